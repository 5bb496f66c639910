// The decode attention's emit section on the host (attention.cu's EMU_EMIT: decode_chunk,
// decode_active, decode_emit, decode_merge_piece; with common.cuh's EMU_Q8 for
// quant_q8_lane), for the split-merge harnesses (attn_decode_merge_emu, attn_decode_tail_emu):
// the kernel qualifiers and constants those sections use, then the sections, written next to
// this file as q8.cuh and emit.cuh by emu::build_attn_emit. Included after a fiber scheduler
// (fibers.h or fibers_grid.h) and intrinsics.h.
#pragma once

#define __shared__ static
#define __global__
#define __launch_bounds__(n)
#define PDL_ENTRY() \
    do {            \
    } while (0)
#define ATT_NEG (-1.0e30f)
#define QK 32

#include "q8.cuh"
#include "emit.cuh"
