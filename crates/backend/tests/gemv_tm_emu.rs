//! Host emulation of the token-major Q4_K GEMV (`tm_quant_block` and `gemv_tm_q4k` in
//! `kernels/matmul.cu`, the section between its EMU_TM markers, with common.cuh's EMU_SM
//! scale decode): compiled unchanged with g++
//! (`gemv_tm_emu/harness.cpp` on `emu/fibers.h`, mma.sync m16n8k32 emulated) and run on random
//! Q4_K rows and x rows with outliers. Checks the quantization (planes within half a step, the
//! sub-block sums), each output against a double-precision sum over the same integers and
//! scales (NMSE ≤ 1e-10), nothing written past the rows or outputs, and every x row's outputs
//! bit for bit equal at every row count and R (decode and verify agree). Needs only g++;
//! skipped with a note where it is missing. What it cannot see: ptxas, timing.

#[path = "emu/mod.rs"]
mod emu;

#[test]
fn token_major_gemv_emulated_matches_reference() {
    const SRC: &str = include_str!("../src/cuda/kernels/matmul.cu");
    const COMMON: &str = include_str!("../src/cuda/kernels/common.cuh");
    let tm = emu::section(SRC, "// EMU_TM_BEGIN", "// EMU_TM_END");
    let sm = emu::section(COMMON, "// EMU_SM_BEGIN", "// EMU_SM_END");
    let Some(exe) = emu::build(
        "gemv-tm-emu",
        &[
            ("sm.cuh", sm),
            ("tm.cuh", tm),
            ("harness.cpp", include_str!("gemv_tm_emu/harness.cpp")),
        ],
    ) else {
        return;
    };
    emu::run_expect_all_ok(&exe, "token-major GEMV");
}
