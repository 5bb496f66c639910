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
//   state column are contiguous). Block = (value head h, 64/L state columns), 64 threads,
//   L lanes per column (L = 8 for dk > 32); lane (col, rg) keeps rows rg*R..rg*R+R of
//   column col in registers (R = 8 or 16). Per token every lane loads its R elements of q
//   and k (float4 loads when dk and conv_dim are multiples of 4; L distinct addresses per
//   column group: broadcasts), the L lanes of a column combine sums of squares, S·k and Sᵀq
//   with xor shuffles: no shared memory and no __syncthreads, each warp runs on its own.
//   The next token's q, k, v, a, b are loaded before the current token is computed. The
//   serial chain per token (3 reductions of log2(L) shuffles, 3R FMAs) is what bounds
//   prefill, so L = 8 halves it against 4 lanes and doubles the warps in flight.
//   Decode (rows = 1): S is read and written once, as float4 runs of the column
//   (dk*dv*8 bytes per head); 512 blocks for Qwen3.5-9B. Prefill runs the same kernel over
//   all rows (sequential in t, parallel over heads and columns); the chunked tensor-core
//   form is the planned next step (GATED_DELTA.md).
// - gated_rms_norm: one warp per head: x = (x * rsqrt(mean(x²) + eps)) * w * silu(z).
// - sigmoid_gate: one thread per element: x *= sigmoid(gate), gate per element or per row.

#define GD_MAX_K 8      // largest convolution kernel (Qwen3.5: 4); = MAX_CONV_KERNEL in Rust
#define CONV_ROWS 16    // rows per convolution thread; >= GD_MAX_K - 1
#define GD_THREADS 64   // threads per gated_delta block

__device__ __forceinline__ float gd_silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float gd_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
// PyTorch's softplus (beta 1, threshold 20), as the CPU computes it.
__device__ __forceinline__ float gd_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

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

// R consecutive floats from p (rows i0.. of a head; zero past dk). `vec`: p, i0 and dk
// are multiples of 4 floats, so float4 loads are aligned and never straddle dk.
template <int R>
__device__ __forceinline__ void gd_rows(float (&x)[R], const float* __restrict__ p, int i0, int dk, bool vec) {
    if (vec) {
#pragma unroll
        for (int m = 0; m < R / 4; m++) {
            float4 f = i0 + 4 * m < dk ? reinterpret_cast<const float4*>(p)[m] : make_float4(0.f, 0.f, 0.f, 0.f);
            x[4 * m] = f.x;
            x[4 * m + 1] = f.y;
            x[4 * m + 2] = f.z;
            x[4 * m + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int ii = 0; ii < R; ii++) x[ii] = i0 + ii < dk ? p[ii] : 0.f;
    }
}

template <int R>
__device__ __forceinline__ void gd_load(GdIn<R>& in, const float* __restrict__ qkv,
                                        const float* __restrict__ a_in, const float* __restrict__ b_in,
                                        int t, int h, int kh, int i0, int col, bool active, int nv, int dk,
                                        int dv, int key_dim, int conv_dim, bool vec) {
    const float* row = qkv + (long long)t * conv_dim;
    gd_rows<R>(in.q, row + kh * dk + i0, i0, dk, vec);
    gd_rows<R>(in.k, row + key_dim + kh * dk + i0, i0, dk, vec);
    in.v = active ? row[2 * key_dim + h * dv + col] : 0.f;
    in.a = a_in[(long long)t * nv + h];
    in.b = b_in[(long long)t * nv + h];
}

// Sum over the L lanes of a state column (lanes L·c .. L·c+L-1); every lane gets the same
// value (xor butterflies: the same additions in every lane).
template <int L>
__device__ __forceinline__ float gd_sum(float v) {
#pragma unroll
    for (int o = 1; o < L; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// qkv: [rows][2*nk*dk + nv*dv] (after conv + SiLU); a_in, b_in: [rows][nv]; ssm_a, dt_bias:
// [nv]; state: this layer's [nv][dv][dk] (column-major per head: a column's dk values are
// contiguous, so a lane's R rows are one aligned run); out: [rows][nv*dv].
// L lanes per state column, R rows per lane (dk <= L*R); 64 threads = 64/L columns.
template <int R, int L>
__device__ __forceinline__ void gd_body(const float* __restrict__ qkv, const float* __restrict__ a_in,
                                        const float* __restrict__ b_in, const float* __restrict__ ssm_a,
                                        const float* __restrict__ dt_bias, float* __restrict__ state,
                                        float* __restrict__ out, int rows, int nk, int nv, int dk, int dv,
                                        int tiled, int vec_i) {
    const bool vec = vec_i != 0;
    int h = blockIdx.x;
    int lane = threadIdx.x & 31;
    int rg = lane % L;
    int col = blockIdx.y * (GD_THREADS / L) + (threadIdx.x >> 5) * (32 / L) + lane / L;
    bool active = col < dv;
    int kh = tiled ? h % nk : h / (nv / nk);
    int key_dim = nk * dk;
    int conv_dim = 2 * key_dim + nv * dv;
    int i0 = rg * R;
    float* S = state + ((long long)h * dv + (active ? col : 0)) * dk + i0;
    float s[R];
    if (active) {
        gd_rows<R>(s, S, i0, dk, vec);
    } else {
#pragma unroll
        for (int ii = 0; ii < R; ii++) s[ii] = 0.f;
    }
    const float scale = 1.f / sqrtf((float)dk);
    const float A = ssm_a[h], dtb = dt_bias[h];
    GdIn<R> nx;
    if (rows > 0) gd_load<R>(nx, qkv, a_in, b_in, 0, h, kh, i0, col, active, nv, dk, dv, key_dim, conv_dim, vec);
    for (int t = 0; t < rows; t++) {
        GdIn<R> in = nx;
        if (t + 1 < rows)
            gd_load<R>(nx, qkv, a_in, b_in, t + 1, h, kh, i0, col, active, nv, dk, dv, key_dim, conv_dim, vec);
        // L2 norms of q and k over the whole head (eps inside the root, as fla/transformers).
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int ii = 0; ii < R; ii++) {
            sq += in.q[ii] * in.q[ii];
            sk += in.k[ii] * in.k[ii];
        }
        sq = gd_sum<L>(sq);
        sk = gd_sum<L>(sk);
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
        kv = gd_sum<L>(kv);
        // S ← S + k (β (v − Sᵀk))ᵀ;  o = Sᵀq
        const float delta = (in.v - kv) * beta;
        float o = 0.f;
#pragma unroll
        for (int ii = 0; ii < R; ii++) {
            s[ii] += in.k[ii] * delta;
            o += s[ii] * in.q[ii];
        }
        o = gd_sum<L>(o);
        if (active && rg == 0) out[(long long)t * nv * dv + (long long)h * dv + col] = o;
    }
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
