//! The CUDA backend's environment switches (tuning and diagnosis; the defaults are the
//! measured best), read one way: unset means the default, a value outside what the switch
//! accepts is an error that names the switch and its values. [`validate`] runs when a device
//! is opened, so a mistyped switch stops the start-up instead of being ignored by a kernel
//! launcher that reads it later.

use anyhow::{bail, Result};

/// What a switch accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Accepts {
    /// One of these integers.
    OneOf(&'static [i64]),
    /// An integer in this inclusive range.
    Range(i64, i64),
    /// This many comma-separated non-negative integers.
    List(usize),
}

/// Every switch of the backend, with what it accepts and where it is described.
pub(crate) const SWITCHES: &[(&str, Accepts, &str)] = &[
    (
        "FERRITE_PDL",
        Accepts::OneOf(&[0, 1]),
        "programmatic dependent launch",
    ),
    (
        "FERRITE_MMQ",
        Accepts::OneOf(&[0, 1]),
        "int8 tensor-core prefill (MMQ.md)",
    ),
    (
        "FERRITE_MMW",
        Accepts::OneOf(&[0, 1, 2]),
        "prefill matmuls on wgmma (sm_90a): 0 off (mm_), 1 on, 2 on without the 64x256 tile (MATMUL.md)",
    ),
    (
        "FERRITE_MMW_MOE",
        Accepts::OneOf(&[0, 1, 2, 3, 4]),
        "a MoE prefill's grouped expert GEMMs on wgmma (sm_90a): 0 off (moe.cu's mma.sync forms), 1 on 128-output tiles one block an SM, 2 on 64-output tiles two blocks an SM, 3 as 2 but the RS Q4_K and Q6_K experts on one producer warpgroup, three blocks an SM, 4 (default) those on one producer warp, 160 threads: Q4_K four blocks an SM, Q6_K three (MOE.md, 49th session)",
    ),
    (
        "FERRITE_MMW_RS",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill: 1 (default) the Q4_K launches on 128-output tiles and the MoE GEMMs decode A in the consumers' registers from raw bytes brought by tensor copies (and FERRITE_MMW_XTMA on), 0 the producers decode (MATMUL.md rounds 83-86)",
    ),
    (
        "FERRITE_MMW_RS_Q8",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill, with FERRITE_MMW_RS: 1 (default) Q8_0 weights take the register-A form too (one 80-byte span a row a step; Qwen3-8B Q8_0 pp512 +43% on an H100), 0 Q8_0 on the producers' form (MATMUL.md round 86)",
    ),
    (
        "FERRITE_MMW_RS_Q6",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill, with FERRITE_MMW_RS: 1 (default) dense Q6_K weights take the register-A form too (two spans a row a step; Qwen3-8B Q4_K_M pp512 +3.4% on an H100), 0 Q6_K on the producers' form (MATMUL.md rounds 86-87)",
    ),
    (
        "FERRITE_GEMV_ROWS_XS",
        Accepts::OneOf(&[0, 1]),
        "f32 small-output weights (the MoE routers) at prefill: 1 (default) on gemv_f32_xs (x held in registers, the same sums), 0 on gemv_f32_rows (MOE.md, 49th session)",
    ),
    (
        "FERRITE_MOE_H_BF16",
        Accepts::OneOf(&[0, 1]),
        "a MoE prefill on the wgmma GEMMs: 1 (default) the gate/up writes h as the bf16 rows the down reads, 0 as f32 rows converted before the down (MOE.md, 49th session)",
    ),
    (
        "FERRITE_MMW_RS_Q5",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill, with FERRITE_MMW_RS: 1 (default) puts Q5_K weights on the register-A form too (Qwen3.5-35B-A3B pp512 +1.5% on an H100), 0 keeps the producers' form (MATMUL.md rounds 91, 93)",
    ),
    (
        "FERRITE_QKR_HEADS",
        Accepts::OneOf(&[0, 1]),
        "prefill QK-norm + RoPE (qk_norm_rope's register form): 1 (default) a warp takes several heads of a token and computes their rotary angles once (pp512 +2.2% on Qwen3-30B-A3B, +2.1% on Qwen3-8B Q4_K_M); 0 one head a warp (MATMUL.md round 90)",
    ),
    (
        "FERRITE_MMW_RSW_MIXED",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill, with FERRITE_MMW_RS_Q6: Q4_K_M's mixed Q, K, V groups (Q4_K, Q4_K, Q6_K) on the wide tile by the register-A form (1, the default: pp512 +1.7% on Qwen3-30B-A3B, +2.9% on Qwen3-8B Q4_K_M) or the producers' form (0) (MATMUL.md round 89)",
    ),
    (
        "FERRITE_MMW_GU_XG",
        Accepts::Range(0, 3),
        "wgmma prefill, MoE gate/up (bits): 1 gathers x's rows into the expert-sorted pair order first so that its x tiles come by one tensor copy a step; 2 orders its blocks tile-major; 3 (default) both: pp512 +5.3% on Qwen3-30B-A3B; 0 neither (MOE.md, 50th session)",
    ),
    (
        "FERRITE_MMW_GU_LEAD",
        Accepts::Range(0, 8),
        "wgmma prefill, with FERRITE_MMW_RS: steps of the MoE gate/up's gathered x copies kept in flight past the step the producers publish (capped at the ring's stages less two; 0, the default: each step's copies waited for at once; 4 measured -4.5% on pp512) (MOE.md, 48th session)",
    ),
    (
        "FERRITE_MMW_RS_Q6_MOE",
        Accepts::OneOf(&[0, 1, 2]),
        "wgmma prefill, with FERRITE_MMW_RS_Q6: the MoE GEMMs' Q6_K experts 0 on the producers' form, 1 on the register-A form (their rows read by tensor maps over groups of rows that are whole 16-byte units) at two blocks an SM, 2 (default) the same at three blocks an SM under FERRITE_MMW_MOE=3 or 4 (MOE.md, 48th session)",
    ),
    (
        "FERRITE_MMW_RSW",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill, with FERRITE_MMW_RS: 1 (default) the Q4_K launches on the 64x256 tile decode A in the consumers' registers too (mmw_rsw kernels), 0 that tile's producers decode (MATMUL.md rounds 85-86)",
    ),
    (
        "FERRITE_MMW_TA",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill: 1 (default) F16 and BF16 weights on the mmw_ta kernels (weight and x tiles by tensor copies as stored, no producer decode; F16 with f16 x), 0 the producers' bf16 path (MATMUL.md round 84)",
    ),
    (
        "FERRITE_MMW_TA_TILE",
        Accepts::OneOf(&[0, 1, 2]),
        "wgmma prefill, the TA form's tiles: 0 the quantized launches' rule (64x256 on full grids), 1 only the 128-output tiles, 2 (default) as 1 with the 128x256 tile (two m64n256 consumer warpgroups) where its grid fills the SMs (MATMUL.md round 92)",
    ),
    (
        "FERRITE_MMW_TA_KS",
        Accepts::OneOf(&[0, 2, 4]),
        "wgmma prefill, with FERRITE_MMW_TA_TILE=2: 2 (default) the TA form's plain launches whose 128x256 tiles would not fill the SMs on that tile with K split between the two blocks of a cluster, their partial sums added through shared memory (where that grid fills three quarters of the SMs), 4 also between four blocks where that takes fewer waves of the clusters the device holds (MATMUL.md round 99), 0 the 128-output tiles there (MATMUL.md round 95)",
    ),
    (
        "FERRITE_CUBLASLT",
        Accepts::OneOf(&[0, 1, 2, 3]),
        "cuBLASLt for the 16-bit weights' dense prefill GEMMs, a bit mask: bit 0 the single ones (the o-projection, the down after the fused SwiGLU), bit 1 the grouped ones (Q, K, V, one GEMM a weight); 1 (default) bit 0 alone, 0 every one on mmw; without libcublasLt, mmw (with a warning where set by hand) (cuda/blas.rs, MATMUL.md round 101)",
    ),
    (
        "FERRITE_MMW_TA_CAT",
        Accepts::OneOf(&[0, 1, 2]),
        "wgmma prefill, with FERRITE_MMW_TA_KS=2: 1 the TA form's K-split launches of weights whose outputs are all multiples of 64 (Q, K, V) on a 192-output tile over their rows one after another (mmw_ta_*_ck: two warpgroups of m64n256 + m64n128, K split in a cluster of two) where that takes fewer waves than the 128-output wide tile (Qwen3-8B's Q, K, V at 512 rows: one wave of 128 blocks instead of 192 blocks), the default, 2 wherever it applies (a check setting), 0 never (MATMUL.md round 100)",
    ),
    (
        "FERRITE_MMW_HX",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill: 1 (default) the TA form's (F16, BF16) fused gate/up/SwiGLU launch writes the down projection's 16-bit x rows itself (MATMUL.md round 96), 0 f32 rows that the down converts",
    ),
    (
        "FERRITE_MMW_TSHIFT",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill: 1 (default) a dense launch's last token tile, where the rows end inside it, read from a tile's length before the end (its x box inside the map: no zero fill; MATMUL.md round 93), 0 from the tile's start",
    ),
    (
        "FERRITE_MMW_XTMA",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill: 1 (default; always with FERRITE_MMW_RS=1) the x tiles of the dense launches and the MoE downs by one 2-D tensor copy (TMA) a step, 0 the producers' cp.async (MATMUL.md round 82)",
    ),
    (
        "FERRITE_MMW_XAFTER",
        Accepts::OneOf(&[0, 1]),
        "wgmma prefill producers: 1 a step's x copies issued after its proxy fence instead of before its decode (MATMUL.md round 81)",
    ),
    (
        "FERRITE_MMW_FUSE",
        Accepts::OneOf(&[0, 1, 2, 3]),
        "wgmma prefill fusions, a bit mask: 1 Q4_K Q, K + Q6_K V in one launch, 2 gate, up and SwiGLU in one (default 3; MATMUL.md)",
    ),
    (
        "FERRITE_KERNEL_PTX",
        Accepts::OneOf(&[0, 1]),
        "load PTX instead of CUBIN",
    ),
    (
        "FERRITE_DELTA_CHUNKED",
        Accepts::OneOf(&[0, 1]),
        "chunked delta-rule prefill",
    ),
    (
        "FERRITE_DEFER_NORM",
        Accepts::OneOf(&[0, 1]),
        "float-weight decode: the RMSNorm deferred into the next projection and the residual add into the one before (MATMUL.md round 23)",
    ),
    (
        "FERRITE_DEFER_NORM_Q8",
        Accepts::OneOf(&[0, 1, 2]),
        "Q8_0 decode: the FFN's RMSNorm handed from the o-projection to the SwiGLU: 0 off, 1 the plain GEMV + add_norm_planes, 2 (default) at one row the 32-row producer gemvq_add_n_q8_0 (MATMUL.md round 41)",
    ),
    (
        "FERRITE_DEFER_NORM_Q",
        Accepts::OneOf(&[0, 1]),
        "Q4_K decode: the FFN's RMSNorm handed from the o-projection to the SwiGLU (MATMUL.md round 24)",
    ),
    (
        "FERRITE_NORM_X16",
        Accepts::OneOf(&[0, 1]),
        "prefill: 1 (default) the add + RMSNorm also writes h as the 16-bit x of the matmuls that read it next (Q, K, V; gate/up), which then skip their conversion launch (MATMUL.md round 98); 0 the conversion launch",
    ),
    (
        "FERRITE_KV_FUSE",
        Accepts::OneOf(&[0, 1]),
        "prefill on a contiguous f16 cache with a NeoX rotation qk_norm_rope's register form takes: 1 (default) the qk_norm_rope launch stores the keys and values itself (rotated k not written back) and no kv_store launch runs (attention.rs qk_norm_rope_attention_stored, MATMUL.md rounds 104 and 106: Qwen3 and Qwen3.5 attention layers); 0 qk_norm_rope then kv_store",
    ),
    (
        "FERRITE_CUBLASLT_ALGO",
        Accepts::Range(0, 7),
        "the cuBLASLt prefill GEMMs' algorithm: 0 (default) the heuristic's first answer, i its (i+1)-th (past the last: the last); a tuning diagnostic (cuda/blas.rs, MATMUL.md round 103)",
    ),
    (
        "FERRITE_NORM_X16_ONLY",
        Accepts::OneOf(&[0, 1]),
        "prefill: 1 (default) a dense layer's RMSNorm or attention whose readers all take its 16-bit hand-over (FERRITE_NORM_X16, FERRITE_ATTN_X16) leaves its f32 output unwritten (ops.rs x16_only, MATMUL.md round 102); 0 it writes both",
    ),
    (
        "FERRITE_LT_ADD",
        Accepts::OneOf(&[0, 1]),
        "prefill of 16-bit weights: 1 (default) the o-projection and the down add the residual in cuBLASLt's epilogue (beta = 1) and a plain RMSNorm follows, where FERRITE_CUBLASLT takes them (mmw.rs adds_in_epilogue, MATMUL.md round 102); 0 their output goes to the add + RMSNorm",
    ),
    (
        "FERRITE_NORM_QKV",
        Accepts::OneOf(&[0, 2]),
        "one-row decode: the attention input's RMSNorm handed from the down projection to the grouped Q, K, V launch: 2 (default) by the K-split Q4_K tile's pair tickets (MATMUL.md round 42; the lane code's group tickets, round 43, lost), 0 off",
    ),
    (
        "FERRITE_GEMV_TM",
        Accepts::OneOf(&[0, 1]),
        "1: plain Q4_K matmuls of up to 16 rows on the token-major GEMV with integer sub-block scales (x scaled per 256 columns; an experiment, MATMUL.md round 78); 0 (default) the decode GEMVs",
    ),
    (
        "FERRITE_QX_EARLY",
        Accepts::OneOf(&[0, 1]),
        "quant_x_q8 lets the GEMV after it launch before its own wait (MATMUL.md round 25)",
    ),
    (
        "FERRITE_GEMV_PF",
        Accepts::Range(0, 2),
        "float GEMV L2 prefetch before the PDL wait: 0 none, 1 row heads, 2 whole spans (MATMUL.md)",
    ),
    (
        "FERRITE_GEMV_PF_HEAD",
        Accepts::Range(128, 65536),
        "bytes per row the float GEMV prefetches into L2 in mode 1 (MATMUL.md)",
    ),
    (
        "FERRITE_GEMV_ONE_WAVE",
        Accepts::OneOf(&[0, 1, 2]),
        "quantized-x decode GEMV launches (the lane code, V of the mixed QKV launch) in one wave where fewer, larger blocks fit one, a wave reckoned at 3 blocks per SM; 2 the lane kernels' own occupancy (an experiment); 0 the splits by block size alone (MATMUL.md round 26)",
    ),
    (
        "FERRITE_GEMV_TC",
        Accepts::Range(0, 3),
        "Q4_K / Q6_K GEMV on the tensor cores: 0 off, 1 on, 2 / 3 long rows in 16- / 8-row tiles (MATMUL.md rounds 8, 9)",
    ),
    (
        "FERRITE_GEMV_TCK",
        Accepts::List(2),
        "long rows' K slices, most columns for Q4_K, Q6_K (0 the lane code; MATMUL.md round 11)",
    ),
    (
        "FERRITE_GEMV_TCK_Q8",
        Accepts::Range(0, 4096),
        "Q8_0 long rows (8192 columns and more: the down projections) on the K-split tensor-core tile, most columns per slice (a multiple of 256; default 2048), 0 the lane code (MATMUL.md round 54)",
    ),
    (
        "FERRITE_GEMV_TCT",
        Accepts::OneOf(&[0, 1]),
        "one-row lm-head-sized GEMVs of short rows (a 16-row tile of at most ~30 KB) in blocks of two tensor-core tiles: 0 one tile a block, 1 two (default; MATMUL.md round 36)",
    ),
    (
        "FERRITE_GATE_QX",
        Accepts::OneOf(&[0, 1]),
        "Qwen3.5 decode: gated_rms_norm and the attention output gate write the int8 planes of their output for the next GEMV (no quant_x_q8 launch): 0 off, 1 on (default; GATED_DELTA.md)",
    ),
    (
        "FERRITE_MOE_TC",
        Accepts::OneOf(&[0, 1]),
        "MoE gate/up experts of Q4_K on the tensor cores: 0 the lane code, 1 on (MOE.md)",
    ),
    (
        "FERRITE_DIAG_SKIP",
        Accepts::Range(0, 31),
        "diagnostic, timing only (wrong outputs; bench skips its gate and refuses --record): a bit mask of one-row launches left out, 1 add_rms_norm, 2 quant_x_q8, 4 the Q8_0 o-projection handing the FFN norm over, 8 the decode attention, 16 QK-norm + RoPE (DECODE_STEP.md)",
    ),
    (
        "FERRITE_DIAG_MMW",
        Accepts::Range(0, 3),
        "diagnostic, timing only (wrong outputs; bench skips its gate and refuses --record): the wgmma prefill producers (mmw.cu), a bit mask: 1 no raw weight loads after the first steps (the same registers decoded again), 2 no proxy fence before a stage is published (MATMUL.md round 81)",
    ),
    (
        "FERRITE_DIAG_DQ",
        Accepts::OneOf(&[0, 1, 2]),
        "diagnostic, timing only (wrong outputs; bench skips its gate and refuses --record): the q8_0 cache's dequantization in the attention kernels replaced by a cheaper one on the same bytes, 1 two FP8 E4M3 conversions a word and no scale, 2 two byte permutes a word (FP8 E5M2 into f16) and no scale (ATTENTION.md)",
    ),
    (
        "FERRITE_DIAG_CLBAR",
        Accepts::Range(0, 3),
        "diagnostic, timing only (outside the memory model: bench skips its gate and refuses --record): a bit mask of cluster barriers made relaxed after a CTA-scope fence instead of release / acquire, 1 the decode attention's split merge, 2 the MoE gate/up's h exchange (ATTENTION.md)",
    ),
    (
        "FERRITE_DIAG_TL",
        Accepts::Range(0, 1_000_000),
        "diagnostic, timing only (bench skips its gate and refuses --record): n > 0 writes the block timeline of the n-th decode-graph replay (every kernel block's PDL wait entry and return, and the tensor-core GEMVs' ends, by %globaltimer) to FERRITE_DIAG_TL_OUT (default ferrite-timeline.tsv); tools/timeline.py reads it (DECODE_STEP.md)",
    ),
    (
        "FERRITE_NORM_ROUTER",
        Accepts::OneOf(&[0, 1]),
        "a MoE block's input RMSNorm and router GEMV in one launch at decode: 0 two launches, 1 one (MOE.md)",
    ),
    (
        "FERRITE_MOE_DOWN_NW",
        Accepts::OneOf(&[2, 4]),
        "MoE down kernel: hidden rows per pass of a warp's slot (the same bits either way; MOE.md)",
    ),
    (
        "FERRITE_MOE_PF",
        Accepts::OneOf(&[0, 1]),
        "MoE gate/up blocks prefetch their experts' down rows into L2: 0 off, 1 on (MOE.md)",
    ),
    (
        "FERRITE_MOE_PREDICT",
        Accepts::Range(0, 32),
        "MoE decode under graph capture: N > 0 predicts each MoE layer's experts from the residual before its attention half (its router on the normed residual, a launch on a stream beside the step) and prefetches the top N's gate and up rows into L2; default 4; 0 off (MOE.md, 63rd and 64th sessions)",
    ),
    (
        "FERRITE_MOE_PREDICT_PF",
        Accepts::OneOf(&[0, 1]),
        "with FERRITE_MOE_PREDICT: 1 (default) the predicted experts prefetched, 0 the prediction launched alone (its cost on the step; MOE.md, 63rd session)",
    ),
    (
        "FERRITE_MOE_PREDICT_AT",
        Accepts::OneOf(&[0, 1, 2]),
        "with FERRITE_MOE_PREDICT: where the predicted experts' prefetch is issued: 0 with the prediction, at the end of the layer before; 1 (default) after the layer's Q, K, V (or Gated DeltaNet in-projection) launch; 2 after its attention (or delta rule) launch (MOE.md, 64th session)",
    ),
    (
        "FERRITE_MOE_PREDICT_PRIO",
        Accepts::OneOf(&[0, 1]),
        "with FERRITE_MOE_PREDICT: 1 (default) gives the prediction's side launches the context's greatest scheduling priority (the decode graph instantiated with node priorities); 0 the default priority (MOE.md, 64th session)",
    ),
    (
        "FERRITE_MOE_PREDICT_HITS",
        Accepts::OneOf(&[0, 1]),
        "diagnostic, timing only (bench refuses --record): with FERRITE_MOE_PREDICT, each MoE layer waits for its prediction and counts how many of its routed experts it held, logged at exit (MOE.md, 63rd session)",
    ),
    (
        "FERRITE_GEMV_DIAG",
        Accepts::Range(0, 3),
        "diagnostic, timing only (wrong outputs; bench skips its gate and refuses --record): the decode GEMVs' copy / compute timed apart, 1 no compute, 2 no weight copies of the bulk-copy tiles, 3 the compute before the copies' wait (MATMUL.md round 8)",
    ),
    (
        "FERRITE_GEMVQ_SMEM",
        Accepts::Range(4, 112),
        "quantized GEMV block KB (MATMUL.md round 5)",
    ),
    (
        "FERRITE_MM_BN",
        Accepts::OneOf(&[64, 128]),
        "prefill token-tile width",
    ),
    (
        "FERRITE_ATTN_TC",
        Accepts::OneOf(&[0, 1, 2]),
        "prefill attention on the tensor cores (1 = f16 and q8_0 caches, 2 = f16 only, 0 = the SIMT kernel; ATTENTION.md)",
    ),
    (
        "FERRITE_ATTN_X16",
        Accepts::OneOf(&[0, 1]),
        "prefill attention on the two-group kernel: 1 (default) also writes its output as the o-projection's 16-bit x, which then skips its conversion launch (MATMUL.md round 99), 0 the conversion launch",
    ),
    (
        "FERRITE_ATTN_TC2",
        Accepts::OneOf(&[0, 1]),
        "tensor-core prefill attention on a contiguous f16 cache, head dims up to 128: 1 two groups of 4 warps a block taking alternate key tiles, merged at the end (default; attn_prefill_tc2_*; ATTENTION.md 53rd session), 0 one group",
    ),
    (
        "FERRITE_GEMV_WARPS",
        Accepts::Range(1, 256),
        "float GEMV: resident-warp goal per SM that sets its K split (default 32; MATMUL.md round 15)",
    ),
    (
        "FERRITE_GEMV_GROUP",
        Accepts::OneOf(&[0, 1]),
        "float GEMV: 1 (default) groups a run of large-output weights (Q, K, V) into one launch at the launch's K split even where a weight alone takes another, 0 only where the splits agree (MATMUL.md round 15)",
    ),
    (
        "FERRITE_ATTN_CLUSTER",
        Accepts::OneOf(&[0, 1]),
        "decode attention's split merge through a thread-block cluster (sm_90, 2-16 splits: the tensor-core loop at head_dim 128, the SIMT loop at 256; 0 = the ticket merge, ATTENTION.md)",
    ),
    (
        "FERRITE_ATTN_DTC",
        Accepts::OneOf(&[0, 1, 2]),
        "decode attention's main loop on the tensor cores (contiguous caches, head_dim 128): 1 f16 and q8_0, 2 f16 only, 0 neither (the SIMT loop; ATTENTION.md)",
    ),
    (
        "FERRITE_ATTN_PIPE",
        Accepts::OneOf(&[0, 1]),
        "q8_0 decode attention on the tensor cores with the next key tile's loads in flight (3 blocks per SM); 0 the plain loop (4 blocks per SM; ATTENTION.md)",
    ),
    (
        "FERRITE_ATTN_MERGE",
        Accepts::OneOf(&[0, 1, 2, 3]),
        "decode attention's split merge for caches past a cluster's 16 splits: 3 (default) by the decode launch's own last blocks, a (head, 32 dims) piece each (decode_tail_merge), where they fit; 1 as a launch of its own (attn_decode_merge: a block per head and 32 dims); 2 the same except for the keys-before-the-wait form (caches of 1-4 K positions); 0 the ticket merge, the last split's block merging alone (ATTENTION.md)",
    ),
    (
        "FERRITE_ATTN_PRE",
        Accepts::OneOf(&[0, 1, 2]),
        "f16 decode attention of one row whose chunks are one tile: 2 (default) loads each warp's keys before the PDL wait (the new key from the step's rows) in the cluster-merge form and in the ticket-merge form of caches past 16 splits, 1 in the cluster-merge form only, 0 after it (ATTENTION.md)",
    ),
    (
        "FERRITE_TC2_PX",
        Accepts::OneOf(&[0, 1]),
        "the Q4_K o-projection that hands the FFN norm over (gemvq_tc2_add): 1 (default) loads its epilogue's norm weight before the PDL wait and the residual right after it, 0 after the tiles (MATMUL.md round 28)",
    ),
    (
        "FERRITE_SWIGLU_W4",
        Accepts::OneOf(&[0, 1]),
        "the one-row Q4_K SwiGLU on the handed-over FFN norm: 1 (default) in blocks of four warps, four blocks per SM (gemvq_swiglu_tcnw4: the eight-warp kernel's sums in its order), 0 eight warps, three blocks per SM (MATMUL.md round 49)",
    ),
    (
        "FERRITE_TCK_W4",
        Accepts::OneOf(&[0, 1, 2]),
        "the one-row K-split Q4_K (and Q8_0) tile (the 12288-column down projections) in blocks of four warps, four blocks per SM (gemvq_tck[n]w4: the eight-warp kernel's sums in its order): 1 (default) the one handing the next layer's attention norm over, 2 also Q4_K's plain one, 0 neither (eight warps, three blocks per SM; MATMUL.md rounds 50, 54)",
    ),
    (
        "FERRITE_MOE_SHARED",
        Accepts::OneOf(&[0, 1]),
        "Qwen3.5-MoE's gated shared expert at decode (up to 16 rows, top-k <= 8, Q4_K / Q5_K / Q6_K / Q8_0 experts, its weights of the routed experts' types): 1 (default) as every token's last pair of the MoE gate/up and down launches (gemvq_moe_gu_tcs_q4_k / gemvq_moe_gus, gemvq_moe_downs4: its gate's dot product and sigmoid in the down's combine), 0 the composition's seven launches (MOE.md)",
    ),
    (
        "FERRITE_SWIGLU_PIPE",
        Accepts::Range(0, 8),
        "the one-row Q8_0 SwiGLU on the handed-over FFN norm on the tensor-core tile as persistent blocks (one per SM), each a ring of this many 8-output tiles (gemvq_swiglu_tcnp_q8_0): 2 (default), 0 the lane code (MATMUL.md round 57)",
    ),
    (
        "FERRITE_ADD_N_PX",
        Accepts::OneOf(&[0, 1]),
        "the Q8_0 o-projection handing the FFN norm over (gemvq_add_n_q8_0_r1) loading its epilogue's norm weight before its PDL wait and its residual right after it: 1 (default), 0 both after its barrier (the same bits; MATMUL.md round 73)",
    ),
    (
        "FERRITE_SWIGLU_QH",
        Accepts::OneOf(&[0, 1]),
        "the Q8_0 SwiGLU ring writing h's int8 planes for the down projection itself: 1 (default) on, 0 a quant_x launch between them (MATMUL.md round 63)",
    ),
    (
        "FERRITE_QKV_VTC",
        Accepts::OneOf(&[0, 1]),
        "the mixed Q, K, V launch (Q4_K Q and K, Q6_K V: the Q4_K_M mix) with V on the tensor-core tile too: 1 (default) on, 0 V on the lane code (MATMUL.md round 51)",
    ),
    (
        "FERRITE_ATTN_ROPE",
        Accepts::OneOf(&[0, 1]),
        "QK-norm + RoPE inside the one-row keys-before-the-wait cluster decode attention (Qwen3's rotation: both norms, NeoX over 128 dims): 1 (default), 0 the qk_norm_rope launch before it (ATTENTION.md, 23rd session)",
    ),
    (
        "FERRITE_GEMV_TC5",
        Accepts::OneOf(&[0, 1, 2, 3]),
        "Q5_K decode GEMVs on the tensor-core tile (gemvq_tc_q5_k; the Qwen3.5 linear layers' in-projection): 3 (default) with the two-tile block for the one-row launches it fits at three or two blocks per SM (gemvq_tct_q5_k; 4096 columns at two), 2 at three only, 1 the one-tile block alone, 0 the lane code (MATMUL.md round 69)",
    ),
    (
        "FERRITE_QKV_VFIRST",
        Accepts::OneOf(&[0, 1]),
        "the one-row mixed Q, K, V launch with V on the tensor-core tile: 1 (default) its blocks in reverse order, the Q6_K V tiles dispatched first; 0 in order (MATMUL.md round 52)",
    ),
    (
        "FERRITE_GEMV_TC6_MIN",
        Accepts::Range(1, 1 << 30),
        "fewest outputs for which a Q6_K weight takes the 16-row tensor-core tile (default 8192: the lm heads; larger keeps them on the lane code; MATMUL.md rounds 9, 52)",
    ),
    (
        "FERRITE_L2_EVICT_FIRST",
        Accepts::OneOf(&[0, 1]),
        "the L2 policy of the dense decode GEMVs' weight copies: 1 (default) evict-first, 0 evict-unchanged (MATMUL.md round 34)",
    ),
    (
        "FERRITE_ROUTER_PRE",
        Accepts::OneOf(&[0, 1]),
        "the MoE norm + router launch (add_rms_norm_gemv_f32): 1 (default) loads each lane's router weights before the PDL wait, 0 from L2 after the norm (MOE.md)",
    ),
    (
        "FERRITE_ATTN_GB",
        Accepts::OneOf(&[1, 2, 4, 8]),
        "query heads per decode block",
    ),
    (
        "FERRITE_ATTN_TUNE",
        Accepts::List(4),
        "decode blocks/SM,max splits,min chunk,prefetch",
    ),
];

fn describe(a: Accepts) -> String {
    match a {
        Accepts::OneOf(v) => v
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        Accepts::Range(lo, hi) => format!("an integer from {lo} to {hi}"),
        Accepts::List(n) => format!("{n} comma-separated non-negative integers"),
    }
}

/// `value` parsed as `a` accepts it: the integers it holds (one, or the list's).
pub(crate) fn parse(a: Accepts, value: &str) -> Option<Vec<i64>> {
    let v = value.trim();
    let one = |ok: &dyn Fn(i64) -> bool| v.parse::<i64>().ok().filter(|x| ok(*x)).map(|x| vec![x]);
    match a {
        Accepts::OneOf(set) => one(&|x| set.contains(&x)),
        Accepts::Range(lo, hi) => one(&|x| (lo..=hi).contains(&x)),
        Accepts::List(n) => {
            let xs: Option<Vec<i64>> = v
                .split(',')
                .map(|x| x.trim().parse::<i64>().ok().filter(|x| *x >= 0))
                .collect();
            xs.filter(|xs| xs.len() == n)
        }
    }
}

fn accepts(name: &str) -> Accepts {
    SWITCHES
        .iter()
        .find(|(n, ..)| *n == name)
        .map(|(_, a, _)| *a)
        .unwrap_or_else(|| panic!("{name} is not in cuda::switches::SWITCHES"))
}

/// The switch `name` (one of [`SWITCHES`]): `None` when unset, its integers when set to
/// something it accepts, an error otherwise.
pub(crate) fn get(name: &str) -> Result<Option<Vec<i64>>> {
    let Ok(v) = std::env::var(name) else {
        return Ok(None);
    };
    let a = accepts(name);
    match parse(a, &v) {
        Some(xs) => Ok(Some(xs)),
        None => bail!("{name}={v:?}: it accepts {}", describe(a)),
    }
}

/// The single integer of switch `name`, or `default` when unset. Only for switches that
/// [`validate`] has checked (launchers reading them lazily): a bad value was an error at
/// start-up, so here it cannot occur and falls back to the default.
pub(crate) fn int_or(name: &str, default: i64) -> i64 {
    get(name).ok().flatten().map_or(default, |xs| xs[0])
}

/// The timing diagnostics' values (0 unless set), read once: `FERRITE_DIAG_SKIP`'s mask,
/// `FERRITE_DIAG_DQ`, `FERRITE_DIAG_CLBAR`'s mask, `FERRITE_DIAG_TL`'s replay,
/// `FERRITE_DIAG_MMW`'s mask and `FERRITE_GEMV_DIAG`'s mode.
fn diags() -> &'static [i64; 6] {
    static D: std::sync::OnceLock<[i64; 6]> = std::sync::OnceLock::new();
    D.get_or_init(|| {
        [
            "FERRITE_DIAG_SKIP",
            "FERRITE_DIAG_DQ",
            "FERRITE_DIAG_CLBAR",
            "FERRITE_DIAG_TL",
            "FERRITE_DIAG_MMW",
            "FERRITE_GEMV_DIAG",
        ]
        .map(|n| int_or(n, 0))
    })
}

/// `FERRITE_DIAG_SKIP`'s mask: which one-row launches a timing diagnostic leaves out.
pub(crate) fn diag_skip() -> i64 {
    diags()[0]
}

/// `FERRITE_DIAG_MMW`: what of the wgmma prefill producers a timing diagnostic leaves out.
pub(crate) fn diag_mmw() -> i64 {
    diags()[4]
}

/// `FERRITE_GEMV_DIAG`: what of the decode GEMVs a timing diagnostic leaves out (1 the
/// compute, 2 the weight copies, 3 the wait before the compute).
pub(crate) fn diag_gemv() -> i64 {
    diags()[5]
}

/// `FERRITE_DIAG_DQ`: the q8_0 cache's dequantization a timing diagnostic replaces.
pub(crate) fn diag_dq() -> i64 {
    diags()[1]
}

/// `FERRITE_DIAG_CLBAR`'s mask: the cluster barriers a timing diagnostic relaxes.
pub(crate) fn diag_clbar() -> i64 {
    diags()[2]
}

/// `FERRITE_DIAG_TL`: which decode-graph replay (1-based) the block timeline records, 0 none.
pub(crate) fn diag_tl() -> i64 {
    diags()[3]
}

/// Checks every switch that is set (called when a CUDA device is opened).
pub(crate) fn validate() -> Result<()> {
    for (name, ..) in SWITCHES {
        get(name)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_checked() {
        assert_eq!(parse(Accepts::OneOf(&[0, 1]), " 1 "), Some(vec![1]));
        assert_eq!(parse(Accepts::OneOf(&[0, 1]), "2"), None);
        assert_eq!(parse(Accepts::OneOf(&[0, 1]), "yes"), None);
        assert_eq!(parse(Accepts::Range(4, 112), "40"), Some(vec![40]));
        assert_eq!(parse(Accepts::Range(4, 112), "113"), None);
        assert_eq!(parse(Accepts::Range(4, 112), "-1"), None);
        assert_eq!(
            parse(Accepts::List(4), "4, 64,64,0"),
            Some(vec![4, 64, 64, 0])
        );
        assert_eq!(parse(Accepts::List(4), "4,64,64"), None);
        assert_eq!(parse(Accepts::List(4), "4,64,x,0"), None);
        assert_eq!(parse(Accepts::List(4), "4,64,-2,0"), None);
    }

    /// Every switch the CUDA sources read by name through `int_or` or `get` is in the registry:
    /// an unregistered one panics at its first read on a GPU, which no host test would
    /// otherwise reach.
    #[test]
    fn every_switch_read_is_registered() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda");
        let mut read = 0;
        for entry in std::fs::read_dir(&dir).expect("src/cuda") {
            let path = entry.expect("a directory entry").path();
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let src = std::fs::read_to_string(&path).expect("a source file");
            for pat in ["int_or(\"", "get(\""] {
                for (i, _) in src.match_indices(pat) {
                    let rest = &src[i + pat.len()..];
                    let Some(name) = rest.split('"').next().filter(|n| {
                        n.starts_with("FERRITE_")
                            && n.chars()
                                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                    }) else {
                        continue;
                    };
                    read += 1;
                    assert!(
                        SWITCHES.iter().any(|(n, ..)| *n == name),
                        "{name} (read in {}) is not in SWITCHES",
                        path.display()
                    );
                }
            }
        }
        assert!(
            read > 50,
            "only {read} switch reads found: the scan is broken"
        );
    }

    #[test]
    fn every_switch_describes_its_values() {
        for (name, a, what) in SWITCHES {
            assert!(name.starts_with("FERRITE_") && !what.is_empty());
            assert!(!describe(*a).is_empty());
            assert_eq!(accepts(name), *a);
        }
    }
}
