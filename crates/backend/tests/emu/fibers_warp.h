// The warp collectives and bit casts of the fiber schedulers (fibers.h: one block,
// fibers_grid.h: the blocks of a launch), included by each after its fiber table: `fib`,
// `cur`, `warp_arrived`, the RUN / WAIT_WARP states, yield_now() and EMU_NF (fibers in all).
#pragma once

// A lane's operands of one collective: `kind` names the collective (every lane of a warp
// must be in the same one), `w` holds up to 16 words.
struct Deposit {
    int kind;
    uint32_t w[16];
};
// Two buffers by call parity: a lane rewrites buffer p only two collectives later, when every
// lane has read it.
static Deposit xbuf[EMU_NF / 32][2][32];

static const Deposit* warp_exchange(const Deposit& mine) {
    const int w = cur / 32, lane = cur % 32, p = fib[cur].parity;
    fib[cur].parity ^= 1;
    xbuf[w][p][lane] = mine;
    fib[cur].st = WAIT_WARP;
    if (++warp_arrived[w] == 32) {
        warp_arrived[w] = 0;
        for (int i = 0; i < 32; i++)
            if (fib[32 * w + i].st == WAIT_WARP) fib[32 * w + i].st = RUN;
    }
    yield_now();
    for (int i = 0; i < 32; i++)
        if (xbuf[w][p][i].kind != mine.kind) {
            fprintf(stderr, "warp %d: lanes in different collectives\n", w);
            exit(3);
        }
    return xbuf[w][p];
}

// Bit casts for the emulated instructions.
static inline float __uint_as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

