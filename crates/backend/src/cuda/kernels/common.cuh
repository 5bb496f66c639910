// common.cuh — prepended to every kernel file.
//
// The ggml block types as they sit in VRAM (exactly the GGUF bytes; no repacking here), and
// a reference per-element decoder used by the simple kernels (embedding rows, expert
// weights). The GEMV/matmul kernels have their own vectorised decoders; they must agree
// with these, which `ferrite check` verifies through the CPU oracle.
//
// Type ids are ggml's (see ferrite_formats::GgmlType::id).

#include <cuda_fp16.h>
#include <cuda_bf16.h>
// NVRTC has no libc headers: the fixed-width types it needs, spelled out.
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef short int16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;

#define GGML_F32 0
#define GGML_F16 1
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define GGML_BF16 30

// Bytes per block / elements per block.
#define Q4_0_BYTES 18
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176
#define Q6_K_BYTES 210
#define QK 32
#define QK_K 256

__device__ __forceinline__ float f16_at(const uint8_t* p) {
    // Blocks are only 2-byte aligned: assemble the half from bytes.
    unsigned short u = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
    return __half2float(__ushort_as_half(u));
}

__device__ __forceinline__ float bf16_at(const uint8_t* p) {
    unsigned int u = ((unsigned int)p[0] | ((unsigned int)p[1] << 8)) << 16;
    return __uint_as_float(u);
}

// EMU_SM_BEGIN (host emulation: tests/gemv_tm_emu.rs)
// ggml's get_scale_min_k4: 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block
// (s: its 12 scale bytes).
__device__ __forceinline__ void scale_min_k4_int(int j, const uint8_t* s, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
// EMU_SM_END

// The same as floats (exact: at most 63).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* s, float* sc, float* m) {
    int si, mi;
    scale_min_k4_int(j, s, si, mi);
    *sc = (float)si;
    *m = (float)mi;
}

// Element i of a row stored as `type` (row points at the row's first byte).
__device__ float ggml_get(const uint8_t* row, int type, int i) {
    switch (type) {
    case GGML_F32: {
        const uint8_t* p = row + 4 * (size_t)i;
        unsigned int u = (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
        return __uint_as_float(u);
    }
    case GGML_F16: return f16_at(row + 2 * (size_t)i);
    case GGML_BF16: return bf16_at(row + 2 * (size_t)i);
    case GGML_Q4_0: {
        const uint8_t* b = row + (size_t)(i / QK) * Q4_0_BYTES;
        int j = i % QK;
        int q = j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4);
        return (float)(q - 8) * f16_at(b);
    }
    case GGML_Q4_1: {
        const uint8_t* b = row + (size_t)(i / QK) * Q4_1_BYTES;
        int j = i % QK;
        int q = j < 16 ? (b[4 + j] & 0xF) : (b[4 + j - 16] >> 4);
        return (float)q * f16_at(b) + f16_at(b + 2);
    }
    case GGML_Q8_0: {
        const uint8_t* b = row + (size_t)(i / QK) * Q8_0_BYTES;
        return (float)(int8_t)b[2 + i % QK] * f16_at(b);
    }
    case GGML_Q4_K: {
        const uint8_t* b = row + (size_t)(i / QK_K) * Q4_K_BYTES;
        int r = i % QK_K, g = r / 64, w = r % 64, l = w % 32;
        float sc, m;
        scale_min_k4(2 * g + (w >= 32), b + 4, &sc, &m);
        uint8_t byte = b[16 + g * 32 + l];
        int q = w < 32 ? (byte & 0xF) : (byte >> 4);
        return f16_at(b) * sc * (float)q - f16_at(b + 2) * m;
    }
    case GGML_Q5_K: {
        const uint8_t* b = row + (size_t)(i / QK_K) * Q5_K_BYTES;
        int r = i % QK_K, g = r / 64, w = r % 64, l = w % 32;
        float sc, m;
        scale_min_k4(2 * g + (w >= 32), b + 4, &sc, &m);
        uint8_t byte = b[48 + g * 32 + l];
        int q = w < 32 ? (byte & 0xF) : (byte >> 4);
        int hb = (b[16 + l] >> (2 * g + (w >= 32))) & 1;
        return f16_at(b) * sc * (float)(q + 16 * hb) - f16_at(b + 2) * m;
    }
    case GGML_Q6_K: {
        const uint8_t* b = row + (size_t)(i / QK_K) * Q6_K_BYTES;
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* sc = (const int8_t*)(b + 192);
        float d = f16_at(b + 208);
        int r = i % QK_K, n = r / 128, rr = r % 128, quarter = rr / 32, l = rr % 32;
        uint8_t lo = ql[64 * n + l + (quarter & 1) * 32];
        int low = quarter >= 2 ? (lo >> 4) : (lo & 0xF);
        int high = (qh[32 * n + l] >> (2 * quarter)) & 3;
        int q = (low | (high << 4)) - 32;
        return d * (float)sc[8 * n + l / 16 + 2 * quarter] * (float)q;
    }
    default: return __int_as_float(0x7fc00000);  // NaN: an unknown type must never pass check
    }
}

// The FFN's activation silu(g) · u as the elementwise `swiglu` kernel computes it; the fused
// gate/up/SwiGLU prefill launch (mmw.cu) calls the same function, so the two agree.
__device__ __forceinline__ float swiglu_f(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// The block timeline's hooks (FERRITE_DIAG_TL): kernels/timeline.cuh defines them when the
// switch is set; otherwise they are empty.
#ifndef FERRITE_TL
#define TL_WAIT_BEGIN()
#define TL_WAIT_DONE()
#define TL_STAMP_END()
#endif

// Programmatic dependent launch (launch.rs). Kernels are launched so that they may start
// while their predecessor in the stream still runs. `pdl_wait` blocks until that predecessor
// grid has completed and its memory is visible: nothing that a predecessor reads or writes
// may be touched before it (reading weights, which no kernel writes, may). Each kernel
// waits at entry unless it has independent work to issue first, then lets its own successor
// launch (`pdl_launch_dependents`): the successor's blocks are scheduled as this grid's
// blocks retire, and its wait covers the whole chain (this grid cannot complete before its
// own wait returned). Before sm_90 (and when launched without the attribute) both are no-ops.
__device__ __forceinline__ void pdl_wait() {
    TL_WAIT_BEGIN();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    TL_WAIT_DONE();
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define PDL_ENTRY()                                                                                \
    do {                                                                                           \
        pdl_wait();                                                                                \
        pdl_launch_dependents();                                                                   \
    } while (0)
// PDL_ENTRY, or where `early` holds the other order: the successor launched before this
// kernel's own wait, so that the GEMV after a small kernel is scheduled (and copies its
// weights) while the kernel before this one still runs. Safe: the successor's own wait covers
// this grid's completion, which follows this grid's wait (quant_x_q8, MATMUL.md round 25).
#define PDL_ENTRY_IF_EARLY(early)                                                                  \
    do {                                                                                           \
        if (early) {                                                                               \
            pdl_launch_dependents();                                                               \
            pdl_wait();                                                                            \
        } else {                                                                                   \
            PDL_ENTRY();                                                                           \
        }                                                                                          \
    } while (0)

// Shared-memory tile plumbing of the tensor-core kernels (matmul.cu's mm_, mmq.cu, mmw.cu,
// attention.cu's prefill): four 8×8 b16 matrices per warp by ldmatrix (row addresses from
// lanes 0-7, 8-15, 16-23, 24-31), plain or transposed, and a 16-byte cp.async whose
// src_bytes = 0 zero-fills the destination without reading src.
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Thread-block clusters (sm_90+): a barrier of every thread of the cluster's blocks whose
// release / acquire makes shared-memory writes before it visible to reads after it in any
// block of the cluster; a float of cluster block `rank`'s shared memory at the offset of p in
// this block's (mapa), read or written (attention.cu's split merge, matmul.cu's MoE gate/up).
__device__ __forceinline__ void cluster_sync_all() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __trap();  // clusters are sm_90+; the launcher never picks these kernels below
#endif
}

// An execution barrier of the cluster (no memory ordering), for the last barrier of an exchange:
// it keeps every block alive until the others' reads of its shared memory have returned (each
// reader used the values before it arrives), which needs no release / acquire; a release
// arrive is a MEMBAR.ALL.GPU, a wait for every global store before it (ATTENTION.md, 30th
// session: the decode attention's split merge).
__device__ __forceinline__ void cluster_sync_exec() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
    __trap();  // clusters are sm_90+; the launcher never picks these kernels below
#endif
}

// cluster_sync_all, or under FERRITE_DIAG_CLBAR's bit `bit` (a timing diagnostic: DIAG_CLBAR is
// defined for the build) a relaxed cluster barrier after a CTA-scope fence, which drops the
// release's MEMBAR.ALL.GPU and stands outside the memory model's guarantees for the shared
// memory it publishes. Bits: 1 the decode attention's split merge, 2 the MoE gate/up's h.
__device__ __forceinline__ void cluster_sync_diag(int bit) {
#if defined(DIAG_CLBAR) && __CUDA_ARCH__ >= 900
    if (DIAG_CLBAR & bit) {
        asm volatile("fence.acq_rel.cta;\n" ::: "memory");
        cluster_sync_exec();
        return;
    }
#endif
    cluster_sync_all();
}

// The float at `p` (this block's shared memory) in the shared memory of cluster block `rank`.
// The shared::cluster address of `p` (this block's shared memory) in cluster block `rank`.
__device__ __forceinline__ uint32_t cluster_addr(const void* p, int rank) {
    uint32_t r = 0;
#if __CUDA_ARCH__ >= 900
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
#endif
    return r;
}

__device__ __forceinline__ float ld_cluster_f32(const float* p, int rank) {
#if __CUDA_ARCH__ >= 900
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
#else
    __trap();
    return 0.f;
#endif
}

// The same for four floats (p 16-byte aligned): mmw.cu's K-split TA tile reading the other
// block's partial sums.
__device__ __forceinline__ float4 ld_cluster_f32x4(const float* p, int rank) {
#if __CUDA_ARCH__ >= 900
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(cluster_addr(p, rank))
                 : "memory");
    return v;
#else
    __trap();
    return make_float4(0.f, 0.f, 0.f, 0.f);
#endif
}

__device__ __forceinline__ void st_cluster_f32(float* p, int rank, float v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(cluster_addr(p, rank)), "f"(v) : "memory");
#else
    __trap();
#endif
}

// One L2 prefetch of `bytes` (a multiple of 16) from the 16-byte aligned global address p
// (the TMA unit walks the range; a hint: no completion, nothing written). attention.cu's
// K/V prefetch, matmul.cu's MoE down rows.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned int bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// This block's rank in its cluster (0 without clusters).
__device__ __forceinline__ int cluster_rank() {
#if __CUDA_ARCH__ >= 900
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
#else
    return 0;
#endif
}

// EMU_Q8_BEGIN (host emulation: tests/gemv_tc2_emu.rs)
// The two-plane int8 quantization of x for the dp4a GEMV (matmul.cu, section 1b), one warp per
// 32-element block, lane = element: v ~ d (127 hi + lo) with d = amax / 127^2: hi =
// rint(v / d1), d1 = amax / 127; lo = rint((v - hi d1) / d): |v - hi d1| <= d1 / 2, so |lo|
// <= 64, error <= d / 2. Writes hi at xr[col], lo at xr[n_in + col] and, from lane 0, the
// block's (d, d * sum(127 hi + lo)) at *xd. Shared by quant_x_q8 and the fused add_rms_norm
// (elementwise.cu) so both produce the same bits.
__device__ __forceinline__ void quant_q8_lane(float v, int lane, int8_t* __restrict__ xr, int n_in, int col,
                                              float2* __restrict__ xd) {
    float amax = fabsf(v);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    int hi = 0, lo = 0;
    float d = 0.0f;
    if (amax > 0.0f) {
        const float d1 = amax / 127.0f;
        d = d1 / 127.0f;
        hi = (int)rintf(v * (127.0f / amax));
        lo = (int)rintf((v - (float)hi * d1) / d);
        lo = lo > 127 ? 127 : (lo < -127 ? -127 : lo);
    }
    int sum = 127 * hi + lo;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    xr[col] = (int8_t)hi;
    xr[n_in + col] = (int8_t)lo;
    if (lane == 0) *xd = make_float2(d, d * (float)sum);
}
// EMU_Q8_END

// Stores a warp's mma.sync accumulators: 2 m-tiles of 16 outputs × NT n-tiles of 8 tokens
// (m16n8k16 bf16 in matmul.cu's mm_, m16n8k32 s8 in mmq.cu: the same C fragment). Fragment
// (PTX ISA; g = lane / 4, t4 = lane % 4): c0, c1 = (output g, tokens 2 t4, 2 t4 + 1); c2, c3 =
// output g + 8. o_w, t_w: the warp's first output and token; outputs >= n_out and tokens >=
// rows are not stored.
template <int NT>
__device__ __forceinline__ void mma_store_c(const float (&acc)[2][NT][4], float* __restrict__ out, int o_w, int t_w,
                                            int g, int t4, int n_out, int rows) {
#pragma unroll
    for (int mi = 0; mi < 2; mi++) {
#pragma unroll
        for (int ni = 0; ni < NT; ni++) {
            const int o = o_w + mi * 16 + g;
            const int t = t_w + ni * 8 + 2 * t4;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int oo = o + (k >= 2 ? 8 : 0), tt = t + (k & 1);
                if (oo < n_out && tt < rows) out[(size_t)tt * n_out + oo] = acc[mi][ni][k];
            }
        }
    }
}

// A float as the f16 KV cache holds it: saturated to ±65504 (NaN kept), rounded to nearest. The
// kv store's bits (attention.cu kv_store, and qk_norm_rope_kv in elementwise.cu, which must
// store what kv_store would).
__device__ __forceinline__ unsigned short f32_to_f16_sat(float x) {
    float c = (x != x) ? x : fminf(fmaxf(x, -65504.f), 65504.f);
    return __half_as_ushort(__float2half_rn(c));
}

