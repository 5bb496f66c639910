// mmw.cu — prefill matmul on the Hopper warpgroup tensor cores (wgmma, sm_90a):
// out[t][o] = Σ_i W[o][i] · x[t][i] for rows > GEMV_MAX_ROWS, any weight type the bf16 `mm_`
// kernel of matmul.cu takes, with the same numerics (x and the dequantized weights rounded
// to bf16, f32 accumulation; only the order of the f32 additions inside a K step differs).
//
// Why (MATMUL.md round 13): the mma.sync kernel `mm_` runs at ~200 TFLOP/s on the H200 (ncu,
// q4_K 4096² × 512 rows: 8 warps per SM, tensor pipe 34% active, stalls on fixed-latency
// waits, the shared-memory pipe (ldmatrix: 96 KB per K step per SM) and barriers). wgmma reads
// both operands from shared memory without the register file, one B tile serving a
// warpgroup's 64 rows, and runs asynchronously to the threads that feed it. Measured: Qwen3-8B
// Q4_K_M pp512 10,476 (mm_) → 16,591 tok/s.
//
// The plan, per block (tile TM outputs × BN tokens: 128 × 128, 128 × 64, or 64 × 256):
// - Warpgroups 0 and 1 produce: per K step of 64 they decode the TM weight rows' 64 elements
//   to bf16 (256 / TM threads per row, 16-element chunks; the raw bytes loaded MMW_RAW steps
//   ahead into registers, after the step's proxy fence (see `step`); the decoders are
//   matmul.cu's raw16/dec16) into the stage's A tile, and copy the x tile (BN tokens × 64 bf16
//   of the bf16 scratch) MMW_XLEAD steps ahead by cp.async.
// - TM / 64 consumer warpgroups: each owns 64 of the outputs and issues per stage four
//   `wgmma.mma_async m64nBNk16` (A and B from shared memory by descriptor), accumulating BN / 2
//   f32 per thread; the next stage's MMAs are issued before the previous stage is released
//   (wgmma.wait_group 1). 64 × 256 (one consumer warpgroup, m64n256) halves the decode per
//   FLOP: the long prefills' full grids take it.
// - A ring of as many stages as fit 224 KB (≤ 7); named barriers per stage: FULL (producers
//   arrive after their writes are fenced to the async proxy, consumers sync) and EMPTY
//   (consumers arrive once their MMAs of the stage completed, the producers sync).
// - Shared layout of a tile [R rows][64 k] bf16: the 128-byte swizzle K-major layout (a row's
//   64 elements one 128-byte line, 16-byte chunk j at position j ^ (row % 8)); a warp's
//   16-byte stores of 8 consecutive rows at one chunk index cover all 32 banks. The
//   no-swizzle layouts tried first ran no faster than mm_ (MATMUL.md round 13).
// - Grid (token tiles, output tiles of up to three weights: MMW_KERNEL1), token tiles fastest
//   (blocks sharing a weight tile run together: weights come from DRAM about once). Edges as
//   `mm_`: token rows >= rows are zero-filled and not stored, output rows >= n_out read a
//   clamped row and are not stored, K beyond n_in is zero in x (the scratch's padding) and in
//   the decoded weights.

#define MMW_TK 64
#define MMW_XLEAD 3                         // steps the x copies run ahead of the decode
#define MMW_PRODUCERS 2                     // producer warpgroups
#define MMW_PTHREADS (128 * MMW_PRODUCERS)  // producer threads: 256 / TM per output row
#define MMW_THREADS(TM) (MMW_PTHREADS + 2 * (TM))  // + TM / 64 consumer warpgroups
#define MMW_RAW 2                           // steps of raw weight bytes in flight per thread

// ---- matmul.cu's bf16 decoders (copied verbatim; the two must stay identical) ----
__device__ __forceinline__ float h2f(uint16_t u) { return __half2float(__ushort_as_half(u)); }
__device__ __forceinline__ float b2f(uint16_t u) { return __uint_as_float((uint32_t)u << 16); }

// Byte k (0..3) of w, which must be < 256 as an unsigned value, as an exact float plus 2^23.
// (prmt builds the bits 0x4B0000bb = 8388608 + bb.)
template <int K>
__device__ __forceinline__ float byte_f(uint32_t w) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + K)) - 8388608.0f;
}

// Byte k of the 12 K-quant scale bytes held in three words.
__device__ __forceinline__ uint32_t sbyte(uint32_t s0, uint32_t s1, uint32_t s2, int k) {
    uint32_t w = k < 4 ? s0 : (k < 8 ? s1 : s2);
    return (w >> ((k & 3) * 8)) & 0xFF;
}

// ggml's get_scale_min_k4 from the scale words.
__device__ __forceinline__ void scale_min_w(int j, uint32_t s0, uint32_t s1, uint32_t s2, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(sbyte(s0, s1, s2, j) & 63);
        *m = (float)(sbyte(s0, s1, s2, j + 4) & 63);
    } else {
        uint32_t a = sbyte(s0, s1, s2, j + 4), lo = sbyte(s0, s1, s2, j - 4), hi = sbyte(s0, s1, s2, j);
        *sc = (float)((a & 0xF) | ((lo >> 6) << 4));
        *m = (float)((a >> 4) | ((hi >> 6) << 4));
    }
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // .x = a (low half) = the lower k
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint16_t ld2c(const uint8_t* p) { return __ldg((const unsigned short*)p); }

// Raw (undecoded) bytes of 16 consecutive weight elements of one row, held in registers
// between the load (before a step's MMAs) and the decode (after them), so that no
// instruction waits on the global load in front of the MMAs.
struct Raw16 {
    uint32_t w[16];
    uint32_t s0, s1, s2, s3;
};

// Loads the 16 bytes at p (2-byte aligned) as aligned words: w[0..4] plus the shift (0/16).
__device__ __forceinline__ void ld16u(const uint8_t* p, uint32_t* w, uint32_t& sh) {
    const size_t a = (size_t)p;
    const uint32_t* q = (const uint32_t*)(a & ~(size_t)3);
    sh = (uint32_t)(a & 3) * 8;
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = __ldg(q + i);
    w[4] = sh ? __ldg(q + 4) : 0u;
}

template <int TYPE>
__device__ __forceinline__ void raw16(const uint8_t* __restrict__ row, int k0, int n_in, Raw16& r) {
    if (TYPE == GGML_F32) {
        if (k0 + 16 <= n_in && (n_in & 3) == 0) {
            const uint4* p = (const uint4*)(row + 4 * (size_t)k0);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint4 u = __ldg(p + i);
                r.w[4 * i] = u.x; r.w[4 * i + 1] = u.y; r.w[4 * i + 2] = u.z; r.w[4 * i + 3] = u.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++)
                r.w[i] = k0 + i < n_in ? __ldg((const unsigned int*)row + k0 + i) : 0u;
        }
    } else if (TYPE == GGML_F16 || TYPE == GGML_BF16) {
        if (k0 + 16 <= n_in && (n_in & 7) == 0) {
            const uint4* p = (const uint4*)(row + 2 * (size_t)k0);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const uint4 u = __ldg(p + i);
                r.w[4 * i] = u.x; r.w[4 * i + 1] = u.y; r.w[4 * i + 2] = u.z; r.w[4 * i + 3] = u.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++) r.w[i] = k0 + i < n_in ? (uint32_t)ld2c(row + 2 * (size_t)(k0 + i)) : 0u;
        }
    } else {
        if (k0 >= n_in) return;  // whole 16-element chunk beyond the row (quant rows are whole blocks)
        if (TYPE == GGML_Q8_0) {
            const uint8_t* blk = row + (size_t)(k0 / QK) * Q8_0_BYTES;
            r.s0 = ld2c(blk);
            ld16u(blk + 2 + (k0 & 16), r.w, r.s1);
        } else if (TYPE == GGML_Q4_0) {
            const uint8_t* blk = row + (size_t)(k0 / QK) * Q4_0_BYTES;
            r.s0 = ld2c(blk);
            ld16u(blk + 2, r.w, r.s1);
        } else if (TYPE == GGML_Q4_1) {
            const uint8_t* blk = row + (size_t)(k0 / QK) * Q4_1_BYTES;  // 4-aligned
            r.s0 = __ldg((const unsigned int*)blk);
#pragma unroll
            for (int i = 0; i < 4; i++) r.w[i] = __ldg((const unsigned int*)(blk + 4) + i);
        } else if (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
            const bool q4 = TYPE == GGML_Q4_K;
            const uint8_t* blk = row + (size_t)(k0 / QK_K) * (q4 ? Q4_K_BYTES : Q5_K_BYTES);  // 16-aligned
            const int rr = k0 % QK_K, g = rr / 64, l0 = rr % 32;
            const uint4 h = __ldg((const uint4*)blk);
            r.s0 = h.x; r.s1 = h.y; r.s2 = h.z; r.s3 = h.w;
            const uint4 qv = __ldg((const uint4*)(blk + (q4 ? 16 : 48) + 32 * g + l0));
            r.w[0] = qv.x; r.w[1] = qv.y; r.w[2] = qv.z; r.w[3] = qv.w;
            if (!q4) {
                const uint4 hv = __ldg((const uint4*)(blk + 16 + l0));
                r.w[4] = hv.x; r.w[5] = hv.y; r.w[6] = hv.z; r.w[7] = hv.w;
            }
        } else if (TYPE == GGML_Q6_K) {
            const uint8_t* blk = row + (size_t)(k0 / QK_K) * Q6_K_BYTES;  // 2-aligned
            const int rr = k0 % QK_K, n = rr / 128, r2 = rr % 128, quarter = r2 / 32, l0 = r2 % 32;
            ld16u(blk + 64 * n + l0 + (quarter & 1) * 32, r.w, r.s2);
            uint32_t sh2;
            ld16u(blk + 128 + 32 * n + l0, r.w + 5, sh2);  // same alignment as the ql run
            r.s0 = ld2c(blk + 208);
            r.s1 = (uint32_t)(int)__ldg((const signed char*)(blk + 192 + 8 * n + l0 / 16 + 2 * quarter));
        }
    }
}

// Decodes what raw16 loaded for the same (k0, n_in) into 8 packed bf16 pairs.
template <int TYPE>
__device__ __forceinline__ void dec16(const Raw16& r, int k0, int n_in, uint32_t (&o)[8]) {
    if (TYPE == GGML_F32) {
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = pack_bf16(__uint_as_float(r.w[2 * i]), __uint_as_float(r.w[2 * i + 1]));
    } else if (TYPE == GGML_F16 || TYPE == GGML_BF16) {
        const bool vec = k0 + 16 <= n_in && (n_in & 7) == 0;
        if (vec) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                if (TYPE == GGML_BF16) o[i] = r.w[i];
                else o[i] = pack_bf16(h2f(r.w[i] & 0xFFFF), h2f(r.w[i] >> 16));
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                if (TYPE == GGML_BF16) o[i] = (r.w[2 * i] & 0xFFFF) | (r.w[2 * i + 1] << 16);
                else o[i] = pack_bf16(h2f(r.w[2 * i]), h2f(r.w[2 * i + 1]));
            }
        }
    } else {
        if (k0 >= n_in) {
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = 0u;
            return;
        }
        if (TYPE == GGML_Q8_0) {
            const float d = h2f(r.s0);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t q = __funnelshift_r(r.w[i], r.w[i + 1], r.s1) ^ 0x80808080u;
                o[2 * i] = pack_bf16((byte_f<0>(q) - 128.0f) * d, (byte_f<1>(q) - 128.0f) * d);
                o[2 * i + 1] = pack_bf16((byte_f<2>(q) - 128.0f) * d, (byte_f<3>(q) - 128.0f) * d);
            }
        } else if (TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1) {
            const bool q40 = TYPE == GGML_Q4_0;
            const float d = h2f(r.s0 & 0xFFFF);
            const float m = q40 ? -8.0f * d : h2f(r.s0 >> 16);
            const int shift = (k0 & 16) ? 4 : 0;  // second half of the block = high nibbles
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t w = q40 ? __funnelshift_r(r.w[i], r.w[i + 1], r.s1) : r.w[i];
                const uint32_t q = (w >> shift) & 0x0F0F0F0Fu;
                o[2 * i] = pack_bf16(fmaf(byte_f<0>(q), d, m), fmaf(byte_f<1>(q), d, m));
                o[2 * i + 1] = pack_bf16(fmaf(byte_f<2>(q), d, m), fmaf(byte_f<3>(q), d, m));
            }
        } else if (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
            const bool q4 = TYPE == GGML_Q4_K;
            const int rr = k0 % QK_K, g = rr / 64, w = rr % 64, sub = 2 * g + (w >= 32);
            float sc, mn;
            scale_min_w(sub, r.s1, r.s2, r.s3, &sc, &mn);
            const float ds = h2f(r.s0 & 0xFFFF) * sc, dm = h2f(r.s0 >> 16) * mn;
            const int shift = w >= 32 ? 4 : 0;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                uint32_t q = (r.w[i] >> shift) & 0x0F0F0F0Fu;
                if (!q4) q |= ((r.w[4 + i] >> sub) & 0x01010101u) << 4;
                o[2 * i] = pack_bf16(fmaf(byte_f<0>(q), ds, -dm), fmaf(byte_f<1>(q), ds, -dm));
                o[2 * i + 1] = pack_bf16(fmaf(byte_f<2>(q), ds, -dm), fmaf(byte_f<3>(q), ds, -dm));
            }
        } else if (TYPE == GGML_Q6_K) {
            const int rr = k0 % QK_K, quarter = (rr % 128) / 32;
            const float ds = h2f(r.s0) * (float)(int)r.s1;
            const int lshift = quarter >= 2 ? 4 : 0, hshift = 2 * quarter;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t lw = __funnelshift_r(r.w[i], r.w[i + 1], r.s2);
                const uint32_t hw = __funnelshift_r(r.w[5 + i], r.w[6 + i], r.s2);
                const uint32_t q = ((lw >> lshift) & 0x0F0F0F0Fu) | (((hw >> hshift) & 0x03030303u) << 4);
                o[2 * i] = pack_bf16((byte_f<0>(q) - 32.0f) * ds, (byte_f<1>(q) - 32.0f) * ds);
                o[2 * i + 1] = pack_bf16((byte_f<2>(q) - 32.0f) * ds, (byte_f<3>(q) - 32.0f) * ds);
            }
        }
    }
}


// ---- wgmma plumbing ----

// Descriptor of a K-major tile in the 128-byte swizzle layout at shared address `addr`: each
// row's 64 bf16 are one 128-byte line whose 16-byte chunk j sits at position j ^ (row % 8);
// 8-row groups (1 KB, 1 KB aligned) adjacent (stride byte offset 1024); the leading offset is
// unused in this mode (1). A k16 step inside the line adds its 32 bytes to the start address
// (the hardware applies the XOR on the absolute address bits, hence the 1 KB alignment).
// The no-swizzle layout (core matrices of 8 rows × 16 B) measured no faster than mm_ in every
// arrangement tried (MATMUL.md round 13).
template <int R>
__device__ __forceinline__ uint64_t mmw_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
// Byte offset of element (r, k) (k < 64) in a tile of that layout.
template <int R>
__device__ __forceinline__ uint32_t mmw_off(int r, int k) {
    return (uint32_t)(r * 128 + ((((k >> 3) ^ r) & 7) << 4) + (k & 7) * 2);
}
__device__ __forceinline__ void mmw_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void mmw_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void mmw_cp16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void mmw_wgmma_n256(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void mmw_wgmma_n128(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void mmw_wgmma_n64(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(1));
}

template <int N>
__device__ __forceinline__ void mmw_fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// A block's tile: TM outputs (64 per consumer warpgroup) × BN tokens. Stages: as many as fit
// 224 KB, at most 7 (two named barriers each, 16 per block).
template <int TM, int BN>
struct MmwShape {
    static constexpr int A_BYTES = TM * MMW_TK * 2;
    static constexpr int B_BYTES = BN * MMW_TK * 2;
    static constexpr int STAGE = A_BYTES + B_BYTES;
    static constexpr int STAGES = (224 * 1024 / STAGE) < 7 ? (224 * 1024 / STAGE) : 7;
    static constexpr int SMEM = STAGES * STAGE + 1024;  // + alignment slack; mmw.rs smem() mirrors it
    static constexpr int THREADS = MMW_THREADS(TM);
    static constexpr int TPR = MMW_PTHREADS / TM;  // producer threads per output row: 2 or 4
};

template <int TYPE, int TM, int BN>
__device__ __forceinline__ void mmw(const uint8_t* __restrict__ W, long long rb, int n_out, int n_in,
                                    const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out,
                                    int oy) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma: sm_90a only (mmw.rs loads this file there only)
    using S = MmwShape<TM, BN>;
    constexpr int NACC = BN / 2;
    constexpr bool KQ = TYPE == GGML_Q4_K || TYPE == GGML_Q5_K;
    constexpr int MMW_STAGES = S::STAGES, MMW_BAR = S::THREADS, TPR = S::TPR, NCH = 4 / TPR;
    constexpr int FULL0 = 1, EMPTY0 = 1 + MMW_STAGES;
    extern __shared__ __align__(1024) uint8_t mmw_smem[];
    // The swizzle atoms must sit on 1 KB boundaries: the ring starts at the first one (the
    // launcher adds 1 KB of slack).
    const uint32_t s0 = ((uint32_t)__cvta_generic_to_shared(mmw_smem) + 1023u) & ~1023u;
    const int tid = threadIdx.x, wgi = tid >> 7;
    const int t0 = blockIdx.x * BN, o0 = oy * TM;
    const int nk = kp / MMW_TK;

    if (wgi < MMW_PRODUCERS) {
        // ---- producers: thread (row r, part h) decodes the NCH chunks h, h + TPR, .. (16 k
        // each) of its row's 64-k step: TPR = 2 (TM = 128: chunks h, h + 2) or 4 (TM = 64) ----
        const int ptid = tid, r = ptid / TPR, h = ptid % TPR;
        const int lo = o0 + r < n_out ? o0 + r : n_out - 1;
        const uint8_t* wrow = W + (size_t)lo * (size_t)rb;
        // MMW_RAW steps of raw weight bytes in flight (K-quants: chunk h + 2 is the high
        // nibbles of chunk h's bytes, one load; other types two).
        Raw16 sets[MMW_RAW][NCH];
        auto load = [&](int kt, Raw16 (&rr)[NCH]) {
            const int k = kt * MMW_TK + 16 * h;
            // (K-quants at TPR = 2: chunk h's bytes also hold chunk h + 2, so one load.)
            raw16<TYPE>(wrow, k, n_in, rr[0]);
            if (NCH == 2 && !KQ) raw16<TYPE>(wrow, k + 32, n_in, rr[NCH - 1]);
        };
        auto store_a = [&](int kt, const Raw16 (&rr)[NCH]) {
            const int k = kt * MMW_TK;
            const uint32_t base = s0 + (kt % MMW_STAGES) * S::STAGE;
#pragma unroll
            for (int i = 0; i < NCH; i++) {
                const int c = h + TPR * i;
                uint32_t d[8];
                dec16<TYPE>(rr[KQ ? 0 : i], k + 16 * c, n_in, d);
                asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(base + mmw_off<TM>(r, 16 * c)),
                             "r"(d[0]), "r"(d[1]), "r"(d[2]), "r"(d[3]) : "memory");
                asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(base + mmw_off<TM>(r, 16 * c + 8)),
                             "r"(d[4]), "r"(d[5]), "r"(d[6]), "r"(d[7]) : "memory");
            }
        };
        // x of step kt into its stage (once the consumers released the stage's previous use,
        // step kt - STAGES), one cp.async group per step (empty past the last step).
        auto copy_b = [&](int kt) {
            if (kt < nk) {
                if (kt >= MMW_STAGES) mmw_bar_sync(EMPTY0 + kt % MMW_STAGES, MMW_BAR);
                const int k = kt * MMW_TK;
                const uint32_t base = s0 + (kt % MMW_STAGES) * S::STAGE + S::A_BYTES;
#pragma unroll
                for (int i = 0; i < BN * 8 / MMW_PTHREADS; i++) {
                    const int c = ptid + MMW_PTHREADS * i, n = c >> 3, kc = (c & 7) * 8;
                    const int t = t0 + n;
                    const uint16_t* src = xb + (size_t)(t < rows ? t : 0) * kp + k + kc;
                    mmw_cp16(base + mmw_off<BN>(n, kc), src, t < rows ? 16 : 0);
                }
            }
            asm volatile("cp.async.commit_group;\n" ::: "memory");
        };
        // Step kt: x of step kt + XLEAD issued (its stage released by the consumers' step
        // kt + XLEAD - STAGES), the weights of step kt decoded into its stage (free: its x
        // was issued XLEAD steps ago, after the release), the raw bytes of step kt + MMW_RAW
        // loaded into the set just decoded, then step kt published once its x copies (the
        // group XLEAD behind the newest) landed. With 7 stages and XLEAD 3 the producers run
        // up to three steps ahead of the consumers; the first version (4 stages, XLEAD 2)
        // let them lead by one, and every step paid the handoffs in series (MATMUL.md).
        auto step = [&](int kt, Raw16 (&cur)[NCH]) {
            copy_b(kt + MMW_XLEAD);
            store_a(kt, cur);
            asm volatile("cp.async.wait_group %0;\n" ::"n"(MMW_XLEAD) : "memory");
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            mmw_bar_arrive(FULL0 + kt % MMW_STAGES, MMW_BAR);
            // After the fence: it compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC, and the
            // membar waits for every load the thread has outstanding. Issued before it (the
            // previous version), the raw loads were waited for at once, every step; issued
            // here they have the next step's decode and copies to land in before the next
            // fence, which is why two sets suffice (MATMUL.md).
            if (kt + MMW_RAW < nk) load(kt + MMW_RAW, cur);
        };
#pragma unroll
        for (int j = 0; j < MMW_RAW; j++)
            if (j < nk) load(j, sets[j]);
#pragma unroll
        for (int j = 0; j < MMW_XLEAD; j++) copy_b(j);
        for (int kt = 0; kt < nk; kt += MMW_RAW) {
#pragma unroll
            for (int j = 0; j < MMW_RAW; j++)
                if (kt + j < nk) step(kt + j, sets[j]);
        }
    } else {
        // ---- consumers: warpgroup c owns outputs 64c.. of the tile ----
        const int c = wgi - MMW_PRODUCERS;
        float acc[NACC];
#pragma unroll
        for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
        for (int kt = 0; kt < nk; kt++) {
            const int s = kt % MMW_STAGES;
            mmw_bar_sync(FULL0 + s, MMW_BAR);
            const uint32_t a = s0 + s * S::STAGE + mmw_off<TM>(64 * c, 0);
            const uint32_t b = s0 + s * S::STAGE + S::A_BYTES;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < MMW_TK / 16; kk++) {
                // k16 step kk starts at core-matrix column 2kk.
                const uint64_t da = mmw_desc<TM>(a + mmw_off<TM>(0, 16 * kk));
                const uint64_t db = mmw_desc<BN>(b + mmw_off<BN>(0, 16 * kk));
                if constexpr (BN == 256) mmw_wgmma_n256(acc, da, db);
                else if constexpr (BN == 128) mmw_wgmma_n128(acc, da, db);
                else mmw_wgmma_n64(acc, da, db);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            if (kt >= 1) {
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                mmw_fence_acc(acc);
                if (kt - 1 + MMW_STAGES < nk) mmw_bar_arrive(EMPTY0 + (kt - 1) % MMW_STAGES, MMW_BAR);
            }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        mmw_fence_acc(acc);
        // D fragment: per 8-token column block j, acc[4j], acc[4j+1] = (row g, tokens 2t4,
        // 2t4+1), acc[4j+2], acc[4j+3] = row g + 8; warp w of the group holds rows 16w..
        const int w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
        const int ob = o0 + 64 * c + 16 * w + g;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int o = ob + (e >= 2 ? 8 : 0), t = t0 + 8 * j + 2 * t4 + (e & 1);
                if (o < n_out && t < rows) out[(size_t)t * n_out + o] = acc[4 * j + e];
            }
        }
    }
#else
    __trap();
#endif
}

// One launch for up to three weights of one type that read the same x (the Q, K, V
// projections): the grid's output tiles are weight 0's, then from tile e1 weight 1's, from e2
// weight 2's (e1 = e2 = the tile count for fewer weights); each block takes its weight's
// pointer, row bytes, outputs and destination. K and V (1024 outputs each at Qwen3-8B) alone
// leave most SMs idle; with Q they fill the wide-tile grid (MATMUL.md round 13).
#define MMW_KERNEL1(name, TYPE, TM, BN)                                                                     \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS(TM), 1) mmw_##name##_n##BN(                   \
        const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, const uint8_t* __restrict__ W2,    \
        long long rb0, long long rb1, long long rb2, int n0, int n1, int n2, int e1, int e2, int n_in,     \
        const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out0,                       \
        float* __restrict__ out1, float* __restrict__ out2) {                                              \
        PDL_ENTRY();                                                                                        \
        const int y = blockIdx.y, g = (y >= e1) + (y >= e2);                                                \
        mmw<TYPE, TM, BN>(g == 0 ? W0 : (g == 1 ? W1 : W2), g == 0 ? rb0 : (g == 1 ? rb1 : rb2),            \
                          g == 0 ? n0 : (g == 1 ? n1 : n2), n_in, xb, kp, rows,                             \
                          g == 0 ? out0 : (g == 1 ? out1 : out2), y - (g == 0 ? 0 : (g == 1 ? e1 : e2)));   \
    }
// n128, n64: 128 outputs (two consumer warpgroups); n256: 64 outputs × 256 tokens (one consumer
// warpgroup, m64n256: each decoded weight serves twice the tokens).
#define MMW_KERNEL(name, TYPE)                                                                              \
    MMW_KERNEL1(name, TYPE, 128, 128)                                                                       \
    MMW_KERNEL1(name, TYPE, 128, 64)                                                                        \
    MMW_KERNEL1(name, TYPE, 64, 256)

MMW_KERNEL(f32, GGML_F32)
MMW_KERNEL(f16, GGML_F16)
MMW_KERNEL(bf16, GGML_BF16)
MMW_KERNEL(q8_0, GGML_Q8_0)
MMW_KERNEL(q4_0, GGML_Q4_0)
MMW_KERNEL(q4_1, GGML_Q4_1)
MMW_KERNEL(q4_k, GGML_Q4_K)
MMW_KERNEL(q5_k, GGML_Q5_K)
MMW_KERNEL(q6_k, GGML_Q6_K)

// x [rows, n_in] f32 -> xb [rows, kp] bf16 (kp % 64 == 0, zero beyond n_in): matmul.cu's
// mm_x_bf16 (copied with the decoders above), one 16-B vector of xb per thread.
extern "C" __global__ void __launch_bounds__(256)
    mmw_x_bf16(const float* __restrict__ x, int rows, int n_in, int kp, uint16_t* __restrict__ xb) {
    PDL_ENTRY();
    const int per_row = kp >> 3;
    const long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= (long long)rows * per_row) return;
    const int t = (int)(u / per_row), c = (int)(u % per_row) * 8;
    const float* xr = x + (size_t)t * n_in;
    uint32_t o[4];
    if ((n_in & 3) == 0 && c + 8 <= n_in) {
        const float4 a = __ldg((const float4*)(xr + c)), b = __ldg((const float4*)(xr + c + 4));
        o[0] = pack_bf16(a.x, a.y); o[1] = pack_bf16(a.z, a.w);
        o[2] = pack_bf16(b.x, b.y); o[3] = pack_bf16(b.z, b.w);
    } else {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = c + i < n_in ? __ldg(xr + c + i) : 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = pack_bf16(v[2 * i], v[2 * i + 1]);
    }
    *(uint4*)(xb + (size_t)t * kp + c) = make_uint4(o[0], o[1], o[2], o[3]);
}
