//! Host emulation of the two-tile Q4_K o-projection that hands the FFN's RMSNorm over to the
//! SwiGLU (`tc2_tiles_add` in `kernels/matmul.cu`: two 8-warp groups on two 16-row tiles of
//! `gemvq_tc_q4k`, `tc_reduce_g2`, and `add_norm_lane`'s residual add, planes of x ⊙ n and
//! group sums of squares), compiled unchanged with g++ on a block of 512 fibers
//! (`gemv_tc2_emu/harness.cpp`, `emu/`), so that CI, which has no GPU, checks the grouping,
//! the epilogue's indexing and R-invariance. The SwiGLU's side (`tc_norm_scale` and the NORM
//! tile) is in `gemv_tc_emu`. Needs only g++; skipped with a note where it is missing. What it
//! cannot see: ptxas, timing, the bulk copies and their barriers. Built twice: as the
//! 512-thread block and as the 256-thread one that takes both tiles in turn (`TC2_SEQ`,
//! `gemvq_tc2w_add_q4_k`), whose results must agree bit for bit.

#[path = "emu/mod.rs"]
mod emu;

const SRC: &str = include_str!("../src/cuda/kernels/matmul.cu");
const COMMON: &str = include_str!("../src/cuda/kernels/common.cuh");
const HARNESS: &str = include_str!("gemv_tc2_emu/harness.cpp");

/// Builds the harness (`seq`: the one-group block, `TC2_SEQ`), runs it, asserts "ALL OK" and
/// returns its digest line (the row-0 results of every configuration).
fn run(seq: bool) -> Option<String> {
    let harness = if seq {
        format!("#define TC2_SEQ 1\n{HARNESS}")
    } else {
        HARNESS.to_string()
    };
    let exe = emu::build(
        if seq { "gemv-tc2seq-emu" } else { "gemv-tc2-emu" },
        &[
            (
                "q8.cuh",
                emu::section(COMMON, "// EMU_Q8_BEGIN", "// EMU_Q8_END"),
            ),
            (
                "kq.cuh",
                emu::section(SRC, "// EMU_KQ_BEGIN", "// EMU_KQ_END"),
            ),
            (
                "tc.cuh",
                emu::section(SRC, "// EMU_TC_BEGIN", "// EMU_TC_END"),
            ),
            ("harness.cpp", &harness),
        ],
    )?;
    let out = std::process::Command::new(&exe)
        .output()
        .expect("running the emulation");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.contains("ALL OK"),
        "the emulated two-tile norm hand-over (seq {seq}) disagrees with the reference"
    );
    if let Some(dir) = exe.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    let digest = text.lines().find(|l| l.starts_with("digest "));
    Some(digest.expect("the harness prints its digest").to_string())
}

#[test]
fn two_tile_norm_handover_emulated_matches_reference() {
    let Some(two_groups) = run(false) else {
        return;
    };
    let Some(one_group) = run(true) else {
        return;
    };
    assert_eq!(
        two_groups, one_group,
        "the one-group block (both tiles in turn) must give the two-group block's bits"
    );
}
