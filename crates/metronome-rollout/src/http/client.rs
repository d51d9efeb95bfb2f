//! A [`RolloutEngine`] that drives any OpenAI-compatible completions server.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::{FuturesUnordered, StreamExt};
use metronome_core::{
    Completion, FinishReason, Group, GroupSink, GroupTiming, PolicyVersion, Prompt, RolloutEngine,
    RolloutRequest, TokenId, WeightSnapshot,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::types::{CompletionRequest, CompletionResponse, PromptInput, StopInput};
use super::{LoadWeightsRequest, snapshot_to_safetensors, version_from_fingerprint};
use crate::{Error, Result, SamplingConfig};

/// Where the server is and how to talk to it. Serde form of the pipeline's
/// `[rollout.openai]` table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OpenAiClientConfig {
    /// The server's base URL, e.g. `http://127.0.0.1:8000` (without `/v1`).
    pub base_url: String,
    /// The served model name.
    pub model: String,
    /// Per-request timeout, seconds.
    pub timeout_s: f64,
    /// Retries after a failed attempt (connection errors, timeouts, 429 and 5xx).
    pub max_retries: u32,
    /// The first retry waits this long; each next one twice as long.
    pub retry_backoff_ms: u64,
    /// Requests in flight at most (one request per prompt, `n` = group size).
    pub max_concurrency: usize,
    /// The run seed sent as `seed` (see the seed mapping in the module docs).
    pub seed: u64,
    /// Sampling sent with every request.
    pub sampling: SamplingConfig,
    /// Send Metronome's `prompt_ids` extension (off for servers that reject unknown fields).
    pub send_prompt_ids: bool,
    /// Sent as `Authorization: Bearer <api_key>` (vLLM's and SGLang's `--api-key`,
    /// `metronome serve`'s).
    pub api_key: Option<metronome_core::Secret>,
}

impl Default for OpenAiClientConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8000".into(),
            model: "metronome".into(),
            timeout_s: 600.0,
            max_retries: 3,
            retry_backoff_ms: 200,
            max_concurrency: 16,
            seed: 0,
            sampling: SamplingConfig::default(),
            send_prompt_ids: true,
            api_key: None,
        }
    }
}

/// What a weight-update hook may use: the client's HTTP connection pool and the server.
#[derive(Debug)]
pub struct HookContext<'a> {
    /// The client's HTTP client.
    pub http: &'a reqwest::Client,
    /// The server's base URL.
    pub base_url: &'a str,
}

/// Brings new weights to the server(s) behind an [`OpenAiEngine`]. Servers differ (vLLM
/// and SGLang have their own reload endpoints, or weights travel over NCCL), hence a trait.
#[async_trait]
pub trait WeightUpdateHook: Send + Sync + std::fmt::Debug {
    /// Makes the server sample with `weights` from now on.
    async fn update(&self, ctx: &HookContext<'_>, weights: Arc<WeightSnapshot>) -> Result<()>;
}

/// A hook that does nothing: the server's weights are managed elsewhere. The client
/// still records the new version for its completions.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoWeightUpdate;

#[async_trait]
impl WeightUpdateHook for NoWeightUpdate {
    async fn update(&self, _ctx: &HookContext<'_>, _weights: Arc<WeightSnapshot>) -> Result<()> {
        Ok(())
    }
}

/// Saves the snapshot as `dir/weights-v<version>.safetensors` and posts
/// `{"path": ..., "version": ...}` to `endpoint` (our server's is
/// `/metronome/v1/load_weights`). The directory must be readable by the server.
#[derive(Clone, Debug)]
pub struct SafetensorsReload {
    /// Where the file is written.
    pub dir: PathBuf,
    /// The reload endpoint's path on the server.
    pub endpoint: String,
}

impl SafetensorsReload {
    /// A hook for our own server's endpoint.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into(), endpoint: "/metronome/v1/load_weights".into() }
    }
}

#[async_trait]
impl WeightUpdateHook for SafetensorsReload {
    async fn update(&self, ctx: &HookContext<'_>, weights: Arc<WeightSnapshot>) -> Result<()> {
        let path = self.dir.join(format!("weights-v{}.safetensors", weights.version));
        let bytes = snapshot_to_safetensors(&weights)?;
        tokio::fs::write(&path, bytes)
            .await
            .map_err(|source| Error::Io { path: path.display().to_string(), source })?;
        let url = format!("{}{}", ctx.base_url.trim_end_matches('/'), self.endpoint);
        let body = LoadWeightsRequest { path: path.display().to_string(), version: weights.version.0 };
        let resp = ctx
            .http
            .post(&url)
            .json(&body)
            .send()
            .await
            .map_err(|e| Error::Http { url: url.clone(), reason: e.to_string() })?;
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            return Err(Error::Http { url, reason: format!("status {status}: {text}") });
        }
        Ok(())
    }
}

/// A rollout engine backed by an OpenAI-compatible server: one `/v1/completions`
/// request per prompt with `n` = group size, at most `max_concurrency` in flight,
/// groups emitted as their requests return.
#[derive(Debug)]
pub struct OpenAiEngine {
    config: OpenAiClientConfig,
    http: reqwest::Client,
    permits: Semaphore,
    version: AtomicU64,
    hook: Box<dyn WeightUpdateHook>,
}

impl OpenAiEngine {
    /// A client for `config.base_url`, starting at `version`, with `hook` for weight updates.
    pub fn new(
        config: OpenAiClientConfig,
        version: PolicyVersion,
        hook: impl WeightUpdateHook + 'static,
    ) -> Result<Self> {
        config.sampling.validate()?;
        if config.max_concurrency == 0 {
            return Err(Error::config("openai.max_concurrency", "is 0 (expected >= 1)"));
        }
        if !(config.timeout_s.is_finite() && config.timeout_s > 0.0) {
            return Err(Error::config("openai.timeout_s", format!("is {} (expected > 0)", config.timeout_s)));
        }
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(key) = &config.api_key {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", key.expose()))
                .map_err(|_| Error::config("api_key", "holds characters a header cannot carry"))?;
            value.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(config.timeout_s))
            .default_headers(headers)
            .build()
            .map_err(|e| Error::Http { url: config.base_url.clone(), reason: e.to_string() })?;
        Ok(Self {
            permits: Semaphore::new(config.max_concurrency),
            http,
            version: AtomicU64::new(version.0),
            hook: Box::new(hook),
            config,
        })
    }

    fn request_for(&self, prompt: &Prompt, n: u32) -> CompletionRequest {
        let s = &self.config.sampling;
        let input = if prompt.tokens.is_empty() {
            PromptInput::Text(prompt.text.clone())
        } else {
            PromptInput::Tokens(prompt.tokens.clone())
        };
        CompletionRequest {
            model: self.config.model.clone(),
            prompt: Some(input),
            n: Some(n),
            max_tokens: Some(s.max_new_tokens),
            temperature: Some(s.temperature),
            top_p: Some(s.top_p),
            top_k: (s.top_k > 0).then_some(s.top_k as i64),
            min_p: (s.min_p > 0.0).then_some(s.min_p),
            repetition_penalty: (s.repetition_penalty != 1.0).then_some(s.repetition_penalty),
            seed: Some(self.config.seed),
            stop: (!s.stop_strings.is_empty()).then(|| StopInput::Many(s.stop_strings.clone())),
            stop_token_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos.then_some(true),
            include_stop_str_in_output: s.include_stop_str_in_output.then_some(true),
            logprobs: Some(0),
            return_tokens_as_token_ids: Some(true),
            prompt_ids: self.config.send_prompt_ids.then(|| vec![prompt.id.0]),
            stream: None,
            echo: None,
        }
    }

    /// Posts `body`, retrying transport errors, timeouts, 429 and 5xx with backoff.
    async fn post(&self, body: &CompletionRequest) -> Result<CompletionResponse> {
        let url = format!("{}/v1/completions", self.config.base_url.trim_end_matches('/'));
        let mut attempt = 0;
        loop {
            let err = match self.http.post(&url).json(body).send().await {
                Ok(resp) if resp.status().is_success() => {
                    return resp
                        .json()
                        .await
                        .map_err(|e| Error::Response { url: url.clone(), reason: e.to_string() });
                }
                Ok(resp) => {
                    let status = resp.status();
                    let text = resp.text().await.unwrap_or_default();
                    let err = Error::Http { url: url.clone(), reason: format!("status {status}: {text}") };
                    if !(status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS) {
                        return Err(err);
                    }
                    err
                }
                Err(e) => Error::Http { url: url.clone(), reason: e.to_string() },
            };
            if attempt >= self.config.max_retries {
                return Err(err);
            }
            tracing::warn!(%url, attempt, error = %err, "completion request failed, retrying");
            crate::metrics::http_retry();
            tokio::time::sleep(Duration::from_millis(self.config.retry_backoff_ms << attempt.min(16))).await;
            attempt += 1;
        }
    }

    /// One prompt's group.
    async fn group_for(
        &self,
        period: metronome_core::PeriodId,
        prompt: Prompt,
        n: u32,
        t0: Instant,
    ) -> Result<Group> {
        let _permit = self.permits.acquire().await.map_err(|_| Error::Shutdown)?;
        let started_s = t0.elapsed().as_secs_f64();
        let fallback_version = PolicyVersion(self.version.load(Ordering::Relaxed));
        let body = self.request_for(&prompt, n);
        let resp = self.post(&body).await?;
        let url = &self.config.base_url;
        let version =
            resp.system_fingerprint.as_deref().and_then(version_from_fingerprint).unwrap_or(fallback_version);
        let mut completions = Vec::with_capacity(n as usize);
        let mut choices = resp.choices;
        choices.sort_by_key(|c| c.index);
        if choices.len() != n as usize {
            return Err(Error::Response {
                url: url.clone(),
                reason: format!("{} choices for n = {n}", choices.len()),
            });
        }
        for (i, choice) in choices.into_iter().enumerate() {
            let lp = choice.logprobs.ok_or_else(|| Error::Response {
                url: url.clone(),
                reason: format!("choice {i} has no logprobs"),
            })?;
            let tokens = lp
                .tokens
                .iter()
                .map(|t| {
                    t.strip_prefix("token_id:").and_then(|id| id.parse::<TokenId>().ok()).ok_or_else(|| Error::Response {
                        url: url.clone(),
                        reason: format!("choice {i} token `{t}` is not `token_id:<id>` (server ignores return_tokens_as_token_ids)"),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let finish_reason = match (choice.finish_reason.as_deref(), &choice.stop_reason) {
                (Some("length"), _) => FinishReason::Length,
                (Some("stop"), Some(serde_json::Value::String(_))) => FinishReason::StopString,
                (Some("stop"), _) => FinishReason::Stop,
                _ => FinishReason::Aborted,
            };
            completions.push(Completion {
                sample_index: i as u32,
                tokens,
                logprobs: lp.token_logprobs,
                text: choice.text,
                finish_reason,
                version,
                episode: None,
            });
        }
        Ok(Group {
            period,
            prompt,
            completions,
            timing: GroupTiming { started_s, finished_s: t0.elapsed().as_secs_f64() },
        })
    }
}

#[async_trait]
impl RolloutEngine for OpenAiEngine {
    async fn generate(&self, request: RolloutRequest, sink: &dyn GroupSink) -> metronome_core::Result<()> {
        if request.group_size == 0 {
            return Err(Error::config("group_size", "is 0 (expected >= 1)").into());
        }
        let t0 = Instant::now();
        let mut pending: FuturesUnordered<_> = request
            .prompts
            .into_iter()
            .map(|p| self.group_for(request.period, p, request.group_size, t0))
            .collect();
        while let Some(group) = pending.next().await {
            let group = group?;
            crate::metrics::group_done(group.timing.finished_s - group.timing.started_s);
            sink.emit(group).await?;
        }
        Ok(())
    }

    async fn install_weights(&self, weights: Arc<WeightSnapshot>) -> metronome_core::Result<()> {
        let version = weights.version;
        let ctx = HookContext { http: &self.http, base_url: &self.config.base_url };
        self.hook.update(&ctx, weights).await?;
        self.version.store(version.0, Ordering::Relaxed);
        Ok(())
    }

    fn version(&self) -> PolicyVersion {
        PolicyVersion(self.version.load(Ordering::Relaxed))
    }
}
