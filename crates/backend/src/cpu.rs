//! The CPU reference backend: plain f32 arithmetic, obviously correct, parallel with rayon.
//!
//! It is the oracle every accelerated kernel is checked against, so clarity wins over speed
//! wherever the two disagree. Quantized weights stay quantized in memory; each block is
//! dequantized inside the dot product (`ferrite_formats::quant::dot_many`).
//!
//! Summation order is part of the contract (the prefill/decode gate compares the argmax of
//! both paths): a matmul row is computed by the same `dot_many` call whether one token or a
//! whole prompt is in flight, attention sums positions in ascending order for every query
//! row, and MoE combines expert outputs in top-k order per token, independent of how many
//! tokens share a step.

use std::borrow::Cow;

use anyhow::{bail, ensure, Context, Result};
use ferrite_formats::{quant, GgmlType};
use rayon::prelude::*;

use crate::gated_delta;
use crate::{
    check_shape, Act, AttnArgs, AttnShape, Backend, BatchLayout, DeltaArgs, DeltaShape,
    ExpertWeights, HostTensor, MoeRouting, PagedKv, Rope, RopeStyle, SeqRows, SnapshotSlots,
    StepBatch, StepInput,
};

/// A weight in host memory, in its file type.
pub struct CpuWeight {
    pub dtype: GgmlType,
    /// Row-major shape; the last dimension is contiguous.
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl CpuWeight {
    /// Bytes of one row (the last dimension).
    fn row_bytes(&self) -> usize {
        // Validated at upload: the row length is a whole number of blocks.
        self.shape
            .last()
            .map_or(0, |&n| n / self.dtype.block_size() * self.dtype.type_size())
    }
    fn row(&self, i: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[i * rb..(i + 1) * rb]
    }
    /// `(n_out, n_in)` of a 2-D weight.
    fn matrix_dims(&self) -> Result<(usize, usize)> {
        match self.shape[..] {
            [n_out, n_in] => Ok((n_out, n_in)),
            _ => bail!("expected a 2-D weight, got shape {:?}", self.shape),
        }
    }
}

/// One sequence's KV cache: per layer, `capacity` positions of `n_kv_heads * head_dim` f32;
/// for hybrid models also each linear-attention layer's state. A paged cache
/// ([`Backend::kv_new_paged`]) holds `n_pages · page_size` rows per layer instead, shared by
/// many sequences: position `p` of a sequence is row `pages[p / page_size] · page_size +
/// p % page_size`.
pub struct CpuKv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    shape: AttnShape,
    capacity: usize,
    /// `Some((n_pages, page_size))` for a paged cache.
    paged: Option<(usize, usize)>,
    /// Per linear layer: the last `conv_kernel - 1` conv inputs, `[kernel - 1, conv_dim]`.
    conv: Vec<Vec<f32>>,
    /// Per linear layer: the recurrent state, `[n_v_heads, k_head_dim, v_head_dim]`.
    delta: Vec<Vec<f32>>,
    delta_shape: Option<DeltaShape>,
    /// Linear-attention states per layer: 1 for one sequence's cache, the pool's size for a
    /// pooled one ([`Backend::kv_new_paged_hybrid`]); `conv[l]` and `delta[l]` hold them
    /// one after another.
    state_slots: usize,
    /// Snapshot slots ([`Backend::kv_snapshots`]): per slot a copy of `conv` and `delta`.
    snapshots: Vec<LinearState>,
    slots: SnapshotSlots,
    /// Row-state slots ([`Backend::kv_row_states`]): per row the state after it, and per
    /// linear layer the rows of its last tracked conv and delta-rule calls.
    row_states: Vec<LinearState>,
    row_conv_rows: Vec<usize>,
    row_delta_rows: Vec<usize>,
}

/// A copy of a cache's linear-attention state: (`conv`, `delta`), per layer.
type LinearState = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Copies a saved linear-attention state (a snapshot or a row state) into the live one.
fn load_state(conv: &mut [Vec<f32>], delta: &mut [Vec<f32>], saved: &LinearState) {
    for (dst, src) in conv.iter_mut().zip(&saved.0) {
        dst.copy_from_slice(src);
    }
    for (dst, src) in delta.iter_mut().zip(&saved.1) {
        dst.copy_from_slice(src);
    }
}

impl CpuKv {
    /// Floats of one state slot of a layer: (conv, recurrent).
    fn state_lens(&self) -> (usize, usize) {
        self.delta_shape
            .map_or((0, 0), |d| (d.conv_state_len(), d.recurrent_state_len()))
    }
    /// Snapshots and row states copy the whole linear-attention state: one sequence's only.
    fn ensure_one_state(&self, what: &str) -> Result<()> {
        ensure!(
            self.state_slots <= 1,
            "{what}: a cache of {} sequences' states takes no snapshots or row states",
            self.state_slots
        );
        Ok(())
    }
    fn delta_shape(&self, layer: usize) -> Result<DeltaShape> {
        ensure!(
            layer < self.delta.len(),
            "linear-attention layer {layer} outside the cache ({} layers)",
            self.delta.len()
        );
        self.delta_shape
            .context("this cache holds no linear-attention state")
    }
}

/// The convolution of `causal_conv1d` over one sequence's rows `x` (`[rows, c]`) continuing
/// `state` (`[kernel - 1, c]`), which then keeps the last `kernel - 1` inputs. Returns the
/// input extended on the left by the old state (`[kernel - 1 + rows, c]`), from which the
/// state after any row can be read.
fn conv_rows(
    x: &[f32],
    c: usize,
    kernel: usize,
    wf: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) -> Vec<f32> {
    let hist = kernel - 1;
    let rows = x.len() / c;
    let mut e = Vec::with_capacity((hist + rows) * c);
    e.extend_from_slice(state);
    e.extend_from_slice(x);
    out.par_chunks_mut(c).enumerate().for_each(|(t, o)| {
        for (ch, y) in o.iter_mut().enumerate() {
            let taps = &wf[ch * kernel..][..kernel];
            let s: f32 = taps
                .iter()
                .enumerate()
                .map(|(j, &wj)| wj * e[(t + j) * c + ch])
                .sum();
            *y = silu(s);
        }
    });
    state.copy_from_slice(&e[rows * c..]);
    e
}

/// `kv` with zeroed linear-attention state for `n_layers` Gated DeltaNet layers of shape
/// `delta`, `slots` sequences' worth.
fn with_linear_state(
    mut kv: CpuKv,
    n_layers: usize,
    delta: DeltaShape,
    slots: usize,
) -> Result<CpuKv> {
    ensure!(
        delta.conv_kernel >= 1
            && delta.n_k_heads > 0
            && delta.n_v_heads.is_multiple_of(delta.n_k_heads),
        "bad linear-attention shape {delta:?}"
    );
    ensure!(slots >= 1, "a hybrid cache needs at least one state slot");
    kv.delta_shape = Some(delta);
    kv.state_slots = slots;
    let (conv, state) = kv.state_lens();
    let alloc = |n: usize| -> Result<Vec<Vec<f32>>> {
        let len = n
            .checked_mul(slots)
            .context("linear-attention state size overflows")?;
        Ok((0..n_layers).map(|_| vec![0.0; len]).collect())
    };
    kv.conv = alloc(conv)?;
    kv.delta = alloc(state)?;
    Ok(kv)
}

/// The CPU reference backend. Uses the global rayon pool (its size is set by the caller).
#[derive(Default)]
pub struct CpuBackend {
    /// Evaluate multi-token Gated DeltaNet steps with the chunked form
    /// ([`gated_delta::chunked`]) instead of the token-by-token recurrence.
    chunked_delta: bool,
    /// Answer [`Backend::defers_rms_norm`] (`All`) or [`Backend::defers_rms_norm_after`]
    /// (`Ffn`) with `true`, so decoders take that deferred-norm order (residual adds in
    /// [`Backend::matmul_add`], norms inside the ops after them) while every op keeps its
    /// reference arithmetic.
    deferred_norms: DeferredNorms,
}

/// Which deferred-norm order [`CpuBackend`] asks decoders to take (a test mode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum DeferredNorms {
    #[default]
    None,
    All,
    Ffn,
}

impl CpuBackend {
    /// The reference: the gated delta rule token by token, so prefill and decode run the
    /// same arithmetic.
    pub fn new() -> Self {
        CpuBackend::default()
    }
    /// Prefill steps evaluate the gated delta rule in chunks of [`gated_delta::CHUNK`], the
    /// way accelerated prefill kernels do; used to check that form end to end against the
    /// recurrence.
    pub fn with_chunked_delta() -> Self {
        CpuBackend {
            chunked_delta: true,
            ..CpuBackend::default()
        }
    }
    /// Decoders take their deferred-norm order of operations (what a GPU backend runs at
    /// decode for float weights) on the reference ops, whose defaults compose the same
    /// arithmetic: used to check that order end to end, bitwise against the usual one.
    pub fn with_deferred_norms() -> Self {
        CpuBackend {
            deferred_norms: DeferredNorms::All,
            ..CpuBackend::default()
        }
    }
    /// Decoders take the per-site order of quantized weights instead
    /// ([`Backend::defers_rms_norm_after`]: the FFN's norm handed over by the o-projection).
    pub fn with_deferred_ffn_norms() -> Self {
        CpuBackend {
            deferred_norms: DeferredNorms::Ffn,
            ..CpuBackend::default()
        }
    }
}

/// `out[t][o] = W[o] · xs[t]` for `t < rows`, W given as raw rows of `dtype`.
/// Parallel over output rows; each weight row is dequantized once per call and dotted with
/// every token (`dot_many`), so decode (rows = 1) and prefill run the same arithmetic.
fn matmul_raw(
    dtype: GgmlType,
    w: &[u8],
    n_out: usize,
    n_in: usize,
    xs: &[f32],
    rows: usize,
    out: &mut [f32],
) {
    let rb = w.len() / n_out.max(1);
    if rows == 1 {
        // One contiguous range of output rows per thread (a few per thread for balance):
        // per-row tasks cost more in scheduling than the dot products at decode sizes.
        let chunk = n_out.div_ceil(rayon::current_num_threads() * 4).max(16);
        out.par_chunks_mut(chunk).enumerate().for_each(|(c, ys)| {
            for (j, y) in ys.iter_mut().enumerate() {
                let o = c * chunk + j;
                quant::dot_many(
                    dtype,
                    &w[o * rb..(o + 1) * rb],
                    xs,
                    n_in,
                    std::slice::from_mut(y),
                );
            }
        });
        return;
    }
    // Tokens in tiles whose activations stay in the core's cache while every weight row
    // passes over them (a 512-token prompt of hidden 4096 is 8 MB: streamed from memory
    // once per weight row otherwise). Each output is still one `dot_many` lane, so the
    // results are bitwise those of the untiled loop.
    let tile = (TOKEN_TILE_BYTES / (n_in * 4).max(1)).clamp(1, rows);
    let mut tmp = vec![0f32; n_out * tile];
    for t0 in (0..rows).step_by(tile) {
        let nt = tile.min(rows - t0);
        let xt = &xs[t0 * n_in..(t0 + nt) * n_in];
        // Column-major scratch: one contiguous run of `nt` results per weight row.
        tmp[..n_out * nt]
            .par_chunks_mut(nt)
            .with_min_len(8)
            .enumerate()
            .for_each(|(o, col)| {
                quant::dot_many(dtype, &w[o * rb..(o + 1) * rb], xt, n_in, col);
            });
        out[t0 * n_out..(t0 + nt) * n_out]
            .par_chunks_mut(n_out)
            .enumerate()
            .for_each(|(t, row)| {
                for (o, y) in row.iter_mut().enumerate() {
                    *y = tmp[o * nt + t];
                }
            });
    }
}

/// Bytes of activations per token tile in the prefill matmul: well inside a core's L2.
const TOKEN_TILE_BYTES: usize = 128 << 10;

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x / sqrt(mean(x²) + eps) * w`, the sum of squares accumulated in f64.
fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = (xi * scale) * wi;
    }
}

/// Softmax over `logits` → top-k expert ids and weights (ties to the lower id).
pub fn route_top_k(logits: &[f32], routing: &MoeRouting) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    // Stable sort by descending probability keeps the lower id first on ties.
    idx.sort_by(|&a, &b| {
        exps[b]
            .partial_cmp(&exps[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let mut chosen: Vec<(usize, f32)> = idx[..routing.top_k]
        .iter()
        .map(|&e| (e, exps[e] / sum))
        .collect();
    if routing.norm_topk {
        let s: f32 = chosen.iter().map(|c| c.1).sum();
        for c in &mut chosen {
            c.1 /= s;
        }
    }
    chosen
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type IBuf = Vec<i32>;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    type Graph = ();

    fn defers_rms_norm(&self, _ws: &[&CpuWeight], _rows: usize) -> bool {
        self.deferred_norms == DeferredNorms::All
    }

    fn defers_rms_norm_after(&self, _p: &CpuWeight, _c: &[&CpuWeight], _rows: usize) -> bool {
        self.deferred_norms == DeferredNorms::Ffn
    }

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn device_name(&self) -> String {
        // /proc/cpuinfo where there is one; the architecture otherwise.
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|n| n.trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string())
    }

    fn copy_bandwidth(&self) -> Result<f64> {
        // 256 MiB, far beyond any cache; all threads copy their share; best of 5.
        const BYTES: usize = 256 << 20;
        let src = vec![1u8; BYTES];
        let mut dst = vec![0u8; BYTES];
        let chunk = BYTES / rayon::current_num_threads().max(1);
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t0 = std::time::Instant::now();
            dst.par_chunks_mut(chunk)
                .zip(src.par_chunks(chunk))
                .for_each(|(d, s)| d.copy_from_slice(s));
            best = best.min(t0.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        Ok(2.0 * BYTES as f64 / best)
    }

    fn kv_bytes_per_element(&self) -> f64 {
        4.0
    }

    fn upload(&self, t: &HostTensor<'_>) -> Result<CpuWeight> {
        t.validate()?;
        let data = match &t.data {
            Cow::Borrowed(b) => b.to_vec(),
            Cow::Owned(v) => v.clone(),
        };
        Ok(CpuWeight {
            dtype: t.dtype,
            shape: t.shape.clone(),
            data,
        })
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<Act<Vec<f32>>> {
        Ok(Act {
            buf: vec![0.0; rows * cols],
            rows,
            cols,
            capacity: rows,
        })
    }

    fn step_input(&self, capacity: usize) -> Result<StepInput<Vec<i32>>> {
        Ok(StepInput {
            tokens: vec![0; capacity],
            positions: vec![0; capacity],
            rows: 0,
            pos0: 0,
            capacity,
            batch: None,
        })
    }

    fn batch_step_input(
        &self,
        capacity: usize,
        max_seqs: usize,
        max_pages: usize,
        page_size: usize,
    ) -> Result<StepInput<Vec<i32>>> {
        let batch = StepBatch::new(
            vec![0; capacity],
            vec![0; max_seqs * max_pages],
            vec![0; 3 * max_seqs],
            max_seqs,
            max_pages,
            page_size,
        )?;
        let mut step = self.step_input(capacity)?;
        step.batch = Some(batch);
        Ok(step)
    }

    fn set_batch(&self, step: &mut StepInput<Vec<i32>>, seqs: &[SeqRows<'_>]) -> Result<()> {
        let capacity = step.capacity;
        let b = step
            .batch
            .as_mut()
            .context("set_batch: the step input was not made by batch_step_input")?;
        let l = BatchLayout::new(seqs, capacity, b.max_seqs, b.max_pages, b.page_size)?;
        let n = l.tokens.len();
        step.tokens[..n].copy_from_slice(&l.tokens);
        step.positions[..n].copy_from_slice(&l.positions);
        b.row_seq[..n].copy_from_slice(&l.row_seq);
        b.block_tables[..l.block_tables.len()].copy_from_slice(&l.block_tables);
        b.seg_info[..l.seg_info.len()].copy_from_slice(&l.seg_info);
        b.segs = l.segs;
        b.max_page = l.max_page;
        step.rows = n;
        step.pos0 = seqs[0].pos0;
        Ok(())
    }

    fn set_step(&self, step: &mut StepInput<Vec<i32>>, tokens: &[u32], pos0: usize) -> Result<()> {
        ensure!(
            tokens.len() <= step.capacity,
            "{} tokens in a step of {}",
            tokens.len(),
            step.capacity
        );
        for (i, &t) in tokens.iter().enumerate() {
            step.tokens[i] = i32::try_from(t).context("token id does not fit in i32")?;
            step.positions[i] = i32::try_from(pos0 + i).context("position does not fit in i32")?;
        }
        step.rows = tokens.len();
        step.pos0 = pos0;
        if let Some(b) = &mut step.batch {
            b.segs.clear();
        }
        Ok(())
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<Act<Vec<f32>>> {
        ensure!(
            data.len() == rows * cols,
            "from_host: {} values for [{rows}, {cols}]",
            data.len()
        );
        Ok(Act {
            buf: data.to_vec(),
            rows,
            cols,
            capacity: rows,
        })
    }

    fn to_host(&self, x: &Act<Vec<f32>>) -> Result<Vec<f32>> {
        Ok(x.buf[..x.len()].to_vec())
    }

    fn embed(
        &self,
        table: &CpuWeight,
        step: &StepInput<Vec<i32>>,
        out: &mut Act<Vec<f32>>,
    ) -> Result<()> {
        let (vocab, dim) = table.matrix_dims()?;
        check_shape("embed out", out, step.rows, dim)?;
        for (&tok, row) in step.tokens[..step.rows].iter().zip(out.buf.chunks_mut(dim)) {
            ensure!(
                tok >= 0 && (tok as usize) < vocab,
                "token id {tok} is outside the vocabulary (size {vocab})"
            );
            quant::dequantize(table.dtype, table.row(tok as usize), row)?;
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Act<Vec<f32>>,
        w: &CpuWeight,
        eps: f32,
        out: &mut Act<Vec<f32>>,
    ) -> Result<()> {
        check_shape("rms_norm out", out, x.rows, x.cols)?;
        let wf = dequant_vec(w, x.cols)?;
        let n = x.len();
        out.buf[..n]
            .par_chunks_mut(x.cols)
            .zip(x.buf[..n].par_chunks(x.cols))
            .for_each(|(o, xr)| rms_norm_row(xr, &wf, eps, o));
        Ok(())
    }

    fn head_rms_norm(
        &self,
        x: &mut Act<Vec<f32>>,
        w: &CpuWeight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(
            x.cols.is_multiple_of(head_dim),
            "head_rms_norm: {} columns is not a whole number of {head_dim}-heads",
            x.cols
        );
        let wf = dequant_vec(w, head_dim)?;
        let n = x.len();
        x.buf[..n]
            .par_chunks_mut(head_dim)
            .with_min_len(16)
            .for_each(|h| {
                let src = h.to_vec();
                rms_norm_row(&src, &wf, eps, h);
            });
        Ok(())
    }

    fn matmul(&self, x: &Act<Vec<f32>>, w: &CpuWeight, out: &mut Act<Vec<f32>>) -> Result<()> {
        let (n_out, n_in) = crate::check_matmul(x, &w.shape, out)?;
        let (nx, no) = (x.len(), out.len());
        matmul_raw(
            w.dtype,
            &w.data,
            n_out,
            n_in,
            &x.buf[..nx],
            x.rows,
            &mut out.buf[..no],
        );
        Ok(())
    }

    fn copy_rows(&self, x: &Act<Vec<f32>>, start: usize, out: &mut Act<Vec<f32>>) -> Result<()> {
        crate::check_copy_rows(x, start, out)?;
        let n = out.len();
        out.buf[..n].copy_from_slice(&x.buf[start * x.cols..start * x.cols + n]);
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &Act<Vec<f32>>,
        rows: &[usize],
        out: &mut Act<Vec<f32>>,
    ) -> Result<()> {
        crate::check_gather_rows(x, rows, out)?;
        let c = x.cols;
        for (i, &r) in rows.iter().enumerate() {
            out.buf[i * c..(i + 1) * c].copy_from_slice(&x.buf[r * c..(r + 1) * c]);
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut Act<Vec<f32>>, y: &Act<Vec<f32>>) -> Result<()> {
        check_shape("add_assign", y, x.rows, x.cols)?;
        let n = x.len();
        x.buf[..n]
            .iter_mut()
            .zip(&y.buf[..n])
            .for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn swiglu(
        &self,
        gate: &Act<Vec<f32>>,
        up: &Act<Vec<f32>>,
        out: &mut Act<Vec<f32>>,
    ) -> Result<()> {
        check_shape("swiglu up", up, gate.rows, gate.cols)?;
        check_shape("swiglu out", out, gate.rows, gate.cols)?;
        let n = gate.len();
        out.buf[..n]
            .par_iter_mut()
            .with_min_len(1 << 14)
            .zip(gate.buf[..n].par_iter().zip(&up.buf[..n]))
            .for_each(|(o, (&g, &u))| *o = silu(g) * u);
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Act<Vec<f32>>,
        head_dim: usize,
        step: &StepInput<Vec<i32>>,
        rope: &Rope,
    ) -> Result<()> {
        crate::check_rope(x, head_dim, step, rope)?;
        let inv_freq = rope_inv_freq(rope);
        let (cols, n) = (x.cols, x.len());
        x.buf[..n]
            .par_chunks_mut(cols)
            .enumerate()
            .for_each(|(t, row)| {
                let cs = rope_cos_sin(&inv_freq, step.positions[t]);
                for h in row.chunks_mut(head_dim) {
                    rope_head(h, &cs, rope);
                }
            });
        Ok(())
    }

    fn add_rms_norm(
        &self,
        x: &mut Act<Vec<f32>>,
        y: &Act<Vec<f32>>,
        w: &CpuWeight,
        eps: f32,
        h: &mut Act<Vec<f32>>,
    ) -> Result<()> {
        let wlen = w.shape.iter().product();
        crate::check_add_rms_norm(x, y, wlen, h)?;
        let wf = dequant_vec(w, x.cols)?;
        let (cols, n) = (x.cols, x.len());
        // Row by row: the add of `add_assign`, then `rms_norm_row` on the sum, so the
        // result is bitwise that of the two ops.
        x.buf[..n]
            .par_chunks_mut(cols)
            .zip(y.buf[..n].par_chunks(cols))
            .zip(h.buf[..n].par_chunks_mut(cols))
            .for_each(|((xr, yr), hr)| {
                xr.iter_mut().zip(yr).for_each(|(a, b)| *a += b);
                rms_norm_row(xr, &wf, eps, hr);
            });
        Ok(())
    }

    fn qk_norm_rope(
        &self,
        q: &mut Act<Vec<f32>>,
        k: &mut Act<Vec<f32>>,
        q_norm: Option<&CpuWeight>,
        k_norm: Option<&CpuWeight>,
        head_dim: usize,
        eps: f32,
        step: &StepInput<Vec<i32>>,
        rope: &Rope,
    ) -> Result<()> {
        let len = |w: &CpuWeight| w.shape.iter().product::<usize>();
        crate::check_qk_norm_rope(
            q,
            k,
            [q_norm.map(len), k_norm.map(len)],
            head_dim,
            step,
            rope,
        )?;
        let qw = q_norm.map(|w| dequant_vec(w, head_dim)).transpose()?;
        let kw = k_norm.map(|w| dequant_vec(w, head_dim)).transpose()?;
        let inv_freq = rope_inv_freq(rope);
        // Per head: `head_rms_norm`'s `rms_norm_row`, then `rope`'s rotation with the same
        // angles, so the result is bitwise that of the four ops.
        let per_head = |h: &mut [f32], w: Option<&Vec<f32>>, cs: &[(f32, f32)]| {
            if let Some(w) = w {
                let src = h.to_vec();
                rms_norm_row(&src, w, eps, h);
            }
            rope_head(h, cs, rope);
        };
        for (x, w) in [(q, qw.as_ref()), (k, kw.as_ref())] {
            let (cols, n) = (x.cols, x.len());
            x.buf[..n]
                .par_chunks_mut(cols)
                .enumerate()
                .for_each(|(t, row)| {
                    let cs = rope_cos_sin(&inv_freq, step.positions[t]);
                    for h in row.chunks_mut(head_dim) {
                        per_head(h, w, &cs);
                    }
                });
        }
        Ok(())
    }

    fn kv_new(&self, n_layers: usize, shape: AttnShape, capacity: usize) -> Result<CpuKv> {
        let per_layer = capacity
            .checked_mul(shape.n_kv_heads * shape.head_dim)
            .context("KV cache size overflows")?;
        Ok(CpuKv {
            k: vec![vec![0.0; per_layer]; n_layers],
            v: vec![vec![0.0; per_layer]; n_layers],
            shape,
            capacity,
            paged: None,
            conv: vec![],
            delta: vec![],
            delta_shape: None,
            state_slots: 0,
            snapshots: vec![],
            row_states: vec![],
            row_conv_rows: vec![],
            row_delta_rows: vec![],
            slots: SnapshotSlots::default(),
        })
    }

    fn kv_new_paged(&self, n_layers: usize, shape: AttnShape, paged: PagedKv) -> Result<CpuKv> {
        let PagedKv {
            n_pages, page_size, ..
        } = paged;
        ensure!(
            page_size.is_power_of_two() && n_pages > 0,
            "paged KV cache: {n_pages} pages of {page_size} positions (a power of two)"
        );
        let rows = n_pages
            .checked_mul(page_size)
            .context("KV cache size overflows")?;
        let per_layer = rows
            .checked_mul(shape.n_kv_heads * shape.head_dim)
            .context("KV cache size overflows")?;
        // One zeroed allocation per layer (not clones of one): the OS maps pages lazily, so
        // memory grows with the pages sequences actually use.
        let zeroed = || (0..n_layers).map(|_| vec![0.0; per_layer]).collect();
        Ok(CpuKv {
            k: zeroed(),
            v: zeroed(),
            shape,
            capacity: rows,
            paged: Some((n_pages, page_size)),
            conv: vec![],
            delta: vec![],
            delta_shape: None,
            state_slots: 0,
            snapshots: vec![],
            row_states: vec![],
            row_conv_rows: vec![],
            row_delta_rows: vec![],
            slots: SnapshotSlots::default(),
        })
    }

    fn kv_new_hybrid(
        &self,
        n_attn_layers: usize,
        shape: AttnShape,
        capacity: usize,
        n_linear_layers: usize,
        delta: DeltaShape,
    ) -> Result<CpuKv> {
        let kv = self.kv_new(n_attn_layers, shape, capacity)?;
        with_linear_state(kv, n_linear_layers, delta, 1)
    }

    fn kv_new_paged_hybrid(
        &self,
        n_attn_layers: usize,
        shape: AttnShape,
        paged: PagedKv,
        n_linear_layers: usize,
        delta: DeltaShape,
        state_slots: usize,
    ) -> Result<CpuKv> {
        let kv = self.kv_new_paged(n_attn_layers, shape, paged)?;
        with_linear_state(kv, n_linear_layers, delta, state_slots)
    }

    fn kv_clear_state(&self, kv: &mut CpuKv, slot: usize) -> Result<()> {
        if kv.delta_shape.is_none() {
            return Ok(());
        }
        ensure!(
            slot < kv.state_slots,
            "kv_clear_state: slot {slot} of a cache of {}",
            kv.state_slots
        );
        let (cl, dl) = kv.state_lens();
        for c in &mut kv.conv {
            c[slot * cl..][..cl].fill(0.0);
        }
        for d in &mut kv.delta {
            d[slot * dl..][..dl].fill(0.0);
        }
        Ok(())
    }

    fn kv_copy_state(&self, kv: &mut CpuKv, from: usize, to: usize) -> Result<()> {
        if kv.delta_shape.is_none() {
            return Ok(());
        }
        ensure!(
            from < kv.state_slots && to < kv.state_slots,
            "kv_copy_state: slots {from} -> {to} of a cache of {}",
            kv.state_slots
        );
        let (cl, dl) = kv.state_lens();
        for c in &mut kv.conv {
            c.copy_within(from * cl..(from + 1) * cl, to * cl);
        }
        for d in &mut kv.delta {
            d.copy_within(from * dl..(from + 1) * dl, to * dl);
        }
        Ok(())
    }

    fn kv_snapshots(&self, kv: &mut CpuKv, n: usize) -> Result<()> {
        kv.ensure_one_state("kv_snapshots")?;
        kv.snapshots = (0..n)
            .map(|_| (kv.conv.clone(), kv.delta.clone()))
            .collect();
        kv.slots = SnapshotSlots::new(n);
        Ok(())
    }

    fn kv_snapshot(&self, kv: &mut CpuKv, slot: usize) -> Result<()> {
        kv.slots.check_snapshot(slot)?;
        let (conv, delta) = &mut kv.snapshots[slot];
        for (dst, src) in conv.iter_mut().zip(&kv.conv) {
            dst.copy_from_slice(src);
        }
        for (dst, src) in delta.iter_mut().zip(&kv.delta) {
            dst.copy_from_slice(src);
        }
        kv.slots.set_filled(slot)
    }

    fn kv_restore(&self, kv: &mut CpuKv, slot: usize) -> Result<()> {
        kv.slots.restore(slot)?;
        load_state(&mut kv.conv, &mut kv.delta, &kv.snapshots[slot]);
        Ok(())
    }

    fn kv_row_states(&self, kv: &mut CpuKv, rows: usize) -> Result<bool> {
        kv.ensure_one_state("kv_row_states")?;
        kv.row_states = (0..rows)
            .map(|_| (kv.conv.clone(), kv.delta.clone()))
            .collect();
        kv.row_conv_rows = vec![0; kv.conv.len()];
        kv.row_delta_rows = vec![0; kv.delta.len()];
        Ok(true)
    }

    fn kv_restore_row(&self, kv: &mut CpuKv, row: usize) -> Result<()> {
        // Every layer a tracked call ran must have had the row (layers it did not run keep
        // their state either way).
        ensure!(
            row < kv.row_states.len()
                && kv
                    .row_conv_rows
                    .iter()
                    .chain(&kv.row_delta_rows)
                    .all(|&n| n == 0 || row < n)
                && kv.row_delta_rows.iter().any(|&n| n > 0),
            "kv_restore_row: no tracked call left a state after row {row}"
        );
        load_state(&mut kv.conv, &mut kv.delta, &kv.row_states[row]);
        Ok(())
    }

    fn causal_conv1d(
        &self,
        kv: &mut CpuKv,
        layer: usize,
        x: &Act<Vec<f32>>,
        w: &CpuWeight,
        out: &mut Act<Vec<f32>>,
        batch: Option<&StepBatch<Vec<i32>>>,
    ) -> Result<()> {
        let ds = kv.delta_shape(layer)?;
        let (c, kernel) = (ds.conv_dim(), ds.conv_kernel);
        check_shape("causal_conv1d x", x, x.rows, c)?;
        check_shape("causal_conv1d out", out, x.rows, c)?;
        ensure!(
            w.shape == [c, kernel],
            "causal_conv1d: weight {:?}, expected [{c}, {kernel}]",
            w.shape
        );
        let segs = crate::check_delta_batch("causal_conv1d", batch, x.rows, kv.state_slots)?;
        let wf = dequant_vec(w, c * kernel)?;
        let (len, _) = kv.state_lens();
        if let Some(segs) = segs {
            // Each sequence's rows on its own state slot, as a call on them alone.
            for sg in segs {
                let rows = sg.row0..sg.row0 + sg.rows;
                conv_rows(
                    &x.buf[rows.start * c..rows.end * c],
                    c,
                    kernel,
                    &wf,
                    &mut kv.conv[layer][sg.state * len..][..len],
                    &mut out.buf[rows.start * c..rows.end * c],
                );
            }
            return Ok(());
        }
        let n = out.len();
        let e = conv_rows(
            &x.buf[..x.len()],
            c,
            kernel,
            &wf,
            &mut kv.conv[layer],
            &mut out.buf[..n],
        );
        let hist = kernel - 1;
        if x.rows <= kv.row_states.len() {
            // The state after row t: the kernel - 1 inputs ending at it.
            for t in 0..x.rows {
                kv.row_states[t].0[layer].copy_from_slice(&e[(t + 1) * c..(t + 1 + hist) * c]);
            }
            kv.row_conv_rows[layer] = x.rows;
        }
        Ok(())
    }

    fn gated_delta_rule(
        &self,
        kv: &mut CpuKv,
        a: DeltaArgs<'_, Vec<f32>, CpuWeight>,
        out: &mut Act<Vec<f32>>,
        batch: Option<&StepBatch<Vec<i32>>>,
    ) -> Result<()> {
        let ds = kv.delta_shape(a.layer)?;
        ensure!(ds == a.shape, "gated_delta_rule: cache shape differs");
        let rows = a.qkv.rows;
        let nv = ds.n_v_heads;
        check_shape("gated_delta_rule qkv", a.qkv, rows, ds.conv_dim())?;
        check_shape("gated_delta_rule a", a.a, rows, nv)?;
        check_shape("gated_delta_rule b", a.b, rows, nv)?;
        check_shape("gated_delta_rule out", out, rows, ds.value_dim())?;
        let segs = crate::check_delta_batch("gated_delta_rule", batch, rows, kv.state_slots)?;
        let ssm_a = dequant_vec(a.ssm_a, nv)?;
        let dt_bias = dequant_vec(a.dt_bias, nv)?;
        if let Some(segs) = segs {
            // Each sequence's rows on its own state slot, as a call on them alone.
            let (_, len) = kv.state_lens();
            let (c, vd) = (ds.conv_dim(), ds.value_dim());
            for sg in segs {
                let r = sg.row0..sg.row0 + sg.rows;
                gated_delta::heads(
                    &ds,
                    sg.rows,
                    &a.qkv.buf[r.start * c..r.end * c],
                    &a.a.buf[r.start * nv..r.end * nv],
                    &a.b.buf[r.start * nv..r.end * nv],
                    &ssm_a,
                    &dt_bias,
                    self.chunked_delta,
                    &mut kv.delta[a.layer][sg.state * len..][..len],
                    &mut out.buf[r.start * vd..r.end * vd],
                    false,
                );
            }
            return Ok(());
        }
        let track = rows <= kv.row_states.len();
        let after = gated_delta::heads(
            &ds,
            rows,
            &a.qkv.buf,
            &a.a.buf,
            &a.b.buf,
            &ssm_a,
            &dt_bias,
            self.chunked_delta,
            &mut kv.delta[a.layer],
            &mut out.buf,
            track,
        );
        if track {
            let per_head = ds.k_head_dim * ds.v_head_dim;
            for (h, states) in after.iter().enumerate() {
                for (t, st) in states.chunks_exact(per_head).enumerate() {
                    kv.row_states[t].1[a.layer][h * per_head..][..per_head].copy_from_slice(st);
                }
            }
            kv.row_delta_rows[a.layer] = rows;
        }
        Ok(())
    }

    fn gated_rms_norm(
        &self,
        x: &mut Act<Vec<f32>>,
        z: &Act<Vec<f32>>,
        w: &CpuWeight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        check_shape("gated_rms_norm z", z, x.rows, x.cols)?;
        ensure!(
            x.cols.is_multiple_of(head_dim),
            "gated_rms_norm: {} columns is not a whole number of {head_dim}-heads",
            x.cols
        );
        let wf = dequant_vec(w, head_dim)?;
        let n = x.len();
        x.buf[..n]
            .par_chunks_mut(head_dim)
            .zip(z.buf[..n].par_chunks(head_dim))
            .for_each(|(h, zh)| {
                let src = h.to_vec();
                rms_norm_row(&src, &wf, eps, h);
                for (a, &g) in h.iter_mut().zip(zh) {
                    *a *= silu(g);
                }
            });
        Ok(())
    }

    fn sigmoid_gate(&self, x: &mut Act<Vec<f32>>, gate: &Act<Vec<f32>>) -> Result<()> {
        ensure!(
            gate.rows == x.rows && (gate.cols == x.cols || gate.cols == 1),
            "sigmoid_gate: gate [{}, {}] for x [{}, {}]",
            gate.rows,
            gate.cols,
            x.rows,
            x.cols
        );
        let cols = x.cols;
        for t in 0..x.rows {
            let row = &mut x.buf[t * cols..(t + 1) * cols];
            if gate.cols == 1 {
                let s = sigmoid(gate.buf[t]);
                row.iter_mut().for_each(|v| *v *= s);
            } else {
                for (v, &g) in row.iter_mut().zip(&gate.buf[t * cols..(t + 1) * cols]) {
                    *v *= sigmoid(g);
                }
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        kv: &mut CpuKv,
        step: &StepInput<Vec<i32>>,
        a: AttnArgs<'_, Vec<f32>>,
        out: &mut Act<Vec<f32>>,
    ) -> Result<()> {
        crate::check_attention(step, &a, out)?;
        let AttnArgs {
            layer,
            q,
            k,
            v,
            shape,
        } = a;
        let AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        let rows = q.rows;
        let kvd = n_kv_heads * head_dim;
        ensure!(
            layer < kv.k.len(),
            "attention: layer {layer} outside the cache"
        );
        ensure!(
            kv.shape.n_kv_heads == n_kv_heads && kv.shape.head_dim == head_dim,
            "attention: cache shape differs"
        );
        let positions = &step.positions[..rows];
        let max_pos = positions.iter().copied().max().unwrap_or(0);
        // Where position `p` of row `t`'s sequence lives: the cache row itself, or through
        // the block table of the row's sequence (paged caches, batched steps).
        let (batch, page_size, limit) = match kv.paged {
            Some((n_pages, page_size)) => {
                let b = crate::check_paged_step(step, n_pages, page_size)?;
                (Some(b), page_size, b.max_pages * page_size)
            }
            None => {
                crate::check_single_sequence_step(step)?;
                (None, 1, kv.capacity)
            }
        };
        ensure!(
            positions.iter().all(|&p| p >= 0) && (max_pos as usize) < limit,
            "context full: position {max_pos} but the cache holds {limit} positions"
        );
        let slot = |t: usize, p: usize| -> usize {
            match batch {
                Some(b) => {
                    let s = b.row_seq[t] as usize;
                    b.block_tables[s * b.max_pages + p / page_size] as usize * page_size
                        + p % page_size
                }
                None => p,
            }
        };

        for (t, &p) in positions.iter().enumerate() {
            let r = slot(t, p as usize);
            kv.k[layer][r * kvd..(r + 1) * kvd].copy_from_slice(&k.buf[t * kvd..(t + 1) * kvd]);
            kv.v[layer][r * kvd..(r + 1) * kvd].copy_from_slice(&v.buf[t * kvd..(t + 1) * kvd]);
        }
        let (kc, vc) = (&kv.k[layer], &kv.v[layer]);
        let group = n_heads / n_kv_heads;
        let scale = 1.0 / (head_dim as f32).sqrt();

        // One task per (query row, head): scores over positions 0..=pos, softmax, Σ p·v.
        let n = out.len();
        out.buf[..n]
            .par_chunks_mut(head_dim)
            .enumerate()
            .for_each(|(i, o)| {
                let (t, h) = (i / n_heads, i % n_heads);
                let qh = &q.buf[t * n_heads * head_dim + h * head_dim..][..head_dim];
                let off = (h / group) * head_dim;
                let n_pos = positions[t] as usize + 1;
                let mut scores: Vec<f32> = (0..n_pos)
                    .map(|p| {
                        let kh = &kc[slot(t, p) * kvd + off..][..head_dim];
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for s in &mut scores {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                o.fill(0.0);
                for (p, &s) in scores.iter().enumerate() {
                    let w = s / sum;
                    let vh = &vc[slot(t, p) * kvd + off..][..head_dim];
                    for (a, &b) in o.iter_mut().zip(vh) {
                        *a += w * b;
                    }
                }
            });
        Ok(())
    }

    fn moe(
        &self,
        x: &Act<Vec<f32>>,
        router_logits: &Act<Vec<f32>>,
        experts: ExpertWeights<'_, CpuWeight>,
        routing: MoeRouting,
        out: &mut Act<Vec<f32>>,
    ) -> Result<()> {
        let rows = x.rows;
        let hidden = x.cols;
        let ffn = crate::check_moe(
            x,
            router_logits,
            [&experts.gate.shape, &experts.up.shape, &experts.down.shape],
            &routing,
            out,
        )?;

        let routes: Vec<Vec<(usize, f32)>> = router_logits.buf[..router_logits.len()]
            .chunks(routing.n_experts)
            .map(|l| route_top_k(l, &routing))
            .collect();

        // Group (token, slot) pairs by expert so each expert's weights are read once per step.
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); routing.n_experts];
        for (t, r) in routes.iter().enumerate() {
            for (slot, &(e, _)) in r.iter().enumerate() {
                by_expert[e].push((t, slot));
            }
        }
        // y[(t, slot)] = down_e(silu(gate_e x_t) * up_e x_t)
        let mut y = vec![0f32; rows * routing.top_k * hidden];
        fn expert_bytes(w: &CpuWeight, e: usize, n: usize) -> &[u8] {
            let per = w.data.len() / n;
            &w.data[e * per..(e + 1) * per]
        }
        let ne = routing.n_experts;
        for (e, members) in by_expert.iter().enumerate() {
            if members.is_empty() {
                continue;
            }
            let n = members.len();
            let mut xs = Vec::with_capacity(n * hidden);
            for &(t, _) in members {
                xs.extend_from_slice(&x.buf[t * hidden..(t + 1) * hidden]);
            }
            let mut g = vec![0f32; n * ffn];
            let mut u = vec![0f32; n * ffn];
            matmul_raw(
                experts.gate.dtype,
                expert_bytes(experts.gate, e, ne),
                ffn,
                hidden,
                &xs,
                n,
                &mut g,
            );
            matmul_raw(
                experts.up.dtype,
                expert_bytes(experts.up, e, ne),
                ffn,
                hidden,
                &xs,
                n,
                &mut u,
            );
            for (gi, &ui) in g.iter_mut().zip(&u) {
                *gi = silu(*gi) * ui;
            }
            let mut d = vec![0f32; n * hidden];
            matmul_raw(
                experts.down.dtype,
                expert_bytes(experts.down, e, ne),
                hidden,
                ffn,
                &g,
                n,
                &mut d,
            );
            for (j, &(t, slot)) in members.iter().enumerate() {
                y[(t * routing.top_k + slot) * hidden..][..hidden]
                    .copy_from_slice(&d[j * hidden..(j + 1) * hidden]);
            }
        }
        // Combine in top-k order per token: independent of batch composition.
        for (t, r) in routes.iter().enumerate() {
            let o = &mut out.buf[t * hidden..(t + 1) * hidden];
            o.fill(0.0);
            for (slot, &(_, w)) in r.iter().enumerate() {
                for (a, &b) in o
                    .iter_mut()
                    .zip(&y[(t * routing.top_k + slot) * hidden..][..hidden])
                {
                    *a += w * b;
                }
            }
        }
        Ok(())
    }

    fn argmax(&self, logits: &Act<Vec<f32>>, out: &mut Vec<i32>) -> Result<()> {
        ensure!(
            out.len() >= logits.rows,
            "argmax: {} rows into {}",
            logits.rows,
            out.len()
        );
        for (t, row) in logits.buf[..logits.len()].chunks(logits.cols).enumerate() {
            out[t] = argmax_row(row) as i32;
        }
        Ok(())
    }

    fn argmax_feed(
        &self,
        logits: &Act<Vec<f32>>,
        out: &mut Vec<i32>,
        step: &mut StepInput<Vec<i32>>,
        log: &mut Vec<i32>,
        log_len: usize,
    ) -> Result<()> {
        crate::check_argmax_feed(
            logits,
            log_len,
            log.len(),
            step.tokens.len(),
            step.positions.len(),
        )?;
        self.argmax(logits, out)?;
        let p = step.positions[0] + 1;
        step.tokens[0] = out[0];
        step.positions[0] = p;
        log[usize::try_from(p)? % log_len] = out[0];
        step.pos0 += 1;
        Ok(())
    }

    fn top_k(
        &self,
        logits: &Act<Vec<f32>>,
        k: usize,
        ids: &mut Vec<i32>,
        vals: &mut Act<Vec<f32>>,
    ) -> Result<()> {
        crate::check_top_k(logits, k, ids.len(), vals)?;
        for (t, row) in logits.buf[..logits.len()].chunks(logits.cols).enumerate() {
            for (j, (i, v)) in top_k_row(row, k).into_iter().enumerate() {
                ids[t * k + j] = i as i32;
                vals.buf[t * k + j] = v;
            }
        }
        Ok(())
    }

    fn read_i32(&self, x: &Vec<i32>, n: usize) -> Result<Vec<i32>> {
        ensure!(n <= x.len(), "read_i32: {n} of {}", x.len());
        Ok(x[..n].to_vec())
    }

    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<()>> {
        f()?;
        Ok(None)
    }

    fn replay(&self, _g: &()) -> Result<()> {
        Ok(())
    }
}

/// The `k` best `(index, value)` of a row: value descending, ties to the lower index, NaN
/// ranked as -inf.
pub fn top_k_row(v: &[f32], k: usize) -> Vec<(usize, f32)> {
    let key = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let mut idx: Vec<usize> = (0..v.len()).collect();
    let cmp = |a: &usize, b: &usize| key(v[*b]).total_cmp(&key(v[*a])).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(cmp);
    idx.into_iter().map(|i| (i, v[i])).collect()
}

/// Index of the largest value; ties (and NaN) resolve to the lower index.
pub fn argmax_row(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// `inv_freq[i] = theta^(-2i/rot_dim)`, computed in f32 as Hugging Face computes it, or the
/// table a scaling set ([`Rope::inv_freq`]).
pub fn rope_inv_freq(rope: &Rope) -> Vec<f32> {
    if let Some(t) = &rope.inv_freq {
        return t.to_vec();
    }
    Rope::unscaled_inv_freq(rope.theta, rope.rot_dim).collect()
}

/// `(cos, sin)` of every rotary frequency at `pos` (angle `pos · inv_freq` in f32).
fn rope_cos_sin(inv_freq: &[f32], pos: i32) -> Vec<(f32, f32)> {
    let pos = pos as f32;
    inv_freq
        .iter()
        .map(|&f| {
            let a = pos * f;
            (a.cos(), a.sin())
        })
        .collect()
}

/// Rotates one head in place by the angles `cs` (the leading `2 · cs.len()` dimensions).
fn rope_head(h: &mut [f32], cs: &[(f32, f32)], rope: &Rope) {
    let half = rope.rot_dim / 2;
    for (i, &(c, s)) in cs.iter().enumerate() {
        let (a, b) = match rope.style {
            RopeStyle::Adjacent => (2 * i, 2 * i + 1),
            RopeStyle::Neox => (i, i + half),
        };
        let (x0, x1) = (h[a], h[b]);
        h[a] = x0 * c - x1 * s;
        h[b] = x0 * s + x1 * c;
    }
}

/// A 1-D weight (norm scale) as f32.
fn dequant_vec(w: &CpuWeight, n: usize) -> Result<Vec<f32>> {
    let len: usize = w.shape.iter().product();
    ensure!(len == n, "norm weight has {len} elements, expected {n}");
    let mut out = vec![0f32; n];
    quant::dequantize(w.dtype, &w.data, &mut out)?;
    Ok(out)
}
