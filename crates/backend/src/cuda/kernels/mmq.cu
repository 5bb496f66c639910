// mmq.cu — prefill matmul on the int8 tensor cores ("MMQ"): out[t][o] = sum_i W[o][i] x[t][i]
// for rows > 16 tokens, W [n_out, n_in] in Q4_K / Q5_K / Q6_K / Q8_0 (the GGUF blocks as stored),
// x [rows, n_in] f32, out [rows, n_out] f32. Launched by mmq.rs; the other types keep the bf16
// kernel of matmul.cu.
//
// Why: the bf16 prefill kernel rounds x and the dequantized weights to 8 bits (NMSE ~1e-5 per
// matmul), the decode GEMV holds x as two int8 planes (NMSE ~2e-9). The difference flips
// near-tied MoE expert choices between prefill and decode. Here x is quantized exactly as for
// the GEMV (quant_q8_lane, common.cuh: same bits), x ~ d (127 hi + lo) per 32-element block,
// and the weights' integer quants are multiplied exactly on the tensor cores; only the block
// scales are applied in f32, per (output, token, 32-block). Expected NMSE ~1e-9 like the GEMV.
//
// 1. x quantized by matmul.cu's quant_x_q8 (launched through matmul.rs's quantize_into): xq
//    [rows][2][n_in] int8 (hi plane, then lo plane), xd [rows][n_in/32] float2 (d, d * sum(127 hi
//    + lo)).
//
// 2. mmq_<type>_n<BN> (BN = 128 or 64 tokens per block), 256 threads = 8 warps as 4 (M) x 2 (N).
//    - Block tile 128 outputs x BN tokens, K step 64 (two 32-blocks kb = 2kt, 2kt+1); warp tile
//      32 outputs x BN/2 tokens = 2 x BN/16 mma tiles of 16 x 8.
//    - Weights: each thread decodes one (row, half) of the step: row lr = tid / 2, lh = tid % 2.
//      K-quants Q4_K/Q5_K: the 16 qs bytes 16 lh.. of the sub-block pair (2g, 2g+1) (one 16-B
//      load: low nibbles = kb 2kt, high nibbles = kb 2kt+1) + the 16-B header; thread lh also
//      derives the scale (and min) of sub-block 2g + lh. Q8_0: block 2kt + lh (9 aligned words
//      + funnel shifts: rows are 2-byte aligned). Q6_K: the 32-block 2kt + lh (ql and qh runs,
//      9 aligned words each, its two 16-element int8 scales and d). Raw bytes are loaded two
//      steps ahead into registers (two sets, as mm_ in matmul.cu), decoded to int8 after the
//      step's MMAs and stored to smem (row stride 80 B: ldmatrix rows conflict free). Q4_K is
//      stored as q - 8 (signed, |.| <= 8) so that hi and lo can be combined in int32 (below).
//      Scales: per (kb, row) a float2: Q4_K (d sc, 8 d sc - dmin m), Q5_K (d sc, -dmin m),
//      Q8_0 (d, 0), Q6_K (d sc_a, d sc_b) for its two 16-element halves.
//    - x: the int8 planes are copied by cp.async (16 B, L1-bypassing) into a 3-stage ring:
//      per token a 144-B row (64 B hi | 64 B lo | 16 pad: ldmatrix conflict free) and its two
//      (d, s) pairs. Issued two steps ahead; one __syncthreads per step.
//    - MMA: per 32-block and 16 x 8 tile, mma.sync m16n8k32 s8.s8.s32 twice (hi plane, lo plane)
//      from ldmatrix.x4 fragments (an int8 k32 fragment has the byte layout of a bf16 k16 one).
//      Q6_K: m16n8k16 per 16-element half (its scales change every 16 elements): four MMAs.
//    - Int -> f32: the accumulators start at 0x4B400000 (the float 1.5 * 2^23), so while
//      |sum| < 2^22 the int32 result read as a float is exactly 1.5 * 2^23 + sum: one FADD
//      instead of a (quarter-rate) I2F. Bounds: per 32-block |127 hi + lo| <= 16193 per
//      element; a hi-plane or lo-plane sum is <= 32 * 128 * 127 = 520192 < 2^22 for every type.
//      Q4_K (q - 8 in [-8, 7]): the combined 127 * H + L <= 32 * 8 * 16193 = 4145408 < 2^22,
//      so it is combined in int32 (one IMAD, hi from 0, lo from the magic) and converted once.
//      Other types: y = 127 (H - M) + (L - M) in f32 (exact products, one rounding).
//    - Epilogue per element and 32-block: acc += (sw[o] dx[t]) y (+ cw[o] sx[t] for the
//      K-quants' mins / Q4_K's offset, sx = the x block sum). acc is f32 per (o, t).
//    - Bytes: weights read once per token tile (token tiles fastest in the grid: blocks that
//      share a weight tile run together and share it through L2); x 2.125 B per element from
//      L2 per output tile.
//    - Edges: token rows >= rows and output rows >= n_out read a clamped valid row and are not
//      stored; n_in must be a multiple of 64 (checked by the launcher).

#define MQ_TM 128           // outputs per block
#define MQ_TK 64            // K per step (two 32-blocks)
#define MQ_ALD 80           // A smem row stride (bytes): 64 + 16 pad
#define MQ_BLD 144          // x smem row stride (bytes): 64 hi + 64 lo + 16 pad
#define MQ_XST 3            // x ring stages
#define MQ_MAGIC 0x4B400000 // bits of 1.5 * 2^23
#define MQ_MAGIC_F 12582912.0f

// Shared memory layout (bytes): A stages [2][128][80], A scales [2][2][128] float2,
// x stages [3][BN][144], x scales [3][BN][2] float2.
#define MQ_A_STAGE (MQ_TM * MQ_ALD)
#define MQ_AS_STAGE (2 * MQ_TM * 8)

__device__ __forceinline__ float mq_h2f(uint32_t h) {
    return __half2float(__ushort_as_half((unsigned short)(h & 0xFFFFu)));
}

// Raw (undecoded) weight bytes of one thread's share of a K step, held in registers between
// the load (two steps ahead) and the decode.
struct MqRaw {
    uint32_t w[20];
    uint32_t s;
};

template <int TYPE>
__device__ __forceinline__ void mq_load(const uint8_t* __restrict__ row, int kt, int lh, MqRaw& r) {
    if (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
        const bool q4 = TYPE == GGML_Q4_K;
        const uint8_t* blk = row + (size_t)(kt >> 2) * (q4 ? Q4_K_BYTES : Q5_K_BYTES);  // 16-aligned
        const int g = kt & 3;
        const uint4 h = __ldg((const uint4*)blk);
        const uint4 q = __ldg((const uint4*)(blk + (q4 ? 16 : 48) + 32 * g + 16 * lh));
        r.w[0] = h.x; r.w[1] = h.y; r.w[2] = h.z; r.w[3] = h.w;
        r.w[4] = q.x; r.w[5] = q.y; r.w[6] = q.z; r.w[7] = q.w;
        if (!q4) {
            const uint4 hv = __ldg((const uint4*)(blk + 16 + 16 * lh));
            r.w[8] = hv.x; r.w[9] = hv.y; r.w[10] = hv.z; r.w[11] = hv.w;
        }
    } else if (TYPE == GGML_Q8_0) {
        // Block 2kt + lh (34 B, 2-byte aligned): 9 aligned words cover it (offset 0 or 2).
        const uint8_t* blk = row + (size_t)(2 * kt + lh) * Q8_0_BYTES;
        const uint32_t* p = (const uint32_t*)((size_t)blk & ~(size_t)3);
#pragma unroll
        for (int i = 0; i < 9; i++) r.w[i] = __ldg(p + i);
        r.s = (uint32_t)((size_t)blk & 2);
    } else if (TYPE == GGML_Q6_K) {
        const uint8_t* blk = row + (size_t)(kt >> 2) * Q6_K_BYTES;  // 2-aligned
        const int n = (kt & 3) >> 1, quarter = 2 * (kt & 1) + lh;
        const size_t a = (size_t)blk;
        // ql run 64n + 32 lh and qh run 128 + 32n: both at even offsets, the block's alignment.
        const uint32_t* pl = (const uint32_t*)((a + 64 * n + 32 * lh) & ~(size_t)3);
        const uint32_t* ph = (const uint32_t*)((a + 128 + 32 * n) & ~(size_t)3);
#pragma unroll
        for (int i = 0; i < 9; i++) r.w[i] = __ldg(pl + i);
#pragma unroll
        for (int i = 0; i < 9; i++) r.w[9 + i] = __ldg(ph + i);
        r.w[18] = __ldg((const unsigned short*)(blk + 208));
        r.w[19] = __ldg((const unsigned short*)(blk + 192 + 8 * n + 2 * quarter));
        r.s = (uint32_t)(a & 2) * 8;  // funnel shift in bits
    }
}

// Byte i (0..11) of the K-quant scale bytes held in words s0 s1 s2.
__device__ __forceinline__ int mq_sbyte(uint32_t s0, uint32_t s1, uint32_t s2, int i) {
    const uint32_t w = i < 4 ? s0 : (i < 8 ? s1 : s2);
    return (int)((w >> (8 * (i & 3))) & 0xFFu);
}

// ggml's get_scale_min_k4 from the scale words.
__device__ __forceinline__ void mq_scale_min(int j, uint32_t s0, uint32_t s1, uint32_t s2, int& sc, int& m) {
    if (j < 4) {
        sc = mq_sbyte(s0, s1, s2, j) & 63;
        m = mq_sbyte(s0, s1, s2, j + 4) & 63;
    } else {
        sc = (mq_sbyte(s0, s1, s2, j + 4) & 0xF) | ((mq_sbyte(s0, s1, s2, j - 4) >> 6) << 4);
        m = (mq_sbyte(s0, s1, s2, j + 4) >> 4) | ((mq_sbyte(s0, s1, s2, j) >> 6) << 4);
    }
}

// Decodes what mq_load loaded for step kt into int8 quants in the smem A row (arow: this
// row's 64 bytes of the stage) and the scale pair of this thread's 32-block into as_
// (the stage's [2][128] float2, row lr).
template <int TYPE>
__device__ __forceinline__ void mq_store(const MqRaw& r, int kt, int lh, uint8_t* arow, float2* as_, int lr) {
    if (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
        const int g = kt & 3, j = 2 * g + lh;
        const float d = mq_h2f(r.w[0]), dmin = mq_h2f(r.w[0] >> 16);
        int sc, m;
        mq_scale_min(j, r.w[1], r.w[2], r.w[3], sc, m);
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t a = r.w[4 + i];
            lo[i] = a & 0x0F0F0F0Fu;
            hi[i] = (a >> 4) & 0x0F0F0F0Fu;
            if (TYPE == GGML_Q5_K) {
                const uint32_t h = r.w[8 + i];
                lo[i] |= ((h >> (2 * g)) & 0x01010101u) << 4;
                hi[i] |= ((h >> (2 * g + 1)) & 0x01010101u) << 4;
            } else {
                // q - 8 per byte: q + 0x78 stays in its byte (q <= 15), then flip the sign bit.
                lo[i] = (lo[i] + 0x78787878u) ^ 0x80808080u;
                hi[i] = (hi[i] + 0x78787878u) ^ 0x80808080u;
            }
        }
        *(uint4*)(arow + 16 * lh) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        *(uint4*)(arow + 32 + 16 * lh) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        const float sw = d * (float)sc;
        const float cw = TYPE == GGML_Q4_K ? fmaf(8.0f, sw, -dmin * (float)m) : -dmin * (float)m;
        as_[lh * MQ_TM + lr] = make_float2(sw, cw);
    } else if (TYPE == GGML_Q8_0) {
        const bool o2 = r.s != 0;
        const float d = mq_h2f(o2 ? (r.w[0] >> 16) : r.w[0]);
        uint32_t q[8];
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = o2 ? r.w[i + 1] : __funnelshift_r(r.w[i], r.w[i + 1], 16);
        *(uint4*)(arow + 32 * lh) = make_uint4(q[0], q[1], q[2], q[3]);
        *(uint4*)(arow + 32 * lh + 16) = make_uint4(q[4], q[5], q[6], q[7]);
        as_[lh * MQ_TM + lr] = make_float2(d, 0.0f);
    } else if (TYPE == GGML_Q6_K) {
        const int quarter = 2 * (kt & 1) + lh;
        const int lshift = (kt & 1) ? 4 : 0, hshift = 2 * quarter;
        uint32_t q[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint32_t ql = __funnelshift_r(r.w[i], r.w[i + 1], r.s);
            const uint32_t qh = __funnelshift_r(r.w[9 + i], r.w[10 + i], r.s);
            const uint32_t v = ((ql >> lshift) & 0x0F0F0F0Fu) | (((qh >> hshift) & 0x03030303u) << 4);
            q[i] = (v + 0x60606060u) ^ 0x80808080u;  // v - 32 per byte (v <= 63)
        }
        *(uint4*)(arow + 32 * lh) = make_uint4(q[0], q[1], q[2], q[3]);
        *(uint4*)(arow + 32 * lh + 16) = make_uint4(q[4], q[5], q[6], q[7]);
        const float d = mq_h2f(r.w[18]);
        const float sa = d * (float)(int)(int8_t)(r.w[19] & 0xFFu);
        const float sb = d * (float)(int)(int8_t)((r.w[19] >> 8) & 0xFFu);
        as_[lh * MQ_TM + lr] = make_float2(sa, sb);
    }
}

// d = a . b + c (int8 m16n8k32; a: 16 x 32 row-major, b: 32 x 8 col-major).
__device__ __forceinline__ void mq_mma32(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, int c) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c));
}

// d = a . b + c (int8 m16n8k16).
__device__ __forceinline__ void mq_mma16(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0, int c) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(c));
}

__device__ __forceinline__ void mq_cp16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void mq_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void mq_cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

__device__ __forceinline__ float mq_unmagic(int v) { return __int_as_float(v) - MQ_MAGIC_F; }

template <int TYPE, int BN>
__device__ __forceinline__ void mmq(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                    const int8_t* __restrict__ xq, const float2* __restrict__ xd, int rows,
                                    float* __restrict__ out) {
    extern __shared__ __align__(16) uint8_t mq_smem[];
    constexpr int NT = BN / 16;                // n-tiles (8 tokens) per warp
    constexpr int XV = BN * 8 / 256;           // 16-B x chunks per thread per step
    constexpr int B_STAGE = BN * MQ_BLD;       // bytes
    constexpr int XS_STAGE = BN * 16;          // bytes: (d, s) of kb 2kt and 2kt+1 per token
    constexpr bool COMB = TYPE == GGML_Q4_K;   // hi and lo combined in int32
    constexpr bool MINS = TYPE == GGML_Q4_K || TYPE == GGML_Q5_K;
    constexpr bool Q6 = TYPE == GGML_Q6_K;
    uint8_t* sA = mq_smem;                                    // [2][128][80]
    float2* sAS = (float2*)(sA + 2 * MQ_A_STAGE);             // [2][2][128]
    uint8_t* sB = (uint8_t*)(sAS + 2 * 2 * MQ_TM);            // [3][BN][144]
    float2* sXS = (float2*)(sB + MQ_XST * B_STAGE);           // [3][BN][2]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp & 3, wn = warp >> 2;
    const int g = lane >> 2, t4 = lane & 3;
    const int t0 = blockIdx.x * BN, o0 = blockIdx.y * MQ_TM;
    const int nk = n_in / MQ_TK;
    const int nkb = n_in / QK;

    // Weight loader: row lr, half lh.
    const int lr = tid >> 1, lh = tid & 1;
    const int wo = o0 + lr < n_out ? o0 + lr : n_out - 1;
    const uint8_t* wrow = W + (size_t)wo * (size_t)rb;

    // x loader: chunk c = tid + 256 v: token c / 8, plane (c / 4) % 2, 16-B piece c % 4.
    const int8_t* xsrc[XV];
    uint32_t xdst[XV];
    const uint32_t sB0 = (uint32_t)__cvta_generic_to_shared(sB);
    const uint32_t sXS0 = (uint32_t)__cvta_generic_to_shared(sXS);
#pragma unroll
    for (int v = 0; v < XV; v++) {
        const int c = tid + 256 * v, t = c >> 3, plane = (c >> 2) & 1, sub = c & 3;
        const int tt = t0 + t < rows ? t0 + t : rows - 1;
        xsrc[v] = xq + (size_t)tt * 2 * n_in + (size_t)plane * n_in + 16 * sub;
        xdst[v] = sB0 + t * MQ_BLD + plane * 64 + 16 * sub;
    }
    const float2* xdsrc = nullptr;
    if (tid < BN) {
        const int tt = t0 + tid < rows ? t0 + tid : rows - 1;
        xdsrc = xd + (size_t)tt * nkb;
    }

    auto load_x = [&](int kt) {
        const int st = kt % MQ_XST;
#pragma unroll
        for (int v = 0; v < XV; v++) mq_cp16(xdst[v] + st * B_STAGE, xsrc[v] + kt * MQ_TK);
        if (tid < BN) mq_cp16(sXS0 + st * XS_STAGE + tid * 16, xdsrc + 2 * kt);
    };
    auto store_w = [&](int kt, const MqRaw& r) {
        const int buf = kt & 1;
        mq_store<TYPE>(r, kt, lh, sA + buf * MQ_A_STAGE + lr * MQ_ALD, sAS + buf * 2 * MQ_TM, lr);
    };

    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

    const uint32_t sA0 = (uint32_t)__cvta_generic_to_shared(sA);
    const uint32_t aoff = (wm * 32 + (lane & 15)) * MQ_ALD + (lane >> 4) * 16;
    const uint32_t boff = (wn * (BN / 2) + (lane & 7) + ((lane >> 4) << 3)) * MQ_BLD + ((lane >> 3) & 1) * 16;

    auto mma_step = [&](int kt) {
        const int abuf = kt & 1, xs = kt % MQ_XST;
        const uint32_t aB = sA0 + abuf * MQ_A_STAGE + aoff;
        const uint32_t bB = sB0 + xs * B_STAGE + boff;
        const float2* as_ = sAS + abuf * 2 * MQ_TM + wm * 32 + g;
        const float2* xs_ = sXS + xs * (XS_STAGE / 8) + (wn * (BN / 2) + 2 * t4) * 2;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            uint32_t af[2][4];
            float2 ws[2][2];  // [mi][row g / g+8]
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                ldsm_x4(aB + mi * 16 * MQ_ALD + kk * 32, af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
                ws[mi][0] = as_[kk * MQ_TM + mi * 16];
                ws[mi][1] = as_[kk * MQ_TM + mi * 16 + 8];
            }
#pragma unroll
            for (int nj = 0; nj < NT / 2; nj++) {
                uint32_t h0, h1, h2, h3, l0, l1, l2, l3;  // n-tile 2nj: (x0, x1); 2nj+1: (x2, x3)
                const uint32_t bq = bB + nj * 16 * MQ_BLD + kk * 32;
                ldsm_x4(bq, h0, h1, h2, h3);
                ldsm_x4(bq + 64, l0, l1, l2, l3);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int ni = 2 * nj + h;
                    const uint32_t bh0 = h ? h2 : h0, bh1 = h ? h3 : h1;
                    const uint32_t bl0 = h ? l2 : l0, bl1 = h ? l3 : l1;
                    // (d, s) of tokens 2 t4 and 2 t4 + 1 of this n-tile, block kk.
                    const float2 x0 = xs_[(ni * 8) * 2 + kk];
                    const float2 x1 = xs_[(ni * 8 + 1) * 2 + kk];
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) {
                        float* c = acc[mi][ni];
                        if (Q6) {
                            int ha[4], hb[4], la[4], lb[4];
                            mq_mma16(ha, af[mi][0], af[mi][1], bh0, MQ_MAGIC);
                            mq_mma16(hb, af[mi][2], af[mi][3], bh1, MQ_MAGIC);
                            mq_mma16(la, af[mi][0], af[mi][1], bl0, MQ_MAGIC);
                            mq_mma16(lb, af[mi][2], af[mi][3], bl1, MQ_MAGIC);
#pragma unroll
                            for (int k = 0; k < 4; k++) {
                                const float2 w = ws[mi][k >> 1];
                                const float dx = (k & 1) ? x1.x : x0.x;
                                const float ya = fmaf(127.0f, mq_unmagic(ha[k]), mq_unmagic(la[k]));
                                const float yb = fmaf(127.0f, mq_unmagic(hb[k]), mq_unmagic(lb[k]));
                                c[k] = fmaf(dx, fmaf(w.x, ya, w.y * yb), c[k]);
                            }
                        } else {
                            int hs[4], ls[4];
                            mq_mma32(hs, af[mi], bh0, bh1, COMB ? 0 : MQ_MAGIC);
                            mq_mma32(ls, af[mi], bl0, bl1, MQ_MAGIC);
#pragma unroll
                            for (int k = 0; k < 4; k++) {
                                const float2 w = ws[mi][k >> 1];
                                const float2 xv = (k & 1) ? x1 : x0;
                                const float y = COMB ? mq_unmagic(127 * hs[k] + ls[k])
                                                     : fmaf(127.0f, mq_unmagic(hs[k]), mq_unmagic(ls[k]));
                                float a = fmaf(w.x * xv.x, y, c[k]);
                                if (MINS) a = fmaf(w.y, xv.y, a);
                                c[k] = a;
                            }
                        }
                    }
                }
            }
        }
    };

    MqRaw rA, rB;
    // Prologue: x of steps 0 and 1 in flight, weights of step 0 stored, step 1 in set B.
    load_x(0);
    mq_cp_commit();
    if (nk > 1) load_x(1);
    mq_cp_commit();
    mq_load<TYPE>(wrow, 0, lh, rA);
    if (nk > 1) mq_load<TYPE>(wrow, 1, lh, rB);
    store_w(0, rA);
    mq_cp_wait1();
    __syncthreads();

    // Step kt: x copies of kt+2 (ring slot last read in step kt-1), weight loads of kt+2 into
    // the register set just stored, MMAs of kt, decode of kt+1 into the other A buffer (last
    // read in step kt-1), wait for x of kt+1, barrier.
    for (int kt = 0; kt < nk; kt += 2) {
        if (kt + 2 < nk) load_x(kt + 2);
        mq_cp_commit();
        if (kt + 2 < nk) mq_load<TYPE>(wrow, kt + 2, lh, rA);
        mma_step(kt);
        if (kt + 1 < nk) store_w(kt + 1, rB);
        mq_cp_wait1();
        __syncthreads();
        if (kt + 1 < nk) {
            if (kt + 3 < nk) load_x(kt + 3);
            mq_cp_commit();
            if (kt + 3 < nk) mq_load<TYPE>(wrow, kt + 3, lh, rB);
            mma_step(kt + 1);
            if (kt + 2 < nk) store_w(kt + 2, rA);
            mq_cp_wait1();
            __syncthreads();
        }
    }

    mma_store_c<NT>(acc, out, o0 + wm * 32, t0 + wn * (BN / 2), g, t4, n_out, rows);
}

#define MMQ_KERNEL(name, TYPE)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                    \
        mmq_##name##_n128(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,                 \
                          const int8_t* __restrict__ xq, const float2* __restrict__ xd, int rows,           \
                          float* __restrict__ out) {                                                        \
        PDL_ENTRY();                                                                                        \
        mmq<TYPE, 128>(W, rb, n_out, n_in, xq, xd, rows, out);                                              \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                    \
        mmq_##name##_n64(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,                  \
                         const int8_t* __restrict__ xq, const float2* __restrict__ xd, int rows,            \
                         float* __restrict__ out) {                                                         \
        PDL_ENTRY();                                                                                        \
        mmq<TYPE, 64>(W, rb, n_out, n_in, xq, xd, rows, out);                                               \
    }

MMQ_KERNEL(q4_k, GGML_Q4_K)
MMQ_KERNEL(q5_k, GGML_Q5_K)
MMQ_KERNEL(q6_k, GGML_Q6_K)
MMQ_KERNEL(q8_0, GGML_Q8_0)
