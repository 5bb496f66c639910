//! The serving scheduler: continuous batching at the iteration level over one [`Engine`].
//!
//! A dedicated thread owns the engine and runs the loop; requests arrive on a channel and
//! each request's results go back through its own [`EventSink`]. Every loop iteration:
//!
//! ```text
//! intake      take every request that arrived (block only when there is nothing to do)
//! reap        drop requests whose client went away: sequence and KV pages freed at once
//! admit       move waiting requests into the running batch while there is a batch slot
//!             and KV pages for their prompt (otherwise they wait: never a crash)
//! plan        every running sequence past its prompt brings one decode row (a sequence
//!             that cannot get a page for it preempts the newest running sequence); the
//!             sequences still prefilling bring chunks of at most `prefill_chunk` prompt
//!             tokens in total, so a long prompt cannot stall the decodes for more than one
//!             chunk
//! step        ONE batched backend step runs all those rows (decode rows first, then the
//!             prefill chunks); every sequence whose rows ended at a new token samples it
//! ```
//!
//! **KV pages.** KV memory is budgeted in fixed-size pages (`page_size` tokens) out of a
//! global pool; each sequence has a block table of page ids, grown as the sequence grows.
//! When the pool runs dry, admission waits, and a running sequence that needs a page takes
//! it by preempting the most recently admitted sequence (vLLM's recompute preemption): its
//! pages and KV are freed and it is requeued at the head of the queue, to be re-prefilled
//! with its prompt plus the tokens it had generated, after which it continues where it was
//! (the next token after a resume comes from prefill logits instead of a decode step).
//!
//! **Batched steps.** The page ids are real: the backend's KV cache is one paged pool
//! ([`Batch`]: `Backend::kv_new_paged`) and each sequence's block table is its `pages`. Each
//! iteration runs one backend step whose rows come from every runnable sequence (matmuls,
//! norms and FFNs see all rows at once; attention reads each row's own sequence through its
//! block table). Pure decode steps are captured as graphs per batch size on backends that
//! have them. Hybrid (linear-attention) models also keep state that is not in pages: the
//! batch holds a pool of `max_batch` such states, and every running sequence holds one slot
//! of it (taken and cleared at admission, given back when it finishes or is preempted). A
//! speculating hybrid model (and any model on a backend without paged caches) runs every
//! sequence with its own contiguous cache and steps (`Sequence`) instead, with the same
//! plan and the same pages accounting: a batched verify has no way to roll one sequence's
//! state back past its rejected drafts.
//!
//! **Determinism.** Each sequence's computation is independent of the others: every op is
//! row-wise but attention, which reads only the row's own sequence in position order; its
//! own sampler and RNG; prefill chunk boundaries that depend only on the sequence itself
//! (chunk `k` covers prompt positions `[k·C, (k+1)·C)` whatever else is running). A greedy
//! request therefore gives the same tokens served in a busy batch as served alone (on the
//! CPU bitwise the same logits: `crates/models/tests/batch.rs`); the tests assert it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use anyhow::{ensure, Result};
use ferrite_backend::{Backend, SeqRows};
use ferrite_models::TOP_K_MAX;
use ferrite_tokenizer::{IncrementalDecoder, Tokenizer};

use crate::batch::{Batch, BatchConfig};
use crate::generate::{Engine, FinishReason, Sequence};
use crate::json_mode::{self, JsonState, Schema};
use crate::pages::{PagePool, PrefixHit};
use crate::sampler::{argmax, Sampler, SamplerConfig, StopCheck, StopChecker};
use crate::speculative::{
    accept_greedy, accept_sampled, Drafter, MtpDrafter, PromptLookup, Speculator,
};

/// Scheduler limits, fixed at start-up.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most sequences in the running batch.
    pub max_batch: usize,
    /// Longest sequence (prompt + generated) a request may reach.
    pub max_context: usize,
    /// KV budget in tokens (rounded up to whole pages; at least `max_context`, so that a
    /// request alone always fits).
    pub kv_tokens: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Most prompt tokens prefilled per loop iteration (all sequences together).
    pub prefill_chunk: usize,
    /// Most requests waiting for admission; more are refused ([`SubmitError::QueueFull`]).
    pub max_waiting: usize,
    /// Speculative decoding with the model's MTP head, this many drafts a step (0 = off;
    /// the head must be loaded). Requests with logprobs or penalties decode without it.
    pub mtp_depth: usize,
    /// Speculative decoding with prompt-lookup drafts ([`PromptLookup`]: n-gram matches in
    /// the prompt and the output so far), up to this many a step (0 = off); any model, in
    /// batched steps too. Not together with `mtp_depth`. Requests with logprobs or
    /// penalties decode without it.
    pub lookup_depth: usize,
    /// Keep the keys and values of full KV pages for later requests that start with the same
    /// tokens ([`crate::pages`]: automatic prefix caching); their prefill then starts after
    /// the cached pages. Hybrid models resume from a Gated DeltaNet state saved where a
    /// cached page ends ([`crate::pages`]); idle cached pages are evicted before any request
    /// waits for pages.
    pub prefix_cache: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_batch: 8,
            max_context: 4096,
            kv_tokens: 8 * 4096,
            page_size: 16,
            prefill_chunk: 256,
            max_waiting: 64,
            mtp_depth: 0,
            lookup_depth: 0,
            prefix_cache: true,
        }
    }
}

impl SchedulerConfig {
    /// Most drafts a speculative step verifies (0: no speculation).
    fn spec_depth(&self) -> usize {
        self.mtp_depth.max(self.lookup_depth)
    }
}

/// What to generate for one request.
#[derive(Clone, Debug)]
pub struct RequestParams {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation ends before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// `Some(k)`: report the log-probability of every generated token and of the `k` most
    /// likely alternatives (raw model distribution, before penalties and temperature).
    pub logprobs: Option<usize>,
    /// JSON output: held to one object of this schema ([`crate::json_mode`]: `json_object`
    /// is [`Schema::any_object`]); sampled from host logits, without speculation.
    pub json: Option<Arc<Schema>>,
}

impl Default for RequestParams {
    fn default() -> Self {
        RequestParams {
            max_tokens: 256,
            sampler: SamplerConfig::greedy(),
            stop: vec![],
            ignore_eos: false,
            logprobs: None,
            json: None,
        }
    }
}

/// Log-probability of a generated token and of the most likely alternatives (best first).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache (not prefilled).
    pub cached_tokens: usize,
}

/// What a request's sink receives, in order: `Token`s, then exactly one `Done` or `Error`.
#[derive(Clone, Debug)]
pub enum Event {
    /// One generated token. `text` is the text that became final with it (often empty: an
    /// incomplete character or a possible start of a stop string is held back).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The end. `text` is the final text not yet sent in `Token` events.
    Done {
        finish: FinishReason,
        text: String,
        usage: Usage,
    },
    Error(String),
}

/// Where a request's events go. `send` returns `false` when the client has gone away; the
/// request is then dropped at once.
pub trait EventSink: Send + 'static {
    fn send(&mut self, ev: Event) -> bool;
    /// Whether the client has gone away (checked every iteration, also while waiting).
    fn is_closed(&self) -> bool {
        false
    }
}

impl EventSink for mpsc::Sender<Event> {
    fn send(&mut self, ev: Event) -> bool {
        mpsc::Sender::send(self, ev).is_ok()
    }
}

/// One generation request.
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: RequestParams,
    pub sink: Box<dyn EventSink>,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// The waiting queue is full: try again later.
    QueueFull,
    /// Prompt + `max_tokens` exceeds `max_context` (or the prompt is empty).
    Invalid(String),
    /// The scheduler thread has stopped.
    Stopped,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::QueueFull => f.write_str("the server is at capacity; retry later"),
            SubmitError::Invalid(m) => f.write_str(m),
            SubmitError::Stopped => f.write_str("the scheduler has stopped"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// Live numbers for monitoring (updated by the scheduler thread every iteration).
#[derive(Debug, Default)]
pub struct Stats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub kv_pages_used: AtomicUsize,
    pub kv_pages_total: AtomicUsize,
    pub preemptions: AtomicU64,
    /// Prompt tokens prefilled, re-prefills after preemption included.
    pub prefill_tokens: AtomicU64,
    /// Decode rows (one generated token of one sequence each).
    pub decode_steps: AtomicU64,
    /// Backend steps (batched: one per iteration; per-sequence mode: one per sequence).
    pub steps: AtomicU64,
    /// Sequences summed over the backend steps (`step_seqs / steps`: the mean batch).
    pub step_seqs: AtomicU64,
    /// Most sequences one backend step has held.
    pub max_step_seqs: AtomicUsize,
    /// Whether steps are batched over a paged KV cache (false: one sequence per step).
    pub batched: std::sync::atomic::AtomicBool,
    /// Speculative decoding: draft tokens proposed by the MTP head and kept by the model.
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    /// Prefix cache: prompt tokens taken from cached pages instead of prefilled (re-prefills
    /// after preemption included), and the cached pages no sequence holds (evictable).
    pub prefix_hit_tokens: AtomicU64,
    pub kv_pages_cached: AtomicUsize,
    /// Whether the prefix cache is on.
    pub prefix_cache: std::sync::atomic::AtomicBool,
}

/// Handle to the scheduler thread. Dropping it (or [`Scheduler::shutdown`]) lets the thread
/// finish the requests it has and exit.
pub struct Scheduler {
    tx: Option<mpsc::Sender<Request>>,
    stats: Arc<Stats>,
    tok: Arc<Tokenizer>,
    cfg: SchedulerConfig,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the scheduler thread, which takes ownership of `engine`. `cfg.max_context` is
    /// capped at the model's context; `cfg.kv_tokens` is raised to at least `max_context`.
    pub fn spawn<B: Backend + 'static>(engine: Engine<B>, cfg: SchedulerConfig) -> Result<Self>
    where
        Engine<B>: Send,
    {
        let mut cfg = cfg;
        ensure!(cfg.max_batch > 0, "max_batch must be at least 1");
        ensure!(cfg.page_size > 0, "page_size must be at least 1");
        ensure!(cfg.prefill_chunk > 0, "prefill_chunk must be at least 1");
        // Every request waits in the queue before it joins the batch: 0 would refuse all.
        ensure!(cfg.max_waiting > 0, "max_waiting must be at least 1");
        // One prompt token and one generated token.
        ensure!(cfg.max_context >= 2, "max_context must be at least 2");
        cfg.max_context = cfg.max_context.min(engine.model.cfg.max_ctx);
        ensure!(
            cfg.mtp_depth <= crate::speculative::MAX_DEPTH
                && cfg.lookup_depth <= crate::speculative::MAX_DEPTH,
            "a draft depth must be 0 (off) to {}",
            crate::speculative::MAX_DEPTH
        );
        ensure!(
            cfg.mtp_depth == 0 || cfg.lookup_depth == 0,
            "speculative decoding drafts with the MTP head or by prompt lookup, not both"
        );
        ensure!(
            cfg.mtp_depth == 0 || engine.model.has_mtp(),
            "speculative decoding needs the model's MTP head loaded"
        );
        ensure!(
            cfg.spec_depth() == 0 || cfg.prefill_chunk <= crate::generate::PREFILL_CHUNK,
            "with speculative decoding the prefill chunk must be at most {} tokens",
            crate::generate::PREFILL_CHUNK
        );
        if cfg.kv_tokens < cfg.max_context {
            tracing::warn!(
                "KV budget of {} tokens is below the context of {}; raised to it",
                cfg.kv_tokens,
                cfg.max_context
            );
            cfg.kv_tokens = cfg.max_context;
        }
        let Engine { be, model, tok } = engine;
        let tok = Arc::new(tok);
        let stats = Arc::new(Stats::default());
        let (tx, rx) = mpsc::channel();
        let pages = PagePool::new(cfg.kv_tokens.div_ceil(cfg.page_size), cfg.page_size);
        stats.kv_pages_total.store(pages.total(), Ordering::Relaxed);
        let (tok2, stats2, cfg2) = (tok.clone(), stats.clone(), cfg.clone());
        let cfg2_max_batch = cfg.max_batch;
        let thread = std::thread::Builder::new()
            .name("ferrite-scheduler".into())
            .spawn(move || {
                let batch = batch_for(&be, &model, &cfg2, pages.total());
                stats2.batched.store(batch.is_some(), Ordering::SeqCst);
                // Pages are real only in batched steps; a hybrid model's prefix cache also needs
                // the states saved where cached pages end.
                let pages = match &batch {
                    Some(b) if cfg2.prefix_cache => match model.cfg.hybrid {
                        Some(_) => pages.with_states(b.config().state_snapshots),
                        None => pages.with_prefix_cache(),
                    },
                    _ => pages,
                };
                stats2
                    .prefix_cache
                    .store(pages.caches_prefixes(), Ordering::SeqCst);
                let mut l = Loop {
                    be: &be,
                    model: &model,
                    tok: &tok2,
                    cfg: cfg2,
                    stats: stats2,
                    pages,
                    batch,
                    waiting: VecDeque::new(),
                    running: Vec::new(),
                    free_states: (0..cfg2_max_batch).rev().collect(),
                    next_id: 0,
                };
                l.run(rx);
            })?;
        Ok(Scheduler {
            tx: Some(tx),
            stats,
            tok,
            cfg,
            thread: Some(thread),
        })
    }

    /// Queues a request. Fails at once when the waiting queue is full or the request can
    /// never fit.
    pub fn submit(&self, req: Request) -> std::result::Result<(), SubmitError> {
        let n = req.prompt.len();
        if n == 0 {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if req.params.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        if n.saturating_add(req.params.max_tokens) > self.cfg.max_context {
            return Err(SubmitError::Invalid(format!(
                "the prompt is {n} tokens and max_tokens is {}, but the context is {} tokens",
                req.params.max_tokens, self.cfg.max_context
            )));
        }
        let waiting = self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.cfg.max_waiting {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull);
        }
        let tx = self.tx.as_ref().ok_or(SubmitError::Stopped)?;
        tx.send(req).map_err(|_| {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Stopped
        })
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tok
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// The configuration in effect (after capping).
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Stops taking requests, lets the running ones finish and joins the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The batched step over a paged cache for this model and backend, or `None` (speculating
/// hybrid models, backends without paged caches, or no memory for it): one sequence per
/// step then.
fn batch_for<'e, B: Backend>(
    be: &'e B,
    model: &'e ferrite_models::Model<B>,
    cfg: &SchedulerConfig,
    n_pages: usize,
) -> Option<Batch<'e, B>> {
    if model.cfg.hybrid.is_some() && cfg.spec_depth() > 0 {
        // A verify's rejected drafts would have advanced the sequence's linear-attention
        // state past them; per sequence, the speculator rolls that back (row states), a
        // batched step has no such rollback. Hybrid models speculate one sequence a step.
        return None;
    }
    // Every running sequence may verify its drafts in a step (lookup drafts; an MTP head's
    // model, a hybrid one, does not batch while it speculates).
    let per_seq = 1 + cfg.lookup_depth;
    let bc = BatchConfig {
        n_pages,
        page_size: cfg.page_size,
        max_pages: cfg.max_context.div_ceil(cfg.page_size),
        max_seqs: cfg.max_batch,
        max_rows: cfg.prefill_chunk + cfg.max_batch * per_seq,
        max_logits: cfg.max_batch * per_seq,
        // A hybrid model's prefix cache resumes from saved states: a running sequence saves
        // one at each prompt chunk end and one rolling one, fewer where pages are shared
        // (the least recently used reused first).
        state_snapshots: if model.cfg.hybrid.is_some() && cfg.prefix_cache {
            3 * cfg.max_batch
        } else {
            0
        },
    };
    match Batch::new(be, model, bc) {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!("batched steps unavailable ({e:#}): one sequence per step");
            None
        }
    }
}

/// One request inside the scheduler, waiting or running.
struct Active<'e, B: Backend> {
    /// Admission order (lower = older); preemption takes the highest.
    id: u64,
    prompt_len: usize,
    params: RequestParams,
    sink: Box<dyn EventSink>,
    /// Per-sequence mode: `None` while waiting (never admitted, or preempted). Batched mode:
    /// always `None` (the KV lives in the batch's pages).
    seq: Option<Sequence<'e, B>>,
    /// Batched mode, while running: the batch's state slot it holds ([`SeqRows::state`]: a
    /// hybrid model's linear-attention state; every running sequence holds one).
    state: Option<usize>,
    /// Whether its decode steps speculate (a draft depth set, no logprobs, no penalties).
    speculates: bool,
    /// Speculative decoding's state in per-sequence mode; made with `seq`. (Batched steps
    /// verify lookup drafts without one.)
    spec: Option<Speculator<'e, B>>,
    /// New tokens the next speculative step may give: its drafts plus one (pages reserved).
    room: usize,
    /// Tokens in the KV cache.
    cached: usize,
    /// Its first pages registered in the prefix cache (taken from it at admission, or
    /// registered as they filled), and the registration to chain the next one from.
    prefix: PrefixHit,
    /// Prompt tokens that came from the prefix cache at its first admission (usage; `None`
    /// before it: a later admission, after a preemption, finds pages it computed itself).
    cached_prompt: Option<usize>,
    /// A hybrid model's prefix cache: the page whose saved state this sequence moves along
    /// as it passes page boundaries past its prompt's (its prompt's own stays).
    rolling_state: Option<u32>,
    /// Context the sequence's KV is allocated for.
    ctx: usize,
    /// Tokens to prefill: the prompt, plus the generated tokens after a preemption.
    feed: Vec<u32>,
    prefilled: usize,
    /// Sampled but not yet in the KV cache (decoded next step).
    pending: Option<u32>,
    pages: Vec<u32>,
    generated: Vec<u32>,
    sampler: Sampler,
    stops: StopChecker,
    detok: IncrementalDecoder,
    text: String,
    emitted: usize,
    /// JSON output: its schema and the output so far, as the reader has read it.
    json: Option<(Arc<Schema>, JsonState)>,
}

/// What became of a sequence after a step.
enum Outcome {
    Continue,
    /// Finished or failed; the sink has had its last event (or is gone).
    Remove,
}

struct Loop<'e, B: Backend> {
    be: &'e B,
    model: &'e ferrite_models::Model<B>,
    tok: &'e Tokenizer,
    cfg: SchedulerConfig,
    stats: Arc<Stats>,
    pages: PagePool,
    /// The batched step (`None`: one sequence per step, each with its own `Sequence`).
    batch: Option<Batch<'e, B>>,
    /// The batch's state slots no running sequence holds (`max_batch` in all: a running
    /// sequence always finds one).
    free_states: Vec<usize>,
    waiting: VecDeque<Active<'e, B>>,
    /// In admission order: the last one is the newest.
    running: Vec<Active<'e, B>>,
    next_id: u64,
}

impl<'e, B: Backend> Loop<'e, B> {
    fn run(&mut self, rx: mpsc::Receiver<Request>) {
        loop {
            // Intake: block only when idle.
            if self.running.is_empty() && self.waiting.is_empty() {
                self.publish();
                match rx.recv() {
                    Ok(r) => self.enqueue(r),
                    Err(_) => return,
                }
            }
            while let Ok(r) = rx.try_recv() {
                self.enqueue(r);
            }
            self.reap();
            self.admit();
            self.step();
            self.publish();
        }
    }

    fn publish(&self) {
        let s = &self.stats;
        s.running.store(self.running.len(), Ordering::Relaxed);
        s.kv_pages_used.store(self.pages.used(), Ordering::Relaxed);
        s.kv_pages_cached
            .store(self.pages.cached_idle(), Ordering::Relaxed);
    }

    fn enqueue(&mut self, r: Request) {
        let vocab = self.model.cfg.vocab;
        let ctx = r.prompt.len() + r.params.max_tokens;
        self.waiting.push_back(Active {
            id: 0,
            prompt_len: r.prompt.len(),
            sampler: Sampler::new(r.params.sampler.clone(), vocab),
            stops: StopChecker::new(r.params.stop.iter().cloned()),
            json: r.params.json.clone().map(|s| (s, JsonState::default())),
            params: r.params,
            sink: r.sink,
            seq: None,
            state: None,
            speculates: false,
            spec: None,
            room: 1,
            cached: 0,
            prefix: PrefixHit::NONE,
            cached_prompt: None,
            rolling_state: None,
            ctx,
            feed: r.prompt,
            prefilled: 0,
            pending: None,
            pages: Vec::new(),
            generated: Vec::new(),
            detok: IncrementalDecoder::new(true),
            text: String::new(),
            emitted: 0,
        });
    }

    /// Drops requests whose client has gone away.
    fn reap(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|a| !a.sink.is_closed());
        let gone = before - self.waiting.len();
        self.stats.waiting.fetch_sub(gone, Ordering::SeqCst);
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].sink.is_closed() {
                self.remove(i);
            } else {
                i += 1;
            }
        }
    }

    fn remove(&mut self, i: usize) {
        let mut a = self.running.remove(i);
        self.pages.release(&mut a.pages);
        self.free_states.extend(a.state.take());
    }

    /// Waiting requests join the batch, oldest first, while there is a slot and pages for
    /// their whole prefill.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_batch {
            let Some(a) = self.waiting.front_mut() else {
                break;
            };
            // Cached pages of its prefix first (at least its last token is prefilled: its
            // logits give the next token), then pages for the rest of its prefill.
            let ps = self.pages.page_size();
            let reusable = (a.feed.len() - 1) / ps * ps;
            if self.pages.caches_prefixes()
                && prefix_in_flight(&a.feed[..reusable], ps, &self.running)
            {
                // A running sequence is prefilling pages this one could take from the cache
                // (`n` choices of one prompt, requests sharing a system prompt that arrived
                // together): wait for them rather than compute them twice.
                break;
            }
            a.prefix = self.pages.lookup(&mut a.pages, &a.feed[..reusable]);
            if !self.pages.grow(&mut a.pages, a.feed.len()) {
                self.pages.release(&mut a.pages);
                a.prefix = PrefixHit::NONE;
                break;
            }
            let mut a = self.waiting.pop_front().expect("front exists");
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            // Batched: a state slot, cleared (the sequence starts from its first token).
            let seq = match &mut self.batch {
                Some(batch) => match self.free_states.pop() {
                    Some(slot) => {
                        a.state = Some(slot);
                        // A hybrid model's state after the cached pages, or the first one.
                        match a.prefix.state {
                            Some(snap) => batch.load_state(snap as usize, slot),
                            None => batch.clear_state(slot),
                        }
                        .map(|()| None)
                    }
                    None => Err(anyhow::anyhow!("no free state slot in the batch")),
                },
                None => Sequence::new(self.be, self.model, a.ctx).map(Some),
            };
            let speculates = self.cfg.spec_depth() > 0
                && a.params.logprobs.is_none()
                && a.params.sampler.no_penalties()
                && a.json.is_none();
            let seq = seq.and_then(|seq| {
                let spec = match (speculates, &seq) {
                    (true, Some(_)) => Some(Speculator::with_chunk(
                        self.be,
                        self.model,
                        self.cfg.spec_depth(),
                        self.cfg.prefill_chunk,
                    )?),
                    _ => None,
                };
                Ok((seq, spec))
            });
            match seq {
                Ok((seq, spec)) => {
                    a.seq = seq;
                    a.speculates = speculates;
                    a.spec = spec;
                    a.cached = a.prefix.pages * self.pages.page_size();
                    a.prefilled = a.cached;
                    a.cached_prompt.get_or_insert(a.cached);
                    self.stats
                        .prefix_hit_tokens
                        .fetch_add(a.cached as u64, Ordering::Relaxed);
                    a.id = self.next_id;
                    self.next_id += 1;
                    self.running.push(a);
                }
                Err(e) => {
                    a.sink
                        .send(Event::Error(format!("allocating the sequence: {e:#}")));
                    self.pages.release(&mut a.pages);
                    a.prefix = PrefixHit::NONE;
                    self.free_states.extend(a.state.take());
                }
            }
        }
    }

    /// Gives running sequence `i` a page for its pending token, preempting the newest
    /// sequences while the pool is dry. Returns whether `i` is still running (at index `i`).
    /// A speculating sequence gets room for its drafts too where the pool has it (otherwise
    /// its step drafts nothing: `room` 1).
    fn reserve_decode_page(&mut self, i: usize) -> bool {
        let a = &mut self.running[i];
        a.room = 1;
        if a.speculates {
            let left = a.params.max_tokens.saturating_sub(a.generated.len());
            let room = (self.cfg.spec_depth() + 1)
                .min(left)
                .min(a.ctx - a.cached)
                .max(1);
            if self.pages.grow(&mut a.pages, a.cached + room) {
                a.room = room;
                return true;
            }
        }
        loop {
            let a = &mut self.running[i];
            if self.pages.grow(&mut a.pages, a.cached + 1) {
                return true;
            }
            let victim = self.running.len() - 1;
            if victim == 0 {
                // Alone and out of pages: cannot happen with kv_tokens ≥ max_context, but end
                // the request rather than loop.
                let outcome = finish(&mut self.running[i], self.tok, FinishReason::Length);
                debug_assert!(matches!(outcome, Outcome::Remove));
                self.remove(i);
                return false;
            }
            self.preempt(victim);
            if victim == i {
                return false;
            }
        }
    }

    /// A batched step's drafts for running sequence `a`'s decode rows: prompt lookup where
    /// it speculates (per-sequence mode drafts inside its `Speculator` step instead).
    fn lookup_drafts(&self, a: &Active<'e, B>) -> Vec<u32> {
        if self.batch.is_none() || !a.speculates || a.room < 2 {
            return Vec::new();
        }
        PromptLookup::default().lookup(&history(a), a.room - 1)
    }

    /// The rows of this iteration's step: a decode row for every sequence with a pending
    /// token (pages reserved), then up to `prefill_chunk` prompt tokens over the sequences
    /// still prefilling, oldest first, in chunks whose boundaries depend only on the sequence.
    fn plan(&mut self) -> Vec<Planned> {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].pending.is_none() || self.reserve_decode_page(i) {
                i += 1;
            }
        }
        let mut plan: Vec<Planned> = (0..self.running.len())
            .filter(|&i| self.running[i].pending.is_some())
            .map(|i| Planned {
                i,
                prefill: None,
                drafts: self.lookup_drafts(&self.running[i]),
            })
            .collect();
        let c = self.cfg.prefill_chunk;
        let mut budget = c;
        for (i, a) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if a.pending.is_some() || a.prefilled >= a.feed.len() {
                continue;
            }
            let start = a.prefilled;
            let mut end = ((start / c + 1) * c).min(a.feed.len());
            if self.pages.saves_states() {
                // A hybrid model's prefix cache resumes only where a state was saved: end a
                // chunk on the prompt's last page boundary (it depends only on the prompt),
                // and where the cached pages it found stopped matching (the end of a prefix
                // it shares with an earlier prompt, which saved no state there: the next
                // prompts sharing it resume at its end, not at the chunk end before it).
                let ps = self.pages.page_size();
                for boundary in [(a.feed.len() - 1) / ps * ps, a.prefix.matched * ps] {
                    if start < boundary && boundary < end {
                        end = boundary;
                    }
                }
            }
            if end - start > budget {
                break;
            }
            budget -= end - start;
            plan.push(Planned {
                i,
                prefill: Some((start, end)),
                drafts: Vec::new(),
            });
        }
        plan
    }

    /// One iteration's step: every planned row through the backend (one batched step, or one
    /// step per sequence without a batch), then a token sampled for every sequence whose
    /// rows reached a new position.
    fn step(&mut self) {
        let plan = self.plan();
        if plan.is_empty() {
            return;
        }
        let n_decode = plan.iter().filter(|p| p.prefill.is_none()).count();
        let n_prefill: usize = plan
            .iter()
            .filter_map(|p| p.prefill.map(|(s, e)| e - s))
            .sum();
        let st = &self.stats;
        st.prefill_tokens
            .fetch_add(n_prefill as u64, Ordering::Relaxed);
        st.decode_steps
            .fetch_add(n_decode as u64, Ordering::Relaxed);

        // Run the rows. `failed[j]`: planned entry j's error (the whole step's, if batched);
        // `spoken[j]`: the tokens a speculative step gave entry j.
        let mut failed: Vec<Option<String>> = vec![None; plan.len()];
        let mut spoken: Vec<Option<Vec<u32>>> = vec![None; plan.len()];
        match &mut self.batch {
            Some(batch) => {
                // A decode row's tokens: the pending one, then its drafts (a verify, every
                // row's logits wanted).
                let verify: Vec<Vec<u32>> = plan
                    .iter()
                    .map(|p| {
                        let a = &self.running[p.i];
                        a.pending.iter().chain(&p.drafts).copied().collect()
                    })
                    .collect();
                let rows: Vec<SeqRows<'_>> = plan
                    .iter()
                    .zip(&verify)
                    .map(|(p, v)| {
                        let a = &self.running[p.i];
                        let (tokens, logits) = match p.prefill {
                            Some((s, e)) => (&a.feed[s..e], 1),
                            None => (&v[..], v.len().max(1)),
                        };
                        SeqRows {
                            tokens,
                            pos0: a.cached,
                            pages: &a.pages,
                            logits,
                            state: a
                                .state
                                .expect("running sequences of a batch hold a state slot"),
                        }
                    })
                    .collect();
                st.steps.fetch_add(1, Ordering::Relaxed);
                st.step_seqs.fetch_add(plan.len() as u64, Ordering::Relaxed);
                st.max_step_seqs.fetch_max(plan.len(), Ordering::Relaxed);
                if let Err(e) = batch.step(&rows) {
                    tracing::error!("batched step failed: {e:#}");
                    failed.fill(Some(format!("{e:#}")));
                } else {
                    // Verified drafts: the tokens each such sequence keeps.
                    for (j, p) in plan.iter().enumerate() {
                        if p.drafts.is_empty() {
                            continue;
                        }
                        let a = &mut self.running[p.i];
                        match accept_batched(batch, j, a, &p.drafts) {
                            Ok(out) => {
                                st.spec_drafted
                                    .fetch_add(p.drafts.len() as u64, Ordering::Relaxed);
                                st.spec_accepted
                                    .fetch_add(out.len() as u64 - 1, Ordering::Relaxed);
                                spoken[j] = Some(out);
                            }
                            Err(e) => failed[j] = Some(format!("{e:#}")),
                        }
                    }
                }
            }
            None => {
                for (j, p) in plan.iter().enumerate() {
                    let a = &mut self.running[p.i];
                    // What a speculative step's drafter may look up.
                    let hist = match (&a.spec, p.prefill) {
                        (Some(_), None) => history(a),
                        _ => Vec::new(),
                    };
                    let seq = a.seq.as_mut().expect("running sequences have a sequence");
                    let r = match (p.prefill, a.pending, &mut a.spec) {
                        // The head catches up on every chunk but the last, whose next token
                        // is sampled below.
                        (Some((s, e)), _, spec) => {
                            seq.prefill(&a.feed[s..e])
                                .and_then(|()| match (spec, a.feed.get(e)) {
                                    (Some(sp), Some(&next)) => {
                                        sp.after_prefill_chunk(seq, &a.feed[s..e], s, next)
                                    }
                                    _ => Ok(()),
                                })
                        }
                        (None, Some(t), Some(sp)) => {
                            let before = sp.stats;
                            let mut lookup = PromptLookup::default();
                            let drafter: &mut dyn Drafter<B> = match self.cfg.mtp_depth {
                                0 => &mut lookup,
                                _ => &mut MtpDrafter,
                            };
                            let out = if a.params.sampler.temperature <= 0.0 {
                                sp.step(seq, drafter, &hist, t, a.room)
                            } else {
                                sp.step_sampled(seq, drafter, &mut a.sampler, &hist, t, a.room)
                            };
                            st.spec_drafted.fetch_add(
                                (sp.stats.drafted - before.drafted) as u64,
                                Ordering::Relaxed,
                            );
                            st.spec_accepted.fetch_add(
                                (sp.stats.accepted - before.accepted) as u64,
                                Ordering::Relaxed,
                            );
                            out.map(|out| spoken[j] = Some(out))
                        }
                        (None, Some(t), None) => seq.decode(t),
                        (None, None, _) => Ok(()),
                    };
                    st.steps.fetch_add(1, Ordering::Relaxed);
                    st.step_seqs.fetch_add(1, Ordering::Relaxed);
                    st.max_step_seqs.fetch_max(1, Ordering::Relaxed);
                    if let Err(e) = r {
                        failed[j] = Some(format!("{e:#}"));
                    }
                }
            }
        }

        // Advance and sample, then drop the finished (highest index first).
        let mut gone = Vec::new();
        for (j, p) in plan.iter().enumerate() {
            let a = &mut self.running[p.i];
            if let Some(e) = &failed[j] {
                tracing::error!("generation failed: {e}");
                a.sink.send(Event::Error(e.clone()));
                gone.push(p.i);
                continue;
            }
            if let Some(out) = spoken[j].take() {
                // A speculative step: the pending token and the kept drafts went into the
                // cache; its tokens are handled in order until one ends the request.
                a.cached += out.len();
                a.pending = None;
                self.stats
                    .decode_steps
                    .fetch_add(out.len() as u64 - 1, Ordering::Relaxed);
                for t in out {
                    if let Outcome::Remove = on_token(a, self.tok, t, None) {
                        gone.push(p.i);
                        break;
                    }
                }
                continue;
            }
            let sample = match p.prefill {
                Some((s, e)) => {
                    a.cached += e - s;
                    a.prefilled = e;
                    e == a.feed.len()
                }
                None => {
                    a.cached += 1;
                    a.pending = None;
                    true
                }
            };
            if !sample {
                continue;
            }
            let outcome = match (&mut self.batch, a.seq.take()) {
                (Some(batch), _) => match batch.rows_of(j) {
                    Ok(rows) => sample_next(
                        a,
                        self.tok,
                        &mut BatchRow {
                            batch,
                            row: rows.end - 1,
                        },
                    ),
                    Err(e) => fail(a, &e),
                },
                (None, Some(mut seq)) => {
                    let mut o = sample_next(a, self.tok, &mut seq);
                    // The prompt's last chunk: the head catches up on it with the token
                    // just sampled.
                    if let (Outcome::Continue, Some(sp), Some((s, e)), Some(t)) =
                        (&o, &mut a.spec, p.prefill, a.pending)
                    {
                        if let Err(err) = sp.after_prefill_chunk(&mut seq, &a.feed[s..e], s, t) {
                            o = fail(a, &err);
                        }
                    }
                    a.seq = Some(seq);
                    o
                }
                (None, None) => fail(a, &anyhow::anyhow!("a running sequence without a cache")),
            };
            if let Outcome::Remove = outcome {
                gone.push(p.i);
            }
        }
        // Pages the step filled join the prefix cache (those of finished sequences too: a
        // conversation's next turn starts with them).
        if self.pages.caches_prefixes() {
            for (j, p) in plan.iter().enumerate() {
                if failed[j].is_none() {
                    let a = &mut self.running[p.i];
                    register_filled(&mut self.pages, a);
                    if let Some(batch) = self.batch.as_mut() {
                        save_boundary_state(&mut self.pages, batch, a);
                    }
                }
            }
        }
        gone.sort_unstable();
        for &i in gone.iter().rev() {
            self.remove(i);
        }
    }

    /// Frees running sequence `i` and puts it at the head of the queue, to be re-prefilled
    /// with everything it has so far.
    fn preempt(&mut self, i: usize) {
        let mut a = self.running.remove(i);
        self.pages.release(&mut a.pages);
        a.prefix = PrefixHit::NONE;
        a.rolling_state = None;
        self.free_states.extend(a.state.take());
        a.seq = None;
        a.spec = None;
        a.cached = 0;
        a.feed.truncate(a.prompt_len);
        a.feed.extend_from_slice(&a.generated);
        a.prefilled = 0;
        a.pending = None;
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        tracing::debug!("preempted a sequence of {} tokens", a.feed.len());
        self.waiting.push_front(a);
    }
}

/// One entry of an iteration's plan: running sequence `i`, with a decode row (its pending
/// token) or the prefill chunk `feed[start..end]`.
#[derive(Clone, Debug)]
struct Planned {
    i: usize,
    prefill: Option<(usize, usize)>,
    /// A decode row's drafts to verify in the same step (batched prompt lookup).
    drafts: Vec<u32>,
}

/// Whether a sequence of `running` is still to register (prefill) full pages that spell the
/// start of `tokens` (whole pages of a waiting sequence's feed that it could take from the
/// prefix cache).
fn prefix_in_flight<B: Backend>(tokens: &[u32], ps: usize, running: &[Active<'_, B>]) -> bool {
    running.iter().any(|r| {
        let shared = tokens
            .chunks_exact(ps)
            .zip(r.feed.chunks_exact(ps))
            .take_while(|(a, b)| a == b)
            .count();
        shared > r.prefix.pages
    })
}

/// Registers sequence `a`'s pages whose positions all hold computed keys and values (below
/// `a.cached`) in the prefix cache, in order, chaining each to the one before.
fn register_filled<B: Backend>(pool: &mut PagePool, a: &mut Active<'_, B>) {
    let ps = pool.page_size();
    // Its tokens: the prompt, then what it generated (a re-prefill's feed is the same).
    let known = a.prompt_len + a.generated.len();
    let full = (a.cached.min(known) / ps).min(a.pages.len());
    while a.prefix.pages < full {
        let j = a.prefix.pages;
        let tokens: Vec<u32> = (j * ps..(j + 1) * ps)
            .map(|p| match p.checked_sub(a.prompt_len) {
                None => a.feed[p],
                Some(g) => a.generated[g],
            })
            .collect();
        let (id, page) = pool.register(a.pages[j], a.prefix.parent, &tokens);
        a.prefix.parent = id;
        a.prefix.parent_page = Some(page);
        a.prefix.pages += 1;
    }
}

/// A hybrid model's prefix cache: where sequence `a`'s cached tokens end on a page boundary
/// and the registered page ending there has no state saved, saves the sequence's
/// linear-attention state there for later sequences to resume from. Each boundary within
/// the prompt (its chunk ends, its last page boundary) gets a snapshot of its own (where a
/// shared system prompt may end); every boundary past it (a decode step's) moves the
/// sequence's one rolling snapshot forward (a conversation's next turn resumes from the
/// last).
fn save_boundary_state<B: Backend>(
    pool: &mut PagePool,
    batch: &mut Batch<'_, B>,
    a: &mut Active<'_, B>,
) {
    // Its registered pages end exactly where its cached tokens do (none registered: no page).
    if !pool.saves_states() || a.prefix.pages * pool.page_size() != a.cached {
        return;
    }
    let (Some(page), Some(slot)) = (a.prefix.parent_page, a.state) else {
        return;
    };
    // Boundaries inside the prompt (its chunk ends, its last page boundary) each keep a state
    // of their own: a shared prefix's end is known only to the next prompt that shares it
    // (`plan` cuts a chunk there), and a page two prompts share has one state for both. Past
    // the prompt, one rolling state follows the decode.
    let in_prompt = a.cached <= a.feed.len();
    let snap = match a.rolling_state {
        Some(old) if !in_prompt => pool
            .move_state(old, page)
            .or_else(|| pool.state_slot_for(page)),
        _ => pool.state_slot_for(page),
    };
    let Some(snap) = snap else {
        return;
    };
    if !in_prompt {
        a.rolling_state = Some(page);
    }
    if let Err(e) = batch.save_state(slot, snap as usize) {
        // Nothing may resume from a snapshot that was not written.
        tracing::error!("saving a prefix state failed: {e:#}");
        pool.forget_state(page);
    }
}

/// The text a sequence's drafter may look up: its prompt and what it has generated (the
/// pending token last).
fn history<B: Backend>(a: &Active<'_, B>) -> Vec<u32> {
    a.feed[..a.prompt_len]
        .iter()
        .chain(&a.generated)
        .copied()
        .collect()
}

/// The tokens sequence `a` (entry `j` of the last batched step) keeps of its verified
/// `drafts`: greedy acceptance, or speculative sampling with the lookup's q all on each
/// draft.
fn accept_batched<B: Backend>(
    batch: &mut Batch<'_, B>,
    j: usize,
    a: &mut Active<'_, B>,
    drafts: &[u32],
) -> Result<Vec<u32>> {
    let rows = batch.rows_of(j)?;
    ensure!(
        rows.len() == drafts.len() + 1,
        "a verify of {} drafts came back with {} logits rows",
        drafts.len(),
        rows.len()
    );
    if a.params.sampler.temperature <= 0.0 {
        let choices = rows.map(|r| batch.greedy(r)).collect::<Result<Vec<_>>>()?;
        return Ok(accept_greedy(drafts, &choices));
    }
    let mut logits = Vec::new();
    for r in rows {
        logits.extend(batch.logits(r)?);
    }
    let hist = history(a);
    Ok(accept_sampled(
        &mut a.sampler,
        &logits,
        batch.vocab(),
        drafts,
        &PromptLookup::q(drafts),
        &hist,
    ))
}

/// Where a sequence's latest logits are: its own workspace, or a row of the batched step.
trait NextLogits {
    fn greedy(&mut self) -> Result<u32>;
    fn top_k(&mut self, k: usize) -> Result<Vec<(u32, f32)>>;
    fn logits(&mut self) -> Result<Vec<f32>>;
}

impl<B: Backend> NextLogits for Sequence<'_, B> {
    fn greedy(&mut self) -> Result<u32> {
        Sequence::greedy(self)
    }
    fn top_k(&mut self, k: usize) -> Result<Vec<(u32, f32)>> {
        Sequence::top_k(self, k)
    }
    fn logits(&mut self) -> Result<Vec<f32>> {
        Sequence::logits(self)
    }
}

/// Row `row` of the last batched step.
struct BatchRow<'a, 'e, B: Backend> {
    batch: &'a mut Batch<'e, B>,
    row: usize,
}

impl<B: Backend> NextLogits for BatchRow<'_, '_, B> {
    fn greedy(&mut self) -> Result<u32> {
        self.batch.greedy(self.row)
    }
    fn top_k(&mut self, k: usize) -> Result<Vec<(u32, f32)>> {
        self.batch.top_k(self.row, k)
    }
    fn logits(&mut self) -> Result<Vec<f32>> {
        self.batch.logits(self.row)
    }
}

/// Samples the next token of `a` from its latest logits and handles it.
fn sample_next<B: Backend>(
    a: &mut Active<'_, B>,
    tok: &Tokenizer,
    src: &mut dyn NextLogits,
) -> Outcome {
    let p = &a.params.sampler;
    let no_penalties = p.no_penalties();
    // The device's choice where the raw logits decide (no logprobs, penalties or JSON mask).
    let device = a.params.logprobs.is_none() && no_penalties && a.json.is_none();
    let sampled = if device && p.temperature <= 0.0 {
        src.greedy().map(|t| (t, None))
    } else if device && (1..=TOP_K_MAX).contains(&p.top_k) {
        let k = p.top_k;
        src.top_k(k).map(|c| (a.sampler.sample_top_k(&c), None))
    } else {
        src.logits().and_then(|mut logits| {
            let raw = a
                .params
                .logprobs
                .map(|k| (log_softmax_top(&logits, k), logits.clone()));
            if let Some((schema, js)) = &a.json {
                let left = json_mode::mask(js, schema, tok, a.params.ignore_eos, &mut logits);
                anyhow::ensure!(
                    left > 0,
                    "no token of the vocabulary continues the JSON output"
                );
            }
            let t = if p.temperature <= 0.0 && no_penalties {
                argmax(&logits)
            } else {
                // Penalties see the generated tokens only (OpenAI semantics).
                a.sampler.sample(&mut logits, &a.generated)
            };
            let lp = raw.map(|((lse, top), raw)| TokenLogprob {
                logprob: raw[t as usize] - lse,
                top,
            });
            Ok((t, lp))
        })
    };
    match sampled {
        Err(e) => fail(a, &e),
        Ok((t, lp)) => on_token(a, tok, t, lp),
    }
}

/// `(logsumexp, k best (id, logprob))` of a logit vector.
fn log_softmax_top(logits: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < k || l > top[top.len() - 1].1 {
                let at = top.partition_point(|&(_, v)| v >= l);
                top.insert(at, (i as u32, l));
                top.truncate(k);
            }
        }
    }
    (lse, top.into_iter().map(|(i, l)| (i, l - lse)).collect())
}

fn fail<B: Backend>(a: &mut Active<'_, B>, e: &anyhow::Error) -> Outcome {
    tracing::error!("generation failed: {e:#}");
    a.sink.send(Event::Error(format!("{e:#}")));
    Outcome::Remove
}

/// Handles a freshly sampled token: stop conditions, text, events.
fn on_token<B: Backend>(
    a: &mut Active<'_, B>,
    tok: &Tokenizer,
    t: u32,
    logprob: Option<TokenLogprob>,
) -> Outcome {
    a.generated.push(t);
    if let Some((schema, js)) = &mut a.json {
        // The mask let only continuations through (end-of-sequence has no bytes to read).
        if !tok.is_special(t) {
            let ok = tok.token_bytes(t).iter().all(|&b| js.feed(schema, b));
            debug_assert!(ok, "a token past the JSON mask");
        }
    }
    let eos = !a.params.ignore_eos && tok.eos_ids().contains(&t);
    let mut stop = eos;
    let mut delta = String::new();
    if !eos {
        a.text.push_str(&a.detok.push(tok, t));
        match a.stops.check(&a.text) {
            StopCheck::Stop { len, .. } => {
                a.text.truncate(len);
                stop = true;
            }
            StopCheck::Continue { safe_len } => {
                if safe_len > a.emitted {
                    delta = a.text[a.emitted..safe_len].to_string();
                    a.emitted = safe_len;
                }
            }
        }
    }
    if !a.sink.send(Event::Token {
        id: t,
        text: delta,
        logprob,
    }) {
        return Outcome::Remove;
    }
    if stop {
        return finish(a, tok, FinishReason::Stop);
    }
    let pos = a.prompt_len + a.generated.len() - 1;
    if a.generated.len() >= a.params.max_tokens || pos >= a.ctx {
        return finish(a, tok, FinishReason::Length);
    }
    a.pending = Some(t);
    Outcome::Continue
}

/// Sends the final event.
fn finish<B: Backend>(a: &mut Active<'_, B>, _tok: &Tokenizer, finish: FinishReason) -> Outcome {
    if finish == FinishReason::Length {
        a.text.push_str(&a.detok.flush());
        if let StopCheck::Stop { len, .. } = a.stops.check(&a.text) {
            a.text.truncate(len);
        }
    }
    let text = a.text.get(a.emitted..).unwrap_or("").to_string();
    a.emitted = a.text.len();
    a.sink.send(Event::Done {
        finish,
        text,
        usage: Usage {
            prompt_tokens: a.prompt_len,
            completion_tokens: a.generated.len(),
            cached_tokens: a.cached_prompt.unwrap_or(0),
        },
    });
    Outcome::Remove
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_top_is_normalized_and_sorted() {
        let logits = [1.0f32, 3.0, 2.0, -1.0];
        let (lse, top) = log_softmax_top(&logits, 2);
        let total: f32 = logits.iter().map(|l| (l - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!(top[0].1 > top[1].1);
    }
}
