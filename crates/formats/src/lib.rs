//! File formats ferrite reads and writes.
//!
//! - [`gguf`]: GGUF v2/v3 reader (memory-mapped) and writer.
//! - [`safetensors_dir`]: Hugging Face checkpoint directories (`config.json` + `*.safetensors`).
//! - [`quant`]: the ggml block types with bit-exact reference (de)quantizers.
//! - [`tensor`]: the format-independent view of one stored tensor that the models consume.

pub mod error;
pub mod gguf;
pub mod quant;
pub mod safetensors_dir;
pub mod tensor;

pub use error::{FormatError, Result};
pub use quant::GgmlType;
pub use tensor::{OwnedTensor, TensorSource, TensorView};
