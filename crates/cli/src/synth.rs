//! `ferrite synth`: random-weight GGUFs of real architectures, real quant mixes and real
//! tokenizer metadata, so machines without model files (and without network) can run and
//! benchmark at real sizes.
//!
//! The files are what llama.cpp's converter (`convert_hf_to_gguf.py`) plus `llama-quantize`
//! would write for the architecture: the same metadata keys, tensor names, shapes and
//! per-tensor types (`llama_tensor_get_type` in llama.cpp's `src/llama-quant.cpp` for the
//! Q4_K_M mix). Only the weight values are random: finite, normal-ish with std 0.02 for
//! matrices, ~1.0 for norm weights.
//!
//! Weights are generated and quantized in parallel (rayon) chunk by chunk, each chunk of rows
//! from its own seeded SplitMix64 stream (so the file depends only on `--seed`, not on the
//! thread count), and written while the next chunk is generated. Memory stays at two chunk
//! buffers, never the whole model.
//!
//! Block-size fallback: a tensor whose row length is not a multiple of its type's block
//! (e.g. Q4_K's 256 with the tiny presets' hidden size 128) is written as Q8_0 (32-element
//! blocks), or F16 if even that does not fit. llama.cpp falls back the same way but to
//! Q5_0/Q5_1 for Q4_K/Q5_K; ferrite loads Q5_0 by converting it to Q8_0 (and not Q5_1), so
//! Q8_0 is what such a tensor computes as either way. (`with_converted_types` writes the
//! types converted at load, for the tests of that path.)

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ferrite_formats::gguf::{GgufFile, GgufValue, GgufWriter};
use ferrite_formats::GgmlType;
use ferrite_models::mix::{self, Mix, MixModel, Role};
use rayon::prelude::*;

/// Arguments of `ferrite synth`.
#[derive(clap::Args, Clone, Debug)]
pub struct SynthArgs {
    /// Architecture and dimensions.
    #[arg(long, value_enum)]
    pub preset: Preset,
    /// Quantization mix (as llama.cpp's converter + llama-quantize would produce it).
    #[arg(long, value_enum, ignore_case = true, default_value_t = SynthQuant::Q4_K_M)]
    pub quant: SynthQuant,
    /// Output .gguf path.
    #[arg(long, short = 'o')]
    pub output: PathBuf,
    /// GGUF whose `tokenizer.*` metadata is copied (default: the vocabulary shipped in the
    /// repository at tests/data/tokenizers/qwen2-gguf/ggml-vocab-qwen2.gguf; for llama3.1-8b,
    /// Llama 3's at tests/data/tokenizers/llama-bpe-gguf/ggml-vocab-llama-bpe.gguf).
    #[arg(long)]
    pub vocab: Option<PathBuf>,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep only the first N layers of the preset (every other dimension, the quant mix and
    /// the hybrid layer pattern stay): a model with a real model's layer shapes that a CPU
    /// can run, for comparing backends on those shapes.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Also write a random multi-token-prediction head (Qwen3.5 presets) beside the GGUF, as
    /// OUTPUT with the extension `.mtp.safetensors`, in Hugging Face's names (where
    /// `--mtp-depth` finds it): speculative decoding then runs at the real head's cost,
    /// drafting badly (random weights).
    #[arg(long)]
    pub mtp: bool,
}

/// Model presets: real dimensions for benchmarks, tiny ones for tests.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// Qwen3-8B (dense, 36 layers, hidden 4096, GQA 32/8).
    #[value(name = "qwen3-8b")]
    Qwen3_8B,
    /// Qwen3-30B-A3B (MoE, 48 layers, 128 experts, 8 active).
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30B_A3B,
    /// Llama-3.1-8B (dense, 32 layers, hidden 4096, GQA 32/8, the "llama3" RoPE scaling as
    /// `rope_freqs.weight`, Llama 3's vocabulary).
    #[value(name = "llama3.1-8b")]
    Llama31_8B,
    /// A 2-layer Llama (hidden 128).
    #[value(name = "tiny-llama")]
    TinyLlama,
    /// A 2-layer Qwen3 (hidden 128).
    #[value(name = "tiny-qwen3")]
    TinyQwen3,
    /// A 2-layer Qwen3-MoE (hidden 128, 8 experts, top 2).
    #[value(name = "tiny-qwen3-moe")]
    TinyQwen3Moe,
    /// Qwen3.5-9B (hybrid: 24 Gated DeltaNet + 8 gated attention layers, hidden 4096).
    #[value(name = "qwen3.5-9b")]
    Qwen35_9B,
    /// Qwen3.5-35B-A3B (hybrid MoE: 40 layers, 256 experts, 8 active, shared expert).
    #[value(name = "qwen3.5-35b-a3b")]
    Qwen35_35B_A3B,
    /// A 4-layer Qwen3.5 (3 linear-attention layers + 1 full; hidden 128).
    #[value(name = "tiny-qwen3.5")]
    TinyQwen35,
    /// A 4-layer Qwen3.5-MoE (hidden 128, 8 experts, top 2, shared expert).
    #[value(name = "tiny-qwen3.5-moe")]
    TinyQwen35Moe,
}

/// Quantization mixes.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthQuant {
    /// All matrices F16, norms F32.
    #[value(name = "F16")]
    F16,
    /// All matrices BF16, norms F32.
    #[value(name = "BF16")]
    BF16,
    /// All matrices Q8_0, norms F32.
    #[value(name = "Q8_0")]
    Q8_0,
    /// llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for output.weight and for attn_v/ffn_down on
    /// the "use_more_bits" layers.
    #[value(name = "Q4_K_M")]
    Q4_K_M,
    /// llama.cpp's MXFP4_MOE mix: the routed experts MXFP4, the other matrices Q8_0.
    #[value(name = "MXFP4_MOE")]
    MXFP4_MOE,
}

impl SynthQuant {
    /// The type rules of this mix.
    fn mix(self) -> Mix {
        match self {
            SynthQuant::F16 => Mix::F16,
            SynthQuant::BF16 => Mix::BF16,
            SynthQuant::Q8_0 => Mix::Q8_0,
            SynthQuant::Q4_K_M => Mix::Q4_K_M,
            SynthQuant::MXFP4_MOE => Mix::MXFP4_MOE,
        }
    }
    /// `general.file_type` (llama.cpp's `llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            SynthQuant::F16 => 1,
            SynthQuant::Q8_0 => 7,
            SynthQuant::Q4_K_M => 15,
            SynthQuant::BF16 => 32,
            SynthQuant::MXFP4_MOE => 38,
        }
    }
    fn name(self) -> &'static str {
        self.mix().name()
    }
}

/// MoE dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub expert_ffn: usize,
}

/// The Gated DeltaNet part of a Qwen3.5 (`qwen35` / `qwen35moe`) model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HybridDims {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    /// Every this-many-th layer is full attention (`full_attention_interval`).
    pub full_attn_interval: usize,
    /// Rotated dims of the attention heads (`partial_rotary_factor` × head_dim).
    pub rot_dim: usize,
    /// The MoE models' shared expert FFN size (0 for dense).
    pub shared_expert_ffn: usize,
}

impl HybridDims {
    fn is_linear(&self, layer: usize) -> bool {
        !(layer + 1).is_multiple_of(self.full_attn_interval)
    }
    fn key_dim(&self) -> usize {
        self.n_k_heads * self.k_head_dim
    }
    fn value_dim(&self) -> usize {
        self.n_v_heads * self.v_head_dim
    }
}

/// Everything the file's shape depends on.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchDims {
    /// `general.architecture`: "llama", "qwen3", "qwen3moe", "qwen35" or "qwen35moe".
    pub arch: &'static str,
    pub name: &'static str,
    pub hidden: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Dense FFN size (`<arch>.feed_forward_length`; for Qwen3-MoE the config's
    /// `intermediate_size`, which the converter writes although no layer uses it).
    pub ffn: usize,
    /// `None` = take it from the vocabulary GGUF.
    pub vocab: Option<usize>,
    pub context: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    /// Per-head RMS norms on q and k (Qwen3).
    pub qk_norm: bool,
    pub moe: Option<MoeDims>,
    /// Qwen3.5's linear-attention layers.
    pub hybrid: Option<HybridDims>,
    /// Llama 3.1's "llama3" RoPE scaling (factor 8, frequency factors 1 and 4, 8,192 original
    /// positions), written as llama.cpp's converter writes it: `rope_freqs.weight`.
    pub llama3_rope: bool,
}

impl Preset {
    /// The vocabulary GGUF when `--vocab` names none (relative to the repository): Qwen2's,
    /// or Llama 3's for Llama-3.1-8B.
    fn default_vocab(self) -> &'static str {
        match self {
            Preset::Llama31_8B => LLAMA3_VOCAB_REL,
            _ => DEFAULT_VOCAB_REL,
        }
    }

    pub fn dims(self) -> ArchDims {
        let tiny = |arch, name, qk_norm, moe, rope_theta, rms_eps| ArchDims {
            arch,
            name,
            hidden: 128,
            n_layer: 2,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 32,
            ffn: 256,
            vocab: None,
            context: 4096,
            rope_theta,
            rms_eps,
            qk_norm,
            moe,
            hybrid: None,
            llama3_rope: false,
        };
        // Qwen3.5's linear-attention dims (both real models share them).
        let q35_linear = |shared_expert_ffn| HybridDims {
            n_k_heads: 16,
            n_v_heads: 32,
            k_head_dim: 128,
            v_head_dim: 128,
            conv_kernel: 4,
            full_attn_interval: 4,
            rot_dim: 64,
            shared_expert_ffn,
        };
        let tiny35 = |arch, name, moe: Option<MoeDims>, shared_expert_ffn| ArchDims {
            arch,
            name,
            hidden: 128,
            n_layer: 4,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 32,
            ffn: if moe.is_some() {
                shared_expert_ffn
            } else {
                256
            },
            vocab: None,
            context: 4096,
            rope_theta: 1e7,
            rms_eps: 1e-6,
            qk_norm: true,
            moe,
            hybrid: Some(HybridDims {
                n_k_heads: 2,
                n_v_heads: 4,
                k_head_dim: 32,
                v_head_dim: 32,
                conv_kernel: 4,
                full_attn_interval: 4,
                rot_dim: 8,
                shared_expert_ffn,
            }),
            llama3_rope: false,
        };
        match self {
            Preset::Llama31_8B => ArchDims {
                arch: "llama",
                name: "Llama-3.1-8B (synthetic random weights)",
                hidden: 4096,
                n_layer: 32,
                n_head: 32,
                n_head_kv: 8,
                head_dim: 128,
                ffn: 14336,
                vocab: Some(128256),
                context: 131072,
                rope_theta: 500000.0,
                rms_eps: 1e-5,
                qk_norm: false,
                moe: None,
                hybrid: None,
                llama3_rope: true,
            },
            Preset::Qwen3_8B => ArchDims {
                arch: "qwen3",
                name: "Qwen3-8B (synthetic random weights)",
                hidden: 4096,
                n_layer: 36,
                n_head: 32,
                n_head_kv: 8,
                head_dim: 128,
                ffn: 12288,
                vocab: Some(151936),
                context: 40960,
                rope_theta: 1e6,
                rms_eps: 1e-6,
                qk_norm: true,
                moe: None,
                hybrid: None,
                llama3_rope: false,
            },
            Preset::Qwen3_30B_A3B => ArchDims {
                arch: "qwen3moe",
                name: "Qwen3-30B-A3B (synthetic random weights)",
                hidden: 2048,
                n_layer: 48,
                n_head: 32,
                n_head_kv: 4,
                head_dim: 128,
                ffn: 6144,
                vocab: Some(151936),
                context: 40960,
                rope_theta: 1e6,
                rms_eps: 1e-6,
                qk_norm: true,
                // norm_topk_prob = true: llama.cpp always renormalizes the top-k weights for
                // qwen3moe, and its converter writes no key for it.
                moe: Some(MoeDims {
                    n_expert: 128,
                    n_expert_used: 8,
                    expert_ffn: 768,
                }),
                hybrid: None,
                llama3_rope: false,
            },
            Preset::TinyLlama => tiny(
                "llama",
                "tiny-llama (synthetic random weights)",
                false,
                None,
                10000.0,
                1e-5,
            ),
            Preset::TinyQwen3 => tiny(
                "qwen3",
                "tiny-qwen3 (synthetic random weights)",
                true,
                None,
                1e6,
                1e-6,
            ),
            Preset::TinyQwen3Moe => tiny(
                "qwen3moe",
                "tiny-qwen3-moe (synthetic random weights)",
                true,
                Some(MoeDims {
                    n_expert: 8,
                    n_expert_used: 2,
                    expert_ffn: 64,
                }),
                1e6,
                1e-6,
            ),
            Preset::Qwen35_9B => ArchDims {
                arch: "qwen35",
                name: "Qwen3.5-9B (synthetic random weights)",
                hidden: 4096,
                n_layer: 32,
                n_head: 16,
                n_head_kv: 4,
                head_dim: 256,
                ffn: 12288,
                vocab: Some(248320),
                context: 262144,
                rope_theta: 1e7,
                rms_eps: 1e-6,
                qk_norm: true,
                moe: None,
                hybrid: Some(q35_linear(0)),
                llama3_rope: false,
            },
            Preset::Qwen35_35B_A3B => ArchDims {
                arch: "qwen35moe",
                name: "Qwen3.5-35B-A3B (synthetic random weights)",
                hidden: 2048,
                n_layer: 40,
                n_head: 16,
                n_head_kv: 2,
                head_dim: 256,
                // No dense FFN; the converter writes none for qwen35moe.
                ffn: 512,
                vocab: Some(248320),
                context: 262144,
                rope_theta: 1e7,
                rms_eps: 1e-6,
                qk_norm: true,
                moe: Some(MoeDims {
                    n_expert: 256,
                    n_expert_used: 8,
                    expert_ffn: 512,
                }),
                hybrid: Some(q35_linear(512)),
                llama3_rope: false,
            },
            Preset::TinyQwen35 => {
                tiny35("qwen35", "tiny-qwen3.5 (synthetic random weights)", None, 0)
            }
            Preset::TinyQwen35Moe => tiny35(
                "qwen35moe",
                "tiny-qwen3.5-moe (synthetic random weights)",
                Some(MoeDims {
                    n_expert: 8,
                    n_expert_used: 2,
                    expert_ffn: 64,
                }),
                64,
            ),
        }
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// Normal-ish, mean 0, std 0.02.
    Matrix,
    /// 1.0 plus normal-ish noise of std 0.02 (RMS-norm weights).
    Norm,
    /// Qwen3.5's `ssm_a` = -exp(A_log) = -A with A uniform in (0, 16), transformers' init.
    NegDecay,
    /// `rope_freqs.weight`: the divisors llama.cpp's converter writes for Llama 3.1's "llama3"
    /// scaling of `theta` ([`LLAMA31_ROPE`]).
    Llama3RopeDivisors { theta: f32 },
}

/// Llama 3.1's `rope_parameters` (its config.json's), the scaling [`Init::Llama3RopeDivisors`]
/// writes.
const LLAMA31_ROPE: &str = r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#;

/// One tensor of the plan.
#[derive(Clone, Debug)]
struct TensorPlan {
    name: String,
    /// Row-major.
    shape: Vec<usize>,
    dtype: GgmlType,
    init: Init,
}

/// The type of one tensor under a mix ([`mix::tensor_type`] with this model's facts).
fn tensor_type(q: SynthQuant, role: Role, layer: usize, d: &ArchDims, row_len: usize) -> GgmlType {
    let m = MixModel {
        n_layers: d.n_layer,
        n_experts: d.moe.map_or(0, |m| m.n_expert),
    };
    mix::tensor_type(q.mix(), role, layer, m, row_len)
}

/// The tensors of the model, in file order.
fn plan(d: &ArchDims, vocab: usize, q: SynthQuant) -> Vec<TensorPlan> {
    let mut p = match d.hybrid {
        Some(hy) => plan_hybrid(d, &hy, vocab, q),
        None => plan_layers(d, vocab, q),
    };
    if q == SynthQuant::MXFP4_MOE {
        // llama.cpp's MXFP4_MOE: the routed experts' stacked matrices (`*_exps`) in MXFP4.
        for t in &mut p {
            let row = *t.shape.last().unwrap();
            if t.name.ends_with("_exps.weight") && row.is_multiple_of(GgmlType::MXFP4.block_size())
            {
                t.dtype = GgmlType::MXFP4;
            }
        }
    }
    p
}

/// [`plan`] of the models without linear-attention layers.
fn plan_layers(d: &ArchDims, vocab: usize, q: SynthQuant) -> Vec<TensorPlan> {
    let mut v = Vec::new();
    let (h, qd, kvd) = (d.hidden, d.n_head * d.head_dim, d.n_head_kv * d.head_dim);
    if d.llama3_rope {
        // LlamaModel.generate_extra_tensors writes it first, as F32.
        v.push(TensorPlan {
            name: "rope_freqs.weight".into(),
            shape: vec![d.head_dim / 2],
            dtype: GgmlType::F32,
            init: Init::Llama3RopeDivisors {
                theta: d.rope_theta,
            },
        });
    }
    let mut add = |name: String, shape: Vec<usize>, role: Role, layer: usize| {
        let row = *shape.last().unwrap();
        let init = if role == Role::Norm {
            Init::Norm
        } else {
            Init::Matrix
        };
        v.push(TensorPlan {
            dtype: tensor_type(q, role, layer, d, row),
            name,
            shape,
            init,
        });
    };
    add(
        "token_embd.weight".into(),
        vec![vocab, h],
        Role::TokenEmbd,
        0,
    );
    for i in 0..d.n_layer {
        let b = |s: &str| format!("blk.{i}.{s}");
        add(b("attn_norm.weight"), vec![h], Role::Norm, i);
        add(b("attn_q.weight"), vec![qd, h], Role::AttnQ, i);
        add(b("attn_k.weight"), vec![kvd, h], Role::AttnK, i);
        add(b("attn_v.weight"), vec![kvd, h], Role::AttnV, i);
        add(b("attn_output.weight"), vec![h, qd], Role::AttnOut, i);
        if d.qk_norm {
            add(b("attn_q_norm.weight"), vec![d.head_dim], Role::Norm, i);
            add(b("attn_k_norm.weight"), vec![d.head_dim], Role::Norm, i);
        }
        add(b("ffn_norm.weight"), vec![h], Role::Norm, i);
        match d.moe {
            None => {
                add(b("ffn_gate.weight"), vec![d.ffn, h], Role::FfnGateUp, i);
                add(b("ffn_up.weight"), vec![d.ffn, h], Role::FfnGateUp, i);
                add(b("ffn_down.weight"), vec![h, d.ffn], Role::FfnDown, i);
            }
            Some(m) => {
                add(
                    b("ffn_gate_inp.weight"),
                    vec![m.n_expert, h],
                    Role::Router,
                    i,
                );
                add(
                    b("ffn_gate_exps.weight"),
                    vec![m.n_expert, m.expert_ffn, h],
                    Role::FfnGateUp,
                    i,
                );
                add(
                    b("ffn_up_exps.weight"),
                    vec![m.n_expert, m.expert_ffn, h],
                    Role::FfnGateUp,
                    i,
                );
                add(
                    b("ffn_down_exps.weight"),
                    vec![m.n_expert, h, m.expert_ffn],
                    Role::FfnDown,
                    i,
                );
            }
        }
    }
    add("output_norm.weight".into(), vec![h], Role::Norm, 0);
    add("output.weight".into(), vec![vocab, h], Role::Output, 0);
    v
}

/// The tensors of a Qwen3.5 model (`qwen35` / `qwen35moe`), named and shaped as llama.cpp's
/// converter writes them (`ferrite_models`' qwen3_5.rs reads the same names): per linear
/// layer `attn_qkv` `[2·Hk·dk + Hv·dv, h]`, `attn_gate` (z), `ssm_beta`, `ssm_alpha`,
/// `ssm_conv1d` `[conv_dim, kernel]` (F32), `ssm_a`, `ssm_dt.bias`, `ssm_norm`, `ssm_out`; per
/// full-attention layer `attn_q` holding query and gate (`[2·H·d, h]`), k, v, output and the
/// q/k norms; `post_attention_norm` before the FFN; MoE layers add the shared expert
/// (`*_shexp`) and its 1-D gate `ffn_gate_inp_shexp`.
fn plan_hybrid(d: &ArchDims, hy: &HybridDims, vocab: usize, q: SynthQuant) -> Vec<TensorPlan> {
    let mut v = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, role: Role, layer: usize, init: Init| {
        let row = *shape.last().unwrap();
        v.push(TensorPlan {
            dtype: tensor_type(q, role, layer, d, row),
            name,
            shape,
            init,
        });
    };
    let (h, qd, kvd) = (d.hidden, d.n_head * d.head_dim, d.n_head_kv * d.head_dim);
    let conv_dim = 2 * hy.key_dim() + hy.value_dim();
    let (m, n) = (Init::Matrix, Init::Norm);
    add(
        "token_embd.weight".into(),
        vec![vocab, h],
        Role::TokenEmbd,
        0,
        m,
    );
    // llama.cpp's attn_v counter: its "more bits" rule runs over the attn_v tensors, out of
    // n_attention_wv = attn_v + attn_qkv tensors (= n_layer).
    let mut i_attn_v = 0;
    for i in 0..d.n_layer {
        let b = |s: &str| format!("blk.{i}.{s}");
        add(b("attn_norm.weight"), vec![h], Role::Norm, i, n);
        if hy.is_linear(i) {
            add(b("attn_qkv.weight"), vec![conv_dim, h], Role::AttnQkv, i, m);
            add(
                b("attn_gate.weight"),
                vec![hy.value_dim(), h],
                Role::Other,
                i,
                m,
            );
            add(
                b("ssm_beta.weight"),
                vec![hy.n_v_heads, h],
                Role::Other,
                i,
                m,
            );
            add(
                b("ssm_alpha.weight"),
                vec![hy.n_v_heads, h],
                Role::Other,
                i,
                m,
            );
            add(
                b("ssm_conv1d.weight"),
                vec![conv_dim, hy.conv_kernel],
                Role::KeepF32,
                i,
                m,
            );
            add(
                b("ssm_a"),
                vec![hy.n_v_heads],
                Role::Norm,
                i,
                Init::NegDecay,
            );
            // transformers initialises dt_bias to ones.
            add(b("ssm_dt.bias"), vec![hy.n_v_heads], Role::Norm, i, n);
            add(b("ssm_norm.weight"), vec![hy.v_head_dim], Role::Norm, i, n);
            add(
                b("ssm_out.weight"),
                vec![h, hy.value_dim()],
                Role::Other,
                i,
                m,
            );
        } else {
            add(b("attn_q.weight"), vec![2 * qd, h], Role::AttnQ, i, m);
            add(b("attn_k.weight"), vec![kvd, h], Role::AttnK, i, m);
            add(b("attn_v.weight"), vec![kvd, h], Role::AttnV, i_attn_v, m);
            i_attn_v += 1;
            add(b("attn_output.weight"), vec![h, qd], Role::AttnOut, i, m);
            add(b("attn_q_norm.weight"), vec![d.head_dim], Role::Norm, i, n);
            add(b("attn_k_norm.weight"), vec![d.head_dim], Role::Norm, i, n);
        }
        add(b("post_attention_norm.weight"), vec![h], Role::Norm, i, n);
        match d.moe {
            None => {
                add(b("ffn_gate.weight"), vec![d.ffn, h], Role::FfnGateUp, i, m);
                add(b("ffn_up.weight"), vec![d.ffn, h], Role::FfnGateUp, i, m);
                add(b("ffn_down.weight"), vec![h, d.ffn], Role::FfnDown, i, m);
            }
            Some(e) => {
                let (ne, ef, sf) = (e.n_expert, e.expert_ffn, hy.shared_expert_ffn);
                add(b("ffn_gate_inp.weight"), vec![ne, h], Role::Router, i, m);
                add(
                    b("ffn_gate_exps.weight"),
                    vec![ne, ef, h],
                    Role::FfnGateUp,
                    i,
                    m,
                );
                add(
                    b("ffn_up_exps.weight"),
                    vec![ne, ef, h],
                    Role::FfnGateUp,
                    i,
                    m,
                );
                add(
                    b("ffn_down_exps.weight"),
                    vec![ne, h, ef],
                    Role::FfnDown,
                    i,
                    m,
                );
                add(b("ffn_gate_inp_shexp.weight"), vec![h], Role::KeepF32, i, m);
                add(
                    b("ffn_gate_shexp.weight"),
                    vec![sf, h],
                    Role::FfnGateUp,
                    i,
                    m,
                );
                add(b("ffn_up_shexp.weight"), vec![sf, h], Role::FfnGateUp, i, m);
                add(b("ffn_down_shexp.weight"), vec![h, sf], Role::FfnDown, i, m);
            }
        }
    }
    add("output_norm.weight".into(), vec![h], Role::Norm, 0, n);
    add("output.weight".into(), vec![vocab, h], Role::Output, 0, m);
    v
}

/// The architecture metadata, with the keys llama.cpp's converter writes.
fn arch_metadata(d: &ArchDims, vocab: usize, q: SynthQuant) -> Vec<(String, GgufValue)> {
    let a = d.arch;
    let u = |x: usize| GgufValue::U32(x as u32);
    let mut kv: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), GgufValue::String(a.into())),
        ("general.type".into(), GgufValue::String("model".into())),
        ("general.name".into(), GgufValue::String(d.name.into())),
        (format!("{a}.block_count"), u(d.n_layer)),
        (format!("{a}.context_length"), u(d.context)),
        (format!("{a}.embedding_length"), u(d.hidden)),
        (format!("{a}.feed_forward_length"), u(d.ffn)),
        (format!("{a}.attention.head_count"), u(d.n_head)),
        (format!("{a}.attention.head_count_kv"), u(d.n_head_kv)),
        (format!("{a}.rope.freq_base"), GgufValue::F32(d.rope_theta)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            GgufValue::F32(d.rms_eps),
        ),
        (format!("{a}.attention.key_length"), u(d.head_dim)),
        (format!("{a}.attention.value_length"), u(d.head_dim)),
    ];
    if let Some(m) = d.moe {
        kv.push((format!("{a}.expert_count"), u(m.n_expert)));
        kv.push((format!("{a}.expert_used_count"), u(m.n_expert_used)));
        kv.push((format!("{a}.expert_feed_forward_length"), u(m.expert_ffn)));
    }
    if let Some(hy) = d.hybrid {
        // Qwen3NextModel / _LinearAttentionVReorderBase's keys (as ferrite's hf_to_gguf).
        let r = hy.rot_dim as i32 / 2;
        let sections = if r == 32 {
            vec![11, 11, 10, 0]
        } else {
            vec![r - 2 * (r / 3), r / 3, r / 3, 0]
        };
        kv.push((format!("{a}.rope.dimension_count"), u(hy.rot_dim)));
        kv.push((
            format!("{a}.rope.dimension_sections"),
            GgufValue::Array(sections.into_iter().map(GgufValue::I32).collect()),
        ));
        kv.push((format!("{a}.ssm.conv_kernel"), u(hy.conv_kernel)));
        kv.push((format!("{a}.ssm.state_size"), u(hy.k_head_dim)));
        kv.push((format!("{a}.ssm.group_count"), u(hy.n_k_heads)));
        kv.push((format!("{a}.ssm.time_step_rank"), u(hy.n_v_heads)));
        kv.push((format!("{a}.ssm.inner_size"), u(hy.value_dim())));
        kv.push((
            format!("{a}.full_attention_interval"),
            u(hy.full_attn_interval),
        ));
        if d.moe.is_some() {
            kv.push((
                format!("{a}.expert_shared_feed_forward_length"),
                u(hy.shared_expert_ffn),
            ));
        }
    }
    if a == "llama" {
        // LlamaModel.set_gguf_parameters adds these two.
        kv.push((format!("{a}.vocab_size"), u(vocab)));
        kv.push((format!("{a}.rope.dimension_count"), u(d.head_dim)));
    }
    kv.push(("general.file_type".into(), GgufValue::U32(q.file_type())));
    kv.push(("general.quantization_version".into(), GgufValue::U32(2)));
    kv
}

const DEFAULT_VOCAB_REL: &str = "tests/data/tokenizers/qwen2-gguf/ggml-vocab-qwen2.gguf";
/// Llama 3's vocabulary (128,256 tokens), llama.cpp's `ggml-vocab-llama-bpe.gguf`.
const LLAMA3_VOCAB_REL: &str = "tests/data/tokenizers/llama-bpe-gguf/ggml-vocab-llama-bpe.gguf";

/// The default vocabulary GGUF: searched upward from the executable, from the current
/// directory, and from this crate's source directory (for `cargo run`/`cargo test`).
fn default_vocab_path(rel: &str) -> Result<PathBuf> {
    let mut starts: Vec<PathBuf> = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        starts.extend(exe.parent().map(Path::to_path_buf));
    }
    if let Ok(cwd) = std::env::current_dir() {
        starts.push(cwd);
    }
    starts.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for s in &starts {
        for dir in s.ancestors() {
            let p = dir.join(rel);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    bail!(
        "the default vocabulary {rel} was not found near the executable or the current \
         directory; pass --vocab PATH (any GGUF with tokenizer.* metadata, e.g. a llama.cpp ggml-vocab-*.gguf)"
    )
}

/// The `tokenizer.*` metadata of the vocabulary GGUF and its token count. When the model's
/// vocabulary is larger than the tokenizer's, the token list is padded with `[PAD{i}]`
/// entries of type UNUSED, as the converter does.
fn tokenizer_metadata(
    vocab_path: &Path,
    model_vocab: Option<usize>,
) -> Result<(Vec<(String, GgufValue)>, usize)> {
    let f = GgufFile::open(vocab_path)
        .with_context(|| format!("reading the vocabulary {}", vocab_path.display()))?;
    let mut kv: Vec<(String, GgufValue)> = f
        .metadata()
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .cloned()
        .collect();
    let n_tokens = f.get_array("tokenizer.ggml.tokens").map(|a| a.len()).with_context(|| {
        format!("{}: no tokenizer.ggml.tokens array; --vocab must be a GGUF with tokenizer metadata", vocab_path.display())
    })?;
    let vocab = model_vocab.unwrap_or(n_tokens);
    if n_tokens > vocab {
        bail!(
            "{}: {n_tokens} tokens, more than the preset's vocabulary of {vocab}",
            vocab_path.display()
        );
    }
    if n_tokens < vocab {
        for (k, v) in kv.iter_mut() {
            let GgufValue::Array(items) = v else { continue };
            if items.len() != n_tokens {
                continue;
            }
            match k.as_str() {
                "tokenizer.ggml.tokens" => {
                    items.extend((n_tokens..vocab).map(|i| GgufValue::String(format!("[PAD{i}]"))))
                }
                // llama.cpp's LLAMA_TOKEN_TYPE_UNUSED.
                "tokenizer.ggml.token_type" => {
                    items.extend((n_tokens..vocab).map(|_| GgufValue::I32(5)))
                }
                "tokenizer.ggml.scores" => {
                    items.extend((n_tokens..vocab).map(|_| GgufValue::F32(0.0)))
                }
                _ => {}
            }
        }
    }
    Ok((kv, vocab))
}

/// SplitMix64: a tiny, fast, well-mixed generator; each chunk of rows gets its own stream.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    #[inline]
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Approximately N(0, 1): the sum of four 16-bit uniforms (Irwin–Hall), centred and
    /// scaled. Bounded (|x| <= 3.47), so always finite.
    #[inline]
    fn normalish(&mut self) -> f32 {
        let r = self.next();
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        // Mean 2 * 65535, variance 4 * 65536^2 / 12.
        const SCALE: f32 = 1.0 / (65536.0 * 0.577_350_3);
        (s as f32 - 131070.0) * SCALE
    }
}

/// Seed of the stream for rows starting at `row` of tensor number `tensor`.
fn chunk_seed(seed: u64, tensor: usize, row: usize) -> u64 {
    let mut s = SplitMix64(seed ^ (tensor as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let a = s.next();
    SplitMix64(a ^ (row as u64).wrapping_mul(0xA24B_AED4_963E_E407)).next()
}

/// Rows generated per RNG stream / rayon task (~256k elements; 1M for the K-quant fast
/// path, whose per-task cost is one real quantized row).
fn rows_per_task(t: GgmlType, row_len: usize) -> usize {
    let elems = if kquant_payload(t).is_some() {
        1 << 20
    } else {
        1 << 18
    };
    (elems / row_len).max(1)
}

/// For the K-quants: the byte range of a block that holds only quant indices (any bit
/// pattern is a valid block), the rest being scales. Layouts as in
/// `ferrite_formats::quant::k_quants`.
fn kquant_payload(t: GgmlType) -> Option<std::ops::Range<usize>> {
    match t {
        // d: f16 | dmin: f16 | scales: [u8; 12] | qs: [u8; 128]
        GgmlType::Q4K => Some(16..144),
        // d | dmin | scales[12] | qh[32] | qs[128]
        GgmlType::Q5K => Some(16..176),
        // ql[128] | qh[64] | scales[16] | d
        GgmlType::Q6K => Some(0..192),
        _ => None,
    }
}

/// Fill `out` (the encoded rows `row0..row0 + out.len() / row_bytes` of tensor `ti`).
///
/// Float and Q8_0 rows are drawn in f32 and encoded with the reference quantizer. The
/// K-quant reference quantizers run at tens of MB/s (an iterative scale search per
/// sub-block), far from the GB/s a 30 GB file needs, so K-quant rows take a shortcut: the
/// first row of each task is drawn and quantized for real, and every row of the task reuses
/// that row's block scales with fresh random quant indices. The blocks are valid, the values
/// finite and on a realistic scale (uniform over each block's quant grid instead of normal).
fn fill_rows(t: &TensorPlan, ti: usize, seed: u64, row0: usize, out: &mut [u8]) -> Result<()> {
    let row_len = *t.shape.last().unwrap();
    let row_bytes = t.dtype.bytes_for(row_len)?;
    let per_task = rows_per_task(t.dtype, row_len);
    let payload = kquant_payload(t.dtype);
    out.par_chunks_mut(per_task * row_bytes)
        .enumerate()
        .try_for_each(|(ci, chunk)| -> Result<()> {
            let first = row0 + ci * per_task;
            let mut rng = SplitMix64(chunk_seed(seed, ti, first));
            let mut x = vec![0f32; row_len];
            let divisors = match t.init {
                Init::Llama3RopeDivisors { theta } => llama3_rope_divisors(theta, 2 * row_len)?,
                _ => Vec::new(),
            };
            let draw = |x: &mut [f32], rng: &mut SplitMix64| match t.init {
                Init::Matrix => x.iter_mut().for_each(|v| *v = 0.02 * rng.normalish()),
                Init::Norm => x.iter_mut().for_each(|v| *v = 1.0 + 0.02 * rng.normalish()),
                Init::NegDecay => x.iter_mut().for_each(|v| {
                    *v = -16.0 * ((rng.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
                }),
                Init::Llama3RopeDivisors { .. } => x.copy_from_slice(&divisors),
            };
            match &payload {
                None => {
                    for row in chunk.chunks_mut(row_bytes) {
                        draw(&mut x, &mut rng);
                        ferrite_formats::quant::quantize(t.dtype, &x, row)?;
                    }
                }
                Some(range) => {
                    let (template, rest) = chunk.split_at_mut(row_bytes);
                    draw(&mut x, &mut rng);
                    ferrite_formats::quant::quantize(t.dtype, &x, template)?;
                    let block = t.dtype.type_size();
                    for row in rest.chunks_mut(row_bytes) {
                        row.copy_from_slice(template);
                        for b in row.chunks_mut(block) {
                            for q in b[range.clone()].chunks_mut(8) {
                                let r = rng.next().to_le_bytes();
                                q.copy_from_slice(&r[..q.len()]);
                            }
                        }
                    }
                }
            }
            Ok(())
        })
}

/// The `rope_freqs.weight` of Llama 3.1's scaling ([`LLAMA31_ROPE`]) for `rot_dim` rotated
/// dimensions at base `theta`, as the model loader reads a checkpoint's.
fn llama3_rope_divisors(theta: f32, rot_dim: usize) -> Result<Vec<f32>> {
    let config = serde_json::json!({
        "rope_parameters": serde_json::from_str::<serde_json::Value>(LLAMA31_ROPE)?,
    });
    let rope = ferrite_backend::Rope {
        style: ferrite_backend::RopeStyle::Adjacent,
        theta,
        rot_dim,
        inv_freq: None,
    };
    ferrite_models::config::hf_llama3_divisors(&config, &rope)?
        .context("the llama3 scaling gave no divisors")
}

/// `src` (a synthetic GGUF) rewritten to `dst` with its Q8_0 matrices stored in the types
/// ferrite converts at load (`ferrite_formats::quant::converted`: q5_0, q3_K and iq4_nl in
/// turn, where a tensor's rows take the type's blocks; the token embedding first). Each block
/// is random bits under a fixed f16 scale, so the weights are finite and at most ~0.04 in
/// magnitude, the synthetic matrices' scale. For the e2e check and the tests of those types'
/// loading; the number of tensors of each type, in `ConvertedType::ALL`'s order.
pub fn with_converted_types(src: &Path, dst: &Path, seed: u64) -> Result<[usize; 3]> {
    use ferrite_formats::quant::converted::ConvertedType;
    let f = GgufFile::open(src)?;
    let mut w = GgufWriter::create(dst)?;
    w.add_metadata_of(&f)?;
    let mut counts = [0usize; 3];
    let mut data = Vec::new();
    for (i, info) in f.tensor_infos().iter().enumerate() {
        let row = *info.shape.last().unwrap_or(&1);
        let pick = ConvertedType::ALL
            .iter()
            .copied()
            .cycle()
            .skip(i % 3)
            .take(3)
            .find(|t| row.is_multiple_of(t.block_size()));
        match pick {
            Some(t) if info.dtype == GgmlType::Q8_0 && info.shape.len() >= 2 => {
                let (d, d_at) = match t {
                    ConvertedType::Q5_0 => (0.0025f32, 0),
                    ConvertedType::IQ4NL => (0.0003, 0),
                    ConvertedType::Q3K => (0.0003, 108),
                };
                let d = half::f16::from_f32(d).to_bits().to_le_bytes();
                let mut rng = SplitMix64(chunk_seed(seed, i, 0));
                let mut bytes = vec![0u8; t.bytes_for(info.n_elements())?];
                for b in bytes.chunks_exact_mut(t.type_size()) {
                    for q in b.chunks_mut(8) {
                        let r = rng.next().to_le_bytes();
                        q.copy_from_slice(&r[..q.len()]);
                    }
                    b[d_at..d_at + 2].copy_from_slice(&d);
                }
                counts[ConvertedType::ALL.iter().position(|&x| x == t).unwrap_or(0)] += 1;
                w.add_tensor_info(&info.name, t, &info.shape)?;
                data.push((info.name.clone(), bytes));
            }
            _ => {
                w.add_tensor_info(&info.name, info.dtype, &info.shape)?;
                data.push((info.name.clone(), f.tensor_data(info).to_vec()));
            }
        }
    }
    w.write_header()?;
    for (name, bytes) in &data {
        w.write_tensor_data(name, bytes)?;
    }
    w.finish()?;
    Ok(counts)
}

/// Bytes generated per pipeline step (one buffer is written while the next is filled).
const CHUNK_BYTES: usize = 64 << 20;

/// Write the GGUF described by `args`.
pub fn synth(args: &SynthArgs) -> Result<()> {
    let mut d = args.preset.dims();
    anyhow::ensure!(
        !args.mtp || d.hybrid.is_some(),
        "--mtp: only the Qwen3.5 presets have an MTP head"
    );
    if let Some(n) = args.layers {
        anyhow::ensure!(
            (1..=d.n_layer).contains(&n),
            "--layers {n}: the preset has {} layers",
            d.n_layer
        );
        d.n_layer = n;
    }
    let vocab_path = match &args.vocab {
        Some(p) => p.clone(),
        None => default_vocab_path(args.preset.default_vocab())?,
    };
    let (tok_kv, vocab) = tokenizer_metadata(&vocab_path, d.vocab)?;
    let tensors = plan(&d, vocab, args.quant);

    // Write to a temporary name and rename at the end: an interrupted run never leaves a
    // file that looks complete.
    let mut tmp_name = args
        .output
        .file_name()
        .context("--output must name a file")?
        .to_os_string();
    tmp_name.push(".part");
    let tmp = args.output.with_file_name(tmp_name);
    let mut w = GgufWriter::create(&tmp)?;
    for (k, v) in arch_metadata(&d, vocab, args.quant)
        .into_iter()
        .chain(tok_kv)
    {
        w.add_kv(k, v)?;
    }
    for t in &tensors {
        w.add_tensor_info(&t.name, t.dtype, &t.shape)?;
    }
    let total = w.planned_data_bytes();
    tracing::info!(
        "synth {:?} {}: {} tensors, {:.2} GB of tensor data -> {}",
        args.preset,
        args.quant.name(),
        tensors.len(),
        total as f64 / 1e9,
        args.output.display()
    );
    w.write_header()?;

    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let start = std::time::Instant::now();

    let mut filled: Vec<u8> = Vec::new();
    let mut spare: Vec<u8> = Vec::new();
    for (ti, t) in tensors.iter().enumerate() {
        bar.set_message(t.name.clone());
        let row_len = *t.shape.last().unwrap();
        let n_rows: usize = t.shape.iter().product::<usize>() / row_len;
        let row_bytes = t.dtype.bytes_for(row_len)?;
        let rows_per_chunk = (CHUNK_BYTES / row_bytes).max(1);
        w.begin_tensor(&t.name)?;
        // Pipeline: write chunk k while chunk k+1 is generated.
        let mut row = 0;
        let mut pending = false;
        while row < n_rows || pending {
            let rows = rows_per_chunk.min(n_rows - row);
            spare.resize(rows * row_bytes, 0);
            let (wr, fr) = rayon::join(
                || -> Result<()> {
                    if pending {
                        w.write_tensor_bytes(&filled)?;
                        bar.inc(filled.len() as u64);
                    }
                    Ok(())
                },
                || {
                    if rows > 0 {
                        fill_rows(t, ti, args.seed, row, &mut spare)
                    } else {
                        Ok(())
                    }
                },
            );
            wr?;
            fr?;
            std::mem::swap(&mut filled, &mut spare);
            pending = rows > 0;
            row += rows;
        }
        w.end_tensor()?;
    }
    w.finish()?;
    bar.finish_and_clear();
    std::fs::rename(&tmp, &args.output)
        .with_context(|| format!("cannot move {} to {}", tmp.display(), args.output.display()))?;
    let secs = start.elapsed().as_secs_f64();
    tracing::info!(
        "wrote {} ({:.2} GB in {:.1} s, {:.2} GB/s)",
        args.output.display(),
        total as f64 / 1e9,
        secs,
        total as f64 / 1e9 / secs.max(1e-9)
    );
    if args.mtp {
        write_mtp(
            &d,
            args.seed,
            &args.output.with_extension("mtp.safetensors"),
        )?;
    }
    Ok(())
}

/// A random Qwen3.5 MTP head for `d` (see [`SynthArgs::mtp`]): bf16 tensors named as the
/// released checkpoints name them (`mtp.fc`, the three norms, and one full-attention layer
/// `mtp.layers.0.*` with the model's FFN, experts one tensor each), drawn as the GGUF's
/// (matrices 0.02·N(0, 1); the zero-centred norms, stored as w for a scale of 1 + w,
/// 0.02·N(0, 1)).
fn write_mtp(d: &ArchDims, seed: u64, path: &std::path::Path) -> Result<()> {
    let hy = d
        .hybrid
        .context("--mtp: only the Qwen3.5 presets have an MTP head")?;
    let (h, qd, kvd) = (d.hidden, d.n_head * d.head_dim, d.n_head_kv * d.head_dim);
    let l = |n: &str| format!("mtp.layers.0.{n}");
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("mtp.fc.weight".into(), vec![h, 2 * h]),
        ("mtp.pre_fc_norm_embedding.weight".into(), vec![h]),
        ("mtp.pre_fc_norm_hidden.weight".into(), vec![h]),
        ("mtp.norm.weight".into(), vec![h]),
        (l("input_layernorm.weight"), vec![h]),
        (l("post_attention_layernorm.weight"), vec![h]),
        (l("self_attn.q_proj.weight"), vec![2 * qd, h]),
        (l("self_attn.k_proj.weight"), vec![kvd, h]),
        (l("self_attn.v_proj.weight"), vec![kvd, h]),
        (l("self_attn.o_proj.weight"), vec![h, qd]),
        (l("self_attn.q_norm.weight"), vec![d.head_dim]),
        (l("self_attn.k_norm.weight"), vec![d.head_dim]),
    ];
    match d.moe {
        None => {
            shapes.push((l("mlp.gate_proj.weight"), vec![d.ffn, h]));
            shapes.push((l("mlp.up_proj.weight"), vec![d.ffn, h]));
            shapes.push((l("mlp.down_proj.weight"), vec![h, d.ffn]));
        }
        Some(e) => {
            let (ef, sf) = (e.expert_ffn, hy.shared_expert_ffn);
            shapes.push((l("mlp.gate.weight"), vec![e.n_expert, h]));
            for x in 0..e.n_expert {
                let p = |n: &str| l(&format!("mlp.experts.{x}.{n}"));
                shapes.push((p("gate_proj.weight"), vec![ef, h]));
                shapes.push((p("up_proj.weight"), vec![ef, h]));
                shapes.push((p("down_proj.weight"), vec![h, ef]));
            }
            shapes.push((l("mlp.shared_expert.gate_proj.weight"), vec![sf, h]));
            shapes.push((l("mlp.shared_expert.up_proj.weight"), vec![sf, h]));
            shapes.push((l("mlp.shared_expert.down_proj.weight"), vec![h, sf]));
            shapes.push((l("mlp.shared_expert_gate.weight"), vec![1, h]));
        }
    }
    let data: Vec<Vec<u8>> = shapes
        .par_iter()
        .enumerate()
        .map(|(i, (_, shape))| {
            let mut rng = SplitMix64(chunk_seed(seed ^ 0x4D54_5000, i, 0));
            let n: usize = shape.iter().product();
            (0..n)
                .flat_map(|_| {
                    let x = 0.02 * rng.normalish();
                    ferrite_formats::quant::float::f32_to_bf16(x).to_le_bytes()
                })
                .collect()
        })
        .collect();
    let views = shapes
        .iter()
        .zip(&data)
        .map(|((name, shape), bytes)| {
            let v = safetensors::tensor::TensorView::new(
                safetensors::Dtype::BF16,
                shape.clone(),
                bytes,
            )?;
            Ok((name.clone(), v))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path)
        .with_context(|| format!("writing {}", path.display()))?;
    tracing::info!(
        "wrote a random MTP head ({} tensors) to {}",
        shapes.len(),
        path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            let p =
                std::env::temp_dir().join(format!("ferrite-synth-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Llama-3.1-8B: its rope_freqs.weight first (F32, one divisor a rotated pair), no QK
    /// norms, Llama 3's vocabulary; the divisors those of llama.cpp's converter for theta
    /// 500,000 (checked against gguf-py's read of a written file when the preset came: equal):
    /// 1 for the short wavelengths, 8 for the long, a blend between.
    #[test]
    fn llama31_8b_plan_and_rope_divisors() {
        let d = Preset::Llama31_8B.dims();
        assert!(d.llama3_rope && !d.qk_norm);
        assert_eq!(Preset::Llama31_8B.default_vocab(), LLAMA3_VOCAB_REL);
        let p = plan(&d, 128256, SynthQuant::Q4_K_M);
        assert_eq!(p[0].name, "rope_freqs.weight");
        assert_eq!((p[0].dtype, &p[0].shape[..]), (GgmlType::F32, &[64][..]));
        assert!(!p.iter().any(|t| t.name.contains("attn_q_norm")));
        let div = llama3_rope_divisors(d.rope_theta, d.head_dim).unwrap();
        assert_eq!(div.len(), 64);
        assert_eq!((div[0], div[63]), (1.0, 8.0));
        assert!(div.windows(2).all(|w| w[0] <= w[1]), "{div:?}");
        assert!(div.iter().any(|&v| v > 1.0 && v < 8.0), "{div:?}");
    }

    #[test]
    fn qwen3_8b_q4_k_m_plan() {
        let d = Preset::Qwen3_8B.dims();
        let p = plan(&d, 151936, SynthQuant::Q4_K_M);
        let get = |n: &str| {
            p.iter()
                .find(|t| t.name == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        assert_eq!(p.len(), 2 + 36 * 11 + 1);
        assert_eq!(get("token_embd.weight").dtype, GgmlType::Q4K);
        assert_eq!(get("output.weight").dtype, GgmlType::Q6K);
        assert_eq!(get("output.weight").shape, vec![151936, 4096]);
        assert_eq!(get("output_norm.weight").dtype, GgmlType::F32);
        assert_eq!(get("blk.0.attn_v.weight").dtype, GgmlType::Q6K);
        assert_eq!(get("blk.4.attn_v.weight").dtype, GgmlType::Q4K);
        assert_eq!(get("blk.6.ffn_down.weight").dtype, GgmlType::Q6K);
        assert_eq!(get("blk.7.ffn_down.weight").dtype, GgmlType::Q4K);
        assert_eq!(get("blk.7.ffn_down.weight").shape, vec![4096, 12288]);
        assert_eq!(get("blk.7.attn_q.weight").shape, vec![4096, 4096]);
        assert_eq!(get("blk.7.attn_k.weight").shape, vec![1024, 4096]);
        assert_eq!(get("blk.7.attn_k_norm.weight").shape, vec![128]);
        assert_eq!(get("blk.7.attn_output.weight").dtype, GgmlType::Q4K);
        // Total size is what a real Qwen3-8B Q4_K_M weighs (~5.0 GB).
        let bytes: usize = p
            .iter()
            .map(|t| t.dtype.bytes_for(t.shape.iter().product()).unwrap())
            .sum();
        assert!((4.8e9..5.2e9).contains(&(bytes as f64)), "{bytes}");
    }

    #[test]
    fn qwen3_30b_plan() {
        let d = Preset::Qwen3_30B_A3B.dims();
        let p = plan(&d, 151936, SynthQuant::Q4_K_M);
        let get = |n: &str| p.iter().find(|t| t.name == n).unwrap();
        assert_eq!(
            get("blk.0.ffn_gate_exps.weight").shape,
            vec![128, 768, 2048]
        );
        assert_eq!(
            get("blk.0.ffn_down_exps.weight").shape,
            vec![128, 2048, 768]
        );
        assert_eq!(get("blk.0.ffn_down_exps.weight").dtype, GgmlType::Q6K);
        assert_eq!(get("blk.10.ffn_down_exps.weight").dtype, GgmlType::Q4K);
        assert_eq!(get("blk.0.ffn_gate_inp.weight").dtype, GgmlType::F32);
        assert_eq!(get("blk.0.attn_q.weight").shape, vec![4096, 2048]);
        let bytes: usize = p
            .iter()
            .map(|t| t.dtype.bytes_for(t.shape.iter().product()).unwrap())
            .sum();
        // A real Qwen3-30B-A3B Q4_K_M is ~18.6 GB.
        assert!((17.5e9..19.5e9).contains(&(bytes as f64)), "{bytes}");
    }

    fn plan_bytes(p: &[TensorPlan]) -> usize {
        p.iter()
            .map(|t| t.dtype.bytes_for(t.shape.iter().product()).unwrap())
            .sum()
    }

    #[test]
    fn qwen35_9b_q4_k_m_plan() {
        let d = Preset::Qwen35_9B.dims();
        let p = plan(&d, 248320, SynthQuant::Q4_K_M);
        let get = |n: &str| {
            p.iter()
                .find(|t| t.name == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        // 24 linear layers of 10 mixer tensors, 8 attention layers of 7; each layer adds
        // its FFN norm and 3 FFN matrices; embedding, output norm, output.
        assert_eq!(p.len(), 3 + 24 * (10 + 4) + 8 * (7 + 4));
        assert_eq!(get("blk.0.attn_qkv.weight").shape, vec![8192, 4096]);
        assert_eq!(get("blk.0.attn_qkv.weight").dtype, GgmlType::Q5K);
        assert_eq!(get("blk.0.attn_gate.weight").shape, vec![4096, 4096]);
        assert_eq!(get("blk.0.ssm_alpha.weight").shape, vec![32, 4096]);
        assert_eq!(get("blk.0.ssm_conv1d.weight").shape, vec![8192, 4]);
        assert_eq!(get("blk.0.ssm_conv1d.weight").dtype, GgmlType::F32);
        assert_eq!(get("blk.0.ssm_a").dtype, GgmlType::F32);
        assert_eq!(get("blk.0.ssm_norm.weight").shape, vec![128]);
        assert_eq!(get("blk.0.ssm_out.weight").shape, vec![4096, 4096]);
        assert_eq!(get("blk.3.attn_q.weight").shape, vec![8192, 4096]);
        assert_eq!(get("blk.3.attn_k.weight").shape, vec![1024, 4096]);
        assert_eq!(get("blk.3.attn_output.weight").shape, vec![4096, 4096]);
        assert_eq!(get("blk.3.attn_v.weight").dtype, GgmlType::Q6K);
        assert!(p.iter().all(|t| !t.name.starts_with("blk.3.ssm")));
        assert_eq!(get("output.weight").shape, vec![248320, 4096]);
        // A real Qwen3.5-9B Q4_K_M weighs 5.23 GiB (5.62 GB).
        let bytes = plan_bytes(&p);
        assert!((5.45e9..5.8e9).contains(&(bytes as f64)), "{bytes}");
    }

    #[test]
    fn qwen35_35b_a3b_plan() {
        let d = Preset::Qwen35_35B_A3B.dims();
        let p = plan(&d, 248320, SynthQuant::Q4_K_M);
        let get = |n: &str| {
            p.iter()
                .find(|t| t.name == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        assert_eq!(
            get("blk.0.ffn_gate_exps.weight").shape,
            vec![256, 512, 2048]
        );
        assert_eq!(
            get("blk.0.ffn_down_exps.weight").shape,
            vec![256, 2048, 512]
        );
        assert_eq!(get("blk.0.ffn_gate_inp.weight").dtype, GgmlType::F32);
        assert_eq!(get("blk.0.ffn_gate_inp_shexp.weight").shape, vec![2048]);
        assert_eq!(get("blk.0.ffn_up_shexp.weight").shape, vec![512, 2048]);
        assert_eq!(get("blk.39.attn_q.weight").shape, vec![8192, 2048]);
        assert_eq!(get("blk.39.attn_k.weight").shape, vec![512, 2048]);
        // A real Qwen3.5-35B-A3B Q4_K_M weighs 19.7 GiB (21.2 GB).
        let bytes = plan_bytes(&p);
        assert!((20.0e9..22.0e9).contains(&(bytes as f64)), "{bytes}");
        let q8 = plan_bytes(&plan(&d, 248320, SynthQuant::Q8_0));
        assert!((35.0e9..38.5e9).contains(&(q8 as f64)), "{q8}");
    }

    /// The tiny Qwen3.5 presets load as `qwen35` / `qwen35moe` models and run on the CPU:
    /// prefill logits equal decode logits (the linear-attention state carries).
    #[test]
    fn tiny_qwen35_presets_load_and_run() {
        use ferrite_backend::cpu::CpuBackend;
        use ferrite_models::{Logits, Model, ModelFile};
        let t = TempDir::new("q35");
        let be = CpuBackend::new();
        for preset in [Preset::TinyQwen35, Preset::TinyQwen35Moe] {
            for quant in [SynthQuant::Q8_0, SynthQuant::Q4_K_M] {
                let out = t.0.join(format!("{preset:?}-{}.gguf", quant.name()));
                synth(&SynthArgs {
                    preset,
                    quant,
                    output: out.clone(),
                    vocab: None,
                    seed: 3,
                    layers: None,
                    mtp: false,
                })
                .unwrap();
                let f = GgufFile::open(&out).unwrap();
                let a = preset.dims().arch;
                assert_eq!(f.architecture(), Some(a));
                assert_eq!(f.get_u32(&format!("{a}.ssm.time_step_rank")), Some(4));
                let file = ModelFile::open(&out).unwrap();
                let m = Model::load(&be, &file, &|_, _| {}).unwrap();
                let tokens: Vec<u32> = (0..12u32).map(|i| 100 + 37 * i).collect();
                let mut kv = m.new_kv(&be, tokens.len()).unwrap();
                let mut ws = m.workspace(&be, tokens.len(), Logits::All).unwrap();
                let all = m
                    .run(&be, &mut ws, &mut kv, 0, &tokens, Logits::All)
                    .unwrap();
                assert!(all.iter().all(|v| v.is_finite()), "{preset:?}");
                // Token by token from a fresh cache: the same last-position logits.
                let mut kv = m.new_kv(&be, tokens.len()).unwrap();
                let mut ws = m.workspace(&be, 1, Logits::All).unwrap();
                let mut last = vec![];
                for (p, &tok) in tokens.iter().enumerate() {
                    last = m
                        .run(&be, &mut ws, &mut kv, p, &[tok], Logits::All)
                        .unwrap();
                }
                let v = m.cfg.vocab;
                let want = &all[(tokens.len() - 1) * v..];
                let err: f32 = last
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(err < 1e-4, "{preset:?} {quant:?}: max |Δ| {err}");
            }
        }
    }

    #[test]
    fn rng_is_sane() {
        let mut r = SplitMix64(1);
        let n = 200_000;
        let xs: Vec<f32> = (0..n).map(|_| r.normalish()).collect();
        let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
        assert!(xs.iter().all(|x| x.is_finite() && x.abs() < 3.5));
    }

    fn check_file(preset: Preset, quant: SynthQuant, dir: &Path) {
        let out = dir.join(format!("{preset:?}-{}.gguf", quant.name()));
        let args = SynthArgs {
            preset,
            quant,
            output: out.clone(),
            vocab: None,
            seed: 7,
            layers: None,
            mtp: false,
        };
        synth(&args).unwrap();
        let f = GgufFile::open(&out).unwrap();
        let d = preset.dims();
        let a = d.arch;
        assert_eq!(f.architecture(), Some(a));
        assert_eq!(f.get_u32(&format!("{a}.embedding_length")), Some(128));
        assert_eq!(f.get_u32(&format!("{a}.block_count")), Some(2));
        assert_eq!(f.get_u32(&format!("{a}.attention.head_count")), Some(4));
        assert_eq!(f.get_u32(&format!("{a}.attention.head_count_kv")), Some(2));
        assert_eq!(f.get_u32(&format!("{a}.attention.key_length")), Some(32));
        assert_eq!(
            f.get_f32(&format!("{a}.rope.freq_base")),
            Some(d.rope_theta)
        );
        assert_eq!(f.get_u32("general.file_type"), Some(quant.file_type()));
        let vocab = f.get_array("tokenizer.ggml.tokens").unwrap().len();
        assert_eq!(vocab, 151936);
        assert_eq!(f.get_str("tokenizer.ggml.model"), Some("gpt2"));
        assert!(f.get("tokenizer.ggml.merges").is_some());
        let want = plan(&d, vocab, quant);
        assert_eq!(f.tensor_infos().len(), want.len());
        for (info, t) in f.tensor_infos().iter().zip(&want) {
            assert_eq!(
                (&info.name, &info.shape, info.dtype),
                (&t.name, &t.shape, t.dtype)
            );
        }
        let ty = |n: &str| f.tensor_info(n).unwrap_or_else(|| panic!("{n}")).dtype;
        assert_eq!(ty("output_norm.weight"), GgmlType::F32);
        assert_eq!(ty("blk.0.attn_norm.weight"), GgmlType::F32);
        match quant {
            SynthQuant::F16 => assert_eq!(ty("blk.0.attn_q.weight"), GgmlType::F16),
            SynthQuant::BF16 => assert_eq!(ty("blk.0.attn_q.weight"), GgmlType::BF16),
            // Rows of 128 don't fit Q4_K/Q6_K blocks: Q8_0 fallback; rows of 256 do.
            SynthQuant::Q8_0 | SynthQuant::Q4_K_M | SynthQuant::MXFP4_MOE => {
                assert_eq!(ty("blk.0.attn_q.weight"), GgmlType::Q8_0)
            }
        }
        if quant == SynthQuant::MXFP4_MOE && d.moe.is_some() {
            assert_eq!(ty("blk.0.ffn_gate_exps.weight"), GgmlType::MXFP4);
            assert_eq!(ty("blk.1.ffn_down_exps.weight"), GgmlType::MXFP4);
        }
        if let Some(m) = d.moe {
            assert_eq!(
                f.get_u32(&format!("{a}.expert_count")),
                Some(m.n_expert as u32)
            );
            assert_eq!(
                f.get_u32(&format!("{a}.expert_used_count")),
                Some(m.n_expert_used as u32)
            );
            assert_eq!(
                f.get_u32(&format!("{a}.expert_feed_forward_length")),
                Some(m.expert_ffn as u32)
            );
            assert_eq!(
                f.tensor_info("blk.1.ffn_up_exps.weight").unwrap().shape,
                vec![8, 64, 128]
            );
            assert_eq!(ty("blk.1.ffn_gate_inp.weight"), GgmlType::F32);
            if quant == SynthQuant::Q4_K_M {
                // n_expert == 8: attn_k/attn_v bumped to Q8_0, as llama.cpp does.
                assert_eq!(ty("blk.0.attn_v.weight"), GgmlType::Q8_0);
            }
        } else {
            assert_eq!(
                f.tensor_info("blk.1.ffn_down.weight").unwrap().shape,
                vec![128, 256]
            );
            if quant == SynthQuant::Q4_K_M {
                // ffn_down rows are 256 long: real K-quants, Q6_K on the "more bits" layer 1.
                assert_eq!(ty("blk.0.ffn_down.weight"), GgmlType::Q4K);
                assert_eq!(ty("blk.1.ffn_down.weight"), GgmlType::Q6K);
            }
        }
        assert_eq!(
            f.tensor_info("blk.0.attn_q_norm.weight").is_some(),
            d.qk_norm
        );
        // Values are finite and sane.
        for name in [
            "token_embd.weight",
            "blk.1.attn_norm.weight",
            "output.weight",
        ] {
            let info = f.tensor_info(name).unwrap();
            let mut x = vec![0f32; info.n_elements()];
            ferrite_formats::quant::dequantize(info.dtype, f.tensor_data(info), &mut x).unwrap();
            assert!(x.iter().all(|v| v.is_finite()), "{name}");
            let mean = x.iter().map(|&v| v as f64).sum::<f64>() / x.len() as f64;
            let rms =
                (x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
            if name.contains("norm") {
                assert!((mean - 1.0).abs() < 0.01, "{name} {mean}");
            } else {
                assert!(
                    mean.abs() < 0.001 && (0.015..0.025).contains(&rms),
                    "{name} {mean} {rms}"
                );
            }
        }
        // No temporary file left behind.
        assert!(!dir
            .join(format!("{preset:?}-{}.gguf.part", quant.name()))
            .exists());
    }

    #[test]
    fn synth_tiny_presets_all_quants() {
        let t = TempDir::new("tiny");
        for preset in [Preset::TinyLlama, Preset::TinyQwen3, Preset::TinyQwen3Moe] {
            for quant in [
                SynthQuant::F16,
                SynthQuant::BF16,
                SynthQuant::Q8_0,
                SynthQuant::Q4_K_M,
                SynthQuant::MXFP4_MOE,
            ] {
                check_file(preset, quant, &t.0);
            }
        }
    }

    #[test]
    fn same_seed_same_file() {
        let t = TempDir::new("seed");
        let run = |seed, name: &str| {
            let out = t.0.join(name);
            synth(&SynthArgs {
                preset: Preset::TinyQwen3,
                quant: SynthQuant::Q4_K_M,
                output: out.clone(),
                vocab: None,
                seed,
                layers: None,
                mtp: false,
            })
            .unwrap();
            std::fs::read(out).unwrap()
        };
        let a = run(1, "a.gguf");
        assert_eq!(a, run(1, "b.gguf"));
        assert_ne!(a, run(2, "c.gguf"));
    }

    #[test]
    fn layers_keeps_the_first_layers() {
        let t = TempDir::new("layers");
        let args = |layers, name: &str| SynthArgs {
            preset: Preset::TinyQwen35,
            quant: SynthQuant::Q8_0,
            output: t.0.join(name),
            vocab: None,
            seed: 0,
            layers,
            mtp: false,
        };
        synth(&args(Some(2), "two.gguf")).unwrap();
        let f = GgufFile::open(t.0.join("two.gguf")).unwrap();
        assert_eq!(f.get_u32("qwen35.block_count"), Some(2));
        assert!(f.tensor_info("blk.1.attn_norm.weight").is_some());
        assert!(f.tensor_info("blk.2.attn_norm.weight").is_none());
        for bad in [0, 5] {
            let e = synth(&args(Some(bad), "bad.gguf")).unwrap_err().to_string();
            assert!(e.contains("--layers"), "{e}");
        }
    }

    #[test]
    fn bad_vocab_is_a_clear_error() {
        let t = TempDir::new("badvocab");
        let e = synth(&SynthArgs {
            preset: Preset::TinyQwen3,
            quant: SynthQuant::F16,
            output: t.0.join("x.gguf"),
            vocab: Some(t.0.join("missing.gguf")),
            seed: 0,
            layers: None,
            mtp: false,
        })
        .unwrap_err();
        assert!(format!("{e:#}").contains("missing.gguf"), "{e:#}");
    }
}
