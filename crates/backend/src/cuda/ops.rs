//! Launchers for the small ops (`kernels/elementwise.cu`) and weight upload.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{ensure, Context, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr, LaunchConfig};
use ferrite_formats::{quant, GgmlType};

use super::launch::{KernelArg, Launch, LaunchExt};
use super::{function, load_module, CudaBackend, CudaWeight};
use crate::{check_shape, Act, HostTensor, Rope, RopeStyle, StepInput};

pub const SRC: &str = include_str!("kernels/elementwise.cu");

/// The compiled kernels of `elementwise.cu`.
pub struct Kernels {
    embed: CudaFunction,
    rms_norm: CudaFunction,
    head_rms_norm: CudaFunction,
    rope: CudaFunction,
    /// `rope_tab`, `qk_norm_rope_tab`, `qk_norm_rope_kv_tab`: the three rotations with a RoPE
    /// scaling's frequency table in theta's place ([`rope_table`]).
    rope_tab: CudaFunction,
    add_rms_norm: CudaFunction,
    qk_norm_rope: CudaFunction,
    /// `qk_norm_rope_kv`: the prefill's k and v stored into the f16 cache by the same launch
    /// ([`qk_norm_rope_kv`]).
    qk_norm_rope_kv: CudaFunction,
    qk_norm_rope_tab: CudaFunction,
    qk_norm_rope_kv_tab: CudaFunction,
    /// The frequency tables copied to the device ([`rope_table`]), each beside the host table
    /// it was copied from.
    rope_tables: Mutex<Vec<RopeTable>>,
    add_assign: CudaFunction,
    swiglu: CudaFunction,
    topk_rows: CudaFunction,
    rms_norm_v4: CudaFunction,
    add_rms_norm_v4: CudaFunction,
    /// `add_rms_norm_v4_xbf16`, `add_rms_norm_v4_xf16`: it also writing h as a prefill's
    /// 16-bit x ([`add_rms_norm`], `FERRITE_NORM_X16`).
    add_rms_norm_v4_x16: [CudaFunction; 2],
    /// `rms_norm_v4_xbf16`, `rms_norm_v4_xf16`: the same hand-over from a norm with no add
    /// (after a projection that added the residual in its epilogue: [`rms_norm`]).
    rms_norm_v4_x16: [CudaFunction; 2],
    add_rms_norm_gemv_f32: CudaFunction,
    argmax_rows_mb: CudaFunction,
    /// `argmax_feed`: one row's argmax_rows_mb, its last block feeding the token to the next
    /// decode step (`Backend::argmax_feed`).
    argmax_feed: CudaFunction,
    /// `argmax_rows_mb`'s per-row best key and arrival ticket (zero between launches).
    argmax_scratch: Mutex<Option<ArgmaxScratch>>,
}

/// A RoPE frequency table on the device, beside the host table it was copied from.
type RopeTable = (Arc<[f32]>, CudaSlice<f32>);

struct ArgmaxScratch {
    best: CudaSlice<u64>,
    ticket: CudaSlice<u32>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &'static str) -> Result<Self> {
        let m = load_module(ctx, arch, "elementwise", SRC)?;
        Ok(Kernels {
            embed: function(&m, "embed")?,
            rms_norm: function(&m, "rms_norm")?,
            head_rms_norm: function(&m, "head_rms_norm")?,
            rope: function(&m, "rope")?,
            rope_tab: function(&m, "rope_tab")?,
            add_rms_norm: function(&m, "add_rms_norm")?,
            qk_norm_rope: function(&m, "qk_norm_rope")?,
            qk_norm_rope_kv: function(&m, "qk_norm_rope_kv")?,
            qk_norm_rope_tab: function(&m, "qk_norm_rope_tab")?,
            qk_norm_rope_kv_tab: function(&m, "qk_norm_rope_kv_tab")?,
            rope_tables: Mutex::new(Vec::new()),
            add_assign: function(&m, "add_assign")?,
            swiglu: function(&m, "swiglu")?,
            topk_rows: function(&m, "topk_rows")?,
            rms_norm_v4: function(&m, "rms_norm_v4")?,
            add_rms_norm_v4: function(&m, "add_rms_norm_v4")?,
            add_rms_norm_v4_x16: [
                function(&m, "add_rms_norm_v4_xbf16")?,
                function(&m, "add_rms_norm_v4_xf16")?,
            ],
            rms_norm_v4_x16: [
                function(&m, "rms_norm_v4_xbf16")?,
                function(&m, "rms_norm_v4_xf16")?,
            ],
            // The form that loads its router weights before its PDL wait (FERRITE_ROUTER_PRE=0:
            // after the norm, from L2).
            add_rms_norm_gemv_f32: function(
                &m,
                if super::switches::int_or("FERRITE_ROUTER_PRE", 1) != 0 {
                    "add_rms_norm_gemv_f32_pre"
                } else {
                    "add_rms_norm_gemv_f32"
                },
            )?,
            argmax_rows_mb: function(&m, "argmax_rows_mb")?,
            argmax_feed: function(&m, "argmax_feed")?,
            argmax_scratch: Mutex::new(None),
        })
    }
}

/// A 1-D launch of `n` threads in blocks of `threads` (at least one block).
pub(crate) fn grid_1d(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(threads).max(1), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The type a weight of type `t` is held in on the device: as stored, except MXFP4 (no
/// kernels of its own), held as Q8_0 ([`upload`]; as BF16 in the rare tensor whose block
/// scales Q8_0's f16 cannot hold).
pub fn device_type(t: GgmlType) -> GgmlType {
    match t {
        GgmlType::MXFP4 => GgmlType::Q8_0,
        t => t,
    }
}

/// Weights go to VRAM as stored; 1-D weights (norm scales) as f32. MXFP4 weights, for which
/// there are no kernels of their own, go as Q8_0 blocks of the very same numbers
/// ([`quant::fp4::mxfp4_to_q8_0`]: the doubled codes as int8, the half scale as the f16
/// scale), onto the tuned Q8_0 kernels at 8.5 bits a weight; a tensor with a block scale
/// outside f16's range goes as BF16, which also holds every MXFP4 value exactly (two
/// significant bits times a power of two), at 16 bits a weight.
pub fn upload(be: &CudaBackend, t: &HostTensor<'_>) -> Result<CudaWeight> {
    let (dtype, bytes) = held(t)?;
    to_vram(be, dtype, &t.shape, &bytes)
}

/// A weight of `dtype` and `shape` from its held bytes, in VRAM.
fn to_vram(be: &CudaBackend, dtype: GgmlType, shape: &[usize], bytes: &[u8]) -> Result<CudaWeight> {
    let data = if bytes.is_empty() {
        be.stream.alloc_zeros::<u8>(1)?
    } else {
        be.stream.clone_htod(bytes)?
    };
    Ok(CudaWeight::in_vram(dtype, shape.to_vec(), data))
}

/// Bytes [`upload`] will hold `t` in (its stored size where it cannot tell: a malformed
/// tensor, which the upload then refuses). An MXFP4 tensor whose block scales Q8_0 cannot
/// hold is counted as Q8_0, though it goes as BF16.
pub fn held_bytes(t: &HostTensor<'_>) -> u64 {
    let n: usize = t.shape.iter().product();
    held_type(t.dtype, &t.shape)
        .bytes_for(n)
        .map_or(t.data.len(), |b| b) as u64
}

/// The type [`upload`] holds a weight of `dtype` and `shape` in: 1-D weights as f32, a type
/// without kernels in [`device_type`]'s, the rest as stored.
pub fn held_type(dtype: GgmlType, shape: &[usize]) -> GgmlType {
    if shape.len() == 1 {
        GgmlType::F32
    } else {
        device_type(dtype)
    }
}

/// What a weight is held as on the device: its type and bytes ([`upload`]'s conversions).
fn held<'a>(t: &'a HostTensor<'_>) -> Result<(GgmlType, Cow<'a, [u8]>)> {
    let n = t.validate()?;
    let held = held_type(t.dtype, &t.shape);
    // Decoded, then encoded in `to` (exact for MXFP4 into BF16).
    let convert = |to: GgmlType| -> Result<(GgmlType, Cow<'a, [u8]>)> {
        let mut f = vec![0f32; n];
        quant::dequantize(t.dtype, &t.data, &mut f)?;
        let mut out = vec![0u8; to.bytes_for(n)?];
        quant::quantize(to, &f, &mut out)?;
        Ok((to, Cow::Owned(out)))
    };
    let (dtype, bytes) = if held == t.dtype {
        (t.dtype, Cow::Borrowed(&t.data[..]))
    } else if t.dtype == GgmlType::MXFP4 && held == GgmlType::Q8_0 {
        match quant::fp4::mxfp4_to_q8_0(&t.data) {
            Some(b) => (GgmlType::Q8_0, Cow::Owned(b)),
            // A block scale f16 cannot hold: BF16, which holds every MXFP4 value.
            None => convert(GgmlType::BF16)?,
        }
    } else {
        convert(held)?
    };
    Ok((dtype, bytes))
}

/// Where stacked experts go: device memory up to `limit` bytes of them, host memory after
/// ([`upload_experts`]). `limit` is `u64::MAX` until a load sets one.
#[derive(Debug)]
pub struct ExpertBudget {
    limit: AtomicU64,
    device: AtomicU64,
    host: AtomicU64,
}

impl Default for ExpertBudget {
    fn default() -> Self {
        ExpertBudget {
            limit: AtomicU64::new(u64::MAX),
            device: AtomicU64::new(0),
            host: AtomicU64::new(0),
        }
    }
}

impl ExpertBudget {
    /// From now on, at most `bytes` more of experts in device memory (`None`: no limit).
    pub fn set(&self, bytes: Option<u64>) {
        let placed = self.device.load(Ordering::Relaxed);
        let limit = bytes.map_or(u64::MAX, |b| placed.saturating_add(b));
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes of experts placed in host memory so far.
    pub fn host_bytes(&self) -> u64 {
        self.host.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes of the budget if they fit (true: the weight goes to device memory),
    /// else counts them as host-held. Loads upload one tensor at a time, so the check and
    /// the add need not be one atomic step.
    fn place(&self, n: u64) -> bool {
        let device = self.device.load(Ordering::Relaxed);
        if device.saturating_add(n) <= self.limit.load(Ordering::Relaxed) {
            self.device.store(device + n, Ordering::Relaxed);
            true
        } else {
            self.host.fetch_add(n, Ordering::Relaxed);
            false
        }
    }
}

/// [`upload`] for stacked experts: into VRAM while the backend's [`ExpertBudget`] lasts,
/// else into pinned host memory mapped into the device's address space
/// (`CU_MEMHOSTALLOC_DEVICEMAP`), whose device address the kernels read as they read VRAM.
/// A decode step then moves its routed experts' bytes across the bus (PCIe: ~50 GB/s at
/// best against VRAM's ~4.3 TB/s), so a model whose experts do not all fit runs, slower,
/// instead of failing to load. Pinned, not pageable: the GPU cannot fault host pages in.
pub fn upload_experts(be: &CudaBackend, t: &HostTensor<'_>) -> Result<CudaWeight> {
    let (dtype, bytes) = held(t)?;
    if bytes.is_empty() || be.expert_budget.place(bytes.len() as u64) {
        return to_vram(be, dtype, &t.shape, &bytes);
    }
    let len = bytes.len();
    let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP
        | cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: the memory is written whole below before any kernel can read it.
    let mut host =
        unsafe { be.ctx.alloc_pinned_with_flags::<u8>(len, flags) }.with_context(|| {
            format!(
                "pinning {:.2} GiB of host memory for experts that do not fit in the GPU's \
             (experts past the host's memory are not supported: use a smaller quantization \
             or a machine with more memory)",
                len as f64 / (1u64 << 30) as f64
            )
        })?;
    {
        use rayon::prelude::*;
        const CHUNK: usize = 16 << 20;
        let dst = host.as_mut_slice()?;
        dst.par_chunks_mut(CHUNK)
            .zip(bytes.par_chunks(CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
    let mut dptr: cudarc::driver::sys::CUdeviceptr = 0;
    // SAFETY: `host` is a live DEVICEMAP allocation of `len` bytes; the call writes dptr.
    unsafe {
        cudarc::driver::sys::cuMemHostGetDevicePointer_v2(
            &mut dptr,
            host.as_mut_ptr()? as *mut std::ffi::c_void,
            0,
        )
        .result()
        .context("mapping pinned host memory into the device's address space")?;
    }
    // SAFETY: dptr addresses `len` bytes (the mapping above); CudaWeight's Drop leaks this
    // view rather than freeing it as device memory, and frees `host` after it.
    let data = unsafe { be.stream.upgrade_device_ptr::<u8>(dptr, len) };
    Ok(CudaWeight::in_host(dtype, t.shape.clone(), data, host))
}

/// The f32 view of a 1-D weight uploaded by [`upload`].
pub(crate) fn f32_vec(w: &CudaWeight, n: usize) -> Result<cudarc::driver::CudaView<'_, f32>> {
    ensure!(
        w.dtype == GgmlType::F32 && w.shape.iter().product::<usize>() == n,
        "expected an f32 vector of {n}, got {:?} {}",
        w.shape,
        w.dtype
    );
    // SAFETY: the buffer holds exactly n little-endian f32 values.
    unsafe { w.data.transmute::<f32>(n) }.ok_or_else(|| anyhow::anyhow!("weight buffer too small"))
}

pub fn embed(
    be: &CudaBackend,
    table: &CudaWeight,
    step: &StepInput<CudaSlice<i32>>,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    let [_, dim] = table.shape[..] else {
        anyhow::bail!("embedding table is not 2-D: {:?}", table.shape)
    };
    check_shape("embed out", out, step.rows, dim)?;
    let (ty, rb) = (table.dtype.id() as i32, table.row_bytes() as i64);
    let cfg = LaunchConfig {
        grid_dim: (
            step.rows as u32,
            dim.div_ceil(256).clamp(1, 65535) as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let dim = dim as i32;
    // SAFETY: token ids were range-checked on the host in set_step's caller (the model's
    // vocabulary); the kernel reads row_bytes per token and writes rows×dim floats.
    unsafe {
        be.stream
            .kernel(&be.ops.embed)
            .arg(&*table.data)
            .arg(&ty)
            .arg(&rb)
            .arg(&step.tokens)
            .arg(&mut out.buf)
            .arg(&dim)
            .launch(cfg)
    }?;
    Ok(())
}

/// `out = rms_norm(x) · w`. With `readers` (the form in which every reader of `out` takes a
/// prefill's 16-bit x, [`x16_only`]) the norm hands `out` over to them as that x
/// (`rms_norm_v4_x16`), and leaves its f32 rows unwritten.
pub(crate) fn rms_norm(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    eps: f32,
    out: &mut Act<CudaSlice<f32>>,
    readers: Option<super::matmul::X16>,
) -> Result<()> {
    check_shape("rms_norm out", out, x.rows, x.cols)?;
    if x.rows == 0 {
        return Ok(());
    }
    let wv = f32_vec(w, x.cols)?;
    let cols = x.cols as i32;
    let v4 = norm_v4_threads(be, w, x.cols);
    if let (Some(threads), Some(mut xb)) = (v4, norm_x16_only(be, v4, x.rows, x.cols, readers)?) {
        let mut launch = be
            .stream
            .kernel(&be.ops.rms_norm_v4_x16[usize::from(xb.kind == super::matmul::X16::F16)]);
        launch
            .arg(&x.buf)
            .arg(&wv)
            .arg(&0u64)
            .arg(&cols)
            .arg(&eps)
            .arg(xb.buf()?);
        // SAFETY: x is [rows, cols] (checked with out); one block per row of `threads` ≤ 1024
        // covering cols / 4 chunks in ≤ NORM_NV rounds (norm_v4_threads: 16-byte aligned
        // rows); out's f32 rows are not written (null); the 16-bit scratch holds rows × cols
        // (xb_for_producer).
        unsafe { launch.launch(norm_v4_config(x.rows, threads)) }?;
        xb.record(be, &out.buf, x.rows, x.cols, true);
        return Ok(());
    }
    if let Some(threads) = v4 {
        // The final norm feeds the lm head's quantized-x GEMV at decode: quantize there too.
        let mut fused = super::matmul::xq_for_producer(be, x.rows, x.cols)?;
        let mut launch = be.stream.kernel(&be.ops.rms_norm_v4);
        launch
            .arg(&x.buf)
            .arg(&wv)
            .arg(&mut out.buf)
            .arg(&cols)
            .arg(&eps);
        xq_planes(&mut launch, fused.as_mut().and_then(|g| g.as_mut()));
        // SAFETY: x and out are [rows, cols] (checked), 16-byte aligned rows (cols % 4 == 0,
        // aligned bases: norm_v4_threads); one block per row of `threads` ≤ 1024 threads
        // covering cols / 4 chunks in ≤ NORM_NV rounds; the scratch holds ≥ rows rows of
        // ≥ cols (a multiple of 32) elements.
        unsafe { launch.launch(norm_v4_config(x.rows, threads)) }?;
        if let Some(xq) = fused.as_mut().and_then(|g| g.as_mut()) {
            xq.record_producer(be, &out.buf, x.rows, x.cols);
        }
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (x.rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: shapes checked above; one block per row.
    unsafe {
        be.stream
            .kernel(&be.ops.rms_norm)
            .arg(&x.buf)
            .arg(&wv)
            .arg(&mut out.buf)
            .arg(&cols)
            .arg(&eps)
            .launch(cfg)
    }?;
    Ok(())
}

/// The last two arguments of a norm that can quantize its output for the next GEMV: the
/// scratch's int8 planes and block scales, or two null pointers (no quantization).
pub(crate) fn xq_planes(launch: &mut Launch<'_>, xq: Option<&mut super::matmul::XQuant>) {
    match xq {
        Some(xq) => launch.arg(&mut xq.q).arg(&mut xq.d),
        None => launch.arg(&0u64).arg(&0u64),
    };
}

/// Float4 chunks per thread at most in the vectorised norms (NORM_NV in elementwise.cu).
const NORM_NV: usize = 4;

/// Threads per block of the vectorised norms (`rms_norm_v4`, `add_rms_norm_v4`) for rows of
/// `cols`, or `None` where they do not apply (cols not a multiple of 4, more than
/// 1024 · NORM_NV chunks, or a weight not 16-byte aligned). One thread per float4 chunk up to
/// 1024 threads, a multiple of 32; chosen from `cols` alone so that a row's summation order
/// never depends on the number of rows in the step.
fn norm_v4_threads(be: &CudaBackend, w: &CudaWeight, cols: usize) -> Option<u32> {
    let chunks = cols / 4;
    let aligned = {
        let (ptr, _sync) = w.data.device_ptr(&be.stream);
        ptr % 16 == 0
    };
    (cols.is_multiple_of(4) && chunks > 0 && chunks <= 1024 * NORM_NV && aligned)
        .then(|| chunks.next_multiple_of(32).min(1024) as u32)
}

fn norm_v4_config(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub fn head_rms_norm(
    be: &CudaBackend,
    x: &mut Act<CudaSlice<f32>>,
    w: &CudaWeight,
    head_dim: usize,
    eps: f32,
) -> Result<()> {
    ensure!(
        x.cols.is_multiple_of(head_dim),
        "head_rms_norm: {} columns is not a whole number of {head_dim}-heads",
        x.cols
    );
    let wv = f32_vec(w, head_dim)?;
    let heads = (x.rows * x.cols / head_dim) as i32;
    let hd = head_dim as i32;
    let cfg = LaunchConfig {
        grid_dim: ((heads as u32).div_ceil(8).max(1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: heads × head_dim floats in x; one warp per head.
    unsafe {
        be.stream
            .kernel(&be.ops.head_rms_norm)
            .arg(&mut x.buf)
            .arg(&wv)
            .arg(&heads)
            .arg(&hd)
            .arg(&eps)
            .launch(cfg)
    }?;
    Ok(())
}

/// The device address of `rope`'s frequency table ([`Rope::inv_freq`], a RoPE scaling's) for
/// the `_tab` kernels, or `None` where the rotation has none (the kernels then compute
/// `theta^(-2i / rot_dim)` themselves). A table is copied the first time it is asked for and
/// kept for the backend's life, so the address stays valid in a captured step; the loader asks
/// before any step (`Backend::load_rope`), so a capture never copies.
pub(crate) fn rope_table(be: &CudaBackend, rope: &Rope) -> Result<Option<u64>> {
    let Some(host) = &rope.inv_freq else {
        return Ok(None);
    };
    ensure!(
        host.len() == rope.rot_dim / 2,
        "RoPE frequency table of {} values for {} rotary dimensions",
        host.len(),
        rope.rot_dim
    );
    let mut tables = be
        .ops
        .rope_tables
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, dev)) = tables.iter().find(|(h, _)| Arc::ptr_eq(h, host)) {
        return Ok(Some(dev.device_ptr(&be.stream).0));
    }
    let dev = be.stream.clone_htod(&host[..])?;
    let ptr = dev.device_ptr(&be.stream).0;
    tables.push((host.clone(), dev));
    Ok(Some(ptr))
}

pub fn rope(
    be: &CudaBackend,
    x: &mut Act<CudaSlice<f32>>,
    head_dim: usize,
    step: &StepInput<CudaSlice<i32>>,
    rope: &Rope,
) -> Result<()> {
    crate::check_rope(x, head_dim, step, rope)?;
    let table = rope_table(be, rope)?;
    let total = x.rows * (x.cols / head_dim) * (rope.rot_dim / 2);
    let (rows, cols, hd, rd) = (
        x.rows as i32,
        x.cols as i32,
        head_dim as i32,
        rope.rot_dim as i32,
    );
    let neox = i32::from(rope.style == RopeStyle::Neox);
    // SAFETY: one thread per rotated pair, bounds-checked in the kernel; a table holds
    // rot_dim / 2 floats (rope_table).
    unsafe {
        let mut b = be.stream.kernel(match table {
            Some(_) => &be.ops.rope_tab,
            None => &be.ops.rope,
        });
        b.arg(&mut x.buf)
            .arg(&step.positions)
            .arg(&rows)
            .arg(&cols)
            .arg(&hd)
            .arg(&rd)
            .arg(&neox);
        match &table {
            Some(t) => b.arg(t),
            None => b.arg(&rope.theta),
        };
        b.launch(grid_1d(total, 256))
    }?;
    Ok(())
}

/// Threads per block of `add_rms_norm`: about 4 columns per thread (a decode row of 4096
/// spreads over a whole 1024-thread block). Chosen from `cols` alone, so a row's summation
/// order never depends on the number of rows in the step.
fn add_rms_norm_threads(cols: usize) -> u32 {
    (cols.div_ceil(4).next_multiple_of(32)).clamp(32, 1024) as u32
}

/// The 16-bit scratch for a producer (a norm, the prefill attention) whose every reader takes a
/// prefill's 16-bit x in the form `readers` (mmw.rs [`super::mmw::x16_readers`]): the producer
/// writes that x and not its f32 output. `None` (write the f32 output) unless the hand-over
/// applies (prefill rows, the scratch in that form: [`super::matmul::xb_for_producer`]) and can
/// be recorded, or under `FERRITE_NORM_X16_ONLY=0`. The producer's own hand-over switch
/// (`FERRITE_NORM_X16`, `FERRITE_ATTN_X16`) is its caller's to ask.
pub(crate) fn x16_only(
    be: &CudaBackend,
    rows: usize,
    cols: usize,
    readers: Option<super::matmul::X16>,
) -> Result<Option<super::matmul::XbProducer<'_>>> {
    let Some(form) = readers else {
        return Ok(None);
    };
    if !x16_only_on() {
        return Ok(None);
    }
    Ok(super::matmul::xb_for_producer(be, rows, cols)?
        .filter(|xb| xb.kind == form && xb.recordable(be)))
}

/// [`x16_only`] for a vectorised norm (`v4`, its threads where [`norm_v4_threads`] takes the
/// row: the `_x16` kernels are its forms) under its hand-over switch (`FERRITE_NORM_X16`).
fn norm_x16_only(
    be: &CudaBackend,
    v4: Option<u32>,
    rows: usize,
    cols: usize,
    readers: Option<super::matmul::X16>,
) -> Result<Option<super::matmul::XbProducer<'_>>> {
    match v4 {
        Some(_) if super::matmul::norm_x16() => x16_only(be, rows, cols, readers),
        _ => Ok(None),
    }
}

/// `FERRITE_NORM_X16_ONLY` (read once; default 1): a prefill norm or attention whose readers all
/// take its 16-bit hand-over leaves its f32 output unwritten ([`x16_only`]; MATMUL.md round
/// 102).
fn x16_only_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::switches::int_or("FERRITE_NORM_X16_ONLY", 1) != 0)
}

/// `x += y`, `h = rms_norm(x) · w`; with `readers` as in [`rms_norm`] (h handed over as the
/// readers' 16-bit x and its f32 rows left unwritten where [`x16_only`] applies).
pub(crate) fn add_rms_norm(
    be: &CudaBackend,
    x: &mut Act<CudaSlice<f32>>,
    y: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    eps: f32,
    h: &mut Act<CudaSlice<f32>>,
    readers: Option<super::matmul::X16>,
) -> Result<()> {
    crate::check_add_rms_norm(x, y, w.shape.iter().product(), h)?;
    if x.rows == 0 {
        return Ok(());
    }
    let wv = f32_vec(w, x.cols)?;
    let cols = x.cols as i32;
    let v4 = norm_v4_threads(be, w, x.cols);
    let cfg = match v4 {
        Some(threads) => norm_v4_config(x.rows, threads),
        None => LaunchConfig {
            grid_dim: (x.rows as u32, 1, 1),
            block_dim: (add_rms_norm_threads(x.cols), 1, 1),
            shared_mem_bytes: 0,
        },
    };
    // A decode step's h feeds a quantized-x GEMV next (the QKV or gate/up projections): the
    // kernel also quantizes it into the GEMV's scratch, which the GEMV then uses instead of
    // launching `quant_x_q8` (matmul.rs, `XQuant::src`).
    let mut fused = super::matmul::xq_for_producer(be, x.rows, x.cols)?;
    if x.rows == 1 && super::switches::diag_skip() & 1 != 0 {
        // Timing diagnostic only: no launch, and the planes (stale) recorded as h's.
        if let Some(xq) = fused.as_mut().and_then(|g| g.as_mut()) {
            xq.record_producer(be, &h.buf, x.rows, x.cols);
        }
        return Ok(());
    }
    // A prefill's h read next by matmuls (their x converted to 16 bits, matmul.rs
    // `with_scratch_rows`): the v4 kernel's `_x16` form writes that 16-bit x too, recorded as
    // h's.
    let only = norm_x16_only(be, v4, x.rows, x.cols, readers)?;
    let h_written = only.is_none();
    let mut x16 = match (v4, only) {
        (_, Some(xb)) => Some(xb),
        (Some(_), None) if super::matmul::norm_x16() => {
            super::matmul::xb_for_producer(be, x.rows, x.cols)?
        }
        _ => None,
    };
    let mut launch = be.stream.kernel(match (&x16, v4) {
        (Some(xb), _) => {
            &be.ops.add_rms_norm_v4_x16[usize::from(xb.kind == super::matmul::X16::F16)]
        }
        (None, Some(_)) => &be.ops.add_rms_norm_v4,
        (None, None) => &be.ops.add_rms_norm,
    });
    launch.arg(&mut x.buf).arg(&y.buf).arg(&wv);
    if h_written {
        launch.arg(&mut h.buf);
    } else {
        launch.arg(&0u64);
    }
    launch.arg(&cols).arg(&eps);
    match x16.as_mut() {
        Some(xb) => {
            launch.arg(xb.buf()?);
        }
        None => xq_planes(&mut launch, fused.as_mut().and_then(|g| g.as_mut())),
    }
    // SAFETY: x, y, h are [rows, cols] (checked above; distinct buffers by the borrows; h
    // null, not written, where x16_only applies: the x16 kernels test it); one block per row,
    // at most 1024 threads (32 warps: the kernel's shared partials; the v4 kernel's chunks fit
    // NORM_NV rounds and its rows are 16-byte aligned, see norm_v4_threads); the int8 scratch
    // holds GEMV_MAX_ROWS ≥ rows rows of ≥ cols (a multiple of 32) elements, the 16-bit one
    // rows × cols (xb_for_producer).
    unsafe { launch.launch(cfg) }?;
    if let Some(xb) = &x16 {
        xb.record(be, &h.buf, x.rows, x.cols, !h_written);
    }
    if let Some(xq) = fused.as_mut().and_then(|g| g.as_mut()) {
        xq.record_producer(be, &h.buf, x.rows, x.cols);
    }
    Ok(())
}

/// A MoE block's input and router at one decode row in one launch
/// (`add_rms_norm_gemv_f32`, plan in elementwise.cu): `x_out = x + y`, `h = rms_norm(x_out) ·
/// w` with h's int8 planes for the experts, `out = h · wmᵀ` — each bitwise what
/// [`add_rms_norm`] + the f32 GEMV give (x itself untouched: the caller's residual moves to
/// `x_out`). Returns `Ok(false)` (nothing launched) where
/// the fused kernel does not apply: more than one row, a router that is not an f32 matrix
/// of at most `F32_SMALL_OUT` rows, a row the one-chunk-per-thread norm cannot hold, or
/// `FERRITE_NORM_ROUTER=0`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_gemv(
    be: &CudaBackend,
    x: &Act<CudaSlice<f32>>,
    y: &Act<CudaSlice<f32>>,
    x_out: &mut Act<CudaSlice<f32>>,
    w: &CudaWeight,
    eps: f32,
    h: &mut Act<CudaSlice<f32>>,
    wm: &CudaWeight,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<bool> {
    use super::matmul::{f32_gemv_split, F32_SMALL_OUT, GEMV_NW};
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| super::switches::int_or("FERRITE_NORM_ROUTER", 1) != 0);
    let cols = x.cols;
    let n_out = wm.shape.first().copied().unwrap_or(0);
    if !on
        || x.rows != 1
        || wm.dtype != GgmlType::F32
        || wm.shape.len() != 2
        || wm.shape[1] != cols
        || n_out == 0
        || n_out > F32_SMALL_OUT
        || !cols.is_multiple_of(32)
    {
        return Ok(false);
    }
    let Some(threads) = norm_v4_threads(be, w, cols) else {
        return Ok(false);
    };
    let warps = threads as usize / 32;
    let ks = f32_gemv_split(be, n_out, cols);
    // One float4 chunk per thread (the norm's order for that count), whole row groups.
    if cols / 4 > threads as usize || !warps.is_multiple_of(ks) {
        return Ok(false);
    }
    crate::check_add_rms_norm(x, y, w.shape.iter().product(), h)?;
    check_shape("add_rms_norm_matmul x_out", x_out, x.rows, cols)?;
    check_shape("add_rms_norm_matmul out", out, x.rows, n_out)?;
    {
        let (ptr, _sync) = wm.data.device_ptr(&be.stream);
        ensure!(ptr % 16 == 0, "router weight buffer is not 16-byte aligned");
    }
    let wv = f32_vec(w, cols)?;
    let rows_per_block = warps / ks * GEMV_NW;
    let cfg = LaunchConfig {
        grid_dim: (n_out.div_ceil(rows_per_block) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: (cols * 4) as u32,
    };
    let (cols_i, n_out_i, ks_i) = (cols as i32, n_out as i32, ks as i32);
    let mut fused = super::matmul::xq_for_producer(be, 1, cols)?;
    let mut launch = be.stream.kernel(&be.ops.add_rms_norm_gemv_f32);
    launch
        .arg(&x.buf)
        .arg(&y.buf)
        .arg(&wv)
        .arg(&mut x_out.buf)
        .arg(&mut h.buf)
        .arg(&cols_i)
        .arg(&eps);
    xq_planes(&mut launch, fused.as_mut().and_then(|g| g.as_mut()));
    launch
        .arg(&*wm.data)
        .arg(&n_out_i)
        .arg(&ks_i)
        .arg(&mut out.buf);
    // SAFETY: x, y, x_out, h are [1, cols] and out [1, n_out] (checked above; distinct
    // buffers by the borrows); wm is [n_out, cols] f32, 16-byte aligned; one chunk per
    // thread (cols / 4 <= threads <= 1024) and cols · 4 bytes of dynamic shared memory
    // (at most 16 KB: cols <= 4096); the scratch holds ≥ one row of cols elements.
    unsafe { launch.launch(cfg) }?;
    if let Some(xq) = fused.as_mut().and_then(|g| g.as_mut()) {
        xq.record_producer(be, &h.buf, 1, cols);
    }
    Ok(true)
}

/// Rotary pairs per lane of `qk_norm_rope` (QKR_PAIRS in elementwise.cu).
const QKR_PAIRS: usize = 4;
/// Registers a lane of the heads one warp of `qk_norm_rope`'s register form takes (QKR_HREGS),
/// at four or eight a head (heads of up to 128 or 256 elements).
const QKR_HREGS: usize = 16;
/// Rows from which `qk_norm_rope` gives a warp several heads: a prefill's, whose warps are
/// plenty either way (a decode step's few heads keep one a warp).
const QKR_HEADS_MIN_ROWS: usize = 32;

/// `FERRITE_QKR_HEADS` (read once; default 1): several heads a warp in `qk_norm_rope`'s
/// register form on prefills: pp512 on an H100 +2.2% on Qwen3-30B-A3B, +2.1% on Qwen3-8B
/// Q4_K_M (MATMUL.md round 90).
fn qkr_heads() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| super::switches::int_or("FERRITE_QKR_HEADS", 1) != 0)
}

#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    be: &CudaBackend,
    q: &mut Act<CudaSlice<f32>>,
    k: &mut Act<CudaSlice<f32>>,
    q_norm: Option<&CudaWeight>,
    k_norm: Option<&CudaWeight>,
    head_dim: usize,
    eps: f32,
    step: &StepInput<CudaSlice<i32>>,
    rope: &Rope,
) -> Result<()> {
    let len = |w: &CudaWeight| w.shape.iter().product::<usize>();
    crate::check_qk_norm_rope(
        q,
        k,
        [q_norm.map(len), k_norm.map(len)],
        head_dim,
        step,
        rope,
    )?;
    ensure!(
        rope.rot_dim <= 2 * 32 * QKR_PAIRS,
        "qk_norm_rope: {} rotary dimensions (the kernel holds up to {} per head)",
        rope.rot_dim,
        2 * 32 * QKR_PAIRS
    );
    qk_norm_rope_launch(be, q, k, (q_norm, k_norm), head_dim, eps, step, rope, None).map(|_| ())
}

/// The f16 KV cache plane pair a prefill's k and v go to ([`qk_norm_rope_kv`]; elementwise.cu
/// `KvDst`): v's rows, this layer's K and V planes (elements from `layer_off`), positions a kv
/// head.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct KvDst {
    pub(crate) v: u64,
    pub(crate) kc: u64,
    pub(crate) vc: u64,
    pub(crate) layer_off: i64,
    pub(crate) capacity: i32,
}

// SAFETY: plain old data laid out as the C struct (three pointers, a long long, an int).
unsafe impl super::launch::ScalarArg for KvDst {}

/// [`qk_norm_rope`] whose k and v also go straight to the f16 KV cache, as `kv_store` would
/// write them (elementwise.cu `qk_norm_rope_kv`): k's rotated rows go to the cache instead of
/// back into `k`, v's rows are stored unchanged, and the attention after it runs no store launch
/// (attention.rs `qk_norm_rope_attention_stored`). `Ok(false)`, nothing done, where the kernel's
/// register form does not take the rotation (the caller runs qk_norm_rope and kv_store). The
/// caller checked the shapes (`check_qk_norm_rope`), v's (`[rows, k.cols]`) and that `kd` is the
/// layer's cache with room for every position.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qk_norm_rope_kv(
    be: &CudaBackend,
    q: &mut Act<CudaSlice<f32>>,
    k: &mut Act<CudaSlice<f32>>,
    norms: (Option<&CudaWeight>, Option<&CudaWeight>),
    head_dim: usize,
    eps: f32,
    step: &StepInput<CudaSlice<i32>>,
    rope: &Rope,
    kd: KvDst,
) -> Result<bool> {
    qk_norm_rope_launch(be, q, k, norms, head_dim, eps, step, rope, Some(kd))
}

/// The `qk_norm_rope` launch, or with `kd` the `qk_norm_rope_kv` one (`Ok(false)`, nothing done,
/// where that form's register path does not take the rotation).
#[allow(clippy::too_many_arguments)]
fn qk_norm_rope_launch(
    be: &CudaBackend,
    q: &mut Act<CudaSlice<f32>>,
    k: &mut Act<CudaSlice<f32>>,
    (q_norm, k_norm): (Option<&CudaWeight>, Option<&CudaWeight>),
    head_dim: usize,
    eps: f32,
    step: &StepInput<CudaSlice<i32>>,
    rope: &Rope,
    kd: Option<KvDst>,
) -> Result<bool> {
    let qw = q_norm.map(|w| f32_vec(w, head_dim)).transpose()?;
    let kw = k_norm.map(|w| f32_vec(w, head_dim)).transpose()?;
    let table = rope_table(be, rope)?;
    let (q_heads, k_heads) = (q.cols / head_dim, k.cols / head_dim);
    // Heads a warp (the kernel's register form only, on prefills): 16 registers a lane of them,
    // so that a token's angles are computed once per 4 heads of up to 128 elements (2 of 256)
    // instead of once a head (`FERRITE_QKR_HEADS=0`: one a warp; MATMUL.md round 90).
    let half = rope.rot_dim / 2;
    let regs = rope.style == RopeStyle::Neox
        && half.is_multiple_of(32)
        && matches!(half / 32, 1 | 2 | 4)
        && head_dim.is_multiple_of(32)
        && head_dim <= 256;
    if kd.is_some() && !regs {
        return Ok(false);
    }
    let hpw = if regs && q.rows >= QKR_HEADS_MIN_ROWS && qkr_heads() {
        // The kernel's registers a head (qkr_heads<NR>): 4 for heads of up to 128 elements, else 8.
        QKR_HREGS / if head_dim <= 128 { 4 } else { 8 }
    } else {
        1
    };
    // KV: as many warps again as k's, for v.
    let k_warps = k_heads.div_ceil(hpw) * if kd.is_some() { 2 } else { 1 };
    let warps = q.rows * (q_heads.div_ceil(hpw) + k_warps);
    if warps == 0 {
        return Ok(true);
    }
    let (rows, qh, kh, hd, rd, hpw) = (
        q.rows as i32,
        q_heads as i32,
        k_heads as i32,
        head_dim as i32,
        rope.rot_dim as i32,
        hpw as i32,
    );
    let neox = i32::from(rope.style == RopeStyle::Neox);
    // A null device pointer: that head family has no norm weight.
    let null: u64 = 0;
    // 8 warps per block; one warp per (row, hpw heads).
    let cfg = grid_1d(warps * 32, 256);
    // SAFETY: q is [rows, q_heads·head_dim], k [rows, k_heads·head_dim] (checked, same rows
    // as the step); norm weights hold head_dim floats (f32_vec); the kernel returns for
    // warps past rows·(q_heads + k_heads).
    unsafe {
        let mut b = be.stream.kernel(match (kd, table) {
            (Some(_), None) => &be.ops.qk_norm_rope_kv,
            (None, None) => &be.ops.qk_norm_rope,
            (Some(_), Some(_)) => &be.ops.qk_norm_rope_kv_tab,
            (None, Some(_)) => &be.ops.qk_norm_rope_tab,
        });
        b.arg(&mut q.buf).arg(&mut k.buf);
        match &qw {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        match &kw {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&step.positions)
            .arg(&rows)
            .arg(&qh)
            .arg(&kh)
            .arg(&hd)
            .arg(&rd)
            .arg(&neox);
        match &table {
            Some(t) => b.arg(t),
            None => b.arg(&rope.theta),
        };
        b.arg(&eps).arg(&hpw);
        if let Some(kd) = &kd {
            b.arg(kd);
        }
        b.launch(cfg)
    }?;
    Ok(true)
}

pub fn add_assign(
    be: &CudaBackend,
    x: &mut Act<CudaSlice<f32>>,
    y: &Act<CudaSlice<f32>>,
) -> Result<()> {
    check_shape("add_assign", y, x.rows, x.cols)?;
    let n = x.len() as i64;
    // SAFETY: n elements in both buffers.
    unsafe {
        be.stream
            .kernel(&be.ops.add_assign)
            .arg(&mut x.buf)
            .arg(&y.buf)
            .arg(&n)
            .launch(grid_1d(n as usize, 256))
    }?;
    Ok(())
}

pub fn swiglu(
    be: &CudaBackend,
    g: &Act<CudaSlice<f32>>,
    u: &Act<CudaSlice<f32>>,
    out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    check_shape("swiglu up", u, g.rows, g.cols)?;
    check_shape("swiglu out", out, g.rows, g.cols)?;
    let n = g.len() as i64;
    // SAFETY: n elements in all three buffers.
    unsafe {
        be.stream
            .kernel(&be.ops.swiglu)
            .arg(&g.buf)
            .arg(&u.buf)
            .arg(&mut out.buf)
            .arg(&n)
            .launch(grid_1d(n as usize, 256))
    }?;
    Ok(())
}

/// Blocks per row of the multi-block argmax (a 151,936-logit row: ~1,200 values per block).
const ARGMAX_BLOCKS: usize = 128;

/// Where `argmax_feed` feeds the token: the step's tokens and positions, and the log with its
/// length.
pub struct Feed<'a> {
    pub step: &'a mut StepInput<CudaSlice<i32>>,
    pub log: &'a mut CudaSlice<i32>,
    pub log_len: usize,
}

pub fn argmax(
    be: &CudaBackend,
    logits: &Act<CudaSlice<f32>>,
    out: &mut CudaSlice<i32>,
) -> Result<()> {
    argmax_launch(be, logits, out, None)
}

/// `argmax`, and with `feed` the token fed back on the device (`argmax_feed`; the caller has
/// made `check_argmax_feed`'s checks).
pub fn argmax_launch(
    be: &CudaBackend,
    logits: &Act<CudaSlice<f32>>,
    out: &mut CudaSlice<i32>,
    mut feed: Option<Feed<'_>>,
) -> Result<()> {
    ensure!(
        out.len() >= logits.rows,
        "argmax: {} rows into {}",
        logits.rows,
        out.len()
    );
    if logits.rows == 0 {
        return Ok(());
    }
    let cols = logits.cols as i32;
    let mut guard = be
        .ops
        .argmax_scratch
        .lock()
        .map_err(|_| anyhow::anyhow!("argmax scratch lock poisoned"))?;
    // Grown (zeroed) outside graph capture: the engine's first decode step runs eagerly with
    // the step's row count; 64 rows cover every batched decode step up to 64 sequences.
    if guard.as_ref().is_none_or(|s| s.ticket.len() < logits.rows) {
        let n = logits.rows.max(64);
        *guard = Some(ArgmaxScratch {
            best: be.stream.alloc_zeros::<u64>(n)?,
            ticket: be.stream.alloc_zeros::<u32>(n)?,
        });
    }
    let s = guard
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("argmax scratch missing"))?;
    let cfg = LaunchConfig {
        grid_dim: (
            ARGMAX_BLOCKS.min(logits.cols.div_ceil(256)).max(1) as u32,
            logits.rows as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let log_len = i32::try_from(feed.as_ref().map_or(1, |f| f.log_len))?;
    {
        let func = if feed.is_some() {
            &be.ops.argmax_feed
        } else {
            &be.ops.argmax_rows_mb
        };
        let mut launch = be.stream.kernel(func);
        launch
            .arg(&logits.buf)
            .arg(out)
            .arg(&cols)
            .arg(&mut s.best)
            .arg(&mut s.ticket);
        if let Some(f) = feed.as_mut() {
            launch
                .arg(&mut f.step.tokens)
                .arg(&mut f.step.positions)
                .arg(&mut *f.log)
                .arg(&log_len);
        }
        // SAFETY: logits hold rows × cols floats; out ≥ rows (checked); best/ticket hold ≥
        // rows zeroed entries, left zeroed by each launch's last block; argmax_feed's last
        // block also writes tokens[0], positions[0] and log[p % log_len] (log_len ≤ the log's
        // length: check_argmax_feed).
        unsafe { launch.launch(cfg) }?;
    }
    if let Some(f) = feed {
        f.step.pos0 += 1;
    }
    Ok(())
}

pub fn top_k(
    be: &CudaBackend,
    logits: &Act<CudaSlice<f32>>,
    k: usize,
    ids: &mut CudaSlice<i32>,
    vals: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    crate::check_top_k(logits, k, ids.len(), vals)?;
    let (cols, k) = (logits.cols as i32, k as i32);
    let cfg = LaunchConfig {
        grid_dim: (logits.rows as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: one block of 1024 threads per row; writes k ids and k values per row.
    unsafe {
        be.stream
            .kernel(&be.ops.topk_rows)
            .arg(&logits.buf)
            .arg(ids)
            .arg(&mut vals.buf)
            .arg(&cols)
            .arg(&k)
            .launch(cfg)
    }?;
    Ok(())
}

/// Device-to-device copy bandwidth (bytes read + written per second), best of 10 copies of
/// 1 GiB: the ceiling the decode roofline is measured against.
pub fn copy_bandwidth(be: &CudaBackend) -> Result<f64> {
    const N: usize = 1 << 30;
    let src = be.stream.alloc_zeros::<u8>(N)?;
    let mut dst = be.stream.alloc_zeros::<u8>(N)?;
    be.stream.memcpy_dtod(&src, &mut dst)?; // warm-up
    be.stream.synchronize()?;
    let mut best = f64::MAX;
    for _ in 0..10 {
        let t0 = std::time::Instant::now();
        be.stream.memcpy_dtod(&src, &mut dst)?;
        be.stream.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(2.0 * N as f64 / best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(dtype: GgmlType, shape: Vec<usize>, data: Vec<u8>) -> HostTensor<'static> {
        HostTensor {
            dtype,
            shape,
            data: Cow::Owned(data),
        }
    }

    /// What the upload holds (no device needed): MXFP4 as Q8_0 of the same numbers, or as
    /// BF16 where a block scale is past f16; 1-D weights as f32; the rest as stored, borrowed.
    #[test]
    fn held_forms() {
        use quant::fp4::{MXFP4_BYTES, QK_MXFP4};
        let block = |e: u8| -> Vec<u8> {
            let mut b = vec![e];
            b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
            b
        };
        let decode = |ty: GgmlType, bytes: &[u8]| {
            let mut f = vec![0f32; 2 * QK_MXFP4];
            quant::dequantize(ty, bytes, &mut f).unwrap();
            f
        };
        for (e2, want) in [(127u8, GgmlType::Q8_0), (200, GgmlType::BF16)] {
            let data = [block(120), block(e2)].concat();
            assert_eq!(data.len(), 2 * MXFP4_BYTES);
            let t = tensor(GgmlType::MXFP4, vec![1, 2 * QK_MXFP4], data.clone());
            let (ty, bytes) = held(&t).unwrap();
            assert_eq!(ty, want, "second block's scale {e2}");
            assert_eq!(held_bytes(&t), GgmlType::Q8_0.bytes_for(64).unwrap() as u64);
            assert_eq!(
                decode(ty, &bytes),
                decode(GgmlType::MXFP4, &data),
                "scale {e2}"
            );
        }
        let norm = tensor(GgmlType::F16, vec![4], vec![0, 60, 0, 64, 0, 0, 0, 188]);
        let (ty, bytes) = held(&norm).unwrap();
        assert_eq!((ty, bytes.len()), (GgmlType::F32, 16));
        assert_eq!(held_bytes(&norm), 16);
        let q8 = tensor(GgmlType::Q8_0, vec![1, 32], vec![0; 34]);
        let (ty, bytes) = held(&q8).unwrap();
        assert!(ty == GgmlType::Q8_0 && matches!(bytes, Cow::Borrowed(_)));
    }
}
