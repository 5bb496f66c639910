//! Qwen3.5's hybrid-layer ops on CUDA (`kernels/gated_delta.cu`; its header holds the
//! plan): the causal depthwise convolution with its rolling state, the gated delta rule with
//! its recurrent state resident in VRAM, gated RMSNorm and the sigmoid gate; and the
//! linear-attention state a hybrid cache carries ([`DeltaState`], in [`CudaKv::delta`]).
//!
//! Semantics are the CPU backend's, formula for formula (`cpu.rs`, `gated_delta.rs`).
//! Tuning record: `GATED_DELTA.md`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaView, DevicePtr, LaunchConfig};
use ferrite_formats::GgmlType;

use super::attention::{self, CudaKv};
use super::launch::{KernelArg, LaunchExt};
use super::{function, load_module, CudaBackend, CudaWeight};
use crate::{check_shape, Act, AttnShape, DeltaArgs, DeltaShape, StepBatch};

pub const SRC: &str = include_str!("kernels/gated_delta.cu");

/// Longest convolution kernel (GD_MAX_K in gated_delta.cu).
pub const MAX_CONV_KERNEL: usize = 8;
/// Rows per convolution thread (CONV_ROWS in gated_delta.cu).
const CONV_ROWS: usize = 16;
/// Largest key head dim: a state column of 8 lanes × 16 registers.
pub const MAX_K_HEAD_DIM: usize = 128;
/// Threads per gated_delta block (GD_THREADS in gated_delta.cu).
const DELTA_THREADS: usize = 128;
/// The chunked prefill kernel (`gated_delta_chunked`): threads per block (GDC_THREADS),
/// state columns per block (GDC_CW), dynamic shared memory (GDC_SMEM_FLOATS × 4 bytes).
const CHUNKED_THREADS: u32 = 256;
const CHUNKED_COLS: usize = 32;
const CHUNKED_SMEM: usize = 46_272 * 4;
/// Fewest rows that take the chunked kernel when it is on: speculative verify (up to 9
/// rows) and decode keep the sequential kernel, so they run the same per-token arithmetic.
const CHUNKED_MIN_ROWS: usize = 17;

/// Whether prefill runs the chunked tensor-core kernel: only with `FERRITE_DELTA_CHUNKED=1`
/// (read once), or as [`force_chunked`] says. Off by default: correct on the H200 but slower
/// than the sequential kernel at Qwen3.5's shapes (GATED_DELTA.md, "First GPU run").
fn chunked_on() -> bool {
    match CHUNKED_FORCE.load(Ordering::Relaxed) {
        1 => return true,
        2 => return false,
        _ => {}
    }
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_DELTA_CHUNKED", 0) == 1)
}

/// 0: `FERRITE_DELTA_CHUNKED` decides; 1: chunked kernel on; 2: off.
static CHUNKED_FORCE: AtomicU8 = AtomicU8::new(0);

/// Overrides `FERRITE_DELTA_CHUNKED` for the calls that follow in this process (`None`: the
/// environment decides again). For `ferrite check`, which runs the chunked kernel's cases
/// whatever the default is.
pub fn force_chunked(on: Option<bool>) {
    CHUNKED_FORCE.store(
        match on {
            None => 0,
            Some(true) => 1,
            Some(false) => 2,
        },
        Ordering::Relaxed,
    );
}

/// The compiled kernels of `gated_delta.cu`.
pub struct Kernels {
    conv: CudaFunction,
    /// (rows of state per lane, lanes per column) = (8, 4), (8, 8), (16, 8): key head dims
    /// up to 32, 64, 128.
    delta: [CudaFunction; 3],
    /// The chunked prefill kernel, when the device grants its 181 KiB of shared memory per
    /// block (run only when [`chunked_on`]).
    chunked: Option<CudaFunction>,
    gated_rms_norm: CudaFunction,
    sigmoid_gate: CudaFunction,
    /// Whether `gated_rms_norm` and the per-element `sigmoid_gate` write their output's int8
    /// planes for the GEMV after them (`FERRITE_GATE_QX`, default on; GATED_DELTA.md, "The
    /// output planes from the gates").
    planes: bool,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self> {
        let m = load_module(ctx, arch, "gated_delta", SRC)?;
        Ok(Kernels {
            conv: function(&m, "causal_conv1d")?,
            delta: [
                function(&m, "gated_delta_r8_l4")?,
                function(&m, "gated_delta_r8_l8")?,
                function(&m, "gated_delta_r16_l8")?,
            ],
            // Loaded wherever the device grants its shared memory (none where it cannot:
            // those GPUs keep the sequential kernel).
            chunked: {
                let f = function(&m, "gated_delta_chunked")?;
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    CHUNKED_SMEM as i32,
                )
                .ok()
                .map(|_| f)
            },
            gated_rms_norm: function(&m, "gated_rms_norm")?,
            sigmoid_gate: function(&m, "sigmoid_gate")?,
            planes: super::switches::int_or("FERRITE_GATE_QX", 1) != 0,
        })
    }
}

/// The linear-attention state of a hybrid cache, all f32, zero at creation.
pub struct DeltaState {
    pub shape: DeltaShape,
    pub n_layers: usize,
    /// Sequences' states held: 1 for one sequence's cache, the pool's size for a pooled one
    /// (`kv_new_paged_hybrid`). Slot-major: slot `s` is `[layer]` of the layouts below,
    /// `s · n_layers · len` floats in, so clearing a slot is one contiguous range.
    pub slots: usize,
    /// Per layer the last `conv_kernel - 1` convolution inputs:
    /// `[slot][layer][kernel-1][conv_dim]`.
    pub conv: CudaSlice<f32>,
    /// Per layer the recurrent state, column-major per value head (the CPU's transpose):
    /// `[slot][layer][n_v_heads][v_head_dim][k_head_dim]`, so a state column is one aligned
    /// run.
    pub state: CudaSlice<f32>,
    /// Snapshot slots (`kv_snapshots`): per slot a buffer like `conv` and one like `state`.
    pub snapshots: Vec<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Row-state slots (`kv_row_states`): `[row]` of a buffer like `conv` and of one like
    /// `state`, each the state after that row of the last tracked call (calls of at most
    /// `row_slots` rows write them). Which rows the last call wrote is not kept here: its
    /// launch may be a graph's replay, which runs no host code.
    pub row_conv: Option<CudaSlice<f32>>,
    pub row_state: Option<CudaSlice<f32>>,
    pub row_slots: usize,
}

impl DeltaState {
    fn conv_len(&self) -> usize {
        self.shape.conv_state_len()
    }
    fn state_len(&self) -> usize {
        self.shape.recurrent_state_len()
    }
}

/// A hybrid cache: the attention cache of [`attention::kv_new`] plus the state of
/// `n_linear_layers` Gated DeltaNet layers.
pub fn kv_new_hybrid(
    be: &CudaBackend,
    n_attn_layers: usize,
    shape: AttnShape,
    capacity: usize,
    n_linear_layers: usize,
    delta: DeltaShape,
) -> Result<CudaKv> {
    check_delta_shape(&delta)?;
    let mut kv = attention::kv_new(be, n_attn_layers, shape, capacity)?;
    kv.delta = Some(delta_state(be, n_linear_layers, delta, 1)?);
    Ok(kv)
}

/// The cache of a hybrid model's batched steps: the paged attention cache of
/// [`attention::kv_new_paged`] plus `slots` sequences' Gated DeltaNet states.
pub fn kv_new_paged_hybrid(
    be: &CudaBackend,
    n_attn_layers: usize,
    shape: AttnShape,
    paged: crate::PagedKv,
    n_linear_layers: usize,
    delta: DeltaShape,
    slots: usize,
) -> Result<CudaKv> {
    check_delta_shape(&delta)?;
    ensure!(
        (1..=i32::MAX as usize).contains(&slots),
        "a hybrid cache of {slots} state slots"
    );
    let ds = delta_state(be, n_linear_layers, delta, slots)?;
    let mut kv = attention::kv_new_paged(be, n_attn_layers, shape, paged)?;
    kv.delta = Some(ds);
    Ok(kv)
}

/// Zeroes state slot `slot` (every layer's conv and recurrent state): two memsets on the
/// stream. Caches without linear-attention state have nothing to clear.
pub fn kv_clear_state(be: &CudaBackend, kv: &mut CudaKv, slot: usize) -> Result<()> {
    let Some(ds) = kv.delta.as_mut() else {
        return Ok(());
    };
    ensure!(
        slot < ds.slots,
        "kv_clear_state: slot {slot} of a cache of {}",
        ds.slots
    );
    let (conv, state) = (ds.n_layers * ds.conv_len(), ds.n_layers * ds.state_len());
    be.stream
        .memset_zeros(&mut ds.conv.slice_mut(slot * conv..(slot + 1) * conv))?;
    be.stream
        .memset_zeros(&mut ds.state.slice_mut(slot * state..(slot + 1) * state))?;
    Ok(())
}

/// Copies state slot `from` over slot `to` (every layer's conv and recurrent state): two
/// device-to-device copies of one contiguous range each. Caches without linear-attention
/// state have nothing to copy.
pub fn kv_copy_state(be: &CudaBackend, kv: &mut CudaKv, from: usize, to: usize) -> Result<()> {
    let Some(ds) = kv.delta.as_mut() else {
        return Ok(());
    };
    ensure!(
        from < ds.slots && to < ds.slots,
        "kv_copy_state: slots {from} -> {to} of a cache of {}",
        ds.slots
    );
    if from == to {
        return Ok(());
    }
    let (conv_len, state_len) = (ds.n_layers * ds.conv_len(), ds.n_layers * ds.state_len());
    for (buf, len) in [(&mut ds.conv, conv_len), (&mut ds.state, state_len)] {
        // Two disjoint ranges of one allocation, split apart.
        let (lo, hi) = (from.min(to), from.max(to));
        let (mut a, mut b) = buf.split_at_mut(hi * len);
        let mut a = a.slice_mut(lo * len..(lo + 1) * len);
        let mut b = b.slice_mut(..len);
        if from < to {
            be.stream.memcpy_dtod(&a, &mut b)?;
        } else {
            be.stream.memcpy_dtod(&b, &mut a)?;
        }
    }
    Ok(())
}

/// Snapshots and row states copy the whole state: one sequence's caches only.
fn ensure_one_state(ds: &DeltaState, what: &str) -> Result<()> {
    ensure!(
        ds.slots == 1,
        "{what}: a cache of {} sequences' states takes no snapshots or row states",
        ds.slots
    );
    Ok(())
}

fn check_delta_shape(delta: &DeltaShape) -> Result<()> {
    ensure!(
        (1..=MAX_CONV_KERNEL).contains(&delta.conv_kernel)
            && delta.n_k_heads > 0
            && delta.n_v_heads.is_multiple_of(delta.n_k_heads)
            && delta.v_head_dim > 0,
        "bad linear-attention shape {delta:?} (the CUDA convolution takes kernels of 1..={MAX_CONV_KERNEL})"
    );
    ensure!(
        (1..=MAX_K_HEAD_DIM).contains(&delta.k_head_dim),
        "linear-attention key head dim {} is not supported on CUDA (at most {MAX_K_HEAD_DIM})",
        delta.k_head_dim
    );
    Ok(())
}

/// Zeroed Gated DeltaNet state of `n_linear_layers` layers for `slots` sequences.
fn delta_state(
    be: &CudaBackend,
    n_linear_layers: usize,
    delta: DeltaShape,
    slots: usize,
) -> Result<DeltaState> {
    let per_layer = |len: usize| {
        n_linear_layers
            .checked_mul(len)
            .and_then(|n| n.checked_mul(slots))
            .context("linear-attention state size overflows")
    };
    let conv = per_layer(delta.conv_state_len())?;
    let state = per_layer(delta.recurrent_state_len())?;
    ensure_free(
        be,
        (conv + state) * 4,
        &format!("linear-attention state of {n_linear_layers} layers, {slots} sequences"),
    )?;
    Ok(DeltaState {
        shape: delta,
        n_layers: n_linear_layers,
        slots,
        conv: be.stream.alloc_zeros::<f32>(conv.max(1))?,
        state: be.stream.alloc_zeros::<f32>(state.max(1))?,
        snapshots: vec![],
        row_conv: None,
        row_state: None,
        row_slots: 0,
    })
}

/// An error naming `what` where `bytes` more would leave the device under 64 MB free (room
/// for the context's own bookkeeping and small allocations).
fn ensure_free(be: &CudaBackend, bytes: usize, what: &str) -> Result<()> {
    let (free, _) = be.mem_info()?;
    ensure!(
        bytes + (64 << 20) <= free,
        "{what}: {:.2} GiB needed, {:.2} GiB free",
        bytes as f64 / (1u64 << 30) as f64,
        free as f64 / (1u64 << 30) as f64
    );
    Ok(())
}

/// `n` snapshot slots for the cache: for a hybrid cache, device buffers the size of its conv
/// and recurrent state (all layers) per slot, allocated here so that snapshots and restores
/// are plain copies. Caches without linear-attention state get slots that hold nothing.
pub fn kv_snapshots(be: &CudaBackend, kv: &mut CudaKv, n: usize) -> Result<()> {
    kv.slots = crate::SnapshotSlots::new(0);
    if let Some(ds) = kv.delta.as_mut() {
        ensure_one_state(ds, "kv_snapshots")?;
        // Free the old slots before asking for the new ones.
        ds.snapshots.clear();
        let (conv, state) = (ds.conv.len(), ds.state.len());
        let bytes = n
            .checked_mul((conv + state) * 4)
            .context("snapshot size overflows")?;
        ensure_free(be, bytes, &format!("{n} state snapshots"))?;
        for _ in 0..n {
            ds.snapshots.push((
                be.stream.alloc_zeros::<f32>(conv)?,
                be.stream.alloc_zeros::<f32>(state)?,
            ));
        }
    }
    kv.slots = crate::SnapshotSlots::new(n);
    Ok(())
}

/// Copies the conv and recurrent state (all layers) into slot `slot`: two device-to-device
/// copies on the stream, no allocation, capturable in a graph.
pub fn kv_snapshot(be: &CudaBackend, kv: &mut CudaKv, slot: usize) -> Result<()> {
    kv.slots.check_snapshot(slot)?;
    if let Some(ds) = kv.delta.as_mut() {
        let (conv, state) = ds
            .snapshots
            .get_mut(slot)
            .context("kv_snapshot: the slot has no buffers")?;
        ensure!(
            conv.len() == ds.conv.len() && state.len() == ds.state.len(),
            "kv_snapshot: slot {slot} is not the size of the state"
        );
        be.stream.memcpy_dtod(&ds.conv, conv)?;
        be.stream.memcpy_dtod(&ds.state, state)?;
    }
    kv.slots.set_filled(slot)
}

/// Copies slot `slot` back into the conv and recurrent state (all layers): two
/// device-to-device copies on the stream, no allocation, capturable in a graph.
pub fn kv_restore(be: &CudaBackend, kv: &mut CudaKv, slot: usize) -> Result<()> {
    kv.slots.restore(slot)?;
    if let Some(ds) = kv.delta.as_mut() {
        let (conv, state) = ds
            .snapshots
            .get(slot)
            .context("kv_restore: the slot has no buffers")?;
        ensure!(
            conv.len() == ds.conv.len() && state.len() == ds.state.len(),
            "kv_restore: slot {slot} is not the size of the state"
        );
        be.stream.memcpy_dtod(conv, &mut ds.conv)?;
        be.stream.memcpy_dtod(state, &mut ds.state)?;
    }
    Ok(())
}

/// `rows` row-state slots for a hybrid cache (`Backend::kv_row_states`): device buffers of
/// `rows` times its conv and recurrent state (all layers), written by the conv and
/// delta-rule kernels for calls of at most `rows` rows. Caches without linear-attention
/// state keep nothing.
pub fn kv_row_states(be: &CudaBackend, kv: &mut CudaKv, rows: usize) -> Result<()> {
    let Some(ds) = kv.delta.as_mut() else {
        return Ok(());
    };
    ensure_one_state(ds, "kv_row_states")?;
    (ds.row_conv, ds.row_state, ds.row_slots) = (None, None, 0);
    if rows == 0 {
        return Ok(());
    }
    let (conv, state) = (ds.conv.len(), ds.state.len());
    let bytes = rows
        .checked_mul((conv + state) * 4)
        .context("row-state size overflows")?;
    ensure_free(be, bytes, &format!("{rows} row states"))?;
    ds.row_conv = Some(be.stream.alloc_zeros::<f32>(rows * conv)?);
    ds.row_state = Some(be.stream.alloc_zeros::<f32>(rows * state)?);
    ds.row_slots = rows;
    Ok(())
}

/// Copies the state after row `row` of the last tracked call (every layer) into the cache's
/// conv and recurrent state: two device-to-device copies, capturable in a graph. The caller
/// vouches that the last tracked call had that row (the CPU backend checks it; here calls
/// may replay as graphs, which leave no host-side record).
pub fn kv_restore_row(be: &CudaBackend, kv: &mut CudaKv, row: usize) -> Result<()> {
    let Some(ds) = kv.delta.as_mut() else {
        return Ok(());
    };
    ensure!(
        row < ds.row_slots,
        "kv_restore_row: row {row} of {} row-state slots",
        ds.row_slots
    );
    let (conv, state) = (ds.conv.len(), ds.state.len());
    let (Some(rc), Some(rs)) = (&ds.row_conv, &ds.row_state) else {
        anyhow::bail!("kv_restore_row: the cache keeps no row states");
    };
    be.stream
        .memcpy_dtod(&rc.slice(row * conv..(row + 1) * conv), &mut ds.conv)?;
    be.stream
        .memcpy_dtod(&rs.slice(row * state..(row + 1) * state), &mut ds.state)?;
    Ok(())
}

/// Where a call of `rows` rows on layer `layer` leaves its per-row states: the device
/// address of row 0's slot for the layer in `buf` (`per_row` floats a row, `layer_len` a
/// layer) and the stride between rows, or a null address (no tracking).
fn row_slot(
    be: &CudaBackend,
    buf: &Option<CudaSlice<f32>>,
    slots: usize,
    rows: usize,
    layer: usize,
    layer_len: usize,
) -> (u64, i64) {
    match buf {
        Some(b) if rows <= slots => {
            let per_row = b.len() / slots;
            let base = b.device_ptr(&be.stream).0;
            (base + (layer * layer_len * 4) as u64, per_row as i64)
        }
        _ => (0, 0),
    }
}

/// The cache's linear-attention state, checked for layer `layer`.
fn delta_of(kv: &mut CudaKv, layer: usize) -> Result<&mut DeltaState> {
    let ds = kv
        .delta
        .as_mut()
        .context("this cache holds no linear-attention state")?;
    ensure!(
        layer < ds.n_layers,
        "linear-attention layer {layer} outside the cache ({} layers)",
        ds.n_layers
    );
    Ok(ds)
}

/// The f32 view of a 1-D weight (1-D weights are uploaded as f32).
fn f32_vec(w: &CudaWeight, n: usize) -> Result<CudaView<'_, f32>> {
    ensure!(
        w.dtype == GgmlType::F32 && w.shape.iter().product::<usize>() == n,
        "expected an f32 vector of {n}, got {:?} {}",
        w.shape,
        w.dtype
    );
    // SAFETY: the buffer holds exactly n little-endian f32 values.
    unsafe { w.data.transmute::<f32>(n) }.context("weight buffer too small")
}

/// The segment arguments of a conv or delta-rule launch: the device address of the step's
/// `[row0, rows, slot]` table and the floats between two slots' states (both 0 for one
/// sequence's call), the grid's z (sequences) and the most rows of one sequence.
fn segment_args(
    be: &CudaBackend,
    what: &str,
    batch: Option<&StepBatch<CudaSlice<i32>>>,
    rows: usize,
    ds: &DeltaState,
    layer_len: usize,
) -> Result<(u64, i64, u32, usize)> {
    Ok(
        match crate::check_delta_batch(what, batch, rows, ds.slots)? {
            None => (0, 0, 1, rows),
            Some(segs) => {
                let b = batch.expect("segments come from a batch");
                let most = segs.iter().map(|s| s.rows).max().unwrap_or(0);
                (
                    b.seg_info.device_ptr(&be.stream).0,
                    (ds.n_layers * layer_len) as i64,
                    u32::try_from(segs.len()).context("sequences in a step")?,
                    most,
                )
            }
        },
    )
}

fn i32_of(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).with_context(|| format!("{what} {x} does not fit in i32"))
}

pub fn causal_conv1d(
    be: &CudaBackend,
    kv: &mut CudaKv,
    layer: usize,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
    batch: Option<&StepBatch<CudaSlice<i32>>>,
) -> Result<()> {
    let ds = delta_of(kv, layer)?;
    let (c, kernel) = (ds.shape.conv_dim(), ds.shape.conv_kernel);
    check_shape("causal_conv1d x", x, x.rows, c)?;
    check_shape("causal_conv1d out", out, x.rows, c)?;
    ensure!(
        w.shape == [c, kernel],
        "causal_conv1d: weight {:?}, expected [{c}, {kernel}]",
        w.shape
    );
    if x.rows == 0 {
        return Ok(());
    }
    let len = ds.conv_len();
    let (segs, slot_stride, n_seqs, most_rows) =
        segment_args(be, "causal_conv1d", batch, x.rows, ds, len)?;
    // Row states: calls of one sequence only (a batched step never tracks them).
    let (rs, rs_stride) = if segs == 0 {
        row_slot(be, &ds.row_conv, ds.row_slots, x.rows, layer, len)
    } else {
        (0, 0)
    };
    // Slot 0's layer `layer`; the kernel adds slot · slot_stride for each sequence.
    let mut state = ds.conv.slice_mut(layer * len..);
    let (wtype, wrb) = (w.dtype.id() as i32, w.row_bytes() as i64);
    let (rows, ci, ki) = (
        i32_of(x.rows, "rows")?,
        i32_of(c, "channels")?,
        kernel as i32,
    );
    let cfg = LaunchConfig {
        grid_dim: (
            (c as u32).div_ceil(256),
            (most_rows as u32).div_ceil(CONV_ROWS as u32),
            n_seqs,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x and out hold rows × c floats (checked), the weight c rows of `kernel` taps,
    // the state view (kernel-1) × c floats; one thread per (channel, run of rows). A row
    // slot (rs, when not null) holds rows ≤ row_slots slots of stride rs_stride floats,
    // this layer's (kernel-1) × c of each at rs. Segments (segs, when not null): the step's
    // table of n_seqs [row0, rows, slot] tiling x's rows (checked), each slot < the pool's
    // slots, so state + slot · slot_stride stays in the pool.
    unsafe {
        be.stream
            .kernel(&be.gated_delta.conv)
            .arg(&x.buf)
            .arg(&*w.data)
            .arg(&wtype)
            .arg(&wrb)
            .arg(&mut state)
            .arg(&mut out.buf)
            .arg(&rows)
            .arg(&ci)
            .arg(&ki)
            .arg(&rs)
            .arg(&rs_stride)
            .arg(&segs)
            .arg(&slot_stride)
            .launch(cfg)
    }?;
    Ok(())
}

pub fn gated_delta_rule(
    be: &CudaBackend,
    kv: &mut CudaKv,
    a: DeltaArgs<'_, CudaSlice<f32>, CudaWeight>,
    out: &mut Act<CudaSlice<f32>>,
    batch: Option<&StepBatch<CudaSlice<i32>>>,
) -> Result<()> {
    let ds = delta_of(kv, a.layer)?;
    ensure!(ds.shape == a.shape, "gated_delta_rule: cache shape differs");
    let d = ds.shape;
    let rows = a.qkv.rows;
    let nv = d.n_v_heads;
    check_shape("gated_delta_rule qkv", a.qkv, rows, d.conv_dim())?;
    check_shape("gated_delta_rule a", a.a, rows, nv)?;
    check_shape("gated_delta_rule b", a.b, rows, nv)?;
    check_shape("gated_delta_rule out", out, rows, d.value_dim())?;
    let ssm_a = f32_vec(a.ssm_a, nv)?;
    let dt_bias = f32_vec(a.dt_bias, nv)?;
    if rows == 0 {
        return Ok(());
    }
    let (variant, lanes) = match d.k_head_dim {
        0..=32 => (0, 4),
        33..=64 => (1, 8),
        _ => (2, 8),
    };
    // float4 loads of q, k and the state: every run starts on a multiple of 4 floats.
    let vec = i32::from(d.k_head_dim % 4 == 0 && d.conv_dim() % 4 == 0);
    let len = ds.state_len();
    let (segs, slot_stride, n_seqs, _) =
        segment_args(be, "gated_delta_rule", batch, rows, ds, len)?;
    // Row states: the sequential kernel writes them (a tracked call never takes the chunked
    // one, which ignores them); calls of one sequence only.
    let (rs, rs_stride) = if segs == 0 {
        row_slot(be, &ds.row_state, ds.row_slots, rows, a.layer, len)
    } else {
        (0, 0)
    };
    // Slot 0's layer; the kernel adds slot · slot_stride for each sequence.
    let mut state = ds.state.slice_mut(a.layer * len..);
    let rows_i = i32_of(rows, "rows")?;
    let (nk, nv_i, dk, dv) = (
        d.n_k_heads as i32,
        i32_of(nv, "value heads")?,
        d.k_head_dim as i32,
        i32_of(d.v_head_dim, "value head dim")?,
    );
    let tiled = i32::from(d.tiled_v_heads);
    // The chunked tensor-core kernel (FERRITE_DELTA_CHUNKED=1) for prompts, else the
    // sequential one; both take the same arguments.
    let (func, cfg) = match be
        .gated_delta
        .chunked
        .as_ref()
        .filter(|_| rs == 0 && segs == 0 && rows >= CHUNKED_MIN_ROWS && chunked_on())
    {
        Some(f) => (
            f,
            LaunchConfig {
                grid_dim: (
                    nv as u32,
                    (d.v_head_dim as u32).div_ceil(CHUNKED_COLS as u32),
                    1,
                ),
                block_dim: (CHUNKED_THREADS, 1, 1),
                shared_mem_bytes: CHUNKED_SMEM as u32,
            },
        ),
        None => (
            &be.gated_delta.delta[variant],
            LaunchConfig {
                grid_dim: (
                    nv as u32,
                    (d.v_head_dim as u32).div_ceil((DELTA_THREADS / lanes) as u32),
                    n_seqs,
                ),
                block_dim: (DELTA_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
        ),
    };
    // SAFETY: shapes checked above; the state view is this layer's nv × dv × dk floats (its
    // offset a multiple of dk × dv, so 16-byte aligned when `vec`; so are the cp.async
    // rows of q and k); all bounds-checked inside. Sequential kernel: one block per (value
    // head, 128/lanes columns), static shared memory only. Chunked kernel: dk ≤ 128 = GDC_DK
    // (checked at kv_new_hybrid), one block per (value head, 32 state columns) with
    // CHUNKED_SMEM bytes of dynamic shared memory (the limit raised at load), its 16-byte
    // cp.async copies only when `vec` (and, for v, dv % 4 == 0, checked inside).
    unsafe {
        be.stream
            .kernel(func)
            .arg(&a.qkv.buf)
            .arg(&a.a.buf)
            .arg(&a.b.buf)
            .arg(&ssm_a)
            .arg(&dt_bias)
            .arg(&mut state)
            .arg(&mut out.buf)
            .arg(&rows_i)
            .arg(&nk)
            .arg(&nv_i)
            .arg(&dk)
            .arg(&dv)
            .arg(&tiled)
            .arg(&vec)
            .arg(&rs)
            .arg(&rs_stride)
            .arg(&segs)
            .arg(&slot_stride)
            .launch(cfg)
    }?;
    Ok(())
}

pub fn gated_rms_norm(
    be: &CudaBackend,
    x: &mut Act<CudaSlice<f32>>,
    z: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    head_dim: usize,
    eps: f32,
) -> Result<()> {
    check_shape("gated_rms_norm z", z, x.rows, x.cols)?;
    ensure!(
        head_dim > 0 && x.cols.is_multiple_of(head_dim),
        "gated_rms_norm: {} columns is not a whole number of {head_dim}-heads",
        x.cols
    );
    let wv = f32_vec(w, head_dim)?;
    let heads = x.rows * x.cols / head_dim;
    if heads == 0 {
        return Ok(());
    }
    let (heads_i, hd) = (i32_of(heads, "heads")?, i32_of(head_dim, "head dim")?);
    let cfg = LaunchConfig {
        grid_dim: ((heads as u32).div_ceil(8), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // The output feeds the out projection's quantized-x GEMV at decode rows: its planes here
    // (whole 32-element groups per warp: head_dim a multiple of 32), no quant_x_q8 launch.
    let mut fused = if be.gated_delta.planes && head_dim.is_multiple_of(32) {
        super::matmul::xq_for_producer(be, x.rows, x.cols)?
    } else {
        None
    };
    let cols = i32_of(x.cols, "columns")?;
    let mut launch = be.stream.kernel(&be.gated_delta.gated_rms_norm);
    launch
        .arg(&mut x.buf)
        .arg(&z.buf)
        .arg(&wv)
        .arg(&heads_i)
        .arg(&hd)
        .arg(&eps);
    super::ops::xq_planes(&mut launch, fused.as_mut().and_then(|g| g.as_mut()));
    launch.arg(&cols);
    // SAFETY: heads × head_dim floats in x and z; one warp per head; the int8 scratch (when
    // passed) holds ≥ rows rows of ≥ cols elements (xq_for_producer), cols % 32 == 0.
    unsafe { launch.launch(cfg) }?;
    if let Some(xq) = fused.as_mut().and_then(|g| g.as_mut()) {
        xq.record_producer(be, &x.buf, x.rows, x.cols);
    }
    Ok(())
}

pub fn sigmoid_gate(
    be: &CudaBackend,
    x: &mut Act<CudaSlice<f32>>,
    gate: &Act<CudaSlice<f32>>,
) -> Result<()> {
    ensure!(
        gate.rows == x.rows && (gate.cols == x.cols || gate.cols == 1),
        "sigmoid_gate: gate [{}, {}] for x [{}, {}]",
        gate.rows,
        gate.cols,
        x.rows,
        x.cols
    );
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let (n_i, cols, gcols) = (
        n as i64,
        i32_of(x.cols, "columns")?,
        i32_of(gate.cols, "gate columns")?,
    );
    let cfg = LaunchConfig {
        grid_dim: ((n as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // A per-element gate (the gated attention's output, which the o-projection reads next):
    // its planes here, whole warps on whole 32-element groups (cols % 32 == 0). The per-row
    // gate (the shared expert's) feeds an add, not a GEMV.
    let mut fused = if be.gated_delta.planes && gate.cols == x.cols {
        super::matmul::xq_for_producer(be, x.rows, x.cols)?
    } else {
        None
    };
    let mut launch = be.stream.kernel(&be.gated_delta.sigmoid_gate);
    launch
        .arg(&mut x.buf)
        .arg(&gate.buf)
        .arg(&n_i)
        .arg(&cols)
        .arg(&gcols);
    super::ops::xq_planes(&mut launch, fused.as_mut().and_then(|g| g.as_mut()));
    // SAFETY: n elements in x; gate holds one per element or one per row (checked); the int8
    // scratch (when passed) holds ≥ rows rows of ≥ cols elements, cols % 32 == 0
    // (xq_for_producer), so n is a multiple of 32 and warps cover whole groups.
    unsafe { launch.launch(cfg) }?;
    if let Some(xq) = fused.as_mut().and_then(|g| g.as_mut()) {
        xq.record_producer(be, &x.buf, x.rows, x.cols);
    }
    Ok(())
}
