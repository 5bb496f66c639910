// Host emulation of matmul.cu's token-major Q4_K GEMV (`tm_quant_block`, `gemv_tm_q4k`: the
// section between its EMU_TM markers, written next to this file as tm.cuh by
// gemv_tm_emu.rs). One block of 4 warps at a time on the host, every thread a fiber
// (../emu/fibers.h); mma.sync m16n8k32 u8 x s8 emulated from the PTX ISA fragment layout
// (../emu/mma.h). Checked:
//  - the quantization: every value within d / 2 (and d1's rounding) of d (127 hi + lo), d = amax / 127^2 of its
//    256 columns, and each sub-block sum the sum of its 127 hi + lo;
//  - each output against a double-precision sum over the same planes, scales and sums
//    (NMSE <= 1e-10: the kernel's sums are exact integers, its float work once a
//    super-block), for whole and partial 16-row tiles, 1..8 and 9..16 x rows, one and several
//    super-blocks a warp and warps with none;
//  - outputs past `rows` and past n_out untouched;
//  - x row r's outputs bit for bit the same at every row count and R (decode and verify).
// Prints one line per configuration and "ALL OK"; exit status 1 on a mismatch.
#define EMU_THREADS 128
#include <cmath>

#include "fibers.h"
#include "intrinsics.h"

#define __shared__ static
#define QK 32
#define QK_K 256
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176

#include "mma.h"
#include "rng.h"
#include "sm.cuh"  // common.cuh's scale_min_k4_int
#include "tm.cuh"
#include "q4k_ref.h"  // scale_min: ggml's get_scale_min_k4, the reference's own

static const uint32_t POISON = 0x7fc0dead;

struct Setup {
    int n_in, n_out;
    std::vector<uint8_t> w;
    std::vector<float> x;
    std::vector<int8_t> xq;
    std::vector<float> xs;
    std::vector<int> xsum;
};
static Setup S;
static int g_rows;
static float* g_out;

static void quant_body() {
    const int nsb = S.n_in / QK_K;
    const int w = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (w >= g_rows * nsb) return;
    tm_quant_block(S.x.data(), S.n_in, w / nsb, w % nsb, S.xq.data(), S.xs.data(), S.xsum.data());
}

template <int R>
static void gemv_body() {
    gemv_tm_q4k<R>(S.w.data(), (long long)(S.n_in / QK_K * Q4_K_BYTES), S.n_out, S.n_in, S.xq.data(),
                   S.xs.data(), S.xsum.data(), g_rows, g_out, blockIdx.x * 16);
}

static int failures = 0;

// Quantizes `rows` x rows (fresh random values, a few outliers) and checks the planes.
static void quantize(int rows) {
    const int n = S.n_in, nsb = n / QK_K;
    S.x.assign((size_t)16 * n, 0.0f);
    for (auto& v : S.x) v = unif(-1.0f, 1.0f);
    for (int i = 0; i < 6; i++) S.x[rnd() % S.x.size()] *= 60.0f;
    S.xq.assign((size_t)16 * 2 * n, 0);
    S.xs.assign((size_t)16 * nsb, 0.0f);
    S.xsum.assign((size_t)16 * (n / QK), 0);
    g_rows = rows;
    for (int b = 0; b < (rows * nsb + 3) / 4; b++) run_block(b, 0, quant_body);
    for (int r = 0; r < rows; r++)
        for (int blk = 0; blk < nsb; blk++) {
            const float d = S.xs[(size_t)r * nsb + blk];
            float amax = 0;
            for (int k = 0; k < QK_K; k++) amax = std::max(amax, std::fabs(S.x[(size_t)r * n + blk * QK_K + k]));
            if (d != amax / 127.0f / 127.0f) {
                printf("quant: row %d block %d: d %g, amax / 127^2 %g\n", r, blk, d, amax / 127.0f / 127.0f);
                failures++;
            }
            for (int j = 0; j < 8; j++) {
                long long s = 0;
                for (int k = 0; k < 32; k++) {
                    const int e = blk * QK_K + 32 * j + k;
                    const int v = 127 * S.xq[(size_t)r * 2 * n + e] + S.xq[(size_t)r * 2 * n + n + e];
                    s += v;
                    // Half a step, plus the float rounding of d1 = amax / 127 against 127 d
                    // (up to |hi| ulps of d1: ~1e-3 d).
                    if (std::fabs(S.x[(size_t)r * n + e] - d * v) > 0.51f * d + 1e-30f) {
                        printf("quant: row %d col %d: %g vs %g (d %g)\n", r, e, S.x[(size_t)r * n + e], d * v, d);
                        failures++;
                        return;
                    }
                }
                if (s != S.xsum[(size_t)r * (n / QK) + blk * 8 + j]) {
                    printf("quant: row %d sub-block %d: sum %lld vs %d\n", r, blk * 8 + j, s,
                           S.xsum[(size_t)r * (n / QK) + blk * 8 + j]);
                    failures++;
                }
            }
        }
}

// Row o of W against x row r, in double, from the planes, scales and sums the kernel reads.
static double ref(int o, int r) {
    const int n = S.n_in, nsb = n / QK_K;
    const uint8_t* row = S.w.data() + (size_t)o * nsb * Q4_K_BYTES;
    double acc = 0;
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t* b = row + sb * Q4_K_BYTES;
        const double d = h2f(b[0] | b[1] << 8), dmin = h2f(b[2] | b[3] << 8);
        const double dx = S.xs[(size_t)r * nsb + sb];
        for (int j = 0; j < 8; j++) {
            int sc, m;
            scale_min(j, b + 4, sc, m);
            long long s = 0;
            for (int k = 0; k < 32; k++) {
                const uint8_t qb = b[16 + 32 * (j / 2) + k];
                const int q = j % 2 ? qb >> 4 : qb & 15;
                const int e = sb * QK_K + 32 * j + k;
                s += (long long)q * (127 * S.xq[(size_t)r * 2 * n + e] + S.xq[(size_t)r * 2 * n + n + e]);
            }
            acc += dx * (d * sc * (double)s - dmin * m * (double)S.xsum[(size_t)r * (n / QK) + sb * 8 + j]);
        }
    }
    return acc;
}

// Runs the GEMV at R for `rows` x rows into a poisoned [16, n_out] output.
static std::vector<float> run(int R, int rows) {
    std::vector<float> out((size_t)16 * S.n_out);
    for (auto& v : out) memcpy(&v, &POISON, 4);
    g_rows = rows;
    g_out = out.data();
    for (int b = 0; b < (S.n_out + 15) / 16; b++) run_block(b, 0, R == 8 ? gemv_body<8> : gemv_body<16>);
    return out;
}

static void config(int n_in, int n_out) {
    S.n_in = n_in;
    S.n_out = n_out;
    const int nsb = n_in / QK_K;
    S.w.assign((size_t)n_out * nsb * Q4_K_BYTES, 0);
    for (int o = 0; o < n_out; o++)
        for (int sb = 0; sb < nsb; sb++) {
            uint8_t* b = S.w.data() + ((size_t)o * nsb + sb) * Q4_K_BYTES;
            const uint16_t d = rnd_f16(), dm = rnd_f16();
            b[0] = d & 0xFF, b[1] = d >> 8, b[2] = dm & 0xFF, b[3] = dm >> 8;
            for (int i = 4; i < Q4_K_BYTES; i++) b[i] = (uint8_t)rnd();
        }
    quantize(16);
    std::vector<std::vector<float>> runs;
    const int cases[][2] = {{8, 1}, {8, 5}, {8, 8}, {16, 9}, {16, 16}, {16, 3}};
    for (auto& c : cases) {
        const int R = c[0], rows = c[1];
        std::vector<float> out = run(R, rows);
        double e = 0, p = 0;
        int untouched = 0;
        for (int r = 0; r < 16; r++)
            for (int o = 0; o < n_out; o++) {
                const float v = out[(size_t)r * n_out + o];
                uint32_t bits;
                memcpy(&bits, &v, 4);
                if (r >= rows) {
                    untouched += bits == POISON;
                    continue;
                }
                const double want = ref(o, r);
                e += (v - want) * (v - want);
                p += want * want;
            }
        const double nmse = e / p;
        const bool ok = nmse <= 1e-10 && untouched == (16 - rows) * n_out;
        printf("n_in %5d n_out %3d R %2d rows %2d: NMSE %.2e, %s\n", n_in, n_out, R, rows, nmse,
               untouched == (16 - rows) * n_out ? "nothing past rows written" : "WROTE PAST rows");
        failures += !ok;
        runs.push_back(out);
    }
    // x row r gives the same bits whatever the row count and R.
    for (size_t a = 0; a < runs.size(); a++)
        for (int r = 0; r < cases[a][1]; r++)
            for (int o = 0; o < n_out; o++) {
                const float want = runs[4][(size_t)r * n_out + o];  // R 16, 16 rows
                if (memcmp(&runs[a][(size_t)r * n_out + o], &want, 4) != 0) {
                    printf("x row %d output %d: R %d rows %d gives %a, R 16 rows 16 %a\n", r, o, cases[a][0],
                           cases[a][1], runs[a][(size_t)r * n_out + o], want);
                    failures++;
                    return;
                }
            }
}

int main() {
    config(512, 16);    // one tile, two super-blocks: warps 2 and 3 have none
    config(1280, 37);   // five super-blocks (warp 0 takes two), a partial third tile
    config(4096, 32);   // four super-blocks a warp
    if (failures) {
        printf("%d FAILED\n", failures);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
