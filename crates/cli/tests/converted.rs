//! GGUF tensors stored as q5_0, q3_K or iq4_nl (types ferrite converts at load, without loss,
//! to q8_0 or q6_K: `ferrite_formats::quant::converted`) load and compute exactly as the same
//! file with those tensors stored already converted: bit-identical logits on the CPU, for a
//! dense, a MoE and a hybrid (Qwen3.5) model, the token embedding included.

mod common;

use common::{cpu_logits as logits, rewrite_tensors};
use ferrite_cli::synth::{self, Preset, SynthArgs, SynthQuant};
use ferrite_formats::gguf::GgufFile;
use ferrite_formats::quant::converted::ConvertedType;
use ferrite_formats::{GgmlType, TensorSource};

/// Random stored blocks of type `t` for `n` values, with the f16 scale `d` in every block:
/// weights of at most ~0.15 in magnitude, like the synthetic model's own.
fn random_blocks(t: ConvertedType, n: usize, seed: u64) -> Vec<u8> {
    let (d, d_at) = match t {
        ConvertedType::Q5_0 => (0.01f32, 0),
        ConvertedType::IQ4NL => (0.001, 0),
        ConvertedType::Q3K => (0.001, 108),
    };
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v: Vec<u8> = (0..t.bytes_for(n).unwrap())
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect();
    for b in v.chunks_exact_mut(t.type_size()) {
        b[d_at..d_at + 2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
    }
    v
}

/// `src` rewritten twice: its Q8_0 matrices (in turn q5_0, iq4_nl, q3_K where the rows take
/// that type's blocks) stored as random blocks of those types (`stored`), and the same blocks
/// converted (`converted`). The number of tensors of each type.
fn rewrite(
    src: &std::path::Path,
    stored: &std::path::Path,
    converted: &std::path::Path,
) -> [usize; 3] {
    let mut counts = [0usize; 3];
    rewrite_tensors(src, [stored, converted], |i, info, bytes| {
        let row = *info.shape.last().unwrap();
        let pick = ConvertedType::ALL
            .iter()
            .copied()
            .cycle()
            .skip(i % 3)
            .take(3)
            .find(|t| row.is_multiple_of(t.block_size()));
        match pick {
            Some(t) if info.dtype == GgmlType::Q8_0 && info.shape.len() >= 2 => {
                let blocks = random_blocks(t, info.n_elements(), i as u64 + 1);
                let conv = t.convert(&blocks).unwrap();
                counts[ConvertedType::ALL.iter().position(|&x| x == t).unwrap()] += 1;
                [(t.into(), blocks), (t.target().into(), conv)]
            }
            _ => [
                (info.dtype.into(), bytes.to_vec()),
                (info.dtype.into(), bytes.to_vec()),
            ],
        }
    });
    counts
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
        let counts = rewrite(&q8, &stored, &conv);
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
