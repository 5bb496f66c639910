//! Gate 3 (DESIGN.md): greedy output with MTP speculation K = 1..8 is token-identical to
//! plain greedy decode, on the two tiny Qwen3.5 oracle models (hybrid: the rollback of
//! the Gated DeltaNet state is exercised) with their MTP heads (tests/data/oracle/*/
//! mtp.safetensors, see tools/oracle/mtp_oracle.py). Random-weight heads draft badly, so
//! a scripted drafter also drives every acceptance length 0..=K on purpose.

use ferrite_backend::cpu::CpuBackend;
use ferrite_engine::speculative::{
    plain_greedy, speculative_greedy, Drafter, MtpDrafter, ScriptedDrafter, Speculator, MAX_DEPTH,
};
use ferrite_engine::{Engine, GenerateParams, Sequence};
use ferrite_models::{Model, ModelFile};
use ferrite_tokenizer::Tokenizer;

const MODELS: [&str; 2] = ["qwen35-tiny", "qwen35-moe-tiny"];
const PROMPT: [u32; 7] = [1, 17, 243, 999, 5, 64, 300];
const GEN: usize = 40;

fn load(name: &str) -> (CpuBackend, Model<CpuBackend>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/oracle")
        .join(name);
    let be = CpuBackend::new();
    let file = ModelFile::open(&dir).unwrap();
    let mut m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    m.load_mtp(&be, &file).unwrap();
    (be, m)
}

fn plain(be: &CpuBackend, m: &Model<CpuBackend>, n: usize) -> Vec<u32> {
    plain_greedy(be, m, &PROMPT, n).unwrap()
}

/// Speculative greedy decode of `n` tokens with `drafter`, checking each step's size and
/// the sequence's position as it goes.
fn speculative(
    be: &CpuBackend,
    m: &Model<CpuBackend>,
    depth: usize,
    drafter: &mut dyn Drafter<CpuBackend>,
    n: usize,
) -> (Vec<u32>, Vec<usize>, ferrite_engine::SpecStats) {
    let ctx = PROMPT.len() + n + 1;
    let mut s = Sequence::new(be, m, ctx).unwrap();
    let mut spec = Speculator::new(be, m, depth).unwrap();
    let mut out = vec![spec.prefill(&mut s, &PROMPT).unwrap()];
    let mut sizes = vec![];
    while out.len() < n {
        let room = (n - out.len()).min(ctx - s.pos);
        let got = spec
            .step(&mut s, drafter, *out.last().unwrap(), room)
            .unwrap();
        assert!((1..=depth + 1).contains(&got.len()) && got.len() <= room);
        assert_eq!(s.pos, PROMPT.len() + out.len() - 1 + got.len());
        sizes.push(got.len());
        out.extend(got);
    }
    (out, sizes, spec.stats)
}

#[test]
fn mtp_speculation_is_token_identical_to_greedy_for_every_depth() {
    for name in MODELS {
        let (be, m) = load(name);
        let want = plain(&be, &m, GEN);
        for depth in 1..=MAX_DEPTH {
            let (got, _, st) = speculative(&be, &m, depth, &mut MtpDrafter, GEN);
            assert_eq!(got, want, "{name}: depth {depth} differs from greedy");
            let (f, _, st2) =
                speculative_greedy(&be, &m, &PROMPT, GEN, depth, &mut MtpDrafter).unwrap();
            assert_eq!((f, st2), (got.clone(), st));
            println!(
                "{name} depth {depth}: {} steps, {}/{} drafts accepted, {} replays",
                st.steps, st.accepted, st.drafted, st.replays
            );
            assert_eq!(
                st.accepted + st.steps,
                GEN - 1,
                "{name}: every token counted"
            );
        }
    }
}

#[test]
fn every_acceptance_length_rolls_back_exactly() {
    for name in MODELS {
        let (be, m) = load(name);
        let truth = plain(&be, &m, GEN + MAX_DEPTH + 1);
        for depth in [1, 3, 8] {
            for wrong_at in 0..=depth {
                let mut d = ScriptedDrafter {
                    truth: truth.clone(),
                    prompt_len: PROMPT.len(),
                    right: wrong_at,
                    vocab: 1024,
                };
                let (got, sizes, st) = speculative(&be, &m, depth, &mut d, GEN);
                assert_eq!(
                    got,
                    truth[..GEN],
                    "{name}: depth {depth}, {wrong_at} right drafts a step"
                );
                // Each step takes the right drafts plus the target's own token (fewer only
                // at the end, where the room runs out).
                let full = wrong_at.min(depth) + 1;
                assert!(
                    sizes[..sizes.len() - 1].iter().all(|&s| s == full),
                    "{sizes:?}"
                );
                assert_eq!(st.replays > 0, wrong_at < depth, "{name}: {st:?}");
            }
        }
    }
}

/// A word-level tokenizer over the tiny models' 1024 ids ("t0" .. "t1023"; eos "t2"), so
/// [`Engine::generate`] can run them.
fn tiny_tokenizer() -> Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..1024).map(|i| (format!("t{i}"), i.into())).collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    });
    let config = serde_json::json!({"eos_token": "t2"});
    Tokenizer::from_json_str(&json.to_string(), Some(&config)).unwrap()
}

#[test]
fn generate_with_mtp_depth_matches_plain_greedy() {
    for name in MODELS {
        let (be, model) = load(name);
        let want = plain(&be, &model, GEN);
        let e = Engine {
            be,
            model,
            tok: tiny_tokenizer(),
        };
        let mut p = GenerateParams {
            max_tokens: GEN,
            ignore_eos: true,
            ..GenerateParams::default()
        };
        let base = e.generate(&PROMPT, &p, &mut |_| {}).unwrap();
        assert_eq!(base.tokens, want);
        assert!(base.spec.is_none());
        for depth in [1, 2, 4] {
            p.mtp_depth = depth;
            let g = e.generate(&PROMPT, &p, &mut |_| {}).unwrap();
            assert_eq!(g.tokens, want, "{name}: depth {depth}");
            assert_eq!(g.text, base.text);
            let st = g.spec.expect("speculation ran");
            assert_eq!(st.accepted + st.steps, GEN - 1);
        }
        // Sampling is refused, with the reason.
        p.sampler.temperature = 0.7;
        let err = e
            .generate(&PROMPT, &p, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("greedy only"), "{err}");
    }
}

/// Without a head (a GGUF, or `load_mtp` not called) a scripted drafter still speculates:
/// the steps skip the head's catch-up. This is how speculation's cost is measured on
/// synthetic models, which have no trained head.
#[test]
fn scripted_speculation_needs_no_head() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/oracle/qwen35-tiny");
    let be = CpuBackend::new();
    let file = ModelFile::open(&dir).unwrap();
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    assert!(!m.has_mtp());
    let truth = plain(&be, &m, GEN + MAX_DEPTH + 1);
    let mut d = ScriptedDrafter {
        truth: truth.clone(),
        prompt_len: PROMPT.len(),
        right: 2,
        vocab: 1024,
    };
    let (got, sizes, st) = speculative(&be, &m, 4, &mut d, GEN);
    assert_eq!(got, truth[..GEN]);
    assert!(
        sizes[..sizes.len() - 1].iter().all(|&s| s == 3),
        "{sizes:?}"
    );
    assert_eq!(st.replays, st.steps - 1);
    // The MTP drafter, though, needs the head.
    let mut s = Sequence::new(&be, &m, 64).unwrap();
    let mut spec = Speculator::new(&be, &m, 2).unwrap();
    let t = spec.prefill(&mut s, &PROMPT).unwrap();
    let e = spec
        .step(&mut s, &mut MtpDrafter, t, 8)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no draft pending"), "{e}");
}
