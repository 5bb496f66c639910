// Host emulation of gated_delta.cu's chunked kernel (the section between the GDC_EMU
// markers, written next to this file as section.cuh by gated_delta_chunked_emu.rs).
//
// Every CUDA thread of a block is a fiber running the kernel body unchanged (../emu/fibers.h,
// written next to this file by the test). The asm wrappers are emulated:
//  - gdc_tf32: cvt.rna.tf32.f32 (round to nearest, ties away, 10 mantissa bits kept);
//  - gdc_mma3: three mma.sync.m16n8k8 tf32 (al·bh, ah·bl, ah·bh in this order): the 32
//    lanes deposit their fragments, the full 16×8 A and 8×8 B are rebuilt from the PTX ISA
//    fragment layout, and each lane computes its own four accumulators (d = c + Σ_k a·b
//    summed exactly in double and rounded once to f32: the tensor core's internal
//    accumulation order is not modelled);
//  - gdc_warp_sum: the xor butterfly (__shfl_xor_sync 16, 8, 4, 2, 1) lane by lane;
//  - cp.async: an immediate copy.
// Usage: emu IN OUT (formats: gated_delta_chunked_emu.rs).
#include <cmath>

#include "fibers.h"

#define GDC_HOST_EMU 1
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
static inline int min(int a, int b) { return a < b ? a : b; }

// Deposit words of this harness's collectives: the mma's ah[4] al[4] bh[2] bl[2], or a
// warp sum's value (word 0).
enum { AH = 0, AL = 4, BH = 8, BL = 10 };

// ---- emulated instructions -------------------------------------------------------------
static inline uint32_t gdc_tf32(float x) {
    uint32_t u = f2u(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;  // inf / nan
    return (u + 0x1000u) & 0xffffe000u;
}

// One m16n8k8 tf32 mma for the lane (g, t) = (lane / 4, lane % 4).
static void mma_one(float (&d)[4], const Deposit* all, bool a_lo, bool b_lo, int lane) {
    double A[16][8], B[8][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        const uint32_t* a = all[l].w + (a_lo ? AL : AH);
        const uint32_t* b = all[l].w + (b_lo ? BL : BH);
        // The tensor core reads 19 bits (sign, exponent, 10 mantissa) of each register.
        auto tf = [](uint32_t u) { return (double)__uint_as_float(u & 0xffffe000u); };
        A[g][t] = tf(a[0]);
        A[g + 8][t] = tf(a[1]);
        A[g][t + 4] = tf(a[2]);
        A[g + 8][t + 4] = tf(a[3]);
        B[t][g] = tf(b[0]);
        B[t + 4][g] = tf(b[1]);
    }
    const int g = lane >> 2, t = lane & 3;
    for (int q = 0; q < 4; q++) {
        const int r = g + 8 * (q >> 1), c = 2 * t + (q & 1);
        double acc = d[q];
        for (int k = 0; k < 8; k++) acc += A[r][k] * B[k][c];
        d[q] = (float)acc;
    }
}

static void gdc_mma3(float (&d)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], const uint32_t (&bh)[2],
                     const uint32_t (&bl)[2]) {
    Deposit m{};
    m.kind = 1;
    memcpy(m.w + AH, ah, sizeof ah);
    memcpy(m.w + AL, al, sizeof al);
    memcpy(m.w + BH, bh, sizeof bh);
    memcpy(m.w + BL, bl, sizeof bl);
    const Deposit* all = warp_exchange(m);
    const int lane = cur % 32;
    mma_one(d, all, true, false, lane);
    mma_one(d, all, false, true, lane);
    mma_one(d, all, false, false, lane);
}

static float gdc_warp_sum(float v) {
    Deposit m{};
    m.kind = 2;
    m.w[0] = f2u(v);
    const Deposit* all = warp_exchange(m);
    float x[32];
    for (int i = 0; i < 32; i++) x[i] = __uint_as_float(all[i].w[0]);
    for (int o = 16; o > 0; o >>= 1) {
        float y[32];
        for (int i = 0; i < 32; i++) y[i] = x[i] + x[i ^ o];
        memcpy(x, y, sizeof x);
    }
    return x[cur % 32];
}

static inline void gdc_cp4(float* dst, const float* src) { *dst = *src; }
static inline void gdc_cp16(float* dst, const float* src) {
    if (((uintptr_t)dst & 15) || ((uintptr_t)src & 15)) {
        fprintf(stderr, "cp.async 16: misaligned %p <- %p\n", (void*)dst, (const void*)src);
        exit(4);
    }
    memcpy(dst, src, 16);
}
static inline void gdc_cp_wait_all() {}

#include "section.cuh"

// ---- one launch ---------------------------------------------------------------------------
struct Args {
    const float *qkv, *a, *b, *ssm_a, *dt_bias;
    float *state, *out;
    int rows, nk, nv, dk, dv, tiled, vec;
};
static Args args;
static float* smem;

static void entry() {
    const Args& g = args;
    gdc_body(smem, g.qkv, g.a, g.b, g.ssm_a, g.dt_bias, g.state, g.out, g.rows, g.nk, g.nv, g.dk, g.dv, g.tiled,
             g.vec);
}

// Garbage in shared memory before each block: the kernel must not rely on its contents.
static void run_gdc_block(int bx, int by) {
    for (int i = 0; i < GDC_SMEM_FLOATS; i++) smem[i] = __uint_as_float(0x7fc00000u);
    run_block(bx, by, entry);
}

static void rd(FILE* f, void* p, size_t n) {
    if (fread(p, 1, n, f) != n) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
}

int main(int argc, char** argv) {
    if (argc != 3) return 1;
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    if (!in || !out) return 1;
    int32_t hd[6];  // nk nv dk dv tiled ncalls
    rd(in, hd, sizeof hd);
    const int nk = hd[0], nv = hd[1], dk = hd[2], dv = hd[3], tiled = hd[4], ncalls = hd[5];
    const int conv_dim = 2 * nk * dk + nv * dv;
    std::vector<float> ssm_a(nv), dt_bias(nv), state((size_t)nv * dv * dk);
    rd(in, ssm_a.data(), nv * 4);
    rd(in, dt_bias.data(), nv * 4);
    rd(in, state.data(), state.size() * 4);
    std::vector<float> sm_buf(GDC_SMEM_FLOATS + 4);
    smem = sm_buf.data();
    for (int call = 0; call < ncalls; call++) {
        int32_t rows;
        rd(in, &rows, 4);
        std::vector<float> qkv((size_t)rows * conv_dim), a((size_t)rows * nv), b((size_t)rows * nv);
        rd(in, qkv.data(), qkv.size() * 4);
        rd(in, a.data(), a.size() * 4);
        rd(in, b.data(), b.size() * 4);
        std::vector<float> o((size_t)rows * nv * dv, __uint_as_float(0x7fc00000u));
        args = {qkv.data(), a.data(), b.data(), ssm_a.data(), dt_bias.data(), state.data(), o.data(),
                rows,       nk,       nv,       dk,           dv,             tiled,        (dk % 4 == 0 && conv_dim % 4 == 0) ? 1 : 0};
        for (int bx = 0; bx < nv; bx++)
            for (int by = 0; by < (dv + GDC_CW - 1) / GDC_CW; by++) run_gdc_block(bx, by);
        fwrite(o.data(), 4, o.size(), out);
    }
    fwrite(state.data(), 4, state.size(), out);
    fclose(out);
    return 0;
}
