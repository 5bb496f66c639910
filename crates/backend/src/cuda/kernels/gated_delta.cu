// gated_delta.cu — the Gated DeltaNet ops of Qwen3.5's linear-attention layers, and the two
// small gating ops of its attention/MoE layers. The CPU backend (cpu.rs, gated_delta.rs) is
// the oracle; every formula below is written in the same order as there.
//
// Plans:
// - causal_conv1d: depthwise causal convolution over time + SiLU, continuing the stored
//   state (the last K-1 inputs of every channel, [K-1][C] f32 in VRAM). One thread per
//   (channel, run of CONV_ROWS rows): grid (C/256, rows/CONV_ROWS). Output t of channel c
//   reads e[t..t+K) of e = [state; x], straight from global memory (each x element is read
//   by K consecutive outputs: L1 hits). Only the run starting at row 0 reads the state
//   (CONV_ROWS >= K-1), and the thread of that run is also the one that writes the new
//   state of its channel after its reads: no other thread touches that channel's state, so
//   there is no race and no second kernel. Bytes: rows*C*4 in + out, 2*(K-1)*C*4 state.
//   Taps are read with ggml_get (F32 in GGUF files, BF16/F16 in Hugging Face ones).
// - gated_delta_rule: the recurrence, token by token, in f32 with the state resident in
//   VRAM ([n_v_heads][dv][dk] per layer: column-major per head, so the dk values of one
//   state column are contiguous). Block = (value head h, COLS = 128/L state columns), 128
//   threads, L lanes per column (L = 8 for dk > 32); lane (col, rg) keeps rows rg*R..rg*R+R
//   of column col in registers (R = 8 or 16) for the whole call.
//   Inputs go through shared memory in chunks of GD_CHUNK = 16 tokens, double-buffered:
//   the block issues the cp.async copies of chunk c+1 (q and k rows of the key head, the
//   block's COLS values of v, a and b: ~1 KiB per token for Qwen3.5) right after chunk c
//   has landed, so one global-load latency is paid per chunk instead of per token. A
//   chunk is then prepared by the whole block: each group of L lanes L2-normalises the q
//   and k of one token in place (the same R-row partial sums and xor butterfly as the
//   recurrence computed per token before: identical bits), every thread computes a decay
//   and beta. The serial loop then runs per token only what depends on the state: decay
//   of S, S·k (one butterfly over L lanes), the delta update, and the lane's partial of
//   Sᵀq, stored to shared memory; after the next barrier the block sums the L partials in
//   the butterfly's order (lane 0's: ((p0+p1)+(p2+p3))+(...)) and stores COLS consecutive
//   outputs per token. q/k are stored permuted (lane rg's m-th float4 at (m*L+rg)*4), so
//   the L lanes of a column read L consecutive float4: no bank conflicts.
//   Shared memory: 2 × 16 × (2·L·R + COLS + 4) + 16·COLS·L floats = 42.5 KiB for dk = 128.
//   Decode (rows = 1) runs the same code with a one-token chunk (the same per-token
//   arithmetic as prefill by construction: the prefill/decode gate compares them exactly);
//   S is read and written once, as float4 runs of the column (dk*dv*8 bytes per head);
//   256 blocks for Qwen3.5-9B. The chunked tensor-core form is a later step (GATED_DELTA.md).
// - gated_rms_norm: one warp per head: x = (x * rsqrt(mean(x²) + eps)) * w * silu(z).
// - sigmoid_gate: one thread per element: x *= sigmoid(gate), gate per element or per row.

#define GD_MAX_K 8      // largest convolution kernel (Qwen3.5: 4); = MAX_CONV_KERNEL in Rust
#define CONV_ROWS 16    // rows per convolution thread; >= GD_MAX_K - 1
#define GD_THREADS 128  // threads per gated_delta block
#define GD_CHUNK 16     // tokens per staged gated_delta chunk

__device__ __forceinline__ float gd_silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float gd_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
// PyTorch's softplus (beta 1, threshold 20), as the CPU computes it.
__device__ __forceinline__ float gd_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// x, out: [rows][C]; w: C rows of K taps stored as `wtype`; state: this layer's [K-1][C].
extern "C" __global__ void causal_conv1d(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                         int wtype, long long w_row_bytes, float* __restrict__ state,
                                         float* __restrict__ out, int rows, int C, int K) {
    PDL_ENTRY();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    int hist = K - 1;
    float taps[GD_MAX_K];
    const uint8_t* wr = w + (long long)c * w_row_bytes;
#pragma unroll
    for (int j = 0; j < GD_MAX_K; j++) taps[j] = j < K ? ggml_get(wr, wtype, j) : 0.f;
    int t0 = blockIdx.y * CONV_ROWS;
    int t1 = min(t0 + CONV_ROWS, rows);
    for (int t = t0; t < t1; t++) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < GD_MAX_K; j++) {
            if (j < K) {
                int i = t + j;  // row of e = [state; x]
                float e = i < hist ? state[(long long)i * C + c] : x[(long long)(i - hist) * C + c];
                s += taps[j] * e;
            }
        }
        out[(long long)t * C + c] = gd_silu(s);
    }
    if (blockIdx.y == 0) {
        // The new state: rows rows..rows+hist of e (all read before any is written).
        float ns[GD_MAX_K - 1];
#pragma unroll
        for (int r = 0; r < GD_MAX_K - 1; r++) {
            if (r < hist) {
                int i = rows + r;
                ns[r] = i < hist ? state[(long long)i * C + c] : x[(long long)(i - hist) * C + c];
            }
        }
#pragma unroll
        for (int r = 0; r < GD_MAX_K - 1; r++)
            if (r < hist) state[(long long)r * C + c] = ns[r];
    }
}

// One token's inputs of one lane (from the staged chunk): q and k already L2-normalised
// (q also scaled), the lane's state column's v, the token's decay and beta.
template <int R>
struct GdIn {
    float q[R], k[R], v, decay, beta;
};

// Sum over the L lanes of a state column (lanes L·c .. L·c+L-1); every lane gets the same
// value (xor butterflies: the same additions in every lane).
template <int L>
__device__ __forceinline__ float gd_sum(float v) {
#pragma unroll
    for (int o = 1; o < L; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// cp.async: global → shared without registers (sm_80+). 16-byte copies need 16-byte aligned
// source and destination; .cg skips L1 (nothing here is read twice by one SM from L1).
__device__ __forceinline__ void gd_cp4(float* dst, const float* src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void gd_cp16(float* dst, const float* src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void gd_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void gd_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Shared layout of one staged chunk (floats): per token q and k in DKP = L*R slots each,
// element i at gd_perm(i) so that lane rg's m-th float4 (rows rg*R+4m..+3) sits at
// (m*L + rg)*4: the L lanes of a column read L consecutive float4 (no bank conflicts);
// then v [GD_CHUNK][COLS], raw a, raw b, decay, beta [GD_CHUNK] each.
template <int R, int L>
__device__ __forceinline__ int gd_perm(int i) {
    return (((i % R) >> 2) * L + i / R) * 4 + (i & 3);
}
template <int R, int L>
struct GdLayout {
    static constexpr int DKP = R * L;
    static constexpr int COLS = GD_THREADS / L;
    static constexpr int OFF_QK = 0;
    static constexpr int OFF_V = GD_CHUNK * 2 * DKP;
    static constexpr int RAW_A = OFF_V + GD_CHUNK * COLS;
    static constexpr int RAW_B = RAW_A + GD_CHUNK;
    static constexpr int DECAY = RAW_B + GD_CHUNK;
    static constexpr int BETA = DECAY + GD_CHUNK;
    static constexpr int STAGE = BETA + GD_CHUNK;  // a multiple of 16 floats
    static constexpr int OPART = GD_CHUNK * COLS * L;
};

// Issues (one cp.async group per thread) the copies of tokens t0..t0+nt of this block's
// inputs into `st`: q and k rows of key head kh, v of columns col0.., a and b of head h.
template <int R, int L>
__device__ __forceinline__ void gd_stage(float* st, const float* __restrict__ qkv, const float* __restrict__ a_in,
                                         const float* __restrict__ b_in, int t0, int nt, int h, int kh, int col0,
                                         int nv, int dk, int dv, int key_dim, int conv_dim, bool vec) {
    using Ly = GdLayout<R, L>;
    const int tid = threadIdx.x;
    if (vec) {
        const int n4 = dk >> 2;  // float4 per q (or k) row
        for (int i = tid; i < nt * 2 * n4; i += GD_THREADS) {
            const int t = i / (2 * n4), r = i - t * 2 * n4;
            const int which = r >= n4, e = 4 * (r - which * n4);
            gd_cp16(st + Ly::OFF_QK + t * 2 * Ly::DKP + which * Ly::DKP + gd_perm<R, L>(e),
                    qkv + (long long)(t0 + t) * conv_dim + which * key_dim + kh * dk + e);
        }
    } else {
        for (int i = tid; i < nt * 2 * dk; i += GD_THREADS) {
            const int t = i / (2 * dk), r = i - t * 2 * dk;
            const int which = r >= dk, e = r - which * dk;
            gd_cp4(st + Ly::OFF_QK + t * 2 * Ly::DKP + which * Ly::DKP + gd_perm<R, L>(e),
                   qkv + (long long)(t0 + t) * conv_dim + which * key_dim + kh * dk + e);
        }
    }
    const int cols = min(Ly::COLS, dv - col0);
    for (int i = tid; i < nt * cols; i += GD_THREADS) {
        const int t = i / cols, c = i - t * cols;
        gd_cp4(st + Ly::OFF_V + t * Ly::COLS + c, qkv + (long long)(t0 + t) * conv_dim + 2 * key_dim + h * dv + col0 + c);
    }
    if (tid < nt) {
        gd_cp4(st + Ly::RAW_A + tid, a_in + (long long)(t0 + tid) * nv + h);
        gd_cp4(st + Ly::RAW_B + tid, b_in + (long long)(t0 + tid) * nv + h);
    }
    gd_cp_commit();
}

// Per-token values that do not depend on the state, for the nt tokens of a staged chunk:
// group g of L lanes normalises tokens g, g+G, ... in place (the L2 norms of q and k over
// the head in exactly the per-token order of the recurrence: R-row partial sums, then the
// xor butterfly), and every thread computes decay and beta of token tid % GD_CHUNK (the
// first GD_CHUNK threads store them). Rows past dk read as zero and are stored as zero.
template <int R, int L>
__device__ __forceinline__ void gd_prep(float* st, int nt, int dk, float A, float dtb, float scale) {
    using Ly = GdLayout<R, L>;
    constexpr int G = GD_THREADS / L;
    const int rg = (threadIdx.x & 31) % L, g = threadIdx.x / L;
    {
        const int ta = threadIdx.x % GD_CHUNK;
        const float decay = expf(A * gd_softplus(st[Ly::RAW_A + ta] + dtb));
        const float beta = gd_sigmoid(st[Ly::RAW_B + ta]);
        if (threadIdx.x < nt) {
            st[Ly::DECAY + ta] = decay;
            st[Ly::BETA + ta] = beta;
        }
    }
#pragma unroll
    for (int tb = 0; tb < GD_CHUNK; tb += G) {
        const int t = tb + g;
        const bool valid = t < nt;
        float* qp = st + Ly::OFF_QK + (valid ? t : 0) * 2 * Ly::DKP;
        float* kp = qp + Ly::DKP;
        float q[R], k[R];
#pragma unroll
        for (int m = 0; m < R / 4; m++) {
            const float4 fq = reinterpret_cast<const float4*>(qp)[m * L + rg];
            const float4 fk = reinterpret_cast<const float4*>(kp)[m * L + rg];
            const int i = rg * R + 4 * m;
            q[4 * m] = valid && i < dk ? fq.x : 0.f;
            q[4 * m + 1] = valid && i + 1 < dk ? fq.y : 0.f;
            q[4 * m + 2] = valid && i + 2 < dk ? fq.z : 0.f;
            q[4 * m + 3] = valid && i + 3 < dk ? fq.w : 0.f;
            k[4 * m] = valid && i < dk ? fk.x : 0.f;
            k[4 * m + 1] = valid && i + 1 < dk ? fk.y : 0.f;
            k[4 * m + 2] = valid && i + 2 < dk ? fk.z : 0.f;
            k[4 * m + 3] = valid && i + 3 < dk ? fk.w : 0.f;
        }
        // L2 norms of q and k over the whole head (eps inside the root, as fla/transformers).
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int ii = 0; ii < R; ii++) {
            sq += q[ii] * q[ii];
            sk += k[ii] * k[ii];
        }
        sq = gd_sum<L>(sq);
        sk = gd_sum<L>(sk);
        const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
#pragma unroll
        for (int ii = 0; ii < R; ii++) {
            k[ii] *= ik;
            q[ii] = (q[ii] * iq) * scale;
        }
        if (valid) {
#pragma unroll
            for (int m = 0; m < R / 4; m++) {
                reinterpret_cast<float4*>(qp)[m * L + rg] = make_float4(q[4 * m], q[4 * m + 1], q[4 * m + 2], q[4 * m + 3]);
                reinterpret_cast<float4*>(kp)[m * L + rg] = make_float4(k[4 * m], k[4 * m + 1], k[4 * m + 2], k[4 * m + 3]);
            }
        }
    }
}

// Token t of a prepared chunk, as lane rg of local column lc sees it.
template <int R, int L>
__device__ __forceinline__ void gd_lds(GdIn<R>& in, const float* st, int t, int lc, int rg, bool active) {
    using Ly = GdLayout<R, L>;
    const float4* qp = reinterpret_cast<const float4*>(st + Ly::OFF_QK + t * 2 * Ly::DKP);
    const float4* kp = reinterpret_cast<const float4*>(st + Ly::OFF_QK + t * 2 * Ly::DKP + Ly::DKP);
#pragma unroll
    for (int m = 0; m < R / 4; m++) {
        const float4 fq = qp[m * L + rg], fk = kp[m * L + rg];
        in.q[4 * m] = fq.x;
        in.q[4 * m + 1] = fq.y;
        in.q[4 * m + 2] = fq.z;
        in.q[4 * m + 3] = fq.w;
        in.k[4 * m] = fk.x;
        in.k[4 * m + 1] = fk.y;
        in.k[4 * m + 2] = fk.z;
        in.k[4 * m + 3] = fk.w;
    }
    in.v = active ? st[Ly::OFF_V + t * Ly::COLS + lc] : 0.f;
    in.decay = st[Ly::DECAY + t];
    in.beta = st[Ly::BETA + t];
}

// One token of the recurrence on the lane's R state rows (the CPU's formula order):
// S ← e^g S;  kv = Sᵀk;  S ← S + k (β (v − Sᵀk))ᵀ;  o = Sᵀq on the updated state. Returns
// the lane's partial of o (its R rows); the L partials are summed by gd_flush.
template <int R, int L>
__device__ __forceinline__ float gd_step(float (&s)[R], const GdIn<R>& in) {
    float kv = 0.f;
#pragma unroll
    for (int ii = 0; ii < R; ii++) {
        s[ii] *= in.decay;
        kv += s[ii] * in.k[ii];
    }
    kv = gd_sum<L>(kv);
    const float delta = (in.v - kv) * in.beta;
    float o = 0.f;
#pragma unroll
    for (int ii = 0; ii < R; ii++) {
        s[ii] += in.k[ii] * delta;
        o += s[ii] * in.q[ii];
    }
    return o;
}

// Outputs of tokens t0..t0+nt of the chunk whose o partials are in `op` ([t][lc][rg]): the
// L partials summed in the xor butterfly's order (lane 0's: ((p0+p1)+(p2+p3))+(...)),
// stored as runs of COLS consecutive columns.
template <int R, int L>
__device__ __forceinline__ void gd_flush(const float* op, float* __restrict__ out, int t0, int nt, int h, int col0,
                                         int nv, int dv) {
    using Ly = GdLayout<R, L>;
    for (int i = threadIdx.x; i < nt * Ly::COLS; i += GD_THREADS) {
        const int t = i / Ly::COLS, c = i % Ly::COLS;
        if (col0 + c < dv) {
            float p[L];
#pragma unroll
            for (int j = 0; j < L; j++) p[j] = op[i * L + j];
#pragma unroll
            for (int o = 1; o < L; o <<= 1)
#pragma unroll
                for (int j = 0; j < L; j += 2 * o) p[j] = p[j] + p[j + o];
            out[(long long)(t0 + t) * nv * dv + (long long)h * dv + col0 + c] = p[0];
        }
    }
}

// qkv: [rows][2*nk*dk + nv*dv] (after conv + SiLU); a_in, b_in: [rows][nv]; ssm_a, dt_bias:
// [nv]; state: this layer's [nv][dv][dk] (column-major per head: a column's dk values are
// contiguous, so a lane's R rows are one aligned run); out: [rows][nv*dv].
// L lanes per state column, R rows per lane (dk <= L*R); GD_THREADS threads = COLS columns.
// Chunks of GD_CHUNK tokens: staged by cp.async one chunk ahead (double buffer), prepared
// (norms, decay, beta) by the whole block, then run token by token from shared memory.
template <int R, int L>
__device__ __forceinline__ void gd_body(const float* __restrict__ qkv, const float* __restrict__ a_in,
                                        const float* __restrict__ b_in, const float* __restrict__ ssm_a,
                                        const float* __restrict__ dt_bias, float* __restrict__ state,
                                        float* __restrict__ out, int rows, int nk, int nv, int dk, int dv,
                                        int tiled, int vec_i) {
    using Ly = GdLayout<R, L>;
    __shared__ __align__(16) float smem[2 * Ly::STAGE + Ly::OPART];
    if (rows <= 0) return;
    const bool vec = vec_i != 0;
    const int h = blockIdx.x;
    const int rg = (threadIdx.x & 31) % L, lc = threadIdx.x / L;
    const int col0 = blockIdx.y * Ly::COLS, col = col0 + lc;
    const bool active = col < dv;
    const int kh = tiled ? h % nk : h / (nv / nk);
    const int key_dim = nk * dk;
    const int conv_dim = 2 * key_dim + nv * dv;
    const int i0 = rg * R;
    float* op = smem + 2 * Ly::STAGE;
    const int nchunks = (rows + GD_CHUNK - 1) / GD_CHUNK;
    gd_stage<R, L>(smem, qkv, a_in, b_in, 0, min(GD_CHUNK, rows), h, kh, col0, nv, dk, dv, key_dim, conv_dim, vec);
    float* S = state + ((long long)h * dv + (active ? col : 0)) * dk + i0;
    float s[R];
    if (active) {
        if (vec) {
#pragma unroll
            for (int m = 0; m < R / 4; m++) {
                float4 f = i0 + 4 * m < dk ? reinterpret_cast<const float4*>(S)[m] : make_float4(0.f, 0.f, 0.f, 0.f);
                s[4 * m] = f.x;
                s[4 * m + 1] = f.y;
                s[4 * m + 2] = f.z;
                s[4 * m + 3] = f.w;
            }
        } else {
#pragma unroll
            for (int ii = 0; ii < R; ii++) s[ii] = i0 + ii < dk ? S[ii] : 0.f;
        }
    } else {
#pragma unroll
        for (int ii = 0; ii < R; ii++) s[ii] = 0.f;
    }
    const float scale = 1.f / sqrtf((float)dk);
    const float A = ssm_a[h], dtb = dt_bias[h];
    for (int c = 0; c < nchunks; c++) {
        float* st = smem + (c & 1) * Ly::STAGE;
        const int t0 = c * GD_CHUNK, nt = min(GD_CHUNK, rows - t0);
        gd_cp_wait_all();
        // Chunk c has landed; every thread is done with chunk c-1's buffer and partials.
        __syncthreads();
        if (c + 1 < nchunks)
            gd_stage<R, L>(smem + ((c + 1) & 1) * Ly::STAGE, qkv, a_in, b_in, t0 + GD_CHUNK,
                           min(GD_CHUNK, rows - t0 - GD_CHUNK), h, kh, col0, nv, dk, dv, key_dim, conv_dim, vec);
        if (c > 0) gd_flush<R, L>(op, out, t0 - GD_CHUNK, GD_CHUNK, h, col0, nv, dv);
        gd_prep<R, L>(st, nt, dk, A, dtb, scale);
        // Prepared chunk visible; chunk c-1's partials read.
        __syncthreads();
        // Two tokens per trip, the next token's shared loads issued before this one's chain.
        GdIn<R> x0, x1;
        gd_lds<R, L>(x0, st, 0, lc, rg, active);
        for (int t = 0; t < nt; t += 2) {
            if (t + 1 < nt) gd_lds<R, L>(x1, st, t + 1, lc, rg, active);
            op[(t * Ly::COLS + lc) * L + rg] = gd_step<R, L>(s, x0);
            if (t + 1 >= nt) break;
            if (t + 2 < nt) gd_lds<R, L>(x0, st, t + 2, lc, rg, active);
            op[((t + 1) * Ly::COLS + lc) * L + rg] = gd_step<R, L>(s, x1);
        }
    }
    __syncthreads();
    gd_flush<R, L>(op, out, (nchunks - 1) * GD_CHUNK, rows - (nchunks - 1) * GD_CHUNK, h, col0, nv, dv);
    if (active) {
        if (vec) {
#pragma unroll
            for (int m = 0; m < R / 4; m++)
                if (i0 + 4 * m < dk)
                    reinterpret_cast<float4*>(S)[m] = make_float4(s[4 * m], s[4 * m + 1], s[4 * m + 2], s[4 * m + 3]);
        } else {
#pragma unroll
            for (int ii = 0; ii < R; ii++)
                if (i0 + ii < dk) S[ii] = s[ii];
        }
    }
}

#define GD_KERNEL(R, L)                                                                                   \
    extern "C" __global__ void __launch_bounds__(GD_THREADS) gated_delta_r##R##_l##L(                     \
        const float* __restrict__ qkv, const float* __restrict__ a_in, const float* __restrict__ b_in,  \
        const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, float* __restrict__ state,  \
        float* __restrict__ out, int rows, int nk, int nv, int dk, int dv, int tiled, int vec) {        \
        PDL_ENTRY();                                                                                    \
        gd_body<R, L>(qkv, a_in, b_in, ssm_a, dt_bias, state, out, rows, nk, nv, dk, dv, tiled, vec);   \
    }
GD_KERNEL(8, 4)
GD_KERNEL(8, 8)
GD_KERNEL(16, 8)

__device__ __forceinline__ float gd_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// x, z: n_heads_total heads of head_dim floats; x normalised and gated in place.
extern "C" __global__ void gated_rms_norm(float* __restrict__ x, const float* __restrict__ z,
                                          const float* __restrict__ w, int n_heads_total, int head_dim,
                                          float eps) {
    PDL_ENTRY();
    int head = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (head >= n_heads_total) return;
    float* hx = x + (long long)head * head_dim;
    const float* hz = z + (long long)head * head_dim;
    float ss = 0.f;
    for (int i = lane; i < head_dim; i += 32) ss += hx[i] * hx[i];
    ss = gd_warp_sum(ss);
    float scale = 1.f / sqrtf(ss / (float)head_dim + eps);
    for (int i = lane; i < head_dim; i += 32) hx[i] = ((hx[i] * scale) * w[i]) * gd_silu(hz[i]);
}

// x: n elements (rows of `cols`); gate: one value per element (gate_cols == cols) or per row.
extern "C" __global__ void sigmoid_gate(float* __restrict__ x, const float* __restrict__ gate, long long n,
                                        int cols, int gate_cols) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate_cols == 1 ? gate[i / cols] : gate[i];
    x[i] *= gd_sigmoid(g);
}
