//! GGUF tensors stored as q5_0, q3_K or iq4_nl (types ferrite converts at load, without loss,
//! to q8_0 or q6_K: `ferrite_formats::quant::converted`) load and compute exactly as the same
//! file with those tensors stored already converted: bit-identical logits on the CPU, for a
//! dense, a MoE and a hybrid (Qwen3.5) model, the token embedding included.

mod common;

use common::{cpu_logits as logits, rewrite_tensors};
use ferrite_cli::synth::{self, Preset, SynthArgs, SynthQuant};
use ferrite_formats::gguf::GgufFile;
use ferrite_formats::TensorSource;

/// `stored` rewritten with each tensor converted at load stored already converted.
fn converted_twin(stored: &std::path::Path, twin: &std::path::Path) {
    rewrite_tensors(stored, [twin], |_, info, bytes| match info.converted_from {
        Some(t) => [(info.dtype.into(), t.convert(bytes).unwrap())],
        None => [(info.dtype.into(), bytes.to_vec())],
    });
}

#[test]
fn converted_types_compute_as_their_conversions() {
    let dir = std::env::temp_dir().join(format!("ferrite-converted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens: Vec<u32> = (0..20u32).map(|i| 100 + (i * 7919) % 5000).collect();
    // Tensors of each type over the three models (the MoE model's rows are too short for
    // q3_K's 256-blocks).
    let mut total = [0usize; 3];
    for preset in [Preset::TinyQwen3, Preset::TinyQwen3Moe, Preset::TinyQwen35] {
        let q8 = dir.join(format!("{preset:?}-q8_0.gguf"));
        synth::synth(&SynthArgs {
            preset,
            quant: SynthQuant::Q8_0,
            output: q8.clone(),
            vocab: None,
            seed: 5,
            layers: None,
            mtp: false,
        })
        .unwrap();
        let (stored, conv) = (
            dir.join(format!("{preset:?}-stored.gguf")),
            dir.join(format!("{preset:?}-conv.gguf")),
        );
        let counts = synth::with_converted_types(&q8, &stored, 7).unwrap();
        converted_twin(&stored, &conv);
        assert!(
            counts.iter().filter(|&&c| c > 0).count() >= 2,
            "{preset:?}: tensors of each type {counts:?}"
        );
        for (t, c) in total.iter_mut().zip(counts) {
            *t += c;
        }

        // The reader hands such a tensor out converted, not as a view.
        let f = GgufFile::open(&stored).unwrap();
        let emb = "token_embd.weight";
        let info = f.tensor_info(emb).unwrap();
        let from = info
            .converted_from
            .expect("the embedding is stored converted");
        assert!(f.tensor(emb).is_none() && f.has(emb));
        assert!(f.require_tensor(emb).is_err());
        let t = f.converted(emb).unwrap().unwrap();
        assert_eq!((t.dtype, &t.shape), (from.target(), &info.shape));

        let (a, b) = (logits(&stored, &tokens), logits(&conv, &tokens));
        assert!(
            a.iter().all(|x| x.is_finite()),
            "{preset:?}: non-finite logits"
        );
        assert!(
            a == b,
            "{preset:?}: logits differ from those of the converted file"
        );
        assert!(
            a != logits(&q8, &tokens),
            "{preset:?}: the rewrite changed no weight"
        );
    }
    assert!(
        total.iter().all(|&c| c > 0),
        "tensors of each type {total:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
