//! The explicit SIMD kernels behind `quant::dot` / `quant::dot_many` (AVX2 on x86-64) give
//! results bit-identical to the portable scalar path (`dot_scalar` / `dot_many_scalar`),
//! for every type, many random rows (random quant bits, sane random scales), row lengths
//! with and without a partial trailing block (float types), and 1..=5, 8, 9, 17 vectors.
//!
//! On a CPU without AVX2 the dispatch takes the scalar path and the test is trivially true;
//! it says so.

use ferrite_formats::quant::{dot, dot_many, dot_many_scalar, dot_scalar};
use ferrite_formats::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn note_if_no_simd() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        return;
    }
    eprintln!("note: no AVX2 on this CPU; dispatch and scalar path are the same code");
}

/// A "sane" f16 scale: mostly magnitudes in [1e-4, 1) of either sign, sometimes 0 or an
/// f16 subnormal (both occur in real files).
fn scale(rng: &mut StdRng) -> [u8; 2] {
    let v: f32 = match rng.random_range(0..20) {
        0 => 0.0,
        1 => rng.random_range(1e-7f32..6e-5), // f16 subnormal range
        _ => 10f32.powf(rng.random_range(-4.0f32..0.0)),
    };
    let v = if rng.random_bool(0.5) { -v } else { v };
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// A random float of typical activation/weight magnitude, occasionally 0 or tiny.
fn value(rng: &mut StdRng) -> f32 {
    match rng.random_range(0..50) {
        0 => 0.0,
        1 => rng.random_range(-1e-30f32..1e-30),
        _ => rng.random_range(-1.0f32..1.0) * 10f32.powf(rng.random_range(-3.0f32..1.0)),
    }
}

/// A random row of `n` elements of type `t`: random quant bits, sane scales/mins.
fn random_row(t: GgmlType, n: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut row = vec![0u8; t.bytes_for(n).unwrap()];
    match t {
        GgmlType::F32 => {
            for c in row.chunks_exact_mut(4) {
                c.copy_from_slice(&value(rng).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in row.chunks_exact_mut(2) {
                c.copy_from_slice(&half::f16::from_f32(value(rng)).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in row.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(value(rng)).to_bits().to_le_bytes());
            }
        }
        // e (E8M0, any exponent a real file holds: 2^-30 .. 2^10) | qs[16] (any bits)
        GgmlType::MXFP4 => {
            rng.fill(&mut row[..]);
            for b in row.chunks_exact_mut(t.type_size()) {
                b[0] = rng.random_range(97..=137);
            }
        }
        _ => {
            rng.fill(&mut row[..]);
            // scale fields: q4_0/q8_0 d at 0; q4_1 d, m at 0, 2; q4_K/q5_K d, dmin at 0, 2
            // (6-bit sub-block scales are any bits); q6_K d at 208 (i8 scales any bits)
            let at: &[usize] = match t {
                GgmlType::Q4_0 | GgmlType::Q8_0 => &[0],
                GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q6K => &[208],
                _ => unreachable!(),
            };
            for b in row.chunks_exact_mut(t.type_size()) {
                for &a in at {
                    b[a..a + 2].copy_from_slice(&scale(rng));
                }
            }
        }
    }
    row
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits()
}

#[test]
fn simd_dot_is_bit_identical_to_scalar() {
    note_if_no_simd();
    let mut rng = StdRng::seed_from_u64(0xA5A5_2024);
    let mut checked = 0usize;
    for t in GgmlType::ALL {
        let bs = t.block_size();
        // row lengths: whole blocks, and for float types (block size 1) every tail length
        let lengths: Vec<usize> = if bs == 1 {
            (0..=40)
                .chain([63, 64, 65, 96, 127, 576, 577, 1000])
                .collect()
        } else {
            [1, 2, 3, 5, 9, 18].iter().map(|k| k * bs.max(32)).collect()
        };
        for &n in &lengths {
            for rep in 0..16 {
                let row = random_row(t, n, &mut rng);
                // 1..=5 vectors, and more than 8 (the kernels reduce 8 vectors at a time)
                let m = [1, 2, 3, 4, 5, 8, 9, 17][rep % 8];
                let xs: Vec<f32> = (0..m * n).map(|_| value(&mut rng)).collect();

                let mut got = vec![f32::NAN; m];
                let mut want = vec![f32::NAN; m];
                dot_many(t, &row, &xs, n, &mut got);
                dot_many_scalar(t, &row, &xs, n, &mut want);
                for j in 0..m {
                    let x = &xs[j * n..(j + 1) * n];
                    let single = dot(t, &row, x);
                    let single_ref = dot_scalar(t, &row, x);
                    assert!(
                        same(got[j], want[j]) && same(single, single_ref) && same(single, got[j]),
                        "{t} n={n} m={m} j={j}: dot_many {} vs scalar {}, dot {single} vs scalar {single_ref}",
                        got[j],
                        want[j]
                    );
                    checked += 1;
                }
            }
        }
    }
    eprintln!("{checked} dot products bit-identical");
}

/// Rows containing every f16 bit pattern (inf and NaN too) against vectors with zeros,
/// negative zeros and normal values. NaN payloads of the result are not compared (Rust
/// does not specify them); NaN-ness and every other bit are.
#[test]
fn f16_all_patterns_through_dot() {
    note_if_no_simd();
    let mut rng = StdRng::seed_from_u64(7);
    let pats: Vec<u16> = (0..=u16::MAX).collect();
    // rows of 37 elements: one full pseudo-block plus a tail
    for chunk in pats.chunks(37) {
        let n = chunk.len();
        let row: Vec<u8> = chunk.iter().flat_map(|h| h.to_le_bytes()).collect();
        let mut xs: Vec<f32> = (0..3 * n).map(|_| value(&mut rng)).collect();
        xs[0] = -0.0;
        xs[n + 1] = 0.0;
        let mut got = [0.0f32; 3];
        let mut want = [0.0f32; 3];
        dot_many(GgmlType::F16, &row, &xs, n, &mut got);
        dot_many_scalar(GgmlType::F16, &row, &xs, n, &mut want);
        for j in 0..3 {
            assert!(
                same(got[j], want[j]) || (got[j].is_nan() && want[j].is_nan()),
                "patterns {:#06x}..: {} vs {}",
                chunk[0],
                got[j],
                want[j]
            );
        }
    }
}

/// Mismatched shapes (a caller bug, caught by debug assertions) must not reach the SIMD
/// kernels' unchecked reads; in release builds they take the checked scalar path.
#[test]
#[cfg(not(debug_assertions))]
fn bad_shapes_do_not_panic() {
    let row = vec![0u8; GgmlType::Q4_0.bytes_for(64).unwrap()];
    let xs = vec![1.0f32; 96];
    let mut out = [0.0f32; 1];
    dot_many(GgmlType::Q4_0, &row, &xs, 96, &mut out);
    let _ = dot(GgmlType::Q4_0, &row, &xs);
    let mut out2 = [0.0f32; 2];
    dot_many(GgmlType::Q4_0, &row, &xs, 64, &mut out2);
}

/// Speed of the dispatch (SIMD) against the scalar path on one core, interleaved and
/// best-of-N to resist a noisy machine: `cargo test --release -p ferrite-formats --test
/// avx2_identity -- --ignored --nocapture speed`. Shapes of a SmolLM2-135M FFN matrix
/// (1536 x 576; 2304 inputs for the K-quants), 1 vector (decode) and 8 (prefill).
#[test]
#[ignore]
fn speed() {
    use std::time::Instant;
    let mut rng = StdRng::seed_from_u64(1);
    let rows = 1536;
    for t in GgmlType::ALL {
        let n = if t.block_size() == 256 { 2304 } else { 576 };
        let rb = t.bytes_for(n).unwrap();
        let w: Vec<u8> = (0..rows).flat_map(|_| random_row(t, n, &mut rng)).collect();
        let xs: Vec<f32> = (0..8 * n).map(|_| value(&mut rng)).collect();
        let mut out = vec![0.0f32; 8];
        // best seconds per matrix for [scalar m=1, simd m=1, scalar m=8, simd m=8]
        let mut best = [f64::MAX; 4];
        for _ in 0..15 {
            for (k, b) in best.iter_mut().enumerate() {
                let m = if k < 2 { 1 } else { 8 };
                let t0 = Instant::now();
                for r in w.chunks_exact(rb) {
                    if k % 2 == 0 {
                        dot_many_scalar(t, r, &xs[..m * n], n, &mut out[..m]);
                    } else {
                        dot_many(t, r, &xs[..m * n], n, &mut out[..m]);
                    }
                    std::hint::black_box(&out);
                }
                *b = b.min(t0.elapsed().as_secs_f64());
            }
        }
        let gmac = |s: f64, m: usize| (rows * n * m) as f64 / s / 1e9;
        eprintln!(
            "{t:>5}: 1 vec {:5.2} -> {:5.2} GMAC/s ({:4.1}x, {:5.2} GB/s)   8 vecs {:5.2} -> {:5.2} GMAC/s ({:4.1}x)",
            gmac(best[0], 1),
            gmac(best[1], 1),
            best[0] / best[1],
            w.len() as f64 / best[1] / 1e9,
            gmac(best[2], 8),
            gmac(best[3], 8),
            best[2] / best[3],
        );
    }
}
