//! Hugging Face checkpoint → GGUF, written the way llama.cpp's converter writes it
//! (metadata keys, tensor names, stacked experts, and for `llama` the Q/K row permutation
//! that turns NeoX-style rotation into ggml's adjacent-pair rotation). Tensors keep their
//! stored type. Used to check that a model gives the same logits from both formats.

use std::path::Path;

use anyhow::{Context, Result};
use ferrite_backend::HostTensor;
use ferrite_formats::gguf::{GgufValue, GgufWriter};

use crate::config::Arch;
use crate::source::{ModelFile, Tensor};

/// llama.cpp's `permute` for llama Q/K weights: within each head, rows
/// `[0, 2, 4, …, 1, 3, 5, …]` of the adjacent-pair layout come from rows `[0..d/2, d/2..d]`
/// of the Hugging Face (rotate-half) layout.
fn permute_qk(t: &HostTensor<'_>, n_heads: usize) -> Result<Vec<u8>> {
    let [n_out, n_in] = t.shape[..] else {
        anyhow::bail!("Q/K weight is not 2-D")
    };
    let row = t.dtype.bytes_for(n_in)?;
    let d = n_out / n_heads;
    let mut out = vec![0u8; t.data.len()];
    for h in 0..n_heads {
        for i in 0..d / 2 {
            for (half, dst) in [(0, 2 * i), (1, 2 * i + 1)] {
                let src = h * d + half * d / 2 + i;
                let dst = h * d + dst;
                out[dst * row..(dst + 1) * row]
                    .copy_from_slice(&t.data[src * row..(src + 1) * row]);
            }
        }
    }
    Ok(out)
}

/// Writes the safetensors checkpoint at `src` as a GGUF file at `dst`.
pub fn hf_to_gguf(src: &Path, dst: &Path) -> Result<()> {
    let file = ModelFile::open(src)?;
    anyhow::ensure!(
        matches!(file, ModelFile::Safetensors(_)),
        "{} is not a safetensors checkpoint",
        src.display()
    );
    let cfg = file.config()?;
    if cfg.arch.is_hybrid() {
        return crate::qwen3_5::hf_to_gguf(&file, &cfg, dst);
    }
    let arch = cfg.arch.gguf_name();
    let mut w = GgufWriter::create(dst)?;
    let k = |s: &str| format!("{arch}.{s}");
    w.add_kv("general.architecture", arch)?;
    w.add_kv(k("context_length"), cfg.max_ctx as u32)?;
    w.add_kv(k("embedding_length"), cfg.hidden as u32)?;
    w.add_kv(k("block_count"), cfg.n_layers as u32)?;
    w.add_kv(k("feed_forward_length"), cfg.ffn as u32)?;
    w.add_kv(k("attention.head_count"), cfg.attn.n_heads as u32)?;
    w.add_kv(k("attention.head_count_kv"), cfg.attn.n_kv_heads as u32)?;
    w.add_kv(k("attention.key_length"), cfg.attn.head_dim as u32)?;
    w.add_kv(k("attention.value_length"), cfg.attn.head_dim as u32)?;
    w.add_kv(k("rope.freq_base"), cfg.rope.theta)?;
    w.add_kv(k("attention.layer_norm_rms_epsilon"), cfg.rms_eps)?;
    if let Some(m) = &cfg.moe {
        anyhow::ensure!(
            m.dense_layers.is_empty(),
            "GGUF qwen3moe has no dense layers"
        );
        w.add_kv(k("expert_count"), m.routing.n_experts as u32)?;
        w.add_kv(k("expert_used_count"), m.routing.top_k as u32)?;
        w.add_kv(k("expert_feed_forward_length"), m.expert_ffn as u32)?;
        w.add_kv(
            k("expert_weights_norm"),
            GgufValue::Bool(m.routing.norm_topk),
        )?;
    }

    // Collect (gguf name, tensor) in llama.cpp's order.
    let mut tensors: Vec<(String, HostTensor<'_>)> = Vec::new();
    let gguf_name = |t: Tensor| ModelFile::gguf_tensor_name(t);
    tensors.push((gguf_name(Tensor::Embed), file.need(Tensor::Embed)?));
    for i in 0..cfg.n_layers {
        let mut push = |t: Tensor| -> Result<()> {
            let mut h = file.need(t)?;
            if cfg.arch == Arch::Llama {
                match t {
                    Tensor::Q(_) => h.data = permute_qk(&h, cfg.attn.n_heads)?.into(),
                    Tensor::K(_) => h.data = permute_qk(&h, cfg.attn.n_kv_heads)?.into(),
                    _ => {}
                }
            }
            tensors.push((gguf_name(t), h));
            Ok(())
        };
        for t in [
            Tensor::AttnNorm(i),
            Tensor::Q(i),
            Tensor::K(i),
            Tensor::V(i),
            Tensor::O(i),
        ] {
            push(t)?;
        }
        if cfg.qk_norm {
            push(Tensor::QNorm(i))?;
            push(Tensor::KNorm(i))?;
        }
        push(Tensor::FfnNorm(i))?;
        if let Some(m) = &cfg.moe {
            push(Tensor::Router(i))?;
            let [g, u, d] = file.experts(i, m.routing.n_experts)?;
            tensors.push((format!("blk.{i}.ffn_gate_exps.weight"), g));
            tensors.push((format!("blk.{i}.ffn_up_exps.weight"), u));
            tensors.push((format!("blk.{i}.ffn_down_exps.weight"), d));
        } else {
            push(Tensor::Gate(i))?;
            push(Tensor::Up(i))?;
            push(Tensor::Down(i))?;
        }
    }
    tensors.push((
        gguf_name(Tensor::OutputNorm),
        file.need(Tensor::OutputNorm)?,
    ));
    // Llama 3.1's "llama3" RoPE scaling, as llama.cpp's converter writes it: one frequency
    // divisor per rotated pair.
    if let ModelFile::Safetensors(c) = &file {
        if let Some(div) = crate::config::hf_llama3_divisors(c.config(), &cfg.rope)? {
            tensors.push((
                "rope_freqs.weight".into(),
                HostTensor {
                    dtype: ferrite_formats::GgmlType::F32,
                    shape: vec![div.len()],
                    data: div
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect::<Vec<u8>>()
                        .into(),
                },
            ));
        }
    }
    if file.has(Tensor::Output) {
        tensors.push((gguf_name(Tensor::Output), file.need(Tensor::Output)?));
    }

    for (name, t) in &tensors {
        w.add_tensor_info(name, t.dtype, &t.shape)?;
    }
    w.write_header()?;
    for (name, t) in &tensors {
        w.write_tensor_data(name, &t.data)?;
    }
    w.finish()
        .with_context(|| format!("writing {}", dst.display()))?;
    Ok(())
}
