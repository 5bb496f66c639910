// What the tensor-core GEMV emulations (gemv_tc_emu, gemv_tc2_emu) compile matmul.cu's
// sections against: the fiber scheduler and host intrinsics, the constants and helpers those
// sections take from the rest of matmul.cu, the emulated mma.sync, the sections themselves
// (written next to this file by emu::build_gemv_tc: EMU_Q8 of common.cuh as q8.cuh, EMU_KQ
// and EMU_TC of matmul.cu as kq.cuh and tc.cuh) and the Q4_K reference. A harness defines
// EMU_THREADS first where its block is not 256 threads.
#include <cmath>

#include "fibers.h"
#include "intrinsics.h"

#define __shared__ static
#define GEMV_WARPS 8
#define QK 32
#define QK_K 256
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176
#define Q8_0_BYTES 34
#define Q6_K_BYTES 210
#define TL_STAMP_END()  // the block timeline's hook (common.cuh): empty, as in the default kernels
#define TL_MARK(k)      // the marks (matmul.cu): empty, as in the default kernels

static inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

#include "mma.h"

#include "q8.cuh"
#include "kq.cuh"
#include "tc.cuh"
#include "q4k_ref.h"
