// attention.cu — KV cache store, split-K decode attention, causal prefill attention.
//
// Semantics (the oracle is CpuBackend::attention): the step's k, v rows are first stored at
// positions[t] of layer `layer`; then query row t, head h (kv head h / group) attends to cache
// positions 0..=positions[t] with scale 1/sqrt(head_dim): softmax, weighted sum of V.
// Positions are always read from device memory, so a captured decode graph replays at every
// position.
//
// KV LAYOUT (f16): [layer][kv_head][pos][head_dim]. One kv head's keys for a run of positions
// are one contiguous block of memory: a decode split streams `chunk × head_dim × 2` contiguous
// bytes per tensor, a prefill tile `BK × head_dim × 2` contiguous bytes (one 16-byte load per
// 8 elements, fully coalesced, DRAM-page friendly, and TMA-able later). The cost is paid at
// store time: a step's row of n_kv*head_dim values scatters into n_kv runs of head_dim halves
// (≥ 64 contiguous bytes each), which is negligible. Values are rounded to f16 with
// saturation to ±65504 (an inf in the cache would turn masked 0·inf into NaN); NaN stays NaN.
// The cache is zero-filled at allocation, so never-written positions hold finite values.
//
// q8_0 KV (optional, chosen at kv_new): the same [layer][kv_head][pos][head_dim] layout in
// planes: int8 quants (1 B/element) and one f16 scale per 32 elements ([..][pos][hd/32]),
// 1.0625 B/element. Stored with ggml's quantize_row_q8_0_ref (one warp per 32-block: amax by
// shuffles). Kernels are the same templates with Q8 = true: a thread's 8 elements are one
// 8-byte load plus its block's 2-byte scale (shared by 4 lanes, served from L1).
//
// Softmax is computed in base 2: q is pre-multiplied by scale·log2(e) and exp2f is used
// (exact same math as exp(s·scale - max) up to rounding). Running maxima start at -1e30
// (not -inf) so that merging two empty states never computes -inf - -inf = NaN.
//
// kv_store: one thread per element of rows × n_kv × head_dim (grid-stride): f32 → f16.
//   Used before prefill, the fallback and the paged decode; the contiguous decode stores
//   its own rows (below).
//
// attn_decode_<HD>_<GB> (rows ≤ 16, i.e. decode and MTP verify): the whole decode attention
//   of a layer in ONE launch — KV store, split-K flash-decoding, split merge and the int8
//   planes of the output for the o-projection GEMV.
//   grid (n_heads/GB, n_splits, rows), 128 threads = 4 warps. A block owns GB query heads
//   that share one kv head (GB = largest of 8,4,2,1 dividing the GQA group), so each K/V row
//   is read once for the GB heads. The split count is fixed per cache (from SM count, heads
//   and capacity: host), and the chunk of positions a split owns is computed ON THE DEVICE
//   from that row's own position: chunk = max(MC, roundup(ceil((pos+1)/n_splits), STEP))
//   (MC = min_chunk, fixed per cache; STEP = the keys of one block iteration, so the
//   splits are balanced to within one iteration). Only the first n_active =
//   ceil((pos+1)/chunk) splits have keys; the others exit at once. So the launch is position-independent (graph-safe), the
//   work spreads over all splits at long context, and a row's result depends only on its
//   own position — identical bits whether it is decoded alone or inside a verify batch.
//   STORE (contiguous cache): the step's rows are new keys. Each block first writes, for
//   its kv head, the step's rows whose positions fall in its own range [start, end) (row t's
//   last split always holds row t; f16, or q8_0 by q8_store; the last row of a position
//   wins, as in kv_store), then a barrier, then reads its keys through L2 (ld.global.cg: the
//   read-only path could hold a line from before the write). So every block that reads a
//   new position wrote it itself: no ordering between blocks is needed, and blocks that
//   share a position (the GB-head blocks of a kv head, verify rows) write identical bits.
//   The bits equal those of a separate kv_store launch.
//   Within a block: TPK = HD/8 threads per key, each owning 8 dims (one 16-byte load of K,
//   one of V); a warp covers 32/TPK keys at once, the block KPB = 4·32/TPK keys, unrolled U
//   deep (U·2 16-byte loads in flight per thread). Score = 8-dim partial dot reduced across
//   the TPK lanes by xor-shuffles; each thread keeps per head an online-softmax state
//   (m, l, acc[8]) over the keys its slot saw; at the end states merge across slots by
//   shuffles, across warps through shared memory. Bytes: each K/V byte of the head read once.
//   attn_decode_tc[_q8]_128_<GB>[_paged] (f16 / q8_0 caches at hd 128, contiguous and
//   paged; the launcher's default there) replace this per-key loop by S = QKᵀ and Oᵀ = VᵀPᵀ
//   on mma.sync, 16 keys per warp step (decode_tc_loop below); everything else is this same
//   template code.
//   L2 prefetch (contiguous cache, pf > 0): one thread issues a TMA bulk prefetch of the K
//   and V tiles pf iterations ahead (the first pf tiles before the PDL wait, overlapping the
//   previous kernel's tail: the cache at earlier positions is written by completed grids).
//   Merge: a row's only split (n_active = 1) writes the output directly. Otherwise each
//   block writes (m, l, acc[HD]) per head to scratch, fences, and takes a ticket (atomicAdd
//   on a counter per (row, head block)); the block that draws the last ticket combines the
//   n_active partials in split order (max, rescale, sum: the same order whichever block it
//   is), writes out = acc / l and, when the launcher passes xq, the o-projection's int8
//   planes (quant_q8_lane, one warp per 32-element block), then resets the counter to 0 for
//   the next launch (graph replay). The tensor-core forms past a cluster's splits merge
//   instead by their last few blocks, a (head, 32 dims) piece each (TAIL, decode_tail_merge:
//   the last block's merge alone took ~8 us at depth 32768 while the other SMs idled), or
//   leave it to a launch of their own (SEP, attn_decode_merge) where the tail's spinning
//   blocks would not fit; the cluster forms merge through distributed shared memory (CL).
//
// attn_prefill_<HD> (rows > 16): flash attention, causal, f32 math on CUDA cores (SIMT).
//   grid (query tiles, n_kv_heads), 256 threads. The block's BQ query slots are (row, head
//   of the GQA group) pairs, row-major: BQ/group consecutive rows × every head of the group,
//   so one K/V tile in shared memory serves group× more queries. TPQ threads per query
//   (4, or 8 for HD=256), each owning HD/TPQ dims as float4 groups interleaved by TPQ
//   (conflict-free LDS.128 with broadcast across the slots of a warp). K/V tiles of BK =
//   4096/HD keys are loaded with 16-byte loads, converted to f32 into shared memory (32 KB).
//   Keys are consumed 8 at a time: 8 scores, one rescale, 8 V accumulations; keys past a
//   query's own position are masked (p = 0). The block's key bound is the max position of its
//   rows (read from device memory). Tiles are launched heaviest-first (reversed blockIdx).
//   Summation over keys is in ascending position order per query, like the CPU.
//   Used for hd 32 and FERRITE_ATTN_TC=0 (=2: for q8_0 caches); hd 64/128/256 take
//   attn_prefill_tc[_q8]_<HD> (tensor cores, below).
//
// attn_generic: any head_dim ≤ 512 (and groups larger than a prefill tile): one warp per
//   (row, head), lane-strided dims, one key at a time. Slow; correct; the fallback.
//
// PAGED KV (serving: one cache shared by many sequences, batched steps). Layout
// [layer][page][kv_head][page_size][head_dim] (q8_0 scales alike, per 32 elements): a page
// holds page_size consecutive positions of one sequence for every kv head, and within a page
// one kv head's positions are contiguous (page_size·head_dim·2 bytes: 4 KB for 16 × 128 f16),
// so every load pattern above is unchanged inside a page. A contiguous cache is exactly the
// one-page case (page_size = capacity), which is why the same templates serve both: the
// *_paged entry points instantiate them with PAGED = true, and only the position → element
// address changes: element(p) = head_off + block_table[p >> page_shift] · page_stride +
// (p & (page_size − 1)) · head_dim, with `capacity` passed as page_size (so head_off is the
// same expression) and page_stride = n_kv · page_size · head_dim. Row t's block table is
// block_tables[row_seq[t] · bt_stride ..]; positions are clamped to max_keys = bt_stride ·
// page_size instead of capacity. The block-table read is one 4-byte load per key per thread,
// shared by the TPK lanes of a key (L1 broadcast). Decode rows of many sequences go through
// the split-K decode kernel in one launch (each row its own sequence, positions and pages:
// the same per-row arithmetic as a lone sequence with the same split count); a prefill chunk
// (one sequence, > 16 rows) through the prefill kernel with its rows' views, all rows of a
// tile in the same sequence. The launcher (attention.rs) splits a step into such runs.

#define ATT_NEG (-1.0e30f)
#define ATT_FULL 0xffffffffu
// The block timeline's marks inside the decode launch (timeline.cuh; empty unless
// FERRITE_DIAG_TL compiled it in).
#ifndef FERRITE_TL
#define TL_MARK(k)
#define TL_MARK_AFTER(k, v)
#endif
#define DECODE_THREADS 128
#define DECODE_MIN_CHUNK 32  // attention.rs DECODE_MIN_CHUNK (the launcher passes min_chunk)
#define PREFILL_THREADS 256


// 8 halves packed in a uint4 → 8 floats.
__device__ __forceinline__ void unpack8(uint4 u, float* f) {
    unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
        f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
    }
}

// Loads the 8 cached elements starting at element index e (a multiple of 8) of a K or V
// tensor: f16 → one 16-byte load; q8_0 → 8 quant bytes (.x, .y) + the block's f16 scale (.z).
// CG: through L2 only (ld.global.cg), for kernels that write part of the cache themselves
// (the read-only path may hold a line from before the write); else the read-only path.
template <bool Q8, bool CG = false>
__device__ __forceinline__ uint4 load8(const unsigned char* __restrict__ base,
                                       const unsigned short* __restrict__ scales, long long e) {
    if constexpr (Q8) {
        const uint2* qp = reinterpret_cast<const uint2*>(base + e);
        const uint2 qv = CG ? __ldcg(qp) : __ldg(qp);
        const unsigned short sc = CG ? __ldcg(scales + e / 32) : __ldg(scales + e / 32);
        return make_uint4(qv.x, qv.y, (unsigned int)sc, 0u);
    } else {
        const uint4* p = reinterpret_cast<const uint4*>(base + 2 * e);
        return CG ? __ldcg(p) : __ldg(p);
    }
}

template <bool Q8>
__device__ __forceinline__ void unpack8x(uint4 u, float* f) {
    if constexpr (Q8) {
        const float d = __half2float(__ushort_as_half((unsigned short)u.z));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[i] = (float)(signed char)((u.x >> (8 * i)) & 0xffu) * d;
            f[4 + i] = (float)(signed char)((u.y >> (8 * i)) & 0xffu) * d;
        }
    } else {
        unpack8(u, f);
    }
}

// One cached element (the fallback kernel).
__device__ __forceinline__ float kv_elem(const unsigned char* __restrict__ base,
                                         const unsigned short* __restrict__ scales, long long e,
                                         int q8) {
    if (q8) return (float)(signed char)base[e] * __half2float(__ushort_as_half(scales[e / 32]));
    return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short*>(base)[e]));
}

// The paged-cache arguments of the *_paged kernels (see PAGED KV in the header).
#define PAGED_ARGS                                                                           \
    const int *__restrict__ row_seq, const int *__restrict__ block_tables, int bt_stride,    \
        int page_shift, long long page_stride, int max_keys
#define PAGED_PASS row_seq, block_tables, bt_stride, page_shift, page_stride, max_keys
#define UNPAGED_PASS(CAP) nullptr, nullptr, 0, 0, 0LL, (CAP)

// EMU_KVPOS_BEGIN (host emulation: tests/attn_decode_tc_emu.rs, for decode_tc_loop)
// Element index of position p of a kv head whose position 0 (page 0 when paged) is at
// head_off; `stride` is the elements per position (head_dim). bt: the row's block table.
template <bool PAGED>
__device__ __forceinline__ long long kv_pos(long long head_off, int p, int stride,
                                            const int* __restrict__ bt, int page_shift,
                                            long long page_stride) {
    if constexpr (PAGED) {
        return head_off + (long long)__ldg(bt + (p >> page_shift)) * page_stride +
               (long long)(p & ((1 << page_shift) - 1)) * stride;
    } else {
        return head_off + (long long)p * stride;
    }
}
// EMU_KVPOS_END

// The block table of row t (nullptr for contiguous caches).
template <bool PAGED>
__device__ __forceinline__ const int* row_table(const int* __restrict__ row_seq,
                                                const int* __restrict__ block_tables,
                                                int bt_stride, int t) {
    if constexpr (PAGED) {
        return block_tables + (long long)row_seq[t] * bt_stride;
    } else {
        return nullptr;
    }
}

template <bool PAGED>
__device__ __forceinline__ void kv_store_impl(const float* __restrict__ k,
                                              const float* __restrict__ v,
                                              const int* __restrict__ positions,
                                              unsigned short* __restrict__ kc,
                                              unsigned short* __restrict__ vc, long long layer_off,
                                              int rows, int n_kv, int hd, int capacity,
                                              PAGED_ARGS) {
    const int kvd = n_kv * hd;
    const long long n = (long long)rows * kvd;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int t = (int)(i / kvd), j = (int)(i % kvd);
        int h = j / hd, d = j % hd;
        int p = positions[t];
        if (p < 0 || p >= max_keys) continue;
        long long dst;
        if constexpr (PAGED) {
            const int* bt = row_table<true>(row_seq, block_tables, bt_stride, t);
            dst = kv_pos<true>(layer_off + (long long)h * capacity * hd, p, hd, bt, page_shift,
                               page_stride) + d;
        } else {
            dst = layer_off + ((long long)h * capacity + p) * hd + d;
        }
        kc[dst] = f32_to_f16_sat(k[i]);
        vc[dst] = f32_to_f16_sat(v[i]);
    }
}

extern "C" __global__ void kv_store(const float* __restrict__ k, const float* __restrict__ v,
                                    const int* __restrict__ positions,
                                    unsigned short* __restrict__ kc, unsigned short* __restrict__ vc,
                                    long long layer_off, int rows, int n_kv, int hd, int capacity) {
    PDL_ENTRY();
    kv_store_impl<false>(k, v, positions, kc, vc, layer_off, rows, n_kv, hd, capacity,
                         UNPAGED_PASS(capacity));
}

// Paged: `capacity` is the page size.
extern "C" __global__ void kv_store_paged(const float* __restrict__ k,
                                          const float* __restrict__ v,
                                          const int* __restrict__ positions,
                                          unsigned short* __restrict__ kc,
                                          unsigned short* __restrict__ vc, long long layer_off,
                                          int rows, int n_kv, int hd, int capacity, PAGED_ARGS) {
    PDL_ENTRY();
    kv_store_impl<true>(k, v, positions, kc, vc, layer_off, rows, n_kv, hd, capacity,
                        PAGED_PASS);
}

// ggml's quantize_row_q8_0_ref for one 32-element block held one element per lane:
// d = amax/127 (stored as f16), q = roundf(x / d) with the unrounded d.
__device__ __forceinline__ void q8_store(float x, unsigned char* __restrict__ q,
                                         unsigned short* __restrict__ sc, long long e, int lane) {
    float a = fabsf(x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(ATT_FULL, a, o));
    const float d = a / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    q[e] = (unsigned char)(signed char)(int)roundf(x * id);
    if (lane == 0) sc[e / 32] = __half_as_ushort(__float2half_rn(d));
}

// q8_0 store: one warp per 32-element block (head_dim % 32 == 0, so a block never straddles
// two heads). The loop and the position test are uniform per warp.
template <bool PAGED>
__device__ __forceinline__ void kv_store_q8_impl(
    const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ positions,
    unsigned char* __restrict__ kq, unsigned char* __restrict__ vq,
    unsigned short* __restrict__ ks, unsigned short* __restrict__ vs, long long layer_off,
    int rows, int n_kv, int hd, int capacity, PAGED_ARGS) {
    const int kvd = n_kv * hd, nb_row = kvd / 32, lane = threadIdx.x & 31;
    const long long nblocks = (long long)rows * nb_row;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nblocks;
         b += nwarps) {
        const int t = (int)(b / nb_row), j = (int)(b % nb_row) * 32 + lane;
        const int h = j / hd, d = j % hd;
        const int p = positions[t];
        if (p < 0 || p >= max_keys) continue;
        long long e;
        if constexpr (PAGED) {
            const int* bt = row_table<true>(row_seq, block_tables, bt_stride, t);
            e = kv_pos<true>(layer_off + (long long)h * capacity * hd, p, hd, bt, page_shift,
                             page_stride) + d;
        } else {
            e = layer_off + ((long long)h * capacity + p) * hd + d;
        }
        q8_store(k[(long long)t * kvd + j], kq, ks, e, lane);
        q8_store(v[(long long)t * kvd + j], vq, vs, e, lane);
    }
}

extern "C" __global__ void kv_store_q8(const float* __restrict__ k, const float* __restrict__ v,
                                       const int* __restrict__ positions,
                                       unsigned char* __restrict__ kq, unsigned char* __restrict__ vq,
                                       unsigned short* __restrict__ ks, unsigned short* __restrict__ vs,
                                       long long layer_off, int rows, int n_kv, int hd, int capacity) {
    PDL_ENTRY();
    kv_store_q8_impl<false>(k, v, positions, kq, vq, ks, vs, layer_off, rows, n_kv, hd,
                            capacity, UNPAGED_PASS(capacity));
}

extern "C" __global__ void kv_store_q8_paged(
    const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ positions,
    unsigned char* __restrict__ kq, unsigned char* __restrict__ vq,
    unsigned short* __restrict__ ks, unsigned short* __restrict__ vs, long long layer_off,
    int rows, int n_kv, int hd, int capacity, PAGED_ARGS) {
    PDL_ENTRY();
    kv_store_q8_impl<true>(k, v, positions, kq, vq, ks, vs, layer_off, rows, n_kv, hd, capacity,
                           PAGED_PASS);
}

// ---------------------------------------------------------------------------------------
// Decode: split-K flash-decoding, one launch per layer (see DECODE in the header).

__device__ __forceinline__ void tc_mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t tc_pack_f16(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);  // .x (low 16 bits) = a
    return *reinterpret_cast<const uint32_t*>(&h);
}

#define DECODE_MAX_ROWS 16
#define DECODE_MAX_SPLITS 128

// L2 prefetch of the cached keys (values) whose elements are e0..e1 of one kv head in a
// contiguous cache (f16: 2 B/element; q8_0: 1 B + the scale plane, range rounded inwards).
template <bool Q8>
__device__ __forceinline__ void prefetch_keys(const unsigned char* base,
                                              const unsigned short* scales, long long e0,
                                              long long e1) {
    if (e1 <= e0) return;
    if constexpr (Q8) {
        prefetch_l2(base + e0, (unsigned int)(e1 - e0));
        const long long s0 = ((e0 / 16) + 15) & ~15LL, s1 = (e1 / 16) & ~15LL;  // scale bytes
        if (s1 > s0) prefetch_l2(reinterpret_cast<const unsigned char*>(scales) + s0,
                                 (unsigned int)(s1 - s0));
    } else {
        prefetch_l2(base + 2 * e0, (unsigned int)(2 * (e1 - e0)));
    }
}

// EMU_EMIT_BEGIN (host emulation: tests/attn_decode_merge_emu.rs)
// A decode launch's splits of a row of n_keys keys: decode_chunk keys each (a multiple of
// `step`, the keys of a block iteration, and at least min_chunk), the first decode_active of
// them holding keys. attn_decode_impl splits by them and attn_decode_merge merges by them, so
// both agree.
__device__ __forceinline__ int decode_chunk(int n_keys, int n_splits, int min_chunk, int step) {
    const int per = (n_keys + n_splits - 1) / n_splits;
    return max(min_chunk, (per + step - 1) / step * step);
}
__device__ __forceinline__ int decode_active(int n_keys, int chunk) { return max(1, (n_keys + chunk - 1) / chunk); }

// One output element of the attention (head h, dim d of row t): out, and with xq the
// o-projection's two int8 planes (quant_q8_lane: the calling warp holds one whole 32-block).
__device__ __forceinline__ void decode_emit(float val, float* __restrict__ out,
                                            int8_t* __restrict__ xq, float2* __restrict__ xd,
                                            int t, int n_heads, int hd, int h, int d) {
    out[((long long)t * n_heads + h) * hd + d] = val;
    if (xq != nullptr) {
        const int cols = n_heads * hd, col = h * hd + d;
        quant_q8_lane(val, threadIdx.x & 31, xq + (long long)t * 2 * cols, cols, col,
                      xd + (long long)t * (cols / QK) + col / QK);
    }
}
#define MERGE_MAX_PER_WARP 32
// One piece of the split merge (attn_decode_merge, and the TAIL decode forms' last blocks):
// head h's dims 32 c .. 32 c + 31 of row t from its n_active <= 4 MPW splits' partials,
// by the calling block's 128 threads (every thread must call it: it has block barriers).
// MPW: splits per warp the registers hold (32 in the merge launch; 16 in the TAIL forms,
// whose loop's registers bound them: the splits past 4 x 16 only ever add exact zeros there).
template <int MPW>
__device__ __forceinline__ void decode_merge_piece(const float* __restrict__ part_acc,
                                                   const float* __restrict__ part_ml, float* __restrict__ out,
                                                   int8_t* __restrict__ xq, float2* __restrict__ xd, int n_heads,
                                                   int n_splits, int n_active, int t, int h, int c) {
    constexpr int HD = 128;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long prow0 = ((long long)t * n_heads + h) * n_splits;
    const int d = 32 * c + lane;
    float m[MPW], l[MPW], v[MPW];
#pragma unroll
    for (int i = 0; i < MPW; i++) {
        const int s = warp + 4 * i;
        const bool on = s < n_active;
        m[i] = on ? __ldcg(part_ml + 2 * (prow0 + s)) : ATT_NEG;
        l[i] = on ? __ldcg(part_ml + 2 * (prow0 + s) + 1) : 0.f;
        v[i] = on ? __ldcg(part_acc + (prow0 + s) * HD + d) : 0.f;
    }
    __shared__ float sm_mx[4], sm_a[4][32], sm_l[4];
    float mx = ATT_NEG;
#pragma unroll
    for (int i = 0; i < MPW; i++) mx = fmaxf(mx, m[i]);
    if (lane == 0) sm_mx[warp] = mx;
    __syncthreads();
    mx = fmaxf(fmaxf(sm_mx[0], sm_mx[1]), fmaxf(sm_mx[2], sm_mx[3]));
    float a = 0.f, ls = 0.f;
#pragma unroll
    for (int i = 0; i < MPW; i++) {
        const float cs = warp + 4 * i < n_active ? exp2f(m[i] - mx) : 0.f;
        a = fmaf(v[i], cs, a);
        ls = fmaf(l[i], cs, ls);
    }
    sm_a[warp][lane] = a;
    if (lane == 0) sm_l[warp] = ls;
    __syncthreads();
    if (warp == 0) {
        const float at = ((sm_a[0][lane] + sm_a[1][lane]) + sm_a[2][lane]) + sm_a[3][lane];
        const float lt = ((sm_l[0] + sm_l[1]) + sm_l[2]) + sm_l[3];
        decode_emit(at * (1.f / lt), out, xq, xd, t, n_heads, HD, h, d);
    }
}
// EMU_EMIT_END

// TAIL (attn_decode_tc_tail_128_<gb> and its q8_0 / keys-before-the-wait forms;
// FERRITE_ATTN_MERGE=3): the split merge by the decode launch's own last blocks, instead of a
// launch of its own (whose two boundaries cost ~5.7 us a layer at depth 32768: ATTENTION.md).
// The head block's merge is 4 GB pieces (decode_merge_piece: a head's 32 dims, the merge
// launch's block, so the bits are the merge launch's). After writing its partial, a split's
// block takes a ticket (low 16 bits of the counter: arrivals); the last P = min(4 GB,
// n_active) arrivals each take pieces k, k + P, ... (k = n_active - 1 - ticket: the last
// arrival takes piece 0 and waits for no one), thread 0 spinning on the counter until every
// split has arrived, then one round trip for the piece's partials. Each then counts itself
// done (high bits); the last to do so re-arms the counter to 0 for the next launch (no
// block reads it after counting itself done).
//  Splits: at most 4 TAIL_MAX_PER_WARP (the launcher's rule: attention.rs TAIL_MAX_SPLITS).
//  Progress: a spinning block waits only for splits of its own head block that have not
//  arrived. At most 4 GB spinners per (row, head block), 4 n_heads rows in all; the launcher
//  takes this form only where that is fewer than the launch's resident blocks (attention.rs
//  `tail_fits`), so a free slot always remains for a split not yet started; the o-projection
//  after it is launched (PDL) only once every block of this grid has started. Blocks of
//  other work sharing the SMs (another stream, another MPS client) end on their own, so they
//  delay a split's start but cannot hold its slot for good. FERRITE_ATTN_MERGE=1 takes the
//  merge launch instead, with no block waiting on another.
// EMU_TAIL_BEGIN (host emulation: tests/attn_decode_tail_emu.rs, whose grid scheduler lets
// a spinning block's siblings arrive: DECODE_TAIL_SPIN yields there, and is empty here)
#ifndef DECODE_TAIL_SPIN
#define DECODE_TAIL_SPIN() \
    do {                   \
    } while (0)
#endif
#define TAIL_MAX_PER_WARP 16
__device__ __forceinline__ void decode_tail_merge(const float* __restrict__ part_acc,
                                                  const float* __restrict__ part_ml, int* ticket,
                                                  float* __restrict__ out, int8_t* __restrict__ xq,
                                                  float2* __restrict__ xd, int n_heads, int n_splits, int n_active,
                                                  int t, int h0, int gb) {
    __shared__ int s_rank;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_rank = atomicAdd(ticket, 1) & 0xFFFF;
    __syncthreads();
    const int pieces = 4 * gb, p_n = min(pieces, n_active);
    const int k = n_active - 1 - s_rank;
    if (k >= p_n) return;  // whole block
    if (threadIdx.x == 0) {
        while ((*(volatile int*)ticket & 0xFFFF) < n_active) DECODE_TAIL_SPIN();
        __threadfence();
    }
    __syncthreads();
    for (int p = k; p < pieces; p += p_n)
        decode_merge_piece<TAIL_MAX_PER_WARP>(part_acc, part_ml, out, xq, xd, n_heads, n_splits, n_active, t,
                                              h0 + p / 4, p % 4);
    if (threadIdx.x == 0) {
        const int old = atomicAdd(ticket, 0x10000);
        if ((old >> 16) == p_n - 1) atomicExch(ticket, 0);
    }
}
// EMU_TAIL_END

// EMU_DTC_BEGIN (host emulation: tests/attn_decode_tc_emu.rs; tc_mma_f16, the half
// intrinsics and the warp collectives are emulated there)
// Eight q8_0 cache values (8 int8 of one 32-block) as the f16 cache's 16 bytes would hold
// them, each rounded once from b · d: the bytes, offset to unsigned, sit under an f16
// exponent that makes them 1024 + b + 128 exactly (byte_perm), less 1152 (exact), times the
// block scale d (one rounding). Feeds the f16 fragment code of decode_tc_loop unchanged.
__device__ __forceinline__ uint4 q8_dequant8(uint2 qv, uint32_t d2) {
#if defined(ATTN_DIAG_DQ) && ATTN_DIAG_DQ == 1
    // FERRITE_DIAG_DQ=1 (timing only, wrong values): the bytes as FP8 E4M3 pairs, no scale.
    uint32_t e[4];
    const uint32_t src[4] = {qv.x & 0xffffu, qv.x >> 16, qv.y & 0xffffu, qv.y >> 16};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const unsigned short h = (unsigned short)src[i];
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(e[i]) : "h"(h));
    }
    return make_uint4(e[0], e[1], e[2], e[3]);
#elif defined(ATTN_DIAG_DQ) && ATTN_DIAG_DQ == 2
    // FERRITE_DIAG_DQ=2 (timing only, wrong values): the bytes as FP8 E5M2 (an f16's high
    // byte), no scale.
    return make_uint4(__byte_perm(qv.x, 0u, 0x1404u), __byte_perm(qv.x, 0u, 0x3424u),
                      __byte_perm(qv.y, 0u, 0x1404u), __byte_perm(qv.y, 0u, 0x3424u));
#endif
    const uint32_t t0 = qv.x ^ 0x80808080u, t1 = qv.y ^ 0x80808080u;
    const __half2 bias = __float2half2_rn(1152.0f);
    const __half2 d = *reinterpret_cast<const __half2*>(&d2);
    uint32_t w[4] = {__byte_perm(t0, 0x64646464u, 0x4140u), __byte_perm(t0, 0x64646464u, 0x4342u),
                     __byte_perm(t1, 0x64646464u, 0x4140u), __byte_perm(t1, 0x64646464u, 0x4342u)};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __half2 h = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&w[i]), bias), d);
        w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// f16 scale e (0..3) of the four at `four` as a half2 (d, d).
__device__ __forceinline__ uint32_t q8_scale2(uint2 four, int e) {
    const uint32_t w = e < 2 ? four.x : four.y;
    return __byte_perm(w, w, (e & 1) ? 0x3232u : 0x1010u);
}

// A warp's raw q8_0 loads of the 16-key tile at `base` for decode_tc_loop's PIPE form, keys
// clamped to end - 1 as in the loop (K's key g of n-tile n, V's keys 2 tq, 2 tq + 1, 2 tq + 8,
// 2 tq + 9): 8-byte quants at byte element (contiguous cache), each key's four scales.
template <int NP, bool ON>
struct DtcQ8Raw {
    uint2 k[2][NP], kd[2], v[4][2], vd[4];
};
template <int NP>
struct DtcQ8Raw<NP, false> {};
template <int HD, int NP>
__device__ __forceinline__ void dtc_q8_load(DtcQ8Raw<NP, true>& r, const unsigned char* __restrict__ kq,
                                            const unsigned char* __restrict__ vq,
                                            const unsigned short* __restrict__ ksh,
                                            const unsigned short* __restrict__ vsh, int base, int end, int g, int tq) {
#pragma unroll
    for (int n = 0; n < 2; n++) {
        const int key = min(base + 8 * n + g, end - 1);
        const uint2* p = reinterpret_cast<const uint2*>(kq + (long long)key * HD + 8 * tq);
#pragma unroll
        for (int c = 0; c < NP; c++) r.k[n][c] = __ldcg(p + 4 * c);
        r.kd[n] = __ldcg(reinterpret_cast<const uint2*>(ksh + (long long)key * (HD / 32)));
    }
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const int key = min(base + 2 * tq + (kk & 1) + 8 * (kk >> 1), end - 1);
        const uint2* p = reinterpret_cast<const uint2*>(vq + (long long)key * HD + 8 * g);
        r.v[kk][0] = __ldcg(p);
        r.v[kk][1] = __ldcg(p + HD / 16);
        r.vd[kk] = __ldcg(reinterpret_cast<const uint2*>(vsh + (long long)key * (HD / 32)));
    }
}
template <int HD, int NP>
__device__ __forceinline__ void dtc_q8_load(DtcQ8Raw<NP, false>&, const unsigned char*, const unsigned char*,
                                            const unsigned short*, const unsigned short*, int, int, int, int) {}

// PRE (f16, contiguous, one row: attn_decode_tc_clp_128_<GB>, and with the ticket merge
// attn_decode_tc_pre_128_<GB>): a warp's loads of its one 16-key tile, issued before the PDL
// wait (keys clamped to end - 1 as in the loop). Every position below the step's own was
// written by a grid that has completed; the step's own position (`DtcNew::pos`) is not
// written yet, so the loop takes that key from the step's k/v rows instead (dtc_f16_new) and
// stores it into the cache itself.
template <int NP, bool ON>
struct DtcF16Pre {
    uint4 k[2][NP], v[4][2];
};
template <int NP>
struct DtcF16Pre<NP, false> {};
template <int HD, int NP>
__device__ __forceinline__ void dtc_f16_load(DtcF16Pre<NP, true>& r, const unsigned short* __restrict__ kh,
                                             const unsigned short* __restrict__ vh, int base, int end, int g,
                                             int tq) {
#pragma unroll
    for (int n = 0; n < 2; n++) {
        const uint4* p = reinterpret_cast<const uint4*>(kh + (long long)min(base + 8 * n + g, end - 1) * HD + 8 * tq);
#pragma unroll
        for (int c = 0; c < NP; c++) r.k[n][c] = __ldcg(p + 4 * c);
    }
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const int key = min(base + 2 * tq + (kk & 1) + 8 * (kk >> 1), end - 1);
        const uint4* p = reinterpret_cast<const uint4*>(vh + (long long)key * HD + 8 * g);
        r.v[kk][0] = __ldcg(p);
        r.v[kk][1] = __ldcg(p + HD / 16);
    }
}
// ROPE (attn_decode_tc_clpr_128_<GB>; attention.rs `qk_norm_rope_attention`, ATTENTION.md
// 23rd session): Qwen3's QK-norm and a NeoX rotation over all 128 dims done by the decode launch
// on the values it loads — q in the registers of its A fragments, the step's new key in the
// lanes that store it — so that no qk_norm_rope launch runs between the Q, K, V and the
// attention. The q and k buffers stay as the Q, K, V launch wrote them; the cache gets the
// rotated key, as after qk_norm_rope. Per element the expressions of qk_norm_rope
// (elementwise.cu): x = (x · s) · w with s = rsqrt(Σ x² / 128 + eps), then
// (x0 c − x1 s', x0 s' + x1 c) with the angle pos · θ^(−2p/128) in f32; only Σ x² is summed in
// another order (a thread's 32 dims, then its quad; the key's lane quads, then the warp).
// The block's table (shared memory), filled before the PDL wait from the position (host
// written) and the norm weights: cos and sin of the 64 pairs, both norm weights.
struct AttnRope {
    const float* qw;
    const float* kw;
    float theta, eps;
};
struct RopeTab {
    float cs[64], sn[64], qw[128], kw[128];
    float eps;
};
__device__ __forceinline__ void rope_tab_fill(RopeTab& rt, const AttnRope& ar, float pos) {
    const int tid = threadIdx.x;  // DECODE_THREADS = 128
    if (tid < 64) {
        const float inv_freq = 1.0f / powf(ar.theta, (float)(2 * tid) / 128.0f);
        const float a = pos * inv_freq;
        rt.cs[tid] = cosf(a);
        rt.sn[tid] = sinf(a);
    }
    rt.qw[tid] = ar.qw[tid];
    rt.kw[tid] = ar.kw[tid];
    if (tid == 0) rt.eps = ar.eps;
}

// The step's new key for PRE: its k and v rows (f32, this kv head's HD elements, written by
// the kernel before this one), its position, and the cache rows' base (this kv head's
// position 0) that the loop stores it at.
struct DtcNew {
    const float* k;
    const float* v;
    unsigned short* kc;
    unsigned short* vc;
    int pos;
    // The lane's words of the new key as the cache holds them (dtc_new_prep): k0, k1 dims
    // 4 l .. 4 l + 3 of k (after QK-norm and RoPE under ROPE), v0, v1 those of v.
    uint32_t k0, k1, v0, v1;
};
// Two f32 as the f16 cache holds them (f32_to_f16_sat: the kv store's bits), packed.
__device__ __forceinline__ uint32_t dtc_f16_pair(float x, float y) {
    return (uint32_t)f32_to_f16_sat(x) | ((uint32_t)f32_to_f16_sat(y) << 16);
}
// PRE: the new position's key as the cache holds it, by every warp right after the PDL wait
// (decode_tc_loop, before q's loads): lane l converts dims 4 l .. 4 l + 3 of the new k and v
// rows (one 16-byte load each; under ROPE k's QK-norm and rotation first); dtc_f16_new stores
// them and gathers them into the fragments. Why every warp, with no branch: the words were made
// in dtc_f16_new, inside the loop after q's norm and rotation, so their loads went out only
// after q's had returned — a second L2 round trip on the launch's chain; under a branch, the
// compiler sinks the loads back into it. Here they share q's round trip (1 KB a warp from L2,
// ~40 instructions a warp).
template <int HD, bool ROPE = false>
__device__ __forceinline__ void dtc_new_prep(DtcNew& nw, int lane, const RopeTab* rt = nullptr) {
    static_assert(HD == 128, "dtc_new_prep: hd 128 (a lane per 4 dims)");
    float4 a = *reinterpret_cast<const float4*>(nw.k + 4 * lane);
    const float4 b = *reinterpret_cast<const float4*>(nw.v + 4 * lane);
    if constexpr (ROPE) {
        // Lane l holds dims 4 l .. 4 l + 3; a dim's NeoX partner (± 64) is in lane l ^ 16.
        float x[4] = {a.x, a.y, a.z, a.w};
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < 4; j++) ss += x[j] * x[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(ATT_FULL, ss, o);
        const float sc = rsqrtf(ss / 128.0f + rt->eps);
#pragma unroll
        for (int j = 0; j < 4; j++) x[j] = (x[j] * sc) * rt->kw[4 * lane + j];
        const bool lo = lane < 16;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float o = __shfl_xor_sync(ATT_FULL, x[j], 16);
            const int p = 4 * (lane & 15) + j;
            x[j] = lo ? x[j] * rt->cs[p] - o * rt->sn[p] : o * rt->sn[p] + x[j] * rt->cs[p];
        }
        a = make_float4(x[0], x[1], x[2], x[3]);
    }
    nw.k0 = dtc_f16_pair(a.x, a.y), nw.k1 = dtc_f16_pair(a.z, a.w);
    nw.v0 = dtc_f16_pair(b.x, b.y), nw.v1 = dtc_f16_pair(b.z, b.w);
}
// PRE: the new position's key stored into the cache row and put in the fragments by the warp
// whose tile holds it (warp-uniform: `base` is), from the words dtc_new_prep made: K's piece c
// of lane (g, tq) is dims 32 c + 8 tq .. + 7 (lanes 8 c + 2 tq, + 1), V's pieces dims 8 g ..
// + 7 and 64 + 8 g .. + 7 (lanes 2 g, + 1 and 16 + 2 g, + 1). The tile holding the position ends there
// (end − 1 = pos), so its keys past it are the loop's clamped copies (masked, p = 0): they take
// zeros, which add what the plain loop's finite copies add: nothing. The lanes with keys below
// it keep their cache loads.
template <int HD, int NP>
__device__ __forceinline__ void dtc_f16_new(uint4 (&kw)[2][NP], uint4 (&vw)[4][2], const DtcNew& nw, int base,
                                            int lane) {
    static_assert(HD == 128 && NP == 4, "dtc_f16_new: hd 128 (a lane per 4 dims)");
    if (nw.pos < base || nw.pos >= base + 16) return;
    const int g = lane >> 2, tq = lane & 3;
    const uint32_t k0 = nw.k0, k1 = nw.k1, v0 = nw.v0, v1 = nw.v1;
    *reinterpret_cast<uint2*>(nw.kc + (long long)nw.pos * HD + 4 * lane) = make_uint2(k0, k1);
    *reinterpret_cast<uint2*>(nw.vc + (long long)nw.pos * HD + 4 * lane) = make_uint2(v0, v1);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int c = 0; c < NP; c++) {
        const int src = 8 * c + 2 * tq;
        const uint4 w = make_uint4(__shfl_sync(ATT_FULL, k0, src), __shfl_sync(ATT_FULL, k1, src),
                                   __shfl_sync(ATT_FULL, k0, src + 1), __shfl_sync(ATT_FULL, k1, src + 1));
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const int key = base + 8 * n + g;
            kw[n][c] = key == nw.pos ? w : key > nw.pos ? zero : kw[n][c];
        }
    }
    const uint4 lo = make_uint4(__shfl_sync(ATT_FULL, v0, 2 * g), __shfl_sync(ATT_FULL, v1, 2 * g),
                                __shfl_sync(ATT_FULL, v0, 2 * g + 1), __shfl_sync(ATT_FULL, v1, 2 * g + 1));
    const uint4 hi = make_uint4(__shfl_sync(ATT_FULL, v0, 16 + 2 * g), __shfl_sync(ATT_FULL, v1, 16 + 2 * g),
                                __shfl_sync(ATT_FULL, v0, 17 + 2 * g), __shfl_sync(ATT_FULL, v1, 17 + 2 * g));
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const int key = base + 2 * tq + (kk & 1) + 8 * (kk >> 1);
        vw[kk][0] = key == nw.pos ? lo : key > nw.pos ? zero : vw[kk][0];
        vw[kk][1] = key == nw.pos ? hi : key > nw.pos ? zero : vw[kk][1];
    }
}

// The decode main loop on the tensor cores (attn_decode_tc_128_<GB>: f16 contiguous cache,
// hd 128; attn_decode_tc_q8_128_<GB>: q8_0, its values dequantized into the same f16 words
// by q8_dequant8 after the loads; ATTENTION.md, "Decode on the tensor cores"). Why: the SIMT loop spends ~65 warp
// instructions per key (8-dim partial dots, a 4-level shuffle reduction per head, per-key
// online softmax, f16 unpacking) and loads one batch per iteration, so at long context it
// ran at ~2.9 TB/s in the model; here a warp spends ~150 instructions per 16 keys (8 KB).
// The plan, per warp (4 warps, warp w takes keys base + 16 w .. + 15 of every 64-key block
// iteration; warps are independent until the block merge, no barriers in the loop):
// - S = Q Kᵀ on mma.sync m16n8k16 (f16 → f32): A = q (rows: the block's GB heads, rows ≥ GB
//   zero; q scaled by scale·log2(e), rounded to f16 once, in registers), B = K (n: 8 keys,
//   two n-tiles per 16 keys). The dims are permuted (a dot product does not care): thread
//   (g, t) owns dims 32 c + 8 t .. + 7 (c < 4) of a key, so a quad reads 64 contiguous bytes
//   per load and a thread's word m holds dims 32 (m / 4) + 8 t + 2 (m % 4), + 1; k step j
//   takes words 2 j (b0) and 2 j + 1 (b1), q packed the same way.
//   Each thread loads key base + 8 n + g of n-tile n: 4 × 16 B (ld.global.cg: the block
//   may have stored the step's own row just before).
// - Online softmax in base 2 per head row g (replicated over the quad t; maxima by two
//   xor-shuffles, l a per-thread partial, reduced at the end); keys at or past `end` masked
//   (p = 0; their loads clamped to end - 1, so they read written, finite cache rows).
// - O += P V as Oᵀ = Vᵀ Pᵀ (m16n8k16): B = Pᵀ straight from S's accumulators (C of two
//   n-tiles = b0/b1: keys 2 t, 2 t + 1 and 8 + 2 t, 9 + 2 t of head g), A = Vᵀ (rows: 16
//   dims, k: 16 keys). Row m of m-tile i is dim 8 m + i, so thread (g, t) needs dims
//   8 g .. + 7 and 64 + 8 g .. + 7 of keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9: 8 × 16 B, each
//   a quad-row of 4 keys × 128 contiguous bytes per warp load; pairs of keys per register
//   by byte_perm. Oᵀ is 8 m-tiles × 4 f32: thread (g, t) holds dims 8 g + i, 64 + 8 g + i
//   of heads 2 t, 2 t + 1; the per-head correction comes from quad 2 t / 2 t + 1 by shuffle.
// Per warp and 16 keys: 16 loads of 16 B, 24 MMAs (16 S, 8 P·V), 32 byte_perm, ~40 for the
// softmax. The warp's (m, l, acc) go to the block merge in the SIMT loop's format.
// Precision: q and P rounded to f16 (as the tensor-core prefill), f32 accumulation.
// PAGED: key p's row sits at page bt[p >> page_shift] (page_stride elements per page),
// row p mod page size, relative to head_base (the kv head's offset in a page); else at p.
//
// PIPE (q8_0, contiguous: attn_decode_tc_q8p_128_<GB>; FERRITE_ATTN_PIPE=0 the plain loop): the
// raw loads of a warp's next 16 keys (quants and scales, 44 registers) are issued before this
// tile's conversions and MMAs, so that a warp has a tile in flight while it computes (the
// plain loop loads, then computes: ~4 KB in flight per warp, none while it computes). The
// arithmetic is the same sequence, so the outputs are the plain loop's bits; ~44 registers
// more: 3 blocks per SM (launch bounds) instead of 4.
//
// PRE (f16, contiguous, one row: attn_decode_tc_clp_128_<GB>, the cluster-merge launch of
// short caches, and attn_decode_tc_pre_128_<GB>, the ticket-merge one, where a warp's chunk is
// its one 16-key tile): the warp's tile is loaded before the PDL wait (dtc_f16_load, into
// `pre`), so the keys' DRAM round trip overlaps the kernels before this one instead of
// following the wait (where it queued behind the next GEMV's weight copies). The new position's key is not in the cache yet: the lanes whose
// (clamped) key is `nw.pos` take it from the step's k/v rows (dtc_f16_new, the kv store's
// f16 bits) and the lanes of the position itself store it; the launch has no store phase and
// no barrier before the loop. Same arithmetic on the same values: the plain loop's bits.
template <int HD, int GB, bool Q8, bool PAGED = false, bool PIPE = false, bool PRE = false, bool ROPE = false>
__device__ __forceinline__ void decode_tc_loop(const float* __restrict__ q, const unsigned char* __restrict__ kc,
                                               const unsigned char* __restrict__ vc,
                                               const unsigned short* __restrict__ ks,
                                               const unsigned short* __restrict__ vs, int t, int n_heads, int h0,
                                               long long head_base, int start, int end, float scale_log2,
                                               float (&sm_acc)[DECODE_THREADS / 32][GB][HD],
                                               float (&sm_m)[DECODE_THREADS / 32][GB],
                                               float (&sm_l)[DECODE_THREADS / 32][GB],
                                               const int* __restrict__ bt = nullptr, int page_shift = 0,
                                               long long page_stride = 0,
                                               const DtcF16Pre<HD / 32, PRE>& pre = DtcF16Pre<HD / 32, PRE>{},
                                               DtcNew nw = DtcNew{}, const RopeTab* rt = nullptr) {
    static_assert(!ROPE || PRE, "decode_tc_loop: ROPE is the PRE form's");
    static_assert(HD == 128 && GB <= 8, "decode_tc_loop: hd 128, at most 8 heads (the n of P V)");
    static_assert(!PRE || (!Q8 && !PAGED), "decode_tc_loop: PRE is the contiguous f16 form");
    constexpr int NW = DECODE_THREADS / 32;
    constexpr int KS = HD / 16;  // k steps of S, m-tiles of Oᵀ
    constexpr int NP = HD / 32;  // 16-byte pieces of a key per thread
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;

    // PRE: the new key's words first (dtc_new_prep: their loads share q's round trip).
    if constexpr (PRE) dtc_new_prep<HD, ROPE>(nw, lane, rt);
    // q's A fragments: row g = head h0 + g; words as the K words (dims 32 c + 8 tq + 2 w).
    uint32_t qa[KS][2];
    {
        const float* qp = q + ((long long)t * n_heads + h0 + min(g, GB - 1)) * HD + 8 * tq;
        float4 qa4[NP], qb4[NP];
#pragma unroll
        for (int c = 0; c < NP; c++) {
            qa4[c] = *reinterpret_cast<const float4*>(qp + 32 * c);
            qb4[c] = *reinterpret_cast<const float4*>(qp + 32 * c + 4);
        }
        if constexpr (ROPE) {
            // This thread's dims 32 c + 8 tq + i (c < 4, i < 8) of its head; the quad (tq) holds
            // the head; dim d < 64 and its NeoX partner d + 64 (c + 2) are in the same thread.
            float x[NP][8];
#pragma unroll
            for (int c = 0; c < NP; c++) {
                x[c][0] = qa4[c].x, x[c][1] = qa4[c].y, x[c][2] = qa4[c].z, x[c][3] = qa4[c].w;
                x[c][4] = qb4[c].x, x[c][5] = qb4[c].y, x[c][6] = qb4[c].z, x[c][7] = qb4[c].w;
            }
            float ss = 0.f;
#pragma unroll
            for (int c = 0; c < NP; c++)
#pragma unroll
                for (int i = 0; i < 8; i++) ss += x[c][i] * x[c][i];
            ss += __shfl_xor_sync(ATT_FULL, ss, 1);
            ss += __shfl_xor_sync(ATT_FULL, ss, 2);
            const float sc = rsqrtf(ss / 128.0f + rt->eps);
#pragma unroll
            for (int c = 0; c < NP; c++)
#pragma unroll
                for (int i = 0; i < 8; i++) x[c][i] = (x[c][i] * sc) * rt->qw[32 * c + 8 * tq + i];
#pragma unroll
            for (int c = 0; c < 2; c++)
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int p = 32 * c + 8 * tq + i;
                    const float x0 = x[c][i], x1 = x[c + 2][i];
                    x[c][i] = x0 * rt->cs[p] - x1 * rt->sn[p];
                    x[c + 2][i] = x0 * rt->sn[p] + x1 * rt->cs[p];
                }
#pragma unroll
            for (int c = 0; c < NP; c++) {
                qa4[c] = make_float4(x[c][0], x[c][1], x[c][2], x[c][3]);
                qb4[c] = make_float4(x[c][4], x[c][5], x[c][6], x[c][7]);
            }
        }
#pragma unroll
        for (int c = 0; c < NP; c++) {
            const float4 a = qa4[c];
            const float4 b = qb4[c];
            const bool on = g < GB;
            qa[2 * c][0] = on ? tc_pack_f16(a.x * scale_log2, a.y * scale_log2) : 0u;
            qa[2 * c][1] = on ? tc_pack_f16(a.z * scale_log2, a.w * scale_log2) : 0u;
            qa[2 * c + 1][0] = on ? tc_pack_f16(b.x * scale_log2, b.y * scale_log2) : 0u;
            qa[2 * c + 1][1] = on ? tc_pack_f16(b.z * scale_log2, b.w * scale_log2) : 0u;
        }
    }
    if constexpr (ROPE) TL_MARK_AFTER(0, qa[KS - 1][1]);
    float acc[KS][4];
#pragma unroll
    for (int i = 0; i < KS; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_run = ATT_NEG, l_run = 0.f;
    // Element offset of key p's row from head_base (kv_pos), and of its q8_0 scales from
    // head_base / 32.
    auto row = [&](int p) -> long long { return kv_pos<PAGED>(0, p, HD, bt, page_shift, page_stride); };
    auto srow = [&](int p) -> long long {
        if constexpr (PAGED) {
            return row(p) / 32;
        } else {
            return (long long)p * (HD / 32);
        }
    };

    // PIPE: the raw loads of the tile at `base` (keys as in the loop below).
    DtcQ8Raw<NP, PIPE> raw;
    if constexpr (PIPE) {
        static_assert(Q8 && !PAGED, "decode_tc_loop: PIPE is the contiguous q8_0 form");
        dtc_q8_load<HD>(raw, kc + head_base, vc + head_base, ks + head_base / 32, vs + head_base / 32,
                        start + 16 * warp, end, g, tq);
    }

    // PRE: the warp's one tile, loaded before the PDL wait.
    DtcF16Pre<NP, PRE> tile = pre;

    for (int base = start + 16 * warp; base < end; base += 16 * NW) {  // uniform across the warp
        // The keys this thread loads, clamped to end - 1: K's key g of n-tile n, V's keys
        // 2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9 (relative to base).
        int kkey[2], vkey[4];
#pragma unroll
        for (int n = 0; n < 2; n++) kkey[n] = min(base + 8 * n + g, end - 1);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) vkey[kk] = min(base + 2 * tq + (kk & 1) + 8 * (kk >> 1), end - 1);
        uint4 kw[2][NP], vw[4][2];
        if constexpr (PIPE) {
            // This tile's loads went out one tile earlier; the next tile's go out now.
            const DtcQ8Raw<NP, PIPE> cur = raw;
            dtc_q8_load<HD>(raw, kc + head_base, vc + head_base, ks + head_base / 32, vs + head_base / 32,
                            base + 16 * NW, end, g, tq);
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int c = 0; c < NP; c++) kw[n][c] = q8_dequant8(cur.k[n][c], q8_scale2(cur.kd[n], c));
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                vw[kk][0] = q8_dequant8(cur.v[kk][0], q8_scale2(cur.vd[kk], g >> 2));
                vw[kk][1] = q8_dequant8(cur.v[kk][1], q8_scale2(cur.vd[kk], 2 + (g >> 2)));
            }
        } else if constexpr (Q8) {
            // The quants at byte head_base + element, the scales per 32 elements (4 per key).
            // Every load first (8-byte quants, the key's four scales), then the conversions.
            const unsigned char *kq = kc + head_base, *vq = vc + head_base;
            const unsigned short *ksh = ks + head_base / 32, *vsh = vs + head_base / 32;
            uint2 kq8[2][NP], kd[2], vq8[4][2], vd[4];
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const uint2* p = reinterpret_cast<const uint2*>(kq + row(kkey[n]) + 8 * tq);
#pragma unroll
                for (int c = 0; c < NP; c++) kq8[n][c] = __ldcg(p + 4 * c);
                kd[n] = __ldcg(reinterpret_cast<const uint2*>(ksh + srow(kkey[n])));
            }
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const uint2* p = reinterpret_cast<const uint2*>(vq + row(vkey[kk]) + 8 * g);
                vq8[kk][0] = __ldcg(p);
                vq8[kk][1] = __ldcg(p + HD / 16);
                vd[kk] = __ldcg(reinterpret_cast<const uint2*>(vsh + srow(vkey[kk])));
            }
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int c = 0; c < NP; c++) kw[n][c] = q8_dequant8(kq8[n][c], q8_scale2(kd[n], c));
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {  // dims 8 g .. (block g / 4), 64 + 8 g .. (2 + g / 4)
                vw[kk][0] = q8_dequant8(vq8[kk][0], q8_scale2(vd[kk], g >> 2));
                vw[kk][1] = q8_dequant8(vq8[kk][1], q8_scale2(vd[kk], 2 + (g >> 2)));
            }
        } else if constexpr (PRE) {
            // The warp's one tile (chunks of at most 16 × NW keys: attn_decode_impl), loaded
            // before the PDL wait; the new position's key from the step's rows.
            dtc_f16_new<HD, NP>(tile.k, tile.v, nw, base, lane);
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int c = 0; c < NP; c++) kw[n][c] = tile.k[n][c];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) vw[kk][0] = tile.v[kk][0], vw[kk][1] = tile.v[kk][1];
        } else {
            const unsigned short* kh = reinterpret_cast<const unsigned short*>(kc) + head_base;
            const unsigned short* vh = reinterpret_cast<const unsigned short*>(vc) + head_base;
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const uint4* p = reinterpret_cast<const uint4*>(kh + row(kkey[n]) + 8 * tq);
#pragma unroll
                for (int c = 0; c < NP; c++) kw[n][c] = __ldcg(p + 4 * c);
            }
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const uint4* p = reinterpret_cast<const uint4*>(vh + row(vkey[kk]) + 8 * g);
                vw[kk][0] = __ldcg(p);
                vw[kk][1] = __ldcg(p + HD / 16);  // dims 64 + 8 g ..
            }
        }

        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int j = 0; j < KS; j++) {
                const uint4 w = kw[n][j / 2];
                const uint32_t b0 = (j & 1) ? w.z : w.x, b1 = (j & 1) ? w.w : w.y;
                tc_mma_f16(s[n], qa[j][0], 0u, qa[j][1], 0u, b0, b1);
            }
        }
        // s[n][e]: head g, key base + 8 n + 2 tq + e (s[n][2..3]: the zero rows g + 8).
        float mx = m_run;
        bool ok[2][2];
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                ok[n][e] = base + 8 * n + 2 * tq + e < end;
                if (ok[n][e]) mx = fmaxf(mx, s[n][e]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(ATT_FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(ATT_FULL, mx, 2));
        const float corr = exp2f(m_run - mx);
        m_run = mx;
        float p[2][2], ps = 0.f;
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                p[n][e] = ok[n][e] ? exp2f(s[n][e] - mx) : 0.f;
                ps += p[n][e];
            }
        l_run = l_run * corr + ps;
        const uint32_t pb0 = tc_pack_f16(p[0][0], p[0][1]), pb1 = tc_pack_f16(p[1][0], p[1][1]);
        // Oᵀ's columns are heads 2 tq, 2 tq + 1: their corrections from quads 2 tq, 2 tq + 1.
        const float ca = __shfl_sync(ATT_FULL, corr, 8 * tq), cb = __shfl_sync(ATT_FULL, corr, 8 * tq + 4);
#pragma unroll
        for (int i = 0; i < KS; i++) {
            acc[i][0] *= ca;
            acc[i][1] *= cb;
            acc[i][2] *= ca;
            acc[i][3] *= cb;
            const uint32_t sel = (i & 1) ? 0x7632u : 0x5410u;  // dim 8 g + i: high or low halves
            const int wi = i / 2;
            const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&vw[0][0]);
            const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&vw[1][0]);
            const uint32_t* v2 = reinterpret_cast<const uint32_t*>(&vw[2][0]);
            const uint32_t* v3 = reinterpret_cast<const uint32_t*>(&vw[3][0]);
            const uint32_t a0 = __byte_perm(v0[wi], v1[wi], sel);          // dim 8g+i, keys 2tq, +1
            const uint32_t a1 = __byte_perm(v0[4 + wi], v1[4 + wi], sel);  // dim 64+8g+i
            const uint32_t a2 = __byte_perm(v2[wi], v3[wi], sel);          // keys 2tq+8, +9
            const uint32_t a3 = __byte_perm(v2[4 + wi], v3[4 + wi], sel);
            tc_mma_f16(acc[i], a0, a1, a2, a3, pb0, pb1);
        }
        if constexpr (PRE) break;  // one tile per warp (without it, ptxas keeps it live: 188 registers)
    }
    l_run += __shfl_xor_sync(ATT_FULL, l_run, 1);
    l_run += __shfl_xor_sync(ATT_FULL, l_run, 2);
    if (tq == 0 && g < GB) {
        sm_m[warp][g] = m_run;
        sm_l[warp][g] = l_run;
    }
#pragma unroll
    for (int i = 0; i < KS; i++) {
        if (2 * tq < GB) {
            sm_acc[warp][2 * tq][8 * g + i] = acc[i][0];
            sm_acc[warp][2 * tq][HD / 2 + 8 * g + i] = acc[i][2];
        }
        if (2 * tq + 1 < GB) {
            sm_acc[warp][2 * tq + 1][8 * g + i] = acc[i][1];
            sm_acc[warp][2 * tq + 1][HD / 2 + 8 * g + i] = acc[i][3];
        }
    }
}
// EMU_DTC_END

// The split merge through the cluster (CL: attn_decode_tc[_q8]_cl_128_<gb> and the SIMT loop's
// attn_decode[_q8]_cl_256_<gb>, a launch whose clusters are the n_splits blocks of one (head
// block, row), n_splits ≤ 16): each block leaves its partial (acc, m, l) in its own shared
// memory; one cluster barrier (release / acquire) makes them visible; then every block merges a
// share of the 32-element output blocks (block r takes blocks r, r + n_splits, ..., one warp
// per 32-block) reading the partials of the n_active splits straight from their shared memory
// (mapa + ld.shared::cluster), and emits them; a second barrier (execution only:
// cluster_sync_exec) keeps every block (and its shared memory) alive until all reads are done. Instead of the ticket path's fence, atomic and
// the partials' round trip through L2, all on the last block's critical path. Blocks of
// empty splits take part in both barriers and their merge share. ATTENTION.md, "The split
// merge in a cluster".
// cluster_sync_all, cluster_sync_exec, ld_cluster_f32: common.cuh.
template <int HD, int GB, bool Q8, bool PAGED, bool STORE, bool TC = false, bool CL = false, bool PIPE = false,
          bool PRE = false, bool SEP = false, bool TAIL = false, bool ROPE = false>
__device__ __forceinline__ void attn_decode_impl(
    const float* __restrict__ q, const float* __restrict__ knew, const float* __restrict__ vnew,
    unsigned char* __restrict__ kc, unsigned char* __restrict__ vc,
    unsigned short* __restrict__ ks, unsigned short* __restrict__ vs,
    const int* __restrict__ positions, float* __restrict__ part_acc,
    float* __restrict__ part_ml, int* __restrict__ tickets, float* __restrict__ out,
    int8_t* __restrict__ xq, float2* __restrict__ xd, long long layer_off, int n_heads,
    int group, int capacity, int n_splits, int min_chunk, int pf, float scale_log2,
    PAGED_ARGS, AttnRope ar = AttnRope{}) {
    constexpr int TPK = HD / 8;      // threads per key; each owns 8 dims
    constexpr int KPW = 32 / TPK;    // keys per warp per pass
    constexpr int NW = DECODE_THREADS / 32;
    constexpr int KPB = NW * KPW;    // keys per block per pass
    constexpr int U = GB >= 8 ? 2 : 4;
    // Keys per block per iteration (TC: 16 per warp, decode_tc_loop).
    constexpr int STEP = TC ? NW * 16 : KPB * U;
    static_assert(HD % 32 == 0 && 32 % TPK == 0, "decode head_dim");
    static_assert(!TC || HD == 128, "tensor-core decode: hd 128");
    static_assert(!CL || !PAGED, "cluster merge: contiguous caches");
    static_assert(!PRE || (TC && STORE && !Q8), "PRE: the contiguous f16 tensor-core form (one row)");

    __shared__ float sm_acc[NW][GB][HD];
    __shared__ float sm_m[NW][GB], sm_l[NW][GB];
    __shared__ float sm_c[GB][DECODE_MAX_SPLITS];
    __shared__ float sm_inv[GB];
    __shared__ int s_pos[DECODE_MAX_ROWS];
    __shared__ int s_ticket;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = lane % TPK, slot = warp * KPW + lane / TPK;
    const int h0 = blockIdx.x * GB, split = blockIdx.y, t = blockIdx.z;
    const int kvh = h0 / group;

    // Before the PDL wait: only the positions (written by host copies, or by the previous
    // step's argmax_feed: a launch that completed before this one's predecessor passed its
    // wait, as every launch between them waits before it ends) and the cache at positions of
    // earlier steps (written by grids that have completed).
    const int pos_t = positions[t];
    const int n_keys = max(0, min(pos_t + 1, max_keys));
    const int chunk = decode_chunk(n_keys, n_splits, min_chunk, STEP);
    const int n_active = decode_active(n_keys, chunk);
    // An empty split takes no part (whole block), except in the cluster merge, where it
    // still passes the barriers and merges its share.
    const bool idle = split >= n_active;
    if (idle && (!CL || n_active == 1)) return;
    const int start = split * chunk;
    const int end = min(n_keys, start + chunk);
    // Element index of position 0 of this kv head (page 0 when paged).
    const long long head_base = layer_off + (long long)kvh * capacity * HD;
    if constexpr (!PAGED) {
        if (pf > 0 && tid == 0 && !(CL && idle)) {
            const int k1 = min(end, start + pf * STEP);
            prefetch_keys<Q8>(kc, ks, head_base + (long long)start * HD, head_base + (long long)k1 * HD);
            prefetch_keys<Q8>(vc, vs, head_base + (long long)start * HD, head_base + (long long)k1 * HD);
        }
    }
    // PRE: the warp's tile of keys, loaded now (decode_tc_loop's PRE form). A warp has one
    // tile only where chunk ≤ STEP: the launcher takes PRE for such caches alone (one row,
    // splits × 64 ≥ capacity, min_chunk ≤ 64); anything else would be its error, not a
    // silently wrong answer.
    DtcF16Pre<HD / 32, PRE> pre;
    if constexpr (PRE) {
        if (chunk > STEP || gridDim.z != 1) __trap();
        if (!idle && start + 16 * warp < end)
            dtc_f16_load<HD>(pre, reinterpret_cast<const unsigned short*>(kc) + head_base,
                             reinterpret_cast<const unsigned short*>(vc) + head_base, start + 16 * warp, end,
                             lane >> 2, lane & 3);
    }
    if constexpr (STORE && !PRE) {
        if (tid < gridDim.z) s_pos[tid] = positions[tid];
    }
    // ROPE: the rotation's table and the norm weights, before the wait (they depend on no
    // kernel); the barrier orders them before the loop's reads.
    __shared__ float rope_mem[ROPE ? sizeof(RopeTab) / sizeof(float) : 1];
    RopeTab* rtab = reinterpret_cast<RopeTab*>(rope_mem);
    if constexpr (ROPE) {
        static_assert(PRE && HD == 128 && DECODE_THREADS == 128, "ROPE: the PRE form at hd 128");
        rope_tab_fill(*rtab, ar, (float)pos_t);
        __syncthreads();
    }
    PDL_ENTRY();

    const int kvd = (n_heads / group) * HD;
    if constexpr (STORE && !PRE) {
        // The step's rows at positions inside this block's range [start, end) (for row t's
        // last split that includes row t itself) are written into the cache by this block,
        // for its kv head (the last row of a position wins, as in kv_store); every block that
        // reads a position of the step has written it itself, so the barrier below orders
        // the write before its reads. Blocks sharing a position write identical bits.
        __syncthreads();
        const int rows = gridDim.z;
        for (int r = 0; r < rows; r++) {  // uniform across the block
            const int p = s_pos[r];
            bool mine = p >= start && p < end;
            for (int r2 = r + 1; r2 < rows; r2++) mine = mine && s_pos[r2] != p;
            if (!mine) continue;
            const long long e0 = head_base + (long long)p * HD;
            const float* kr = knew + (long long)r * kvd + kvh * HD;
            const float* vr = vnew + (long long)r * kvd + kvh * HD;
            for (int i = tid; i < HD; i += DECODE_THREADS) {  // whole warps (HD % 32 == 0)
                if constexpr (Q8) {
                    q8_store(kr[i], kc, ks, e0 + i, lane);
                    q8_store(vr[i], vc, vs, e0 + i, lane);
                } else {
                    reinterpret_cast<unsigned short*>(kc)[e0 + i] = f32_to_f16_sat(kr[i]);
                    reinterpret_cast<unsigned short*>(vc)[e0 + i] = f32_to_f16_sat(vr[i]);
                }
            }
        }
        __syncthreads();
    }

    if (CL && idle) {
        // CL only: no keys (the partial below is not written; the merge reads n_active).
    } else if constexpr (TC) {
        if constexpr (PAGED) {
            decode_tc_loop<HD, GB, Q8, true>(q, kc, vc, ks, vs, t, n_heads, h0, head_base, start, end, scale_log2,
                                             sm_acc, sm_m, sm_l,
                                             row_table<true>(row_seq, block_tables, bt_stride, t), page_shift,
                                             page_stride);
        } else if constexpr (PRE) {
            // One row (the launcher's rule): its new key at pos_t, its k/v rows at row 0.
            const DtcNew nw{knew + kvh * HD, vnew + kvh * HD, reinterpret_cast<unsigned short*>(kc) + head_base,
                            reinterpret_cast<unsigned short*>(vc) + head_base, pos_t};
            decode_tc_loop<HD, GB, false, false, false, true, ROPE>(q, kc, vc, ks, vs, t, n_heads, h0, head_base,
                                                                    start, end, scale_log2, sm_acc, sm_m, sm_l,
                                                                    nullptr, 0, 0, pre, nw, rtab);
        } else {
            decode_tc_loop<HD, GB, Q8, false, PIPE>(q, kc, vc, ks, vs, t, n_heads, h0, head_base, start, end,
                                                    scale_log2, sm_acc, sm_m, sm_l);
        }
    } else {
        const int* bt = row_table<PAGED>(row_seq, block_tables, bt_stride, t);

        float qr[GB][8];
    #pragma unroll
        for (int g = 0; g < GB; g++) {
            const float4* qp = reinterpret_cast<const float4*>(
                q + ((long long)t * n_heads + h0 + g) * HD + sub * 8);
            float4 a = qp[0], b = qp[1];
            qr[g][0] = a.x * scale_log2; qr[g][1] = a.y * scale_log2;
            qr[g][2] = a.z * scale_log2; qr[g][3] = a.w * scale_log2;
            qr[g][4] = b.x * scale_log2; qr[g][5] = b.y * scale_log2;
            qr[g][6] = b.z * scale_log2; qr[g][7] = b.w * scale_log2;
        }
        float m[GB], l[GB], acc[GB][8];
    #pragma unroll
        for (int g = 0; g < GB; g++) {
            m[g] = ATT_NEG;
            l[g] = 0.f;
    #pragma unroll
            for (int i = 0; i < 8; i++) acc[g][i] = 0.f;
        }

        // Element index of this thread's 8 dims at position 0 of its kv head.
        const long long head_off = head_base + sub * 8;
        for (int base = start; base < end; base += STEP) {  // uniform across the block
            if constexpr (!PAGED) {
                if (pf > 0 && tid == 0) {
                    const int k0 = base + pf * STEP, k1 = min(end, k0 + STEP);
                    prefetch_keys<Q8>(kc, ks, head_base + (long long)k0 * HD, head_base + (long long)k1 * HD);
                    prefetch_keys<Q8>(vc, vs, head_base + (long long)k0 * HD, head_base + (long long)k1 * HD);
                }
            }
            uint4 kr[U], vr[U];
            bool ok[U];
    #pragma unroll
            for (int u = 0; u < U; u++) {
                int kp = base + u * KPB + slot;
                ok[u] = kp < end;
                if (ok[u]) {
                    const long long e = kv_pos<PAGED>(head_off, kp, HD, bt, page_shift, page_stride);
                    kr[u] = load8<Q8, STORE>(kc, ks, e);
                    vr[u] = load8<Q8, STORE>(vc, vs, e);
                } else {
                    kr[u] = make_uint4(0, 0, 0, 0);
                    vr[u] = make_uint4(0, 0, 0, 0);
                }
            }
            float s[U][GB];
    #pragma unroll
            for (int u = 0; u < U; u++) {
                float kf[8];
                unpack8x<Q8>(kr[u], kf);
    #pragma unroll
                for (int g = 0; g < GB; g++) {
                    float d = 0.f;
    #pragma unroll
                    for (int i = 0; i < 8; i++) d = fmaf(qr[g][i], kf[i], d);
    #pragma unroll
                    for (int o = TPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(ATT_FULL, d, o);
                    s[u][g] = ok[u] ? d : ATT_NEG;
                }
            }
            float mn[GB];
    #pragma unroll
            for (int g = 0; g < GB; g++) {
                mn[g] = m[g];
    #pragma unroll
                for (int u = 0; u < U; u++) mn[g] = fmaxf(mn[g], s[u][g]);
                float corr = exp2f(m[g] - mn[g]);
                l[g] *= corr;
    #pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] *= corr;
                m[g] = mn[g];
            }
    #pragma unroll
            for (int u = 0; u < U; u++) {
                float vf[8];
                unpack8x<Q8>(vr[u], vf);
    #pragma unroll
                for (int g = 0; g < GB; g++) {
                    float p = ok[u] ? exp2f(s[u][g] - m[g]) : 0.f;
                    l[g] += p;
    #pragma unroll
                    for (int i = 0; i < 8; i++) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
                }
            }
        }

        // Merge the key slots of a warp (lanes with the same `sub`): butterfly over slot bits.
    #pragma unroll
        for (int o = TPK; o < 32; o <<= 1) {
    #pragma unroll
            for (int g = 0; g < GB; g++) {
                float mo = __shfl_xor_sync(ATT_FULL, m[g], o);
                float lo = __shfl_xor_sync(ATT_FULL, l[g], o);
                float mx = fmaxf(m[g], mo);
                float c1 = exp2f(m[g] - mx), c2 = exp2f(mo - mx);
                l[g] = l[g] * c1 + lo * c2;
    #pragma unroll
                for (int i = 0; i < 8; i++) {
                    float ao = __shfl_xor_sync(ATT_FULL, acc[g][i], o);
                    acc[g][i] = acc[g][i] * c1 + ao * c2;
                }
                m[g] = mx;
            }
        }
        if (lane < TPK) {
    #pragma unroll
            for (int g = 0; g < GB; g++) {
    #pragma unroll
                for (int i = 0; i < 8; i++) sm_acc[warp][g][sub * 8 + i] = acc[g][i];
                if (sub == 0) {
                    sm_m[warp][g] = m[g];
                    sm_l[warp][g] = l[g];
                }
            }
        }
    }
    __syncthreads();
    if constexpr (ROPE) TL_MARK(1);
    // The block's state per (head, dim): the whole answer when it is the row's only split,
    // else a partial (m, l, acc) for the merge below (CL: in this block's shared memory).
    __shared__ float sm_part[CL ? GB : 1][CL ? HD : 1];
    __shared__ float sm_pml[CL ? GB : 1][2];
    const bool single = n_active == 1;  // uniform across the block
    for (int idx = tid; idx < (CL && idle ? 0 : GB * HD); idx += DECODE_THREADS) {  // whole warps per 32-block
        const int g = idx / HD, d = idx % HD;
        float mx = ATT_NEG;
#pragma unroll
        for (int w = 0; w < NW; w++) mx = fmaxf(mx, sm_m[w][g]);
        float a = 0.f, lsum = 0.f;
#pragma unroll
        for (int w = 0; w < NW; w++) {
            float c = exp2f(sm_m[w][g] - mx);
            a += sm_acc[w][g][d] * c;
            lsum += sm_l[w][g] * c;
        }
        if (single) {
            decode_emit(a * (1.f / lsum), out, xq, xd, t, n_heads, HD, h0 + g, d);
        } else if constexpr (CL) {
            sm_part[g][d] = a;
            if (d == 0) {
                sm_pml[g][0] = mx;
                sm_pml[g][1] = lsum;
            }
        } else {
            const long long prow = ((long long)t * n_heads + h0 + g) * n_splits + split;
            part_acc[prow * HD + d] = a;
            if (d == 0) {
                part_ml[2 * prow] = mx;
                part_ml[2 * prow + 1] = lsum;
            }
        }
    }
    if (single) return;

    if constexpr (CL) {
        cluster_sync_diag(1);
        if constexpr (ROPE) TL_MARK(2);
        // This block's share: 32-element output blocks split, split + n_splits, ... (the
        // cluster's blocks are the row's splits in order: rank = split), one warp each.
        for (int b = split + warp * n_splits; b < GB * HD / 32; b += NW * n_splits) {
            const int idx = b * 32 + lane, g = idx / HD, d = idx % HD;
            float mx = ATT_NEG;
            for (int s = 0; s < n_active; s++) mx = fmaxf(mx, ld_cluster_f32(&sm_pml[g][0], s));
            float a = 0.f, lsum = 0.f;
            for (int s = 0; s < n_active; s++) {
                const float c = exp2f(ld_cluster_f32(&sm_pml[g][0], s) - mx);
                a = fmaf(ld_cluster_f32(&sm_part[g][d], s), c, a);
                lsum = fmaf(ld_cluster_f32(&sm_pml[g][1], s), c, lsum);
            }
            decode_emit(a * (1.f / lsum), out, xq, xd, t, n_heads, HD, h0 + g, d);
        }
        if constexpr (ROPE) TL_MARK(3);
        cluster_sync_exec();  // no block leaves while its partial may still be read
        if constexpr (ROPE) TL_MARK(4);
        return;
    }

    // TAIL: merged by this launch's last blocks (decode_tail_merge).
    if constexpr (TAIL) {
        static_assert(HD == 128 && NW == 4, "TAIL: decode_merge_piece's shape");
        decode_tail_merge(part_acc, part_ml, tickets + (long long)t * gridDim.x + blockIdx.x, out, xq, xd, n_heads,
                          n_splits, n_active, t, h0, GB);
        return;
    }
    // SEP: the splits are merged by the launch after this one (attn_decode_merge).
    if constexpr (SEP) return;
    // The last of the row's n_active splits to finish (per block of heads) merges them, in
    // split order whichever block it is, and re-arms the ticket for the next launch.
    __threadfence();
    __syncthreads();
    int* ticket = tickets + (long long)t * gridDim.x + blockIdx.x;
    if (tid == 0) s_ticket = atomicAdd(ticket, 1);
    __syncthreads();
    if (s_ticket != n_active - 1) return;
    __threadfence();
    for (int g = warp; g < GB; g += NW) {
        const long long prow0 = ((long long)t * n_heads + h0 + g) * n_splits;
        float mx = ATT_NEG;
        for (int s = lane; s < n_active; s += 32) mx = fmaxf(mx, __ldcg(part_ml + 2 * (prow0 + s)));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(ATT_FULL, mx, o));
        float lsum = 0.f;
        for (int s = lane; s < n_active; s += 32) {
            const float c = exp2f(__ldcg(part_ml + 2 * (prow0 + s)) - mx);
            sm_c[g][s] = c;
            lsum += __ldcg(part_ml + 2 * (prow0 + s) + 1) * c;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(ATT_FULL, lsum, o);
        if (lane == 0) sm_inv[g] = 1.f / lsum;
    }
    __syncthreads();
    // 4 dims per thread (16-byte loads, 16 splits deep: the merge reads n_active × GB × HD
    // floats from L2 in few round trips), staged in shared memory (sm_acc is free by now)
    // for the emit, whose warps each need one whole 32-element block.
    float* sm_out = &sm_acc[0][0][0];
    for (int i4 = tid; i4 < GB * HD / 4; i4 += DECODE_THREADS) {
        const int g = (i4 * 4) / HD, d = (i4 * 4) % HD;
        const float4* pa = reinterpret_cast<const float4*>(
            part_acc + ((long long)t * n_heads + h0 + g) * n_splits * HD + d);
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 16
        for (int s = 0; s < n_active; s++) {
            const float4 v = __ldcg(pa + (long long)s * (HD / 4));
            const float c = sm_c[g][s];
            a.x = fmaf(v.x, c, a.x);
            a.y = fmaf(v.y, c, a.y);
            a.z = fmaf(v.z, c, a.z);
            a.w = fmaf(v.w, c, a.w);
        }
        const float inv = sm_inv[g];
        sm_out[4 * i4] = a.x * inv;
        sm_out[4 * i4 + 1] = a.y * inv;
        sm_out[4 * i4 + 2] = a.z * inv;
        sm_out[4 * i4 + 3] = a.w * inv;
    }
    __syncthreads();
    for (int idx = tid; idx < GB * HD; idx += DECODE_THREADS)  // whole warps per 32-block
        decode_emit(sm_out[idx], out, xq, xd, t, n_heads, HD, h0 + idx / HD, idx % HD);
    if (tid == 0) *ticket = 0;
}

#define DECODE_ARGS                                                                          \
    const float *__restrict__ q, const float *__restrict__ knew,                             \
        const float *__restrict__ vnew, unsigned char *__restrict__ kc,                      \
        unsigned char *__restrict__ vc, unsigned short *__restrict__ ks,                     \
        unsigned short *__restrict__ vs, const int *__restrict__ positions,                  \
        float *__restrict__ part_acc, float *__restrict__ part_ml, int *__restrict__ tickets, \
        float *__restrict__ out, int8_t *__restrict__ xq, float2 *__restrict__ xd,           \
        long long layer_off, int n_heads, int group, int capacity, int n_splits,             \
        int min_chunk, int pf, float scale_log2
#define DECODE_PASS                                                                          \
    q, knew, vnew, kc, vc, ks, vs, positions, part_acc, part_ml, tickets, out, xq, xd,       \
        layer_off, n_heads, group, capacity, n_splits, min_chunk, pf, scale_log2
// Contiguous cache: the step's k/v rows are stored by the decode launch itself (STORE).
// Paged: kv_store_paged runs first (knew/vnew unused).
#define DECODE_KERNEL1(NAME, HD, GB, Q8)                                                     \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) NAME(DECODE_ARGS) {        \
        attn_decode_impl<HD, GB, Q8, false, true>(DECODE_PASS, UNPAGED_PASS(capacity));     \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS)                             \
        NAME##_paged(DECODE_ARGS, PAGED_ARGS) {                                              \
        attn_decode_impl<HD, GB, Q8, true, false>(DECODE_PASS, PAGED_PASS);                 \
    }
#define DECODE_KERNEL(HD, GB)                                                                \
    DECODE_KERNEL1(attn_decode_##HD##_##GB, HD, GB, false)                                   \
    DECODE_KERNEL1(attn_decode_q8_##HD##_##GB, HD, GB, true)

DECODE_KERNEL(32, 1)
DECODE_KERNEL(32, 2)
DECODE_KERNEL(32, 4)
DECODE_KERNEL(32, 8)
DECODE_KERNEL(64, 1)
DECODE_KERNEL(64, 2)
DECODE_KERNEL(64, 4)
DECODE_KERNEL(64, 8)
DECODE_KERNEL(128, 1)
DECODE_KERNEL(128, 2)
DECODE_KERNEL(128, 4)
DECODE_KERNEL(128, 8)
DECODE_KERNEL(256, 1)
DECODE_KERNEL(256, 2)
DECODE_KERNEL(256, 4)
DECODE_KERNEL(256, 8)
// The SIMT loop at head dim 256 (Qwen3.5's gated attention) with the split merge through the
// cluster (CL, as the tensor-core forms at 128): attn_decode[_q8]_cl_256_<GB>, taken where the
// cache's split count is 2..16 (attention.rs CLUSTER_MAX_SPLITS); longer caches keep the ticket
// merge of attn_decode[_q8]_256_<GB>.
#define DECODE_CL_KERNEL(HD, GB)                                                             \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attn_decode_cl_##HD##_##GB(DECODE_ARGS) { \
        attn_decode_impl<HD, GB, false, false, true, false, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attn_decode_q8_cl_##HD##_##GB(DECODE_ARGS) { \
        attn_decode_impl<HD, GB, true, false, true, false, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }
DECODE_CL_KERNEL(256, 1)
DECODE_CL_KERNEL(256, 2)
DECODE_CL_KERNEL(256, 4)
DECODE_CL_KERNEL(256, 8)

// The tensor-core main loop (decode_tc_loop): f16 and q8_0 caches, hd 128, contiguous (the
// step's rows stored by the launch) and paged (stored by kv_store_paged before it).
#define DECODE_TC_KERNEL(GB)                                                                 \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attn_decode_tc_128_##GB(DECODE_ARGS) { \
        attn_decode_impl<128, GB, false, false, true, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attn_decode_tc_q8_128_##GB(DECODE_ARGS) { \
        attn_decode_impl<128, GB, true, false, true, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS)                             \
        attn_decode_tc_128_##GB##_paged(DECODE_ARGS, PAGED_ARGS) {                           \
        attn_decode_impl<128, GB, false, true, false, true>(DECODE_PASS, PAGED_PASS);        \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS)                             \
        attn_decode_tc_q8_128_##GB##_paged(DECODE_ARGS, PAGED_ARGS) {                        \
        attn_decode_impl<128, GB, true, true, false, true>(DECODE_PASS, PAGED_PASS);         \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attn_decode_tc_cl_128_##GB(DECODE_ARGS) { \
        attn_decode_impl<128, GB, false, false, true, true, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attn_decode_tc_q8_cl_128_##GB(DECODE_ARGS) { \
        attn_decode_impl<128, GB, true, false, true, true, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 3) attn_decode_tc_q8p_128_##GB(DECODE_ARGS) { \
        attn_decode_impl<128, GB, true, false, true, true, false, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attn_decode_tc_clp_128_##GB(DECODE_ARGS) { \
        attn_decode_impl<128, GB, false, false, true, true, true, false, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS)                             \
        attn_decode_tc_clpr_128_##GB(DECODE_ARGS, AttnRope ar) {                             \
        attn_decode_impl<128, GB, false, false, true, true, true, false, true, false, false, true>( \
            DECODE_PASS, UNPAGED_PASS(capacity), ar);                                        \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, DECODE_PRE_MINB)                            \
        attn_decode_tc_pre_128_##GB(DECODE_ARGS) {                                                           \
        attn_decode_impl<128, GB, false, false, true, true, false, false, true>(DECODE_PASS, UNPAGED_PASS(capacity)); \
    }
// The split merge as a launch of its own (FERRITE_ATTN_MERGE; ATTENTION.md, "The split merge
// as a launch of its own"), after a SEP decode launch: the ticket merge's last block merged
// every (head, dim) of its head block alone, ~47 partials of 4 heads x 128 dims read in three
// dependent rounds by 128 threads, ~8 us at depth 32768 while the other SMs idled. Here block
// (h, c, t) takes head h's dims 32 c .. 32 c + 31 of row t: warp j the splits j, j + 4, ...
// (at most 32 each: KERNEL_MAX_SPLITS), lane d one dim; every load of a thread issued at once
// (m, l and its dim's partial per split), one round trip; the block's max through shared
// memory, each warp's sums in split order, the four warps' in order, then the emit (one warp
// per 32-element block, decode_emit's quantization for the o-projection). n_active is the decode
// launch's (decode_chunk, decode_active); a row whose keys took one split was
// emitted by its block (n_active == 1: nothing to do).
// EMU_MERGE_BEGIN (host emulation: tests/attn_decode_merge_emu.rs)
extern "C" __global__ void __launch_bounds__(128)
    attn_decode_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                      const int* __restrict__ positions, float* __restrict__ out, int8_t* __restrict__ xq,
                      float2* __restrict__ xd, int n_heads, int capacity, int n_splits, int min_chunk, int step) {
    const int h = blockIdx.x, c = blockIdx.y, t = blockIdx.z;
    const int pos_t = positions[t];  // host copies, or an earlier step's argmax_feed (see attn_decode_impl)
    const int n_keys = max(0, min(pos_t + 1, capacity));
    const int n_active = decode_active(n_keys, decode_chunk(n_keys, n_splits, min_chunk, step));
    PDL_ENTRY();
    if (n_active == 1) return;
    decode_merge_piece<MERGE_MAX_PER_WARP>(part_acc, part_ml, out, xq, xd, n_heads, n_splits, n_active, t, h, c);
}
// EMU_MERGE_END

// attn_decode_tc_pre_128_<GB>: the keys-before-the-wait form with the ticket merge (caches of
// more splits than a cluster holds whose chunks are still one tile: attention.rs
// `pre_loads_fit`), held to 4 blocks per SM like the plain kernel it replaces (its split count
// assumes them).
#define DECODE_PRE_MINB 4
DECODE_TC_KERNEL(1)
DECODE_TC_KERNEL(2)
DECODE_TC_KERNEL(4)
DECODE_TC_KERNEL(8)
// The tensor-core loops past a cluster's splits — the f16 loop, the q8_0 loop with its next
// tile in flight, and the keys-before-the-wait form — leaving their splits to attn_decode_merge
// (`sep`: SEP) or merging them in their own last blocks (`tail`: TAIL, decode_tail_merge; the
// default); FERRITE_ATTN_MERGE.
#define DECODE_MERGE_FORM_KERNELS(GB, FORM, SEP, TAIL)                                       \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS)                             \
        attn_decode_tc_##FORM##_128_##GB(DECODE_ARGS) {                                      \
        attn_decode_impl<128, GB, false, false, true, true, false, false, false, SEP, TAIL>( \
            DECODE_PASS, UNPAGED_PASS(capacity));                                            \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 3)                          \
        attn_decode_tc_q8p##FORM##_128_##GB(DECODE_ARGS) {                                   \
        attn_decode_impl<128, GB, true, false, true, true, false, true, false, SEP, TAIL>(   \
            DECODE_PASS, UNPAGED_PASS(capacity));                                            \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, DECODE_PRE_MINB)            \
        attn_decode_tc_pre##FORM##_128_##GB(DECODE_ARGS) {                                   \
        attn_decode_impl<128, GB, false, false, true, true, false, false, true, SEP, TAIL>(  \
            DECODE_PASS, UNPAGED_PASS(capacity));                                            \
    }
#define DECODE_MERGE_FORMS(GB)                       \
    DECODE_MERGE_FORM_KERNELS(GB, sep, true, false)  \
    DECODE_MERGE_FORM_KERNELS(GB, tail, false, true)
DECODE_MERGE_FORMS(1)
DECODE_MERGE_FORMS(2)
DECODE_MERGE_FORMS(4)
DECODE_MERGE_FORMS(8)

// ---------------------------------------------------------------------------------------
// Prefill: causal flash attention, SIMT f32.

template <int HD, bool Q8, bool PAGED>
__device__ __forceinline__ void attn_prefill_impl(
    const float* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, const unsigned short* __restrict__ ks,
    const unsigned short* __restrict__ vs, const int* __restrict__ positions,
    float* __restrict__ out, long long layer_off, int rows, int n_heads, int group,
    int capacity, float scale_log2, PAGED_ARGS) {
    constexpr int TPQ = HD >= 256 ? 8 : 4;          // threads per query
    constexpr int BQ = PREFILL_THREADS / TPQ;       // query slots per block
    constexpr int NG = HD / (4 * TPQ);              // float4 groups per thread
    constexpr int HD4 = HD / 4;
    constexpr int BK = 4096 / HD;                   // keys per tile (K+V tiles = 32 KB f32)
    static_assert(NG >= 1 && BK % 8 == 0, "prefill head_dim");

    __shared__ float4 sk[BK * HD4];
    __shared__ float4 sv[BK * HD4];
    __shared__ int s_kmax;

    const int tid = threadIdx.x, j = tid % TPQ, qi = tid / TPQ;
    const int rpt = BQ / group;  // rows per tile (host guarantees 1 ≤ group ≤ BQ)
    const int tile = gridDim.x - 1 - blockIdx.x;  // heaviest (latest rows) first
    const int kvh = blockIdx.y;
    const int r = qi / group, gi = qi % group;
    const int t = tile * rpt + r;
    const bool valid = r < rpt && t < rows;
    const int h = kvh * group + gi;
    const int P = valid ? min(positions[t], max_keys - 1) : -1;
    // Paged: every row of the launch belongs to one sequence (the launcher's contract).
    const int* bt = row_table<PAGED>(row_seq, block_tables, bt_stride, 0);

    if (tid == 0) s_kmax = 0;
    __syncthreads();
    if (valid && j == 0) atomicMax(&s_kmax, P + 1);
    __syncthreads();
    const int kmax = s_kmax;

    float4 qv[NG], acc[NG];
#pragma unroll
    for (int c = 0; c < NG; c++) {
        acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (valid) {
            float4 a = reinterpret_cast<const float4*>(q + ((long long)t * n_heads + h) * HD)[c * TPQ + j];
            qv[c] = make_float4(a.x * scale_log2, a.y * scale_log2, a.z * scale_log2, a.w * scale_log2);
        } else {
            qv[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    float m = ATT_NEG, l = 0.f;

    const long long head_off = layer_off + (long long)kvh * capacity * HD;  // element index

    for (int k0 = 0; k0 < kmax; k0 += BK) {
        __syncthreads();  // the previous tile is consumed
        for (int i = tid; i < BK * HD / 8; i += PREFILL_THREADS) {
            const int kp = k0 + (i * 8) / HD;
            uint4 a = make_uint4(0, 0, 0, 0), b = make_uint4(0, 0, 0, 0);
            if (kp < kmax) {
                long long e;
                if constexpr (PAGED) {
                    e = kv_pos<true>(head_off, kp, HD, bt, page_shift, page_stride) + (i * 8) % HD;
                } else {
                    e = head_off + (long long)k0 * HD + i * 8;
                }
                a = load8<Q8>(kc, ks, e);
                b = load8<Q8>(vc, vs, e);
            }
            float f[8];
            unpack8x<Q8>(a, f);
            sk[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
            sk[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
            unpack8x<Q8>(b, f);
            sv[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
            sv[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
        }
        __syncthreads();
        const int nk = min(BK, kmax - k0);
        for (int kk = 0; kk < nk; kk += 8) {  // uniform across the block
            float s[8];
            float mn = m;
#pragma unroll
            for (int c8 = 0; c8 < 8; c8++) {
                const float4* kr = sk + (kk + c8) * HD4 + j;
                float d = 0.f;
#pragma unroll
                for (int c = 0; c < NG; c++) {
                    float4 kf = kr[c * TPQ];
                    d = fmaf(qv[c].x, kf.x, d);
                    d = fmaf(qv[c].y, kf.y, d);
                    d = fmaf(qv[c].z, kf.z, d);
                    d = fmaf(qv[c].w, kf.w, d);
                }
#pragma unroll
                for (int o = TPQ / 2; o > 0; o >>= 1) d += __shfl_xor_sync(ATT_FULL, d, o);
                s[c8] = (k0 + kk + c8 <= P) ? d : ATT_NEG;
                mn = fmaxf(mn, s[c8]);
            }
            const float corr = exp2f(m - mn);
            l *= corr;
#pragma unroll
            for (int c = 0; c < NG; c++) {
                acc[c].x *= corr; acc[c].y *= corr; acc[c].z *= corr; acc[c].w *= corr;
            }
            m = mn;
#pragma unroll
            for (int c8 = 0; c8 < 8; c8++) {
                const float p = (k0 + kk + c8 <= P) ? exp2f(s[c8] - m) : 0.f;
                l += p;
                const float4* vr = sv + (kk + c8) * HD4 + j;
#pragma unroll
                for (int c = 0; c < NG; c++) {
                    float4 vf = vr[c * TPQ];
                    acc[c].x = fmaf(p, vf.x, acc[c].x);
                    acc[c].y = fmaf(p, vf.y, acc[c].y);
                    acc[c].z = fmaf(p, vf.z, acc[c].z);
                    acc[c].w = fmaf(p, vf.w, acc[c].w);
                }
            }
        }
    }
    if (valid) {
        const float inv = 1.f / l;
        float4* o = reinterpret_cast<float4*>(out + ((long long)t * n_heads + h) * HD);
#pragma unroll
        for (int c = 0; c < NG; c++)
            o[c * TPQ + j] = make_float4(acc[c].x * inv, acc[c].y * inv, acc[c].z * inv, acc[c].w * inv);
    }
}

#define PREFILL_ARGS                                                                         \
    const float *__restrict__ q, const unsigned char *__restrict__ kc,                       \
        const unsigned char *__restrict__ vc, const unsigned short *__restrict__ ks,         \
        const unsigned short *__restrict__ vs, const int *__restrict__ positions,            \
        float *__restrict__ out, long long layer_off, int rows, int n_heads, int group,      \
        int capacity, float scale_log2
#define PREFILL_KERNEL1(NAME, HD, Q8)                                                        \
    extern "C" __global__ void __launch_bounds__(PREFILL_THREADS) NAME(PREFILL_ARGS) {      \
        PDL_ENTRY();                                                                        \
        attn_prefill_impl<HD, Q8, false>(q, kc, vc, ks, vs, positions, out, layer_off, rows, \
                                         n_heads, group, capacity, scale_log2,              \
                                         UNPAGED_PASS(capacity));                           \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)                            \
        NAME##_paged(PREFILL_ARGS, PAGED_ARGS) {                                             \
        PDL_ENTRY();                                                                         \
        attn_prefill_impl<HD, Q8, true>(q, kc, vc, ks, vs, positions, out, layer_off, rows,  \
                                        n_heads, group, capacity, scale_log2, PAGED_PASS);  \
    }
#define PREFILL_KERNEL(HD)                                                                   \
    PREFILL_KERNEL1(attn_prefill_##HD, HD, false)                                            \
    PREFILL_KERNEL1(attn_prefill_q8_##HD, HD, true)

PREFILL_KERNEL(32)
PREFILL_KERNEL(64)
PREFILL_KERNEL(128)
PREFILL_KERNEL(256)

// ---------------------------------------------------------------------------------------
// Prefill on the tensor cores (f16 cache): causal flash attention with mma.sync.
//
// The plan (FlashAttention-2 on mma.sync m16n8k16 f16 → f32):
// - grid (query tiles, n_kv_heads), TC_THREADS = 128 = 4 warps. A block's 64 query slots are
//   (row, head of the GQA group) pairs, row-major as in the SIMT kernel (64/group rows × every
//   head of the group), so each K/V tile in shared memory serves the whole group; warp w owns
//   slots 16w..16w+15 (the m16 of its MMAs). Tiles are launched heaviest-first.
// - q is scaled by scale·log2(e), rounded to f16 into shared memory once ([64][HD + 8]: the
//   8-half pad staggers rows by 16 B so ldmatrix reads are conflict-free); a warp reloads its
//   A fragments from there (ldmatrix.x4) for every key tile — cheaper than holding HD/16 × 4
//   registers through the loop, and the same code serves HD = 256.
// - K/V tiles of BKV keys (64, 32 for HD = 256) stream in by cp.async (16 B per copy, keys
//   past the block's bound zero-filled so masked p = 0 never meets a NaN), double-buffered:
//   tile i+1 is in flight while tile i is computed; one barrier pair per tile.
// - S = Q·Kᵀ: the cache's [pos][hd] rows are the "col" B operand as they are (ldmatrix, no
//   transpose); masking per (row, key) from the rows' device positions; online softmax in
//   base 2 per row, each thread holding rows g and g+8 of its warp's 16 (row maxima by two
//   xor-shuffles across the quad; the running sums l stay per-thread partials, reduced once
//   at the end — the correction factors are uniform across the quad).
// - O += P·V: P's f32 accumulators are the A fragment of the next MMA after packing to f16
//   (the C layout of two n-tiles is the A layout of one k16 step); V [pos][hd] is k-major, so
//   its B fragments come from ldmatrix.trans. O is HD/8 n-tiles × 4 f32 per thread.
// - attn_prefill_tc2_<hd> (G = 2, 256 threads, the default for f16 caches up to hd 128): two
//   groups of 4 warps over the same 64 slots, group g taking key tiles g, g + 2, ... one at a
//   time into its own buffer (the double buffer's halves), then one merge of the two softmax
//   states through shared memory (below the loop; ATTENTION.md 53rd session).
// Bytes: each block reads its kv head's K and V rows 0..bound once (L2 serves the other
// query tiles of the head). Work per warp and 64-key tile at HD = 128: 128 MMAs (64 for S, 64
// for P·V), 8 + 32 + 32 ldmatrix.x4.
// Precision: q and P rounded to f16 (relative 2⁻¹¹, like the cache's K and V), f32
// accumulation: attention NMSE ~1e-7 against the f32 CPU oracle, as the SIMT kernel.
// Keys are summed in tile order, 16 at a time inside an MMA, not one by one as on the CPU.
//
// q8_0 caches (attn_prefill_tc_q8_<hd>): the same MMAs over f16 tiles, which the block makes
// itself. The int8 rows and their f16 scales (one per 32) stream in by cp.async into raw
// stages, double-buffered as the f16 tiles are (a key row: HD / 16 16-byte copies and one
// HD / 16-byte copy of its scales); once a stage has landed the block dequantizes it into a
// single f16 K/V tile (q8_dequant8: b·d rounded once to f16, as the tensor-core decode loop
// does), a barrier, then the f16 code above unchanged. One f16 tile suffices: the next
// conversion starts after the barrier that ends this tile's MMAs. Shared memory is the f16
// kernel's (raw stages of 1.0625 B/element instead of the second f16 buffer). The extra work
// per 64-key tile at HD = 128: 16 conversions of 8 values per thread, one barrier. Why:
// the SIMT prefill was what a q8_0 cache took (704 tok/s at depth 32768 for Qwen3-8B).

#define TC_THREADS 128
#define TC_SLOTS 64

// Keys per K/V tile and the shared-memory bytes of a block (attention.rs tc_smem mirrors it):
// f16, q [64][LDS] + K and V [2][BKV][LDS] halves; q8_0, q + one f16 K and V tile + the raw
// stages [2][K, V][BKV][HD] int8 and [2][K, V][BKV][HD / 32] f16 scales.
template <int HD, bool Q8 = false>
struct TcShape {
    static constexpr int BKV = HD >= 256 ? 32 : 64;
    static constexpr int LDS = HD + 8;  // halves per shared row
    static constexpr int F16_BYTES = 2 * (TC_SLOTS + (Q8 ? 2 : 4) * BKV) * LDS;
    static constexpr int RAW_BYTES = Q8 ? 4 * BKV * (HD + HD / 16) : 0;
    static constexpr int SMEM = F16_BYTES + RAW_BYTES;
};

// cp.async of N = 4, 8 or 16 bytes (src_bytes < N: the rest zero-filled); through L1 (.ca:
// the only form for N < 16).
template <int N>
__device__ __forceinline__ void cp_async_n(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes)
                 : "memory");
}

// XO (the tc2 kernels' `_x16` forms, attention.rs prefill_x16): the output also written as the
// o-projection's 16-bit x rows into `xo` ([rows][n_heads · HD], the prefill matmuls' x scratch),
// rounded as their conversion launch rounds it: 1 bf16 (pack_bf16, mm_x_bf16), 2 f16
// (pack_f16_sat, mmw_x_f16); the o-projection then skips that launch (matmul.rs XbState). In
// those forms `out` may be null: the o-projection alone reads the output, from xo (attention.rs
// `out_readers`), and its f32 rows (two thirds of the output's bytes) are not written.
template <int HD, bool Q8, bool PAGED, int G = 1, int XO = 0>
__device__ __forceinline__ void attn_prefill_tc_impl(
    const float* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, const unsigned short* __restrict__ ks,
    const unsigned short* __restrict__ vs, const int* __restrict__ positions,
    float* __restrict__ out, long long layer_off, int rows, int n_heads, int group,
    int capacity, float scale_log2, PAGED_ARGS, unsigned short* __restrict__ xo = nullptr) {
    using S = TcShape<HD, Q8>;
    static_assert(G == 1 || (G == 2 && !Q8), "attn_prefill_tc: two key groups on f16 caches only");
    constexpr int BKV = S::BKV, LDS = S::LDS;
    constexpr int NS = BKV / 8;   // S n-tiles (8 keys) per warp
    constexpr int NO = HD / 8;    // O n-tiles (8 dims) per warp
    constexpr int CPR = HD / 8;   // 16-B chunks per cached row
    extern __shared__ __align__(16) unsigned char tc_smem[];
    __half* sQ = reinterpret_cast<__half*>(tc_smem);
    constexpr int NBUF = Q8 ? 1 : 2;      // f16 K/V tiles (q8_0: one, made from the raw stages)
    __half* sK = sQ + TC_SLOTS * LDS;     // [NBUF][BKV][LDS]
    __half* sV = sK + NBUF * BKV * LDS;   // [NBUF][BKV][LDS]
    // q8_0 raw stages: [2][K, V][BKV][HD] int8, then [2][K, V][BKV][HD / 32] f16 scales.
    unsigned char* raw = tc_smem + S::F16_BYTES;
    unsigned short* raw_sc = reinterpret_cast<unsigned short*>(raw + 4 * BKV * HD);
    __shared__ int s_pos[TC_SLOTS];
    __shared__ int s_kmax;

    const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
    // G = 2: key group kg (threads kg · 128 ..) takes the key tiles kg, kg + 2, ...; gtid is a
    // thread's index in its group (G = 1: the block's).
    const int kg = G == 2 ? tid >> 7 : 0, gtid = tid & (TC_THREADS - 1);
    const int g = lane >> 2, t4 = lane & 3;
    const int rpt = TC_SLOTS / group;  // rows per tile (host guarantees 1 ≤ group ≤ 64)
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int kvh = blockIdx.y;
    const int* bt = row_table<PAGED>(row_seq, block_tables, bt_stride, 0);

    if (tid == 0) s_kmax = 0;
    __syncthreads();
    if (tid < TC_SLOTS) {
        const int r = tid / group, t = tile * rpt + r;
        const int P = (r < rpt && t < rows) ? min(positions[t], max_keys - 1) : -1;
        s_pos[tid] = P;
        if (P >= 0) atomicMax(&s_kmax, P + 1);
    }
    // q → f16 (pre-scaled), one float4 per step; invalid slots are zeros.
    for (int i = tid; i < TC_SLOTS * HD / 4; i += G * TC_THREADS) {
        const int slot = i / (HD / 4), c = (i % (HD / 4)) * 4;
        const int r = slot / group, gi = slot % group, t = tile * rpt + r;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < rpt && t < rows)
            a = *reinterpret_cast<const float4*>(q + ((long long)t * n_heads + kvh * group + gi) * HD + c);
        uint2 h;
        h.x = tc_pack_f16(a.x * scale_log2, a.y * scale_log2);
        h.y = tc_pack_f16(a.z * scale_log2, a.w * scale_log2);
        *reinterpret_cast<uint2*>(sQ + slot * LDS + c) = h;
    }
    __syncthreads();
    const int kmax = s_kmax;
    const int n_tiles = (kmax + BKV - 1) / BKV;
    const int P0 = s_pos[warp * 16 + g], P1 = s_pos[warp * 16 + g + 8];
    int wmax = max(P0, P1);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) wmax = max(wmax, __shfl_xor_sync(ATT_FULL, wmax, o));

    const long long head_off = layer_off + (long long)kvh * capacity * HD;
    const unsigned short* kbase = reinterpret_cast<const unsigned short*>(kc);
    const unsigned short* vbase = reinterpret_cast<const unsigned short*>(vc);
    const uint32_t sK0 = (uint32_t)__cvta_generic_to_shared(sK);
    const uint32_t sV0 = (uint32_t)__cvta_generic_to_shared(sV);
    const uint32_t sQ0 = (uint32_t)__cvta_generic_to_shared(sQ);

    // Element index of key p's row + col, and the bytes of a copy of n there (0 past the
    // block's key bound: zero-filled, from a valid address).
    auto key_src = [&](int p, int col, int n, long long& e) -> int {
        e = head_off;
        int bytes = 0;
        if (p < kmax) {
            e = kv_pos<PAGED>(head_off, p, HD, bt, page_shift, page_stride) + col;
            bytes = n;
        }
        return bytes;
    };
    auto load_tile = [&](int it) {
        const int k0 = it * BKV, buf = it & 1;
        if constexpr (Q8) {
            // Int8 rows: HD / 16 16-byte copies each; scales: one HD / 16-byte copy per row
            // (a row's HD / 32 scales are contiguous at element / 32 and aligned to their size).
            constexpr int QCPR = HD / 16;
            const uint32_t rk = (uint32_t)__cvta_generic_to_shared(raw + buf * 2 * BKV * HD);
            for (int c = tid; c < BKV * QCPR; c += TC_THREADS) {
                const int kr = c / QCPR, col = (c % QCPR) * 16;
                long long e;
                const int bytes = key_src(k0 + kr, col, 16, e);
                const uint32_t off = (uint32_t)(kr * HD + col);
                cp_async16(rk + off, kc + e, bytes);
                cp_async16(rk + BKV * HD + off, vc + e, bytes);
            }
            const uint32_t rs = (uint32_t)__cvta_generic_to_shared(raw_sc + buf * 2 * BKV * (HD / 32));
            for (int kr = tid; kr < BKV; kr += TC_THREADS) {
                long long e;
                const int bytes = key_src(k0 + kr, 0, HD / 16, e);
                const uint32_t off = (uint32_t)(kr * (HD / 16));
                cp_async_n<HD / 16>(rs + off, ks + e / 32, bytes);
                cp_async_n<HD / 16>(rs + BKV * (HD / 16) + off, vs + e / 32, bytes);
            }
            asm volatile("cp.async.commit_group;\n" ::: "memory");
            return;
        }
        // G = 2: each group's own (single) buffer, filled by its threads.
        const int fb = G == 2 ? kg : buf;
        for (int c = gtid; c < BKV * CPR; c += TC_THREADS) {
            const int kr = c / CPR, col = (c % CPR) * 8;
            long long e;
            const int bytes = key_src(k0 + kr, col, 16, e);
            const uint32_t off = (uint32_t)((fb * BKV + kr) * LDS + col) * 2;
            cp_async16(sK0 + off, kbase + e, bytes);
            cp_async16(sV0 + off, vbase + e, bytes);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    // q8_0: raw stage `buf` (landed, after a barrier) → the f16 tile, 8 values per step.
    auto dequant_tile = [&](int buf) {
        constexpr int CH = BKV * HD / 8;  // 8-value chunks per tensor
        const unsigned char* rk = raw + buf * 2 * BKV * HD;
        const unsigned short* rs = raw_sc + buf * 2 * BKV * (HD / 32);
        for (int c = tid; c < 2 * CH; c += TC_THREADS) {
            const int m = c / CH, i = c % CH;  // m: 0 K, 1 V
            const int kr = i / (HD / 8), col = (i % (HD / 8)) * 8;
            const uint2 qv = *reinterpret_cast<const uint2*>(rk + m * BKV * HD + kr * HD + col);
            const uint32_t d = rs[m * BKV * (HD / 32) + kr * (HD / 32) + col / 32];
            *reinterpret_cast<uint4*>((m ? sV : sK) + kr * LDS + col) = q8_dequant8(qv, d | (d << 16));
        }
    };

    float o_acc[NO][4];
#pragma unroll
    for (int j = 0; j < NO; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) o_acc[j][c] = 0.f;
    float m0 = ATT_NEG, m1 = ATT_NEG, l0 = 0.f, l1 = 0.f;

    // ldmatrix lane addresses (bytes, buffer 0): A (q rows of the warp), B (key rows, no
    // transpose: lanes 0-7 keys 0-7 dims +0, 8-15 keys 0-7 dims +8, 16-31 keys 8-15), V (trans:
    // lanes 0-15 keys 0-15 dims +0, 16-31 keys 0-15 dims +8).
    const uint32_t qa = sQ0 + ((warp * 16 + (lane & 15)) * LDS + (lane >> 4) * 8) * 2;
    const uint32_t kb = ((lane & 7) + ((lane >> 4) << 3)) * LDS * 2 + ((lane >> 3) & 1) * 16;
    const uint32_t vb = (lane & 15) * LDS * 2 + (lane >> 4) * 16;

    // G = 1: tile it + 1 in flight while tile it is computed, one barrier pair a tile. G = 2:
    // each group its tiles one at a time in its own buffer, on its own named barrier (1 + kg);
    // the other group's warps (and the other block's) cover the copy's latency.
    if (G == 1 && n_tiles > 0) load_tile(0);
    for (int it = kg; it < n_tiles; it += G) {
        if constexpr (G == 2) {
            load_tile(it);
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
            asm volatile("bar.sync %0, %1;\n" ::"r"(1 + kg), "n"(TC_THREADS) : "memory");
        } else {
            if (it + 1 < n_tiles) {
                load_tile(it + 1);
                asm volatile("cp.async.wait_group 1;\n" ::: "memory");
            } else {
                asm volatile("cp.async.wait_group 0;\n" ::: "memory");
            }
            __syncthreads();
        }
        if constexpr (Q8) {
            dequant_tile(it & 1);
            __syncthreads();
        }
        const int k0 = it * BKV;
        if (k0 <= wmax) {  // warp-uniform: some row of this warp sees keys of this tile
            const int buf = Q8 ? 0 : (G == 2 ? kg : it & 1);
            const uint32_t kt = sK0 + buf * BKV * LDS * 2 + kb;
            const uint32_t vt = sV0 + buf * BKV * LDS * 2 + vb;
            float s[NS][4];
#pragma unroll
            for (int j = 0; j < NS; j++)
#pragma unroll
                for (int c = 0; c < 4; c++) s[j][c] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint32_t a0, a1, a2, a3;
                ldsm_x4(qa + kk * 32, a0, a1, a2, a3);
#pragma unroll
                for (int nj = 0; nj < NS / 2; nj++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(kt + nj * 16 * LDS * 2 + kk * 32, b0, b1, b2, b3);
                    tc_mma_f16(s[2 * nj], a0, a1, a2, a3, b0, b1);
                    tc_mma_f16(s[2 * nj + 1], a0, a1, a2, a3, b2, b3);
                }
            }
            // Mask, row maxima, online-softmax rescale.
            float mx0 = m0, mx1 = m1;
#pragma unroll
            for (int j = 0; j < NS; j++) {
                const int key = k0 + j * 8 + 2 * t4;
                s[j][0] = key <= P0 ? s[j][0] : ATT_NEG;
                s[j][1] = key + 1 <= P0 ? s[j][1] : ATT_NEG;
                s[j][2] = key <= P1 ? s[j][2] : ATT_NEG;
                s[j][3] = key + 1 <= P1 ? s[j][3] : ATT_NEG;
                mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
                mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
            }
#pragma unroll
            for (int o = 1; o < 4; o <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(ATT_FULL, mx0, o));
                mx1 = fmaxf(mx1, __shfl_xor_sync(ATT_FULL, mx1, o));
            }
            const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
            m0 = mx0;
            m1 = mx1;
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int j = 0; j < NO; j++) {
                o_acc[j][0] *= c0;
                o_acc[j][1] *= c0;
                o_acc[j][2] *= c1;
                o_acc[j][3] *= c1;
            }
#pragma unroll
            for (int j = 0; j < NS; j++) {
                const int key = k0 + j * 8 + 2 * t4;
                s[j][0] = key <= P0 ? exp2f(s[j][0] - m0) : 0.f;
                s[j][1] = key + 1 <= P0 ? exp2f(s[j][1] - m0) : 0.f;
                s[j][2] = key <= P1 ? exp2f(s[j][2] - m1) : 0.f;
                s[j][3] = key + 1 <= P1 ? exp2f(s[j][3] - m1) : 0.f;
                l0 += s[j][0] + s[j][1];
                l1 += s[j][2] + s[j][3];
            }
            // O += P·V, 16 keys per MMA step.
#pragma unroll
            for (int kj = 0; kj < BKV / 16; kj++) {
                const uint32_t a0 = tc_pack_f16(s[2 * kj][0], s[2 * kj][1]);
                const uint32_t a1 = tc_pack_f16(s[2 * kj][2], s[2 * kj][3]);
                const uint32_t a2 = tc_pack_f16(s[2 * kj + 1][0], s[2 * kj + 1][1]);
                const uint32_t a3 = tc_pack_f16(s[2 * kj + 1][2], s[2 * kj + 1][3]);
#pragma unroll
                for (int dn = 0; dn < HD / 16; dn++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(vt + kj * 16 * LDS * 2 + dn * 32, b0, b1, b2, b3);
                    tc_mma_f16(o_acc[2 * dn], a0, a1, a2, a3, b0, b1);
                    tc_mma_f16(o_acc[2 * dn + 1], a0, a1, a2, a3, b2, b3);
                }
            }
        }
        // Tile it's buffer is free for tile it + 2 (G = 2: for the group's next tile).
        if constexpr (G == 2) {
            asm volatile("bar.sync %0, %1;\n" ::"r"(1 + kg), "n"(TC_THREADS) : "memory");
        } else {
            __syncthreads();
        }
    }
    if constexpr (G == 2) {
        // The two groups' partial softmax states merged: group 1 leaves its m, l (per-thread
        // partial sums) and O accumulators in shared memory, group 0 rescales both to the
        // larger maximum and adds (a group without keys: m = ATT_NEG, weight exp2 → 0). A
        // thread's partner is the group-1 thread of the same warp index and lane: the same
        // slots and fragment.
        // The K and V tiles' region (both groups are past their last tile at the barrier):
        // O as [warp][n-tile][4][lane] (64 · HD floats), then m, l as [warp][4][lane].
        float* xo = reinterpret_cast<float*>(sK);
        static_assert((TC_SLOTS * HD + 4 * 4 * 32) * 4 <= 4 * BKV * LDS * 2,
                      "attn_prefill_tc: the merge's floats fit the K and V tiles");
        float* xml = xo + 4 * NO * 4 * 32;
        __syncthreads();
        if (kg == 1) {
#pragma unroll
            for (int j = 0; j < NO; j++)
#pragma unroll
                for (int c = 0; c < 4; c++) xo[((warp * NO + j) * 4 + c) * 32 + lane] = o_acc[j][c];
            xml[(warp * 4 + 0) * 32 + lane] = m0;
            xml[(warp * 4 + 1) * 32 + lane] = m1;
            xml[(warp * 4 + 2) * 32 + lane] = l0;
            xml[(warp * 4 + 3) * 32 + lane] = l1;
        }
        __syncthreads();
        if (kg == 1) return;
        const float mb0 = xml[(warp * 4 + 0) * 32 + lane], mb1 = xml[(warp * 4 + 1) * 32 + lane];
        const float lb0 = xml[(warp * 4 + 2) * 32 + lane], lb1 = xml[(warp * 4 + 3) * 32 + lane];
        const float n0 = fmaxf(m0, mb0), n1 = fmaxf(m1, mb1);
        const float a0 = exp2f(m0 - n0), b0 = exp2f(mb0 - n0), a1 = exp2f(m1 - n1), b1 = exp2f(mb1 - n1);
        l0 = l0 * a0 + lb0 * b0;
        l1 = l1 * a1 + lb1 * b1;
#pragma unroll
        for (int j = 0; j < NO; j++) {
            const float* p = xo + (warp * NO + j) * 4 * 32 + lane;
            o_acc[j][0] = o_acc[j][0] * a0 + p[0] * b0;
            o_acc[j][1] = o_acc[j][1] * a0 + p[32] * b0;
            o_acc[j][2] = o_acc[j][2] * a1 + p[64] * b1;
            o_acc[j][3] = o_acc[j][3] * a1 + p[96] * b1;
        }
    }

#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        l0 += __shfl_xor_sync(ATT_FULL, l0, o);
        l1 += __shfl_xor_sync(ATT_FULL, l1, o);
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int slot = warp * 16 + g + 8 * half;
        if ((half ? P1 : P0) < 0) continue;
        const int r = slot / group, gi = slot % group, t = tile * rpt + r;
        const float inv = 1.f / (half ? l1 : l0);
        const long long oi = ((long long)t * n_heads + kvh * group + gi) * HD + 2 * t4;
        float* o = out + oi;
#pragma unroll
        for (int j = 0; j < NO; j++) {
            const float v0 = o_acc[j][2 * half] * inv, v1 = o_acc[j][2 * half + 1] * inv;
            if (XO == 0 || out != nullptr) *reinterpret_cast<float2*>(o + j * 8) = make_float2(v0, v1);
            if constexpr (XO != 0)
                *reinterpret_cast<uint32_t*>(xo + oi + j * 8) = XO == 2 ? pack_f16_sat(v0, v1) : pack_bf16(v0, v1);
        }
    }
}

#define PREFILL_TC_KERNEL1(NAME, HD, Q8)                                                     \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) NAME(PREFILL_ARGS) {            \
        PDL_ENTRY();                                                                         \
        attn_prefill_tc_impl<HD, Q8, false>(q, kc, vc, ks, vs, positions, out, layer_off,    \
                                            rows, n_heads, group, capacity, scale_log2,      \
                                            UNPAGED_PASS(capacity));                         \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) NAME##_paged(PREFILL_ARGS, PAGED_ARGS) { \
        PDL_ENTRY();                                                                         \
        attn_prefill_tc_impl<HD, Q8, true>(q, kc, vc, ks, vs, positions, out, layer_off,     \
                                           rows, n_heads, group, capacity, scale_log2,       \
                                           PAGED_PASS);                                      \
    }
// attn_prefill_tc2_<hd> (FERRITE_ATTN_TC2, on by default): the f16 kernel with two key groups of 4 warps
// (G = 2): at 128 threads a pp512 launch of Qwen3-8B was 256 blocks of 4 warps, 11% occupancy,
// 1.06 instructions a cycle, its heaviest blocks 8 key tiles in a row (ncu, ATTENTION.md 53rd
// session); two groups halve that chain and double the warps, at ≤ 128 registers (two
// 256-thread blocks an SM, as the shared memory allows).
// `_xbf16` / `_xf16`: the same with the output also as the o-projection's 16-bit x (XO above;
// XARG / XPASS the extra parameter and its pass, or TC2_NONE).
#define TC2_NONE
#define TC2_XO_ARG , unsigned short* __restrict__ xo
#define TC2_XO_PASS , xo
#define PREFILL_TC2_KERNEL1(NAME, HD, XO, XARG, XPASS)                                      \
    extern "C" __global__ void __launch_bounds__(2 * TC_THREADS, 2) NAME(PREFILL_ARGS XARG) { \
        PDL_ENTRY();                                                                         \
        attn_prefill_tc_impl<HD, false, false, 2, XO>(q, kc, vc, ks, vs, positions, out, layer_off, \
                                                      rows, n_heads, group, capacity, scale_log2, \
                                                      UNPAGED_PASS(capacity) XPASS);         \
    }
#define PREFILL_TC2_KERNEL(HD)                                                               \
    PREFILL_TC2_KERNEL1(attn_prefill_tc2_##HD, HD, 0, TC2_NONE, TC2_NONE)                    \
    PREFILL_TC2_KERNEL1(attn_prefill_tc2_##HD##_xbf16, HD, 1, TC2_XO_ARG, TC2_XO_PASS)       \
    PREFILL_TC2_KERNEL1(attn_prefill_tc2_##HD##_xf16, HD, 2, TC2_XO_ARG, TC2_XO_PASS)
#define PREFILL_TC_KERNEL(HD)                                                                \
    PREFILL_TC_KERNEL1(attn_prefill_tc_##HD, HD, false)                                      \
    PREFILL_TC_KERNEL1(attn_prefill_tc_q8_##HD, HD, true)

PREFILL_TC_KERNEL(64)
PREFILL_TC_KERNEL(128)
PREFILL_TC_KERNEL(256)
// Not at 256: its 128 accumulators a thread spill under the 128-register ceiling.
PREFILL_TC2_KERNEL(64)
PREFILL_TC2_KERNEL(128)

// ---------------------------------------------------------------------------------------
// Fallback: any head_dim ≤ 512. Grid (ceil(n_heads/4), rows), 128 threads: a warp per head.

#define GENERIC_ARGS                                                                         \
    const float *__restrict__ q, const unsigned char *__restrict__ kc,                       \
        const unsigned char *__restrict__ vc, const unsigned short *__restrict__ ks,         \
        const unsigned short *__restrict__ vs, int q8, const int *__restrict__ positions,    \
        float *__restrict__ out, long long layer_off, int n_heads, int group, int hd,        \
        int capacity, float scale_log2

template <bool PAGED>
__device__ __forceinline__ void attn_generic_impl(GENERIC_ARGS, PAGED_ARGS) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.x * 4 + warp, t = blockIdx.y;
    if (h >= n_heads) return;  // whole warp; no block-level synchronisation below
    const int kvh = h / group;
    const int P = min(positions[t], max_keys - 1);
    const int* bt = row_table<PAGED>(row_seq, block_tables, bt_stride, t);
    const float* qr = q + ((long long)t * n_heads + h) * hd;
    float qv[16], acc[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int d = lane + 32 * i;
        qv[i] = d < hd ? qr[d] * scale_log2 : 0.f;
        acc[i] = 0.f;
    }
    const long long head_off = layer_off + (long long)kvh * capacity * hd;
    float m = ATT_NEG, l = 0.f;
    for (int p = 0; p <= P; p++) {
        const long long row = kv_pos<PAGED>(head_off, p, hd, bt, page_shift, page_stride);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int d = lane + 32 * i;
            if (d < hd) s = fmaf(qv[i], kv_elem(kc, ks, row + d, q8), s);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(ATT_FULL, s, o);
        const float mn = fmaxf(m, s);
        const float corr = exp2f(m - mn), pr = exp2f(s - mn);
        l = l * corr + pr;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int d = lane + 32 * i;
            const float vv = d < hd ? kv_elem(vc, vs, row + d, q8) : 0.f;
            acc[i] = fmaf(pr, vv, acc[i] * corr);
        }
        m = mn;
    }
    const float inv = 1.f / l;
    float* o = out + ((long long)t * n_heads + h) * hd;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int d = lane + 32 * i;
        if (d < hd) o[d] = acc[i] * inv;
    }
}

extern "C" __global__ void __launch_bounds__(128) attn_generic(GENERIC_ARGS) {
    PDL_ENTRY();
    attn_generic_impl<false>(q, kc, vc, ks, vs, q8, positions, out, layer_off, n_heads, group,
                             hd, capacity, scale_log2, UNPAGED_PASS(capacity));
}

extern "C" __global__ void __launch_bounds__(128) attn_generic_paged(GENERIC_ARGS, PAGED_ARGS) {
    PDL_ENTRY();
    attn_generic_impl<true>(q, kc, vc, ks, vs, q8, positions, out, layer_off, n_heads, group,
                            hd, capacity, scale_log2, PAGED_PASS);
}
