// moe.cu — mixture-of-experts SwiGLU FFN: routing, expert gate/up, expert down + combine.
//
// Semantics are the CPU reference's (cpu.rs `moe`, `route_top_k`): per token, softmax over
// all n_experts router logits → top-k by probability (ties to the lower expert id) →
// optional renormalisation of the k weights → out[t] = Σ_k w_k · down_e(silu(gate_e x) * up_e x),
// the k terms added in top-k order starting from 0.
//
// Three launches per MoE layer, every one of them reading the routing from device memory,
// so one captured decode graph is valid for any routing (the host never learns which
// experts were chosen):
//
// 1. moe_route: one warp per token. Max (warp shuffle), exps into shared memory, their sum
//    (lane-strided partials + xor butterfly: ulp-level differences from the CPU's order), then top_k rounds of a warp-wide
//    arg-max over (probability desc, id asc) by two redux.sync; the winner is marked taken (-1
//    in shared memory). Lane 0 writes (id, p/sum) per slot and renormalises if asked. A token's
//    routing depends only on its own logits (batch-invariant). Bytes: rows·n_experts·4 in,
//    rows·top_k·8 out.
// 2. moe_gate_up: one warp per (token, slot, ffn row): reads the expert id of its slot,
//    computes the gate row · x_t and the up row · x_t (both from the stored ggml blocks),
//    writes silu(g)·u into the scratch h[rows·top_k, ffn]. Blocks of 8 warps cover 8
//    consecutive ffn rows of one (token, slot), so neighbouring blocks stream neighbouring
//    rows of the same expert. Bytes at decode: top_k·2·ffn·hidden·(bytes/weight), e.g.
//    Qwen3-30B-A3B Q4_K: 8·2·768·2048·0.5625 B ≈ 14.2 MB per layer.
// 3. moe_down: one warp per (token, slot, hidden row) computes the down row of expert
//    ids[t,k] · h[t,k]; a block holds every slot of its rows, so the combine is fused: the
//    slot results meet in shared memory and one thread per row adds w_k·d_k for k in top-k
//    order (no FMA contraction, like the CPU). No [rows, top_k, hidden] scratch, no fourth
//    launch, the same summation order as a separate combine kernel. Bytes at decode:
//    top_k·hidden·ffn·bpw (≈ 7.1 MB per layer for the example above).
//
// Row dot products, one warp per row (each lane sums a strided share, then a shuffle
// reduction). Decoders per stored type, each equal to common.cuh's ggml_get element by
// element:
// - Q8_0 (34 B blocks, 2-byte aligned): 8 lanes per block, 4 quants per lane read as two
//   u16; 4 blocks per warp step.
// - Q4_K (144 B blocks: 16-byte aligned whenever the tensor base is, since 144 = 9·16):
//   16 lanes per block, 8 quant bytes per lane as one 8-byte load (low nibbles: sub-block
//   2g, high nibbles: sub-block 2g+1); 2 blocks per warp step.
// - Q6_K (210 B blocks, 2-byte aligned): 16 lanes per block; a lane takes 4 consecutive
//   l of one half n and produces the 4 quarters (16 weights) from 4+4 ql bytes and 4 qh
//   bytes (u16 loads); 2 blocks per warp step.
// - F16 / BF16 with n_in % 8 == 0 and a 16-byte aligned base: 8 weights per 16-byte load.
// - everything else (F32, Q4_0, Q4_1, Q5_K, odd rows): ggml_get per element (slow, exact).
// The activations (x rows, h rows) are 16-byte aligned whenever the row length is a
// multiple of 4 floats, which the fast paths require (block sizes 32/256, F16 n % 8).
//
// Prefill (many rows) uses the same kernels: each (token, slot) re-reads its expert's rows,
// mostly from L2. Correct, but far from a grouped GEMM; the planned optimisation is a
// grouped expert GEMM over tokens sorted by expert (device-side histogram + offsets, so it
// stays graph-safe), reading quantized tiles directly.

#define MOE_WARPS 8

__device__ __forceinline__ void scale_min_w(int j, uint32_t s0, uint32_t s1, uint32_t s2, float* sc, float* m);

__device__ __forceinline__ float moe_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// 4 bytes at a 2-byte aligned address.
__device__ __forceinline__ unsigned int ld_u32_a2(const uint8_t* p) {
    const unsigned short* s = (const unsigned short*)p;
    return (unsigned int)s[0] | ((unsigned int)s[1] << 16);
}

__device__ __forceinline__ float f16_at_a2(const uint8_t* p) {
    return __half2float(__ushort_as_half(*(const unsigned short*)p));
}

__device__ __forceinline__ float dot4(float4 x, float a, float b, float c, float d) {
    return x.x * a + x.y * b + x.z * c + x.w * d;
}

// ---------------------------------------------------------------- per-type lane partials

__device__ float part_generic(const uint8_t* row, int type, const float* x, int n, int lane) {
    float acc = 0.f;
    for (int i = lane; i < n; i += 32) acc += ggml_get(row, type, i) * x[i];
    return acc;
}

__device__ float part_q8_0(const uint8_t* row, const float* x, int n, int lane) {
    const int nb = n / QK;
    const int sub = lane & 7;
    float acc = 0.f;
    for (int b = lane >> 3; b < nb; b += 4) {
        const uint8_t* blk = row + (size_t)b * Q8_0_BYTES;
        const float d = f16_at_a2(blk);
        const unsigned int q = ld_u32_a2(blk + 2 + 4 * sub);
        const float4 xv = *(const float4*)(x + (size_t)b * QK + 4 * sub);
        const float s = dot4(xv, (float)(int8_t)(q & 0xff), (float)(int8_t)((q >> 8) & 0xff),
                             (float)(int8_t)((q >> 16) & 0xff), (float)(int8_t)(q >> 24));
        acc += d * s;
    }
    return acc;
}

// Requires the row to start 16-byte aligned.
__device__ float part_q4_k(const uint8_t* row, const float* x, int n, int lane) {
    const int nb = n / QK_K;
    const int l16 = lane & 15;
    const int g = l16 >> 2;         // 64-weight group 0..3
    const int l0 = (l16 & 3) * 8;   // first of 8 bytes within the group's 32
    float acc = 0.f;
    for (int b = lane >> 4; b < nb; b += 2) {
        const uint8_t* blk = row + (size_t)b * Q4_K_BYTES;
        const float d = f16_at_a2(blk), dmin = f16_at_a2(blk + 2);
        float sc0, m0, sc1, m1;
        scale_min_k4(2 * g, blk + 4, &sc0, &m0);
        scale_min_k4(2 * g + 1, blk + 4, &sc1, &m1);
        const uint2 q = *(const uint2*)(blk + 16 + g * 32 + l0);
        const float* xb = x + (size_t)b * QK_K + g * 64 + l0;
        const float4 xa = *(const float4*)xb, xb4 = *(const float4*)(xb + 4);
        const float4 xc = *(const float4*)(xb + 32), xd = *(const float4*)(xb + 36);
        const unsigned int w0 = q.x, w1 = q.y;
        float slo = dot4(xa, (float)(w0 & 0xF), (float)((w0 >> 8) & 0xF), (float)((w0 >> 16) & 0xF),
                         (float)((w0 >> 24) & 0xF)) +
                    dot4(xb4, (float)(w1 & 0xF), (float)((w1 >> 8) & 0xF), (float)((w1 >> 16) & 0xF),
                         (float)((w1 >> 24) & 0xF));
        float shi = dot4(xc, (float)((w0 >> 4) & 0xF), (float)((w0 >> 12) & 0xF), (float)((w0 >> 20) & 0xF),
                         (float)(w0 >> 28)) +
                    dot4(xd, (float)((w1 >> 4) & 0xF), (float)((w1 >> 12) & 0xF), (float)((w1 >> 20) & 0xF),
                         (float)(w1 >> 28));
        float xlo = xa.x + xa.y + xa.z + xa.w + xb4.x + xb4.y + xb4.z + xb4.w;
        float xhi = xc.x + xc.y + xc.z + xc.w + xd.x + xd.y + xd.z + xd.w;
        acc += d * sc0 * slo - dmin * m0 * xlo + d * sc1 * shi - dmin * m1 * xhi;
    }
    return acc;
}

__device__ float part_q6_k(const uint8_t* row, const float* x, int n, int lane) {
    const int nb = n / QK_K;
    const int l16 = lane & 15;
    const int h = l16 >> 3;         // half of the block (128 weights)
    const int l0 = (l16 & 7) * 4;   // first of 4 consecutive l in 0..31
    float acc = 0.f;
    for (int b = lane >> 4; b < nb; b += 2) {
        const uint8_t* blk = row + (size_t)b * Q6_K_BYTES;
        const unsigned int ql0 = ld_u32_a2(blk + 64 * h + l0);
        const unsigned int ql1 = ld_u32_a2(blk + 64 * h + 32 + l0);
        const unsigned int qh = ld_u32_a2(blk + 128 + 32 * h + l0);
        const int8_t* sc = (const int8_t*)(blk + 192 + 8 * h + l0 / 16);
        const float d = f16_at_a2(blk + 208);
        const float* xb = x + (size_t)b * QK_K + 128 * h + l0;
        float s[4];
#pragma unroll
        for (int qr = 0; qr < 4; ++qr) {
            const unsigned int lo = (qr & 1) ? ql1 : ql0;
            const int shift_lo = (qr >= 2) ? 4 : 0;
            const float4 xv = *(const float4*)(xb + 32 * qr);
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int low = (lo >> (8 * j + shift_lo)) & 0xF;
                int high = (qh >> (8 * j + 2 * qr)) & 3;
                v[j] = (float)((low | (high << 4)) - 32);
            }
            s[qr] = dot4(xv, v[0], v[1], v[2], v[3]);
        }
        acc += d * ((float)sc[0] * s[0] + (float)sc[2] * s[1] + (float)sc[4] * s[2] + (float)sc[6] * s[3]);
    }
    return acc;
}

// Gate and up rows of one Q4_K expert at once (both 16-byte aligned): each x value loaded
// feeds both rows, the 16-byte block header is one (broadcast) load, and the step loop is
// unrolled so a lane has up to 4 steps x 2 rows of loads in flight. Same lane -> element
// mapping as part_q4_k.
__device__ __forceinline__ void part2_q4_k(const uint8_t* ra, const uint8_t* rb, const float* x, int n, int lane,
                                           float* acc_a, float* acc_b) {
    const int nb = n / QK_K;
    const int l16 = lane & 15;
    const int g = l16 >> 2;
    const int l0 = (l16 & 3) * 8;
    float aa = 0.f, ab = 0.f;
#pragma unroll 4
    for (int b = lane >> 4; b < nb; b += 2) {
        const float* xb = x + (size_t)b * QK_K + g * 64 + l0;
        const float4 xa = *(const float4*)xb, xb4 = *(const float4*)(xb + 4);
        const float4 xc = *(const float4*)(xb + 32), xd = *(const float4*)(xb + 36);
        const float xlo = xa.x + xa.y + xa.z + xa.w + xb4.x + xb4.y + xb4.z + xb4.w;
        const float xhi = xc.x + xc.y + xc.z + xc.w + xd.x + xd.y + xd.z + xd.w;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint8_t* blk = (r ? rb : ra) + (size_t)b * Q4_K_BYTES;
            const uint4 hd = __ldcs((const uint4*)blk);
            const uint2 q = __ldcs((const uint2*)(blk + 16 + g * 32 + l0));
            const float d = __half2float(__ushort_as_half((unsigned short)(hd.x & 0xFFFF)));
            const float dmin = __half2float(__ushort_as_half((unsigned short)(hd.x >> 16)));
            float sc0, m0, sc1, m1;
            scale_min_w(2 * g, hd.y, hd.z, hd.w, &sc0, &m0);
            scale_min_w(2 * g + 1, hd.y, hd.z, hd.w, &sc1, &m1);
            const unsigned int w0 = q.x, w1 = q.y;
            const float slo = dot4(xa, (float)(w0 & 0xF), (float)((w0 >> 8) & 0xF), (float)((w0 >> 16) & 0xF),
                                   (float)((w0 >> 24) & 0xF)) +
                              dot4(xb4, (float)(w1 & 0xF), (float)((w1 >> 8) & 0xF), (float)((w1 >> 16) & 0xF),
                                   (float)((w1 >> 24) & 0xF));
            const float shi = dot4(xc, (float)((w0 >> 4) & 0xF), (float)((w0 >> 12) & 0xF),
                                   (float)((w0 >> 20) & 0xF), (float)(w0 >> 28)) +
                              dot4(xd, (float)((w1 >> 4) & 0xF), (float)((w1 >> 12) & 0xF),
                                   (float)((w1 >> 20) & 0xF), (float)(w1 >> 28));
            const float v = d * sc0 * slo - dmin * m0 * xlo + d * sc1 * shi - dmin * m1 * xhi;
            if (r) ab += v; else aa += v;
        }
    }
    *acc_a = aa;
    *acc_b = ab;
}

// F16 / BF16, n % 8 == 0, row 16-byte aligned.
__device__ float part_half8(const uint8_t* row, int bf, const float* x, int n, int lane) {
    const uint4* w = (const uint4*)row;
    const int nv = n / 8;
    float acc = 0.f;
    for (int j = lane; j < nv; j += 32) {
        const uint4 q = w[j];
        const float4 xa = *(const float4*)(x + 8 * (size_t)j), xb = *(const float4*)(x + 8 * (size_t)j + 4);
        unsigned int u[4] = {q.x, q.y, q.z, q.w};
        float f[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (bf) {
                f[2 * k] = __uint_as_float(u[k] << 16);
                f[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
            } else {
                f[2 * k] = __half2float(__ushort_as_half((unsigned short)(u[k] & 0xffff)));
                f[2 * k + 1] = __half2float(__ushort_as_half((unsigned short)(u[k] >> 16)));
            }
        }
        acc += dot4(xa, f[0], f[1], f[2], f[3]) + dot4(xb, f[4], f[5], f[6], f[7]);
    }
    return acc;
}

// Full-warp dot product of one stored row with x (n elements); every lane gets the sum.
// `aligned16`: the weight tensor and the activation buffer start 16-byte aligned (checked on
// the host; always true for cudaMalloc'd buffers). Without it, only the generic path runs.
__device__ __forceinline__ float row_dot(const uint8_t* row, int type, int aligned16, const float* x, int n,
                                         int lane) {
    float p;
    if (!aligned16) p = part_generic(row, type, x, n, lane);
    else if (type == GGML_Q8_0 && n % QK == 0) p = part_q8_0(row, x, n, lane);
    else if (type == GGML_Q4_K && n % QK_K == 0) p = part_q4_k(row, x, n, lane);
    else if (type == GGML_Q6_K && n % QK_K == 0) p = part_q6_k(row, x, n, lane);
    else if ((type == GGML_F16 || type == GGML_BF16) && n % 8 == 0)
        p = part_half8(row, type == GGML_BF16, x, n, lane);
    else p = part_generic(row, type, x, n, lane);
    return moe_warp_sum(p);
}

// ---------------------------------------------------------------- kernels

// One warp (block of 32) per token; dynamic shared memory: n_experts floats.
// The top_k rounds pick by two redux.sync (matmul.cu moe_route_pick's form: the max key, p's bits
// + 1, then the lowest id holding it: the shuffle butterfly's (max p, lowest id) choice), and the
// weights wait in shared memory for the renormalisation, where lane 0 once read them back from
// global memory one dependent load at a time (the launch added ~10 µs a Qwen3-30B-A3B prefill
// layer; this form gained 0.4% of its pp512: MOE.md, 50th session). Same max, exps, sum, choices
// and divisions: the same ids and weights.
#define MOE_ROUTE_TOPK 64
extern "C" __global__ void moe_route(const float* __restrict__ logits, int n_experts, int top_k, int norm,
                                     int* __restrict__ ids, float* __restrict__ wts) {
    PDL_ENTRY();
    extern __shared__ float p[];
    __shared__ float sw[MOE_ROUTE_TOPK];  // top_k <= MOE_ROUTE_TOPK (moe.rs MAX_TOP_K)
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)t * n_experts;
    float mx = __int_as_float(0xff800000);  // -inf
    for (int e = lane; e < n_experts; e += 32) mx = fmaxf(mx, l[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    for (int e = lane; e < n_experts; e += 32) p[e] = expf(l[e] - mx);
    __syncwarp();
    // Lane-strided partial sums, then a fixed xor butterfly (deterministic, per token; a
    // sequential sum by one lane cost ~2 µs per layer at 128 experts).
    float sum = 0.f;
    for (int e = lane; e < n_experts; e += 32) sum += p[e];
    sum = moe_warp_sum(sum);
    int* my_ids = ids + (long long)t * top_k;
    float* my_w = wts + (long long)t * top_k;
    for (int k = 0; k < top_k; ++k) {
        // Each lane's best untaken probability (>= 0; taken ones are -1), ascending e: the
        // lowest id of a tie stays.
        float bv = -2.f;
        int bi = 0x7fffffff;
        for (int e = lane; e < n_experts; e += 32) {
            float v = p[e];
            if (v > bv) { bv = v; bi = e; }
        }
        const unsigned key = bv >= 0.f ? __float_as_uint(bv) + 1u : 0u;
        const unsigned m = __reduce_max_sync(0xffffffffu, key);
        const int win = (int)__reduce_min_sync(0xffffffffu, (key == m && m != 0u) ? (unsigned)bi : 0x7fffffffu);
        if (lane == 0) {
            my_ids[k] = win;
            sw[k] = __uint_as_float(m - 1u) / sum;
            if (win < n_experts) p[win] = -1.f;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float s = 0.f;
        if (norm)
            for (int k = 0; k < top_k; ++k) s += sw[k];
        for (int k = 0; k < top_k; ++k) my_w[k] = norm ? sw[k] / s : sw[k];
    }
}

// Grid: pairs · ceil(ffn / MOE_WARPS) blocks of MOE_WARPS warps; pair = token·top_k + slot.
extern "C" __global__ void moe_gate_up(const float* __restrict__ x, const int* __restrict__ ids,
                                       const uint8_t* __restrict__ gate, int gate_type, long long gate_rb,
                                       int gate_a16, const uint8_t* __restrict__ up, int up_type,
                                       long long up_rb, int up_a16, float* __restrict__ h, int pairs,
                                       int top_k, int hidden, int ffn, int n_experts) {
    PDL_ENTRY();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long chunks = (ffn + MOE_WARPS - 1) / MOE_WARPS;
    const long long pair = (long long)blockIdx.x / chunks;
    const int o = (int)((long long)blockIdx.x % chunks) * MOE_WARPS + warp;
    if (pair >= pairs || o >= ffn) return;  // whole warps only; no block barriers below
    const int e = ids[pair];
    float* dst = h + pair * ffn + o;
    if (e < 0 || e >= n_experts) {  // cannot happen after moe_route; never read out of bounds
        if (lane == 0) *dst = __int_as_float(0x7fc00000);
        return;
    }
    const float* xt = x + (pair / top_k) * (long long)hidden;
    const long long r = (long long)e * ffn + o;
    float g, u;
    if (gate_a16 && up_a16 && gate_type == GGML_Q4_K && up_type == GGML_Q4_K && hidden % QK_K == 0) {
        part2_q4_k(gate + r * gate_rb, up + r * up_rb, xt, hidden, lane, &g, &u);
        g = moe_warp_sum(g);
        u = moe_warp_sum(u);
    } else {
        g = row_dot(gate + r * gate_rb, gate_type, gate_a16, xt, hidden, lane);
        u = row_dot(up + r * up_rb, up_type, up_a16, xt, hidden, lane);
    }
    if (lane == 0) *dst = g / (1.0f + expf(-g)) * u;
}

// A block covers R = rows_per_block consecutive hidden rows of one token (R·top_k items,
// R = max(1, MOE_WARPS / top_k) chosen on the host): item i = (row r = i / top_k, slot
// k = i % top_k), warp w takes items w, w + MOE_WARPS, ... So at top-8 every warp owns one
// (slot, row) dot product: rows·top_k·hidden warps in flight at decode instead of
// rows·hidden. The partial results meet in shared memory and thread r adds row r's slots
// in top-k order. Grid: rows · ceil(hidden / R) blocks of MOE_WARPS warps.
#define MOE_MAX_TOPK 64
extern "C" __global__ void moe_down(const float* __restrict__ h, const int* __restrict__ ids,
                                    const float* __restrict__ wts, const uint8_t* __restrict__ down,
                                    int down_type, long long down_rb, int down_a16, float* __restrict__ out,
                                    int rows, int top_k, int hidden, int ffn, int n_experts,
                                    int rows_per_block) {
    PDL_ENTRY();
    __shared__ float part[MOE_MAX_TOPK * MOE_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int R = rows_per_block;
    const long long chunks = (hidden + R - 1) / R;
    const long long t = (long long)blockIdx.x / chunks;
    const int o0 = (int)((long long)blockIdx.x % chunks) * R;
    const int items = R * top_k;  // <= MOE_MAX_TOPK * MOE_WARPS (host-checked)
    for (int i = warp; i < items; i += MOE_WARPS) {
        const int r = i / top_k, k = i % top_k;
        const int o = o0 + r;
        float d = 0.f;
        if (t < rows && o < hidden) {
            const long long pair = t * top_k + k;
            const int e = ids[pair];
            if (e < 0 || e >= n_experts) d = __int_as_float(0x7fc00000);
            else d = row_dot(down + ((long long)e * hidden + o) * down_rb, down_type, down_a16,
                             h + pair * ffn, ffn, lane);
        }
        if (lane == 0) part[i] = d;
    }
    __syncthreads();
    if (threadIdx.x < R && t < rows) {
        const int r = threadIdx.x, o = o0 + r;
        if (o < hidden) {
            float acc = 0.f;
            for (int k = 0; k < top_k; ++k)
                acc = __fadd_rn(acc, __fmul_rn(wts[t * top_k + k], part[r * top_k + k]));
            out[t * hidden + o] = acc;
        }
    }
}

// =======================================================================================
// Grouped prefill path (rows > 16; launcher: moe.rs). bf16 tensor cores, f32 accumulation.
//
// 4. moe_sort (one block of 1024 threads): counting sort of the rows·top_k (token, slot)
//    pairs by expert. Histogram with shared-memory atomics into cnt[n_experts], one warp
//    scans the counts (and the 64-pair tiles per expert) with shuffles, then every pair is
//    scattered to list[offsets[e] + atomicAdd(cursor[e])]. Order inside an expert does not
//    matter: each pair's output row is computed by the same K-ordered mma chain wherever it
//    sits in a tile. Also writes the tile table (expert, first list position) and the tile
//    count, so the GEMM grids can be sized from the worst case (pairs/64 + n_experts tiles)
//    without the host knowing the routing. Bytes: pairs·4 in, ~pairs·4 + tiles·8 out.
// 5. moe_mm_gu_<type>: per (tile, 64 ffn outputs) block, 256 threads = 8 warps as 4 (M) x
//    2 (N). A = 128 smem rows: warp wm's 32 rows are 16 gate rows then the same 16 up rows
//    (outputs o0+16wm..+15), so one thread holds gate and up of the same (output, pair) in
//    its accumulators and applies SwiGLU in the epilogue. B = the 64 pairs' x rows (token =
//    pair / top_k, gathered), converted to bf16. K steps of 32, two smem buffers, the next
//    step decoded into registers during the mma of the current one (as mm_* in matmul.cu,
//    whose decoders are copied here). Writes h[list position, ffn] in f32.
//    __launch_bounds__(256, 3): <= 80 registers so 3 blocks share an SM; with one K step of
//    register prefetch per block, more resident blocks is what keeps weight loads in flight.
// 6. moe_mm_down_<type>: per (tile, 128 hidden outputs) block; A = 128 down rows of the
//    expert, B = the tile's h rows (contiguous in list order). Writes y[pair, hidden] f32.
// 7. moe_combine: out[t][o] = sum_k w[t,k] · y[t·top_k + k][o] in top-k order (no FMA
//    contraction, like the CPU). Bytes: pairs·hidden·4 in, rows·hidden·4 out.
// Weights: each expert's tile rows are read by its ceil(count/64) token tiles (mostly from
// L2 when several), i.e. about once per layer at pp512 (~340 MB for Qwen3-30B-A3B Q4_K).
// Precision: bf16 x, h and weights (rel. error <= 2^-9 each), f32 accumulation.

// h2f, b2f, byte_f, sbyte, scale_min_w, pack_bf16 and ld2c come from mm_decode.cuh
// (prepended by mod.rs: the same helpers as the dense prefill kernels).

#define GM_TM 128  // smem rows of A per block
#define GM_TN 64   // pairs per tile (mma N)
#define GM_TK 32   // K per step
#define GM_LDS 40  // smem row stride in bf16 (80 B: 16-B aligned rows, conflict-free fragments)

__device__ __forceinline__ uint32_t ld4c(const uint8_t* p) {
    size_t a = (size_t)p;
    const uint32_t* q = (const uint32_t*)(a & ~(size_t)3);
    uint32_t sh = (uint32_t)(a & 3) * 8;
    uint32_t lo = __ldg(q);
    uint32_t hi = sh ? __ldg(q + 1) : 0u;
    return __funnelshift_r(lo, hi, sh);
}

// Weight elements k0..k0+15 (k0 % 16 == 0) of one row as 8 packed bf16 pairs; zero at or
// beyond n_in. (matmul.cu's decode16, verbatim.)
template <int TYPE>
__device__ __forceinline__ void decode16(const uint8_t* __restrict__ row, int k0, int n_in, uint32_t (&o)[8]) {
    if (TYPE == GGML_F32 || TYPE == GGML_F16 || TYPE == GGML_BF16) {
        float v[16];
        const bool vec = k0 + 16 <= n_in && (TYPE == GGML_F32 ? (n_in & 3) == 0 : (n_in & 7) == 0);
        if (vec) {
            if (TYPE == GGML_F32) {
                const float4* p = (const float4*)(row + 4 * (size_t)k0);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float4 f = __ldg(p + i);
                    v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
                }
            } else {
                const uint4* p = (const uint4*)(row + 2 * (size_t)k0);
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const uint4 u = __ldg(p + i);
                    const uint32_t ws[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        if (TYPE == GGML_BF16) {
                            o[4 * i + k] = ws[k];
                        } else {
                            v[8 * i + 2 * k] = h2f(ws[k] & 0xFFFF);
                            v[8 * i + 2 * k + 1] = h2f(ws[k] >> 16);
                        }
                    }
                }
                if (TYPE == GGML_BF16) return;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const int k = k0 + i;
                float f = 0.0f;
                if (k < n_in) {
                    if (TYPE == GGML_F32) f = __ldg((const float*)row + k);
                    else if (TYPE == GGML_F16) f = h2f(ld2c(row + 2 * (size_t)k));
                    else f = b2f(ld2c(row + 2 * (size_t)k));
                }
                v[i] = f;
            }
        }
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = pack_bf16(v[2 * i], v[2 * i + 1]);
    } else if (TYPE == GGML_Q8_0) {
        const uint8_t* blk = row + (size_t)(k0 / QK) * Q8_0_BYTES;
        const float d = h2f(ld2c(blk));
        const uint8_t* qs = blk + 2 + (k0 & 16);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = ld4c(qs + 4 * i) ^ 0x80808080u;
            o[2 * i] = pack_bf16((byte_f<0>(q) - 128.0f) * d, (byte_f<1>(q) - 128.0f) * d);
            o[2 * i + 1] = pack_bf16((byte_f<2>(q) - 128.0f) * d, (byte_f<3>(q) - 128.0f) * d);
        }
    } else if (TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1) {
        const bool q40 = TYPE == GGML_Q4_0;
        const uint8_t* blk = row + (size_t)(k0 / QK) * (q40 ? Q4_0_BYTES : Q4_1_BYTES);
        const float d = h2f(ld2c(blk));
        const float m = q40 ? -8.0f * d : h2f(ld2c(blk + 2));
        const int shift = (k0 & 16) ? 4 : 0;
        const uint8_t* qs = blk + (q40 ? 2 : 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = (ld4c(qs + 4 * i) >> shift) & 0x0F0F0F0Fu;
            o[2 * i] = pack_bf16(fmaf(byte_f<0>(q), d, m), fmaf(byte_f<1>(q), d, m));
            o[2 * i + 1] = pack_bf16(fmaf(byte_f<2>(q), d, m), fmaf(byte_f<3>(q), d, m));
        }
    } else if (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
        const bool q4 = TYPE == GGML_Q4_K;
        const uint8_t* blk = row + (size_t)(k0 / QK_K) * (q4 ? Q4_K_BYTES : Q5_K_BYTES);  // 16-aligned
        const int r = k0 % QK_K, g = r / 64, w = r % 64, l0 = w % 32, sub = 2 * g + (w >= 32);
        const uint4 h = __ldg((const uint4*)blk);
        float sc, mn;
        scale_min_w(sub, h.y, h.z, h.w, &sc, &mn);
        const float ds = h2f(h.x & 0xFFFF) * sc, dm = h2f(h.x >> 16) * mn;
        const uint4 qv = __ldg((const uint4*)(blk + (q4 ? 16 : 48) + 32 * g + l0));
        const uint32_t qw[4] = {qv.x, qv.y, qv.z, qv.w};
        uint32_t hw[4] = {0u, 0u, 0u, 0u};
        if (!q4) {
            const uint4 hv = __ldg((const uint4*)(blk + 16 + l0));
            hw[0] = hv.x; hw[1] = hv.y; hw[2] = hv.z; hw[3] = hv.w;
        }
        const int shift = w >= 32 ? 4 : 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t q = (qw[i] >> shift) & 0x0F0F0F0Fu;
            if (!q4) q |= ((hw[i] >> sub) & 0x01010101u) << 4;
            o[2 * i] = pack_bf16(fmaf(byte_f<0>(q), ds, -dm), fmaf(byte_f<1>(q), ds, -dm));
            o[2 * i + 1] = pack_bf16(fmaf(byte_f<2>(q), ds, -dm), fmaf(byte_f<3>(q), ds, -dm));
        }
    } else if (TYPE == GGML_Q6_K) {
        const uint8_t* blk = row + (size_t)(k0 / QK_K) * Q6_K_BYTES;  // 2-aligned
        const int r = k0 % QK_K, n = r / 128, rr = r % 128, quarter = rr / 32, l0 = rr % 32;
        const uint8_t* ql = blk + 64 * n + l0 + (quarter & 1) * 32;
        const uint8_t* qh = blk + 128 + 32 * n + l0;
        const float d = h2f(ld2c(blk + 208));
        const float ds = d * (float)(int8_t)__ldg((const signed char*)(blk + 192 + 8 * n + l0 / 16 + 2 * quarter));
        const int lshift = quarter >= 2 ? 4 : 0, hshift = 2 * quarter;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = ((ld4c(ql + 4 * i) >> lshift) & 0x0F0F0F0Fu) |
                               (((ld4c(qh + 4 * i) >> hshift) & 0x03030303u) << 4);
            o[2 * i] = pack_bf16((byte_f<0>(q) - 32.0f) * ds, (byte_f<1>(q) - 32.0f) * ds);
            o[2 * i + 1] = pack_bf16((byte_f<2>(q) - 32.0f) * ds, (byte_f<3>(q) - 32.0f) * ds);
        }
    }
}

// Activation elements k0..k0+7 of one f32 row as 4 bf16 pairs (zero at or beyond n, or for a
// padding row: valid == false).
__device__ __forceinline__ void load_act8(const float* __restrict__ r, int k0, int n, bool valid, uint32_t (&o)[4]) {
    if (!valid) {
        o[0] = o[1] = o[2] = o[3] = 0u;
    } else if (k0 + 8 <= n && (n & 3) == 0) {
        const float4 a = __ldg((const float4*)(r + k0)), b = __ldg((const float4*)(r + k0 + 4));
        o[0] = pack_bf16(a.x, a.y); o[1] = pack_bf16(a.z, a.w);
        o[2] = pack_bf16(b.x, b.y); o[3] = pack_bf16(b.z, b.w);
    } else {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = k0 + i < n ? __ldg(r + k0 + i) : 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = pack_bf16(v[2 * i], v[2 * i + 1]);
    }
}

// One block of 1024 threads; dynamic shared memory: 2·n_experts ints.
// idx layout (ints): offsets[n_experts + 1] | n_tiles[1] | tiles[2·max_tiles] | list[pairs]
extern "C" __global__ void __launch_bounds__(1024) moe_sort(const int* __restrict__ ids, int pairs, int n_experts,
                                                            int* __restrict__ offsets, int* __restrict__ n_tiles,
                                                            int* __restrict__ tiles, int* __restrict__ list) {
    PDL_ENTRY();
    extern __shared__ int sm[];
    int* cnt = sm;
    int* cur = sm + n_experts;
    const int tid = threadIdx.x;
    for (int e = tid; e < n_experts; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < n_experts) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (tid < 32) {
        const int lane = tid;
        const int chunk = (n_experts + 31) / 32;
        const int e0 = min(n_experts, lane * chunk), e1 = min(n_experts, e0 + chunk);
        int s = 0, st = 0;
        for (int e = e0; e < e1; ++e) {
            s += cnt[e];
            st += (cnt[e] + GM_TN - 1) / GM_TN;
        }
        int is = s, ist = st;  // inclusive scans over lanes
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, is, o), b = __shfl_up_sync(0xffffffffu, ist, o);
            if (lane >= o) { is += a; ist += b; }
        }
        int base = is - s, tb = ist - st;
        for (int e = e0; e < e1; ++e) {
            offsets[e] = base;
            cur[e] = base;
            const int c = cnt[e];
            for (int j = 0; j * GM_TN < c; ++j) {
                tiles[2 * (tb + j)] = e;
                tiles[2 * (tb + j) + 1] = base + j * GM_TN;
            }
            tb += (c + GM_TN - 1) / GM_TN;
            base += c;
        }
        if (lane == 31) {
            offsets[n_experts] = is;
            *n_tiles = ist;
        }
    }
    __syncthreads();
    for (int p = tid; p < pairs; p += blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < n_experts) list[atomicAdd(&cur[e], 1)] = p;
    }
}

// GU: gate/up + SwiGLU (W0 = gate, W1 = up, n_out = ffn, n_in = hidden, src = x rows by
// token, dst = h[list position, ffn]). !GU: down (W0 = down, n_out = hidden, n_in = ffn,
// src = h rows by list position, dst = y[pair, hidden]).
template <int TYPE, bool GU>
__device__ __forceinline__ void moe_mm(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, long long rb,
                                       int n_out, int n_in, const float* __restrict__ src,
                                       const int* __restrict__ offsets, const int* __restrict__ n_tiles,
                                       const int* __restrict__ tiles, const int* __restrict__ list, int top_k,
                                       float* __restrict__ dst) {
    __shared__ __align__(16) uint16_t sA[2][GM_TM * GM_LDS];
    __shared__ __align__(16) uint16_t sB[2][GM_TN * GM_LDS];
    const int tile = blockIdx.x;
    if (tile >= *n_tiles) return;  // whole block, before any barrier
    const int e = tiles[2 * tile], start = tiles[2 * tile + 1];
    const int cnt = min(GM_TN, offsets[e + 1] - start);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp & 3, wn = warp >> 2;  // warp tile: A rows 32*wm.., pairs 32*wn..
    const int g = lane >> 2, t4 = lane & 3;
    const int o0 = blockIdx.y * (GU ? GM_TM / 2 : GM_TM);

    // A loader: smem row lr, 16 of the 32 K elements (half lh).
    const int lr = tid >> 1, lh = tid & 1;
    int lo;
    const uint8_t* W;
    if (GU) {
        const int j = lr & 31;
        lo = o0 + 16 * (lr >> 5) + (j & 15);
        W = j >= 16 ? W1 : W0;
    } else {
        lo = o0 + lr;
        W = W0;
    }
    lo = lo < n_out ? lo : n_out - 1;
    const uint8_t* wrow = W + ((size_t)e * (size_t)n_out + (size_t)lo) * (size_t)rb;
    // B loader: tile row bi, 8 K elements at 8*bq.
    const int bi = tid >> 2, bq = tid & 3;
    const bool bvalid = bi < cnt;
    const int bpos = start + (bvalid ? bi : 0);
    const float* srow = GU ? src + (size_t)(list[bpos] / top_k) * (size_t)n_in : src + (size_t)bpos * (size_t)n_in;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

    const int nk = (n_in + GM_TK - 1) / GM_TK;
    uint32_t ra[8], rx[4];
    decode16<TYPE>(wrow, 16 * lh, n_in, ra);
    load_act8(srow, 8 * bq, n_in, bvalid, rx);
    {
        uint4* pa = (uint4*)&sA[0][lr * GM_LDS + 16 * lh];
        pa[0] = make_uint4(ra[0], ra[1], ra[2], ra[3]);
        pa[1] = make_uint4(ra[4], ra[5], ra[6], ra[7]);
        *(uint4*)&sB[0][bi * GM_LDS + 8 * bq] = make_uint4(rx[0], rx[1], rx[2], rx[3]);
    }
    __syncthreads();

    for (int kt = 0; kt < nk; kt++) {
        const int cur = kt & 1;
        const bool more = kt + 1 < nk;
        if (more) {
            decode16<TYPE>(wrow, (kt + 1) * GM_TK + 16 * lh, n_in, ra);
            load_act8(srow, (kt + 1) * GM_TK + 8 * bq, n_in, bvalid, rx);
        }
        const uint16_t* A = sA[cur];
        const uint16_t* B = sB[cur];
#pragma unroll
        for (int kk = 0; kk < GM_TK; kk += 16) {
            uint32_t af[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const uint16_t* p = A + (wm * 32 + mi * 16 + g) * GM_LDS + kk + 2 * t4;
                af[mi][0] = *(const uint32_t*)p;
                af[mi][1] = *(const uint32_t*)(p + 8 * GM_LDS);
                af[mi][2] = *(const uint32_t*)(p + 8);
                af[mi][3] = *(const uint32_t*)(p + 8 * GM_LDS + 8);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const uint16_t* p = B + (wn * 32 + ni * 8 + g) * GM_LDS + kk + 2 * t4;
                const uint32_t b0 = *(const uint32_t*)p, b1 = *(const uint32_t*)(p + 8);
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
                    mma_bf16(acc[mi][ni], af[mi][0], af[mi][1], af[mi][2], af[mi][3], b0, b1);
            }
        }
        if (more) {
            // Buffer cur^1 was last read in step kt-1, which ended with a barrier.
            uint4* pa = (uint4*)&sA[cur ^ 1][lr * GM_LDS + 16 * lh];
            pa[0] = make_uint4(ra[0], ra[1], ra[2], ra[3]);
            pa[1] = make_uint4(ra[4], ra[5], ra[6], ra[7]);
            *(uint4*)&sB[cur ^ 1][bi * GM_LDS + 8 * bq] = make_uint4(rx[0], rx[1], rx[2], rx[3]);
        }
        __syncthreads();
    }

    // C fragment: c0,c1 = (A row g, pairs 2*t4, 2*t4+1); c2,c3 = A row g+8.
#pragma unroll
    for (int ni = 0; ni < 4; ni++) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int i = wn * 32 + ni * 8 + 2 * t4 + (k & 1);
            const int r = g + (k >= 2 ? 8 : 0);
            if (i >= cnt) continue;
            if (GU) {
                const int o = o0 + 16 * wm + r;
                if (o < n_out) {
                    const float gv = acc[0][ni][k], uv = acc[1][ni][k];
                    dst[(size_t)(start + i) * (size_t)n_out + o] = gv / (1.0f + expf(-gv)) * uv;
                }
            } else {
                const size_t p = (size_t)list[start + i];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    const int o = o0 + wm * 32 + mi * 16 + r;
                    if (o < n_out) dst[p * (size_t)n_out + o] = acc[mi][ni][k];
                }
            }
        }
    }
}

#define MOE_MM_KERNELS(name, TYPE)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 3)                                                          \
        moe_mm_gu_##name(const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up, long long rb,        \
                         int ffn, int hidden, const float* __restrict__ x, const int* __restrict__ offsets,    \
                         const int* __restrict__ n_tiles, const int* __restrict__ tiles,                       \
                         const int* __restrict__ list, int top_k, float* __restrict__ h) {                     \
        PDL_ENTRY();                                                                                           \
        moe_mm<TYPE, true>(gate, up, rb, ffn, hidden, x, offsets, n_tiles, tiles, list, top_k, h);             \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 3)                                                          \
        moe_mm_down_##name(const uint8_t* __restrict__ down, long long rb, int hidden, int ffn,               \
                           const float* __restrict__ h, const int* __restrict__ offsets,                       \
                           const int* __restrict__ n_tiles, const int* __restrict__ tiles,                     \
                           const int* __restrict__ list, int top_k, float* __restrict__ y) {                   \
        PDL_ENTRY();                                                                                           \
        moe_mm<TYPE, false>(down, down, rb, hidden, ffn, h, offsets, n_tiles, tiles, list, top_k, y);          \
    }

MOE_MM_KERNELS(f32, GGML_F32)
MOE_MM_KERNELS(f16, GGML_F16)
MOE_MM_KERNELS(bf16, GGML_BF16)
MOE_MM_KERNELS(q8_0, GGML_Q8_0)
MOE_MM_KERNELS(q4_0, GGML_Q4_0)
MOE_MM_KERNELS(q4_1, GGML_Q4_1)
MOE_MM_KERNELS(q4_k, GGML_Q4_K)
MOE_MM_KERNELS(q5_k, GGML_Q5_K)
MOE_MM_KERNELS(q6_k, GGML_Q6_K)

// out[t][o] = sum_k wts[t,k] · y[t·top_k + k][o], k ascending. One thread per element.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ ids,
                                       const float* __restrict__ wts, float* __restrict__ out, int rows, int top_k,
                                       int hidden, int n_experts) {
    PDL_ENTRY();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * hidden) return;
    const long long t = idx / hidden;
    const int o = (int)(idx % hidden);
    float acc = 0.f;
    for (int k = 0; k < top_k; ++k) {
        const long long pair = t * top_k + k;
        const int e = ids[pair];
        const float d = (e < 0 || e >= n_experts) ? __int_as_float(0x7fc00000) : y[pair * hidden + o];
        acc = __fadd_rn(acc, __fmul_rn(wts[pair], d));
    }
    out[idx] = acc;
}

// moe_combine4: the same sums four outputs a thread (hidden % 4 == 0: 16-byte loads of y and
// stores of out; each pair's id and weight read once for its four). Every output's additions
// are moe_combine's, in the same order (same bits). Qwen3-30B-A3B at pp512: 22 µs a layer on
// the scalar form (MOE.md, 49th session).
extern "C" __global__ void moe_combine4(const float4* __restrict__ y, const int* __restrict__ ids,
                                        const float* __restrict__ wts, float4* __restrict__ out, int rows, int top_k,
                                        int hidden, int n_experts) {
    PDL_ENTRY();
    const int h4 = hidden >> 2;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * h4) return;
    const long long t = idx / h4;
    const int o = (int)(idx % h4);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < top_k; ++k) {
        const long long pair = t * top_k + k;
        const int e = ids[pair];
        const float w = wts[pair], nan = __int_as_float(0x7fc00000);
        const float4 d = (e < 0 || e >= n_experts) ? make_float4(nan, nan, nan, nan) : y[pair * h4 + o];
        acc.x = __fadd_rn(acc.x, __fmul_rn(w, d.x));
        acc.y = __fadd_rn(acc.y, __fmul_rn(w, d.y));
        acc.z = __fadd_rn(acc.z, __fmul_rn(w, d.z));
        acc.w = __fadd_rn(acc.w, __fmul_rn(w, d.w));
    }
    out[idx] = acc;
}

// ---------------------------------------------------------------------------------------
// moe_predict + moe_prefetch_experts: a MoE layer's likely experts for the one decode row,
// their gate and up rows prefetched into L2 ahead of the layer (moe.rs `prefetch`; MOE.md,
// 63rd session).
//
// The prediction is the layer's own router on rms_norm(x) · n, x the residual before the
// layer's attention half: the router will see x plus that half's output, which moves the
// residual's direction by a little (the cross-layer expert prediction of pre-gated and
// offloading MoE engines). A hint only: both launches run on a stream of their own beside the
// decode step's chain (no PDL attribute, no pdl_wait: the fork's event orders the first after
// the launch that wrote x, the stream the second after the first), nothing in the chain waits
// for them or reads what they write, and a wrong guess costs DRAM bytes, never a result.
//
// moe_predict: grid nb blocks × 256 threads (8 warps). Every block: Σ x² (float4 loads) →
// 1 / rms; x ⊙ n / rms into shared memory (hidden floats); warp w of block b takes router rows
// e = 8 b + w, + 8 nb, ...: one dot of hidden floats a row (16 float4 loads a lane at 2048, all
// in flight), logits[e]. Then a ticket: the launch's last block reads the logits back and warp
// 0 picks the `pick` largest by rounds of a warp arg-max (lowest id on ties) into ids[]; it
// resets the ticket (zero between launches and graph replays). Bytes: the router (n_experts ·
// hidden · 4: 1 MB on Qwen3-30B-A3B), x once a block.
#define MOE_PF_MAX_EXPERTS 1024

// One round of the prediction's top-k (moe_predict, moe_predict_hits), one warp: the largest
// untaken logit of lg[0..n) (shared memory; the lowest id of a tie), marked taken (-inf) and
// returned; n when none is left above -inf (NaN or -inf logits).
__device__ __forceinline__ int moe_pf_take(float* lg, int n, int lane) {
    float bv = __int_as_float(0xff800000);  // -inf
    int bi = 0x7fffffff;
    for (int e = lane; e < n; e += 32)
        if (lg[e] > bv) bv = lg[e], bi = e;  // ascending e: a lane's lowest id of a tie
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    if (bi >= n) return n;
    if (lane == (bi & 31)) lg[bi] = __int_as_float(0xff800000);
    __syncwarp();
    return bi;
}
extern "C" __global__ void __launch_bounds__(256) moe_predict(const float* __restrict__ x, const float* __restrict__ nw,
                                                              float eps, int hidden, const float* __restrict__ router,
                                                              int n_experts, int pick, float* __restrict__ logits,
                                                              int* __restrict__ ticket, int* __restrict__ ids) {
    extern __shared__ float4 xs4[];  // x ⊙ n / rms, hidden / 4 float4
    __shared__ float red[8];
    __shared__ float lg[MOE_PF_MAX_EXPERTS];
    __shared__ int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h4 = hidden / 4;
    const float4* x4 = (const float4*)x;
    const float4* n4 = (const float4*)nw;
    float ss = 0.f;
    for (int i = threadIdx.x; i < h4; i += blockDim.x) {
        const float4 v = x4[i];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = moe_warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < 8; w++) tot += red[w];
    const float inv = rsqrtf(tot / (float)hidden + eps);
    for (int i = threadIdx.x; i < h4; i += blockDim.x) {
        const float4 v = x4[i], n = __ldg(n4 + i);
        xs4[i] = make_float4(v.x * inv * n.x, v.y * inv * n.y, v.z * inv * n.z, v.w * inv * n.w);
    }
    __syncthreads();
    for (int e = blockIdx.x * 8 + warp; e < n_experts; e += gridDim.x * 8) {
        const float4* r = (const float4*)(router + (size_t)e * (size_t)hidden);
        float acc = 0.f;
        for (int i = lane; i < h4; i += 32) {
            const float4 w = __ldg(r + i), v = xs4[i];
            acc += w.x * v.x + w.y * v.y + w.z * v.z + w.w * v.w;
        }
        acc = moe_warp_sum(acc);
        if (lane == 0) logits[e] = acc;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) lg[e] = __ldcg(logits + e);
    __syncthreads();
    if (warp != 0) return;
    for (int k = 0; k < pick; k++) {
        // None left above -inf (NaN or -inf logits): expert 0, a harmless hint.
        const int id = moe_pf_take(lg, n_experts, lane);
        if (lane == 0) ids[k] = id < n_experts ? id : 0;
    }
    if (lane == 0) *ticket = 0;
}

// moe_prefetch_experts: one cp.async.bulk.prefetch.L2 a block (thread 0), of piece p of matrix
// m (0 gate, 1 up) of predicted expert k (block b = (p · pick + k) · 2 + m: every winner's first
// pieces first): the span of expert e is bytes [e·eb, (e + 1)·eb) of each stacked tensor, cut
// into MOE_PF_PIECE-byte pieces. One piece a block spreads the copies over the SMs' TMA units:
// one block issuing all of a layer's pieces (14.2 MB for 8 Qwen3-30B-A3B experts) kept its SM's
// unit busy ~35 µs, longer than a layer (MOE.md, 63rd session).
#define MOE_PF_PIECE 32768ll
extern "C" __global__ void __launch_bounds__(32) moe_prefetch_experts(const int* __restrict__ ids, int pick,
                                                                      const uint8_t* __restrict__ gate,
                                                                      const uint8_t* __restrict__ up, long long eb) {
    if (threadIdx.x != 0) return;
    const long long b = blockIdx.x, p = b / (2 * pick);
    const int k = (int)((b / 2) % pick), m = (int)(b & 1);
    const long long rem = eb - p * MOE_PF_PIECE;
    if (rem <= 0) return;
    prefetch_l2((m ? up : gate) + (size_t)__ldg(ids + k) * (size_t)eb + (size_t)(p * MOE_PF_PIECE),
                (unsigned int)(rem < MOE_PF_PIECE ? rem : MOE_PF_PIECE));
}

// moe_predict_hits (a diagnostic, FERRITE_MOE_PREDICT_HITS; moe.rs `score_prediction`): one
// warp, launched on the chain after the side stream's prediction for this layer and the
// layer's router: of the token's true top_k experts (largest logits, the routing's rounds),
// how many the prediction's ids[0..pick) hold; hits[0] += that, hits[1] += top_k.
extern "C" __global__ void __launch_bounds__(32) moe_predict_hits(const float* __restrict__ logits, int n_experts,
                                                                  int top_k, const int* __restrict__ ids, int pick,
                                                                  unsigned int* __restrict__ hits) {
    __shared__ float lg[MOE_PF_MAX_EXPERTS];
    const int lane = threadIdx.x;
    for (int e = lane; e < n_experts; e += 32) lg[e] = logits[e];
    __syncwarp();
    unsigned int n = 0;
    for (int k = 0; k < top_k; k++) {
        const int id = moe_pf_take(lg, n_experts, lane);
        if (id >= n_experts) break;
        for (int j = 0; j < pick; j++) n += ids[j] == id;
    }
    if (lane == 0) {
        atomicAdd(hits, n);
        atomicAdd(hits + 1, (unsigned int)top_k);
    }
}
