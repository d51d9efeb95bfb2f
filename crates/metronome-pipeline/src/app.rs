//! A whole run from a [`PipelineConfig`]: build the stages, warm-start with SFT, run
//! the schedule, evaluate on held-out prompts, and record everything in the run
//! directory. The `metronome` binary and `cargo xtask e2e` call [`run`].

use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use metronome_core::{
    AccumulateReport, Completion, GroupScorer, PeriodId, PolicyVersion, Prompt, PromptSource, RewardFn,
    RolloutEngine, RolloutRequest, RunSeed, ScoredGroup, StepReport, Tokenizer, TrainBatch, Trainer,
    WeightSnapshot,
};
use metronome_model::{CharTokenizer, DeviceSpec, HfTokenizer, Model, ModelConfig};
use metronome_reward::{RewardConfig, ScorerConfig};
use metronome_rollout::CollectSink;
use metronome_trainer::{GrpoTrainer, SftExample};
use metronome_transport::local;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{Checkpoints, RunState};
use crate::config::{ModelSource, PipelineConfig};
use crate::error::{Error, Result};
use crate::report::PeriodReport;
use crate::rundir::RunDir;
use crate::runner::{PeriodEnd, Runner, RunnerOptions, Stages, Transport};
use crate::schedule::Schedule;
use crate::summary::summary_table;

/// Held-out accuracy at one point of the run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    /// Optimiser steps of RL taken before the evaluation (0: after the warm start).
    pub after_periods: u64,
    /// Fraction of held-out answers that are correct (greedy, or sampled as `eval` says).
    pub accuracy: f64,
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
        RewardConfig::Remote(_) => ScorerConfig::Math(Default::default()),
    };
    scorer.build().map_err(err("reward"))
}

/// Greedy answers to held-out prompts, scored by the `correct` part of the reward
/// (or a positive total when the scorer reports no such part).
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
        let engine = engine_cfg.build(inference, PolicyVersion(0), tokenizer).map_err(err("rollout"))?;
        Ok(Some(Self { engine, prompts, scorer: eval_scorer(config)?, samples: config.eval.samples }))
    }

    async fn accuracy(&self, weights: Arc<WeightSnapshot>) -> Result<f64> {
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
                let r = self.scorer.score(p, c);
                r.parts.get("correct").map_or(f64::from(u8::from(r.total > 0.0)), |&x| f64::from(x))
            })
            .sum();
        Ok(correct / answers.max(1) as f64)
    }
}

/// Supervised warm start: `sft.steps` steps of cross-entropy on reference answers.
pub(crate) async fn warm_start(
    config: &PipelineConfig,
    model: Model,
    tokenizer: &Arc<dyn Tokenizer>,
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
    let mut trainer = GrpoTrainer::new(cfg, model).map_err(err("trainer"))?;
    let mut losses = Vec::new();
    for _ in 0..sft.steps {
        let Some(batch) = loader.next().await.map_err(err("dataloader"))? else { break };
        let mut examples = Vec::with_capacity(batch.prompts.len());
        for p in &batch.prompts {
            let Some(reference) = &p.reference else { continue };
            let mut answer = tokenizer.encode(reference)?;
            answer.extend(eos);
            examples.push(SftExample { prompt: p.tokens.clone(), answer });
        }
        if examples.is_empty() {
            return Err(Error::Config {
                key: "sft.steps".into(),
                reason: "the training prompts have no reference answers to warm-start on".into(),
            });
        }
        let report = trainer.accumulate_sft(&examples).map_err(err("trainer"))?;
        trainer.step_sync().map_err(err("trainer"))?;
        losses.push(report.loss_sum / report.tokens.max(1) as f64);
    }
    let first_last = losses.first().copied().zip(losses.last().copied());
    Ok((trainer.policy().clone(), first_last))
}

/// The GRPO trainer behind a lock: the runner owns it as a stage while the caller keeps
/// this handle for checkpoints and inspection.
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
}

/// How [`run`] treats its terminal and a run directory it finds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Draw progress bars on stderr.
    pub progress: bool,
    /// Resume even when the config differs from the stored one in keys that change
    /// what is trained (see [`PipelineConfig::resume_changes`]).
    pub allow_config_change: bool,
}

/// Runs a whole configured run. When `run.out_dir/run.name` holds a checkpoint of
/// an earlier run (killed, or ended and given more `run.periods`), the run resumes
/// from it: trainer, optimiser, generator, data cursor and period, with the record of
/// the periods before it; the weights it ends with equal an uninterrupted run's
/// (`sync` and `periodic`; a `stale:s` run resumes with the newest weights where the
/// uninterrupted one sampled older ones).
pub async fn run(mut config: PipelineConfig, options: RunOptions) -> Result<RunOutcome> {
    config.place();
    config.validate()?;
    let name = config.run.name.clone().unwrap_or_else(|| {
        let secs =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        format!("{}-{secs}", config.run.schedule).replace(':', "")
    });
    let dir = RunDir::create(&config.run.out_dir, &name)?;
    let checkpoints = Checkpoints::new(dir.checkpoints().join("periods"));
    let resumed = checkpoints.latest()?;
    if resumed.is_some() {
        check_resumable(&config, &dir, options.allow_config_change)?;
    }
    dir.write_config(&config.to_toml()?)?;

    let (model, tokenizer) = load_model(&config, config.trainer_device())?;
    let mut evals = Vec::new();
    let mut sft_loss = None;
    let (trainer, evaluator, resume) = match resumed {
        Some((path, state)) => {
            let device = model.device().clone();
            drop(model);
            eprintln!("resuming at period {} from {}", state.next_period, path.display());
            let trainer =
                GrpoTrainer::resume(config.trainer.clone(), &path, &device).map_err(err("trainer"))?;
            dir.resume_record(state.next_period)?;
            let evaluator = Evaluator::new(&config, trainer.policy(), tokenizer.clone()).await?;
            (trainer, evaluator, Some(state))
        }
        None => {
            // A directory without a checkpoint holds nothing to continue: start over.
            dir.resume_record(0)?;
            let bar = progress_bar(options.progress, config.sft.steps, "sft");
            let (model, loss) = warm_start(&config, model, &tokenizer).await?;
            bar.finish_and_clear();
            if let Some((first, last)) = loss {
                tracing::info!(first, last, "warm start done");
            }
            sft_loss = loss;
            let evaluator = Evaluator::new(&config, &model, tokenizer.clone()).await?;
            if let Some(e) = &evaluator {
                let initial = Arc::new(model.snapshot(PolicyVersion(0)).map_err(err("model"))?);
                let accuracy = e.accuracy(initial).await?;
                eprintln!(
                    "held-out accuracy ({}) after warm start: {:.1}%",
                    config.eval.describe(),
                    accuracy * 100.0
                );
                evals.push(EvalPoint { after_periods: 0, accuracy });
            }
            (GrpoTrainer::new(config.trainer.clone(), model).map_err(err("trainer"))?, evaluator, None)
        }
    };

    let (mut stages, trainer) = stages_around(&config, trainer, tokenizer.clone())?;
    if let Some(state) = resume {
        stages.source.restore(state.cursor).map_err(err("dataloader"))?;
    }
    let transport = (config.run.schedule != Schedule::Sync).then(|| local_transport(&config));
    let options_runner = RunnerOptions {
        schedule: config.run.schedule,
        periods: config.run.periods,
        group_size: config.run.group_size,
    };

    let first = resume.map_or(0, |s| s.next_period);
    let bar = Arc::new(progress_bar(options.progress, config.run.periods.saturating_sub(first), "periods"));
    let shared_evals = Arc::new(Mutex::new(Vec::new()));
    let hook = PeriodEndHook {
        dir: dir.clone(),
        checkpoints,
        trainer: trainer.clone(),
        evaluator: evaluator.map(Arc::new),
        evals: shared_evals.clone(),
        bar: bar.clone(),
        eval_every: config.eval.every,
        periods: config.run.periods,
        checkpoint_every: config.run.checkpoint_every,
        checkpoint_interval: std::time::Duration::from_secs(config.run.checkpoint_interval_s),
        last_checkpoint: Instant::now(),
    };
    let started = Instant::now();
    let mut hook = hook;
    let runner = Runner::new(stages, transport, options_runner)?.on_period(move |end| hook.period_ended(end));
    let (_, stages) = runner.run().await?;
    bar.finish_and_clear();
    tracing::info!(seconds = started.elapsed().as_secs_f64(), "schedule done");

    let weights = Arc::new(stages.trainer.snapshot().await?);
    trainer.lock().save_checkpoint(&dir.checkpoints().join("final")).map_err(err("trainer"))?;
    evals.extend(shared_evals.lock().unwrap_or_else(std::sync::PoisonError::into_inner).drain(..));
    // The whole run, also when it was resumed: the record on disk.
    let periods = dir.read_periods()?;
    dir.write_plots(&periods)?;
    eprintln!("\n{}", summary_table(&periods));
    eprintln!("run directory: {}", dir.path().display());
    Ok(RunOutcome { dir, periods, evals, weights, sft_loss })
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

/// What `run` does when a period ends: record it, checkpoint when due, evaluate
/// when due, print its line.
struct PeriodEndHook {
    dir: RunDir,
    checkpoints: Checkpoints,
    trainer: TrainerHandle,
    evaluator: Option<Arc<Evaluator>>,
    evals: Arc<Mutex<Vec<EvalPoint>>>,
    bar: Arc<indicatif::ProgressBar>,
    eval_every: u64,
    periods: u64,
    checkpoint_every: u64,
    checkpoint_interval: std::time::Duration,
    last_checkpoint: Instant,
}

impl PeriodEndHook {
    fn period_ended(&mut self, end: &PeriodEnd<'_>) -> Result<()> {
        let report = end.report;
        let done = report.period.0 + 1;
        // The period's line goes first, then the checkpoint that contains it: a
        // resume from an older checkpoint drops the lines after it.
        self.dir.append_period(report)?;
        let by_count = self.checkpoint_every > 0 && done.is_multiple_of(self.checkpoint_every);
        let by_time =
            !self.checkpoint_interval.is_zero() && self.last_checkpoint.elapsed() >= self.checkpoint_interval;
        // Always after the last period too: a run given more periods continues there.
        if by_count || by_time || done == self.periods {
            let state = RunState { next_period: done, cursor: end.resume };
            self.checkpoints.save(&self.trainer.lock(), state)?;
            self.last_checkpoint = Instant::now();
        }
        let mut line = format!(
            "period {:>3}  {:6.2}s  reward {:.3}  loss {:+.4}  kl {:.4}",
            report.period, report.period_s, report.reward_mean, report.step.loss, report.step.kl
        );
        if !report.step.applied {
            line.push_str("  step refused (non-finite)");
        }
        if report.rejected > 0 {
            line.push_str(&format!("  {} groups rejected", report.rejected));
        }
        if let Some(e) = &self.evaluator
            && (done.is_multiple_of(self.eval_every) || done == self.periods)
        {
            let handle = tokio::runtime::Handle::current();
            match tokio::task::block_in_place(|| handle.block_on(e.accuracy(end.weights.clone()))) {
                Ok(accuracy) => {
                    line.push_str(&format!("  held-out accuracy {:.1}%", accuracy * 100.0));
                    self.evals
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(EvalPoint { after_periods: done, accuracy });
                }
                Err(err) => tracing::error!("evaluation failed: {err}"),
            }
        }
        self.bar.inc(1);
        self.bar.suspend(|| eprintln!("{line}"));
        Ok(())
    }
}

pub(crate) fn progress_bar(show: bool, len: u64, what: &'static str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{prefix:>8} [{bar:30}] {pos}/{len} {elapsed}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what);
    bar
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

/// The run's group scorer, computing advantages with the trainer's estimator.
pub(crate) fn group_scorer(config: &PipelineConfig) -> Result<Box<dyn GroupScorer>> {
    let mut reward = config.reward.clone();
    if let RewardConfig::Local { pool, .. } = &mut reward {
        pool.estimator = config.trainer.advantage;
    }
    reward.build().map_err(err("reward"))
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
    let trainer = GrpoTrainer::new(config.trainer.clone(), policy).map_err(err("trainer"))?;
    stages_around(config, trainer, tokenizer)
}

/// The stages of a configured run around `trainer` (a new one, or one resumed from
/// a checkpoint: the engine starts from its weights and version).
fn stages_around(
    config: &PipelineConfig,
    trainer: GrpoTrainer,
    tokenizer: Arc<dyn Tokenizer>,
) -> Result<(Stages, TrainerHandle)> {
    let source = config.data.build(RunSeed(config.run.seed), tokenizer.clone()).map_err(err("dataloader"))?;
    let device = config.rollout_device().open().map_err(err("model"))?;
    let inference = trainer.policy().frozen_copy_on(&device).map_err(err("model"))?;
    let mut engine_cfg = config.rollout.clone();
    engine_cfg.seed = config.run.seed;
    let engine = engine_cfg.build(inference, trainer.version(), tokenizer).map_err(err("rollout"))?;
    let scorer = group_scorer(config)?;
    let packer = packer(config.packing);
    // The trainer scores log-probs at the temperature the engine samples at.
    let trainer =
        trainer.with_sampling_temperature(config.rollout.sampling.temperature).map_err(err("trainer"))?;
    let trainer = TrainerHandle(Arc::new(Mutex::new(trainer)));
    let stages = Stages {
        source: Box::new(source) as Box<dyn PromptSource>,
        engine: Arc::new(engine),
        scorer: Arc::from(scorer),
        packer: Arc::new(packer),
        trainer: Box::new(trainer.clone()),
    };
    Ok((stages, trainer))
}
