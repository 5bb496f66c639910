// mmw.cu — prefill matmul on the Hopper warpgroup tensor cores (wgmma, sm_90a):
// out[t][o] = Σ_i W[o][i] · x[t][i] for rows > GEMV_MAX_ROWS, any weight type the bf16 `mm_`
// kernel of matmul.cu takes, with the same numerics (x and the dequantized weights rounded
// to bf16, f32 accumulation; only the order of the f32 additions inside a K step differs).
//
// Why (MATMUL.md round 13): the mma.sync kernel `mm_` runs at ~200 TFLOP/s on the H200 (ncu,
// q4_K 4096² × 512 rows: 8 warps per SM, tensor pipe 34% active, stalls on fixed-latency
// waits, the shared-memory pipe (ldmatrix: 96 KB per K step per SM) and barriers). wgmma reads
// both operands from shared memory without the register file, one B tile serving a
// warpgroup's 64 rows, and runs asynchronously to the threads that feed it. Measured: Qwen3-8B
// Q4_K_M pp512 10,476 (mm_) → 16,591 tok/s.
//
// The plan, per block (tile TM outputs × BN tokens: 128 × 128, 128 × 64, or 64 × 256):
// - Warpgroups 0 and 1 produce: per K step of 64 they decode the TM weight rows' 64 elements
//   to bf16 (256 / TM threads per row, 16-element chunks; the raw bytes loaded MMW_RAW steps
//   ahead into registers, after the step's proxy fence (see `step`); the decoders are
//   matmul.cu's raw16/dec16) into the stage's A tile, and copy the x tile (BN tokens × 64 bf16
//   of the bf16 scratch) MMW_XLEAD steps ahead by cp.async.
// - TM / 64 consumer warpgroups: each owns 64 of the outputs and issues per stage four
//   `wgmma.mma_async m64nBNk16` (A and B from shared memory by descriptor), accumulating BN / 2
//   f32 per thread; the next stage's MMAs are issued before the previous stage is released
//   (wgmma.wait_group 1). 64 × 256 (one consumer warpgroup, m64n256) halves the decode per
//   FLOP: the long prefills' full grids take it.
// - A ring of as many stages as fit 224 KB (≤ 7); named barriers per stage: FULL (producers
//   arrive after their writes are fenced to the async proxy, consumers sync) and EMPTY
//   (consumers arrive once their MMAs of the stage completed, the producers sync).
// - Shared layout of a tile [R rows][64 k] bf16: the 128-byte swizzle K-major layout (a row's
//   64 elements one 128-byte line, 16-byte chunk j at position j ^ (row % 8)); a warp's
//   16-byte stores of 8 consecutive rows at one chunk index cover all 32 banks. The
//   no-swizzle layouts tried first ran no faster than mm_ (MATMUL.md round 13).
// - Epilogue: the consumers stage their fragments in the (then idle) ring as [token][output]
//   f32, then all 12 warps store 16-byte runs of 4 outputs along each token's row (and
//   compute the SwiGLU there, below).
// - Two fused forms: the Q, K, V projections of Q4_K_M (Q4_K, Q4_K, Q6_K) in one grid
//   (MMW_KERNEL1 with two types), and gate, up and SwiGLU in one (`mmw_row`: a tile's rows
//   are 8 gate rows then the same outputs' 8 up rows per MMA row group, so the epilogue has
//   both in one thread's registers).
// - Grid (token tiles, output tiles of up to three weights: MMW_KERNEL1), token tiles fastest
//   (blocks sharing a weight tile run together: weights come from DRAM about once). Edges as
//   `mm_`: token rows >= rows are zero-filled and not stored, output rows >= n_out read a
//   clamped row and are not stored, K beyond n_in is zero in x (the scratch's padding) and in
//   the decoded weights.

#define MMW_TK 64
#define MMW_XLEAD 2                         // steps the x copies run ahead of the decode
#define MMW_PRODUCERS 2  // producer warpgroups (256 threads: 256 / TM per output row)
// Threads of a block: P producer warpgroups (the RS wide tile's one: `mmw_rsw_*`) + TM / 64
// consumer warpgroups; MMW_THREADS with the usual two. P = 0: the consumer warpgroups first,
// then one producer warp (the RS MoE forms `mmw_moe4w_*`, `mmw_moe3w_*`).
#define MMW_THREADS_P(TM, P) ((P) ? 128 * (P) + 2 * (TM) : 2 * (TM) + 32)
#define MMW_THREADS(TM) MMW_THREADS_P(TM, MMW_PRODUCERS)
#define MMW_RAW 2                           // steps of raw weight bytes in flight per thread
// MMW_XAFTER (`FERRITE_MMW_XAFTER=1`): a step's x copies issued after its proxy fence instead of
// before its decode (MATMUL.md round 81).
#ifndef MMW_XAFTER
#define MMW_XAFTER 0
#endif
// MMW_XTMA (`FERRITE_MMW_XTMA=1`; MATMUL.md round 82): the x tiles of the dense launches and the
// MoE downs by one 2-D tensor copy a step (TMA, the 128-byte swizzle: mmw_off's layout) on a
// per-stage mbarrier the consumers wait on, instead of BN × 8 16-byte cp.async spread over the
// producer threads (8 a thread a step, their address arithmetic, and a wait for them before
// every stage's fence). The MoE gate/up's x rows are its pairs' tokens': cp.async, or one tensor
// copy a step over them gathered in list order first (MMW_GU_XG).
#ifndef MMW_XTMA
#define MMW_XTMA 0
#endif
// A CUtensorMap (opaque, 128 bytes, 64-byte aligned), passed as a __grid_constant__ parameter.
struct __align__(128) MmwTmap {
    unsigned long long v[16];
};
// MMW_RS (`FERRITE_MMW_RS=1`, which compiles MMW_XTMA in too; MATMUL.md rounds 83, 85): the
// Q4_K launches on 128-output tiles take A from registers (and the Q8_0 ones, by one span of a
// row's two blocks a step: mmw_rs_row_q80). The producers' thread 0 brings each
// stage's raw weight bytes by tensor copies beside x (two maps a weight over its rows as bytes:
// the super-block headers, 16 bytes a row, and the step's 64-element group of quants, 32
// bytes a row), and each consumer thread decodes its own A fragment from them (dec16's
// arithmetic, so the same bf16 weights) right before its wgmma: no producer decode, shared
// bf16 A tile, proxy fence or FULL barrier. The consumer's decode overlaps the previous
// step's asynchronous MMAs (two register sets of A).
#ifndef MMW_RS
#define MMW_RS 0
#endif
// MMW_RS_Q8 (FERRITE_MMW_RS_Q8, on by default with RS): the Q8_0 form of RS (mmw_rs_row_q80;
// MATMUL.md round 86). Without it the RS build's Q8_0 launches keep the producers' form.
#ifndef MMW_RS_Q8
#define MMW_RS_Q8 0
#endif
// MMW_RS_Q6 (FERRITE_MMW_RS_Q6, on by default with RS): the Q6_K form of RS on the dense
// launches (mmw_rs_row_q6k; MATMUL.md rounds 86, 87). Its stage's raw A is MMW_RS_Q6_ROW bytes a
// row (the two spans), so its MmwShape has larger stages.
#ifndef MMW_RS_Q6
#define MMW_RS_Q6 0
#endif
// MMW_RS_Q5 (FERRITE_MMW_RS_Q5, on by default with RS): the Q5_K form of RS on the dense launches
// (mmw_rs_row<true>: the Q4_K form with each nibble's fifth bit from qh; MATMUL.md rounds 91, 93).
#ifndef MMW_RS_Q5
#define MMW_RS_Q5 0
#endif
// MMW_RS_Q6_MOE (FERRITE_MMW_RS_Q6_MOE, with MMW_RS_Q6): the Q6_K form on the MoE GEMMs too. Their
// rows need not be whole 16-byte units (Qwen3-30B-A3B's down experts: 630 bytes, Qwen3.5-35B-A3B's
// 420), so their maps read groups of QG rows (mmw_q6_groups: 8 and 4 there), whose QG · rb bytes
// are, one box a row of the group (MOE.md, 48th session).
#ifndef MMW_RS_Q6_MOE
#define MMW_RS_Q6_MOE 0
#endif
// MMW_GU_LEAD (`FERRITE_MMW_GU_LEAD`, default 0): under RS, steps of the MoE gate/up's gathered
// x copies (cp.async) the producers keep in flight past the step they publish, at most
// STAGES - 2 (0: each step's copies waited for as soon as issued; MOE.md, 48th session).
#ifndef MMW_GU_LEAD
#define MMW_GU_LEAD 0
#endif
// MMW_GU_XG (`FERRITE_MMW_GU_XG`, bits; mod.rs defines it, 3 by default): the MoE gate/up's x.
// Both bits: pp512 (H100) Qwen3-30B-A3B +5.3%, Qwen3.5-35B-A3B +4.6%; bit 2 alone +0.8% there.
//   bit 1: the x rows gathered once into list order before the launch (mmw_moe_x_gather: pair
//          p's row is its token's, bf16 as mm_x_bf16 rounds it), so that the gate/up takes its
//          x tile by one tensor copy a step as the down does (only with MMW_XTMA), instead of the
//          producers' 512 cp.async a step from the token rows (MOE.md, 50th session);
//   bit 2: the gate/up's blocks in tile-major order (a tile's output blocks adjacent: its x rows
//          read by blocks resident together rather than once per wave of output tiles).
#ifndef MMW_GU_XG
#define MMW_GU_XG 0
#endif
// MMW_TSHIFT (`FERRITE_MMW_TSHIFT`, on by default; MATMUL.md round 93): a dense launch's last
// token tile, where the rows end inside it, read from BN rows before the end instead of past it
// (its x box then lies inside the map, without the tensor copy's zero fill, which cost up to
// twice the tile's time; the rows it shares with the tile before are computed twice and stored
// once).
#ifndef MMW_TSHIFT
#define MMW_TSHIFT 0
#endif
#define MMW_GU_XT ((MMW_GU_XG & 1) && MMW_XTMA)
#if MMW_XTMA
#define MMW_XMAP_PARAM , const __grid_constant__ MmwTmap xmap
#define MMW_XMAP &xmap
#else
#define MMW_XMAP_PARAM
#define MMW_XMAP nullptr
#endif
// The gate/up's x map (MMW_GU_XT) and the x rows' first row, the tile's first list position.
#if MMW_GU_XT
#define MMW_GU_XMAP_PARAM MMW_XMAP_PARAM
#define MMW_GU_XMAP(start) MMW_XMAP, (start)
#else
#define MMW_GU_XMAP_PARAM
#define MMW_GU_XMAP(start) nullptr, 0
#endif
#if MMW_RS
// A launch's weight maps: weight i's headers and quants (three weights: the grouped Q, K, V).
#define MMW_WMAP_PARAM                                                                             \
    , const __grid_constant__ MmwTmap wm0h, const __grid_constant__ MmwTmap wm0q,                  \
        const __grid_constant__ MmwTmap wm1h, const __grid_constant__ MmwTmap wm1q,                \
        const __grid_constant__ MmwTmap wm2h, const __grid_constant__ MmwTmap wm2q
#define MMW_WMAP(g) ((g) == 0 ? &wm0h : ((g) == 1 ? &wm1h : &wm2h)), ((g) == 0 ? &wm0q : ((g) == 1 ? &wm1q : &wm2q))
// The SwiGLU launch's: gate's and up's.
#define MMW_WMAP2_PARAM                                                                            \
    , const __grid_constant__ MmwTmap wgh, const __grid_constant__ MmwTmap wgq,                    \
        const __grid_constant__ MmwTmap wuh, const __grid_constant__ MmwTmap wuq
#define MMW_WMAP2 &wgh, &wgq, &wuh, &wuq
// The MoE down's: its experts', rows of every expert.
#define MMW_WMAP1_PARAM , const __grid_constant__ MmwTmap wdh, const __grid_constant__ MmwTmap wdq
#define MMW_WMAP1 &wdh, &wdq
#else
#define MMW_WMAP_PARAM
#define MMW_WMAP(g) nullptr, nullptr
#define MMW_WMAP2_PARAM
#define MMW_WMAP2 nullptr, nullptr, nullptr, nullptr
#define MMW_WMAP1_PARAM
#define MMW_WMAP1 nullptr, nullptr
#endif
__device__ __forceinline__ void mmw_mbar_init(uint32_t bar, uint32_t count = 1) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mmw_mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
}
// The box at element column c0, row r0 of the map into shared dst (128-byte aligned; 1 KB for
// the swizzle), completing on bar; mmw_expect is the calling thread's arrival on bar,
// announcing `bytes` of copies; mmw_tma_x both.
__device__ __forceinline__ void mmw_tma(uint32_t dst, const MmwTmap* map, int c0, int r0, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];" ::"r"(dst),
        "l"((unsigned long long)map), "r"(c0), "r"(r0), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void mmw_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mmw_tma_x(uint32_t dst, const MmwTmap* map, int c0, int r0, uint32_t bar,
                                          uint32_t bytes) {
    mmw_expect(bar, bytes);
    mmw_tma(dst, map, c0, r0, bar);
}
// The staged epilogue: row pitch of stage[token][column] in floats (TM + 4: a fragment store's
// 4 token rows land 8 banks apart, conflict-free; 16-byte aligned rows), and its barrier (the
// stages' barriers are 1..14).
#define MMW_SP(TM) ((TM) + 4)
// The stages' budget at three blocks an SM (`mmw_moe3_*`; mmw.rs MOE3_BUDGET): three blocks
// of six 11 KB stages (RS Q4_K's raw A rows, MMW_RS_Q4K_ROW) with their slack fit 227 KB.
#define MMW_MOE3_BUDGET (72 * 1024)
// ... and at four (`mmw_moe4w_*`: 160-thread blocks): four such stages, 46 KB with the slack.
#define MMW_MOE4_BUDGET (48 * 1024)
// Bytes a row of an RS Q4_K stage's raw A (the header's 16 and the step's 32 quant bytes):
// the three-blocks-an-SM form's stages hold those instead of a bf16 row's 128.
#define MMW_RS_Q4K_ROW 48
#define MMW_EPI_BAR 15

// The bf16 decoders (h2f, raw16, dec16, ..) come from mm_decode.cuh, prepended by mod.rs.

// ---- wgmma plumbing ----

// Descriptor of a K-major tile in the 128-byte swizzle layout at shared address `addr`: each
// row's 64 bf16 are one 128-byte line whose 16-byte chunk j sits at position j ^ (row % 8);
// 8-row groups (1 KB, 1 KB aligned) adjacent (stride byte offset 1024); the leading offset is
// unused in this mode (1). A k16 step inside the line adds its 32 bytes to the start address
// (the hardware applies the XOR on the absolute address bits, hence the 1 KB alignment).
// The no-swizzle layout (core matrices of 8 rows × 16 B) measured no faster than mm_ in every
// arrangement tried (MATMUL.md round 13).
// The start address field is addr >> 4 in bits 0-13: a shared address is below 2^18 (the
// window is 228 KB), so no mask, and a constant offset from a 16-byte aligned base folds into
// one add (the mask cost ~5 instructions a wgmma in the RS consumers' loops).
template <int R>
__device__ __forceinline__ uint64_t mmw_desc(uint32_t addr) {
    return (uint64_t)(addr >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
// Byte offset of element (r, k) (k < 64) in a tile of that layout.
template <int R>
__device__ __forceinline__ uint32_t mmw_off(int r, int k) {
    return (uint32_t)(r * 128 + ((((k >> 3) ^ r) & 7) << 4) + (k & 7) * 2);
}
__device__ __forceinline__ void mmw_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void mmw_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// The SS forms: A and B from shared memory by descriptor. H: f16 operands (MMW_TA's F16
// weights with the f16 x scratch), else bf16. The accumulator operand lists: MMW_D<N>.
#define MMW_D128 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define MMW_D64 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define MMW_D32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MMW_SS256(TY)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n" \
                 : MMW_D128                                                                  \
                 : "l"(da), "l"(db), "r"(1))
#define MMW_SS128(TY)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
                 : MMW_D64                                                                  \
                 : "l"(da), "l"(db), "r"(1))
#define MMW_SS64(TY)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                 : MMW_D32                                                                  \
                 : "l"(da), "l"(db), "r"(1))
template <bool H = false>
__device__ __forceinline__ void mmw_wgmma_n256(float (&d)[128], uint64_t da, uint64_t db) {
    if constexpr (H) MMW_SS256("f16");
    else MMW_SS256("bf16");
}
template <bool H = false>
__device__ __forceinline__ void mmw_wgmma_n128(float (&d)[64], uint64_t da, uint64_t db) {
    if constexpr (H) MMW_SS128("f16");
    else MMW_SS128("bf16");
}
template <bool H = false>
__device__ __forceinline__ void mmw_wgmma_n64(float (&d)[32], uint64_t da, uint64_t db) {
    if constexpr (H) MMW_SS64("f16");
    else MMW_SS64("bf16");
}

// A from registers (MMW_RS, below): a[0..3] the warp's A fragment of the k16 step, as
// mma.sync m16n8k16's (rows g, g + 8 of the warp's 16; columns 2t, 2t + 1, then + 8).
__device__ __forceinline__ void mmw_wgmma_rs_n256(float (&d)[128], const uint32_t* a, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 0;\n}\n"
        : MMW_D128
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void mmw_wgmma_rs_n128(float (&d)[64], const uint32_t* a, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
        : MMW_D64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void mmw_wgmma_rs_n64(float (&d)[32], const uint32_t* a, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
        : MMW_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// Shared-memory loads at a shared address (the RS consumers' raw bytes).
__device__ __forceinline__ uint4 mmw_lds128(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ uint32_t mmw_lds16(uint32_t a) {
    uint16_t v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a));
    return v;
}

// EMU_RS_BEGIN (host emulation: tests/mmw_rs_emu.rs)
// One A row's part of a k step's four k16 fragments for the RS consumers (MMW_RS): `hdr` the
// shared address of the row's Q4_K super-block header (d, dmin, the 12 scale bytes), `qs` of the
// row's 32 quant bytes of the step's 64-element group G, t the thread's index in its quad,
// `half` 0 for the fragment's row g, 1 for g + 8. Bytes 2t, 2t + 1, 2t + 8, 2t + 9 (and 16 +
// those) hold columns 2t, 2t + 1, 2t + 8, 2t + 9 of k16 steps 0 (1) in their low nibbles and of
// steps 2 (3) in their high ones, whose sub-blocks are 2G and 2G + 1; the values are dec16's,
// fmaf(q, d · sc, −dmin · m) packed to bf16. Step kk's registers are a[4 kk .. 4 kk + 3], as
// mma.sync m16n8k16's A: (row g, columns 2t, 2t + 1), (g + 8, same), (g, 2t + 8, 2t + 9),
// (g + 8, same).
// The scales of sub-blocks 2G, 2G + 1 come from kq_pair_scales (no branch on G, a runtime
// value of the consumers' two-step loop) and d · sc, dmin · m from byte_v: exact products (an
// f16 times a 6-bit integer), the same bits as ggml's order of operations.
// Q5 (the Q5_K form, MMW_RS_Q5): `hdr` is the row's first 48 bytes of its super-block, the same
// header then qh[32]; each nibble's fifth bit is bit 2G (low nibbles) or 2G + 1 (high ones) of
// the qh byte at the quant byte's offset in the group (dec16's Q5_K branch: sub-block j's bit j).
template <bool Q5 = false>
__device__ __forceinline__ void mmw_rs_row(uint32_t hdr, uint32_t qs, int G, int t, int half, uint32_t (&a)[16]) {
    const uint4 h = mmw_lds128(hdr);
    const uint32_t sm = kq_pair_scales(kq_pair_sel(G), h.y, h.z, h.w);  // bytes sc0, sc1, m0, m1
    const float d = h2f(h.x & 0xFFFF), dmin = h2f(h.x >> 16);
    const float d23 = d * 8388608.0f, m23 = dmin * 8388608.0f;
    const float ds0 = fmaf(byte_v<0>(sm), d, -d23), ds1 = fmaf(byte_v<1>(sm), d, -d23);
    const float dm0 = fmaf(byte_v<2>(sm), dmin, -m23), dm1 = fmaf(byte_v<3>(sm), dmin, -m23);
    const uint32_t q = qs + 2 * t;
    const uint32_t w0 = mmw_lds16(q) | (mmw_lds16(q + 8) << 16), w1 = mmw_lds16(q + 16) | (mmw_lds16(q + 24) << 16);
    uint32_t h0 = 0, h1 = 0;  // Q5: the qh bytes at the quant bytes' offsets, bit 2G down to bit 0
    if constexpr (Q5) {
        const uint32_t qh = hdr + 16 + 2 * t;
        h0 = (mmw_lds16(qh) | (mmw_lds16(qh + 8) << 16)) >> (2 * G);
        h1 = (mmw_lds16(qh + 16) | (mmw_lds16(qh + 24) << 16)) >> (2 * G);
    }
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const uint32_t ww = (kk & 1) ? w1 : w0;
        uint32_t qn = (kk >= 2 ? ww >> 4 : ww) & 0x0F0F0F0Fu;
        if constexpr (Q5) {
            const uint32_t hh = (kk & 1) ? h1 : h0;
            qn |= ((kk >= 2 ? hh >> 1 : hh) & 0x01010101u) << 4;
        }
        const float ds = kk >= 2 ? ds1 : ds0, dm = kk >= 2 ? dm1 : dm0;
        a[4 * kk + half] = pack_bf16(fmaf(byte_f<0>(qn), ds, -dm), fmaf(byte_f<1>(qn), ds, -dm));
        a[4 * kk + 2 + half] = pack_bf16(fmaf(byte_f<2>(qn), ds, -dm), fmaf(byte_f<3>(qn), ds, -dm));
    }
}

// The Q8_0 form: step kt's two 34-byte blocks (f16 d, 32 int8 quants each) start at byte
// MMW_RS_Q80_STEP · kt of a row, which is a 16-byte unit only every fourth step; a tensor copy's
// box starts at a whole 16-byte unit (its first try started at the blocks' byte and stopped on
// an illegal instruction: MATMUL.md round 86), so the producers copy MMW_RS_Q80_SPAN bytes from
// mmw_rs_q80_col(kt), the unit holding the step's first byte, which sits mmw_rs_q80_off(kt) =
// 0, 4, 8 or 12 bytes into the span (12 + 68 = 80: the blocks always fit). `row` is the shared
// address of the row's span, t and half as mmw_rs_row's. Columns 2t, 2t + 1, 2t + 8, 2t + 9 of
// k16 step kk are quants 16 (kk % 2) + those of block kk / 2; the values dec16's, (q + 128 −
// 128) · d exactly as its Q8_0 branch computes them (the − 128 folded into byte_fb's one FADD:
// the same exact integer), packed to bf16.
#define MMW_RS_Q80_SPAN 80
#define MMW_RS_Q80_STEP (2 * Q8_0_BYTES)
__device__ __forceinline__ int mmw_rs_q80_col(int kt) { return (kt * MMW_RS_Q80_STEP) & ~15; }
__device__ __forceinline__ uint32_t mmw_rs_q80_off(int kt) { return (uint32_t)(kt * MMW_RS_Q80_STEP) & 15u; }
__device__ __forceinline__ void mmw_rs_row_q80(uint32_t row, int kt, int t, int half, uint32_t (&a)[16]) {
    row += mmw_rs_q80_off(kt);
    const float d0 = h2f((uint16_t)mmw_lds16(row)), d1 = h2f((uint16_t)mmw_lds16(row + Q8_0_BYTES));
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const uint32_t q = row + Q8_0_BYTES * (kk >> 1) + 2 + 16 * (kk & 1) + 2 * t;
        const uint32_t w = (mmw_lds16(q) | (mmw_lds16(q + 8) << 16)) ^ 0x80808080u;
        const float d = kk >= 2 ? d1 : d0;
        a[4 * kk + half] = pack_bf16(byte_fb<0, 128>(w) * d, byte_fb<1, 128>(w) * d);
        a[4 * kk + 2 + half] = pack_bf16(byte_fb<2, 128>(w) * d, byte_fb<3, 128>(w) * d);
    }
}

// The Q6_K form (MATMUL.md rounds 86, 87; the dense launches under MMW_RS_Q6).
// Super-block kt / 4 of a row (210 bytes: ql[128], qh[64], scales[16] int8, d f16) starts
// mmw_rs_q6k_off(kt) = 210 (kt / 4) mod 16 bytes past a 16-byte unit, so its step kt (64
// elements: half n = (kt % 4) / 2 of the super-block, nibble half odd = kt % 2) comes in two
// boxes from the units below its bytes: MMW_RS_Q6_QL bytes from mmw_rs_q6k_qlcol(kt) (the
// half's 64 ql bytes) and MMW_RS_Q6_HI from mmw_rs_q6k_hicol(kt) (bytes 128..209: qh, the
// scales, d; 82 + 14 <= 96). Element e of the step is, as dec16's Q6_K branch reads it,
// q = ((ql[64 n + e] >> 4 odd) & 15) | ((qh[32 n + e % 32] >> (4 odd + 2 (e / 32))) & 3) << 4,
// (q − 32) · (d · sc[8 n + 4 odd + e / 16]): dec16's values. `ql` and `hi` are the shared
// addresses of the row's two spans; t and half as mmw_rs_row's (element 16 kk + 2t, 2t + 1 and
// 2t + 8, 2t + 9 of k16 step kk).
#define MMW_RS_Q6_QL 80
#define MMW_RS_Q6_HI 96
#define MMW_RS_Q6_ROW (MMW_RS_Q6_QL + MMW_RS_Q6_HI)
__device__ __forceinline__ uint32_t mmw_rs_q6k_off(int kt) { return (uint32_t)((kt >> 2) * Q6_K_BYTES) & 15u; }
__device__ __forceinline__ int mmw_rs_q6k_qlcol(int kt) { return ((kt >> 2) * Q6_K_BYTES + 64 * ((kt & 3) >> 1)) & ~15; }
__device__ __forceinline__ int mmw_rs_q6k_hicol(int kt) { return ((kt >> 2) * Q6_K_BYTES + 128) & ~15; }
// Rows of rb bytes a group whose bytes are whole 16-byte units: 16 / gcd(rb, 16) (mmw.rs
// q6_groups). The MoE GEMMs' Q6_K maps (MMW_RS_Q6_MOE) are [experts' rows / QG][QG · rb] bytes;
// row j · QG + i of a box of BR rows is box i's row j, at shared row i · BR / QG + j.
__device__ __forceinline__ int mmw_q6_groups(long long rb) {
    const int low = (int)(rb & -rb);
    return 16 / (low < 16 ? low : 16);
}
__device__ __forceinline__ void mmw_rs_row_q6k(uint32_t ql, uint32_t hi, int kt, int t, int half, uint32_t (&a)[16]) {
    const uint32_t off = mmw_rs_q6k_off(kt);
    const int n = (kt & 3) >> 1, odd = kt & 1;
    ql += off;
    hi += off;
    const float d = h2f((uint16_t)mmw_lds16(hi + 80));
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        // The step's scale kk (its bytes 2-aligned: the byte pair holding it).
        const uint32_t sp = mmw_lds16(hi + 64 + 8 * n + 4 * odd + (kk & ~1));
        const float ds = d * (float)(int)(int8_t)(uint8_t)(sp >> (8 * (kk & 1)));
        const uint32_t l = ql + 16 * kk + 2 * t, h = hi + 32 * n + 16 * (kk & 1) + 2 * t;
        const uint32_t lw = mmw_lds16(l) | (mmw_lds16(l + 8) << 16);
        const uint32_t hw = mmw_lds16(h) | (mmw_lds16(h + 8) << 16);
        const uint32_t q = ((lw >> (4 * odd)) & 0x0F0F0F0Fu) | (((hw >> (4 * odd + 2 * (kk >> 1))) & 0x03030303u) << 4);
        a[4 * kk + half] = pack_bf16(byte_fb<0, 32>(q) * ds, byte_fb<1, 32>(q) * ds);
        a[4 * kk + 2 + half] = pack_bf16(byte_fb<2, 32>(q) * ds, byte_fb<3, 32>(q) * ds);
    }
}
// EMU_RS_END

template <int N>
__device__ __forceinline__ void mmw_fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// A dense launch's token tile tn..tn + bn of `rows`: the first row of its x box. Under
// MMW_TSHIFT the last of several tiles ends at the last row, so that its box lies inside the
// map (the rows before tn read again and not stored; MATMUL.md round 93).
__device__ __forceinline__ int mmw_t0(int tn, int rows, int bn) {
    return MMW_TSHIFT && rows > bn && tn + bn > rows ? rows - bn : tn;
}
// The K split between the `ks` blocks of a cluster (MATMUL.md rounds 95, 99): block `rank`
// takes the steps kb .. kb + nk of the kp / MMW_TK, rank · ceil(steps / ks) on. One rule for
// every split kernel, so that the same halves give the same sums.
__device__ __forceinline__ void mmw_k_part(int kp, int ks, int rank, int& kb, int& nk) {
    const int all = kp / MMW_TK, part = (all + ks - 1) / ks;
    kb = rank * part;
    nk = ks > 1 ? min(part, all - kb) : all;
}

// A block's tile: TM outputs (64 per consumer warpgroup) × BN tokens. Stages: as many as fit
// 224 KB, at most 7 (two named barriers each, 16 per block); with BPS = 2 (two blocks an SM:
// the MoE GEMMs' `mmw_moe2_*`) as many as fit 96 KB, with BPS = 3 (`mmw_moe3_*`) 72 KB, with
// BPS = 4 (`mmw_moe4w_*`) 48 KB.
// AROW: bytes a row of the stage's A region (a bf16 row of the step; the RS Q6_K form's raw
// spans are more).
template <int TM, int BN, int BPS = 1, int P = MMW_PRODUCERS, int AROW = MMW_TK * 2>
struct MmwShape {
    static constexpr int A_BYTES = TM * AROW;
    static constexpr int B_BYTES = BN * MMW_TK * 2;
    static constexpr int STAGE = A_BYTES + B_BYTES;
    static constexpr int BUDGET =
        BPS == 1 ? 224 * 1024 : (BPS == 2 ? 96 * 1024 : (BPS == 3 ? MMW_MOE3_BUDGET : MMW_MOE4_BUDGET));
    static constexpr int STAGES = (BUDGET / STAGE) < 7 ? (BUDGET / STAGE) : 7;
    // + the stages' mbarriers (MMW_XTMA, MMW_RS) and the alignment slack; mmw.rs smem()
    // mirrors it.
    static constexpr int SMEM = STAGES * STAGE + 64 + 1024;
    static constexpr int PTHREADS = P ? 128 * P : 32;
    static constexpr int THREADS = MMW_THREADS_P(TM, P);
    static constexpr int TPR = PTHREADS / TM;  // producer threads per output row: 1, 2 or 4
    static_assert(BN * MMW_SP(TM) * 4 <= STAGES * STAGE, "the staged epilogue must fit the ring");
};

// SWIGLU: W is the gate weight, W2 the up weight (same type and shape); the tile's TM rows are
// TM / 2 outputs, each 16-row MMA group 8 gate rows then the same outputs' 8 up rows
// (`mmw_row`), so each consumer thread's D fragment holds gate (rows g) and up (rows g + 8) of
// the same output and token, and the epilogue stores silu(gate) · up with elementwise.cu's
// `swiglu` expression on accumulators built by the same MMAs in the same order as the unfused
// launches' (meant to be bitwise the unfused path; checked against the CPU, not compared bit
// for bit on the GPU). Otherwise W2 is unused and row r is output oy · TM + r.
template <bool SWIGLU>
__device__ __forceinline__ int mmw_row(int oy, int tm, int r) {
    return SWIGLU ? oy * (tm / 2) + (r >> 4) * 8 + (r & 7) : oy * tm + r;
}

// The epilogue's silu(g) · u is common.cuh's `swiglu_f`, the elementwise `swiglu` kernel's,
// so the fused launch computes what the unfused one does. (The fast-math form, __expf and
// __fdividef, was 0.6% faster at pp512: not worth a second rounding of the FFN's activations.)

// MOE (the grouped expert GEMMs, `mmw_moe_*` below): the block's tokens are one tile of moe_sort's
// list (`mlist`: its pair positions' entries, `rows` of them), W (and W2) the tile's expert. With
// SWIGLU (gate/up) token t's x row is that of the pair's token, mlist[t] / mtk (under MMW_GU_XT
// row xrow0 + t of the rows gathered in list order: the same values), and its output
// row is t (the caller offsets `out` to the tile's first list position: h in list order);
// without (down) x row t is row t (the caller offsets xb to the tile's h rows) and its output
// row is the pair, mlist[t] (y by pair, for moe_combine).
// TA (the `mmw_ta_*` kernels, 16-bit weights: MATMUL.md round 84): A as well as x by tensor
// copies, the weights' rows as they are stored (bf16, or f16 with an f16 x scratch and f16
// wgmma: H), so no producer decodes, stores or fences; SWIGLU's tile rows are then the TM / 2
// gate rows followed by the same outputs' up rows (two boxes; the epilogue pairs column o with
// o + TM / 2 as it does for mmw_row's order), wmh / wmh2 the gate's and up's maps.
// P: producer warpgroups (1: the RS wide tile, `mmw_rsw_*`, whose 256 threads leave its consumer
// warpgroup the registers of 128 accumulators and two A sets).
// KS (the TA form's plain launches only; MATMUL.md rounds 95, 99): the tile's K steps split
// between the KS = 2 or 4 blocks of a cluster (grid z, the cluster's rank: block r the steps
// r · ceil(nk / KS) on), each block staging its partial sums as usual; then, after a cluster
// barrier, block r stores token rows r · BN / KS.. of the tile, each output the KS partial sums
// added in rank order (the same sum whichever block stores it), the other blocks' read from
// their shared memory (DSMEM). The wide tile's 64 blocks of a 4096-output projection at 512
// rows become 128 with no memset and no atomics; Q, K, V's 96 would become 384 at KS = 4,
// three waves of quarter-K blocks where a device holds 128 blocks in clusters of four (the
// 132-SM Hopper cards hold 120, four waves: the launcher keeps KS = 2 there, round 99).
template <int TYPE, int TM, int BN, bool SWIGLU = false, bool MOE = false, int BPS = 1, bool TA = false,
          int P = MMW_PRODUCERS, int KS = 1>
__device__ __forceinline__ void mmw(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2, long long rb,
                                    int n_out, int n_in, const uint16_t* __restrict__ xb, int kp, int rows,
                                    float* __restrict__ out, int oy, const int* __restrict__ mlist = nullptr,
                                    int mtk = 1, const MmwTmap* xmap = nullptr, int xrow0 = 0,
                                    const MmwTmap* wmh = nullptr, const MmwTmap* wmq = nullptr,
                                    const MmwTmap* wmh2 = nullptr, const MmwTmap* wmq2 = nullptr, int wrow0 = 0,
                                    int hbf = 0) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma: sm_90a only (mmw.rs loads this file there only)
    // RS: the dense launches' 128-output tiles and the MoE GEMMs' (x for the gate/up by the
    // producers' cp.async from its token rows unless MMW_GU_XT gathered them in list order);
    // Q6_K (MMW_RS_Q6) the dense ones, and the MoE ones under MMW_RS_Q6_MOE.
    constexpr bool Q80 = TYPE == GGML_Q8_0;  // RS: the Q8_0 form (one span a row a step)
    constexpr bool Q6 = TYPE == GGML_Q6_K;   // RS: the Q6_K form (two spans a row a step)
    constexpr bool Q5 = TYPE == GGML_Q5_K;   // RS: the Q5_K form (the Q4_K one's plus qh)
    constexpr bool RS = MMW_RS && !TA &&
                        (TYPE == GGML_Q4_K || (Q80 && MMW_RS_Q8) || (Q6 && MMW_RS_Q6 && (!MOE || MMW_RS_Q6_MOE)) ||
                         (Q5 && MMW_RS_Q5 && !MOE)) &&
                        (TM == 128 || (MOE && BN == 64) || (P == 1 && TM == 64 && BN == 256));
    using S = MmwShape<TM, BN, BPS, P,
                       RS && Q6 ? MMW_RS_Q6_ROW : (RS && TYPE == GGML_Q4_K && MOE && P <= 1 ? MMW_RS_Q4K_ROW : MMW_TK * 2)>;
    constexpr int NACC = BN / 2;
    constexpr bool KQ = TYPE == GGML_Q4_K || TYPE == GGML_Q5_K;
    constexpr int MMW_STAGES = S::STAGES, MMW_BAR = S::THREADS, TPR = S::TPR, NCH = TPR ? 4 / TPR : 1;
    constexpr int FULL0 = 1, EMPTY0 = 1 + MMW_STAGES;
    extern __shared__ __align__(1024) uint8_t mmw_smem[];
    // The swizzle atoms must sit on 1 KB boundaries: the ring starts at the first one (the
    // launcher adds 1 KB of slack).
    const uint32_t s0 = ((uint32_t)__cvta_generic_to_shared(mmw_smem) + 1023u) & ~1023u;
    // The ring's start as a generic pointer: the staged epilogue's [token][column] f32 tile.
    float* const stage = reinterpret_cast<float*>(mmw_smem + (s0 - (uint32_t)__cvta_generic_to_shared(mmw_smem)));
    const int tid = threadIdx.x, wgi = tid >> 7;
    // P = 0: consumer warpgroups 0 .. TM / 64 - 1, then the producer warp.
    const bool producer = P ? wgi < P : tid >= 2 * TM;
    // The token tile: rows tn .. tn + BN, its x box from row t0 (mmw_t0; a MoE tile is a list
    // segment, read from its start).
    const int tn = MOE ? 0 : blockIdx.x * BN;
    const int t0 = MOE ? tn : mmw_t0(tn, rows, BN);
    static_assert(KS == 1 || ((KS == 2 || KS == 4) && TA && !SWIGLU), "mmw: the K split is the TA form's plain launches'");
    // KS: this block's steps kb .. kb + nk of the tile's K steps (the launcher splits only K of
    // at least KS steps a block, so that every block has one: mmw.rs Tile::split_k).
    const int ks_rank = KS > 1 ? cluster_rank() : 0;
    int kb, nk;
    mmw_k_part(kp, KS, ks_rank, kb, nk);
    // The MoE Q6_K maps' rows a group (mmw_q6_groups; 1 where rows are whole units).
    const int QG = (MOE && RS && Q6) ? mmw_q6_groups(rb) : 1;
    // XT: x by tensor copies (MMW_XTMA; the gate/up's only under MMW_GU_XT, its map then over
    // the rows gathered in list order), on the stages' mbarriers after the ring (x row xrow0 + t
    // of the map is the tile's token t).
    static_assert(P == MMW_PRODUCERS || RS || TA, "mmw: one producer warpgroup or warp is the RS and TA forms'");
    constexpr bool XT = (MMW_XTMA || RS || TA) && (!(MOE && SWIGLU) || MMW_GU_XT);
    static_assert(!TA || ((TYPE == GGML_F16 || TYPE == GGML_BF16) && !MOE), "mmw: TA is the dense 16-bit form");
    constexpr bool H = TA && TYPE == GGML_F16;  // f16 operands
    const uint32_t xbar0 = s0 + MMW_STAGES * S::STAGE;
    if constexpr (XT || RS) {
        if (tid == 0) {
            for (int i = 0; i < MMW_STAGES; i++) mmw_mbar_init(xbar0 + 8 * i);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
    }

    if (producer) {
        const int ptid = P ? tid : tid - 2 * TM;
        // MOE gate/up: the x rows of this thread's copies (fixed: its tokens n are the same
        // every step), each the row of its pair's token.
        constexpr int NCP = BN * 8 / S::PTHREADS;
        int xr[NCP];
#pragma unroll
        for (int i = 0; i < NCP; i++) {
            const int n = (ptid + S::PTHREADS * i) >> 3;
            xr[i] = MOE && SWIGLU && !XT ? mlist[n < rows ? n : 0] / mtk : 0;
        }
        // x of step kt into its stage (once the consumers released the stage's previous use,
        // step kt - STAGES), one cp.async group per step (empty past the last step).
        auto copy_b = [&](int kt) {
            if (XT) {
                if (kt < nk) {
                    if (kt >= MMW_STAGES) mmw_bar_sync(EMPTY0 + kt % MMW_STAGES, MMW_BAR);
                    if (ptid == 0)
                        mmw_tma_x(s0 + (kt % MMW_STAGES) * S::STAGE + S::A_BYTES, xmap, kt * MMW_TK, xrow0 + t0,
                                  xbar0 + 8 * (kt % MMW_STAGES), (uint32_t)S::B_BYTES);
                }
                return;
            }
            if (kt < nk) {
                if (kt >= MMW_STAGES) mmw_bar_sync(EMPTY0 + kt % MMW_STAGES, MMW_BAR);
                const int k = kt * MMW_TK;
                const uint32_t base = s0 + (kt % MMW_STAGES) * S::STAGE + S::A_BYTES;
#pragma unroll
                for (int i = 0; i < NCP; i++) {
                    const int c = ptid + S::PTHREADS * i, n = c >> 3, kc = (c & 7) * 8;
                    const int t = t0 + n;
                    const int xrow = MOE && SWIGLU ? xr[i] : (t < rows ? t : 0);
                    const uint16_t* src = xb + (size_t)xrow * kp + k + kc;
                    cp_async16(base + mmw_off<BN>(n, kc), src, t < rows ? 16 : 0);
                }
            }
            asm volatile("cp.async.commit_group;\n" ::: "memory");
        };
        if constexpr (TA) {
            // ---- TA producers: thread 0 copies each stage's A (one box of TM rows, or the gate's
            // and the up's TM / 2) and x, as far ahead as the stages allow; the others keep the
            // EMPTY barriers' count ----
            constexpr int BR = SWIGLU ? TM / 2 : TM;  // rows a weight box
            for (int kt = 0; kt < nk; kt++) {
                const int s = kt % MMW_STAGES;
                if (kt >= MMW_STAGES) mmw_bar_sync(EMPTY0 + s, MMW_BAR);
                if (ptid == 0) {
                    const uint32_t st = s0 + s * S::STAGE, bar = xbar0 + 8 * s;
                    const int k = (kb + kt) * MMW_TK, r0 = wrow0 + oy * BR;
                    mmw_expect(bar, (uint32_t)S::STAGE);
                    mmw_tma(st + S::A_BYTES, xmap, k, xrow0 + t0, bar);
                    mmw_tma(st, wmh, k, r0, bar);
                    if (SWIGLU) mmw_tma(st + BR * 128, wmh2, k, r0, bar);
                }
            }
        } else if constexpr (RS) {
            // ---- RS producers: thread 0 copies each stage's raw A (the headers [TM][16] at the
            // stage's start, the step's quants [TM][32] after them; SWIGLU: gate rows then up
            // rows in each; rows wrow0 + oy · BR.. of the maps) and x's box, as far ahead as the
            // stages allow. The MoE gate/up's gathered x rows: every producer's copy_b, waited
            // for and fenced, then the FULL barrier. Otherwise the others keep the EMPTY
            // barriers' count ----
            constexpr int BR = SWIGLU ? TM / 2 : TM;  // rows a weight box
            // GL: steps of the gathered x copies in flight past the one being published (the
            // MoE gate/up; 0: each step's copies issued and waited for at once, one L2 round
            // trip a step). At most STAGES - 2: the copies of step kt + GL wait for the
            // consumers' release of step kt + GL - STAGES, which they give in step kt + GL -
            // STAGES + 1, whose FULL barrier must already be published (kt - 1 at the latest).
            constexpr int GL = XT ? 0 : (MMW_GU_LEAD < MMW_STAGES - 2 ? MMW_GU_LEAD : (MMW_STAGES > 2 ? MMW_STAGES - 2 : 0));
            // Step kt's copies into its stage: the x rows (copy_b: the EMPTY barrier, then one
            // cp.async group, empty past the last step) and thread 0's tensor copies.
            auto issue = [&](int kt) {
                if (!XT) copy_b(kt);
                if (kt >= nk) return;
                const int s = kt % MMW_STAGES;
                const uint32_t st = s0 + s * S::STAGE, bar = xbar0 + 8 * s;
                if (XT && kt >= MMW_STAGES) mmw_bar_sync(EMPTY0 + s, MMW_BAR);
                if (ptid == 0 && Q80) {
                    // Q8_0: one span of MMW_RS_Q80_SPAN bytes a row from the 16-byte unit
                    // holding the step's two blocks (68 bytes; the bytes around them, of the
                    // steps either side or zeros past the row, are not read), rows [TM]
                    // (SWIGLU: gate rows then up rows).
                    const int cb = mmw_rs_q80_col(kt), r0 = wrow0 + oy * BR;
                    mmw_expect(bar, (uint32_t)((XT ? S::B_BYTES : 0) + TM * MMW_RS_Q80_SPAN));
                    if (XT) mmw_tma(st + S::A_BYTES, xmap, kt * MMW_TK, xrow0 + t0, bar);
                    mmw_tma(st, wmh, cb, r0, bar);
                    if (SWIGLU) mmw_tma(st + BR * MMW_RS_Q80_SPAN, wmh2, cb, r0, bar);
                } else if (ptid == 0 && Q6) {
                    // Q6_K: the ql spans [TM][MMW_RS_Q6_QL] at the stage's start, the hi spans
                    // [TM][MMW_RS_Q6_HI] after them (mmw_rs_row_q6k; SWIGLU: gate rows then up
                    // rows in each), from the 16-byte units below the step's bytes.
                    const int cl = mmw_rs_q6k_qlcol(kt), chh = mmw_rs_q6k_hicol(kt), r0 = wrow0 + oy * BR;
                    const uint32_t hb = st + TM * MMW_RS_Q6_QL;
                    mmw_expect(bar, (uint32_t)((XT ? S::B_BYTES : 0) + TM * MMW_RS_Q6_ROW));
                    if (XT) mmw_tma(st + S::A_BYTES, xmap, kt * MMW_TK, xrow0 + t0, bar);
                    if (MOE && QG > 1) {
                        // Box i of each span: rows i, QG + i, .. of the tile (BR / QG of them),
                        // from the unit below the step's bytes in row i of the group.
                        const int gr = BR / QG, y0 = r0 / QG, sb = (kt >> 2) * Q6_K_BYTES;
                        for (int i = 0; i < QG; i++) {
                            const int b = i * (int)rb + sb, bl = (b + 64 * ((kt & 3) >> 1)) & ~15, bh = (b + 128) & ~15;
                            mmw_tma(st + i * gr * MMW_RS_Q6_QL, wmh, bl, y0, bar);
                            mmw_tma(hb + i * gr * MMW_RS_Q6_HI, wmq, bh, y0, bar);
                            if (SWIGLU) {
                                mmw_tma(st + (BR + i * gr) * MMW_RS_Q6_QL, wmh2, bl, y0, bar);
                                mmw_tma(hb + (BR + i * gr) * MMW_RS_Q6_HI, wmq2, bh, y0, bar);
                            }
                        }
                    } else {
                        mmw_tma(st, wmh, cl, r0, bar);
                        mmw_tma(hb, wmq, chh, r0, bar);
                        if (SWIGLU) {
                            mmw_tma(st + BR * MMW_RS_Q6_QL, wmh2, cl, r0, bar);
                            mmw_tma(hb + BR * MMW_RS_Q6_HI, wmq2, chh, r0, bar);
                        }
                    }
                } else if (ptid == 0) {
                    // Q4_K (and Q5_K): the super-block's first HB bytes (the header; Q5_K's also qh)
                    // [TM][HB] at the stage's start, the step's 32 quant bytes [TM][32] after them
                    // (SWIGLU: gate rows then up rows in each).
                    constexpr int HB = Q5 ? 48 : 16;
                    const int cb = (kt >> 2) * (Q5 ? Q5_K_BYTES : Q4_K_BYTES), cq = cb + HB + 32 * (kt & 3);
                    const int r0 = wrow0 + oy * BR;
                    mmw_expect(bar, (uint32_t)((XT ? S::B_BYTES : 0) + TM * (HB + 32)));
                    if (XT) mmw_tma(st + S::A_BYTES, xmap, kt * MMW_TK, xrow0 + t0, bar);
                    mmw_tma(st, wmh, cb, r0, bar);
                    mmw_tma(st + TM * HB, wmq, cq, r0, bar);
                    if (SWIGLU) {
                        mmw_tma(st + BR * HB, wmh2, cb, r0, bar);
                        mmw_tma(st + TM * HB + BR * 32, wmq2, cq, r0, bar);
                    }
                }
            };
            for (int j = 0; j < GL; j++) issue(j);
            for (int kt = 0; kt < nk; kt++) {
                issue(kt + GL);
                if constexpr (!XT) {
                    // Step kt's group is the GL-th newest: waited for, fenced to the async
                    // proxy (the wgmma reads x), published.
                    asm volatile("cp.async.wait_group %0;\n" ::"n"(GL) : "memory");
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    mmw_bar_arrive(FULL0 + kt % MMW_STAGES, MMW_BAR);
                }
            }
        } else {
            // ---- producers: thread (row r, part h) decodes the NCH chunks h, h + TPR, .. (16 k
            // each) of its row's 64-k step: TPR = 2 (TM = 128: chunks h, h + 2) or 4 (TM = 64) ----
            const int r = ptid / TPR, h = ptid % TPR;
            const int o = mmw_row<SWIGLU>(oy, TM, r), lo = o < n_out ? o : n_out - 1;
            const uint8_t* wrow = (SWIGLU && (r & 8) ? W2 : W) + (size_t)lo * (size_t)rb;
            // MMW_RAW steps of raw weight bytes in flight (K-quants: chunk h + 2 is the high
            // nibbles of chunk h's bytes, one load; other types two).
            Raw16 sets[MMW_RAW][NCH];
            auto load = [&](int kt, Raw16 (&rr)[NCH]) {
#if defined(MMW_DIAG) && (MMW_DIAG & 1)
                if (kt >= MMW_RAW) return;  // FERRITE_DIAG_MMW bit 1: timing only
#endif
                const int k = kt * MMW_TK + 16 * h;
                // (K-quants at TPR = 2: chunk h's bytes also hold chunk h + 2, so one load.)
                raw16<TYPE>(wrow, k, n_in, rr[0]);
                if (NCH == 2 && !KQ) raw16<TYPE>(wrow, k + 32, n_in, rr[NCH - 1]);
            };
            auto store_a = [&](int kt, const Raw16 (&rr)[NCH]) {
                const int k = kt * MMW_TK;
                const uint32_t base = s0 + (kt % MMW_STAGES) * S::STAGE;
#pragma unroll
                for (int i = 0; i < NCH; i++) {
                    const int c = h + TPR * i;
                    uint32_t d[8];
                    dec16<TYPE>(rr[KQ ? 0 : i], k + 16 * c, n_in, d);
                    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(base + mmw_off<TM>(r, 16 * c)),
                                 "r"(d[0]), "r"(d[1]), "r"(d[2]), "r"(d[3]) : "memory");
                    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(base + mmw_off<TM>(r, 16 * c + 8)),
                                 "r"(d[4]), "r"(d[5]), "r"(d[6]), "r"(d[7]) : "memory");
                }
            };
            // Step kt: x of step kt + XLEAD issued (its stage released by the consumers' step
            // kt + XLEAD - STAGES), the weights of step kt decoded into its stage (free: its x
            // was issued XLEAD steps ago, after the release), the raw bytes of step kt + MMW_RAW
            // loaded into the set just decoded, then step kt published once its x copies (the
            // group XLEAD behind the newest) landed. The producers may lead the consumers by
            // STAGES - XLEAD steps (3 on the 64 × 256 tile's 5 stages); the first version (4
            // stages, XLEAD 2) let them lead by two at most and every step paid the handoffs in
            // series (MATMUL.md round 13); XLEAD 3 on the 5-7 stage rings measured 0.4% slower
            // than 2 at pp512 (round 14).
            auto step = [&](int kt, Raw16 (&cur)[NCH]) {
#if MMW_XAFTER
                store_a(kt, cur);
                if (!XT) asm volatile("cp.async.wait_group %0;\n" ::"n"(MMW_XLEAD - 1) : "memory");
#else
                copy_b(kt + MMW_XLEAD);
                store_a(kt, cur);
                if (!XT) asm volatile("cp.async.wait_group %0;\n" ::"n"(MMW_XLEAD) : "memory");
#endif
#if !(defined(MMW_DIAG) && (MMW_DIAG & 2))  // FERRITE_DIAG_MMW bit 2: timing only
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
                mmw_bar_arrive(FULL0 + kt % MMW_STAGES, MMW_BAR);
#if MMW_XAFTER
                copy_b(kt + MMW_XLEAD);
#endif
                // After the fence: it compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC, and the
                // membar waits for every load the thread has outstanding. Issued before it (the
                // previous version), the raw loads were waited for at once, every step; issued
                // here they have the next step's decode and copies to land in before the next
                // fence, which is why two sets suffice (MATMUL.md).
                if (kt + MMW_RAW < nk) load(kt + MMW_RAW, cur);
            };
#pragma unroll
            for (int j = 0; j < MMW_RAW; j++)
                if (j < nk) load(j, sets[j]);
#pragma unroll
            for (int j = 0; j < MMW_XLEAD; j++) copy_b(j);
            for (int kt = 0; kt < nk; kt += MMW_RAW) {
#pragma unroll
                for (int j = 0; j < MMW_RAW; j++)
                    if (kt + j < nk) step(kt + j, sets[j]);
            }
        }
    } else {
        // ---- consumers: warpgroup c owns outputs 64c.. of the tile ----
        const int c = P ? wgi - P : wgi;
        float acc[NACC];
#pragma unroll
        for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
        if constexpr (RS) {
            // Thread (g, t) of warp w: A rows g and g + 8 of the warp's 16, i.e. raw rows ra and
            // rb2 (SWIGLU: the gate and the up row of output 8 (4c + w) + g, mmw_row's order).
            const int w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
            const int ra = SWIGLU ? (4 * c + w) * 8 + g : 64 * c + 16 * w + g;
            const int rb2 = SWIGLU ? TM / 2 + ra : ra + 8;
            // The MoE Q6_K groups (QG > 1): rows ra, rb2 at shared rows qa, qb of the boxes (row
            // l of a weight's BR is box l % QG's row l / QG), their group bytes qia, qib.
            constexpr int BRC = SWIGLU ? TM / 2 : TM;
            const int gra = QG > 1 ? BRC / QG : 0;
            const int qa = QG > 1 ? (ra / BRC) * BRC + (ra % BRC % QG) * gra + ra % BRC / QG : ra;
            const int qb = QG > 1 ? (rb2 / BRC) * BRC + (rb2 % BRC % QG) * gra + rb2 % BRC / QG : rb2;
            const uint32_t qia = (uint32_t)((long long)(ra % BRC % QG) * rb), qib = (uint32_t)((long long)(rb2 % BRC % QG) * rb);
            // Step kt's A fragments (mmw_rs_row for the thread's two rows).
            auto decode = [&](int kt, uint32_t (&a)[16]) {
                const uint32_t st = s0 + ((unsigned)kt % MMW_STAGES) * S::STAGE;
                if constexpr (Q80) {
                    mmw_rs_row_q80(st + ra * MMW_RS_Q80_SPAN, kt, t, 0, a);
                    mmw_rs_row_q80(st + rb2 * MMW_RS_Q80_SPAN, kt, t, 1, a);
                } else if constexpr (Q6) {
                    const uint32_t hb = st + TM * MMW_RS_Q6_QL;
                    if (MOE && QG > 1) {
                        // Row r's spans at its shared row qa (qb), its bytes (i · rb + the
                        // super-block's) & 15 into them: mmw_rs_row_q6k adds the super-block's
                        // part, so the row's own goes in the addresses (mod 2^32).
                        const uint32_t sb = (uint32_t)((kt >> 2) * Q6_K_BYTES), fo = sb & 15u;
                        const uint32_t da = ((qia + sb) & 15u) - fo, db = ((qib + sb) & 15u) - fo;
                        mmw_rs_row_q6k(st + qa * MMW_RS_Q6_QL + da, hb + qa * MMW_RS_Q6_HI + da, kt, t, 0, a);
                        mmw_rs_row_q6k(st + qb * MMW_RS_Q6_QL + db, hb + qb * MMW_RS_Q6_HI + db, kt, t, 1, a);
                    } else {
                        mmw_rs_row_q6k(st + ra * MMW_RS_Q6_QL, hb + ra * MMW_RS_Q6_HI, kt, t, 0, a);
                        mmw_rs_row_q6k(st + rb2 * MMW_RS_Q6_QL, hb + rb2 * MMW_RS_Q6_HI, kt, t, 1, a);
                    }
                } else {
                    constexpr uint32_t HB = Q5 ? 48 : 16;  // the producer's header bytes a row
                    mmw_rs_row<Q5>(st + ra * HB, st + TM * HB + ra * 32, kt & 3, t, 0, a);
                    mmw_rs_row<Q5>(st + rb2 * HB, st + TM * HB + rb2 * 32, kt & 3, t, 1, a);
                }
            };
            // Step kt: its stage's copies waited for, A decoded into a (the other set may still
            // feed the previous step's MMAs), four wgmmas issued; then the previous step's
            // group waited for and its stage released.
            auto cstep = [&](int kt, uint32_t (&a)[16]) {
                // kt >= 0: unsigned, so that % and / by a power of two are a mask and a shift.
                const int s = (int)((unsigned)kt % MMW_STAGES);
                if (!XT) mmw_bar_sync(FULL0 + s, MMW_BAR);
                mmw_mbar_wait(xbar0 + 8 * s, ((unsigned)kt / MMW_STAGES) & 1u);
                decode(kt, a);
                // The fragment's registers written before the fence (wgmma reads them
                // asynchronously; nothing may move past it).
#pragma unroll
                for (int i = 0; i < 16; i++) asm volatile("" : "+r"(a[i])::"memory");
                // k16 step kk starts 32 kk bytes into x's lines (mmw_off(0, 16 kk)): the
                // descriptor's address field (bytes / 16) plus 2 kk, one add a wgmma.
                const uint64_t b = mmw_desc<BN>(s0 + s * S::STAGE + S::A_BYTES);
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int kk = 0; kk < MMW_TK / 16; kk++) {
                    const uint64_t db = b + (uint64_t)(mmw_off<BN>(0, 16 * kk) >> 4);
                    if constexpr (BN == 256) mmw_wgmma_rs_n256(acc, a + 4 * kk, db);
                    else if constexpr (BN == 128) mmw_wgmma_rs_n128(acc, a + 4 * kk, db);
                    else mmw_wgmma_rs_n64(acc, a + 4 * kk, db);
                }
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                if (kt >= 1) {
                    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                    mmw_fence_acc(acc);
                    if (kt - 1 + MMW_STAGES < nk) mmw_bar_arrive(EMPTY0 + (int)((unsigned)(kt - 1) % MMW_STAGES), MMW_BAR);
                }
            };
            uint32_t a0[16], a1[16];
            for (int kt = 0; kt < nk; kt += 2) {
                cstep(kt, a0);
                if (kt + 1 < nk) cstep(kt + 1, a1);
            }
        } else
        for (int kt = 0; kt < nk; kt++) {
            const int s = kt % MMW_STAGES;
            if (!TA) mmw_bar_sync(FULL0 + s, MMW_BAR);
            if (XT) mmw_mbar_wait(xbar0 + 8 * s, (uint32_t)((kt / MMW_STAGES) & 1));
            const uint32_t a = s0 + s * S::STAGE + mmw_off<TM>(64 * c, 0);
            const uint32_t b = s0 + s * S::STAGE + S::A_BYTES;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < MMW_TK / 16; kk++) {
                // k16 step kk starts at core-matrix column 2kk.
                const uint64_t da = mmw_desc<TM>(a + mmw_off<TM>(0, 16 * kk));
                const uint64_t db = mmw_desc<BN>(b + mmw_off<BN>(0, 16 * kk));
                if constexpr (BN == 256) mmw_wgmma_n256<H>(acc, da, db);
                else if constexpr (BN == 128) mmw_wgmma_n128<H>(acc, da, db);
                else mmw_wgmma_n64<H>(acc, da, db);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            if (kt >= 1) {
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                mmw_fence_acc(acc);
                if (kt - 1 + MMW_STAGES < nk) mmw_bar_arrive(EMPTY0 + (kt - 1) % MMW_STAGES, MMW_BAR);
            }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        mmw_fence_acc(acc);
        // D fragment: per 8-token column block j, acc[4j], acc[4j+1] = (row g, tokens 2t4,
        // 2t4+1), acc[4j+2], acc[4j+3] = row g + 8; warp w of the group holds rows 16w..
        const int w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
        // Once every consumer's MMAs are done reading the ring, the fragment goes to
        // stage[token][column] (gate columns, then up columns for SWIGLU). Stored straight
        // from the fragments instead (4-byte stores of 8 outputs per token by the 4 consumer
        // warps alone), the fused SwiGLU ran 6% slower (MATMUL.md round 14).
        mmw_bar_sync(MMW_EPI_BAR, 2 * TM);
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int rr = 64 * c + 16 * w + g + (e >= 2 ? 8 : 0), t = 8 * j + 2 * t4 + (e & 1);
                const int col = SWIGLU && !TA ? (rr >> 4) * 8 + (rr & 7) + ((rr & 8) ? TM / 2 : 0) : rr;
                stage[t * MMW_SP(TM) + col] = acc[4 * j + e];
            }
        }
    }
    // ---- all warpgroups: the staged tile to `out`, 16-byte stores of 4 outputs along a
    // token's row (SWIGLU: silu(gate) · up computed here, 12 warps sharing the math that
    // the 4 consumer warps alone ran latency-bound: MATMUL.md round 14) ----
    if (producer) asm volatile("cp.async.wait_all;\n" ::: "memory");
    // KS: every block's partial tile staged and visible to the others before any reads.
    if (KS > 1) cluster_sync_all();
    else __syncthreads();
    constexpr int OUTS = SWIGLU ? TM / 2 : TM, NQ = OUTS / 4;
    constexpr int TR = BN / KS;  // token rows this block stores (KS: rows ks_rank · TR..)
    const int ob = oy * OUTS;
    const bool vec = n_out % 4 == 0 && ((unsigned long long)out & 15) == 0;
    for (int i = tid; i < TR * NQ; i += S::THREADS) {
        const int t = i / NQ + ks_rank * TR, q = i % NQ, tt = t0 + t, o = ob + 4 * q;
        if (tt >= rows || o >= n_out || (MMW_TSHIFT && tt < tn)) continue;
        const float* const sp = stage + t * MMW_SP(TM) + 4 * q;
        float4 v = *reinterpret_cast<const float4*>(sp);
        if constexpr (KS > 1) {
            // The KS partial sums of the same outputs added in rank order, this block's from its
            // own shared memory (the same sum whichever block stores it; at KS = 2 one addition).
            float4 a = ks_rank == 0 ? v : ld_cluster_f32x4(sp, 0);
#pragma unroll
            for (int r = 1; r < KS; r++) {
                const float4 u = r == ks_rank ? v : ld_cluster_f32x4(sp, r);
                a = make_float4(a.x + u.x, a.y + u.y, a.z + u.z, a.w + u.w);
            }
            v = a;
        }
        if constexpr (SWIGLU) {
            const float4 u = *reinterpret_cast<const float4*>(stage + t * MMW_SP(TM) + TM / 2 + 4 * q);
            v.x = swiglu_f(v.x, u.x);
            v.y = swiglu_f(v.y, u.y);
            v.z = swiglu_f(v.z, u.z);
            v.w = swiglu_f(v.w, u.w);
        }
        const size_t orow = MOE && !SWIGLU ? (size_t)mlist[tt] : (size_t)tt;
        if (SWIGLU && (MOE || TA) && hbf) {
            // The gate/up's h as 16-bit rows for the down (`out` holds uint16 then; n_out a
            // multiple of 64 so that the rows are the down's x scratch rows), rounded as the
            // conversion the down's input took before: the MoE experts' and BF16 weights' bf16
            // (pack_bf16, mm_x_bf16), F16 weights' f16 (pack_f16_sat, mmw_x_f16).
            uint16_t* dst16 = reinterpret_cast<uint16_t*>(out) + orow * n_out + o;
            if (o + 3 < n_out) {
                *reinterpret_cast<uint2*>(dst16) =
                    H ? make_uint2(pack_f16_sat(v.x, v.y), pack_f16_sat(v.z, v.w))
                      : make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
            } else {
                const float vs[4] = {v.x, v.y, v.z, v.w};
                for (int k = 0; k < 4 && o + k < n_out; k++)
                    dst16[k] = (uint16_t)((H ? pack_f16_sat(vs[k], 0.0f) : pack_bf16(vs[k], 0.0f)) & 0xFFFF);
            }
            continue;
        }
        float* dst = out + orow * n_out + o;
        if (vec && o + 3 < n_out) {
            *reinterpret_cast<float4*>(dst) = v;
        } else {
            const float vs[4] = {v.x, v.y, v.z, v.w};
            for (int k = 0; k < 4 && o + k < n_out; k++) dst[k] = vs[k];
        }
    }
    // KS: no block exits (its shared memory released) before the others have read it.
    if (KS > 1) cluster_sync_exec();
#else
    __trap();
#endif
}

// One launch for up to three weights that read the same x (the Q, K, V projections): the
// grid's output tiles are weight 0's, then from tile e1 weight 1's, from e2 weight 2's (e1 = e2
// = the tile count for fewer weights); each block takes its weight's pointer, row bytes,
// outputs and destination. K and V (1024 outputs each at Qwen3-8B) alone leave most SMs idle;
// with Q they fill the wide-tile grid (MATMUL.md round 13). Weights 0 and 1 are of type TA,
// weight 2 of TB: Q4_K_M stores V as Q6_K in half the layers, Q and K as Q4_K (the branch is
// uniform per block; the kernel holds both producers).
#define MMW_KERNEL1(name, TA, TB, TM, BN)                                                                   \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS(TM), 1) mmw_##name##_n##BN(                   \
        const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, const uint8_t* __restrict__ W2,    \
        long long rb0, long long rb1, long long rb2, int n0, int n1, int n2, int e1, int e2, int n_in,     \
        const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out0,                       \
        float* __restrict__ out1, float* __restrict__ out2 MMW_XMAP_PARAM MMW_WMAP_PARAM) {                \
        PDL_ENTRY();                                                                                        \
        const int y = blockIdx.y, g = (y >= e1) + (y >= e2);                                                \
        if (TA == TB || g < 2)                                                                              \
            mmw<TA, TM, BN>(g == 0 ? W0 : (g == 1 ? W1 : W2), nullptr, g == 0 ? rb0 : (g == 1 ? rb1 : rb2),   \
                            g == 0 ? n0 : (g == 1 ? n1 : n2), n_in, xb, kp, rows,                           \
                            g == 0 ? out0 : (g == 1 ? out1 : out2), y - (g == 0 ? 0 : (g == 1 ? e1 : e2)),  \
                            nullptr, 1, MMW_XMAP, 0, MMW_WMAP(g));                                          \
        else                                                                                                \
            mmw<TB, TM, BN>(W2, nullptr, rb2, n2, n_in, xb, kp, rows, out2, y - e2, nullptr, 1, MMW_XMAP, 0, \
                            MMW_WMAP(2));                                                                   \
    }
// The first half of a SwiGLU FFN in one launch: out = silu(gate · x) ⊙ (up · x), TM / 2
// outputs per block (`mmw_row`), no gate or up written.
#define MMW_SWIGLU1(name, TYPE, TM, BN)                                                                     \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS(TM), 1) mmw_swiglu_##name##_n##BN(            \
        const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long rb, int n_out, int n_in, \
        const uint16_t* __restrict__ xb, int kp, int rows,                                                 \
        float* __restrict__ out MMW_XMAP_PARAM MMW_WMAP2_PARAM) {                                          \
        PDL_ENTRY();                                                                                        \
        mmw<TYPE, TM, BN, true>(Wg, Wu, rb, n_out, n_in, xb, kp, rows, out, blockIdx.y, nullptr, 1, MMW_XMAP, \
                                0, MMW_WMAP2);                                                              \
    }
// n128, n64: 128 outputs (two consumer warpgroups); n256: 64 outputs × 256 tokens (one consumer
// warpgroup, m64n256: each decoded weight serves twice the tokens).
#define MMW_KERNEL(name, TYPE)                                                                              \
    MMW_KERNEL1(name, TYPE, TYPE, 128, 128)                                                                 \
    MMW_KERNEL1(name, TYPE, TYPE, 128, 64)                                                                  \
    MMW_KERNEL1(name, TYPE, TYPE, 64, 256)                                                                  \
    MMW_SWIGLU1(name, TYPE, 128, 128)                                                                       \
    MMW_SWIGLU1(name, TYPE, 128, 64)                                                                        \
    MMW_SWIGLU1(name, TYPE, 64, 256)

// The block's weight rows (`bytes` from p: one expert's output tile, contiguous) into L2 by one
// bulk prefetch at the block's start: an expert's rows serve only its tile's few pairs, so
// unlike the dense launches' (read by every token tile of a weight tile at once, from L2) they
// come from DRAM, and the producers' two steps of raw loads in flight (MMW_RAW) would pay
// DRAM's latency on every step. The range widened to 16-byte bounds (prefetch_l2's rule).
// Only where a block's rows are at most MMW_MOE_PF_MAX bytes: one block an SM, so 132 of
// them then claim ≤ 42 MB of L2; BF16 gate/up rows (512 KB a block) evicted each other's
// before use and lost 12% at rows=64 (Q4_K, Q6_K, Q8_0 gained 3-6%: MOE.md).
#define MMW_MOE_PF_MAX (320 * 1024)
__device__ __forceinline__ void mmw_moe_prefetch(const uint8_t* p, size_t bytes) {
    if (threadIdx.x == 0 && bytes > 0) {
        const size_t a = (size_t)p & ~(size_t)15, b = ((size_t)p + bytes + 15) & ~(size_t)15;
        prefetch_l2((const void*)a, (unsigned int)(b - a));
    }
}
#define MMW_MOE_ROWS(o0, n, n_out) ((size_t)((o0) + (n) <= (n_out) ? (n) : ((n_out) > (o0) ? (n_out) - (o0) : 0)))

// The grouped expert GEMMs of a MoE prefill (moe.rs `grouped_experts`; MOE.md, 41st session):
// moe.cu's moe_sort orders the (token, slot) pairs by expert into tiles of 64 (GM_TN there,
// BN here) and writes the tile table; block (x, y) takes tile x (surplus tiles of the
// worst-case grid exit at once) and output tile y of the tile's expert, on the wgmma pipeline
// above (TM × 64 tiles: MMW_MOE, MMW_MOE2 below). Gate/up: W, W2 the gate and up experts [n_experts, ffn, hidden], x
// the bf16 scratch of the tokens' rows (gathered per pair), h[list position][ffn] = silu(gate)
// ⊙ up in f32. Down: W the down experts [n_experts, hidden, ffn], xb the bf16 copy of h, y[pair]
// [hidden] in f32; moe_combine then adds each token's slots in top-k order. The numerics of
// moe.cu's mma.sync forms (bf16 x, h and weights, f32 accumulation; the order of the f32
// additions inside a K step differs).
// One form of the grouped GEMMs: `mmw_<form>_gu_<type>_n64` and `mmw_<form>_down_<type>_n64` on
// TM-output tiles at BPS blocks an SM (the L2 prefetch's cap shared between them).
#define MMW_MOE_FORM(form, name, TYPE, TM, BPS) MMW_MOE_FORM_P(form, name, TYPE, TM, BPS, MMW_PRODUCERS)
#define MMW_MOE_FORM_P(form, name, TYPE, TM, BPS, P)                                                      \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS_P(TM, P), BPS) mmw_##form##_gu_##name##_n64(  \
        const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long rb, int n_out, int n_in, \
        const uint16_t* __restrict__ xb, int kp, const int* __restrict__ offsets,                          \
        const int* __restrict__ n_tiles, const int* __restrict__ tiles, const int* __restrict__ list,      \
        int top_k, float* __restrict__ h, int h_bf16 MMW_GU_XMAP_PARAM MMW_WMAP2_PARAM) {                   \
        PDL_ENTRY();                                                                                        \
        int tile = blockIdx.x, oy = blockIdx.y;                                                             \
        if (MMW_GU_XG & 2) { /* tile-major: block b = tile · gridDim.y + oy */                              \
            const unsigned b = blockIdx.x + gridDim.x * blockIdx.y;                                         \
            tile = (int)(b / gridDim.y), oy = (int)(b % gridDim.y);                                         \
        }                                                                                                   \
        if (tile >= *n_tiles) return; /* whole block, before any barrier */                                 \
        const int e = tiles[2 * tile], start = tiles[2 * tile + 1];                                         \
        const int cnt = min(64, offsets[e + 1] - start);                                                    \
        const size_t eo = (size_t)e * (size_t)n_out * (size_t)rb;                                           \
        const int o0 = oy * ((TM) / 2);                                                                     \
        const size_t span = MMW_MOE_ROWS(o0, (TM) / 2, n_out) * (size_t)rb;                                 \
        if (2 * (BPS) * span <= MMW_MOE_PF_MAX) {                                                           \
            mmw_moe_prefetch(Wg + eo + (size_t)o0 * (size_t)rb, span);                                      \
            mmw_moe_prefetch(Wu + eo + (size_t)o0 * (size_t)rb, span);                                      \
        }                                                                                                   \
        /* h_bf16: h holds uint16 rows (bf16; the down reads them as its x scratch) */                     \
        float* const ht = h_bf16 ? reinterpret_cast<float*>(reinterpret_cast<uint16_t*>(h) +               \
                                                            (size_t)start * (size_t)n_out)                  \
                                 : h + (size_t)start * (size_t)n_out;                                       \
        mmw<TYPE, TM, 64, true, true, BPS, false, P>(Wg + eo, Wu + eo, rb, n_out, n_in, xb, kp, cnt, ht,    \
                                           oy, list + start, top_k, MMW_GU_XMAP(start), MMW_WMAP2,          \
                                           e * n_out, h_bf16);                                              \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS_P(TM, P), BPS) mmw_##form##_down_##name##_n64( \
        const uint8_t* __restrict__ W, long long rb, int n_out, int n_in, const uint16_t* __restrict__ hb,  \
        int kp, const int* __restrict__ offsets, const int* __restrict__ n_tiles,                          \
        const int* __restrict__ tiles, const int* __restrict__ list,                                       \
        float* __restrict__ y MMW_XMAP_PARAM MMW_WMAP1_PARAM) {                                            \
        PDL_ENTRY();                                                                                        \
        const int tile = blockIdx.x;                                                                        \
        if (tile >= *n_tiles) return;                                                                       \
        const int e = tiles[2 * tile], start = tiles[2 * tile + 1];                                         \
        const int cnt = min(64, offsets[e + 1] - start);                                                    \
        const size_t eo = (size_t)e * (size_t)n_out * (size_t)rb;                                           \
        const int o0 = blockIdx.y * (TM);                                                                   \
        const size_t span = MMW_MOE_ROWS(o0, TM, n_out) * (size_t)rb;                                       \
        if ((BPS) * span <= MMW_MOE_PF_MAX) mmw_moe_prefetch(W + eo + (size_t)o0 * (size_t)rb, span);       \
        mmw<TYPE, TM, 64, false, true, BPS, false, P>(W + eo, nullptr, rb, n_out, n_in,                     \
                                            hb + (size_t)start * (size_t)kp, kp, cnt, y, blockIdx.y,        \
                                            list + start, 1, MMW_XMAP, start, MMW_WMAP1, nullptr, nullptr,  \
                                            e * n_out);                                                     \
    }
// `FERRITE_MMW_MOE=1`: 128-output tiles (two consumer warpgroups), one block an SM.
#define MMW_MOE(name, TYPE) MMW_MOE_FORM(moe, name, TYPE, 128, 1)

// mmw_moe2_{gu,down}_<type>_n64 (the default, `FERRITE_MMW_MOE=2`): the same on 64-output
// tiles (one consumer warpgroup, 384 threads) with 6 stages (97 KB), two blocks an SM, so that
// one block's step waits (about one load round trip each: MOE.md) overlap the other's.
// Gate/up: 32 outputs a block. Qwen3-30B-A3B pp512 +9.7% over the form above (H100; MOE.md,
// 42nd session).
#define MMW_MOE2(name, TYPE) MMW_MOE_FORM(moe2, name, TYPE, 64, 2)

// mmw_moe3_{gu,down}_q4_k_n64 (`FERRITE_MMW_MOE=3`, RS only): the RS Q4_K form on 64-output
// tiles with one producer warpgroup (thread 0's tensor copies; the gate/up's gathered x rows,
// four cp.async a thread a step), 256 threads, six stages of 11 KB (raw A rows of 48 bytes),
// three blocks an SM: a third more consumer warps an SM to hide their decode's latency.
// moe2's 74-75 registers fit the 85 of three 256-thread blocks (at that cap ptxas serializes
// the wgmmas, C7512, as it does moe2's: MOE.md, 48th session). Other types keep moe2.
#if MMW_RS
MMW_MOE_FORM_P(moe3, q4_k, GGML_Q4_K, 64, 3, 1)
#endif
// mmw_moe3_{gu,down}_q6_k_n64: the same for the RS Q6_K experts (MMW_RS_Q6_MOE; three stages
// of 19 KB: raw A rows of MMW_RS_Q6_ROW bytes).
#if MMW_RS && MMW_RS_Q6 && MMW_RS_Q6_MOE
MMW_MOE_FORM_P(moe3, q6_k, GGML_Q6_K, 64, 3, 1)
#endif
// mmw_moe4w_{gu,down}_q4_k_n64 and mmw_moe3w_{gu,down}_q6_k_n64 (`FERRITE_MMW_MOE=4`, the default:
// pp512 +1.0% / +3.7% on Qwen3-30B-A3B / Qwen3.5-35B-A3B over moe3; MOE.md, 48th and 49th
// sessions): the RS experts' blocks as one consumer warpgroup (warps 0-3)
// and one producer warp (thread 0's tensor copies; the gate/up's gathered x rows, 16 cp.async a
// lane a step), 160 threads. moe3's 256-thread blocks cap a thread at 80 registers, under which
// ptxas serializes the wgmmas (C7512, "insufficient register resources": each waits for the one
// before); at 160 threads Q4_K's four blocks an SM leave 96 (its kernels take 95 at two blocks
// an SM unserialized) and Q6_K's three, 136 (108).
#if MMW_RS
MMW_MOE_FORM_P(moe4w, q4_k, GGML_Q4_K, 64, 4, 0)
#endif
#if MMW_RS && MMW_RS_Q6 && MMW_RS_Q6_MOE
MMW_MOE_FORM_P(moe3w, q6_k, GGML_Q6_K, 64, 3, 0)
#endif

MMW_MOE(f32, GGML_F32)
MMW_MOE2(f32, GGML_F32)
MMW_MOE(f16, GGML_F16)
MMW_MOE2(f16, GGML_F16)
MMW_MOE(bf16, GGML_BF16)
MMW_MOE2(bf16, GGML_BF16)
MMW_MOE(q8_0, GGML_Q8_0)
MMW_MOE2(q8_0, GGML_Q8_0)
MMW_MOE(q4_0, GGML_Q4_0)
MMW_MOE2(q4_0, GGML_Q4_0)
MMW_MOE(q4_1, GGML_Q4_1)
MMW_MOE2(q4_1, GGML_Q4_1)
MMW_MOE(q4_k, GGML_Q4_K)
MMW_MOE2(q4_k, GGML_Q4_K)
MMW_MOE(q5_k, GGML_Q5_K)
MMW_MOE2(q5_k, GGML_Q5_K)
MMW_MOE(q6_k, GGML_Q6_K)
MMW_MOE2(q6_k, GGML_Q6_K)

MMW_KERNEL(f32, GGML_F32)
MMW_KERNEL(f16, GGML_F16)
MMW_KERNEL(bf16, GGML_BF16)
MMW_KERNEL(q8_0, GGML_Q8_0)
MMW_KERNEL(q4_0, GGML_Q4_0)
MMW_KERNEL(q4_1, GGML_Q4_1)
MMW_KERNEL(q4_k, GGML_Q4_K)
MMW_KERNEL(q5_k, GGML_Q5_K)
MMW_KERNEL(q6_k, GGML_Q6_K)
// The register-A form on the 64 × 256 tile (MMW_RS; `FERRITE_MMW_RSW`, MATMUL.md round 85):
// one consumer warpgroup decodes its 64 rows' A fragments for 256 tokens (the decode per
// FLOP of the producers' wide tile, without the producers' stores and fence), beside one
// producer warpgroup (thread 0's tensor copies), so that its 128 accumulators and two A
// register sets fit: 256 threads, up to 255 registers. The RS types' weights and the mixed Q, K,
// V below (MMW_KERNEL1's and MMW_SWIGLU1's parameters).
#if MMW_RS
// MMW_RSW_KERNEL1: MMW_KERNEL1's grouped launch on this tile (weights 0 and 1 of type TA, weight
// 2 of TB, each block the form of its weight's type). MMW_RSW_SEL: weight g's value of a, b, c in
// the TA branch (`same`: TA == TB; otherwise only weights 0 and 1 come there).
#define MMW_RSW_SEL(same, a, b, c) ((same) ? (g == 0 ? (a) : (g == 1 ? (b) : (c))) : (g == 0 ? (a) : (b)))
#define MMW_RSW_KERNEL1(name, TA, TB)                                                                       \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS_P(64, 1), 1) mmw_rsw_##name##_n256(           \
        const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, const uint8_t* __restrict__ W2,    \
        long long rb0, long long rb1, long long rb2, int n0, int n1, int n2, int e1, int e2, int n_in,     \
        const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out0,                       \
        float* __restrict__ out1, float* __restrict__ out2 MMW_XMAP_PARAM MMW_WMAP_PARAM) {                \
        PDL_ENTRY();                                                                                        \
        const int y = blockIdx.y, g = (y >= e1) + (y >= e2);                                                \
        if (TA == TB || g < 2)                                                                              \
            mmw<TA, 64, 256, false, false, 1, false, 1>(                                                    \
                MMW_RSW_SEL(TA == TB, W0, W1, W2), nullptr, MMW_RSW_SEL(TA == TB, rb0, rb1, rb2),            \
                MMW_RSW_SEL(TA == TB, n0, n1, n2), n_in, xb, kp, rows, MMW_RSW_SEL(TA == TB, out0, out1, out2),\
                y - MMW_RSW_SEL(TA == TB, 0, e1, e2), nullptr, 1, MMW_XMAP, 0, MMW_WMAP(g));                 \
        else                                                                                                \
            mmw<TB, 64, 256, false, false, 1, false, 1>(W2, nullptr, rb2, n2, n_in, xb, kp, rows, out2,     \
                                                        y - e2, nullptr, 1, MMW_XMAP, 0, MMW_WMAP(2));      \
    }
#define MMW_RSW_KERNEL(name, TYPE)                                                                          \
    MMW_RSW_KERNEL1(name, TYPE, TYPE)                                                                       \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS_P(64, 1), 1) mmw_rsw_swiglu_##name##_n256(    \
        const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long rb, int n_out, int n_in, \
        const uint16_t* __restrict__ xb, int kp, int rows,                                                 \
        float* __restrict__ out MMW_XMAP_PARAM MMW_WMAP2_PARAM) {                                          \
        PDL_ENTRY();                                                                                        \
        mmw<TYPE, 64, 256, true, false, 1, false, 1>(Wg, Wu, rb, n_out, n_in, xb, kp, rows, out, blockIdx.y, \
                                                     nullptr, 1, MMW_XMAP, 0, MMW_WMAP2);                   \
    }
MMW_RSW_KERNEL(q4_k, GGML_Q4_K)
#if MMW_RS_Q8
MMW_RSW_KERNEL(q8_0, GGML_Q8_0)
#endif
#if MMW_RS_Q6
MMW_RSW_KERNEL(q6_k, GGML_Q6_K)
#endif
#if MMW_RS_Q5
MMW_RSW_KERNEL(q5_k, GGML_Q5_K)
#endif
// mmw_rsw_q4_k_q6_k_n256 (`FERRITE_MMW_RSW_MIXED`, default 1; MATMUL.md round 89): MMW_KERNEL1's
// mixed Q, K, V of Q4_K_M (weights 0 and 1 Q4_K, weight 2 Q6_K) on the RS wide tile, each block
// the form of its weight's type (the branch uniform per block), where the producers' mixed wide
// tile (`mmw_q4_k_q6_k_n256`) took 55 µs a Qwen3-30B-A3B layer against the all-Q4_K layers'
// `mmw_rsw_q4_k_n256` 35 (H100). mmw.rs smem() sizes the ring for both forms.
#if MMW_RS_Q6
MMW_RSW_KERNEL1(q4_k_q6_k, GGML_Q4_K, GGML_Q6_K)
#endif
#endif
// Mixed groups (weights 0, 1 of the first type, weight 2 of the second): Q4_K_M's Q, K, V.
MMW_KERNEL1(q4_k_q6_k, GGML_Q4_K, GGML_Q6_K, 128, 128)
MMW_KERNEL1(q4_k_q6_k, GGML_Q4_K, GGML_Q6_K, 128, 64)
MMW_KERNEL1(q4_k_q6_k, GGML_Q4_K, GGML_Q6_K, 64, 256)

// ---- The TA form (16-bit weights, `FERRITE_MMW_TA`; MATMUL.md round 84) ----
// A Hopper GEMM as the hardware intends it: producer thread 0 brings each stage's weight rows
// and x tile by tensor copies in the 128-byte swizzle that the wgmma descriptors read, and the
// consumers' MMAs are all the block computes; the weights are used as stored (BF16 with the
// bf16 x scratch, exactly the producers' numerics; F16 with an f16 x scratch, mmw_x_f16, and
// f16 wgmma, where the producers round both to bf16). The kernels are MMW_KERNEL1's and
// MMW_SWIGLU1's with x's tensor map and the weights' (boxes of a tile's rows: TM, or TM / 2
// for the gate and the up) as their last parameters; the SwiGLU ones then `hbf` (1: h written as
// the down's 16-bit x rows instead of f32, mmw.rs swiglu_mlp; MATMUL.md round 96).
// MMW_TA_KERNEL1P / MMW_TA_SWIGLU1P: the kernel `kname` on tile TM × BN with P producer
// warpgroups (0: one producer warp).
#define MMW_TA_KERNEL1P(kname, TYPE, TM, BN, P) MMW_TA_KERNEL1PK(kname, TYPE, TM, BN, P, 1)
// ... with the K steps split between the KS blocks of a cluster along the grid's z.
#define MMW_TA_KERNEL1PK(kname, TYPE, TM, BN, P, KS)                                                        \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS_P(TM, P), 1) kname(                            \
        const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, const uint8_t* __restrict__ W2,    \
        long long rb0, long long rb1, long long rb2, int n0, int n1, int n2, int e1, int e2, int n_in,     \
        const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out0,                       \
        float* __restrict__ out1, float* __restrict__ out2, const __grid_constant__ MmwTmap xmap,           \
        const __grid_constant__ MmwTmap wm0, const __grid_constant__ MmwTmap wm1,                          \
        const __grid_constant__ MmwTmap wm2) {                                                             \
        PDL_ENTRY();                                                                                        \
        const int y = blockIdx.y, g = (y >= e1) + (y >= e2);                                                \
        mmw<TYPE, TM, BN, false, false, 1, true, P, KS>(                                                    \
            g == 0 ? W0 : (g == 1 ? W1 : W2), nullptr, g == 0 ? rb0 : (g == 1 ? rb1 : rb2),                  \
            g == 0 ? n0 : (g == 1 ? n1 : n2), n_in, xb, kp, rows, g == 0 ? out0 : (g == 1 ? out1 : out2),    \
            y - (g == 0 ? 0 : (g == 1 ? e1 : e2)), nullptr, 1, &xmap, 0,                                    \
            g == 0 ? &wm0 : (g == 1 ? &wm1 : &wm2));                                                        \
    }
#define MMW_TA_SWIGLU1P(kname, TYPE, TM, BN, P)                                                             \
    extern "C" __global__ void __launch_bounds__(MMW_THREADS_P(TM, P), 1) kname(                            \
        const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long rb, int n_out, int n_in, \
        const uint16_t* __restrict__ xb, int kp, int rows, float* __restrict__ out,                        \
        const __grid_constant__ MmwTmap xmap, const __grid_constant__ MmwTmap wg,                          \
        const __grid_constant__ MmwTmap wu, int hbf) {                                                     \
        PDL_ENTRY();                                                                                        \
        mmw<TYPE, TM, BN, true, false, 1, true, P>(Wg, Wu, rb, n_out, n_in, xb, kp, rows, out, blockIdx.y,  \
                                                   nullptr, 1, &xmap, 0, &wg, nullptr, &wu, nullptr, 0,     \
                                                   hbf);                                                    \
    }
#define MMW_TA_KERNEL1(name, TYPE, TM, BN) MMW_TA_KERNEL1P(mmw_ta_##name##_n##BN, TYPE, TM, BN, MMW_PRODUCERS)
#define MMW_TA_SWIGLU1(name, TYPE, TM, BN) \
    MMW_TA_SWIGLU1P(mmw_ta_swiglu_##name##_n##BN, TYPE, TM, BN, MMW_PRODUCERS)
// The 128 × 256 tile (`mmw_ta_*_w`; MATMUL.md round 92): two consumer warpgroups of m64n256
// (128 accumulators a thread) and one producer warp (P = 0: 288 threads, a ceiling of 224
// registers), four 48 KB stages. A step's 48 KB of copies feed 1,024 tensor-core cycles
// against the 32 KB a 512 of the 128 × 128 tile and the 40 KB a 512 of the 64 × 256 one.
#define MMW_TA_KERNEL1W(name, TYPE)                              \
    MMW_TA_KERNEL1P(mmw_ta_##name##_w, TYPE, 128, 256, 0)        \
    MMW_TA_KERNEL1PK(mmw_ta_##name##_wk, TYPE, 128, 256, 0, 2)   \
    MMW_TA_KERNEL1PK(mmw_ta_##name##_wk4, TYPE, 128, 256, 0, 4)  \
    MMW_TA_SWIGLU1P(mmw_ta_swiglu_##name##_w, TYPE, 128, 256, 0)
#define MMW_TA_KERNEL(name, TYPE)                                                                           \
    MMW_TA_KERNEL1(name, TYPE, 128, 128)                                                                    \
    MMW_TA_KERNEL1(name, TYPE, 128, 64)                                                                     \
    MMW_TA_KERNEL1(name, TYPE, 64, 256)                                                                     \
    MMW_TA_SWIGLU1(name, TYPE, 128, 128)                                                                    \
    MMW_TA_SWIGLU1(name, TYPE, 128, 64)                                                                     \
    MMW_TA_SWIGLU1(name, TYPE, 64, 256)                                                                     \
    MMW_TA_KERNEL1W(name, TYPE)
MMW_TA_KERNEL(f16, GGML_F16)
MMW_TA_KERNEL(bf16, GGML_BF16)

// ---- The concatenated 192-output tile (`mmw_ta_<type>_ck`; MATMUL.md round 100) ----
// Q, K and V of a 16-bit model in one wave. At Qwen3-8B's 512 rows their 4096 + 1024 + 1024
// outputs make 48 tiles of the 128 × 256 wide tile, 192 blocks with K split in two: 1.45 waves
// on 132 SMs, two waves of half-K blocks (59 µs on an H100 against cuBLAS's 38). Taken one after
// another, their rows make 32 tiles of 192 outputs: 128 half-K blocks, one wave of blocks 1.5×
// as long, three quarters of the time.
//
// The plan, per block (192 outputs × 256 tokens × half of K; a cluster of the two K halves
// along z, as `mmw_ta_*_wk`):
// - Tile rows: rows oy · 192.. of the weights' rows one after another (weight 0's n0, then
//   weight 1's n1, weight 2's n2; each a multiple of 64, so that a 64-row box is one weight's).
//   Stage A: three 64-row boxes, each by the tensor map of the weight holding it (a box past the
//   last weight's rows reads weight 0's first 64; those outputs are not stored); stage B: x's box
//   of the 256 tokens. 56 KB a stage in the 128-byte swizzle, four stages (224 KB).
// - Two warpgroups and no producer warp: 192 × 256 f32 accumulators are 192 a thread over 256
//   threads (a producer warp would cap every thread at 168 registers, and a producer warpgroup
//   at 128: the SM's four register files hold a quarter of the warps each; setmaxnreg cannot
//   lift ptxas's limit). Warpgroup w issues per k16 an m64n256k16 on rows 64w.. (all tokens)
//   and an m64n128k16 on rows 128.. (tokens 128w..): 192 tensor-core cycles each, 24 K MACs.
// - Thread 0 issues the tensor copies: the first four steps at the start, then step kt - 1 + 4
//   once both warpgroups have released step kt - 1's stage (an mbarrier of two arrivals, one a
//   warpgroup after its wgmma.wait_group), three steps of copies in flight.
// - Epilogue as the wide tile's K split: the fragments staged as [token][output] f32 in the
//   ring, a cluster barrier, block r stores token rows 128 r.. of the tile, each output its
//   own partial sum plus the other block's (DSMEM): the same K halves, in the same order, as
//   `mmw_ta_*_wk`, so the same sums. Output o of the concatenation goes to out[g] column o
//   minus weight g's first row.
#define MMW_CAT_TM 192
#define MMW_CAT_BN 256
#define MMW_CAT_STAGES 4
#define MMW_CAT_STAGE ((MMW_CAT_TM + MMW_CAT_BN) * MMW_TK * 2)
#define MMW_CAT_SP (MMW_CAT_TM + 4)  // the staged tile's row pitch in floats (as MMW_SP)
static_assert(MMW_CAT_BN * MMW_CAT_SP * 4 <= MMW_CAT_STAGES * MMW_CAT_STAGE, "the staged epilogue must fit the ring");

struct MmwCat {
    const MmwTmap* map[3];  // the weights' tensor maps, boxes of 64 rows
    float* out[3];          // their outputs, [rows][n[g]]
    int n[3];               // their output counts, multiples of 64
};
// The weight holding row r of the concatenation, and that weight's first row; element g of a
// field by selects (indexed, the struct went to the stack: 64 bytes, 44 local loads and stores).
__device__ __forceinline__ int mmw_cat_g(const MmwCat& c, int r) { return (r >= c.n[0]) + (r >= c.n[0] + c.n[1]); }
template <typename T>
__device__ __forceinline__ T mmw_cat_sel(const T (&f)[3], int g) {
    return g == 0 ? f[0] : (g == 1 ? f[1] : f[2]);
}
__device__ __forceinline__ int mmw_cat_first(const MmwCat& c, int g) {
    return g == 0 ? 0 : (g == 1 ? c.n[0] : c.n[0] + c.n[1]);
}

template <int TYPE>
__device__ __forceinline__ void mmw_cat(const MmwCat& cat, const MmwTmap* xmap, int kp, int rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool H = TYPE == GGML_F16;
    constexpr int S = MMW_CAT_STAGES;
    extern __shared__ __align__(1024) uint8_t mmw_smem[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(mmw_smem);
    const uint32_t s0 = (sbase + 1023u) & ~1023u;
    float* const stage = reinterpret_cast<float*>(mmw_smem + (s0 - sbase));
    const uint32_t full0 = s0 + S * MMW_CAT_STAGE, empty0 = full0 + 8 * S;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int oy = blockIdx.y, tn = blockIdx.x * MMW_CAT_BN;
    const int t0 = mmw_t0(tn, rows, MMW_CAT_BN);
    const int rank = cluster_rank();
    int kb, nk;
    mmw_k_part(kp, 2, rank, kb, nk);
    const int n_out = cat.n[0] + cat.n[1] + cat.n[2];
    if (tid == 0) {
        for (int i = 0; i < S; i++) {
            mmw_mbar_init(full0 + 8 * i);
            mmw_mbar_init(empty0 + 8 * i, 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Thread 0: step kt's boxes into its stage.
    auto issue = [&](int kt) {
        const int s = kt % S;
        const uint32_t st = s0 + s * MMW_CAT_STAGE, bar = full0 + 8 * s;
        const int k = (kb + kt) * MMW_TK;
        mmw_expect(bar, (uint32_t)MMW_CAT_STAGE);
        mmw_tma(st + MMW_CAT_TM * 128, xmap, k, t0, bar);
#pragma unroll
        for (int j = 0; j < 3; j++) {
            // (A box past the last weight's rows reads weight 0's first 64 rows.)
            const int rj = oy * MMW_CAT_TM + 64 * j, r = rj < n_out ? rj : 0, g = mmw_cat_g(cat, r);
            mmw_tma(st + j * 64 * 128, mmw_cat_sel(cat.map, g), k, r - mmw_cat_first(cat, g), bar);
        }
    };
    if (tid == 0)
        for (int kt = 0; kt < S && kt < nk; kt++) issue(kt);

    float acc[128], acc2[64];  // rows 64 wg.. × tokens 0..255; rows 128.. × tokens 128 wg..
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++) acc2[i] = 0.0f;
    // The zeros in their registers before the first wgmma (ptxas sank acc2's zeros between the
    // first step's wgmmas and then ran every wgmma alone: its C7515).
    mmw_fence_acc(acc);
    mmw_fence_acc(acc2);
    for (int kt = 0; kt < nk; kt++) {
        const int s = kt % S;
        mmw_mbar_wait(full0 + 8 * s, (uint32_t)((kt / S) & 1));
        const uint32_t st = s0 + s * MMW_CAT_STAGE, b = st + MMW_CAT_TM * 128;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        // The step's four k16 wgmmas on each accumulator set, chained (one commit group).
#pragma unroll
        for (int kk = 0; kk < MMW_TK / 16; kk++) {
            const uint32_t ko = mmw_off<64>(0, 16 * kk);
            mmw_wgmma_n256<H>(acc, mmw_desc<64>(st + 64 * wg * 128 + ko), mmw_desc<256>(b + ko));
        }
#pragma unroll
        for (int kk = 0; kk < MMW_TK / 16; kk++) {
            const uint32_t ko = mmw_off<64>(0, 16 * kk);
            mmw_wgmma_n128<H>(acc2, mmw_desc<64>(st + 128 * 128 + ko), mmw_desc<128>(b + 128 * wg * 128 + ko));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (kt >= 1) {
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            mmw_fence_acc(acc);
            mmw_fence_acc(acc2);
            const int sp = (kt - 1) % S;
            if ((tid & 127) == 0)
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty0 + 8 * sp) : "memory");
            if (tid == 0 && kt - 1 + S < nk) {
                mmw_mbar_wait(empty0 + 8 * sp, (uint32_t)(((kt - 1) / S) & 1));
                issue(kt - 1 + S);
            }
        }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    mmw_fence_acc(acc);
    mmw_fence_acc(acc2);
    // Both warpgroups' MMAs done reading the ring: the fragments to stage[token][output].
    __syncthreads();
    const int w = (tid >> 5) & 3, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int j = 0; j < 32; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            stage[(8 * j + 2 * t4 + (e & 1)) * MMW_CAT_SP + 64 * wg + 16 * w + g8 + (e >= 2 ? 8 : 0)] = acc[4 * j + e];
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            stage[(128 * wg + 8 * j + 2 * t4 + (e & 1)) * MMW_CAT_SP + 128 + 16 * w + g8 + (e >= 2 ? 8 : 0)] =
                acc2[4 * j + e];
    // Both blocks' partial tiles staged and visible to each other.
    cluster_sync_all();
    constexpr int NQ = MMW_CAT_TM / 4, TR = MMW_CAT_BN / 2;
    for (int i = tid; i < TR * NQ; i += 256) {
        const int t = i / NQ + rank * TR, q = i % NQ, tt = t0 + t, o = oy * MMW_CAT_TM + 4 * q;
        if (tt >= rows || o >= n_out || (MMW_TSHIFT && tt < tn)) continue;
        const float* const sp = stage + t * MMW_CAT_SP + 4 * q;
        const float4 v = *reinterpret_cast<const float4*>(sp), u = ld_cluster_f32x4(sp, rank ^ 1);
        const float4 a = make_float4(v.x + u.x, v.y + u.y, v.z + u.z, v.w + u.w);
        const int g = mmw_cat_g(cat, o);
        float* const dst =
            mmw_cat_sel(cat.out, g) + (size_t)tt * mmw_cat_sel(cat.n, g) + (o - mmw_cat_first(cat, g));
        if ((((unsigned long long)dst) & 15) == 0) *reinterpret_cast<float4*>(dst) = a;
        else dst[0] = a.x, dst[1] = a.y, dst[2] = a.z, dst[3] = a.w;
    }
    // No block leaves (its shared memory released) before the other has read it.
    cluster_sync_exec();
#else
    __trap();
#endif
}
#define MMW_TA_CAT(name, TYPE)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1) mmw_ta_##name##_ck(                               \
        int n0, int n1, int n2, int kp, int rows, float* __restrict__ out0, float* __restrict__ out1,      \
        float* __restrict__ out2, const __grid_constant__ MmwTmap xmap, const __grid_constant__ MmwTmap wm0, \
        const __grid_constant__ MmwTmap wm1, const __grid_constant__ MmwTmap wm2) {                        \
        PDL_ENTRY();                                                                                        \
        const MmwCat cat = {{&wm0, &wm1, &wm2}, {out0, out1, out2}, {n0, n1, n2}};                         \
        mmw_cat<TYPE>(cat, &xmap, kp, rows);                                                                \
    }
MMW_TA_CAT(f16, GGML_F16)
MMW_TA_CAT(bf16, GGML_BF16)

// A MoE prefill's x gathered into list order for the gate/up's tensor copies (MMW_GU_XG bit 1):
// xg [pairs, kp] bf16, row p the row of pair list[p]'s token (list[p] / top_k) of x [rows, n_in]
// f32, rounded as mm_x_bf16 rounds it (x_scratch16), so the gate/up multiplies the same bf16
// values. One thread writes 8 columns (16 bytes) of one row.
extern "C" __global__ void __launch_bounds__(256)
    mmw_moe_x_gather(const float* __restrict__ x, int pairs, int n_in, int kp, const int* __restrict__ list,
                     int top_k, uint16_t* __restrict__ xg) {
    PDL_ENTRY();
    x_scratch16<false>(x, pairs, n_in, kp, xg, list, top_k);
}

// x [rows, n_in] f32 -> xb [rows, kp] f16 for the TA form's F16 weights (mm_x_bf16's form:
// mm_decode.cuh x_scratch16, values beyond f16's range saturated).
extern "C" __global__ void __launch_bounds__(256)
    mmw_x_f16(const float* __restrict__ x, int rows, int n_in, int kp, uint16_t* __restrict__ xb) {
    PDL_ENTRY();
    x_scratch16<true>(x, rows, n_in, kp, xb);
}
