//! Host emulation of the decode attention's split merge launch (`attn_decode_merge` in
//! `kernels/attention.cu`, between its EMU_MERGE markers, with `decode_emit` from between its
//! EMU_EMIT markers and `quant_q8_lane` from common.cuh's EMU_Q8), so that CI, which has no GPU,
//! checks which splits it reads (the decode launch's chunk formula: the splits past a row's
//! active ones hold NaN here), its merge of (m, l, acc) against a double-precision one, that a
//! row of one split is left to its decode block, and the o-projection's int8 planes it writes.
//! The kernel code is compiled unchanged with g++ (`attn_decode_merge_emu/harness.cpp` on
//! `emu/fibers.h`). Needs only g++; skipped with a note where it is missing. On the GPU, `ferrite
//! check` runs the merge behind every decode case past a cluster's 16 splits.

#[path = "emu/mod.rs"]
mod emu;

const SRC: &str = include_str!("../src/cuda/kernels/attention.cu");
const HARNESS: &str = include_str!("attn_decode_merge_emu/harness.cpp");

#[test]
fn decode_split_merge_emulated_matches_reference() {
    let Some(exe) = emu::build_attn_emit(
        "attn-decode-merge-emu",
        &[
            (
                "merge.cuh",
                emu::section(SRC, "// EMU_MERGE_BEGIN", "// EMU_MERGE_END"),
            ),
            ("harness.cpp", HARNESS),
        ],
    ) else {
        return;
    };
    emu::run_expect_all_ok(&exe, "decode split merge");
}
