// mma.sync m16n8k32 with 8-bit operands (tc_mma: u8 x s8, tc_mma_s8: s8 x s8 -> s32) for the
// kernel emulation harnesses (gemv_tc_emu, gemv_tc2_emu): the 32 lanes deposit their
// fragments, A (16 x 32) and B (32 x 8) are rebuilt from the PTX ISA fragment layout, each lane
// adds its four products exactly (integers). Included after fibers.h.
#pragma once

template <bool SA>
static void mma_emu(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    Deposit m{};
    m.kind = 2;
    const uint32_t in[10] = {a0, a1, a2, a3, b0, b1, (uint32_t)c[0], (uint32_t)c[1], (uint32_t)c[2], (uint32_t)c[3]};
    memcpy(m.w, in, sizeof in);
    const Deposit* all = warp_exchange(m);
    int A[16][32], B[32][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; i++) {
            // A: unsigned bytes (tc_mma) or signed (tc_mma_s8).
            const auto a = [&](uint32_t w) { return SA ? (int)(int8_t)(w >> (8 * i)) : (int)((w >> (8 * i)) & 0xFF); };
            A[g][4 * t + i] = a(all[l].w[0]);
            A[g + 8][4 * t + i] = a(all[l].w[1]);
            A[g][16 + 4 * t + i] = a(all[l].w[2]);
            A[g + 8][16 + 4 * t + i] = a(all[l].w[3]);
            B[4 * t + i][g] = (int8_t)((all[l].w[4] >> (8 * i)) & 0xFF);  // signed bytes
            B[16 + 4 * t + i][g] = (int8_t)((all[l].w[5] >> (8 * i)) & 0xFF);
        }
    }
    const int lane = cur % 32, g = lane >> 2, t = lane & 3;
    for (int q = 0; q < 4; q++) {
        const int r = g + 8 * (q >> 1), col = 2 * t + (q & 1);
        int64_t acc = c[q];
        for (int k = 0; k < 32; k++) acc += (int64_t)A[r][k] * B[k][col];
        c[q] = (int)acc;
    }
}

static void tc_mma(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    mma_emu<false>(c, a0, a1, a2, a3, b0, b1);
}
static void tc_mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    mma_emu<true>(c, a0, a1, a2, a3, b0, b1);
}
