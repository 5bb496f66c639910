//! Mixture-of-experts launchers (`kernels/moe.cu`): device-side top-k routing, the expert
//! gate/up GEMVs with SwiGLU, and the expert down GEMVs fused with the weighted combine.
//!
//! Three launches per layer, none of which depends on host knowledge of the routing, so a
//! captured decode graph replays correctly whatever experts the tokens pick. Scratch
//! buffers (routing ids/weights, SwiGLU activations) live in [`Kernels`] and grow on first
//! use with a bigger shape; the engine runs its first decode step eagerly before capturing,
//! so no allocation ever happens inside a capture. Buffers replaced by a bigger one are kept
//! alive (not freed) because an earlier captured graph may still point at them.

use std::sync::{Arc, Mutex};

use anyhow::{bail, ensure, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg,
};

/// Kernel source.
pub const SRC: &str = include_str!("kernels/moe.cu");

use super::{function, load_module, CudaBackend, CudaWeight};
use crate::{check_shape, Act, ExpertWeights, MoeRouting};

/// Warps per block of the expert kernels (`MOE_WARPS` in moe.cu).
const MOE_WARPS: usize = 8;
/// The routing kernel keeps one f32 per expert in shared memory (48 KiB default limit).
const MAX_EXPERTS: usize = 8192;
/// moe_down keeps every slot's partial result of its rows in shared memory.
const MAX_TOP_K: usize = 64;

/// Device scratch for one MoE call; grown geometrically, never shrunk.
struct Scratch {
    /// `[rows·top_k]` expert ids, then weights.
    ids: CudaSlice<i32>,
    wts: CudaSlice<f32>,
    /// `[rows·top_k, ffn]` SwiGLU activations.
    h: CudaSlice<f32>,
    /// Buffers replaced by bigger ones: a captured graph may still reference them.
    retired: Vec<(CudaSlice<i32>, CudaSlice<f32>, CudaSlice<f32>)>,
}

/// The compiled MoE kernels and their scratch.
pub struct Kernels {
    route: CudaFunction,
    gate_up: CudaFunction,
    down: CudaFunction,
    scratch: Mutex<Option<Scratch>>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self> {
        let m = load_module(ctx, arch, "moe", SRC)?;
        Ok(Kernels {
            route: function(&m, "moe_route")?,
            gate_up: function(&m, "moe_gate_up")?,
            down: function(&m, "moe_down")?,
            scratch: Mutex::new(None),
        })
    }
}

/// `(n_out, n_in)` of a stacked expert weight `[n_experts, n_out, n_in]`.
fn expert_dims(what: &str, w: &CudaWeight, n_experts: usize) -> Result<(usize, usize)> {
    match w.shape[..] {
        [e, o, i] if e == n_experts => {
            let bs = w.dtype.block_size();
            ensure!(
                i % bs == 0,
                "moe {what}: row length {i} is not a multiple of the {} block size {bs}",
                w.dtype
            );
            Ok((o, i))
        }
        _ => bail!(
            "moe {what}: expert weight shape {:?} does not hold {n_experts} experts",
            w.shape
        ),
    }
}

/// Whether a device buffer starts 16-byte aligned (the fast decoders' precondition).
fn aligned16<T>(be: &CudaBackend, s: &CudaSlice<T>) -> bool {
    let (p, _sync) = s.device_ptr(&be.stream);
    p % 16 == 0
}

fn i32_arg(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| anyhow::anyhow!("moe: {what} = {v} does not fit in i32"))
}

pub fn moe(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    router_logits: &Act<CudaSlice<f32>>,
    experts: ExpertWeights<'_, CudaWeight>,
    routing: MoeRouting,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    let (rows, hidden) = (x.rows, x.cols);
    let MoeRouting {
        n_experts,
        top_k,
        norm_topk,
    } = routing;
    check_shape("moe router logits", router_logits, rows, n_experts)?;
    check_shape("moe out", out, rows, hidden)?;
    ensure!(
        top_k >= 1 && top_k <= n_experts,
        "moe: top-k {top_k} of {n_experts} experts"
    );
    ensure!(
        n_experts <= MAX_EXPERTS,
        "moe: {n_experts} experts (the routing kernel supports up to {MAX_EXPERTS})"
    );
    ensure!(
        top_k <= MAX_TOP_K,
        "moe: top-k {top_k} (the expert kernels support up to {MAX_TOP_K})"
    );
    let (ffn, h_in) = expert_dims("gate", experts.gate, n_experts)?;
    ensure!(
        h_in == hidden
            && expert_dims("up", experts.up, n_experts)? == (ffn, hidden)
            && expert_dims("down", experts.down, n_experts)? == (hidden, ffn),
        "moe: expert shapes disagree (gate {:?}, up {:?}, down {:?}, hidden {hidden})",
        experts.gate.shape,
        experts.up.shape,
        experts.down.shape
    );
    if rows == 0 {
        return Ok(());
    }
    let pairs = rows * top_k;

    let mut guard = be
        .moe
        .scratch
        .lock()
        .map_err(|_| anyhow::anyhow!("moe scratch lock poisoned"))?;
    let grow = match guard.as_ref() {
        None => true,
        Some(s) => s.ids.len() < pairs || s.h.len() < pairs * ffn,
    };
    if grow {
        // Geometric growth keeps the number of retired buffers logarithmic.
        let (old_pairs, old_h) = guard.as_ref().map_or((0, 0), |s| (s.ids.len(), s.h.len()));
        let np = pairs.next_power_of_two().max(old_pairs);
        let nh = (pairs * ffn).next_power_of_two().max(old_h);
        let mut fresh = Scratch {
            ids: be.stream.alloc_zeros::<i32>(np)?,
            wts: be.stream.alloc_zeros::<f32>(np)?,
            h: be.stream.alloc_zeros::<f32>(nh)?,
            retired: Vec::new(),
        };
        if let Some(old) = guard.take() {
            fresh.retired = old.retired;
            fresh.retired.push((old.ids, old.wts, old.h));
        }
        *guard = Some(fresh);
    }
    let s = guard
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("moe scratch missing"))?;

    let (ne, tk, hid, ff) = (
        i32_arg("n_experts", n_experts)?,
        i32_arg("top_k", top_k)?,
        i32_arg("hidden", hidden)?,
        i32_arg("ffn", ffn)?,
    );
    let (rows_i, pairs_i) = (i32_arg("rows", rows)?, i32_arg("rows·top_k", pairs)?);
    let norm = i32::from(norm_topk);

    // 1. Routing: one warp per token.
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: (n_experts * 4) as u32,
    };
    // SAFETY: logits hold rows × n_experts floats (checked); ids/wts hold ≥ rows·top_k.
    unsafe {
        be.stream
            .launch_builder(&be.moe.route)
            .arg(&router_logits.buf)
            .arg(&ne)
            .arg(&tk)
            .arg(&norm)
            .arg(&mut s.ids)
            .arg(&mut s.wts)
            .launch(cfg)
    }?;

    // 2. Gate/up + SwiGLU: one warp per (pair, ffn row).
    let x_a16 = aligned16(be, &x.buf);
    let h_a16 = aligned16(be, &s.h);
    let (g, u, d) = (experts.gate, experts.up, experts.down);
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
            .launch_builder(&be.moe.gate_up)
            .arg(&x.buf)
            .arg(&s.ids)
            .arg(&g.data)
            .arg(&g_ty)
            .arg(&g_rb)
            .arg(&g_a16)
            .arg(&u.data)
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
            .launch_builder(&be.moe.down)
            .arg(&s.h)
            .arg(&s.ids)
            .arg(&s.wts)
            .arg(&d.data)
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
