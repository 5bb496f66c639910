//! JSON mode (OpenAI's `response_format: {"type": "json_object"}`): the output is held to
//! one JSON object (RFC 8259) by masking, at every step, the tokens whose bytes cannot
//! continue it.
//!
//! [`JsonState`] is an incremental validator over bytes: a pushdown automaton whose stack is
//! the open containers (at most [`MAX_DEPTH`]) and whose mode is where in the grammar the
//! next byte falls (inside a string, a number, a literal, between tokens). It is `Copy`, so a
//! candidate token is tried on a copy ([`JsonState::accepts`]). [`mask`] runs that over the
//! vocabulary (in parallel: ~150k tokens of a few bytes each) and leaves `-inf` on every
//! token that cannot come next; the sampler then picks among the rest as it would anyway
//! (greedy, temperature, top-k/p, penalties), so a JSON-mode request samples from the model's
//! distribution restricted to valid continuations. Once the object is closed only an
//! end-of-sequence token may follow (whitespace where the request ignores EOS), so
//! generation ends there. Strings may hold any bytes but unescaped control characters (a
//! multi-byte character split over tokens is fine: bytes ≥ 0x80 are string content).

use ferrite_tokenizer::Tokenizer;
use rayon::prelude::*;

/// Deepest nesting of objects and arrays a JSON-mode output may reach.
pub const MAX_DEPTH: usize = 32;

/// Where a number is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Before the top-level object: whitespace or `{`.
    Top,
    /// A value is expected (after `:`, or after `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    ArrayStart,
    /// After `{`: a key or `}`.
    ObjectStart,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value in a container: `,` or the container's close.
    After,
    Str {
        key: bool,
    },
    Esc {
        key: bool,
    },
    Hex {
        key: bool,
        left: u8,
    },
    Num(Num),
    /// Inside `true` (0), `false` (1) or `null` (2), `at` bytes matched.
    Lit {
        which: u8,
        at: u8,
    },
    /// The top-level object is closed: whitespace only.
    Done,
}

const LITERALS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// An incremental JSON-object validator (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JsonState {
    /// Open containers, `{` or `[`, innermost last.
    stack: [u8; MAX_DEPTH],
    depth: u8,
    mode: Mode,
}

impl Default for JsonState {
    fn default() -> Self {
        JsonState {
            stack: [0; MAX_DEPTH],
            depth: 0,
            mode: Mode::Top,
        }
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonState {
    /// Whether the top-level object is complete.
    pub fn complete(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Whether `bytes` can follow what was fed so far (the state unchanged).
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        let mut s = *self;
        bytes.iter().all(|&b| s.feed(b))
    }

    /// Feeds one byte; `false` (the state then undefined) where it cannot continue the
    /// object.
    pub fn feed(&mut self, b: u8) -> bool {
        match self.mode {
            Mode::Top | Mode::Done if is_ws(b) => true,
            Mode::Top => b == b'{' && self.open(b),
            Mode::Done => false,
            Mode::Value
            | Mode::ArrayStart
            | Mode::ObjectStart
            | Mode::Key
            | Mode::Colon
            | Mode::After
                if is_ws(b) =>
            {
                true
            }
            Mode::ArrayStart if b == b']' => self.close(b),
            Mode::Value | Mode::ArrayStart => self.start_value(b),
            Mode::ObjectStart if b == b'}' => self.close(b),
            Mode::ObjectStart | Mode::Key => {
                self.mode = Mode::Str { key: true };
                b == b'"'
            }
            Mode::Colon => {
                self.mode = Mode::Value;
                b == b':'
            }
            Mode::After => match b {
                b',' => {
                    self.mode = if self.top() == b'{' {
                        Mode::Key
                    } else {
                        Mode::Value
                    };
                    true
                }
                b'}' | b']' => self.close(b),
                _ => false,
            },
            Mode::Str { key } => match b {
                b'"' => {
                    if key {
                        self.mode = Mode::Colon;
                    } else {
                        self.value_done();
                    }
                    true
                }
                b'\\' => {
                    self.mode = Mode::Esc { key };
                    true
                }
                _ => b >= 0x20,
            },
            Mode::Esc { key } => match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                    self.mode = Mode::Str { key };
                    true
                }
                b'u' => {
                    self.mode = Mode::Hex { key, left: 4 };
                    true
                }
                _ => false,
            },
            Mode::Hex { key, left } => {
                self.mode = if left == 1 {
                    Mode::Str { key }
                } else {
                    Mode::Hex {
                        key,
                        left: left - 1,
                    }
                };
                b.is_ascii_hexdigit()
            }
            Mode::Num(n) => self.number(n, b),
            Mode::Lit { which, at } => {
                let lit = LITERALS[which as usize];
                if b != lit[at as usize] {
                    return false;
                }
                if at as usize + 1 == lit.len() {
                    self.value_done();
                } else {
                    self.mode = Mode::Lit { which, at: at + 1 };
                }
                true
            }
        }
    }

    fn top(&self) -> u8 {
        self.stack[self.depth as usize - 1]
    }

    fn open(&mut self, b: u8) -> bool {
        if self.depth as usize == MAX_DEPTH {
            return false;
        }
        self.stack[self.depth as usize] = b;
        self.depth += 1;
        self.mode = if b == b'{' {
            Mode::ObjectStart
        } else {
            Mode::ArrayStart
        };
        true
    }

    fn close(&mut self, b: u8) -> bool {
        let want = if b == b'}' { b'{' } else { b'[' };
        if self.depth == 0 || self.top() != want {
            return false;
        }
        self.depth -= 1;
        self.value_done();
        true
    }

    /// A value ended: the container's next, or the end of the top-level object.
    fn value_done(&mut self) {
        self.mode = if self.depth == 0 {
            Mode::Done
        } else {
            Mode::After
        };
    }

    fn start_value(&mut self, b: u8) -> bool {
        self.mode = match b {
            b'{' | b'[' => return self.open(b),
            b'"' => Mode::Str { key: false },
            b'-' => Mode::Num(Num::Minus),
            b'0' => Mode::Num(Num::Zero),
            b'1'..=b'9' => Mode::Num(Num::Int),
            b't' => Mode::Lit { which: 0, at: 1 },
            b'f' => Mode::Lit { which: 1, at: 1 },
            b'n' => Mode::Lit { which: 2, at: 1 },
            _ => return false,
        };
        true
    }

    fn number(&mut self, n: Num, b: u8) -> bool {
        let digit = b.is_ascii_digit();
        let next = match (n, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, _) if digit => Num::Int,
            (Num::Int, _) if digit => Num::Int,
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Dot | Num::Frac, _) if digit => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::E,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exp, _) if digit => Num::Exp,
            // A complete number ends at the first byte that cannot extend it, which is then
            // read as what follows the value.
            (Num::Zero | Num::Int | Num::Frac | Num::Exp, _) => {
                self.value_done();
                return self.feed(b);
            }
            _ => return false,
        };
        self.mode = Mode::Num(next);
        true
    }
}

/// Sets to `-inf` every logit whose token cannot come next in a JSON-mode output at `state`:
/// tokens whose bytes `state` does not accept, special tokens, and end-of-sequence tokens
/// until the object is complete; once it is, every token but end-of-sequence (and, where
/// `ignore_eos`, whitespace). Returns how many tokens remain possible.
pub fn mask(state: &JsonState, tok: &Tokenizer, ignore_eos: bool, logits: &mut [f32]) -> usize {
    let eos = tok.eos_ids();
    let done = state.complete();
    let vocab = tok.vocab_size();
    logits
        .par_chunks_mut(4096)
        .enumerate()
        .map(|(c, chunk)| {
            let mut kept = 0;
            for (j, l) in chunk.iter_mut().enumerate() {
                let id = (c * 4096 + j) as u32;
                let ok = if (id as usize) >= vocab {
                    false
                } else if eos.contains(&id) {
                    done && !ignore_eos
                } else if tok.is_special(id) || (done && !ignore_eos) {
                    false
                } else {
                    let bytes = tok.token_bytes(id);
                    !bytes.is_empty() && state.accepts(bytes)
                };
                if ok {
                    kept += 1;
                } else {
                    *l = f32::NEG_INFINITY;
                }
            }
            kept
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(s: &str) -> bool {
        let mut st = JsonState::default();
        s.bytes().all(|b| st.feed(b)) && st.complete()
    }

    fn prefix_ok(s: &str) -> bool {
        JsonState::default().accepts(s.as_bytes())
    }

    #[test]
    fn whole_objects() {
        for s in [
            "{}",
            " { } ",
            r#"{"a": 1}"#,
            r#"{"a": -0.5e+10, "b": [true, false, null, "x\"y\\u00e9"], "c": {"d": []}}"#,
            "{\"k\":\n[1,2 ,3]}\n",
            r#"{"é": "ü ✓"}"#,
            r#"{"n": 0, "m": 10.25E-3}"#,
        ] {
            assert!(valid(s), "{s}");
        }
    }

    #[test]
    fn not_objects() {
        for s in [
            "[]",
            "1",
            "\"x\"",
            "{",
            "{\"a\"}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":-}",
            "{\"a\":tru}",
            "{\"a\":[1,]}",
            "{\"a\":[1}",
            "{a:1}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12g4\"}",
            "{\"a\":\"line\nbreak\"}",
            "{}x",
            "{}{}",
        ] {
            assert!(!valid(s), "{s}");
        }
    }

    /// Prefixes: what a token may continue, including numbers ending at a delimiter inside
    /// the same token and literals split over tokens.
    #[test]
    fn prefixes_and_splits() {
        assert!(prefix_ok(""));
        assert!(prefix_ok("  {"));
        assert!(!prefix_ok("Sure"));
        assert!(prefix_ok("{\"ke"));
        assert!(prefix_ok("{\"a\": 12"));
        assert!(prefix_ok("{\"a\": 12}"));
        assert!(prefix_ok("{\"a\": fa"));
        assert!(!prefix_ok("{\"a\": fx"));
        let mut s = JsonState::default();
        for piece in ["{\"a", "\": [1", "2, tr", "ue], \"b\": \"\\u00", "e9\"}"] {
            assert!(s.accepts(piece.as_bytes()), "{piece}");
            piece.bytes().for_each(|b| assert!(s.feed(b)));
        }
        assert!(s.complete());
        assert!(s.accepts(b" \n"));
        assert!(!s.accepts(b","));
    }

    #[test]
    fn nesting_is_bounded() {
        let deep = "{\"a\":".to_string() + &"[".repeat(MAX_DEPTH - 1);
        assert!(prefix_ok(&deep));
        assert!(!prefix_ok(&(deep + "[")));
    }
}
