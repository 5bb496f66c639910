//! Host emulation of the decode attention's tail merge (`decode_tail_merge` in
//! `kernels/attention.cu`, between its EMU_TAIL markers, with `decode_emit` and
//! `decode_merge_piece` from between its EMU_EMIT markers and `quant_q8_lane` from
//! common.cuh's EMU_Q8), so that CI, which has no GPU, checks the protocol of the launch's last
//! blocks: which arrivals take which (head, 32 dims) pieces, the spin on the counter, the
//! counter's re-arming, and that the merged outputs and the o-projection's int8 planes are
//! bitwise the merge launch's. The split blocks of a (row, head block) run as one grid of
//! fibers (`emu/fibers_grid.h`) in three arrival orders. Needs only g++; skipped with a note
//! where it is missing. On the GPU, `ferrite check` runs the tail merge behind every decode
//! case past a cluster's 16 splits.

#[path = "emu/mod.rs"]
mod emu;

const SRC: &str = include_str!("../src/cuda/kernels/attention.cu");
const HARNESS: &str = include_str!("attn_decode_tail_emu/harness.cpp");

#[test]
fn decode_tail_merge_emulated_matches_the_merge_launch() {
    let Some(exe) = emu::build_attn_emit(
        "attn-decode-tail-emu",
        &[
            (
                "tail.cuh",
                emu::section(SRC, "// EMU_TAIL_BEGIN", "// EMU_TAIL_END"),
            ),
            ("harness.cpp", HARNESS),
        ],
    ) else {
        return;
    };
    emu::run_expect_all_ok(&exe, "decode tail merge");
}
