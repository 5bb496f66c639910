//! The `ferrite` command-line tool as a library, so integration tests can drive the same
//! code paths the binary uses.

pub mod bench;
pub mod check;
pub mod check_e2e;
pub mod load;
pub mod model_spec;
pub mod run;
pub mod serve;
pub mod synth;
pub mod tools;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};

/// Where to run.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Device {
    /// The GPU when there is one, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// Options shared by every command that loads a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model: a .gguf file, a Hugging Face checkpoint directory, or empty for the default
    /// model ($FERRITE_MODEL, else SmolLM2-135M-Instruct from the user cache, fetched if absent).
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Device to run on.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// CPU threads (default: all available cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Keep the KV cache in q8_0 blocks (int8 with one f16 scale per 32 values: ~0.53 of the
    /// f16 cache's bytes, attention NMSE ~4e-5 against f32). CUDA only: the CPU backend keeps
    /// its cache in f32 and refuses this flag.
    #[arg(long)]
    pub kv_cache_q8: bool,
    /// Quantize the checkpoint's float matrices as they load (F32, F16, BF16, and the FP8 /
    /// NVFP4 weights decoded to BF16): q8_0 (8.5 bits a weight) or q4_k_m (llama.cpp's
    /// Q4_K_M mix, ~4.9 bits). A decode step reads every weight once, so fewer bytes are a
    /// faster step; each matrix becomes what llama.cpp's quantizer makes of it, so the
    /// answers change as a quantized GGUF's do. Norms, routers and the convolution taps stay
    /// float; tensors stored quantized keep their type.
    #[arg(long, value_enum)]
    pub quantize: Option<Quantize>,
    /// GPU memory the weights may take, in GiB. A mixture-of-experts model larger than this
    /// keeps the stacked experts that do not fit (in load order: mostly the last layers') in
    /// pinned host memory, which the GPU reads in place over its bus: it runs, at the bus's
    /// speed for those experts (a decode step reads its routed experts' bytes across PCIe),
    /// instead of failing to load. Default: the GPU's free memory at load less 6 GiB for
    /// the KV cache, activations and workspaces. Dense weights always go to the GPU.
    #[arg(long, value_name = "GIB")]
    pub vram_weights: Option<f64>,
}

/// The mixes `--quantize` applies at load.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Quantize {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_k_m")]
    Q4_K_M,
}

impl Quantize {
    pub fn mix(self) -> ferrite_models::mix::Mix {
        match self {
            Quantize::Q8_0 => ferrite_models::mix::Mix::Q8_0,
            Quantize::Q4_K_M => ferrite_models::mix::Mix::Q4_K_M,
        }
    }
}

/// Resolves `--model` (or the default) to a path.
pub fn model_path(spec: Option<&str>) -> Result<PathBuf> {
    model_spec::resolve_model(spec)
}
