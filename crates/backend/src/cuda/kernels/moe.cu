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
//    added sequentially by lane 0 (the CPU's order), then top_k rounds of a warp-wide
//    arg-max over (probability desc, id asc); the winner is marked taken (-1 in shared
//    memory). Lane 0 writes (id, p/sum) per slot and renormalises if asked. A token's
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
extern "C" __global__ void moe_route(const float* __restrict__ logits, int n_experts, int top_k, int norm,
                                     int* __restrict__ ids, float* __restrict__ wts) {
    extern __shared__ float p[];
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)t * n_experts;
    float mx = __int_as_float(0xff800000);  // -inf
    for (int e = lane; e < n_experts; e += 32) mx = fmaxf(mx, l[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    for (int e = lane; e < n_experts; e += 32) p[e] = expf(l[e] - mx);
    __syncwarp();
    float sum = 0.f;
    if (lane == 0)
        for (int e = 0; e < n_experts; ++e) sum += p[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    int* my_ids = ids + (long long)t * top_k;
    float* my_w = wts + (long long)t * top_k;
    for (int k = 0; k < top_k; ++k) {
        // Probabilities are >= 0, taken ones are -1: the -2 start loses to everything.
        float bv = -2.f;
        int bi = 0x7fffffff;
        for (int e = lane; e < n_experts; e += 32) {
            float v = p[e];
            if (v > bv) { bv = v; bi = e; }  // ascending e: the lowest id of a tie stays
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) {
            my_ids[k] = bi;
            my_w[k] = bv / sum;
            p[bi] = -1.f;
        }
        __syncwarp();
    }
    if (norm && lane == 0) {
        float s = 0.f;
        for (int k = 0; k < top_k; ++k) s += my_w[k];
        for (int k = 0; k < top_k; ++k) my_w[k] = my_w[k] / s;
    }
}

// Grid: pairs · ceil(ffn / MOE_WARPS) blocks of MOE_WARPS warps; pair = token·top_k + slot.
extern "C" __global__ void moe_gate_up(const float* __restrict__ x, const int* __restrict__ ids,
                                       const uint8_t* __restrict__ gate, int gate_type, long long gate_rb,
                                       int gate_a16, const uint8_t* __restrict__ up, int up_type,
                                       long long up_rb, int up_a16, float* __restrict__ h, int pairs,
                                       int top_k, int hidden, int ffn, int n_experts) {
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
    const float g = row_dot(gate + r * gate_rb, gate_type, gate_a16, xt, hidden, lane);
    const float u = row_dot(up + r * up_rb, up_type, up_a16, xt, hidden, lane);
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
