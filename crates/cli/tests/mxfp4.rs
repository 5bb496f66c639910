//! MXFP4 weights (llama.cpp's `MXFP4_MOE` files: the routed experts in MXFP4) run on the CPU
//! reference exactly as their dequantized values do: a copy of the file whose expert tensors
//! are F32 (each weight decoded once) gives bit-identical logits, because the CPU's dot
//! products decode every type into the same 32-weight blocks and sum them in one order.

use ferrite_backend::cpu::CpuBackend;
use ferrite_cli::synth::{self, Preset, SynthArgs, SynthQuant};
use ferrite_formats::gguf::{GgufFile, GgufWriter};
use ferrite_formats::quant::dequantize;
use ferrite_formats::GgmlType;
use ferrite_models::{Logits, Model, ModelFile};

fn logits(path: &std::path::Path, tokens: &[u32]) -> Vec<f32> {
    let be = CpuBackend::new();
    let file = ModelFile::open(path).unwrap();
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    let mut kv = m.new_kv(&be, tokens.len()).unwrap();
    let mut ws = m.workspace(&be, tokens.len(), Logits::All).unwrap();
    m.run(&be, &mut ws, &mut kv, 0, tokens, Logits::All)
        .unwrap()
}

/// `src` rewritten with every MXFP4 tensor as F32; the number of tensors converted.
fn with_f32_experts(src: &std::path::Path, dst: &std::path::Path) -> usize {
    let f = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::create(dst).unwrap();
    for (k, v) in f.metadata() {
        if k != "general.alignment" {
            w.add_kv(k.clone(), v.clone()).unwrap();
        }
    }
    let mut converted = 0;
    let mut data = Vec::new();
    for info in f.tensor_infos() {
        let bytes = f.tensor_data(info);
        let (ty, bytes) = if info.dtype == GgmlType::MXFP4 {
            converted += 1;
            let mut v = vec![0f32; info.shape.iter().product()];
            dequantize(GgmlType::MXFP4, bytes, &mut v).unwrap();
            (
                GgmlType::F32,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        } else {
            (info.dtype, bytes.to_vec())
        };
        w.add_tensor_info(&info.name, ty, &info.shape).unwrap();
        data.push((info.name.clone(), bytes));
    }
    w.write_header().unwrap();
    for (name, bytes) in &data {
        w.write_tensor_data(name, bytes).unwrap();
    }
    w.finish().unwrap();
    converted
}

#[test]
fn mxfp4_experts_compute_as_their_values() {
    let dir = std::env::temp_dir().join(format!("ferrite-mxfp4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens: Vec<u32> = (0..24u32).map(|i| 100 + (i * 7919) % 5000).collect();
    for preset in [Preset::TinyQwen3Moe, Preset::TinyQwen35Moe] {
        let mx = dir.join(format!("{preset:?}-mxfp4.gguf"));
        synth::synth(&SynthArgs {
            preset,
            quant: SynthQuant::MXFP4_MOE,
            output: mx.clone(),
            vocab: None,
            seed: 3,
            layers: None,
            mtp: false,
        })
        .unwrap();
        let f32s = dir.join(format!("{preset:?}-f32.gguf"));
        let n = with_f32_experts(&mx, &f32s);
        assert!(n >= 3, "{preset:?}: {n} MXFP4 tensors");
        let (a, b) = (logits(&mx, &tokens), logits(&f32s, &tokens));
        assert!(
            a.iter().all(|x| x.is_finite()),
            "{preset:?}: non-finite logits"
        );
        assert!(
            a == b,
            "{preset:?}: MXFP4 logits differ from those of its F32 twin"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
