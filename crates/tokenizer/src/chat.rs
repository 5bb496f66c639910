//! Chat templates: the Jinja programs models ship (`tokenizer_config.json` → `chat_template`,
//! GGUF → `tokenizer.chat_template`) that turn a conversation into the prompt text.
//!
//! Rendered with minijinja, set up to match what Hugging Face transformers does with jinja2:
//! `trim_blocks` and `lstrip_blocks` on, Python string/list/dict methods (`.strip()`,
//! `.startswith()`, `.split()`, ...) through minijinja-contrib's pycompat, and the globals
//! transformers adds: `raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` that writes
//! Python's `json.dumps` format (`", "` and `": "` separators, non-ASCII kept, no HTML
//! escaping, keys in the order given) instead of minijinja's HTML-safe compact JSON.
//! `crates/tokenizer/tools/chat_template_check.py` renders the same cases with jinja2 as the
//! independent oracle the tests compare against.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::{Result, TokenizerError};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Earlier reasoning of an assistant turn, for templates that handle it (Qwen3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The tool calls an assistant turn made, in OpenAI's shape
    /// (`[{"type": "function", "function": {"name", "arguments"}}]`; `arguments` a JSON
    /// string or object), for templates that replay them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// For `tool` turns: which call this is the result of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For `tool` turns: the tool's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// Everything a template may read besides the messages.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// End with the header of an assistant turn, so the model writes the answer.
    pub add_generation_prompt: bool,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Qwen3's switch; left undefined in the template when `None`.
    pub enable_thinking: Option<bool>,
    /// The tool definitions as JSON text (an array). Text rather than a parsed value so that
    /// the key order the caller wrote is the order `tojson` writes, as with HF's Python dicts.
    pub tools: Option<String>,
    /// Further template variables (a request's `chat_template_kwargs`, as vLLM and
    /// llama-server take them), e.g. `enable_thinking` where `enable_thinking` above is
    /// `None`. They cannot replace `messages`, `tools`, `add_generation_prompt` or the
    /// special tokens.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; syntax errors are reported here, not at render time.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(template_err)?;
        Ok(ChatTemplate { env })
    }

    /// Renders a conversation into prompt text.
    pub fn render(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        let tools =
            match &opts.tools {
                Some(text) => Some(serde_json::from_str::<Value>(text).map_err(|e| {
                    TokenizerError::Template(format!("tools is not valid JSON: {e}"))
                })?),
                None => None,
            };
        let enable_thinking = match (opts.enable_thinking, opts.kwargs.get("enable_thinking")) {
            (Some(on), _) => Value::from(on),
            (None, Some(v)) => Value::from_serialize(v),
            (None, None) => Value::UNDEFINED,
        };
        // Left to right: the keys above win over the kwargs'.
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => opts.add_generation_prompt,
            bos_token => opts.bos_token.clone().unwrap_or_default(),
            eos_token => opts.eos_token.clone().unwrap_or_default(),
            enable_thinking => enable_thinking,
            tools => tools.unwrap_or(Value::UNDEFINED),
            ..Value::from_serialize(&opts.kwargs)
        };
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(template_err)?;
        tmpl.render(ctx).map_err(template_err)
    }
}

fn template_err(e: Error) -> TokenizerError {
    // minijinja's Display has the kind and the detail; the source chain names the line.
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    TokenizerError::Template(msg)
}

/// `raise_exception(msg)`: templates call it to reject a conversation they cannot format.
fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: the current UTC date/time formatted with a subset of strftime
/// (`%Y %y %m %d %e %H %M %S %j %B %b %A %a %p %I %%`) — what chat templates use for
/// "Today Date: 26 Jul 2024" lines.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&fmt, secs)
}

pub(crate) fn strftime(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (sod / 3600, sod % 3600 / 60, sod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let month = MONTHS[(m - 1) as usize];
    let day_name = DAYS[weekday];

    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 })),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('%') => out.push('%'),
            // Unknown directive: keep it literally, as C's strftime does on most platforms.
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, indent, sort_keys.unwrap_or(false), 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
) -> std::result::Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    // Python's separators: ", " between items without indent, "," with it; ": " always.
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(f) = v
                .as_i64()
                .is_none()
                .then(|| f64::try_from(v.clone()).ok())
                .flatten()
            {
                out.push_str(&python_float(f));
            } else {
                out.push_str(&v.to_string());
            }
        }
        ValueKind::String => out.push_str(&json_string(v.as_str().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, sort_keys, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                out.push_str(&json_string(&key));
                out.push_str(": ");
                write_json(out, &v.get_item(k)?, indent, sort_keys, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => out.push_str(&json_string(&v.to_string())),
    }
    Ok(())
}

/// A JSON string literal as Python writes it with `ensure_ascii=False` (same escapes as
/// serde_json: quote, backslash and control characters).
fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

/// Python's `repr(float)`: shortest round-trip digits, always with a `.` or exponent.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let s = format!("{f:?}");
    if s.contains('.') || s.contains('e') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2024-07-26 00:00:00 UTC, a Friday.
        assert_eq!(strftime("%d %b %Y", 1_721_952_000), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %j %H:%M:%S %%", 1_721_952_000 + 3661),
            "Friday July 208 01:01:01 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
    }

    #[test]
    fn tojson_is_pythonic() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}").unwrap();
        let env_val = serde_json::from_str::<Value>(r#"{"b": [1, 2.5, "é<"], "a": null}"#).unwrap();
        let out = t
            .env
            .get_template(TEMPLATE_NAME)
            .unwrap()
            .render(minijinja::context! { x => env_val })
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"é<\"], \"a\": null}|{\n  \"b\": [\n    1,\n    2.5,\n    \"é<\"\n  ],\n  \"a\": null\n}"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let err = t.render(&[], &RenderOptions::default()).unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }
}
