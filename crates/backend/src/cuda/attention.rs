//! KV cache and attention launchers. (Being written; see kernels/attention.cu.)

use std::sync::Arc;

use anyhow::{bail, Result};
use cudarc::driver::{CudaContext, CudaSlice};

/// Kernel source.
pub const SRC: &str = include_str!("kernels/attention.cu");

use super::CudaBackend;
use crate::{Act, AttnArgs, AttnShape, StepInput};

/// Bytes per cached key/value element (f16).
pub const KV_BYTES_PER_ELEMENT: f64 = 2.0;

/// One sequence's KV cache in VRAM.
pub struct CudaKv {}

/// The compiled attention kernels.
pub struct Kernels {}

impl Kernels {
    pub fn load(_ctx: &Arc<CudaContext>, _arch: &'static str) -> Result<Self> {
        Ok(Kernels {})
    }
}

pub fn kv_new(
    _be: &CudaBackend,
    _n_layers: usize,
    _shape: AttnShape,
    _capacity: usize,
) -> Result<CudaKv> {
    bail!("the CUDA KV cache is not available yet")
}

pub fn attention(
    _be: &CudaBackend,
    _kv: &mut CudaKv,
    _step: &StepInput<CudaSlice<i32>>,
    _a: AttnArgs<'_, CudaSlice<f32>>,
    _out: &mut Act<CudaSlice<f32>>,
) -> Result<()> {
    bail!("CUDA attention is not available yet")
}
