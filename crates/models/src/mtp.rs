//! Qwen3.5's multi-token-prediction (MTP) head: a one-layer predictor of the token after
//! next, trained with the model and shipped in its checkpoint (`mtp.*`), used as the draft
//! model of speculative decoding (`ferrite_engine::speculative`).
//!
//! Given the target model's final hidden state `h_t` (after its output norm, the vector
//! its output projection reads) and the token `x_{t+1}` that followed it:
//!
//! ```text
//! e = rms_norm(embed(x_{t+1})) · (1 + pre_fc_norm_embedding)
//! g = rms_norm(h_t) · (1 + pre_fc_norm_hidden)
//! u = fc([e | g])                           fc: [hidden, 2·hidden], embedding half first
//! u = decoder_layer(u)                      a full gated-attention layer of the target's
//!                                           kind (dense or MoE FFN), its own KV cache
//! d = rms_norm(u) · (1 + norm)              the draft hidden state
//! logits = d · Woutᵀ                        the target's output projection (shared)
//! ```
//!
//! The embedding and output projection are the target's. The row for `(h_t, x_{t+1})` sits
//! at position `t` (the position of `h_t`), as vLLM places it; only relative positions
//! reach the attention scores, so this is a convention, not a choice that changes results
//! beyond rounding. Drafting further ahead feeds the head its own draft hidden state `d`
//! with the token it drafted, one position on, reusing its layer
//! (`mtp_num_hidden_layers` = 1 in the released checkpoints).
//!
//! The head's tensors use Hugging Face's names and conventions wherever they are read from:
//! the checkpoint, an `mtp.safetensors` beside it, or for a GGUF model `X.gguf` a file
//! `X.mtp.safetensors` (llama.cpp's converter does not write Qwen3.5's head).
//!
//! `fc` is applied as two matrices (its input columns split at load: the embedding's half
//! and the hidden state's half), `u = e·Feᵀ + g·Fhᵀ`, so no concatenation op is needed.

use std::borrow::Cow;

use anyhow::{Context, Result};
use ferrite_backend::{Act, Backend, HostTensor};

use crate::decoder::{Logits, Model, Workspace};
use crate::qwen3_5::{Layer, Reader};
use crate::source::ModelFile;

/// The MTP head's weights (see the module docs).
pub(crate) struct Mtp<W> {
    /// `1 + pre_fc_norm_embedding`, `1 + pre_fc_norm_hidden` (f32).
    enorm: W,
    hnorm: W,
    /// `fc`'s input columns `0..hidden` (the embedding's) and `hidden..2·hidden`.
    fc_embed: W,
    fc_hidden: W,
    pub(crate) layers: Vec<Layer<W>>,
    /// `1 + norm` (f32).
    norm: W,
}

/// Splits the input columns of a row-major `[rows, cols]` weight at column `at` (a multiple
/// of the storage type's block): `[rows, at]` and `[rows, cols - at]`.
fn split_columns(t: &HostTensor<'_>, at: usize) -> Result<[HostTensor<'static>; 2]> {
    let [rows, cols] = t.shape[..] else {
        anyhow::bail!("a 2-D weight was expected, not shape {:?}", t.shape)
    };
    anyhow::ensure!(
        at < cols && at.is_multiple_of(t.dtype.block_size()),
        "cannot split {cols} columns of {} at column {at}",
        t.dtype
    );
    let (row, left) = (t.dtype.bytes_for(cols)?, t.dtype.bytes_for(at)?);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for r in t.data.chunks_exact(row).take(rows) {
        a.extend_from_slice(&r[..left]);
        b.extend_from_slice(&r[left..]);
    }
    let mk = |data: Vec<u8>, n: usize| HostTensor {
        dtype: t.dtype,
        shape: vec![rows, n],
        data: Cow::Owned(data),
    };
    Ok([mk(a, at), mk(b, cols - at)])
}

/// Where a head for `file` would be if not in it: beside a checkpoint directory
/// `mtp.safetensors`; beside `X.gguf`, `X.mtp.safetensors` (llama.cpp's converter leaves
/// Qwen3.5's head out of GGUF files; `ferrite synth --mtp` writes one there).
fn beside_path(file: &ModelFile) -> std::path::PathBuf {
    match file {
        ModelFile::Safetensors(c) => c.dir().join("mtp.safetensors"),
        ModelFile::Gguf(g) => g.path().with_extension("mtp.safetensors"),
    }
}

/// Where `file`'s MTP head is, for `ferrite info`: in the checkpoint, in the file beside it
/// ([`Model::load_mtp`] looks in both), or `None`.
pub fn head_location(file: &ModelFile) -> Option<String> {
    if file.tensors().has("mtp.fc.weight") {
        return Some("in the checkpoint (mtp.*)".into());
    }
    let beside = beside_path(file);
    beside.is_file().then(|| format!("in {}", beside.display()))
}

impl<B: Backend> Model<B> {
    /// Loads the checkpoint's MTP head (Hugging Face `mtp.*` tensors, in the checkpoint
    /// itself or in an `mtp.safetensors` beside it, as some releases ship the head), after
    /// which [`Model::new_kv`] makes room for its attention layers and
    /// [`Model::mtp_forward`] runs it. `file` must be the checkpoint the model was loaded
    /// from. The number of layers is the config's `mtp_num_hidden_layers`, or where it is
    /// absent the `mtp.layers.{j}` present; it must be one.
    pub fn load_mtp(&mut self, be: &B, file: &ModelFile) -> Result<()> {
        let cfg = &self.cfg;
        let hy = cfg
            .hybrid
            .as_ref()
            .context("speculative decoding with an MTP head needs a Qwen3.5 model")?;
        let beside = beside_path(file);
        let separate;
        let file = if file.tensors().has("mtp.fc.weight") || !beside.is_file() {
            file
        } else {
            separate = ModelFile::open(&beside)?;
            &separate
        };
        let src = file.tensors();
        let n_layers = match hy.mtp_layers {
            0 => (0..)
                .take_while(|j| src.has(&format!("mtp.layers.{j}.input_layernorm.weight")))
                .count(),
            n => n,
        };
        anyhow::ensure!(
            n_layers > 0 && src.has("mtp.fc.weight"),
            "the model has no multi-token-prediction head: speculative decoding needs the \
             checkpoint's `mtp.*` tensors (in it or in {}), which some re-packaged \
             checkpoints drop{}",
            beside.display(),
            match hy.mtp_layers {
                0 => String::new(),
                n => format!(" (its config says {n} MTP layer(s))"),
            }
        );
        // vLLM runs layer `step % n` at draft step `step`, each with its own cache; the
        // released checkpoints have one layer, the only case built and checked here.
        anyhow::ensure!(
            n_layers == 1,
            "an MTP head of {n_layers} layers: only one-layer heads (the released Qwen3.5 \
             checkpoints') are supported"
        );
        let h = cfg.hidden;
        let need = |name: &str, shape: &[usize]| {
            crate::source::require_shaped(src, name, shape, file.config_source())
        };
        let norm = |name: &str| -> Result<B::Weight> {
            be.upload(&crate::qwen3_5::plus_one(&need(name, &[h])?)?)
        };
        let [fe, fh] = split_columns(&need("mtp.fc.weight", &[h, 2 * h])?, h)?;
        // The head's layers are full attention; their KV slots follow the model's own.
        let reader = Reader::new(file, cfg).with_prefix("mtp.");
        let n_attn = hy.counts().1;
        let layers = (0..n_layers)
            .map(|j| reader.layer(be, j, false, n_attn + j))
            .collect::<Result<Vec<_>>>()
            .context("loading the MTP head's layers")?;
        self.mtp = Some(Mtp {
            enorm: norm("mtp.pre_fc_norm_embedding.weight")?,
            hnorm: norm("mtp.pre_fc_norm_hidden.weight")?,
            fc_embed: be.upload(&fe)?,
            fc_hidden: be.upload(&fh)?,
            layers,
            norm: norm("mtp.norm.weight")?,
        });
        Ok(())
    }

    /// Whether [`Model::load_mtp`] has loaded an MTP head.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Runs the MTP head on the step in `ws.step`: row `i` pairs the token `ws.step`
    /// holds (`x_{t+1}`) with row `i` of `hidden` (`h_t`, a target or draft hidden state),
    /// at the step's position for that row (`t`); its keys and values go to the head's
    /// slots of `kv`. The draft hidden states land in `ws.h` ([`Workspace::hidden`]) and
    /// the logits in `ws.logits` as [`Model::forward`] puts them. `hidden` must not be
    /// `ws`'s own (copy a draft hidden state out first).
    pub fn mtp_forward(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        hidden: &Act<B::Buf>,
        kv: &mut B::Kv,
        which: Logits,
    ) -> Result<()> {
        let m = self
            .mtp
            .as_ref()
            .context("no MTP head loaded (Model::load_mtp)")?;
        let t = ws.step.rows;
        anyhow::ensure!(
            t > 0 && hidden.rows == t && hidden.cols == self.cfg.hidden,
            "the MTP head's step has {t} tokens but {} hidden rows of {} (want {})",
            hidden.rows,
            hidden.cols,
            self.cfg.hidden
        );
        ws.set_rows(t)?;
        let eps = self.cfg.rms_eps;
        // u = rms_norm(e)·enorm · Feᵀ + rms_norm(h)·hnorm · Fhᵀ, into the residual x.
        be.embed(&self.embed, &ws.step, &mut ws.x2)?;
        be.rms_norm(&ws.x2, &m.enorm, eps, &mut ws.y)?;
        be.matmul(&ws.y, &m.fc_embed, &mut ws.x)?;
        be.rms_norm(hidden, &m.hnorm, eps, &mut ws.y)?;
        be.matmul_add(&ws.y, &m.fc_hidden, &mut ws.x, &mut ws.x2)?;
        crate::qwen3_5::forward_layers(be, &self.cfg, &m.layers, &m.norm, ws, kv)?;
        self.output_logits(be, ws, which)
    }
}
