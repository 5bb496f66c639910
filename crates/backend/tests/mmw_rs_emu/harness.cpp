// Host emulation of mmw.cu's RS fragment decode (`mmw_rs_row`, the section between its EMU_RS
// markers, written next to this file as rs.cuh by mmw_rs_emu.rs, on mm_decode.cuh's EMU_DEC
// section: byte_f, scale_min_w, pack_bf16). A 128-row Q4_K tile of random super-blocks
// (random d, dmin, all 64 scale and min values, every nibble) is laid out as the RS
// producers' tensor copies leave it in a stage (headers [128][16], then one group's quants
// [128][32]); every consumer thread (warpgroup c, warp w, lane g·4 + t) decodes its two rows
// for each group G of the super-block, plain and SwiGLU row orders (mmw.cu's ra / rb2).
// Checked: each of the 4 k16 steps' four registers holds, as mma.sync m16n8k16's A fragment
// places them, the bf16 (round to nearest even) of ggml's value d · sc · q − dmin · m of the
// element it stands for (by ggml's own layout, q4k_ref.h's scale_min), bit for bit; and that
// every element of the tile is covered once per step. The Q8_0 form (`mmw_rs_row_q80`) the
// same way on a tile of random Q8_0 rows, each row's 80-byte span of a step (two blocks at the
// step's offset in it, junk around them) as its producer copies it: each register the bf16 of
// q · d of its element. The Q6_K form (`mmw_rs_row_q6k`) on random super-blocks at every
// super-block offset and quarter pair, its two spans a row as its producer would copy them:
// each register the bf16 of ggml's dequantize_row_q6_K value; the Q5_K form (`mmw_rs_row<true>`)
// as the Q4_K one with each nibble's fifth bit from qh. Prints one line per
// configuration and "ALL OK"; exit status 1 on a mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fibers.h"
#include "intrinsics.h"

#define QK 32
#define QK_K 256
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176
#define Q6_K_BYTES 210
#define Q8_0_BYTES 34

// bf16 pairs: the device's __floats2bfloat162_rn (round to nearest even; no NaN here).
struct __nv_bfloat162 {
    uint16_t x, y;
};
static uint16_t bf16_rn(float f) {
    const uint32_t u = f2u(f);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
static __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {bf16_rn(a), bf16_rn(b)}; }

// The stage: shared addresses are offsets into this buffer (large enough for the Q6_K form's
// two spans a row, the largest).
#define MMW_RS_Q6_QL_BYTES 80
#define MMW_RS_Q6_HI_BYTES 96
static uint8_t smem[128 * (MMW_RS_Q6_QL_BYTES + MMW_RS_Q6_HI_BYTES)];
static uint4 mmw_lds128(uint32_t a) {
    uint4 v;
    memcpy(&v, smem + a, 16);
    return v;
}
static uint32_t mmw_lds16(uint32_t a) {
    uint16_t v;
    memcpy(&v, smem + a, 2);
    return v;
}

#include "dec.cuh"
#include "rs.cuh"
#include "q4k_ref.h"  // scale_min: ggml's get_scale_min_k4
#include "rng.h"      // rnd, rnd_f16

static const int TM = 128;
static int bad = 0;

// Every consumer thread (warpgroup c, warp w, lane g·4 + t) of the tile decodes its two rows
// (mmw.cu's ra / rb2 for the row order) by decode(ra, rb2, t, a); each register half must be
// want(row, col) for the element mma.sync m16n8k16's A fragment places there, and every element
// of the step must be covered once. `label` names the configuration in the messages.
template <typename Decode, typename Want>
static void check_tile(bool swiglu, Decode decode, Want want, const char* label) {
    std::vector<int> seen(TM * 64, 0);
    for (int c = 0; c < 2; c++)
        for (int w = 0; w < 4; w++)
            for (int lane = 0; lane < 32; lane++) {
                const int g = lane >> 2, t = lane & 3;
                const int ra = swiglu ? (4 * c + w) * 8 + g : 64 * c + 16 * w + g;
                const int rb2 = swiglu ? TM / 2 + ra : ra + 8;
                uint32_t a[16];
                decode(ra, rb2, t, a);
                for (int kk = 0; kk < 4; kk++)
                    for (int reg = 0; reg < 4; reg++)
                        for (int e = 0; e < 2; e++) {
                            const int row = (reg & 1) ? rb2 : ra;
                            const int col = 16 * kk + 2 * t + (reg >= 2 ? 8 : 0) + e;
                            const uint16_t want_v = want(row, col);
                            const uint16_t got = (uint16_t)(a[4 * kk + reg] >> (16 * e));
                            seen[row * 64 + col]++;
                            if (got != want_v && bad++ < 10)
                                printf("MISMATCH %s c %d w %d lane %d kk %d reg %d e %d: %04x != %04x\n", label, c, w,
                                       lane, kk, reg, e, got, want_v);
                        }
            }
    for (int i = 0; i < TM * 64; i++)
        if (seen[i] != 1 && bad++ < 10) printf("COVERAGE %s row %d col %d seen %d times\n", label, i / 64, i % 64, seen[i]);
}

// The Q4_K form, or with Q5 the Q5_K form: a tile of random super-blocks (random d, dmin, all
// 64 scale and min values, every nibble; Q5_K also qh[32] after the header), the stage as its
// producer's copies leave it (each row's first HB bytes, the header and Q5_K's qh, [128][HB], then
// one group's quants [128][32]), against ggml's dequantize_row_q4_K / _q5_K: element 64 G + l
// (l < 32) is quant byte 32 G + l's low nibble, element 64 G + 32 + l its high one, Q5_K's + 16
// where bit 2G (2G + 1) of qh[l] is set, times d · sc minus dmin · m of sub-block 2G (2G + 1).
template <bool Q5>
static void check_kq(char* label, size_t label_len) {
    const int SB = Q5 ? Q5_K_BYTES : Q4_K_BYTES, HB = Q5 ? 48 : 16;
    const char* name = Q5 ? "q5_K" : "q4_K";
    std::vector<uint8_t> rows(TM * SB);
    for (int trial = 0; trial < 8; trial++) {
        for (auto& b : rows) b = (uint8_t)rnd();
        for (int r = 0; r < TM; r++) {
            const uint16_t d = rnd_f16(), dmin = rnd_f16();
            memcpy(&rows[r * SB], &d, 2);
            memcpy(&rows[r * SB + 2], &dmin, 2);
        }
        for (int swiglu = 0; swiglu < 2; swiglu++) {
            for (int G = 0; G < 4; G++) {
                // The stage as the producers' copies leave it.
                for (int r = 0; r < TM; r++) {
                    memcpy(smem + r * HB, &rows[r * SB], HB);
                    memcpy(smem + TM * HB + r * 32, &rows[r * SB + HB + 32 * G], 32);
                }
                snprintf(label, label_len, "%s trial %d swiglu %d G %d", name, trial, swiglu, G);
                check_tile(
                    swiglu,
                    [&](int ra, int rb2, int t, uint32_t(&a)[16]) {
                        mmw_rs_row<Q5>(ra * HB, TM * HB + ra * 32, G, t, 0, a);
                        mmw_rs_row<Q5>(rb2 * HB, TM * HB + rb2 * 32, G, t, 1, a);
                    },
                    [&](int row, int col) {
                        // ggml: element 64 G + col of the super-block is sub-block j = 2 G +
                        // col / 32, quant byte 32 G + col % 32's nibble (+ 16 by qh's bit j).
                        const uint8_t* b = &rows[row * SB];
                        const int j = 2 * G + col / 32, l = col % 32;
                        const uint8_t qb = b[HB + 32 * G + l];
                        const int q = (col < 32 ? qb & 15 : qb >> 4) + (Q5 && (b[16 + l] >> j) & 1 ? 16 : 0);
                        int sc, m;
                        scale_min(j, b + 4, sc, m);
                        const float ds = h2f(b[0] | b[1] << 8) * (float)sc;
                        const float dm = h2f(b[2] | b[3] << 8) * (float)m;
                        return bf16_rn(fmaf((float)q, ds, -dm));
                    },
                    label);
            }
            printf("%s trial %d %s: %s\n", name, trial, swiglu ? "swiglu" : "plain", bad ? "FAIL" : "ok");
        }
    }
}

int main() {
    char label[96];
    // Q4_K, and Q5_K (`mmw_rs_row<true>`): a tile of random super-blocks, one 64-element group
    // G a step.
    check_kq<false>(label, sizeof label);
    check_kq<true>(label, sizeof label);
    // The Q8_0 form: a step's two blocks (f16 d, 32 int8 quants each) a row, in 80-byte spans
    // as the producer copies them, from the 16-byte unit holding the blocks: at step kt they
    // sit mmw_rs_q80_off(kt) bytes into the span (kt = 0..3: offsets 0, 4, 8, 12; the rest
    // junk).
    const int SPAN = MMW_RS_Q80_SPAN, QB = 34;
    for (int trial = 0; trial < 8; trial++) {
        const int kt = trial % 4 + 4 * (trial / 4) * 5;  // 0..3, then 20..23: the same offsets
        const int off = (int)mmw_rs_q80_off(kt);
        if (off != (kt * MMW_RS_Q80_STEP) % 16 || mmw_rs_q80_col(kt) + off != kt * MMW_RS_Q80_STEP ||
            off + 2 * QB > SPAN) {
            printf("q8_0 step %d: span offset %d FAIL\n", kt, off);
            bad = true;
        }
        for (int i = 0; i < TM * SPAN; i++) smem[i] = (uint8_t)rnd();
        for (int r = 0; r < TM; r++)
            for (int b = 0; b < 2; b++) {
                const uint16_t d = rnd_f16();
                memcpy(smem + r * SPAN + off + QB * b, &d, 2);
            }
        for (int swiglu = 0; swiglu < 2; swiglu++) {
            snprintf(label, sizeof label, "q8_0 trial %d step %d swiglu %d", trial, kt, swiglu);
            check_tile(
                swiglu,
                [&](int ra, int rb2, int t, uint32_t(&a)[16]) {
                    mmw_rs_row_q80(ra * SPAN, kt, t, 0, a);
                    mmw_rs_row_q80(rb2 * SPAN, kt, t, 1, a);
                },
                [&](int row, int col) {
                    // ggml: element col of the step is quant col % 32 of block col / 32.
                    const uint8_t* blk = smem + row * SPAN + off + QB * (col / 32);
                    const float d = h2f(blk[0] | blk[1] << 8);
                    return bf16_rn((float)(int8_t)blk[2 + col % 32] * d);
                },
                label);
            printf("q8_0 trial %d %s: %s\n", trial, swiglu ? "swiglu" : "plain", bad ? "FAIL" : "ok");
        }
    }
    // The Q6_K form: a tile of random super-blocks (210 bytes: ql, qh, scales, d); at step kt
    // each row's two spans as the producer copies them, from the 16-byte units below the
    // half's ql bytes and below bytes 128..209 (the rest junk), against ggml's
    // dequantize_row_q6_K of the super-block. Steps over every super-block offset (kt / 4 =
    // 0..7) and each quarter pair.
    {
        const int QL = MMW_RS_Q6_QL, HI = MMW_RS_Q6_HI, HIB = TM * QL;
        if (QL != MMW_RS_Q6_QL_BYTES || HI != MMW_RS_Q6_HI_BYTES) {
            printf("q6_k spans %d, %d: the harness's buffer is for %d, %d FAIL\n", QL, HI, MMW_RS_Q6_QL_BYTES,
                   MMW_RS_Q6_HI_BYTES);
            bad++;
        }
        std::vector<uint8_t> sbs(TM * 210);
        std::vector<float> y(TM * 256);
        for (int trial = 0; trial < 16; trial++) {
            const int sb = trial % 8, j = (trial + trial / 8 * 2) % 4, kt = 4 * sb + j;
            const int n = j / 2, off = (int)mmw_rs_q6k_off(kt);
            if (off != (210 * sb) % 16 || mmw_rs_q6k_qlcol(kt) + off != 210 * sb + 64 * n ||
                mmw_rs_q6k_hicol(kt) + off != 210 * sb + 128 || off + 64 > QL || off + 82 > HI) {
                printf("q6_k step %d: span offset %d FAIL\n", kt, off);
                bad++;
            }
            for (auto& b : sbs) b = (uint8_t)rnd();
            for (int r = 0; r < TM; r++) {
                uint8_t* b = sbs.data() + r * 210;
                const uint16_t d = rnd_f16();
                memcpy(b + 208, &d, 2);
                // ggml's dequantize_row_q6_K, one super-block.
                const uint8_t *ql = b, *qh = b + 128;
                const int8_t* sc = (const int8_t*)(b + 192);
                const float df = h2f(d);
                float* yr = y.data() + r * 256;
                for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, yr += 128)
                    for (int l = 0; l < 32; l++) {
                        const int is = l / 16;
                        const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                        const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        yr[l + 0] = df * sc[is + 0] * q1;
                        yr[l + 32] = df * sc[is + 2] * q2;
                        yr[l + 64] = df * sc[is + 4] * q3;
                        yr[l + 96] = df * sc[is + 6] * q4;
                    }
                // The spans: junk around the copied bytes.
                for (int i = 0; i < QL; i++) smem[r * QL + i] = (uint8_t)rnd();
                for (int i = 0; i < HI; i++) smem[HIB + r * HI + i] = (uint8_t)rnd();
                memcpy(smem + r * QL + off, b + 64 * n, 64);
                memcpy(smem + HIB + r * HI + off, b + 128, 82);
            }
            for (int swiglu = 0; swiglu < 2; swiglu++) {
                snprintf(label, sizeof label, "q6_k trial %d step %d swiglu %d", trial, kt, swiglu);
                check_tile(
                    swiglu,
                    [&](int ra, int rb2, int t, uint32_t(&a)[16]) {
                        mmw_rs_row_q6k(ra * QL, HIB + ra * HI, kt, t, 0, a);
                        mmw_rs_row_q6k(rb2 * QL, HIB + rb2 * HI, kt, t, 1, a);
                    },
                    [&](int row, int col) { return bf16_rn(y[row * 256 + 64 * j + col]); }, label);
                printf("q6_k trial %d %s: %s\n", trial, swiglu ? "swiglu" : "plain", bad ? "FAIL" : "ok");
            }
        }
    }
    if (bad) return 1;
    printf("ALL OK\n");
    return 0;
}
