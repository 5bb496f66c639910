//! Model hyperparameters, read from GGUF metadata or a Hugging Face `config.json`.

use anyhow::{bail, Context, Result};
use ferrite_backend::{AttnShape, DeltaShape, MoeRouting, Rope, RopeStyle};
use ferrite_formats::gguf::GgufFile;
use std::sync::Arc;

/// The architectures ferrite runs. Adding one = a file in this crate + a line in
/// [`Arch::from_gguf_name`] / [`Arch::from_hf_name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen3,
    Qwen3Moe,
    /// Qwen3.5 / Qwen3.6 hybrid (Gated DeltaNet + gated full attention), dense FFN.
    Qwen35,
    /// Qwen3.5 / Qwen3.6 hybrid with a mixture of experts plus a gated shared expert.
    Qwen35Moe,
}

impl Arch {
    pub fn from_gguf_name(name: &str) -> Result<Arch> {
        Ok(match name {
            "llama" => Arch::Llama,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "qwen35" => Arch::Qwen35,
            "qwen35moe" => Arch::Qwen35Moe,
            other => {
                bail!("unsupported GGUF architecture '{other}' (supported: llama, qwen3, qwen3moe, qwen35, qwen35moe)")
            }
        })
    }
    pub fn from_hf_name(name: &str) -> Result<Arch> {
        Ok(match name {
            "LlamaForCausalLM" | "llama" => Arch::Llama,
            "Qwen3ForCausalLM" | "qwen3" => Arch::Qwen3,
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Arch::Qwen3Moe,
            // The released checkpoints are vision-language wrappers; their text model loads.
            "Qwen3_5ForCausalLM"
            | "Qwen3_5ForConditionalGeneration"
            | "qwen3_5_text"
            | "qwen3_5" => Arch::Qwen35,
            "Qwen3_5MoeForCausalLM"
            | "Qwen3_5MoeForConditionalGeneration"
            | "qwen3_5_moe_text"
            | "qwen3_5_moe" => Arch::Qwen35Moe,
            other => bail!(
                "unsupported architecture '{other}' (supported: LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM)"
            ),
        })
    }
    /// The name GGUF files use.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen35 => "qwen35",
            Arch::Qwen35Moe => "qwen35moe",
        }
    }
    /// Qwen3.5's hybrid layer stack ([`crate::qwen3_5`]).
    pub fn is_hybrid(self) -> bool {
        matches!(self, Arch::Qwen35 | Arch::Qwen35Moe)
    }
}

/// The layer stack of a hybrid (Qwen3.5) model.
#[derive(Clone, Debug)]
pub struct HybridConfig {
    /// Per layer: `true` for a Gated DeltaNet (linear attention) layer, `false` for full
    /// attention (`layer_types`).
    pub linear: Vec<bool>,
    pub delta: DeltaShape,
    /// Multi-token-prediction layers the checkpoint says it has (Hugging Face
    /// `mtp_num_hidden_layers`, GGUF `nextn_predict_layers`): the draft head of
    /// [`crate::mtp`], loaded only on request ([`crate::Model::load_mtp`]).
    pub mtp_layers: usize,
}

impl HybridConfig {
    /// Number of linear-attention and of full-attention layers.
    pub fn counts(&self) -> (usize, usize) {
        let n_lin = self.linear.iter().filter(|&&l| l).count();
        (n_lin, self.linear.len() - n_lin)
    }
}

/// Mixture-of-experts hyperparameters.
#[derive(Clone, Debug)]
pub struct MoeConfig {
    pub routing: MoeRouting,
    /// Hidden size of one expert's SwiGLU FFN.
    pub expert_ffn: usize,
    /// Layers that use a dense FFN instead of experts (Qwen3-MoE `mlp_only_layers` and
    /// `decoder_sparse_step`).
    pub dense_layers: Vec<usize>,
    /// Hidden size of the always-on shared expert (Qwen3.5-MoE), gated by
    /// `sigmoid(shared_expert_gate · x)`; 0 when there is none.
    pub shared_expert_ffn: usize,
}

/// Everything the forward pass needs to know about the model's shape.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub n_layers: usize,
    pub attn: AttnShape,
    /// Dense FFN hidden size (0 when every layer is MoE).
    pub ffn: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope: Rope,
    /// Longest context the model was trained for.
    pub max_ctx: usize,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub moe: Option<MoeConfig>,
    /// Qwen3.5's linear/full attention layer pattern and linear-attention shape.
    pub hybrid: Option<HybridConfig>,
}

impl ModelConfig {
    /// Is layer `i` a mixture-of-experts layer?
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| !m.dense_layers.contains(&i))
    }
}

/// The frequencies of llama.cpp's `rope_freqs.weight`: how its converter writes Llama 3.1's
/// "llama3" scaling, one divisor per rotated pair (and no `rope.scaling.type` key). `None`
/// where the file has none, or divisors that are all 1.
fn gguf_rope_freqs(f: &GgufFile, theta: f32, rot_dim: usize) -> Result<Option<Arc<[f32]>>> {
    use ferrite_formats::TensorSource;
    const NAME: &str = "rope_freqs.weight";
    if !f.has(NAME) {
        return Ok(None);
    }
    let div = f
        .require_tensor(NAME)
        .and_then(|t| t.to_f32())
        .with_context(|| format!("reading {NAME}"))?;
    anyhow::ensure!(
        div.len() == rot_dim / 2,
        "{NAME} has {} divisors, but the heads rotate {} pairs",
        div.len(),
        rot_dim / 2
    );
    anyhow::ensure!(
        div.iter().all(|d| d.is_finite() && *d > 0.0),
        "{NAME}: divisors must be positive and finite"
    );
    if div.iter().all(|&d| d == 1.0) {
        return Ok(None);
    }
    Ok(Some(
        Rope::unscaled_inv_freq(theta, rot_dim)
            .zip(&div)
            .map(|(f, d)| f / d)
            .collect(),
    ))
}

/// The RoPE scaling a config.json names: transformers 5 keeps it in `rope_parameters`, 4.x in
/// `rope_scaling` (`rope_type`, or `type`); "default" where neither names one.
fn hf_rope_type(c: &serde_json::Value) -> &str {
    c.get("rope_parameters")
        .filter(|v| v.is_object())
        .and_then(|p| p.get("rope_type"))
        .or_else(|| {
            c.get("rope_scaling")
                .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
        })
        .and_then(|v| v.as_str())
        .unwrap_or("default")
}

/// Llama 3.1's "llama3" RoPE scaling: wavelengths shorter than `original / high` keep their
/// frequency, those longer than `original / low` are slowed by `factor`, and those between
/// blend the two by where `original / wavelength` falls between `low` and `high`.
struct Llama3Scaling {
    factor: f64,
    low: f64,
    high: f64,
    original: f64,
}

impl Llama3Scaling {
    /// The scaling of a config.json (its text model's part) that names "llama3", `None` for
    /// any other.
    fn of_hf(c: &serde_json::Value) -> Result<Option<Self>> {
        if hf_rope_type(c) != "llama3" {
            return Ok(None);
        }
        let p = c
            .get("rope_parameters")
            .filter(|v| v.is_object())
            .or_else(|| c.get("rope_scaling"))
            .unwrap_or(&serde_json::Value::Null);
        let get = |k: &str| {
            p.get(k)
                .and_then(|v| v.as_f64())
                .with_context(|| format!("llama3 RoPE scaling without '{k}'"))
        };
        let s = Llama3Scaling {
            factor: get("factor")?,
            low: get("low_freq_factor")?,
            high: get("high_freq_factor")?,
            original: get("original_max_position_embeddings")?,
        };
        anyhow::ensure!(
            s.factor > 0.0 && s.low > 0.0 && s.high > s.low,
            "llama3 RoPE scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0"
        );
        Ok(Some(s))
    }

    /// The wavelengths below which frequencies are kept and above which they are divided,
    /// rounded to f32 where (as Python floats) they meet the f32 frequencies.
    fn bounds(&self) -> (f32, f32) {
        (
            (self.original / self.high) as f32,
            (self.original / self.low) as f32,
        )
    }

    /// The frequencies as transformers computes them (`_compute_llama3_parameters`, in f32
    /// as torch evaluates it).
    fn inv_freq(&self, theta: f32, rot_dim: usize) -> Arc<[f32]> {
        let (high_wavelen, low_wavelen) = self.bounds();
        let (factor, low, high_minus_low, old_ctx) = (
            self.factor as f32,
            self.low as f32,
            (self.high - self.low) as f32,
            self.original as f32,
        );
        Rope::unscaled_inv_freq(theta, rot_dim)
            .map(|f| {
                let wavelen = std::f32::consts::TAU / f;
                let v = if wavelen > low_wavelen { f / factor } else { f };
                let smooth = (old_ctx / wavelen - low) / high_minus_low;
                let smoothed = (1.0 - smooth) * v / factor + smooth * v;
                // transformers' `~(wavelen < high) * ~(wavelen > low)`; wavelengths are finite.
                let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                if medium {
                    smoothed
                } else {
                    v
                }
            })
            .collect()
    }

    /// The `rope_freqs.weight` divisors llama.cpp's converter writes for it
    /// (`LlamaModel.generate_extra_tensors` in `convert_hf_to_gguf.py`, in f32 as its torch
    /// scalars compute): 1, `factor`, or `1 / ((1 - s) / factor + s)` between.
    fn divisors(&self, theta: f32, rot_dim: usize) -> Vec<f32> {
        let (high_wavelen, low_wavelen) = self.bounds();
        let factor = self.factor as f32;
        Rope::unscaled_inv_freq(theta, rot_dim)
            .map(|f| {
                let wavelen = std::f32::consts::TAU / f;
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor
                } else {
                    let s = (self.original as f32 / wavelen - self.low as f32)
                        / (self.high - self.low) as f32;
                    1.0 / ((1.0 - s) / factor + s)
                }
            })
            .collect()
    }
}

/// The `rope_freqs.weight` divisors llama.cpp's converter writes for a Hugging Face
/// checkpoint's "llama3" scaling ([`Llama3Scaling::divisors`]); `None` where it has none.
pub fn hf_llama3_divisors(config: &serde_json::Value, rope: &Rope) -> Result<Option<Vec<f32>>> {
    let c = config.get("text_config").unwrap_or(config);
    Ok(Llama3Scaling::of_hf(c)?.map(|s| s.divisors(rope.theta, rope.rot_dim)))
}

/// Reads a GGUF file's `<arch>.*` hyperparameters (llama.cpp's key names).
pub fn from_gguf(f: &GgufFile, vocab: usize) -> Result<ModelConfig> {
    let arch_name = f
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .context("GGUF has no general.architecture")?;
    let arch = Arch::from_gguf_name(arch_name)?;
    if arch.is_hybrid() {
        return from_gguf_qwen35(f, arch, vocab);
    }
    let key = |k: &str| format!("{arch_name}.{k}");
    let get_usize = |k: &str| f.get(&key(k)).and_then(|v| v.as_usize());
    let need = |k: &str| get_usize(k).with_context(|| format!("GGUF is missing {}", key(k)));
    let get_f32 = |k: &str| f.get(&key(k)).and_then(|v| v.as_f32());

    let hidden = need("embedding_length")?;
    let n_heads = need("attention.head_count")?;
    let n_kv_heads = get_usize("attention.head_count_kv").unwrap_or(n_heads);
    let head_dim = get_usize("attention.key_length").unwrap_or(hidden / n_heads.max(1));
    if let Some(vl) = get_usize("attention.value_length") {
        anyhow::ensure!(
            vl == head_dim,
            "value_length {vl} != key_length {head_dim} is not supported"
        );
    }
    if let Some(t) = f.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        anyhow::ensure!(t == "none", "RoPE scaling '{t}' is not supported yet");
    }
    // Biases (a converted model with attention or MLP biases): the decoder has none.
    if let Some(t) = f.tensor_infos().iter().find(|t| t.name.ends_with(".bias")) {
        bail!(
            "tensor '{}': biases are not supported for {arch_name} (the decoder computes \
             none, so it would leave them out)",
            t.name
        );
    }
    // llama.cpp writes Mixtral-style MoE models as `llama` with experts: not this decoder's
    // dense Llama (whose FFN tensors such a file does not have).
    if arch == Arch::Llama {
        if let Some(n) = get_usize("expert_count").filter(|&n| n > 0) {
            bail!(
                "this `llama` GGUF has {n} experts a layer ({arch_name}.expert_count; a \
                 Mixtral-style MoE), which ferrite does not run: its llama is dense (its MoE \
                 architectures are qwen3moe and qwen35moe)"
            );
        }
    }
    let moe = match arch {
        Arch::Qwen3Moe => Some(MoeConfig {
            routing: MoeRouting {
                n_experts: need("expert_count")?,
                top_k: need("expert_used_count")?,
                // llama.cpp always renormalises qwen3moe's top-k weights; newer files say so.
                norm_topk: f
                    .get(&key("expert_weights_norm"))
                    .and_then(|v| v.as_bool())
                    .unwrap_or(true),
            },
            expert_ffn: need("expert_feed_forward_length")?,
            dense_layers: vec![],
            shared_expert_ffn: 0,
        }),
        _ => None,
    };
    let theta = get_f32("rope.freq_base").unwrap_or(10000.0);
    let rot_dim = get_usize("rope.dimension_count").unwrap_or(head_dim);
    let cfg = ModelConfig {
        arch,
        hidden,
        n_layers: need("block_count")?,
        attn: AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
        },
        ffn: get_usize("feed_forward_length").unwrap_or(0),
        vocab,
        rms_eps: get_f32("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        rope: Rope {
            // llama.cpp's converter permutes llama Q/K rows for the adjacent-pair rotation;
            // qwen3 files keep the Hugging Face order and use NeoX rotation.
            style: if arch == Arch::Llama {
                RopeStyle::Adjacent
            } else {
                RopeStyle::Neox
            },
            theta,
            rot_dim,
            inv_freq: gguf_rope_freqs(f, theta, rot_dim)?,
        },
        max_ctx: get_usize("context_length").unwrap_or(4096),
        qk_norm: arch != Arch::Llama,
        moe,
        hybrid: None,
    };
    validate(&cfg)?;
    Ok(cfg)
}

/// llama.cpp's `qwen35` / `qwen35moe` metadata, as its converter (`Qwen3NextModel` and
/// `_LinearAttentionVReorderBase` in `convert_hf_to_gguf.py`) writes it: the Gated DeltaNet
/// shape in the `ssm.*` keys (`conv_kernel` = kernel, `state_size` = key head dim,
/// `group_count` = key heads, `time_step_rank` = value heads, `inner_size` = value heads ×
/// value head dim), every `full_attention_interval`-th layer full attention, value heads in
/// tiled order, `block_count` counting the `nextn_predict_layers` MTP layers at the end.
fn from_gguf_qwen35(f: &GgufFile, arch: Arch, vocab: usize) -> Result<ModelConfig> {
    let arch_name = arch.gguf_name();
    let key = |k: &str| format!("{arch_name}.{k}");
    let get_usize = |k: &str| f.get(&key(k)).and_then(|v| v.as_usize());
    let need = |k: &str| get_usize(k).with_context(|| format!("GGUF is missing {}", key(k)));
    let get_f32 = |k: &str| f.get(&key(k)).and_then(|v| v.as_f32());

    let hidden = need("embedding_length")?;
    let (blocks, mtp) = (
        need("block_count")?,
        get_usize("nextn_predict_layers").unwrap_or(0),
    );
    let n_layers = blocks.checked_sub(mtp).with_context(|| {
        format!("GGUF has {mtp} MTP layers (nextn_predict_layers) in {blocks} blocks")
    })?;
    let n_heads = need("attention.head_count")?;
    let head_dim = need("attention.key_length")?;
    let every = get_usize("full_attention_interval").unwrap_or(4).max(1);
    let n_v_heads = need("ssm.time_step_rank")?;
    let delta = DeltaShape {
        n_k_heads: need("ssm.group_count")?,
        n_v_heads,
        k_head_dim: need("ssm.state_size")?,
        v_head_dim: need("ssm.inner_size")? / n_v_heads.max(1),
        conv_kernel: need("ssm.conv_kernel")?,
        tiled_v_heads: true,
    };
    anyhow::ensure!(
        delta.n_k_heads > 0 && delta.n_v_heads.is_multiple_of(delta.n_k_heads),
        "{} linear value heads is not a multiple of {} key heads",
        delta.n_v_heads,
        delta.n_k_heads
    );
    let (moe, ffn) = if arch == Arch::Qwen35Moe {
        let shared = get_usize("expert_shared_feed_forward_length").unwrap_or(0);
        let moe = MoeConfig {
            routing: MoeRouting {
                n_experts: need("expert_count")?,
                top_k: need("expert_used_count")?,
                norm_topk: true,
            },
            expert_ffn: need("expert_feed_forward_length")?,
            dense_layers: vec![],
            shared_expert_ffn: shared,
        };
        (Some(moe), shared)
    } else {
        (None, need("feed_forward_length")?)
    };
    let cfg = ModelConfig {
        arch,
        hidden,
        n_layers,
        attn: AttnShape {
            n_heads,
            n_kv_heads: get_usize("attention.head_count_kv").unwrap_or(n_heads),
            head_dim,
        },
        ffn,
        vocab,
        rms_eps: get_f32("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        rope: Rope {
            style: RopeStyle::Neox,
            theta: get_f32("rope.freq_base").unwrap_or(10_000_000.0),
            rot_dim: get_usize("rope.dimension_count").unwrap_or(head_dim / 4),
            inv_freq: None,
        },
        max_ctx: get_usize("context_length").unwrap_or(32768),
        qk_norm: true,
        moe,
        hybrid: Some(HybridConfig {
            linear: (0..n_layers).map(|i| (i + 1) % every != 0).collect(),
            delta,
            mtp_layers: mtp,
        }),
    };
    validate(&cfg)?;
    Ok(cfg)
}

/// A checkpoint's `quantization_config`, if any, must be one ferrite loads (converting the
/// weights to BF16 at load): "fp8" (E4M3 weights with `_scale_inv` block scales), "modelopt"
/// with `quant_algo` "FP8" or "NVFP4", or "compressed-tensors" in its "float-quantized"
/// format (E4M3 with a scale per tensor or row). Other methods store their weights under
/// other names and types (AWQ's `qweight`, packed integers), which would otherwise surface as
/// a missing tensor at the first layer.
fn check_quantization(config: &serde_json::Value) -> Result<()> {
    let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(());
    };
    // ModelOpt writes its fields at the top or (hf_quant_config.json's layout) under
    // "quantization".
    let field = |k: &str| {
        q.get(k)
            .or_else(|| q.get("quantization").and_then(|n| n.get(k)))
            .and_then(|m| m.as_str())
    };
    let method = field("quant_method").unwrap_or("(no quant_method)");
    let supported = match method {
        "fp8" => true,
        "modelopt" => matches!(field("quant_algo"), Some("FP8" | "NVFP4")),
        "compressed-tensors" => field("format") == Some("float-quantized"),
        _ => false,
    };
    anyhow::ensure!(
        supported,
        "config.json: the checkpoint is quantized with '{method}'{}, which ferrite does not \
         load (from safetensors it loads unquantized checkpoints and FP8 or NVFP4 ones: \
         quant_method \"fp8\", \"modelopt\" FP8 / NVFP4, compressed-tensors \
         \"float-quantized\"; other quantizations load as GGUF)",
        match (field("quant_algo"), field("format")) {
            (Some(a), _) => format!(" ({a})"),
            (None, Some(f)) => format!(" (format '{f}')"),
            _ => String::new(),
        }
    );
    if let Some(f) = field("fmt") {
        anyhow::ensure!(
            f == "e4m3",
            "config.json: FP8 checkpoint in format '{f}'; ferrite loads E4M3 (fmt \"e4m3\")"
        );
    }
    Ok(())
}

/// Reads a Hugging Face `config.json` (text models; VLM wrappers' `text_config` too).
pub fn from_hf(config: &serde_json::Value) -> Result<ModelConfig> {
    check_quantization(config)?;
    let arch_name = config["architectures"]
        .get(0)
        .and_then(|v| v.as_str())
        .or_else(|| config["model_type"].as_str())
        .context("config.json names no architecture (neither 'architectures' nor 'model_type')")?;
    let arch = Arch::from_hf_name(arch_name)?;
    let c = config.get("text_config").unwrap_or(config);
    if arch.is_hybrid() {
        return from_hf_qwen35(arch, c);
    }
    let get_usize = |k: &str| c.get(k).and_then(|v| v.as_u64()).map(|v| v as usize);
    let need = |k: &str| get_usize(k).with_context(|| format!("config.json is missing '{k}'"));
    let get_f32 = |k: &str| c.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);

    let hidden = need("hidden_size")?;
    let n_heads = need("num_attention_heads")?;
    let head_dim = get_usize("head_dim").unwrap_or(hidden / n_heads.max(1));
    if c.get("attention_bias").and_then(|v| v.as_bool()) == Some(true) {
        bail!("attention_bias = true is not supported for {arch_name}");
    }
    // What the decoder does not compute, refused rather than left out of the sums.
    if c.get("mlp_bias").and_then(|v| v.as_bool()) == Some(true) {
        bail!("mlp_bias = true is not supported for {arch_name}");
    }
    if let Some(act) = c.get("hidden_act").and_then(|v| v.as_str()) {
        anyhow::ensure!(
            matches!(act, "silu" | "swish"),
            "hidden_act '{act}' is not supported for {arch_name} (its MLP is SwiGLU: silu)"
        );
    }
    if c.get("use_sliding_window").and_then(|v| v.as_bool()) == Some(true) {
        bail!("use_sliding_window = true (sliding-window attention) is not supported yet");
    }
    // transformers 5 keeps rope settings in `rope_parameters`; 4.x in `rope_theta`/`rope_scaling`.
    let rope_params = c.get("rope_parameters").filter(|v| v.is_object());
    let rope_type = hf_rope_type(c);
    anyhow::ensure!(
        matches!(rope_type, "default" | "llama3"),
        "RoPE scaling '{rope_type}' is not supported yet"
    );
    let theta = rope_params
        .and_then(|p| p.get("rope_theta"))
        .and_then(|v| v.as_f64())
        .map(|v| v as f32)
        .or_else(|| get_f32("rope_theta"))
        .unwrap_or(10000.0);
    let moe = match arch {
        Arch::Qwen3Moe => {
            let n_layers = need("num_hidden_layers")?;
            let step = get_usize("decoder_sparse_step").unwrap_or(1).max(1);
            let mut dense: Vec<usize> = c
                .get("mlp_only_layers")
                .and_then(|v| v.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64())
                        .map(|x| x as usize)
                        .collect()
                })
                .unwrap_or_default();
            // transformers: a layer is sparse iff not in mlp_only_layers and (i+1) % step == 0.
            dense.extend((0..n_layers).filter(|i| (i + 1) % step != 0));
            dense.sort_unstable();
            dense.dedup();
            Some(MoeConfig {
                routing: MoeRouting {
                    // transformers 5 saves `num_local_experts`; Hub configs say `num_experts`.
                    n_experts: get_usize("num_experts")
                        .or_else(|| get_usize("num_local_experts"))
                        .context("config.json is missing 'num_experts'")?,
                    top_k: need("num_experts_per_tok")?,
                    norm_topk: c
                        .get("norm_topk_prob")
                        .and_then(|v| v.as_bool())
                        .unwrap_or(false),
                },
                expert_ffn: need("moe_intermediate_size")?,
                dense_layers: dense,
                shared_expert_ffn: 0,
            })
        }
        _ => None,
    };
    let cfg = ModelConfig {
        arch,
        hidden,
        n_layers: need("num_hidden_layers")?,
        attn: AttnShape {
            n_heads,
            n_kv_heads: get_usize("num_key_value_heads").unwrap_or(n_heads),
            head_dim,
        },
        ffn: get_usize("intermediate_size").unwrap_or(0),
        vocab: need("vocab_size")?,
        rms_eps: get_f32("rms_norm_eps").unwrap_or(1e-6),
        rope: Rope {
            style: RopeStyle::Neox,
            theta,
            rot_dim: head_dim,
            inv_freq: Llama3Scaling::of_hf(c)?.map(|s| s.inv_freq(theta, head_dim)),
        },
        max_ctx: get_usize("max_position_embeddings").unwrap_or(4096),
        qk_norm: arch != Arch::Llama,
        moe,
        hybrid: None,
    };
    validate(&cfg)?;
    Ok(cfg)
}

/// Qwen3.5's `qwen3_5_text` / `qwen3_5_moe_text` config (the `text_config` of the
/// vision-language wrappers), as transformers 5.17 reads it.
fn from_hf_qwen35(arch: Arch, c: &serde_json::Value) -> Result<ModelConfig> {
    let get_usize = |k: &str| c.get(k).and_then(|v| v.as_u64()).map(|v| v as usize);
    let need = |k: &str| get_usize(k).with_context(|| format!("config.json is missing '{k}'"));
    let get_f32 = |k: &str| c.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
    if c.get("attention_bias").and_then(|v| v.as_bool()) == Some(true) {
        bail!("attention_bias = true is not supported for Qwen3.5");
    }
    let hidden = need("hidden_size")?;
    let n_layers = need("num_hidden_layers")?;
    let n_heads = need("num_attention_heads")?;
    let head_dim = get_usize("head_dim").unwrap_or(256);

    // RoPE: `rope_parameters` (transformers 5) or top-level keys. The multimodal rotary
    // embedding (`mrope_section`) gives every section the same position for text-only input,
    // so it reduces to plain NeoX rotation of the first `partial_rotary_factor · head_dim`
    // dimensions.
    let rp = c.get("rope_parameters").filter(|v| v.is_object());
    let rp_f = |k: &str| {
        rp.and_then(|p| p.get(k))
            .or_else(|| c.get(k))
            .and_then(|v| v.as_f64())
    };
    let rope_type = rp
        .and_then(|p| p.get("rope_type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    anyhow::ensure!(
        rope_type == "default",
        "RoPE scaling '{rope_type}' is not supported yet"
    );
    let theta = rp_f("rope_theta").unwrap_or(10_000_000.0) as f32;
    let partial = rp_f("partial_rotary_factor").unwrap_or(0.25);
    let rot_dim = (head_dim as f64 * partial) as usize;

    // layer_types, or every `full_attention_interval`-th layer full (transformers' default).
    let linear: Vec<bool> = match c.get("layer_types").and_then(|v| v.as_array()) {
        Some(a) => a
            .iter()
            .map(|t| match t.as_str() {
                Some("linear_attention") | Some("mamba") => Ok(true),
                Some("full_attention") | Some("attention") => Ok(false),
                other => bail!("unknown layer type {other:?}"),
            })
            .collect::<Result<_>>()?,
        None => {
            let every = get_usize("full_attention_interval").unwrap_or(4).max(1);
            (0..n_layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    anyhow::ensure!(
        linear.len() == n_layers,
        "layer_types has {} entries for {n_layers} layers",
        linear.len()
    );
    let delta = DeltaShape {
        n_k_heads: need("linear_num_key_heads")?,
        n_v_heads: need("linear_num_value_heads")?,
        k_head_dim: need("linear_key_head_dim")?,
        v_head_dim: need("linear_value_head_dim")?,
        conv_kernel: get_usize("linear_conv_kernel_dim").unwrap_or(4),
        tiled_v_heads: false,
    };
    anyhow::ensure!(
        delta.n_k_heads > 0 && delta.n_v_heads.is_multiple_of(delta.n_k_heads),
        "{} linear value heads is not a multiple of {} key heads",
        delta.n_v_heads,
        delta.n_k_heads
    );
    let (moe, ffn) = if arch == Arch::Qwen35Moe {
        let shared = get_usize("shared_expert_intermediate_size").unwrap_or(0);
        let moe = MoeConfig {
            routing: MoeRouting {
                n_experts: get_usize("num_experts")
                    .or_else(|| get_usize("num_local_experts"))
                    .context("config.json is missing 'num_experts'")?,
                top_k: need("num_experts_per_tok")?,
                // Qwen3_5MoeTopKRouter always renormalises the top-k probabilities.
                norm_topk: true,
            },
            expert_ffn: need("moe_intermediate_size")?,
            dense_layers: vec![],
            shared_expert_ffn: shared,
        };
        // The dense FFN buffers serve the shared expert.
        (Some(moe), shared)
    } else {
        (None, need("intermediate_size")?)
    };
    let cfg = ModelConfig {
        arch,
        hidden,
        n_layers,
        attn: AttnShape {
            n_heads,
            n_kv_heads: get_usize("num_key_value_heads").unwrap_or(n_heads),
            head_dim,
        },
        ffn,
        vocab: need("vocab_size")?,
        rms_eps: get_f32("rms_norm_eps").unwrap_or(1e-6),
        rope: Rope {
            style: RopeStyle::Neox,
            theta,
            rot_dim,
            inv_freq: None,
        },
        max_ctx: get_usize("max_position_embeddings").unwrap_or(32768),
        qk_norm: true,
        moe,
        hybrid: Some(HybridConfig {
            linear,
            delta,
            mtp_layers: get_usize("mtp_num_hidden_layers").unwrap_or(0),
        }),
    };
    validate(&cfg)?;
    Ok(cfg)
}

fn validate(c: &ModelConfig) -> Result<()> {
    let a = &c.attn;
    for (what, n) in [
        ("hidden size", c.hidden),
        ("layer count", c.n_layers),
        ("vocabulary size", c.vocab),
        ("context length", c.max_ctx),
        ("attention head count", a.n_heads),
        ("key/value head count", a.n_kv_heads),
        ("attention head size", a.head_dim),
    ] {
        anyhow::ensure!(n > 0, "the model's configuration gives a {what} of 0");
    }
    // A non-positive base makes every rotation angle NaN or infinite, a negative epsilon the
    // RMSNorm's square root NaN for small rows: the model would run and print garbage.
    anyhow::ensure!(
        c.rope.theta.is_finite() && c.rope.theta > 0.0,
        "the model's configuration gives a RoPE base (rope_theta / rope.freq_base) of {}: it \
         must be a positive number",
        c.rope.theta
    );
    anyhow::ensure!(
        c.rms_eps.is_finite() && c.rms_eps >= 0.0,
        "the model's configuration gives an RMSNorm epsilon of {}: it must be a finite number \
         ≥ 0",
        c.rms_eps
    );
    anyhow::ensure!(
        a.n_heads.is_multiple_of(a.n_kv_heads),
        "{} heads is not a multiple of {} kv heads",
        a.n_heads,
        a.n_kv_heads
    );
    anyhow::ensure!(
        c.rope.rot_dim <= a.head_dim && c.rope.rot_dim.is_multiple_of(2),
        "bad rotary dim {}",
        c.rope.rot_dim
    );
    if let Some(m) = &c.moe {
        anyhow::ensure!(
            m.routing.top_k >= 1 && m.routing.top_k <= m.routing.n_experts,
            "top-k {} of {} experts",
            m.routing.top_k,
            m.routing.n_experts
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny Llama's config.json with `extra` merged in.
    fn llama(extra: serde_json::Value) -> serde_json::Value {
        let mut c = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    /// What the decoder does not compute is refused by name, not left out of the sums.
    #[test]
    fn hf_configs_the_decoder_does_not_compute_are_refused() {
        assert!(from_hf(&llama(serde_json::json!({}))).is_ok());
        for (extra, says) in [
            (serde_json::json!({"mlp_bias": true}), "mlp_bias"),
            (
                serde_json::json!({"attention_bias": true}),
                "attention_bias",
            ),
            (
                serde_json::json!({"hidden_act": "gelu"}),
                "hidden_act 'gelu'",
            ),
            (
                serde_json::json!({"use_sliding_window": true}),
                "sliding-window",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
                "RoPE scaling 'yarn'",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
                "without 'low_freq_factor'",
            ),
        ] {
            let e = from_hf(&llama(extra.clone())).unwrap_err().to_string();
            assert!(e.contains(says), "{extra}: {e}");
        }
        // Stated but off: accepted.
        for extra in [
            serde_json::json!({"mlp_bias": false, "use_sliding_window": false}),
            serde_json::json!({"hidden_act": "swish"}),
        ] {
            assert!(from_hf(&llama(extra.clone())).is_ok(), "{extra}");
        }
    }

    /// transformers' llama3 frequencies: the short wavelengths kept, the long ones divided by
    /// `factor`, the ones between blended monotonically; and llama.cpp's divisors give the
    /// same frequencies to within rounding.
    #[test]
    fn llama3_frequencies() {
        let p = serde_json::json!({
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024
        });
        let c = from_hf(&llama(serde_json::json!({"rope_parameters": p.clone()}))).unwrap();
        let table = c.rope.inv_freq.clone().unwrap();
        let base: Vec<f32> = Rope::unscaled_inv_freq(c.rope.theta, c.rope.rot_dim).collect();
        assert_eq!(table.len(), 8);
        for i in 0..8 {
            let wavelen = std::f32::consts::TAU / base[i];
            let ratio = table[i] / base[i];
            if wavelen < 256.0 {
                assert_eq!(table[i], base[i], "{i}: kept");
            } else if wavelen > 1024.0 {
                assert_eq!(table[i], base[i] / 8.0, "{i}: divided");
            } else {
                assert!(
                    ratio > 1.0 / 8.0 && ratio < 1.0,
                    "{i}: blended, ratio {ratio}"
                );
            }
        }
        let div = hf_llama3_divisors(&serde_json::json!({"rope_parameters": p}), &c.rope)
            .unwrap()
            .unwrap();
        for i in 0..8 {
            let f = base[i] / div[i];
            assert!(
                (f - table[i]).abs() <= 2.0 * f32::EPSILON * table[i],
                "{i}: {f} vs {}",
                table[i]
            );
        }
    }
}
