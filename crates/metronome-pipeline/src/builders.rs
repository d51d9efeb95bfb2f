//! The stages of a configured run, built from its [`PipelineConfig`]: the network and
//! its tokenizer, the rollout engine of `rollout.backend`, the scorer, the packer, the
//! trainer, the in-process transport and the runner's options. Every entry point
//! (`run`, the cluster roles, `serve`, the examples) builds through these, so a
//! config means the same stages wherever it runs.

use std::path::Path;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use metronome_core::{
    AccumulateReport, GroupScorer, PolicyVersion, PromptSource, RolloutEngine, RunSeed, ScoredGroup,
    StepReport, Tokenizer, TrainBatch, Trainer, WeightSnapshot,
};
use metronome_model::{CharTokenizer, DeviceSpec, HfTokenizer, Model, ModelConfig, Stage};
use metronome_trainer::GrpoTrainer;
use metronome_transport::local;

use crate::config::{ModelSource, PipelineConfig};
use crate::error::{Error, Result};
use crate::runner::{RunnerOptions, Stages, Transport};

/// Builds the network and its tokenizer on `device` (the policy on
/// [`PipelineConfig::trainer_device`], a rollout worker's copy on
/// [`PipelineConfig::rollout_device`]).
pub fn load_model(config: &PipelineConfig, device: DeviceSpec) -> Result<(Model, Arc<dyn Tokenizer>)> {
    let device = device.open()?;
    Ok(match &config.model {
        ModelSource::Tiny { .. } => {
            let model = Model::new(ModelConfig::tiny(), &device, config.run.seed)?;
            (model, Arc::new(CharTokenizer))
        }
        ModelSource::Hf { path, .. } => {
            let model = Model::load_hf(path, &device)?;
            (model, Arc::new(HfTokenizer::from_dir(path)?))
        }
        ModelSource::Gguf { path, .. } => {
            let (model, tokenizer) = Model::load_gguf(path, &device)?;
            (model, Arc::new(tokenizer))
        }
    })
}

/// The tokenizer of the config's model source, without its weights (a GGUF's from its
/// metadata): what [`load_model`] returns beside the network.
pub(crate) fn load_tokenizer(config: &PipelineConfig) -> Result<Arc<dyn Tokenizer>> {
    Ok(match &config.model {
        ModelSource::Tiny { .. } => Arc::new(CharTokenizer),
        ModelSource::Hf { path, .. } => Arc::new(HfTokenizer::from_dir(path)?),
        ModelSource::Gguf { path, .. } => Arc::new(metronome_model::GgufTokenizer::from_gguf(path)?),
    })
}

/// The runner's options of a run: the schedule, periods, time limit, group size and
/// dynamic sampling of `[run]`, the advantage estimator of `[trainer]`, partial rollouts of
/// `[rollout]`, the groups packed together of `[packing]`.
impl From<&PipelineConfig> for RunnerOptions {
    fn from(config: &PipelineConfig) -> Self {
        Self {
            schedule: config.run.schedule,
            periods: config.run.periods,
            group_size: config.run.group_size,
            advantage: config.trainer.advantage,
            dynamic_sampling: config.run.dynamic_sampling.map(|d| d.groups),
            partial_rollouts: config.rollout.partial_rollouts,
            time_limit: (config.run.time_limit_s > 0)
                .then(|| std::time::Duration::from_secs(config.run.time_limit_s)),
            groups_per_pack: config.packing.groups_per_pack,
        }
    }
}

/// The GRPO trainer behind a lock: the runner owns it as a stage while the caller keeps
/// this handle for inspection (the final policy, say).
#[derive(Clone, Debug)]
pub struct TrainerHandle(Arc<Mutex<GrpoTrainer>>);

impl TrainerHandle {
    /// Locks the trainer (between the runner's calls).
    pub fn lock(&self) -> std::sync::MutexGuard<'_, GrpoTrainer> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl Trainer for TrainerHandle {
    fn version(&self) -> PolicyVersion {
        self.lock().version()
    }

    async fn accumulate(&mut self, batch: TrainBatch) -> metronome_core::Result<AccumulateReport> {
        self.lock().accumulate_sync(&batch).map_err(|e| metronome_core::Error::stage("trainer", e))
    }

    async fn step(&mut self) -> metronome_core::Result<StepReport> {
        self.lock().step_sync().map_err(|e| metronome_core::Error::stage("trainer", e))
    }

    async fn snapshot(&self) -> metronome_core::Result<WeightSnapshot> {
        self.lock().snapshot_sync().map_err(|e| metronome_core::Error::stage("trainer", e))
    }

    async fn save_checkpoint(&mut self, dir: &Path) -> metronome_core::Result<()> {
        self.lock().save_checkpoint(dir).map_err(|e| metronome_core::Error::stage("trainer", e))
    }

    async fn restore_checkpoint(&mut self, dir: &Path) -> metronome_core::Result<()> {
        self.lock().restore(dir).map_err(|e| metronome_core::Error::stage("trainer", e))
    }
}

/// The in-process transport: a bounded group channel (backpressure at one period's
/// groups) and a watch cell for the newest weights.
pub fn local_transport(config: &PipelineConfig) -> Transport {
    let (sender, receiver) = local::group_channel(config.data.release.batch_size.max(1));
    let (publisher, subscriber) = local::weight_channel();
    Transport {
        sender: Arc::new(sender),
        receiver: Box::new(receiver),
        publisher: Arc::new(publisher),
        subscriber: Box::new(subscriber),
    }
}

/// `engine` running the multi-turn episodes of `[env]`, when the run has that table.
pub fn with_env(
    engine: metronome_rollout::ModelEngine,
    config: &PipelineConfig,
) -> Result<metronome_rollout::ModelEngine> {
    let Some(env) = &config.env else { return Ok(engine) };
    let environment = env.build().map_err(|e| Error::stage("env", e))?;
    Ok(engine.with_episodes(metronome_rollout::Episodes {
        environment,
        max_turns: env.max_turns,
        tool_time_limit: std::time::Duration::from_millis(env.tool_time_limit_ms),
        max_running_calls: env.max_running_tool_calls,
        chat_template: config.data.prompt.chat_template,
    })?)
}

/// The run's group scorer, computing advantages with the trainer's estimator.
pub(crate) fn group_scorer(config: &PipelineConfig) -> Result<Box<dyn GroupScorer>> {
    Ok(config.reward.build(config.trainer.advantage)?)
}

/// The masking crate's packing with the run's settings.
pub(crate) fn packer(packing: metronome_masking::PackingConfig) -> impl crate::runner::Packer {
    move |groups: &[ScoredGroup]| -> metronome_core::Result<Vec<TrainBatch>> {
        metronome_masking::pack_period(groups, &packing)
            .map(|layouts| layouts.into_iter().map(|l| l.batch).collect())
            .map_err(|e| metronome_core::Error::stage("masking", e))
    }
}

/// The stages of a configured run on `policy`, and a handle on its trainer.
pub fn build_stages(
    config: &PipelineConfig,
    policy: Model,
    tokenizer: Arc<dyn Tokenizer>,
) -> Result<(Stages, TrainerHandle)> {
    stages_around(config, new_trainer(config, policy)?, tokenizer)
}

/// Loads the distillation teacher of `trainer.distill` (on the CPU, then dropped:
/// the trainer loads it again on its device) and checks it against `student`, so a
/// teacher that does not load or has another vocabulary stops the run before the
/// warm start, naming `trainer.distill.path`.
pub(crate) fn check_teacher(config: &PipelineConfig, student: &Model) -> Result<()> {
    let Some(distill) = &config.trainer.distill else { return Ok(()) };
    match distill.load_teacher(student.config(), &metronome_model::Device::Cpu) {
        Ok(_) => Ok(()),
        Err(metronome_trainer::TrainerError::Config { key, reason }) => {
            Err(Error::Config { key: format!("trainer.{key}"), reason })
        }
        Err(other) => Err(other.into()),
    }
}

/// The run's trainer around `policy`: `[trainer]`, scoring log-probs at the
/// temperature the engine samples at (`rollout.sampling.temperature`).
pub(crate) fn new_trainer(config: &PipelineConfig, policy: Model) -> Result<GrpoTrainer> {
    Ok(GrpoTrainer::new(config.trainer.clone(), policy)
        .and_then(|t| t.with_sampling_temperature(config.rollout.sampling.temperature))?)
}

/// The stages of a configured run around `trainer` (a new one, or one resumed from
/// a checkpoint: the engine starts from its weights and version). A trainer on a GPU
/// publishes to an engine of this process (`native`, `agent`) by snapshots left on
/// its device, which the engine installs device to device.
pub(crate) fn stages_around(
    config: &PipelineConfig,
    trainer: GrpoTrainer,
    tokenizer: Arc<dyn Tokenizer>,
) -> Result<(Stages, TrainerHandle)> {
    let source = config.data.build(RunSeed(config.run.seed), tokenizer.clone())?;
    let engine = rollout_engine(config, trainer.policy(), trainer.version(), tokenizer)?;
    let in_process = config.rollout.backend != metronome_rollout::Backend::Openai;
    let on_gpu = !trainer.policy().device().is_cpu();
    let trainer = trainer.with_resident_snapshots(in_process && on_gpu);
    let scorer = group_scorer(config)?;
    let packer = packer(config.packing);
    let trainer = TrainerHandle(Arc::new(Mutex::new(trainer)));
    let stages = Stages {
        source: Box::new(source) as Box<dyn PromptSource>,
        engine,
        scorer: Arc::from(scorer),
        packer: Arc::new(packer),
        trainer: Box::new(trainer.clone()),
    };
    Ok((stages, trainer))
}

/// The native engine of `engine` (`[rollout]`, or the evaluation's variant of it)
/// with `[env]`'s episodes, on a frozen copy of `model` on
/// [`PipelineConfig::rollout_device`], at `version`.
pub(crate) fn native_engine(
    config: &PipelineConfig,
    engine: &metronome_rollout::EngineConfig,
    model: &Model,
    version: PolicyVersion,
    tokenizer: Arc<dyn Tokenizer>,
) -> Result<metronome_rollout::ModelEngine> {
    let device = config.rollout_device().open_for(Stage::Rollout)?;
    let inference = model.frozen_copy_on(&device)?;
    let built = engine.build(inference, version, tokenizer, RunSeed(config.run.seed))?;
    with_env(built, config)
}

/// The run's rollout engine, starting at `version`: with `rollout.backend = "native"`
/// the engine of `[rollout]` on a frozen copy of `policy` on
/// [`PipelineConfig::rollout_device`]; with `"openai"` a client of the servers of
/// `[rollout.openai]`, sampling as `rollout.sampling` says from `run.seed`, whose weight
/// updates export `policy`'s architecture (its Hugging Face `config.json`) with each
/// snapshot.
pub(crate) fn rollout_engine(
    config: &PipelineConfig,
    policy: &Model,
    version: PolicyVersion,
    tokenizer: Arc<dyn Tokenizer>,
) -> Result<Arc<dyn RolloutEngine>> {
    match config.rollout.backend {
        metronome_rollout::Backend::Native => {
            Ok(Arc::new(native_engine(config, &config.rollout, policy, version, tokenizer)?))
        }
        #[cfg(feature = "http")]
        metronome_rollout::Backend::Openai => {
            use metronome_rollout::http::{OpenAiEngine, weight_sync_hook};
            let openai = &config.rollout.openai;
            let hook = weight_sync_hook(openai, policy.config().to_hf_json())?;
            let seed = RunSeed(config.run.seed);
            let sampling = config.rollout.sampling.clone();
            Ok(Arc::new(OpenAiEngine::new(openai.clone(), sampling, seed, version, hook)?))
        }
        #[cfg(not(feature = "http"))]
        metronome_rollout::Backend::Openai => Err(crate::config::openai_needs_http()),
        #[cfg(feature = "http")]
        metronome_rollout::Backend::Agent => {
            let device = config.rollout_device().open_for(Stage::Rollout)?;
            let inference = policy.frozen_copy_on(&device)?;
            let native = config.rollout.build(inference, version, tokenizer, RunSeed(config.run.seed))?;
            let agent = &config.rollout.agent;
            let chat =
                metronome_rollout::http::Chat { template: None, tools: tool_syntax(agent.tool_format) };
            Ok(Arc::new(metronome_rollout::agent::AgentEngine::new(native, agent.clone(), chat)?))
        }
        #[cfg(not(feature = "http"))]
        metronome_rollout::Backend::Agent => Err(crate::config::openai_needs_http()),
    }
}

/// The environments' tool-call format the agent proxy reads and writes.
#[cfg(feature = "http")]
fn tool_syntax(
    format: metronome_rollout::AgentToolFormat,
) -> Option<Arc<dyn metronome_core::ToolCallSyntax>> {
    use metronome_reward::ToolCallFormat;
    match format {
        metronome_rollout::AgentToolFormat::Json => Some(Arc::new(ToolCallFormat::Json)),
        metronome_rollout::AgentToolFormat::Tag => Some(Arc::new(ToolCallFormat::Tag)),
        metronome_rollout::AgentToolFormat::None => None,
    }
}
