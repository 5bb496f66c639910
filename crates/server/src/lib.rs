//! The OpenAI-compatible HTTP API: request/response types ([`openai`]) and axum handlers.
//!
//! Generation itself happens in the engine's scheduler thread ([`Scheduler`]); a handler
//! validates the request, renders and tokenizes the prompt, submits it and turns the
//! scheduler's events into an OpenAI response or an SSE stream. When a client goes away
//! (connection closed mid-stream, or a non-streaming request abandoned), the event receiver
//! is dropped and the scheduler frees the sequence at its next iteration.

pub mod metrics;
pub mod openai;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferrite_engine::scheduler::{
    Event, EventSink, Request, RequestParams, Scheduler, SubmitError, TokenLogprob, Usage,
};
use ferrite_engine::FinishReason;
use ferrite_tokenizer::{ChatTemplate, Tokenizer};
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::openai::{
    fit_length, parse, parse_tool_calls, ApiError, ChatRequest, CompletionRequest, PromptInput,
    UsageOut,
};

/// Server settings (the scheduler has its own).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model name clients must send (`/v1/models` lists it).
    pub model_id: String,
    /// When set, every route but `/health` needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Request bodies above this many bytes get a 413.
    pub max_body_bytes: usize,
}

/// Everything the handlers share.
pub struct AppState {
    sched: Scheduler,
    template: Option<ChatTemplate>,
    cfg: ServerConfig,
    metrics: Metrics,
    created: u64,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(sched: Scheduler, cfg: ServerConfig) -> anyhow::Result<Arc<AppState>> {
        let template = sched.tokenizer().compile_chat_template()?;
        if template.is_none() {
            tracing::warn!(
                "the model has no chat template: /v1/chat/completions will refuse requests"
            );
        }
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Arc::new(AppState {
            sched,
            template,
            cfg,
            metrics: Metrics::default(),
            created,
            next_id: AtomicU64::new(0),
        }))
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    fn tok(&self) -> &Tokenizer {
        self.sched.tokenizer()
    }

    fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        format!("{prefix}-{t:x}{n:06x}")
    }

    fn now(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(self.created, |d| d.as_secs())
    }
}

/// The routes, with the API-key check and the body-size limit.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then lets open requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

async fn auth(State(st): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            // Constant time in the key's content (a length mismatch returns early, which
            // reveals only the length).
            let ok: bool = given.as_bytes().ct_eq(key.as_bytes()).into();
            if !ok {
                let mut e = ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "invalid_request_error",
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                )
                .with_code("invalid_api_key");
                e.param = None;
                st.metrics.request(req.uri().path(), 401);
                return e.into_response();
            }
        }
    }
    next.run(req).await
}

async fn health() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

async fn not_found(req: HttpRequest) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("no route {} {}", req.method(), req.uri().path()),
    )
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(st.sched.stats()),
    )
}

async fn models(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.cfg.model_id,
            "object": "model",
            "created": st.created,
            "owned_by": "ferrite",
            "max_model_len": st.sched.config().max_context,
        }]
    }))
}

fn body_error(r: BytesRejection) -> ApiError {
    let status = r.status();
    let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "the request body is larger than the server accepts".to_string()
    } else {
        r.body_text()
    };
    ApiError::new(status, "invalid_request_error", msg)
}

/// Events with the time they were produced (for the latency histograms).
type Events = mpsc::UnboundedReceiver<(Event, Instant)>;

struct Sink(mpsc::UnboundedSender<(Event, Instant)>);

impl EventSink for Sink {
    fn send(&mut self, ev: Event) -> bool {
        self.0.send((ev, Instant::now())).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

fn submit(st: &AppState, prompt: Vec<u32>, params: RequestParams) -> Result<Events, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let req = Request {
        prompt,
        params,
        sink: Box::new(Sink(tx)),
    };
    st.sched.submit(req).map_err(|e| match e {
        SubmitError::QueueFull => {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "The server is at capacity (the waiting queue is full); retry later.",
            );
            e.retry_after = Some(1);
            e
        }
        SubmitError::Invalid(m) => ApiError::invalid("prompt", m),
        SubmitError::Stopped => {
            let mut e = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the server is shutting down",
            );
            e.retry_after = Some(5);
            e
        }
    })?;
    Ok(rx)
}

/// Submits `n` copies of a request (the choices of `n`): choice `i` samples with seed
/// `seed + i` when a seed is given. If one cannot be queued, the ones already queued are
/// dropped (their sinks close, so the scheduler frees them) and the error is returned.
fn submit_n(
    st: &AppState,
    prompt: Vec<u32>,
    params: RequestParams,
    n: usize,
) -> Result<Vec<Events>, ApiError> {
    (0..n)
        .map(|i| {
            let mut p = params.clone();
            p.sampler.seed = p.sampler.seed.map(|s| s.wrapping_add(i as u64));
            submit(st, prompt.clone(), p)
        })
        .collect()
}

/// Usage of `n` choices of one prompt: the prompt counted once, the completions summed.
fn total_usage(us: &[Usage]) -> Usage {
    Usage {
        prompt_tokens: us.first().map_or(0, |u| u.prompt_tokens),
        completion_tokens: us.iter().map(|u| u.completion_tokens).sum(),
        cached_tokens: us.first().map_or(0, |u| u.cached_tokens),
    }
}

/// Records latencies and token counts as events go by.
struct Tracker<'a> {
    metrics: &'a Metrics,
    start: Instant,
    last: Option<Instant>,
}

impl Tracker<'_> {
    fn token(&mut self, at: Instant) {
        match self.last {
            None => self
                .metrics
                .ttft
                .observe(at.duration_since(self.start).as_secs_f64()),
            Some(l) => self.metrics.itl.observe(at.duration_since(l).as_secs_f64()),
        }
        self.last = Some(at);
        self.metrics
            .generation_tokens
            .fetch_add(1, Ordering::Relaxed);
    }
    fn done(&mut self, u: &Usage) {
        self.metrics
            .prompt_tokens
            .fetch_add(u.prompt_tokens as u64, Ordering::Relaxed);
    }
}

/// Which response shape to write.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat { tools: bool },
    Completion,
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn piece(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_bytes(id).to_vec();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// Chat `logprobs.content` entries.
fn chat_logprobs(tok: &Tokenizer, lps: &[(u32, TokenLogprob)]) -> Value {
    let entry = |id: u32, lp: f32| {
        let (t, b) = piece(tok, id);
        json!({"token": t, "logprob": lp, "bytes": b})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|(id, lp)| {
            let mut e = entry(*id, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(i, l)| entry(i, l)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// Completion `logprobs` (the legacy shape); `offset` is the text length before these tokens.
fn completion_logprobs(tok: &Tokenizer, lps: &[(u32, TokenLogprob)], offset: usize) -> Value {
    let mut tokens = vec![];
    let mut token_logprobs = vec![];
    let mut top = vec![];
    let mut text_offset = vec![];
    let mut off = offset;
    for (id, lp) in lps {
        let (t, _) = piece(tok, *id);
        text_offset.push(off);
        off += t.len();
        tokens.push(t);
        token_logprobs.push(lp.logprob);
        let m: serde_json::Map<String, Value> = lp
            .top
            .iter()
            .map(|&(i, l)| (piece(tok, i).0, json!(l)))
            .collect();
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset})
}

/// Everything a finished request produced.
struct Collected {
    text: String,
    logprobs: Vec<(u32, TokenLogprob)>,
    finish: FinishReason,
    usage: Usage,
}

async fn collect(st: &AppState, mut rx: Events, start: Instant) -> Result<Collected, ApiError> {
    let mut tr = Tracker {
        metrics: &st.metrics,
        start,
        last: None,
    };
    let mut text = String::new();
    let mut logprobs = vec![];
    while let Some((ev, at)) = rx.recv().await {
        match ev {
            Event::Token {
                id,
                text: t,
                logprob,
            } => {
                tr.token(at);
                text.push_str(&t);
                if let Some(lp) = logprob {
                    logprobs.push((id, lp));
                }
            }
            Event::Done {
                finish,
                text: t,
                usage,
            } => {
                tr.done(&usage);
                text.push_str(&t);
                return Ok(Collected {
                    text,
                    logprobs,
                    finish,
                    usage,
                });
            }
            Event::Error(m) => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    m,
                ))
            }
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the scheduler dropped the request",
    ))
}

async fn chat(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = chat_inner(&st, body, Instant::now()).await;
    let resp = r.unwrap_or_else(IntoResponse::into_response);
    st.metrics
        .request("/v1/chat/completions", resp.status().as_u16());
    resp
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = completions_inner(&st, body, Instant::now()).await;
    let resp = r.unwrap_or_else(IntoResponse::into_response);
    st.metrics
        .request("/v1/completions", resp.status().as_u16());
    resp
}

async fn chat_inner(
    st: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    start: Instant,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let req: ChatRequest = parse(&body)?;
    let ctx = st.sched.config().max_context;
    let (max, mut params) = req
        .common
        .validate(&st.cfg.model_id, ctx, st.tok().vocab_size())?;
    params.logprobs = req.logprobs()?;
    let msgs = req.messages()?;
    let tools = req.tools_json()?;
    let kwargs = req.template_kwargs()?;
    let tmpl = st.template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "messages",
            "this model has no chat template; use /v1/completions",
        )
    })?;
    let tok = st.tok();
    let mut opts = tok.render_options(true);
    opts.tools = tools.clone();
    opts.kwargs = kwargs;
    let text = tmpl
        .render(&msgs, &opts)
        .map_err(|e| ApiError::invalid("messages", format!("chat template: {e}")))?;
    // The rendered template holds every special token it wants.
    let prompt = tok
        .encode(&text, false, true)
        .map_err(|e| ApiError::invalid("messages", format!("tokenizing: {e}")))?;
    params.max_tokens = fit_length("messages", prompt.len(), max, ctx)?;
    let api = Api::Chat {
        tools: tools.is_some(),
    };
    let rxs = submit_n(st, prompt, params, req.common.choices())?;
    let id = st.new_id("chatcmpl");
    if req.common.stream() {
        return Ok(stream(
            st.clone(),
            rxs,
            start,
            api,
            id,
            req.common.include_usage(),
        ));
    }
    let mut choices = vec![];
    let mut usages = vec![];
    for (i, rx) in rxs.into_iter().enumerate() {
        let c = collect(st, rx, start).await?;
        let mut message = json!({"role": "assistant", "content": c.text});
        let mut finish = finish_str(c.finish);
        if let Api::Chat { tools: true } = api {
            let (content, calls) = parse_tool_calls(&c.text, &format!("call_{id}_{i}_"));
            if !calls.is_empty() {
                message["content"] = if content.is_empty() {
                    Value::Null
                } else {
                    json!(content)
                };
                message["tool_calls"] = json!(calls);
                finish = "tool_calls";
            }
        }
        let logprobs = (!c.logprobs.is_empty()).then(|| chat_logprobs(st.tok(), &c.logprobs));
        choices.push(json!({
            "index": i,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
        }));
        usages.push(c.usage);
    }
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": st.now(),
        "model": st.cfg.model_id,
        "choices": choices,
        "usage": UsageOut::from(total_usage(&usages)),
    }))
    .into_response())
}

async fn completions_inner(
    st: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    start: Instant,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let req: CompletionRequest = parse(&body)?;
    let ctx = st.sched.config().max_context;
    let (max, mut params) = req
        .common
        .validate(&st.cfg.model_id, ctx, st.tok().vocab_size())?;
    params.logprobs = req.logprobs()?;
    if req.echo.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    let tok = st.tok();
    let prompt = match req.prompt.input(tok.vocab_size())? {
        PromptInput::Tokens(t) => t,
        PromptInput::Text(s) => tok
            .encode(&s, true, false)
            .map_err(|e| ApiError::invalid("prompt", format!("tokenizing: {e}")))?,
    };
    params.max_tokens = fit_length("prompt", prompt.len(), max, ctx)?;
    let rxs = submit_n(st, prompt, params, req.common.choices())?;
    let id = st.new_id("cmpl");
    if req.common.stream() {
        return Ok(stream(
            st.clone(),
            rxs,
            start,
            Api::Completion,
            id,
            req.common.include_usage(),
        ));
    }
    let mut choices = vec![];
    let mut usages = vec![];
    for (i, rx) in rxs.into_iter().enumerate() {
        let c = collect(st, rx, start).await?;
        let logprobs =
            (!c.logprobs.is_empty()).then(|| completion_logprobs(st.tok(), &c.logprobs, 0));
        choices.push(json!({
            "index": i,
            "text": c.text,
            "logprobs": logprobs,
            "finish_reason": finish_str(c.finish),
        }));
        usages.push(c.usage);
    }
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": st.now(),
        "model": st.cfg.model_id,
        "choices": choices,
        "usage": UsageOut::from(total_usage(&usages)),
    }))
    .into_response())
}

/// Builds the SSE chunks of one request.
struct Chunker {
    api: Api,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl Chunker {
    fn wrap(&self, choices: Value, usage: Option<Value>) -> String {
        let object = match self.api {
            Api::Chat { .. } => "chat.completion.chunk",
            Api::Completion => "text_completion",
        };
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        format!("data: {v}\n\n")
    }

    /// A chunk of choice `index` carrying text (and the logprobs of its tokens), or its
    /// final one.
    fn delta(
        &self,
        index: usize,
        delta: Value,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> String {
        let choice = match self.api {
            Api::Chat { .. } => json!({
                "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
            }),
            Api::Completion => json!({
                "index": index,
                "text": delta.get("content").cloned().unwrap_or(json!("")),
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        self.wrap(json!([choice]), None)
    }
}

/// One choice's state while streaming.
struct ChoiceStream<'a> {
    tr: Tracker<'a>,
    /// Text held back to parse tool calls at the end (chat with tools).
    buffered: String,
    /// Bytes of text sent (completion logprobs' text offsets).
    offset: usize,
    usage: Option<Usage>,
}

/// Streams the events of a request's choices (one receiver each) as OpenAI server-sent
/// events: chunks of different choices interleave as their tokens arrive, each carrying its
/// choice index; the usage chunk and `[DONE]` follow the last choice's end.
fn stream(
    st: Arc<AppState>,
    rxs: Vec<Events>,
    start: Instant,
    api: Api,
    id: String,
    include_usage: bool,
) -> Response {
    let (tx, body_rx) = mpsc::channel::<Result<String, Infallible>>(64);
    let ch = Chunker {
        api,
        id: id.clone(),
        created: st.now(),
        model: st.cfg.model_id.clone(),
        include_usage,
    };
    tokio::spawn(async move {
        use tokio_stream::StreamExt;
        let n = rxs.len();
        let mut events = tokio_stream::StreamMap::new();
        for (i, rx) in rxs.into_iter().enumerate() {
            events.insert(i, tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
        }
        let mut choices: Vec<ChoiceStream> = (0..n)
            .map(|_| ChoiceStream {
                tr: Tracker {
                    metrics: &st.metrics,
                    start,
                    last: None,
                },
                buffered: String::new(),
                offset: 0,
                usage: None,
            })
            .collect();
        let tok = st.tok();
        let buffer_tools = matches!(api, Api::Chat { tools: true });
        let logprobs_of = |id: u32, lp: TokenLogprob, offset: usize| match api {
            Api::Chat { .. } => chat_logprobs(tok, &[(id, lp)]),
            Api::Completion => completion_logprobs(tok, &[(id, lp)], offset),
        };
        if let Api::Chat { .. } = api {
            for i in 0..n {
                let first = ch.delta(i, json!({"role": "assistant", "content": ""}), None, None);
                if tx.send(Ok(first)).await.is_err() {
                    return;
                }
            }
        }
        while let Some((i, (ev, at))) = events.next().await {
            let c = &mut choices[i];
            let mut out = vec![];
            match ev {
                Event::Token { id, text, logprob } => {
                    c.tr.token(at);
                    if buffer_tools {
                        c.buffered.push_str(&text);
                    } else if !text.is_empty() || logprob.is_some() {
                        let lp = logprob.map(|lp| logprobs_of(id, lp, c.offset));
                        c.offset += text.len();
                        out.push(ch.delta(i, json!({"content": text}), lp, None));
                    }
                }
                Event::Done {
                    finish,
                    text,
                    usage,
                } => {
                    c.tr.done(&usage);
                    c.usage = Some(usage);
                    let mut finish = finish_str(finish);
                    if buffer_tools {
                        c.buffered.push_str(&text);
                        let (content, calls) =
                            parse_tool_calls(&c.buffered, &format!("call_{id}_{i}_"));
                        let content = if calls.is_empty() {
                            c.buffered.clone()
                        } else {
                            content
                        };
                        if !content.is_empty() {
                            out.push(ch.delta(i, json!({"content": content}), None, None));
                        }
                        if !calls.is_empty() {
                            let calls: Vec<Value> = calls
                                .iter()
                                .enumerate()
                                .map(|(k, c)| {
                                    let mut v = json!(c);
                                    v["index"] = json!(k);
                                    v
                                })
                                .collect();
                            out.push(ch.delta(i, json!({"tool_calls": calls}), None, None));
                            finish = "tool_calls";
                        }
                    } else if !text.is_empty() {
                        out.push(ch.delta(i, json!({"content": text}), None, None));
                    }
                    out.push(ch.delta(i, json!({}), None, Some(finish)));
                    let usages: Option<Vec<Usage>> = choices.iter().map(|c| c.usage).collect();
                    if let Some(us) = usages {
                        // Every choice has ended.
                        if include_usage {
                            let u = UsageOut::from(total_usage(&us));
                            out.push(ch.wrap(json!([]), Some(json!(u))));
                        }
                        out.push("data: [DONE]\n\n".to_string());
                    }
                }
                Event::Error(m) => {
                    let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m);
                    out.push(format!("data: {}\n\n", e.body()));
                    out.push("data: [DONE]\n\n".to_string());
                }
            }
            let end = out.last().is_some_and(|s| s.starts_with("data: [DONE]"));
            for s in out {
                if tx.send(Ok(s)).await.is_err() {
                    // The client is gone: dropping the receivers tells the scheduler.
                    return;
                }
            }
            if end {
                return;
            }
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(body_rx));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
