//! Where the weights come from: a GGUF file or a Hugging Face safetensors checkpoint, and
//! the tensor names each uses.

use std::borrow::Cow;
use std::path::Path;

use anyhow::{bail, Context, Result};
use ferrite_backend::HostTensor;
use ferrite_formats::gguf::GgufFile;
use ferrite_formats::safetensors_dir::SafetensorsCheckpoint;
use ferrite_formats::{FormatError, OwnedTensor, TensorSource, TensorView};

use crate::config::{self, ModelConfig};

/// An opened model file.
pub enum ModelFile {
    Gguf(GgufFile),
    Safetensors(SafetensorsCheckpoint),
}

/// The logical weights of a decoder layer, named once; [`ModelFile::name`] maps them to
/// each format's tensor names.
#[derive(Clone, Copy, Debug)]
pub enum Tensor {
    Embed,
    OutputNorm,
    Output,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    QNorm(usize),
    KNorm(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    Router(usize),
}

impl ModelFile {
    /// Opens a `.gguf` file, or a safetensors checkpoint (a directory, or a `.safetensors`
    /// file inside one).
    pub fn open(path: &Path) -> Result<ModelFile> {
        let is_gguf = path.is_file()
            && path
                .extension()
                .is_none_or(|e| e != "safetensors" && e != "json");
        if is_gguf {
            Ok(ModelFile::Gguf(GgufFile::open(path)?))
        } else if path.exists() {
            Ok(ModelFile::Safetensors(SafetensorsCheckpoint::open(path)?))
        } else {
            bail!("model path {} does not exist", path.display())
        }
    }

    pub fn tensors(&self) -> &dyn TensorSource {
        match self {
            ModelFile::Gguf(f) => f,
            ModelFile::Safetensors(c) => c,
        }
    }

    /// The model's hyperparameters.
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            ModelFile::Gguf(f) => {
                // The info, not a view: a tensor converted at load has no view.
                let vocab = match (
                    f.tensor_info("token_embd.weight"),
                    f.unloadable_tensor("token_embd.weight"),
                ) {
                    (Some(t), _) => t.shape[0],
                    (None, Some(t)) => t.shape[0],
                    (None, None) => anyhow::bail!("GGUF has no token_embd.weight"),
                };
                config::from_gguf(f, vocab)
            }
            ModelFile::Safetensors(c) => config::from_hf(c.config()),
        }
    }

    /// llama.cpp's GGUF name for a logical tensor.
    pub fn gguf_tensor_name(t: Tensor) -> String {
        use Tensor::*;
        match t {
            Embed => "token_embd.weight".into(),
            OutputNorm => "output_norm.weight".into(),
            Output => "output.weight".into(),
            AttnNorm(i) => format!("blk.{i}.attn_norm.weight"),
            Q(i) => format!("blk.{i}.attn_q.weight"),
            K(i) => format!("blk.{i}.attn_k.weight"),
            V(i) => format!("blk.{i}.attn_v.weight"),
            O(i) => format!("blk.{i}.attn_output.weight"),
            QNorm(i) => format!("blk.{i}.attn_q_norm.weight"),
            KNorm(i) => format!("blk.{i}.attn_k_norm.weight"),
            FfnNorm(i) => format!("blk.{i}.ffn_norm.weight"),
            Gate(i) => format!("blk.{i}.ffn_gate.weight"),
            Up(i) => format!("blk.{i}.ffn_up.weight"),
            Down(i) => format!("blk.{i}.ffn_down.weight"),
            Router(i) => format!("blk.{i}.ffn_gate_inp.weight"),
        }
    }

    /// This format's name for a logical tensor.
    pub fn name(&self, t: Tensor) -> String {
        use Tensor::*;
        match self {
            ModelFile::Gguf(_) => Self::gguf_tensor_name(t),
            ModelFile::Safetensors(_) => match t {
                Embed => "model.embed_tokens.weight".into(),
                OutputNorm => "model.norm.weight".into(),
                Output => "lm_head.weight".into(),
                AttnNorm(i) => format!("model.layers.{i}.input_layernorm.weight"),
                Q(i) => format!("model.layers.{i}.self_attn.q_proj.weight"),
                K(i) => format!("model.layers.{i}.self_attn.k_proj.weight"),
                V(i) => format!("model.layers.{i}.self_attn.v_proj.weight"),
                O(i) => format!("model.layers.{i}.self_attn.o_proj.weight"),
                QNorm(i) => format!("model.layers.{i}.self_attn.q_norm.weight"),
                KNorm(i) => format!("model.layers.{i}.self_attn.k_norm.weight"),
                FfnNorm(i) => format!("model.layers.{i}.post_attention_layernorm.weight"),
                Gate(i) => format!("model.layers.{i}.mlp.gate_proj.weight"),
                Up(i) => format!("model.layers.{i}.mlp.up_proj.weight"),
                Down(i) => format!("model.layers.{i}.mlp.down_proj.weight"),
                Router(i) => format!("model.layers.{i}.mlp.gate.weight"),
            },
        }
    }

    /// Whether the file stores this tensor (in any type: an optional weight stored as FP8
    /// is present, and loading it converts it or names what is missing).
    pub fn has(&self, t: Tensor) -> bool {
        self.tensors().has(&self.name(t))
    }

    /// The tensor, with a clear error naming it when absent or stored in a type ferrite
    /// does not load.
    pub fn need(&self, t: Tensor) -> Result<HostTensor<'_>> {
        require(self.tensors(), &self.name(t))
    }

    /// Multi-token-prediction layers stored after the model's own as whole blocks: a GGUF's
    /// `<arch>.nextn_predict_layers` (its `block_count` counts them; Hugging Face keeps
    /// them under `mtp.*` instead, not as layers).
    pub fn mtp_layers(&self) -> usize {
        match self {
            ModelFile::Gguf(f) => f
                .get_str("general.architecture")
                .and_then(|a| f.get(&format!("{a}.nextn_predict_layers")))
                .and_then(|v| v.as_usize())
                .unwrap_or(0),
            ModelFile::Safetensors(_) => 0,
        }
    }

    /// Where this file's hyperparameters come from, for errors that blame them.
    pub fn config_source(&self) -> &'static str {
        match self {
            ModelFile::Gguf(_) => "the GGUF metadata",
            ModelFile::Safetensors(_) => "config.json",
        }
    }

    /// The tensor, which must have the row-major shape `want`: a configuration whose
    /// dimensions disagree with its weights is refused at load, naming the tensor, instead
    /// of failing at the first matmul of a forward pass.
    pub fn need_shaped(&self, t: Tensor, want: &[usize]) -> Result<HostTensor<'_>> {
        require_shaped(self.tensors(), &self.name(t), want, self.config_source())
    }

    /// The stacked `[n_experts, n_out, n_in]` gate, up and down weights of MoE layer `i`.
    /// GGUF stores them stacked; Hugging Face checkpoints either per expert
    /// (`mlp.experts.{e}.gate_proj.weight`) or fused (`mlp.experts.gate_up_proj`, gate rows
    /// first, and `mlp.experts.down_proj`).
    pub fn experts(&self, i: usize, n_experts: usize) -> Result<[HostTensor<'_>; 3]> {
        let get = |name: String| require(self.tensors(), &name);
        match self {
            ModelFile::Gguf(_) => Ok([
                get(format!("blk.{i}.ffn_gate_exps.weight"))?,
                get(format!("blk.{i}.ffn_up_exps.weight"))?,
                get(format!("blk.{i}.ffn_down_exps.weight"))?,
            ]),
            ModelFile::Safetensors(_) => {
                self.hf_experts(&format!("model.layers.{i}.mlp.experts"), n_experts)
            }
        }
    }

    /// The stacked gate, up and down weights of the Hugging Face experts under `p`
    /// (`…mlp.experts`), stored per expert or fused.
    pub fn hf_experts(&self, p: &str, n_experts: usize) -> Result<[HostTensor<'_>; 3]> {
        let src = self.tensors();
        let fused = format!("{p}.gate_up_proj");
        if src.has(&fused) {
            let down = require(src, &format!("{p}.down_proj"))?;
            let [gate, up] = split_gate_up(require(src, &fused)?)?;
            return Ok([gate, up, down]);
        }
        // Not fused: stored per expert.
        let stack = |w: &str| -> Result<HostTensor<'_>> {
            let parts: Vec<HostTensor<'_>> = (0..n_experts)
                .map(|e| require(src, &format!("{p}.{e}.{w}.weight")))
                .collect::<Result<_>>()?;
            stack_experts(&parts)
        };
        Ok([stack("gate_proj")?, stack("up_proj")?, stack("down_proj")?])
    }
}

/// Refuses tensor `what` ("tensor 'name'") unless its row-major shape is `want` (the shape
/// the model's hyperparameters, read from `config_source`, give it).
pub(crate) fn check_shape(
    what: &str,
    t: &HostTensor<'_>,
    want: &[usize],
    config_source: &str,
) -> Result<()> {
    anyhow::ensure!(
        t.shape == want,
        "{what} has shape {:?}, but {config_source}'s dimensions need {want:?}: \
         the configuration does not belong to these weights",
        t.shape
    );
    Ok(())
}

/// Tensor `name` of `src`, or an error that says why there is none: absent, or stored in a
/// type ferrite does not load (an integer tensor, or an FP8 weight without its block scales,
/// of a safetensors checkpoint). An FP8 weight with its `_scale_inv` scales comes converted
/// to BF16 ([`ferrite_formats::quant::fp8`]).
pub(crate) fn require<'a>(src: &'a dyn TensorSource, name: &str) -> Result<HostTensor<'a>> {
    match src.require_tensor(name) {
        Ok(v) => Ok(host(v)),
        Err(e @ FormatError::UnsupportedDtype { .. }) => match src.converted(name) {
            Some(t) => t.map(owned).map_err(|e| load_error(name, e)),
            None => Err(load_error(name, e)),
        },
        Err(e) => Err(load_error(name, e)),
    }
}

/// [`require`], refused unless the tensor's row-major shape is `want` ([`check_shape`]).
pub(crate) fn require_shaped<'a>(
    src: &'a dyn TensorSource,
    name: &str,
    want: &[usize],
    config_source: &str,
) -> Result<HostTensor<'a>> {
    let t = require(src, name)?;
    check_shape(&format!("tensor '{name}'"), &t, want, config_source)?;
    Ok(t)
}

/// The loader's words for `require_tensor`'s errors.
fn load_error(name: &str, e: FormatError) -> anyhow::Error {
    match e {
        FormatError::MissingTensor(_) => anyhow::anyhow!("model file has no tensor '{name}'"),
        FormatError::UnsupportedDtype { dtype, .. } => anyhow::anyhow!(
            "tensor '{name}' is stored as {dtype}, which ferrite cannot load from safetensors \
             (it loads F32, F16 and BF16 there, and F8_E4M3 weights with their \
             '_scale_inv' block scales; quantized weights come as GGUF)"
        ),
        e => e.into(),
    }
}

pub(crate) fn host(v: TensorView<'_>) -> HostTensor<'_> {
    HostTensor {
        dtype: v.dtype,
        shape: v.shape.to_vec(),
        data: Cow::Borrowed(v.data),
    }
}

fn owned<'a>(t: OwnedTensor) -> HostTensor<'a> {
    HostTensor {
        dtype: t.dtype,
        shape: t.shape,
        data: Cow::Owned(t.data),
    }
}

/// Concatenates per-expert `[n_out, n_in]` matrices into one `[n_experts, n_out, n_in]`.
fn stack_experts<'a>(parts: &[HostTensor<'_>]) -> Result<HostTensor<'a>> {
    let first = parts.first().context("no experts")?;
    let mut data = Vec::with_capacity(first.data.len() * parts.len());
    for p in parts {
        anyhow::ensure!(
            p.shape == first.shape && p.dtype == first.dtype,
            "experts differ in shape or type"
        );
        data.extend_from_slice(&p.data);
    }
    let mut shape = vec![parts.len()];
    shape.extend_from_slice(&first.shape);
    Ok(HostTensor {
        dtype: first.dtype,
        shape,
        data: Cow::Owned(data),
    })
}

/// Splits a fused `[n_experts, 2*ffn, n_in]` gate/up tensor (gate rows first) in two.
fn split_gate_up<'a>(gu: HostTensor<'_>) -> Result<[HostTensor<'a>; 2]> {
    let [e, two_f, n_in] = gu.shape[..] else {
        bail!(
            "fused gate_up_proj has shape {:?}, expected 3 dims",
            gu.shape
        )
    };
    anyhow::ensure!(
        two_f % 2 == 0,
        "fused gate_up_proj has an odd row count {two_f}"
    );
    let f = two_f / 2;
    let row = gu.dtype.bytes_for(n_in)?;
    let (mut gate, mut up) = (
        Vec::with_capacity(e * f * row),
        Vec::with_capacity(e * f * row),
    );
    for x in 0..e {
        let base = x * two_f * row;
        gate.extend_from_slice(&gu.data[base..base + f * row]);
        up.extend_from_slice(&gu.data[base + f * row..base + two_f * row]);
    }
    let t = |data| HostTensor {
        dtype: gu.dtype,
        shape: vec![e, f, n_in],
        data: Cow::Owned(data),
    };
    Ok([t(gate), t(up)])
}
