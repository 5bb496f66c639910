//! Host emulation of the four-warp NORM SwiGLU (`gemvq_tc_q4k`'s W4 in `kernels/matmul.cu`,
//! the default one-row kernel `gemvq_swiglu_tcnw4_q4_k_r1`; MATMUL.md round 49) and the
//! four-warp plain tile of the K-split down (`gemvq_tck[n]w4_q4_k_r1`, round 50; its Q8_0 form
//! `gemvq_tcknw4_q8_0_r1`, round 54) against the eight-warp ones: the same harness compiled as an eight-warp block and as a four-warp block
//! (`gemv_tc_w4_emu/harness.cpp` on `emu/fibers.h`), run on the same random tiles; their
//! outputs must be the same bits, as W4 claims (each warp's two accumulator sets are the
//! eight-warp kernel's partials of warps w and w + 4, added in its order), so that decode
//! (this kernel) and verify (the eight-warp R > 1 kernels) keep agreeing. The eight-warp
//! kernel's own correctness against a double-precision reference is gemv_tc_emu's.
//! Needs only g++; skipped with a note where it is missing.

#[path = "emu/mod.rs"]
mod emu;

const HARNESS: &str = include_str!("gemv_tc_w4_emu/harness.cpp");

fn run(name: &str, prelude: &str) -> Option<String> {
    let exe = emu::build_gemv_tc(name, &format!("{prelude}{HARNESS}"))?;
    let out = std::process::Command::new(&exe)
        .output()
        .expect("run the harness");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{name}: {text}");
    Some(text)
}

#[test]
fn four_warp_tiles_give_the_eight_warp_bits() {
    let Some(eight) = run("gemv-tc-w4-emu-8", "") else {
        return;
    };
    let Some(four) = run(
        "gemv-tc-w4-emu-4",
        "#define EMU_THREADS 128\n#define EMU_W4 1\n",
    ) else {
        return;
    };
    assert_eq!(eight.lines().count(), 12, "{eight}");
    assert_eq!(
        four, eight,
        "the four-warp tiles' outputs differ from the eight-warp kernels'"
    );
}
