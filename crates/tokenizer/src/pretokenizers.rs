//! The pre-tokenizer table: `tokenizer.ggml.pre` name → the regex splits llama.cpp applies
//! before byte-level BPE (`llm_tokenizer_bpe` in llama.cpp's `src/llama-vocab.cpp`).
//!
//! llama.cpp applies the expressions one after the other; each splits every piece produced
//! by the previous one and keeps both the matches and the text between them. That is exactly
//! Hugging Face's `Split` pre-tokenizer with behaviour `Isolated`, so each expression becomes
//! one `Split` in a `Sequence`, followed by `ByteLevel` (without its own regex).
//!
//! The contraction alternatives are written `'[sS]|'[tT]...` rather than `(?i:'s|'t...)`
//! exactly as llama.cpp does: the meaning is the same and it keeps the table a faithful copy.

/// How one family of vocabularies is pre-tokenized.
#[derive(Debug)]
pub struct PreTokenizerSpec {
    /// Every `tokenizer.ggml.pre` value that selects this spec.
    pub names: &'static [&'static str],
    /// Regexes applied in order (each one an `Isolated` split).
    pub regexes: &'static [&'static str],
    /// Take a pre-tokenized word whole when it is in the vocabulary, skipping the merges
    /// (llama.cpp's `ignore_merges`; Llama 3 needs it to match its tiktoken origin).
    pub ignore_merges: bool,
    /// Default for `tokenizer.ggml.add_bos_token` when the file does not say.
    pub add_bos_default: bool,
}

// llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3 (also dbrx, smaug-bpe).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

// llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2 (also stablelm2): like Llama 3 but one digit per piece.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

// llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35: Qwen2's shape, but combining marks (\p{M}) stay with
// their letters and out of the punctuation runs.
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

// GPT-2's original word regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_GPT2). The trailing `|\s+` of
// the Python original is not needed: unmatched whitespace is kept as its own piece anyway.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

// llama.cpp LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM: the letter class is spelled out as ranges.
const DEEPSEEK_LLM_LETTERS: &str = "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+";

/// CJK ideographs, the range below them and Hangul, as one run (both DeepSeek tokenizers).
const DEEPSEEK_CJK: &str = "[一-龥ࠀ-一가-퟿]+";

impl PreTokenizerSpec {
    /// The `tokenizer.json` pre-tokenizer of this spec: each regex an `Isolated` split, then
    /// `ByteLevel` without its own regex.
    pub(crate) fn byte_level_pre_tokenizer(&self) -> serde_json::Value {
        let mut seq: Vec<serde_json::Value> = self
            .regexes
            .iter()
            .map(|r| serde_json::json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
            .collect();
        seq.push(BYTE_LEVEL.clone());
        serde_json::json!({"type": "Sequence", "pretokenizers": seq})
    }
}

/// `ByteLevel` as a pre-tokenizer step (after the splits) and as the decoder: GPT-2's byte
/// mapping, no prefix space, no regex of its own.
pub(crate) static BYTE_LEVEL: std::sync::LazyLock<serde_json::Value> = std::sync::LazyLock::new(
    || serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
);

/// Every supported `tokenizer.ggml.pre`.
pub static PRE_TOKENIZERS: &[PreTokenizerSpec] = &[
    PreTokenizerSpec {
        names: &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "dbrx",
            "smaug-bpe",
        ],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos_default: true,
    },
    PreTokenizerSpec {
        names: &["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"],
        regexes: &[QWEN2],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizerSpec {
        names: &["qwen35"],
        regexes: &[QWEN35],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizerSpec {
        // SmolLM (and starcoder/refact): every digit alone, then GPT-2's regex.
        names: &["smollm", "starcoder", "refact"],
        regexes: &[r"\p{N}", GPT2],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizerSpec {
        names: &["gpt-2", "phi-2", "mpt", "olmo", "jina-es", "jina-de"],
        regexes: &[GPT2],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizerSpec {
        names: &["deepseek-llm"],
        regexes: &[
            "[\r\n]",
            DEEPSEEK_LLM_LETTERS,
            "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            DEEPSEEK_CJK,
            r"\p{N}+",
        ],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizerSpec {
        names: &["deepseek-coder"],
        regexes: &["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizerSpec {
        // llama.cpp's fallback when `tokenizer.ggml.pre` is "default" (or absent).
        names: &["default"],
        regexes: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos_default: false,
    },
];

/// The spec for a `tokenizer.ggml.pre` value, or an error that lists the supported names.
pub fn lookup(pre: &str) -> crate::Result<&'static PreTokenizerSpec> {
    PRE_TOKENIZERS
        .iter()
        .find(|s| s.names.contains(&pre))
        .ok_or_else(|| {
            crate::TokenizerError::Unsupported(format!(
                "pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not supported; supported: {}",
                supported_names().join(", ")
            ))
        })
}

/// Every name [`lookup`] accepts.
pub fn supported_names() -> Vec<&'static str> {
    PRE_TOKENIZERS
        .iter()
        .flat_map(|s| s.names.iter().copied())
        .collect()
}
