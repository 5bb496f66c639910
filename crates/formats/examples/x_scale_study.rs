//! What scaling the decode GEMV's quantized activations per 256 columns instead of per 32
//! would cost in accuracy (MATMUL.md, "The few-row GEMVs": integer sub-block scales inside a
//! Q4_K super-block need one x scale per super-block).
//!
//! x is quantized as CUDA's `quant_q8_lane` does, two int8 planes, v ≈ d (127 hi + lo) with
//! d = amax / 127², over blocks of 32 (today) or 256 (the proposal). Each dot product of a
//! Q4_K row with the quantized x is compared, in f64, with the dot of the same Q4_K row with
//! the exact x; the Q4_K rounding of the weights themselves (the dot of the f32 row with x
//! minus the Q4_K row's) is printed beside it as the scale that matters.
//!
//! `cargo run --release -p ferrite-formats --example x_scale_study`

use ferrite_formats::quant::{dequantize, quantize};
use ferrite_formats::GgmlType;
use rand::{Rng, SeedableRng};

const N_IN: usize = 4096;
const ROWS: usize = 512;

/// x quantized in blocks of `block` columns: two planes, as `quant_q8_lane`.
fn two_planes(x: &[f32], block: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks(block) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            out.extend(std::iter::repeat_n(0.0, b.len()));
            continue;
        }
        let d1 = amax / 127.0;
        let d = d1 / 127.0;
        for &v in b {
            let hi = (v * (127.0 / amax)).round_ties_even();
            let lo = ((v - hi * d1) / d).round_ties_even().clamp(-127.0, 127.0);
            out.push(d as f64 * (127.0 * hi as f64 + lo as f64));
        }
    }
    out
}

fn dot(w: &[f32], x: &[f64]) -> f64 {
    w.iter().zip(x).map(|(&a, &b)| a as f64 * b).sum()
}

fn normal(rng: &mut impl Rng) -> f32 {
    // Box-Muller.
    let (u, v): (f64, f64) = (rng.random_range(1e-12..1.0), rng.random_range(0.0..1.0));
    ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(37);
    let mut w = vec![0f32; ROWS * N_IN];
    for v in &mut w {
        *v = 0.02 * normal(&mut rng);
    }
    let mut wq = vec![0u8; GgmlType::Q4K.bytes_for(w.len())?];
    quantize(GgmlType::Q4K, &w, &mut wq)?;
    let mut wd = vec![0f32; w.len()];
    dequantize(GgmlType::Q4K, &wq, &mut wd)?;

    println!("relative RMS error of {ROWS} dot products of {N_IN} (Q4_K rows, f64 sums)");
    println!(
        "{:<34} {:>12} {:>12} {:>12}",
        "x", "x per 32", "x per 256", "Q4_K weights"
    );
    // Activations: plain normal, and with outlier channels (RMSNorm outputs of real models
    // carry a few channels 20-100x the rest).
    for (name, outliers, factor) in [
        ("normal", 0, 1.0f32),
        ("4 channels x20", 4, 20.0),
        ("4 channels x100", 4, 100.0),
        ("16 channels x100", 16, 100.0),
    ] {
        let mut x: Vec<f32> = (0..N_IN).map(|_| normal(&mut rng)).collect();
        for _ in 0..outliers {
            let c = rng.random_range(0..N_IN);
            x[c] *= factor;
        }
        let xe: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let (x32, x256) = (two_planes(&x, 32), two_planes(&x, 256));
        let (mut e32, mut e256, mut ew, mut p) = (0f64, 0f64, 0f64, 0f64);
        for r in 0..ROWS {
            let row = &wd[r * N_IN..(r + 1) * N_IN];
            let exact = dot(row, &xe);
            e32 += (dot(row, &x32) - exact).powi(2);
            e256 += (dot(row, &x256) - exact).powi(2);
            ew += (dot(&w[r * N_IN..(r + 1) * N_IN], &xe) - exact).powi(2);
            p += exact * exact;
        }
        let rel = |e: f64| (e / p).sqrt();
        println!(
            "{name:<34} {:>12.2e} {:>12.2e} {:>12.2e}",
            rel(e32),
            rel(e256),
            rel(ew)
        );
    }
    // The proposal's integer ranges (per super-block, Σ_j sc_j Σ_k q_k plane_k):
    let hi = 63i64 * 15 * 127 * 256;
    println!(
        "int32 range: hi plane |Σ sc S| <= {hi} ({:.1}% of 2^31); 127 hi + lo combined {} (over: keep the planes apart)",
        100.0 * hi as f64 / 2f64.powi(31),
        127 * hi + 63 * 15 * 127 * 256
    );
    Ok(())
}
