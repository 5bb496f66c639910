//! llama.cpp's tokenizer test vectors (`ggml-vocab-*.gguf.inp/.out`, from llama.cpp's
//! `models/`), encoded without special tokens added and without parsing special-token text,
//! exactly as `tests/test-tokenizer-0.cpp` does. Also: the Qwen3 tokenizer.json against the
//! same vectors, decoding round trips, and streaming decoding.

mod common;

use common::{data_dir, qwen3_json_tokenizer, read_vocab_cases, VocabCase};
use ferrite_formats::gguf::{GgufFile, GgufValue};
use ferrite_tokenizer::{IncrementalDecoder, Tokenizer};

fn gguf_tokenizer(dir: &str, name: &str) -> (Tokenizer, Vec<VocabCase>) {
    let path = data_dir().join(dir).join(name);
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tok = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cases = read_vocab_cases(&path.with_extension("gguf.inp"));
    (tok, cases)
}

/// The Qwen3.5 vocabulary: Qwen2's (the same tokens, merges and types) with llama.cpp's
/// `qwen35` pre-tokenizer, built from qwen2-gguf's file with `tokenizer.ggml.pre` replaced (the
/// repository keeps only the one 6 MB file), and the qwen35 vectors.
fn qwen35_tokenizer() -> (Tokenizer, Vec<VocabCase>) {
    let path = data_dir().join("qwen2-gguf/ggml-vocab-qwen2.gguf");
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let pre = GgufValue::String("qwen35".into());
    let get = |key: &str| match key {
        "tokenizer.ggml.pre" => Some(&pre),
        _ => file.get(key),
    };
    let tok = ferrite_tokenizer::gguf::from_metadata(&get).unwrap();
    let cases = read_vocab_cases(&data_dir().join("qwen35-gguf/ggml-vocab-qwen35.gguf.inp"));
    (tok, cases)
}

/// A vocabulary's vectors: there are some, every one encodes to llama.cpp's ids, and the ids
/// decode back to the text ([`check_cases`], [`check_round_trip`]).
fn check_vectors(label: &str, tok: &Tokenizer, cases: &[VocabCase]) {
    assert!(!cases.is_empty(), "{label}: no cases");
    check_cases(label, tok, cases);
    check_round_trip(label, tok, cases);
}

/// Encodes every case and reports all mismatches at once.
fn check_cases(label: &str, tok: &Tokenizer, cases: &[VocabCase]) {
    let mut failures = Vec::new();
    for c in cases {
        let got = tok.encode(&c.text, false, false).unwrap();
        if got != c.ids {
            failures.push(format!(
                "{:?}\n   expected {:?}\n   got      {:?}",
                c.text, c.ids, got
            ));
        }
    }
    eprintln!(
        "{label}: {}/{} cases match",
        cases.len() - failures.len(),
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{label}: {} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Decoding the expected ids must give the text back (byte-level BPE is lossless).
fn check_round_trip(label: &str, tok: &Tokenizer, cases: &[VocabCase]) {
    for c in cases {
        assert_eq!(
            tok.decode(&c.ids, false).unwrap(),
            c.text,
            "{label}: decode"
        );
        let mut dec = IncrementalDecoder::new(false);
        let mut streamed = String::new();
        for &id in &c.ids {
            let delta = dec.push(tok, id);
            // Every delta is a whole string: no replacement characters from split sequences.
            assert!(
                !delta.contains('\u{fffd}') || c.text.contains('\u{fffd}'),
                "{label}: {delta:?}"
            );
            streamed.push_str(&delta);
        }
        streamed.push_str(&dec.flush());
        assert_eq!(streamed, c.text, "{label}: streamed decode");
    }
}

#[test]
fn qwen2_gguf_vectors() {
    let (tok, cases) = gguf_tokenizer("qwen2-gguf", "ggml-vocab-qwen2.gguf");
    check_vectors("qwen2", &tok, &cases);
}

#[test]
fn qwen35_gguf_vectors() {
    let (tok, cases) = qwen35_tokenizer();
    check_vectors("qwen35", &tok, &cases);
}

/// Llama 3's byte-level BPE (`llama-bpe`: its regex and `ignore_merges`).
#[test]
fn llama_bpe_gguf_vectors() {
    let (tok, cases) = gguf_tokenizer("llama-bpe-gguf", "ggml-vocab-llama-bpe.gguf");
    check_vectors("llama-bpe", &tok, &cases);
}

/// Llama 2's SentencePiece BPE (`tokenizer.ggml.model = "llama"`): scores, byte fallback and
/// the space prefix, against llama.cpp's vectors.
#[test]
fn llama_spm_gguf_vectors() {
    let (tok, cases) = gguf_tokenizer("llama-spm-gguf", "ggml-vocab-llama-spm.gguf");
    check_vectors("llama-spm", &tok, &cases);
}

/// The SentencePiece vocabulary's BOS (added by default), its control tokens (split out only
/// when parsing special text, with llama.cpp's space before the text after them) and decoding.
#[test]
fn llama_spm_special_tokens() {
    let (tok, _) = gguf_tokenizer("llama-spm-gguf", "ggml-vocab-llama-spm.gguf");
    let (bos, eos) = (tok.bos_id().unwrap(), tok.eos_id().unwrap());
    assert_eq!((bos, eos), (1, 2));
    assert!(tok.is_special(bos) && tok.is_special(eos));
    let hello = tok.encode("Hello", false, false).unwrap();
    assert_eq!(
        tok.encode("Hello", true, false).unwrap(),
        [&[bos], &hello[..]].concat()
    );
    // "</s>" parsed: the token, then " Hello" with the space the text after a special gets.
    let parsed = tok.encode("</s>Hello", false, true).unwrap();
    assert_eq!(parsed, [&[eos], &hello[..]].concat());
    // Not parsed: the characters themselves, never the control token.
    let plain = tok.encode("</s>Hello", false, false).unwrap();
    assert!(
        !plain.contains(&eos) && plain.len() > parsed.len(),
        "{plain:?}"
    );
    assert_eq!(tok.decode(&plain, false).unwrap(), "</s>Hello");
    // A character outside the vocabulary falls back to its UTF-8 bytes' tokens.
    let snowman = tok.encode("\u{2603}", false, false).unwrap();
    let pieces: Vec<&[u8]> = snowman.iter().map(|&id| tok.token_bytes(id)).collect();
    assert_eq!(pieces.concat(), " \u{2603}".as_bytes(), "{snowman:?}");
    assert_eq!(
        snowman.len(),
        4,
        "the space, then one token a byte: {snowman:?}"
    );
    assert_eq!(tok.decode(&snowman, false).unwrap(), "\u{2603}");
}

/// `tokenizer.ggml.add_space_prefix = false` (llama.cpp's key; true by default): no `▁` is
/// put before the text, and decoding keeps a leading space.
#[test]
fn llama_spm_without_space_prefix() {
    let path = data_dir().join("llama-spm-gguf/ggml-vocab-llama-spm.gguf");
    let file = GgufFile::open(&path).unwrap();
    let off = GgufValue::Bool(false);
    let get = |key: &str| match key {
        "tokenizer.ggml.add_space_prefix" => Some(&off),
        _ => file.get(key),
    };
    let bare = ferrite_tokenizer::gguf::from_metadata(&get).unwrap();
    let (prefixed, _) = gguf_tokenizer("llama-spm-gguf", "ggml-vocab-llama-spm.gguf");
    // The prefix the default adds, written out: the same ids.
    assert_eq!(
        bare.encode(" Hello world", false, false).unwrap(),
        prefixed.encode("Hello world", false, false).unwrap()
    );
    // Without it, "Hello" does not start with the "▁Hello" piece.
    let ids = bare.encode("Hello", false, false).unwrap();
    assert_ne!(ids, prefixed.encode("Hello", false, false).unwrap());
    assert!(!bare.token_bytes(ids[0]).starts_with(b" "), "{ids:?}");
    assert_eq!(bare.decode(&ids, false).unwrap(), "Hello");
    let spaced = bare.encode(" Hello", false, false).unwrap();
    assert_eq!(bare.decode(&spaced, false).unwrap(), " Hello");
}

#[test]
fn qwen3_tokenizer_json_matches_qwen2_vectors() {
    let tok = qwen3_json_tokenizer();
    let cases = read_vocab_cases(&data_dir().join("qwen2-gguf/ggml-vocab-qwen2.gguf.inp"));
    check_vectors("qwen3 tokenizer.json", &tok, &cases);
}

#[test]
fn special_tokens_parse_only_when_asked() {
    let (tok, _) = gguf_tokenizer("qwen2-gguf", "ggml-vocab-qwen2.gguf");
    let im_start = tok
        .token_to_id("<|im_start|>")
        .expect("<|im_start|> in vocab");
    assert!(tok.is_special(im_start));
    let text = "<|im_start|>user\nhi";
    let parsed = tok.encode(text, false, true).unwrap();
    assert_eq!(parsed[0], im_start);
    let plain = tok.encode(text, false, false).unwrap();
    assert!(!plain.contains(&im_start), "{plain:?}");
    assert!(plain.len() > parsed.len());
    // Both decode to the same text.
    assert_eq!(tok.decode(&parsed, false).unwrap(), text);
    assert_eq!(tok.decode(&plain, false).unwrap(), text);
    // Skipping special tokens drops <|im_start|> only.
    assert_eq!(tok.decode(&parsed, true).unwrap(), "user\nhi");
}

#[test]
fn qwen_stop_tokens() {
    let tok = qwen3_json_tokenizer();
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    let eot = tok.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(tok.eos_id(), Some(im_end));
    assert_eq!(tok.pad_id(), Some(eot));
    assert_eq!(tok.bos_id(), None);
    assert!(tok.eos_ids().contains(&im_end) && tok.eos_ids().contains(&eot));
    assert!(tok.chat_template().is_some());
    // <think> is a user-defined (non-special) token: one id even when not parsing specials.
    let think = tok.token_to_id("<think>").unwrap();
    assert!(!tok.is_special(think));
    assert_eq!(tok.encode("<think>", false, false).unwrap(), vec![think]);

    let (gtok, _) = qwen35_tokenizer();
    let g_im_end = gtok.token_to_id("<|im_end|>").unwrap();
    assert!(gtok.eos_ids().contains(&g_im_end), "{:?}", gtok.eos_ids());
}

#[test]
fn incremental_decoder_holds_split_characters() {
    let (tok, _) = gguf_tokenizer("qwen2-gguf", "ggml-vocab-qwen2.gguf");
    for text in ["🦙 llama", "日本語のテキスト", "a😶‍🌫️b", "Cửa Việt", "🚀"]
    {
        let ids = tok.encode(text, false, false).unwrap();
        let mut dec = IncrementalDecoder::new(false);
        let mut out = String::new();
        let mut held_back = false;
        for &id in &ids {
            let d = dec.push(&tok, id);
            assert!(!d.contains('\u{fffd}'), "{text:?}: broken delta {d:?}");
            held_back |= dec.has_pending();
            out.push_str(&d);
        }
        assert_eq!(dec.flush(), "");
        assert_eq!(out, text);
        if text == "🚀" {
            // A single emoji is several byte tokens in this vocabulary unless it has its own.
            eprintln!("🚀 -> {ids:?} (held back: {held_back})");
        }
    }

    // Feed the four UTF-8 bytes of 🦙 as four byte tokens: nothing until the last one.
    let byte_ids: Vec<u32> = "🦙"
        .as_bytes()
        .iter()
        .map(|b| {
            (0..tok.vocab_size() as u32)
                .find(|&id| tok.token_bytes(id) == [*b])
                .expect("a byte token")
        })
        .collect();
    let mut dec = IncrementalDecoder::new(false);
    assert_eq!(dec.push(&tok, byte_ids[0]), "");
    assert_eq!(dec.push(&tok, byte_ids[1]), "");
    assert_eq!(dec.push(&tok, byte_ids[2]), "");
    assert_eq!(dec.push(&tok, byte_ids[3]), "🦙");
    // An incomplete sequence at the end is flushed as a replacement character.
    assert_eq!(dec.push(&tok, byte_ids[0]), "");
    assert_eq!(dec.flush(), "\u{fffd}");
    // An invalid byte in the middle does not stall the stream.
    let cont = byte_ids[1]; // a continuation byte on its own is never valid
    let a = tok.encode("a", false, false).unwrap()[0];
    assert_eq!(dec.push(&tok, cont), "\u{fffd}");
    assert_eq!(dec.push(&tok, a), "a");
}

#[test]
fn unknown_pre_tokenizer_is_a_clear_error() {
    let err = ferrite_tokenizer::pretokenizers::lookup("no-such-pre")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no-such-pre") && err.contains("qwen2") && err.contains("llama-bpe"),
        "{err}"
    );
}
