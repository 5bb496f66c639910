// Double-precision references of the Q4_K tensor-core GEMV for the emulation harnesses
// (gemv_tc_emu, gemv_tc2_emu): ggml's scale decoding and a row's dot product with the int8 x
// planes and block scales the kernels read (and Q5_K's). Needs QK, QK_K, Q4_K_BYTES, Q5_K_BYTES
// and h2f.
#pragma once

// ggml's get_scale_min_k4.
static void scale_min(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// sum over the row of w . x for x row r, in double, from the same int8 planes and scales.
// q5: a Q5_K row (ggml's layout: d, dmin, the scales, qh[32], qs[128]; weight 32 j + k takes
// nibble j % 2 of qs byte 32 (j / 2) + k and bit j of qh byte k as its fifth).
static double ref_dot_k(const uint8_t* row, int n_in, const int8_t* xr, const float2* dr, bool q5) {
    double acc = 0;
    const int bytes = q5 ? Q5_K_BYTES : Q4_K_BYTES, qs = q5 ? 48 : 16;
    for (int sb = 0; sb < n_in / QK_K; sb++) {
        const uint8_t* b = row + sb * bytes;
        const double d = h2f(b[0] | b[1] << 8), dmin = h2f(b[2] | b[3] << 8);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            scale_min(j, b + 4, sc, m);
            int64_t s = 0;
            for (int k = 0; k < 32; k++) {
                const uint8_t qb = b[qs + 32 * (j / 2) + k];
                const int q = (j % 2 ? qb >> 4 : qb & 15) | (q5 ? ((b[16 + k] >> j) & 1) << 4 : 0);
                const int e = sb * QK_K + 32 * j + k;
                s += (int64_t)q * (127 * xr[e] + xr[n_in + e]);
            }
            const float2 ds = dr[sb * 8 + j];
            acc += d * sc * ds.x * (double)s - dmin * m * ds.y;
        }
    }
    return acc;
}
static double ref_dot_q4(const uint8_t* row, int n_in, const int8_t* xr, const float2* dr) {
    return ref_dot_k(row, n_in, xr, dr, false);
}
