//! The recording proxy: `/episodes/<id>/v1/chat/completions` for each running
//! episode, served by the engine's current weights through the chat route's own
//! rendering, limits and checks, and recording every call.
//!
//! An episode is addressed by its id in the path and authenticated by its own key
//! (the agent's `OPENAI_API_KEY`). A key no episode holds is refused (401). A call
//! with an episode's key to another episode's address ends the caller's own episode
//! (`wrong_key`, 403). A call to an episode that has ended is refused (410) and
//! counted (`late_call`); a call that was generating when its episode ended is not
//! recorded. An episode's calls are seeded by (run seed, sample, call index) and
//! the prompt's id, so a deterministic agent gets the same tokens on every run; they
//! sample with the run's temperature and top-p whatever the agent asks (the trainer
//! scores its log-probs at that temperature), and at most the run's
//! `max_new_tokens` per call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use metronome_core::{RunSeed, mix64};
use tokio::sync::{Notify, Semaphore};

use super::trajectory::RecordedCall;
use crate::http::api::{ApiError, parse_json};
use crate::http::chat::{Chat, Seeding, chat_turn};
use crate::http::chat_types::ChatCompletionRequest;
use crate::http::server::{admit, guarded};
use crate::http::server_config::ServerConfig;
use crate::{Engine, InferenceModel};

/// One episode's record.
pub(crate) struct EpisodeRecord {
    key: String,
    prompt: u64,
    sample: u32,
    pub(crate) calls: Vec<RecordedCall>,
    /// Calls started (their index seeds them).
    started: u64,
    open: bool,
    /// Why the proxy ended it (`wrong_key`).
    pub(crate) failure: Option<String>,
    /// Tells the episode's process to stop.
    pub(crate) end: Arc<Notify>,
}

/// The episodes the proxy serves.
pub(crate) struct Proxy<M: InferenceModel> {
    engine: Arc<Engine<M>>,
    server: ServerConfig,
    chat: Chat,
    seed: RunSeed,
    in_flight: Arc<Semaphore>,
    episodes: Mutex<HashMap<String, EpisodeRecord>>,
    /// Key → episode id.
    keys: Mutex<HashMap<String, String>>,
}

impl<M: InferenceModel> Proxy<M> {
    pub(crate) fn new(engine: Arc<Engine<M>>, server: ServerConfig, chat: Chat, seed: RunSeed) -> Self {
        let in_flight = Arc::new(Semaphore::new(server.max_concurrent_requests.max(1)));
        Self {
            engine,
            server,
            chat,
            seed,
            in_flight,
            episodes: Mutex::new(HashMap::new()),
            keys: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn model(&self) -> &str {
        &self.server.model_name
    }

    fn episodes(&self) -> MutexGuard<'_, HashMap<String, EpisodeRecord>> {
        self.episodes.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn keys(&self) -> MutexGuard<'_, HashMap<String, String>> {
        self.keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Opens episode `id` (with `key`) for sample `sample` of prompt `prompt`.
    pub(crate) fn open(&self, id: &str, key: &str, prompt: u64, sample: u32) -> Arc<Notify> {
        let end = Arc::new(Notify::new());
        let record = EpisodeRecord {
            key: key.to_owned(),
            prompt,
            sample,
            calls: Vec::new(),
            started: 0,
            open: true,
            failure: None,
            end: Arc::clone(&end),
        };
        self.episodes().insert(id.to_owned(), record);
        self.keys().insert(key.to_owned(), id.to_owned());
        end
    }

    /// Closes episode `id`: later calls are late. Returns its calls and the failure
    /// the proxy gave it.
    pub(crate) fn close(&self, id: &str) -> (Vec<RecordedCall>, Option<String>) {
        let mut episodes = self.episodes();
        let Some(e) = episodes.get_mut(id) else { return (Vec::new(), None) };
        e.open = false;
        (std::mem::take(&mut e.calls), e.failure.clone())
    }

    /// Forgets episode `id` (its key is then unknown).
    pub(crate) fn forget(&self, id: &str) {
        if let Some(e) = self.episodes().remove(id) {
            self.keys().remove(&e.key);
        }
    }

    /// The routes.
    pub(crate) fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/episodes/{id}/v1/chat/completions", post(chat::<M>))
            .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route", None) })
            .layer(axum::middleware::from_fn_with_state(Arc::clone(self), guard::<M>))
            .layer(axum::extract::DefaultBodyLimit::max(self.server.max_body_bytes))
            .with_state(Arc::clone(self))
    }

    /// The episode `key` belongs to, checked against the `id` it called: the id, or
    /// the refusal (ending the caller's episode when it called another's).
    fn admit_call(&self, id: &str, key: Option<&str>) -> Result<(u64, u32, u64), ApiError> {
        let owner = key.and_then(|k| self.keys().get(k).cloned());
        let Some(owner) = owner else {
            return Err(ApiError::new(StatusCode::UNAUTHORIZED, "no episode holds this API key", None));
        };
        let mut episodes = self.episodes();
        if owner != id {
            if let Some(e) = episodes.get_mut(&owner).filter(|e| e.open) {
                e.failure.get_or_insert_with(|| "wrong_key".into());
                e.end.notify_one();
            }
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "this API key belongs to another episode; the caller's episode is ended",
                None,
            ));
        }
        // Forgotten between the two look-ups: as unknown as its key.
        let Some(e) = episodes.get_mut(id) else {
            return Err(ApiError::new(StatusCode::UNAUTHORIZED, "no episode holds this API key", None));
        };
        if !e.open {
            crate::metrics::episode_failed("late_call");
            return Err(ApiError::new(StatusCode::GONE, "this episode has ended", None));
        }
        e.started += 1;
        Ok((e.prompt, e.sample, e.started - 1))
    }

    /// Records a call's result on episode `id`, if it is still open.
    fn record(&self, id: &str, call: RecordedCall) -> bool {
        match self.episodes().get_mut(id) {
            Some(e) if e.open => {
                e.calls.push(call);
                true
            }
            _ => false,
        }
    }
}

/// The server's body limits; the key is the proxy's own check.
async fn guard<M: InferenceModel>(
    State(p): State<Arc<Proxy<M>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let open = ServerConfig { api_key: None, ..p.server.clone() };
    guarded(&open, request, next).await
}

async fn chat<M: InferenceModel>(
    State(p): State<Arc<Proxy<M>>>,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let key = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let (prompt, sample, index) = match p.admit_call(&id, key) {
        Ok(admitted) => admitted,
        Err(e) => return e.into_response(),
    };
    let _permit = match admit(&p.in_flight, p.server.max_concurrent_requests) {
        Ok(permit) => permit,
        Err(busy) => return busy.into_response(),
    };
    let result = async {
        let mut req: ChatCompletionRequest = parse_json(&body, "chat completion")?;
        let sampling = &p.engine.config().sampling;
        req.temperature = Some(sampling.temperature);
        req.top_p = Some(sampling.top_p);
        let asked = req.max_completion_tokens.or(req.max_tokens).unwrap_or(sampling.max_new_tokens);
        req.max_completion_tokens = Some(asked.min(sampling.max_new_tokens));
        if req.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("an episode's call samples one choice (`n` = 1)", Some("n")));
        }
        let seed = mix64(p.seed.0 ^ mix64((u64::from(sample) << 32) ^ index));
        let turn = chat_turn(&p.engine, &p.server, &p.chat, &req, Seeding::Fixed { seed, prompt }).await?;
        let c = turn.completions.into_iter().next().expect("one choice was asked for");
        let call = RecordedCall {
            prompt: turn.prompt,
            tokens: c.tokens,
            logprobs: c.logprobs,
            version: c.version,
            finish_reason: c.finish_reason,
        };
        if !p.record(&id, call) {
            crate::metrics::episode_failed("late_call");
            return Err(ApiError::new(
                StatusCode::GONE,
                "this episode ended while the call was generating",
                None,
            ));
        }
        Ok(turn.response)
    }
    .await;
    match result {
        Ok(r) => axum::Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use metronome_core::PolicyVersion;
    use metronome_model::{CharTokenizer, Device, Model, ModelConfig};

    use super::*;

    fn proxy() -> Proxy<Model> {
        let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).unwrap().with_trainable(false);
        let config =
            crate::EngineConfig { threads_per_worker: Some(1), max_seq_len: 64, ..Default::default() };
        let engine =
            crate::model_engine(model, PolicyVersion(0), Arc::new(CharTokenizer), config, RunSeed(1));
        Proxy::new(Arc::new(engine.unwrap()), ServerConfig::named("tiny"), Chat::default(), RunSeed(1))
    }

    fn status(r: Result<(u64, u32, u64), ApiError>) -> u16 {
        r.map_or_else(|e| e.status.as_u16(), |_| 200)
    }

    /// Unknown keys, another episode's address, ended and forgotten episodes.
    #[test]
    fn calls_are_admitted_only_to_their_own_open_episode() {
        let p = proxy();
        p.open("a", "ka", 7, 0);
        p.open("b", "kb", 7, 1);
        assert_eq!(p.admit_call("a", Some("ka")).unwrap(), (7, 0, 0));
        assert_eq!(p.admit_call("a", Some("ka")).unwrap(), (7, 0, 1), "each call has its own index");
        assert_eq!(status(p.admit_call("a", Some("nobody's"))), 401);
        assert_eq!(status(p.admit_call("a", None)), 401);
        // `a`'s key at `b`'s address ends `a`, never `b`.
        assert_eq!(status(p.admit_call("b", Some("ka"))), 403);
        assert_eq!(p.close("a").1.as_deref(), Some("wrong_key"));
        assert_eq!(p.admit_call("b", Some("kb")).unwrap(), (7, 1, 0));
        assert_eq!(p.close("b").1, None);
        assert_eq!(status(p.admit_call("b", Some("kb"))), 410, "a call after the episode ended is late");
        p.forget("b");
        assert_eq!(status(p.admit_call("b", Some("kb"))), 401, "a forgotten episode's key is unknown");
        assert!(!p.record("b", RecordedCall::default()));
    }
}
