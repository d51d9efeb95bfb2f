//! A [`RolloutEngine`] that drives one or more OpenAI-compatible completions servers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::{FuturesUnordered, StreamExt};
use metronome_core::{
    Completion, FinishReason, Group, GroupSink, GroupTiming, PolicyVersion, Prompt, RolloutEngine,
    RolloutRequest, RunSeed, TokenId, WeightSnapshot,
};
use tokio::sync::Semaphore;

use super::types::{Choice, CompletionRequest, CompletionResponse, PromptInput, StopInput};
use super::version_from_fingerprint;
use super::weight_sync::{HookContext, WeightUpdateHook};
use crate::{Error, OpenAiClientConfig, Result, SamplingConfig};

/// Seeds sent to servers without the `prompt_ids` extension stay below 2^62: vLLM
/// takes a signed 64-bit seed (and would add a choice index to it for `n > 1`).
const FOREIGN_SEED_MASK: u64 = (1 << 62) - 1;

/// One server of the pool.
#[derive(Debug)]
struct Endpoint {
    /// Base URL without a trailing slash.
    url: String,
    /// Requests sent to it and not yet answered.
    in_flight: AtomicUsize,
    /// Whether it holds the client's current weights: a server whose weight update
    /// failed, or that answered with other weights, gets no request until the next
    /// update reaches it.
    synced: AtomicBool,
    /// Whether it holds weights this client gave it (its last update succeeded and no
    /// answer since came from other weights). Until then an update may take it back
    /// to an older version ([`HookContext::allow_older`]).
    ours: AtomicBool,
}

/// Counts a request in flight on an endpoint for as long as it lives.
struct InFlight<'a>(&'a Endpoint);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A rollout engine backed by OpenAI-compatible servers: one `/v1/completions`
/// request per prompt with `n` = group size (one per response, `n` = 1, for servers
/// without `prompt_ids`), at most `max_concurrency` groups in flight over all endpoints, each sent to the endpoint with the fewest requests in flight (ties
/// taken in turn) and retried on another one when it fails; groups are emitted as
/// their requests return. [`RolloutEngine::install_weights`] brings every endpoint to
/// the new weights through the [`WeightUpdateHook`].
#[derive(Debug)]
pub struct OpenAiEngine {
    config: OpenAiClientConfig,
    sampling: SamplingConfig,
    seed: RunSeed,
    http: reqwest::Client,
    endpoints: Vec<Endpoint>,
    /// Where the next tie among endpoints is broken.
    turn: AtomicUsize,
    permits: Semaphore,
    version: AtomicU64,
    hook: Box<dyn WeightUpdateHook>,
}

impl OpenAiEngine {
    /// A client for `config.endpoints` sampling as `sampling` says from the run seed
    /// `seed`, starting at `version`, with `hook` for weight updates. Errors name the
    /// field at fault.
    pub fn new(
        config: OpenAiClientConfig,
        sampling: SamplingConfig,
        seed: RunSeed,
        version: PolicyVersion,
        hook: impl WeightUpdateHook + 'static,
    ) -> Result<Self> {
        config.validate(&sampling)?;
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(key) = &config.api_key {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", key.expose()))
                .map_err(|_| Error::config("openai.api_key", "holds characters a header cannot carry"))?;
            value.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(config.timeout_s))
            .default_headers(headers)
            .build()
            .map_err(|e| Error::Http { url: config.endpoints.join(", "), reason: e.to_string() })?;
        let endpoints = config
            .endpoints
            .iter()
            .map(|url| Endpoint {
                url: url.trim_end_matches('/').to_owned(),
                in_flight: AtomicUsize::new(0),
                synced: AtomicBool::new(true),
                ours: AtomicBool::new(false),
            })
            .collect();
        Ok(Self {
            permits: Semaphore::new(config.max_concurrency),
            http,
            endpoints,
            turn: AtomicUsize::new(0),
            version: AtomicU64::new(version.0),
            hook: Box::new(hook),
            sampling,
            seed,
            config,
        })
    }

    /// The endpoints' base URLs with whether each holds the current weights.
    #[must_use]
    pub fn endpoint_status(&self) -> Vec<(String, bool)> {
        self.endpoints.iter().map(|e| (e.url.clone(), e.synced.load(Ordering::Relaxed))).collect()
    }

    /// The requests of one prompt's group. With `prompt_ids` our server derives each
    /// response's seed from the run seed as the native engine does: one request with
    /// `n` = group size. Other servers get one request per response (`n` = 1) seeded
    /// with that response's own `sample_seed(run, version, prompt, j)`: how they seed
    /// the choices of one request with `n > 1` is theirs (SGLang documents none), and
    /// the same seed for every choice would make a group's responses equal. Their
    /// prefix caches share the prompt's prefill between the requests.
    fn requests_for(&self, prompt: &Prompt, n: u32, version: PolicyVersion) -> Vec<CompletionRequest> {
        if self.config.send_prompt_ids {
            return vec![self.request_for(prompt, n, self.seed.0)];
        }
        (0..n)
            .map(|j| {
                let seed = metronome_core::sample_seed(self.seed, version, prompt.id, j) & FOREIGN_SEED_MASK;
                self.request_for(prompt, 1, seed)
            })
            .collect()
    }

    fn request_for(&self, prompt: &Prompt, n: u32, seed: u64) -> CompletionRequest {
        let s = &self.sampling;
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
            seed: Some(seed),
            stop: (!s.stop_strings.is_empty()).then(|| StopInput::Many(s.stop_strings.clone())),
            stop_token_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos.then_some(true),
            include_stop_str_in_output: s.include_stop_str_in_output.then_some(true),
            logprobs: Some(0),
            return_tokens_as_token_ids: Some(true),
            return_token_ids: Some(true),
            prompt_ids: self.config.send_prompt_ids.then(|| vec![prompt.id.0]),
            stream: None,
            echo: None,
        }
    }

    /// The endpoint for the next attempt: among those holding the current weights and
    /// not yet `tried` by this request (all of them again once each was tried), the
    /// one with the fewest requests in flight; ties go in turn.
    fn pick(&self, tried: &[usize]) -> Option<usize> {
        let synced: Vec<usize> =
            (0..self.endpoints.len()).filter(|&i| self.endpoints[i].synced.load(Ordering::Relaxed)).collect();
        let untried: Vec<usize> = synced.iter().copied().filter(|i| !tried.contains(i)).collect();
        let pool = if untried.is_empty() { synced } else { untried };
        let start = self.turn.fetch_add(1, Ordering::Relaxed);
        let n = self.endpoints.len();
        (0..n)
            .map(|k| (start + k) % n)
            .filter(|i| pool.contains(i))
            .min_by_key(|&i| self.endpoints[i].in_flight.load(Ordering::Relaxed))
    }

    /// Posts `body` for `prompt`, retrying transport errors, timeouts, 429, 5xx and
    /// answers from other weights with backoff, each retry on another endpoint when
    /// there is one. The response and the version it was sampled with.
    async fn post(
        &self,
        body: &CompletionRequest,
        expected: PolicyVersion,
    ) -> Result<(CompletionResponse, String)> {
        let json = body.to_json();
        let mut tried = Vec::new();
        let mut attempt = 0;
        loop {
            let Some(i) = self.pick(&tried) else {
                return Err(Error::Http {
                    url: self.config.endpoints.join(", "),
                    reason: "no endpoint holds the current weights (every weight update failed)".into(),
                });
            };
            tried.push(i);
            let endpoint = &self.endpoints[i];
            let url = format!("{}/v1/completions", endpoint.url);
            endpoint.in_flight.fetch_add(1, Ordering::Relaxed);
            let guard = InFlight(endpoint);
            let err = match self.http.post(&url).json(&json).send().await {
                Ok(resp) if resp.status().is_success() => {
                    let resp: CompletionResponse = resp
                        .json()
                        .await
                        .map_err(|e| Error::Response { url: url.clone(), reason: e.to_string() })?;
                    match self.check_version(&resp, expected) {
                        Ok(()) => return Ok((resp, url)),
                        Err(reason) => {
                            // Off-policy samples would be trained as on-policy: this
                            // server gets nothing more until it is updated again.
                            endpoint.synced.store(false, Ordering::Relaxed);
                            endpoint.ours.store(false, Ordering::Relaxed);
                            Error::Response { url: url.clone(), reason }
                        }
                    }
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
                Err(e) => {
                    Error::Http { url: url.clone(), reason: metronome_core::ErrorChain(&e).to_string() }
                }
            };
            drop(guard);
            if attempt >= self.config.max_retries {
                return Err(err);
            }
            tracing::warn!(%url, attempt, error = %err, "completion request failed, retrying");
            crate::metrics::http_retry();
            tokio::time::sleep(Duration::from_millis(self.config.retry_backoff_ms << attempt.min(16))).await;
            attempt += 1;
        }
    }

    /// Refuses an answer from our server on weights other than the ones it was given
    /// (only when the client updates weights: otherwise the server's are its own).
    fn check_version(&self, resp: &CompletionResponse, expected: PolicyVersion) -> Result<(), String> {
        if self.config.weight_sync != crate::WeightSync::Metronome {
            return Ok(());
        }
        match resp.system_fingerprint.as_deref().and_then(version_from_fingerprint) {
            Some(v) if v != expected => {
                Err(format!("the server sampled with weights of version {v}, expected {expected}"))
            }
            _ => Ok(()),
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
        let expected = PolicyVersion(self.version.load(Ordering::Relaxed));
        let bodies = self.requests_for(&prompt, n, expected);
        let answers =
            futures::future::try_join_all(bodies.iter().map(|body| self.post(body, expected))).await?;
        let mut completions = Vec::with_capacity(n as usize);
        for ((resp, url), body) in answers.into_iter().zip(&bodies) {
            // Our server says which weights sampled; for the others, the version the
            // client last brought them to.
            let version =
                resp.system_fingerprint.as_deref().and_then(version_from_fingerprint).unwrap_or(expected);
            let asked = body.n.unwrap_or(1);
            let mut choices = resp.choices;
            choices.sort_by_key(|c| c.index);
            if choices.len() != asked as usize {
                return Err(Error::Response {
                    url,
                    reason: format!("{} choices for n = {asked}", choices.len()),
                });
            }
            for choice in choices {
                let index = completions.len() as u32;
                completions.push(completion_of(index, choice, version, &url)?);
            }
        }
        Ok(Group {
            period,
            prompt,
            completions,
            timing: GroupTiming { started_s, finished_s: t0.elapsed().as_secs_f64() },
        })
    }
}

/// One API choice as a completion: its token ids (`token_ids` of vLLM's and SGLang's
/// `return_token_ids`, or the `token_id:<id>` strings of vLLM's
/// `return_tokens_as_token_ids`) and their log-probs.
fn completion_of(i: u32, choice: Choice, version: PolicyVersion, url: &str) -> Result<Completion> {
    let bad = |reason: String| Error::Response { url: url.to_owned(), reason };
    let lp = choice.logprobs.ok_or_else(|| bad(format!("choice {i} has no logprobs")))?;
    let tokens = match choice.token_ids {
        Some(ids) => ids,
        None => lp
            .tokens
            .iter()
            .map(|t| {
                t.strip_prefix("token_id:").and_then(|id| id.parse::<TokenId>().ok()).ok_or_else(|| {
                    bad(format!(
                        "choice {i} token `{t}` is not `token_id:<id>` and the choice has no token_ids (the \
                         server ignores return_tokens_as_token_ids and return_token_ids)"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?,
    };
    if tokens.len() != lp.token_logprobs.len() {
        return Err(bad(format!(
            "choice {i} has {} tokens but {} log-probs",
            tokens.len(),
            lp.token_logprobs.len()
        )));
    }
    // vLLM names what stopped a choice in `stop_reason`, SGLang in `matched_stop`.
    let stop = choice.stop_reason.as_ref().or(choice.matched_stop.as_ref());
    let finish_reason = match (choice.finish_reason.as_deref(), stop) {
        (Some("length"), _) => FinishReason::Length,
        (Some("stop"), Some(serde_json::Value::String(_))) => FinishReason::StopString,
        (Some("stop"), _) => FinishReason::Stop,
        _ => FinishReason::Aborted,
    };
    Ok(Completion {
        sample_index: i,
        tokens,
        logprobs: lp.token_logprobs,
        text: choice.text,
        finish_reason,
        version,
        switches: Vec::new(),
        episode: None,
    })
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

    /// Exports the weights once, then has every endpoint load them (concurrently). An
    /// endpoint that fails is left out of generation until a later update reaches it;
    /// the update fails only when no endpoint took it.
    async fn install_weights(&self, weights: Arc<WeightSnapshot>) -> metronome_core::Result<()> {
        let version = weights.version;
        self.hook.export(weights).await?;
        let loads = self.endpoints.iter().map(|e| async move {
            let allow_older = !e.ours.load(Ordering::Relaxed);
            let ctx = HookContext { http: &self.http, base_url: &e.url, allow_older };
            let result = self.hook.load(&ctx, version).await;
            e.synced.store(result.is_ok(), Ordering::Relaxed);
            e.ours.store(result.is_ok(), Ordering::Relaxed);
            result
        });
        let results = futures::future::join_all(loads).await;
        let failed: Vec<String> = results
            .iter()
            .zip(&self.endpoints)
            .filter_map(|(r, e)| {
                r.as_ref().err().map(|err| format!("{}: {}", e.url, metronome_core::ErrorChain(err)))
            })
            .collect();
        if failed.len() == self.endpoints.len() {
            return Err(Error::Http {
                url: self.config.endpoints.join(", "),
                reason: format!("no endpoint took the weights of version {version}: {}", failed.join("; ")),
            }
            .into());
        }
        for f in &failed {
            tracing::warn!(
                version = version.0,
                "weight update failed, endpoint left out until the next: {f}"
            );
        }
        self.version.store(version.0, Ordering::Relaxed);
        Ok(())
    }

    fn version(&self) -> PolicyVersion {
        PolicyVersion(self.version.load(Ordering::Relaxed))
    }
}
