//! One sequence, start to finish: prompt prefill, token-by-token decode, sampling, stop
//! conditions, streaming text out. Also the prefill/decode argmax gate.

use std::time::Instant;

use anyhow::{ensure, Result};
use ferrite_backend::Backend;
use ferrite_models::{Logits, Model};
use ferrite_tokenizer::{IncrementalDecoder, Tokenizer};

use crate::sampler::{argmax, Sampler, SamplerConfig, StopCheck, StopChecker};

/// A model, the backend it lives on, and its tokenizer.
pub struct Engine<B: Backend> {
    pub be: B,
    pub model: Model<B>,
    pub tok: Tokenizer,
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation ends before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Context length to allocate; `None` = prompt + max_tokens, capped at the model's.
    pub context: Option<usize>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            sampler: SamplerConfig::greedy(),
            stop: vec![],
            ignore_eos: false,
            context: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` (or the context) ran out.
    Length,
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated token ids (the end-of-generation token included, if one ended it).
    pub tokens: Vec<u32>,
    /// Generated text, stop string and end token excluded.
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Seconds spent on the prompt (one batched forward) and on the decode steps.
    pub prefill_s: f64,
    pub decode_s: f64,
}

impl Generation {
    /// Decode speed in tokens/s (steps after the first token, which prefill produced).
    pub fn decode_tps(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        if self.decode_s > 0.0 {
            steps as f64 / self.decode_s
        } else {
            0.0
        }
    }
    pub fn prefill_tps(&self) -> f64 {
        if self.prefill_s > 0.0 {
            self.prompt_tokens as f64 / self.prefill_s
        } else {
            0.0
        }
    }
}

/// Outcome of the prefill/decode gate.
#[derive(Clone, Copy, Debug)]
pub struct GateResult {
    pub prefill_argmax: u32,
    pub decode_argmax: u32,
    /// Largest absolute difference between the two last-position logit vectors.
    pub max_abs_diff: f32,
}

impl GateResult {
    pub fn passed(&self) -> bool {
        self.prefill_argmax == self.decode_argmax
    }
}

impl<B: Backend> Engine<B> {
    /// Context length for a prompt of `n` tokens.
    fn context_for(&self, n: usize, p: &GenerateParams) -> Result<usize> {
        let max = self.model.cfg.max_ctx;
        let ctx = p.context.unwrap_or_else(|| (n + p.max_tokens).min(max));
        ensure!(n > 0, "the prompt is empty");
        ensure!(
            n < ctx,
            "the prompt is {n} tokens but the context is {ctx} tokens (the model supports {max}); shorten the prompt"
        );
        Ok(ctx)
    }

    /// The gate: the argmax of the last position after one batched prefill must equal the
    /// argmax after feeding the same prompt one token at a time.
    pub fn gate(&self, prompt: &[u32]) -> Result<GateResult> {
        let (be, m) = (&self.be, &self.model);
        let ctx = prompt.len();
        let mut kv = m.new_kv(be, ctx)?;
        let pre = be.to_host(&m.forward(be, &mut kv, 0, prompt, Logits::Last)?)?;
        let mut kv = m.new_kv(be, ctx)?;
        let mut dec = Vec::new();
        for (i, &t) in prompt.iter().enumerate() {
            dec = be.to_host(&m.forward(be, &mut kv, i, &[t], Logits::Last)?)?;
        }
        let max_abs_diff = pre
            .iter()
            .zip(&dec)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        Ok(GateResult {
            prefill_argmax: argmax(&pre),
            decode_argmax: argmax(&dec),
            max_abs_diff,
        })
    }

    /// Generates from `prompt`, calling `on_text` with each new piece of text as soon as it
    /// is final (never broken UTF-8, never part of a stop string).
    pub fn generate(
        &self,
        prompt: &[u32],
        p: &GenerateParams,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        let (be, m) = (&self.be, &self.model);
        let ctx = self.context_for(prompt.len(), p)?;
        let mut kv = m.new_kv(be, ctx)?;
        let mut sampler = Sampler::new(p.sampler.clone(), m.cfg.vocab);
        let mut stops = StopChecker::new(p.stop.iter().cloned());
        let mut detok = IncrementalDecoder::new(true);
        let eos = self.tok.eos_ids();

        let mut history: Vec<u32> = prompt.to_vec();
        let mut out = Generation {
            tokens: vec![],
            text: String::new(),
            finish: FinishReason::Length,
            prompt_tokens: prompt.len(),
            prefill_s: 0.0,
            decode_s: 0.0,
        };
        let mut text = String::new();
        let mut emitted = 0;

        let t0 = Instant::now();
        let mut logits = be.to_host(&m.forward(be, &mut kv, 0, prompt, Logits::Last)?)?;
        out.prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut pos = prompt.len();
        while out.tokens.len() < p.max_tokens {
            let tok = sampler.sample(&mut logits, &history);
            out.tokens.push(tok);
            history.push(tok);
            if !p.ignore_eos && eos.contains(&tok) {
                out.finish = FinishReason::Stop;
                break;
            }
            text.push_str(&detok.push(&self.tok, tok));
            match stops.check(&text) {
                StopCheck::Stop { len, .. } => {
                    text.truncate(len);
                    out.finish = FinishReason::Stop;
                    break;
                }
                StopCheck::Continue { safe_len } => {
                    if safe_len > emitted {
                        on_text(&text[emitted..safe_len]);
                        emitted = safe_len;
                    }
                }
            }
            if out.tokens.len() >= p.max_tokens || pos + 1 >= ctx {
                break;
            }
            logits = be.to_host(&m.forward(be, &mut kv, pos, &[tok], Logits::Last)?)?;
            pos += 1;
        }
        out.decode_s = t1.elapsed().as_secs_f64();
        if out.finish == FinishReason::Length {
            text.push_str(&detok.flush());
            if let StopCheck::Stop { len, .. } = stops.check(&text) {
                text.truncate(len);
            }
        }
        if text.len() > emitted {
            on_text(&text[emitted..]);
        }
        out.text = text;
        Ok(out)
    }
}
