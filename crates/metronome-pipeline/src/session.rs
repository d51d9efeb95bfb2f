//! What every run of periods does around its [`Runner`], in one process and in the
//! trainer of many: the run directory, the choice between a warm start and the
//! checkpoint to resume from, held-out evaluation, the period record, and the ending.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use metronome_core::{PolicyVersion, Tokenizer, WeightSnapshot};
use metronome_model::Model;
use metronome_trainer::GrpoTrainer;

use crate::builders::{check_teacher, new_trainer};
use crate::config::PipelineConfig;
use crate::error::Result;
use crate::evaluate::Evaluator;
use crate::events::{Event, Observer};
use crate::report::{EvalPoint, PeriodReport};
use crate::rundir::{OpenRun, RunDir};
use crate::runner::{PeriodEnd, Runner};
use crate::tensorboard::{EventWriter, eval_scalars, period_scalars};
use crate::warm_start::warm_start;

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

/// Where [`run`](crate::run) reports what happens, and how it treats a run directory it finds.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Receives the run's events (the binary renders them).
    pub observer: Observer,
    /// Resume even when the config differs from the stored one in keys that change
    /// what is trained (see [`PipelineConfig::resume_changes`]).
    pub allow_config_change: bool,
}

/// A run of periods in the making (see the module docs).
pub(crate) struct Session {
    pub(crate) dir: RunDir,
    /// The period checkpoints' folder.
    pub(crate) checkpoints: PathBuf,
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
        let OpenRun { dir, checkpoints, resume, set_aside } =
            RunDir::open_run(config, store, options.allow_config_change)?;
        for s in set_aside {
            options.observer.emit(&Event::CheckpointSetAside { moved_to: s.moved_to, reason: s.reason });
        }
        let resume_at = resume.map(|(checkpoint, period)| {
            options.observer.emit(&Event::Resuming { period, checkpoint });
            period
        });
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
        check_teacher(config, &model)?;
        let model = if self.resume_at.is_some() {
            model
        } else {
            let checkpoints = self.dir.warm_start_checkpoints();
            let (model, loss) = warm_start(config, model, &tokenizer, &self.observer, checkpoints).await?;
            if let Some((first, last)) = loss {
                tracing::info!(first, last, "warm start done");
            }
            sft_loss = loss;
            model
        };
        let mut evaluator = Evaluator::new(config, &model, tokenizer).await?;
        if let Some(e) = evaluator.as_mut().filter(|_| self.resume_at.is_none()) {
            let initial = Arc::new(model.snapshot(PolicyVersion(0))?);
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
        };
        let started = Instant::now();
        // The hook writes each period to the run directory, which is the record read
        // back below; the runner need not hold them all.
        let end = runner
            .observe(self.observer.clone())
            .on_period(move |end| hook.period_ended(end))
            .keep_reports(false)
            .run()
            .await?;
        tracing::info!(seconds = started.elapsed().as_secs_f64(), "schedule done");

        let mut trainer = end.trainer;
        // In host memory: what a caller reads (the trainer may publish resident ones).
        let weights = Arc::new(trainer.snapshot().await?.into_host()?);
        trainer.save_checkpoint(&self.dir.checkpoints().join("final")).await?;
        evals.extend(shared_evals.lock().unwrap_or_else(std::sync::PoisonError::into_inner).drain(..));
        // The whole run, also when it was resumed: the record on disk.
        let periods = self.dir.read_periods()?;
        self.dir.write_plots(&periods)?;
        self.observer.emit(&Event::RunFinished { dir: self.dir.path().to_owned() });
        Ok(RunOutcome { dir: self.dir, periods, evals, weights, sft_loss })
    }
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
        if let Some(e) = &mut self.evaluator
            && (done.is_multiple_of(self.eval_every) || end.last)
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
