//! The serde configuration that builds an engine (the pipeline's `[rollout]` table).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{Error, Result, SamplingConfig};

/// Where a run's responses are generated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// Metronome's own [`Engine`](crate::Engine) in this process.
    #[default]
    Native,
    /// One or more OpenAI-compatible `/v1/completions` servers (`[rollout.openai]`):
    /// `metronome serve`, vLLM or SGLang. Needs the `http` feature.
    Openai,
    /// A program that calls an OpenAI-compatible chat API, run per response against
    /// a recording proxy in front of the native engine (`[rollout.agent]`,
    /// `crate::agent`). Needs the `http` feature.
    Agent,
}

/// How new weights reach the servers of the `openai` backend at every period start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightSync {
    /// `metronome serve`: a safetensors file in `export_dir`, then
    /// `POST /metronome/v1/load_weights {"path", "version"}`; the server reports the
    /// version it samples with in every response.
    #[default]
    Metronome,
    /// SGLang: a Hugging Face folder `export_dir/v<version>/` (`config.json`,
    /// `model.safetensors`), then `POST /update_weights_from_disk {"model_path",
    /// "weight_version"}`.
    Sglang,
    /// vLLM started with `VLLM_SERVER_DEV_MODE=1` on `export_dir` as its model: the
    /// folder's `model.safetensors` and `config.json` are replaced, then `POST
    /// /collective_rpc {"method": "reload_weights"}` and `POST /reset_prefix_cache`.
    Vllm,
    /// Nothing is sent: the servers' weights are managed elsewhere (evaluation, or a
    /// frozen policy). The client still records the trainer's version on each group.
    None,
}

/// The `openai` backend's servers and how to talk to them (`[rollout.openai]`). The
/// seed is the run's (`run.seed`) and sampling is `[rollout.sampling]`: neither is
/// repeated here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OpenAiClientConfig {
    /// The servers' base URLs, e.g. `["http://10.0.0.5:8000"]` (without `/v1`). Each
    /// request goes to the endpoint with the fewest requests in flight (ties in turn);
    /// a failed attempt is retried on another endpoint.
    pub endpoints: Vec<String>,
    /// The served model name sent as `model`.
    pub model: String,
    /// Per-request timeout, seconds (a request generates a whole group, or one
    /// response without `send_prompt_ids`).
    pub timeout_s: f64,
    /// Retries after a failed attempt (connection errors, timeouts, 429 and 5xx, a
    /// server on other weights), each on another endpoint when there is one.
    pub max_retries: u32,
    /// The first retry waits this long; each next one twice as long.
    pub retry_backoff_ms: u64,
    /// Groups in flight at most, over all endpoints (a group is one request with `n` =
    /// group size, or one request per response without `send_prompt_ids`).
    pub max_concurrency: usize,
    /// Send Metronome's `prompt_ids` extension with the run seed, so that `metronome
    /// serve` samples exactly the native engine's tokens. Off (required for vLLM and
    /// SGLang, which ignore the field), each response is its own request (`n` = 1) with
    /// its own seed, `sample_seed(run seed, version, prompt id, sample index)`.
    pub send_prompt_ids: bool,
    /// Sent as `Authorization: Bearer <api_key>` (`--api-key` of vLLM and SGLang,
    /// `--api-key-file` of `metronome serve`); `{ env = "VAR" }` or `{ file = "PATH" }`
    /// keep it out of the config.
    pub api_key: Option<metronome_core::Secret>,
    /// How weights reach the servers at every period start.
    pub weight_sync: WeightSync,
    /// Where the weights are written for the servers to read (every `weight_sync`
    /// but `none`).
    pub export_dir: Option<PathBuf>,
    /// The same folder as the servers see it, when they mount it elsewhere (a
    /// container, another machine); absent, `export_dir`.
    pub server_export_dir: Option<PathBuf>,
}

impl Default for OpenAiClientConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            model: "metronome".into(),
            timeout_s: 600.0,
            max_retries: 3,
            retry_backoff_ms: 200,
            max_concurrency: 16,
            send_prompt_ids: true,
            api_key: None,
            weight_sync: WeightSync::Metronome,
            export_dir: None,
            server_export_dir: None,
        }
    }
}

impl OpenAiClientConfig {
    /// Checks the table and that `sampling` can be sent to its servers; errors name the
    /// field (`openai.endpoints`, `sampling.include_stop_str_in_output`, ...).
    pub fn validate(&self, sampling: &SamplingConfig) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::config(
                "openai.endpoints",
                "is empty: the openai backend needs at least one server base URL, e.g. \
                 [\"http://127.0.0.1:8000\"]",
            ));
        }
        for url in &self.endpoints {
            let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"));
            if rest.is_none_or(|r| r.trim_end_matches('/').is_empty()) {
                return Err(Error::config(
                    "openai.endpoints",
                    format!("holds `{url}`, not an http:// or https:// base URL"),
                ));
            }
            if url.trim_end_matches('/').ends_with("/v1") {
                return Err(Error::config(
                    "openai.endpoints",
                    format!(
                        "holds `{url}`: give the base URL without `/v1` (the client adds `/v1/completions`)"
                    ),
                ));
            }
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = self.endpoints.iter().find(|u| !seen.insert(u.trim_end_matches('/'))) {
            return Err(Error::config("openai.endpoints", format!("lists `{dup}` twice")));
        }
        if self.model.is_empty() {
            return Err(Error::config("openai.model", "is empty (the served model name)"));
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            return Err(Error::config("openai.timeout_s", format!("is {} (expected > 0)", self.timeout_s)));
        }
        if self.max_concurrency == 0 {
            return Err(Error::config("openai.max_concurrency", "is 0 (expected >= 1)"));
        }
        if self.api_key.as_ref().is_some_and(|k| k.expose().is_empty()) {
            return Err(Error::config("openai.api_key", "is empty"));
        }
        if self.weight_sync != WeightSync::None && self.export_dir.is_none() {
            return Err(Error::config(
                "openai.export_dir",
                format!(
                    "must be set for weight_sync = \"{}\": the folder the weights are written to for the \
                     servers to read",
                    self.weight_sync.name()
                ),
            ));
        }
        if self.weight_sync == WeightSync::Vllm && self.server_export_dir.is_some() {
            return Err(Error::config(
                "openai.server_export_dir",
                "is set with weight_sync = \"vllm\": vLLM reloads from the folder it was started on, which must \
                 be export_dir itself; leave it out",
            ));
        }
        let foreign = matches!(self.weight_sync, WeightSync::Sglang | WeightSync::Vllm);
        if foreign && self.send_prompt_ids {
            return Err(Error::config(
                "openai.send_prompt_ids",
                format!(
                    "is true with weight_sync = \"{}\": that server ignores Metronome's prompt_ids, so every \
                     request would share the run seed; set it to false (each response is then a request with a \
                     seed of its own, derived from run.seed, the version, the prompt id and the sample index)",
                    self.weight_sync.name()
                ),
            ));
        }
        // SGLang's completions API keeps or trims stop strings with its own
        // `no_stop_trim`, not vLLM's `include_stop_str_in_output`.
        if self.weight_sync == WeightSync::Sglang && sampling.include_stop_str_in_output {
            return Err(Error::config(
                "sampling.include_stop_str_in_output",
                "is true, which SGLang's completions API does not take (it has no_stop_trim instead)",
            ));
        }
        sampling.validate()
    }
}

impl WeightSync {
    /// The config spelling.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Metronome => "metronome",
            Self::Sglang => "sglang",
            Self::Vllm => "vllm",
            Self::None => "none",
        }
    }
}

/// How free slots are refilled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Batching {
    /// A finished sequence's slot takes the next pending sequence at once.
    #[default]
    Continuous,
    /// Row-skipping static batching: a batch of up to `max_num_seqs` sequences runs
    /// until its longest member ends and only then is the next batch admitted, but a
    /// finished sequence leaves the decode forward at once (its slot stays empty). A
    /// stronger baseline than the usual static batching, since the tail of a batch
    /// costs only its live rows.
    Static,
    /// Padded static batching, the standard baseline (Hugging Face `transformers`
    /// `generate`, and the static batching the continuous-batching literature compares
    /// with): as [`Batching::Static`], and moreover a finished sequence keeps its slot
    /// *and its row in every decode forward* until the batch's longest member ends. Its
    /// outputs are discarded, so tokens, log-probs and finish reasons are those of the
    /// other modes (the decode is batch-invariant); only the compute differs. A
    /// finished row whose KV-cache slot is full (`max_seq_len`) drops out of the
    /// forward. Prompts are still prefilled without padding.
    StaticPadded,
}

/// What partial rollouts do with a running response's KV cache when newer weights
/// take over (`rollout.partial_cache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartialCache {
    /// One prefill of the response's tokens so far under the new weights: exactly the
    /// state an engine given the new weights at that token would have, at the cost of
    /// re-reading every token (each running response, at every new version).
    #[default]
    Rebuild,
    /// The keys and values computed under the old weights stay; only the tokens from
    /// the switch on are computed under the new ones. Free, and the attention then
    /// mixes two versions' keys, as AReaL's and slime's in-flight updates do.
    Keep,
}

/// Engine layout and sampling. Every field has a default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Engine workers, each an OS thread with its own KV cache and thread pool.
    pub workers: usize,
    /// Threads of each worker's rayon pool (the matmuls of its decode steps run
    /// there). Unset, the pipeline's placement chooses (`run.auto_placement`), else 1
    /// ([`EngineConfig::threads_per_worker`]).
    pub threads_per_worker: Option<usize>,
    /// KV-cache slots per worker: the most sequences one worker decodes at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + response) a slot holds; capped by the model's context.
    pub max_seq_len: usize,
    /// Positions of KV cache each worker holds, shared by its slots in blocks (a paged
    /// cache); absent, room for every slot at `max_seq_len` (`max_num_seqs x
    /// max_seq_len`). Smaller, a worker admits a response only while its pool can hold
    /// the response's prompt and whole budget (`max_new_tokens`; `max_seq_len` for
    /// multi-turn episodes and padded static batching) next to those it runs, so many
    /// short responses share the memory few long ones would need and none ever waits
    /// for memory midway. At least `max_seq_len`, at most `max_num_seqs x max_seq_len`.
    pub kv_cache_tokens: Option<usize>,
    /// Continuous (default), row-skipping static, or padded static batching.
    pub batching: Batching,
    /// Partial rollouts: when newer weights are installed, running responses continue
    /// under them (their KV cache rebuilt by one prefill of their tokens so far)
    /// instead of finishing with the weights they started with; every completion
    /// records where the weights changed. Off (the default) keeps a response on one
    /// version. Only for off-policy schedules (`stale:s`): the pipeline refuses it
    /// with `sync` and `periodic`, which sample each period with one version.
    pub partial_rollouts: bool,
    /// With partial rollouts, what becomes of a running response's KV cache when newer
    /// weights take over: rebuilt under them, or kept.
    pub partial_cache: PartialCache,
    /// Sampling used by [`metronome_core::RolloutEngine::generate`].
    pub sampling: SamplingConfig,
    /// The device the engine decodes on; absent, the model's (`model.device` in a run
    /// config). Read by whoever builds the engine's model (the pipeline).
    pub device: Option<metronome_model::DeviceSpec>,
    /// The type the native engine decodes in, weights and KV cache: `"f32"` or
    /// `"bf16"`; absent, bf16 on a GPU (half the bytes a decode step reads, which is
    /// what bounds it there) and f32 on the CPU (whose fused kernels are f32, and
    /// whose bf16 matrix products are slower). A bf16 engine's behaviour log-probs
    /// differ from an f32 trainer's by bf16 rounding: the train-rollout mismatch
    /// metrics report it.
    pub precision: Option<metronome_model::Precision>,
    /// `native` (this process) or `openai` (the servers of `[rollout.openai]`). The
    /// layout keys above (`workers`, `max_num_seqs`, ...) configure the native engine
    /// and `metronome serve`; `sampling` applies to both.
    pub backend: Backend,
    /// The servers of the `openai` backend.
    pub openai: OpenAiClientConfig,
    /// The agent of the `agent` backend.
    pub agent: AgentConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            workers: 1,
            threads_per_worker: None,
            max_num_seqs: 16,
            max_seq_len: 1024,
            kv_cache_tokens: None,
            batching: Batching::Continuous,
            partial_rollouts: false,
            partial_cache: PartialCache::default(),
            sampling: SamplingConfig::default(),
            device: None,
            precision: None,
            backend: Backend::Native,
            openai: OpenAiClientConfig::default(),
            agent: AgentConfig::default(),
        }
    }
}

/// The most rollout workers an engine runs (each a thread and a KV cache).
pub const MAX_WORKERS: usize = 1024;
/// The most threads of one pool (a worker's, or the trainer's).
pub const MAX_THREADS: usize = 4096;
/// The most KV-cache slots of one worker.
pub const MAX_NUM_SEQS: usize = 1 << 16;
/// The longest sequence, and the most new tokens, in tokens.
pub const MAX_SEQ_LEN: usize = 1 << 20;

impl EngineConfig {
    /// The precision the engine decodes in on `device`: `precision`, else bf16 on a
    /// GPU and f32 on the CPU.
    #[must_use]
    pub fn precision_on(&self, device: &candle_core::Device) -> metronome_model::Precision {
        self.precision.unwrap_or_else(|| metronome_model::Precision::for_device(device))
    }

    /// Threads of each worker's pool: `threads_per_worker`, or 1 when unset.
    #[must_use]
    pub fn threads_per_worker(&self) -> usize {
        self.threads_per_worker.unwrap_or(1)
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<()> {
        // Upper bounds far above any real use, below what would abort an allocation
        // (counts of threads, slot tables, position tables); the KV cache itself is
        // checked against the machine's memory when the engine is built
        // (`InferenceModel::check_caches`).
        for (field, value, min, max) in [
            ("workers", self.workers, 1, MAX_WORKERS),
            ("threads_per_worker", self.threads_per_worker.unwrap_or(1), 1, MAX_THREADS),
            ("max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS),
            ("max_seq_len", self.max_seq_len, 2, MAX_SEQ_LEN),
            ("sampling.max_new_tokens", self.sampling.max_new_tokens, 1, MAX_SEQ_LEN),
        ] {
            if !(min..=max).contains(&value) {
                return Err(Error::config(field, format!("is {value} (expected {min} to {max})")));
            }
        }
        if let Some(tokens) = self.kv_cache_tokens {
            let most = self.max_num_seqs.saturating_mul(self.max_seq_len);
            if !(self.max_seq_len..=most).contains(&tokens) {
                return Err(Error::config(
                    "kv_cache_tokens",
                    format!(
                        "is {tokens} (expected max_seq_len {} to max_num_seqs x max_seq_len {most}: one sequence at \
                         its longest must fit, and more than every slot at its longest is never used)",
                        self.max_seq_len
                    ),
                ));
            }
        }
        if self.backend == Backend::Openai {
            self.openai.validate(&self.sampling)?;
        }
        if self.backend == Backend::Agent {
            self.agent.validate()?;
        }
        self.sampling.validate()
    }
}

// The `[rollout.agent]` table (the backend itself is `crate::agent`).

/// How the task reaches the agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskInput {
    /// The prompt's text on stdin (then closed).
    #[default]
    Stdin,
    /// The prompt's text in `METRONOME_TASK`.
    Env,
}

/// Where an episode's reward comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentReward {
    /// The agent's report: its stdout's last line, `{"reward": <number>}`; an agent
    /// that reports none fails its episode (`no_reward`).
    Agent,
    /// The run's reward stage, on the last call's sampled text (the final answer).
    Stage,
    /// The agent's report when it gives one, else the reward stage.
    #[default]
    Either,
}

/// How the model writes tool calls, for the proxy to read them into OpenAI's
/// `tool_calls` and write them back (the environments' formats, `[env] format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentToolFormat {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
    #[default]
    Json,
    /// `<NAME>INPUT</NAME>`.
    Tag,
    /// No calls are read: requests that offer tools are refused.
    None,
}

/// The `[rollout.agent]` table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// The agent's argv: program and arguments.
    pub command: Vec<String>,
    /// Its working directory (the run's when unset).
    pub working_dir: Option<PathBuf>,
    /// Environment variables added to the run's.
    pub env: BTreeMap<String, String>,
    /// Seconds an episode may run; past them its process group is killed (`timeout`).
    pub time_limit_s: f64,
    /// Agents running at once at most.
    pub concurrency: usize,
    /// How the task is given.
    pub task_input: TaskInput,
    /// Where the reward comes from.
    pub reward: AgentReward,
    /// The reward of a failed episode's trajectories.
    pub failure_reward: f32,
    /// The model name agents ask for.
    pub model_name: String,
    /// A Jinja chat template that replaces the tokenizer's (for a tokenizer without
    /// one, as the tiny tasks' character tokenizer).
    pub chat_template: Option<String>,
    /// How the model writes tool calls.
    pub tool_format: AgentToolFormat,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            command: Vec::new(),
            working_dir: None,
            env: BTreeMap::new(),
            time_limit_s: 60.0,
            concurrency: 4,
            task_input: TaskInput::Stdin,
            reward: AgentReward::Either,
            failure_reward: 0.0,
            model_name: "metronome".into(),
            chat_template: None,
            tool_format: AgentToolFormat::Json,
        }
    }
}

/// The most agents a run may start at once.
pub const MAX_AGENT_CONCURRENCY: usize = 4096;

impl AgentConfig {
    /// Checks every field; errors name it (`agent.<field>`, under `rollout.` in a run's config).
    pub fn validate(&self) -> Result<()> {
        if self.command.first().is_none_or(|p| p.is_empty()) {
            return Err(Error::config(
                "agent.command",
                "is empty (expected the agent's program and arguments)",
            ));
        }
        if !(self.time_limit_s.is_finite() && self.time_limit_s > 0.0 && self.time_limit_s <= 86_400.0) {
            return Err(Error::config(
                "agent.time_limit_s",
                format!("is {} (expected in (0, 86400] seconds)", self.time_limit_s),
            ));
        }
        if self.concurrency == 0 || self.concurrency > MAX_AGENT_CONCURRENCY {
            return Err(Error::config(
                "agent.concurrency",
                format!("is {} (expected 1 to {MAX_AGENT_CONCURRENCY})", self.concurrency),
            ));
        }
        if !self.failure_reward.is_finite() {
            return Err(Error::config(
                "agent.failure_reward",
                format!("is {} (expected a finite number)", self.failure_reward),
            ));
        }
        if let Some(bad) = self.env.keys().find(|k| k.is_empty() || k.contains(['=', '\0'])) {
            return Err(Error::config(
                "agent.env",
                format!("has the name {bad:?}, which no environment variable can have"),
            ));
        }
        if self.model_name.is_empty() {
            return Err(Error::config("agent.model_name", "is empty"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_from_the_pipeline_toml() {
        let text = r#"
            workers = 2
            threads_per_worker = 1
            max_num_seqs = 8
            batching = "static"

            [sampling]
            temperature = 0.7
            top_p = 0.95
            max_new_tokens = 64
            stop_strings = ["</answer>"]
        "#;
        let cfg: EngineConfig = toml::from_str(text).unwrap();
        assert_eq!(cfg.workers, 2);
        assert_eq!(cfg.batching, Batching::Static);
        assert_eq!(cfg.sampling.max_new_tokens, 64);
        assert_eq!(cfg.sampling.top_k, 0, "unset fields take defaults");
        cfg.validate().unwrap();
        let padded: EngineConfig = toml::from_str(r#"batching = "static_padded""#).unwrap();
        assert_eq!(padded.batching, Batching::StaticPadded);
        let err = toml::from_str::<EngineConfig>("max_num_seq = 3").unwrap_err().to_string();
        assert!(err.contains("max_num_seq"), "{err}");
        let zero = EngineConfig { max_num_seqs: 0, ..EngineConfig::default() };
        assert_eq!(
            zero.validate().unwrap_err().to_string(),
            "config field `max_num_seqs` is 0 (expected 1 to 65536)"
        );
    }
}
