// Host emulation of matmul.cu's two-tile Q4_K o-projection that hands the FFN's RMSNorm over to
// the SwiGLU (tc2_tiles_add: gemvq_tc_q4k in its two-group form, tc_reduce_g2, add_norm_lane with
// quant_q8_lane; the EMU_TC section of matmul.cu and EMU_Q8 of common.cuh, written next to this
// file by emu::build_gemv_tc, with the prelude gemv_tc.h). One block of 512 threads (two groups of
// 8 warps) on the host, every thread a fiber (../emu/fibers.h), mma.sync emulated (../emu/mma.h).
// Each configuration (columns, block index, R, valid rows, x staged) is checked against double-
// precision references: the residual x + W x (the dot products over the same int8 x planes and
// block scales, NMSE <= 1e-11), the planes of (x + W x) * n (dequantized within half a step of the
// int8 grid, the scale pair's sum exact), the group sums of squares (relative 1e-6); everything
// outside the block's 32 outputs and the valid rows untouched; and x row 0 bit for bit the same at
// R = 1 (x staged) and R = 3 (x from global memory). Prints one line per configuration and "ALL
// OK"; exit status 1 on a mismatch.
#define EMU_THREADS 512
#include "gemv_tc.h"

struct Cfg {
    int n_in, bx, R, rows, staged;
};
static Cfg cfg;
static const int N_OUT = 64;  // two blocks of 32 rows
static const uint8_t* slots[2][2];
static long long rb;
static const int8_t* xq;
static const float2* xd;
static uint8_t* xs;
static float *xres, *nw, *pss;
static int8_t* pq;
static float2* pd;

template <int R, bool XS>
static void body_r() {
    const int tg = threadIdx.x >> 8;
    if (XS) {
        tc_stage_x(xs, xq, xd, cfg.n_in);
        tc2_tiles_add<R, true>(slots[tg][0], slots[tg][1], rb, N_OUT, cfg.n_in, (const int8_t*)xs,
                               (const float2*)(xs + 2 * cfg.n_in + 128), cfg.rows, cfg.n_in + 64, cfg.bx, xres, nw,
                               pq, pd, pss);
    } else {
        tc2_tiles_add<R, false>(slots[tg][0], slots[tg][1], rb, N_OUT, cfg.n_in, xq, xd, cfg.rows, cfg.n_in, cfg.bx,
                                xres, nw, pq, pd, pss);
    }
}
static void body() { cfg.R == 1 ? body_r<1, true>() : body_r<3, false>(); }

#include "rng.h"

// What a run leaves for x row 0 (for the R = 1 / R = 3 comparison).
struct Row0 {
    std::vector<float> x, pss;
    std::vector<int8_t> q;
    std::vector<float2> d;
};

static bool run(const Cfg& c, Row0* row0) {
    cfg = c;
    const int n_in = c.n_in, nb = n_in / QK, ng = N_OUT / QK;
    rb = (long long)(n_in / QK_K) * Q4_K_BYTES;
    std::vector<uint8_t> w(N_OUT * rb);
    for (int r = 0; r < N_OUT; r++)
        for (int sb = 0; sb < n_in / QK_K; sb++) {
            uint8_t* b = &w[r * rb + sb * Q4_K_BYTES];
            for (int i = 0; i < Q4_K_BYTES; i++) b[i] = rnd() & 0xFF;
            const uint16_t d = rnd_f16(), dm = rnd_f16();
            b[0] = d & 0xFF, b[1] = d >> 8, b[2] = dm & 0xFF, b[3] = dm >> 8;
        }
    // Group tg's slots: rows r0 .. r0 + 7 and r0 + 8 .. r0 + 15, r0 = 32 bx + 16 tg.
    std::vector<uint8_t> sl[2][2];
    for (int tg = 0; tg < 2; tg++)
        for (int k = 0; k < 2; k++) {
            const int r0 = 32 * c.bx + 16 * tg + 8 * k;
            sl[tg][k].assign(w.begin() + r0 * rb, w.begin() + (r0 + 8) * rb);
            slots[tg][k] = sl[tg][k].data();
        }
    // x planes (the o-projection's input), the residual, the norm weight: row 0 first, so
    // that the R = 1 and R = 3 runs of one seed share it.
    std::vector<int8_t> x((size_t)c.R * 2 * n_in);
    std::vector<float2> dsc((size_t)c.R * nb);
    std::vector<float> res((size_t)c.R * N_OUT), res0;
    for (int r = 0; r < c.R; r++) {
        for (int e = 0; e < n_in; e++) {
            x[(size_t)r * 2 * n_in + e] = (int8_t)((int)(rnd() % 255) - 127);
            x[(size_t)r * 2 * n_in + n_in + e] = (int8_t)((int)(rnd() % 129) - 64);
        }
        for (int i = 0; i < nb; i++) dsc[(size_t)r * nb + i] = {unif(1e-4f, 1e-2f), unif(-50.f, 50.f)};
        for (int o = 0; o < N_OUT; o++) res[(size_t)r * N_OUT + o] = unif(-200.f, 200.f);
    }
    std::vector<float> nwv(N_OUT);
    for (int o = 0; o < N_OUT; o++) nwv[o] = (float)(1 + (o * 37) % 11) / 8.0f;  // a function of o alone
    res0 = res;
    xq = x.data(), xd = dsc.data(), xres = res.data(), nw = nwv.data();
    std::vector<uint8_t> xsb(2 * n_in + 128 + nb * 8 + 16);
    xs = xsb.data();
    // Outputs, marked "not written".
    std::vector<int8_t> q((size_t)c.R * 2 * N_OUT, (int8_t)0x5A);
    std::vector<float2> d((size_t)c.R * ng, {-7.0f, -7.0f});
    std::vector<float> ss((size_t)c.R * ng, -7.0f);
    pq = q.data(), pd = d.data(), pss = ss.data();
    run_block(c.bx, 0, body);

    bool ok = true;
    double err = 0, ref2 = 0;
    for (int r = 0; r < c.R; r++)
        for (int o = 0; o < N_OUT; o++) {
            const size_t i = (size_t)r * N_OUT + o;
            const bool valid = r < c.rows && o / 32 == c.bx;
            if (!valid) {
                if (f2u(res[i]) != f2u(res0[i])) {
                    printf("  x row %d col %d changed but not the block's\n", r, o);
                    ok = false;
                }
                continue;
            }
            const double v = ref_dot_q4(&w[o * rb], n_in, &x[(size_t)r * 2 * n_in], &dsc[(size_t)r * nb]);
            const double got = (double)res[i] - (double)res0[i];
            err += (got - v) * (got - v);
            ref2 += v * v;
        }
    const double nmse = err / (ref2 > 0 ? ref2 : 1);
    if (!(nmse <= 1e-11)) ok = false;
    // Planes, scale pairs and group sums of the block's group for the valid rows; the rest
    // untouched.
    double worst_q = 0, worst_ss = 0;
    for (int r = 0; r < c.R; r++)
        for (int g = 0; g < ng; g++) {
            const size_t gi = (size_t)r * ng + g;
            const bool valid = r < c.rows && g == c.bx;
            if (!valid) {
                if (ss[gi] != -7.0f || d[gi].x != -7.0f) {
                    printf("  row %d group %d: planes written but not the block's\n", r, g);
                    ok = false;
                }
                continue;
            }
            double sq = 0, amax = 0;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                const int o = 32 * g + j;
                const float xr = res[(size_t)r * N_OUT + o];
                sq += (double)xr * xr;
                amax = std::max(amax, std::fabs((double)(xr * nwv[o])));
            }
            const double step = amax / (127.0 * 127.0);
            for (int j = 0; j < 32; j++) {
                const int o = 32 * g + j;
                const int hi = q[(size_t)r * 2 * N_OUT + o], lo = q[(size_t)r * 2 * N_OUT + N_OUT + o];
                sum += 127 * hi + lo;
                const double t = (double)(res[(size_t)r * N_OUT + o] * nwv[o]);
                const double e = std::fabs((double)d[gi].x * (127.0 * hi + lo) - t);
                worst_q = std::max(worst_q, step > 0 ? e / step : e);
            }
            if (f2u(d[gi].y) != f2u(d[gi].x * (float)sum)) {
                printf("  row %d group %d: scaled sum %a, expected %a\n", r, g, d[gi].y, d[gi].x * (float)sum);
                ok = false;
            }
            worst_ss = std::max(worst_ss, std::fabs(ss[gi] - sq) / sq);
        }
    if (!(worst_q <= 0.5 + 1e-3) || !(worst_ss <= 1e-6)) ok = false;
    printf("n_in %5d block %d R %d rows %d staged %d: residual NMSE %.2e, planes %.3f steps, sums %.1e %s\n", c.n_in,
           c.bx, c.R, c.rows, c.staged, nmse, worst_q, worst_ss, ok ? "OK" : "MISMATCH");
    if (row0) {
        Row0 now{std::vector<float>(res.begin(), res.begin() + N_OUT), std::vector<float>(ss.begin(), ss.begin() + ng),
                 std::vector<int8_t>(q.begin(), q.begin() + 2 * N_OUT), std::vector<float2>(d.begin(), d.begin() + ng)};
        if (c.R == 1) {
            *row0 = now;
        } else {
            bool same = true;
            for (int o = 0; o < N_OUT; o++) same &= f2u(now.x[o]) == f2u(row0->x[o]);
            for (int o = 0; o < 2 * N_OUT; o++) same &= now.q[o] == row0->q[o];
            for (int g = 0; g < ng; g++)
                same &= f2u(now.pss[g]) == f2u(row0->pss[g]) && f2u(now.d[g].x) == f2u(row0->d[g].x) &&
                        f2u(now.d[g].y) == f2u(row0->d[g].y);
            if (!same) {
                printf("  x row 0: R = 3 differs from R = 1\n");
                ok = false;
            }
        }
    }
    return ok;
}

int main() {
    bool ok = true;
    // (n_in, block, R, rows, staged): the Qwen3-8B o-projection's rows, a short row (one
    // super-block per warp of a group), the second block, padded x rows (rows < R).
    const Cfg pairs[][2] = {
        {{4096, 0, 1, 1, 1}, {4096, 0, 3, 3, 0}},
        {{4096, 1, 1, 1, 1}, {4096, 1, 3, 2, 0}},
        {{2048, 1, 1, 1, 1}, {2048, 1, 3, 3, 0}},
        {{256, 0, 1, 1, 1}, {256, 0, 3, 1, 0}},
    };
    for (const auto& p : pairs) {
        Row0 row0;
        const uint64_t seed = rng;
        ok &= run(p[0], &row0);
        rng = seed;
        ok &= run(p[1], &row0);
    }
    puts(ok ? "ALL OK" : "FAILED");
    return ok ? 0 : 1;
}
