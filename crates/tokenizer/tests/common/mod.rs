//! Shared helpers for the tokenizer tests: test-data paths and llama.cpp's vocab test files.
#![allow(dead_code)]

use std::path::PathBuf;

/// `tests/data/tokenizers` at the workspace root.
pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tokenizers")
}

/// Qwen3's `tokenizer.json` (stored gzipped: 2 MB instead of 11, for the working tree a
/// device call carries) with its `tokenizer_config.json`.
pub fn qwen3_json_tokenizer() -> ferrite_tokenizer::Tokenizer {
    use std::io::Read;
    let dir = data_dir().join("qwen3-json");
    let mut json = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(dir.join("tokenizer.json.gz")).unwrap())
        .read_to_string(&mut json)
        .unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    ferrite_tokenizer::Tokenizer::from_json_str(&json, Some(&config)).unwrap()
}

/// SmolLM2-135M-Instruct (98 MB, not committed): `FERRITE_SMOLLM2`, else the shared fixtures
/// next to the workspace. `None` (and a note on stderr) when absent.
pub fn smollm2_gguf() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("FERRITE_SMOLLM2").map(PathBuf::from),
        Some(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
    ];
    let found = candidates.into_iter().flatten().find(|p| p.is_file());
    if found.is_none() {
        eprintln!("note: SmolLM2 GGUF not found (set FERRITE_SMOLLM2); skipping");
    }
    found
}

/// One llama.cpp tokenizer test case: the text and the expected ids.
pub struct VocabCase {
    pub text: String,
    pub ids: Vec<u32>,
}

/// Reads `<name>.inp` / `<name>.out` as llama.cpp's `tests/test-tokenizer-0.cpp` does:
/// the input is split on "\n__ggml_vocab_test__\n" (the file ends with one, so the last
/// piece is dropped); each output line holds the space-separated ids of one text.
pub fn read_vocab_cases(inp: &std::path::Path) -> Vec<VocabCase> {
    let out = inp.with_extension("out"); // x.gguf.inp -> x.gguf.out
    let raw = std::fs::read_to_string(inp).expect("read .inp");
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts = Vec::new();
    let mut pos = 0;
    while pos < raw.len() {
        match raw[pos..].find(sep) {
            Some(next) => {
                texts.push(raw[pos..pos + next].to_string());
                pos += next + sep.len();
            }
            None => {
                texts.push(raw[pos..].to_string());
                break;
            }
        }
    }
    let outs: Vec<Vec<u32>> = std::fs::read_to_string(&out)
        .expect("read .out")
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse().expect("id"))
                .collect()
        })
        .collect();
    assert_eq!(
        texts.len(),
        outs.len(),
        "{}: inp/out case counts differ",
        inp.display()
    );
    texts
        .into_iter()
        .zip(outs)
        .map(|(text, ids)| VocabCase { text, ids })
        .collect()
}
