//! The Backend trait: the coarse operations a decoder-only transformer is made of, and the
//! CPU reference backend ([`cpu::CpuBackend`]) that implements them in plain f32.
//!
//! The model files (crate `ferrite-models`) are written against this trait only, so the same
//! forward pass runs on every backend, and every fast backend can be checked op by op against
//! the CPU one (`ferrite check`).
//!
//! Conventions shared by every op:
//! - Activations are f32 matrices stored row-major in a backend buffer: one row per token.
//!   Their shape travels with them in [`Act`].
//! - A weight matrix is `[n_out, n_in]` (PyTorch's `nn.Linear` layout) stored in its file
//!   type (quantized weights stay quantized); `matmul` computes `y[t] = W x[t]`.
//! - Positions are absolute token positions in the sequence (for RoPE and the causal mask).

pub mod cpu;
pub mod cuda;
pub mod gated_delta;

use anyhow::{Context, Result};
use ferrite_formats::GgmlType;

/// A weight as read from a model file, before it is handed to a backend.
#[derive(Clone, Debug)]
pub struct HostTensor<'a> {
    pub dtype: GgmlType,
    /// Row-major shape: the last dimension is contiguous.
    pub shape: Vec<usize>,
    pub data: std::borrow::Cow<'a, [u8]>,
}

impl HostTensor<'_> {
    /// Checks that the bytes hold exactly the shape's elements in whole blocks (the check
    /// every backend's `upload` makes); returns the element count.
    pub fn validate(&self) -> Result<usize> {
        let n: usize = self.shape.iter().product();
        let want = self.dtype.bytes_for(n)?;
        anyhow::ensure!(
            self.data.len() == want,
            "weight of shape {:?} {} has {} bytes, expected {}",
            self.shape,
            self.dtype,
            self.data.len(),
            want
        );
        let row = self.shape.last().copied().unwrap_or(1);
        anyhow::ensure!(
            row % self.dtype.block_size() == 0,
            "row length {row} is not a multiple of the {} block size",
            self.dtype
        );
        Ok(n)
    }
}

/// Activation matrix `[rows, cols]` in backend memory. The buffer may hold more rows than
/// are active (`capacity`): workspaces are allocated once for the largest step and reused,
/// so a decode step can be captured in a CUDA graph and replayed with the same buffers.
#[derive(Clone, Debug)]
pub struct Act<B> {
    pub buf: B,
    /// Active rows (tokens in this step).
    pub rows: usize,
    pub cols: usize,
    /// Rows the buffer can hold.
    pub capacity: usize,
}

impl<B> Act<B> {
    /// Changes the number of active rows (≤ capacity).
    pub fn set_rows(&mut self, rows: usize) -> Result<()> {
        anyhow::ensure!(
            rows <= self.capacity,
            "{rows} rows do not fit in a buffer of {}",
            self.capacity
        );
        self.rows = rows;
        Ok(())
    }
    /// Active element count.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The inputs of one forward step in backend memory: token ids and their absolute positions
/// (one per row). Ops read positions from here rather than from host arguments, so one
/// captured decode step replays correctly at every position.
///
/// A step holds the rows of one sequence ([`Backend::set_step`]) or, in a batched step over a
/// paged KV cache ([`Backend::set_batch`]), the rows of several: then `batch` says which
/// sequence each row belongs to and where that sequence's pages are. Every op but attention
/// (and RoPE, which reads the per-row positions) is row-wise, so it needs nothing more.
pub struct StepInput<I> {
    pub tokens: I,
    pub positions: I,
    /// Active rows.
    pub rows: usize,
    /// Position of the first row (host copy, for shape checks and the CPU backend).
    pub pos0: usize,
    pub capacity: usize,
    /// The sequence/page mapping of batched steps (`None` for single-sequence step inputs).
    pub batch: Option<StepBatch<I>>,
}

/// The per-row sequence and per-sequence page mapping of a batched step, in backend memory
/// (written by [`Backend::set_batch`] outside graph capture, like the tokens and positions,
/// so a captured batched decode step replays for new positions and pages).
pub struct StepBatch<I> {
    /// Per row: the index of its sequence in the step (i32, `capacity` rows).
    pub row_seq: I,
    /// Block tables, `[max_seqs][max_pages]` page ids (i32): entry `j` of sequence `s` is the
    /// page holding its positions `j·page_size .. (j+1)·page_size`.
    pub block_tables: I,
    /// Per sequence `[row0, rows, state slot]` (i32, `[max_seqs][3]`): where its rows sit and
    /// which linear-attention state it continues ([`Segment`] on the device; read by the
    /// Gated DeltaNet ops of a hybrid model's batched step).
    pub seg_info: I,
    pub max_seqs: usize,
    pub max_pages: usize,
    /// Positions per page (a power of two); must equal the paged cache's.
    pub page_size: usize,
    /// Host copy of the step's layout, one entry per sequence in row order; empty after a
    /// single-sequence [`Backend::set_step`].
    pub segs: Vec<Segment>,
    /// Largest page id the step's block tables use (checked against the cache).
    pub max_page: usize,
}

impl<I> StepBatch<I> {
    /// The layout of an empty batched step over buffers `row_seq` (`capacity` rows) and
    /// `block_tables` (`max_seqs × max_pages`) the backend allocated. Both backends'
    /// [`Backend::batch_step_input`] build theirs here, so the checks are the same.
    pub fn new(
        row_seq: I,
        block_tables: I,
        seg_info: I,
        max_seqs: usize,
        max_pages: usize,
        page_size: usize,
    ) -> Result<Self> {
        anyhow::ensure!(
            page_size.is_power_of_two(),
            "page size {page_size} is not a power of two"
        );
        Ok(StepBatch {
            row_seq,
            block_tables,
            seg_info,
            max_seqs,
            max_pages,
            page_size,
            segs: vec![],
            max_page: 0,
        })
    }
}

/// Where one sequence's rows sit in a batched step (host side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First row of the sequence in the step.
    pub row0: usize,
    /// Its rows (consecutive tokens).
    pub rows: usize,
    /// Position of its first row.
    pub pos0: usize,
    /// How many of its last rows' logits the step returns ([`SeqRows::logits`]).
    pub logits: usize,
    /// Its linear-attention state slot ([`SeqRows::state`]).
    pub state: usize,
}

/// One sequence's part of a batched step (the input of [`Backend::set_batch`]).
#[derive(Clone, Copy, Debug)]
pub struct SeqRows<'a> {
    /// Its tokens in this step, at positions `pos0..pos0 + tokens.len()`.
    pub tokens: &'a [u32],
    pub pos0: usize,
    /// Its block table: page `pages[j]` holds positions `j·page_size..(j+1)·page_size`. Must
    /// cover every position up to the step's last row of the sequence.
    pub pages: &'a [u32],
    /// How many of its last rows' logits the step returns (the model's `Logits::SeqLast`):
    /// 1 (a decode row, a prefill chunk's last row), or all of them (a speculative verify:
    /// its token and its drafts). At least 1, at most its rows.
    pub logits: usize,
    /// The slot of the cache's linear-attention state pool this sequence continues
    /// ([`Backend::kv_new_paged_hybrid`]; cleared for a new sequence by
    /// [`Backend::kv_clear_state`]). Two sequences of one step must not share a slot. Caches
    /// without linear-attention state ignore it.
    pub state: usize,
}

/// Size of a paged KV cache ([`Backend::kv_new_paged`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedKv {
    /// Pages in the pool, shared by all sequences.
    pub n_pages: usize,
    /// Positions per page (a power of two).
    pub page_size: usize,
    /// Pages one sequence may hold (its block table's length; bounds its context).
    pub max_pages: usize,
    /// Most rows of one batched decode step (sizes the backend's split-K scratch).
    pub max_rows: usize,
    /// Store keys and values as q8_0 blocks where the backend has such a cache (CUDA; needs
    /// head_dim % 32 == 0); otherwise the backend's default type (the CPU keeps f32).
    pub q8_0: bool,
}

/// The host-side contents of a batched step, validated: what [`Backend::set_batch`] copies
/// to the device. Shared by the backends so they accept and reject the same inputs.
pub struct BatchLayout {
    pub tokens: Vec<i32>,
    pub positions: Vec<i32>,
    pub row_seq: Vec<i32>,
    /// `[seqs.len()][max_pages]`, unused entries 0.
    pub block_tables: Vec<i32>,
    /// `[seqs.len()][3]`: each sequence's first row, rows and state slot.
    pub seg_info: Vec<i32>,
    pub segs: Vec<Segment>,
    pub max_page: usize,
}

impl BatchLayout {
    /// Lays out `seqs` for a step input of `capacity` rows, `max_seqs` sequences and
    /// `max_pages` pages of `page_size` per sequence.
    pub fn new(
        seqs: &[SeqRows<'_>],
        capacity: usize,
        max_seqs: usize,
        max_pages: usize,
        page_size: usize,
    ) -> Result<BatchLayout> {
        anyhow::ensure!(
            !seqs.is_empty(),
            "a batched step needs at least one sequence"
        );
        anyhow::ensure!(
            seqs.len() <= max_seqs,
            "{} sequences in a step of at most {max_seqs}",
            seqs.len()
        );
        let rows: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        anyhow::ensure!(
            rows <= capacity,
            "{rows} rows in a step of at most {capacity}"
        );
        let mut l = BatchLayout {
            tokens: Vec::with_capacity(rows),
            positions: Vec::with_capacity(rows),
            row_seq: Vec::with_capacity(rows),
            block_tables: vec![0; seqs.len() * max_pages],
            seg_info: Vec::with_capacity(3 * seqs.len()),
            segs: Vec::with_capacity(seqs.len()),
            max_page: 0,
        };
        for (i, s) in seqs.iter().enumerate() {
            let n = s.tokens.len();
            anyhow::ensure!(n > 0, "sequence {i} of the step has no tokens");
            let end = s.pos0 + n;
            anyhow::ensure!(
                s.pages.len() <= max_pages && end <= s.pages.len() * page_size,
                "sequence {i} reaches position {} but its {} pages of {page_size} hold {}                  (at most {max_pages} pages)",
                end - 1,
                s.pages.len(),
                s.pages.len() * page_size
            );
            anyhow::ensure!(
                (1..=n).contains(&s.logits),
                "sequence {i} of the step asks for {} rows' logits of its {n}",
                s.logits
            );
            anyhow::ensure!(
                !seqs[..i].iter().any(|o| o.state == s.state),
                "sequences of one step share linear-attention state slot {}",
                s.state
            );
            let state = i32::try_from(s.state)
                .map_err(|_| anyhow::anyhow!("state slot {} does not fit in i32", s.state))?;
            l.seg_info.extend([l.tokens.len() as i32, n as i32, state]);
            l.segs.push(Segment {
                row0: l.tokens.len(),
                rows: n,
                pos0: s.pos0,
                logits: s.logits,
                state: s.state,
            });
            for (j, &t) in s.tokens.iter().enumerate() {
                l.tokens.push(
                    i32::try_from(t)
                        .map_err(|_| anyhow::anyhow!("token id {t} does not fit in i32"))?,
                );
                l.positions.push(
                    i32::try_from(s.pos0 + j)
                        .map_err(|_| anyhow::anyhow!("position does not fit in i32"))?,
                );
                l.row_seq.push(i as i32);
            }
            for (j, &p) in s.pages.iter().enumerate() {
                l.block_tables[i * max_pages + j] = i32::try_from(p)
                    .map_err(|_| anyhow::anyhow!("page id {p} does not fit in i32"))?;
                l.max_page = l.max_page.max(p as usize);
            }
        }
        Ok(l)
    }
}

/// How rotary embeddings pair the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(x[2i], x[2i+1])`: ggml's "normal" mode, used for GGUF `llama` files, whose
    /// Q/K rows llama.cpp's converter permuted from the Hugging Face order.
    Adjacent,
    /// Pairs `(x[i], x[i + d/2])`: Hugging Face `rotate_half`, ggml's "NeoX" mode.
    Neox,
}

/// Rotary position embedding parameters.
#[derive(Clone, Debug)]
pub struct Rope {
    pub style: RopeStyle,
    pub theta: f32,
    /// Number of leading dimensions of each head that rotate (= head_dim unless partial).
    pub rot_dim: usize,
    /// The rotary frequencies where a scaling sets them (`rot_dim / 2` of them; Llama 3.1's
    /// "llama3" scaling slows the long wavelengths). `None`: `theta^(-2i / rot_dim)`.
    pub inv_freq: Option<std::sync::Arc<[f32]>>,
}

impl Rope {
    /// `theta^(-2i / rot_dim)` for each rotated pair, in f32 as Hugging Face computes it: the
    /// frequencies without a scaling, and what a scaling's table is made from.
    pub fn unscaled_inv_freq(theta: f32, rot_dim: usize) -> impl Iterator<Item = f32> {
        (0..rot_dim / 2).map(move |i| 1.0 / theta.powf((2 * i) as f32 / rot_dim as f32))
    }
}

/// The arguments of [`Backend::qk_norm_rope`] after its q and k, for the ops that include it
/// ([`Backend::qk_norm_rope_attention`]).
#[derive(Clone, Copy)]
pub struct QkRope<'a, W, I> {
    pub q_norm: Option<&'a W>,
    pub k_norm: Option<&'a W>,
    pub head_dim: usize,
    pub eps: f32,
    pub step: &'a StepInput<I>,
    pub rope: &'a Rope,
}

/// [`Backend::qk_norm_rope_attention`] as its two ops: [`Backend::qk_norm_rope`] on q and k in
/// place, then [`Backend::attention`] (the trait's default, and a backend's own fallback).
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_then_attention<B: Backend + ?Sized>(
    be: &B,
    kv: &mut B::Kv,
    qk: QkRope<'_, B::Weight, B::IBuf>,
    (q, k, v): QkvMut<'_, B::Buf>,
    layer: usize,
    shape: AttnShape,
    out: &mut Act<B::Buf>,
    readers: &[&B::Weight],
) -> Result<()> {
    be.qk_norm_rope(
        q,
        k,
        qk.q_norm,
        qk.k_norm,
        qk.head_dim,
        qk.eps,
        qk.step,
        qk.rope,
    )?;
    be.attention_for(
        kv,
        qk.step,
        AttnArgs {
            layer,
            q,
            k,
            v,
            shape,
        },
        out,
        readers,
    )
}

/// An attention layer's q, k (both rotated in place by [`Backend::qk_norm_rope`]) and v.
pub type QkvMut<'a, B> = (&'a mut Act<B>, &'a mut Act<B>, &'a Act<B>);

/// Shape of a (grouped-query) attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Mixture-of-experts routing parameters.
#[derive(Clone, Copy, Debug)]
pub struct MoeRouting {
    pub n_experts: usize,
    pub top_k: usize,
    /// Renormalise the top-k routing weights to sum to 1 (`norm_topk_prob`).
    pub norm_topk: bool,
}

/// Where in a layer's mixer half (its attention, or Gated DeltaNet) the decoder stands, for
/// [`Backend::moe_prefetch_at`]: a hint about when DRAM has room for the layer's predicted
/// experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerPoint {
    /// The mixer's input projections (Q, K, V; a Gated DeltaNet's in-projections) launched.
    Projected,
    /// Its core (the attention; the delta rule) launched.
    Mixed,
}

/// Shape of a Gated DeltaNet (linear attention) layer: `n_k_heads` query/key heads of
/// `k_head_dim`, `n_v_heads` value heads of `v_head_dim` (a multiple of the key heads), and
/// the short causal convolution's kernel length. The convolution runs over the concatenated
/// `[q | k | v]` channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    /// How value heads share key heads. Hugging Face groups them (value head `h` reads key
    /// head `h / (n_v_heads / n_k_heads)`); llama.cpp's converter reorders the value heads
    /// of GGUF files to tiled order (value head `h` reads key head `h % n_k_heads`) so ggml
    /// can broadcast. Every per-value-head weight follows the same order, so only this
    /// mapping differs.
    pub tiled_v_heads: bool,
}

impl DeltaShape {
    /// The key head value head `h` reads.
    pub fn k_head_of(&self, h: usize) -> usize {
        if self.tiled_v_heads {
            h % self.n_k_heads
        } else {
            h / (self.n_v_heads / self.n_k_heads)
        }
    }
    /// Width of the query (and of the key) block: `n_k_heads * k_head_dim`.
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.k_head_dim
    }
    /// Width of the value block and of the output: `n_v_heads * v_head_dim`.
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.v_head_dim
    }
    /// Channels of the convolution: `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Floats of one layer's convolution state: the last `conv_kernel - 1` inputs of every
    /// channel.
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
    }
    /// Floats of one layer's recurrent state: `[k_head_dim, v_head_dim]` per value head.
    pub fn recurrent_state_len(&self) -> usize {
        self.n_v_heads * self.k_head_dim * self.v_head_dim
    }
}

/// The operands of one Gated DeltaNet call (after the convolution).
pub struct DeltaArgs<'a, B, W> {
    /// Index of this linear-attention layer among the model's linear-attention layers.
    pub layer: usize,
    /// `[rows, conv_dim]`: `[q | k | v]` after the convolution and SiLU.
    pub qkv: &'a Act<B>,
    /// `[rows, n_v_heads]`: the decay input (`in_proj_a`).
    pub a: &'a Act<B>,
    /// `[rows, n_v_heads]`: the write-strength logits (`in_proj_b`).
    pub b: &'a Act<B>,
    /// `[n_v_heads]`: `-exp(A_log)` (GGUF stores it so: `ssm_a`).
    pub ssm_a: &'a W,
    /// `[n_v_heads]`: the bias added to `a` before the softplus.
    pub dt_bias: &'a W,
    pub shape: DeltaShape,
}

/// The three stacked expert matrices of one MoE layer, each `[n_experts, n_out, n_in]` (a
/// shared expert's, [`Backend::moe_shared`]: `[n_out, n_in]`).
pub struct ExpertWeights<'a, W> {
    pub gate: &'a W,
    pub up: &'a W,
    pub down: &'a W,
}

// References only: copyable whatever W is (a derive would ask W: Copy).
impl<W> Clone for ExpertWeights<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<W> Copy for ExpertWeights<'_, W> {}

/// The operations a model is made of. Implemented by the CPU reference backend and by the
/// accelerated backends; `ferrite check` compares every implementation against the CPU one.
pub trait Backend: Send + Sync {
    /// A device buffer of f32 values.
    type Buf: Send + Sync;
    /// A device buffer of i32 values (token ids, positions).
    type IBuf: Send + Sync;
    /// A stored weight tensor (any [`GgmlType`]) in device memory.
    type Weight: Send + Sync;
    /// One sequence's key/value cache for every layer.
    type Kv: Send + Sync;
    /// A captured sequence of ops that can be replayed (a CUDA graph).
    type Graph;

    /// Short human-readable name ("cpu (2 threads)", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;

    /// The device's name for reports ("NVIDIA H200", the CPU model).
    fn device_name(&self) -> String;
    /// Measured copy bandwidth in bytes/s, counting bytes read plus bytes written: the
    /// ceiling the bandwidth roofline is computed against.
    fn copy_bandwidth(&self) -> Result<f64>;
    /// Device memory (used, total) in bytes, where the backend has its own memory.
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }
    /// Bytes per cached key or value element (4 for f32, 2 for f16, ~1.06 for q8_0).
    fn kv_bytes_per_element(&self) -> f64;
    /// Readies a model's rotation before its first step: CUDA copies a RoPE scaling's
    /// frequency table ([`Rope::inv_freq`]) to the device here, so that a captured step never
    /// copies it. The rotary ops take any rotation without it; it only moves the copy.
    fn load_rope(&self, _rope: &Rope) -> Result<()> {
        Ok(())
    }

    /// Moves a weight into backend memory, keeping its storage type.
    fn upload(&self, t: &HostTensor<'_>) -> Result<Self::Weight>;
    /// Bytes `t` takes once uploaded (the backend may hold a type in another: the CUDA
    /// backend's MXFP4 as Q8_0, 1-D weights as f32). What a decode step reads of it.
    fn held_bytes(&self, t: &HostTensor<'_>) -> u64 {
        t.data.len() as u64
    }
    /// Moves a stacked-experts weight (experts × rows × columns) into backend memory, or,
    /// once the budget [`Backend::set_expert_budget`] set is spent, into host memory that
    /// the backend's kernels read in place (a GPU over its bus). Backends whose memory is
    /// the host's upload it as any other weight.
    fn upload_experts(&self, t: &HostTensor<'_>) -> Result<Self::Weight> {
        self.upload(t)
    }
    /// How many bytes of stacked experts [`Backend::upload_experts`] may place in device
    /// memory from now on (`None`: no limit, the default). Ignored by backends without
    /// memory of their own.
    fn set_expert_budget(&self, _bytes: Option<u64>) {}
    /// Bytes of stacked experts held in host memory rather than device memory so far.
    fn host_expert_bytes(&self) -> u64 {
        0
    }
    /// A zero-filled activation matrix with `rows` active rows and that capacity.
    fn zeros(&self, rows: usize, cols: usize) -> Result<Act<Self::Buf>>;
    /// A step input buffer for up to `capacity` rows.
    fn step_input(&self, capacity: usize) -> Result<StepInput<Self::IBuf>>;
    /// Writes the token ids of the next step; row `t` is at position `pos0 + t`.
    /// Runs outside graph capture (it is the host→device input of a step).
    fn set_step(&self, step: &mut StepInput<Self::IBuf>, tokens: &[u32], pos0: usize)
        -> Result<()>;
    /// A step input for batched steps ([`Backend::set_batch`]) of up to `capacity` rows from
    /// up to `max_seqs` sequences, each with a block table of up to `max_pages` pages of
    /// `page_size` positions.
    fn batch_step_input(
        &self,
        capacity: usize,
        max_seqs: usize,
        max_pages: usize,
        page_size: usize,
    ) -> Result<StepInput<Self::IBuf>>;
    /// Writes a batched step: the rows of `seqs` one sequence after the other, each with its
    /// positions and block table (laid out by [`BatchLayout::new`]). Runs outside graph
    /// capture. The step must come from [`Backend::batch_step_input`].
    fn set_batch(&self, step: &mut StepInput<Self::IBuf>, seqs: &[SeqRows<'_>]) -> Result<()>;
    /// An activation matrix holding `data` (row-major). (A method: the backend allocates it.)
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<Act<Self::Buf>>;
    /// Copies the active rows of an activation matrix back to the host.
    fn to_host(&self, x: &Act<Self::Buf>) -> Result<Vec<f32>>;

    /// `out[t] = table[tokens[t]]` (rows of the embedding matrix, dequantized).
    fn embed(
        &self,
        table: &Self::Weight,
        step: &StepInput<Self::IBuf>,
        out: &mut Act<Self::Buf>,
    ) -> Result<()>;
    /// `out = x / rms(x) * w` row by row (`w` has `cols` elements).
    fn rms_norm(
        &self,
        x: &Act<Self::Buf>,
        w: &Self::Weight,
        eps: f32,
        out: &mut Act<Self::Buf>,
    ) -> Result<()>;
    /// RMSNorm applied to each `head_dim`-sized head of every row in place (Qwen3's QK-norm).
    fn head_rms_norm(
        &self,
        x: &mut Act<Self::Buf>,
        w: &Self::Weight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// `out[t] = W x[t]` for a weight `[n_out, n_in]`; `out` is `[rows, n_out]`.
    fn matmul(&self, x: &Act<Self::Buf>, w: &Self::Weight, out: &mut Act<Self::Buf>) -> Result<()>;

    /// `outs[i] = ws[i] · x` for several weights reading the same `x` (the Q, K and V
    /// projections). Same results as one `matmul` each; a backend may share the preparation
    /// of `x` (the CUDA decode GEMV quantizes it once).
    fn matmuls(
        &self,
        x: &Act<Self::Buf>,
        ws: &[&Self::Weight],
        outs: &mut [&mut Act<Self::Buf>],
    ) -> Result<()> {
        anyhow::ensure!(
            ws.len() == outs.len(),
            "matmuls: {} weights, {} outputs",
            ws.len(),
            outs.len()
        );
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(x, w, out)?;
        }
        Ok(())
    }

    /// `act = silu(gate · x) ⊙ (up · x)`, the first half of a SwiGLU FFN. `g` and `u` are
    /// scratch for the two projections; a backend that fuses the three steps into one kernel
    /// may leave them untouched.
    fn matmul_swiglu(
        &self,
        x: &Act<Self::Buf>,
        gate: &Self::Weight,
        up: &Self::Weight,
        (g, u): (&mut Act<Self::Buf>, &mut Act<Self::Buf>),
        act: &mut Act<Self::Buf>,
    ) -> Result<()> {
        self.matmul(x, gate, g)?;
        self.matmul(x, up, u)?;
        self.swiglu(g, u, act)
    }
    /// The SwiGLU MLP `out = down · (silu(gate · x) ⊙ (up · x))`: [`Backend::matmul_swiglu`]
    /// into `act`, then [`Backend::matmul`] of `down`. `g`, `u` and `act` are scratch; a
    /// backend may leave `act` holding what its down projection read instead of the f32
    /// activations (CUDA's prefill: their 16-bit rounding, written by the gate/up launch in
    /// place of the f32 rows and the down's conversion of them). `out` equals the composition's
    /// bitwise.
    #[allow(clippy::too_many_arguments)]
    fn swiglu_mlp(
        &self,
        x: &Act<Self::Buf>,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
        gu: (&mut Act<Self::Buf>, &mut Act<Self::Buf>),
        act: &mut Act<Self::Buf>,
        out: &mut Act<Self::Buf>,
    ) -> Result<()> {
        self.matmul_swiglu(x, gate, up, gu, act)?;
        self.matmul(act, down, out)
    }
    /// [`Backend::swiglu_mlp`] added to the residual: `res += down · SwiGLU(x)`, `out` scratch
    /// (the composition: `swiglu_mlp` into `out`, then [`Backend::add_assign`]). A backend whose
    /// down adds in its GEMM's epilogue ([`Backend::adds_in_epilogue`]) writes no `out`.
    #[allow(clippy::too_many_arguments)]
    fn swiglu_mlp_add(
        &self,
        x: &Act<Self::Buf>,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
        gu: (&mut Act<Self::Buf>, &mut Act<Self::Buf>),
        act: &mut Act<Self::Buf>,
        res: &mut Act<Self::Buf>,
        out: &mut Act<Self::Buf>,
    ) -> Result<()> {
        self.swiglu_mlp(x, gate, up, down, gu, act, out)?;
        self.add_assign(res, out)
    }
    /// Whether [`Backend::matmul_add`] of `w` on `rows` rows (and [`Backend::swiglu_mlp_add`]
    /// with `w` as its down) adds the residual in the projection's own epilogue, so that a
    /// decoder does better with it and a plain RMSNorm after ([`Backend::rms_norm_for`]) than
    /// with the projection and an add + RMSNorm (CUDA: 16-bit weights at prefill rows on
    /// cuBLASLt, where the f32 output is no longer written and read back). The sum is the same
    /// f32 addition either way; the projection's own summation order may differ from its plain
    /// call's (another GEMM algorithm), within the matmul's tolerance. The CPU backend: never.
    fn adds_in_epilogue(&self, w: &Self::Weight, rows: usize) -> bool {
        let _ = (w, rows);
        false
    }
    /// Whether [`Backend::rms_norm_matmuls`] and [`Backend::rms_norm_matmul_swiglu`] on
    /// `rows` rows of every one of `ws` defer the RMSNorm into the projection (no norm
    /// launch: `rms_norm(x) · n · W = s · ((x ⊙ n) · W)` with `s = 1 / rms(x)` per row,
    /// applied after the dot products). A decoder that gets `true` for all of a layer's
    /// consumers of normed activations fuses the residual adds into the projections before
    /// them ([`Backend::matmul_add`]), so no norm or add runs on its own. The CPU backend:
    /// never (it keeps the reference order of operations).
    fn defers_rms_norm(&self, ws: &[&Self::Weight], rows: usize) -> bool {
        let _ = (ws, rows);
        false
    }

    /// `out += x · wᵀ`: a projection added to the residual stream in its own epilogue.
    /// `y` is scratch for the projection (a backend that adds in the kernel leaves it
    /// untouched). Equals `matmul(x, w, y)` followed by `add_assign(out, y)` bitwise, but
    /// where [`Backend::adds_in_epilogue`] (there the projection's sums within its tolerance).
    fn matmul_add(
        &self,
        x: &Act<Self::Buf>,
        w: &Self::Weight,
        out: &mut Act<Self::Buf>,
        y: &mut Act<Self::Buf>,
    ) -> Result<()> {
        self.matmul(x, w, y)?;
        self.add_assign(out, y)
    }

    /// Whether, on `rows` rows, [`Backend::matmul_add_for_norm`] with `producer` can hand
    /// the next RMSNorm's input to [`Backend::rms_norm_matmul_swiglu`] of `consumers` (gate,
    /// up) or to [`Backend::rms_norm_matmuls`] of `consumers` (the next layer's Q, K, V)
    /// without a norm launch: the producer writes the norm's input already weighted and
    /// quantized for the consumer, which applies `1 / rms(x)` after its dot products. Asked
    /// per site where [`Backend::defers_rms_norm`] is false (quantized weights). The CPU
    /// backend: only in its test mode (gate, up).
    fn defers_rms_norm_after(
        &self,
        producer: &Self::Weight,
        consumers: &[&Self::Weight],
        rows: usize,
    ) -> bool {
        let _ = (producer, consumers, rows);
        false
    }

    /// [`Backend::matmul_add`] whose result feeds `rms_norm(out) · norm` next (the consumer
    /// being [`Backend::rms_norm_matmul_swiglu`] or [`Backend::rms_norm_matmuls`] with the same
    /// `norm`): a backend may prepare that input in the projection's epilogue. Same `out` as
    /// `matmul_add`, bitwise.
    fn matmul_add_for_norm(
        &self,
        x: &Act<Self::Buf>,
        w: &Self::Weight,
        out: &mut Act<Self::Buf>,
        y: &mut Act<Self::Buf>,
        norm: (&Self::Weight, f32),
    ) -> Result<()> {
        let _ = norm;
        self.matmul_add(x, w, out, y)
    }

    /// `outs[i] = (rms_norm(x) · norm) · ws[i]ᵀ` ([`Backend::rms_norm`], then
    /// [`Backend::matmuls`]). `h` is scratch for the normed rows; a backend that defers the
    /// norm ([`Backend::defers_rms_norm`]) leaves it untouched and scales each output by
    /// `1 / rms(x)` after its dot product (same value to rounding, not bitwise).
    fn rms_norm_matmuls(
        &self,
        x: &Act<Self::Buf>,
        (norm, eps): (&Self::Weight, f32),
        ws: &[&Self::Weight],
        outs: &mut [&mut Act<Self::Buf>],
        h: &mut Act<Self::Buf>,
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, h)?;
        self.matmuls(h, ws, outs)
    }

    /// `act = silu(gate · h) ⊙ (up · h)` with `h = rms_norm(x) · norm`
    /// ([`Backend::rms_norm`], then [`Backend::matmul_swiglu`]); `h`, `g` and `u` are
    /// scratch, as in those ops. A backend that defers the norm scales both projections by
    /// `1 / rms(x)` before the SwiGLU.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_swiglu(
        &self,
        x: &Act<Self::Buf>,
        (norm, eps): (&Self::Weight, f32),
        gate: &Self::Weight,
        up: &Self::Weight,
        (g, u): (&mut Act<Self::Buf>, &mut Act<Self::Buf>),
        act: &mut Act<Self::Buf>,
        h: &mut Act<Self::Buf>,
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, h)?;
        self.matmul_swiglu(h, gate, up, (g, u), act)
    }

    /// Copies rows `start..start+out.rows` of `x` into `out`.
    fn copy_rows(&self, x: &Act<Self::Buf>, start: usize, out: &mut Act<Self::Buf>) -> Result<()>;
    /// `out[i] = x[rows[i]]` (host row indices; `out.rows == rows.len()`).
    fn gather_rows(
        &self,
        x: &Act<Self::Buf>,
        rows: &[usize],
        out: &mut Act<Self::Buf>,
    ) -> Result<()>;
    /// `x += y` elementwise.
    fn add_assign(&self, x: &mut Act<Self::Buf>, y: &Act<Self::Buf>) -> Result<()>;
    /// `out = silu(gate) * up` elementwise.
    fn swiglu(
        &self,
        gate: &Act<Self::Buf>,
        up: &Act<Self::Buf>,
        out: &mut Act<Self::Buf>,
    ) -> Result<()>;
    /// Rotates every head of every row in place; row `t` is at `step.positions[t]`.
    fn rope(
        &self,
        x: &mut Act<Self::Buf>,
        head_dim: usize,
        step: &StepInput<Self::IBuf>,
        rope: &Rope,
    ) -> Result<()>;
    /// [`Backend::add_rms_norm`] whose `h` is read next only as the x of one call of
    /// [`Backend::matmuls`], [`Backend::matmul_swiglu`] or [`Backend::swiglu_mlp`] (or `_add`)
    /// of the weights `readers` on x's rows, and written again before anything else reads it. A
    /// backend whose matmuls there read a 16-bit copy of x that the norm writes may leave h's
    /// f32 rows unwritten (CUDA at prefill rows: a third of the launch's bytes). The values the
    /// readers compute are the same.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_for(
        &self,
        x: &mut Act<Self::Buf>,
        y: &Act<Self::Buf>,
        w: &Self::Weight,
        eps: f32,
        h: &mut Act<Self::Buf>,
        readers: &[&Self::Weight],
    ) -> Result<()> {
        let _ = readers;
        self.add_rms_norm(x, y, w, eps, h)
    }
    /// [`Backend::rms_norm`] with `out` read next as [`Backend::add_rms_norm_for`]'s `h` is.
    fn rms_norm_for(
        &self,
        x: &Act<Self::Buf>,
        w: &Self::Weight,
        eps: f32,
        out: &mut Act<Self::Buf>,
        readers: &[&Self::Weight],
    ) -> Result<()> {
        let _ = readers;
        self.rms_norm(x, w, eps, out)
    }
    /// The residual add fused with the next RMSNorm: `x += y`, then `h = x / rms(x) * w`
    /// row by row. Equals [`Backend::add_assign`] followed by [`Backend::rms_norm`] (the
    /// CPU backend bitwise).
    fn add_rms_norm(
        &self,
        x: &mut Act<Self::Buf>,
        y: &Act<Self::Buf>,
        w: &Self::Weight,
        eps: f32,
        h: &mut Act<Self::Buf>,
    ) -> Result<()>;
    /// A MoE block's input and router in one op: the residual add `x + y`, `h = rms_norm(x +
    /// y) · w` row by row, and `out = h · wmᵀ` as [`Backend::matmul`]. The sum goes into `x`
    /// (returns `false`: [`Backend::add_rms_norm`] + `matmul`, the CPU backend's way) or out
    /// of place into `x_alt` (returns `true`; `x` is left as it was): a backend may run the
    /// op as one launch of many blocks that each read `x` and `y` while some of them write
    /// the sum (CUDA at one decode row). Either way the values are bitwise those of
    /// `add_rms_norm` + `matmul`.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_matmul(
        &self,
        x: &mut Act<Self::Buf>,
        y: &Act<Self::Buf>,
        x_alt: &mut Act<Self::Buf>,
        w: &Self::Weight,
        eps: f32,
        h: &mut Act<Self::Buf>,
        wm: &Self::Weight,
        out: &mut Act<Self::Buf>,
    ) -> Result<bool> {
        let _ = x_alt;
        self.add_rms_norm(x, y, w, eps, h)?;
        self.matmul(h, wm, out)?;
        Ok(false)
    }
    /// Attention's query/key preparation in one op: on every `head_dim`-sized head of `q`
    /// and of `k`, the per-head RMSNorm where its weight is given (Qwen3's QK-norm), then
    /// the rotation of [`Backend::rope`]. Equals `head_rms_norm(q)`, `head_rms_norm(k)`,
    /// `rope(q)`, `rope(k)` (the CPU backend bitwise).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        q: &mut Act<Self::Buf>,
        k: &mut Act<Self::Buf>,
        q_norm: Option<&Self::Weight>,
        k_norm: Option<&Self::Weight>,
        head_dim: usize,
        eps: f32,
        step: &StepInput<Self::IBuf>,
        rope: &Rope,
    ) -> Result<()>;

    /// [`Backend::qk_norm_rope`] on q and k, then [`Backend::attention`] of them at layer
    /// `layer`: what the decoder's attention half runs after its Q, K, V. A backend may do both
    /// in one launch and leave q and k as they were (CUDA at one decode row of a short
    /// contiguous f16 cache: the attention normalises and rotates the values it loads).
    fn qk_norm_rope_attention(
        &self,
        kv: &mut Self::Kv,
        qk: QkRope<'_, Self::Weight, Self::IBuf>,
        (q, k, v): QkvMut<'_, Self::Buf>,
        layer: usize,
        shape: AttnShape,
        out: &mut Act<Self::Buf>,
    ) -> Result<()> {
        qk_norm_rope_then_attention(self, kv, qk, (q, k, v), layer, shape, out, &[])
    }

    /// [`Backend::attention`] whose `out` is read next only as the x of one [`Backend::matmul`]
    /// or [`Backend::matmul_add`] of a weight in `readers` (the o-projection), as
    /// [`Backend::add_rms_norm_for`]'s h is: a backend whose matmul there reads a 16-bit copy of
    /// x that the attention writes may leave `out`'s f32 rows unwritten.
    fn attention_for(
        &self,
        kv: &mut Self::Kv,
        step: &StepInput<Self::IBuf>,
        a: AttnArgs<'_, Self::Buf>,
        out: &mut Act<Self::Buf>,
        readers: &[&Self::Weight],
    ) -> Result<()> {
        let _ = readers;
        self.attention(kv, step, a, out)
    }

    /// [`Backend::qk_norm_rope_attention`] whose `out` is read next only as the x of one
    /// [`Backend::matmul`] or [`Backend::matmul_add`] of a weight in `readers` (the
    /// o-projection), as [`Backend::attention_for`]'s.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_attention_for(
        &self,
        kv: &mut Self::Kv,
        qk: QkRope<'_, Self::Weight, Self::IBuf>,
        qkv: QkvMut<'_, Self::Buf>,
        layer: usize,
        shape: AttnShape,
        out: &mut Act<Self::Buf>,
        readers: &[&Self::Weight],
    ) -> Result<()> {
        let _ = readers;
        self.qk_norm_rope_attention(kv, qk, qkv, layer, shape, out)
    }

    /// A KV cache for `n_layers` layers of `shape`, holding up to `capacity` positions.
    fn kv_new(&self, n_layers: usize, shape: AttnShape, capacity: usize) -> Result<Self::Kv>;
    /// As [`Backend::kv_new`], the cache in q8_0 blocks where the backend has them, whatever
    /// the backend's default cache type (the CPU reference keeps f32, as for
    /// [`PagedKv::q8_0`]): lets `ferrite check` compare both cache types in one run.
    fn kv_new_q8(&self, n_layers: usize, shape: AttnShape, capacity: usize) -> Result<Self::Kv> {
        self.kv_new(n_layers, shape, capacity)
    }
    /// A paged KV cache shared by many sequences: `n_pages` pages of `page_size` positions
    /// per layer; a sequence's positions live in the pages of its block table. Used with
    /// batched steps ([`Backend::set_batch`]): [`Backend::attention`] then stores and reads
    /// each row's keys and values through its sequence's block table.
    fn kv_new_paged(&self, n_layers: usize, shape: AttnShape, paged: PagedKv) -> Result<Self::Kv>;
    /// Causal attention for the rows of `q` at positions `step.positions`: first stores
    /// `k`, `v` (`[rows, n_kv_heads*head_dim]`) at those positions of layer `a.layer`, then
    /// attends each query row to positions `0..=its position`. `out` is
    /// `[rows, n_heads*head_dim]`. With a paged cache the step is batched: each row's
    /// positions are those of its own sequence, addressed through its block table.
    fn attention(
        &self,
        kv: &mut Self::Kv,
        step: &StepInput<Self::IBuf>,
        a: AttnArgs<'_, Self::Buf>,
        out: &mut Act<Self::Buf>,
    ) -> Result<()>;

    /// A cache for a hybrid model: `n_attn_layers` attention layers as [`Backend::kv_new`]
    /// (indexed by attention-layer number), plus for each of `n_linear_layers` Gated
    /// DeltaNet layers its convolution state (the last `conv_kernel - 1` inputs of every
    /// channel) and its recurrent state (`[k_head_dim, v_head_dim]` f32 per value head), all
    /// zero: the state a sequence carries from prefill into decode.
    fn kv_new_hybrid(
        &self,
        n_attn_layers: usize,
        shape: AttnShape,
        capacity: usize,
        n_linear_layers: usize,
        delta: DeltaShape,
    ) -> Result<Self::Kv>;
    /// The cache of batched steps for a hybrid model: the paged attention cache of
    /// [`Backend::kv_new_paged`] for its `n_attn_layers` attention layers, plus a pool of
    /// `state_slots` linear-attention states (conv and recurrent, every one of the
    /// `n_linear_layers` layers, as [`Backend::kv_new_hybrid`] keeps one), all zero. A
    /// sequence of a batched step continues the slot its [`SeqRows::state`] names; the
    /// scheduler clears a slot ([`Backend::kv_clear_state`]) before a new sequence takes
    /// it. Pooled caches take no snapshots or row states (speculation runs per sequence).
    fn kv_new_paged_hybrid(
        &self,
        n_attn_layers: usize,
        shape: AttnShape,
        paged: PagedKv,
        n_linear_layers: usize,
        delta: DeltaShape,
        state_slots: usize,
    ) -> Result<Self::Kv> {
        let _ = (
            n_attn_layers,
            shape,
            paged,
            n_linear_layers,
            delta,
            state_slots,
        );
        anyhow::bail!("this backend has no batched caches for hybrid (linear-attention) models")
    }
    /// Zeroes linear-attention state slot `slot` of a cache (every layer's conv and
    /// recurrent state): the state of a sequence before its first token. Caches without
    /// linear-attention state have nothing to clear. A device operation on the backend's
    /// stream where it has one.
    fn kv_clear_state(&self, kv: &mut Self::Kv, slot: usize) -> Result<()>;
    /// Copies linear-attention state slot `from` over slot `to` (every layer's conv and
    /// recurrent state; `from` is unchanged): a prefix cache's saved state handed to a new
    /// sequence, or a sequence's state saved for later ones. Caches without linear-attention
    /// state have nothing to copy. A device copy on the backend's stream where it has one.
    fn kv_copy_state(&self, kv: &mut Self::Kv, from: usize, to: usize) -> Result<()>;
    /// Gives a cache `n` state snapshot slots ([`Backend::kv_snapshot`],
    /// [`Backend::kv_restore`]), all empty, replacing any it had: for a hybrid cache each
    /// slot is preallocated room for the conv and recurrent state of every linear layer, so
    /// snapshots and restores never allocate. Runs outside graph capture. Caches without
    /// linear-attention state (attention-only, paged) take slots that hold nothing: the
    /// same rollback code then runs for every model at no cost.
    fn kv_snapshots(&self, kv: &mut Self::Kv, n: usize) -> Result<()>;
    /// Copies the cache's linear-attention state (conv and recurrent, every layer) into
    /// snapshot slot `slot`, e.g. before a speculative verify step. Attention layers need
    /// no copy: their rows are addressed by position, so after a rollback the rejected
    /// positions are written again before any query reads them. The cache records no
    /// position: the caller continues at the position the snapshot was taken at. A device
    /// copy on the backend's stream where the backend has one (capturable in a graph; the
    /// slot's filled flag is host-side and set when the call is issued).
    fn kv_snapshot(&self, kv: &mut Self::Kv, slot: usize) -> Result<()>;
    /// Copies snapshot slot `slot` back into the cache's linear-attention state (the
    /// rollback after rejected draft tokens); the slot keeps its contents, so one snapshot
    /// can be restored several times. An error for a slot that was never written.
    fn kv_restore(&self, kv: &mut Self::Kv, slot: usize) -> Result<()>;
    /// Gives a hybrid cache `rows` row-state slots (0: none), replacing any it had: while it
    /// has them, every [`Backend::causal_conv1d`] and [`Backend::gated_delta_rule`] call of
    /// at most `rows` rows also leaves the state after each of its rows (conv and recurrent,
    /// per layer) in that row's slot. A speculative verify's rejected drafts are then rolled
    /// back by [`Backend::kv_restore_row`] with no replay. Returns false, having done nothing,
    /// where the backend does not keep them (the caller then snapshots and replays); caches
    /// without linear-attention state take slots that hold nothing. Runs outside graph
    /// capture.
    fn kv_row_states(&self, kv: &mut Self::Kv, rows: usize) -> Result<bool> {
        let _ = (kv, rows);
        Ok(false)
    }
    /// Copies the state after row `row` of the last tracked call (every linear layer's) into
    /// the cache's linear-attention state. The caller must name a row that call had (the CPU
    /// backend checks it; a backend whose calls replay as graphs cannot).
    fn kv_restore_row(&self, kv: &mut Self::Kv, row: usize) -> Result<()> {
        let _ = (kv, row);
        anyhow::bail!("this backend keeps no per-row states")
    }
    /// Causal depthwise convolution over time followed by SiLU, continuing the stored
    /// state of linear layer `layer`: with `w` `[channels, kernel]` and the input extended
    /// on the left by the state, `out[t][c] = silu(Σ_j w[c][j] · x[t - (kernel-1) + j][c])`;
    /// then the state keeps the last `kernel - 1` inputs.
    ///
    /// `batch`: `None` for the rows of one sequence (a cache of one state); a batched step's
    /// layout ([`Backend::set_batch`], its segments non-empty) over a pooled cache
    /// ([`Backend::kv_new_paged_hybrid`]): each segment's rows continue its own state slot,
    /// exactly as a call on that segment alone would.
    fn causal_conv1d(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        x: &Act<Self::Buf>,
        w: &Self::Weight,
        out: &mut Act<Self::Buf>,
        batch: Option<&StepBatch<Self::IBuf>>,
    ) -> Result<()>;
    /// The gated delta rule (Gated DeltaNet), continuing the recurrent state of linear
    /// layer `a.layer`. Per token and value head, with `q`, `k` L2-normalised (eps 1e-6),
    /// `q` scaled by `k_head_dim^-1/2`, `g = ssm_a · softplus(a + dt_bias)`,
    /// `β = sigmoid(b)`:
    /// `S ← e^g S;  S ← S + k (β (v − Sᵀk))ᵀ;  o = Sᵀq`  (`S` is `[k_head_dim, v_head_dim]`).
    /// `out` is `[rows, n_v_heads * v_head_dim]`. The result must equal the token-by-token
    /// recurrence however the backend evaluates it (chunked for prefill: see
    /// [`gated_delta`]).
    /// `batch`: as for [`Backend::causal_conv1d`].
    fn gated_delta_rule(
        &self,
        kv: &mut Self::Kv,
        a: DeltaArgs<'_, Self::Buf, Self::Weight>,
        out: &mut Act<Self::Buf>,
        batch: Option<&StepBatch<Self::IBuf>>,
    ) -> Result<()>;
    /// Gated RMSNorm in place on each `head_dim`-sized head:
    /// `x = x / rms(x) · w · silu(z)` (`w` has `head_dim` elements, `z` is shaped like `x`).
    fn gated_rms_norm(
        &self,
        x: &mut Act<Self::Buf>,
        z: &Act<Self::Buf>,
        w: &Self::Weight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// `x *= sigmoid(gate)` elementwise; a one-column `gate` scales whole rows (the shared
    /// expert's gate).
    fn sigmoid_gate(&self, x: &mut Act<Self::Buf>, gate: &Act<Self::Buf>) -> Result<()>;

    /// Mixture-of-experts SwiGLU FFN: `router_logits` `[rows, n_experts]` → softmax → top-k
    /// (ties to the lower expert id) → optional renormalisation; then
    /// `out[t] = Σ_k w_k · down_e(silu(gate_e x[t]) * up_e x[t])`.
    fn moe(
        &self,
        x: &Act<Self::Buf>,
        router_logits: &Act<Self::Buf>,
        experts: ExpertWeights<'_, Self::Weight>,
        routing: MoeRouting,
        out: &mut Act<Self::Buf>,
    ) -> Result<()>;

    /// A hint with no result: bring the experts a MoE layer is likely to route the one decode
    /// row `x` to toward the compute units before the layer needs them. The prediction is
    /// the layer's own router on `rms_norm(x) · norm` where `x` is the residual before the
    /// layer's attention half (the router later sees it with that half's output added).
    /// CUDA, under graph capture only: launches beside the step's chain (their own stream)
    /// compute the prediction and prefetch the first experts' gate and up rows into L2
    /// (`FERRITE_MOE_PREDICT`, four by default, issued at [`Backend::moe_prefetch_at`]; MOE.md
    /// 63rd and 64th sessions). Nothing a later op computes depends on it; the default does
    /// nothing.
    fn moe_prefetch(
        &self,
        x: &Act<Self::Buf>,
        norm: (&Self::Weight, f32),
        router: &Self::Weight,
        experts: ExpertWeights<'_, Self::Weight>,
        routing: MoeRouting,
    ) -> Result<()> {
        let _ = (x, norm, router, experts, routing);
        Ok(())
    }

    /// With [`Backend::moe_prefetch`]: the decoder has reached `point` of the layer whose
    /// experts were predicted. A backend that holds the prediction's prefetch back to a later
    /// point (CUDA: `FERRITE_MOE_PREDICT_AT`) issues it here; the default does nothing.
    fn moe_prefetch_at(&self, point: MixerPoint) -> Result<()> {
        let _ = point;
        Ok(())
    }

    /// The expert prediction's ranking at one row, for `ferrite check`: `out[e] = router[e] ·
    /// (rms_norm(x) · norm)` (`out` `[1, n_experts]`, `h` scratch `[1, hidden]`). The default
    /// composes [`Backend::rms_norm`] and [`Backend::matmul`]; CUDA runs
    /// [`Backend::moe_prefetch`]'s prediction kernel and checks its picks against its own
    /// logits.
    fn moe_predict_logits(
        &self,
        x: &Act<Self::Buf>,
        norm: (&Self::Weight, f32),
        router: &Self::Weight,
        h: &mut Act<Self::Buf>,
        out: &mut Act<Self::Buf>,
    ) -> Result<()> {
        self.rms_norm(x, norm.0, norm.1, h)?;
        self.matmul(h, router, out)
    }

    /// [`Backend::moe`] and a gated shared expert (Qwen3.5-MoE) in one step, where the backend
    /// fuses them: `out[t] = moe(x)[t] + σ(x[t] · gate) · shared(x[t])`, `shared` a SwiGLU MLP
    /// (gate, up, down: `[ffn, hidden]`, `[ffn, hidden]`, `[hidden, ffn]`, an expert's shapes)
    /// and `gate` its `[1, hidden]` row.
    /// Returns false, having done nothing, where it does not (the default): the caller then
    /// runs the composition (`moe`, the MLP, `matmul` of the gate row, `sigmoid_gate`,
    /// `add_assign`), whose result this approximates to within floating-point summation order.
    #[allow(clippy::too_many_arguments)]
    fn moe_shared(
        &self,
        x: &Act<Self::Buf>,
        router_logits: &Act<Self::Buf>,
        experts: ExpertWeights<'_, Self::Weight>,
        shared: ExpertWeights<'_, Self::Weight>,
        gate: &Self::Weight,
        routing: MoeRouting,
        out: &mut Act<Self::Buf>,
    ) -> Result<bool> {
        let _ = (x, router_logits, experts, shared, gate, routing, out);
        Ok(false)
    }

    /// Greedy token choice on the device: `out[t] = argmax(logits[t])` (ties to the lower id).
    fn argmax(&self, logits: &Act<Self::Buf>, out: &mut Self::IBuf) -> Result<()>;
    /// Greedy decoding fed back on the device, for one-row steps: [`Backend::argmax`] of the
    /// one row of `logits` into `out`, and that token becomes the step's next input with no
    /// host round trip: `step.tokens[0] = t`, `step.positions[0] += 1`, and
    /// `log[p % log_len] = t` for the new position p, so that a decode step captured with this
    /// op at its end can be replayed step after step and its tokens read from the log later.
    /// The host copy `step.pos0` advances where the call runs (not on a graph replay: the
    /// caller keeps its own count).
    fn argmax_feed(
        &self,
        logits: &Act<Self::Buf>,
        out: &mut Self::IBuf,
        step: &mut StepInput<Self::IBuf>,
        log: &mut Self::IBuf,
        log_len: usize,
    ) -> Result<()>;
    /// The `k` largest logits of each row, best first, ties to the lower id (NaN counts as
    /// -inf): `ids[t*k + j]` and `vals[t][j]` (`vals` is `[rows, k]`). Sampling with top-k
    /// then needs only these k pairs on the host, not the whole vocabulary.
    fn top_k(
        &self,
        logits: &Act<Self::Buf>,
        k: usize,
        ids: &mut Self::IBuf,
        vals: &mut Act<Self::Buf>,
    ) -> Result<()>;
    /// Reads `n` values of an i32 buffer back to the host.
    fn read_i32(&self, x: &Self::IBuf, n: usize) -> Result<Vec<i32>>;

    /// Records the ops `f` issues into a graph (`Ok(None)` where the backend has no graphs:
    /// then `f` has simply run, and the caller runs it again each time).
    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Graph>>;
    /// Replays a captured graph.
    fn replay(&self, g: &Self::Graph) -> Result<()>;
}

/// The operands of one attention call.
pub struct AttnArgs<'a, B> {
    pub layer: usize,
    pub q: &'a Act<B>,
    pub k: &'a Act<B>,
    pub v: &'a Act<B>,
    pub shape: AttnShape,
}

/// The host-side bookkeeping of a cache's snapshot slots ([`Backend::kv_snapshots`]): which
/// slots hold a snapshot. Shared by the backends so they accept and reject the same slots.
#[derive(Clone, Debug, Default)]
pub struct SnapshotSlots {
    filled: Vec<bool>,
}

impl SnapshotSlots {
    /// `n` empty slots.
    pub fn new(n: usize) -> SnapshotSlots {
        SnapshotSlots {
            filled: vec![false; n],
        }
    }
    /// Number of slots.
    pub fn len(&self) -> usize {
        self.filled.len()
    }
    pub fn is_empty(&self) -> bool {
        self.filled.is_empty()
    }
    fn check(&self, what: &str, slot: usize) -> Result<()> {
        anyhow::ensure!(
            slot < self.filled.len(),
            "{what}: snapshot slot {slot} of a cache with {} slots{}",
            self.filled.len(),
            if self.filled.is_empty() {
                " (kv_snapshots allocates them)"
            } else {
                ""
            }
        );
        Ok(())
    }
    /// Checks `slot` for [`Backend::kv_snapshot`].
    pub fn check_snapshot(&self, slot: usize) -> Result<()> {
        self.check("kv_snapshot", slot)
    }
    /// Marks `slot` as holding a snapshot (after a successful copy).
    pub fn set_filled(&mut self, slot: usize) -> Result<()> {
        self.check("kv_snapshot", slot)?;
        self.filled[slot] = true;
        Ok(())
    }
    /// Checks that `slot` exists and holds a snapshot, for [`Backend::kv_restore`].
    pub fn restore(&self, slot: usize) -> Result<()> {
        self.check("kv_restore", slot)?;
        anyhow::ensure!(
            self.filled[slot],
            "kv_restore: snapshot slot {slot} holds no snapshot (kv_snapshot writes it)"
        );
        Ok(())
    }
}

/// The shape checks every backend's `matmul` makes, for a weight of shape `w_shape`;
/// returns `(n_out, n_in)`.
pub fn check_matmul<B>(x: &Act<B>, w_shape: &[usize], out: &Act<B>) -> Result<(usize, usize)> {
    let [n_out, n_in] = w_shape[..] else {
        anyhow::bail!("matmul: expected a 2-D weight, got shape {w_shape:?}")
    };
    anyhow::ensure!(
        x.cols == n_in,
        "matmul: input has {} columns, weight {w_shape:?} wants {n_in}",
        x.cols
    );
    check_shape("matmul out", out, x.rows, n_out)?;
    Ok((n_out, n_in))
}

/// The shape checks every backend's `gather_rows` makes.
pub fn check_gather_rows<B>(x: &Act<B>, rows: &[usize], out: &Act<B>) -> Result<()> {
    anyhow::ensure!(
        out.rows == rows.len() && out.cols == x.cols,
        "gather_rows: {} rows of {} columns into [{}, {}]",
        rows.len(),
        x.cols,
        out.rows,
        out.cols
    );
    if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
        anyhow::bail!("gather_rows: row {r} of {}", x.rows);
    }
    Ok(())
}

/// The checks every backend makes before a batched step's attention over a paged cache of
/// `n_pages` pages of `page_size`; returns the step's batch.
pub fn check_paged_step<I>(
    step: &StepInput<I>,
    n_pages: usize,
    page_size: usize,
) -> Result<&StepBatch<I>> {
    let b = match &step.batch {
        Some(b) if !b.segs.is_empty() => b,
        _ => anyhow::bail!(
            "attention: a paged KV cache needs a batched step (set_batch), not set_step"
        ),
    };
    anyhow::ensure!(
        b.page_size == page_size,
        "attention: the step's pages hold {} positions, the cache's {page_size}",
        b.page_size
    );
    anyhow::ensure!(
        b.max_page < n_pages,
        "attention: page {} outside the cache's {n_pages} pages",
        b.max_page
    );
    let rows: usize = b.segs.iter().map(|s| s.rows).sum();
    anyhow::ensure!(
        rows == step.rows,
        "attention: the step's sequences hold {rows} rows, the step {}",
        step.rows
    );
    Ok(b)
}

/// The check a contiguous (single-sequence) cache makes on the step.
pub fn check_single_sequence_step<I>(step: &StepInput<I>) -> Result<()> {
    anyhow::ensure!(
        step.batch.as_ref().is_none_or(|b| b.segs.len() <= 1),
        "attention: a batched step of several sequences needs a paged KV cache (kv_new_paged)"
    );
    Ok(())
}

/// The shape checks every backend's `copy_rows` makes.
/// The segments a Gated DeltaNet op of `rows` rows runs on a cache of `slots` linear-attention
/// states: `None` for one sequence's rows (a cache of one state), or a batched step's
/// segments, checked to tile the rows and to name slots the cache has. Shared by the
/// backends so they accept and reject the same calls.
pub fn check_delta_batch<'b, I>(
    what: &str,
    batch: Option<&'b StepBatch<I>>,
    rows: usize,
    slots: usize,
) -> Result<Option<&'b [Segment]>> {
    let Some(b) = batch else {
        anyhow::ensure!(
            slots == 1,
            "{what}: a cache of {slots} linear-attention states needs a batched step's segments"
        );
        return Ok(None);
    };
    let segs = &b.segs;
    anyhow::ensure!(
        !segs.is_empty(),
        "{what}: the batched step has no sequences (set_batch first)"
    );
    let mut next = 0;
    for s in segs {
        anyhow::ensure!(
            s.row0 == next && s.rows > 0,
            "{what}: segments of the step do not tile its rows"
        );
        anyhow::ensure!(
            s.state < slots,
            "{what}: state slot {} of a cache of {slots}",
            s.state
        );
        next += s.rows;
    }
    anyhow::ensure!(next == rows, "{what}: {rows} rows for a step of {next}");
    Ok(Some(segs))
}

pub fn check_copy_rows<B>(x: &Act<B>, start: usize, out: &Act<B>) -> Result<()> {
    anyhow::ensure!(
        start + out.rows <= x.rows,
        "copy_rows: rows {start}..{} of {}",
        start + out.rows,
        x.rows
    );
    anyhow::ensure!(
        out.cols == x.cols,
        "copy_rows: {} columns into {}",
        x.cols,
        out.cols
    );
    Ok(())
}

/// The checks every backend's `argmax_feed` makes: one row of logits, a log of `log_len` ≥ 1
/// entries in a buffer of `log_cap`, a step input with a token and a position to write.
pub fn check_argmax_feed<B>(
    logits: &Act<B>,
    log_len: usize,
    log_cap: usize,
    step_tokens: usize,
    step_positions: usize,
) -> Result<()> {
    anyhow::ensure!(
        logits.rows == 1
            && log_len >= 1
            && log_cap >= log_len
            && step_tokens >= 1
            && step_positions >= 1,
        "argmax_feed: one row, a log of {log_len} entries (of {log_cap})"
    );
    Ok(())
}

/// The shape checks every backend's `top_k` makes (`ids_len`: the ids buffer's length).
pub fn check_top_k<B>(logits: &Act<B>, k: usize, ids_len: usize, vals: &Act<B>) -> Result<()> {
    anyhow::ensure!(
        k >= 1 && k <= logits.cols,
        "top_k: k = {k} of {} logits",
        logits.cols
    );
    check_shape("top_k values", vals, logits.rows, k)?;
    anyhow::ensure!(
        ids_len >= logits.rows * k,
        "top_k: ids buffer holds {ids_len} of {}",
        logits.rows * k
    );
    Ok(())
}

/// The shape checks every backend's `moe` makes; `shapes` are those of the stacked gate, up
/// and down expert weights (`[n_experts, n_out, n_in]`). Returns the experts' FFN size.
pub fn check_moe<B>(
    x: &Act<B>,
    router_logits: &Act<B>,
    shapes: [&[usize]; 3],
    routing: &MoeRouting,
    out: &Act<B>,
) -> Result<usize> {
    let MoeRouting {
        n_experts, top_k, ..
    } = *routing;
    let (rows, hidden) = (x.rows, x.cols);
    check_shape("moe router logits", router_logits, rows, n_experts)?;
    check_shape("moe out", out, rows, hidden)?;
    anyhow::ensure!(
        top_k >= 1 && top_k <= n_experts,
        "moe: top-k {top_k} of {n_experts} experts"
    );
    let dims = |what: &str, s: &[usize]| -> Result<(usize, usize)> {
        match s[..] {
            [e, o, i] if e == n_experts => Ok((o, i)),
            _ => anyhow::bail!(
                "moe {what}: expert weight shape {s:?} does not hold {n_experts} experts"
            ),
        }
    };
    let [gate, up, down] = shapes;
    let (ffn, h_in) = dims("gate", gate)?;
    anyhow::ensure!(
        h_in == hidden && dims("up", up)? == (ffn, hidden) && dims("down", down)? == (hidden, ffn),
        "moe: expert shapes disagree (gate {gate:?}, up {up:?}, down {down:?}, hidden {hidden})"
    );
    Ok(ffn)
}

/// The shape checks every backend's `rope` makes.
pub fn check_rope<B, I>(
    x: &Act<B>,
    head_dim: usize,
    step: &StepInput<I>,
    rope: &Rope,
) -> Result<()> {
    anyhow::ensure!(
        head_dim > 0 && x.cols.is_multiple_of(head_dim),
        "rope: {} columns is not a whole number of {head_dim}-heads",
        x.cols
    );
    anyhow::ensure!(
        rope.rot_dim <= head_dim && rope.rot_dim.is_multiple_of(2),
        "rope: bad rotary dim {}",
        rope.rot_dim
    );
    anyhow::ensure!(
        x.rows == step.rows,
        "rope: {} rows for a step of {}",
        x.rows,
        step.rows
    );
    Ok(())
}

/// The shape checks every backend's `add_rms_norm` makes (`w_len`: the norm weight's
/// element count).
pub fn check_add_rms_norm<B>(x: &Act<B>, y: &Act<B>, w_len: usize, h: &Act<B>) -> Result<()> {
    check_shape("add_rms_norm y", y, x.rows, x.cols)?;
    check_shape("add_rms_norm out", h, x.rows, x.cols)?;
    anyhow::ensure!(
        w_len == x.cols,
        "add_rms_norm: norm weight has {w_len} elements, expected {}",
        x.cols
    );
    Ok(())
}

/// The shape checks every backend's `qk_norm_rope` makes (`norm_lens`: the element counts
/// of the q and k norm weights, where given).
pub fn check_qk_norm_rope<B, I>(
    q: &Act<B>,
    k: &Act<B>,
    norm_lens: [Option<usize>; 2],
    head_dim: usize,
    step: &StepInput<I>,
    rope: &Rope,
) -> Result<()> {
    check_rope(q, head_dim, step, rope).context("qk_norm_rope q")?;
    check_rope(k, head_dim, step, rope).context("qk_norm_rope k")?;
    for (what, len) in ["q", "k"].into_iter().zip(norm_lens) {
        if let Some(n) = len {
            anyhow::ensure!(
                n == head_dim,
                "qk_norm_rope: {what} norm weight has {n} elements, expected {head_dim}"
            );
        }
    }
    Ok(())
}

/// The shape checks every backend's `attention` makes on its operands (cache checks are
/// the backend's own).
pub fn check_attention<B, I>(step: &StepInput<I>, a: &AttnArgs<'_, B>, out: &Act<B>) -> Result<()> {
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = a.shape;
    let rows = a.q.rows;
    let kvd = n_kv_heads * head_dim;
    anyhow::ensure!(
        n_kv_heads > 0 && n_heads % n_kv_heads == 0,
        "attention: {n_heads} heads over {n_kv_heads} kv heads"
    );
    anyhow::ensure!(
        rows == step.rows,
        "attention: {rows} rows for a step of {}",
        step.rows
    );
    check_shape("attention q", a.q, rows, n_heads * head_dim)?;
    check_shape("attention k", a.k, rows, kvd)?;
    check_shape("attention v", a.v, rows, kvd)?;
    check_shape("attention out", out, rows, n_heads * head_dim)
}

/// Checks that two activations have the shapes an op needs; used by every backend.
pub fn check_shape<B>(what: &str, x: &Act<B>, rows: usize, cols: usize) -> Result<()> {
    anyhow::ensure!(
        x.rows == rows && x.cols == cols,
        "{what}: expected [{rows}, {cols}], got [{}, {}]",
        x.rows,
        x.cols
    );
    Ok(())
}
