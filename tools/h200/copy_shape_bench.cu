// How fast the H200 streams weights into shared memory by bulk copies (cp.async.bulk, the TMA
// engine), by the shape of what one copy takes — the question behind MATMUL.md round 59: the
// decode GEMVs whose tiles are K slices of rows (16 pieces of 2,176 bytes, 13 KB apart: the
// K-split down) stream at ~2.9 TB/s where whole rows reach ~3.6, and the SwiGLU ring in K slices
// lost 20% to the ring of whole rows. Is it the copy shape (DRAM), or the kernels?
//
// The buffer is `rows` rows of `rb` bytes (a weight). An item is `nr` rows' slice [k0, k0 + p)
// (p = rb: whole rows): nr pieces of p bytes, rb apart, or one copy where the item is one
// contiguous span and `one` is set. Two forms:
//   ring: persistent blocks (bps per SM), each a ring of nb item buffers over a contiguous
//         range of items (slices of a tile fastest); a buffer is refilled as soon as it lands
//         (after an optional busy wait of `delay` ns standing for the tile's compute);
//   tile: one block per item (the one-tile GEMV blocks), as many per SM as fit.
// Nothing is computed; each item's first word is summed so the copies cannot be dropped.
//
//   nvcc -O3 -arch=sm_90a tools/h200/copy_shape_bench.cu -o /tmp/copy_shape && /tmp/copy_shape
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cuda_runtime.h>

#define CK(x)                                                                                 \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                  \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(b), "r"(parity)
            : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint64_t* bar, uint8_t* dst, const uint8_t* src, uint32_t bytes) {
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
            "r"((uint32_t)__cvta_generic_to_shared(dst)),
        "l"(src), "r"(bytes), "r"((uint32_t)__cvta_generic_to_shared(bar)), "l"(pol)
        : "memory");
}

struct Shape {
    long long rb;  // row bytes
    int nr;        // rows per item
    int p;         // bytes per piece (a K slice of a row; rb: whole rows)
    int one;       // one copy per item where the item is contiguous (p == rb)
    int ks;        // slices per row: rb / p
    long long items;
    int delay;     // ns of busy wait per item after it lands
    long long pad; // bytes between pieces in shared memory beyond p (the kernels' 16)
};

__device__ void issue(const Shape& s, const uint8_t* w, long long i, uint8_t* buf, uint64_t* bar) {
    const int lane = threadIdx.x & 31;
    const long long t = i / s.ks;
    const int k = (int)(i % s.ks);
    const uint8_t* src = w + (size_t)t * s.nr * s.rb + (size_t)k * s.p;
    if (s.one && s.p == s.rb) {
        if (lane == 0) {
            mbar_expect(bar, (uint32_t)(s.nr * s.p));
            bulk_g2s(bar, buf, src, (uint32_t)(s.nr * s.p));
        }
        return;
    }
    if (lane == 0) mbar_expect(bar, (uint32_t)(s.nr * s.p));
    __syncwarp();
    for (int j = lane; j < s.nr; j += 32)
        bulk_g2s(bar, buf + (size_t)j * (s.p + s.pad), src + (size_t)j * s.rb, (uint32_t)s.p);
}

__device__ void spin(int ns) {
    if (ns <= 0) return;
    long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 >= ns) break;
    }
}

__global__ void ring(Shape s, const uint8_t* w, int nb, unsigned long long* sink) {
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ __align__(8) uint64_t bars[8];
    const size_t slot = ((size_t)s.nr * (s.p + s.pad) + 127) & ~(size_t)127;
    const long long lo = (long long)blockIdx.x * s.items / gridDim.x;
    const long long hi = (long long)(blockIdx.x + 1) * s.items / gridDim.x;
    if (threadIdx.x < nb) mbar_init(bars + threadIdx.x);
    __syncthreads();
    if (threadIdx.x < 32)
        for (int b = 0; b < nb && lo + b < hi; b++) issue(s, w, lo + b, smem + b * slot, bars + b);
    unsigned long long acc = 0;
    int b = 0, ph = 0;
    for (long long i = lo; i < hi; i++) {
        mbar_wait(bars + b, (uint32_t)ph);
        if (threadIdx.x == 0) acc += smem[b * slot];
        if (threadIdx.x == 0) spin(s.delay);
        __syncthreads();
        if (threadIdx.x < 32 && i + nb < hi) issue(s, w, i + nb, smem + b * slot, bars + b);
        if (++b == nb) b = 0, ph ^= 1;
    }
    if (threadIdx.x == 0 && acc == 0x1234567) *sink = acc;
}

__global__ void tile(Shape s, const uint8_t* w, unsigned long long* sink) {
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ __align__(8) uint64_t bar;
    if (threadIdx.x == 0) mbar_init(&bar);
    __syncthreads();
    if (threadIdx.x < 32) issue(s, w, blockIdx.x, smem, &bar);
    mbar_wait(&bar, 0);
    if (threadIdx.x == 0) spin(s.delay);
    if (threadIdx.x == 0 && smem[0] == 0x12) *sink = smem[1];
}

// The same bytes by plain 16-byte loads (the LSU path, no TMA): each thread keeps U loads in
// flight, grid-stride over the span.
template <int U>
__global__ void lsu(const int4* __restrict__ w, long long n16, unsigned long long* sink) {
    const long long nt = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int acc = 0;
    for (; i + (U - 1) * nt < n16; i += U * nt) {
        int4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = __ldcs(w + i + u * nt);
#pragma unroll
        for (int u = 0; u < U; u++) acc ^= v[u].x ^ v[u].w;
    }
    for (; i < n16; i += nt) acc ^= __ldcs(w + i).x;
    if (acc == 0x1234567) *sink = acc;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute(ring, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    CK(cudaFuncSetAttribute(tile, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    const size_t total = (size_t)2 << 30;
    uint8_t* w;
    unsigned long long* sink;
    CK(cudaMalloc(&w, total));
    CK(cudaMemset(w, 1, total));
    CK(cudaMalloc(&sink, 8));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    // (name, rb, nr, p, one, form 0 ring / 1 tile, nb or blocks a SM, bytes a launch, delay ns)
    struct Case {
        const char* name;
        long long rb;
        int nr, p, one, form, nb;
        double mb;
        int delay;
        int fixed = 0;  // 1: every launch reads the same span (L2-resident when it fits)
    };
    const Case cases[] = {
        {"swiglu rows 16x4352 ring nb2", 4352, 16, 4352, 0, 0, 2, 107, 0},
        {"swiglu rows 16x4352 ring nb2 one copy", 4352, 16, 4352, 1, 0, 2, 107, 0},
        {"swiglu rows 16x4352 ring nb3", 4352, 16, 4352, 0, 0, 3, 107, 0},
        {"swiglu rows ring nb2 delay 1000", 4352, 16, 4352, 0, 0, 2, 107, 1000},
        {"swiglu slices 16x2176 ring nb4", 4352, 16, 2176, 0, 0, 4, 107, 0},
        {"swiglu rows 16x4352 tile", 4352, 16, 4352, 0, 1, 0, 107, 0},
        {"down slices 16x2176/13056 ring nb4", 13056, 16, 2176, 0, 0, 4, 53.5, 0},
        {"down slices 16x2176/13056 ring nb6", 13056, 16, 2176, 0, 0, 6, 53.5, 0},
        {"down slices 16x2176/13056 tile", 13056, 16, 2176, 0, 1, 0, 53.5, 0},
        {"down rows 8x13056 ring nb2", 13056, 8, 13056, 0, 0, 2, 53.5, 0},
        {"down rows 8x13056 ring nb2 one copy", 13056, 8, 13056, 1, 0, 2, 53.5, 0},
        {"down repacked 16x2176 contiguous ring nb4", 2176, 16, 2176, 0, 0, 4, 53.5, 0},
        {"down repacked 16x2176 contiguous ring nb4 one", 2176, 16, 2176, 1, 0, 4, 53.5, 0},
        {"down repacked 16x2176 contiguous tile", 2176, 16, 2176, 0, 1, 0, 53.5, 0},
        {"down repacked one 34816 tile", 2176, 16, 2176, 1, 1, 0, 53.5, 0},
        {"big: rows 16x4352 ring nb2 (1 GB)", 4352, 16, 4352, 0, 0, 2, 1024, 0},
        {"big: slices 16x2176/13056 ring nb4 (1 GB)", 13056, 16, 2176, 0, 0, 4, 1024, 0},
        {"big: slices 16x2176/13056 tile (1 GB)", 13056, 16, 2176, 0, 1, 0, 1024, 0},
        {"big: repacked 34816 tile one (1 GB)", 2176, 16, 2176, 1, 1, 0, 1024, 0},
        {"L2: swiglu rows ring nb2 (16 MB, same span)", 4352, 16, 4352, 0, 0, 2, 16, 0, 1},
        {"L2: swiglu rows ring nb2 one (16 MB, same span)", 4352, 16, 4352, 1, 0, 2, 16, 0, 1},
        {"L2: repacked 34816 tile one (16 MB, same span)", 2176, 16, 2176, 1, 1, 0, 16, 0, 1},
        {"L2: swiglu rows ring nb2 (32 MB, same span)", 4352, 16, 4352, 0, 0, 2, 32, 0, 1},
        {"DRAM: swiglu rows ring nb2 (16 MB)", 4352, 16, 4352, 0, 0, 2, 16, 0, 0},
        {"lsu U=4 107 MB", 4352, 16, 4352, 0, 2, 4, 107, 0},
        {"lsu U=8 107 MB", 4352, 16, 4352, 0, 2, 8, 107, 0},
        {"lsu U=8 53.5 MB", 4352, 16, 4352, 0, 2, 8, 53.5, 0},
        {"lsu U=8 1 GB", 4352, 16, 4352, 0, 2, 8, 1024, 0},
        {"lsu U=8 16 MB same span (L2)", 4352, 16, 4352, 0, 2, 8, 16, 0, 1},
    };
    printf("%-48s %8s %8s %9s\n", "case", "MB", "us", "TB/s");
    for (const Case& c : cases) {
        Shape s;
        s.rb = c.rb;
        s.nr = c.nr;
        s.p = c.p;
        s.one = c.one;
        s.ks = (int)(c.rb / c.p);
        s.delay = c.delay;
        s.pad = (c.one && c.p == c.rb) ? 0 : 16;
        const double item_bytes = (double)c.nr * c.p;
        s.items = (long long)(c.mb * 1e6 / item_bytes);
        s.items -= s.items % s.ks;
        const size_t slot = ((size_t)s.nr * (s.p + s.pad) + 127) & ~(size_t)127;
        // Spread successive launches over the 2 GB so that none reads from L2 what the last left.
        const size_t span = (size_t)(s.items / s.ks) * s.nr * s.rb;
        // Ten launches back to back per timing (as a step's kernels follow each other), the
        // best of five timings.
        const int per_t = 10, timings = 5;
        int per = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, ring, 256, c.nb * slot));
        float best = 1e30f;
        for (int r = 0; r < timings; r++) {
            CK(cudaEventRecord(e0));
            for (int l = 0; l < per_t; l++) {
                const uint8_t* base = c.fixed ? w : w + ((size_t)(r * per_t + l) * span) % (total - span);
                if (c.form == 2) {
                    const long long n16 = (long long)span / 16;
                    if (c.nb == 4)
                        lsu<4><<<sms * 4, 512>>>((const int4*)base, n16, sink);
                    else
                        lsu<8><<<sms * 4, 512>>>((const int4*)base, n16, sink);
                } else if (c.form == 0)
                    ring<<<sms * (per > 0 ? per : 1), 256, c.nb * slot>>>(s, base, c.nb, sink);
                else
                    tile<<<(unsigned)s.items, 128, slot>>>(s, base, sink);
            }
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            ms /= per_t;
            best = ms < best ? ms : best;
        }
        CK(cudaGetLastError());
        const double bytes = (double)s.items * item_bytes;
        printf("%-48s %8.1f %8.1f %9.2f  (%d blocks a SM)\n", c.name, bytes / 1e6, best * 1e3,
               bytes / (best * 1e-3) / 1e12, c.form == 0 ? per : 0);
    }
    return 0;
}
