//! `llama` GGUF metadata the dense Llama decoder must not ignore: Llama 3.1-style RoPE
//! frequency divisors (`rope_freqs.weight`, how llama.cpp's converter writes `rope_type:
//! "llama3"`) become the model's frequency table (all-1 divisors none; a wrong count is an
//! error), and Mixtral-style experts (`llama.expert_count`) and bias tensors are refused with a
//! clear error.

use ferrite_cli::synth::{self, Preset, SynthArgs, SynthQuant};
use ferrite_formats::gguf::{GgufFile, GgufValue, GgufWriter};
use ferrite_formats::GgmlType;
use ferrite_models::ModelFile;

/// `src` with the metadata `kv` and the F32 tensors `extra` added.
fn rewritten(
    src: &std::path::Path,
    dst: &std::path::Path,
    kv: &[(&str, GgufValue)],
    extra: &[(&str, &[f32])],
) {
    let f = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::create(dst).unwrap();
    w.add_metadata_of(&f).unwrap();
    for (k, v) in kv {
        w.add_kv(k.to_string(), v.clone()).unwrap();
    }
    for info in f.tensor_infos() {
        w.add_tensor_info(&info.name, info.dtype, &info.shape)
            .unwrap();
    }
    for (name, v) in extra {
        w.add_tensor_info(name, GgmlType::F32, &[v.len()]).unwrap();
    }
    w.write_header().unwrap();
    for info in f.tensor_infos() {
        w.write_tensor_data(&info.name, f.tensor_data(info))
            .unwrap();
    }
    for (name, v) in extra {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.write_tensor_data(name, &bytes).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn rope_divisors_experts_and_biases() {
    let dir = std::env::temp_dir().join(format!("ferrite-llama-refusals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("llama.gguf");
    synth::synth(&SynthArgs {
        preset: Preset::TinyLlama,
        quant: SynthQuant::Q8_0,
        output: base.clone(),
        vocab: None,
        seed: 1,
        layers: None,
        mtp: false,
    })
    .unwrap();
    let head_dim = ModelFile::open(&base)
        .unwrap()
        .config()
        .unwrap()
        .attn
        .head_dim;

    // Llama 3.1-style divisors: the frequencies the model runs with are the file's base
    // frequencies divided by them (the CPU backend's table; the CUDA backend refuses a
    // table at load, not runnable here).
    let scaled: Vec<f32> = (0..head_dim / 2)
        .map(|i| if i < head_dim / 4 { 1.0 } else { 8.0 })
        .collect();
    let path = dir.join("scaled.gguf");
    rewritten(&base, &path, &[], &[("rope_freqs.weight", &scaled)]);
    let rope = ModelFile::open(&path).unwrap().config().unwrap().rope;
    let table = rope.inv_freq.expect("a frequency table");
    for (i, (&f, &d)) in table.iter().zip(&scaled).enumerate() {
        let base = 1.0 / rope.theta.powf((2 * i) as f32 / rope.rot_dim as f32);
        assert_eq!(f, base / d, "frequency {i}");
    }
    // Divisors of the wrong count are an error, not a guess.
    let path = dir.join("short.gguf");
    rewritten(&base, &path, &[], &[("rope_freqs.weight", &scaled[1..])]);
    let msg = format!(
        "{:#}",
        ModelFile::open(&path).unwrap().config().unwrap_err()
    );
    assert!(msg.contains("divisors, but the heads rotate"), "{msg}");

    let ones = vec![1.0f32; head_dim / 2];
    let path = dir.join("ones.gguf");
    rewritten(&base, &path, &[], &[("rope_freqs.weight", &ones)]);
    assert!(ModelFile::open(&path)
        .unwrap()
        .config()
        .unwrap()
        .rope
        .inv_freq
        .is_none());

    let path = dir.join("experts.gguf");
    rewritten(
        &base,
        &path,
        &[("llama.expert_count", GgufValue::U32(8))],
        &[],
    );
    let msg = format!(
        "{:#}",
        ModelFile::open(&path).unwrap().config().unwrap_err()
    );
    assert!(msg.contains("8 experts a layer"), "{msg}");

    let path = dir.join("bias.gguf");
    let bias = vec![0.5f32; 64];
    rewritten(&base, &path, &[], &[("blk.0.attn_q.bias", &bias)]);
    let msg = format!(
        "{:#}",
        ModelFile::open(&path).unwrap().config().unwrap_err()
    );
    assert!(
        msg.contains("'blk.0.attn_q.bias': biases are not supported"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
