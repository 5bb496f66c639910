// matmul.cu — out[t][o] = sum_i W[o][i] * x[t][i] for a weight [n_out, n_in] stored as a
// ggml type (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q4_K Q5_K Q6_K, the GGUF bytes as they sit in VRAM),
// x [rows, n_in] f32 row-major, out [rows, n_out] f32 row-major.
//
// Two kernel families (launchers in matmul.rs; the row split is GEMV_MAX_ROWS there):
//
// 1. gemv_<type>_r<R>   (decode and speculative verify: rows <= 16; memory-bound)
//    - A block is 8 warps (256 threads) = 8/ks row groups of ks warps. A row group owns NW = 2
//      consecutive output rows; its ks warps split the row's K steps (warp kw takes steps kw,
//      kw+ks, ...), walk both rows with the same lane->element mapping (each x value serves
//      NW weight rows), reduce with a fixed xor butterfly and add their ks totals through
//      shared memory in warp order. ks in {1,2,4,8} is a launch argument chosen by the
//      launcher from the shape only (enough warps per SM for ~30 KB in flight; 1024-output
//      K/V projections get ks = 8/4, the 151936-row lm head ks = 1), never from R.
//    - Lane mapping, chosen so that at each load instruction 8 consecutive lanes read 32
//      consecutive floats of x (one 128-B line: no L1 wavefront amplification), and the
//      weight bytes a warp reads per instruction are one contiguous span of the row:
//        F32:       lane reads 4 floats (16 B, float4) per step; 32 lanes = 128 elements.
//        F16/BF16:  lane reads 4 halves (8 B, uint2) per step (16-B loads were slower:
//                   a lane's x then spans two float4, 2x the L1 wavefronts).
//        Q8_0:      8 lanes per block; lane j reads quants 4j..4j+3 (4 B) + the f16 scale.
//        Q4_0/Q4_1: 4 lanes per block; lane j reads qs[4j..4j+3] = elements 4j.. (low
//                   nibbles) and 16+4j.. (high nibbles).
//        Q4_K/Q5_K: one warp per super-block; lane (g = lane/8, j = lane%8) reads qs word
//                   32g+4j (elements 64g+4j.. low nibbles, 64g+32+4j.. high nibbles);
//                   Q5_K also the qh word 4j; the 16-B header (d, dmin, scales) as one uint4
//                   (a broadcast), both sub-block scales decoded at once (kq_pair_scales).
//        Q6_K:      one warp per super-block; lane (n = lane/16, p = lane/8%2, c = lane%8)
//                   reads ql word 64n+32p+4c and qh word 32n+4c: elements 128n+32p+4c.. and
//                   128n+64+32p+4c.., their two int8 scales and d.
//      Rows of Q8_0/Q4_0/Q6_K are only 2-byte aligned: their 4-byte words are read with
//      ld4() (aligned loads + funnel shift). Q4_1 (20 B), Q4_K (144 B) and Q5_K (176 B)
//      blocks keep 4/16-byte alignment (the buffer base is 256-aligned).
//    - Bytes moved per output row: exactly the row's stored bytes (n_in/bs*ts; e.g. Q4_K
//      0.5625 B/element, Q6_K 0.82, Q8_0 1.0625, F16 2) from DRAM, read once, with
//      streaming (evict-first) loads; x comes from L1/L2 (it is read by every warp).
//    - Nibbles/bytes -> f32 exactly with the 2^23 trick: prmt the byte into the mantissa of
//      8388608.0f and subtract (PRMT + FADD instead of the slow I2F).
//    - R = rows rounded up to an instantiated size (1, 2, 4, 8, 9, 16); padded rows recompute
//      the last real row and are not stored. Every accumulator is one explicit fmaf chain in
//      a fixed element order, the warp reduction a fixed xor-butterfly and the ks partials are
//      added in warp order, all fixed by the shape, so out[t][o]
//      is bitwise independent of R and of the other rows: decode (rows = 1) and speculative
//      verify (rows = K+1) give identical results for the same token.
//    The quantized types decode on int8 x instead (gemvq_<type>_r<R>, section 1b), Q4_K on
//    sm_90+ on the int8 tensor cores (gemvq_tc_q4_k_r<R>, section 1b').
//
// 2. mm_<type>          (prefill: rows > 16; tensor cores, mma.sync m16n8k16 bf16 -> f32)
//    - Block tile 128 outputs (M) x 128 tokens (N) x 32 (K), 256 threads = 8 warps as 4 (M)
//      x 2 (N); each warp computes 32 outputs x 64 tokens = 2 x 8 mma tiles (64 f32
//      accumulators per thread).
//    - Per K step each thread decodes 16 consecutive weight elements of one output row
//      (row = tid/2, half = tid%2) from the stored blocks straight into bf16, and converts
//      16 floats of one token row of x to bf16; both go to shared memory (rows padded to 40
//      bf16 = 80 B so that fragment loads are bank-conflict free). Two smem buffers: the
//      next tile is loaded into registers before the mma of the current one and stored
//      after it; one __syncthreads per K step.
//    - blockIdx.x walks the token tiles fastest, so the blocks that read the same weight
//      tile run together and share it through L2: weights come from DRAM about once.
//    - Precision: bf16 inputs (x and the dequantized weights rounded to nearest even; 8-bit
//      mantissa, relative error <= 2^-9 per element) and f32 accumulation. bf16 rather than
//      f16 because it has f32's exponent range: activation outliers cannot overflow and no
//      per-row scaling is needed. Expected NMSE vs the f32 oracle ~1e-6..1e-5.
//    - Edges: token rows >= rows and output rows >= n_out read a clamped valid row and are
//      not stored; K beyond n_in (float types with n_in % 32 != 0) is zero in both A and B.
//
// Decoders here must agree with ggml_get in common.cuh (checked by `ferrite check`; before any
// GPU run they and the mma tile indexing were checked on the host by compiling this file with
// g++ against ggml_get, with an emulated mma.sync; see MATMUL.md).

// The block timeline's marks inside the one-row tensor-core GEMV block (gemvq_tc_block; empty
// unless FERRITE_DIAG_TL compiled them in, with TL_MARK_SLOTS 3 for this file: mod.rs
// full_source): 0 x staged, 1 the tile's copy waited for, 2 warp 0's super-block loop done.
// tools/timeline.py --phases reads them (DECODE_STEP.md, 68th session).
#ifndef FERRITE_TL
#define TL_MARK(k)
#endif
#define GEMV_WARPS 8
#define GEMV_NW 2
// Loop unroll depths (iterations of a lane's step loop whose loads can be in flight together):
// aim for >= ~24 KB in flight per SM (4.3 TB/s x ~700 ns / 132 SMs). F: float types (8-16 B
// per row per step), B: 32-element block types (2-5 B per lane per row), K: super-blocks.
#define GEMV_UNROLL_F 8
#define GEMV_UNROLL_B 8
#define GEMV_UNROLL_K 4

// ---------------------------------------------------------------------------------------
// Loads

// Weights are read once per call: streaming loads (evict-first in L1 and L2).
__device__ __forceinline__ uint32_t ldw(const uint32_t* p) { return __ldcs((const unsigned int*)p); }

// The 4 bytes at p (only 2-byte aligned) as a little-endian word: one aligned load when p is
// 4-aligned, else two aligned loads and a funnel shift. The second load is predicated off when
// aligned, so it never reads past a 4-aligned end of the buffer. (When p is 2 mod 4, the second
// word can extend up to 2 bytes past the last needed byte; it stays inside an aligned word of
// the allocation granule, so it cannot fault.)
__device__ __forceinline__ uint32_t ld4(const uint8_t* p) {
    size_t a = (size_t)p;
    const uint32_t* q = (const uint32_t*)(a & ~(size_t)3);
    uint32_t sh = (uint32_t)(a & 3) * 8;
    uint32_t lo = ldw(q);
    uint32_t hi = sh ? ldw(q + 1) : 0u;
    return __funnelshift_r(lo, hi, sh);
}

__device__ __forceinline__ uint16_t ld2(const uint8_t* p) {
    return __ldcs((const unsigned short*)p);
}

// ---------------------------------------------------------------------------------------
// GEMV

// PAD_ROWS: an R-row instantiation serves rows <= R (R in GEMV_R: 3 rows run R = 4, 5..7
// run R = 8). Its per-row loops stop at `rows` (a warp-uniform branch) instead of computing
// the last real row again for the padded ones: the few-row GEMVs are issue-bound, each row
// costing its x loads, MMAs or FMAs and its float epilogue (MATMUL.md round 77). The padded
// accumulators stay zero and are never stored. r = 0 is never tested, so the R = 1 kernels
// are unchanged. The cost of the skip at a full tile: with `rows` a variable, each row's x
// loads wait behind its test (one load latency per row per step, not one per step); with rows
// the constant R (the call inlined with it) the tests fold away and every row's loads issue
// together, as before the skip, in more registers. Only gemv_<type>_rows takes that form
// (MOE.md, 42nd session): in the R-row kernels the extra registers are the whole kernel's, and
// made the padded tiles 35-40% slower (Q4_K at 3 and 5 rows) where the full ones gained 22%.

// byte_fb: mm_decode.cuh (shared with mmw.cu's RS Q6_K consumers).

// kq_pair_sel / kq_pair_scales: mm_decode.cuh (shared with mmw.cu's RS consumers).

// acc[r][w] += wv[w][k] * x[r][e + k] for k < 4 (x row r clamped to rows-1).
template <int R, int NW>
__device__ __forceinline__ void fma4(float (&acc)[R][NW], const float* __restrict__ x, int n_in, int rows,
                                     int e, const float (&wv)[NW][4]) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
        const float4 xv = __ldg((const float4*)(x + (size_t)r * n_in + e));
#pragma unroll
        for (int w = 0; w < NW; w++) {
            acc[r][w] = fmaf(wv[w][0], xv.x, acc[r][w]);
            acc[r][w] = fmaf(wv[w][1], xv.y, acc[r][w]);
            acc[r][w] = fmaf(wv[w][2], xv.z, acc[r][w]);
            acc[r][w] = fmaf(wv[w][3], xv.w, acc[r][w]);
        }
    }
}

// One scalar element for the unaligned float paths.
template <int R, int NW>
__device__ __forceinline__ void fma1(float (&acc)[R][NW], const float* __restrict__ x, int n_in, int rows,
                                     int e, const float (&wv)[NW]) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
        const float xv = __ldg(x + (size_t)r * n_in + e);
#pragma unroll
        for (int w = 0; w < NW; w++) acc[r][w] = fmaf(wv[w], xv, acc[r][w]);
    }
}

// Elements 4i .. 4i + 3 of a float-type row (F32: one 16-byte load; F16 / BF16: one 8-byte
// load, 4 halves) as floats; streaming loads, as every weight load (ldw).
template <int TYPE>
__device__ __forceinline__ void float_row4(const uint8_t* row, int i, float (&v)[4]) {
    if (TYPE == GGML_F32) {
        const float4 f = __ldcs((const float4*)row + i);
        v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
    } else {
        const uint2 u = __ldcs((const uint2*)row + i);
        const uint16_t h0 = u.x & 0xFFFF, h1 = u.x >> 16, h2 = u.y & 0xFFFF, h3 = u.y >> 16;
        if (TYPE == GGML_F16) {
            v[0] = h2f(h0); v[1] = h2f(h1); v[2] = h2f(h2); v[3] = h2f(h3);
        } else {
            v[0] = b2f(h0); v[1] = b2f(h1); v[2] = b2f(h2); v[3] = b2f(h3);
        }
    }
}

// Per type: accumulate this lane's share of the NW rows `wr` into acc. The step loop of every
// type is split over the ks warps of a row group: warp kw takes steps kw, kw + ks, ... (a step
// = 32 lanes' units), so each lane's fmaf chain depends only on (type, n_in, ks), and ks only
// on the shape (chosen by the launcher), never on R.
template <int TYPE, int R, int NW>
__device__ __forceinline__ void gemv_lane(const uint8_t* const (&wr)[NW], int n_in, const float* __restrict__ x,
                                          int rows, int lane, int kw, int ks, float (&acc)[R][NW]) {
    const int u0 = lane + 32 * kw, us = 32 * ks;
    if (TYPE == GGML_F32) {
        if ((n_in & 3) == 0) {
            const int n4 = n_in >> 2;
#pragma unroll GEMV_UNROLL_F
            for (int i = u0; i < n4; i += us) {
                float wv[NW][4];
#pragma unroll
                for (int w = 0; w < NW; w++) float_row4<TYPE>(wr[w], i, wv[w]);
                fma4<R, NW>(acc, x, n_in, rows, 4 * i, wv);
            }
        } else {
            for (int i = u0; i < n_in; i += us) {
                float wv[NW];
#pragma unroll
                for (int w = 0; w < NW; w++) wv[w] = __ldcs((const float*)wr[w] + i);
                fma1<R, NW>(acc, x, n_in, rows, i, wv);
            }
        }
    } else if (TYPE == GGML_F16 || TYPE == GGML_BF16) {
        if ((n_in & 3) == 0) {
            // 8-B loads (4 halves): 8 lanes read one 128-B line of x per instruction. (16-B
            // loads made a lane's x span two float4 per step: 2x L1 wavefronts, 1.6x slower
            // at R = 16.)
            const int n4 = n_in >> 2;
#pragma unroll GEMV_UNROLL_F
            for (int i = u0; i < n4; i += us) {
                float wv[NW][4];
#pragma unroll
                for (int w = 0; w < NW; w++) float_row4<TYPE>(wr[w], i, wv[w]);
                fma4<R, NW>(acc, x, n_in, rows, 4 * i, wv);
            }
        } else {
            for (int i = u0; i < n_in; i += us) {
                float wv[NW];
#pragma unroll
                for (int w = 0; w < NW; w++) {
                    const uint16_t h = ld2(wr[w] + 2 * (size_t)i);
                    wv[w] = TYPE == GGML_F16 ? h2f(h) : b2f(h);
                }
                fma1<R, NW>(acc, x, n_in, rows, i, wv);
            }
        }
    } else if (TYPE == GGML_Q8_0) {
        const int units = (n_in / QK) * 8;  // 8 lanes per block
#pragma unroll GEMV_UNROLL_B
        for (int u = u0; u < units; u += us) {
            const int b = u >> 3, j = u & 7;
            float wv[NW][4];
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const uint8_t* blk = wr[w] + (size_t)b * Q8_0_BYTES;
                const float d = h2f(ld2(blk));
                const uint32_t q = ld4(blk + 2 + 4 * j) ^ 0x80808080u;  // int8 -> q + 128
                wv[w][0] = byte_fb<0, 128>(q) * d;
                wv[w][1] = byte_fb<1, 128>(q) * d;
                wv[w][2] = byte_fb<2, 128>(q) * d;
                wv[w][3] = byte_fb<3, 128>(q) * d;
            }
            fma4<R, NW>(acc, x, n_in, rows, b * QK + 4 * j, wv);
        }
    } else if (TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1) {
        const int units = (n_in / QK) * 4;  // 4 lanes per block
#pragma unroll GEMV_UNROLL_B
        for (int u = u0; u < units; u += us) {
            const int b = u >> 2, j = u & 3;
            float lo[NW][4], hi[NW][4];
#pragma unroll
            for (int w = 0; w < NW; w++) {
                if (TYPE == GGML_Q4_0) {
                    const uint8_t* blk = wr[w] + (size_t)b * Q4_0_BYTES;
                    const float d = h2f(ld2(blk));
                    const uint32_t q = ld4(blk + 2 + 4 * j);
                    const uint32_t ql = q & 0x0F0F0F0Fu, qh = (q >> 4) & 0x0F0F0F0Fu;
                    lo[w][0] = byte_fb<0, 8>(ql) * d; lo[w][1] = byte_fb<1, 8>(ql) * d;
                    lo[w][2] = byte_fb<2, 8>(ql) * d; lo[w][3] = byte_fb<3, 8>(ql) * d;
                    hi[w][0] = byte_fb<0, 8>(qh) * d; hi[w][1] = byte_fb<1, 8>(qh) * d;
                    hi[w][2] = byte_fb<2, 8>(qh) * d; hi[w][3] = byte_fb<3, 8>(qh) * d;
                } else {
                    const uint8_t* blk = wr[w] + (size_t)b * Q4_1_BYTES;  // 4-aligned
                    const uint32_t dm = ldw((const uint32_t*)blk);
                    const float d = h2f(dm & 0xFFFF), m = h2f(dm >> 16);
                    const uint32_t q = ldw((const uint32_t*)(blk + 4 + 4 * j));
                    const uint32_t ql = q & 0x0F0F0F0Fu, qh = (q >> 4) & 0x0F0F0F0Fu;
                    lo[w][0] = fmaf(byte_f<0>(ql), d, m); lo[w][1] = fmaf(byte_f<1>(ql), d, m);
                    lo[w][2] = fmaf(byte_f<2>(ql), d, m); lo[w][3] = fmaf(byte_f<3>(ql), d, m);
                    hi[w][0] = fmaf(byte_f<0>(qh), d, m); hi[w][1] = fmaf(byte_f<1>(qh), d, m);
                    hi[w][2] = fmaf(byte_f<2>(qh), d, m); hi[w][3] = fmaf(byte_f<3>(qh), d, m);
                }
            }
            fma4<R, NW>(acc, x, n_in, rows, b * QK + 4 * j, lo);
            fma4<R, NW>(acc, x, n_in, rows, b * QK + 16 + 4 * j, hi);
        }
    } else if (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
        const int nsb = n_in / QK_K;
        const int g = lane >> 3, j = lane & 7;
        const int bytes = TYPE == GGML_Q4_K ? Q4_K_BYTES : Q5_K_BYTES;
#pragma unroll GEMV_UNROLL_K
        for (int s = kw; s < nsb; s += ks) {
            float lo[NW][4], hi[NW][4];
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const uint8_t* blk = wr[w] + (size_t)s * bytes;  // 16-aligned
                const uint4 h = __ldcs((const uint4*)blk);
                const float d = h2f(h.x & 0xFFFF), dmin = h2f(h.x >> 16);
                const uint32_t sm = kq_pair_scales(kq_pair_sel(g), h.y, h.z, h.w);
                const float sc0 = byte_fb<0, 0>(sm), sc1 = byte_fb<1, 0>(sm);
                const float m0 = byte_fb<2, 0>(sm), m1 = byte_fb<3, 0>(sm);
                const float ds0 = d * sc0, dm0 = dmin * m0, ds1 = d * sc1, dm1 = dmin * m1;
                uint32_t ql, qh;
                if (TYPE == GGML_Q4_K) {
                    const uint32_t q = ldw((const uint32_t*)(blk + 16 + 32 * g + 4 * j));
                    ql = q & 0x0F0F0F0Fu;
                    qh = (q >> 4) & 0x0F0F0F0Fu;
                } else {
                    const uint32_t hb = ldw((const uint32_t*)(blk + 16 + 4 * j));
                    const uint32_t q = ldw((const uint32_t*)(blk + 48 + 32 * g + 4 * j));
                    ql = (q & 0x0F0F0F0Fu) | (((hb >> (2 * g)) & 0x01010101u) << 4);
                    qh = ((q >> 4) & 0x0F0F0F0Fu) | (((hb >> (2 * g + 1)) & 0x01010101u) << 4);
                }
                lo[w][0] = fmaf(byte_f<0>(ql), ds0, -dm0); lo[w][1] = fmaf(byte_f<1>(ql), ds0, -dm0);
                lo[w][2] = fmaf(byte_f<2>(ql), ds0, -dm0); lo[w][3] = fmaf(byte_f<3>(ql), ds0, -dm0);
                hi[w][0] = fmaf(byte_f<0>(qh), ds1, -dm1); hi[w][1] = fmaf(byte_f<1>(qh), ds1, -dm1);
                hi[w][2] = fmaf(byte_f<2>(qh), ds1, -dm1); hi[w][3] = fmaf(byte_f<3>(qh), ds1, -dm1);
            }
            const int e = s * QK_K + 64 * g + 4 * j;
            fma4<R, NW>(acc, x, n_in, rows, e, lo);
            fma4<R, NW>(acc, x, n_in, rows, e + 32, hi);
        }
    } else if (TYPE == GGML_Q6_K) {
        const int nsb = n_in / QK_K;
        const int n = lane >> 4, p = (lane >> 3) & 1, c = lane & 7;
#pragma unroll GEMV_UNROLL_K
        for (int s = kw; s < nsb; s += ks) {
            float lo[NW][4], hi[NW][4];
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const uint8_t* blk = wr[w] + (size_t)s * Q6_K_BYTES;  // 2-aligned
                const uint32_t ql = ld4(blk + 64 * n + 32 * p + 4 * c);
                const uint32_t qh = ld4(blk + 128 + 32 * n + 4 * c);
                const int si = 192 + 8 * n + (c >> 2) + 2 * p;
                const float d = h2f(ld2(blk + 208));
                const float ds0 = d * (float)(int8_t)__ldcs((const signed char*)(blk + si));
                const float ds1 = d * (float)(int8_t)__ldcs((const signed char*)(blk + si + 4));
                const uint32_t q0 = (ql & 0x0F0F0F0Fu) | (((qh >> (2 * p)) & 0x03030303u) << 4);
                const uint32_t q1 = ((ql >> 4) & 0x0F0F0F0Fu) | (((qh >> (2 * p + 4)) & 0x03030303u) << 4);
                lo[w][0] = byte_fb<0, 32>(q0) * ds0; lo[w][1] = byte_fb<1, 32>(q0) * ds0;
                lo[w][2] = byte_fb<2, 32>(q0) * ds0; lo[w][3] = byte_fb<3, 32>(q0) * ds0;
                hi[w][0] = byte_fb<0, 32>(q1) * ds1; hi[w][1] = byte_fb<1, 32>(q1) * ds1;
                hi[w][2] = byte_fb<2, 32>(q1) * ds1; hi[w][3] = byte_fb<3, 32>(q1) * ds1;
            }
            const int e = s * QK_K + 128 * n + 32 * p + 4 * c;
            fma4<R, NW>(acc, x, n_in, rows, e, lo);
            fma4<R, NW>(acc, x, n_in, rows, e + 64, hi);
        }
    }
}

// Block = GEMV_WARPS warps = (GEMV_WARPS / ks) row groups of ks warps; a row group owns NW
// consecutive output rows and its ks warps split the K steps. Each warp reduces its lanes with
// a fixed xor butterfly; the ks warp totals are added through shared memory in warp order
// (((p0 + p1) + p2) + ...). ks = 1 stores the butterfly total directly (the same value).
//
// SWIGLU (float types; the quantized ones have gemvq_swiglu_*): a row group is (gate row o of
// W, up row o of W2) and stores silu(gate) * up at out[o], one output per group.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

// The deferred RMSNorm (gemv_norm_*, gemv_swiglu_norm_*, gemv_multi_norm_*; matmul.rs
// `rms_norm_matmuls`): the input is the raw residual row x, not rms_norm(x) · n, and
//     (rms_norm(x) · n) · w = s · Σ_i w_i (x_i n_i),   s = 1 / sqrt(mean(x²) + eps),
// so each lane multiplies its x values by the norm weight n as it reads them and sums their
// squares beside the dot products; the row group's ks warps then hold the whole row's
// Σ x² (they read all of x between them), reduced in the same fixed order as the dot
// products, and the epilogue scales by s. No norm launch and no normed copy of x: the
// extra work is one float4 load of n per x float4 (the same 16 KB for every block: L1) and
// 4 FMAs per row. Float weight types only, rows a multiple of 4 elements (matmul.rs
// `defers`); the summation order depends on (type, n_in, ks) alone, as gemv_lane's.
template <int TYPE, int R, int NW>
__device__ __forceinline__ void gemv_lane_norm(const uint8_t* const (&wr)[NW], int n_in, const float* __restrict__ x,
                                               const float* __restrict__ nw, int rows, int lane, int kw, int ks,
                                               float (&acc)[R][NW], float (&ss)[R]) {
    const int u0 = lane + 32 * kw, us = 32 * ks;
    const int n4 = n_in >> 2;
    // As many weight bytes in flight per lane as gemv_lane's GEMV_NW rows x GEMV_UNROLL_F.
    constexpr int UNROLL = GEMV_UNROLL_F * GEMV_NW / NW > 0 ? GEMV_UNROLL_F * GEMV_NW / NW : 1;
#pragma unroll UNROLL
    for (int i = u0; i < n4; i += us) {
        float wv[NW][4];
#pragma unroll
        for (int w = 0; w < NW; w++) float_row4<TYPE>(wr[w], i, wv[w]);
        const float4 nv = __ldg((const float4*)nw + i);
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
            const float4 xv = __ldg((const float4*)(x + (size_t)r * n_in) + i);
            ss[r] = fmaf(xv.x, xv.x, ss[r]);
            ss[r] = fmaf(xv.y, xv.y, ss[r]);
            ss[r] = fmaf(xv.z, xv.z, ss[r]);
            ss[r] = fmaf(xv.w, xv.w, ss[r]);
            const float a = xv.x * nv.x, b = xv.y * nv.y, c = xv.z * nv.z, d = xv.w * nv.w;
#pragma unroll
            for (int w = 0; w < NW; w++) {
                acc[r][w] = fmaf(wv[w][0], a, acc[r][w]);
                acc[r][w] = fmaf(wv[w][1], b, acc[r][w]);
                acc[r][w] = fmaf(wv[w][2], c, acc[r][w]);
                acc[r][w] = fmaf(wv[w][3], d, acc[r][w]);
            }
        }
    }
}

// The norm's scale from a row's Σ x² (as the RMSNorm kernels, elementwise.cu).
__device__ __forceinline__ float gemv_norm_scale(float ss, int n_in, float eps) {
    return rsqrtf(ss / (float)n_in + eps);
}

// PDL prologue of a GEMV block (launch.rs, common.cuh): the weight rows [r0, r1) the block
// will stream (of W, and of W2 for the fused SwiGLU) depend on no earlier kernel, so their
// lines are prefetched into L2 before waiting for the predecessor. While the previous kernel
// drains (its tail leaves DRAM idle), this block's weights are already on their way; its
// streaming loads then hit L2. Then wait, then let the next kernel launch.
// How much of its weights gemv_prologue prefetches into L2 before the PDL wait (set once by
// the launcher, matmul.rs; a tuning switch while the F16 decode regression is measured):
// 0 nothing, 1 the first gemv_pf_head bytes of each of the block's rows (what the first
// steps of the row groups load), 2 the block's whole span (round 3).
__constant__ int gemv_pf_mode;
// matmul.rs F32_SMALL_OUT: outputs at or below which a weight is a router-like small GEMV.
#define GEMV_SMALL_OUT 256
__constant__ int gemv_diag;  // diagnostic, matmul.rs set_gemv_prefetch
// Mode 1's head in bytes per row (matmul.rs GEMV_PF_HEAD; FERRITE_GEMV_PF_HEAD).
__constant__ int gemv_pf_head;

__device__ __forceinline__ void gemv_prologue(const uint8_t* W, const uint8_t* W2, long long rb, int n_out,
                                              int r0, int r1) {
#if __CUDA_ARCH__ >= 900
    r1 = r1 < n_out ? r1 : n_out;
    // Small-output launches (MoE routers, Qwen3.5's beta / alpha: n_out <= GEMV_SMALL_OUT)
    // take the whole span in mode 1: their few blocks' rows are all of the weight (the
    // router 1-2 MB), which then lands during the RMSNorm before them (MATMUL.md round 21).
    const int mode = gemv_pf_mode == 1 && n_out <= GEMV_SMALL_OUT ? 2 : gemv_pf_mode;
    if (mode == 1 && r0 < r1) {
        // One line per thread and pass: thread t takes row t / L, line t % L of that row's head.
        const long long head = gemv_pf_head;
        const int L = (int)((rb < head ? rb : head) + 127) / 128;
        const int n = (r1 - r0) * L;
#pragma unroll 1
        for (int m = 0; m < 2; m++) {
            const uint8_t* base = m == 0 ? W : W2;
            if (base == nullptr) break;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const uint8_t* a = base + (size_t)(r0 + i / L) * (size_t)rb + 128 * (size_t)(i % L);
                asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
            }
        }
    }
    if (mode == 2 && r0 < r1) {
        const size_t bytes = (size_t)(r1 - r0) * (size_t)rb;
#pragma unroll 1
        for (int m = 0; m < 2; m++) {
            const uint8_t* base = m == 0 ? W : W2;
            if (base == nullptr) break;
            const size_t a0 = (size_t)(base + (size_t)r0 * (size_t)rb) & ~(size_t)127;
            const size_t a1 = (size_t)(base + (size_t)r0 * (size_t)rb) + bytes;
            for (size_t a = a0 + 128 * (size_t)threadIdx.x; a < a1; a += 128 * (size_t)blockDim.x)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
        }
    }
#endif
    PDL_ENTRY();
}

// The bulk-copy form of the quantized-x GEMV: the only form on sm_90+ (the launcher always
// passes its shared memory there), the register-load form of gemvq_lane<.., false> before.
// The block's weight rows [r0, r1) (of W, and of W2 for the fused SwiGLU) are one contiguous
// span each; thread 0 copies each span into shared memory with cp.async.bulk (the TMA engine:
// one instruction per span, no registers held, the whole span in flight at once) completing
// on an mbarrier, BEFORE waiting for the predecessor kernel (weights depend on nothing). The
// lanes then read the same bytes from shared memory with the same lane mapping and the same
// arithmetic as the global path. Why: the register-held loads of the global path keep only
// one unrolled step (~2 KB per warp) in flight (the compiler does not hoist the loads of the
// next step), ~50 KB per SM, under what the H200's latency x bandwidth needs; the bulk copy
// puts 2-3 blocks x 10-110 KB in flight per SM and overlaps them with the previous kernel.
// The copy moves whole 16-byte units: a span is widened to the 16-byte boundaries around it
// (at most 15 bytes before it, inside the 256-aligned weight buffer, and 15 after its end,
// inside the allocation's granule) and its rows sit `off` = (address mod 16) bytes into the
// span's slot, so a row has the same alignment in shared memory as in global memory. Slot
// size (the launcher's formula, gemvq_bulk in matmul.rs): rows * rb rounded up to 16, + 16.
__device__ __forceinline__ uint32_t gemv_dyn_smem() {
    uint32_t v;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

__device__ __forceinline__ size_t gemv_slot(int per_block, long long rb) {
    return (((size_t)per_block * (size_t)rb + 15) & ~(size_t)15) + 16;
}

// The mbarrier and bulk-copy primitives of the bulk-copy GEMVs, the tensor-core tiles and
// the MoE experts (sm_90+; nothing before). mbar_init: one arrival expected, made visible to
// the copy engine; mbar_expect: that arrival, announcing `bytes` of copies; bulk_g2s: `bytes`
// from global src (16-byte aligned, a multiple of 16) to shared dst, completing on bar;
// mbar_wait: until phase `parity` of bar completes (gemv_bulk_wait: phase 0).
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
#if __CUDA_ARCH__ >= 900
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void bulk_g2s(uint64_t* bar, uint8_t* dst, size_t src, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(bytes), "r"((uint32_t)__cvta_generic_to_shared(bar))
                 : "memory");
#endif
}

// bulk_g2s for the dense decode GEMVs' weight tiles (bulk_issue_spans, the K-split rows), with an
// L2 policy (MATMUL.md round 34): evict-first, so that the weight stream, read once a step and
// far larger than L2, evicts its own lines before the small tensors the latency chain reads
// (norm weights, activations, the KV cache of short contexts). gemv_l2ef = 0
// (FERRITE_L2_EVICT_FIRST=0): evict-unchanged instead, the same instructions. The MoE experts'
// copies keep bulk_g2s (evict-first there measured -1.3% on Qwen3-30B-A3B).
__constant__ int gemv_l2ef;
__device__ __forceinline__ void bulk_g2s_w(uint64_t* bar, uint8_t* dst, size_t src, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    uint64_t first, unchanged;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
    asm volatile("createpolicy.fractional.L2::evict_unchanged.b64 %0, 1.0;" : "=l"(unchanged));
    const uint64_t pol = gemv_l2ef ? first : unchanged;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
            "r"((uint32_t)__cvta_generic_to_shared(dst)),
        "l"(src), "r"(bytes), "r"((uint32_t)__cvta_generic_to_shared(bar)), "l"(pol)
        : "memory");
#endif
}

// Phase 0 of a one-shot barrier (every GEMV block's): the parity as an immediate. (As
// mbar_wait(bar, 0), which passes it in a register, it changed the register allocation and
// scheduling of 7 lane-code kernels on sm_90a, checked with nvdisasm.)
__device__ __forceinline__ void gemv_bulk_wait(uint64_t* bar) {
#if __CUDA_ARCH__ >= 900
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(b)
            : "memory");
    }
#endif
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(b), "r"(parity)
            : "memory");
    }
#endif
}

// Thread 0 copies na rows at a into smem and nb rows at b into smem + slot (rows of rb bytes,
// each span widened to whole 16-byte units as above; n = 0: no copy), completing on the
// block's mbarrier bar; then the block barrier (bar initialised before anyone waits) and the
// PDL entry. Before sm_90 only the PDL entry.
// The copies of bulk_prologue_spans, issued by the calling thread alone (no barrier, no
// PDL entry): the two-tile block's group leaders (gemvq_tc2_add_q4k) each issue their tile's.
__device__ __forceinline__ void bulk_issue_spans(const uint8_t* a, int na, const uint8_t* b, int nb, long long rb,
                                                 size_t slot, uint8_t* smem, uint64_t* bar) {
#if __CUDA_ARCH__ >= 900
    {
        size_t a0[2], len[2];
        uint32_t total = 0;
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const uint8_t* base = m == 0 ? a : b;
            const int n = m == 0 ? na : nb;
            len[m] = 0;
            if (n > 0) {
                a0[m] = (size_t)base & ~(size_t)15;
                len[m] = (((size_t)(base + (size_t)n * (size_t)rb) + 15) & ~(size_t)15) - a0[m];
                total += (uint32_t)len[m];
            }
        }
        if (gemv_diag == 2) total = 0, len[0] = len[1] = 0;
        mbar_init(bar);
        mbar_expect(bar, total);
#pragma unroll
        for (int m = 0; m < 2; m++)
            if (len[m]) bulk_g2s_w(bar, smem + m * slot, a0[m], (uint32_t)len[m]);
    }
#endif
}

__device__ __forceinline__ void bulk_prologue_spans(const uint8_t* a, int na, const uint8_t* b, int nb,
                                                    long long rb, size_t slot, uint8_t* smem, uint64_t* bar) {
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) bulk_issue_spans(a, na, b, nb, rb, slot, smem, bar);
    __syncthreads();
#endif
    PDL_ENTRY();
}

// The lane-code GEMV's copies: rows [r0, r0 + per_block) (clamped to n_out) of W into slot 0
// and, for the fused SwiGLU, of W2 into slot 1.
__device__ __forceinline__ void gemv_bulk_prologue(const uint8_t* W, const uint8_t* W2, long long rb, int n_out,
                                                   int r0, int per_block, uint8_t* smem, uint64_t* bar) {
    const int n = max(0, min(per_block, n_out - r0));
    bulk_prologue_spans(W + (size_t)r0 * (size_t)rb, n, W2 ? W2 + (size_t)r0 * (size_t)rb : nullptr, W2 ? n : 0,
                        rb, gemv_slot(per_block, rb), smem, bar);
}


// What a float GEMV does besides W x (the MODE of gemv): nothing; the deferred RMSNorm of x
// (gemv_lane_norm: nw, eps); or the residual add out += W x in its epilogue (gemv_add_*:
// each output read and written by the lane that stores it; bitwise matmul + add_assign).
#define GEMV_PLAIN 0
#define GEMV_NORM 1
#define GEMV_ADD 2

template <int TYPE, int R, bool SWIGLU = false, int MODE = GEMV_PLAIN, int NW = GEMV_NW>
__device__ __forceinline__ void gemv(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                     const float* __restrict__ x, int rows, float* __restrict__ out, int ks,
                                     const uint8_t* __restrict__ W2, int bx, const float* __restrict__ nw = nullptr,
                                     float eps = 0.0f) {
    constexpr int PER = SWIGLU ? 1 : NW;  // outputs per row group
    constexpr bool NORM = MODE == GEMV_NORM;
    constexpr int NS = NORM ? R : 0;      // Σ x² slots after the outputs' in `red`
    __shared__ float red[GEMV_WARPS][R * NW + NS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kw = warp % ks, grp = warp / ks;
    const int o0 = (bx * (GEMV_WARPS / ks) + grp) * PER;
    const bool active = o0 < n_out;  // whole warp
    gemv_prologue(W, SWIGLU ? W2 : nullptr, rb, n_out, bx * (GEMV_WARPS / ks) * PER,
                  (bx + 1) * (GEMV_WARPS / ks) * PER);
    float acc[R][NW];
    float ss[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        ss[r] = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; w++) acc[r][w] = 0.0f;
    }
    if (active) {
        const uint8_t* wr[NW];
        if (SWIGLU) {
            wr[0] = W + (size_t)o0 * (size_t)rb;
            wr[1] = W2 + (size_t)o0 * (size_t)rb;
        } else {
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const int o = o0 + w < n_out ? o0 + w : n_out - 1;
                wr[w] = W + (size_t)o * (size_t)rb;
            }
        }
        if (NORM)
            gemv_lane_norm<TYPE, R, NW>(wr, n_in, x, nw, rows, lane, kw, ks, acc, ss);
        else
            gemv_lane<TYPE, R, NW>(wr, n_in, x, rows, lane, kw, ks, acc);
        // Fixed xor butterfly: every lane ends with the same totals.
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int w = 0; w < NW; w++) {
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) acc[r][w] += __shfl_xor_sync(0xffffffffu, acc[r][w], off);
            }
            if (NORM) {
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], off);
            }
        }
    }
    if (ks == 1) {  // uniform over the block
        if (!active) return;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float s = NORM ? gemv_norm_scale(ss[r], n_in, eps) : 1.0f;
            if (SWIGLU) {
                if (lane == (r & 31) && r < rows) {
                    const float g = NORM ? s * acc[r][0] : acc[r][0], u = NORM ? s * acc[r][1] : acc[r][1];
                    out[(size_t)r * n_out + o0] = silu(g) * u;
                }
            } else {
#pragma unroll
                for (int w = 0; w < NW; w++)
                    if (lane == ((r * NW + w) & 31) && r < rows && o0 + w < n_out) {
                        float* o = out + (size_t)r * n_out + o0 + w;
                        *o = MODE == GEMV_ADD ? *o + acc[r][w] : (NORM ? s * acc[r][w] : acc[r][w]);
                    }
            }
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int w = 0; w < NW; w++) red[warp][r * NW + w] = acc[r][w];
            if (NORM) red[warp][R * NW + (NORM ? r : 0)] = ss[r];
        }
    }
    __syncthreads();
    if (active && kw == 0) {
        if (SWIGLU) {
            for (int r = lane; r < R; r += 32) {
                float g = red[warp][r * NW], u = red[warp][r * NW + 1];
                float q = NORM ? red[warp][R * NW + (NORM ? r : 0)] : 0.0f;
                for (int k = 1; k < ks; k++) {
                    g += red[warp + k][r * NW];
                    u += red[warp + k][r * NW + 1];
                    if (NORM) q += red[warp + k][R * NW + (NORM ? r : 0)];
                }
                if (NORM) {
                    const float s = gemv_norm_scale(q, n_in, eps);
                    g *= s;
                    u *= s;
                }
                if (r < rows) out[(size_t)r * n_out + o0] = silu(g) * u;
            }
        } else {
            for (int i = lane; i < R * NW; i += 32) {
                float v = red[warp][i];
                for (int k = 1; k < ks; k++) v += red[warp + k][i];
                const int r = i / NW, w = i % NW;
                if (NORM) {
                    float q = red[warp][R * NW + (NORM ? r : 0)];
                    for (int k = 1; k < ks; k++) q += red[warp + k][R * NW + (NORM ? r : 0)];
                    v *= gemv_norm_scale(q, n_in, eps);
                }
                if (r < rows && o0 + w < n_out) {
                    float* o = out + (size_t)r * n_out + o0 + w;
                    *o = MODE == GEMV_ADD ? *o + v : v;
                }
            }
        }
    }
}

// Every kernel family is instantiated for these x row counts R (GEMV_R in matmul.rs): M(args,
// R) for each.
#define GEMV_EACH_R(M, ...) \
    M(__VA_ARGS__, 1) M(__VA_ARGS__, 2) M(__VA_ARGS__, 4) M(__VA_ARGS__, 8) M(__VA_ARGS__, 9) M(__VA_ARGS__, 16)

#define GEMV_KERNEL(name, TYPE, R)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_##name##_r##R(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,               \
                           const float* __restrict__ x, int rows, float* __restrict__ out, int ks) {        \
        gemv<TYPE, R>(W, rb, n_out, n_in, x, rows, out, ks, nullptr, blockIdx.x);                           \
    }
#define GEMV_ALL_R(name, TYPE) \
    GEMV_EACH_R(GEMV_KERNEL, name, TYPE) GEMV_ROWS_KERNEL(name, TYPE)

// gemv_<type>_rows: a small-output weight (n_out <= F32_SMALL_OUT: the MoE routers, Qwen3.5's
// beta / alpha projections) at more than 16 rows, i.e. in a prefill. Block (x, y) is block x of
// the 16-row launch on rows 16 y .. 16 y + 15, so every row's sums are the 16-row launch's (a
// lane's fmaf chain depends on (type, n_in, ks) alone, never on R or the row's place) and the
// routing stays the decode's, as before; but in one launch, not one per 16 rows (Qwen3-30B-A3B
// at pp512: 32 launches of ~8 µs a layer, a quarter of the forward: MOE.md, 41st session).
#define GEMV_ROWS_KERNEL(name, TYPE)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_##name##_rows(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,               \
                           const float* __restrict__ x, int rows, float* __restrict__ out, int ks) {        \
        const int r0 = 16 * (int)blockIdx.y;                                                                \
        const int n = rows - r0 < 16 ? rows - r0 : 16;                                                      \
        const float* xc = x + (size_t)r0 * (size_t)n_in;                                                    \
        float* oc = out + (size_t)r0 * (size_t)n_out;                                                       \
        if (n == 16) /* a full chunk: rows the constant 16 (PAD_ROWS) */                                    \
            gemv<TYPE, 16>(W, rb, n_out, n_in, xc, 16, oc, ks, nullptr, blockIdx.x);                        \
        else                                                                                                \
            gemv<TYPE, 16>(W, rb, n_out, n_in, xc, n, oc, ks, nullptr, blockIdx.x);                         \
    }

// gemv_f32_xs_j<J>: gemv_f32_rows's sums with x held in registers. There every block (NW = 2
// outputs × 16 rows, ks warps a row group) reads its 16 rows of x whole, so at Qwen3-30B-A3B's
// router (2048 -> 128, ks = 8) a pp512 reads x 64 times from L2 (268 MB: 40 µs a layer, 8% of
// the forward; MOE.md, 49th session). Here a block's lanes hold XS_RB rows of x, each lane the J
// quads its chain reads (i = lane + 32 kw + 32 ks j, as gemv_lane; n_in / 4 = 32 ks J exactly:
// matmul.rs picks this kernel only then), and stream the weight rows of the k-group's `opb`
// outputs past them, XS_OB at a time. Per (row, output): the lane's fmaf chain is gemv_lane's
// (quads in j order, .x .. .w each), the 32 lanes' partials add in the xor butterfly's pairs,
// and the ks warp totals in warp order, so every output has gemv_f32_rows's bits (and the
// one-row decode GEMV's: check's matmul_rows_same_as_alone). The lanes reduce by a
// reduce-scatter over the batch's XS_RB · XS_OB = 32 values: at each level (xor 16, 8, .., 1)
// lane l keeps the half of its values that its bit selects and adds its partner's partial of
// each, the butterfly's very pair sums (own + other, the same bits in either lane), so that
// after five levels lane l holds value l: 31 shuffles for 32 values instead of 160.
#define XS_RB 8
#define XS_OB 4
// One level of that reduce-scatter: lane l keeps values [0, OFF) of its half (values OFF.. where
// its bit OFF is set), adding the partner's partial of each (a template: every index a constant,
// so the values stay in registers).
template <int OFF>
__device__ __forceinline__ void xs_level(float (&acc)[XS_RB * XS_OB], int lane) {
    const bool hi = lane & OFF;
#pragma unroll
    for (int m = 0; m < OFF; m++) {
        const float send = hi ? acc[m] : acc[m + OFF], keep = hi ? acc[m + OFF] : acc[m];
        acc[m] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
}
template <int J>
__device__ __forceinline__ void gemv_f32_xs(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                            const float* __restrict__ x, int rows, float* __restrict__ out, int ks,
                                            int opb) {
    __shared__ float red[GEMV_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kg = warp / ks, kw = warp % ks, KG = GEMV_WARPS / ks;
    const int r0 = (int)blockIdx.y * XS_RB;
    const int us = 32 * ks, u0 = lane + 32 * kw;
    const int ob0 = ((int)blockIdx.x * KG + kg) * opb;
    // The block's weight rows (every k-group's) into L2, then the PDL wait (x is the last
    // kernel's output).
    gemv_prologue(W, nullptr, rb, n_out, (int)blockIdx.x * KG * opb, ((int)blockIdx.x + 1) * KG * opb);
    float4 xv[XS_RB][J];
#pragma unroll
    for (int r = 0; r < XS_RB; r++) {
#pragma unroll
        for (int j = 0; j < J; j++)
            xv[r][j] = r0 + r < rows ? __ldg((const float4*)(x + (size_t)(r0 + r) * n_in) + u0 + us * j)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int b = 0; b < opb; b += XS_OB) {
        float acc[XS_RB * XS_OB];  // value r · XS_OB + q: row r0 + r, output ob0 + b + q
#pragma unroll
        for (int v = 0; v < XS_RB * XS_OB; v++) acc[v] = 0.0f;
#pragma unroll
        for (int q = 0; q < XS_OB; q++) {
            const int o = min(ob0 + b + q, n_out - 1);  // past n_out: computed, not stored
            const float4* wr = (const float4*)(W + (size_t)o * (size_t)rb);
#pragma unroll
            for (int j = 0; j < J; j++) {
                // A plain load, not gemv_lane's streaming one: every row chunk's blocks read
                // these rows again (1 MB a router). Measured the same as the streaming load
                // (20.5 against 20.6 µs a layer, MOE.md 49th session): kept for the reuse.
                const float4 w4 = __ldg(wr + u0 + us * j);
#pragma unroll
                for (int r = 0; r < XS_RB; r++) {
                    float& a = acc[r * XS_OB + q];
                    a = fmaf(w4.x, xv[r][j].x, a);
                    a = fmaf(w4.y, xv[r][j].y, a);
                    a = fmaf(w4.z, xv[r][j].z, a);
                    a = fmaf(w4.w, xv[r][j].w, a);
                }
            }
        }
        xs_level<16>(acc, lane);
        xs_level<8>(acc, lane);
        xs_level<4>(acc, lane);
        xs_level<2>(acc, lane);
        xs_level<1>(acc, lane);
        red[warp][lane] = acc[0];
        __syncthreads();
        if (kw == 0) {
            float v = red[warp][lane];
            for (int k = 1; k < ks; k++) v += red[warp + k][lane];
            const int r = lane / XS_OB, o = ob0 + b + lane % XS_OB;
            if (r0 + r < rows && o < n_out && b + lane % XS_OB < opb) out[(size_t)(r0 + r) * n_out + o] = v;
        }
        __syncthreads();
    }
}
#define GEMV_F32_XS_KERNEL(J)                                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2)                                        \
        gemv_f32_xs_j##J(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,                  \
                         const float* __restrict__ x, int rows, float* __restrict__ out, int ks, int opb) { \
        gemv_f32_xs<J>(W, rb, n_out, n_in, x, rows, out, ks, opb);                                          \
    }
GEMV_F32_XS_KERNEL(1)
GEMV_F32_XS_KERNEL(2)

// Up to three weights of one type and row length reading the same x (Q, K, V) in one launch:
// blocks [0, b0) are weight 0's row groups, [b0, b0 + b1) weight 1's, the rest weight 2's. Each
// output is computed exactly as by a single-weight launch with the same ks.
struct GemvSegs {
    const uint8_t* w0;
    const uint8_t* w1;
    const uint8_t* w2;
    float* out0;
    float* out1;
    float* out2;
    int n0, n1, n2;
    int b0, b1;
};

// A mixed grouped launch's block index: blockIdx.x, or VF (V first) the blocks in reverse
// order, so that the last segment's are dispatched first.
template <bool VF>
__device__ __forceinline__ int mixed_bx() {
    return VF ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
}

// The segment of block bx, and bx made relative to it.
__device__ __forceinline__ int gemv_seg(const GemvSegs& sg, int& bx) {
    if (bx < sg.b0) return 0;
    bx -= sg.b0;
    if (bx < sg.b1) return 1;
    bx -= sg.b1;
    return 2;
}

#define GEMV_SWIGLU_KERNEL(name, TYPE, R)                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_swiglu_##name##_r##R(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2, long long rb, \
                                  int n_out, int n_in, const float* __restrict__ x, int rows,               \
                                  float* __restrict__ out, int ks) {                                        \
        gemv<TYPE, R, true>(W, rb, n_out, n_in, x, rows, out, ks, W2, blockIdx.x);                          \
    }
#define GEMV_SWIGLU_ALL_R(name, TYPE) GEMV_EACH_R(GEMV_SWIGLU_KERNEL, name, TYPE)

GEMV_SWIGLU_ALL_R(f32, GGML_F32)
GEMV_SWIGLU_ALL_R(f16, GGML_F16)
GEMV_SWIGLU_ALL_R(bf16, GGML_BF16)

// gemv_multi_<type>_r<R>: 2-3 weights of one type and row length reading the same f32 x in
// one launch (segments as gemvq_multi). Every type has it: the float types' Q, K, V, and the
// quantized types' small-output weights (<= F32_SMALL_OUT rows, matmul.rs: the Qwen3.5
// beta/alpha projections), which keep the f32-x GEMV.
#define GEMV_MULTI_KERNEL(name, TYPE, R)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_multi_##name##_r##R(GemvSegs sg, long long rb, int n_in, const float* __restrict__ x, int rows, \
                                 int ks) {                                                                  \
        int bx = blockIdx.x;                                                                                \
        const int s = gemv_seg(sg, bx);                                                                     \
        const uint8_t* W = s == 0 ? sg.w0 : (s == 1 ? sg.w1 : sg.w2);                                      \
        float* out = s == 0 ? sg.out0 : (s == 1 ? sg.out1 : sg.out2);                                      \
        const int n_out = s == 0 ? sg.n0 : (s == 1 ? sg.n1 : sg.n2);                                       \
        gemv<TYPE, R, false>(W, rb, n_out, n_in, x, rows, out, ks, nullptr, bx);                            \
    }
#define GEMV_MULTI_ALL_R(name, TYPE) GEMV_EACH_R(GEMV_MULTI_KERNEL, name, TYPE)
GEMV_MULTI_ALL_R(f32, GGML_F32)
GEMV_MULTI_ALL_R(f16, GGML_F16)
GEMV_MULTI_ALL_R(bf16, GGML_BF16)
GEMV_MULTI_ALL_R(q8_0, GGML_Q8_0)
GEMV_MULTI_ALL_R(q4_0, GGML_Q4_0)
GEMV_MULTI_ALL_R(q4_1, GGML_Q4_1)
GEMV_MULTI_ALL_R(q4_k, GGML_Q4_K)
GEMV_MULTI_ALL_R(q5_k, GGML_Q5_K)
GEMV_MULTI_ALL_R(q6_k, GGML_Q6_K)

// The deferred-RMSNorm and residual-add forms (float types; matmul.rs `rms_norm_matmuls`,
// `rms_norm_matmul_swiglu`, `matmul_add`): the plain, SwiGLU and grouped kernels above with
// x the raw residual row and the norm's weight nw (gemv_lane_norm), or out += W x.
// Rows per warp of the plain and grouped deferred-norm GEMVs (matmul.rs DEFER_NW): each x
// float4 comes with a float4 of the norm weight, so twice the plain GEMV's rows keep the
// L1 reads per weight byte where the plain GEMV has them (MATMUL.md round 23).
#define GEMV_NORM_NW 4
#define GEMV_NORM_KERNEL(name, TYPE, R)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_norm_##name##_r##R(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,          \
                                const float* __restrict__ x, int rows, float* __restrict__ out, int ks,     \
                                const float* __restrict__ nw, float eps) {                                  \
        gemv<TYPE, R, false, GEMV_NORM, GEMV_NORM_NW>(W, rb, n_out, n_in, x, rows, out, ks, nullptr, blockIdx.x, \
                                                     nw, eps);                                              \
    }
#define GEMV_ADD_KERNEL(name, TYPE, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_add_##name##_r##R(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,           \
                               const float* __restrict__ x, int rows, float* __restrict__ out, int ks) {    \
        gemv<TYPE, R, false, GEMV_ADD>(W, rb, n_out, n_in, x, rows, out, ks, nullptr, blockIdx.x);          \
    }
#define GEMV_SWIGLU_NORM_KERNEL(name, TYPE, R)                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_swiglu_norm_##name##_r##R(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,      \
                                       long long rb, int n_out, int n_in, const float* __restrict__ x,      \
                                       int rows, float* __restrict__ out, int ks,                           \
                                       const float* __restrict__ nw, float eps) {                           \
        gemv<TYPE, R, true, GEMV_NORM>(W, rb, n_out, n_in, x, rows, out, ks, W2, blockIdx.x, nw, eps);      \
    }
#define GEMV_MULTI_NORM_KERNEL(name, TYPE, R)                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_multi_norm_##name##_r##R(GemvSegs sg, long long rb, int n_in, const float* __restrict__ x,    \
                                      int rows, int ks, const float* __restrict__ nw, float eps) {          \
        int bx = blockIdx.x;                                                                                \
        const int s = gemv_seg(sg, bx);                                                                     \
        const uint8_t* W = s == 0 ? sg.w0 : (s == 1 ? sg.w1 : sg.w2);                                      \
        float* out = s == 0 ? sg.out0 : (s == 1 ? sg.out1 : sg.out2);                                      \
        const int n_out = s == 0 ? sg.n0 : (s == 1 ? sg.n1 : sg.n2);                                       \
        gemv<TYPE, R, false, GEMV_NORM, GEMV_NORM_NW>(W, rb, n_out, n_in, x, rows, out, ks, nullptr, bx, nw, eps); \
    }
#define GEMV_DEFERRED_ALL_R(name, TYPE)                \
    GEMV_EACH_R(GEMV_NORM_KERNEL, name, TYPE)          \
    GEMV_EACH_R(GEMV_ADD_KERNEL, name, TYPE)           \
    GEMV_EACH_R(GEMV_SWIGLU_NORM_KERNEL, name, TYPE)   \
    GEMV_EACH_R(GEMV_MULTI_NORM_KERNEL, name, TYPE)
GEMV_DEFERRED_ALL_R(f32, GGML_F32)
GEMV_DEFERRED_ALL_R(f16, GGML_F16)
GEMV_DEFERRED_ALL_R(bf16, GGML_BF16)

GEMV_ALL_R(f32, GGML_F32)
GEMV_ALL_R(f16, GGML_F16)
GEMV_ALL_R(bf16, GGML_BF16)
GEMV_ALL_R(q8_0, GGML_Q8_0)
GEMV_ALL_R(q4_0, GGML_Q4_0)
GEMV_ALL_R(q4_1, GGML_Q4_1)
GEMV_ALL_R(q4_k, GGML_Q4_K)
GEMV_ALL_R(q5_k, GGML_Q5_K)
GEMV_ALL_R(q6_k, GGML_Q6_K)

// ---------------------------------------------------------------------------------------
// 1b. Quantized-activation GEMV: gemvq_<type>_r<R> for the quantized weight types (decode,
//     rows <= 16). Replaces the f32 GEMV for Q8_0 Q4_0 Q4_1 Q4_K Q5_K Q6_K.
//
//  Why: the f32 GEMV spent ~7 instructions per weight element (nibble -> float, dequant FMA,
//  FMA with x, header decode per 8 elements) against a budget of ~4.7 at 4.3 TB/s for Q4_K,
//  so it ran at 0.7-1.0 TB/s. With x in int8 one dp4a multiplies 4 weights by 4 activations:
//  ~2 instructions per element for Q4_K, ~3 for Q6_K, ~1.5 for Q8_0, leaving the kernel
//  bandwidth-bound.
//
//  Precision: x is held as two int8 planes per 32-element block, x ~ d (127 hi + lo): hi is
//  x rounded at step d1 = amax / 127 (ggml's q8_1), lo the residual rounded at d = d1 / 127.
//  The error is <= d / 2 per element (relative ~3e-5 of amax, NMSE ~1e-9 on a dot product:
//  near the f32 GEMV, where a single int8 plane gave ~3e-5 and flipped the prefill/decode
//  argmax gate on random-weight models with near-tied logits). Each weight word takes two
//  dp4a (hi and lo); 127 * sum(w hi) + sum(w lo) is an exact int32 (|.| < 2^27). Weights
//  exact; scales applied in f32. Every output is a fixed sequence of operations whatever R
//  is (padded rows recompute the last real row), so decode and speculative verify agree
//  bitwise, as for the f32 GEMV.
//
//  quant_x_q8: one warp per 32-element block of x: absmax by xor butterfly, hi, lo as above,
//  s = d * sum(127 hi + lo). xq [rows][2][n_in] int8 (the hi plane, then the lo plane),
//  xd [rows][n_in/32] float2 (d, s). With `early` it triggers its dependent launch before its
//  own PDL wait: the GEMV reading the planes (the down projection) is scheduled as the
//  SwiGLU's blocks retire and copies its tiles in their tail (MATMUL.md round 25).
//
//  Block/warp structure as gemv_ (8 warps, row groups of NW = 2 rows, ks warps split K). A lane
//  "unit" is 32 weight elements:
//    Q8_0 / Q4_0 / Q4_1: one block (34 / 18 / 20 B). Q8_0 and Q4_0 quants sit at offset 2
//      (2-byte aligned): aligned words + funnel shifts. Q4_1 is 4-byte aligned.
//    Q4_K / Q5_K: 8 units per super-block: lane l8 = lane % 8 = (g = l8/2, h = l8%2) reads the
//      16 qs bytes 32g + 16h.. (one 16-B load: the low nibbles are elements 16h.. of sub-block
//      2g, the high nibbles elements 16h.. of sub-block 2g+1) and the 16-B header (a broadcast
//      across the 8 lanes), whose pair scales and mins it decodes branch-free
//      (kq_pair_scales); Q5_K also qh bytes 16h.. . The min term uses the x block sums s and
//      is added by the h = 0 lane only. A warp step covers 4 super-blocks, 128 contiguous
//      bytes per super-block per load instruction. Q4_K's high nibbles stay in place (16x,
//      unsigned dp4a; 1/16 in the float scale). (4 lanes per super-block, 64 weights each,
//      halved the instructions per weight but was slower: MATMUL.md round 7.)
//    Q6_K: 8 units per super-block: l8 = (n = l8/4, p = l8/2 % 2, c = l8 % 2) reads ql bytes
//      64n + 32p + 16c.. (low nibbles: quarter p, high: quarter p + 2) and qh bytes 32n + 16c..
//      (2-byte aligned: funnel shifts), two int8 scales (16-element sub-blocks) and d.
//  Bytes moved per output row: its stored bytes once (streaming loads); x is 1.0625 B per
//  element per row of x from L1/L2 (1/4 of the f32 GEMV's x traffic).
//
//  gemvq_swiglu_<type>: the same with the NW = 2 rows of a group being row o of the gate and
//  row o of the up weight: out[o] = silu(gate . x) * (up . x): the FFN's first half in one
//  kernel, one read of x for both.

// Signed byte-wise dot product of 4 int8 pairs added to c.
__device__ __forceinline__ int dp4(uint32_t a, uint32_t b, int c) { return __dp4a((int)a, (int)b, c); }

// Dot product of 4 unsigned bytes a (weights >= 0: K-quant nibbles, possibly x16) with 4
// signed bytes b (x) added to c.
__device__ __forceinline__ int dp4u(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}


// The 16 bytes at p (2-byte aligned) as four little-endian words: 5 aligned loads (the 5th
// only when p is 2 mod 4) and funnel shifts.
// SM: the bytes are in shared memory (the bulk-copy GEMV), read with plain loads; otherwise
// global memory, streaming loads.
template <bool SM>
__device__ __forceinline__ uint32_t wld4(const uint32_t* p) { return SM ? *p : ldw(p); }
template <bool SM>
__device__ __forceinline__ uint4 wld16(const uint8_t* p) {
    return SM ? *(const uint4*)p : __ldcs((const uint4*)p);
}
template <bool SM>
__device__ __forceinline__ uint16_t wld2(const uint8_t* p) { return SM ? *(const uint16_t*)p : ld2(p); }
template <bool SM>
__device__ __forceinline__ int wld1s(const uint8_t* p) {
    return SM ? (int)*(const int8_t*)p : (int)(int8_t)__ldcs((const signed char*)p);
}

template <bool SM = false>
__device__ __forceinline__ void ld16_a2(const uint8_t* p, uint32_t (&w)[4]) {
    // (The aligned word is rebuilt from an integer, so the shared-memory form compiles to
    // generic loads (LD.E); pointer arithmetic on p gives LDS but was slower for Q8_0 on the
    // H200 (4096² 7.3 -> 8.2 us, 48 registers + 8 B of stack): MATMUL.md round 7.)
    const size_t a = (size_t)p;
    const uint32_t* q = (const uint32_t*)(a & ~(size_t)3);
    const uint32_t sh = (uint32_t)(a & 3) * 8;
    uint32_t v[5];
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = wld4<SM>(q + i);
    v[4] = sh ? wld4<SM>(q + 4) : 0u;
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = __funnelshift_r(v[i], v[i + 1], sh);
}

extern "C" __global__ void quant_x_q8(const float* __restrict__ x, int rows, int n_in, int8_t* __restrict__ xq,
                                      float2* __restrict__ xd, int early) {
    PDL_ENTRY_IF_EARLY(early);
    const int nb = n_in / QK;
    const long long blk = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= (long long)rows * nb) return;  // whole warp
    const int lane = threadIdx.x & 31;
    const long long row = blk / nb;
    quant_q8_lane(x[blk * QK + lane], lane, xq + row * 2 * (long long)n_in, n_in, (int)(blk % nb) * QK + lane,
                  xd + blk);
}

// Per type: this lane's share of the NW rows `wr` against R rows of quantized x, into acc.
// Units (32 weight elements each) are split over the ks warps as in gemv_lane.
template <int TYPE, int R, int NW, bool SM = false>
__device__ __forceinline__ void gemvq_lane(const uint8_t* const (&wr)[NW], int n_in, const int8_t* __restrict__ xq,
                                           const float2* __restrict__ xd, int rows, int lane, int kw, int ks,
                                           float (&acc)[R][NW]) {
    const int nb = n_in / QK;  // 32-element units per row
    const int us = 32 * ks;
    if (TYPE == GGML_Q8_0 || TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1) {
#pragma unroll GEMV_UNROLL_K
        for (int u = lane + 32 * kw; u < nb; u += us) {
            uint32_t q[NW][8];
            float dw[NW], mw[NW];
#pragma unroll
            for (int w = 0; w < NW; w++) {
                if (TYPE == GGML_Q8_0) {
                    const uint8_t* blk = wr[w] + (size_t)u * Q8_0_BYTES;
                    dw[w] = h2f(wld2<SM>(blk));
                    uint32_t a[4], b[4];
                    ld16_a2<SM>(blk + 2, a);
                    ld16_a2<SM>(blk + 18, b);
#pragma unroll
                    for (int i = 0; i < 4; i++) { q[w][i] = a[i]; q[w][4 + i] = b[i]; }
                } else if (TYPE == GGML_Q4_0) {
                    const uint8_t* blk = wr[w] + (size_t)u * Q4_0_BYTES;
                    dw[w] = h2f(wld2<SM>(blk));
                    uint32_t a[4];
                    ld16_a2<SM>(blk + 2, a);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        q[w][i] = a[i] & 0x0F0F0F0Fu;
                        q[w][4 + i] = (a[i] >> 4) & 0x0F0F0F0Fu;
                    }
                } else {
                    const uint8_t* blk = wr[w] + (size_t)u * Q4_1_BYTES;  // 4-aligned
                    const uint32_t dm = wld4<SM>((const uint32_t*)blk);
                    dw[w] = h2f(dm & 0xFFFF);
                    mw[w] = h2f(dm >> 16);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const uint32_t a = wld4<SM>((const uint32_t*)(blk + 4) + i);
                        q[w][i] = a & 0x0F0F0F0Fu;
                        q[w][4 + i] = (a >> 4) & 0x0F0F0F0Fu;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
                const int8_t* xr = xq + (size_t)r * 2 * n_in + (size_t)u * QK;
                const int4* xp = (const int4*)xr;
                const int4* yp = (const int4*)(xr + n_in);
                const int4 x0 = __ldg(xp), x1 = __ldg(xp + 1), y0 = __ldg(yp), y1 = __ldg(yp + 1);
                const float2 ds = __ldg(xd + (size_t)r * nb + u);
                const uint32_t xv[8] = {(uint32_t)x0.x, (uint32_t)x0.y, (uint32_t)x0.z, (uint32_t)x0.w,
                                        (uint32_t)x1.x, (uint32_t)x1.y, (uint32_t)x1.z, (uint32_t)x1.w};
                const uint32_t yv[8] = {(uint32_t)y0.x, (uint32_t)y0.y, (uint32_t)y0.z, (uint32_t)y0.w,
                                        (uint32_t)y1.x, (uint32_t)y1.y, (uint32_t)y1.z, (uint32_t)y1.w};
#pragma unroll
                for (int w = 0; w < NW; w++) {
                    int sh = 0, sl = 0;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        sh = dp4(q[w][i], xv[i], sh);
                        sl = dp4(q[w][i], yv[i], sl);
                    }
                    const int s = 127 * sh + sl;
                    if (TYPE == GGML_Q8_0) {
                        acc[r][w] = fmaf(dw[w] * ds.x, (float)s, acc[r][w]);
                    } else if (TYPE == GGML_Q4_0) {
                        acc[r][w] = fmaf(dw[w], fmaf(ds.x, (float)s, -8.0f * ds.y), acc[r][w]);
                    } else {
                        acc[r][w] = fmaf(dw[w] * ds.x, (float)s, fmaf(mw[w], ds.y, acc[r][w]));
                    }
                }
            }
        }
    } else if (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
        // Lane l8 = lane % 8 = (g = l8 / 2, h = l8 % 2) of super-block lane / 8 of the step: qs
        // bytes 32g + 16h.. (low nibbles: elements 16h.. of sub-block 2g, high nibbles: of
        // sub-block 2g+1). The pair's scales and mins without a branch on g (kq_pair_scales);
        // Q4_K's high nibbles stay in place (q & 0xF0F0F0F0 = 16 x the nibble, unsigned bytes:
        // dp4u), the 1/16 folded into the x scale of sub-block 2g+1 (an exact power of two).
        constexpr bool K4 = TYPE == GGML_Q4_K;
        const int l8 = lane & 7, g = l8 >> 1, h = l8 & 1;
        const int nsb = n_in / QK_K;
        const int bytes = K4 ? Q4_K_BYTES : Q5_K_BYTES;
        const float mfac = h ? 0.0f : 1.0f;  // the min term once per sub-block (h = 0 lanes)
        const KqPairSel sel = kq_pair_sel(g);
        const float hscale = K4 ? 0.0625f : 1.0f;
#pragma unroll GEMV_UNROLL_K
        for (int s = (lane >> 3) + 4 * kw; s < nsb; s += 4 * ks) {
            uint32_t lo[NW][4], hi[NW][4];
            float d[NW], dmin[NW], sc0[NW], m0[NW], sc1[NW], m1[NW];
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const uint8_t* blk = wr[w] + (size_t)s * bytes;  // 16-aligned
                const uint4 hd = wld16<SM>(blk);
                const uint4 qv = wld16<SM>(blk + (K4 ? 16 : 48) + 32 * g + 16 * h);
                d[w] = h2f(hd.x & 0xFFFF);
                dmin[w] = h2f(hd.x >> 16);
                const uint32_t sm = kq_pair_scales(sel, hd.y, hd.z, hd.w);
                sc0[w] = byte_fb<0, 0>(sm);
                sc1[w] = byte_fb<1, 0>(sm);
                m0[w] = byte_fb<2, 0>(sm);
                m1[w] = byte_fb<3, 0>(sm);
                const uint32_t qa[4] = {qv.x, qv.y, qv.z, qv.w};
                if (K4) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        lo[w][i] = qa[i] & 0x0F0F0F0Fu;
                        hi[w][i] = qa[i] & 0xF0F0F0F0u;
                    }
                } else {
                    const uint4 hv = wld16<SM>(blk + 16 + 16 * h);
                    const uint32_t ha[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        lo[w][i] = (qa[i] & 0x0F0F0F0Fu) | (((ha[i] >> (2 * g)) & 0x01010101u) << 4);
                        hi[w][i] = ((qa[i] >> 4) & 0x0F0F0F0Fu) | (((ha[i] >> (2 * g + 1)) & 0x01010101u) << 4);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
                const int8_t* xr = xq + (size_t)r * 2 * n_in + (size_t)s * QK_K + 64 * g + 16 * h;
                const int4 x0 = __ldg((const int4*)xr), x1 = __ldg((const int4*)(xr + 32));
                const int4 y0 = __ldg((const int4*)(xr + n_in)), y1 = __ldg((const int4*)(xr + n_in + 32));
                const float4 ds = __ldg((const float4*)(xd + (size_t)r * nb + (size_t)s * 8 + 2 * g));
                const uint32_t xa[4] = {(uint32_t)x0.x, (uint32_t)x0.y, (uint32_t)x0.z, (uint32_t)x0.w};
                const uint32_t xb[4] = {(uint32_t)x1.x, (uint32_t)x1.y, (uint32_t)x1.z, (uint32_t)x1.w};
                const uint32_t ya[4] = {(uint32_t)y0.x, (uint32_t)y0.y, (uint32_t)y0.z, (uint32_t)y0.w};
                const uint32_t yb[4] = {(uint32_t)y1.x, (uint32_t)y1.y, (uint32_t)y1.z, (uint32_t)y1.w};
                const float dzb = ds.z * hscale;
#pragma unroll
                for (int w = 0; w < NW; w++) {
                    int sa = 0, sb = 0, la = 0, lb = 0;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        sa = dp4u(lo[w][i], xa[i], sa);
                        sb = dp4u(hi[w][i], xb[i], sb);
                        la = dp4u(lo[w][i], ya[i], la);
                        lb = dp4u(hi[w][i], yb[i], lb);
                    }
                    // |127 sb + lb| <= 127 * 16 * 240 * 128 < 2^26 (Q4_K's 16x high nibbles).
                    sa = 127 * sa + la;
                    sb = 127 * sb + lb;
                    const float t = fmaf(sc1[w] * dzb, (float)sb, sc0[w] * ds.x * (float)sa);
                    const float mm = mfac * fmaf(m1[w], ds.w, m0[w] * ds.y);
                    acc[r][w] = fmaf(d[w], t, fmaf(-dmin[w], mm, acc[r][w]));
                }
            }
        }
    } else if (TYPE == GGML_Q6_K) {
        const int l8 = lane & 7, n = l8 >> 2, p = (l8 >> 1) & 1, c = l8 & 1;
        const int nsb = n_in / QK_K;
#pragma unroll GEMV_UNROLL_K
        for (int s = (lane >> 3) + 4 * kw; s < nsb; s += 4 * ks) {
            uint32_t lo[NW][4], hi[NW][4];
            float da[NW], db[NW];
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const uint8_t* blk = wr[w] + (size_t)s * Q6_K_BYTES;  // 2-aligned
                uint32_t ql[4], qh[4];
                ld16_a2<SM>(blk + 64 * n + 32 * p + 16 * c, ql);
                ld16_a2<SM>(blk + 128 + 32 * n + 16 * c, qh);
                const float d = h2f(wld2<SM>(blk + 208));
                const int si = 192 + 8 * n + c + 2 * p;
                da[w] = d * (float)wld1s<SM>(blk + si);
                db[w] = d * (float)wld1s<SM>(blk + si + 4);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const uint32_t h0 = (qh[i] >> (2 * p)) & 0x03030303u;
                    const uint32_t h1 = (qh[i] >> (2 * p + 4)) & 0x03030303u;
                    lo[w][i] = __vsub4((ql[i] & 0x0F0F0F0Fu) | (h0 << 4), 0x20202020u);
                    hi[w][i] = __vsub4(((ql[i] >> 4) & 0x0F0F0F0Fu) | (h1 << 4), 0x20202020u);
                }
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
                const int e = s * QK_K + 128 * n + 32 * p + 16 * c;
                const int8_t* xr = xq + (size_t)r * 2 * n_in + e;
                const int4 x0 = __ldg((const int4*)xr), x1 = __ldg((const int4*)(xr + 64));
                const int4 y0 = __ldg((const int4*)(xr + n_in)), y1 = __ldg((const int4*)(xr + n_in + 64));
                const float dxa = __ldg(xd + (size_t)r * nb + e / QK).x;
                const float dxb = __ldg(xd + (size_t)r * nb + e / QK + 2).x;
                const uint32_t xa[4] = {(uint32_t)x0.x, (uint32_t)x0.y, (uint32_t)x0.z, (uint32_t)x0.w};
                const uint32_t xb[4] = {(uint32_t)x1.x, (uint32_t)x1.y, (uint32_t)x1.z, (uint32_t)x1.w};
                const uint32_t ya[4] = {(uint32_t)y0.x, (uint32_t)y0.y, (uint32_t)y0.z, (uint32_t)y0.w};
                const uint32_t yb[4] = {(uint32_t)y1.x, (uint32_t)y1.y, (uint32_t)y1.z, (uint32_t)y1.w};
#pragma unroll
                for (int w = 0; w < NW; w++) {
                    int sa = 0, sb = 0, la = 0, lb = 0;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        sa = dp4(lo[w][i], xa[i], sa);
                        sb = dp4(hi[w][i], xb[i], sb);
                        la = dp4(lo[w][i], ya[i], la);
                        lb = dp4(hi[w][i], yb[i], lb);
                    }
                    sa = 127 * sa + la;
                    sb = 127 * sb + lb;
                    acc[r][w] = fmaf(db[w] * dxb, (float)sb, fmaf(da[w] * dxa, (float)sa, acc[r][w]));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// 1b'. The Q4_K and Q6_K decode GEMVs on the int8 tensor cores (sm_90+, one 16-row tile per
//      block, rows whose tile fits 64 KB: matmul.rs tc_form): the gemvq_tc_* kernels, separate
//      instances so that their register count is their own (FERRITE_GEMV_TC=0: the lane
//      code); the 8-row tile for long rows (gemvq_tch_*, FERRITE_GEMV_TC=3) and the 16-row
//      tile over K slices (gemvq_tck_*). MATMUL.md rounds 8, 9 and 11. The Q4_K form is
//      described here, the Q6_K one at gemvq_tc_q6k.
//
//  Why: timed apart (FERRITE_GEMV_DIAG), the dp4a lane code's compute on a block's copied rows
//  took as long as the copy itself (q4_K SwiGLU 4096->12288: copy only 16.8 us, compute only
//  17.0, both 24.2): ~175 instructions per 64 weight-rows per lane, most of them integer ops
//  (dp4a x2 planes, nibble masks, address arithmetic), which issue at half rate. Here the
//  integer dot products run on the tensor cores: one mma.sync m16n8k32 (u8 weights x s8 x)
//  multiplies 16 rows x 32 columns, so per 16 weight-rows x 128 columns a thread spends 4
//  shared loads, 16 masks and 4 MMAs, plus one scale epilogue per (row, 32-element block).
//
//  The tile is the block's 16 rows in two copies of 8 rows (plain: rows r0.. and r0 + 8..;
//  SwiGLU: the 8 gate rows and the same 8 up rows), in two slots whose bases differ by 64
//  bytes modulo 128 (tc_slot), and MMA row a reads row a / 2 of slot a % 2: the two rows a
//  quarter-warp loads together (g = 2k, 2k + 1) then sit in different banks (rows are
//  multiples of 128 bytes apart: within one slot every 16-B load of a row pair would
//  conflict two ways, measured 7.4 wavefronts per load). Warp w takes super-blocks w, w + 8,
//  ... of every row. A "lifetime" is half a super-block (chunks c, c + 1 of 32 qs bytes, c in
//  {0, 2}: sub-blocks 2c .. 2c + 3): 4 MMAs into one int32 accumulator, then the epilogue.
//  - K slices: the 32 k of an MMA are 4 slices of 8; slice s holds 8 weights of sub-block
//    2c + s (slices 0, 2: low nibbles of chunks c, c + 1; slices 1, 3: their high nibbles,
//    kept in place, 16x: u8 up to 240; the 1/16 is folded into the x scale).
//  - A (fragment rows g = lane / 4 and g + 8, t = lane % 4): a0/a1 hold k 4t.. (slice t / 2),
//    a2/a3 k 16 + 4t.. (slice 2 + t / 2). Thread t loads the 16 qs bytes 16 (t % 2).. of
//    chunks c and c + 1 of both its rows (4 x 16-B loads) and masks low (t < 2) or high
//    (t >= 2) nibbles; MMA i takes word i: the weights 16 (t % 2) + 4i .. + 3 of the slice's
//    sub-block. (t and t + 2 load the same bytes for the two nibbles.)
//  - B (column n = lane / 4 = (slice n / 2, plane n % 2): hi and lo int8 planes of x): lane
//    (n, t) holds x at the positions of its k quads where slice(k) = n / 2, zero elsewhere:
//    one 16-B load (word i for MMA i), half of the lanes.
//  - C: thread t holds columns 2t, 2t + 1 = (sub-block 2c + t; hi, lo) for rows g, g + 8:
//    S = 127 hi + lo exact in int32 (|S| < 2^27), then acc += d sc dx S - dmin m sx in f32
//    (its own sub-block's scale and min, decoded branch-free by kq_pair_scales).
//  - End: the four t lanes (xor 1, 2) and the 8 warps (in order, through shared memory) are
//    added; every output is a fixed sequence of operations whatever R is (R loops inside a
//    lifetime over the same A fragments), so decode and verify agree bitwise.
//  Bytes: the weights once (the bulk copy); x 2 B per column per block, read once per block
//  (not per row pair as in the lane code): at R = 1 staged in shared memory after the PDL
//  wait while the weights are in flight (tc_stage_x), for larger R read from L1/L2.
//  Checked on the host too (tests/gemv_tc_emu.rs: this section compiled with g++, the MMA
//  emulated from its fragment layout), besides `ferrite check` on the GPU.

// c += a . b (m16n8k32; a: 16 x 32 unsigned bytes, b: 32 x 8 signed bytes; int32).
__device__ __forceinline__ void tc_mma(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same with signed bytes in a (Q6_K's 6-bit weights, 4x and centred).
__device__ __forceinline__ void tc_mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// EMU_TC_BEGIN (host emulation: tests/gemv_tc_emu.rs; tc_mma is emulated there)
// Byte e (runtime, 0..3) of w as an exact float.
__device__ __forceinline__ float byte_fe(uint32_t w, int e) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u + (uint32_t)e)) - 8388608.0f;
}

// Bytes per slot of the tensor-core GEMV (NS = 8 rows, or 4 for the half tile; + 16 for the
// alignment offset), rounded so that slot 1 starts 64 bytes past a 128-byte boundary
// (matmul.rs tc_slot: the same formula).
__device__ __forceinline__ size_t tc_slot(long long rb, int ns) {
    return (((size_t)ns * (size_t)rb + 16 + 127) & ~(size_t)127) + 64;
}

// s0, s1: the two 8-row slots in shared memory (rows rb apart). r0: the block's first output row.
// Copies row 0 of the quantized x (hi plane, lo plane, scale pairs) into shared memory at
// xs: the lo plane 64 bytes past n_in (its 16-B loads then sit in the other half of the banks
// from the hi plane's), the pairs after both planes + 128. Bytes: 2 n_in + 128 + 8 n_in / 32
// (tc_x_bytes in matmul.rs). Called after the PDL wait (x is the predecessor's output), while
// the weight copy is in flight; ends with a block barrier.
// src_plane: the distance of the source's planes where x is a column slice of a wider x
// (the K-split tile, gemvq_tck_block; 0: n_in).
// In two steps (MATMUL.md round 46): tc_stage_x_load issues a thread's first TC_XU words of
// each plane and TC_XD scale pairs at once (every word of x up to 8192 columns at 256 threads),
// tc_stage_x_store stores them, copies any rest (longer x) and ends with the barrier: one L2
// round trip where a load-store loop took one per iteration (three at 4096 columns), and a
// caller's own loads (the NORM form's group sums) can go out between the two.
constexpr int TC_XU = 2, TC_XD = 2;  // plane words per plane, scale pairs, per thread
struct TcXStage {
    int4 v[2][TC_XU];  // [plane][u]: word threadIdx.x + u blockDim.x of each plane
    float2 d[TC_XD];
};
__device__ __forceinline__ void tc_stage_x_load(TcXStage& st, const int8_t* __restrict__ xq,
                                                const float2* __restrict__ xd, int n_in, int src_plane = 0) {
    const int n16 = n_in / 16, nb = n_in / QK, sp = src_plane ? src_plane : n_in;
    const int4* q0 = (const int4*)xq;
    const int4* q1 = (const int4*)(xq + sp);
#pragma unroll
    for (int u = 0; u < TC_XU; u++) {
        const int j = threadIdx.x + u * blockDim.x;
        if (j < n16) {
            st.v[0][u] = __ldg(q0 + j);
            st.v[1][u] = __ldg(q1 + j);
        }
    }
#pragma unroll
    for (int u = 0; u < TC_XD; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < nb) st.d[u] = __ldg(xd + i);
    }
}
__device__ __forceinline__ void tc_stage_x_store(const TcXStage& st, uint8_t* xs, const int8_t* __restrict__ xq,
                                                 const float2* __restrict__ xd, int n_in, int src_plane = 0) {
    const int n16 = n_in / 16, nb = n_in / QK, sp = src_plane ? src_plane : n_in;
    int4* s0 = (int4*)xs;
    int4* s1 = (int4*)(xs + n_in + 64);
#pragma unroll
    for (int u = 0; u < TC_XU; u++) {
        const int j = threadIdx.x + u * blockDim.x;
        if (j < n16) {
            s0[j] = st.v[0][u];
            s1[j] = st.v[1][u];
        }
    }
    for (int j = threadIdx.x + TC_XU * blockDim.x; j < n16; j += blockDim.x) {
        s0[j] = __ldg((const int4*)xq + j);
        s1[j] = __ldg((const int4*)(xq + sp) + j);
    }
    float2* ds = (float2*)(xs + 2 * n_in + 128);
#pragma unroll
    for (int u = 0; u < TC_XD; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < nb) ds[i] = st.d[u];
    }
    for (int i = threadIdx.x + TC_XD * blockDim.x; i < nb; i += blockDim.x) ds[i] = __ldg(xd + i);
    __syncthreads();
}
__device__ __forceinline__ void tc_stage_x(uint8_t* xs, const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                                           int n_in, int src_plane = 0) {
    TcXStage st;
    tc_stage_x_load(st, xq, xd, n_in, src_plane);
    tc_stage_x_store(st, xs, xq, xd, n_in, src_plane);
}

// The end of a tensor-core GEMV block: thread (g, t) of warp w holds acc[r][a], its share of
// MMA row g + 8a for x row r. The four t lanes (xor 1, 2), then the 8 warps (in order,
// through shared memory) are added. Output row `row` of the tile (slot m = row / 8, its row
// j = row % 8) is MMA row 2j + m; SWIGLU: gate row j is MMA row 2j, up row j is 2j + 1, and
// the output is silu(gate) * up. HALF (the 8-row tile, MMA rows g + 8 repeat rows g): only
// acc[r][0] counts, output row `row` (slot row / 4, its row row % 4) is MMA row
// 2 (row % 4) + row / 4.
// NORM: the input was x ⊙ n with the RMSNorm's 1 / rms(x) deferred (gemvq_tc_block NORM):
// sn[r] scales each sum (SwiGLU: gate and up) before it is used.
// W4 (gemvq_tc_q4k's W4): four warps, each holding two of the eight-warp kernel's partials
// (acc: warp w's, acc2: warp w + 4's), written to their places: the same sums in the same order.
// hs (R = 1; shared memory, or nullptr): each output also at hs[row] (the Q8_0 SwiGLU ring's
// copy of h for its own quantization, gemvq_swiglu_p_q80).
template <int R, bool SWIGLU, bool HALF = false, bool NORM = false, bool W4 = false>
__device__ __forceinline__ void tc_store(float (&acc)[R][2], int rows, float* __restrict__ out, int n_out, int r0,
                                         const float* sn = nullptr, float (*acc2)[2] = nullptr,
                                         float* hs = nullptr) {
    constexpr int NA = HALF ? 1 : 2;  // MMA row halves that hold distinct rows
    __shared__ float tred[GEMV_WARPS][R][8 * NA];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int a = 0; a < NA; a++) {
            acc[r][a] += __shfl_xor_sync(0xffffffffu, acc[r][a], 1);
            acc[r][a] += __shfl_xor_sync(0xffffffffu, acc[r][a], 2);
            if (t == 0) tred[warp][r][8 * a + g] = acc[r][a];
            if constexpr (W4) {
                acc2[r][a] += __shfl_xor_sync(0xffffffffu, acc2[r][a], 1);
                acc2[r][a] += __shfl_xor_sync(0xffffffffu, acc2[r][a], 2);
                if (t == 0) tred[warp + GEMV_WARPS / 2][r][8 * a + g] = acc2[r][a];
            }
        }
    __syncthreads();
    constexpr int NO = SWIGLU ? 4 * NA : 8 * NA;  // outputs per tile
    for (int i = threadIdx.x; i < R * NO; i += blockDim.x) {
        const int r = (unsigned)i / NO, row = (unsigned)i % NO;
        const int a = SWIGLU ? 2 * row : 2 * (row % (NO / 2)) + row / (NO / 2);
        const int au = a + 1;  // SWIGLU: the up row
        float v = tred[0][r][a];
#pragma unroll
        for (int w = 1; w < GEMV_WARPS; w++) v += tred[w][r][a];
        const int o = r0 + row;
        if (r >= rows || o >= n_out) continue;
        if (NORM) v *= sn[r];
        if (SWIGLU) {
            float u = tred[0][r][au];
#pragma unroll
            for (int w = 1; w < GEMV_WARPS; w++) u += tred[w][r][au];
            if (NORM) u *= sn[r];
            v = silu(v) * u;
        }
        out[(size_t)r * n_out + o] = v;
        if (hs != nullptr) hs[row] = v;
    }
    TL_STAMP_END();
}

// tc_store's sums for a two-tile block (G2): group tg = threadIdx.x / 256 of 8 warps adds its
// tile's MMA rows in tc_store's order (the four t lanes, then the warps in order: the bits of
// the one-tile kernel's outputs) into out16[r * 16 + row] (shared memory), row as tc_store's
// plain rows. Ends with a block barrier: both groups' sums are then visible to every thread.
template <int R>
__device__ __forceinline__ void tc_reduce_g2(float (&acc)[R][2], float* out16) {
    __shared__ float tred2[2][GEMV_WARPS][R][16];
    const int lane = threadIdx.x & 31, tg = threadIdx.x >> 8, warp = (threadIdx.x >> 5) & (GEMV_WARPS - 1);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int a = 0; a < 2; a++) {
            acc[r][a] += __shfl_xor_sync(0xffffffffu, acc[r][a], 1);
            acc[r][a] += __shfl_xor_sync(0xffffffffu, acc[r][a], 2);
            if (t == 0) tred2[tg][warp][r][8 * a + g] = acc[r][a];
        }
    __syncthreads();
    for (int i = threadIdx.x & 255; i < R * 16; i += 256) {
        const int r = (unsigned)i / 16, row = (unsigned)i % 16;
        const int a = 2 * (row % 8) + row / 8;
        float v = tred2[tg][0][r][a];
#pragma unroll
        for (int w = 1; w < GEMV_WARPS; w++) v += tred2[tg][w][r][a];
        out16[r * 16 + row] = v;
    }
    __syncthreads();
}

// W4's two accumulator sets exchanged (gemvq_tc_q4k).
template <int R>
__device__ __forceinline__ void tc_swap_acc(float (&acc)[R][2], float (&acc2)[R][2]) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int a = 0; a < 2; a++) {
            const float v = acc[r][a];
            acc[r][a] = acc2[r][a];
            acc2[r][a] = v;
        }
}

// The B words of an MMA lifetime: the lane's one unconditional 16-byte x load, masked into
// b0 (k 0..15: wa) or b1 (k 16..31: wb) or neither (mlo, mhi: all ones or zero per lane) —
// no predicated loads and their scaffolding (MATMUL.md rounds 11 and 53).
__device__ __forceinline__ void tc_b_words(const int4 xv, uint32_t mlo, uint32_t mhi, uint32_t (&wa)[4],
                                           uint32_t (&wb)[4]) {
    wa[0] = (uint32_t)xv.x & mlo, wa[1] = (uint32_t)xv.y & mlo, wa[2] = (uint32_t)xv.z & mlo;
    wa[3] = (uint32_t)xv.w & mlo;
    wb[0] = (uint32_t)xv.x & mhi, wb[1] = (uint32_t)xv.y & mhi, wb[2] = (uint32_t)xv.z & mhi;
    wb[3] = (uint32_t)xv.w & mhi;
}

// A Q5_K lifetime's four A words from the lane's 16 nibble bytes w and its 16 qh bytes q
// (gemvq_tc_q4k's Q5): rot(w, nrot) & nmask | rot(q, qr) & hmask, rot a left rotation.
__device__ __forceinline__ void q5_a(const uint4 w, const uint4 q, uint32_t nrot, uint32_t qr, uint32_t nmask,
                                     uint32_t hmask, uint32_t (&a)[4]) {
    const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, qv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        a[i] = (__funnelshift_l(wv[i], wv[i], nrot) & nmask) | (__funnelshift_l(qv[i], qv[i], qr) & hmask);
}

// XS (R = 1): x was staged in shared memory by the block (tc_stage_x): planes xplane bytes
// apart, its scales at xd; otherwise global x (planes n_in apart, rows 2 n_in apart).
// kcols: the tile's columns where x is wider (a K slice, gemvq_tck_block; 0: n_in).
// HALF: the 8-row tile (slots of 4 rows; MMA rows g + 8 repeat rows g, whose loads and
// epilogue are skipped): the long rows, whose 16-row tile does not fit (matmul.rs tc_form).
// NORM: tc_store scales by sn (see there). G2: the block is two 8-warp groups on two tiles
// (gemvq_tc2_add_q4k): warps index within their group, and the tile's 16 sums go to g2out
// (tc_reduce_g2) instead of global memory.
// W4 (gemvq_swiglu_tcnw4_q4_k; MATMUL.md round 49): a block of four warps; warp w takes
// super-blocks w, w + 4, ..., alternately into the eight-warp kernel's partials of warps w
// (w, w + 8, ...) and w + 4 (w + 4, w + 12, ...), by swapping two accumulator sets after
// each super-block: every sum is the eight-warp kernel's, in its order.
// Q5 (gemvq_tc_q5_k_r<R>; MATMUL.md round 69): Q5_K rows, the Q4_K layout with qh[32] (the
// fifth bits) between the scales and the nibbles (176-byte super-blocks). Per row and
// super-block the lane also loads its 16 qh bytes (the bytes 16 e .. of every 32-byte run
// of nibbles its A words come from: one load serves the four chunks); byte l of chunk cc
// has its fifth bit at bit 2 cc + sel of qh[l] (sel: the lane's nibble, t >> 1). A bytes:
// the low nibble with its bit at bit 4 (v, 0..31), or the high nibble rotated down to bits
// 3..6 with its bit at bit 7 (8 v: the byte holds 8 v exactly, and hs = 1/8 undoes it), so
// each A word is two rotations, a mask and one LOP3 (q5_a) where Q4_K's is one mask.
template <int R, bool SWIGLU, bool XS, bool HALF = false, bool NORM = false, bool G2 = false, bool W4 = false,
          bool Q5 = false>
__device__ __forceinline__ void gemvq_tc_q4k(const uint8_t* s0, const uint8_t* s1, long long rb, int n_out,
                                             int n_in, const int8_t* __restrict__ xq,
                                             const float2* __restrict__ xd, int rows, float* __restrict__ out,
                                             int r0, int xplane, int kcols = 0, const float* sn = nullptr,
                                             float* g2out = nullptr) {
    const int lane = threadIdx.x & 31, warp = G2 ? (threadIdx.x >> 5) & (GEMV_WARPS - 1) : threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3, e = t & 1;
    // MMA rows g and g + 8: row g / 2 and g / 2 + 4 of slot g % 2 (HALF: both row g / 2).
    const uint8_t* p0 = ((g & 1) ? s1 : s0) + (size_t)(g >> 1) * (size_t)rb;
    const uint8_t* p1 = HALF ? p0 : p0 + 4 * (size_t)rb;
    const uint32_t amask = (t >> 1) ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
    const KqPairSel sel0 = kq_pair_sel(t >> 1), sel1 = kq_pair_sel(2 + (t >> 1));
    // Column t's sub-block is odd: 16x high nibbles (Q5: 8x, q5_a).
    const float hs = e ? (Q5 ? 0.125f : 0.0625f) : 1.0f;
    constexpr int SB_BYTES = Q5 ? Q5_K_BYTES : Q4_K_BYTES, QS_OFF = Q5 ? 48 : 16;  // the nibbles' offset
    // Q5: the lane's rotations (nibble; the fifth bit of chunk cc: by qrot - 2 cc) and masks.
    const uint32_t nrot = (t >> 1) ? 31u : 0u, qrot = 4u + 2u * (uint32_t)(t >> 1);
    const uint32_t nmask = (t >> 1) ? 0x78787878u : 0x0F0F0F0Fu, hmask = (t >> 1) ? 0x80808080u : 0x10101010u;
    const int q = g >> 1;                  // B: this lane's column slice
    const bool bval = (q & 1) == (t >> 1), bhi = q >= 2;
    // The x words go to b0 (k 0..15) or b1 (k 16..31) or neither: masks of one unconditional
    // load (tc_b_words).
    const uint32_t mlo = (bval && !bhi) ? 0xFFFFFFFFu : 0u, mhi = (bval && bhi) ? 0xFFFFFFFFu : 0u;
    const size_t xoff = (size_t)(g & 1) * (size_t)(XS ? xplane : n_in) + 32 * q + 16 * e;
    const int nsb = (kcols ? kcols : n_in) / QK_K, nb = n_in / QK;
    float acc[R][2], acc2[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc2[r][0] = acc2[r][1] = 0.0f;
    constexpr int WS = W4 ? GEMV_WARPS / 2 : GEMV_WARPS;  // the warps' super-block stride
    // Two super-blocks per iteration for R = 2 (their loads in flight together; measured
    // with the conflict-free slots and the predicated x loads: SwiGLU 4096->12288 24.5 ->
    // 21.8 us); one for R = 1 (with the branch-free x words the second super-block's values
    // do not fit the registers: MATMUL.md round 11) and for larger R, whose accumulators take
    // the registers.
    constexpr int SB_UNROLL = R == 2 ? 2 : 1;
    int nsw = 0;  // W4: super-blocks taken (which set acc is)
#pragma unroll SB_UNROLL
    for (int sb = warp; sb < nsb; sb += WS) {
        const size_t off = (size_t)sb * SB_BYTES;
        const uint8_t* b0 = p0 + off;
        const uint8_t* b1 = p1 + off;
        const uint4 h0 = *(const uint4*)b0, h1 = HALF ? h0 : *(const uint4*)b1;
        const float d0 = h2f(h0.x & 0xFFFF), n0 = h2f(h0.x >> 16);
        const float d1 = h2f(h1.x & 0xFFFF), n1 = h2f(h1.x >> 16);
        uint4 qh0 = make_uint4(0, 0, 0, 0), qh1 = qh0;  // Q5: the lane's fifth bits
        if constexpr (Q5) {
            qh0 = *(const uint4*)(b0 + 16 + 16 * e);
            qh1 = HALF ? qh0 : *(const uint4*)(b1 + 16 + 16 * e);
        }
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int c = 2 * half;
            const uint4 wa0 = *(const uint4*)(b0 + QS_OFF + 32 * c + 16 * e);
            const uint4 wb0 = *(const uint4*)(b0 + QS_OFF + 32 + 32 * c + 16 * e);
            const uint4 wa1 = HALF ? wa0 : *(const uint4*)(b1 + QS_OFF + 32 * c + 16 * e);
            const uint4 wb1 = HALF ? wb0 : *(const uint4*)(b1 + QS_OFF + 32 + 32 * c + 16 * e);
            uint32_t A0[4], A1[4], A2[4], A3[4];
            if constexpr (Q5) {
                // Chunk c (A0, A1) and c + 1 (A2, A3): the fifth bit rotated to bit 4 or 7.
                const uint32_t ra = (qrot - 2u * (uint32_t)c) & 31u, rb2 = (qrot - 2u * (uint32_t)(c + 1)) & 31u;
                q5_a(wa0, qh0, nrot, ra, nmask, hmask, A0);
                q5_a(wa1, qh1, nrot, ra, nmask, hmask, A1);
                q5_a(wb0, qh0, nrot, rb2, nmask, hmask, A2);
                q5_a(wb1, qh1, nrot, rb2, nmask, hmask, A3);
            } else {
                A0[0] = wa0.x & amask, A0[1] = wa0.y & amask, A0[2] = wa0.z & amask, A0[3] = wa0.w & amask;
                A1[0] = wa1.x & amask, A1[1] = wa1.y & amask, A1[2] = wa1.z & amask, A1[3] = wa1.w & amask;
                A2[0] = wb0.x & amask, A2[1] = wb0.y & amask, A2[2] = wb0.z & amask, A2[3] = wb0.w & amask;
                A3[0] = wb1.x & amask, A3[1] = wb1.y & amask, A3[2] = wb1.z & amask, A3[3] = wb1.w & amask;
            }
            const KqPairSel sel = half ? sel1 : sel0;
            const uint32_t sm0 = kq_pair_scales(sel, h0.y, h0.z, h0.w);
            const uint32_t sm1 = kq_pair_scales(sel, h1.y, h1.z, h1.w);
            const float sc0 = byte_fe(sm0, e), m0 = byte_fe(sm0, 2 + e);
            const float sc1 = byte_fe(sm1, e), m1 = byte_fe(sm1, 2 + e);
            const int xs = sb * QK_K + 64 * c;  // first column of the lifetime
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
                // b0 words (k 0..15) or b1 words (k 16..31): one load, masked into each.
                const int4* xp = (const int4*)(xq + (XS ? 0 : (size_t)r * 2 * n_in) + xoff + xs);
                const float2* dp = xd + (XS ? 0 : (size_t)r * nb) + (size_t)sb * 8 + 2 * c + t;
                const int4 xv = XS ? *xp : __ldg(xp);
                const float2 ds = XS ? *dp : __ldg(dp);
                uint32_t wa[4], wb[4];
                tc_b_words(xv, mlo, mhi, wa, wb);
                int C[4] = {0, 0, 0, 0};
#pragma unroll
                for (int i = 0; i < 4; i++) tc_mma(C, A0[i], A1[i], A2[i], A3[i], wa[i], wb[i]);
                const float dxs = ds.x * hs;
                const int S0 = 127 * C[0] + C[1], S1 = 127 * C[2] + C[3];
                acc[r][0] = fmaf(d0, sc0 * dxs * (float)S0, fmaf(-n0, m0 * ds.y, acc[r][0]));
                if (!HALF) acc[r][1] = fmaf(d1, sc1 * dxs * (float)S1, fmaf(-n1, m1 * ds.y, acc[r][1]));
            }
        }
        if constexpr (W4) {
            tc_swap_acc<R>(acc, acc2);
            nsw++;
        }
    }
    if constexpr (W4) {
        if (nsw & 1) tc_swap_acc<R>(acc, acc2);  // acc holds warp w + 4's partial: swap back
    }
    TL_MARK(2);
    if (G2)
        tc_reduce_g2<R>(acc, g2out);
    else
        tc_store<R, SWIGLU, HALF, NORM, W4>(acc, rows, out, n_out, r0, sn, acc2);
}

// The Q6_K form. A super-block (210 bytes: ql[128] low nibbles, qh[64] 2-bit highs, 16 int8
// scales, f16 d) is two halves of 128 weights, 8 sub-blocks of 16 each (ggml's layout: in half
// h, sub-block j = 2 jj + i holds weights 128 h + 16 j + m, m < 16, from the nibble of ql byte
// 64 h + 32 (jj % 2) + 16 i + m (low for jj < 2, high otherwise) and bits 2 jj of qh byte
// 32 h + 16 i + m; its scale is scales[8 h + j]). A lifetime is one half: 8 MMAs.
//  - K quads: quad q (k 4q .. 4q + 3) of every MMA holds sub-block q; MMA i takes its weights
//    m = 4i .. 4i + 3. Thread t's a0/a1 (quad t) are sub-block t = the low nibbles of ql bytes
//    16 t .. 16 t + 15, its a2/a3 (quad 4 + t) sub-block 4 + t = the high nibbles of the same
//    bytes; the highs from qh bytes 16 (t % 2) .. at bits 2 (t / 2) and 4 + 2 (t / 2). One
//    16-byte load of ql and one of qh per row and half (2-byte aligned: 5 words and funnel
//    shifts, tc_ld16u).
//  - A bytes: 4 (v - 32) as s8 for the 6-bit v (v << 2 with its top bit flipped: the 6-bit
//    value sign-extends through the byte), exact; the 1/4 is folded into the x scale.
//  - B column n = sub-block n: lane (n, t) holds x when t = n % 4, in b0 (n < 4) or b1, the
//    16 x at 16 n.. of the half (word i for MMA i); zero elsewhere. Two passes, hi and lo planes.
//  - C: thread t holds sub-blocks 2t, 2t + 1 (one x block: 128 h + 32 t ..) for rows g, g + 8:
//    S = 127 hi + lo per sub-block (|S| < 2^25), acc += d dx / 4 (sc_2t S_2t + sc_2t+1 S_2t+1).
// Byte for byte the Q4_K form otherwise (slots, x staging, tc_store).

// The 16 bytes at p (shared memory, 2-byte aligned) as four little-endian words.
__device__ __forceinline__ void tc_ld16u(const uint8_t* p, uint32_t (&w)[4]) {
    const uint32_t mis = (uint32_t)(size_t)p & 3;
    const uint32_t* a = (const uint32_t*)(p - mis);
    const uint32_t sh = 8 * mis;
    uint32_t v[5];
#pragma unroll
    for (int i = 0; i < 5; i++) v[i] = a[i];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = __funnelshift_r(v[i], v[i + 1], sh);
}

// 4 (v - 32) as signed bytes for the four 6-bit weights v = (nibbles of nib at bits 2..5) |
// (qh bits at 6..7), both already shifted into place.
__device__ __forceinline__ uint32_t q6_a(uint32_t nib, uint32_t hi) {
    return ((nib & 0x3C3C3C3Cu) | (hi & 0xC0C0C0C0u)) ^ 0x80808080u;
}

template <int R, bool SWIGLU, bool XS, bool HALF = false, bool NORM = false>
__device__ __forceinline__ void gemvq_tc_q6k(const uint8_t* s0, const uint8_t* s1, long long rb, int n_out,
                                             int n_in, const int8_t* __restrict__ xq,
                                             const float2* __restrict__ xd, int rows, float* __restrict__ out,
                                             int r0, int xplane, int kcols = 0, const float* sn = nullptr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const uint8_t* p0 = ((g & 1) ? s1 : s0) + (size_t)(g >> 1) * (size_t)rb;
    const uint8_t* p1 = HALF ? p0 : p0 + 4 * (size_t)rb;
    // qh bits 2 (t / 2) (sub-block t) and 4 + 2 (t / 2) (sub-block 4 + t) to bits 6..7.
    const int shl = 6 - 2 * (t >> 1), shh = 2 - 2 * (t >> 1);
    const bool bval = t == (g & 3), bhi = g >= 4;
    const uint32_t mlo = (bval && !bhi) ? 0xFFFFFFFFu : 0u, mhi = (bval && bhi) ? 0xFFFFFFFFu : 0u;
    const size_t xoff = 16 * (size_t)g;
    const size_t plane = XS ? (size_t)xplane : (size_t)n_in;
    const int nsb = (kcols ? kcols : n_in) / QK_K, nb = n_in / QK;
    float acc[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = 0.0f;
    for (int sb = warp; sb < nsb; sb += GEMV_WARPS) {
        const uint8_t* b0 = p0 + (size_t)sb * Q6_K_BYTES;
        const uint8_t* b1 = p1 + (size_t)sb * Q6_K_BYTES;
        const float d0 = h2f(*(const uint16_t*)(b0 + 208)), d1 = HALF ? d0 : h2f(*(const uint16_t*)(b1 + 208));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint32_t l0[4], l1[4], q0[4], q1[4];
            tc_ld16u(b0 + 64 * h + 16 * t, l0);
            tc_ld16u(b0 + 128 + 32 * h + 16 * (t & 1), q0);
            if (HALF) {
#pragma unroll
                for (int i = 0; i < 4; i++) l1[i] = l0[i], q1[i] = q0[i];
            } else {
                tc_ld16u(b1 + 64 * h + 16 * t, l1);
                tc_ld16u(b1 + 128 + 32 * h + 16 * (t & 1), q1);
            }
            uint32_t A0[4], A1[4], A2[4], A3[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                A0[i] = q6_a(l0[i] << 2, q0[i] << shl);
                A1[i] = q6_a(l1[i] << 2, q1[i] << shl);
                A2[i] = q6_a(l0[i] >> 2, q0[i] << shh);
                A3[i] = q6_a(l1[i] >> 2, q1[i] << shh);
            }
            const uint16_t sp0 = *(const uint16_t*)(b0 + 192 + 8 * h + 2 * t);
            const uint16_t sp1 = HALF ? sp0 : *(const uint16_t*)(b1 + 192 + 8 * h + 2 * t);
            const float sa0 = (float)(int8_t)(sp0 & 0xFF), sb0 = (float)(int8_t)(sp0 >> 8);
            const float sa1 = (float)(int8_t)(sp1 & 0xFF), sb1 = (float)(int8_t)(sp1 >> 8);
            const int xs = sb * QK_K + 128 * h;  // first column of the lifetime
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
                const int8_t* xr = xq + (XS ? 0 : (size_t)r * 2 * n_in) + xoff + xs;
                const float2* dp = xd + (XS ? 0 : (size_t)r * nb) + (size_t)sb * 8 + 4 * h + t;
                // b0 words (quads 0..3) or b1 words (quads 4..7), per plane: one unconditional
                // load of each plane (every lane's 16 columns lie inside the lifetime's 128),
                // masked into each, as the Q4_K form does (MATMUL.md rounds 11 and 53: the
                // predicated loads took branches and register moves around them).
                const int4 xh = XS ? *(const int4*)xr : __ldg((const int4*)xr);
                const int4 xl = XS ? *(const int4*)(xr + plane) : __ldg((const int4*)(xr + plane));
                const float dx = (XS ? *dp : __ldg(dp)).x * 0.25f;
                uint32_t wha[4], whb[4], wla[4], wlb[4];
                tc_b_words(xh, mlo, mhi, wha, whb);
                tc_b_words(xl, mlo, mhi, wla, wlb);
                int H[4] = {0, 0, 0, 0}, L[4] = {0, 0, 0, 0};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    tc_mma_s8(H, A0[i], A1[i], A2[i], A3[i], wha[i], whb[i]);
                    tc_mma_s8(L, A0[i], A1[i], A2[i], A3[i], wla[i], wlb[i]);
                }
                const int S0 = 127 * H[0] + L[0], S1 = 127 * H[1] + L[1];
                const int S2 = 127 * H[2] + L[2], S3 = 127 * H[3] + L[3];
                acc[r][0] = fmaf(d0 * dx, fmaf(sb0, (float)S1, sa0 * (float)S0), acc[r][0]);
                if (!HALF) acc[r][1] = fmaf(d1 * dx, fmaf(sb1, (float)S3, sa1 * (float)S2), acc[r][1]);
            }
        }
    }
    TL_MARK(2);
    tc_store<R, SWIGLU, HALF, NORM>(acc, rows, out, n_out, r0, sn);
}

// The Q8_0 form (MATMUL.md round 54; the K-split tile's, gemvq_tck_block). A Q8_0 block is 34
// bytes (f16 d, then 32 int8 quants: ggml's layout, unchanged in VRAM); the tile's unit is 8
// blocks (256 columns, Q8_0_UNIT_BYTES = 272: 16-byte aligned, as the K-split slices need),
// two lifetimes of 4 blocks (4L .. 4L + 3), 4 MMAs each.
//  - K slices: slice s of every MMA holds 8 weights of block m(s) of the lifetime, m = (0, 2,
//    1, 3). So a0 / a1 (slices 0, 1) take the even blocks and a2 / a3 (slices 2, 3) the odd
//    ones, and each A word has one alignment in every lane: an even block's quants start 2
//    bytes past a 4-byte boundary (34 (4L + 2j) + 2), an odd block's on one.
//  - A (s8, the quants as stored: tc_mma_s8): thread t takes the 16 quants 16 (t % 2).. of
//    block m(t / 2) (a0: row g, a1: row g + 8) and of block m(2 + t / 2) (a2, a3); MMA i takes
//    word i (weights 16 (t % 2) + 4i ..). Even blocks: five aligned 32-bit loads, funnel shifts
//    by 16 bits; odd blocks: four aligned loads. No masks, no scale decoding.
//  - B: the Q4_K form's (column n = (slice n / 2, plane n % 2)), slice q's x being that of
//    block m(q) of the lifetime.
//  - C: thread t holds (block m(t); hi, lo) for rows g, g + 8: S = 127 hi + lo exact in int32
//    (|S| < 2^26), then acc += d (dx S) in f32 with the row's block scale d.
//  - Bank conflicts: the 32 lanes' words differ by multiples of 4 words (slots, rows, t % 2)
//    and by the 17 words between a thread pair's two blocks, so two-way at best; rows rb ≡ 16
//    (mod 128) bytes apart reach it (gemvq_tck_block pads its row slices by 16 bytes: rows
//    a multiple of 128 apart would be four-way).
// Per lifetime and thread: 18 shared loads and 8 funnel shifts for A, one 16-byte x load and
// 8 masks for B, 4 MMAs, two f16 scales and ~10 epilogue operations, for 2,176 weight bytes a
// warp (the Q4_K tile's lifetime moves 1,152).
// W4: as gemvq_tc_q4k's (four warps, the eight-warp kernel's partials in its order).
#define Q8_0_UNIT_BYTES (8 * Q8_0_BYTES)
template <int R, bool SWIGLU, bool XS, bool NORM = false, bool W4 = false>
__device__ __forceinline__ void gemvq_tc_q80(const uint8_t* s0, const uint8_t* s1, long long rb, int n_out,
                                             int n_in, const int8_t* __restrict__ xq,
                                             const float2* __restrict__ xd, int rows, float* __restrict__ out,
                                             int r0, int xplane, int kcols = 0, const float* sn = nullptr,
                                             float* hs = nullptr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3, e = t & 1, j = t >> 1;
    const uint8_t* p0 = ((g & 1) ? s1 : s0) + (size_t)(g >> 1) * (size_t)rb;
    const uint8_t* p1 = p0 + 4 * (size_t)rb;
    // In a lifetime (136 bytes): the aligned word before the even block m(j) = 2j's quants
    // (its f16 d, then the quants 16 e ..), the odd block m(2 + j) = 2j + 1's quants 16 e ..,
    // and the block m(t) whose sums thread t holds (C).
    const int ae = 68 * j + 16 * e, ao = 34 * (2 * j + 1) + 2 + 16 * e;
    const int mt = 2 * e + j;
    const int q = g >> 1, mq = 2 * (q & 1) + (q >> 1);  // B: this lane's column slice, its block
    const bool bval = (q & 1) == j, bhi = q >= 2;
    const uint32_t mlo = (bval && !bhi) ? 0xFFFFFFFFu : 0u, mhi = (bval && bhi) ? 0xFFFFFFFFu : 0u;
    const size_t xoff = (size_t)(g & 1) * (size_t)(XS ? xplane : n_in) + 32 * mq + 16 * e;
    const int nsb = (kcols ? kcols : n_in) / QK_K, nb = n_in / QK;
    float acc[R][2], acc2[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc2[r][0] = acc2[r][1] = 0.0f;
    constexpr int WS = W4 ? GEMV_WARPS / 2 : GEMV_WARPS;  // the warps' unit stride
    int nsw = 0;  // W4: units taken (which set acc is)
    for (int sb = warp; sb < nsb; sb += WS) {
        const size_t off = (size_t)sb * Q8_0_UNIT_BYTES;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint8_t* b0 = p0 + off + 136 * h;
            const uint8_t* b1 = p1 + off + 136 * h;
            uint32_t v0[5], v1[5], A0[4], A1[4], A2[4], A3[4];
#pragma unroll
            for (int i = 0; i < 5; i++) {
                v0[i] = ((const uint32_t*)(b0 + ae))[i];
                v1[i] = ((const uint32_t*)(b1 + ae))[i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                A0[i] = __funnelshift_r(v0[i], v0[i + 1], 16);
                A1[i] = __funnelshift_r(v1[i], v1[i + 1], 16);
                A2[i] = ((const uint32_t*)(b0 + ao))[i];
                A3[i] = ((const uint32_t*)(b1 + ao))[i];
            }
            const float d0 = h2f(*(const uint16_t*)(b0 + 34 * mt)), d1 = h2f(*(const uint16_t*)(b1 + 34 * mt));
            const int xs = sb * QK_K + 128 * h;  // first column of the lifetime
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r > 0 && r >= rows) break;  // padded rows: skipped (PAD_ROWS)
                const int4* xp = (const int4*)(xq + (XS ? 0 : (size_t)r * 2 * n_in) + xoff + xs);
                const float2* dp = xd + (XS ? 0 : (size_t)r * nb) + (size_t)sb * 8 + 4 * h + mt;
                const int4 xv = XS ? *xp : __ldg(xp);
                const float dx = (XS ? *dp : __ldg(dp)).x;
                uint32_t wa[4], wb[4];
                tc_b_words(xv, mlo, mhi, wa, wb);
                int C[4] = {0, 0, 0, 0};
#pragma unroll
                for (int i = 0; i < 4; i++) tc_mma_s8(C, A0[i], A1[i], A2[i], A3[i], wa[i], wb[i]);
                const int S0 = 127 * C[0] + C[1], S1 = 127 * C[2] + C[3];
                acc[r][0] = fmaf(d0, dx * (float)S0, acc[r][0]);
                acc[r][1] = fmaf(d1, dx * (float)S1, acc[r][1]);
            }
        }
        if constexpr (W4) {
            tc_swap_acc<R>(acc, acc2);
            nsw++;
        }
    }
    if constexpr (W4) {
        if (nsw & 1) tc_swap_acc<R>(acc, acc2);  // acc holds warp w + 4's partial: swap back
    }
    TL_MARK(2);
    tc_store<R, SWIGLU, false, NORM, W4>(acc, rows, out, n_out, r0, sn, acc2, hs);
}

// One lane's element of the norm's input handed to the SwiGLU (gemvq_tc2_add_q4k's epilogue
// and add_norm_planes: the same operations, so the same bits): x <- x + v in place, the planes
// of x * n for the lane's 32-group (quant_q8_lane; the calling warp holds the whole group) and,
// from lane 0, the group's sum of x^2 (xor butterfly).
__device__ __forceinline__ void add_norm_lane(float* xp, float v, float nwv, int lane, int8_t* __restrict__ pq_row,
                                              int n, int o, float2* __restrict__ pd_g, float* __restrict__ pss_g,
                                              const float* x_old = nullptr) {
    const float xr = (x_old != nullptr ? *x_old : *xp) + v;
    *xp = xr;
    float ss = xr * xr;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    quant_q8_lane(xr * nwv, lane, pq_row, n, o, pd_g);
    if (lane == 0) *pss_g = ss;
}

// The two tiles and the epilogue of gemvq_tc2_add_q4k (block bx, 512 threads; s0, s1: the
// calling thread's group's slots, whose copy has landed; x staged or not as XS): each group's
// 16 sums (tc_reduce_g2), then warp r < rows takes x row r's 32 outputs of the block.
// PX: the epilogue's residual x and norm weight were loaded early (gemvq_tc2_add_q4k) into
// `xe` (x, then n), instead of after the tiles' compute.
template <int R, bool XS, bool PX = false>
__device__ __forceinline__ void tc2_tiles_add(const uint8_t* s0, const uint8_t* s1, long long rb, int n_out, int n_in,
                                              const int8_t* __restrict__ xa, const float2* __restrict__ da,
                                              int rows, int plane, int bx, float* __restrict__ x,
                                              const float* __restrict__ nw, int8_t* __restrict__ pq,
                                              float2* __restrict__ pd, float* __restrict__ pss,
                                              const float* xe = nullptr) {
    __shared__ float sums[2][R][16];
    const int tg = threadIdx.x >> 8;
    gemvq_tc_q4k<R, false, XS, false, false, true>(s0, s1, rb, n_out, n_in, xa, da, rows, nullptr,
                                                   bx * 32 + 16 * tg, plane, 0, nullptr, &sums[tg][0][0]);
    const int lane = threadIdx.x & 31, r = threadIdx.x >> 5, o = bx * 32 + lane, ng = n_out / QK;
    if (r < R && r < rows)
        add_norm_lane(x + (size_t)r * n_out + o, sums[lane >> 4][r][lane & 15], PX ? xe[1] : nw[o], lane,
                      pq + (size_t)r * 2 * n_out, n_out, o, pd + (size_t)r * ng + bx, pss + (size_t)r * ng + bx,
                      PX ? &xe[0] : nullptr);
}

// The SwiGLU's 1 / rms(x) per x row from the producer's group sums pss[r][n_in / 32] (NORM of
// gemvq_tc_block): lane i adds groups i, i + 32, ... in order, then the xor butterfly; into
// sn[r] (shared). No barrier: the caller's next one publishes sn.
template <int R>
__device__ __forceinline__ void tc_norm_scale(const float* __restrict__ pss, int n_in, int rows, float eps,
                                              float* sn) {
    const int lane = threadIdx.x & 31, ng = n_in / QK;
    for (int r = threadIdx.x >> 5; r < R; r += GEMV_WARPS) {
        const float* p = pss + (size_t)(r < rows ? r : rows - 1) * ng;
        float v = 0.0f;
        for (int i = lane; i < ng; i += 32) v += p[i];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) sn[r] = rsqrtf(v / (float)n_in + eps);
    }
}


// EMU_TC_END

// ---------------------------------------------------------------------------------------
// 1f. The token-major Q4_K GEMV on integer sub-block scales (an experiment: MATMUL.md round 78;
//     `FERRITE_GEMV_TM=1` runs it for plain Q4_K matmuls of up to 16 rows)
//
// The decode GEMVs above spend the MMA's N dimension on a row's sub-blocks, so every x row
// repeats the tile's MMAs, its x loads and a float epilogue per sub-block (MATMUL.md, "The
// few-row GEMVs"). Here N is the tokens (x rows), and the float work is once per super-block:
//  - x: `quant_x_q8s`, one warp per 256 columns of a row (lane l: columns 8 l .. 8 l + 7):
//    the two int8 planes of `quant_q8_lane` (v ~ d (127 hi + lo), d = amax / 127^2) with
//    amax over the 256 columns, d at xs[row][block], and per 32 columns the integer
//    sum of 127 hi + lo at xsum[row][sub-block] (the min term's).
//  - A block of TM_WARPS warps owns 16 output rows (one m16 tile); warp w takes super-blocks
//    w, w + TM_WARPS, ... Per super-block and sub-block j: the 16 rows' 32 nibbles as the u8
//    A operand (lane (g, t): rows g and g + 8, qs bytes 8 t .. 8 t + 7 of the sub-block's
//    32-byte run: one 8-byte load a row serves sub-blocks 2 p and 2 p + 1 as its low and high
//    nibbles; the K order inside an MMA is any order A and B share), one MMA with x's hi
//    plane and one with its lo plane as B (column n: token 8 nt + n, the same 8 bytes of its
//    row), and the int32 sums scaled by the row's 6-bit scale into integer accumulators:
//    hi and lo apart (Σ_j sc_j S_j ≤ 63 · 15 · 127 · 256 ≈ 3.1e7; 127 hi + lo would not fit).
//    The mins: Σ_j m_j xsum_j, integers. Then per (row, token) once a super-block:
//    acc += dx d (127 HI + LO) − dx dmin M, in floats.
//  - Bytes: the weights once (144 a row and super-block) whatever the row count; per
//    super-block a warp issues 16 MMAs a token tile and ~100 integer operations, against the
//    one-row tile's 8 MMAs a token (MATMUL.md round 78 for the count and the measurement).
//  - Bits: each (row, token) output is the same operations in the same order for every row
//    count R (a token's tile only picks which B column it is), so verify rows keep decode's
//    bits; they are not the other GEMVs' bits (x scaled per 256, not per 32).
// EMU_TM_BEGIN (host emulation: tests/gemv_tm_emu.rs)
#define TM_WARPS 4

// One warp: 256-column block `blk` of x row `row` into the planes (hi at xq[row][2 n_in],
// lo n_in after it), its scale and its 8 sub-block sums.
__device__ __forceinline__ void tm_quant_block(const float* __restrict__ x, int n_in, int row, int blk,
                                               int8_t* __restrict__ xq, float* __restrict__ xs,
                                               int* __restrict__ xsum) {
    const int lane = threadIdx.x & 31;
    const float* xb = x + (size_t)row * n_in + (size_t)blk * QK_K + 8 * lane;
    float v[8];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        v[i] = xb[i];
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d1 = amax / 127.0f, d = d1 / 127.0f;
    int8_t* hr = xq + (size_t)row * 2 * n_in + (size_t)blk * QK_K + 8 * lane;
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int hi = 0, lo = 0;
        if (amax > 0.0f) {
            hi = (int)rintf(v[i] * (127.0f / amax));
            lo = (int)rintf((v[i] - (float)hi * d1) / d);
            lo = lo > 127 ? 127 : (lo < -127 ? -127 : lo);
        }
        hr[i] = (int8_t)hi;
        hr[n_in + i] = (int8_t)lo;
        s += 127 * hi + lo;
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if ((lane & 3) == 0) xsum[(size_t)row * (n_in / QK) + (size_t)blk * 8 + (lane >> 2)] = s;
    if (lane == 0) xs[(size_t)row * (n_in / QK_K) + blk] = amax > 0.0f ? d : 0.0f;
}

// The 16 output rows o0 .. o0 + 15 of a [n_out, n_in] Q4_K weight W (rows rb bytes apart)
// for x rows 0 .. rows - 1 (rows <= R; R a multiple of 8), into out[token][n_out].
template <int R>
__device__ __forceinline__ void gemv_tm_q4k(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                            const int8_t* __restrict__ xq, const float* __restrict__ xs,
                                            const int* __restrict__ xsum, int rows, float* __restrict__ out,
                                            int o0) {
    constexpr int NT = R / 8;  // token tiles
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row_a = min(o0 + g, n_out - 1), row_b = min(o0 + g + 8, n_out - 1);
    const uint8_t* wa = W + (size_t)row_a * (size_t)rb;
    const uint8_t* wb = W + (size_t)row_b * (size_t)rb;
    const int nsb = n_in / QK_K, nb = n_in / QK;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    for (int sb = warp; sb < nsb; sb += TM_WARPS) {
        const uint8_t* ba = wa + (size_t)sb * Q4_K_BYTES;
        const uint8_t* bb = wb + (size_t)sb * Q4_K_BYTES;
        int sca[8], ma[8], scb[8], mb[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            scale_min_k4_int(j, ba + 4, sca[j], ma[j]);
            scale_min_k4_int(j, bb + 4, scb[j], mb[j]);
        }
        int hs[NT][4], ls[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) hs[nt][q] = ls[nt][q] = 0;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const uint2 qa = *(const uint2*)(ba + 16 + 32 * p + 8 * t);
            const uint2 qb = *(const uint2*)(bb + 16 + 32 * p + 8 * t);
#pragma unroll
            for (int h = 0; h < 2; h++) {  // low nibbles: sub-block 2 p; high: 2 p + 1
                const int j = 2 * p + h;
                const uint32_t a0 = (qa.x >> (4 * h)) & 0x0F0F0F0Fu, a1 = (qb.x >> (4 * h)) & 0x0F0F0F0Fu;
                const uint32_t a2 = (qa.y >> (4 * h)) & 0x0F0F0F0Fu, a3 = (qb.y >> (4 * h)) & 0x0F0F0F0Fu;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const int tok = min(8 * nt + g, rows - 1);
                    const int8_t* xr = xq + (size_t)tok * 2 * n_in + (size_t)sb * QK_K + 32 * j + 8 * t;
                    const uint2 xh = *(const uint2*)xr, xl = *(const uint2*)(xr + n_in);
                    int ch[4] = {0, 0, 0, 0}, cl[4] = {0, 0, 0, 0};
                    tc_mma(ch, a0, a1, a2, a3, xh.x, xh.y);
                    tc_mma(cl, a0, a1, a2, a3, xl.x, xl.y);
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const int sc = q < 2 ? sca[j] : scb[j];
                        hs[nt][q] += sc * ch[q];
                        ls[nt][q] += sc * cl[q];
                    }
                }
            }
        }
        const float da = h2f(*(const uint16_t*)ba), dma = h2f(*(const uint16_t*)(ba + 2));
        const float db = h2f(*(const uint16_t*)bb), dmb = h2f(*(const uint16_t*)(bb + 2));
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int tok = min(8 * nt + 2 * t + (q & 1), rows - 1);
                const int* xsr = xsum + (size_t)tok * nb + (size_t)sb * 8;
                int m = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) m += (q < 2 ? ma[j] : mb[j]) * xsr[j];
                const float dx = xs[(size_t)tok * nsb + sb];
                const long long s = 127LL * hs[nt][q] + ls[nt][q];
                const float d = q < 2 ? da : db, dm = q < 2 ? dma : dmb;
                acc[nt][q] = fmaf(dx * d, (float)s, fmaf(-(dx * dm), (float)m, acc[nt][q]));
            }
    }
    // The warps' partials added in warp order.
    __shared__ float red[TM_WARPS][NT][16][8];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int q = 0; q < 4; q++) red[warp][nt][g + 8 * (q >> 1)][2 * t + (q & 1)] = acc[nt][q];
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 128; i += blockDim.x) {
        const int nt = i / 128, r = (i / 8) % 16, c = i % 8;
        const int tok = 8 * nt + c, o = o0 + r;
        float v = red[0][nt][r][c];
#pragma unroll
        for (int w = 1; w < TM_WARPS; w++) v += red[w][nt][r][c];
        if (tok < rows && o < n_out) out[(size_t)tok * n_out + o] = v;
    }
}
// EMU_TM_END

// x rows into the planes, scales and sums of gemv_tm_q4k: one warp per 256 columns of a row.
extern "C" __global__ void __launch_bounds__(TM_WARPS * 32)
    quant_x_q8s(const float* __restrict__ x, int rows, int n_in, int8_t* __restrict__ xq, float* __restrict__ xs,
                int* __restrict__ xsum) {
    PDL_ENTRY();
    const int nsb = n_in / QK_K;
    const long long w = (long long)blockIdx.x * TM_WARPS + (threadIdx.x >> 5);
    if (w >= (long long)rows * nsb) return;  // whole warp
    tm_quant_block(x, n_in, (int)(w / nsb), (int)(w % nsb), xq, xs, xsum);
}

#define GEMV_TM_KERNEL(R)                                                                                      \
    extern "C" __global__ void __launch_bounds__(TM_WARPS * 32)                                                \
        gemv_tm_q4k_r##R(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,                    \
                         const int8_t* __restrict__ xq, const float* __restrict__ xs,                         \
                         const int* __restrict__ xsum, int rows, float* __restrict__ out) {                   \
        PDL_ENTRY();                                                                                           \
        gemv_tm_q4k<R>(W, rb, n_out, n_in, xq, xs, xsum, rows, out, blockIdx.x * 16);                          \
    }
GEMV_TM_KERNEL(8)
GEMV_TM_KERNEL(16)

// A block's ticket after it has written its share of some outputs: adds `n` to *t and sets
// *last (shared) where that completes `total`. The block barrier orders every thread's writes
// before thread 0's fence (cumulative) and atomic; in the last block, thread 0's fence after
// the atomic and the barrier order the others' reads (L2: __ldcg) after it. One fence per
// block, not one per thread (MATMUL.md round 11, item 4). (fence.acq_rel.gpu in place of
// __threadfence's fence.sc.gpu measured no different: MATMUL.md round 54.)
__device__ __forceinline__ void tail_ticket(unsigned* t, unsigned n, unsigned total, unsigned* last) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const bool l = atomicAdd(t, n) + n == total;
        if (l) __threadfence();
        *last = l;
    }
    __syncthreads();
}

// One tensor-core GEMV block (sm_90+): bulk copy of its tile into two slots, x staged at
// R = 1 (not for the HALF tile: its long rows' x would take the shared memory of a block),
// then gemvq_tc_q4k / gemvq_tc_q6k. The tile: 16 rows (plain: rows r0.. and r0 + 8.. of W in
// the two slots), 8 SwiGLU pairs (rows r0.. of W, the gate, and of W2, the up), or HALF 8
// rows (r0.. and r0 + 4..). TYPE: Q4_K, Q5_K (the Q4_K form's Q5) or Q6_K (any other is the
// Q6_K form: never launched).
// NORM (Q4_K, the SwiGLU of gemvq_swiglu_tcn_q4_k): x's planes are those of x ⊙ n, written
// by the producer (gemvq_tc2_add_q4k) with the per-group Σ x² in pss[r][n_in / 32]; after
// the PDL wait each row's s = 1 / sqrt(Σ / n_in + eps) is summed in a fixed order (lane i
// takes groups i, i + 32, ...; then the xor butterfly) into shared memory for tc_store.
template <int TYPE, int R, bool SWIGLU, bool HALF, bool NORM = false, bool W4 = false>
__device__ __forceinline__ void gemvq_tc_block(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                               long long rb, int n_out, int n_in, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xd, int rows, float* __restrict__ out,
                                               int bx, uint8_t* smem, uint64_t* bar,
                                               const float* __restrict__ pss = nullptr, float eps = 0.0f) {
    static_assert(!W4 || TYPE == GGML_Q4_K, "gemvq_tc_block: W4 is the Q4_K tile's");
#if __CUDA_ARCH__ >= 900
    constexpr int NS = HALF ? 4 : 8;  // rows per slot
    constexpr bool XS = R == 1 && !HALF;
    const int r0 = bx * (SWIGLU ? NS : 2 * NS);
    const uint8_t* Wb = SWIGLU ? W2 : W;
    const int rbeg = SWIGLU ? r0 : r0 + NS;
    const uint8_t* pa = W + (size_t)r0 * (size_t)rb;
    const uint8_t* pb = Wb + (size_t)rbeg * (size_t)rb;
    const size_t slot = tc_slot(rb, NS);
    bulk_prologue_spans(pa, max(0, min(NS, n_out - r0)), pb, max(0, min(NS, n_out - rbeg)), rb, slot, smem, bar);
    const uint8_t* s0 = smem + ((size_t)pa & 15);
    const uint8_t* s1 = smem + slot + ((size_t)pb & 15);
    const int diag = gemv_diag;  // timing only (matmul.rs): 1 no compute, 3 no wait before it
    uint8_t* xs = smem + 2 * slot;  // XS: x after the two slots
    __shared__ float sn[NORM ? R : 1];
    if (XS) {
        // x's loads first, the group sums' while they are in flight (one round trip for both).
        TcXStage st;
        tc_stage_x_load(st, xq, xd, n_in);
        if (NORM) tc_norm_scale<R>(pss, n_in, rows, eps, sn);
        tc_stage_x_store(st, xs, xq, xd, n_in);  // ends with the barrier sn needs too
    } else if (NORM) {
        tc_norm_scale<R>(pss, n_in, rows, eps, sn);
        __syncthreads();
    }
    TL_MARK(0);
    if (diag != 3) gemv_bulk_wait(bar);
    TL_MARK(1);
    if (diag != 1) {
        const int8_t* xa = XS ? (const int8_t*)xs : xq;
        const float2* da = XS ? (const float2*)(xs + 2 * n_in + 128) : xd;
        const int plane = XS ? n_in + 64 : n_in;
        if (TYPE == GGML_Q4_K)
            gemvq_tc_q4k<R, SWIGLU, XS, HALF, NORM, false, W4>(s0, s1, rb, n_out, n_in, xa, da, rows, out, r0, plane,
                                                               0, sn);
        else if (TYPE == GGML_Q5_K)
            gemvq_tc_q4k<R, SWIGLU, XS, HALF, NORM, false, false, true>(s0, s1, rb, n_out, n_in, xa, da, rows, out, r0,
                                                                        plane, 0, sn);
        else
            gemvq_tc_q6k<R, SWIGLU, XS, HALF, NORM>(s0, s1, rb, n_out, n_in, xa, da, rows, out, r0, plane, 0, sn);
    }
    if (diag == 3) gemv_bulk_wait(bar);
#endif
}

// Two 16-row tiles per block (gemvq_tct_<q4_k|q6_k>_r1; matmul.rs `TCT_MAX_SMEM`): the
// one-row plain launches of many tiles whose 16-row tile is small — the lm heads of
// 2048-column models (Qwen3-30B-A3B: 151936 x 2048 Q6_K, 27 KB a tile).
//  Why: a one-tile block of such a launch holds 27 KB in flight, three per SM 81 KB, about
//  what the SM's share of the bandwidth needs over one DRAM round trip under load, so every
//  block turnover (its compute, its exit, the next block's copy issue) leaves the SM short
//  of bytes: the 30B's lm head ran at ~2.8 TB/s against the 4096-column one's ~3.5
//  (DECODE_STEP.md traces). Here a block issues both tiles' copies at once (each on its own
//  mbarrier), stages x once, and computes tile 0 as soon as it lands while tile 1 is still
//  in flight: 54 KB a block, three blocks per SM as before.
//  Bits: each tile is gemvq_tc_block's one-row tile (gemvq_tc_q4k / gemvq_tc_q6k, x staged,
//  tc_store) on the same slots' layout, so every output is the one-tile kernel's.
//  Rows r 32 bx + 16 t .. + 15 of tile t (slot 2 t rows r0 .., slot 2 t + 1 rows r0 + 8 ..).
template <int TYPE>
__device__ __forceinline__ void gemvq_tct_block(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                                const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                                                float* __restrict__ out, uint8_t* smem, uint64_t* bars) {
#if __CUDA_ARCH__ >= 900
    const size_t slot = tc_slot(rb, 8);
    const int rbase = blockIdx.x * 32;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int t = 0; t < 2; t++) {
            const int r0 = rbase + 16 * t;
            const uint8_t* pa = W + (size_t)r0 * (size_t)rb;
            bulk_issue_spans(pa, max(0, min(8, n_out - r0)), pa + 8 * (size_t)rb, max(0, min(8, n_out - r0 - 8)), rb,
                             slot, smem + 2 * t * slot, bars + t);
        }
    }
    __syncthreads();
    PDL_ENTRY();
    uint8_t* xs = smem + 4 * slot;  // x after the four slots
    tc_stage_x(xs, xq, xd, n_in);
    const int8_t* xa = (const int8_t*)xs;
    const float2* da = (const float2*)(xs + 2 * n_in + 128);
#pragma unroll 1
    for (int t = 0; t < 2; t++) {
        const int r0 = rbase + 16 * t;
        if (r0 >= n_out) break;  // block-uniform
        const uint8_t* pa = W + (size_t)r0 * (size_t)rb;
        const uint8_t* s0 = smem + 2 * t * slot + ((size_t)pa & 15);
        const uint8_t* s1 = smem + (2 * t + 1) * slot + ((size_t)(pa + 8 * (size_t)rb) & 15);
        gemv_bulk_wait(bars + t);
        if (TYPE == GGML_Q4_K)
            gemvq_tc_q4k<1, false, true>(s0, s1, rb, n_out, n_in, xa, da, 1, out, r0, n_in + 64);
        else if (TYPE == GGML_Q5_K)
            gemvq_tc_q4k<1, false, true, false, false, false, false, true>(s0, s1, rb, n_out, n_in, xa, da, 1, out,
                                                                          r0, n_in + 64);
        else
            gemvq_tc_q6k<1, false, true>(s0, s1, rb, n_out, n_in, xa, da, 1, out, r0, n_in + 64);
        __syncthreads();  // tc_store's shared sums are the next tile's
    }
#endif
}

// The o-projection handing the FFN's RMSNorm over to the SwiGLU (gemvq_tc2_add_q4_k_r<R>;
// matmul.rs `matmul_add_for_norm`, MATMUL.md round 24): a Q4_K GEMV whose block owns a whole
// 32-row quantization group, so that it can write the next GEMV's input itself.
//  - Block: 16 warps, two groups of 8 (tg = threadIdx.x / 256), group tg on the 16-row tile
//    of rows 32 bx + 16 tg .. + 15 exactly as gemvq_tc_block's one-tile block (its own two
//    slots and mbarrier, its leader thread issuing its copies; x staged once for both at
//    R = 1), so each output is bitwise the plain tensor-core GEMV's (tc_reduce_g2).
//  - Epilogue: warp r (one per x row) takes the block's 32 outputs v, lane j row 32 bx + j:
//    x ← x + v (the residual add, in place: bitwise matmul + add_assign), then the planes of
//    x ⊙ n (n: the FFN norm's weight) by quant_q8_lane into pq / pd (quant_x_q8's layout) and
//    the group's Σ x² (xor butterfly) into pss[r][bx]. The SwiGLU after it
//    (gemvq_swiglu_tcn_q4_k) scales by 1 / rms(x) from those sums: no norm launch.
//  - One block per 32 rows: 128 blocks of 512 threads for a 4096-row projection, one per SM
//    (the one-tile kernel's 256 blocks run two per SM: the same bytes per SM).
//  Needs n_out % 32 == 0 and R <= 16 warps.
//  PX (gemvq_tc2_addx_q4_k_r<R>; FERRITE_TC2_PX): the epilogue's loads go out early — the
//  norm weight before the PDL wait, the residual x right after it (its last writer is
//  launches back, but the wait is what orders it) — so that their round trips (the weight
//  from DRAM: each layer's is read once a step) overlap the tiles' copy and compute instead
//  of following them.
template <int R, bool PX = false>
__device__ __forceinline__ void gemvq_tc2_add_q4k(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                                  const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                                                  int rows, float* __restrict__ x, const float* __restrict__ nw,
                                                  int8_t* __restrict__ pq, float2* __restrict__ pd,
                                                  float* __restrict__ pss, uint8_t* smem, uint64_t* bars) {
#if __CUDA_ARCH__ >= 900
    constexpr bool XS = R == 1;
    const int tg = threadIdx.x >> 8;
    const int r0 = blockIdx.x * 32 + 16 * tg;
    const uint8_t* pa = W + (size_t)r0 * (size_t)rb;
    const uint8_t* pb = W + (size_t)(r0 + 8) * (size_t)rb;
    const size_t slot = tc_slot(rb, 8);
    uint8_t* gs = smem + (size_t)tg * 2 * slot;
    if ((threadIdx.x & 255) == 0)
        bulk_issue_spans(pa, max(0, min(8, n_out - r0)), pb, max(0, min(8, n_out - r0 - 8)), rb, slot, gs,
                         bars + tg);
    __syncthreads();
    float xe[2] = {0.f, 0.f};  // PX: x, n of this lane's epilogue element
    const int er = threadIdx.x >> 5, eo = blockIdx.x * 32 + (threadIdx.x & 31);
    const bool epi = er < R && er < rows;
    if constexpr (PX) {
        if (epi) xe[1] = nw[eo];
    }
    PDL_ENTRY();
    if constexpr (PX) {
        if (epi) xe[0] = x[(size_t)er * n_out + eo];
    }
    const uint8_t* s0 = gs + ((size_t)pa & 15);
    const uint8_t* s1 = gs + slot + ((size_t)pb & 15);
    uint8_t* xs = smem + 4 * slot;  // XS: x after the four slots
    if (XS) tc_stage_x(xs, xq, xd, n_in);
    gemv_bulk_wait(bars + tg);
    const int8_t* xa = XS ? (const int8_t*)xs : xq;
    const float2* da = XS ? (const float2*)(xs + 2 * n_in + 128) : xd;
    tc2_tiles_add<R, XS, PX>(s0, s1, rb, n_out, n_in, xa, da, rows, XS ? n_in + 64 : n_in, blockIdx.x, x, nw, pq,
                             pd, pss, xe);
#endif
}

// gemvq_tc2_add_q4k's epilogue as a kernel of its own (add_norm_planes), after the plain
// tensor-core GEMV wrote y: for more rows of x than the two-tile block holds in its 128
// registers (matmul.rs TC2_MAX_ROWS). One warp per (row, 32-group), the same operations in
// the same order, so the residual, the planes and the sums are bitwise the fused kernel's
// at every row count.
extern "C" __global__ void add_norm_planes(float* __restrict__ x, const float* __restrict__ y,
                                           const float* __restrict__ nw, int rows, int n, int8_t* __restrict__ pq,
                                           float2* __restrict__ pd, float* __restrict__ pss) {
    PDL_ENTRY();
    const int ng = n / QK;
    const long long blk = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= (long long)rows * ng) return;  // whole warp
    const int lane = threadIdx.x & 31;
    const long long r = blk / ng;
    const int o = (int)(blk % ng) * QK + lane;
    add_norm_lane(x + r * n + o, y[r * n + o], nw[o], lane, pq + r * 2 * n, n, o, pd + blk, pss + blk);
}

// The last block's sum of an output's ks slice partials (p: slice 0's, stride apart):
// every load issued first (one L2 round trip; a loop of load-then-add waited for each in
// turn: MATMUL.md round 48), then the adds in slice order from v, as that loop did.
#define TCK_MAX_SPLITS 8  // matmul.rs TCK_MAX_SPLITS
__device__ __forceinline__ void tck_sum(float& v, const float* p, size_t stride, int ks) {
    float t[TCK_MAX_SPLITS];
#pragma unroll
    for (int j = 0; j < TCK_MAX_SPLITS; j++) t[j] = j < ks ? __ldcg(p + (size_t)j * stride) : 0.0f;
#pragma unroll
    for (int j = 0; j < TCK_MAX_SPLITS; j++)
        if (j < ks) v += t[j];
}

// The long rows split along K (gemvq_tck_<type>_r<R>; matmul.rs `TcForm::Split`):
// block (tile, k) takes rows 16 tile .. 16 tile + 15 over the columns [k kc, k kc + kn) of
// n_in (kn = kc but for a shorter last slice; whole super-blocks), a 16 x kn tile laid out in
// the two slots exactly as the tile of a kn-column weight (rows one slice apart), so the tile
// arithmetic is gemvq_tc_q4k / gemvq_tc_q6k unchanged on a kn-column matrix, with x's slice
// staged as gemvq_tc_block stages x.
//  Why: the 12288-column down projections' 16-row tile (110 KB for Q4_K) fits one or two
//  blocks per SM and puts the whole matrix in one wave (copy, then compute: MATMUL.md rounds
//  5, 9), so they ran on the lane code, whose compute (~9.4 us for Q4_K) exceeds the 6.6 us
//  copy (DECODE_STEP.md). In slices of 4096 columns the tile is the SwiGLU's 16 x 4096
//  (37 KB Q4_K, 54 KB Q6_K), three blocks per SM, waves that overlap.
//  Copies: one bulk copy per row slice (16 per block, from threads 0..15, since row slices
//  are not contiguous across rows); every slice is 16-byte aligned (the host's rule: rb and
//  the slice bytes multiples of 16).
//  Rows of x: R = 1 stages x's slice in shared memory; larger R (verify) read x from global
//  memory, as gemvq_tc_block does; the same arithmetic, so the same bits, at every R.
//  Sum: each block writes its partial sums to part[k][rows][n_out]; the block that draws the
//  tile's last ticket (tickets[tile], reset to 0 by it) adds the ks partials in the order of
//  k, so the output does not depend on which block finishes last.
// PAIRN (one row; gemvq_tckn_q4_k_r1, matmul.rs `matmul_add_for_norm` before the Q, K, V
// launch): one ticket per pair of tiles (2 ks blocks, 32 rows: a whole 32-element group of
// the output), and the pair's last block, instead of storing the sums, runs add_norm_planes's
// add_norm_lane on them (warp 0, lane l: output 32 (tile / 2) + l, its ks partials added in
// the order of k as above): x += the sum in place, the planes of x ⊙ n and the group's Σ x²
// for the NORM Q, K, V launch — the residual of the plain launch + add_assign, bitwise.
// W4 (Q4_K, one row; gemvq_tck[n]w4_q4_k_r1, MATMUL.md round 50): blocks of four warps,
// gemvq_tc_q4k's W4 (the eight-warp tile's sums in its order, so the same partials and the
// same outputs), four blocks per SM instead of three.
// Q8_0 (gemvq_tck_q8_0_r<R>, gemvq_tckn[w4]_q8_0_r1; MATMUL.md round 54): gemvq_tc_q80 on
// slices of whole 256-column units (272 bytes), its row slices PAD = 16 bytes apart beyond
// their length in the slots (its loads' bank conflicts two-way instead of four-way); the
// host's shared memory adds the same (matmul.rs tck_row_pad). Its lane-code down and the
// norm launch after it took 16.2 + 7.1 us a layer on Qwen3-8B Q8_0 (DECODE_STEP.md).
template <int TYPE, int R, bool PAIRN = false, bool W4 = false>
__device__ __forceinline__ void gemvq_tck_block(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                                int kc, const int8_t* __restrict__ xq,
                                                const float2* __restrict__ xd, int rows, float* __restrict__ out,
                                                float* __restrict__ part, unsigned* __restrict__ tickets,
                                                uint8_t* smem, uint64_t* bar, float* __restrict__ xres = nullptr,
                                                const float* __restrict__ nw = nullptr,
                                                int8_t* __restrict__ pq = nullptr, float2* __restrict__ pd = nullptr,
                                                float* __restrict__ pss = nullptr) {
    static_assert(!PAIRN || R == 1, "gemvq_tck_block: PAIRN is one row's");
    static_assert(!W4 || (TYPE != GGML_Q6_K && R == 1), "gemvq_tck_block: W4 is the one-row Q4_K / Q8_0 tile's");
#if __CUDA_ARCH__ >= 900
    constexpr int NS = 8;  // rows per slot
    constexpr bool XS = R == 1;
    // Bytes per 256 columns; Q8_0's row slices 16 bytes apart beyond their length in the slots
    // (gemvq_tc_q80: rows 16 mod 128 bytes apart take its loads' bank conflicts from four-way
    // to two-way).
    constexpr int SBB = TYPE == GGML_Q4_K ? Q4_K_BYTES : TYPE == GGML_Q8_0 ? Q8_0_UNIT_BYTES : Q6_K_BYTES;
    constexpr int PAD = TYPE == GGML_Q8_0 ? 16 : 0;
    __shared__ unsigned tck_last;
    const int tile = blockIdx.x, k = blockIdx.y, ks = gridDim.y;
    const int r0 = tile * 2 * NS, k0 = k * kc, kn = min(kc, n_in - k0);
    const int nrows = max(0, min(2 * NS, n_out - r0));
    const long long srb = (long long)(kn / QK_K) * SBB;  // bytes of a row slice
    const long long srs = srb + PAD;                      // and between rows in a slot
    const size_t slot = tc_slot(srs, NS);
    if (threadIdx.x == 0) {
        mbar_init(bar);
        mbar_expect(bar, (uint32_t)(nrows * srb));
    }
    __syncthreads();
    if (threadIdx.x < nrows) {
        const int j = threadIdx.x;
        const uint8_t* src = W + (size_t)(r0 + j) * (size_t)rb + (size_t)(k0 / QK_K) * SBB;
        bulk_g2s_w(bar, smem + (size_t)(j / NS) * slot + (size_t)(j % NS) * (size_t)srs, (size_t)src, (uint32_t)srb);
    }
    PDL_ENTRY();
    // XS: x after the two slots of the widest slice (the host sizes the shared memory for kc).
    uint8_t* xs = smem + 2 * tc_slot((long long)(kc / QK_K) * SBB + PAD, NS);
    if (XS) tc_stage_x(xs, xq + k0, xd + k0 / QK, kn, n_in);
    gemv_bulk_wait(bar);
    float* po = part + (size_t)k * (size_t)rows * (size_t)n_out;
    const int8_t* xa = XS ? (const int8_t*)xs : xq + k0;
    const float2* da = XS ? (const float2*)(xs + 2 * kn + 128) : xd + k0 / QK;
    const int nx = XS ? kn : n_in;  // x's row layout: the staged slice, or the whole global row
    if (TYPE == GGML_Q4_K)
        gemvq_tc_q4k<R, false, XS, false, false, false, W4>(smem, smem + slot, srb, n_out, nx, xa, da, rows, po, r0,
                                                             kn + 64, kn);
    else if (TYPE == GGML_Q8_0)
        gemvq_tc_q80<R, false, XS, false, W4>(smem, smem + slot, srs, n_out, nx, xa, da, rows, po, r0, kn + 64, kn);
    else
        gemvq_tc_q6k<R, false, XS>(smem, smem + slot, srb, n_out, nx, xa, da, rows, po, r0, kn + 64, kn);
    if (PAIRN) {
        const int pair = tile >> 1;
        tail_ticket(tickets + pair, 1u, 2u * (unsigned)ks, &tck_last);
        if (tck_last && threadIdx.x < 32) {
            const int lane = threadIdx.x, o = pair * 32 + lane;
            float v = 0.0f;
            tck_sum(v, part + o, (size_t)n_out, ks);
            add_norm_lane(xres + o, v, nw[o], lane, pq, n_out, o, pd + pair, pss + pair);
            if (lane == 0) tickets[pair] = 0;
        }
        return;
    }
    tail_ticket(tickets + tile, 1u, (unsigned)ks, &tck_last);
    if (tck_last) {
        for (int i = threadIdx.x; i < rows * nrows; i += blockDim.x) {
            const int r = i / nrows, o = r0 + i % nrows;
            float v = 0.0f;
            tck_sum(v, part + (size_t)r * n_out + o, (size_t)rows * n_out, ks);
            out[(size_t)r * n_out + o] = v;
        }
        if (threadIdx.x == 0) tickets[tile] = 0;
    }
#endif
}

// The one-row Q8_0 SwiGLU on the handed-over FFN norm as a ring (gemvq_swiglu_tcnp_q8_0_r1;
// matmul.rs `rms_norm_matmul_swiglu_handed`, FERRITE_SWIGLU_PIPE; MATMUL.md round 57):
// persistent blocks of eight warps, one per SM, each a ring of nb SwiGLU tiles (8 gate rows in
// slot 0, their 8 up rows in slot 1: gemvq_tc_block's SWIGLU layout, whole rows, so no partial
// sums) on the Q8_0 tensor-core tile (gemvq_tc_q80 SWIGLU NORM).
//  Why: the lane code streamed Qwen3-8B's 12288 x 4096 gate and up at ~3.46 TB/s (31.1 us a
//  layer, the step's largest item), and a one-tile block of the 70 KB tile would hold its slot
//  through copy, compute and exit; the ring keeps a tile in flight while one is computed:
//  29.7 us. nb = 2 (150 KB) by measurement: 1 and 3 (220 KB, nothing else fits beside it) were
//  no faster than the lane code. (The same ring of Q4_K tiles lost to its one-tile blocks, and
//  a ring of the K-split down's tiles did not gain: rounds 56-57.)
//  Rows: one bulk copy per row (lanes 0..7 of warp 0 the gate rows, 8..15 the up rows), rows
//  rb + 16 bytes apart in the slots (gemvq_tc_q80's two-way bank conflicts; rb = 34 n_in / 32
//  is a multiple of 128 for n_in a multiple of 512). Tiles: 8 outputs each, block b taking the
//  contiguous range [b tiles / G, (b + 1) tiles / G).
//  x: staged once after the PDL wait, with the row's 1 / rms from the group sums
//  (tc_norm_scale), as gemvq_tc_block's NORM does. Shared memory: nb buffers, then x.
//  hq / hd (FERRITE_SWIGLU_QH; nullptr: none): h's int8 planes for the down projection, so
//  that no quant_x launch runs between the two (MATMUL.md round 63). The block's range is
//  then whole 32-row groups (four tiles each: blocks [b groups / G, (b + 1) groups / G), the
//  most tiles a block takes no more than the tile ranges' for Qwen3-8B: 12), its outputs are
//  kept in shared memory too (tc_store's hs; at most PIPE_QH_MAX), and after its last tile
//  warp w quantizes groups w, w + 8, ... with quant_q8_lane: quant_x_q8's bits, all the
//  block's groups in one round at its end rather than one after each group's last tile
//  (which would hold warp 0, and so the next tile, ~0.15 us a group).
#define PIPE_QH_MAX 256  // matmul.rs PIPE_QH_MAX
__device__ __forceinline__ void gemvq_swiglu_p_q80(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                                   long long rb, int n_out, int n_in, int nb,
                                                   const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                                                   float* __restrict__ out, const float* __restrict__ pss,
                                                   float eps, uint8_t* smem, uint64_t* bars,
                                                   int8_t* __restrict__ hq, float2* __restrict__ hd) {
#if __CUDA_ARCH__ >= 900
    constexpr int NS = 8, PAD = 16, GT = QK / NS;  // GT: tiles a 32-row group
    __shared__ float hsm[PIPE_QH_MAX];
    const bool qh = hq != nullptr;
    if (qh && n_out % QK != 0) __trap();  // the launcher passes planes only for whole groups
    const int tiles = (n_out + NS - 1) / NS, groups = n_out / QK;
    const int glo = (int)((long long)blockIdx.x * groups / gridDim.x);
    const int ghi = (int)((long long)(blockIdx.x + 1) * groups / gridDim.x);
    const int lo = qh ? GT * glo : (int)((long long)blockIdx.x * tiles / gridDim.x);
    const int hi = qh ? GT * ghi : (int)((long long)(blockIdx.x + 1) * tiles / gridDim.x);
    if (qh && (hi - lo) * NS > PIPE_QH_MAX) __trap();  // the launcher's bound
    const long long srs = rb + PAD;
    const size_t slot = tc_slot(srs, NS);
    uint8_t* xs = smem + (size_t)nb * 2 * slot;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Warp 0: tile i into buffer b (lane 0 arms the barrier first: program order in the warp).
    auto issue = [&](int i, int b) {
        const int r0 = i * NS, nrows = min(NS, n_out - r0);
        if (lane == 0) mbar_expect(bars + b, (uint32_t)(2 * nrows * rb));
        __syncwarp();
        const int m = lane / NS, j = lane % NS;
        if (lane < 2 * NS && j < nrows)
            bulk_g2s_w(bars + b, smem + (size_t)b * 2 * slot + (size_t)m * slot + (size_t)j * (size_t)srs,
                       (size_t)((m ? W2 : W) + (size_t)(r0 + j) * (size_t)rb), (uint32_t)rb);
    };
    if (threadIdx.x < nb) mbar_init(bars + threadIdx.x);
    __syncthreads();
    if (warp == 0)
        for (int b = 0; b < nb && lo + b < hi; b++) issue(lo + b, b);
    PDL_ENTRY();
    __shared__ float sn[1];
    {
        TcXStage st;
        tc_stage_x_load(st, xq, xd, n_in);
        tc_norm_scale<1>(pss, n_in, 1, eps, sn);
        tc_stage_x_store(st, xs, xq, xd, n_in);  // ends with the barrier sn needs too
    }
    const float2* da = (const float2*)(xs + 2 * n_in + 128);
    for (int i = lo, b = 0, ph = 0; i < hi; i++) {
        mbar_wait(bars + b, (uint32_t)ph);
        uint8_t* s0 = smem + (size_t)b * 2 * slot;
        gemvq_tc_q80<1, true, true, true>(s0, s0 + slot, srs, n_out, n_in, (const int8_t*)xs, da, 1, out, i * NS,
                                          n_in + 64, 0, sn, qh ? hsm + (i - lo) * NS : nullptr);
        __syncthreads();  // buffer b read by every warp (and hsm written)
        if (warp == 0 && i + nb < hi) issue(i + nb, b);
        if (++b == nb) {
            b = 0;
            ph ^= 1;
        }
    }
    if (qh)
        for (int k = warp; k < ghi - glo; k += GEMV_WARPS)
            quant_q8_lane(hsm[k * QK + lane], lane, hq, n_out, (glo + k) * QK + lane, hd + glo + k);
#endif
}

// As gemv(), over quantized x. SWIGLU: a row group is (gate row o, up row o) of W and W2 and
// stores silu(gate) * up at out[o]; otherwise NW consecutive rows of W.
// TC: the tensor-core form (gemvq_tc_q4k / gemvq_tc_q6k; ks = 1, sm_90+ only: the
// launcher's choice).
// NORM: a norm handed over by the producer before (matmul.rs matmul_add_for_norm): x's planes
// are those of x ⊙ n with the groups' Σ x² in pss[r][n_in / 32]; after the PDL wait each row's
// s = 1 / sqrt(Σ / n_in + eps) (tc_norm_scale's order), and every sum is scaled by s at the
// store (SWIGLU: gate and up, before the SwiGLU), as tc_store's NORM form does. The lane
// code (the Q8_0 SwiGLU of gemvq_swiglu_n_q8_0, the Q6_K V of the NORM Q, K, V launch) and
// the Q4_K tensor-core tile (gemvq_tc_block's NORM; the Q, K, V launch's Q4_K segments).
// NWT: rows per warp of the plain lane code (GEMV_NW; 4 for gemvq_add_n_q8_0's 32-row blocks).
// SOUT (plain rows, one x row): the block's sums go to sout[output - first row of the block]
// (shared memory) instead of out; xe_src (or nullptr): a float loaded into *xe_dst right
// after the PDL wait (gemvq_add_n_q8_0_r1's residual).
template <int TYPE, int R, bool SWIGLU, bool TC = false, bool NORM = false, int NWT = GEMV_NW, bool SOUT = false>
__device__ __forceinline__ void gemvq(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2, long long rb,
                                      int n_out, int n_in, const int8_t* __restrict__ xq,
                                      const float2* __restrict__ xd, int rows, float* __restrict__ out, int ks,
                                      int bx, const float* __restrict__ pss = nullptr, float eps = 0.0f,
                                      float* sout = nullptr, const float* xe_src = nullptr,
                                      float* xe_dst = nullptr) {
    static_assert(!SOUT || (R == 1 && !SWIGLU && !TC), "gemvq: SOUT is for one plain row");
    constexpr int NW = NWT;
    constexpr int PER = SWIGLU ? 1 : NW;  // outputs per row group
    __shared__ float red[GEMV_WARPS][R * NW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kw = warp % ks, grp = warp / ks;
    const int o0 = (bx * (GEMV_WARPS / ks) + grp) * PER;
    const bool active = o0 < n_out;  // whole warp
    const int per_block = (GEMV_WARPS / ks) * PER, r0 = bx * per_block;
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) uint8_t gemv_smem[];
    __shared__ __align__(8) uint64_t gemv_bar;
    if (gemv_dyn_smem() == 0) __trap();  // the launcher always passes the slots on sm_90+
    if (TC && (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K || TYPE == GGML_Q6_K)) {
        if (ks != 1) __trap();  // the tensor-core launches are ks = 1
        // (NORM && TC: the lane-code instances never take this branch nor instantiate the
        // tile's NORM form.)
        gemvq_tc_block<TYPE, R, SWIGLU, false, NORM && TC>(W, W2, rb, n_out, n_in, xq, xd, rows, out, bx,
                                                           gemv_smem, &gemv_bar, pss, eps);
        return;
    }
    gemv_bulk_prologue(W, SWIGLU ? W2 : nullptr, rb, n_out, r0, per_block, gemv_smem, &gemv_bar);
#else
    gemv_prologue(W, SWIGLU ? W2 : nullptr, rb, n_out, r0, r0 + per_block);
#endif
    if constexpr (SOUT) {
        if (xe_src != nullptr) *xe_dst = *xe_src;  // past the PDL wait
    }
    __shared__ float sn[NORM ? R : 1];
    if (NORM) {
        tc_norm_scale<R>(pss, n_in, rows, eps, sn);
        __syncthreads();
    }
    float acc[R][NW];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int w = 0; w < NW; w++) acc[r][w] = 0.0f;
    if (active) {
        // Row w of the group: row ow[w] of W (or of W2: the SwiGLU's up row).
        int ow[NW];
#pragma unroll
        for (int w = 0; w < NW; w++) ow[w] = SWIGLU ? o0 : (o0 + w < n_out ? o0 + w : n_out - 1);
        const uint8_t* wr[NW];
#if __CUDA_ARCH__ >= 900
        // The copies in shared memory: W's slot, then W2's; rows `off` bytes into the slot.
        const size_t slot = gemv_slot(per_block, rb);
#pragma unroll
        for (int w = 0; w < NW; w++) {
            const int m = SWIGLU && w == 1 ? 1 : 0;
            const size_t off = (size_t)((m ? W2 : W) + (size_t)r0 * (size_t)rb) & 15;
            wr[w] = gemv_smem + m * slot + off + (size_t)(ow[w] - r0) * (size_t)rb;
        }
        const int diag = gemv_diag;
        if (diag != 3) gemv_bulk_wait(&gemv_bar);
        if (diag != 1) gemvq_lane<TYPE, R, NW, true>(wr, n_in, xq, xd, rows, lane, kw, ks, acc);
        if (diag == 3) gemv_bulk_wait(&gemv_bar);
#else
#pragma unroll
        for (int w = 0; w < NW; w++) wr[w] = (SWIGLU && w == 1 ? W2 : W) + (size_t)ow[w] * (size_t)rb;
        gemvq_lane<TYPE, R, NW, false>(wr, n_in, xq, xd, rows, lane, kw, ks, acc);
#endif
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int w = 0; w < NW; w++) {
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) acc[r][w] += __shfl_xor_sync(0xffffffffu, acc[r][w], off);
            }
    }
    if (ks > 1) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int w = 0; w < NW; w++) red[warp][r * NW + w] = acc[r][w];
        }
        __syncthreads();
        if (!active || kw != 0) return;
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int w = 0; w < NW; w++) {
                float v = red[warp][r * NW + w];
                for (int k = 1; k < ks; k++) v += red[warp + k][r * NW + w];
                acc[r][w] = v;
            }
    } else if (!active) {
        return;
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (SWIGLU) {
            if (lane == (r & 31) && r < rows) {
                if (NORM)
                    out[(size_t)r * n_out + o0] = silu(acc[r][0] * sn[r]) * (acc[r][1] * sn[r]);
                else
                    out[(size_t)r * n_out + o0] = silu(acc[r][0]) * acc[r][1];
            }
        } else {
#pragma unroll
            for (int w = 0; w < NW; w++)
                if (lane == ((r * NW + w) & 31) && r < rows && o0 + w < n_out) {
                    if (SOUT)
                        sout[o0 + w - r0] = acc[r][w];
                    else
                        out[(size_t)r * n_out + o0 + w] = NORM ? acc[r][w] * sn[r] : acc[r][w];
                }
        }
    }
}

// One family of quantized-x GEMV kernels: gemvq<TCN>_<name>_r<R> (plain), gemvq_swiglu<TCN>_...
// and gemvq_multi<TCN>_... (TCN empty: the lane code; _tc: the tensor-core form, TC = true);
// LB: the parenthesised __launch_bounds__ arguments.
#define GEMVQ_KERNEL_FAM(name, TYPE, R, TC, TCN, LB)                                                         \
    extern "C" __global__ void __launch_bounds__ LB                                                          \
        gemvq##TCN##_##name##_r##R(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,        \
                                   const int8_t* __restrict__ xq, const float2* __restrict__ xd, int rows,  \
                                   float* __restrict__ out, int ks) {                                        \
        gemvq<TYPE, R, false, TC>(W, W, rb, n_out, n_in, xq, xd, rows, out, ks, blockIdx.x);                 \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__ LB                                                          \
        gemvq_swiglu##TCN##_##name##_r##R(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,    \
                                          long long rb, int n_out, int n_in, const int8_t* __restrict__ xq, \
                                          const float2* __restrict__ xd, int rows, float* __restrict__ out, \
                                          int ks) {                                                          \
        gemvq<TYPE, R, true, TC>(W, W2, rb, n_out, n_in, xq, xd, rows, out, ks, blockIdx.x);                 \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__ LB                                                          \
        gemvq_multi##TCN##_##name##_r##R(GemvSegs sg, long long rb, int n_in, const int8_t* __restrict__ xq, \
                                         const float2* __restrict__ xd, int rows, int ks) {                  \
        int bx = blockIdx.x;                                                                                 \
        const int s = gemv_seg(sg, bx);                                                                      \
        const uint8_t* W = s == 0 ? sg.w0 : (s == 1 ? sg.w1 : sg.w2);                                       \
        float* out = s == 0 ? sg.out0 : (s == 1 ? sg.out1 : sg.out2);                                       \
        const int n_out = s == 0 ? sg.n0 : (s == 1 ? sg.n1 : sg.n2);                                        \
        gemvq<TYPE, R, false, TC>(W, W, rb, n_out, n_in, xq, xd, rows, out, ks, bx);                         \
    }
#define GEMVQ_KERNEL(name, TYPE, R) GEMVQ_KERNEL_FAM(name, TYPE, R, false, , (GEMV_WARPS * 32))
// gemvq_tc_<q4_k|q6_k>_r<R> and their SwiGLU / grouped forms: gemvq_tc_q4k / gemvq_tc_q6k
// (ks = 1 launches on sm_90+). Q4_K R = 1 and 2: at most 85 registers, three blocks of 8 warps
// per SM (R = 1 had 64 and four blocks, MATMUL.md round 8, until the branch-free x words took
// 78: round 11). Q6_K (a 4096-column tile + x is ~62 KB: three blocks per SM by shared
// memory) R = 1 at most 85, R = 2 at most 128. Larger R (batched decode, verify) take what
// they need.
#define GEMVQ_TC_MINB(TYPE, R) ((TYPE) != GGML_Q6_K ? ((R) <= 2 ? 3 : 1) : ((R) == 1 ? 3 : (R) == 2 ? 2 : 1))
#define GEMVQ_TC_KERNEL(name, TYPE, R) \
    GEMVQ_KERNEL_FAM(name, TYPE, R, true, _tc, (GEMV_WARPS * 32, GEMVQ_TC_MINB(TYPE, R)))
#define GEMVQ_TC_ALL_R(name, TYPE) GEMV_EACH_R(GEMVQ_TC_KERNEL, name, TYPE)
// gemvq_tch_<type>_r<R>: the 8-row tile (HALF) for rows too long for the 16-row one (the
// 12288-column down projections); plain weights only. Bounds as the 16-row kernels'.
#define GEMVQ_TCH_KERNEL(name, TYPE, R)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMVQ_TC_MINB(TYPE, R))                   \
        gemvq_tch_##name##_r##R(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,           \
                                const int8_t* __restrict__ xq, const float2* __restrict__ xd, int rows,     \
                                float* __restrict__ out) {                                                  \
        extern __shared__ __align__(128) uint8_t gemv_smem[];                                               \
        __shared__ __align__(8) uint64_t gemv_bar;                                                          \
        gemvq_tc_block<TYPE, R, false, true>(W, W, rb, n_out, n_in, xq, xd, rows, out, blockIdx.x, gemv_smem, \
                                             &gemv_bar);                                                    \
    }
#define GEMVQ_TCH_ALL_R(name, TYPE) GEMV_EACH_R(GEMVQ_TCH_KERNEL, name, TYPE)
// gemvq_tck<W>_<type>_r<R>: the K-split tile for long rows (gemvq_tck_block): grid (tiles, ks),
// slices of kc columns, partial sums in part[ks][rows][n_out], one ticket per tile. W empty:
// eight warps, bounds as the 16-row kernels'; W = w4 (gemvq_tckw4_q4_k_r1): W4 = true, LB
// its bounds.
#define GEMVQ_TCK_FORM(W, name, TYPE, R, W4, LB)                                                           \
    extern "C" __global__ void __launch_bounds__ LB                                                         \
        gemvq_tck##W##_##name##_r##R(const uint8_t* __restrict__ W_, long long rb, int n_out, int n_in,     \
                                     const int8_t* __restrict__ xq, const float2* __restrict__ xd,          \
                                     int rows, float* __restrict__ out, int kc, float* __restrict__ part,   \
                                     unsigned* __restrict__ tickets) {                                      \
        extern __shared__ __align__(128) uint8_t gemv_smem[];                                               \
        __shared__ __align__(8) uint64_t gemv_bar;                                                          \
        gemvq_tck_block<TYPE, R, false, W4>(W_, rb, n_out, n_in, kc, xq, xd, rows, out, part, tickets,      \
                                            gemv_smem, &gemv_bar);                                          \
    }
#define GEMVQ_TCK_KERNEL(name, TYPE, R) \
    GEMVQ_TCK_FORM(, name, TYPE, R, false, (GEMV_WARPS * 32, GEMVQ_TC_MINB(TYPE, R)))
#define GEMVQ_TCK_ALL_R(name, TYPE) GEMV_EACH_R(GEMVQ_TCK_KERNEL, name, TYPE)

#define GEMVQ_ALL_R(name, TYPE) GEMV_EACH_R(GEMVQ_KERNEL, name, TYPE)

// gemvq_multi_<a>_<b>_r<R>: the grouped launch when the third weight has another type (the
// Q4_K_M mix stores V as Q6_K in half the layers, Q and K as Q4_K: without this V was a
// launch of its own, 64 blocks for ~6 µs). Segments 0 and 1 are type A with (rb, ks), segment
// 2 type B with (rb2, ks2); each output is computed exactly as by its single-weight launch
// (same lane code, same split), so the bits do not change. The launch's shared memory is the
// larger of the two segments' slots.
// TCN / TC / LB as in GEMVQ_KERNEL_FAM: _tc puts segments 0 and 1 in the tensor-core form
// (their ks = 1); segment 2 keeps the lane code (Q6_K's tensor-core tile was slower on the
// 1024-row V: MATMUL.md round 9).
#define GEMVQ_MIXED_FAM(na, TA, nb, TB, R, TC, TC2, TCN, LB, VF)                                             \
    extern "C" __global__ void __launch_bounds__ LB                                                          \
        gemvq_multi##TCN##_##na##_##nb##_r##R(GemvSegs sg, long long rb, long long rb2, int n_in,            \
                                              const int8_t* __restrict__ xq, const float2* __restrict__ xd,  \
                                              int rows, int ks, int ks2) {                                   \
        int bx = mixed_bx<VF>();                                                                             \
        const int s = gemv_seg(sg, bx);                                                                      \
        if (s < 2) {                                                                                         \
            const uint8_t* W = s == 0 ? sg.w0 : sg.w1;                                                       \
            gemvq<TA, R, false, TC>(W, W, rb, s == 0 ? sg.n0 : sg.n1, n_in, xq, xd, rows,                    \
                                    s == 0 ? sg.out0 : sg.out1, ks, bx);                                     \
        } else {                                                                                             \
            gemvq<TB, R, false, TC2>(sg.w2, sg.w2, rb2, sg.n2, n_in, xq, xd, rows, sg.out2, ks2, bx);        \
        }                                                                                                    \
    }
#define GEMVQ_MIXED_KERNEL(na, TA, nb, TB, R) \
    GEMVQ_MIXED_FAM(na, TA, nb, TB, R, false, false, , (GEMV_WARPS * 32), false)
// R = 1 with the tensor-core segments: at most 85 registers (three blocks per SM, as the
// lane-code kernels).
#define GEMVQ_MIXED_TC_KERNEL(na, TA, nb, TB, R) \
    GEMVQ_MIXED_FAM(na, TA, nb, TB, R, true, false, _tc, (GEMV_WARPS * 32, (R) == 1 ? 3 : 1), false)
#define GEMVQ_MIXED_TC_ALL_R(na, TA, nb, TB) GEMV_EACH_R(GEMVQ_MIXED_TC_KERNEL, na, TA, nb, TB)
// gemvq_multi_tcv_<a>_<b>_r<R> (FERRITE_QKV_VTC; MATMUL.md round 51): the third weight on the
// tensor-core tile too (ks2 = 1: 64 tiles of 16 rows for a 1024-row Q6_K V). Why: in one wave
// of 384 blocks the lane-code V blocks (a warp's two rows over all 4096 columns) ran last;
// the mixed launch took 5.3 / 6.4 µs against 3.2 / 3.6 for the all-Q4_K one (traces, 17th
// session), 3.1 MB more bytes being ~0.7 µs of it. Every R, so that decode and verify keep
// one V kernel (the same bits).
#define GEMVQ_MIXED_TCV_KERNEL(na, TA, nb, TB, R) \
    GEMVQ_MIXED_FAM(na, TA, nb, TB, R, true, true, _tcv, (GEMV_WARPS * 32, (R) == 1 ? 3 : 1), false)
// gemvq_multi_tcvf_<a>_<b>_r1 (FERRITE_QKV_VFIRST; MATMUL.md round 52): the same launch with
// its blocks taken in reverse order (mixed_bx), so that the V tiles, the heaviest (a Q6_K
// 16-row tile: 54 KB and ~1.5x the Q4_K tile's instructions per MMA), are dispatched first
// instead of last. Each block's arithmetic is unchanged, so the bits are the R = 1 tcv's.
#define GEMVQ_MIXED_TCVF_KERNEL(na, TA, nb, TB)                                                                \
    GEMVQ_MIXED_FAM(na, TA, nb, TB, 1, true, true, _tcvf, (GEMV_WARPS * 32, 3), true)

#define GEMVQ_MIXED_ALL_R(na, TA, nb, TB) GEMV_EACH_R(GEMVQ_MIXED_KERNEL, na, TA, nb, TB)

GEMVQ_ALL_R(q8_0, GGML_Q8_0)
GEMVQ_ALL_R(q4_0, GGML_Q4_0)
GEMVQ_ALL_R(q4_1, GGML_Q4_1)
GEMVQ_ALL_R(q4_k, GGML_Q4_K)
GEMVQ_ALL_R(q5_k, GGML_Q5_K)
GEMVQ_ALL_R(q6_k, GGML_Q6_K)
GEMVQ_MIXED_ALL_R(q4_k, GGML_Q4_K, q6_k, GGML_Q6_K)
GEMVQ_TC_ALL_R(q4_k, GGML_Q4_K)
GEMVQ_TC_ALL_R(q6_k, GGML_Q6_K)
// gemvq_tc_q5_k_r<R>: Q5_K's 16-row tile (gemvq_tc_q4k's Q5), the plain launch alone: its
// SwiGLU and grouped forms, not measured against the lane code, are not built (MATMUL.md
// round 69).
#define GEMVQ_TC_PLAIN_KERNEL(name, TYPE, R)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMVQ_TC_MINB(TYPE, R))                    \
        gemvq_tc_##name##_r##R(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,             \
                               const int8_t* __restrict__ xq, const float2* __restrict__ xd, int rows,       \
                               float* __restrict__ out, int ks) {                                            \
        gemvq<TYPE, R, false, true>(W, W, rb, n_out, n_in, xq, xd, rows, out, ks, blockIdx.x);               \
    }
GEMV_EACH_R(GEMVQ_TC_PLAIN_KERNEL, q5_k, GGML_Q5_K)
// The grouped Q, K, V launch on the attention input's handed-over norm (gemvq's NORM; one
// row: matmul.rs `rms_norm_matmuls_handed`): gemvq_multi_tcn_q4_k_r1 (the tensor-core form),
// gemvq_multi_tcn_q4_k_q6_k_r1 (Q4_K Q, K on it + Q6_K V on the lane code, as the mixed
// launch) and gemvq_multi_n_q8_0_r1 (the lane code). Bounds as their plain forms'.
#define GEMVQ_MULTI_NORM_KERNEL(name, TYPE, TC, TCN, LB)                                                     \
    extern "C" __global__ void __launch_bounds__ LB                                                          \
        gemvq_multi##TCN##_##name##_r1(GemvSegs sg, long long rb, int n_in, const int8_t* __restrict__ xq,   \
                                       const float2* __restrict__ xd, int rows, int ks,                      \
                                       const float* __restrict__ pss, float eps) {                           \
        int bx = blockIdx.x;                                                                                 \
        const int s = gemv_seg(sg, bx);                                                                      \
        const uint8_t* W = s == 0 ? sg.w0 : (s == 1 ? sg.w1 : sg.w2);                                       \
        float* out = s == 0 ? sg.out0 : (s == 1 ? sg.out1 : sg.out2);                                       \
        const int n_out = s == 0 ? sg.n0 : (s == 1 ? sg.n1 : sg.n2);                                        \
        gemvq<TYPE, 1, false, TC, true>(W, W, rb, n_out, n_in, xq, xd, rows, out, ks, bx, pss, eps);         \
    }
GEMVQ_MULTI_NORM_KERNEL(q4_k, GGML_Q4_K, true, _tcn, (GEMV_WARPS * 32, GEMVQ_TC_MINB(GGML_Q4_K, 1)))
GEMVQ_MULTI_NORM_KERNEL(q8_0, GGML_Q8_0, false, _n, (GEMV_WARPS * 32))
// gemvq_multi_tcn<V>_q4_k_q6_k_r1: V on the lane code (V empty) or on the tile (V = v; the
// handed-over form of gemvq_multi_tcv, round 51).
#define GEMVQ_MIXED_NORM_KERNEL(TC2, V, VF)                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 3)                                         \
        gemvq_multi_tcn##V##_q4_k_q6_k_r1(GemvSegs sg, long long rb, long long rb2, int n_in,                \
                                          const int8_t* __restrict__ xq, const float2* __restrict__ xd,      \
                                          int rows, int ks, int ks2, const float* __restrict__ pss,          \
                                          float eps) {                                                       \
        int bx = mixed_bx<VF>();                                                                             \
        const int s = gemv_seg(sg, bx);                                                                      \
        if (s < 2) {                                                                                         \
            const uint8_t* W = s == 0 ? sg.w0 : sg.w1;                                                       \
            gemvq<GGML_Q4_K, 1, false, true, true>(W, W, rb, s == 0 ? sg.n0 : sg.n1, n_in, xq, xd, rows,     \
                                                   s == 0 ? sg.out0 : sg.out1, ks, bx, pss, eps);            \
        } else {                                                                                             \
            gemvq<GGML_Q6_K, 1, false, TC2, true>(sg.w2, sg.w2, rb2, sg.n2, n_in, xq, xd, rows, sg.out2,     \
                                                  ks2, bx, pss, eps);                                        \
        }                                                                                                    \
    }
GEMVQ_MIXED_NORM_KERNEL(false, , false)
GEMVQ_MIXED_NORM_KERNEL(true, v, false)
GEMVQ_MIXED_NORM_KERNEL(true, vf, true)
// The two-tile one-row blocks (gemvq_tct_block): the signature of gemvq_tc_<type>_r1 (rows
// must be 1, ks is unused), three blocks per SM as the one-tile kernel's.
#define GEMVQ_TCT_KERNEL(name, TYPE)                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 3)                                          \
        gemvq_tct_##name##_r1(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,              \
                              const int8_t* __restrict__ xq, const float2* __restrict__ xd, int rows,        \
                              float* __restrict__ out, int ks) {                                              \
        extern __shared__ __align__(128) uint8_t gemv_smem[];                                                 \
        __shared__ __align__(8) uint64_t bars[2];                                                             \
        if (rows != 1) __trap();                                                                              \
        gemvq_tct_block<TYPE>(W, rb, n_out, n_in, xq, xd, out, gemv_smem, bars);                              \
    }
GEMVQ_TCT_KERNEL(q4_k, GGML_Q4_K)
GEMVQ_TCT_KERNEL(q5_k, GGML_Q5_K)
GEMVQ_TCT_KERNEL(q6_k, GGML_Q6_K)
// The FFN norm handed from the o-projection to the SwiGLU (Q4_K; gemvq_tc2_add_q4k and
// gemvq_tc_block's NORM form): gemvq_tc2_add_q4_k_r<R> (blocks of 512 threads, two tiles) and
// gemvq_swiglu_tcn_q4_k_r<R> (the SwiGLU tensor-core kernel with the deferred scale; bounds
// as its plain form's).
// One two-tile o-projection kernel (PX: gemvq_tc2_add_q4k's early epilogue loads).
// The one-row kernels are held to TC2_R1_MAXNREG registers so that a block fits on an SM
// beside a block of the decode attention before it (attn_decode_tc_clpr_128_4: 147 registers,
// 19,456 of an SM's 65,536 for its four warps; 16 warps at 90 registers take 49,152, at 88
// 45,056): at 90 the ~18 blocks on the attention's SMs became resident only as those exited,
// so their tiles were copied after the o-projection's dep and set its end (MATMUL.md round 74).
#define TC2_R1_MAXNREG 88
#define TC2_BOUNDS_1 __maxnreg__(TC2_R1_MAXNREG)  // (not with __launch_bounds__: NVRTC refuses both)
#define TC2_BOUNDS_2 __launch_bounds__(2 * GEMV_WARPS * 32, 1)
#define TC2_BOUNDS_4 TC2_BOUNDS_2
#define TC2_BOUNDS_8 TC2_BOUNDS_2
#define TC2_BOUNDS_9 TC2_BOUNDS_2
#define TC2_BOUNDS_16 TC2_BOUNDS_2
#define GEMVQ_TC2_ADD_KERNEL(kname, R, PX)                                                                   \
    extern "C" __global__ void TC2_BOUNDS_##R                                                                \
        kname(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in, const int8_t* __restrict__ xq, \
              const float2* __restrict__ xd, int rows, float* __restrict__ x, const float* __restrict__ nw,  \
              int8_t* __restrict__ pq, float2* __restrict__ pd, float* __restrict__ pss) {                   \
        extern __shared__ __align__(128) uint8_t gemv_smem[];                                               \
        __shared__ __align__(8) uint64_t gemv_bars[2];                                                      \
        gemvq_tc2_add_q4k<R, PX>(W, rb, n_out, n_in, xq, xd, rows, x, nw, pq, pd, pss, gemv_smem, gemv_bars); \
    }
#define GEMVQ_TC2_KERNELS(R)                                                                                 \
    GEMVQ_TC2_ADD_KERNEL(gemvq_tc2_add_q4_k_r##R, R, false)                                                  \
    GEMVQ_TC2_ADD_KERNEL(gemvq_tc2_addx_q4_k_r##R, R, true)                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMVQ_TC_MINB(GGML_Q4_K, R))              \
        gemvq_swiglu_tcn_q4_k_r##R(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,           \
                                   long long rb, int n_out, int n_in, const int8_t* __restrict__ xq,        \
                                   const float2* __restrict__ xd, int rows, float* __restrict__ out,        \
                                   const float* __restrict__ pss, float eps) {                              \
        extern __shared__ __align__(128) uint8_t gemv_smem[];                                               \
        __shared__ __align__(8) uint64_t gemv_bar;                                                          \
        gemvq_tc_block<GGML_Q4_K, R, true, false, true>(W, W2, rb, n_out, n_in, xq, xd, rows, out, blockIdx.x, \
                                                        gemv_smem, &gemv_bar, pss, eps);                    \
    }
#define GEMVQ_TC2_KERNEL_R(unused, R) GEMVQ_TC2_KERNELS(R)
GEMV_EACH_R(GEMVQ_TC2_KERNEL_R, _)
// gemvq_swiglu_tcnw4_q4_k_r1 (the default; FERRITE_SWIGLU_W4=0 the eight-warp kernel;
// MATMUL.md round 49): the one-row NORM SwiGLU in blocks of four warps (gemvq_tc_q4k's W4:
// the eight-warp kernel's bits), four blocks per SM: a third more weight bytes in flight per
// SM, each warp's prologue and epilogue over twice the tile work.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS / 2 * 32, 4)
    gemvq_swiglu_tcnw4_q4_k_r1(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2, long long rb,
                               int n_out, int n_in, const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                               int rows, float* __restrict__ out, const float* __restrict__ pss, float eps) {
    extern __shared__ __align__(128) uint8_t gemv_smem[];
    __shared__ __align__(8) uint64_t gemv_bar;
    gemvq_tc_block<GGML_Q4_K, 1, true, false, true, true>(W, W2, rb, n_out, n_in, xq, xd, rows, out, blockIdx.x,
                                                          gemv_smem, &gemv_bar, pss, eps);
}
// gemvq_swiglu_n_q8_0_r<R>: the Q8_0 SwiGLU on the FFN norm handed over by the o-projection's
// residual add (gemvq's NORM; matmul.rs `hands_norm_over`). Bounds as the plain SwiGLU's.
#define GEMVQ_SWIGLU_N_KERNEL(name, TYPE, R)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemvq_swiglu_n_##name##_r##R(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,         \
                                     long long rb, int n_out, int n_in, const int8_t* __restrict__ xq,      \
                                     const float2* __restrict__ xd, int rows, float* __restrict__ out,      \
                                     int ks, const float* __restrict__ pss, float eps) {                    \
        gemvq<TYPE, R, true, false, true>(W, W2, rb, n_out, n_in, xq, xd, rows, out, ks, blockIdx.x, pss, eps); \
    }
GEMV_EACH_R(GEMVQ_SWIGLU_N_KERNEL, q8_0, GGML_Q8_0)
// gemvq_add_n_q8_0_r1: the Q8_0 o-projection handing the FFN's RMSNorm to that SwiGLU at one
// row (matmul.rs `matmul_add_for_norm`, FERRITE_DEFER_NORM_Q8=2): blocks of 32 rows (the lane
// code at four rows a warp), so that a block owns a whole 32-element group of the output, as
// gemvq_tc2_add_q4k's two tiles do for Q4_K; the 32 sums go through shared memory to warp 0,
// which runs add_norm_planes's add_norm_lane on them: the residual, the planes and the
// group's sum of the plain GEMV + add_norm_planes, without that launch. One block per SM
// (32 rows x 4352 bytes at 4096 columns), one wave.
// (Held to 128 registers, so that two SwiGLU blocks fit beside it: no gain, MATMUL.md round 55.)
// gemv_add_n_px (FERRITE_ADD_N_PX; MATMUL.md round 73): the epilogue's loads go out early, as
// gemvq_tc2_add_q4k's PX form (round 28): warp 0's norm weight n[o] before the PDL wait, its
// residual x[o] right after it (x's last writer is launches back, but only the wait orders
// it), so that their round trip overlaps the copy and the compute instead of following the
// block's barrier. The same values into the same operations: the same bits.
__constant__ int gemv_add_n_px;
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 1)
    gemvq_add_n_q8_0_r1(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                        const int8_t* __restrict__ xq, const float2* __restrict__ xd, float* __restrict__ x,
                        const float* __restrict__ nw, int8_t* __restrict__ pq, float2* __restrict__ pd,
                        float* __restrict__ pss) {
    __shared__ float sums[32];
    const int lane = threadIdx.x & 31, o = blockIdx.x * 32 + lane;
    const bool early = gemv_add_n_px != 0 && threadIdx.x < 32;
    float xo = 0.f, no = 0.f;  // early: x[o], n[o]
    if (early) no = nw[o];
    gemvq<GGML_Q8_0, 1, false, false, false, 4, true>(W, W, rb, n_out, n_in, xq, xd, 1, nullptr, 1, blockIdx.x,
                                                      nullptr, 0.0f, sums, early ? x + o : nullptr, &xo);
    __syncthreads();
    if (threadIdx.x < 32) {
        const float xv = early ? xo : x[o];
        add_norm_lane(x + o, sums[lane], early ? no : nw[o], lane, pq, n_out, o, pd + blockIdx.x, pss + blockIdx.x,
                      &xv);
    }
}
GEMVQ_TCH_ALL_R(q4_k, GGML_Q4_K)
GEMVQ_TCH_ALL_R(q6_k, GGML_Q6_K)
GEMVQ_TCK_ALL_R(q4_k, GGML_Q4_K)
GEMVQ_TCK_ALL_R(q6_k, GGML_Q6_K)
// gemvq_tckn<W>_<type>_r1: the K-split Q4_K (Q8_0) down projection handing the next layer's
// attention norm to its Q, K, V (gemvq_tck_block's PAIRN; n_out % 32 == 0). W empty: eight
// warps, bounds as the plain one's.
#define GEMVQ_TCKN_FORM(W, name, TYPE, W4, LB)                                                               \
    extern "C" __global__ void __launch_bounds__ LB                                                           \
        gemvq_tckn##W##_##name##_r1(const uint8_t* __restrict__ W_, long long rb, int n_out, int n_in,       \
                                const int8_t* __restrict__ xq, const float2* __restrict__ xd, int kc,        \
                                float* __restrict__ part, unsigned* __restrict__ tickets,                    \
                                float* __restrict__ x, const float* __restrict__ nw, int8_t* __restrict__ pq, \
                                float2* __restrict__ pd, float* __restrict__ pss) {                          \
        extern __shared__ __align__(128) uint8_t gemv_smem[];                                                 \
        __shared__ __align__(8) uint64_t gemv_bar;                                                            \
        gemvq_tck_block<TYPE, 1, true, W4>(W_, rb, n_out, n_in, kc, xq, xd, 1, nullptr, part, tickets,        \
                                           gemv_smem, &gemv_bar, x, nw, pq, pd, pss);                         \
    }
GEMVQ_TCKN_FORM(, q4_k, GGML_Q4_K, false, (GEMV_WARPS * 32, GEMVQ_TC_MINB(GGML_Q4_K, 1)))
// gemvq_tckw4_q4_k_r1 / gemvq_tcknw4_q4_k_r1 (FERRITE_TCK_W4; MATMUL.md round 50): the
// one-row K-split Q4_K tile, plain and handing the norm over, in blocks of four warps
// (gemvq_tck_block's W4: the eight-warp kernels' partials and outputs, bit for bit), four
// blocks per SM, as the SwiGLU's gemvq_swiglu_tcnw4_q4_k_r1.
GEMVQ_TCK_FORM(w4, q4_k, GGML_Q4_K, 1, true, (GEMV_WARPS / 2 * 32, 4))
GEMVQ_TCKN_FORM(w4, q4_k, GGML_Q4_K, true, (GEMV_WARPS / 2 * 32, 4))
// The Q8_0 K-split tile (gemvq_tc_q80; MATMUL.md round 54): gemvq_tck_q8_0_r<R> for the long
// rows' plain launches at every R, and the one-row down handing the attention norm over,
// gemvq_tckn_q8_0_r1 / gemvq_tcknw4_q8_0_r1 (eight warps / four, as Q4_K's).
GEMVQ_TCK_ALL_R(q8_0, GGML_Q8_0)
GEMVQ_TCKN_FORM(, q8_0, GGML_Q8_0, false, (GEMV_WARPS * 32, GEMVQ_TC_MINB(GGML_Q8_0, 1)))
GEMVQ_TCKN_FORM(w4, q8_0, GGML_Q8_0, true, (GEMV_WARPS / 2 * 32, 4))
#define PIPE_MAX_NB 8  // matmul.rs PIPE_MAX_NB
// gemvq_swiglu_tcnp_q8_0_r1: the Q8_0 SwiGLU ring (gemvq_swiglu_p_q80), eight warps, one block
// per SM.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 1)
    gemvq_swiglu_tcnp_q8_0_r1(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2, long long rb,
                              int n_out, int n_in, int nb, const int8_t* __restrict__ xq,
                              const float2* __restrict__ xd, float* __restrict__ out,
                              const float* __restrict__ pss, float eps, int8_t* __restrict__ hq,
                              float2* __restrict__ hd) {
    extern __shared__ __align__(128) uint8_t gemv_smem[];
    __shared__ __align__(8) uint64_t bars[PIPE_MAX_NB];
    if (nb < 1 || nb > PIPE_MAX_NB) __trap();
    gemvq_swiglu_p_q80(W, W2, rb, n_out, n_in, nb, xq, xd, out, pss, eps, gemv_smem, bars, hq, hd);
}
GEMVQ_MIXED_TC_ALL_R(q4_k, GGML_Q4_K, q6_k, GGML_Q6_K)
GEMV_EACH_R(GEMVQ_MIXED_TCV_KERNEL, q4_k, GGML_Q4_K, q6_k, GGML_Q6_K)
GEMVQ_MIXED_TCVF_KERNEL(q4_k, GGML_Q4_K, q6_k, GGML_Q6_K)

// ---------------------------------------------------------------------------------------
// 1c. MoE experts on quantized activations (launcher: moe.rs; decode, and exact prefill with
//     FERRITE_MMQ=1 for any row count). Two launches per layer after the router GEMV:
//
//  Routing (moe_route_warp): each block computes the routing of its token itself, one warp,
//    from the router logits: max, p_e = expf(l_e - max) kept in shared memory, their sum
//    (lane-strided partials + xor butterfly), then top-k rounds of a warp arg-max over
//    (p desc, id asc) with redux.sync: each lane keeps the best of its own experts (ascending
//    id, strict >), the warp takes the max key (p's bits + 1; p >= 0 so the bit order is the
//    float order) and the lowest id among the lanes holding it; only the winner's lane
//    rescans its experts. Exactly moe_route's choice and weights (moe.cu: same max, exps, sum
//    order, comparison and division), with no routing launch and no ids round trip.
//    n_experts <= MOE_ROUTE_MAX (shared memory).
//  gemvq_moe_gu_<type>: grid (ceil(ffn / 16), pairs); block (bx, p) owns ffn rows 16 bx ..
//    16 bx + 15 of the pair's expert e (pair p = token t, slot k = p % top_k; warp 0 routes
//    token t through round k). sm_90+: thread 0 then copies the block's 16 gate rows and 16
//    up rows (two contiguous spans, ~37 KB for Q4_K 2048) into shared memory with
//    cp.async.bulk (all in flight at once) and the warps read them there (gemvq_lane<..,
//    true>, the dense bulk GEMV's lane code; the only form on sm_90+: the launcher takes
//    this path only when the spans fit); before sm_90 the register-load lane code. 16 rows per block
//    so that a Qwen3-30B-A3B layer's 384 blocks are resident at once (one wave: ~3 blocks
//    per SM by registers). Warp w computes ffn rows o = 16 bx + w and o + 8, each as the
//    SwiGLU pair (gate row o, up row o) over the token's quantized x, R = 1, NW = 2, ks = 1,
//    writes h[p][o] = silu(gate) * up, then the block takes a ticket for its 32-row group
//    (p, o / 32): the 2nd block to arrive reads the group's 32 h values back from L2 and
//    quantizes them (quant_q8_lane: the same bits as quant_x_q8 on h) into hq / hd, and
//    resets the ticket to 0 (ready for the next launch or graph replay). No separate
//    quantization launch.
//    gemvq_moe_gu_tc_q4_k (sm_90+; moe.rs takes it unless FERRITE_MOE_TC=0): the block's 16
//    rows are two tensor-core SwiGLU tiles (gemvq_tc_q4k: 8 gate rows and the same 8 up rows
//    each, rows 0-7 then 8-15 of the two slots, which are laid out as tc_slot's: bases 64
//    bytes apart modulo 128), x staged in shared memory while the copy is in flight
//    (tc_stage_x), each tile stored by tc_store; in this one-wave launch a block's compute
//    follows its copy (MOE.md, "The gate/up experts on the tensor cores"). Its launch groups
//    the two blocks of a 32-row quantization group into a cluster, which replaces the ticket
//    (below, at the kernel's end).
//  gemvq_moe_down4_<type> (gemvq_moe_down_<type>: FERRITE_MOE_DOWN_NW=2): grid (ceil(hidden /
//    8), rows); block (bx, t) owns hidden rows 8 bx .. 8 bx + 7 of token t; warp w computes
//    them (two passes of 4 rows sharing each x load; 4 passes of 2) for slots w, w + 8, ...
//    (expert ids[k] from the block's own routing, input row t top_k + k of hq), partial
//    results meet in shared memory and 8 threads add the slots in top-k order weighted by
//    the routing weights (no FMA contraction, as the CPU's combine): the down projection
//    and the combine in one launch. The routing and (sm_90+) each warp's bulk copy of its
//    slot's 8 down rows happen BEFORE the PDL wait: the router logits were complete before
//    the gate/up kernel passed its own wait (read through L2, __ldcg), and the weights
//    depend on nothing, so the down weights stream in while gate/up drains. 8 rows per
//    block: 256 blocks per token, one wave at 2 blocks per SM.
//  Every output is a fixed sequence of operations per (token, expert), whatever the row
//  count of the launch: decode and exact prefill agree bitwise.
//  An expert id outside [0, n_experts) (impossible for finite logits) yields NaN, never an
//  out-of-bounds read.

#define MOE_ROUTE_MAX 1024
#define GEMVQ_MOE_MAX_TOPK 64
// ffn rows per gemvq_moe_gu block (each warp takes MOE_GU_ROWS / 8 of them) and blocks per
// 32-element quantization group of h; hidden rows per gemvq_moe_down block (a multiple of 4).
#define MOE_GU_ROWS 16
#define MOE_GU_GROUP (QK / MOE_GU_ROWS)
#define MOE_DOWN_ROWS 8

// One top-k round of the warp routing (both forms below): the warp's best untaken
// probability over the lanes' candidates (bv, bi) and the lowest id holding it. Untaken
// probabilities are >= 0; a lane left with only taken ones (-1) or none (-2) offers nothing
// (key 0). Lane 0 writes round k's (id, p / sum) when ids is given. Returns the winner.
__device__ __forceinline__ int moe_route_pick(float bv, int bi, float sum, int k, int* ids, float* wts, int lane) {
    const unsigned key = bv >= 0.f ? __float_as_uint(bv) + 1u : 0u;
    const unsigned m = __reduce_max_sync(0xffffffffu, key);
    const int win = (int)__reduce_min_sync(0xffffffffu, (key == m && m != 0u) ? (unsigned)bi : 0x7fffffffu);
    if (ids != nullptr && lane == 0) {
        ids[k] = win;
        wts[k] = __uint_as_float(m - 1u) / sum;
    }
    return win;
}

// The top_k routing weights renormalised to sum 1 (the weights added in slot order).
__device__ __forceinline__ void moe_route_renorm(int top_k, float* wts) {
    float s = 0.f;
    for (int k = 0; k < top_k; ++k) s += wts[k];
    for (int k = 0; k < top_k; ++k) wts[k] = wts[k] / s;
}

// One warp: the router probabilities of one token (logits l, n <= MOE_ROUTE_MAX) into rp,
// then rounds 0..k_last of the top-k; lane 0 gets (id, weight = p / sum) of round k in
// ids[k], wts[k] when those are given (shared memory), and every lane the id of round
// k_last as the return value. norm: renormalise wts over the top_k slots (needs k_last =
// top_k - 1). Same bits as moe_route (moe.cu) for finite logits.
__device__ __forceinline__ int moe_route_smem(const float* __restrict__ l, int n, int k_last, int top_k, int norm,
                                              float* rp, int* ids, float* wts, int lane) {
    float mx = __int_as_float(0xff800000);  // -inf
    for (int e = lane; e < n; e += 32) {  // one pass over L2: the logits into rp
        const float v = __ldcg(l + e);
        rp[e] = v;
        mx = fmaxf(mx, v);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    float bv = -2.f;
    int bi = 0x7fffffff;
    for (int e = lane; e < n; e += 32) {  // a lane reads back only what it wrote
        const float v = expf(rp[e] - mx);
        rp[e] = v;
        sum += v;
        if (v > bv) { bv = v; bi = e; }  // ascending e: the lowest id of a tie stays
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    int win = 0x7fffffff;
    for (int k = 0; k <= k_last; ++k) {
        win = moe_route_pick(bv, bi, sum, k, ids, wts, lane);
        if (win < n && (win & 31) == lane) {  // the winner's lane rescans its experts
            rp[win] = -1.f;
            bv = -2.f;
            bi = 0x7fffffff;
            for (int e = lane; e < n; e += 32) {
                const float v = rp[e];
                if (v > bv) { bv = v; bi = e; }
            }
        }
    }
    if (norm && ids != nullptr && lane == 0) moe_route_renorm(top_k, wts);
    return win;
}

// moe_route_smem with the probabilities in registers (NJ per lane, n <= 32 NJ): the same
// values in the same order (max, exps, lane-strided sum, butterflies, the same key and
// tie rule), so the same ids and weights bit for bit; a round costs two redux and an
// unrolled register rescan on the winner's lane instead of shared-memory loads.
template <int NJ>
__device__ __forceinline__ int moe_route_reg(const float* __restrict__ l, int n, int k_last, int top_k, int norm,
                                             int* ids, float* wts, int lane) {
    float v[NJ];
    float mx = __int_as_float(0xff800000);  // -inf
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < n ? __ldcg(l + e) : 0.f;
        if (e < n) mx = fmaxf(mx, v[j]);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    float bv = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const int e = lane + 32 * j;
        if (e < n) {
            v[j] = expf(v[j] - mx);
            sum += v[j];
            if (v[j] > bv) { bv = v[j]; bi = e; }
        } else {
            v[j] = -2.f;  // never a lane's best
        }
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    int win = 0x7fffffff;
    for (int k = 0; k <= k_last; ++k) {
        win = moe_route_pick(bv, bi, sum, k, ids, wts, lane);
        if (win < n && (win & 31) == lane) {
            bv = -2.f;
            bi = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int e = lane + 32 * j;
                if (e == win) v[j] = -1.f;
                if (v[j] > bv) { bv = v[j]; bi = e; }
            }
        }
    }
    if (norm && ids != nullptr && lane == 0) moe_route_renorm(top_k, wts);
    return win;
}

// The routing of one token by one warp: registers up to 256 experts, else shared memory.
__device__ __forceinline__ int moe_route_warp(const float* __restrict__ l, int n, int k_last, int top_k, int norm,
                                              float* rp, int* ids, float* wts, int lane) {
    if (n <= 128) return moe_route_reg<4>(l, n, k_last, top_k, norm, ids, wts, lane);
    if (n <= 256) return moe_route_reg<8>(l, n, k_last, top_k, norm, ids, wts, lane);
    return moe_route_smem(l, n, k_last, top_k, norm, rp, ids, wts, lane);
}

// Bulk copies of expert rows (sm_90+): rows [r0, r0 + n) of W (rows of rb bytes), widened to
// the 16-byte units around them as in gemv_bulk_prologue; returns the byte count and the
// span's start (the rows sit `r0 address mod 16` bytes into the destination).
__device__ __forceinline__ uint32_t moe_span(const uint8_t* W, size_t r0, int n, long long rb, size_t* a0) {
    *a0 = (size_t)(W + r0 * (size_t)rb) & ~(size_t)15;
    const size_t a1 = ((size_t)(W + (r0 + (size_t)n) * (size_t)rb) + 15) & ~(size_t)15;
    return (uint32_t)(a1 - *a0);
}

// The gate/up block's share of its expert's down rows (hidden rows of d_rb bytes), prefetched
// into L2 once the block's own copy has landed (d_rb = 0: none; moe.rs, FERRITE_MOE_PF). The
// down kernel's blocks become resident only as gate/up's retire (registers), so their copies
// start after gate/up ends; the expert ids are known here, and DRAM idles while the gate/up
// blocks compute, reduce and quantize: the down copies then read L2. One bulk prefetch per
// block (a hint: no completion, nothing written), the blocks of a pair splitting the expert's
// rows in 16-byte units.
__device__ __forceinline__ void moe_down_prefetch(const uint8_t* D, long long d_rb, int hidden, int e) {
#if __CUDA_ARCH__ >= 900
    if (d_rb == 0 || threadIdx.x != 0) return;
    const size_t units = ((size_t)hidden * (size_t)d_rb) / 16, nb = gridDim.x;
    const size_t u0 = units * blockIdx.x / nb, u1 = units * (blockIdx.x + 1) / nb;
    if (u1 > u0) prefetch_l2(D + (size_t)e * hidden * (size_t)d_rb + 16 * u0, (unsigned)(16 * (u1 - u0)));
#endif
}

// SH (gemvq_moe_gu_tcs_q4_k, gemvq_moe_gus_<type>; moe.rs `moe_shared`): a token's pairs are
// its top_k routed experts and, as slot top_k, the shared expert (Gs, Us: its gate and up,
// `ffn` rows of rb bytes like an expert's; Ds its down, prefetched as an expert's): the same
// tile or lanes, h and quantization of h as a routed pair's, no routing.
template <int TYPE, bool TC = false, bool SH = false>
__device__ __forceinline__ void gemvq_moe_gu(const uint8_t* __restrict__ G, const uint8_t* __restrict__ U,
                                             long long rb, int ffn, int hidden, const int8_t* __restrict__ xq,
                                             const float2* __restrict__ xd, const float* __restrict__ logits,
                                             int n_experts, int top_k, float* __restrict__ h,
                                             int8_t* __restrict__ hq, float2* __restrict__ hd,
                                             int* __restrict__ tickets, const uint8_t* __restrict__ D,
                                             long long d_rb, const uint8_t* __restrict__ Gs = nullptr,
                                             const uint8_t* __restrict__ Us = nullptr,
                                             const uint8_t* __restrict__ Ds = nullptr) {
    extern __shared__ __align__(128) uint8_t gemv_smem[];
    __shared__ __align__(8) uint64_t bar;
    __shared__ float rp[MOE_ROUTE_MAX];
    __shared__ int s_e, s_last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = blockIdx.x * MOE_GU_ROWS;
    const int kp = SH ? top_k + 1 : top_k;  // pairs per token
    const int p = blockIdx.y, t = p / kp, kslot = p % kp;
    const bool sh = SH && kslot == top_k;  // the shared expert's pair
    const uint8_t* Gb = sh ? Gs : G;
    const uint8_t* Ub = sh ? Us : U;
    const int nr = ffn - r0 < MOE_GU_ROWS ? ffn - r0 : MOE_GU_ROWS;  // rows of this block (> 0)
#if __CUDA_ARCH__ >= 900
    constexpr bool bulk = true;  // the only form on sm_90+: the launcher always passes the slots
    if (gemv_dyn_smem() == 0) __trap();
    constexpr bool tc = TC && TYPE == GGML_Q4_K;
    const size_t slot = tc ? tc_slot(rb, MOE_GU_ROWS) : gemv_slot(MOE_GU_ROWS, rb);
#else
    constexpr bool bulk = false;
#endif
    PDL_ENTRY();  // logits: the router GEMV; xq: the norm (or quant_x_q8)
    if (warp == 0) {
        // The shared expert's pair: expert "n_experts" (valid below), rows r0.. of Gs and Us.
        const int e = sh ? n_experts
                         : moe_route_warp(logits + (size_t)t * n_experts, n_experts, kslot, top_k, 0, rp, nullptr,
                                          nullptr, lane);
        if (lane == 0) {
            s_e = e;
            if (bulk && (sh || (e >= 0 && e < n_experts))) {
                const size_t row = sh ? (size_t)r0 : (size_t)e * ffn + r0;
                size_t ag, au;
                const uint32_t lg = moe_span(Gb, row, nr, rb, &ag), lu = moe_span(Ub, row, nr, rb, &au);
                mbar_init(&bar);
                mbar_expect(&bar, lg + lu);
#if __CUDA_ARCH__ >= 900
                bulk_g2s(&bar, gemv_smem, ag, lg);
                bulk_g2s(&bar, gemv_smem + slot, au, lu);
#endif
            }
        }
    }
    __syncthreads();  // s_e, and the barrier initialised before anyone waits on it
    const int e = s_e;
    const bool valid = sh || (e >= 0 && e < n_experts);
    const int8_t* xt = xq + (size_t)t * 2 * hidden;
    const float2* dt = xd + (size_t)t * (hidden / QK);
#if __CUDA_ARCH__ >= 900
    if constexpr (tc) {
        // The tensor-core tiles, into hs: x staged after the two slots while the copy lands.
        // Then the cluster of the group's two blocks (rank = which 16 rows of the 32-row
        // quantization group): rank 1 stores its 16 outputs into rank 0's hs[16..31], one
        // cluster barrier, rank 0's warp 0 quantizes the 32 (quant_q8_lane, the bits of
        // quant_x_q8 on h). No ticket, no fence, no round trip of h through L2; h itself is
        // not stored (only its int8 planes are read, by the down kernel).
        __shared__ float hs[2 * MOE_GU_ROWS];
        if (valid) {
            uint8_t* xs = gemv_smem + 2 * slot;
            tc_stage_x(xs, xt, dt, hidden);
            mbar_wait(&bar, 0);
            moe_down_prefetch(sh ? Ds : D, d_rb, hidden, sh ? 0 : e);
            const size_t row0 = sh ? (size_t)r0 : (size_t)e * ffn + r0;
            const uint8_t* sg = gemv_smem + ((size_t)(Gb + row0 * (size_t)rb) & 15);
            const uint8_t* su = gemv_smem + slot + ((size_t)(Ub + row0 * (size_t)rb) & 15);
#pragma unroll 1
            for (int j = 0; j < MOE_GU_ROWS; j += 8) {
                if (j) __syncthreads();  // the previous tile's tc_store has read its shared sums
                // Outputs o = j + row < nr (= MOE_GU_ROWS: ffn % 32 == 0, moe.rs) into hs[o].
                gemvq_tc_q4k<1, true, true>(sg + (size_t)j * (size_t)rb, su + (size_t)j * (size_t)rb, rb, nr,
                                             hidden, (const int8_t*)xs, (const float2*)(xs + 2 * hidden + 128),
                                             1, hs, j, hidden + 64);
            }
        } else if (threadIdx.x < MOE_GU_ROWS) {
            hs[threadIdx.x] = __int_as_float(0x7fc00000);
        }
        __syncthreads();
        const int rank = cluster_rank();
#if defined(DIAG_CLBAR) && (DIAG_CLBAR & 2)
        // FERRITE_DIAG_CLBAR bit 2 (timing diagnostic): rank 0 reads rank 1's outputs after
        // cluster_sync_diag's relaxed barrier, and an execution barrier keeps rank 1 until then.
        cluster_sync_diag(2);
        if (rank == 0 && warp == 0) {
            const int grp = r0 / QK;
            const float v = lane < MOE_GU_ROWS ? hs[lane] : ld_cluster_f32(&hs[lane - MOE_GU_ROWS], 1);
            quant_q8_lane(v, lane, hq + (size_t)p * 2 * ffn, ffn, grp * QK + lane, hd + (size_t)p * (ffn / QK) + grp);
        }
        cluster_sync_exec();
#else
        if (rank == 1 && threadIdx.x < MOE_GU_ROWS) st_cluster_f32(&hs[MOE_GU_ROWS + threadIdx.x], 0, hs[threadIdx.x]);
        cluster_sync_all();
        if (rank == 0 && warp == 0) {
            const int grp = r0 / QK;
            quant_q8_lane(hs[lane], lane, hq + (size_t)p * 2 * ffn, ffn, grp * QK + lane,
                          hd + (size_t)p * (ffn / QK) + grp);
        }
#endif
        return;
    }
    if (bulk && valid) mbar_wait(&bar, 0);
#endif
    if (valid) moe_down_prefetch(sh ? Ds : D, d_rb, hidden, sh ? 0 : e);
    // Warp w: rows r0 + w, r0 + w + 8, ... (whole warps).
#pragma unroll 1
    for (int o = r0 + warp; o < r0 + nr; o += GEMV_WARPS) {
        float* dst = h + (size_t)p * ffn + o;
        if (!valid) {
            if (lane == 0) *dst = __int_as_float(0x7fc00000);
            continue;
        }
        float acc[1][2] = {{0.0f, 0.0f}};
#if __CUDA_ARCH__ >= 900
        if (bulk) {
            const size_t row0 = sh ? (size_t)r0 : (size_t)e * ffn + r0;
            const uint8_t* wr[2] = {
                gemv_smem + ((size_t)(Gb + row0 * (size_t)rb) & 15) + (size_t)(o - r0) * (size_t)rb,
                gemv_smem + slot + ((size_t)(Ub + row0 * (size_t)rb) & 15) + (size_t)(o - r0) * (size_t)rb};
            gemvq_lane<TYPE, 1, 2, true>(wr, hidden, xt, dt, 1, lane, 0, 1, acc);
        }
#else
        {
            const size_t r = sh ? (size_t)o : (size_t)e * ffn + o;
            const uint8_t* wr[2] = {Gb + r * (size_t)rb, Ub + r * (size_t)rb};
            gemvq_lane<TYPE, 1, 2, false>(wr, hidden, xt, dt, 1, lane, 0, 1, acc);
        }
#endif
#pragma unroll
        for (int w = 0; w < 2; w++)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[0][w] += __shfl_xor_sync(0xffffffffu, acc[0][w], off);
        if (lane == 0) *dst = silu(acc[0][0]) * acc[0][1];
    }
    // Ticket of the 32-row group: the last of its MOE_GU_GROUP blocks quantizes it.
    __threadfence();
    __syncthreads();
    const int grp = r0 / QK;
    int* tk = tickets + (size_t)p * (ffn / QK) + grp;
    if (threadIdx.x == 0) s_last = atomicAdd(tk, 1) == MOE_GU_GROUP - 1;
    __syncthreads();
    if (s_last && warp == 0) {
        __threadfence();
        const float v = __ldcg(h + (size_t)p * ffn + grp * QK + lane);
        quant_q8_lane(v, lane, hq + (size_t)p * 2 * ffn, ffn, grp * QK + lane, hd + (size_t)p * (ffn / QK) + grp);
        if (lane == 0) atomicExch(tk, 0);
    }
}

// DNW: rows per pass of a warp's slot (2 or 4: the same per-row arithmetic, so the same bits;
// 4 shares each x load between four rows and halves the dependent passes).
// SH (gemvq_moe_downs4_<type>; moe.rs `moe_shared`; top_k <= GEMV_WARPS): the shared expert
// as slot top_k of every token (Ds: its down, `hidden` rows of rb bytes; its h the gate/up's
// pair t (top_k + 1) + top_k), added after the routed slots with its gate: out = Σ_k w_k y_k
// + y_s σ(x_t · wsg), in the order and the operations of the composition (moe, then the
// shared expert's output times sigmoid_gate's σ, then add_assign). The shared rows get a
// copy slot of their own (GEMV_WARPS + 1 slots), issued with the others before the PDL wait,
// so the warp that takes them second (warp 0 at top_k = 8) finds them landed; the last warp
// also takes the gate's dot product over the token's x (xf: the MoE input in f32, wsg: the
// gate row) before the wait, as warp 0 takes the routing (both complete two launches back).
template <int TYPE, int DNW = 2, bool SH = false>
__device__ __forceinline__ void gemvq_moe_down(const uint8_t* __restrict__ D, long long rb, int hidden, int ffn,
                                               const int8_t* __restrict__ hq, const float2* __restrict__ hd,
                                               const float* __restrict__ logits, int n_experts, int top_k, int norm,
                                               float* __restrict__ out, const uint8_t* __restrict__ Ds = nullptr,
                                               const float* __restrict__ xf = nullptr,
                                               const float* __restrict__ wsg = nullptr) {
    constexpr int NW = GEMV_WARPS, NSL = SH ? GEMV_WARPS + 1 : GEMV_WARPS;  // warps, copy slots
    extern __shared__ __align__(128) uint8_t gemv_smem[];
    __shared__ __align__(8) uint64_t bars[NSL];
    __shared__ float rp[MOE_ROUTE_MAX];
    __shared__ int s_id[GEMVQ_MOE_MAX_TOPK];
    __shared__ float s_w[GEMVQ_MOE_MAX_TOPK];
    __shared__ float part[GEMVQ_MOE_MAX_TOPK + (SH ? 1 : 0)][MOE_DOWN_ROWS];
    __shared__ float s_sg;  // SH: the shared expert's gate σ(x_t · wsg)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kp = SH ? top_k + 1 : top_k;  // slots per token
    if (SH && top_k > NW) __trap();          // the launcher's bound: a slot of its own each
    const int o0 = blockIdx.x * MOE_DOWN_ROWS, t = blockIdx.y;
    const int nr = hidden - o0 < MOE_DOWN_ROWS ? hidden - o0 : MOE_DOWN_ROWS;
#if __CUDA_ARCH__ >= 900
    constexpr bool bulk = true;  // the only form on sm_90+: the launcher always passes the slots
    if (gemv_dyn_smem() == 0) __trap();
    const size_t slot = gemv_slot(MOE_DOWN_ROWS, rb);
    uint8_t* my = gemv_smem + (size_t)warp * slot;
#else
    constexpr bool bulk = false;
#endif
    // Before the PDL wait: the routing (router logits complete two launches back) and the
    // first slot's weight copy of every warp.
    if (warp == 0) moe_route_warp(logits + (size_t)t * n_experts, n_experts, top_k - 1, top_k, norm, rp, s_id, s_w, lane);
    if (bulk && lane == 0) mbar_init(&bars[warp]);
    if (SH && bulk && threadIdx.x == 0) mbar_init(&bars[NW]);
    __syncthreads();
    if (bulk && lane == 0 && warp < top_k) {
        const int e = s_id[warp];
        if (e >= 0 && e < n_experts) {
            size_t a;
            const uint32_t len = moe_span(D, (size_t)e * hidden + o0, nr, rb, &a);
            mbar_expect(&bars[warp], len);
#if __CUDA_ARCH__ >= 900
            bulk_g2s(&bars[warp], my, a, len);
#endif
        }
    }
#if __CUDA_ARCH__ >= 900
    if (SH && bulk && threadIdx.x == 0) {  // the shared expert's rows into slot NW
        size_t a;
        const uint32_t len = moe_span(Ds, (size_t)o0, nr, rb, &a);
        mbar_expect(&bars[NW], len);
        bulk_g2s(&bars[NW], gemv_smem + (size_t)NW * slot, a, len);
    }
#endif
    if (SH && warp == NW - 1) {  // the shared expert's gate: sigmoid_gate's σ of x_t · wsg
        const float* xr = xf + (size_t)t * hidden;
        float g = 0.0f;
#pragma unroll 8
        for (int i = lane; i < hidden; i += 32) g = fmaf(__ldcg(xr + i), __ldg(wsg + i), g);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) g += __shfl_xor_sync(0xffffffffu, g, off);
        if (lane == 0) s_sg = 1.f / (1.f + expf(-g));
    }
    PDL_ENTRY();  // hq, hd: the gate/up kernel
    uint32_t ph = 0;  // copies this warp's slot has completed (barrier phases)
    for (int k = warp; k < kp; k += NW) {
        const int p = t * kp + k;
        const bool sh = SH && k == top_k;
        const int e = sh ? 0 : s_id[k];
        const bool valid = sh || (e >= 0 && e < n_experts);
        const uint8_t* Dk = sh ? Ds : D;
        const int8_t* hp = hq + (size_t)p * 2 * ffn;
        const float2* dp = hd + (size_t)p * (ffn / QK);
#if __CUDA_ARCH__ >= 900
        const size_t row0 = (size_t)e * hidden + o0;
        if (SH && sh) {  // its own slot, copied before the wait
            my = gemv_smem + (size_t)NW * slot;
            mbar_wait(&bars[NW], 0);
        } else if (bulk && valid) {
            if (k != warp) {  // the slot's previous rows are read by every lane: reuse it
                __syncwarp();
                if (lane == 0) {
                    size_t a;
                    const uint32_t len = moe_span(Dk, row0, nr, rb, &a);
                    mbar_expect(&bars[warp], len);
                    bulk_g2s(&bars[warp], my, a, len);
                }
            }
            mbar_wait(&bars[warp], ph & 1u);
            ++ph;
        }
#endif
        // Rows o0 + j .. o0 + j + DNW - 1 (j a multiple of DNW; a row past the end recomputes
        // the last row and is not stored).
#pragma unroll 1
        for (int j = 0; j < MOE_DOWN_ROWS; j += DNW) {
            float acc[1][DNW];
#pragma unroll
            for (int w = 0; w < DNW; w++) acc[0][w] = valid ? 0.0f : __int_as_float(0x7fc00000);
            if (valid) {
                int ro[DNW];
#pragma unroll
                for (int w = 0; w < DNW; w++) ro[w] = o0 + j + w < hidden ? j + w : hidden - 1 - o0;
                const uint8_t* wr[DNW];
#if __CUDA_ARCH__ >= 900
                if (bulk) {
                    const uint8_t* base = my + ((size_t)(Dk + row0 * (size_t)rb) & 15);
#pragma unroll
                    for (int w = 0; w < DNW; w++) wr[w] = base + (size_t)ro[w] * (size_t)rb;
                    gemvq_lane<TYPE, 1, DNW, true>(wr, ffn, hp, dp, 1, lane, 0, 1, acc);
                }
#else
#pragma unroll
                for (int w = 0; w < DNW; w++) wr[w] = Dk + ((size_t)e * hidden + o0 + ro[w]) * (size_t)rb;
                gemvq_lane<TYPE, 1, DNW, false>(wr, ffn, hp, dp, 1, lane, 0, 1, acc);
#endif
#pragma unroll
                for (int w = 0; w < DNW; w++)
#pragma unroll
                    for (int off = 16; off > 0; off >>= 1)
                        acc[0][w] += __shfl_xor_sync(0xffffffffu, acc[0][w], off);
            }
            if (lane == 0) {
#pragma unroll
                for (int w = 0; w < DNW; w++) part[k][j + w] = acc[0][w];
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < MOE_DOWN_ROWS && o0 + (int)threadIdx.x < hidden) {
        float acc = 0.0f;
        for (int k = 0; k < top_k; k++) acc = __fadd_rn(acc, __fmul_rn(s_w[k], part[k][threadIdx.x]));
        if (SH) acc = __fadd_rn(acc, __fmul_rn(part[top_k][threadIdx.x], s_sg));
        out[(size_t)t * hidden + o0 + threadIdx.x] = acc;
    }
}

// A down kernel of DNW rows per pass (gemvq_moe_down).
#define GEMVQ_MOE_DOWN_KERNEL(kname, TYPE, DNW)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2)                                           \
        kname(const uint8_t* __restrict__ D, long long rb, int hidden, int ffn, const int8_t* __restrict__ hq,  \
              const float2* __restrict__ hd, const float* __restrict__ logits, int n_experts, int top_k,         \
              int norm, float* __restrict__ out) {                                                               \
        gemvq_moe_down<TYPE, DNW>(D, rb, hidden, ffn, hq, hd, logits, n_experts, top_k, norm, out);             \
    }

#define GEMVQ_MOE_KERNELS(name, TYPE)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 3)                                           \
        gemvq_moe_gu_##name(const uint8_t* __restrict__ G, const uint8_t* __restrict__ U, long long rb, int ffn, \
                            int hidden, const int8_t* __restrict__ xq, const float2* __restrict__ xd,            \
                            const float* __restrict__ logits, int n_experts, int top_k, float* __restrict__ h,  \
                            int8_t* __restrict__ hq, float2* __restrict__ hd, int* __restrict__ tickets,         \
                            const uint8_t* __restrict__ D, long long d_rb) {                                     \
        gemvq_moe_gu<TYPE>(G, U, rb, ffn, hidden, xq, xd, logits, n_experts, top_k, h, hq, hd, tickets, D, d_rb); \
    }                                                                                                          \
    GEMVQ_MOE_DOWN_KERNEL(gemvq_moe_down_##name, TYPE, 2)                                                      \
    GEMVQ_MOE_DOWN_KERNEL(gemvq_moe_down4_##name, TYPE, 4)

// The tensor-core gate/up of Q4_K experts (its own instance: its register allocation is its own).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 3)
    gemvq_moe_gu_tc_q4_k(const uint8_t* __restrict__ G, const uint8_t* __restrict__ U, long long rb, int ffn,
                         int hidden, const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                         const float* __restrict__ logits, int n_experts, int top_k, float* __restrict__ h,
                         int8_t* __restrict__ hq, float2* __restrict__ hd, int* __restrict__ tickets,
                         const uint8_t* __restrict__ D, long long d_rb) {
    gemvq_moe_gu<GGML_Q4_K, true>(G, U, rb, ffn, hidden, xq, xd, logits, n_experts, top_k, h, hq, hd, tickets, D,
                                  d_rb);
}

// The same with the shared expert as every token's slot top_k (SH; moe.rs `moe_shared`).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 3)
    gemvq_moe_gu_tcs_q4_k(const uint8_t* __restrict__ G, const uint8_t* __restrict__ U, long long rb, int ffn,
                          int hidden, const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                          const float* __restrict__ logits, int n_experts, int top_k, float* __restrict__ h,
                          int8_t* __restrict__ hq, float2* __restrict__ hd, int* __restrict__ tickets,
                          const uint8_t* __restrict__ D, long long d_rb, const uint8_t* __restrict__ Gs,
                          const uint8_t* __restrict__ Us, const uint8_t* __restrict__ Ds) {
    gemvq_moe_gu<GGML_Q4_K, true, true>(G, U, rb, ffn, hidden, xq, xd, logits, n_experts, top_k, h, hq, hd, tickets,
                                        D, d_rb, Gs, Us, Ds);
}
// gemvq_moe_gus_<type>: the lane-code gate/up with the shared expert (SH; types without the tile).
#define GEMVQ_MOE_GUS_KERNEL(name, TYPE)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 3)                                           \
        gemvq_moe_gus_##name(const uint8_t* __restrict__ G, const uint8_t* __restrict__ U, long long rb,        \
                             int ffn, int hidden, const int8_t* __restrict__ xq, const float2* __restrict__ xd,   \
                             const float* __restrict__ logits, int n_experts, int top_k, float* __restrict__ h,  \
                             int8_t* __restrict__ hq, float2* __restrict__ hd, int* __restrict__ tickets,         \
                             const uint8_t* __restrict__ D, long long d_rb, const uint8_t* __restrict__ Gs,       \
                             const uint8_t* __restrict__ Us, const uint8_t* __restrict__ Ds) {                    \
        gemvq_moe_gu<TYPE, false, true>(G, U, rb, ffn, hidden, xq, xd, logits, n_experts, top_k, h, hq, hd,     \
                                        tickets, D, d_rb, Gs, Us, Ds);                                          \
    }
GEMVQ_MOE_GUS_KERNEL(q5_k, GGML_Q5_K)
GEMVQ_MOE_GUS_KERNEL(q6_k, GGML_Q6_K)
GEMVQ_MOE_GUS_KERNEL(q8_0, GGML_Q8_0)
// gemvq_moe_downs4_<type>: the down + combine with the shared expert (SH), four rows a pass.
#define GEMVQ_MOE_DOWNS_KERNEL(name, TYPE)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2)                                           \
        gemvq_moe_downs4_##name(const uint8_t* __restrict__ D, long long rb, int hidden, int ffn,              \
                                const int8_t* __restrict__ hq, const float2* __restrict__ hd,                   \
                                const float* __restrict__ logits, int n_experts, int top_k, int norm,           \
                                float* __restrict__ out, const uint8_t* __restrict__ Ds,                        \
                                const float* __restrict__ xf, const float* __restrict__ wsg) {                  \
        gemvq_moe_down<TYPE, 4, true>(D, rb, hidden, ffn, hq, hd, logits, n_experts, top_k, norm, out, Ds, xf,  \
                                      wsg);                                                                     \
    }
GEMVQ_MOE_DOWNS_KERNEL(q4_k, GGML_Q4_K)
GEMVQ_MOE_DOWNS_KERNEL(q5_k, GGML_Q5_K)
GEMVQ_MOE_DOWNS_KERNEL(q6_k, GGML_Q6_K)
GEMVQ_MOE_DOWNS_KERNEL(q8_0, GGML_Q8_0)

GEMVQ_MOE_KERNELS(q8_0, GGML_Q8_0)
GEMVQ_MOE_KERNELS(q4_0, GGML_Q4_0)
GEMVQ_MOE_KERNELS(q4_1, GGML_Q4_1)
GEMVQ_MOE_KERNELS(q4_k, GGML_Q4_K)
GEMVQ_MOE_KERNELS(q5_k, GGML_Q5_K)
GEMVQ_MOE_KERNELS(q6_k, GGML_Q6_K)

// ---------------------------------------------------------------------------------------
// Prefill: tensor cores (mma.sync m16n8k16, bf16 inputs, f32 accumulators)
//
// Plan (mm_<type>_n<BN>, BN = 128 or 64 tokens per block; 256 threads = 8 warps as 4 (M) x 2 (N)):
//  - x is first converted once per call to a bf16 scratch [rows, kp] (kp = n_in rounded up to
//    64, zero padded) by mm_x_bf16: halves the activation bytes every block reads from L2 and
//    removes the per-block conversion.
//  - Block tile 128 outputs x BN tokens x 64 K; warp tile 32 outputs x BN/2 tokens.
//  - Double-buffered smem (rows padded to 72 bf16 = 144 B: ldmatrix rows land in distinct
//    banks), one __syncthreads per K step. In step k each thread first issues the global loads
//    of step k+2 into one of two register sets (raw weight bytes of 2 x 16 elements of one
//    output row, and BN*8/256 16-B vectors of the bf16 x tile), then runs the step-k MMAs from
//    smem (fragments by ldmatrix.x4), then decodes the other set (step k+1, loaded a step
//    earlier) to bf16 and stores it into the other smem buffer. Decode happens once per weight
//    tile per block.
//  - Measured limit (ncu, q4_K 4096x4096x512): L1/TEX throughput ~78% (global loads where each
//    warp instruction touches 16 rows = 16 lines, plus ldmatrix/STS wavefronts); tensor pipe
//    far from busy. See MATMUL.md.
//  - Grid (token tiles, output tiles), token tiles fastest: blocks sharing a weight tile run
//    together, so weights come from DRAM about once.
//  - Edges: token rows >= rows read a clamped valid row and are not stored; output rows >=
//    n_out likewise; K beyond n_in is zero in x (padding) and in the decoded weights.

#define MM_TM 128  // outputs per block (mma M)
#define MM_TK 64   // K per step
#define MM_LDS 72  // smem row stride in bf16 (144 B)

// x [rows, n_in] f32 -> xb [rows, kp] bf16 (kp % 64 == 0, zero beyond n_in); one 16-B vector
// of xb per thread (mm_decode.cuh x_scratch16).
extern "C" __global__ void __launch_bounds__(256)
    mm_x_bf16(const float* __restrict__ x, int rows, int n_in, int kp, uint16_t* __restrict__ xb) {
    PDL_ENTRY();
    x_scratch16<false>(x, rows, n_in, kp, xb);
}

// BN tokens per block (128 or 64). Dynamic smem: 2 * (MM_TM + BN) * MM_LDS * 2 bytes.
template <int TYPE, int BN>
__device__ __forceinline__ void mm(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                   const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out) {
    extern __shared__ __align__(16) uint8_t mm_smem[];
    constexpr int NT = BN / 16;          // n-tiles (8 tokens) per warp
    constexpr int XV = BN * 8 / 256;     // 16-B x vectors per thread per step (4 or 2)
    constexpr bool KQ = TYPE == GGML_Q4_K || TYPE == GGML_Q5_K;
    constexpr int A_STAGE = MM_TM * MM_LDS, B_STAGE = BN * MM_LDS;  // in bf16
    uint16_t* sA = (uint16_t*)mm_smem;
    uint16_t* sB = sA + 2 * A_STAGE;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp & 3, wn = warp >> 2;  // warp tile: outputs 32*wm.., tokens (BN/2)*wn..
    const int g = lane >> 2, t4 = lane & 3;
    const int t0 = blockIdx.x * BN, o0 = blockIdx.y * MM_TM;

    // Weight loader: output row lr, elements 16*lh.. and 32+16*lh.. of each 64-K step.
    const int lr = tid >> 1, lh = tid & 1;
    const int lo = o0 + lr < n_out ? o0 + lr : n_out - 1;
    const uint8_t* wrow = W + (size_t)lo * (size_t)rb;
    // x loader: vector v of this thread is 16-B column xc of token row xr + v * (256 / 8), so
    // 8 consecutive lanes read one 128-B row slice (4 lines per warp instruction).
    const int xr = tid >> 3, xc = tid & 7;
    const uint4* xrow[XV];
#pragma unroll
    for (int v = 0; v < XV; v++) {
        const int t = t0 + xr + 32 * v;
        xrow[v] = (const uint4*)(xb + (size_t)(t < rows ? t : rows - 1) * kp) + xc;
    }

    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

    const int nk = kp / MM_TK;
    // Two register sets of raw loads: the loads of step k+2 are issued in step k, so each has
    // two steps of MMAs to land before its decode (after the MMAs of step k+1).
    Raw16 rA0, rA1, rB0, rB1;
    uint4 xA[XV], xB[XV];

    // smem addresses (bytes) of this thread's ldmatrix rows, buffer 0, kk = 0.
    const uint32_t sA0 = (uint32_t)__cvta_generic_to_shared(sA);
    const uint32_t sB0 = (uint32_t)__cvta_generic_to_shared(sB);
    const uint32_t aoff = ((wm * 32 + (lane & 15)) * MM_LDS + (lane >> 4) * 8) * 2;
    const uint32_t boff = ((wn * (BN / 2) + (lane & 7) + ((lane >> 4) << 3)) * MM_LDS + ((lane >> 3) & 1) * 8) * 2;

    auto load = [&](int kt, Raw16& r0, Raw16& r1, uint4 (&xv)[XV]) {
        const int k = kt * MM_TK;
        raw16<TYPE>(wrow, k + 16 * lh, n_in, r0);
        // K-quants: both chunks are the low and high nibbles of the same bytes (same header).
        if (!KQ) raw16<TYPE>(wrow, k + 32 + 16 * lh, n_in, r1);
#pragma unroll
        for (int v = 0; v < XV; v++) xv[v] = __ldg(xrow[v] + k / 8);
    };
    auto store = [&](int kt, const Raw16& r0, const Raw16& r1, const uint4 (&xv)[XV]) {
        const int k = kt * MM_TK, buf = kt & 1;
        uint32_t da[8];
        uint4* pa = (uint4*)(sA + buf * A_STAGE + lr * MM_LDS + 16 * lh);
        dec16<TYPE>(r0, k + 16 * lh, n_in, da);
        pa[0] = make_uint4(da[0], da[1], da[2], da[3]);
        pa[1] = make_uint4(da[4], da[5], da[6], da[7]);
        dec16<TYPE>(KQ ? r0 : r1, k + 32 + 16 * lh, n_in, da);
        pa[4] = make_uint4(da[0], da[1], da[2], da[3]);
        pa[5] = make_uint4(da[4], da[5], da[6], da[7]);
#pragma unroll
        for (int v = 0; v < XV; v++) *((uint4*)(sB + buf * B_STAGE + (xr + 32 * v) * MM_LDS) + xc) = xv[v];
    };
    auto mma_step = [&](int kt) {
        const int cur = kt & 1;
        const uint32_t aB = sA0 + cur * A_STAGE * 2 + aoff;
        const uint32_t bB = sB0 + cur * B_STAGE * 2 + boff;
#pragma unroll
        for (int kk = 0; kk < MM_TK; kk += 16) {
            uint32_t af[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                ldsm_x4(aB + (mi * 16 * MM_LDS + kk) * 2, af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
#pragma unroll
            for (int nj = 0; nj < NT / 2; nj++) {
                uint32_t b0, b1, b2, b3;  // n-tile 2nj: (b0, b1); n-tile 2nj+1: (b2, b3)
                ldsm_x4(bB + (nj * 16 * MM_LDS + kk) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    mma_bf16(acc[mi][2 * nj], af[mi][0], af[mi][1], af[mi][2], af[mi][3], b0, b1);
                    mma_bf16(acc[mi][2 * nj + 1], af[mi][0], af[mi][1], af[mi][2], af[mi][3], b2, b3);
                }
            }
        }
    };

    // Prologue: step 0 decoded into buffer 0, step 1 in flight in set B.
    load(0, rA0, rA1, xA);
    if (nk > 1) load(1, rB0, rB1, xB);
    store(0, rA0, rA1, xA);
    __syncthreads();

    // Step kt: issue the loads of kt+2 (into the set just decoded), MMAs of kt, decode kt+1
    // into the other buffer (last read in step kt-1, which ended with a barrier), barrier.
    for (int kt = 0; kt < nk; kt += 2) {
        if (kt + 2 < nk) load(kt + 2, rA0, rA1, xA);
        mma_step(kt);
        if (kt + 1 < nk) store(kt + 1, rB0, rB1, xB);
        __syncthreads();
        if (kt + 1 < nk) {
            if (kt + 3 < nk) load(kt + 3, rB0, rB1, xB);
            mma_step(kt + 1);
            if (kt + 2 < nk) store(kt + 2, rA0, rA1, xA);
            __syncthreads();
        }
    }

    mma_store_c<NT>(acc, out, o0 + wm * 32, t0 + wn * (BN / 2), g, t4, n_out, rows);
}

#define MM_KERNEL(name, TYPE)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                    \
        mm_##name##_n128(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,                  \
                         const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out) {      \
        PDL_ENTRY();                                                                                        \
        mm<TYPE, 128>(W, rb, n_out, n_in, xb, kp, rows, out);                                               \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                    \
        mm_##name##_n64(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,                   \
                        const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out) {       \
        PDL_ENTRY();                                                                                        \
        mm<TYPE, 64>(W, rb, n_out, n_in, xb, kp, rows, out);                                                \
    }

MM_KERNEL(f32, GGML_F32)
MM_KERNEL(f16, GGML_F16)
MM_KERNEL(bf16, GGML_BF16)
MM_KERNEL(q8_0, GGML_Q8_0)
MM_KERNEL(q4_0, GGML_Q4_0)
MM_KERNEL(q4_1, GGML_Q4_1)
MM_KERNEL(q4_k, GGML_Q4_K)
MM_KERNEL(q5_k, GGML_Q5_K)
MM_KERNEL(q6_k, GGML_Q6_K)
