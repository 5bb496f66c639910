//! ggml quant types against an independent implementation: the numpy (de)quantizers of
//! gguf-py (`gguf.quants`), whose outputs `tools/quant_vectors/make_vectors.py` stored in
//! `tests/data/quant_vectors/vectors.json` (see that file for the gguf version).
//!
//! Checked here:
//! - `dequantize` is bit-exact with gguf-py for every type (random blocks);
//! - `quantize` is byte-exact with gguf-py where gguf-py has a quantizer (f32 f16 bf16 q4_0
//!   q4_1 q8_0 mxfp4). gguf-py 0.19 has none for q4_K/q5_K/q6_K: those are only checked for
//!   round-trip error here (and by construction against ggml's C reference);
//! - `dot` is within a rounding-error bound of an f64 dot of the dequantized row, and
//!   `dot_many` is bit-identical to `dot`;
//! - quantize → dequantize error is within a per-type bound;
//! - bad lengths are errors, not panics.

use ferrite_formats::quant::{dequantize, dot, dot_many, quantize};
use ferrite_formats::GgmlType;
use serde::Deserialize;

#[derive(Deserialize)]
struct Vectors {
    gguf_version: String,
    types: Vec<TypeVectors>,
}

#[derive(Deserialize)]
struct TypeVectors {
    #[serde(rename = "type")]
    name: String,
    dequant: Dequant,
    quant: Quant,
}

#[derive(Deserialize)]
struct Dequant {
    n: usize,
    data: String,
    f32_bits: String,
}

#[derive(Deserialize)]
struct Quant {
    n: usize,
    x_f32_bits: String,
    data: Option<String>,
}

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2));
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn f32s(s: &str) -> Vec<f32> {
    hex(s)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn load() -> Vectors {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/quant_vectors/vectors.json"
    );
    let text = std::fs::read_to_string(path).expect("test vectors present");
    serde_json::from_str(&text).expect("test vectors parse")
}

fn ty(name: &str) -> GgmlType {
    *GgmlType::ALL
        .iter()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("type {name}"))
}

/// Deterministic xorshift activations in [-1, 1) (no extra dev-dependency needed).
fn activations(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn all_types_present() {
    let v = load();
    assert!(!v.gguf_version.is_empty());
    for t in GgmlType::ALL {
        assert!(
            v.types.iter().any(|tv| tv.name == t.name()),
            "no vectors for {t}"
        );
    }
}

#[test]
fn dequantize_is_bit_exact_with_gguf_py() {
    for tv in load().types {
        let t = ty(&tv.name);
        let data = hex(&tv.dequant.data);
        let want = f32s(&tv.dequant.f32_bits);
        assert_eq!(want.len(), tv.dequant.n);
        let mut got = vec![0.0f32; tv.dequant.n];
        dequantize(t, &data, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{t} element {i}: ours {g:e}, gguf-py {w:e}"
            );
        }
    }
}

/// Types whose quantizer gguf-py implements (0.19.0); each must match byte for byte.
const GGUF_PY_QUANTIZERS: [&str; 6] = ["f32", "f16", "bf16", "q4_0", "q4_1", "q8_0"];

#[test]
fn quantize_is_byte_exact_with_gguf_py() {
    for tv in load().types {
        let t = ty(&tv.name);
        let x = f32s(&tv.quant.x_f32_bits);
        assert_eq!(x.len(), tv.quant.n);
        let Some(want) = tv.quant.data.as_deref().map(hex) else {
            assert!(
                !GGUF_PY_QUANTIZERS.contains(&tv.name.as_str()),
                "{t}: vectors lack bytes"
            );
            continue;
        };
        let mut got = vec![0u8; t.bytes_for(x.len()).unwrap()];
        quantize(t, &x, &mut got).unwrap();
        assert_eq!(got.len(), want.len());
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            let bs = t.type_size();
            panic!(
                "{t}: byte {i} (block {}) differs: ours {:02x?}, gguf-py {:02x?}",
                i / bs,
                &got[i / bs * bs..][..bs],
                &want[i / bs * bs..][..bs]
            );
        }
    }
}

/// Upper bound on |dot - exact| for our summation tree, as a multiple of sum |w_i x_i|:
/// each product is rounded once and each term then goes through at most `depth` f32
/// additions (block_size/8 lane adds + 3 tree levels + one add per block into the row sum),
/// and for k roundings the relative error is at most k·u/(1 - k·u) ≈ k·u with
/// u = f32::EPSILON / 2 (Higham, Accuracy and Stability, §3.1). The weights themselves are
/// compared exactly (the reference is the f64 dot of our bit-exact dequantized row).
fn dot_error_bound(t: GgmlType, n: usize, sum_abs: f64) -> f64 {
    let block = if t.block_size() == 1 {
        32
    } else {
        t.block_size()
    };
    let depth = (block / 8 + 3 + n.div_ceil(block) + 1) as f64;
    let u = f32::EPSILON as f64 / 2.0;
    // factor 1.01 covers the second-order k·u/(1 - k·u) term for k < 10^4
    1.01 * depth * u * sum_abs
}

#[test]
fn dot_matches_dequantized_dot_and_dot_many_is_identical() {
    for tv in load().types {
        let t = ty(&tv.name);
        // the vectors' random blocks as one long row, and also shorter prefixes as rows
        let data = hex(&tv.dequant.data);
        let n_all = tv.dequant.n;
        let step = if t.block_size() == 1 {
            32 + 7
        } else {
            t.block_size()
        };
        let mut n = step;
        while n <= n_all {
            let bytes = t.bytes_for(n).unwrap();
            let row = &data[..bytes];
            let mut w = vec![0.0f32; n];
            dequantize(t, row, &mut w).unwrap();
            let x = activations(n, n as u64);
            let got = dot(t, row, &x);
            let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let sum_abs: f64 = w
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            if exact.is_finite() {
                let bound = dot_error_bound(t, n, sum_abs);
                assert!(
                    (got as f64 - exact).abs() <= bound,
                    "{t} n={n}: dot {got} vs exact {exact} (bound {bound})"
                );
            }

            // dot_many over 5 vectors (one of them equal to x) is bit-identical to dot
            let m = 5;
            let mut xs = Vec::with_capacity(m * n);
            for j in 0..m {
                xs.extend(if j == 2 {
                    x.clone()
                } else {
                    activations(n, (n * 31 + j) as u64)
                });
            }
            let mut many = vec![f32::NAN; m];
            dot_many(t, row, &xs, n, &mut many);
            for j in 0..m {
                let single = dot(t, row, &xs[j * n..(j + 1) * n]);
                // NaN (random f32/bf16 bits include NaN and inf): the payload is not
                // specified by Rust, only NaN-ness
                let same =
                    many[j].to_bits() == single.to_bits() || (many[j].is_nan() && single.is_nan());
                assert!(
                    same,
                    "{t} n={n} vector {j}: dot_many {} vs dot {single}",
                    many[j]
                );
            }
            assert!(many[2].to_bits() == got.to_bits() || (got.is_nan() && many[2].is_nan()));
            n += step * 3;
        }
    }
}

/// Round-trip bounds: sqrt(sum (x - deq(q(x)))^2 / sum x^2) over gaussian data, per type.
/// Derived from the grid step: uniform rounding error has rms step/sqrt(12); for b bits and
/// gaussian blocks the step is about range/(2^b - 1) with range ≈ 4.5σ (32 values) to 5.5σ
/// (256), so the expected relative rms is ≈ range/((2^b - 1)·sqrt(12)). The bounds are that
/// estimate with headroom of about 1.5x (measured values in the comments).
fn roundtrip_bound(t: GgmlType) -> f64 {
    // measured on this test's data (64 gaussian super-blocks) in the comments
    match t {
        GgmlType::F32 => 0.0,
        // 11-bit significand: relative error <= 2^-11, rms about 2^-11/sqrt(3) (2.1e-4)
        GgmlType::F16 => 3.2e-4,
        // 8-bit significand: relative error <= 2^-8 (1.7e-3)
        GgmlType::BF16 => 2.5e-3,
        GgmlType::Q8_0 => 0.008, // 0.0054
        GgmlType::Q4_0 => 0.13,  // 0.087
        GgmlType::Q4_1 => 0.115, // 0.077
        GgmlType::Q4K => 0.105,  // 0.071
        GgmlType::Q5K => 0.055,  // 0.036
        GgmlType::Q6K => 0.027,  // 0.0177
        // E2M1 codes: 2 significant bits, a power-of-two scale per 32 (0.115)
        GgmlType::MXFP4 => 0.17,
    }
}

#[test]
fn roundtrip_error_within_bounds() {
    for t in GgmlType::ALL {
        let n = 64 * 256;
        // gaussian via Box-Muller on the xorshift stream
        let u = activations(2 * n, 77 + t.id() as u64);
        let x: Vec<f32> = (0..n)
            .map(|i| {
                let (a, b) = ((u[2 * i] + 1.0) / 2.0, (u[2 * i + 1] + 1.0) / 2.0);
                let r = (-2.0 * (a.max(1e-7) as f64).ln()).sqrt();
                (r * (std::f64::consts::TAU * b as f64).cos()) as f32
            })
            .collect();
        let mut q = vec![0u8; t.bytes_for(n).unwrap()];
        quantize(t, &x, &mut q).unwrap();
        let mut y = vec![0.0f32; n];
        dequantize(t, &q, &mut y).unwrap();
        let err: f64 = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
            .sum();
        let norm: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
        let rel = (err / norm).sqrt();
        eprintln!("{t}: relative rms round-trip error {rel:.5}");
        assert!(
            rel <= roundtrip_bound(t),
            "{t}: relative rms error {rel} > {}",
            roundtrip_bound(t)
        );
    }
}

#[test]
fn k_quant_quantize_roundtrip_on_vector_inputs() {
    // the vectors' edge-case inputs (zero, constant, outlier, one-signed blocks) must
    // quantize without NaN and dequantize close to the input
    for tv in load().types {
        let t = ty(&tv.name);
        let x = f32s(&tv.quant.x_f32_bits);
        let mut q = vec![0u8; t.bytes_for(x.len()).unwrap()];
        quantize(t, &x, &mut q).unwrap();
        let mut y = vec![0.0f32; x.len()];
        dequantize(t, &q, &mut y).unwrap();
        let bs = t.block_size().max(32);
        for (b, (xb, yb)) in x.chunks(bs).zip(y.chunks(bs)).enumerate() {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            let max_err = xb
                .iter()
                .zip(yb)
                .fold(0.0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
            assert!(
                yb.iter().all(|v| v.is_finite()),
                "{t} block {b}: non-finite output"
            );
            if t.block_size() > 1 {
                // generous: no element off by more than half the block's range
                assert!(
                    max_err <= 0.5 * amax + 1e-6,
                    "{t} block {b}: max error {max_err}, amax {amax}"
                );
            }
        }
    }
}

#[test]
fn bad_lengths_are_errors() {
    for t in GgmlType::ALL {
        let bs = t.block_size();
        let n = 2 * bs.max(32);
        let ts = t.bytes_for(n).unwrap();
        let mut out = vec![0.0f32; n];
        assert!(dequantize(t, &vec![0u8; ts - 1], &mut out).is_err(), "{t}");
        assert!(dequantize(t, &vec![0u8; ts + 1], &mut out).is_err(), "{t}");
        let mut q = vec![0u8; ts + 1];
        assert!(quantize(t, &out, &mut q).is_err(), "{t}");
        if bs > 1 {
            let mut odd = vec![0.0f32; n - 1];
            assert!(dequantize(t, &vec![0u8; ts], &mut odd).is_err(), "{t}");
            assert!(quantize(t, &odd, &mut vec![0u8; ts]).is_err(), "{t}");
        }
        assert!(
            dequantize(t, &[], &mut []).is_ok(),
            "{t}: empty row is fine"
        );
    }
}

/// Throughput of `dot` (GB/s of weights) and `quantize` (MB/s of output) on one core.
/// Not a correctness test: `cargo test -p ferrite-formats --test quant_vectors -- --ignored
/// --nocapture throughput`.
#[test]
#[ignore]
fn throughput() {
    use std::time::Instant;
    let (rows, n) = (1536usize, 576usize); // a SmolLM2-135M FFN matrix
    let x = activations(n, 1);
    for t in GgmlType::ALL {
        let n_q = if t.block_size() == 256 { 2304 } else { n };
        let src = activations(rows * n_q, 2);
        let rb = t.bytes_for(n_q).unwrap();
        let mut w = vec![0u8; rows * rb];
        let t0 = Instant::now();
        for (r, o) in src.chunks_exact(n_q).zip(w.chunks_exact_mut(rb)) {
            quantize(t, r, o).unwrap();
        }
        let qs = t0.elapsed().as_secs_f64();
        let xq = activations(n_q, 3);
        let xs = if n_q == n { &x } else { &xq };
        let mut sink = 0.0f32;
        let reps = 50;
        let t0 = Instant::now();
        for _ in 0..reps {
            for r in w.chunks_exact(rb) {
                sink += dot(t, r, xs);
            }
        }
        let ds = t0.elapsed().as_secs_f64() / reps as f64;
        eprintln!(
            "{t:>5}: dot {:6.2} GB/s ({:5.1} Melem/s)  quantize {:7.1} MB/s out ({:6.1} Melem/s)  [{sink:.1}]",
            w.len() as f64 / ds / 1e9,
            (rows * n_q) as f64 / ds / 1e6,
            w.len() as f64 / qs / 1e6,
            (rows * n_q) as f64 / qs / 1e6,
        );
    }
}

/// The types converted at load (q5_0, q3_K, iq4_nl; `quant::converted`), against gguf-py's
/// dequantizers (`tools/quant_vectors/make_converted_vectors.py`): the reference
/// dequantization, and the converted q8_0 / q6_K blocks' values, bit for bit.
#[test]
fn converted_types_keep_gguf_py_values() {
    use ferrite_formats::quant::converted::ConvertedType;
    #[derive(Deserialize)]
    struct Converted {
        types: Vec<ConvertedVectors>,
    }
    #[derive(Deserialize)]
    struct ConvertedVectors {
        #[serde(rename = "type")]
        name: String,
        n: usize,
        data: String,
        f32_bits: String,
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/quant_vectors/converted.json"
    );
    let v: Converted = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for t in ConvertedType::ALL {
        let tv = v
            .types
            .iter()
            .find(|tv| tv.name == t.name())
            .unwrap_or_else(|| panic!("no vectors for {t}"));
        let (data, want) = (hex(&tv.data), f32s(&tv.f32_bits));
        assert_eq!(want.len(), tv.n);
        let mut reference = vec![0f32; tv.n];
        t.dequantize(&data, &mut reference).unwrap();
        let mut converted = vec![0f32; tv.n];
        dequantize(t.target(), &t.convert(&data).unwrap(), &mut converted).unwrap();
        for (i, w) in want.iter().enumerate() {
            let (r, c) = (reference[i], converted[i]);
            assert_eq!(
                r.to_bits(),
                w.to_bits(),
                "{t} value {i}: ours {r:e}, gguf-py {w:e}"
            );
            assert_eq!(
                c.to_bits(),
                w.to_bits(),
                "{t} value {i} as {}: {c:e}, gguf-py {w:e}",
                t.target()
            );
        }
    }
}
