//! Matmul launchers: decode GEMV for every weight type, prefill matmul on the tensor cores.
//! (Being written; see kernels/gemv.cu and kernels/matmul.cu.)

use std::sync::Arc;

use anyhow::{bail, Result};
use cudarc::driver::{CudaContext, CudaSlice};

/// Kernel source.
pub const SRC: &str = include_str!("kernels/matmul.cu");

use super::{CudaBackend, CudaWeight};
use crate::Act;

/// The compiled matmul kernels.
pub struct Kernels {}

impl Kernels {
    pub fn load(_ctx: &Arc<CudaContext>, _arch: &'static str) -> Result<Self> {
        Ok(Kernels {})
    }
}

/// `out[t] = W x[t]` for a weight `[n_out, n_in]` of any stored type.
pub fn matmul(
    _be: &CudaBackend,
    _x: &Act<CudaSlice<f32>>,
    w: &CudaWeight,
    _out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    bail!("CUDA matmul for {} is not available yet", w.dtype)
}
