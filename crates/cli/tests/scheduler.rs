//! The serving scheduler on the default model (SmolLM2-135M-Instruct, CPU backend):
//! batching identity (batched steps over the paged KV cache: decode rows and prefill chunks
//! of several sequences in one step give each sequence the tokens it gets alone), admission
//! waiting and preemption under a small KV budget, a disconnected client freeing its
//! sequence, speculative decoding with prompt-lookup drafts verified inside batched steps,
//! and the prefix cache.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrite_cli::{load, Device, ModelArgs};
use ferrite_engine::json_mode::Schema;
use ferrite_engine::scheduler::{Event, Request, RequestParams, Scheduler, SchedulerConfig};
use ferrite_engine::{FinishReason, SamplerConfig};

const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
];

/// The default model (SmolLM2) on the CPU.
fn default_engine() -> ferrite_engine::Engine<ferrite_backend::cpu::CpuBackend> {
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

fn scheduler(cfg: SchedulerConfig) -> (Scheduler, Vec<Vec<u32>>) {
    let e = default_engine();
    let prompts = PROMPTS
        .iter()
        .map(|p| e.tok.encode(p, true, false).expect("tokenizes"))
        .collect();
    (Scheduler::spawn(e, cfg).expect("scheduler starts"), prompts)
}

struct Out {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    text: String,
    finish: FinishReason,
    completion_tokens: usize,
    cached_tokens: usize,
}

fn submit(s: &Scheduler, prompt: &[u32], params: &RequestParams) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    s.submit(Request {
        prompt: prompt.to_vec(),
        params: params.clone(),
        sink: Box::new(tx),
    })
    .expect("accepted");
    rx
}

fn collect(rx: mpsc::Receiver<Event>) -> Out {
    let mut o = Out {
        tokens: vec![],
        logprobs: vec![],
        text: String::new(),
        finish: FinishReason::Length,
        completion_tokens: 0,
        cached_tokens: 0,
    };
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
            Event::Token { id, text, logprob } => {
                o.tokens.push(id);
                o.text.push_str(&text);
                if let Some(lp) = logprob {
                    o.logprobs.push(lp.logprob);
                    o.logprobs.extend(lp.top.iter().map(|t| t.1));
                }
            }
            Event::Done {
                finish,
                text,
                usage,
            } => {
                o.text.push_str(&text);
                o.finish = finish;
                o.completion_tokens = usage.completion_tokens;
                o.cached_tokens = usage.cached_tokens;
                return o;
            }
            Event::Error(e) => panic!("generation failed: {e}"),
        }
    }
}

fn alone(s: &Scheduler, prompts: &[Vec<u32>], p: &RequestParams) -> Vec<Out> {
    prompts.iter().map(|q| collect(submit(s, q, p))).collect()
}

fn together(s: &Scheduler, prompts: &[Vec<u32>], p: &RequestParams) -> Vec<Out> {
    let rxs: Vec<_> = prompts.iter().map(|q| submit(s, q, p)).collect();
    rxs.into_iter().map(collect).collect()
}

fn wait_idle(s: &Scheduler) {
    let t0 = Instant::now();
    while s.stats().running.load(Ordering::SeqCst) > 0
        || s.stats().kv_pages_used.load(Ordering::SeqCst) > 0
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "scheduler never went idle"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn concurrent_greedy_equals_alone() {
    let (s, prompts) = scheduler(SchedulerConfig {
        max_batch: 8,
        max_context: 512,
        kv_tokens: 8 * 512,
        // Small chunks so that prompts are prefilled across iterations, interleaved with
        // the decodes of other sequences.
        prefill_chunk: 4,
        ..SchedulerConfig::default()
    });
    let p = RequestParams {
        max_tokens: 20,
        ..RequestParams::default()
    };
    let a = alone(&s, &prompts, &p);
    assert_eq!(
        s.stats().max_step_seqs.load(Ordering::SeqCst),
        1,
        "requests served one after the other run alone"
    );
    let b = together(&s, &prompts, &p);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.tokens, y.tokens, "prompt {i}: batched output differs");
        assert_eq!(x.text, y.text);
        assert_eq!(x.completion_tokens, x.tokens.len());
        assert!(!x.tokens.is_empty());
    }
    wait_idle(&s);
    assert_eq!(s.stats().preemptions.load(Ordering::SeqCst), 0);
    // The sequences really shared backend steps (one KV pool, decode rows and prefill chunks
    // of several sequences per step).
    let st = s.stats();
    assert!(st.batched.load(Ordering::SeqCst), "steps are batched");
    assert!(
        st.max_step_seqs.load(Ordering::SeqCst) > 1,
        "no step held more than one sequence"
    );
}

/// The batching identity for every way a token is chosen: greedy on the device, seeded
/// top-k sampling from device candidates, full logits on the host (penalties, logprobs):
/// six different requests together give each exactly what it gets alone, logprobs included.
#[test]
fn batched_sampling_and_logprobs_equal_alone() {
    let (s, prompts) = scheduler(SchedulerConfig {
        max_batch: 6,
        max_context: 256,
        kv_tokens: 6 * 256,
        prefill_chunk: 8,
        ..SchedulerConfig::default()
    });
    let sampled = |seed| SamplerConfig {
        temperature: 0.8,
        top_k: 40,
        seed: Some(seed),
        ..SamplerConfig::default()
    };
    let params: Vec<RequestParams> = vec![
        RequestParams {
            max_tokens: 12,
            ..RequestParams::default()
        },
        RequestParams {
            max_tokens: 12,
            sampler: sampled(7),
            ..RequestParams::default()
        },
        RequestParams {
            max_tokens: 12,
            logprobs: Some(3),
            ..RequestParams::default()
        },
        RequestParams {
            max_tokens: 12,
            sampler: SamplerConfig {
                presence_penalty: 0.5,
                frequency_penalty: 0.3,
                seed: Some(3),
                ..SamplerConfig::default()
            },
            ..RequestParams::default()
        },
        RequestParams {
            max_tokens: 12,
            sampler: sampled(11),
            ignore_eos: true,
            ..RequestParams::default()
        },
        RequestParams {
            max_tokens: 12,
            logprobs: Some(0),
            sampler: SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            ..RequestParams::default()
        },
    ];
    let a: Vec<Out> = prompts
        .iter()
        .zip(&params)
        .map(|(q, p)| collect(submit(&s, q, p)))
        .collect();
    let rxs: Vec<_> = prompts
        .iter()
        .zip(&params)
        .map(|(q, p)| submit(&s, q, p))
        .collect();
    let b: Vec<Out> = rxs.into_iter().map(collect).collect();
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.tokens, y.tokens, "request {i}: batched tokens differ");
        assert_eq!(x.text, y.text, "request {i}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&x.logprobs),
            bits(&y.logprobs),
            "request {i}: batched logprobs differ"
        );
    }
    assert!(!a[2].logprobs.is_empty() && !a[5].logprobs.is_empty());
    wait_idle(&s);
    assert!(s.stats().max_step_seqs.load(Ordering::SeqCst) > 1);
}

#[test]
fn small_kv_budget_waits_and_preempts_and_finishes_everything() {
    // 8 pages of 16 tokens: four sequences of ~10 prompt + 40 generated tokens need 16.
    let (s, prompts) = scheduler(SchedulerConfig {
        max_batch: 4,
        max_context: 128,
        kv_tokens: 128,
        page_size: 16,
        prefill_chunk: 64,
        max_waiting: 64,
        mtp_depth: 0,
        lookup_depth: 0,
        // Re-admitted sequences find their own released pages (until others evict them).
        prefix_cache: true,
    });
    let p = RequestParams {
        max_tokens: 40,
        ignore_eos: true,
        ..RequestParams::default()
    };
    let prompts = &prompts[..4];
    let a = alone(&s, prompts, &p);
    assert_eq!(s.stats().preemptions.load(Ordering::SeqCst), 0);
    let b = together(&s, prompts, &p);
    assert!(
        s.stats().preemptions.load(Ordering::SeqCst) > 0,
        "the budget is too small for all four: someone must have been preempted"
    );
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(y.tokens.len(), 40, "prompt {i}");
        assert_eq!(y.finish, FinishReason::Length);
        // Resumed sequences re-prefill their history; SmolLM2's greedy path is stable
        // under that, so the tokens agree.
        assert_eq!(x.tokens, y.tokens, "prompt {i}: preempted output differs");
    }
    wait_idle(&s);
}

#[test]
fn disconnected_client_frees_its_sequence_and_queue_limits_hold() {
    let (s, prompts) = scheduler(SchedulerConfig {
        max_batch: 1,
        max_context: 512,
        kv_tokens: 512,
        max_waiting: 1,
        ..SchedulerConfig::default()
    });
    let p = RequestParams {
        max_tokens: 400,
        ignore_eos: true,
        ..RequestParams::default()
    };
    let rx = submit(&s, &prompts[0], &p);
    // Wait for the first token, then hang up.
    assert!(matches!(
        rx.recv_timeout(Duration::from_secs(60)),
        Ok(Event::Token { .. })
    ));
    drop(rx);
    wait_idle(&s);

    // One running, one waiting, the third is refused.
    let r1 = submit(&s, &prompts[0], &p);
    let _ = r1.recv_timeout(Duration::from_secs(60));
    let r2 = submit(&s, &prompts[1], &p);
    let (tx, _r3) = mpsc::channel();
    let e = s.submit(Request {
        prompt: prompts[2].clone(),
        params: p.clone(),
        sink: Box::new(tx),
    });
    assert_eq!(
        e.unwrap_err(),
        ferrite_engine::scheduler::SubmitError::QueueFull
    );
    drop((r1, r2));
    wait_idle(&s);

    // Too long for the context: refused with the numbers.
    let (tx, _r) = mpsc::channel();
    let e = s.submit(Request {
        prompt: vec![1; 500],
        params: RequestParams {
            max_tokens: 100,
            ..RequestParams::default()
        },
        sink: Box::new(tx),
    });
    assert!(
        matches!(e, Err(ferrite_engine::scheduler::SubmitError::Invalid(m)) if m.contains("500"))
    );
}

/// Settings under which the server could serve nothing are refused at start-up: no room to
/// wait (every request would get 429), a context of under two tokens.
#[test]
fn unservable_settings_are_refused() {
    for (cfg, msg) in [
        (
            SchedulerConfig {
                max_waiting: 0,
                ..SchedulerConfig::default()
            },
            "max_waiting must be at least 1",
        ),
        (
            SchedulerConfig {
                max_context: 1,
                ..SchedulerConfig::default()
            },
            "max_context must be at least 2",
        ),
        (
            SchedulerConfig {
                mtp_depth: 2,
                ..SchedulerConfig::default()
            },
            "needs the model's MTP head",
        ),
        (
            SchedulerConfig {
                lookup_depth: 9,
                ..SchedulerConfig::default()
            },
            "draft depth must be 0 (off) to 8",
        ),
    ] {
        let err = Scheduler::spawn(default_engine(), cfg)
            .err()
            .expect("refused");
        assert!(err.to_string().contains(msg), "{err}");
    }
}

/// Prompts whose continuations repeat what they hold, so that lookup drafts are right.
const REPEATING: [&str; 3] = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    "red, green, blue, red, green, blue, red, green, blue, red,",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
];

/// Prompt-lookup speculation in batched steps: greedy requests together with it give the
/// tokens plain decoding gives each alone, drafts are kept, a `max_tokens` inside a step cuts
/// it there, logprobs requests (which do not speculate) are unchanged, and seeded sampling
/// repeats; then the same under a KV budget that forces preemptions.
#[test]
fn lookup_drafts_in_batched_steps_keep_each_requests_output() {
    let (plain, prompts) = scheduler(SchedulerConfig {
        max_batch: 8,
        max_context: 256,
        kv_tokens: 8 * 256,
        prefill_chunk: 16,
        ..SchedulerConfig::default()
    });
    let e = default_engine();
    let mut prompts: Vec<Vec<u32>> = prompts[..3].to_vec();
    prompts.extend(
        REPEATING
            .iter()
            .map(|p| e.tok.encode(p, true, false).expect("tokenizes")),
    );
    let spec_cfg = SchedulerConfig {
        max_batch: 8,
        max_context: 256,
        kv_tokens: 8 * 256,
        prefill_chunk: 16,
        lookup_depth: 4,
        ..SchedulerConfig::default()
    };
    let spec = Scheduler::spawn(e, spec_cfg.clone()).expect("scheduler starts");
    let greedy = RequestParams {
        max_tokens: 40,
        ignore_eos: true,
        ..RequestParams::default()
    };
    let want = alone(&plain, &prompts, &greedy);
    let got = together(&spec, &prompts, &greedy);
    for (i, (x, y)) in want.iter().zip(&got).enumerate() {
        assert_eq!(x.tokens, y.tokens, "prompt {i}: speculative output differs");
        assert_eq!(x.text, y.text);
        assert_eq!(y.completion_tokens, 40);
    }
    wait_idle(&spec);
    let st = spec.stats();
    let (drafted, kept) = (
        st.spec_drafted.load(Ordering::SeqCst),
        st.spec_accepted.load(Ordering::SeqCst),
    );
    println!("lookup depth 4: {kept} of {drafted} drafts kept");
    assert!(st.batched.load(Ordering::SeqCst), "steps are batched");
    assert!(
        kept > 20 && kept <= drafted,
        "{kept} of {drafted} drafts kept on prompts that repeat themselves"
    );
    // Fewer decode steps than tokens: verifies gave several tokens at once.
    assert!(st.max_step_seqs.load(Ordering::SeqCst) > 1);

    // max_tokens cuts a step short: 5 tokens exactly, plain decoding's first 5.
    let short = RequestParams {
        max_tokens: 5,
        ..greedy.clone()
    };
    let five = together(&spec, &prompts[3..], &short);
    for (x, y) in want[3..].iter().zip(&five) {
        assert_eq!(y.tokens, x.tokens[..5]);
        assert_eq!(y.finish, FinishReason::Length);
    }

    // Logprobs requests decode plainly, beside speculating ones.
    let lp = RequestParams {
        max_tokens: 12,
        logprobs: Some(3),
        ..RequestParams::default()
    };
    let lp_want = alone(&plain, &prompts[3..], &lp);
    let before = spec.stats().spec_drafted.load(Ordering::SeqCst);
    let lp_got = together(&spec, &prompts[3..], &lp);
    assert_eq!(spec.stats().spec_drafted.load(Ordering::SeqCst), before);
    for (x, y) in lp_want.iter().zip(&lp_got) {
        assert_eq!(x.tokens, y.tokens);
        assert_eq!(x.logprobs, y.logprobs);
    }

    // Seeded sampling with lookup drafts repeats itself, batched or alone.
    let sampled = RequestParams {
        max_tokens: 24,
        ignore_eos: true,
        sampler: SamplerConfig {
            temperature: 0.7,
            top_k: 20,
            seed: Some(11),
            ..SamplerConfig::greedy()
        },
        ..RequestParams::default()
    };
    let s1 = together(&spec, &prompts, &sampled);
    let s2 = alone(&spec, &prompts, &sampled);
    for (x, y) in s1.iter().zip(&s2) {
        assert_eq!(
            x.tokens, y.tokens,
            "seeded sampling with drafts does not repeat"
        );
        assert_eq!(x.tokens.len(), 24);
    }
    wait_idle(&spec);
    drop(spec);

    // Under a KV budget too small for all: preemptions, and still plain decoding's tokens.
    let e = default_engine();
    let tight = Scheduler::spawn(
        e,
        SchedulerConfig {
            max_batch: 4,
            max_context: 128,
            kv_tokens: 128,
            page_size: 16,
            prefill_chunk: 64,
            ..spec_cfg
        },
    )
    .expect("scheduler starts");
    let got = together(&tight, &prompts[2..6], &greedy);
    assert!(tight.stats().preemptions.load(Ordering::SeqCst) > 0);
    for (x, y) in want[2..6].iter().zip(&got) {
        assert_eq!(x.tokens, y.tokens, "preempted speculative output differs");
    }
    wait_idle(&tight);
}

/// The prefix cache: requests that share a system prompt, and a conversation's next turn
/// (which starts with the earlier turn and its answer), take those pages from the cache and
/// get exactly the tokens they get without it (the cached keys and values are those they
/// would have computed: bitwise on the CPU), alone and together; `usage.cached_tokens` says
/// how many prompt tokens were not prefilled.
#[test]
fn prefix_cache_keeps_every_requests_output() {
    const SYSTEM: &str = "You are a careful assistant. You answer questions about geography, \
        history, cooking and science in two short sentences, in plain English, without lists \
        and without repeating the question. ";
    let e = default_engine();
    let enc = |t: &str| e.tok.encode(t, true, false).expect("tokenizes");
    let shared: Vec<Vec<u32>> = PROMPTS[..3]
        .iter()
        .map(|p| enc(&format!("{SYSTEM}{p}")))
        .collect();
    let common = shared[0]
        .iter()
        .zip(&shared[1])
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        common >= 32,
        "the system prompt spans two pages ({common} tokens)"
    );
    let question = e
        .tok
        .encode(" Why is that?", false, false)
        .expect("tokenizes");
    let p = RequestParams {
        max_tokens: 24,
        ignore_eos: true,
        ..RequestParams::default()
    };
    let mut runs = Vec::new();
    for cache in [false, true] {
        let (s, _) = scheduler(SchedulerConfig {
            max_batch: 4,
            max_context: 512,
            kv_tokens: 4 * 512,
            prefill_chunk: 16,
            prefix_cache: cache,
            ..SchedulerConfig::default()
        });
        let first = alone(&s, &shared, &p);
        assert_eq!(s.stats().prefix_cache.load(Ordering::SeqCst), cache);
        // The next turn: the first conversation, its answer, a new question.
        let mut turn: Vec<u32> = shared[0].iter().chain(&first[0].tokens).copied().collect();
        turn.extend(&question);
        let second = collect(submit(&s, &turn, &p));
        let both = together(&s, &shared, &p);
        // Three copies of a prompt not seen yet, together (as `n` choices are): with the
        // cache the later copies wait for the first one's pages and prefill only the rest.
        let fresh = enc(&format!(
            "Three friends walked along the old canal on a grey morning in late autumn, \
             talking about the books they had read that year and the ones they still meant \
             to read. {}",
            PROMPTS[5]
        ));
        let before = s.stats().prefill_tokens.load(Ordering::SeqCst);
        let copies = together(&s, &[fresh.clone(), fresh.clone(), fresh.clone()], &p);
        let prefilled = s.stats().prefill_tokens.load(Ordering::SeqCst) - before;
        let rest = fresh.len() - (fresh.len() - 1) / 16 * 16;
        assert_eq!(
            prefilled as usize,
            if cache {
                fresh.len() + 2 * rest
            } else {
                3 * fresh.len()
            },
            "prompt tokens prefilled for three copies of {}",
            fresh.len()
        );
        assert!(copies.iter().all(|o| o.tokens == copies[0].tokens));
        let hits = s.stats().prefix_hit_tokens.load(Ordering::SeqCst);
        println!(
            "prefix cache {cache}: cached tokens of the first requests {:?}, of the next turn \
             {} (of {}), together {:?}",
            first.iter().map(|o| o.cached_tokens).collect::<Vec<_>>(),
            second.cached_tokens,
            turn.len(),
            both.iter().map(|o| o.cached_tokens).collect::<Vec<_>>()
        );
        wait_idle(&s);
        if cache {
            assert_eq!(first[0].cached_tokens, 0, "nothing cached before the first");
            for o in &first[1..] {
                assert_eq!(
                    o.cached_tokens,
                    common / 16 * 16,
                    "the system prompt's pages"
                );
            }
            // Every full page the first conversation filled: its prompt and answer but the
            // last answer token (sampled, never fed).
            let filled = shared[0].len() + first[0].tokens.len() - 1;
            assert_eq!(
                second.cached_tokens,
                (filled / 16 * 16).min((turn.len() - 1) / 16 * 16),
                "the next turn takes the first turn's pages, its answer's too"
            );
            assert!(second.cached_tokens > common, "the answer's pages too");
            assert!(both.iter().all(|o| o.cached_tokens > 0));
            assert!(hits > 0);
            assert!(s.stats().kv_pages_cached.load(Ordering::SeqCst) > 0);
        } else {
            assert!(first.iter().chain(&both).all(|o| o.cached_tokens == 0));
            assert_eq!(hits, 0);
        }
        runs.push((first, second, both, copies));
    }
    let (off, on) = (&runs[0], &runs[1]);
    for (i, (x, y)) in off.0.iter().zip(&on.0).enumerate() {
        assert_eq!(
            x.tokens, y.tokens,
            "request {i}: the cache changed its output"
        );
    }
    assert_eq!(off.1.tokens, on.1.tokens, "the next turn's output changed");
    for (i, (x, y)) in off.2.iter().zip(&on.2).enumerate() {
        assert_eq!(
            x.tokens, y.tokens,
            "request {i} together: the cache changed its output"
        );
    }
    assert_eq!(
        off.3[0].tokens, on.3[0].tokens,
        "the copies' output changed"
    );
}

/// JSON mode (`response_format: json_object`): greedy and sampled requests, alone and beside
/// a plain one, each give one JSON object and stop there; a short `max_tokens` cuts it.
#[test]
fn json_mode_gives_one_json_object() {
    let (s, prompts) = scheduler(SchedulerConfig {
        max_batch: 4,
        max_context: 512,
        kv_tokens: 4 * 512,
        prefill_chunk: 16,
        ..SchedulerConfig::default()
    });
    let e = default_engine();
    let prompt = e
        .tok
        .encode(
            "Describe the city of Paris as a JSON object with the keys name, country and \
             population.",
            true,
            false,
        )
        .expect("tokenizes");
    drop(e);
    let json = |temperature: f32, max_tokens: usize| RequestParams {
        max_tokens,
        json: Some(Arc::new(Schema::any_object())),
        sampler: SamplerConfig {
            temperature,
            seed: Some(5),
            ..SamplerConfig::greedy()
        },
        ..RequestParams::default()
    };
    let plain = RequestParams {
        max_tokens: 24,
        ..RequestParams::default()
    };
    let rxs = [
        submit(&s, &prompt, &json(0.0, 200)),
        submit(&s, &prompt, &json(0.9, 200)),
        submit(&s, &prompts[0], &plain),
    ];
    let outs: Vec<Out> = rxs.into_iter().map(collect).collect();
    for (i, o) in outs[..2].iter().enumerate() {
        let v: serde_json::Value = serde_json::from_str(&o.text)
            .unwrap_or_else(|e| panic!("request {i}: not JSON ({e}): {:?}", o.text));
        assert!(v.is_object(), "request {i}: {v}");
        assert_eq!(o.finish, FinishReason::Stop, "request {i}: {:?}", o.text);
        println!("JSON mode {i}: {}", o.text);
    }
    // The plain request beside them is what it is alone.
    assert_eq!(
        outs[2].tokens,
        collect(submit(&s, &prompts[0], &plain)).tokens
    );
    // Cut short: a prefix of an object, finish "length".
    let cut = collect(submit(&s, &prompt, &json(0.0, 3)));
    assert_eq!(cut.finish, FinishReason::Length);
    assert!(cut.text.trim_start().starts_with('{'), "{:?}", cut.text);
    assert!(serde_json::from_str::<serde_json::Value>(&cut.text).is_err());

    // A schema (structured output): exactly its keys, the required ones, the types asked.
    let schema = Schema::compile(&serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer"},
            "capital": {"type": "boolean"},
            "continent": {"enum": ["Europe", "Asia", "Africa"]}
        },
        "required": ["name", "population", "capital"],
        "additionalProperties": false
    }))
    .expect("compiles");
    for temperature in [0.0, 0.9] {
        let p = RequestParams {
            json: Some(Arc::new(schema.clone())),
            ..json(temperature, 300)
        };
        let o = collect(submit(&s, &prompt, &p));
        println!("schema, temperature {temperature}: {}", o.text);
        let v: serde_json::Value = serde_json::from_str(&o.text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", o.text));
        let m = v.as_object().expect("an object");
        assert!(m["name"].is_string() && m["population"].is_i64() && m["capital"].is_boolean());
        let keys = ["name", "country", "population", "capital", "continent"];
        assert!(m.keys().all(|k| keys.contains(&k.as_str())), "{v}");
        if let Some(c) = m.get("continent") {
            assert!(
                ["Europe", "Asia", "Africa"].contains(&c.as_str().unwrap()),
                "{v}"
            );
        }
        assert_eq!(o.finish, FinishReason::Stop, "{:?}", o.text);
    }
}
