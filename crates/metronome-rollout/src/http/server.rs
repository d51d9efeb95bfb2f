//! The OpenAI-compatible server: `/v1/completions` and `/v1/models` in front of an
//! [`Engine`], plus `POST /metronome/v1/load_weights` for the client's weight hook.
//!
//! Hostile traffic is expected ([`ServerConfig`]): with an `api_key` every route needs
//! `Authorization: Bearer <key>` (401 otherwise; the key is required to listen on a
//! non-loopback address); bodies above `max_body_bytes` get 413; `n`, `max_tokens`,
//! prompts per request and stop conditions above their limits get 400 naming the
//! field; requests beyond `max_concurrent_requests` in flight get 429 at once instead
//! of queueing; `load_weights` reads only files inside `weights_dir` (none: the route
//! answers 403), up to `max_weights_bytes`, and its errors name only the path the
//! client sent; it installs only tensors the model has, every one finite, and never
//! an older version unless the request says `allow_older`.
//!
//! Slow and odd clients are bounded too: at most `max_connections` connections are
//! open (more wait in the listen backlog), a request's headers must arrive within
//! `header_timeout_s` (the connection is closed otherwise, idle keep-alive ones
//! included) and its body within `body_timeout_s` (408); a `POST` whose
//! `Content-Type` is not JSON gets 415, unknown routes 404 and wrong methods 405.
//! Every error is in OpenAI's shape (`{"error": {"message", "type", "param",
//! "code"}}`), with `param` naming the field at fault where there is one.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metronome_core::{ErrorChain, FinishReason, PeriodId, PolicyVersion, Prompt, PromptId, RunSeed, Secret};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::api::{ApiError, parse_json, unix_now};
use super::chat::Chat;
use super::snapshot::snapshot_from_safetensors;
use super::types::{
    Choice, CompletionRequest, CompletionResponse, LogProbs, ModelCard, ModelList, PromptInput, Usage,
};
use crate::{Engine, Error, InferenceModel, LogprobsMode, Result, Rollback, SamplingConfig, Submission};

/// What the server accepts. Every limit has a default that serves a rollout client
/// (`serde` form of `metronome serve`'s settings).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// The served model name (`model` in requests).
    pub model_name: String,
    /// Every request must carry `Authorization: Bearer <api_key>`; required to listen
    /// on a non-loopback address.
    pub api_key: Option<Secret>,
    /// The largest request body, in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Prompts per request at most.
    pub max_prompts: usize,
    /// Choices per prompt (`n`) at most.
    pub max_n: u32,
    /// `max_tokens` at most (the context length bounds it too).
    pub max_tokens: usize,
    /// Stop strings and stop token ids per request at most, each.
    pub max_stop: usize,
    /// Requests generating at once at most; more are answered 429 at once.
    pub max_concurrent_requests: usize,
    /// The only folder `load_weights` reads from; `None` refuses the route (403).
    pub weights_dir: Option<PathBuf>,
    /// The largest weights file `load_weights` reads, in bytes.
    pub max_weights_bytes: u64,
    /// Which log-prob every answer's `logprobs` carries: of the distribution each
    /// token was sampled from (`sampled`, the default: what a trainer scores), or of
    /// the raw model at temperature 1 (`raw`, as vLLM answers unless started with
    /// `--logprobs-mode processed_logprobs`).
    pub logprobs: LogprobsMode,
    /// Connections open at once at most; more wait in the listen backlog.
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (a new connection's first,
    /// or the next on a kept-alive one) before the connection is closed.
    pub header_timeout_s: f64,
    /// Seconds a client has to send a request's body once its headers are in (408).
    pub body_timeout_s: f64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_name: "metronome".into(),
            api_key: None,
            max_body_bytes: 4 << 20,
            max_prompts: 256,
            max_n: 64,
            max_tokens: 4096,
            max_stop: 16,
            max_concurrent_requests: 16,
            weights_dir: None,
            max_weights_bytes: 64 << 30,
            logprobs: LogprobsMode::Sampled,
            max_connections: 256,
            header_timeout_s: 10.0,
            body_timeout_s: 30.0,
        }
    }
}

/// The longest stop string accepted, in bytes.
const MAX_STOP_BYTES: usize = 256;

/// The most connections a server may be configured to hold open.
const MAX_CONNECTIONS: usize = 65_536;

/// The longest header or body timeout a server may be configured with (one day).
const MAX_TIMEOUT_S: f64 = 86_400.0;

impl ServerConfig {
    /// The default limits, serving `model_name`.
    #[must_use]
    pub fn named(model_name: impl Into<String>) -> Self {
        Self { model_name: model_name.into(), ..Self::default() }
    }

    /// Checks the limits, and that a server reachable from other machines (bound to
    /// `addr`, not a loopback address) asks for a key; errors name the field.
    pub fn validate(&self, addr: std::net::SocketAddr) -> Result<()> {
        for (field, value) in [
            ("max_body_bytes", self.max_body_bytes),
            ("max_prompts", self.max_prompts),
            ("max_n", self.max_n as usize),
            ("max_tokens", self.max_tokens),
            ("max_concurrent_requests", self.max_concurrent_requests),
            ("max_connections", self.max_connections),
        ] {
            if value == 0 {
                return Err(Error::config(field, "is 0 (expected at least 1)"));
            }
        }
        // A connection holds a task and its buffers: beyond this the bound is no bound.
        if self.max_connections > MAX_CONNECTIONS {
            return Err(Error::config(
                "max_connections",
                format!("is {} (expected at most {MAX_CONNECTIONS})", self.max_connections),
            ));
        }
        for (field, value) in
            [("header_timeout_s", self.header_timeout_s), ("body_timeout_s", self.body_timeout_s)]
        {
            if !(value.is_finite() && value > 0.0 && value <= MAX_TIMEOUT_S) {
                return Err(Error::config(
                    field,
                    format!("is {value} (expected in (0, {MAX_TIMEOUT_S}] seconds)"),
                ));
            }
        }
        if self.api_key.as_ref().is_some_and(|k| k.expose().is_empty()) {
            return Err(Error::config("api_key", "is empty"));
        }
        if !addr.ip().is_loopback() && self.api_key.is_none() {
            return Err(Error::config(
                "api_key",
                format!("must be set to listen on {addr}, which other machines can reach"),
            ));
        }
        Ok(())
    }
}

pub(super) struct AppState<M: InferenceModel> {
    pub(super) engine: Arc<Engine<M>>,
    pub(super) config: ServerConfig,
    pub(super) chat: Chat,
    pub(super) in_flight: Arc<Semaphore>,
    created: u64,
}

/// The routes, serving `engine` as `config` says; chat requests are rendered with
/// the tokenizer's chat template and refused when they offer tools
/// ([`router_with_chat`] says otherwise).
pub fn router<M: InferenceModel>(engine: Arc<Engine<M>>, config: ServerConfig) -> Router {
    router_with_chat(engine, config, Chat::default())
}

/// [`router`], rendering and reading chat requests as `chat` says.
pub fn router_with_chat<M: InferenceModel>(
    engine: Arc<Engine<M>>,
    config: ServerConfig,
    chat: Chat,
) -> Router {
    let in_flight = Arc::new(Semaphore::new(config.max_concurrent_requests.max(1)));
    let body_limit = config.max_body_bytes;
    let state = Arc::new(AppState { engine, config, chat, in_flight, created: unix_now() });
    Router::new()
        .route("/v1/completions", post(completions::<M>))
        .route("/v1/chat/completions", post(super::chat::chat_completions::<M>))
        .route("/v1/models", get(models::<M>))
        .route("/metronome/v1/load_weights", post(load_weights::<M>))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route", None) })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "this route does not take that method", None)
        })
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), guard::<M>))
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// The door every request passes: the bearer key (401), then for a request with a
/// body its content type (415) and the whole body, within `max_body_bytes` (413)
/// and `body_timeout_s` (408), before any handler sees it.
async fn guard<M: InferenceModel>(
    State(s): State<Arc<AppState<M>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    guarded(&s.config, request, next).await
}

/// [`guard`] under `config`'s key and limits.
pub(crate) async fn guarded(
    config: &ServerConfig,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Err(e) = authorize(config, &request) {
        return e.into_response();
    }
    if request.method() != axum::http::Method::POST {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    match read_body(config, &parts.headers, body).await {
        Ok(bytes) => next.run(axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes))).await,
        Err(e) => e.into_response(),
    }
}

/// A `POST` body: JSON by its `Content-Type`, read whole within the size and time
/// limits.
async fn read_body(
    limits: &ServerConfig,
    headers: &axum::http::HeaderMap,
    body: axum::body::Body,
) -> std::result::Result<Bytes, ApiError> {
    let content_type =
        headers.get(axum::http::header::CONTENT_TYPE).map(|v| String::from_utf8_lossy(v.as_bytes()));
    let is_json = content_type.as_deref().is_some_and(|t| {
        let mime = t.split(';').next().unwrap_or("").trim();
        mime.eq_ignore_ascii_case("application/json")
    });
    if !is_json {
        let sent =
            content_type.map_or_else(|| "no content type".to_owned(), |t| format!("content type `{t}`"));
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("the body must be JSON (Content-Type: application/json); the request has {sent}"),
            None,
        ));
    }
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is larger than this server's limit of {} bytes", limits.max_body_bytes),
            None,
        )
    };
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return Err(too_large());
    }
    let read = axum::body::to_bytes(body, limits.max_body_bytes);
    match tokio::time::timeout(Duration::from_secs_f64(limits.body_timeout_s), read).await {
        Ok(Ok(bytes)) => Ok(bytes),
        // Only the length limit ends the read of a body that keeps coming.
        Ok(Err(e)) if is_length_limit(&e) => Err(too_large()),
        Ok(Err(e)) => Err(ApiError::bad(format!("the body could not be read: {e}"), None)),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the body did not arrive within {} s", limits.body_timeout_s),
            None,
        )),
    }
}

/// Whether reading a body failed on its length limit.
fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// Refuses a request without the configured bearer key (401).
fn authorize(config: &ServerConfig, request: &axum::extract::Request) -> std::result::Result<(), ApiError> {
    if let Some(key) = &config.api_key {
        let given = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.expose().as_bytes())) {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key (Authorization: Bearer <key>)",
                None,
            ));
        }
    }
    Ok(())
}

/// Equality whose time does not depend on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Serves `router` on `listener` within `config`'s connection limits until the future
/// is dropped or the listener fails.
pub fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    config: &ServerConfig,
) -> impl std::future::Future<Output = std::io::Result<()>> + Send + 'static {
    serve_until(listener, router, config, std::future::pending())
}

/// [`serve`] until `shutdown` resolves, then finishes the requests in flight.
///
/// HTTP/1.1 with hyper's own header timeout; `max_connections` permits, one held by
/// each connection for its whole life, so a client that opens many connections and
/// sends nothing holds them no longer than `header_timeout_s`.
pub fn serve_until(
    listener: tokio::net::TcpListener,
    router: Router,
    config: &ServerConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> impl std::future::Future<Output = std::io::Result<()>> + Send + 'static {
    use hyper_util::rt::TokioTimer;
    let permits = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(Duration::from_secs_f64(config.header_timeout_s));
    accept_loop(listener, router, permits, http, shutdown)
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    router: Router,
    permits: Arc<Semaphore>,
    http: hyper::server::conn::http1::Builder,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::TokioIo;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = Arc::clone(&permits).acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Per-connection failures (a reset before accept, out of descriptors)
                // must not end the server; back off a moment and go on.
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A client that goes away or times out ends only its own connection.
            let _ = connection.await;
            drop(permit);
        });
    }
    graceful.shutdown().await;
    Ok(())
}

/// Accept errors that concern one connection only.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}

async fn models<M: InferenceModel>(State(s): State<Arc<AppState<M>>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: s.config.model_name.clone(),
            object: "model".into(),
            created: s.created,
            owned_by: "metronome".into(),
            max_model_len: Some(s.engine.max_seq_len()),
        }],
    })
}

async fn completions<M: InferenceModel>(State(s): State<Arc<AppState<M>>>, body: Bytes) -> Response {
    let _permit = match admit(&s.in_flight, s.config.max_concurrent_requests) {
        Ok(permit) => permit,
        Err(busy) => return busy.into_response(),
    };
    let result = async {
        let req: CompletionRequest = parse_json(&body, "completion")?;
        complete(&s.engine, &s.config, &req).await
    }
    .await;
    match result {
        Ok(r) => Json(r.response).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A place among the requests generating at once, or [`Busy`]: beyond the limit a
/// client backs off and retries, where a queue would hold its connection and memory.
pub(crate) fn admit(
    in_flight: &Arc<Semaphore>,
    limit: usize,
) -> std::result::Result<tokio::sync::OwnedSemaphorePermit, Busy> {
    Arc::clone(in_flight).try_acquire_owned().map_err(|_| Busy { limit })
}

/// The 429 with `Retry-After` of a server serving `limit` requests already.
#[derive(Debug)]
pub(crate) struct Busy {
    limit: usize,
}

impl IntoResponse for Busy {
    fn into_response(self) -> Response {
        let mut r = ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "{} requests are being served, the most this server takes at once; retry later",
                self.limit
            ),
            param: None,
        }
        .into_response();
        r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        r
    }
}

/// What a request generated: the answer, and each choice's completion in choice
/// order (its sampled ids, behaviour log-probs and version, whatever the answer shows).
pub(crate) struct Generated {
    pub(crate) response: CompletionResponse,
    pub(crate) completions: Vec<metronome_core::Completion>,
}

/// Validates a request, runs it on the engine, and shapes the answer.
pub(crate) async fn complete<M: InferenceModel>(
    engine: &Engine<M>,
    config: &ServerConfig,
    req: &CompletionRequest,
) -> std::result::Result<Generated, ApiError> {
    let (n, max_tokens) = check_options(req, config)?;
    let tokenizer = Arc::clone(engine.tokenizer());
    let prompts = prompts_of(req, tokenizer.as_ref(), config, max_tokens, engine.max_seq_len())?;
    let sampling = sampling_of(req, max_tokens, &tokenizer.stop_token_ids(), config.logprobs);
    sampling.validate().map_err(|e| match &e {
        // The request's field: `sampling.top_p` is `top_p` here.
        Error::Config { field, .. } => {
            let param = field.strip_prefix("sampling.").unwrap_or(field);
            ApiError::bad(e.to_string(), Some(param))
        }
        _ => ApiError::bad(e.to_string(), None),
    })?;
    let seed = req
        .seed
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    let index_of: HashMap<u64, usize> = prompts.iter().enumerate().map(|(i, p)| (p.id.0, i)).collect();
    let prompt_tokens = prompts.iter().map(|p| p.tokens.len()).sum();
    let sub = Submission {
        period: PeriodId(0),
        prompts,
        group_size: n,
        sampling: sampling.clone(),
        seed: RunSeed(seed),
    };
    let groups = engine.generate_groups(sub).await.map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("generation failed: {}", ErrorChain(&e)),
        param: None,
    })?;

    let mut choices = Vec::with_capacity(index_of.len() * n as usize);
    let mut completions = Vec::with_capacity(choices.capacity());
    let mut version = PolicyVersion(0);
    let mut completion_tokens = 0;
    for group in groups {
        let i = index_of[&group.prompt.id.0] as u32;
        for c in group.completions {
            version = version.max(c.version);
            completion_tokens += c.tokens.len();
            let index = i * n + c.sample_index;
            choices.push(choice(req, &c, index, tokenizer.as_ref(), &sampling));
            completions.push((index, c));
        }
    }
    choices.sort_by_key(|c| c.index);
    completions.sort_by_key(|(index, _)| *index);
    let completions = completions.into_iter().map(|(_, c)| c).collect();
    let response = CompletionResponse {
        id: format!("cmpl-{seed:016x}-{}", unix_now()),
        object: "text_completion".into(),
        created: unix_now(),
        model: config.model_name.clone(),
        system_fingerprint: Some(format!("metronome-v{version}")),
        choices,
        usage: Some(Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }),
    };
    Ok(Generated { response, completions })
}

/// Checks the request's options against the server's limits; `n` and `max_tokens`.
fn check_options(
    req: &CompletionRequest,
    limits: &ServerConfig,
) -> std::result::Result<(u32, usize), ApiError> {
    if req.model != limits.model_name {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "model `{}` does not exist (this server serves `{}`)",
                req.model, limits.model_name
            ),
            param: Some(Cow::Borrowed("model")),
        });
    }
    if req.stream == Some(true) {
        return Err(ApiError::bad(
            "`stream` is true, but this server only answers whole responses",
            Some("stream"),
        ));
    }
    if req.echo == Some(true) {
        return Err(ApiError::bad("`echo` is true, but this server does not echo prompts", Some("echo")));
    }
    let n = req.n.unwrap_or(1);
    if n == 0 || n > limits.max_n {
        return Err(ApiError::bad(format!("`n` is {n} (expected 1 to {})", limits.max_n), Some("n")));
    }
    let stops = req.stop.clone().map(super::StopInput::into_vec).unwrap_or_default();
    if stops.len() > limits.max_stop || stops.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            format!("`stop` takes at most {} strings of up to {MAX_STOP_BYTES} bytes", limits.max_stop),
            Some("stop"),
        ));
    }
    if req.stop_token_ids.as_ref().is_some_and(|ids| ids.len() > limits.max_stop) {
        return Err(ApiError::bad(
            format!("`stop_token_ids` takes at most {} ids", limits.max_stop),
            Some("stop_token_ids"),
        ));
    }
    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens == 0 || max_tokens > limits.max_tokens {
        return Err(ApiError::bad(
            format!("`max_tokens` is {max_tokens} (expected 1 to {})", limits.max_tokens),
            Some("max_tokens"),
        ));
    }
    Ok((n, max_tokens))
}

/// The request's prompts, tokenised and checked: within the server's count, the
/// vocabulary and, with `max_tokens` new ones, the engine's `context`.
fn prompts_of(
    req: &CompletionRequest,
    tokenizer: &dyn metronome_core::Tokenizer,
    limits: &ServerConfig,
    max_tokens: usize,
    context: usize,
) -> std::result::Result<Vec<Prompt>, ApiError> {
    let encode = |t: &str| {
        tokenizer.encode(t).map_err(|e| ApiError::bad(format!("prompt: {}", ErrorChain(&e)), Some("prompt")))
    };
    let inputs: Vec<(String, Vec<u32>)> = match req.prompt.clone() {
        None => return Err(ApiError::bad("`prompt` is missing", Some("prompt"))),
        Some(PromptInput::Text(t)) => vec![(t.clone(), encode(&t)?)],
        Some(PromptInput::Texts(ts)) => {
            ts.into_iter().map(|t| Ok((t.clone(), encode(&t)?))).collect::<std::result::Result<_, _>>()?
        }
        Some(PromptInput::Tokens(ids)) => vec![(String::new(), ids)],
        Some(PromptInput::TokenLists(lists)) => lists.into_iter().map(|ids| (String::new(), ids)).collect(),
    };
    if inputs.is_empty() {
        return Err(ApiError::bad("`prompt` is an empty list", Some("prompt")));
    }
    if inputs.len() > limits.max_prompts {
        return Err(ApiError::bad(
            format!("`prompt` holds {} prompts (at most {})", inputs.len(), limits.max_prompts),
            Some("prompt"),
        ));
    }
    let vocab = tokenizer.vocab_size();
    for (i, (_, tokens)) in inputs.iter().enumerate() {
        if tokens.is_empty() {
            return Err(ApiError::bad(format!("prompt {i} has no tokens"), Some("prompt")));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad(
                format!("prompt {i} has token id {bad}, outside the vocabulary of {vocab}"),
                Some("prompt"),
            ));
        }
        // Saturating: neither number is trusted to leave room for the sum.
        if tokens.len().saturating_add(max_tokens) > context {
            return Err(ApiError::bad(
                format!(
                    "`max_tokens` {max_tokens} plus the {} tokens of prompt {i} exceeds the context length {context}",
                    tokens.len()
                ),
                Some("max_tokens"),
            ));
        }
    }
    let ids: Vec<u64> = match &req.prompt_ids {
        Some(ids) if ids.len() != inputs.len() => {
            return Err(ApiError::bad(
                format!("`prompt_ids` has {} ids for {} prompts", ids.len(), inputs.len()),
                Some("prompt_ids"),
            ));
        }
        Some(ids) => ids.clone(),
        None => (0..inputs.len() as u64).collect(),
    };
    if ids.iter().collect::<HashSet<_>>().len() != ids.len() {
        return Err(ApiError::bad("`prompt_ids` has duplicates", Some("prompt_ids")));
    }
    Ok(inputs
        .into_iter()
        .zip(ids)
        .map(|((text, tokens), id)| Prompt { id: PromptId(id), text, tokens, ..Prompt::default() })
        .collect())
}

/// One completion as an API choice at `index`: its text, log-probs when asked for,
/// and why it finished.
fn choice(
    req: &CompletionRequest,
    c: &metronome_core::Completion,
    index: u32,
    tokenizer: &dyn metronome_core::Tokenizer,
    sampling: &SamplingConfig,
) -> Choice {
    let logprobs = req.logprobs.map(|_| {
        let as_ids = req.return_tokens_as_token_ids.unwrap_or(false);
        let tokens: Vec<String> =
            c.tokens
                .iter()
                .map(|&t| {
                    if as_ids { format!("token_id:{t}") } else { tokenizer.decode(&[t]).unwrap_or_default() }
                })
                .collect();
        let mut offset = 0;
        let text_offset = tokens
            .iter()
            .map(|t| {
                let o = offset;
                offset += if as_ids { 0 } else { t.len() };
                o
            })
            .collect();
        LogProbs { tokens, token_logprobs: c.logprobs.clone(), top_logprobs: None, text_offset }
    });
    let (finish_reason, stop_reason) = match c.finish_reason {
        FinishReason::Stop => ("stop", c.tokens.last().map(|&t| serde_json::json!(t))),
        FinishReason::StopString => {
            let full = tokenizer.decode(&c.tokens).unwrap_or_default();
            let hit =
                sampling.stop_strings.iter().filter_map(|s| full.find(s.as_str()).map(|at| (at, s))).min();
            ("stop", hit.map(|(_, s)| serde_json::json!(s)))
        }
        // The server checks the context before it submits, so a prompt is never
        // rejected here; no room left is "length" in the API's terms.
        FinishReason::Length | FinishReason::PromptRejected => ("length", None),
        FinishReason::Aborted => ("abort", None),
    };
    let token_ids = req.return_token_ids.unwrap_or(false).then(|| c.tokens.clone());
    Choice {
        index,
        text: c.text.clone(),
        logprobs,
        finish_reason: Some(finish_reason.into()),
        stop_reason,
        token_ids,
        matched_stop: None,
    }
}

/// The request's sampling, recording log-probs as the server is configured to;
/// unset fields take OpenAI's defaults (temperature 1, top-p 1).
fn sampling_of(
    req: &CompletionRequest,
    max_tokens: usize,
    eos: &[u32],
    logprobs: LogprobsMode,
) -> SamplingConfig {
    let stop_token_ids = req.stop_token_ids.as_ref().map(|extra| {
        let mut ids = eos.to_vec();
        ids.extend(extra.iter().filter(|t| !eos.contains(t)));
        ids
    });
    SamplingConfig {
        temperature: req.temperature.unwrap_or(1.0),
        top_k: req.top_k.filter(|&k| k > 0).map_or(0, |k| k as usize),
        top_p: req.top_p.unwrap_or(1.0),
        min_p: req.min_p.unwrap_or(0.0),
        repetition_penalty: req.repetition_penalty.unwrap_or(1.0),
        max_new_tokens: max_tokens,
        stop_token_ids,
        stop_strings: req.stop.clone().map(super::StopInput::into_vec).unwrap_or_default(),
        include_stop_str_in_output: req.include_stop_str_in_output.unwrap_or(false),
        ignore_eos: req.ignore_eos.unwrap_or(false),
        logprobs,
    }
}

/// `POST /metronome/v1/load_weights` body: a safetensors file written by
/// [`super::snapshot_to_safetensors`] (e.g. by [`super::SafetensorsReload`]) and its version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadWeightsRequest {
    /// The file, readable by the server.
    pub path: String,
    /// The policy version the weights are.
    pub version: u64,
    /// Install them even when they are older than the served weights (a resumed
    /// trainer's, or a server another client moved ahead). Without it an older
    /// version is refused (409), so a delayed or replayed request cannot undo a newer
    /// update.
    #[serde(default)]
    pub allow_older: bool,
}

async fn load_weights<M: InferenceModel>(State(s): State<Arc<AppState<M>>>, body: Bytes) -> Response {
    let result = async {
        let req: LoadWeightsRequest = parse_json(&body, "load_weights")?;
        let path = weights_file(&s, &req.path).await?;
        let bytes = tokio::fs::read(&path)
            .await
            .map_err(|_| ApiError::bad(format!("{}: cannot be read", req.path), Some("path")))?;
        let snapshot = snapshot_from_safetensors(&bytes, PolicyVersion(req.version))
            .map_err(|e| ApiError::bad(format!("{}: {}", req.path, ErrorChain(&e)), Some("path")))?;
        let rollback = if req.allow_older { Rollback::Allow } else { Rollback::Refuse };
        s.engine.install_snapshot(&snapshot, rollback).map_err(|e| match e {
            Error::Rollback { .. } => ApiError {
                status: StatusCode::CONFLICT,
                message: e.to_string(),
                param: Some(Cow::Borrowed("version")),
            },
            e => ApiError {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                message: format!("installing {}: {}", req.path, ErrorChain(&e)),
                param: Some(Cow::Borrowed("path")),
            },
        })?;
        Ok::<_, ApiError>(serde_json::json!({ "version": req.version }))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The file `load_weights` may read for `requested` (a name inside `weights_dir`, or
/// a path that resolves inside it), checked against the size limit. Errors name only
/// what the client sent: they say nothing of other paths on the server.
async fn weights_file<M: InferenceModel>(
    s: &AppState<M>,
    requested: &str,
) -> std::result::Result<PathBuf, ApiError> {
    let refused = |message: String| ApiError {
        status: StatusCode::FORBIDDEN,
        message,
        param: Some(Cow::Borrowed("path")),
    };
    let Some(dir) = &s.config.weights_dir else {
        return Err(refused(
            "this server loads no weights (it was started without a weights directory)".into(),
        ));
    };
    let dir = tokio::fs::canonicalize(dir)
        .await
        .map_err(|_| refused("the server's weights directory is missing".into()))?;
    let outside = || ApiError {
        status: StatusCode::FORBIDDEN,
        message: format!("{requested}: not a file in the server's weights directory"),
        param: Some(Cow::Borrowed("path")),
    };
    let path = tokio::fs::canonicalize(dir.join(requested)).await.map_err(|_| outside())?;
    if !path.starts_with(&dir) {
        return Err(outside());
    }
    let meta = tokio::fs::metadata(&path).await.map_err(|_| outside())?;
    if !meta.is_file() {
        return Err(outside());
    }
    if meta.len() > s.config.max_weights_bytes {
        return Err(ApiError::bad(
            format!("{requested}: {} bytes, above the limit of {}", meta.len(), s.config.max_weights_bytes),
            Some("path"),
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_from_our_fingerprint_only() {
        assert_eq!(super::super::version_from_fingerprint("metronome-v12"), Some(PolicyVersion(12)));
        assert_eq!(super::super::version_from_fingerprint("fp_44709d6fcb"), None);
    }
}
