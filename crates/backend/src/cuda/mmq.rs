//! Prefill matmul on the int8 tensor cores (`kernels/mmq.cu`): `out[t][o] = Σ_i W[o][i] · x[t][i]`
//! for more than [`GEMV_MAX_ROWS`] rows and a Q4_K / Q5_K / Q6_K / Q8_0 weight, with x held as
//! the decode GEMV holds it (two int8 planes per 32-element block, x ≈ d·(127·hi + lo),
//! `quant_q8_lane`: the same bits) and the weights' integer quants multiplied exactly.
//!
//! Plan (details in the kernel file's header and `MMQ.md`):
//! - x quantized by the decode GEMV's own kernel (`matmul::quantize_into`, `quant_x_q8`) into
//!   this module's scratch: `[rows][2][n_in]` int8 and per block `(d, d·Σ(127·hi + lo))`
//!   (2.125 B per element written, 4 B read).
//! - `mmq_<type>_n<BN>`: 256 threads (8 warps, 4 × 2) per 128-output × BN-token tile (BN = 128,
//!   or 64 when 128-token tiles leave most SMs idle), K step 64. Each thread decodes half a
//!   row's step of weights to int8 (+ its block scale) into shared memory; x's planes arrive by
//!   `cp.async` in a 3-stage ring. Per 32-block and 16 × 8 tile two `mma.sync m16n8k32
//!   s8.s8.s32` (hi and lo planes; Q6_K: four m16n8k16 for its 16-element scales), the int32
//!   results turned into f32 by the magic-number trick and scaled per (output, token, block).
//!   Weights are read from DRAM about once per call (token tiles fastest in the grid: blocks
//!   that share a weight tile run together), x ~2.1 B per element per output tile from L2.
//! - Why: the bf16 prefill kernel (matmul.rs) has NMSE ~1e-5 per matmul, the decode GEMV ~2e-9;
//!   the difference flips near-tied MoE expert choices between prefill and decode. This path
//!   has the GEMV's precision, and int8 MMAs have twice bf16's throughput.
//!
//! [`matmul`] returns `Ok(false)` (nothing launched) when it does not apply: ≤ GEMV_MAX_ROWS
//! rows, ≤ F32_SMALL_OUT outputs (routers keep the f32 GEMV), another weight type, `n_in` not a
//! multiple of 64, or the path is not switched on: it runs only with `FERRITE_MMQ=1` (see
//! `disabled`).

use std::sync::{Arc, Mutex};

use anyhow::{anyhow, ensure, Context, Result};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr, LaunchConfig};
use ferrite_formats::GgmlType;

use super::launch::{KernelArg, LaunchExt};
use super::matmul::{F32_SMALL_OUT, GEMV_MAX_ROWS};
use super::{function, load_module, CudaBackend, CudaWeight};
use crate::Act;

/// Kernel source.
pub const SRC: &str = include_str!("kernels/mmq.cu");

/// Weight types with an int8 tensor-core kernel, in kernel-name order.
const TYPES: [(GgmlType, &str); 4] = [
    (GgmlType::Q4K, "q4_k"),
    (GgmlType::Q5K, "q5_k"),
    (GgmlType::Q6K, "q6_k"),
    (GgmlType::Q8_0, "q8_0"),
];
/// Outputs per block, K per step, threads per block (MQ_TM, MQ_TK in mmq.cu).
const TM: usize = 128;
const TK: usize = 64;
const THREADS: u32 = 256;
/// Token-tile widths instantiated as `mmq_<type>_n<BN>`, in kernel-array order.
const BN: [usize; 2] = [128, 64];

/// Dynamic shared memory of `mmq_<type>_n<bn>`: two weight stages (128 rows × 80 B + 2 × 128
/// scale pairs) and three x stages (bn rows × 144 B + bn × 16 B of scales).
fn smem(bn: usize) -> usize {
    2 * (TM * 80 + 2 * TM * 8) + 3 * bn * (144 + 16)
}

/// The int8 copy of x (two planes per row) and its block scales.
type XBufs = (CudaSlice<i8>, CudaSlice<f32>);

/// The compiled kernels and the x scratch.
pub struct Kernels {
    /// `mmq_<type>_n128`, `mmq_<type>_n64`, indexed like [`TYPES`].
    mm: Vec<[CudaFunction; 2]>,
    /// The current scratch (grown geometrically) and the smaller ones it replaced, kept alive
    /// because a graph captured earlier (batched serving steps of more than GEMV_MAX_ROWS rows)
    /// may still point at them.
    scratch: Mutex<(Option<XBufs>, Vec<XBufs>)>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self> {
        let m = load_module(ctx, arch, "mmq", SRC)?;
        ctx.bind_to_thread()?;
        let mut mm = Vec::with_capacity(TYPES.len());
        for (_, name) in TYPES {
            let g = |bn: usize| -> Result<CudaFunction> {
                let f = function(&m, &format!("mmq_{name}_n{bn}"))?;
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem(bn) as i32,
                )
                .with_context(|| format!("mmq_{name}_n{bn}: raising the shared-memory limit"))?;
                Ok(f)
            };
            mm.push([g(BN[0])?, g(BN[1])?]);
        }
        Ok(Kernels {
            mm,
            scratch: Mutex::new((None, Vec::new())),
        })
    }
}

/// Whether this path is off: unless `FERRITE_MMQ=1` (read once). Off by default because it
/// measured 1.3–2.1× slower than the bf16 kernel (MMQ.md); what it buys is decode-exact
/// prefill (NMSE ~2e-9 per matmul instead of ~6e-6), which the bf16 path does not need for
/// the prefill/decode gate of the dense models and which is not enough alone for the MoE
/// hybrids while the grouped expert GEMM (moe.cu) is bf16.
fn disabled() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| super::switches::int_or("FERRITE_MMQ", 0) != 1)
}

/// Whether prefill runs decode-exact (`FERRITE_MMQ=1`): this module's int8 GEMM for the
/// dense matmuls, and the MoE experts on the decode's quantized-x kernels (moe.rs).
pub(crate) fn exact_prefill() -> bool {
    !disabled()
}

/// Whether `w` on `rows` rows takes this path (exact prefill on, a kernel for its type and
/// shape): callers with a fused bf16 alternative (mmw's SwiGLU launch) must leave such
/// weights to the plain calls that reach [`matmul`] / [`matmuls`].
pub(crate) fn takes(be: &CudaBackend, w: &CudaWeight, rows: usize) -> bool {
    kernel_index(be, w, rows).is_some()
}

/// Index in [`TYPES`] of the kernel for a `w` on `rows` rows, or `None` when this path does
/// not apply (see the module comment).
fn kernel_index(be: &CudaBackend, w: &CudaWeight, rows: usize) -> Option<usize> {
    if disabled() || rows <= GEMV_MAX_ROWS || w.shape.len() != 2 {
        return None;
    }
    let (n_out, n_in) = (w.shape[0], w.shape[1]);
    if n_out <= F32_SMALL_OUT || n_in == 0 || n_in % TK != 0 {
        return None;
    }
    let ti = TYPES.iter().position(|&(t, _)| t == w.dtype)?;
    // 16-byte loads of Q4_K / Q5_K rows need a 16-byte aligned base (cudaMalloc gives 256).
    let (ptr, _g) = w.data.device_ptr(&be.stream);
    (ptr % 16 == 0).then_some(ti)
}

/// `out = W x` on the int8 tensor cores when this path applies (returns `Ok(false)`, having
/// done nothing, when it does not: the caller runs the bf16/GEMV kernels of matmul.rs).
pub fn matmul(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    // The one-weight group: the shape check and the path decision are matmuls' (a shape
    // error is check_matmul's either way: the fallback of matmul.rs runs it first too).
    matmuls(be, x, &[w], &mut [out])
}

/// `outs[i] = ws[i] x` for weights reading the same x (the Q, K, V projections): x quantized
/// once. Returns `Ok(false)`, having done nothing, unless this path applies to every weight.
pub fn matmuls(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    ws: &[&CudaWeight],
    outs: &mut [&mut Act<CudaSlice<f32>>],
) -> Result<bool> {
    let Some(tis) = super::matmul::group_kernels(x, ws, outs, |w| kernel_index(be, w, x.rows))?
    else {
        return Ok(false);
    };
    let mut guard = quantize(be, x)?;
    let xs = guard
        .0
        .as_mut()
        .ok_or_else(|| anyhow!("mmq: int8 scratch missing"))?;
    for ((w, out), ti) in ws.iter().zip(outs.iter_mut()).zip(tis) {
        launch_mm(be, xs, x.rows, w, ti, out)?;
    }
    Ok(true)
}

/// Quantizes x (`[rows, n_in]`, n_in a multiple of 64) into the scratch (grown first if too
/// small) and returns the scratch locked: the launches that follow read it in stream order.
fn quantize<'a>(
    be: &'a CudaBackend,
    x: &Act<CudaSlice<f32>>,
) -> Result<std::sync::MutexGuard<'a, (Option<XBufs>, Vec<XBufs>)>> {
    let (rows, n_in) = (x.rows, x.cols);
    let n = rows * n_in;
    ensure!(
        n_in % TK == 0 && x.buf.len() >= n,
        "mmq: input [{rows}, {n_in}] is not whole 64-element steps or exceeds its buffer"
    );
    ensure!(
        2 * n <= i32::MAX as usize,
        "mmq: input [{rows}, {n_in}] is too large"
    );
    let mut guard = be
        .mmq
        .scratch
        .lock()
        .map_err(|_| anyhow!("mmq: scratch lock poisoned"))?;
    let (cur, retired) = &mut *guard;
    if cur.as_ref().is_none_or(|(q, _)| q.len() < 2 * n) {
        let cap = n.next_power_of_two();
        let fresh = (
            be.stream.alloc_zeros::<i8>(2 * cap)?,
            be.stream.alloc_zeros::<f32>(cap / 16)?,
        );
        if let Some(old) = cur.replace(fresh) {
            retired.push(old);
        }
    }
    let (q, d) = cur
        .as_mut()
        .ok_or_else(|| anyhow!("mmq: int8 scratch missing"))?;
    // The decode GEMV's quantization of x (the same kernel, so the same bits).
    super::matmul::quantize_into(be, &x.buf, rows, n_in, q, d)?;
    Ok(guard)
}

/// One `mmq_<type>_n<BN>` launch on the quantized x in `xs` (`rows` rows of `w.shape[1]`).
fn launch_mm(
    be: &CudaBackend,
    xs: &XBufs,
    rows: usize,
    w: &CudaWeight,
    ti: usize,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    let (n_out, n_in) = (w.shape[0], w.shape[1]);
    let rb = w.row_bytes();
    ensure!(
        out.rows == rows && out.cols == n_out && out.buf.len() >= rows * n_out,
        "mmq: output [{}, {}] (buffer {}) for [{rows}, {n_in}] x [{n_out}, {n_in}]",
        out.rows,
        out.cols,
        out.buf.len()
    );
    ensure!(
        w.data.len() >= n_out * rb,
        "mmq: weight buffer holds {} bytes, [{n_out}, {n_in}] {} needs {}",
        w.data.len(),
        w.dtype,
        n_out * rb
    );
    ensure!(
        xs.0.len() >= 2 * rows * n_in && xs.1.len() >= rows * n_in / 16,
        "mmq: int8 scratch smaller than [{rows}, {n_in}]"
    );
    ensure!(
        n_out <= i32::MAX as usize && rows * n_out <= isize::MAX as usize,
        "mmq: [{rows}, {n_out}] output too large"
    );
    let gy = n_out.div_ceil(TM);
    ensure!(gy <= 65535, "mmq: {n_out} outputs exceed the grid limit");
    let bn = super::matmul::token_tile(rows, n_out, be.sm_count);
    let bi = BN
        .iter()
        .position(|&b| b == bn)
        .ok_or_else(|| anyhow!("mmq: no kernel for token tile {bn}"))?;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(bn) as u32, gy as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem(bn) as u32,
    };
    let (rb_i, n_out_i, n_in_i, rows_i) = (rb as i64, n_out as i32, n_in as i32, rows as i32);
    // SAFETY: checked above: W holds n_out rows of rb bytes, the scratch rows×n_in quantized
    // values of x (two planes) and their block scales, out rows×n_out floats.
    unsafe {
        be.stream
            .kernel(&be.mmq.mm[ti][bi])
            .arg(&*w.data)
            .arg(&rb_i)
            .arg(&n_out_i)
            .arg(&n_in_i)
            .arg(&xs.0)
            .arg(&xs.1)
            .arg(&rows_i)
            .arg(&mut out.buf)
            .launch(cfg)
    }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_the_h200() {
        for bn in BN {
            assert!(smem(bn) <= 227 * 1024, "{bn}: {}", smem(bn));
        }
        assert_eq!(smem(128), 86016);
    }
}
