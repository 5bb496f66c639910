//! Llama 3.1's "llama3" RoPE scaling on the CPU reference: the llama-tiny oracle checkpoint
//! with its `rope_parameters` replaced by tests/data/oracle/llama-tiny/llama3.json, against
//! the float64 numpy oracle of the same (tools/oracle/llama3_oracle.py: check_oracle.py's
//! Llama, which matches transformers on the unscaled fixtures to NMSE ~1e-12, with
//! transformers' `_compute_llama3_parameters`), from the safetensors checkpoint and from the
//! GGUF llama.cpp's converter would write (its `rope_freqs.weight` divisors).

mod common;

use common::{
    assert_oracle, cpu_logits, data_dir, nmse, read_oracle, read_oracle_file, ORACLE_NMSE,
};
use ferrite_models::ModelFile;

/// GGUF against safetensors: the frequencies as the file's divisors (f / d) against
/// transformers' blend computed directly, ~1 ulp apart, plus the Q/K row permutation.
const FORMAT_NMSE: f64 = 1e-10;

#[test]
fn llama3_rope_scaling_matches_the_oracle() {
    let src = data_dir().join("llama-tiny");
    let dir = std::env::temp_dir().join(format!("ferrite-llama3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    config["rope_parameters"] =
        serde_json::from_slice(&std::fs::read(src.join("llama3.json")).unwrap()).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();

    let o = read_oracle_file(&src.join("llama3_oracle.safetensors"));
    let file = ModelFile::open(&dir).unwrap();
    assert!(file.config().unwrap().rope.inv_freq.is_some());
    let ours = cpu_logits(&file, &o.tokens);
    assert_oracle("llama3 (numpy float64)", &ours, &o);
    // The scaling changes the answer: far from the unscaled model's logits.
    let plain = read_oracle(&src);
    let e_plain = nmse(&ours, &plain.logits);
    assert!(
        e_plain > 100.0 * ORACLE_NMSE,
        "scaled vs unscaled NMSE {e_plain:e}"
    );

    // The same model as llama.cpp's converter writes it: the divisors in rope_freqs.weight.
    let gguf = dir.join("llama3.gguf");
    ferrite_models::convert::hf_to_gguf(&dir, &gguf).unwrap();
    let gfile = ModelFile::open(&gguf).unwrap();
    assert!(gfile.tensors().has("rope_freqs.weight"));
    let from_gguf = cpu_logits(&gfile, &o.tokens);
    let e2 = nmse(&from_gguf, &ours);
    println!("llama3: NMSE GGUF vs safetensors = {e2:.3e}");
    assert!(e2 < FORMAT_NMSE, "NMSE {e2:e}");
    std::fs::remove_dir_all(&dir).ok();
}
