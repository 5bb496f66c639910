//! Safetensors checkpoints: single file, sharded, unsupported dtypes, corrupt files.

use std::path::{Path, PathBuf};

use ferrite_formats::safetensors_dir::SafetensorsCheckpoint;
use ferrite_formats::{FormatError, GgmlType, TensorSource};
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView as StView;
use safetensors::Dtype;

/// A fresh, empty scratch directory (no `tempfile` dependency needed for this).
fn scratch_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ferrite-st-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) | 1)
        .collect()
}

/// (name, dtype, shape, bytes)
type Spec = (&'static str, Dtype, Vec<usize>, Vec<u8>);

fn spec(name: &'static str, dtype: Dtype, shape: Vec<usize>, seed: u8) -> Spec {
    let n = shape.iter().product::<usize>() * dtype.bitsize() / 8;
    (name, dtype, shape, pattern(n, seed))
}

fn serialize(tensors: &[Spec]) -> Vec<u8> {
    let views = tensors.iter().map(|(name, dtype, shape, data)| {
        (
            name.to_string(),
            StView::new(*dtype, shape.clone(), data).unwrap(),
        )
    });
    safetensors::serialize(views, None).unwrap()
}

fn write_config(dir: &Path, json: &str) {
    std::fs::write(dir.join("config.json"), json).unwrap();
}

const QWEN3_CONFIG: &str =
    r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 8}"#;

fn single_specs() -> Vec<Spec> {
    vec![
        spec("model.embed_tokens.weight", Dtype::BF16, vec![4, 8], 1),
        spec("model.norm.weight", Dtype::F32, vec![8], 2),
        spec("lm_head.weight", Dtype::F16, vec![4, 8], 3),
        spec("rotary.position_ids", Dtype::I64, vec![1, 5], 4),
        spec(
            "model.layers.0.mlp.up_proj.weight",
            Dtype::F8_E4M3,
            vec![8, 8],
            5,
        ),
        spec("scalar", Dtype::F32, vec![], 6),
    ]
}

fn check_view(ckpt: &SafetensorsCheckpoint, s: &Spec, ggml: GgmlType) {
    let v = ckpt
        .tensor(s.0)
        .unwrap_or_else(|| panic!("{} missing", s.0));
    assert_eq!(v.dtype, ggml);
    assert_eq!(v.shape, &s.2[..]);
    assert_eq!(v.data, &s.3[..], "{}", s.0);
}

#[test]
fn single_file_checkpoint() {
    let dir = scratch_dir("single");
    write_config(&dir, QWEN3_CONFIG);
    let specs = single_specs();
    std::fs::write(dir.join("model.safetensors"), serialize(&specs)).unwrap();

    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    assert_eq!(ckpt.architecture(), Some("Qwen3ForCausalLM"));
    assert_eq!(ckpt.config()["hidden_size"], 8);
    assert_eq!(ckpt.shard_paths().len(), 1);
    let mut names = ckpt.tensor_names();
    names.sort();
    let mut want: Vec<String> = specs.iter().map(|s| s.0.to_owned()).collect();
    want.sort();
    assert_eq!(
        names, want,
        "every tensor is listed, supported dtype or not"
    );

    check_view(&ckpt, &specs[0], GgmlType::BF16);
    check_view(&ckpt, &specs[1], GgmlType::F32);
    check_view(&ckpt, &specs[2], GgmlType::F16);
    check_view(&ckpt, &specs[5], GgmlType::F32);
    assert_eq!(ckpt.tensor("scalar").unwrap().n_elements(), 1);

    // Unsupported dtypes: listed, readable raw, but not views; require_tensor says why.
    for (name, dtype) in [
        ("rotary.position_ids", "I64"),
        ("model.layers.0.mlp.up_proj.weight", "F8_E4M3"),
    ] {
        assert!(ckpt.tensor(name).is_none());
        match ckpt.require_tensor(name) {
            Err(FormatError::UnsupportedDtype { name: n, dtype: d }) => {
                assert_eq!((n.as_str(), d.as_str()), (name, dtype))
            }
            other => panic!("{name}: {other:?}"),
        }
        let (info, raw) = ckpt.raw_tensor(name).unwrap();
        assert_eq!(info.ggml, None);
        assert_eq!(raw, &specs.iter().find(|s| s.0 == name).unwrap().3[..]);
    }
    assert!(matches!(
        ckpt.require_tensor("nope"),
        Err(FormatError::MissingTensor(_))
    ));
    assert!(ckpt.require_tensor("lm_head.weight").is_ok());

    // Opening the file itself works too, and still finds config.json next to it.
    let ckpt = SafetensorsCheckpoint::open(dir.join("model.safetensors")).unwrap();
    assert_eq!(ckpt.architecture(), Some("Qwen3ForCausalLM"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn architecture_falls_back_to_model_type_and_lone_file_needs_no_config() {
    let dir = scratch_dir("arch");
    write_config(&dir, r#"{"model_type": "llama"}"#);
    std::fs::write(dir.join("model.safetensors"), serialize(&single_specs())).unwrap();
    assert_eq!(
        SafetensorsCheckpoint::open(&dir).unwrap().architecture(),
        Some("llama")
    );

    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = SafetensorsCheckpoint::open(&dir).unwrap_err();
    assert!(e.to_string().contains("config.json"), "{e}");
    let lone = SafetensorsCheckpoint::open(dir.join("model.safetensors")).unwrap();
    assert!(lone.config().is_null());
    assert_eq!(lone.architecture(), None);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn missing_weights_and_bad_config() {
    let dir = scratch_dir("missing");
    write_config(&dir, QWEN3_CONFIG);
    let e = SafetensorsCheckpoint::open(&dir).unwrap_err();
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    std::fs::write(dir.join("model.safetensors"), serialize(&single_specs())).unwrap();
    write_config(&dir, "{ not json");
    assert!(matches!(
        SafetensorsCheckpoint::open(&dir),
        Err(FormatError::Corrupt { .. })
    ));
    assert!(matches!(
        SafetensorsCheckpoint::open(dir.join("nope")),
        Err(FormatError::Io { .. })
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

fn write_sharded(dir: &Path) -> (Vec<Spec>, Vec<Spec>) {
    write_config(dir, QWEN3_CONFIG);
    let a = vec![
        spec("model.embed_tokens.weight", Dtype::BF16, vec![4, 8], 1),
        spec(
            "model.layers.0.input_layernorm.weight",
            Dtype::BF16,
            vec![8],
            2,
        ),
    ];
    let b = vec![
        spec("model.norm.weight", Dtype::BF16, vec![8], 3),
        spec("lm_head.weight", Dtype::BF16, vec![4, 8], 4),
    ];
    std::fs::write(dir.join("model-00001-of-00002.safetensors"), serialize(&a)).unwrap();
    std::fs::write(dir.join("model-00002-of-00002.safetensors"), serialize(&b)).unwrap();
    let mut map = serde_json::Map::new();
    for s in &a {
        map.insert(s.0.into(), "model-00001-of-00002.safetensors".into());
    }
    for s in &b {
        map.insert(s.0.into(), "model-00002-of-00002.safetensors".into());
    }
    write_index(dir, serde_json::Value::Object(map));
    (a, b)
}

fn write_index(dir: &Path, weight_map: serde_json::Value) {
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn sharded_checkpoint() {
    let dir = scratch_dir("sharded");
    let (a, b) = write_sharded(&dir);
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    assert_eq!(ckpt.shard_paths().len(), 2);
    assert_eq!(ckpt.tensor_names().len(), 4);
    for s in a.iter().chain(&b) {
        check_view(&ckpt, s, GgmlType::BF16);
    }
    assert_eq!(ckpt.tensor_info("lm_head.weight").unwrap().shard, 1);
    // The index file itself can be opened.
    let ckpt = SafetensorsCheckpoint::open(dir.join("model.safetensors.index.json")).unwrap();
    assert_eq!(ckpt.tensor_names().len(), 4);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sharded_index_errors() {
    let dir = scratch_dir("index");
    write_sharded(&dir);
    let shard1 = "model-00001-of-00002.safetensors";

    // A tensor the index places in a shard that does not hold it.
    write_index(&dir, serde_json::json!({"lm_head.weight": shard1}));
    let e = SafetensorsCheckpoint::open(&dir).unwrap_err();
    assert!(e.to_string().contains("lm_head.weight"), "{e}");

    // A shard that does not exist.
    write_index(
        &dir,
        serde_json::json!({"x": "model-00009-of-00009.safetensors"}),
    );
    assert!(matches!(
        SafetensorsCheckpoint::open(&dir),
        Err(FormatError::Io { .. })
    ));

    // Paths that leave the directory, non-string entries, no weight_map, bad JSON.
    for bad in [
        serde_json::json!({"x": "../model.safetensors"}),
        serde_json::json!({"x": "/etc/passwd"}),
        serde_json::json!({"x": 3}),
        serde_json::json!({}),
        serde_json::json!([1, 2]),
    ] {
        write_index(&dir, bad.clone());
        assert!(
            matches!(
                SafetensorsCheckpoint::open(&dir),
                Err(FormatError::Corrupt { .. })
            ),
            "{bad}"
        );
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": ",
    )
    .unwrap();
    assert!(matches!(
        SafetensorsCheckpoint::open(&dir),
        Err(FormatError::Corrupt { .. })
    ));

    // The same tensor stored in two shards.
    let dup = serialize(&[spec("model.norm.weight", Dtype::BF16, vec![8], 9)]);
    std::fs::write(dir.join(shard1), dup).unwrap();
    write_index(
        &dir,
        serde_json::json!({"model.norm.weight": "model-00002-of-00002.safetensors", "y": shard1}),
    );
    let e = SafetensorsCheckpoint::open(&dir).unwrap_err();
    assert!(e.to_string().contains("also stored"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A file with a hand-written header: `header` JSON, then `data_len` bytes.
fn raw_file(header: &str, data_len: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend(std::iter::repeat_n(1u8, data_len));
    b
}

fn open_bytes(dir: &Path, bytes: &[u8]) -> ferrite_formats::Result<SafetensorsCheckpoint> {
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    SafetensorsCheckpoint::open(dir)
}

#[test]
fn corrupt_files() {
    let dir = scratch_dir("corrupt");
    write_config(&dir, QWEN3_CONFIG);
    let ok = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    assert!(open_bytes(&dir, &raw_file(ok, 8)).is_ok());

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("huge header length", {
            let mut b = u64::MAX.to_le_bytes().to_vec();
            b.extend_from_slice(b"{}");
            b
        }),
        ("header length past end", {
            let mut b = 1000u64.to_le_bytes().to_vec();
            b.extend_from_slice(b"{}");
            b
        }),
        ("not JSON", raw_file("{\"a\": nope}", 8)),
        ("not UTF-8", {
            let mut b = 2u64.to_le_bytes().to_vec();
            b.extend_from_slice(&[0xff, 0xfe]);
            b
        }),
        (
            "unknown dtype",
            raw_file(
                r#"{"a":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}}"#,
                8,
            ),
        ),
        (
            "dtype×shape != bytes",
            raw_file(
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
            ),
        ),
        (
            "offsets past data",
            raw_file(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                4,
            ),
        ),
        ("trailing bytes", raw_file(ok, 12)),
        (
            "gap between tensors",
            raw_file(
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
                12,
            ),
        ),
        (
            "shape overflow",
            raw_file(
                r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#,
                8,
            ),
        ),
    ];
    for (what, bytes) in cases {
        match open_bytes(&dir, &bytes) {
            Err(FormatError::Corrupt { path, what: msg }) => {
                assert!(path.ends_with("model.safetensors"), "{what}: {path:?}");
                println!("{what}: {msg}");
            }
            other => panic!("{what}: expected Corrupt, got {other:?}"),
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn every_truncation_is_an_error() {
    let dir = scratch_dir("trunc");
    write_config(&dir, QWEN3_CONFIG);
    let full = serialize(&single_specs());
    for cut in 0..full.len() {
        assert!(
            open_bytes(&dir, &full[..cut]).is_err(),
            "prefix of {cut} bytes was accepted"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn random_corruption_never_panics() {
    let dir = scratch_dir("fuzz");
    write_config(&dir, QWEN3_CONFIG);
    let full = serialize(&single_specs());
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5afe);
    for _ in 0..2_000 {
        let mut b = full.clone();
        for _ in 0..rng.random_range(1..4) {
            // Mostly inside the header, where the structure is.
            let hi = if rng.random_bool(0.8) {
                8 + 64.min(b.len() - 8)
            } else {
                b.len()
            };
            let i = rng.random_range(0..hi);
            b[i] = rng.random();
        }
        if let Ok(ckpt) = open_bytes(&dir, &b) {
            for name in ckpt.tensor_names() {
                if let Some(v) = ckpt.tensor(&name) {
                    assert_eq!(v.data.len(), v.dtype.bytes_for(v.n_elements()).unwrap());
                }
            }
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The quantized forms' malformed companions are errors naming the weight, never panics or
/// silently wrong weights; a tensor without its scales is not converted at all.
#[test]
fn quantized_forms_with_malformed_scales_are_refused() {
    let w = "model.layers.0.mlp.up_proj.weight";
    let case = |tensors: Vec<Spec>, config: &str| -> Option<String> {
        let dir = scratch_dir("quant");
        std::fs::write(dir.join("model.safetensors"), serialize(&tensors)).unwrap();
        write_config(&dir, config);
        let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
        let r = ckpt.converted(w).map(|r| r.map(|t| (t.shape, t.dtype)));
        std::fs::remove_dir_all(&dir).ok();
        r.map(|r| match r {
            Ok((shape, dtype)) => format!("ok {shape:?} {dtype}"),
            Err(e) => format!("{e}"),
        })
    };
    let fp8 = |scale: &'static str, dt: Dtype, shape: Vec<usize>| {
        vec![
            (w, Dtype::F8_E4M3, vec![4, 8], vec![0x38u8; 32]),
            spec(scale, dt, shape, 7),
        ]
    };
    let s = |suffix: &str| -> &'static str { Box::leak(format!("{w}{suffix}").into_boxed_str()) };
    let block_cfg =
        r#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 4]}}"#;
    // Block scales: the grid of 2 x 4 tiles is [2, 2]; a transposed or short grid is refused.
    let ok = case(fp8(s("_scale_inv"), Dtype::BF16, vec![2, 2]), block_cfg);
    assert_eq!(ok.as_deref(), Some("ok [4, 8] bf16"));
    let e = case(fp8(s("_scale_inv"), Dtype::BF16, vec![1, 4]), block_cfg).unwrap();
    assert!(
        e.contains(w) && e.contains("needs scales of shape [2, 2]"),
        "{e}"
    );
    let e = case(fp8(s("_scale_inv"), Dtype::I32, vec![2, 2]), block_cfg).unwrap();
    assert!(e.contains("stored as I32"), "{e}");
    // A scale per tensor or per row, in the shapes writers use; three for four rows is neither.
    for shape in [vec![], vec![1], vec![4], vec![4, 1]] {
        let r = case(fp8(s("_scale"), Dtype::F32, shape.clone()), "{}");
        assert_eq!(r.as_deref(), Some("ok [4, 8] bf16"), "{shape:?}");
    }
    let e = case(fp8(s("_scale"), Dtype::F32, vec![3]), "{}").unwrap();
    assert!(e.contains("neither one a tensor nor one a row"), "{e}");
    // NVFP4: 8 weights a row packed in 4 bytes, one E4M3 scale per 16 (here one a row).
    let nvfp4 = |scale_shape: Vec<usize>, global: Vec<usize>| {
        vec![
            spec(w, Dtype::U8, vec![4, 4], 3),
            (
                s("_scale"),
                Dtype::F8_E4M3,
                scale_shape.clone(),
                vec![0x38u8; scale_shape.iter().product()],
            ),
            spec(s("_scale_2"), Dtype::F32, global, 5),
        ]
    };
    let ok = case(nvfp4(vec![4, 1], vec![]), "{}");
    assert_eq!(ok.as_deref(), Some("ok [4, 8] bf16"));
    let e = case(nvfp4(vec![4, 2], vec![]), "{}").unwrap();
    assert!(e.contains("needs E4M3 scales of shape [4, 1]"), "{e}");
    let e = case(nvfp4(vec![4, 1], vec![2]), "{}").unwrap();
    assert!(e.contains("expected one value"), "{e}");
    // Without scales nothing is converted (the loader then names the dtype).
    assert_eq!(
        case(
            vec![(w, Dtype::F8_E4M3, vec![4, 8], vec![0x38u8; 32])],
            "{}"
        ),
        None
    );
}
