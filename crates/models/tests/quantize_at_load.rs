//! `--quantize` (float matrices quantized as they load, `ferrite_models::mix`) on the oracle
//! checkpoints: the model holds fewer bytes (Q4_K_M's K-quant rows fewer than Q8_0's), its
//! logits stay near the float model's.

mod common;

use common::{data_dir, nmse, read_oracle};
use ferrite_backend::cpu::CpuBackend;
use ferrite_models::mix::Mix;
use ferrite_models::{Logits, Model, ModelFile};

/// NMSE of the quantized model's logits against the float model's. These random-weight
/// models amplify weight noise, the hybrid ones most (the FP8 tests measured 6.5e-3..3.5e-2
/// for E4M3's ~3.6% error a weight). Measured here, Q8_0: 7.4e-4..1.0e-3 on the plain
/// decoders, 7.9e-3..1.1e-2 on the hybrids (spread over every kind of matrix: leaving any one
/// kind in float removes at most half of it); Q4_K_M: 6.6e-3..9.0e-3 where it takes K-quants.
/// A wrong or misplaced weight gives ~1.
fn bound(mix: Mix) -> f64 {
    match mix {
        Mix::Q4_K_M => 5e-2,
        _ => 3e-2,
    }
}

fn logits(be: &CpuBackend, m: &Model<CpuBackend>, tokens: &[u32]) -> Vec<f32> {
    let mut kv = m.new_kv(be, tokens.len()).unwrap();
    let mut ws = m.workspace(be, tokens.len(), Logits::All).unwrap();
    m.run(be, &mut ws, &mut kv, 0, tokens, Logits::All).unwrap()
}

#[test]
fn quantized_at_load_stays_near_the_float_model() {
    let be = CpuBackend::new();
    let mut k_quants = vec![];
    for name in [
        "qwen3-tiny",
        "llama-tiny",
        "qwen3-moe-tiny",
        "qwen35-tiny",
        "qwen35-moe-tiny",
    ] {
        let dir = data_dir().join(name);
        let file = ModelFile::open(&dir).unwrap();
        let tokens = read_oracle(&dir).tokens;
        let float: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
        let want = logits(&be, &float, &tokens);
        let mut bytes = vec![float.weight_bytes];
        for mix in [Mix::Q8_0, Mix::Q4_K_M] {
            let m = Model::load_quantized(&be, &file, &|_, _| {}, Some(mix)).unwrap();
            let got = logits(&be, &m, &tokens);
            let e = nmse(&got, &want);
            println!(
                "{name} {}: NMSE {e:.2e} against the float model, {:?}",
                mix.name(),
                m.weight_bytes
            );
            assert!(e < bound(mix), "{name} {}: NMSE {e:.2e}", mix.name());
            bytes.push(m.weight_bytes);
        }
        // Float > Q8_0 ≥ Q4_K_M in the matrices: the tiny plain decoders' 256-wide down
        // projections take Q4_K / Q6_K; the 128-wide rows (every row of the other models)
        // fall back to Q8_0.
        let total = |b: &ferrite_models::decoder::WeightBytes| b.other + b.experts + b.embed;
        assert!(
            total(&bytes[0]) > total(&bytes[1]) && total(&bytes[1]) >= total(&bytes[2]),
            "{name}: {bytes:?}"
        );
        if total(&bytes[2]) < total(&bytes[1]) {
            k_quants.push(name);
        }
    }
    assert!(
        k_quants.contains(&"qwen3-tiny") && k_quants.contains(&"llama-tiny"),
        "Q4_K_M took K-quants only in {k_quants:?}"
    );
}
