//! KV cache and attention launchers (`kernels/attention.cu`; its header holds the plan).
//!
//! The cache is f16, laid out `[layer][kv_head][pos][head_dim]` so that one kv head's keys
//! over a run of positions are contiguous (coalesced 16-byte loads for decode splits and
//! prefill tiles). Each attention call:
//! 1. rows ≤ [`DECODE_MAX_ROWS`] (decode, MTP verify) with a tuned head_dim: ONE launch,
//!    `attn_decode_<hd>_<gb>`, stores the step's k, v rows into the cache, runs split-K
//!    flash-decoding and merges the splits (the last block of a row's splits to finish does
//!    it) into the output and its int8 planes for the o-projection; the grid depends only on
//!    the cache (split count fixed at [`kv_new`]) and the row count, never on the position,
//!    so a captured decode step replays at every position;
//! 2. otherwise `kv_store` (the step's k, v rows, f32 → f16 at `step.positions[t]`), then
//!    causal flash attention over query tiles (prefill) or the fallback.
//!
//! Head dims 32, 64, 128 and 256 have tuned kernels; any other head_dim ≤ 512 runs a simple
//! warp-per-head fallback (`attn_generic`).
//!
//! **Paged caches** ([`kv_new_paged`], serving): `[layer][page][kv_head][page_size][head_dim]`,
//! shared by the sequences of a batched step, each row addressed through its sequence's
//! block table (the `*_paged` kernels; the contiguous cache is the one-page case of the same
//! layout). [`attention`] splits a batched step into launches: runs of short segments
//! (decode rows of many sequences, ≤ [`DECODE_MAX_ROWS`]-row chunks) through split-K decode
//! in one launch, each longer prefill chunk (one sequence) through the prefill kernel. A
//! pure decode step is one launch whatever its batch size, graph-capturable per batch size.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

/// Kernel source.
pub const SRC: &str = include_str!("kernels/attention.cu");

use super::launch::{KernelArg, LaunchExt};
use super::{function, load_module, matmul, CudaBackend, CudaWeight};
use crate::{Act, AttnArgs, AttnShape, PagedKv, StepInput};

/// Storage type of the KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// f16 (the default): 2 bytes per element.
    #[default]
    F16,
    /// ggml q8_0 in planes (int8 quants + one f16 scale per 32): 1.0625 bytes per element.
    /// Needs head_dim % 32 == 0.
    Q8_0,
}

impl KvType {
    /// Bytes per cached key or value element.
    pub fn bytes_per_element(self) -> f64 {
        match self {
            KvType::F16 => 2.0,
            KvType::Q8_0 => 1.0 + 2.0 / 32.0,
        }
    }
}

/// Steps of up to this many rows use the split-K decode kernel (decode, MTP verify of up to
/// 15 drafts); longer steps use the prefill kernel. Scratch is sized for this many rows.
pub const DECODE_MAX_ROWS: usize = 16;
/// Upper bound on the decode split count (scratch grows linearly with it; the kernel's
/// merge holds DECODE_MAX_SPLITS = 128 weights per head in shared memory).
const MAX_SPLITS: usize = 64;
/// The kernel's limit on the split count (DECODE_MAX_SPLITS in attention.cu).
const KERNEL_MAX_SPLITS: usize = 128;
/// Fewest positions a decode split covers (the kernel's `min_chunk`; longer chunks are
/// rounded up to whole block iterations). 32: twice the splits below ~4096 positions, one
/// block iteration each (ATTENTION.md, "min_chunk 32"): the SIMT kernels' head dims.
const DECODE_MIN_CHUNK: usize = 32;
/// The same at [`DECODE_TC_HEAD_DIM`] (the tensor-core kernels with the cluster merge):
/// 64, so that caches of up to 1024 positions take at most 16 splits, merged through a
/// thread-block cluster (CLUSTER_MAX_SPLITS). Same-call tg128 at ~600 positions over 32:
/// Qwen3-8B Q4_K_M +0.7%, Qwen3-30B-A3B +1.3%, F16 +0.7%, Q8_0 +0.3%; Qwen3.5-9B (head dim
/// 256, SIMT) −0.7%, hence the two values. Caches of 4096 positions and more have 64 splits
/// either way (ATTENTION.md, "min_chunk 64 at head dim 128").
const DECODE_MIN_CHUNK_TC: usize = 64;
/// Decode blocks wanted per SM at rows = 1 (4 blocks × 4 warps, ~64 KB of loads in flight
/// per SM: enough to cover DRAM latency at full bandwidth).
const DECODE_BLOCKS_PER_SM: usize = 4;
/// The same for the q8_0 tensor-core loop that loads its next tile early
/// (`attn_decode_tc_q8p_128_<gb>`: 167 registers, 3 blocks per SM), whose split count is
/// rounded down so that the launch stays one wave (ATTENTION.md, "The q8_0 loop's next tile in
/// flight").
const DECODE_PIPE_BLOCKS_PER_SM: usize = 3;
/// Decode L2 prefetch distance in key tiles (the kernel's `pf`; 0 = off). Off: no gain
/// measured (ATTENTION.md, one-launch decode round).
const DECODE_PREFETCH: usize = 0;
/// Head dims with tuned kernels.
const FAST_HEAD_DIMS: [usize; 4] = [32, 64, 128, 256];
/// Largest head_dim of the fallback kernel (16 values per lane).
const GENERIC_MAX_HEAD_DIM: usize = 512;
/// Threads per prefill block (PREFILL_THREADS in attention.cu).
const PREFILL_THREADS: usize = 256;
/// Head dims of the tensor-core prefill kernels (`attn_prefill_tc[_q8]_<hd>`).
const TC_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Threads and query slots of a tensor-core prefill block (TC_THREADS, TC_SLOTS).
const TC_THREADS: usize = 128;
const TC_SLOTS: usize = 64;

/// `FERRITE_ATTN_TC2` (read once; default 1): 1 runs a contiguous f16 cache's tensor-core
/// prefill on `attn_prefill_tc2_<hd>`, two groups of 4 warps a block taking alternate key
/// tiles, merged at the end (ATTENTION.md 53rd session: the pp512 launch 38.6 → 32.4 µs,
/// Qwen3-8B Q4_K_M pp512 at depth 8192 +7% on an H100); 0 the one-group kernel.
fn tc2() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_ATTN_TC2", 1) != 0)
}

/// The largest head dim with an `attn_prefill_tc2_<hd>`: at 256 its 128 accumulators a thread
/// would spill under the two-blocks-an-SM register ceiling (128).
const TC2_MAX_HEAD_DIM: usize = 128;

/// A tensor-core prefill kernel and its threads a block: [`TC_THREADS`], or twice that for
/// `attn_prefill_tc2_<hd>` (two key groups).
type TcPrefill = (CudaFunction, usize);

/// `FERRITE_ATTN_X16` (read once; default 1, MATMUL.md round 99): 1 has a contiguous f16
/// cache's prefill on the two-group kernel also write its output as the o-projection's 16-bit
/// x (`attn_prefill_tc2_<hd>_x{bf16,f16}`, into the prefill matmuls' x scratch, matmul.rs
/// `xb_for_producer`), which then skips its conversion launch, as the norms' hand-over does
/// for Q, K, V and gate/up (MATMUL.md round 99).
fn attn_x16() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_ATTN_X16", 1) != 0)
}

/// Dynamic shared memory of `attn_prefill_tc[_q8]_<hd>` (TcShape::SMEM in attention.cu): q as
/// f16 [64][hd + 8] and double-buffered f16 K and V tiles [2][keys][hd + 8]; q8_0 (`q8` = 1),
/// one f16 K and V tile and the double-buffered raw stages (int8 + one f16 scale per 32).
fn tc_smem(head_dim: usize, q8: usize) -> usize {
    let keys = if head_dim >= 256 { 32 } else { 64 };
    if q8 == 1 {
        2 * (TC_SLOTS + 2 * keys) * (head_dim + 8) + 4 * keys * (head_dim + head_dim / 16)
    } else {
        2 * (TC_SLOTS + 4 * keys) * (head_dim + 8)
    }
}

/// The decode kernel (without the cluster merge) for this cache and shape: the tensor-core
/// loop (`tc[q8]`, by log2 heads per block) at [`DECODE_TC_HEAD_DIM`] where it is loaded, else
/// the SIMT one (`simt[q8][head dim index][log2 heads per block]`). Contiguous and paged
/// caches pass their own kernel sets.
fn decode_kernel<'a>(
    tc: &'a [Option<Vec<CudaFunction>>; 2],
    simt: &'a [Vec<Vec<CudaFunction>>; 2],
    q8: usize,
    fi: usize,
    gbi: usize,
    head_dim: usize,
) -> &'a CudaFunction {
    match &tc[q8] {
        Some(tc) if head_dim == DECODE_TC_HEAD_DIM => &tc[gbi],
        _ => &simt[q8][fi][gbi],
    }
}

/// The prefill kernel for this cache and shape with its launch shape: the tensor-core one
/// (`tc[q8]`) where it applies (a [`TC_HEAD_DIMS`] head size, a GQA group that fits its 64
/// slots, the cache type not switched off), else the SIMT one (`simt[q8]`: a
/// [`FAST_HEAD_DIMS`] head size, a group that fits its tile); `None`: the fallback kernel.
/// Both take the same arguments.
#[allow(clippy::too_many_arguments)]
fn prefill_kernel<'a>(
    tc: &'a [Option<Vec<TcPrefill>>; 2],
    simt: &'a [Vec<CudaFunction>; 2],
    q8: usize,
    head_dim: usize,
    group: usize,
    rows: usize,
    n_kv_heads: usize,
) -> Option<(&'a CudaFunction, LaunchConfig)> {
    if group == 0 {
        return None;
    }
    let tc_kernel = TC_HEAD_DIMS
        .iter()
        .position(|&h| h == head_dim)
        .filter(|_| group <= TC_SLOTS)
        .and_then(|i| tc[q8].as_ref()?.get(i));
    if let Some((f, threads)) = tc_kernel {
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(TC_SLOTS / group) as u32, n_kv_heads as u32, 1),
            block_dim: (*threads as u32, 1, 1),
            shared_mem_bytes: tc_smem(head_dim, q8) as u32,
        };
        return Some((f, cfg));
    }
    let fi = fast_index(head_dim)?;
    if group > prefill_slots(head_dim) {
        return None;
    }
    let cfg = LaunchConfig {
        grid_dim: (
            rows.div_ceil(prefill_slots(head_dim) / group) as u32,
            n_kv_heads as u32,
            1,
        ),
        block_dim: (PREFILL_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    Some((&simt[q8][fi], cfg))
}

/// One sequence's KV cache in VRAM.
pub struct CudaKv {
    pub kv_type: KvType,
    /// Keys, `[layer][kv_head][pos][head_dim]`: f16 bits (2 bytes each) or q8_0 quants.
    pub k: CudaSlice<u8>,
    /// Values, same layout.
    pub v: CudaSlice<u8>,
    /// q8_0 scales (f16 bits) of the keys, `[layer][kv_head][pos][head_dim/32]`; one unused
    /// element for f16 caches.
    pub k_scales: CudaSlice<u16>,
    /// q8_0 scales of the values.
    pub v_scales: CudaSlice<u16>,
    pub n_layers: usize,
    pub shape: AttnShape,
    /// Positions per layer.
    pub capacity: usize,
    /// Decode splits per (row, head); fixed for the cache's lifetime so every decode launch
    /// has the same grid and a row's arithmetic depends only on its own position.
    pub n_splits: usize,
    /// Fewest positions per decode split (fixed with `n_splits`).
    min_chunk: usize,
    /// Split-K partials: unnormalised output `[rows][n_heads][n_splits][head_dim]`.
    part_acc: CudaSlice<f32>,
    /// Split-K partials: (running max, running sum) per `[rows][n_heads][n_splits]`.
    part_ml: CudaSlice<f32>,
    /// Merge tickets, one counter per `[rows][n_heads]` (at most one per decode block of
    /// heads); zero between launches (the merging block resets its counter).
    tickets: CudaSlice<i32>,
    /// Rows the split-K scratch holds ([`DECODE_MAX_ROWS`], or a paged cache's batch size).
    scratch_rows: usize,
    /// `Some((n_pages, page_size))` for a paged cache; `capacity` is then
    /// `n_pages · page_size` (positions of all sequences together).
    paged: Option<(usize, usize)>,
    /// Hybrid models: the Gated DeltaNet layers' conv and recurrent state
    /// (`gated_delta::kv_new_hybrid`).
    pub delta: Option<super::gated_delta::DeltaState>,
    /// Which snapshot slots hold a snapshot (`gated_delta::kv_snapshots`; the copies live in
    /// `delta`).
    pub slots: crate::SnapshotSlots,
}

/// The decode forms that merge their splits in their own last blocks ([`Kernels`]
/// `decode_tail`).
struct DecodeTail {
    loops: [Vec<CudaFunction>; 2],
    pre: Option<Vec<CudaFunction>>,
    blocks_per_sm: usize,
}

/// Whether a tail-merge decode launch of `rows` rows can make progress: its spinning blocks
/// (at most four per head and row: one per 32-dim piece of a head) must leave at least one of
/// the launch's resident slots free for a split that has not started (attention.cu
/// `decode_tail_merge`).
fn tail_fits(n_heads: usize, rows: usize, blocks_per_sm: usize, sm_count: usize) -> bool {
    4 * n_heads * rows < blocks_per_sm * sm_count
}

/// Most splits the tail merge takes (attention.cu: 4 warps × TAIL_MAX_PER_WARP, the partials
/// its registers hold next to the loop's).
const TAIL_MAX_SPLITS: usize = 64;

/// The compiled attention kernels.
pub struct Kernels {
    /// Cache type of the next [`kv_new`] (a [`KvType`] as u8; F16 unless set).
    kv_type: AtomicU8,
    /// `[f16, q8_0]` variants of each kernel.
    kv_store: [CudaFunction; 2],
    /// `decode[q8][hd index][log2 heads-per-block]`.
    decode: [Vec<Vec<CudaFunction>>; 2],
    /// The tensor-core decode kernels (contiguous caches, head_dim [`DECODE_TC_HEAD_DIM`]; the
    /// paged ones are in [`PagedKernels`]),
    /// `[f16, q8_0]`, each by log2 heads-per-block; `None` where `FERRITE_ATTN_DTC` keeps
    /// that cache type on the SIMT loop (0: both, 2: q8_0).
    decode_tc: [Option<Vec<CudaFunction>>; 2],
    /// The same with the split merge through a thread-block cluster
    /// (`attn_decode_tc[_q8]_cl_128_<gb>`, sm_90+; taken where the cache's split count is
    /// 2..=[`CLUSTER_MAX_SPLITS`]); `None` below sm_90, where the tensor-core kernels are off,
    /// or with `FERRITE_ATTN_CLUSTER=0`.
    decode_cl: [Option<Vec<CudaFunction>>; 2],
    /// The SIMT loop at head dim [`DECODE_CL_SIMT_HEAD_DIM`] with the same cluster merge
    /// (`attn_decode[_q8]_cl_256_<gb>`: Qwen3.5's gated attention), `[f16, q8_0]` by log2
    /// heads per block; `None` below sm_90 or with `FERRITE_ATTN_CLUSTER=0` (ATTENTION.md,
    /// 30th session).
    decode_cl_simt: [Option<Vec<CudaFunction>>; 2],
    /// The f16 cluster-merge kernels that load each warp's keys before the PDL wait
    /// (`attn_decode_tc_clp_128_<gb>`, one row only: ATTENTION.md, "Keys loaded before the
    /// wait"; on by default); `None` with `FERRITE_ATTN_PRE=0` or where `decode_cl[0]` is.
    decode_clp: Option<Vec<CudaFunction>>,
    /// `decode_clp` with QK-norm + RoPE on the values it loads (`attn_decode_tc_clpr_128_<gb>`;
    /// [`qk_norm_rope_attention`], `FERRITE_ATTN_ROPE`); `None` with it 0 or where `decode_clp` is.
    decode_clpr: Option<Vec<CudaFunction>>,
    /// The same form with the ticket merge (`attn_decode_tc_pre_128_<gb>`), for caches of
    /// more splits than a cluster holds whose chunks are still one tile (up to 4,096
    /// positions at 64 splits; on by default); `None` with `FERRITE_ATTN_PRE` 0 or 1.
    decode_pre: Option<Vec<CudaFunction>>,
    /// Whether `decode_tc[1]` is the q8_0 loop that loads its next tile early
    /// (`attn_decode_tc_q8p_128_<gb>`; `FERRITE_ATTN_PIPE=0`: the plain loop).
    q8_pipe: bool,
    /// The tensor-core decode loops that leave their splits to a merge launch of its own
    /// (`attn_decode_tc_sep_128_<gb>`, `attn_decode_tc_q8psep_128_<gb>`), `[f16, q8_0]`, and
    /// that merge (`attn_decode_merge`; ATTENTION.md, "The split merge as a launch of its
    /// own"). Taken where the ticket merge would be: contiguous caches at
    /// [`DECODE_TC_HEAD_DIM`] whose splits take no cluster (the keys-before-the-wait form:
    /// `decode_presep`) and the tail merge (`decode_tail`) does not fit; `None` with
    /// `FERRITE_ATTN_MERGE=0` (the ticket merge), and with
    /// `FERRITE_ATTN_PIPE=0` (the q8_0 form is the pipelined loop, whose split count it shares).
    decode_sep: Option<([Vec<CudaFunction>; 2], CudaFunction)>,
    /// The keys-before-the-wait form with the merge launch (`attn_decode_tc_presep_128_<gb>`),
    /// where `decode_pre` would run; `None` with `FERRITE_ATTN_MERGE` 0 or 2 (the ticket merge
    /// for that form only) or where `decode_pre` is.
    decode_presep: Option<Vec<CudaFunction>>,
    /// The same loops merging their splits in their own last blocks (`decode_tail_merge`:
    /// `attn_decode_tc_tail_128_<gb>`, `attn_decode_tc_q8ptail_128_<gb>` `[f16, q8_0]`, and
    /// `attn_decode_tc_pretail_128_<gb>` where `decode_presep` is), with the fewest blocks
    /// per SM any of them keeps resident; taken instead of `decode_sep` where the merge's
    /// spinning blocks leave a slot free ([`tail_fits`]) and the splits fit its registers
    /// ([`TAIL_MAX_SPLITS`]). `FERRITE_ATTN_MERGE=3`, the default (ATTENTION.md, "The split
    /// merge by the decode launch's own last blocks").
    decode_tail: Option<DecodeTail>,
    /// Decode tuning, fixed at load (tuning runs may override it from the environment).
    tuning: DecodeTuning,
    /// `prefill[q8][hd index]`.
    prefill: [Vec<CudaFunction>; 2],
    /// Tensor-core prefill, `[f16, q8_0]`, per [`TC_HEAD_DIMS`] entry; `None` where
    /// `FERRITE_ATTN_TC` keeps that cache type on the SIMT kernel (0: both, 2: q8_0).
    prefill_tc: [Option<Vec<TcPrefill>>; 2],
    /// `attn_prefill_tc2_<hd>_x{bf16,f16}` per [`TC_HEAD_DIMS`] entry where the f16 prefill
    /// takes `attn_prefill_tc2_<hd>` and [`attn_x16`] is on: the same kernel writing the
    /// o-projection's 16-bit x too, `[bf16, f16]`.
    prefill_tc2_x16: Vec<Option<[CudaFunction; 2]>>,
    generic: CudaFunction,
    /// The paged-cache variants (same indexing).
    paged: PagedKernels,
}

/// The `*_paged` entry points of `attention.cu`.
struct PagedKernels {
    kv_store: [CudaFunction; 2],
    decode: [Vec<Vec<CudaFunction>>; 2],
    prefill: [Vec<CudaFunction>; 2],
    prefill_tc: [Option<Vec<TcPrefill>>; 2],
    /// `attn_decode_tc[_q8]_128_<gb>_paged` (as `decode_tc`).
    decode_tc: [Option<Vec<CudaFunction>>; 2],
    generic: CudaFunction,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self> {
        let m = load_module(ctx, arch, "attention", SRC)?;
        let decode = |pre: &str, post: &str| {
            FAST_HEAD_DIMS
                .iter()
                .map(|hd| {
                    [1, 2, 4, 8]
                        .iter()
                        .map(|gb| function(&m, &format!("attn_decode_{pre}{hd}_{gb}{post}")))
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()
        };
        let prefill = |pre: &str, post: &str| {
            FAST_HEAD_DIMS
                .iter()
                .map(|hd| function(&m, &format!("attn_prefill_{pre}{hd}{post}")))
                .collect::<Result<Vec<_>>>()
        };
        let ptc = super::switches::int_or("FERRITE_ATTN_TC", 1);
        // A tensor-core prefill kernel with the dynamic shared memory its head size takes.
        let tc_function = |name: &str, hd: usize, q8: usize| -> Result<CudaFunction> {
            let smem = tc_smem(hd, q8);
            let f = function(&m, name)?;
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .with_context(|| format!("{name}: {smem} B of shared memory"))?;
            Ok(f)
        };
        // `attn_prefill_tc_[q8_]<hd><post>` for every TC head size, where `on` (`tc2`:
        // `attn_prefill_tc2_<hd>` where there is one, [`TC2_MAX_HEAD_DIM`]).
        let prefill_tc_family =
            |on: bool, tc2: bool, q8: usize, post: &str| -> Result<Option<Vec<TcPrefill>>> {
                if !on {
                    return Ok(None);
                }
                let pre = if q8 == 1 { "q8_" } else { "" };
                TC_HEAD_DIMS
                    .iter()
                    .map(|&hd| {
                        let two = tc2 && hd <= TC2_MAX_HEAD_DIM;
                        let base = if two { "tc2" } else { "tc" };
                        let f =
                            tc_function(&format!("attn_prefill_{base}_{pre}{hd}{post}"), hd, q8)?;
                        Ok((f, if two { 2 * TC_THREADS } else { TC_THREADS }))
                    })
                    .collect::<Result<Vec<_>>>()
                    .map(Some)
            };
        // The contiguous f16 cache's kernels with two key groups (`attn_prefill_tc2_<hd>`,
        // 256 threads) where FERRITE_ATTN_TC2 is on.
        let tc2 = tc2();
        let prefill_tc = |post: &str| -> Result<[Option<Vec<TcPrefill>>; 2]> {
            Ok([
                prefill_tc_family(ptc != 0, tc2 && post.is_empty(), 0, post)?,
                prefill_tc_family(ptc == 1, false, 1, post)?,
            ])
        };
        let dtc = super::switches::int_or("FERRITE_ATTN_DTC", 1);
        // `attn_decode_<pre><hd>_<gb><post>` for every heads-per-block, where `on`.
        let family =
            |on: bool, pre: &str, hd: usize, post: &str| -> Result<Option<Vec<CudaFunction>>> {
                if !on {
                    return Ok(None);
                }
                [1, 2, 4, 8]
                    .iter()
                    .map(|gb| function(&m, &format!("attn_decode_{pre}{hd}_{gb}{post}")))
                    .collect::<Result<Vec<_>>>()
                    .map(Some)
            };
        let tc_family_post =
            |on: bool, pre: &str, post: &str| family(on, pre, DECODE_TC_HEAD_DIM, post);
        let tc_family = |on: bool, pre: &str| tc_family_post(on, pre, "");
        // q8_0 contiguous caches whose splits do not take the cluster merge: the loop that
        // issues its next tile's loads before this tile's MMAs.
        let q8_pipe = dtc == 1 && super::switches::int_or("FERRITE_ATTN_PIPE", 1) != 0;
        let q8_pre = if q8_pipe { "tc_q8p_" } else { "tc_q8_" };
        let decode_tc = [tc_family(dtc != 0, "tc_")?, tc_family(dtc == 1, q8_pre)?];
        let decode_tc_paged = [
            tc_family_post(dtc != 0, "tc_", "_paged")?,
            tc_family_post(dtc == 1, "tc_q8_", "_paged")?,
        ];
        // Clusters of up to 16 blocks: the non-portable size, allowed per kernel.
        let clusters =
            arch == "compute_90a" && super::switches::int_or("FERRITE_ATTN_CLUSTER", 1) != 0;
        let cl_family_hd = |on: bool, pre: &str, hd: usize| -> Result<Option<Vec<CudaFunction>>> {
            let Some(fs) = family(on && clusters, pre, hd, "")? else {
                return Ok(None);
            };
            for f in &fs {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )
                .context("decode attention: clusters of 16 blocks")?;
            }
            Ok(Some(fs))
        };
        let cl_family = |on: bool, pre: &str| cl_family_hd(on, pre, DECODE_TC_HEAD_DIM);
        let decode_cl = [
            cl_family(dtc != 0, "tc_cl_")?,
            cl_family(dtc == 1, "tc_q8_cl_")?,
        ];
        // The SIMT loop's cluster-merge kernels at its one head size that has them.
        let decode_cl_simt = [
            cl_family_hd(true, "cl_", DECODE_CL_SIMT_HEAD_DIM)?,
            cl_family_hd(true, "q8_cl_", DECODE_CL_SIMT_HEAD_DIM)?,
        ];
        let pre = super::switches::int_or("FERRITE_ATTN_PRE", 2);
        let decode_clp = cl_family(dtc != 0 && pre != 0, "tc_clp_")?;
        let decode_clpr = cl_family(
            dtc != 0 && pre != 0 && super::switches::int_or("FERRITE_ATTN_ROPE", 1) != 0,
            "tc_clpr_",
        )?;
        let decode_pre = tc_family(dtc != 0 && pre == 2, "tc_pre_")?;
        let merge = super::switches::int_or("FERRITE_ATTN_MERGE", 3);
        let sep_on = dtc == 1 && q8_pipe && merge != 0;
        let decode_sep = match (
            tc_family(sep_on, "tc_sep_")?,
            tc_family(sep_on, "tc_q8psep_")?,
        ) {
            (Some(f16), Some(q8)) => Some(([f16, q8], function(&m, "attn_decode_merge")?)),
            _ => None,
        };
        let decode_presep = tc_family(
            decode_sep.is_some() && decode_pre.is_some() && (merge == 1 || merge == 3),
            "tc_presep_",
        )?;
        let decode_tail = match (
            tc_family(sep_on && merge == 3, "tc_tail_")?,
            tc_family(sep_on && merge == 3, "tc_q8ptail_")?,
        ) {
            (Some(f16), Some(q8)) => {
                let pre = tc_family(decode_presep.is_some(), "tc_pretail_")?;
                let mut blocks_per_sm = usize::MAX;
                for f in f16.iter().chain(&q8).chain(pre.iter().flatten()) {
                    let b = f
                        .occupancy_max_active_blocks_per_multiprocessor(128, 0, None)
                        .context("decode attention: the tail merge's occupancy")?;
                    blocks_per_sm = blocks_per_sm.min(b as usize);
                }
                Some(DecodeTail {
                    loops: [f16, q8],
                    pre,
                    blocks_per_sm,
                })
            }
            _ => None,
        };
        Ok(Kernels {
            kv_type: AtomicU8::new(0),
            kv_store: [function(&m, "kv_store")?, function(&m, "kv_store_q8")?],
            decode: [decode("", "")?, decode("q8_", "")?],
            decode_tc,
            decode_cl,
            decode_cl_simt,
            decode_clp,
            decode_clpr,
            decode_pre,
            q8_pipe,
            decode_sep,
            decode_presep,
            decode_tail,
            tuning: DecodeTuning::from_env(),
            prefill: [prefill("", "")?, prefill("q8_", "")?],
            prefill_tc: prefill_tc("")?,
            prefill_tc2_x16: TC_HEAD_DIMS
                .iter()
                .map(|&hd| {
                    if ptc == 0 || !tc2 || hd > TC2_MAX_HEAD_DIM || !attn_x16() {
                        return Ok(None);
                    }
                    let f =
                        |form: &str| tc_function(&format!("attn_prefill_tc2_{hd}_x{form}"), hd, 0);
                    Ok(Some([f("bf16")?, f("f16")?]))
                })
                .collect::<Result<Vec<_>>>()?,
            generic: function(&m, "attn_generic")?,
            paged: PagedKernels {
                kv_store: [
                    function(&m, "kv_store_paged")?,
                    function(&m, "kv_store_q8_paged")?,
                ],
                decode: [decode("", "_paged")?, decode("q8_", "_paged")?],
                prefill: [prefill("", "_paged")?, prefill("q8_", "_paged")?],
                prefill_tc: prefill_tc("_paged")?,
                decode_tc: decode_tc_paged,
                generic: function(&m, "attn_generic_paged")?,
            },
        })
    }

    /// Chooses the storage type of the caches that [`kv_new`] makes from now on.
    pub fn set_kv_type(&self, t: KvType) {
        self.kv_type.store(t as u8, Ordering::Relaxed);
    }

    /// The storage type [`kv_new`] uses.
    pub fn kv_type(&self) -> KvType {
        match self.kv_type.load(Ordering::Relaxed) {
            1 => KvType::Q8_0,
            _ => KvType::F16,
        }
    }
}

/// The decode launch's tuning knobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DecodeTuning {
    /// Decode blocks wanted per SM at rows = 1.
    blocks_per_sm: usize,
    /// The same for the q8_0 loop with its next tile in flight.
    pipe_blocks_per_sm: usize,
    /// Most splits per (row, head).
    max_splits: usize,
    /// Fewest positions per split (0: by head dim, [`min_chunk_for`]).
    min_chunk: usize,
    /// L2 prefetch distance in key tiles (0 = off).
    prefetch: usize,
}

impl Default for DecodeTuning {
    fn default() -> Self {
        DecodeTuning {
            blocks_per_sm: DECODE_BLOCKS_PER_SM,
            pipe_blocks_per_sm: DECODE_PIPE_BLOCKS_PER_SM,
            max_splits: MAX_SPLITS,
            min_chunk: 0,
            prefetch: DECODE_PREFETCH,
        }
    }
}

impl DecodeTuning {
    /// The defaults, overridden by `FERRITE_ATTN_TUNE=blocks_per_sm,max_splits,min_chunk,
    /// prefetch` (tuning runs; values out of range are clamped).
    fn from_env() -> Self {
        let mut t = DecodeTuning::default();
        if let Ok(Some(f)) = super::switches::get("FERRITE_ATTN_TUNE") {
            let f: Vec<usize> = f.into_iter().map(|x| x as usize).collect();
            if let [b, s, c, p] = f[..] {
                t = DecodeTuning {
                    blocks_per_sm: b.max(1),
                    pipe_blocks_per_sm: b.max(1),
                    max_splits: s.clamp(1, KERNEL_MAX_SPLITS),
                    min_chunk: c.clamp(1, 4096),
                    prefetch: p.min(64),
                };
            }
        }
        t
    }
}

/// Index of `head_dim` among the tuned sizes.
fn fast_index(head_dim: usize) -> Option<usize> {
    FAST_HEAD_DIMS.iter().position(|&d| d == head_dim)
}

/// The head dim whose SIMT decode loop has a cluster-merge form (`attn_decode[_q8]_cl_256_<gb>`).
const DECODE_CL_SIMT_HEAD_DIM: usize = 256;

/// Most splits a decode launch merges through a thread-block cluster (the cluster is the
/// splits of one head block and row; 16 is Hopper's largest, non-portable, cluster).
const CLUSTER_MAX_SPLITS: usize = 16;

/// The head size of the tensor-core decode kernels (`attn_decode_tc[_q8]_<hd>_<gb>[_paged]`;
/// the other sizes take the SIMT loop).
pub const DECODE_TC_HEAD_DIM: usize = 128;
/// Keys per iteration of a tensor-core decode block (4 warps × 16 keys: `STEP` in
/// attention.cu). The form that loads its keys before the PDL wait holds one such tile per
/// warp, so it takes caches whose chunks never exceed it ([`pre_loads_fit`]).
const DECODE_TC_STEP: usize = 64;

/// Whether every chunk of a contiguous cache of `capacity` positions in `n_splits` splits
/// with `min_chunk` is at most one block iteration ([`DECODE_TC_STEP`]) at any position:
/// attention.cu's chunk is max(min_chunk, ⌈⌈keys / splits⌉ / STEP⌉ · STEP).
fn pre_loads_fit(capacity: usize, n_splits: usize, min_chunk: usize) -> bool {
    min_chunk <= DECODE_TC_STEP && capacity <= DECODE_TC_STEP * n_splits
}

/// Most query heads per decode block (see [`heads_per_block`]).
const DECODE_MAX_GB: usize = 4;

/// Query heads per decode block: the largest of 4, 2, 1 that divides the GQA group, so a
/// block's heads share one kv head and each K/V row is read once for all of them. 8 heads per
/// block (the kernels exist) made Qwen3-30B-A3B's decode 8% slower than 4 (ATTENTION.md, GQA
/// group 8); `FERRITE_ATTN_GB` (8, 4, 2, 1) overrides the cap (a tuning switch).
fn heads_per_block(group: usize) -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let max = *MAX
        .get_or_init(|| super::switches::int_or("FERRITE_ATTN_GB", DECODE_MAX_GB as i64) as usize);
    [8, 4, 2, 1]
        .into_iter()
        .find(|gb| *gb <= max && group.is_multiple_of(*gb))
        .unwrap_or(1)
}

/// Query slots of one prefill block for `head_dim` (threads / threads-per-query).
fn prefill_slots(head_dim: usize) -> usize {
    PREFILL_THREADS / if head_dim >= 256 { 8 } else { 4 }
}

/// The decode split's fewest positions for `head_dim`: the tuning override, else
/// [`DECODE_MIN_CHUNK_TC`] at the tensor-core head dim and [`DECODE_MIN_CHUNK`] elsewhere.
fn min_chunk_for(head_dim: usize, tu: DecodeTuning) -> usize {
    match tu.min_chunk {
        0 if head_dim == DECODE_TC_HEAD_DIM => DECODE_MIN_CHUNK_TC,
        0 => DECODE_MIN_CHUNK,
        c => c,
    }
}

/// The fixed decode split count for a cache: enough blocks for every SM at rows = 1, no more
/// splits than `capacity` has minimum-size chunks. `pipe`: the cache takes the q8_0 loop with
/// its next tile in flight, whose blocks fit fewer per SM: as many splits as fill the SMs
/// once, rounded down (a 397th block of 396 slots would run as a second wave).
fn decode_splits(
    sm_count: usize,
    shape: AttnShape,
    capacity: usize,
    tu: DecodeTuning,
    pipe: bool,
) -> usize {
    let group = shape.n_heads / shape.n_kv_heads.max(1);
    let blocks_x = (shape.n_heads / heads_per_block(group)).max(1);
    let want = if pipe {
        tu.pipe_blocks_per_sm * sm_count.max(1) / blocks_x
    } else {
        (tu.blocks_per_sm * sm_count.max(1)).div_ceil(blocks_x)
    };
    want.clamp(1, tu.max_splits.min(KERNEL_MAX_SPLITS))
        .min(capacity.div_ceil(min_chunk_for(shape.head_dim, tu)).max(1))
}

/// A cache of the type chosen with [`Kernels::set_kv_type`] (f16 by default).
pub fn kv_new(
    be: &CudaBackend,
    n_layers: usize,
    shape: AttnShape,
    capacity: usize,
) -> Result<CudaKv> {
    kv_new_typed(be, n_layers, shape, capacity, be.attention.kv_type())
}

/// A cache of `kv_type` for `n_layers` layers of `shape`, `capacity` positions each, with the
/// split-K decode scratch.
pub fn kv_new_typed(
    be: &CudaBackend,
    n_layers: usize,
    shape: AttnShape,
    capacity: usize,
    kv_type: KvType,
) -> Result<CudaKv> {
    kv_alloc(be, n_layers, shape, capacity, kv_type, None)
}

/// A paged cache of the type chosen with [`Kernels::set_kv_type`]: `p.n_pages` pages of
/// `p.page_size` positions per layer, split-K scratch for `p.max_rows` decode rows. The
/// split count is chosen as for a contiguous cache of one sequence's largest context
/// (`max_pages · page_size`) and fixed, so a row's arithmetic depends only on its own
/// position, never on the batch it shares a step with.
pub fn kv_new_paged(
    be: &CudaBackend,
    n_layers: usize,
    shape: AttnShape,
    p: PagedKv,
) -> Result<CudaKv> {
    ensure!(
        p.page_size.is_power_of_two() && p.n_pages > 0 && p.max_pages > 0,
        "paged KV cache: {} pages of {} positions (a power of two), {} per sequence",
        p.n_pages,
        p.page_size,
        p.max_pages
    );
    ensure!(
        p.max_pages
            .checked_mul(p.page_size)
            .is_some_and(|n| n <= i32::MAX as usize),
        "paged KV cache: {} pages of {} positions per sequence is out of range",
        p.max_pages,
        p.page_size
    );
    let capacity = p
        .n_pages
        .checked_mul(p.page_size)
        .context("KV cache size overflows")?;
    kv_alloc(
        be,
        n_layers,
        shape,
        capacity,
        if p.q8_0 {
            KvType::Q8_0
        } else {
            be.attention.kv_type()
        },
        Some(p),
    )
}

fn kv_alloc(
    be: &CudaBackend,
    n_layers: usize,
    shape: AttnShape,
    capacity: usize,
    kv_type: KvType,
    paged: Option<PagedKv>,
) -> Result<CudaKv> {
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    ensure!(
        n_kv_heads > 0 && n_heads % n_kv_heads == 0,
        "KV cache: {n_heads} heads over {n_kv_heads} kv heads"
    );
    ensure!(
        head_dim > 0 && head_dim <= GENERIC_MAX_HEAD_DIM,
        "KV cache: head_dim {head_dim} is not supported by the CUDA attention (at most {GENERIC_MAX_HEAD_DIM})"
    );
    ensure!(
        capacity > 0 && capacity <= i32::MAX as usize,
        "KV cache: capacity {capacity} positions is out of range"
    );
    let per_tensor = n_layers
        .checked_mul(n_kv_heads)
        .and_then(|x| x.checked_mul(capacity))
        .and_then(|x| x.checked_mul(head_dim))
        .context("KV cache size overflows")?
        .max(1);
    ensure!(
        kv_type == KvType::F16 || head_dim % 32 == 0,
        "KV cache: a q8_0 cache needs head_dim divisible by 32, got {head_dim}"
    );
    let (data_bytes, n_scales) = match kv_type {
        KvType::F16 => (per_tensor * 2, 1),
        KvType::Q8_0 => (per_tensor, (per_tensor / 32).max(1)),
    };
    let seq_capacity = paged.map_or(capacity, |p| p.max_pages * p.page_size);
    let tuning = be.attention.tuning;
    // The pipelined q8_0 loop takes contiguous caches at its head size (paged ones, and
    // caches of other head sizes, the 4-block kernels).
    let pipe = be.attention.q8_pipe
        && kv_type == KvType::Q8_0
        && paged.is_none()
        && head_dim == DECODE_TC_HEAD_DIM;
    let n_splits = decode_splits(be.sm_count, shape, seq_capacity, tuning, pipe);
    let scratch_rows = paged.map_or(DECODE_MAX_ROWS, |p| p.max_rows.max(DECODE_MAX_ROWS));
    let part_rows = scratch_rows * n_heads * n_splits;
    let scratch = part_rows * (head_dim + 2) + scratch_rows * n_heads;
    let bytes = 2 * (data_bytes + n_scales * 2) + scratch * 4;
    let (free, total) = be.mem_info()?;
    // Leave room for the context's own bookkeeping and small allocations.
    const HEADROOM: usize = 64 << 20;
    ensure!(
        bytes + HEADROOM <= free,
        "KV cache for {capacity} positions × {n_layers} layers needs {:.2} GiB ({kv_type:?}) but \
         only {:.2} of {:.2} GiB of device memory are free: lower the context length",
        bytes as f64 / (1u64 << 30) as f64,
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64
    );
    Ok(CudaKv {
        kv_type,
        k: be.stream.alloc_zeros::<u8>(data_bytes)?,
        v: be.stream.alloc_zeros::<u8>(data_bytes)?,
        k_scales: be.stream.alloc_zeros::<u16>(n_scales)?,
        v_scales: be.stream.alloc_zeros::<u16>(n_scales)?,
        n_layers,
        shape,
        capacity,
        n_splits,
        min_chunk: min_chunk_for(head_dim, tuning),
        part_acc: be.stream.alloc_zeros::<f32>(part_rows * head_dim)?,
        part_ml: be.stream.alloc_zeros::<f32>(part_rows * 2)?,
        tickets: be.stream.alloc_zeros::<i32>(scratch_rows * n_heads)?,
        scratch_rows,
        paged: paged.map(|p| (p.n_pages, p.page_size)),
        delta: None,
        slots: crate::SnapshotSlots::default(),
    })
}

/// The checks both attention paths make of the cache against the call: the layer exists,
/// and the cache was made for these key/value heads and head size, with room for the
/// query heads' scratch.
fn check_cache(kv: &CudaKv, layer: usize, shape: AttnShape) -> Result<()> {
    ensure!(
        layer < kv.n_layers,
        "attention: layer {layer} outside the cache"
    );
    ensure!(
        kv.shape.n_kv_heads == shape.n_kv_heads
            && kv.shape.head_dim == shape.head_dim
            && shape.n_heads <= kv.shape.n_heads,
        "attention: cache shape differs"
    );
    Ok(())
}

/// Launch of the KV store over `n` new key (and value) elements (`kv_store*`: f16, a thread
/// per element; q8_0, a warp per 32-element block), contiguous and paged alike.
fn store_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Kernel argument of the ROPE decode form (`AttnRope` in attention.cu): the q and k norm
/// weights (128 floats each) and the rotation's θ, the norms' eps.
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnRope {
    qw: u64,
    kw: u64,
    theta: f32,
    eps: f32,
}

// SAFETY: plain old data laid out as the C struct (two pointers, two floats).
unsafe impl super::launch::ScalarArg for AttnRope {}

pub fn attention(
    be: &CudaBackend,
    kv: &mut CudaKv,
    step: &StepInput<CudaSlice<i32>>,
    a: AttnArgs<'_, CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    attention_impl(be, kv, step, a, out, None, None, false).map(|_| ())
}

/// [`attention`] whose output is read next only as the x of matmuls that take it from the
/// 16-bit scratch in the form `readers` (mmw.rs `x16_readers`: the o-projection): where the
/// prefill kernel hands the output over in that form, its f32 rows are not written (ops.rs
/// `x16_only`, `FERRITE_NORM_X16_ONLY`; MATMUL.md round 102).
pub(crate) fn attention_for(
    be: &CudaBackend,
    kv: &mut CudaKv,
    step: &StepInput<CudaSlice<i32>>,
    a: AttnArgs<'_, CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
    readers: Option<super::matmul::X16>,
) -> Result<()> {
    attention_impl(be, kv, step, a, out, None, readers, false).map(|_| ())
}

/// [`Backend::qk_norm_rope`] then [`attention`] as one launch: the keys-before-the-wait
/// cluster form (`attn_decode_tc_clpr_128_<gb>`) normalising and rotating q and the step's key
/// on the values it loads (attention.cu `ROPE`); q and k are left as they are. `false`
/// (nothing done) unless the step is one decode row of a contiguous f16 cache that takes that
/// form and the rotation is Qwen3's: both norms, NeoX over all 128 dims.
pub fn qk_norm_rope_attention(
    be: &CudaBackend,
    kv: &mut CudaKv,
    a: AttnArgs<'_, CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
    qk: &crate::QkRope<'_, CudaWeight, CudaSlice<i32>>,
) -> Result<bool> {
    let (Some(qn), Some(kn)) = (qk.q_norm, qk.k_norm) else {
        return Ok(false);
    };
    // A RoPE scaling's table (rope_tab) has no place in the launch's argument: the composition.
    if be.attention.decode_clpr.is_none()
        || qk.rope.inv_freq.is_some()
        || qk.rope.style != crate::RopeStyle::Neox
        || qk.head_dim != DECODE_TC_HEAD_DIM
        || qk.rope.rot_dim != DECODE_TC_HEAD_DIM
        || a.shape.head_dim != qk.head_dim
        || a.q.rows != 1
    {
        return Ok(false);
    }
    let len = |w: &CudaWeight| w.shape.iter().product::<usize>();
    crate::check_qk_norm_rope(
        a.q,
        a.k,
        [Some(len(qn)), Some(len(kn))],
        qk.head_dim,
        qk.step,
        qk.rope,
    )?;
    let qw = super::ops::f32_vec(qn, qk.head_dim)?;
    let kw = super::ops::f32_vec(kn, qk.head_dim)?;
    let (qwp, _gq) = qw.device_ptr(&be.stream);
    let (kwp, _gk) = kw.device_ptr(&be.stream);
    let rope = AttnRope {
        qw: qwp,
        kw: kwp,
        theta: qk.rope.theta,
        eps: qk.eps,
    };
    // SAFETY (of the kernel's reads through `rope`): both norm weights hold 128 floats
    // (f32_vec), alive until the launch is enqueued (the guards above).
    attention_impl(be, kv, qk.step, a, out, Some(rope), None, false)
}

/// `FERRITE_KV_FUSE` (read once; default 1): a prefill's keys and values go to an f16 cache from
/// the qk_norm_rope launch itself ([`qk_norm_rope_attention_stored`]; MATMUL.md round 104).
fn kv_fuse() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_KV_FUSE", 1) != 0)
}

/// [`Backend::qk_norm_rope`] then [`attention`] at prefill rows, the step's keys and values
/// stored into the cache by the qk_norm_rope launch (ops.rs `qk_norm_rope_kv`: kv_store's bits)
/// instead of a store launch of the attention's: k's rotated rows are not written back to `k`
/// (nothing reads them after), k and v are not read a second time. `readers` as in
/// [`attention_for`]. `Ok(false)`, nothing done, unless the step has more than DECODE_MAX_ROWS
/// rows of one sequence on a contiguous f16 cache with room for them and the rotation is one
/// qk_norm_rope's register form takes (NeoX, whole 32-pair groups: Qwen3's, Qwen3.5's).
pub(crate) fn qk_norm_rope_attention_stored(
    be: &CudaBackend,
    kv: &mut CudaKv,
    (q, k, v): crate::QkvMut<'_, CudaSlice<f32>>,
    (layer, shape): (usize, AttnShape),
    out: &mut Act<CudaSlice<f32>>,
    qk: &crate::QkRope<'_, CudaWeight, CudaSlice<i32>>,
    readers: Option<super::matmul::X16>,
) -> Result<bool> {
    let step = qk.step;
    let rows = q.rows;
    if !kv_fuse()
        || kv.paged.is_some()
        || kv.kv_type != KvType::F16
        || rows <= DECODE_MAX_ROWS
        || step.pos0 + rows > kv.capacity
        || step.positions.len() < rows
    {
        return Ok(false);
    }
    crate::check_single_sequence_step(step)?;
    check_cache(kv, layer, shape)?;
    let len = |w: &CudaWeight| w.shape.iter().product::<usize>();
    crate::check_qk_norm_rope(
        q,
        k,
        [qk.q_norm.map(len), qk.k_norm.map(len)],
        qk.head_dim,
        step,
        qk.rope,
    )?;
    let kvd = shape.n_kv_heads * shape.head_dim;
    ensure!(
        qk.head_dim == shape.head_dim
            && k.cols == kvd
            && k.rows == rows
            && v.rows == rows
            && v.cols == kvd
            && v.buf.len() >= rows * kvd,
        "attention: k [{}, {}] and v [{}, {}] do not match {rows} rows of {kvd}",
        k.rows,
        k.cols,
        v.rows,
        v.cols
    );
    let (vp, gv) = v.buf.device_ptr(&be.stream);
    let (kcp, gk) = kv.k.device_ptr(&be.stream);
    let (vcp, gvc) = kv.v.device_ptr(&be.stream);
    let kd = super::ops::KvDst {
        v: vp,
        kc: kcp,
        vc: vcp,
        layer_off: (layer * kvd * kv.capacity) as i64,
        capacity: i32::try_from(kv.capacity).context("attention: cache capacity")?,
    };
    // SAFETY (of the kernel's accesses through `kd`): v holds rows × kvd floats (checked); the
    // cache planes hold every layer's n_kv_heads × capacity × head_dim halves (check_cache) and
    // the kernel writes layer `layer`'s at positions below capacity only; all three buffers
    // outlive the enqueued launch (borrowed for this call).
    if !super::ops::qk_norm_rope_kv(
        be,
        q,
        k,
        (qk.q_norm, qk.k_norm),
        qk.head_dim,
        qk.eps,
        step,
        qk.rope,
        kd,
    )? {
        return Ok(false);
    }
    drop((gv, gk, gvc));
    let a = AttnArgs {
        layer,
        q: &*q,
        k: &*k,
        v,
        shape,
    };
    attention_impl(be, kv, step, a, out, None, readers, true)
}

/// [`attention`]; with `rope`, only by the ROPE decode form, else `false` and nothing done;
/// `readers` as in [`attention_for`]; `stored`: the step's keys and values are in the cache
/// already ([`qk_norm_rope_attention_stored`]; prefill rows only), so no store launch runs.
#[allow(clippy::too_many_arguments)]
fn attention_impl(
    be: &CudaBackend,
    kv: &mut CudaKv,
    step: &StepInput<CudaSlice<i32>>,
    a: AttnArgs<'_, CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
    rope: Option<AttnRope>,
    readers: Option<super::matmul::X16>,
    stored: bool,
) -> Result<bool> {
    crate::check_attention(step, &a, out)?;
    if kv.paged.is_some() {
        if rope.is_some() {
            return Ok(false);
        }
        return attention_paged(be, kv, step, a, out).map(|_| true);
    }
    crate::check_single_sequence_step(step)?;
    let AttnArgs {
        layer,
        q,
        k,
        v,
        shape,
    } = a;
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let rows = q.rows;
    let kvd = n_kv_heads * head_dim;
    check_cache(kv, layer, shape)?;
    ensure!(
        step.pos0 + rows <= kv.capacity,
        "context full: position {} but the cache holds {} positions",
        step.pos0 + rows.max(1) - 1,
        kv.capacity
    );
    ensure!(
        step.positions.len() >= rows,
        "attention: {rows} rows but {} positions",
        step.positions.len()
    );
    if rows == 0 {
        return Ok(true);
    }

    let group = n_heads / n_kv_heads;
    let capacity = kv.capacity as i32;
    let layer_off = (layer * n_kv_heads * kv.capacity * head_dim) as i64;
    let (rows_i, n_heads_i, group_i, kv_i, hd_i) = (
        rows as i32,
        n_heads as i32,
        group as i32,
        n_kv_heads as i32,
        head_dim as i32,
    );
    let scale_log2 = std::f32::consts::LOG2_E / (head_dim as f32).sqrt();
    let q8 = usize::from(kv.kv_type == KvType::Q8_0);

    let fast = fast_index(head_dim);
    if rope.is_some() && (fast.is_none() || rows != 1) {
        return Ok(false);
    }

    // 1. Decode (few rows): one launch stores the rows, attends and merges the splits.
    if let (Some(fi), true) = (fast, rows <= DECODE_MAX_ROWS) {
        let gbi = heads_per_block(group).trailing_zeros() as usize;
        // The tensor-core loop at its head size; its cluster-merge form where the cache's
        // splits fit one cluster.
        let tc_dim = head_dim == DECODE_TC_HEAD_DIM;
        let cl_fams = if tc_dim {
            be.attention.decode_cl[q8].as_ref()
        } else if head_dim == DECODE_CL_SIMT_HEAD_DIM {
            be.attention.decode_cl_simt[q8].as_ref()
        } else {
            None
        };
        let cl = cl_fams.filter(|_| (2..=CLUSTER_MAX_SPLITS).contains(&kv.n_splits));
        // One f16 row whose chunks are one tile: the forms whose warps load their keys before
        // the PDL wait, with the cluster merge or past a cluster's splits (the ticket merge).
        let pre_ok =
            tc_dim && q8 == 0 && rows == 1 && pre_loads_fit(kv.capacity, kv.n_splits, kv.min_chunk);
        let clp = be
            .attention
            .decode_clp
            .as_ref()
            .filter(|_| pre_ok && cl.is_some());
        let pre = be
            .attention
            .decode_pre
            .as_ref()
            .filter(|_| pre_ok && cl.is_none());
        let presep = be
            .attention
            .decode_presep
            .as_ref()
            .filter(|_| pre.is_some());
        // The split merge as a launch of its own where the ticket merge would be.
        let sep = be.attention.decode_sep.as_ref().filter(|_| {
            tc_dim && clp.is_none() && cl.is_none() && (pre.is_none() || presep.is_some())
        });
        // The merge by the decode launch's own last blocks where it fits instead (in the
        // keys-before-the-wait form too, where that form has one).
        let tail = be.attention.decode_tail.as_ref().filter(|tl| {
            sep.is_some()
                && kv.n_splits <= TAIL_MAX_SPLITS
                && tail_fits(n_heads, rows, tl.blocks_per_sm, be.sm_count)
                && (pre.is_none() || tl.pre.is_some())
        });
        let sep = sep.filter(|_| tail.is_none());
        // With the rotation: the clp form's twin that rotates (`_clpr_`), or nothing.
        let clp = match (&rope, clp) {
            (None, clp) => clp,
            (Some(_), Some(_)) if be.attention.decode_clpr.is_some() => {
                be.attention.decode_clpr.as_ref()
            }
            (Some(_), _) => return Ok(false),
        };
        let func = match (clp, cl, pre, tail, sep) {
            (Some(clp), ..) => &clp[gbi],
            (None, Some(cl), ..) => &cl[gbi],
            (None, None, Some(pre), tail, _) => tail
                .and_then(|tl| tl.pre.as_ref())
                .or(presep)
                .map_or(&pre[gbi], |f| &f[gbi]),
            (None, None, None, Some(tl), _) => &tl.loops[q8][gbi],
            (None, None, None, None, Some((fams, _))) => &fams[q8][gbi],
            (None, None, None, None, None) => decode_kernel(
                &be.attention.decode_tc,
                &be.attention.decode,
                q8,
                fi,
                gbi,
                head_dim,
            ),
        };
        let cluster = cl.is_some();
        // The output feeds the o-projection next: quantize it for a quantized-x GEMV there.
        let cols = n_heads * head_dim;
        let mut fused = matmul::xq_for_producer(be, rows, cols)?;
        let qp = q.buf.device_ptr(&be.stream).0;
        let kp = k.buf.device_ptr(&be.stream).0;
        let vp = v.buf.device_ptr(&be.stream).0;
        let pp = step.positions.device_ptr(&be.stream).0;
        let op = out.buf.device_ptr_mut(&be.stream).0;
        let xq = fused.as_mut().and_then(|g| g.as_mut());
        let (xqp, xdp) = match xq {
            Some(x) => (
                x.q.device_ptr_mut(&be.stream).0,
                x.d.device_ptr_mut(&be.stream).0,
            ),
            None => (0, 0),
        };
        let ptrs = DecodePtrs {
            q: qp,
            k_new: kp,
            v_new: vp,
            positions: pp,
            out: op,
            xq: xqp,
            xd: xdp,
        };
        let dims = DecodeDims {
            rows,
            n_heads,
            group,
            head_dim,
            capacity,
            layer_off,
            scale_log2,
        };
        // SAFETY: q is [rows, n_heads*hd], k and v [rows, n_kv*hd], out [rows, n_heads*hd]
        // (checked by check_attention); positions hold ≥ rows entries (checked above) and
        // are clamped to capacity in the kernel; the int8 scratch holds ≥ rows rows of
        // ≥ cols elements (xq_for_producer).
        // FERRITE_DIAG_SKIP 8 (timing only): the one-row launches left out, the planes still
        // recorded below, so that the o-projection runs as it would after them.
        let skip = rows == 1 && super::switches::diag_skip() & 8 != 0;
        if !skip {
            unsafe { decode_launch(be, func, kv, ptrs, dims, None, cluster, rope) }?;
        }
        if let (false, Some((_, merge))) = (skip, sep) {
            let cfg = LaunchConfig {
                grid_dim: (n_heads as u32, (head_dim / 32) as u32, rows as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let (splits_i, chunk_i, step_i) = (
                kv.n_splits as i32,
                kv.min_chunk as i32,
                DECODE_TC_STEP as i32,
            );
            let mut launch = be.stream.kernel(merge);
            launch
                .arg(&kv.part_acc)
                .arg(&kv.part_ml)
                .arg(&step.positions)
                .arg(&op)
                .arg(&xqp)
                .arg(&xdp)
                .arg(&n_heads_i)
                .arg(&capacity)
                .arg(&splits_i)
                .arg(&chunk_i)
                .arg(&step_i);
            // SAFETY: the partials are [rows][n_heads][n_splits][head_dim] and (m, l) pairs, as
            // the decode launch above wrote them (decode_launch checked the scratch); out and the
            // planes as for that launch; head_dim is DECODE_TC_HEAD_DIM (tc_dim).
            unsafe { launch.launch(cfg) }?;
        }
        if let Some(xq) = fused.as_mut().and_then(|g| g.as_mut()) {
            xq.record_producer(be, &out.buf, rows, cols);
        }
        return Ok(true);
    }

    // 2. Store this step's keys and values (f16: a thread per element; q8_0: a warp per
    // 32-element block), unless the qk_norm_rope launch did (`stored`).
    ensure!(
        !stored || rows > DECODE_MAX_ROWS,
        "attention: keys stored ahead of a decode step (an internal error)"
    );
    if !stored {
        let n = rows * kvd;
        let store_cfg = store_config(n);
        let mut store = be.stream.kernel(&be.attention.kv_store[q8]);
        store.arg(&k.buf).arg(&v.buf).arg(&step.positions);
        store.arg(&mut kv.k).arg(&mut kv.v);
        if q8 == 1 {
            store.arg(&mut kv.k_scales).arg(&mut kv.v_scales);
        }
        store
            .arg(&layer_off)
            .arg(&rows_i)
            .arg(&kv_i)
            .arg(&hd_i)
            .arg(&capacity);
        // SAFETY: k, v hold rows×kvd floats (checked); the kernel bounds-checks positions
        // against capacity and writes inside layer `layer` of the cache (and its scales).
        unsafe { store.launch(store_cfg) }?;
    }

    // 2b. Prefill: query tiles × kv heads (the tensor-core kernel where it applies).
    let pre = prefill_kernel(
        &be.attention.prefill_tc,
        &be.attention.prefill,
        q8,
        head_dim,
        group,
        rows,
        n_kv_heads,
    );
    if let Some((func, cfg)) = pre {
        // The two-group f16 kernel's `_x16` form where the o-projection's 16-bit x can be
        // written beside the output (a prefill of whole 64-column rows, the scratch large
        // enough: xb_for_producer), recorded as the output's.
        // The pick must be that kernel itself (the f16 family's entry: where a `_x16` pair is
        // loaded, the two-group one), not the SIMT one, whose blocks are 256 threads too.
        let x16_pair = TC_HEAD_DIMS
            .iter()
            .position(|&h| h == head_dim)
            .filter(|&i| {
                let tc = be.attention.prefill_tc[0].as_ref().and_then(|v| v.get(i));
                tc.is_some_and(|(f, _)| std::ptr::eq(f, func))
            })
            .and_then(|i| be.attention.prefill_tc2_x16[i].as_ref());
        // Where the o-projection alone reads the output, from the hand-over, the f32 rows are
        // left unwritten (a null `out`; ops.rs x16_only).
        let only = match x16_pair {
            Some(_) => super::ops::x16_only(be, rows, n_heads * head_dim, readers)?,
            None => None,
        };
        let out_written = only.is_none();
        let mut x16 = match (x16_pair, only) {
            (_, Some(xb)) => Some(xb),
            (Some(_), None) => super::matmul::xb_for_producer(be, rows, n_heads * head_dim)?,
            (None, None) => None,
        };
        let func = match (&x16, x16_pair) {
            (Some(xb), Some(pair)) => &pair[usize::from(xb.kind == super::matmul::X16::F16)],
            _ => func,
        };
        let mut launch = be.stream.kernel(func);
        launch
            .arg(&q.buf)
            .arg(&kv.k)
            .arg(&kv.v)
            .arg(&kv.k_scales)
            .arg(&kv.v_scales)
            .arg(&step.positions);
        if out_written {
            launch.arg(&mut out.buf);
        } else {
            launch.arg(&0u64);
        }
        launch
            .arg(&layer_off)
            .arg(&rows_i)
            .arg(&n_heads_i)
            .arg(&group_i)
            .arg(&capacity)
            .arg(&scale_log2);
        if let Some(xb) = x16.as_mut() {
            launch.arg(xb.buf()?);
        }
        // SAFETY: shapes checked above; each block writes only its own (row, head) outputs
        // (both kernels take the same arguments; the tc one ignores the q8_0 scales); the
        // `_x16` forms also the same elements of the 16-bit scratch, which holds rows × (n_heads
        // · head_dim) (xb_for_producer), and write no f32 output where it is null (only `_x16`
        // forms get a null: `only` is one of their scratch grants).
        unsafe { launch.launch(cfg) }?;
        if let Some(xb) = &x16 {
            xb.record(be, &out.buf, rows, n_heads * head_dim, !out_written);
        }
        return Ok(true);
    }

    // 3. Any other head_dim (or a GQA group wider than a prefill tile): the fallback.
    ensure!(
        head_dim <= GENERIC_MAX_HEAD_DIM,
        "attention: head_dim {head_dim} is not supported (at most {GENERIC_MAX_HEAD_DIM})"
    );
    let cfg = LaunchConfig {
        grid_dim: (n_heads.div_ceil(4) as u32, rows as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let q8_i = q8 as i32;
    // SAFETY: one warp per (row, head), bounds-checked against n_heads and hd.
    unsafe {
        be.stream
            .kernel(&be.attention.generic)
            .arg(&q.buf)
            .arg(&kv.k)
            .arg(&kv.v)
            .arg(&kv.k_scales)
            .arg(&kv.v_scales)
            .arg(&q8_i)
            .arg(&step.positions)
            .arg(&mut out.buf)
            .arg(&layer_off)
            .arg(&n_heads_i)
            .arg(&group_i)
            .arg(&hd_i)
            .arg(&capacity)
            .arg(&scale_log2)
            .launch(cfg)
    }?;
    Ok(true)
}

/// Device pointers of one decode launch: the rows' queries, new keys and values (0 for the
/// paged kernels, which do not store), positions and output, and the o-projection's int8
/// scratch (0: none).
struct DecodePtrs {
    q: u64,
    k_new: u64,
    v_new: u64,
    positions: u64,
    out: u64,
    xq: u64,
    xd: u64,
}

/// Sizes of one decode launch (`capacity`: positions per kv-head run, the page size when
/// paged).
struct DecodeDims {
    rows: usize,
    n_heads: usize,
    group: usize,
    head_dim: usize,
    capacity: i32,
    layer_off: i64,
    scale_log2: f32,
}

/// The paged kernels' extra arguments (PAGED_ARGS in attention.cu).
struct PagedPtrs {
    row_seq: u64,
    block_tables: u64,
    bt_stride: i32,
    page_shift: i32,
    page_stride: i64,
    max_keys: i32,
}

/// One decode launch (`attn_decode_*`: store (contiguous), split-K attention and merge;
/// attention.cu's header has the plan): grid (n_heads/gb, n_splits, rows) × 128.
///
/// # Safety
/// The pointers must hold `rows` rows of their shapes (q and out `n_heads·hd`, k_new and
/// v_new `n_kv·hd`, xq/xd the int8 scratch of `n_heads·hd` columns) and `positions` (and
/// the paged row_seq) `rows` entries; the block tables must name pages inside the cache.
#[allow(clippy::too_many_arguments)]
unsafe fn decode_launch(
    be: &CudaBackend,
    func: &CudaFunction,
    kv: &mut CudaKv,
    p: DecodePtrs,
    d: DecodeDims,
    paged: Option<PagedPtrs>,
    cluster: bool,
    rope: Option<AttnRope>,
) -> Result<()> {
    let gb = heads_per_block(d.group);
    let n_splits = kv.n_splits;
    ensure!(
        d.rows <= kv.scratch_rows
            && d.rows * d.n_heads * n_splits * d.head_dim <= kv.part_acc.len()
            && d.rows * (d.n_heads / gb) <= kv.tickets.len()
            && n_splits <= KERNEL_MAX_SPLITS,
        "attention: decode scratch too small for {} rows",
        d.rows
    );
    ensure!(
        paged.is_some() || d.rows <= DECODE_MAX_ROWS,
        "attention: a contiguous decode launch takes at most {DECODE_MAX_ROWS} rows"
    );
    let cfg = LaunchConfig {
        grid_dim: ((d.n_heads / gb) as u32, n_splits as u32, d.rows as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n_heads_i, group_i, splits_i) = (d.n_heads as i32, d.group as i32, n_splits as i32);
    let (chunk_i, pf_i) = (kv.min_chunk as i32, be.attention.tuning.prefetch as i32);
    let mut launch = be.stream.kernel(func);
    launch
        .arg(&p.q)
        .arg(&p.k_new)
        .arg(&p.v_new)
        .arg(&mut kv.k)
        .arg(&mut kv.v)
        .arg(&mut kv.k_scales)
        .arg(&mut kv.v_scales)
        .arg(&p.positions)
        .arg(&mut kv.part_acc)
        .arg(&mut kv.part_ml)
        .arg(&mut kv.tickets)
        .arg(&p.out)
        .arg(&p.xq)
        .arg(&p.xd)
        .arg(&d.layer_off)
        .arg(&n_heads_i)
        .arg(&group_i)
        .arg(&d.capacity)
        .arg(&splits_i)
        .arg(&chunk_i)
        .arg(&pf_i)
        .arg(&d.scale_log2);
    if let Some(r) = &rope {
        ensure!(
            paged.is_none(),
            "attention: the QK-norm + RoPE form is contiguous"
        );
        launch.arg(r);
    }
    if let Some(pg) = &paged {
        launch
            .arg(&pg.row_seq)
            .arg(&pg.block_tables)
            .arg(&pg.bt_stride)
            .arg(&pg.page_shift)
            .arg(&pg.page_stride)
            .arg(&pg.max_keys);
    }
    if cluster {
        // One cluster per (head block, row): its n_splits blocks merge through their shared
        // memory (attention.cu `CL`).
        ensure!(
            paged.is_none() && (2..=CLUSTER_MAX_SPLITS).contains(&n_splits),
            "attention: a cluster merge takes 2..={CLUSTER_MAX_SPLITS} splits of a contiguous cache"
        );
        launch.cluster((1, n_splits as u32, 1));
    }
    // SAFETY: the caller's contract; the scratch and tickets were checked above.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// One launch of a paged step: rows `row0..row0 + rows`, through split-K decode (`decode`:
/// a run of short segments) or the prefill kernel (one long segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Unit {
    decode: bool,
    row0: usize,
    rows: usize,
}

/// Splits a batched step into launches: consecutive segments of at most
/// [`DECODE_MAX_ROWS`] rows share one split-K launch of at most `scratch_rows` rows; every
/// longer segment (a prefill chunk of one sequence) is a launch of its own.
fn paged_units(segs: &[crate::Segment], scratch_rows: usize) -> Vec<Unit> {
    let mut units = Vec::new();
    let mut i = 0;
    while i < segs.len() {
        let s = segs[i];
        if s.rows > DECODE_MAX_ROWS {
            units.push(Unit {
                decode: false,
                row0: s.row0,
                rows: s.rows,
            });
            i += 1;
            continue;
        }
        let mut n = 0;
        while i < segs.len() && segs[i].rows <= DECODE_MAX_ROWS && n + segs[i].rows <= scratch_rows
        {
            n += segs[i].rows;
            i += 1;
        }
        units.push(Unit {
            decode: true,
            row0: s.row0,
            rows: n,
        });
    }
    units
}

/// Attention of a batched step over a paged cache (the module doc has the plan).
fn attention_paged(
    be: &CudaBackend,
    kv: &mut CudaKv,
    step: &StepInput<CudaSlice<i32>>,
    a: AttnArgs<'_, CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    let (n_pages, page_size) = kv.paged.context("attention: not a paged cache")?;
    let b = crate::check_paged_step(step, n_pages, page_size)?;
    let AttnArgs {
        layer,
        q,
        k,
        v,
        shape,
    } = a;
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let rows = q.rows;
    let (qd, kvd) = (n_heads * head_dim, n_kv_heads * head_dim);
    check_cache(kv, layer, shape)?;
    ensure!(
        step.positions.len() >= rows
            && b.row_seq.len() >= rows
            && b.block_tables.len() >= b.segs.len() * b.max_pages,
        "attention: the step's buffers are smaller than its {rows} rows"
    );
    if rows == 0 {
        return Ok(());
    }
    let group = n_heads / n_kv_heads;
    // Kernel arguments: `capacity` is the page size (positions per kv-head run), elements
    // of one page of one layer, the layer's first element, the position clamp.
    let page_stride = (n_kv_heads * page_size * head_dim) as i64;
    let layer_off = layer as i64 * n_pages as i64 * page_stride;
    let page_shift = page_size.trailing_zeros() as i32;
    let bt_stride = b.max_pages as i32;
    let max_keys = i32::try_from(b.max_pages * page_size)
        .context("attention: block tables too long for i32 positions")?;
    let (rows_i, n_heads_i, group_i, kv_i, hd_i, cap_i) = (
        rows as i32,
        n_heads as i32,
        group as i32,
        n_kv_heads as i32,
        head_dim as i32,
        page_size as i32,
    );
    let scale_log2 = std::f32::consts::LOG2_E / (head_dim as f32).sqrt();
    let q8 = usize::from(kv.kv_type == KvType::Q8_0);
    let kern = &be.attention.paged;

    // 1. Store the step's keys and values through the block tables.
    let n = rows * kvd;
    let store_cfg = store_config(n);
    let mut store = be.stream.kernel(&kern.kv_store[q8]);
    store.arg(&k.buf).arg(&v.buf).arg(&step.positions);
    store.arg(&mut kv.k).arg(&mut kv.v);
    if q8 == 1 {
        store.arg(&mut kv.k_scales).arg(&mut kv.v_scales);
    }
    store
        .arg(&layer_off)
        .arg(&rows_i)
        .arg(&kv_i)
        .arg(&hd_i)
        .arg(&cap_i)
        .arg(&b.row_seq)
        .arg(&b.block_tables)
        .arg(&bt_stride)
        .arg(&page_shift)
        .arg(&page_stride)
        .arg(&max_keys);
    // SAFETY: k, v hold rows×kvd floats (checked); positions are clamped to max_keys, the
    // block tables hold page ids < n_pages (checked by check_paged_step), so every write is
    // inside layer `layer` of the cache.
    unsafe { store.launch(store_cfg) }?;

    // 2. Attention, launch by launch.
    let fast = fast_index(head_dim);
    for u in paged_units(&b.segs, kv.scratch_rows) {
        let (r0, nr) = (u.row0, u.rows);
        let q_v = q.buf.slice(r0 * qd..(r0 + nr) * qd);
        let pos_v = step.positions.slice(r0..r0 + nr);
        let rs_v = b.row_seq.slice(r0..r0 + nr);
        let mut out_v = out.buf.slice_mut(r0 * qd..(r0 + nr) * qd);
        let nr_i = nr as i32;
        // A prefill unit's kernel (none for decode units, which the first arm takes).
        let pre = (!u.decode)
            .then(|| {
                prefill_kernel(
                    &kern.prefill_tc,
                    &kern.prefill,
                    q8,
                    head_dim,
                    group,
                    nr,
                    n_kv_heads,
                )
            })
            .flatten();
        match (fast, pre) {
            (Some(fi), _) if u.decode => {
                let gbi = heads_per_block(group).trailing_zeros() as usize;
                let func = decode_kernel(&kern.decode_tc, &kern.decode, q8, fi, gbi, head_dim);
                let qp = q_v.device_ptr(&be.stream).0;
                let pp = pos_v.device_ptr(&be.stream).0;
                let op = out_v.device_ptr_mut(&be.stream).0;
                let rsp = rs_v.device_ptr(&be.stream).0;
                let btp = b.block_tables.device_ptr(&be.stream).0;
                let ptrs = DecodePtrs {
                    q: qp,
                    k_new: 0,
                    v_new: 0,
                    positions: pp,
                    out: op,
                    xq: 0,
                    xd: 0,
                };
                let dims = DecodeDims {
                    rows: nr,
                    n_heads,
                    group,
                    head_dim,
                    capacity: cap_i,
                    layer_off,
                    scale_log2,
                };
                let pg = PagedPtrs {
                    row_seq: rsp,
                    block_tables: btp,
                    bt_stride,
                    page_shift,
                    page_stride,
                    max_keys,
                };
                // SAFETY: q_v holds nr rows of n_heads×hd, out_v nr rows; reads stay inside
                // the cache as for the store (block tables checked by check_paged_step).
                unsafe { decode_launch(be, func, kv, ptrs, dims, Some(pg), false, None) }?;
            }
            (_, Some((func, cfg))) => {
                // SAFETY: one sequence's rows (a prefill unit is one segment); each block
                // writes only its own (row, head) outputs inside out_v (the tc kernel takes
                // the same arguments and ignores the q8_0 scales).
                unsafe {
                    be.stream
                        .kernel(func)
                        .arg(&q_v)
                        .arg(&kv.k)
                        .arg(&kv.v)
                        .arg(&kv.k_scales)
                        .arg(&kv.v_scales)
                        .arg(&pos_v)
                        .arg(&mut out_v)
                        .arg(&layer_off)
                        .arg(&nr_i)
                        .arg(&n_heads_i)
                        .arg(&group_i)
                        .arg(&cap_i)
                        .arg(&scale_log2)
                        .arg(&rs_v)
                        .arg(&b.block_tables)
                        .arg(&bt_stride)
                        .arg(&page_shift)
                        .arg(&page_stride)
                        .arg(&max_keys)
                        .launch(cfg)
                }?;
            }
            _ => {
                let cfg = LaunchConfig {
                    grid_dim: (n_heads.div_ceil(4) as u32, nr as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                let q8_i = q8 as i32;
                // SAFETY: one warp per (row, head), bounds-checked against n_heads and hd.
                unsafe {
                    be.stream
                        .kernel(&kern.generic)
                        .arg(&q_v)
                        .arg(&kv.k)
                        .arg(&kv.v)
                        .arg(&kv.k_scales)
                        .arg(&kv.v_scales)
                        .arg(&q8_i)
                        .arg(&pos_v)
                        .arg(&mut out_v)
                        .arg(&layer_off)
                        .arg(&n_heads_i)
                        .arg(&group_i)
                        .arg(&hd_i)
                        .arg(&cap_i)
                        .arg(&scale_log2)
                        .arg(&rs_v)
                        .arg(&b.block_tables)
                        .arg(&bt_stride)
                        .arg(&page_shift)
                        .arg(&page_stride)
                        .arg(&max_keys)
                        .launch(cfg)
                }?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> AttnShape {
        AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
        }
    }

    #[test]
    fn tail_merge_leaves_a_slot_free() {
        // Qwen3-8B (32 heads) on 132 SMs at 3 blocks each (the q8_0 loop's bound): up to 3
        // rows spin in at most 384 of 396 slots; at 4 rows (512 spinners) the merge launch.
        assert!(tail_fits(32, 3, 3, 132));
        assert!(!tail_fits(32, 4, 3, 132));
        // Exactly as many spinners as slots: none left for a split not yet started.
        assert!(!tail_fits(33, 1, 1, 132));
        assert!(tail_fits(32, 1, 1, 129));
    }

    #[test]
    fn paged_units_group_short_segments() {
        let seg = |row0, rows| crate::Segment {
            row0,
            rows,
            pos0: 0,
            logits: 1,
            state: 0,
        };
        let u = |decode, row0, rows| Unit { decode, row0, rows };
        // Decode rows, a long prefill chunk, a short chunk and more decode rows.
        let segs = [seg(0, 1), seg(1, 1), seg(2, 40), seg(42, 9), seg(51, 1)];
        assert_eq!(
            paged_units(&segs, 16),
            vec![u(true, 0, 2), u(false, 2, 40), u(true, 42, 10)]
        );
        // The scratch bounds a run.
        let many: Vec<_> = (0..40).map(|i| seg(i, 1)).collect();
        assert_eq!(paged_units(&many, 32), vec![u(true, 0, 32), u(true, 32, 8)]);
        assert_eq!(paged_units(&many, 40), vec![u(true, 0, 40)]);
    }

    #[test]
    fn heads_per_block_divides_the_group() {
        for group in 1..=32 {
            let gb = heads_per_block(group);
            assert!(group % gb == 0 && gb <= 8, "group {group} → {gb}");
        }
        assert_eq!(heads_per_block(4), 4);
        assert_eq!(heads_per_block(6), 2);
        assert_eq!(heads_per_block(16), 4);
        assert_eq!(heads_per_block(8), 4);
    }

    #[test]
    fn split_count_is_bounded() {
        // Qwen3-8B on an H200: 32 heads / 8 kv heads → 8 blocks per split.
        let tu = DecodeTuning::default();
        assert_eq!(decode_splits(132, shape(32, 8, 128), 40960, tu, false), 64);
        // The pipelined q8_0 loop (3 blocks per SM): one wave, 49 × 8 = 392 ≤ 396 blocks.
        assert_eq!(decode_splits(132, shape(32, 8, 128), 40960, tu, true), 49);
        assert_eq!(decode_splits(132, shape(32, 8, 128), 600, tu, true), 10);
        // Short caches never get empty-by-construction splits.
        assert_eq!(
            decode_splits(132, shape(32, 8, 128), 100, tu, false),
            100usize.div_ceil(DECODE_MIN_CHUNK_TC)
        );
        assert_eq!(
            decode_splits(132, shape(16, 4, 256), 1000, tu, false),
            1000usize.div_ceil(DECODE_MIN_CHUNK)
        );
        assert_eq!(decode_splits(132, shape(4, 2, 32), 1, tu, false), 1);
        // Many heads: fewer splits.
        assert_eq!(decode_splits(132, shape(64, 64, 128), 40960, tu, false), 9);
        assert_eq!(decode_splits(132, shape(64, 64, 128), 40960, tu, true), 6);
    }

    /// The caches that take the keys-before-the-wait form have chunks of at most one block
    /// iteration at every position (the device's chunk formula, as in the test below), and
    /// the bench's tg128 cache (512 positions, 8 splits) is one of them.
    #[test]
    fn pre_loads_fit_only_single_tile_chunks() {
        for cap in 1..=1200usize {
            for splits in 1..=16usize {
                for mc in [16usize, 32, 64, 128] {
                    let fits = pre_loads_fit(cap, splits, mc);
                    let widest = (1..=cap)
                        .map(|n| mc.max(n.div_ceil(splits).next_multiple_of(DECODE_TC_STEP)))
                        .max()
                        .unwrap();
                    assert_eq!(
                        fits,
                        widest <= DECODE_TC_STEP,
                        "cap {cap} splits {splits} mc {mc}"
                    );
                }
            }
        }
        let tu = DecodeTuning::default();
        let splits = decode_splits(132, shape(32, 8, 128), 512, tu, false);
        assert_eq!(splits, 8);
        assert!(pre_loads_fit(512, splits, min_chunk_for(128, tu)));
    }

    /// The device computes chunk = max(mc, roundup(ceil(n/splits), step)) (step: keys per
    /// block iteration, 16 or 32) and uses the first n_active = ceil(n/chunk) splits; every
    /// position 0..n must fall in exactly one of those, and n_active ≤ splits, for every
    /// n ≤ capacity.
    #[test]
    fn decode_chunks_cover_every_position() {
        for (mc, step) in [
            (16usize, 16usize),
            (32, 32),
            (DECODE_MIN_CHUNK, 16),
            (64, 32),
            (128, 32),
        ] {
            for splits in [1usize, 2, 3, 7, 33, 64, 128] {
                for n in 1..3000usize {
                    let per = n.div_ceil(splits);
                    let chunk = mc.max(per.next_multiple_of(step));
                    let active = n.div_ceil(chunk);
                    assert!(active <= splits, "mc {mc} splits {splits} n {n}");
                    assert!((active - 1) * chunk < n, "mc {mc} splits {splits} n {n}");
                }
            }
        }
    }
}
