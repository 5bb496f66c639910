//! The engine: sequences, sampling and the generation loop.

pub mod generate;
pub mod sampler;
pub mod scheduler;

pub use generate::{gate, Engine, FinishReason, GateResult, GenerateParams, Generation, Sequence};
pub use sampler::{Sampler, SamplerConfig};
