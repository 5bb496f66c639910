// One CUDA thread block on the host, for the kernel emulation tests (gated_delta_emu,
// gemv_tc_emu): every thread a ucontext fiber running the kernel body unchanged, scheduled on
// one OS thread until each blocks at __syncthreads or at a warp collective, so barriers,
// shared memory and per-thread indexing are the kernel's own. A warp collective is
// warp_exchange: each lane deposits its operands, waits for the 32 lanes, then reads all of
// them (an emulated instruction computes its lane's result from those). EMU_THREADS (default
// 256) is the block size.
#pragma once
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef EMU_THREADS
#define EMU_THREADS 256
#endif

struct Dim3 {
    int x, y, z;
};
static Dim3 threadIdx, blockIdx, blockDim = {EMU_THREADS, 1, 1};

constexpr int NT = EMU_THREADS;
enum { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
struct Fiber {
    ucontext_t ctx;
    int st;
    int parity;
};
static Fiber fib[NT];
static ucontext_t sched_ctx;
static int cur, block_arrived, warp_arrived[NT / 32];

static void yield_now() { swapcontext(&fib[cur].ctx, &sched_ctx); }

static void __syncthreads() {
    fib[cur].st = WAIT_BLOCK;
    if (++block_arrived == NT) {
        block_arrived = 0;
        for (auto& f : fib)
            if (f.st == WAIT_BLOCK) f.st = RUN;
    }
    yield_now();
}

#define EMU_NF NT
#include "fibers_warp.h"

static void (*emu_body)();
static void emu_entry() {
    emu_body();
    fib[cur].st = DONE;
}

// Runs `body` as block (bx, by): every thread from the start to its return.
static void run_block(int bx, int by, void (*body)()) {
    static std::vector<char> stacks(NT * 65536);
    blockIdx = {bx, by, 0};
    emu_body = body;
    block_arrived = 0;
    for (int w = 0; w < NT / 32; w++) warp_arrived[w] = 0;
    for (int i = 0; i < NT; i++) {
        getcontext(&fib[i].ctx);
        fib[i].ctx.uc_stack.ss_sp = &stacks[(size_t)i * 65536];
        fib[i].ctx.uc_stack.ss_size = 65536;
        fib[i].ctx.uc_link = &sched_ctx;
        makecontext(&fib[i].ctx, emu_entry, 0);
        fib[i].st = RUN;
        fib[i].parity = 0;
    }
    for (;;) {
        bool any = false, live = false;
        for (int i = 0; i < NT; i++) {
            if (fib[i].st != DONE) live = true;
            if (fib[i].st != RUN) continue;
            cur = i;
            threadIdx = {i, 0, 0};
            swapcontext(&sched_ctx, &fib[i].ctx);
            any = true;
        }
        if (!live) break;
        if (!any) {
            fprintf(stderr, "block (%d, %d): deadlock (a barrier not reached by every thread)\n", bx, by);
            exit(5);
        }
    }
}
