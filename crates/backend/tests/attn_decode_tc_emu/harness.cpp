// Host emulation of attention.cu's tensor-core decode loop (decode_tc_loop with q8_dequant8
// and q8_scale2: the section between its EMU_DTC markers, written next to this file as
// dtc.cuh by attn_decode_tc_emu.rs, after kv_pos from between its EMU_KVPOS markers, as
// kvpos.cuh). One block of 128 threads on the host, every thread a fiber (../emu/fibers.h);
// emulated:
//  - tc_mma_f16: mma.sync m16n8k16 f16 x f16 -> f32: the 32 lanes deposit their fragments,
//    A (16 x 16) and B (16 x 8) are rebuilt from the PTX ISA fragment layout, each lane adds
//    its four dot products (in double, then rounded to f32);
//  - the half intrinsics (round to nearest even at every f16 result, as the hardware),
//    __shfl_xor_sync / __shfl_sync, __byte_perm, __ldcg.
// Each configuration (heads per block GB, f16 or q8_0 cache, the key range [start, end) of
// the block) runs the loop, merges the 4 warps' (m, l, acc) as attn_decode_impl's tail does,
// and compares every (head, dim) with a double-precision softmax attention over the cache's
// values (NMSE <= 1e-5: q and P are rounded to f16 for the MMAs, as in the tensor-core
// prefill). Prints one line per configuration and "ALL OK"; exit status 1 on a mismatch.
#define EMU_THREADS 128
#include <cmath>
#include <utility>

#include "fibers.h"
#include "intrinsics.h"

#define DECODE_THREADS 128
#define ATT_NEG (-1.0e30f)
#define ATT_FULL 0xffffffffu
#define TL_MARK_AFTER(k, v)  // the block timeline's marks (timeline.cuh): nothing on the host


// f32 -> f16 bits, rounded to nearest even (finite values, as the cache holds).
static uint16_t f2h(float f) {
    const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    double a = std::fabs((double)f);
    if (a == 0) return sign;
    int e;
    std::frexp(a, &e);                         // a = m 2^e, m in [0.5, 1)
    int ex = std::max(e - 1, -14);             // f16 exponent (subnormals at -14)
    const double q = std::ldexp(1.0, ex - 10);  // spacing of f16 values there
    double n = std::nearbyint(a / q);          // round half to even (default mode)
    double v = n * q;
    if (v >= 65520.0) return sign | 0x7C00;
    // Re-encode v.
    if (v < std::ldexp(1.0, -14)) return sign | (uint16_t)std::nearbyint(v / std::ldexp(1.0, -24));
    std::frexp(v, &e);
    ex = e - 1;
    const uint16_t mant = (uint16_t)((int)std::nearbyint(std::ldexp(v, 10 - ex)) - 1024);
    return sign | (uint16_t)((ex + 15) << 10) | mant;
}
struct __half2 {
    uint16_t x, y;
};
static inline __half2 __float2half2_rn(float f) { return {f2h(f), f2h(f)}; }
static inline __half2 __floats2half2_rn(float a, float b) { return {f2h(a), f2h(b)}; }
static inline __half2 __hsub2(__half2 a, __half2 b) {
    return {f2h(h2f(a.x) - h2f(b.x)), f2h(h2f(a.y) - h2f(b.y))};
}
static inline __half2 __hmul2(__half2 a, __half2 b) {
    return {f2h((float)((double)h2f(a.x) * h2f(b.x))), f2h((float)((double)h2f(a.y) * h2f(b.y)))};
}
static inline uint32_t tc_pack_f16(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}

static void tc_mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                       uint32_t b1) {
    Deposit m{};
    m.kind = 2;
    const uint32_t in[10] = {a0, a1, a2, a3, b0, b1, f2u(c[0]), f2u(c[1]), f2u(c[2]), f2u(c[3])};
    memcpy(m.w, in, sizeof in);
    const Deposit* all = warp_exchange(m);
    double A[16][16], B[16][8];
    const auto lo = [](uint32_t w) { return (double)h2f((uint16_t)(w & 0xFFFF)); };
    const auto hi = [](uint32_t w) { return (double)h2f((uint16_t)(w >> 16)); };
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        const uint32_t* w = all[l].w;
        A[g][2 * t] = lo(w[0]), A[g][2 * t + 1] = hi(w[0]);
        A[g + 8][2 * t] = lo(w[1]), A[g + 8][2 * t + 1] = hi(w[1]);
        A[g][2 * t + 8] = lo(w[2]), A[g][2 * t + 9] = hi(w[2]);
        A[g + 8][2 * t + 8] = lo(w[3]), A[g + 8][2 * t + 9] = hi(w[3]);
        B[2 * t][g] = lo(w[4]), B[2 * t + 1][g] = hi(w[4]);
        B[2 * t + 8][g] = lo(w[5]), B[2 * t + 9][g] = hi(w[5]);
    }
    const int lane = cur % 32, g = lane >> 2, t = lane & 3;
    for (int q = 0; q < 4; q++) {
        const int r = g + 8 * (q >> 1), col = 2 * t + (q & 1);
        double acc = c[q];
        for (int k = 0; k < 16; k++) acc += A[r][k] * B[k][col];
        c[q] = (float)acc;
    }
}

// attention.cu's f32 -> f16 of the kv store (saturating; finite values here).
static unsigned short f32_to_f16_sat(float x) {
    const float c = (x != x) ? x : std::fmin(std::fmax(x, -65504.f), 65504.f);
    return f2h(c);
}

#include "kvpos.cuh"
#include "dtc.cuh"

// ---- one configuration ------------------------------------------------------------------
constexpr int HD = 128, NWARP = 4, CAP = 512, MAXGB = 8;
struct Cfg {
    int gb, q8, start, end;
    int page_shift;  // 0: contiguous; else pages of 1 << page_shift positions, shuffled
};
// Paged layout: logical position p lives at physical row bt[p >> shift] * page + (p & (page - 1))
// of the same buffers (one kv head, so the page stride is page * HD elements).
static std::vector<int> bt;
static Cfg cfg;
static std::vector<float> qv;                 // [gb][HD]
static std::vector<uint16_t> kf, vf;          // f16 cache [CAP][HD]
static std::vector<uint8_t> kq, vq;           // q8_0 quants [CAP][HD]
static std::vector<uint16_t> ksc, vsc;        // q8_0 scales [CAP][HD / 32]
static const float SCALE_LOG2 = 1.4426950408889634f / std::sqrt((float)HD);

template <int GB>
static float* sm_acc_gb() {
    static float buf[NWARP * GB * HD];
    return buf;
}
template <int GB>
static float* sm_ml_gb(int which) {
    static float buf[2][NWARP * GB];
    return buf[which];
}

// PRE (f16, contiguous, one 16-key tile per warp): the step's new key at `pre_pos` is not in
// the cache (its row holds NaN) but in knew / vnew; the tile loaded "before the wait".
static int pre_pos = -1;
static std::vector<float> knew, vnew;
// ROPE (PRE only): the block's table (attn_decode_impl fills it before the wait).
static RopeTab rtab;

template <int GB, bool Q8, bool PIPE, bool PRE = false, bool ROPE = false>
static void run_body() {
    auto& a = *reinterpret_cast<float(*)[NWARP][GB][HD]>(sm_acc_gb<GB>());
    auto& m = *reinterpret_cast<float(*)[NWARP][GB]>(sm_ml_gb<GB>(0));
    auto& l = *reinterpret_cast<float(*)[NWARP][GB]>(sm_ml_gb<GB>(1));
    const unsigned char* kc = Q8 ? kq.data() : reinterpret_cast<const unsigned char*>(kf.data());
    const unsigned char* vc = Q8 ? vq.data() : reinterpret_cast<const unsigned char*>(vf.data());
    if constexpr (PRE) {
        const int lane = cur % 32, warp = (cur % EMU_THREADS) / 32;
        DtcF16Pre<HD / 32, true> pre;
        if (cfg.start + 16 * warp < cfg.end)
            dtc_f16_load<HD>(pre, kf.data(), vf.data(), cfg.start + 16 * warp, cfg.end, lane >> 2, lane & 3);
        const DtcNew nw{knew.data(), vnew.data(), kf.data(), vf.data(), pre_pos};
        decode_tc_loop<HD, GB, false, false, false, true, ROPE>(qv.data(), kc, vc, ksc.data(), vsc.data(), 0, GB, 0,
                                                                0, cfg.start, cfg.end, SCALE_LOG2, a, m, l, nullptr,
                                                                0, 0, pre, nw, &rtab);
    } else if (cfg.page_shift > 0) {
        decode_tc_loop<HD, GB, Q8, true>(qv.data(), kc, vc, ksc.data(), vsc.data(), 0, GB, 0, 0, cfg.start,
                                         cfg.end, SCALE_LOG2, a, m, l, bt.data(), cfg.page_shift,
                                         (long long)HD << cfg.page_shift);
    } else {
        decode_tc_loop<HD, GB, Q8, false, PIPE>(qv.data(), kc, vc, ksc.data(), vsc.data(), 0, GB, 0, 0, cfg.start,
                                                cfg.end, SCALE_LOG2, a, m, l);
    }
}

static std::vector<double> out_kernel, out_ref;

template <int GB, bool Q8, bool PIPE = false, bool PRE = false, bool ROPE = false>
static void run() {
    float* a = sm_acc_gb<GB>();
    float* m = sm_ml_gb<GB>(0);
    float* l = sm_ml_gb<GB>(1);
    for (int i = 0; i < NWARP * GB * HD; i++) a[i] = NAN;
    for (int i = 0; i < NWARP * GB; i++) m[i] = l[i] = NAN;
    run_block(0, 0, run_body<GB, Q8, PIPE, PRE, ROPE>);
    // attn_decode_impl's block merge.
    out_kernel.assign(GB * HD, 0.0);
    for (int h = 0; h < GB; h++) {
        float mx = ATT_NEG;
        for (int w = 0; w < NWARP; w++) mx = fmaxf(mx, m[w * GB + h]);
        double ls = 0;
        for (int w = 0; w < NWARP; w++) ls += l[w * GB + h] * std::exp2((double)m[w * GB + h] - mx);
        for (int d = 0; d < HD; d++) {
            double s = 0;
            for (int w = 0; w < NWARP; w++) s += a[(w * GB + h) * HD + d] * std::exp2((double)m[w * GB + h] - mx);
            out_kernel[h * HD + d] = s / ls;
        }
    }
}

static double kval(bool v, int lp, int d) {
    const int sh = cfg.page_shift;
    const int p = sh > 0 ? (bt[lp >> sh] << sh) + (lp & ((1 << sh) - 1)) : lp;  // physical row
    if (!cfg.q8) return h2f((v ? vf : kf)[p * HD + d]);
    const int8_t b = (int8_t)(v ? vq : kq)[p * HD + d];
    return b * (double)h2f((v ? vsc : ksc)[p * (HD / 32) + d / 32]);
}

static void reference() {
    out_ref.assign(cfg.gb * HD, 0.0);
    for (int h = 0; h < cfg.gb; h++) {
        std::vector<double> s(cfg.end - cfg.start);
        double mx = -1e300;
        for (int p = cfg.start; p < cfg.end; p++) {
            double dot = 0;
            for (int d = 0; d < HD; d++) dot += (double)qv[h * HD + d] * kval(false, p, d);
            s[p - cfg.start] = dot * SCALE_LOG2;
            mx = std::max(mx, s[p - cfg.start]);
        }
        double den = 0;
        for (auto& x : s) den += (x = std::exp2(x - mx));
        for (int d = 0; d < HD; d++) {
            double num = 0;
            for (int p = cfg.start; p < cfg.end; p++) num += s[p - cfg.start] * kval(true, p, d);
            out_ref[h * HD + d] = num / den;
        }
    }
}

// run<GB, ...>() for the case's heads per block (1, 2, 4 or 8).
template <bool Q8, bool PIPE = false, bool PRE = false, bool ROPE = false>
static void run_gb(int gb) {
    switch (gb) {
        case 1: run<1, Q8, PIPE, PRE, ROPE>(); break;
        case 2: run<2, Q8, PIPE, PRE, ROPE>(); break;
        case 4: run<4, Q8, PIPE, PRE, ROPE>(); break;
        case 8: run<8, Q8, PIPE, PRE, ROPE>(); break;
    }
}

// QK-norm + NeoX RoPE over 128 dims on the host, with the table's cos/sin and weights (as
// qk_norm_rope computes it; Σ x² in double).
static void host_qk_rope(float* x, const float* w) {
    double ss = 0;
    for (int d = 0; d < HD; d++) ss += (double)x[d] * x[d];
    const float sc = 1.0f / std::sqrt((float)(ss / HD) + rtab.eps);
    for (int d = 0; d < HD; d++) x[d] = (x[d] * sc) * w[d];
    for (int p = 0; p < HD / 2; p++) {
        const float x0 = x[p], x1 = x[p + HD / 2];
        x[p] = x0 * rtab.cs[p] - x1 * rtab.sn[p];
        x[p + HD / 2] = x0 * rtab.sn[p] + x1 * rtab.cs[p];
    }
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double urand() {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (rng >> 11) * (1.0 / 9007199254740992.0);
}
static double nrand() { return std::sqrt(-2 * std::log(urand() + 1e-300)) * std::cos(6.283185307179586 * urand()); }

int main() {
    const Cfg cases[] = {
        {4, 0, 0, 1},   {4, 0, 0, 17},  {4, 0, 64, 101}, {4, 0, 0, 200}, {1, 0, 5, 77},
        {4, 0, 0, 64},  {1, 0, 320, 333}, {8, 0, 448, 510}, {2, 0, 7, 8},
        {2, 0, 128, 192}, {8, 0, 0, 150}, {4, 1, 0, 1},   {4, 1, 0, 17},  {4, 1, 64, 101},
        {4, 1, 0, 200}, {8, 1, 3, 130}, {1, 1, 0, 64},
        // Paged caches: pages of 16 and 2 positions, shuffled (a tile's keys cross pages).
        {4, 0, 0, 200, 4}, {4, 1, 0, 200, 4}, {8, 0, 3, 130, 4}, {2, 1, 64, 101, 4},
        {4, 0, 5, 77, 1}, {4, 1, 0, 40, 1},
    };
    bool ok = true;
    for (const Cfg& c : cases) {
        cfg = c;
        qv.resize(MAXGB * HD);
        for (auto& x : qv) x = (float)nrand();
        kf.resize(CAP * HD), vf.resize(CAP * HD), kq.resize(CAP * HD), vq.resize(CAP * HD);
        ksc.resize(CAP * HD / 32), vsc.resize(CAP * HD / 32);
        for (int i = 0; i < CAP * HD; i++) {
            kf[i] = f2h((float)(2 * nrand()));
            vf[i] = f2h((float)nrand());
            kq[i] = (uint8_t)(int8_t)(int)std::lround(127 * (2 * urand() - 1));
            vq[i] = (uint8_t)(int8_t)(int)std::lround(127 * (2 * urand() - 1));
        }
        for (int i = 0; i < CAP * HD / 32; i++) {
            ksc[i] = f2h((float)(0.02 * (0.5 + urand())));
            vsc[i] = f2h((float)(0.01 * (0.5 + urand())));
        }
        if (c.page_shift > 0) {  // a random permutation of the CAP >> shift pages
            bt.resize(CAP >> c.page_shift);
            for (size_t i = 0; i < bt.size(); i++) bt[i] = (int)i;
            for (size_t i = bt.size() - 1; i > 0; i--) std::swap(bt[i], bt[(size_t)(urand() * (i + 1)) % (i + 1)]);
        }
        if (c.q8)
            run_gb<true>(c.gb);
        else
            run_gb<false>(c.gb);
        // The q8_0 loop with the next tile's loads issued early (PIPE, contiguous caches):
        // the same arithmetic, so the same bits as the plain loop.
        bool pipe_same = true;
        if (c.q8 && c.page_shift == 0) {
            const std::vector<double> plain = out_kernel;
            run_gb<true, true>(c.gb);
            pipe_same = out_kernel == plain;
            if (!pipe_same) printf("gb=%d q8_0 keys [%d, %d): the PIPE loop differs from the plain one\n", c.gb,
                                   c.start, c.end);
        }
        // The f16 loop with its one tile per warp loaded before the wait (PRE: chunks of at most
        // 64 keys): the new key (the range's last, as in a row's last split; or past the range,
        // as in the other splits) taken from the step's rows, NaN in its cache row until the
        // loop stores it. Same values, so the plain loop's bits, and the row stored exactly.
        bool pre_same = true;
        if (!c.q8 && c.page_shift == 0 && c.end - c.start <= 64) {
            const std::vector<double> plain = out_kernel;
            for (const int pos : {c.end - 1, c.end + 5}) {
                if (pos >= CAP) continue;
                const std::vector<uint16_t> kf0 = kf, vf0 = vf;
                knew.assign(HD, 0.f), vnew.assign(HD, 0.f);
                for (int d = 0; d < HD; d++) {
                    knew[d] = h2f(kf[pos * HD + d]), vnew[d] = h2f(vf[pos * HD + d]);
                    kf[pos * HD + d] = vf[pos * HD + d] = 0x7E00;  // NaN: not yet written
                }
                pre_pos = pos;
                run_gb<false, false, true>(c.gb);
                const bool same = out_kernel == plain;
                // Its row stored by the block that holds it; left alone by the others.
                const bool stored = pos < c.end ? (kf == kf0 && vf == vf0) : true;
                if (!same || !stored)
                    printf("gb=%d f16 keys [%d, %d) new key %d: PRE %s\n", c.gb, c.start, c.end, pos,
                           !same ? "differs from the plain loop" : "did not store the new row");
                pre_same = pre_same && same && stored;
                // ROPE: raw q and new key through the fused form, against the plain PRE loop on
                // the host-rotated ones (Σ x² in another order: NMSE, not bits), and the stored
                // key row within f16 rounding of the host-rotated one.
                if (pos < c.end) {
                    const std::vector<float> q0 = qv;
                    for (int p = 0; p < HD / 2; p++) {
                        const float a = (float)pos * (1.0f / std::pow(1e6f, (float)(2 * p) / 128.0f));
                        rtab.cs[p] = std::cos(a), rtab.sn[p] = std::sin(a);
                    }
                    for (int d = 0; d < HD; d++) {
                        rtab.qw[d] = (float)(1 + 0.1 * nrand()), rtab.kw[d] = (float)(1 + 0.1 * nrand());
                        knew[d] = (float)(3 * nrand());
                    }
                    rtab.eps = 1e-6f;
                    const std::vector<float> kraw = knew;
                    std::vector<float> qrot = qv;
                    for (int h = 0; h < c.gb; h++) host_qk_rope(&qrot[h * HD], rtab.qw);
                    host_qk_rope(knew.data(), rtab.kw);
                    qv = qrot;
                    run_gb<false, false, true>(c.gb);
                    const std::vector<double> want = out_kernel;
                    const std::vector<uint16_t> krow(kf.begin() + pos * HD, kf.begin() + (pos + 1) * HD);
                    kf = kf0, vf = vf0;
                    for (int d = 0; d < HD; d++) kf[pos * HD + d] = vf[pos * HD + d] = 0x7E00;
                    qv = q0, knew = kraw;
                    run_gb<false, false, true, true>(c.gb);
                    double num = 0, den = 0, kerr = 0;
                    for (size_t i = 0; i < want.size(); i++)
                        num += (out_kernel[i] - want[i]) * (out_kernel[i] - want[i]), den += want[i] * want[i];
                    for (int d = 0; d < HD; d++)
                        kerr = std::max(kerr, (double)std::fabs(h2f(kf[pos * HD + d]) - h2f(krow[d])) /
                                                  std::max(1e-3, (double)std::fabs(h2f(krow[d]))));
                    const double nm = num / std::max(den, 1e-300);
                    const bool rope_ok = nm <= 1e-8 && kerr <= 2e-3;
                    if (!rope_ok)
                        printf("gb=%d f16 keys [%d, %d) new key %d: ROPE NMSE %.2e, stored key rel. error %.2e\n",
                               c.gb, c.start, c.end, pos, nm, kerr);
                    pre_same = pre_same && rope_ok;
                    qv = q0;
                }
                kf = kf0, vf = vf0;
            }
            out_kernel = plain;
        }
        reference();
        double num = 0, den = 0;
        for (size_t i = 0; i < out_ref.size(); i++) {
            const double e = out_kernel[i] - out_ref[i];
            num += e * e, den += out_ref[i] * out_ref[i];
        }
        const double nmse = num / std::max(den, 1e-300);
        const bool good = std::isfinite(nmse) && nmse <= 1e-5 && pipe_same && pre_same;
        printf("gb=%d %s keys [%d, %d)%s: NMSE %.2e %s\n", c.gb, c.q8 ? "q8_0" : "f16", c.start, c.end,
               c.page_shift ? (c.page_shift == 4 ? " paged 16" : " paged 2") : "", nmse, good ? "OK" : "FAIL");
        ok = ok && good;
    }
    if (ok) printf("ALL OK\n");
    return ok ? 0 : 1;
}
