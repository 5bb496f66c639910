//! Host emulation of the two-tile Q4_K o-projection that hands the FFN's RMSNorm over to the
//! SwiGLU (`tc2_tiles_add` in `kernels/matmul.cu`: two 8-warp groups on two 16-row tiles of
//! `gemvq_tc_q4k`, `tc_reduce_g2`, and `add_norm_lane`'s residual add, planes of x ⊙ n and
//! group sums of squares), compiled unchanged with g++ on a block of 512 fibers
//! (`gemv_tc2_emu/harness.cpp`, `emu/`), so that CI, which has no GPU, checks the grouping,
//! the epilogue's indexing and R-invariance. The SwiGLU's side (`tc_norm_scale` and the NORM
//! tile) is in `gemv_tc_emu`. Needs only g++; skipped with a note where it is missing. What it
//! cannot see: ptxas, timing, the bulk copies and their barriers.

#[path = "emu/mod.rs"]
mod emu;

const HARNESS: &str = include_str!("gemv_tc2_emu/harness.cpp");

#[test]
fn two_tile_norm_handover_emulated_matches_reference() {
    let Some(exe) = emu::build_gemv_tc("gemv-tc2-emu", HARNESS) else {
        return;
    };
    emu::run_expect_all_ok(&exe, "two-tile norm hand-over");
}
