//! Shared by the kernel emulation tests (gated_delta_chunked_emu, gemv_tc_emu): writes a
//! harness and the kernel sections it includes into a temporary directory, next to
//! `fibers.h` (the fiber-per-thread block scheduler), and compiles it with g++.

use std::path::PathBuf;
use std::process::Command;

const FIBERS: &str = include_str!("fibers.h");

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

/// The text between two marker comments of a kernel source.
pub fn section<'a>(src: &'a str, begin: &str, end: &str) -> &'a str {
    let b = src.find(begin).unwrap_or_else(|| panic!("{begin} marker"));
    let e = src.find(end).unwrap_or_else(|| panic!("{end} marker"));
    &src[b..e]
}
