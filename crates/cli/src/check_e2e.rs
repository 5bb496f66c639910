//! End-to-end gates for an accelerated backend, run by `ferrite check` after the op cases:
//! whole models on the backend under test against the CPU reference and against Hugging Face
//! transformers' logits (the committed oracle checkpoints), and the prefill/decode gate on
//! the backend under test (its decode step graph-captured and replayed).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ferrite_backend::cpu::CpuBackend;
use ferrite_backend::{Backend, SeqRows};
use ferrite_engine::sampler::argmax;
use ferrite_engine::speculative::{
    plain_greedy, speculative_greedy, Drafter, MtpDrafter, ScriptedDrafter, MAX_DEPTH,
};
use ferrite_engine::{Batch, BatchConfig};
use ferrite_models::{Logits, Model, ModelFile};

use crate::synth::{self, Preset, SynthArgs, SynthQuant};

/// Backend vs CPU logits of a whole model. The CUDA backend feeds the tensor cores bf16
/// activations at prefill (8 significant bits: ~4e-3 relative rounding per element) and
/// keeps the KV cache in f16, while the CPU computes in f32; through a few layers that is
/// worth NMSE ~1e-6..1e-5 on these small random models. 1e-4 still fails any real error
/// (a wrong index or layout gives NMSE ≥ 1e-2).
const E2E_NMSE: f64 = 1e-4;

/// The argmax must agree wherever the reference's top-1/top-2 logit gap is at least this.
/// The bf16 prefill moves logits by up to ~3e-2 on these models (the gate prints the
/// largest prefill-vs-decode difference); random-weight models with a 151k vocabulary have
/// many positions with near-ties below that, where either answer is right within the
/// arithmetic's precision. 0.1 is 3× the largest observed noise.
const E2E_ARGMAX_MARGIN: f32 = 0.1;

/// (top-1 index, top-1 − top-2) of a row.
fn top2(v: &[f32]) -> (usize, f32) {
    let i = argmax(v) as usize;
    let second = v
        .iter()
        .enumerate()
        .filter(|&(j, _)| j != i)
        .map(|(_, &x)| x)
        .fold(f32::NEG_INFINITY, f32::max);
    (i, v[i] - second)
}

fn nmse(a: &[f32], reference: &[f32]) -> f64 {
    let mse: f64 = a
        .iter()
        .zip(reference)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let pow: f64 = reference.iter().map(|y| (*y as f64).powi(2)).sum();
    if pow == 0.0 {
        mse
    } else {
        mse / pow
    }
}

fn all_logits<B: Backend>(be: &B, file: &ModelFile, tokens: &[u32]) -> Result<(Vec<f32>, usize)> {
    let m = Model::load(be, file, &|_, _| {})?;
    Ok((logits_of(be, &m, tokens)?, m.cfg.vocab))
}

/// Every position's logits of `m` over `tokens`, from an empty cache.
fn logits_of<B: Backend>(be: &B, m: &Model<B>, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut kv = m.new_kv(be, tokens.len())?;
    let mut ws = m.workspace(be, tokens.len(), Logits::All)?;
    m.run(be, &mut ws, &mut kv, 0, tokens, Logits::All)
}

/// Tensor `name` of an oracle file as f32 values.
fn read_f32s(st: &safetensors::SafeTensors<'_>, name: &str) -> Result<Vec<f32>> {
    Ok(st
        .tensor(name)?
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

/// Token ids `name` of an oracle file (I64, or I32).
fn read_ids(st: &safetensors::SafeTensors<'_>, name: &str) -> Result<Vec<u32>> {
    let t = st.tensor(name)?;
    Ok(match t.dtype() {
        safetensors::Dtype::I64 => t
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
        _ => t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
    })
}

fn read_oracle(dir: &Path) -> Result<(Vec<u32>, Vec<f32>)> {
    read_oracle_file(&dir.join("oracle.safetensors"))
}

fn read_oracle_file(path: &Path) -> Result<(Vec<u32>, Vec<f32>)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    Ok((read_ids(&st, "tokens")?, read_f32s(&st, "logits")?))
}

/// One comparison's outcome, printed as a line.
struct Line {
    what: String,
    ok: bool,
    detail: String,
}

fn compare(what: String, test: &[f32], reference: &[f32], vocab: usize) -> Line {
    let e = nmse(test, reference);
    let finite = test.iter().all(|v| v.is_finite());
    let rows = reference.len() / vocab.max(1);
    let (mut agree, mut decisive, mut decisive_agree) = (0, 0, 0);
    for (a, b) in test.chunks(vocab).zip(reference.chunks(vocab)) {
        let (want, margin) = top2(b);
        let same = argmax(a) as usize == want;
        agree += usize::from(same);
        if margin >= E2E_ARGMAX_MARGIN {
            decisive += 1;
            decisive_agree += usize::from(same);
        }
    }
    let ok = finite && e < E2E_NMSE && decisive_agree == decisive;
    Line {
        what,
        ok,
        detail: format!(
            "NMSE {e:.2e} (< {E2E_NMSE:.0e}), argmax {agree}/{rows} ({decisive_agree}/{decisive} where margin >= {E2E_ARGMAX_MARGIN}){}",
            if finite { "" } else { ", NON-FINITE" }
        ),
    }
}

fn gate_line<B: Backend>(be: &B, m: &Model<B>, what: &str, prompt: &[u32]) -> Result<Line> {
    let g = ferrite_engine::gate(be, m, prompt)?;
    Ok(Line {
        what: format!("gate {what}"),
        ok: g.passed(),
        detail: g.describe(),
    })
}

/// Runs every end-to-end gate; returns the number of failures.
pub fn run<B: Backend>(be: &B, oracle_dir: &Path, scratch: &Path) -> Result<usize> {
    let cpu = CpuBackend::new();
    let mut lines = Vec::new();

    // 1. Hugging Face oracle checkpoints (safetensors, bf16 weights).
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(oracle_dir)
        .with_context(|| format!("reading {}", oracle_dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("oracle.safetensors").exists())
        .collect();
    dirs.sort();
    for dir in &dirs {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (tokens, oracle) = read_oracle(dir)?;
        let file = ModelFile::open(dir)?;
        let oracle = Some(("transformers", &oracle[..]));
        versus_cpu(be, &cpu, &file, &name, &tokens, oracle, &mut lines)?;
        if dir.join("mtp_oracle.safetensors").exists() {
            lines.extend(mtp_lines(be, &cpu, dir, &name, &file, &tokens)?);
        }
        if dir.join(LLAMA3_ORACLE).exists() {
            lines.extend(llama3_lines(be, &cpu, dir, &name, scratch)?);
        }
    }

    // 2. Synthetic GGUFs in llama.cpp's layout and quant mixes.
    std::fs::create_dir_all(scratch)?;
    for preset in [
        Preset::TinyLlama,
        Preset::TinyQwen3,
        Preset::TinyQwen3Moe,
        Preset::TinyQwen35,
        Preset::TinyQwen35Moe,
    ] {
        // The MoE presets also as llama.cpp's MXFP4_MOE (MXFP4 experts).
        let moe = matches!(preset, Preset::TinyQwen3Moe | Preset::TinyQwen35Moe);
        let mxfp4 = moe.then_some(SynthQuant::MXFP4_MOE);
        for quant in [SynthQuant::Q8_0, SynthQuant::F16, SynthQuant::Q4_K_M]
            .into_iter()
            .chain(mxfp4)
        {
            let path = scratch.join(format!("{preset:?}-{quant:?}.gguf"));
            synth::synth(&SynthArgs {
                preset,
                quant,
                output: path.clone(),
                vocab: None,
                seed: 1,
                layers: None,
                mtp: false,
            })?;
            let file = ModelFile::open(&path)?;
            let tokens: Vec<u32> = (0..40u32).map(|i| 100 + (i * 7919) % 5000).collect();
            let what = format!("{preset:?} {quant:?}");
            let (m, test) = versus_cpu(be, &cpu, &file, &what, &tokens, None, &mut lines)?;
            // Speculation's verify (several rows) against the decode step, every architecture
            // and quant mix: scripted drafts kept whole and in part.
            lines.extend(gate3_lines(
                be,
                &m,
                &what,
                &tokens[..8],
                &[(4, Some(4)), (4, Some(2))],
            )?);
            // Serve's batched steps (hybrid models: each sequence on its own state slot).
            lines.push(batch_line(be, &m, &what)?);
            drop(m);
            // Experts held in host memory (a model larger than the GPU): the same kernels
            // reading the same bytes across the bus, so the same logits, bit for bit.
            if moe && be.device_memory().is_some() {
                lines.extend(host_expert_lines(be, &file, &what, &tokens, &test)?);
            }
            // The types converted at load (q5_0, q3_K, iq4_nl to q8_0 / q6_K): the Q8_0 file
            // with its matrices stored in them, loaded through the conversion.
            if quant == SynthQuant::Q8_0 {
                let conv = scratch.join(format!("{preset:?}-converted.gguf"));
                let counts = synth::with_converted_types(&path, &conv, 1)?;
                let what = format!("{preset:?} q5_0/q3_K/iq4_nl {counts:?}");
                versus_cpu(
                    be,
                    &cpu,
                    &ModelFile::open(&conv)?,
                    &what,
                    &tokens,
                    None,
                    &mut lines,
                )?;
                std::fs::remove_file(&conv).ok();
            }
            std::fs::remove_file(&path).ok();
        }
    }

    // 3. Full-width cuts of the benchmark presets (their first layers at real dimensions):
    //    the tiny models' matrices are below the prefill matmul's size limits (the tensor-core
    //    GEMMs, the wgmma tiles and their grouped, mixed-type and fused launches never run on
    //    them), so a kernel wrong only at real widths passed everything above (MATMUL.md
    //    round 14). The gate at 32 prompt tokens (the short-prefill tiles) and 160 (the
    //    64 × 256 tile). Only where the backend has device memory: on the CPU backend it
    //    would compare the CPU with itself, for minutes.
    if be.device_memory().is_some() {
        lines.extend(full_width_gates(be, scratch)?);
    }

    let mut failed = 0;
    for l in &lines {
        println!(
            "{:<4} e2e  {:<52} {}",
            if l.ok { "OK" } else { "FAIL" },
            l.what,
            l.detail
        );
        failed += usize::from(!l.ok);
    }
    Ok(failed)
}

/// `file`'s logits on `tokens` from `be` against an oracle's (named; where there is one) and
/// the CPU's, and its prefill/decode gate: those lines into `lines`. The loaded model and its
/// logits, for the checks that follow.
fn versus_cpu<B: Backend>(
    be: &B,
    cpu: &CpuBackend,
    file: &ModelFile,
    what: &str,
    tokens: &[u32],
    oracle: Option<(&str, &[f32])>,
    lines: &mut Vec<Line>,
) -> Result<(Model<B>, Vec<f32>)> {
    let (test, vocab) = all_logits(be, file, tokens)?;
    let (reference, _) = all_logits(cpu, file, tokens)?;
    if let Some((oracle_name, oracle)) = oracle {
        lines.push(compare(
            format!("{what}: {} vs {oracle_name}", be.name()),
            &test,
            oracle,
            vocab,
        ));
    }
    lines.push(compare(
        format!("{what}: {} vs cpu", be.name()),
        &test,
        &reference,
        vocab,
    ));
    let m = Model::load(be, file, &|_, _| {})?;
    lines.push(gate_line(be, &m, what, tokens)?);
    Ok((m, test))
}

/// `file` loaded with every stacked expert in host memory (an expert budget of 0 bytes):
/// its logits on `tokens` must equal `in_vram`'s (the same load in device memory) exactly,
/// and its prefill/decode gate (the decode step graph-captured) must pass.
fn host_expert_lines<B: Backend>(
    be: &B,
    file: &ModelFile,
    what: &str,
    tokens: &[u32],
    in_vram: &[f32],
) -> Result<Vec<Line>> {
    let before = be.host_expert_bytes();
    be.set_expert_budget(Some(0));
    let run = || -> Result<(Vec<f32>, Line)> {
        let m = Model::load(be, file, &|_, _| {})?;
        let logits = logits_of(be, &m, tokens)?;
        let gate = gate_line(be, &m, &format!("{what}, experts in host memory"), tokens)?;
        Ok((logits, gate))
    };
    let result = run();
    be.set_expert_budget(None);
    let (logits, gate) = result?;
    let held = be.host_expert_bytes() - before;
    let differ = logits
        .iter()
        .zip(in_vram)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    let exact = Line {
        what: format!("{what}: experts in host memory vs in VRAM"),
        ok: held > 0 && differ == 0 && logits.len() == in_vram.len(),
        detail: format!(
            "{differ} of {} logits differ (want 0 bits); {:.1} MB of experts held in host memory",
            in_vram.len(),
            held as f64 / 1e6
        ),
    };
    Ok(vec![exact, gate])
}

/// The float64 oracle of an oracle checkpoint run with Llama 3.1's "llama3" RoPE scaling
/// (`llama3.json`, its `rope_parameters`; tools/oracle/llama3_oracle.py).
const LLAMA3_ORACLE: &str = "llama3_oracle.safetensors";

/// The checkpoint of `dir` with its `rope_parameters` replaced by `llama3.json` (written under
/// `scratch`), and that checkpoint as llama.cpp's converter writes it (its `rope_freqs.weight`
/// divisors, adjacent pairs): each on the backend against the float64 oracle and the CPU, and
/// the prefill/decode gate (the scaled rotation in a captured decode step).
fn llama3_lines<B: Backend>(
    be: &B,
    cpu: &CpuBackend,
    dir: &Path,
    name: &str,
    scratch: &Path,
) -> Result<Vec<Line>> {
    let (tokens, oracle) = read_oracle_file(&dir.join(LLAMA3_ORACLE))?;
    let scaled = scratch.join(format!("{name}-llama3"));
    std::fs::create_dir_all(&scaled)?;
    std::fs::copy(
        dir.join("model.safetensors"),
        scaled.join("model.safetensors"),
    )?;
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    config["rope_parameters"] = serde_json::from_slice(&std::fs::read(dir.join("llama3.json"))?)?;
    std::fs::write(scaled.join("config.json"), config.to_string())?;
    let gguf = scratch.join(format!("{name}-llama3.gguf"));
    ferrite_models::convert::hf_to_gguf(&scaled, &gguf)?;
    let mut lines = Vec::new();
    for (form, path) in [("safetensors", &scaled), ("GGUF", &gguf)] {
        let file = ModelFile::open(path)?;
        let what = format!("{name} llama3 RoPE ({form})");
        let oracle = Some(("oracle", &oracle[..]));
        versus_cpu(be, cpu, &file, &what, &tokens, oracle, &mut lines)?;
    }
    Ok(lines)
}

/// Greedy tokens gate 3 compares, plain against speculative.
const GATE3_TOKENS: usize = 32;

/// The MTP head of an oracle checkpoint that has one (`mtp.safetensors`, see
/// tools/oracle/mtp_oracle.py): its logits on the backend, fed transformers' hidden states,
/// against the float64 oracle and the CPU; then gate 3, speculation K = 1..=8 against plain
/// greedy decode on the backend, token for token.
fn mtp_lines<B: Backend>(
    be: &B,
    cpu: &CpuBackend,
    dir: &Path,
    name: &str,
    file: &ModelFile,
    tokens: &[u32],
) -> Result<Vec<Line>> {
    let bytes = std::fs::read(dir.join("mtp_oracle.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let (hidden_in, oracle) = (read_f32s(&st, "hidden_in")?, read_f32s(&st, "logits")?);
    let tokens_in = read_ids(&st, "tokens_in")?;
    fn with_head<B: Backend>(be: &B, file: &ModelFile) -> Result<Model<B>> {
        let mut m = Model::load(be, file, &|_, _| {})?;
        m.load_mtp(be, file)?;
        Ok(m)
    }
    fn head<B: Backend>(be: &B, m: &Model<B>, h: &[f32], t: &[u32]) -> Result<Vec<f32>> {
        let mut kv = m.new_kv(be, t.len())?;
        let mut ws = m.workspace(be, t.len(), Logits::All)?;
        let hidden = be.from_host(h, t.len(), m.cfg.hidden)?;
        be.set_step(&mut ws.step, t, 0)?;
        m.mtp_forward(be, &mut ws, &hidden, &mut kv, Logits::All)?;
        be.to_host(&ws.logits)
    }
    let m = with_head(be, file)?;
    let test = head(be, &m, &hidden_in, &tokens_in)?;
    let reference = head(cpu, &with_head(cpu, file)?, &hidden_in, &tokens_in)?;
    let vocab = oracle.len() / tokens_in.len().max(1);
    let mut lines = vec![
        compare(
            format!("{name} MTP head: {} vs oracle", be.name()),
            &test,
            &oracle,
            vocab,
        ),
        compare(
            format!("{name} MTP head: {} vs cpu", be.name()),
            &test,
            &reference,
            vocab,
        ),
    ];
    let prompt = &tokens[..tokens.len().min(8)];
    // The random-weight head's drafts (nearly all rejected: the rollback path), then a
    // scripted continuation accepted whole or in part (the accepting paths).
    let heads = (1..=MAX_DEPTH).map(|k| (k, None));
    let scripted = [(1, 1), (3, 3), (3, 1), (8, 8), (8, 5)].map(|(k, r)| (k, Some(r)));
    let runs: Vec<_> = heads.chain(scripted).collect();
    lines.extend(gate3_lines(be, &m, name, prompt, &runs)?);
    Ok(lines)
}

/// Gate 3 on `m` after `prompt`: for each run `(depth, right)`, greedy decode with
/// speculation `depth` deep — drafts from the MTP head (`right` = `None`) or scripted with
/// `right` of each step's drafts right (a loaded head still run for its cost) — must give
/// plain greedy decode's [`GATE3_TOKENS`] tokens.
fn gate3_lines<B: Backend>(
    be: &B,
    m: &Model<B>,
    what: &str,
    prompt: &[u32],
    runs: &[(usize, Option<usize>)],
) -> Result<Vec<Line>> {
    let truth = plain_greedy(be, m, prompt, GATE3_TOKENS + MAX_DEPTH)?;
    let want = &truth[..GATE3_TOKENS];
    let mut lines = Vec::new();
    for &(depth, right) in runs {
        let (how, mut drafter): (String, Box<dyn Drafter<B>>) = match right {
            None => ("MTP head".into(), Box::new(MtpDrafter)),
            Some(right) => (
                format!("{right} right a step"),
                Box::new(ScriptedDrafter {
                    truth: truth.clone(),
                    prompt_len: prompt.len(),
                    right,
                    vocab: m.cfg.vocab,
                    run_head: true,
                }),
            ),
        };
        let (got, _, st) = speculative_greedy(be, m, prompt, GATE3_TOKENS, depth, &mut *drafter)?;
        let first_diff = want.iter().zip(&got).position(|(a, b)| a != b);
        lines.push(Line {
            what: format!("gate3 {what} depth {depth}, {how}"),
            ok: got == want,
            detail: match first_diff {
                None => format!(
                    "{GATE3_TOKENS} tokens identical to greedy; {}/{} drafts accepted in {} steps",
                    st.accepted, st.drafted, st.steps
                ),
                Some(i) => format!(
                    "token {i} differs: greedy {} vs speculative {}",
                    want[i], got[i]
                ),
            },
        });
    }
    Ok(lines)
}

/// Tokens each sequence of [`batch_line`] leaves for its decode-only steps.
const BATCH_DECODE_TAIL: usize = 4;

/// Serve's batched steps ([`Batch`]: one paged cache for several sequences, prefill chunks
/// mixed with other sequences' single rows, chunks asking for all their rows' logits as a
/// prompt-lookup verify does, then decode-only steps, captured as a graph per batch size
/// where the backend has graphs): every logits row a step returns against the same position
/// of the sequence alone on the same backend (one prefill over a contiguous cache). On the
/// CPU bitwise equal (NMSE 0); on CUDA within the e2e tolerances (the alone prefill runs the
/// tensor-core GEMMs, the batched steps mostly the decode GEMVs).
fn batch_line<B: Backend>(be: &B, m: &Model<B>, what: &str) -> Result<Line> {
    const PAGE: usize = 16;
    const CHUNK: usize = 8;
    const SEVERAL: usize = 4;
    let lens = [21usize, 6, 35, 13];
    let seqs: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|p| 100 + ((i * 131 + p * 7919) % 5000) as u32)
                .collect()
        })
        .collect();
    let alone: Vec<Vec<f32>> = seqs
        .iter()
        .map(|toks| logits_of(be, m, toks))
        .collect::<Result<_>>()?;
    let vocab = m.cfg.vocab;
    let max_len = lens.iter().copied().max().unwrap_or(1);
    let n_pages: usize = lens.iter().map(|n| n.div_ceil(PAGE)).sum::<usize>() + 2;
    let mut batch = Batch::new(
        be,
        m,
        BatchConfig {
            n_pages,
            page_size: PAGE,
            max_pages: max_len.div_ceil(PAGE),
            max_seqs: seqs.len(),
            max_rows: seqs.len() * CHUNK,
            max_logits: seqs.len() * SEVERAL,
            state_snapshots: 0,
        },
    )?;
    // Sequence i continues state slot i (a hybrid model's linear-attention state); the
    // graph warm-up wrote there.
    for i in 0..seqs.len() {
        batch.clear_state(i)?;
    }
    let mut next_page = 0u32;
    let mut pages: Vec<Vec<u32>> = vec![vec![]; seqs.len()];
    let mut done = vec![0usize; seqs.len()];
    let (mut test, mut reference) = (Vec::new(), Vec::new());
    let (mut steps, mut mixed, mut several, mut decode_steps) = (0usize, 0, 0, 0);
    while done.iter().zip(&lens).any(|(d, n)| d < n) {
        // Mixed steps until every sequence is down to its tail, then decode only.
        let decode_only = done
            .iter()
            .zip(&lens)
            .all(|(d, n)| n - d <= BATCH_DECODE_TAIL);
        let mut plan = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let left = len - done[i];
            let (n, l) = if decode_only {
                if left == 0 {
                    continue;
                }
                (1, 1)
            } else {
                if left <= BATCH_DECODE_TAIL || (steps + i) % 4 == 3 {
                    continue;
                }
                let n = (1 + (steps * 5 + i * 3) % CHUNK).min(left - BATCH_DECODE_TAIL);
                // A lookup verify asks for every row's logits: its token and its drafts.
                let l = if n > 1 && n <= SEVERAL && (steps + i) % 3 == 0 {
                    n
                } else {
                    1
                };
                (n, l)
            };
            while pages[i].len() * PAGE < done[i] + n {
                pages[i].push(next_page);
                next_page += 1;
            }
            plan.push((i, n, l));
        }
        mixed += usize::from(plan.iter().any(|p| p.1 > 1) && plan.iter().any(|p| p.1 == 1));
        several += plan.iter().filter(|p| p.2 > 1).count();
        decode_steps += usize::from(decode_only);
        let rows: Vec<SeqRows<'_>> = plan
            .iter()
            .map(|&(i, n, l)| SeqRows {
                tokens: &seqs[i][done[i]..done[i] + n],
                pos0: done[i],
                pages: &pages[i],
                logits: l,
                state: i,
            })
            .collect();
        batch.step(&rows)?;
        for (k, &(i, n, l)) in plan.iter().enumerate() {
            let r = batch.rows_of(k)?;
            anyhow::ensure!(
                r.len() == l,
                "sequence {i}: {} logits rows, {l} asked",
                r.len()
            );
            for (row, pos) in r.zip(done[i] + n - l..done[i] + n) {
                test.extend(batch.logits(row)?);
                reference.extend_from_slice(&alone[i][pos * vocab..(pos + 1) * vocab]);
            }
            done[i] += n;
        }
        steps += 1;
    }
    let mut line = compare(
        format!("batch {what}: {} steps vs alone", be.name()),
        &test,
        &reference,
        vocab,
    );
    line.ok &= mixed > 0 && several > 0 && decode_steps >= 3;
    line.detail = format!(
        "{}; {steps} steps ({mixed} mixed, {decode_steps} decode-only), {several} verify chunks",
        line.detail
    );
    Ok(line)
}

/// The prefill/decode gate on full-width cuts of the benchmark presets (section 3 of [`run`]).
fn full_width_gates<B: Backend>(be: &B, scratch: &Path) -> Result<Vec<Line>> {
    std::fs::create_dir_all(scratch)?;
    let mut lines = Vec::new();
    // Qwen3.5 keeps 4 layers: its first full-attention layer is the fourth.
    for (preset, layers) in [
        (Preset::Qwen3_8B, 2),
        (Preset::Qwen3_30B_A3B, 2),
        (Preset::Qwen35_9B, 4),
    ] {
        let path = scratch.join(format!("{preset:?}-cut{layers}.gguf"));
        synth::synth(&SynthArgs {
            preset,
            quant: SynthQuant::Q4_K_M,
            output: path.clone(),
            vocab: None,
            seed: 1,
            layers: Some(layers),
            mtp: false,
        })?;
        let file = ModelFile::open(&path)?;
        let m = Model::load(be, &file, &|_, _| {})?;
        for n in [32u32, 160] {
            let tokens: Vec<u32> = (0..n).map(|i| 100 + (i * 7919) % 5000).collect();
            let what = format!("{preset:?} {layers} layers Q4_K_M, {n} tokens");
            lines.push(gate_line(be, &m, &what, &tokens)?);
        }
        // Speculation's verify rows at real widths against the decode step.
        let prompt: Vec<u32> = (0..8u32).map(|i| 100 + (i * 7919) % 5000).collect();
        let what = format!("{preset:?} {layers} layers Q4_K_M");
        lines.extend(gate3_lines(
            be,
            &m,
            &what,
            &prompt,
            &[(4, Some(4)), (4, Some(2))],
        )?);
        drop(m);
        std::fs::remove_file(&path).ok();
    }
    Ok(lines)
}
