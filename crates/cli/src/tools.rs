//! The inspection commands: `logits`, `tokenize`, `info`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use ferrite_backend::cuda::ops::device_type;
use ferrite_models::{Logits, ModelFile};

use crate::load;
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// Output safetensors file.
    #[arg(long, short = 'o')]
    pub output: PathBuf,
}

pub fn logits(a: &LogitsArgs) -> Result<()> {
    let (_, file) = load::open(&a.model)?;
    crate::on_backend!(&a.model, be => logits_on(&be, &file, a))
}

fn logits_on<B: ferrite_backend::Backend>(be: &B, file: &ModelFile, a: &LogitsArgs) -> Result<()> {
    let model = load::model(be, file, &a.model)?;
    anyhow::ensure!(!a.tokens.is_empty(), "--tokens is empty");
    if let Some(&bad) = a.tokens.iter().find(|&&t| t as usize >= model.cfg.vocab) {
        anyhow::bail!(
            "token id {bad} is outside the vocabulary (size {})",
            model.cfg.vocab
        );
    }
    let mut kv = model.new_kv(be, a.tokens.len())?;
    let mut ws = model.workspace(
        be,
        a.tokens.len().min(ferrite_engine::generate::PREFILL_CHUNK),
        Logits::All,
    )?;
    let data = model.run(be, &mut ws, &mut kv, 0, &a.tokens, Logits::All)?;
    let (rows, cols) = (a.tokens.len(), model.cfg.vocab);
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![rows, cols], &bytes)?;
    safetensors::serialize_to_file([("logits", view)], None, &a.output)
        .with_context(|| format!("writing {}", a.output.display()))?;
    eprintln!("wrote logits [{rows}, {cols}] to {}", a.output.display());
    Ok(())
}

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// A .gguf file (vocab-only files work), a checkpoint directory with tokenizer.json, or a
    /// Qwen3.5/3.6 .tiktoken vocabulary.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Text to tokenize.
    #[arg(long)]
    pub text: String,
}

pub fn tokenize(a: &TokenizeArgs) -> Result<()> {
    let path = crate::model_path(a.model.as_deref())?;
    // Vocab-only GGUFs have no weights: read the tokenizer straight from the metadata.
    let tok = if path.is_dir() || path.extension().is_some_and(|e| e == "json") {
        let file = ModelFile::open(&path)?;
        load::tokenizer_for(&file, &path)?
            .with_context(|| format!("{} has no tokenizer.json", path.display()))?
    } else if path.extension().is_some_and(|e| e == "tiktoken") {
        ferrite_tokenizer::Tokenizer::from_tiktoken_file(&path)?
    } else {
        let g = ferrite_formats::gguf::GgufFile::open(&path)?;
        ferrite_tokenizer::Tokenizer::from_gguf(&g)?
    };
    let ids = tok.encode(&a.text, false, false)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Model: a .gguf file or a checkpoint directory (default: the default model).
    #[arg(long, short = 'm')]
    pub model: Option<String>,
}

pub fn info(a: &InfoArgs) -> Result<()> {
    let path = crate::model_path(a.model.as_deref())?;
    let file = ModelFile::open(&path)?;
    println!("file:          {}", path.display());
    match &file {
        ModelFile::Gguf(g) => println!("format:        GGUF v{}", g.version()),
        ModelFile::Safetensors(_) => println!("format:        Hugging Face safetensors checkpoint"),
    }
    match file.config() {
        Ok(c) => {
            println!("architecture:  {:?}", c.arch);
            println!("layers:        {}", c.n_layers);
            println!("hidden:        {}", c.hidden);
            println!(
                "attention:     {} heads, {} kv heads, head dim {}, rope {:?} theta {}{}",
                c.attn.n_heads,
                c.attn.n_kv_heads,
                c.attn.head_dim,
                c.rope.style,
                c.rope.theta,
                if c.rope.inv_freq.is_some() {
                    " (scaled: llama3 frequencies)"
                } else {
                    ""
                }
            );
            if c.ffn > 0 {
                println!("ffn:           {}", c.ffn);
            }
            if let Some(m) = &c.moe {
                println!(
                    "experts:       {} (top {}, expert ffn {}, renormalised: {})",
                    m.routing.n_experts, m.routing.top_k, m.expert_ffn, m.routing.norm_topk
                );
            }
            if let Some(h) = &c.hybrid {
                let (lin, full) = h.counts();
                println!("layers:        {lin} linear attention (Gated DeltaNet) + {full} full attention");
                println!(
                    "MTP head:      {}",
                    match ferrite_models::mtp::head_location(&file) {
                        Some(w) => format!("{w} (speculative decoding: --mtp-depth K)"),
                        None => "none".into(),
                    }
                );
            }
            println!("vocab:         {}", c.vocab);
            println!("context:       {}", c.max_ctx);
            println!("rms eps:       {:e}", c.rms_eps);
        }
        Err(e) => println!("architecture:  not runnable: {e:#}"),
    }
    // Per-type tensor counts and stored bytes, and the bytes the weights take on a GPU.
    let src = file.tensors();
    let mut by_type: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut held = 0usize;
    let names = src.tensor_names();
    for n in &names {
        // A safetensors tensor of a type ferrite does not compute with (integers, an FP8
        // weight without its scales) is listed but not a view: counted under its stored
        // type, marked. Converted weights (FP8, NVFP4) are held as BF16, MXFP4 as Q8_0, and a
        // GGUF's q5_0, q3_K and iq4_nl tensors as Q8_0 or Q6_K ([`quant::converted`]).
        let (ty, bytes, on_gpu) = match (src.tensor(n), &file) {
            (Some(t), _) if device_type(t.dtype) != t.dtype => (
                format!(
                    "{} ({} on a GPU)",
                    t.dtype.name(),
                    device_type(t.dtype).name().to_uppercase()
                ),
                t.data.len(),
                device_type(t.dtype).bytes_for(t.n_elements())?,
            ),
            (Some(t), _) => (t.dtype.name().to_string(), t.data.len(), t.data.len()),
            (None, ModelFile::Safetensors(c)) => match c.tensor_info(n) {
                Some(i) if c.quantized_form(n).is_some() => (
                    format!("{} (BF16 at load)", i.dtype),
                    i.n_bytes(),
                    2 * c.converted_elements(n).unwrap_or(0),
                ),
                Some(i) => (format!("{} (not loadable)", i.dtype), i.n_bytes(), 0),
                None => continue,
            },
            (None, ModelFile::Gguf(g)) => match g.tensor_info(n) {
                Some(i) => match i.converted_from {
                    Some(from) => (
                        format!("{from} ({} at load)", i.dtype.name().to_uppercase()),
                        i.n_bytes,
                        device_type(i.dtype).bytes_for(i.n_elements())?,
                    ),
                    None => continue,
                },
                None => match g.unloadable_tensor(n) {
                    Some(t) => (format!("{} (not loadable)", t.type_name), t.n_bytes, 0),
                    None => continue,
                },
            },
        };
        let e = by_type.entry(ty).or_default();
        e.0 += 1;
        e.1 += bytes;
        held += on_gpu;
    }
    let total: usize = by_type.values().map(|v| v.1).sum();
    if let Ok(c) = file.config() {
        // What a GPU needs: the weights as it holds them, plus an f16 KV cache per token for
        // the full-attention layers (a hybrid's linear-attention layers keep a fixed-size
        // state).
        let full_layers = c.hybrid.as_ref().map_or(c.n_layers, |h| h.counts().1);
        let kv_per_1k = 1000 * full_layers * 2 * c.attn.n_kv_heads * c.attn.head_dim * 2;
        println!(
            "VRAM:          {:.2} GiB of weights + {:.1} MiB of f16 KV cache per 1000 tokens",
            held as f64 / (1u64 << 30) as f64,
            kv_per_1k as f64 / (1 << 20) as f64
        );
        let experts = load::GpuFootprint::of(&file).experts;
        if experts > 0 {
            println!(
                "               {:.2} GiB of the weights are routed experts (what does not fit \
                 the GPU is held in host memory: --vram-weights)",
                experts as f64 / (1u64 << 30) as f64
            );
        }
    }
    println!(
        "tensors:       {} ({:.2} MiB)",
        names.len(),
        total as f64 / (1 << 20) as f64
    );
    let w = by_type.keys().map(|t| t.len()).max().unwrap_or(0).max(6);
    for (ty, (n, b)) in &by_type {
        println!(
            "  {ty:<w$} {n:>6} tensors {:>12.2} MiB",
            *b as f64 / (1 << 20) as f64
        );
    }
    match load::tokenizer_for(&file, &path) {
        Ok(Some(t)) => {
            println!(
                "tokenizer:     {} tokens, bos {:?}, end ids {:?}",
                t.vocab_size(),
                t.bos_id(),
                t.eos_ids()
            );
            println!(
                "chat template: {}",
                if t.chat_template().is_some() {
                    "present"
                } else {
                    "absent"
                }
            );
        }
        Ok(None) => println!("tokenizer:     none"),
        Err(e) => println!("tokenizer:     unusable: {e:#}"),
    }
    Ok(())
}
