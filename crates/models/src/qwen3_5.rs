//! Qwen3.5 / Qwen3.6 (transformers' `qwen3_5` and `qwen3_5_moe`): a hybrid stack in which
//! most layers mix tokens with Gated DeltaNet (linear attention with a recurrent state) and
//! every few layers (`layer_types`) with gated full attention.
//!
//! ```text
//! x = embed(tokens)                                            [T, hidden]
//! for each layer:
//!     h = rms_norm(x) · (1 + attn_norm)                        zero-centred RMSNorm
//!     Gated DeltaNet layer:
//!         qkv = causal_conv1d(h Wqkvᵀ | conv state), then SiLU [T, 2·Hk·dk + Hv·dv]
//!         z, b, a = h Wzᵀ, h Wbᵀ, h Waᵀ                         [T, Hv·dv], [T, Hv], [T, Hv]
//!         o = gated_delta(q, k, v | state),  g = −e^{A_log}·softplus(a + dt_bias), β = σ(b)
//!         y = (rms_norm_per_head(o) · norm_w · silu(z)) Woutᵀ
//!     gated attention layer:
//!         q, gate = h Wqᵀ split per head into [query | gate]   [T, H·d] each
//!         q, k = head_rms_norm(q)·(1+w), head_rms_norm(h Wkᵀ)·(1+w)
//!         q, k = rope(q, k) on the first partial_rotary_factor·d dims (NeoX pairs)
//!         y = (attention(q, k, v | cache) · σ(gate)) Woᵀ
//!     x += y
//!     h = rms_norm(x) · (1 + ffn_norm)
//!     x += down(silu(gate h) * up h)                           dense, or
//!     x += Σ_top-k w_e·expert_e(h) + σ(h·w_sg)·shared_expert(h)   (MoE, top-k renormalised)
//! logits = rms_norm(x) · (1 + output_norm) · Woutᵀ
//! ```
//! transformers' zero-centred norms scale by `1 + w`, computed in f32 from the stored
//! weight; the loader stores that sum as an f32 weight, so the backend's plain RMSNorm ops
//! apply it. The linear-attention output norm (`Qwen3_5RMSNormGated`) scales by `w` itself.
//!
//! Checkpoints: `Qwen3_5ForCausalLM` keeps the text model under `model.`; the released
//! vision-language checkpoints (`Qwen3_5ForConditionalGeneration`) under
//! `model.language_model.`. Their `mtp.*` tensors (the multi-token-prediction head) stay in
//! the file for speculative decoding; this forward pass does not read them.

use std::borrow::Cow;

use anyhow::{bail, Context, Result};
use ferrite_backend::{
    Act, AttnArgs, Backend, DeltaArgs, DeltaShape, ExpertWeights, HostTensor, StepInput,
};
use ferrite_formats::{quant, GgmlType};

use crate::config::ModelConfig;
use crate::decoder::{Model, Workspace};
use crate::source::{host, ModelFile};

/// How a layer mixes tokens.
pub(crate) enum Mixer<W> {
    /// Gated DeltaNet; `slot` numbers the linear layers (their state in the cache).
    Linear {
        slot: usize,
        /// `in_proj_qkv` `[2·Hk·dk + Hv·dv, hidden]`.
        qkv: W,
        /// `in_proj_z` `[Hv·dv, hidden]`: the output gate.
        z: W,
        /// `in_proj_b` `[Hv, hidden]`: write strength logits.
        b: W,
        /// `in_proj_a` `[Hv, hidden]`: decay input.
        a: W,
        /// `conv1d` taps `[conv_dim, kernel]`.
        conv: W,
        /// `-exp(A_log)` `[Hv]` (f32).
        ssm_a: W,
        dt_bias: W,
        /// Gated RMSNorm weight `[dv]`.
        norm: W,
        out: W,
    },
    /// Gated full attention; `slot` numbers the attention layers (their KV cache).
    Attention {
        slot: usize,
        q: W,
        /// The output gate's half of `q_proj`.
        gate: W,
        k: W,
        v: W,
        o: W,
        /// `1 + q_norm`, `1 + k_norm` (f32).
        q_norm: W,
        k_norm: W,
    },
}

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
        /// The shared expert's SwiGLU and its `[1, hidden]` gate.
        shared_gate: W,
        shared_up: W,
        shared_down: W,
        shared_expert_gate: W,
    },
}

pub(crate) struct Layer<W> {
    /// `1 + input_layernorm` (f32).
    attn_norm: W,
    mixer: Mixer<W>,
    /// `1 + post_attention_layernorm` (f32).
    ffn_norm: W,
    ffn: Ffn<W>,
}

/// The activations Qwen3.5 needs beyond the decoder's (see [`Workspace`]).
pub(crate) struct Buffers<B: Backend> {
    /// `in_proj_qkv` output and the convolution's output `[T, conv_dim]`.
    mixed: Act<B::Buf>,
    conv: Act<B::Buf>,
    z: Act<B::Buf>,
    a: Act<B::Buf>,
    b: Act<B::Buf>,
    /// Gated DeltaNet output `[T, Hv·dv]`.
    core: Act<B::Buf>,
    /// Attention output gate `[T, H·d]`.
    attn_gate: Act<B::Buf>,
    /// Shared expert output `[T, hidden]` and its gate logit `[T, 1]`.
    shared: Act<B::Buf>,
    shared_gate: Act<B::Buf>,
}

impl<B: Backend> Buffers<B> {
    pub(crate) fn new(be: &B, c: &ModelConfig, rows: usize) -> Result<Self> {
        let d = c.hybrid.as_ref().context("not a hybrid model")?.delta;
        Ok(Buffers {
            mixed: be.zeros(rows, d.conv_dim())?,
            conv: be.zeros(rows, d.conv_dim())?,
            z: be.zeros(rows, d.value_dim())?,
            a: be.zeros(rows, d.n_v_heads)?,
            b: be.zeros(rows, d.n_v_heads)?,
            core: be.zeros(rows, d.value_dim())?,
            attn_gate: be.zeros(rows, c.attn.n_heads * c.attn.head_dim)?,
            shared: be.zeros(rows, c.hidden)?,
            shared_gate: be.zeros(rows, 1)?,
        })
    }
    pub(crate) fn set_rows(&mut self, t: usize) -> Result<()> {
        for a in [
            &mut self.mixed,
            &mut self.conv,
            &mut self.z,
            &mut self.a,
            &mut self.b,
            &mut self.core,
            &mut self.attn_gate,
            &mut self.shared,
            &mut self.shared_gate,
        ] {
            a.set_rows(t)?;
        }
        Ok(())
    }
}

/// Runs every layer of the step in `ws.step` on `ws.x` (already embedded).
pub(crate) fn forward_layers<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    layers: &[Layer<B::Weight>],
    ws: &mut Workspace<B>,
    kv: &mut B::Kv,
) -> Result<()> {
    let a = cfg.attn;
    let delta = cfg.hybrid.as_ref().context("not a hybrid model")?.delta;
    let eps = cfg.rms_eps;
    let Workspace {
        step,
        x,
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
        hybrid,
        ..
    } = ws;
    let hb = hybrid
        .as_mut()
        .context("workspace lacks the hybrid buffers")?;
    let step: &StepInput<B::IBuf> = step;

    for l in layers {
        // Token mixer.
        be.rms_norm(x, &l.attn_norm, eps, h)?;
        match &l.mixer {
            Mixer::Linear {
                slot,
                qkv,
                z,
                b,
                a: wa,
                conv,
                ssm_a,
                dt_bias,
                norm,
                out,
            } => {
                be.matmul(h, qkv, &mut hb.mixed)?;
                be.causal_conv1d(kv, *slot, &hb.mixed, conv, &mut hb.conv)?;
                be.matmul(h, z, &mut hb.z)?;
                be.matmul(h, b, &mut hb.b)?;
                be.matmul(h, wa, &mut hb.a)?;
                be.gated_delta_rule(
                    kv,
                    DeltaArgs {
                        layer: *slot,
                        qkv: &hb.conv,
                        a: &hb.a,
                        b: &hb.b,
                        ssm_a,
                        dt_bias,
                        shape: delta,
                    },
                    &mut hb.core,
                )?;
                be.gated_rms_norm(&mut hb.core, &hb.z, norm, delta.v_head_dim, eps)?;
                be.matmul(&hb.core, out, y)?;
            }
            Mixer::Attention {
                slot,
                q: wq,
                gate: wg,
                k: wk,
                v: wv,
                o: wo,
                q_norm,
                k_norm,
            } => {
                be.matmul(h, wq, q)?;
                be.matmul(h, wg, &mut hb.attn_gate)?;
                be.matmul(h, wk, k)?;
                be.matmul(h, wv, v)?;
                be.head_rms_norm(q, q_norm, a.head_dim, eps)?;
                be.head_rms_norm(k, k_norm, a.head_dim, eps)?;
                be.rope(q, a.head_dim, step, &cfg.rope)?;
                be.rope(k, a.head_dim, step, &cfg.rope)?;
                be.attention(
                    kv,
                    step,
                    AttnArgs {
                        layer: *slot,
                        q,
                        k,
                        v,
                        shape: a,
                    },
                    att,
                )?;
                be.sigmoid_gate(att, &hb.attn_gate)?;
                be.matmul(att, wo, y)?;
            }
        }
        be.add_assign(x, y)?;

        // Feed-forward.
        be.rms_norm(x, &l.ffn_norm, eps, h)?;
        match &l.ffn {
            Ffn::Dense {
                gate: wg,
                up: wu,
                down: wd,
            } => {
                be.matmul(h, wg, gate)?;
                be.matmul(h, wu, up)?;
                be.swiglu(gate, up, act)?;
                be.matmul(act, wd, y)?;
            }
            Ffn::Moe {
                router: wr,
                gate: wg,
                up: wu,
                down: wd,
                shared_gate,
                shared_up,
                shared_down,
                shared_expert_gate,
            } => {
                let moe = cfg.moe.as_ref().context("MoE layer without MoE config")?;
                be.matmul(h, wr, router)?;
                be.moe(
                    h,
                    router,
                    ExpertWeights {
                        gate: wg,
                        up: wu,
                        down: wd,
                    },
                    moe.routing,
                    y,
                )?;
                be.matmul(h, shared_gate, gate)?;
                be.matmul(h, shared_up, up)?;
                be.swiglu(gate, up, act)?;
                be.matmul(act, shared_down, &mut hb.shared)?;
                be.matmul(h, shared_expert_gate, &mut hb.shared_gate)?;
                be.sigmoid_gate(&mut hb.shared, &hb.shared_gate)?;
                be.add_assign(y, &hb.shared)?;
            }
        }
        be.add_assign(x, y)?;
    }
    Ok(())
}

/// An f32 weight `1 + w`: transformers' zero-centred RMSNorm scale, as it computes it.
fn plus_one(t: &HostTensor<'_>) -> Result<HostTensor<'static>> {
    map_f32(t, |w| 1.0 + w)
}

/// Applies `f` to every element of a (small) tensor, giving an f32 tensor.
fn map_f32(t: &HostTensor<'_>, f: impl Fn(f32) -> f32) -> Result<HostTensor<'static>> {
    let n: usize = t.shape.iter().product();
    let mut v = vec![0f32; n];
    quant::dequantize(t.dtype, &t.data, &mut v)?;
    Ok(HostTensor {
        dtype: GgmlType::F32,
        shape: t.shape.clone(),
        data: Cow::Owned(v.iter().flat_map(|&x| f(x).to_le_bytes()).collect()),
    })
}

/// Splits `q_proj` `[H·2d, hidden]`, whose rows are per head `[query (d) | gate (d)]`
/// (transformers views the output as `[.., H, 2d]` and chunks the last dim), into the query
/// and gate matrices `[H·d, hidden]` each. Rows move whole, so any storage type works.
fn split_query_gate(
    t: &HostTensor<'_>,
    n_heads: usize,
    head_dim: usize,
) -> Result<[HostTensor<'static>; 2]> {
    let [rows, n_in] = t.shape[..] else {
        bail!("q_proj is not 2-D: {:?}", t.shape)
    };
    anyhow::ensure!(
        rows == n_heads * 2 * head_dim,
        "q_proj has {rows} rows, expected {n_heads} heads × 2 × {head_dim} (query and gate)"
    );
    let rb = t.dtype.bytes_for(n_in)?;
    let (mut q, mut g) = (Vec::new(), Vec::new());
    for hd in 0..n_heads {
        let base = hd * 2 * head_dim * rb;
        q.extend_from_slice(&t.data[base..base + head_dim * rb]);
        g.extend_from_slice(&t.data[base + head_dim * rb..base + 2 * head_dim * rb]);
    }
    let mk = |data: Vec<u8>| HostTensor {
        dtype: t.dtype,
        shape: vec![n_heads * head_dim, n_in],
        data: Cow::Owned(data),
    };
    Ok([mk(q), mk(g)])
}

/// Uploads a Qwen3.5 checkpoint (Hugging Face safetensors).
pub(crate) fn load<B: Backend>(
    be: &B,
    file: &ModelFile,
    cfg: ModelConfig,
    progress: &dyn Fn(usize, usize),
) -> Result<Model<B>> {
    let ModelFile::Safetensors(_) = file else {
        bail!("Qwen3.5 from GGUF (llama.cpp's qwen35 / qwen35moe) is not supported yet")
    };
    let hy = cfg.hybrid.clone().context("not a hybrid model")?;
    let src = file.tensors();
    // The text model of a vision-language wrapper sits under `model.language_model.`.
    let p = if src
        .tensor("model.language_model.embed_tokens.weight")
        .is_some()
    {
        "model.language_model."
    } else {
        "model."
    };
    let get = |name: &str| -> Result<HostTensor<'_>> {
        src.tensor(name)
            .map(host)
            .with_context(|| format!("model file has no tensor '{name}'"))
    };
    let up = |name: &str| -> Result<B::Weight> { be.upload(&get(name)?) };
    let up_norm = |name: &str| -> Result<B::Weight> { be.upload(&plus_one(&get(name)?)?) };
    let d: DeltaShape = hy.delta;

    let mut layers = Vec::with_capacity(cfg.n_layers);
    let (mut n_lin, mut n_attn) = (0, 0);
    for (i, &linear) in hy.linear.iter().enumerate() {
        let l = format!("{p}layers.{i}.");
        let mixer = if linear {
            let la = format!("{l}linear_attn.");
            let mut conv = get(&format!("{la}conv1d.weight"))?;
            anyhow::ensure!(
                conv.shape == [d.conv_dim(), 1, d.conv_kernel],
                "conv1d.weight has shape {:?}, expected [{}, 1, {}]",
                conv.shape,
                d.conv_dim(),
                d.conv_kernel
            );
            conv.shape = vec![d.conv_dim(), d.conv_kernel];
            let a_log = get(&format!("{la}A_log"))?;
            let m = Mixer::Linear {
                slot: n_lin,
                qkv: up(&format!("{la}in_proj_qkv.weight"))?,
                z: up(&format!("{la}in_proj_z.weight"))?,
                b: up(&format!("{la}in_proj_b.weight"))?,
                a: up(&format!("{la}in_proj_a.weight"))?,
                conv: be.upload(&conv)?,
                ssm_a: be.upload(&map_f32(&a_log, |x| -x.exp())?)?,
                dt_bias: up(&format!("{la}dt_bias"))?,
                norm: up(&format!("{la}norm.weight"))?,
                out: up(&format!("{la}out_proj.weight"))?,
            };
            n_lin += 1;
            m
        } else {
            let sa = format!("{l}self_attn.");
            let [q, gate] = split_query_gate(
                &get(&format!("{sa}q_proj.weight"))?,
                cfg.attn.n_heads,
                cfg.attn.head_dim,
            )?;
            let m = Mixer::Attention {
                slot: n_attn,
                q: be.upload(&q)?,
                gate: be.upload(&gate)?,
                k: up(&format!("{sa}k_proj.weight"))?,
                v: up(&format!("{sa}v_proj.weight"))?,
                o: up(&format!("{sa}o_proj.weight"))?,
                q_norm: up_norm(&format!("{sa}q_norm.weight"))?,
                k_norm: up_norm(&format!("{sa}k_norm.weight"))?,
            };
            n_attn += 1;
            m
        };
        let mlp = format!("{l}mlp.");
        let ffn = match &cfg.moe {
            Some(m) => {
                let [g, u, dn] = file.hf_experts(&format!("{mlp}experts"), m.routing.n_experts)?;
                Ffn::Moe {
                    router: up(&format!("{mlp}gate.weight"))?,
                    gate: be.upload(&g)?,
                    up: be.upload(&u)?,
                    down: be.upload(&dn)?,
                    shared_gate: up(&format!("{mlp}shared_expert.gate_proj.weight"))?,
                    shared_up: up(&format!("{mlp}shared_expert.up_proj.weight"))?,
                    shared_down: up(&format!("{mlp}shared_expert.down_proj.weight"))?,
                    shared_expert_gate: up(&format!("{mlp}shared_expert_gate.weight"))?,
                }
            }
            None => Ffn::Dense {
                gate: up(&format!("{mlp}gate_proj.weight"))?,
                up: up(&format!("{mlp}up_proj.weight"))?,
                down: up(&format!("{mlp}down_proj.weight"))?,
            },
        };
        layers.push(Layer {
            attn_norm: up_norm(&format!("{l}input_layernorm.weight"))?,
            mixer,
            ffn_norm: up_norm(&format!("{l}post_attention_layernorm.weight"))?,
            ffn,
        });
        progress(i + 1, cfg.n_layers);
    }
    let embed = up(&format!("{p}embed_tokens.weight"))?;
    let out_norm = up_norm(&format!("{p}norm.weight"))?;
    let output = match src.tensor("lm_head.weight") {
        Some(t) => Some(be.upload(&host(t))?),
        None => None,
    };
    Ok(Model::from_hybrid(cfg, embed, layers, out_norm, output))
}
