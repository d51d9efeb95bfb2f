//! The `agent` backend: any program that calls an OpenAI-compatible chat API is the
//! rollout, unchanged. For each prompt and sample, [`AgentEngine`] starts the
//! configured command with `OPENAI_BASE_URL` set to an episode's own address on a
//! recording proxy (`proxy`) and `OPENAI_API_KEY` to the episode's key, and gives
//! it the task (the prompt's text) on stdin or in `METRONOME_TASK`. The proxy serves
//! every call from the engine's current weights and records its rendered prompt,
//! sampled tokens, behaviour log-probs and version. When the agent exits, its calls
//! become trajectories ([`trajectory`]: joined while each prompt extends the last,
//! split otherwise) and the prompt's group of completions, with the agent's
//! reported reward, or none for the reward stage to score.
//!
//! An episode that fails (its agent crashes, overruns `time_limit_s`, never calls,
//! or calls another episode's address) ends alone: its process group is killed,
//! its trajectories (if any) get `failure_reward`, the reason is counted in
//! `metronome_rollout_episode_failures_total{reason}`, and the period goes on. A
//! prompt none of whose episodes left a trajectory becomes a rejected group.

pub(crate) mod process;
pub(crate) mod proxy;
pub mod trajectory;

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use futures::StreamExt;
use metronome_core::{
    Group, GroupSink, PolicyVersion, Prompt, RolloutEngine, RolloutRequest, WeightSnapshot,
};
use tokio::sync::{OnceCell, Semaphore};

pub use crate::config::{AgentConfig, AgentReward, AgentToolFormat, MAX_AGENT_CONCURRENCY, TaskInput};
use crate::http::{Chat, ServerConfig};
use crate::{Engine, Error, InferenceModel, Result};
use trajectory::{EpisodeEnd, RecordedCall, Trajectory};

/// The `agent` backend: a [`RolloutEngine`] that runs the configured agent per
/// response against a recording proxy in front of `engine` (module docs).
pub struct AgentEngine<M: InferenceModel> {
    engine: Arc<Engine<M>>,
    config: AgentConfig,
    proxy: Arc<proxy::Proxy<M>>,
    base: OnceCell<String>,
    slots: Arc<Semaphore>,
    episodes: AtomicU64,
    keys: std::collections::hash_map::RandomState,
}

impl<M: InferenceModel> std::fmt::Debug for AgentEngine<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentEngine").field("config", &self.config).finish_non_exhaustive()
    }
}

impl<M: InferenceModel> AgentEngine<M> {
    /// Agents of `config` served by `engine`, their calls read and rendered as `chat`
    /// says (its template replaced by `config.chat_template` when that is set). The
    /// proxy listens on a loopback port from the first generation on.
    pub fn new(engine: Engine<M>, config: AgentConfig, mut chat: Chat) -> Result<Self> {
        config.validate()?;
        if let Some(source) = &config.chat_template {
            chat.template = Some(metronome_model::ChatTemplate::new(source.clone(), "", ""));
        }
        let engine = Arc::new(engine);
        let server = ServerConfig {
            model_name: config.model_name.clone(),
            max_concurrent_requests: config.concurrency.saturating_mul(2),
            max_tokens: engine.max_seq_len(),
            ..ServerConfig::default()
        };
        let proxy = Arc::new(proxy::Proxy::new(Arc::clone(&engine), server, chat, engine.seed()));
        let slots = Arc::new(Semaphore::new(config.concurrency));
        Ok(Self {
            engine,
            config,
            proxy,
            base: OnceCell::new(),
            slots,
            episodes: AtomicU64::new(0),
            keys: std::collections::hash_map::RandomState::new(),
        })
    }

    /// The engine the proxy serves.
    #[must_use]
    pub fn engine(&self) -> &Arc<Engine<M>> {
        &self.engine
    }

    /// The proxy's address, listening from the first call on.
    async fn base(&self) -> Result<&str> {
        let base = self
            .base
            .get_or_try_init(|| async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| {
                    Error::config("rollout.agent", format!("the proxy cannot listen on loopback: {e}"))
                })?;
                let addr =
                    listener.local_addr().map_err(|e| Error::config("rollout.agent", e.to_string()))?;
                let server = ServerConfig::named(self.config.model_name.clone());
                tokio::spawn(crate::http::serve(listener, self.proxy.router(), &server));
                Ok::<_, Error>(format!("http://{addr}"))
            })
            .await?;
        Ok(base)
    }

    /// Runs sample `sample` of `prompt`: its calls, and how it ended.
    /// The episode's id is pushed to `ids`, for the request to forget it at its end.
    async fn episode(
        &self,
        base: &str,
        prompt: &Prompt,
        sample: u32,
        ids: &std::sync::Mutex<Vec<String>>,
    ) -> (Vec<RecordedCall>, EpisodeEnd) {
        let _slot = self.slots.acquire().await.expect("the semaphore is never closed");
        let n = self.episodes.fetch_add(1, Ordering::Relaxed);
        let id = format!("e{n}");
        ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(id.clone());
        let key = format!("mk-{:016x}{:016x}", self.keys.hash_one(n), self.keys.hash_one(!n));
        let end = self.proxy.open(&id, &key, prompt.id.0, sample);
        let launch = process::Launch {
            base_url: &format!("{base}/episodes/{id}/v1"),
            api_key: &key,
            model: self.proxy.model(),
            task: &prompt.text,
        };
        let exit = process::run(&self.config, &launch, &end).await;
        let (calls, proxy_failure) = self.proxy.close(&id);
        let reported = match &exit {
            process::Exit::Done { last_line } => last_line.as_deref().and_then(reported_reward),
            _ => None,
        };
        let failure = proxy_failure.or(match exit {
            process::Exit::Done { .. } if calls.is_empty() => Some("no_call".to_owned()),
            process::Exit::Done { .. } if reported.is_none() && self.config.reward == AgentReward::Agent => {
                Some("no_reward".to_owned())
            }
            process::Exit::Done { .. } => None,
            process::Exit::Crashed(status) => Some(format!("crash: {status}")),
            process::Exit::TimedOut => Some("timeout".to_owned()),
            process::Exit::Ended => Some("wrong_key".to_owned()),
            process::Exit::NotStarted(why) => Some(format!("not_started: {why}")),
        });
        if let Some(f) = &failure {
            tracing::warn!(prompt = prompt.id.0, sample, failure = %f, "agent episode failed");
            crate::metrics::episode_failed(f);
        }
        let reward = match (&failure, self.config.reward) {
            (Some(_), _) => Some(self.config.failure_reward),
            (None, AgentReward::Stage) => None,
            (None, _) => reported,
        };
        let answer =
            calls.last().and_then(|c| self.engine.tokenizer().decode(&c.tokens).ok()).unwrap_or_default();
        (calls, EpisodeEnd { reward, failure, answer })
    }

    /// The group of `prompt`: its `group_size` episodes, run at once within the
    /// concurrency, assembled into trajectories.
    async fn prompt_group(
        &self,
        base: &str,
        period: metronome_core::PeriodId,
        prompt: Prompt,
        group_size: u32,
        ids: &std::sync::Mutex<Vec<String>>,
    ) -> Group {
        let episodes =
            futures::future::join_all((0..group_size).map(|j| self.episode(base, &prompt, j, ids))).await;
        let mut all: Vec<(Trajectory, &EpisodeEnd)> = Vec::new();
        let mut splits = 0;
        for (calls, end) in &episodes {
            let ts = trajectory::trajectories(calls);
            splits += ts.len().saturating_sub(1);
            all.extend(ts.into_iter().map(|t| (t, end)));
        }
        crate::metrics::agent_splits(splits);
        match trajectory::group(period, &prompt, &all, self.engine.tokenizer().as_ref()) {
            Some(group) => group,
            None => {
                tracing::warn!(
                    prompt = prompt.id.0,
                    "no agent episode of the prompt left a trajectory to train"
                );
                crate::metrics::prompt_rejected();
                Group::rejected(period, prompt, group_size, self.engine.current_version())
            }
        }
    }
}

/// The reward of an agent's report line `{"reward": <finite number>}`.
fn reported_reward(line: &str) -> Option<f32> {
    let value: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
    let reward = value.get("reward")?.as_f64()? as f32;
    reward.is_finite().then_some(reward)
}

#[async_trait]
impl<M: InferenceModel> RolloutEngine for AgentEngine<M> {
    /// Runs every prompt's episodes (at most `concurrency` agents at once) and emits
    /// each prompt's group as its last episode ends.
    async fn generate(&self, request: RolloutRequest, sink: &dyn GroupSink) -> metronome_core::Result<()> {
        let base = self.base().await?.to_owned();
        let ids = std::sync::Mutex::new(Vec::new());
        let mut groups: futures::stream::FuturesUnordered<_> = request
            .prompts
            .into_iter()
            .map(|p| self.prompt_group(&base, request.period, p, request.group_size, &ids))
            .collect();
        let mut result = Ok(());
        while let Some(group) = groups.next().await {
            if let Err(e) = sink.emit(group).await {
                result = Err(e);
                break;
            }
        }
        drop(groups);
        // The request's episodes are over: their keys are unknown from now on.
        for id in ids.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            self.proxy.forget(&id);
        }
        result
    }

    async fn install_weights(&self, weights: Arc<WeightSnapshot>) -> metronome_core::Result<()> {
        self.engine.install_weights(weights).await
    }

    fn version(&self) -> PolicyVersion {
        self.engine.current_version()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn reports_and_configs_are_read_strictly() {
        assert_eq!(reported_reward(r#"{"reward": 1.5, "answer": "7"}"#), Some(1.5));
        assert_eq!(reported_reward("7"), None);
        assert_eq!(reported_reward(r#"{"reward": "high"}"#), None);
        let ok = AgentConfig { command: vec!["python3".into(), "agent.py".into()], ..AgentConfig::default() };
        ok.validate().unwrap();
        for (bad, field) in [
            (AgentConfig { command: vec![], ..ok.clone() }, "agent.command"),
            (AgentConfig { time_limit_s: 0.0, ..ok.clone() }, "agent.time_limit_s"),
            (AgentConfig { concurrency: 0, ..ok.clone() }, "agent.concurrency"),
            (AgentConfig { failure_reward: f32::NAN, ..ok.clone() }, "agent.failure_reward"),
            (AgentConfig { env: BTreeMap::from([("A=B".into(), "x".into())]), ..ok.clone() }, "agent.env"),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }
}
