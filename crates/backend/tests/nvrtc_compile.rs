//! Every CUDA kernel compiles with NVRTC for Hopper (compute_90a) and Ampere (compute_80), and
//! to Hopper machine code (sm_90a CUBIN).
//! Needs only the NVRTC library and CUDA headers, not a GPU; skipped (with a note) where
//! NVRTC is not installed, as on CI machines.

use ferrite_backend::cuda;

fn nvrtc_present() -> bool {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let ok = std::panic::catch_unwind(|| cuda::nvrtc::nvrtc_version().is_ok()).unwrap_or(false);
    std::panic::set_hook(hook);
    ok && cuda::nvrtc::cuda_include_dir().is_ok()
}

#[test]
fn kernels_compile() {
    if !nvrtc_present() {
        eprintln!("skipped: NVRTC or the CUDA headers are not installed here");
        return;
    }
    // `FERRITE_NVRTC_ONLY=mmw,moe` (tools/h200/kernel_cache.sh MODULE...): only those modules'
    // sm_90a CUBINs, to refresh a kernel cache after a change to a few files.
    if let Ok(only) = std::env::var("FERRITE_NVRTC_ONLY") {
        let only: Vec<&str> = only.split(',').map(str::trim).collect();
        for (name, src) in cuda::sources() {
            if only.contains(&name) {
                let cubin = cuda::nvrtc::compile_cubin(
                    name,
                    &cuda::full_source(name, src),
                    "compute_90a",
                    false,
                )
                .unwrap_or_else(|e| panic!("sm_90a {name}: {e:#}"));
                println!("sm_90a {name}: {} bytes of CUBIN", cubin.len());
            }
        }
        return;
    }
    for arch in ["compute_90a", "compute_80"] {
        let out = cuda::compile_all(arch).unwrap_or_else(|e| panic!("{arch}: {e:#}"));
        for (name, bytes) in out {
            assert!(bytes > 0, "{name}: empty PTX");
            println!("{arch} {name}: {bytes} bytes of PTX");
        }
    }
    // The machine code a Hopper start-up loads (NVRTC runs ptxas here: register limits,
    // shared memory sizes and inline PTX are checked as on the device).
    let out = cuda::compile_all_cubin("compute_90a").unwrap_or_else(|e| panic!("sm_90a: {e:#}"));
    for (name, bytes) in out {
        assert!(bytes > 0, "{name}: empty CUBIN");
        println!("sm_90a {name}: {bytes} bytes of CUBIN");
    }
}
