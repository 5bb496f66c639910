use std::path::PathBuf;

/// Everything that can be wrong with a model file. Every variant names the problem so the
/// user can act on it; no reader in this crate panics on bad input.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    // The io error is printed here, not chained as a `source`: a chained report
    // (`{:#}`) would print it twice.
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: not a GGUF file (magic {magic:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, magic: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated or corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("unknown or unsupported tensor type {0}")]
    UnknownType(u32),
    #[error("tensor '{0}' not found")]
    MissingTensor(String),
    #[error("tensor '{name}': {what}")]
    BadTensor { name: String, what: String },
    /// A tensor stored in a type ferrite cannot compute with (a safetensors I64 buffer, an
    /// FP8 weight without a supported path, ...). It is listed, but not handed out as a view.
    #[error("tensor '{name}': unsupported dtype {dtype}")]
    UnsupportedDtype { name: String, dtype: String },
    /// A GGUF tensor of a ggml type ferrite neither computes with nor converts (q2_K, ...):
    /// listed, refused where a model needs it.
    #[error("tensor '{name}': unsupported type {why}")]
    UnloadableType { name: String, why: String },
    #[error("{0}")]
    Other(String),
}

pub type Result<T> = std::result::Result<T, FormatError>;
