//! GGUF: the single-file model format of llama.cpp (versions 2 and 3, little-endian).
//!
//! Layout of a file:
//!
//! ```text
//! "GGUF" u32 version  u64 n_tensors  u64 n_kv
//! n_kv × (string key, u32 type, value)
//! n_tensors × (string name, u32 n_dims, n_dims × u64 dim (innermost first), u32 ggml type,
//!              u64 offset (relative to the data section))
//! zero padding to `general.alignment` (default 32)
//! data section: tensor data, each tensor aligned
//! ```
//!
//! Strings are a u64 byte length followed by UTF-8 bytes (no terminator). Arrays are a u32
//! element type, a u64 count and the elements.
//!
//! [`GgufFile`] memory-maps a file and validates every length, count and offset before it
//! touches the bytes they describe. [`GgufWriter`] writes v3 files, streaming tensor data.

mod reader;
mod value;
mod writer;

pub use reader::{GgufFile, GgufTensorInfo, UnloadableTensor};
pub use value::{GgufValue, GgufValueType};
pub use writer::GgufWriter;

/// "GGUF" as stored at the start of every file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The version [`GgufWriter`] writes.
pub const GGUF_VERSION: u32 = 3;
/// The alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// ggml's `GGML_MAX_DIMS`: no ggml tensor has more dimensions.
pub const MAX_DIMS: usize = 4;
/// The metadata key that overrides the alignment.
pub const KEY_ALIGNMENT: &str = "general.alignment";
/// The metadata key naming the architecture ("llama", "qwen3", ...).
pub const KEY_ARCHITECTURE: &str = "general.architecture";

/// Round `x` up to a multiple of `align` (a power of two); `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    Some(x.checked_add(align - 1)? & !(align - 1))
}
