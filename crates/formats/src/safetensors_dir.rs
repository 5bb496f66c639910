//! Hugging Face checkpoints: a directory with `config.json` and either `model.safetensors`
//! or shards listed by `model.safetensors.index.json`.
//!
//! Each shard is memory-mapped; its header is parsed and validated by the `safetensors`
//! crate (header length, offsets contiguous and inside the file, dtype × shape equal to the
//! byte length). BF16/F16/F32 tensors are handed out as [`TensorView`]s; tensors in other
//! dtypes (I64 position ids, FP8 weights, U8 packed data, ...) stay listed with their
//! safetensors dtype and can be read raw, but [`TensorSource::tensor`] does not return them
//! and [`TensorSource::require_tensor`] names the dtype. The exceptions are the quantized
//! weights of FP8 and NVFP4 checkpoints stored with their scales ([`QuantizedForm`]):
//! [`TensorSource::converted`] returns them as BF16 ([`crate::quant::fp8`],
//! [`crate::quant::fp4`]).

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::quant::GgmlType;
use crate::tensor::{OwnedTensor, TensorSource, TensorView};
use crate::{FormatError, Result};

pub const CONFIG_FILE: &str = "config.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// How a quantized weight of a checkpoint is stored (each converted to BF16 at load).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantizedForm {
    /// E4M3 codes, F32/BF16/F16 `_scale_inv` per `weight_block_size` tile ("fine-grained
    /// FP8": Qwen's and DeepSeek's FP8 releases).
    Fp8Blocks,
    /// E4M3 codes, a `_scale` per tensor or per row (ModelOpt FP8, compressed-tensors FP8).
    Fp8Scaled,
    /// ModelOpt NVFP4: E2M1 codes two a byte, an E4M3 `_scale` per 16 weights, an f32
    /// `_scale_2` per tensor.
    Nvfp4,
}

impl QuantizedForm {
    /// For logs: "NVFP4", "FP8 (E4M3, block scales)", ...
    pub fn name(self) -> &'static str {
        match self {
            QuantizedForm::Fp8Blocks => "FP8 (E4M3, block scales)",
            QuantizedForm::Fp8Scaled => "FP8 (E4M3)",
            QuantizedForm::Nvfp4 => "NVFP4",
        }
    }
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug)]
pub struct SafetensorsTensorInfo {
    pub name: String,
    /// The dtype as stored.
    pub dtype: Dtype,
    /// The ggml type, for the dtypes ferrite computes with directly (BF16, F16, F32).
    pub ggml: Option<GgmlType>,
    /// Row-major, as stored.
    pub shape: Vec<usize>,
    /// Index into [`SafetensorsCheckpoint::shard_paths`].
    pub shard: usize,
    /// Absolute byte range in the shard file (validated at open).
    start: usize,
    end: usize,
}

impl SafetensorsTensorInfo {
    pub fn n_bytes(&self) -> usize {
        self.end - self.start
    }
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// An open checkpoint: config parsed, every shard mapped and its header validated.
pub struct SafetensorsCheckpoint {
    dir: PathBuf,
    config: serde_json::Value,
    shards: Vec<Shard>,
    /// Shard order, then data-offset order within a shard (the order the bytes lie in).
    tensors: Vec<SafetensorsTensorInfo>,
    index: HashMap<String, usize>,
    /// `quantization_config.weight_block_size` of an FP8 checkpoint (rows, columns of a
    /// scale's tile), when config.json gives one.
    fp8_block: Option<[usize; 2]>,
}

impl std::fmt::Debug for SafetensorsCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsCheckpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FormatError + '_ {
    move |err| FormatError::Io {
        path: path.to_path_buf(),
        err,
    }
}

fn corrupt(path: &Path, what: impl Into<String>) -> FormatError {
    FormatError::Corrupt {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read(path).map_err(io_err(path))?;
    serde_json::from_slice(&text).map_err(|e| corrupt(path, format!("invalid JSON: {e}")))
}

fn ggml_type_of(dtype: Dtype) -> Option<GgmlType> {
    match dtype {
        Dtype::F32 => Some(GgmlType::F32),
        Dtype::F16 => Some(GgmlType::F16),
        Dtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}

impl SafetensorsCheckpoint {
    /// Open a checkpoint directory, or one `.safetensors` file or index file inside one.
    ///
    /// A directory must hold `config.json`. When a file is given, `config.json` next to it is
    /// read if present (otherwise `config()` is `Null`).
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsCheckpoint> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(io_err(path))?;
        let (dir, weights, config_required) = if meta.is_dir() {
            let index = path.join(INDEX_FILE);
            let single = path.join(SINGLE_FILE);
            let weights = if index.is_file() {
                index
            } else if single.is_file() {
                single
            } else {
                return Err(FormatError::Other(format!(
                    "{}: no {SINGLE_FILE} or {INDEX_FILE} in this directory",
                    path.display()
                )));
            };
            (path.to_path_buf(), weights, true)
        } else {
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            (dir, path.to_path_buf(), false)
        };

        let config_path = dir.join(CONFIG_FILE);
        let config = if config_path.is_file() {
            read_json(&config_path)?
        } else if config_required {
            return Err(FormatError::Other(format!(
                "{}: no {CONFIG_FILE} in the checkpoint directory",
                dir.display()
            )));
        } else {
            serde_json::Value::Null
        };

        let is_index = weights
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".json"));
        let (shard_names, weight_map) = if is_index {
            let (names, map) = read_index(&weights)?;
            (names, Some(map))
        } else {
            (vec![weights.clone()], None)
        };

        let fp8_block = fp8_block_of(&config).map_err(|what| corrupt(&config_path, what))?;
        let mut ckpt = SafetensorsCheckpoint {
            dir,
            fp8_block,
            config,
            shards: Vec::with_capacity(shard_names.len()),
            tensors: Vec::new(),
            index: HashMap::new(),
        };
        for shard_path in shard_names {
            ckpt.add_shard(shard_path)?;
        }
        if let (Some(map), Some(index_path)) = (weight_map, is_index.then_some(&weights)) {
            ckpt.check_weight_map(&map, index_path)?;
        }
        Ok(ckpt)
    }

    fn add_shard(&mut self, path: PathBuf) -> Result<()> {
        let file = File::open(&path).map_err(io_err(&path))?;
        // SAFETY: read-only map; see GgufFile::open for why mapping is accepted.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(&path))?;
        // `read_metadata` checks the header length against the file, that the tensors tile
        // the data section exactly, and dtype × shape == bytes for each (with overflow
        // checks). A truncated file fails the "data section ends at the file end" check.
        let (header_len, metadata) = SafeTensors::read_metadata(&map)
            .map_err(|e| corrupt(&path, format!("invalid safetensors: {e}")))?;
        let data_start = 8usize
            .checked_add(header_len)
            .ok_or_else(|| corrupt(&path, "header length overflows"))?;
        let shard = self.shards.len();
        for name in metadata.offset_keys() {
            let Some(info) = metadata.info(&name) else {
                continue;
            };
            let (s, e) = info.data_offsets;
            let (Some(start), Some(end)) = (data_start.checked_add(s), data_start.checked_add(e))
            else {
                return Err(corrupt(&path, format!("tensor '{name}': offsets overflow")));
            };
            // Already guaranteed by read_metadata; checked again because slicing relies on it.
            if start > end || end > map.len() {
                return Err(corrupt(
                    &path,
                    format!("tensor '{name}': data outside the file"),
                ));
            }
            if let Some(&prev) = self.index.get(&name) {
                let other = &self.shards[self.tensors[prev].shard].path;
                return Err(corrupt(
                    &path,
                    format!("tensor '{name}' is also stored in {}", other.display()),
                ));
            }
            self.index.insert(name.clone(), self.tensors.len());
            self.tensors.push(SafetensorsTensorInfo {
                name,
                dtype: info.dtype,
                ggml: ggml_type_of(info.dtype),
                shape: info.shape.clone(),
                shard,
                start,
                end,
            });
        }
        self.shards.push(Shard { path, map });
        Ok(())
    }

    /// Every tensor the index names must be in the shard it names.
    fn check_weight_map(&self, map: &[(String, PathBuf)], index_path: &Path) -> Result<()> {
        for (name, file) in map {
            let found = self
                .index
                .get(name)
                .map(|&i| &self.shards[self.tensors[i].shard].path);
            if found != Some(file) {
                return Err(corrupt(
                    index_path,
                    format!(
                        "weight_map puts '{name}' in {}, but it is not there",
                        file.display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The parsed `config.json` (`Null` when a lone file without one was opened).
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }
    /// `architectures[0]` of the config (e.g. "Qwen3ForCausalLM"), else its `model_type`.
    pub fn architecture(&self) -> Option<&str> {
        self.config
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .or_else(|| self.config.get("model_type").and_then(|m| m.as_str()))
    }
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }
    /// All tensors, supported dtype or not.
    pub fn tensor_infos(&self) -> &[SafetensorsTensorInfo] {
        &self.tensors
    }
    pub fn tensor_info(&self, name: &str) -> Option<&SafetensorsTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }
    /// The quantized form tensor `name` is stored in, if it is a weight that
    /// [`TensorSource::converted`] hands out as BF16: an FP8 (E4M3) weight with `_scale_inv`
    /// block scales or a `_scale` (one a tensor or a row), or an NVFP4 weight (packed bytes
    /// with E4M3 `_scale` and an f32 `_scale_2`, ModelOpt's layout).
    pub fn quantized_form(&self, name: &str) -> Option<QuantizedForm> {
        let info = self.tensor_info(name)?;
        let dtype = |suffix: &str| {
            self.tensor_info(&format!("{name}{suffix}"))
                .map(|t| t.dtype)
        };
        match info.dtype {
            Dtype::F8_E4M3 if dtype("_scale_inv").is_some() => Some(QuantizedForm::Fp8Blocks),
            Dtype::F8_E4M3 if dtype("_scale").is_some() => Some(QuantizedForm::Fp8Scaled),
            Dtype::U8 if dtype("_scale") == Some(Dtype::F8_E4M3) && dtype("_scale_2").is_some() => {
                Some(QuantizedForm::Nvfp4)
            }
            _ => None,
        }
    }
    /// Elements of weight `name` once converted (`None` unless [`Self::quantized_form`]):
    /// NVFP4 packs two a byte.
    pub fn converted_elements(&self, name: &str) -> Option<usize> {
        let form = self.quantized_form(name)?;
        let n: usize = self.tensor_info(name)?.shape.iter().product();
        Some(if form == QuantizedForm::Nvfp4 {
            2 * n
        } else {
            n
        })
    }
    /// The stored bytes of any tensor, whatever its dtype (FP8 weights, I64 buffers, ...).
    pub fn raw_tensor(&self, name: &str) -> Option<(&SafetensorsTensorInfo, &[u8])> {
        let info = self.tensor_info(name)?;
        let bytes = self.shards[info.shard].map.get(info.start..info.end)?;
        Some((info, bytes))
    }
}

/// The FP8 scale tile of config.json's `quantization_config` (`weight_block_size`, two
/// positive integers), if it names one. Other quantization methods are not this reader's to
/// refuse (the model loader names them); a malformed block size is an error.
fn fp8_block_of(config: &serde_json::Value) -> std::result::Result<Option<[usize; 2]>, String> {
    let Some(b) = config
        .get("quantization_config")
        .and_then(|q| q.get("weight_block_size"))
        .filter(|b| !b.is_null())
    else {
        return Ok(None);
    };
    let dims: Option<Vec<usize>> = b.as_array().map(|a| {
        a.iter()
            .filter_map(|v| v.as_u64().and_then(|v| usize::try_from(v).ok()))
            .filter(|&v| v > 0)
            .collect()
    });
    match dims.as_deref() {
        Some(&[r, c]) if b.as_array().is_some_and(|a| a.len() == 2) => Ok(Some([r, c])),
        _ => Err(format!(
            "quantization_config.weight_block_size is {b}, expected two positive integers"
        )),
    }
}

/// A quantized weight's scales as f32 (FP8 scales, NVFP4's global scale: stored as F32, BF16
/// or F16).
fn scales_f32(name: &str, info: &SafetensorsTensorInfo, bytes: &[u8]) -> Result<Vec<f32>> {
    let v = match info.dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        d => {
            return Err(FormatError::BadTensor {
                name: name.to_owned(),
                what: format!("scales stored as {d} (expected F32, BF16 or F16)"),
            })
        }
    };
    Ok(v)
}

/// The tile of an FP8 weight's `_scale_inv` block scales: config.json's
/// `weight_block_size`, or, where it gives none, the whole matrix when there is one scale a
/// matrix (any other grid would be a guess).
fn fp8_tile(
    name: &str,
    shape: &[usize],
    scale_shape: &[usize],
    configured: Option<[usize; 2]>,
) -> Result<[usize; 2]> {
    let n = shape.len();
    let lead = |s: &[usize]| s[..s.len().saturating_sub(2)].iter().product::<usize>();
    match configured {
        Some(b) => Ok(b),
        None if n >= 2 && scale_shape.iter().product::<usize>() == lead(scale_shape) => {
            Ok([shape[n - 2], shape[n - 1]])
        }
        None => Err(FormatError::BadTensor {
            name: name.to_owned(),
            what: format!(
                "FP8 weight with block scales of shape {scale_shape:?}, but config.json's \
                 quantization_config gives no weight_block_size"
            ),
        }),
    }
}

/// The tile and the tile grid of an FP8 weight of a 2-D `shape` whose `_scale` is one a
/// tensor or one a row, in any of the shapes writers use ([], [1], [rows], [rows, 1]).
fn scale_per_tensor_or_row(
    name: &str,
    shape: &[usize],
    scale_shape: &[usize],
) -> Result<([usize; 2], Vec<usize>)> {
    let count: usize = scale_shape.iter().product();
    match *shape {
        [rows, cols] if count == 1 => Ok(([rows, cols], vec![1, 1])),
        [rows, cols] if count == rows => Ok(([1, cols], vec![rows, 1])),
        _ => Err(FormatError::BadTensor {
            name: name.to_owned(),
            what: format!(
                "FP8 weight of shape {shape:?}: its scales of shape {scale_shape:?} are neither \
                 one a tensor nor one a row"
            ),
        }),
    }
}

/// (tensor name, shard path) pairs of an index's `weight_map`.
type WeightMap = Vec<(String, PathBuf)>;

/// Read `weight_map` from an index file: (tensor name, shard path) pairs and the distinct
/// shard paths in sorted order (shards are named `model-00001-of-00004.safetensors`, ...).
fn read_index(index_path: &Path) -> Result<(Vec<PathBuf>, WeightMap)> {
    let json = read_json(index_path)?;
    let dir = index_path.parent().unwrap_or(Path::new(""));
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| corrupt(index_path, "no \"weight_map\" object"))?;
    let mut pairs = Vec::with_capacity(map.len());
    let mut shards = BTreeSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| corrupt(index_path, format!("weight_map['{name}'] is not a string")))?;
        // Shards live next to the index: a path that leaves the directory is not a shard.
        let mut comps = Path::new(file).components();
        if !matches!(
            (comps.next(), comps.next()),
            (Some(Component::Normal(_)), None)
        ) {
            return Err(corrupt(
                index_path,
                format!("weight_map['{name}'] = {file:?} is not a file name"),
            ));
        }
        let path = dir.join(file);
        shards.insert(path.clone());
        pairs.push((name.clone(), path));
    }
    if pairs.is_empty() {
        return Err(corrupt(index_path, "weight_map is empty"));
    }
    Ok((shards.into_iter().collect(), pairs))
}

impl TensorSource for SafetensorsCheckpoint {
    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let (info, data) = self.raw_tensor(name)?;
        Some(TensorView {
            dtype: info.ggml?,
            shape: &info.shape,
            data,
        })
    }
    fn tensor_names(&self) -> Vec<String> {
        self.tensors.iter().map(|t| t.name.clone()).collect()
    }
    fn require_tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| FormatError::MissingTensor(name.to_owned()))?;
        match self.tensor(name) {
            Some(view) => Ok(view),
            None => Err(FormatError::UnsupportedDtype {
                name: name.to_owned(),
                dtype: info.dtype.to_string(),
            }),
        }
    }
    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
    fn converted(&self, name: &str) -> Option<Result<OwnedTensor>> {
        let form = self.quantized_form(name)?;
        let (info, codes) = self.raw_tensor(name)?;
        // `quantized_form` found the companions; an error rather than a panic all the same.
        let companion = |n: &str| {
            self.raw_tensor(n)
                .ok_or_else(|| FormatError::MissingTensor(n.to_owned()))
        };
        let convert = || -> Result<OwnedTensor> {
            let (data, shape) = match form {
                QuantizedForm::Fp8Blocks | QuantizedForm::Fp8Scaled => {
                    let blocks = form == QuantizedForm::Fp8Blocks;
                    let scale_name =
                        format!("{name}{}", if blocks { "_scale_inv" } else { "_scale" });
                    let (sinfo, sbytes) = companion(&scale_name)?;
                    let scales = scales_f32(&scale_name, sinfo, sbytes)?;
                    let (block, grid) = if blocks {
                        let tile = fp8_tile(name, &info.shape, &sinfo.shape, self.fp8_block)?;
                        (tile, sinfo.shape.clone())
                    } else {
                        scale_per_tensor_or_row(name, &info.shape, &sinfo.shape)?
                    };
                    let data = crate::quant::fp8::dequantize_block_scaled_bf16(
                        name,
                        codes,
                        &info.shape,
                        &scales,
                        &grid,
                        block,
                    )?;
                    (data, info.shape.clone())
                }
                QuantizedForm::Nvfp4 => {
                    let (sinfo, sbytes) = companion(&format!("{name}_scale"))?;
                    let g_name = format!("{name}_scale_2");
                    let (ginfo, gbytes) = companion(&g_name)?;
                    let [global] = scales_f32(&g_name, ginfo, gbytes)?[..] else {
                        return Err(FormatError::BadTensor {
                            name: g_name,
                            what: format!(
                                "NVFP4 global scale of shape {:?}, expected one value",
                                ginfo.shape
                            ),
                        });
                    };
                    crate::quant::fp4::nvfp4_to_bf16(
                        name,
                        codes,
                        &info.shape,
                        sbytes,
                        &sinfo.shape,
                        global,
                    )?
                }
            };
            Ok(OwnedTensor {
                dtype: GgmlType::BF16,
                shape,
                data,
            })
        };
        Some(convert())
    }
}
