//! Matmul launchers (`kernels/matmul.cu`): `out[t][o] = Σ_i W[o][i] · x[t][i]` for a 2-D
//! weight `[n_out, n_in]` stored in any ggml type, read straight from its GGUF blocks.
//!
//! - rows ≤ [`GEMV_MAX_ROWS`]: the memory-bound decode/verify GEMV (each output is bitwise
//!   independent of how many rows come along): `gemvq_<type>_r<R>` for the quantized types
//!   (x quantized to int8 per 32 elements by `quant_x_q8`, dp4a dot products), `gemv_<type>_r<R>`
//!   in f32 for the float types and for small-output matrices (MoE routers).
//! - more rows: `mm_<type>`, the prefill matmul on the tensor cores (bf16 inputs, f32
//!   accumulation), dequantizing weight tiles on the fly.
//!
//! The plans, bytes moved and precision are in the kernel file's header and `MATMUL.md`.

use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig,
};
use ferrite_formats::quant::k_quants::QK_K;
use ferrite_formats::GgmlType;

use super::launch::{KernelArg, LaunchExt};
use super::{function, load_module, switches, CudaBackend, CudaWeight};
use crate::Act;

/// Kernel source.
pub const SRC: &str = include_str!("kernels/matmul.cu");

/// Largest row count served by the f32 GEMV; more rows go to the tensor-core kernel.
///
/// 16 rather than 8: speculative verify runs K+1 rows (K ≤ 8 draft tokens → up to 9), and
/// it must run the same kernel as plain decode (rows = 1) so that greedy output with MTP is
/// token-identical to plain greedy decode. The GEMV gives bitwise the same value for a row
/// whatever R it is launched with; the bf16 tensor-core kernel would not match it. Cost: the
/// f32 GEMV becomes FMA-bound rather than bandwidth-bound above ~4 rows (see MATMUL.md).
pub const GEMV_MAX_ROWS: usize = 16;

/// Matrices with at most this many outputs (MoE routers: 8–256 experts) always run the f32
/// GEMV, 16 rows per launch, also at prefill: the routing decision is a discrete argmax-like
/// choice, and bf16 inputs would flip near-tied experts between prefill and decode. Because
/// the GEMV is bitwise independent of the row count, a token's router logits are then
/// identical whether it arrives in a prompt or alone. The cost is negligible (the router is
/// `n_experts × hidden`). Such launches prefetch their whole span into L2 before the PDL
/// wait (`GEMV_SMALL_OUT` in matmul.cu, the same number).
pub const F32_SMALL_OUT: usize = 256;

/// Row counts the GEMV is instantiated for (rows round up to the next one).
/// 9 = speculative verify of 8 draft tokens (K + 1), which would otherwise pad to 16.
const GEMV_R: [usize; 6] = [1, 2, 4, 8, 9, 16];
/// Warps per GEMV block and output rows per warp (GEMV_WARPS, GEMV_NW in matmul.cu).
const GEMV_WARPS: usize = 8;
pub(crate) const GEMV_NW: usize = 2;
/// Resident-warp goal per SM for the float GEMV's split-K choice (Little's law: ~30 KB in
/// flight per SM at ~0.5–1 KB per warp). 32, not 64: the 4096-row F16 projections then split
/// K 4 ways instead of 8 (twice the steps per warp, half the cross-warp reductions): synth
/// Qwen3-8B F16 tg128 225.9 → 231.3 (MATMUL.md round 15; 16 lost: 212.5).
/// `FERRITE_GEMV_WARPS` overrides it (a tuning switch).
const GEMV_TARGET_WARPS_PER_SM: usize = 32;
/// Prefill tile: outputs per block, K per step, smem row stride in bf16, threads per block
/// (MM_TM, MM_TK, MM_LDS in matmul.cu). Tokens per block (BN) are 128 or 64, chosen by shape.
const MM_TM: usize = 128;
pub(crate) const MM_TK: usize = 64;
const MM_LDS: usize = 72;
const MM_THREADS: u32 = 256;
/// Token-tile widths instantiated as `mm_<type>_n<BN>`, in kernel-array order.
const MM_BN: [usize; 2] = [128, 64];

/// Dynamic shared memory of `mm_<type>_n<bn>`: two stages of the bf16 A and B tiles.
fn mm_smem(bn: usize) -> usize {
    2 * (MM_TM + bn) * MM_LDS * 2
}

/// Weight types in kernel-name order (the `<type>` of `gemv_<type>_*`, `mm_<type>_*` and the
/// MoE kernels).
pub(crate) const TYPES: [(GgmlType, &str); 9] = [
    (GgmlType::F32, "f32"),
    (GgmlType::F16, "f16"),
    (GgmlType::BF16, "bf16"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q4K, "q4_k"),
    (GgmlType::Q5K, "q5_k"),
    (GgmlType::Q6K, "q6_k"),
];

/// The MoE decode kernels that take a shared expert (`Kernels::gemvq_moe_shared`): the Q4_K
/// gate/up on the tile (`gemvq_moe_gu_tcs_q4_k`, where `gemvq_moe_gu_tc` is loaded), the
/// lane-code gate/up (`gemvq_moe_gus_<type>`) and the down + combine (`gemvq_moe_downs4_<type>`)
/// by [`TYPES`] index, None for the types without one.
pub(crate) struct MoeSharedKernels {
    pub(crate) gu_tc: Option<CudaFunction>,
    pub(crate) gu: Vec<Option<CudaFunction>>,
    pub(crate) down: Vec<Option<CudaFunction>>,
}

/// The compiled matmul kernels, indexed like [`TYPES`].
pub struct Kernels {
    gemv: Vec<[CudaFunction; 6]>,
    /// `gemv_<type>_rows`: the 16-row GEMV over every 16-row chunk of a prefill in one launch
    /// (grid y = the chunk), for small-output weights such as the MoE routers.
    gemv_rows: Vec<CudaFunction>,
    /// `gemv_f32_xs_j1` and `_j2`: f32 small-output weights at prefill with x held in the
    /// lanes' registers (the same sums as `gemv_f32_rows`, where each lane's chain reads one or
    /// two quads: [`xs_plan`]); `None` under `FERRITE_GEMV_ROWS_XS=0`.
    gemv_f32_xs: Option<[CudaFunction; 2]>,
    /// `gemv_swiglu_<type>_r<R>` (float types only: the quantized ones use gemvq_swiglu).
    gemv_swiglu: Vec<Option<[CudaFunction; 6]>>,
    /// `gemv_multi_<type>_r<R>`: 2–3 weights in one launch on f32 x (float types; the
    /// quantized types' small-output weights).
    gemv_multi: Vec<[CudaFunction; 6]>,
    /// The deferred-RMSNorm and residual-add float GEMVs (float types only): `gemv_norm_`,
    /// `gemv_add_`, `gemv_swiglu_norm_`, `gemv_multi_norm_<type>_r<R>` ([`rms_norm_matmuls`],
    /// [`matmul_add`]).
    gemv_deferred: Vec<Option<[[CudaFunction; 6]; 4]>>,
    /// Whether decode takes them (`FERRITE_DEFER_NORM`, on by default; MATMUL.md round 23).
    pub(crate) defer_norm: bool,
    /// `gemvq_<type>_r<R>`, `gemvq_swiglu_<type>_r<R>`, `gemvq_multi_<type>_r<R>`
    /// (quantized types only).
    gemvq: Vec<Option<[[CudaFunction; 6]; 3]>>,
    /// `gemvq_multi_<a>_<b>_r<R>`: a grouped launch of two weights of type a and a third of
    /// type b (the pairs of [`GEMVQ_MIXED`]).
    gemvq_mixed: Vec<(GgmlType, GgmlType, [CudaFunction; 6])>,
    /// The tensor-core forms of the Q4_K and Q6_K quantized-x GEMVs (`gemvq_tc_<type>_r<R>`,
    /// the `_swiglu_tc` / `_multi_tc` families, and the mixed `gemvq_multi_tc_q4_k_q6_k_r<R>`):
    /// launches whose 16-row tile fits [`GEMVQ_TC_MAX_SMEM`] on sm_90+ (MATMUL.md rounds 8
    /// and 9). None before sm_90 or with `FERRITE_GEMV_TC=0`.
    gemvq_tc: Option<TcKernels>,
    /// `gemvq_tc2_add_q4_k_r<R>` and `gemvq_swiglu_tcn_q4_k_r<R>`: the FFN's RMSNorm handed
    /// from the Q4_K o-projection to the SwiGLU ([`matmul_add_for_norm`]; sm_90+, unless
    /// `FERRITE_DEFER_NORM_Q=0`).
    tc2: Option<[[CudaFunction; 6]; 2]>,
    /// `gemvq_swiglu_tcnw4_q4_k_r1` (MATMUL.md round 49; `FERRITE_SWIGLU_W4=0`: None): the
    /// one-row SwiGLU of `tc2` in blocks of four warps.
    swiglu_w4: Option<CudaFunction>,
    /// `add_norm_planes`: the two-tile kernel's epilogue alone, after the plain GEMV, for more
    /// than [`TC2_MAX_ROWS`] rows.
    add_norm_planes: CudaFunction,
    /// The planes, scales and group Σ x² that `gemvq_tc2_add_q4_k` writes for the SwiGLU.
    xqn: Mutex<Option<NormPlanes>>,
    /// `gemvq_swiglu_n_q8_0_r<R>`: the Q8_0 SwiGLU (lane code) on the handed-over FFN norm,
    /// its producer the plain o-projection and `add_norm_planes` (sm_90+, with `tc2`;
    /// `FERRITE_DEFER_NORM_Q8`, on by default; MATMUL.md round 41).
    swiglu_n_q8_0: Option<[CudaFunction; 6]>,
    /// `gemvq_add_n_q8_0_r1`: its one-row producer in 32-row blocks (`FERRITE_DEFER_NORM_Q8=2`,
    /// the default; for more rows, or with 1, the plain GEMV and `add_norm_planes`).
    add_n_q8_0: Option<CudaFunction>,
    /// The grouped Q, K, V kernels on the attention input's handed-over norm
    /// ([`hands_norm_to_qkv`]; sm_90+, `FERRITE_NORM_QKV` ≠ 0).
    qkv_norm: Option<QkvNorm>,
    /// `gemvq_tckn_q4_k_r1`: the K-split Q4_K down projection's pair tickets
    /// (`FERRITE_NORM_QKV=2`, the default).
    tckn: Option<CudaFunction>,
    /// `gemvq_tckw4_q4_k_r1` (MATMUL.md round 50; `FERRITE_TCK_W4=2`): the plain one-row
    /// K-split Q4_K tile in blocks of four warps (the eight-warp kernel's bits). Off by
    /// default (−0.9% on Qwen3.5-9B).
    tck_w4: Option<CudaFunction>,
    /// `gemvq_tcknw4_q4_k_r1` (`FERRITE_TCK_W4` ≥ 1, the default): `tckn` in blocks of four
    /// warps (Qwen3-8B +1.1%).
    tckn_w4: Option<CudaFunction>,
    /// The Q8_0 down projection's pair tickets on its K-split tile (MATMUL.md round 54):
    /// `gemvq_tcknw4_q8_0_r1` (`FERRITE_TCK_W4` ≥ 1) or `gemvq_tckn_q8_0_r1`; None without
    /// the Q8_0 K-split tile (`FERRITE_GEMV_TCK_Q8=0`) or `FERRITE_NORM_QKV=0`; with whether
    /// it is the four-warp one.
    tckn_q8: Option<(CudaFunction, bool)>,
    /// `gemvq_swiglu_tcnp_q8_0_r1` (MATMUL.md round 57; `FERRITE_SWIGLU_PIPE`, on by
    /// default): the one-row Q8_0 SwiGLU on the handed-over norm as a ring of that many
    /// tensor-core tiles per persistent block; None: the lane code.
    swiglu_pipe: Option<(CudaFunction, usize)>,
    /// `FERRITE_SWIGLU_QH` (on by default; MATMUL.md round 63): the ring also writes h's int8
    /// planes into the GEMV scratch for the down projection (no quant_x launch between them).
    swiglu_qh: bool,
    /// `gemvq_multi_tcv_q4_k_q6_k_r<R>` and `gemvq_multi_tcnv_q4_k_q6_k_r1` (MATMUL.md round
    /// 51; `FERRITE_QKV_VTC`): the mixed Q, K, V launches (plain, on the handed-over norm)
    /// with the Q6_K V on the tensor-core tile too. None: V on the lane code. With
    /// `FERRITE_QKV_VFIRST` (on by default; round 52) the one-row pair is
    /// `gemvq_multi_tcvf_q4_k_q6_k_r1` / `gemvq_multi_tcnvf_q4_k_q6_k_r1`, the same launches
    /// with the V tiles dispatched first (the same bits).
    qkv_vtc: Option<([CudaFunction; 6], CudaFunction)>,
    /// How rows too long for the 16-row tensor-core tile are done (`FERRITE_GEMV_TC`, a
    /// tuning switch).
    gemvq_tc_long: TcLong,
    /// Most columns per K slice of the long rows, Q4_K and Q6_K ([`TCK_COLS`]).
    gemvq_tck_cols: [usize; 2],
    /// The same for Q8_0's long rows ([`TCK_Q8_COLS`], `FERRITE_GEMV_TCK_Q8`; 0: the lane code).
    gemvq_tck_q8_cols: usize,
    /// Fewest outputs for the Q6_K 16-row tile ([`GEMVQ_TC_Q6K_MIN_OUT`];
    /// `FERRITE_GEMV_TC6_MIN`).
    gemvq_tc6_min: usize,
    /// The K-split tile's partial sums and tickets (`TcLong::Split`), grown like the int8
    /// scratch (by an eager step; retired buffers kept for graphs that still point at them).
    tck: Mutex<Option<TckScratch>>,
    /// `gemvq_moe_gu_<type>`, `gemvq_moe_down_<type>`: MoE decode experts (launched by moe.rs).
    pub(crate) gemvq_moe: Vec<Option<[CudaFunction; 2]>>,
    /// Their dynamic shared-memory limit: `moe::MOE_BULK_MAX_SMEM` where raising it at load
    /// succeeded, else `moe::MOE_BULK_DEFAULT_SMEM`.
    pub(crate) gemvq_moe_smem: usize,
    /// `gemvq_moe_gu_tc_q4_k`: the Q4_K gate/up experts on the tensor-core tile (sm_90+,
    /// unless `FERRITE_MOE_TC=0`); moe.rs sizes its shared memory to match.
    pub(crate) gemvq_moe_gu_tc: Option<CudaFunction>,
    /// The same with Qwen3.5's shared expert as every token's last pair, and the down +
    /// combine that adds it with its gate (moe.rs `moe_shared`, MOE.md; unless
    /// `FERRITE_MOE_SHARED=0`).
    pub(crate) gemvq_moe_shared: Option<MoeSharedKernels>,
    /// Whether the MoE gate/up blocks prefetch their experts' down rows into L2 (matmul.cu
    /// `moe_down_prefetch`; on unless `FERRITE_MOE_PF=0`).
    pub(crate) moe_down_prefetch: bool,
    /// x f32 → int8 blocks of 32 with (scale, scaled sum), run before the quantized GEMV.
    quant_x: CudaFunction,
    /// The token-major Q4_K GEMV (matmul.cu section 1f, MATMUL.md round 78) for plain Q4_K
    /// matmuls of up to GEMV_MAX_ROWS rows where `FERRITE_GEMV_TM=1` (an experiment: off by
    /// default), and its scratch.
    tm: Option<TmKernels>,
    tm_scratch: Mutex<Option<TmScratch>>,
    /// `quant_x_q8`'s `early` argument: 1 (unless `FERRITE_QX_EARLY=0`), the GEMV after it
    /// launched before its own wait (MATMUL.md round 25).
    quant_x_early: i32,
    /// Whether the quantized-x GEMV takes its bulk-copy form ([`gemvq_split`]): sm_90 and
    /// later (also the test of moe.rs `prefetch`, whose L2 prefetches are bulk operations).
    pub(crate) bulk: bool,
    /// Bulk-copy quantized-x launches keep to one wave where larger blocks let them
    /// ([`one_wave_split`]; on unless `FERRITE_GEMV_ONE_WAVE=0`).
    one_wave: bool,
    /// Per type (by [`type_index`]): the blocks per SM its lane-code launches' waves are
    /// reckoned with — [`GEMVQ_WAVE_BLOCKS_PER_SM`], or with `FERRITE_GEMV_ONE_WAVE=2` (an
    /// experiment) the R = 1 plain kernel's own occupancy by its registers (Q8_0: four).
    wave_blocks_per_sm: Vec<usize>,
    /// Float GEMV runs of large-output weights group at the launch's split ([`matmuls`];
    /// on unless `FERRITE_GEMV_GROUP=0`: F16 tg128 +0.8%, MATMUL.md round 15).
    group_float: bool,
    /// The int8 copy of x and its block scales, sized for GEMV_MAX_ROWS rows of the widest
    /// input seen; grown only by an eager (first) step, never inside a captured one.
    xq: Mutex<Option<XQuant>>,
    /// `mm_<type>_n128`, `mm_<type>_n64` (see [`MM_BN`]).
    mm: Vec<[CudaFunction; 2]>,
    /// x f32 → bf16 scratch (zero-padded to whole K steps), run before every prefill matmul
    /// (this module's and mmw.rs's).
    pub(crate) mm_x: CudaFunction,
    /// The bf16 copy of x, grown on demand (geometrically), and the smaller buffers it
    /// replaced: kept alive because a graph captured earlier (batched serving steps of more
    /// than GEMV_MAX_ROWS rows run this path inside graphs) may still point at them.
    xb: Mutex<BfScratch>,
    /// What the 16-bit x scratch holds and which form the prefill last converted x to
    /// ([`XbState`]).
    xb_state: Mutex<XbState>,
}

/// The prefill's 16-bit x forms: bf16 (`mm_x_bf16`, every weight type but the TA form's F16)
/// and f16 (`mmw_x_f16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum X16 {
    Bf16,
    F16,
}

/// The x scratch's hand-over (`FERRITE_NORM_X16`): `src` is (x's device address, rows, cols,
/// the launch count right after the producer, form) where the launch just issued wrote x's
/// 16-bit rows into the scratch as the conversion would (ops.rs add_rms_norm); only the next
/// launch's conversion of that x, in that form, is then skipped. `last`: the form of the last
/// conversion, the one a producer writes (a model's prefill matmuls all take one form).
/// `f32_missing`: the producer left x's f32 rows unwritten (its readers all take the 16-bit
/// ones: ops.rs `x16_only`), so a conversion of that x instead of the hand-over is an error.
#[derive(Default)]
struct XbState {
    src: Option<(u64, usize, usize, u64, X16)>,
    f32_missing: bool,
    last: Option<X16>,
}

/// `FERRITE_NORM_X16` (read once; default 1): a prefill's add + RMSNorm also writes its h as
/// the 16-bit x of the matmuls that read h next (Q, K, V; gate/up), which then skip their
/// conversion launch (MATMUL.md round 98: pp512 +0.8% on Qwen3-8B F16, +1.9% on Q4_K_M, an
/// H100). The norm's switch (ops.rs add_rms_norm); each producer has its own.
pub(crate) fn norm_x16() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| switches::int_or("FERRITE_NORM_X16", 1) != 0)
}

/// The 16-bit x scratch, locked, for a producer of `[rows, cols]` that can write it in the
/// form the prefill last converted to: prefill rows, whole 64-column K steps (no padding to
/// zero), a scratch already large enough (never grown here).
pub(crate) struct XbProducer<'a> {
    guard: std::sync::MutexGuard<'a, BfScratch>,
    pub(crate) kind: X16,
}

impl XbProducer<'_> {
    pub(crate) fn buf(&mut self) -> Result<&mut CudaSlice<u16>> {
        self.guard
            .0
            .as_mut()
            .ok_or_else(|| anyhow!("matmul: x scratch missing"))
    }

    /// Records that the launch just issued wrote `x`'s 16-bit rows, and whether it left x's
    /// f32 rows unwritten (`f32_missing`). (A poisoned state lock records nothing: the consumer
    /// then converts, as without the hand-over; a producer that leaves the f32 rows unwritten
    /// checks the record first, [`XbProducer::recordable`].)
    pub(crate) fn record(
        &self,
        be: &CudaBackend,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        f32_missing: bool,
    ) {
        let (ptr, _g) = x.device_ptr(&be.stream);
        if let Ok(mut st) = be.matmul.xb_state.lock() {
            st.src = Some((ptr, rows, cols, super::launch::launch_count(), self.kind));
            st.f32_missing = f32_missing;
        }
    }

    /// Whether [`XbProducer::record`] can record (the state lock is not poisoned): a producer
    /// may leave x's f32 rows unwritten only where it can.
    pub(crate) fn recordable(&self, be: &CudaBackend) -> bool {
        be.matmul.xb_state.lock().is_ok()
    }
}

/// The 16-bit x scratch, locked (always before [`lock_xb_state`] where both are held).
fn lock_xb(be: &CudaBackend) -> Result<std::sync::MutexGuard<'_, BfScratch>> {
    be.matmul
        .xb
        .lock()
        .map_err(|_| anyhow!("matmul: bf16 scratch lock poisoned"))
}

/// What the 16-bit x scratch holds ([`XbState`]), locked.
fn lock_xb_state(be: &CudaBackend) -> Result<std::sync::MutexGuard<'_, XbState>> {
    be.matmul
        .xb_state
        .lock()
        .map_err(|_| anyhow!("matmul: x scratch state lock poisoned"))
}

/// [`XbProducer`] for `[rows, cols]`, or `None` where it does not apply. (Whether a producer
/// hands over at all is its own switch: [`norm_x16`], attention.rs `attn_x16`.)
pub(crate) fn xb_for_producer(
    be: &CudaBackend,
    rows: usize,
    cols: usize,
) -> Result<Option<XbProducer<'_>>> {
    if rows <= GEMV_MAX_ROWS || !cols.is_multiple_of(MM_TK) {
        return Ok(None);
    }
    let Some(kind) = lock_xb_state(be)?.last else {
        return Ok(None);
    };
    let guard = lock_xb(be)?;
    Ok(guard
        .0
        .as_ref()
        .is_some_and(|b| b.len() >= rows * cols)
        .then_some(XbProducer { guard, kind }))
}

/// The bf16 copy of x for the prefill matmuls (`mm_` here, `mmw`): the buffer in use and the
/// smaller ones it replaced.
type BfScratch = (Option<CudaSlice<u16>>, Vec<CudaSlice<u16>>);

/// How much of its weight rows the float GEMV prefetches into L2 before its PDL wait
/// (`gemv_pf_mode` in matmul.cu): 0 nothing, 1 each row's head (`GEMV_PF_HEAD`; the whole
/// span for launches of at most `F32_SMALL_OUT` outputs), 2 the block's whole span.
/// `FERRITE_GEMV_PF` overrides the default (a tuning switch: MATMUL.md, "F16 decode
/// regression", round 21).
const GEMV_PF_DEFAULT: i32 = 1;

/// Bytes of each row's head that prefetch mode 1 fetches into L2 (`FERRITE_GEMV_PF_HEAD`
/// overrides it: a tuning switch). 512: F16 tg128 +0.4–0.7% over 1024 in three calls
/// (MATMUL.md round 17); 2048 and more lose.
const GEMV_PF_HEAD: usize = 512;

fn set_gemv_switches(ctx: &Arc<CudaContext>, m: &Arc<CudaModule>) -> Result<()> {
    let stream = ctx.default_stream();
    let set = |name: &str, value: i32| -> Result<()> {
        let mut sym = m.get_global(name, &stream)?;
        // SAFETY: the symbols set here are 4-byte `__constant__ int`s (matmul.cu).
        let mut v = unsafe { sym.transmute_mut::<i32>(1) }
            .with_context(|| format!("{name} is not an int"))?;
        stream.memcpy_htod(&[value], &mut v)?;
        Ok(())
    };
    let mode = switches::get("FERRITE_GEMV_PF")?.map_or(GEMV_PF_DEFAULT, |v| v[0] as i32);
    set("gemv_pf_mode", mode)?;
    let head = switches::int_or("FERRITE_GEMV_PF_HEAD", GEMV_PF_HEAD as i64) as i32;
    set("gemv_pf_head", head)?;
    // Diagnostic (MATMUL.md round 8): 1 = the bulk GEMV copies but does not compute,
    // 2 = computes on whatever shared memory holds without copying, 3 = copies and computes
    // without waiting (then waits before exiting). Wrong outputs for 1-3: timing only.
    let diag = switches::get("FERRITE_GEMV_DIAG")?.map_or(0, |v| v[0] as i32);
    set("gemv_diag", diag)?;
    set(
        "gemv_l2ef",
        switches::int_or("FERRITE_L2_EVICT_FIRST", 1) as i32,
    )?;
    set(
        "gemv_add_n_px",
        switches::int_or("FERRITE_ADD_N_PX", 1) as i32,
    )?;
    stream.synchronize()?;
    Ok(())
}

/// The instantiations `<prefix>_r<R>` of a decode kernel, one per [`GEMV_R`]; with `bulk`
/// (the bulk-copy GEMVs on sm_90+) their shared-memory limit raised to
/// [`GEMVQ_BULK_MAX_SMEM`].
fn per_r(m: &Arc<CudaModule>, prefix: &str, bulk: bool) -> Result<[CudaFunction; 6]> {
    let fs = GEMV_R
        .iter()
        .map(|r| {
            let name = format!("{prefix}_r{r}");
            if bulk {
                function_smem(m, &name, GEMVQ_BULK_MAX_SMEM)
            } else {
                function(m, &name)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    fs.try_into()
        .map_err(|_| anyhow!("{prefix}: not one kernel per GEMV_R size"))
}

/// The kernel `name` with its dynamic shared-memory limit raised to `smem` bytes.
fn function_smem(m: &Arc<CudaModule>, name: &str, smem: usize) -> Result<CudaFunction> {
    let f = function(m, name)?;
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .with_context(|| format!("{name}: raising the shared-memory limit"))?;
    Ok(f)
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self> {
        let m = load_module(ctx, arch, "matmul", SRC)?;
        ctx.bind_to_thread()?;
        let mut gemv = Vec::with_capacity(TYPES.len());
        let mut gemv_rows = Vec::with_capacity(TYPES.len());
        let mut mm = Vec::with_capacity(TYPES.len());
        let mut gemvq = Vec::with_capacity(TYPES.len());
        let mut gemvq_moe = Vec::with_capacity(TYPES.len());
        let mut gemv_swiglu = Vec::with_capacity(TYPES.len());
        let mut gemv_multi = Vec::with_capacity(TYPES.len());
        let mut gemv_deferred = Vec::with_capacity(TYPES.len());
        // Bulk copies (cp.async.bulk): sm_90 and later (matmul.cu compiles the bulk-copy
        // GEMV for them, the register-load one before).
        let bulk = arch.starts_with("compute_9") || arch.starts_with("compute_1");
        // The MoE down kernel's rows per pass of a warp (FERRITE_MOE_DOWN_NW: 2 or 4; MOE.md).
        let down = match switches::int_or("FERRITE_MOE_DOWN_NW", 4) {
            2 => "gemvq_moe_down_",
            _ => "gemvq_moe_down4_",
        };
        for (ty, name) in TYPES {
            gemvq_moe.push(if quantized_x(ty) {
                Some([
                    function(&m, &format!("gemvq_moe_gu_{name}"))?,
                    function(&m, &format!("{down}{name}"))?,
                ])
            } else {
                None
            });
            gemv.push(per_r(&m, &format!("gemv_{name}"), false)?);
            gemv_rows.push(function(&m, &format!("gemv_{name}_rows"))?);
            gemv_swiglu.push(if quantized_x(ty) {
                None
            } else {
                Some(per_r(&m, &format!("gemv_swiglu_{name}"), false)?)
            });
            gemv_multi.push(per_r(&m, &format!("gemv_multi_{name}"), false)?);
            gemv_deferred.push(if quantized_x(ty) {
                None
            } else {
                let all = |kind: &str| per_r(&m, &format!("gemv{kind}_{name}"), false);
                Some([
                    all("_norm")?,
                    all("_add")?,
                    all("_swiglu_norm")?,
                    all("_multi_norm")?,
                ])
            });
            gemvq.push(if quantized_x(ty) {
                let all = |kind: &str| per_r(&m, &format!("gemvq{kind}_{name}"), bulk);
                Some([all("")?, all("_swiglu")?, all("_multi")?])
            } else {
                None
            });
            let g = |bn: usize| function_smem(&m, &format!("mm_{name}_n{bn}"), mm_smem(bn));
            mm.push([g(MM_BN[0])?, g(MM_BN[1])?]);
        }
        let mut gemvq_mixed = Vec::with_capacity(GEMVQ_MIXED.len());
        for &(a, b) in GEMVQ_MIXED {
            let (na, nb) = (TYPES[type_index(a)?].1, TYPES[type_index(b)?].1);
            gemvq_mixed.push((a, b, per_r(&m, &format!("gemvq_multi_{na}_{nb}"), bulk)?));
        }
        // The tensor-core GEMVs: on unless FERRITE_GEMV_TC=0 (a tuning switch; 2 and 3 change
        // the long rows, TcLong).
        let tc = switches::get("FERRITE_GEMV_TC")?.map_or(1, |v| v[0]);
        let tc_on = tc >= 1;
        let gemvq_tc_long = match tc {
            2 => TcLong::Full,
            3 => TcLong::Half,
            _ => TcLong::Split,
        };
        let one_wave = switches::int_or("FERRITE_GEMV_ONE_WAVE", 1);
        let wave_blocks_per_sm = gemvq
            .iter()
            .map(|fams| match (one_wave, fams) {
                (2, Some(f)) => f[0][0]
                    .occupancy_max_active_blocks_per_multiprocessor(
                        (GEMV_WARPS * 32) as u32,
                        0,
                        None,
                    )
                    .map_or(GEMVQ_WAVE_BLOCKS_PER_SM, |b| (b as usize).max(1)),
                _ => GEMVQ_WAVE_BLOCKS_PER_SM,
            })
            .collect();
        let gemvq_tck_cols =
            switches::get("FERRITE_GEMV_TCK")?.map_or(TCK_COLS, |v| [v[0] as usize, v[1] as usize]);
        let gemvq_tck_q8_cols =
            usize::try_from(switches::int_or("FERRITE_GEMV_TCK_Q8", TCK_Q8_COLS as i64))?;
        let gemvq_tc = if bulk && tc_on {
            let all = |kind: &str| per_r(&m, &format!("gemvq{kind}"), true);
            let mut fams = Vec::with_capacity(TC_TYPES.len());
            let mut half = Vec::with_capacity(TC_TYPES.len());
            let mut split = Vec::with_capacity(TC_TYPES.len());
            let mut tct = Vec::with_capacity(TC_TYPES.len());
            for t in TC_TYPES {
                let name = TYPES[type_index(t)?].1;
                fams.push((
                    t,
                    [
                        Some(all(&format!("_tc_{name}"))?),
                        Some(all(&format!("_swiglu_tc_{name}"))?),
                        Some(all(&format!("_multi_tc_{name}"))?),
                    ],
                ));
                half.push((t, all(&format!("_tch_{name}"))?));
                split.push((t, all(&format!("_tck_{name}"))?));
                let f = function_smem(&m, &format!("gemvq_tct_{name}_r1"), GEMVQ_BULK_MAX_SMEM)?;
                tct.push((t, f));
            }
            // Q5_K has the 16-row tile (gemvq_tc_q4k's Q5; MATMUL.md round 69) and, with
            // FERRITE_GEMV_TC5=2, its two-tile block at three blocks per SM, with 3 (default)
            // also at two (4096 columns); 0: the lane code. Rows too long for the tile take
            // the lane code.
            let tc5 = switches::int_or("FERRITE_GEMV_TC5", 3);
            if tc5 >= 2 {
                let f = function_smem(&m, "gemvq_tct_q5_k_r1", GEMVQ_BULK_MAX_SMEM)?;
                tct.push((GgmlType::Q5K, f));
            }
            if tc5 != 0 {
                // The plain family alone: its SwiGLU and grouped launches keep the lane code.
                fams.push((GgmlType::Q5K, [Some(all("_tc_q5_k")?), None, None]));
            }
            // Q8_0 has the K-split tile alone (its long rows: tc_form).
            if gemvq_tck_q8_cols != 0 {
                split.push((GgmlType::Q8_0, all("_tck_q8_0")?));
            }
            Some(TcKernels {
                fams,
                half,
                split,
                tct,
                tct_on: switches::int_or("FERRITE_GEMV_TCT", 1) != 0,
                tct5_max_smem: if tc5 >= 3 {
                    TCT5_WIDE_SMEM
                } else {
                    TCT_MAX_SMEM
                },
                mixed: all("_multi_tc_q4_k_q6_k")?,
            })
        } else {
            None
        };
        let tc2 = if gemvq_tc.is_some() && switches::int_or("FERRITE_DEFER_NORM_Q", 1) != 0 {
            let all = |kind: &str| per_r(&m, &format!("gemvq{kind}"), true);
            // FERRITE_TC2_PX=1: the form that loads its epilogue's residual and norm weight early.
            let add = if switches::int_or("FERRITE_TC2_PX", 1) != 0 {
                "_tc2_addx_q4_k"
            } else {
                "_tc2_add_q4_k"
            };
            Some([all(add)?, all("_swiglu_tcn_q4_k")?])
        } else {
            None
        };
        let defer_q8 = if tc2.is_some() {
            // 2 (default): the 32-row producer at one row; 1: the plain GEMV + add_norm_planes
            // everywhere; 0: off (MATMUL.md round 41).
            switches::int_or("FERRITE_DEFER_NORM_Q8", 2)
        } else {
            0
        };
        let swiglu_n_q8_0 = if defer_q8 != 0 {
            Some(per_r(&m, "gemvq_swiglu_n_q8_0", true)?)
        } else {
            None
        };
        let add_n_q8_0 = if defer_q8 == 2 {
            Some(function_smem(&m, "gemvq_add_n_q8_0_r1", ADD_N_MAX_SMEM)?)
        } else {
            None
        };
        // FERRITE_NORM_QKV=2 (default): the K-split Q4_K down's pair tickets (MATMUL.md round
        // 42); 0 off.
        let norm_qkv = gemvq_tc.is_some() && switches::int_or("FERRITE_NORM_QKV", 2) != 0;
        let tckn = if norm_qkv && tc2.is_some() {
            Some(function_smem(
                &m,
                "gemvq_tckn_q4_k_r1",
                GEMVQ_BULK_MAX_SMEM,
            )?)
        } else {
            None
        };
        // The one-row K-split Q4_K tile in blocks of four warps (round 50): FERRITE_TCK_W4=1
        // (default) the pair-ticket kernel, 2 also the plain one, 0 neither.
        let tck_w4_on = if gemvq_tc.is_some() {
            switches::int_or("FERRITE_TCK_W4", 1)
        } else {
            0
        };
        let w4_kernel = |on: bool, name: &str| -> Result<Option<CudaFunction>> {
            on.then(|| function_smem(&m, name, GEMVQ_BULK_MAX_SMEM))
                .transpose()
        };
        let tck_w4 = w4_kernel(tck_w4_on >= 2, "gemvq_tckw4_q4_k_r1")?;
        let tckn_w4 = w4_kernel(tck_w4_on >= 1 && tckn.is_some(), "gemvq_tcknw4_q4_k_r1")?;
        let tckn_q8 = if tckn.is_some() && gemvq_tck_q8_cols != 0 {
            let w4 = tck_w4_on >= 1;
            let name = if w4 {
                "gemvq_tcknw4_q8_0_r1"
            } else {
                "gemvq_tckn_q8_0_r1"
            };
            Some((function_smem(&m, name, GEMVQ_BULK_MAX_SMEM)?, w4))
        } else {
            None
        };
        // FERRITE_SWIGLU_PIPE=nb: the one-row Q8_0 SwiGLU ring's tiles (round 57; 0: the lane
        // code).
        let swiglu_nb = usize::try_from(switches::int_or(
            "FERRITE_SWIGLU_PIPE",
            SWIGLU_PIPE_NB as i64,
        ))?;
        let swiglu_pipe = if swiglu_n_q8_0.is_some() && gemvq_tc.is_some() && swiglu_nb >= 1 {
            Some((
                function_smem(&m, "gemvq_swiglu_tcnp_q8_0_r1", PIPE_MAX_SMEM)?,
                swiglu_nb.min(PIPE_MAX_NB),
            ))
        } else {
            None
        };
        let swiglu_qh = switches::int_or("FERRITE_SWIGLU_QH", 1) == 1;
        // FERRITE_QKV_VTC=1: the mixed Q, K, V launches' Q6_K V on the tensor cores (round 51);
        // FERRITE_QKV_VFIRST=1 (default): at one row, the forms with their V tiles first
        // (round 52).
        let qkv_vtc = if gemvq_tc.is_some() && switches::int_or("FERRITE_QKV_VTC", 1) != 0 {
            let vf = if switches::int_or("FERRITE_QKV_VFIRST", 1) != 0 {
                "f"
            } else {
                ""
            };
            let mut plain = per_r(&m, "gemvq_multi_tcv_q4_k_q6_k", true)?;
            plain[0] = function_smem(
                &m,
                &format!("gemvq_multi_tcv{vf}_q4_k_q6_k_r1"),
                GEMVQ_BULK_MAX_SMEM,
            )?;
            let norm = function_smem(
                &m,
                &format!("gemvq_multi_tcnv{vf}_q4_k_q6_k_r1"),
                GEMVQ_BULK_MAX_SMEM,
            )?;
            Some((plain, norm))
        } else {
            None
        };
        let qkv_norm = if norm_qkv {
            let one = |name: &str| function_smem(&m, name, GEMVQ_BULK_MAX_SMEM);
            Some(QkvNorm {
                q4_k: one("gemvq_multi_tcn_q4_k_r1")?,
                q4_k_q6_k: one("gemvq_multi_tcn_q4_k_q6_k_r1")?,
                q8_0: one("gemvq_multi_n_q8_0_r1")?,
            })
        } else {
            None
        };
        let mm_x = function(&m, "mm_x_bf16")?;
        set_gemv_switches(ctx, &m)?;
        // The tensor-core gate/up of Q4_K experts (sm_90+), unless FERRITE_MOE_TC=0.
        let gemvq_moe_gu_tc = if bulk && switches::int_or("FERRITE_MOE_TC", 1) != 0 {
            Some(function(&m, "gemvq_moe_gu_tc_q4_k")?)
        } else {
            None
        };
        // The shared expert inside those launches (gate/up: Q4_K on the tile, the types
        // below on the lane code; downs of the types below), unless FERRITE_MOE_SHARED=0.
        let gemvq_moe_shared = if bulk && switches::int_or("FERRITE_MOE_SHARED", 1) != 0 {
            let each = |prefix: &str, types: &[GgmlType]| -> Result<Vec<Option<CudaFunction>>> {
                TYPES
                    .iter()
                    .map(|(ty, name)| {
                        types
                            .contains(ty)
                            .then(|| function(&m, &format!("{prefix}{name}")))
                            .transpose()
                    })
                    .collect()
            };
            use GgmlType::{Q4K, Q5K, Q6K, Q8_0};
            Some(MoeSharedKernels {
                gu_tc: gemvq_moe_gu_tc
                    .is_some()
                    .then(|| function(&m, "gemvq_moe_gu_tcs_q4_k"))
                    .transpose()?,
                gu: each("gemvq_moe_gus_", &[Q5K, Q6K, Q8_0])?,
                down: each("gemvq_moe_downs4_", &[Q4K, Q5K, Q6K, Q8_0])?,
            })
        } else {
            None
        };
        // The MoE expert kernels' bulk-copy limit (moe.rs): raised here with every other
        // kernel's; where that fails they keep what a launch gets without opting in.
        let raised = gemvq_moe
            .iter()
            .flatten()
            .flatten()
            .chain(&gemvq_moe_gu_tc)
            .chain(gemvq_moe_shared.iter().flat_map(|k| {
                k.gu_tc
                    .iter()
                    .chain(k.gu.iter().flatten())
                    .chain(k.down.iter().flatten())
            }))
            .all(|f| {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    super::moe::MOE_BULK_MAX_SMEM as i32,
                )
                .is_ok()
            });
        let gemvq_moe_smem = if raised {
            super::moe::MOE_BULK_MAX_SMEM
        } else {
            super::moe::MOE_BULK_DEFAULT_SMEM
        };
        let gemv_f32_xs = if switches::int_or("FERRITE_GEMV_ROWS_XS", 1) != 0 {
            Some([
                function(&m, "gemv_f32_xs_j1")?,
                function(&m, "gemv_f32_xs_j2")?,
            ])
        } else {
            None
        };
        Ok(Kernels {
            gemv,
            gemv_rows,
            gemv_f32_xs,
            gemv_swiglu,
            gemv_multi,
            gemv_deferred,
            defer_norm: switches::int_or("FERRITE_DEFER_NORM", 1) != 0,
            gemvq,
            gemvq_mixed,
            gemvq_tc,
            swiglu_w4: if tc2.is_some() && switches::int_or("FERRITE_SWIGLU_W4", 1) != 0 {
                Some(function_smem(
                    &m,
                    "gemvq_swiglu_tcnw4_q4_k_r1",
                    GEMVQ_BULK_MAX_SMEM,
                )?)
            } else {
                None
            },
            tc2,
            add_norm_planes: function(&m, "add_norm_planes")?,
            xqn: Mutex::new(None),
            swiglu_n_q8_0,
            add_n_q8_0,
            qkv_norm,
            tckn,
            tck_w4,
            tckn_w4,
            tckn_q8,
            swiglu_pipe,
            swiglu_qh,
            qkv_vtc,
            gemvq_tc_long,
            gemvq_tck_cols,
            gemvq_tck_q8_cols,
            gemvq_tc6_min: usize::try_from(switches::int_or(
                "FERRITE_GEMV_TC6_MIN",
                GEMVQ_TC_Q6K_MIN_OUT as i64,
            ))?,
            tck: Mutex::new(None),
            gemvq_moe,
            gemvq_moe_smem,
            gemvq_moe_gu_tc,
            gemvq_moe_shared,
            moe_down_prefetch: switches::int_or("FERRITE_MOE_PF", 1) != 0,
            quant_x: function(&m, "quant_x_q8")?,
            tm: if switches::int_or("FERRITE_GEMV_TM", 0) != 0 {
                Some(TmKernels {
                    quant: function(&m, "quant_x_q8s")?,
                    gemv: [
                        function(&m, "gemv_tm_q4k_r8")?,
                        function(&m, "gemv_tm_q4k_r16")?,
                    ],
                })
            } else {
                None
            },
            tm_scratch: Mutex::new(None),
            quant_x_early: i32::from(switches::int_or("FERRITE_QX_EARLY", 1) != 0),
            bulk,
            one_wave: bulk && one_wave != 0,
            wave_blocks_per_sm,
            group_float: switches::int_or("FERRITE_GEMV_GROUP", 1) != 0,
            xq: Mutex::new(None),
            mm,
            mm_x,
            xb: Mutex::new((None, Vec::new())),
            xb_state: Mutex::new(XbState::default()),
        })
    }
}

/// Activations quantized per 32 elements (`quant_x_q8`): two int8 planes per row (x ≈
/// d·(127·hi + lo)) and, per block, (scale d, d · Σ(127·hi + lo)) as two f32.
pub(crate) struct XQuant {
    pub(crate) q: CudaSlice<i8>,
    pub(crate) d: CudaSlice<f32>,
    /// Elements per row the buffers are laid out for (rows are `n_in` apart).
    cap: usize,
    /// Smaller scratches replaced by a grow, kept alive: a graph captured earlier may still
    /// point at them (`lock_grown`).
    retired: Vec<XQuant>,
    /// What the scratch holds when a producer kernel quantized its output here (the fused
    /// add_rms_norm, ops.rs): (that output's device address, rows, cols, the launch count
    /// right after it). A GEMV on exactly that input with no launch in between skips its
    /// own quantization (same bits: both run `quant_q8_lane`).
    pub(crate) src: Option<(u64, usize, usize, u64)>,
}

impl XQuant {
    /// Records that the kernel just launched also quantized its output `out` (`[rows, cols]`)
    /// here, for the GEMV that reads `out` next (see `src`).
    pub(crate) fn record_producer(
        &mut self,
        be: &CudaBackend,
        out: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) {
        let (ptr, _g) = out.device_ptr(&be.stream);
        self.src = Some((ptr, rows, cols, super::launch::launch_count()));
    }
}

/// Keeps x's int8 planes valid (`XQuant::src`) across one float GEMV launch on x, which
/// writes neither x nor the int8 scratch (the MoE router between the norm that quantized x
/// and the experts that read the planes). On drop: if the planes were valid for x right
/// before, and exactly one launch happened since, they are recorded valid after it.
struct KeepXq<'a> {
    be: &'a CudaBackend,
    x: (u64, usize, usize),
    before: u64,
}

impl<'a> KeepXq<'a> {
    fn new(be: &'a CudaBackend, x: &Act<CudaSlice<f32>>) -> Self {
        let (ptr, _g) = x.buf.device_ptr(&be.stream);
        KeepXq {
            be,
            x: (ptr, x.rows, x.cols),
            before: super::launch::launch_count(),
        }
    }
}

impl Drop for KeepXq<'_> {
    fn drop(&mut self) {
        let now = super::launch::launch_count();
        if now != self.before + 1 {
            return;
        }
        // try_lock: `matmuls` holds the scratch while it runs a float GEMV of its group (a
        // small-output quantized weight next to quantized-x ones), and a blocking lock here
        // would wait on this very thread forever. Held, the planes simply stay unrecorded
        // (the next consumer quantizes x again: correct, one launch slower).
        if let Ok(mut g) = self.be.matmul.xq.try_lock() {
            if let Some(xq) = g.as_mut() {
                let (p, r, c) = self.x;
                if xq.src == Some((p, r, c, self.before)) {
                    xq.src = Some((p, r, c, now));
                }
            }
        }
    }
}

/// Weight types whose decode GEMV runs on int8-quantized activations (dp4a). The float types
/// keep the f32 GEMV: they are bandwidth-bound already and gain nothing from it.
pub fn quantized_x(t: GgmlType) -> bool {
    matches!(
        t,
        GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
    )
}

pub(crate) fn type_index(t: GgmlType) -> Result<usize> {
    TYPES
        .iter()
        .position(|&(ty, _)| ty == t)
        .ok_or_else(|| anyhow::anyhow!("CUDA matmul: unsupported weight type {t}"))
}

/// K steps of a GEMV lane loop (32 lanes' units each) for a row of `n_in` elements: the
/// most warps that can usefully split one row (must follow the step loops of matmul.cu).
fn gemv_steps(t: GgmlType, n_in: usize) -> usize {
    let units = match t {
        GgmlType::F32 if n_in.is_multiple_of(4) => n_in / 4,
        GgmlType::F16 | GgmlType::BF16 if n_in.is_multiple_of(4) => n_in / 4,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => n_in,
        GgmlType::Q8_0 => n_in / 32 * 8,
        GgmlType::Q4_0 | GgmlType::Q4_1 => n_in / 32 * 4,
        // K-quants: one super-block per warp step.
        _ => return n_in / 256,
    };
    units.div_ceil(32)
}

/// [`gemv_steps`] for the quantized-x GEMV, whose lane unit is 32 elements (32-element
/// blocks: a block per lane; K-quants: 8 lanes per super-block, 4 super-blocks per warp step).
fn gemvq_steps(t: GgmlType, n_in: usize) -> usize {
    match t {
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => (n_in / 256).div_ceil(4),
        _ => (n_in / 32).div_ceil(32),
    }
}

/// Rows of x a `gemv_f32_xs` block holds (XS_RB in matmul.cu) and outputs a k-group takes a
/// batch (XS_OB).
const XS_RB: usize = 8;
const XS_OB: usize = 4;
/// Outputs a `gemv_f32_xs` k-group streams past its rows: 16 (Qwen3-30B-A3B's router, 128
/// outputs at ks = 8: 8 × 64 blocks at pp512, x read 8 times instead of 64).
const XS_OPB: usize = 16;

/// `gemv_f32_xs_j<J>`'s plan for an f32 small-output weight at ks: (J, outputs a k-group), where
/// each lane's chain reads exactly J ≤ 2 quads (n_in = 128 ks J), or `None` (gemv_f32_rows).
fn xs_plan(t: GgmlType, n_in: usize, n_out: usize, ks: usize) -> Option<(usize, usize)> {
    if t != GgmlType::F32 || !n_in.is_multiple_of(4 * 32 * ks) {
        return None;
    }
    let j = n_in / (4 * 32 * ks);
    let opb = XS_OPB.min(n_out.next_multiple_of(XS_OB));
    (1..=2).contains(&j).then_some((j, opb))
}

/// Warps splitting the K dimension of one GEMV row group (1, 2, 4 or 8 = GEMV_WARPS), for
/// rows of `steps` warp steps in a launch of `groups` row groups: the fewest that give
/// `GEMV_TARGET_WARPS_PER_SM` warps per SM, capped by the steps a row has. A function of the
/// shape only, never of the row count: the reduction order of an output (lane chains,
/// butterfly, then the ks warp totals in warp order) must not depend on R.
fn split_k(steps: usize, groups: usize, sm_count: usize) -> usize {
    static TARGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let target = *TARGET.get_or_init(|| {
        switches::int_or("FERRITE_GEMV_WARPS", GEMV_TARGET_WARPS_PER_SM as i64) as usize
    });
    let want = target * sm_count.max(1);
    let mut ks = 1;
    while ks < GEMV_WARPS && 2 * ks <= steps && groups * ks < want {
        ks *= 2;
    }
    ks
}

/// Largest weight span one block of the bulk-copy quantized-x GEMV holds in shared memory
/// (matmul.cu, `gemv_bulk_prologue`): two such blocks fit in an H200 SM's 228 KB.
const GEMVQ_BULK_MAX_SMEM: usize = 112 * 1024;

/// The shared memory a bulk-copy GEMV block aims at: the split grows until the block's slots
/// fit (or ks = GEMV_WARPS). 40 KB keeps 4096-column rows whole per warp (16 rows of Q4_K, 37
/// KB) and splits the 12288-column down projections 4–8 ways, so their blocks finish sooner
/// after their copy lands (MATMUL.md round 5: Qwen3-8B Q4_K_M tg128 +4% over 112 KB).
/// `FERRITE_GEMVQ_SMEM` (KB) overrides it (a tuning switch).
const GEMVQ_BLOCK_SMEM: usize = 40 * 1024;

fn gemvq_block_smem() -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| match switches::int_or("FERRITE_GEMVQ_SMEM", 0) {
        0 => GEMVQ_BLOCK_SMEM,
        kb => (kb as usize * 1024).min(GEMVQ_BULK_MAX_SMEM),
    })
}

/// The K split and dynamic shared memory of a quantized-x GEMV launch over `groups` row
/// groups of rows of `rb` bytes, `spans` weights per row group (1, or 2 for the fused
/// SwiGLU's gate and up rows). Before sm_90: the register-load form, split by [`split_k`],
/// no shared memory. On sm_90+ the kernel always takes its bulk-copy form: the fewest splits
/// whose slots (per weight: the block's rows, rounded up to 16 bytes, + 16 for the
/// alignment offset; `gemv_slot` in matmul.cu) fit in [`GEMVQ_BULK_MAX_SMEM`]. A function of
/// the shape only, never of the row count (see `split_k`).
fn gemvq_split(
    be: &CudaBackend,
    t: GgmlType,
    n_in: usize,
    rb: usize,
    groups: usize,
    spans: usize,
) -> Result<(usize, u32)> {
    if !be.matmul.bulk {
        return Ok((split_k(gemvq_steps(t, n_in), groups, be.sm_count), 0));
    }
    let cap = gemvq_block_smem();
    let mut ks = 1;
    while ks <= GEMV_WARPS {
        let bytes = gemvq_block_bytes(ks, spans, rb);
        if bytes <= cap || (ks == GEMV_WARPS && bytes <= GEMVQ_BULK_MAX_SMEM) {
            return Ok(if be.matmul.one_wave {
                let per_sm = be.matmul.wave_blocks_per_sm[type_index(t)?];
                one_wave_split(
                    be.sm_count,
                    per_sm,
                    0,
                    groups,
                    spans,
                    rb,
                    (ks, bytes as u32),
                )
            } else {
                (ks, bytes as u32)
            });
        }
        ks *= 2;
    }
    bail!("quantized GEMV: rows of {rb} bytes ({t}, {n_in} columns) do not fit in shared memory")
}

/// The shared memory of a bulk-copy quantized-x GEMV block split `ks` ways (GEMV_WARPS / ks
/// row groups of GEMV_NW rows, `spans` weights each): per weight its rows of `rb` bytes,
/// rounded up to 16 bytes, + 16 for the alignment offset (`gemv_slot` in matmul.cu).
fn gemvq_block_bytes(ks: usize, spans: usize, rb: usize) -> usize {
    let rows = GEMV_WARPS / ks * GEMV_NW / spans;
    spans * ((rows * rb).div_ceil(16) * 16 + 16)
}

/// Blocks per SM that a wave of a bulk-copy quantized-x GEMV launch is reckoned with: the R = 1
/// register bound of the K-quant forms' 256-thread blocks (73–85 registers: three blocks; Q8_0's
/// lane code at 58–60 fits four, so for it the rule is conservative — MATMUL.md round 26). The
/// same for every R: a split must not depend on the rows, or decode and verify would differ in
/// the outputs' bits.
const GEMVQ_WAVE_BLOCKS_PER_SM: usize = 3;

/// Shared memory of an SM, and what each block takes beyond its dynamic slots (the 1 KB the
/// driver reserves per block, the kernels' static shared memory).
const SM_SMEM: usize = 228 * 1024;
const BLOCK_SMEM_EXTRA: usize = 3 * 1024;

/// The split of a bulk-copy quantized-x GEMV launch (`groups` row groups of rows of `rb`
/// bytes, `spans` weights per group, after `lead` blocks of other segments; `per_sm` blocks
/// per SM by registers, fewer where their shared memory allows fewer) kept to one wave
/// where it can be: `single` ([`gemvq_split`]'s (ks, bytes)) unless with it the launch needs
/// more blocks than one wave holds while fewer, larger blocks (up to [`GEMVQ_BULK_MAX_SMEM`])
/// fit one; then the most blocks that do. A second wave of a few blocks runs after the first
/// one's compute, with nothing left to overlap its copies: Qwen3-8B Q4_K_M's mixed QKV
/// launch (256 + 64 + 128 blocks of V's 8-row split for 396 slots) took 6.3 µs against the
/// all-Q4_K launch's 3.5 (DECODE_STEP.md).
fn one_wave_split(
    sm_count: usize,
    per_sm: usize,
    lead: usize,
    groups: usize,
    spans: usize,
    rb: usize,
    single: (usize, u32),
) -> (usize, u32) {
    let blocks = |ks: usize| lead + groups.div_ceil(GEMV_WARPS / ks);
    let slots = |bytes: usize| sm_count * per_sm.min(SM_SMEM / (bytes + BLOCK_SMEM_EXTRA));
    if blocks(single.0) <= slots(single.1 as usize) {
        return single;
    }
    (1..single.0)
        .rev()
        .filter(|ks| single.0.is_multiple_of(*ks))
        .map(|ks| (ks, gemvq_block_bytes(ks, spans, rb)))
        .find(|&(ks, bytes)| bytes <= GEMVQ_BULK_MAX_SMEM && blocks(ks) <= slots(bytes))
        .map_or(single, |(ks, bytes)| (ks, bytes as u32))
}

/// Index in [`GEMV_R`] of the instantiation serving `rows` decode rows (rows round up to the
/// next instantiated size).
fn gemv_r_index(rows: usize) -> Result<usize> {
    GEMV_R
        .iter()
        .position(|&r| r >= rows)
        .ok_or_else(|| anyhow!("GEMV: {rows} rows (at most {GEMV_MAX_ROWS})"))
}

/// Row groups of a GEMV launch over `n_out` consecutive rows (GEMV_NW rows per group).
fn row_groups(n_out: usize) -> usize {
    n_out.div_ceil(GEMV_NW)
}

/// The K split of the f32 GEMV on a `[n_out, n_in]` F32 weight at one decode row (what
/// [`matmul`] launches): the fused norm + router kernel (ops.rs, `add_rms_norm_matmul`)
/// repeats its row groups exactly, so it must split the same way.
pub(crate) fn f32_gemv_split(be: &CudaBackend, n_out: usize, n_in: usize) -> usize {
    split_k(
        gemv_steps(GgmlType::F32, n_in),
        row_groups(n_out),
        be.sm_count,
    )
}

/// The launch of `groups` row groups split `ks` ways (GEMV_WARPS / ks groups per block).
fn gemv_config(groups: usize, ks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (groups.div_ceil(GEMV_WARPS / ks) as u32, 1, 1),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `out[t] = W x[t]` for a weight `[n_out, n_in]` of any stored type.
pub fn matmul(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    let (n_out, n_in) = crate::check_matmul(x, &w.shape, out)?;
    let rows = x.rows;
    if rows == 0 || n_out == 0 {
        return Ok(());
    }
    ensure!(
        n_in > 0,
        "matmul: weight {:?} has no input columns",
        w.shape
    );
    let ti = type_index(w.dtype)?;
    let bs = w.dtype.block_size();
    ensure!(
        n_in % bs == 0,
        "matmul: {} rows of {n_in} elements are not whole blocks of {bs}",
        w.dtype
    );
    let rb = w.row_bytes();
    ensure!(
        w.data.len() >= n_out * rb,
        "matmul: weight buffer holds {} bytes, [{n_out}, {n_in}] {} needs {}",
        w.data.len(),
        w.dtype,
        n_out * rb
    );
    ensure!(
        x.buf.len() >= rows * n_in && out.buf.len() >= rows * n_out,
        "matmul: activation buffers smaller than their shapes"
    );
    ensure!(
        n_in <= i32::MAX as usize && n_out <= i32::MAX as usize && rows <= i32::MAX as usize,
        "matmul: shape [{rows}, {n_in}] x [{n_out}, {n_in}] too large"
    );
    // The kernels use 16-byte loads on rows whose length is a multiple of 16 bytes; that needs
    // a 16-byte aligned base (cudaMalloc gives 256).
    {
        let (ptr, _sync) = w.data.device_ptr(&be.stream);
        ensure!(
            ptr % 16 == 0,
            "matmul: weight buffer is not 16-byte aligned"
        );
    }
    let rb = rb as i64;

    if rows > GEMV_MAX_ROWS && n_out <= F32_SMALL_OUT {
        // The 16-row GEMV's arithmetic for every row (routing stays the decode's), every
        // 16-row chunk of x a grid row of one launch.
        let groups = row_groups(n_out);
        let ks = split_k(gemv_steps(w.dtype, n_in), groups, be.sm_count);
        let chunks = rows.div_ceil(GEMV_MAX_ROWS);
        ensure!(
            chunks <= 65_535,
            "matmul: {rows} rows exceed the small-output GEMV's grid"
        );
        if let (Some(xs), Some((j, opb))) =
            (&be.matmul.gemv_f32_xs, xs_plan(w.dtype, n_in, n_out, ks))
        {
            // Block (x, y): rows XS_RB y.. of x in registers, outputs of GEMV_WARPS / ks
            // k-groups of opb each.
            let per_block = GEMV_WARPS / ks * opb;
            let cfg = LaunchConfig {
                grid_dim: (
                    n_out.div_ceil(per_block) as u32,
                    rows.div_ceil(XS_RB) as u32,
                    1,
                ),
                block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            ensure!(
                rows.div_ceil(XS_RB) <= 65_535,
                "matmul: {rows} rows exceed the small-output GEMV's grid"
            );
            // (The rows past n_out that a k-group's last batch computes read the last row.)
            return float_gemv(be, &xs[j - 1], w, x, out, ks, cfg, Some(opb as i32));
        }
        let mut cfg = gemv_config(groups, ks);
        cfg.grid_dim.1 = chunks as u32;
        // Block (x, y) reads rows 16 y .. min(16 y + 16, rows) of x and writes those of out.
        return float_gemv(be, &be.matmul.gemv_rows[ti], w, x, out, ks, cfg, None);
    }

    if let Some(tm) = &be.matmul.tm {
        if rows <= GEMV_MAX_ROWS
            && w.dtype == GgmlType::Q4K
            && n_out > F32_SMALL_OUT
            && n_in % QK_K == 0
        {
            return tm_launch(be, tm, x, w, out);
        }
    }

    if rows <= GEMV_MAX_ROWS && uses_gemvq(w, rows) {
        let xq = quantize_x(be, x)?;
        let xq = xq
            .as_ref()
            .ok_or_else(|| anyhow!("matmul: int8 scratch missing"))?;
        return gemvq_launch(be, xq, w, None, out, rows);
    }

    if rows <= GEMV_MAX_ROWS {
        let ri = gemv_r_index(rows)?;
        let groups = row_groups(n_out);
        let ks = split_k(gemv_steps(w.dtype, n_in), groups, be.sm_count);
        let _keep = KeepXq::new(be, x);
        let cfg = gemv_config(groups, ks);
        return float_gemv(be, &be.matmul.gemv[ti][ri], w, x, out, ks, cfg, None);
    }
    mm_launch(be, x, w, out, ti, rb, n_out, n_in, rows)
}

/// One launch of a float-x GEMV kernel (`gemv_<type>_*`, the deferred forms) whose caller
/// checked the shapes and buffers, with K split `ks` ways (`opb`: `gemv_f32_xs_j*`'s extra
/// argument).
#[allow(clippy::too_many_arguments)]
fn float_gemv(
    be: &CudaBackend,
    func: &CudaFunction,
    w: &CudaWeight,
    x: &Act<CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
    ks: usize,
    cfg: LaunchConfig,
    opb: Option<i32>,
) -> Result<()> {
    let (rb, n_out, n_in) = (w.row_bytes() as i64, w.shape[0] as i32, w.shape[1] as i32);
    let (rows, ks) = (x.rows as i32, ks as i32);
    let mut launch = be.stream.kernel(func);
    launch
        .arg(&*w.data)
        .arg(&rb)
        .arg(&n_out)
        .arg(&n_in)
        .arg(&x.buf)
        .arg(&rows)
        .arg(&mut out.buf)
        .arg(&ks);
    // gemv_f32_xs_j*: the outputs a k-group takes.
    if let Some(opb) = &opb {
        launch.arg(opb);
    }
    // SAFETY: the caller checked the shapes and buffer sizes: the kernel reads n_out rows of
    // rb bytes of W and rows×n_in floats of x, and writes rows×n_out floats of out.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// `quant_x_q8s` and `gemv_tm_q4k_r8` / `_r16` ([`tm_launch`]).
struct TmKernels {
    quant: CudaFunction,
    gemv: [CudaFunction; 2],
}

/// x as the token-major GEMV reads it (`quant_x_q8s`): the two int8 planes per row, a scale
/// per 256 columns, an integer sum per 32; sized for GEMV_MAX_ROWS rows of `cap` columns.
struct TmScratch {
    q: CudaSlice<i8>,
    s: CudaSlice<f32>,
    sum: CudaSlice<i32>,
    cap: usize,
    retired: Vec<TmScratch>,
}

impl Grown for TmScratch {
    fn retired(&mut self) -> &mut Vec<Self> {
        &mut self.retired
    }
}

/// The token-major Q4_K GEMV (`FERRITE_GEMV_TM=1`; matmul.cu section 1f): x quantized with
/// one scale per 256 columns, then one launch of 16-row tiles whose MMAs take up to 8 (R = 8)
/// or 16 (R = 16) x rows as their N columns. Shapes checked by [`matmul`].
fn tm_launch(
    be: &CudaBackend,
    tm: &TmKernels,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    let (rows, n_in, n_out) = (x.rows, x.cols, w.shape[0]);
    let mut guard = lock_grown(
        &be.matmul.tm_scratch,
        "token-major GEMV",
        |s: &TmScratch| s.cap >= n_in,
        || {
            Ok(TmScratch {
                q: be.stream.alloc_zeros::<i8>(2 * GEMV_MAX_ROWS * n_in)?,
                s: be.stream.alloc_zeros::<f32>(GEMV_MAX_ROWS * n_in / QK_K)?,
                sum: be.stream.alloc_zeros::<i32>(GEMV_MAX_ROWS * n_in / 32)?,
                cap: n_in,
                retired: Vec::new(),
            })
        },
    )?;
    let sc = guard
        .as_mut()
        .ok_or_else(|| anyhow!("matmul: token-major scratch missing"))?;
    let (rows_i, n_in_i, n_out_i) = (rows as i32, n_in as i32, n_out as i32);
    let rb = w.row_bytes() as i64;
    let warps = rows * n_in / QK_K;
    // SAFETY: x holds rows × n_in floats (checked by matmul); the scratch holds GEMV_MAX_ROWS
    // ≥ rows rows of n_in columns: planes 2·n_in bytes a row, n_in / 256 scales and n_in / 32
    // sums; one warp per 256 columns of a row.
    unsafe {
        be.stream
            .kernel(&tm.quant)
            .arg(&x.buf)
            .arg(&rows_i)
            .arg(&n_in_i)
            .arg(&mut sc.q)
            .arg(&mut sc.s)
            .arg(&mut sc.sum)
            .launch(LaunchConfig {
                grid_dim: (warps.div_ceil(4) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
    }?;
    let func = &tm.gemv[usize::from(rows > 8)];
    // SAFETY: W holds n_out rows of rb bytes (checked by matmul); the kernel reads the
    // scratch's first `rows` rows and writes rows × n_out floats of out; 16 rows a block.
    unsafe {
        be.stream
            .kernel(func)
            .arg(&*w.data)
            .arg(&rb)
            .arg(&n_out_i)
            .arg(&n_in_i)
            .arg(&sc.q)
            .arg(&sc.s)
            .arg(&sc.sum)
            .arg(&rows_i)
            .arg(&mut out.buf)
            .launch(LaunchConfig {
                grid_dim: (n_out.div_ceil(16) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
    }?;
    Ok(())
}

/// Whether a matmul of a `t` weight with `n_out` outputs on `rows` rows runs the
/// quantized-x GEMV. Small-output matrices (routers) keep the f32 GEMV at every row count
/// (see [`F32_SMALL_OUT`]).
pub fn gemvq_applies(t: GgmlType, n_out: usize, rows: usize) -> bool {
    rows <= GEMV_MAX_ROWS && quantized_x(t) && n_out > F32_SMALL_OUT
}

fn uses_gemvq(w: &CudaWeight, rows: usize) -> bool {
    w.shape.len() == 2 && gemvq_applies(w.dtype, w.shape[0], rows)
}

/// Quantizes the rows of x (≤ GEMV_MAX_ROWS, `cols` a multiple of 32) into the backend's int8
/// scratch and returns it locked: the GEMVs that follow read it in stream order.
pub(crate) fn quantize_x<'a>(
    be: &'a CudaBackend,
    x: &Act<CudaSlice<f32>>,
) -> Result<std::sync::MutexGuard<'a, Option<XQuant>>> {
    let (rows, n_in) = (x.rows, x.cols);
    ensure!(
        rows <= GEMV_MAX_ROWS && n_in % 32 == 0 && x.buf.len() >= rows * n_in,
        "quantize_x: [{rows}, {n_in}] is not a GEMV input"
    );
    let mut guard = lock_xq(be, n_in)?;
    let xq = guard
        .as_mut()
        .ok_or_else(|| anyhow!("matmul: int8 scratch missing"))?;
    let (x_ptr, _g) = x.buf.device_ptr(&be.stream);
    let skip = rows == 1 && switches::diag_skip() & 2 != 0; // timing diagnostic only
    if xq.src.take() != Some((x_ptr, rows, n_in, super::launch::launch_count())) && !skip {
        quantize_into(be, &x.buf, rows, n_in, &mut xq.q, &mut xq.d)?;
    }
    Ok(guard)
}

/// The int8 scratch, locked, for a producer kernel that can quantize its `[rows, cols]`
/// output there as the next GEMV wants it (then recorded in `XQuant::src`): `None` when
/// that output is not a decode GEMV input or no quantized-x GEMV has run yet (the scratch
/// does not exist: float-weight models never quantize, and it is never grown here).
pub(crate) fn xq_for_producer(
    be: &CudaBackend,
    rows: usize,
    cols: usize,
) -> Result<Option<std::sync::MutexGuard<'_, Option<XQuant>>>> {
    if rows == 0 || rows > GEMV_MAX_ROWS || !cols.is_multiple_of(32) {
        return Ok(None);
    }
    let guard = be
        .matmul
        .xq
        .lock()
        .map_err(|_| anyhow!("matmul: int8 scratch lock poisoned"))?;
    Ok(guard
        .as_ref()
        .is_some_and(|b| b.cap >= cols)
        .then_some(guard))
}

/// The int8 scratch, locked, grown first if its rows are shorter than `n_in` (sized for
/// GEMV_MAX_ROWS rows whatever the step's row count, so that the first (eager) decode step
/// already allocates what a later captured verify step needs).
pub(crate) fn lock_xq(
    be: &CudaBackend,
    n_in: usize,
) -> Result<std::sync::MutexGuard<'_, Option<XQuant>>> {
    lock_grown(
        &be.matmul.xq,
        "int8",
        |b| b.cap >= n_in,
        || {
            Ok(XQuant {
                q: be.stream.alloc_zeros::<i8>(2 * GEMV_MAX_ROWS * n_in)?,
                d: be
                    .stream
                    .alloc_zeros::<f32>(GEMV_MAX_ROWS * n_in / 32 * 2)?,
                cap: n_in,
                retired: Vec::new(),
                src: None,
            })
        },
    )
}

impl Grown for XQuant {
    fn retired(&mut self) -> &mut Vec<Self> {
        &mut self.retired
    }
}

/// The FFN norm's input as `gemvq_tc2_add_q4_k` leaves it for the SwiGLU: the int8 planes
/// and scale pairs of x ⊙ n (quant_x_q8's layout) and each 32-element group's Σ x².
pub(crate) struct NormPlanes {
    q: CudaSlice<i8>,
    d: CudaSlice<f32>,
    ss: CudaSlice<f32>,
    cap: usize,
    retired: Vec<NormPlanes>,
    /// What they hold: (x's device address, the norm weight's, rows, cols, the launch count
    /// right after the producer). Only `rms_norm_matmul_swiglu` with that norm on that x,
    /// next in the stream, takes them.
    src: Option<(u64, u64, usize, usize, u64)>,
}

impl Grown for NormPlanes {
    fn retired(&mut self) -> &mut Vec<Self> {
        &mut self.retired
    }
}

impl NormPlanes {
    /// What planes of `x` (`rows` × `cols`) weighted by `norm` left by the launch just issued
    /// are recorded as (`src`).
    fn key(
        be: &CudaBackend,
        x: &CudaSlice<f32>,
        norm: &CudaWeight,
        rows: usize,
        cols: usize,
    ) -> (u64, u64, usize, usize, u64) {
        let (xp, _g) = x.device_ptr(&be.stream);
        let (np, _g2) = norm.data.device_ptr(&be.stream);
        (xp, np, rows, cols, super::launch::launch_count())
    }

    /// Whether the planes are those the producer just left for `x` and `norm`, nothing
    /// launched since; either way they are taken (a second consumer never reads them).
    fn take_for(&mut self, be: &CudaBackend, x: &Act<CudaSlice<f32>>, norm: &CudaWeight) -> bool {
        self.src.take() == Some(Self::key(be, &x.buf, norm, x.rows, x.cols))
    }
}

/// The one-row grouped Q, K, V kernels reading the planes of x ⊙ n that [`matmul_add_for_norm`]
/// left, scaling each output by 1 / rms(x) (matmul.cu `GEMVQ_MULTI_NORM_KERNEL`): Q4_K on the
/// tensor-core tile, Q4_K Q, K + Q6_K V (the mixed launch), and Q8_0 on the lane code.
struct QkvNorm {
    q4_k: CudaFunction,
    q4_k_q6_k: CudaFunction,
    q8_0: CudaFunction,
}

/// The scratch of the handed-over planes, grown to `n` columns.
fn norm_planes(
    be: &CudaBackend,
    n: usize,
) -> Result<std::sync::MutexGuard<'_, Option<NormPlanes>>> {
    lock_grown(
        &be.matmul.xqn,
        "norm planes",
        |b| b.cap >= n,
        || {
            Ok(NormPlanes {
                q: be.stream.alloc_zeros::<i8>(2 * GEMV_MAX_ROWS * n)?,
                d: be.stream.alloc_zeros::<f32>(GEMV_MAX_ROWS * n / 32 * 2)?,
                ss: be.stream.alloc_zeros::<f32>(GEMV_MAX_ROWS * n / 32)?,
                cap: n,
                retired: Vec::new(),
                src: None,
            })
        },
    )
}

/// Quantizes `rows` rows of `n_in` (a multiple of 32) floats of `x` into `q` (two int8 planes
/// per row, rows `2·n_in` apart) and `d` (per 32-element block: scale, scale · Σq):
/// `quant_x_q8`.
pub(crate) fn quantize_into(
    be: &CudaBackend,
    x: &CudaSlice<f32>,
    rows: usize,
    n_in: usize,
    q: &mut CudaSlice<i8>,
    d: &mut CudaSlice<f32>,
) -> Result<()> {
    let n = rows * n_in;
    ensure!(
        n_in.is_multiple_of(32) && x.len() >= n && q.len() >= 2 * n && d.len() >= n / 16,
        "quantize: [{rows}, {n_in}] does not fit its buffers"
    );
    ensure!(
        n <= i32::MAX as usize,
        "quantize: [{rows}, {n_in}] is too large"
    );
    if n == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: ((n / 32).div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows_i, n_in_i) = (rows as i32, n_in as i32);
    // SAFETY: sizes checked above.
    unsafe {
        be.stream
            .kernel(&be.matmul.quant_x)
            .arg(x)
            .arg(&rows_i)
            .arg(&n_in_i)
            .arg(q)
            .arg(d)
            .arg(&be.matmul.quant_x_early)
            .launch(cfg)
    }?;
    Ok(())
}

/// The quantized-x GEMV of `w` (or, with `up`, the fused SwiGLU pair `silu(w·x) ⊙ (up·x)`)
/// on the quantized rows in `xq`. The caller checked shapes and that [`uses_gemvq`] holds.
fn gemvq_launch(
    be: &CudaBackend,
    xq: &XQuant,
    w: &CudaWeight,
    up: Option<&CudaWeight>,
    out: &mut Act<CudaSlice<f32>>,
    rows: usize,
) -> Result<()> {
    let (n_out, n_in) = (w.shape[0], w.shape[1]);
    ensure!(
        xq.cap >= n_in && out.buf.len() >= rows * n_out && rows >= 1,
        "gemvq: buffers smaller than [{rows}, {n_in}] -> {n_out}"
    );
    let ti = type_index(w.dtype)?;
    let fams = be.matmul.gemvq[ti]
        .as_ref()
        .ok_or_else(|| anyhow!("gemvq: no quantized-x kernel for {}", w.dtype))?;
    let ri = gemv_r_index(rows)?;
    let rb = w.row_bytes() as i64;
    let (n_out_i, n_in_i, rows_i) = (n_out as i32, n_in as i32, rows as i32);
    // The kernel indexes x rows n_in apart: the scratch was filled for this n_in.
    let xd = xq.d.slice(..rows * n_in / 32 * 2);
    let xqs = xq.q.slice(..2 * rows * n_in);
    // The plain GEMV: GEMV_NW consecutive rows per row group, kernel family 0; the fused
    // SwiGLU: one output per row group (gate row o with up row o), family 1, a second weight.
    let (groups, spans, fam) = match up {
        None => (row_groups(n_out), 1, 0),
        Some(up) => {
            ensure!(
                up.dtype == w.dtype && up.shape == w.shape && up.data.len() >= n_out * rb as usize,
                "gemvq: gate {:?} {} and up {:?} {} differ",
                w.shape,
                w.dtype,
                up.shape,
                up.dtype
            );
            (n_out, 2, 1)
        }
    };
    let kind = if up.is_some() {
        GemvKind::Swiglu
    } else {
        GemvKind::Plain
    };
    let (ks, smem, tc) = gemvq_plan(
        be,
        w.dtype,
        n_in,
        n_out,
        rb as usize,
        groups,
        spans,
        rows,
        kind,
    )?;
    // The kernel, its grid and its split argument: the 8-row tensor-core tile takes one block
    // per 8 rows, and it and the TMA-box tile no split argument.
    let (f, cfg, ks_arg) = match tc {
        Some(TcForm::Half(f)) => {
            let cfg = LaunchConfig {
                grid_dim: (u32::try_from(n_out.div_ceil(8))?, 1, 1),
                block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            (&f[ri], cfg, None)
        }
        // The K-split tile: a block per (16-row tile, slice); the slice width in the split
        // argument's place.
        // The one-row Q4_K tile in blocks of four warps where `tck_w4` is on.
        Some(TcForm::Split(f, ks, kc)) => {
            let w4 = (rows == 1 && w.dtype == GgmlType::Q4K)
                .then_some(be.matmul.tck_w4.as_ref())
                .flatten();
            let cfg = LaunchConfig {
                grid_dim: (u32::try_from(n_out.div_ceil(16))?, u32::try_from(ks)?, 1),
                block_dim: tc_block_dim(w4.is_some()),
                shared_mem_bytes: 0,
            };
            (w4.unwrap_or(&f[ri]), cfg, Some(i32::try_from(kc)?))
        }
        // The two-tile block: one per 32 rows.
        Some(TcForm::Pair(f)) => {
            let cfg = LaunchConfig {
                grid_dim: (u32::try_from(n_out.div_ceil(32))?, 1, 1),
                block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            (f, cfg, Some(ks as i32))
        }
        Some(TcForm::Full(tc)) => (&tc[ri], gemv_config(groups, ks), Some(ks as i32)),
        None => (&fams[fam][ri], gemv_config(groups, ks), Some(ks as i32)),
    };
    let cfg = LaunchConfig {
        shared_mem_bytes: smem,
        ..cfg
    };
    // The K-split tile's partial sums and tickets (its bulk copies need 16-byte aligned
    // rows: the weight's own allocation, rb a multiple of 16 by tck_split).
    let tck = match tc {
        Some(TcForm::Split(..)) => {
            let (wp, _g) = w.data.device_ptr(&be.stream);
            ensure!(
                wp % 16 == 0 && rb % 16 == 0,
                "gemvq: K-split tile on a weight not 16-byte aligned"
            );
            Some(lock_tck(be, n_out)?)
        }
        _ => None,
    };
    let mut launch = be.stream.kernel(f);
    launch.arg(&*w.data);
    if let Some(up) = up {
        launch.arg(&*up.data);
    }
    launch
        .arg(&rb)
        .arg(&n_out_i)
        .arg(&n_in_i)
        .arg(&xqs)
        .arg(&xd)
        .arg(&rows_i)
        .arg(&mut out.buf);
    if let Some(ks_i) = &ks_arg {
        launch.arg(ks_i);
    }
    let tck_bufs = tck.as_ref().and_then(|g| g.as_ref());
    if let Some(sc) = tck_bufs {
        launch.arg(&sc.part).arg(&sc.tickets);
    }
    // SAFETY: w (and up, same type and shape) hold n_out rows of rb bytes (checked by the
    // caller and above); the x scratch holds
    // rows×n_in int8 and rows×n_in/32 scale pairs; out holds rows×n_out floats; the K-split
    // scratch holds TCK_MAX_SPLITS × GEMV_MAX_ROWS × n_out partials and a ticket per tile.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// The two-tile block (`gemvq_tct_<type>_r1`) for a one-row plain launch of `n_out` rows of a
/// weight of type `t` whose 16-row tile is the tensor-core one, where switched on and its
/// shared memory fits [`TCT_MAX_SMEM`] from [`TCT_MIN_OUT`] rows. Each of its tiles runs the
/// one-tile kernel's one-row arithmetic, so decode keeps the bits that verify rows (the
/// one-tile kernel at R > 1) give for the same row.
fn tct_kernel(
    be: &CudaBackend,
    t: GgmlType,
    n_in: usize,
    n_out: usize,
    rb: usize,
    kind: GemvKind,
    rows: usize,
) -> Option<&CudaFunction> {
    let tc = be.matmul.gemvq_tc.as_ref()?;
    if !tc.tct_on
        || kind != GemvKind::Plain
        || rows != 1
        || n_out < TCT_MIN_OUT
        || tct_smem(rb, n_in) as usize
            > if t == GgmlType::Q5K {
                tc.tct5_max_smem
            } else {
                TCT_MAX_SMEM
            }
    {
        return None;
    }
    tc.tct.iter().find(|(ty, _)| *ty == t).map(|(_, f)| f)
}

/// Weight types with every tensor-core decode GEMV form (`gemvq_tc_q4k`, `gemvq_tc_q6k` in
/// matmul.cu); Q5_K has the 16-row tile's plain kernel and the two-tile block alone, Q8_0 the
/// K-split tile alone.
const TC_TYPES: [GgmlType; 2] = [GgmlType::Q4K, GgmlType::Q6K];

/// The tensor-core kernels: per type its 16-row tile's families by [`GemvKind`] (as
/// `Kernels::gemvq`: plain, SwiGLU, grouped; `None` where that kind keeps the lane code) and,
/// per type of [`TC_TYPES`], its 8-row-tile kernels (`gemvq_tch_<type>_r<R>`), and the mixed
/// Q4_K + Q6_K grouped launch (Q and K on the tensor cores, V the lane code).
struct TcKernels {
    fams: Vec<(GgmlType, [Option<[CudaFunction; 6]>; 3])>,
    half: Vec<(GgmlType, [CudaFunction; 6])>,
    /// `gemvq_tck_<type>_r<R>`: the K-split tile for long rows (`TcLong::Split`).
    split: Vec<(GgmlType, [CudaFunction; 6])>,
    /// `gemvq_tct_<type>_r1`: two 16-row tiles per block, for one-row plain launches of many
    /// small tiles ([`tct_smem`]).
    tct: Vec<(GgmlType, CudaFunction)>,
    /// Whether those launches take it (`FERRITE_GEMV_TCT`).
    tct_on: bool,
    /// Most shared memory of the Q5_K two-tile block ([`TCT5_WIDE_SMEM`]: two blocks per SM,
    /// Qwen3.5-9B's 4096 columns; with `FERRITE_GEMV_TC5=2` [`TCT_MAX_SMEM`]).
    tct5_max_smem: usize,
    mixed: [CudaFunction; 6],
}

/// Fewest outputs of a one-row plain launch that takes the two-tile block
/// (`gemvq_tct_<type>_r1`): the many-wave launches (a wave is 132 SMs x 3 blocks x 16 rows),
/// where its blocks' turnover is what it shortens (the lm heads).
const TCT_MIN_OUT: usize = 8192;

/// Most shared memory of the two-tile block (four 8-row slots and the staged x): three blocks
/// per SM, as the one-tile kernel. Q6_K up to 2048 columns (59 KB), Q4_K up to 3072.
const TCT_MAX_SMEM: usize = 64 * 1024;

/// The Q5_K two-tile block's limit (`FERRITE_GEMV_TC5=3`, the default): two blocks per SM (a
/// 4096-column Q5_K tile pair and x: 98 KB; MATMUL.md round 69: +0.7% on Qwen3.5-9B).
const TCT5_WIDE_SMEM: usize = 110 * 1024;

/// The two-tile block's shared memory for rows of `rb` bytes and `n_in` columns: two one-tile
/// blocks' slots and one staged x.
fn tct_smem(rb: usize, n_in: usize) -> u32 {
    2 * tc_smem(rb, 8) + tc_x_bytes(n_in)
}

/// Rows whose 16-row tensor-core tile does not fit [`GEMVQ_TC_MAX_SMEM`] (the 12288-column
/// down projections): `FERRITE_GEMV_TC` 1 (default) the 16-row tile over slices of K for the
/// types with a slice width ([`TCK_COLS`], plain launches only; MATMUL.md round 11), else the
/// lane code; 2 the 16-row tile up to [`GEMVQ_BULK_MAX_SMEM`] (one block per SM), 3 the 8-row
/// tile (faster from 8 rows of x, slower at one: MATMUL.md round 9).
#[derive(Clone, Copy, PartialEq, Eq)]
enum TcLong {
    Half,
    Full,
    Split,
}

/// Most columns per slice of the K-split tile, for Q4_K and Q6_K (0: that type's long rows
/// take the lane code); `FERRITE_GEMV_TCK` overrides. 4096: the tile is the 16 x 4096 one of
/// the SwiGLU and the 4096-column weights. Q6_K stays on the lane code: at one row its split
/// tile was slower (12288->4096: 18.1 -> 21.6 us; Q4_K 13.1 -> 13.5 isolated, 13.5 -> 13.4 in
/// the decode graph, and 65 -> 39 us at 8 rows: MATMUL.md round 11).
const TCK_COLS: [usize; 2] = [4096, 0];

/// Most columns per slice of Q8_0's K-split tile (`gemvq_tc_q80`, MATMUL.md round 54): 2048, a
/// 16 x 2048 tile of 35 KB, the bytes of Q4_K's 16 x 4096 one.
const TCK_Q8_COLS: usize = 2048;

/// Fewest columns of the Q8_0 rows that take the K-split tile: the down projections. Shorter
/// rows (Q, K, V, the o-projection, gate/up, the 4096-column lm heads) keep the lane code,
/// which streams them at up to 4.5 TB/s (the lm head) and has no 16-row tile form here.
const TCK_Q8_MIN_COLS: usize = 8192;

/// Most columns per slice the K-split tile accepts (its shared memory: a 16 x 8192 Q6_K tile
/// and x are ~125 KB, over [`GEMVQ_BULK_MAX_SMEM`]).
const TCK_MAX_COLS: usize = 4096;

/// Most tile buffers of the SwiGLU ring (`gemvq_swiglu_tcnp_q8_0_r1`; `PIPE_MAX_NB` in
/// matmul.cu: its mbarriers).
const PIPE_MAX_NB: usize = 8;

/// Tiles of the one-row Q8_0 SwiGLU ring (`FERRITE_SWIGLU_PIPE`; 0: the lane code). Two, 150
/// KB (MATMUL.md round 57): Qwen3-8B Q8_0 tg128 +3.3%; one and three were no faster than the
/// lane code.
const SWIGLU_PIPE_NB: usize = 2;

/// Dynamic shared memory of a one-block-per-SM ring (`gemvq_swiglu_tcnp_q8_0_r1`): the
/// H100 / H200 opt-in limit of a block, 227 KB, less the kernel's static shared memory
/// (2.6 KB with h's copy, `PIPE_QH_MAX`: the driver refuses a limit whose sum with it passes
/// 227 KB).
const PIPE_MAX_SMEM: usize = 224 * 1024;

/// Most outputs a ring block quantizes for the down projection (`PIPE_QH_MAX` in matmul.cu:
/// its shared copy of h); a ring whose blocks would take more groups writes no planes.
const PIPE_QH_MAX: usize = 256;

/// Most slices of the K-split tile (the partial-sum scratch is sized for it).
const TCK_MAX_SPLITS: usize = 8;

/// The K-split of a row of `n_in` columns of type `t` (Q4_K or Q6_K) into slices of at most
/// `max_cols` columns: (slices, columns per slice, the last slice shorter where they do not
/// divide), whole super-blocks each, every slice 16-byte aligned for its bulk copies (Q6_K's
/// 210-byte super-blocks: multiples of 8); None where it does not apply (one slice, too many,
/// or misaligned).
fn tck_split(t: GgmlType, n_in: usize, max_cols: usize) -> Option<(usize, usize)> {
    // Super-blocks per 16-byte aligned slice start (Q4_K's are 144 bytes, Q6_K's 210: 16
    // divides 8 x 210).
    let align = match t {
        // Q8_0: 8 blocks of 34 bytes, 272 (16 x 17).
        GgmlType::Q4K | GgmlType::Q8_0 => 1,
        GgmlType::Q6K => 8,
        _ => return None,
    };
    let nsb = n_in / QK_K;
    if !n_in.is_multiple_of(QK_K) || !nsb.is_multiple_of(align) || max_cols < QK_K * align {
        return None;
    }
    let per = nsb
        .div_ceil(nsb.div_ceil(max_cols.min(TCK_MAX_COLS) / QK_K))
        .next_multiple_of(align);
    let ks = nsb.div_ceil(per);
    (2..=TCK_MAX_SPLITS)
        .contains(&ks)
        .then_some((ks, per * QK_K))
}

/// The K-split tile's scratch: partial sums for [`TCK_MAX_SPLITS`] slices of
/// [`GEMV_MAX_ROWS`] rows of `n_out` outputs, and one ticket per 16-row tile (zero between
/// launches: the block that draws a tile's last ticket resets it).
struct TckScratch {
    part: CudaSlice<f32>,
    tickets: CudaSlice<u32>,
    n_out: usize,
    /// Smaller scratches replaced by a grow, kept alive for graphs captured earlier.
    retired: Vec<TckScratch>,
}

impl Grown for TckScratch {
    fn retired(&mut self) -> &mut Vec<Self> {
        &mut self.retired
    }
}

/// The K-split scratch, locked, grown first if sized for fewer than `n_out` outputs.
fn lock_tck(
    be: &CudaBackend,
    n_out: usize,
) -> Result<std::sync::MutexGuard<'_, Option<TckScratch>>> {
    lock_grown(
        &be.matmul.tck,
        "K-split",
        |b| b.n_out >= n_out,
        || {
            Ok(TckScratch {
                part: be
                    .stream
                    .alloc_zeros::<f32>(TCK_MAX_SPLITS * GEMV_MAX_ROWS * n_out)?,
                tickets: be.stream.alloc_zeros::<u32>(n_out.div_ceil(16))?,
                n_out,
                retired: Vec::new(),
            })
        },
    )
}

/// A scratch that grows: the scratches it replaced, kept alive in its retired list (a graph
/// captured earlier may still point at their buffers).
trait Grown: Sized {
    fn retired(&mut self) -> &mut Vec<Self>;
}

/// The scratch behind `m`, locked; first replaced by a fresh `make()` unless `fits` holds for
/// it, the old one (and everything it had retired) moved into the new one's retired list.
fn lock_grown<'a, T: Grown>(
    m: &'a Mutex<Option<T>>,
    what: &str,
    fits: impl Fn(&T) -> bool,
    make: impl FnOnce() -> Result<T>,
) -> Result<std::sync::MutexGuard<'a, Option<T>>> {
    let mut guard = m
        .lock()
        .map_err(|_| anyhow!("matmul: {what} scratch lock poisoned"))?;
    if !guard.as_ref().is_some_and(&fits) {
        let mut fresh = make()?;
        if let Some(mut old) = guard.take() {
            *fresh.retired() = std::mem::take(old.retired());
            fresh.retired().push(old);
        }
        *guard = Some(fresh);
    }
    Ok(guard)
}

/// Most shared memory a tensor-core GEMV block with the 16-row tile takes by default (the tile
/// and, at one row, the staged x): three blocks per SM. Q4_K up to 6144 columns and Q6_K up
/// to 4096 fit (a Q6_K 4096-column block is 62 KB).
const GEMVQ_TC_MAX_SMEM: usize = 64 * 1024;

/// Fewest outputs for which Q6_K takes the 16-row tensor-core tile: measured slower than the
/// lane code under a wave of blocks (4096 x 4096 rows = 1: 8.9 -> 10.5 us; the 1024-row V
/// segment 6.9 -> 7.3), faster with many (the 151936-row lm head 177.3 -> 156.8 us); a
/// wave is 132 SMs x 3 blocks x 16 rows (MATMUL.md round 9).
const GEMVQ_TC_Q6K_MIN_OUT: usize = 8192;

/// How a quantized-x launch takes the tensor cores.
#[derive(Clone, Copy)]
enum TcForm<'a> {
    /// The 16-row tile: the launch kind's kernels by R.
    Full(&'a [CudaFunction; 6]),
    /// The 8-row tile (plain launches only).
    Half(&'a [CudaFunction; 6]),
    /// Two 16-row tiles per block (`gemvq_tct_<type>_r1`: one-row plain launches where
    /// [`tct_kernel`] takes it; chosen by [`gemvq_plan`] in place of `Full`).
    Pair(&'a CudaFunction),
    /// The 16-row tile over slices of K (plain launches only): the kernels by R, the slices
    /// and the columns per slice ([`tck_split`]).
    Split(&'a [CudaFunction; 6], usize, usize),
}

/// The launch a GEMV plan is for: the tensor-core forms differ in which they have.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GemvKind {
    Plain,
    Swiglu,
    Grouped,
}

impl GemvKind {
    /// The kind's index among a type's kernel families (plain, SwiGLU, grouped).
    fn family(self) -> usize {
        match self {
            GemvKind::Plain => 0,
            GemvKind::Swiglu => 1,
            GemvKind::Grouped => 2,
        }
    }
}

/// The tensor-core form a weight of type `t` with `n_out` rows of `n_in` columns (rb bytes)
/// takes, if any: sm_90+, not switched off, a type of [`TC_TYPES`]; the 16-row tile where
/// its one-row block fits [`GEMVQ_TC_MAX_SMEM`] (Q6_K from [`GEMVQ_TC_Q6K_MIN_OUT`] rows),
/// else by [`TcLong`] (the 8-row and K-split tiles: plain launches only). A function of the
/// shape only, so decode and verify take the same kernel.
fn tc_form(
    be: &CudaBackend,
    t: GgmlType,
    n_in: usize,
    n_out: usize,
    rb: usize,
    kind: GemvKind,
) -> Option<TcForm<'_>> {
    let tc = be.matmul.gemvq_tc.as_ref()?;
    // The K-split tile in slices of at most `cols` columns.
    let split = |cols: usize| {
        let (ks, kc) = tck_split(t, n_in, cols)?;
        tc.split
            .iter()
            .find(|(ty, _)| *ty == t)
            .map(|(_, f)| TcForm::Split(f, ks, kc))
    };
    if t == GgmlType::Q8_0 {
        // Q8_0: the K-split tile for its long rows' plain launches alone.
        let cols = be.matmul.gemvq_tck_q8_cols;
        if kind != GemvKind::Plain || cols == 0 || n_in < TCK_Q8_MIN_COLS {
            return None;
        }
        return split(cols);
    }
    let fams = tc
        .fams
        .iter()
        .find(|(ty, _)| *ty == t)
        .and_then(|(_, f)| f[kind.family()].as_ref())?;
    let full = (tc_smem(rb, 8) + tc_x_bytes(n_in)) as usize;
    if full <= GEMVQ_TC_MAX_SMEM {
        if t == GgmlType::Q6K && n_out < be.matmul.gemvq_tc6_min {
            return None;
        }
        return Some(TcForm::Full(fams));
    }
    match be.matmul.gemvq_tc_long {
        TcLong::Full if full <= GEMVQ_BULK_MAX_SMEM => Some(TcForm::Full(fams)),
        TcLong::Half
            if kind == GemvKind::Plain && tc_smem(rb, 4) as usize <= GEMVQ_BULK_MAX_SMEM =>
        {
            tc.half
                .iter()
                .find(|(ty, _)| *ty == t)
                .map(|(_, f)| TcForm::Half(f))
        }
        TcLong::Split if kind == GemvKind::Plain => {
            split(be.matmul.gemvq_tck_cols[usize::from(t == GgmlType::Q6K)])
        }
        _ => None,
    }
}

/// [`gemvq_split`], or the tensor-core form ([`tc_form`]) with its split, 1, and shared
/// memory: the tile and, for the 16-row tile at one row, the staged x. The split and the
/// kernel depend on the shape only, so decode and verify take the same one; the shared memory
/// also on whether `rows` is 1 (R = 1 stages x; the arithmetic is the same), and so does the
/// two-tile block ([`tct_kernel`]), whose tiles run the one-row tile's arithmetic.
#[allow(clippy::too_many_arguments)]
fn gemvq_plan(
    be: &CudaBackend,
    t: GgmlType,
    n_in: usize,
    n_out: usize,
    rb: usize,
    groups: usize,
    spans: usize,
    rows: usize,
    kind: GemvKind,
) -> Result<(usize, u32, Option<TcForm<'_>>)> {
    let x = if rows == 1 { tc_x_bytes(n_in) } else { 0 };
    match tc_form(be, t, n_in, n_out, rb, kind) {
        Some(TcForm::Full(f)) => Ok(match tct_kernel(be, t, n_in, n_out, rb, kind, rows) {
            Some(p) => (1, tct_smem(rb, n_in), Some(TcForm::Pair(p))),
            None => (1, tc_smem(rb, 8) + x, Some(TcForm::Full(f))),
        }),
        // (tc_form, a function of the shape, leaves this form to the row count above.)
        Some(TcForm::Pair(p)) => Ok((1, tct_smem(rb, n_in), Some(TcForm::Pair(p)))),
        Some(TcForm::Half(f)) => Ok((1, tc_smem(rb, 4), Some(TcForm::Half(f)))),
        // The tile of the widest slice (rb / (n_in / kc) bytes per row), its x slice at one row.
        Some(TcForm::Split(f, ks, kc)) => {
            let x = if rows == 1 { tc_x_bytes(kc) } else { 0 };
            let slice_rb = rb / (n_in / 256) * (kc / 256) + tck_row_pad(t);
            Ok((1, tc_smem(slice_rb, 8) + x, Some(TcForm::Split(f, ks, kc))))
        }
        None => {
            let (ks, smem) = gemvq_split(be, t, n_in, rb, groups, spans)?;
            Ok((ks, smem, None))
        }
    }
}

/// Bytes the K-split tile leaves between its row slices beyond their length (`PAD` of
/// `gemvq_tck_block`): 16 for Q8_0, whose tile loads conflict four-way on rows a multiple of
/// 128 bytes apart, two-way on rows 16 more apart (`gemvq_tc_q80`).
fn tck_row_pad(t: GgmlType) -> usize {
    if t == GgmlType::Q8_0 {
        16
    } else {
        0
    }
}

/// A tensor-core GEMV block's threads: eight warps, or four for the W4 kernels (MATMUL.md
/// rounds 49-50: a warp takes the super-blocks of two of the eight-warp kernel's warps).
fn tc_block_dim(w4: bool) -> (u32, u32, u32) {
    let warps = if w4 { GEMV_WARPS / 2 } else { GEMV_WARPS };
    ((warps * 32) as u32, 1, 1)
}

/// Dynamic shared memory of a tensor-core GEMV block: two slots of `ns` rows (8, or 4 for the
/// 8-row tile), the second starting 64 bytes past a 128-byte boundary (`tc_slot` in
/// matmul.cu, the same formula).
pub(crate) fn tc_smem(rb: usize, ns: usize) -> u32 {
    (2 * ((ns * rb + 16).div_ceil(128) * 128 + 64)) as u32
}

/// Shared memory a one-row tensor-core GEMV block adds for its staged x (`tc_stage_x` in
/// matmul.cu: both int8 planes, 128 bytes of bank padding, the scale pairs).
pub(crate) fn tc_x_bytes(n_in: usize) -> u32 {
    (2 * n_in + 128 + n_in / 32 * 8) as u32
}

/// Type pairs (a, b) with a grouped quantized-x launch of two type-a weights and a type-b
/// third (`gemvq_multi_<a>_<b>_r<R>` in matmul.cu): Q4_K_M's Q, K (Q4_K) and V (Q6_K in half
/// the layers).
const GEMVQ_MIXED: &[(GgmlType, GgmlType)] = &[(GgmlType::Q4K, GgmlType::Q6K)];

/// The `gemvq_multi_<a>_<b>_r<R>` kernels (by R index) for a type-a pair followed by a type-b
/// weight, if [`GEMVQ_MIXED`] has them.
fn mixed_kernels(be: &CudaBackend, a: GgmlType, b: GgmlType) -> Option<&[CudaFunction; 6]> {
    be.matmul
        .gemvq_mixed
        .iter()
        .find(|(ta, tb, _)| *ta == a && *tb == b)
        .map(|(_, _, f)| f)
}

/// Kernel argument of `gemv_multi_*` / `gemvq_multi_*` (`GemvSegs` in matmul.cu): up to
/// three weights of one type and row length, their outputs and row counts, and the blocks of
/// the first two (the third takes the rest of the grid).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemvSegs {
    w: [u64; 3],
    out: [u64; 3],
    n: [i32; 3],
    b: [i32; 2],
}

// SAFETY: plain old data laid out as the C struct (6 pointers, 5 ints).
unsafe impl super::launch::ScalarArg for GemvSegs {}

/// Which decode GEMV a weight takes at `rows` rows, for grouping in [`matmuls`]: `Some(true)`
/// the quantized-x one, `Some(false)` the f32-x one (float types, and small-output quantized
/// weights), `None` neither (prefill rows).
fn gemv_path(w: &CudaWeight, rows: usize) -> Option<bool> {
    if rows == 0 || rows > GEMV_MAX_ROWS || w.shape.len() != 2 {
        None
    } else if uses_gemvq(w, rows) {
        Some(true)
    } else {
        // The f32-x GEMV: float types, and quantized ones with small outputs.
        Some(false)
    }
}

/// `outs[i] = ws[i] · x` for weights reading the same x (the Q, K, V projections). At decode
/// rows, consecutive weights of one type and row length run as one launch (up to three:
/// `gemv_multi_*` / `gemvq_multi_*`), and x is quantized once for all quantized-x GEMVs.
pub fn matmuls(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    ws: &[&CudaWeight],
    outs: &mut [&mut Act<CudaSlice<f32>>],
) -> Result<()> {
    ensure!(
        ws.len() == outs.len(),
        "matmuls: {} weights, {} outputs",
        ws.len(),
        outs.len()
    );
    let rows = x.rows;
    for (w, out) in ws.iter().zip(outs.iter()) {
        crate::check_matmul(x, &w.shape, out)?;
        ensure!(
            w.data.len() >= w.shape[0] * w.row_bytes(),
            "matmuls: weight buffer smaller than {:?} {}",
            w.shape,
            w.dtype
        );
    }
    ensure!(
        x.buf.len() >= rows * x.cols,
        "matmuls: input buffer smaller than its shape"
    );
    let paths: Vec<Option<bool>> = ws.iter().map(|w| gemv_path(w, rows)).collect();
    let guard = if paths.contains(&Some(true)) {
        Some(quantize_x(be, x)?)
    } else {
        None
    };
    let xq = guard.as_ref().and_then(|g| g.as_ref());
    let mut outs = outs.iter_mut();
    let mut i = 0;
    while i < ws.len() {
        // The run of weights from i that can share one launch.
        let mut j = i + 1;
        while j < ws.len()
            && j - i < 3
            && paths[i].is_some()
            && paths[j] == paths[i]
            && ws[j].dtype == ws[i].dtype
            && ws[j].shape[1] == ws[i].shape[1]
        {
            j += 1;
        }
        // Two quantized-x weights of one type followed by one of another type that has a
        // mixed kernel (Q4_K Q, K + Q6_K V): one launch for the three.
        if j - i == 2
            && j < ws.len()
            && paths[i] == Some(true)
            && paths[j] == Some(true)
            && ws[j].shape[1] == ws[i].shape[1]
            && mixed_kernels(be, ws[i].dtype, ws[j].dtype).is_some()
        {
            j += 1;
        }
        // The f32-x GEMV's split depends on the launch's row groups: group only where it is
        // the split of each weight's own launch, so that every output keeps the bits it has
        // alone (and at prefill rows, where small-output weights take this GEMV per weight).
        // Weights whose outputs are all above F32_SMALL_OUT (their prefill takes the matmul
        // kernels, never this GEMV) group at the launch's split (`group_float`): decode and
        // verify still share one launch, so their bits agree.
        if paths[i] == Some(false) && j - i >= 2 {
            let steps = gemv_steps(ws[i].dtype, ws[i].shape[1]);
            let all: usize = ws[i..j].iter().map(|w| row_groups(w.shape[0])).sum();
            let ks = split_k(steps, all, be.sm_count);
            let free = be.matmul.group_float && ws[i..j].iter().all(|w| w.shape[0] > F32_SMALL_OUT);
            if !free
                && ws[i..j]
                    .iter()
                    .any(|w| split_k(steps, row_groups(w.shape[0]), be.sm_count) != ks)
            {
                j = i + 1;
            }
        }
        let group: Vec<&mut &mut Act<CudaSlice<f32>>> = outs.by_ref().take(j - i).collect();
        match paths[i] {
            Some(q) if j - i >= 2 => multi_launch(be, x, xq, q, &ws[i..j], group, None)?,
            Some(true) => {
                let xq = xq.ok_or_else(|| anyhow!("matmuls: int8 scratch missing"))?;
                for out in group {
                    gemvq_launch(be, xq, ws[i], None, out, rows)?;
                }
            }
            // Never touches the int8 scratch held here (not a quantized-x GEMV).
            _ => {
                for out in group {
                    matmul(be, x, ws[i], out)?;
                }
            }
        }
        i = j;
    }
    Ok(())
}

/// One launch of 2–3 weights of one type and row length (checked by the caller): the
/// quantized-x GEMV on `xq` (`q`) or the f32 GEMV on x.
/// `handed`: the planes of x ⊙ n and their group sums that [`matmul_add_for_norm`] left, read
/// instead of `xq` by the launch's NORM form (one row; [`handed_kernel`]), with the norm's eps.
fn multi_launch(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    xq: Option<&XQuant>,
    q: bool,
    ws: &[&CudaWeight],
    outs: Vec<&mut &mut Act<CudaSlice<f32>>>,
    handed: Option<(&NormPlanes, f32)>,
) -> Result<()> {
    use cudarc::driver::DevicePtrMut;
    let (t, n_in, rows) = (ws[0].dtype, ws[0].shape[1], x.rows);
    ensure!(
        (2..=3).contains(&ws.len()) && ws.len() == outs.len(),
        "matmuls: a group of {} weights",
        ws.len()
    );
    let groups: usize = ws.iter().map(|w| row_groups(w.shape[0])).sum();
    let steps = if q {
        gemvq_steps(t, n_in)
    } else {
        gemv_steps(t, n_in)
    };
    // The type-t weights' kernel form is one for the launch: decided at the fewest rows among
    // them (Q6_K's tile depends on the row count).
    let t_outs = ws.iter().filter(|w| w.dtype == t).map(|w| w.shape[0]);
    let n_min = t_outs.min().unwrap_or(0);
    let (ks, smem, tc) = if q {
        let (ks, smem, tc) = gemvq_plan(
            be,
            t,
            n_in,
            n_min,
            ws[0].row_bytes(),
            groups,
            1,
            rows,
            GemvKind::Grouped,
        )?;
        let tc = match tc {
            Some(TcForm::Full(f)) => Some(f),
            Some(TcForm::Half(_) | TcForm::Split(..) | TcForm::Pair(_)) => {
                bail!("matmuls: a single-weight tensor-core form in a grouped launch")
            }
            None => None,
        };
        (ks, smem, tc)
    } else {
        (split_k(steps, groups, be.sm_count), 0, None)
    };
    // A third weight of another type (a mixed kernel, quantized x only) has its own split
    // and slots: those its single-weight launch would take.
    let t2 = ws[ws.len() - 1].dtype;
    let mixed = t2 != t;
    ensure!(
        !mixed || (q && ws.len() == 3 && ws[1].dtype == t),
        "matmuls: mixed types in a grouped launch"
    );
    // The Q6_K V on the tensor-core tile (`qkv_vtc`): its one-tile block, ks2 = 1.
    let vtc = match &be.matmul.qkv_vtc {
        Some(k) if mixed && tc.is_some() && (t, t2) == (GgmlType::Q4K, GgmlType::Q6K) => Some(k),
        _ => None,
    };
    let (ks2, smem2) = if vtc.is_some() {
        let x = if rows == 1 { tc_x_bytes(n_in) } else { 0 };
        (1, tc_smem(ws[2].row_bytes(), 8) + x)
    } else if mixed {
        let g2 = row_groups(ws[2].shape[0]);
        let single = gemvq_split(be, t2, n_in, ws[2].row_bytes(), g2, 1)?;
        match tc {
            Some(_) if be.matmul.one_wave => {
                let lead: usize = ws[..2]
                    .iter()
                    .map(|w| w.shape[0].div_ceil(GEMV_WARPS / ks * GEMV_NW))
                    .sum();
                let per_sm = GEMVQ_WAVE_BLOCKS_PER_SM;
                one_wave_split(be.sm_count, per_sm, lead, g2, 1, ws[2].row_bytes(), single)
            }
            _ => single,
        }
    } else {
        (ks, smem)
    };
    let mut sg = GemvSegs::default();
    let mut grid = 0usize;
    let mut guards = Vec::new();
    for (k, (w, out)) in ws.iter().zip(outs).enumerate() {
        let (wp, gw) = w.data.device_ptr(&be.stream);
        let (op, go) = out.buf.device_ptr_mut(&be.stream);
        guards.push((gw, go));
        sg.w[k] = wp;
        sg.out[k] = op;
        sg.n[k] = i32::try_from(w.shape[0])?;
        let per_block = GEMV_WARPS / if k == 2 { ks2 } else { ks } * GEMV_NW;
        let b = w.shape[0].div_ceil(per_block);
        if k < 2 {
            sg.b[k] = i32::try_from(b)?;
        }
        grid += b;
    }
    if ws.len() == 2 {
        // No third weight: its segment is empty (the grid ends with weight 1).
        sg.w[2] = sg.w[1];
        sg.out[2] = sg.out[1];
    }
    let ti = type_index(t)?;
    let ri = gemv_r_index(rows)?;
    let cfg = LaunchConfig {
        grid_dim: (u32::try_from(grid)?, 1, 1),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem.max(smem2),
    };
    let (rb, n_in_i, rows_i, ks_i) = (
        ws[0].row_bytes() as i64,
        n_in as i32,
        rows as i32,
        ks as i32,
    );
    if q {
        let (pq, pd, cap) = match (handed, xq) {
            (Some((p, _)), _) => (&p.q, &p.d, p.cap),
            (None, Some(xq)) => (&xq.q, &xq.d, xq.cap),
            (None, None) => bail!("matmuls: int8 scratch missing"),
        };
        ensure!(cap >= n_in, "matmuls: int8 scratch too small");
        let fams = be.matmul.gemvq[ti]
            .as_ref()
            .ok_or_else(|| anyhow!("matmuls: no quantized-x kernel for {t}"))?;
        let xd = pd.slice(..rows * n_in / 32 * 2);
        let xqs = pq.slice(..2 * rows * n_in);
        // The kernel: the NORM form on the handed-over planes, the mixed-type launch (a
        // third weight of type t2), or the plain grouped one; the arguments are theirs in
        // that order (the mixed form's rb2 and ks2, the NORM form's group sums and eps).
        let f = if let Some((plain, norm)) = vtc {
            if handed.is_some() {
                ensure!(rows == 1, "matmuls: the handed-over norm at {rows} rows");
                norm
            } else {
                &plain[ri]
            }
        } else if handed.is_some() {
            handed_kernel(be, t, t2, tc.is_some(), rows)
                .ok_or_else(|| anyhow!("matmuls: no handed-norm kernel for {t} + {t2}"))?
        } else if mixed {
            match (&be.matmul.gemvq_tc, tc) {
                (Some(all), Some(_)) => {
                    ensure!(
                        (t, t2) == (GgmlType::Q4K, GgmlType::Q6K),
                        "matmuls: no tensor-core mixed kernel for {t} + {t2}"
                    );
                    &all.mixed[ri]
                }
                _ => &mixed_kernels(be, t, t2)
                    .ok_or_else(|| anyhow!("matmuls: no mixed kernel for {t} + {t2}"))?[ri],
            }
        } else {
            match tc {
                Some(tc) => &tc[ri],
                None => &fams[2][ri],
            }
        };
        let (rb2, ks2_i) = (ws[ws.len() - 1].row_bytes() as i64, ks2 as i32);
        let sums = handed.map(|(p, eps)| (p.ss.slice(..rows * n_in / 32), eps));
        let mut launch = be.stream.kernel(f);
        launch.arg(&sg).arg(&rb);
        if mixed {
            launch.arg(&rb2);
        }
        launch
            .arg(&n_in_i)
            .arg(&xqs)
            .arg(&xd)
            .arg(&rows_i)
            .arg(&ks_i);
        if mixed {
            launch.arg(&ks2_i);
        }
        if let Some((ss, eps)) = &sums {
            launch.arg(ss).arg(eps);
        }
        // SAFETY: every weight holds n rows of rb bytes (the mixed form's third n2 rows of
        // rb2) and every output rows×n floats (checked by matmuls); the scratch, or the
        // handed-over planes, hold rows×n_in quantized values with their scales (and, handed
        // over, the group sums of x, written by matmul_add_for_norm).
        unsafe { launch.launch(cfg) }?;
    } else {
        let fams = &be.matmul.gemv_multi[ti];
        // SAFETY: as above, with x holding rows×n_in floats.
        unsafe {
            be.stream
                .kernel(&fams[ri])
                .arg(&sg)
                .arg(&rb)
                .arg(&n_in_i)
                .arg(&x.buf)
                .arg(&rows_i)
                .arg(&ks_i)
                .launch(cfg)
        }?;
    }
    drop(guards);
    Ok(())
}

/// `out = silu(gate · x) ⊙ (up · x)` in one kernel when both weights have the same type and
/// shape and the rows are decode rows (the quantized-x GEMV, or the f32 GEMV of the float
/// types); returns `false` (nothing done) otherwise.
pub fn matmul_swiglu(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    gate: &CudaWeight,
    up: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    if gate.dtype != up.dtype || gate.shape != up.shape {
        return Ok(false);
    }
    // The decode GEMV this pair takes, if any (none at prefill rows; the fused f32-x form
    // exists for the float types only, so small-output quantized weights neither: the
    // caller then runs the three plain ops).
    let Some(quantized) = gemv_path(gate, x.rows) else {
        return Ok(false);
    };
    if !quantized && quantized_x(gate.dtype) {
        return Ok(false);
    }
    crate::check_matmul(x, &gate.shape, out)?;
    let rows = x.rows;
    for w in [gate, up] {
        ensure!(
            w.data.len() >= w.shape[0] * w.row_bytes(),
            "matmul_swiglu: weight buffer smaller than {:?} {}",
            w.shape,
            w.dtype
        );
    }
    if !quantized {
        let (n_out, n_in) = (gate.shape[0], gate.shape[1]);
        ensure!(
            x.buf.len() >= rows * n_in && out.buf.len() >= rows * n_out,
            "matmul_swiglu: activation buffers smaller than their shapes"
        );
        let ti = type_index(gate.dtype)?;
        let fams = be.matmul.gemv_swiglu[ti]
            .as_ref()
            .ok_or_else(|| anyhow!("matmul_swiglu: no fused kernel for {}", gate.dtype))?;
        let ri = gemv_r_index(rows)?;
        // One output per row group (gate row o with up row o).
        let ks = split_k(gemv_steps(gate.dtype, n_in), n_out, be.sm_count);
        let (rb, n_out_i, n_in_i, rows_i, ks_i) = (
            gate.row_bytes() as i64,
            n_out as i32,
            n_in as i32,
            rows as i32,
            ks as i32,
        );
        // SAFETY: both weights hold n_out rows of rb bytes (checked above); x holds rows×n_in
        // floats and out rows×n_out.
        unsafe {
            be.stream
                .kernel(&fams[ri])
                .arg(&*gate.data)
                .arg(&*up.data)
                .arg(&rb)
                .arg(&n_out_i)
                .arg(&n_in_i)
                .arg(&x.buf)
                .arg(&rows_i)
                .arg(&mut out.buf)
                .arg(&ks_i)
                .launch(gemv_config(n_out, ks))
        }?;
        return Ok(true);
    }
    let guard = quantize_x(be, x)?;
    let xq = guard
        .as_ref()
        .ok_or_else(|| anyhow!("matmul_swiglu: int8 scratch missing"))?;
    gemvq_launch(be, xq, gate, Some(up), out, rows)?;
    Ok(true)
}

/// Whether the float GEMV of `w` at `rows` rows can take the raw residual with its RMSNorm
/// deferred (`gemv_lane_norm`): a float type (the quantized ones read x as int8 planes that
/// a norm writes), decode rows, rows of whole float4 steps.
pub(crate) fn defers(be: &CudaBackend, w: &CudaWeight, rows: usize) -> bool {
    be.matmul.defer_norm
        && w.shape.len() == 2
        && (1..=GEMV_MAX_ROWS).contains(&rows)
        && w.shape[1].is_multiple_of(4)
        && !quantized_x(w.dtype)
        && type_index(w.dtype).is_ok_and(|ti| be.matmul.gemv_deferred[ti].is_some())
}

/// Rows per warp of `gemv_norm_*` and `gemv_multi_norm_*` (`GEMV_NORM_NW` in matmul.cu;
/// the SwiGLU and add forms keep [`GEMV_NW`]).
const DEFER_NW: usize = 4;

/// The deferred-GEMV family `k` (0 norm, 1 add, 2 SwiGLU norm, 3 grouped norm) of `t`.
fn deferred_kernels(be: &CudaBackend, t: GgmlType, k: usize) -> Result<&[CudaFunction; 6]> {
    let fams = be.matmul.gemv_deferred[type_index(t)?]
        .as_ref()
        .ok_or_else(|| anyhow!("no deferred-norm GEMV for {t}"))?;
    Ok(&fams[k])
}

fn check_weight(w: &CudaWeight, what: &str) -> Result<()> {
    ensure!(
        w.data.len() >= w.shape[0] * w.row_bytes(),
        "{what}: weight buffer smaller than {:?} {}",
        w.shape,
        w.dtype
    );
    Ok(())
}

/// `out += x · wᵀ` in the float GEMV's epilogue (`gemv_add_*`: bitwise `matmul` then
/// `add_assign`, the split being the plain GEMV's); `false` (nothing done) where `w` does
/// not take it ([`defers`]).
pub fn matmul_add(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    let rows = x.rows;
    if !defers(be, w, rows) {
        return Ok(false);
    }
    let (n_out, n_in) = crate::check_matmul(x, &w.shape, out)?;
    check_weight(w, "matmul_add")?;
    ensure!(
        x.buf.len() >= rows * n_in && out.buf.len() >= rows * n_out,
        "matmul_add: activation buffers smaller than their shapes"
    );
    let groups = row_groups(n_out);
    let ks = split_k(gemv_steps(w.dtype, n_in), groups, be.sm_count);
    let f = &deferred_kernels(be, w.dtype, 1)?[gemv_r_index(rows)?];
    // (w holds n_out rows of rb bytes, checked; each output is read and written by the one
    // lane that stores it.)
    float_gemv(be, f, w, x, out, ks, gemv_config(groups, ks), None)?;
    Ok(true)
}

/// `outs[i] = (rms_norm(x) · norm) · ws[i]ᵀ` with the norm deferred into the GEMVs
/// (`gemv_norm_*`, runs of up to three weights of one type in one `gemv_multi_norm_*` launch
/// at the launch's split); `false` (nothing done) unless every weight [`defers`].
pub fn rms_norm_matmuls(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    (norm, eps): (&CudaWeight, f32),
    ws: &[&CudaWeight],
    outs: &mut [&mut Act<CudaSlice<f32>>],
) -> Result<bool> {
    use cudarc::driver::DevicePtrMut;
    let rows = x.rows;
    if ws.is_empty() || !ws.iter().all(|w| defers(be, w, rows)) {
        return Ok(false);
    }
    ensure!(
        ws.len() == outs.len(),
        "rms_norm_matmuls: {} weights, {} outputs",
        ws.len(),
        outs.len()
    );
    for (w, out) in ws.iter().zip(outs.iter()) {
        crate::check_matmul(x, &w.shape, out)?;
        check_weight(w, "rms_norm_matmuls")?;
        ensure!(
            out.buf.len() >= rows * w.shape[0],
            "rms_norm_matmuls: output buffer smaller than its shape"
        );
    }
    let n_in = x.cols;
    ensure!(
        x.buf.len() >= rows * n_in,
        "rms_norm_matmuls: input buffer smaller than its shape"
    );
    let nw = super::ops::f32_vec(norm, n_in)?;
    let ri = gemv_r_index(rows)?;
    let (n_in_i, rows_i) = (n_in as i32, rows as i32);
    let mut outs = outs.iter_mut();
    let mut i = 0;
    while i < ws.len() {
        let mut j = i + 1;
        while j < ws.len() && j - i < 3 && ws[j].dtype == ws[i].dtype {
            j += 1;
        }
        let t = ws[i].dtype;
        let steps = gemv_steps(t, n_in);
        let rb = ws[i].row_bytes() as i64;
        let group: Vec<&mut &mut Act<CudaSlice<f32>>> = outs.by_ref().take(j - i).collect();
        if j - i == 1 {
            let out = group
                .into_iter()
                .next()
                .ok_or_else(|| anyhow!("rms_norm_matmuls: no output"))?;
            let n_out = ws[i].shape[0];
            let groups = n_out.div_ceil(DEFER_NW);
            // As the grouped launch below: the plain GEMV's split for these rows.
            let ks = split_k(steps, row_groups(n_out), be.sm_count);
            let (n_out_i, ks_i) = (n_out as i32, ks as i32);
            // SAFETY: the weight holds n_out rows of rb bytes, x rows×n_in floats, out
            // rows×n_out (checked above), the norm weight n_in floats.
            unsafe {
                be.stream
                    .kernel(&deferred_kernels(be, t, 0)?[ri])
                    .arg(&*ws[i].data)
                    .arg(&rb)
                    .arg(&n_out_i)
                    .arg(&n_in_i)
                    .arg(&x.buf)
                    .arg(&rows_i)
                    .arg(&mut out.buf)
                    .arg(&ks_i)
                    .arg(&nw)
                    .arg(&eps)
                    .launch(gemv_config(groups, ks))
            }?;
        } else {
            // The split the plain grouped launch takes for these rows (its row groups of
            // GEMV_NW): at DEFER_NW rows per warp that is half its blocks, one wave
            // (QKV of Qwen3-8B F16: 384 blocks, 15.3 µs, against 17.3 at split_k of the
            // DEFER_NW groups, 768 blocks; MATMUL.md round 23).
            let all: usize = ws[i..j].iter().map(|w| row_groups(w.shape[0])).sum();
            let ks = split_k(steps, all, be.sm_count);
            let per_block = GEMV_WARPS / ks * DEFER_NW;
            let mut sg = GemvSegs::default();
            let mut grid = 0usize;
            let mut guards = Vec::new();
            for (k, (w, out)) in ws[i..j].iter().zip(group).enumerate() {
                let (wp, gw) = w.data.device_ptr(&be.stream);
                let (op, go) = out.buf.device_ptr_mut(&be.stream);
                guards.push((gw, go));
                sg.w[k] = wp;
                sg.out[k] = op;
                sg.n[k] = i32::try_from(w.shape[0])?;
                let b = w.shape[0].div_ceil(per_block);
                if k < 2 {
                    sg.b[k] = i32::try_from(b)?;
                }
                grid += b;
            }
            if j - i == 2 {
                sg.w[2] = sg.w[1];
                sg.out[2] = sg.out[1];
            }
            let cfg = LaunchConfig {
                grid_dim: (u32::try_from(grid)?, 1, 1),
                block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let ks_i = ks as i32;
            // SAFETY: every weight holds its n rows of rb bytes and every output rows×n
            // floats (checked above); x rows×n_in floats, the norm weight n_in.
            unsafe {
                be.stream
                    .kernel(&deferred_kernels(be, t, 3)?[ri])
                    .arg(&sg)
                    .arg(&rb)
                    .arg(&n_in_i)
                    .arg(&x.buf)
                    .arg(&rows_i)
                    .arg(&ks_i)
                    .arg(&nw)
                    .arg(&eps)
                    .launch(cfg)
            }?;
            drop(guards);
        }
        i = j;
    }
    Ok(true)
}

/// `out = silu(gate · h) ⊙ (up · h)`, `h = rms_norm(x) · norm`, in one launch with the norm
/// deferred (`gemv_swiglu_norm_*`: s scales both sums before the SwiGLU); `false` (nothing
/// done) unless both weights [`defers`] and agree in type and shape.
pub fn rms_norm_matmul_swiglu(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    (norm, eps): (&CudaWeight, f32),
    gate: &CudaWeight,
    up: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    let rows = x.rows;
    if gate.dtype != up.dtype
        || gate.shape != up.shape
        || !defers(be, gate, rows)
        || !defers(be, up, rows)
    {
        return Ok(false);
    }
    let (n_out, n_in) = crate::check_matmul(x, &gate.shape, out)?;
    check_weight(gate, "rms_norm_matmul_swiglu")?;
    check_weight(up, "rms_norm_matmul_swiglu")?;
    ensure!(
        x.buf.len() >= rows * n_in && out.buf.len() >= rows * n_out,
        "rms_norm_matmul_swiglu: activation buffers smaller than their shapes"
    );
    let nw = super::ops::f32_vec(norm, n_in)?;
    // One output per row group (gate row o with up row o), as matmul_swiglu.
    let ks = split_k(gemv_steps(gate.dtype, n_in), n_out, be.sm_count);
    let (rb, n_out_i, n_in_i, rows_i, ks_i) = (
        gate.row_bytes() as i64,
        n_out as i32,
        n_in as i32,
        rows as i32,
        ks as i32,
    );
    // SAFETY: both weights hold n_out rows of rb bytes (checked); x holds rows×n_in floats,
    // out rows×n_out, the norm weight n_in.
    unsafe {
        be.stream
            .kernel(&deferred_kernels(be, gate.dtype, 2)?[gemv_r_index(rows)?])
            .arg(&*gate.data)
            .arg(&*up.data)
            .arg(&rb)
            .arg(&n_out_i)
            .arg(&n_in_i)
            .arg(&x.buf)
            .arg(&rows_i)
            .arg(&mut out.buf)
            .arg(&ks_i)
            .arg(&nw)
            .arg(&eps)
            .launch(gemv_config(n_out, ks))
    }?;
    Ok(true)
}

/// Whether `w` can be the o-projection of the handed-over norm (`gemvq_tc2_add_q4_k`): a
/// Q4_K weight on its one-tile tensor-core form, whole 32-row groups, decode rows.
fn hands_norm_from(be: &CudaBackend, w: &CudaWeight, rows: usize) -> bool {
    // Q8_0: any row count (matmul_add_for_norm: the 32-row producer at one row, else the plain
    // GEMV and add_norm_planes), for its lane-code NORM SwiGLU.
    if w.dtype == GgmlType::Q8_0 {
        return be.matmul.swiglu_n_q8_0.is_some()
            && w.shape.len() == 2
            && w.shape[0].is_multiple_of(32)
            && gemv_path(w, rows) == Some(true);
    }
    be.matmul.tc2.is_some()
        && w.dtype == GgmlType::Q4K
        && w.shape.len() == 2
        && w.shape[0].is_multiple_of(32)
        && gemv_path(w, rows) == Some(true)
        && matches!(
            tc_form(
                be,
                w.dtype,
                w.shape[1],
                w.shape[0],
                w.row_bytes(),
                GemvKind::Plain
            ),
            Some(TcForm::Full(_))
        )
}

/// The K-split plan of `w` at one row if it is the pair-ticket producer's
/// (`gemvq_tckn[w4]_q4_k_r1`, `gemvq_tckn[w4]_q8_0_r1`: [`tckn_kernel`]): Q4_K or Q8_0 rows
/// of whole 32-row groups on the K-split tile.
fn tckn_plan(be: &CudaBackend, w: &CudaWeight, rows: usize) -> Result<Option<(usize, usize, u32)>> {
    if tckn_kernel(be, w.dtype).is_none()
        || rows != 1
        || w.shape.len() != 2
        || !w.shape[0].is_multiple_of(32)
        || gemv_path(w, rows) != Some(true)
    {
        return Ok(None);
    }
    let (n_out, n_in, rb) = (w.shape[0], w.shape[1], w.row_bytes());
    let (_, smem, tc) = gemvq_plan(
        be,
        w.dtype,
        n_in,
        n_out,
        rb,
        row_groups(n_out),
        1,
        rows,
        GemvKind::Plain,
    )?;
    Ok(match tc {
        Some(TcForm::Split(_, ks, kc)) => Some((ks, kc, smem)),
        _ => None,
    })
}

/// Whether `matmul_add_for_norm` of the down projection `wd` can hand the next layer's
/// attention norm to its grouped Q, K, V `qkv` (`FERRITE_NORM_QKV`): a producer that takes
/// whole 32-row groups — the K-split Q4_K or Q8_0 tile's pair tickets ([`tckn_plan`]; the lane code's
/// group tickets lost, MATMUL.md round 43) — and a NORM form of the Q, K, V launch
/// ([`takes_handed`]).
pub(crate) fn hands_norm_to_qkv(
    be: &CudaBackend,
    wd: &CudaWeight,
    qkv: &[&CudaWeight],
    rows: usize,
) -> bool {
    matches!(tckn_plan(be, wd, rows), Ok(Some(_)))
        && matches!(takes_handed(be, qkv, rows), Ok(true))
}

/// Whether `w` at `rows` rows takes Q8_0's 32-row producer (`gemvq_add_n_q8_0_r1`): one row,
/// its 32 rows within [`ADD_N_MAX_SMEM`].
/// Its sums are plain `matmul_add`'s bit for bit only where that GEMV takes every row whole in
/// one warp (ks = 1, as the 32-row block does): at 3072 columns the one-wave split gives it
/// two warps a row and other sums, so such weights keep the plain GEMV and `add_norm_planes`.
fn add_n_fits(be: &CudaBackend, w: &CudaWeight, rows: usize) -> bool {
    let (n_out, rb) = (w.shape[0], w.row_bytes());
    be.matmul.add_n_q8_0.is_some()
        && rows == 1
        && w.dtype == GgmlType::Q8_0
        && w.shape.len() == 2
        && add_n_smem(rb) <= ADD_N_MAX_SMEM
        && matches!(
            gemvq_plan(
                be,
                w.dtype,
                w.shape[1],
                n_out,
                rb,
                row_groups(n_out),
                1,
                1,
                GemvKind::Plain
            ),
            Ok((1, _, None))
        )
}

/// Dynamic shared memory of a `gemvq_add_n_q8_0_r1` block: 32 rows of `rb` bytes, rounded up
/// to 16, + 16 for the alignment offset.
fn add_n_smem(rb: usize) -> usize {
    32 * rb.div_ceil(16) * 16 + 16
}

/// Whether `matmul_add_for_norm` of `wo` followed by `rms_norm_matmul_swiglu` of `gate` and
/// `up` at `rows` rows takes the handed-over norm (`gemvq_tc2_add_q4_k` and
/// `gemvq_swiglu_tcn_q4_k`): [`hands_norm_from`] `wo`, and Q4_K gate and up on the
/// tensor-core SwiGLU taking its output.
pub(crate) fn hands_norm_over(
    be: &CudaBackend,
    wo: &CudaWeight,
    gate: &CudaWeight,
    up: &CudaWeight,
    rows: usize,
) -> bool {
    let q8 = gate.dtype == GgmlType::Q8_0 && be.matmul.swiglu_n_q8_0.is_some();
    hands_norm_from(be, wo, rows)
        && (gate.dtype == GgmlType::Q4K || q8)
        && gate.shape.len() == 2
        && gate.dtype == up.dtype
        && gate.shape == up.shape
        && wo.shape[0] == gate.shape[1]
        && gemv_path(gate, rows) == Some(true)
        && (q8
            || matches!(
                tc_form(
                    be,
                    gate.dtype,
                    gate.shape[1],
                    gate.shape[0],
                    gate.row_bytes(),
                    GemvKind::Swiglu
                ),
                Some(TcForm::Full(_))
            ))
}

/// Shared memory `gemvq_add_n_q8_0_r1` may take: its 32 rows (139 KB at 4096 columns), one
/// block per SM.
const ADD_N_MAX_SMEM: usize = 200 * 1024;

/// Most rows of x the two-tile kernel takes (`gemvq_tc2_add_q4_k_r<R>`: 512 threads, so at
/// most 128 registers; from 8 rows its accumulators spill). More rows: the plain tensor-core
/// GEMV, then `add_norm_planes` (the same bits).
const TC2_MAX_ROWS: usize = 4;

/// `out += x · wᵀ` leaving the planes of `out ⊙ norm` and their groups' Σ out² for the
/// SwiGLU or the Q, K, V next: the K-split Q4_K down's pair tickets (`gemvq_tckn_q4_k_r1`,
/// [`tckn_plan`]), Q8_0's 32-row producer (`gemvq_add_n_q8_0_r1`), the two-tile Q4_K
/// o-projection (`gemvq_tc2_add_q4_k_r<R>`), else (above [`TC2_MAX_ROWS`] rows, Q8_0's other
/// rows) the plain GEMV into `y` and `add_norm_planes`; `false` (nothing done) where `w` does
/// not take it.
pub fn matmul_add_for_norm(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
    y: &mut Act<CudaSlice<f32>>,
    norm: &CudaWeight,
) -> Result<bool> {
    let rows = x.rows;
    let tckn = tckn_plan(be, w, rows)?;
    let Some(tc2) = be.matmul.tc2.as_ref() else {
        return Ok(false);
    };
    if tckn.is_none() && !hands_norm_from(be, w, rows) {
        return Ok(false);
    }
    let (n_out, n_in) = crate::check_matmul(x, &w.shape, out)?;
    check_weight(w, "matmul_add_for_norm")?;
    ensure!(
        out.buf.len() >= rows * n_out,
        "matmul_add_for_norm: output buffer smaller than its shape"
    );
    let nw = super::ops::f32_vec(norm, n_out)?;
    let rb = w.row_bytes();
    {
        let (wp, _g) = w.data.device_ptr(&be.stream);
        ensure!(
            wp % 16 == 0,
            "matmul_add_for_norm: weight buffer is not 16-byte aligned"
        );
    }
    let guard = quantize_x(be, x)?;
    let xq = guard
        .as_ref()
        .ok_or_else(|| anyhow!("matmul_add_for_norm: int8 scratch missing"))?;
    let mut planes = norm_planes(be, n_out)?;
    let p = planes
        .as_mut()
        .ok_or_else(|| anyhow!("matmul_add_for_norm: plane scratch missing"))?;
    let (rb_i, n_out_i, n_in_i, rows_i) = (rb as i64, n_out as i32, n_in as i32, rows as i32);
    if let Some(plan) = tckn {
        tckn_launch(be, xq, w, out, &nw, p, plan)?;
    } else if switches::diag_skip() & 4 != 0 && add_n_fits(be, w, rows) {
        // FERRITE_DIAG_SKIP 4 (timing only): the launch left out, the planes still recorded
        // below, so that the SwiGLU after it runs as it would.
    } else if let (Some(f), true) = (&be.matmul.add_n_q8_0, add_n_fits(be, w, rows)) {
        let cfg = LaunchConfig {
            grid_dim: (u32::try_from(n_out / 32)?, 1, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: add_n_smem(rb) as u32,
        };
        let xd = xq.d.slice(..n_in / 32 * 2);
        let xqs = xq.q.slice(..2 * n_in);
        // SAFETY: w holds n_out rows of rb bytes (checked), 16-byte aligned; the int8 scratch
        // holds n_in quantized values of x; out (the residual, read and written in place by
        // the one lane of each element) n_out floats; the plane scratch GEMV_MAX_ROWS rows of
        // n_out; the norm weight n_out floats; one block per 32 rows (n_out % 32 == 0).
        unsafe {
            be.stream
                .kernel(f)
                .arg(&*w.data)
                .arg(&rb_i)
                .arg(&n_out_i)
                .arg(&n_in_i)
                .arg(&xqs)
                .arg(&xd)
                .arg(&mut out.buf)
                .arg(&nw)
                .arg(&mut p.q)
                .arg(&mut p.d)
                .arg(&mut p.ss)
                .launch(cfg)
        }?;
    } else if rows > TC2_MAX_ROWS || w.dtype != GgmlType::Q4K {
        crate::check_matmul(x, &w.shape, y)?;
        gemvq_launch(be, xq, w, None, y, rows)?;
        let cfg = LaunchConfig {
            grid_dim: (u32::try_from((rows * n_out / 32).div_ceil(8))?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: out and y hold rows × n_out floats (checked), the norm weight n_out, the
        // plane scratch GEMV_MAX_ROWS ≥ rows rows of n_out; one warp per 32-group.
        unsafe {
            be.stream
                .kernel(&be.matmul.add_norm_planes)
                .arg(&mut out.buf)
                .arg(&y.buf)
                .arg(&nw)
                .arg(&rows_i)
                .arg(&n_out_i)
                .arg(&mut p.q)
                .arg(&mut p.d)
                .arg(&mut p.ss)
                .launch(cfg)
        }?;
    } else {
        // Two tiles' slots, and x staged at one row.
        let smem = 2 * tc_smem(rb, 8) + if rows == 1 { tc_x_bytes(n_in) } else { 0 };
        let cfg = LaunchConfig {
            grid_dim: (u32::try_from(n_out / 32)?, 1, 1),
            block_dim: ((2 * GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        let xd = xq.d.slice(..rows * n_in / 32 * 2);
        let xqs = xq.q.slice(..2 * rows * n_in);
        // SAFETY: w holds n_out rows of rb bytes (checked), 16-byte aligned; the int8 scratch
        // holds rows × n_in quantized values of x; out (the residual, read and written in place
        // by the one lane of each element) rows × n_out floats; the plane scratch
        // GEMV_MAX_ROWS ≥ rows rows of n_out; the norm weight n_out floats; one block per 32
        // rows (n_out % 32 == 0).
        unsafe {
            be.stream
                .kernel(&tc2[0][gemv_r_index(rows)?])
                .arg(&*w.data)
                .arg(&rb_i)
                .arg(&n_out_i)
                .arg(&n_in_i)
                .arg(&xqs)
                .arg(&xd)
                .arg(&rows_i)
                .arg(&mut out.buf)
                .arg(&nw)
                .arg(&mut p.q)
                .arg(&mut p.d)
                .arg(&mut p.ss)
                .launch(cfg)
        }?;
    }
    p.src = Some(NormPlanes::key(be, &out.buf, norm, rows, n_out));
    Ok(true)
}

/// The NORM form of the grouped launch of two `t` weights and a third of type `t2` at `rows`
/// rows, with or without the tensor-core segments (`tc`), if there is one ([`QkvNorm`]).
fn handed_kernel(
    be: &CudaBackend,
    t: GgmlType,
    t2: GgmlType,
    tc: bool,
    rows: usize,
) -> Option<&CudaFunction> {
    let k = be.matmul.qkv_norm.as_ref().filter(|_| rows == 1)?;
    match (t, t2, tc) {
        (GgmlType::Q4K, GgmlType::Q4K, true) => Some(&k.q4_k),
        (GgmlType::Q4K, GgmlType::Q6K, true) => Some(&k.q4_k_q6_k),
        (GgmlType::Q8_0, GgmlType::Q8_0, false) => Some(&k.q8_0),
        _ => None,
    }
}

/// Whether [`matmuls`] of `ws` at `rows` rows is one grouped launch that has a NORM form
/// ([`handed_kernel`]): the consumers [`matmul_add_for_norm`] can hand the norm to.
fn takes_handed(be: &CudaBackend, ws: &[&CudaWeight], rows: usize) -> Result<bool> {
    let [a, b, c] = ws else {
        return Ok(false);
    };
    if be.matmul.qkv_norm.is_none()
        || rows != 1
        || !ws.iter().all(|w| gemv_path(w, rows) == Some(true))
        || a.dtype != b.dtype
        || !ws.iter().all(|w| w.shape[1] == a.shape[1])
        || (c.dtype != a.dtype && mixed_kernels(be, a.dtype, c.dtype).is_none())
    {
        return Ok(false);
    }
    // multi_launch's plan for the group.
    let n_min = ws
        .iter()
        .filter(|w| w.dtype == a.dtype)
        .map(|w| w.shape[0])
        .min()
        .unwrap_or(0);
    let groups: usize = ws.iter().map(|w| row_groups(w.shape[0])).sum();
    let (_, _, tc) = gemvq_plan(
        be,
        a.dtype,
        a.shape[1],
        n_min,
        a.row_bytes(),
        groups,
        1,
        rows,
        GemvKind::Grouped,
    )?;
    let tc = match tc {
        Some(TcForm::Full(_)) => true,
        None => false,
        Some(_) => return Ok(false),
    };
    Ok(handed_kernel(be, a.dtype, c.dtype, tc, rows).is_some())
}

/// `outs[i] = (rms_norm(x) · norm) · ws[i]ᵀ` on the planes [`matmul_add_for_norm`] just left
/// for this `x` and `norm` (the grouped launch's NORM form); `false` (nothing done) unless they
/// are there, nothing launched since, and the weights take the form.
pub fn rms_norm_matmuls_handed(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    (norm, eps): (&CudaWeight, f32),
    ws: &[&CudaWeight],
    outs: &mut [&mut Act<CudaSlice<f32>>],
) -> Result<bool> {
    let rows = x.rows;
    let mut guard = be
        .matmul
        .xqn
        .lock()
        .map_err(|_| anyhow!("matmul: norm plane scratch lock poisoned"))?;
    let Some(p) = guard.as_mut() else {
        return Ok(false);
    };
    if !p.take_for(be, x, norm) || !takes_handed(be, ws, rows)? {
        return Ok(false);
    }
    ensure!(
        ws.len() == outs.len() && p.cap >= x.cols,
        "rms_norm_matmuls: {} weights, {} outputs",
        ws.len(),
        outs.len()
    );
    for (w, out) in ws.iter().zip(outs.iter()) {
        crate::check_matmul(x, &w.shape, out)?;
        check_weight(w, "rms_norm_matmuls")?;
        ensure!(
            out.buf.len() >= rows * w.shape[0],
            "rms_norm_matmuls: output buffer smaller than its shape"
        );
    }
    let group: Vec<&mut &mut Act<CudaSlice<f32>>> = outs.iter_mut().collect();
    multi_launch(be, x, None, true, ws, group, Some((p, eps)))?;
    Ok(true)
}

/// The pair-ticket kernel of a K-split down projection of type `t` and whether its blocks are
/// of four warps: Q4_K's (`gemvq_tcknw4_q4_k_r1` or `gemvq_tckn_q4_k_r1`), Q8_0's (`tckn_q8`).
fn tckn_kernel(be: &CudaBackend, t: GgmlType) -> Option<(&CudaFunction, bool)> {
    let m = &be.matmul;
    match t {
        GgmlType::Q4K => m
            .tckn_w4
            .as_ref()
            .map(|f| (f, true))
            .or(m.tckn.as_ref().map(|f| (f, false))),
        GgmlType::Q8_0 => m.tckn_q8.as_ref().map(|(f, w4)| (f, *w4)),
        _ => None,
    }
}

/// `out += x · wᵀ` at one row by the pair-ticket producer (`gemvq_tckn_q4_k_r1`, the K-split
/// plan `(ks, kc, smem)` of [`tckn_plan`]) on x's int8 planes `xq`, leaving the planes of
/// `out ⊙ nw` and their groups' Σ out² in `p` (`matmul_add_for_norm` checked the shapes).
fn tckn_launch(
    be: &CudaBackend,
    xq: &XQuant,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
    nw: &cudarc::driver::CudaView<'_, f32>,
    p: &mut NormPlanes,
    (ks, kc, smem): (usize, usize, u32),
) -> Result<()> {
    let (f, w4) = tckn_kernel(be, w.dtype)
        .ok_or_else(|| anyhow!("matmul_add_for_norm: no pair-ticket kernel"))?;
    let (n_out, n_in, rb) = (w.shape[0], w.shape[1], w.row_bytes());
    ensure!(
        rb % 16 == 0 && n_out.is_multiple_of(32),
        "matmul_add_for_norm: K-split tile on rows not of 16-byte units"
    );
    let tck = lock_tck(be, n_out)?;
    let sc = tck
        .as_ref()
        .ok_or_else(|| anyhow!("matmul_add_for_norm: K-split scratch missing"))?;
    let cfg = LaunchConfig {
        grid_dim: (u32::try_from(n_out / 16)?, u32::try_from(ks)?, 1),
        block_dim: tc_block_dim(w4),
        shared_mem_bytes: smem,
    };
    let (rb_i, n_out_i, n_in_i, kc_i) = (rb as i64, n_out as i32, n_in as i32, kc as i32);
    let xd = xq.d.slice(..n_in / 32 * 2);
    let xqs = xq.q.slice(..2 * n_in);
    // SAFETY: w holds n_out rows of rb bytes (checked by the caller), 16-byte aligned with rb
    // a multiple of 16; the int8 scratch holds n_in quantized values of x; out (the residual,
    // read and written in place by one lane of each element) n_out floats; the norm weight
    // n_out; the plane scratch GEMV_MAX_ROWS rows of n_out; the K-split scratch
    // TCK_MAX_SPLITS × n_out partials and a ticket per 16-row tile (the pairs use the first
    // n_out / 32).
    unsafe {
        be.stream
            .kernel(f)
            .arg(&*w.data)
            .arg(&rb_i)
            .arg(&n_out_i)
            .arg(&n_in_i)
            .arg(&xqs)
            .arg(&xd)
            .arg(&kc_i)
            .arg(&sc.part)
            .arg(&sc.tickets)
            .arg(&mut out.buf)
            .arg(nw)
            .arg(&mut p.q)
            .arg(&mut p.d)
            .arg(&mut p.ss)
            .launch(cfg)
    }?;
    Ok(())
}

/// The SwiGLU on the planes `matmul_add_for_norm` just left for this `x` and `norm`
/// (`gemvq_swiglu_tcn_q4_k_r<R>`); `false` (nothing done) unless they are there and the
/// weights take the form.
pub fn rms_norm_matmul_swiglu_handed(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    (norm, eps): (&CudaWeight, f32),
    gate: &CudaWeight,
    up: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    let rows = x.rows;
    let Some(tc2) = be.matmul.tc2.as_ref() else {
        return Ok(false);
    };
    let mut guard = be
        .matmul
        .xqn
        .lock()
        .map_err(|_| anyhow!("matmul: norm plane scratch lock poisoned"))?;
    let Some(p) = guard.as_mut() else {
        return Ok(false);
    };
    let q8 = gate.dtype == GgmlType::Q8_0 && be.matmul.swiglu_n_q8_0.is_some();
    if !p.take_for(be, x, norm)
        || !((gate.dtype == GgmlType::Q4K || q8)
            && gate.dtype == up.dtype
            && gate.shape == up.shape
            && gemv_path(gate, rows) == Some(true))
    {
        return Ok(false);
    }
    let (n_out, n_in) = crate::check_matmul(x, &gate.shape, out)?;
    check_weight(gate, "rms_norm_matmul_swiglu")?;
    check_weight(up, "rms_norm_matmul_swiglu")?;
    ensure!(
        p.cap >= n_in && out.buf.len() >= rows * n_out,
        "rms_norm_matmul_swiglu: buffers smaller than [{rows}, {n_in}] -> {n_out}"
    );
    let rb = gate.row_bytes();
    let (ks, smem, tc) = gemvq_plan(
        be,
        gate.dtype,
        n_in,
        n_out,
        rb,
        n_out,
        2,
        rows,
        GemvKind::Swiglu,
    )?;
    let (rb_i, n_out_i, n_in_i, rows_i) = (rb as i64, n_out as i32, n_in as i32, rows as i32);
    let xd = p.d.slice(..rows * n_in / 32 * 2);
    let xqs = p.q.slice(..2 * rows * n_in);
    let ss = p.ss.slice(..rows * n_in / 32);
    if let (true, 1, Some((f, nb))) = (q8, rows, &be.matmul.swiglu_pipe) {
        // The ring (gemvq_swiglu_tcnp_q8_0_r1): whole rows of 16-byte units in the slots, 16
        // bytes apart beyond their length.
        let buf = tc_smem(rb + 16, 8) as usize;
        let x = tc_x_bytes(n_in) as usize;
        if rb.is_multiple_of(16) && n_in.is_multiple_of(256) && buf + x <= PIPE_MAX_SMEM {
            let nb = (*nb).min((PIPE_MAX_SMEM - x) / buf).max(1);
            let smem = u32::try_from(nb * buf + x)?;
            let block_dim = tc_block_dim(false);
            let per_sm = f
                .occupancy_max_active_blocks_per_multiprocessor(block_dim.0, smem as usize, None)
                .context("rms_norm_matmul_swiglu: the ring kernel's occupancy")?
                .max(1) as usize;
            let blocks = n_out.div_ceil(8).min(per_sm * be.sm_count.max(1));
            let nb_i = nb as i32;
            // h's planes for the down projection (FERRITE_SWIGLU_QH): in the GEMV scratch, if
            // it exists and holds a row of n_out, whole 32-row groups, and no block takes more
            // groups than its shared copy of h holds.
            let mut hguard = if be.matmul.swiglu_qh
                && n_out.is_multiple_of(32)
                && (n_out / 32).div_ceil(blocks) * 32 <= PIPE_QH_MAX
            {
                xq_for_producer(be, 1, n_out)?
            } else {
                None
            };
            let mut hplanes = hguard.as_mut().and_then(|g| g.as_mut());
            let (hq, hd) = match hplanes.as_mut() {
                Some(xq) => (
                    xq.q.device_ptr_mut(&be.stream).0,
                    xq.d.device_ptr_mut(&be.stream).0,
                ),
                None => (0, 0),
            };
            let mut launch = be.stream.kernel(f);
            launch
                .arg(&*gate.data)
                .arg(&*up.data)
                .arg(&rb_i)
                .arg(&n_out_i)
                .arg(&n_in_i)
                .arg(&nb_i)
                .arg(&xqs)
                .arg(&xd)
                .arg(&mut out.buf)
                .arg(&ss)
                .arg(&eps)
                .arg(&hq)
                .arg(&hd);
            // SAFETY: as below (the same buffers); the ring's shared memory is the nb buffers
            // and x that gemvq_swiglu_p_q80 lays out, nb ≤ PIPE_MAX_NB; hq / hd are one row of
            // the GEMV scratch (2 n_out bytes, n_out / 32 pairs) or null.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (u32::try_from(blocks)?, 1, 1),
                    block_dim,
                    shared_mem_bytes: smem,
                })
            }?;
            if let Some(xq) = hplanes {
                xq.record_producer(be, &out.buf, 1, n_out);
            }
            return Ok(true);
        }
    }
    if let (true, Some(fs), None) = (q8, &be.matmul.swiglu_n_q8_0, &tc) {
        let ks_i = ks as i32;
        // SAFETY: as below; the lane code's grid and split (gemvq_launch's SwiGLU: one row
        // group per output).
        unsafe {
            be.stream
                .kernel(&fs[gemv_r_index(rows)?])
                .arg(&*gate.data)
                .arg(&*up.data)
                .arg(&rb_i)
                .arg(&n_out_i)
                .arg(&n_in_i)
                .arg(&xqs)
                .arg(&xd)
                .arg(&rows_i)
                .arg(&mut out.buf)
                .arg(&ks_i)
                .arg(&ss)
                .arg(&eps)
                .launch(LaunchConfig {
                    shared_mem_bytes: smem,
                    ..gemv_config(n_out, ks)
                })
        }?;
        return Ok(true);
    }
    if !matches!(tc, Some(TcForm::Full(_))) {
        bail!("rms_norm_matmul_swiglu: the handed-over planes need the tensor-core SwiGLU");
    }
    // The W4 form (one row): four warps a block, the same sums in the same order.
    let w4 = be.matmul.swiglu_w4.as_ref().filter(|_| rows == 1);
    let cfg = LaunchConfig {
        grid_dim: (u32::try_from(n_out.div_ceil(8))?, 1, 1),
        block_dim: tc_block_dim(w4.is_some()),
        shared_mem_bytes: smem,
    };
    // SAFETY: both weights hold n_out rows of rb bytes (checked); the planes hold rows ×
    // n_in values with their scales and group sums (written by the producer just before);
    // out holds rows × n_out floats; one block per 8 SwiGLU outputs.
    unsafe {
        be.stream
            .kernel(w4.unwrap_or(&tc2[1][gemv_r_index(rows)?]))
            .arg(&*gate.data)
            .arg(&*up.data)
            .arg(&rb_i)
            .arg(&n_out_i)
            .arg(&n_in_i)
            .arg(&xqs)
            .arg(&xd)
            .arg(&rows_i)
            .arg(&mut out.buf)
            .arg(&ss)
            .arg(&eps)
            .launch(cfg)
    }?;
    Ok(true)
}

/// Token-tile width for a prefill matmul: 64 when 128-token tiles would leave most SMs idle
/// (fewer blocks than half the SMs) or most of a tile empty; `FERRITE_MM_BN` (128 or 64)
/// overrides it. Measured on the H200 (MATMUL.md): 4096→4096 at 512 rows (128 blocks of 128)
/// is faster with 128, 4096→1024 (32 blocks) with 64.
fn mm_bn(rows: usize, n_out: usize, sm_count: usize) -> usize {
    static FORCE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let force = *FORCE.get_or_init(|| {
        Some(switches::int_or("FERRITE_MM_BN", 0) as usize).filter(|b| MM_BN.contains(b))
    });
    if let Some(b) = force {
        return b;
    }
    token_tile(rows, n_out, sm_count)
}

/// The token-tile rule of the prefill matmul kernels with 128-output tiles (`mm_` here, `mmq_`,
/// `mmw_`'s 128 × BN tiles): 64 when 128-token tiles would leave more than half the SMs idle
/// or the rows fit one 64-token tile, else 128.
pub(crate) fn token_tile(rows: usize, n_out: usize, sm_count: usize) -> usize {
    let blocks128 = rows.div_ceil(128) * n_out.div_ceil(MM_TM);
    if rows <= 64 || 2 * blocks128 < sm_count.max(1) {
        64
    } else {
        128
    }
}

/// The kernel indices of a group of weights reading one x, for the prefill paths that take a
/// group only whole (mmq.rs, mmw.rs): each weight's shape checked against x and its output,
/// then `pick` per weight; `None` (the caller does nothing) for an empty or ragged group or as
/// soon as one weight has no kernel.
pub(crate) fn group_kernels(
    x: &Act<CudaSlice<f32>>,
    ws: &[&CudaWeight],
    outs: &[&mut Act<CudaSlice<f32>>],
    pick: impl Fn(&CudaWeight) -> Option<usize>,
) -> Result<Option<Vec<usize>>> {
    if ws.is_empty() || ws.len() != outs.len() {
        return Ok(None);
    }
    let mut tis = Vec::with_capacity(ws.len());
    for (w, out) in ws.iter().zip(outs.iter()) {
        crate::check_matmul(x, &w.shape, out)?;
        match pick(w) {
            Some(ti) => tis.push(ti),
            None => return Ok(None),
        }
    }
    Ok(Some(tis))
}

/// x (`[rows, n_in]` f32) → the bf16 scratch `[rows][kp]` (kp = n_in rounded up to whole
/// K steps of [`MM_TK`], zero beyond n_in) by `mm_x_bf16`, the scratch grown first if too
/// small; then `f(scratch, kp)` with the scratch locked: the launches `f` makes (`mm_` here,
/// `mmw`) read it in stream order.
pub(crate) fn with_bf16<R>(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    f: impl FnOnce(&CudaSlice<u16>, usize) -> Result<R>,
) -> Result<R> {
    with_bf16_rows(be, &x.buf, x.rows, x.cols, f)
}

/// [`with_bf16`] of the first `rows` rows of `n_in` floats in `x`.
pub(crate) fn with_bf16_rows<R>(
    be: &CudaBackend,
    x: &CudaSlice<f32>,
    rows: usize,
    n_in: usize,
    f: impl FnOnce(&CudaSlice<u16>, usize) -> Result<R>,
) -> Result<R> {
    with_scratch_rows(be, x, rows, n_in, (&be.matmul.mm_x, X16::Bf16), f)
}

/// [`with_bf16_rows`] with the conversion kernel `cvt` of form `kind` (`mm_x_bf16`'s
/// arguments; mmw.cu's `mmw_x_f16` writes f16 into the same scratch). No conversion where the
/// launch just before wrote x's rows there in that form ([`XbState`]).
pub(crate) fn with_scratch_rows<R>(
    be: &CudaBackend,
    x: &CudaSlice<f32>,
    rows: usize,
    n_in: usize,
    (cvt_kernel, kind): (&CudaFunction, X16),
    f: impl FnOnce(&CudaSlice<u16>, usize) -> Result<R>,
) -> Result<R> {
    let kp = n_in.div_ceil(MM_TK) * MM_TK;
    let need = rows * kp;
    ensure!(
        x.len() >= rows * n_in,
        "matmul: input [{rows}, {n_in}] exceeds its buffer"
    );
    ensure!(
        need / 8 <= i32::MAX as usize && kp <= i32::MAX as usize,
        "matmul: [{rows}, {n_in}] activations too large for the bf16 scratch"
    );
    let mut guard = lock_xb(be)?;
    let (cur, retired) = &mut *guard;
    let mut grown = false;
    if cur.as_ref().is_none_or(|b| b.len() < need) {
        let fresh = be.stream.alloc_zeros::<u16>(need.next_power_of_two())?;
        if let Some(old) = cur.replace(fresh) {
            retired.push(old);
        }
        grown = true;
    }
    let xb = cur
        .as_mut()
        .ok_or_else(|| anyhow!("matmul: bf16 scratch missing"))?;
    // Handed over by the launch just before (XbState): the rows are there already.
    let handed = {
        let mut st = lock_xb_state(be)?;
        st.last = Some(kind);
        let (ptr, _g) = x.device_ptr(&be.stream);
        let src = st.src.take();
        let missing = std::mem::take(&mut st.f32_missing);
        let handed = src == Some((ptr, rows, n_in, super::launch::launch_count(), kind)) && !grown;
        // A producer that left this x's f32 rows unwritten promised that its readers take the
        // hand-over (ops.rs `x16_only`): converting them instead would read stale floats.
        ensure!(
            handed || !missing || src.is_none_or(|s| s.0 != ptr),
            "matmul: x [{rows}, {n_in}] was handed over as 16-bit rows only, but this launch \
             cannot take them (an internal error: ops.rs x16_only and this path disagree)"
        );
        handed
    };
    if handed {
        return f(xb, kp);
    }
    let (rows_i, n_in_i, kp_i) = (rows as i32, n_in as i32, kp as i32);
    let cvt = LaunchConfig {
        grid_dim: ((need / 8).div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x holds rows×n_in floats (checked); xb holds ≥ rows×kp bf16.
    unsafe {
        be.stream
            .kernel(cvt_kernel)
            .arg(x)
            .arg(&rows_i)
            .arg(&n_in_i)
            .arg(&kp_i)
            .arg(&mut *xb)
            .launch(cvt)
    }?;
    f(xb, kp)
}

/// Prefill (rows > GEMV_MAX_ROWS): x → bf16 scratch by `mm_x_bf16`, then the tensor-core
/// `mm_<type>_n<BN>`.
#[allow(clippy::too_many_arguments)]
fn mm_launch(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
    ti: usize,
    rb: i64,
    n_out: usize,
    n_in: usize,
    rows: usize,
) -> Result<()> {
    let gy = n_out.div_ceil(MM_TM);
    ensure!(gy <= 65535, "matmul: {n_out} outputs exceed the grid limit");
    let bn = mm_bn(rows, n_out, be.sm_count);
    let bi = MM_BN
        .iter()
        .position(|&b| b == bn)
        .ok_or_else(|| anyhow!("matmul: no kernel for token tile {bn}"))?;
    with_bf16(be, x, |xb, kp| {
        let (n_out_i, n_in_i, rows_i, kp_i) = (n_out as i32, n_in as i32, rows as i32, kp as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(bn) as u32, gy as u32, 1),
            block_dim: (MM_THREADS, 1, 1),
            shared_mem_bytes: mm_smem(bn) as u32,
        };
        // SAFETY: shapes and buffer sizes checked by the caller; the kernel reads n_out rows
        // of rb bytes of W and rows×kp bf16 of xb, and writes rows×n_out floats of out.
        unsafe {
            be.stream
                .kernel(&be.matmul.mm[ti][bi])
                .arg(&*w.data)
                .arg(&rb)
                .arg(&n_out_i)
                .arg(&n_in_i)
                .arg(xb)
                .arg(&kp_i)
                .arg(&rows_i)
                .arg(&mut out.buf)
                .launch(cfg)
        }?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_keep_to_one_wave_where_they_can() {
        // Qwen3-8B's Q4_K_M QKV on 132 SMs: Q and K 256 + 64 tensor-core blocks; V (1024 Q6_K
        // rows of 4096 columns, 3360 bytes) splits 2 ways alone (8-row blocks of 26,896 B):
        // 448 blocks for 396 slots, so 16-row blocks (53,776 B): 384.
        let rb = 16 * 210;
        assert_eq!(
            one_wave_split(132, 3, 320, 512, 1, rb, (2, 26_896)),
            (1, 53_776)
        );
        // Qwen3-30B-A3B's (512 rows of 2048 columns, one split alone: 320 blocks): unchanged.
        assert_eq!(
            one_wave_split(132, 3, 288, 256, 1, 8 * 210, (1, 26_896)),
            (1, 26_896)
        );
        // Qwen3-8B Q8_0's o-projection (4096 rows of 4352 bytes): 512 blocks of 8 rows, or
        // 256 of 16 (69,648 B, three per SM).
        assert_eq!(
            one_wave_split(132, 3, 0, 2048, 1, 4352, (2, 34_832)),
            (1, 69_648)
        );
        // Reckoned with four blocks per SM (its lane kernels' registers allow four): 512
        // blocks fit one wave already; its QKV (3072 groups: 768 blocks) takes 16-row blocks.
        assert_eq!(
            one_wave_split(132, 4, 0, 2048, 1, 4352, (2, 34_832)),
            (2, 34_832)
        );
        assert_eq!(
            one_wave_split(132, 4, 0, 3072, 1, 4352, (2, 34_832)),
            (1, 69_648)
        );
        // Its down projection (12288 columns): no split fits one wave, its own stays.
        assert_eq!(
            one_wave_split(132, 3, 0, 2048, 1, 13_056, (8, 26_128)),
            (8, 26_128)
        );
        // No split short of its own fits one wave: its own.
        assert_eq!(
            one_wave_split(16, 3, 320, 512, 1, rb, (2, 26_896)),
            (2, 26_896)
        );
        // Blocks that would not fit shared memory: its own.
        assert_eq!(
            one_wave_split(132, 3, 320, 512, 1, 8 * rb, (4, 107_536)),
            (4, 107_536)
        );
    }

    #[test]
    fn k_split_slices_are_whole_aligned_super_blocks() {
        // Qwen3-8B's down projections: three 4096-column slices; Llama-3-8B's 14336 columns:
        // Q4_K four of 3584, Q6_K 16-super-block slices (16-byte aligned) and a short last.
        let m = TCK_MAX_COLS;
        assert_eq!(tck_split(GgmlType::Q4K, 12288, m), Some((3, 4096)));
        assert_eq!(tck_split(GgmlType::Q6K, 12288, m), Some((3, 4096)));
        assert_eq!(tck_split(GgmlType::Q4K, 14336, m), Some((4, 3584)));
        assert_eq!(tck_split(GgmlType::Q6K, 14336, m), Some((4, 4096)));
        assert_eq!(tck_split(GgmlType::Q4K, 12288, 2048), Some((6, 2048)));
        // Q8_0 (272-byte units of 256 columns): Qwen3-8B's downs in six 2048-column slices
        // (TCK_Q8_COLS), Llama-3-8B's in seven.
        assert_eq!(
            tck_split(GgmlType::Q8_0, 12288, TCK_Q8_COLS),
            Some((6, 2048))
        );
        assert_eq!(
            tck_split(GgmlType::Q8_0, 14336, TCK_Q8_COLS),
            Some((7, 2048))
        );
        assert_eq!(tck_split(GgmlType::Q8_0, 12288, m), Some((3, 4096)));
        // One slice, misaligned Q6_K, other types, partial super-blocks, off: not split.
        assert_eq!(tck_split(GgmlType::Q4K, 4096, m), None);
        assert_eq!(tck_split(GgmlType::Q6K, 256 * 20, m), None);
        assert_eq!(tck_split(GgmlType::Q5K, 12288, m), None);
        assert_eq!(tck_split(GgmlType::Q8_0, 12288 + 32, m), None);
        assert_eq!(tck_split(GgmlType::Q4K, 12288 + 32, m), None);
        assert_eq!(tck_split(GgmlType::Q4K, 12288, 0), None);
        assert_eq!(tck_split(GgmlType::Q6K, 12288, 1024), None);
        for t in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0] {
            for nsb in (8..=256).step_by(8) {
                if let Some((ks, kc)) = tck_split(t, nsb * 256, m) {
                    let bytes = match t {
                        GgmlType::Q4K => 144,
                        GgmlType::Q6K => 210,
                        _ => 272,
                    };
                    assert!(
                        kc <= TCK_MAX_COLS && ks * kc >= nsb * 256 && (ks - 1) * kc < nsb * 256
                    );
                    assert_eq!(kc / 256 * bytes % 16, 0, "{t} {nsb}");
                }
            }
        }
    }

    #[test]
    fn gemv_sizes_cover_the_gemv_rows() {
        assert_eq!(GEMV_R.last().copied(), Some(GEMV_MAX_ROWS));
        assert!(GEMV_R.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(GEMV_R[0], 1);
    }

    #[test]
    fn every_type_has_kernels() {
        // Directly, or in the type the upload holds it in (MXFP4 as Q8_0, or BF16).
        for t in GgmlType::ALL {
            let d = crate::cuda::ops::device_type(t);
            assert!(type_index(d).is_ok(), "{t} held as {d}");
        }
    }
}
