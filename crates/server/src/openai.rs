//! OpenAI request and response shapes, request validation, and the OpenAI error format.
//!
//! Requests are parsed leniently where OpenAI clients differ (unknown fields are ignored,
//! `null` means "not given") and strictly where a wrong value would silently change the
//! answer (wrong types, out-of-range numbers, `n` beyond [`MAX_CHOICES`]): those get a 400
//! naming the field.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

use ferrite_engine::json_mode::{schema_of_response_format, Schema};
use ferrite_engine::scheduler::RequestParams;
use ferrite_engine::SamplerConfig;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};

/// An error in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
    /// Seconds for a `Retry-After` header (429/503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 `invalid_request_error`, naming the offending parameter.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e = ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            message.into(),
        );
        e.param = Some(param.to_string());
        e
    }

    pub fn with_code(mut self, code: &str) -> Self {
        self.code = Some(code.to_string());
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert("retry-after", s.to_string().parse().expect("digits"));
        }
        r
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Message content: a string or a list of parts (only text parts are supported).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct InMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's earlier tool calls (OpenAI's shape), replayed by the template.
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn's call id and tool name.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling and length parameters shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub model: String,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Only `{"type": "text"}` (the default): output is not constrained to JSON or a schema,
    /// and a request that asks for it is refused rather than answered unconstrained.
    #[serde(default)]
    pub response_format: Option<Value>,
    /// Not supported: refused unless empty, rather than ignored.
    #[serde(default)]
    pub logit_bias: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub common: Common,
    pub messages: Vec<InMessage>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// Kept as raw JSON so the template sees the keys in the order the client wrote them.
    #[serde(default)]
    pub tools: Option<Box<RawValue>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Further variables for the chat template, as vLLM and llama-server take them (e.g.
    /// `{"enable_thinking": false}` for Qwen3).
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// `prompt`: a string, a list of token ids, or a one-element list of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<i64>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<i64>>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub common: Common,
    pub prompt: Prompt,
    /// Number of alternatives per position (0..=5 as OpenAI; up to 20 here).
    #[serde(default)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: Option<bool>,
}

/// The most alternatives `top_logprobs` / `logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// The most stop strings per request.
pub const MAX_STOPS: usize = 16;
/// Most choices (`n`) one request may ask for: each is a sequence of its own in the batch,
/// with seed `seed + i` when a seed is given.
pub const MAX_CHOICES: usize = 8;

/// Parses a JSON body into `T`, mapping syntax and type errors to a 400.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "malformed JSON in the request body"
        } else {
            "invalid request"
        };
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("{what}: {e}"),
        )
    })
}

impl Common {
    /// Checks everything that does not need the prompt; returns the requested length (if
    /// any) and the sampling parameters.
    pub fn validate(
        &self,
        served_model: &str,
        max_context: usize,
        vocab: usize,
    ) -> Result<(Option<usize>, RequestParams), ApiError> {
        if self.model != served_model {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "The model `{}` does not exist; this server serves `{served_model}`",
                    self.model
                ),
            )
            .with_code("model_not_found"));
        }
        // JSON output: one object (json_object) or one object of a schema (json_schema),
        // held to it by the engine (json_mode.rs).
        let mut json = None;
        if let Some(f) = self.response_format.as_ref().filter(|f| !f.is_null()) {
            let ty = f.get("type").and_then(Value::as_str);
            match ty {
                Some("text") => {}
                Some("json_object") => json = Some(Arc::new(Schema::any_object())),
                Some("json_schema") => {
                    let spec = f.get("json_schema").unwrap_or(&Value::Null);
                    let schema = schema_of_response_format(spec).map_err(|e| {
                        ApiError::invalid("response_format", format!("json_schema: {e:#}"))
                    })?;
                    json = Some(Arc::new(schema));
                }
                _ => {
                    return Err(ApiError::invalid(
                        "response_format",
                        format!(
                            "response_format type {} is not supported (\"text\", \
                             \"json_object\" and \"json_schema\" are)",
                            ty.map_or_else(|| f.to_string(), |t| format!("\"{t}\""))
                        ),
                    ));
                }
            }
        }
        let logit_bias = logit_bias(self.logit_bias.as_ref(), vocab)?;
        if let Some(n) = self.n {
            if !(1..=MAX_CHOICES as i64).contains(&n) {
                return Err(ApiError::invalid(
                    "n",
                    format!("n = {n} is out of range: 1 to {MAX_CHOICES} choices"),
                ));
            }
        }
        let (param, max) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, m) => ("max_tokens", m),
        };
        let max_tokens = match max {
            None => None,
            Some(m) if m < 1 => {
                return Err(ApiError::invalid(
                    param,
                    format!("{param} must be at least 1, got {m}"),
                ))
            }
            Some(m) if m as u64 >= max_context as u64 => {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "{param} = {m} is too large: the context is {max_context} tokens, prompt included"
                    ),
                ))
            }
            Some(m) => Some(m as usize),
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be in [0, 2], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid(
                "min_p",
                format!("min_p must be in [0, 1], got {min_p}"),
            ));
        }
        // -1 and 0 both mean "off" (vLLM uses -1).
        let top_k = match self.top_k.unwrap_or(0) {
            k if k < -1 => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1, 0 (off) or positive, got {k}"),
                ))
            }
            k => k.max(0) as usize,
        };
        let penalty = |name: &str, v: Option<f32>| -> Result<f32, ApiError> {
            let v = v.unwrap_or(0.0);
            if !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::invalid(
                    name,
                    format!("{name} must be in [-2, 2], got {v}"),
                ));
            }
            Ok(v)
        };
        let presence_penalty = penalty("presence_penalty", self.presence_penalty)?;
        let frequency_penalty = penalty("frequency_penalty", self.frequency_penalty)?;
        let stop = match &self.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOPS} stop strings, got {}", stop.len()),
            ));
        }
        let params = RequestParams {
            max_tokens: max_tokens.unwrap_or(0),
            sampler: SamplerConfig {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty: 1.0,
                presence_penalty,
                frequency_penalty,
                seed: self.seed.map(|s| s as u64),
                logit_bias,
            },
            stop,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs: None,
            json,
        };
        Ok((max_tokens, params))
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Choices asked for (`n`, validated by [`Self::validate`]).
    pub fn choices(&self) -> usize {
        self.n
            .map_or(1, |n| n.clamp(1, MAX_CHOICES as i64) as usize)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// Settles `max_tokens` against the prompt length: the default is the rest of the context;
/// a prompt that leaves no room, or an explicit `max_tokens` that does not fit, is a 400
/// with the numbers. `input`: the request field the prompt came from (`messages` for chat,
/// `prompt` for completions), named as the error's `param`.
pub fn fit_length(
    input: &'static str,
    prompt_tokens: usize,
    max_tokens: Option<usize>,
    max_context: usize,
) -> Result<usize, ApiError> {
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(input, "the prompt is empty"));
    }
    if prompt_tokens >= max_context {
        return Err(ApiError::invalid(
            input,
            format!(
                "This model's maximum context length is {max_context} tokens. However, your prompt is {prompt_tokens} tokens, which leaves no room for a completion. Please shorten the prompt."
            ),
        )
        .with_code("context_length_exceeded"));
    }
    match max_tokens {
        None => Ok(max_context - prompt_tokens),
        Some(m) if prompt_tokens + m > max_context => Err(ApiError::invalid(
            "max_tokens",
            format!(
                "This model's maximum context length is {max_context} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {m} for the completion). Please reduce the prompt or max_tokens.",
                prompt_tokens + m
            ),
        )
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m),
    }
}

impl ChatRequest {
    /// Messages as the chat template wants them.
    pub fn messages(&self) -> Result<Vec<ferrite_tokenizer::ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "messages must hold at least one message",
            ));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = match m.role.as_str() {
                    "system" | "user" | "assistant" | "tool" => m.role.clone(),
                    "developer" => "system".to_string(),
                    r => {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].role"),
                            format!(
                                "unknown role `{r}` (system, developer, user, assistant or tool)"
                            ),
                        ))
                    }
                };
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut s = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => s.push_str(t),
                                (k, _) => {
                                    return Err(ApiError::invalid(
                                        &format!("messages[{i}].content"),
                                        format!(
                                        "content part of type `{k}` is not supported (text only)"
                                    ),
                                    ))
                                }
                            }
                        }
                        s
                    }
                };
                if let Some(tc) = &m.tool_calls {
                    if !tc.is_array() {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].tool_calls"),
                            "tool_calls must be an array",
                        ));
                    }
                }
                let mut msg = ferrite_tokenizer::ChatMessage::new(role, content);
                msg.tool_calls = m.tool_calls.clone();
                msg.tool_call_id = m.tool_call_id.clone();
                msg.name = m.name.clone();
                Ok(msg)
            })
            .collect()
    }

    /// `Some(k)` when log-probabilities are asked for.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        let top = self.top_logprobs.unwrap_or(0);
        if !(0..=MAX_TOP_LOGPROBS).contains(&top) {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}"),
            ));
        }
        if self.logprobs.unwrap_or(false) {
            Ok(Some(top as usize))
        } else if self.top_logprobs.is_some_and(|t| t > 0) {
            Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        } else {
            Ok(None)
        }
    }

    /// The tool definitions as JSON text, when tools are given and not switched off.
    /// `chat_template_kwargs`, checked: `enable_thinking`, where given, is a boolean.
    pub fn template_kwargs(&self) -> Result<serde_json::Map<String, Value>, ApiError> {
        let kw = self.chat_template_kwargs.clone().unwrap_or_default();
        if kw.get("enable_thinking").is_some_and(|v| !v.is_boolean()) {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                "chat_template_kwargs.enable_thinking must be true or false",
            ));
        }
        Ok(kw)
    }

    pub fn tools_json(&self) -> Result<Option<String>, ApiError> {
        let Some(raw) = &self.tools else {
            return Ok(None);
        };
        let v: Value = serde_json::from_str(raw.get())
            .map_err(|e| ApiError::invalid("tools", format!("tools: {e}")))?;
        match &v {
            Value::Null => return Ok(None),
            Value::Array(a) if a.is_empty() => return Ok(None),
            Value::Array(_) => {}
            _ => return Err(ApiError::invalid("tools", "tools must be an array")),
        }
        match self.tool_choice.as_ref() {
            None | Some(Value::Null) => {}
            Some(c) if c.as_str() == Some("none") => return Ok(None),
            Some(c) if c.as_str() == Some("auto") => {}
            // "required" or a named function: a call would have to be forced.
            Some(c) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice {c} is not supported: ferrite cannot force a tool call \
                         (\"auto\" and \"none\" are)"
                    ),
                ))
            }
        }
        Ok(Some(raw.get().to_string()))
    }
}

impl CompletionRequest {
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match self.logprobs {
            None => Ok(None),
            Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Ok(Some(k as usize)),
            Some(k) => Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}"),
            )),
        }
    }
}

/// The prompt of a completion request: text to tokenize, or token ids checked against the
/// vocabulary.
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

impl Prompt {
    pub fn input(&self, vocab: usize) -> Result<PromptInput, ApiError> {
        let ids = |v: &[i64]| -> Result<Vec<u32>, ApiError> {
            v.iter()
                .map(|&t| {
                    if t < 0 || t as u64 >= vocab as u64 {
                        Err(ApiError::invalid(
                            "prompt",
                            format!("token id {t} is outside the vocabulary (0..{vocab})"),
                        ))
                    } else {
                        Ok(t as u32)
                    }
                })
                .collect()
        };
        let many = || ApiError::invalid("prompt", "only one prompt per request is supported");
        match self {
            Prompt::Text(s) => Ok(PromptInput::Text(s.clone())),
            Prompt::Tokens(v) => Ok(PromptInput::Tokens(ids(v)?)),
            Prompt::Texts(v) if v.len() == 1 => Ok(PromptInput::Text(v[0].clone())),
            Prompt::TokenLists(v) if v.len() == 1 => Ok(PromptInput::Tokens(ids(&v[0])?)),
            _ => Err(many()),
        }
    }
}

/// Most entries of a `logit_bias` map.
const MAX_LOGIT_BIAS: usize = 1024;

/// OpenAI's `logit_bias`: `{"token id": bias}` with biases in [-100, 100], ids in the
/// vocabulary; sorted by id.
fn logit_bias(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid("logit_bias", m);
    let m = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("logit_bias must be an object of token id → bias".into())),
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(bad(format!(
            "at most {MAX_LOGIT_BIAS} logit_bias entries, got {}",
            m.len()
        )));
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, b) in m {
        let id: u32 = k
            .parse()
            .map_err(|_| bad(format!("logit_bias key \"{k}\" is not a token id")))?;
        if id as usize >= vocab {
            return Err(bad(format!(
                "logit_bias token id {id} is outside the vocabulary (0..{vocab})"
            )));
        }
        let b = b
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias of token {id} must be a number in [-100, 100], got {b}"
                ))
            })?;
        out.push((id, b as f32));
    }
    out.sort_by_key(|e| e.0);
    Ok(out)
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// OpenAI's breakdown of the prompt: `cached_tokens` came from the prefix cache.
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl From<ferrite_engine::scheduler::Usage> for UsageOut {
    fn from(u: ferrite_engine::scheduler::Usage) -> Self {
        UsageOut {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

/// A tool call the model wrote.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's format).
    pub arguments: String,
}

/// Splits Qwen3/Hermes-style output into plain content and the `<tool_call>{"name": ..,
/// "arguments": {..}}</tool_call>` blocks. A block that does not parse stays in the content.
pub fn parse_tool_calls(text: &str, id_prefix: &str) -> (String, Vec<ToolCall>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(a) = rest.find(OPEN) {
        let after = &rest[a + OPEN.len()..];
        // An unterminated block (generation stopped inside it) is parsed to the end.
        let (inner, next) = match after.find(CLOSE) {
            Some(b) => (&after[..b], &after[b + CLOSE.len()..]),
            None => (after, ""),
        };
        let parsed = serde_json::from_str::<Value>(inner.trim())
            .ok()
            .and_then(|v| {
                let name = v.get("name")?.as_str()?.to_string();
                let args = match v.get("arguments").or_else(|| v.get("parameters")) {
                    Some(Value::String(s)) => s.clone(),
                    Some(a) => a.to_string(),
                    None => "{}".to_string(),
                };
                Some((name, args))
            });
        match parsed {
            Some((name, arguments)) => {
                content.push_str(&rest[..a]);
                calls.push(ToolCall {
                    id: format!("{id_prefix}{}", calls.len()),
                    kind: "function",
                    function: FunctionCall { name, arguments },
                });
            }
            None => content.push_str(&rest[..a + OPEN.len() + inner.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(extra: Value) -> Result<(Option<usize>, RequestParams), ApiError> {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        let r: ChatRequest = parse(v.to_string().as_bytes())?;
        r.common.validate("m", 100, 1000)
    }

    #[test]
    fn malformed_and_mistyped_bodies_are_400() {
        let e = parse::<ChatRequest>(b"{\"model\": ").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("malformed JSON"), "{}", e.message);
        let e = parse::<ChatRequest>(br#"{"model": "m", "messages": "hi"}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = common(json!({"max_tokens": "ten"})).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse::<ChatRequest>(br#"{"messages": []}"#).unwrap_err();
        assert!(e.message.contains("model"), "{}", e.message);
    }

    #[test]
    fn validation_errors_name_the_parameter() {
        let cases = [
            (json!({"n": 0}), "n"),
            (json!({"n": MAX_CHOICES as i64 + 1}), "n"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_tokens": -5}), "max_tokens"),
            (json!({"max_tokens": 1_000_000}), "max_tokens"),
            (json!({"max_completion_tokens": 0}), "max_completion_tokens"),
            (json!({"temperature": 3.0}), "temperature"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"presence_penalty": 5.0}), "presence_penalty"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema":
                    {"name": "x", "schema": {"type": "object", "properties":
                        {"a": {"type": "string", "pattern": "^a"}}}}}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format",
            ),
            (json!({"response_format": "json"}), "response_format"),
            // Outside the vocabulary (1000 here), out of range, not an id, not a number.
            (json!({"logit_bias": {"50256": -100}}), "logit_bias"),
            (json!({"logit_bias": {"5": 150}}), "logit_bias"),
            (json!({"logit_bias": {"five": 1}}), "logit_bias"),
            (json!({"logit_bias": {"5": "1"}}), "logit_bias"),
            (json!({"logit_bias": [5, 1]}), "logit_bias"),
        ];
        for (extra, param) in cases {
            let e = common(extra.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{extra}");
            assert_eq!(e.param.as_deref(), Some(param), "{extra}");
            let body = e.body();
            assert!(body["error"]["message"].is_string());
            assert_eq!(body["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn chat_template_kwargs_are_an_object_with_a_boolean_enable_thinking() {
        let r: ChatRequest = parse(
            br#"{"model": "m", "messages": [],
                 "chat_template_kwargs": {"enable_thinking": false, "custom": [1, 2]}}"#,
        )
        .unwrap();
        let kw = r.template_kwargs().unwrap();
        assert_eq!(kw["enable_thinking"], json!(false));
        assert_eq!(kw["custom"], json!([1, 2]));
        let r: ChatRequest = parse(
            br#"{"model": "m", "messages": [], "chat_template_kwargs": {"enable_thinking": "no"}}"#,
        )
        .unwrap();
        let e = r.template_kwargs().unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("chat_template_kwargs"));
        let e = parse::<ChatRequest>(
            br#"{"model": "m", "messages": [], "chat_template_kwargs": [true]}"#,
        )
        .unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn tool_choice_auto_and_none_only() {
        let tools = r#"[{"type": "function", "function": {"name": "f", "parameters": {}}}]"#;
        let req = |choice: &str| -> ChatRequest {
            let body = format!(
                r#"{{"model": "m", "messages": [], "tools": {tools}, "tool_choice": {choice}}}"#
            );
            parse(body.as_bytes()).unwrap()
        };
        assert!(req("\"auto\"").tools_json().unwrap().is_some());
        assert!(req("null").tools_json().unwrap().is_some());
        assert!(req("\"none\"").tools_json().unwrap().is_none());
        for forced in [
            "\"required\"",
            r#"{"type": "function", "function": {"name": "f"}}"#,
        ] {
            let e = req(forced).tools_json().unwrap_err();
            assert_eq!(e.param.as_deref(), Some("tool_choice"), "{forced}");
        }
    }

    #[test]
    fn text_response_format_and_empty_logit_bias_are_accepted() {
        for extra in [
            json!({"response_format": {"type": "text"}}),
            json!({"response_format": null}),
            json!({"logit_bias": {}}),
            json!({"logit_bias": null}),
        ] {
            assert!(common(extra.clone()).is_ok(), "{extra}");
        }
    }

    #[test]
    fn json_formats_ask_for_json_output() {
        let (_, p) = common(json!({"response_format": {"type": "json_object"}})).unwrap();
        assert_eq!(p.json.as_deref(), Some(&Schema::any_object()));
        let (_, p) = common(
            json!({"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "strict": true,
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                       "required": ["a"], "additionalProperties": false}}}}),
        )
        .unwrap();
        assert!(p.json.is_some());
        let (_, p) = common(json!({"response_format": {"type": "text"}})).unwrap();
        assert!(p.json.is_none());
    }

    #[test]
    fn logit_bias_maps_to_the_sampler() {
        let (_, p) = common(json!({"logit_bias": {"7": 2.5, "5": -100}})).unwrap();
        assert_eq!(p.sampler.logit_bias, vec![(5, -100.0), (7, 2.5)]);
        assert!(
            !p.sampler.no_penalties(),
            "biased requests sample from host logits"
        );
    }

    #[test]
    fn unknown_model_is_404() {
        let r: ChatRequest = parse(br#"{"model": "gpt-4", "messages": []}"#).unwrap();
        let e = r.common.validate("m", 100, 1000).unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(e.code.as_deref(), Some("model_not_found"));
    }

    #[test]
    fn good_parameters_map_to_the_sampler() {
        let (max, p) = common(json!({
            "max_tokens": 10, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "seed": 7, "stop": "\n", "presence_penalty": 0.5, "frequency_penalty": 0.25, "n": 1
        }))
        .unwrap();
        assert_eq!(max, Some(10));
        assert_eq!(p.sampler.temperature, 0.5);
        assert_eq!(p.sampler.top_k, 40);
        assert_eq!(p.sampler.seed, Some(7));
        assert_eq!(p.stop, vec!["\n".to_string()]);
        assert_eq!(p.sampler.frequency_penalty, 0.25);
        let (_, p) = common(json!({"stop": ["a", "b"], "top_k": -1})).unwrap();
        assert_eq!(p.stop.len(), 2);
        assert_eq!(p.sampler.top_k, 0);
        let (max, _) = common(json!({"max_completion_tokens": 3, "max_tokens": 50})).unwrap();
        assert_eq!(max, Some(3), "max_completion_tokens wins");
    }

    #[test]
    fn tool_round_trip_messages_reach_the_template() {
        let r: ChatRequest = parse(
            br#"{"model": "m", "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C"}]}"#,
        )
        .unwrap();
        let m = r.messages().unwrap();
        let calls = m[1].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(m[2].role, "tool");
        assert_eq!(m[2].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(m[2].name.as_deref(), Some("get_weather"));
        let bad: ChatRequest = parse(
            br#"{"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": {"x": 1}}]}"#,
        )
        .unwrap();
        assert_eq!(bad.messages().unwrap_err().status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn messages_roles_and_parts() {
        let r: ChatRequest = parse(
            br#"{"model": "m", "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}]}"#,
        )
        .unwrap();
        let m = r.messages().unwrap();
        assert_eq!(m[0].role, "system");
        assert_eq!(m[1].content, "ab");
        assert_eq!(m[2].content, "");
        let r: ChatRequest = parse(br#"{"model": "m", "messages": []}"#).unwrap();
        assert_eq!(r.messages().unwrap_err().param.as_deref(), Some("messages"));
        let r: ChatRequest =
            parse(br#"{"model": "m", "messages": [{"role": "robot", "content": "x"}]}"#).unwrap();
        assert_eq!(r.messages().unwrap_err().status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn prompt_length_against_the_context() {
        assert_eq!(fit_length("prompt", 10, None, 100).unwrap(), 90);
        assert_eq!(fit_length("prompt", 10, Some(5), 100).unwrap(), 5);
        let e = fit_length("messages", 100, None, 100).unwrap_err();
        assert!(e.message.contains("100 tokens"), "{}", e.message);
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = fit_length("prompt", 100, None, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = fit_length("prompt", 60, Some(50), 100).unwrap_err();
        assert!(e.message.contains("110"), "{}", e.message);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(fit_length("prompt", 0, None, 100).is_err());
    }

    #[test]
    fn prompts_as_text_or_tokens() {
        let p: Prompt = serde_json::from_str("[1, 2, 3]").unwrap();
        assert!(matches!(p.input(10).unwrap(), PromptInput::Tokens(t) if t == vec![1, 2, 3]));
        let p: Prompt = serde_json::from_str("[1, 20]").unwrap();
        assert!(p.input(10).is_err());
        let p: Prompt = serde_json::from_str(r#"["a", "b"]"#).unwrap();
        assert!(p.input(10).is_err());
        let p: Prompt = serde_json::from_str(r#"["a"]"#).unwrap();
        assert!(matches!(p.input(10).unwrap(), PromptInput::Text(t) if t == "a"));
    }

    #[test]
    fn tool_calls_are_parsed_out_of_the_text() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (content, calls) = parse_tool_calls(text, "call_");
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls[0].id, "call_0");
        let (content, calls) = parse_tool_calls("<tool_call>not json</tool_call> x", "c");
        assert!(calls.is_empty());
        assert!(content.contains("not json"));
        let (content, calls) = parse_tool_calls("no tools here", "c");
        assert_eq!((content.as_str(), calls.len()), ("no tools here", 0));
    }

    #[test]
    fn logprob_limits() {
        let r: ChatRequest =
            parse(br#"{"model": "m", "messages": [], "logprobs": true, "top_logprobs": 3}"#)
                .unwrap();
        assert_eq!(r.logprobs().unwrap(), Some(3));
        let r: ChatRequest =
            parse(br#"{"model": "m", "messages": [], "logprobs": true, "top_logprobs": 50}"#)
                .unwrap();
        assert!(r.logprobs().is_err());
    }
}
