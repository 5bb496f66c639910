//! A checkpoint whose config.json does not describe its weights is refused at load, with an
//! error naming the first tensor that disagrees, not at the first matmul of a forward pass
//! ("matmul out: expected [32, 256], got [32, 512]") or, for a smaller layer count, never
//! (the model ran truncated).

use std::path::{Path, PathBuf};

use ferrite_backend::cpu::CpuBackend;
use ferrite_models::{Model, ModelFile};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle")
}

/// Loads oracle checkpoint `name` with `key` of its config.json set to `value`; the error.
fn load_with(name: &str, key: &str, value: serde_json::Value) -> String {
    load_with_all(name, &[(key, value)])
}

/// Loads oracle checkpoint `name` with each `(key, value)` set in its config.json; the error.
fn load_with_all(name: &str, changes: &[(&str, serde_json::Value)]) -> String {
    let key = changes[0].0;
    let src = data_dir().join(name);
    let dir = std::env::temp_dir().join(format!(
        "ferrite-config-mismatch-{name}-{key}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    for (key, value) in changes {
        assert!(config.get(key).is_some(), "{name} has no {key}");
        assert_ne!(&config[key], value, "{name}'s {key} is {value} already");
        config[key] = value.clone();
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let be = CpuBackend::new();
    let loaded = ModelFile::open(&dir).and_then(|f| Model::<CpuBackend>::load(&be, &f, &|_, _| {}));
    std::fs::remove_dir_all(&dir).ok();
    match loaded {
        Ok(_) => panic!("{name} with {changes:?} loaded"),
        Err(e) => format!("{e:#}"),
    }
}

fn expect(err: &str, tensor: &str, shape: &str) {
    assert!(
        err.contains(&format!("tensor '{tensor}' has shape {shape}"))
            && err.contains("config.json's dimensions need"),
        "{err}"
    );
}

#[test]
fn dense_dimensions_that_disagree_name_the_tensor() {
    let (q, k) = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    );
    let gate = "model.layers.0.mlp.gate_proj.weight";
    // (checkpoint, config key, its new value, the tensor named, its stored shape)
    for (name, key, value, tensor, shape) in [
        ("qwen3-tiny", "intermediate_size", 512, gate, "[256, 128]"),
        ("qwen3-tiny", "num_attention_heads", 8, q, "[128, 128]"),
        ("qwen3-tiny", "num_key_value_heads", 4, k, "[64, 128]"),
        ("qwen3-tiny", "head_dim", 64, q, "[128, 128]"),
        (
            "qwen3-tiny",
            "vocab_size",
            2048,
            "lm_head.weight",
            "[1024, 128]",
        ),
        ("llama-tiny", "hidden_size", 256, gate, "[256, 128]"),
    ] {
        expect(&load_with(name, key, value.into()), tensor, shape);
    }
}

#[test]
fn a_layer_count_below_the_weights_is_refused() {
    let err = load_with("qwen3-tiny", "num_hidden_layers", 2.into());
    assert!(
        err.contains("config.json gives 2 layers, but the weights have more")
            && err.contains("model.layers.2.input_layernorm.weight"),
        "{err}"
    );
    let err = load_with_all(
        "qwen35-tiny",
        &[
            ("num_hidden_layers", 3.into()),
            (
                "layer_types",
                serde_json::json!(vec!["linear_attention"; 3]),
            ),
        ],
    );
    assert!(
        err.contains("config.json gives 3 layers, but the weights have more")
            && err.contains("model.layers.3.input_layernorm.weight"),
        "{err}"
    );
}

#[test]
fn moe_and_hybrid_dimensions_that_disagree_name_the_tensor() {
    let err = load_with("qwen3-moe-tiny", "moe_intermediate_size", 32.into());
    assert!(
        err.contains("layer 0's experts' gate_proj (stacked) has shape [8, 64, 128]")
            && err.contains("need [8, 32, 128]"),
        "{err}"
    );
    for (name, key, value, tensor, shape) in [
        (
            "qwen35-tiny",
            "num_attention_heads",
            8,
            "model.layers.3.self_attn.q_proj.weight",
            "[256, 128]",
        ),
        (
            "qwen35-tiny",
            "linear_num_value_heads",
            2,
            "model.layers.0.linear_attn.conv1d.weight",
            "[256, 1, 4]",
        ),
        (
            "qwen35-moe-tiny",
            "shared_expert_intermediate_size",
            64,
            "model.layers.0.mlp.shared_expert.gate_proj.weight",
            "[32, 128]",
        ),
    ] {
        expect(&load_with(name, key, value.into()), tensor, shape);
    }
}

/// Values no weights can disagree with, which would run and print garbage (NaN rotations, a
/// NaN RMSNorm) or fail far from their cause, are refused by name.
#[test]
fn hyperparameters_out_of_range_are_refused() {
    let err = load_with(
        "qwen3-tiny",
        "rope_parameters",
        serde_json::json!({"rope_theta": 0.0, "rope_type": "default"}),
    );
    assert!(err.contains("RoPE base") && err.contains("of 0"), "{err}");
    let err = load_with("qwen3-tiny", "rms_norm_eps", (-1e-6).into());
    assert!(err.contains("RMSNorm epsilon of -0.000001"), "{err}");
    let err = load_with("qwen3-tiny", "max_position_embeddings", 0.into());
    assert!(err.contains("a context length of 0"), "{err}");
    let err = load_with("qwen3-tiny", "num_hidden_layers", 0.into());
    assert!(err.contains("a layer count of 0"), "{err}");
}

/// A weight stored in a type the safetensors loader does not compute with (an FP8
/// checkpoint's) is named with its type, not reported missing.
#[test]
fn an_unloadable_weight_type_is_named() {
    let src = data_dir().join("qwen3-tiny");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let q = "model.layers.0.self_attn.q_proj.weight";
    let fp8 = vec![0u8; 128 * 128];
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != q)
        .collect();
    tensors.push((
        q.into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F8_E4M3, vec![128, 128], &fp8)
            .unwrap(),
    ));
    let dir = std::env::temp_dir().join(format!("ferrite-fp8-weight-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let be = CpuBackend::new();
    let loaded = ModelFile::open(&dir).and_then(|f| Model::<CpuBackend>::load(&be, &f, &|_, _| {}));
    std::fs::remove_dir_all(&dir).ok();
    let err = format!("{:#}", loaded.err().expect("an F8_E4M3 weight loaded"));
    assert!(
        err.contains(&format!("tensor '{q}' is stored as F8_E4M3")),
        "{err}"
    );
}

/// A GGUF's multi-token-prediction blocks follow its layers under the same names
/// (`block_count` counts them, `nextn_predict_layers` says how many): not extra layers.
#[test]
fn gguf_mtp_blocks_are_not_extra_layers() {
    use ferrite_formats::gguf::{GgufFile, GgufWriter};
    let tmp = |what: &str| {
        std::env::temp_dir().join(format!("ferrite-mtp-{what}-{}.gguf", std::process::id()))
    };
    let (src, dst) = (tmp("src"), tmp("dst"));
    ferrite_models::convert::hf_to_gguf(&data_dir().join("qwen35-tiny"), &src).unwrap();
    // The same file, its last block (blk.3) declared an MTP block.
    let g = GgufFile::open(&src).unwrap();
    let mut w = GgufWriter::create(&dst).unwrap();
    for (k, v) in g.metadata() {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    w.add_kv("qwen35.nextn_predict_layers", 1u32).unwrap();
    for t in g.tensor_infos() {
        w.add_tensor_info(&t.name, t.dtype, &t.shape).unwrap();
    }
    w.write_header().unwrap();
    for t in g.tensor_infos() {
        w.write_tensor_data(&t.name, g.tensor_data(t)).unwrap();
    }
    w.finish().unwrap();
    let be = CpuBackend::new();
    let file = ModelFile::open(&dst).unwrap();
    let loaded = Model::<CpuBackend>::load(&be, &file, &|_, _| {});
    std::fs::remove_file(&src).ok();
    std::fs::remove_file(&dst).ok();
    let m = loaded.expect("three layers and an MTP block load");
    assert_eq!(m.cfg.n_layers, 3);
}
