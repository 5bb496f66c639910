//! Prefill matmul on the Hopper warpgroup tensor cores (`kernels/mmw.cu`, sm_90a `wgmma`):
//! `out[t][o] = Σ_i W[o][i] · x[t][i]` for more than [`GEMV_MAX_ROWS`] rows, with the numerics
//! of the bf16 `mm_` kernel (x and the dequantized weights rounded to bf16, f32 accumulation).
//! The plan is in the kernel file's header; the record in MATMUL.md ("wgmma prefill").
//!
//! [`matmul`] / [`matmuls`] return `Ok(false)` (nothing launched) when the path does not apply:
//! not an sm_90a device, ≤ GEMV_MAX_ROWS rows, ≤ F32_SMALL_OUT outputs (routers keep the f32
//! GEMV), a type without a kernel, or `FERRITE_MMW=0` (the mma.sync `mm_` kernel instead).
//!
//! Tiles (MATMUL.md round 13, measured on the H200): 64 outputs × 256 tokens (one consumer
//! warpgroup, `m64n256`: a decoded weight serves 256 tokens) where a prefill of more than 128
//! rows fills the SMs (Qwen3-8B Q4_K_M pp512 15,573 tok/s against 10,476 on `mm_`; 16,591
//! with the Q, K, V projections in one launch); 128 × 128 or 128 × 64 (the `mm_` rule) on
//! grids that leave more than half the SMs idle and on short prefills. `FERRITE_MMW=2` never
//! takes the 256-token tile (12,417 in the same call).
//!
//! Fused launches (MATMUL.md round 14, `FERRITE_MMW_FUSE`): Q4_K_M's Q, K (Q4_K) and V (Q6_K)
//! in one grid (`MIXED`), and gate, up and the SwiGLU in one ([`matmul_swiglu`]): pp512
//! 16,727 → 17,933 → 18,161 (18,364 recorded).
//!
//! A MoE prefill's grouped expert GEMMs take the same pipeline ([`moe_gate_up`], [`moe_down`]:
//! moe_sort's 64-pair tiles as the token tiles, each block its tile's expert; MOE.md, 41st
//! session): Qwen3-30B-A3B pp512 +8% over moe.cu's mma.sync forms on an H100.

use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use ferrite_formats::GgmlType;

use super::launch::{KernelArg, LaunchExt};
use super::matmul::{F32_SMALL_OUT, GEMV_MAX_ROWS};
use super::{function, load_module, CudaBackend, CudaWeight};
use crate::Act;

/// Kernel source.
pub const SRC: &str = include_str!("kernels/mmw.cu");

/// Weight types with a kernel, in kernel-name order.
const TYPES: [(GgmlType, &str); 9] = [
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
/// K per stage (MMW_TK in mmw.cu): the bf16 scratch's row length (matmul.rs `with_bf16`) is
/// a multiple of matmul.rs's K step, which must be one of these.
const TK: usize = 64;
const _: () = assert!(TK == super::matmul::MM_TK);
/// The instantiated tiles (outputs TM × tokens BN), as `mmw_<type>_n<BN>`, in kernel-array
/// order: two consumer warpgroups of 64 outputs at 128 or 64 tokens, one at 256 tokens.
const TILES: [(usize, usize); 3] = [(128, 128), (128, 64), (64, 256)];
/// Outputs per block of the n128 / n64 tiles (the tile rules count grids of these).
const TM: usize = 128;

/// Threads of a block with TM outputs: two producer warpgroups and TM / 64 consumer ones
/// (MMW_THREADS in mmw.cu).
fn threads(tm: usize) -> u32 {
    threads_p(tm, 2)
}

/// Threads of a block with TM outputs and `p` producer warpgroups, or with `p` = 0 one
/// producer warp (MMW_THREADS_P in mmw.cu).
const fn threads_p(tm: usize, p: usize) -> u32 {
    (if p > 0 { 128 * p } else { 32 } + 2 * tm) as u32
}

/// Dynamic shared memory of a tile's kernel (MmwShape::SMEM in mmw.cu): as many stages of A
/// (tm × 64 bf16) and B (bn × 64 bf16) as fit 224 KB, at most 7, 64 bytes for the stages'
/// mbarriers (`FERRITE_MMW_XTMA`, `FERRITE_MMW_RS`) and 1 KB of slack for aligning the ring
/// to the swizzle atoms.
/// Under [`rs_q6`] every dense tile takes the larger of that and the RS Q6_K form's ring (its
/// raw A rows are RS_Q6_QL + RS_Q6_HI bytes: fewer, larger stages), so that one limit serves
/// both (the mixed Q, K, V launch runs both forms).
fn smem(tm: usize, bn: usize) -> usize {
    let plain = ring_smem(tm, bn, 224 * 1024);
    if rs_q6() {
        plain.max(ring_smem_row(
            tm,
            bn,
            224 * 1024,
            (RS_Q6_QL + RS_Q6_HI) as usize,
        ))
    } else {
        plain
    }
}

/// [`smem`] with the stages' budget `budget` bytes (MmwShape's BUDGET: 96 KB at two blocks
/// an SM).
const fn ring_smem(tm: usize, bn: usize, budget: usize) -> usize {
    ring_smem_row(tm, bn, budget, TK * 2)
}

/// [`ring_smem`] with A rows of `arow` bytes (MmwShape's AROW).
const fn ring_smem_row(tm: usize, bn: usize, budget: usize, arow: usize) -> usize {
    let stage = tm * arow + bn * TK * 2;
    let stages = if budget / stage < 7 {
        budget / stage
    } else {
        7
    };
    stages * stage + 64 + 1024
}

/// `FERRITE_MMW_XTMA` (read once; default 1, and on whenever [`rs`] is): the x tiles of the
/// dense launches and the MoE downs by tensor copies (mod.rs compiles mmw.cu with MMW_XTMA 1,
/// whose kernels then take [`x_map`] as their last argument; MATMUL.md round 82: Qwen3-8B
/// Q4_K_M pp512 +8% on an H100). `FERRITE_MMW_XTMA=0` (RS off): the producers' cp.async.
pub(crate) fn xtma() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| rs() || super::switches::int_or("FERRITE_MMW_XTMA", 1) != 0)
}

/// `FERRITE_MMW_TA` (read once; default 1): F16 and BF16 weights on the `mmw_ta_*` kernels,
/// whose weight tiles and x tiles come by tensor copies as stored, with no producer decode
/// (F16 with an f16 x scratch and f16 MMAs; MATMUL.md round 84: Qwen3-8B F16 pp512 +41% on
/// an H100).
pub(crate) fn ta() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_MMW_TA", 1) != 0)
}

/// `FERRITE_MMW_TA_TILE` (read once; default 2): the TA form's tiles. 0: the quantized
/// launches' rule (the 64 × 256 tile on full grids of long prefills); 1: only the 128-output
/// tiles (128 × 128, 128 × 64); 2: as 1, but the 128 × 256 tile (`mmw_ta_*_w`, two consumer
/// warpgroups of m64n256) where its grid fills the SMs at least once (MATMUL.md round 92; the
/// launches whose grid does not fill them, with K split in two on that tile and the halves
/// added into the zeroed output, measured slower: round 93).
fn ta_tile_mode() -> i64 {
    static MODE: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| super::switches::int_or("FERRITE_MMW_TA_TILE", 2))
}

/// `FERRITE_MMW_TA_KS` (read once; default 2): the most blocks of a cluster the TA form's plain
/// launches split a tile's K between ([`Tile::split_k`]). 2 puts the launches whose 128 × 256
/// tiles would not fill the SMs (the 4096-output projections at 512 rows: 64 blocks) on that
/// tile with K split between the two blocks of a cluster, added through shared memory
/// (`mmw_ta_*_wk`, MATMUL.md round 95), where the split grid fills at least three quarters of
/// the SMs; 4 also lets four blocks split it (`mmw_ta_*_wk4`, round 99) where that takes fewer
/// waves of tile time with the clusters the device holds at once (Q, K, V's 96 tiles: three
/// waves of quarter tiles against two of halves where 128 blocks fit in clusters of four; the
/// 132-SM Hopper cards hold 120, so two there);
/// 0 (or any other value): the 128-output tiles there. On the H100 the two-way split took
/// Qwen3-8B F16's down from 100.4 to 86.6 µs and its pp512 from ~31,950 to ~32,710 tok/s.
fn ta_ks() -> usize {
    static KS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KS.get_or_init(|| match super::switches::int_or("FERRITE_MMW_TA_KS", 2) {
        v @ (2 | 4) => v as usize,
        _ => 0,
    })
}

/// `FERRITE_MMW_TA_CAT` (read once; default 1): the 192-output tile over the grouped weights'
/// rows one after another ([`cat_tile`]): 1 where it takes fewer waves than the K-split wide
/// tile, 2 wherever it applies (a check setting), 0 never. On the H100 (MATMUL.md round 100,
/// 59th session) 1 took Qwen3-8B F16 pp512 from ~34,700 to ~35,800 tok/s.
fn ta_cat() -> i64 {
    static MODE: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| super::switches::int_or("FERRITE_MMW_TA_CAT", 1))
}

/// The concatenated tile (`mmw_ta_<type>_ck`, mmw.cu MMW_CAT_*; MATMUL.md round 100): 192
/// outputs of the group's rows one after another × 256 tokens, K split between a cluster's
/// two blocks; two warpgroups (256 threads) and four 56 KB stages.
const TA_CAT: (usize, usize) = (192, 256);
const TA_CAT_THREADS: u32 = 256;
const TA_CAT_SMEM: usize = ring_smem(TA_CAT.0, TA_CAT.1, 224 * 1024);

/// Whether a TA launch that [`Tile::split_k`] put on the K-split wide tile (`wide_blocks`
/// blocks) takes the concatenated tile instead: its weights' outputs `ns` all multiples of 64
/// (a 64-row box is one weight's), and under `FERRITE_MMW_TA_CAT=1` fewer waves of whole-tile
/// time, ceil(cat blocks / slots) · 3/4 against ceil(wide blocks / slots) · 1/2 (its block
/// computes 1.5 times the wide tile's half). `slots`: blocks resident at once (one an SM).
fn cat_tile(mode: i64, rows: usize, ns: &[usize], wide_blocks: usize, slots: usize) -> bool {
    let n_total: usize = ns.iter().sum();
    if mode == 0 || ns.iter().any(|n| !n.is_multiple_of(64)) || n_total == 0 {
        return false;
    }
    let blocks = 2 * rows.div_ceil(TA_CAT.1) * n_total.div_ceil(TA_CAT.0);
    let slots = slots.max(1);
    mode == 2 || 3 * blocks.div_ceil(slots) < 2 * wide_blocks.div_ceil(slots)
}

/// The TA form's 128 × 256 tile (outputs × tokens) and its block: two consumer warpgroups
/// and one producer warp (mmw.cu MMW_THREADS_P(128, 0)).
const TA_WIDE: (usize, usize) = (128, 256);
const TA_WIDE_THREADS: u32 = threads_p(128, 0);
/// Its dynamic shared memory: four 48 KB stages of the 224 KB budget (MmwShape's at P = 0).
const TA_WIDE_SMEM: usize = ring_smem(TA_WIDE.0, TA_WIDE.1, 224 * 1024);

/// A launch's tile: one of [`TILES`] (by index), or the TA form's [`TA_WIDE`], whole or with
/// K split between a cluster's 2 or 4 blocks ([`ta_ks`]; the count its field).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tile {
    Std(usize),
    TaWide,
    TaWideK(u32),
}

impl Tile {
    /// The tile for a launch of `n_total` outputs on `rows` rows: the TA form's rule (`ta`,
    /// [`ta_tile_mode`]) or the quantized launches' ([`tile_index`]).
    fn pick(ta: bool, rows: usize, n_total: usize, sm_count: usize) -> Tile {
        let mode = if ta { ta_tile_mode() } else { 0 };
        if mode == 0 {
            return Tile::Std(tile_index(rows, n_total, sm_count));
        }
        if mode == 2
            && rows > 128
            && rows.div_ceil(TA_WIDE.1) * n_total.div_ceil(TA_WIDE.0) >= sm_count.max(1)
        {
            Tile::TaWide
        } else if super::matmul::token_tile(rows, n_total, sm_count) == 128 {
            Tile::Std(0)
        } else {
            Tile::Std(1)
        }
    }

    /// A TA plain launch's tile once [`ta_ks`] has its say: the 128-output tiles become the
    /// wide one with K split in two where their launch has `out_tiles` output tiles (of 128)
    /// on more than 128 `rows` and the split wide grid fills at least three quarters of the
    /// SMs (the unsplit wide tile, where [`Tile::pick`] chose it, fills them already); split in
    /// four instead (under `FERRITE_MMW_TA_KS=4`) where that takes fewer waves of whole-tile
    /// time, ceil(4 · blocks / slots₄) / 4 against ceil(2 · blocks / slots₂) / 2, and K has at
    /// least 16 steps of 64 (every block at least 4: the kernel's split leaves none empty).
    /// `slots`: the blocks of clusters of 2 and of 4 the device holds at once
    /// ([`Kernels::ta_wave_slots`]; 0 where unknown: the SM count).
    fn split_k(
        self,
        rows: usize,
        out_tiles: usize,
        k_steps: usize,
        sm_count: usize,
        slots: [usize; 2],
    ) -> Tile {
        let max_ks = ta_ks();
        let blocks = rows.div_ceil(TA_WIDE.1) * out_tiles;
        let sm = sm_count.max(1);
        let wave = |i: usize| if slots[i] > 0 { slots[i] } else { sm };
        match self {
            Tile::Std(0 | 1)
                if max_ks >= 2
                    && ta_tile_mode() == 2
                    && rows > 128
                    && k_steps >= 2
                    && 4 * 2 * blocks >= 3 * sm =>
            {
                // Waves of whole-tile time, in quarters: ceil(ks · blocks / slots) · 4 / ks.
                let quarters = |ks: usize| (ks * blocks).div_ceil(wave(ks / 4)) * 4 / ks;
                if max_ks >= 4 && k_steps >= 16 && quarters(4) < quarters(2) {
                    Tile::TaWideK(4)
                } else {
                    Tile::TaWideK(2)
                }
            }
            t => t,
        }
    }

    /// Outputs × tokens.
    fn dims(self) -> (usize, usize) {
        match self {
            Tile::Std(i) => TILES[i],
            Tile::TaWide | Tile::TaWideK(_) => TA_WIDE,
        }
    }

    /// The index of the kernel in a [`Tiles`] family (the wide tile has its own kernels).
    fn index(self) -> Option<usize> {
        match self {
            Tile::Std(i) => Some(i),
            Tile::TaWide | Tile::TaWideK(_) => None,
        }
    }

    /// The launch shape over `rows` tokens and `out_tiles` output tiles.
    fn config(self, rows: usize, out_tiles: usize) -> Result<LaunchConfig> {
        ensure!(
            out_tiles <= 65535,
            "mmw: {out_tiles} output tiles exceed the grid limit"
        );
        let (tm, bn) = self.dims();
        let (threads, smem_bytes) = match self {
            Tile::Std(_) => (threads(tm), smem(tm, bn)),
            Tile::TaWide | Tile::TaWideK(_) => (TA_WIDE_THREADS, TA_WIDE_SMEM),
        };
        Ok(LaunchConfig {
            grid_dim: (
                rows.div_ceil(bn) as u32,
                out_tiles as u32,
                if let Tile::TaWideK(ks) = self { ks } else { 1 },
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem_bytes as u32,
        })
    }
}

/// `FERRITE_MMW_RSW` (read once; default 1; only with [`rs`]): Q4_K launches on the 64 × 256
/// tile take the register-A form too (`mmw_rsw_*`: one consumer warpgroup decoding its 64 rows
/// for 256 tokens beside one producer warpgroup; MATMUL.md rounds 85–86: Qwen3-8B Q4_K_M
/// pp512 +15% on an H100 with [`rs`]).
pub(crate) fn rsw() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| rs() && super::switches::int_or("FERRITE_MMW_RSW", 1) != 0)
}

/// `FERRITE_MMW_RS_Q8` (read once; default 1; only with [`rs`]): Q8_0 weights take the RS form
/// too (mmw.cu's MMW_RS_Q8: one 80-byte span a row a step, from the 16-byte unit holding the
/// step's blocks; MATMUL.md round 86: Qwen3-8B Q8_0 pp512 +43% on an H100). Q8_0 rows that
/// are not whole 16-byte units (n_in not a multiple of 256) have no map and take `mm_` (dense)
/// or moe.cu's forms (experts) under it.
pub(crate) fn rs_q8() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| rs() && super::switches::int_or("FERRITE_MMW_RS_Q8", 1) != 0)
}

/// Threads of an `mmw_rsw_*` block (MMW_THREADS_P(64, 1) in mmw.cu).
const RSW_THREADS: u32 = threads_p(64, 1);

/// `FERRITE_MMW_RS_Q6` (read once; default 1; only with [`rs`]): dense Q6_K weights take the
/// RS form too (mmw.cu's MMW_RS_Q6: two spans a row a step, larger stages; MATMUL.md rounds
/// 86, 87: Qwen3-8B Q4_K_M pp512 +3.4% on an H100). Q6_K rows that are not whole 16-byte
/// units (n_in not a multiple of 2048) have no map and take `mm_` under it; the MoE experts
/// take it under [`rs_q6_moe`].
pub(crate) fn rs_q6() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| rs() && super::switches::int_or("FERRITE_MMW_RS_Q6", 1) != 0)
}

/// `FERRITE_MMW_RS_Q5` (read once; default 1, only with [`rs`]): Q5_K weights on the RS form
/// too (mmw.cu's MMW_RS_Q5: the Q4_K form's decode with each nibble's fifth bit from qh, the
/// super-block's first 48 bytes and the step's 32 quant bytes by two tensor copies a row;
/// MATMUL.md round 91; measured in round 93: Qwen3.5-35B-A3B Q4_K_M pp512 +1.5% on an H100).
pub(crate) fn rs_q5() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| rs() && super::switches::int_or("FERRITE_MMW_RS_Q5", 1) != 0)
}

/// `FERRITE_MMW_HX` (read once; default 1): the TA form's gate/up launch writes the down's
/// 16-bit x rows itself ([`swiglu_mlp`]; MATMUL.md round 96); 0: f32 h, converted by the down.
fn hx() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_MMW_HX", 1) != 0)
}

/// `FERRITE_MMW_TSHIFT` (read once; default 1): a dense launch's last token tile, where the
/// rows end inside it, read from a tile's length before the end (mmw.cu MMW_TSHIFT: its x box
/// inside the map, no zero fill by the tensor copy; MATMUL.md round 93: pp300 on an H100
/// +69% on Qwen3-8B Q4_K_M, +30% on F16).
pub(crate) fn tshift() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_MMW_TSHIFT", 1) != 0)
}

/// Whether a MoE prefill's gate/up writes h as the bf16 rows the down reads: where ffn is a
/// whole number of K steps (the rows are then the down's x scratch rows) and
/// `FERRITE_MOE_H_BF16` (read once) is 1, the default; else h is f32, converted before the down.
pub(crate) fn moe_h_bf16(ffn: usize) -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    ffn.is_multiple_of(TK)
        && *V.get_or_init(|| super::switches::int_or("FERRITE_MOE_H_BF16", 1) != 0)
}

/// Steps of the RS MoE gate/up's gathered x copies in flight past the one its producers
/// publish (`FERRITE_MMW_GU_LEAD`, default 0; the kernel caps it at its stages less two; 0:
/// each step's copies waited for as soon as issued, the form before the 48th session).
pub(crate) fn gu_lead() -> i64 {
    static V: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *V.get_or_init(|| super::switches::int_or("FERRITE_MMW_GU_LEAD", 0).clamp(0, 8))
}

/// `FERRITE_MMW_GU_XG` (read once; bits, default 3): bit 1 gathers a MoE prefill's x rows into
/// list order before the gate/up (`mmw_moe_x_gather`, into the down's output buffer, free until
/// the down) so that the gate/up takes its x tiles by tensor copies (only with [`xtma`]); bit 2
/// orders the gate/up's blocks tile-major. pp512 on an H100 against 0: Qwen3-30B-A3B +5.3%,
/// Qwen3.5-35B-A3B +4.6% (MOE.md, 50th session). mod.rs compiles mmw.cu with MMW_GU_XG where it
/// is not 0.
pub(crate) fn gu_xg() -> i64 {
    static V: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *V.get_or_init(|| super::switches::int_or("FERRITE_MMW_GU_XG", 3).clamp(0, 3))
}

/// `FERRITE_MMW_RSW_MIXED` (read once; default 1): Q4_K_M's mixed Q, K, V groups (Q4_K, Q4_K,
/// Q6_K) on the wide tile by the RS form (`mmw_rsw_q4_k_q6_k_n256`) instead of the producers'
/// `mmw_q4_k_q6_k_n256`: pp512 on an H100 +1.7% on Qwen3-30B-A3B, +2.9% on Qwen3-8B Q4_K_M
/// (MATMUL.md round 89).
fn rsw_mixed() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| super::switches::int_or("FERRITE_MMW_RSW_MIXED", 1) != 0)
}

/// Whether the gate/up takes its x rows gathered in list order ([`gu_xg`] bit 1 with [`xtma`]).
fn gu_xt() -> bool {
    gu_xg() & 1 != 0 && xtma()
}

/// `FERRITE_MMW_RS_Q6_MOE` (read once; only with [`rs_q6`]): 0 the MoE GEMMs' Q6_K experts on
/// the producers' form, 1 on the RS form at two blocks an SM (`mmw_moe2_*`), 2 (default) on the
/// RS form at three (`mmw_moe3_*` under `FERRITE_MMW_MOE=3`, `mmw_moe3w_*` under 4). mod.rs compiles mmw.cu with
/// MMW_RS_Q6_MOE where it is not 0.
pub(crate) fn rs_q6_moe() -> i64 {
    static V: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        if rs_q6() {
            super::switches::int_or("FERRITE_MMW_RS_Q6_MOE", 2)
        } else {
            0
        }
    })
}

/// The types of the `mmw_rsw_*` kernels, in their order in `Kernels::rsw`: Q4_K, then Q8_0
/// under [`rs_q8`], Q6_K under [`rs_q6`] and Q5_K under [`rs_q5`] (read once: every wide-tile
/// launch asks).
fn rsw_types() -> &'static [(GgmlType, &'static str)] {
    static T: std::sync::OnceLock<Vec<(GgmlType, &'static str)>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut v = vec![(GgmlType::Q4K, "q4_k")];
        if rs_q8() {
            v.push((GgmlType::Q8_0, "q8_0"));
        }
        if rs_q6() {
            v.push((GgmlType::Q6K, "q6_k"));
        }
        if rs_q5() {
            v.push((GgmlType::Q5K, "q5_k"));
        }
        v
    })
}

/// Index of `t`'s `mmw_rsw_*` kernels ([`rsw_types`]).
fn rsw_index(t: GgmlType) -> Option<usize> {
    rsw_types().iter().position(|&(u, _)| u == t)
}

/// The TA form's weight types, in kernel-array order (`mmw_ta_<name>_n<BN>`).
const TA_TYPES: [(GgmlType, &str); 2] = [(GgmlType::F16, "f16"), (GgmlType::BF16, "bf16")];

/// `FERRITE_MMW_RS` (read once; default 1): the Q4_K launches on 128-output tiles and the MoE
/// grouped GEMMs decode their A fragments in the consumers' registers from raw bytes brought
/// by tensor copies (mod.rs compiles mmw.cu with MMW_RS 1 and MMW_XTMA 1; the dense kernels
/// then also take [`w_maps`]' maps; the 64 × 256 tile keeps its producers, with x by tensor
/// copies, unless [`rsw`]; MATMUL.md rounds 83–86: on an H100 the 128-output tiles 1.44–1.49×
/// faster, Qwen3-30B-A3B pp512 +3.3%, with [`rsw`] +4.2% and Qwen3-8B Q4_K_M +15%).
pub(crate) fn rs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_MMW_RS", 1) != 0)
}

/// A 2-D tiled tensor map: `dims` (innermost first) of `ty` elements at `ptr`, rows `stride`
/// bytes apart, boxes of `boxd`, elements past the dims read as zeros.
fn tensor_map(
    ptr: u64,
    ty: cudarc::driver::sys::CUtensorMapDataType,
    dims: [u64; 2],
    stride: u64,
    boxd: [u32; 2],
    swizzle: cudarc::driver::sys::CUtensorMapSwizzle,
) -> Result<cudarc::driver::sys::CUtensorMap> {
    use cudarc::driver::sys;
    let strides: [u64; 1] = [stride];
    let elem: [u32; 2] = [1, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: every pointer is to a live local array of the rank the call is given (2, and
    // rank - 1 strides); the map is written by the call before it is read.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            ty,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxd.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .with_context(|| {
            format!("encoding a tensor map of {dims:?} ({stride}-byte rows) in boxes of {boxd:?}")
        })?;
        Ok(map.assume_init())
    }
}

/// The two tensor maps of a Q4_K weight for the RS kernels, over its rows as bytes: boxes of
/// 16 bytes (a super-block's d, dmin and scales) and of 32 (a 64-element group's quants), each
/// `box_rows` rows; rows past the weight read as zeros. Other types: zeroed maps (their
/// kernels never read them).
fn w_maps(
    be: &CudaBackend,
    w: &CudaWeight,
    box_rows: usize,
    moe: bool,
) -> Result<[cudarc::driver::sys::CUtensorMap; 2]> {
    use cudarc::driver::sys;
    if !rs_type(w.dtype, moe) {
        // SAFETY: a CUtensorMap is plain bytes; a zeroed one is passed only to kernels that
        // do not read it.
        let zero = unsafe { std::mem::zeroed::<sys::CUtensorMap>() };
        return Ok([zero, zero]);
    }
    // Rows over every leading dimension (stacked experts: n_experts · n_out).
    let n_out: usize = w.shape[..w.shape.len() - 1].iter().product();
    let rb = w.row_bytes();
    // The MoE Q6_K rows in groups whose bytes are whole 16-byte units (mmw.cu mmw_q6_groups):
    // a map of n_out / g rows of g · rb bytes, boxes of box_rows / g.
    let g = if moe && w.dtype == GgmlType::Q6K {
        q6_groups(rb)
    } else {
        1
    };
    ensure!(
        (g * rb).is_multiple_of(16)
            && n_out > 0
            && box_rows <= 256
            && box_rows.is_multiple_of(g)
            && w.shape[w.shape.len() - 2].is_multiple_of(g),
        "mmw: tensor maps of [{n_out}] rows of {rb} bytes in groups of {g}"
    );
    ensure!(
        !w.in_host_memory(),
        "FERRITE_MMW_RS: a weight held in host memory has no tensor map; run without the switch"
    );
    let (ptr, _guard) = w.data.device_ptr(&be.stream);
    let map = |inner: u32| {
        tensor_map(
            ptr,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            [(g * rb) as u64, (n_out / g) as u64],
            (g * rb) as u64,
            [inner, (box_rows / g) as u32],
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        )
    };
    if w.dtype == GgmlType::Q6K {
        // Two spans a row a step (mmw_rs_row_q6k): the half's ql bytes and the super-block's
        // bytes 128..209, each from the 16-byte unit below them.
        return Ok([map(RS_Q6_QL)?, map(RS_Q6_HI)?]);
    }
    if w.dtype == GgmlType::Q5K {
        // The super-block's first 48 bytes (d, dmin, scales, qh) and the step's 32 quant bytes
        // (mmw_rs_row<true>).
        return Ok([map(48)?, map(32)?]);
    }
    if w.dtype == GgmlType::Q8_0 {
        // One span a row a step (MMW_RS_Q80_SPAN bytes from the 16-byte unit holding the
        // step's two 34-byte blocks: a box starts at a whole unit); the second map is not read.
        let m = map(RS_Q80_SPAN)?;
        return Ok([m, m]);
    }
    Ok([map(16)?, map(32)?])
}

/// Bytes a Q8_0 row's span of a K step in the RS form (MMW_RS_Q80_SPAN in mmw.cu).
const RS_Q80_SPAN: u32 = 80;

/// Bytes a Q6_K row's two spans of a K step in the RS form (MMW_RS_Q6_QL, MMW_RS_Q6_HI in
/// mmw.cu).
const RS_Q6_QL: u32 = 80;
const RS_Q6_HI: u32 = 96;

/// Weight types of the RS form (mmw.cu's RS: Q4_K, Q8_0 by spans under [`rs_q8`], Q6_K by
/// two spans under [`rs_q6`] on the dense launches, and on the MoE GEMMs (`moe`) under
/// [`rs_q6_moe`], and Q5_K on the dense launches under [`rs_q5`]).
fn rs_type(t: GgmlType, moe: bool) -> bool {
    t == GgmlType::Q4K
        || (t == GgmlType::Q8_0 && rs_q8())
        || (t == GgmlType::Q6K && rs_q6() && (!moe || rs_q6_moe() != 0))
        || (t == GgmlType::Q5K && rs_q5() && !moe)
}

/// Rows of `rb` bytes a group whose bytes are whole 16-byte units: 16 / gcd(rb, 16) (mmw.cu
/// mmw_q6_groups; Q6_K expert rows of 768 columns, 630 bytes: 8; of 512, 420 bytes: 4).
fn q6_groups(rb: usize) -> usize {
    16 / (1usize << rb.trailing_zeros().min(4))
}

/// Whether a weight of an RS type can be read by the RS kernels' tensor maps: in device memory,
/// rows a whole number of 16-byte units (Q8_0 rows of 256·k elements, Q6_K rows of 2048·k;
/// Q4_K's always are), or for the MoE GEMMs' (`moe`) Q6_K experts groups of rows that are
/// (`q6_groups`: each expert's rows a whole number of groups).
fn rs_mappable(w: &CudaWeight, moe: bool) -> bool {
    let rb = w.row_bytes();
    !w.in_host_memory()
        && (rb.is_multiple_of(16)
            || (moe
                && w.dtype == GgmlType::Q6K
                && w.shape.len() >= 2
                && w.shape[w.shape.len() - 2].is_multiple_of(q6_groups(rb))))
}

/// The TA kernels' tensor map of a 16-bit weight `[n_out, n_in]` (F16 or BF16, rows as
/// stored): boxes of 64 elements (one 128-byte line, the 128-byte swizzle of mmw_off) ×
/// `box_rows` rows; elements past the weight read as zeros.
fn a16_map(
    be: &CudaBackend,
    w: &CudaWeight,
    box_rows: usize,
) -> Result<cudarc::driver::sys::CUtensorMap> {
    use cudarc::driver::sys;
    let (n_out, n_in, rb) = (w.shape[0], w.shape[1], w.row_bytes());
    ensure!(
        rb == 2 * n_in && rb.is_multiple_of(16) && box_rows <= 256 && !w.in_host_memory(),
        "mmw: a 16-bit tensor map of [{n_out}, {n_in}] {} in boxes of {box_rows} rows",
        w.dtype
    );
    let ty = if w.dtype == GgmlType::F16 {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    } else {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    };
    let (ptr, _guard) = w.data.device_ptr(&be.stream);
    tensor_map(
        ptr,
        ty,
        [n_in as u64, n_out as u64],
        rb as u64,
        [TK as u32, box_rows as u32],
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )
}

/// The tensor map of a bf16 scratch of `rows` rows of `kp` for the x tiles of tile width `bn`:
/// boxes of 64 elements (one 128-byte line, the 128-byte swizzle of mmw_off) × bn rows; rows
/// past `rows` read as zeros.
fn x_map<X: cudarc::driver::DevicePtr<u16>>(
    be: &CudaBackend,
    xb: &X,
    rows: usize,
    kp: usize,
    bn: usize,
) -> Result<cudarc::driver::sys::CUtensorMap> {
    use cudarc::driver::sys;
    ensure!(
        rows > 0 && kp.is_multiple_of(TK) && xb.len() >= rows * kp && bn <= 256,
        "mmw: tensor map of [{rows}, {kp}] bf16 (buffer {}) in boxes of {bn} rows",
        xb.len()
    );
    let (ptr, _guard) = xb.device_ptr(&be.stream);
    tensor_map(
        ptr,
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        [kp as u64, rows as u64],
        (kp * 2) as u64,
        [TK as u32, bn as u32],
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )
}

/// Mixed-type groups with a kernel (`mmw_<a>_<b>_n<BN>`: weights 0 and 1 of type a, weight 2
/// of type b): Q4_K_M's Q, K (Q4_K) and V (Q6_K in half the layers). Alone, that V
/// projection's launch was 7% of a Qwen3-8B Q4_K_M pp512 forward (MATMUL.md round 13).
const MIXED: [(GgmlType, GgmlType, &str); 1] = [(GgmlType::Q4K, GgmlType::Q6K, "q4_k_q6_k")];

/// The [`TILES`] kernels of one family.
type Tiles = [CudaFunction; 3];

/// The compiled kernels (x is converted to bf16 into matmul.rs's scratch by its
/// `with_bf16`, the same kernel and buffer as `mm_`'s). Every list is empty where wgmma is
/// not available (not sm_90a) or switched off.
pub struct Kernels {
    /// `mmw_<type>_n<BN>` of each of [`TYPES`].
    mm: Vec<Tiles>,
    /// `mmw_swiglu_<type>_n<BN>` of each of [`TYPES`]: gate, up and silu(gate) ⊙ up in one.
    swiglu: Vec<Tiles>,
    /// The [`MIXED`] kernels.
    mixed: Vec<Tiles>,
    /// `mmw_moe_gu_<type>_n64` and `mmw_moe_down_<type>_n64` of each of [`TYPES`]: a MoE
    /// prefill's grouped expert GEMMs ([`moe_gate_up`], [`moe_down`]); empty where wgmma is
    /// not available or `FERRITE_MMW_MOE=0` (moe.cu's mma.sync forms instead). By default
    /// (`FERRITE_MMW_MOE=4`) the RS Q4_K experts on the `mmw_moe4w_*` forms and the RS Q6_K
    /// ones on `mmw_moe3w_*` (64-output tiles, one consumer warpgroup and one producer warp,
    /// four and three blocks an SM: pp512 +1.0% on Qwen3-30B-A3B and +3.7% on Qwen3.5-35B-A3B
    /// over `FERRITE_MMW_MOE=3`, MOE.md 49th session); under 3 those on the `mmw_moe3_*`
    /// forms (one producer warpgroup, three blocks an SM: +8.8% and +8.7% over 2, MOE.md 48th
    /// session); every other type on the `mmw_moe2_*` forms
    /// (64-output tiles, two blocks an SM: +9.7% on Qwen3-30B-A3B's pp512, MOE.md 42nd
    /// session), as under `FERRITE_MMW_MOE=2` every type; `FERRITE_MMW_MOE=1` the 128-output
    /// ones, one block an SM.
    moe: Vec<[MoeFn; 2]>,
    /// Their tile: outputs a block (gate and up rows together for the gate/up) and dynamic
    /// shared memory (of the `FERRITE_MMW_MOE=1` or 2 form; each [`MoeFn`] has its own).
    moe_tile: (usize, usize),
    /// `mmw_ta_<type>_n<BN>` and `mmw_ta_swiglu_<type>_n<BN>` of each of [`TA_TYPES`]; empty
    /// unless `FERRITE_MMW_TA` is on.
    ta: Vec<(Tiles, Tiles)>,
    /// `mmw_ta_<type>_w` and `mmw_ta_swiglu_<type>_w`, the [`TA_WIDE`] tile, likewise.
    ta_w: Vec<(CudaFunction, CudaFunction)>,
    /// `mmw_ta_<type>_wk` and `mmw_ta_<type>_wk4`: that tile with K split between a
    /// cluster's two and four blocks ([`Tile::TaWideK`]), likewise.
    ta_wk: Vec<(CudaFunction, CudaFunction)>,
    /// The wide tile's blocks resident at once in clusters of 2 and of 4
    /// (`cuOccupancyMaxActiveClusters` × the cluster size, of the first `ta_wk` pair; 0 where
    /// unknown): one block an SM, but a cluster's blocks share a GPC, so clusters of four may
    /// leave SMs idle ([`Tile::split_k`] counts its waves by these).
    ta_wave_slots: [usize; 2],
    /// `mmw_ta_<type>_ck`: the concatenated 192-output tile ([`TA_CAT`]), likewise.
    ta_ck: Vec<CudaFunction>,
    /// `mmw_x_f16`: x into the scratch as f16, for the TA form's F16 weights.
    x_f16: Option<CudaFunction>,
    /// `mmw_moe_x_gather`: a MoE prefill's x rows in list order as bf16 (under [`gu_xt`]).
    x_gather: Option<CudaFunction>,
    /// `mmw_rsw_<type>_n256` and `mmw_rsw_swiglu_<type>_n256` under [`rsw`], for
    /// [`rsw_types`] in order ([`rsw_index`]).
    rsw: Option<Vec<(CudaFunction, CudaFunction)>>,
    /// `mmw_rsw_q4_k_q6_k_n256`: the [`MIXED`] Q, K, V (its one entry) on the RS wide tile,
    /// under [`rsw`] and [`rs_q6`] where `FERRITE_MMW_RSW_MIXED` is 1 (the default).
    rsw_mixed: Option<CudaFunction>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self> {
        let off = Kernels {
            mm: Vec::new(),
            swiglu: Vec::new(),
            mixed: Vec::new(),
            moe: Vec::new(),
            moe_tile: moe_form(1).1,
            ta: Vec::new(),
            ta_w: Vec::new(),
            ta_wk: Vec::new(),
            ta_ck: Vec::new(),
            ta_wave_slots: [0; 2],
            x_f16: None,
            x_gather: None,
            rsw: None,
            rsw_mixed: None,
        };
        if arch != "compute_90a" || mode() == 0 {
            return Ok(off);
        }
        let m = load_module(ctx, arch, "mmw", SRC)?;
        ctx.bind_to_thread()?;
        // Kernel `name` with its dynamic shared-memory limit raised to `bytes`.
        let with_smem = |name: String, bytes: usize| -> Result<CudaFunction> {
            let f = function(&m, &name)?;
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .with_context(|| format!("{name}: raising the shared-memory limit"))?;
            Ok(f)
        };
        let tiles = |family: &str| -> Result<Tiles> {
            let g =
                |(tm, bn): (usize, usize)| with_smem(format!("mmw_{family}_n{bn}"), smem(tm, bn));
            Ok([g(TILES[0])?, g(TILES[1])?, g(TILES[2])?])
        };
        let moe_mode = super::switches::int_or("FERRITE_MMW_MOE", 4);
        let (family, moe_tile) = moe_form(moe_mode.min(2));
        let moe = if moe_mode != 0 {
            TYPES
                .iter()
                .map(|&(t, n)| -> Result<[MoeFn; 2]> {
                    // FERRITE_MMW_MOE=3: the RS Q4_K experts, and the Q6_K ones under
                    // FERRITE_MMW_RS_Q6_MOE=2, on `mmw_moe3_*` (one producer warpgroup, three
                    // blocks an SM), every other type on moe2's.
                    let three = moe_mode >= 3
                        && rs()
                        && (t == GgmlType::Q4K || (t == GgmlType::Q6K && rs_q6_moe() == 2));
                    // FERRITE_MMW_MOE=4 (the default): those on 160-thread blocks, one producer
                    // warp (`mmw_moe4w_*` for Q4_K, `mmw_moe3w_*` for Q6_K; MOE.md 49th session).
                    let warp = moe_mode == 4;
                    let g = |part: &str| -> Result<MoeFn> {
                        Ok(if three {
                            let q6 = t == GgmlType::Q6K;
                            let (form, smem, threads) = match (warp, q6) {
                                (false, false) => ("moe3", MOE3_SMEM, threads_p(moe_tile.0, 1)),
                                (false, true) => ("moe3", MOE3_SMEM_Q6, threads_p(moe_tile.0, 1)),
                                (true, false) => ("moe4w", MOE4W_SMEM, threads_p(moe_tile.0, 0)),
                                (true, true) => ("moe3w", MOE3_SMEM_Q6, threads_p(moe_tile.0, 0)),
                            };
                            MoeFn {
                                f: with_smem(format!("mmw_{form}_{part}_{n}_n{MOE_TN}"), smem)?,
                                threads,
                                smem,
                            }
                        } else {
                            MoeFn {
                                f: with_smem(
                                    format!("mmw_{family}_{part}_{n}_n{MOE_TN}"),
                                    moe_tile.1,
                                )?,
                                threads: threads(moe_tile.0),
                                smem: moe_tile.1,
                            }
                        })
                    };
                    Ok([g("gu")?, g("down")?])
                })
                .collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let ta_wk = per_ta_type(|n| {
            Ok((
                with_smem(format!("mmw_ta_{n}_wk"), TA_WIDE_SMEM)?,
                with_smem(format!("mmw_ta_{n}_wk4"), TA_WIDE_SMEM)?,
            ))
        })?;
        // Asked only where the four-way split may be taken; a failed query leaves 0 (the SM
        // count is used instead).
        let ta_wave_slots = match ta_wk.first().filter(|_| ta_ks() == 4) {
            Some((k2, k4)) => [(k2, 2u32), (k4, 4)].map(|(f, ks)| {
                Tile::TaWideK(ks)
                    .config(512, 48)
                    .ok()
                    .and_then(|cfg| super::launch::max_active_clusters(f, cfg, (1, 1, ks)).ok())
                    .map_or(0, |n| n as usize * ks as usize)
            }),
            None => [0; 2],
        };
        tracing::debug!(
            "mmw: the wide TA tile's blocks resident in clusters of 2 and 4: {ta_wave_slots:?}"
        );
        Ok(Kernels {
            mm: TYPES.iter().map(|(_, n)| tiles(n)).collect::<Result<_>>()?,
            swiglu: TYPES
                .iter()
                .map(|(_, n)| tiles(&format!("swiglu_{n}")))
                .collect::<Result<_>>()?,
            mixed: MIXED
                .iter()
                .map(|(_, _, n)| tiles(n))
                .collect::<Result<_>>()?,
            moe,
            moe_tile,
            ta: per_ta_type(|n| {
                Ok((
                    tiles(&format!("ta_{n}"))?,
                    tiles(&format!("ta_swiglu_{n}"))?,
                ))
            })?,
            ta_w: per_ta_type(|n| {
                Ok((
                    with_smem(format!("mmw_ta_{n}_w"), TA_WIDE_SMEM)?,
                    with_smem(format!("mmw_ta_swiglu_{n}_w"), TA_WIDE_SMEM)?,
                ))
            })?,
            ta_wk,
            ta_ck: per_ta_type(|n| with_smem(format!("mmw_ta_{n}_ck"), TA_CAT_SMEM))?,
            ta_wave_slots,
            x_f16: if ta() {
                Some(function(&m, "mmw_x_f16")?)
            } else {
                None
            },
            x_gather: if gu_xt() {
                Some(function(&m, "mmw_moe_x_gather")?)
            } else {
                None
            },
            rsw: if rsw() {
                let (tm, bn) = TILES[2];
                let pair = |n: &str| -> Result<(CudaFunction, CudaFunction)> {
                    Ok((
                        with_smem(format!("mmw_rsw_{n}_n256"), smem(tm, bn))?,
                        with_smem(format!("mmw_rsw_swiglu_{n}_n256"), smem(tm, bn))?,
                    ))
                };
                Some(
                    rsw_types()
                        .iter()
                        .map(|&(_, n)| pair(n))
                        .collect::<Result<Vec<_>>>()?,
                )
            } else {
                None
            },
            rsw_mixed: if rsw() && rs_q6() && rsw_mixed() {
                let (tm, bn) = TILES[2];
                Some(with_smem(
                    format!("mmw_rsw_{}_n256", MIXED[0].2),
                    smem(tm, bn),
                )?)
            } else {
                None
            },
        })
    }
}

/// `FERRITE_MMW` (read once): 0 off, 1 on (the default), 2 on without the 64 × 256 tile.
fn mode() -> i64 {
    static MODE: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| super::switches::int_or("FERRITE_MMW", 1))
}

/// Index in [`TYPES`] of the kernel for `w` on `rows` rows, or `None` when this path does not
/// apply (see the module comment).
fn kernel_index(be: &CudaBackend, w: &CudaWeight, rows: usize) -> Option<usize> {
    if be.mmw.mm.is_empty() || rows <= GEMV_MAX_ROWS || w.shape.len() != 2 {
        return None;
    }
    let (n_out, n_in) = (w.shape[0], w.shape[1]);
    if n_out <= F32_SMALL_OUT || n_in == 0 || n_in % w.dtype.block_size() != 0 {
        return None;
    }
    let ti = TYPES.iter().position(|&(t, _)| t == w.dtype)?;
    if rs() && rs_type(w.dtype, false) && !rs_mappable(w, false) {
        return None; // the RS kernels of its type read it by tensor maps (matmul.rs mm_ instead)
    }
    // 16-byte loads need a 16-byte aligned base (cudaMalloc gives 256).
    let (ptr, _g) = w.data.device_ptr(&be.stream);
    (ptr % 16 == 0).then_some(ti)
}

/// `load(name)` for each of [`TA_TYPES`] in order (the TA kernel lists, indexed as
/// [`ta_index`]), or none where `FERRITE_MMW_TA` is off.
fn per_ta_type<T>(load: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    if !ta() {
        return Ok(Vec::new());
    }
    TA_TYPES.iter().map(|(_, n)| load(n)).collect()
}

/// Index in [`TA_TYPES`] of the TA kernels for `w` (already on this path: [`kernel_index`]),
/// or `None` where they do not apply (switched off, another type, rows not a whole number
/// of 16-byte units, a weight in host memory).
fn ta_index(be: &CudaBackend, w: &CudaWeight) -> Option<usize> {
    if be.mmw.ta.is_empty()
        || w.shape.len() != 2
        || !w.shape[1].is_multiple_of(8)
        || w.in_host_memory()
    {
        return None;
    }
    TA_TYPES.iter().position(|&(t, _)| t == w.dtype)
}

/// `f(scratch, kp)` on x converted for a launch family: f16 for the TA form's F16 weights
/// (`ta` naming F16 in [`TA_TYPES`]), bf16 otherwise (matmul.rs `with_bf16_rows`).
fn with_x<R>(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    ta: Option<usize>,
    f: impl FnOnce(&CudaSlice<u16>, usize) -> Result<R>,
) -> Result<R> {
    match (ta, &be.mmw.x_f16) {
        (Some(t), Some(cvt)) if TA_TYPES[t].0 == GgmlType::F16 => super::matmul::with_scratch_rows(
            be,
            &x.buf,
            x.rows,
            x.cols,
            (cvt, super::matmul::X16::F16),
            f,
        ),
        _ => super::matmul::with_bf16(be, x, f),
    }
}

/// The 16-bit x form in which the prefill matmuls of `ws` on `rows` rows read x, where every one
/// of them takes it from the 16-bit scratch on this path (no exact int8 prefill, a kernel for
/// each weight): f16 where all are F16 weights on the TA form ([`with_x`]), bf16 otherwise. A
/// norm whose readers are these matmuls alone may then write only that x (ops.rs
/// `x16_only`). `None` where any weight goes elsewhere (mmq.rs, matmul.rs's GEMVs, a
/// weight no kernel here takes). [`matmuls`], [`matmul_swiglu`] and [`swiglu_mlp`] choose
/// their form as here; matmul.rs `with_scratch_rows` errors if one does not take the
/// hand-over after all.
pub(crate) fn x16_readers(
    be: &CudaBackend,
    ws: &[&CudaWeight],
    rows: usize,
) -> Option<super::matmul::X16> {
    if ws.is_empty()
        || ws
            .iter()
            .any(|w| super::mmq::takes(be, w, rows) || kernel_index(be, w, rows).is_none())
    {
        return None;
    }
    let ta = ta_index(be, ws[0]).filter(|&t| ws.iter().all(|w| ta_index(be, w) == Some(t)));
    Some(match (ta, &be.mmw.x_f16) {
        (Some(t), Some(_)) if TA_TYPES[t].0 == GgmlType::F16 => super::matmul::X16::F16,
        _ => super::matmul::X16::Bf16,
    })
}

/// Whether a matmul takes the 64 × 256 tile: more than 128 rows (a 256-token tile at least
/// half full) and a 128 × 128 grid that fills at least half the SMs (the smaller grids keep
/// more blocks with the 128-output tiles).
fn wide_tile(rows: usize, n_out: usize, sm_count: usize) -> bool {
    rows > 128 && 2 * rows.div_ceil(128) * n_out.div_ceil(TM) >= sm_count.max(1)
}

/// `out = W x` on the wgmma kernel when this path applies (`Ok(false)`, nothing done,
/// otherwise: the caller runs matmul.rs).
pub fn matmul(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    matmuls(be, x, &[w], &mut [out])
}

/// `outs[i] = ws[i] x` for weights reading the same x: x converted to bf16 once, runs of up to
/// three weights of one type in one launch. Returns `Ok(false)`, having done nothing, unless
/// this path applies to every weight.
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
    // The TA form where it applies to every weight (one type: one x scratch format).
    let ta = ta_index(be, ws[0]).filter(|&t| ws.iter().all(|w| ta_index(be, w) == Some(t)));
    with_x(be, x, ta, |xb, kp| {
        if let Some(t) = ta {
            for (wg, og) in ws.chunks(3).zip(outs.chunks_mut(3)) {
                if !super::blas::gemms(be, xb, kp, x.rows, wg, og, TA_TYPES[t].0, false)? {
                    launch(be, xb, kp, x.rows, wg, &be.mmw.ta[t].0, og, Some(t))?;
                }
            }
            return Ok(());
        }
        let mut i = 0;
        while i < ws.len() {
            // Three weights whose types have a mixed kernel, else a run of up to three of one
            // type.
            let mixed = (fuse() & 1 != 0
                && i + 3 <= ws.len()
                && tis[i + 1] == tis[i]
                && tis[i + 2] != tis[i])
                .then(|| {
                    MIXED
                        .iter()
                        .position(|&(a, b, _)| a == ws[i].dtype && b == ws[i + 2].dtype)
                })
                .flatten();
            let (j, kernels) = match mixed {
                Some(m) => (i + 3, &be.mmw.mixed[m]),
                None => {
                    let mut j = i + 1;
                    while j < ws.len() && j - i < 3 && tis[j] == tis[i] {
                        j += 1;
                    }
                    (j, &be.mmw.mm[tis[i]])
                }
            };
            launch(
                be,
                xb,
                kp,
                x.rows,
                &ws[i..j],
                kernels,
                &mut outs[i..j],
                None,
            )?;
            i = j;
        }
        Ok(())
    })?;
    Ok(true)
}

/// `act = silu(gate · x) ⊙ (up · x)` in one launch per tile when this path applies to both
/// weights (same type and shape); `Ok(false)`, nothing done, otherwise. The two matmuls' MMAs
/// and the elementwise swiglu's expression (see `mmw_row` in mmw.cu), without writing or
/// re-reading gate and up, and with x converted once.
pub fn matmul_swiglu(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    gate: &CudaWeight,
    up: &CudaWeight,
    act: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    swiglu(be, x, gate, up, act, None)
}

/// `out = down · SwiGLU(x)` where the gate/up launch can hand the down its x (the TA form, the
/// down of the gate's type, its K whole steps): that launch writes h as the down's 16-bit x
/// rows into `act`'s first bytes (`hbf`, mmw.cu; the rounding of the conversion it replaces,
/// so `out` is bitwise the composition's), in place of the f32 rows the down converted, and the
/// down reads them there. Per Qwen3-8B F16 layer at 512 rows that is 24 MB of f32 written and
/// read and 12 MB of f16 written by a launch of its own, against 12 MB written by the gate/up
/// (MATMUL.md round 96). `Ok(false)`, nothing done, where it does not apply.
///
/// With `residual`, the down's output is added to it instead (`residual += down · h`, `out`
/// scratch): in cuBLASLt's epilogue where it takes the down ([`adds_in_epilogue`]), else
/// mmw's launch into `out` and an `add_assign`.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_mlp(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    gate: &CudaWeight,
    up: &CudaWeight,
    down: &CudaWeight,
    act: &mut Act<CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
    residual: Option<&mut Act<CudaSlice<f32>>>,
) -> Result<bool> {
    if !hx() {
        return Ok(false);
    }
    let (rows, n_ff) = (x.rows, gate.shape[0]);
    let Some(td) = kernel_index(be, down, rows).and_then(|_| ta_index(be, down)) else {
        return Ok(false);
    };
    // swiglu() does nothing unless gate and up are on the TA form of the down's type.
    if down.shape[1] != n_ff || !n_ff.is_multiple_of(TK) || !swiglu(be, x, gate, up, act, Some(td))?
    {
        return Ok(false);
    }
    // SAFETY: the view is act's first rows · n_ff · 2 bytes (act holds rows · n_ff floats:
    // checked by the launch), which the gate/up launch wrote as 16-bit rows; nothing writes
    // act while the down reads it (one stream).
    let hb = unsafe { act.buf.transmute::<u16>(rows * n_ff) }
        .context("mmw: 16-bit view of the SwiGLU output")?;
    down_launch(be, &hb, n_ff, rows, down, td, out, residual)?;
    Ok(true)
}

/// `out = x · wᵀ` for one TA-form weight (`td` its index in [`TA_TYPES`]) on x in the 16-bit
/// scratch `xb`: cuBLASLt where it takes it, else mmw's launch. With `residual`, `residual +=
/// x · wᵀ` instead (`out` scratch): cuBLASLt's epilogue adds it, or mmw writes `out` and an
/// `add_assign` adds it.
#[allow(clippy::too_many_arguments)]
fn down_launch<X: DevicePtr<u16>>(
    be: &CudaBackend,
    xb: &X,
    kp: usize,
    rows: usize,
    w: &CudaWeight,
    td: usize,
    out: &mut Act<CudaSlice<f32>>,
    residual: Option<&mut Act<CudaSlice<f32>>>,
) -> Result<()> {
    let t16 = TA_TYPES[td].0;
    let mmw = |y: &mut Act<CudaSlice<f32>>| {
        launch(be, xb, kp, rows, &[w], &be.mmw.ta[td].0, &mut [y], Some(td))
    };
    match residual {
        Some(res) => {
            if super::blas::gemms(be, xb, kp, rows, &[w], &mut [&mut *res], t16, true)? {
                return Ok(());
            }
            mmw(out)?;
            super::ops::add_assign(be, res, out)
        }
        None => {
            if super::blas::gemms(be, xb, kp, rows, &[w], &mut [&mut *out], t16, false)? {
                return Ok(());
            }
            mmw(out)
        }
    }
}

/// `out += x · wᵀ` at prefill rows for a 16-bit weight on the TA form (`y` scratch): the residual
/// added in cuBLASLt's epilogue ([`down_launch`]). `Ok(false)`, nothing done, where this path
/// does not take `w` (the caller composes matmul and add).
pub fn matmul_add(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
    y: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    if !adds_in_epilogue(be, w, x.rows) {
        return Ok(false);
    }
    let Some(t) = ta_index(be, w) else {
        return Ok(false);
    };
    crate::check_matmul(x, &w.shape, out)?;
    crate::check_matmul(x, &w.shape, y)?;
    check_weight(w)?;
    with_x(be, x, Some(t), |xb, kp| {
        down_launch(be, xb, kp, x.rows, w, t, y, Some(out))
    })?;
    Ok(true)
}

/// Whether a prefill projection of `w` on `rows` rows that adds to the residual can add it in
/// cuBLASLt's epilogue (a 16-bit weight on the TA form, single 16-bit GEMMs on cuBLASLt:
/// `FERRITE_CUBLASLT` bit 0, and `FERRITE_LT_ADD`, on by default): the decoder then runs
/// [`matmul_add`] / the down with a residual and a plain RMSNorm after, instead of the
/// projection and an add + RMSNorm (MATMUL.md round 102). A call cuBLASLt turns down after all
/// (the first, where the library is missing; a shape it cannot plan) still adds, by mmw and
/// `add_assign`.
pub(crate) fn adds_in_epilogue(be: &CudaBackend, w: &CudaWeight, rows: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_LT_ADD", 1) != 0)
        && super::blas::mode() & 1 != 0
        // Not where cuBLASLt could not start (no library): mmw and an add would run instead.
        && be.blas.get().is_none_or(Option::is_some)
        && matches!(w.dtype, GgmlType::F16 | GgmlType::BF16)
        && !super::mmq::takes(be, w, rows)
        && kernel_index(be, w, rows).is_some()
        && ta_index(be, w).is_some()
}

/// [`matmul_swiglu`]; with `h16` (an index in [`TA_TYPES`]: the TA form of that type, or
/// nothing done) h written as the down's 16-bit x rows ([`swiglu_mlp`]).
fn swiglu(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    gate: &CudaWeight,
    up: &CudaWeight,
    act: &mut Act<CudaSlice<f32>>,
    h16: Option<usize>,
) -> Result<bool> {
    if gate.dtype != up.dtype || gate.shape != up.shape || fuse() & 2 == 0 {
        return Ok(false);
    }
    let (Some(ti), Some(_)) = (kernel_index(be, gate, x.rows), kernel_index(be, up, x.rows)) else {
        return Ok(false);
    };
    crate::check_matmul(x, &gate.shape, act)?;
    let (n_out, n_in) = (gate.shape[0], gate.shape[1]);
    let rb = gate.row_bytes();
    for w in [gate, up] {
        check_weight(w)?;
    }
    let rows = x.rows;
    ensure!(
        act.buf.len() >= rows * n_out && rows * n_out <= isize::MAX as usize,
        "mmw: swiglu output buffer smaller than [{rows}, {n_out}]"
    );
    // The tile rule counts gate and up rows together (2 n_out), as the grouped launch would;
    // a block covers tm / 2 outputs.
    let ta = ta_index(be, gate).filter(|&t| ta_index(be, up) == Some(t));
    if h16.is_some() && ta != h16 {
        return Ok(false);
    }
    // The tile: the TA form's own rule (its 128 × 256 tile among them) or the quantized one.
    let tile = Tile::pick(ta.is_some(), rows, 2 * n_out, be.sm_count);
    let (tm, bn) = tile.dims();
    let mut cfg = tile.config(rows, n_out.div_ceil(tm / 2))?;
    // Q4_K on the wide tile under FERRITE_MMW_RSW: the register-A form's kernel.
    let rsw = be
        .mmw
        .rsw
        .as_ref()
        .zip(rsw_index(gate.dtype))
        .filter(|_| tile == Tile::Std(2))
        .map(|(k, r)| &k[r].1);
    if rsw.is_some() {
        cfg.block_dim.0 = RSW_THREADS;
    }
    with_x(be, x, ta, |xb, kp| {
        let (rb_i, n_out_i, n_in_i, kp_i, rows_i) =
            (rb as i64, n_out as i32, n_in as i32, kp as i32, rows as i32);
        let map = (xtma() || ta.is_some())
            .then(|| x_map(be, xb, rows, kp, bn))
            .transpose()?;
        let kernel = match (ta, rsw, tile.index()) {
            (Some(t), _, None) => &be.mmw.ta_w[t].1,
            (Some(t), _, Some(i)) => &be.mmw.ta[t].1[i],
            (None, Some(k), _) => k,
            (None, None, i) => &be.mmw.swiglu[ti][i.context("mmw: the wide TA tile without TA")?],
        };
        let mut launch = be.stream.kernel(kernel);
        launch
            .arg(&*gate.data)
            .arg(&*up.data)
            .arg(&rb_i)
            .arg(&n_out_i)
            .arg(&n_in_i)
            .arg(xb)
            .arg(&kp_i)
            .arg(&rows_i)
            .arg(&mut act.buf);
        if let Some(map) = &map {
            launch.arg(map);
        }
        // The RS kernels' weight maps: gate's and up's, boxes of a tile's tm / 2 rows; the TA
        // kernels' likewise, one a weight.
        let box_rows = tm / 2;
        let wm = if rs() && ta.is_none() {
            Some((
                w_maps(be, gate, box_rows, false)?,
                w_maps(be, up, box_rows, false)?,
            ))
        } else {
            None
        };
        if let Some((g, u)) = &wm {
            launch.arg(&g[0]).arg(&g[1]).arg(&u[0]).arg(&u[1]);
        }
        let am = if ta.is_some() {
            Some((a16_map(be, gate, box_rows)?, a16_map(be, up, box_rows)?))
        } else {
            None
        };
        let hbf = h16.is_some() as i32;
        if let Some((g, u)) = &am {
            launch.arg(g).arg(u).arg(&hbf);
        }
        // SAFETY: checked above: gate and up hold n_out rows of rb bytes each, xb rows×kp
        // bf16 (zero beyond n_in; the map describes it), act rows×n_out floats; blocks cover
        // n_out outputs by tm / 2.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    })?;
    Ok(true)
}

/// `FERRITE_MMW_FUSE` (read once), a bit mask, 3 by default: bit 0 takes the [`MIXED`]
/// kernels (without it a mixed group is two launches), bit 1 fuses a prefill's gate, up and
/// SwiGLU into one launch (without it: the two matmuls in one grouped launch, then the
/// elementwise kernel).
fn fuse() -> i64 {
    static MODE: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| super::switches::int_or("FERRITE_MMW_FUSE", 3))
}

/// Whether `w`'s buffer holds its `[n_out, n_in]` rows.
fn check_weight(w: &CudaWeight) -> Result<()> {
    let (n_out, n_in, rb) = (w.shape[0], w.shape[1], w.row_bytes());
    ensure!(
        w.data.len() >= n_out * rb,
        "mmw: weight buffer holds {} bytes, [{n_out}, {n_in}] {} needs {}",
        w.data.len(),
        w.dtype,
        n_out * rb
    );
    Ok(())
}

/// Index in [`TILES`] of the tile for a launch of `n_total` outputs on `rows` rows.
fn tile_index(rows: usize, n_total: usize, sm_count: usize) -> usize {
    if mode() == 1 && wide_tile(rows, n_total, sm_count) {
        2
    } else if super::matmul::token_tile(rows, n_total, sm_count) == 128 {
        0
    } else {
        1
    }
}

/// One launch of a `kernels` family (`mmw_<type>_n<BN>`, a [`MIXED`] one, or with `ta` (the
/// index in [`TA_TYPES`]) a `mmw_ta_<type>_n<BN>`, or its [`TA_WIDE`] `mmw_ta_<type>_w` where
/// [`Tile::pick`] picks it) on the x in `xb` (`rows` rows of `kp`; bf16, or f16 for the TA form's
/// F16) for 1–3 weights (one grid over their output tiles in order).
#[allow(clippy::too_many_arguments)]
fn launch<X: DevicePtr<u16>>(
    be: &CudaBackend,
    xb: &X,
    kp: usize,
    rows: usize,
    ws: &[&CudaWeight],
    kernels: &Tiles,
    outs: &mut [&mut Act<CudaSlice<f32>>],
    ta_t: Option<usize>,
) -> Result<()> {
    let ta = ta_t.is_some();
    ensure!(
        (1..=3).contains(&ws.len()) && ws.len() == outs.len(),
        "mmw: a group of {} weights",
        ws.len()
    );
    let n_in = ws[0].shape[1];
    ensure!(
        xb.len() >= rows * kp,
        "mmw: bf16 scratch smaller than [{rows}, {kp}]"
    );
    let mut wp = [0u64; 3];
    let mut rbs = [0i64; 3];
    let mut ns = [0i32; 3];
    let mut op = [0u64; 3];
    let mut n_total = 0;
    for (g, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        let n_out = w.shape[0];
        let rb = w.row_bytes();
        ensure!(
            w.shape[1] == n_in && (g == 2 || w.dtype == ws[0].dtype),
            "mmw: grouped weights differ in row length, or weights 0 and 1 in type"
        );
        ensure!(
            out.rows == rows && out.cols == n_out && out.buf.len() >= rows * n_out,
            "mmw: output [{}, {}] (buffer {}) for [{rows}, {n_in}] x [{n_out}, {n_in}]",
            out.rows,
            out.cols,
            out.buf.len()
        );
        check_weight(w)?;
        ensure!(
            n_out <= i32::MAX as usize && rows * n_out <= isize::MAX as usize,
            "mmw: [{rows}, {n_out}] output too large"
        );
        wp[g] = w.data.device_ptr(&be.stream).0;
        rbs[g] = rb as i64;
        ns[g] = n_out as i32;
        op[g] = out.buf.device_ptr_mut(&be.stream).0;
        n_total += n_out;
    }
    // Absent weights: weight 0's pointers, never reached (their tile ranges are empty).
    for g in ws.len()..3 {
        wp[g] = wp[0];
        rbs[g] = rbs[0];
        op[g] = op[0];
    }
    // The tile: the TA form's own rule (its 128 × 256 tile among them) or the quantized one.
    let tile = Tile::pick(ta, rows, n_total, be.sm_count);
    let tiles = ns.map(|n| (n as usize).div_ceil(tile.dims().0));
    let (e1, e2) = (tiles[0], tiles[0] + tiles[1]);
    // The TA 128-output tiles: the wide one with K split where that fills the SMs (its
    // outputs a block are theirs, 128, so the output tiles stay).
    let tile = if ta {
        tile.split_k(
            rows,
            e2 + tiles[2],
            kp / TK,
            be.sm_count,
            be.mmw.ta_wave_slots,
        )
    } else {
        tile
    };
    if let (Some(t), Tile::TaWideK(2)) = (ta_t, tile) {
        let ns_u = ns.map(|n| n as usize);
        let wide_blocks = 2 * rows.div_ceil(TA_WIDE.1) * (e2 + tiles[2]);
        if cat_tile(ta_cat(), rows, &ns_u[..ws.len()], wide_blocks, be.sm_count) {
            return launch_cat(be, xb, kp, rows, ws, &ns, &op, t);
        }
    }
    let (tm, bn) = tile.dims();
    let mut cfg = tile.config(rows, e2 + tiles[2])?;
    // On the wide tile, the register-A form's kernel where there is one: `mmw_rsw_<type>` for a
    // group of one RS type (FERRITE_MMW_RSW), `mmw_rsw_q4_k_q6_k` for the mixed Q, K, V (each
    // block the form of its weight's type).
    let mut kernel = match (ta_t, tile.index()) {
        (Some(t), None) if tile == Tile::TaWideK(2) => &be.mmw.ta_wk[t].0,
        (Some(t), None) if tile == Tile::TaWideK(4) => &be.mmw.ta_wk[t].1,
        (Some(t), None) => &be.mmw.ta_w[t].0,
        (_, Some(i)) => &kernels[i],
        (None, None) => bail!("mmw: the wide TA tile without TA"),
    };
    if tile == Tile::Std(2) && !ta {
        let rs_kernel = if ws.iter().all(|w| w.dtype == ws[0].dtype) {
            be.mmw
                .rsw
                .as_ref()
                .zip(rsw_index(ws[0].dtype))
                .map(|(rsw, r)| &rsw[r].0)
        } else if ws.len() == 3
            && ws[1].dtype == ws[0].dtype
            && (ws[0].dtype, ws[2].dtype) == (MIXED[0].0, MIXED[0].1)
        {
            be.mmw.rsw_mixed.as_ref()
        } else {
            None
        };
        if let Some(f) = rs_kernel {
            kernel = f;
            cfg.block_dim.0 = RSW_THREADS;
        }
    }
    let (e1_i, e2_i, n_in_i, kp_i, rows_i) =
        (e1 as i32, e2 as i32, n_in as i32, kp as i32, rows as i32);
    let map = (xtma() || ta)
        .then(|| x_map(be, xb, rows, kp, bn))
        .transpose()?;
    // xb's device address (a slice or a view), held across the launch.
    let (xp, _xb_guard) = xb.device_ptr(&be.stream);
    let mut launch = be.stream.kernel(kernel);
    if let Tile::TaWideK(ks) = tile {
        // The K parts' blocks: one cluster along the grid's z.
        launch.cluster((1, 1, ks));
    }
    launch
        .arg(&wp[0])
        .arg(&wp[1])
        .arg(&wp[2])
        .arg(&rbs[0])
        .arg(&rbs[1])
        .arg(&rbs[2])
        .arg(&ns[0])
        .arg(&ns[1])
        .arg(&ns[2])
        .arg(&e1_i)
        .arg(&e2_i)
        .arg(&n_in_i)
        .arg(&xp)
        .arg(&kp_i)
        .arg(&rows_i)
        .arg(&op[0])
        .arg(&op[1])
        .arg(&op[2]);
    if let Some(map) = &map {
        launch.arg(map);
    }
    // The RS kernels' weight maps, three weights' (absent ones: the last present weight's,
    // never read).
    let wm = if rs() && !ta {
        (0..3)
            .map(|g| w_maps(be, ws[g.min(ws.len() - 1)], tm, false))
            .collect::<Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    for pair in &wm {
        launch.arg(&pair[0]).arg(&pair[1]);
    }
    // The TA kernels' weight maps, boxes of the tile's rows (absent weights: as above).
    let am = if ta {
        (0..3)
            .map(|g| a16_map(be, ws[g.min(ws.len() - 1)], tm))
            .collect::<Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    for m in &am {
        launch.arg(m);
    }
    // SAFETY: checked above: each W holds n_out rows of rb bytes, xb rows×kp bf16 (zero beyond
    // n_in; the map describes it), each out rows×n_out floats; block y < e1 uses weight 0,
    // < e2 weight 1, else 2, and only the present weights have tiles.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// [`launch`]'s group on the concatenated tile ([`TA_CAT`], `mmw_ta_<type>_ck`): `ns` and `op`
/// its weights' outputs and output pointers as [`launch`] filled them (absent weights: 0
/// outputs, never reached).
#[allow(clippy::too_many_arguments)]
fn launch_cat<X: DevicePtr<u16>>(
    be: &CudaBackend,
    xb: &X,
    kp: usize,
    rows: usize,
    ws: &[&CudaWeight],
    ns: &[i32; 3],
    op: &[u64; 3],
    t: usize,
) -> Result<()> {
    let n_total: usize = ns.iter().map(|&n| n as usize).sum();
    let out_tiles = n_total.div_ceil(TA_CAT.0);
    ensure!(
        out_tiles <= 65535 && kp / TK >= 2,
        "mmw: the concatenated tile for {n_total} outputs and K of {kp}"
    );
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(TA_CAT.1) as u32, out_tiles as u32, 2),
        block_dim: (TA_CAT_THREADS, 1, 1),
        shared_mem_bytes: TA_CAT_SMEM as u32,
    };
    let map = x_map(be, xb, rows, kp, TA_CAT.1)?;
    // Boxes of 64 rows (absent weights: the last present weight's map, never read).
    let am = (0..3)
        .map(|g| a16_map(be, ws[g.min(ws.len() - 1)], 64))
        .collect::<Result<Vec<_>>>()?;
    let (kp_i, rows_i) = (kp as i32, rows as i32);
    // xb held across the launch (its map has the address).
    let (_xp, _xb_guard) = xb.device_ptr(&be.stream);
    let mut launch = be.stream.kernel(&be.mmw.ta_ck[t]);
    // The K halves' blocks: one cluster along the grid's z.
    launch.cluster((1, 1, 2));
    launch
        .arg(&ns[0])
        .arg(&ns[1])
        .arg(&ns[2])
        .arg(&kp_i)
        .arg(&rows_i)
        .arg(&op[0])
        .arg(&op[1])
        .arg(&op[2])
        .arg(&map)
        .arg(&am[0])
        .arg(&am[1])
        .arg(&am[2]);
    // SAFETY: as [`launch`]'s: each weight holds ns[g] rows (multiples of 64, [`cat_tile`]) of
    // 2 · n_in bytes that its map describes, x rows × kp 16-bit (its map), each out rows ×
    // ns[g] floats; a tile's rows past the last weight's read weight 0's first rows and are not
    // stored.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Pairs per tile of the grouped expert GEMMs: moe.cu's `GM_TN`, whose tile table
/// (`moe_sort`) they read.
pub(crate) const MOE_TN: usize = 64;
/// The grouped GEMMs' kernel family under `FERRITE_MMW_MOE` = `mode` (1 or 2) and its tile:
/// outputs a block and dynamic shared memory. 2 (and under the default 3, every type but the
/// RS Q4_K and Q6_K experts'): `mmw_moe2_*`, 64 outputs (one
/// consumer warpgroup) with MmwShape<64, 64, 2>'s 96 KB of stages, two blocks an SM; 1:
/// `mmw_moe_*`, 128 outputs (two consumer warpgroups), one block an SM.
fn moe_form(mode: i64) -> (&'static str, (usize, usize)) {
    if mode == 2 {
        ("moe2", (64, ring_smem(64, MOE_TN, 96 * 1024)))
    } else {
        ("moe", (TM, smem(TM, MOE_TN)))
    }
}

/// A grouped expert GEMM's kernel with its block size and dynamic shared memory (the
/// `FERRITE_MMW_MOE=3` form's differ from moe2's).
pub(crate) struct MoeFn {
    f: CudaFunction,
    threads: u32,
    smem: usize,
}

/// The stages' budget of the three-blocks-an-SM form (mmw.cu MMW_MOE3_BUDGET) and its dynamic
/// shared memory: six stages of 64 raw RS Q4_K A rows (48 bytes) and 64 bf16 x rows.
const MOE3_BUDGET: usize = 72 * 1024;
const MOE3_SMEM: usize = ring_smem_row(64, MOE_TN, MOE3_BUDGET, 48);
/// The same for the RS Q6_K experts (`FERRITE_MMW_RS_Q6_MOE=2`): three stages of raw A rows
/// of RS_Q6_QL + RS_Q6_HI bytes.
const MOE3_SMEM_Q6: usize = ring_smem_row(64, MOE_TN, MOE3_BUDGET, (RS_Q6_QL + RS_Q6_HI) as usize);
// Three moe3 blocks an SM: each its dynamic shared memory, 1 KB static (the kernel's barrier
// words and epilogue) and the 1 KB the driver reserves a block, in the SM's 228 KB.
const _: () = assert!(3 * (MOE3_SMEM + 2048) <= 228 * 1024 && MOE3_SMEM_Q6 <= MOE3_SMEM);
/// The four-blocks-an-SM form's (`mmw_moe4w_*`): its stages' budget (mmw.cu MMW_MOE4_BUDGET)
/// and shared memory, four 11 KB stages.
const MOE4W_BUDGET: usize = 48 * 1024;
const MOE4W_SMEM: usize = ring_smem_row(64, MOE_TN, MOE4W_BUDGET, 48);
const _: () = assert!(4 * (MOE4W_SMEM + 2048) <= 228 * 1024);

/// The tile table moe.cu's `moe_sort` writes (moe.rs `Scratch`): the per-expert list
/// offsets, the tile count, the tiles (expert, first list position) and the sorted pairs;
/// `max_tiles` the grid's worst case, `top_k` the pairs per token.
pub(crate) struct MoeTiles<'a> {
    pub offsets: &'a CudaSlice<i32>,
    pub n_tiles: &'a CudaSlice<i32>,
    pub tiles: &'a CudaSlice<i32>,
    pub list: &'a CudaSlice<i32>,
    pub max_tiles: usize,
    pub top_k: usize,
}

/// Index in [`TYPES`] of the grouped expert GEMMs for the gate, up and down experts `[g, u,
/// d]`, or `None` where they are not loaded (not sm_90a, `FERRITE_MMW=0`, `FERRITE_MMW_MOE=0`),
/// a type has none, or under the RS form an expert tensor of an RS type its tensor maps cannot
/// read (held in host memory, or rows not whole 16-byte units: moe.cu's mma.sync forms take
/// those).
pub(crate) fn moe_kernels(be: &CudaBackend, [g, u, d]: [&CudaWeight; 3]) -> Option<(usize, usize)> {
    if be.mmw.moe.is_empty()
        || (rs()
            && [g, u, d]
                .iter()
                .any(|w| rs_type(w.dtype, true) && !rs_mappable(w, true)))
    {
        return None;
    }
    let i = |t: GgmlType| TYPES.iter().position(|&(u, _)| u == t);
    Some((i(g.dtype)?, i(d.dtype)?))
}

/// The grid of a grouped expert GEMM: every tile the routing could yield by `out_tiles`
/// output tiles.
fn moe_config(k: &MoeFn, t: &MoeTiles<'_>, out_tiles: usize) -> Result<LaunchConfig> {
    ensure!(
        t.max_tiles < (1 << 31) && out_tiles <= 65535,
        "mmw: MoE grid of {} tiles by {out_tiles} is too large",
        t.max_tiles
    );
    Ok(LaunchConfig {
        grid_dim: (t.max_tiles as u32, out_tiles as u32, 1),
        block_dim: (k.threads, 1, 1),
        shared_mem_bytes: k.smem as u32,
    })
}

/// A MoE prefill's gate/up + SwiGLU on the wgmma pipeline: `h[p] = silu(gate_e x_t) ⊙ (up_e
/// x_t)` for every list position p of the tile table (pair list[p] = token t, slot; e its
/// expert), x (`rows × hidden` f32) converted to bf16 once. `g`, `u`: `[n_experts, ffn,
/// hidden]` of type `TYPES[ti]`; h holds `pairs × ffn` floats (checked by the caller, moe.rs).
/// `h_bf16`: h's rows written as bf16 instead (`pairs × ffn` uint16 at the buffer's start;
/// ffn a multiple of [`TK`]), which [`moe_down`] then reads as its x scratch: the f32 rows'
/// conversion (`mm_x_bf16`, the same rounding) saved, and half the bytes written (MOE.md,
/// 49th session). `xg`: scratch of at least `pairs × hidden` floats, free until the down (its
/// output), which holds x's rows gathered in list order under [`gu_xt`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_gate_up(
    be: &CudaBackend,
    ti: usize,
    x: &CudaSlice<f32>,
    (rows, hidden, ffn): (usize, usize, usize),
    g: &CudaWeight,
    u: &CudaWeight,
    t: &MoeTiles<'_>,
    h: &mut CudaSlice<f32>,
    h_bf16: bool,
    xg: &mut CudaSlice<f32>,
) -> Result<()> {
    ensure!(
        !h_bf16 || ffn.is_multiple_of(TK),
        "mmw: bf16 h rows need ffn ({ffn}) a multiple of {TK}"
    );
    let hbf = h_bf16 as i32;
    let k = &be.mmw.moe[ti][0];
    let cfg = moe_config(k, t, ffn.div_ceil(be.mmw.moe_tile.0 / 2))?;
    let (rb, n_out, n_in, tk) = (
        g.row_bytes() as i64,
        ffn as i32,
        hidden as i32,
        t.top_k as i32,
    );
    // The launch on x's bf16 rows at device address `xp` (rows of kp; `xmap`: their tensor map
    // under the gathered form, whose rows are in list order).
    let run = |xp: u64,
               kp: i32,
               xmap: Option<&cudarc::driver::sys::CUtensorMap>,
               h: &mut CudaSlice<f32>| {
        // The RS kernels' weight maps: gate's and up's experts, boxes of a tile's outputs.
        let wm = rs()
            .then(|| -> Result<_> {
                let box_rows = be.mmw.moe_tile.0 / 2;
                Ok((
                    w_maps(be, g, box_rows, true)?,
                    w_maps(be, u, box_rows, true)?,
                ))
            })
            .transpose()?;
        let mut launch = be.stream.kernel(&k.f);
        launch
            .arg(&*g.data)
            .arg(&*u.data)
            .arg(&rb)
            .arg(&n_out)
            .arg(&n_in)
            .arg(&xp)
            .arg(&kp)
            .arg(t.offsets)
            .arg(t.n_tiles)
            .arg(t.tiles)
            .arg(t.list)
            .arg(&tk)
            .arg(h)
            .arg(&hbf);
        if let Some(m) = xmap {
            launch.arg(m);
        }
        if let Some((gm, um)) = &wm {
            launch.arg(&gm[0]).arg(&gm[1]).arg(&um[0]).arg(&um[1]);
        }
        // SAFETY: the tile table comes from moe_sort (experts < n_experts, positions and
        // counts within the pairs); g and u hold n_experts·ffn rows of rb bytes (the maps
        // describe them); x at xp holds rows × kp bf16 (tokens < rows), or under the gathered
        // form pairs × kp in list order (the map's; rows past pairs read as zeros); h ≥ pairs ×
        // ffn floats.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    };
    if let Some(gather) = &be.mmw.x_gather {
        // x's rows in list order (pair p: its token's row), bf16 as mm_x_bf16 rounds them,
        // into xg's bytes, and the gate/up's x tiles by tensor copies over them.
        let pairs = rows * t.top_k;
        let kp = hidden.div_ceil(TK) * TK;
        ensure!(
            x.len() >= rows * hidden
                && 2 * xg.len() >= pairs * kp
                && t.list.len() >= pairs
                && pairs * kp / 8 <= i32::MAX as usize,
            "mmw: gathered x [{pairs}, {kp}] exceeds its scratch ({} floats)",
            xg.len()
        );
        // SAFETY: the view is xg's first pairs · kp · 2 bytes (checked above); the gate/up
        // reads it before the down overwrites xg (one stream).
        let mut xgb = unsafe { xg.transmute_mut::<u16>(pairs * kp) }
            .ok_or_else(|| anyhow::anyhow!("mmw: bf16 view of the gathered x"))?;
        let (pairs_i, kp_i) = (pairs as i32, kp as i32);
        // One thread a 16-byte vector of a row.
        let cvt = super::ops::grid_1d(pairs * kp / 8, 256);
        let mut launch = be.stream.kernel(gather);
        launch
            .arg(x)
            .arg(&pairs_i)
            .arg(&n_in)
            .arg(&kp_i)
            .arg(t.list)
            .arg(&tk)
            .arg(&mut xgb);
        // SAFETY: x holds rows × hidden floats, list pairs positions of pair ids < rows ·
        // top_k (moe_sort), xgb pairs × kp bf16 (checked above).
        unsafe { launch.launch(cvt) }?;
        let xmap = x_map(be, &xgb, pairs, kp, MOE_TN)?;
        let (xp, _xg_guard) = xgb.device_ptr(&be.stream);
        return run(xp, kp_i, Some(&xmap), h);
    }
    super::matmul::with_bf16_rows(be, x, rows, hidden, |xb, kp| {
        let (xp, _xb_guard) = xb.device_ptr(&be.stream);
        run(xp, kp as i32, None, h)
    })
}

/// A MoE prefill's down projections on the wgmma pipeline: `y[list[p]] = down_e h[p]` for every
/// list position p (h `pairs × ffn` f32 in list order, converted to bf16 once; `h_bf16`: h
/// already holds those bf16 rows, as [`moe_gate_up`] wrote them); `d`: `[n_experts, hidden,
/// ffn]` of type `TYPES[ti]`; y holds `pairs × hidden` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_down(
    be: &CudaBackend,
    ti: usize,
    h: &CudaSlice<f32>,
    (pairs, ffn, hidden): (usize, usize, usize),
    d: &CudaWeight,
    t: &MoeTiles<'_>,
    y: &mut CudaSlice<f32>,
    h_bf16: bool,
) -> Result<()> {
    if h_bf16 {
        ensure!(
            ffn.is_multiple_of(TK) && 2 * h.len() >= pairs * ffn,
            "mmw: bf16 h rows [{pairs}, {ffn}] exceed their buffer"
        );
        // SAFETY: the view's bytes are h's first pairs · ffn · 2 (checked above), which
        // moe_gate_up wrote as bf16; nothing writes h while the down reads it (one stream).
        let hb = unsafe { h.transmute::<u16>(pairs * ffn) }
            .ok_or_else(|| anyhow::anyhow!("mmw: bf16 view of h"))?;
        return moe_down_bf16(be, ti, &hb, (pairs, ffn, ffn, hidden), d, t, y);
    }
    super::matmul::with_bf16_rows(be, h, pairs, ffn, |hb, kp| {
        moe_down_bf16(be, ti, hb, (pairs, ffn, kp, hidden), d, t, y)
    })
}

/// [`moe_down`] on its bf16 rows `hb` (`pairs × kp`: ffn columns, kp a multiple of [`TK`]).
fn moe_down_bf16<H: cudarc::driver::DevicePtr<u16>>(
    be: &CudaBackend,
    ti: usize,
    hb: &H,
    (pairs, ffn, kp, hidden): (usize, usize, usize, usize),
    d: &CudaWeight,
    t: &MoeTiles<'_>,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    let k = &be.mmw.moe[ti][1];
    let cfg = moe_config(k, t, hidden.div_ceil(be.mmw.moe_tile.0))?;
    let (rb, n_out, n_in) = (d.row_bytes() as i64, hidden as i32, ffn as i32);
    let map = xtma()
        .then(|| x_map(be, hb, pairs, kp, MOE_TN))
        .transpose()?;
    let kp = kp as i32;
    // hb's device address (a slice or a view of h), held across the launch.
    let (hp, _hb_guard) = hb.device_ptr(&be.stream);
    let mut launch = be.stream.kernel(&k.f);
    launch
        .arg(&*d.data)
        .arg(&rb)
        .arg(&n_out)
        .arg(&n_in)
        .arg(&hp)
        .arg(&kp)
        .arg(t.offsets)
        .arg(t.n_tiles)
        .arg(t.tiles)
        .arg(t.list)
        .arg(y);
    if let Some(map) = &map {
        launch.arg(map);
    }
    let wm = rs()
        .then(|| w_maps(be, d, be.mmw.moe_tile.0, true))
        .transpose()?;
    if let Some(m) = &wm {
        launch.arg(&m[0]).arg(&m[1]);
    }
    // SAFETY: as moe_gate_up; d holds n_experts·hidden rows of rb bytes, hb pairs × kp
    // bf16 (list positions < pairs; the map describes them, a tile's rows past pairs read
    // as zeros), y ≥ pairs × hidden floats (pairs < pairs).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q6_groups_make_whole_units() {
        // Qwen3-30B-A3B's Q6_K down experts (768 columns), Qwen3.5-35B-A3B's (512), an
        // attn_v of 1024 columns, and rows of 2048 columns (already whole units).
        for (rb, g) in [(630, 8), (420, 4), (840, 2), (1680, 1)] {
            assert_eq!(q6_groups(rb), g, "{rb}");
            assert!((g * rb).is_multiple_of(16));
            assert!(
                !(g / 2 * rb).is_multiple_of(16) || g == 1,
                "{rb}: {g} is not the least"
            );
        }
    }

    #[test]
    fn shared_memory_fits_the_h200() {
        assert_eq!(MOE3_SMEM, 6 * (64 * 48 + 64 * 128) + 64 + 1024);
        for (tm, bn) in TILES {
            assert!(smem(tm, bn) <= 227 * 1024, "{tm}x{bn}: {}", smem(tm, bn));
        }
        // The bf16 A rows' rings (smem without FERRITE_MMW_RS_Q6).
        assert_eq!(ring_smem(128, 128, 224 * 1024), 7 * 32768 + 64 + 1024);
        assert_eq!(ring_smem(64, 256, 224 * 1024), 5 * 40960 + 64 + 1024);
        // The RS Q6_K form's rings (FERRITE_MMW_RS_Q6, on by default: raw A rows of 176 bytes),
        // which smem takes where they are larger: they fit too.
        let q6 = (RS_Q6_QL + RS_Q6_HI) as usize;
        for (tm, bn) in TILES {
            let r = ring_smem_row(tm, bn, 224 * 1024, q6);
            assert!(r <= 227 * 1024, "{tm}x{bn} (Q6_K RS): {r}");
        }
        assert_eq!(
            ring_smem_row(128, 128, 224 * 1024, q6),
            5 * (22528 + 16384) + 64 + 1024
        );
        assert_eq!(
            ring_smem_row(64, 256, 224 * 1024, q6),
            5 * (11264 + 32768) + 64 + 1024
        );
    }

    #[test]
    fn fused_swiglu_grid_is_the_grouped_launchs() {
        // Qwen3-8B at 512 rows: gate + up grouped are 2 × 192 tiles of 64 outputs on the wide
        // tile; the fused launch takes the same tile (the rule counts 2 × 12288 outputs) and
        // 384 tiles of 32 outputs: the same blocks, each half gate, half up.
        let tile = Tile::pick(false, 512, 2 * 12288, 132);
        assert_eq!(tile.dims(), (64, 256));
        let fused = tile
            .config(512, 12288usize.div_ceil(tile.dims().0 / 2))
            .unwrap();
        let grouped = tile
            .config(512, 2 * 12288usize.div_ceil(tile.dims().0))
            .unwrap();
        assert_eq!(fused.grid_dim, (2, 384, 1));
        assert_eq!(fused.grid_dim, grouped.grid_dim);
        assert_eq!(fused.block_dim, (384, 1, 1));
        // Past the grid's y limit: an error, not a truncated launch.
        assert!(tile.config(512, 65536).is_err());
        // The TA form's wide tile: 288 threads, four 48 KB stages.
        let wide = Tile::TaWide.config(512, 192).unwrap();
        assert_eq!((wide.grid_dim, wide.block_dim), ((2, 192, 1), (288, 1, 1)));
        assert_eq!(wide.shared_mem_bytes as usize, 4 * 49152 + 64 + 1024);
    }

    #[test]
    fn wide_tiles_for_full_grids_of_long_prefills() {
        // Qwen3-8B at 512 rows on 132 SMs: Q/O (4096 outputs, 128 tiles) and gate/up (12288)
        // wide; K/V (1024 outputs, 32 tiles) not; prefills of ≤ 128 rows not.
        assert!(wide_tile(512, 4096, 132));
        assert!(wide_tile(512, 12288, 132));
        assert!(!wide_tile(512, 1024, 132));
        assert!(!wide_tile(128, 12288, 132));
        assert!(wide_tile(129, 12288, 132));
    }

    #[test]
    fn ta_wide_tile_where_its_grid_fills_the_sms() {
        if ta_tile_mode() != 2 {
            return; // FERRITE_MMW_TA_TILE set in the environment: another rule
        }
        // Qwen3-8B F16 at 512 rows on 132 SMs: the fused gate/up (2 × 12288 rows, 2 × 192
        // blocks) and a 12288-output weight (2 × 96) take the 128 × 256 tile; Q, K, V
        // grouped (6144: 2 × 48) and O or down (4096: 2 × 32) the 128-output ones; ≤ 128
        // rows never.
        let ta = |rows, n| Tile::pick(true, rows, n, 132);
        assert_eq!(ta(512, 24576), Tile::TaWide);
        assert_eq!(ta(512, 12288), Tile::TaWide);
        assert_eq!(ta(300, 12200), Tile::TaWide);
        for (rows, n) in [(512, 6144), (512, 4096), (128, 1 << 20)] {
            assert!(matches!(ta(rows, n), Tile::Std(0 | 1)), "{rows} x {n}");
        }
        // The quantized launches keep their rule (the 64 × 256 tile on full grids).
        assert_eq!(Tile::pick(false, 512, 12288, 132), Tile::Std(2));
    }

    #[test]
    fn ta_k_split_where_the_wide_grid_falls_short() {
        if ta_tile_mode() != 2 {
            return; // FERRITE_MMW_TA_TILE set in the environment: another rule
        }
        // K = 4096: 64 steps of 64.
        let pick = |rows, n| {
            let t = Tile::pick(true, rows, n, 132);
            t.split_k(rows, n / 128, 64, 132, [0; 2])
        };
        if ta_ks() == 0 {
            // Off (FERRITE_MMW_TA_KS=0): the 128-output tiles stay.
            assert!(matches!(pick(512, 4096), Tile::Std(0 | 1)));
            return;
        }
        // Qwen3-8B F16 at 512 (or 300) rows on 132 SMs: O or down (32 output tiles: 2 × 32
        // blocks) split in two (in four: 256 blocks, two waves of quarter tiles, no fewer);
        // Q, K, V grouped (48: 96 blocks) in two, or in four where allowed (384 blocks: three
        // waves of quarters against two of halves); K or V alone (8: 16 blocks) and 128 rows
        // not.
        for (rows, n) in [(512, 4096), (300, 4096)] {
            assert_eq!(pick(rows, n), Tile::TaWideK(2), "{rows} x {n}");
        }
        let qkv = if ta_ks() == 4 { 4 } else { 2 };
        assert_eq!(pick(512, 6144), Tile::TaWideK(qkv));
        // Too few K steps to give each of four blocks four: two.
        assert_eq!(
            Tile::Std(0).split_k(512, 48, 15, 132, [0; 2]),
            Tile::TaWideK(2)
        );
        if ta_ks() == 4 {
            // Clusters of four holding only 120 blocks at once (30 clusters): four waves of
            // quarters, no fewer than two of halves.
            assert_eq!(
                Tile::Std(0).split_k(512, 48, 64, 132, [132, 120]),
                Tile::TaWideK(2)
            );
            assert_eq!(
                Tile::Std(0).split_k(512, 48, 64, 132, [132, 128]),
                Tile::TaWideK(4)
            );
        }
        for (rows, n) in [(512, 1024), (128, 4096)] {
            assert!(matches!(pick(rows, n), Tile::Std(0 | 1)), "{rows} x {n}");
        }
        assert_eq!(pick(512, 24576), Tile::TaWide);
        let k = Tile::TaWideK(2).config(512, 32).unwrap();
        assert_eq!((k.grid_dim, k.block_dim.0), ((2, 32, 2), TA_WIDE_THREADS));
        let k = Tile::TaWideK(4).config(512, 48).unwrap();
        assert_eq!(k.grid_dim, (2, 48, 4));
    }

    #[test]
    fn concatenated_tile_where_it_takes_fewer_waves() {
        // Qwen3-8B's Q, K, V at 512 rows: 192 wide half-K blocks (two waves of halves) against
        // 128 concatenated ones (one wave of three quarters).
        assert!(cat_tile(1, 512, &[4096, 1024, 1024], 192, 132));
        // A partial last tile (5120 outputs: 27 tiles, 108 blocks) against 160.
        assert!(cat_tile(1, 512, &[4096, 512, 512], 160, 132));
        // O (4096 outputs, 128 wide blocks: one wave already) and Qwen3-14B's Q, K, V (7168:
        // 152 blocks, two waves either way) keep the wide tile.
        assert!(!cat_tile(1, 512, &[4096], 128, 132));
        assert!(!cat_tile(1, 512, &[5120, 1024, 1024], 224, 132));
        // Outputs not whole 64-row boxes never take it; mode 2 wherever they are; 0 never.
        assert!(!cat_tile(2, 512, &[4096, 1000, 1000], 192, 132));
        assert!(cat_tile(2, 512, &[4096], 128, 132));
        assert!(!cat_tile(0, 512, &[4096, 1024, 1024], 192, 132));
        assert_eq!(TA_CAT_SMEM, 4 * 56 * 1024 + 64 + 1024);
    }
}
