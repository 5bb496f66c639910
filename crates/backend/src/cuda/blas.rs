//! cuBLASLt for the dense prefill GEMMs of 16-bit weights (`FERRITE_CUBLASLT`; the o-projection
//! and the down by default, Q, K, V stay on mmw's concatenated tile; MATMUL.md round 101).
//!
//! DESIGN.md allows cuBLASLt for dense bf16/f16 prefill GEMMs and nothing else: decode, the
//! quantized matmuls, attention, norms, MoE and the delta rule stay ours. The case for it is
//! the 4096-input projections of Qwen3-8B F16 at 512 rows, where our wgmma tiles still trail
//! cuBLAS by a fixed cost a tile (MATMUL.md rounds 92–95, H100: Q, K, V 59 µs against 38 as
//! one 6144-output GEMM, O 34 against 26, the down 87 against 72). The gate/up stays on
//! mmw's fused SwiGLU, which also writes the down's 16-bit x (round 96): cuBLASLt has no
//! SwiGLU epilogue, and its unfused gate + up (142 µs) would add the f32 round trip of both
//! outputs that the fused launch (156 µs) never writes.
//!
//! The operands. mmw's launches take x as 16-bit rows of `kp` elements (zero past `n_in`) and
//! the weight as `[n_out, n_in]` rows; they write `y[rows, n_out]` f32. In cuBLASLt's
//! column-major terms: D (`n_out` × `rows`, ld `n_out`) = op(A) · B with A the weight read as
//! an `n_in` × `n_out` matrix (ld `n_in`) transposed, B the x rows as `n_in` × `rows` (ld
//! `kp`); f32 accumulation (`CUBLAS_COMPUTE_32F`) and f32 D, C only where the residual is
//! added in the epilogue (β = 1, C = D in place: `gemms`' `accumulate`). The same products
//! as mmw's kernels, summed in cuBLAS's order: the check's NMSE bound and the argmax gate are
//! what hold it to the CPU reference, as they hold mmw.
//!
//! The algorithm: cuBLASLt's heuristic's first choice, asked once a shape and kept. Two
//! lessons of other engines shape the calls. cuBLASLt picks kernels by the operands'
//! alignment, so the preference pins 16-byte alignment for every operand and a call whose
//! operands are not 16-byte aligned runs mmw instead; and a graph captured around cuBLASLt
//! was not stable across replays with other buffers, so a capturing stream runs mmw too
//! (prefills are not captured today; the guard keeps it so).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Context, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use ferrite_formats::GgmlType;

use super::{CudaBackend, CudaWeight};
use crate::Act;

/// The workspace cuBLASLt may use: NVIDIA's recommendation for Hopper (32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Plans kept at most: one a (weight shape, row count), so a server meeting many prompt
/// lengths would otherwise grow the map without bound. Past it the map is emptied (a plan is
/// the heuristic's answer, made again on the next call of its shape).
const MAX_PLANS: usize = 1024;

/// The alignment pinned in the heuristic's preference and required of every operand at a
/// call, in bytes: 16, the widest vector load cuBLASLt's kernels take.
const ALIGN: u64 = 16;

/// `FERRITE_CUBLASLT` (read once; default 1), a bit mask: bit 0 the single 16-bit prefill
/// matmuls on cuBLASLt (the o-projection, the down after the fused SwiGLU), bit 1 the grouped
/// ones (Q, K, V: one GEMM a weight). 0 leaves every one on mmw.
///
/// The default is bit 0 alone (MATMUL.md round 101, H100, Qwen3-8B F16 pp512): with Q, K, V on
/// the concatenated tile (`FERRITE_MMW_TA_CAT=1`) the o-projection and the down on cuBLASLt
/// gained 0.8–0.9% in four pairs; Q, K, V as three cuBLASLt GEMMs (bit 1) gained nothing
/// against mmw's grouped launch and lose to the concatenated tile.
pub(crate) fn mode() -> i64 {
    static MODE: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| super::switches::int_or("FERRITE_CUBLASLT", 1))
}

/// Answers asked of cuBLASLt's heuristic a shape (it returns them best first).
const HEURISTIC_CANDIDATES: usize = 8;

/// `FERRITE_CUBLASLT_ALGO` (read once; default 0, the heuristic's first answer): which of the
/// heuristic's answers a plan takes (past the last: the last). A tuning diagnostic (MATMUL.md
/// round 103): `check --perf --eager` of a shape under each value times the alternatives.
fn algo_pick() -> usize {
    static PICK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PICK.get_or_init(|| super::switches::int_or("FERRITE_CUBLASLT_ALGO", 0).clamp(0, 7) as usize)
}

/// A GEMM's shape: what its descriptors and its algorithm depend on.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Shape {
    bf16: bool,
    n_out: usize,
    n_in: usize,
    rows: usize,
    /// x's row stride in elements.
    kp: usize,
}

/// The descriptors and the algorithm of one [`Shape`], made once.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by Plan::new and is destroyed once, here.
        unsafe {
            for l in [self.a, self.b, self.d] {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn cublas(what: &str) -> impl FnOnce(lt::CublasError) -> anyhow::Error + '_ {
    move |e| anyhow!("cuBLASLt {what}: {e:?}")
}

impl Plan {
    fn new(handle: sys::cublasLtHandle_t, s: Shape) -> Result<Self> {
        let t16 = if s.bf16 {
            sys::cudaDataType::CUDA_R_16BF
        } else {
            sys::cudaDataType::CUDA_R_16F
        };
        let f32t = sys::cudaDataType::CUDA_R_32F;
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t)
            .map_err(cublas("matmul descriptor"))?;
        // Built field by field so that Drop frees whatever was made if a later step fails.
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            // SAFETY: a plain-data struct; overwritten by the heuristic's choice below.
            algo: unsafe { std::mem::zeroed() },
        };
        // cublasOperation_t's CUBLAS_OP_T (the bindings name the enum only through cublas).
        let trans: i32 = 1;
        // SAFETY: desc is live; the attribute is the operation enum (an int), passed by size.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&trans) as *const _ as *const _,
                std::mem::size_of_val(&trans),
            )
        }
        .map_err(cublas("transposed A"))?;
        plan.a = lt::create_matrix_layout(t16, s.n_in as u64, s.n_out as u64, s.n_in as i64)
            .map_err(cublas("weight layout"))?;
        plan.b = lt::create_matrix_layout(t16, s.n_in as u64, s.rows as u64, s.kp as i64)
            .map_err(cublas("x layout"))?;
        plan.d = lt::create_matrix_layout(f32t, s.n_out as u64, s.rows as u64, s.n_out as i64)
            .map_err(cublas("output layout"))?;
        let pref = lt::create_matmul_pref().map_err(cublas("preference"))?;
        let chosen = (|| {
            // SAFETY: pref is live; each attribute is passed by its documented type's size.
            unsafe {
                let ws = WORKSPACE_BYTES as u64;
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&ws) as *const _ as *const _,
                    std::mem::size_of_val(&ws),
                )?;
                for attr in [
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ] {
                    let a = ALIGN as u32;
                    let size = std::mem::size_of_val(&a);
                    lt::set_matmul_pref_attribute(pref, attr, (&a) as *const _ as *const _, size)?;
                }
                // C is D's layout (read where β = 1, in place: gemms' `accumulate`). Up to
                // HEURISTIC_CANDIDATES answers, best first; `FERRITE_CUBLASLT_ALGO` picks one.
                let mut found: [sys::cublasLtMatmulHeuristicResult_t; HEURISTIC_CANDIDATES] =
                    std::mem::zeroed();
                let mut count = 0i32;
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    desc,
                    plan.a,
                    plan.b,
                    plan.d,
                    plan.d,
                    pref,
                    HEURISTIC_CANDIDATES as i32,
                    found.as_mut_ptr(),
                    &mut count,
                )
                .result()?;
                let usable: Vec<_> = found[..count.clamp(0, HEURISTIC_CANDIDATES as i32) as usize]
                    .iter()
                    .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                    .copied()
                    .collect();
                let pick = usable
                    .get(algo_pick().min(usable.len().saturating_sub(1)))
                    .copied()
                    .ok_or(lt::CublasError(
                        sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
                    ))?;
                tracing::debug!(
                    "cuBLASLt: {} algorithms for {s:?}, taking number {}",
                    usable.len(),
                    algo_pick().min(usable.len().saturating_sub(1))
                );
                Ok::<_, lt::CublasError>(pick)
            }
        })();
        // SAFETY: pref was created above and is not used after.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let chosen = chosen.map_err(cublas("algorithm heuristic"))?;
        plan.algo = chosen.algo;
        tracing::debug!(
            "cuBLASLt plan for {s:?}: workspace {} bytes, {} waves",
            chosen.workspaceSize,
            chosen.wavesCount
        );
        Ok(plan)
    }
}

/// A cuBLASLt handle, its workspace and the plans made so far (`None`: a shape whose plan could
/// not be made, left to mmw).
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<Shape, Option<Plan>>>,
}

// SAFETY: the handle, the workspace and the plans' descriptors are used only under `plans`'
// lock (plan making and every cublasLtMatmul call), so one thread at a time.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: the handle was created by Lt::new and is destroyed once, here.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Lt {
    /// The handle and workspace (made by [`gemms`] at the first GEMM that takes them); `None`
    /// when the library is not installed, an error when it does not start: mmw then runs every
    /// prefill GEMM. Its absence is a warning only where `FERRITE_CUBLASLT` was set by hand
    /// (the default's gain is under 1%, not worth alarming a user whose CUDA install lacks the
    /// library).
    fn new(stream: &Arc<CudaStream>) -> Result<Option<Self>> {
        // SAFETY: only probes for the shared library.
        if !unsafe { sys::is_culib_present() } {
            let msg = "libcublasLt was not found: the 16-bit prefill GEMMs stay on mmw";
            if matches!(super::switches::get("FERRITE_CUBLASLT"), Ok(Some(_))) {
                tracing::warn!("FERRITE_CUBLASLT is set but {msg}");
            } else {
                tracing::debug!("{msg}");
            }
            return Ok(None);
        }
        stream.context().bind_to_thread()?;
        let handle = lt::create_handle().map_err(cublas("handle"))?;
        let workspace = match stream.alloc_zeros::<u8>(WORKSPACE_BYTES) {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created just above, not used after.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(e).context("cuBLASLt workspace");
            }
        };
        Ok(Some(Lt {
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
        }))
    }
}

/// `outs[i] = x · ws[i]ᵀ` (with `accumulate`, `outs[i] += x · ws[i]ᵀ`: β = 1 and C = D, the
/// residual added in cuBLASLt's epilogue, MATMUL.md round 102) by cuBLASLt, one GEMM a weight,
/// for x in `xb` (`rows` 16-bit rows of
/// `kp` elements, the type of `t16`) where [`mode`] takes this group (a single weight under
/// bit 0, a group under bit 1), every weight is `t16` in device memory, every operand is
/// [`ALIGN`]ed, every buffer holds its shape and the stream is not capturing. `Ok(false)`,
/// nothing done, otherwise (mmw's launch then runs, with its own checks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemms<X: DevicePtr<u16>>(
    be: &CudaBackend,
    xb: &X,
    kp: usize,
    rows: usize,
    ws: &[&CudaWeight],
    outs: &mut [&mut Act<CudaSlice<f32>>],
    t16: GgmlType,
    accumulate: bool,
) -> Result<bool> {
    let bit = if ws.len() == 1 { 1 } else { 2 };
    if mode() & bit == 0 {
        return Ok(false);
    }
    let aligned = |p: u64| p.is_multiple_of(ALIGN);
    let (xp, _gx) = xb.device_ptr(&be.stream);
    let applies = matches!(t16, GgmlType::F16 | GgmlType::BF16)
        && ws.len() == outs.len()
        && aligned(xp)
        && aligned(kp as u64 * 2)
        && xb.len() >= rows * kp
        && ws.iter().zip(outs.iter()).all(|(w, o)| {
            let (n_out, n_in) = (w.shape[0], w.shape[1]);
            w.dtype == t16
                && !w.in_host_memory()
                && n_in <= kp
                && aligned(n_in as u64 * 2)
                && aligned(n_out as u64 * 4)
                && w.data.len() >= n_out * n_in * 2
                && aligned(w.data.device_ptr(&be.stream).0)
                && aligned(o.buf.device_ptr(&be.stream).0)
                && o.rows == rows
                && o.cols == n_out
                && o.buf.len() >= rows * n_out
        });
    if !applies {
        return Ok(false);
    }
    if be.stream.capture_status()?
        != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    {
        return Ok(false);
    }
    // Made here, at the first GEMM that takes it (never under capture: the workspace is an
    // allocation). One that cannot start leaves this backend's prefill GEMMs on mmw.
    let made = be.blas.get_or_init(|| {
        Lt::new(&be.stream).unwrap_or_else(|e| {
            tracing::warn!("cuBLASLt did not start ({e:#}): the 16-bit prefill GEMMs stay on mmw");
            None
        })
    });
    let Some(ltx) = made.as_ref() else {
        return Ok(false);
    };
    let mut plans = ltx
        .plans
        .lock()
        .map_err(|_| anyhow!("cuBLASLt plans: lock poisoned"))?;
    let shapes: Vec<Shape> = ws
        .iter()
        .map(|w| Shape {
            bf16: t16 == GgmlType::BF16,
            n_out: w.shape[0],
            n_in: w.shape[1],
            rows,
            kp,
        })
        .collect();
    // Every plan before any GEMM, so that a shape cuBLASLt cannot plan leaves the whole call
    // to mmw (with one warning a shape) rather than failing the prefill, now that it is on by
    // default.
    for &s in &shapes {
        if plans.len() >= MAX_PLANS && !plans.contains_key(&s) {
            plans.clear();
        }
        if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(s) {
            e.insert(Plan::new(ltx.handle, s).map_or_else(
                |err| {
                    tracing::warn!("no cuBLASLt plan for {s:?} ({err:#}): it stays on mmw");
                    None
                },
                Some,
            ));
        }
    }
    let Some(chosen) = shapes
        .iter()
        .map(|s| plans.get(s).and_then(Option::as_ref))
        .collect::<Option<Vec<&Plan>>>()
    else {
        return Ok(false);
    };
    for ((w, out), plan) in ws.iter().zip(outs.iter_mut()).zip(chosen) {
        let (wp, _gw) = w.data.device_ptr(&be.stream);
        let (op, _go) = out.buf.device_ptr_mut(&be.stream);
        let (wsp, _gws) = ltx.workspace.device_ptr(&be.stream);
        // β = 1: D = acc + C in f32, C = D in place (the same layout, which cuBLASLt requires
        // of an in-place C) — the sum add_rms_norm would form of this output and the residual.
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // A GEMM writes an activation as a kernel would: counted as a launch, so that a
        // 16-bit x handed over before it is not taken for one handed over after it.
        super::launch::note_write();
        // SAFETY: the plan's layouts describe these buffers (checked above: the weight holds
        // n_out · n_in 16-bit values, x rows · kp, out rows · n_out floats); the workspace is
        // WORKSPACE_BYTES, the preference's bound; the stream is the backend's one stream.
        unsafe {
            lt::matmul(
                ltx.handle,
                plan.desc,
                (&alpha) as *const f32 as *const _,
                (&beta) as *const f32 as *const _,
                wp as *const _,
                plan.a,
                xp as *const _,
                plan.b,
                op as *const _,
                plan.d,
                op as *mut _,
                plan.d,
                &plan.algo,
                wsp as *mut _,
                WORKSPACE_BYTES,
                be.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(cublas("matmul"))?;
    }
    Ok(true)
}
