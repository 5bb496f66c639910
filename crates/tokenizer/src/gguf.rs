//! Building a [`Tokenizer`] from GGUF metadata, the way llama.cpp reads it
//! (`llama_vocab::impl::load` in `src/llama-vocab.cpp`).
//!
//! Keys read:
//! - `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece BPE:
//!   Llama 2, Mistral 7B up to v0.3, TinyLlama; see [`sentencepiece`]).
//! - `tokenizer.ggml.pre`: the pre-tokenizer name, looked up in [`crate::pretokenizers`]
//!   (byte-level BPE only: llama.cpp's SentencePiece tokenizer has none).
//! - `tokenizer.ggml.scores`, `tokenizer.ggml.add_space_prefix` (SentencePiece).
//! - `tokenizer.ggml.tokens`, `tokenizer.ggml.merges` (`"a b"` strings),
//!   `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
//!   6 byte).
//! - `tokenizer.ggml.{bos,eos,eot,eom,pad}_token_id`, `tokenizer.ggml.add_bos_token`,
//!   `tokenizer.ggml.add_eos_token`, `tokenizer.chat_template`.
//!
//! The result is an in-memory `tokenizer.json` loaded by the `tokenizers` crate: no
//! normalizer (llama.cpp does not normalize BPE input), the pre-tokenizer's regexes as
//! `Isolated` splits, then byte-level mapping and BPE. Control tokens become special added
//! tokens (split out only when parsing special text); user-defined ones become non-special
//! added tokens (always split out, as llama.cpp does).

use std::collections::{HashMap, HashSet};

use ferrite_formats::gguf::{GgufFile, GgufValue};
use serde_json::{json, Value};

use crate::{pretokenizers, Bpe, Parts, PieceStyle, Result, Tokenizer, TokenizerError};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Builds the tokenizer from a GGUF file's metadata.
pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
    from_metadata(&|key| file.get(key))
}

/// Builds the tokenizer from any source of GGUF metadata (a file, or a map in tests).
pub fn from_metadata<'a>(get: &dyn Fn(&str) -> Option<&'a GgufValue>) -> Result<Tokenizer> {
    let invalid = |what: String| TokenizerError::Invalid(format!("GGUF tokenizer: {what}"));
    let get_str = |key: &str| -> Option<&'a str> { get(key).and_then(GgufValue::as_str) };

    let model = get_str("tokenizer.ggml.model")
        .ok_or_else(|| invalid("missing tokenizer.ggml.model".into()))?;
    let spm = match model {
        "gpt2" => false,
        "llama" => true,
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "tokenizer.ggml.model = \"{other}\"; supported: \"gpt2\" (byte-level BPE) and \
                 \"llama\" (SentencePiece BPE)"
            )))
        }
    };
    // llama.cpp falls back to "default" (with a loud warning) when the key is missing. Its
    // SentencePiece tokenizer reads no pre-tokenizer (the files say "default"): `None`.
    let pre = if spm {
        None
    } else {
        Some(pretokenizers::lookup(
            get_str("tokenizer.ggml.pre").unwrap_or("default"),
        )?)
    };

    let tokens = get("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_str_array)
        .ok_or_else(|| {
            invalid("tokenizer.ggml.tokens missing or not an array of strings".into())
        })?;
    let n = tokens.len();
    if n == 0 {
        return Err(invalid("tokenizer.ggml.tokens is empty".into()));
    }
    let types = per_token(get, "tokenizer.ggml.token_type", n, "integers", |v| {
        v.as_i32_array()
    })?
    .unwrap_or_else(|| vec![token_type::NORMAL; n]);

    // A missing, negative or out-of-range id means "no such token": llama.cpp warns and
    // ignores those too (converters write -1, and some ids point past a trimmed vocabulary).
    let id_key = |key: &str| -> Option<u32> { get(key)?.as_u32().filter(|&id| (id as usize) < n) };
    let bos = id_key("tokenizer.ggml.bos_token_id");
    let eos = id_key("tokenizer.ggml.eos_token_id");
    let eot = id_key("tokenizer.ggml.eot_token_id");
    let eom = id_key("tokenizer.ggml.eom_token_id");
    let pad = id_key("tokenizer.ggml.padding_token_id");
    // llama.cpp adds BOS by default for SentencePiece vocabularies.
    let add_bos = get("tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(pre.is_none_or(|p| p.add_bos_default));
    let add_eos = get("tokenizer.ggml.add_eos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    if add_bos && bos.is_none() {
        return Err(invalid(
            "tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is not set"
                .into(),
        ));
    }
    if add_eos && eos.is_none() {
        return Err(invalid(
            "tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id is not set"
                .into(),
        ));
    }

    // Vocabulary: the first id of a duplicated string wins (the map cannot hold both).
    let mut vocab = serde_json::Map::with_capacity(n);
    for (id, t) in tokens.iter().enumerate() {
        if !vocab.contains_key(*t) {
            vocab.insert((*t).to_string(), json!(id));
        }
    }
    let merges = if spm {
        let scores = per_token(get, "tokenizer.ggml.scores", n, "floats", |v| {
            v.as_f32_array()
        })?
        .ok_or_else(|| invalid("tokenizer.ggml.scores missing".into()))?;
        sentencepiece::merges(&tokens, &types, &scores)
    } else {
        let merges_raw = get("tokenizer.ggml.merges")
            .and_then(GgufValue::as_str_array)
            .ok_or_else(|| {
                invalid("tokenizer.ggml.merges missing or not an array of strings".into())
            })?;
        let mut merges = Vec::with_capacity(merges_raw.len());
        for (i, m) in merges_raw.iter().enumerate() {
            // The separator is the first space after the first character: llama.cpp searches
            // from index 1 so that a merge whose left part is a space still splits correctly.
            let first_len = m.chars().next().map(char::len_utf8).unwrap_or(0);
            let pos = m[first_len..].find(' ').map(|p| p + first_len);
            match pos {
                Some(p) => merges.push(json!([&m[..p], &m[p + 1..]])),
                None => return Err(invalid(format!("merge #{i} {m:?} has no space separator"))),
            }
        }
        merges
    };

    let mut added = Vec::new();
    let mut special = HashSet::new();
    for (id, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        let is_control = ty == token_type::CONTROL || ty == token_type::UNKNOWN;
        if is_control || ty == token_type::USER_DEFINED {
            if t.is_empty() {
                continue; // an empty pattern would match everywhere
            }
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": is_control,
            }));
            if is_control {
                special.insert(id as u32);
            }
        }
    }

    // llama.cpp's SentencePiece default: a space before the text and after each special token.
    let add_space_prefix = spm
        && get("tokenizer.ggml.add_space_prefix")
            .and_then(GgufValue::as_bool)
            .unwrap_or(true);
    // What differs between the two kinds: byte-level BPE splits by the pre-tokenizer's regexes
    // and maps bytes to printable characters; SentencePiece writes spaces as `▁`, takes the
    // text as one word and falls back to byte tokens.
    let (normalizer, pre_tokenizer, decoder) = match pre {
        Some(pre) => (
            Value::Null,
            pre.byte_level_pre_tokenizer(),
            pretokenizers::BYTE_LEVEL.clone(),
        ),
        None => (
            sentencepiece::normalizer(add_space_prefix),
            Value::Null,
            sentencepiece::decoder(add_space_prefix),
        ),
    };

    let post_processor = template_processing(
        add_bos
            .then(|| bos.map(|id| (id, tokens[id as usize])))
            .flatten(),
        add_eos
            .then(|| eos.map(|id| (id, tokens[id as usize])))
            .flatten(),
    );

    let tokenizer_json = Bpe {
        added_tokens: added,
        normalizer,
        pre_tokenizer,
        post_processor,
        decoder,
        byte_fallback: spm,
        ignore_merges: pre.is_some_and(|p| p.ignore_merges),
        vocab,
        merges,
    }
    .json();
    let hf: tokenizers::Tokenizer = serde_json::from_value(tokenizer_json)
        .map_err(|e| invalid(format!("building the BPE tokenizer failed: {e}")))?;

    // Bytes of each id: control/user-defined tokens are stored raw, the rest byte-level (or
    // SentencePiece's `▁` and `<0xAB>`).
    let style = if spm {
        PieceStyle::SENTENCEPIECE
    } else {
        PieceStyle::BYTE_LEVEL
    };
    let pieces = tokens
        .iter()
        .zip(&types)
        .map(|(t, &ty)| match ty {
            token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED => {
                t.as_bytes().to_vec()
            }
            _ => style.token_bytes(t),
        })
        .collect();

    Ok(Tokenizer::from_parts(Parts {
        hf,
        pieces,
        special,
        bos,
        eos,
        extra_eos: eot.into_iter().chain(eom).collect(),
        pad,
        strip_leading_space: add_space_prefix,
        chat_template: get_str("tokenizer.chat_template").map(str::to_string),
    }))
}

/// `key`'s array of one value a token (`n` of them), read by `as_array`; `None` where the
/// metadata has no such key.
fn per_token<'a, T>(
    get: &dyn Fn(&str) -> Option<&'a GgufValue>,
    key: &str,
    n: usize,
    kind: &str,
    as_array: fn(&GgufValue) -> Option<Vec<T>>,
) -> Result<Option<Vec<T>>> {
    let invalid = |what: String| TokenizerError::Invalid(format!("GGUF tokenizer: {what}"));
    let Some(v) = get(key) else {
        return Ok(None);
    };
    let a = as_array(v).ok_or_else(|| invalid(format!("{key} is not an array of {kind}")))?;
    if a.len() != n {
        return Err(invalid(format!(
            "{key} has {} entries for {n} tokens",
            a.len()
        )));
    }
    Ok(Some(a))
}

/// A `TemplateProcessing` post-processor that adds BOS before and/or EOS after a sequence;
/// `null` when neither is added.
fn template_processing(bos: Option<(u32, &str)>, eos: Option<(u32, &str)>) -> Value {
    if bos.is_none() && eos.is_none() {
        return Value::Null;
    }
    let special = |t: &str| json!({"SpecialToken": {"id": t, "type_id": 0}});
    let seq = |s: &str| json!({"Sequence": {"id": s, "type_id": 0}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut special_tokens = HashMap::new();
    if let Some((id, t)) = bos {
        single.push(special(t));
        pair.push(special(t));
        special_tokens.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    single.push(seq("A"));
    pair.push(seq("A"));
    pair.push(seq("B"));
    if let Some((id, t)) = eos {
        single.push(special(t));
        pair.push(special(t));
        special_tokens.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens})
}

/// llama.cpp's SentencePiece BPE (`llm_tokenizer_spm`, a port of sentencepiece's
/// `bpe_model.cc`) as a `tokenizers` pipeline, the form Hugging Face's own conversion of these
/// vocabularies takes (`LlamaConverter`): spaces become `▁` and one `▁` goes before the text
/// (and after each special token, where llama.cpp adds it too); the text is one word; BPE with
/// byte fallback to the `<0xAB>` tokens.
///
/// llama.cpp merges, at each step, the adjacent pair whose concatenation is the vocabulary's
/// highest-scoring token (the leftmost of equals). As merges: every split of a token into two
/// tokens, ranked by the whole token's score, highest first (ties in token order, then by the
/// halves' ids, as `SentencePieceExtractor` orders them). `tests/vocab.rs` holds the result to
/// llama.cpp's own vectors (`ggml-vocab-llama-spm.gguf`).
mod sentencepiece {
    use std::collections::HashMap;

    use serde_json::{json, Value};

    use super::token_type;

    /// The merges of a SentencePiece BPE vocabulary from its tokens and scores.
    pub(super) fn merges(tokens: &[&str], types: &[i32], scores: &[f32]) -> Vec<Value> {
        // Pieces a merge may produce or join: the model's own pieces (normal and
        // user-defined), not control, unknown, unused or byte tokens.
        let mergeable = |ty: i32| ty == token_type::NORMAL || ty == token_type::USER_DEFINED;
        let mut id_of: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
        for (id, (&t, &ty)) in tokens.iter().zip(types).enumerate() {
            if mergeable(ty) {
                id_of.entry(t).or_insert(id);
            }
        }
        let mut found: Vec<(f32, usize, usize, usize)> = Vec::new();
        for (id, (&t, &ty)) in tokens.iter().zip(types).enumerate() {
            if !mergeable(ty) || id_of.get(t) != Some(&id) {
                continue;
            }
            for (split, _) in t.char_indices().skip(1) {
                let (l, r) = t.split_at(split);
                if let (Some(&li), Some(&ri)) = (id_of.get(l), id_of.get(r)) {
                    found.push((scores[id], id, li, ri));
                }
            }
        }
        // Highest score first; equal scores in token order, then by the halves' ids.
        found.sort_by(|a, b| {
            b.0.total_cmp(&a.0)
                .then(a.1.cmp(&b.1))
                .then((a.2, a.3).cmp(&(b.2, b.3)))
        });
        found
            .into_iter()
            .map(|(_, _, l, r)| json!([tokens[l], tokens[r]]))
            .collect()
    }

    /// Spaces as `▁`, with one before the text where `add_space_prefix` (the normalizer runs
    /// on each stretch of text between added tokens, so after each special token too).
    pub(super) fn normalizer(add_space_prefix: bool) -> Value {
        let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
        if add_space_prefix {
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u{2581}"}, replace]})
        } else {
            replace
        }
    }

    /// `▁` back to spaces, byte tokens to bytes, and the leading space the normalizer added
    /// dropped.
    pub(super) fn decoder(add_space_prefix: bool) -> Value {
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if add_space_prefix {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        json!({"type": "Sequence", "decoders": decoders})
    }
}
