//! The CUDA backend: our own kernels (`kernels/*.cu`, compiled at first use by NVRTC for the
//! device's architecture), weights in VRAM in their file types, preallocated activations, and
//! decode steps captured as CUDA graphs.
//!
//! Loaded dynamically (cudarc `dynamic-loading`): the same binary builds and runs on machines
//! without CUDA; [`CudaBackend::available`] says whether a GPU can be used.
//!
//! Kernel families, one launcher module each:
//! - [`ops`]: embedding, RMSNorm, per-head RMSNorm, RoPE, add, SwiGLU, argmax, and the fused
//!   add + RMSNorm and QK-norm + RoPE (`elementwise.cu`).
//! - [`matmul`]: decode GEMV for every weight type and the prefill matmul on the tensor cores.
//! - [`mmq`]: the prefill matmul of Q4_K/Q5_K/Q6_K/Q8_0 weights on the int8 tensor cores (x
//!   quantized as for the decode GEMV); tried first (opt-in), then
//! - [`mmw`]: the prefill matmul on the sm_90a warpgroup tensor cores (wgmma), bf16 numerics;
//!   [`matmul`] otherwise.
//! - [`attention`]: KV cache (f16 / q8_0), prefill flash attention, split-K decode attention.
//! - [`moe`]: top-k routing and batched expert FFNs.
//! - [`gated_delta`]: Qwen3.5's Gated DeltaNet ops (conv1d + state, the delta rule with its
//!   state in VRAM), gated RMSNorm, sigmoid gate.
//!
//! Every kernel is launched through [`launch`] (programmatic dependent launch on Hopper).

pub mod attention;
pub mod blas;
pub mod gated_delta;
pub mod launch;
pub mod matmul;
pub mod mmq;
pub mod mmw;
pub mod moe;
pub mod nvrtc;
pub mod ops;
pub(crate) mod switches;
mod timeline;

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream};
use ferrite_formats::GgmlType;

use crate::{
    Act, AttnArgs, AttnShape, Backend, ExpertWeights, HostTensor, MoeRouting, Rope, StepInput,
};

/// Source shared by every kernel file: block layouts and dequantization of the ggml types
/// (prepended to each `.cu` before compilation).
pub const COMMON_CUH: &str = include_str!("kernels/common.cuh");

/// The block timeline's stamps (`FERRITE_DIAG_TL`), prepended only when that is set.
const TIMELINE_CUH: &str = include_str!("kernels/timeline.cuh");

/// A weight in VRAM, in its file type (quantized blocks exactly as stored in the GGUF).
/// 1-D weights (norm scales) are converted to f32 at upload: they are tiny and read often.
///
/// Stacked experts past the expert budget ([`ops::upload_experts`]) live in pinned host
/// memory mapped into the device's address space instead: `data` is then that memory's
/// device address, which every kernel reads as it reads VRAM (each load crossing the bus),
/// so no kernel knows where its weight is.
pub struct CudaWeight {
    pub dtype: GgmlType,
    /// Row-major shape; the last dimension is contiguous.
    pub shape: Vec<usize>,
    /// The bytes' device address. Dropped by [`CudaWeight`]'s `Drop`: freed as device
    /// memory, or, for a host-held weight, released with `host`.
    pub data: std::mem::ManuallyDrop<CudaSlice<u8>>,
    /// The pinned host memory `data` maps, for a weight held in host memory.
    host: Option<cudarc::driver::PinnedHostSlice<u8>>,
}

impl CudaWeight {
    /// A weight in device memory.
    pub(crate) fn in_vram(dtype: GgmlType, shape: Vec<usize>, data: CudaSlice<u8>) -> Self {
        CudaWeight {
            dtype,
            shape,
            data: std::mem::ManuallyDrop::new(data),
            host: None,
        }
    }

    /// A weight in pinned host memory `host`, `data` being its device address.
    pub(crate) fn in_host(
        dtype: GgmlType,
        shape: Vec<usize>,
        data: CudaSlice<u8>,
        host: cudarc::driver::PinnedHostSlice<u8>,
    ) -> Self {
        CudaWeight {
            dtype,
            shape,
            data: std::mem::ManuallyDrop::new(data),
            host: Some(host),
        }
    }

    /// Bytes of one row (the last dimension).
    pub fn row_bytes(&self) -> usize {
        self.shape
            .last()
            .map_or(0, |&n| n / self.dtype.block_size() * self.dtype.type_size())
    }

    /// Whether the weight is held in host memory (read by the kernels across the bus).
    pub fn in_host_memory(&self) -> bool {
        self.host.is_some()
    }
}

impl Drop for CudaWeight {
    fn drop(&mut self) {
        // SAFETY: `data` is taken once, here, and not used after.
        let data = unsafe { std::mem::ManuallyDrop::take(&mut self.data) };
        if self.host.is_some() {
            // Host memory is not the device allocator's to free: wait for every kernel
            // that may still read it, forget the device view, and let `host` free the
            // pages (PinnedHostSlice's own drop).
            let stream = data.stream().clone();
            data.leak();
            if let Err(e) = stream.synchronize() {
                tracing::warn!("synchronizing before freeing a host-held weight: {e}");
            }
        } else {
            drop(data);
        }
    }
}

/// The device, its stream and every compiled kernel.
pub struct CudaBackend {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// NVRTC architecture, e.g. `compute_90a`.
    pub arch: &'static str,
    pub sm_count: usize,
    pub device_name: String,
    pub ops: ops::Kernels,
    pub matmul: matmul::Kernels,
    pub mmq: mmq::Kernels,
    pub mmw: mmw::Kernels,
    pub attention: attention::Kernels,
    pub moe: moe::Kernels,
    pub gated_delta: gated_delta::Kernels,
    /// The stream and scratch of the MoE expert prediction beside a captured decode step
    /// ([`moe::prefetch`]).
    pub moe_side: moe::Side,
    /// cuBLASLt for the 16-bit weights' dense prefill GEMMs, where `FERRITE_CUBLASLT` asks
    /// for it and the library is present ([`blas`]); made at the first such GEMM, so that a
    /// model without 16-bit weights never loads the library or holds its workspace.
    pub blas: std::sync::OnceLock<Option<blas::Lt>>,
    /// How many bytes of stacked experts may still go to VRAM ([`ops::upload_experts`]).
    pub expert_budget: ops::ExpertBudget,
}

/// The bf16 decoders shared by the prefill matmul kernels (`matmul.cu`'s `mm_`, the wgmma
/// `mmw.cu` and `moe.cu`'s grouped expert GEMM), prepended to those files after
/// [`COMMON_CUH`].
pub const MM_DECODE_CUH: &str = include_str!("kernels/mm_decode.cuh");

/// Whether a timing diagnostic is on, as the backend itself reads them (`FERRITE_DIAG_SKIP`
/// leaves launches out, `FERRITE_DIAG_DQ` swaps a dequantization: wrong outputs;
/// `FERRITE_DIAG_CLBAR` relaxes cluster barriers past the memory model's guarantees;
/// `FERRITE_DIAG_TL` stamps every block, ~5% slower; `FERRITE_DIAG_MMW` and
/// `FERRITE_GEMV_DIAG` leave loads or compute out; `FERRITE_MOE_PREDICT_HITS` makes every MoE
/// layer wait for its expert prediction): `bench` then skips its gate and
/// refuses to record.
pub fn timing_diagnostic() -> bool {
    switches::diag_skip() != 0
        || switches::diag_dq() != 0
        || switches::diag_clbar() != 0
        || switches::diag_tl() != 0
        || switches::diag_mmw() != 0
        || switches::diag_gemv() != 0
        || moe::hits_diagnostic()
}

/// A kernel file as NVRTC compiles it: [`COMMON_CUH`] prepended (and [`MM_DECODE_CUH`] for
/// the files that dequantize weights to bf16).
pub fn full_source(name: &str, src: &str) -> String {
    let mut defs = String::new();
    // The wgmma prefill's forms (MATMUL.md rounds 81-85): x by tensor copies on by default
    // (FERRITE_MMW_XTMA), and the register-A form for Q4_K (FERRITE_MMW_RS, FERRITE_MMW_RSW)
    // and Q8_0 (FERRITE_MMW_RS_Q8) and dense Q6_K (FERRITE_MMW_RS_Q6); the x copies after the
    // fence (FERRITE_MMW_XAFTER, −17% on an H100) as a switch, off.
    if name == "mmw" {
        if switches::int_or("FERRITE_MMW_XAFTER", 0) != 0 {
            defs += "#define MMW_XAFTER 1\n";
        }
        if mmw::xtma() {
            defs += "#define MMW_XTMA 1\n";
        }
        if mmw::rs() {
            defs += "#define MMW_RS 1\n";
        }
        if mmw::rs_q8() {
            defs += "#define MMW_RS_Q8 1\n";
        }
        if mmw::rs_q6() {
            defs += "#define MMW_RS_Q6 1\n";
        }
        if mmw::rs_q5() {
            defs += "#define MMW_RS_Q5 1\n";
        }
        if mmw::rs_q6_moe() != 0 {
            defs += "#define MMW_RS_Q6_MOE 1\n";
        }
        if mmw::gu_xg() != 0 {
            defs += &format!("#define MMW_GU_XG {}\n", mmw::gu_xg());
        }
        if mmw::tshift() {
            defs += "#define MMW_TSHIFT 1\n";
        }
        let gu_lead = mmw::gu_lead();
        if gu_lead != 0 {
            defs += &format!("#define MMW_GU_LEAD {gu_lead}\n");
        }
    }
    // Timing diagnostics compiled in (wrong outputs or outside the memory model: bench skips
    // its gate and refuses to record): FERRITE_DIAG_MMW (mmw.cu's producers), FERRITE_DIAG_DQ
    // (attention.cu's q8_dequant8), FERRITE_DIAG_CLBAR (common.cuh's cluster_sync_diag) and
    // FERRITE_DIAG_TL (the block timeline's stamps, kernels/timeline.cuh: the outputs
    // unchanged, every file).
    if name == "mmw" && switches::diag_mmw() != 0 {
        defs += &format!("#define MMW_DIAG {}\n", switches::diag_mmw());
    }
    if name == "attention" && switches::diag_dq() != 0 {
        defs += &format!("#define ATTN_DIAG_DQ {}\n", switches::diag_dq());
    }
    // (Each file gets the define only for its own bit, so the other's machine code is the
    // default's and its cache entry too.)
    let clbar = switches::diag_clbar() & if name == "attention" { 1 } else { 2 };
    if matches!(name, "attention" | "matmul") && clbar != 0 {
        defs += &format!("#define DIAG_CLBAR {clbar}\n");
    }
    if switches::diag_tl() != 0 {
        // The decode attention's five marks (attention.cu TL_MARK; ATTENTION.md, 33rd session).
        if name == "attention" {
            defs += "#define TL_MARK_SLOTS 5u\n";
        }
        // The one-row tensor-core GEMV block's three (matmul.cu gemvq_tc_block; DECODE_STEP.md,
        // 68th session).
        if name == "matmul" {
            defs += "#define TL_MARK_SLOTS 3u\n";
        }
        defs += "#define FERRITE_TL 1\n";
        defs += TIMELINE_CUH;
    }
    // (elementwise.cu and attention.cu: the norms' and the prefill attention's 16-bit
    // hand-over to the prefill matmuls rounds with mm_decode.cuh's pack_bf16 / pack_f16_sat.)
    if matches!(name, "matmul" | "mmw" | "moe" | "elementwise" | "attention") {
        format!("{defs}{COMMON_CUH}\n#line 1 \"mm_decode.cuh\"\n{MM_DECODE_CUH}\n#line 1 \"{name}.cu\"\n{src}")
    } else {
        format!("{defs}{COMMON_CUH}\n#line 1 \"{name}.cu\"\n{src}")
    }
}

/// Compiles `src` (with [`COMMON_CUH`] prepended) and loads it as a module: a CUBIN for the
/// device's exact architecture (nvrtc.rs), or, if that fails or `FERRITE_KERNEL_PTX=1`,
/// PTX that the driver compiles.
pub fn load_module(
    ctx: &Arc<CudaContext>,
    arch: &'static str,
    name: &str,
    src: &str,
) -> Result<Arc<CudaModule>> {
    let full = full_source(name, src);
    let mut module = None;
    if switches::int_or("FERRITE_KERNEL_PTX", 0) != 1 {
        let loaded = nvrtc::compile_cubin(name, &full, arch, false).and_then(|bin| {
            ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin))
                .map_err(anyhow::Error::from)
        });
        match loaded {
            Ok(m) => module = Some(m),
            Err(e) => tracing::warn!("{name} kernels as CUBIN: {e:#}; loading them as PTX"),
        }
    }
    let module = match module {
        Some(m) => m,
        None => ctx
            .load_module(nvrtc::compile(name, &full, arch)?)
            .with_context(|| format!("loading the {name} kernels"))?,
    };
    if switches::diag_tl() != 0 {
        timeline::register(name, &module);
    }
    Ok(module)
}

/// Compiles every kernel file's CUBIN in parallel (one thread each; NVRTC is thread-safe
/// across programs) into nvrtc.rs's caches, so that the sequential loads that follow find
/// them: a cold start costs the slowest file (matmul.cu) instead of the sum. Errors are
/// left to the loads (which report them, or fall back to PTX).
fn precompile(arch: &'static str) {
    if switches::int_or("FERRITE_KERNEL_PTX", 0) == 1 {
        return;
    }
    std::thread::scope(|sc| {
        for (name, src) in sources() {
            sc.spawn(move || {
                let _ = nvrtc::compile_cubin(name, &full_source(name, src), arch, true);
            });
        }
    });
}

/// Every kernel source: (name, text). Compiled together by [`compile_all`].
pub fn sources() -> Vec<(&'static str, &'static str)> {
    vec![
        ("elementwise", ops::SRC),
        ("matmul", matmul::SRC),
        ("mmq", mmq::SRC),
        ("mmw", mmw::SRC),
        ("attention", attention::SRC),
        ("moe", moe::SRC),
        ("gated_delta", gated_delta::SRC),
    ]
}

/// Compiles every kernel for `arch` with NVRTC to PTX (no GPU needed): catches compile
/// errors on machines without a device. Returns (name, PTX bytes) per file.
pub fn compile_all(arch: &'static str) -> Result<Vec<(&'static str, usize)>> {
    sources()
        .into_iter()
        .map(|(name, src)| {
            Ok((
                name,
                nvrtc::compile(name, &full_source(name, src), arch)?
                    .to_src()
                    .len(),
            ))
        })
        .collect()
}

/// Compiles every kernel for the real architecture of `arch` to CUBIN (no GPU needed), in
/// parallel: what a device start-up does first ([`precompile`]), and how a CUBIN cache for
/// another machine is made (FERRITE_CACHE_DIR). Returns (name, CUBIN bytes) per file.
pub fn compile_all_cubin(arch: &'static str) -> Result<Vec<(&'static str, usize)>> {
    std::thread::scope(|sc| {
        let jobs: Vec<_> = sources()
            .into_iter()
            .map(|(name, src)| {
                sc.spawn(move || -> Result<(&'static str, usize)> {
                    Ok((
                        name,
                        nvrtc::compile_cubin(name, &full_source(name, src), arch, false)?.len(),
                    ))
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .map_err(|_| anyhow::anyhow!("a compile thread panicked"))?
            })
            .collect()
    })
}

/// Loads a kernel by its `extern "C"` name (once, at start-up).
pub fn function(m: &Arc<CudaModule>, name: &str) -> Result<CudaFunction> {
    m.load_function(name)
        .with_context(|| format!("kernel {name} not found"))
}

impl CudaBackend {
    /// Whether a CUDA device can be used: the driver library loads and reports a device.
    /// cudarc panics when a library is missing, so the probe runs under `catch_unwind` with
    /// the panic message silenced.
    pub fn available() -> bool {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let ok = std::panic::catch_unwind(|| {
            CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
        })
        .unwrap_or(false);
        std::panic::set_hook(hook);
        ok
    }

    /// Opens device `ordinal` and compiles every kernel for it.
    pub fn new(ordinal: usize) -> Result<Self> {
        ensure!(
            Self::available(),
            "no CUDA device found (the CUDA driver library did not load or reports no GPU)"
        );
        switches::validate()?;
        let ctx = CudaContext::new(ordinal).context("creating the CUDA context")?;
        // One stream for the chain, in order; cudarc's automatic per-buffer events stay off
        // (they also break graph capture). The MoE expert prediction's side stream
        // (moe.rs `Side`) is ordered against it by explicit events.
        // SAFETY: called before any other stream or allocation exists.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().context("creating a CUDA stream")?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = nvrtc::arch_for(major, minor);
        launch::configure_pdl(major);
        precompile(arch);
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        let device_name = ctx.name()?;
        Ok(CudaBackend {
            blas: std::sync::OnceLock::new(),
            ops: ops::Kernels::load(&ctx, arch)?,
            matmul: matmul::Kernels::load(&ctx, arch)?,
            mmq: mmq::Kernels::load(&ctx, arch)?,
            mmw: mmw::Kernels::load(&ctx, arch)?,
            attention: attention::Kernels::load(&ctx, arch)?,
            moe: moe::Kernels::load(&ctx, arch)?,
            gated_delta: gated_delta::Kernels::load(&ctx, arch)?,
            moe_side: moe::Side::new(&stream)?,
            expert_budget: Default::default(),
            ctx,
            stream,
            arch,
            sm_count,
            device_name,
        })
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type IBuf = CudaSlice<i32>;
    type Weight = CudaWeight;
    type Kv = attention::CudaKv;
    type Graph = CudaGraph;

    fn name(&self) -> String {
        format!(
            "cuda:{} {} ({}, {} SMs)",
            self.ctx.ordinal(),
            self.device_name,
            self.arch,
            self.sm_count
        )
    }

    fn device_name(&self) -> String {
        self.device_name.clone()
    }

    fn copy_bandwidth(&self) -> Result<f64> {
        ops::copy_bandwidth(self)
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        self.mem_info()
            .ok()
            .map(|(free, total)| ((total - free) as u64, total as u64))
    }

    /// The type the next `kv_new` makes (f16 unless the loader chose q8_0).
    fn kv_bytes_per_element(&self) -> f64 {
        self.attention.kv_type().bytes_per_element()
    }

    fn load_rope(&self, rope: &Rope) -> Result<()> {
        ops::rope_table(self, rope).map(|_| ())
    }

    fn upload(&self, t: &HostTensor<'_>) -> Result<CudaWeight> {
        ops::upload(self, t)
    }

    fn held_bytes(&self, t: &HostTensor<'_>) -> u64 {
        ops::held_bytes(t)
    }

    fn upload_experts(&self, t: &HostTensor<'_>) -> Result<CudaWeight> {
        ops::upload_experts(self, t)
    }

    fn set_expert_budget(&self, bytes: Option<u64>) {
        self.expert_budget.set(bytes);
    }

    fn host_expert_bytes(&self) -> u64 {
        self.expert_budget.host_bytes()
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<Act<CudaSlice<f32>>> {
        let buf = self.stream.alloc_zeros::<f32>((rows * cols).max(1))?;
        Ok(Act {
            buf,
            rows,
            cols,
            capacity: rows,
        })
    }

    fn step_input(&self, capacity: usize) -> Result<StepInput<CudaSlice<i32>>> {
        Ok(StepInput {
            tokens: self.stream.alloc_zeros::<i32>(capacity.max(1))?,
            positions: self.stream.alloc_zeros::<i32>(capacity.max(1))?,
            rows: 0,
            pos0: 0,
            capacity,
            batch: None,
        })
    }

    fn batch_step_input(
        &self,
        capacity: usize,
        max_seqs: usize,
        max_pages: usize,
        page_size: usize,
    ) -> Result<StepInput<CudaSlice<i32>>> {
        let batch = crate::StepBatch::new(
            self.stream.alloc_zeros::<i32>(capacity.max(1))?,
            self.stream
                .alloc_zeros::<i32>((max_seqs * max_pages).max(1))?,
            self.stream.alloc_zeros::<i32>((3 * max_seqs).max(1))?,
            max_seqs,
            max_pages,
            page_size,
        )?;
        let mut step = self.step_input(capacity)?;
        step.batch = Some(batch);
        Ok(step)
    }

    fn set_batch(
        &self,
        step: &mut StepInput<CudaSlice<i32>>,
        seqs: &[crate::SeqRows<'_>],
    ) -> Result<()> {
        let capacity = step.capacity;
        let b = step
            .batch
            .as_mut()
            .context("set_batch: the step input was not made by batch_step_input")?;
        let l = crate::BatchLayout::new(seqs, capacity, b.max_seqs, b.max_pages, b.page_size)?;
        let n = l.tokens.len();
        let s = &self.stream;
        s.memcpy_htod(&l.tokens, &mut step.tokens.slice_mut(..n))?;
        s.memcpy_htod(&l.positions, &mut step.positions.slice_mut(..n))?;
        s.memcpy_htod(&l.row_seq, &mut b.row_seq.slice_mut(..n))?;
        let nb = l.block_tables.len();
        s.memcpy_htod(&l.block_tables, &mut b.block_tables.slice_mut(..nb))?;
        let ns = l.seg_info.len();
        s.memcpy_htod(&l.seg_info, &mut b.seg_info.slice_mut(..ns))?;
        b.segs = l.segs;
        b.max_page = l.max_page;
        step.rows = n;
        step.pos0 = seqs[0].pos0;
        Ok(())
    }

    fn set_step(
        &self,
        step: &mut StepInput<CudaSlice<i32>>,
        tokens: &[u32],
        pos0: usize,
    ) -> Result<()> {
        ensure!(
            tokens.len() <= step.capacity,
            "{} tokens in a step of {}",
            tokens.len(),
            step.capacity
        );
        let ids: Vec<i32> = tokens
            .iter()
            .map(|&t| i32::try_from(t).context("token id does not fit in i32"))
            .collect::<Result<_>>()?;
        let pos: Vec<i32> = (0..tokens.len())
            .map(|i| i32::try_from(pos0 + i).context("position does not fit in i32"))
            .collect::<Result<_>>()?;
        self.stream
            .memcpy_htod(&ids, &mut step.tokens.slice_mut(..ids.len()))?;
        self.stream
            .memcpy_htod(&pos, &mut step.positions.slice_mut(..pos.len()))?;
        step.rows = tokens.len();
        step.pos0 = pos0;
        if let Some(b) = &mut step.batch {
            b.segs.clear();
        }
        Ok(())
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<Act<CudaSlice<f32>>> {
        ensure!(
            data.len() == rows * cols,
            "from_host: {} values for [{rows}, {cols}]",
            data.len()
        );
        let buf = if data.is_empty() {
            self.stream.alloc_zeros::<f32>(1)?
        } else {
            self.stream.clone_htod(data)?
        };
        Ok(Act {
            buf,
            rows,
            cols,
            capacity: rows,
        })
    }

    fn to_host(&self, x: &Act<CudaSlice<f32>>) -> Result<Vec<f32>> {
        let mut out = vec![0f32; x.len()];
        if !out.is_empty() {
            self.stream.memcpy_dtoh(&x.buf.slice(..x.len()), &mut out)?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    fn embed(
        &self,
        table: &CudaWeight,
        step: &StepInput<CudaSlice<i32>>,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        ops::embed(self, table, step, out)
    }

    fn rms_norm(
        &self,
        x: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        eps: f32,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        ops::rms_norm(self, x, w, eps, out, None)
    }

    fn rms_norm_for(
        &self,
        x: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        eps: f32,
        out: &mut Act<CudaSlice<f32>>,
        readers: &[&CudaWeight],
    ) -> Result<()> {
        let form = mmw::x16_readers(self, readers, x.rows);
        ops::rms_norm(self, x, w, eps, out, form)
    }

    fn head_rms_norm(
        &self,
        x: &mut Act<CudaSlice<f32>>,
        w: &CudaWeight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        ops::head_rms_norm(self, x, w, head_dim, eps)
    }

    fn matmul(
        &self,
        x: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        if mmq::matmul(self, x, w, out)? || mmw::matmul(self, x, w, out)? {
            return Ok(());
        }
        matmul::matmul(self, x, w, out)
    }

    fn matmuls(
        &self,
        x: &Act<CudaSlice<f32>>,
        ws: &[&CudaWeight],
        outs: &mut [&mut Act<CudaSlice<f32>>],
    ) -> Result<()> {
        if mmq::matmuls(self, x, ws, outs)? || mmw::matmuls(self, x, ws, outs)? {
            return Ok(());
        }
        matmul::matmuls(self, x, ws, outs)
    }

    fn defers_rms_norm(&self, ws: &[&CudaWeight], rows: usize) -> bool {
        ws.iter().all(|w| matmul::defers(self, w, rows))
    }

    fn matmul_add(
        &self,
        x: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        out: &mut Act<CudaSlice<f32>>,
        y: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        if matmul::matmul_add(self, x, w, out)? || mmw::matmul_add(self, x, w, out, y)? {
            return Ok(());
        }
        self.matmul(x, w, y)?;
        self.add_assign(out, y)
    }

    fn defers_rms_norm_after(
        &self,
        producer: &CudaWeight,
        consumers: &[&CudaWeight],
        rows: usize,
    ) -> bool {
        match consumers {
            [gate, up] => matmul::hands_norm_over(self, producer, gate, up, rows),
            [_, _, _] => matmul::hands_norm_to_qkv(self, producer, consumers, rows),
            _ => false,
        }
    }

    fn matmul_add_for_norm(
        &self,
        x: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        out: &mut Act<CudaSlice<f32>>,
        y: &mut Act<CudaSlice<f32>>,
        norm: (&CudaWeight, f32),
    ) -> Result<()> {
        if matmul::matmul_add_for_norm(self, x, w, out, y, norm.0)? {
            return Ok(());
        }
        self.matmul_add(x, w, out, y)
    }

    fn rms_norm_matmuls(
        &self,
        x: &Act<CudaSlice<f32>>,
        norm: (&CudaWeight, f32),
        ws: &[&CudaWeight],
        outs: &mut [&mut Act<CudaSlice<f32>>],
        h: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        if matmul::rms_norm_matmuls_handed(self, x, norm, ws, outs)?
            || matmul::rms_norm_matmuls(self, x, norm, ws, outs)?
        {
            return Ok(());
        }
        self.rms_norm(x, norm.0, norm.1, h)?;
        self.matmuls(h, ws, outs)
    }

    fn rms_norm_matmul_swiglu(
        &self,
        x: &Act<CudaSlice<f32>>,
        norm: (&CudaWeight, f32),
        gate: &CudaWeight,
        up: &CudaWeight,
        gu: (&mut Act<CudaSlice<f32>>, &mut Act<CudaSlice<f32>>),
        act: &mut Act<CudaSlice<f32>>,
        h: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        if matmul::rms_norm_matmul_swiglu(self, x, norm, gate, up, act)?
            || matmul::rms_norm_matmul_swiglu_handed(self, x, norm, gate, up, act)?
        {
            return Ok(());
        }
        self.rms_norm(x, norm.0, norm.1, h)?;
        self.matmul_swiglu(h, gate, up, gu, act)
    }

    fn matmul_swiglu(
        &self,
        x: &Act<CudaSlice<f32>>,
        gate: &CudaWeight,
        up: &CudaWeight,
        (g, u): (&mut Act<CudaSlice<f32>>, &mut Act<CudaSlice<f32>>),
        act: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        if matmul::matmul_swiglu(self, x, gate, up, act)? {
            return Ok(());
        }
        // Exact prefill (`FERRITE_MMQ=1`, mmq.rs) takes gate and up through the int8 GEMM of
        // the plain calls below, never the bf16 fused launch: decode-exact is its purpose
        // (the Qwen3.5-35B-A3B 32-token gate failed while mmw's SwiGLU took them).
        let exact = mmq::takes(self, gate, x.rows) && mmq::takes(self, up, x.rows);
        if !exact && mmw::matmul_swiglu(self, x, gate, up, act)? {
            return Ok(());
        }
        // Prefill: gate and up in one grouped launch where the kernel groups them.
        self.matmuls(x, &[gate, up], &mut [g, u])?;
        self.swiglu(g, u, act)
    }

    fn swiglu_mlp(
        &self,
        x: &Act<CudaSlice<f32>>,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
        gu: (&mut Act<CudaSlice<f32>>, &mut Act<CudaSlice<f32>>),
        act: &mut Act<CudaSlice<f32>>,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        // A prefill on the TA form (16-bit weights): the gate/up launch writes the down's
        // 16-bit x itself (mmw.rs swiglu_mlp). Exact prefill (mmq.rs) takes quantized weights
        // only, so it never meets this path.
        if mmw::swiglu_mlp(self, x, gate, up, down, act, out, None)? {
            return Ok(());
        }
        self.matmul_swiglu(x, gate, up, gu, act)?;
        self.matmul(act, down, out)
    }

    fn swiglu_mlp_add(
        &self,
        x: &Act<CudaSlice<f32>>,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
        gu: (&mut Act<CudaSlice<f32>>, &mut Act<CudaSlice<f32>>),
        act: &mut Act<CudaSlice<f32>>,
        res: &mut Act<CudaSlice<f32>>,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        if mmw::swiglu_mlp(self, x, gate, up, down, act, out, Some(&mut *res))? {
            return Ok(());
        }
        self.matmul_swiglu(x, gate, up, gu, act)?;
        self.matmul_add(act, down, res, out)
    }

    fn adds_in_epilogue(&self, w: &CudaWeight, rows: usize) -> bool {
        mmw::adds_in_epilogue(self, w, rows)
    }

    fn copy_rows(
        &self,
        x: &Act<CudaSlice<f32>>,
        start: usize,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        crate::check_copy_rows(x, start, out)?;
        let n = out.len();
        let src = x.buf.slice(start * x.cols..start * x.cols + n);
        launch::note_write();
        self.stream.memcpy_dtod(&src, &mut out.buf.slice_mut(..n))?;
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &Act<CudaSlice<f32>>,
        rows: &[usize],
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        crate::check_gather_rows(x, rows, out)?;
        launch::note_write();
        let c = x.cols;
        for (i, &r) in rows.iter().enumerate() {
            let src = x.buf.slice(r * c..(r + 1) * c);
            self.stream
                .memcpy_dtod(&src, &mut out.buf.slice_mut(i * c..(i + 1) * c))?;
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut Act<CudaSlice<f32>>, y: &Act<CudaSlice<f32>>) -> Result<()> {
        ops::add_assign(self, x, y)
    }

    fn swiglu(
        &self,
        gate: &Act<CudaSlice<f32>>,
        up: &Act<CudaSlice<f32>>,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        ops::swiglu(self, gate, up, out)
    }

    fn rope(
        &self,
        x: &mut Act<CudaSlice<f32>>,
        head_dim: usize,
        step: &StepInput<CudaSlice<i32>>,
        rope: &Rope,
    ) -> Result<()> {
        ops::rope(self, x, head_dim, step, rope)
    }

    fn add_rms_norm(
        &self,
        x: &mut Act<CudaSlice<f32>>,
        y: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        eps: f32,
        h: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        ops::add_rms_norm(self, x, y, w, eps, h, None)
    }

    fn add_rms_norm_for(
        &self,
        x: &mut Act<CudaSlice<f32>>,
        y: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        eps: f32,
        h: &mut Act<CudaSlice<f32>>,
        readers: &[&CudaWeight],
    ) -> Result<()> {
        let form = mmw::x16_readers(self, readers, x.rows);
        ops::add_rms_norm(self, x, y, w, eps, h, form)
    }

    fn add_rms_norm_matmul(
        &self,
        x: &mut Act<CudaSlice<f32>>,
        y: &Act<CudaSlice<f32>>,
        x_alt: &mut Act<CudaSlice<f32>>,
        w: &CudaWeight,
        eps: f32,
        h: &mut Act<CudaSlice<f32>>,
        wm: &CudaWeight,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<bool> {
        if ops::add_rms_norm_gemv(self, x, y, x_alt, w, eps, h, wm, out)? {
            return Ok(true);
        }
        self.add_rms_norm(x, y, w, eps, h)?;
        self.matmul(h, wm, out)?;
        Ok(false)
    }

    fn qk_norm_rope(
        &self,
        q: &mut Act<CudaSlice<f32>>,
        k: &mut Act<CudaSlice<f32>>,
        q_norm: Option<&CudaWeight>,
        k_norm: Option<&CudaWeight>,
        head_dim: usize,
        eps: f32,
        step: &StepInput<CudaSlice<i32>>,
        rope: &Rope,
    ) -> Result<()> {
        if q.rows == 1 && switches::diag_skip() & 16 != 0 {
            return Ok(()); // timing diagnostic only (wrong outputs)
        }
        ops::qk_norm_rope(self, q, k, q_norm, k_norm, head_dim, eps, step, rope)
    }

    fn kv_new(
        &self,
        n_layers: usize,
        shape: AttnShape,
        capacity: usize,
    ) -> Result<attention::CudaKv> {
        attention::kv_new(self, n_layers, shape, capacity)
    }

    fn kv_new_q8(
        &self,
        n_layers: usize,
        shape: AttnShape,
        capacity: usize,
    ) -> Result<attention::CudaKv> {
        attention::kv_new_typed(self, n_layers, shape, capacity, attention::KvType::Q8_0)
    }

    fn kv_new_paged(
        &self,
        n_layers: usize,
        shape: AttnShape,
        paged: crate::PagedKv,
    ) -> Result<attention::CudaKv> {
        attention::kv_new_paged(self, n_layers, shape, paged)
    }

    fn kv_new_hybrid(
        &self,
        n_attn_layers: usize,
        shape: AttnShape,
        capacity: usize,
        n_linear_layers: usize,
        delta: crate::DeltaShape,
    ) -> Result<attention::CudaKv> {
        gated_delta::kv_new_hybrid(self, n_attn_layers, shape, capacity, n_linear_layers, delta)
    }

    fn kv_snapshots(&self, kv: &mut attention::CudaKv, n: usize) -> Result<()> {
        gated_delta::kv_snapshots(self, kv, n)
    }

    fn kv_snapshot(&self, kv: &mut attention::CudaKv, slot: usize) -> Result<()> {
        gated_delta::kv_snapshot(self, kv, slot)
    }

    fn kv_row_states(&self, kv: &mut attention::CudaKv, rows: usize) -> Result<bool> {
        gated_delta::kv_row_states(self, kv, rows).map(|()| true)
    }

    fn kv_restore_row(&self, kv: &mut attention::CudaKv, row: usize) -> Result<()> {
        gated_delta::kv_restore_row(self, kv, row)
    }

    fn kv_new_paged_hybrid(
        &self,
        n_attn_layers: usize,
        shape: AttnShape,
        paged: crate::PagedKv,
        n_linear_layers: usize,
        delta: crate::DeltaShape,
        state_slots: usize,
    ) -> Result<attention::CudaKv> {
        gated_delta::kv_new_paged_hybrid(
            self,
            n_attn_layers,
            shape,
            paged,
            n_linear_layers,
            delta,
            state_slots,
        )
    }

    fn kv_clear_state(&self, kv: &mut attention::CudaKv, slot: usize) -> Result<()> {
        gated_delta::kv_clear_state(self, kv, slot)
    }

    fn kv_copy_state(&self, kv: &mut attention::CudaKv, from: usize, to: usize) -> Result<()> {
        gated_delta::kv_copy_state(self, kv, from, to)
    }

    fn kv_restore(&self, kv: &mut attention::CudaKv, slot: usize) -> Result<()> {
        gated_delta::kv_restore(self, kv, slot)
    }

    fn causal_conv1d(
        &self,
        kv: &mut attention::CudaKv,
        layer: usize,
        x: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        out: &mut Act<CudaSlice<f32>>,
        batch: Option<&crate::StepBatch<CudaSlice<i32>>>,
    ) -> Result<()> {
        gated_delta::causal_conv1d(self, kv, layer, x, w, out, batch)
    }

    fn gated_delta_rule(
        &self,
        kv: &mut attention::CudaKv,
        a: crate::DeltaArgs<'_, CudaSlice<f32>, CudaWeight>,
        out: &mut Act<CudaSlice<f32>>,
        batch: Option<&crate::StepBatch<CudaSlice<i32>>>,
    ) -> Result<()> {
        gated_delta::gated_delta_rule(self, kv, a, out, batch)
    }

    fn gated_rms_norm(
        &self,
        x: &mut Act<CudaSlice<f32>>,
        z: &Act<CudaSlice<f32>>,
        w: &CudaWeight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        gated_delta::gated_rms_norm(self, x, z, w, head_dim, eps)
    }

    fn sigmoid_gate(&self, x: &mut Act<CudaSlice<f32>>, gate: &Act<CudaSlice<f32>>) -> Result<()> {
        gated_delta::sigmoid_gate(self, x, gate)
    }

    fn attention(
        &self,
        kv: &mut attention::CudaKv,
        step: &StepInput<CudaSlice<i32>>,
        a: AttnArgs<'_, CudaSlice<f32>>,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        attention::attention(self, kv, step, a, out)
    }

    fn attention_for(
        &self,
        kv: &mut attention::CudaKv,
        step: &StepInput<CudaSlice<i32>>,
        a: AttnArgs<'_, CudaSlice<f32>>,
        out: &mut Act<CudaSlice<f32>>,
        readers: &[&CudaWeight],
    ) -> Result<()> {
        let form = mmw::x16_readers(self, readers, a.q.rows);
        attention::attention_for(self, kv, step, a, out, form)
    }

    fn qk_norm_rope_attention(
        &self,
        kv: &mut attention::CudaKv,
        qk: crate::QkRope<'_, CudaWeight, CudaSlice<i32>>,
        (q, k, v): crate::QkvMut<'_, CudaSlice<f32>>,
        layer: usize,
        shape: AttnShape,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        let args = AttnArgs {
            layer,
            q,
            k,
            v,
            shape,
        };
        if attention::qk_norm_rope_attention(self, kv, args, out, &qk)?
            || attention::qk_norm_rope_attention_stored(
                self,
                kv,
                (&mut *q, &mut *k, v),
                (layer, shape),
                out,
                &qk,
                None,
            )?
        {
            return Ok(());
        }
        crate::qk_norm_rope_then_attention(self, kv, qk, (q, k, v), layer, shape, out, &[])
    }

    fn qk_norm_rope_attention_for(
        &self,
        kv: &mut attention::CudaKv,
        qk: crate::QkRope<'_, CudaWeight, CudaSlice<i32>>,
        (q, k, v): crate::QkvMut<'_, CudaSlice<f32>>,
        layer: usize,
        shape: AttnShape,
        out: &mut Act<CudaSlice<f32>>,
        readers: &[&CudaWeight],
    ) -> Result<()> {
        // Only prefill rows hand the output over (x16_readers is None at decode rows).
        let Some(form) = mmw::x16_readers(self, readers, q.rows) else {
            return self.qk_norm_rope_attention(kv, qk, (q, k, v), layer, shape, out);
        };
        if attention::qk_norm_rope_attention_stored(
            self,
            kv,
            (&mut *q, &mut *k, v),
            (layer, shape),
            out,
            &qk,
            Some(form),
        )? {
            return Ok(());
        }
        crate::qk_norm_rope_then_attention(self, kv, qk, (q, k, v), layer, shape, out, readers)
    }

    fn moe(
        &self,
        x: &Act<CudaSlice<f32>>,
        router_logits: &Act<CudaSlice<f32>>,
        experts: ExpertWeights<'_, CudaWeight>,
        routing: MoeRouting,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        moe::moe(self, x, router_logits, experts, routing, out)
    }

    fn moe_prefetch(
        &self,
        x: &Act<CudaSlice<f32>>,
        norm: (&CudaWeight, f32),
        router: &CudaWeight,
        experts: ExpertWeights<'_, CudaWeight>,
        routing: MoeRouting,
    ) -> Result<()> {
        moe::prefetch(self, x, norm, router, experts, routing)
    }

    fn moe_prefetch_at(&self, point: crate::MixerPoint) -> Result<()> {
        moe::prefetch_at(self, point)
    }

    fn moe_predict_logits(
        &self,
        x: &Act<CudaSlice<f32>>,
        norm: (&CudaWeight, f32),
        router: &CudaWeight,
        h: &mut Act<CudaSlice<f32>>,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        moe::predict_logits(self, x, norm, router, h, out)
    }

    fn moe_shared(
        &self,
        x: &Act<CudaSlice<f32>>,
        router_logits: &Act<CudaSlice<f32>>,
        experts: ExpertWeights<'_, CudaWeight>,
        shared: ExpertWeights<'_, CudaWeight>,
        gate: &CudaWeight,
        routing: MoeRouting,
        out: &mut Act<CudaSlice<f32>>,
    ) -> Result<bool> {
        moe::moe_shared(self, x, router_logits, experts, shared, gate, routing, out)
    }

    fn argmax(&self, logits: &Act<CudaSlice<f32>>, out: &mut CudaSlice<i32>) -> Result<()> {
        ops::argmax(self, logits, out)
    }

    fn argmax_feed(
        &self,
        logits: &Act<CudaSlice<f32>>,
        out: &mut CudaSlice<i32>,
        step: &mut StepInput<CudaSlice<i32>>,
        log: &mut CudaSlice<i32>,
        log_len: usize,
    ) -> Result<()> {
        crate::check_argmax_feed(
            logits,
            log_len,
            log.len(),
            step.tokens.len(),
            step.positions.len(),
        )?;
        let feed = ops::Feed { step, log, log_len };
        ops::argmax_launch(self, logits, out, Some(feed))
    }

    fn top_k(
        &self,
        logits: &Act<CudaSlice<f32>>,
        k: usize,
        ids: &mut CudaSlice<i32>,
        vals: &mut Act<CudaSlice<f32>>,
    ) -> Result<()> {
        ops::top_k(self, logits, k, ids, vals)
    }

    fn read_i32(&self, x: &CudaSlice<i32>, n: usize) -> Result<Vec<i32>> {
        ensure!(n <= x.len(), "read_i32: {n} of {}", x.len());
        let mut out = vec![0i32; n];
        if n > 0 {
            self.stream.memcpy_dtoh(&x.slice(..n), &mut out)?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<CudaGraph>> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let recorded = f();
        // The side stream's launches joined back (moe::prefetch), then the capture ended even
        // when recording failed, so the stream is usable again.
        let joined = self.moe_side.end(&self.stream);
        // The side launches' priority kept where the graph holds them and they carry one
        // (FERRITE_MOE_PREDICT_PRIO); every other graph instantiated as before.
        let forked = matches!(joined, Ok(true));
        let flags = if forked && moe::side_priority().is_some() {
            CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
        } else {
            CUgraphInstantiate_flags(0)
        };
        let graph = self.stream.end_capture(flags);
        recorded?;
        joined?;
        let graph = graph.context("instantiating the captured decode step")?;
        if let Some(g) = &graph {
            g.upload()?;
        }
        Ok(graph)
    }

    fn replay(&self, g: &CudaGraph) -> Result<()> {
        if switches::diag_tl() != 0 {
            return timeline::replay(&self.stream, g);
        }
        g.launch()?;
        Ok(())
    }
}
