//! Loading a model onto a backend, with progress on stderr.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ferrite_backend::cpu::CpuBackend;
use ferrite_engine::Engine;
use ferrite_models::{Model, ModelFile};
use ferrite_tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};

use crate::{Device, ModelArgs};

/// Sets the size of the CPU thread pool (once per process).
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

/// Picks the backend for `--device`.
pub fn cpu_backend(device: Device) -> Result<CpuBackend> {
    match device {
        Device::Auto | Device::Cpu => Ok(CpuBackend::new()),
        Device::Cuda => bail!("the CUDA backend is not part of this build yet; use --device cpu"),
    }
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
pub fn model<B: ferrite_backend::Backend>(be: &B, file: &ModelFile) -> Result<Model<B>> {
    let t0 = Instant::now();
    let bar = ProgressBar::hidden();
    let model = Model::load(be, file, &|done, total| {
        if done == 1 && total > 4 {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.set_length(total as u64);
            bar.set_style(
                ProgressStyle::with_template("loading {bar:40} {pos}/{len} layers {elapsed}")
                    .expect("valid template"),
            );
        }
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
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

/// Model + tokenizer on the chosen backend.
pub fn engine(args: &ModelArgs) -> Result<Engine<CpuBackend>> {
    let (path, file) = open(args)?;
    let tok = tokenizer_for(&file, &path)?
        .with_context(|| format!("{} has no tokenizer (tokenizer.json)", path.display()))?;
    let be = cpu_backend(args.device)?;
    let model = model(&be, &file)?;
    Ok(Engine { be, model, tok })
}
