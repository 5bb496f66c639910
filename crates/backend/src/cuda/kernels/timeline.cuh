// timeline.cuh — the block timeline's stamps (FERRITE_DIAG_TL, a timing diagnostic;
// DECODE_STEP.md), prepended before common.cuh with `#define FERRITE_TL` only when the
// switch is set (mod.rs full_source): the default kernels' sources, and so their machine code
// and kernel-cache keys, do not contain it.
//
// Each block's thread (0, 0, 0) stamps %globaltimer with its SM, its block index and its
// grid's size into the module's ferrite_tl buffer — at the PDL wait's entry (TL_WAIT_IN: the
// block runs, past whatever it issues before its wait), at its return (TL_WAIT_OUT: the
// predecessor grid has completed) and where a tensor-core GEMV's block has written its
// outputs (TL_END; tc_store). The host zeroes ferrite_tl_n before one chosen graph replay and
// reads the stamps after it (timeline.rs). A block's slots (three, and TL_MARK_SLOTS more
// in a file whose kernels mark points: TL_MARK) are taken by one atomic
// issued before the wait, whose return the wait hides; the stamps after it are plain stores
// (the slot kept in shared memory for TL_END): no round trip is added to a block's path once
// its wait has returned. (A block whose thread 0 took no slots, having no PDL wait, would
// put its TL_END at an undefined slot inside the buffer; tools/timeline.py places stamps by
// their own words, and every kernel with a tc_store has its wait.)
#define TL_WAIT_IN 1u
#define TL_WAIT_OUT 2u
#define TL_END 3u
// TL_MARK(k) (k < TL_MARK_SLOTS): a point inside a block's path after its wait, kind
// TL_MARK0 + k (attention.cu's decode launch: where its chain goes after the wait).
// TL_MARK_SLOTS is defined before this file for the files that mark (mod.rs full_source), so
// that the others keep three slots a block (the buffer holds a whole step of the larger
// models, and the recorded step is not lengthened by the marks' slots).
#ifndef TL_MARK_SLOTS
#define TL_MARK_SLOTS 0
#endif
#define TL_MARK0 4u
#define TL_SLOTS (3u + TL_MARK_SLOTS)
#define FERRITE_TL_CAP (1u << 20)
__device__ unsigned int ferrite_tl_n;
__device__ unsigned long long ferrite_tl[2 * FERRITE_TL_CAP];
__shared__ unsigned tl_slot;
__device__ __forceinline__ bool tl_thread() { return (threadIdx.x | threadIdx.y | threadIdx.z) == 0; }
__device__ __forceinline__ unsigned long long tl_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void tl_put(unsigned i, unsigned kind, unsigned long long t) {
    if (i >= FERRITE_TL_CAP) return;
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    const unsigned long long grid = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
    const unsigned long long blk =
        blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    ferrite_tl[2 * i] = t;
    // kind (4 bits) | threads a block / 32 (6) | SM (8) | grid (23) | block (23)
    ferrite_tl[2 * i + 1] = ((unsigned long long)kind << 60) |
                            ((unsigned long long)(blockDim.x * blockDim.y * blockDim.z / 32) << 54) |
                            ((unsigned long long)(smid & 0xFF) << 46) | ((grid & 0x7FFFFF) << 23) | (blk & 0x7FFFFF);
}
#define TL_WAIT_BEGIN()                                                                            \
    unsigned tl_i = 0;                                                                             \
    unsigned long long tl_in = 0;                                                                  \
    if (tl_thread()) {                                                                             \
        tl_in = tl_now();                                                                          \
        tl_i = atomicAdd(&ferrite_tl_n, TL_SLOTS);                                                 \
    }
#define TL_WAIT_DONE()                                                                             \
    if (tl_thread()) {                                                                             \
        const unsigned long long tl_out = tl_now();                                                \
        tl_put(tl_i, TL_WAIT_IN, tl_in);                                                           \
        tl_put(tl_i + 1, TL_WAIT_OUT, tl_out);                                                     \
        tl_slot = tl_i;                                                                            \
    }
#define TL_STAMP_END()                                                                             \
    if (tl_thread()) tl_put(tl_slot + 2, TL_END, tl_now())
#define TL_MARK(k)                                                                                 \
    do {                                                                                           \
        static_assert((k) < TL_MARK_SLOTS, "TL_MARK: more marks than this file's TL_MARK_SLOTS"); \
        if (tl_thread()) tl_put(tl_slot + 3 + (k), TL_MARK0 + (k), tl_now());                      \
    } while (0)
// TL_MARK after the 32-bit value v exists (an empty volatile asm that takes it: the timer's
// read, another volatile asm, stays after it).
#define TL_MARK_AFTER(k, v)                                                                        \
    do {                                                                                           \
        asm volatile("" ::"r"(v));                                                                 \
        TL_MARK(k);                                                                                \
    } while (0)
