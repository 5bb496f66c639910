//! The unquantized element types: f32, f16, bf16 (ggml block size 1).
//!
//! Layouts (little-endian, one element per "block"):
//!
//! | type | bytes | encoding                                                         |
//! |------|-------|------------------------------------------------------------------|
//! | f32  | 4     | IEEE binary32                                                    |
//! | f16  | 2     | IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits    |
//! | bf16 | 2     | the top 16 bits of a binary32 (1 sign, 8 exponent, 7 mantissa)  |
//!
//! Decoding is exact for all three (every f16/bf16 value, NaN payloads included, is an f32).
//! Encoding follows ggml: f32 → f16 rounds to nearest, ties to even (`GGML_FP32_TO_FP16`,
//! numpy's `astype(float16)`); f32 → bf16 is `ggml_compute_fp32_to_bf16`: NaN is made quiet
//! by setting mantissa bit 6, everything else rounds to nearest even (subnormals kept, no
//! flush to zero).
//!
//! The dot products treat a float row as pseudo-blocks of [`FLOAT_DOT_CHUNK`] elements so
//! they share the blocked summation order of the quantized types (see `quant::dot`).

use super::{dot_impl, dot_many_impl};

/// Elements per pseudo-block when a float row goes through the blocked dot product.
pub(crate) const FLOAT_DOT_CHUNK: usize = 32;

/// 2^112: rescales a binary16 exponent/mantissa shifted into binary32 position (bias 15 → 127).
const F16_REBIAS: f32 = f32::from_bits((127 + 112) << 23);

/// Exact binary16 → binary32 (all 65536 inputs; NaN payloads preserved like numpy does).
///
/// Branch-free except for one select, so loops over f16 rows vectorise. For normal and
/// subnormal inputs, the 15 exponent+mantissa bits shifted left by 13 form a binary32 that is
/// 2^-112 times the value (a binary32 subnormal when the f16 is subnormal); multiplying by
/// 2^112 is exact because the result is representable.
#[inline(always)]
pub const fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    let bits = if em >= 0x7c00 {
        // inf / NaN: max exponent, keep the mantissa (NaN payload)
        (em << 13) | 0x7f80_0000
    } else {
        (f32::from_bits(em << 13) * F16_REBIAS).to_bits()
    };
    f32::from_bits(bits | sign)
}

/// binary32 → binary16, round to nearest even (ggml `GGML_FP32_TO_FP16`).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// Exact bf16 → binary32.
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// binary32 → bf16 exactly as `ggml_compute_fp32_to_bf16`.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        // NaN: truncate and force it quiet (a truncated signalling NaN could become inf)
        return ((u >> 16) | 64) as u16;
    }
    // cannot overflow: the largest non-NaN pattern is 0xff80_0000
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

#[inline(always)]
fn le_u16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

pub(crate) fn dequantize_f32(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

pub(crate) fn dequantize_f16(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
        *o = f16_to_f32(le_u16(b));
    }
}

pub(crate) fn dequantize_bf16(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
        *o = bf16_to_f32(le_u16(b));
    }
}

pub(crate) fn quantize_f32(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(4)) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f32_to_f16(*v).to_le_bytes());
    }
}

pub(crate) fn quantize_bf16(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
    }
}

// Pseudo-block decoders for the dot products: FLOAT_DOT_CHUNK elements at a time.

#[inline(always)]
fn chunk_f32(b: &[u8; 4 * FLOAT_DOT_CHUNK], out: &mut [f32; FLOAT_DOT_CHUNK]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

#[inline(always)]
fn chunk_f16(b: &[u8; 2 * FLOAT_DOT_CHUNK], out: &mut [f32; FLOAT_DOT_CHUNK]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = f16_to_f32(le_u16(c));
    }
}

#[inline(always)]
fn chunk_bf16(b: &[u8; 2 * FLOAT_DOT_CHUNK], out: &mut [f32; FLOAT_DOT_CHUNK]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = bf16_to_f32(le_u16(c));
    }
}

#[inline(always)]
pub(crate) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, chunk_f32)
}
#[inline(always)]
pub(crate) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, chunk_f16)
}
#[inline(always)]
pub(crate) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, chunk_bf16)
}
#[inline(always)]
pub(crate) fn dot_many_f32(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, chunk_f32)
}
#[inline(always)]
pub(crate) fn dot_many_f16(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, chunk_f16)
}
#[inline(always)]
pub(crate) fn dot_many_bf16(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, chunk_bf16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_decode_matches_half_for_all_bit_patterns() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
                // numpy keeps the payload: sign | 0x7f800000 | mantissa << 13
                let want = ((h as u32 & 0x8000) << 16) | 0x7f80_0000 | ((h as u32 & 0x3ff) << 13);
                assert_eq!(ours.to_bits(), want, "{h:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn bf16_rounding() {
        // ties to even: 1 + 2^-8 is exactly halfway between two bf16 values → rounds down to 1
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        // ...and 1 + 3·2^-8 rounds up to the even neighbour
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        // signalling NaN with payload only in the low bits stays a NaN
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(bf16_to_f32(0xc040), -3.0);
    }
}
