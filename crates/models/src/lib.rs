//! Model architectures: configuration, tensor names, and the forward pass written against
//! the [`ferrite_backend::Backend`] ops.

pub mod config;
pub mod convert;
pub mod decoder;
pub mod mix;
pub mod mtp;
pub mod qwen3_5;
pub mod source;

pub use config::{Arch, ModelConfig};
pub use decoder::{Logits, Model, Workspace, TOP_K_MAX};
pub use source::ModelFile;
