//! The engine: sequences, sampling and the generation loop.

pub mod generate;
pub mod sampler;

pub use generate::{Engine, FinishReason, GateResult, GenerateParams, Generation};
pub use sampler::{Sampler, SamplerConfig};
