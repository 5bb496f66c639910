//! Quantized Hugging Face checkpoints load as BF16: "fine-grained FP8" (E4M3 weights with
//! `_scale_inv` block scales, `quant_method = "fp8"`), ModelOpt FP8 and NVFP4, and
//! compressed-tensors FP8.
//!
//! Each oracle checkpoint's projection weights are quantized here, and the
//! same model is written a second time with those weights dequantized by this file's own
//! decoder (bit fields into an f32, the product rounded to BF16 to nearest-even): the FP8
//! checkpoint must give exactly that checkpoint's logits. Against transformers' logits of the
//! unquantized model it differs by the FP8 rounding only.

mod common;

use std::path::{Path, PathBuf};

use common::{data_dir, nmse, read_oracle};
use ferrite_backend::cpu::CpuBackend;
use ferrite_formats::quant::fp8::f32_to_e4m3;
use ferrite_models::{Logits, Model, ModelFile};
use safetensors::Dtype;

/// NMSE of the quantized model's logits against transformers' logits of the BF16 model: a
/// sanity bound (the exact comparison with the dequantized twin is what tests the
/// conversion). These random-weight models amplify weight noise. E4M3 keeps 3 mantissa bits
/// (~3.6% RMS error a weight): measured 6.5e-3..3.5e-2. NVFP4's E2M1 keeps one (three times
/// the error, with an E4M3 scale per 16 weights): measured 0.13..0.34. A model that is not
/// the checkpoint's gives ~1.
fn oracle_bound(scheme: Scheme) -> f64 {
    match scheme {
        Scheme::Nvfp4 => 0.5,
        _ => 5e-2,
    }
}

/// The value of an E4M3FN code, built from its bit fields (independent of the library's
/// decoder): normal codes re-biased into an f32's exponent, subnormals as m · 2⁻⁹.
fn e4m3(code: u8) -> f32 {
    let sign = u32::from(code >> 7) << 31;
    let exp = u32::from((code >> 3) & 0xf);
    let man = u32::from(code & 7);
    if exp == 0 {
        let v = man as f32 / 512.0;
        return if sign != 0 { -v } else { v };
    }
    f32::from_bits(sign | ((exp + 127 - 7) << 23) | (man << 20))
}

/// f32 to BF16 bits, rounding to nearest-even (finite inputs).
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// How the test stores the block scales.
#[derive(Clone, Copy)]
enum ScaleType {
    F32,
    Bf16,
}

/// The stored forms these tests write.
#[derive(Clone, Copy)]
enum Scheme {
    /// "fine-grained FP8": a `_scale_inv` per tile.
    Fp8Blocks([usize; 2], ScaleType),
    /// ModelOpt FP8: one F32 `_scale` (shape []) a tensor, and an `input_scale`.
    Fp8Tensor,
    /// compressed-tensors FP8: a BF16 `_scale` of shape [rows, 1].
    Fp8Rows,
    /// ModelOpt NVFP4: packed E2M1, an E4M3 `_scale` per 16, an F32 `_scale_2`.
    Nvfp4,
}

/// One quantized weight: the tensors that store it (name suffix, dtype, shape, bytes) and
/// its dequantized BF16 bytes (what ferrite must load).
struct Quantized {
    stored: Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)>,
    dequant: Vec<u8>,
}

fn scale_bytes(v: &[f32], st: ScaleType) -> Vec<u8> {
    match st {
        ScaleType::F32 => v.iter().flat_map(|s| s.to_le_bytes()).collect(),
        ScaleType::Bf16 => v.iter().flat_map(|&s| bf16_bits(s).to_le_bytes()).collect(),
    }
}

fn stored_scale(raw: f32, st: ScaleType) -> f32 {
    match st {
        ScaleType::F32 => raw,
        ScaleType::Bf16 => bf16_to_f32(bf16_bits(raw)),
    }
}

/// FP8 codes and scales for `w` in `block` tiles (a tile per tensor: the whole matrix; per
/// row: one row), and the dequantized BF16 bytes.
fn fp8_tiles(
    w: &[f32],
    rows: usize,
    cols: usize,
    block: [usize; 2],
    st: ScaleType,
) -> (Vec<u8>, Vec<f32>, Vec<u8>) {
    let (sr, sc) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0f32; sr * sc];
    for (ti, s) in scales.iter_mut().enumerate() {
        let (r0, c0) = ((ti / sc) * block[0], (ti % sc) * block[1]);
        let tile = || {
            (r0..(r0 + block[0]).min(rows))
                .flat_map(move |r| (c0..(c0 + block[1]).min(cols)).map(move |c| r * cols + c))
        };
        let amax = tile().map(|i| w[i].abs()).fold(0f32, f32::max);
        // The scale as stored: a BF16 scale is rounded before the codes are chosen.
        *s = stored_scale(if amax > 0.0 { amax / 448.0 } else { 1.0 }, st);
        for i in tile() {
            codes[i] = f32_to_e4m3(w[i] / *s);
        }
    }
    let dequant = codes
        .iter()
        .enumerate()
        .flat_map(|(i, &c)| {
            let s = scales[(i / cols / block[0]) * sc + (i % cols) / block[1]];
            bf16_bits(e4m3(c) * s).to_le_bytes()
        })
        .collect();
    (codes, scales, dequant)
}

/// The E2M1 value of a code from its bit fields (sign, exponent with bias 1, one mantissa
/// bit; exponent 0 subnormal).
fn e2m1(code: u8) -> f32 {
    let sign = if code & 8 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = ((code >> 1) & 3, f32::from(code & 1));
    sign * if exp == 0 {
        man * 0.5
    } else {
        (1.0 + man * 0.5) * f32::powi(2.0, i32::from(exp) - 1)
    }
}

fn nearest_e2m1(x: f32) -> u8 {
    (0..16u8)
        .min_by(|&a, &b| (e2m1(a) - x).abs().total_cmp(&(e2m1(b) - x).abs()))
        .unwrap()
}

fn quantize(w: &[f32], rows: usize, cols: usize, scheme: Scheme) -> Quantized {
    match scheme {
        Scheme::Fp8Blocks(block, st) => {
            let (codes, scales, dequant) = fp8_tiles(w, rows, cols, block, st);
            let sd = match st {
                ScaleType::F32 => Dtype::F32,
                ScaleType::Bf16 => Dtype::BF16,
            };
            let grid = vec![rows.div_ceil(block[0]), cols.div_ceil(block[1])];
            Quantized {
                stored: vec![
                    ("", Dtype::F8_E4M3, vec![rows, cols], codes),
                    ("_scale_inv", sd, grid, scale_bytes(&scales, st)),
                ],
                dequant,
            }
        }
        Scheme::Fp8Tensor => {
            let (codes, scales, dequant) = fp8_tiles(w, rows, cols, [rows, cols], ScaleType::F32);
            Quantized {
                stored: vec![
                    ("", Dtype::F8_E4M3, vec![rows, cols], codes),
                    (
                        "_scale",
                        Dtype::F32,
                        vec![],
                        scale_bytes(&scales, ScaleType::F32),
                    ),
                ],
                dequant,
            }
        }
        Scheme::Fp8Rows => {
            let (codes, scales, dequant) = fp8_tiles(w, rows, cols, [1, cols], ScaleType::Bf16);
            Quantized {
                stored: vec![
                    ("", Dtype::F8_E4M3, vec![rows, cols], codes),
                    (
                        "_scale",
                        Dtype::BF16,
                        vec![rows, 1],
                        scale_bytes(&scales, ScaleType::Bf16),
                    ),
                ],
                dequant,
            }
        }
        Scheme::Nvfp4 => {
            // ModelOpt's recipe: a global scale amax / (6 · 448), a group scale (E4M3) of
            // group amax / 6 in its units, each weight the nearest E2M1 code.
            let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            let global = amax / (6.0 * 448.0);
            let groups = cols.div_ceil(16);
            let mut sf = vec![0u8; rows * groups];
            let mut packed = vec![0u8; rows * cols / 2];
            let mut dequant = Vec::with_capacity(rows * cols * 2);
            for r in 0..rows {
                for g in 0..groups {
                    let idx = (g * 16..((g + 1) * 16).min(cols)).map(|c| r * cols + c);
                    let gmax = idx.clone().fold(0f32, |m, i| m.max(w[i].abs()));
                    sf[r * groups + g] = f32_to_e4m3(gmax / 6.0 / global);
                    let s = e4m3(sf[r * groups + g]);
                    for i in idx {
                        let q = if s > 0.0 {
                            nearest_e2m1(w[i] / (s * global))
                        } else {
                            0
                        };
                        let c = i % cols;
                        packed[i / 2] |= if c.is_multiple_of(2) { q } else { q << 4 };
                    }
                }
                for c in 0..cols {
                    let i = r * cols + c;
                    let q = if c % 2 == 0 {
                        packed[i / 2] & 0xF
                    } else {
                        packed[i / 2] >> 4
                    };
                    let s = e4m3(sf[r * groups + c / 16]);
                    dequant.extend_from_slice(&bf16_bits(e2m1(q) * s * global).to_le_bytes());
                }
            }
            Quantized {
                stored: vec![
                    ("", Dtype::U8, vec![rows, cols / 2], packed),
                    ("_scale", Dtype::F8_E4M3, vec![rows, groups], sf),
                    (
                        "_scale_2",
                        Dtype::F32,
                        vec![],
                        global.to_le_bytes().to_vec(),
                    ),
                ],
                dequant,
            }
        }
    }
}

/// Writes checkpoint `name` twice, its 2-D projection weights quantized by `scheme`: as a
/// quantized checkpoint (`quantization_config` as given), and with the dequantized weights as
/// plain BF16. Returns (quantized dir, reference dir, weights quantized).
fn write_pair(
    name: &str,
    tag: &str,
    scheme: Scheme,
    quant_config: serde_json::Value,
) -> (PathBuf, PathBuf, usize) {
    let src = data_dir().join(name);
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let base =
        std::env::temp_dir().join(format!("ferrite-quant-{name}-{tag}-{}", std::process::id()));
    let (q_dir, ref_dir) = (base.join("quant"), base.join("ref"));
    let mut quantized = Vec::new();
    let mut names = Vec::new();
    for (n, t) in file.tensors() {
        if t.shape().len() == 2 && n.ends_with("proj.weight") {
            assert_eq!(t.dtype(), Dtype::BF16, "{n}");
            let w: Vec<f32> = t
                .data()
                .chunks_exact(2)
                .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                .collect();
            let (rows, cols) = (t.shape()[0], t.shape()[1]);
            quantized.push((n.clone(), rows, cols, quantize(&w, rows, cols, scheme)));
        } else {
            names.push(n);
        }
    }
    // An activation scale as ModelOpt writes one per weight (ferrite does not use it).
    let input_scale = 1.0f32.to_le_bytes();
    let views = |quant: bool| {
        let mut v: Vec<(String, safetensors::tensor::TensorView<'_>)> = names
            .iter()
            .map(|n| (n.clone(), file.tensor(n).unwrap()))
            .collect();
        for (n, rows, cols, q) in &quantized {
            let view = |dtype, shape: Vec<usize>, data| {
                safetensors::tensor::TensorView::new(dtype, shape, data).unwrap()
            };
            if quant {
                for (suffix, dtype, shape, data) in &q.stored {
                    v.push((format!("{n}{suffix}"), view(*dtype, shape.clone(), data)));
                }
                let is = n.replace(".weight", ".input_scale");
                v.push((is, view(Dtype::F32, vec![], &input_scale)));
            } else {
                v.push((n.clone(), view(Dtype::BF16, vec![*rows, *cols], &q.dequant)));
            }
        }
        v
    };
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    for (dir, quant) in [(&q_dir, true), (&ref_dir, false)] {
        std::fs::create_dir_all(dir).unwrap();
        safetensors::serialize_to_file(views(quant), None, &dir.join("model.safetensors")).unwrap();
        let mut c = config.clone();
        if quant {
            c["quantization_config"] = quant_config.clone();
        }
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    }
    (q_dir, ref_dir, quantized.len())
}

fn fp8_config(block: Option<[usize; 2]>) -> serde_json::Value {
    let mut q = serde_json::json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
    });
    if let Some(b) = block {
        q["weight_block_size"] = serde_json::json!(b);
    }
    q
}

fn logits(dir: &Path, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
    let be = CpuBackend::new();
    let file = ModelFile::open(dir)?;
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {})?;
    let mut kv = m.new_kv(&be, tokens.len())?;
    let mut ws = m.workspace(&be, tokens.len(), Logits::All)?;
    m.run(&be, &mut ws, &mut kv, 0, tokens, Logits::All)
}

fn check(name: &str, tag: &str, scheme: Scheme, config: serde_json::Value) {
    let (quant, reference, n) = write_pair(name, tag, scheme, config);
    assert!(n > 0, "{name}: no projection weights quantized");
    let o = read_oracle(&data_dir().join(name));
    let (tokens, want) = (&o.tokens, &o.logits);
    let got = logits(&quant, tokens).expect("quantized checkpoint loads");
    let exact = logits(&reference, tokens).expect("reference checkpoint loads");
    assert_eq!(
        got.len(),
        tokens.len() * o.vocab,
        "{name} {tag}: logits of every position"
    );
    std::fs::remove_dir_all(quant.parent().unwrap()).ok();
    assert!(
        got == exact,
        "{name} {tag}: the quantized checkpoint's logits differ from its dequantized BF16 \
         twin's (NMSE {:e})",
        nmse(&got, &exact)
    );
    let e = nmse(&got, want);
    println!("{name} {tag}: {n} weights, NMSE vs transformers (BF16 model) = {e:.3e}");
    assert!(e < oracle_bound(scheme), "{name} {tag}: NMSE {e:e}");
}

fn blocks(name: &str, tag: &str, block: [usize; 2], st: ScaleType) {
    check(
        name,
        tag,
        Scheme::Fp8Blocks(block, st),
        fp8_config(Some(block)),
    );
}

/// The released checkpoints' tiles (128 × 128, F32 scales: one tile a weight here, partial
/// for the 64-row K and V), and tiles that split every weight unevenly (48 × 40, BF16 scales).
#[test]
fn fp8_checkpoints_load_as_their_dequantized_weights() {
    for name in ["qwen3-tiny", "llama-tiny"] {
        blocks(name, "128", [128, 128], ScaleType::F32);
        blocks(name, "48x40", [48, 40], ScaleType::Bf16);
    }
}

/// Per-expert MoE weights (stacked after conversion) and Qwen3.5's linear-attention
/// projections go through the same conversion.
#[test]
fn fp8_moe_and_hybrid_checkpoints_load() {
    blocks("qwen3-moe-tiny", "48x40", [48, 40], ScaleType::Bf16);
    blocks("qwen35-tiny", "48x40", [48, 40], ScaleType::F32);
    blocks("qwen35-moe-tiny", "128", [128, 128], ScaleType::F32);
}

/// ModelOpt's FP8 (a scale a tensor) and NVFP4, and compressed-tensors' FP8 (a scale a row).
#[test]
fn modelopt_and_compressed_tensors_checkpoints_load() {
    let modelopt = |algo: &str| serde_json::json!({"quant_method": "modelopt", "quant_algo": algo, "group_size": 16});
    let ct = serde_json::json!({"quant_method": "compressed-tensors", "format": "float-quantized"});
    // ModelOpt's other layout: its fields under "quantization".
    let nested =
        serde_json::json!({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}});
    check("llama-tiny", "nvfp4-nested", Scheme::Nvfp4, nested);
    for name in ["qwen3-tiny", "qwen3-moe-tiny", "qwen35-tiny"] {
        check(name, "fp8-tensor", Scheme::Fp8Tensor, modelopt("FP8"));
        check(name, "fp8-rows", Scheme::Fp8Rows, ct.clone());
        check(name, "nvfp4", Scheme::Nvfp4, modelopt("NVFP4"));
    }
}

fn load_error(dir: &Path) -> String {
    let tokens = read_oracle(&data_dir().join("qwen3-tiny")).tokens;
    let e = logits(dir, &tokens[..2]).expect_err("loaded");
    format!("{e:#}")
}

#[test]
fn fp8_checkpoints_that_cannot_load_say_why() {
    // Block scales without a block size in config.json: refused, naming the weight.
    let (fp8, _, _) = write_pair(
        "qwen3-tiny",
        "noblock",
        Scheme::Fp8Blocks([48, 40], ScaleType::F32),
        fp8_config(None),
    );
    let err = load_error(&fp8);
    assert!(
        err.contains("gives no weight_block_size") && err.contains("_proj.weight"),
        "{err}"
    );
    // One scale a weight needs no block size.
    let (one, one_ref, _) = write_pair(
        "qwen3-tiny",
        "tensor",
        Scheme::Fp8Blocks([4096, 4096], ScaleType::F32),
        fp8_config(None),
    );
    let tokens = read_oracle(&data_dir().join("qwen3-tiny")).tokens;
    assert_eq!(
        logits(&one, &tokens).unwrap(),
        logits(&one_ref, &tokens).unwrap()
    );
    // Another quantization method, a malformed block size, another FP8 format.
    let config = fp8.join("config.json");
    let c: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    for (key, value, want) in [
        (
            "quant_method",
            serde_json::json!("awq"),
            "quantized with 'awq'",
        ),
        (
            "weight_block_size",
            serde_json::json!([128]),
            "expected two positive integers",
        ),
        ("fmt", serde_json::json!("e5m2"), "format 'e5m2'"),
    ] {
        let mut c = c.clone();
        c["quantization_config"][key] = value;
        std::fs::write(&config, c.to_string()).unwrap();
        let err = load_error(&fp8);
        assert!(err.contains(want), "{key}: {err}");
    }
    std::fs::remove_dir_all(fp8.parent().unwrap()).ok();
    std::fs::remove_dir_all(one.parent().unwrap()).ok();
}
