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

use anyhow::Result;
use ferrite_backend::{Act, Backend, ExpertWeights};

use crate::config::ModelConfig;
use crate::source::{ModelFile, Tensor};

enum Ffn<W> {
    Dense { gate: W, up: W, down: W },
    Moe { router: W, gate: W, up: W, down: W },
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

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (generation).
    Last,
    /// Every position (`ferrite logits`, oracle checks).
    All,
}

/// A loaded model: configuration plus weights in backend memory.
pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    embed: B::Weight,
    layers: Vec<Layer<B::Weight>>,
    out_norm: B::Weight,
    /// `None` when the output projection is tied to the embedding.
    output: Option<B::Weight>,
}

impl<B: Backend> Model<B> {
    /// Uploads every weight; `progress(done, total)` is called after each layer.
    pub fn load(be: &B, file: &ModelFile, progress: &dyn Fn(usize, usize)) -> Result<Self> {
        let cfg = file.config()?;
        let up = |t: Tensor| -> Result<B::Weight> { be.upload(&file.need(t)?) };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let ffn = if cfg.is_moe_layer(i) {
                let n = cfg.moe.as_ref().map_or(0, |m| m.routing.n_experts);
                let [g, u, d] = file.experts(i, n)?;
                Ffn::Moe {
                    router: up(Tensor::Router(i))?,
                    gate: be.upload(&g)?,
                    up: be.upload(&u)?,
                    down: be.upload(&d)?,
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
        let output = match file.get(Tensor::Output) {
            Some(t) => Some(be.upload(&t)?),
            None => None,
        };
        Ok(Model {
            embed: up(Tensor::Embed)?,
            out_norm: up(Tensor::OutputNorm)?,
            output,
            layers,
            cfg,
        })
    }

    /// A KV cache for one sequence of up to `capacity` tokens.
    pub fn new_kv(&self, be: &B, capacity: usize) -> Result<B::Kv> {
        be.kv_new(self.cfg.n_layers, self.cfg.attn, capacity)
    }

    /// Runs `tokens` at positions `pos0..` through the model, appending to the KV cache;
    /// returns logits `[rows, vocab]` for the positions `which` asks for.
    pub fn forward(
        &self,
        be: &B,
        kv: &mut B::Kv,
        pos0: usize,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Act<B::Buf>> {
        let cfg = &self.cfg;
        let t = tokens.len();
        let a = cfg.attn;
        anyhow::ensure!(t > 0, "forward: no tokens");
        let mut x = be.zeros(t, cfg.hidden)?;
        be.embed(&self.embed, tokens, &mut x)?;
        let mut h = be.zeros(t, cfg.hidden)?;
        let mut q = be.zeros(t, a.n_heads * a.head_dim)?;
        let mut k = be.zeros(t, a.n_kv_heads * a.head_dim)?;
        let mut v = be.zeros(t, a.n_kv_heads * a.head_dim)?;
        let mut att = be.zeros(t, a.n_heads * a.head_dim)?;
        let mut y = be.zeros(t, cfg.hidden)?;

        for (il, l) in self.layers.iter().enumerate() {
            // Attention block.
            be.rms_norm(&x, &l.attn_norm, cfg.rms_eps, &mut h)?;
            be.matmul(&h, &l.wq, &mut q)?;
            be.matmul(&h, &l.wk, &mut k)?;
            be.matmul(&h, &l.wv, &mut v)?;
            if let Some((qn, kn)) = &l.qk_norm {
                be.head_rms_norm(&mut q, qn, a.head_dim, cfg.rms_eps)?;
                be.head_rms_norm(&mut k, kn, a.head_dim, cfg.rms_eps)?;
            }
            be.rope(&mut q, a.head_dim, pos0, &cfg.rope)?;
            be.rope(&mut k, a.head_dim, pos0, &cfg.rope)?;
            be.attention(kv, il, pos0, &q, &k, &v, a, &mut att)?;
            be.matmul(&att, &l.wo, &mut y)?;
            be.add_assign(&mut x, &y)?;

            // Feed-forward block.
            be.rms_norm(&x, &l.ffn_norm, cfg.rms_eps, &mut h)?;
            match &l.ffn {
                Ffn::Dense { gate, up, down } => {
                    let mut g = be.zeros(t, cfg.ffn)?;
                    let mut u = be.zeros(t, cfg.ffn)?;
                    be.matmul(&h, gate, &mut g)?;
                    be.matmul(&h, up, &mut u)?;
                    let mut gu = be.zeros(t, cfg.ffn)?;
                    be.swiglu(&g, &u, &mut gu)?;
                    be.matmul(&gu, down, &mut y)?;
                }
                Ffn::Moe {
                    router,
                    gate,
                    up,
                    down,
                } => {
                    let moe = cfg.moe.as_ref().expect("MoE layer without MoE config");
                    let mut logits = be.zeros(t, moe.routing.n_experts)?;
                    be.matmul(&h, router, &mut logits)?;
                    be.moe(
                        &h,
                        &logits,
                        ExpertWeights { gate, up, down },
                        moe.routing,
                        &mut y,
                    )?;
                }
            }
            be.add_assign(&mut x, &y)?;
        }

        let x = match which {
            Logits::All => x,
            Logits::Last => be.slice_rows(&x, t - 1, 1)?,
        };
        let mut h = be.zeros(x.rows, cfg.hidden)?;
        be.rms_norm(&x, &self.out_norm, cfg.rms_eps, &mut h)?;
        let mut logits = be.zeros(x.rows, cfg.vocab)?;
        be.matmul(&h, self.output.as_ref().unwrap_or(&self.embed), &mut logits)?;
        Ok(logits)
    }
}
