//! The K-quant super-block types: q4_K, q5_K, q6_K (`QK_K = 256` weights per block).
//!
//! Block layouts (little-endian, packed, no padding):
//!
//! ```text
//! q4_K 144 B: d: f16 | dmin: f16 | scales: [u8; 12] | qs: [u8; 128]
//! q5_K 176 B: d: f16 | dmin: f16 | scales: [u8; 12] | qh: [u8; 32] | qs: [u8; 128]
//! q6_K 210 B: ql: [u8; 128] | qh: [u8; 64] | scales: [i8; 16] | d: f16
//! ```
//!
//! q4_K / q5_K: 8 sub-blocks of 32 weights, each with a 6-bit scale `sc` and 6-bit min `m`,
//! packed into `scales` (`get_scale_min`): sub-block j < 4 has `sc = s[j] & 63`,
//! `m = s[j+4] & 63`; j >= 4 has `sc = s[j+4] & 0xF | (s[j-4] >> 6) << 4`,
//! `m = s[j+4] >> 4 | (s[j] >> 6) << 4`. Weight = `(d*sc) * q - (dmin*m)`.
//! Quants come in 64-weight groups g (sub-blocks 2g, 2g+1): `qs[32g + l]` holds weight
//! 64g + l in its low nibble and 64g + 32 + l in its high nibble. q5_K adds a fifth bit:
//! bit 2g of `qh[l]` for weight 64g + l, bit 2g+1 for weight 64g + 32 + l.
//!
//! q6_K: 16 sub-blocks of 16 weights with signed 8-bit scales; weight = `(d*sc) * (q - 32)`
//! with 6-bit q. Per 128-weight half h (ql offset 64h, qh offset 32h), for l in 0..32:
//! weight 128h + l      = ql[l] & 0xF    | (qh[l] >> 0 & 3) << 4
//! weight 128h + 32 + l = ql[l+32] & 0xF | (qh[l] >> 2 & 3) << 4
//! weight 128h + 64 + l = ql[l] >> 4     | (qh[l] >> 4 & 3) << 4
//! weight 128h + 96 + l = ql[l+32] >> 4  | (qh[l] >> 6 & 3) << 4
//!
//! Dequantization evaluates ggml's `dequantize_row_q*_K` expressions in the same order
//! (e.g. q6_K is `(d * sc) * q`, not `d * (sc * q)`), so it is bit-exact with ggml and with
//! gguf-py. The quantizers port `quantize_row_q4_K_ref` / `q5_K_ref` / `q6_K_ref` (the
//! no-imatrix paths: `make_qkx2_quants`, `make_qx_quants` with rmse_type 1) operation for
//! operation. gguf-py (0.19) has no K-quant quantizer, so their byte-exactness is by
//! construction, not checked against an independent implementation; note that a ggml built
//! with FMA contraction (`-march=native` on GCC) may round a few intermediate sums
//! differently, which can flip an occasional quant: these functions follow the C source's
//! unfused semantics.
//!
//! Speed: the reference search is long chains of dependent f32 adds (every sum sequential,
//! which bit-exactness requires). `search_x8` / `search6_x16` run the 8 (16) sub-blocks of a
//! super-block in SIMD lanes, each lane doing the scalar port's operations in its order,
//! tested byte-identical to the straight ports `search_scalar` / `search6_scalar`. Measured
//! on a loaded 2-core AMD EPYC (one core, noisy): q4_K 6 → ~12 MB/s of output, q6_K 18 →
//! ~35-57 MB/s (AVX2 dispatch). That is far from GB/s: tools writing large random-weight
//! files should not push f32 through these quantizers.

use super::float::{f16_to_f32, f32_to_f16};
use super::{dot_impl, dot_many_impl};

pub const QK_K: usize = 256;
pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;

/// ggml's GROUP_MAX_EPS: groups with a smaller max |x| are treated as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

#[inline(always)]
fn le_f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5·2^23 magic number.
/// Exact for |v| <= 2^22 - 1 (ggml asserts that); out-of-range input gives garbage, never
/// a panic.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let val = v + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// `nearest_int(v).clamp(lo, hi) as f32`, computed in f32 so lane loops vectorise without
/// SSE4.1 integer min/max: clamping before rounding gives the same result because rounding
/// is monotone and the bounds are integers; `(v + 1.5·2^23) - 1.5·2^23` rounds to nearest
/// even exactly like `nearest_int` for |v| < 2^22 (the callers' v are at most nmax + 1).
#[inline(always)]
fn round_clamped(v: f32, lo: f32, hi: f32) -> f32 {
    let v = if v < lo { lo } else { v };
    let v = if v > hi { hi } else { v };
    (v + 12_582_912.0) - 12_582_912.0
}

/// 6-bit scale and min of sub-block `j` (0..8) of a q4_K/q5_K `scales` field.
#[inline(always)]
pub(super) fn get_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

// ---------------------------------------------------------------- dequantize one block

#[inline(always)]
pub(crate) fn dequant_block_q4_k(b: &[u8; Q4_K_BYTES], out: &mut [f32; QK_K]) {
    let d = le_f16(b, 0);
    let min = le_f16(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..];
    for (g, (q, o)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (sc1, m1) = get_scale_min(2 * g, scales);
        let (sc2, m2) = get_scale_min(2 * g + 1, scales);
        let (d1, dm1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, dm2) = (d * sc2 as f32, min * m2 as f32);
        let (lo, hi) = o.split_at_mut(32);
        for ((q, o0), o1) in q.iter().zip(lo).zip(hi) {
            *o0 = d1 * (q & 0xF) as f32 - dm1;
            *o1 = d2 * (q >> 4) as f32 - dm2;
        }
    }
}

#[inline(always)]
pub(crate) fn dequant_block_q5_k(b: &[u8; Q5_K_BYTES], out: &mut [f32; QK_K]) {
    let d = le_f16(b, 0);
    let min = le_f16(b, 2);
    let scales = &b[4..16];
    let qh: &[u8] = &b[16..48];
    let qs = &b[48..];
    for (g, (q, o)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (sc1, m1) = get_scale_min(2 * g, scales);
        let (sc2, m2) = get_scale_min(2 * g + 1, scales);
        let (d1, dm1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, dm2) = (d * sc2 as f32, min * m2 as f32);
        let (lo, hi) = o.split_at_mut(32);
        for (((q, h), o0), o1) in q.iter().zip(qh).zip(lo).zip(hi) {
            let h0 = ((h >> (2 * g)) & 1) << 4;
            let h1 = ((h >> (2 * g + 1)) & 1) << 4;
            *o0 = d1 * ((q & 0xF) | h0) as f32 - dm1;
            *o1 = d2 * ((q >> 4) | h1) as f32 - dm2;
        }
    }
}

#[inline(always)]
pub(crate) fn dequant_block_q6_k(b: &[u8; Q6_K_BYTES], out: &mut [f32; QK_K]) {
    let d = le_f16(b, 208);
    let (ql_all, rest) = b.split_at(128);
    let (qh_all, rest) = rest.split_at(64);
    let sc_all = &rest[..16];
    for (half, o) in out.chunks_exact_mut(128).enumerate() {
        let ql = &ql_all[64 * half..64 * half + 64];
        let qh = &qh_all[32 * half..32 * half + 32];
        let sc = &sc_all[8 * half..8 * half + 8];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

// ---------------------------------------------------------------- quantizer helpers

/// Parameters of ggml's `make_qkx2_quants` search (rmin, rdelta, nstep; use_mad = false).
struct Qkx2 {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
}

/// q4_K: `make_qkx2_quants(32, 15, ..., -1.f, 0.1f, 20, false)`.
const Q4_K_SEARCH: Qkx2 = Qkx2 {
    nmax: 15,
    rmin: -1.0,
    rdelta: 0.1,
    nstep: 20,
};
/// q5_K: `make_qkx2_quants(32, 31, ..., -0.5f, 0.1f, 15, false)`.
const Q5_K_SEARCH: Qkx2 = Qkx2 {
    nmax: 31,
    rmin: -0.5,
    rdelta: 0.1,
    nstep: 15,
};

/// ggml `make_qkx2_quants` for n = 32 with squared error: fits x ≈ scale*L - the_min with
/// L in 0..=nmax by weighted least squares over a small grid of candidate inverse scales.
/// Returns (scale, the_min) and writes the quants of the best candidate to `l`.
/// Every sum is accumulated sequentially in f32, in ggml's order, for bit-exactness.
fn make_qkx2_quants(x: &[f32; 32], w: &[f32; 32], l: &mut [u8; 32], p: &Qkx2) -> (f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..32 {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmax = p.nmax as f32;
    let mut iscale = nmax / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..32 {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, p.nmax);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    let mut laux = [0u8; 32];
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + nmax) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..32 {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, p.nmax);
            laux[i] = q as u8;
            let q = q as f32;
            sum_l += w[i] * q;
            sum_l2 += w[i] * q * q;
            sum_xl += w[i] * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..32 {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += w[i] * (diff * diff);
            }
            if cur_error < best_error {
                *l = laux;
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The per-sub-block search of q4_K/q5_K: for each of the 8 sub-blocks, the (scale, min)
/// pair and quants of `make_qkx2_quants`.
type SubBlockSearch = fn(&[f32; QK_K], &Qkx2, &mut [u8; QK_K], &mut [f32; 8], &mut [f32; 8]);

/// Straight port: one sub-block after the other through [`make_qkx2_quants`]. Kept as the
/// reference the lane-parallel [`search_x8`] is tested against.
#[cfg_attr(not(test), allow(dead_code))]
fn search_scalar(
    x: &[f32; QK_K],
    p: &Qkx2,
    l: &mut [u8; QK_K],
    scales: &mut [f32; 8],
    mins: &mut [f32; 8],
) {
    for j in 0..8 {
        let xs: &[f32; 32] = x[32 * j..32 * j + 32]
            .try_into()
            .expect("32-element sub-block");
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        // weights: |x| plus the rms of the sub-block (ggml's no-imatrix choice)
        let w: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        let lj: &mut [u8; 32] = (&mut l[32 * j..32 * j + 32]).try_into().expect("32 quants");
        (scales[j], mins[j]) = make_qkx2_quants(xs, &w, lj, p);
    }
}

fn search_x8(
    x: &[f32; QK_K],
    p: &Qkx2,
    l_out: &mut [u8; QK_K],
    scales: &mut [f32; 8],
    mins: &mut [f32; 8],
) {
    // Same code compiled for AVX2 when the CPU has it: twice the lanes per instruction,
    // identical IEEE results (no FMA is enabled, and Rust never contracts a*b+c anyway).
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the running CPU supports AVX2, checked just above.
        return unsafe { search_x8_avx2(x, p, l_out, scales, mins) };
    }
    search_x8_body(x, p, l_out, scales, mins)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn search_x8_avx2(
    x: &[f32; QK_K],
    p: &Qkx2,
    l_out: &mut [u8; QK_K],
    scales: &mut [f32; 8],
    mins: &mut [f32; 8],
) {
    search_x8_body(x, p, l_out, scales, mins)
}

/// [`search_scalar`] with the 8 sub-blocks in 8 SIMD lanes. Each lane performs exactly the
/// scalar operations in the same order (every sum is still sequential over the 32 weights of
/// its sub-block), so the result is bit-identical; but the 8 independent dependency chains
/// vectorise and hide the f32 add latency that bounds the scalar version.
/// Branches become per-lane selects; a lane that the scalar code would leave early
/// (max == min) computes garbage that is discarded at the end.
#[inline(always)]
fn search_x8_body(
    x: &[f32; QK_K],
    p: &Qkx2,
    l_out: &mut [u8; QK_K],
    scales: &mut [f32; 8],
    mins: &mut [f32; 8],
) {
    type V = [f32; 8];
    // transpose: xt[i][j] = weight i of sub-block j
    let xt: [V; 32] = std::array::from_fn(|i| std::array::from_fn(|j| x[32 * j + i]));
    let mut sum_x2 = [0.0f32; 8];
    for xi in &xt {
        for j in 0..8 {
            sum_x2[j] += xi[j] * xi[j];
        }
    }
    let av_x: V = std::array::from_fn(|j| (sum_x2[j] / 32.0).sqrt());
    let wt: [V; 32] = std::array::from_fn(|i| std::array::from_fn(|j| av_x[j] + xt[i][j].abs()));

    let mut min = xt[0];
    let mut max = xt[0];
    let mut sum_w = wt[0];
    let mut sum_x: V = std::array::from_fn(|j| sum_w[j] * xt[0][j]);
    for i in 1..32 {
        for j in 0..8 {
            let (v, w) = (xt[i][j], wt[i][j]);
            min[j] = if v < min[j] { v } else { min[j] };
            max[j] = if v > max[j] { v } else { max[j] };
            sum_w[j] += w;
            sum_x[j] += w * v;
        }
    }
    for m in &mut min {
        if *m > 0.0 {
            *m = 0.0;
        }
    }
    let flat: [bool; 8] = std::array::from_fn(|j| max[j] == min[j]);
    let min0 = min;

    let nmax = p.nmax as f32;
    let iscale: V = std::array::from_fn(|j| nmax / (max[j] - min[j]));
    let mut scale: V = std::array::from_fn(|j| 1.0 / iscale[j]);
    // quants are kept as f32 (exact small integers) so every lane operation is an f32 one
    let mut l = [[0.0f32; 8]; 32];
    let mut best_error = [0.0f32; 8];
    for i in 0..32 {
        for j in 0..8 {
            let q = round_clamped(iscale[j] * (xt[i][j] - min[j]), 0.0, nmax);
            l[i][j] = q;
            let diff = scale[j] * q + min[j] - xt[i][j];
            best_error[j] += wt[i][j] * (diff * diff);
        }
    }
    for is in 0..=p.nstep {
        let r = p.rmin + p.rdelta * is as f32 + nmax;
        let iscale: V = std::array::from_fn(|j| r / (max[j] - min[j]));
        let mut laux = [[0.0f32; 8]; 32];
        let (mut sum_l, mut sum_l2, mut sum_xl) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
        for i in 0..32 {
            for j in 0..8 {
                let q = round_clamped(iscale[j] * (xt[i][j] - min[j]), 0.0, nmax);
                laux[i][j] = q;
                let w = wt[i][j];
                sum_l[j] += w * q;
                sum_l2[j] += w * q * q;
                sum_xl[j] += w * q * xt[i][j];
            }
        }
        let mut this_scale = [0.0f32; 8];
        let mut this_min = [0.0f32; 8];
        let mut take = [false; 8];
        for j in 0..8 {
            let det = sum_w[j] * sum_l2[j] - sum_l[j] * sum_l[j];
            let s = (sum_w[j] * sum_xl[j] - sum_x[j] * sum_l[j]) / det;
            let m = (sum_l2[j] * sum_x[j] - sum_l[j] * sum_xl[j]) / det;
            let clamp = m > 0.0;
            this_scale[j] = if clamp { sum_xl[j] / sum_l2[j] } else { s };
            this_min[j] = if clamp { 0.0 } else { m };
            take[j] = det > 0.0;
        }
        let mut cur_error = [0.0f32; 8];
        for i in 0..32 {
            for j in 0..8 {
                let diff = this_scale[j] * laux[i][j] + this_min[j] - xt[i][j];
                cur_error[j] += wt[i][j] * (diff * diff);
            }
        }
        for j in 0..8 {
            take[j] &= cur_error[j] < best_error[j];
            if take[j] {
                best_error[j] = cur_error[j];
                scale[j] = this_scale[j];
                min[j] = this_min[j];
            }
        }
        for (li, ai) in l.iter_mut().zip(&laux) {
            for j in 0..8 {
                li[j] = if take[j] { ai[j] } else { li[j] };
            }
        }
    }
    for j in 0..8 {
        (scales[j], mins[j]) = if flat[j] {
            (0.0, -min0[j])
        } else {
            (scale[j], -min[j])
        };
        for i in 0..32 {
            l_out[32 * j + i] = if flat[j] { 0 } else { l[i][j] as u8 };
        }
    }
}

/// The shared body of `quantize_row_q4_K_ref` and `quantize_row_q5_K_ref` up to the final
/// quants: returns (d bits, dmin bits, packed 12-byte scales) and
/// writes L (0..=nmax per weight).
fn quant_scales_mins(
    x: &[f32; QK_K],
    p: &Qkx2,
    l: &mut [u8; QK_K],
    search: SubBlockSearch,
) -> (u16, u16, [u8; 12]) {
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    search(x, p, l, &mut scales, &mut mins);
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..8 {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        // C: `uint8_t ls = nearest_int(...)` truncates to 8 bits before MIN(63, ls)
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d = f32_to_f16(max_scale / 63.0);
    let dmin = f32_to_f16(max_min / 63.0);

    // Requantize every weight against the rounded (6-bit, f16) scales actually stored.
    // A sub-block whose stored scale is 0 keeps its quants from the search, as in ggml.
    let (df, dminf) = (f16_to_f32(d), f16_to_f32(dmin));
    for j in 0..8 {
        let (sc, m) = get_scale_min(j, &packed);
        let dj = df * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dminf * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / dj).clamp(0, p.nmax) as u8;
        }
    }
    (d, dmin, packed)
}

/// `quantize_row_q4_K_ref` for one super-block.
pub(crate) fn quant_block_q4_k(x: &[f32; QK_K], out: &mut [u8; Q4_K_BYTES]) {
    quant_block_q4_k_with(x, out, search_x8)
}

fn quant_block_q4_k_with(x: &[f32; QK_K], out: &mut [u8; Q4_K_BYTES], search: SubBlockSearch) {
    let mut l = [0u8; QK_K];
    let (d, dmin, scales) = quant_scales_mins(x, &Q4_K_SEARCH, &mut l, search);
    out[0..2].copy_from_slice(&d.to_le_bytes());
    out[2..4].copy_from_slice(&dmin.to_le_bytes());
    out[4..16].copy_from_slice(&scales);
    for (g, q) in out[16..].chunks_exact_mut(32).enumerate() {
        for (i, q) in q.iter_mut().enumerate() {
            *q = l[64 * g + i] | (l[64 * g + 32 + i] << 4);
        }
    }
}

/// `quantize_row_q5_K_ref` for one super-block.
pub(crate) fn quant_block_q5_k(x: &[f32; QK_K], out: &mut [u8; Q5_K_BYTES]) {
    quant_block_q5_k_with(x, out, search_x8)
}

fn quant_block_q5_k_with(x: &[f32; QK_K], out: &mut [u8; Q5_K_BYTES], search: SubBlockSearch) {
    let mut l = [0u8; QK_K];
    let (d, dmin, scales) = quant_scales_mins(x, &Q5_K_SEARCH, &mut l, search);
    out[0..2].copy_from_slice(&d.to_le_bytes());
    out[2..4].copy_from_slice(&dmin.to_le_bytes());
    out[4..16].copy_from_slice(&scales);
    let (qh, qs) = out[16..].split_at_mut(32);
    qh.fill(0);
    for (g, q) in qs.chunks_exact_mut(32).enumerate() {
        for (i, q) in q.iter_mut().enumerate() {
            let l1 = l[64 * g + i];
            let l2 = l[64 * g + 32 + i];
            qh[i] |= ((l1 >> 4) << (2 * g)) | ((l2 >> 4) << (2 * g + 1));
            *q = (l1 & 0xF) | ((l2 & 0xF) << 4);
        }
    }
}

/// ggml `make_qx_quants(16, 32, x, L, rmse_type = 1, NULL)`: symmetric 6-bit fit with
/// weights x², trying inverse scales -(32 + 0.1·is)/max for is in -9..=9. Writes L + 32
/// (0..=63) and returns the scale.
fn make_qx_quants_q6(x: &[f32; 16], l: &mut [u8; 16]) -> f32 {
    const NMAX: i32 = 32;
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let mut iscale = -(NMAX as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..16 {
        let q = nearest_int(iscale * x[i]).clamp(-NMAX, NMAX - 1);
        l[i] = (q + NMAX) as u8;
        let w = x[i] * x[i];
        let q = q as f32;
        sumlx += w * x[i] * q;
        suml2 += w * q * q;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(NMAX as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let q = nearest_int(iscale * v).clamp(-NMAX, NMAX - 1) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (li, &v) in l.iter_mut().zip(x) {
                *li = (nearest_int(iscale * v).clamp(-NMAX, NMAX - 1) + NMAX) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `quantize_row_q6_K_ref` for one super-block.
pub(crate) fn quant_block_q6_k(x: &[f32; QK_K], out: &mut [u8; Q6_K_BYTES]) {
    quant_block_q6_k_with(x, out, search6_x16)
}

/// The per-sub-block search of q6_K: scales and quants (+32) of the 16 sub-blocks.
type SubBlockSearch6 = fn(&[f32; QK_K], &mut [u8; QK_K], &mut [f32; 16]);

/// Straight port: [`make_qx_quants_q6`] per sub-block; the reference for [`search6_x16`].
#[cfg_attr(not(test), allow(dead_code))]
fn search6_scalar(x: &[f32; QK_K], l: &mut [u8; QK_K], scales: &mut [f32; 16]) {
    for ib in 0..16 {
        let xs: &[f32; 16] = x[16 * ib..16 * ib + 16]
            .try_into()
            .expect("16-element sub-block");
        let lb: &mut [u8; 16] = (&mut l[16 * ib..16 * ib + 16])
            .try_into()
            .expect("16 quants");
        scales[ib] = make_qx_quants_q6(xs, lb);
    }
}

fn search6_x16(x: &[f32; QK_K], l_out: &mut [u8; QK_K], scales: &mut [f32; 16]) {
    // Same code compiled for AVX2 when the CPU has it: twice the lanes per instruction,
    // identical IEEE results (no FMA is enabled, and Rust never contracts a*b+c anyway).
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the running CPU supports AVX2, checked just above.
        return unsafe { search6_x16_avx2(x, l_out, scales) };
    }
    search6_x16_body(x, l_out, scales)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn search6_x16_avx2(x: &[f32; QK_K], l_out: &mut [u8; QK_K], scales: &mut [f32; 16]) {
    search6_x16_body(x, l_out, scales)
}

/// [`search6_scalar`] with the 16 sub-blocks in 16 SIMD lanes: the same per-lane operations
/// in the same order (bit-identical), with branches turned into per-lane selects.
#[inline(always)]
fn search6_x16_body(x: &[f32; QK_K], l_out: &mut [u8; QK_K], scales: &mut [f32; 16]) {
    const NMAX: i32 = 32;
    type V = [f32; 16];
    let xt: [V; 16] = std::array::from_fn(|i| std::array::from_fn(|j| x[16 * j + i]));
    let mut max = [0.0f32; 16];
    let mut amax = [0.0f32; 16];
    for xi in &xt {
        for j in 0..16 {
            let a = xi[j].abs();
            let bigger = a > amax[j];
            amax[j] = if bigger { a } else { amax[j] };
            max[j] = if bigger { xi[j] } else { max[j] };
        }
    }
    // quants are kept as f32 (exact small integers, without the +32 offset) so every lane
    // operation is an f32 one
    let (lo, hi) = (-(NMAX as f32), (NMAX - 1) as f32);
    let mut l = [[0.0f32; 16]; 16];
    let mut sumlx = [0.0f32; 16];
    let mut suml2 = [0.0f32; 16];
    let iscale: V = std::array::from_fn(|j| -(NMAX as f32) / max[j]);
    for i in 0..16 {
        for j in 0..16 {
            let v = xt[i][j];
            let q = round_clamped(iscale[j] * v, lo, hi);
            l[i][j] = q;
            let w = v * v;
            sumlx[j] += w * v * q;
            suml2[j] += w * q * q;
        }
    }
    let mut scale: V = std::array::from_fn(|j| {
        if suml2[j] != 0.0 {
            sumlx[j] / suml2[j]
        } else {
            0.0
        }
    });
    let mut best: V = std::array::from_fn(|j| scale[j] * sumlx[j]);
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let r = -(NMAX as f32 + 0.1 * is as f32);
        let iscale: V = std::array::from_fn(|j| r / max[j]);
        let mut laux = [[0.0f32; 16]; 16];
        let (mut slx, mut sl2) = ([0.0f32; 16], [0.0f32; 16]);
        for i in 0..16 {
            for j in 0..16 {
                let v = xt[i][j];
                let q = round_clamped(iscale[j] * v, lo, hi);
                laux[i][j] = q;
                let w = v * v;
                slx[j] += w * v * q;
                sl2[j] += w * q * q;
            }
        }
        let take: [bool; 16] =
            std::array::from_fn(|j| sl2[j] > 0.0 && slx[j] * slx[j] > best[j] * sl2[j]);
        for j in 0..16 {
            if take[j] {
                scale[j] = slx[j] / sl2[j];
                best[j] = scale[j] * slx[j];
            }
        }
        for (li, ai) in l.iter_mut().zip(&laux) {
            for j in 0..16 {
                li[j] = if take[j] { ai[j] } else { li[j] };
            }
        }
    }
    for j in 0..16 {
        // the scalar code returns early for an all-(near-)zero sub-block
        let zero = amax[j] < GROUP_MAX_EPS;
        scales[j] = if zero { 0.0 } else { scale[j] };
        for i in 0..16 {
            l_out[16 * j + i] = if zero {
                0
            } else {
                (l[i][j] as i32 + NMAX) as u8
            };
        }
    }
}

fn quant_block_q6_k_with(x: &[f32; QK_K], out: &mut [u8; Q6_K_BYTES], search: SubBlockSearch6) {
    let mut l = [0u8; QK_K];
    let mut scales = [0.0f32; 16];
    search(x, &mut l, &mut scales);
    let mut max_scale = 0.0f32;
    let mut max_abs_scale = 0.0f32;
    for &s in &scales {
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        // all (near) zero: an all-zero block, d = +0
        out.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f32_to_f16(1.0 / iscale);
    let mut sc = [0i8; 16];
    for (s, &v) in sc.iter_mut().zip(&scales) {
        // C stores MIN(127, int) into an int8_t
        *s = nearest_int(iscale * v).min(127) as i8;
    }
    let df = f16_to_f32(d);
    for ((lj, xj), &s) in l.chunks_exact_mut(16).zip(x.chunks_exact(16)).zip(&sc) {
        let dj = df * s as f32;
        if dj == 0.0 {
            continue; // keep the search's quants, as ggml does
        }
        for (q, &v) in lj.iter_mut().zip(xj) {
            *q = (nearest_int(v / dj).clamp(-32, 31) + 32) as u8;
        }
    }
    let (ql, rest) = out.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    let (scales_out, d_out) = rest.split_at_mut(16);
    for half in 0..2 {
        let lh = &l[128 * half..128 * half + 128];
        let ql = &mut ql[64 * half..64 * half + 64];
        let qh = &mut qh[32 * half..32 * half + 32];
        for i in 0..32 {
            let (l1, l2, l3, l4) = (lh[i], lh[i + 32], lh[i + 64], lh[i + 96]);
            ql[i] = (l1 & 0xF) | ((l3 & 0xF) << 4);
            ql[i + 32] = (l2 & 0xF) | ((l4 & 0xF) << 4);
            qh[i] = (l1 >> 4) | ((l2 >> 4) << 2) | ((l3 >> 4) << 4) | ((l4 >> 4) << 6);
        }
    }
    for (o, s) in scales_out.iter_mut().zip(sc) {
        *o = s as u8;
    }
    d_out.copy_from_slice(&d.to_le_bytes());
}

// ---------------------------------------------------------------- row drivers

#[inline(always)]
pub(crate) fn dot_q4_k(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, dequant_block_q4_k)
}
#[inline(always)]
pub(crate) fn dot_q5_k(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, dequant_block_q5_k)
}
#[inline(always)]
pub(crate) fn dot_q6_k(row: &[u8], x: &[f32]) -> f32 {
    dot_impl(row, x, dequant_block_q6_k)
}
#[inline(always)]
pub(crate) fn dot_many_q4_k(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, dequant_block_q4_k)
}
#[inline(always)]
pub(crate) fn dot_many_q5_k(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, dequant_block_q5_k)
}
#[inline(always)]
pub(crate) fn dot_many_q6_k(row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_impl(row, xs, n_in, out, dequant_block_q6_k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_ties_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-2.6), -3);
        assert_eq!(nearest_int(63.49), 63);
    }

    #[test]
    fn scale_min_packing_roundtrip() {
        // pack 6-bit (sc, m) pairs the way the quantizer does and read them back
        let pairs: [(u8, u8); 8] = [
            (1, 2),
            (63, 0),
            (17, 45),
            (32, 33),
            (5, 60),
            (63, 63),
            (0, 1),
            (40, 22),
        ];
        let mut p = [0u8; 12];
        for (j, &(ls, lm)) in pairs.iter().enumerate() {
            if j < 4 {
                p[j] = ls;
                p[j + 4] = lm;
            } else {
                p[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                p[j - 4] |= (ls >> 4) << 6;
                p[j] |= (lm >> 4) << 6;
            }
        }
        for (j, &pair) in pairs.iter().enumerate() {
            assert_eq!(get_scale_min(j, &p), pair, "sub-block {j}");
        }
    }

    #[test]
    fn q6_k_hand_block() {
        // d = 1, every scale 2 except sub-block 5 = -3; all quants 33 (q - 32 = 1) except
        // weight 200 = 0 (q - 32 = -32)
        let mut b = [0u8; Q6_K_BYTES];
        let mut l = [33u8; QK_K];
        l[200] = 0;
        for half in 0..2 {
            for i in 0..32 {
                let lh = &l[128 * half..];
                b[64 * half + i] = (lh[i] & 0xF) | ((lh[i + 64] & 0xF) << 4);
                b[64 * half + i + 32] = (lh[i + 32] & 0xF) | ((lh[i + 96] & 0xF) << 4);
                b[128 + 32 * half + i] = (lh[i] >> 4)
                    | ((lh[i + 32] >> 4) << 2)
                    | ((lh[i + 64] >> 4) << 4)
                    | ((lh[i + 96] >> 4) << 6);
            }
        }
        for s in 0..16 {
            b[192 + s] = if s == 5 { (-3i8) as u8 } else { 2 };
        }
        b[208..210].copy_from_slice(&f32_to_f16(1.0).to_le_bytes());
        let mut w = [0.0; QK_K];
        dequant_block_q6_k(&b, &mut w);
        for (i, &v) in w.iter().enumerate() {
            let want = match i {
                200 => -64.0,
                80..=95 => -3.0,
                _ => 2.0,
            };
            assert_eq!(v, want, "weight {i}");
        }
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let x = [0.0f32; QK_K];
        let mut b6 = [0xAAu8; Q6_K_BYTES];
        quant_block_q6_k(&x, &mut b6);
        assert!(b6.iter().all(|&v| v == 0));
        let mut b4 = [0xAAu8; Q4_K_BYTES];
        quant_block_q4_k(&x, &mut b4);
        let mut w = [1.0; QK_K];
        dequant_block_q4_k(&b4, &mut w);
        assert!(w.iter().all(|&v| v == 0.0));
    }

    /// Deterministic test inputs: gaussian-ish blocks whose sub-blocks vary in scale, with
    /// edge cases mixed in (zero, constant, one-signed, single spike, tiny, huge).
    fn test_blocks(n: usize) -> Vec<[f32; QK_K]> {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        (0..n)
            .map(|b| {
                let mut x = [0.0f32; QK_K];
                for sub in 0..16 {
                    let scale = 10f32.powf(next() * 6.0 - 4.0);
                    let kind = (b * 16 + sub) % 11;
                    for v in &mut x[16 * sub..16 * sub + 16] {
                        let g = (next() + next() + next() - 1.5) * 2.0; // roughly gaussian
                        *v = match kind {
                            0 => 0.0,
                            1 => scale,
                            2 => g.abs() * scale + scale,
                            3 => -(g.abs() * scale),
                            4 => 1e-20 * g,
                            _ => g * scale,
                        };
                    }
                    if kind == 5 {
                        x[16 * sub + 3] = 50.0 * scale;
                    }
                }
                x
            })
            .collect()
    }

    #[test]
    fn lane_parallel_search_is_bit_identical_to_scalar_port() {
        for (i, x) in test_blocks(3000).iter().enumerate() {
            let (mut a4, mut b4) = ([0u8; Q4_K_BYTES], [0u8; Q4_K_BYTES]);
            quant_block_q4_k_with(x, &mut a4, search_scalar);
            quant_block_q4_k_with(x, &mut b4, search_x8);
            assert_eq!(a4, b4, "q4_K block {i}");
            quant_block_q4_k_with(x, &mut b4, search_x8_body);
            assert_eq!(a4, b4, "q4_K block {i} (portable)");
            let (mut a5, mut b5) = ([0u8; Q5_K_BYTES], [0u8; Q5_K_BYTES]);
            quant_block_q5_k_with(x, &mut a5, search_scalar);
            quant_block_q5_k_with(x, &mut b5, search_x8);
            assert_eq!(a5, b5, "q5_K block {i}");
            let (mut a6, mut b6) = ([0u8; Q6_K_BYTES], [0u8; Q6_K_BYTES]);
            quant_block_q6_k_with(x, &mut a6, search6_scalar);
            quant_block_q6_k_with(x, &mut b6, search6_x16);
            assert_eq!(a6, b6, "q6_K block {i}");
            quant_block_q6_k_with(x, &mut b6, search6_x16_body);
            assert_eq!(a6, b6, "q6_K block {i} (portable)");
        }
    }

    /// Blocks/s of the three q4_K/q6_K searches, interleaved to share machine noise:
    /// `cargo test -p ferrite-formats --lib -- --ignored --nocapture search_speed`.
    #[test]
    #[ignore]
    fn search_speed() {
        let xs = test_blocks(400);
        let mut out4 = [0u8; Q4_K_BYTES];
        let mut out6 = [0u8; Q6_K_BYTES];
        let s4: [(&str, SubBlockSearch); 3] = [
            ("scalar", search_scalar),
            ("lanes", search_x8_body),
            ("lanes+dispatch", search_x8),
        ];
        let s6: [(&str, SubBlockSearch6); 3] = [
            ("scalar", search6_scalar),
            ("lanes", search6_x16_body),
            ("lanes+dispatch", search6_x16),
        ];
        let mut t4 = [0.0f64; 3];
        let mut t6 = [0.0f64; 3];
        for _ in 0..5 {
            for k in 0..3 {
                let t0 = std::time::Instant::now();
                for x in &xs {
                    quant_block_q4_k_with(x, &mut out4, s4[k].1);
                }
                t4[k] += t0.elapsed().as_secs_f64();
                let t0 = std::time::Instant::now();
                for x in &xs {
                    quant_block_q6_k_with(x, &mut out6, s6[k].1);
                }
                t6[k] += t0.elapsed().as_secs_f64();
            }
        }
        for k in 0..3 {
            let mb = |t: f64, bytes: usize| (5 * xs.len() * bytes) as f64 / t / 1e6;
            eprintln!(
                "{:>15}: q4_K {:6.1} MB/s out, q6_K {:6.1} MB/s out",
                s4[k].0,
                mb(t4[k], Q4_K_BYTES),
                mb(t6[k], Q6_K_BYTES)
            );
        }
    }
}
