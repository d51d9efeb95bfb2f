//! A whole run from a [`PipelineConfig`]: build the stages, warm-start with SFT, run
//! the schedule, evaluate on held-out prompts, and record everything in the run
//! directory. The `metronome` binary and `cargo xtask e2e` call [`run`].

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use metronome_core::{
    AccumulateReport, Completion, Environment, GroupScorer, PeriodId, PolicyVersion, Prompt, PromptSource,
    RewardFn, RolloutEngine, RolloutRequest, RunSeed, ScoredGroup, StepReport, TokenSpan, Tokenizer,
    TrainBatch, Trainer, WeightSnapshot,
};
use metronome_model::{CharTokenizer, DeviceSpec, HfTokenizer, Model, ModelConfig};
use metronome_reward::{RewardConfig, ScorerConfig};
use metronome_rollout::CollectSink;
use metronome_trainer::{GrpoTrainer, SftExample};
use metronome_transport::local;
use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoints;
use crate::config::{ModelSource, PipelineConfig};
use crate::error::{Error, Result};
use crate::events::{Event, Observer};
use crate::report::PeriodReport;
use crate::rundir::RunDir;
use crate::runner::{Checkpointing, PeriodEnd, Runner, Stages, Transport};
use crate::schedule::Schedule;
use crate::tensorboard::{EventWriter, eval_scalars, period_scalars};

/// Held-out accuracy at one point of the run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    /// Optimiser steps of RL taken before the evaluation (0: after the warm start).
    pub after_periods: u64,
    /// Fraction of held-out answers that are correct (greedy, or sampled as `eval` says).
    pub accuracy: f64,
    /// With `[env]`: the fraction of held-out trajectories in which the policy
    /// called a tool (took more than one turn).
    pub tool_use: Option<f64>,
}

/// What a run produced.
#[derive(Debug)]
pub struct RunOutcome {
    /// The run directory.
    pub dir: RunDir,
    /// One report per period.
    pub periods: Vec<PeriodReport>,
    /// Held-out accuracy before RL and after every `eval.every` periods.
    pub evals: Vec<EvalPoint>,
    /// The final weights.
    pub weights: Arc<WeightSnapshot>,
    /// Mean SFT loss of the first and last warm-start steps.
    pub sft_loss: Option<(f64, f64)>,
}

pub(crate) fn err<E: std::error::Error + Send + Sync + 'static>(stage: &'static str) -> impl Fn(E) -> Error {
    move |e| Error::Stage(metronome_core::Error::stage(stage, e))
}

/// Builds the network and its tokenizer on `device` (the policy on
/// [`PipelineConfig::trainer_device`], a rollout worker's copy on
/// [`PipelineConfig::rollout_device`]).
pub fn load_model(config: &PipelineConfig, device: DeviceSpec) -> Result<(Model, Arc<dyn Tokenizer>)> {
    let device = device.open().map_err(err("model"))?;
    Ok(match &config.model {
        ModelSource::Tiny { .. } => {
            let model = Model::new(ModelConfig::tiny(), &device, config.run.seed).map_err(err("model"))?;
            (model, Arc::new(CharTokenizer))
        }
        ModelSource::Hf { path, .. } => {
            let model = Model::load_hf(path, &device).map_err(err("model"))?;
            (model, Arc::new(HfTokenizer::from_dir(path).map_err(err("model"))?))
        }
        ModelSource::Gguf { path, .. } => {
            let (model, tokenizer) = Model::load_gguf(path, &device).map_err(err("model"))?;
            (model, Arc::new(tokenizer))
        }
    })
}

/// The per-completion scorer evaluation uses: the run's local scorer, or the math
/// verifier when rewards come from a remote service.
fn eval_scorer(config: &PipelineConfig) -> Result<Arc<dyn RewardFn>> {
    let scorer = match &config.reward {
        RewardConfig::Local { scorer, .. } => scorer.clone(),
        RewardConfig::Remote(_) | RewardConfig::Judge(_) => ScorerConfig::Math(Default::default()),
    };
    scorer.build().map_err(err("reward"))
}

/// Greedy answers to held-out prompts, scored by the `correct` part of the reward
/// (or a positive total when the scorer reports no such part); an episode the
/// environment rewarded counts as correct when that reward is positive.
struct Evaluator {
    engine: metronome_rollout::ModelEngine,
    prompts: Vec<Prompt>,
    scorer: Arc<dyn RewardFn>,
    samples: u32,
}

impl Evaluator {
    async fn new(
        config: &PipelineConfig,
        model: &Model,
        tokenizer: Arc<dyn Tokenizer>,
    ) -> Result<Option<Self>> {
        if config.eval.prompts == 0 {
            return Ok(None);
        }
        let source = config.heldout_source().expect("validated: a held-out source exists");
        let mut data = config.data.clone();
        data.source = source;
        data.release.batch_size = config.eval.prompts;
        data.release.shuffle = false;
        data.release.prefetch = false;
        data.release.epochs = None;
        let mut loader =
            data.build(RunSeed(config.run.seed), tokenizer.clone()).map_err(err("dataloader"))?;
        let prompts = loader.next().await.map_err(err("dataloader"))?.map(|b| b.prompts).unwrap_or_default();
        let mut engine_cfg = config.rollout.clone();
        engine_cfg.sampling.temperature = config.eval.temperature;
        engine_cfg.workers = 1;
        let device = config.rollout_device().open().map_err(err("model"))?;
        let inference = model.frozen_copy_on(&device).map_err(err("model"))?;
        let engine = engine_cfg
            .build(inference, PolicyVersion(0), tokenizer, RunSeed(config.run.seed))
            .map_err(err("rollout"))?;
        let engine = with_env(engine, config)?;
        Ok(Some(Self { engine, prompts, scorer: eval_scorer(config)?, samples: config.eval.samples }))
    }

    /// Held-out accuracy (and tool use) of `weights`, after `after_periods` periods.
    async fn evaluate(&self, weights: Arc<WeightSnapshot>, after_periods: u64) -> Result<EvalPoint> {
        self.engine.install_weights(weights).await?;
        let request = RolloutRequest {
            period: PeriodId(u64::MAX),
            prompts: self.prompts.clone(),
            group_size: self.samples,
        };
        let sink = CollectSink::default();
        self.engine.generate(request, &sink).await?;
        let groups = sink.into_groups();
        let answers: usize = groups.iter().map(|g| g.completions.len()).sum();
        let correct: f64 = groups
            .iter()
            .flat_map(|g| g.completions.iter().map(move |c| (&g.prompt, c)))
            .map(|(p, c): (&Prompt, &Completion)| {
                // An environment's own verdict on its episode comes first, as in training.
                if let Some(r) = c.episode.as_ref().and_then(|e| e.reward) {
                    return f64::from(u8::from(r > 0.0));
                }
                let r = self.scorer.score(p, c);
                r.parts.get("correct").map_or(f64::from(u8::from(r.total > 0.0)), |&x| f64::from(x))
            })
            .sum();
        let episodes: Vec<_> =
            groups.iter().flat_map(|g| &g.completions).filter_map(|c| c.episode.as_ref()).collect();
        let tool_use = (!episodes.is_empty())
            .then(|| episodes.iter().filter(|e| e.turns > 1).count() as f64 / episodes.len() as f64);
        Ok(EvalPoint { after_periods, accuracy: correct / answers.max(1) as f64, tool_use })
    }
}

/// Supervised warm start: `sft.steps` steps of cross-entropy on reference answers,
/// each reported to `observer` (of adapters only with `trainer.lora`, merged into the
/// model it returns).
pub(crate) async fn warm_start(
    config: &PipelineConfig,
    model: Model,
    tokenizer: &Arc<dyn Tokenizer>,
    observer: &Observer,
) -> Result<(Model, Option<(f64, f64)>)> {
    let sft = &config.sft;
    if sft.steps == 0 {
        return Ok((model, None));
    }
    let mut data = config.data.clone();
    data.release.batch_size = sft.batch_size;
    data.release.epochs = None;
    // A stream of the run seed of its own: SFT batches are not the RL batches.
    let mut loader = data
        .build(RunSeed(metronome_core::stream_seed(RunSeed(config.run.seed), 0x5f7, 0)), tokenizer.clone())
        .map_err(err("dataloader"))?;
    let mut cfg = config.trainer.clone();
    // A short warm-up and a cosine decay to a tenth: the supervised phase is long
    // enough for the decay to matter, unlike the RL periods.
    cfg.schedule = metronome_trainer::schedule::LrSchedule {
        lr: sft.learning_rate,
        warmup_steps: (sft.steps / 20).min(50),
        decay: metronome_trainer::schedule::Decay::Cosine { total_steps: sft.steps, min_ratio: 0.1 },
    };
    cfg.loss.kl_coef = 0.0;
    let eos = tokenizer.stop_token_ids().first().copied();
    // With `[env]`, prompts the environment can solve with its tools are shown
    // solved that way, so that RL has tool use to reinforce.
    let environment = config.env.as_ref().map(|env| env.build().map_err(err("env"))).transpose()?;
    let mut trainer = GrpoTrainer::new(cfg, model).map_err(err("trainer"))?;
    let mut losses = Vec::new();
    for step in 1..=sft.steps {
        let Some(batch) = loader.next().await.map_err(err("dataloader"))? else { break };
        let mut examples = Vec::with_capacity(batch.prompts.len());
        for p in &batch.prompts {
            let demonstrated = match &environment {
                Some(env) if shown_with_tools(config, p.id) => {
                    demonstrate(env.as_ref(), p, tokenizer.as_ref(), config.data.prompt.chat_template).await?
                }
                _ => None,
            };
            let mut example = match (demonstrated, &p.reference) {
                (Some(example), _) => example,
                (None, Some(reference)) => SftExample::new(p.tokens.clone(), tokenizer.encode(reference)?),
                (None, None) => continue,
            };
            example.answer.extend(eos);
            examples.push(example);
        }
        if examples.is_empty() {
            return Err(Error::Config {
                key: "sft.steps".into(),
                reason: "the training prompts have no reference answers to warm-start on".into(),
            });
        }
        let report = trainer.accumulate_sft(&examples).map_err(err("trainer"))?;
        trainer.step_sync().map_err(err("trainer"))?;
        let loss = report.loss_sum / report.tokens.max(1) as f64;
        observer.emit(&Event::WarmStartStep { step, steps: sft.steps, loss });
        losses.push(loss);
    }
    let first_last = losses.first().copied().zip(losses.last().copied());
    // With `trainer.lora` the warm start trained adapters: RL starts from the merged
    // model, which gets fresh adapters and is the KL reference.
    let policy = trainer.policy();
    let policy =
        if policy.lora().is_some() { policy.merged().map_err(err("model"))? } else { policy.clone() };
    Ok((policy, first_last))
}

/// Whether the warm start shows `prompt` solved with the environment's tools
/// (`sft.tool_demonstrations`): the same prompts whatever the batch they come in.
fn shown_with_tools(config: &PipelineConfig, prompt: metronome_core::PromptId) -> bool {
    let draw = metronome_core::stream_seed(RunSeed(config.run.seed), TOOL_DEMONSTRATION_STREAM, prompt.0);
    // The top 53 bits as a uniform number in [0, 1).
    ((draw >> 11) as f64) / ((1u64 << 53) as f64) < config.sft.tool_demonstrations
}

/// The [`metronome_core::stream_seed`] stream of the choice of demonstrated prompts.
const TOOL_DEMONSTRATION_STREAM: u64 = 0x746f_6f6c_5f64_656d; // "tool_dem"

/// `prompt` solved as `environment` demonstrates it (`None` when it cannot), played
/// through a real episode: the policy's turns are targets, the observations between
/// them context, rendered as the engine renders them (`chat_template`). The stop
/// token is the caller's to add.
async fn demonstrate(
    environment: &dyn Environment,
    prompt: &Prompt,
    tokenizer: &dyn Tokenizer,
    chat_template: bool,
) -> Result<Option<SftExample>> {
    let Some(turns) = environment.demonstration(prompt) else { return Ok(None) };
    let failed = |reason: String| {
        Error::Stage(metronome_core::Error::invalid(
            format!("the demonstration of prompt {}", prompt.id),
            reason,
        ))
    };
    let mut episode = environment.start(prompt, 0).map_err(|e| failed(format!("no episode: {e}")))?;
    let mut example = SftExample::new(prompt.tokens.clone(), Vec::new());
    let (last, calls) = turns.split_last().ok_or_else(|| failed("has no turns".into()))?;
    for (i, turn) in calls.iter().enumerate() {
        example.answer.extend(tokenizer.encode(turn)?);
        let observation = episode.step(turn).await.map_err(|e| failed(format!("turn {i} failed: {e}")))?;
        if observation.done {
            return Err(failed(format!("the environment ended the episode at turn {i} of {}", turns.len())));
        }
        let tokens = tokenizer.encode(&observation.render(tokenizer, chat_template)?)?;
        // As the engine records them: an empty observation leaves no span.
        if !tokens.is_empty() {
            example.context.push(TokenSpan { start: example.answer.len() as u32, len: tokens.len() as u32 });
            example.answer.extend(tokens);
        }
    }
    example.answer.extend(tokenizer.encode(last)?);
    Ok(Some(example))
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

/// Where [`run`] reports what happens, and how it treats a run directory it finds.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Receives the run's events (the binary renders them).
    pub observer: Observer,
    /// Resume even when the config differs from the stored one in keys that change
    /// what is trained (see [`PipelineConfig::resume_changes`]).
    pub allow_config_change: bool,
}

/// Runs a whole configured run in this process. When `run.out_dir/run.name` holds a
/// checkpoint of an earlier run (killed, or ended and given more `run.periods`), the
/// run resumes from it: trainer, optimiser, generator, data cursor and period, with
/// the record of the periods before it; the weights it ends with equal an
/// uninterrupted run's (`sync` and `periodic`; a `stale:s` run resumes with the newest
/// weights where the uninterrupted one sampled older ones).
pub async fn run(mut config: PipelineConfig, options: RunOptions) -> Result<RunOutcome> {
    config.place();
    config.validate()?;
    // A reward that cannot start (no sandbox, an unreachable judge) fails the run now,
    // not after the warm start; the scorer is built again with the other stages.
    drop(group_scorer(&config)?);
    let session = Session::open(&config, "periods", &options)?;
    let (model, tokenizer) = load_model(&config, config.trainer_device())?;
    let start = session.start(&config, model, tokenizer.clone()).await?;
    let (stages, _) = stages_around(&config, start.trainer, tokenizer)?;
    let transport = (config.run.schedule != Schedule::Sync).then(|| local_transport(&config));
    let runner = Runner::new(stages, transport, config.runner_options())?;
    let checkpointing = Checkpointing {
        dir: session.checkpoints.clone(),
        every: config.run.checkpoint_every,
        interval: std::time::Duration::from_secs(config.run.checkpoint_interval_s),
    };
    session.finish(&config, runner.checkpoint(checkpointing), start.evaluation).await
}

/// What every run of periods does around its [`Runner`], in one process and in the
/// trainer of many: the run directory, the choice between a warm start and the
/// checkpoint to resume from, the evaluator, the period record, and the ending.
pub(crate) struct Session {
    pub(crate) dir: RunDir,
    /// The period checkpoints' folder.
    pub(crate) checkpoints: std::path::PathBuf,
    /// The period a checkpoint there resumes at.
    pub(crate) resume_at: Option<u64>,
    observer: Observer,
    /// The run's TensorBoard event file (one per process start).
    events: Mutex<EventWriter>,
}

/// A session's trainer and evaluation, ready for the runner.
pub(crate) struct Start {
    pub(crate) trainer: GrpoTrainer,
    pub(crate) evaluation: Evaluation,
}

/// What a session measures beside the periods: the warm start's loss and held-out
/// accuracy (the first point before RL, unless resumed).
pub(crate) struct Evaluation {
    evaluator: Option<Evaluator>,
    evals: Vec<EvalPoint>,
    sft_loss: Option<(f64, f64)>,
}

impl Session {
    /// Opens the run directory (`run.out_dir/run.name`, a fresh name when unset) with
    /// its period checkpoints in `checkpoints/<store>`. A checkpoint there means a
    /// resume: refused when the config would train differently, unless allowed; its
    /// record keeps the periods before it.
    pub(crate) fn open(config: &PipelineConfig, store: &str, options: &RunOptions) -> Result<Self> {
        let name = config.run.name.clone().unwrap_or_else(|| {
            let secs =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            format!("{}-{secs}", config.run.schedule).replace(':', "")
        });
        let dir = RunDir::create(&config.run.out_dir, &name)?;
        let checkpoints = dir.checkpoints().join(store);
        let latest = Checkpoints::new(checkpoints.clone()).latest()?;
        if latest.is_some() {
            check_resumable(config, &dir, options.allow_config_change)?;
        }
        dir.write_config(&config.to_toml()?)?;
        // A directory without a checkpoint holds nothing to continue: start over.
        let resume_at = latest.map(|(checkpoint, state)| {
            options.observer.emit(&Event::Resuming { period: state.next_period, checkpoint });
            state.next_period
        });
        dir.resume_record(resume_at.unwrap_or(0))?;
        let events = Mutex::new(EventWriter::create(dir.path())?);
        Ok(Self { dir, checkpoints, resume_at, observer: options.observer.clone(), events })
    }

    /// The trainer around `model`: warm-started and evaluated for a fresh run; as it
    /// is for a resumed one, whose runner restores it from the checkpoint.
    pub(crate) async fn start(
        &self,
        config: &PipelineConfig,
        model: Model,
        tokenizer: Arc<dyn Tokenizer>,
    ) -> Result<Start> {
        let mut evals = Vec::new();
        let mut sft_loss = None;
        let model = if self.resume_at.is_some() {
            model
        } else {
            let (model, loss) = warm_start(config, model, &tokenizer, &self.observer).await?;
            if let Some((first, last)) = loss {
                tracing::info!(first, last, "warm start done");
            }
            sft_loss = loss;
            model
        };
        let evaluator = Evaluator::new(config, &model, tokenizer).await?;
        if let Some(e) = evaluator.as_ref().filter(|_| self.resume_at.is_none()) {
            let initial = Arc::new(model.snapshot(PolicyVersion(0)).map_err(err("model"))?);
            let point = e.evaluate(initial, 0).await?;
            self.observer.emit(&Event::Evaluated { how: config.eval.describe(), accuracy: point.accuracy });
            let mut events = self.events.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            events.scalars(0, &eval_scalars(&point))?;
            evals.push(point);
        }
        let trainer = new_trainer(config, model)?;
        Ok(Start { trainer, evaluation: Evaluation { evaluator, evals, sft_loss } })
    }

    /// Runs `runner` with the period record (and evaluation) as its hook, then saves
    /// the final checkpoint and the plots of the whole run.
    pub(crate) async fn finish(
        self,
        config: &PipelineConfig,
        runner: Runner,
        evaluation: Evaluation,
    ) -> Result<RunOutcome> {
        let Evaluation { evaluator, mut evals, sft_loss } = evaluation;
        let first = self.resume_at.unwrap_or(0);
        self.observer.emit(&Event::PeriodsStarted { first, periods: config.run.periods });
        let shared_evals = Arc::new(Mutex::new(Vec::new()));
        let mut hook = PeriodEndHook {
            dir: self.dir.clone(),
            events: self.events.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner),
            evaluator,
            evals: shared_evals.clone(),
            observer: self.observer.clone(),
            eval_every: config.eval.every,
            periods: config.run.periods,
        };
        let started = Instant::now();
        let end =
            runner.observe(self.observer.clone()).on_period(move |end| hook.period_ended(end)).run().await?;
        tracing::info!(seconds = started.elapsed().as_secs_f64(), "schedule done");

        let mut trainer = end.trainer;
        let weights = Arc::new(trainer.snapshot().await?);
        trainer.save_checkpoint(&self.dir.checkpoints().join("final")).await?;
        evals.extend(shared_evals.lock().unwrap_or_else(std::sync::PoisonError::into_inner).drain(..));
        // The whole run, also when it was resumed: the record on disk.
        let periods = self.dir.read_periods()?;
        self.dir.write_plots(&periods)?;
        self.observer.emit(&Event::RunFinished { dir: self.dir.path().to_owned() });
        Ok(RunOutcome { dir: self.dir, periods, evals, weights, sft_loss })
    }
}

/// Refuses to resume a run whose stored config differs from `config` in a key that
/// changes what is trained, unless told to.
fn check_resumable(config: &PipelineConfig, dir: &RunDir, allow: bool) -> Result<()> {
    let path = dir.path().join(crate::rundir::CONFIG_FILE);
    let stored = std::fs::read_to_string(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
    let changed = config.resume_changes(&stored)?;
    if changed.is_empty() {
        return Ok(());
    }
    if allow {
        tracing::warn!(?changed, "resuming with a changed config, as asked");
        return Ok(());
    }
    Err(Error::Config {
        key: changed.join(", "),
        reason: format!(
            "differs from the config of the run being resumed ({}): it would make a different run; \
             keep the stored values, start a new run.name, or resume anyway (--allow-config-change)",
            path.display()
        ),
    })
}

/// What a run does when a period ends: record it, evaluate when due, report it.
/// (The runner checkpoints after it.)
struct PeriodEndHook {
    dir: RunDir,
    events: EventWriter,
    evaluator: Option<Evaluator>,
    evals: Arc<Mutex<Vec<EvalPoint>>>,
    observer: Observer,
    eval_every: u64,
    periods: u64,
}

impl PeriodEndHook {
    fn period_ended(&mut self, end: &PeriodEnd<'_>) -> Result<()> {
        let report = end.report;
        let done = report.period.0 + 1;
        // The period's line goes first, then the checkpoint that contains it: a
        // resume from an older checkpoint drops the lines after it.
        self.dir.append_period(report)?;
        let mut accuracy = None;
        let mut scalars = period_scalars(report);
        if let Some(e) = &self.evaluator
            && (done.is_multiple_of(self.eval_every) || done == self.periods)
        {
            let handle = tokio::runtime::Handle::current();
            match tokio::task::block_in_place(|| handle.block_on(e.evaluate(end.weights.clone(), done))) {
                Ok(point) => {
                    accuracy = Some(point.accuracy);
                    scalars.extend(eval_scalars(&point));
                    self.evals.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(point);
                }
                Err(err) => tracing::error!("evaluation failed: {}", metronome_core::ErrorChain(&err)),
            }
        }
        self.events.scalars(done, &scalars)?;
        self.observer.emit(&Event::PeriodDone { report: Box::new(report.clone()), accuracy });
        Ok(())
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
    let environment = env.build().map_err(err("env"))?;
    engine
        .with_episodes(metronome_rollout::Episodes {
            environment,
            max_turns: env.max_turns,
            tool_time_limit: std::time::Duration::from_millis(env.tool_time_limit_ms),
            max_running_calls: env.max_running_tool_calls,
            chat_template: config.data.prompt.chat_template,
        })
        .map_err(err("rollout"))
}

/// The run's group scorer, computing advantages with the trainer's estimator.
pub(crate) fn group_scorer(config: &PipelineConfig) -> Result<Box<dyn GroupScorer>> {
    config.reward.build(config.trainer.advantage).map_err(err("reward"))
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

/// The run's trainer around `policy`: `[trainer]`, scoring log-probs at the
/// temperature the engine samples at (`rollout.sampling.temperature`).
fn new_trainer(config: &PipelineConfig, policy: Model) -> Result<GrpoTrainer> {
    GrpoTrainer::new(config.trainer.clone(), policy)
        .and_then(|t| t.with_sampling_temperature(config.rollout.sampling.temperature))
        .map_err(err("trainer"))
}

/// The stages of a configured run around `trainer` (a new one, or one resumed from
/// a checkpoint: the engine starts from its weights and version).
fn stages_around(
    config: &PipelineConfig,
    trainer: GrpoTrainer,
    tokenizer: Arc<dyn Tokenizer>,
) -> Result<(Stages, TrainerHandle)> {
    let source = config.data.build(RunSeed(config.run.seed), tokenizer.clone()).map_err(err("dataloader"))?;
    let engine = rollout_engine(config, trainer.policy(), trainer.version(), tokenizer)?;
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
    let seed = RunSeed(config.run.seed);
    match config.rollout.backend {
        metronome_rollout::Backend::Native => {
            let device = config.rollout_device().open().map_err(err("model"))?;
            let inference = policy.frozen_copy_on(&device).map_err(err("model"))?;
            let engine = config.rollout.build(inference, version, tokenizer, seed).map_err(err("rollout"))?;
            Ok(Arc::new(with_env(engine, config)?))
        }
        #[cfg(feature = "http")]
        metronome_rollout::Backend::Openai => {
            use metronome_rollout::http::{OpenAiEngine, weight_sync_hook};
            let openai = &config.rollout.openai;
            let hook = weight_sync_hook(openai, policy.config().to_hf_json()).map_err(rollout_config)?;
            let engine =
                OpenAiEngine::new(openai.clone(), config.rollout.sampling.clone(), seed, version, hook)
                    .map_err(rollout_config)?;
            Ok(Arc::new(engine))
        }
        #[cfg(not(feature = "http"))]
        metronome_rollout::Backend::Openai => Err(Error::Config {
            key: "rollout.backend".into(),
            reason: "is \"openai\", which needs the `http` feature, left out of this build".into(),
        }),
    }
}

/// A rollout error as the config error it is when it names a field (`rollout.<field>`).
pub(crate) fn rollout_config(e: metronome_rollout::Error) -> Error {
    match e {
        metronome_rollout::Error::Config { field, reason } => {
            Error::Config { key: format!("rollout.{field}"), reason }
        }
        other => Error::Stage(metronome_core::Error::stage("rollout", other)),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use metronome_core::{Episode, Observation, PromptId};
    use metronome_reward::{EnvConfig, ToolCallFormat};

    use super::*;

    fn prompt() -> Prompt {
        Prompt {
            id: PromptId(7),
            text: "2+3=".into(),
            tokens: CharTokenizer.encode("2+3=").unwrap(),
            reference: Some("5".into()),
            metadata: BTreeMap::from([("expression".to_owned(), "2+3".to_owned())]),
        }
    }

    /// Shows two turns, but ends the episode at the first.
    struct EndsEarly;

    struct Done;

    #[async_trait]
    impl Episode for Done {
        async fn step(&mut self, _turn: &str) -> metronome_core::Result<Observation> {
            Ok(Observation::done(Some(1.0)))
        }
    }

    impl Environment for EndsEarly {
        fn start(&self, _: &Prompt, _: u32) -> metronome_core::Result<Box<dyn Episode>> {
            Ok(Box::new(Done))
        }

        fn demonstration(&self, _: &Prompt) -> Option<Vec<String>> {
            Some(vec!["call".into(), "answer".into()])
        }
    }

    #[tokio::test]
    async fn a_demonstration_trains_on_the_turns_and_reads_the_tool_results_as_context() {
        let env = EnvConfig { format: ToolCallFormat::Tag, ..EnvConfig::default() }.build().unwrap();
        let example = demonstrate(env.as_ref(), &prompt(), &CharTokenizer, false).await.unwrap().unwrap();
        let text = |tokens: &[u32]| CharTokenizer.decode(tokens).unwrap();
        assert_eq!(example.prompt, prompt().tokens);
        assert_eq!(text(&example.answer), "<calculator>2+3</calculator><result>5</result>5");
        // The environment's own answer, and only it, is context.
        let [span] = example.context[..] else { panic!("{:?}", example.context) };
        assert_eq!(text(&example.answer[span.start as usize..span.end() as usize]), "<result>5</result>");
        // A prompt the environment cannot show is left to its reference answer.
        let bare = Prompt { metadata: BTreeMap::new(), ..prompt() };
        assert!(demonstrate(env.as_ref(), &bare, &CharTokenizer, false).await.unwrap().is_none());
        // A demonstration the environment does not follow is an error naming the prompt.
        let err = demonstrate(&EndsEarly, &prompt(), &CharTokenizer, false).await.unwrap_err().to_string();
        assert!(err.contains("prompt 7") && err.contains("ended the episode at turn 0 of 2"), "{err}");
    }
}
