//! Mixture-of-experts launchers. (Being written; see kernels/moe.cu.)

use std::sync::Arc;

use anyhow::{bail, Result};
use cudarc::driver::{CudaContext, CudaSlice};

/// Kernel source.
pub const SRC: &str = include_str!("kernels/moe.cu");

use super::{CudaBackend, CudaWeight};
use crate::{Act, ExpertWeights, MoeRouting};

/// The compiled MoE kernels.
pub struct Kernels {}

impl Kernels {
    pub fn load(_ctx: &Arc<CudaContext>, _arch: &'static str) -> Result<Self> {
        Ok(Kernels {})
    }
}

pub fn moe(
    _be: &CudaBackend,
    _x: &Act<CudaSlice<f32>>,
    _router_logits: &Act<CudaSlice<f32>>,
    _experts: ExpertWeights<'_, CudaWeight>,
    _routing: MoeRouting,
    _out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    bail!("CUDA mixture-of-experts is not available yet")
}
