//! `ferrite check`: every op of the [`Backend`] trait on the backend under test against the
//! CPU reference backend, modeled on llama.cpp's `test-backend-ops`.
//!
//! Each case draws fresh random inputs from its own seed (a hash of the global seed and the
//! case name, so `--filter` never changes a case's data; never zeros), builds the case on
//! both backends from the SAME host data, poisons the outputs (NaN, plus one extra poisoned
//! row past the active rows that must survive: kernels may touch only `rows`), runs the op
//! on both and compares:
//!
//! - NMSE = mse(test, cpu) / mse(cpu, 0) must be ≤ the op's threshold (named constants
//!   below, each with the reason for its size), every value finite;
//! - argmax must be exactly equal.
//!
//! One line per case, then the Backend ops that have no case, then `ALL GREEN` or
//! `N FAILED` (and a non-zero exit code). `--perf` also times each case on the backend
//! under test (warm-up, then batches of repetitions, median) and prints µs, the GB/s of the
//! bytes the op must move, and that as a % of the measured copy bandwidth.
//!
//! Weights are real quantizations of random rows where that is cheap; large weights (the
//! real Qwen3 shapes, 128-expert stacks) are built block by block: random quant bytes with
//! sane f16 scales (the K-quant reference quantizer runs at tens of MB/s).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use ferrite_backend::cpu::{route_top_k, CpuBackend};
use ferrite_backend::cuda::attention::KvType;
use ferrite_backend::cuda::matmul as cuda_matmul;
use ferrite_backend::cuda::CudaBackend;
use ferrite_backend::{
    Act, AttnArgs, AttnShape, Backend, DeltaArgs, DeltaShape, ExpertWeights, HostTensor,
    MoeRouting, PagedKv, QkRope, Rope, RopeStyle, SeqRows, StepBatch, StepInput,
};
use ferrite_formats::{quant, GgmlType};
use rayon::prelude::*;

use crate::Device;

#[path = "check_paged.rs"]
mod paged;

// ============================================================================ thresholds

/// Exact ops (copies): the bits must be equal.
const EXACT_NMSE: f64 = 0.0;
/// Elementwise f32 arithmetic (add, SwiGLU, RMSNorm, embedding decode): at most a few ulp
/// per element from `expf`/`rsqrtf`/FMA contraction and reduction order, i.e. relative
/// errors ~1e-7 → NMSE ~1e-14. 1e-12 leaves room; any indexing error gives NMSE ≥ 1e-2.
const ELEMENTWISE_NMSE: f64 = 1e-12;
/// RoPE: the angle `pos · θ^(-2i/d)` amplifies a 1-ulp difference of `powf` between CUDA and
/// Rust by the position (1e-7 relative × pos ~1000 → ~1e-4 rad at worst on a few pairs),
/// worth NMSE ~1e-10; a wrong pairing or position gives ≥ 1e-2.
const ROPE_NMSE: f64 = 1e-8;
/// Decode GEMV (rows ≤ GEMV_MAX_ROWS): weights decoded exactly, f32 activations and
/// accumulation; only the summation order differs from the CPU (relative ~1e-7 per output
/// → NMSE ~1e-13).
const MATMUL_GEMV_NMSE: f64 = 1e-9;
/// Decode GEMV of the quantized weight types: x held as two int8 planes per 32-element block
/// (x ≈ d·(127·hi + lo), error ≤ d/2 = amax/32258 per element: NMSE ~1e-9 on a dot product;
/// one plane measured 2e-5..1e-4), weights exact, integer dot products, f32 scales. 5e-8
/// leaves headroom over the expected ~1e-9; a wrong element, scale or block gives ≥ 1e-2.
const MATMUL_GEMVQ_NMSE: f64 = 5e-8;
/// Prefill matmul (more rows) on the tensor cores: activations (and dequantized weights)
/// rounded to bf16 (8 significant bits, relative RMS ~1.1e-3 per operand) gives NMSE
/// ~1e-6; 1e-5 leaves headroom, and a wrong tile or layout gives ≥ 1e-2.
const MATMUL_TC_NMSE: f64 = 1e-5;
/// `silu(g) · u` of two matmul outputs carries both their errors, and silu shrinks the
/// reference's magnitude (negative g) more than the error: measured NMSE ~4–8× the plain
/// matmul's on the H200 (e.g. 2.5e-4 for Q4_K at 512→300 with one int8 plane of x, 1.7e-5
/// on the tensor cores).
const SWIGLU_NMSE_FACTOR: f64 = 5.0;

/// The threshold of a matmul of a `ty` weight with `n_out` outputs on `rows` rows: that of
/// the kernel the CUDA launcher picks.
fn matmul_nmse(ty: GgmlType, n_out: usize, rows: usize) -> f64 {
    if cuda_matmul::gemvq_applies(ty, n_out, rows) {
        MATMUL_GEMVQ_NMSE
    } else if rows <= GEMV_MAX_ROWS {
        MATMUL_GEMV_NMSE
    } else {
        MATMUL_TC_NMSE
    }
}

/// Rows at or below which a matmul runs the decode GEMV (the f32 path); the CUDA
/// launcher's own switch point, so the threshold follows the kernel actually run.
const GEMV_MAX_ROWS: usize = ferrite_backend::cuda::matmul::GEMV_MAX_ROWS;
/// Rows at or below which attention runs the decode kernel (f32 math over the cache).
const ATTN_DECODE_MAX_ROWS: usize = ferrite_backend::cuda::attention::DECODE_MAX_ROWS;
/// Attention with an f32 KV cache: summation order only.
const ATTN_F32_NMSE: f64 = 1e-9;
/// Decode attention over an f16 KV cache: each cached K/V element rounded to 11 bits
/// (relative RMS ~1.4e-4), through the softmax and the weighted sum NMSE ~1e-7.
const ATTN_F16_DECODE_NMSE: f64 = 1e-6;
/// Attention over an f16 KV cache on the tensor cores (Q and P rounded to f16 for the
/// MMAs): NMSE ~1e-7..1e-6. The prefill, and decode at the tensor-core decode head size.
/// Causal-mask and position errors show at the short depths as ≥ 1e-3.
const ATTN_F16_TC_NMSE: f64 = 1e-5;
/// The head size whose decode runs on the tensor cores (`FERRITE_ATTN_DTC`).
const ATTN_DECODE_TC_HEAD_DIM: usize = ferrite_backend::cuda::attention::DECODE_TC_HEAD_DIM;
/// Attention over a q8_0 KV cache: step amax/127 per 32 values, an error of relative RMS
/// ~6e-3 per element, NMSE ~4e-5 through V and the scores; 5e-4 still fails any
/// indexing error (≥ 1e-2).
const ATTN_Q8_NMSE: f64 = 5e-4;
/// MoE at decode rows (≤ 16): expert GEMVs with f32 activations and exact weight decoding
/// (measured ~1e-13); only summation order differs, as for the f32 GEMV.
const MOE_DECODE_NMSE: f64 = 1e-9;
/// MoE at decode rows with quantized expert weights: x and the SwiGLU activations held as
/// two int8 planes (as the quantized GEMV, twice in a chain, plus the SwiGLU's amplification:
/// see SWIGLU_NMSE_FACTOR; one plane measured 1.3–1.6e-4, two should be ~127² smaller).
/// A wrong expert, slot or row gives ≥ 1e-2.
const MOE_DECODE_Q8_NMSE: f64 = 2e-7;
/// MoE at prefill: the grouped tensor-core path rounds x, the SwiGLU activations and the
/// dequantized weights to bf16 (8 significant bits: relative RMS ~2e-3 per operand) through
/// two chained GEMMs: measured 1.5–1.8e-5 (bf16 weights ~8e-6). A wrong expert choice, slot
/// order or tile gives NMSE ≥ 1e-2.
const MOE_PREFILL_NMSE: f64 = 5e-5;
/// Residual add fused with RMSNorm: the sum is the same f32 add as `add_assign` (bitwise),
/// the norm the same arithmetic as `rms_norm` (f32 reduction in another order than the
/// CPU's f64 sum): as any elementwise op. The NMSE is taken over each output (x and h)
/// apart and the larger reported, so an error in one is not diluted by the other.
const ADD_RMS_NORM_NMSE: f64 = ELEMENTWISE_NMSE;
/// QK-norm + RoPE: the per-head norm is elementwise-exact (~1e-14); the rotation's angle
/// error (see ROPE_NMSE) dominates, so RoPE's threshold. A wrong head, pair, weight or
/// q/k mix-up gives ≥ 1e-2.
const QK_NORM_ROPE_NMSE: f64 = ROPE_NMSE;
/// The rotation of the qk_norm_rope+attention cases: Qwen3's (NeoX over all 128 dims); the
/// Qwen3.5 cases take its style and base on their own `rot_dim`.
const ATTN_ROPE: Rope = Rope {
    style: RopeStyle::Neox,
    theta: 1e6,
    rot_dim: 128,
    inv_freq: None,
};
/// A RoPE scaling's frequency table for the scaled cases: the unscaled frequencies with the
/// longer wavelengths slowed, up to 8× at the longest, as Llama 3.1's "llama3" scaling does
/// (the kernels take whatever the table holds; this gives them a table unlike theta's).
fn scaled_inv_freq(theta: f32, rot_dim: usize) -> Arc<[f32]> {
    let half = rot_dim / 2;
    Rope::unscaled_inv_freq(theta, rot_dim)
        .enumerate()
        .map(|(i, f)| f / (1.0 + 7.0 * i as f32 / (half - 1).max(1) as f32))
        .collect()
}

/// The case label's mark of a scaled rotation.
fn scaled_label(inv_freq: &Option<Arc<[f32]>>) -> &'static str {
    if inv_freq.is_some() {
        " scaled"
    } else {
        ""
    }
}

/// Graph capture + replay of RoPE at new positions: as RoPE.
const GRAPH_NMSE: f64 = ROPE_NMSE;
/// Causal conv1d: a K-tap f32 dot product per output then SiLU: FMA contraction and `expf`
/// differ from the CPU by an ulp or two, as any elementwise op. A wrong tap, channel or
/// state row gives NMSE ≥ 1e-2.
const CONV1D_NMSE: f64 = ELEMENTWISE_NMSE;
/// Gated delta rule: f32 throughout on both sides, but the GPU sums the key dimension in 4
/// partial sums (one per lane of a state column) and contracts multiply-adds, and the
/// recurrence carries those roundings from token to token (decays ≤ 1 and the delta-rule
/// update are contractions, so they do not grow): relative errors ~1e-7..1e-6 → NMSE
/// ~1e-13..1e-11. 1e-9 leaves room; a wrong head mapping, decay, β or state row gives
/// NMSE ≥ 1e-3.
const GATED_DELTA_NMSE: f64 = 1e-9;
/// Snapshot/restore: the copies are exact, so the outputs after a restore differ from the CPU
/// only as conv1d's and the delta rule's do (each output compared apart against the looser of
/// the two). Restoring the wrong state changes the first `kernel - 1` conv rows and the
/// carried recurrence: skipping the restore or restoring the other slot gave NMSE ≥ 2e-2 in
/// every case (measured on the CPU by breaking the harness on purpose).
const SNAPSHOT_NMSE: f64 = GATED_DELTA_NMSE;
/// Batched conv + delta rule: each segment runs the one-sequence arithmetic on its own slot,
/// so its outputs differ from the CPU's only as those ops' do. A segment on another slot, or
/// a slot left uncleared, starts from a different state: the case's first rows then differ
/// at the inputs' scale.
const DELTA_BATCH_NMSE: f64 = GATED_DELTA_NMSE;
/// Rows each state slot takes in a [`Op::DeltaBatch`] case before the checked steps (so no
/// slot's state is zero unless cleared).
const DELTA_BATCH_DIRTY: usize = 3;
/// Gated RMSNorm (f32 reduction against the CPU's f64 one) and the sigmoid gate: elementwise.
const GATED_NORM_NMSE: f64 = ELEMENTWISE_NMSE;
const SIGMOID_GATE_NMSE: f64 = ELEMENTWISE_NMSE;

/// RMSNorm epsilon used by the cases (Qwen3's).
const EPS: f32 = 1e-6;
/// Rows per KV-fill step before an attention case (a prefill chunk).
const FILL_CHUNK: usize = 512;

// ============================================================================ CLI

/// Arguments of `ferrite check`.
#[derive(Args, Clone, Debug)]
pub struct CheckArgs {
    /// Backend under test: `cuda`, `cpu` (the CPU backend against itself: NMSE 0), or `auto`
    /// (CUDA when a GPU is usable, else the CPU against itself).
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Also time each case on the backend under test: µs, GB/s, % of the copy bandwidth.
    #[arg(long)]
    pub perf: bool,
    /// With --perf: time launches back to back instead of replaying a captured graph. A path
    /// that never runs under capture (cuBLASLt's prefill GEMMs) is only timed this way; the
    /// times then include the host's launch overhead.
    #[arg(long, requires = "perf")]
    pub eager: bool,
    /// Run only the cases whose name contains this text.
    #[arg(long)]
    pub filter: Option<String>,
    /// A reduced case set (small shapes only; for CI).
    #[arg(long)]
    pub quick: bool,
    /// List the cases and exit.
    #[arg(long)]
    pub list: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// Repetitions per timing batch in --perf mode (5 batches after a warm-up; median).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// CPU threads for the reference backend (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// After the op cases, run the end-to-end gates (whole models against the CPU and the
    /// Hugging Face oracle logits, prefill/decode gate) with the oracle checkpoints of this
    /// directory (the repository's `tests/data/oracle`).
    #[arg(long, value_name = "ORACLE_DIR")]
    pub e2e: Option<std::path::PathBuf>,
}

/// Runs `ferrite check`; an error (non-zero exit) when any case fails.
pub fn check(args: &CheckArgs) -> Result<()> {
    crate::load::init_threads(args.threads);
    let all = cases(args.quick);
    if args.list {
        for c in &all {
            println!("{}", c.name);
        }
        return Ok(());
    }
    let failed = match args.device {
        Device::Cpu => run_all(&CpuBackend::new(), &all, args)?,
        Device::Cuda => {
            ensure_gpu()?;
            run_all(&CudaBackend::new(0)?, &all, args)?
        }
        Device::Auto => {
            if CudaBackend::available() {
                run_all(&CudaBackend::new(0)?, &all, args)?
            } else {
                println!(
                    "no GPU found (the CUDA driver did not load or reports no device): \
                     checking the CPU backend against itself"
                );
                run_all(&CpuBackend::new(), &all, args)?
            }
        }
    };
    if failed > 0 {
        bail!("{failed} FAILED");
    }
    Ok(())
}

/// The op cases, then the end-to-end gates when asked, then the verdict line.
fn run_all<B: Backend>(be: &B, all: &[Case], args: &CheckArgs) -> Result<usize> {
    let mut failed = run_cases(be, &CpuBackend::new(), all, args)?;
    if let Some(dir) = &args.e2e {
        println!("end-to-end gates ({}):", dir.display());
        let scratch = std::env::temp_dir().join(format!("ferrite-check-{}", std::process::id()));
        let r = crate::check_e2e::run(be, dir, &scratch);
        std::fs::remove_dir_all(&scratch).ok();
        match r {
            Ok(n) => failed += n,
            Err(e) => {
                println!("end-to-end gates: ERROR {e:#}  FAIL");
                failed += 1;
            }
        }
    }
    if failed == 0 {
        println!("ALL GREEN");
    } else {
        println!("{failed} FAILED");
    }
    Ok(failed)
}

fn ensure_gpu() -> Result<()> {
    anyhow::ensure!(
        CudaBackend::available(),
        "--device cuda: no GPU found (the CUDA driver did not load or reports no device)"
    );
    Ok(())
}

// ============================================================================ cases

/// The Backend ops `ferrite check` knows about (the data-movement methods upload, zeros,
/// from_host, to_host, set_step and read_i32 are exercised by every case; defers_rms_norm by
/// the rms_norm_matmuls and rms_norm_matmul_swiglu cases, defers_rms_norm_after by the
/// matmul_add_for_norm ones).
const OPS: &[&str] = &[
    "embed",
    "rms_norm",
    "head_rms_norm",
    "matmul",
    "matmuls",
    "matmul_swiglu",
    "swiglu_mlp",
    // The deferred-RMSNorm decode projections and the residual add in a projection's epilogue.
    "rms_norm_matmuls",
    "rms_norm_matmul_swiglu",
    "matmul_add",
    // The o-projection's residual add handing the FFN norm's input to the gate/up
    // projections (matmul_add_for_norm, then rms_norm_matmul_swiglu; defers_rms_norm_after),
    // and the down projection's handing the attention norm's to the Q, K, V (then
    // rms_norm_matmuls).
    "matmul_add_for_norm",
    "copy_rows",
    "gather_rows",
    "add_assign",
    "swiglu",
    "rope",
    "add_rms_norm",
    "add_rms_norm_matmul",
    "moe_predict_logits",
    "qk_norm_rope",
    "attention",
    "qk_norm_rope_attention",
    "moe",
    "argmax",
    "argmax_feed",
    "top_k",
    "capture/replay",
    // Qwen3.5's hybrid-layer ops (the fresh-state cases cover kv_new_hybrid).
    "kv_new_hybrid",
    "causal_conv1d",
    "gated_delta_rule",
    "gated_rms_norm",
    "sigmoid_gate",
    // State snapshots for speculative rollback (kv_snapshots, kv_snapshot, kv_restore).
    "kv_snapshot/kv_restore",
    // Batched steps of hybrid models: the pooled state, clearing and copying a slot, and the
    // conv and delta rule on each sequence's own slot.
    "kv_new_paged_hybrid/kv_clear_state/kv_copy_state",
];

#[derive(Clone, Debug)]
enum Op {
    Embed {
        ty: GgmlType,
        vocab: usize,
        dim: usize,
        rows: usize,
    },
    RmsNorm {
        wty: GgmlType,
        rows: usize,
        cols: usize,
    },
    HeadRmsNorm {
        rows: usize,
        heads: usize,
        head_dim: usize,
    },
    Matmul {
        ty: GgmlType,
        n_in: usize,
        n_out: usize,
        rows: usize,
    },
    /// `matmuls` of two weights of type `ty` reading the same x (a [1024, n_in] one first,
    /// or `[n_out, n_in]` for small outputs: see `matmuls_first_rows`; then the checked
    /// `[n_out, n_in]` one): at decode rows one grouped launch. With `v`, a
    /// third `[n_out, n_in]` weight of type `v` follows (Q4_K_M's Q, K, V: one mixed-type
    /// launch), and `checked` says which output is checked (0 the first, 1 the second, 2 the
    /// third; 1 without `v`).
    Matmuls {
        ty: GgmlType,
        n_in: usize,
        n_out: usize,
        rows: usize,
        v: Option<GgmlType>,
        checked: usize,
    },
    /// `silu(gate · x) ⊙ (up · x)` (`matmul_swiglu`), gate and up of type `ty`. With `down`,
    /// the down projection (`[n_in, n_out]`, type `ty`) of that output follows and is what is
    /// checked (`swiglu_mlp`): the FFN's two decode GEMVs in a row, the second on the first's
    /// quantized output, or at prefill the gate/up launch writing the down's 16-bit x.
    MatmulSwiglu {
        ty: GgmlType,
        n_in: usize,
        n_out: usize,
        rows: usize,
        down: bool,
    },
    /// `outs[i] = (rms_norm(x) · norm) · ws[i]ᵀ` (`rms_norm_matmuls`): an f32 norm of
    /// `n_in`, then one `[n_out, n_in]` weight of type `ty` per entry of `n_outs`, every
    /// output checked (each apart). x is the raw residual (rows of unequal norms).
    RmsNormMatmuls {
        ty: GgmlType,
        n_in: usize,
        n_outs: &'static [usize],
        rows: usize,
    },
    /// `silu(gate · h) ⊙ (up · h)`, `h = rms_norm(x) · norm` (`rms_norm_matmul_swiglu`),
    /// gate and up `[n_out, n_in]` of type `ty`.
    RmsNormMatmulSwiglu {
        ty: GgmlType,
        n_in: usize,
        n_out: usize,
        rows: usize,
    },
    /// `out += x · wᵀ` (`matmul_add`), `w` `[n_out, n_in]` of type `ty`, `out` a random
    /// residual (restored before the op); on any backend bitwise `matmul` + `add_assign`
    /// (run_once asserts it).
    MatmulAdd {
        ty: GgmlType,
        n_in: usize,
        n_out: usize,
        rows: usize,
    },
    /// The o-projection into the residual, then the FFN's first half on its norm:
    /// `matmul_add_for_norm(att, w_o, x, y, norm)` then
    /// `rms_norm_matmul_swiglu(x, norm, gate, up)` back to back (the pair a backend may fuse:
    /// `defers_rms_norm_after`). `w_o` `[hidden, hidden]`, gate and up `[ffn, hidden]`, all of
    /// type `ty`; `x` a random residual (restored before the op). Checked: the SwiGLU output
    /// and the residual after the op (each apart, each against its own threshold); run_once
    /// also asserts the residual bitwise equal to plain `matmul_add`'s on the same backend.
    AddNormSwiglu {
        ty: GgmlType,
        hidden: usize,
        ffn: usize,
        rows: usize,
    },
    /// The down projection, the residual add and the next layer's Q, K, V on the attention
    /// norm, as the decoder runs them: where the backend hands the norm over from the down
    /// projection (`defers_rms_norm_after(w_down, [wq, wk, wv])`), `matmul_add_for_norm`
    /// then `rms_norm_matmuls`; else `matmul`, `add_rms_norm` and `matmuls`. The down
    /// projection `[n_in, down.1]` of type `down.0` on a random input; Q, K `[n_outs[0|1],
    /// n_in]` of type `ty`, V of `ty_v`; `x` a random residual (restored before the op).
    /// Checked: q, the residual after the op, k, v (each apart).
    AddNormMatmuls {
        ty: GgmlType,
        ty_v: GgmlType,
        n_in: usize,
        n_outs: [usize; 3],
        rows: usize,
        down: (GgmlType, usize),
    },
    Rope {
        rows: usize,
        heads: usize,
        head_dim: usize,
        rope: Rope,
        pos0: usize,
    },
    AddAssign {
        rows: usize,
        cols: usize,
    },
    /// `x += y; h = rms_norm(x) · w`.
    AddRmsNorm {
        wty: GgmlType,
        rows: usize,
        cols: usize,
    },
    /// A MoE block's input and router: `s = x + y; h = rms_norm(s) · w; out = h · wmᵀ` (f32
    /// router `[n_out, cols]`). The outputs checked: the logits, then `h + s` (one sum, so a
    /// wrong h or a wrong s shows), wherever the op put s (in place or in the other
    /// buffer). On any backend the op must also equal its composition (add_rms_norm, matmul)
    /// bitwise: the decode step takes the fused form at one row and the composition at
    /// more, and a decode must not depend on the rows around it (run_once asserts it).
    AddRmsNormMatmul {
        rows: usize,
        cols: usize,
        n_out: usize,
    },
    /// The MoE expert prediction at one row (`moe_predict_logits`: on CUDA the kernel of
    /// `moe_prefetch`, which also checks its picks against its own logits): `out = (rms_norm(x)
    /// · w) · routerᵀ`, an f32 norm of `cols` and an f32 router `[n_experts, cols]`.
    MoePredict {
        cols: usize,
        n_experts: usize,
    },
    /// Per-head RMSNorm (when `norm`) + RoPE on q and k in one op.
    QkNormRope {
        rows: usize,
        q_heads: usize,
        k_heads: usize,
        head_dim: usize,
        rope: Rope,
        norm: bool,
        pos0: usize,
    },
    Swiglu {
        rows: usize,
        cols: usize,
    },
    CopyRows {
        src_rows: usize,
        cols: usize,
        start: usize,
        rows: usize,
    },
    /// `out[i] = x[pick[i]]`.
    GatherRows {
        src_rows: usize,
        cols: usize,
        pick: &'static [usize],
    },
    /// Batched attention over a paged KV cache (`check_paged.rs`).
    Paged(paged::PagedCase),
    Attention {
        shape: AttnShape,
        pos0: usize,
        rows: usize,
        /// The cache in q8_0 blocks (`Backend::kv_new_q8`; the CPU reference keeps f32).
        q8: bool,
    },
    /// A prefill's attention over an f16 cache filled to `pos0`, then its o-projection (`[qd,
    /// qd]` of type `ty`, qd = heads × head_dim), after a first matmul of the same weight on q
    /// (the Q, K, V projections' place: the prefill's 16-bit x form), as the decoder runs
    /// them: on CUDA the attention writes the projection's 16-bit x (`FERRITE_ATTN_X16`).
    /// Checked: the projection's output, and the attention's (out2) unless `o_only`: then the
    /// attention is told that the projection alone reads its output (`attention_for`; CUDA may
    /// leave its f32 rows unwritten, so they are scratch poisoned with NaN, not an output).
    AttnO {
        shape: AttnShape,
        pos0: usize,
        rows: usize,
        ty: GgmlType,
        o_only: bool,
    },
    /// QK-norm + RoPE (both norms, NeoX over the first `rot_dim` dims: Qwen3's all 128, Qwen3.5's
    /// 64 of 256) then `rows` rows of attention over an f16 cache filled to `pos0`, by
    /// `qk_norm_rope_attention` (CUDA: at one decode row one launch where the cache takes the
    /// keys-before-the-wait cluster form; at prefill rows the keys and values stored by the
    /// rotation's launch). Checked: the output.
    AttnRope {
        shape: AttnShape,
        rot_dim: usize,
        pos0: usize,
        rows: usize,
        /// A RoPE scaling's frequency table ([`scaled_inv_freq`]; CUDA's `_tab` kernels, the
        /// composition at a decode row), or `None`: Qwen3's base alone.
        inv_freq: Option<Arc<[f32]>>,
    },
    /// The experts alone (`moe`), or (`shared`) with Qwen3.5's gated shared expert of the
    /// experts' types, by `moe_shared` (CUDA: the shared expert inside the MoE launches; it
    /// must take that form where the case is one it fuses) or else the composition.
    Moe {
        routing: MoeRouting,
        hidden: usize,
        ffn: usize,
        gate_ty: GgmlType,
        down_ty: GgmlType,
        rows: usize,
        shared: bool,
    },
    Argmax {
        rows: usize,
        cols: usize,
        kind: ArgmaxKind,
    },
    /// One row's argmax fed to the next decode step (`argmax_feed`): the step at position
    /// `pos`, a log of `FEED_CHECK_LOG` entries (one more allocated: it must stay untouched).
    /// Checked exactly: the argmax, the step's token and position after it, the whole log.
    ArgmaxFeed {
        cols: usize,
        pos: usize,
        kind: ArgmaxKind,
    },
    /// The k best logits per row (device-side top-k for sampling).
    TopK {
        rows: usize,
        cols: usize,
        k: usize,
        kind: ArgmaxKind,
    },
    /// copy_rows + rope captured at one position and replayed at another.
    Graph {
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos_capture: usize,
        pos_replay: usize,
    },
    /// causal_conv1d over `shape.conv_dim()` channels: a first call of `fill` rows (the
    /// state it leaves is carried), then the checked call of `rows`.
    Conv1d {
        shape: DeltaShape,
        wty: GgmlType,
        fill: usize,
        rows: usize,
    },
    /// gated_delta_rule: a first call of `fill` rows, then the checked call of `rows`. With
    /// `chunked`, calls of ≥ 17 rows run CUDA's chunked tensor-core kernel whatever
    /// `FERRITE_DELTA_CHUNKED` says (`cuda::gated_delta::force_chunked`).
    GatedDelta {
        shape: DeltaShape,
        fill: usize,
        rows: usize,
        chunked: bool,
    },
    /// State rollback on a hybrid cache with two snapshot slots (layer 1, the end of the
    /// state buffers): conv1d + delta rule over `fill` rows, snapshot into slot 1, `draft`
    /// other rows, snapshot into slot 0; then the checked part restores slot 1 and runs
    /// `rows` new rows (out: the conv output, out2: the delta rule's). A restore that does
    /// not bring back the post-fill state, or a snapshot that aliases the live state or
    /// another slot, changes both outputs. With `row`, the cache also keeps `draft` row
    /// states (kv_row_states) and the checked part restores the state after draft row `row`
    /// (kv_restore_row) instead: the speculative verify's rollback.
    Snapshot {
        shape: DeltaShape,
        fill: usize,
        draft: usize,
        rows: usize,
        row: Option<usize>,
    },
    /// A hybrid model's batched step on a pooled cache (`kv_new_paged_hybrid`): sequence `i`
    /// of `rows.len()` on state slot `rows.len() - i` of `rows.len() + 1` (reversed, slot 0
    /// unused: a slot offset or stride error shows). Every slot first takes 3 rows of a
    /// batched step (its state no longer zero), the even sequences' slots are cleared
    /// (`kv_clear_state`), sequence 1's takes a copy of slot 0's (`kv_copy_state`), a
    /// batched step feeds sequence `i` `fills[i]` rows (those with any),
    /// then the checked step runs `rows[i]` rows of each (out: the conv output, out2: the
    /// delta rule's). The CPU runs each segment as a call on that sequence alone.
    DeltaBatch {
        shape: DeltaShape,
        fills: Vec<usize>,
        rows: Vec<usize>,
    },
    GatedRmsNorm {
        rows: usize,
        heads: usize,
        head_dim: usize,
    },
    /// `x *= sigmoid(gate)`; `per_row`: a one-column gate (the shared expert's).
    SigmoidGate {
        rows: usize,
        cols: usize,
        per_row: bool,
    },
    /// A Qwen3.5 gate and the Q4_K projection that reads its output ([n_out, cols]): the
    /// linear layers' `gated_rms_norm` (`head_dim`) or the gated attention's per-element
    /// `sigmoid_gate` (None). At decode rows the gate writes the GEMV's int8 planes itself
    /// (`FERRITE_GATE_QX`), so out (the projection's) checks those planes.
    GateMatmul {
        rows: usize,
        cols: usize,
        head_dim: Option<usize>,
        n_out: usize,
    },
}

/// `k16x128/v32x128 K4 tiled`: a linear-attention shape in case names.
fn delta_name(s: &DeltaShape) -> String {
    format!(
        "k{}x{}/v{}x{} K{} {}",
        s.n_k_heads,
        s.k_head_dim,
        s.n_v_heads,
        s.v_head_dim,
        s.conv_kernel,
        if s.tiled_v_heads { "tiled" } else { "grouped" }
    )
}

#[derive(Clone, Copy, Debug)]
enum ArgmaxKind {
    Random,
    /// The maximum planted at several far-apart indices: the lowest must win.
    Ties,
    /// Every value equal: index 0.
    Constant,
    /// All values negative (the running maximum must not start at 0).
    Negative,
}

/// One check case: an op at one shape.
pub struct Case {
    pub name: String,
    /// Which entry of [`OPS`] it covers.
    pub op_name: &'static str,
    op: Op,
}

impl Case {
    fn new(op: Op) -> Case {
        let (op_name, name) = describe(&op);
        Case { name, op_name, op }
    }
}

fn describe(op: &Op) -> (&'static str, String) {
    match op {
        Op::Embed {
            ty,
            vocab,
            dim,
            rows,
        } => ("embed", format!("embed {ty} {vocab}x{dim} rows={rows}")),
        Op::RmsNorm { wty, rows, cols } => (
            "rms_norm",
            format!("rms_norm w={wty} cols={cols} rows={rows}"),
        ),
        Op::HeadRmsNorm {
            rows,
            heads,
            head_dim,
        } => (
            "head_rms_norm",
            format!("head_rms_norm hd={head_dim} heads={heads} rows={rows}"),
        ),
        Op::Matmul {
            ty,
            n_in,
            n_out,
            rows,
        } => ("matmul", format!("matmul {ty} {n_in}->{n_out} rows={rows}")),
        Op::Matmuls {
            ty,
            n_in,
            n_out,
            rows,
            v,
            checked,
        } => (
            "matmuls",
            match v {
                None => format!(
                    "matmuls {ty}: {} + {n_in}->{n_out} rows={rows}",
                    matmuls_first_rows(*n_out)
                ),
                Some(v) => format!(
                    "matmuls {ty} {ty} {v}: {} + {n_in}->{n_out} x2 rows={rows} (checked: {})",
                    matmuls_first_rows(*n_out),
                    ["the first", "the second", "the third"][*checked]
                ),
            },
        ),
        Op::MatmulSwiglu {
            ty,
            n_in,
            n_out,
            rows,
            down,
        } => (
            if *down { "swiglu_mlp" } else { "matmul_swiglu" },
            if *down {
                format!("swiglu_mlp {ty} {n_in}->{n_out}->{n_in} rows={rows}")
            } else {
                format!("matmul_swiglu {ty} {n_in}->{n_out} rows={rows}")
            },
        ),
        Op::RmsNormMatmuls {
            ty,
            n_in,
            n_outs,
            rows,
        } => (
            "rms_norm_matmuls",
            format!(
                "rms_norm_matmuls {ty} {n_in}->{} rows={rows}",
                n_outs
                    .iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join("+")
            ),
        ),
        // Named as a matmul_swiglu: tests/check.rs wants every `--filter swiglu` case name to
        // start with `swiglu` or `matmul_swiglu`.
        Op::RmsNormMatmulSwiglu {
            ty,
            n_in,
            n_out,
            rows,
        } => (
            "rms_norm_matmul_swiglu",
            format!("matmul_swiglu(rms_norm) {ty} {n_in}->{n_out} rows={rows}"),
        ),
        Op::MatmulAdd {
            ty,
            n_in,
            n_out,
            rows,
        } => (
            "matmul_add",
            format!("matmul_add {ty} {n_in}->{n_out} rows={rows}"),
        ),
        // tests/check.rs accepts `matmul_add+matmul_swiglu` as a `--filter swiglu` prefix.
        Op::AddNormSwiglu {
            ty,
            hidden,
            ffn,
            rows,
        } => (
            "matmul_add_for_norm",
            format!(
                "matmul_add+matmul_swiglu(rms_norm) {ty} {hidden}->{hidden}->{ffn} rows={rows}"
            ),
        ),
        Op::AddNormMatmuls {
            ty,
            ty_v,
            n_in,
            n_outs: [nq, nk, nv],
            rows,
            down: (ty_d, down),
        } => (
            "matmul_add_for_norm",
            format!(
                "matmul_add+matmuls(rms_norm) {ty_d} {down}->{n_in} {ty}+{ty_v} {n_in}->{nq}+{nk}+{nv} rows={rows}"
            ),
        ),
        Op::Rope {
            rows,
            heads,
            head_dim,
            rope,
            pos0,
        } => (
            "rope",
            format!(
                "rope {:?} hd={head_dim} rot={} θ={}{} heads={heads} rows={rows} pos0={pos0}",
                rope.style,
                rope.rot_dim,
                rope.theta,
                scaled_label(&rope.inv_freq)
            ),
        ),
        Op::AddAssign { rows, cols } => ("add_assign", format!("add_assign {rows}x{cols}")),
        Op::AddRmsNorm { wty, rows, cols } => (
            "add_rms_norm",
            format!("add_rms_norm w={wty} cols={cols} rows={rows}"),
        ),
        Op::AddRmsNormMatmul { rows, cols, n_out } => (
            "add_rms_norm_matmul",
            format!("add_rms_norm_matmul cols={cols} router={n_out} rows={rows}"),
        ),
        Op::MoePredict { cols, n_experts } => (
            "moe_predict_logits",
            format!("moe_predict cols={cols} experts={n_experts}"),
        ),
        Op::QkNormRope {
            rows,
            q_heads,
            k_heads,
            head_dim,
            rope,
            norm,
            pos0,
        } => (
            "qk_norm_rope",
            format!(
                "qk_norm_rope {:?} hd={head_dim} rot={} θ={}{} heads={q_heads}/{k_heads} \
                 norm={norm} rows={rows} pos0={pos0}",
                rope.style,
                rope.rot_dim,
                rope.theta,
                scaled_label(&rope.inv_freq)
            ),
        ),
        Op::Swiglu { rows, cols } => ("swiglu", format!("swiglu {rows}x{cols}")),
        Op::CopyRows {
            src_rows,
            cols,
            start,
            rows,
        } => (
            "copy_rows",
            format!("copy_rows {src_rows}x{cols} start={start} rows={rows}"),
        ),
        Op::GatherRows {
            src_rows,
            cols,
            pick,
        } => (
            "gather_rows",
            format!("gather_rows {src_rows}x{cols} rows={pick:?}"),
        ),
        Op::Paged(c) => ("attention", c.name()),
        Op::Attention {
            shape,
            pos0,
            rows,
            q8,
        } => (
            "attention",
            format!(
                "attention hd={} heads={}/kv{}{} {} rows={rows} pos0={pos0}",
                shape.head_dim,
                shape.n_heads,
                shape.n_kv_heads,
                if *q8 { " q8_0" } else { "" },
                if *rows == 1 { "decode" } else { "multi" }
            ),
        ),
        Op::AttnO {
            shape,
            pos0,
            rows,
            ty,
            o_only,
        } => (
            "attention",
            format!(
                "attention+o {ty:?} hd={} heads={}/kv{} rows={rows} pos0={pos0}{}",
                shape.head_dim,
                shape.n_heads,
                shape.n_kv_heads,
                if *o_only { " o-only" } else { "" }
            ),
        ),
        Op::AttnRope {
            shape,
            rot_dim,
            pos0,
            rows,
            inv_freq,
        } => (
            "qk_norm_rope_attention",
            format!(
                "qk_norm_rope+attention hd={}{}{} heads={}/kv{} {} pos0={pos0}",
                shape.head_dim,
                if *rot_dim == shape.head_dim {
                    String::new()
                } else {
                    format!(" rot={rot_dim}")
                },
                scaled_label(inv_freq),
                shape.n_heads,
                shape.n_kv_heads,
                if *rows == 1 {
                    "decode".to_string()
                } else {
                    format!("rows={rows}")
                }
            ),
        ),
        Op::Moe {
            routing,
            hidden,
            ffn,
            gate_ty,
            down_ty,
            rows,
            shared,
        } => (
            "moe",
            format!(
                "moe{} e{} top{} {hidden}/{ffn} {gate_ty}/{down_ty} norm={} rows={rows}",
                if *shared { "+shared" } else { "" },
                routing.n_experts,
                routing.top_k,
                routing.norm_topk
            ),
        ),
        Op::Argmax { rows, cols, kind } => ("argmax", format!("argmax {kind:?} {rows}x{cols}")),
        Op::ArgmaxFeed { cols, pos, kind } => (
            "argmax_feed",
            format!("argmax_feed {kind:?} 1x{cols} pos={pos}"),
        ),
        Op::TopK {
            rows,
            cols,
            k,
            kind,
        } => ("top_k", format!("top_k k={k} {kind:?} {rows}x{cols}")),
        Op::Graph {
            rows,
            heads,
            head_dim,
            pos_capture,
            pos_replay,
        } => (
            "capture/replay",
            format!(
                "graph copy_rows+rope hd={head_dim} heads={heads} rows={rows} \
                 captured@{pos_capture} replayed@{pos_replay}"
            ),
        ),
        // A fresh cache (no fill) checks that kv_new_hybrid's state starts at zero.
        Op::Conv1d {
            shape,
            wty,
            fill,
            rows,
        } => (
            if *fill == 0 {
                "kv_new_hybrid"
            } else {
                "causal_conv1d"
            },
            format!(
                "{}causal_conv1d C={} {} w={wty} fill={fill} rows={rows}",
                if *fill == 0 { "kv_new_hybrid + " } else { "" },
                shape.conv_dim(),
                delta_name(shape)
            ),
        ),
        Op::GatedDelta {
            shape,
            fill,
            rows,
            chunked,
        } => (
            if *fill == 0 {
                "kv_new_hybrid"
            } else {
                "gated_delta_rule"
            },
            format!(
                "{}gated_delta_rule {} fill={fill} rows={rows}{}",
                if *fill == 0 { "kv_new_hybrid + " } else { "" },
                delta_name(shape),
                if *chunked { " chunked" } else { "" }
            ),
        ),
        Op::Snapshot {
            shape,
            fill,
            draft,
            rows,
            row,
        } => (
            "kv_snapshot/kv_restore",
            format!(
                "kv_snapshot/restore {} fill={fill} draft={draft} rows={rows}{}",
                delta_name(shape),
                row.map_or(String::new(), |r| format!(" row={r}"))
            ),
        ),
        Op::DeltaBatch { shape, fills, rows } => (
            "kv_new_paged_hybrid/kv_clear_state/kv_copy_state",
            format!(
                "batched causal_conv1d + gated_delta_rule {} fills={fills:?} rows={rows:?}",
                delta_name(shape)
            ),
        ),
        Op::GatedRmsNorm {
            rows,
            heads,
            head_dim,
        } => (
            "gated_rms_norm",
            format!("gated_rms_norm hd={head_dim} heads={heads} rows={rows}"),
        ),
        Op::SigmoidGate {
            rows,
            cols,
            per_row,
        } => (
            "sigmoid_gate",
            format!(
                "sigmoid_gate {rows}x{cols} gate={}",
                if *per_row { "per row" } else { "per element" }
            ),
        ),
        Op::GateMatmul {
            rows,
            cols,
            head_dim,
            n_out,
        } => match head_dim {
            Some(hd) => (
                "gated_rms_norm",
                format!("gated_rms_norm+matmul hd={hd} q4_K {cols}->{n_out} rows={rows}"),
            ),
            None => (
                "sigmoid_gate",
                format!("sigmoid_gate+matmul q4_K {cols}->{n_out} rows={rows}"),
            ),
        },
    }
}

const ALL_TYPES: [GgmlType; 10] = GgmlType::ALL;

/// Weight types of real model files, checked at the real shapes.
const MAIN_TYPES: [GgmlType; 5] = [
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q8_0,
    GgmlType::F16,
    GgmlType::BF16,
];

fn is_float(t: GgmlType) -> bool {
    t.block_size() == 1
}

/// The case list. `quick` keeps only small shapes (seconds on a laptop CPU).
pub fn cases(quick: bool) -> Vec<Case> {
    let mut v = Vec::new();
    let mut add = |op: Op| v.push(Case::new(op));

    // --- embed: every type; odd dims for the float types.
    for ty in ALL_TYPES {
        let dim = if is_float(ty) {
            50
        } else if ty.block_size() == 32 {
            96
        } else {
            512
        };
        for rows in [1, 7, 64] {
            add(Op::Embed {
                ty,
                vocab: 300,
                dim,
                rows,
            });
        }
    }

    // --- norms
    for wty in [GgmlType::F32, GgmlType::F16] {
        for cols in [64, 1000, 4096, 5120] {
            for rows in [1, 7, 64] {
                if quick && (cols > 1000 || rows > 7) {
                    continue;
                }
                add(Op::RmsNorm { wty, rows, cols });
            }
        }
    }
    for head_dim in [64, 128, 256] {
        for (heads, rows) in [(8, 1), (32, 7), (8, 64)] {
            add(Op::HeadRmsNorm {
                rows,
                heads,
                head_dim,
            });
        }
    }

    // --- matmul
    // Small and odd shapes for every type; n_in is a whole number of blocks.
    for ty in ALL_TYPES {
        let shapes: &[(usize, usize)] = if is_float(ty) {
            &[(33, 5), (100, 67), (768, 130), (256, 1)]
        } else if ty.block_size() == 32 {
            &[(32, 3), (96, 67), (768, 130), (1280, 1)]
        } else {
            &[(256, 3), (512, 67), (768, 130), (1280, 1)]
        };
        for (si, &(n_in, n_out)) in shapes.iter().enumerate() {
            let rows_set: &[usize] = if si == 2 {
                &[1, 2, 7, 8, 9, 16, 17, 64, 512]
            } else {
                &[1, 9, 64]
            };
            for &rows in rows_set {
                if quick && rows > 9 {
                    continue;
                }
                add(Op::Matmul {
                    ty,
                    n_in,
                    n_out,
                    rows,
                });
            }
        }
    }
    // The quantized-x decode GEMV (more than F32_SMALL_OUT outputs): an odd output count, a
    // row length that is not a whole warp step (3 super-blocks; 24 blocks of 32), every
    // quantized type; and the long rows' partial last tile (Q4_K, Q6_K and Q8_0: the
    // tensor-core GEMV's 16-row tile over K slices (Q4_K and Q8_0 by default, Q6_K with
    // FERRITE_GEMV_TCK), its 8-row tile with FERRITE_GEMV_TC=3, or the lane code's split
    // blocks), and long rows in unequal K slices (14336 columns: Q4_K 4 x 3584, Q6_K 3 x 4096
    // + 2048, Q8_0 7 x 2048); and a launch of
    // many 16-row tensor-core tiles (more than a wave), its last tile half full (Q4_K, and
    // Q6_K from 8192 rows), and one of 20008 rows (1251 tiles, the last half full); at one
    // row with FERRITE_GEMV_TCT=1 these two take the two-tile block, whose last block then
    // holds one half-full tile and skips its second.
    // Per set: types, (n_in, n_out), row counts, the most rows under `quick`.
    let quantized: Vec<GgmlType> = GgmlType::ALL
        .into_iter()
        .filter(|t| cuda_matmul::quantized_x(*t))
        .collect();
    type GemvqSet<'a> = (&'a [GgmlType], (usize, usize), &'a [usize], usize);
    let sets: [GemvqSet; 5] = [
        (&quantized, (768, 263), &[1, 2, 5, 9, 16], 9),
        (
            &[GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0],
            (12288, 100),
            &[1, 3, 9],
            1,
        ),
        (
            &[GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0],
            (14336, 40),
            &[1, 9],
            1,
        ),
        (&[GgmlType::Q4K, GgmlType::Q6K], (2048, 8200), &[1, 2], 1),
        (&[GgmlType::Q4K, GgmlType::Q6K], (2048, 20008), &[1], 1),
    ];
    for (tys, (n_in, n_out), row_counts, quick_max) in sets {
        for &ty in tys {
            for &rows in row_counts {
                if quick && rows > quick_max {
                    continue;
                }
                add(Op::Matmul {
                    ty,
                    n_in,
                    n_out,
                    rows,
                });
            }
        }
    }
    if !quick {
        // The real Qwen3-8B shapes: q/o, k/v, gate/up, down.
        let real = [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)];
        for ty in MAIN_TYPES {
            for &(n_in, n_out) in &real {
                // 3 and 5: padded instantiations (R = 4, 8) at real widths; 2, 8 and 16 full
                // ones (a batched step's rows).
                for rows in [1, 2, 3, 5, 8, 9, 16, 17, 64, 512] {
                    add(Op::Matmul {
                        ty,
                        n_in,
                        n_out,
                        rows,
                    });
                }
            }
        }
        // The TA form's 128 × 256 tile (FERRITE_MMW_TA_TILE=2: its grid of 2 × 96 blocks
        // fills the SMs) with a partial last output tile (12200 = 95 × 128 + 40) and a partial
        // token tile (300 = 256 + 44).
        for ty in [GgmlType::F16, GgmlType::BF16] {
            add(Op::Matmul {
                ty,
                n_in: 4096,
                n_out: 12200,
                rows: 300,
            });
            // Grids of fewer wide tiles than SMs (the K split in a cluster, FERRITE_MMW_TA_KS):
            // a partial last output tile (4000 = 31 × 128 + 32) over a partial token tile,
            // three token tiles (640 rows), a long K at 300 rows.
            for (n_in, n_out, rows) in [(4096, 4000, 300), (4096, 4096, 640), (12288, 4096, 300)] {
                add(Op::Matmul {
                    ty,
                    n_in,
                    n_out,
                    rows,
                });
            }
        }
        for ty in [GgmlType::Q5K, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::F32] {
            for rows in [1, 9, 64] {
                add(Op::Matmul {
                    ty,
                    n_in: 4096,
                    n_out: 4096,
                    rows,
                });
            }
        }
        // The MoE routers (f32, Qwen3-30B-A3B's 2048 -> 128 and Qwen3.5-35B-A3B's 2048 -> 256)
        // at decode, a full 16-row tile and a prefill (the rows kernel: ROUTER_MAX_OUT).
        for n_out in [128, 256] {
            for rows in [1, 16, 512] {
                add(Op::Matmul {
                    ty: GgmlType::F32,
                    n_in: 2048,
                    n_out,
                    rows,
                });
            }
        }
        // Qwen3.5's Q5_K in-projections (the linear layers' attn_qkv of the 35B-A3B and the
        // 9B): the 16-row tensor-core tile at decode and verify rows, the prefill at 17 and at
        // 512 (the wide tile: its register-A form under FERRITE_MMW_RS_Q5).
        for n_in in [2048, 4096] {
            for rows in [1, 3, 16, 17, 512] {
                add(Op::Matmul {
                    ty: GgmlType::Q5K,
                    n_in,
                    n_out: 8192,
                    rows,
                });
            }
        }
        // The output head (vocabulary 151936): the types lm_heads are stored in; and the
        // 2048-column Q6_K one of Qwen3-30B-A3B (at one row the two-tile tensor-core block).
        for ty in [GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4K] {
            for rows in [1, 9] {
                add(Op::Matmul {
                    ty,
                    n_in: 4096,
                    n_out: 151936,
                    rows,
                });
            }
        }
        add(Op::Matmul {
            ty: GgmlType::Q6K,
            n_in: 2048,
            n_out: 151936,
            rows: 1,
        });
    }

    // --- matmuls / matmul_swiglu: the fused decode paths (and their fallbacks: float types,
    // prefill rows).
    // Per set: types, (n_in, n_out) shapes, row counts. The second set is two small-output
    // weights (the Qwen3.5 beta/alpha projections, 32 rows each): the f32-x GEMV's grouped
    // launch for the quantized types.
    type MatmulsSet<'a> = (&'a [GgmlType], &'a [(usize, usize)], &'a [usize]);
    let sets: [MatmulsSet; 2] = [
        (
            &[GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::F16],
            &[(512, 384), (4096, 1024)],
            &[1, 3, 9, 17],
        ),
        (
            &[GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q8_0],
            &[(2048, 32), (4096, 32)],
            &[1, 9, 17],
        ),
    ];
    for (tys, shapes, row_counts) in sets {
        for &ty in tys {
            for &(n_in, n_out) in shapes {
                for &rows in row_counts {
                    if quick && (rows > 9 || (n_out <= 256 && n_in > 2048)) {
                        continue;
                    }
                    add(Op::Matmuls {
                        ty,
                        n_in,
                        n_out,
                        rows,
                        v: None,
                        checked: 1,
                    });
                }
            }
        }
    }
    // A prefill's three 16-bit weights in one TA launch (Qwen3-8B's Q, K, V: 6144 outputs at
    // 512 rows: the K-split wide tile, or under FERRITE_MMW_TA_CAT the concatenated one),
    // each of the three outputs checked.
    if !quick {
        for ty in [GgmlType::F16, GgmlType::BF16] {
            for checked in [0, 1, 2] {
                add(Op::Matmuls {
                    ty,
                    n_in: 4096,
                    n_out: 1024,
                    rows: 512,
                    v: Some(ty),
                    checked,
                });
            }
            // The concatenated 192-output tile's partial last tile (4096 + 512 + 512 = 26⅔
            // tiles), and a last token tile that the rows end inside (300 rows: the second
            // 256-token tile read from row 44 under MMW_TSHIFT, its rows from 256 stored).
            for (n_out, rows) in [(512, 512), (1024, 300)] {
                for checked in [0, 2] {
                    add(Op::Matmuls {
                        ty,
                        n_in: 4096,
                        n_out,
                        rows,
                        v: Some(ty),
                        checked,
                    });
                }
            }
        }
    }
    // Q, K (Q4_K) and V (Q6_K) as the Q4_K_M mix stores them: one mixed-type launch; both
    // outputs after the first weight's are checked (the segment boundaries differ per type).
    // Rows 17, 64 and 300: the prefill matmul's mixed launch (wgmma on sm_90a), its 128- and
    // 64-token tiles and a partial last token tile. V of Q and K's type (the other half of the
    // layers): one launch of three weights of one type, each output checked (a kernel that
    // gave the third weight the second's rows passed every two-weight case).
    for v in [GgmlType::Q6K, GgmlType::Q4K] {
        for &(n_in, n_out) in &[(512, 384), (4096, 1024), (2048, 512)] {
            for rows in [1, 3, 9, 16, 17, 64, 300] {
                if quick && rows > 9 {
                    continue;
                }
                for checked in [1, 2] {
                    add(Op::Matmuls {
                        ty: GgmlType::Q4K,
                        n_in,
                        n_out,
                        rows,
                        v: Some(v),
                        checked,
                    });
                }
            }
        }
    }
    // Per set: types, the quick shape, the full shapes, row counts, and whether the down
    // projection follows (the FFN's two GEMVs in a row: the second reads the first's output
    // quantized).
    type SwigluSet<'a> = (
        &'a [GgmlType],
        (usize, usize),
        &'a [(usize, usize)],
        &'a [usize],
        bool,
    );
    let sets: [SwigluSet; 5] = [
        (
            &[GgmlType::Q4K, GgmlType::Q8_0, GgmlType::Q5K, GgmlType::BF16],
            (512, 300),
            &[(512, 300), (4096, 12288), (2048, 768)],
            &[1, 2, 9, 16, 17],
            false,
        ),
        // Prefill rows: the fused wgmma gate/up/SwiGLU launch on sm_90a, each tile (64 ×
        // 256 on the full 12288-output grid at 300 rows, a partial token tile; 128 × 128 and
        // 128 × 64 elsewhere) and a partial last output tile (300 outputs); F16 and BF16 for
        // the TA form's gate-then-up tile rows (FERRITE_MMW_TA).
        (
            &[
                GgmlType::Q4K,
                GgmlType::Q6K,
                GgmlType::Q8_0,
                GgmlType::F16,
                GgmlType::BF16,
            ],
            (512, 300),
            &[(512, 300), (4096, 12288)],
            &[64, 300],
            false,
        ),
        // Prefill rows with the down (`swiglu_mlp`): on sm_90a the TA form's gate/up writes
        // the down's 16-bit x itself (mmw.rs swiglu_mlp) — the F16 and BF16 FFN of Qwen3-8B at
        // a partial token tile (300: the last tile shifted) and at whole ones, a small FFN of
        // 384 (the smaller tiles), and one whose 328 columns are not whole 64-column steps (the
        // composition instead).
        (
            &[GgmlType::F16, GgmlType::BF16],
            (512, 328),
            &[(512, 328), (512, 384), (4096, 12288)],
            &[300, 512],
            true,
        ),
        // Many 8-pair tensor-core tiles (more than a wave), the last one half full.
        (
            &[GgmlType::Q4K],
            (2048, 8196),
            &[(2048, 8196)],
            &[1, 2],
            false,
        ),
        (
            &[GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0],
            (512, 512),
            &[(512, 512), (4096, 12288), (2048, 768)],
            &[1, 9, 16, 17],
            true,
        ),
    ];
    for (tys, quick_shape, shapes, row_counts, down) in sets {
        let shapes = if quick { &[quick_shape][..] } else { shapes };
        for &ty in tys {
            for &(n_in, n_out) in shapes {
                for &rows in row_counts {
                    if quick && rows > 9 {
                        continue;
                    }
                    add(Op::MatmulSwiglu {
                        ty,
                        n_in,
                        n_out,
                        rows,
                        down,
                    });
                }
            }
        }
    }

    // --- the decode projections with the RMSNorm deferred into them (rms_norm_matmuls,
    // rms_norm_matmul_swiglu) and the residual add in the epilogue (matmul_add): CUDA takes
    // them for float weights at decode rows (≤ GEMV_MAX_ROWS) with n_in % 4 == 0
    // (`Backend::defers_rms_norm`). Rows 17 (prefill), n_in 37 (not whole float4 steps) and
    // a Q4_K weight check the fallbacks to the default composition; n_in 72 is whole float4
    // steps but not whole 32-lane steps. Per op, the n_in 37 case takes one float type.
    let float_types = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];
    for (i, ty) in float_types.into_iter().enumerate() {
        if !quick {
            // Qwen3-8B's Q, K and V reading one normed x (one grouped launch), and a single
            // lm-head-like projection.
            let outs: [&'static [usize]; 2] = [&[4096, 1024, 1024], &[8192]];
            for n_outs in outs {
                for rows in [1, 2, 9, 16, 17] {
                    add(Op::RmsNormMatmuls {
                        ty,
                        n_in: 4096,
                        n_outs,
                        rows,
                    });
                }
            }
            for rows in [1, 9, 16, 17] {
                add(Op::RmsNormMatmulSwiglu {
                    ty,
                    n_in: 4096,
                    n_out: 12288,
                    rows,
                });
                // o_proj and down_proj into the residual.
                for n_in in [4096, 12288] {
                    add(Op::MatmulAdd {
                        ty,
                        n_in,
                        n_out: 4096,
                        rows,
                    });
                }
            }
        }
        // Small shapes: four weights (runs of up to three per launch: 3 + 1), odd outputs.
        add(Op::RmsNormMatmuls {
            ty,
            n_in: 72,
            n_outs: &[100, 36, 36, 20],
            rows: 9,
        });
        add(Op::RmsNormMatmulSwiglu {
            ty,
            n_in: 72,
            n_out: 100,
            rows: 9,
        });
        add(Op::MatmulAdd {
            ty,
            n_in: 72,
            n_out: 100,
            rows: 9,
        });
        let (n_in, rows) = (37, 9);
        match i {
            0 => add(Op::RmsNormMatmuls {
                ty,
                n_in,
                n_outs: &[67],
                rows,
            }),
            1 => add(Op::RmsNormMatmulSwiglu {
                ty,
                n_in,
                n_out: 67,
                rows,
            }),
            _ => add(Op::MatmulAdd {
                ty,
                n_in,
                n_out: 67,
                rows,
            }),
        }
    }
    // A quantized weight at one decode row: the fallback (Qwen3-8B's shapes; small in quick).
    let ty = GgmlType::Q4K;
    let (n_in, n_outs, n_out): (usize, &'static [usize], usize) = if quick {
        (512, &[384, 128, 128], 300)
    } else {
        (4096, &[4096, 1024, 1024], 12288)
    };
    let rows = 1;
    add(Op::RmsNormMatmuls {
        ty,
        n_in,
        n_outs,
        rows,
    });
    add(Op::RmsNormMatmulSwiglu {
        ty,
        n_in,
        n_out,
        rows,
    });
    add(Op::MatmulAdd {
        ty,
        n_in,
        n_out: n_outs[0],
        rows,
    });

    // --- matmul_add_for_norm + rms_norm_matmul_swiglu (the o-projection handing the FFN
    // norm's input to gate/up): CUDA fuses the pair for Q4_K weights at decode rows
    // (`Backend::defers_rms_norm_after`); F16 takes the float deferred norm
    // (`defers_rms_norm`), Q8_0 the 32-row producer at one row (`gemvq_add_n_q8_0`; more rows:
    // the plain o-projection + add_norm_planes) and the lane-code NORM SwiGLU
    // (FERRITE_DEFER_NORM_Q8=0: the default composition). Qwen3-8B's shapes; small in quick.
    if !quick {
        for (ty, rows) in [
            (GgmlType::Q4K, 1),
            (GgmlType::Q4K, 2),
            (GgmlType::Q4K, 9),
            (GgmlType::Q4K, 16),
            (GgmlType::F16, 1),
            (GgmlType::Q8_0, 1),
            (GgmlType::Q8_0, 9),
            // Prefill rows: 16-bit weights add in the o-projection's cuBLASLt epilogue and a
            // plain norm hands h to the gate/up as their 16-bit x alone (its f32 rows
            // unwritten); Q4_K the add + norm handing over the same way.
            (GgmlType::F16, 300),
            (GgmlType::BF16, 300),
            (GgmlType::Q4K, 300),
        ] {
            add(Op::AddNormSwiglu {
                ty,
                hidden: 4096,
                ffn: 12288,
                rows,
            });
        }
    }
    for ty in [GgmlType::Q4K, GgmlType::Q8_0] {
        add(Op::AddNormSwiglu {
            ty,
            hidden: 512,
            ffn: 1024,
            rows: 1,
        });
    }
    // Q8_0 at other widths: 2048 columns (the 32-row producer, as at 4096) and 3072 (its plain
    // GEMV splits rows over two warps, so the 32-row producer, whose sums would differ, is not
    // taken: the plain GEMV and add_norm_planes).
    if !quick {
        for hidden in [2048, 3072] {
            add(Op::AddNormSwiglu {
                ty: GgmlType::Q8_0,
                hidden,
                ffn: 1024,
                rows: 1,
            });
        }
    }

    // --- matmul_add_for_norm + rms_norm_matmuls (the down projection's residual add handing
    // the attention norm's input to the next layer's Q, K, V). CUDA takes it at one decode
    // row from the K-split Q4_K tile (FERRITE_NORM_QKV=2) into Q4_K (V Q4_K or Q6_K: the
    // mixed launch) and Q8_0 Q, K, V; other producers (the Q6_K / Q8_0 lane code: MATMUL.md
    // round 43), types and rows run matmul + add_rms_norm + matmuls. Qwen3-8B's shapes
    // (Q4_K_M's downs are Q4_K or Q6_K), two rows, a Q, K, V type without a NORM form;
    // small in quick.
    type QkvCase = (
        GgmlType,
        GgmlType,
        usize,
        [usize; 3],
        usize,
        (GgmlType, usize),
    );
    let (q4, q6, q8) = (GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0);
    let qkv: &[QkvCase] = if quick {
        &[
            (q4, q6, 512, [384, 128, 128], 1, (q6, 1024)),
            (q8, q8, 512, [384, 128, 128], 1, (q8, 1024)),
        ]
    } else {
        let d8 = [4096, 1024, 1024];
        &[
            (q4, q4, 4096, d8, 1, (q4, 12288)),
            (q4, q6, 4096, d8, 1, (q4, 12288)),
            (q4, q4, 4096, d8, 2, (q4, 12288)),
            (q4, q4, 4096, d8, 1, (q6, 12288)),
            (q4, q6, 4096, d8, 1, (q6, 12288)),
            (q4, q6, 4096, d8, 2, (q6, 12288)),
            (q8, q8, 4096, d8, 1, (q8, 12288)),
            // The Q8_0 NORM form of the Q, K, V after a K-split Q4_K producer.
            (q8, q8, 4096, d8, 1, (q4, 12288)),
            (q8, q8, 4096, d8, 2, (q8, 12288)),
            (q6, q6, 4096, d8, 1, (q6, 12288)),
            (q4, q6, 2048, [4096, 512, 512], 1, (q6, 6144)),
            (q4, q6, 512, [384, 128, 128], 1, (q6, 1024)),
            // Prefills: the add + RMSNorm handing h to the Q, K, V as their 16-bit x
            // (FERRITE_NORM_X16; f16 for the TA form's F16, bf16 otherwise).
            (
                GgmlType::F16,
                GgmlType::F16,
                4096,
                d8,
                300,
                (GgmlType::F16, 12288),
            ),
            (
                GgmlType::BF16,
                GgmlType::BF16,
                4096,
                d8,
                300,
                (GgmlType::BF16, 12288),
            ),
            (q4, q6, 4096, d8, 300, (q6, 12288)),
        ]
    };
    for &(ty, ty_v, n_in, n_outs, rows, down) in qkv {
        add(Op::AddNormMatmuls {
            ty,
            ty_v,
            n_in,
            n_outs,
            rows,
            down,
        });
    }

    // --- rope: both styles, partial rotary dims, positions from 0 and from 1000.
    let ropes = [
        (128, 128, 1e6f32, 32),
        (64, 32, 1e4, 4),
        (128, 64, 1e7, 8),
        (256, 256, 1e7, 2),
    ];
    // Llama 3.1's scaled rotation (a frequency table, CUDA's rope_tab): 8 heads of 128.
    let scaled_rope = (128, 128, 1e6f32, 8);
    for style in [RopeStyle::Adjacent, RopeStyle::Neox] {
        for (&(head_dim, rot_dim, theta, heads), scaled) in ropes
            .iter()
            .map(|r| (r, false))
            .chain([(&scaled_rope, true)])
        {
            for (rows, pos0) in [(1, 0), (7, 0), (1, 1000), (64, 1000)] {
                if quick && rows > 7 {
                    continue;
                }
                add(Op::Rope {
                    rows,
                    heads,
                    head_dim,
                    rope: Rope {
                        style,
                        theta,
                        rot_dim,
                        inv_freq: scaled.then(|| scaled_inv_freq(theta, rot_dim)),
                    },
                    pos0,
                });
            }
        }
    }

    // --- elementwise
    for (rows, cols) in [(1, 1), (1, 4096), (7, 33), (64, 12288)] {
        if quick && cols > 4096 {
            continue;
        }
        add(Op::AddAssign { rows, cols });
        add(Op::Swiglu { rows, cols });
    }
    // --- fused residual add + RMSNorm: Qwen3-8B (4096), Qwen3-30B-A3B / Qwen3.5-2B (2048),
    // SmolLM2-135M (576), odd widths; decode, a few rows, a prefill chunk.
    for cols in [4096, 2048, 576, 1000, 33] {
        for rows in [1, 7, 512] {
            if quick && (cols > 1000 || rows > 7) {
                continue;
            }
            add(Op::AddRmsNorm {
                wty: GgmlType::F32,
                rows,
                cols,
            });
        }
    }
    add(Op::AddRmsNorm {
        wty: GgmlType::F16,
        rows: 7,
        cols: 576,
    });
    // --- a MoE block's input norm + router: Qwen3-30B-A3B (2048 → 128), Qwen3.5-35B-A3B
    // (2048 → 256), Qwen3-235B-A22B (4096 → 128), small and odd shapes (the fused CUDA
    // kernel's row groups past n_out, one block); rows > 1 take the composition.
    for (cols, n_out) in [
        (2048, 128),
        (2048, 256),
        (4096, 128),
        (576, 8),
        (1024, 60),
        (96, 3),
    ] {
        for rows in [1, 3] {
            if quick && cols > 1024 {
                continue;
            }
            add(Op::AddRmsNormMatmul { rows, cols, n_out });
        }
    }

    // --- the MoE expert prediction (one row): Qwen3-30B-A3B's and Qwen3.5-35B-A3B's routers,
    // a wider row (4096 columns), odd small shapes.
    for (cols, n_experts) in [(2048, 128), (2048, 256), (4096, 128), (1024, 60), (96, 3)] {
        if quick && cols > 1024 {
            continue;
        }
        add(Op::MoePredict { cols, n_experts });
    }

    // --- fused QK-norm + RoPE: Qwen3-8B (32/8 × 128, NeoX, norm), Llama GGUF (adjacent
    // pairs, no norm), Qwen3.5 full attention (16/2 × 256, NeoX on 64 dims), SmolLM2
    // (9/3 × 64), odd shapes (36 pairs: lanes wrap; 3 of 4 pairs rotated), head counts that
    // leave a prefill warp's last group of heads short (6/3 × 128: groups of 4, 2 and 3).
    let qk = [
        (32, 8, 128, 128, RopeStyle::Neox, 1e6f32, true),
        (6, 3, 128, 128, RopeStyle::Neox, 1e6, true),
        (32, 8, 128, 128, RopeStyle::Neox, 1e6, false),
        (32, 8, 128, 128, RopeStyle::Adjacent, 5e5, false),
        (16, 2, 256, 64, RopeStyle::Neox, 1e7, true),
        (9, 3, 64, 64, RopeStyle::Adjacent, 1e5, true),
        (3, 1, 72, 72, RopeStyle::Neox, 1e4, true),
        (5, 5, 96, 72, RopeStyle::Adjacent, 1e4, true),
        (4, 2, 32, 16, RopeStyle::Neox, 1e4, false),
    ];
    // Llama 3.1's scaled rotation (a frequency table, CUDA's qk_norm_rope_tab): its GGUF's
    // adjacent pairs and a checkpoint's NeoX ones (the register form at prefill rows), no norm;
    // a partial NeoX rotation with norms.
    let qk_scaled = [
        (32, 8, 128, 128, RopeStyle::Adjacent, 5e5f32, false),
        (32, 8, 128, 128, RopeStyle::Neox, 5e5, false),
        (16, 2, 256, 64, RopeStyle::Neox, 1e7, true),
    ];
    let qk_cases = qk.iter().map(|c| (c, false));
    for (&(q_heads, k_heads, head_dim, rot_dim, style, theta, norm), scaled) in
        qk_cases.chain(qk_scaled.iter().map(|c| (c, true)))
    {
        for (rows, pos0) in [(1, 0), (1, 1000), (7, 3), (512, 0)] {
            if quick && (rows > 7 || q_heads > 16) {
                continue;
            }
            add(Op::QkNormRope {
                rows,
                q_heads,
                k_heads,
                head_dim,
                rope: Rope {
                    style,
                    theta,
                    rot_dim,
                    inv_freq: scaled.then(|| scaled_inv_freq(theta, rot_dim)),
                },
                norm,
                pos0,
            });
        }
    }

    for (src_rows, cols, start, rows) in [(10, 37, 0, 1), (10, 37, 9, 1), (64, 4096, 3, 60)] {
        add(Op::CopyRows {
            src_rows,
            cols,
            start,
            rows,
        });
    }
    for (src_rows, cols, pick) in [
        (10, 37, &[9usize, 0, 4][..]),
        (1, 5, &[0][..]),
        (300, 4096, &[7, 299, 0, 150, 151][..]),
    ] {
        add(Op::GatherRows {
            src_rows,
            cols,
            pick,
        });
    }
    // Batched attention over a paged cache (the serving step).
    for c in paged::cases(quick) {
        add(Op::Paged(c));
    }

    // --- QK-norm + RoPE and the attention in one op. Decode rows: Qwen3-8B's and
    // Qwen3-30B-A3B's heads, GQA 2, at caches of 2, 5 and 15 splits (the cluster form's range,
    // where CUDA folds the rotation into the launch), one, and 32 and 47 (the tail merge: two
    // launches). Prefills (GQA groups of 4, 8 and 2, from position 0 and after a prefix, a last
    // tile part full): CUDA's qk_norm_rope storing the keys and values itself
    // (`FERRITE_KV_FUSE`), and the composition a form rotating q inside the attention would
    // replace (MATMUL.md round 102 measured one, 7252348, and removed it: a tie).
    // Qwen3.5's gated attention layers too (heads of 256 rotated on their first 64 dims; 16
    // query heads on 2 kv heads in the 35B-A3B, on 4 in the 9B): at one decode row the
    // composition, at prefill rows the rotation's launch storing the keys and values.
    const QWEN3: (usize, usize) = (128, 128); // (head_dim, rot_dim)
    const QWEN35: (usize, usize) = (256, 64);
    for (n_heads, n_kv_heads, (head_dim, rot_dim), pos0, rows) in [
        (32, 8, QWEN3, 100, 1),
        (32, 8, QWEN3, 300, 1),
        (32, 8, QWEN3, 900, 1),
        (32, 4, QWEN3, 300, 1),
        (16, 8, QWEN3, 150, 1),
        (32, 8, QWEN3, 20, 1),
        (32, 8, QWEN3, 2000, 1),
        (32, 4, QWEN3, 3000, 1),
        (32, 8, QWEN3, 0, 300),
        (32, 4, QWEN3, 100, 300),
        (16, 8, QWEN3, 0, 64),
        (32, 8, QWEN3, 37, 130),
        (16, 2, QWEN35, 300, 1),
        (16, 4, QWEN35, 40, 1),
        (16, 2, QWEN35, 0, 300),
        (16, 4, QWEN35, 100, 300),
        (16, 2, QWEN35, 37, 130),
    ] {
        if quick && pos0 != 300 && rows != 300 {
            continue;
        }
        add(Op::AttnRope {
            shape: AttnShape {
                n_heads,
                n_kv_heads,
                head_dim,
            },
            rot_dim,
            pos0,
            rows,
            inv_freq: None,
        });
    }
    // Scaled by a frequency table: CUDA's composition at a decode row (the one-launch form has
    // no table), and qk_norm_rope_kv_tab storing the keys and values at prefill rows.
    for (pos0, rows) in [(300, 1), (0, 300), (37, 130)] {
        if quick && rows == 130 {
            continue;
        }
        let (head_dim, rot_dim) = QWEN3;
        add(Op::AttnRope {
            shape: AttnShape {
                n_heads: 32,
                n_kv_heads: 8,
                head_dim,
            },
            rot_dim,
            pos0,
            rows,
            inv_freq: Some(scaled_inv_freq(ATTN_ROPE.theta, rot_dim)),
        });
    }

    // --- attention
    // Every head_dim × GQA group at a short decode depth and a short prefill.
    for head_dim in [32, 64, 128, 256] {
        for group in [1, 2, 4, 8] {
            let shape = AttnShape {
                n_heads: 2 * group,
                n_kv_heads: 2,
                head_dim,
            };
            add(Op::Attention {
                shape,
                pos0: 17,
                rows: 1,
                q8: false,
            });
            if !quick || head_dim == 128 {
                add(Op::Attention {
                    shape,
                    pos0: 5,
                    rows: 7,
                    q8: false,
                });
            }
        }
    }
    // A prefill's attention and its o-projection in a row (the attention's 16-bit hand-over
    // to the projection on CUDA): F16 and BF16 weights (f16 and bf16 x), Q4_K (bf16 x), whole
    // and partial token tiles, from an empty cache and after 100 positions.
    if !quick {
        let shape = AttnShape {
            n_heads: 8,
            n_kv_heads: 2,
            head_dim: 128,
        };
        // o-only: as the decoder runs it, the o-projection named as the output's only reader
        // (its f32 rows may then be left unwritten).
        for (ty, rows, pos0, o_only) in [
            (GgmlType::F16, 64, 100, false),
            (GgmlType::F16, 300, 0, false),
            (GgmlType::BF16, 300, 0, false),
            (GgmlType::Q4K, 300, 0, false),
            (GgmlType::F16, 300, 0, true),
            (GgmlType::BF16, 300, 0, true),
            (GgmlType::Q4K, 300, 0, true),
            (GgmlType::F16, 300, 100, true),
        ] {
            add(Op::AttnO {
                shape,
                pos0,
                rows,
                ty,
                o_only,
            });
        }
    }
    // Qwen3-8B's shape (32 heads over 8 KV heads of 128) at decode depths and prefills.
    let q8b = AttnShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
    };
    let small = AttnShape {
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 128,
    };
    // Both cache types: f16 (the default) and q8_0 (`--kv-cache-q8`; the decode kernel stores
    // the step's rows itself, in either type).
    for q8 in [false, true] {
        for pos0 in [0, 1, 17] {
            add(Op::Attention {
                shape: q8b,
                pos0,
                rows: 1,
                q8,
            });
        }
        add(Op::Attention {
            shape: q8b,
            pos0: 0,
            rows: 7,
            q8,
        });
        if !quick {
            add(Op::Attention {
                shape: q8b,
                pos0: 1000,
                rows: 1,
                q8,
            });
            // Speculative verify (K+1 rows) on both sides of the decode/prefill switch.
            for rows in [9, 16, 17] {
                add(Op::Attention {
                    shape: q8b,
                    pos0: 100,
                    rows,
                    q8,
                });
            }
        }
    }
    if !quick {
        // One f16 row in caches of 2 to 32 splits of at most 64 keys (the cluster merge up to
        // 16, and the keys loaded before the PDL wait: attention.rs `pre_loads_fit`), the new
        // key in the first, a middle and the last tile of its split; Qwen3-8B's GQA group 4 and
        // Qwen3-30B-A3B's 8 (32 heads over 4 KV heads: two head blocks per KV head).
        let q30b = AttnShape {
            n_heads: 32,
            n_kv_heads: 4,
            head_dim: 128,
        };
        for (shape, pos0) in [
            (q8b, 64),
            (q8b, 130),
            (q8b, 700),
            (q30b, 300),
            (q30b, 959),
            // Past a cluster's 16 splits with chunks still one tile (24 and 32 splits; the
            // ticket-merge form of the keys-before-the-wait kernel on CUDA).
            (q8b, 1500),
            (q30b, 2000),
        ] {
            add(Op::Attention {
                shape,
                pos0,
                rows: 1,
                q8: false,
            });
        }
        // Depth ~5000 with fewer heads: the CPU fills the cache with a causal prefill. 64
        // splits of two tiles per warp, merged on CUDA by the decode launch's last blocks
        // (the tail merge; attn_decode_merge with FERRITE_ATTN_MERGE=1), in both cache types.
        for q8 in [false, true] {
            add(Op::Attention {
                shape: small,
                pos0: 5004,
                rows: 1,
                q8,
            });
        }
        // A q8_0 cache past the cluster merge's 16 splits (24 at Qwen3-8B's shape): the
        // loop with its next tile in flight, at decode (the tail merge) and at verify (9
        // rows: too many spinning blocks for the tail, so the merge launch).
        for rows in [1, 9] {
            add(Op::Attention {
                shape: q8b,
                pos0: 1501 - rows,
                rows,
                q8: true,
            });
        }
        let pf = AttnShape {
            n_heads: 8,
            n_kv_heads: 2,
            head_dim: 128,
        };
        for rows in [7, 64, 512] {
            for pos0 in [0, 300] {
                add(Op::Attention {
                    shape: pf,
                    pos0,
                    rows,
                    q8: false,
                });
            }
        }
        for head_dim in [64, 256] {
            add(Op::Attention {
                shape: AttnShape {
                    n_heads: 8,
                    n_kv_heads: 4,
                    head_dim,
                },
                pos0: 300,
                rows: 64,
                q8: false,
            });
        }
        // Qwen3.5-35B-A3B's gated attention: 16 heads over 2 KV heads of 256 (a GQA group
        // of 8 with the widest head: 4 query rows per prefill tile).
        let q35moe = AttnShape {
            n_heads: 16,
            n_kv_heads: 2,
            head_dim: 256,
        };
        for (pos0, rows) in [(0, 32), (300, 64)] {
            add(Op::Attention {
                shape: q35moe,
                pos0,
                rows,
                q8: false,
            });
        }
        // Its decode and verify rows at depths of several splits: the SIMT loop's
        // cluster-merge form at hd 256 (2..16 splits), both cache types.
        for q8 in [false, true] {
            for (pos0, rows) in [(100, 1), (300, 1), (300, 3)] {
                add(Op::Attention {
                    shape: q35moe,
                    pos0,
                    rows,
                    q8,
                });
            }
        }
        // The tensor-core prefill's edges (64 query slots per block): a group that leaves
        // slots empty (6: 10 rows, 60 slots), wide groups (16, 32: 4 and 2 rows per block),
        // one head per group at hd 256 (64 rows per block, 32-key tiles), a key bound off the
        // 64-key tile grid, and a long cached prefix; f16 and q8_0 caches (the q8_0 kernel
        // stages the raw rows and scales: 4-, 8- and 16-byte scale copies at hd 64/128/256).
        for q8 in [false, true] {
            for (n_heads, n_kv_heads, head_dim, pos0, rows) in [
                (12, 2, 64, 0, 33),
                (16, 1, 128, 70, 40),
                (32, 1, 256, 5, 17),
                (2, 2, 256, 0, 100),
                (8, 2, 64, 1000, 200),
            ] {
                add(Op::Attention {
                    shape: AttnShape {
                        n_heads,
                        n_kv_heads,
                        head_dim,
                    },
                    pos0,
                    rows,
                    q8,
                });
            }
            if q8 {
                // A long prefill chunk over a prefix (the f16 one is above).
                add(Op::Attention {
                    shape: pf,
                    pos0: 300,
                    rows: 512,
                    q8,
                });
            }
        }
    }

    // --- moe: 8 experts top-2 (small, every path incl. the generic decoders) and the
    // Qwen3-30B-A3B layer (128 experts top-8, hidden 2048, expert ffn 768).
    let small_types = [
        (GgmlType::Q4K, GgmlType::Q6K),
        (GgmlType::Q4K, GgmlType::Q4K),
        (GgmlType::Q8_0, GgmlType::Q8_0),
        (GgmlType::F16, GgmlType::BF16),
        (GgmlType::Q5K, GgmlType::Q4_0),
        (GgmlType::Q4_1, GgmlType::F32),
    ];
    for (gate_ty, down_ty) in small_types {
        for norm_topk in [true, false] {
            for rows in [1, 5, 64] {
                if quick && rows > 5 {
                    continue;
                }
                add(Op::Moe {
                    routing: MoeRouting {
                        n_experts: 8,
                        top_k: 2,
                        norm_topk,
                    },
                    hidden: 256,
                    ffn: 512,
                    gate_ty,
                    down_ty,
                    rows,
                    shared: false,
                });
            }
        }
    }
    if !quick {
        // Qwen3-30B-A3B Q4_K_M's down experts are Q6_K in some layers, Q4_K in the others.
        for (gate_ty, down_ty) in [
            (GgmlType::Q4K, GgmlType::Q6K),
            (GgmlType::Q4K, GgmlType::Q4K),
            (GgmlType::Q8_0, GgmlType::Q8_0),
            (GgmlType::BF16, GgmlType::BF16),
        ] {
            for norm_topk in [true, false] {
                for rows in [1, 5, 64] {
                    add(Op::Moe {
                        routing: MoeRouting {
                            n_experts: 128,
                            top_k: 8,
                            norm_topk,
                        },
                        hidden: 2048,
                        ffn: 768,
                        gate_ty,
                        down_ty,
                        rows,
                        shared: false,
                    });
                }
            }
        }
        // Qwen3.5-35B-A3B's routed experts: 256 experts top-8, hidden 2048, expert ffn 512;
        // and with its gated shared expert of the same shapes (fused by CUDA at ≤ 16 rows;
        // 17 rows: the composition).
        let q35 = |gate_ty, down_ty, rows, shared| Op::Moe {
            routing: MoeRouting {
                n_experts: 256,
                top_k: 8,
                norm_topk: true,
            },
            hidden: 2048,
            ffn: 512,
            gate_ty,
            down_ty,
            rows,
            shared,
        };
        for (gate_ty, down_ty) in [
            (GgmlType::Q4K, GgmlType::Q6K),
            (GgmlType::Q8_0, GgmlType::Q8_0),
        ] {
            for rows in [1, 5, 32] {
                add(q35(gate_ty, down_ty, rows, false));
            }
        }
        for (gate_ty, down_ty) in [
            (GgmlType::Q4K, GgmlType::Q6K),
            (GgmlType::Q4K, GgmlType::Q4K),
            (GgmlType::Q4K, GgmlType::Q8_0),
            (GgmlType::Q8_0, GgmlType::Q8_0),
            (GgmlType::Q6K, GgmlType::Q6K),
            (GgmlType::Q5K, GgmlType::Q5K),
        ] {
            for rows in [1, 3, 16, 17] {
                add(q35(gate_ty, down_ty, rows, true));
            }
        }
    }
    // The gated shared expert at a small shape too (every backend, the quick set included).
    for rows in [1, 5] {
        add(Op::Moe {
            routing: MoeRouting {
                n_experts: 8,
                top_k: 2,
                norm_topk: true,
            },
            hidden: 256,
            ffn: 512,
            gate_ty: GgmlType::Q4K,
            down_ty: GgmlType::Q6K,
            rows,
            shared: true,
        });
    }

    // --- argmax
    for (rows, cols) in [(1, 1), (1, 7), (3, 1000), (8, 151936), (1, 248320)] {
        for kind in [
            ArgmaxKind::Random,
            ArgmaxKind::Ties,
            ArgmaxKind::Constant,
            ArgmaxKind::Negative,
        ] {
            if (quick && cols > 1000) || (cols < 4 && matches!(kind, ArgmaxKind::Ties)) {
                continue;
            }
            add(Op::Argmax { rows, cols, kind });
        }
    }

    // --- argmax fed to the next step: positions whose next one wraps the log and not.
    for (cols, pos) in [(7, 0), (1000, FEED_CHECK_LOG - 1), (151936, 40)] {
        for kind in [ArgmaxKind::Random, ArgmaxKind::Ties] {
            if quick && cols > 1000 {
                continue;
            }
            add(Op::ArgmaxFeed { cols, pos, kind });
        }
    }

    // --- top-k (sampling candidates)
    for (rows, cols, k) in [(1, 1000, 1), (1, 1000, 40), (3, 5000, 64), (2, 151936, 40)] {
        for kind in [ArgmaxKind::Random, ArgmaxKind::Ties, ArgmaxKind::Constant] {
            if quick && cols > 5000 {
                continue;
            }
            add(Op::TopK {
                rows,
                cols,
                k,
                kind,
            });
        }
    }

    // --- Qwen3.5 hybrid layers. Linear attention of Qwen3.5-9B and -35B-A3B (16 key / 32
    // value heads × 128, kernel 4; GGUF's tiled value heads and Hugging Face's grouped
    // ones), the tiny oracle's shape, and odd ones (key head dims padded inside a lane's
    // rows, partial column blocks, kernels 1..3). Each case runs a first call (`fill`
    // rows) whose state the checked call continues; fill = 0 starts from a fresh cache.
    let ds = |nk, nv, dk, dv, k, tiled| DeltaShape {
        n_k_heads: nk,
        n_v_heads: nv,
        k_head_dim: dk,
        v_head_dim: dv,
        conv_kernel: k,
        tiled_v_heads: tiled,
    };
    let q35 = ds(16, 32, 128, 128, 4, true);
    let delta_shapes = [
        q35,
        ds(16, 32, 128, 128, 4, false),
        ds(2, 4, 32, 32, 4, false),
        ds(3, 6, 24, 40, 3, true),
        ds(1, 2, 64, 20, 2, false),
        ds(2, 2, 100, 128, 4, true),
        // Odd dk and conv_dim: the scalar (not float4) loads.
        ds(1, 3, 6, 7, 2, true),
    ];
    let fills = [(0, 5), (2, 1), (7, 5), (100, 64), (37, 200)];
    for (si, &shape) in delta_shapes.iter().enumerate() {
        if si == 0 && !quick {
            // Qwen3.5-9B's prefill chunk (PREFILL_CHUNK rows): the chunked kernel's design size.
            for chunked in [false, true] {
                add(Op::GatedDelta {
                    shape,
                    fill: 0,
                    rows: 512,
                    chunked,
                });
            }
        }
        for &(fill, rows) in &fills {
            if quick && (shape.conv_dim() > 1000 || rows > 5) {
                continue;
            }
            add(Op::GatedDelta {
                shape,
                fill,
                rows,
                chunked: false,
            });
            // The tensor-core prefill kernel (off by default) on every shape's prompts.
            if !quick && rows >= 17 {
                add(Op::GatedDelta {
                    shape,
                    fill,
                    rows,
                    chunked: true,
                });
            }
            if si != 1 {
                add(Op::Conv1d {
                    shape,
                    wty: GgmlType::F32,
                    fill,
                    rows,
                });
            }
        }
    }
    // Conv taps as Hugging Face stores them (bf16 / f16); kernels 1 (no state) and 2 on an
    // odd channel count.
    for (shape, wty) in [
        (q35, GgmlType::BF16),
        (ds(2, 4, 32, 32, 4, false), GgmlType::F16),
        (ds(1, 1, 5, 27, 1, false), GgmlType::F32),
        (ds(1, 1, 5, 27, 2, false), GgmlType::F32),
    ] {
        for (fill, rows) in [(2, 1), (37, 200)] {
            if quick && rows > 5 {
                continue;
            }
            add(Op::Conv1d {
                shape,
                wty,
                fill,
                rows,
            });
        }
    }
    // State rollback (speculative decoding): Qwen3.5's linear dims, the tiny oracle's, the
    // odd scalar-load shape and a kernel-1 convolution (no conv state); from a fresh cache
    // (fill 0), decode-sized and prefill-sized continuations.
    for shape in [
        q35,
        ds(2, 4, 32, 32, 4, false),
        ds(1, 3, 6, 7, 2, true),
        ds(2, 4, 5, 27, 1, false),
    ] {
        for (fill, draft, rows) in [(0, 3, 2), (7, 4, 1), (37, 3, 4), (100, 8, 64)] {
            if quick && (shape.conv_dim() > 1000 || rows > 5) {
                continue;
            }
            // The snapshot slot, then the row states after the first and the last draft row.
            for row in [None, Some(0), Some(draft - 1)] {
                add(Op::Snapshot {
                    shape,
                    fill,
                    draft,
                    rows,
                    row,
                });
            }
        }
    }
    // Batched steps of a hybrid model (serve): decode rows only (one row a sequence: the
    // graph-captured step), prefill chunks beside decode rows (segments longer than a
    // convolution thread's run), and one sequence; Qwen3.5's dims, the tiny oracle's, the
    // odd scalar-load shape and a kernel-1 convolution.
    for shape in [
        q35,
        ds(2, 4, 32, 32, 4, false),
        ds(1, 3, 6, 7, 2, true),
        ds(2, 4, 5, 27, 1, false),
    ] {
        for (fills, rows) in [
            (vec![5, 0, 17, 2], vec![1, 1, 1, 1]),
            (vec![0, 9, 33], vec![7, 1, 20]),
            (vec![4], vec![1]),
        ] {
            if quick && (shape.conv_dim() > 1000 || rows.iter().any(|&r| r > 5)) {
                continue;
            }
            add(Op::DeltaBatch { shape, fills, rows });
        }
    }
    // Gated RMSNorm over the value heads (Qwen3.5: 32 × 128; the tiny oracle: 4 × 32; odd).
    for (heads, head_dim) in [(32, 128), (4, 32), (3, 40)] {
        for rows in [1, 5, 64, 200] {
            if quick && (heads > 4 || rows > 5) {
                continue;
            }
            add(Op::GatedRmsNorm {
                rows,
                heads,
                head_dim,
            });
        }
    }
    // Sigmoid gates: the attention output gate (16 heads × 256 in both models) and the
    // shared expert's one-column gate (35B-A3B hidden 2048), odd widths.
    for (cols, per_row) in [(4096, false), (2048, true), (33, false), (33, true)] {
        for rows in [1, 5, 64, 200] {
            if quick && (cols > 33 || rows > 5) {
                continue;
            }
            add(Op::SigmoidGate {
                rows,
                cols,
                per_row,
            });
        }
    }
    // Each gate with the projection after it (the planes it writes for that GEMV): the
    // models' 4096 columns (32 x 128 value heads; 16 x 256 attention heads), and a small one.
    for (cols, n_out, rows) in [(512, 384, 1), (4096, 2048, 1), (4096, 2048, 3)] {
        if quick && cols > 512 {
            continue;
        }
        for head_dim in [Some(128), None] {
            add(Op::GateMatmul {
                rows,
                cols,
                head_dim,
                n_out,
            });
        }
    }

    // --- graph capture / replay
    for (rows, pos_capture, pos_replay) in [(1, 5, 6), (1, 3, 4000), (4, 0, 100)] {
        add(Op::Graph {
            rows,
            heads: 4,
            head_dim: 128,
            pos_capture,
            pos_replay,
        });
    }
    v
}

// ============================================================================ random data

use crate::synth::SplitMix64;

/// SplitMix64 with Box–Muller normals.
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut r = Rng(SplitMix64(seed ^ 0x243F_6A88_85A3_08D3));
        r.next();
        r
    }
    fn next(&mut self) -> u64 {
        self.0.next()
    }
    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
    fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.normal()).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// FNV-1a of the case name mixed with the global seed.
fn case_seed(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// Weights quantized for real up to this many elements (the K-quant reference quantizer is
/// slow); larger ones are built block by block.
const REAL_QUANT_MAX: usize = 1 << 20;

/// A random weight of `shape` stored as `ty` (never all zeros).
fn gen_weight(ty: GgmlType, shape: &[usize], seed: u64) -> Result<Vec<u8>> {
    let row_len = *shape.last().unwrap_or(&1);
    let n: usize = shape.iter().product();
    let n_rows = n / row_len.max(1);
    let rb = ty.bytes_for(row_len)?;
    let mut data = vec![0u8; rb * n_rows];
    let real = is_float(ty) || n <= REAL_QUANT_MAX;
    data.par_chunks_mut(rb)
        .enumerate()
        .try_for_each(|(r, row)| -> Result<()> {
            let mut rng = Rng::new(seed ^ (r as u64).wrapping_mul(0xA24B_AED4_963E_E407));
            if real {
                let x = rng.normals(row_len, 0.05);
                quant::quantize(ty, &x, row)?;
            } else {
                synth_blocks(ty, row, &mut rng);
            }
            Ok(())
        })?;
    Ok(data)
}

fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

/// Random quant bytes with sane f16 scales (layouts as in ferrite_formats::quant).
fn synth_blocks(ty: GgmlType, row: &mut [u8], rng: &mut Rng) {
    for q in row.chunks_mut(8) {
        let r = rng.next().to_le_bytes();
        q.copy_from_slice(&r[..q.len()]);
    }
    for b in row.chunks_mut(ty.type_size()) {
        let u = 0.5 + rng.uniform() as f32;
        let sign = if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
        match ty {
            GgmlType::Q4_0 => put_f16(&mut b[0..2], sign * 0.01 * u),
            GgmlType::Q4_1 => {
                put_f16(&mut b[0..2], 0.01 * u);
                put_f16(&mut b[2..4], -0.08 * u);
            }
            GgmlType::Q8_0 => put_f16(&mut b[0..2], sign * 0.0005 * u),
            // d | dmin | scales[12] | (qh[32]) | qs[128]
            GgmlType::Q4K | GgmlType::Q5K => {
                put_f16(&mut b[0..2], 0.001 * u);
                put_f16(&mut b[2..4], 0.002 * u);
            }
            // ql[128] | qh[64] | scales[16] | d
            GgmlType::Q6K => put_f16(&mut b[208..210], sign * 0.0003 * u),
            // e (E8M0) | qs[16]: a scale of 2^-9 .. 2^-6, weights up to ~0.09.
            GgmlType::MXFP4 => b[0] = 118 + (rng.next() % 4) as u8,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {}
        }
    }
}

/// Host inputs of one case, shared by both backends.
#[derive(Default)]
struct HostData {
    weights: Vec<(GgmlType, Vec<usize>, Vec<u8>)>,
    /// Input activations: (values, rows, cols).
    acts: Vec<(Vec<f32>, usize, usize)>,
    /// Output: rows, cols (an extra poisoned row is added).
    out: (usize, usize),
    /// A second output of the ops that have two (add_rms_norm's x, qk_norm_rope's k),
    /// poisoned the same way.
    out2: Option<(usize, usize)>,
    /// Outputs past the second (rms_norm_matmuls' third and later weights), poisoned and
    /// checked the same way.
    more_outs: Vec<(usize, usize)>,
    tokens: Vec<u32>,
    pos0: usize,
    /// Attention: the KV-fill steps before the checked step.
    fill: Vec<FillStep>,
    /// Paged attention: pages and fill chunks of every sequence.
    paged: Option<paged::PagedData>,
}

/// One KV-fill (prefill) step: (q, k, v, first position, rows).
type FillStep = (Vec<f32>, Vec<f32>, Vec<f32>, usize, usize);

/// The gated delta rule's per-value-head weights, ssm_a then dt_bias (f32 `[nv]` each):
/// ssm_a = -exp(A_log) over [-20, -0.05] and dt_bias around -1, decays from ~0.99 (the state
/// carries across many tokens) to ~0.
fn push_decay_weights(h: &mut HostData, rng: &mut Rng, nv: usize) {
    let ssm_a: Vec<f32> = (0..nv)
        .map(|_| -((rng.uniform() * 6.0 - 3.0).exp() as f32))
        .collect();
    let dt_bias: Vec<f32> = (0..nv).map(|_| -1.0 + 0.5 * rng.normal()).collect();
    for w in [ssm_a, dt_bias] {
        h.weights.push((GgmlType::F32, vec![nv], f32_bytes(&w)));
    }
}

/// The operands of conv + delta-rule steps on `shape` (the Snapshot and DeltaBatch cases):
/// the weights (conv taps as f32, ssm_a, dt_bias), then per step of `n` rows its conv input,
/// qkv, a and b.
fn push_delta_steps(h: &mut HostData, rng: &mut Rng, shape: &DeltaShape, steps: &[usize]) {
    let (c, k, nv) = (shape.conv_dim(), shape.conv_kernel, shape.n_v_heads);
    let taps = rng.normals(c * k, 0.5);
    h.weights
        .push((GgmlType::F32, vec![c, k], f32_bytes(&taps)));
    push_decay_weights(h, rng, nv);
    for &n in steps {
        h.acts.push((rng.normals(n * c, 1.0), n, c));
        h.acts.push((rng.normals(n * c, 1.0), n, c));
        h.acts.push((rng.normals(n * nv, 1.0), n, nv));
        h.acts.push((rng.normals(n * nv, 2.0), n, nv));
    }
}

/// An f32 weight's stored bytes.
fn f32_bytes(w: &[f32]) -> Vec<u8> {
    w.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// An RMSNorm weight of `n` (f32, around 1), as the add_rms_norm cases draw theirs.
fn push_norm_weight(h: &mut HostData, rng: &mut Rng, n: usize) {
    let w: Vec<f32> = (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect();
    h.weights.push((GgmlType::F32, vec![n], f32_bytes(&w)));
}

/// Normal rows, each at its own scale in [0.5, 4.5): a residual stream whose rows' RMS
/// differ, so a norm taken from the wrong row (or none) shows.
fn residual_rows(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let scale = 0.5 + 4.0 * rng.uniform() as f32;
        x.extend(rng.normals(cols, scale));
    }
    x
}

/// `rows` rows of `cols` logits of the argmax, argmax_feed and top-k cases, as `kind` says.
fn argmax_logits(rng: &mut Rng, kind: ArgmaxKind, rows: usize, cols: usize) -> Vec<f32> {
    let mut x = match kind {
        ArgmaxKind::Constant => vec![1.5; rows * cols],
        ArgmaxKind::Negative => (0..rows * cols)
            .map(|_| -100.0 - rng.normal().abs())
            .collect(),
        _ => rng.normals(rows * cols, 1.0),
    };
    if let ArgmaxKind::Ties = kind {
        for row in x.chunks_mut(cols) {
            // Far apart (different threads of a row-parallel reduction), lowest last.
            for j in [cols - 1, (cols * 2) / 3, cols / 3 + 1] {
                row[j] = 10.0;
            }
        }
    }
    x
}

fn gen(op: &Op, seed: u64) -> Result<HostData> {
    let mut rng = Rng::new(seed);
    let mut h = HostData::default();
    match *op {
        Op::Embed {
            ty,
            vocab,
            dim,
            rows,
        } => {
            h.weights
                .push((ty, vec![vocab, dim], gen_weight(ty, &[vocab, dim], seed)?));
            // The first and the last id always, to catch row-offset errors at both ends.
            h.tokens = (0..rows)
                .map(|i| match i {
                    0 => vocab as u32 - 1,
                    1 => 0,
                    _ => rng.below(vocab) as u32,
                })
                .collect();
            h.out = (rows, dim);
        }
        Op::RmsNorm { wty, rows, cols } => {
            let w: Vec<f32> = (0..cols).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            let mut wb = vec![0u8; wty.bytes_for(cols)?];
            quant::quantize(wty, &w, &mut wb)?;
            h.weights.push((wty, vec![cols], wb));
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.out = (rows, cols);
        }
        Op::HeadRmsNorm {
            rows,
            heads,
            head_dim,
        } => {
            let w: Vec<f32> = (0..head_dim).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            h.weights
                .push((GgmlType::F32, vec![head_dim], f32_bytes(&w)));
            let cols = heads * head_dim;
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.out = (rows, cols);
        }
        Op::Matmul {
            ty,
            n_in,
            n_out,
            rows,
        } => {
            h.weights
                .push((ty, vec![n_out, n_in], gen_weight(ty, &[n_out, n_in], seed)?));
            h.acts.push((rng.normals(rows * n_in, 1.0), rows, n_in));
            h.out = (rows, n_out);
        }
        Op::Matmuls {
            ty,
            n_in,
            n_out,
            rows,
            v,
            checked,
        } => {
            let first = [matmuls_first_rows(n_out), n_in];
            h.weights
                .push((ty, first.to_vec(), gen_weight(ty, &first, seed)?));
            h.weights.push((
                ty,
                vec![n_out, n_in],
                gen_weight(ty, &[n_out, n_in], seed ^ 0x9e37)?,
            ));
            if let Some(v) = v {
                h.weights.push((
                    v,
                    vec![n_out, n_in],
                    gen_weight(v, &[n_out, n_in], seed ^ 0x7f4a)?,
                ));
            }
            h.acts.push((rng.normals(rows * n_in, 1.0), rows, n_in));
            // The outputs not checked, in weight order.
            let outs = [first[0], n_out, n_out];
            let n_w = if v.is_some() { 3 } else { 2 };
            for (g, &n) in outs[..n_w].iter().enumerate() {
                if g != checked {
                    h.acts.push((vec![0.0; rows * n], rows, n));
                }
            }
            h.out = (rows, outs[checked]);
        }
        Op::MatmulSwiglu {
            ty,
            n_in,
            n_out,
            rows,
            down,
        } => {
            for salt in [0, 0x51ed] {
                h.weights.push((
                    ty,
                    vec![n_out, n_in],
                    gen_weight(ty, &[n_out, n_in], seed ^ salt)?,
                ));
            }
            h.acts.push((rng.normals(rows * n_in, 1.0), rows, n_in));
            h.acts.push((vec![0.0; rows * n_out], rows, n_out));
            h.acts.push((vec![0.0; rows * n_out], rows, n_out));
            h.out = (rows, n_out);
            if down {
                h.weights.push((
                    ty,
                    vec![n_in, n_out],
                    gen_weight(ty, &[n_in, n_out], seed ^ 0xd0e5)?,
                ));
                // The SwiGLU output (the down projection's input).
                h.acts.push((vec![0.0; rows * n_out], rows, n_out));
                h.out = (rows, n_in);
            }
        }
        Op::RmsNormMatmuls {
            ty,
            n_in,
            n_outs,
            rows,
        } => {
            push_norm_weight(&mut h, &mut rng, n_in);
            for (i, &n_out) in n_outs.iter().enumerate() {
                let salt = (i as u64 + 1).wrapping_mul(0x9e37);
                h.weights.push((
                    ty,
                    vec![n_out, n_in],
                    gen_weight(ty, &[n_out, n_in], seed ^ salt)?,
                ));
            }
            h.acts
                .push((residual_rows(&mut rng, rows, n_in), rows, n_in));
            // h, the normed rows' scratch: poisoned (a backend that defers the norm leaves
            // it so; run_once checks).
            h.acts.push((vec![f32::NAN; rows * n_in], rows, n_in));
            h.out = (rows, n_outs[0]);
            h.out2 = n_outs.get(1).map(|&n| (rows, n));
            h.more_outs = n_outs.iter().skip(2).map(|&n| (rows, n)).collect();
        }
        Op::AddNormMatmuls {
            ty,
            ty_v,
            n_in,
            n_outs,
            rows,
            down,
        } => {
            push_norm_weight(&mut h, &mut rng, n_in);
            for (i, &n_out) in n_outs.iter().enumerate() {
                let t = if i == 2 { ty_v } else { ty };
                let salt = (i as u64 + 1).wrapping_mul(0x9e37);
                h.weights.push((
                    t,
                    vec![n_out, n_in],
                    gen_weight(t, &[n_out, n_in], seed ^ salt)?,
                ));
            }
            // The residual x as generated (copied into out2 before each run), y (rows of
            // unequal scales: a norm of the wrong row or of x before the add shows), and h
            // (poisoned: where the norm is handed over nothing writes it).
            h.acts
                .push((residual_rows(&mut rng, rows, n_in), rows, n_in));
            h.acts
                .push((residual_rows(&mut rng, rows, n_in), rows, n_in));
            h.acts.push((vec![f32::NAN; rows * n_in], rows, n_in));
            h.out = (rows, n_outs[0]);
            h.out2 = Some((rows, n_in));
            h.more_outs = vec![(rows, n_outs[1]), (rows, n_outs[2])];
            // The down projection (w[4]) and its input (a[3]).
            let (ty_d, down) = down;
            h.weights.push((
                ty_d,
                vec![n_in, down],
                gen_weight(ty_d, &[n_in, down], seed ^ 0xd0e1)?,
            ));
            h.acts.push((rng.normals(rows * down, 1.0), rows, down));
        }
        Op::RmsNormMatmulSwiglu {
            ty,
            n_in,
            n_out,
            rows,
        } => {
            push_norm_weight(&mut h, &mut rng, n_in);
            for salt in [0, 0x51ed] {
                h.weights.push((
                    ty,
                    vec![n_out, n_in],
                    gen_weight(ty, &[n_out, n_in], seed ^ salt)?,
                ));
            }
            // x, the scratch g and u, h (poisoned, as for rms_norm_matmuls).
            h.acts
                .push((residual_rows(&mut rng, rows, n_in), rows, n_in));
            h.acts.push((vec![0.0; rows * n_out], rows, n_out));
            h.acts.push((vec![0.0; rows * n_out], rows, n_out));
            h.acts.push((vec![f32::NAN; rows * n_in], rows, n_in));
            h.out = (rows, n_out);
        }
        Op::MatmulAdd {
            ty,
            n_in,
            n_out,
            rows,
        } => {
            h.weights
                .push((ty, vec![n_out, n_in], gen_weight(ty, &[n_out, n_in], seed)?));
            // x, the residual (kept as generated; copied into out before each run), the
            // scratch y.
            h.acts.push((rng.normals(rows * n_in, 1.0), rows, n_in));
            h.acts.push((rng.normals(rows * n_out, 2.0), rows, n_out));
            h.acts.push((vec![0.0; rows * n_out], rows, n_out));
            h.out = (rows, n_out);
        }
        Op::AddNormSwiglu {
            ty,
            hidden,
            ffn,
            rows,
        } => {
            // norm, gate, up (as rms_norm_matmul_swiglu's), then w_o.
            push_norm_weight(&mut h, &mut rng, hidden);
            for salt in [0, 0x51ed] {
                h.weights.push((
                    ty,
                    vec![ffn, hidden],
                    gen_weight(ty, &[ffn, hidden], seed ^ salt)?,
                ));
            }
            h.weights.push((
                ty,
                vec![hidden, hidden],
                gen_weight(ty, &[hidden, hidden], seed ^ 0x0a77)?,
            ));
            // A down projection, not part of the op: planes_left_same_as_quantized's GEMV on
            // the SwiGLU output.
            h.weights.push((
                ty,
                vec![hidden, ffn],
                gen_weight(ty, &[hidden, ffn], seed ^ 0x0d0e)?,
            ));
            // The attention output (rows of unequal scales too, so the sum's rows differ in
            // RMS: a norm taken from the wrong row, or from x before the add, shows), the
            // residual x as generated (copied into out2 before each run), the scratch y, g, u
            // and h (poisoned, as for rms_norm_matmul_swiglu).
            h.acts
                .push((residual_rows(&mut rng, rows, hidden), rows, hidden));
            h.acts
                .push((residual_rows(&mut rng, rows, hidden), rows, hidden));
            h.acts.push((vec![0.0; rows * hidden], rows, hidden));
            h.acts.push((vec![0.0; rows * ffn], rows, ffn));
            h.acts.push((vec![0.0; rows * ffn], rows, ffn));
            h.acts.push((vec![f32::NAN; rows * hidden], rows, hidden));
            // The SwiGLU output, then the residual after the op.
            h.out = (rows, ffn);
            h.out2 = Some((rows, hidden));
        }
        Op::Rope {
            rows,
            heads,
            head_dim,
            pos0,
            ..
        } => {
            let cols = heads * head_dim;
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.out = (rows, cols);
            h.tokens = vec![0; rows];
            h.pos0 = pos0;
        }
        Op::MoePredict { cols, n_experts } => {
            let w: Vec<f32> = (0..cols).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            h.weights.push((GgmlType::F32, vec![cols], f32_bytes(&w)));
            let wm = rng.normals(n_experts * cols, 0.05);
            h.weights
                .push((GgmlType::F32, vec![n_experts, cols], f32_bytes(&wm)));
            // x (the residual), the composition's h (poisoned).
            h.acts.push((rng.normals(cols, 2.0), 1, cols));
            h.acts.push((vec![f32::NAN; cols], 1, cols));
            h.out = (1, n_experts);
        }
        Op::AddRmsNormMatmul { rows, cols, n_out } => {
            let w: Vec<f32> = (0..cols).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            h.weights.push((GgmlType::F32, vec![cols], f32_bytes(&w)));
            let wm = rng.normals(n_out * cols, 0.05);
            h.weights
                .push((GgmlType::F32, vec![n_out, cols], f32_bytes(&wm)));
            // x (the residual stream, kept as generated), y (the block output), x's working
            // copy (reset before each run), the other residual buffer (poisoned).
            h.acts.push((rng.normals(rows * cols, 2.0), rows, cols));
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.acts.push((vec![f32::NAN; rows * cols], rows, cols));
            h.acts.push((vec![f32::NAN; rows * cols], rows, cols));
            h.out = (rows, n_out);
            h.out2 = Some((rows, cols));
        }
        Op::AddRmsNorm { wty, rows, cols } => {
            let w: Vec<f32> = (0..cols).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            let mut wb = vec![0u8; wty.bytes_for(cols)?];
            quant::quantize(wty, &w, &mut wb)?;
            h.weights.push((wty, vec![cols], wb));
            // x (the residual stream) larger than y (the block output), as in a model.
            h.acts.push((rng.normals(rows * cols, 2.0), rows, cols));
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.out = (rows, cols);
            h.out2 = Some((rows, cols));
        }
        Op::QkNormRope {
            rows,
            q_heads,
            k_heads,
            head_dim,
            norm,
            pos0,
            ..
        } => {
            if norm {
                for _ in 0..2 {
                    let w: Vec<f32> = (0..head_dim).map(|_| 1.0 + 0.1 * rng.normal()).collect();
                    h.weights
                        .push((GgmlType::F32, vec![head_dim], f32_bytes(&w)));
                }
            }
            let (qd, kd) = (q_heads * head_dim, k_heads * head_dim);
            h.acts.push((rng.normals(rows * qd, 1.0), rows, qd));
            h.acts.push((rng.normals(rows * kd, 3.0), rows, kd));
            h.out = (rows, qd);
            h.out2 = Some((rows, kd));
            h.tokens = vec![0; rows];
            h.pos0 = pos0;
        }
        Op::AddAssign { rows, cols } | Op::Swiglu { rows, cols } => {
            h.acts.push((rng.normals(rows * cols, 2.0), rows, cols));
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.out = (rows, cols);
        }
        Op::CopyRows {
            src_rows,
            cols,
            rows,
            ..
        } => {
            h.acts
                .push((rng.normals(src_rows * cols, 1.0), src_rows, cols));
            h.out = (rows, cols);
        }
        Op::GatherRows {
            src_rows,
            cols,
            pick,
        } => {
            h.acts
                .push((rng.normals(src_rows * cols, 1.0), src_rows, cols));
            h.out = (pick.len(), cols);
        }
        Op::Paged(ref c) => c.gen(&mut rng, &mut h),
        Op::Attention { .. } | Op::AttnRope { .. } | Op::AttnO { .. } => {
            let (shape, pos0, rows) = match *op {
                Op::Attention {
                    shape, pos0, rows, ..
                }
                | Op::AttnO {
                    shape, pos0, rows, ..
                } => (shape, pos0, rows),
                Op::AttnRope {
                    shape, pos0, rows, ..
                } => (shape, pos0, rows),
                _ => unreachable!(),
            };
            let qd = shape.n_heads * shape.head_dim;
            let kvd = shape.n_kv_heads * shape.head_dim;
            let mut p = 0;
            while p < pos0 {
                let n = FILL_CHUNK.min(pos0 - p);
                h.fill.push((
                    rng.normals(n * qd, 1.0),
                    rng.normals(n * kvd, 1.0),
                    rng.normals(n * kvd, 1.0),
                    p,
                    n,
                ));
                p += n;
            }
            h.acts.push((rng.normals(rows * qd, 1.0), rows, qd));
            h.acts.push((rng.normals(rows * kvd, 1.0), rows, kvd));
            h.acts.push((rng.normals(rows * kvd, 1.0), rows, kvd));
            h.out = (rows, qd);
            h.tokens = vec![0; rows];
            h.pos0 = pos0;
            if let Op::AttnO { ty, o_only, .. } = *op {
                // The o-projection, and the attention's output (out2; o-only: a[3], scratch).
                h.weights
                    .push((ty, vec![qd, qd], gen_weight(ty, &[qd, qd], seed ^ 0x0a77)?));
                if o_only {
                    h.acts.push((vec![f32::NAN; rows * qd], rows, qd));
                } else {
                    h.out2 = Some((rows, qd));
                }
            }
            if let Op::AttnRope { .. } = *op {
                // The q and k norm weights; q and k again (a[3], a[4]: the op rotates them in
                // place where it runs as two ops, so each run starts from these).
                for _ in 0..2 {
                    let w: Vec<f32> = (0..shape.head_dim)
                        .map(|_| 1.0 + 0.1 * rng.normal())
                        .collect();
                    h.weights
                        .push((GgmlType::F32, vec![shape.head_dim], f32_bytes(&w)));
                }
                let (q, k) = (h.acts[0].clone(), h.acts[1].clone());
                h.acts.push(q);
                h.acts.push(k);
            }
        }
        Op::Moe {
            routing,
            hidden,
            ffn,
            gate_ty,
            down_ty,
            rows,
            shared,
        } => {
            let ne = routing.n_experts;
            for (i, (ty, shape)) in [
                (gate_ty, [ne, ffn, hidden]),
                (gate_ty, [ne, ffn, hidden]),
                (down_ty, [ne, hidden, ffn]),
            ]
            .into_iter()
            .enumerate()
            {
                let data = gen_weight(ty, &shape, seed.wrapping_add(i as u64 + 1))?;
                h.weights.push((ty, shape.to_vec(), data));
            }
            h.acts.push((rng.normals(rows * hidden, 1.0), rows, hidden));
            h.acts.push((rng.normals(rows * ne, 2.0), rows, ne));
            if shared {
                // Its gate, up and down, its f32 gate row (scaled so that σ spans (0, 1)),
                // and the composition's scratch: gate, up, act, its output, its gate.
                for (i, (ty, shape)) in [
                    (gate_ty, vec![ffn, hidden]),
                    (gate_ty, vec![ffn, hidden]),
                    (down_ty, vec![hidden, ffn]),
                ]
                .into_iter()
                .enumerate()
                {
                    let data = gen_weight(ty, &shape, seed.wrapping_add(i as u64 + 11))?;
                    h.weights.push((ty, shape, data));
                }
                let gate_row = rng.normals(hidden, 1.0 / (hidden as f32).sqrt());
                h.weights
                    .push((GgmlType::F32, vec![1, hidden], f32_bytes(&gate_row)));
                for (r, c) in [
                    (rows, ffn),
                    (rows, ffn),
                    (rows, ffn),
                    (rows, hidden),
                    (rows, 1),
                ] {
                    h.acts.push((rng.normals(r * c, 1.0), r, c));
                }
            }
            h.out = (rows, hidden);
        }
        Op::ArgmaxFeed { cols, pos, kind } => {
            // The step the token is fed to: an unknown token at `pos`.
            h.tokens = vec![POISON_ID];
            h.pos0 = pos;
            h.acts
                .push((argmax_logits(&mut rng, kind, 1, cols), 1, cols));
            h.out = (1, 1);
        }
        Op::Argmax { rows, cols, kind }
        | Op::TopK {
            rows, cols, kind, ..
        } => {
            h.acts
                .push((argmax_logits(&mut rng, kind, rows, cols), rows, cols));
            h.out = match op {
                Op::TopK { k, .. } => (rows, *k),
                _ => (rows, 1),
            };
        }
        Op::Conv1d {
            shape,
            wty,
            fill,
            rows,
        } => {
            let (c, k) = (shape.conv_dim(), shape.conv_kernel);
            let taps = rng.normals(c * k, 0.5);
            let mut wb = vec![0u8; wty.bytes_for(c * k)?];
            quant::quantize(wty, &taps, &mut wb)?;
            h.weights.push((wty, vec![c, k], wb));
            h.acts.push((rng.normals(rows * c, 1.0), rows, c));
            h.acts.push((rng.normals(fill * c, 1.0), fill, c));
            h.out = (rows, c);
        }
        Op::GatedDelta {
            shape, fill, rows, ..
        } => {
            let (c, nv) = (shape.conv_dim(), shape.n_v_heads);
            push_decay_weights(&mut h, &mut rng, nv);
            for n in [rows, fill] {
                h.acts.push((rng.normals(n * c, 1.0), n, c));
                h.acts.push((rng.normals(n * nv, 1.0), n, nv));
                h.acts.push((rng.normals(n * nv, 2.0), n, nv));
            }
            h.out = (rows, shape.value_dim());
        }
        Op::Snapshot {
            shape,
            fill,
            draft,
            rows,
            ..
        } => {
            // Steps: the checked rows, the fill, the draft.
            push_delta_steps(&mut h, &mut rng, &shape, &[rows, fill, draft]);
            h.out = (rows, shape.conv_dim());
            h.out2 = Some((rows, shape.value_dim()));
        }
        Op::DeltaBatch {
            shape,
            ref fills,
            ref rows,
        } => {
            // Steps (all their sequences' rows): the checked one, the dirtying, the fill.
            let total = rows.iter().sum::<usize>();
            let dirty = DELTA_BATCH_DIRTY * (rows.len() + 1);
            push_delta_steps(
                &mut h,
                &mut rng,
                &shape,
                &[total, dirty, fills.iter().sum()],
            );
            h.out = (total, shape.conv_dim());
            h.out2 = Some((total, shape.value_dim()));
        }
        Op::GatedRmsNorm {
            rows,
            heads,
            head_dim,
        } => {
            let w: Vec<f32> = (0..head_dim).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            h.weights
                .push((GgmlType::F32, vec![head_dim], f32_bytes(&w)));
            let cols = heads * head_dim;
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.acts.push((rng.normals(rows * cols, 2.0), rows, cols));
            h.out = (rows, cols);
        }
        Op::SigmoidGate {
            rows,
            cols,
            per_row,
        } => {
            let gc = if per_row { 1 } else { cols };
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.acts.push((rng.normals(rows * gc, 3.0), rows, gc));
            h.out = (rows, cols);
        }
        Op::GateMatmul {
            rows,
            cols,
            head_dim,
            n_out,
        } => {
            // The norm's weight (gated_rms_norm), then the projection's.
            if let Some(hd) = head_dim {
                let w: Vec<f32> = (0..hd).map(|_| 1.0 + 0.1 * rng.normal()).collect();
                h.weights.push((GgmlType::F32, vec![hd], f32_bytes(&w)));
            }
            let ty = GgmlType::Q4K;
            h.weights
                .push((ty, vec![n_out, cols], gen_weight(ty, &[n_out, cols], seed)?));
            // x, z (or the gate), the scratch the gate runs on in place.
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.acts.push((rng.normals(rows * cols, 2.0), rows, cols));
            h.acts.push((vec![0.0; rows * cols], rows, cols));
            h.out = (rows, n_out);
        }
        Op::Graph {
            rows,
            heads,
            head_dim,
            pos_capture,
            ..
        } => {
            let cols = heads * head_dim;
            h.acts.push((rng.normals(rows * cols, 1.0), rows, cols));
            h.out = (rows, cols);
            h.tokens = vec![0; rows];
            h.pos0 = pos_capture;
        }
    }
    Ok(h)
}

// ============================================================================ execution

/// A case's buffers on one backend.
struct Prepared<B: Backend> {
    w: Vec<B::Weight>,
    a: Vec<Act<B::Buf>>,
    /// Output, with one poisoned row past the active ones.
    out: Act<B::Buf>,
    /// The second output where the op has one ([`HostData::out2`]), poisoned the same way.
    out2: Option<Act<B::Buf>>,
    /// The outputs past the second ([`HostData::more_outs`]), poisoned the same way.
    more: Vec<Act<B::Buf>>,
    step: StepInput<B::IBuf>,
    kv: Option<B::Kv>,
    /// argmax output: `tokens` of a step input (poisoned with i32::MAX).
    iout: Option<StepInput<B::IBuf>>,
}

const POISON_ID: u32 = i32::MAX as u32;

/// Entries of the token log the argmax_feed cases give the op (one more is allocated).
const FEED_CHECK_LOG: usize = 18;

/// While alive, CUDA's gated delta rule takes the kernel a `chunked` case asks for; dropped,
/// the environment decides again (so no other case or model run sees the override).
struct ChunkedOverride;

impl ChunkedOverride {
    fn new(op: &Op) -> Option<Self> {
        match op {
            Op::GatedDelta { chunked, .. } => {
                ferrite_backend::cuda::gated_delta::force_chunked(Some(*chunked));
                Some(ChunkedOverride)
            }
            _ => None,
        }
    }
}

impl Drop for ChunkedOverride {
    fn drop(&mut self) {
        ferrite_backend::cuda::gated_delta::force_chunked(None);
    }
}

fn prepare<B: Backend>(be: &B, op: &Op, h: &HostData) -> Result<Prepared<B>> {
    let _chunked = ChunkedOverride::new(op);
    let mut w = Vec::new();
    for (ty, shape, data) in &h.weights {
        w.push(be.upload(&HostTensor {
            dtype: *ty,
            shape: shape.clone(),
            data: std::borrow::Cow::Borrowed(data),
        })?);
    }
    let mut a = Vec::new();
    for (x, rows, cols) in &h.acts {
        a.push(be.from_host(x, *rows, *cols)?);
    }
    let (rows, cols) = h.out;
    let mut out = be.from_host(&vec![f32::NAN; (rows + 1) * cols], rows + 1, cols)?;
    out.set_rows(rows)?;
    let poisoned = |(rows, cols): (usize, usize)| -> Result<Act<B::Buf>> {
        let mut o = be.from_host(&vec![f32::NAN; (rows + 1) * cols], rows + 1, cols)?;
        o.set_rows(rows)?;
        Ok(o)
    };
    let out2 = h.out2.map(poisoned).transpose()?;
    let more = h
        .more_outs
        .iter()
        .map(|&o| poisoned(o))
        .collect::<Result<Vec<_>>>()?;
    let mut step = be.step_input(h.tokens.len().max(1))?;
    if !h.tokens.is_empty() {
        be.set_step(&mut step, &h.tokens, h.pos0)?;
    }
    let mut kv = None;
    let mut iout = None;
    match op {
        Op::Paged(c) => {
            let (cache, s) = c.prepare(be, h)?;
            kv = Some(cache);
            step = s;
        }
        Op::Attention { .. } | Op::AttnRope { .. } | Op::AttnO { .. } => {
            let (shape, pos0, rows, q8) = match op {
                Op::Attention {
                    shape,
                    pos0,
                    rows,
                    q8,
                } => (shape, pos0, rows, q8),
                Op::AttnO {
                    shape, pos0, rows, ..
                } => (shape, pos0, rows, &false),
                Op::AttnRope {
                    shape, pos0, rows, ..
                } => (shape, pos0, rows, &false),
                _ => unreachable!(),
            };
            let mut cache = if *q8 {
                be.kv_new_q8(2, *shape, pos0 + rows + 3)?
            } else {
                be.kv_new(2, *shape, pos0 + rows + 3)?
            };
            let (qd, kvd) = (
                shape.n_heads * shape.head_dim,
                shape.n_kv_heads * shape.head_dim,
            );
            let mut fstep = be.step_input(FILL_CHUNK)?;
            for (q, k, v, p, n) in &h.fill {
                be.set_step(&mut fstep, &vec![0; *n], *p)?;
                let (q, k, v) = (
                    be.from_host(q, *n, qd)?,
                    be.from_host(k, *n, kvd)?,
                    be.from_host(v, *n, kvd)?,
                );
                let mut o = be.zeros(*n, qd)?;
                be.attention(
                    &mut cache,
                    &fstep,
                    AttnArgs {
                        layer: 1,
                        q: &q,
                        k: &k,
                        v: &v,
                        shape: *shape,
                    },
                    &mut o,
                )?;
            }
            kv = Some(cache);
        }
        Op::Argmax { rows, .. } => {
            let mut s = be.step_input(rows + 1)?;
            be.set_step(&mut s, &vec![POISON_ID; rows + 1], 0)?;
            iout = Some(s);
        }
        Op::ArgmaxFeed { .. } => {
            // tokens: the argmax output (entry 0; the rest poisoned), positions: the log
            // (set_step's 0, 1, 2, ...: a stray write shows).
            let n = FEED_CHECK_LOG + 1;
            let mut s = be.step_input(n)?;
            be.set_step(&mut s, &vec![POISON_ID; n], 0)?;
            iout = Some(s);
        }
        Op::TopK { rows, k, .. } => {
            let n = rows * k + 1;
            let mut s = be.step_input(n)?;
            be.set_step(&mut s, &vec![POISON_ID; n], 0)?;
            iout = Some(s);
        }
        Op::Conv1d { shape, fill, .. } | Op::GatedDelta { shape, fill, .. } => {
            // Two linear layers; the cases use layer 1 (a layer-offset error shows).
            let mut cache = be.kv_new_hybrid(1, HYBRID_ATTN, 1, 2, *shape)?;
            if *fill > 0 {
                if let Op::Conv1d { .. } = op {
                    let mut o = be.zeros(*fill, shape.conv_dim())?;
                    be.causal_conv1d(&mut cache, 1, &a[1], &w[0], &mut o, None)?;
                } else {
                    let mut o = be.zeros(*fill, shape.value_dim())?;
                    be.gated_delta_rule(
                        &mut cache,
                        delta_args::<B>(&w, &a[3..6], *shape),
                        &mut o,
                        None,
                    )?;
                }
            }
            kv = Some(cache);
        }
        Op::DeltaBatch { shape, fills, rows } => {
            let n = rows.len();
            let slot_of = |i: usize| n - i;
            let longest = fills.iter().chain(rows).copied().max().unwrap_or(1);
            let page_size = longest.max(DELTA_BATCH_DIRTY).next_power_of_two();
            let paged = PagedKv {
                n_pages: 1,
                page_size,
                max_pages: 1,
                max_rows: n + 1,
                q8_0: false,
            };
            let mut cache = be.kv_new_paged_hybrid(1, HYBRID_ATTN, paged, 2, *shape, n + 1)?;
            // A batched step input over `(rows, slot)` segments (positions from 0 in page 0:
            // the linear-attention ops read none).
            let zeros = vec![0u32; longest.max(DELTA_BATCH_DIRTY)];
            let seg_step = |segs: &[(usize, usize)]| -> Result<StepInput<B::IBuf>> {
                let total = segs.iter().map(|s| s.0).sum::<usize>();
                let mut st = be.batch_step_input(total, segs.len(), 1, page_size)?;
                let seqs: Vec<SeqRows<'_>> = segs
                    .iter()
                    .map(|&(r, slot)| SeqRows {
                        tokens: &zeros[..r],
                        pos0: 0,
                        pages: &[0],
                        logits: 1,
                        state: slot,
                    })
                    .collect();
                be.set_batch(&mut st, &seqs)?;
                Ok(st)
            };
            let every: Vec<(usize, usize)> = (0..=n).map(|s| (DELTA_BATCH_DIRTY, s)).collect();
            let st = seg_step(&every)?;
            delta_step(be, &mut cache, &w, &a[4..8], *shape, st.batch.as_ref())?;
            for i in (0..n).step_by(2) {
                be.kv_clear_state(&mut cache, slot_of(i))?;
            }
            // Sequence 1 continues a copy of the unused slot 0's state.
            if n > 1 {
                be.kv_copy_state(&mut cache, 0, slot_of(1))?;
            }
            let fed: Vec<(usize, usize)> = (0..n)
                .filter(|&i| fills[i] > 0)
                .map(|i| (fills[i], slot_of(i)))
                .collect();
            if !fed.is_empty() {
                let st = seg_step(&fed)?;
                delta_step(be, &mut cache, &w, &a[8..12], *shape, st.batch.as_ref())?;
            }
            let checked: Vec<(usize, usize)> = (0..n).map(|i| (rows[i], slot_of(i))).collect();
            step = seg_step(&checked)?;
            kv = Some(cache);
        }
        Op::Snapshot {
            shape,
            fill,
            draft,
            row,
            ..
        } => {
            let mut cache = be.kv_new_hybrid(1, HYBRID_ATTN, 1, 2, *shape)?;
            be.kv_snapshots(&mut cache, 2)?;
            if row.is_some() {
                anyhow::ensure!(
                    be.kv_row_states(&mut cache, *draft)?,
                    "this backend keeps no row states"
                );
            }
            // Bad slots are errors on every backend.
            anyhow::ensure!(
                be.kv_restore(&mut cache, 1).is_err(),
                "kv_restore of an empty slot succeeded"
            );
            anyhow::ensure!(
                be.kv_snapshot(&mut cache, 2).is_err(),
                "kv_snapshot into slot 2 of 2 succeeded"
            );
            if *fill > 0 {
                delta_step(be, &mut cache, &w, &a[4..8], *shape, None)?;
            }
            be.kv_snapshot(&mut cache, 1)?;
            if *draft > 0 {
                delta_step(be, &mut cache, &w, &a[8..12], *shape, None)?;
            }
            be.kv_snapshot(&mut cache, 0)?;
            kv = Some(cache);
        }
        _ => {}
    }
    Ok(Prepared {
        w,
        a,
        out,
        out2,
        more,
        step,
        kv,
        iout,
    })
}

/// The attention part of the hybrid caches the linear-attention cases make.
const HYBRID_ATTN: AttnShape = AttnShape {
    n_heads: 1,
    n_kv_heads: 1,
    head_dim: 32,
};

/// The operands of a gated_delta_rule case: weights (ssm_a, dt_bias), acts (qkv, a, b).
fn delta_args<'a, B: Backend>(
    w: &'a [B::Weight],
    a: &'a [Act<B::Buf>],
    shape: DeltaShape,
) -> DeltaArgs<'a, B::Buf, B::Weight> {
    DeltaArgs {
        layer: 1,
        qkv: &a[0],
        a: &a[1],
        b: &a[2],
        ssm_a: &w[0],
        dt_bias: &w[1],
        shape,
    }
}

/// One step of a snapshot case outside the checked part: conv1d and the delta rule on layer 1
/// over `a` (conv input, qkv, a, b), outputs discarded.
fn delta_step<B: Backend>(
    be: &B,
    kv: &mut B::Kv,
    w: &[B::Weight],
    a: &[Act<B::Buf>],
    shape: DeltaShape,
    batch: Option<&StepBatch<B::IBuf>>,
) -> Result<()> {
    let rows = a[0].rows;
    let mut o = be.zeros(rows, shape.conv_dim())?;
    be.causal_conv1d(kv, 1, &a[0], &w[0], &mut o, batch)?;
    let mut o = be.zeros(rows, shape.value_dim())?;
    be.gated_delta_rule(kv, delta_args::<B>(&w[1..], &a[1..4], shape), &mut o, batch)
}

/// Resets the output of an in-place op to its input (not part of the timed op).
fn reset<B: Backend>(be: &B, op: &Op, p: &mut Prepared<B>) -> Result<()> {
    match op {
        Op::HeadRmsNorm { .. }
        | Op::Rope { .. }
        | Op::AddAssign { .. }
        | Op::GatedRmsNorm { .. }
        | Op::SigmoidGate { .. } => be.copy_rows(&p.a[0], 0, &mut p.out),
        Op::AddRmsNorm { .. } => be.copy_rows(&p.a[0], 0, out2(&mut p.out2)?),
        // out starts as the residual.
        Op::MatmulAdd { .. } => be.copy_rows(&p.a[1], 0, &mut p.out),
        Op::AddNormSwiglu { .. } => be.copy_rows(&p.a[1], 0, out2(&mut p.out2)?),
        Op::AddNormMatmuls { .. } => be.copy_rows(&p.a[0], 0, out2(&mut p.out2)?),
        Op::AddRmsNormMatmul { .. } => {
            let [x, _, xw, _] = &mut p.a[..] else {
                bail!("add_rms_norm_matmul: expected 4 activations")
            };
            be.copy_rows(x, 0, xw)
        }
        Op::QkNormRope { .. } => {
            be.copy_rows(&p.a[0], 0, &mut p.out)?;
            be.copy_rows(&p.a[1], 0, out2(&mut p.out2)?)
        }
        // q and k from their copies (the two-op form rotates them in place).
        Op::AttnRope { .. } => {
            let [q, k, _, q0, k0] = &mut p.a[..] else {
                bail!("qk_norm_rope+attention: expected 5 activations")
            };
            be.copy_rows(q0, 0, q)?;
            be.copy_rows(k0, 0, k)
        }
        _ => Ok(()),
    }
}

fn out2<T>(o: &mut Option<Act<T>>) -> Result<&mut Act<T>> {
    o.as_mut()
        .ok_or_else(|| anyhow::anyhow!("no second output"))
}

/// The rotation graph cases capture (Qwen3's).
const GRAPH_ROPE: Rope = Rope {
    style: RopeStyle::Neox,
    theta: 1e6,
    rot_dim: 128,
    inv_freq: None,
};

/// The body a graph case captures: restore x from the pristine input, rotate it.
fn graph_body<B: Backend>(
    be: &B,
    x0: &Act<B::Buf>,
    out: &mut Act<B::Buf>,
    step: &StepInput<B::IBuf>,
    head_dim: usize,
) -> Result<()> {
    be.copy_rows(x0, 0, out)?;
    be.rope(out, head_dim, step, &GRAPH_ROPE)
}

/// Rows of the first (unchecked) weight of a `matmuls` case: a Q next to a K or V — 4096
/// next to 1024 rows (Qwen3-8B's attention: its mixed Q4_K + Q6_K launch is then more blocks
/// than one wave unless V's split adapts), else 1024 — or `n_out` when the checked weight has
/// small outputs (the beta/alpha pair: both small, so the pair takes the f32-x GEMV's grouped
/// launch).
fn matmuls_first_rows(n_out: usize) -> usize {
    match n_out {
        0..=256 => n_out,
        // Qwen3-8B's K, V (1024 rows) and Qwen3-30B-A3B's (512): Q 4096 rows before them.
        512 | 1024 => 4096,
        _ => 1024,
    }
}

/// Runs the op once (the timed part).
fn exec<B: Backend>(be: &B, op: &Op, p: &mut Prepared<B>) -> Result<()> {
    let _chunked = ChunkedOverride::new(op);
    match op {
        Op::Embed { .. } => be.embed(&p.w[0], &p.step, &mut p.out),
        Op::RmsNorm { .. } => be.rms_norm(&p.a[0], &p.w[0], EPS, &mut p.out),
        Op::HeadRmsNorm { head_dim, .. } => be.head_rms_norm(&mut p.out, &p.w[0], *head_dim, EPS),
        Op::Matmul { .. } => be.matmul(&p.a[0], &p.w[0], &mut p.out),
        Op::Matmuls { checked, .. } => {
            // x, then the outputs not checked in weight order; the checked one is `out`.
            let Some((x, others)) = p.a.split_first_mut() else {
                bail!("matmuls: no activations")
            };
            let ws: Vec<_> = p.w.iter().collect();
            let mut others = others.iter_mut();
            let mut out = Some(&mut p.out);
            let mut outs = Vec::with_capacity(ws.len());
            for g in 0..ws.len() {
                outs.push(match out.take_if(|_| g == *checked) {
                    Some(o) => o,
                    None => others
                        .next()
                        .ok_or_else(|| anyhow::anyhow!("matmuls: too few activations"))?,
                });
            }
            be.matmuls(x, &ws, &mut outs)
        }
        Op::MatmulSwiglu { down: false, .. } => {
            let [x, g, u] = &mut p.a[..] else {
                bail!("matmul_swiglu: expected 3 activations")
            };
            be.matmul_swiglu(x, &p.w[0], &p.w[1], (g, u), &mut p.out)
        }
        Op::MatmulSwiglu { down: true, .. } => {
            let [x, g, u, h] = &mut p.a[..] else {
                bail!("swiglu_mlp: expected 4 activations")
            };
            be.swiglu_mlp(x, &p.w[0], &p.w[1], &p.w[2], (g, u), h, &mut p.out)
        }
        Op::RmsNormMatmuls { .. } => {
            let [x, h] = &mut p.a[..] else {
                bail!("rms_norm_matmuls: expected 2 activations")
            };
            let ws: Vec<&B::Weight> = p.w[1..].iter().collect();
            let mut outs: Vec<&mut Act<B::Buf>> = std::iter::once(&mut p.out)
                .chain(p.out2.as_mut())
                .chain(p.more.iter_mut())
                .collect();
            be.rms_norm_matmuls(x, (&p.w[0], EPS), &ws, &mut outs, h)
        }
        Op::RmsNormMatmulSwiglu { .. } => {
            let [x, g, u, h] = &mut p.a[..] else {
                bail!("rms_norm_matmul_swiglu: expected 4 activations")
            };
            be.rms_norm_matmul_swiglu(x, (&p.w[0], EPS), &p.w[1], &p.w[2], (g, u), &mut p.out, h)
        }
        Op::MatmulAdd { .. } => {
            let [x, _, y] = &mut p.a[..] else {
                bail!("matmul_add: expected 3 activations")
            };
            be.matmul_add(x, &p.w[0], &mut p.out, y)
        }
        Op::AddNormSwiglu { .. } => {
            let [att, _, y, g, u, h] = &mut p.a[..] else {
                bail!("matmul_add+matmul_swiglu: expected 6 activations")
            };
            let x = out2(&mut p.out2)?;
            let norm = (&p.w[0], EPS);
            let (wo, gu) = (&p.w[3], [&p.w[1], &p.w[2]]);
            // The hand-over (quantized weights) or the deferred norm (float weights at decode
            // rows): the pair as the decoder runs it then.
            if be.defers_rms_norm_after(wo, &gu, att.rows) || be.defers_rms_norm(&gu, att.rows) {
                be.matmul_add_for_norm(att, wo, x, y, norm)?;
                return be.rms_norm_matmul_swiglu(x, norm, gu[0], gu[1], (g, u), &mut p.out, h);
            }
            // As the decoder's dense layer where the o-projection does not hand the norm over:
            // the add in its epilogue and a plain norm, or the add + norm; the gate and up alone
            // read h (poisoned, as above).
            if be.adds_in_epilogue(wo, att.rows) {
                be.matmul_add(att, wo, x, y)?;
                be.rms_norm_for(x, norm.0, EPS, h, &gu)?;
            } else {
                be.matmul(att, wo, y)?;
                be.add_rms_norm_for(x, y, norm.0, EPS, h, &gu)?;
            }
            be.matmul_swiglu(h, gu[0], gu[1], (g, u), &mut p.out)
        }
        Op::AddNormMatmuls { .. } => {
            let [_, y, h, act] = &mut p.a[..] else {
                bail!("matmul_add+matmuls: expected 4 activations")
            };
            let x = p
                .out2
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("matmul_add+matmuls: no residual output"))?;
            let norm = (&p.w[0], EPS);
            let ws: Vec<&B::Weight> = p.w[1..4].iter().collect();
            let mut outs: Vec<&mut Act<B::Buf>> = std::iter::once(&mut p.out)
                .chain(p.more.iter_mut())
                .collect();
            let wd = &p.w[4];
            if be.defers_rms_norm_after(wd, &ws, act.rows) {
                be.matmul_add_for_norm(act, wd, x, y, norm)?;
                return be.rms_norm_matmuls(x, norm, &ws, &mut outs, h);
            }
            // As the decoder: the add in the down's epilogue and a plain norm where the backend
            // has one, else the add + norm; either norm told that Q, K, V alone read h (h is
            // poisoned: a reader of its f32 rows where the norm left them unwritten shows).
            if be.adds_in_epilogue(wd, act.rows) {
                be.matmul_add(act, wd, x, y)?;
                be.rms_norm_for(x, norm.0, EPS, h, &ws)?;
            } else {
                be.matmul(act, wd, y)?;
                be.add_rms_norm_for(x, y, norm.0, EPS, h, &ws)?;
            }
            be.matmuls(h, &ws, &mut outs)
        }
        Op::Rope { head_dim, rope, .. } => be.rope(&mut p.out, *head_dim, &p.step, rope),
        Op::AddAssign { .. } => be.add_assign(&mut p.out, &p.a[1]),
        Op::AddRmsNorm { .. } => {
            be.add_rms_norm(out2(&mut p.out2)?, &p.a[1], &p.w[0], EPS, &mut p.out)
        }
        Op::MoePredict { .. } => {
            let [x, h] = &mut p.a[..] else {
                bail!("moe_predict: expected 2 activations")
            };
            be.moe_predict_logits(x, (&p.w[0], EPS), &p.w[1], h, &mut p.out)
        }
        Op::AddRmsNormMatmul { .. } => {
            // The sum ends in the working copy either way (moved there where the op put it
            // out of place): what run_once reads.
            let [_, y, xw, xa] = &mut p.a[..] else {
                bail!("add_rms_norm_matmul: expected 4 activations")
            };
            let h = out2(&mut p.out2)?;
            if be.add_rms_norm_matmul(xw, y, xa, &p.w[0], EPS, h, &p.w[1], &mut p.out)? {
                be.copy_rows(xa, 0, xw)?;
            }
            Ok(())
        }
        Op::QkNormRope {
            head_dim,
            rope,
            norm,
            ..
        } => {
            let (qn, kn) = if *norm {
                (Some(&p.w[0]), Some(&p.w[1]))
            } else {
                (None, None)
            };
            be.qk_norm_rope(
                &mut p.out,
                out2(&mut p.out2)?,
                qn,
                kn,
                *head_dim,
                EPS,
                &p.step,
                rope,
            )
        }
        Op::Swiglu { .. } => be.swiglu(&p.a[0], &p.a[1], &mut p.out),
        Op::CopyRows { start, .. } => be.copy_rows(&p.a[0], *start, &mut p.out),
        Op::GatherRows { pick, .. } => be.gather_rows(&p.a[0], pick, &mut p.out),
        Op::Paged(c) => {
            let kv =
                p.kv.as_mut()
                    .ok_or_else(|| anyhow::anyhow!("no KV cache"))?;
            be.attention(
                kv,
                &p.step,
                AttnArgs {
                    layer: 1,
                    q: &p.a[0],
                    k: &p.a[1],
                    v: &p.a[2],
                    shape: c.shape,
                },
                &mut p.out,
            )
        }
        Op::Attention { shape, .. } | Op::AttnO { shape, .. } => {
            let kv =
                p.kv.as_mut()
                    .ok_or_else(|| anyhow::anyhow!("no KV cache"))?;
            let args = AttnArgs {
                layer: 1,
                q: &p.a[0],
                k: &p.a[1],
                v: &p.a[2],
                shape: *shape,
            };
            if let Op::Attention { .. } = op {
                return be.attention(kv, &p.step, args, &mut p.out);
            }
            // AttnO: the projection before the attention (Q, K, V's place), into out: the
            // 16-bit x form the prefill's matmuls take; then the attention and its projection.
            be.matmul(&p.a[0], &p.w[0], &mut p.out)?;
            if let Op::AttnO { o_only: true, .. } = op {
                let [q, k, v, att] = &mut p.a[..] else {
                    bail!("attention+o: expected 4 activations")
                };
                let args = AttnArgs {
                    layer: 1,
                    q: &*q,
                    k: &*k,
                    v: &*v,
                    shape: *shape,
                };
                be.attention_for(kv, &p.step, args, att, &[&p.w[0]])?;
                return be.matmul(att, &p.w[0], &mut p.out);
            }
            let att = out2(&mut p.out2)?;
            be.attention(kv, &p.step, args, att)?;
            be.matmul(att, &p.w[0], &mut p.out)
        }
        Op::AttnRope {
            shape,
            rot_dim,
            inv_freq,
            ..
        } => {
            let kv =
                p.kv.as_mut()
                    .ok_or_else(|| anyhow::anyhow!("no KV cache"))?;
            let rope = Rope {
                rot_dim: *rot_dim,
                inv_freq: inv_freq.clone(),
                ..ATTN_ROPE
            };
            let qk = QkRope {
                q_norm: Some(&p.w[0]),
                k_norm: Some(&p.w[1]),
                head_dim: shape.head_dim,
                eps: EPS,
                step: &p.step,
                rope: &rope,
            };
            let [q, k, v, ..] = &mut p.a[..] else {
                bail!("qk_norm_rope+attention: expected 5 activations")
            };
            be.qk_norm_rope_attention(kv, qk, (q, k, &*v), 1, *shape, &mut p.out)
        }
        Op::Moe {
            routing,
            shared: false,
            ..
        } => be.moe(
            &p.a[0],
            &p.a[1],
            ExpertWeights {
                gate: &p.w[0],
                up: &p.w[1],
                down: &p.w[2],
            },
            *routing,
            &mut p.out,
        ),
        Op::Moe {
            routing,
            rows,
            shared: true,
            ..
        } => {
            let experts = ExpertWeights {
                gate: &p.w[0],
                up: &p.w[1],
                down: &p.w[2],
            };
            let sw = ExpertWeights {
                gate: &p.w[3],
                up: &p.w[4],
                down: &p.w[5],
            };
            let [x, logits, g, u, act, so, sg] = &mut p.a[..] else {
                bail!("moe+shared: expected 7 activations")
            };
            if be.moe_shared(x, logits, experts, sw, &p.w[6], *routing, &mut p.out)? {
                return Ok(());
            }
            // CUDA fuses every case here up to 16 rows (moe.rs `moe_shared`: Q4_K, Q5_K, Q6_K
            // and Q8_0 experts) unless switched off: a composition there would leave the fused
            // kernels unchecked.
            let fuses = be.name().starts_with("cuda")
                && *rows <= ferrite_backend::cuda::moe::DECODE_MAX_ROWS
                && std::env::var("FERRITE_MOE_SHARED").as_deref() != Ok("0");
            if fuses {
                bail!("moe+shared: the CUDA backend ran the composition, not its fused form");
            }
            be.moe(x, logits, experts, *routing, &mut p.out)?;
            be.matmul_swiglu(x, sw.gate, sw.up, (g, u), act)?;
            be.matmul(act, sw.down, so)?;
            be.matmul(x, &p.w[6], sg)?;
            be.sigmoid_gate(so, sg)?;
            be.add_assign(&mut p.out, so)
        }
        Op::Argmax { .. } => {
            let s = p
                .iout
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("no argmax output"))?;
            be.argmax(&p.a[0], &mut s.tokens)
        }
        Op::ArgmaxFeed { .. } => {
            let s = p
                .iout
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("no argmax output"))?;
            be.argmax_feed(
                &p.a[0],
                &mut s.tokens,
                &mut p.step,
                &mut s.positions,
                FEED_CHECK_LOG,
            )
        }
        Op::TopK { k, .. } => {
            let s = p
                .iout
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("no top-k output"))?;
            be.top_k(&p.a[0], *k, &mut s.tokens, &mut p.out)
        }
        Op::Graph {
            rows,
            head_dim,
            pos_replay,
            ..
        } => {
            let (x0, out, step) = (&p.a[0], &mut p.out, &p.step);
            let graph = be.capture(&mut || graph_body(be, x0, out, step, *head_dim))?;
            // New positions, written outside the graph as the engine does, then replay.
            be.set_step(&mut p.step, &vec![0; *rows], *pos_replay)?;
            match graph {
                Some(g) => be.replay(&g),
                None => graph_body(be, &p.a[0], &mut p.out, &p.step, *head_dim),
            }
        }
        Op::Conv1d { .. } => {
            let kv =
                p.kv.as_mut()
                    .ok_or_else(|| anyhow::anyhow!("no hybrid cache"))?;
            be.causal_conv1d(kv, 1, &p.a[0], &p.w[0], &mut p.out, None)
        }
        Op::GatedDelta { shape, .. } => {
            let kv =
                p.kv.as_mut()
                    .ok_or_else(|| anyhow::anyhow!("no hybrid cache"))?;
            be.gated_delta_rule(
                kv,
                delta_args::<B>(&p.w, &p.a[..3], *shape),
                &mut p.out,
                None,
            )
        }
        Op::Snapshot { shape, row, .. } => {
            let kv =
                p.kv.as_mut()
                    .ok_or_else(|| anyhow::anyhow!("no hybrid cache"))?;
            match row {
                Some(r) => be.kv_restore_row(kv, *r)?,
                None => be.kv_restore(kv, 1)?,
            }
            be.causal_conv1d(kv, 1, &p.a[0], &p.w[0], &mut p.out, None)?;
            let o2 = p
                .out2
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("no second output"))?;
            be.gated_delta_rule(kv, delta_args::<B>(&p.w[1..], &p.a[1..4], *shape), o2, None)
        }
        Op::DeltaBatch { shape, .. } => {
            let kv =
                p.kv.as_mut()
                    .ok_or_else(|| anyhow::anyhow!("no hybrid cache"))?;
            let batch = p.step.batch.as_ref();
            be.causal_conv1d(kv, 1, &p.a[0], &p.w[0], &mut p.out, batch)?;
            let o2 = p
                .out2
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("no second output"))?;
            be.gated_delta_rule(
                kv,
                delta_args::<B>(&p.w[1..], &p.a[1..4], *shape),
                o2,
                batch,
            )
        }
        Op::GatedRmsNorm { head_dim, .. } => {
            be.gated_rms_norm(&mut p.out, &p.a[1], &p.w[0], *head_dim, EPS)
        }
        Op::SigmoidGate { .. } => be.sigmoid_gate(&mut p.out, &p.a[1]),
        Op::GateMatmul { head_dim, .. } => {
            let [x, zg, xs] = &mut p.a[..] else {
                bail!("gate+matmul: expected 3 activations")
            };
            let w =
                p.w.last()
                    .ok_or_else(|| anyhow::anyhow!("gate+matmul: no weight"))?;
            // A quantized-x GEMV first (as the projections before the gate in a decode
            // step), so that the int8 scratch the gate writes into exists.
            be.matmul(x, w, &mut p.out)?;
            be.copy_rows(x, 0, xs)?;
            match head_dim {
                Some(hd) => be.gated_rms_norm(xs, zg, &p.w[0], *hd, EPS)?,
                None => be.sigmoid_gate(xs, zg)?,
            }
            be.matmul(xs, w, &mut p.out)
        }
    }
}

enum Output {
    F(Vec<f32>),
    I(Vec<i32>),
}

/// Runs the case once on a fresh preparation and reads the result; checks that the poisoned
/// row past the active rows is untouched.
fn run_once<B: Backend>(be: &B, op: &Op, h: &HostData) -> Result<(Output, Prepared<B>)> {
    let mut p = prepare(be, op, h)?;
    reset(be, op, &mut p)?;
    exec(be, op, &mut p)?;
    if let Op::AddNormSwiglu { .. } = op {
        planes_left_same_as_quantized(be, op, &mut p)?;
    }
    if let Op::Argmax { rows, .. } = op {
        let s = p
            .iout
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no argmax output"))?;
        let ids = be.read_i32(&s.tokens, rows + 1)?;
        anyhow::ensure!(
            ids[*rows] == POISON_ID as i32,
            "argmax wrote past its {rows} rows"
        );
        return Ok((Output::I(ids[..*rows].to_vec()), p));
    }
    if let Op::ArgmaxFeed { pos, .. } = op {
        let s = p
            .iout
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no argmax output"))?;
        let n = FEED_CHECK_LOG + 1;
        let out = be.read_i32(&s.tokens, n)?;
        anyhow::ensure!(
            out[1..].iter().all(|&v| v == POISON_ID as i32),
            "argmax_feed wrote past its one row"
        );
        anyhow::ensure!(
            p.step.pos0 == pos + 1,
            "argmax_feed left the step's host position at {}, not {}",
            p.step.pos0,
            pos + 1
        );
        let mut ids = vec![out[0]];
        ids.extend(be.read_i32(&p.step.tokens, 1)?);
        ids.extend(be.read_i32(&p.step.positions, 1)?);
        ids.extend(be.read_i32(&s.positions, n)?);
        return Ok((Output::I(ids), p));
    }
    if let Op::TopK { rows, k, .. } = op {
        let n = rows * k;
        let s = p
            .iout
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no top-k output"))?;
        let mut ids = be.read_i32(&s.tokens, n + 1)?;
        anyhow::ensure!(ids[n] == POISON_ID as i32, "top_k wrote past its {n} ids");
        // The values must be the logits at those ids: append them, compared exactly too.
        let vals = be.to_host(&p.out)?;
        ids.truncate(n);
        ids.extend(vals.iter().map(|v| v.to_bits() as i32));
        return Ok((Output::I(ids), p));
    }
    if let Op::AddRmsNormMatmul { .. } = op {
        same_as_composition(be, op, h, &mut p)?;
        // The second output checked is h + the sum (Op::AddRmsNormMatmul).
        be.add_assign(out2(&mut p.out2)?, &p.a[2])?;
    }
    norm_deferred_untouched(be, op, &p)?;
    if let Op::Matmul { rows, n_out, .. } = op {
        if (2..=ROW_INVARIANT_ROWS).contains(rows) || (*rows > 1 && *n_out <= ROUTER_MAX_OUT) {
            matmul_rows_same_as_alone(be, op, &p)?;
        }
    }
    if let Op::MatmulAdd { .. } = op {
        matmul_add_same_as_composition(be, op, h, &mut p)?;
    }
    if let Op::MatmulSwiglu { down: true, .. } = op {
        swiglu_mlp_add_same_as_composition(be, op, h, &p)?;
    }
    if let Op::AddNormSwiglu { .. } = op {
        add_for_norm_same_as_matmul_add(be, op, h, &mut p)?;
    }
    let mut all = read_guarded(be, &mut p.out)?;
    if let Some(o) = &mut p.out2 {
        all.extend(read_guarded(be, o)?);
    }
    for o in &mut p.more {
        all.extend(read_guarded(be, o)?);
    }
    Ok((Output::F(all), p))
}

/// A backend that says it defers the norm of a rms_norm_matmuls / rms_norm_matmul_swiglu
/// case's weights (`defers_rms_norm`), or hands it over from the projection before
/// (`defers_rms_norm_after`, the matmul_add_for_norm cases), must have run no norm: the
/// scratch h is still poisoned.
fn norm_deferred_untouched<B: Backend>(be: &B, op: &Op, p: &Prepared<B>) -> Result<()> {
    let (ws, h, producer): (Vec<&B::Weight>, &Act<B::Buf>, _) = match op {
        Op::RmsNormMatmuls { .. } => (p.w[1..].iter().collect(), &p.a[1], None),
        Op::RmsNormMatmulSwiglu { .. } => (p.w[1..3].iter().collect(), &p.a[3], None),
        Op::AddNormSwiglu { .. } => (p.w[1..3].iter().collect(), &p.a[5], Some(&p.w[3])),
        _ => return Ok(()),
    };
    let handed = producer.is_some_and(|w| be.defers_rms_norm_after(w, &ws, h.rows));
    if be.defers_rms_norm(&ws, h.rows) || handed {
        let v = be.to_host(h)?;
        let written = v.iter().filter(|x| !x.is_nan()).count();
        anyhow::ensure!(
            written == 0,
            "the norm is deferred ({}), yet {written} of {} values of the scratch h were written",
            if handed {
                "defers_rms_norm_after"
            } else {
                "defers_rms_norm"
            },
            v.len()
        );
    }
    Ok(())
}

/// Row counts up to which a matmul must give every row the bits of that row's one-row call:
/// a speculative verify (K + 1 ≤ 9 rows) and a batched decode step (up to 16 sequences) must
/// reproduce the decode step's logits exactly, or greedy output with speculation stops being
/// plain greedy output (gate 3) and a sequence served in a batch stops being the sequence
/// alone. CUDA's decode GEMVs serve these rows; on the CPU every row count is one `dot_many`
/// lane per output.
const ROW_INVARIANT_ROWS: usize = GEMV_MAX_ROWS;

/// Outputs up to which a weight is router-like (the CUDA GEMV's small-output bound, whose
/// prefill takes `gemv_<type>_rows`): its matmul must give every row that row's one-row bits at
/// ANY row count, prefill included, since a MoE router's choices must not depend on how many
/// tokens arrive together (a prefill routed unlike the decode changes the experts, and with
/// them the answer).
const ROUTER_MAX_OUT: usize = cuda_matmul::F32_SMALL_OUT;

/// A matmul of 2..=[`ROW_INVARIANT_ROWS`] rows (any count for [`ROUTER_MAX_OUT`] outputs or
/// fewer) against each of its rows run alone on the same
/// backend: bitwise equal (R-invariance of the decode GEMVs; the padded rows of an R-row
/// instantiation must not reach a real row).
fn matmul_rows_same_as_alone<B: Backend>(be: &B, op: &Op, p: &Prepared<B>) -> Result<()> {
    let Op::Matmul {
        n_in, n_out, rows, ..
    } = *op
    else {
        bail!("matmul_rows_same_as_alone: not a matmul case")
    };
    let x = be.to_host(&p.a[0])?;
    let all = be.to_host(&p.out)?;
    for r in 0..rows {
        let x1 = be.from_host(&x[r * n_in..(r + 1) * n_in], 1, n_in)?;
        let mut o1 = be.zeros(1, n_out)?;
        be.matmul(&x1, &p.w[0], &mut o1)?;
        ensure_same_bits(
            &be.to_host(&o1)?,
            &all[r * n_out..(r + 1) * n_out],
            &format!("matmul: row {r} of {rows} differs from the row alone"),
        )?;
    }
    Ok(())
}

/// That two equally long value lists are bitwise equal; else an error `"{what} in {n} of
/// {len} values"` (`what` says which output differs from which).
fn ensure_same_bits(fused: &[f32], reference: &[f32], what: &str) -> Result<()> {
    let differ = fused
        .iter()
        .zip(reference)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    anyhow::ensure!(differ == 0, "{what} in {differ} of {} values", fused.len());
    Ok(())
}

/// A fresh, reset copy of a case's buffers, for running the composition the fused op must
/// reproduce beside the case's own run.
fn twin<B: Backend>(be: &B, op: &Op, h: &HostData) -> Result<Prepared<B>> {
    let mut q = prepare(be, op, h)?;
    reset(be, op, &mut q)?;
    Ok(q)
}

/// `matmul_add` against its composition (matmul into y, add_assign into out) on the same
/// backend: bitwise equal (the trait's contract; the CPU's default op is that composition).
fn matmul_add_same_as_composition<B: Backend>(
    be: &B,
    op: &Op,
    h: &HostData,
    p: &mut Prepared<B>,
) -> Result<()> {
    let mut q = twin(be, op, h)?;
    {
        let [x, _, y] = &mut q.a[..] else {
            bail!("matmul_add: expected 3 activations")
        };
        be.matmul(x, &q.w[0], y)?;
        be.add_assign(&mut q.out, y)?;
    }
    ensure_same_bits(
        &be.to_host(&p.out)?,
        &be.to_host(&q.out)?,
        "matmul_add: out differs from matmul + add_assign's",
    )
}

/// `swiglu_mlp_add` (the down added to a residual; CUDA at prefill rows of 16-bit weights: in
/// cuBLASLt's epilogue, β = 1) against the op's own `swiglu_mlp` output added to that residual
/// by `add_assign`: bitwise equal (the same GEMM algorithm, its output added once in f32).
fn swiglu_mlp_add_same_as_composition<B: Backend>(
    be: &B,
    op: &Op,
    h: &HostData,
    p: &Prepared<B>,
) -> Result<()> {
    let &Op::MatmulSwiglu { n_in, rows, .. } = op else {
        bail!("swiglu_mlp_add: not a swiglu_mlp case")
    };
    // A random residual, as the matmul_add cases' (scale 2).
    let res0 = Rng::new(0x5ad0).normals(rows * n_in, 2.0);
    let mut want = be.from_host(&res0, rows, n_in)?;
    let mut got = be.from_host(&res0, rows, n_in)?;
    let mut y = be.from_host(&vec![f32::NAN; rows * n_in], rows, n_in)?;
    let mut q = twin(be, op, h)?;
    {
        let [x, g, u, a] = &mut q.a[..] else {
            bail!("swiglu_mlp: expected 4 activations")
        };
        be.swiglu_mlp_add(x, &q.w[0], &q.w[1], &q.w[2], (g, u), a, &mut got, &mut y)?;
    }
    be.add_assign(&mut want, &p.out)?;
    ensure_same_bits(
        &be.to_host(&got)?,
        &be.to_host(&want)?,
        "swiglu_mlp_add: the residual differs from swiglu_mlp + add_assign's",
    )
}

/// What a SwiGLU left for the GEMV after it against what that GEMV quantizes itself: CUDA's
/// Q8_0 SwiGLU ring writes h's int8 planes for the down projection (`FERRITE_SWIGLU_QH`),
/// which a GEMV on exactly that output, with no launch in between, reads instead of running
/// quant_x. So a down projection of the op's SwiGLU output straight after the op (`p.w[4]`,
/// not part of the op) and one of a copy of it (a buffer with no planes recorded) must be
/// bitwise equal: both quantizations are `quant_q8_lane` on the same values. Runs first after
/// the op (any launch between them would drop the record).
fn planes_left_same_as_quantized<B: Backend>(be: &B, op: &Op, p: &mut Prepared<B>) -> Result<()> {
    let &Op::AddNormSwiglu {
        hidden, ffn, rows, ..
    } = op
    else {
        bail!("planes_left_same_as_quantized: not a matmul_add+matmul_swiglu case")
    };
    let down =
        p.w.get(4)
            .ok_or_else(|| anyhow::anyhow!("matmul_add+matmul_swiglu: no down projection"))?;
    let mut left = be.zeros(rows, hidden)?;
    let mut copy = be.zeros(rows, ffn)?;
    let mut fresh = be.zeros(rows, hidden)?;
    be.matmul(&p.out, down, &mut left)?;
    be.copy_rows(&p.out, 0, &mut copy)?;
    be.matmul(&copy, down, &mut fresh)?;
    ensure_same_bits(
        &be.to_host(&left)?,
        &be.to_host(&fresh)?,
        "the down projection on the planes the SwiGLU left differs from one on quant_x's",
    )
}

/// A matmul_add_for_norm case's residual against plain `matmul_add`'s on the same backend:
/// bitwise equal (the trait's contract: whatever the producer prepares for the norm after it,
/// the residual's bits are matmul_add's).
fn add_for_norm_same_as_matmul_add<B: Backend>(
    be: &B,
    op: &Op,
    h: &HostData,
    p: &mut Prepared<B>,
) -> Result<()> {
    let mut q = twin(be, op, h)?;
    {
        let [att, _, y, ..] = &mut q.a[..] else {
            bail!("matmul_add+matmul_swiglu: expected 6 activations")
        };
        be.matmul_add(att, &q.w[3], out2(&mut q.out2)?, y)?;
    }
    ensure_same_bits(
        &be.to_host(out2(&mut p.out2)?)?,
        &be.to_host(out2(&mut q.out2)?)?,
        "matmul_add_for_norm: the residual differs from matmul_add's",
    )
}

/// `add_rms_norm_matmul` against its composition (add_rms_norm, matmul) on the
/// same backend: logits, h and the sum bitwise equal (the CPU's default op is that
/// composition; CUDA's fused decode kernel must reproduce it).
fn same_as_composition<B: Backend>(
    be: &B,
    op: &Op,
    h: &HostData,
    p: &mut Prepared<B>,
) -> Result<()> {
    let mut q = twin(be, op, h)?;
    {
        let [_, y, xw, _] = &mut q.a[..] else {
            bail!("add_rms_norm_matmul: expected 4 activations")
        };
        let hq = out2(&mut q.out2)?;
        be.add_rms_norm(xw, y, &q.w[0], EPS, hq)?;
        be.matmul(hq, &q.w[1], &mut q.out)?;
    }
    let pairs = [
        ("logits", be.to_host(&p.out)?, be.to_host(&q.out)?),
        (
            "h",
            be.to_host(out2(&mut p.out2)?)?,
            be.to_host(out2(&mut q.out2)?)?,
        ),
        ("x + y", be.to_host(&p.a[2])?, be.to_host(&q.a[2])?),
    ];
    for (what, fused, composed) in pairs {
        ensure_same_bits(
            &fused,
            &composed,
            &format!("add_rms_norm_matmul: {what} differs from the composition's"),
        )?;
    }
    Ok(())
}

/// The active rows of an output; checks that the poisoned row past them is untouched.
fn read_guarded<B: Backend>(be: &B, out: &mut Act<B::Buf>) -> Result<Vec<f32>> {
    let rows = out.rows;
    out.set_rows(rows + 1)?;
    let all = be.to_host(out);
    out.set_rows(rows)?;
    let mut all = all?;
    let cols = out.cols;
    anyhow::ensure!(
        all[rows * cols..].iter().all(|v| v.is_nan()),
        "the op wrote past its {rows} active rows (into the capacity)"
    );
    all.truncate(rows * cols);
    Ok(all)
}

fn nmse(test: &[f32], reference: &[f32]) -> f64 {
    let err: f64 = test
        .iter()
        .zip(reference)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let pow: f64 = reference.iter().map(|b| (*b as f64).powi(2)).sum();
    if pow == 0.0 {
        err
    } else {
        err / pow
    }
}

fn threshold<B: Backend>(be: &B, op: &Op) -> f64 {
    match op {
        Op::CopyRows { .. } | Op::GatherRows { .. } => EXACT_NMSE,
        Op::Paged(c) => c.threshold(be),
        Op::Embed { .. }
        | Op::RmsNorm { .. }
        | Op::HeadRmsNorm { .. }
        | Op::AddAssign { .. }
        | Op::Swiglu { .. } => ELEMENTWISE_NMSE,
        Op::Rope { .. } => ROPE_NMSE,
        Op::AddRmsNorm { .. } => ADD_RMS_NORM_NMSE,
        // The f32 GEMV's accumulation on top of the norm's.
        Op::AddRmsNormMatmul { .. } => MATMUL_GEMV_NMSE,
        // The same norm and f32 dot products, in the kernel's order.
        Op::MoePredict { .. } => MATMUL_GEMV_NMSE,
        Op::QkNormRope { .. } => QK_NORM_ROPE_NMSE,
        Op::Graph { .. } => GRAPH_NMSE,
        Op::Matmul {
            ty, n_out, rows, ..
        }
        | Op::Matmuls {
            ty, n_out, rows, ..
        } => matmul_nmse(*ty, *n_out, *rows),
        // The residual added in the epilogue is the same f32 add as add_assign's: the
        // matmul's own error, diluted by the residual's power.
        Op::MatmulAdd {
            ty, n_out, rows, ..
        } => matmul_nmse(*ty, *n_out, *rows),
        // Deferring the norm (s · ((x ⊙ n) · W)) changes the rounding order only (~1e-7
        // relative, as the GEMV's own summation order): the matmul's threshold, the loosest
        // of the outputs' kernels (each output is compared apart).
        Op::RmsNormMatmuls {
            ty, n_outs, rows, ..
        } => n_outs
            .iter()
            .map(|&n| matmul_nmse(*ty, n, *rows))
            .fold(0.0, f64::max),
        Op::RmsNormMatmulSwiglu {
            ty, n_out, rows, ..
        } => SWIGLU_NMSE_FACTOR * matmul_nmse(*ty, *n_out, *rows),
        // The looser of the two outputs' thresholds (see output_thresholds: each output is
        // held to its own).
        Op::AddNormSwiglu { .. } | Op::AddNormMatmuls { .. } => {
            output_thresholds(op).into_iter().fold(0.0, f64::max)
        }
        Op::MatmulSwiglu {
            ty,
            n_in,
            n_out,
            rows,
            down,
        } => {
            let t = SWIGLU_NMSE_FACTOR * matmul_nmse(*ty, *n_out, *rows);
            if *down {
                // Two matmuls in a row: their errors add.
                t + matmul_nmse(*ty, *n_in, *rows)
            } else {
                t
            }
        }
        // The attention's threshold (f16 cache, one decode row) plus QK-norm + RoPE's.
        Op::AttnRope { .. } => {
            let b = be.kv_bytes_per_element();
            QK_NORM_ROPE_NMSE
                + if b >= 4.0 {
                    ATTN_F32_NMSE
                } else {
                    ATTN_F16_TC_NMSE
                }
        }
        // The attention's error carries through the projection (a linear map of random
        // weights keeps its relative size); the projection adds its own.
        Op::AttnO {
            shape,
            pos0,
            rows,
            ty,
            ..
        } => {
            let att = Op::Attention {
                shape: *shape,
                pos0: *pos0,
                rows: *rows,
                q8: false,
            };
            threshold(be, &att) + matmul_nmse(*ty, shape.n_heads * shape.head_dim, *rows)
        }
        Op::Attention {
            rows, q8, shape, ..
        } => {
            let b = be.kv_bytes_per_element();
            if b >= 4.0 {
                ATTN_F32_NMSE
            } else if b >= 2.0 && !*q8 {
                if *rows <= ATTN_DECODE_MAX_ROWS && shape.head_dim != ATTN_DECODE_TC_HEAD_DIM {
                    ATTN_F16_DECODE_NMSE
                } else {
                    ATTN_F16_TC_NMSE
                }
            } else {
                ATTN_Q8_NMSE
            }
        }
        Op::Moe {
            rows,
            gate_ty,
            down_ty,
            ..
        } => {
            if ferrite_backend::cuda::moe::quantized_decode_types(*gate_ty, *down_ty, *rows) {
                MOE_DECODE_Q8_NMSE
            } else if *rows <= ferrite_backend::cuda::moe::DECODE_MAX_ROWS {
                MOE_DECODE_NMSE
            } else {
                MOE_PREFILL_NMSE
            }
        }
        Op::Argmax { .. } | Op::ArgmaxFeed { .. } | Op::TopK { .. } => 0.0,
        Op::Conv1d { .. } => CONV1D_NMSE,
        Op::GatedDelta { .. } => GATED_DELTA_NMSE,
        Op::Snapshot { .. } => SNAPSHOT_NMSE,
        Op::DeltaBatch { .. } => DELTA_BATCH_NMSE,
        Op::GatedRmsNorm { .. } => GATED_NORM_NMSE,
        Op::SigmoidGate { .. } => SIGMOID_GATE_NMSE,
        // The projection's threshold: the gate's own error is far below it.
        Op::GateMatmul { rows, n_out, .. } => matmul_nmse(GgmlType::Q4K, *n_out, *rows),
    }
}

/// Per-output thresholds of the ops whose outputs are held to different ones (in output
/// order: out, out2, more); empty where the op's threshold applies to every output.
fn output_thresholds(op: &Op) -> Vec<f64> {
    match op {
        // The SwiGLU output: as the matmul_swiglu cases of that type and shape (the handed-over
        // planes of x ⊙ norm are the quantized GEMV's x, 1/rms applied after the dot products
        // as in the deferred norm). The residual: the o-projection's matmul threshold (the add
        // is add_assign's f32 add, bitwise; run_once checks it against matmul_add).
        Op::AddNormSwiglu {
            ty,
            hidden,
            ffn,
            rows,
        } => vec![
            SWIGLU_NMSE_FACTOR * matmul_nmse(*ty, *ffn, *rows),
            matmul_nmse(*ty, *hidden, *rows),
        ],
        // Q, K, V: the matmul thresholds of their types and shapes (the handed-over planes of
        // x ⊙ norm are the quantized GEMV's x, 1/rms applied after the dot products, as for
        // the FFN's hand-over). The residual: x + y in f32, bitwise add_rms_norm's sum, y the
        // down projection's output (the matmul threshold of its type and shape).
        Op::AddNormMatmuls {
            ty,
            ty_v,
            n_in,
            n_outs: [nq, nk, nv],
            rows,
            down,
        } => {
            // q, k and v read h of the residual the down projection wrote: its error carries
            // into theirs (two matmuls in a row: the errors add, as for MatmulSwiglu's down;
            // at prefill rows, two bf16 roundings of x, ~1.1e-5 with quantized weights).
            let d = matmul_nmse(down.0, *n_in, *rows);
            vec![
                matmul_nmse(*ty, *nq, *rows) + d,
                d,
                matmul_nmse(*ty, *nk, *rows) + d,
                matmul_nmse(*ty_v, *nv, *rows) + d,
            ]
        }
        _ => Vec::new(),
    }
}

/// Bytes per cached K/V element an attention case reads: q8_0 cases on a backend whose caches
/// are narrower than f32 take the q8_0 figure, the others the backend's own cache element.
fn kv_elem_bytes<B: Backend>(be: &B, q8: bool) -> f64 {
    if q8 && be.kv_bytes_per_element() < 4.0 {
        KvType::Q8_0.bytes_per_element()
    } else {
        be.kv_bytes_per_element()
    }
}

/// Bytes the op must move (read + write), for the --perf GB/s.
fn bytes_moved<B: Backend>(be: &B, op: &Op, h: &HostData) -> f64 {
    let acts: usize = h.acts.iter().map(|(x, _, _)| x.len() * 4).sum();
    let out = h.out.0 * h.out.1 * 4;
    let f = |x: usize| x as f64;
    match op {
        Op::Embed { ty, dim, rows, .. } => f(rows * ty.bytes_for(*dim).unwrap_or(0)) + f(out),
        Op::Matmul { .. } => f(h.weights[0].2.len() + acts + out),
        Op::Matmuls { .. } | Op::MatmulSwiglu { .. } => {
            let w: usize = h.weights.iter().map(|w| w.2.len()).sum();
            f(w + acts + out)
        }
        // The norm and the weights, x in, the outputs (the scratch h, g, u: not needed).
        Op::RmsNormMatmuls { .. } | Op::RmsNormMatmulSwiglu { .. } => {
            let w: usize = h.weights.iter().map(|w| w.2.len()).sum();
            let outs: usize = h
                .out2
                .iter()
                .chain(&h.more_outs)
                .map(|(r, c)| r * c * 4)
                .sum();
            f(w + h.acts[0].0.len() * 4 + out + outs)
        }
        // The weight, x in, the residual read and written (the scratch y: not needed).
        Op::MatmulAdd { .. } => f(h.weights[0].2.len() + h.acts[0].0.len() * 4 + 2 * out),
        // The four weights, the attention output in, the residual read and written, the SwiGLU
        // output (the scratch y, g, u, h: not needed).
        Op::AddNormSwiglu { .. } => {
            // (The fifth weight, the down projection of the planes check, is not the op's.)
            let w: usize = h.weights[..4].iter().map(|w| w.2.len()).sum();
            let x = h.out2.map_or(0, |(r, c)| r * c * 4);
            f(w + h.acts[0].0.len() * 4 + 2 * x + out)
        }
        // The norm and the weights, y in, the residual read and written, the outputs.
        Op::AddNormMatmuls { .. } => {
            let w: usize = h.weights.iter().map(|w| w.2.len()).sum();
            let outs: usize = h.more_outs.iter().map(|(r, c)| r * c * 4).sum();
            f(w + 3 * h.acts[0].0.len() * 4 + out + outs)
        }
        Op::RmsNorm { .. } | Op::Swiglu { .. } => f(acts + out),
        Op::HeadRmsNorm { .. } | Op::Rope { .. } => f(2 * out),
        Op::AddAssign { .. } => f(3 * out),
        // Reads x and y; writes x and h.
        Op::AddRmsNorm { .. } => f(acts + 2 * out),
        // Reads x, y and the router; writes the sum, h and the logits.
        Op::AddRmsNormMatmul { rows, cols, .. } => {
            f(h.weights[1].2.len() + 4 * rows * cols * 4 + out)
        }
        // Reads x, the norm and the router; writes the logits.
        Op::MoePredict { cols, .. } => f(h.weights[1].2.len() + 2 * cols * 4 + out),
        // Reads and writes q and k.
        Op::QkNormRope { .. } => f(2 * acts),
        Op::CopyRows { .. } | Op::GatherRows { .. } => f(2 * out),
        Op::Paged(c) => c.bytes(be, h),
        Op::Argmax { .. } | Op::ArgmaxFeed { .. } => f(acts),
        Op::TopK { k, .. } => f(acts * k),
        Op::Graph { .. } => f(3 * out),
        // x in, out, the taps, the state read and written.
        Op::Conv1d { shape, .. } => {
            f(h.acts[0].0.len() * 4 + out + h.weights[0].2.len() + 2 * shape.conv_state_len() * 4)
        }
        // qkv, a, b in, out, the recurrent state read and written.
        Op::GatedDelta { shape, .. } => {
            let ins: usize = h.acts[..3].iter().map(|(x, _, _)| x.len() * 4).sum();
            f(ins + out + 2 * shape.recurrent_state_len() * 4)
        }
        // The restore of both layers' conv and recurrent state, then the checked step's
        // conv1d and delta rule (as their cases).
        Op::Snapshot { shape, rows, .. } => {
            let (conv, state) = (shape.conv_state_len() * 4, shape.recurrent_state_len() * 4);
            let out2 = rows * shape.value_dim() * 4;
            let ins: usize = h.acts[..4].iter().map(|(x, _, _)| x.len() * 4).sum();
            // Restore: 2 layers × (read + write); the ops: layer 1 read + write.
            let moved_state = (2 * 2 + 2) * (conv + state);
            f(moved_state + ins + out + out2 + h.weights[0].2.len())
        }
        // Each sequence's conv and recurrent state read and written, the checked step's
        // inputs, both outputs, the taps.
        Op::DeltaBatch { shape, rows, .. } => {
            let (conv, state) = (shape.conv_state_len() * 4, shape.recurrent_state_len() * 4);
            let out2 = rows.iter().sum::<usize>() * shape.value_dim() * 4;
            let ins: usize = h.acts[..4].iter().map(|(x, _, _)| x.len() * 4).sum();
            f(2 * rows.len() * (conv + state) + ins + out + out2 + h.weights[0].2.len())
        }
        // x and z (or gate) in, x out.
        Op::GatedRmsNorm { .. } | Op::SigmoidGate { .. } => f(acts + out),
        // The weights, x and z (or the gate) in, the projection's output (twice: the GEMV
        // before the gate too).
        Op::GateMatmul { .. } => {
            let w: usize = h.weights.iter().map(|w| w.2.len()).sum();
            f(2 * w + acts + 2 * out)
        }
        Op::Attention {
            shape,
            pos0,
            rows,
            q8,
        } => {
            let kvd = shape.n_kv_heads * shape.head_dim;
            f((pos0 + rows) * kvd * 2) * kv_elem_bytes(be, *q8) + f(acts + out)
        }
        Op::AttnRope {
            shape, pos0, rows, ..
        } => {
            let kvd = shape.n_kv_heads * shape.head_dim;
            f((pos0 + rows) * kvd * 2) * kv_elem_bytes(be, false) + f(acts + out)
        }
        // The cache, q, k, v, the weight twice (two matmuls), the attention's output written
        // and read, the projection's written twice.
        Op::AttnO {
            shape, pos0, rows, ..
        } => {
            let kvd = shape.n_kv_heads * shape.head_dim;
            f((pos0 + rows) * kvd * 2) * kv_elem_bytes(be, false)
                + f(2 * h.weights[0].2.len() + acts + 4 * out)
        }
        Op::Moe { routing, rows, .. } => {
            // The distinct experts the tokens chose (from the CPU routing of the same logits).
            let (logits, _, ne) = &h.acts[1];
            let mut used = BTreeSet::new();
            for l in logits.chunks(*ne).take(*rows) {
                for (e, _) in route_top_k(l, routing) {
                    used.insert(e);
                }
            }
            // The routed experts' three matrices; a shared expert's (and its gate row) whole.
            let per_expert: usize = h.weights[..3]
                .iter()
                .map(|w| w.2.len() / routing.n_experts)
                .sum();
            let shared: usize = h.weights[3..].iter().map(|w| w.2.len()).sum();
            f(used.len() * per_expert + shared + acts + out)
        }
    }
}

/// Median µs per op: warm-up, then 5 batches of `reps` runs, each closed by a device
/// synchronisation (a 1-element read back). Where the backend has graphs and `eager` is false
/// the `reps` runs are captured once and the batches replay that graph: the time is then what
/// the op costs inside a captured decode step (no host launch overhead, only the device's gaps
/// between kernels). Otherwise the runs are launched back to back, as a prefill's are.
fn time_case<B: Backend>(
    be: &B,
    op: &Op,
    p: &mut Prepared<B>,
    reps: usize,
    eager: bool,
) -> Result<f64> {
    let tiny = be.from_host(&[0.0], 1, 1)?;
    for _ in 0..3 {
        exec(be, op, p)?;
    }
    be.to_host(&tiny)?;
    let reps = reps.max(1);
    // Not capturable, or not asked for: time eager launches.
    let graph = if eager {
        None
    } else {
        be.capture(&mut || {
            for _ in 0..reps {
                exec(be, op, p)?;
            }
            Ok(())
        })
        .unwrap_or_default()
    };
    let mut per = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        match &graph {
            Some(g) => be.replay(g)?,
            None => {
                for _ in 0..reps {
                    exec(be, op, p)?;
                }
            }
        }
        be.to_host(&tiny)?;
        per.push(t0.elapsed().as_secs_f64() * 1e6 / reps as f64);
    }
    per.sort_by(|a, b| a.total_cmp(b));
    Ok(per[per.len() / 2])
}

/// Runs `cases` (after `--filter`) on `be` against `cpu`; prints one line per case and the
/// coverage. Returns the number of failed cases (the caller prints the verdict).
pub fn run_cases<B: Backend>(
    be: &B,
    cpu: &CpuBackend,
    all: &[Case],
    args: &CheckArgs,
) -> Result<usize> {
    println!("ferrite check: {} against {}", be.name(), cpu.name());
    let bw = if args.perf {
        let bw = be.copy_bandwidth()?;
        println!("copy bandwidth: {:.1} GB/s", bw / 1e9);
        bw
    } else {
        0.0
    };
    let selected: Vec<&Case> = all
        .iter()
        .filter(|c| args.filter.as_deref().is_none_or(|f| c.name.contains(f)))
        .collect();
    let (mut failed, mut passed) = (0usize, 0usize);
    let t_all = Instant::now();
    for c in &selected {
        let seed = case_seed(args.seed, &c.name);
        let thr = threshold(be, &c.op);
        let line = match check_case(be, cpu, c, seed, thr, args, bw) {
            Ok((ok, text)) => {
                if ok {
                    passed += 1;
                } else {
                    failed += 1;
                }
                format!("{:<72} {text}", c.name)
            }
            Err(e) => {
                failed += 1;
                format!("{:<72} ERROR {e:#}  FAIL", c.name)
            }
        };
        println!("{line}");
    }
    println!(
        "{} cases in {:.1} s: {passed} passed, {failed} failed",
        selected.len(),
        t_all.elapsed().as_secs_f64()
    );
    let covered: BTreeSet<&str> = all.iter().map(|c| c.op_name).collect();
    let missing: Vec<&str> = OPS
        .iter()
        .copied()
        .filter(|o| !covered.contains(o))
        .collect();
    if missing.is_empty() {
        println!("coverage: every Backend op has cases ({})", OPS.join(", "));
    } else {
        println!("Backend ops with no case: {}", missing.join(", "));
    }
    Ok(failed)
}

/// One case: (passed, the rest of its report line).
fn check_case<B: Backend>(
    be: &B,
    cpu: &CpuBackend,
    c: &Case,
    seed: u64,
    thr: f64,
    args: &CheckArgs,
    bw: f64,
) -> Result<(bool, String)> {
    let h = gen(&c.op, seed)?;
    let (want, _) = run_once(cpu, &c.op, &h)?;
    let (got, mut p) = run_once(be, &c.op, &h)?;
    let (ok, mut text) = match (&got, &want) {
        (Output::I(g), Output::I(w)) => {
            let ok = g == w;
            let text = if ok {
                format!("{:<25}  OK", "ids equal")
            } else {
                format!("ids {g:?} != cpu {w:?}  FAIL")
            };
            (ok, text)
        }
        (Output::F(g), Output::F(w)) => {
            let bad = g.iter().filter(|v| !v.is_finite()).count();
            let cpu_bad = w.iter().filter(|v| !v.is_finite()).count();
            // Several outputs: each compared apart against its own threshold (where the op
            // has per-output ones), the worst relative to its threshold counts (NaN wins).
            let lens = std::iter::once(p.out.len())
                .chain(p.out2.iter().map(|o| o.len()))
                .chain(p.more.iter().map(|o| o.len()));
            let per = output_thresholds(&c.op);
            let thr_all = thr;
            let (mut e, mut thr, mut worst, mut at) = (0f64, thr, f64::NEG_INFINITY, 0usize);
            let mut each = Vec::new();
            for (i, n) in lens.chain(std::iter::once(usize::MAX)).enumerate() {
                let end = at.saturating_add(n).min(g.len());
                if end > at {
                    let x = nmse(&g[at..end], &w[at..end]);
                    each.push(x);
                    let t = per.get(i).copied().unwrap_or(thr_all);
                    let r = if t > 0.0 {
                        x / t
                    } else if x > 0.0 {
                        f64::INFINITY
                    } else {
                        0.0
                    };
                    if r > worst || x.is_nan() {
                        (e, thr, worst) = (x, t, if x.is_nan() { f64::NAN } else { r });
                    }
                }
                at = end;
            }
            let ok = bad == 0 && cpu_bad == 0 && e <= thr;
            let mut text = format!("NMSE {e:>9.2e} <= {thr:<7.0e}");
            if bad > 0 {
                text += &format!(" {bad} non-finite values");
            }
            if cpu_bad > 0 {
                text += &format!(" ({cpu_bad} non-finite on the CPU: bad case)");
            }
            text += if ok { "  OK" } else { "  FAIL" };
            if !ok && each.len() > 1 {
                // Which of the outputs (in the op's order) failed.
                let list: Vec<String> = each.iter().map(|x| format!("{x:.2e}")).collect();
                text += &format!(" (each output: {})", list.join(", "));
            }
            (ok, text)
        }
        _ => bail!("output kinds differ"),
    };
    if args.perf && !matches!(c.op, Op::Graph { .. }) {
        let us = time_case(be, &c.op, &mut p, args.reps, args.eager)?;
        let gbs = bytes_moved(be, &c.op, &h) / (us * 1e-6) / 1e9;
        text += &format!(
            "  {us:>10.1} µs {gbs:>8.1} GB/s {:>5.1}%",
            100.0 * gbs * 1e9 / bw.max(1.0)
        );
    }
    Ok((ok, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nmse_basics() {
        assert_eq!(nmse(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((nmse(&[0.0, 0.0], &[1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!(nmse(&[f32::NAN], &[1.0]).is_nan());
    }

    /// Block-built weights decode to finite, non-zero, sanely scaled values for every type.
    #[test]
    fn synthesized_blocks_are_sane() {
        for ty in GgmlType::ALL {
            let n = 512;
            let mut row = vec![0u8; ty.bytes_for(n).unwrap()];
            synth_blocks(ty, &mut row, &mut Rng::new(7));
            if is_float(ty) {
                continue; // float rows are always drawn and converted, never block-built
            }
            let mut f = vec![0f32; n];
            quant::dequantize(ty, &row, &mut f).unwrap();
            assert!(f.iter().all(|v| v.is_finite() && v.abs() < 10.0), "{ty}");
            assert!(f.iter().filter(|v| **v != 0.0).count() > n / 2, "{ty}");
        }
    }

    #[test]
    fn weights_are_deterministic_and_nonzero() {
        for ty in GgmlType::ALL {
            let shape = [3, ty.block_size().max(64)];
            let a = gen_weight(ty, &shape, 1).unwrap();
            assert_eq!(a, gen_weight(ty, &shape, 1).unwrap(), "{ty}");
            assert_ne!(a, gen_weight(ty, &shape, 2).unwrap(), "{ty}");
        }
    }

    #[test]
    fn case_names_are_unique() {
        for quick in [true, false] {
            let c = cases(quick);
            let names: BTreeSet<&str> = c.iter().map(|c| c.name.as_str()).collect();
            assert_eq!(names.len(), c.len());
        }
    }
}
