// Host emulation of attention.cu's split merge launch (attn_decode_merge, between its
// EMU_MERGE markers, written next to this file as merge.cuh by attn_decode_merge_emu.rs, after
// decode_emit from between its EMU_EMIT markers and quant_q8_lane from common.cuh's EMU_Q8).
// Every block (head h, 32-dim chunk c, row t) runs as 128 fibers (../emu/fibers.h) over
// random partials (m, l, acc) of a decode launch's splits; the splits past the row's active
// ones hold NaN (a merge that reads one fails). Each output is compared with a double-precision
// merge of the active splits (max |error| <= 1e-5 of the largest output); a row whose keys took
// one split must be left untouched (its decode block emitted it); the o-projection's planes
// must hold the output (|d (127 hi + lo) - out| <= d: quant_q8_lane's error is d / 2).
// Prints one line per case and "ALL OK"; exit status 1 on a mismatch.
#define EMU_THREADS 128
#include <cmath>
#include <cstdio>
#include <vector>

#include "fibers.h"
#include "intrinsics.h"

#include "attn_emit.h"
#include "merge.cuh"

constexpr int HD = 128, MIN_CHUNK = 64, STEP = 64;
struct Case {
    int n_heads, n_splits, capacity;
    std::vector<int> positions;  // one per row
};
static const Case* cur_case;
static std::vector<float> acc, ml, out;
static std::vector<int8_t> xq;
static std::vector<float2> xd;
static int cur_t;

static void body() {
    blockIdx.z = cur_t;
    const Case& c = *cur_case;
    attn_decode_merge(acc.data(), ml.data(), c.positions.data(), out.data(), xq.data(), xd.data(), c.n_heads,
                      c.capacity, c.n_splits, MIN_CHUNK, STEP);
}

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static double urand() {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (rng >> 11) * (1.0 / 9007199254740992.0);
}

// The decode launch's active splits of a row at position p, restated here as the oracle
// (attention.cu decode_chunk and decode_active, which the kernel under test calls).
static int active_splits(const Case& c, int p) {
    const int n_keys = std::max(0, std::min(p + 1, c.capacity));
    const int per = (n_keys + c.n_splits - 1) / c.n_splits;
    const int chunk = std::max(MIN_CHUNK, (per + STEP - 1) / STEP * STEP);
    return std::max(1, (n_keys + chunk - 1) / chunk);
}

int main() {
    const Case cases[] = {
        {32, 49, 32960, {32895}},       // Qwen3-8B at depth 32768 (47 active)
        {4, 64, 5008, {5004}},          // the check's depth-5004 case
        {32, 24, 1504, {1499, 1500}},   // two rows (verify)
        {8, 20, 1200, {100}},           // two active of 20
        {8, 49, 33000, {10, 20000}},    // one split (untouched), and a row beside it
        {8, 128, 40000, {39999}},       // the most splits: 32 per warp
    };
    bool ok = true;
    for (const Case& c : cases) {
        cur_case = &c;
        const int rows = (int)c.positions.size(), H = c.n_heads, S = c.n_splits;
        acc.assign((size_t)rows * H * S * HD, NAN);
        ml.assign((size_t)rows * H * S * 2, NAN);
        out.assign((size_t)rows * H * HD, NAN);
        xq.assign((size_t)rows * 2 * H * HD, 0);
        xd.assign((size_t)rows * H * HD / QK, make_float2(0.f, 0.f));
        for (int t = 0; t < rows; t++) {
            const int na = active_splits(c, c.positions[t]);
            for (int h = 0; h < H; h++)
                for (int s = 0; s < na; s++) {
                    const size_t pr = ((size_t)t * H + h) * S + s;
                    ml[2 * pr] = (float)(10 * urand() - 5);
                    ml[2 * pr + 1] = (float)(0.5 + 1.5 * urand());
                    for (int d = 0; d < HD; d++) acc[pr * HD + d] = (float)(2 * urand() - 1);
                }
        }
        for (int t = 0; t < rows; t++)
            for (int h = 0; h < H; h++)
                for (int ch = 0; ch < HD / 32; ch++) {
                    cur_t = t;
                    run_block(h, ch, body);
                }
        double err = 0, big = 0;
        bool good = true;
        for (int t = 0; t < rows; t++) {
            const int na = active_splits(c, c.positions[t]);
            for (int h = 0; h < H; h++)
                for (int d = 0; d < HD; d++) {
                    const float o = out[((size_t)t * H + h) * HD + d];
                    if (na == 1) {
                        good = good && std::isnan(o);
                        continue;
                    }
                    double mx = -1e300, num = 0, den = 0;
                    for (int s = 0; s < na; s++) mx = std::max(mx, (double)ml[2 * (((size_t)t * H + h) * S + s)]);
                    for (int s = 0; s < na; s++) {
                        const size_t pr = ((size_t)t * H + h) * S + s;
                        const double w = std::exp2((double)ml[2 * pr] - mx);
                        num += acc[pr * HD + d] * w, den += ml[2 * pr + 1] * w;
                    }
                    const double ref = num / den;
                    err = std::max(err, std::fabs(o - ref)), big = std::max(big, std::fabs(ref));
                    good = good && std::isfinite(o);
                    const int col = h * HD + d, cols = H * HD;
                    const float2 q = xd[(size_t)t * (cols / QK) + col / QK];
                    const double back = q.x * (127.0 * xq[(size_t)t * 2 * cols + col] + xq[(size_t)t * 2 * cols + cols + col]);
                    good = good && std::fabs(back - o) <= q.x + 1e-12;
                }
        }
        good = good && err <= 1e-5 * std::max(big, 1e-30);
        printf("heads %d splits %d rows %d (active %d): max |error| %.2e of %.2e %s\n", H, S, rows,
               active_splits(c, c.positions[0]), err, big, good ? "OK" : "FAIL");
        ok = ok && good;
    }
    if (ok) printf("ALL OK\n");
    return ok ? 0 : 1;
}
