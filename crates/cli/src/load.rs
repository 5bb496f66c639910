//! Loading a model onto a backend, with progress on stderr.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use ferrite_backend::cuda::CudaBackend;
use ferrite_backend::Backend;
use ferrite_engine::Engine;
use ferrite_models::{Model, ModelFile};
use ferrite_tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};

use crate::{Device, ModelArgs};

/// Sets the size of the CPU thread pool (once per process; later calls are no-ops).
pub fn init_threads(threads: Option<usize>) {
    if let Some(n) = threads {
        // Fails only if the pool was already built, which is harmless.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global();
    }
}

/// The tokenizer that belongs to a model file: GGUF metadata, or the checkpoint's
/// `tokenizer.json` (+ `tokenizer_config.json`). `None` when a checkpoint has none.
pub fn tokenizer_for(file: &ModelFile, path: &Path) -> Result<Option<Tokenizer>> {
    match file {
        ModelFile::Gguf(g) => Ok(Some(Tokenizer::from_gguf(g)?)),
        ModelFile::Safetensors(_) => {
            let dir = if path.is_dir() {
                path
            } else {
                path.parent().unwrap_or(Path::new("."))
            };
            let tj = dir.join("tokenizer.json");
            if !tj.exists() {
                return Ok(None);
            }
            let tc = dir.join("tokenizer_config.json");
            Ok(Some(Tokenizer::from_json_file(
                &tj,
                tc.exists().then_some(tc.as_path()),
            )?))
        }
    }
}

/// Which backend `--device` resolves to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda,
}

/// Resolves `--device`: `auto` takes the GPU when one is usable.
pub fn choose(device: Device) -> Result<DeviceChoice> {
    match device {
        Device::Cpu => Ok(DeviceChoice::Cpu),
        Device::Cuda => {
            anyhow::ensure!(
                CudaBackend::available(),
                "--device cuda: no CUDA device found (the CUDA driver library did not load or reports no GPU)"
            );
            Ok(DeviceChoice::Cuda)
        }
        Device::Auto => {
            if CudaBackend::available() {
                Ok(DeviceChoice::Cuda)
            } else {
                tracing::info!("no CUDA device found: running on the CPU");
                Ok(DeviceChoice::Cpu)
            }
        }
    }
}

/// Runs `$body` with `$be` bound to the backend `--device` picks (a concrete type in each
/// arm, so the body is compiled once per backend), set up as the [`crate::ModelArgs`] ask
/// (`--kv-cache-q8`).
#[macro_export]
macro_rules! on_backend {
    ($args:expr, $be:ident => $body:expr) => {{
        let args: &$crate::ModelArgs = $args;
        match $crate::load::choose(args.device)? {
            $crate::load::DeviceChoice::Cpu => {
                anyhow::ensure!(
                    !args.kv_cache_q8,
                    "--kv-cache-q8: the CPU backend keeps its KV cache in f32 (q8_0 caches are CUDA only)"
                );
                let $be = ferrite_backend::cpu::CpuBackend::new();
                $body
            }
            $crate::load::DeviceChoice::Cuda => {
                let $be = ferrite_backend::cuda::CudaBackend::new(0)?;
                if args.kv_cache_q8 {
                    $be.attention
                        .set_kv_type(ferrite_backend::cuda::attention::KvType::Q8_0);
                }
                $body
            }
        }
    }};
}

/// Opens the model file named by `args` (or the default model).
pub fn open(args: &ModelArgs) -> Result<(std::path::PathBuf, ModelFile)> {
    init_threads(args.threads);
    let path = crate::model_path(args.model.as_deref())?;
    let file = ModelFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    Ok((path, file))
}

/// GPU memory left free by default for what is not weights: the KV cache, activations,
/// CUDA graphs and workspaces (`--vram-weights` sets the weights' share directly). A run at
/// the default context takes well under a GiB of it; the rest is headroom for serving.
const VRAM_RESERVE_GIB: f64 = 6.0;

const GIB: f64 = (1u64 << 30) as f64;

/// A checkpoint's weights as the GPU holds them ([`ferrite_backend::cuda::ops::upload`]'s
/// types): bytes of stacked experts and of everything else. Counts every tensor in the file
/// at its stored (or converted) size, so a `--quantize` load, which shrinks the float
/// matrices, takes less than this.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuFootprint {
    pub experts: u64,
    pub dense: u64,
}

impl GpuFootprint {
    pub fn of(file: &ModelFile) -> GpuFootprint {
        let mut f = GpuFootprint::default();
        let mut add = |expert: bool, n: u64| {
            if expert {
                f.experts += n
            } else {
                f.dense += n
            }
        };
        match file {
            ModelFile::Gguf(g) => {
                for t in g.tensor_infos() {
                    let n: usize = t.shape.iter().product();
                    let held = ferrite_backend::cuda::ops::held_type(t.dtype, &t.shape)
                        .bytes_for(n)
                        .unwrap_or(t.n_bytes);
                    add(t.shape.len() == 3, held as u64);
                }
            }
            ModelFile::Safetensors(c) => {
                for t in c.tensor_infos() {
                    // Not counted: the MTP head (`mtp.*`, loaded only for speculation,
                    // after the model: its experts then go where the budget left says) and
                    // a vision tower (`visual.*`, not loaded).
                    if t.name.starts_with("mtp.") || t.name.contains("visual.") {
                        continue;
                    }
                    let n: usize = t.shape.iter().product();
                    let held = if let Some(m) = c.converted_elements(&t.name) {
                        2 * m // BF16
                    } else if t.shape.len() == 1 {
                        4 * n
                    } else if let Some(g) = t.ggml {
                        g.bytes_for(n).unwrap_or(0)
                    } else {
                        c.raw_tensor(&t.name).map_or(0, |(_, b)| b.len())
                    };
                    // Checkpoints store experts one matrix each (`mlp.experts.E.gate_proj`)
                    // or stacked (`mlp.experts.gate_up_proj`); the loader stacks them either
                    // way. By name: other tensors are 3-D too (Qwen3.5's conv taps).
                    add(t.name.contains(".experts."), held as u64);
                }
            }
        }
        f
    }
}

/// How many bytes of stacked experts may go to the GPU when its weights may take `budget`
/// bytes: `None` when everything fits (no limit), else what the dense weights leave (0 when
/// they take it all: every expert in host memory, the dense weights tried as they are).
pub fn expert_budget(budget: u64, f: GpuFootprint) -> Option<u64> {
    if f.dense.saturating_add(f.experts) <= budget || f.experts == 0 {
        None
    } else {
        Some(budget.saturating_sub(f.dense))
    }
}

/// Sets the backend's expert budget for `file` ([`expert_budget`]) where the backend has
/// device memory, saying what it decided.
fn plan_experts<B: Backend>(be: &B, file: &ModelFile, vram_weights: Option<f64>) -> Result<()> {
    let Some((used, total)) = be.device_memory() else {
        anyhow::ensure!(
            vram_weights.is_none(),
            "--vram-weights: the CPU backend holds its weights in host memory (GPU only)"
        );
        return Ok(());
    };
    let budget = match vram_weights {
        Some(g) => {
            anyhow::ensure!(
                g.is_finite() && g >= 0.0,
                "--vram-weights {g}: expected a size in GiB, 0 or more"
            );
            (g * GIB) as u64
        }
        None => total
            .saturating_sub(used)
            .saturating_sub((VRAM_RESERVE_GIB * GIB) as u64),
    };
    let f = GpuFootprint::of(file);
    let limit = expert_budget(budget, f);
    be.set_expert_budget(limit);
    if let Some(limit) = limit {
        // The experts past the budget are pinned: warn now, before the load has spent its
        // time, where the host lacks the memory (a machine whose memory grows on demand may
        // report less than it can give: a warning, not a refusal).
        let pinned = f.experts.saturating_sub(limit);
        let available = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| mem_available(&m));
        if let Some(avail) = available.filter(|&a| a < pinned) {
            tracing::warn!(
                "~{:.2} GiB of experts are to be pinned in host memory, and the host reports \
                 {:.2} GiB available: the load may fail when pinning",
                pinned as f64 / GIB,
                avail as f64 / GIB
            );
        }
    }
    if f.dense.saturating_add(f.experts) > budget {
        let what = if f.experts == 0 {
            "a dense model's weights all go to the GPU; the load may run out of memory"
        } else if f.dense > budget {
            "every expert will be held in host memory (the dense weights go to the GPU \
             regardless)"
        } else {
            "the experts that do not fit are held in pinned host memory and read over the bus"
        };
        tracing::warn!(
            "the weights take ~{:.2} GiB on the GPU ({:.2} GiB of them experts), more than the \
             {:.2} GiB {}: {what}",
            (f.dense + f.experts) as f64 / GIB,
            f.experts as f64 / GIB,
            budget as f64 / GIB,
            if vram_weights.is_some() {
                "--vram-weights allows"
            } else {
                "free for them (the free memory less the reserve for the KV cache)"
            },
        );
    }
    Ok(())
}

/// `MemAvailable` of a /proc/meminfo text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Uploads the weights with a progress bar (shown only on a terminal, for models that take
/// a moment), experts past the GPU's room in host memory ([`plan_experts`]).
pub fn model<B: Backend>(be: &B, file: &ModelFile, args: &ModelArgs) -> Result<Model<B>> {
    let quantize = args.quantize;
    let t0 = Instant::now();
    plan_experts(be, file, args.vram_weights)?;
    if let ModelFile::Safetensors(c) = file {
        let mut forms = std::collections::BTreeMap::new();
        for t in c.tensor_infos() {
            if let Some(f) = c.quantized_form(&t.name) {
                *forms.entry(f.name()).or_insert(0usize) += 1;
            }
        }
        for (what, n) in forms {
            tracing::info!("{n} {what} weights: converted to BF16 as they load");
        }
    }
    if let ModelFile::Gguf(g) = file {
        // Stored in a type converted at load: say so, with what it costs in memory.
        let mut conv = std::collections::BTreeMap::new();
        for t in g.tensor_infos() {
            if let Some(from) = t.converted_from {
                let e = conv
                    .entry((from.name(), t.dtype.name()))
                    .or_insert((0, 0, 0));
                e.0 += 1;
                e.1 += t.n_bytes;
                e.2 += t.dtype.bytes_for(t.n_elements()).unwrap_or(0);
            }
        }
        for ((from, to), (n, stored, held)) in conv {
            tracing::info!(
                "{n} {from} tensors: converted to {to} as they load (the same values; {:.1} MiB \
                 stored, {:.1} MiB held)",
                stored as f64 / (1u64 << 20) as f64,
                held as f64 / (1u64 << 20) as f64
            );
        }
    }
    if let (ModelFile::Gguf(g), Some(_)) = (file, be.device_memory()) {
        let mut held = std::collections::BTreeMap::new();
        for t in g.tensor_infos() {
            let d = ferrite_backend::cuda::ops::device_type(t.dtype);
            if d != t.dtype {
                let (ty, d) = (t.dtype.name().to_uppercase(), d.name().to_uppercase());
                *held.entry((ty, d)).or_insert(0usize) += 1;
            }
        }
        for ((ty, d), n) in held {
            tracing::info!(
                "{n} {ty} tensors: held on the GPU as {d} (the same values; no {ty} kernels yet)"
            );
        }
    }
    let bar = ProgressBar::hidden();
    if let Some(q) = quantize {
        tracing::info!(
            "quantizing float matrices to {} as they load",
            q.mix().name()
        );
    }
    let model = Model::load_quantized(
        be,
        file,
        &|done, total| {
            if done == 1 && total > 4 {
                bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
                bar.set_length(total as u64);
                bar.set_style(
                    ProgressStyle::with_template("loading {bar:40} {pos}/{len} layers {elapsed}")
                        .expect("valid template"),
                );
            }
            bar.set_position(done as u64);
        },
        quantize.map(crate::Quantize::mix),
    )
    .with_context(|| match be.device_memory() {
        Some((used, total)) => {
            let f = GpuFootprint::of(file);
            format!(
                "loading the weights onto {} ({:.2} GiB free now of {:.2}; the model's weights \
                 take ~{:.2} GiB on a GPU, {:.2} of them routed experts, which --vram-weights \
                 can hold in host memory)",
                be.name(),
                total.saturating_sub(used) as f64 / GIB,
                total as f64 / GIB,
                (f.dense + f.experts) as f64 / GIB,
                f.experts as f64 / GIB
            )
        }
        None => format!("loading the weights onto {}", be.name()),
    })?;
    bar.finish_and_clear();
    let host = be.host_expert_bytes();
    if host > 0 {
        tracing::info!(
            "{:.2} GiB of experts held in host memory: the GPU reads them over its bus, so \
             steps that route to them are bound by it",
            host as f64 / GIB,
        );
    }
    if let Some((used, total)) = be.device_memory() {
        tracing::info!(
            "device memory: {:.2} GiB used of {:.2} GiB",
            used as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        );
    }
    tracing::info!(
        "loaded {:?} model ({} layers, hidden {}) on {} in {:.2}s",
        model.cfg.arch,
        model.cfg.n_layers,
        model.cfg.hidden,
        be.name(),
        t0.elapsed().as_secs_f64()
    );
    Ok(model)
}

/// Model + tokenizer on backend `be`.
pub fn engine<B: Backend>(be: B, args: &ModelArgs) -> Result<Engine<B>> {
    engine_with(be, args, false)
}

/// [`engine`], with the model's MTP head loaded too when `mtp` (speculative decoding).
pub fn engine_with<B: Backend>(be: B, args: &ModelArgs, mtp: bool) -> Result<Engine<B>> {
    let (path, file) = open(args)?;
    let tok = tokenizer_for(&file, &path)?
        .with_context(|| format!("{} has no tokenizer (tokenizer.json)", path.display()))?;
    let mut model = model(&be, &file, args)?;
    if mtp {
        model.load_mtp(&be, &file)?;
        tracing::info!("loaded the MTP head for speculative decoding");
    }
    Ok(Engine { be, model, tok })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oracle(name: &str) -> ModelFile {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle");
        ModelFile::open(&dir.join(name)).unwrap()
    }

    /// The oracle checkpoints store experts one matrix each (`mlp.experts.E.*`); the
    /// footprint counts them as experts at BF16's 2 bytes, the shared expert as dense, and
    /// the MTP head (`mtp.safetensors`, loaded only for speculation) not at all.
    #[test]
    fn footprint_splits_experts_from_the_rest() {
        let dense = GpuFootprint::of(&oracle("qwen3-tiny"));
        assert_eq!(dense.experts, 0);
        assert!(dense.dense > 0);
        for moe in ["qwen3-moe-tiny", "qwen35-moe-tiny"] {
            let f = GpuFootprint::of(&oracle(moe));
            let ModelFile::Safetensors(c) = oracle(moe) else {
                unreachable!()
            };
            let experts: u64 = c
                .tensor_infos()
                .iter()
                .filter(|t| t.name.contains(".experts.") && !t.name.starts_with("mtp."))
                .map(|t| 2 * t.shape.iter().product::<usize>() as u64)
                .sum();
            assert!(experts > 0, "{moe}");
            assert_eq!(f.experts, experts, "{moe}");
            assert!(f.dense > 0, "{moe}");
        }
    }

    /// A GGUF's stacked experts (3-D `ffn_*_exps`) are what the loader uploads as experts.
    #[test]
    fn footprint_of_a_gguf_matches_the_loaded_experts() {
        use crate::synth::{Preset, SynthArgs, SynthQuant};
        let path =
            std::env::temp_dir().join(format!("ferrite-footprint-{}.gguf", std::process::id()));
        crate::synth::synth(&SynthArgs {
            preset: Preset::TinyQwen3Moe,
            quant: SynthQuant::Q4_K_M,
            output: path.clone(),
            vocab: None,
            seed: 1,
            layers: None,
            mtp: false,
        })
        .unwrap();
        let file = ModelFile::open(&path).unwrap();
        let f = GpuFootprint::of(&file);
        let be = ferrite_backend::cpu::CpuBackend::new();
        let m = Model::load(&be, &file, &|_, _| {}).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(f.experts > 0);
        assert_eq!(f.experts, m.weight_bytes.experts);
        // The rest as the GPU holds it: norms widened to f32, so at least what the CPU load
        // counts.
        assert!(f.dense >= m.weight_bytes.other + m.weight_bytes.embed);
    }

    #[test]
    fn mem_available_reads_meminfo() {
        let m =
            "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   65536 kB\n";
        assert_eq!(mem_available(m), Some(65536 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn expert_budget_is_what_the_dense_weights_leave() {
        let f = GpuFootprint {
            experts: 100,
            dense: 30,
        };
        // Everything fits: no limit.
        assert_eq!(expert_budget(130, f), None);
        assert_eq!(expert_budget(1000, f), None);
        // Experts spill: what the dense weights leave.
        assert_eq!(expert_budget(129, f), Some(99));
        assert_eq!(expert_budget(30, f), Some(0));
        // The dense weights alone too large: every expert in host memory.
        assert_eq!(expert_budget(10, f), Some(0));
        // A dense model is never limited (nothing to move; the load reports its own error).
        let dense = GpuFootprint {
            experts: 0,
            dense: 30,
        };
        assert_eq!(expert_budget(10, dense), None);
    }
}
