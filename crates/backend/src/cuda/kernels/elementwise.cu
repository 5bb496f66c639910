// elementwise.cu — the small ops of a decoder layer.
//
// All of these move O(rows × cols) floats and are bandwidth-trivial next to the matmuls;
// their cost at decode is launch latency, which CUDA graphs hide. Plans:
// - embed:        grid (token rows, column chunks of 256): one element per thread, decoded
//                 from the stored block type (ggml_get). (One block per row walked 16
//                 dependent decodes per thread: 10 µs per decode step for a 4096-wide row.)
// - rms_norm:     one block per row; each thread sums squares of a strided slice, warp
//                 shuffles then shared memory reduce; then every thread scales its slice.
// - head_rms_norm: one warp per head (head_dim ≤ 256: 8 values per lane at most).
// - rope:         one thread per rotated pair; the angle pos·θ^(-2i/d) computed in f32 as
//                 the CPU reference and Hugging Face compute it; the position is read from
//                 device memory so a captured decode graph is valid at every position.
// - add / swiglu: one thread per element.
// - add_rms_norm: the residual add fused with the next RMSNorm (x += y; h = rms_norm(x)·w),
//                 replacing add_assign + rms_norm twice per layer. One block per row,
//                 ~4 columns per thread (32..1024 threads, from cols only so a row's result
//                 never depends on how many rows share the step): pass 1 adds, stores x
//                 and sums the squares of the sum (exactly add_assign's f32 add, so x is
//                 bitwise the CPU's); shared reduce as rms_norm; pass 2 re-reads its own x
//                 elements and writes h. Moves 3 reads + 2 writes of rows·cols floats where
//                 the two ops moved 3 + 1 then 1 + 1 (and one launch instead of two).
// - qk_norm_rope: Qwen3's per-head QK-norm (where weights are given) and RoPE on q AND k in
//                 one launch, replacing head_rms_norm ×2 + rope ×2. One warp per (row, head):
//                 warps [0, rows·q_heads) take q's heads, the rest k's (a head's offset is
//                 warp·head_dim since heads are contiguous across rows). The warp sums the
//                 head's squares lane-strided (as head_rms_norm) and shuffles; then lane l
//                 takes rotary pairs p = l, l+32, ... (NeoX (p, p+rot/2) or adjacent (2p, 2p+1)),
//                 normalises both elements in registers, rotates them with the rope kernel's
//                 angle arithmetic, writes them; the dims past rot_dim (partial rotary) are
//                 only normalised. Every element is read and written by one lane, and all
//                 lanes finish pass-1 reads before the shuffle, so no lane sees another's
//                 writes. One read (two with norm, the second from L1/L2) and one write per
//                 element. The lane's norm weights and rotary frequencies (powf) are loaded
//                 and computed before the PDL wait (up to QKR_PAIRS pairs per lane:
//                 rot_dim <= 256, checked by the launcher).
// - rope_tab, qk_norm_rope_tab, qk_norm_rope_kv_tab: the rotations with a RoPE scaling's
//                 frequency table (Llama 3.1's "llama3"; ops.rs rope_table) read where theta's
//                 powf was: rot_dim / 2 floats a launch, from L1/L2 after the first warp. They
//                 are the same templates with TAB set; with TAB unset rope, qk_norm_rope and
//                 qk_norm_rope_kv compile to the SASS they had before (their CUBIN .text
//                 sections byte-identical, compared when the tables came), so the unscaled
//                 models' path did not change.
// - topk_rows:    one block per row, k passes: pass j finds the best element strictly after
//                 the (j-1)-th in the total order (value desc, index asc; NaN as -inf), so
//                 no selection list is kept; k·cols reads (k ≤ 64: ~40 MB at 150k vocab,
//                 ~10 µs) instead of copying the whole row to the host.
// - rms_norm_v4 / add_rms_norm_v4 (rows of cols % 4 == 0, up to 16384 columns; the launcher
//                 falls back to the scalar kernels above otherwise): one block per row, thread
//                 t owns the float4 chunks t, t + blockDim, ... (at most NORM_NV) and keeps
//                 them in registers, so the row is read once with 16-byte loads, all loads
//                 of a thread in flight together. The weight chunks are loaded BEFORE the PDL
//                 wait (weights depend on no kernel), so their latency overlaps the previous
//                 kernel's tail. One __syncthreads: every thread adds the warp partials itself
//                 in warp order. Why: the scalar kernels walked 4 dependent load rounds per
//                 thread and two barriers (measured 7.45 µs per call for a 4096-column decode
//                 row; ~15% of a Qwen3-8B decode step with 72 calls).
//                 Quantization for the next GEMV (xq != null): a 32-element block is 8
//                 consecutive lanes of 4 values; amax and the integer sum over those 8 lanes
//                 by xor shuffles; per element the expressions of quant_q8_lane (common.cuh),
//                 so the planes are bitwise quant_x_q8's (max and integer sums are exact in
//                 any order).
// - argmax_rows_mb: grid (ARGMAX_BLOCKS, rows): a block takes a contiguous slice of its row,
//                 per-thread best (first max in ascending order), then a 64-bit key
//                 (order-preserving value bits << 32 | ~index: the largest key is the largest
//                 value at the lowest index, exactly the CPU's choice) reduced by shuffles and
//                 one atomicMax per block into best[row]; the block that arrives last (ticket
//                 counter, after a fence) writes the index and resets best and the ticket to
//                 0, so a replayed graph finds them clean. NaN and -inf are never candidates
//                 (as on the CPU); a row with none gives 0. Why: a single block read the
//                 151,936-logit row at one SM's bandwidth (58 µs per decode step).

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void embed(const uint8_t* __restrict__ table, int type, long long row_bytes,
                                 const int* __restrict__ tokens, float* __restrict__ out, int dim) {
    PDL_ENTRY();
    const int t = blockIdx.x;
    const uint8_t* row = table + (long long)tokens[t] * row_bytes;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < dim; i += gridDim.y * blockDim.x)
        out[(long long)t * dim + i] = ggml_get(row, type, i);
}

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int cols, float eps) {
    PDL_ENTRY();
    __shared__ float partial[32];
    const float* xr = x + (long long)blockIdx.x * cols;
    float* orow = out + (long long)blockIdx.x * cols;
    float ss = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) partial[wid] = ss;
    __syncthreads();
    if (wid == 0) {
        int nw = (blockDim.x + 31) >> 5;
        float v = lane < nw ? partial[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    float scale = rsqrtf(partial[0] / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) orow[i] = (xr[i] * scale) * w[i];
}

// x: n_heads_total heads of head_dim floats, normalised in place, one warp per head.
extern "C" __global__ void head_rms_norm(float* __restrict__ x, const float* __restrict__ w,
                                         int n_heads_total, int head_dim, float eps) {
    PDL_ENTRY();
    int head = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (head >= n_heads_total) return;
    float* h = x + (long long)head * head_dim;
    float ss = 0.f;
    for (int i = lane; i < head_dim; i += 32) ss += h[i] * h[i];
    ss = warp_sum(ss);
    float scale = rsqrtf(ss / (float)head_dim + eps);
    for (int i = lane; i < head_dim; i += 32) h[i] = (h[i] * scale) * w[i];
}

// One thread per (row, head, pair i < rot_dim/2). TAB (rope_tab): the pair's frequency from
// the table a RoPE scaling set (`freq`, rot_dim / 2 floats: Llama 3.1's "llama3") instead of
// theta^(-2i / rot_dim); rope itself compiles to the code it had before the table existed.
template <bool TAB>
__device__ __forceinline__ void rope_impl(float* __restrict__ x, const int* __restrict__ positions, int rows,
                                          int cols, int head_dim, int rot_dim, int neox, float theta,
                                          const float* __restrict__ freq) {
    PDL_ENTRY();
    int half = rot_dim / 2;
    int heads = cols / head_dim;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)rows * heads * half;
    if (idx >= total) return;
    int i = (int)(idx % half);
    long long rh = idx / half;
    int head = (int)(rh % heads);
    int t = (int)(rh / heads);
    float inv_freq;
    if constexpr (TAB)
        inv_freq = freq[i];
    else
        inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)rot_dim);
    float a = (float)positions[t] * inv_freq;
    float c = cosf(a), s = sinf(a);
    float* h = x + (long long)t * cols + (long long)head * head_dim;
    int ia = neox ? i : 2 * i;
    int ib = neox ? i + half : 2 * i + 1;
    float x0 = h[ia], x1 = h[ib];
    h[ia] = x0 * c - x1 * s;
    h[ib] = x0 * s + x1 * c;
}
extern "C" __global__ void rope(float* __restrict__ x, const int* __restrict__ positions, int rows, int cols,
                                int head_dim, int rot_dim, int neox, float theta) {
    rope_impl<false>(x, positions, rows, cols, head_dim, rot_dim, neox, theta, nullptr);
}
extern "C" __global__ void rope_tab(float* __restrict__ x, const int* __restrict__ positions, int rows, int cols,
                                    int head_dim, int rot_dim, int neox, const float* __restrict__ freq) {
    rope_impl<true>(x, positions, rows, cols, head_dim, rot_dim, neox, 0.f, freq);
}

// x += y; h = (x · rsqrt(mean(x²) + eps)) · w; one block per row. With xq (the launcher
// passes it when the next op is a quantized-x GEMV reading h: ops.rs), h is also quantized
// for it (quant_q8_lane, the same bits as quant_x_q8) into xq / xd laid out as quant_x_q8's:
// cols is then a multiple of 32 and so is blockDim, so each warp's iteration of the last loop
// covers one whole 32-element block.
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ y,
                                        const float* __restrict__ w, float* __restrict__ h,
                                        int cols, float eps, int8_t* __restrict__ xq,
                                        float2* __restrict__ xd) {
    PDL_ENTRY();
    __shared__ float partial[32];
    float* xr = x + (long long)blockIdx.x * cols;
    const float* yr = y + (long long)blockIdx.x * cols;
    float* hr = h + (long long)blockIdx.x * cols;
    float ss = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = xr[i] + yr[i];
        xr[i] = v;
        ss += v * v;
    }
    ss = warp_sum(ss);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) partial[wid] = ss;
    __syncthreads();
    if (wid == 0) {
        int nw = (blockDim.x + 31) >> 5;
        float v = lane < nw ? partial[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    float scale = rsqrtf(partial[0] / (float)cols + eps);
    // Each thread re-reads only the x elements it wrote itself.
    if (xq == nullptr) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) hr[i] = (xr[i] * scale) * w[i];
    } else {
        int8_t* qr = xq + (long long)blockIdx.x * 2 * cols;
        float2* dr = xd + (long long)blockIdx.x * (cols / QK);
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float v = (xr[i] * scale) * w[i];
            hr[i] = v;
            quant_q8_lane(v, lane, qr, cols, i, dr + i / QK);
        }
    }
}

// q: rows × q_heads heads, k: rows × k_heads heads, each head_dim floats, in place.
// qw / kw: the heads' norm weights (head_dim floats), or null for no norm.
// Rotary pairs per lane held in registers by qk_norm_rope (head_dim <= 256: half <= 128).
#define QKR_PAIRS 4
// The register form (qk_norm_rope's heads of at most QKR_REGS * 32 elements, a multiple of
// 32, NeoX pairs half = 32 HOFF apart, so that a pair lies in one lane: Qwen3.5's 256-dim
// heads rotated on 64 dims, Qwen3's 128 on 128): the lane's elements lane + 32 k all loaded
// at once after the PDL wait (one L2 round trip where the loops took one per step: the
// 28th session's lesson from gated_rms_norm), their norm weights before it, then the loops'
// operations in their order on registers: the same bits.
#define QKR_REGS 8
// The rotation of the register form by the angles' cosines and sines (qkr_angles: per rotary
// pair j of the lane, computed once for every head of the warp: they depend on the token and
// the pair only).
template <int HOFF>
__device__ __forceinline__ void qkr_angles(float (&c)[QKR_PAIRS], float (&s)[QKR_PAIRS], const float (&inv_freq)[QKR_PAIRS],
                                           float pos) {
#pragma unroll
    for (int j = 0; j < HOFF; j++) {
        // One range reduction for both (the pair the one-head form's cosf(a), sinf(a) compiled to:
        // the same bits).
        const float a = pos * inv_freq[j];
        sincosf(a, &s[j], &c[j]);
    }
}
template <int HOFF, int N>
__device__ __forceinline__ void qkr_rotate(float (&v)[N], const float (&c)[QKR_PAIRS], const float (&s)[QKR_PAIRS]) {
#pragma unroll
    for (int j = 0; j < HOFF; j++) {
        const float x0 = v[j], x1 = v[j + HOFF];
        v[j] = x0 * c[j] - x1 * s[j];
        v[j + HOFF] = x0 * s[j] + x1 * c[j];
    }
}
// Elements a lane holds at most across the register form's heads (`hpw`, the launcher's: 16 / NR
// heads of NR registers a lane, i.e. 4 heads of up to 128 elements or 2 of 256, for prefills; else
// 1). One warp a head recomputed the same angles (two sincos a lane, and the powf before the
// wait) for every head of a token: 36 times a Qwen3-30B-A3B token (MATMUL.md round 90).
#define QKR_HREGS 16

// The register form on a warp's nh heads (nh <= QKR_HREGS / NR) of at most 32 NR elements each: every
// head's elements loaded at once (one L2 round trip for the warp's heads), then each head
// normalised, rotated by the warp's angles and stored.
// kc0 (qk_norm_rope_kv's k warps): each head's result goes to the f16 cache instead, head h at
// kc0 + h · kc_stride, as f32_to_f16_sat (the kv store's bits), and its f32 rows are not written.
template <int NR>
__device__ __forceinline__ void qkr_heads(float* __restrict__ hp0, int nh, int head_dim, int hoff, bool norm,
                                          const float (&nv)[QKR_REGS], const float (&cs)[QKR_PAIRS],
                                          const float (&sn)[QKR_PAIRS], float eps, int lane,
                                          unsigned short* __restrict__ kc0 = nullptr, long long kc_stride = 0) {
    constexpr int HH = QKR_HREGS / NR;
    float vh[HH][NR];
#pragma unroll
    for (int h = 0; h < HH; h++)
#pragma unroll
        for (int m = 0; m < NR; m++)
            vh[h][m] = h < nh && lane + 32 * m < head_dim ? hp0[(long long)h * head_dim + lane + 32 * m] : 0.f;
#pragma unroll
    for (int h = 0; h < HH; h++) {
        if (h >= nh) break;
        float* hp = hp0 + (long long)h * head_dim;
        float(&v)[NR] = vh[h];
        if (norm) {
            float ss = 0.f;
#pragma unroll
            for (int m = 0; m < NR; m++)
                if (lane + 32 * m < head_dim) ss += v[m] * v[m];
            ss = warp_sum(ss);
            const float scale = rsqrtf(ss / (float)head_dim + eps);
#pragma unroll
            for (int m = 0; m < NR; m++) v[m] = (v[m] * scale) * nv[m];
        }
        if (hoff == 1)
            qkr_rotate<1>(v, cs, sn);
        else if (hoff == 2)
            qkr_rotate<2>(v, cs, sn);
        else if constexpr (NR >= 8)
            qkr_rotate<4>(v, cs, sn);
        if (kc0 != nullptr) {
#pragma unroll
            for (int m = 0; m < NR; m++)
                if (lane + 32 * m < head_dim) kc0[h * kc_stride + lane + 32 * m] = f32_to_f16_sat(v[m]);
            continue;
        }
#pragma unroll
        for (int m = 0; m < NR; m++)
            if (lane + 32 * m < head_dim) hp[lane + 32 * m] = v[m];
    }
}

// The f16 KV cache a prefill's k and v go to (qk_norm_rope_kv): this layer's K and V planes at
// layer_off, `capacity` positions a kv head.
struct KvDst {
    const float* v;
    unsigned short* kc;
    unsigned short* vc;
    long long layer_off;
    int capacity;
};

// Warp w takes heads h0 .. h0 + hpw - 1 (fewer at the end) of one row of q (w < rows · ceil(q_heads
// / hpw)) or of k (after them). KV (qk_norm_rope_kv, the register form only: the launcher checks
// it applies): the k warps store their heads into the f16 cache at the row's position instead of
// writing k, and as many warps after them store v's heads there unchanged — kv_store's work (its
// bits: f32_to_f16_sat, positions outside the cache skipped), so no kv_store launch follows.
// TAB (the _tab kernels): the frequencies from a RoPE scaling's table `freq` (rot_dim / 2
// floats) instead of theta^(-2p / rot_dim), as rope_tab.
template <bool KV, bool TAB>
__device__ __forceinline__ void qk_norm_rope_impl(float* __restrict__ q, float* __restrict__ k,
                                                  const float* __restrict__ qw, const float* __restrict__ kw,
                                                  const int* __restrict__ positions, int rows, int q_heads,
                                                  int k_heads, int head_dim, int rot_dim, int neox, float theta,
                                                  float eps, int hpw, KvDst kd,
                                                  const float* __restrict__ freq) {
    long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    const int qg = (q_heads + hpw - 1) / hpw, kg = (k_heads + hpw - 1) / hpw;
    long long nq = (long long)rows * qg;
    long long total = nq + (long long)rows * kg;
    const long long nv_warps = KV ? (long long)rows * kg : 0;
    const float* w = warp < nq ? qw : kw;
    const bool norm = w != nullptr;
    const int half = rot_dim / 2;
    // Before the PDL wait (they depend on no kernel): this lane's norm weights and rotary
    // frequencies, so their loads and powf overlap the previous kernel's tail.
    float wa[QKR_PAIRS], wb[QKR_PAIRS], inv_freq[QKR_PAIRS];
#pragma unroll
    for (int j = 0; j < QKR_PAIRS; j++) {
        const int p = lane + 32 * j;
        wa[j] = wb[j] = 1.f;
        inv_freq[j] = 0.f;
        if (p < half) {
            if (norm && warp < total) {
                wa[j] = w[neox ? p : 2 * p];
                wb[j] = w[neox ? p + half : 2 * p + 1];
            }
            if constexpr (TAB)
                inv_freq[j] = freq[p];
            else
                inv_freq[j] = 1.0f / powf(theta, (float)(2 * p) / (float)rot_dim);
        }
    }
    const int hoff = half / 32;
    const bool regs = neox && half % 32 == 0 && (hoff == 1 || hoff == 2 || hoff == 4) && head_dim % 32 == 0 &&
                      head_dim <= 32 * QKR_REGS;
    float nv[QKR_REGS];  // the register form's norm weights
    if (regs) {
#pragma unroll
        for (int m = 0; m < QKR_REGS; m++) {
            const int i = lane + 32 * m;
            nv[m] = norm && warp < total && i < head_dim ? w[i] : 1.f;
        }
    }
    PDL_ENTRY();
    if constexpr (KV) {
        if (warp >= total && warp < total + nv_warps) {
            // v's heads into the cache (no norm, no rotation): a head's elements on NR registers.
            const long long vw = warp - total;
            const int t = (int)(vw / kg), h0 = (int)(vw % kg) * hpw, nh = min(hpw, k_heads - h0);
            const int p = positions[t];
            if (p < 0 || p >= kd.capacity) return;
            const float* vp = kd.v + ((long long)t * k_heads + h0) * head_dim;
            unsigned short* dst = kd.vc + kd.layer_off + ((long long)h0 * kd.capacity + p) * head_dim;
            for (int h = 0; h < nh; h++)
                for (int i = lane; i < head_dim; i += 32)
                    dst[(long long)h * kd.capacity * head_dim + i] = f32_to_f16_sat(vp[(long long)h * head_dim + i]);
            return;
        }
    }
    if (warp >= total) return;  // warp-uniform: blockDim is a multiple of 32
    float* hp0;
    int t, nh;
    unsigned short* kc0 = nullptr;
    if (warp < nq) {
        t = (int)(warp / qg);
        const int h0 = (int)(warp % qg) * hpw;
        nh = min(hpw, q_heads - h0);
        hp0 = q + ((long long)t * q_heads + h0) * head_dim;
    } else {
        const long long kw_ = warp - nq;
        t = (int)(kw_ / kg);
        const int h0 = (int)(kw_ % kg) * hpw;
        nh = min(hpw, k_heads - h0);
        hp0 = k + ((long long)t * k_heads + h0) * head_dim;
        if constexpr (KV) {
            const int p = positions[t];
            if (p < 0 || p >= kd.capacity) return;  // kv_store skips them too
            kc0 = kd.kc + kd.layer_off + ((long long)h0 * kd.capacity + p) * head_dim;
        }
    }
    const float pos = (float)positions[t];
    if (regs) {
        float cs[QKR_PAIRS], sn[QKR_PAIRS];
        if (hoff == 1)
            qkr_angles<1>(cs, sn, inv_freq, pos);
        else if (hoff == 2)
            qkr_angles<2>(cs, sn, inv_freq, pos);
        else
            qkr_angles<4>(cs, sn, inv_freq, pos);
        // Heads of at most 128 elements on four registers a lane, else eight.
        const long long kc_stride = (long long)kd.capacity * head_dim;
        if (head_dim <= 128)
            qkr_heads<4>(hp0, nh, head_dim, hoff, norm, nv, cs, sn, eps, lane, kc0, kc_stride);
        else
            qkr_heads<QKR_REGS>(hp0, nh, head_dim, hoff, norm, nv, cs, sn, eps, lane, kc0, kc_stride);
        return;
    }
    if constexpr (KV) return;  // the launcher takes the KV form only where the register form runs
#pragma unroll 1
    for (int h = 0; h < nh; h++) {
        float* hp = hp0 + (long long)h * head_dim;
        float scale = 1.f;
        if (norm) {
            float ss = 0.f;
            for (int i = lane; i < head_dim; i += 32) ss += hp[i] * hp[i];
            ss = warp_sum(ss);
            scale = rsqrtf(ss / (float)head_dim + eps);
        }
#pragma unroll
        for (int j = 0; j < QKR_PAIRS; j++) {
            const int p = lane + 32 * j;
            if (p >= half) break;
            int ia = neox ? p : 2 * p;
            int ib = neox ? p + half : 2 * p + 1;
            float x0 = hp[ia], x1 = hp[ib];
            if (norm) {
                x0 = (x0 * scale) * wa[j];
                x1 = (x1 * scale) * wb[j];
            }
            float a = pos * inv_freq[j];
            float c = cosf(a), s = sinf(a);
            hp[ia] = x0 * c - x1 * s;
            hp[ib] = x0 * s + x1 * c;
        }
        if (norm)
            for (int i = rot_dim + lane; i < head_dim; i += 32) hp[i] = (hp[i] * scale) * w[i];
    }
}

extern "C" __global__ void __launch_bounds__(256, 4) qk_norm_rope(float* __restrict__ q, float* __restrict__ k,
                                        const float* __restrict__ qw, const float* __restrict__ kw,
                                        const int* __restrict__ positions, int rows, int q_heads,
                                        int k_heads, int head_dim, int rot_dim, int neox,
                                        float theta, float eps, int hpw) {
    qk_norm_rope_impl<false, false>(q, k, qw, kw, positions, rows, q_heads, k_heads, head_dim, rot_dim, neox, theta,
                                    eps, hpw, KvDst{}, nullptr);
}

// qk_norm_rope whose k and v go straight to the f16 cache (KV above; ops.rs qk_norm_rope_kv).
extern "C" __global__ void __launch_bounds__(256, 4) qk_norm_rope_kv(float* __restrict__ q, float* __restrict__ k,
                                        const float* __restrict__ qw, const float* __restrict__ kw,
                                        const int* __restrict__ positions, int rows, int q_heads,
                                        int k_heads, int head_dim, int rot_dim, int neox,
                                        float theta, float eps, int hpw, KvDst kd) {
    qk_norm_rope_impl<true, false>(q, k, qw, kw, positions, rows, q_heads, k_heads, head_dim, rot_dim, neox, theta,
                                   eps, hpw, kd, nullptr);
}

// The two above with a RoPE scaling's frequency table (TAB): theta's place holds `freq`.
extern "C" __global__ void __launch_bounds__(256, 4) qk_norm_rope_tab(float* __restrict__ q, float* __restrict__ k,
                                        const float* __restrict__ qw, const float* __restrict__ kw,
                                        const int* __restrict__ positions, int rows, int q_heads,
                                        int k_heads, int head_dim, int rot_dim, int neox,
                                        const float* __restrict__ freq, float eps, int hpw) {
    qk_norm_rope_impl<false, true>(q, k, qw, kw, positions, rows, q_heads, k_heads, head_dim, rot_dim, neox, 0.f,
                                   eps, hpw, KvDst{}, freq);
}
extern "C" __global__ void __launch_bounds__(256, 4) qk_norm_rope_kv_tab(float* __restrict__ q, float* __restrict__ k,
                                        const float* __restrict__ qw, const float* __restrict__ kw,
                                        const int* __restrict__ positions, int rows, int q_heads,
                                        int k_heads, int head_dim, int rot_dim, int neox,
                                        const float* __restrict__ freq, float eps, int hpw, KvDst kd) {
    qk_norm_rope_impl<true, true>(q, k, qw, kw, positions, rows, q_heads, k_heads, head_dim, rot_dim, neox, 0.f,
                                  eps, hpw, kd, freq);
}

extern "C" __global__ void add_assign(float* __restrict__ x, const float* __restrict__ y, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void swiglu(const float* __restrict__ g, const float* __restrict__ u,
                                  float* __restrict__ out, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = swiglu_f(g[i], u[i]);
    }
}

// Total order of (value, index): a before b when a is larger, ties to the lower index.
__device__ __forceinline__ bool tk_before(float av, int ai, float bv, int bi) {
    return av > bv || (av == bv && ai < bi);
}

extern "C" __global__ void topk_rows(const float* __restrict__ logits, int* __restrict__ ids,
                                     float* __restrict__ vals, int cols, int k) {
    PDL_ENTRY();
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    const float NEG_INF = __int_as_float(0xff800000);
    const float* row = logits + (long long)blockIdx.x * cols;
    float prev_v = __int_as_float(0x7f800000);  // +inf: everything is after it
    int prev_i = -1;
    for (int j = 0; j < k; ++j) {
        float best = NEG_INF;
        int idx = 0x7fffffff;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            float v = row[i];
            if (v != v) v = NEG_INF;
            // Candidates come strictly after the previous pick in the order.
            if (tk_before(prev_v, prev_i, v, i) && tk_before(v, i, best, idx)) { best = v; idx = i; }
        }
        bv[threadIdx.x] = best;
        bi[threadIdx.x] = idx;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s && tk_before(bv[threadIdx.x + s], bi[threadIdx.x + s], bv[threadIdx.x], bi[threadIdx.x])) {
                bv[threadIdx.x] = bv[threadIdx.x + s];
                bi[threadIdx.x] = bi[threadIdx.x + s];
            }
            __syncthreads();
        }
        prev_v = bv[0];
        prev_i = bi[0];
        if (threadIdx.x == 0) {
            int id = prev_i == 0x7fffffff ? 0 : prev_i;
            ids[(long long)blockIdx.x * k + j] = id;
            vals[(long long)blockIdx.x * k + j] = row[id];
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------
// Vectorised row norms (plan in the header).

#define NORM_NV 4

// The two-plane quantization of quant_q8_lane for 4 consecutive values per lane, a 32-element
// block spread over 8 consecutive lanes (lane & 7 = chunk within the block). Every lane of the
// warp must call it (shuffles); lanes with valid == false hold zeros and store nothing (a
// block's 8 lanes are all valid or all not: the row length is a multiple of 32).
__device__ __forceinline__ void quant_q8_vec4(const float (&v)[4], bool valid, int8_t* __restrict__ xr, int n_in,
                                              int col, float2* __restrict__ xd) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    int hi[4] = {0, 0, 0, 0}, lo[4] = {0, 0, 0, 0};
    float d = 0.0f;
    if (amax > 0.0f) {
        const float d1 = amax / 127.0f;
        d = d1 / 127.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            hi[k] = (int)rintf(v[k] * (127.0f / amax));
            int l = (int)rintf((v[k] - (float)hi[k] * d1) / d);
            lo[k] = l > 127 ? 127 : (l < -127 ? -127 : l);
        }
    }
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) sum += 127 * hi[k] + lo[k];
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (valid) {
        const uint32_t h4 = (uint32_t)(hi[0] & 255) | ((uint32_t)(hi[1] & 255) << 8) | ((uint32_t)(hi[2] & 255) << 16) |
                            ((uint32_t)(hi[3] & 255) << 24);
        const uint32_t l4 = (uint32_t)(lo[0] & 255) | ((uint32_t)(lo[1] & 255) << 8) | ((uint32_t)(lo[2] & 255) << 16) |
                            ((uint32_t)(lo[3] & 255) << 24);
        *(uint32_t*)(xr + col) = h4;  // col % 4 == 0 and the row base is 2·n_in-aligned
        *(uint32_t*)(xr + n_in + col) = l4;
        if ((threadIdx.x & 7) == 0) *xd = make_float2(d, d * (float)sum);
    }
}

// The row's 1 / rms from each thread's sum of squares ss: the warp butterfly, the warp totals
// in `partial`, one barrier, then every thread adds them in warp order. The order of the
// vectorised norms, which add_rms_norm_gemv_f32 repeats for the same bits.
__device__ __forceinline__ float norm_scale(float ss, float* partial, int cols, float eps) {
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    ss = warp_sum(ss);
    if (lane == 0) partial[wid] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < nw; i++) tot += partial[i];
    return rsqrtf(tot / (float)cols + eps);
}

// h = rms_norm(x (+ y)) · w for row blockIdx.x; ADD also stores x + y into x. xq / xd as in
// add_rms_norm (null: no quantization). X16 (a prefill's hand-over to the matmuls that read h
// next, ops.rs add_rms_norm): h also as 16-bit rows of `cols` into xb, 1 bf16 (pack_bf16), 2 f16
// (pack_f16_sat) — the rounding of the prefill's x conversion (mm_decode.cuh x_scratch16), so
// the matmuls read the bits the conversion would have written. In the X16 forms h may be null:
// every reader of h takes the 16-bit rows (ops.rs `x16_only`), and the f32 rows (a third of
// the launch's bytes at a 4096-column prefill row after an add) are not written.
template <bool ADD, int X16 = 0>
__device__ __forceinline__ void norm_row_v4(float* __restrict__ x, const float* __restrict__ y,
                                            const float* __restrict__ w, float* __restrict__ h, int cols,
                                            float eps, int8_t* __restrict__ xq, float2* __restrict__ xd,
                                            uint16_t* __restrict__ xb = nullptr) {
    __shared__ float partial[32];
    const int chunks = cols >> 2;
    const int tid = threadIdx.x;
    const long long r = blockIdx.x;
    float4 wv[NORM_NV], v[NORM_NV];
#pragma unroll
    for (int j = 0; j < NORM_NV; j++) {
        const int c = tid + j * blockDim.x;
        wv[j] = c < chunks ? __ldg((const float4*)w + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    PDL_ENTRY();
    float4* xr = (float4*)(x + r * cols);
    const float4* yr = (const float4*)(y + r * cols);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_NV; j++) {
        const int c = tid + j * blockDim.x;
        v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < chunks) {
            float4 a = xr[c];
            if (ADD) {
                const float4 b = yr[c];
                a.x += b.x;
                a.y += b.y;
                a.z += b.z;
                a.w += b.w;
                xr[c] = a;
            }
            v[j] = a;
        }
    }
#pragma unroll
    for (int j = 0; j < NORM_NV; j++) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    const float scale = norm_scale(ss, partial, cols, eps);
    float4* hr = (float4*)(h + r * cols);
#pragma unroll
    for (int j = 0; j < NORM_NV; j++) {
        const int c = tid + j * blockDim.x;
        if (j * blockDim.x >= chunks) break;  // block-uniform
        const bool valid = c < chunks;
        const float o[4] = {(v[j].x * scale) * wv[j].x, (v[j].y * scale) * wv[j].y, (v[j].z * scale) * wv[j].z,
                            (v[j].w * scale) * wv[j].w};
        if (valid && (!X16 || h != nullptr)) hr[c] = make_float4(o[0], o[1], o[2], o[3]);
        if (X16 && valid)
            *reinterpret_cast<uint2*>(xb + r * cols + 4 * c) =
                X16 == 2 ? make_uint2(pack_f16_sat(o[0], o[1]), pack_f16_sat(o[2], o[3]))
                         : make_uint2(pack_bf16(o[0], o[1]), pack_bf16(o[2], o[3]));
        if (xq != nullptr)
            quant_q8_vec4(o, valid, xq + r * 2 * cols, cols, 4 * c, xd + r * (cols / QK) + (4 * c) / QK);
    }
}

extern "C" __global__ void add_rms_norm_v4(float* __restrict__ x, const float* __restrict__ y,
                                           const float* __restrict__ w, float* __restrict__ h, int cols, float eps,
                                           int8_t* __restrict__ xq, float2* __restrict__ xd) {
    norm_row_v4<true>(x, y, w, h, cols, eps, xq, xd);
}

// add_rms_norm_v4 handing h over to a prefill's matmuls as their bf16 / f16 x (X16 above).
extern "C" __global__ void add_rms_norm_v4_xbf16(float* __restrict__ x, const float* __restrict__ y,
                                                 const float* __restrict__ w, float* __restrict__ h, int cols,
                                                 float eps, uint16_t* __restrict__ xb) {
    norm_row_v4<true, 1>(x, y, w, h, cols, eps, nullptr, nullptr, xb);
}
extern "C" __global__ void add_rms_norm_v4_xf16(float* __restrict__ x, const float* __restrict__ y,
                                                const float* __restrict__ w, float* __restrict__ h, int cols,
                                                float eps, uint16_t* __restrict__ xb) {
    norm_row_v4<true, 2>(x, y, w, h, cols, eps, nullptr, nullptr, xb);
}

// rms_norm_v4 handing h over to a prefill's matmuls as their bf16 / f16 x (X16 above): the
// norm after a projection that added the residual in its own epilogue (ops.rs rms_norm).
extern "C" __global__ void rms_norm_v4_xbf16(const float* __restrict__ x, const float* __restrict__ w,
                                             float* __restrict__ out, int cols, float eps, uint16_t* __restrict__ xb) {
    norm_row_v4<false, 1>(const_cast<float*>(x), nullptr, w, out, cols, eps, nullptr, nullptr, xb);
}
extern "C" __global__ void rms_norm_v4_xf16(const float* __restrict__ x, const float* __restrict__ w,
                                            float* __restrict__ out, int cols, float eps, uint16_t* __restrict__ xb) {
    norm_row_v4<false, 2>(const_cast<float*>(x), nullptr, w, out, cols, eps, nullptr, nullptr, xb);
}

extern "C" __global__ void rms_norm_v4(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ out, int cols, float eps, int8_t* __restrict__ xq,
                                       float2* __restrict__ xd) {
    norm_row_v4<false>(const_cast<float*>(x), nullptr, w, out, cols, eps, xq, xd);
}

// ---------------------------------------------------------------------------------------
// add_rms_norm_gemv_f32: a MoE block's input and its router at one decode row, one launch
// (Backend::add_rms_norm_matmul; ops.rs).
//
// Why: at decode the MoE half of a layer was a chain add_rms_norm_v4 (one block) → router
// GEMV (f32, 128-256 outputs, 1-2 MB) → experts, each a dependent phase (~2.8 and ~2.3 µs
// added per layer in the Qwen3-30B-A3B trace, DECODE_STEP.md). Unlike the RMSNorm before
// the QKV projections (whose window hides the QKV tile copies; folding it in lost, e91fa81),
// the norm before a router hides nothing: the router's 1-2 MB land in L2 before its wait
// anyway, and the experts cannot copy before they know their routing.
//
// Plan: blocks of T = the norm's own thread count for the row (one float4 chunk per
// thread: chunks <= 1024, the launcher checks), so every block computes the row's sum of
// squares in add_rms_norm_v4's order (one chunk per thread, warp butterfly, warp partials
// added in warp order by every thread) and h = rms_norm(x + y) · w bitwise as that kernel
// does, into shared memory. Block b owns chunks [b·per, (b+1)·per) (per a multiple of 8
// chunks: whole 32-element blocks) and stores their sum x_out = x + y (out of place: the
// other blocks still read x), h, and h's int8 planes (quant_q8_vec4, where xq != null).
// Then the block's T / 32 warps are the router's row groups exactly as in matmul.cu's
// gemv<GGML_F32, 1> (GEMV_NW = 2 rows per group, ks warps splitting the float4 steps of a
// row: lane chains, xor butterfly, the ks warp totals in warp order), so the logits are the
// unfused GEMV's bits too, with x read from shared memory. Before the PDL wait the block's
// norm weights are loaded and its router rows prefetched into L2 (as the small-output
// GEMV's mode-2 prologue). Reads per block: x, y (2 · 4 · cols bytes from L2) and its rows.
//
// PRE (add_rms_norm_gemv_f32_pre, the default; FERRITE_ROUTER_PRE=0 takes the other): each
// lane's router weights for its first NG_PRE loop steps are loaded into registers before the
// PDL wait, instead of from L2 after the norm: the weights depend on no launch, and read
// after the norm they are one more L2 round trip on the chain between the o-projection and
// the experts (Qwen3-30B-A3B: 2048 columns, ks = 8, two steps per lane, so the whole router;
// the prefetch is then left out). The same FMAs in the same order: the same bits. MOE.md,
// "The router's weights before the PDL wait".
#define NG_NW 2   // rows per row group: matmul.cu's GEMV_NW
#define NG_PRE 4  // PRE: loop steps per lane whose weights are loaded before the wait

template <bool PRE>
__device__ __forceinline__ void add_rms_norm_gemv_f32_impl(
    const float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
    float* __restrict__ x_out, float* __restrict__ h, int cols, float eps, int8_t* __restrict__ xq,
    float2* __restrict__ xd, const float* __restrict__ W, int n_out, int ks, float* __restrict__ out) {
    extern __shared__ float4 hs[];  // h, cols / 4 chunks
    __shared__ float partial[32];
    __shared__ float red[32][NG_NW];
    const int chunks = cols >> 2;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    const int c = tid;  // this thread's chunk (blockDim >= chunks)
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 wv = c < chunks ? __ldg((const float4*)w + c) : zero;
    const int gpb = nw / ks;  // row groups per block
    const int grp = wid / ks, kw = wid % ks;
    const int o0 = (blockIdx.x * gpb + grp) * NG_NW;
    constexpr int NP = PRE ? NG_PRE : 0;
    float4 pa[PRE ? NG_PRE : 1][NG_NW];
    if constexpr (PRE) {
        if (o0 < n_out) {  // whole warp
#pragma unroll
            for (int r = 0; r < NG_NW; r++) {
                const float4* wr = (const float4*)(W + (size_t)min(o0 + r, n_out - 1) * cols);
#pragma unroll
                for (int j = 0; j < NG_PRE; j++) {
                    const int i = lane + 32 * kw + j * 32 * ks;
                    pa[j][r] = i < chunks ? __ldcs(wr + i) : zero;
                }
            }
        }
    }
#if __CUDA_ARCH__ >= 900
    if (!PRE || NP * 32 * ks < chunks) {
        const int r0 = blockIdx.x * gpb * NG_NW, r1 = min(r0 + gpb * NG_NW, n_out);
        const size_t a0 = (size_t)(W + (size_t)r0 * cols) & ~(size_t)127;
        const size_t a1 = (size_t)(W + (size_t)r1 * cols);
        for (size_t a = a0 + 128 * (size_t)tid; a < a1; a += 128 * (size_t)blockDim.x)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
    }
#endif
    PDL_ENTRY();
    // The norm, as norm_row_v4<true> for one chunk per thread.
    float4 v = zero;
    if (c < chunks) {
        v = ((const float4*)x)[c];
        const float4 b = ((const float4*)y)[c];
        v.x += b.x;
        v.y += b.y;
        v.z += b.z;
        v.w += b.w;
    }
    float ss = 0.f;
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    const float scale = norm_scale(ss, partial, cols, eps);
    const float o[4] = {(v.x * scale) * wv.x, (v.y * scale) * wv.y, (v.z * scale) * wv.z, (v.w * scale) * wv.w};
    if (c < chunks) hs[c] = make_float4(o[0], o[1], o[2], o[3]);
    const int per = (((chunks + (int)gridDim.x - 1) / (int)gridDim.x) + 7) & ~7;
    const bool own = c < chunks && c >= (int)blockIdx.x * per && c < ((int)blockIdx.x + 1) * per;
    if (own) {
        ((float4*)x_out)[c] = v;
        ((float4*)h)[c] = make_float4(o[0], o[1], o[2], o[3]);
    }
    if (xq != nullptr) quant_q8_vec4(o, own, xq, cols, 4 * c, xd + (4 * c) / QK);
    __syncthreads();
    // The router rows, as gemv<GGML_F32, 1> (matmul.cu) with x = hs.
    float acc[NG_NW] = {0.f, 0.f};
    const bool active = o0 < n_out;  // whole warp
    if (active) {
        const float4* wr[NG_NW];
#pragma unroll
        for (int r = 0; r < NG_NW; r++) wr[r] = (const float4*)(W + (size_t)min(o0 + r, n_out - 1) * cols);
        if constexpr (PRE) {
#pragma unroll
            for (int j = 0; j < NG_PRE; j++) {
                const int i = lane + 32 * kw + j * 32 * ks;
                if (i < chunks) {
                    const float4 xv = hs[i];
#pragma unroll
                    for (int r = 0; r < NG_NW; r++) {
                        acc[r] = fmaf(pa[j][r].x, xv.x, acc[r]);
                        acc[r] = fmaf(pa[j][r].y, xv.y, acc[r]);
                        acc[r] = fmaf(pa[j][r].z, xv.z, acc[r]);
                        acc[r] = fmaf(pa[j][r].w, xv.w, acc[r]);
                    }
                }
            }
        }
#pragma unroll 8
        for (int i = lane + 32 * kw + NP * 32 * ks; i < chunks; i += 32 * ks) {
            float4 a[NG_NW];
#pragma unroll
            for (int r = 0; r < NG_NW; r++) a[r] = __ldcs(wr[r] + i);
            const float4 xv = hs[i];
#pragma unroll
            for (int r = 0; r < NG_NW; r++) {
                acc[r] = fmaf(a[r].x, xv.x, acc[r]);
                acc[r] = fmaf(a[r].y, xv.y, acc[r]);
                acc[r] = fmaf(a[r].z, xv.z, acc[r]);
                acc[r] = fmaf(a[r].w, xv.w, acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < NG_NW; r++) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
        }
    }
    if (ks == 1) {  // uniform over the block
#pragma unroll
        for (int r = 0; r < NG_NW; r++)
            if (active && lane == r && o0 + r < n_out) out[o0 + r] = acc[r];
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < NG_NW; r++) red[wid][r] = acc[r];
    }
    __syncthreads();
    if (active && kw == 0 && lane < NG_NW) {
        float s = red[wid][lane];
        for (int k = 1; k < ks; k++) s += red[wid + k][lane];
        if (o0 + lane < n_out) out[o0 + lane] = s;
    }
}

#define ADD_RMS_NORM_GEMV_ARGS                                                                          \
    const float *__restrict__ x, const float *__restrict__ y, const float *__restrict__ w,             \
        float *__restrict__ x_out, float *__restrict__ h, int cols, float eps, int8_t *__restrict__ xq, \
        float2 *__restrict__ xd, const float *__restrict__ W, int n_out, int ks, float *__restrict__ out
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_gemv_f32(ADD_RMS_NORM_GEMV_ARGS) {
    add_rms_norm_gemv_f32_impl<false>(x, y, w, x_out, h, cols, eps, xq, xd, W, n_out, ks, out);
}
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_gemv_f32_pre(ADD_RMS_NORM_GEMV_ARGS) {
    add_rms_norm_gemv_f32_impl<true>(x, y, w, x_out, h, cols, eps, xq, xd, W, n_out, ks, out);
}

// ---------------------------------------------------------------------------------------
// Multi-block argmax (plan in the header).

// Float bits mapped so that unsigned order is float order (for non-NaN values).
__device__ __forceinline__ uint32_t ord_bits(float f) {
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// FEED (argmax_feed, one row; Backend::argmax_feed): the last block also feeds the token to the
// next decode step on the device: tokens[0] = it, positions[0] += 1, log[new position % log_len]
// = it (the host reads the log when it wants the tokens; the next step is a graph launched
// after this one, so it finds them written).
template <bool FEED>
__device__ __forceinline__ void argmax_rows_mb_impl(const float* __restrict__ logits, int* __restrict__ out,
                                                    int cols, unsigned long long* __restrict__ best,
                                                    unsigned int* __restrict__ ticket, int* __restrict__ tokens,
                                                    int* __restrict__ positions, int* __restrict__ log, int log_len) {
    PDL_ENTRY();
    __shared__ unsigned long long wbest[32];
    const int row = blockIdx.y;
    const float* rp = logits + (long long)row * cols;
    const int per = (cols + gridDim.x - 1) / gridDim.x;
    const int a = blockIdx.x * per;
    const int b = a + per < cols ? a + per : cols;
    float bv = __int_as_float(0xff800000);  // -inf
    int bi = -1;
    for (int i = a + threadIdx.x; i < b; i += blockDim.x) {
        const float v = rp[i];
        if (v > bv) {  // ascending per thread: the first of equal maxima
            bv = v;
            bi = i;
        }
    }
    unsigned long long key = bi < 0 ? 0ull : ((unsigned long long)ord_bits(bv) << 32) | (unsigned long long)(~(uint32_t)bi);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned long long o = __shfl_xor_sync(0xffffffffu, key, off);
        key = o > key ? o : key;
    }
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) wbest[wid] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < nw; i++) key = wbest[i] > key ? wbest[i] : key;
        if (key) atomicMax(best + row, key);
        __threadfence();
        const unsigned int t = atomicAdd(ticket + row, 1u);
        if (t == gridDim.x - 1) {  // every block's atomicMax is done (each fenced before its ticket)
            const unsigned long long k = atomicMax(best + row, 0ull);
            const int id = k ? (int)(~(uint32_t)(k & 0xffffffffull)) : 0;
            out[row] = id;
            best[row] = 0ull;
            ticket[row] = 0u;
            if (FEED) {
                const int p = positions[0] + 1;
                tokens[0] = id;
                positions[0] = p;
                log[p % log_len] = id;
            }
        }
    }
}
extern "C" __global__ void argmax_rows_mb(const float* __restrict__ logits, int* __restrict__ out, int cols,
                                          unsigned long long* __restrict__ best, unsigned int* __restrict__ ticket) {
    argmax_rows_mb_impl<false>(logits, out, cols, best, ticket, nullptr, nullptr, nullptr, 1);
}
extern "C" __global__ void argmax_feed(const float* __restrict__ logits, int* __restrict__ out, int cols,
                                       unsigned long long* __restrict__ best, unsigned int* __restrict__ ticket,
                                       int* __restrict__ tokens, int* __restrict__ positions, int* __restrict__ log,
                                       int log_len) {
    argmax_rows_mb_impl<true>(logits, out, cols, best, ticket, tokens, positions, log, log_len);
}
