// mm_decode.cuh — the bf16 decoders of the prefill matmuls and their mma.sync bf16 step
// (`mma_bf16`), shared by matmul.cu (`mm_`, and h2f / byte_f / scale_min_w in its GEMVs),
// mmw.cu (the wgmma kernel) and moe.cu (its helpers; the grouped expert GEMM has its own
// one-pass decoder): the kernels must dequantize to the same bits. Prepended after common.cuh
// to those files only (mod.rs `full_source`). raw16 loads the raw bytes of 16 consecutive
// weight elements of one row into registers; dec16 turns them into 8 packed bf16 pairs. Their
// layouts follow ggml (checked against ggml_get in common.cuh by `ferrite check`).

__device__ __forceinline__ float h2f(uint16_t u) { return __half2float(__ushort_as_half(u)); }
__device__ __forceinline__ float b2f(uint16_t u) { return __uint_as_float((uint32_t)u << 16); }

// EMU_DEC_BEGIN (host emulation: tests/mmw_rs_emu.rs)
// Byte k (0..3) of w, which must be < 256 as an unsigned value, as an exact float plus 2^23.
// (prmt builds the bits 0x4B0000bb = 8388608 + bb.)
template <int K>
__device__ __forceinline__ float byte_f(uint32_t w) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + K)) - 8388608.0f;
}

// Byte k of w (< 256) minus the constant B, exactly: prmt builds the float 2^23 + byte and one
// FADD subtracts 2^23 + B (both exact: every value involved is an integer below 2^24). Same
// bits as (byte_f<K>(w) - B), one instruction fewer.
template <int K, int B>
__device__ __forceinline__ float byte_fb(uint32_t w) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + K)) - (8388608.0f + (float)B);
}

// Byte k (0..3) of w as the float 2^23 + byte exactly (byte_f before its subtraction): where
// the byte is then multiplied by c, fmaf(byte_v<K>(w), c, -2^23 c) is byte · c rounded once,
// exact where that product fits a float's 24 bits (a K-quant's 6-bit scale times its f16 d).
template <int K>
__device__ __forceinline__ float byte_v(uint32_t w) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + K));
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

// EMU_KQ_BEGIN (host emulation: tests/gemv_tc_emu.rs, tests/mmw_rs_emu.rs)
// Per-lane constants of kq_pair_scales for sub-block pair g (0..3) of a K-quant super-block.
struct KqPairSel {
    uint32_t perm;   // byte_perm selector: bytes b, b+1 of the first word, b, b+1 of the second
    uint32_t shift;  // 0 for g < 2, 2 for g >= 2 (where the top two bits come from)
    bool upper;      // g >= 2: the low four bits come from the third scale word
};
__device__ __forceinline__ KqPairSel kq_pair_sel(int g) {
    const uint32_t b = 2u * (uint32_t)(g & 1);
    return {b | (b + 1) << 4 | (b + 4) << 8 | (b + 5) << 12, g < 2 ? 0u : 2u, g >= 2};
}
// The scales and mins of sub-blocks 2g and 2g+1 (ggml's get_scale_min_k4) from the 12 scale
// bytes (words s0 s1 s2) as the bytes (sc0, sc1, m0, m1) of one word, without a branch on g
// (g varies across a GEMV warp's lanes, and by step in mmw.cu's RS consumers, where ggml's
// two-branch form cost ~60 instructions a step). H gathers bytes b, b+1 of s0 and s1; for
// g < 2 the values are H & 0x3F. For g >= 2 the low four bits are the nibbles of s2's bytes b, b+1 (low
// nibbles: scales, high: mins) and the top two are bits 6-7 of H's bytes:
// (L & 0x0F) | ((H >> 2) & 0x30) per byte (the shift's carry between bytes is masked off).
__device__ __forceinline__ uint32_t kq_pair_scales(KqPairSel sel, uint32_t s0, uint32_t s1, uint32_t s2) {
    const uint32_t H = __byte_perm(s0, s1, sel.perm);
    const uint32_t L = sel.upper ? __byte_perm(s2, s2 >> 4, sel.perm) : H;
    return (L & 0x0F0F0F0Fu) | ((H >> sel.shift) & 0x30303030u);
}
// EMU_KQ_END

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // .x = a (low half) = the lower k
    return *reinterpret_cast<uint32_t*>(&v);
}
// EMU_DEC_END

// Two floats as f16 (.x = a, the low half), saturated to ±65504 (a NaN stays one): the TA
// form's f16 x scratch, whose values an f16 GEMM's input would clamp rather than overflow.
__device__ __forceinline__ uint32_t pack_f16_sat(float a, float b) {
    const float m = 65504.0f;
    a = a != a ? a : fminf(fmaxf(a, -m), m);
    b = b != b ? b : fminf(fmaxf(b, -m), m);
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
}

// The prefill's 16-bit x scratch, one thread's 16-byte vector: x [rows, n_in] f32 -> xb
// [rows, kp] (kp % 64 == 0, zero beyond n_in) as bf16 (matmul.cu mm_x_bf16) or, F16, as
// pack_f16_sat's f16 (mmw.cu mmw_x_f16, the TA form's F16 weights). `gather`: row t of xb is
// row gather[t] / div of x (mmw.cu mmw_moe_x_gather: a MoE prefill's pairs in list order).
template <bool F16>
__device__ __forceinline__ void x_scratch16(const float* __restrict__ x, int rows, int n_in, int kp,
                                            uint16_t* __restrict__ xb, const int* __restrict__ gather = nullptr,
                                            int div = 1) {
    const int per_row = kp >> 3;
    const long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= (long long)rows * per_row) return;
    const int t = (int)(u / per_row), c = (int)(u % per_row) * 8;
    const float* xr = x + (size_t)(gather ? __ldg(gather + t) / div : t) * n_in;
    float v[8];
    if ((n_in & 3) == 0 && c + 8 <= n_in) {
        const float4 a = __ldg((const float4*)(xr + c)), b = __ldg((const float4*)(xr + c + 4));
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = c + i < n_in ? __ldg(xr + c + i) : 0.0f;
    }
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; i++) o[i] = F16 ? pack_f16_sat(v[2 * i], v[2 * i + 1]) : pack_bf16(v[2 * i], v[2 * i + 1]);
    *(uint4*)(xb + (size_t)t * kp + c) = make_uint4(o[0], o[1], o[2], o[3]);
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

// N 16-byte loads at p (16-byte aligned) into w[0 .. 4N).
template <int N>
__device__ __forceinline__ void ld16v(const uint8_t* p, uint32_t* w) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const uint4 u = __ldg((const uint4*)p + i);
        w[4 * i] = u.x; w[4 * i + 1] = u.y; w[4 * i + 2] = u.z; w[4 * i + 3] = u.w;
    }
}

template <int TYPE>
__device__ __forceinline__ void raw16(const uint8_t* __restrict__ row, int k0, int n_in, Raw16& r) {
    if (TYPE == GGML_F32) {
        if (k0 + 16 <= n_in && (n_in & 3) == 0) {
            ld16v<4>(row + 4 * (size_t)k0, r.w);
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++)
                r.w[i] = k0 + i < n_in ? __ldg((const unsigned int*)row + k0 + i) : 0u;
        }
    } else if (TYPE == GGML_F16 || TYPE == GGML_BF16) {
        if (k0 + 16 <= n_in && (n_in & 7) == 0) {
            ld16v<2>(row + 2 * (size_t)k0, r.w);
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

// One mma.sync m16n8k16 bf16 x bf16 -> f32 step, accumulating into c (the prefill matmul
// of matmul.cu and moe.cu's grouped expert GEMM).
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
