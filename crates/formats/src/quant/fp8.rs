//! FP8 E4M3 weights with block scales, as Hugging Face "fine-grained FP8" checkpoints store
//! them (Qwen3 / Qwen3.5 `-FP8` releases, DeepSeek-V3): `X.weight` holds `float8_e4m3fn`
//! codes, `X.weight_scale_inv` one scale per `block[0] × block[1]` tile of the last two
//! dimensions (`[…, ⌈rows / block[0]⌉, ⌈cols / block[1]⌉]`; a partial tile at the edge has
//! its own scale), and the weight is `e4m3(code) × scale`. (`scale_inv` is the inverse of
//! the quantizer's divisor: the stored number multiplies.)
//!
//! E4M3FN: one sign bit, four exponent bits (bias 7), three mantissa bits; no infinities;
//! `S.1111.111` is NaN; exponent 0 is subnormal (`m / 8 × 2⁻⁶`). Largest finite: 448.
//!
//! ferrite computes these weights in BF16: [`dequantize_block_scaled_bf16`] forms each
//! product in f32 (exact: a 4-bit significand times the scale's) and rounds it to BF16 to
//! nearest-even, as the reference dequantizers of the checkpoints' authors do before a BF16
//! matmul. The rounding is ≤ 2⁻⁹ relative, well under the FP8 code's own step (2⁻⁴).

use crate::{FormatError, Result};

/// Largest finite E4M3FN value.
pub const E4M3_MAX: f32 = 448.0;

/// The value of one E4M3FN code (NaN for the two NaN codes).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = (code >> 3) & 0x0f;
    let man = (code & 0x07) as f32;
    if exp == 0x0f && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        // Subnormal: m / 8 × 2^(1 − 7).
        sign * man * (1.0 / 8.0) * (1.0 / 64.0)
    } else {
        sign * (1.0 + man / 8.0) * f32::powi(2.0, i32::from(exp) - 7)
    }
}

/// The E4M3FN code nearest to `x` (ties to the even code), saturating at ±448; NaN maps to
/// the NaN code. The reference quantizer (tests and `synth` write checkpoints with it).
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // The 127 finite non-negative codes are monotone in value: the nearest is one of the
    // two around `a`; a tie goes to the code with the even mantissa (the even code).
    let (mut lo, mut hi) = (0u8, 0x7eu8);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (vl, vh) = (e4m3_to_f32(lo), e4m3_to_f32(hi));
    let code = if a - vl < vh - a || (a - vl == vh - a && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | code
}

/// Dequantizes a block-scaled FP8 tensor to BF16 (little-endian bytes, the tensor's shape).
///
/// `shape` is the weight's row-major shape (at least two dims: the last two are the tiled
/// matrix, leading dims are a batch such as stacked experts); `scales` (f32) has the shape
/// `scale_shape`, which must be the weight's leading dims followed by
/// `[⌈rows / block[0]⌉, ⌈cols / block[1]⌉]`. A NaN code or a non-finite scale is refused:
/// a checkpoint holding one is corrupt.
pub fn dequantize_block_scaled_bf16(
    name: &str,
    codes: &[u8],
    shape: &[usize],
    scales: &[f32],
    scale_shape: &[usize],
    block: [usize; 2],
) -> Result<Vec<u8>> {
    let bad = |what: String| FormatError::BadTensor {
        name: name.to_owned(),
        what,
    };
    let n = shape.len();
    if n < 2 || block[0] == 0 || block[1] == 0 {
        return Err(bad(format!(
            "FP8 weight of shape {shape:?} with block {block:?}: needs two or more dims and \
             non-empty blocks"
        )));
    }
    let (rows, cols) = (shape[n - 2], shape[n - 1]);
    let (srows, scols) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let mut want = shape[..n - 2].to_vec();
    want.extend([srows, scols]);
    if scale_shape != want.as_slice() {
        return Err(bad(format!(
            "FP8 weight of shape {shape:?} in {}x{} blocks needs scales of shape {want:?}, \
             found {scale_shape:?}",
            block[0], block[1]
        )));
    }
    let total: usize = shape.iter().product();
    if codes.len() != total || scales.len() != want.iter().product::<usize>() {
        return Err(bad(format!(
            "FP8 weight of shape {shape:?} has {} bytes and {} scales",
            codes.len(),
            scales.len()
        )));
    }
    if let Some(s) = scales.iter().find(|s| !s.is_finite()) {
        return Err(bad(format!("FP8 block scale {s} is not finite")));
    }
    if let Some(i) = codes.iter().position(|&c| c & 0x7f == 0x7f) {
        return Err(bad(format!("FP8 code at element {i} is NaN")));
    }
    let table: [f32; 256] = std::array::from_fn(|c| e4m3_to_f32(c as u8));
    let mut out = vec![0u8; total * 2];
    if cols == 0 {
        return Ok(out);
    }
    // Row by row (in parallel: a checkpoint's billions of weights are decoded at load), each
    // row in runs of `block[1]` codes that share a scale.
    use rayon::prelude::*;
    out.par_chunks_mut(2 * cols)
        .zip(codes.par_chunks(cols))
        .enumerate()
        .for_each(|(row, (o, c))| {
            let (b, r) = (row / rows, row % rows);
            let srow = &scales[(b * srows + r / block[0]) * scols..][..scols];
            for ((o, c), &s) in o.chunks_mut(2 * block[1]).zip(c.chunks(block[1])).zip(srow) {
                for (o, &c) in o.chunks_exact_mut(2).zip(c) {
                    let v = super::float::f32_to_bf16(table[usize::from(c)] * s);
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x80), 0.0);
        assert!(e4m3_to_f32(0x80).is_sign_negative());
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exponent 7 = bias
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9)); // largest subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(e4m3_to_f32(0x3c), 1.5);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        // Finite non-negative codes increase with the code.
        for c in 0..0x7eu8 {
            assert!(e4m3_to_f32(c) < e4m3_to_f32(c + 1), "code {c:#x}");
        }
    }

    #[test]
    fn encode_round_trips_and_rounds_to_nearest_even() {
        for c in 0..=255u8 {
            if c & 0x7f == 0x7f {
                continue;
            }
            let v = e4m3_to_f32(c);
            // -0 encodes as 0x80 and +0 as 0x00: the code itself comes back.
            assert_eq!(f32_to_e4m3(v), c, "code {c:#x} value {v}");
        }
        assert_eq!(f32_to_e4m3(1000.0), 0x7e); // saturates
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
        // 1.0625 lies halfway between 1.0 (0x38, mantissa 0) and 1.125 (0x39): to 1.0.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        // 1.1875 lies halfway between 1.125 (0x39) and 1.25 (0x3a): to 1.25.
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        assert_eq!(f32_to_e4m3(1.07), 0x39);
        // Below half the smallest subnormal: zero; at 0.75 of it: the subnormal.
        assert_eq!(f32_to_e4m3(2f32.powi(-11)), 0x00);
        assert_eq!(f32_to_e4m3(0.75 * 2f32.powi(-9)), 0x01);
    }

    #[test]
    fn block_scaled_dequantization() {
        // 3 x 5 weight in 2 x 2 blocks: scales 2 x 3, each tile (partial ones included)
        // multiplied by its own scale.
        let shape = [3, 5];
        let codes: Vec<u8> = (0..15).map(|i| f32_to_e4m3(i as f32 - 7.0)).collect();
        let scales = [1.0f32, 2.0, 4.0, 0.5, 0.25, 8.0];
        let out =
            dequantize_block_scaled_bf16("w", &codes, &shape, &scales, &[2, 3], [2, 2]).unwrap();
        for r in 0..3 {
            for c in 0..5 {
                let i = r * 5 + c;
                let got = half::bf16::from_bits(u16::from_le_bytes([out[2 * i], out[2 * i + 1]]));
                let want = (i as f32 - 7.0) * scales[(r / 2) * 3 + c / 2];
                assert_eq!(got.to_f32(), want, "({r}, {c})");
            }
        }
        // Wrong scale shape, NaN code, non-finite scale: refused with the tensor's name.
        let e = dequantize_block_scaled_bf16("w", &codes, &shape, &scales, &[3, 2], [2, 2]);
        assert!(format!("{}", e.unwrap_err()).contains("needs scales of shape [2, 3]"));
        let mut nan = codes.clone();
        nan[4] = 0xff;
        let e = dequantize_block_scaled_bf16("w", &nan, &shape, &scales, &[2, 3], [2, 2]);
        assert!(format!("{}", e.unwrap_err()).contains("element 4 is NaN"));
        let mut inf = scales;
        inf[5] = f32::INFINITY;
        let e = dequantize_block_scaled_bf16("w", &codes, &shape, &inf, &[2, 3], [2, 2]);
        assert!(format!("{}", e.unwrap_err()).contains("not finite"));
    }
}
