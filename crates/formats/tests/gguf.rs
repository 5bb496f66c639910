//! GGUF reader/writer: round trips, every kind of corruption, and the real files when present.

use std::path::{Path, PathBuf};

use ferrite_formats::gguf::{GgufFile, GgufValue, GgufWriter, DEFAULT_ALIGNMENT};
use ferrite_formats::{FormatError, GgmlType, TensorSource};
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------------
// helpers

/// A fresh, empty scratch directory (no `tempfile` dependency needed for this).
fn scratch_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir =
        std::env::temp_dir().join(format!("ferrite-formats-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Deterministic non-zero bytes, so a misplaced tensor shows up as a mismatch.
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

struct SampleTensor {
    name: &'static str,
    dtype: GgmlType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn sample_tensors() -> Vec<SampleTensor> {
    let t = |name, dtype: GgmlType, shape: Vec<usize>, seed| {
        let n = dtype.bytes_for(shape.iter().product()).unwrap();
        SampleTensor {
            name,
            dtype,
            shape,
            data: pattern(n, seed),
        }
    };
    vec![
        t("token_embd.weight", GgmlType::Q8_0, vec![3, 64], 1), // 3 rows × 2 blocks × 34 B
        t("blk.0.attn_norm.weight", GgmlType::F32, vec![5], 2), // 20 B: next tensor gets padded
        t("blk.0.ffn_up.weight", GgmlType::Q4_1, vec![2, 32], 3),
        t(
            "blk.0.ffn_gate_exps.weight",
            GgmlType::Q4K,
            vec![2, 1, 3, 256],
            4,
        ), // 4-D (MoE)
        t("output_norm.weight", GgmlType::BF16, vec![16], 5), // 32 B: no trailing padding
    ]
}

fn sample_metadata() -> Vec<(String, GgufValue)> {
    let kv = |k: &str, v: GgufValue| (k.to_owned(), v);
    vec![
        kv("general.architecture", "llama".into()),
        kv("general.name", "tiny ünïcödé 模型".into()),
        kv("llama.block_count", GgufValue::U32(1)),
        kv("t.u8", GgufValue::U8(250)),
        kv("t.i8", GgufValue::I8(-7)),
        kv("t.u16", GgufValue::U16(65000)),
        kv("t.i16", GgufValue::I16(-30000)),
        kv("t.i32", GgufValue::I32(-5)),
        kv("t.u64", GgufValue::U64(1 << 40)),
        kv("t.i64", GgufValue::I64(-(1 << 40))),
        kv("t.f32", GgufValue::F32(1e-5)),
        kv("t.f64", GgufValue::F64(0.1)),
        kv("t.bool", GgufValue::Bool(true)),
        kv("t.empty_str", "".into()),
        kv("t.strs", vec!["a", "", "Ġb c"].into()),
        kv("t.i32s", vec![1i32, -2, 3].into()),
        kv("t.f32s", vec![0.5f32, -1.0].into()),
        kv("t.empty_arr", GgufValue::Array(vec![])),
        kv(
            "t.nested",
            GgufValue::Array(vec![
                vec![1u32, 2].into(),
                vec![3u32].into(),
                GgufValue::Array(vec![]),
            ]),
        ),
        kv(
            "t.nested_strs",
            GgufValue::Array(vec![vec!["x", "y"].into(), vec!["z"].into()]),
        ),
    ]
}

/// Write the sample file into memory.
fn sample_bytes_with(alignment: Option<u32>) -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new());
    for (k, v) in sample_metadata() {
        w.add_kv(k, v).unwrap();
    }
    if let Some(a) = alignment {
        w.add_kv("general.alignment", GgufValue::U32(a)).unwrap();
    }
    let tensors = sample_tensors();
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, &t.shape).unwrap();
    }
    w.write_header().unwrap();
    for t in &tensors {
        w.write_tensor_data(t.name, &t.data).unwrap();
    }
    w.finish().unwrap()
}

fn sample_bytes() -> Vec<u8> {
    sample_bytes_with(None)
}

fn check_sample(f: &GgufFile, alignment: usize) {
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), alignment);
    assert_eq!(f.data_offset() % alignment, 0);
    let mut want = sample_metadata();
    if alignment != DEFAULT_ALIGNMENT {
        want.push(("general.alignment".into(), GgufValue::U32(alignment as u32)));
    }
    assert_eq!(
        f.metadata(),
        &want[..],
        "metadata and its order survive the round trip"
    );
    let tensors = sample_tensors();
    assert_eq!(
        f.tensor_names(),
        tensors
            .iter()
            .map(|t| t.name.to_owned())
            .collect::<Vec<_>>()
    );
    for t in &tensors {
        let info = f.tensor_info(t.name).unwrap();
        assert_eq!(info.offset % alignment as u64, 0);
        assert_eq!(info.n_bytes, t.data.len());
        let v = f.tensor(t.name).unwrap();
        assert_eq!(v.dtype, t.dtype);
        assert_eq!(v.shape, &t.shape[..]);
        assert_eq!(v.data, &t.data[..], "{}", t.name);
    }
    assert!(f.tensor("missing").is_none());
    assert!(matches!(
        f.require_tensor("missing"),
        Err(FormatError::MissingTensor(_))
    ));
}

fn err_of(bytes: Vec<u8>) -> FormatError {
    match GgufFile::from_bytes(bytes) {
        Ok(f) => panic!("expected an error, got {f:?}"),
        Err(e) => e,
    }
}

fn assert_corrupt(bytes: Vec<u8>, needle: &str) {
    match err_of(bytes) {
        FormatError::Corrupt { what, .. } => {
            assert!(
                what.contains(needle),
                "error {what:?} should mention {needle:?}"
            )
        }
        e => panic!("expected Corrupt ({needle}), got {e:?}"),
    }
}

/// Hand-assembles GGUF bytes, so corruptions the writer refuses to produce can be tested.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    /// A key with a u32 value.
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    /// A tensor info: dims innermost first, as the file stores them.
    fn tensor(&mut self, name: &str, ne: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(ne.len() as u32);
        for &d in ne {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pad to 32 and append `n` data bytes.
    fn data(&mut self, n: usize) -> Vec<u8> {
        while !self.0.len().is_multiple_of(32) {
            self.0.push(0);
        }
        self.0.extend(std::iter::repeat_n(7u8, n));
        std::mem::take(&mut self.0)
    }
    fn done(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

// ---------------------------------------------------------------------------------------
// round trips

#[test]
fn round_trip_in_memory() {
    let f = GgufFile::from_bytes(sample_bytes()).unwrap();
    check_sample(&f, DEFAULT_ALIGNMENT);
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(
        f.arch_get("block_count").and_then(GgufValue::as_u32),
        Some(1)
    );
}

#[test]
fn round_trip_custom_alignment() {
    let f = GgufFile::from_bytes(sample_bytes_with(Some(64))).unwrap();
    check_sample(&f, 64);
}

#[test]
fn round_trip_file_streamed_in_chunks() {
    let dir = scratch_dir("gguf-rt");
    let path = dir.join("m.gguf");
    let tensors = sample_tensors();
    let mut w = GgufWriter::create(&path).unwrap();
    for (k, v) in sample_metadata() {
        w.add_kv(k, v).unwrap();
    }
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, &t.shape).unwrap();
    }
    w.write_header().unwrap();
    for t in &tensors {
        w.begin_tensor(t.name).unwrap();
        for chunk in t.data.chunks(7) {
            w.write_tensor_bytes(chunk).unwrap();
        }
        w.end_tensor().unwrap();
    }
    w.finish().unwrap();
    let f = GgufFile::open(&path).unwrap();
    check_sample(&f, DEFAULT_ALIGNMENT);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        sample_bytes(),
        "streamed == whole-tensor writes"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn getters_accept_any_fitting_type() {
    let f = GgufFile::from_bytes(sample_bytes()).unwrap();
    assert_eq!(f.get_u32("t.u8"), Some(250));
    assert_eq!(f.get_u32("t.u16"), Some(65000));
    assert_eq!(f.get_u32("t.i32"), None, "negative does not fit u32");
    assert_eq!(f.get_u32("t.u64"), None, "2^40 does not fit u32");
    assert_eq!(f.get_u64("t.u64"), Some(1 << 40));
    assert_eq!(f.get_i64("t.i64"), Some(-(1 << 40)));
    assert_eq!(f.get_f32("t.f32"), Some(1e-5));
    assert_eq!(f.get_f32("t.f64"), Some(0.1f64 as f32));
    assert_eq!(f.get_f32("t.u8"), None);
    assert_eq!(f.get_bool("t.bool"), Some(true));
    assert_eq!(f.get_str("general.name"), Some("tiny ünïcödé 模型"));
    assert_eq!(f.get_str("t.u8"), None);
    assert_eq!(f.get_str_array("t.strs"), Some(vec!["a", "", "Ġb c"]));
    assert_eq!(f.get_str_array("t.i32s"), None);
    assert_eq!(f.get_i32_array("t.i32s"), Some(vec![1, -2, 3]));
    assert_eq!(f.get_u32_array("t.i32s"), None);
    assert_eq!(f.get_f32_array("t.f32s"), Some(vec![0.5, -1.0]));
    assert_eq!(f.get_array("t.empty_arr").map(<[_]>::len), Some(0));
    let nested = f.get_array("t.nested").unwrap();
    assert_eq!(nested[0].as_u32_array(), Some(vec![1, 2]));
    assert_eq!(f.get("nope"), None);
    assert!(f.require("nope").is_err());
    // Display summarises long arrays instead of printing them whole.
    let long = GgufValue::from((0..1000u32).collect::<Vec<_>>()).to_string();
    assert!(long.contains("1000 items") && long.len() < 100, "{long}");
}

#[test]
fn vocab_only_file_has_no_data_section() {
    let mut w = GgufWriter::new(Vec::new());
    w.add_kv("general.architecture", "qwen2").unwrap();
    let bytes = w.finish().unwrap();
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert!(f.tensor_infos().is_empty());
    assert_eq!(f.architecture(), Some("qwen2"));
}

// ---------------------------------------------------------------------------------------
// writer misuse is an error, not a corrupt file

#[test]
fn writer_rejects_misuse() {
    let mut w = GgufWriter::new(Vec::new());
    w.add_kv("a", GgufValue::U32(1)).unwrap();
    assert!(w.add_kv("a", GgufValue::U32(2)).is_err(), "duplicate key");
    assert!(w
        .add_kv("mixed", GgufValue::Array(vec![1u32.into(), "x".into()]))
        .is_err());
    assert!(w.add_kv("general.alignment", GgufValue::U32(24)).is_err());
    assert!(
        w.add_tensor_info("q", GgmlType::Q4_0, &[4, 31]).is_err(),
        "row not whole blocks"
    );
    assert!(
        w.add_tensor_info("z", GgmlType::F32, &[4, 0]).is_err(),
        "zero dim"
    );
    assert!(
        w.add_tensor_info("d5", GgmlType::F32, &[1, 1, 1, 1, 1])
            .is_err(),
        "5 dims"
    );
    assert!(
        w.add_tensor_info(&"n".repeat(64), GgmlType::F32, &[1])
            .is_err(),
        "long name"
    );
    w.add_tensor_info("x", GgmlType::F32, &[2]).unwrap();
    w.add_tensor_info("y", GgmlType::F32, &[2]).unwrap();
    assert!(
        w.add_tensor_info("x", GgmlType::F32, &[2]).is_err(),
        "duplicate tensor"
    );
    assert!(
        w.write_tensor_data("x", &[0; 8]).is_err(),
        "data before header"
    );
    w.write_header().unwrap();
    assert!(w.add_kv("late", GgufValue::U32(1)).is_err());
    assert!(w.write_tensor_data("y", &[0; 8]).is_err(), "out of order");
    assert!(w.write_tensor_data("x", &[0; 9]).is_err(), "too many bytes");
    let mut w2 = GgufWriter::new(Vec::new());
    w2.add_tensor_info("x", GgmlType::F32, &[2]).unwrap();
    w2.write_header().unwrap();
    w2.begin_tensor("x").unwrap();
    w2.write_tensor_bytes(&[0; 4]).unwrap();
    assert!(w2.end_tensor().is_err(), "too few bytes");
    let mut w3 = GgufWriter::new(Vec::new());
    w3.add_tensor_info("x", GgmlType::F32, &[2]).unwrap();
    w3.write_header().unwrap();
    assert!(
        w3.finish().is_err(),
        "finish before all tensors are written"
    );
}

// ---------------------------------------------------------------------------------------
// corruption

#[test]
fn bad_magic() {
    let mut b = sample_bytes();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(err_of(b), FormatError::BadMagic { magic, .. } if &magic == b"GGML"));
}

#[test]
fn unsupported_versions() {
    for v in [
        0u32,
        1,
        4,
        99,
        0x0300_0000, /* a big-endian v3 read as LE */
    ] {
        let mut b = sample_bytes();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        assert!(
            matches!(err_of(b), FormatError::UnsupportedVersion { version, .. } if version == v),
            "version {v}"
        );
    }
    // v2 has the same layout as v3 for little-endian files.
    let mut b = sample_bytes();
    b[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(GgufFile::from_bytes(b).unwrap().version(), 2);
}

#[test]
fn every_truncation_is_an_error() {
    let full = sample_bytes();
    let f = GgufFile::from_bytes(full.clone()).unwrap();
    let last = f.tensor_infos().last().unwrap();
    let data_end = f.data_offset() + last.offset as usize + last.n_bytes;
    assert_eq!(
        data_end,
        full.len(),
        "the sample ends exactly with its last tensor"
    );
    for cut in 0..full.len() {
        let r = GgufFile::from_bytes(full[..cut].to_vec());
        assert!(r.is_err(), "prefix of {cut} bytes was accepted");
    }
    // The same through the memory-mapped path, including the empty file.
    let dir = scratch_dir("gguf-trunc");
    for cut in [
        0,
        1,
        3,
        4,
        7,
        8,
        23,
        24,
        100,
        full.len() / 2,
        full.len() - 1,
    ] {
        let path = dir.join(format!("cut{cut}.gguf"));
        std::fs::write(&path, &full[..cut]).unwrap();
        let e = GgufFile::open(&path).unwrap_err();
        assert!(
            e.to_string().contains(&format!("cut{cut}.gguf")),
            "error names the file: {e}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn missing_file_is_io_error() {
    let e = GgufFile::open("definitely/not/here.gguf").unwrap_err();
    assert!(matches!(e, FormatError::Io { .. }), "{e:?}");
    // The io error is in the message once, and not chained again as a source (a chained
    // report printed it twice).
    let msg = e.to_string();
    assert!(msg.starts_with("definitely/not/here.gguf: "), "{msg}");
    assert!(std::error::Error::source(&e).is_none(), "{msg}");
}

#[test]
fn huge_string_length() {
    // As a key.
    let mut r = Raw::header(3, 0, 1);
    r.u64(u64::MAX).bytes(&[b'a'; 16]);
    assert_corrupt(r.done(), "string length");
    // As a value.
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(8).u64(1 << 40).bytes(b"abc");
    assert_corrupt(r.done(), "string length");
    // As a tensor name.
    let mut r = Raw::header(3, 1, 0);
    r.u64(1 << 50).bytes(&[0; 40]);
    assert_corrupt(r.done(), "string length");
}

#[test]
fn huge_counts() {
    let mut r = Raw::header(3, 0, u64::MAX);
    r.bytes(&[0; 64]);
    assert_corrupt(r.done(), "metadata count");
    let mut r = Raw::header(3, u64::MAX / 2, 0);
    r.bytes(&[0; 64]);
    assert_corrupt(r.done(), "tensor count");
    // An array claiming 2^62 u8 elements in a tiny file is rejected before any allocation.
    let mut r = Raw::header(3, 0, 1);
    r.str("tokenizer.ggml.tokens")
        .u32(9)
        .u32(0)
        .u64(1 << 62)
        .bytes(&[1, 2, 3]);
    assert_corrupt(r.done(), "array count");
    // Strings need at least 8 bytes each: 10 strings cannot fit in 20 bytes.
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(8).u64(10).bytes(&[0; 20]);
    assert_corrupt(r.done(), "array count");
}

#[test]
fn nested_arrays() {
    // [[1, 2], []] of u16 inside an array of arrays, written by hand.
    let mut r = Raw::header(3, 0, 1);
    r.str("n").u32(9).u32(9).u64(2);
    r.u32(2)
        .u64(2)
        .bytes(&1u16.to_le_bytes())
        .bytes(&2u16.to_le_bytes());
    r.u32(2).u64(0);
    let f = GgufFile::from_bytes(r.done()).unwrap();
    assert_eq!(
        f.get("n"),
        Some(&GgufValue::Array(vec![
            GgufValue::Array(vec![GgufValue::U16(1), GgufValue::U16(2)]),
            GgufValue::Array(vec![])
        ]))
    );
    // Arrays nested thousands deep are refused instead of overflowing the stack.
    let mut r = Raw::header(3, 0, 1);
    r.str("deep").u32(9);
    for _ in 0..10_000 {
        r.u32(9).u64(1);
    }
    r.u32(0).u64(0);
    assert_corrupt(r.done(), "nested");
}

#[test]
fn bad_values() {
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(13).u32(0);
    assert_corrupt(r.done(), "unknown value type 13");
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(77).u64(0);
    assert_corrupt(r.done(), "unknown array element type 77");
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(7).bytes(&[2]);
    assert_corrupt(r.done(), "bool");
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("k", 1).kv_u32("k", 2);
    assert_corrupt(r.done(), "duplicate metadata key 'k'");
    let mut r = Raw::header(3, 0, 1);
    r.u64(2).bytes(&[0xff, 0xfe]).u32(4).u32(1);
    assert_corrupt(r.done(), "not valid UTF-8");
    let mut r = Raw::header(3, 0, 1);
    r.kv_u32("general.alignment", 48);
    assert_corrupt(r.done(), "power of two");
    let mut r = Raw::header(3, 0, 1);
    r.kv_u32("general.alignment", 0);
    assert_corrupt(r.done(), "power of two");
    // Invalid UTF-8 in a string *value* is kept, lossily.
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(8).u64(3).bytes(&[b'a', 0xff, b'b']);
    let f = GgufFile::from_bytes(r.done()).unwrap();
    assert_eq!(f.get_str("k"), Some("a\u{fffd}b"));
}

#[test]
fn bad_tensor_infos() {
    // The reference: one valid f32 tensor of 8 elements.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8], 0, 0);
    let f = GgufFile::from_bytes(r.data(32)).unwrap();
    assert_eq!(f.tensor("t").unwrap().shape, &[8]);

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8], 99, 0);
    match err_of(r.data(32)) {
        FormatError::UnsupportedDtype { name, dtype } => {
            assert_eq!(name, "t");
            assert!(
                dtype.starts_with("unknown (ggml type 99; ferrite loads f32, "),
                "{dtype}"
            );
        }
        e => panic!("{e:?}"),
    }
    // A type ggml has and ferrite does not load: listed and bounds-checked, refused by name
    // (with what ferrite loads and converts) where it is required.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[256], 10, 0);
    let f = GgufFile::from_bytes(r.data(84)).unwrap();
    assert!(f.tensor_info("t").is_none() && f.tensor("t").is_none() && f.has("t"));
    assert_eq!(f.tensor_names(), ["t"]);
    let u = &f.unloadable_tensors()[0];
    assert_eq!(
        (u.type_name, &u.shape[..], u.n_bytes),
        ("q2_K", &[256usize][..], 84)
    );
    let e = f.require_tensor("t").unwrap_err().to_string();
    assert!(
        e.starts_with("tensor 't': unsupported type q2_K (ggml type 10; ")
            && e.ends_with("and converts q5_0, q3_K, iq4_nl at load)"),
        "{e}"
    );
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[256], 10, 0);
    assert_corrupt(r.data(80), "runs past the end");
    // A type converted at load: its stored bytes are bounds-checked like any other's, and a
    // row must hold whole blocks of it.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[256], 11, 0);
    let f = GgufFile::from_bytes(r.data(110)).unwrap();
    let info = f.tensor_info("t").unwrap();
    assert_eq!((info.dtype, info.n_bytes), (GgmlType::Q6K, 110));
    assert!(f.tensor("t").is_none());
    assert_eq!(f.converted("t").unwrap().unwrap().data.len(), 210);
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[256], 11, 0);
    assert_corrupt(r.data(100), "");
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[128], 11, 0);
    assert_corrupt(r.data(110), "not a multiple of the q3_K block size 256");

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[1, 1, 1, 1, 8], 0, 0);
    assert_corrupt(r.data(32), "5 dimensions");

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8, 0], 0, 0);
    assert_corrupt(r.data(32), "dimension is 0");

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[1 << 32, 1 << 32, 1 << 32], 0, 0);
    assert_corrupt(r.data(32), "overflows");

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[u64::MAX / 2, 2], 0, 0);
    assert_corrupt(r.data(32), "overflows");

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8], 0, 4);
    assert_corrupt(r.data(64), "not a multiple of the alignment");

    // Data past the end of the file: by size, and by offset.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[9], 0, 0);
    assert_corrupt(r.data(32), "past the end");
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8], 0, 32);
    assert_corrupt(r.data(32), "past the end");
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8], 0, u64::MAX - 31);
    assert_corrupt(r.data(32), "past the end");

    // A quantized row must be whole blocks.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[48, 2], GgmlType::Q4_0.id(), 0);
    assert_corrupt(r.data(256), "block size");

    let mut r = Raw::header(3, 2, 0);
    r.tensor("t", &[8], 0, 0).tensor("t", &[8], 0, 32);
    assert_corrupt(r.data(64), "duplicate tensor name 't'");

    let mut r = Raw::header(3, 1, 0);
    r.u64(1).bytes(&[0x80]).u32(1).u64(8).u32(0).u64(0);
    assert_corrupt(r.data(32), "not valid UTF-8");
}

/// Random byte flips of a valid file: whatever comes out, nothing panics or reads out of
/// bounds, and whatever opens hands out views inside the file.
#[test]
fn random_corruption_never_panics() {
    let full = sample_bytes();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6767_7566);
    for _ in 0..20_000 {
        let mut b = full.clone();
        for _ in 0..rng.random_range(1..4) {
            let i = rng.random_range(0..b.len());
            b[i] = match rng.random_range(0..3) {
                0 => rng.random(),
                1 => 0xff,
                _ => 0,
            };
        }
        if let Ok(f) = GgufFile::from_bytes(b) {
            // A flipped type id may make a tensor one converted at load or one only listed.
            for name in f.tensor_names() {
                match (f.tensor(&name), f.tensor_info(&name)) {
                    (Some(v), _) => {
                        assert_eq!(v.data.len(), v.dtype.bytes_for(v.n_elements()).unwrap())
                    }
                    (None, Some(info)) => {
                        let t = f.converted(&name).unwrap().unwrap();
                        assert_eq!(
                            t.data.len(),
                            info.dtype.bytes_for(info.n_elements()).unwrap()
                        );
                    }
                    (None, None) => assert!(f.require_tensor(&name).is_err()),
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// real files (when present)

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// SmolLM2-135M-Instruct Q4_1: from `FERRITE_SMOLLM2`, or the shared fixtures next to the
/// workspace. Not committed (98 MB), so the test skips when neither is there.
fn smollm2_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FERRITE_SMOLLM2") {
        return Some(PathBuf::from(p));
    }
    let p = workspace_root().join("../shared/fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.is_file().then_some(p)
}

#[test]
fn real_smollm2() {
    let Some(path) = smollm2_path() else {
        println!("skipped: SmolLM2 GGUF not found (set FERRITE_SMOLLM2)");
        return;
    };
    let f = GgufFile::open(&path).unwrap();
    println!(
        "{f:?}: {} bytes, data at {}",
        f.file_size(),
        f.data_offset()
    );
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.get_u32("llama.block_count"), Some(30));
    assert_eq!(f.get_u32("llama.embedding_length"), Some(576));
    assert_eq!(f.get_u32("llama.attention.head_count"), Some(9));
    assert_eq!(f.get_u32("llama.attention.head_count_kv"), Some(3));
    assert_eq!(f.get_f32("llama.rope.freq_base"), Some(100000.0));
    assert_eq!(f.get_str("tokenizer.ggml.model"), Some("gpt2"));
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(tokens[1], "<|im_start|>");
    // 30 layers × 9 tensors + token_embd + output_norm (the output is tied to token_embd).
    assert_eq!(f.tensor_infos().len(), 30 * 9 + 2);
    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (emb.dtype, emb.shape),
        (GgmlType::Q8_0, &[49152usize, 576][..])
    );
    let down = f.tensor("blk.0.ffn_down.weight").unwrap();
    assert_eq!(
        (down.dtype, down.shape),
        (GgmlType::Q4_1, &[576usize, 1536][..])
    );
    let norm = f.tensor("blk.29.attn_norm.weight").unwrap();
    assert_eq!((norm.dtype, norm.shape), (GgmlType::F32, &[576usize][..]));

    // Rewriting it with the writer reproduces the file byte for byte (same key order,
    // alignment, offsets and padding as llama.cpp's writer).
    let mut w = GgufWriter::new(Vec::with_capacity(f.file_size()));
    for (k, v) in f.metadata() {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    for t in f.tensor_infos() {
        w.add_tensor_info(&t.name, t.dtype, &t.shape).unwrap();
    }
    w.write_header().unwrap();
    for t in f.tensor_infos() {
        w.write_tensor_data(&t.name, f.tensor_data(t)).unwrap();
    }
    let out = w.finish().unwrap();
    assert!(
        out == std::fs::read(&path).unwrap(),
        "rewrite is not byte-identical"
    );
}

#[test]
fn real_vocab_files() {
    for (dir, file, pre) in [("qwen2-gguf", "ggml-vocab-qwen2.gguf", "qwen2")] {
        let path = workspace_root()
            .join("tests/data/tokenizers")
            .join(dir)
            .join(file);
        if !path.is_file() {
            println!("skipped: {file} not found");
            continue;
        }
        let f = GgufFile::open(&path).unwrap();
        println!("{file}: {f:?}");
        assert!(f.tensor_infos().is_empty(), "vocab-only file");
        assert_eq!(f.architecture(), Some("qwen2"));
        assert_eq!(f.get_str("tokenizer.ggml.pre"), Some(pre));
        let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
        assert_eq!(tokens.len(), 151936);
        assert_eq!(
            f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
            tokens.len()
        );
        assert!(f.get_str_array("tokenizer.ggml.merges").unwrap().len() > 150_000);
        assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id"), Some(151643));

        let mut w = GgufWriter::new(Vec::new());
        for (k, v) in f.metadata() {
            w.add_kv(k.clone(), v.clone()).unwrap();
        }
        let out = w.finish().unwrap();
        assert!(
            out == std::fs::read(&path).unwrap(),
            "{file}: rewrite is not byte-identical"
        );
    }
}
