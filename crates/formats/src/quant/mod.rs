//! ggml block types: layouts, bit-exact reference dequantizers, reference quantizers and the
//! dot products the CPU reference backend uses (weights stay quantized; each block is
//! dequantized inside the dot product).
//!
//! One module per family: [`legacy`] (q4_0 q4_1 q8_0), [`k_quants`] (q4_K q5_K q6_K),
//! [`float`] (f32 f16 bf16), [`fp4`] (mxfp4); [`fp8`] (E4M3 with block scales, the Hugging Face FP8
//! checkpoints' weights: not a ggml type, converted to BF16 at load); [`converted`] (q5_0 q3_K
//! iq4_nl: ggml types converted at load, without loss, to q8_0 or q6_K).

#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod converted;
pub mod float;
pub mod fp4;
pub mod fp8;
pub mod k_quants;
pub mod legacy;

use crate::{FormatError, Result};

/// Tensor element types, numbered as ggml numbers them (the ids stored in GGUF files).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    BF16,
    MXFP4,
}

impl GgmlType {
    pub const ALL: [GgmlType; 10] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::BF16,
        GgmlType::MXFP4,
    ];

    /// The ggml type id (as stored in GGUF tensor infos).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
            GgmlType::MXFP4 => 39,
        }
    }

    pub fn from_id(id: u32) -> Result<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.id() == id)
            .ok_or(FormatError::UnknownType(id))
    }

    /// ggml's name for type id `id`, supported or not (`None` for ids ggml never had or
    /// has retired), for errors about files that use one ferrite does not load.
    pub fn name_of_id(id: u32) -> Option<&'static str> {
        GGML_TYPES.iter().find(|t| t.0 == id).map(|t| t.1)
    }

    /// ggml's (elements, bytes) per block for type id `id`, supported or not: the bounds of a
    /// tensor ferrite lists but does not load.
    pub fn block_of_id(id: u32) -> Option<(usize, usize)> {
        GGML_TYPES.iter().find(|t| t.0 == id).map(|t| (t.2, t.3))
    }

    /// ggml's name for the type ("q4_K", "bf16", ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q4K => "q4_K",
            GgmlType::Q5K => "q5_K",
            GgmlType::Q6K => "q6_K",
            GgmlType::BF16 => "bf16",
            GgmlType::MXFP4 => "mxfp4",
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::MXFP4 => 32,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q4K => 2 + 2 + 12 + 128,
            GgmlType::Q5K => 2 + 2 + 12 + 32 + 128,
            GgmlType::Q6K => 128 + 64 + 16 + 2,
            GgmlType::MXFP4 => fp4::MXFP4_BYTES,
        }
    }

    /// Bytes for `n` elements; error if `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return Err(FormatError::Other(format!(
                "{} elements is not a multiple of the {} block size {}",
                n,
                self.name(),
                bs
            )));
        }
        Ok(n / bs * self.type_size())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Every ggml type (id, name, elements a block, bytes a block), as gguf-py 0.19.0's
/// `GGML_QUANT_SIZES` lists them; ids ggml never had or retired are absent.
const GGML_TYPES: [(u32, &str, usize, usize); 34] = [
    (0, "f32", 1, 4),
    (1, "f16", 1, 2),
    (2, "q4_0", 32, 18),
    (3, "q4_1", 32, 20),
    (6, "q5_0", 32, 22),
    (7, "q5_1", 32, 24),
    (8, "q8_0", 32, 34),
    (9, "q8_1", 32, 40),
    (10, "q2_K", 256, 84),
    (11, "q3_K", 256, 110),
    (12, "q4_K", 256, 144),
    (13, "q5_K", 256, 176),
    (14, "q6_K", 256, 210),
    (15, "q8_K", 256, 292),
    (16, "iq2_xxs", 256, 66),
    (17, "iq2_xs", 256, 74),
    (18, "iq3_xxs", 256, 98),
    (19, "iq1_s", 256, 50),
    (20, "iq4_nl", 32, 18),
    (21, "iq3_s", 256, 110),
    (22, "iq2_s", 256, 82),
    (23, "iq4_xs", 256, 136),
    (24, "i8", 1, 1),
    (25, "i16", 1, 2),
    (26, "i32", 1, 4),
    (27, "i64", 1, 8),
    (28, "f64", 1, 8),
    (29, "iq1_m", 256, 56),
    (30, "bf16", 1, 2),
    (34, "tq1_0", 256, 54),
    (35, "tq2_0", 256, 66),
    (39, "mxfp4", 32, 17),
    (40, "nvfp4", 64, 36),
    (41, "q1_0", 128, 18),
];

/// A tensor's type as a GGUF file stores it: one ferrite computes with, or one it converts at
/// load ([`converted`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StoredType {
    Computed(GgmlType),
    Converted(converted::ConvertedType),
}

impl StoredType {
    /// The ggml type id, or an error naming the type (or the id) where ferrite neither
    /// computes with it nor converts it.
    pub fn from_id(id: u32) -> Result<Self> {
        GgmlType::from_id(id)
            .map(StoredType::Computed)
            .or_else(|e| {
                converted::ConvertedType::from_id(id)
                    .map(StoredType::Converted)
                    .ok_or(e)
            })
    }
    pub fn id(self) -> u32 {
        match self {
            StoredType::Computed(t) => t.id(),
            StoredType::Converted(t) => t.id(),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            StoredType::Computed(t) => t.name(),
            StoredType::Converted(t) => t.name(),
        }
    }
    /// The type ferrite computes with: the stored one, or what it is converted to.
    pub fn computed(self) -> GgmlType {
        match self {
            StoredType::Computed(t) => t,
            StoredType::Converted(t) => t.target(),
        }
    }
    pub fn block_size(self) -> usize {
        match self {
            StoredType::Computed(t) => t.block_size(),
            StoredType::Converted(t) => t.block_size(),
        }
    }
    /// Stored bytes for `n` elements; error if `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Result<usize> {
        match self {
            StoredType::Computed(t) => t.bytes_for(n),
            StoredType::Converted(t) => t.bytes_for(n),
        }
    }
}

impl From<GgmlType> for StoredType {
    fn from(t: GgmlType) -> Self {
        StoredType::Computed(t)
    }
}

impl From<converted::ConvertedType> for StoredType {
    fn from(t: converted::ConvertedType) -> Self {
        StoredType::Converted(t)
    }
}

impl std::fmt::Display for StoredType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// ======================================================================= row operations

/// Accumulator lanes of [`block_dot`]. 8 independent chains hide the add latency and map onto
/// two SSE or one AVX register; LLVM turns the lane loop into vector code.
const LANES: usize = 8;

/// Dot product of one dequantized block with the matching slice of the activation vector.
///
/// Summation order (part of the contract, because prefill and decode must agree bit for
/// bit): lane `k` accumulates `w[i] * x[i]` for `i = k, k + 8, k + 16, ...` in increasing
/// `i`, each product rounded to f32 and added in f32 (no FMA); the lanes are then combined
/// as `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`.
#[inline(always)]
fn block_dot<const N: usize>(w: &[f32; N], x: &[f32; N]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (wc, xc) in w.chunks_exact(LANES).zip(x.chunks_exact(LANES)) {
        for k in 0..LANES {
            acc[k] += wc[k] * xc[k];
        }
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Zero-padded copies of a partial trailing block (float rows whose length is not a multiple
/// of the pseudo-block). Padding adds `0 * 0` terms, which leave the sum unchanged.
#[inline(always)]
fn padded_tail<const BS: usize, const TS: usize>(
    bytes: &[u8],
    x: &[f32],
    deq: &impl Fn(&[u8; TS], &mut [f32; BS]),
) -> ([f32; BS], [f32; BS]) {
    let mut b = [0u8; TS];
    let nb = bytes.len().min(TS);
    b[..nb].copy_from_slice(&bytes[..nb]);
    let mut w = [0.0f32; BS];
    deq(&b, &mut w);
    let mut xp = [0.0f32; BS];
    let nx = x.len().min(BS);
    xp[..nx].copy_from_slice(&x[..nx]);
    (w, xp)
}

/// Row dot product over blocks of `BS` weights stored in `TS` bytes: each block is decoded
/// into a stack array by `deq`, dotted with [`block_dot`], and the block results are added
/// left to right into an f32 starting from 0.
#[inline(always)]
pub(crate) fn dot_impl<const BS: usize, const TS: usize>(
    row: &[u8],
    x: &[f32],
    deq: impl Fn(&[u8; TS], &mut [f32; BS]),
) -> f32 {
    let blocks = row.chunks_exact(TS);
    let xblocks = x.chunks_exact(BS);
    let (rtail, xtail) = (blocks.remainder(), xblocks.remainder());
    let mut w = [0.0f32; BS];
    let mut sum = 0.0f32;
    for (b, xb) in blocks.zip(xblocks) {
        // chunks_exact guarantees the lengths; these conversions cannot fail
        deq(b.try_into().unwrap(), &mut w);
        sum += block_dot(&w, xb.try_into().unwrap());
    }
    if !xtail.is_empty() {
        let (w, xp) = padded_tail(rtail, xtail, &deq);
        sum += block_dot(&w, &xp);
    }
    sum
}

/// [`dot_impl`] against `out.len()` activation vectors of length `n_in` stored back to back in
/// `xs`: each weight block is decoded once and dotted with every vector. Per vector the
/// operations and their order are exactly those of [`dot_impl`], so the results are
/// bit-identical to calling it once per vector.
#[inline(always)]
pub(crate) fn dot_many_impl<const BS: usize, const TS: usize>(
    row: &[u8],
    xs: &[f32],
    n_in: usize,
    out: &mut [f32],
    deq: impl Fn(&[u8; TS], &mut [f32; BS]),
) {
    out.fill(0.0);
    if n_in == 0 {
        return;
    }
    let n_full = n_in / BS;
    let mut w = [0.0f32; BS];
    for (bi, b) in row.chunks_exact(TS).take(n_full).enumerate() {
        deq(b.try_into().unwrap(), &mut w);
        for (o, x) in out.iter_mut().zip(xs.chunks_exact(n_in)) {
            if let Some(xb) = x.get(bi * BS..bi * BS + BS) {
                *o += block_dot(&w, xb.try_into().unwrap());
            }
        }
    }
    if !n_in.is_multiple_of(BS) {
        let rtail = row.get(n_full * TS..).unwrap_or(&[]);
        for (o, x) in out.iter_mut().zip(xs.chunks_exact(n_in)) {
            let (w, xp) = padded_tail(rtail, &x[n_full * BS..], &deq);
            *o += block_dot(&w, &xp);
        }
    }
}

fn check_len(t: GgmlType, n: usize, bytes: usize) -> Result<()> {
    let want = t.bytes_for(n)?;
    if bytes != want {
        return Err(FormatError::Other(format!(
            "{t}: {n} elements take {want} bytes, got a buffer of {bytes}"
        )));
    }
    Ok(())
}

/// Apply a fixed-size block function to each (source block, destination block) pair;
/// the caller has checked that both buffers hold the same whole number of blocks.
macro_rules! blockwise {
    ($src:expr, $dst:expr, $bs_src:expr, $bs_dst:expr, $f:path) => {
        for (s, d) in $src
            .chunks_exact($bs_src)
            .zip($dst.chunks_exact_mut($bs_dst))
        {
            $f(s.try_into().unwrap(), d.try_into().unwrap());
        }
    };
}

/// Decode `out.len()` elements of type `t` from `data`, bit-exactly as ggml's
/// `dequantize_row_*` (and gguf-py's `gguf.quants.dequantize`) do.
///
/// Errors if `out.len()` is not a whole number of blocks or `data.len()` is not exactly
/// `t.bytes_for(out.len())`.
pub fn dequantize(t: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    check_len(t, out.len(), data.len())?;
    use fp4::*;
    use k_quants::*;
    use legacy::*;
    match t {
        GgmlType::F32 => float::dequantize_f32(data, out),
        GgmlType::F16 => float::dequantize_f16(data, out),
        GgmlType::BF16 => float::dequantize_bf16(data, out),
        GgmlType::Q4_0 => blockwise!(data, out, Q4_0_BYTES, QK, dequant_block_q4_0),
        GgmlType::Q4_1 => blockwise!(data, out, Q4_1_BYTES, QK, dequant_block_q4_1),
        GgmlType::Q8_0 => blockwise!(data, out, Q8_0_BYTES, QK, dequant_block_q8_0),
        GgmlType::Q4K => blockwise!(data, out, Q4_K_BYTES, QK_K, dequant_block_q4_k),
        GgmlType::Q5K => blockwise!(data, out, Q5_K_BYTES, QK_K, dequant_block_q5_k),
        GgmlType::Q6K => blockwise!(data, out, Q6_K_BYTES, QK_K, dequant_block_q6_k),
        GgmlType::MXFP4 => blockwise!(data, out, MXFP4_BYTES, QK_MXFP4, dequant_block_mxfp4),
    }
    Ok(())
}

/// Encode `x` as type `t` into `out` with ggml's reference quantizers
/// (`quantize_row_*_ref`, no importance matrix); see the family modules for exactness notes.
///
/// Errors if `x.len()` is not a whole number of blocks or `out.len()` is not exactly
/// `t.bytes_for(x.len())`. Allocation-free; one row at a time (callers parallelise over rows).
pub fn quantize(t: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    check_len(t, x.len(), out.len())?;
    use fp4::*;
    use k_quants::*;
    use legacy::*;
    match t {
        GgmlType::F32 => float::quantize_f32(x, out),
        GgmlType::F16 => float::quantize_f16(x, out),
        GgmlType::BF16 => float::quantize_bf16(x, out),
        GgmlType::Q4_0 => blockwise!(x, out, QK, Q4_0_BYTES, quant_block_q4_0),
        GgmlType::Q4_1 => blockwise!(x, out, QK, Q4_1_BYTES, quant_block_q4_1),
        GgmlType::Q8_0 => blockwise!(x, out, QK, Q8_0_BYTES, quant_block_q8_0),
        GgmlType::Q4K => blockwise!(x, out, QK_K, Q4_K_BYTES, quant_block_q4_k),
        GgmlType::Q5K => blockwise!(x, out, QK_K, Q5_K_BYTES, quant_block_q5_k),
        GgmlType::Q6K => blockwise!(x, out, QK_K, Q6_K_BYTES, quant_block_q6_k),
        GgmlType::MXFP4 => blockwise!(x, out, QK_MXFP4, MXFP4_BYTES, quant_block_mxfp4),
    }
    Ok(())
}

/// Dot product of one stored weight row (`x.len()` elements of type `t`) with `x`.
///
/// The weights are decoded block by block into a stack array inside the loop (no f32 copy of
/// the row). Summation order, for every type: per block (32 weights for q4_0/q4_1/q8_0 and
/// for float rows, whose last block may be partial; 256 for the K-quants), 8 f32 lane
/// accumulators combined in a fixed tree (see `block_dot`); the block sums are then added
/// left to right into an f32 starting at 0. Results are therefore deterministic and equal
/// to [`dot_many`]'s, but not bitwise equal to a naive sequential f32 sum.
///
/// On x86-64 CPUs with AVX2 the work is done by explicit SIMD kernels (`quant/avx2.rs`)
/// that perform exactly these operations in this order, so the result is bit-identical to
/// the portable code ([`dot_scalar`]) on every machine (`tests/avx2_identity.rs`).
///
/// Shapes are the caller's contract (validated at load): `row.len()` must be
/// `t.bytes_for(x.len())`. A mismatch is caught by a debug assertion; in release builds it
/// yields an unspecified value, never a panic or an out-of-bounds read.
pub fn dot(t: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(
        t.bytes_for(x.len()).ok(),
        Some(row.len()),
        "{t} row/x length mismatch"
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && t.bytes_for(x.len()).ok() == Some(row.len()) {
        let mut out = 0.0f32;
        // SAFETY: the CPU supports AVX2 and the shapes are consistent (both checked above;
        // one vector of x.len() in x).
        unsafe { avx2::dot_many(t, row, x, x.len(), std::slice::from_mut(&mut out)) };
        return out;
    }
    dot_dispatch(t, row, x)
}

/// [`dot`] without the explicit SIMD kernels: the portable code that defines the results.
/// For tests that check the kernels against it bit for bit.
#[doc(hidden)]
pub fn dot_scalar(t: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    dot_dispatch(t, row, x)
}

#[inline(always)]
fn dot_dispatch(t: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match t {
        GgmlType::F32 => float::dot_f32(row, x),
        GgmlType::F16 => float::dot_f16(row, x),
        GgmlType::BF16 => float::dot_bf16(row, x),
        GgmlType::Q4_0 => legacy::dot_q4_0(row, x),
        GgmlType::Q4_1 => legacy::dot_q4_1(row, x),
        GgmlType::Q8_0 => legacy::dot_q8_0(row, x),
        GgmlType::Q4K => k_quants::dot_q4_k(row, x),
        GgmlType::Q5K => k_quants::dot_q5_k(row, x),
        GgmlType::Q6K => k_quants::dot_q6_k(row, x),
        GgmlType::MXFP4 => fp4::dot_mxfp4(row, x),
    }
}

/// `out[j] = dot(t, row, &xs[j * n_in..(j + 1) * n_in])` for every j, decoding each weight
/// block once for all the vectors (prefill: many tokens share one weight row).
///
/// Bit-identical to calling [`dot`] per vector (same per-block operations in the same
/// order), which the prefill/decode gate relies on. Shapes as for [`dot`], plus
/// `xs.len() == out.len() * n_in` (debug assertion; release builds never panic).
pub fn dot_many(t: GgmlType, row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    debug_assert_eq!(
        t.bytes_for(n_in).ok(),
        Some(row.len()),
        "{t} row/x length mismatch"
    );
    debug_assert_eq!(
        xs.len(),
        out.len() * n_in,
        "xs must hold out.len() vectors of n_in"
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && t.bytes_for(n_in).ok() == Some(row.len())
        && Some(xs.len()) == out.len().checked_mul(n_in)
    {
        // SAFETY: the CPU supports AVX2 and the shapes are consistent (both checked above).
        return unsafe { avx2::dot_many(t, row, xs, n_in, out) };
    }
    dot_many_dispatch(t, row, xs, n_in, out)
}

/// [`dot_many`] without the explicit SIMD kernels (see [`dot_scalar`]).
#[doc(hidden)]
pub fn dot_many_scalar(t: GgmlType, row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    dot_many_dispatch(t, row, xs, n_in, out)
}

#[inline(always)]
fn dot_many_dispatch(t: GgmlType, row: &[u8], xs: &[f32], n_in: usize, out: &mut [f32]) {
    match t {
        GgmlType::F32 => float::dot_many_f32(row, xs, n_in, out),
        GgmlType::F16 => float::dot_many_f16(row, xs, n_in, out),
        GgmlType::BF16 => float::dot_many_bf16(row, xs, n_in, out),
        GgmlType::Q4_0 => legacy::dot_many_q4_0(row, xs, n_in, out),
        GgmlType::Q4_1 => legacy::dot_many_q4_1(row, xs, n_in, out),
        GgmlType::Q8_0 => legacy::dot_many_q8_0(row, xs, n_in, out),
        GgmlType::Q4K => k_quants::dot_many_q4_k(row, xs, n_in, out),
        GgmlType::Q5K => k_quants::dot_many_q5_k(row, xs, n_in, out),
        GgmlType::Q6K => k_quants::dot_many_q6_k(row, xs, n_in, out),
        GgmlType::MXFP4 => fp4::dot_many_mxfp4(row, xs, n_in, out),
    }
}
