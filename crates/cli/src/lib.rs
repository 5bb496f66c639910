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
}

/// Resolves `--model` (or the default) to a path.
pub fn model_path(spec: Option<&str>) -> Result<PathBuf> {
    model_spec::resolve_model(spec)
}
