//! Kernel compilation: `.cu` sources embedded in the binary, compiled at first use by NVRTC
//! for the device's exact architecture (`compute_90a` on Hopper, so wgmma/TMA are available),
//! cached on disk by (source hash, architecture, options, NVRTC version).
//!
//! Machine code: on the device the modules are compiled straight to a CUBIN for its exact
//! architecture (`sm_90a`), cached the same way, and loaded as is. PTX would make the
//! driver run ptxas again at every first load on a machine (matmul.cu's 44 MB of PTX: ~40 s),
//! and a CUBIN cache made on one machine serves another with the same NVRTC. The PTX path
//! stays as the fallback (and for `compile_all`, the compile check without a GPU).
//!
//! NVRTC needs the CUDA headers (`cuda_bf16.h`, `cuda_fp16.h`, ...). They are found through
//! `CUDA_HOME` / `CUDA_PATH`, then `/usr/local/cuda/include`, then the `nvidia/*/include`
//! directories of pip's CUDA wheels; the error names every path tried.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

/// Directories that may hold the CUDA headers, in search order.
fn include_candidates() -> Vec<PathBuf> {
    let mut c = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            c.push(PathBuf::from(v).join("include"));
        }
    }
    c.push(PathBuf::from("/usr/local/cuda/include"));
    // pip wheels: <site-packages>/nvidia/{cu13,cuda_runtime,...}/include
    if let Ok(out) = std::process::Command::new("python3")
        .args(["-c", "import site,sys; print('\\n'.join(site.getsitepackages()+[site.getusersitepackages()]))"])
        .output()
    {
        for sp in String::from_utf8_lossy(&out.stdout).lines() {
            let nv = Path::new(sp).join("nvidia");
            if let Ok(rd) = std::fs::read_dir(&nv) {
                let mut dirs: Vec<PathBuf> = rd.flatten().map(|e| e.path().join("include")).collect();
                dirs.sort();
                c.extend(dirs);
            }
        }
    }
    c
}

/// The include directory that holds `cuda_bf16.h`.
pub fn cuda_include_dir() -> Result<PathBuf> {
    let cands = include_candidates();
    for d in &cands {
        if d.join("cuda_bf16.h").exists() {
            return Ok(d.clone());
        }
    }
    bail!(
        "CUDA headers (cuda_bf16.h) not found; NVRTC needs them. Set CUDA_HOME to a CUDA toolkit. Tried: {}",
        cands.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

/// NVRTC's architecture name for a compute capability: `compute_90a` on Hopper (the `a`
/// unlocks wgmma and TMA), `compute_XY` elsewhere.
pub fn arch_for(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (9, 0) => "compute_90a",
        (10, 0) => "compute_100a",
        (8, 9) => "compute_89",
        (8, 6) => "compute_86",
        (8, 0) => "compute_80",
        (12, _) => "compute_120",
        _ => "compute_80",
    }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through valid pointers.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    anyhow::ensure!(
        r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS,
        "nvrtcVersion failed: {r:?}"
    );
    Ok((major, minor))
}

fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("FERRITE_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("ferrite")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/ferrite")))?;
    Some(base.join("kernels"))
}

/// Compiles one `.cu` source to PTX for `arch`, through the disk cache.
pub fn compile(name: &str, src: &str, arch: &'static str) -> Result<Ptx> {
    let include = cuda_include_dir()?;
    let options = vec![
        "--std=c++17".to_string(),
        "-default-device".to_string(),
        "-lineinfo".to_string(),
    ];
    let (major, minor) = nvrtc_version()?;
    let mut h = DefaultHasher::new();
    (src, arch, &options, major, minor).hash(&mut h);
    let key = format!("{name}-{arch}-{:016x}.ptx", h.finish());
    let cached = cache_dir().map(|d| d.join(&key));
    if let Some(p) = &cached {
        if let Ok(ptx) = std::fs::read_to_string(p) {
            return Ok(Ptx::from_src(ptx));
        }
    }
    let opts = CompileOptions {
        arch: Some(arch),
        include_paths: vec![include.display().to_string()],
        options,
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow::anyhow!(
                "NVRTC failed to compile {name}.cu for {arch}:\n{}",
                log.to_string_lossy()
            )
        }
        other => anyhow::anyhow!("NVRTC failed on {name}.cu: {other:?}"),
    })?;
    if let Some(p) = &cached {
        cache_store(p, ptx.to_src().as_bytes());
    }
    Ok(ptx)
}

/// Writes a compiled module into the disk cache (through a temporary file, so a concurrent
/// reader never sees half of it). A cache that cannot be written only costs a recompile
/// next time.
fn cache_store(path: &Path, bytes: &[u8]) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

/// The real architecture of an NVRTC virtual one: `compute_90a` → `sm_90a`.
pub fn sm_arch(arch: &str) -> String {
    arch.replacen("compute_", "sm_", 1)
}

/// Compiles one `.cu` source to a CUBIN for the real architecture of `arch`, through the
/// disk cache (key: source, architecture, options, NVRTC version, like [`compile`]). With
/// `ahead_of_load` the image is also kept in memory for the one load that follows
/// (a parallel start-up compile), which then takes it.
pub fn compile_cubin(
    name: &str,
    src: &str,
    arch: &'static str,
    ahead_of_load: bool,
) -> Result<Vec<u8>> {
    let include = cuda_include_dir()?;
    let sm = sm_arch(arch);
    let options = vec![
        "--std=c++17".to_string(),
        "-default-device".to_string(),
        // No -lineinfo here: it triples the machine code (matmul 12 → 38 MB). For source
        // views in a profiler, FERRITE_KERNEL_PTX=1 loads the PTX, which carries it.
        format!("-arch={sm}"),
        format!("-I{}", include.display()),
    ];
    let (major, minor) = nvrtc_version()?;
    let mut h = DefaultHasher::new();
    // The include path is in the options but not in the key: the headers are the toolkit's.
    (src, arch, &options[..3], major, minor, "cubin").hash(&mut h);
    let key = format!("{name}-{sm}-{:016x}.cubin", h.finish());
    // Images compiled ahead and not yet loaded: a start-up compiles every module in parallel
    // first (CudaBackend::new), then loads them one by one; the load takes its image from
    // here whether or not a disk cache exists.
    static AHEAD: std::sync::Mutex<Vec<(String, Vec<u8>)>> = std::sync::Mutex::new(Vec::new());
    if let Ok(mut ahead) = AHEAD.lock() {
        if let Some(i) = ahead.iter().position(|(k, _)| *k == key) {
            return Ok(ahead.swap_remove(i).1);
        }
    }
    let cached = cache_dir().map(|d| d.join(&key));
    let bin = match cached.as_ref().and_then(|p| std::fs::read(p).ok()) {
        Some(bin) if !bin.is_empty() => bin,
        _ => {
            tracing::info!("compiling the {name} CUDA kernels for {sm} (once per machine: cached)");
            let bin = nvrtc_cubin(name, src, &options)?;
            if let Some(p) = &cached {
                cache_store(p, &bin);
            }
            bin
        }
    };
    if ahead_of_load {
        if let Ok(mut ahead) = AHEAD.lock() {
            ahead.push((key, bin.clone()));
        }
    }
    Ok(bin)
}

/// One NVRTC compilation to a CUBIN (cudarc's safe API stops at PTX).
fn nvrtc_cubin(name: &str, src: &str, options: &[String]) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let src_c = std::ffi::CString::new(src).context("kernel source holds a NUL byte")?;
    let name_c = std::ffi::CString::new(format!("{name}.cu"))?;
    let prog = result::create_program(&src_c, Some(&name_c))
        .map_err(|e| anyhow::anyhow!("NVRTC: creating the {name} program: {e:?}"))?;
    // SAFETY: `prog` was created above and is destroyed once, at the end; the buffers handed
    // to NVRTC are sized by the size queries before them.
    let out = unsafe {
        let compiled = result::compile_program(prog, options);
        let out = match compiled {
            Err(_) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes)
                            .trim_end_matches('\0')
                            .to_string()
                    })
                    .unwrap_or_default();
                Err(anyhow::anyhow!("NVRTC failed to compile {name}.cu:\n{log}"))
            }
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| anyhow::anyhow!("NVRTC: no CUBIN for {name}.cu ({e:?})"))?;
                let mut bin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut std::ffi::c_char)
                    .result()
                    .map_err(|e| anyhow::anyhow!("NVRTC: reading the {name}.cu CUBIN: {e:?}"))?;
                Ok(bin)
            }
        };
        let _ = result::destroy_program(prog);
        out
    };
    out
}
