//! MXFP4, the OCP microscaling FP4 type as ggml stores it (GGUF type 39; llama.cpp's
//! `MXFP4_MOE` files hold their expert weights in it).
//!
//! Block layout (17 bytes for 32 weights):
//!
//! ```text
//! mxfp4  17 B: e: u8 (E8M0) | qs: [u8; 16]   w[j]    = E2M1[qs[j] & 0xF] · 2^(e − 127)
//!                                             w[j+16] = E2M1[qs[j] >> 4]  · 2^(e − 127)
//! ```
//!
//! E2M1 codes are sign | 2 exponent bits | 1 mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
//! ggml keeps them doubled as integers (`kvalues_mxfp4`) and halves the scale instead
//! (`GGML_E8M0_TO_FP32_HALF`: 2^(e − 128), subnormal for e < 2); the products are the same
//! exact numbers, and this module evaluates ggml's expressions (an i8 times the half scale,
//! in f32), so dequantization is bit-exact with `dequantize_row_mxfp4`. Nibble order as in
//! q4_0: low nibbles the first half of the block, high nibbles the second.
//!
//! Every MXFP4 weight has at most two significant bits, so it is exactly representable in
//! BF16 (same exponent range as f32): a backend without MXFP4 kernels may run the weights as
//! BF16 and compute on the very same values.

use super::{dot_impl, dot_many_impl};
use crate::{FormatError, Result};

pub const QK_MXFP4: usize = 32;
pub const MXFP4_BYTES: usize = 1 + QK_MXFP4 / 2;

/// ggml's `kvalues_mxfp4`: the E2M1 values times two, by code.
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `GGML_E8M0_TO_FP32_HALF`: 2^(e − 128) as an f32 (subnormal for e = 0 and 1).
#[inline(always)]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

#[inline(always)]
pub(crate) fn dequant_block_mxfp4(b: &[u8; MXFP4_BYTES], out: &mut [f32; QK_MXFP4]) {
    let d = e8m0_to_f32_half(b[0]);
    let (lo, hi) = out.split_at_mut(QK_MXFP4 / 2);
    for ((q, o0), o1) in b[1..].iter().zip(lo).zip(hi) {
        *o0 = f32::from(KVALUES_MXFP4[usize::from(q & 0xF)]) * d;
        *o1 = f32::from(KVALUES_MXFP4[usize::from(q >> 4)]) * d;
    }
}

/// ggml's `best_index_mxfp4`: the first code whose value is nearest `x` (strict `<`).
#[inline(always)]
fn best_index(x: f32, d: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (f32::from(KVALUES_MXFP4[0]) * d - x).abs();
    for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
        let err = (f32::from(k) * d - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// `quantize_row_mxfp4_ref`: e = ⌊log2 amax⌋ − 2 + 127 (0 for an all-zero block), each
/// weight the nearest code. ggml casts the exponent with C's `(uint8_t)`, undefined outside
/// 0..=255; here it saturates (only blocks with amax < 2⁻¹²⁵ or > 2¹²⁸ reach that).
pub(crate) fn quant_block_mxfp4(x: &[f32; QK_MXFP4], out: &mut [u8; MXFP4_BYTES]) {
    let mut amax = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
        }
    }
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0) as u8
    } else {
        0
    };
    let d = e8m0_to_f32_half(e);
    out[0] = e;
    for j in 0..QK_MXFP4 / 2 {
        out[1 + j] = best_index(x[j], d) | (best_index(x[j + QK_MXFP4 / 2], d) << 4);
    }
}

#[inline(always)]
pub(crate) fn dot_mxfp4(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, dequant_block_mxfp4)
}

#[inline(always)]
pub(crate) fn dot_many_mxfp4(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, dequant_block_mxfp4)
}

/// MXFP4 blocks rewritten as Q8_0 blocks of the same 32 weights, exactly: a Q8_0 block's
/// int8 values are ggml's doubled codes (`KVALUES_MXFP4`, ±12 at most) and its f16 scale the
/// half scale 2^(e − 128), which f16 holds exactly for e in 104..=143 (2^−24 ..= 2^15), so
/// Q8_0's dequantization (i8 · f32(d)) gives MXFP4's numbers bit for bit. 34 bytes against
/// MXFP4's 17 but BF16's 64: a backend with Q8_0 kernels and no MXFP4 ones runs the same
/// weights at half of BF16's bytes. Returns `None` when a block with a nonzero code has its
/// scale outside that range (the caller keeps another form); all-zero blocks take d = 0.
pub fn mxfp4_to_q8_0(src: &[u8]) -> Option<Vec<u8>> {
    use super::legacy::Q8_0_BYTES;
    if !src.len().is_multiple_of(MXFP4_BYTES) {
        return None;
    }
    let mut out = vec![0u8; src.len() / MXFP4_BYTES * Q8_0_BYTES];
    for (b, o) in src
        .chunks_exact(MXFP4_BYTES)
        .zip(out.chunks_exact_mut(Q8_0_BYTES))
    {
        let qs = &b[1..];
        let d = if qs.iter().all(|&q| q & 0x77 == 0) {
            // Codes 0 and 8 are ±0: every weight is zero whatever the scale.
            half::f16::ZERO
        } else if (104..=143).contains(&b[0]) {
            let d = half::f16::from_f32(e8m0_to_f32_half(b[0]));
            debug_assert_eq!(d.to_f32(), e8m0_to_f32_half(b[0]));
            d
        } else {
            return None;
        };
        o[..2].copy_from_slice(&d.to_le_bytes());
        for (j, &q) in qs.iter().enumerate() {
            o[2 + j] = KVALUES_MXFP4[usize::from(q & 0xF)] as u8;
            o[2 + j + QK_MXFP4 / 2] = KVALUES_MXFP4[usize::from(q >> 4)] as u8;
        }
    }
    Some(out)
}

/// Weights per NVFP4 scale.
pub const NVFP4_GROUP: usize = 16;

/// Dequantizes an NVFP4 weight as NVIDIA's ModelOpt checkpoints store it to BF16
/// (little-endian bytes). `packed` holds two E2M1 codes a byte, the element of even index
/// in the low nibble, in a row-major `[…, rows, cols / 2]` tensor (`packed_shape`); `scales`
/// one E4M3 code per 16 weights of a row (`[…, rows, cols / 16]`), and `global` the tensor's
/// `weight_scale_2`. A weight is `E2M1 · e4m3(scale) · global`: the first product is exact
/// (six significant bits), the second is rounded to f32 and then to BF16 (nearest-even).
/// Returns the bytes and the weight's shape (`cols` = twice the packed width).
pub fn nvfp4_to_bf16(
    name: &str,
    packed: &[u8],
    packed_shape: &[usize],
    scales: &[u8],
    scale_shape: &[usize],
    global: f32,
) -> Result<(Vec<u8>, Vec<usize>)> {
    let bad = |what: String| FormatError::BadTensor {
        name: name.to_owned(),
        what,
    };
    let Some((&half_cols, lead)) = packed_shape.split_last() else {
        return Err(bad("NVFP4 weight with no dimensions".into()));
    };
    let cols = 2 * half_cols;
    let mut shape = lead.to_vec();
    shape.push(cols);
    let mut want = lead.to_vec();
    want.push(cols.div_ceil(NVFP4_GROUP));
    if scale_shape != want.as_slice() || packed.len() != shape.iter().product::<usize>() / 2 {
        return Err(bad(format!(
            "NVFP4 weight of packed shape {packed_shape:?} needs E4M3 scales of shape \
             {want:?} (one per {NVFP4_GROUP} weights), found {scale_shape:?}"
        )));
    }
    if !global.is_finite() {
        return Err(bad(format!("NVFP4 global scale {global} is not finite")));
    }
    if let Some(i) = scales.iter().position(|&c| c & 0x7f == 0x7f) {
        return Err(bad(format!("NVFP4 scale {i} is NaN")));
    }
    let groups = want.last().copied().unwrap_or(0);
    let mut out = vec![0u8; packed.len() * 4];
    if half_cols == 0 {
        return Ok((out, shape));
    }
    // Row by row, in parallel; a group's 16 weights are 8 bytes and share a scale.
    use rayon::prelude::*;
    out.par_chunks_mut(4 * half_cols)
        .zip(packed.par_chunks(half_cols))
        .zip(scales.par_chunks(groups))
        .for_each(|((o, p), sc)| {
            for ((o, p), &sc) in o
                .chunks_mut(2 * NVFP4_GROUP)
                .zip(p.chunks(NVFP4_GROUP / 2))
                .zip(sc)
            {
                let s = super::fp8::e4m3_to_f32(sc);
                for (o, &b) in o.chunks_exact_mut(4).zip(p) {
                    for (o, nib) in o.chunks_exact_mut(2).zip([b & 0xF, b >> 4]) {
                        let v = f32::from(KVALUES_MXFP4[usize::from(nib)]) * 0.5 * s * global;
                        o.copy_from_slice(&super::float::f32_to_bf16(v).to_le_bytes());
                    }
                }
            }
        });
    Ok((out, shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The E2M1 value of a code from its bit fields (sign, 2 exponent bits with bias 1,
    /// 1 mantissa bit; exponent 0 subnormal), independent of the table.
    fn e2m1(code: u8) -> f32 {
        let sign = if code & 8 != 0 { -1.0 } else { 1.0 };
        let (exp, man) = ((code >> 1) & 3, f32::from(code & 1));
        sign * if exp == 0 {
            man * 0.5
        } else {
            (1.0 + man * 0.5) * f32::powi(2.0, i32::from(exp) - 1)
        }
    }

    #[test]
    fn table_and_scale_are_the_ocp_values() {
        for c in 0..16u8 {
            assert_eq!(
                f32::from(KVALUES_MXFP4[usize::from(c)]) * 0.5,
                e2m1(c),
                "{c}"
            );
        }
        for e in 0..=254u8 {
            // 2^(e − 127) / 2, subnormals included.
            assert_eq!(
                e8m0_to_f32_half(e) as f64,
                2f64.powi(i32::from(e) - 128),
                "{e}"
            );
        }
    }

    #[test]
    fn nvfp4_weights_decode() {
        // One row of 32 weights (two groups) packed in 16 bytes: element 2j in the low
        // nibble of byte j. Group scales 2 and 0.5 (E4M3 0x40 and 0x30), global 0.25.
        let packed: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        let (out, shape) =
            nvfp4_to_bf16("w", &packed, &[1, 16], &[0x40, 0x30], &[1, 2], 0.25).unwrap();
        assert_eq!(shape, vec![1, 32]);
        for c in 0..32 {
            let code = if c % 2 == 0 {
                (c / 2) as u8
            } else {
                15 - (c / 2) as u8
            };
            let s = if c < 16 { 2.0 } else { 0.5 };
            let got = half::bf16::from_le_bytes([out[2 * c], out[2 * c + 1]]).to_f32();
            assert_eq!(got, e2m1(code) * s * 0.25, "{c}");
        }
        let e = nvfp4_to_bf16("w", &packed, &[1, 16], &[0x40], &[1, 1], 1.0).unwrap_err();
        assert!(
            format!("{e}").contains("needs E4M3 scales of shape [1, 2]"),
            "{e}"
        );
        let e = nvfp4_to_bf16("w", &packed, &[1, 16], &[0x40, 0x7f], &[1, 2], 1.0).unwrap_err();
        assert!(format!("{e}").contains("scale 1 is NaN"), "{e}");
    }

    /// Every code at every scale f16 holds: the Q8_0 blocks decode to the MXFP4 blocks'
    /// numbers bit for bit (code 8, E2M1's −0, is 0 in ggml's doubled codes, so in both); a
    /// scale outside that range with a nonzero code is refused, and all-zero blocks are kept
    /// whatever their scale.
    #[test]
    fn mxfp4_rewritten_as_q8_0_decodes_to_the_same_numbers() {
        let mut src = Vec::new();
        for e in 104u8..=143 {
            let mut b = [0u8; MXFP4_BYTES];
            b[0] = e;
            for j in 0..16 {
                b[1 + j] = ((j as u8 + e) & 0xF) | (((15 - j as u8) ^ e) & 0xF) << 4;
            }
            src.extend_from_slice(&b);
        }
        // Zero blocks at scales out of f16's range.
        for e in [0u8, 1, 103, 144, 255] {
            let mut b = [0u8; MXFP4_BYTES];
            b[0] = e;
            b[5] = 0x88; // −0 twice
            src.extend_from_slice(&b);
        }
        let q8 = mxfp4_to_q8_0(&src).expect("every scale in range");
        let n = src.len() / MXFP4_BYTES * QK_MXFP4;
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        crate::quant::dequantize(crate::GgmlType::MXFP4, &src, &mut a).unwrap();
        crate::quant::dequantize(crate::GgmlType::Q8_0, &q8, &mut b).unwrap();
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(x == y, "weight {i}: mxfp4 {x:e} vs q8_0 {y:e}");
        }
        for e in [103u8, 144] {
            let mut b = [0u8; MXFP4_BYTES];
            b[0] = e;
            b[1] = 1;
            assert!(mxfp4_to_q8_0(&b).is_none(), "scale {e}");
        }
    }

    #[test]
    fn blocks_decode_and_round_trip() {
        // A hand-built block: scale 2^(130 − 127) = 8, codes 0..15 then 15..0.
        let mut b = [0u8; MXFP4_BYTES];
        b[0] = 130;
        for j in 0..16 {
            b[1 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut w = [0f32; QK_MXFP4];
        dequant_block_mxfp4(&b, &mut w);
        for j in 0..16 {
            assert_eq!(w[j], e2m1(j as u8) * 8.0);
            assert_eq!(w[j + 16], e2m1(15 - j as u8) * 8.0);
        }
        // Values on the grid quantize back to themselves (the block's largest magnitude,
        // 6 · 8 = 48, gives e = ⌊log2 48⌋ − 2 + 127 = 130).
        let mut q = [0u8; MXFP4_BYTES];
        quant_block_mxfp4(&w, &mut q);
        let mut back = [0f32; QK_MXFP4];
        dequant_block_mxfp4(&q, &mut back);
        assert_eq!(back, w);
        assert_eq!(q[0], 130);
        // An all-zero block.
        quant_block_mxfp4(&[0.0; QK_MXFP4], &mut q);
        assert_eq!(q, [0u8; MXFP4_BYTES]);
    }
}
