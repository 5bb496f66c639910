//! One sequence, start to finish: prompt prefill, token-by-token decode, sampling, stop
//! conditions, streaming text out. Also the prefill/decode argmax gate.

use std::time::Instant;

use anyhow::{ensure, Context, Result};
use ferrite_backend::Backend;
use ferrite_models::{Logits, Model, Workspace, TOP_K_MAX};
use ferrite_tokenizer::{IncrementalDecoder, Tokenizer};

use crate::sampler::{argmax, Sampler, SamplerConfig, StopCheck, StopChecker};
use crate::speculative::{Drafter, MtpDrafter, PromptLookup, SpecStats, Speculator};

/// A model, the backend it lives on, and its tokenizer.
pub struct Engine<B: Backend> {
    pub be: B,
    pub model: Model<B>,
    pub tok: Tokenizer,
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation ends before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Context length to allocate; `None` = prompt + max_tokens, capped at the model's.
    pub context: Option<usize>,
    /// Speculative decoding with the model's MTP head, this many draft tokens a step
    /// (0 = off; no repetition, presence or frequency penalty; the head must be loaded,
    /// [`Model::load_mtp`]).
    pub mtp_depth: usize,
    /// Speculative decoding with n-gram drafts from the text so far
    /// ([`crate::speculative::PromptLookup`]), up to this many a step (0 = off; not with
    /// `mtp_depth`, nor with penalties). Any model.
    pub lookup_depth: usize,
}

impl GenerateParams {
    /// The checks that need no model: at least one token to generate, sampling parameters in
    /// range ([`SamplerConfig::validate`]). [`Engine::context_for`] makes them too; a caller
    /// can make them before loading a model.
    pub fn validate(&self) -> Result<()> {
        self.sampler.validate()?;
        ensure!(self.max_tokens > 0, "max_tokens must be at least 1");
        let max = crate::speculative::MAX_DEPTH;
        for (what, d) in [("MTP", self.mtp_depth), ("lookup", self.lookup_depth)] {
            ensure!(
                d <= max,
                "the {what} draft depth must be 0 (off) to {max}, not {d}"
            );
        }
        ensure!(
            self.mtp_depth == 0 || self.lookup_depth == 0,
            "drafts come from the MTP head or from lookup, not both"
        );
        ensure!(
            self.mtp_depth + self.lookup_depth == 0 || self.sampler.no_penalties(),
            "speculative decoding does not take a repetition, presence or frequency penalty"
        );
        Ok(())
    }

    /// The speculation asked for: its depth, where its drafts come from (a name for logs,
    /// and the drafter), or `None` when off.
    pub fn speculation<B: Backend>(&self) -> Option<(usize, &'static str, Box<dyn Drafter<B>>)> {
        match (self.mtp_depth, self.lookup_depth) {
            (0, 0) => None,
            (0, k) => Some((k, "lookup", Box::new(PromptLookup::default()))),
            (k, _) => Some((k, "MTP", Box::new(MtpDrafter))),
        }
    }
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            sampler: SamplerConfig::greedy(),
            stop: vec![],
            ignore_eos: false,
            context: None,
            mtp_depth: 0,
            lookup_depth: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` (or the context) ran out.
    Length,
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated token ids (the end-of-generation token included, if one ended it).
    pub tokens: Vec<u32>,
    /// Generated text, stop string and end token excluded.
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Seconds spent on the prompt (one batched forward) and on the decode steps.
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Speculative decoding's counts, when it ran.
    pub spec: Option<SpecStats>,
}

impl Generation {
    /// Decode speed in tokens/s (steps after the first token, which prefill produced).
    pub fn decode_tps(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        if self.decode_s > 0.0 {
            steps as f64 / self.decode_s
        } else {
            0.0
        }
    }
    pub fn prefill_tps(&self) -> f64 {
        if self.prefill_s > 0.0 {
            self.prompt_tokens as f64 / self.prefill_s
        } else {
            0.0
        }
    }
}

/// The prefill/decode gate: the argmax of the last position after a batched prefill must
/// equal the argmax after feeding the same prompt one token at a time through the decode
/// step (the graph-replayed path where the backend has graphs).
pub fn gate<B: Backend>(be: &B, model: &Model<B>, prompt: &[u32]) -> Result<GateResult> {
    let mut s = Sequence::new(be, model, prompt.len())?;
    s.prefill(prompt)?;
    let pre = s.logits()?;
    let mut s = Sequence::new(be, model, prompt.len())?;
    for &t in prompt {
        s.decode(t)?;
    }
    let dec = s.logits()?;
    let max_abs_diff = pre
        .iter()
        .zip(&dec)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let (prefill_argmax, decode_argmax) = (argmax(&pre), argmax(&dec));
    Ok(GateResult {
        prefill_argmax,
        decode_argmax,
        max_abs_diff,
        prefill_gap: pre[prefill_argmax as usize] - pre[decode_argmax as usize],
    })
}

/// The greedy tokens of `n` decode steps after `prompt`, token by token (decode, then the
/// argmax read back: the host loop) and fed on the device ([`Sequence::greedy_chain`]: a chain
/// of 2, its eager step and its capture, then chains of [`FEED_CHUNK`], as
/// [`Engine::generate`] runs them). Both run the same decode kernels, so they must be equal
/// (`ferrite bench` checks it on every model it measures).
pub fn fed_and_host_tokens<B: Backend>(
    be: &B,
    model: &Model<B>,
    prompt: &[u32],
    n: usize,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let ctx = prompt.len() + n + 1;
    let mut a = Sequence::new(be, model, ctx)?;
    a.prefill(prompt)?;
    let mut tok = a.greedy()?;
    let mut host = vec![];
    for _ in 0..n {
        a.decode(tok)?;
        tok = a.greedy()?;
        host.push(tok);
    }
    let mut b = Sequence::new(be, model, ctx)?;
    b.prefill(prompt)?;
    let mut tok = b.greedy()?;
    let mut fed = vec![];
    while fed.len() < n {
        let k = b.feed_chunk().min(n - fed.len());
        let t = b.greedy_chain(tok, k)?;
        tok = *t
            .last()
            .ok_or_else(|| anyhow::anyhow!("an empty greedy chain"))?;
        fed.extend(t);
    }
    Ok((fed, host))
}

/// Outcome of the prefill/decode gate.
#[derive(Clone, Copy, Debug)]
pub struct GateResult {
    pub prefill_argmax: u32,
    pub decode_argmax: u32,
    /// Largest absolute difference between the two last-position logit vectors.
    pub max_abs_diff: f32,
    /// How far below the prefill's best logit the prefill ranks the decode's argmax (0 when
    /// they agree). A failure with a gap under `max_abs_diff` is a near-tie decided by
    /// rounding; one far above it is a real disagreement. Diagnostic only: the gate stays
    /// exact.
    pub prefill_gap: f32,
}

impl GateResult {
    pub fn passed(&self) -> bool {
        self.prefill_argmax == self.decode_argmax
    }

    /// One line for logs and errors: both argmaxes, the gap when they differ, max |Δlogit|.
    pub fn describe(&self) -> String {
        if self.passed() {
            format!(
                "prefill argmax {} == decode argmax {}, max |Δlogit| {:.2e}",
                self.prefill_argmax, self.decode_argmax, self.max_abs_diff
            )
        } else {
            format!(
                "prefill argmax {} != decode argmax {} (the prefill ranks the decode's token \
                 {:.2e} below its own), max |Δlogit| {:.2e}",
                self.prefill_argmax, self.decode_argmax, self.prefill_gap, self.max_abs_diff
            )
        }
    }
}

/// Prompts are prefilled in chunks of at most this many tokens (bounds the workspace).
pub const PREFILL_CHUNK: usize = 512;

/// Where the decode step stands with graph capture.
pub(crate) enum GraphState<G> {
    /// Next step runs eagerly (the first one).
    Eager,
    /// Next step is captured.
    Capture,
    Replay(G),
    /// The backend has no graphs.
    Unsupported,
}

impl<G> GraphState<G> {
    /// Runs `step` as the decode step runs: eagerly the first time (kernels size their
    /// scratch buffers then), captured as a graph the second where the backend has graphs
    /// (and replayed at once: a capture records the step, it does not run it), replayed every
    /// later time. A replay runs none of the step's host-side bookkeeping (an activation's
    /// row count, say): the caller redoes what it reads of that.
    pub(crate) fn run<B: Backend<Graph = G>>(
        &mut self,
        be: &B,
        step: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        match self {
            GraphState::Eager => {
                step()?;
                *self = GraphState::Capture;
            }
            GraphState::Capture => match be.capture(step)? {
                Some(g) => {
                    be.replay(&g)?;
                    *self = GraphState::Replay(g);
                }
                // No graphs on this backend: `capture` ran the step; keep running eagerly.
                None => *self = GraphState::Unsupported,
            },
            GraphState::Replay(g) => be.replay(g)?,
            GraphState::Unsupported => step()?,
        }
        Ok(())
    }
}

/// Entries of a sequence's greedy token log ([`Sequence::greedy_chain`]): a ring indexed by
/// position, so one chain reads at most this many tokens.
pub const FEED_LOG: usize = 256;

/// Decode steps a greedy generation runs between reads of its tokens ([`Engine::generate`]
/// once its fed step is a graph, `ferrite bench`'s default): each read waits for the device
/// and leaves it idle until the next chain is launched (~20-30 µs on the H200), once per chain
/// instead of once per token. A chain may run past an end token or stop string by at most
/// this many steps less one, whose tokens are dropped; text streams out in pieces of up to
/// this many tokens.
pub const FEED_CHUNK: usize = 8;

/// The greedy decode step with its token fed back on the device (`Backend::argmax_feed` at
/// its end), captured as its own graph, and the log its tokens go to.
struct FeedStep<B: Backend> {
    graph: GraphState<B::Graph>,
    log: B::IBuf,
}

/// One sequence's state on the backend: its KV cache, a prefill workspace, and a one-row
/// decode workspace whose step is captured as a graph once and replayed for every token.
pub struct Sequence<'e, B: Backend> {
    be: &'e B,
    model: &'e Model<B>,
    pub(crate) kv: B::Kv,
    /// Positions the cache holds.
    ctx: usize,
    prefill: Option<Workspace<B>>,
    decode: Workspace<B>,
    graph: GraphState<B::Graph>,
    feed: Option<FeedStep<B>>,
    /// Tokens in the cache.
    pub pos: usize,
    /// Which workspace holds the latest logits.
    last_was_decode: bool,
}

impl<'e, B: Backend> Sequence<'e, B> {
    /// A sequence that can hold `ctx` tokens.
    pub fn new(be: &'e B, model: &'e Model<B>, ctx: usize) -> Result<Self> {
        let m = model;
        Ok(Sequence {
            be,
            model,
            kv: m.new_kv(be, ctx)?,
            ctx,
            prefill: None,
            decode: m.workspace(be, 1, Logits::Last)?,
            graph: GraphState::Eager,
            feed: None,
            pos: 0,
            last_was_decode: false,
        })
    }

    /// Appends `tokens` in one batched forward per chunk; logits of the last one follow.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        let (be, m) = (self.be, self.model);
        let mut pos = self.pos;
        let (ws, kv) = self.prefill_and_kv(tokens.len())?;
        for chunk in tokens.chunks(ws.capacity()) {
            be.set_step(&mut ws.step, chunk, pos)?;
            m.forward(be, ws, kv, Logits::Last)?;
            pos += chunk.len();
        }
        self.pos = pos;
        self.last_was_decode = false;
        Ok(())
    }

    /// The prefill workspace, made (or remade larger) for prompts of `n` tokens in chunks
    /// of at most [`PREFILL_CHUNK`], and the cache.
    pub(crate) fn prefill_and_kv(&mut self, n: usize) -> Result<(&mut Workspace<B>, &mut B::Kv)> {
        let (be, m) = (self.be, self.model);
        if self
            .prefill
            .as_ref()
            .is_none_or(|ws| ws.capacity() < n.min(PREFILL_CHUNK))
        {
            self.prefill = Some(m.workspace(be, n.clamp(1, PREFILL_CHUNK), Logits::Last)?);
        }
        let ws = self.prefill.as_mut().context("the prefill workspace")?;
        Ok((ws, &mut self.kv))
    }

    /// Appends one token with the decode step. The first step runs eagerly (kernels size
    /// their scratch buffers then); the second is captured as a graph where the backend has
    /// graphs, and every later step replays it: one launch per token.
    pub fn decode(&mut self, token: u32) -> Result<()> {
        let (be, m) = (self.be, self.model);
        be.set_step(&mut self.decode.step, &[token], self.pos)?;
        let (ws, kv) = (&mut self.decode, &mut self.kv);
        self.graph
            .run(be, &mut || m.forward(be, ws, kv, Logits::Last))?;
        self.pos += 1;
        self.last_was_decode = true;
        Ok(())
    }

    /// Greedy decoding with each token fed to the next step on the device: appends `token`
    /// and then the argmax of each step's logits, `n` steps in all, with no host round trip
    /// between them (`Backend::argmax_feed` at the end of the step, captured as a graph of
    /// its own after one eager step, as [`Sequence::decode`]'s). Returns the `n` argmaxes in
    /// order, read from the device once at the end; the last one is not appended (it is the
    /// next chain's `token`), and the latest logits are its step's.
    pub fn greedy_chain(&mut self, token: u32, n: usize) -> Result<Vec<u32>> {
        ensure!(
            (1..=FEED_LOG).contains(&n),
            "a greedy chain runs 1 to {FEED_LOG} steps, not {n}"
        );
        ensure!(
            self.pos + n <= self.ctx,
            "{n} decode steps from position {} pass the context of {} positions",
            self.pos,
            self.ctx
        );
        let (be, m) = (self.be, self.model);
        let p0 = self.pos;
        be.set_step(&mut self.decode.step, &[token], p0)?;
        let (ws, kv) = (&mut self.decode, &mut self.kv);
        let f = match &mut self.feed {
            Some(f) => f,
            slot => slot.insert(FeedStep {
                graph: GraphState::Eager,
                log: be.step_input(FEED_LOG)?.tokens,
            }),
        };
        let log = &mut f.log;
        let mut step = |ws: &mut Workspace<B>| -> Result<()> {
            m.forward(be, ws, kv, Logits::Last)?;
            be.argmax_feed(&ws.logits, &mut ws.argmax, &mut ws.step, log, FEED_LOG)
        };
        for _ in 0..n {
            f.graph.run(be, &mut || step(ws))?;
        }
        self.pos += n;
        self.last_was_decode = true;
        let log = be.read_i32(&f.log, FEED_LOG)?;
        (1..=n)
            .map(|i| Ok(u32::try_from(log[(p0 + i) % FEED_LOG])?))
            .collect()
    }

    /// Steps [`Engine::generate`] runs in its next greedy chain: [`FEED_CHUNK`] once the fed
    /// step replays as a graph; 2 before (its eager step and its capture); 1 where the backend
    /// has no graphs (every step runs from the host anyway, so a chain saves nothing and
    /// tokens stream out one at a time).
    pub fn feed_chunk(&self) -> usize {
        match self.feed.as_ref().map(|f| &f.graph) {
            Some(GraphState::Replay(_)) => FEED_CHUNK,
            Some(GraphState::Unsupported) => 1,
            None | Some(GraphState::Eager | GraphState::Capture) => 2,
        }
    }

    fn ws(&mut self) -> &mut Workspace<B> {
        match (&mut self.prefill, self.last_was_decode) {
            (Some(p), false) => p,
            _ => &mut self.decode,
        }
    }

    /// The latest logits on the host.
    pub fn logits(&mut self) -> Result<Vec<f32>> {
        let be = self.be;
        be.to_host(&self.ws().logits)
    }

    /// The `k ≤ TOP_K_MAX` best `(token, logit)` of the latest position, best first,
    /// selected on the device (k pairs cross to the host, not the vocabulary).
    pub fn top_k(&mut self, k: usize) -> Result<Vec<(u32, f32)>> {
        anyhow::ensure!(
            (1..=TOP_K_MAX).contains(&k),
            "top-k on the device needs 1 ≤ k ≤ {TOP_K_MAX}"
        );
        let be = self.be;
        let ws = self.ws();
        let mut vals = be.zeros(1, k)?;
        be.top_k(&ws.logits, k, &mut ws.top_ids, &mut vals)?;
        let ids = be.read_i32(&ws.top_ids, k)?;
        let vals = be.to_host(&vals)?;
        Ok(ids.into_iter().map(|i| i as u32).zip(vals).collect())
    }

    /// The greedy choice for the latest position, computed on the device (a 4-byte read).
    pub fn greedy(&mut self) -> Result<u32> {
        let be = self.be;
        let ws = self.ws();
        be.argmax(&ws.logits, &mut ws.argmax)?;
        Ok(be.read_i32(&ws.argmax, 1)?[0] as u32)
    }
}

impl<B: Backend> Engine<B> {
    /// Context length for a prompt of `n` tokens under `p`; the error a prompt that the
    /// context cannot hold (or an empty one, or sampling parameters out of range) gets from
    /// [`Engine::generate`], for callers that want it before other work.
    pub fn context_for(&self, n: usize, p: &GenerateParams) -> Result<usize> {
        p.validate()?;
        let max = self.model.cfg.max_ctx;
        let ctx = p.context.unwrap_or_else(|| (n + p.max_tokens).min(max));
        ensure!(n > 0, "the prompt is empty");
        ensure!(
            n < ctx,
            "the prompt is {n} tokens but the context is {ctx} tokens (the model supports {max}); shorten the prompt"
        );
        Ok(ctx)
    }

    /// The gate: the argmax of the last position after one batched prefill must equal the
    /// argmax after feeding the same prompt one token at a time.
    pub fn gate(&self, prompt: &[u32]) -> Result<GateResult> {
        gate(&self.be, &self.model, prompt)
    }

    /// Generates from `prompt`, calling `on_text` with each new piece of text as soon as it
    /// is final (never broken UTF-8, never part of a stop string).
    pub fn generate(
        &self,
        prompt: &[u32],
        p: &GenerateParams,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        let ctx = self.context_for(prompt.len(), p)?;
        let mut seq = Sequence::new(&self.be, &self.model, ctx)?;
        let mut sampler = Sampler::new(p.sampler.clone(), self.model.cfg.vocab);
        // Without penalties the logits need not cross to the host: greedy is an argmax on the
        // device, and top-k sampling needs only the k best, selected on the device.
        let no_penalties = p.sampler.no_penalties();
        let device_greedy = p.sampler.is_plain_greedy();
        ensure!(
            p.mtp_depth == 0 || self.model.has_mtp(),
            "speculative decoding needs the model's MTP head loaded"
        );
        let device_top_k = no_penalties && (1..=TOP_K_MAX).contains(&p.sampler.top_k);
        let mut stops = StopChecker::new(p.stop.iter().cloned());
        let mut detok = IncrementalDecoder::new(true);
        let eos = self.tok.eos_ids();

        let mut history: Vec<u32> = prompt.to_vec();
        let mut out = Generation {
            tokens: vec![],
            text: String::new(),
            finish: FinishReason::Length,
            prompt_tokens: prompt.len(),
            prefill_s: 0.0,
            decode_s: 0.0,
            spec: None,
        };
        let mut text = String::new();
        let mut emitted = 0;

        let t0 = Instant::now();
        // Speculation: its state, and where its drafts come from.
        let mut spec = match p.speculation::<B>() {
            None => None,
            Some((k, _, drafter)) => Some((Speculator::new(&self.be, &self.model, k)?, drafter)),
        };
        if spec.is_none() {
            seq.prefill(prompt)?;
        }
        let next =
            |seq: &mut Sequence<'_, B>, sampler: &mut Sampler, history: &[u32]| -> Result<u32> {
                if device_greedy {
                    seq.greedy()
                } else if device_top_k {
                    Ok(sampler.sample_top_k(&seq.top_k(p.sampler.top_k)?))
                } else {
                    Ok(sampler.sample(&mut seq.logits()?, history))
                }
            };
        let mut tok = match &mut spec {
            // Greedy first token on the device; a sampled one from the host's logits.
            Some((s, _)) if device_greedy => s.prefill(&mut seq, prompt)?,
            Some((s, _)) => {
                let be = &self.be;
                s.prefill_with(&mut seq, prompt, &mut |ws| {
                    Ok(sampler.sample(&mut be.to_host(&ws.logits)?, &history))
                })?
            }
            None => next(&mut seq, &mut sampler, &history)?,
        };
        out.prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        // Greedy on the device: the tokens after `tok` come from chains of decode steps fed
        // on the device (Sequence::greedy_chain), read feed_chunk() at a time; the queue holds
        // a chain's tokens not yet taken (those past a stop are never taken).
        let mut queue = std::collections::VecDeque::new();
        loop {
            out.tokens.push(tok);
            history.push(tok);
            if !p.ignore_eos && eos.contains(&tok) {
                out.finish = FinishReason::Stop;
                break;
            }
            text.push_str(&detok.push(&self.tok, tok));
            match stops.check(&text) {
                StopCheck::Stop { len, .. } => {
                    text.truncate(len);
                    out.finish = FinishReason::Stop;
                    break;
                }
                StopCheck::Continue { safe_len } => {
                    if safe_len > emitted {
                        on_text(&text[emitted..safe_len]);
                        emitted = safe_len;
                    }
                }
            }
            // The position the token-by-token loop would be at: a chain appends its queued
            // tokens ahead of their turn.
            if out.tokens.len() >= p.max_tokens || seq.pos - queue.len() >= ctx {
                break;
            }
            if let Some((s, drafter)) = &mut spec {
                // A speculative step: one verify of the drafts, 1..=depth+1 tokens.
                if queue.is_empty() {
                    let n = (p.max_tokens - out.tokens.len()).min(ctx - seq.pos);
                    queue.extend(if device_greedy {
                        s.step(&mut seq, &mut **drafter, &history, tok, n)?
                    } else {
                        s.step_sampled(&mut seq, &mut **drafter, &mut sampler, &history, tok, n)?
                    });
                }
                tok = queue
                    .pop_front()
                    .ok_or_else(|| anyhow::anyhow!("an empty speculative step"))?;
            } else if device_greedy {
                if queue.is_empty() {
                    // As many steps as the token-by-token loop could still take, at most a chunk.
                    let n = seq
                        .feed_chunk()
                        .min(p.max_tokens - out.tokens.len())
                        .min(ctx - seq.pos);
                    queue.extend(seq.greedy_chain(tok, n)?);
                }
                tok = queue
                    .pop_front()
                    .ok_or_else(|| anyhow::anyhow!("an empty greedy chain"))?;
            } else {
                seq.decode(tok)?;
                tok = next(&mut seq, &mut sampler, &history)?;
            }
        }
        out.decode_s = t1.elapsed().as_secs_f64();
        out.spec = spec.map(|(s, _)| s.stats);
        if out.finish == FinishReason::Length {
            text.push_str(&detok.flush());
            if let StopCheck::Stop { len, .. } = stops.check(&text) {
                text.truncate(len);
            }
        }
        if text.len() > emitted {
            on_text(&text[emitted..]);
        }
        out.text = text;
        Ok(out)
    }
}
