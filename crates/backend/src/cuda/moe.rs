//! Mixture-of-experts launchers (`kernels/moe.cu`): device-side top-k routing, the expert
//! gate/up GEMVs with SwiGLU, and the expert down GEMVs fused with the weighted combine.
//!
//! Decode with quantized expert weights (the usual case; also exact prefill): two launches
//! per layer on int8-quantized activations (matmul.cu section 1c, [`quantized_experts`]):
//! gate/up + SwiGLU with in-kernel routing and in-kernel quantization of h, then down +
//! combine with its own in-kernel routing. Other decode (float experts): three launches
//! (route, gate/up, down + combine), f32 math. Prefill (more rows): route, a device-side counting sort of the
//! (token, slot) pairs by expert, a grouped gate/up+SwiGLU GEMM and a grouped down GEMM on
//! the tensor cores (bf16 inputs, f32 accumulation; on sm_90a mmw.cu's wgmma pipeline,
//! [`super::mmw::moe_gate_up`] / [`super::mmw::moe_down`], elsewhere moe.cu's mma.sync
//! kernels), then the combine in top-k order. No
//! launch depends on host knowledge of the routing (grids are sized from the worst case),
//! so a captured graph replays correctly whatever experts the tokens pick. Scratch
//! buffers (routing ids/weights, SwiGLU activations) live in [`Kernels`] and grow on first
//! use with a bigger shape; the engine runs its first decode step eagerly before capturing,
//! so no allocation ever happens inside a capture. Buffers replaced by a bigger one are kept
//! alive (not freed) because an earlier captured graph may still point at them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use anyhow::{ensure, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    ValidAsZeroBits,
};
use ferrite_formats::GgmlType;

/// Kernel source.
pub const SRC: &str = include_str!("kernels/moe.cu");

use super::launch::{KernelArg, LaunchExt};
use super::{function, load_module, matmul, CudaBackend, CudaWeight};
use crate::{Act, ExpertWeights, MixerPoint, MoeRouting};

/// Warps per block of the expert kernels (`MOE_WARPS` in moe.cu).
const MOE_WARPS: usize = 8;
/// The routing kernel keeps one f32 per expert in shared memory (48 KiB default limit).
const MAX_EXPERTS: usize = 8192;
/// moe_down keeps every slot's partial result of its rows in shared memory.
const MAX_TOP_K: usize = 64;

/// Router width of the quantized-activation path's in-kernel routing (`MOE_ROUTE_MAX` in
/// matmul.cu: the probabilities sit in shared memory).
const MOE_ROUTE_MAX: usize = 1024;
/// Dynamic shared memory the quantized-activation expert kernels take for their bulk-copied
/// weight rows (sm_90+), at most: the limit raised when matmul.rs loads them (two blocks per
/// SM fit in an H200's 228 KB) or, when raising fails, under the 48 KB a launch gets without
/// opting in with room for their ~7 KB of static shared memory. Bigger spans: the f32
/// decode kernels (moe.cu).
pub(crate) const MOE_BULK_MAX_SMEM: usize = 96 * 1024;
pub(crate) const MOE_BULK_DEFAULT_SMEM: usize = 40 * 1024;
/// Rows per block of the quantized-activation expert kernels (`MOE_GU_ROWS`,
/// `MOE_DOWN_ROWS` in matmul.cu): gate/up ffn rows, down hidden rows.
const MOE_GU_ROWS: usize = 16;
const MOE_DOWN_ROWS: usize = 8;
/// matmul.cu's `gemv_slot`: the shared-memory slot of `rows` rows of `rb` bytes copied in
/// 16-byte units (rounded up to 16, + 16 for the rows' offset inside the first unit).
fn bulk_slot(rows: usize, rb: usize) -> usize {
    (rows * rb).div_ceil(16) * 16 + 16
}

/// Rows at or below which the f32 decode kernels run; above, the grouped tensor-core path.
pub const DECODE_MAX_ROWS: usize = 16;
/// Pairs per token tile of the grouped GEMMs (`GM_TN` in moe.cu).
const GM_TN: usize = 64;
/// Outputs per block: gate/up (64 ffn rows, each as gate and up) and down (128 hidden rows).
const GM_GU_OUT: usize = 64;
const GM_DOWN_OUT: usize = 128;
/// moe_sort keeps two ints per expert in shared memory (48 KiB default limit).
const SORT_MAX_EXPERTS: usize = 4096;

/// Weight types of the grouped kernels, in kernel-name order: the matmul kernels' list.
use super::matmul::TYPES;

/// Device scratch for one MoE call; grown geometrically, never shrunk.
struct Scratch {
    /// `[rows·top_k]` expert ids, then weights.
    ids: CudaSlice<i32>,
    wts: CudaSlice<f32>,
    /// `[rows·top_k, ffn]` SwiGLU activations (prefill: in sorted pair order).
    h: CudaSlice<f32>,
    /// Prefill only: `[n_experts + 1]` list offsets per expert, the tile count, the tile
    /// table `[2·max_tiles]` (expert, first list position), the sorted pair list.
    offsets: CudaSlice<i32>,
    n_tiles: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    list: CudaSlice<i32>,
    /// Prefill only: `[rows·top_k, hidden]` per-pair expert outputs before the combine.
    y: CudaSlice<f32>,
    /// Quantized-activation decode: h quantized per 32 elements (int8, then (scale, scaled
    /// sum) pairs as f32), `[rows·top_k, ffn]`.
    hq: CudaSlice<i8>,
    hd: CudaSlice<f32>,
    /// Exact prefill (more rows than the GEMV scratch holds): x quantized as `hq` / `hd`,
    /// `[rows, hidden]`.
    xq: CudaSlice<i8>,
    xd: CudaSlice<f32>,
    /// Quantized-activation path: one ticket per (pair, 32-row group of h) for the gate/up
    /// kernel's in-kernel quantization of h; zero between launches (the last block of a
    /// group resets its ticket).
    tickets: CudaSlice<i32>,
    /// Buffers replaced by bigger ones: a captured graph may still reference them.
    retired_i: Vec<CudaSlice<i32>>,
    retired_f: Vec<CudaSlice<f32>>,
    retired_q: Vec<CudaSlice<i8>>,
}

/// Replaces `buf` by a zeroed buffer of at least `need` elements (next power of two) when it
/// is too small, keeping the old one alive in `retired`.
fn grow<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
    need: usize,
    retired: &mut Vec<CudaSlice<T>>,
) -> Result<()> {
    if buf.len() < need {
        let n = need.next_power_of_two().max(buf.len());
        let fresh = stream.alloc_zeros::<T>(n)?;
        retired.push(std::mem::replace(buf, fresh));
    }
    Ok(())
}

/// The compiled MoE kernels and their scratch.
pub struct Kernels {
    route: CudaFunction,
    gate_up: CudaFunction,
    down: CudaFunction,
    sort: CudaFunction,
    combine: CudaFunction,
    /// `moe_combine4`: the same, four outputs a thread (hidden a multiple of 4).
    combine4: CudaFunction,
    /// Grouped prefill GEMMs, indexed like [`TYPES`].
    mm_gu: Vec<CudaFunction>,
    mm_down: Vec<CudaFunction>,
    /// `moe_predict` and `moe_prefetch_experts` ([`prefetch`]).
    predict: CudaFunction,
    prefetch_experts: CudaFunction,
    predict_hits: CudaFunction,
    scratch: Mutex<Option<Scratch>>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self> {
        let m = load_module(ctx, arch, "moe", SRC)?;
        let mut mm_gu = Vec::with_capacity(TYPES.len());
        let mut mm_down = Vec::with_capacity(TYPES.len());
        for (_, name) in TYPES {
            mm_gu.push(function(&m, &format!("moe_mm_gu_{name}"))?);
            mm_down.push(function(&m, &format!("moe_mm_down_{name}"))?);
        }
        Ok(Kernels {
            route: function(&m, "moe_route")?,
            gate_up: function(&m, "moe_gate_up")?,
            down: function(&m, "moe_down")?,
            sort: function(&m, "moe_sort")?,
            combine: function(&m, "moe_combine")?,
            combine4: function(&m, "moe_combine4")?,
            mm_gu,
            mm_down,
            predict: function(&m, "moe_predict")?,
            prefetch_experts: function(&m, "moe_prefetch_experts")?,
            predict_hits: function(&m, "moe_predict_hits")?,
            scratch: Mutex::new(None),
        })
    }
}

fn type_index(t: GgmlType) -> Option<usize> {
    TYPES.iter().position(|&(ty, _)| ty == t)
}

/// A stacked expert weight's rows must be whole blocks (shapes are checked by
/// [`crate::check_moe`]).
fn check_blocks(what: &str, w: &CudaWeight) -> Result<()> {
    let i = w.shape.last().copied().unwrap_or(0);
    let bs = w.dtype.block_size();
    ensure!(
        i % bs == 0,
        "moe {what}: row length {i} is not a multiple of the {} block size {bs}",
        w.dtype
    );
    Ok(())
}

/// Whether a device buffer starts 16-byte aligned (the fast decoders' precondition).
fn aligned16<T>(be: &CudaBackend, s: &CudaSlice<T>) -> bool {
    let (p, _sync) = s.device_ptr(&be.stream);
    p % 16 == 0
}

fn i32_arg(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| anyhow::anyhow!("moe: {what} = {v} does not fit in i32"))
}

/// The sizes every MoE kernel takes, as i32 launch arguments (converted and checked once in
/// [`moe`], passed to the per-path launchers).
#[derive(Clone, Copy)]
struct Dims {
    ne: i32,
    tk: i32,
    hid: i32,
    ff: i32,
    rows: i32,
    pairs: i32,
}

impl Dims {
    fn new(rows: usize, routing: MoeRouting, hidden: usize, ffn: usize) -> Result<Self> {
        Ok(Dims {
            ne: i32_arg("n_experts", routing.n_experts)?,
            tk: i32_arg("top_k", routing.top_k)?,
            hid: i32_arg("hidden", hidden)?,
            ff: i32_arg("ffn", ffn)?,
            rows: i32_arg("rows", rows)?,
            pairs: i32_arg("rows·top_k", rows * routing.top_k)?,
        })
    }
}

pub fn moe(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    router_logits: &Act<CudaSlice<f32>>,
    experts: ExpertWeights<'_, CudaWeight>,
    routing: MoeRouting,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    moe_with(be, x, router_logits, experts, None, routing, out)
}

/// A gated shared expert taken into the quantized-activation path's two launches
/// ([`moe_shared`]): its kernels, weights and gate row.
struct Shared<'a> {
    /// The gate/up kernel, and whether it is the tile's (launched in clusters of two).
    gu: (&'a CudaFunction, bool),
    down: &'a CudaFunction,
    w: (&'a CudaWeight, &'a CudaWeight, &'a CudaWeight),
    gate: &'a CudaWeight,
}

/// `Backend::moe_shared` (MOE.md, "The shared expert inside the MoE launches"): where the
/// quantized-activation decode path runs (≤ DECODE_MAX_ROWS rows, Q4_K / Q5_K / Q6_K / Q8_0
/// experts), top-k ≤ 8, the shared expert's gate and up of the experts' type and shape, its
/// down of the experts' down type, and an f32 gate row, the shared expert is every token's
/// last pair of the gate/up launch (`gemvq_moe_gu_tcs_q4_k` on the tile, else
/// `gemvq_moe_gus_<type>`) and last slot of the down + combine (`gemvq_moe_downs4_<type>`,
/// which also takes the gate's dot product and sigmoid): two launches where the composition
/// takes seven. Otherwise false, nothing done.
#[allow(clippy::too_many_arguments)]
pub fn moe_shared(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    router_logits: &Act<CudaSlice<f32>>,
    experts: ExpertWeights<'_, CudaWeight>,
    shared: ExpertWeights<'_, CudaWeight>,
    gate: &CudaWeight,
    routing: MoeRouting,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    let Some(k) = be.matmul.gemvq_moe_shared.as_ref() else {
        return Ok(false);
    };
    let (g, d) = (experts.gate, experts.down);
    let (sg, su, sd) = (shared.gate, shared.up, shared.down);
    let (rows, hidden) = (x.rows, x.cols);
    let ffn = match g.shape[..] {
        [_, f, _] => f,
        _ => return Ok(false),
    };
    fn by_type(v: &[Option<CudaFunction>], t: GgmlType) -> Option<&CudaFunction> {
        matmul::type_index(t).ok().and_then(|i| v.get(i)?.as_ref())
    }
    // Q4_K gate/up on the tile where moe() would take it, the lane code's otherwise.
    let gu = match (gu_tc_kernel(be, g.dtype), &k.gu_tc) {
        (Some(_), Some(f)) => Some((f, true)),
        (Some(_), None) => None,
        (None, _) => by_type(&k.gu, g.dtype).map(|f| (f, false)),
    };
    let down = by_type(&k.down, d.dtype);
    let d_slots = (MOE_WARPS + 1) * bulk_slot(MOE_DOWN_ROWS, d.row_bytes());
    let takes = (1..=DECODE_MAX_ROWS).contains(&rows)
        && routing.top_k <= MOE_WARPS
        && quantized_decode_types(g.dtype, d.dtype, rows)
        && sg.dtype == g.dtype
        && su.dtype == g.dtype
        && sd.dtype == d.dtype
        && sg.shape == [ffn, hidden]
        && su.shape == [ffn, hidden]
        && sd.shape == [hidden, ffn]
        && gate.dtype == GgmlType::F32
        && gate.shape.iter().product::<usize>() == hidden
        && d_slots <= be.matmul.gemvq_moe_smem
        && quantized_path_slots(be, x, experts, routing.n_experts, ffn).is_some()
        && [&sg.data, &su.data, &sd.data, &gate.data]
            .iter()
            .all(|b| aligned16(be, b));
    let (Some(gu), Some(down)) = (gu, down) else {
        return Ok(false);
    };
    if !takes {
        return Ok(false);
    }
    moe_with(
        be,
        x,
        router_logits,
        experts,
        Some(Shared {
            gu,
            down,
            w: (sg, su, sd),
            gate,
        }),
        routing,
        out,
    )?;
    Ok(true)
}

/// The quantized-activation path's bulk-copy slots ([`bulk_smem`]) where its conditions
/// beyond the weight types hold (moe_with's choice, which `moe_shared` makes too): the
/// in-kernel routing's width, gate and up of one type, 32-multiples, the slots within the
/// limit, 16-byte aligned buffers; `None` elsewhere.
fn quantized_path_slots(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    experts: ExpertWeights<'_, CudaWeight>,
    n_experts: usize,
    ffn: usize,
) -> Option<(u32, u32)> {
    let (g, u, d) = (experts.gate, experts.up, experts.down);
    let hidden = x.cols;
    let fits = n_experts <= MOE_ROUTE_MAX
        && g.dtype == u.dtype
        && hidden.is_multiple_of(32)
        && ffn.is_multiple_of(32)
        && aligned16(be, &x.buf)
        && aligned16(be, &g.data)
        && aligned16(be, &u.data)
        && aligned16(be, &d.data);
    fits.then(|| bulk_smem(be, g.dtype, g.row_bytes(), hidden, d.row_bytes()))
        .flatten()
}

fn moe_with(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    router_logits: &Act<CudaSlice<f32>>,
    experts: ExpertWeights<'_, CudaWeight>,
    shared: Option<Shared<'_>>,
    routing: MoeRouting,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    score_prediction(be, router_logits, routing)?;
    let (rows, hidden) = (x.rows, x.cols);
    let MoeRouting {
        n_experts,
        top_k,
        norm_topk,
    } = routing;
    let ffn = crate::check_moe(
        x,
        router_logits,
        [&experts.gate.shape, &experts.up.shape, &experts.down.shape],
        &routing,
        out,
    )?;
    ensure!(
        n_experts <= MAX_EXPERTS,
        "moe: {n_experts} experts (the routing kernel supports up to {MAX_EXPERTS})"
    );
    ensure!(
        top_k <= MAX_TOP_K,
        "moe: top-k {top_k} (the expert kernels support up to {MAX_TOP_K})"
    );
    check_blocks("gate", experts.gate)?;
    check_blocks("up", experts.up)?;
    check_blocks("down", experts.down)?;
    if rows == 0 {
        return Ok(());
    }
    // With the shared expert: a pair more per token (gate/up's h and its planes).
    let pairs = rows * (top_k + usize::from(shared.is_some()));

    let (g, u, d) = (experts.gate, experts.up, experts.down);
    let x_a16 = aligned16(be, &x.buf);
    // The grouped path: many rows, gate and up of one type, known types, aligned buffers.
    let grouped = match (type_index(g.dtype), type_index(d.dtype)) {
        (Some(gi), Some(di))
            if rows > DECODE_MAX_ROWS
                && g.dtype == u.dtype
                && n_experts <= SORT_MAX_EXPERTS
                && x_a16
                && aligned16(be, &g.data)
                && aligned16(be, &u.data)
                && aligned16(be, &d.data) =>
        {
            Some((gi, di))
        }
        _ => None,
    };
    let max_tiles = pairs.div_ceil(GM_TN) + n_experts.min(pairs);
    // Decode on int8-quantized activations (matmul.cu section 1c) when every expert weight
    // has a quantized-x kernel and the buffers allow its 16-byte loads.
    // With exact prefill on (`FERRITE_MMQ=1`, mmq.rs) prefill runs this path too: a pair's
    // gate/up and a token's down + combine do not depend on how many rows share the launch,
    // so a prompt's expert outputs are bitwise the decode's for the same inputs (the bf16
    // grouped GEMMs flip near-tied expert choices of later layers: MOE.md).
    let exact_prefill = rows > DECODE_MAX_ROWS
        && super::mmq::exact_prefill()
        && matmul::quantized_x(g.dtype)
        && matmul::quantized_x(d.dtype)
        && pairs <= 65535;
    let bulk = quantized_path_slots(be, x, experts, n_experts, ffn);
    let quantized_decode =
        (quantized_decode_types(g.dtype, d.dtype, rows) || exact_prefill) && bulk.is_some();

    let mut guard = be
        .moe
        .scratch
        .lock()
        .map_err(|_| anyhow::anyhow!("moe scratch lock poisoned"))?;
    if guard.is_none() {
        let one_i = || be.stream.alloc_zeros::<i32>(1);
        let one_f = || be.stream.alloc_zeros::<f32>(1);
        *guard = Some(Scratch {
            ids: one_i()?,
            wts: one_f()?,
            h: one_f()?,
            offsets: one_i()?,
            n_tiles: one_i()?,
            tiles: one_i()?,
            list: one_i()?,
            y: one_f()?,
            hq: be.stream.alloc_zeros::<i8>(1)?,
            hd: one_f()?,
            xq: be.stream.alloc_zeros::<i8>(1)?,
            xd: one_f()?,
            tickets: one_i()?,
            retired_i: Vec::new(),
            retired_f: Vec::new(),
            retired_q: Vec::new(),
        });
    }
    let s = guard
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("moe scratch missing"))?;
    {
        let st = &be.stream;
        let (ri, rf) = (&mut s.retired_i, &mut s.retired_f);
        grow(st, &mut s.ids, pairs, ri)?;
        grow(st, &mut s.wts, pairs, rf)?;
        grow(st, &mut s.h, pairs * ffn, rf)?;
        if quantized_decode {
            grow(st, &mut s.hq, 2 * pairs * ffn, &mut s.retired_q)?;
            grow(st, &mut s.hd, pairs * ffn / 16, rf)?;
            grow(st, &mut s.tickets, pairs * ffn / 32, ri)?;
            if rows > matmul::GEMV_MAX_ROWS {
                grow(st, &mut s.xq, 2 * rows * hidden, &mut s.retired_q)?;
                grow(st, &mut s.xd, rows * hidden / 16, rf)?;
            }
        }
        if grouped.is_some() {
            grow(st, &mut s.offsets, n_experts + 1, ri)?;
            grow(st, &mut s.tiles, 2 * max_tiles, ri)?;
            grow(st, &mut s.list, pairs, ri)?;
            grow(st, &mut s.y, pairs * hidden, rf)?;
        }
    }

    let dims = Dims::new(rows, routing, hidden, ffn)?;
    let Dims {
        ne,
        tk,
        hid,
        ff,
        rows: rows_i,
        pairs: pairs_i,
    } = dims;
    let norm = i32::from(norm_topk);

    ensure!(
        shared.is_none() || quantized_decode,
        "moe: the shared expert is taken only on the quantized-activation path"
    );
    if quantized_decode {
        return quantized_experts(
            be,
            x,
            &router_logits.buf,
            s,
            (g, u, d),
            rows,
            hidden,
            ffn,
            routing,
            dims,
            bulk.unwrap_or((0, 0)),
            shared,
            out,
        );
    }

    // 1. Routing: one warp per token.
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: (n_experts * 4) as u32,
    };
    // SAFETY: logits hold rows × n_experts floats (checked); ids/wts hold ≥ rows·top_k.
    unsafe {
        be.stream
            .kernel(&be.moe.route)
            .arg(&router_logits.buf)
            .arg(&ne)
            .arg(&tk)
            .arg(&norm)
            .arg(&mut s.ids)
            .arg(&mut s.wts)
            .launch(cfg)
    }?;

    if let Some((gi, di)) = grouped {
        return grouped_experts(
            be,
            x,
            s,
            (g, u, d),
            (gi, di),
            rows,
            hidden,
            ffn,
            routing,
            dims,
            max_tiles,
            out,
        );
    }

    // 2. Gate/up + SwiGLU: one warp per (pair, ffn row).
    let h_a16 = aligned16(be, &s.h);
    let g_a16 = i32::from(x_a16 && aligned16(be, &g.data));
    let u_a16 = i32::from(x_a16 && aligned16(be, &u.data));
    let d_a16 = i32::from(h_a16 && aligned16(be, &d.data));
    let (g_ty, u_ty, d_ty) = (
        g.dtype.id() as i32,
        u.dtype.id() as i32,
        d.dtype.id() as i32,
    );
    let (g_rb, u_rb, d_rb) = (
        g.row_bytes() as i64,
        u.row_bytes() as i64,
        d.row_bytes() as i64,
    );
    let blocks = |n_items: usize, n_rows: usize, per_block: usize| -> Result<LaunchConfig> {
        let b = n_items * n_rows.div_ceil(per_block);
        ensure!(b < (1usize << 31), "moe: grid of {b} blocks is too large");
        Ok(LaunchConfig {
            grid_dim: (b as u32, 1, 1),
            block_dim: ((MOE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        })
    };
    // SAFETY: expert ids come from moe_route (< n_experts, also checked in the kernel);
    // rows of gate/up are `ffn` per expert of g_rb/u_rb bytes; h holds ≥ pairs × ffn floats.
    unsafe {
        be.stream
            .kernel(&be.moe.gate_up)
            .arg(&x.buf)
            .arg(&s.ids)
            .arg(&*g.data)
            .arg(&g_ty)
            .arg(&g_rb)
            .arg(&g_a16)
            .arg(&*u.data)
            .arg(&u_ty)
            .arg(&u_rb)
            .arg(&u_a16)
            .arg(&mut s.h)
            .arg(&pairs_i)
            .arg(&tk)
            .arg(&hid)
            .arg(&ff)
            .arg(&ne)
            .launch(blocks(pairs, ffn, MOE_WARPS)?)
    }?;

    // 3. Down + combine in top-k order: one warp per (token, slot, hidden row), a block
    // holding every slot of `per_block` rows.
    let per_block = (MOE_WARPS / top_k).max(1);
    let per_block_i = per_block as i32;
    // SAFETY: as above; out holds rows × hidden floats (checked).
    unsafe {
        be.stream
            .kernel(&be.moe.down)
            .arg(&s.h)
            .arg(&s.ids)
            .arg(&s.wts)
            .arg(&*d.data)
            .arg(&d_ty)
            .arg(&d_rb)
            .arg(&d_a16)
            .arg(&mut out.buf)
            .arg(&rows_i)
            .arg(&tk)
            .arg(&hid)
            .arg(&ff)
            .arg(&ne)
            .arg(&per_block_i)
            .launch(blocks(rows, hidden, per_block)?)
    }?;
    Ok(())
}

/// The dynamic shared memory of the quantized-activation expert kernels (gate/up, down):
/// their bulk-copy slots (matmul.cu 1c; sm_90+, where it is their only form; the kernels
/// compiled for older GPUs ignore it): gate/up the block's MOE_GU_ROWS rows of gate and of
/// up, down MOE_DOWN_ROWS rows per warp. `None` when they do not fit (that path is not taken)
/// under the kernels' limit (`gemvq_moe_smem`, set when matmul.rs loads them).
/// Q4_K gate/up on the tensor-core tiles (`Kernels::gemvq_moe_gu_tc`): two `tc_slot`s of 16
/// rows and the staged x of `hidden` columns.
fn bulk_smem(
    be: &CudaBackend,
    gu: GgmlType,
    gu_rb: usize,
    hidden: usize,
    d_rb: usize,
) -> Option<(u32, u32)> {
    let limit = be.matmul.gemvq_moe_smem;
    let gu = if gu_tc_kernel(be, gu).is_some() {
        (matmul::tc_smem(gu_rb, MOE_GU_ROWS) + matmul::tc_x_bytes(hidden)) as usize
    } else {
        2 * bulk_slot(MOE_GU_ROWS, gu_rb)
    };
    let d = MOE_WARPS * bulk_slot(MOE_DOWN_ROWS, d_rb);
    (gu <= limit && d <= limit).then_some((gu as u32, d as u32))
}

/// The tensor-core gate/up kernel where gate/up of type `g` takes it (Q4_K, where loaded);
/// `bulk_smem` and `quantized_experts` ask the same question here.
fn gu_tc_kernel(be: &CudaBackend, g: GgmlType) -> Option<&CudaFunction> {
    be.matmul
        .gemvq_moe_gu_tc
        .as_ref()
        .filter(|_| g == GgmlType::Q4K)
}

/// Whether a MoE call with gate/up of type `g` and down of type `d` on `rows` rows runs the
/// quantized-activation decode path (given 16-byte aligned buffers, as allocations are).
pub fn quantized_decode_types(g: GgmlType, d: GgmlType, rows: usize) -> bool {
    rows <= DECODE_MAX_ROWS && matmul::quantized_x(g) && matmul::quantized_x(d)
}

/// The path on int8-quantized activations (decode; exact prefill): x quantized once (usually
/// by the producing norm already), then two launches (matmul.cu 1c): gate/up + SwiGLU per
/// (pair, ffn row) with the routing computed in-kernel and h quantized in-kernel, then down
/// and combine in top-k order with its own in-kernel routing. No routing launch, no ids in
/// memory. Expects `s.h`, `s.hq`, `s.hd`, `s.tickets` grown for this shape.
#[allow(clippy::too_many_arguments)]
fn quantized_experts(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    logits: &CudaSlice<f32>,
    s: &mut Scratch,
    (g, u, d): (&CudaWeight, &CudaWeight, &CudaWeight),
    rows: usize,
    hidden: usize,
    ffn: usize,
    routing: MoeRouting,
    dims: Dims,
    smem: (u32, u32),
    shared: Option<Shared<'_>>,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    let top_k = routing.top_k;
    let pairs = rows * (top_k + usize::from(shared.is_some()));
    ensure!(
        u.row_bytes() == g.row_bytes(),
        "moe: gate and up rows differ in size"
    );
    ensure!(
        routing.n_experts <= MOE_ROUTE_MAX && top_k <= MAX_TOP_K && ffn.is_multiple_of(32),
        "moe: the quantized-activation path needs <= {MOE_ROUTE_MAX} experts, top-k <= \
         {MAX_TOP_K} and ffn % 32 == 0"
    );
    let gk = be.matmul.gemvq_moe[matmul::type_index(g.dtype)?]
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("moe: no quantized-x kernel for {}", g.dtype))?;
    let dk = be.matmul.gemvq_moe[matmul::type_index(d.dtype)?]
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("moe: no quantized-x kernel for {}", d.dtype))?;
    let Dims {
        ne, tk, hid, ff, ..
    } = dims;
    let norm = i32::from(routing.norm_topk);
    let (gu_smem, d_smem) = smem;
    let (gu_rb, d_rb) = (g.row_bytes() as i64, d.row_bytes() as i64);
    // x's int8 planes: the GEMV scratch at decode (often already written by the producing
    // add_rms_norm), this module's own scratch for a prompt's rows (same bits: quant_x_q8).
    let gemv_xq;
    let (xq_q, xq_d) = if rows <= matmul::GEMV_MAX_ROWS {
        gemv_xq = matmul::quantize_x(be, x)?;
        let xq = gemv_xq
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("moe: int8 scratch missing"))?;
        (&xq.q, &xq.d)
    } else {
        matmul::quantize_into(be, &x.buf, rows, hidden, &mut s.xq, &mut s.xd)?;
        (&s.xq, &s.xd)
    };
    // Q4_K on the tensor-core tile where loaded (bulk_smem sized its shared memory for it).
    // Its launch groups the two blocks of each 32-row quantization group of h into a cluster
    // (ffn % 32 == 0, checked above: the grid's x is even), through which they quantize h
    // instead of by ticket (matmul.cu 1c).
    let gu_tc = gu_tc_kernel(be, g.dtype);
    let (gu_kernel, gu_cluster) = match &shared {
        Some(sh) => sh.gu,
        None => (gu_tc.unwrap_or(&gk[0]), gu_tc.is_some()),
    };
    let threads = (MOE_WARPS * 32) as u32;
    let cfg = LaunchConfig {
        grid_dim: (ffn.div_ceil(MOE_GU_ROWS) as u32, pairs as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: gu_smem,
    };
    // Gate/up prefetches the down rows of its experts into L2 (matmul.cu moe_down_prefetch;
    // a row size of 0: not).
    let pf_rb = if be.matmul.moe_down_prefetch { d_rb } else { 0 };
    let mut launch = be.stream.kernel(gu_kernel);
    launch
        .arg(&*g.data)
        .arg(&*u.data)
        .arg(&gu_rb)
        .arg(&ff)
        .arg(&hid)
        .arg(xq_q)
        .arg(xq_d)
        .arg(logits)
        .arg(&ne)
        .arg(&tk)
        .arg(&mut s.h)
        .arg(&mut s.hq)
        .arg(&mut s.hd)
        .arg(&mut s.tickets)
        .arg(&*d.data)
        .arg(&pf_rb);
    if let Some(sh) = &shared {
        launch
            .arg(&*sh.w.0.data)
            .arg(&*sh.w.1.data)
            .arg(&*sh.w.2.data);
    }
    if gu_cluster {
        launch.cluster((2, 1, 1));
    }
    // SAFETY: logits hold rows × n_experts floats (checked by check_moe); the kernel's
    // routing yields ids < n_experts (others give NaN, never a read); each expert has `ffn`
    // rows of gu_rb bytes in gate and up (shapes checked by check_moe); the quantized x holds
    // rows × hidden values; h holds ≥ pairs × ffn floats, hq 2·pairs·ffn bytes, hd
    // pairs·ffn/16 floats, tickets pairs·ffn/32 ints (grown by the caller); the L2
    // prefetch stays inside the expert's `hidden` down rows of d_rb bytes (a hint: no write).
    // With the shared expert (moe_shared): pairs counts its pair per token, and its gate, up
    // and down hold `ffn`, `ffn` and `hidden` rows of the experts' row sizes (checked there).
    unsafe { launch.launch(cfg) }?;
    // The shared expert's down + combine: a copy slot more (moe_shared checked its fit).
    let d_smem = match &shared {
        Some(_) => ((MOE_WARPS + 1) * bulk_slot(MOE_DOWN_ROWS, d.row_bytes())) as u32,
        None => d_smem,
    };
    let cfg = LaunchConfig {
        grid_dim: (hidden.div_ceil(MOE_DOWN_ROWS) as u32, rows as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: d_smem,
    };
    let mut launch = be
        .stream
        .kernel(shared.as_ref().map_or(&dk[1], |sh| sh.down));
    launch
        .arg(&*d.data)
        .arg(&d_rb)
        .arg(&hid)
        .arg(&ff)
        .arg(&s.hq)
        .arg(&s.hd)
        .arg(logits)
        .arg(&ne)
        .arg(&tk)
        .arg(&norm)
        .arg(&mut out.buf);
    if let Some(sh) = &shared {
        launch.arg(&*sh.w.2.data).arg(&x.buf).arg(&*sh.gate.data);
    }
    // SAFETY: as above; down has `hidden` rows of d_rb bytes per expert (and the shared
    // expert's down `hidden` rows of the same type and size: moe_shared checked them); out
    // holds rows × hidden floats (checked); top_k ≤ MAX_TOP_K = the kernel's shared-memory
    // slots (≤ MOE_WARPS with the shared expert); x rows × hidden f32 values and the gate
    // row `hidden` f32 values for its dot product.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// The prefill path: counting sort of the pairs by expert, grouped gate/up + SwiGLU and down
/// GEMMs on the tensor cores, combine in top-k order (moe.cu, kernels 4-7). Expects the
/// routing in `s.ids` / `s.wts` and every scratch buffer grown for this shape.
#[allow(clippy::too_many_arguments)]
fn grouped_experts(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    s: &mut Scratch,
    (g, u, d): (&CudaWeight, &CudaWeight, &CudaWeight),
    (gi, di): (usize, usize),
    rows: usize,
    hidden: usize,
    ffn: usize,
    routing: MoeRouting,
    dims: Dims,
    max_tiles: usize,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    let (n_experts, top_k) = (routing.n_experts, routing.top_k);
    let pairs = rows * top_k;
    let Dims {
        ne,
        tk,
        hid,
        ff: _,
        rows: rows_i,
        pairs: pairs_i,
    } = dims;
    ensure!(
        u.row_bytes() == g.row_bytes(),
        "moe: gate and up rows differ in size"
    );
    ensure!(
        max_tiles < (1usize << 31) && pairs * hidden < (1usize << 62),
        "moe: {pairs} pairs is too many"
    );

    // 4. Counting sort by expert (one block).
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: (2 * n_experts * 4) as u32,
    };
    // SAFETY: ids hold pairs entries; offsets ≥ ne+1, tiles ≥ 2·max_tiles (the most tiles
    // any routing yields), list ≥ pairs (grown by the caller).
    unsafe {
        be.stream
            .kernel(&be.moe.sort)
            .arg(&s.ids)
            .arg(&pairs_i)
            .arg(&ne)
            .arg(&mut s.offsets)
            .arg(&mut s.n_tiles)
            .arg(&mut s.tiles)
            .arg(&mut s.list)
            .launch(cfg)
    }?;

    // 5–6 on the wgmma pipeline where it is loaded (sm_90a; mmw.rs): the same tiles and
    // buffers; Qwen3-30B-A3B's pp512 +5.6% over the mma.sync kernels, +8% with the L2
    // prefetch (MOE.md, 41st session).
    if let Some((mgi, mdi)) = super::mmw::moe_kernels(be, [g, u, d]) {
        const _: () = assert!(super::mmw::MOE_TN == GM_TN);
        let t = super::mmw::MoeTiles {
            offsets: &s.offsets,
            n_tiles: &s.n_tiles,
            tiles: &s.tiles,
            list: &s.list,
            max_tiles,
            top_k,
        };
        // h as the down's bf16 rows straight from the gate/up where they are whole steps
        // (`FERRITE_MOE_H_BF16`, default on; MOE.md, 49th session).
        let hbf = super::mmw::moe_h_bf16(ffn);
        super::mmw::moe_gate_up(
            be,
            mgi,
            &x.buf,
            (rows, hidden, ffn),
            g,
            u,
            &t,
            &mut s.h,
            hbf,
            &mut s.y,
        )?;
        super::mmw::moe_down(be, mdi, &s.h, (pairs, ffn, hidden), d, &t, &mut s.y, hbf)?;
    } else {
        grouped_mma_sync(
            be,
            x,
            s,
            (g, u, d),
            (gi, di),
            dims,
            (ffn, hidden),
            max_tiles,
        )?;
    }

    // 7. Combine in top-k order: one thread per output element, or per four where the rows
    // are whole 16-byte units (moe_combine4: the same sums).
    let four = hidden.is_multiple_of(4);
    let n = if four {
        rows * hidden / 4
    } else {
        rows * hidden
    };
    let blocks = n.div_ceil(256);
    ensure!(
        blocks < (1usize << 31),
        "moe: grid of {blocks} blocks is too large"
    );
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: y holds pairs × hidden, ids/wts pairs, out rows × hidden (checked by the caller).
    unsafe {
        be.stream
            .kernel(if four {
                &be.moe.combine4
            } else {
                &be.moe.combine
            })
            .arg(&s.y)
            .arg(&s.ids)
            .arg(&s.wts)
            .arg(&mut out.buf)
            .arg(&rows_i)
            .arg(&tk)
            .arg(&hid)
            .arg(&ne)
            .launch(cfg)
    }?;
    Ok(())
}

/// Steps 5 and 6 of [`grouped_experts`] on moe.cu's mma.sync kernels (`moe_mm_gu_<type>`,
/// `moe_mm_down_<type>`): where the wgmma forms are not loaded.
#[allow(clippy::too_many_arguments)]
fn grouped_mma_sync(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    s: &mut Scratch,
    (g, u, d): (&CudaWeight, &CudaWeight, &CudaWeight),
    (gi, di): (usize, usize),
    dims: Dims,
    (ffn, hidden): (usize, usize),
    max_tiles: usize,
) -> Result<()> {
    let Dims { tk, hid, ff, .. } = dims;
    let (gu_rb, d_rb) = (g.row_bytes() as i64, d.row_bytes() as i64);
    // 5. Gate/up + SwiGLU: grid (worst-case tiles, ffn / 64); surplus tiles exit at once.
    let cfg = LaunchConfig {
        grid_dim: (max_tiles as u32, ffn.div_ceil(GM_GU_OUT) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: tile entries come from moe_sort (experts < ne, positions < pairs); gate/up hold
    // ne·ffn rows of gu_rb bytes; x holds rows × hidden floats; h ≥ pairs × ffn.
    unsafe {
        be.stream
            .kernel(&be.moe.mm_gu[gi])
            .arg(&*g.data)
            .arg(&*u.data)
            .arg(&gu_rb)
            .arg(&ff)
            .arg(&hid)
            .arg(&x.buf)
            .arg(&s.offsets)
            .arg(&s.n_tiles)
            .arg(&s.tiles)
            .arg(&s.list)
            .arg(&tk)
            .arg(&mut s.h)
            .launch(cfg)
    }?;

    // 6. Down: grid (worst-case tiles, hidden / 128).
    let cfg = LaunchConfig {
        grid_dim: (max_tiles as u32, hidden.div_ceil(GM_DOWN_OUT) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above; down holds ne·hidden rows of d_rb bytes; y ≥ pairs × hidden.
    unsafe {
        be.stream
            .kernel(&be.moe.mm_down[di])
            .arg(&*d.data)
            .arg(&d_rb)
            .arg(&hid)
            .arg(&ff)
            .arg(&s.h)
            .arg(&s.offsets)
            .arg(&s.n_tiles)
            .arg(&s.tiles)
            .arg(&s.list)
            .arg(&tk)
            .arg(&mut s.y)
            .launch(cfg)
    }?;
    Ok(())
}

/// Experts a [`prefetch`] launch may rank (`MOE_PF_MAX_EXPERTS` in moe.cu: their logits sit
/// in its shared memory) and may prefetch.
const PF_MAX_EXPERTS: usize = 1024;
const PF_MAX_PICK: usize = 32;
/// Bytes a `moe_prefetch_experts` block prefetches (`MOE_PF_PIECE` in moe.cu).
const PF_PIECE: usize = 32768;
/// Widest residual [`prefetch`] takes: x ⊙ n sits in its dynamic shared memory, under the
/// 48 KB a launch gets without opting in (its static 4.2 KB beside).
const PF_MAX_HIDDEN: usize = 8192;

/// The stream beside the decode step's chain that [`prefetch`]'s launches run on, and its
/// scratch: one logit per expert, the prediction launch's ticket and the predicted ids. Used
/// only while a step is being captured ([`CudaBackend`]'s `capture`): the graph then holds the
/// side launches as a branch forked from the chain after the launch that wrote their x and
/// joined back at the step's end, so a replay orders them; eager steps run without them.
pub struct Side {
    stream: OnceLock<Arc<CudaStream>>,
    logits: CudaSlice<f32>,
    ticket: CudaSlice<i32>,
    ids: CudaSlice<i32>,
    /// `FERRITE_MOE_PREDICT_HITS`: [hits, true experts] over the replays ([`score_prediction`]),
    /// logged when the backend is dropped; the chain's stream, to read them then.
    hits: CudaSlice<u32>,
    main: Arc<CudaStream>,
    /// A prediction launched whose layer's routing has not been scored yet.
    pending: AtomicBool,
    /// The side stream has work since the capture began, to be joined before it ends.
    forked: AtomicBool,
    /// The prefetch held back to a later point of the layer ([`prefetch_at`]).
    held: Mutex<Option<HeldPrefetch>>,
}

impl Side {
    /// The scratch, zeroed (the ticket must start at 0), allocated on `stream` and
    /// synchronised before any capture can begin.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let side = Side {
            stream: OnceLock::new(),
            logits: stream.alloc_zeros::<f32>(PF_MAX_EXPERTS)?,
            ticket: stream.alloc_zeros::<i32>(1)?,
            ids: stream.alloc_zeros::<i32>(PF_MAX_PICK)?,
            hits: stream.alloc_zeros::<u32>(2)?,
            main: stream.clone(),
            pending: AtomicBool::new(false),
            forked: AtomicBool::new(false),
            held: Mutex::new(None),
        };
        stream.synchronize()?;
        Ok(side)
    }

    /// Before a capture on `main` ends: `main` waits for the side stream's work, if the
    /// capture forked it (a capture must end with every stream it forked joined back).
    /// Returns whether it had (the graph then holds side launches).
    pub fn end(&self, main: &CudaStream) -> Result<bool> {
        // A prefetch still held (no later point reached) is dropped with its step.
        if let Ok(mut h) = self.held() {
            h.take();
        }
        let forked = self.forked.swap(false, Ordering::Relaxed);
        if forked {
            if let Some(side) = self.stream.get() {
                main.join(side)?;
            }
        }
        Ok(forked)
    }

    /// The prefetch held back to a later point of the layer ([`prefetch`], [`prefetch_at`]).
    fn held(&self) -> Result<MutexGuard<'_, Option<HeldPrefetch>>> {
        self.held
            .lock()
            .map_err(|_| anyhow::anyhow!("moe: held prefetch lock poisoned"))
    }
}

/// The prediction's switches, read once: experts to prefetch a layer (`FERRITE_MOE_PREDICT`,
/// 0: none), whether to prefetch them (`FERRITE_MOE_PREDICT_PF`), whether to count its hits
/// (`FERRITE_MOE_PREDICT_HITS`), where the prefetch is issued (`FERRITE_MOE_PREDICT_AT`: 0 with
/// the prediction, 1 after the layer's mixer input projections, 2 after its core) and at what
/// priority (`FERRITE_MOE_PREDICT_PRIO`); defaults in [`PREDICT_DEFAULT`]. The decoder asks at
/// every layer of an eager decode step.
#[derive(Clone, Copy)]
struct PredictSwitches {
    pick: usize,
    pf: bool,
    hits: bool,
    at: Option<MixerPoint>,
    prio: bool,
}

/// The defaults of `FERRITE_MOE_PREDICT`, `_AT` and `_PRIO`: four experts, prefetched after
/// the layer's Q, K, V launch, the side launches at the greatest priority. Measured on an H100
/// (MOE.md, 64th session; three calls, two rounds each, against 0 in the same rounds):
/// Qwen3-30B-A3B tg128 +1.1% (552.8 → 558.8 on average), Qwen3.5-35B-A3B +0.5% (470.6 →
/// 472.9). Eight experts lost on the 30B at either priority, and four at the default priority
/// tied; issued with the prediction (`_AT=0`) four read the same as here. Not measured on an
/// H200.
const PREDICT_DEFAULT: (usize, i64, i64) = (4, 1, 1);

fn predict_switches() -> PredictSwitches {
    static S: OnceLock<PredictSwitches> = OnceLock::new();
    *S.get_or_init(|| {
        use super::switches::int_or;
        PredictSwitches {
            pick: int_or("FERRITE_MOE_PREDICT", PREDICT_DEFAULT.0 as i64).max(0) as usize,
            pf: int_or("FERRITE_MOE_PREDICT_PF", 1) != 0,
            hits: int_or("FERRITE_MOE_PREDICT_HITS", 0) != 0,
            at: match int_or("FERRITE_MOE_PREDICT_AT", PREDICT_DEFAULT.1) {
                1 => Some(MixerPoint::Projected),
                2 => Some(MixerPoint::Mixed),
                _ => None,
            },
            prio: int_or("FERRITE_MOE_PREDICT_PRIO", PREDICT_DEFAULT.2) != 0,
        }
    })
}

/// The side launches' scheduling priority under `FERRITE_MOE_PREDICT_PRIO=1` (with
/// `FERRITE_MOE_PREDICT` on): the context's greatest, so that their blocks are placed before
/// the chain's waiting ones as SMs free up. None otherwise (the default launch priority).
pub(crate) fn side_priority() -> Option<i32> {
    static P: OnceLock<Option<i32>> = OnceLock::new();
    *P.get_or_init(|| {
        let sw = predict_switches();
        if !sw.prio || sw.pick == 0 {
            return None;
        }
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: two out-pointers to live integers; reads the current context's range.
        let r =
            unsafe { cudarc::driver::sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) };
        (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(greatest)
    })
}

/// Marks `launch` as one of the side stream's ([`super::launch::Launch::beside`]), at
/// [`side_priority`] where that is set.
fn side_launch(launch: &mut super::launch::Launch<'_>) {
    launch.beside();
    if let Some(pr) = side_priority() {
        launch.priority(pr);
    }
}

/// Experts to prefetch a layer of `routing` (`FERRITE_MOE_PREDICT`, 0: none), within what the
/// kernels hold.
fn predict_pick(routing: MoeRouting) -> usize {
    predict_switches()
        .pick
        .min(routing.n_experts)
        .min(PF_MAX_PICK)
}

/// Whether `FERRITE_MOE_PREDICT_HITS` (a timing diagnostic, [`score_prediction`]) is on.
pub(crate) fn hits_diagnostic() -> bool {
    predict_switches().hits
}

/// A `moe_prefetch_experts` launch's grid and arguments (the stacks as device addresses):
/// launched at once, or held back to a later point of the layer (`FERRITE_MOE_PREDICT_AT`,
/// [`prefetch_at`]) and dropped, if still held, when the capture ends ([`Side::end`]).
struct HeldPrefetch {
    pieces: u32,
    pick: i32,
    gate: u64,
    up: u64,
    expert_bytes: i64,
}

/// Launches `moe_prefetch_experts` for `p` on the side stream.
fn launch_prefetch(be: &CudaBackend, stream: &CudaStream, p: &HeldPrefetch) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (p.pieces, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.kernel(&be.moe.prefetch_experts);
    launch
        .arg(&be.moe_side.ids)
        .arg(&p.pick)
        .arg(&p.gate)
        .arg(&p.up)
        .arg(&p.expert_bytes);
    side_launch(&mut launch);
    // SAFETY: the arguments match moe_prefetch_experts's parameters (the stacks as their
    // device addresses); it reads pick ids (each < n_experts, written by moe_predict before it
    // on this stream) and prefetches pieces of their expert_bytes spans of the [n_experts, ..]
    // stacks, nothing past a span's end. The stacks are a loaded model's weights, alive while
    // any step of it is captured or replayed.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// [`crate::Backend::moe_prefetch_at`] on CUDA: the prefetch [`prefetch`] held back, issued on
/// the side stream after everything the chain has launched so far, where `point` is
/// `FERRITE_MOE_PREDICT_AT`'s.
pub fn prefetch_at(be: &CudaBackend, point: MixerPoint) -> Result<()> {
    let side = &be.moe_side;
    // No side stream yet: nothing was ever predicted (a dense model, or no capture so far).
    let Some(stream) = side.stream.get() else {
        return Ok(());
    };
    if predict_switches().at != Some(point) {
        return Ok(());
    }
    let Some(p) = side.held()?.take() else {
        return Ok(());
    };
    stream.join(&be.stream)?;
    launch_prefetch(be, stream, &p)
}

/// [`crate::Backend::moe_prefetch`] on CUDA: while a decode step is captured, two launches on
/// the side stream ([`Side`]): `moe_predict` ranks the experts by the router on `rms_norm(x) ·
/// norm` and keeps the first `FERRITE_MOE_PREDICT`, `moe_prefetch_experts` prefetches their
/// gate and up rows into L2, one piece a block (plans in moe.cu), launched here or held back to
/// [`prefetch_at`] (`FERRITE_MOE_PREDICT_AT`). Does nothing (and is no error) outside a
/// capture, below sm_90 (no bulk prefetch: matmul.rs's `bulk`), at more than one
/// row, for experts held in host memory, or for shapes the kernels do not take
/// ([`predict_takes`]; 16-byte expert spans). The side launch reads x after its producer (the
/// fork's event); the chain may overwrite x in place later (the next o-projection's residual
/// add), which could worsen a guess, never a result.
pub fn prefetch(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    (norm, eps): (&CudaWeight, f32),
    router: &CudaWeight,
    experts: ExpertWeights<'_, CudaWeight>,
    routing: MoeRouting,
) -> Result<()> {
    let pick = predict_pick(routing);
    let side = &be.moe_side;
    let (g, u) = (experts.gate, experts.up);
    // One expert's span of a stack: its rows (shape[1]) of whole blocks (shape[2]).
    let whole = g.shape.len() == 3 && g.shape[2].is_multiple_of(g.dtype.block_size());
    let eb = if whole { g.shape[1] * g.row_bytes() } else { 0 };
    let takes = pick > 0
        && be.matmul.bulk
        && predict_takes(x, norm, router)
        && router.shape[0] == routing.n_experts
        && whole
        && g.shape[0] == routing.n_experts
        && u.shape == g.shape
        && u.dtype == g.dtype
        && eb > 0
        && eb.is_multiple_of(16)
        && !g.in_host_memory()
        && !u.in_host_memory()
        && aligned16(be, &g.data)
        && aligned16(be, &u.data);
    // Only inside a capture of the chain's stream (eager steps run without it).
    use cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE;
    if !takes || be.stream.capture_status()? != CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Ok(());
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::info!(
            "MoE expert prediction: the top {pick} of {} experts' gate and up rows ({:.1} MB) \
             prefetched a layer ahead, beside the decode step",
            routing.n_experts,
            (2 * pick * eb) as f64 / 1e6
        )
    });
    let stream = match side.stream.get() {
        Some(s) => s,
        None => {
            let s = be.ctx.new_stream()?;
            side.stream.get_or_init(|| s)
        }
    };
    // The side stream waits for what the chain has issued so far (x's producer included).
    stream.join(&be.stream)?;
    side.forked.store(true, Ordering::Relaxed);
    side.pending.store(true, Ordering::Relaxed);
    launch_predict(
        be,
        stream,
        x,
        (norm, eps),
        router,
        (routing.n_experts, pick),
        &side.logits,
        true,
    )?;
    let sw = predict_switches();
    if !sw.pf {
        return Ok(()); // the prediction's own cost (a measurement)
    }
    // One piece of PF_PIECE bytes a block (`MOE_PF_PIECE` in moe.cu).
    let (gate, _g) = g.data.device_ptr(&be.stream);
    let (up, _u) = u.data.device_ptr(&be.stream);
    let p = HeldPrefetch {
        pieces: u32::try_from(2 * pick * eb.div_ceil(PF_PIECE))?,
        pick: i32_arg("pick", pick)?,
        gate,
        up,
        expert_bytes: eb as i64,
    };
    if sw.at.is_none() {
        return launch_prefetch(be, stream, &p);
    }
    *side.held()? = Some(p);
    Ok(())
}

/// Whether the prediction kernels take this row, norm and router (f32 weights, at most
/// [`PF_MAX_EXPERTS`] experts, a residual of whole float4s up to [`PF_MAX_HIDDEN`]).
fn predict_takes(x: &Act<CudaSlice<f32>>, norm: &CudaWeight, router: &CudaWeight) -> bool {
    let hidden = x.cols;
    x.rows == 1
        && router.dtype == GgmlType::F32
        && norm.dtype == GgmlType::F32
        && router.shape.len() == 2
        && router.shape[1] == hidden
        && router.shape[0] <= PF_MAX_EXPERTS
        && norm.shape.iter().product::<usize>() == hidden
        && hidden.is_multiple_of(4)
        && hidden <= PF_MAX_HIDDEN
}

/// Launches the prediction (`moe_predict`) on `stream`: `logits[e]` for the `n_experts` router
/// rows, the first `pick` ids into the side's ids. `side`: a launch of the side stream (else one
/// of `ferrite check` on the chain's stream, after its work, counted as a write). The caller has
/// checked [`predict_takes`].
#[allow(clippy::too_many_arguments)]
fn launch_predict(
    be: &CudaBackend,
    stream: &CudaStream,
    x: &Act<CudaSlice<f32>>,
    (norm, eps): (&CudaWeight, f32),
    router: &CudaWeight,
    (n_experts, pick): (usize, usize),
    logits: &CudaSlice<f32>,
    side: bool,
) -> Result<()> {
    let hidden = x.cols;
    let (ne, pk, hid) = (
        i32_arg("n_experts", n_experts)?,
        i32_arg("pick", pick)?,
        i32_arg("hidden", hidden)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (n_experts.div_ceil(MOE_WARPS) as u32, 1, 1),
        block_dim: (32 * MOE_WARPS as u32, 1, 1),
        shared_mem_bytes: (hidden * 4) as u32,
    };
    let mut launch = stream.kernel(&be.moe.predict);
    launch
        .arg(&x.buf)
        .arg(&*norm.data)
        .arg(&eps)
        .arg(&hid)
        .arg(&*router.data)
        .arg(&ne)
        .arg(&pk)
        .arg(logits)
        .arg(&be.moe_side.ticket)
        .arg(&be.moe_side.ids);
    if side {
        side_launch(&mut launch);
    } else {
        // No PDL attribute (the kernels have no pdl_wait): the stream's order alone.
        launch.beside();
    }
    // SAFETY: the arguments match moe_predict's parameters; it reads hidden floats of x and of
    // the norm and n_experts router rows of hidden floats (predict_takes' shapes), and writes
    // n_experts ≤ PF_MAX_EXPERTS logits, the ticket and pick ≤ PF_MAX_PICK ids.
    unsafe { launch.launch(cfg) }?;
    if !side {
        super::launch::note_write();
    }
    Ok(())
}

/// [`crate::Backend::moe_predict_logits`] on CUDA: the prediction kernel on the chain's stream,
/// its logits into `out`; then its picks (the first min(n_experts, [`PF_MAX_PICK`])) read back
/// and checked to be the top of its own logits (descending, the lower id first on ties): an
/// error names the first rank that differs. Shapes the kernels do not take run the composition.
pub fn predict_logits(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    (norm, eps): (&CudaWeight, f32),
    router: &CudaWeight,
    h: &mut Act<CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    use crate::Backend;
    let n_experts = router.shape.first().copied().unwrap_or(0);
    ensure!(
        out.rows == x.rows && out.cols == n_experts,
        "moe_predict_logits: out is {}x{}, want {}x{n_experts}",
        out.rows,
        out.cols,
        x.rows
    );
    if !predict_takes(x, norm, router) || n_experts == 0 {
        be.rms_norm(x, norm, eps, h)?;
        return be.matmul(h, router, out);
    }
    let pick = n_experts.min(PF_MAX_PICK);
    launch_predict(
        be,
        &be.stream,
        x,
        (norm, eps),
        router,
        (n_experts, pick),
        &out.buf,
        false,
    )?;
    let got = be.stream.clone_dtoh(&be.moe_side.ids)?;
    let lg = be.to_host(out)?;
    let mut order: Vec<usize> = (0..n_experts).collect();
    order.sort_by(|&a, &b| lg[b].total_cmp(&lg[a]).then(a.cmp(&b)));
    for (k, &want) in order.iter().take(pick).enumerate() {
        ensure!(
            got[k] as usize == want,
            "moe_predict: pick {k} is expert {} (logit {}), its logits rank expert {want} \
             (logit {}) there",
            got[k],
            lg.get(got[k].max(0) as usize).copied().unwrap_or(f32::NAN),
            lg[want]
        );
    }
    Ok(())
}

impl Drop for Side {
    fn drop(&mut self) {
        if !hits_diagnostic() {
            return;
        }
        let mut h = [0u32; 2];
        if self.main.memcpy_dtoh(&self.hits, &mut h).is_ok()
            && self.main.synchronize().is_ok()
            && h[1] > 0
        {
            tracing::info!(
                "MoE expert prediction: {} of {} routed experts predicted ({:.1}%)",
                h[0],
                h[1],
                100.0 * h[0] as f64 / h[1] as f64
            );
        }
    }
}

/// `FERRITE_MOE_PREDICT_HITS=1` (a timing diagnostic): at a captured decode step's MoE layer
/// whose experts [`prefetch`] predicted, the chain waits for the side stream and
/// `moe_predict_hits` counts how many of the router's top-k the prediction held (logged when
/// the backend is dropped). Not counted as a launch: it writes nothing the chain reads.
fn score_prediction(
    be: &CudaBackend,
    router_logits: &Act<CudaSlice<f32>>,
    routing: MoeRouting,
) -> Result<()> {
    let side = &be.moe_side;
    if !hits_diagnostic() || router_logits.rows != 1 || !side.pending.swap(false, Ordering::Relaxed)
    {
        return Ok(());
    }
    let Some(stream) = side.stream.get() else {
        return Ok(());
    };
    be.stream.join(stream)?;
    let pick = predict_pick(routing);
    let (ne, tk, pk) = (
        i32_arg("n_experts", routing.n_experts)?,
        i32_arg("top_k", routing.top_k)?,
        i32_arg("pick", pick)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = be.stream.kernel(&be.moe.predict_hits);
    launch
        .arg(&router_logits.buf)
        .arg(&ne)
        .arg(&tk)
        .arg(&side.ids)
        .arg(&pk)
        .arg(&side.hits)
        .beside();
    // SAFETY: the arguments match moe_predict_hits's parameters; it reads n_experts ≤
    // PF_MAX_EXPERTS logits (one row) and pick ids, and adds to the two counters.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}
