//! Tokenizers and chat templates.
//!
//! - [`Tokenizer`]: a Hugging Face `tokenizers::Tokenizer` built from a `tokenizer.json`
//!   ([`Tokenizer::from_json_file`]) or from GGUF metadata ([`Tokenizer::from_gguf`], see
//!   [`gguf`]) or from a tiktoken vocabulary ([`Tokenizer::from_tiktoken`], see
//!   [`tiktoken`]), plus what the engine needs around it: special-token ids, end-of-generation
//!   ids, the raw bytes of every token and the model's chat template.
//! - [`IncrementalDecoder`]: ids in, text deltas out, never a broken UTF-8 sequence.
//! - [`ChatTemplate`]: Jinja chat templates rendered with minijinja the way Hugging Face
//!   renders them with jinja2.
//!
//! Encoding has two modes, chosen per call:
//! - `parse_special = true`: text that spells a special token (`<|im_start|>`) becomes that
//!   token. Needed for rendered chat templates.
//! - `parse_special = false`: special-token text is ordinary text (llama.cpp's default for
//!   user text and its tokenizer test vectors). User-defined added tokens (`<think>`) are
//!   still matched, as llama.cpp does.

pub mod chat;
pub mod gguf;
pub mod incremental;
pub mod pretokenizers;
pub mod tiktoken;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use chat::{ChatMessage, ChatTemplate, RenderOptions};
pub use incremental::IncrementalDecoder;

/// Everything that can go wrong building or using a tokenizer or a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    // Printed here, not chained as a `source` (a chained report would print it twice).
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{0}")]
    Invalid(String),
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Hf(String),
    #[error("chat template: {0}")]
    Template(String),
}

pub type Result<T> = std::result::Result<T, TokenizerError>;

fn hf_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Hf(e.to_string())
}

/// Token texts that end a turn when a vocabulary has them as special tokens (llama.cpp's
/// end-of-generation heuristics in `llama_vocab::impl::load`): models often stop with one of
/// these although their `eos` says otherwise (Qwen: eos `<|endoftext|>`, turns end with
/// `<|im_end|>`).
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<|eom_id|>",
    "<｜end▁of▁sentence｜>",
];

/// A tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    /// Splits every added token out of the text before the model runs (parse_special).
    hf: tokenizers::Tokenizer,
    /// Same pipeline, but special tokens are left in the text as ordinary text. Built on
    /// first use: most processes only ever encode one way, and it is a full vocabulary copy.
    hf_plain: OnceLock<tokenizers::Tokenizer>,
    /// The bytes each id stands for (byte-level / `<0xAB>` / `▁` already undone).
    pieces: Vec<Vec<u8>>,
    /// Ids of special (control) tokens.
    special: HashSet<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eos_ids: Vec<u32>,
    pad: Option<u32>,
    /// SentencePiece-style decoders drop the space that starts the text.
    strip_leading_space: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos_ids", &self.eos_ids)
            .field("n_special", &self.special.len())
            .finish()
    }
}

/// The parts of a BPE `tokenizer.json` that the builders from GGUF metadata and tiktoken
/// files choose; [`Bpe::json`] writes the rest.
pub(crate) struct Bpe {
    pub added_tokens: Vec<serde_json::Value>,
    pub normalizer: serde_json::Value,
    pub pre_tokenizer: serde_json::Value,
    pub post_processor: serde_json::Value,
    pub decoder: serde_json::Value,
    pub byte_fallback: bool,
    pub ignore_merges: bool,
    pub vocab: serde_json::Map<String, serde_json::Value>,
    pub merges: Vec<serde_json::Value>,
}

impl Bpe {
    /// The pipeline as the `tokenizers` crate reads it.
    pub(crate) fn json(self) -> serde_json::Value {
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": self.added_tokens,
            "normalizer": self.normalizer,
            "pre_tokenizer": self.pre_tokenizer,
            "post_processor": self.post_processor,
            "decoder": self.decoder,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": self.byte_fallback,
                "ignore_merges": self.ignore_merges,
                "vocab": self.vocab, "merges": self.merges,
            },
        })
    }
}

/// What a builder (tokenizer.json or GGUF) knows besides the `tokenizers` pipeline.
pub(crate) struct Parts {
    pub hf: tokenizers::Tokenizer,
    pub pieces: Vec<Vec<u8>>,
    pub special: HashSet<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Extra explicit end-of-generation ids (GGUF `eot`/`eom`).
    pub extra_eos: Vec<u32>,
    pub pad: Option<u32>,
    pub strip_leading_space: bool,
    pub chat_template: Option<String>,
}

impl Tokenizer {
    pub(crate) fn from_parts(p: Parts) -> Tokenizer {
        let mut eos_ids: Vec<u32> = p.eos.into_iter().chain(p.extra_eos).collect();
        for text in END_OF_TURN_TEXTS {
            if let Some(id) = p.hf.token_to_id(text) {
                if p.special.contains(&id) && !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        Tokenizer {
            hf: p.hf,
            hf_plain: OnceLock::new(),
            pieces: p.pieces,
            special: p.special,
            bos: p.bos,
            eos: p.eos,
            eos_ids,
            pad: p.pad,
            strip_leading_space: p.strip_leading_space,
            chat_template: p.chat_template,
        }
    }

    /// Loads a Hugging Face `tokenizer.json`, and from `tokenizer_config.json` (when given)
    /// the bos/eos/pad tokens and the chat template.
    pub fn from_json_file(
        tokenizer_json: &Path,
        tokenizer_config_json: Option<&Path>,
    ) -> Result<Tokenizer> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|err| TokenizerError::Io {
                path: p.to_path_buf(),
                err,
            })
        };
        let tok_text = read(tokenizer_json)?;
        let config = match tokenizer_config_json {
            Some(p) => Some(
                serde_json::from_str::<serde_json::Value>(&read(p)?)
                    .map_err(|e| TokenizerError::Invalid(format!("{}: {e}", p.display())))?,
            ),
            None => None,
        };
        Self::from_json_str(&tok_text, config.as_ref())
            .map_err(|e| TokenizerError::Invalid(format!("{}: {e}", tokenizer_json.display())))
    }

    /// [`Tokenizer::from_json_file`] on text already in memory (`config` is the parsed
    /// `tokenizer_config.json`).
    pub fn from_json_str(
        tokenizer_json: &str,
        config: Option<&serde_json::Value>,
    ) -> Result<Tokenizer> {
        let json: serde_json::Value = serde_json::from_str(tokenizer_json)
            .map_err(|e| TokenizerError::Invalid(e.to_string()))?;
        let decoder = json
            .get("decoder")
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        let hf: tokenizers::Tokenizer = serde_json::from_value(json).map_err(hf_err)?;

        let style = PieceStyle::from_decoder(&decoder);
        let added = hf.get_added_tokens_decoder();
        let n = hf.get_vocab_size(true);
        let mut pieces = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let bytes = match added.get(&id) {
                Some(t) => t.content.as_bytes().to_vec(),
                None => match hf.id_to_token(id) {
                    Some(t) => style.token_bytes(&t),
                    None => Vec::new(),
                },
            };
            pieces.push(bytes);
        }
        let special: HashSet<u32> = added
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| *id)
            .collect();

        // tokenizer_config.json names special tokens either as a string or as an
        // AddedToken object {"content": ...}.
        let token_id = |key: &str| -> Option<u32> {
            let v = config?.get(key)?;
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
            hf.token_to_id(text)
        };
        let bos = token_id("bos_token");
        let eos = token_id("eos_token");
        let pad = token_id("pad_token");
        let chat_template = config.and_then(|c| chat_template_from_config(c.get("chat_template")?));

        Ok(Tokenizer::from_parts(Parts {
            hf,
            pieces,
            special,
            bos,
            eos,
            extra_eos: Vec::new(),
            pad,
            strip_leading_space: style.strip_leading_space,
            chat_template,
        }))
    }

    /// Builds the tokenizer stored in a GGUF file's metadata (see [`gguf`]).
    pub fn from_gguf(file: &ferrite_formats::gguf::GgufFile) -> Result<Tokenizer> {
        gguf::from_gguf(file)
    }

    /// Text → ids.
    ///
    /// `add_special`: add what the tokenizer adds around a sequence (BOS for Llama 3, ...).
    /// `parse_special`: treat special-token text in `text` as those tokens (see the crate
    /// docs); `false` tokenizes it as ordinary text.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let hf = if parse_special {
            &self.hf
        } else {
            self.hf_plain.get_or_init(|| {
                let mut t = self.hf.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let enc = hf.encode_fast(text, add_special).map_err(hf_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids → text. Unknown ids are skipped; `skip_special` drops special tokens.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.hf.decode(ids, skip_special).map_err(hf_err)
    }

    /// The raw bytes of one token (may be part of a UTF-8 sequence). Empty for unknown ids.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.pieces
            .get(id as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The text of one token (lossy when the token is part of a multi-byte character).
    pub fn token_to_piece(&self, id: u32) -> String {
        String::from_utf8_lossy(self.token_bytes(id)).into_owned()
    }

    /// The id of a token given its vocabulary text (`"<|im_end|>"`, `"Ġthe"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.hf.token_to_id(token)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Every id that ends generation: eos, eot/eom, and end-of-turn tokens such as
    /// `<|im_end|>` and `<|endoftext|>` when the vocabulary has them as special tokens.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// The text of the BOS token, for chat templates (`bos_token`).
    pub fn bos_token(&self) -> Option<String> {
        self.bos.and_then(|id| self.hf.id_to_token(id))
    }

    /// The text of the EOS token, for chat templates (`eos_token`).
    pub fn eos_token(&self) -> Option<String> {
        self.eos.and_then(|id| self.hf.id_to_token(id))
    }

    /// The model's chat template source, if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Compiles the model's chat template (`Ok(None)` when it has none).
    pub fn compile_chat_template(&self) -> Result<Option<ChatTemplate>> {
        self.chat_template
            .as_deref()
            .map(ChatTemplate::new)
            .transpose()
    }

    /// Render options pre-filled with this tokenizer's bos/eos texts.
    pub fn render_options(&self, add_generation_prompt: bool) -> RenderOptions {
        RenderOptions {
            add_generation_prompt,
            bos_token: self.bos_token(),
            eos_token: self.eos_token(),
            ..RenderOptions::default()
        }
    }

    /// The underlying Hugging Face tokenizer.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.hf
    }

    pub(crate) fn strip_leading_space(&self) -> bool {
        self.strip_leading_space
    }
}

/// `chat_template` in tokenizer_config.json is a string, or a list of `{name, template}`
/// of which "default" is the one used when no name is asked for.
fn chat_template_from_config(v: &serde_json::Value) -> Option<String> {
    if let Some(s) = v.as_str() {
        return Some(s.to_string());
    }
    let list = v.as_array()?;
    let named = |name: &str| {
        list.iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
            .and_then(|t| t.get("template")?.as_str())
    };
    named("default")
        .or_else(|| list.first().and_then(|t| t.get("template")?.as_str()))
        .map(str::to_string)
}

/// How vocabulary strings map to bytes.
pub(crate) struct PieceStyle {
    /// GPT-2 byte-level: every byte is stored as one printable character.
    byte_level: bool,
    strip_leading_space: bool,
}

impl PieceStyle {
    pub(crate) const BYTE_LEVEL: PieceStyle = PieceStyle {
        byte_level: true,
        strip_leading_space: false,
    };
    /// SentencePiece's pieces: `▁` is a space, `<0xAB>` a byte.
    pub(crate) const SENTENCEPIECE: PieceStyle = PieceStyle {
        byte_level: false,
        strip_leading_space: true,
    };

    /// Reads the `decoder` of a tokenizer.json: ByteLevel anywhere → byte-level; otherwise
    /// SentencePiece conventions (`▁` is a space, `<0xAB>` a byte), with the leading space
    /// dropped when the decoder strips it (`Strip` with start ≥ 1, or a prepending Metaspace).
    fn from_decoder(decoder: &serde_json::Value) -> PieceStyle {
        let mut parts: Vec<&serde_json::Value> = vec![decoder];
        if let Some(seq) = decoder.get("decoders").and_then(|d| d.as_array()) {
            parts.extend(seq.iter());
        }
        fn ty(d: &serde_json::Value) -> &str {
            d.get("type").and_then(|t| t.as_str()).unwrap_or("")
        }
        let byte_level = parts.iter().any(|d| ty(d) == "ByteLevel");
        let strip_leading_space = parts.iter().any(|d| {
            (ty(d) == "Strip" && d.get("start").and_then(|s| s.as_u64()).unwrap_or(0) >= 1)
                || (ty(d) == "Metaspace"
                    && (d.get("add_prefix_space").and_then(|a| a.as_bool()) == Some(true)
                        || matches!(
                            d.get("prepend_scheme").and_then(|s| s.as_str()),
                            Some("always") | Some("first")
                        )))
        });
        PieceStyle {
            byte_level,
            strip_leading_space,
        }
    }

    pub(crate) fn token_bytes(&self, token: &str) -> Vec<u8> {
        if self.byte_level {
            return byte_level_decode(token);
        }
        if let Some(b) = parse_byte_token(token) {
            return vec![b];
        }
        token.replace('\u{2581}', " ").into_bytes()
    }
}

/// `<0xAB>` → 0xAB (SentencePiece byte-fallback tokens).
fn parse_byte_token(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// GPT-2's byte → printable-character table: printable Latin-1 bytes map to themselves,
/// the other 68 bytes to U+0100.. in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\u{fffd}');
    }
    table
}

fn char_to_byte(c: char) -> Option<u8> {
    static TABLE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            byte_to_char_table()
                .iter()
                .enumerate()
                .map(|(b, c)| (*c, b as u8))
                .collect()
        })
        .get(&c)
        .copied()
}

/// A byte-level vocabulary string → its bytes. A string with a character outside the table
/// (an added token stored raw) is taken as its own UTF-8, as `tokenizers`' ByteLevel does.
pub(crate) fn byte_level_decode(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(char_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}
