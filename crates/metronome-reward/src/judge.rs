//! A judge model as the reward: each completion graded against a rubric by a model
//! behind an OpenAI-compatible completions endpoint (vLLM, SGLang, `metronome serve`).
//!
//! The request is `POST {url}/v1/completions` with the rubric template filled in:
//! `{prompt}`, `{completion}`, `{reference}` and `{score_format}`, the instruction that
//! says how to write the score. The score is read strictly: the reply's last non-empty
//! line must be `SCORE: <n>` with `n` a whole number from `min_score` to `max_score`;
//! anything else is a malformed judgement. The reward is the score scaled to 0..1
//! (also the part `judge`).
//!
//! A judge cannot hang a period: each request has a timeout and bounded retries with
//! backoff (the pieces [`crate::RemoteScorer`] uses), requests in flight are limited,
//! and a whole group has a deadline (`group_timeout_ms`). A completion that could not
//! be graded gets the configured [`JudgeFailure`] policy, counted in
//! `metronome_reward_judge_failures_total{policy}`: the failure score, or the group is
//! dropped (its rewards are not finite, which the trainer refuses with the reason: the
//! group is counted as rejected and its period completes without it). Judgements are
//! cached by (prompt, completion, rubric, judge model), so a repeated completion costs
//! nothing. At build time the judge is asked for its models (`GET {url}/v1/models`),
//! so an unreachable judge or a wrong model name is an error at start-up.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use metronome_core::{AdvantageEstimator, Group, GroupScorer, Reward, ScoredGroup, Secret, mix64};

use crate::http::{self, Attempt, Backoff};
use crate::{Error, Result, metrics};

/// What happens to a completion the judge could not grade.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgeFailure {
    /// It gets `failure_score`, with the reason; the rest of its group keeps its grades.
    #[default]
    Score,
    /// Its whole group is left out of training (every reward of the group becomes NaN
    /// with the reason, which the trainer refuses and counts as rejected).
    Drop,
}

impl JudgeFailure {
    fn label(self) -> &'static str {
        match self {
            Self::Score => "score",
            Self::Drop => "drop",
        }
    }
}

/// The rubric used when the config gives none.
pub const DEFAULT_TEMPLATE: &str = "You are a strict grader. Grade the response to the task below.\n\n\
    Task:\n{prompt}\n\nReference answer (may be empty):\n{reference}\n\nResponse:\n{completion}\n\n\
    Judge correctness first, then clarity. {score_format}\n";

/// Configuration of [`JudgeScorer`].
///
/// ```toml
/// [reward]
/// kind = "judge"
/// url = "http://judge.internal:8000"
/// model = "judge"
/// template_file = "rubrics/helpful.txt"
/// on_failure = "drop"
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JudgeConfig {
    /// The server's base URL (`http://host:port`; plain HTTP only); requests go to
    /// `{url}/v1/completions`.
    pub url: String,
    /// The model name the server serves.
    pub model: String,
    /// Sent as `Authorization: Bearer <api_key>`.
    pub api_key: Option<Secret>,
    /// The rubric template (see the module docs for its slots); `template_file`
    /// instead reads it from a file; neither: [`DEFAULT_TEMPLATE`].
    pub template: Option<String>,
    /// A file holding the rubric template.
    pub template_file: Option<PathBuf>,
    /// The lowest score the judge may give.
    pub min_score: i64,
    /// The highest score the judge may give.
    pub max_score: i64,
    /// Tokens the judge may write.
    pub max_tokens: u32,
    /// The judge's sampling temperature (0: greedy).
    pub temperature: f32,
    /// Time limit of one request, in milliseconds.
    pub timeout_ms: u64,
    /// Retries after the first attempt (refused connections, timeouts, `429`, `5xx`).
    pub max_retries: u32,
    /// Delay before the first retry, in milliseconds; doubled after every retry.
    pub backoff_initial_ms: u64,
    /// Largest delay between retries, in milliseconds.
    pub backoff_max_ms: u64,
    /// Requests in flight at once, over all groups.
    pub max_concurrency: usize,
    /// Larger response bodies are refused.
    pub max_response_bytes: usize,
    /// Time limit of one whole group's judging, in milliseconds: completions not graded
    /// by then fail.
    pub group_timeout_ms: u64,
    /// Judgements kept in the cache (0: no cache).
    pub cache_entries: usize,
    /// What a completion the judge could not grade gets.
    pub on_failure: JudgeFailure,
    /// The score under [`JudgeFailure::Score`].
    pub failure_score: f32,
    /// Ask the server for its models when the scorer is built.
    pub probe: bool,
}

impl Default for JudgeConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            model: String::new(),
            api_key: None,
            template: None,
            template_file: None,
            min_score: 0,
            max_score: 10,
            max_tokens: 512,
            temperature: 0.0,
            timeout_ms: 60_000,
            max_retries: 2,
            backoff_initial_ms: 200,
            backoff_max_ms: 5_000,
            max_concurrency: 16,
            max_response_bytes: 1 << 20,
            group_timeout_ms: 300_000,
            cache_entries: 65_536,
            on_failure: JudgeFailure::Score,
            failure_score: 0.0,
            probe: true,
        }
    }
}

impl JudgeConfig {
    /// The rubric template: inline, from its file, or the default; checked for its
    /// slots. Errors name the key, and the file.
    pub fn template(&self) -> Result<String> {
        let (template, place) = match (&self.template, &self.template_file) {
            (Some(_), Some(_)) => {
                return Err(Error::config(
                    "judge.template",
                    "and `judge.template_file` are both set; keep one",
                ));
            }
            (Some(t), None) => (t.clone(), "judge.template".to_owned()),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    Error::config("judge.template_file", format!("cannot read `{}`: {e}", path.display()))
                })?;
                (text, format!("judge.template_file ({})", path.display()))
            }
            (None, None) => (DEFAULT_TEMPLATE.to_owned(), "judge.template".to_owned()),
        };
        for (slot, why) in [
            ("{score_format}", "where the judge is told how to write its score (`SCORE: <n>`)"),
            ("{completion}", "where the graded completion goes"),
        ] {
            if !template.contains(slot) {
                return Err(Error::config(place, format!("has no `{slot}` slot, {why}")));
            }
        }
        Ok(template)
    }

    fn check(&self) -> Result<()> {
        if !self.url.starts_with("http://") {
            return Err(Error::config(
                "judge.url",
                format!("must be an http:// URL (https is not built in), got `{}`", self.url),
            ));
        }
        if self.model.is_empty() {
            return Err(Error::config("judge.model", "is empty"));
        }
        if self.min_score >= self.max_score {
            return Err(Error::config("judge.max_score", "must be larger than judge.min_score"));
        }
        let positive = [
            ("judge.timeout_ms", self.timeout_ms),
            ("judge.group_timeout_ms", self.group_timeout_ms),
            ("judge.max_tokens", u64::from(self.max_tokens)),
            ("judge.max_concurrency", self.max_concurrency as u64),
            ("judge.max_response_bytes", self.max_response_bytes as u64),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(Error::config(*field, "must be positive"));
        }
        if self.backoff_max_ms < self.backoff_initial_ms {
            return Err(Error::config("judge.backoff_max_ms", "must be >= backoff_initial_ms"));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::config("judge.temperature", "must be a finite number >= 0"));
        }
        crate::error::finite_scores(&[("judge.failure_score", self.failure_score)])
    }

    /// Checks the values and the template, builds the client and (with `probe`) asks
    /// the server for its models: an unreachable judge or an unknown model is an error.
    pub fn build(&self) -> Result<JudgeScorer> {
        self.check()?;
        let template = self.template()?;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(self.timeout_ms))
            .build()
            .map_err(|error| Error::Remote { url: self.url.clone(), error })?;
        let scorer = JudgeScorer {
            inner: Arc::new(Inner {
                client,
                limit: Semaphore::new(self.max_concurrency),
                template,
                cache: Mutex::new(Cache::default()),
                config: self.clone(),
            }),
            estimator: AdvantageEstimator::default(),
        };
        if self.probe {
            scorer.probe()?;
        }
        Ok(scorer)
    }
}

/// A bounded map of judgements, the oldest evicted first.
#[derive(Debug, Default)]
struct Cache {
    scores: HashMap<[u8; 32], f32>,
    order: VecDeque<[u8; 32]>,
}

#[derive(Debug)]
struct Inner {
    client: reqwest::Client,
    limit: Semaphore,
    template: String,
    cache: Mutex<Cache>,
    config: JudgeConfig,
}

/// Grades completions with a judge model (see the module docs); a
/// [`GroupScorer`], like [`crate::RemoteScorer`].
#[derive(Debug, Clone)]
pub struct JudgeScorer {
    inner: Arc<Inner>,
    estimator: AdvantageEstimator,
}

/// The instruction that fills `{score_format}`.
fn score_format(min: i64, max: i64) -> String {
    format!(
        "End your reply with a last line of exactly the form `SCORE: <n>`, where <n> is a whole number from {min} to {max}."
    )
}

/// The score in a judge's reply: its last non-empty line must be `SCORE: <n>`, with
/// `n` a whole number in `min..=max`.
pub fn parse_score(reply: &str, min: i64, max: i64) -> std::result::Result<i64, String> {
    let Some(last) = reply.lines().map(str::trim).rev().find(|l| !l.is_empty()) else {
        return Err("the reply is empty".into());
    };
    let clipped: String = last.chars().take(60).collect();
    let Some(value) = last.strip_prefix("SCORE:") else {
        return Err(format!("the last line `{clipped}` is not `SCORE: <n>`"));
    };
    let n: i64 = value.trim().parse().map_err(|_| format!("`{clipped}` does not hold a whole number"))?;
    if !(min..=max).contains(&n) {
        return Err(format!("score {n} is outside {min}..={max}"));
    }
    Ok(n)
}

impl Inner {
    fn render(&self, group: &Group, completion: &str) -> String {
        // One pass, so that text inside a slot's value is never taken for a slot.
        let c = &self.config;
        let values = [
            ("{prompt}", group.prompt.text.as_str()),
            ("{completion}", completion),
            ("{reference}", group.prompt.reference.as_deref().unwrap_or("")),
        ];
        let format = score_format(c.min_score, c.max_score);
        let mut out = String::with_capacity(self.template.len() + completion.len() + group.prompt.text.len());
        let mut rest = self.template.as_str();
        while let Some(at) = rest.find('{') {
            out.push_str(&rest[..at]);
            rest = &rest[at..];
            let slot = values
                .iter()
                .copied()
                .chain([("{score_format}", format.as_str())])
                .find(|(s, _)| rest.starts_with(s));
            match slot {
                Some((s, value)) => {
                    out.push_str(value);
                    rest = &rest[s.len()..];
                }
                None => {
                    out.push('{');
                    rest = &rest[1..];
                }
            }
        }
        out.push_str(rest);
        out
    }

    fn cache_key(&self, rendered: &str) -> [u8; 32] {
        let mut hash = Sha256::new();
        hash.update(self.config.model.as_bytes());
        hash.update([0]);
        hash.update(rendered.as_bytes());
        hash.finalize().into()
    }

    fn cached(&self, key: &[u8; 32]) -> Option<f32> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner).scores.get(key).copied()
    }

    fn remember(&self, key: [u8; 32], score: f32) {
        let capacity = self.config.cache_entries;
        if capacity == 0 {
            return;
        }
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.scores.insert(key, score).is_none() {
            cache.order.push_back(key);
        }
        while cache.order.len() > capacity {
            if let Some(old) = cache.order.pop_front() {
                cache.scores.remove(&old);
            }
        }
    }

    async fn attempt(&self, body: &serde_json::Value) -> Attempt<i64> {
        let c = &self.config;
        // The semaphore is never closed, so acquiring only waits.
        let Ok(_permit) = self.limit.acquire().await else {
            return Attempt::Fatal("concurrency limiter closed".into());
        };
        let started = Instant::now();
        let mut request =
            self.client.post(format!("{}/v1/completions", c.url.trim_end_matches('/'))).json(body);
        if let Some(key) = &c.api_key {
            request = request.bearer_auth(key.expose());
        }
        let outcome = match http::response(request.send().await) {
            Ok(response) => match http::body(response, c.max_response_bytes).await {
                Ok(body) => self.read(&body),
                Err(failed) => failed,
            },
            Err(failed) => failed,
        };
        let label = match &outcome {
            Attempt::Done(_) => "ok",
            Attempt::Fatal(reason) if reason.starts_with("malformed") => "malformed",
            Attempt::Retry(reason) | Attempt::Fatal(reason) if reason.starts_with("timed out") => "timeout",
            _ => "error",
        };
        metrics::judge_request(label, started.elapsed());
        outcome
    }

    /// The score in a completions response.
    fn read(&self, body: &[u8]) -> Attempt<i64> {
        let c = &self.config;
        let value: serde_json::Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return Attempt::Fatal(format!("malformed response: not JSON: {e}")),
        };
        let Some(text) = value["choices"][0]["text"].as_str() else {
            return Attempt::Fatal("malformed response: no `choices[0].text`".into());
        };
        match parse_score(text, c.min_score, c.max_score) {
            Ok(n) => Attempt::Done(n),
            Err(reason) => Attempt::Fatal(format!("malformed judgement: {reason}")),
        }
    }

    /// The grade of one completion (0..1), or why there is none.
    async fn grade(&self, group: &Group, index: usize) -> std::result::Result<f32, String> {
        let c = &self.config;
        let rendered = self.render(group, &group.completions[index].text);
        let key = self.cache_key(&rendered);
        if let Some(score) = self.cached(&key) {
            metrics::judge_cache_hit();
            return Ok(score);
        }
        let body = serde_json::json!({
            "model": c.model,
            "prompt": rendered,
            "max_tokens": c.max_tokens,
            "temperature": c.temperature,
            "n": 1,
        });
        let backoff = Backoff { initial_ms: c.backoff_initial_ms, max_ms: c.backoff_max_ms };
        let retry_key = mix64(u64::from_le_bytes(key[..8].try_into().unwrap_or_default()));
        let on_retry = |reason: &str| tracing::debug!(url = %c.url, %reason, "retrying the judge");
        let n =
            http::with_retries(c.max_retries, backoff, retry_key, on_retry, || self.attempt(&body)).await?;
        let score = (n - c.min_score) as f32 / (c.max_score - c.min_score) as f32;
        self.remember(key, score);
        Ok(score)
    }
}

impl JudgeScorer {
    /// Computes advantages with `estimator` (GRPO's by default). Not a key of
    /// [`JudgeConfig`]: a run has one estimator, and it is the trainer's.
    #[must_use]
    pub fn with_estimator(mut self, estimator: AdvantageEstimator) -> Self {
        self.estimator = estimator;
        self
    }

    /// Asks the server for its models on a thread of its own (the caller may be on an
    /// async runtime or not), within the request timeout.
    fn probe(&self) -> Result<()> {
        let inner = Arc::clone(&self.inner);
        let c = &self.inner.config;
        let fail = |reason: String| Error::Judge { url: c.url.clone(), reason };
        let listed = std::thread::spawn(move || -> std::result::Result<Vec<String>, String> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("could not start a runtime to probe it: {e}"))?;
            runtime.block_on(async {
                let c = &inner.config;
                let mut request = inner.client.get(format!("{}/v1/models", c.url.trim_end_matches('/')));
                if let Some(key) = &c.api_key {
                    request = request.bearer_auth(key.expose());
                }
                let response = http::response::<()>(request.send().await).map_err(|failed| match failed {
                    Attempt::Retry(r) | Attempt::Fatal(r) => r,
                    Attempt::Done(()) => String::new(),
                })?;
                let body: serde_json::Value =
                    response.json().await.map_err(|e| format!("answered with no model list: {e}"))?;
                Ok(body["data"]
                    .as_array()
                    .map(|models| models.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
                    .unwrap_or_default())
            })
        })
        .join()
        .map_err(|_| fail("the probe thread panicked".into()))?
        .map_err(|reason| {
            fail(format!("did not answer GET /v1/models ({reason}); is the judge server up?"))
        })?;
        if !listed.contains(&c.model) {
            return Err(fail(format!(
                "does not serve the model `{}` (judge.model); it serves {listed:?}",
                c.model
            )));
        }
        Ok(())
    }

    /// Grades every completion of `group`: a score in 0..1 each, or the reason it has
    /// none. Never takes longer than `group_timeout_ms`.
    pub async fn grades(&self, group: &Group) -> Vec<std::result::Result<f32, String>> {
        let n = group.completions.len();
        let group = Arc::new(group.clone());
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..n {
            let (inner, group) = (Arc::clone(&self.inner), Arc::clone(&group));
            tasks.spawn(async move { (i, inner.grade(&group, i).await) });
        }
        let deadline = Duration::from_millis(self.inner.config.group_timeout_ms);
        let mut grades: Vec<std::result::Result<f32, String>> =
            vec![Err(format!("not graded within group_timeout_ms ({} ms)", deadline.as_millis())); n];
        let _ = tokio::time::timeout(deadline, async {
            while let Some(joined) = tasks.join_next().await {
                match joined {
                    Ok((i, grade)) => grades[i] = grade,
                    Err(e) => tracing::error!("a judge task failed: {e}"),
                }
            }
        })
        .await;
        // Dropping the set aborts what is still running.
        grades
    }
}

#[async_trait]
impl GroupScorer for JudgeScorer {
    async fn score(&self, group: Group) -> metronome_core::Result<ScoredGroup> {
        let started = Instant::now();
        let c = &self.inner.config;
        let grades = self.grades(&group).await;
        let failed = grades.iter().filter(|g| g.is_err()).count();
        let rewards: Vec<Reward> = if failed > 0 && c.on_failure == JudgeFailure::Drop {
            let reason = grades.iter().find_map(|g| g.as_ref().err()).cloned().unwrap_or_default();
            let reason = format!(
                "judge {}: {failed} of {} not graded, the group is dropped: {reason}",
                c.url,
                grades.len()
            );
            tracing::warn!(key = %group.key(), "{reason}");
            vec![Reward::failed(f32::NAN, reason); grades.len()]
        } else {
            grades
                .into_iter()
                .map(|grade| match grade {
                    Ok(score) => {
                        let mut reward = Reward::scalar(score);
                        reward.parts.insert("judge".into(), score);
                        reward
                    }
                    Err(reason) => Reward::failed(c.failure_score, format!("judge {}: {reason}", c.url)),
                })
                .collect()
        };
        if failed > 0 {
            metrics::judge_failures(c.on_failure.label(), failed as u64);
            metrics::failure("judge", failed as u64);
        }
        metrics::group_scored(rewards.len(), started.elapsed());
        ScoredGroup::new(group, rewards, self.estimator)
    }
}
