//! The CLI contract on small committed data: tokenize, logits, info, and clear errors on bad
//! input (exit code 1 with a message, never a panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn data(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data")
        .join(p)
}

fn ferrite(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(args)
        .output()
        .unwrap()
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ferrite-cli-{}-{name}", std::process::id()))
}

#[test]
fn tokenize_vocab_only_gguf() {
    let v = data("tokenizers/qwen2-gguf/ggml-vocab-qwen2.gguf");
    let out = ferrite(&[
        "tokenize",
        "--model",
        v.to_str().unwrap(),
        "--text",
        "Hello world<|im_start|>",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
    // "Hello" " world" then the special-token text as plain text: "<|", "im", "_start", "|>".
    assert_eq!(&ids[..2], &[9707, 1879]);
    assert!(
        ids.len() > 3 && !ids.contains(&151644),
        "special text must not be parsed: {ids:?}"
    );
}

#[test]
fn logits_command_matches_oracle() {
    let dir = data("oracle/qwen3-tiny");
    let out_path = tmp("logits.safetensors");
    let out = ferrite(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        "1,5,9,200",
        "--output",
        out_path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&out_path).unwrap();
    std::fs::remove_file(&out_path).ok();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    assert_eq!(t.shape(), &[4, 1024]);
    let v: Vec<f32> = t
        .data()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(v.iter().all(|x| x.is_finite()));
    assert!(
        v.iter().map(|x| x.abs()).sum::<f32>() > 1.0,
        "logits are not all zero"
    );
}

#[test]
fn info_describes_checkpoint() {
    let dir = data("oracle/qwen3-moe-tiny");
    let out = ferrite(&["info", "--model", dir.to_str().unwrap()]);
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("Qwen3Moe") && s.contains("experts:       8 (top 2"),
        "{s}"
    );
    assert!(s.contains("bf16"), "{s}");

    // A Qwen3.5 checkpoint with its MTP head beside it says where the head is.
    let out = ferrite(&[
        "info",
        "--model",
        data("oracle/qwen35-tiny").to_str().unwrap(),
    ]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("MTP head:") && s.contains("mtp.safetensors (speculative decoding"),
        "{s}"
    );

    // A weight stored as FP8: listed under its type as not loadable, and `run` names it.
    let src = data("oracle/qwen3-tiny");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let q = "model.layers.0.self_attn.q_proj.weight";
    let fp8 = vec![0u8; 128 * 128];
    let mut tensors: Vec<_> = st.tensors().into_iter().filter(|(n, _)| n != q).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F8_E4M3, vec![128, 128], &fp8)
            .unwrap();
    tensors.push((q.to_string(), view));
    let dir = tmp("fp8-ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let out = ferrite(&["info", "--model", dir.to_str().unwrap()]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("F8_E4M3 (not loadable)      1 tensors"), "{s}");
    let out = ferrite(&["bench", "--model", dir.to_str().unwrap(), "--device", "cpu"]);
    assert_clean_error(&out, &format!("tensor '{q}' is stored as F8_E4M3"));

    // With its block scales (an FP8 checkpoint): converted to BF16 at load, and it runs.
    let scale = (1.0f32 / 448.0).to_le_bytes();
    let mut tensors: Vec<_> = st.tensors().into_iter().filter(|(n, _)| n != q).collect();
    tensors.push((
        q.to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F8_E4M3, vec![128, 128], &fp8)
            .unwrap(),
    ));
    tensors.push((
        format!("{q}_scale_inv"),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 1], &scale).unwrap(),
    ));
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
    let out = ferrite(&["info", "--model", dir.to_str().unwrap()]);
    let s = String::from_utf8_lossy(&out.stdout);
    // Listed with its stored bytes (one a weight: 16 KiB).
    assert!(
        s.contains("F8_E4M3 (BF16 at load)      1 tensors         0.02 MiB"),
        "{s}"
    );
    let logits = dir.join("logits.safetensors");
    let out = ferrite(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--output",
        logits.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    std::fs::remove_dir_all(&dir).ok();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("1 FP8 (E4M3, block scales) weights: converted to BF16 as they load"),
        "{err}"
    );
}

fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected a clean error, got {:?}: {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains(needle),
        "error should mention {needle:?}: {stderr}"
    );
}

#[test]
fn corrupt_and_missing_inputs_are_clear_errors() {
    let bad = tmp("bad.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00\xff\xff").unwrap();
    assert_clean_error(
        &ferrite(&["info", "--model", bad.to_str().unwrap()]),
        "bad.gguf",
    );
    std::fs::write(&bad, b"NOPE this is not a model").unwrap();
    assert_clean_error(
        &ferrite(&["run", "--model", bad.to_str().unwrap(), "--prompt", "hi"]),
        "not a GGUF file",
    );
    std::fs::remove_file(&bad).ok();
    assert_clean_error(
        &ferrite(&["info", "--model", "/nonexistent/model.gguf"]),
        "no such file",
    );
    let dir = data("oracle/qwen3-tiny");
    assert_clean_error(
        &ferrite(&[
            "logits",
            "--model",
            dir.to_str().unwrap(),
            "--tokens",
            "1,99999",
            "--output",
            "/dev/null",
        ]),
        "outside the vocabulary",
    );
    assert_clean_error(
        &ferrite(&["run", "--model", dir.to_str().unwrap(), "--prompt", "hi"]),
        "no tokenizer",
    );
    // A bench cache smaller than its tests, refused before any model is loaded.
    assert_clean_error(
        &ferrite(&[
            "bench",
            "--model",
            dir.to_str().unwrap(),
            "--device",
            "cpu",
            "--depth",
            "100",
            "--prompt-tokens",
            "16",
            "--context",
            "64",
        ]),
        "--context 64 is too small: the tests need 230 positions",
    );
}

/// A random-weight tiny Qwen3 (Q8_0, the qwen2 vocabulary) written by `synth` to a temporary
/// file named `name`; the caller removes it.
fn synth_tiny(name: &str) -> PathBuf {
    let path = tmp(name);
    let vocab = data("tokenizers/qwen2-gguf/ggml-vocab-qwen2.gguf");
    let out = ferrite(&[
        "synth",
        "--preset",
        "tiny-qwen3",
        "--quant",
        "Q8_0",
        "--output",
        path.to_str().unwrap(),
        "--vocab",
        vocab.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// `run` turns away a prompt its context cannot hold before the prefill/decode gate (which,
/// over a whole prompt, decodes it token by token), and gates a long prompt on its first
/// `--gate-tokens` (64) only. Sampling parameters out of range are refused earlier still,
/// before the model loads.
#[test]
fn run_checks_the_context_before_the_gate() {
    let path = synth_tiny("tiny-qwen3-ctx.gguf");
    let model = path.to_str().unwrap();
    let run_with = |prompt: &str, max_tokens: &str, more: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            model,
            "--device",
            "cpu",
            "--prompt",
            prompt,
            "--max-tokens",
            max_tokens,
        ];
        args.extend_from_slice(more);
        ferrite(&args)
    };
    let run = |prompt: &str, max_tokens: &str| run_with(prompt, max_tokens, &[]);
    let run_without_model = |flag: &str, value: &str| {
        let model = "/nonexistent/model.gguf";
        ferrite(&["run", "--model", model, "--prompt", "hi", flag, value])
    };
    // The preset's context is 4096 positions; "word " is one token each.
    let out = run(&"word ".repeat(5000), "4");
    assert_clean_error(&out, "but the context is 4096 tokens");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("gate"), "the gate ran first: {stderr}");
    assert_clean_error(&run("hi", "0"), "max_tokens must be at least 1");
    // Sampling parameters out of range, negative ones included (not taken for flags).
    for (flag, value, msg) in [
        (
            "--temperature",
            "-1",
            "temperature must be a finite number ≥ 0",
        ),
        (
            "--temperature",
            "nan",
            "temperature must be a finite number ≥ 0",
        ),
        ("--top-p", "0", "top_p must be in (0, 1]"),
        ("--min-p", "1.5", "min_p must be in [0, 1]"),
        (
            "--repeat-penalty",
            "-1",
            "repetition penalty must be a finite number > 0",
        ),
    ] {
        assert_clean_error(&run_with("hi", "4", &[flag, value]), msg);
        // Before the model loads: the same error where there is no model file at all.
        assert_clean_error(&run_without_model(flag, value), msg);
    }
    assert_clean_error(
        &run_without_model("--max-tokens", "0"),
        "max_tokens must be at least 1",
    );
    // --vram-weights is the GPU's: the CPU backend refuses it rather than ignoring it.
    assert_clean_error(
        &run_with("hi", "4", &["--vram-weights", "1"]),
        "--vram-weights: the CPU backend holds its weights in host memory",
    );
    let out = run(&"word ".repeat(300), "1");
    std::fs::remove_file(&path).ok();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("gate passed on 64 of "), "{stderr}");
}

/// `run --prompt-file` (a file, or `-` for standard input) generates what `--prompt` does with
/// the same text (one final newline dropped); a missing or non-UTF-8 file is a clean error.
#[test]
fn run_reads_the_prompt_from_a_file_or_stdin() {
    let path = synth_tiny("tiny-qwen3-pf.gguf");
    let run = |src: &[&str], stdin: &[u8]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferrite"))
            .args(["run", "--model", path.to_str().unwrap(), "--device", "cpu"])
            .args(["--max-tokens", "6"])
            .args(src)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), stdin).unwrap();
        child.wait_with_output().unwrap()
    };
    let text = run(&["--prompt", "Once upon a time"], b"");
    assert!(
        text.status.success(),
        "{}",
        String::from_utf8_lossy(&text.stderr)
    );
    let file = tmp("prompt.txt");
    let f = file.to_str().unwrap();
    std::fs::write(&file, "Once upon a time\n").unwrap();
    let from_file = run(&["--prompt-file", f], b"");
    let err = String::from_utf8_lossy(&from_file.stderr);
    assert_eq!(from_file.stdout, text.stdout, "{err}");
    let from_stdin = run(&["--prompt-file", "-"], b"Once upon a time");
    let err = String::from_utf8_lossy(&from_stdin.stderr);
    assert_eq!(from_stdin.stdout, text.stdout, "{err}");
    std::fs::write(&file, b"Once\xff").unwrap();
    let bad = run(&["--prompt-file", f], b"");
    assert_clean_error(&bad, "is not UTF-8 text (invalid byte at offset 4)");
    std::fs::remove_file(&file).ok();
    assert_clean_error(&run(&["--prompt-file", f], b""), "reading the prompt file");
    std::fs::remove_file(&path).ok();
}

#[test]
fn synth_tiny_model_runs() {
    let path = synth_tiny("tiny-qwen3.gguf");
    let out = ferrite(&[
        "run",
        "--model",
        path.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--max-tokens",
        "4",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("gate passed"), "{stderr}");
    // bench: the gate, greedy decode fed on the device against the host loop, both timings.
    let out = ferrite(&[
        "bench",
        "--model",
        path.to_str().unwrap(),
        "--device",
        "cpu",
        "--reps",
        "1",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "12",
        "--gate-tokens",
        "4",
        "--batch",
        "3",
        "--json",
    ]);
    std::fs::remove_file(&path).ok();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("gate: passed"), "{stderr}");
    assert!(
        stderr.contains("fed decode: 10 tokens equal to the host loop's"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(r#""test":"tg12""#) && stdout.contains(r#""decode_loop":"fed 8""#),
        "{stdout}"
    );
    // --batch 3: three sequences in serve's batched step, with their step's bandwidth.
    let batched: serde_json::Value = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|r| r["test"] == "tg12-b3")
        .unwrap_or_else(|| panic!("no tg12-b3 record: {stdout}"));
    assert!(
        batched["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0),
        "{batched}"
    );
    assert!(
        batched["roofline_pct"].as_f64().is_some_and(|p| p > 0.0),
        "{batched}"
    );

    // A hybrid model's batched step: each sequence on its own linear-attention state slot.
    let hybrid = tmp("bench-batch-hybrid.gguf");
    let out = ferrite(&[
        "synth",
        "--preset",
        "tiny-qwen3.5",
        "--quant",
        "Q8_0",
        "--output",
        hybrid.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ferrite(&[
        "bench",
        "--model",
        hybrid.to_str().unwrap(),
        "--device",
        "cpu",
        "--reps",
        "1",
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "2",
        "--batch",
        "2",
        "--json",
    ]);
    std::fs::remove_file(&hybrid).ok();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let batched: serde_json::Value = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|r| r["test"] == "tg2-b2")
        .unwrap_or_else(|| panic!("no tg2-b2 record: {stdout}"));
    assert!(
        batched["roofline_pct"].as_f64().is_some_and(|p| p > 0.0),
        "{batched}"
    );
}
