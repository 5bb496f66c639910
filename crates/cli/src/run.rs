//! `ferrite run`: generate from a prompt.

use std::io::Write;

use anyhow::{Context, Result};
use clap::Args;
use ferrite_backend::Backend;
use ferrite_engine::{Engine, GenerateParams, SamplerConfig};
use ferrite_tokenizer::ChatMessage;

use crate::ModelArgs;

#[derive(Args, Debug)]
#[command(group = clap::ArgGroup::new("prompt_source").required(true))]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long, short = 'p', group = "prompt_source")]
    pub prompt: Option<String>,
    /// Read the prompt from this file (UTF-8; `-` reads standard input) instead of --prompt.
    /// One final newline is dropped (the one editors end a file with), as llama.cpp's -f does.
    #[arg(long, short = 'f', group = "prompt_source")]
    pub prompt_file: Option<std::path::PathBuf>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// The chat template's `enable_thinking` (with --chat; Qwen3's switch between thinking
    /// first and answering at once). Default: the template's own default.
    #[arg(long, requires = "chat")]
    pub enable_thinking: Option<bool>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy (the default: reproducible output).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Repetition penalty over the prompt and output so far (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    /// Random seed for sampling (default: random).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Skip the gates that run before generation: the prefill/decode argmax gate, and with
    /// speculation its own (a few greedy tokens with and without it must agree).
    #[arg(long)]
    pub no_gate: bool,
    /// Prompt tokens the prefill/decode gate checks: the prompt's first N (all of it when
    /// shorter). The gate decodes them one at a time besides one batched prefill, so over a
    /// whole long prompt it would cost as many decode steps as the prompt has tokens.
    #[arg(long, default_value_t = RUN_GATE_TOKENS, value_parser = clap::value_parser!(u32).range(1..))]
    pub gate_tokens: u32,
    /// Speculative decoding with the model's own multi-token-prediction head (Qwen3.5
    /// checkpoints' `mtp.*` tensors): draft K tokens a step with the head, verify them in one
    /// forward of the model, keep those it agrees with. Greedy output is the model's greedy
    /// output either way; with sampling (--temperature > 0) drafts are kept by speculative
    /// sampling, which leaves every token's distribution as plain sampling's. K trades draft
    /// work against tokens per verify (1 to 8; 0 = off). Not with --repeat-penalty.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8))]
    pub mtp_depth: u32,
    /// Speculative decoding with n-gram drafts from the prompt and the output so far (prompt
    /// lookup; any model, no extra weights): up to K drafts a step where the text's last few
    /// tokens occurred before, verified in one forward as with --mtp-depth; fast where the
    /// output repeats its input (code edits, quotes, lists), a plain step elsewhere (1 to 8;
    /// 0 = off). Not with --mtp-depth or --repeat-penalty.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8), conflicts_with = "mtp_depth")]
    pub lookup_depth: u32,
}

/// Greedy tokens `run`'s speculation gate compares (gate 3: with and without speculation).
const SPEC_GATE_TOKENS: usize = 8;

/// Prompt tokens `run`'s gate checks by default: enough rows for the prefill kernels (the
/// decode kernels take up to 16), few enough decode steps to cost little before generating.
pub const RUN_GATE_TOKENS: u32 = 64;

pub fn run(a: &RunArgs) -> Result<()> {
    crate::load::init_threads(a.model.threads);
    // Read and checked before the model loads: a missing prompt file or a parameter out of
    // range fails at once, not after a load of many gigabytes.
    let text = prompt_text(a)?;
    let params = params(a);
    params.validate()?;
    let mtp = params.mtp_depth > 0;
    crate::on_backend!(&a.model, be => run_on(crate::load::engine_with(be, &a.model, mtp)?, a, &text, &params))
}

/// What `run` asks the engine to generate.
fn params(a: &RunArgs) -> GenerateParams {
    GenerateParams {
        max_tokens: a.max_tokens,
        sampler: SamplerConfig {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            min_p: a.min_p,
            repetition_penalty: a.repeat_penalty,
            seed: a.seed,
            ..SamplerConfig::default()
        },
        stop: a.stop.clone(),
        mtp_depth: a.mtp_depth as usize,
        lookup_depth: a.lookup_depth as usize,
        ..GenerateParams::default()
    }
}

/// The prompt: --prompt's text, or --prompt-file's contents (`-`: standard input).
fn prompt_text(a: &RunArgs) -> Result<String> {
    let path = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => return Ok(p.clone()),
        (None, Some(path)) => path,
        (None, None) => anyhow::bail!("give the prompt with --prompt or --prompt-file"),
    };
    let stdin = path.as_os_str() == "-";
    let source = if stdin {
        "standard input".to_string()
    } else {
        format!("the prompt file {}", path.display())
    };
    let bytes = if stdin {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut b).map(|_| b)
    } else {
        std::fs::read(path)
    }
    .with_context(|| format!("reading {source}"))?;
    let mut text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{source} is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

fn run_on<B: Backend>(
    engine: Engine<B>,
    a: &RunArgs,
    text: &str,
    params: &GenerateParams,
) -> Result<()> {
    let tok = &engine.tok;
    let prompt = if a.chat {
        let tmpl = tok
            .compile_chat_template()?
            .context("this model has no chat template; drop --chat")?;
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage::new("system", s.as_str()));
        }
        msgs.push(ChatMessage::new("user", text));
        let mut opts = tok.render_options(true);
        opts.enable_thinking = a.enable_thinking;
        let text = tmpl.render(&msgs, &opts)?;
        // The rendered template already holds every special token it wants.
        tok.encode(&text, false, true)?
    } else {
        tok.encode(text, true, false)?
    };
    tracing::info!("prompt: {} tokens", prompt.len());

    // A prompt the context cannot hold fails here, before the gate's work.
    engine.context_for(prompt.len(), params)?;

    if !a.no_gate {
        let n = prompt.len().min(a.gate_tokens as usize);
        let g = engine.gate(&prompt[..n])?;
        anyhow::ensure!(g.passed(), "prefill/decode gate FAILED: {}", g.describe());
        tracing::info!(
            "prefill/decode gate passed on {n} of {} prompt tokens (argmax {}, max |Δlogit| {:.3e})",
            prompt.len(),
            g.prefill_argmax,
            g.max_abs_diff
        );
    }

    // Gate 3 on the same prompt: a short greedy run with the speculation asked for must give
    // plain greedy decode's tokens (on a GPU the verify's several rows and the decode step
    // take different kernels).
    if let (false, Some((depth, _, mut drafter))) = (a.no_gate, params.speculation::<B>()) {
        use ferrite_engine::speculative::{plain_greedy, speculative_greedy};
        let n = prompt.len().min(a.gate_tokens as usize);
        let (be, m) = (&engine.be, &engine.model);
        let plain = plain_greedy(be, m, &prompt[..n], SPEC_GATE_TOKENS)?;
        let (fast, _, st) =
            speculative_greedy(be, m, &prompt[..n], SPEC_GATE_TOKENS, depth, &mut *drafter)?;
        anyhow::ensure!(
            fast == plain,
            "speculation gate FAILED: greedy decode with speculation {depth} deep gave {fast:?} \
             where plain greedy decode gives {plain:?}"
        );
        tracing::info!(
            "speculation gate passed: {SPEC_GATE_TOKENS} greedy tokens identical with \
             speculation {depth} deep ({}/{} drafts kept)",
            st.accepted,
            st.drafted
        );
    }

    let mut stdout = std::io::stdout().lock();
    let g = engine.generate(&prompt, params, &mut |s| {
        // A closed pipe is the reader's choice; stop writing but finish cleanly.
        let _ = stdout.write_all(s.as_bytes()).and_then(|_| stdout.flush());
    })?;
    let _ = writeln!(stdout);
    tracing::info!(
        "{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s, finish: {:?}",
        g.prompt_tokens,
        g.prefill_tps(),
        g.tokens.len(),
        g.decode_tps(),
        g.finish
    );
    if let (Some(st), Some((depth, what, _))) = (g.spec, params.speculation::<B>()) {
        tracing::info!(
            "{what} speculation, depth {depth}: {}/{} drafts accepted ({:.0}%), {:.2} tokens per verify step",
            st.accepted,
            st.drafted,
            100.0 * st.acceptance(),
            st.tokens_per_step()
        );
    }
    tracing::debug!("generated ids: {:?}", g.tokens);
    Ok(())
}
