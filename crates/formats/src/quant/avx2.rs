//! Explicit AVX2 versions of [`super::dot`] / [`super::dot_many`], bit-identical to the
//! scalar path (`dot_impl` / `dot_many_impl` with the `dequant_block_*` decoders).
//!
//! Identity argument, step by step (tested bitwise in `tests/avx2_identity.rs`):
//!
//! - **Weights.** Each decoder evaluates the scalar decoder's f32 expression with the same
//!   operations in the same order, one IEEE op per intrinsic: integer quant → `cvtepi32_ps`
//!   (exact for |q| < 2^24), then e.g. q4_1 `q * d + m` as `mul` then `add`, q4_K
//!   `(d * sc) * q - (dmin * m)` with the sub-block factors computed in scalar f32 exactly as
//!   the scalar decoder does, q6_K `(d * sc) * q`. Scales are converted with the scalar
//!   [`f16_to_f32`]; f16 rows use a lane-wise transcription of it (see [`cvt_f16x8`]).
//!   Multiplication commutes bitwise in IEEE arithmetic, so operand order inside one `mul`
//!   does not matter (NaN payloads aside, which Rust does not specify either).
//! - **Lanes.** Register `c` of a decoded block holds elements `8c..8c+8`, so element `j`
//!   sits in lane `j % 8` of chunk `j / 8`, as in `block_dot`.
//! - **Accumulation.** Per block, `acc = 0; acc = acc + w_c * x_c` for c = 0, 1, 2, ... with
//!   separate `mul` and `add` (never FMA, which rounds once instead of twice).
//! - **Reduction.** `lo128 + hi128 = [a0+a4, a1+a5, a2+a6, a3+a7] = [s0, s1, s2, s3]`; adding
//!   `movehl` gives `[s0+s2, s1+s3, ..]`; adding `movehdup` gives `(s0+s2) + (s1+s3)`
//!   = `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`, the scalar tree.
//! - **Row sum.** Block sums are added left to right into an f32 starting at 0, per vector.
//!   Float rows whose length is not a multiple of 32 finish with the scalar code on the tail.
//!
//! Everything here is `unsafe`: callers must have checked that the CPU has AVX2 and that the
//! shapes are consistent (`row.len() == t.bytes_for(n_in)`, `xs.len() == out.len() * n_in`);
//! the kernels then read through raw pointers without further bounds checks.

use std::arch::x86_64::*;

use super::float::{self, f16_to_f32, FLOAT_DOT_CHUNK};
use super::k_quants::{get_scale_min, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K};
use super::legacy::{Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES, QK};
use super::GgmlType;

const _: () = assert!(QK == 32 && FLOAT_DOT_CHUNK == 32 && QK_K == 256);

// ======================================================================= helpers

/// Little-endian u16 at `p` (unaligned).
#[inline(always)]
unsafe fn rd_u16(p: *const u8) -> u16 {
    u16::from_le_bytes(p.cast::<[u8; 2]>().read_unaligned())
}

/// [`f16_to_f32`] of every f16 bit pattern, evaluated at compile time (256 KiB). Block scales
/// are converted by one load from it instead of ~10 scalar ops; the scales of one matrix
/// cluster in a few exponents, so few cache lines of it are hot (ggml does the same).
static F16_TO_F32: [f32; 1 << 16] = {
    let mut t = [0.0f32; 1 << 16];
    let mut h = 0;
    while h < t.len() {
        t[h] = f16_to_f32(h as u16);
        h += 1;
    }
    t
};

/// The f16 at `p` (little-endian, unaligned) as f32, bit-identical to [`f16_to_f32`].
#[inline(always)]
unsafe fn rd_f16(p: *const u8) -> f32 {
    F16_TO_F32[rd_u16(p) as usize]
}

/// 8 bytes at `p`, zero-extended to 8 i32 lanes.
#[inline(always)]
unsafe fn u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
}

/// 8 bytes at `p`, sign-extended to 8 i32 lanes.
#[inline(always)]
unsafe fn i8x8(p: *const u8) -> __m256i {
    _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))
}

/// 8 little-endian u16 at `p`, zero-extended to 8 i32 lanes.
#[inline(always)]
unsafe fn u16x8(p: *const u8) -> __m256i {
    _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))
}

#[inline(always)]
unsafe fn f32_of(v: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(v)
}

/// Lane-wise [`f16_to_f32`] on 8 f16 bit patterns held in i32 lanes: the same bit
/// operations, the same `(em << 13) as f32 * 2^112` (exact, and subnormal inputs go through
/// the same f32 subnormal path as the scalar code) and the same inf/NaN select.
#[inline(always)]
unsafe fn cvt_f16x8(h: __m256i) -> __m256 {
    const F16_REBIAS: f32 = f32::from_bits((127 + 112) << 23);
    let sign = _mm256_slli_epi32::<16>(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)));
    let em = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
    let shifted = _mm256_slli_epi32::<13>(em);
    let finite = _mm256_castps_si256(_mm256_mul_ps(
        _mm256_castsi256_ps(shifted),
        _mm256_set1_ps(F16_REBIAS),
    ));
    let inf_nan = _mm256_or_si256(shifted, _mm256_set1_epi32(0x7f80_0000));
    let is_inf_nan = _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7bff));
    let bits = _mm256_blendv_epi8(finite, inf_nan, is_inf_nan);
    _mm256_castsi256_ps(_mm256_or_si256(bits, sign))
}

/// `block_dot`'s reduction tree: `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`.
#[inline(always)]
unsafe fn hsum(acc: __m256) -> f32 {
    // [a0+a4, a1+a5, a2+a6, a3+a7] = [s0, s1, s2, s3]
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    // [s0+s2, s1+s3, s2+s2, s3+s3]
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    // lane 0: (s0+s2) + (s1+s3)
    _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
}

/// `acc + w * x` as two rounded operations (mul, then add).
#[inline(always)]
unsafe fn mac(acc: __m256, w: __m256, x: *const f32) -> __m256 {
    _mm256_add_ps(acc, _mm256_mul_ps(w, _mm256_loadu_ps(x)))
}

/// [`hsum`] of 8 accumulators at once, as `[hsum(a[0]), ..., hsum(a[7])]`: the same tree
/// per accumulator, computed transposed (about half the instructions of 8 [`hsum`]s).
#[inline(always)]
unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
    // S_k = [a_k.lo + a_k.hi | a_k+1.lo + a_k+1.hi] = [s_k0..s_k3 | s_k+1,0..s_k+1,3]
    let s = |k: usize| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a[k], a[k + 1]),
            _mm256_permute2f128_ps::<0x31>(a[k], a[k + 1]),
        )
    };
    let (s01, s23, s45, s67) = (s(0), s(2), s(4), s(6));
    // T = [s_k0 + s_k2, s_k1 + s_k3, s_k+2,0 + s_k+2,2, s_k+2,1 + s_k+2,3 | same for k+1, k+3]
    let t = |p: __m256, q: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(p, q),
            _mm256_shuffle_ps::<0b11_10_11_10>(p, q),
        )
    };
    let (t0, t4) = (t(s01, s23), t(s45, s67));
    // B = (s_k0 + s_k2) + (s_k1 + s_k3) in order [b0, b2, b4, b6 | b1, b3, b5, b7]
    let b = _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(t0, t4),
        _mm256_shuffle_ps::<0b11_01_11_01>(t0, t4),
    );
    _mm256_permutevar8x32_ps(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// One 32-element block's accumulator: `0 + w_0 x_0 + w_1 x_1 + ...` per lane, in order.
#[inline(always)]
unsafe fn acc32(w: &[__m256; 4], x: *const f32) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    for (c, &wc) in w.iter().enumerate() {
        acc = mac(acc, wc, x.add(8 * c));
    }
    acc
}

/// One 256-element block's accumulator from its 32 decoded chunks.
#[inline(always)]
unsafe fn acc256(w: &[__m256; 32], x: *const f32) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    for (c, &wc) in w.iter().enumerate() {
        acc = mac(acc, wc, x.add(8 * c));
    }
    acc
}

/// `acc` continued over one decoded 64-element group (chunks in order).
#[inline(always)]
unsafe fn acc_group(mut acc: __m256, w: &[__m256; 8], x: *const f32) -> __m256 {
    for (c, &wc) in w.iter().enumerate() {
        acc = mac(acc, wc, x.add(8 * c));
    }
    acc
}

/// `out[0..8] += b` element-wise (each `out[j]` gets one more left-to-right term).
#[inline(always)]
unsafe fn add8(out: &mut [f32], b: __m256) {
    let o = out[..8].as_mut_ptr();
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), b));
}

// ======================================================================= block decoders

/// A 32-element block (legacy quants, float pseudo-blocks) decoded whole: register `c`
/// holds elements `8c..8c + 8`.
trait Block32 {
    /// Bytes per block.
    const BYTES: usize;
    unsafe fn decode(b: *const u8) -> [__m256; 4];
}

/// A 256-element K-quant super-block, decoded 64 elements (one group `g`, 0..4) at a time:
/// register `c` of group `g` holds elements `64g + 8c..64g + 8c + 8`.
trait Block256 {
    const BYTES: usize;
    /// Per-block factors, computed once per block in scalar f32 as the scalar decoder does.
    type Scales;
    unsafe fn scales(b: *const u8) -> Self::Scales;
    unsafe fn decode_group(b: *const u8, s: &Self::Scales, g: usize) -> [__m256; 8];
}

struct Q4_0;
struct Q4_1;
struct Q8_0;
struct F32;
struct F16;
struct BF16;
struct Q4K;
struct Q5K;
struct Q6K;

impl Block32 for Q4_0 {
    const BYTES: usize = Q4_0_BYTES;
    /// `((q & 0xF) as i32 - 8) as f32 * d`; low nibbles are elements 0..16, high 16..32.
    #[inline(always)]
    unsafe fn decode(b: *const u8) -> [__m256; 4] {
        let d = _mm256_set1_ps(rd_f16(b));
        let (m4, eight) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(8));
        let v0 = u8x8(b.add(2)); // qs[0..8]
        let v1 = u8x8(b.add(10)); // qs[8..16]
        let q = |v: __m256i| f32_of(_mm256_sub_epi32(v, eight));
        [
            _mm256_mul_ps(q(_mm256_and_si256(v0, m4)), d),
            _mm256_mul_ps(q(_mm256_and_si256(v1, m4)), d),
            _mm256_mul_ps(q(_mm256_srli_epi32::<4>(v0)), d),
            _mm256_mul_ps(q(_mm256_srli_epi32::<4>(v1)), d),
        ]
    }
}

impl Block32 for Q4_1 {
    const BYTES: usize = Q4_1_BYTES;
    /// `(q & 0xF) as f32 * d + m` (mul, then add).
    #[inline(always)]
    unsafe fn decode(b: *const u8) -> [__m256; 4] {
        let d = _mm256_set1_ps(rd_f16(b));
        let m = _mm256_set1_ps(rd_f16(b.add(2)));
        let m4 = _mm256_set1_epi32(0xF);
        let v0 = u8x8(b.add(4));
        let v1 = u8x8(b.add(12));
        let w = |q: __m256i| _mm256_add_ps(_mm256_mul_ps(f32_of(q), d), m);
        [
            w(_mm256_and_si256(v0, m4)),
            w(_mm256_and_si256(v1, m4)),
            w(_mm256_srli_epi32::<4>(v0)),
            w(_mm256_srli_epi32::<4>(v1)),
        ]
    }
}

impl Block32 for Q8_0 {
    const BYTES: usize = Q8_0_BYTES;
    /// `(q as i8) as f32 * d`.
    #[inline(always)]
    unsafe fn decode(b: *const u8) -> [__m256; 4] {
        let d = _mm256_set1_ps(rd_f16(b));
        let w = |c: usize| _mm256_mul_ps(f32_of(i8x8(b.add(2 + 8 * c))), d);
        [w(0), w(1), w(2), w(3)]
    }
}

impl Block32 for F32 {
    const BYTES: usize = 4 * FLOAT_DOT_CHUNK;
    #[inline(always)]
    unsafe fn decode(b: *const u8) -> [__m256; 4] {
        let p = b.cast::<f32>();
        [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ]
    }
}

impl Block32 for F16 {
    const BYTES: usize = 2 * FLOAT_DOT_CHUNK;
    #[inline(always)]
    unsafe fn decode(b: *const u8) -> [__m256; 4] {
        let w = |c: usize| cvt_f16x8(u16x8(b.add(16 * c)));
        [w(0), w(1), w(2), w(3)]
    }
}

impl Block32 for BF16 {
    const BYTES: usize = 2 * FLOAT_DOT_CHUNK;
    /// bf16 is the top half of an f32.
    #[inline(always)]
    unsafe fn decode(b: *const u8) -> [__m256; 4] {
        let w = |c: usize| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(u16x8(b.add(16 * c))));
        [w(0), w(1), w(2), w(3)]
    }
}

/// q4_K / q5_K sub-block factors: `d * sc` and `dmin * m` for the 8 sub-blocks of 32.
struct KScales {
    d: [f32; 8],
    m: [f32; 8],
}

/// As `dequant_block_q4_k` / `q5_k` compute them: `(d * sc as f32, min * m as f32)`.
#[inline(always)]
unsafe fn k_scales(b: *const u8) -> KScales {
    let d = rd_f16(b);
    let min = rd_f16(b.add(2));
    let scales = &*b.add(4).cast::<[u8; 12]>();
    let mut s = KScales {
        d: [0.0; 8],
        m: [0.0; 8],
    };
    for j in 0..8 {
        let (sc, m) = get_scale_min(j, scales);
        s.d[j] = d * sc as f32;
        s.m[j] = min * m as f32;
    }
    s
}

impl Block256 for Q4K {
    const BYTES: usize = Q4_K_BYTES;
    type Scales = KScales;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> KScales {
        k_scales(b)
    }
    /// Group g = sub-blocks 2g (low nibbles of `qs[32g..32g + 32]`) and 2g + 1 (high
    /// nibbles): `d1 * q as f32 - dm1` (mul, then sub).
    #[inline(always)]
    unsafe fn decode_group(b: *const u8, s: &KScales, g: usize) -> [__m256; 8] {
        let qs = b.add(16 + 32 * g);
        let (d1, m1) = (_mm256_set1_ps(s.d[2 * g]), _mm256_set1_ps(s.m[2 * g]));
        let (d2, m2) = (
            _mm256_set1_ps(s.d[2 * g + 1]),
            _mm256_set1_ps(s.m[2 * g + 1]),
        );
        let m4 = _mm256_set1_epi32(0xF);
        let mut w = [_mm256_setzero_ps(); 8];
        for c in 0..4 {
            let v = u8x8(qs.add(8 * c));
            let lo = f32_of(_mm256_and_si256(v, m4));
            let hi = f32_of(_mm256_srli_epi32::<4>(v));
            w[c] = _mm256_sub_ps(_mm256_mul_ps(d1, lo), m1);
            w[4 + c] = _mm256_sub_ps(_mm256_mul_ps(d2, hi), m2);
        }
        w
    }
}

impl Block256 for Q5K {
    const BYTES: usize = Q5_K_BYTES;
    type Scales = KScales;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> KScales {
        k_scales(b)
    }
    /// As q4_K plus the fifth bit: bit 2g of `qh[l]` for element 64g + l, bit 2g + 1 for
    /// element 64g + 32 + l.
    #[inline(always)]
    unsafe fn decode_group(b: *const u8, s: &KScales, g: usize) -> [__m256; 8] {
        let qh = b.add(16);
        let qs = b.add(48 + 32 * g);
        let (d1, m1) = (_mm256_set1_ps(s.d[2 * g]), _mm256_set1_ps(s.m[2 * g]));
        let (d2, m2) = (
            _mm256_set1_ps(s.d[2 * g + 1]),
            _mm256_set1_ps(s.m[2 * g + 1]),
        );
        let (m4, one) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(1));
        let sh1 = _mm_cvtsi32_si128(2 * g as i32);
        let sh2 = _mm_cvtsi32_si128(2 * g as i32 + 1);
        let mut w = [_mm256_setzero_ps(); 8];
        for c in 0..4 {
            let v = u8x8(qs.add(8 * c));
            let h = u8x8(qh.add(8 * c));
            let h1 = _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srl_epi32(h, sh1), one));
            let h2 = _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srl_epi32(h, sh2), one));
            let lo = f32_of(_mm256_or_si256(_mm256_and_si256(v, m4), h1));
            let hi = f32_of(_mm256_or_si256(_mm256_srli_epi32::<4>(v), h2));
            w[c] = _mm256_sub_ps(_mm256_mul_ps(d1, lo), m1);
            w[4 + c] = _mm256_sub_ps(_mm256_mul_ps(d2, hi), m2);
        }
        w
    }
}

impl Block256 for Q6K {
    const BYTES: usize = Q6_K_BYTES;
    /// `d * sc as f32` for the 16 sub-blocks of 16, as `dequant_block_q6_k` groups it.
    type Scales = [f32; 16];
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> [f32; 16] {
        let d = rd_f16(b.add(208));
        let sc = b.add(192);
        let mut s = [0.0; 16];
        for (i, v) in s.iter_mut().enumerate() {
            *v = d * (*sc.add(i) as i8) as f32;
        }
        s
    }
    /// Group g = half h = g / 2, runs k = 2(g % 2) and k + 1 of 32 elements
    /// (element 128h + 32k + l, l in 0..32): 4-bit part from `ql[64h + 32(k % 2) + l]`
    /// (low nibble for k < 2, high for k >= 2), 2-bit part `qh[32h + l] >> 2k & 3`,
    /// weight `(d * sc) * (q - 32) as f32` with sub-block scale `8h + 2k + l / 16`.
    #[inline(always)]
    unsafe fn decode_group(b: *const u8, s: &[f32; 16], g: usize) -> [__m256; 8] {
        let (h, upper) = (g / 2, g % 2);
        let ql = b.add(64 * h);
        let qh = b.add(128 + 32 * h);
        let (m4, m3, k32) = (
            _mm256_set1_epi32(0xF),
            _mm256_set1_epi32(3),
            _mm256_set1_epi32(32),
        );
        let nib_shift = _mm_cvtsi32_si128(4 * upper as i32);
        let mut w = [_mm256_setzero_ps(); 8];
        for kk in 0..2 {
            let k = 2 * upper + kk;
            let qh_shift = _mm_cvtsi32_si128(2 * k as i32);
            for c in 0..4 {
                let lv = u8x8(ql.add(32 * kk + 8 * c));
                let nib = _mm256_and_si256(_mm256_srl_epi32(lv, nib_shift), m4);
                let hv = u8x8(qh.add(8 * c));
                let hb =
                    _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srl_epi32(hv, qh_shift), m3));
                let q = f32_of(_mm256_sub_epi32(_mm256_or_si256(nib, hb), k32));
                let ds = _mm256_set1_ps(s[8 * h + 2 * k + c / 2]);
                w[4 * kk + c] = _mm256_mul_ps(ds, q);
            }
        }
        w
    }
}

// ======================================================================= row drivers

/// 32-element blocks, `nb` of them: `out[j] +=` each block sum, left to right.
///
/// One vector (decode): blocks in groups of 8, their accumulators reduced together by
/// [`hsum8`], then added to the sum one by one in block order. Several vectors (prefill):
/// each block decoded once, vectors in groups of 8 reduced together.
#[inline(always)]
unsafe fn many_b32<K: Block32>(
    row: *const u8,
    xs: *const f32,
    n_in: usize,
    out: &mut [f32],
    nb: usize,
) {
    if out.len() == 1 {
        let mut sum = out[0];
        let mut i = 0;
        while i + 8 <= nb {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (k, a) in acc.iter_mut().enumerate() {
                *a = acc32(
                    &K::decode(row.add((i + k) * K::BYTES)),
                    xs.add(32 * (i + k)),
                );
            }
            let mut b = [0.0f32; 8];
            _mm256_storeu_ps(b.as_mut_ptr(), hsum8(&acc));
            for v in b {
                sum += v;
            }
            i += 8;
        }
        for i in i..nb {
            sum += hsum(acc32(&K::decode(row.add(i * K::BYTES)), xs.add(32 * i)));
        }
        out[0] = sum;
        return;
    }
    let m8 = out.len() / 8 * 8;
    for i in 0..nb {
        let w = K::decode(row.add(i * K::BYTES));
        let x = xs.add(32 * i);
        for j in (0..m8).step_by(8) {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (k, a) in acc.iter_mut().enumerate() {
                *a = acc32(&w, x.add((j + k) * n_in));
            }
            add8(&mut out[j..], hsum8(&acc));
        }
        for (j, o) in out.iter_mut().enumerate().skip(m8) {
            *o += hsum(acc32(&w, x.add(j * n_in)));
        }
    }
}

/// 256-element super-blocks, `nb` of them (see [`many_b32`]).
#[inline(always)]
unsafe fn many_b256<K: Block256>(
    row: *const u8,
    xs: *const f32,
    n_in: usize,
    out: &mut [f32],
    nb: usize,
) {
    if out.len() == 1 {
        let mut sum = out[0];
        // two blocks at a time: their accumulator chains (32 dependent adds each) overlap
        let mut i = 0;
        while i + 2 <= nb {
            let (b0, b1) = (row.add(i * K::BYTES), row.add((i + 1) * K::BYTES));
            let (s0, s1) = (K::scales(b0), K::scales(b1));
            let (x0, x1) = (xs.add(256 * i), xs.add(256 * (i + 1)));
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for g in 0..4 {
                a0 = acc_group(a0, &K::decode_group(b0, &s0, g), x0.add(64 * g));
                a1 = acc_group(a1, &K::decode_group(b1, &s1, g), x1.add(64 * g));
            }
            sum += hsum(a0);
            sum += hsum(a1);
            i += 2;
        }
        for i in i..nb {
            let b = row.add(i * K::BYTES);
            let s = K::scales(b);
            let x = xs.add(256 * i);
            let mut acc = _mm256_setzero_ps();
            for g in 0..4 {
                acc = acc_group(acc, &K::decode_group(b, &s, g), x.add(64 * g));
            }
            sum += hsum(acc);
        }
        out[0] = sum;
        return;
    }
    let m8 = out.len() / 8 * 8;
    let mut w = [_mm256_setzero_ps(); 32];
    for i in 0..nb {
        let b = row.add(i * K::BYTES);
        let s = K::scales(b);
        for g in 0..4 {
            let wg = K::decode_group(b, &s, g);
            w[8 * g..8 * g + 8].copy_from_slice(&wg);
        }
        let x = xs.add(256 * i);
        for j in (0..m8).step_by(8) {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (c, &wc) in w.iter().enumerate() {
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = mac(*a, wc, x.add((j + k) * n_in + 8 * c));
                }
            }
            add8(&mut out[j..], hsum8(&acc));
        }
        for (j, o) in out.iter_mut().enumerate().skip(m8) {
            *o += hsum(acc256(&w, x.add(j * n_in)));
        }
    }
}

/// Float rows: full 32-element pseudo-blocks with `K`, then the scalar code on the tail.
#[inline(always)]
unsafe fn many_float<K: Block32>(
    row: &[u8],
    xs: &[f32],
    n_in: usize,
    out: &mut [f32],
    tail: fn(&[u8], &[f32]) -> f32,
) {
    let nb = n_in / 32;
    many_b32::<K>(row.as_ptr(), xs.as_ptr(), n_in, out, nb);
    if !n_in.is_multiple_of(32) {
        // `tail` is the scalar dot of the partial block alone: `0 + block_dot(padded)`.
        // Adding it equals adding `block_dot(padded)` (as `dot_impl` does): the two differ
        // only when the block sum is -0, and `o` is never -0 (it starts at +0 and an IEEE
        // sum is -0 only if both terms are), so `o + 0 == o + -0`.
        let rtail = &row[nb * K::BYTES..];
        for (o, x) in out.iter_mut().zip(xs.chunks_exact(n_in)) {
            *o += tail(rtail, &x[nb * 32..]);
        }
    }
}

/// `quant::dot_many` for every type, with AVX2.
///
/// # Safety
/// The CPU must support AVX2, and `row.len() == t.bytes_for(n_in)`,
/// `xs.len() == out.len() * n_in`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn dot_many(t: GgmlType, row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    out.fill(0.0);
    if n_in == 0 || out.is_empty() {
        return;
    }
    let (r, x) = (row.as_ptr(), xs.as_ptr());
    match t {
        GgmlType::F32 => many_float::<F32>(row, xs, n_in, out, float::dot_f32),
        GgmlType::F16 => many_float::<F16>(row, xs, n_in, out, float::dot_f16),
        GgmlType::BF16 => many_float::<BF16>(row, xs, n_in, out, float::dot_bf16),
        GgmlType::Q4_0 => many_b32::<Q4_0>(r, x, n_in, out, n_in / 32),
        GgmlType::Q4_1 => many_b32::<Q4_1>(r, x, n_in, out, n_in / 32),
        GgmlType::Q8_0 => many_b32::<Q8_0>(r, x, n_in, out, n_in / 32),
        GgmlType::Q4K => many_b256::<Q4K>(r, x, n_in, out, n_in / 256),
        GgmlType::Q5K => many_b256::<Q5K>(r, x, n_in, out, n_in / 256),
        GgmlType::Q6K => many_b256::<Q6K>(r, x, n_in, out, n_in / 256),
        // No explicit kernel: the portable code (which LLVM vectorises) is the result.
        GgmlType::MXFP4 => super::fp4::dot_many_mxfp4(row, xs, n_in, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compile-time table equals the run-time [`f16_to_f32`] bit for bit.
    #[test]
    fn f16_table_matches_scalar() {
        for h in 0..=u16::MAX {
            assert_eq!(
                F16_TO_F32[h as usize].to_bits(),
                f16_to_f32(h).to_bits(),
                "{h:#06x}"
            );
        }
    }

    /// [`cvt_f16x8`] equals the scalar [`f16_to_f32`] bit for bit on all 65536 patterns
    /// (NaN payloads and signalling NaNs included).
    #[test]
    fn f16_lanes_match_scalar_for_all_patterns() {
        if !is_x86_feature_detected!("avx2") {
            eprintln!("skipped: no AVX2 on this CPU");
            return;
        }
        #[target_feature(enable = "avx2")]
        unsafe fn lanes(h: &[u16; 8]) -> [u32; 8] {
            let v = cvt_f16x8(_mm256_cvtepu16_epi32(_mm_loadu_si128(h.as_ptr().cast())));
            std::mem::transmute(v)
        }
        for base in (0..=u16::MAX).step_by(8) {
            let h: [u16; 8] = std::array::from_fn(|i| base + i as u16);
            let got = unsafe { lanes(&h) };
            for i in 0..8 {
                assert_eq!(got[i], f16_to_f32(h[i]).to_bits(), "{:#06x}", h[i]);
            }
        }
    }

    /// F16C's `vcvtph2ps` is not a drop-in for [`f16_to_f32`]: it quiets signalling NaNs
    /// (sets mantissa bit 22), while the scalar decoder keeps the payload as numpy does.
    /// Everything else (zeros, subnormals, normals, inf, quiet NaNs) matches. This test
    /// records that finding; the kernels therefore use [`cvt_f16x8`].
    #[test]
    fn f16c_differs_only_on_signalling_nans() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
            eprintln!("skipped: no AVX2/F16C on this CPU");
            return;
        }
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn lanes(h: &[u16; 8]) -> [u32; 8] {
            std::mem::transmute(_mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast())))
        }
        let mut differ = 0;
        for base in (0..=u16::MAX).step_by(8) {
            let h: [u16; 8] = std::array::from_fn(|i| base + i as u16);
            let got = unsafe { lanes(&h) };
            for i in 0..8 {
                let want = f16_to_f32(h[i]).to_bits();
                let is_snan = h[i] & 0x7e00 == 0x7c00 && h[i] & 0x1ff != 0;
                if is_snan {
                    assert_eq!(got[i], want | 0x0040_0000, "{:#06x}", h[i]);
                    differ += (got[i] != want) as usize;
                } else {
                    assert_eq!(got[i], want, "{:#06x}", h[i]);
                }
            }
        }
        assert_eq!(differ, 2 * 511);
    }
}
