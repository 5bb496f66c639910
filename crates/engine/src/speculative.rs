//! Speculative decoding with the model's own MTP head ([`ferrite_models::mtp`]): greedy
//! ([`Speculator::step`]) and sampled ([`Speculator::step_sampled`], speculative sampling:
//! every token distributed as plain sampling would give it).
//!
//! One greedy step, from position `n` with the token `t` that goes there (not yet in the
//! cache):
//!
//! ```text
//! draft     d1 = the head's greedy choice after its row (h[n-1], t)      (already run)
//!           d(i+1) = head(its own draft hidden state, di) at position n-1+i, i = 1..k-1
//! verify    the target on [t, d1 .. dk] at positions n .. n+k, every row's argmax a0 .. ak
//! accept    j = the longest prefix with di = a(i-1); the new tokens are a0 .. aj
//! rollback  when j < k on a hybrid model: the linear-attention state becomes the one the
//!           verify left after row j (attention rows are addressed by position: the rejected
//!           ones are overwritten before anything reads them, so an attention-only model
//!           needs no rollback)
//! catch up  the head on (h[n+i], ai), i = 0..j, at positions n..n+j: its cache gets the
//!           target's true hidden states, and its last row drafts the next step's d1
//! ```
//!
//! Every emitted token is the target's argmax given the tokens before it, so the output is
//! the target's greedy output; the head only decides how many come per verify. That is the
//! contract `ferrite check`'s gate 3 tests: greedy output with depth K = 1..8 is
//! token-identical to plain greedy decode. It holds exactly where a step of several rows
//! computes each row as a one-row step does (the CPU backend); elsewhere rounding may
//! differ between the two shapes and a near-tie can flip, which the gate would show.
//!
//! **Graphs.** Where the backend has graphs, each forward of a step is captured once per
//! shape and replayed after, as the plain decode step is (`GraphState`): the target's
//! forward of r rows (a verify of r = k+1 rows, or a replay of r ≤ k), the head's catch-up
//! on the target's r hidden states, and its one-row chained draft. Tokens and positions are
//! device inputs written before each (`Backend::set_step`), every buffer they touch is the
//! speculator's or the sequence's own, and no launch depends on the position (the decode
//! attention's split count follows the cache's capacity), so a shape's graph serves every
//! step. The snapshot, restore and argmax reads stay eager. `FERRITE_SPEC_GRAPHS=0` runs
//! every forward eagerly (to measure what the graphs save).
//!
//! **Rollback.** Where the backend keeps per-row states (`Backend::kv_row_states`: the
//! verify's conv and delta-rule calls also leave the state after each of their rows in a
//! slot of its own), a rejection copies row j's state back (`kv_restore_row`): one copy of
//! the state, ~48 MB on Qwen3.5-9B, written k+1 times by each verify. Elsewhere, or with
//! `FERRITE_SPEC_REPLAY=1`, the state goes back to a snapshot taken before the verify and
//! [t, d1 .. dj] run again: one more forward of up to k rows, about one more decode step on
//! a bandwidth-bound GPU. Either way the head catches up on the first j+1 rows of the
//! verify's (or the replay's) hidden states.

use anyhow::{ensure, Context, Result};
use ferrite_backend::{Act, Backend};
use ferrite_models::{Logits, Model, Workspace};

use crate::generate::{GraphState, Sequence, PREFILL_CHUNK};
use crate::sampler::Sampler;

/// Deepest draft [`Speculator`] accepts (the gate tests 1..=MAX_DEPTH).
pub const MAX_DEPTH: usize = 8;

/// Counts of one generation's speculative steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Verify steps run.
    pub steps: usize,
    /// Draft tokens proposed and accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// Verify steps that rejected a draft on a hybrid model (its state rolled back).
    pub rollbacks: usize,
    /// Rollbacks that replayed the accepted rows (no per-row states kept).
    pub replays: usize,
}

impl SpecStats {
    /// Fraction of drafted tokens the target accepted.
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
    /// Tokens per verify step (accepted drafts plus the target's own token).
    pub fn tokens_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            (self.accepted + self.steps) as f64 / self.steps as f64
        }
    }
}

/// A probability distribution over token ids: `(id, probability)` pairs, summing to 1.
pub type Distribution = Vec<(u32, f64)>;

/// What a step asks its drafter for: up to `k` drafts after the token `t` at position `n`;
/// `history` is the prompt and output so far, `t` included.
#[derive(Clone, Copy, Debug)]
pub struct DraftAsk<'a> {
    pub n: usize,
    pub t: u32,
    pub k: usize,
    pub history: &'a [u32],
}

/// Where a draft comes from: the MTP head ([`MtpDrafter`]), n-gram lookup in the text so far
/// ([`PromptLookup`]); tests script their own to drive every acceptance length.
pub trait Drafter<B: Backend> {
    /// Up to `ask.k` draft tokens (fewer, or none, where the drafter has no guess). The
    /// head's first draft comes from the state [`Speculator`] left after its last catch-up.
    fn draft(
        &mut self,
        spec: &mut Speculator<'_, B>,
        kv: &mut B::Kv,
        ask: DraftAsk<'_>,
    ) -> Result<Vec<u32>>;

    /// Drafts for speculative sampling ([`Speculator::step_sampled`]): up to `ask.k`
    /// tokens, each with the distribution (`(id, probability)`, summing to 1) it was drawn
    /// from, given the history and the drafts before it.
    fn draft_sampled(
        &mut self,
        spec: &mut Speculator<'_, B>,
        kv: &mut B::Kv,
        ask: DraftAsk<'_>,
        sampler: &mut Sampler,
    ) -> Result<Vec<(u32, Distribution)>> {
        let _ = (spec, kv, ask, sampler);
        anyhow::bail!("this drafter drafts for greedy decoding only")
    }
}

/// The MTP head as the drafter (see the module docs).
pub struct MtpDrafter;

impl<B: Backend> Drafter<B> for MtpDrafter {
    fn draft(
        &mut self,
        spec: &mut Speculator<'_, B>,
        kv: &mut B::Kv,
        ask: DraftAsk<'_>,
    ) -> Result<Vec<u32>> {
        let (n, k) = (ask.n, ask.k);
        ensure!(spec.head_ready, "no draft pending: prefill first");
        let be = spec.be;
        let mut d = greedy(be, &mut spec.draft)?[0];
        let mut out = Vec::with_capacity(k);
        out.push(d);
        for i in 1..k {
            spec.chain(kv, d, n - 1 + i)?;
            d = greedy(be, &mut spec.draft)?[0];
            out.push(d);
        }
        Ok(out)
    }

    fn draft_sampled(
        &mut self,
        spec: &mut Speculator<'_, B>,
        kv: &mut B::Kv,
        ask: DraftAsk<'_>,
        sampler: &mut Sampler,
    ) -> Result<Vec<(u32, Distribution)>> {
        ensure!(
            spec.head_ready,
            "no draft pending: prefill first, with the MTP head loaded"
        );
        let be = spec.be;
        let mut out: Vec<(u32, Distribution)> = Vec::with_capacity(ask.k);
        let mut hist = ask.history.to_vec();
        for i in 0..ask.k {
            if let Some(&(d, _)) = out.last() {
                spec.chain(kv, d, ask.n - 1 + i)?;
            }
            let q = sampler.distribution(&mut be.to_host(&spec.draft.logits)?, &hist);
            let d = sampler.pick(&q);
            hist.push(d);
            out.push((d, q));
        }
        Ok(out)
    }
}

/// The head on the target's hidden states `hidden` paired with `tokens` (row i: the token
/// after hidden state i) at positions `start..`: its cache gets those rows, and its last
/// row's logits (the next step's first draft) land in `draft`.
fn catch_up<B: Backend>(
    be: &B,
    m: &Model<B>,
    draft: &mut Workspace<B>,
    hidden: &Act<B::Buf>,
    kv: &mut B::Kv,
    tokens: &[u32],
    start: usize,
) -> Result<()> {
    be.set_step(&mut draft.step, tokens, start)?;
    m.mtp_forward(be, draft, hidden, kv, Logits::Last)
}

fn greedy<B: Backend>(be: &B, ws: &mut Workspace<B>) -> Result<Vec<u32>> {
    be.argmax(&ws.logits, &mut ws.argmax)?;
    Ok(be
        .read_i32(&ws.argmax, ws.logits.rows)?
        .into_iter()
        .map(|t| t as u32)
        .collect())
}

/// A forward of the speculative step, by shape: what one graph records (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Pass {
    /// The target over r rows of the verify workspace (a verify, or a replay after one).
    Target(usize),
    /// The head over the target's r hidden states in the verify workspace.
    CatchUp(usize),
    /// The head's one-row chained draft.
    Chain,
}

/// The graph of `pass`, made on first use: eager for good where `eager` (then
/// [`GraphState::run`] runs the forward every time).
fn graph_of<G>(
    graphs: &mut std::collections::HashMap<Pass, GraphState<G>>,
    eager: bool,
    pass: Pass,
) -> &mut GraphState<G> {
    graphs.entry(pass).or_insert(if eager {
        GraphState::Unsupported
    } else {
        GraphState::Eager
    })
}

/// The state speculative decoding adds to a [`Sequence`]: the head's workspace, the verify
/// workspace, their graphs, the counts.
pub struct Speculator<'e, B: Backend> {
    be: &'e B,
    model: &'e Model<B>,
    depth: usize,
    /// The head's steps: prompt chunks and catch-ups (up to [`PREFILL_CHUNK`] rows), chained
    /// drafts (one row).
    draft: Workspace<B>,
    /// The draft hidden state a chained draft step reads `[1, hidden]`.
    hid: Act<B::Buf>,
    /// The target's verify steps: up to `depth + 1` rows, every row's logits.
    verify: Workspace<B>,
    /// Whether the head has caught up on the sequence, its last row's logits (the next
    /// step's first draft) in `draft`.
    head_ready: bool,
    graphs: std::collections::HashMap<Pass, GraphState<B::Graph>>,
    /// `FERRITE_SPEC_GRAPHS=0`: every forward eager.
    eager: bool,
    /// Rollbacks by replay even where the backend keeps per-row states
    /// (`FERRITE_SPEC_REPLAY=1`, [`Speculator::with_replay`]).
    replay: bool,
    /// The sequence's cache keeps the verify's per-row states (set at its prefill).
    row_states: bool,
    pub stats: SpecStats,
}

impl<'e, B: Backend> Speculator<'e, B> {
    /// Speculation `depth` tokens deep (1..=[`MAX_DEPTH`]) for sequences of `model`, whose
    /// MTP head must be loaded ([`Model::load_mtp`]) if [`MtpDrafter`] drafts; without a
    /// head the steps skip its catch-up (a [`ScriptedDrafter`] needs none).
    pub fn new(be: &'e B, model: &'e Model<B>, depth: usize) -> Result<Self> {
        Self::with_chunk(be, model, depth, PREFILL_CHUNK)
    }

    /// Rollbacks by replay whatever the backend keeps (for tests and measurements: the
    /// two forms must give the same tokens). Set before the prefill.
    pub fn with_replay(mut self) -> Self {
        self.replay = true;
        self
    }

    /// [`Speculator::new`] for prompts prefilled in chunks of at most `chunk` tokens
    /// ([`Speculator::after_prefill_chunk`]): the head's workspace holds that many rows.
    pub fn with_chunk(be: &'e B, model: &'e Model<B>, depth: usize, chunk: usize) -> Result<Self> {
        ensure!(
            (1..=MAX_DEPTH).contains(&depth),
            "the speculation depth must be 1 to {MAX_DEPTH}, not {depth}"
        );
        let mut hid = be.zeros(1, model.cfg.hidden)?;
        hid.set_rows(1)?;
        Ok(Speculator {
            be,
            model,
            depth,
            draft: model.workspace(
                be,
                chunk.clamp(1, PREFILL_CHUNK).max(depth + 1),
                Logits::Last,
            )?,
            hid,
            verify: model.workspace(be, depth + 1, Logits::All)?,
            head_ready: false,
            graphs: Default::default(),
            eager: std::env::var("FERRITE_SPEC_GRAPHS").is_ok_and(|v| v == "0"),
            replay: std::env::var("FERRITE_SPEC_REPLAY").is_ok_and(|v| v == "1"),
            row_states: false,
            stats: SpecStats::default(),
        })
    }

    /// One chained draft step: the head on (its own last draft hidden state, the token `d`
    /// drafted from it) at position `pos`; its logits then in `self.draft`.
    fn chain(&mut self, kv: &mut B::Kv, d: u32, pos: usize) -> Result<()> {
        let (be, m) = (self.be, self.model);
        let Speculator {
            draft,
            hid,
            graphs,
            eager,
            ..
        } = self;
        let h = draft.hidden();
        be.copy_rows(h, h.rows - 1, hid)?;
        be.set_step(&mut draft.step, &[d], pos)?;
        graph_of(graphs, *eager, Pass::Chain)
            .run(be, &mut || m.mtp_forward(be, draft, hid, kv, Logits::Last))?;
        draft.replayed(1, Logits::Last)
    }

    /// The target's forward over `rows` at position `pos` in the verify workspace, every
    /// row's logits and hidden states then there.
    fn target(&mut self, kv: &mut B::Kv, rows: &[u32], pos: usize) -> Result<()> {
        let (be, m) = (self.be, self.model);
        let ws = &mut self.verify;
        be.set_step(&mut ws.step, rows, pos)?;
        graph_of(&mut self.graphs, self.eager, Pass::Target(rows.len()))
            .run(be, &mut || m.forward(be, ws, kv, Logits::All))?;
        ws.replayed(rows.len(), Logits::All)
    }

    /// The head's catch-up on the target's hidden states in the verify workspace, row i
    /// paired with `tokens[i]`, at positions `pos..`; its last row's logits then in `draft`.
    fn catch_up_verified(&mut self, kv: &mut B::Kv, tokens: &[u32], pos: usize) -> Result<()> {
        let (be, m) = (self.be, self.model);
        let Speculator {
            draft,
            verify,
            graphs,
            eager,
            ..
        } = self;
        be.set_step(&mut draft.step, tokens, pos)?;
        let hidden = verify.hidden();
        graph_of(graphs, *eager, Pass::CatchUp(tokens.len())).run(be, &mut || {
            m.mtp_forward(be, draft, hidden, kv, Logits::Last)
        })?;
        draft.replayed(tokens.len(), Logits::Last)
    }

    /// Prefills `prompt` into `seq` (which must be empty) chunk by chunk, the head catching
    /// up on each chunk's hidden states; returns the target's greedy first token.
    pub fn prefill(&mut self, seq: &mut Sequence<'_, B>, prompt: &[u32]) -> Result<u32> {
        let be = self.be;
        self.prefill_with(seq, prompt, &mut |ws| Ok(greedy(be, ws)?[0]))
    }

    /// [`Speculator::prefill`] with the first token chosen by `choose` from the workspace
    /// holding the last position's logits.
    pub fn prefill_with(
        &mut self,
        seq: &mut Sequence<'_, B>,
        prompt: &[u32],
        choose: &mut dyn FnMut(&mut Workspace<B>) -> Result<u32>,
    ) -> Result<u32> {
        ensure!(seq.pos == 0, "speculative prefill needs an empty sequence");
        ensure!(!prompt.is_empty(), "the prompt is empty");
        let cap = seq.prefill_and_kv(prompt.len())?.0.capacity();
        let mut first = 0;
        for (ci, chunk) in prompt.chunks(cap).enumerate() {
            let (start, end) = (ci * cap, ci * cap + chunk.len());
            seq.prefill(chunk)?;
            // The head pairs the chunk's last hidden state with the prompt's next token, or
            // after the last chunk with the target's first choice.
            let next = match prompt.get(end) {
                Some(&t) => t,
                None => {
                    first = choose(seq.prefill_and_kv(chunk.len())?.0)?;
                    first
                }
            };
            self.after_prefill_chunk(seq, chunk, start, next)?;
        }
        Ok(first)
    }

    /// For callers that prefill in their own chunks (the scheduler): after
    /// `seq.prefill(chunk)` of the tokens at positions `start..`, the head catches up on the
    /// chunk's hidden states; `next` is the token after the chunk (the prompt's next one, or
    /// after the last chunk the first generated token). The chunk must have gone through
    /// one forward, of at most the `chunk` tokens the speculator was made for.
    pub fn after_prefill_chunk(
        &mut self,
        seq: &mut Sequence<'_, B>,
        chunk: &[u32],
        start: usize,
        next: u32,
    ) -> Result<()> {
        let (be, m) = (self.be, self.model);
        ensure!(
            !chunk.is_empty()
                && chunk.len() <= self.draft.capacity()
                && seq.pos == start + chunk.len(),
            "the head catches up on one prefilled chunk at a time ({} tokens at {start}, the \
             sequence at {})",
            chunk.len(),
            seq.pos
        );
        if start == 0 {
            be.kv_snapshots(&mut seq.kv, 1)?;
            self.row_states = !self.replay && be.kv_row_states(&mut seq.kv, self.depth + 1)?;
        }
        if !m.has_mtp() {
            return Ok(());
        }
        let tokens: Vec<u32> = chunk[1..].iter().copied().chain([next]).collect();
        let (ws, kv) = seq.prefill_and_kv(chunk.len())?;
        ensure!(
            ws.hidden().rows == chunk.len(),
            "the last prefill forward held {} rows, not the chunk's {}",
            ws.hidden().rows,
            chunk.len()
        );
        catch_up(be, m, &mut self.draft, ws.hidden(), kv, &tokens, start)?;
        self.head_ready = true;
        Ok(())
    }

    /// One speculative step from the token `t` (the last one returned, not yet in the
    /// cache): at most `n_max` (≥ 1) new tokens, the last of which is not appended, like
    /// [`Sequence::greedy_chain`]'s; the sequence advances by as many positions as tokens
    /// are returned.
    pub fn step(
        &mut self,
        seq: &mut Sequence<'_, B>,
        drafter: &mut dyn Drafter<B>,
        history: &[u32],
        t: u32,
        n_max: usize,
    ) -> Result<Vec<u32>> {
        let be = self.be;
        let ask = self.ask(seq, history, t, n_max)?;
        let drafts = if ask.k > 0 {
            drafter.draft(self, &mut seq.kv, ask)?
        } else {
            vec![]
        };
        let rows = self.verify(seq, t, &drafts, ask.k)?;
        let out = accept_greedy(&drafts, &greedy(be, &mut self.verify)?);
        self.finish(seq, &rows, &out)?;
        Ok(out)
    }

    /// What a step from the token `t` at the sequence's position asks its drafter for: as
    /// many drafts as the depth allows and `n_max` (≥ 1) new tokens leave room for.
    fn ask<'h>(
        &self,
        seq: &Sequence<'_, B>,
        history: &'h [u32],
        t: u32,
        n_max: usize,
    ) -> Result<DraftAsk<'h>> {
        ensure!(n_max >= 1, "a speculative step needs room for one token");
        Ok(DraftAsk {
            n: seq.pos,
            t,
            k: self.depth.min(n_max - 1),
            history,
        })
    }

    /// The verify forward: the target over the step's token `t` and its `drafts` (at most
    /// `k_max`) at the sequence's position, every row's logits then in `self.verify`, after a
    /// snapshot of the linear-attention state. Returns the rows.
    fn verify(
        &mut self,
        seq: &mut Sequence<'_, B>,
        t: u32,
        drafts: &[u32],
        k_max: usize,
    ) -> Result<Vec<u32>> {
        ensure!(
            drafts.len() <= k_max,
            "the drafter gave {} drafts, more than the {k_max} asked for",
            drafts.len()
        );
        let rows: Vec<u32> = std::iter::once(t).chain(drafts.iter().copied()).collect();
        if !self.row_states {
            self.be.kv_snapshot(&mut seq.kv, 0)?;
        }
        self.target(&mut seq.kv, &rows, seq.pos)?;
        Ok(rows)
    }

    /// After a verify of `rows` (the step's token and its drafts) at the sequence's
    /// position: `out` are the step's new tokens, the accepted drafts and the target's
    /// token after them. Rolls the state back where drafts were rejected, advances the
    /// sequence, lets the head catch up (its last row's logits then in `self.draft`), and
    /// counts.
    fn finish(&mut self, seq: &mut Sequence<'_, B>, rows: &[u32], out: &[u32]) -> Result<()> {
        let (be, m) = (self.be, self.model);
        let (n, k, j) = (seq.pos, rows.len() - 1, out.len() - 1);
        ensure!(
            j <= k,
            "{} new tokens from a verify of {} rows",
            out.len(),
            rows.len()
        );
        self.stats.steps += 1;
        self.stats.drafted += k;
        self.stats.accepted += j;
        // Rejected drafts went through a hybrid model's linear-attention state: it takes
        // the state after the last kept row, or goes back to the snapshot and the kept rows
        // run again. An attention-only model needs neither: its rejected rows are
        // overwritten before any query reads them. The head then reads the kept rows'
        // hidden states (a causal step's first j+1 rows are what those rows alone give).
        if j < k {
            if m.cfg.hybrid.is_some() {
                self.stats.rollbacks += 1;
                if self.row_states {
                    be.kv_restore_row(&mut seq.kv, j)?;
                } else {
                    self.stats.replays += 1;
                    be.kv_restore(&mut seq.kv, 0)?;
                    self.target(&mut seq.kv, &rows[..=j], n)?;
                }
            }
            // After a replay the verify workspace already holds those j+1 rows.
            self.verify.truncate(j + 1, Logits::All)?;
        }
        seq.pos = n + j + 1;
        // The head catches up on the target's hidden states of the accepted rows.
        if m.has_mtp() {
            self.catch_up_verified(&mut seq.kv, out, n)?;
        }
        Ok(())
    }

    /// [`Speculator::step`] for sampling (temperature > 0, top-k, top-p, min-p; no
    /// penalties): speculative sampling (Leviathan et al., Chen et al. 2023). The head's
    /// drafts are drawn from its own distribution q under the same sampler settings; draft
    /// `d` is kept with probability min(1, p(d) / q(d)) against the target's p at that
    /// row; the first rejected one is replaced by a draw from max(0, p − q) renormalized,
    /// and when every draft is kept one more token is drawn from the last row's p. Each
    /// token is then distributed exactly as plain sampling from p would give it. `history`
    /// is the prompt and output so far, `t` included.
    pub fn step_sampled(
        &mut self,
        seq: &mut Sequence<'_, B>,
        drafter: &mut dyn Drafter<B>,
        sampler: &mut Sampler,
        history: &[u32],
        t: u32,
        n_max: usize,
    ) -> Result<Vec<u32>> {
        let (be, m) = (self.be, self.model);
        let ask = self.ask(seq, history, t, n_max)?;
        let vocab = m.cfg.vocab;
        // Draft: d(i+1) ~ q(i+1), the drafter's distribution given the drafts before it.
        let (drafts, qs): (Vec<u32>, Vec<Distribution>) = if ask.k > 0 {
            drafter
                .draft_sampled(self, &mut seq.kv, ask, sampler)?
                .into_iter()
                .unzip()
        } else {
            (vec![], vec![])
        };
        let rows = self.verify(seq, t, &drafts, ask.k)?;
        let logits = be.to_host(&self.verify.logits)?;
        let out = accept_sampled(sampler, &logits, vocab, &drafts, &qs, history);
        self.finish(seq, &rows, &out)?;
        Ok(out)
    }
}

/// Greedy acceptance: the target's choices `a` after each row of a verify of k `drafts`
/// (k + 1 of them) give the longest prefix of drafts it agrees with and its own token after
/// that prefix.
pub fn accept_greedy(drafts: &[u32], a: &[u32]) -> Vec<u32> {
    debug_assert_eq!(a.len(), drafts.len() + 1, "one choice per verify row");
    let j = drafts.iter().zip(a).take_while(|(d, a)| d == a).count();
    a[..=j].to_vec()
}

/// Speculative sampling's acceptance ([`Speculator::step_sampled`]) over a verify's `logits`
/// (k + 1 rows of `vocab`: after the step's token and after each of its k `drafts`), each
/// draft drawn from its distribution in `qs`; `history` is the text so far, the step's token
/// included. Returns the step's new tokens: the kept drafts, then the replacement of the
/// first rejected one or, with all kept, one more token drawn from the last row.
pub fn accept_sampled(
    sampler: &mut Sampler,
    logits: &[f32],
    vocab: usize,
    drafts: &[u32],
    qs: &[Distribution],
    history: &[u32],
) -> Vec<u32> {
    let k = drafts.len();
    let mut out = Vec::with_capacity(k + 1);
    let mut hist = history.to_vec();
    let mut dense_q = vec![0f64; vocab];
    for (i, row) in logits.chunks_exact(vocab).enumerate() {
        let p = sampler.distribution(&mut row.to_vec(), &hist);
        if i == k {
            out.push(sampler.pick(&p));
            break;
        }
        let d = drafts[i];
        let pd = p.iter().find(|x| x.0 == d).map_or(0.0, |x| x.1);
        let qd = qs[i].iter().find(|x| x.0 == d).map_or(0.0, |x| x.1);
        let keep = if qd > 0.0 {
            sampler.uniform() < (pd / qd).min(1.0)
        } else {
            pd > 0.0
        };
        if keep {
            out.push(d);
            hist.push(d);
            continue;
        }
        // The residual max(0, p − q): what p has that the draft under-proposed.
        for &(id, q) in &qs[i] {
            dense_q[id as usize] = q;
        }
        let residual: Vec<(u32, f64)> = p
            .iter()
            .map(|&(id, pp)| (id, (pp - dense_q[id as usize]).max(0.0)))
            .filter(|x| x.1 > 0.0)
            .collect();
        out.push(if residual.is_empty() {
            sampler.pick(&p)
        } else {
            sampler.pick(&residual)
        });
        break;
    }
    out
}

/// Prompt lookup decoding: n-gram drafts from the text so far, as llama.cpp's `lookup` and
/// transformers' `prompt_lookup_num_tokens` draft. The longest suffix of the history, of
/// `max_ngram` tokens down to one, that occurred earlier; the tokens that followed its latest
/// earlier occurrence are the drafts. No weights and almost no work; right where the output
/// repeats its input or itself (code edits, quotations, lists, structured data), silent
/// (no drafts, a plain step) where nothing repeats. Its drafts are deterministic: for
/// sampling, q is all on the draft, so a draft is kept with probability p(draft) and a
/// rejection draws from p without it.
pub struct PromptLookup {
    pub max_ngram: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        PromptLookup { max_ngram: 3 }
    }
}

impl PromptLookup {
    /// The distributions lookup drafts are drawn from, for speculative sampling: each all
    /// on its draft (the lookup is deterministic).
    pub fn q(drafts: &[u32]) -> Vec<Distribution> {
        drafts.iter().map(|&d| vec![(d, 1.0)]).collect()
    }

    /// Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    /// of `history` (at most `max_ngram` tokens) seen before; none when no suffix recurs.
    pub fn lookup(&self, history: &[u32], k: usize) -> Vec<u32> {
        let len = history.len();
        for n in (1..=self.max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = &history[len - n..];
            if let Some(i) = (0..len - n).rev().find(|&i| &history[i..i + n] == suffix) {
                return history[i + n..(i + n + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

impl<B: Backend> Drafter<B> for PromptLookup {
    fn draft(
        &mut self,
        _: &mut Speculator<'_, B>,
        _: &mut B::Kv,
        ask: DraftAsk<'_>,
    ) -> Result<Vec<u32>> {
        Ok(self.lookup(ask.history, ask.k))
    }

    fn draft_sampled(
        &mut self,
        _: &mut Speculator<'_, B>,
        _: &mut B::Kv,
        ask: DraftAsk<'_>,
        _: &mut Sampler,
    ) -> Result<Vec<(u32, Distribution)>> {
        let drafts = self.lookup(ask.history, ask.k);
        Ok(drafts.iter().copied().zip(Self::q(&drafts)).collect())
    }
}

/// Drafts a known greedy continuation, right for the first `right` drafts of each step and
/// wrong after (the truth's token + 1): every acceptance length on demand, for gate 3 and to
/// measure speculation's cost at a chosen acceptance where no trained head is at hand.
pub struct ScriptedDrafter {
    /// The greedy tokens after the prompt (the first one is the prefill's).
    pub truth: Vec<u32>,
    pub prompt_len: usize,
    pub right: usize,
    pub vocab: usize,
    /// Also run the MTP head's chained draft steps (their choices unused) where a head is
    /// loaded: timing then includes what drafting with the head costs.
    pub run_head: bool,
}

impl<B: Backend> Drafter<B> for ScriptedDrafter {
    fn draft(
        &mut self,
        spec: &mut Speculator<'_, B>,
        kv: &mut B::Kv,
        ask: DraftAsk<'_>,
    ) -> Result<Vec<u32>> {
        if self.run_head && spec.model.has_mtp() {
            MtpDrafter.draft(spec, kv, ask)?;
        }
        // The token at position p is truth[p - prompt_len].
        (0..ask.k)
            .map(|i| {
                let t = *self
                    .truth
                    .get(ask.n + 1 + i - self.prompt_len)
                    .context("the scripted continuation is too short")?;
                Ok(if i < self.right {
                    t
                } else {
                    (t + 1) % self.vocab as u32
                })
            })
            .collect()
    }
}

/// Gate 3's reference: the greedy tokens of `n` steps after `prompt` by plain decode
/// (prefill, then one-row decode steps: the captured graph where the backend has graphs).
pub fn plain_greedy<B: Backend>(
    be: &B,
    model: &Model<B>,
    prompt: &[u32],
    n: usize,
) -> Result<Vec<u32>> {
    ensure!(n > 0, "at least one token");
    let mut s = Sequence::new(be, model, prompt.len() + n + 1)?;
    s.prefill(prompt)?;
    let mut out = vec![s.greedy()?];
    while out.len() < n {
        s.decode(out[out.len() - 1])?;
        out.push(s.greedy()?);
    }
    Ok(out)
}

/// Gate 3's other side: the greedy tokens of `n` steps after `prompt` by speculation
/// `depth` deep with `drafter`, the tokens each step gave, and the counts. Equal to
/// [`plain_greedy`]'s, whatever the drafter.
pub fn speculative_greedy<B: Backend>(
    be: &B,
    model: &Model<B>,
    prompt: &[u32],
    n: usize,
    depth: usize,
    drafter: &mut dyn Drafter<B>,
) -> Result<(Vec<u32>, Vec<usize>, SpecStats)> {
    ensure!(n > 0, "at least one token");
    let ctx = prompt.len() + n + 1;
    let mut s = Sequence::new(be, model, ctx)?;
    let mut spec = Speculator::new(be, model, depth)?;
    let mut out = vec![spec.prefill(&mut s, prompt)?];
    let mut history: Vec<u32> = prompt.iter().chain(&out).copied().collect();
    let mut sizes = vec![];
    while out.len() < n {
        let room = (n - out.len()).min(ctx - s.pos);
        let got = spec.step(&mut s, drafter, &history, out[out.len() - 1], room)?;
        sizes.push(got.len());
        history.extend(&got);
        out.extend(got);
    }
    Ok((out, sizes, spec.stats))
}

#[cfg(test)]
mod tests {
    use super::PromptLookup;

    #[test]
    fn lookup_takes_the_longest_recurring_suffix_and_its_latest_occurrence() {
        let l = PromptLookup { max_ngram: 3 };
        // "a b c d a b c" -> the trigram "a b c" occurred at 0, followed by "d a b c".
        assert_eq!(l.lookup(&[1, 2, 3, 4, 1, 2, 3], 2), vec![4, 1]);
        // The continuation may run into the suffix itself.
        assert_eq!(l.lookup(&[1, 2, 3, 4, 1, 2, 3], 8), vec![4, 1, 2, 3]);
        // Latest occurrence wins: "x 9" at 1 and 4; 4 is followed by 7.
        assert_eq!(l.lookup(&[5, 8, 9, 6, 8, 9, 7, 8, 9], 1), vec![7]);
        // Only a unigram recurs.
        assert_eq!(l.lookup(&[1, 2, 3, 2], 3), vec![3, 2]);
        // Nothing recurs; too short.
        assert!(l.lookup(&[1, 2, 3], 3).is_empty());
        assert!(l.lookup(&[1], 3).is_empty());
        assert!(l.lookup(&[], 3).is_empty());
    }
}
