//! The legacy 32-element block types: q4_0, q4_1, q8_0.
//!
//! Block layouts (little-endian, packed, no padding), `QK = 32` weights per block:
//!
//! ```text
//! q4_0  18 B: d: f16 | qs: [u8; 16]          w[j]    = (qs[j] & 0xF  - 8) * d     j in 0..16
//!                                             w[j+16] = (qs[j] >> 4   - 8) * d
//! q4_1  20 B: d: f16 | m: f16 | qs: [u8; 16] w[j]    = (qs[j] & 0xF) * d + m
//!                                             w[j+16] = (qs[j] >> 4)  * d + m
//! q8_0  34 B: d: f16 | qs: [i8; 32]          w[j]    = qs[j] * d
//! ```
//!
//! Note the nibble order: the low nibbles hold the first half of the block, the high nibbles
//! the second half (not interleaved pairs).
//!
//! Dequantization evaluates exactly the expressions of ggml's `dequantize_row_*` (in f32, no
//! fused multiply-add), so it is bit-exact. The quantizers are ports of ggml's
//! `quantize_row_*_ref` (bit-exact with them and with gguf-py's numpy versions; checked by
//! `tests/quant_vectors.rs`).

use super::float::{f16_to_f32, f32_to_f16};
use super::{dot_impl, dot_many_impl};

pub const QK: usize = 32;
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q8_0_BYTES: usize = 34;

#[inline(always)]
fn le_f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// C's `(int8_t)(float)` as compiled on the platforms ggml targets: truncate toward zero to
/// an int, keep the low 8 bits. Only called with values in [0, 17) for finite inputs.
#[inline(always)]
fn c_trunc_i8(v: f32) -> i8 {
    v as i32 as i8
}

// ---------------------------------------------------------------- dequantize one block

#[inline(always)]
pub(crate) fn dequant_block_q4_0(b: &[u8; Q4_0_BYTES], out: &mut [f32; QK]) {
    let d = le_f16(b, 0);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((q, o0), o1) in b[2..].iter().zip(lo).zip(hi) {
        *o0 = ((q & 0xF) as i32 - 8) as f32 * d;
        *o1 = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

#[inline(always)]
pub(crate) fn dequant_block_q4_1(b: &[u8; Q4_1_BYTES], out: &mut [f32; QK]) {
    let d = le_f16(b, 0);
    let m = le_f16(b, 2);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((q, o0), o1) in b[4..].iter().zip(lo).zip(hi) {
        *o0 = (q & 0xF) as f32 * d + m;
        *o1 = (q >> 4) as f32 * d + m;
    }
}

#[inline(always)]
pub(crate) fn dequant_block_q8_0(b: &[u8; Q8_0_BYTES], out: &mut [f32; QK]) {
    let d = le_f16(b, 0);
    for (q, o) in b[2..].iter().zip(out.iter_mut()) {
        *o = (*q as i8) as f32 * d;
    }
}

// ---------------------------------------------------------------- quantize one block

/// `quantize_row_q4_0_ref`: d = (the value of largest magnitude) / -8, so that value maps
/// exactly to nibble 0 and the grid is asymmetric towards it.
pub(crate) fn quant_block_q4_0(x: &[f32; QK], out: &mut [u8; Q4_0_BYTES]) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        // strict `<`: the first of equal magnitudes wins, as in ggml
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    // the unrounded d (not its f16) scales the quants, as in ggml
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for j in 0..QK / 2 {
        let xi0 = c_trunc_i8(x[j] * id + 8.5).min(15) as u8;
        let xi1 = c_trunc_i8(x[j + QK / 2] * id + 8.5).min(15) as u8;
        out[2 + j] = xi0 | (xi1 << 4);
    }
}

/// `quantize_row_q4_1_ref`: min/max affine grid with 15 steps.
pub(crate) fn quant_block_q4_1(x: &[f32; QK], out: &mut [u8; Q4_1_BYTES]) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    out[2..4].copy_from_slice(&f32_to_f16(min).to_le_bytes());
    for j in 0..QK / 2 {
        let xi0 = c_trunc_i8((x[j] - min) * id + 0.5).min(15) as u8;
        let xi1 = c_trunc_i8((x[j + QK / 2] - min) * id + 0.5).min(15) as u8;
        out[4 + j] = xi0 | (xi1 << 4);
    }
}

/// `quantize_row_q8_0_ref`: symmetric, d = amax / 127, round half away from zero (`roundf`).
pub(crate) fn quant_block_q8_0(x: &[f32; QK], out: &mut [u8; Q8_0_BYTES]) {
    let mut amax = 0.0f32;
    for &v in x {
        // C's MAX(a, b) is `a > b ? a : b`
        let a = v.abs();
        amax = if amax > a { amax } else { a };
    }
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (v, o) in x.iter().zip(out[2..].iter_mut()) {
        // f32::round rounds half away from zero, like C's roundf
        *o = ((v * id).round() as i8) as u8;
    }
}

// ---------------------------------------------------------------- row drivers

#[inline(always)]
pub(crate) fn dot_q4_0(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, dequant_block_q4_0)
}
#[inline(always)]
pub(crate) fn dot_q4_1(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, dequant_block_q4_1)
}
#[inline(always)]
pub(crate) fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, dequant_block_q8_0)
}
#[inline(always)]
pub(crate) fn dot_many_q4_0(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, dequant_block_q4_0)
}
#[inline(always)]
pub(crate) fn dot_many_q4_1(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, dequant_block_q4_1)
}
#[inline(always)]
pub(crate) fn dot_many_q8_0(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, dequant_block_q8_0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(v: f32) -> [u8; 2] {
        f32_to_f16(v).to_le_bytes()
    }

    #[test]
    fn q4_0_hand_block() {
        // d = 0.5; qs[j] = low nibble j, high nibble 15 - j
        let mut b = [0u8; Q4_0_BYTES];
        b[..2].copy_from_slice(&f16b(0.5));
        for j in 0..16 {
            b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut w = [0.0; QK];
        dequant_block_q4_0(&b, &mut w);
        for j in 0..16 {
            assert_eq!(w[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(w[j + 16], (7.0 - j as f32) * 0.5);
        }
    }

    #[test]
    fn q4_1_hand_block() {
        let mut b = [0u8; Q4_1_BYTES];
        b[..2].copy_from_slice(&f16b(0.25));
        b[2..4].copy_from_slice(&f16b(-1.0));
        b[4] = 0xF3; // w[0] = 3*0.25 - 1, w[16] = 15*0.25 - 1
        let mut w = [0.0; QK];
        dequant_block_q4_1(&b, &mut w);
        assert_eq!(w[0], -0.25);
        assert_eq!(w[16], 2.75);
        assert_eq!(w[1], -1.0);
    }

    #[test]
    fn q8_0_quantize_hand_block() {
        // amax 127 → d = 1, values round half away from zero
        let mut x = [0.0f32; QK];
        x[0] = 127.0;
        x[1] = -2.5;
        x[2] = 2.5;
        x[3] = -127.0;
        let mut b = [0u8; Q8_0_BYTES];
        quant_block_q8_0(&x, &mut b);
        assert_eq!(&b[..2], &f16b(1.0));
        assert_eq!(b[2] as i8, 127);
        assert_eq!(b[3] as i8, -3);
        assert_eq!(b[4] as i8, 3);
        assert_eq!(b[5] as i8, -127);
    }

    #[test]
    fn q4_0_quantize_maps_extreme_to_zero_nibble() {
        let mut x = [0.0f32; QK];
        x[5] = -4.0; // largest magnitude, negative → d = 0.5, maps to nibble 0
        x[20] = 3.0;
        let mut b = [0u8; Q4_0_BYTES];
        quant_block_q4_0(&x, &mut b);
        let mut w = [0.0; QK];
        dequant_block_q4_0(&b, &mut w);
        assert_eq!(b[2 + 5] & 0xF, 0);
        assert_eq!(w[5], -4.0);
        assert_eq!(w[20], 3.0); // on the grid (d = 0.5)
        assert_eq!(w[0], 0.0);
    }
}
