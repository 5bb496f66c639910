//! Host emulation of the RS fragment decode of the wgmma prefill (`mmw_rs_row` in
//! `kernels/mmw.cu`, the section between its EMU_RS markers, on mm_decode.cuh's EMU_DEC
//! section): compiled unchanged with g++ (`mmw_rs_emu/harness.cpp`, shared loads on a host
//! stage) and run for every consumer thread of a 128-row Q4_K tile, plain and SwiGLU row
//! orders, every 64-element group. Checks each A register against the bf16 of ggml's value of
//! the element mma.sync m16n8k16's A fragment places there (bit for bit) and that each element
//! is covered once; the Q8_0 form (`mmw_rs_row_q80`) on a tile of random Q8_0 spans at each
//! step offset; the Q6_K form (`mmw_rs_row_q6k`) against ggml's Q6_K dequantization; and the Q5_K
//! form (`mmw_rs_row::<true>`) against ggml's Q5_K values. What
//! it cannot see: the wgmma itself, the tensor copies, ptxas, timing.

#[path = "emu/mod.rs"]
mod emu;

#[test]
fn rs_fragments_are_the_q4k_weights() {
    const MMW: &str = include_str!("../src/cuda/kernels/mmw.cu");
    const DEC: &str = include_str!("../src/cuda/kernels/mm_decode.cuh");
    let Some(exe) = emu::build(
        "mmw-rs-emu",
        &[
            (
                "dec.cuh",
                emu::section(DEC, "// EMU_DEC_BEGIN", "// EMU_DEC_END"),
            ),
            (
                "rs.cuh",
                emu::section(MMW, "// EMU_RS_BEGIN", "// EMU_RS_END"),
            ),
            ("harness.cpp", include_str!("mmw_rs_emu/harness.cpp")),
        ],
    ) else {
        return;
    };
    emu::run_expect_all_ok(&exe, "RS fragment decode");
}
