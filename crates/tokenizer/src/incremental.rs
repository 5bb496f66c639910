//! Streaming detokenization: ids in one at a time, text out, never a broken character.
//!
//! Byte-level vocabularies split multi-byte characters across tokens (an emoji is often
//! four byte tokens), so the text of one token alone may be half a character. The decoder
//! keeps the bytes that do not yet form a complete UTF-8 sequence and emits them once the
//! sequence completes. Bytes that can never become valid UTF-8 are emitted as U+FFFD right
//! away so that one bad token cannot stall the stream.

use crate::Tokenizer;

/// Per-sequence streaming decoder. It holds no reference to the tokenizer, so it can live
/// next to an `Arc<Tokenizer>` in a sequence's state.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    /// Bytes received but not yet emitted: an incomplete UTF-8 sequence at the end.
    pending: Vec<u8>,
    skip_special: bool,
    /// Whether a token has been taken: SentencePiece's leading space is dropped from the
    /// first one only (as a decoder's `Strip` after `Fuse`, and llama.cpp's detokenizer), even
    /// where that token is the space alone.
    started: bool,
}

impl IncrementalDecoder {
    /// `skip_special`: special tokens produce no text (what a chat client wants).
    pub fn new(skip_special: bool) -> IncrementalDecoder {
        IncrementalDecoder {
            pending: Vec::new(),
            skip_special,
            started: false,
        }
    }

    /// Adds one id; returns the text that became complete (often empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if self.skip_special && tok.is_special(id) {
            return String::new();
        }
        let mut bytes = tok.token_bytes(id);
        if !self.started && tok.strip_leading_space() {
            if let Some(rest) = bytes.strip_prefix(b" ") {
                bytes = rest;
            }
        }
        self.started = true;
        self.pending.extend_from_slice(bytes);
        self.take_complete()
    }

    /// Adds several ids; returns the text that became complete.
    pub fn push_all(&mut self, tok: &Tokenizer, ids: &[u32]) -> String {
        ids.iter().map(|&id| self.push(tok, id)).collect()
    }

    /// Ends the stream: whatever is still pending is emitted (incomplete bytes as U+FFFD).
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Whether bytes are held back waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Emits the longest prefix of `pending` that is complete: valid UTF-8, with invalid
    /// bytes replaced by U+FFFD, keeping only a trailing incomplete sequence.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // The prefix up to `valid` was just validated, so this copies it as is.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // Invalid bytes: they will never complete, replace and go on.
                        Some(n) => {
                            out.push('\u{fffd}');
                            start = valid + n;
                        }
                        // Incomplete sequence at the end: wait for more bytes.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
