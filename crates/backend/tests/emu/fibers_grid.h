// Several CUDA thread blocks of one grid on the host, for emulation tests of kernels whose
// blocks wait on each other (attn_decode_tail_emu: the decode attention's tail merge, whose
// last blocks spin until every split has arrived). fibers.h's scheme — a ucontext fiber per
// thread, scheduled on one OS thread, barriers and warp collectives as there — with the
// blocks of a launch alive together: the scheduler runs one block's fibers until none of
// them can move (all done, at a barrier, or spinning: emu_spin()), then the next block in
// the launch's order, round after round, so a spinning block lets the others arrive. A round
// in which nothing but spinning happened is a deadlock (exit 5).
//  Shared memory: the harness defines __shared__ as `static`, one copy for every block, so a
//  kernel emulated here must not hold shared state across a point where its block can be
//  switched out (a spin). decode_tail_merge reads its ticket from shared memory before it
//  spins and uses its pieces' shared arrays only between barriers after it.
//  EMU_THREADS (default 128) is the block size, EMU_BLOCKS (default 64) the most blocks.
#pragma once
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef EMU_THREADS
#define EMU_THREADS 128
#endif
#ifndef EMU_BLOCKS
#define EMU_BLOCKS 64
#endif

struct Dim3 {
    int x, y, z;
};
static Dim3 threadIdx, blockIdx, blockDim = {EMU_THREADS, 1, 1};

constexpr int NT = EMU_THREADS, NF = EMU_THREADS * EMU_BLOCKS;
constexpr size_t STACK = 65536;  // bytes per fiber
enum { RUN, WAIT_BLOCK, WAIT_WARP, SPIN, DONE };
struct Fiber {
    ucontext_t ctx;
    int st;
    int parity;
};
static Fiber fib[NF];
static Dim3 block_coord[EMU_BLOCKS];
static ucontext_t sched_ctx;
static int cur, block_arrived[EMU_BLOCKS], warp_arrived[NF / 32];

static void yield_now() { swapcontext(&fib[cur].ctx, &sched_ctx); }

static void __syncthreads() {
    const int b = cur / NT;
    fib[cur].st = WAIT_BLOCK;
    if (++block_arrived[b] == NT) {
        block_arrived[b] = 0;
        for (int i = b * NT; i < (b + 1) * NT; i++)
            if (fib[i].st == WAIT_BLOCK) fib[i].st = RUN;
    }
    yield_now();
}

// A spin loop's iteration: this thread yields until the scheduler's next round.
static void emu_spin() {
    fib[cur].st = SPIN;
    yield_now();
}

#define EMU_NF NF
#include "fibers_warp.h"

// Global-memory atomics and fences: one OS thread, so plain read-modify-writes.
static inline int atomicAdd(int* p, int v) {
    const int old = *p;
    *p = old + v;
    return old;
}
static inline int atomicExch(int* p, int v) {
    const int old = *p;
    *p = v;
    return old;
}
static inline void __threadfence() {}

static void (*emu_body)();
static void emu_entry() {
    emu_body();
    fib[cur].st = DONE;
}

// Runs `body` as the blocks coords[0..n) of one launch, scheduled in that order (the order in
// which they first run: where the kernel takes a ticket at its start, its arrival order).
static void run_grid(const std::vector<Dim3>& coords, void (*body)()) {
    // Untouched pages of the stacks are never committed (malloc, not a zeroed vector).
    static char* stacks = (char*)malloc((size_t)NF * STACK);
    const int nb = (int)coords.size();
    if (nb > EMU_BLOCKS) {
        fprintf(stderr, "run_grid: %d blocks, EMU_BLOCKS %d\n", nb, EMU_BLOCKS);
        exit(4);
    }
    emu_body = body;
    for (int b = 0; b < nb; b++) {
        block_coord[b] = coords[b];
        block_arrived[b] = 0;
    }
    for (int w = 0; w < nb * NT / 32; w++) warp_arrived[w] = 0;
    for (int i = 0; i < nb * NT; i++) {
        getcontext(&fib[i].ctx);
        fib[i].ctx.uc_stack.ss_sp = stacks + (size_t)i * STACK;
        fib[i].ctx.uc_stack.ss_size = STACK;
        fib[i].ctx.uc_link = &sched_ctx;
        makecontext(&fib[i].ctx, emu_entry, 0);
        fib[i].st = RUN;
        fib[i].parity = 0;
    }
    for (;;) {
        bool live = false, moved = false;
        for (int b = 0; b < nb; b++) {
            for (int i = b * NT; i < (b + 1) * NT; i++)
                if (fib[i].st == SPIN) fib[i].st = RUN;  // its next check
            for (;;) {
                bool any = false;
                for (int i = b * NT; i < (b + 1) * NT; i++) {
                    if (fib[i].st != RUN) continue;
                    cur = i;
                    threadIdx = {i % NT, 0, 0};
                    blockIdx = block_coord[b];
                    swapcontext(&sched_ctx, &fib[i].ctx);
                    if (fib[i].st != SPIN) moved = true;
                    any = true;
                }
                if (!any) break;
            }
            for (int i = b * NT; i < (b + 1) * NT; i++) live = live || fib[i].st != DONE;
        }
        if (!live) break;
        if (!moved) {
            fprintf(stderr, "grid of %d blocks: deadlock (only spinning or barriers left)\n", nb);
            exit(5);
        }
    }
}
