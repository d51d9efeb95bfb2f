//! A remote scorer: one JSON request per group to a reward model served elsewhere,
//! with a timeout, retries with exponential backoff, and a concurrency limit.
//!
//! Request (`POST url`, `application/json`):
//! `{"prompt_id": 7, "prompt": "…", "reference": "…" | null, "metadata": {…}, "completions": ["…", …]}`.
//! Response: `{"rewards": [r, …]}` with one entry per completion, in order, each a
//! number or `{"total": r, "parts": {"name": r, …}}`.
//!
//! Connection errors, timeouts, `429` and `5xx` are retried; other statuses and
//! malformed or oversized bodies are not (retrying cannot fix them). When every attempt failed the
//! whole group gets the configured failure score with the reason, counted as
//! `metronome_reward_failures_total{reason="remote"}`: the run goes on.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use metronome_core::{AdvantageEstimator, Group, GroupScorer, PromptId, Reward, ScoredGroup, mix64};

use crate::http::{self, Attempt, Backoff};
use crate::{Error, Result, metrics};

/// Configuration of [`RemoteScorer`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// The scoring endpoint, e.g. `http://rm.internal:8000/score` (plain HTTP only).
    pub url: String,
    /// Time limit of one attempt (connect, send, and read the response), in milliseconds.
    pub timeout_ms: u64,
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// Delay before the first retry, in milliseconds; doubled after every retry.
    pub backoff_initial_ms: u64,
    /// Largest delay between retries, in milliseconds.
    pub backoff_max_ms: u64,
    /// Requests in flight at once, over all groups.
    pub max_concurrency: usize,
    /// Larger response bodies are refused (not retried).
    pub max_response_bytes: usize,
    /// Score of every completion of a group whose scoring failed.
    pub failure_score: f32,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            timeout_ms: 30_000,
            max_retries: 3,
            backoff_initial_ms: 200,
            backoff_max_ms: 5_000,
            max_concurrency: 8,
            max_response_bytes: 16 << 20,
            failure_score: 0.0,
        }
    }
}

impl RemoteConfig {
    /// Checks the values and builds the scorer (no connection is made yet).
    pub fn build(&self) -> Result<RemoteScorer> {
        // The workspace builds reqwest without a TLS backend (no native libraries, no
        // certificates to manage), so only plain HTTP is accepted: put reward models on a
        // private network or behind a local TLS-terminating proxy.
        if !self.url.starts_with("http://") {
            return Err(Error::config(
                "remote.url",
                format!("must be an http:// URL (https is not built in), got `{}`", self.url),
            ));
        }
        if self.timeout_ms == 0 {
            return Err(Error::config("remote.timeout_ms", "must be positive"));
        }
        if self.max_response_bytes == 0 {
            return Err(Error::config("remote.max_response_bytes", "must be positive"));
        }
        if self.max_concurrency == 0 {
            return Err(Error::config("remote.max_concurrency", "must be at least 1"));
        }
        if self.backoff_max_ms < self.backoff_initial_ms {
            return Err(Error::config("remote.backoff_max_ms", "must be >= backoff_initial_ms"));
        }
        if !self.failure_score.is_finite() {
            return Err(Error::config("remote.failure_score", "must be finite"));
        }
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(self.timeout_ms))
            .build()
            .map_err(|error| Error::Remote { url: self.url.clone(), error })?;
        Ok(RemoteScorer {
            client,
            limit: Arc::new(Semaphore::new(self.max_concurrency)),
            config: self.clone(),
            estimator: AdvantageEstimator::default(),
        })
    }
}

/// The JSON body sent for one group.
#[derive(Debug, Serialize)]
pub struct RemoteRequest<'a> {
    /// The prompt's id.
    pub prompt_id: PromptId,
    /// The prompt text.
    pub prompt: &'a str,
    /// The reference answer, if any.
    pub reference: Option<&'a str>,
    /// The prompt's metadata.
    pub metadata: &'a BTreeMap<String, String>,
    /// The completions' texts, in order.
    pub completions: Vec<&'a str>,
}

/// The JSON body expected back.
#[derive(Debug, Deserialize)]
pub struct RemoteResponse {
    /// One reward per completion, in order.
    pub rewards: Vec<RemoteReward>,
}

/// One reward in a [`RemoteResponse`].
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RemoteReward {
    /// A bare score.
    Scalar(f32),
    /// A score with a breakdown.
    Full {
        /// The score.
        total: f32,
        /// Named parts.
        #[serde(default)]
        parts: BTreeMap<String, f32>,
    },
}

/// Scores groups with a reward model behind HTTP (see the module docs).
#[derive(Debug, Clone)]
pub struct RemoteScorer {
    client: reqwest::Client,
    limit: Arc<Semaphore>,
    config: RemoteConfig,
    estimator: AdvantageEstimator,
}

impl RemoteScorer {
    /// Computes advantages with `estimator` (GRPO's by default). Not a key of
    /// [`RemoteConfig`]: a run has one estimator, and it is the trainer's.
    #[must_use]
    pub fn with_estimator(mut self, estimator: AdvantageEstimator) -> Self {
        self.estimator = estimator;
        self
    }

    /// The delay before retry number `retry` (0-based) of the group `key`: exponential
    /// up to the cap, with deterministic "equal jitter" (half fixed, half spread by a
    /// hash of the group and the retry) so groups that failed together do not retry
    /// together.
    #[must_use]
    pub fn backoff(&self, retry: u32, key: u64) -> Duration {
        self.backoff_policy().delay(retry, key)
    }

    fn backoff_policy(&self) -> Backoff {
        Backoff { initial_ms: self.config.backoff_initial_ms, max_ms: self.config.backoff_max_ms }
    }

    async fn attempt(&self, request: &RemoteRequest<'_>, expected: usize) -> Attempt<Vec<Reward>> {
        // The semaphore is never closed, so acquiring only waits.
        let Ok(_permit) = self.limit.acquire().await else {
            return Attempt::Fatal("concurrency limiter closed".into());
        };
        let response = match http::response(self.client.post(&self.config.url).json(request).send().await) {
            Ok(r) => r,
            Err(failed) => return failed,
        };
        let body = match http::body(response, self.config.max_response_bytes).await {
            Ok(body) => body,
            Err(failed) => return failed,
        };
        let parsed: RemoteResponse = match serde_json::from_slice(&body) {
            Ok(p) => p,
            Err(e) => return Attempt::Fatal(format!("malformed response: {e}")),
        };
        if parsed.rewards.len() != expected {
            return Attempt::Fatal(format!(
                "returned {} rewards for {expected} completions",
                parsed.rewards.len()
            ));
        }
        let rewards: Vec<Reward> = parsed
            .rewards
            .into_iter()
            .map(|r| match r {
                RemoteReward::Scalar(total) => Reward::scalar(total),
                RemoteReward::Full { total, parts } => Reward { total, parts, failure: None },
            })
            .collect();
        if let Some(bad) = rewards.iter().position(|r| !r.total.is_finite()) {
            return Attempt::Fatal(format!("reward {bad} is not finite"));
        }
        Attempt::Done(rewards)
    }

    /// Scores the completions of `group`, retrying as configured; `Err` carries the
    /// reason of the last failed attempt.
    pub async fn rewards(&self, group: &Group) -> Result<Vec<Reward>, String> {
        let request = RemoteRequest {
            prompt_id: group.prompt.id,
            prompt: &group.prompt.text,
            reference: group.prompt.reference.as_deref(),
            metadata: &group.prompt.metadata,
            completions: group.completions.iter().map(|c| c.text.as_str()).collect(),
        };
        let key = mix64(group.period.0 ^ mix64(group.prompt.id.0));
        let on_retry = |reason: &str| {
            tracing::debug!(url = %self.config.url, %reason, "retrying remote reward");
            metrics::remote_retry();
        };
        let n = group.completions.len();
        http::with_retries(self.config.max_retries, self.backoff_policy(), key, on_retry, || {
            self.attempt(&request, n)
        })
        .await
    }
}

#[async_trait]
impl GroupScorer for RemoteScorer {
    async fn score(&self, group: Group) -> metronome_core::Result<ScoredGroup> {
        let started = Instant::now();
        let n = group.completions.len();
        let rewards = match self.rewards(&group).await {
            Ok(rewards) => rewards,
            Err(reason) => {
                metrics::failure("remote", n as u64);
                let reward = Reward::failed(
                    self.config.failure_score,
                    format!("remote scorer {}: {reason}", self.config.url),
                );
                vec![reward; n]
            }
        };
        metrics::group_scored(n, started.elapsed());
        ScoredGroup::new(group, rewards, self.estimator)
    }
}
