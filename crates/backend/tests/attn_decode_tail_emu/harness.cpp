// Host emulation of attention.cu's tail merge (decode_tail_merge, between its EMU_TAIL
// markers, written next to this file as tail.cuh by attn_decode_tail_emu.rs; decode_emit and
// decode_merge_piece from between the EMU_EMIT markers, quant_q8_lane from common.cuh's
// EMU_Q8). The split blocks of one (row, head block) run as one grid of fibers
// (../emu/fibers_grid.h) in a given arrival order, the spinning blocks yielding to the ones
// not yet arrived (DECODE_TAIL_SPIN). Checks, per case and order: every output, its int8
// planes and scales bitwise equal to the merge launch's pieces (decode_merge_piece at
// MERGE_MAX_PER_WARP, as attn_decode_merge runs them) on the same partials, every counter
// back at 0 for the next launch, and no deadlock. The splits past a row's active ones hold
// NaN (a merge that reads one fails). Prints one line per case and "ALL OK"; exit status 1 on
// a mismatch.
#define EMU_THREADS 128
#include <cmath>
#include <cstdio>
#include <vector>

#include "fibers_grid.h"
#include "intrinsics.h"

#include "attn_emit.h"
#define DECODE_TAIL_SPIN() emu_spin()
#include "tail.cuh"

constexpr int HD = 128;
struct Case {
    int n_heads, gb, n_splits;
    std::vector<int> active;  // per row
};
struct Out {
    std::vector<float> out;
    std::vector<int8_t> xq;
    std::vector<float2> xd;
    void reset(int rows, int H) {
        out.assign((size_t)rows * H * HD, NAN);
        xq.assign((size_t)rows * 2 * H * HD, 0);
        xd.assign((size_t)rows * H * HD / QK, make_float2(0.f, 0.f));
    }
};
static const Case* cc;
// The decode launch's partials: src as its loops would leave them, acc / ml as the merge
// reads them (NaN until the split's block writes its own: a block that merges before every
// split has arrived reads NaN).
static std::vector<float> src_acc, src_ml, acc, ml;
static std::vector<int> tickets;
static Out got, want;

// One split block of the decode launch from its partial's write (blockIdx: head block,
// split, row).
static void tail_body() {
    const Case& c = *cc;
    const int hb = blockIdx.x, t = blockIdx.z, nhb = c.n_heads / c.gb;
    for (int g = 0; g < c.gb; g++) {
        const size_t pr = ((size_t)t * c.n_heads + hb * c.gb + g) * c.n_splits + blockIdx.y;
        acc[pr * HD + threadIdx.x] = src_acc[pr * HD + threadIdx.x];
        if (threadIdx.x < 2) ml[2 * pr + threadIdx.x] = src_ml[2 * pr + threadIdx.x];
    }
    decode_tail_merge(acc.data(), ml.data(), &tickets[(size_t)t * nhb + hb], got.out.data(), got.xq.data(),
                      got.xd.data(), c.n_heads, c.n_splits, c.active[t], t, hb * c.gb, c.gb);
}
// The merge launch's block (head, 32 dims, row).
static void ref_body() {
    const Case& c = *cc;
    decode_merge_piece<MERGE_MAX_PER_WARP>(acc.data(), ml.data(), want.out.data(), want.xq.data(), want.xd.data(),
                                           c.n_heads, c.n_splits, c.active[blockIdx.z], blockIdx.z, blockIdx.x,
                                           blockIdx.y);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next() {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}
static double urand() { return (next() >> 11) * (1.0 / 9007199254740992.0); }

int main() {
    const Case cases[] = {
        {8, 4, 49, {47}},      // Qwen3-8B at depth 32768: one piece per spinning block
        {8, 4, 49, {5}},       // early in a long cache: 5 blocks take 16 pieces
        {8, 4, 24, {16}},      // as many active splits as pieces
        {8, 4, 64, {64}},      // the most splits the tail takes
        {16, 8, 40, {20}},     // 8 heads a block: 32 pieces over 20 blocks
        {4, 1, 20, {3}},       // one head a block: 4 pieces over 3
        {8, 4, 24, {24, 2}},   // two rows (verify), each its own counters
        {8, 2, 33, {2, 33}},   // a row of two splits beside a full one
    };
    bool ok = true;
    for (const Case& c : cases) {
        cc = &c;
        const int rows = (int)c.active.size(), H = c.n_heads, S = c.n_splits, nhb = H / c.gb;
        src_acc.assign((size_t)rows * H * S * HD, NAN);
        src_ml.assign((size_t)rows * H * S * 2, NAN);
        for (int t = 0; t < rows; t++)
            for (int h = 0; h < H; h++)
                for (int s = 0; s < c.active[t]; s++) {
                    const size_t pr = ((size_t)t * H + h) * S + s;
                    src_ml[2 * pr] = (float)(10 * urand() - 5);
                    src_ml[2 * pr + 1] = (float)(0.5 + 1.5 * urand());
                    for (int d = 0; d < HD; d++) src_acc[pr * HD + d] = (float)(2 * urand() - 1);
                }
        acc = src_acc, ml = src_ml;  // the reference merges them all written
        want.reset(rows, H);
        for (int t = 0; t < rows; t++) {
            if (c.active[t] == 1) continue;
            std::vector<Dim3> pieces;
            for (int h = 0; h < H; h++)
                for (int ch = 0; ch < HD / 32; ch++) pieces.push_back({h, ch, t});
            for (size_t i = 0; i < pieces.size(); i += EMU_BLOCKS)
                run_grid(std::vector<Dim3>(pieces.begin() + i, pieces.begin() + std::min(pieces.size(), i + EMU_BLOCKS)),
                         ref_body);
        }
        // Arrival orders: split order, its reverse, and a shuffle.
        for (int order = 0; order < 3; order++) {
            got.reset(rows, H);
            tickets.assign((size_t)rows * nhb, 0);
            acc.assign(src_acc.size(), NAN);
            ml.assign(src_ml.size(), NAN);
            for (int t = 0; t < rows; t++)
                for (int hb = 0; hb < nhb; hb++) {
                    std::vector<Dim3> blocks;
                    for (int s = 0; s < c.active[t]; s++) blocks.push_back({hb, s, t});
                    if (order == 1) std::reverse(blocks.begin(), blocks.end());
                    if (order == 2)
                        for (size_t i = blocks.size(); i > 1; i--) std::swap(blocks[i - 1], blocks[next() % i]);
                    run_grid(blocks, tail_body);
                }
            bool good = true;
            for (int t = 0; t < rows; t++)
                for (int i = 0; i < H * HD; i++) {
                    const size_t o = (size_t)t * H * HD + i;
                    good = good && f2u(got.out[o]) == f2u(want.out[o]);
                }
            good = good && got.xq == want.xq;
            for (size_t i = 0; i < got.xd.size(); i++)
                good = good && f2u(got.xd[i].x) == f2u(want.xd[i].x) && f2u(got.xd[i].y) == f2u(want.xd[i].y);
            for (int v : tickets) good = good && v == 0;
            printf("heads %d per block %d splits %d active", H, c.gb, S);
            for (int a : c.active) printf(" %d", a);
            printf(", order %s: %s\n", order == 0 ? "split" : order == 1 ? "reverse" : "shuffled",
                   good ? "OK" : "FAIL");
            ok = ok && good;
        }
    }
    if (ok) printf("ALL OK\n");
    return ok ? 0 : 1;
}
