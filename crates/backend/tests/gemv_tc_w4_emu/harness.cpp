// Host emulation of the four-warp NORM SwiGLU (gemvq_tc_q4k's W4, the one-row kernel
// gemvq_swiglu_tcnw4_q4_k_r1) against the eight-warp one (gemvq_swiglu_tcn_q4_k_r1), and of
// the four-warp plain tile of the K-split down (gemvq_tck[n]w4_q4_k_r1) against its
// eight-warp one, and the same for the Q8_0 K-split tile (gemvq_tc_q80's W4,
// gemvq_tcknw4_q8_0_r1), on the same tiles: compiled twice by gemv_tc_w4_emu.rs, as an eight-warp
// block (EMU_THREADS 256) and, with EMU_W4 defined, as a four-warp block (EMU_THREADS 128).
// Each run stages x (tc_stage_x), takes the norm's scale (tc_norm_scale; the SwiGLU only)
// and prints every output's bits; the test requires the two printouts to be identical (W4
// claims the eight-warp kernel's sums in its order) and every output finite.
#include "gemv_tc.h"
#include "rng.h"

static const uint8_t *s0, *s1;
static long long rb;
static const int8_t* xq;
static const float2* xd;
static uint8_t* xs;
static float* out;
static const float* pss;
static float sn[1];
static int n_in, n_out;

static bool plain;  // the plain 16-row tile (the K-split down's, gemvq_tck[n]w4) instead of the SwiGLU
static bool q8;     // that tile in Q8_0 (gemvq_tc_q80)

static void body() {
    if (!plain) tc_norm_scale<1>(pss, n_in, 1, 1e-6f, sn);
    tc_stage_x(xs, xq, xd, n_in);  // ends with the barrier that also orders sn
    const int8_t* xa = (const int8_t*)xs;
    const float2* da = (const float2*)(xs + 2 * n_in + 128);
#ifdef EMU_W4
    constexpr bool W4 = true;
#else
    constexpr bool W4 = false;
#endif
    if (q8)
        gemvq_tc_q80<1, false, true, false, W4>(s0, s1, rb, n_out, n_in, xa, da, 1, out, 0, n_in + 64, n_in);
    else if (plain)  // as gemvq_tck_block calls it: the staged slice, kcols = its width
        gemvq_tc_q4k<1, false, true, false, false, false, W4>(s0, s1, rb, n_out, n_in, xa, da, 1, out, 0, n_in + 64,
                                                              n_in);
    else
        gemvq_tc_q4k<1, true, true, false, true, false, W4>(s0, s1, rb, n_out, n_in, xa, da, 1, out, 0, n_in + 64, 0,
                                                            sn);
}

int main() {
    // (n_in, n_out): super-blocks per (eight-)warp 2 (Qwen3-8B's 4096), 1, 1 or 0 (768: warps
    // past the last super-block), 3 and 2 (5120: odd and even counts per W4 warp), a partial tile.
    // The plain tile (third column 1): 16 rows, the K-split down's 4096-column slice first;
    // 2: the Q8_0 tile, its 2048-column slice first (units per eight-warp warp 1, 2, 3, 0..1).
    const int cfgs[][3] = {{4096, 8, 0}, {2048, 8, 0},  {768, 5, 0},   {5120, 8, 0},  {256, 3, 0},
                           {4096, 16, 1}, {3072, 16, 1}, {768, 11, 1}, {2048, 16, 2}, {4096, 16, 2},
                           {6144, 16, 2}, {768, 9, 2}};
    for (const auto& c : cfgs) {
        n_in = c[0], n_out = c[1], plain = c[2] != 0, q8 = c[2] == 2;
        const int ns = 8, nb = n_in / QK, bytes = q8 ? 8 * Q8_0_BYTES : Q4_K_BYTES;  // per 256 columns
        rb = (long long)(n_in / QK_K) * bytes;
        std::vector<uint8_t> w(2 * ns * rb);  // gate rows 0..7, then up rows 0..7 (plain: rows 0..15)
        for (int r = 0; r < 2 * ns; r++)
            for (int sb = 0; sb < n_in / QK_K; sb++) {
                uint8_t* b = &w[r * rb + sb * bytes];
                for (int i = 0; i < bytes; i++) b[i] = rnd() & 0xFF;
                for (int k = 0; k < (q8 ? 8 : 1); k++) {
                    const uint16_t d = rnd_f16();
                    b[k * Q8_0_BYTES] = d & 0xFF, b[k * Q8_0_BYTES + 1] = d >> 8;
                }
                if (!q8) {
                    const uint16_t dm = rnd_f16();
                    b[2] = dm & 0xFF, b[3] = dm >> 8;
                }
            }
        // Q8_0: rows 16 bytes apart beyond their length, as gemvq_tck_block lays them out.
        const long long rs = q8 ? rb + 16 : rb;
        std::vector<uint8_t> slots(2 * ns * rs + 16);
        for (int r = 0; r < 2 * ns; r++) memcpy(&slots[r * rs], &w[r * rb], rb);
        s0 = slots.data(), s1 = slots.data() + ns * rs;
        rb = rs;
        std::vector<int8_t> x(2 * n_in);
        std::vector<float2> dsc(nb);
        for (int e = 0; e < n_in; e++) {
            x[e] = (int8_t)((int)(rnd() % 255) - 127);
            x[n_in + e] = (int8_t)((int)(rnd() % 129) - 64);
        }
        for (int i = 0; i < nb; i++) dsc[i] = {unif(1e-4f, 1e-2f), unif(-50.f, 50.f)};
        xq = x.data(), xd = dsc.data();
        std::vector<float> ssv(nb);
        // Group sums that scale the dot products (~1e8 here) to a few units, so that silu(gate)
        // is not a signed zero for half the outputs.
        for (int g = 0; g < nb; g++) ssv[g] = (0.5f + (float)((g * 7919) % 997) / 25.0f) * 1e16f;
        pss = ssv.data();
        std::vector<uint8_t> xsb(2 * n_in + 128 + nb * 8 + 16);
        xs = xsb.data();
        std::vector<float> ob(n_out, 0.0f);
        out = ob.data();
        run_block(0, 0, body);
        printf("%s n_in %d n_out %d:", q8 ? "q8_0" : plain ? "plain" : "swiglu", n_in, n_out);
        for (int i = 0; i < n_out; i++) printf(" %08x", f2u(ob[i]));
        printf("\n");
        for (int i = 0; i < n_out; i++)
            if (!std::isfinite(ob[i])) {
                printf("output %d not finite\n", i);
                return 1;
            }
    }
    return 0;
}
