//! Host emulation of the tensor-core Q4_K decode GEMV (`gemvq_tc_q4k` and `tc_stage_x` in
//! `kernels/matmul.cu`, the section between its EMU_TC markers, with `kq_pair_scales` from the
//! EMU_KQ section), so that CI, which has no GPU, still checks the kernel's fragment layout,
//! K-slice mapping, scale decoding, reductions and R-invariance.
//!
//! The kernel code is compiled unchanged with g++ (`gemv_tc_emu/harness.cpp` on
//! `emu/fibers.h`: every CUDA thread a fiber; mma.sync m16n8k32 u8 x s8 emulated from the PTX
//! ISA fragment layout) and run on random Q4_K rows and int8 x planes: whole and partial
//! tiles, one and several super-blocks per warp, SwiGLU, x staged in shared memory (R = 1) or
//! read from global memory (R = 3, with padded x rows). Each output is compared with a
//! double-precision dot product over the same int8 planes and block scales (NMSE ≤ 1e-11:
//! f32 accumulation of exact integer block sums), outputs outside the valid rows must stay
//! unwritten, and x row 0 must give the same bits at R = 1 and R = 3. Needs only g++; skipped
//! with a note where it is missing. What it cannot see: ptxas, timing, the bulk copy.

#[path = "emu/mod.rs"]
mod emu;

const HARNESS: &str = include_str!("gemv_tc_emu/harness.cpp");

#[test]
fn tensor_core_gemv_emulated_matches_reference() {
    let Some(exe) = emu::build_gemv_tc("gemv-tc-emu", HARNESS) else {
        return;
    };
    emu::run_expect_all_ok(&exe, "tensor-core GEMV");
}
