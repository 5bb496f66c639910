//! The decoder-only transformer shared by Llama, Qwen3 and Qwen3-MoE.
//!
//! ```text
//! x = embed(tokens)                                   [T, hidden]
//! for each layer:
//!     h = rms_norm(x) · attn_norm
//!     q, k, v = h Wqᵀ, h Wkᵀ, h Wvᵀ                   [T, H·d], [T, Hkv·d], [T, Hkv·d]
//!     q, k = head_rms_norm(q), head_rms_norm(k)       (Qwen3 only: per-head QK-norm)
//!     q, k = rope(q, pos), rope(k, pos)
//!     x += attention(q, k, v | cache) Woᵀ             causal, grouped-query
//!     h = rms_norm(x) · ffn_norm
//!     x += down(silu(gate h) * up h)                  dense SwiGLU, or
//!     x += Σ_top-k w_e · down_e(silu(gate_e h) * up_e h)   (Qwen3-MoE)
//! logits = rms_norm(x) · output_norm · Woutᵀ           [T, vocab]
//! ```
//! The architectures differ only in the flags of [`ModelConfig`] (`qk_norm`, `moe`) and in
//! how their files name tensors ([`crate::source`]); Qwen3.5's hybrid layers get a file of
//! their own.
//!
//! Fused ops, one launch each on an accelerator: the QK-norm and both rotations are one
//! [`Backend::qk_norm_rope`]; every residual add is fused with the RMSNorm that follows it
//! ([`Backend::add_rms_norm`]): the attention output's add with `ffn_norm`, the FFN
//! output's add with the next layer's `attn_norm` (or, after the last layer, with
//! `output_norm`). Only the first layer's `attn_norm` is a plain `rms_norm`.

use anyhow::{Context, Result};
use ferrite_backend::{
    Act, Backend, ExpertWeights, HostTensor, MixerPoint, PagedKv, QkRope, StepInput,
};

use crate::config::{ModelConfig, MoeConfig};
use crate::mix::{LoadQuant, Mix, MixModel, Role};
use crate::source::{ModelFile, Tensor};

/// A layer's feed-forward network: a SwiGLU MLP, or routed experts (Qwen3-MoE), with a
/// gated shared expert beside them in Qwen3.5-MoE.
pub(crate) enum Ffn<W> {
    Dense {
        gate: W,
        up: W,
        down: W,
    },
    Moe {
        router: W,
        gate: W,
        up: W,
        down: W,
        shared: Option<SharedExpert<W>>,
    },
}

/// Qwen3.5-MoE's shared expert: a SwiGLU MLP whose output is scaled by
/// `sigmoid(gate_w · h)` (one value per row) and added to the routed experts' sum.
pub(crate) struct SharedExpert<W> {
    pub(crate) gate: W,
    pub(crate) up: W,
    pub(crate) down: W,
    /// `[1, hidden]`.
    pub(crate) gate_w: W,
}

impl<W> SharedExpert<W> {
    /// Its MLP's three matrices.
    fn mlp(&self) -> ExpertWeights<'_, W> {
        ExpertWeights {
            gate: &self.gate,
            up: &self.up,
            down: &self.down,
        }
    }
}

/// Scratch of a SwiGLU MLP: the gate and up projections and their product.
pub(crate) type MlpScratch<'a, B> = (
    &'a mut Act<<B as Backend>::Buf>,
    &'a mut Act<<B as Backend>::Buf>,
    &'a mut Act<<B as Backend>::Buf>,
);

/// The shared expert's scratch: its output and its per-row gate.
type SharedScratch<'a, B> = (
    &'a mut Act<<B as Backend>::Buf>,
    &'a mut Act<<B as Backend>::Buf>,
);

/// Scratch of one FFN block: the SwiGLU MLP's gate, up and product, the router logits, and
/// the shared expert's (needed only by a layer that has one).
pub(crate) struct FfnScratch<'a, B: Backend> {
    pub(crate) gate: &'a mut Act<B::Buf>,
    pub(crate) up: &'a mut Act<B::Buf>,
    pub(crate) act: &'a mut Act<B::Buf>,
    pub(crate) router: &'a mut Act<B::Buf>,
    pub(crate) shared: Option<SharedScratch<'a, B>>,
}

/// The dense FFN's (gate, up, down) where the backend takes the FFN's RMSNorm handed over by
/// `producer`, the projection before it, at `rows` rows ([`Backend::defers_rms_norm_after`]:
/// `matmul_add_for_norm`, then `rms_norm_matmul_swiglu`); `None` where it runs the norm.
pub(crate) fn handed_ffn<'a, B: Backend>(
    be: &B,
    producer: &B::Weight,
    ffn: &'a Ffn<B::Weight>,
    rows: usize,
) -> Option<(&'a B::Weight, &'a B::Weight, &'a B::Weight)> {
    match ffn {
        Ffn::Dense { gate, up, down } if be.defers_rms_norm_after(producer, &[gate, up], rows) => {
            Some((gate, up, down))
        }
        _ => None,
    }
}

/// A dense FFN half with its RMSNorm deferred ([`Backend::defers_rms_norm`]): `act =
/// SwiGLU(rms_norm(x) · norm)` without a norm launch, then `x += down(act)`; `h` and `y` are
/// scratch for the backends that compose the ops.
#[allow(clippy::too_many_arguments)]
pub(crate) fn deferred_ffn<B: Backend>(
    be: &B,
    ffn: &Ffn<B::Weight>,
    norm: (&B::Weight, f32),
    x: &mut Act<B::Buf>,
    (gate, up, act): MlpScratch<'_, B>,
    h: &mut Act<B::Buf>,
    y: &mut Act<B::Buf>,
) -> Result<()> {
    let Ffn::Dense {
        gate: wg,
        up: wu,
        down: wd,
    } = ffn
    else {
        anyhow::bail!("deferred norms on a MoE layer");
    };
    be.rms_norm_matmul_swiglu(x, norm, wg, wu, (gate, up), act, h)?;
    be.matmul_add(act, wd, x, y)
}

/// At a decode row, where the next layer (`next`: its FFN and the FFN's norm) is MoE: its
/// experts predicted from the residual `x` before that layer's attention half (or mixer) and
/// brought toward the compute units while that half runs (a hint, [`Backend::moe_prefetch`]).
pub(crate) fn prefetch_experts<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    x: &Act<B::Buf>,
    next: Option<(&Ffn<B::Weight>, &B::Weight)>,
) -> Result<()> {
    if let (
        1,
        Some((
            Ffn::Moe {
                router,
                gate,
                up,
                down,
                ..
            },
            norm,
        )),
        Some(m),
    ) = (x.rows, next, cfg.moe.as_ref())
    {
        let experts = ExpertWeights { gate, up, down };
        be.moe_prefetch(x, (norm, cfg.rms_eps), router, experts, m.routing)?;
    }
    Ok(())
}

/// The FFN half of a layer: `x += y`, `h = rms_norm(x) · norm`, then `y = FFN(h)`. A MoE
/// layer takes the norm and its router in one op ([`Backend::add_rms_norm_matmul`]: on CUDA
/// at decode one launch instead of two dependent ones); where that op puts the sum out of
/// place, into `x_alt`, the two references swap, so `x` holds the residual afterwards.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ffn_half<'x, B: Backend>(
    be: &B,
    ffn: &Ffn<B::Weight>,
    moe: Option<&MoeConfig>,
    (x, x_alt): (&mut &'x mut Act<B::Buf>, &mut &'x mut Act<B::Buf>),
    (norm, eps): (&B::Weight, f32),
    h: &mut Act<B::Buf>,
    s: FfnScratch<'_, B>,
    y: &mut Act<B::Buf>,
) -> Result<()> {
    if let Ffn::Moe { router, .. } = ffn {
        if be.add_rms_norm_matmul(x, y, x_alt, norm, eps, h, router, s.router)? {
            std::mem::swap(x, x_alt);
        }
        return ffn_block(be, ffn, moe, h, s, y, true);
    }
    // A dense FFN's gate and up alone read h ([`Backend::add_rms_norm_for`]).
    match ffn {
        Ffn::Dense { gate, up, .. } => be.add_rms_norm_for(x, y, norm, eps, h, &[gate, up])?,
        Ffn::Moe { .. } => be.add_rms_norm(x, y, norm, eps, h)?,
    }
    ffn_block(be, ffn, moe, h, s, y, false)
}

/// `y = FFN(h)` for one layer; `routed`: a MoE layer's router logits are already in the
/// scratch (computed with its input norm, [`ffn_half`]).
fn ffn_block<B: Backend>(
    be: &B,
    ffn: &Ffn<B::Weight>,
    moe: Option<&MoeConfig>,
    h: &Act<B::Buf>,
    s: FfnScratch<'_, B>,
    y: &mut Act<B::Buf>,
    routed: bool,
) -> Result<()> {
    let FfnScratch {
        gate,
        up,
        act,
        router,
        shared: shared_out,
    } = s;
    match ffn {
        Ffn::Dense {
            gate: wg,
            up: wu,
            down: wd,
        } => swiglu_mlp(
            be,
            h,
            ExpertWeights {
                gate: wg,
                up: wu,
                down: wd,
            },
            (gate, up, act),
            y,
        ),
        Ffn::Moe {
            router: wr,
            gate: wg,
            up: wu,
            down: wd,
            shared,
        } => {
            let moe = moe.context("MoE layer without MoE config")?;
            if !routed {
                be.matmul(h, wr, router)?;
            }
            let experts = ExpertWeights {
                gate: wg,
                up: wu,
                down: wd,
            };
            // The routed and the gated shared expert in one step where the backend fuses
            // them (the same sum as the composition below, to summation order).
            if let Some(se) = shared {
                if be.moe_shared(h, router, experts, se.mlp(), &se.gate_w, moe.routing, y)? {
                    return Ok(());
                }
            }
            be.moe(h, router, experts, moe.routing, y)?;
            if let Some(se) = shared {
                let (out, out_gate) = shared_out.context("no scratch for the shared expert")?;
                swiglu_mlp(be, h, se.mlp(), (gate, up, act), out)?;
                be.matmul(h, &se.gate_w, out_gate)?;
                be.sigmoid_gate(out, out_gate)?;
                be.add_assign(y, out)?;
            }
            Ok(())
        }
    }
}

struct Layer<W> {
    attn_norm: W,
    wq: W,
    wk: W,
    wv: W,
    wo: W,
    /// Per-head QK-norm weights (Qwen3).
    qk_norm: Option<(W, W)>,
    ffn_norm: W,
    ffn: Ffn<W>,
}

/// The SwiGLU MLP `out = W_down (silu(W_gate h) * W_up h)` of one (dense or shared-expert)
/// FFN, with `gate`, `up` and `act` as scratch activations.
pub(crate) fn swiglu_mlp<B: Backend>(
    be: &B,
    h: &Act<B::Buf>,
    w: ExpertWeights<'_, B::Weight>,
    (gate, up, act): MlpScratch<'_, B>,
    out: &mut Act<B::Buf>,
) -> Result<()> {
    be.swiglu_mlp(h, w.gate, w.up, w.down, (gate, up), act, out)
}

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (generation).
    Last,
    /// Every position (`ferrite logits`, oracle checks).
    All,
    /// The last row of each sequence of a batched step ([`Backend::set_batch`]), in the
    /// step's sequence order: row `i` of the logits belongs to sequence `i` (serving). A
    /// sequence that asks for more ([`ferrite_backend::SeqRows::logits`]: a speculative
    /// verify) gets its last rows', in order, and the rows after them move down.
    SeqLast,
}

/// The row-major shape weight `t` of a plain decoder must have under `cfg`.
fn shape_of(cfg: &ModelConfig, t: Tensor) -> Vec<usize> {
    use Tensor::*;
    let a = cfg.attn;
    let (h, q, kv) = (
        cfg.hidden,
        a.n_heads * a.head_dim,
        a.n_kv_heads * a.head_dim,
    );
    match t {
        Embed | Output => vec![cfg.vocab, h],
        OutputNorm | AttnNorm(_) | FfnNorm(_) => vec![h],
        Q(_) => vec![q, h],
        K(_) | V(_) => vec![kv, h],
        O(_) => vec![h, q],
        QNorm(_) | KNorm(_) => vec![a.head_dim],
        Gate(_) | Up(_) => vec![cfg.ffn, h],
        Down(_) => vec![h, cfg.ffn],
        Router(_) => vec![cfg.moe.as_ref().map_or(0, |m| m.routing.n_experts), h],
    }
}

/// MoE layer `i`'s stacked experts must be `[n_experts, expert_ffn, hidden]` (gate, up)
/// and `[n_experts, hidden, expert_ffn]` (down).
pub(crate) fn check_experts(
    file: &ModelFile,
    cfg: &ModelConfig,
    i: usize,
    [g, u, d]: [&ferrite_backend::HostTensor<'_>; 3],
) -> Result<()> {
    let m = cfg.moe.as_ref().context("experts in a model without MoE")?;
    let (e, f, h) = (m.routing.n_experts, m.expert_ffn, cfg.hidden);
    for (what, t, want) in [
        ("gate", g, [e, f, h]),
        ("up", u, [e, f, h]),
        ("down", d, [e, h, f]),
    ] {
        let what = match file {
            ModelFile::Gguf(_) => format!("tensor 'blk.{i}.ffn_{what}_exps.weight'"),
            ModelFile::Safetensors(_) => format!("layer {i}'s experts' {what}_proj (stacked)"),
        };
        crate::source::check_shape(&what, t, &want, file.config_source())?;
    }
    Ok(())
}

/// The file must hold no layer past the configured count (and the MTP layers a GGUF stores
/// after it): a configuration that names fewer layers than its checkpoint has would
/// otherwise run a truncated model without a word. `layer_tensor(i)` names a tensor every
/// layer `i` has.
pub(crate) fn check_layer_count(
    file: &ModelFile,
    cfg: &ModelConfig,
    layer_tensor: impl Fn(usize) -> String,
) -> Result<()> {
    let extra = layer_tensor(cfg.n_layers + file.mtp_layers());
    anyhow::ensure!(
        !file.tensors().has(&extra),
        "{} gives {} layers, but the weights have more (the file holds '{extra}'): the \
         configuration does not belong to these weights",
        file.config_source(),
        cfg.n_layers
    );
    Ok(())
}

/// A logical tensor's kind for a quantization mix, and its layer.
fn role_of(t: Tensor) -> (Role, usize) {
    use Tensor::*;
    match t {
        Embed => (Role::TokenEmbd, 0),
        Output => (Role::Output, 0),
        OutputNorm => (Role::Norm, 0),
        AttnNorm(i) | QNorm(i) | KNorm(i) | FfnNorm(i) => (Role::Norm, i),
        Q(i) => (Role::AttnQ, i),
        K(i) => (Role::AttnK, i),
        V(i) => (Role::AttnV, i),
        O(i) => (Role::AttnOut, i),
        Gate(i) | Up(i) => (Role::FfnGateUp, i),
        Down(i) => (Role::FfnDown, i),
        Router(i) => (Role::Router, i),
    }
}

/// Bytes of the weights a model uploaded (after any quantization at load, in the types the
/// backend holds them in: [`Backend::held_bytes`]), by what a decode step reads of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightBytes {
    /// The token embedding (a decode step reads one row, unless it is also the output
    /// projection: no separate output weight).
    pub embed: u64,
    /// Stacked routed experts (a step reads its routed share).
    pub experts: u64,
    /// Everything else (read whole every step).
    pub other: u64,
}

impl WeightBytes {
    /// Counts `t`, of `role`, into its share (stacked experts are the 3-D tensors), at the
    /// `n` bytes the backend holds it in.
    fn count(&mut self, t: &HostTensor<'_>, role: Role, n: u64) {
        match role {
            Role::TokenEmbd => self.embed += n,
            _ if t.shape.len() == 3 => self.experts += n,
            _ => self.other += n,
        }
    }
}

/// How a loader hands weights to the backend: each quantized first where the load asks for
/// it (`--quantize`), its bytes counted ([`WeightBytes`]).
pub(crate) struct Uploader {
    quant: Option<LoadQuant>,
    bytes: std::cell::Cell<WeightBytes>,
}

impl Uploader {
    /// For a model of `cfg`, quantizing its float matrices to `mix` (`None`: as stored).
    pub(crate) fn new(cfg: &ModelConfig, mix: Option<Mix>) -> Uploader {
        Uploader {
            quant: mix.map(|mix| LoadQuant {
                mix,
                model: MixModel {
                    n_layers: cfg.n_layers,
                    n_experts: cfg.moe.as_ref().map_or(0, |m| m.routing.n_experts),
                },
            }),
            bytes: Default::default(),
        }
    }

    /// Uploads `t` (of `role` in `layer`).
    pub(crate) fn put<B: Backend>(
        &self,
        be: &B,
        t: HostTensor<'_>,
        role: Role,
        layer: usize,
    ) -> Result<B::Weight> {
        let t = match &self.quant {
            Some(q) => q.apply(t, role, layer)?,
            None => t,
        };
        let held = be.held_bytes(&t);
        let mut b = self.bytes.get();
        b.count(&t, role, held);
        self.bytes.set(b);
        let done = if t.shape.len() == 3 {
            // Stacked experts: the backend may hold them in host memory when its device
            // memory runs short (`Backend::upload_experts`).
            be.upload_experts(&t)
        } else {
            be.upload(&t)
        };
        // Which weight, and what the load had placed before it: an out-of-memory error
        // says how far the model got.
        done.with_context(|| {
            format!(
                "uploading the {role:?} weight of layer {layer} ({:?} {}, {:.1} MiB) after \
                 {:.2} GiB of weights",
                t.shape,
                t.dtype,
                held as f64 / (1u64 << 20) as f64,
                (b.embed + b.experts + b.other - held) as f64 / (1u64 << 30) as f64
            )
        })
    }

    /// What it has uploaded so far.
    pub(crate) fn bytes(&self) -> WeightBytes {
        self.bytes.get()
    }
}

/// A loaded model: configuration plus weights in backend memory.
pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    /// What its weights take in backend memory, by kind.
    pub weight_bytes: WeightBytes,
    pub(crate) embed: B::Weight,
    layers: Vec<Layer<B::Weight>>,
    /// Qwen3.5's hybrid layers ([`crate::qwen3_5`]); empty for the plain decoders.
    hybrid: Vec<crate::qwen3_5::Layer<B::Weight>>,
    out_norm: B::Weight,
    /// `None` when the output projection is tied to the embedding.
    pub(crate) output: Option<B::Weight>,
    /// The multi-token-prediction head, once [`Model::load_mtp`] has loaded it.
    pub(crate) mtp: Option<crate::mtp::Mtp<B::Weight>>,
}

impl<B: Backend> Model<B> {
    /// Uploads every weight; `progress(done, total)` is called after each layer.
    pub fn load(be: &B, file: &ModelFile, progress: &dyn Fn(usize, usize)) -> Result<Self> {
        Self::load_quantized(be, file, progress, None)
    }

    /// [`Model::load`], quantizing the float matrices to `quantize`'s types as they load
    /// ([`crate::mix`]; tensors stored quantized keep their type).
    pub fn load_quantized(
        be: &B,
        file: &ModelFile,
        progress: &dyn Fn(usize, usize),
        quantize: Option<Mix>,
    ) -> Result<Self> {
        let cfg = file.config()?;
        be.load_rope(&cfg.rope)?;
        if cfg.arch.is_hybrid() {
            return crate::qwen3_5::load(be, file, cfg, progress, quantize);
        }
        check_layer_count(file, &cfg, |i| file.name(Tensor::AttnNorm(i)))?;
        let upl = Uploader::new(&cfg, quantize);
        let put = |t: HostTensor<'_>, role: Role, layer: usize| upl.put(be, t, role, layer);
        let up = |t: Tensor| -> Result<B::Weight> {
            let (role, layer) = role_of(t);
            put(file.need_shaped(t, &shape_of(&cfg, t))?, role, layer)
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let ffn = if cfg.is_moe_layer(i) {
                let n = cfg.moe.as_ref().map_or(0, |m| m.routing.n_experts);
                let [g, u, d] = file.experts(i, n)?;
                check_experts(file, &cfg, i, [&g, &u, &d])?;
                Ffn::Moe {
                    router: up(Tensor::Router(i))?,
                    gate: put(g, Role::FfnGateUp, i)?,
                    up: put(u, Role::FfnGateUp, i)?,
                    down: put(d, Role::FfnDown, i)?,
                    shared: None,
                }
            } else {
                Ffn::Dense {
                    gate: up(Tensor::Gate(i))?,
                    up: up(Tensor::Up(i))?,
                    down: up(Tensor::Down(i))?,
                }
            };
            layers.push(Layer {
                attn_norm: up(Tensor::AttnNorm(i))?,
                wq: up(Tensor::Q(i))?,
                wk: up(Tensor::K(i))?,
                wv: up(Tensor::V(i))?,
                wo: up(Tensor::O(i))?,
                qk_norm: if cfg.qk_norm {
                    Some((up(Tensor::QNorm(i))?, up(Tensor::KNorm(i))?))
                } else {
                    None
                },
                ffn_norm: up(Tensor::FfnNorm(i))?,
                ffn,
            });
            progress(i + 1, cfg.n_layers);
        }
        let output = match file.has(Tensor::Output) {
            true => Some(up(Tensor::Output)?),
            false => None,
        };
        let (embed, out_norm) = (up(Tensor::Embed)?, up(Tensor::OutputNorm)?);
        Ok(Model {
            embed,
            out_norm,
            output,
            layers,
            hybrid: vec![],
            mtp: None,
            cfg,
            weight_bytes: upl.bytes(),
        })
    }

    /// A hybrid model from its parts (see [`crate::qwen3_5::load`]).
    pub(crate) fn from_hybrid(
        cfg: ModelConfig,
        embed: B::Weight,
        hybrid: Vec<crate::qwen3_5::Layer<B::Weight>>,
        out_norm: B::Weight,
        output: Option<B::Weight>,
        weight_bytes: WeightBytes,
    ) -> Self {
        Model {
            cfg,
            weight_bytes,
            embed,
            layers: vec![],
            hybrid,
            out_norm,
            output,
            mtp: None,
        }
    }

    /// Whether the output projection is the token embedding (no weight of its own).
    pub fn ties_output(&self) -> bool {
        self.output.is_none()
    }

    /// A KV cache for one sequence of up to `capacity` tokens (for hybrid models also the
    /// linear-attention layers' state).
    pub fn new_kv(&self, be: &B, capacity: usize) -> Result<B::Kv> {
        match &self.cfg.hybrid {
            Some(h) => {
                // The MTP head's attention layers, when loaded, take the slots after the
                // model's own.
                let (n_lin, n_attn) = h.counts();
                let n_attn = n_attn + self.mtp.as_ref().map_or(0, |m| m.layers.len());
                be.kv_new_hybrid(n_attn, self.cfg.attn, capacity, n_lin, h.delta)
            }
            None => be.kv_new(self.cfg.n_layers, self.cfg.attn, capacity),
        }
    }

    /// A paged KV cache shared by the sequences of batched steps. For a hybrid model also a
    /// pool of `seqs` linear-attention states, one for each sequence that may be running at
    /// once ([`ferrite_backend::SeqRows::state`]); the MTP head's layers are not in it
    /// (batched steps do not speculate with the head).
    pub fn new_paged_kv(&self, be: &B, paged: PagedKv, seqs: usize) -> Result<B::Kv> {
        match &self.cfg.hybrid {
            Some(h) => {
                let (n_lin, n_attn) = h.counts();
                be.kv_new_paged_hybrid(n_attn, self.cfg.attn, paged, n_lin, h.delta, seqs)
            }
            None => be.kv_new_paged(self.cfg.n_layers, self.cfg.attn, paged),
        }
    }

    /// Activation buffers for batched steps ([`Backend::set_batch`]) of up to `max_rows`
    /// rows from up to `max_seqs` sequences, each with a block table of up to `max_pages`
    /// pages of `page_size` positions; their logits come with [`Logits::SeqLast`], at most
    /// `max_logits` rows a step (`max_seqs`, or more where sequences verify drafts).
    pub fn batch_workspace(
        &self,
        be: &B,
        max_rows: usize,
        max_seqs: usize,
        max_logits: usize,
        max_pages: usize,
        page_size: usize,
    ) -> Result<Workspace<B>> {
        anyhow::ensure!(
            (1..=max_rows).contains(&max_seqs) && (max_seqs..=max_rows).contains(&max_logits),
            "a batched workspace of {max_rows} rows for {max_seqs} sequences and {max_logits} \
             logits rows"
        );
        let mut ws = self.workspace(be, max_rows, Logits::Last)?;
        ws.step = be.batch_step_input(max_rows, max_seqs, max_pages, page_size)?;
        ws.last = be.zeros(max_logits, self.cfg.hidden)?;
        ws.logits = be.zeros(max_logits, self.cfg.vocab)?;
        ws.top_ids = be.step_input(max_logits * TOP_K_MAX)?.tokens;
        Ok(ws)
    }

    /// Activation buffers for steps of up to `max_rows` tokens, allocated once and reused
    /// (a decode step then touches no allocator and can be captured as a graph). `which`
    /// says whether steps will want every row's logits or only the last one's.
    pub fn workspace(&self, be: &B, max_rows: usize, which: Logits) -> Result<Workspace<B>> {
        let c = &self.cfg;
        let a = c.attn;
        let ffn = c.ffn.max(1);
        let n_exp = c.moe.as_ref().map_or(1, |m| m.routing.n_experts);
        Ok(Workspace {
            step: be.step_input(max_rows)?,
            x: be.zeros(max_rows, c.hidden)?,
            x2: be.zeros(max_rows, c.hidden)?,
            h: be.zeros(max_rows, c.hidden)?,
            q: be.zeros(max_rows, a.n_heads * a.head_dim)?,
            k: be.zeros(max_rows, a.n_kv_heads * a.head_dim)?,
            v: be.zeros(max_rows, a.n_kv_heads * a.head_dim)?,
            att: be.zeros(max_rows, a.n_heads * a.head_dim)?,
            y: be.zeros(max_rows, c.hidden)?,
            gate: be.zeros(max_rows, ffn)?,
            up: be.zeros(max_rows, ffn)?,
            act: be.zeros(max_rows, ffn)?,
            router: be.zeros(max_rows, n_exp)?,
            last: be.zeros(1, c.hidden)?,
            logits: be.zeros(if which == Logits::All { max_rows } else { 1 }, c.vocab)?,
            argmax: be.step_input(max_rows)?.tokens,
            top_ids: be.step_input(TOP_K_MAX)?.tokens,
            hybrid: match &c.hybrid {
                Some(_) => Some(crate::qwen3_5::Buffers::new(be, c, max_rows)?),
                None => None,
            },
        })
    }

    /// Runs the step in `ws.step` (tokens and positions set with [`Backend::set_step`])
    /// through the model, appending its keys and values to `kv`. Logits land in
    /// `ws.logits`: one row (the last position) for [`Logits::Last`], every row for
    /// [`Logits::All`].
    pub fn forward(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        kv: &mut B::Kv,
        which: Logits,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let a = cfg.attn;
        let t = ws.step.rows;
        anyhow::ensure!(t > 0, "forward: no tokens");
        ws.set_rows(t)?;
        if !self.hybrid.is_empty() {
            be.embed(&self.embed, &ws.step, &mut ws.x)?;
            crate::qwen3_5::forward_layers(be, cfg, &self.hybrid, &self.out_norm, ws, kv)?;
            return self.output_logits(be, ws, which);
        }
        let Workspace {
            step,
            x,
            x2,
            h,
            q,
            k,
            v,
            att,
            y,
            gate,
            up,
            act,
            router,
            ..
        } = ws;

        be.embed(&self.embed, step, x)?;
        // The residual stream: `x` holds it, `x_alt` takes the sum where it goes out of place.
        let (mut x, mut x_alt) = (x, x2);
        // h = the first layer's attention input; from then on every norm is fused with
        // the residual add before it.
        let first_norm = self.layers.first().map_or(&self.out_norm, |l| &l.attn_norm);
        // Float-weight decode on a backend that defers the RMSNorms into the projections
        // after them ([`Backend::defers_rms_norm`]): the residual adds go into the
        // projections before them, so no norm or add runs on its own.
        let defer = self.defers_norms(be, t);
        if !defer {
            // Read next only by the first layer's Q, K, V ([`Backend::rms_norm_for`]).
            let readers = self.qkv_readers(0);
            be.rms_norm_for(
                x,
                first_norm,
                cfg.rms_eps,
                h,
                readers.as_ref().map_or(&[], |r| r),
            )?;
        }
        // Whether the previous layer's down projection handed this layer's attention norm
        // over to its Q, K, V ([`Backend::matmul_add_for_norm`]) instead of writing h.
        let mut handed = false;
        for (il, l) in self.layers.iter().enumerate() {
            // Attention block (h = rms_norm(x) · attn_norm).
            if defer || handed {
                be.rms_norm_matmuls(
                    x,
                    (&l.attn_norm, cfg.rms_eps),
                    &[&l.wq, &l.wk, &l.wv],
                    &mut [&mut *q, &mut *k, &mut *v],
                    h,
                )?;
            } else {
                be.matmuls(h, &[&l.wq, &l.wk, &l.wv], &mut [&mut *q, &mut *k, &mut *v])?;
            }
            // The experts predicted for this layer: their prefetch, where it was held back.
            be.moe_prefetch_at(MixerPoint::Projected)?;
            let (qn, kn) = match &l.qk_norm {
                Some((qn, kn)) => (Some(qn), Some(kn)),
                None => (None, None),
            };
            let qk = QkRope {
                q_norm: qn,
                k_norm: kn,
                head_dim: a.head_dim,
                eps: cfg.rms_eps,
                step,
                rope: &cfg.rope,
            };
            // att is read next by the o-projection alone, where its 16-bit hand-over applies.
            let o_reader = [&l.wo];
            let readers: &[&B::Weight] = if defer { &[] } else { &o_reader };
            be.qk_norm_rope_attention_for(kv, qk, (&mut *q, &mut *k, &*v), il, a, att, readers)?;
            be.moe_prefetch_at(MixerPoint::Mixed)?;
            let norm = (&l.ffn_norm, cfg.rms_eps);
            if defer {
                // x += o(att), then the FFN with its norm deferred.
                be.matmul_add(att, &l.wo, x, y)?;
                deferred_ffn(be, &l.ffn, norm, x, (&mut *gate, &mut *up, &mut *act), h, y)?;
                continue;
            }
            if let Some((wg, wu, wd)) = handed_ffn(be, &l.wo, &l.ffn, t) {
                // x += o(att), handing rms_norm(x) · ffn_norm over to the SwiGLU;
                // y = down(SwiGLU), added with the next norm below.
                be.matmul_add_for_norm(att, &l.wo, x, y, norm)?;
                be.rms_norm_matmul_swiglu(x, norm, wg, wu, (&mut *gate, &mut *up), act, h)?;
                // x += down(act), handing the next layer's attention norm over to its Q, K, V
                // where the backend can ([`Backend::defers_rms_norm_after`]).
                if let Some(n) = self
                    .layers
                    .get(il + 1)
                    .filter(|n| be.defers_rms_norm_after(wd, &[&n.wq, &n.wk, &n.wv], t))
                {
                    be.matmul_add_for_norm(act, wd, x, y, (&n.attn_norm, cfg.rms_eps))?;
                    handed = true;
                    continue;
                }
                be.matmul(act, wd, y)?;
            } else if let Ffn::Dense {
                gate: wg,
                up: wu,
                down: wd,
            } = &l.ffn
            {
                // x += o(att), h = rms_norm(x) · ffn_norm: the add in the projection's epilogue
                // where the backend has one ([`Backend::adds_in_epilogue`]), else with the
                // norm. h is read next by the gate and up alone ([`Backend::add_rms_norm_for`]).
                let (fnorm, eps) = norm;
                if be.adds_in_epilogue(&l.wo, t) {
                    be.matmul_add(att, &l.wo, x, y)?;
                    be.rms_norm_for(x, fnorm, eps, h, &[wg, wu])?;
                } else {
                    be.matmul(att, &l.wo, y)?;
                    be.add_rms_norm_for(x, y, fnorm, eps, h, &[wg, wu])?;
                }
                // x += down(SwiGLU(h)), h = the next layer's attention input (read by its Q,
                // K, V alone) or the output norm's result.
                let (next_norm, next) = self.attn_input(il + 1);
                let readers = next.as_ref().map_or(&[][..], |r| r);
                if be.adds_in_epilogue(wd, t) {
                    be.swiglu_mlp_add(h, wg, wu, wd, (&mut *gate, &mut *up), act, x, y)?;
                    be.rms_norm_for(x, next_norm, eps, h, readers)?;
                } else {
                    be.swiglu_mlp(h, wg, wu, wd, (&mut *gate, &mut *up), act, y)?;
                    be.add_rms_norm_for(x, y, next_norm, eps, h, readers)?;
                }
                handed = false;
                continue;
            } else {
                be.matmul(att, &l.wo, y)?;

                // Feed-forward block: x += y, h = rms_norm(x) · ffn_norm, y = FFN(h).
                let scratch = FfnScratch::<B> {
                    gate: &mut *gate,
                    up: &mut *up,
                    act: &mut *act,
                    router: &mut *router,
                    shared: None,
                };
                ffn_half(
                    be,
                    &l.ffn,
                    cfg.moe.as_ref(),
                    (&mut x, &mut x_alt),
                    norm,
                    h,
                    scratch,
                    y,
                )?;
            }
            // x += y, h = the next layer's attention input, read by its Q, K, V alone (or the
            // output norm's result).
            handed = false;
            let (next_norm, next) = self.attn_input(il + 1);
            let readers = next.as_ref().map_or(&[][..], |r| r);
            be.add_rms_norm_for(x, y, next_norm, cfg.rms_eps, h, readers)?;
            let next = self.layers.get(il + 1).map(|n| (&n.ffn, &n.ffn_norm));
            prefetch_experts(be, cfg, x, next)?;
        }

        if defer {
            be.rms_norm(x, &self.out_norm, cfg.rms_eps, h)?;
        }
        self.output_logits(be, ws, which)
    }

    /// The weights that read layer `il`'s attention input h: its Q, K, V (none past the last
    /// layer, where h is the output norm's result). An array, not a Vec: asked twice a layer
    /// on every step, decode's included.
    fn qkv_readers(&self, il: usize) -> Option<[&B::Weight; 3]> {
        self.layers.get(il).map(|l| [&l.wq, &l.wk, &l.wv])
    }

    /// Layer `il`'s attention-input norm weight (the output norm past the last layer) and the
    /// weights that read its result ([`Self::qkv_readers`]).
    fn attn_input(&self, il: usize) -> (&B::Weight, Option<[&B::Weight; 3]>) {
        let norm = self.layers.get(il).map_or(&self.out_norm, |n| &n.attn_norm);
        (norm, self.qkv_readers(il))
    }

    /// Whether a step of `rows` rows runs with the RMSNorms deferred into the projections
    /// after them: every layer dense, and the backend defers for every projection (those
    /// after a norm take it; the o- and down projections then add to the residual).
    fn defers_norms(&self, be: &B, rows: usize) -> bool {
        !self.layers.is_empty()
            && self.layers.iter().all(|l| match &l.ffn {
                Ffn::Dense { gate, up, down } => {
                    be.defers_rms_norm(&[&l.wq, &l.wk, &l.wv, &l.wo, gate, up, down], rows)
                }
                Ffn::Moe { .. } => false,
            })
    }

    /// The output projection of the step's last row, or of every row; `ws.h` holds
    /// `rms_norm(x) · output_norm` of every row (the layers fuse that norm with their last
    /// residual add).
    pub(crate) fn output_logits(&self, be: &B, ws: &mut Workspace<B>, which: Logits) -> Result<()> {
        let t = ws.step.rows;
        // Logits::SeqLast: the last rows of each sequence of the step (one, or a verify's).
        let seq_ends: Vec<usize> = match (which, &ws.step.batch) {
            (Logits::SeqLast, Some(b)) => b
                .segs
                .iter()
                .flat_map(|s| s.row0 + s.rows - s.logits..s.row0 + s.rows)
                .collect(),
            _ => Vec::new(),
        };
        let Workspace {
            h, last, logits, ..
        } = ws;
        let out_w = self.output.as_ref().unwrap_or(&self.embed);
        match which {
            Logits::All => {
                logits
                    .set_rows(t)
                    .context("this workspace keeps only the last position's logits")?;
                be.matmul(h, out_w, logits)?;
            }
            Logits::Last => {
                logits.set_rows(1)?;
                if t == 1 {
                    // A decode step: h is that one row.
                    be.matmul(h, out_w, logits)?;
                } else {
                    // RMSNorm is row-wise: the last row of the normalised rows is the
                    // norm of the last row.
                    be.copy_rows(h, t - 1, last)?;
                    be.matmul(last, out_w, logits)?;
                }
            }
            Logits::SeqLast => {
                let n = seq_ends.len();
                anyhow::ensure!(n > 0, "Logits::SeqLast needs a batched step (set_batch)");
                logits
                    .set_rows(n)
                    .context("this workspace keeps fewer sequences' logits")?;
                if n == t {
                    // Every row's logits (decode rows, verifies): h is those rows, in order.
                    be.matmul(h, out_w, logits)?;
                } else {
                    last.set_rows(n)?;
                    be.gather_rows(h, &seq_ends, last)?;
                    be.matmul(last, out_w, logits)?;
                }
            }
        }
        Ok(())
    }

    /// Convenience for tools and tests: runs `tokens` at positions `pos0..` in chunks of
    /// the workspace's capacity and returns the requested logits on the host.
    pub fn run(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        kv: &mut B::Kv,
        pos0: usize,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Vec<f32>> {
        anyhow::ensure!(!tokens.is_empty(), "no tokens to run");
        let cap = ws.step.capacity;
        let mut out = Vec::new();
        let n_chunks = tokens.len().div_ceil(cap);
        for (i, chunk) in tokens.chunks(cap).enumerate() {
            be.set_step(&mut ws.step, chunk, pos0 + i * cap)?;
            let last_chunk = i + 1 == n_chunks;
            let w = if which == Logits::All {
                Logits::All
            } else {
                Logits::Last
            };
            self.forward(be, ws, kv, w)?;
            if which == Logits::All || last_chunk {
                out.extend(be.to_host(&ws.logits)?);
            }
        }
        Ok(out)
    }
}

/// Preallocated activations of one sequence's steps (see [`Model::workspace`]).
pub struct Workspace<B: Backend> {
    /// Token ids and positions of the current step.
    pub step: StepInput<B::IBuf>,
    pub(crate) x: Act<B::Buf>,
    /// The residual's other buffer: a MoE layer's FFN input op
    /// ([`Backend::add_rms_norm_matmul`]) may write `x + y` out of place (CUDA at one decode
    /// row), and from such a layer on the residual alternates between `x` and `x2`.
    pub(crate) x2: Act<B::Buf>,
    pub(crate) h: Act<B::Buf>,
    pub(crate) q: Act<B::Buf>,
    pub(crate) k: Act<B::Buf>,
    pub(crate) v: Act<B::Buf>,
    pub(crate) att: Act<B::Buf>,
    pub(crate) y: Act<B::Buf>,
    pub(crate) gate: Act<B::Buf>,
    pub(crate) up: Act<B::Buf>,
    pub(crate) act: Act<B::Buf>,
    pub(crate) router: Act<B::Buf>,
    pub(crate) last: Act<B::Buf>,
    /// Logits of the last step: `[1, vocab]` or `[rows, vocab]`.
    pub logits: Act<B::Buf>,
    /// Greedy choices of the last step (device side), see [`Backend::argmax`].
    pub argmax: B::IBuf,
    /// The best `k ≤ TOP_K_MAX` logits of the last position, see [`Backend::top_k`].
    pub top_ids: B::IBuf,
    /// Qwen3.5's extra buffers (linear attention, attention gate, shared expert).
    pub(crate) hybrid: Option<crate::qwen3_5::Buffers<B>>,
}

/// Largest top-k the device selects for sampling (larger k copies the logits to the host).
pub const TOP_K_MAX: usize = 64;

impl<B: Backend> Workspace<B> {
    pub(crate) fn set_rows(&mut self, t: usize) -> Result<()> {
        for a in [
            &mut self.x,
            &mut self.x2,
            &mut self.h,
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.att,
            &mut self.y,
            &mut self.gate,
            &mut self.up,
            &mut self.act,
            &mut self.router,
        ] {
            a.set_rows(t)?;
        }
        if let Some(hb) = &mut self.hybrid {
            hb.set_rows(t)?;
        }
        Ok(())
    }
    /// Most rows one step can hold.
    pub fn capacity(&self) -> usize {
        self.step.capacity
    }
    /// What a forward of `t` rows with logits `which` leaves in this workspace's host-side
    /// row counts, set without running it: a graph replay of such a forward runs its
    /// kernels but none of its bookkeeping.
    pub fn replayed(&mut self, t: usize, which: Logits) -> Result<()> {
        self.set_rows(t)?;
        self.logits.set_rows(match which {
            Logits::All => t,
            Logits::Last => 1,
            Logits::SeqLast => anyhow::bail!("a replayed batched step sets its own logits rows"),
        })
    }

    /// Keeps the first `t` rows of the last step's activations and logits (`which`: the
    /// logits it asked for): what a step of those `t` rows alone leaves, the model being
    /// causal (every op row-wise but attention, which reads earlier positions only).
    pub fn truncate(&mut self, t: usize, which: Logits) -> Result<()> {
        anyhow::ensure!(
            t >= 1 && t <= self.step.rows,
            "truncate to {t} rows of a step of {}",
            self.step.rows
        );
        self.step.rows = t;
        self.replayed(t, which)
    }

    /// `rms_norm(x) · output_norm` of every row of the last step: the hidden states the
    /// output projection reads (after [`Model::mtp_forward`], the MTP head's).
    pub fn hidden(&self) -> &Act<B::Buf> {
        &self.h
    }
}
