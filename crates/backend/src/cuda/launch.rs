//! Kernel launches through `cuLaunchKernelEx`, with programmatic dependent launch (PDL).
//!
//! A decode step is a chain of ~10 small kernels per layer replayed from a CUDA graph. Between
//! two dependent kernels the GPU normally drains the first grid completely before it starts
//! scheduling the second: ~2 µs per kernel in a graph on the H200 (MATMUL.md), most of a
//! 4096-row GEMV's time. With PDL (sm_90+) a kernel launched with
//! `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` may be scheduled while its
//! predecessor still runs; it must then execute `griddepcontrol.wait` (common.cuh's
//! `pdl_wait`) before it touches memory the predecessor reads or writes — the wait returns
//! once the predecessor grid has completed and its writes are visible. Every kernel of
//! ferrite starts with `PDL_ENTRY` (wait, then allow its own dependents to launch), and may
//! issue work that depends on nothing before the wait (GEMV weight prefetches and bulk
//! copies). Without the attribute, or below sm_90, the wait is a no-op and launches
//! serialise as usual. Measured on the H200: Qwen3-8B Q4_K_M decode +5% (MATMUL.md round 3);
//! what remains of the per-kernel floor is each kernel's own dependent latency chain.
//!
//! The same builder shape as cudarc's `launch_builder` (`.arg(&x)...launch(cfg)`), so call
//! sites read the same; event tracking is off on our context (one stream), so arguments are
//! plain device pointers and values. `FERRITE_PDL=0` turns the attribute off (A/B runs).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudarc::driver::sys::{self, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DriverError, LaunchConfig,
};

/// Whether launches carry the PDL attribute (set once per backend from the device).
static PDL: AtomicBool = AtomicBool::new(false);

/// Kernels launched so far (by every backend of the process): lets an op check that nothing
/// ran between a producer and itself (the GEMV input quantized by add_rms_norm, matmul.rs).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many clusters of `dims` blocks of `func` (with `cfg`'s block size and dynamic shared
/// memory) the device can hold resident at once (`cuOccupancyMaxActiveClusters`): a cluster
/// needs its blocks on SMs of one GPC, so large blocks in clusters of four may leave SMs idle
/// that single blocks would fill (mmw.rs sizes its K split's waves by it).
pub fn max_active_clusters(
    func: &CudaFunction,
    cfg: LaunchConfig,
    dims: (u32, u32, u32),
) -> Result<u32, DriverError> {
    let mut attr = cluster_attr(dims);
    let config = driver_config(cfg, std::ptr::null_mut(), std::slice::from_mut(&mut attr));
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `config` and `attr` outlive the call, which only reads them.
    unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, func.cu_function(), &config) }.result()?;
    Ok(n.max(0) as u32)
}

/// The launch attribute grouping a grid's blocks into clusters of `dims`.
fn cluster_attr((x, y, z): (u32, u32, u32)) -> CUlaunchAttribute {
    // SAFETY: a zeroed attribute is a valid value; its id's union member is set.
    let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = x;
    attr.value.clusterDim.y = y;
    attr.value.clusterDim.z = z;
    attr
}

/// The driver's launch configuration for `cfg` on `stream` with `attrs` (none: a null list).
fn driver_config(
    cfg: LaunchConfig,
    stream: sys::CUstream,
    attrs: &mut [CUlaunchAttribute],
) -> CUlaunchConfig {
    CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream,
        attrs: if attrs.is_empty() {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        numAttrs: attrs.len() as u32,
    }
}

/// The number of kernel launches (and other writes into activations, [`note_write`]) issued so
/// far.
pub fn launch_count() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Counts a write into an activation by anything but our kernels (a device-to-device copy, a
/// cuBLASLt GEMM: blas.rs) as a launch: it may overwrite a producer's output just as a kernel
/// could.
pub fn note_write() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

/// Turns PDL on for devices of compute capability 9.0 and above, unless `FERRITE_PDL=0`.
/// Returns whether it is on.
pub fn configure_pdl(major: i32) -> bool {
    let off = super::switches::int_or("FERRITE_PDL", 1) == 0;
    let on = major >= 9 && !off;
    PDL.store(on, Ordering::Relaxed);
    on
}

/// Whether launches use programmatic dependent launch.
pub fn pdl_enabled() -> bool {
    PDL.load(Ordering::Relaxed)
}

/// One kernel argument: a pointer to a value the caller keeps alive, or a device pointer
/// held here.
enum Arg {
    Ref(*const c_void),
    Dev(sys::CUdeviceptr),
}

/// A kernel launch being assembled (see the module comment).
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    args: Vec<Arg>,
    /// Thread-block cluster dimensions (sm_90+), if the launch groups its blocks.
    cluster: Option<(u32, u32, u32)>,
    /// A launch beside the chain ([`Launch::beside`]).
    beside: bool,
    /// Its scheduling priority, if set ([`Launch::priority`]).
    priority: Option<i32>,
}

/// `stream.kernel(&func)`: starts a launch on this stream.
pub trait LaunchExt {
    fn kernel<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a>;
}

impl LaunchExt for CudaStream {
    fn kernel<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a> {
        Launch {
            stream: self,
            func,
            args: Vec::with_capacity(16),
            cluster: None,
            beside: false,
            priority: None,
        }
    }
}

/// Plain values passed by value to a kernel (their bytes are the kernel parameter).
///
/// # Safety
/// The type must have the layout the kernel declares for that parameter.
pub unsafe trait ScalarArg {}
unsafe impl ScalarArg for i32 {}
unsafe impl ScalarArg for u32 {}
unsafe impl ScalarArg for i64 {}
unsafe impl ScalarArg for u64 {}
unsafe impl ScalarArg for f32 {}
// SAFETY: a CUtensorMap is 128 plain bytes, passed by value (a `__grid_constant__` parameter).
unsafe impl ScalarArg for cudarc::driver::sys::CUtensorMap {}

/// Adds one argument to a [`Launch`].
pub trait KernelArg<T> {
    fn arg(&mut self, a: T) -> &mut Self;
}

impl<'a, 'b: 'a, T: ScalarArg> KernelArg<&'b T> for Launch<'a> {
    fn arg(&mut self, a: &'b T) -> &mut Self {
        self.args.push(Arg::Ref(a as *const T as *const c_void));
        self
    }
}

impl<'a, T> KernelArg<&CudaSlice<T>> for Launch<'a> {
    fn arg(&mut self, a: &CudaSlice<T>) -> &mut Self {
        let (p, _sync) = a.device_ptr(self.stream);
        self.args.push(Arg::Dev(p));
        self
    }
}

impl<'a, T> KernelArg<&mut CudaSlice<T>> for Launch<'a> {
    fn arg(&mut self, a: &mut CudaSlice<T>) -> &mut Self {
        let (p, _sync) = a.device_ptr_mut(self.stream);
        self.args.push(Arg::Dev(p));
        self
    }
}

impl<'a, T> KernelArg<&CudaView<'_, T>> for Launch<'a> {
    fn arg(&mut self, a: &CudaView<'_, T>) -> &mut Self {
        let (p, _sync) = a.device_ptr(self.stream);
        self.args.push(Arg::Dev(p));
        self
    }
}

impl<'a, T> KernelArg<&mut CudaViewMut<'_, T>> for Launch<'a> {
    fn arg(&mut self, a: &mut CudaViewMut<'_, T>) -> &mut Self {
        let (p, _sync) = a.device_ptr_mut(self.stream);
        self.args.push(Arg::Dev(p));
        self
    }
}

impl Launch<'_> {
    /// Groups the launch's blocks into clusters of `dims` (sm_90+; each grid dimension a
    /// multiple of the cluster's; more than 8 blocks needs the kernel's non-portable
    /// cluster attribute).
    pub fn cluster(&mut self, dims: (u32, u32, u32)) -> &mut Self {
        self.cluster = Some(dims);
        self
    }

    /// A launch on a stream beside the decode chain that writes no activation (moe.rs
    /// `prefetch`): no PDL attribute (it has no programmatic predecessor; its stream's event
    /// wait orders it) and not counted by [`launch_count`], which tags the chain's hand-overs
    /// (a norm's int8 planes stay its consumer's across it).
    pub fn beside(&mut self) -> &mut Self {
        self.beside = true;
        self
    }

    /// The launch's scheduling priority (`CU_LAUNCH_ATTRIBUTE_PRIORITY`; lower numbers first,
    /// within the context's stream priority range). A captured graph keeps it only where it
    /// is instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY`.
    pub fn priority(&mut self, p: i32) -> &mut Self {
        self.priority = Some(p);
        self
    }

    /// Submits the kernel to the stream (asynchronously).
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and the
    /// kernel must stay inside the buffers it is given. With PDL on, the kernel must call
    /// `pdl_wait` (common.cuh) before it touches memory its predecessors use.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let devs: Vec<sys::CUdeviceptr> = self
            .args
            .iter()
            .map(|a| match a {
                Arg::Dev(p) => *p,
                Arg::Ref(_) => 0,
            })
            .collect();
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .zip(&devs)
            .map(|(a, d)| match a {
                Arg::Ref(p) => *p as *mut c_void,
                Arg::Dev(_) => d as *const sys::CUdeviceptr as *mut c_void,
            })
            .collect();
        // SAFETY: zeroed attributes are valid values; only the first `n_attrs` are passed,
        // each with the union member its id reads set.
        let mut attrs: [CUlaunchAttribute; 3] = std::mem::zeroed();
        let mut n_attrs = 0;
        if pdl_enabled() && !self.beside {
            attrs[n_attrs].id =
                CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
            n_attrs += 1;
        }
        if let Some(dims) = self.cluster {
            attrs[n_attrs] = cluster_attr(dims);
            n_attrs += 1;
        }
        if let Some(p) = self.priority {
            attrs[n_attrs].id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY;
            attrs[n_attrs].value.priority = p;
            n_attrs += 1;
        }
        let config = driver_config(cfg, self.stream.cu_stream(), &mut attrs[..n_attrs]);
        self.stream.context().bind_to_thread()?;
        if !self.beside {
            LAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: `params` points at live values (the borrowed scalars, `devs` here) for the
        // duration of the call, which copies them; the caller vouches for their types.
        sys::cuLaunchKernelEx(
            &config,
            self.func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}
