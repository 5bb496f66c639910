// Host emulation of matmul.cu's tensor-core Q4_K, Q5_K, Q6_K and Q8_0 GEMVs (gemvq_tc_q4k and
// its Q5 form, gemvq_tc_q6k, gemvq_tc_q80, tc_stage_x: the section between its EMU_TC markers, with kq_pair_scales from the EMU_KQ section;
// written next to this file as kq.cuh and tc.cuh by emu::build_gemv_tc, with the prelude
// gemv_tc.h). One block (r0 = 0) on the host, every thread a fiber (../emu/fibers.h); emulated:
//  - tc_mma / tc_mma_s8: mma.sync m16n8k32 u8 (s8) x s8 -> s32: the 32 lanes deposit their
//    fragments, A (16 x 32) and B (32 x 8) are rebuilt from the PTX ISA fragment layout, each
//    lane adds its four products exactly (integers);
//  - __shfl_xor_sync, __syncthreads (fibers.h), __byte_perm, __ldg, f16 -> f32.
// Each configuration (type, columns, valid rows, R, x rows, SwiGLU, x staged, and for the K-split
// tile x's width and the slice's first column) is checked against a
// double-precision dot product over the same int8 x planes and block scales, outputs outside
// the valid rows must stay untouched, and x row 0 must come out bit for bit the same at R = 1
// (x staged) and R = 3 (x from global memory): decode and verify agree.
// Prints one line per configuration and "ALL OK"; exit status 1 on a mismatch.
#include "gemv_tc.h"

// ---- one configuration ------------------------------------------------------------------
// kx, k0: the K-split tile (gemvq_tck_block): the tile's n_in columns are x's columns
// k0 .. k0 + n_in of kx (0: x is n_in wide).
// q8: the Q8_0 tile (gemvq_tc_q80), its rows 16 bytes apart beyond their length in the slots,
// as gemvq_tck_block lays them out.
// q5: the Q5_K rows of gemvq_tc_q4k's Q5 (the 16-row tile only).
struct Cfg {
    int n_in, n_out, R, rows, swiglu, staged, q6, half, kx, k0, norm, q8, q5;
};
static Cfg cfg;
static const uint8_t *s0, *s1;
static long long rb;
static const int8_t* xq;
static const float2* xd;
static uint8_t* xs;
static float* out;

// NORM (cfg.norm; Q4_K, and Q8_0 staged): the SwiGLU / plain tile with the deferred RMSNorm scale
// (gemvq_tc_block's NORM form): tc_norm_scale from the group sums pss, then the tile, whose
// tc_store scales each sum by sn[r].
static const float* pss;
static float eps_n;
static float sn[4];
template <int R, bool SW, bool H>
static void body_r() {
    // As gemvq_tck_block: x's slice staged (planes kx apart in the source), or x read in place
    // (rows and planes kx apart) with the tile's columns as kcols.
    const int nx = cfg.kx ? cfg.kx : cfg.n_in, k0 = cfg.k0;
    if (cfg.norm) {
        tc_norm_scale<R>(pss, cfg.n_in, cfg.rows, eps_n, sn);
        __syncthreads();
    }
    if (cfg.staged) {
        tc_stage_x(xs, xq + k0, xd + k0 / QK, cfg.n_in, nx);
        const int8_t* xa = (const int8_t*)xs;
        const float2* da = (const float2*)(xs + 2 * cfg.n_in + 128);
        if (cfg.q6)
            gemvq_tc_q6k<R, SW, true, H>(s0, s1, rb, cfg.n_out, cfg.n_in, xa, da, cfg.rows, out, 0, cfg.n_in + 64,
                                         cfg.n_in);
        else if (cfg.q8 && cfg.norm)
            gemvq_tc_q80<R, SW, true, true>(s0, s1, rb, cfg.n_out, cfg.n_in, xa, da, cfg.rows, out, 0, cfg.n_in + 64,
                                            cfg.n_in, sn);
        else if (cfg.q8)
            gemvq_tc_q80<R, SW, true>(s0, s1, rb, cfg.n_out, cfg.n_in, xa, da, cfg.rows, out, 0, cfg.n_in + 64,
                                      cfg.n_in);
        else if (cfg.q5)
            gemvq_tc_q4k<R, SW, true, H, false, false, false, true>(s0, s1, rb, cfg.n_out, cfg.n_in, xa, da,
                                                                    cfg.rows, out, 0, cfg.n_in + 64, cfg.n_in);
        else if (cfg.norm)
            gemvq_tc_q4k<R, SW, true, H, true>(s0, s1, rb, cfg.n_out, cfg.n_in, xa, da, cfg.rows, out, 0,
                                               cfg.n_in + 64, cfg.n_in, sn);
        else
            gemvq_tc_q4k<R, SW, true, H>(s0, s1, rb, cfg.n_out, cfg.n_in, xa, da, cfg.rows, out, 0, cfg.n_in + 64,
                                         cfg.n_in);
    } else {
        if (cfg.q6)
            gemvq_tc_q6k<R, SW, false, H>(s0, s1, rb, cfg.n_out, nx, xq + k0, xd + k0 / QK, cfg.rows, out, 0, nx,
                                          cfg.n_in);
        else if (cfg.q8 && cfg.norm)
            gemvq_tc_q80<R, SW, false, true>(s0, s1, rb, cfg.n_out, nx, xq + k0, xd + k0 / QK, cfg.rows, out, 0, nx,
                                             cfg.n_in, sn);
        else if (cfg.q8)
            gemvq_tc_q80<R, SW, false>(s0, s1, rb, cfg.n_out, nx, xq + k0, xd + k0 / QK, cfg.rows, out, 0, nx,
                                       cfg.n_in);
        else if (cfg.q5)
            gemvq_tc_q4k<R, SW, false, H, false, false, false, true>(s0, s1, rb, cfg.n_out, nx, xq + k0,
                                                                     xd + k0 / QK, cfg.rows, out, 0, nx, cfg.n_in);
        else if (cfg.norm)
            gemvq_tc_q4k<R, SW, false, H, true>(s0, s1, rb, cfg.n_out, nx, xq + k0, xd + k0 / QK, cfg.rows, out, 0,
                                                nx, cfg.n_in, sn);
        else
            gemvq_tc_q4k<R, SW, false, H>(s0, s1, rb, cfg.n_out, nx, xq + k0, xd + k0 / QK, cfg.rows, out, 0, nx,
                                          cfg.n_in);
    }
}
template <bool H>
static void body_h() {
    if (cfg.R == 1) cfg.swiglu ? body_r<1, true, H>() : body_r<1, false, H>();
    else cfg.swiglu ? body_r<3, true, H>() : body_r<3, false, H>();
}
static void body() { cfg.half ? body_h<true>() : body_h<false>(); }

#include "rng.h"

// ggml's Q6_K weight e (0..255) of super-block b and its scale.
static int q6_weight(const uint8_t* b, int e, int& sc) {
    const int h = e / 128, j = e % 128 / 16, m = e % 16, jj = j / 2, i = j % 2;
    const uint8_t ql = b[64 * h + 32 * (jj % 2) + 16 * i + m], qh = b[128 + 32 * h + 16 * i + m];
    sc = (int8_t)b[192 + 8 * h + j];
    return ((jj < 2 ? ql & 15 : ql >> 4) | ((qh >> (2 * jj)) & 3) << 4) - 32;
}

// sum over the row of w . x for x row r, in double, from the same int8 planes and scales.
static double ref_dot_q6(const uint8_t* row, int n_in, const int8_t* xr, const float2* dr) {
    double acc = 0;
    for (int sb = 0; sb < n_in / QK_K; sb++) {
        const uint8_t* b = row + sb * Q6_K_BYTES;
        const double d = h2f(b[208] | b[209] << 8);
        for (int j = 0; j < 16; j++) {
            int64_t s = 0;
            int sc = 0;
            for (int m = 0; m < 16; m++) {
                const int q = q6_weight(b, 16 * j + m, sc), e = sb * QK_K + 16 * j + m;
                s += (int64_t)q * (127 * xr[e] + xr[n_in + e]);
            }
            acc += d * sc * dr[(sb * QK_K + 16 * j) / QK].x * (double)s;
        }
    }
    return acc;
}

// The same for a Q8_0 row (blocks of f16 d and 32 int8 quants).
static double ref_dot_q8(const uint8_t* row, int n_in, const int8_t* xr, const float2* dr) {
    double acc = 0;
    for (int b = 0; b < n_in / QK; b++) {
        const uint8_t* blk = row + b * Q8_0_BYTES;
        int64_t s = 0;
        for (int m = 0; m < QK; m++) {
            const int e = b * QK + m;
            s += (int64_t)(int8_t)blk[2 + m] * (127 * xr[e] + xr[n_in + e]);
        }
        acc += (double)h2f(blk[0] | blk[1] << 8) * dr[b].x * (double)s;
    }
    return acc;
}

static double ref_dot(const uint8_t* row, int n_in, const int8_t* xr, const float2* dr) {
    return cfg.q6   ? ref_dot_q6(row, n_in, xr, dr)
           : cfg.q8 ? ref_dot_q8(row, n_in, xr, dr)
           : cfg.q5 ? ref_dot_k(row, n_in, xr, dr, true)
                    : ref_dot_q4(row, n_in, xr, dr);
}

static bool run(const Cfg& c, std::vector<float>* row0) {
    cfg = c;
    // Tile rows (outputs): 16 plain / 8 SwiGLU pairs; HALF (8-row tile, slots of 4 rows) 8 / 4.
    const int n_in = c.n_in, nb = n_in / QK, ns = c.half ? 4 : 8, tile = c.swiglu ? ns : 2 * ns;
    const int bytes = c.q6 ? Q6_K_BYTES : c.q8 ? 8 * Q8_0_BYTES : c.q5 ? Q5_K_BYTES : Q4_K_BYTES;  // per 256
    rb = (long long)(n_in / QK_K) * bytes;
    // Weights: 2 ns tile rows (plain: rows 0..2ns-1; SwiGLU: gate rows 0..ns-1, up rows the next
    // ns).
    std::vector<uint8_t> w(2 * ns * rb);
    for (int r = 0; r < 2 * ns; r++)
        for (int sb = 0; sb < n_in / QK_K; sb++) {
            uint8_t* b = &w[r * rb + sb * bytes];
            for (int i = 0; i < bytes; i++) b[i] = rnd() & 0xFF;
            const uint16_t d = rnd_f16(), dm = rnd_f16();
            if (c.q6) {
                b[208] = d & 0xFF, b[209] = d >> 8;
            } else if (c.q8) {
                for (int k = 0; k < 8; k++) {
                    const uint16_t dk = k ? rnd_f16() : d;
                    b[k * Q8_0_BYTES] = dk & 0xFF, b[k * Q8_0_BYTES + 1] = dk >> 8;
                }
            } else {
                b[0] = d & 0xFF, b[1] = d >> 8, b[2] = dm & 0xFF, b[3] = dm >> 8;
            }
        }
    // Slots as the kernel's: plain, rows 0..ns-1 and ns..; SwiGLU, gate rows and up rows. A
    // Q6_K row is only 2-byte aligned: the slots start 2 bytes past a 16-byte boundary (as
    // `smem + (address & 15)` in the kernel's caller) and odd super-block counts make every
    // other row 2 mod 4.
    const int mis = c.q6 ? 2 : 0;
    // Q8_0: rows rs = rb + 16 apart in the slots (gemvq_tck_block's PAD), the pad bytes
    // garbage that no output may read.
    const long long rs = c.q8 ? rb + 16 : rb;
    std::vector<uint8_t> slot0(ns * rs + 32, 0xA5), slot1(ns * rs + 32, 0x5A);
    for (int r = 0; r < ns; r++) {
        memcpy(slot0.data() + mis + r * rs, w.data() + r * rb, rb);
        memcpy(slot1.data() + mis + r * rs, w.data() + (ns + r) * rb, rb);
    }
    s0 = slot0.data() + mis, s1 = slot1.data() + mis;
    const long long rb_w = rb;  // the reference's row bytes
    rb = rs;
    // x: R rows of nx columns (two planes); the reference takes each row's slice k0.. as a
    // row of n_in columns (xr, dr below).
    const int nx = c.kx ? c.kx : n_in, nbx = nx / QK;
    std::vector<int8_t> x((size_t)c.R * 2 * nx);
    std::vector<float2> dsc((size_t)c.R * nbx);
    for (int r = 0; r < c.R; r++) {
        for (int e = 0; e < nx; e++) {
            x[(size_t)r * 2 * nx + e] = (int8_t)((int)(rnd() % 255) - 127);
            x[(size_t)r * 2 * nx + nx + e] = (int8_t)((int)(rnd() % 129) - 64);
        }
        for (int i = 0; i < nbx; i++) dsc[(size_t)r * nbx + i] = {unif(1e-4f, 1e-2f), unif(-50.f, 50.f)};
    }
    xq = x.data(), xd = dsc.data();
    // The producer's group sums of x^2 (NORM): positive, rows of nb, a function of (row,
    // group) alone so that x row 0 has the same sums at R = 1 and R = 3.
    std::vector<float> ssv((size_t)c.R * nb);
    for (int r = 0; r < c.R; r++)
        for (int g = 0; g < nb; g++) ssv[(size_t)r * nb + g] = 0.5f + (float)((g * 7919 + r * 104729) % 997) / 25.0f;
    pss = ssv.data(), eps_n = 1e-6f;
    std::vector<int8_t> xslice(2 * n_in);
    std::vector<uint8_t> xsb(2 * n_in + 128 + nb * 8 + 16);
    xs = xsb.data();
    // The kernel stores out[r * n_out + o]; a quiet NaN with a payload marks "not written".
    std::vector<float> ob((size_t)c.R * c.n_out + 1, __uint_as_float(0x7fc00001u));
    out = ob.data();
    run_block(0, 0, body);
    bool ok = true;
    double err = 0, ref2 = 0;
    for (int r = 0; r < c.R; r++)
        for (int i = 0; i < c.n_out; i++) {
            const float got = ob[(size_t)r * c.n_out + i];
            const bool valid = r < c.rows && i < tile;
            if (!valid) {
                if (f2u(got) != 0x7fc00001u) {
                    printf("  row %d out %d written but not valid\n", r, i);
                    ok = false;
                }
                continue;
            }
            const int8_t* xrow = &x[(size_t)r * 2 * nx];
            for (int e = 0; e < n_in; e++)
                xslice[e] = xrow[c.k0 + e], xslice[n_in + e] = xrow[nx + c.k0 + e];
            const int8_t* xr = xslice.data();
            const float2* dr = &dsc[(size_t)r * nbx + c.k0 / QK];
            // NORM: s = 1 / sqrt(sum of row r's group sums / n_in + eps) scales each dot product.
            double s = 1.0;
            if (c.norm) {
                double ss = 0;
                for (int g = 0; g < nb; g++) ss += ssv[(size_t)r * nb + g];
                s = 1.0 / std::sqrt(ss / n_in + eps_n);
            }
            double ref;
            if (c.swiglu) {
                const double g = s * ref_dot(&w[i * rb_w], n_in, xr, dr);
                const double u = s * ref_dot(&w[(ns + i) * rb_w], n_in, xr, dr);
                ref = g / (1 + std::exp(-g)) * u;
            } else {
                ref = s * ref_dot(&w[i * rb_w], n_in, xr, dr);
            }
            err += (got - ref) * (got - ref);
            ref2 += ref * ref;
            if (!std::isfinite(got)) ok = false;
        }
    const double nmse = err / (ref2 > 0 ? ref2 : 1);
    if (!(nmse <= 1e-11)) ok = false;
    printf("%s%s n_in %5d (x %5d from %5d) n_out %2d R %d rows %d swiglu %d staged %d norm %d: NMSE %.2e %s\n",
           c.q6 ? "q6_K" : c.q8 ? "q8_0" : c.q5 ? "q5_K" : "q4_K", c.half ? " half" : "", c.n_in, nx, c.k0, c.n_out, c.R, c.rows, c.swiglu,
           c.staged, c.norm, nmse, ok ? "OK" : "MISMATCH");
    if (row0) {
        const int n = min(tile, c.n_out);
        if (c.R == 1) row0->assign(ob.begin(), ob.begin() + n);
        else
            for (int i = 0; i < n; i++)
                if (f2u(ob[i]) != f2u((*row0)[i])) {
                    printf("  x row 0, output %d: R = 3 gives %a, R = 1 gave %a\n", i, ob[i], (*row0)[i]);
                    ok = false;
                }
    }
    return ok;
}

int main() {
    bool ok = true;
    // (n_in, n_out, R, rows, swiglu, staged): one super-block in all, one and several per
    // warp, a partial tile, padded x rows (rows < R), SwiGLU; each R = 1 / R = 3 pair shares
    // x row 0 and the weights (same seed) for the bitwise comparison.
    const Cfg pairs[][2] = {
        {{4096, 16, 1, 1, 0, 1, 0, 0}, {4096, 16, 3, 3, 0, 0, 0, 0}},
        {{512, 13, 1, 1, 0, 1, 0, 0}, {512, 13, 3, 2, 0, 0, 0, 0}},
        {{2048, 8, 1, 1, 1, 1, 0, 0}, {2048, 8, 3, 3, 1, 0, 0, 0}},
        {{768, 5, 1, 1, 1, 1, 0, 0}, {768, 5, 3, 1, 1, 0, 0, 0}},
        {{256, 16, 1, 1, 0, 1, 0, 0}, {256, 16, 3, 3, 0, 0, 0, 0}},      // one super-block: warp 0 alone
        {{12288, 16, 1, 1, 0, 1, 0, 0}, {12288, 16, 3, 2, 0, 0, 0, 0}},  // FERRITE_GEMV_TC=2's long rows
        // Q6_K: the lm head and V shape, odd super-block counts (rows 2 mod 4), SwiGLU.
        {{4096, 16, 1, 1, 0, 1, 1, 0}, {4096, 16, 3, 3, 0, 0, 1, 0}},
        {{768, 11, 1, 1, 0, 1, 1, 0}, {768, 11, 3, 2, 0, 0, 1, 0}},
        {{2304, 8, 1, 1, 1, 1, 1, 0}, {2304, 8, 3, 3, 1, 0, 1, 0}},
        {{256, 3, 1, 1, 1, 1, 1, 0}, {256, 3, 3, 1, 1, 0, 1, 0}},
        // The 8-row tile (long rows; x from global memory, as its launch does at every R).
        {{12288, 8, 1, 1, 0, 0, 0, 1}, {12288, 8, 3, 3, 0, 0, 0, 1}},
        {{12288, 8, 1, 1, 0, 0, 1, 1}, {12288, 8, 3, 2, 0, 0, 1, 1}},
        {{768, 5, 1, 1, 0, 0, 1, 1}, {768, 5, 3, 3, 0, 0, 1, 1}},
        {{1024, 4, 1, 1, 1, 0, 0, 1}, {1024, 4, 3, 3, 1, 0, 0, 1}},
        // The K-split tile: a 4096-column slice of a 12288-wide x (the middle one), Q4_K and
        // Q6_K, a partial tile; Q6_K's short last slice of 14336 columns.
        {{4096, 16, 1, 1, 0, 1, 0, 0, 12288, 4096}, {4096, 16, 3, 3, 0, 0, 0, 0, 12288, 4096}},
        {{4096, 11, 1, 1, 0, 1, 1, 0, 12288, 8192}, {4096, 11, 3, 2, 0, 0, 1, 0, 12288, 8192}},
        {{2048, 16, 1, 1, 0, 1, 1, 0, 14336, 12288}, {2048, 16, 3, 3, 0, 0, 1, 0, 14336, 12288}},
        // The deferred RMSNorm scale (gemvq_swiglu_tcn_q4_k): SwiGLU and plain, staged and
        // not, a partial tile, padded x rows.
        {{4096, 8, 1, 1, 1, 1, 0, 0, 0, 0, 1}, {4096, 8, 3, 3, 1, 0, 0, 0, 0, 0, 1}},
        {{768, 5, 1, 1, 1, 1, 0, 0, 0, 0, 1}, {768, 5, 3, 2, 1, 0, 0, 0, 0, 0, 1}},
        {{1024, 16, 1, 1, 0, 1, 0, 0, 0, 0, 1}, {1024, 16, 3, 3, 0, 0, 0, 0, 0, 0, 1}},
        // Q8_0 (gemvq_tc_q80): the K-split down's 2048-column slices of a 12288-wide x (the
        // first and the last), a 4096-column one, a partial tile, one unit (warp 0 alone),
        // SwiGLU (a form no kernel takes yet).
        {{2048, 16, 1, 1, 0, 1, 0, 0, 12288, 0, 0, 1}, {2048, 16, 3, 3, 0, 0, 0, 0, 12288, 0, 0, 1}},
        {{2048, 16, 1, 1, 0, 1, 0, 0, 12288, 10240, 0, 1}, {2048, 16, 3, 2, 0, 0, 0, 0, 12288, 10240, 0, 1}},
        {{4096, 13, 1, 1, 0, 1, 0, 0, 12288, 4096, 0, 1}, {4096, 13, 3, 3, 0, 0, 0, 0, 12288, 4096, 0, 1}},
        {{256, 16, 1, 1, 0, 1, 0, 0, 0, 0, 0, 1}, {256, 16, 3, 3, 0, 0, 0, 0, 0, 0, 0, 1}},
        {{2304, 8, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1}, {2304, 8, 3, 3, 1, 0, 0, 0, 0, 0, 0, 1}},
        // The Q8_0 SwiGLU ring's tile (gemvq_swiglu_p_q80: staged x, the handed-over norm), a
        // partial tile too; R = 3 reads x from global memory.
        {{4096, 8, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1}, {4096, 8, 3, 3, 1, 0, 0, 0, 0, 0, 1, 1}},
        {{8192, 5, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1}, {8192, 5, 3, 2, 1, 0, 0, 0, 0, 0, 1, 1}},
        // Q5_K (gemvq_tc_q4k's Q5): Qwen3.5's in-projection widths, a partial tile, one
        // super-block (warp 0 alone), SwiGLU (the template's form; no kernel builds it yet).
        {{2048, 16, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1}, {2048, 16, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 1}},
        {{4096, 13, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1}, {4096, 13, 3, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1}},
        {{256, 16, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1}, {256, 16, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 1}},
        {{768, 5, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1}, {768, 5, 3, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1}},
    };
    for (const auto& p : pairs) {
        std::vector<float> row0;
        const uint64_t seed = rng;
        ok &= run(p[0], &row0);
        // The same seed: the same weights and the same x row 0 (rows are drawn in order) for
        // the R = 3 run, whose later rows are the verify rows.
        rng = seed;
        ok &= run(p[1], &row0);
    }
    puts(ok ? "ALL OK" : "FAILED");
    return ok ? 0 : 1;
}
