//! External oracle: tiny random-weight checkpoints made by Hugging Face `transformers`
//! (tools/oracle/make_oracle.py), with transformers' fp32 logits. The CPU reference backend
//! must reproduce them, from the safetensors checkpoint and from the same model written as
//! GGUF.

mod common;

use common::{argmax, assert_oracle, cpu_logits, data_dir, nmse, read_oracle, ORACLE_NMSE};
use ferrite_backend::cpu::CpuBackend;
use ferrite_models::{Logits, Model, ModelFile};

/// GGUF vs safetensors of the same weights: identical except for the llama Q/K row
/// permutation and Qwen3.5's tiled value-head order, which only reorder the terms of dot
/// products (f32 rounding: ~1e-14 for llama, ~1e-12 through Qwen3.5's recurrence).
const FORMAT_NMSE: f64 = 1e-10;

fn check_model(name: &str) {
    check_model_formats(name, true)
}

/// `gguf`: also convert to GGUF (llama.cpp's layout) and compare.
fn check_model_formats(name: &str, gguf: bool) {
    let dir = data_dir().join(name);
    let o = read_oracle(&dir);
    let file = ModelFile::open(&dir).expect("checkpoint opens");
    let ours = cpu_logits(&file, &o.tokens);
    assert_oracle(&format!("{name} (transformers)"), &ours, &o);

    // Same weights through GGUF (llama.cpp's names, layout and for llama its Q/K permutation).
    if gguf {
        let gguf =
            std::env::temp_dir().join(format!("ferrite-oracle-{name}-{}.gguf", std::process::id()));
        ferrite_models::convert::hf_to_gguf(&dir, &gguf).expect("convert to GGUF");
        let gfile = ModelFile::open(&gguf).expect("GGUF opens");
        let from_gguf = cpu_logits(&gfile, &o.tokens);
        std::fs::remove_file(&gguf).ok();
        let e2 = nmse(&from_gguf, &ours);
        println!("{name}: NMSE GGUF vs safetensors = {e2:.3e}");
        assert!(
            e2 < FORMAT_NMSE,
            "{name}: GGUF and safetensors disagree: NMSE {e2:e}"
        );
    }

    // Token by token through the cache (conv + recurrent state for Qwen3.5) gives the
    // same logits at every position as the one-step prefill.
    let be = CpuBackend::new();
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    let mut kv = m.new_kv(&be, o.tokens.len()).unwrap();
    let mut ws = m.workspace(&be, 1, Logits::All).unwrap();
    let stepwise = m
        .run(&be, &mut ws, &mut kv, 0, &o.tokens, Logits::All)
        .unwrap();
    let e3 = nmse(&stepwise, &ours);
    println!("{name}: NMSE token-by-token vs prefill = {e3:.3e}");
    assert!(
        e3 < FORMAT_NMSE,
        "{name}: decode and prefill disagree: NMSE {e3:e}"
    );

    // Greedy continuation with the KV cache, token by token, as transformers generated it.
    let g: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("greedy.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = g["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<u32> = g["generated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let be = CpuBackend::new();
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    let mut kv = m.new_kv(&be, prompt.len() + want.len()).unwrap();
    let mut ws = m.workspace(&be, prompt.len(), Logits::Last).unwrap();
    let mut logits = m
        .run(&be, &mut ws, &mut kv, 0, &prompt, Logits::Last)
        .unwrap();
    let mut got = vec![];
    for i in 0..want.len() {
        let t = argmax(&logits) as u32;
        got.push(t);
        logits = m
            .run(&be, &mut ws, &mut kv, prompt.len() + i, &[t], Logits::Last)
            .unwrap();
    }
    assert_eq!(
        got, want,
        "{name}: greedy continuation differs from transformers"
    );
}

#[test]
fn qwen3_matches_transformers() {
    check_model("qwen3-tiny");
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_model("qwen3-moe-tiny");
}

#[test]
fn qwen3_moe_without_topk_renormalisation_matches_transformers() {
    check_model("qwen3-moe-tiny-nonorm");
}

#[test]
fn llama_tied_embeddings_matches_transformers() {
    check_model("llama-tiny");
}

/// Llama 3.1's "llama3" RoPE scaling (`rope_parameters` in its config.json: the frequencies
/// as transformers' `_compute_llama3_parameters` makes them).
#[test]
fn llama31_rope_scaling_matches_transformers() {
    check_model("llama31-tiny");
}

#[test]
fn qwen35_matches_transformers() {
    check_model_formats("qwen35-tiny", true);
}

#[test]
fn qwen35_moe_matches_transformers() {
    check_model_formats("qwen35-moe-tiny", true);
}

/// The released Qwen3.5 checkpoints are vision-language wrappers
/// (`Qwen3_5ForConditionalGeneration`): the text config under `text_config`, the text model's
/// tensors under `model.language_model.`, plus vision (`model.visual.*`) and MTP (`mtp.*`)
/// tensors. The same tiny weights repackaged that way give the same logits.
#[test]
fn qwen35_vision_language_wrapper_loads_its_text_model() {
    let dir = data_dir().join("qwen35-tiny");
    let o = read_oracle(&dir);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let name = match name.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => name,
            };
            (name, t)
        })
        .collect();
    // Tensors the text model must ignore.
    let lm = st.tensor("lm_head.weight").unwrap();
    tensors.push(("mtp.fc.weight".into(), lm.clone()));
    tensors.push(("model.visual.merger.weight".into(), lm));
    let out = std::env::temp_dir().join(format!("ferrite-qwen35-vl-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    safetensors::serialize_to_file(tensors, None, &out.join("model.safetensors")).unwrap();
    let text: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let config = serde_json::json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 1},
    });
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();

    let file = ModelFile::open(&out).expect("wrapper opens");
    let ours = cpu_logits(&file, &o.tokens);
    std::fs::remove_dir_all(&out).ok();
    let e = nmse(&ours, &o.logits);
    println!("qwen35-tiny as a VL wrapper: NMSE vs transformers = {e:.3e}");
    assert!(e < ORACLE_NMSE, "NMSE {e:e}");
}

/// Every row's logits of `tokens` on `be`: the first `prefill` tokens in one step, the rest
/// one token per step (decode), the cache carried between them.
fn prefill_then_decode(
    be: &CpuBackend,
    file: &ModelFile,
    tokens: &[u32],
    prefill: usize,
) -> Vec<f32> {
    let m: Model<CpuBackend> = Model::load(be, file, &|_, _| {}).unwrap();
    let mut kv = m.new_kv(be, tokens.len()).unwrap();
    let mut ws = m.workspace(be, prefill, Logits::All).unwrap();
    let mut out = m
        .run(be, &mut ws, &mut kv, 0, &tokens[..prefill], Logits::All)
        .unwrap();
    let mut ws1 = m.workspace(be, 1, Logits::All).unwrap();
    out.extend(
        m.run(
            be,
            &mut ws1,
            &mut kv,
            prefill,
            &tokens[prefill..],
            Logits::All,
        )
        .unwrap(),
    );
    out
}

/// The chunked gated delta rule (chunks of 64, as prefill kernels compute it) through the
/// whole model equals the token-by-token recurrence, and its final state carries into
/// decode: a 150-token prompt (two full chunks and a partial one) prefilled chunked, then
/// 40 tokens decoded, against the recurrence throughout. Both are f32 and differ only in
/// association order (the unit tests in `ferrite_backend::gated_delta` measure ~1e-13 per
/// layer); 1e-10 leaves room for four layers and still fails any real error.
#[test]
fn qwen35_chunked_prefill_equals_recurrence() {
    for name in ["qwen35-tiny", "qwen35-moe-tiny"] {
        let file = ModelFile::open(&data_dir().join(name)).unwrap();
        let tokens: Vec<u32> = (0..190u32).map(|i| (i * 7919 + 13) % 1024).collect();
        let reference = prefill_then_decode(&CpuBackend::new(), &file, &tokens, 1);
        let chunked = prefill_then_decode(&CpuBackend::with_chunked_delta(), &file, &tokens, 150);
        let e = nmse(&chunked, &reference);
        println!("{name}: NMSE chunked prefill + decode vs recurrence = {e:.3e}");
        assert!(e < 1e-10, "{name}: NMSE {e:e}");
        for (t, (a, b)) in chunked.chunks(1024).zip(reference.chunks(1024)).enumerate() {
            assert_eq!(argmax(a), argmax(b), "{name}: argmax differs at {t}");
        }
    }
}

/// The decoders' deferred-norm order (the residual adds inside the o- and down projections,
/// each RMSNorm inside the projections after it: what the CUDA backend runs at decode for
/// float weights) on the reference ops, which compose the same arithmetic: bitwise the usual
/// order, in prefill and in decode.
#[test]
fn deferred_norm_order_equals_the_usual_one() {
    for name in ["qwen3-tiny", "llama-tiny", "qwen35-tiny"] {
        let file = ModelFile::open(&data_dir().join(name)).unwrap();
        let tokens: Vec<u32> = (0..24u32).map(|i| (i * 7919 + 13) % 1024).collect();
        let usual = prefill_then_decode(&CpuBackend::new(), &file, &tokens, 9);
        for be in [
            CpuBackend::with_deferred_norms(),
            CpuBackend::with_deferred_ffn_norms(),
        ] {
            let deferred = prefill_then_decode(&be, &file, &tokens, 9);
            assert_eq!(usual.len(), deferred.len());
            let differ = usual
                .iter()
                .zip(&deferred)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(differ, 0, "{name}: {differ} logits differ");
        }
    }
}
