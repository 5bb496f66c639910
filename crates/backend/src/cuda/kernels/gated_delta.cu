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
//   VRAM ([n_v_heads][dk][dv] per layer, the CPU layout). Block = (value head h, 16 state
//   columns): 64 threads, 4 lanes per column; lane (col, rg) keeps rows rg*R..rg*R+R of
//   column col of S in registers (R = 8/16/32 for dk <= 32/64/128). Per token every lane
//   loads its R elements of q and k (4 distinct addresses per warp load: broadcasts), the
//   4 lanes of a column combine sums of squares, S·k and Sᵀq with two xor shuffles, so the
//   whole step needs no shared memory and no __syncthreads: each warp runs independently.
//   The next token's q, k, v, a, b are loaded before the current token is computed (one
//   exposed load latency per token is what bounds prefill). Decode (rows = 1): S is read
//   and written once (dk*dv*8 bytes per head), 8 blocks per head, 256 blocks for Qwen3.5-9B.
//   Prefill runs the same kernel over all rows (sequential in t, parallel over heads and
//   columns); the chunked tensor-core form is the planned next step (GATED_DELTA.md).
// - gated_rms_norm: one warp per head: x = (x * rsqrt(mean(x²) + eps)) * w * silu(z).
// - sigmoid_gate: one thread per element: x *= sigmoid(gate), gate per element or per row.

#define GD_MAX_K 8      // largest convolution kernel (Qwen3.5: 4); = MAX_CONV_KERNEL in Rust
#define CONV_ROWS 16    // rows per convolution thread; >= GD_MAX_K - 1
#define GD_COLS 16      // state columns per gated_delta block (64 threads)

__device__ __forceinline__ float gd_silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float gd_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
// PyTorch's softplus (beta 1, threshold 20), as the CPU computes it.
__device__ __forceinline__ float gd_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
// Sum over the 4 lanes of a state column (lanes 4c..4c+3); every lane gets the same value.
__device__ __forceinline__ float gd_sum4(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

// x, out: [rows][C]; w: C rows of K taps stored as `wtype`; state: this layer's [K-1][C].
extern "C" __global__ void causal_conv1d(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                         int wtype, long long w_row_bytes, float* __restrict__ state,
                                         float* __restrict__ out, int rows, int C, int K) {
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

// One token's inputs of one lane.
template <int R>
struct GdIn {
    float q[R], k[R], v, a, b;
};

template <int R>
__device__ __forceinline__ void gd_load(GdIn<R>& in, const float* __restrict__ qkv,
                                        const float* __restrict__ a_in, const float* __restrict__ b_in,
                                        int t, int h, int kh, int i0, int col, bool active, int nv, int dk,
                                        int dv, int key_dim, int conv_dim) {
    const float* row = qkv + (long long)t * conv_dim;
#pragma unroll
    for (int ii = 0; ii < R; ii++) {
        int i = i0 + ii;
        in.q[ii] = i < dk ? row[kh * dk + i] : 0.f;
        in.k[ii] = i < dk ? row[key_dim + kh * dk + i] : 0.f;
    }
    in.v = active ? row[2 * key_dim + h * dv + col] : 0.f;
    in.a = a_in[(long long)t * nv + h];
    in.b = b_in[(long long)t * nv + h];
}

// qkv: [rows][2*nk*dk + nv*dv] (after conv + SiLU); a_in, b_in: [rows][nv]; ssm_a, dt_bias:
// [nv]; state: this layer's [nv][dk][dv]; out: [rows][nv*dv].
template <int R>
__device__ __forceinline__ void gd_body(const float* __restrict__ qkv, const float* __restrict__ a_in,
                                        const float* __restrict__ b_in, const float* __restrict__ ssm_a,
                                        const float* __restrict__ dt_bias, float* __restrict__ state,
                                        float* __restrict__ out, int rows, int nk, int nv, int dk, int dv,
                                        int tiled) {
    int h = blockIdx.x;
    int lane = threadIdx.x & 31;
    int rg = lane & 3;
    int col = blockIdx.y * GD_COLS + (threadIdx.x >> 5) * 8 + (lane >> 2);
    bool active = col < dv;
    int kh = tiled ? h % nk : h / (nv / nk);
    int key_dim = nk * dk;
    int conv_dim = 2 * key_dim + nv * dv;
    int i0 = rg * R;
    float* S = state + (long long)h * dk * dv;
    float s[R];
#pragma unroll
    for (int ii = 0; ii < R; ii++) {
        int i = i0 + ii;
        s[ii] = (active && i < dk) ? S[(long long)i * dv + col] : 0.f;
    }
    const float scale = 1.f / sqrtf((float)dk);
    const float A = ssm_a[h], dtb = dt_bias[h];
    GdIn<R> nx;
    if (rows > 0) gd_load<R>(nx, qkv, a_in, b_in, 0, h, kh, i0, col, active, nv, dk, dv, key_dim, conv_dim);
    for (int t = 0; t < rows; t++) {
        GdIn<R> in = nx;
        if (t + 1 < rows)
            gd_load<R>(nx, qkv, a_in, b_in, t + 1, h, kh, i0, col, active, nv, dk, dv, key_dim, conv_dim);
        // L2 norms of q and k over the whole head (eps inside the root, as fla/transformers).
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int ii = 0; ii < R; ii++) {
            sq += in.q[ii] * in.q[ii];
            sk += in.k[ii] * in.k[ii];
        }
        sq = gd_sum4(sq);
        sk = gd_sum4(sk);
        const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
        const float decay = expf(A * gd_softplus(in.a + dtb));
        const float beta = gd_sigmoid(in.b);
        // S ← e^g S;  kv = Sᵀk
        float kv = 0.f;
#pragma unroll
        for (int ii = 0; ii < R; ii++) {
            in.k[ii] *= ik;
            in.q[ii] = (in.q[ii] * iq) * scale;
            s[ii] *= decay;
            kv += s[ii] * in.k[ii];
        }
        kv = gd_sum4(kv);
        // S ← S + k (β (v − Sᵀk))ᵀ;  o = Sᵀq
        const float delta = (in.v - kv) * beta;
        float o = 0.f;
#pragma unroll
        for (int ii = 0; ii < R; ii++) {
            s[ii] += in.k[ii] * delta;
            o += s[ii] * in.q[ii];
        }
        o = gd_sum4(o);
        if (active && rg == 0) out[(long long)t * nv * dv + (long long)h * dv + col] = o;
    }
#pragma unroll
    for (int ii = 0; ii < R; ii++) {
        int i = i0 + ii;
        if (active && i < dk) S[(long long)i * dv + col] = s[ii];
    }
}

#define GD_KERNEL(R)                                                                                     \
    extern "C" __global__ void __launch_bounds__(64) gated_delta_r##R(                                   \
        const float* __restrict__ qkv, const float* __restrict__ a_in, const float* __restrict__ b_in,  \
        const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, float* __restrict__ state,  \
        float* __restrict__ out, int rows, int nk, int nv, int dk, int dv, int tiled) {                 \
        gd_body<R>(qkv, a_in, b_in, ssm_a, dt_bias, state, out, rows, nk, nv, dk, dv, tiled);           \
    }
GD_KERNEL(8)
GD_KERNEL(16)
GD_KERNEL(32)

__device__ __forceinline__ float gd_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// x, z: n_heads_total heads of head_dim floats; x normalised and gated in place.
extern "C" __global__ void gated_rms_norm(float* __restrict__ x, const float* __restrict__ z,
                                          const float* __restrict__ w, int n_heads_total, int head_dim,
                                          float eps) {
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
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate_cols == 1 ? gate[i / cols] : gate[i];
    x[i] *= gd_sigmoid(g);
}
