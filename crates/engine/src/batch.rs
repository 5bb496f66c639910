//! Batched steps over a paged KV cache: the serving scheduler's backend step.
//!
//! One [`Batch`] owns the KV cache of every sequence the scheduler runs — a pool of
//! fixed-size pages, each sequence's positions reached through its block table (the page ids
//! the scheduler's `PagePool` hands out) — and one workspace whose steps hold the rows of
//! many sequences: the decode rows of every running sequence plus prefill chunks. Every op
//! but attention is row-wise, so a step costs one pass over the weights for all its rows.
//! A hybrid model's Gated DeltaNet layers are not row-wise either: the cache holds a pool of
//! `max_seqs` linear-attention states, and each sequence of a step continues the slot its
//! [`SeqRows::state`] names (the scheduler's; [`Batch::clear_state`] readies one for a new
//! sequence).
//!
//! **Graphs.** A step whose sequences each bring one row (pure decode) is captured as a graph
//! per batch size, like the single-sequence decode step: the first step of a size runs
//! eagerly, the second is captured, later ones replay it (tokens, positions and block tables
//! are device inputs written before each step). Steps with prefill chunks run eagerly.
//! On backends that have graphs, [`Batch::new`] runs one eager step at the workspace's full
//! row count (no sequence holds pages yet): kernels that grow scratch buffers on demand reach
//! their final size before any graph records their addresses.
//!
//! **Identity.** A row's arithmetic does not depend on the other rows of its step (row-wise
//! ops; attention reads only the row's own sequence, in position order; the linear layers
//! run each sequence's rows on its own state as a call on that sequence alone). On the CPU backend a
//! sequence's logits are therefore bitwise those of the sequence run alone
//! (`crates/models/tests/batch.rs`). On CUDA, rows ≤ 16 run the f32 GEMV (row-count
//! invariant); larger batches run the tensor-core GEMM, whose bf16 operand rounding differs
//! slightly from the GEMV's.

use anyhow::{ensure, Context, Result};
use ferrite_backend::{Act, Backend, PagedKv, SeqRows};
use ferrite_models::{Logits, Model, Workspace, TOP_K_MAX};

use crate::generate::GraphState;

/// Sizes of a [`Batch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// KV pages in the pool (all sequences together).
    pub n_pages: usize,
    /// Positions per page (a power of two).
    pub page_size: usize,
    /// Pages one sequence may hold (bounds its context).
    pub max_pages: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Most rows in one step (decode rows plus prefill chunks).
    pub max_rows: usize,
    /// Most logits rows one step returns: `max_seqs`, more where sequences verify drafts
    /// ([`SeqRows::logits`]); at most `max_rows`.
    pub max_logits: usize,
    /// A hybrid model's saved linear-attention states beside the sequences' own
    /// ([`Batch::save_state`], [`Batch::load_state`]: the prefix cache's); 0 otherwise.
    pub state_snapshots: usize,
}

/// The paged KV cache and workspace of batched steps (see the module doc).
pub struct Batch<'e, B: Backend> {
    be: &'e B,
    model: &'e Model<B>,
    kv: B::Kv,
    ws: Workspace<B>,
    cfg: BatchConfig,
    /// Decode-only steps of `n` sequences: `graphs[n - 1]`.
    graphs: Vec<GraphState<B::Graph>>,
    /// Each sequence's logits rows in the last step (empty before a step, or after one that
    /// failed).
    seq_rows: Vec<std::ops::Range<usize>>,
    /// Device top-k values of the last step, `[max_logits, TOP_K_MAX]`.
    top_vals: Act<B::Buf>,
    /// Per-step caches of what the sequences asked for.
    greedy: Option<Vec<u32>>,
    top: Option<(Vec<i32>, Vec<f32>)>,
    host: Option<Vec<f32>>,
}

/// The sequences of the warm-up step: `(rows, pages)` each, together `max_rows` rows where the
/// pool allows (a sequence holds at most `max_pages` pages; distinct pages from page 0).
fn warm_up_plan(c: &BatchConfig) -> Vec<(usize, Vec<u32>)> {
    let per_seq = c.max_pages * c.page_size;
    let (mut left, mut next) = (c.max_rows, 0usize);
    let mut plan = Vec::new();
    while left > 0 && plan.len() < c.max_seqs && per_seq > 0 {
        let rows = left.min(per_seq);
        let n = rows.div_ceil(c.page_size);
        let (rows, n) = if next + n <= c.n_pages {
            (rows, n)
        } else {
            let n = c.n_pages - next;
            (rows.min(n * c.page_size), n)
        };
        if rows == 0 {
            break;
        }
        plan.push((rows, (next as u32..(next + n) as u32).collect()));
        next += n;
        left -= rows;
    }
    plan
}

impl<'e, B: Backend> Batch<'e, B> {
    /// Allocates the paged cache (for a hybrid model also `max_seqs + state_snapshots`
    /// linear-attention state slots) and the workspace. Fails on backends without paged
    /// caches.
    pub fn new(be: &'e B, model: &'e Model<B>, cfg: BatchConfig) -> Result<Self> {
        ensure!(
            cfg.max_seqs >= 1 && (cfg.max_seqs..=cfg.max_rows).contains(&cfg.max_logits),
            "a batch of {} rows for {} sequences and {} logits rows",
            cfg.max_rows,
            cfg.max_seqs,
            cfg.max_logits
        );
        let kv = model.new_paged_kv(
            be,
            PagedKv {
                n_pages: cfg.n_pages,
                page_size: cfg.page_size,
                max_pages: cfg.max_pages,
                max_rows: cfg.max_seqs,
                q8_0: false,
            },
            cfg.max_seqs + cfg.state_snapshots,
        )?;
        let ws = model.batch_workspace(
            be,
            cfg.max_rows,
            cfg.max_seqs,
            cfg.max_logits,
            cfg.max_pages,
            cfg.page_size,
        )?;
        let mut top_vals = be.zeros(cfg.max_logits, TOP_K_MAX)?;
        top_vals.set_rows(1)?;
        let mut b = Batch {
            be,
            model,
            kv,
            ws,
            cfg,
            graphs: (0..cfg.max_seqs).map(|_| GraphState::Eager).collect(),
            seq_rows: Vec::new(),
            top_vals,
            greedy: None,
            top: None,
            host: None,
        };
        // Backends with graphs only (a zero-sized graph type means none: the CPU's `()`).
        if std::mem::size_of::<B::Graph>() != 0 {
            b.warm_up()?;
        }
        Ok(b)
    }

    pub fn config(&self) -> &BatchConfig {
        &self.cfg
    }

    /// Readies state slot `slot` (`0..max_seqs`) for a new sequence: a hybrid model's
    /// linear-attention state there is zeroed (the state before a first token); nothing to
    /// do for other models, whose state is all in pages. Call before the sequence's first
    /// step, and again whenever it starts over (a preempted sequence's re-prefill).
    pub fn clear_state(&mut self, slot: usize) -> Result<()> {
        let slot = self.seq_slot(slot)?;
        if self.model.cfg.hybrid.is_some() {
            self.be.kv_clear_state(&mut self.kv, slot)?;
        }
        Ok(())
    }

    /// Saves sequence state slot `slot`'s linear-attention state (a hybrid model's) as
    /// snapshot `snap` (`0..state_snapshots`); nothing for other models.
    pub fn save_state(&mut self, slot: usize, snap: usize) -> Result<()> {
        let (at, slot) = (self.snapshot(snap)?, self.seq_slot(slot)?);
        self.be.kv_copy_state(&mut self.kv, slot, at)
    }

    /// Starts sequence state slot `slot` from snapshot `snap` (instead of
    /// [`Batch::clear_state`]): the state after the cached pages it takes.
    pub fn load_state(&mut self, snap: usize, slot: usize) -> Result<()> {
        let (at, slot) = (self.snapshot(snap)?, self.seq_slot(slot)?);
        self.be.kv_copy_state(&mut self.kv, at, slot)
    }

    /// Sequence state slot `slot`, checked (`0..max_seqs`).
    fn seq_slot(&self, slot: usize) -> Result<usize> {
        ensure!(
            slot < self.cfg.max_seqs,
            "state slot {slot} of a batch of {} sequences",
            self.cfg.max_seqs
        );
        Ok(slot)
    }

    /// The cache's state slot holding snapshot `snap` (after the sequences' slots).
    fn snapshot(&self, snap: usize) -> Result<usize> {
        ensure!(
            snap < self.cfg.state_snapshots,
            "state snapshot {snap} of {}",
            self.cfg.state_snapshots
        );
        Ok(self.cfg.max_seqs + snap)
    }

    /// Runs one step over `seqs` (their rows in this order); afterwards sequence `i`'s
    /// logits are the rows [`Batch::rows_of`]`(i)` ([`Batch::greedy`], [`Batch::top_k`],
    /// [`Batch::logits`]): row `i` where every sequence asks for one. Each sequence's pages
    /// must cover its positions; its earlier positions must have been filled by earlier
    /// steps with the same pages and, for a hybrid model, the same state slot
    /// ([`SeqRows::state`], cleared by [`Batch::clear_state`] before its first step).
    pub fn step(&mut self, seqs: &[SeqRows<'_>]) -> Result<()> {
        let n = seqs.len();
        ensure!(
            (1..=self.cfg.max_seqs).contains(&n),
            "a step of {n} sequences (at most {})",
            self.cfg.max_seqs
        );
        if let Some(&p) = seqs.iter().flat_map(|s| s.pages).max() {
            ensure!(
                (p as usize) < self.cfg.n_pages,
                "page {p} outside the pool of {}",
                self.cfg.n_pages
            );
        }
        self.seq_rows.clear();
        (self.greedy, self.top, self.host) = (None, None, None);
        let n_logits: usize = seqs.iter().map(|s| s.logits).sum();
        ensure!(
            n_logits <= self.cfg.max_logits,
            "a step asking for {n_logits} logits rows (at most {})",
            self.cfg.max_logits
        );
        let (be, m) = (self.be, self.model);
        let decode_only = seqs.iter().all(|s| s.tokens.len() == 1);
        be.set_batch(&mut self.ws.step, seqs)?;
        let (ws, kv) = (&mut self.ws, &mut self.kv);
        if !decode_only {
            m.forward(be, ws, kv, Logits::SeqLast)?;
        } else {
            self.graphs[n - 1].run(be, &mut || m.forward(be, ws, kv, Logits::SeqLast))?;
            // A replay does not run the host-side bookkeeping of the forward pass.
            ws.logits.set_rows(n)?;
        }
        let mut row = 0;
        for s in seqs {
            self.seq_rows.push(row..row + s.logits);
            row += s.logits;
        }
        Ok(())
    }

    /// One eager step at the workspace's full row count, before any sequence holds pages
    /// (it writes keys and values into the first pages of the pool): scratch buffers that
    /// kernels grow on demand (and may free when they grow) reach their largest size before
    /// a graph records their addresses.
    fn warm_up(&mut self) -> Result<()> {
        let plan = warm_up_plan(&self.cfg);
        let rows: usize = plan.iter().map(|p| p.0).sum();
        if rows < self.cfg.max_rows {
            tracing::warn!(
                "graph warm-up covers {rows} of {} rows (KV pool too small)",
                self.cfg.max_rows
            );
        }
        if plan.is_empty() {
            return Ok(());
        }
        let tokens = vec![0u32; rows];
        let seqs: Vec<SeqRows<'_>> = plan
            .iter()
            .enumerate()
            .map(|(i, (n, pages))| SeqRows {
                tokens: &tokens[..*n],
                pos0: 0,
                pages,
                logits: 1,
                state: i,
            })
            .collect();
        self.be.set_batch(&mut self.ws.step, &seqs)?;
        self.model
            .forward(self.be, &mut self.ws, &mut self.kv, Logits::SeqLast)
    }

    /// The model's vocabulary: the length of a logits row.
    pub fn vocab(&self) -> usize {
        self.model.cfg.vocab
    }

    /// Logits rows of the last step.
    fn n_rows(&self) -> usize {
        self.seq_rows.last().map_or(0, |r| r.end)
    }

    /// Sequence `i`'s logits rows in the last step.
    pub fn rows_of(&self, i: usize) -> Result<std::ops::Range<usize>> {
        self.seq_rows
            .get(i)
            .cloned()
            .with_context(|| format!("sequence {i} of a step of {}", self.seq_rows.len()))
    }

    /// The greedy choice of logits row `i` of the last step (every row's taken on the
    /// device; one read).
    pub fn greedy(&mut self, i: usize) -> Result<u32> {
        let n = self.n_rows();
        ensure!(i < n, "logits row {i} of a step of {n}");
        if self.greedy.is_none() {
            let ws = &mut self.ws;
            self.be.argmax(&ws.logits, &mut ws.argmax)?;
            let ids = self.be.read_i32(&ws.argmax, n)?;
            self.greedy = Some(ids.into_iter().map(|t| t as u32).collect());
        }
        Ok(self.greedy.as_ref().expect("just set")[i])
    }

    /// The `k ≤ TOP_K_MAX` best `(token, logit)` of logits row `i`, best first (selected
    /// on the device for every row at once: the first k of the best TOP_K_MAX).
    pub fn top_k(&mut self, i: usize, k: usize) -> Result<Vec<(u32, f32)>> {
        let n = self.n_rows();
        ensure!(i < n, "logits row {i} of a step of {n}");
        ensure!(
            (1..=TOP_K_MAX).contains(&k),
            "top-k on the device needs 1 ≤ k ≤ {TOP_K_MAX}"
        );
        let kk = TOP_K_MAX.min(self.model.cfg.vocab);
        ensure!(k <= kk, "top-k of {k} over a vocabulary of {kk}");
        if self.top.is_none() {
            let be = self.be;
            let ws = &mut self.ws;
            self.top_vals.cols = kk;
            self.top_vals.set_rows(n)?;
            be.top_k(&ws.logits, kk, &mut ws.top_ids, &mut self.top_vals)?;
            let ids = be.read_i32(&ws.top_ids, n * kk)?;
            self.top = Some((ids, be.to_host(&self.top_vals)?));
        }
        let (ids, vals) = self.top.as_ref().expect("just set");
        Ok((0..k)
            .map(|j| (ids[i * kk + j] as u32, vals[i * kk + j]))
            .collect())
    }

    /// Logits row `i` on the host (every row's cross once per step).
    pub fn logits(&mut self, i: usize) -> Result<Vec<f32>> {
        let n = self.n_rows();
        ensure!(i < n, "logits row {i} of a step of {n}");
        if self.host.is_none() {
            self.host = Some(self.be.to_host(&self.ws.logits)?);
        }
        let v = self.model.cfg.vocab;
        Ok(self.host.as_ref().expect("just set")[i * v..(i + 1) * v].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(n_pages: usize, max_pages: usize, max_seqs: usize, max_rows: usize) -> BatchConfig {
        BatchConfig {
            n_pages,
            page_size: 16,
            max_pages,
            max_seqs,
            max_rows,
            max_logits: max_seqs,
            state_snapshots: 0,
        }
    }

    /// The warm-up reaches the full row count through several sequences when one sequence's
    /// context is shorter (`ferrite serve`: 512-token prefill chunks + 32 decode rows, a
    /// 448-token context), never reusing a page.
    #[test]
    fn warm_up_covers_max_rows() {
        for c in [
            cfg(896, 28, 32, 544),
            cfg(100, 4, 8, 100),
            cfg(64, 64, 1, 300),
            cfg(3, 28, 32, 544),
        ] {
            let plan = warm_up_plan(&c);
            let rows: usize = plan.iter().map(|p| p.0).sum();
            let want = c
                .max_rows
                .min(c.max_seqs * c.max_pages * 16)
                .min(c.n_pages * 16);
            assert_eq!(rows, want, "{c:?}");
            assert!(plan.len() <= c.max_seqs);
            let mut pages: Vec<u32> = plan.iter().flat_map(|p| p.1.clone()).collect();
            for (n, p) in &plan {
                assert!(p.len() <= c.max_pages && n.div_ceil(16) <= p.len() && *n > 0);
            }
            let all = pages.len();
            pages.sort();
            pages.dedup();
            assert_eq!(pages.len(), all, "a page used twice");
            assert!(pages.iter().all(|&p| (p as usize) < c.n_pages));
        }
    }
}
