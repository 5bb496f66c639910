//! `ferrite serve`: the OpenAI-compatible HTTP server.

use std::path::Path;

use anyhow::{Context, Result};
use clap::Args;
use ferrite_backend::Backend;
use ferrite_engine::scheduler::{Scheduler, SchedulerConfig};
use ferrite_engine::Engine;
use ferrite_server::{AppState, ServerConfig};

use crate::ModelArgs;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to bind (loopback by default: expose it deliberately).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "FERRITE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Most sequences generating at once.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Longest prompt + completion (default: the model's context, at most 4096).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// KV cache budget in tokens, shared by all sequences (default: max-batch × max-context).
    #[arg(long)]
    pub max_kv_tokens: Option<usize>,
    /// Most requests waiting for a batch slot; more get 429.
    #[arg(long, default_value_t = 64)]
    pub max_waiting: usize,
    /// Most prompt tokens prefilled per scheduler iteration (bounds decode stalls).
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Name clients must use as `model` (default: the model file's name without extension).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Speculative decoding with the model's own multi-token-prediction head (Qwen3.5
    /// checkpoints' `mtp.*` tensors), K drafts a step (1 to 8; 0 = off). Greedy requests
    /// get the model's greedy output, sampled ones speculative sampling (the same
    /// distribution); requests with logprobs or penalties decode without it.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8))]
    pub mtp_depth: u32,
    /// Speculative decoding with n-gram drafts from each request's prompt and output so far
    /// (prompt lookup; any model, no extra weights, in batched steps too): up to K drafts a
    /// step where the text's last few tokens occurred before, verified with the step's other
    /// rows; fast where the output repeats its input (code edits, quotes, lists, JSON), a
    /// plain decode row elsewhere (1 to 8; 0 = off). Greedy requests get the model's greedy
    /// output, sampled ones the same distribution; requests with logprobs or penalties
    /// decode without it. Not with --mtp-depth.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8), conflicts_with = "mtp_depth")]
    pub lookup_depth: u32,
    /// Turn off the prefix cache. By default the keys and values of every full 16-token KV
    /// page are kept after their request, and a later request that starts with the same
    /// tokens (a shared system prompt, the earlier turns of a conversation) takes them instead
    /// of prefilling them again (`usage.prompt_tokens_details.cached_tokens`); kept pages are
    /// evicted, oldest first, as soon as a request needs the room. Hybrid (Qwen3.5) models
    /// also save their Gated DeltaNet state where cached pages end (3 × --max-batch saved
    /// states) and resume from it. Batched steps only (not with --mtp-depth or
    /// --lookup-depth on hybrid models).
    #[arg(long)]
    pub no_prefix_cache: bool,
}

/// Default `--max-context` cap: the CPU backend allocates each sequence's KV contiguously,
/// so a model's full context (often 32k+) per sequence would waste memory by default.
const DEFAULT_MAX_CONTEXT: usize = 4096;
/// Tokens per KV page (vLLM's default block size).
const PAGE_SIZE: usize = 16;

pub fn serve(a: &ServeArgs) -> Result<()> {
    crate::load::init_threads(a.model.threads);
    let path = crate::model_path(a.model.model.as_deref())?;
    let name = a
        .served_model_name
        .clone()
        .unwrap_or_else(|| model_name(&path));
    let mtp = a.mtp_depth > 0;
    crate::on_backend!(&a.model, be => serve_on(crate::load::engine_with(be, &a.model, mtp)?, a, name))
}

fn model_name(path: &Path) -> String {
    let f = path
        .file_name()
        .map_or_else(|| "model".to_string(), |f| f.to_string_lossy().into_owned());
    f.strip_suffix(".gguf").map(str::to_string).unwrap_or(f)
}

fn serve_on<B: Backend + 'static>(engine: Engine<B>, a: &ServeArgs, model_id: String) -> Result<()>
where
    Engine<B>: Send,
{
    anyhow::ensure!(a.max_body_bytes > 0, "--max-body-bytes must be at least 1");
    // Capped at the model's context before the KV budget is derived from it.
    let model_ctx = engine.model.cfg.max_ctx;
    let max_context = match a.max_context {
        Some(c) if c > model_ctx => {
            tracing::warn!(
                "--max-context {c} is beyond the model's context; capped at {model_ctx}"
            );
            model_ctx
        }
        Some(c) => c,
        None => DEFAULT_MAX_CONTEXT.min(model_ctx),
    };
    let cfg = SchedulerConfig {
        max_batch: a.max_batch,
        max_context,
        kv_tokens: a.max_kv_tokens.unwrap_or(a.max_batch * max_context),
        page_size: PAGE_SIZE,
        prefill_chunk: a.prefill_chunk,
        max_waiting: a.max_waiting,
        mtp_depth: a.mtp_depth as usize,
        lookup_depth: a.lookup_depth as usize,
        prefix_cache: !a.no_prefix_cache,
    };
    let sched = Scheduler::spawn(engine, cfg)?;
    tracing::info!("scheduler: {:?}", sched.config());
    let state = AppState::new(
        sched,
        ServerConfig {
            model_id: model_id.clone(),
            api_key: a.api_key.clone(),
            max_body_bytes: a.max_body_bytes,
        },
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!(
            "ferrite serve: model `{model_id}` on http://{local}/v1 (api key {})",
            if a.api_key.is_some() {
                "required"
            } else {
                "off"
            }
        );
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("ferrite serve: shutting down");
        };
        ferrite_server::serve(listener, state, shutdown).await
    })
}
