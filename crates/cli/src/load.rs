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

/// Uploads the weights with a progress bar (shown only on a terminal, for models that take
/// a moment).
pub fn model<B: Backend>(
    be: &B,
    file: &ModelFile,
    quantize: Option<crate::Quantize>,
) -> Result<Model<B>> {
    let t0 = Instant::now();
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
    )?;
    bar.finish_and_clear();
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
    let mut model = model(&be, &file, args.quantize)?;
    if mtp {
        model.load_mtp(&be, &file)?;
        tracing::info!("loaded the MTP head for speculative decoding");
    }
    Ok(Engine { be, model, tok })
}
