//! The OpenAI-compatible server: `/v1/completions`, `/v1/chat/completions` and
//! `/v1/models` in front of an [`Engine`], plus `POST /metronome/v1/load_weights` for
//! the client's weight hook. A request's generation is `completions.rs`'s, a chat
//! request's rendering and reading `chat.rs`'s; this file is the door, the routes and
//! the accept loop.
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
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metronome_core::{ErrorChain, PolicyVersion};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::api::{ApiError, parse_json, unix_now};
use super::chat::{Chat, Seeding, chat_turn};
use super::completions::complete;
pub use super::server_config::ServerConfig;
use super::snapshot::snapshot_from_safetensors;
use super::types::{CompletionRequest, ModelCard, ModelList};
use crate::{Engine, Error, InferenceModel, Rollback};

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
        .route("/v1/chat/completions", post(chat_completions::<M>))
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

async fn chat_completions<M: InferenceModel>(State(s): State<Arc<AppState<M>>>, body: Bytes) -> Response {
    let _permit = match admit(&s.in_flight, s.config.max_concurrent_requests) {
        Ok(permit) => permit,
        Err(busy) => return busy.into_response(),
    };
    let result = async {
        let req: super::chat_types::ChatCompletionRequest = parse_json(&body, "chat completion")?;
        chat_turn(&s.engine, &s.config, &s.chat, &req, Seeding::Request).await
    }
    .await;
    match result {
        Ok(turn) => Json(turn.response).into_response(),
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
