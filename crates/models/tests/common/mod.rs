//! What the model tests share: the oracle checkpoints of tests/data/oracle (transformers'
//! tiny random-weight models and their fp32 logits) and the error measure they are held to.
// Each test crate that includes this module reads only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle")
}

pub struct Oracle {
    pub tokens: Vec<u32>,
    pub logits: Vec<f32>,
    pub vocab: usize,
}

pub fn read_oracle(dir: &Path) -> Oracle {
    read_oracle_file(&dir.join("oracle.safetensors"))
}

/// An oracle file of `tokens` and `logits` ([`read_oracle`]'s, or another of the same form).
pub fn read_oracle_file(path: &Path) -> Oracle {
    let bytes = std::fs::read(path).expect("oracle file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    let t = st.tensor("tokens").unwrap();
    let tokens: Vec<u32> = match t.dtype() {
        safetensors::Dtype::I64 => t
            .data()
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
        safetensors::Dtype::I32 => t
            .data()
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
        d => panic!("tokens dtype {d:?}"),
    };
    let l = st.tensor("logits").unwrap();
    let vocab = l.shape()[1];
    let logits = l
        .data()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Oracle {
        tokens,
        logits,
        vocab,
    }
}

pub fn nmse(a: &[f32], reference: &[f32]) -> f64 {
    let mse: f64 = a
        .iter()
        .zip(reference)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>();
    let pow: f64 = reference.iter().map(|y| (*y as f64).powi(2)).sum::<f64>();
    mse / pow
}

/// The CPU reference's logits at every position of `tokens`, one prefill of the model `file`.
pub fn cpu_logits(file: &ferrite_models::ModelFile, tokens: &[u32]) -> Vec<f32> {
    use ferrite_backend::cpu::CpuBackend;
    use ferrite_models::{Logits, Model};
    let be = CpuBackend::new();
    let m: Model<CpuBackend> = Model::load(&be, file, &|_, _| {}).expect("model loads");
    let mut kv = m.new_kv(&be, tokens.len()).unwrap();
    let mut ws = m.workspace(&be, tokens.len(), Logits::All).unwrap();
    m.run(&be, &mut ws, &mut kv, 0, tokens, Logits::All)
        .unwrap()
}

/// NMSE = mse(ours, oracle) / mean(oracle²). Both sides compute in f32 from the same
/// bf16-rounded weights; what differs is summation order (ours: blockwise dot products,
/// f64 RMSNorm sums; PyTorch: its own GEMM tiling), worth ~1e-12..1e-9 at these sizes.
/// 1e-5 is the bar and still catches any real error (a wrong rope pairing or
/// norm gives NMSE ≥ 1e-2).
pub const ORACLE_NMSE: f64 = 1e-5;

pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
}

/// `ours` against the oracle `o`: NMSE under [`ORACLE_NMSE`] and the same argmax at every
/// position (printed as `what`).
pub fn assert_oracle(what: &str, ours: &[f32], o: &Oracle) {
    assert_eq!(ours.len(), o.logits.len());
    let e = nmse(ours, &o.logits);
    println!("{what}: NMSE vs the oracle = {e:.3e}");
    assert!(e < ORACLE_NMSE, "{what}: NMSE {e:e} ≥ {ORACLE_NMSE:e}");
    for (t, (a, b)) in ours
        .chunks(o.vocab)
        .zip(o.logits.chunks(o.vocab))
        .enumerate()
    {
        assert_eq!(
            argmax(a),
            argmax(b),
            "{what}: argmax differs at position {t}"
        );
    }
}
