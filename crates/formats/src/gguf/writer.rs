//! The GGUF writer: v3 files, metadata in the order it was added, tensor data streamed.
//!
//! ```ignore
//! let mut w = GgufWriter::create("model.gguf")?;
//! w.add_kv("general.architecture", "llama")?;
//! w.add_tensor_info("token_embd.weight", GgmlType::Q4K, &[vocab, dim])?;
//! w.write_header()?;
//! w.write_tensor_data("token_embd.weight", &bytes)?;   // in declared order
//! w.finish()?;
//! ```
//!
//! Large tensors can be streamed in pieces with `begin_tensor` / `write_tensor_bytes` /
//! `end_tensor`, so a 16 GB model never has to be in memory at once.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::value::{GgufValue, GgufValueType};
use super::{align_up, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, KEY_ALIGNMENT, MAX_DIMS};
use crate::quant::StoredType;
use crate::{FormatError, Result};

/// Big enough that the per-write overhead vanishes next to the disk; writes larger than
/// this bypass the buffer (BufWriter passes them straight through), so tensor data is not
/// copied.
const WRITE_BUFFER_BYTES: usize = 8 << 20;

/// ggml's `GGML_MAX_NAME` is 64 including the terminating NUL; llama.cpp rejects longer names.
const MAX_TENSOR_NAME_BYTES: usize = 63;

struct PendingTensor {
    name: String,
    dtype: StoredType,
    /// Row-major.
    shape: Vec<usize>,
    n_bytes: u64,
}

#[derive(Debug, PartialEq)]
enum State {
    /// Metadata and tensor infos may be added.
    Building,
    /// Header written; `next` is the index of the next tensor to write, `in_tensor` how many
    /// bytes of it have been written if it has been begun.
    Data {
        next: usize,
        in_tensor: Option<u64>,
    },
    Finished,
}

/// Writes a GGUF v3 file. Errors from misuse (a tensor written out of order, a wrong byte
/// count) are reported, not panicked on.
pub struct GgufWriter<W: Write> {
    out: W,
    /// Names the destination in I/O errors.
    path: PathBuf,
    kvs: Vec<(String, GgufValue)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
    alignment: u64,
    state: State,
    /// Bytes written so far (the current file offset).
    pos: u64,
}

impl GgufWriter<BufWriter<File>> {
    /// Create (or truncate) a file for writing.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|err| FormatError::Io {
            path: path.to_path_buf(),
            err,
        })?;
        let mut w = GgufWriter::new(BufWriter::with_capacity(WRITE_BUFFER_BYTES, file));
        w.path = path.to_path_buf();
        Ok(w)
    }
}

impl<W: Write> GgufWriter<W> {
    /// Write to any sink (a `Vec<u8>` in tests).
    pub fn new(out: W) -> Self {
        GgufWriter {
            out,
            path: PathBuf::from("<writer>"),
            kvs: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            alignment: DEFAULT_ALIGNMENT as u64,
            state: State::Building,
            pos: 0,
        }
    }

    fn misuse(&self, what: impl std::fmt::Display) -> FormatError {
        FormatError::Other(format!("GGUF writer ({}): {what}", self.path.display()))
    }

    /// Add one metadata entry. Keys must be unique; array elements must share one type.
    /// `general.alignment` (a power of two) changes the alignment of the data section.
    ///
    /// An empty array is written with element type u8: the value carries no element type
    /// and readers see an empty array either way.
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<GgufValue>) -> Result<()> {
        let key = key.into();
        let value = value.into();
        if self.state != State::Building {
            return Err(self.misuse(format!("metadata '{key}' added after the header")));
        }
        if self.keys.contains(&key) {
            return Err(self.misuse(format!("duplicate metadata key '{key}'")));
        }
        check_homogeneous(&value).map_err(|e| self.misuse(format!("metadata '{key}': {e}")))?;
        if key == KEY_ALIGNMENT {
            match value.as_u64() {
                Some(a) if a.is_power_of_two() && a <= u32::MAX as u64 => self.alignment = a,
                _ => {
                    return Err(
                        self.misuse(format!("{KEY_ALIGNMENT} = {value} is not a power of two"))
                    )
                }
            }
        }
        self.keys.insert(key.clone());
        self.kvs.push((key, value));
        Ok(())
    }

    /// Every metadata key of `f` but its alignment (this writer lays out its own data): a file's
    /// metadata under which to write its tensors again, some of them changed.
    pub fn add_metadata_of(&mut self, f: &super::GgufFile) -> Result<()> {
        for (k, v) in f.metadata() {
            if k != KEY_ALIGNMENT {
                self.add_kv(k.clone(), v.clone())?;
            }
        }
        Ok(())
    }

    /// Declare a tensor. `shape` is row-major (last dimension contiguous); the file stores
    /// it reversed, as ggml does. Data must later be written in declaration order.
    /// `dtype`: a [`crate::GgmlType`], or a type ferrite converts at load
    /// ([`crate::quant::converted::ConvertedType`]).
    pub fn add_tensor_info(
        &mut self,
        name: &str,
        dtype: impl Into<StoredType>,
        shape: &[usize],
    ) -> Result<()> {
        let dtype: StoredType = dtype.into();
        if self.state != State::Building {
            return Err(self.misuse(format!("tensor '{name}' declared after the header")));
        }
        if self.names.contains(name) {
            return Err(self.misuse(format!("duplicate tensor name '{name}'")));
        }
        if name.len() > MAX_TENSOR_NAME_BYTES {
            return Err(self.misuse(format!(
                "tensor name '{name}' is longer than ggml's {MAX_TENSOR_NAME_BYTES} bytes"
            )));
        }
        if shape.is_empty() || shape.len() > MAX_DIMS || shape.contains(&0) {
            return Err(self.misuse(format!(
                "tensor '{name}': shape {shape:?} must have 1..={MAX_DIMS} non-zero dimensions"
            )));
        }
        let n_elements = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| self.misuse(format!("tensor '{name}': element count overflows")))?;
        let row = shape[shape.len() - 1];
        if !row.is_multiple_of(dtype.block_size()) {
            return Err(self.misuse(format!(
                "tensor '{name}': row length {row} is not a multiple of the {dtype} block size {}",
                dtype.block_size()
            )));
        }
        let n_bytes = dtype.bytes_for(n_elements)? as u64;
        self.names.insert(name.to_owned());
        self.tensors.push(PendingTensor {
            name: name.to_owned(),
            dtype,
            shape: shape.to_vec(),
            n_bytes,
        });
        Ok(())
    }

    /// Bytes of tensor data (with the padding between tensors) that will be written, known
    /// once all tensors are declared; lets a caller size a progress bar.
    pub fn planned_data_bytes(&self) -> u64 {
        self.tensors.iter().fold(0u64, |off, t| {
            align_up(off, self.alignment)
                .unwrap_or(u64::MAX)
                .saturating_add(t.n_bytes)
        })
    }

    fn io(&self, err: std::io::Error) -> FormatError {
        FormatError::Io {
            path: self.path.clone(),
            err,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes).map_err(|e| self.io(e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn put_str(&mut self, s: &str) -> Result<()> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }

    /// Zero bytes up to the next multiple of the alignment.
    fn pad(&mut self) -> Result<()> {
        const ZEROS: [u8; 256] = [0; 256];
        let target = align_up(self.pos, self.alignment)
            .ok_or_else(|| self.misuse("file offset overflows"))?;
        while self.pos < target {
            let n = ((target - self.pos) as usize).min(ZEROS.len());
            self.put(&ZEROS[..n])?;
        }
        Ok(())
    }

    fn put_value(&mut self, v: &GgufValue) -> Result<()> {
        match v {
            GgufValue::U8(x) => self.put(&x.to_le_bytes()),
            GgufValue::I8(x) => self.put(&x.to_le_bytes()),
            GgufValue::U16(x) => self.put(&x.to_le_bytes()),
            GgufValue::I16(x) => self.put(&x.to_le_bytes()),
            GgufValue::U32(x) => self.put(&x.to_le_bytes()),
            GgufValue::I32(x) => self.put(&x.to_le_bytes()),
            GgufValue::U64(x) => self.put(&x.to_le_bytes()),
            GgufValue::I64(x) => self.put(&x.to_le_bytes()),
            GgufValue::F32(x) => self.put(&x.to_le_bytes()),
            GgufValue::F64(x) => self.put(&x.to_le_bytes()),
            GgufValue::Bool(x) => self.put(&[*x as u8]),
            GgufValue::String(s) => self.put_str(s),
            GgufValue::Array(items) => {
                let elem = items
                    .first()
                    .map_or(GgufValueType::U8, GgufValue::value_type);
                self.put(&elem.id().to_le_bytes())?;
                self.put(&(items.len() as u64).to_le_bytes())?;
                for item in items {
                    self.put_value(item)?;
                }
                Ok(())
            }
        }
    }

    /// Write the header: metadata, tensor infos with their offsets, padding.
    pub fn write_header(&mut self) -> Result<()> {
        if self.state != State::Building {
            return Err(self.misuse("header written twice"));
        }
        self.put(&GGUF_MAGIC)?;
        self.put(&GGUF_VERSION.to_le_bytes())?;
        self.put(&(self.tensors.len() as u64).to_le_bytes())?;
        self.put(&(self.kvs.len() as u64).to_le_bytes())?;
        let kvs = std::mem::take(&mut self.kvs);
        for (k, v) in &kvs {
            self.put_str(k)?;
            self.put(&v.value_type().id().to_le_bytes())?;
            self.put_value(v)?;
        }
        self.kvs = kvs;
        let tensors = std::mem::take(&mut self.tensors);
        let mut offset = 0u64;
        for t in &tensors {
            offset = align_up(offset, self.alignment)
                .ok_or_else(|| self.misuse("data offset overflows"))?;
            self.put_str(&t.name)?;
            self.put(&(t.shape.len() as u32).to_le_bytes())?;
            for &d in t.shape.iter().rev() {
                self.put(&(d as u64).to_le_bytes())?;
            }
            self.put(&t.dtype.id().to_le_bytes())?;
            self.put(&offset.to_le_bytes())?;
            offset = offset
                .checked_add(t.n_bytes)
                .ok_or_else(|| self.misuse("data offset overflows"))?;
        }
        self.tensors = tensors;
        // Without tensors there is no data section to align; gguf-py writes vocab-only files
        // without the padding, and leaving it out keeps a rewrite of them byte-identical.
        if !self.tensors.is_empty() {
            self.pad()?;
        }
        self.state = State::Data {
            next: 0,
            in_tensor: None,
        };
        Ok(())
    }

    /// Start writing the data of tensor `name`, which must be the next declared one.
    pub fn begin_tensor(&mut self, name: &str) -> Result<()> {
        let State::Data {
            next,
            in_tensor: None,
        } = self.state
        else {
            return Err(self.misuse(format!(
                "begin_tensor('{name}') before write_header, inside another tensor, or after finish"
            )));
        };
        match self.tensors.get(next) {
            Some(t) if t.name == name => {}
            Some(t) => {
                return Err(self.misuse(format!(
                    "tensor '{name}' written out of order: '{}' is next",
                    t.name
                )))
            }
            None => {
                return Err(
                    self.misuse(format!("tensor '{name}': all declared tensors are written"))
                )
            }
        }
        // The data section start and every offset are aligned, so aligning the absolute file
        // position puts the tensor exactly where its header offset says.
        self.pad()?;
        self.state = State::Data {
            next,
            in_tensor: Some(0),
        };
        Ok(())
    }

    /// Append bytes to the tensor begun with [`begin_tensor`](Self::begin_tensor).
    pub fn write_tensor_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        let State::Data {
            next,
            in_tensor: Some(done),
        } = self.state
        else {
            return Err(self.misuse("write_tensor_bytes outside begin_tensor/end_tensor"));
        };
        let t = &self.tensors[next];
        let total = done + bytes.len() as u64;
        if total > t.n_bytes {
            return Err(self.misuse(format!(
                "tensor '{}': {total} bytes written, its {} {:?} holds {}",
                t.name, t.dtype, t.shape, t.n_bytes
            )));
        }
        self.put(bytes)?;
        self.state = State::Data {
            next,
            in_tensor: Some(total),
        };
        Ok(())
    }

    /// Finish the current tensor; its byte count must be exact.
    pub fn end_tensor(&mut self) -> Result<()> {
        let State::Data {
            next,
            in_tensor: Some(done),
        } = self.state
        else {
            return Err(self.misuse("end_tensor without begin_tensor"));
        };
        let t = &self.tensors[next];
        if done != t.n_bytes {
            return Err(self.misuse(format!(
                "tensor '{}': {done} bytes written, its {} {:?} needs {}",
                t.name, t.dtype, t.shape, t.n_bytes
            )));
        }
        // ggml pads after every tensor, the last included, so the file length is aligned.
        self.pad()?;
        self.state = State::Data {
            next: next + 1,
            in_tensor: None,
        };
        Ok(())
    }

    /// Write the whole data of tensor `name` (the next declared one).
    pub fn write_tensor_data(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        self.begin_tensor(name)?;
        self.write_tensor_bytes(bytes)?;
        self.end_tensor()
    }

    /// Check that every declared tensor was written, flush, and hand back the sink.
    pub fn finish(mut self) -> Result<W> {
        match self.state {
            State::Data {
                next,
                in_tensor: None,
            } if next == self.tensors.len() => {}
            State::Building if self.tensors.is_empty() => self.write_header()?,
            _ => {
                let written = match self.state {
                    State::Data { next, .. } => next,
                    _ => 0,
                };
                return Err(self.misuse(format!(
                    "finish after {written} of {} tensors were written",
                    self.tensors.len()
                )));
            }
        }
        self.out.flush().map_err(|e| self.io(e))?;
        self.state = State::Finished;
        Ok(self.out)
    }
}

/// GGUF arrays carry one element type; reject mixed arrays before anything is written.
fn check_homogeneous(v: &GgufValue) -> std::result::Result<(), String> {
    if let GgufValue::Array(items) = v {
        if let Some(first) = items.first() {
            let ty = first.value_type();
            if let Some(bad) = items.iter().find(|i| i.value_type() != ty) {
                return Err(format!(
                    "array mixes element types {:?} and {:?}",
                    ty,
                    bad.value_type()
                ));
            }
        }
        items.iter().try_for_each(check_homogeneous)?;
    }
    Ok(())
}
