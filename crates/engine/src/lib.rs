//! The engine: sequences, sampling and the generation loop.

pub mod batch;
pub mod generate;
pub mod json_mode;
pub mod pages;
pub mod sampler;
pub mod scheduler;
pub mod speculative;

pub use batch::{Batch, BatchConfig};
pub use generate::{gate, Engine, FinishReason, GateResult, GenerateParams, Generation, Sequence};
pub use sampler::{Sampler, SamplerConfig};
pub use speculative::{MtpDrafter, SpecStats, Speculator};
