//! ggml block types that ferrite has no kernels for but converts at load, without loss, into
//! types it has kernels for (as MXFP4 experts go to the GPU as Q8_0 blocks). Each weight keeps
//! its value bit for bit: a model loaded from such a file computes with exactly the weights
//! ggml's dequantization of the file gives, on the CPU and GPU paths of the wider type, at the
//! wider type's size and speed.
//!
//! Block layouts (little-endian, packed) and the conversions:
//!
//! ```text
//! q5_0    22 B / 32: d: f16 | qh: u32 (fifth bits) | qs: [u8; 16]
//!                    w[j]    = ((qs[j] & 0xF) | bit j of qh << 4) - 16) * d        j in 0..16
//!                    w[j+16] = ((qs[j] >> 4)  | bit j+16 of qh << 4) - 16) * d
//!         → q8_0 (34 B): the same d, the int8 value q - 16 (in -16..15).            1.55× the bytes
//! iq4_nl  18 B / 32: d: f16 | qs: [u8; 16]
//!                    w[j] = d * T[qs[j] & 0xF], w[j+16] = d * T[qs[j] >> 4]
//!                    (T: 16 fixed int8 values, IQ4_NL_VALUES)
//!         → q8_0: the same d, the int8 T[q].                                        1.89×
//! q3_K   110 B / 256: hmask: [u8; 32] | qs: [u8; 64] | scales: 12 B (16 6-bit s) | d: f16
//!                    sixteen 16-weight sub-blocks; weight p = 128 h + 32 j + l (h < 2, j < 4,
//!                    l < 32) has its 2 bits at bits 2 j of qs[32 h + l], its high bit at bit
//!                    4 h + j of hmask[l], and sub-block p / 16:
//!                    w[p] = d * (s[p / 16] - 32) * (q2 - (high bit ? 0 : 4))
//!         → q6_K (210 B): the same d, int8 scales s - 32 (in -32..31) and 6-bit codes
//!           v + 32 for the values v in -4..3 (q6_K's sub-block of weight p is p / 16 too).  1.91×
//! ```
//!
//! Why the values are equal: ggml dequantizes q8_0 as `q * d` and q6_K as `d * sc * q`, all in
//! f32. A q5_0 or iq4_nl weight is `x * d` with the same integer x and the same f16 d: the
//! same product. A q3_K weight is `(d * (s - 32)) * v`; its q6_K form `(d * sc) * (q - 32)`
//! with sc = s - 32 and q - 32 = v multiplies the same numbers in the same order. (Each of
//! those products is exact in f32 besides: an f16 significand of 11 bits times integers of at
//! most 6 and 3 bits.) `tests/quant_vectors.rs` checks it against gguf-py's dequantizers.
//!
//! Not converted, because no type ferrite computes with holds their values exactly: q5_1 and
//! q4_1-style offsets at 5 bits (`d * q + m`), q2_K (a min per 16 weights), iq4_xs (a 6-bit
//! scale times the table's 8-bit values needs more than f16's significand). Those are refused
//! at load, with the tensor and its type named.

use super::float::f16_to_f32;
use super::k_quants::{Q6_K_BYTES, QK_K};
use super::legacy::{Q8_0_BYTES, QK};
use super::GgmlType;
use crate::{FormatError, Result};
use rayon::prelude::*;

/// The 16 values an iq4_nl code selects (ggml's `kvalues_iq4nl`).
pub const IQ4_NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

pub const Q5_0_BYTES: usize = 22;
pub const IQ4_NL_BYTES: usize = 18;
pub const Q3_K_BYTES: usize = 110;

/// Blocks converted per parallel task: large enough that a task's overhead is noise, small
/// enough that a tensor of a few MB still spreads over the cores.
const BLOCKS_PER_TASK: usize = 4096;

/// A ggml type ferrite converts at load (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvertedType {
    Q5_0,
    Q3K,
    IQ4NL,
}

impl ConvertedType {
    pub const ALL: [ConvertedType; 3] = [
        ConvertedType::Q5_0,
        ConvertedType::Q3K,
        ConvertedType::IQ4NL,
    ];

    /// The ggml type id (as stored in GGUF tensor infos).
    pub fn id(self) -> u32 {
        match self {
            ConvertedType::Q5_0 => 6,
            ConvertedType::Q3K => 11,
            ConvertedType::IQ4NL => 20,
        }
    }

    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// ggml's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            ConvertedType::Q5_0 => "q5_0",
            ConvertedType::Q3K => "q3_K",
            ConvertedType::IQ4NL => "iq4_nl",
        }
    }

    /// The type the weights are converted to.
    pub fn target(self) -> GgmlType {
        match self {
            ConvertedType::Q5_0 | ConvertedType::IQ4NL => GgmlType::Q8_0,
            ConvertedType::Q3K => GgmlType::Q6K,
        }
    }

    /// Elements per block (the target's too).
    pub fn block_size(self) -> usize {
        match self {
            ConvertedType::Q5_0 | ConvertedType::IQ4NL => QK,
            ConvertedType::Q3K => QK_K,
        }
    }

    /// Bytes per stored block.
    pub fn type_size(self) -> usize {
        match self {
            ConvertedType::Q5_0 => Q5_0_BYTES,
            ConvertedType::Q3K => Q3_K_BYTES,
            ConvertedType::IQ4NL => IQ4_NL_BYTES,
        }
    }

    /// Stored bytes for `n` elements; error if `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return Err(FormatError::Other(format!(
                "{n} elements is not a multiple of the {} block size {bs}",
                self.name()
            )));
        }
        Ok(n / bs * self.type_size())
    }

    fn whole_blocks(self, len: usize) -> Result<usize> {
        if !len.is_multiple_of(self.type_size()) {
            return Err(FormatError::Other(format!(
                "{} bytes is not a whole number of {}-byte {} blocks",
                len,
                self.type_size(),
                self.name()
            )));
        }
        Ok(len / self.type_size())
    }

    /// The stored blocks `src` as the target type's blocks, the same values (module docs).
    pub fn convert(self, src: &[u8]) -> Result<Vec<u8>> {
        let n_blocks = self.whole_blocks(src.len())?;
        let (ts, out_ts) = (self.type_size(), self.target().type_size());
        let mut out = vec![0u8; n_blocks * out_ts];
        let block: fn(&[u8], &mut [u8]) = match self {
            ConvertedType::Q5_0 => q5_0_to_q8_0,
            ConvertedType::Q3K => q3_k_to_q6_k,
            ConvertedType::IQ4NL => iq4_nl_to_q8_0,
        };
        out.par_chunks_mut(BLOCKS_PER_TASK * out_ts)
            .zip(src.par_chunks(BLOCKS_PER_TASK * ts))
            .for_each(|(o, s)| {
                for (ob, sb) in o.chunks_exact_mut(out_ts).zip(s.chunks_exact(ts)) {
                    block(sb, ob);
                }
            });
        Ok(out)
    }

    /// ggml's dequantization of the stored blocks (`dequantize_row_q5_0` / `_q3_K` /
    /// `_iq4_nl`), written from their definitions and independently of [`Self::convert`]:
    /// the reference the conversion is checked against.
    pub fn dequantize(self, src: &[u8], out: &mut [f32]) -> Result<()> {
        let n_blocks = self.whole_blocks(src.len())?;
        if out.len() != n_blocks * self.block_size() {
            return Err(FormatError::Other(format!(
                "{} {} blocks hold {} values, not {}",
                n_blocks,
                self.name(),
                n_blocks * self.block_size(),
                out.len()
            )));
        }
        let block: fn(&[u8], &mut [f32]) = match self {
            ConvertedType::Q5_0 => dequant_q5_0,
            ConvertedType::Q3K => dequant_q3_k,
            ConvertedType::IQ4NL => dequant_iq4_nl,
        };
        for (b, o) in src
            .chunks_exact(self.type_size())
            .zip(out.chunks_exact_mut(self.block_size()))
        {
            block(b, o);
        }
        Ok(())
    }
}

impl std::fmt::Display for ConvertedType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn le_f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

// ------------------------------------------------------------------------- q5_0, iq4_nl

/// The 32 integer values of a q5_0 block, in weight order.
fn q5_0_values(b: &[u8]) -> [i8; QK] {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    let mut v = [0i8; QK];
    for j in 0..16 {
        let lo = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        v[j] = lo as i8 - 16;
        v[j + 16] = hi as i8 - 16;
    }
    v
}

/// The 32 integer values of an iq4_nl block, in weight order.
fn iq4_nl_values(b: &[u8]) -> [i8; QK] {
    let mut v = [0i8; QK];
    for j in 0..16 {
        v[j] = IQ4_NL_VALUES[(b[2 + j] & 0x0F) as usize];
        v[j + 16] = IQ4_NL_VALUES[(b[2 + j] >> 4) as usize];
    }
    v
}

/// A q8_0 block of the f16 scale bytes `d` and the values `v`.
fn q8_0_block(d: [u8; 2], v: &[i8; QK], out: &mut [u8]) {
    debug_assert_eq!(out.len(), Q8_0_BYTES);
    out[..2].copy_from_slice(&d);
    for (o, &x) in out[2..].iter_mut().zip(v) {
        *o = x as u8;
    }
}

fn q5_0_to_q8_0(b: &[u8], out: &mut [u8]) {
    q8_0_block([b[0], b[1]], &q5_0_values(b), out);
}

fn iq4_nl_to_q8_0(b: &[u8], out: &mut [u8]) {
    q8_0_block([b[0], b[1]], &iq4_nl_values(b), out);
}

// ggml's dequantize_row_q5_0: `x0 * d` with x0 the integer value.
fn dequant_q5_0(b: &[u8], out: &mut [f32]) {
    let d = le_f16(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = ((b[6 + j] as u32 & 0x0F) | xh0) as i32 - 16;
        let x1 = ((b[6 + j] as u32 >> 4) | xh1) as i32 - 16;
        out[j] = x0 as f32 * d;
        out[j + 16] = x1 as f32 * d;
    }
}

// ggml's dequantize_row_iq4_nl: `d * kvalues_iq4nl[q]`.
fn dequant_iq4_nl(b: &[u8], out: &mut [f32]) {
    let d = le_f16(b, 0);
    for j in 0..16 {
        out[j] = d * IQ4_NL_VALUES[(b[2 + j] & 0x0F) as usize] as f32;
        out[j + 16] = d * IQ4_NL_VALUES[(b[2 + j] >> 4) as usize] as f32;
    }
}

// ------------------------------------------------------------------------------- q3_K

/// The 16 six-bit scales of a q3_K block (0..63; the weight's factor is s - 32). Scale k has
/// its low four bits in byte k % 8 (low nibble for k < 8, high for k ≥ 8) and its high two at
/// bits 2 (k / 4) of byte 8 + k % 4.
fn q3_k_scales(sc: &[u8]) -> [u8; 16] {
    let mut s = [0u8; 16];
    for (k, s) in s.iter_mut().enumerate() {
        let lo = (sc[k % 8] >> (4 * (k / 8))) & 0x0F;
        let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 0x03;
        *s = lo | (hi << 4);
    }
    s
}

/// The value (-4..3) of weight p of a q3_K block (module docs).
fn q3_k_value(hmask: &[u8], qs: &[u8], p: usize) -> i8 {
    let (h, j, l) = (p / 128, (p % 128) / 32, p % 32);
    let q2 = (qs[32 * h + l] >> (2 * j)) & 3;
    let high = (hmask[l] >> (4 * h + j)) & 1;
    q2 as i8 - if high == 1 { 0 } else { 4 }
}

fn q3_k_to_q6_k(b: &[u8], out: &mut [u8]) {
    debug_assert_eq!(out.len(), Q6_K_BYTES);
    let (hmask, qs, scales) = (&b[..32], &b[32..96], q3_k_scales(&b[96..108]));
    // q6_K: ql[128] | qh[64] | scales: [i8; 16] | d: f16. Weight p = 128 n + 32 k + l (n < 2,
    // k < 4, l < 32) has its low nibble in ql[64 n + 32 (k % 2) + l] (the high nibble of the
    // byte for k ≥ 2) and its top two bits at bits 2 k of qh[32 n + l].
    let (ql, rest) = out.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    let (sc, d) = rest.split_at_mut(16);
    ql.fill(0);
    qh.fill(0);
    for p in 0..QK_K {
        let q6 = (q3_k_value(hmask, qs, p) + 32) as u8;
        let (n, k, l) = (p / 128, (p % 128) / 32, p % 32);
        ql[64 * n + 32 * (k % 2) + l] |= (q6 & 0x0F) << (4 * (k / 2));
        qh[32 * n + l] |= (q6 >> 4) << (2 * k);
    }
    for (o, &s) in sc.iter_mut().zip(&scales) {
        *o = (s as i8 - 32) as u8;
    }
    d.copy_from_slice(&b[108..110]);
}

// ggml's dequantize_row_q3_K: the scales unpacked through four u32 words, then
// `dl = d_all * (scale - 32)` and `dl * (q2 - (hm & m ? 0 : 4))` in its loop order.
fn dequant_q3_k(b: &[u8], out: &mut [f32]) {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let (hm, qs_all) = (&b[..32], &b[32..96]);
    let word = |i: usize| u32::from_le_bytes([b[96 + i], b[97 + i], b[98 + i], b[99 + i]]);
    let (a0, a1, tmp) = (word(0), word(4), word(8));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let scale = |is: usize| (aux[is / 4] >> (8 * (is % 4))) as u8 as i8;
    let d_all = le_f16(b, 108);
    let (mut is, mut m, mut y) = (0usize, 1u8, 0usize);
    for n in 0..2 {
        let q = &qs_all[32 * n..];
        for j in 0..4 {
            let shift = 2 * j;
            for half in 0..2 {
                let dl = d_all * (scale(is) as i32 - 32) as f32;
                is += 1;
                for l in 16 * half..16 * half + 16 {
                    let v = ((q[l] >> shift) & 3) as i32 - if hm[l] & m != 0 { 0 } else { 4 };
                    out[y] = dl * v as f32;
                    y += 1;
                }
            }
            m <<= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bytes (xorshift), with the f16 scale at `d_at` set to a finite value.
    fn blocks(t: ConvertedType, n: usize, seed: u64, d_at: usize) -> Vec<u8> {
        let mut s = seed | 1;
        let mut v: Vec<u8> = (0..n * t.type_size())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 32) as u8
            })
            .collect();
        for (i, b) in v.chunks_exact_mut(t.type_size()).enumerate() {
            // 2^-7 .. 2^0 with either sign: normal f16 values.
            let h = half::f16::from_f32(
                (1.0 + i as f32 / 7.0) / 128.0 * if i % 2 == 0 { 1.0 } else { -1.0 },
            );
            b[d_at..d_at + 2].copy_from_slice(&h.to_bits().to_le_bytes());
        }
        v
    }

    /// Every conversion's values are the stored block's values, bit for bit.
    #[test]
    fn conversions_keep_every_value() {
        for (t, d_at) in [
            (ConvertedType::Q5_0, 0),
            (ConvertedType::IQ4NL, 0),
            (ConvertedType::Q3K, 108),
        ] {
            let n = 37;
            let src = blocks(t, n, 0x5eed + t.id() as u64, d_at);
            let mut want = vec![0f32; n * t.block_size()];
            t.dequantize(&src, &mut want).unwrap();
            let conv = t.convert(&src).unwrap();
            assert_eq!(conv.len(), t.target().bytes_for(want.len()).unwrap());
            let mut got = vec![0f32; want.len()];
            super::super::dequantize(t.target(), &conv, &mut got).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{t} value {i}: {g} vs {w}");
            }
        }
    }

    /// q3_K's value and scale unpacking, read against ggml's word-wise form.
    #[test]
    fn q3_k_scales_match_the_word_form() {
        let src = blocks(ConvertedType::Q3K, 8, 99, 108);
        for b in src.chunks_exact(Q3_K_BYTES) {
            let mut conv = [0u8; Q6_K_BYTES];
            q3_k_to_q6_k(b, &mut conv);
            let s = q3_k_scales(&b[96..108]);
            for k in 0..16 {
                assert_eq!(conv[192 + k] as i8, s[k] as i8 - 32);
            }
        }
    }

    /// ggml's block table (what unloadable tensors are bounds-checked by) agrees with every
    /// type ferrite loads or converts.
    #[test]
    fn ggml_block_table_agrees() {
        for t in GgmlType::ALL {
            let want = (t.block_size(), t.type_size());
            assert_eq!(GgmlType::block_of_id(t.id()), Some(want), "{t}");
            assert_eq!(GgmlType::name_of_id(t.id()), Some(t.name()));
        }
        for t in ConvertedType::ALL {
            let want = (t.block_size(), t.type_size());
            assert_eq!(GgmlType::block_of_id(t.id()), Some(want), "{t}");
            assert_eq!(GgmlType::name_of_id(t.id()), Some(t.name()));
        }
    }

    #[test]
    fn partial_blocks_are_errors() {
        for t in ConvertedType::ALL {
            assert!(t.convert(&vec![0u8; t.type_size() + 1]).is_err());
            assert!(t
                .dequantize(&vec![0u8; t.type_size()], &mut [0f32; 3])
                .is_err());
            assert!(t.bytes_for(t.block_size() + 1).is_err());
            assert_eq!(ConvertedType::from_id(t.id()), Some(t));
            assert!(
                GgmlType::from_id(t.id()).is_err(),
                "{t} is not computed with"
            );
        }
    }
}
