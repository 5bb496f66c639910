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
//! As in [`crate::decoder`], the QK-norm, the (partial) rotation and the attention are one
//! [`Backend::qk_norm_rope_attention`] and every residual add is fused with the RMSNorm after it
//! ([`Backend::add_rms_norm`]).
//!
//! transformers' zero-centred norms scale by `1 + w`, computed in f32 from the stored
//! weight; the loader stores that sum as an f32 weight, so the backend's plain RMSNorm ops
//! apply it. The linear-attention output norm (`Qwen3_5RMSNormGated`) scales by `w` itself.
//!
//! Checkpoints: `Qwen3_5ForCausalLM` keeps the text model under `model.`; the released
//! vision-language checkpoints (`Qwen3_5ForConditionalGeneration`) under
//! `model.language_model.`. Their `mtp.*` tensors (the multi-token-prediction head) are
//! read only on request, by [`crate::mtp`], for speculative decoding.

use std::borrow::Cow;

use anyhow::{bail, Context, Result};
use ferrite_backend::{
    Act, Backend, DeltaArgs, DeltaShape, HostTensor, MixerPoint, QkRope, StepInput,
};

use crate::decoder::Uploader;
use crate::mix::{Mix, Role};
use ferrite_formats::{quant, GgmlType};

use crate::config::ModelConfig;
use crate::decoder::{
    deferred_ffn, ffn_half, handed_ffn, prefetch_experts, Ffn, FfnScratch, Model, SharedExpert,
    Workspace,
};
use crate::source::ModelFile;

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

/// Runs every layer of the step in `ws.step` on `ws.x` (already embedded); leaves
/// `rms_norm(x) · out_norm` in `ws.h` (the last residual add fused with that norm).
pub(crate) fn forward_layers<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    layers: &[Layer<B::Weight>],
    out_norm: &B::Weight,
    ws: &mut Workspace<B>,
    kv: &mut B::Kv,
) -> Result<()> {
    let a = cfg.attn;
    let delta = cfg.hybrid.as_ref().context("not a hybrid model")?.delta;
    let eps = cfg.rms_eps;
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
        hybrid,
        ..
    } = ws;
    let hb = hybrid
        .as_mut()
        .context("workspace lacks the hybrid buffers")?;
    let step: &StepInput<B::IBuf> = step;

    // Float-weight decode on a backend that defers the RMSNorms into the projections after
    // them (as decoder.rs): the residual adds go into the projections before them.
    let defer = defers_norms(be, layers, step.rows);
    // h = the first layer's mixer input; every later norm is fused with the residual add
    // before it.
    if !defer {
        be.rms_norm(x, layers.first().map_or(out_norm, |l| &l.attn_norm), eps, h)?;
    }
    // The residual stream: `x` holds it, `x_alt` takes the sum where it goes out of place.
    let (mut x, mut x_alt) = (x, x2);
    for (il, l) in layers.iter().enumerate() {
        // Where the backend takes it (decoder.rs), the mixer's output projection adds into x
        // itself and hands the FFN's RMSNorm over to the SwiGLU.
        let ffn_norm = (&l.ffn_norm, eps);
        let mixer_out = match &l.mixer {
            Mixer::Linear { out, .. } => out,
            Mixer::Attention { o, .. } => o,
        };
        let handed = if defer {
            None
        } else {
            handed_ffn(be, mixer_out, &l.ffn, step.rows)
        };
        // Token mixer (h = rms_norm(x) · attn_norm).
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
                // qkv and z before the convolution: one quantization of h serves both (a
                // launch between them would invalidate it); the two small β/α projections
                // (float GEMVs) in one launch.
                let mixer_norm = (&l.attn_norm, eps);
                if defer {
                    be.rms_norm_matmuls(
                        x,
                        mixer_norm,
                        &[qkv, z],
                        &mut [&mut hb.mixed, &mut hb.z],
                        h,
                    )?;
                } else {
                    be.matmuls(h, &[qkv, z], &mut [&mut hb.mixed, &mut hb.z])?;
                }
                // The experts predicted for this layer: their prefetch, where it was held back.
                be.moe_prefetch_at(MixerPoint::Projected)?;
                // A batched step's sequences each continue their own state.
                let batch = step.batch.as_ref();
                be.causal_conv1d(kv, *slot, &hb.mixed, conv, &mut hb.conv, batch)?;
                if defer {
                    be.rms_norm_matmuls(x, mixer_norm, &[b, wa], &mut [&mut hb.b, &mut hb.a], h)?;
                } else {
                    be.matmuls(h, &[b, wa], &mut [&mut hb.b, &mut hb.a])?;
                }
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
                    batch,
                )?;
                be.moe_prefetch_at(MixerPoint::Mixed)?;
                be.gated_rms_norm(&mut hb.core, &hb.z, norm, delta.v_head_dim, eps)?;
                if defer {
                    be.matmul_add(&hb.core, out, x, y)?;
                } else if handed.is_some() {
                    be.matmul_add_for_norm(&hb.core, out, x, y, ffn_norm)?;
                } else {
                    be.matmul(&hb.core, out, y)?;
                }
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
                // One grouped decode launch where the types allow (x quantized once).
                let outs = &mut [&mut *q, &mut hb.attn_gate, &mut *k, &mut *v];
                if defer {
                    be.rms_norm_matmuls(x, (&l.attn_norm, eps), &[wq, wg, wk, wv], outs, h)?;
                } else {
                    be.matmuls(h, &[wq, wg, wk, wv], outs)?;
                }
                be.moe_prefetch_at(MixerPoint::Projected)?;
                // One op, so a backend may fuse it as the dense decoder's attention half does
                // (CUDA at prefill rows: the keys and values stored by the rotation's launch).
                // att is read next by the sigmoid gate, not by a matmul: no hand-over.
                let qk = QkRope {
                    q_norm: Some(q_norm),
                    k_norm: Some(k_norm),
                    head_dim: a.head_dim,
                    eps,
                    step,
                    rope: &cfg.rope,
                };
                be.qk_norm_rope_attention(kv, qk, (q, k, &*v), *slot, a, att)?;
                be.moe_prefetch_at(MixerPoint::Mixed)?;
                be.sigmoid_gate(att, &hb.attn_gate)?;
                if defer {
                    be.matmul_add(att, wo, x, y)?;
                } else if handed.is_some() {
                    be.matmul_add_for_norm(att, wo, x, y, ffn_norm)?;
                } else {
                    be.matmul(att, wo, y)?;
                }
            }
        }
        if defer {
            deferred_ffn(
                be,
                &l.ffn,
                ffn_norm,
                x,
                (&mut *gate, &mut *up, &mut *act),
                h,
                y,
            )?;
            continue;
        }
        if let Some((wg, wu, wd)) = handed {
            // x already holds x + mixer(x); y = down(SwiGLU(rms_norm(x) · ffn_norm)).
            be.rms_norm_matmul_swiglu(x, ffn_norm, wg, wu, (&mut *gate, &mut *up), act, h)?;
            be.matmul(act, wd, y)?;
        } else {
            // Feed-forward: x += y, h = rms_norm(x) · ffn_norm, y = FFN(h).
            let scratch = FfnScratch::<B> {
                gate: &mut *gate,
                up: &mut *up,
                act: &mut *act,
                router: &mut *router,
                shared: Some((&mut hb.shared, &mut hb.shared_gate)),
            };
            ffn_half(
                be,
                &l.ffn,
                cfg.moe.as_ref(),
                (&mut x, &mut x_alt),
                ffn_norm,
                h,
                scratch,
                y,
            )?;
        }
        // x += y, h = the next layer's mixer input (or the output norm's result). A gated
        // attention's Q, gate, K, V alone read it ([`Backend::add_rms_norm_for`]); a Gated
        // DeltaNet's in-projections read it twice (qkv and z, then b and a), so it is written.
        let next_norm = layers.get(il + 1).map_or(out_norm, |n| &n.attn_norm);
        match layers.get(il + 1).map(|n| &n.mixer) {
            Some(Mixer::Attention { q, gate, k, v, .. }) => {
                be.add_rms_norm_for(x, y, next_norm, eps, h, &[q, gate, k, v])?
            }
            _ => be.add_rms_norm(x, y, next_norm, eps, h)?,
        }
        let next = layers.get(il + 1).map(|n| (&n.ffn, &n.ffn_norm));
        prefetch_experts(be, cfg, x, next)?;
    }
    if defer {
        be.rms_norm(x, out_norm, eps, h)?;
    }
    Ok(())
}

/// Whether a step of `rows` rows runs with the RMSNorms deferred into the projections after
/// them (decoder.rs `defers_norms`): every FFN dense, every projection deferrable.
fn defers_norms<B: Backend>(be: &B, layers: &[Layer<B::Weight>], rows: usize) -> bool {
    !layers.is_empty()
        && layers.iter().all(|l| {
            let Ffn::Dense { gate, up, down } = &l.ffn else {
                return false;
            };
            let [m0, m1, m2, m3, m4] = match &l.mixer {
                Mixer::Linear {
                    qkv, z, b, a, out, ..
                } => [qkv, z, b, a, out],
                Mixer::Attention {
                    q, gate, k, v, o, ..
                } => [q, gate, k, v, o],
            };
            be.defers_rms_norm(&[gate, up, down, m0, m1, m2, m3, m4], rows)
        })
}

/// An f32 weight `1 + w`: transformers' zero-centred RMSNorm scale, as it computes it.
pub(crate) fn plus_one(t: &HostTensor<'_>) -> Result<HostTensor<'static>> {
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

/// The logical weights of a Qwen3.5 model; [`Names::of`] maps them to each format's names.
#[derive(Clone, Copy, Debug)]
enum W {
    Embed,
    OutputNorm,
    Output,
    AttnNorm(usize),
    FfnNorm(usize),
    Qkv(usize),
    Z(usize),
    B(usize),
    A(usize),
    Conv(usize),
    SsmA(usize),
    DtBias(usize),
    SsmNorm(usize),
    SsmOut(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    QNorm(usize),
    KNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    Router(usize),
    SharedGate(usize),
    SharedUp(usize),
    SharedDown(usize),
    SharedExpertGate(usize),
}

impl W {
    /// Its kind for a quantization mix, and the layer the mix's rules see (a V projection's
    /// is given by the caller: llama.cpp counts the attn_v tensors).
    fn role(self) -> (Role, usize) {
        use W::*;
        match self {
            Embed => (Role::TokenEmbd, 0),
            Output => (Role::Output, 0),
            OutputNorm => (Role::Norm, 0),
            AttnNorm(i) | FfnNorm(i) | SsmA(i) | DtBias(i) | SsmNorm(i) | QNorm(i) | KNorm(i) => {
                (Role::Norm, i)
            }
            Qkv(i) => (Role::AttnQkv, i),
            Z(i) | B(i) | A(i) | SsmOut(i) => (Role::Other, i),
            Conv(i) | SharedExpertGate(i) => (Role::KeepF32, i),
            Q(i) => (Role::AttnQ, i),
            K(i) => (Role::AttnK, i),
            V(i) => (Role::AttnV, i),
            O(i) => (Role::AttnOut, i),
            Gate(i) | Up(i) | SharedGate(i) | SharedUp(i) => (Role::FfnGateUp, i),
            Down(i) | SharedDown(i) => (Role::FfnDown, i),
            Router(i) => (Role::Router, i),
        }
    }
}

/// The row-major shape weight `w` of a Qwen3.5 model must have under `cfg` (as stored, in
/// either format); `None` for the two whose stored shape varies (the conv taps and the
/// shared expert's gate vector, each checked by its element count where it is read).
fn shape_of(cfg: &ModelConfig, w: W) -> Option<Vec<usize>> {
    use W::*;
    let a = cfg.attn;
    let d = cfg.hybrid.as_ref()?.delta;
    let (h, q, kv) = (
        cfg.hidden,
        a.n_heads * a.head_dim,
        a.n_kv_heads * a.head_dim,
    );
    let moe = cfg.moe.as_ref();
    let shared = moe.map_or(0, |m| m.shared_expert_ffn);
    Some(match w {
        Embed | Output => vec![cfg.vocab, h],
        OutputNorm | AttnNorm(_) | FfnNorm(_) => vec![h],
        Qkv(_) => vec![d.conv_dim(), h],
        Z(_) => vec![d.value_dim(), h],
        B(_) | A(_) => vec![d.n_v_heads, h],
        SsmA(_) | DtBias(_) => vec![d.n_v_heads],
        SsmNorm(_) => vec![d.v_head_dim],
        SsmOut(_) => vec![h, d.value_dim()],
        // The query rows and the output gate's, interleaved by head.
        Q(_) => vec![2 * q, h],
        K(_) | V(_) => vec![kv, h],
        O(_) => vec![h, q],
        QNorm(_) | KNorm(_) => vec![a.head_dim],
        Gate(_) | Up(_) => vec![cfg.ffn, h],
        Down(_) => vec![h, cfg.ffn],
        Router(_) => vec![moe.map_or(0, |m| m.routing.n_experts), h],
        SharedGate(_) | SharedUp(_) => vec![shared, h],
        SharedDown(_) => vec![h, shared],
        Conv(_) | SharedExpertGate(_) => return None,
    })
}

/// Tensor naming of one file: llama.cpp's GGUF names, or Hugging Face names under a prefix
/// (`model.` for `Qwen3_5ForCausalLM`, `model.language_model.` for the VL wrappers).
enum Names {
    Gguf,
    Hf(&'static str),
}

impl Names {
    fn of(&self, w: W) -> String {
        use W::*;
        match self {
            Names::Gguf => match w {
                Embed => "token_embd.weight".into(),
                OutputNorm => "output_norm.weight".into(),
                Output => "output.weight".into(),
                AttnNorm(i) => format!("blk.{i}.attn_norm.weight"),
                FfnNorm(i) => format!("blk.{i}.post_attention_norm.weight"),
                Qkv(i) => format!("blk.{i}.attn_qkv.weight"),
                Z(i) => format!("blk.{i}.attn_gate.weight"),
                B(i) => format!("blk.{i}.ssm_beta.weight"),
                A(i) => format!("blk.{i}.ssm_alpha.weight"),
                Conv(i) => format!("blk.{i}.ssm_conv1d.weight"),
                SsmA(i) => format!("blk.{i}.ssm_a"),
                DtBias(i) => format!("blk.{i}.ssm_dt.bias"),
                SsmNorm(i) => format!("blk.{i}.ssm_norm.weight"),
                SsmOut(i) => format!("blk.{i}.ssm_out.weight"),
                Q(i) => format!("blk.{i}.attn_q.weight"),
                K(i) => format!("blk.{i}.attn_k.weight"),
                V(i) => format!("blk.{i}.attn_v.weight"),
                O(i) => format!("blk.{i}.attn_output.weight"),
                QNorm(i) => format!("blk.{i}.attn_q_norm.weight"),
                KNorm(i) => format!("blk.{i}.attn_k_norm.weight"),
                Gate(i) => format!("blk.{i}.ffn_gate.weight"),
                Up(i) => format!("blk.{i}.ffn_up.weight"),
                Down(i) => format!("blk.{i}.ffn_down.weight"),
                Router(i) => format!("blk.{i}.ffn_gate_inp.weight"),
                SharedGate(i) => format!("blk.{i}.ffn_gate_shexp.weight"),
                SharedUp(i) => format!("blk.{i}.ffn_up_shexp.weight"),
                SharedDown(i) => format!("blk.{i}.ffn_down_shexp.weight"),
                SharedExpertGate(i) => format!("blk.{i}.ffn_gate_inp_shexp.weight"),
            },
            Names::Hf(p) => {
                let la = |i: usize, n: &str| format!("{p}layers.{i}.linear_attn.{n}");
                let sa = |i: usize, n: &str| format!("{p}layers.{i}.self_attn.{n}");
                let mlp = |i: usize, n: &str| format!("{p}layers.{i}.mlp.{n}");
                match w {
                    Embed => format!("{p}embed_tokens.weight"),
                    OutputNorm => format!("{p}norm.weight"),
                    Output => "lm_head.weight".into(),
                    AttnNorm(i) => format!("{p}layers.{i}.input_layernorm.weight"),
                    FfnNorm(i) => format!("{p}layers.{i}.post_attention_layernorm.weight"),
                    Qkv(i) => la(i, "in_proj_qkv.weight"),
                    Z(i) => la(i, "in_proj_z.weight"),
                    B(i) => la(i, "in_proj_b.weight"),
                    A(i) => la(i, "in_proj_a.weight"),
                    Conv(i) => la(i, "conv1d.weight"),
                    SsmA(i) => la(i, "A_log"),
                    DtBias(i) => la(i, "dt_bias"),
                    SsmNorm(i) => la(i, "norm.weight"),
                    SsmOut(i) => la(i, "out_proj.weight"),
                    Q(i) => sa(i, "q_proj.weight"),
                    K(i) => sa(i, "k_proj.weight"),
                    V(i) => sa(i, "v_proj.weight"),
                    O(i) => sa(i, "o_proj.weight"),
                    QNorm(i) => sa(i, "q_norm.weight"),
                    KNorm(i) => sa(i, "k_norm.weight"),
                    Gate(i) => mlp(i, "gate_proj.weight"),
                    Up(i) => mlp(i, "up_proj.weight"),
                    Down(i) => mlp(i, "down_proj.weight"),
                    Router(i) => mlp(i, "gate.weight"),
                    SharedGate(i) => mlp(i, "shared_expert.gate_proj.weight"),
                    SharedUp(i) => mlp(i, "shared_expert.up_proj.weight"),
                    SharedDown(i) => mlp(i, "shared_expert.down_proj.weight"),
                    SharedExpertGate(i) => mlp(i, "shared_expert_gate.weight"),
                }
            }
        }
    }
}

/// Reads a Qwen3.5 checkpoint's tensors in one format's names and conventions, and uploads
/// them in the form the forward pass takes. The formats differ in more than names:
/// llama.cpp's converter stores the zero-centred norms as `1 + w`, `A_log` as `-exp(A_log)`,
/// the conv taps squeezed to `[channels, kernel]`, and the value heads in tiled order (see
/// [`DeltaShape::tiled_v_heads`], set from the format by [`crate::config`]); this reader
/// brings Hugging Face tensors to the same form.
pub(crate) struct Reader<'f> {
    file: &'f ModelFile,
    cfg: &'f ModelConfig,
    names: Names,
    /// Hands the weights to the backend (quantized as the load asks, counted).
    upl: Uploader,
}

impl<'f> Reader<'f> {
    /// The reader of `file`'s text model: llama.cpp's names in a GGUF, Hugging Face names
    /// under `model.` or (vision-language wrappers) `model.language_model.`.
    pub(crate) fn new(file: &'f ModelFile, cfg: &'f ModelConfig) -> Self {
        let names = match file {
            ModelFile::Gguf(_) => Names::Gguf,
            ModelFile::Safetensors(_) => Names::Hf(
                if file
                    .tensors()
                    .has("model.language_model.embed_tokens.weight")
                {
                    "model.language_model."
                } else {
                    "model."
                },
            ),
        };
        Reader {
            file,
            cfg,
            names,
            upl: Uploader::new(cfg, None),
        }
    }

    /// The same reader quantizing float matrices to `mix` as it uploads them.
    pub(crate) fn quantized(mut self, mix: Option<Mix>) -> Self {
        self.upl = Uploader::new(self.cfg, mix);
        self
    }

    /// The same checkpoint's layers under another Hugging Face prefix (the MTP head's
    /// `mtp.layers.{j}`).
    /// Its weights stay as stored (the head is small, and its own checks compare it with its
    /// float oracle).
    pub(crate) fn with_prefix(&self, prefix: &'static str) -> Self {
        Reader {
            file: self.file,
            cfg: self.cfg,
            names: Names::Hf(prefix),
            upl: Uploader::new(self.cfg, None),
        }
    }

    fn hf(&self) -> bool {
        matches!(self.names, Names::Hf(_))
    }

    fn get(&self, w: W) -> Result<HostTensor<'f>> {
        let src = self.file.tensors();
        let name = self.names.of(w);
        match shape_of(self.cfg, w) {
            Some(want) => {
                crate::source::require_shaped(src, &name, &want, self.file.config_source())
            }
            None => crate::source::require(src, &name),
        }
    }

    fn up<B: Backend>(&self, be: &B, w: W) -> Result<B::Weight> {
        let (role, layer) = w.role();
        self.upl.put(be, self.get(w)?, role, layer)
    }

    /// A zero-centred RMSNorm weight: Hugging Face stores w, GGUF 1 + w.
    fn up_norm<B: Backend>(&self, be: &B, w: W) -> Result<B::Weight> {
        let t = self.get(w)?;
        let t = if self.hf() { plus_one(&t)? } else { t };
        self.upl.put(be, t, Role::Norm, 0)
    }

    /// Layer `i`: Gated DeltaNet (`linear`) or gated attention, with its FFN; `slot` numbers
    /// it among the layers of its kind (its state or KV cache).
    pub(crate) fn layer<B: Backend>(
        &self,
        be: &B,
        i: usize,
        linear: bool,
        slot: usize,
    ) -> Result<Layer<B::Weight>> {
        let (cfg, file, names) = (self.cfg, self.file, &self.names);
        let hf = self.hf();
        let d = cfg.hybrid.as_ref().context("not a hybrid model")?.delta;
        let up = |w: W| self.up(be, w);
        let mixer = if linear {
            let mut conv = self.get(W::Conv(i))?;
            let n: usize = conv.shape.iter().product();
            anyhow::ensure!(
                n == d.conv_dim() * d.conv_kernel,
                "tensor '{}' has shape {:?}, but {}'s dimensions need {} channels × {} taps: \
                 the configuration does not belong to these weights",
                names.of(W::Conv(i)),
                conv.shape,
                file.config_source(),
                d.conv_dim(),
                d.conv_kernel
            );
            conv.shape = vec![d.conv_dim(), d.conv_kernel];
            let ssm_a = self.get(W::SsmA(i))?;
            Mixer::Linear {
                slot,
                qkv: up(W::Qkv(i))?,
                z: up(W::Z(i))?,
                b: up(W::B(i))?,
                a: up(W::A(i))?,
                conv: self.upl.put(be, conv, Role::KeepF32, i)?,
                ssm_a: self.upl.put(
                    be,
                    if hf {
                        map_f32(&ssm_a, |x| -x.exp())?
                    } else {
                        ssm_a
                    },
                    Role::Norm,
                    i,
                )?,
                dt_bias: up(W::DtBias(i))?,
                norm: up(W::SsmNorm(i))?,
                out: up(W::SsmOut(i))?,
            }
        } else {
            let [q, gate] =
                split_query_gate(&self.get(W::Q(i))?, cfg.attn.n_heads, cfg.attn.head_dim)?;
            Mixer::Attention {
                slot,
                q: self.upl.put(be, q, Role::AttnQ, i)?,
                gate: self.upl.put(be, gate, Role::AttnQ, i)?,
                k: up(W::K(i))?,
                // llama.cpp's "more bits" rule counts the attn_v tensors: this one's number
                // among them is the layer's attention slot.
                v: self.upl.put(be, self.get(W::V(i))?, Role::AttnV, slot)?,
                o: up(W::O(i))?,
                q_norm: self.up_norm(be, W::QNorm(i))?,
                k_norm: self.up_norm(be, W::KNorm(i))?,
            }
        };
        let ffn = match &cfg.moe {
            Some(m) => {
                let n = m.routing.n_experts;
                let [g, u, dn] = match names {
                    Names::Gguf => file.experts(i, n)?,
                    Names::Hf(p) => file.hf_experts(&format!("{p}layers.{i}.mlp.experts"), n)?,
                };
                crate::decoder::check_experts(file, cfg, i, [&g, &u, &dn])?;
                let mut seg = self.get(W::SharedExpertGate(i))?;
                anyhow::ensure!(
                    seg.shape.iter().product::<usize>() == cfg.hidden,
                    "tensor '{}' has shape {:?}, but {}'s dimensions need {} elements: the \
                     configuration does not belong to these weights",
                    names.of(W::SharedExpertGate(i)),
                    seg.shape,
                    file.config_source(),
                    cfg.hidden
                );
                seg.shape = vec![1, cfg.hidden];
                Ffn::Moe {
                    router: up(W::Router(i))?,
                    gate: self.upl.put(be, g, Role::FfnGateUp, i)?,
                    up: self.upl.put(be, u, Role::FfnGateUp, i)?,
                    down: self.upl.put(be, dn, Role::FfnDown, i)?,
                    shared: Some(SharedExpert {
                        gate: up(W::SharedGate(i))?,
                        up: up(W::SharedUp(i))?,
                        down: up(W::SharedDown(i))?,
                        gate_w: self.upl.put(be, seg, Role::KeepF32, i)?,
                    }),
                }
            }
            None => Ffn::Dense {
                gate: up(W::Gate(i))?,
                up: up(W::Up(i))?,
                down: up(W::Down(i))?,
            },
        };
        Ok(Layer {
            attn_norm: self.up_norm(be, W::AttnNorm(i))?,
            mixer,
            ffn_norm: self.up_norm(be, W::FfnNorm(i))?,
            ffn,
        })
    }
}

/// Uploads a Qwen3.5 model from a Hugging Face checkpoint or a llama.cpp GGUF file
/// (see [`Reader`] for how the two differ).
pub(crate) fn load<B: Backend>(
    be: &B,
    file: &ModelFile,
    cfg: ModelConfig,
    progress: &dyn Fn(usize, usize),
    quantize: Option<Mix>,
) -> Result<Model<B>> {
    let hy = cfg.hybrid.clone().context("not a hybrid model")?;
    let r = Reader::new(file, &cfg).quantized(quantize);
    crate::decoder::check_layer_count(file, &cfg, |i| r.names.of(W::AttnNorm(i)))?;
    let mut layers = Vec::with_capacity(cfg.n_layers);
    let (mut n_lin, mut n_attn) = (0, 0);
    for (i, &linear) in hy.linear.iter().enumerate() {
        let slot = if linear { &mut n_lin } else { &mut n_attn };
        layers.push(r.layer(be, i, linear, *slot)?);
        *slot += 1;
        progress(i + 1, cfg.n_layers);
    }
    let embed = r.up(be, W::Embed)?;
    let out_norm = r.up_norm(be, W::OutputNorm)?;
    let output = match file.tensors().has(&r.names.of(W::Output)) {
        true => Some(r.up(be, W::Output)?),
        false => None,
    };
    let bytes = r.upl.bytes();
    Ok(Model::from_hybrid(
        cfg, embed, layers, out_norm, output, bytes,
    ))
}

/// llama.cpp's converter's value-head reorder (`_LinearAttentionVReorderBase`): along a
/// dimension of `n_v_heads` blocks of `block` items, grouped order `[k][j]` (value head
/// `k·r + j` reads key head `k`) becomes tiled order `[j][k]`. Returns, for each new block
/// position, the old block index.
fn tiled_order(d: &DeltaShape) -> Vec<usize> {
    let (nk, r) = (d.n_k_heads, d.n_v_heads / d.n_k_heads);
    (0..d.n_v_heads).map(|t| (t % nk) * r + t / nk).collect()
}

/// Reorders blocks of `block_bytes` bytes of `data` (starting at byte `start`) by `order`.
fn reorder_blocks(data: &mut [u8], start: usize, block_bytes: usize, order: &[usize]) {
    let old = data[start..start + order.len() * block_bytes].to_vec();
    for (t, &g) in order.iter().enumerate() {
        data[start + t * block_bytes..][..block_bytes]
            .copy_from_slice(&old[g * block_bytes..][..block_bytes]);
    }
}

/// Writes a Qwen3.5 safetensors checkpoint as llama.cpp's converter writes a `qwen35` /
/// `qwen35moe` GGUF (metadata keys, tensor names, `1 + w` norms, `-exp(A_log)`, squeezed
/// conv taps, tiled value heads). Tensors keep their stored type except the f32 ones the
/// converter computes. The MTP tensors are not written: llama.cpp's converter leaves them
/// out of `qwen35` files, and ferrite reads the head from Hugging Face checkpoints.
pub(crate) fn hf_to_gguf(file: &ModelFile, cfg: &ModelConfig, dst: &std::path::Path) -> Result<()> {
    use ferrite_formats::gguf::GgufWriter;
    let hy = cfg.hybrid.as_ref().context("not a hybrid model")?;
    let d = hy.delta;
    anyhow::ensure!(
        !d.tiled_v_heads,
        "source is already in GGUF value-head order"
    );
    // llama.cpp derives the layer pattern from one interval: check the file has one.
    let every = hy
        .linear
        .iter()
        .position(|&l| !l)
        .map_or(hy.linear.len() + 1, |p| p + 1);
    anyhow::ensure!(
        hy.linear
            .iter()
            .enumerate()
            .all(|(i, &l)| l == ((i + 1) % every != 0)),
        "layer_types is not every-{every}th-layer full attention: GGUF cannot express it"
    );
    let arch = cfg.arch.gguf_name();
    let k = |s: &str| format!("{arch}.{s}");
    let mut w = GgufWriter::create(dst)?;
    w.add_kv("general.architecture", arch)?;
    w.add_kv(k("context_length"), cfg.max_ctx as u32)?;
    w.add_kv(k("embedding_length"), cfg.hidden as u32)?;
    w.add_kv(k("block_count"), cfg.n_layers as u32)?;
    w.add_kv(k("attention.head_count"), cfg.attn.n_heads as u32)?;
    w.add_kv(k("attention.head_count_kv"), cfg.attn.n_kv_heads as u32)?;
    w.add_kv(k("attention.key_length"), cfg.attn.head_dim as u32)?;
    w.add_kv(k("attention.value_length"), cfg.attn.head_dim as u32)?;
    w.add_kv(k("attention.layer_norm_rms_epsilon"), cfg.rms_eps)?;
    w.add_kv(k("rope.freq_base"), cfg.rope.theta)?;
    w.add_kv(k("rope.dimension_count"), cfg.rope.rot_dim as u32)?;
    w.add_kv(k("rope.dimension_sections"), vec![11i32, 11, 10, 0])?;
    w.add_kv(k("ssm.conv_kernel"), d.conv_kernel as u32)?;
    w.add_kv(k("ssm.state_size"), d.k_head_dim as u32)?;
    w.add_kv(k("ssm.group_count"), d.n_k_heads as u32)?;
    w.add_kv(k("ssm.time_step_rank"), d.n_v_heads as u32)?;
    w.add_kv(k("ssm.inner_size"), d.value_dim() as u32)?;
    w.add_kv(k("full_attention_interval"), every as u32)?;
    match &cfg.moe {
        Some(m) => {
            w.add_kv(k("expert_count"), m.routing.n_experts as u32)?;
            w.add_kv(k("expert_used_count"), m.routing.top_k as u32)?;
            w.add_kv(k("expert_feed_forward_length"), m.expert_ffn as u32)?;
            w.add_kv(
                k("expert_shared_feed_forward_length"),
                m.shared_expert_ffn as u32,
            )?;
        }
        None => w.add_kv(k("feed_forward_length"), cfg.ffn as u32)?,
    }

    let src = file.tensors();
    let hf_prefix = if src.has("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    };
    let (hf, gg) = (Names::Hf(hf_prefix), Names::Gguf);
    let get = |x: W| -> Result<HostTensor<'_>> { crate::source::require(src, &hf.of(x)) };
    let order = tiled_order(&d);
    let reorder = d.n_v_heads != d.n_k_heads;
    // Rows `start..` of a 2-D tensor: value heads of `rows_per_head` rows each → tiled.
    let reorder_rows = |t: &mut HostTensor<'_>, start_row: usize, rows_per_head: usize| {
        if !reorder {
            return Ok::<(), anyhow::Error>(());
        }
        let row = t.dtype.bytes_for(*t.shape.last().unwrap_or(&1))?;
        let mut data = t.data.to_vec();
        reorder_blocks(&mut data, start_row * row, rows_per_head * row, &order);
        t.data = Cow::Owned(data);
        Ok(())
    };
    let mut out: Vec<(String, HostTensor<'_>)> = vec![(gg.of(W::Embed), get(W::Embed)?)];
    for (i, &linear) in hy.linear.iter().enumerate() {
        let mut put = |x: W, t: HostTensor<'static>| out.push((gg.of(x), t));
        put(W::AttnNorm(i), plus_one(&get(W::AttnNorm(i))?)?);
        if linear {
            let mut qkv = get(W::Qkv(i))?;
            reorder_rows(&mut qkv, 2 * d.key_dim(), d.v_head_dim)?;
            let mut z = get(W::Z(i))?;
            reorder_rows(&mut z, 0, d.v_head_dim)?;
            let mut b = get(W::B(i))?;
            reorder_rows(&mut b, 0, 1)?;
            let mut a = get(W::A(i))?;
            reorder_rows(&mut a, 0, 1)?;
            let mut conv = get(W::Conv(i))?;
            conv.shape = vec![d.conv_dim(), d.conv_kernel];
            reorder_rows(&mut conv, 2 * d.key_dim(), d.v_head_dim)?;
            let mut ssm_a = map_f32(&get(W::SsmA(i))?, |x| -x.exp())?;
            ssm_a.shape = vec![d.n_v_heads, 1];
            reorder_rows(&mut ssm_a, 0, 1)?;
            ssm_a.shape = vec![d.n_v_heads];
            let mut dt = map_f32(&get(W::DtBias(i))?, |x| x)?;
            dt.shape = vec![d.n_v_heads, 1];
            reorder_rows(&mut dt, 0, 1)?;
            dt.shape = vec![d.n_v_heads];
            // out_proj: its input columns are the value heads.
            let mut o = get(W::SsmOut(i))?;
            if reorder {
                anyhow::ensure!(
                    o.dtype.block_size() == 1,
                    "reordering out_proj columns needs an unquantized type, not {}",
                    o.dtype
                );
                let es = o.dtype.type_size();
                let n_in = o.shape[1];
                let mut data = o.data.to_vec();
                for r in data.chunks_mut(n_in * es) {
                    reorder_blocks(r, 0, d.v_head_dim * es, &order);
                }
                o.data = Cow::Owned(data);
            }
            for (x, t) in [
                (W::Qkv(i), qkv),
                (W::Z(i), z),
                (W::B(i), b),
                (W::A(i), a),
                (W::Conv(i), conv),
            ] {
                put(x, t.into_owned_tensor());
            }
            put(W::SsmA(i), ssm_a);
            put(W::DtBias(i), dt);
            put(W::SsmNorm(i), get(W::SsmNorm(i))?.into_owned_tensor());
            put(W::SsmOut(i), o.into_owned_tensor());
        } else {
            for x in [W::Q(i), W::K(i), W::V(i), W::O(i)] {
                put(x, get(x)?.into_owned_tensor());
            }
            put(W::QNorm(i), plus_one(&get(W::QNorm(i))?)?);
            put(W::KNorm(i), plus_one(&get(W::KNorm(i))?)?);
        }
        put(W::FfnNorm(i), plus_one(&get(W::FfnNorm(i))?)?);
        match &cfg.moe {
            Some(m) => {
                put(W::Router(i), get(W::Router(i))?.into_owned_tensor());
                let [g, u, dn] = file.hf_experts(
                    &format!("{hf_prefix}layers.{i}.mlp.experts"),
                    m.routing.n_experts,
                )?;
                for (n, t) in [("gate", g), ("up", u), ("down", dn)] {
                    out.push((
                        format!("blk.{i}.ffn_{n}_exps.weight"),
                        t.into_owned_tensor(),
                    ));
                }
                let mut put = |x: W, t: HostTensor<'static>| out.push((gg.of(x), t));
                for x in [
                    W::SharedGate(i),
                    W::SharedUp(i),
                    W::SharedDown(i),
                    W::SharedExpertGate(i),
                ] {
                    put(x, get(x)?.into_owned_tensor());
                }
            }
            None => {
                for x in [W::Gate(i), W::Up(i), W::Down(i)] {
                    out.push((gg.of(x), get(x)?.into_owned_tensor()));
                }
            }
        }
    }
    out.push((gg.of(W::OutputNorm), plus_one(&get(W::OutputNorm)?)?));
    if src.has(&hf.of(W::Output)) {
        out.push((gg.of(W::Output), get(W::Output)?));
    }

    for (name, t) in &out {
        w.add_tensor_info(name, t.dtype, &t.shape)?;
    }
    w.write_header()?;
    for (name, t) in &out {
        w.write_tensor_data(name, &t.data)?;
    }
    w.finish()
        .with_context(|| format!("writing {}", dst.display()))?;
    Ok(())
}

trait IntoOwned {
    fn into_owned_tensor(self) -> HostTensor<'static>;
}

impl IntoOwned for HostTensor<'_> {
    fn into_owned_tensor(self) -> HostTensor<'static> {
        HostTensor {
            dtype: self.dtype,
            shape: self.shape,
            data: Cow::Owned(self.data.into_owned()),
        }
    }
}
