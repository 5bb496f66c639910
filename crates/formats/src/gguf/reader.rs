//! The GGUF reader: parse and validate the header, memory-map the tensor data.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::value::{GgufValue, GgufValueType};
use super::{align_up, DEFAULT_ALIGNMENT, GGUF_MAGIC, KEY_ALIGNMENT, KEY_ARCHITECTURE, MAX_DIMS};
use crate::quant::converted::ConvertedType;
use crate::quant::{GgmlType, StoredType};
use crate::tensor::{OwnedTensor, TensorSource, TensorView};
use crate::{FormatError, Result};

/// Arrays may nest (an array of arrays), but no real model nests more than a level or two.
/// The limit keeps a crafted file of nested array headers from overflowing the stack.
const MAX_ARRAY_DEPTH: usize = 16;

/// Up-front capacity for lists whose length comes from the file. Counts are already bounded
/// by the bytes left, but a garbage count should not reserve memory before the read fails;
/// beyond this the vectors grow as elements actually parse.
const MAX_RESERVE: usize = 1 << 16;

/// Smallest possible key/value pair: u64 key length (empty key), u32 type, a 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest possible tensor info: u64 name length (empty), u32 n_dims (0), u32 type, u64 offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// One tensor as described by the header.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// The type ferrite computes with: the stored type, or what `converted_from` becomes.
    pub dtype: GgmlType,
    /// The stored type, where ferrite converts it at load without loss (q5_0, q3_K, iq4_nl:
    /// [`crate::quant::converted`]); `n_bytes` are then the stored bytes, and the tensor is
    /// handed out by [`TensorSource::converted`], not as a view.
    pub converted_from: Option<ConvertedType>,
    /// Row-major (PyTorch order): the GGUF dims reversed, last dimension contiguous.
    pub shape: Vec<usize>,
    /// Offset of the data from the start of the data section (as stored in the file).
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: usize,
}

/// A tensor of a ggml type ferrite neither computes with nor converts (q2_K, iq4_xs, ...):
/// listed (`ferrite info`), bounds-checked like any other, and refused by name where a model
/// needs it ([`TensorSource::require_tensor`]).
#[derive(Clone, Debug, PartialEq)]
pub struct UnloadableTensor {
    pub name: String,
    pub type_id: u32,
    /// ggml's name for the type ("q2_K").
    pub type_name: &'static str,
    /// Row-major.
    pub shape: Vec<usize>,
    pub offset: u64,
    pub n_bytes: usize,
}

impl UnloadableTensor {
    /// Why it does not load: the type, with what ferrite loads and converts.
    pub fn why(&self) -> String {
        unsupported_type(self.type_id)
    }
}

/// `"{name} (ggml type {id}; ferrite loads …, and converts … at load)"`.
fn unsupported_type(type_id: u32) -> String {
    let supported: Vec<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
    let converted: Vec<&str> = ConvertedType::ALL.iter().map(|t| t.name()).collect();
    format!(
        "{} (ggml type {type_id}; ferrite loads {}, and converts {} at load)",
        GgmlType::name_of_id(type_id).unwrap_or("unknown"),
        supported.join(", "),
        converted.join(", ")
    )
}

/// A tensor info as parsed: one ferrite loads, or one it only lists.
enum ParsedTensor {
    Loadable(GgufTensorInfo),
    Unloadable(UnloadableTensor),
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> usize {
        // Checked when the file was opened: the product fits in usize.
        self.shape.iter().product()
    }
}

/// The bytes behind a [`GgufFile`]: a memory map, or a buffer the caller handed over.
enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An open GGUF file: metadata parsed into memory, tensor data borrowed from the map.
pub struct GgufFile {
    path: PathBuf,
    backing: Backing,
    version: u32,
    alignment: usize,
    /// File order, which the writer preserves when a file is rewritten.
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Tensors of types ferrite does not load, in file order.
    unloadable: Vec<UnloadableTensor>,
    /// Absolute file offset of the data section.
    data_offset: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Open and validate a GGUF file. The tensor data is memory-mapped, not read.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io = |err| FormatError::Io {
            path: path.to_path_buf(),
            err,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. If another process truncates or rewrites the file
        // while it is mapped, reads may fault or see changed bytes; every mmap-based model
        // loader (llama.cpp, safetensors) accepts this, and copying 16 GB is not an option.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path.to_path_buf(), Backing::Mmap(map))
    }

    /// Parse a GGUF file held in memory (tests, or files fetched from elsewhere).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(PathBuf::from("<memory>"), Backing::Owned(bytes))
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<GgufFile> {
        let header = parse_header(backing.bytes(), &path)?;
        Ok(GgufFile {
            path,
            backing,
            version: header.version,
            alignment: header.alignment,
            metadata_index: index_of(header.metadata.iter().map(|(k, _)| k)),
            metadata: header.metadata,
            tensor_index: index_of(header.tensors.iter().map(|t| &t.name)),
            tensors: header.tensors,
            unloadable: header.unloadable,
            data_offset: header.data_offset,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }
    /// The alignment of the data section and of every tensor in it.
    pub fn alignment(&self) -> usize {
        self.alignment
    }
    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }
    /// Size of the file in bytes.
    pub fn file_size(&self) -> usize {
        self.backing.bytes().len()
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }
    /// Any integer type whose value fits in u32.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get(key)?.as_u32()
    }
    /// Any integer type whose value fits in u64.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }
    /// Any integer type whose value fits in i64.
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }
    /// f32 or f64.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }
    pub fn get_array(&self, key: &str) -> Option<&[GgufValue]> {
        self.get(key)?.as_array()
    }
    /// An array of strings (`None` if absent or if any element is not a string).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?.as_str_array()
    }
    /// An array of integers that all fit in u32.
    pub fn get_u32_array(&self, key: &str) -> Option<Vec<u32>> {
        self.get(key)?.as_u32_array()
    }
    /// An array of integers that all fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get(key)?.as_i32_array()
    }
    /// An array of f32/f64.
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?.as_f32_array()
    }

    /// `general.architecture` ("llama", "qwen3", ...).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str(KEY_ARCHITECTURE)
    }
    /// The value of `"{architecture}.{suffix}"`, e.g. `arch_get("block_count")`.
    pub fn arch_get(&self, suffix: &str) -> Option<&GgufValue> {
        let arch = self.architecture()?;
        self.get(&format!("{arch}.{suffix}"))
    }
    /// A required key: the error names the key and the file.
    pub fn require(&self, key: &str) -> Result<&GgufValue> {
        self.get(key).ok_or_else(|| {
            FormatError::Other(format!(
                "{}: metadata key '{key}' is missing",
                self.path.display()
            ))
        })
    }

    /// The tensor infos, in file order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    /// The tensors of types ferrite does not load (listed by `ferrite info`), in file order.
    pub fn unloadable_tensors(&self) -> &[UnloadableTensor] {
        &self.unloadable
    }
    pub fn unloadable_tensor(&self, name: &str) -> Option<&UnloadableTensor> {
        self.unloadable.iter().find(|t| t.name == name)
    }
    /// A view of `info`'s stored bytes, as its computed type.
    fn view<'a>(&'a self, info: &'a GgufTensorInfo) -> TensorView<'a> {
        TensorView {
            dtype: info.dtype,
            shape: &info.shape,
            data: self.tensor_data(info),
        }
    }
    /// The bytes of one tensor (borrowed from the map).
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> &[u8] {
        // Bounds were checked at open for every info this file handed out; `get` keeps a
        // foreign info (from another file) from panicking.
        let start = self.data_offset.saturating_add(info.offset as usize);
        let end = start.saturating_add(info.n_bytes);
        self.backing.bytes().get(start..end).unwrap_or(&[])
    }
}

impl TensorSource for GgufFile {
    /// A view of the stored bytes; `None` for a tensor converted at load ([`Self::converted`]).
    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let info = self.tensor_info(name)?;
        info.converted_from.is_none().then(|| self.view(info))
    }
    /// Every tensor, those of types ferrite does not load included.
    fn tensor_names(&self) -> Vec<String> {
        let names = self.tensors.iter().map(|t| t.name.clone());
        names
            .chain(self.unloadable.iter().map(|t| t.name.clone()))
            .collect()
    }
    fn require_tensor(&self, name: &str) -> Result<TensorView<'_>> {
        if let Some(t) = self.unloadable_tensor(name) {
            return Err(FormatError::UnloadableType {
                name: name.to_owned(),
                why: t.why(),
            });
        }
        let info = self
            .tensor_info(name)
            .ok_or_else(|| FormatError::MissingTensor(name.to_owned()))?;
        match info.converted_from {
            None => Ok(self.view(info)),
            Some(from) => Err(FormatError::UnsupportedDtype {
                name: name.to_owned(),
                dtype: format!("{from} (converted to {} at load)", info.dtype),
            }),
        }
    }
    fn has(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name) || self.unloadable_tensor(name).is_some()
    }
    /// A q5_0, q3_K or iq4_nl tensor as q8_0 / q6_K blocks of the same values.
    fn converted(&self, name: &str) -> Option<Result<OwnedTensor>> {
        let info = self.tensor_info(name)?;
        let from = info.converted_from?;
        Some(
            from.convert(self.tensor_data(info))
                .map(|data| OwnedTensor {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    data,
                })
                .map_err(|e| FormatError::BadTensor {
                    name: name.to_owned(),
                    what: e.to_string(),
                }),
        )
    }
}

fn index_of<'a>(names: impl Iterator<Item = &'a String>) -> HashMap<String, usize> {
    names.enumerate().map(|(i, n)| (n.clone(), i)).collect()
}

struct Header {
    version: u32,
    alignment: usize,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensorInfo>,
    unloadable: Vec<UnloadableTensor>,
    data_offset: usize,
}

/// Parse and validate everything before the data section, and every tensor's place in it.
fn parse_header(buf: &[u8], path: &Path) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0, path };
    if buf.len() < 4 {
        return Err(c.corrupt(format!(
            "file is {} bytes, too short for a GGUF header",
            buf.len()
        )));
    }
    let magic: [u8; 4] = c.array("magic")?;
    if magic != GGUF_MAGIC {
        return Err(FormatError::BadMagic {
            path: path.to_path_buf(),
            magic,
        });
    }
    let version = c.u32("version")?;
    // v1 used 32-bit counts and lengths; nothing current writes it. A big-endian file reads
    // as a huge version here and is rejected the same way.
    if version != 2 && version != 3 {
        return Err(FormatError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // Counts are guarded by the bytes left before anything is allocated for them.
    if n_kv > c.remaining() as u64 / MIN_KV_BYTES {
        return Err(c.corrupt(format!("metadata count {n_kv} cannot fit in the file")));
    }
    if n_tensors > c.remaining() as u64 / MIN_TENSOR_INFO_BYTES {
        return Err(c.corrupt(format!("tensor count {n_tensors} cannot fit in the file")));
    }

    let mut metadata: Vec<(String, GgufValue)> =
        Vec::with_capacity((n_kv as usize).min(MAX_RESERVE));
    let mut seen_keys: HashMap<String, ()> =
        HashMap::with_capacity((n_kv as usize).min(MAX_RESERVE));
    for i in 0..n_kv {
        let key = c.strict_string(&format!("metadata key #{i}"))?;
        let ty_id = c.u32("metadata value type")?;
        let ty = GgufValueType::from_id(ty_id).ok_or_else(|| {
            c.corrupt(format!("metadata key '{key}': unknown value type {ty_id}"))
        })?;
        let value = c.value(ty, &key, 0)?;
        if seen_keys.insert(key.clone(), ()).is_some() {
            return Err(c.corrupt(format!("duplicate metadata key '{key}'")));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == KEY_ALIGNMENT) {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_usize() {
            Some(a) if a.is_power_of_two() => a,
            _ => {
                return Err(c.corrupt(format!("{KEY_ALIGNMENT} = {v} is not a power of two")));
            }
        },
    };

    let mut tensors: Vec<GgufTensorInfo> =
        Vec::with_capacity((n_tensors as usize).min(MAX_RESERVE));
    let mut seen_names: HashMap<String, ()> =
        HashMap::with_capacity((n_tensors as usize).min(MAX_RESERVE));
    let mut unloadable: Vec<UnloadableTensor> = Vec::new();
    for i in 0..n_tensors {
        let parsed = c.tensor_info(i)?;
        let name = match &parsed {
            ParsedTensor::Loadable(t) => &t.name,
            ParsedTensor::Unloadable(t) => &t.name,
        };
        if seen_names.insert(name.clone(), ()).is_some() {
            return Err(c.corrupt(format!("duplicate tensor name '{name}'")));
        }
        match parsed {
            ParsedTensor::Loadable(t) => tensors.push(t),
            ParsedTensor::Unloadable(t) => unloadable.push(t),
        }
    }

    // The data section starts at the next aligned offset after the header. A file with no
    // tensors (a vocab-only file) may end before that padding; nothing is read there.
    let data_offset = align_up(c.pos as u64, alignment as u64)
        .ok_or_else(|| c.corrupt("data section offset overflows"))?;
    let places = tensors
        .iter()
        .map(|t| (&t.name, t.offset, t.n_bytes))
        .chain(unloadable.iter().map(|t| (&t.name, t.offset, t.n_bytes)));
    for (name, offset, n_bytes) in places {
        if offset % alignment as u64 != 0 {
            return Err(c.corrupt(format!(
                "tensor '{name}': offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let end = data_offset
            .checked_add(offset)
            .and_then(|s| s.checked_add(n_bytes as u64));
        match end {
            Some(end) if end <= buf.len() as u64 => {}
            _ => {
                return Err(c.corrupt(format!(
                    "tensor '{name}': data at offset {offset} + {n_bytes} bytes runs past the \
                     end of the data section ({} bytes; the file is truncated)",
                    (buf.len() as u64).saturating_sub(data_offset)
                )));
            }
        }
    }
    // Every tensor lies inside `buf`, so `data_offset` fits in usize when there are tensors;
    // without tensors it is only reported, never used to index.
    let data_offset = usize::try_from(data_offset).unwrap_or(usize::MAX);

    Ok(Header {
        version,
        alignment,
        metadata,
        tensors,
        unloadable,
        data_offset,
    })
}

/// A bounds-checked little-endian reader over the file bytes. Every read names what it was
/// reading so that a truncated file says where it ends.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn corrupt(&self, what: impl Into<String>) -> FormatError {
        FormatError::Corrupt {
            path: self.path.to_path_buf(),
            what: what.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.corrupt(format!(
                "file ends at byte {} while reading {what} ({n} bytes needed at byte {})",
                self.buf.len(),
                self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed byte string; the length is checked against the bytes left.
    fn string_bytes(&mut self, what: &str) -> Result<&'a [u8]> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(self.corrupt(format!(
                "{what}: string length {len} exceeds the {} bytes left in the file",
                self.remaining()
            )));
        }
        self.take(len as usize, what)
    }

    /// Keys and tensor names must be valid UTF-8: a name that is not is a corrupt file, and
    /// a lossy replacement could make two names collide.
    fn strict_string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let bytes = self.string_bytes(what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.corrupt(format!("{what} at byte {at} is not valid UTF-8")))
    }

    fn value(&mut self, ty: GgufValueType, key: &str, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(key)?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(key)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(key)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(key)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            GgufValueType::Bool => {
                let [b] = self.array::<1>(key)?;
                match b {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    _ => return Err(self.corrupt(format!("metadata key '{key}': bool byte {b}"))),
                }
            }
            // Text values (vocab entries, chat templates) may hold byte sequences that are
            // not valid UTF-8 in some converted files; keep them readable.
            GgufValueType::String => {
                GgufValue::String(String::from_utf8_lossy(self.string_bytes(key)?).into_owned())
            }
            GgufValueType::Array => {
                let elem_id = self.u32(key)?;
                let elem = GgufValueType::from_id(elem_id).ok_or_else(|| {
                    self.corrupt(format!(
                        "metadata key '{key}': unknown array element type {elem_id}"
                    ))
                })?;
                let count = self.u64(key)?;
                if count > (self.remaining() / elem.min_encoded_size()) as u64 {
                    return Err(self.corrupt(format!(
                        "metadata key '{key}': array count {count} cannot fit in the {} bytes left",
                        self.remaining()
                    )));
                }
                if elem == GgufValueType::Array && depth + 1 >= MAX_ARRAY_DEPTH {
                    return Err(self.corrupt(format!(
                        "metadata key '{key}': arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let mut items = Vec::with_capacity((count as usize).min(MAX_RESERVE));
                for _ in 0..count {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
        })
    }

    fn tensor_info(&mut self, index: u64) -> Result<ParsedTensor> {
        let name = self.strict_string(&format!("tensor name #{index}"))?;
        let n_dims = self.u32("tensor dimension count")?;
        if n_dims as usize > MAX_DIMS {
            return Err(self.corrupt(format!(
                "tensor '{name}': {n_dims} dimensions (ggml supports at most {MAX_DIMS})"
            )));
        }
        // GGUF stores dims innermost first (ggml's ne[0] is the contiguous one).
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = self.u64("tensor dimension")?;
            if d == 0 {
                return Err(self.corrupt(format!("tensor '{name}': a dimension is 0")));
            }
            let d = usize::try_from(d)
                .map_err(|_| self.corrupt(format!("tensor '{name}': dimension {d} too large")))?;
            ne.push(d);
        }
        let type_id = self.u32("tensor type")?;
        // A type ferrite loads, or one ggml has whose blocks are known (listed, not loaded).
        // (ggml's block table agrees with every type ferrite loads: converted.rs's test.)
        let dtype = StoredType::from_id(type_id).ok();
        let (block, type_size) =
            GgmlType::block_of_id(type_id).ok_or_else(|| FormatError::UnsupportedDtype {
                name: name.clone(),
                dtype: unsupported_type(type_id),
            })?;
        let type_name = GgmlType::name_of_id(type_id).unwrap_or("unknown");
        let offset = self.u64("tensor offset")?;

        let n_elements = ne
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| self.corrupt(format!("tensor '{name}': element count overflows")))?;
        let row = ne.first().copied().unwrap_or(1);
        if row % block != 0 {
            return Err(self.corrupt(format!(
                "tensor '{name}': row length {row} is not a multiple of the {type_name} block \
                 size {block}"
            )));
        }
        let n_bytes = (n_elements / block)
            .checked_mul(type_size)
            .ok_or_else(|| self.corrupt(format!("tensor '{name}': byte size overflows")))?;
        ne.reverse();
        Ok(match dtype {
            Some(dtype) => ParsedTensor::Loadable(GgufTensorInfo {
                name,
                dtype: dtype.computed(),
                converted_from: match dtype {
                    StoredType::Computed(_) => None,
                    StoredType::Converted(t) => Some(t),
                },
                shape: ne,
                offset,
                n_bytes,
            }),
            None => ParsedTensor::Unloadable(UnloadableTensor {
                name,
                type_id,
                type_name,
                shape: ne,
                offset,
                n_bytes,
            }),
        })
    }
}
