//! Shared by the kernel emulation tests (gated_delta_chunked_emu, gemv_tc_emu,
//! attn_decode_tc_emu): writes a harness and the kernel sections it includes into a
//! temporary directory, next to `fibers.h` (the fiber-per-thread block scheduler),
//! `fibers_grid.h` (the same for the blocks of a launch together; both on `fibers_warp.h`)
//! and `intrinsics.h` (shared host intrinsics), compiles it with g++, and runs it.

use std::path::PathBuf;
use std::process::Command;

const FIBERS: &str = include_str!("fibers.h");
const FIBERS_WARP: &str = include_str!("fibers_warp.h");
const FIBERS_GRID: &str = include_str!("fibers_grid.h");
const INTRINSICS: &str = include_str!("intrinsics.h");
const MMA: &str = include_str!("mma.h");
const Q4K_REF: &str = include_str!("q4k_ref.h");
const RNG: &str = include_str!("rng.h");

/// The compiled harness, or `None` (with a note) where g++ is not installed. `files`:
/// (file name, contents), one of them `harness.cpp`.
pub fn build(name: &str, files: &[(&str, &str)]) -> Option<PathBuf> {
    if Command::new("g++").arg("--version").output().is_err() {
        eprintln!("skipped: g++ is not installed here");
        return None;
    }
    let dir = std::env::temp_dir().join(format!("ferrite-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("fibers.h"), FIBERS).unwrap();
    std::fs::write(dir.join("fibers_warp.h"), FIBERS_WARP).unwrap();
    std::fs::write(dir.join("fibers_grid.h"), FIBERS_GRID).unwrap();
    std::fs::write(dir.join("intrinsics.h"), INTRINSICS).unwrap();
    std::fs::write(dir.join("mma.h"), MMA).unwrap();
    std::fs::write(dir.join("q4k_ref.h"), Q4K_REF).unwrap();
    std::fs::write(dir.join("rng.h"), RNG).unwrap();
    for (f, text) in files {
        std::fs::write(dir.join(f), text).unwrap();
    }
    let exe = dir.join("emu");
    let st = Command::new("g++")
        .args(["-O2", "-std=c++17", "-Wno-unknown-pragmas", "-o"])
        .arg(&exe)
        .arg(dir.join("harness.cpp"))
        .status()
        .expect("g++");
    assert!(st.success(), "g++ failed on the {name} emulation harness");
    Some(exe)
}

/// [`build`] for a harness of matmul.cu's tensor-core GEMV code (gemv_tc_emu, gemv_tc2_emu):
/// with `gemv_tc.h` (the harnesses' common prelude) and the sections it includes — EMU_Q8 of
/// common.cuh, EMU_KQ of mm_decode.cuh and EMU_TC of matmul.cu.
#[allow(dead_code)]
pub fn build_gemv_tc(name: &str, harness: &str) -> Option<PathBuf> {
    const SRC: &str = include_str!("../../src/cuda/kernels/matmul.cu");
    const COMMON: &str = include_str!("../../src/cuda/kernels/common.cuh");
    const DEC: &str = include_str!("../../src/cuda/kernels/mm_decode.cuh");
    build(
        name,
        &[
            ("gemv_tc.h", include_str!("gemv_tc.h")),
            (
                "q8.cuh",
                section(COMMON, "// EMU_Q8_BEGIN", "// EMU_Q8_END"),
            ),
            ("kq.cuh", section(DEC, "// EMU_KQ_BEGIN", "// EMU_KQ_END")),
            ("tc.cuh", section(SRC, "// EMU_TC_BEGIN", "// EMU_TC_END")),
            ("harness.cpp", harness),
        ],
    )
}

/// [`build`] for a harness of attention.cu's split merge (attn_decode_merge_emu,
/// attn_decode_tail_emu): with `attn_emit.h` and the sections it includes — EMU_Q8 of
/// common.cuh, EMU_EMIT of attention.cu — besides the harness's own `files`.
#[allow(dead_code)]
pub fn build_attn_emit(name: &str, files: &[(&str, &str)]) -> Option<PathBuf> {
    const SRC: &str = include_str!("../../src/cuda/kernels/attention.cu");
    const COMMON: &str = include_str!("../../src/cuda/kernels/common.cuh");
    let mut all = vec![
        ("attn_emit.h", include_str!("attn_emit.h")),
        (
            "q8.cuh",
            section(COMMON, "// EMU_Q8_BEGIN", "// EMU_Q8_END"),
        ),
        (
            "emit.cuh",
            section(SRC, "// EMU_EMIT_BEGIN", "// EMU_EMIT_END"),
        ),
    ];
    all.extend_from_slice(files);
    build(name, &all)
}

/// The text between two marker comments of a kernel source.
pub fn section<'a>(src: &'a str, begin: &str, end: &str) -> &'a str {
    let b = src.find(begin).unwrap_or_else(|| panic!("{begin} marker"));
    let e = src.find(end).unwrap_or_else(|| panic!("{end} marker"));
    &src[b..e]
}

/// Runs a harness built by [`build`] and asserts it exited cleanly and printed "ALL OK"
/// (`what` names the emulated kernel in the failure), then removes its directory. (Not every
/// test crate that includes this module calls it.)
#[allow(dead_code)]
pub fn run_expect_all_ok(exe: &std::path::Path, what: &str) {
    let out = Command::new(exe).output().expect("running the emulation");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.contains("ALL OK"),
        "the emulated {what} disagrees with the reference"
    );
    if let Some(dir) = exe.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}
