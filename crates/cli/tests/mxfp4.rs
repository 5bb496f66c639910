//! MXFP4 weights (llama.cpp's `MXFP4_MOE` files: the routed experts in MXFP4) run on the CPU
//! reference exactly as their dequantized values do: a copy of the file whose expert tensors
//! are F32 (each weight decoded once) gives bit-identical logits, because the CPU's dot
//! products decode every type into the same 32-weight blocks and sum them in one order.

mod common;

use common::{cpu_logits as logits, rewrite_tensors};
use ferrite_cli::synth::{self, Preset, SynthArgs, SynthQuant};
use ferrite_formats::quant::dequantize;
use ferrite_formats::GgmlType;

/// `src` rewritten with every MXFP4 tensor as F32; the number of tensors converted.
fn with_f32_experts(src: &std::path::Path, dst: &std::path::Path) -> usize {
    let mut converted = 0;
    rewrite_tensors(src, [dst], |_, info, bytes| {
        if info.dtype != GgmlType::MXFP4 {
            return [(info.dtype.into(), bytes.to_vec())];
        }
        converted += 1;
        let mut v = vec![0f32; info.shape.iter().product()];
        dequantize(GgmlType::MXFP4, bytes, &mut v).unwrap();
        [(
            GgmlType::F32.into(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )]
    });
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
