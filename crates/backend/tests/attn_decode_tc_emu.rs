//! Host emulation of the tensor-core decode attention loop (`decode_tc_loop`, `q8_dequant8`
//! and `q8_scale2` in `kernels/attention.cu`, the section between its EMU_DTC markers, with
//! `kv_pos` from between its EMU_KVPOS markers), so
//! that CI, which has no GPU, still checks the loop's fragment layout (the permuted K dims,
//! V's key pairs, P from S's accumulators), its online softmax and masking, the warps' key
//! ranges, and the q8_0 dequantization into f16 words; and that the q8_0 loop with the next
//! tile's loads issued early (PIPE) gives the plain loop's bits; and that the keys-before-the-wait
//! loop with QK-norm + RoPE on its loaded values (ROPE) matches the plain loop on q and the new
//! key rotated on the host (NMSE ≤ 1e-8, the stored key row within f16 rounding).
//!
//! The kernel code is compiled unchanged with g++ (`attn_decode_tc_emu/harness.cpp` on
//! `emu/fibers.h`: every CUDA thread a fiber; mma.sync m16n8k16 f16 emulated from the PTX ISA
//! fragment layout; every f16 result rounded to nearest even) and run for 1, 2, 4 and 8
//! heads per block, f16 and q8_0 caches, key ranges of 1 to 200 keys (warps with no keys,
//! partial 16-key tiles, several tiles per warp). The 4 warps' states are merged as the
//! kernel's tail does and compared with a double-precision softmax attention over the cache's
//! values: NMSE ≤ 1e-5 (q and P are rounded to f16, as on the GPU, where `ferrite check`
//! measured 0.5–1.7e-7). Needs only g++; skipped with a note where it is missing. What it
//! cannot see: ptxas, timing, the store and the split merge (`ferrite check` on the GPU).

#[path = "emu/mod.rs"]
mod emu;

const SRC: &str = include_str!("../src/cuda/kernels/attention.cu");
const HARNESS: &str = include_str!("attn_decode_tc_emu/harness.cpp");

#[test]
fn tensor_core_decode_attention_emulated_matches_reference() {
    let Some(exe) = emu::build(
        "attn-decode-tc-emu",
        &[
            (
                "kvpos.cuh",
                emu::section(SRC, "// EMU_KVPOS_BEGIN", "// EMU_KVPOS_END"),
            ),
            (
                "dtc.cuh",
                emu::section(SRC, "// EMU_DTC_BEGIN", "// EMU_DTC_END"),
            ),
            ("harness.cpp", HARNESS),
        ],
    ) else {
        return;
    };
    emu::run_expect_all_ok(&exe, "tensor-core decode attention");
}
