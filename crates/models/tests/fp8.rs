//! Hugging Face FP8 checkpoints ("fine-grained FP8": E4M3 weights with `_scale_inv` block
//! scales, `quantization_config.quant_method = "fp8"`) load as BF16.
//!
//! Each oracle checkpoint's projection weights are quantized here to FP8 in blocks, and the
//! same model is written a second time with those weights dequantized by this file's own
//! decoder (bit fields into an f32, the product rounded to BF16 to nearest-even): the FP8
//! checkpoint must give exactly that checkpoint's logits. Against transformers' logits of the
//! unquantized model it differs by the FP8 rounding only.

use std::path::{Path, PathBuf};

use ferrite_backend::cpu::CpuBackend;
use ferrite_formats::quant::fp8::f32_to_e4m3;
use ferrite_models::{Logits, Model, ModelFile};
use safetensors::Dtype;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle")
}

/// NMSE of the FP8 model's logits against transformers' logits of the BF16 model: a sanity
/// bound (the exact comparison with the dequantized twin is what tests the conversion). E4M3
/// keeps 3 mantissa bits, ~3.6% RMS error a weight, and these random-weight models amplify
/// weight noise: measured 6e-3..2.6e-2. A model that is not the checkpoint's gives ~1.
const FP8_ORACLE_NMSE: f64 = 5e-2;

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

/// One quantized weight: its E4M3 codes, its scales as stored, and its dequantized BF16
/// bytes (what ferrite must load).
struct Quantized {
    codes: Vec<u8>,
    scale_bytes: Vec<u8>,
    scale_shape: Vec<usize>,
    dequant: Vec<u8>,
}

fn quantize(w: &[f32], rows: usize, cols: usize, block: [usize; 2], st: ScaleType) -> Quantized {
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
        let raw = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        *s = match st {
            ScaleType::F32 => raw,
            ScaleType::Bf16 => bf16_to_f32(bf16_bits(raw)),
        };
        for i in tile() {
            codes[i] = f32_to_e4m3(w[i] / *s);
        }
    }
    let scale_bytes = match st {
        ScaleType::F32 => scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        ScaleType::Bf16 => scales
            .iter()
            .flat_map(|&s| bf16_bits(s).to_le_bytes())
            .collect(),
    };
    let dequant = codes
        .iter()
        .enumerate()
        .flat_map(|(i, &c)| {
            let s = scales[(i / cols / block[0]) * sc + (i % cols) / block[1]];
            bf16_bits(e4m3(c) * s).to_le_bytes()
        })
        .collect();
    Quantized {
        codes,
        scale_bytes,
        scale_shape: vec![sr, sc],
        dequant,
    }
}

/// Writes checkpoint `name` twice, its 2-D projection weights quantized to FP8 in `block`
/// tiles: as an FP8 checkpoint (`quantization_config` set as `config_block` says), and with
/// the dequantized weights as plain BF16. Returns (fp8 dir, reference dir, weights quantized).
fn write_pair(
    name: &str,
    tag: &str,
    block: [usize; 2],
    st: ScaleType,
    config_block: Option<[usize; 2]>,
) -> (PathBuf, PathBuf, usize) {
    let src = data_dir().join(name);
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let base =
        std::env::temp_dir().join(format!("ferrite-fp8-{name}-{tag}-{}", std::process::id()));
    let (fp8_dir, ref_dir) = (base.join("fp8"), base.join("ref"));
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
            quantized.push((n.clone(), rows, cols, quantize(&w, rows, cols, block, st)));
        } else {
            names.push(n);
        }
    }
    let views = |fp8: bool| {
        let mut v: Vec<(String, safetensors::tensor::TensorView<'_>)> = names
            .iter()
            .map(|n| (n.clone(), file.tensor(n).unwrap()))
            .collect();
        for (n, rows, cols, q) in &quantized {
            let view = |dtype, shape: Vec<usize>, data| {
                safetensors::tensor::TensorView::new(dtype, shape, data).unwrap()
            };
            if fp8 {
                v.push((
                    n.clone(),
                    view(Dtype::F8_E4M3, vec![*rows, *cols], &q.codes),
                ));
                let sd = match st {
                    ScaleType::F32 => Dtype::F32,
                    ScaleType::Bf16 => Dtype::BF16,
                };
                v.push((
                    format!("{n}_scale_inv"),
                    view(sd, q.scale_shape.clone(), &q.scale_bytes),
                ));
            } else {
                v.push((n.clone(), view(Dtype::BF16, vec![*rows, *cols], &q.dequant)));
            }
        }
        v
    };
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    for (dir, fp8) in [(&fp8_dir, true), (&ref_dir, false)] {
        std::fs::create_dir_all(dir).unwrap();
        safetensors::serialize_to_file(views(fp8), None, &dir.join("model.safetensors")).unwrap();
        let mut c = config.clone();
        if fp8 {
            let mut q = serde_json::json!({
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
            });
            if let Some(b) = config_block {
                q["weight_block_size"] = serde_json::json!(b);
            }
            c["quantization_config"] = q;
        }
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    }
    (fp8_dir, ref_dir, quantized.len())
}

fn oracle(dir: &Path) -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(dir.join("oracle.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("tokens").unwrap();
    let tokens = match t.dtype() {
        Dtype::I64 => t
            .data()
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
        Dtype::I32 => t
            .data()
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
        d => panic!("tokens dtype {d:?}"),
    };
    let logits = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (tokens, logits)
}

fn logits(dir: &Path, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
    let be = CpuBackend::new();
    let file = ModelFile::open(dir)?;
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {})?;
    let mut kv = m.new_kv(&be, tokens.len())?;
    let mut ws = m.workspace(&be, tokens.len(), Logits::All)?;
    m.run(&be, &mut ws, &mut kv, 0, tokens, Logits::All)
}

fn nmse(a: &[f32], reference: &[f32]) -> f64 {
    let mse: f64 = a
        .iter()
        .zip(reference)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    mse / reference.iter().map(|y| (*y as f64).powi(2)).sum::<f64>()
}

fn check(name: &str, tag: &str, block: [usize; 2], st: ScaleType) {
    let (fp8, reference, n) = write_pair(name, tag, block, st, Some(block));
    assert!(n > 0, "{name}: no projection weights quantized");
    let (tokens, want) = oracle(&data_dir().join(name));
    let got = logits(&fp8, &tokens).expect("FP8 checkpoint loads");
    let exact = logits(&reference, &tokens).expect("reference checkpoint loads");
    std::fs::remove_dir_all(fp8.parent().unwrap()).ok();
    assert!(
        got == exact,
        "{name} {tag}: the FP8 checkpoint's logits differ from its dequantized BF16 twin's \
         (NMSE {:e})",
        nmse(&got, &exact)
    );
    let e = nmse(&got, &want);
    println!("{name} {tag}: {n} FP8 weights, NMSE vs transformers (BF16 model) = {e:.3e}");
    assert!(e < FP8_ORACLE_NMSE, "{name} {tag}: NMSE {e:e}");
}

/// The released checkpoints' tiles (128 × 128, F32 scales: one tile a weight here, partial
/// for the 64-row K and V), and tiles that split every weight unevenly (48 × 40, BF16 scales).
#[test]
fn fp8_checkpoints_load_as_their_dequantized_weights() {
    for name in ["qwen3-tiny", "llama-tiny"] {
        check(name, "128", [128, 128], ScaleType::F32);
        check(name, "48x40", [48, 40], ScaleType::Bf16);
    }
}

/// Per-expert MoE weights (stacked after conversion) and Qwen3.5's linear-attention
/// projections go through the same conversion.
#[test]
fn fp8_moe_and_hybrid_checkpoints_load() {
    check("qwen3-moe-tiny", "48x40", [48, 40], ScaleType::Bf16);
    check("qwen35-tiny", "48x40", [48, 40], ScaleType::F32);
    check("qwen35-moe-tiny", "128", [128, 128], ScaleType::F32);
}

fn load_error(dir: &Path) -> String {
    let (tokens, _) = oracle(&data_dir().join("qwen3-tiny"));
    let e = logits(dir, &tokens[..2]).expect_err("loaded");
    format!("{e:#}")
}

#[test]
fn fp8_checkpoints_that_cannot_load_say_why() {
    // Block scales without a block size in config.json: refused, naming the weight.
    let (fp8, _, _) = write_pair("qwen3-tiny", "noblock", [48, 40], ScaleType::F32, None);
    let err = load_error(&fp8);
    assert!(
        err.contains("gives no weight_block_size") && err.contains("_proj.weight"),
        "{err}"
    );
    // One scale a weight needs no block size.
    let (one, one_ref, _) = write_pair("qwen3-tiny", "tensor", [4096, 4096], ScaleType::F32, None);
    let (tokens, _) = oracle(&data_dir().join("qwen3-tiny"));
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
