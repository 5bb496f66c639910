//! `ferrite bench`: the prefill/decode gate first, then prefill and decode speed, achieved
//! bandwidth and % of the bandwidth roofline; optionally recorded in bench/results.jsonl.
//!
//! Roofline: decode at batch 1 must read every weight it uses once per token, plus the KV
//! cache up to the current depth. bytes_per_token / copy_bandwidth is the fastest a token
//! can be; `roofline_pct` = achieved tokens/s ÷ that bound.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use ferrite_backend::Backend;
use ferrite_engine::Sequence;
use ferrite_models::ModelFile;
use serde::Serialize;

use crate::{load, ModelArgs};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length of the prefill test (pp).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens generated in the decode test (tg).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Tokens already in the KV cache before each test (context depth).
    #[arg(long, default_value_t = 0)]
    pub depth: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Tokens used by the prefill/decode gate.
    #[arg(long, default_value_t = 32)]
    pub gate_tokens: usize,
    /// Print the results as JSON lines on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Append the results to bench/results.jsonl (or --results FILE).
    #[arg(long)]
    pub record: bool,
    /// Results file for --record.
    #[arg(long, default_value = "bench/results.jsonl")]
    pub results: PathBuf,
    /// Model label for the record (default: from the file's general.name).
    #[arg(long)]
    pub label: Option<String>,
    /// KV cache capacity in positions (default: --depth plus the longer test). A larger one
    /// measures decode in a cache sized for a long generation, as `run` sizes it for
    /// --max-tokens: the decode attention's split count follows the capacity, and the
    /// positions decoded here hold fewer of the splits than at the end of such a cache.
    #[arg(long)]
    pub context: Option<usize>,
    /// Decode steps between reads of the generated tokens in the decode test: each token is
    /// chosen and fed to the next step on the device, as `run` decodes greedily; 0 reads each
    /// token back before the next step is launched (the host loop).
    #[arg(long, default_value_t = ferrite_engine::generate::FEED_CHUNK)]
    pub feed_chunk: usize,
    /// Also time greedy decode with speculation K tokens deep (a third test, tgN-mtpK; 0 =
    /// off): drafts from the model's MTP head where it has one (Hugging Face Qwen3.5
    /// checkpoints, or `X.mtp.safetensors` beside `X.gguf`: `synth --mtp`), otherwise, or
    /// with --draft-right, scripted drafts of the known greedy continuation (the head, when
    /// there is one, still runs for its cost). Its tokens must equal plain greedy decode's
    /// (gate 3) or nothing is recorded.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8))]
    pub mtp_depth: u32,
    /// Scripted drafts: how many of each step's K drafts are right, the rest wrong, to time
    /// speculation at a chosen acceptance (a random head's drafts are all wrong). Default
    /// without a head: all K.
    #[arg(long)]
    pub draft_right: Option<usize>,
    /// Also time greedy decode of N sequences together (a further test, tg<gen>-b<N>; 0 = off):
    /// serve's batched step over one paged cache (on a GPU a graph per batch size), each
    /// sequence from its own first token at --depth, one read of every row's choice a step.
    /// Reports the tokens of all sequences per second; for dense models also the achieved
    /// bandwidth of a step (one pass over the weights plus every sequence's cache) and its %
    /// of the roofline: how close a step of N rows stays to a step of one.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub batch: u32,
}

/// One measurement, as appended to bench/results.jsonl.
#[derive(Serialize, Debug, Clone)]
pub struct Record {
    pub date: String,
    pub git_sha: &'static str,
    pub gpu: String,
    pub engine: &'static str,
    pub backend: String,
    pub model: String,
    pub quant: String,
    pub test: String,
    pub depth: usize,
    pub tokens_per_s: f64,
    pub achieved_gb_s: Option<f64>,
    pub roofline_pct: Option<f64>,
    pub bytes_per_token: Option<u64>,
    pub copy_bandwidth_gb_s: f64,
    /// Device memory in use after the test (weights, KV cache, workspaces), GiB.
    pub vram_used_gib: Option<f64>,
    pub reps: usize,
    /// Prompt length of the prefill/decode gate the run passed (`--gate-tokens`).
    pub gate_tokens: usize,
    /// The KV cache's storage where it is not the default f16 (`--kv-cache-q8`: "q8_0").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<&'static str>,
    /// The KV cache's capacity where `--context` set it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
    /// The decode test's loop (tg records): "fed N" (greedy fed on the device, read N steps at
    /// a time) or "host" (each token read back before the next step), the graph-capturing
    /// step untimed. Records without it: the host loop with that step timed, except those of
    /// git sha de6fd1b, which fed 8 (the field came after them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_loop: Option<String>,
}

/// llama.cpp's `llama_ftype` names for `general.file_type`.
fn ftype_name(ft: u32) -> String {
    match ft {
        0 => "F32".into(),
        1 => "F16".into(),
        2 => "Q4_0".into(),
        3 => "Q4_1".into(),
        7 => "Q8_0".into(),
        14 => "Q4_K_S".into(),
        15 => "Q4_K_M".into(),
        16 => "Q5_K_S".into(),
        17 => "Q5_K_M".into(),
        18 => "Q6_K".into(),
        32 => "BF16".into(),
        n => format!("ftype{n}"),
    }
}

/// Weight bytes a decode step reads: every weight as the model holds it (after any
/// quantization at load), the routed experts' top-k share, and the token embedding only where
/// it is also the output projection.
fn weight_bytes_per_token<B: Backend>(m: &ferrite_models::Model<B>) -> u64 {
    let w = m.weight_bytes;
    let expert_frac = m
        .cfg
        .moe
        .as_ref()
        .map_or(1.0, |e| e.routing.top_k as f64 / e.routing.n_experts as f64);
    let embed = if m.ties_output() { w.embed } else { 0 };
    w.other + embed + (w.experts as f64 * expert_frac) as u64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Deterministic prompt tokens that avoid the vocabulary's top (special tokens).
fn bench_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let hi = (vocab as u64 * 9 / 10).max(101);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (100 + s % hi.saturating_sub(100).max(1)) as u32
        })
        .collect()
}

/// The KV cache capacity of the tests: `--context`, at least --depth plus the longer test.
fn bench_context(a: &BenchArgs) -> Result<usize> {
    let need = a.depth + a.prompt_tokens.max(a.gen_tokens + 2 + a.mtp_depth as usize);
    // (The batched test decodes gen_tokens + 2 positions from --depth: within `need`.)
    let ctx = a.context.unwrap_or(need);
    anyhow::ensure!(
        ctx >= need,
        "--context {ctx} is too small: the tests need {need} positions (--depth {} plus the \
         longer of --prompt-tokens {} and --gen-tokens {} + 2 + --mtp-depth {})",
        a.depth,
        a.prompt_tokens,
        a.gen_tokens,
        a.mtp_depth
    );
    Ok(ctx)
}

/// Positions per page of the batched test's cache (serve's default page size).
const BATCH_PAGE: usize = 16;

/// Prompt rows per prefill step of the batched test's fill.
const BATCH_FILL_CHUNK: usize = 512;

/// Greedy decode of `first.len()` sequences together through serve's batched step
/// ([`ferrite_engine::Batch`]), each filled with `fill` (untimed) and then fed its first
/// token; returns every sequence's tokens per second over `gen` steps. The first two steps
/// (eager, then captured as a graph where the backend has graphs) are not timed.
fn batched_decode<B: Backend>(
    be: &B,
    model: &ferrite_models::Model<B>,
    ctx: usize,
    fill: &[u32],
    first: &[u32],
    gen: usize,
) -> Result<f64> {
    use ferrite_backend::SeqRows;
    use ferrite_engine::{Batch, BatchConfig};
    let n = first.len();
    let per_seq = ctx.div_ceil(BATCH_PAGE);
    let mut batch = Batch::new(
        be,
        model,
        BatchConfig {
            n_pages: n * per_seq,
            page_size: BATCH_PAGE,
            max_pages: per_seq,
            max_seqs: n,
            max_rows: n.max(fill.len().min(BATCH_FILL_CHUNK)),
            max_logits: n,
            state_snapshots: 0,
        },
    )?;
    let pages: Vec<Vec<u32>> = (0..n)
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    for (i, p) in pages.iter().enumerate() {
        batch.clear_state(i)?;
        for (c, chunk) in fill.chunks(BATCH_FILL_CHUNK).enumerate() {
            batch.step(&[SeqRows {
                tokens: chunk,
                pos0: c * BATCH_FILL_CHUNK,
                pages: p,
                logits: 1,
                state: i,
            }])?;
        }
    }
    let mut cur = first.to_vec();
    let mut pos = fill.len();
    let step = |batch: &mut Batch<'_, B>, cur: &mut Vec<u32>, pos: &mut usize| -> Result<()> {
        let rows: Vec<SeqRows<'_>> = (0..n)
            .map(|i| SeqRows {
                tokens: std::slice::from_ref(&cur[i]),
                pos0: *pos,
                pages: &pages[i],
                logits: 1,
                state: i,
            })
            .collect();
        batch.step(&rows)?;
        let next = (0..n)
            .map(|i| batch.greedy(i))
            .collect::<Result<Vec<_>>>()?;
        *cur = next;
        *pos += 1;
        Ok(())
    };
    for _ in 0..2 {
        step(&mut batch, &mut cur, &mut pos)?;
    }
    let t0 = Instant::now();
    for _ in 0..gen {
        step(&mut batch, &mut cur, &mut pos)?;
    }
    Ok((n * gen) as f64 / t0.elapsed().as_secs_f64())
}

/// Decode steps of the check that greedy decoding fed on the device gives the host loop's
/// tokens (after the gate, on the gate's prompt): a chain of 2 and one of 8, as `run` takes
/// them.
const FED_CHECK: usize = 10;

pub fn bench(a: &BenchArgs) -> Result<()> {
    anyhow::ensure!(
        a.reps >= 1 && a.gen_tokens >= 1 && a.prompt_tokens >= 1,
        "reps, gen-tokens and prompt-tokens must be ≥ 1"
    );
    let ctx = bench_context(a)?;
    let (path, file) = load::open(&a.model)?;
    crate::on_backend!(&a.model, be => bench_on(&be, &path, &file, a, ctx))
}

fn bench_on<B: Backend>(
    be: &B,
    path: &std::path::Path,
    file: &ModelFile,
    a: &BenchArgs,
    ctx: usize,
) -> Result<()> {
    let mut model = load::model(be, file, &a.model)?;
    let spec_depth = a.mtp_depth as usize;
    // Speculation's drafter: the MTP head unless scripted drafts are asked for or there is
    // no head to load (scripted drafts then still run a loaded head for its cost).
    let loaded = spec_depth > 0
        && match model.load_mtp(be, file) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("speculation: scripted drafts, no head ({e:#})");
                false
            }
        };
    let head = loaded && a.draft_right.is_none();
    let model = model;
    // The roofline and the records assume every weight in device memory; experts read over
    // the bus are another measurement (bench/host_experts.md).
    let host_experts = be.host_expert_bytes();
    anyhow::ensure!(
        !(a.record && host_experts > 0),
        "experts held in host memory (--vram-weights, or a model larger than the GPU): not \
         recorded; bench/results.jsonl holds runs with every weight in VRAM"
    );
    if host_experts > 0 {
        eprintln!(
            "note: {:.2} GiB of experts in host memory; the roofline below counts them as VRAM \
             bytes",
            host_experts as f64 / (1u64 << 30) as f64
        );
    }
    let cfg = model.cfg.clone();
    if ctx > cfg.max_ctx {
        // Timed like any other positions, but not a context the model can be used at.
        tracing::warn!(
            "the tests reach {ctx} positions, past the model's context of {}: `run` and `serve` \
             would refuse that",
            cfg.max_ctx
        );
    }
    let (label, quant) = match file {
        ModelFile::Gguf(g) => (
            g.get_str("general.name")
                .map(|s| s.to_lowercase().replace(' ', "-")),
            g.get_u32("general.file_type").map(ftype_name),
        ),
        ModelFile::Safetensors(_) => (None, None),
    };
    let label = a.label.clone().or(label).unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    });
    let quant = match a.model.quantize {
        // Not the file's type: the mix it was quantized to as it loaded.
        Some(q) => format!("{} (at load)", q.mix().name()),
        None => quant.unwrap_or_else(|| "unknown".into()),
    };

    // Gate first: no timing is worth anything if prefill and decode disagree. Under the
    // backend's timing diagnostics (FERRITE_DIAG_*, FERRITE_GEMV_DIAG: launches, loads or
    // compute left out, wrong outputs) the gate cannot pass; it is skipped and nothing is
    // recorded.
    let gate_prompt = bench_tokens(a.gate_tokens.max(2), cfg.vocab, 7);
    let diag = ferrite_backend::cuda::timing_diagnostic();
    if diag {
        anyhow::ensure!(
            !a.record,
            "a timing diagnostic (FERRITE_DIAG_* or FERRITE_GEMV_DIAG) is on, with wrong outputs: not recorded"
        );
        eprintln!("gate: SKIPPED (a timing diagnostic is on: FERRITE_DIAG_* or FERRITE_GEMV_DIAG; the outputs are wrong)");
    } else {
        let g = ferrite_engine::gate(be, &model, &gate_prompt)?;
        anyhow::ensure!(g.passed(), "prefill/decode gate FAILED: {}", g.describe());
        eprintln!(
            "gate: passed ({} tokens: {})",
            gate_prompt.len(),
            g.describe()
        );
        // The decode test's greedy chains fed on the device against the host loop.
        let (fed, host) =
            ferrite_engine::generate::fed_and_host_tokens(be, &model, &gate_prompt, FED_CHECK)?;
        anyhow::ensure!(
            fed == host,
            "greedy decode fed on the device FAILED: {fed:?} where the host loop gives {host:?}"
        );
        eprintln!("fed decode: {FED_CHECK} tokens equal to the host loop's");
    }

    let bw = be.copy_bandwidth()?;
    let weight_bytes = weight_bytes_per_token(&model);
    // The cache type the model was loaded with (a q8_0 cache: 1.0625 bytes per element), in
    // the attention layers; a hybrid model's Gated DeltaNet layers instead read and write
    // their f32 state (conv and recurrent) once a token whatever the depth.
    let (n_attn_layers, state_bytes) = match &cfg.hybrid {
        Some(h) => {
            let (n_lin, n_attn) = h.counts();
            let d = h.delta;
            let state = d.conv_state_len() + d.recurrent_state_len();
            (n_attn, (2 * n_lin * state * 4) as u64)
        }
        None => (cfg.n_layers, 0),
    };
    let kv_per_pos = ((n_attn_layers * 2 * cfg.attn.n_kv_heads * cfg.attn.head_dim) as f64
        * be.kv_bytes_per_element())
    .round() as u64;
    let depth = a.depth;
    let fill = bench_tokens(depth, cfg.vocab, 11);
    let prompt = bench_tokens(a.prompt_tokens, cfg.vocab, 13);

    // Speculation's test decodes from the same start as the decode test: the fill, then the
    // prompt's first token. Its reference (gate 3) is plain greedy decode from there.
    let spec_prompt: Vec<u32> = fill.iter().chain(&prompt[..1]).copied().collect();
    let truth = if spec_depth > 0 {
        ferrite_engine::speculative::plain_greedy(
            be,
            &model,
            &spec_prompt,
            a.gen_tokens + spec_depth + 2,
        )?
    } else {
        vec![]
    };
    let right = a.draft_right.unwrap_or(spec_depth);
    let mut sp = Vec::new();
    let mut spec_stats = ferrite_engine::SpecStats::default();

    let n_batch = a.batch as usize;
    // The batched test's first tokens: the decode test's, then others from the prompt.
    let batch_first: Vec<u32> = (0..n_batch)
        .map(|i| {
            prompt[i % prompt.len()].wrapping_add((i / prompt.len()) as u32) % cfg.vocab as u32
        })
        .collect();
    let mut bt = Vec::new();

    let mut pp = Vec::new();
    let mut tg = Vec::new();
    for _ in 0..a.reps {
        if n_batch > 0 {
            bt.push(batched_decode(
                be,
                &model,
                ctx,
                &fill,
                &batch_first,
                a.gen_tokens,
            )?);
        }
        if spec_depth > 0 {
            use ferrite_engine::speculative::{Drafter, MtpDrafter, ScriptedDrafter};
            let mut scripted = ScriptedDrafter {
                truth: truth.clone(),
                prompt_len: spec_prompt.len(),
                right,
                vocab: cfg.vocab,
                run_head: loaded,
            };
            let drafter: &mut dyn Drafter<B> = if head { &mut MtpDrafter } else { &mut scripted };
            let (tps, st) = speculative_decode(
                be,
                &model,
                ctx,
                &spec_prompt,
                &truth,
                (spec_depth, drafter),
                a.gen_tokens,
            )?;
            sp.push(tps);
            spec_stats = st;
        }
        // Prefill test: fill the cache to `depth` (untimed), then time the prompt.
        let mut seq = Sequence::new(be, &model, ctx)?;
        if !fill.is_empty() {
            seq.prefill(&fill)?;
            // Launches are asynchronous: wait for the fill, or its tail is timed below.
            seq.greedy()?;
        }
        let t0 = Instant::now();
        seq.prefill(&prompt)?;
        seq.greedy()?; // waits for the device
        pp.push(a.prompt_tokens as f64 / t0.elapsed().as_secs_f64());

        // Decode test: greedy, token by token, from `depth`.
        let mut seq = Sequence::new(be, &model, ctx)?;
        if !fill.is_empty() {
            seq.prefill(&fill)?;
        }
        // The first two steps (eager, then captured as a graph) are not timed; the reads wait
        // for the device, so the fill and those steps are done before t0 (timing from an
        // asynchronous fill under-reported decode at depth: 182 vs 280 tok/s at depth 8192).
        let t0 = if a.feed_chunk > 0 {
            let mut tok = *seq
                .greedy_chain(prompt[0], 2)?
                .last()
                .context("an empty greedy chain")?;
            let t0 = Instant::now();
            let mut left = a.gen_tokens;
            while left > 0 {
                let n = left
                    .min(a.feed_chunk)
                    .min(ferrite_engine::generate::FEED_LOG);
                tok = *seq
                    .greedy_chain(tok, n)?
                    .last()
                    .context("an empty greedy chain")?;
                left -= n;
            }
            t0
        } else {
            seq.decode(prompt[0])?;
            let tok = seq.greedy()?;
            seq.decode(tok)?;
            let mut tok = seq.greedy()?;
            let t0 = Instant::now();
            for _ in 0..a.gen_tokens {
                seq.decode(tok)?;
                tok = seq.greedy()?;
            }
            t0
        };
        tg.push(a.gen_tokens as f64 / t0.elapsed().as_secs_f64());
    }
    let (pp, tg) = (median(pp), median(tg));
    let sp = (spec_depth > 0).then(|| median(sp));
    let bt = (n_batch > 0).then(|| median(bt));
    let vram_used_gib = be
        .device_memory()
        .map(|(used, _)| used as f64 / (1u64 << 30) as f64);
    // Average KV bytes read per decode token over the generated span (and the linear
    // layers' state).
    let kv_bytes = kv_per_pos * (depth as u64 + a.gen_tokens as u64 / 2) + state_bytes;
    let bytes_tg = weight_bytes + kv_bytes;
    let device = be.device_name();
    let date = utc_now();
    let kv_cache = a.model.kv_cache_q8.then_some("q8_0");
    let mut records = vec![
        Record {
            date: date.clone(),
            git_sha: env!("FERRITE_GIT_SHA"),
            gpu: device.clone(),
            engine: "ferrite",
            backend: be.name(),
            model: label.clone(),
            quant: quant.clone(),
            test: format!("pp{}", a.prompt_tokens),
            depth,
            tokens_per_s: pp,
            achieved_gb_s: None,
            roofline_pct: None,
            bytes_per_token: None,
            copy_bandwidth_gb_s: bw / 1e9,
            vram_used_gib,
            reps: a.reps,
            gate_tokens: gate_prompt.len(),
            kv_cache,
            context: a.context,
            decode_loop: None,
        },
        Record {
            date,
            git_sha: env!("FERRITE_GIT_SHA"),
            gpu: device,
            engine: "ferrite",
            backend: be.name(),
            model: label,
            quant,
            test: format!("tg{}", a.gen_tokens),
            depth,
            tokens_per_s: tg,
            achieved_gb_s: Some(tg * bytes_tg as f64 / 1e9),
            roofline_pct: Some(100.0 * tg * bytes_tg as f64 / bw),
            bytes_per_token: Some(bytes_tg),
            copy_bandwidth_gb_s: bw / 1e9,
            vram_used_gib,
            reps: a.reps,
            gate_tokens: gate_prompt.len(),
            kv_cache,
            context: a.context,
            decode_loop: Some(if a.feed_chunk > 0 {
                format!("fed {}", a.feed_chunk)
            } else {
                "host".into()
            }),
        },
    ];
    // Speculation's record: the decode test's, but its own speed; several tokens per verify
    // step means bytes per token are not one pass over the weights each.
    let spec_record = sp.map(|sp| Record {
        test: format!("tg{}-mtp{spec_depth}", a.gen_tokens),
        tokens_per_s: sp,
        achieved_gb_s: None,
        roofline_pct: None,
        bytes_per_token: None,
        decode_loop: Some(format!(
            "speculative, {}: {}/{} drafts accepted, {:.2} tokens per verify (last rep)",
            if head {
                "MTP head".to_string()
            } else {
                format!(
                    "scripted drafts, {right} of {spec_depth} right{}",
                    if loaded {
                        ", the head run for its cost"
                    } else {
                        ""
                    }
                )
            },
            spec_stats.accepted,
            spec_stats.drafted,
            spec_stats.tokens_per_step()
        )),
        ..records[1].clone()
    });
    records.extend(spec_record);
    // The batched test's record: all sequences' tokens per second; a step reads the weights
    // once and every sequence's cache and state (dense models: a MoE step's experts depend on
    // the rows' routing, so its bytes are not known here).
    let batch_record = bt.map(|bt| {
        let steps = bt / n_batch as f64;
        let bytes_step = (cfg.moe.is_none()).then(|| weight_bytes + n_batch as u64 * kv_bytes);
        Record {
            test: format!("tg{}-b{n_batch}", a.gen_tokens),
            tokens_per_s: bt,
            achieved_gb_s: bytes_step.map(|b| steps * b as f64 / 1e9),
            roofline_pct: bytes_step.map(|b| 100.0 * steps * b as f64 / bw),
            bytes_per_token: None,
            decode_loop: Some(format!(
                "batched, {n_batch} sequences a step (serve's step), every row's greedy choice \
                 read a step"
            )),
            ..records[1].clone()
        }
    });
    records.extend(batch_record);
    if a.json {
        for r in &records {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        println!(
            "{} {} on {} ({}), depth {}, median of {} reps",
            records[0].model, records[0].quant, records[0].gpu, records[0].backend, depth, a.reps
        );
        println!(
            "copy bandwidth {:.1} GB/s; decode reads {:.1} MB/token{}",
            bw / 1e9,
            bytes_tg as f64 / 1e6,
            vram_used_gib.map_or(String::new(), |g| format!(
                "; device memory in use {g:.2} GiB"
            ))
        );
        println!(
            "{:<12} {:>12} {:>12} {:>10}",
            "test", "tokens/s", "GB/s", "roofline"
        );
        for r in &records {
            println!(
                "{:<12} {:>12.1} {:>12} {:>10}",
                r.test,
                r.tokens_per_s,
                r.achieved_gb_s.map_or("-".into(), |v| format!("{v:.1}")),
                r.roofline_pct.map_or("-".into(), |v| format!("{v:.1}%"))
            );
        }
    }
    if a.record {
        if let Some(dir) = a.results.parent() {
            std::fs::create_dir_all(dir).ok();
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&a.results)
            .with_context(|| format!("opening {}", a.results.display()))?;
        for r in &records {
            writeln!(f, "{}", serde_json::to_string(r)?)?;
        }
        eprintln!(
            "recorded {} results in {}",
            records.len(),
            a.results.display()
        );
    }
    Ok(())
}

/// The speculative decode test: `prompt` prefilled, one untimed step (its kernels size
/// their scratch then), then `gen` tokens timed, speculating `depth` deep with `drafter`.
/// Its tokens must be `truth`'s, plain greedy decode's (gate 3). Tokens/s and the counts.
fn speculative_decode<B: Backend>(
    be: &B,
    model: &ferrite_models::Model<B>,
    ctx: usize,
    prompt: &[u32],
    truth: &[u32],
    (depth, drafter): (usize, &mut dyn ferrite_engine::speculative::Drafter<B>),
    gen: usize,
) -> Result<(f64, ferrite_engine::SpecStats)> {
    let mut seq = Sequence::new(be, model, ctx)?;
    let mut spec = ferrite_engine::Speculator::new(be, model, depth)?;
    let mut out = vec![spec.prefill(&mut seq, prompt)?];
    // What a drafter may look up: the prompt and the output so far.
    let mut history: Vec<u32> = prompt.iter().chain(&out).copied().collect();
    let mut t0 = None;
    let mut end = gen + 1;
    while out.len() < end {
        let room = (end - out.len()).min(ctx - seq.pos);
        let got = spec.step(&mut seq, drafter, &history, out[out.len() - 1], room)?;
        history.extend(&got);
        out.extend(got);
        if t0.is_none() {
            // The clock starts after the first step.
            t0 = Some(Instant::now());
            end = out.len() + gen;
        }
    }
    let tps = gen as f64 / t0.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let n = out.len().min(truth.len());
    anyhow::ensure!(
        out[..n] == truth[..n],
        "gate 3 FAILED: speculative decode (depth {depth}) gave {:?} where plain greedy \
         decode gives {:?}",
        &out[..n],
        &truth[..n]
    );
    Ok((tps, spec.stats))
}

/// The current UTC time as ISO 8601 (no time-zone crate needed for UTC).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
