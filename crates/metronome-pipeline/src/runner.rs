//! The schedule runner: drives the stages through periods.
//!
//! `sync` is one sequential loop. `periodic` and `stale:s` share one overlapped
//! design: a *producer* task releases each period's prompts, waits until weights of
//! version `period - s` are published, installs the newest, generates, scores each
//! group as it completes and sends it; the *consumer* (this task) trains groups in
//! arrival order, steps once a period's groups are all in, and publishes the new
//! weights. With `s = 0` that is periodic asynchrony exactly; with `s > 0` the same
//! wait is the production/consumption controller that bounds staleness.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use metronome_core::{
    Cursor, Delivery, Group, GroupKey, GroupReceiver, GroupScorer, GroupSender, GroupSink, PeriodId,
    PolicyVersion, PromptBatch, PromptSource, RolloutEngine, RolloutRequest, ScoredGroup, StepReport,
    TrainBatch, Trainer, WeightPublisher, WeightSnapshot, WeightSubscriber,
};
use metronome_rollout::CollectSink;
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::metrics::record_period;
use crate::report::{Interval, PeriodReport, StageKind};
use crate::schedule::Schedule;

/// Turns scored groups into the trainer's micro-batches (the masking crate's packing,
/// configured by the pipeline). Implemented by closures.
pub trait Packer: Send + Sync {
    /// Micro-batches holding exactly the responses of `groups`.
    fn pack(&self, groups: &[ScoredGroup]) -> metronome_core::Result<Vec<TrainBatch>>;
}

impl<F> Packer for F
where
    F: Fn(&[ScoredGroup]) -> metronome_core::Result<Vec<TrainBatch>> + Send + Sync,
{
    fn pack(&self, groups: &[ScoredGroup]) -> metronome_core::Result<Vec<TrainBatch>> {
        self(groups)
    }
}

/// The stages of a run, each behind its contract.
pub struct Stages {
    /// Releases each period's prompts.
    pub source: Box<dyn PromptSource>,
    /// Generates groups.
    pub engine: Arc<dyn RolloutEngine>,
    /// Scores groups.
    pub scorer: Arc<dyn GroupScorer>,
    /// Packs scored groups into micro-batches.
    pub packer: Arc<dyn Packer>,
    /// Trains.
    pub trainer: Box<dyn Trainer>,
}

impl std::fmt::Debug for Stages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stages").field("version", &self.trainer.version()).finish_non_exhaustive()
    }
}

/// The channels between the rollout side and the trainer side (overlapped schedules).
pub struct Transport {
    /// Rollout side of the group stream.
    pub sender: Arc<dyn GroupSender>,
    /// Trainer side of the group stream.
    pub receiver: Box<dyn GroupReceiver>,
    /// Trainer side of the weights.
    pub publisher: Arc<dyn WeightPublisher>,
    /// Rollout side of the weights.
    pub subscriber: Box<dyn WeightSubscriber>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport").finish_non_exhaustive()
    }
}

/// What the runner needs beyond the stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunnerOptions {
    /// The schedule.
    pub schedule: Schedule,
    /// Periods to run (fewer if the prompt source is exhausted first).
    pub periods: u64,
    /// Responses per prompt (`G`).
    pub group_size: u32,
}

/// What the runner tells its hook when a period ends.
#[derive(Debug)]
pub struct PeriodEnd<'a> {
    /// The period's report.
    pub report: &'a PeriodReport,
    /// The weights its step produced (the next period samples with them).
    pub weights: &'a Arc<WeightSnapshot>,
    /// Where the prompt source stands after this period's release: restored with
    /// the trainer's checkpoint of this moment, a run resumes with the next period.
    pub resume: Cursor,
}

/// Called after every period; an error stops the run (a record or checkpoint that
/// cannot be written must not be lost silently).
pub type PeriodHook = Box<dyn FnMut(&PeriodEnd<'_>) -> Result<()> + Send>;

/// Runs a schedule over the stages.
pub struct Runner {
    stages: Stages,
    transport: Option<Transport>,
    options: RunnerOptions,
    hook: Option<PeriodHook>,
    t0: Instant,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("options", &self.options).finish_non_exhaustive()
    }
}

impl Runner {
    /// A runner. Overlapped schedules (`periodic`, `stale:s`) need a transport; `sync`
    /// ignores it.
    pub fn new(stages: Stages, transport: Option<Transport>, options: RunnerOptions) -> Result<Self> {
        if options.group_size == 0 {
            return Err(Error::Config { key: "group_size".into(), reason: "must be at least 1".into() });
        }
        if options.schedule != Schedule::Sync && transport.is_none() {
            return Err(Error::Config {
                key: "schedule".into(),
                reason: format!("`{}` overlaps stages and needs a transport", options.schedule),
            });
        }
        Ok(Self { stages, transport, options, hook: None, t0: Instant::now() })
    }

    /// Calls `hook` after every period (e.g. to evaluate, checkpoint or print).
    #[must_use]
    pub fn on_period(mut self, hook: impl FnMut(&PeriodEnd<'_>) -> Result<()> + Send + 'static) -> Self {
        self.hook = Some(Box::new(hook));
        self
    }

    /// Runs every period and returns their reports and the stages (for a final
    /// evaluation or checkpoint). Needs a multi-threaded tokio runtime: the trainer's
    /// compute runs in place on the runtime thread it is called from.
    pub async fn run(mut self) -> Result<(Vec<PeriodReport>, Stages)> {
        if tokio::runtime::Handle::current().runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return Err(Error::Config {
                key: "runtime".into(),
                reason: "the pipeline needs a multi-threaded tokio runtime".into(),
            });
        }
        self.t0 = Instant::now();
        match self.options.schedule {
            Schedule::Sync => self.run_sync().await,
            Schedule::Periodic | Schedule::Stale(_) => self.run_overlapped().await,
        }
    }

    fn since_start(&self, t: Instant) -> f64 {
        t.duration_since(self.t0).as_secs_f64()
    }

    fn finish_period(
        &mut self,
        report: &PeriodReport,
        weights: &Arc<WeightSnapshot>,
        resume: Cursor,
    ) -> Result<()> {
        record_period(report);
        tracing::info!(
            period = report.period.0,
            seconds = report.period_s,
            reward = report.reward_mean,
            loss = report.step.loss,
            "period done"
        );
        match self.hook.as_mut() {
            Some(hook) => hook(&PeriodEnd { report, weights, resume }),
            None => Ok(()),
        }
    }

    async fn run_sync(mut self) -> Result<(Vec<PeriodReport>, Stages)> {
        let mut reports = Vec::new();
        // A restored source resumes a run at the period its cursor names.
        let first = self.stages.source.cursor().period.0;
        let mut weights = Arc::new(self.stages.trainer.snapshot().await?);
        for k in first..self.options.periods {
            let period = PeriodId(k);
            let start = Instant::now();
            let mut report = PeriodReport { period, ..PeriodReport::default() };

            let t = Instant::now();
            self.stages.engine.install_weights(weights.clone()).await?;
            report.intervals.push(self.interval(StageKind::Publication, period, t));

            let Some(batch) = next_batch(self.stages.source.as_mut()).await? else { break };
            let resume = self.stages.source.cursor();
            let order: BTreeMap<GroupKey, usize> = batch
                .prompts
                .iter()
                .enumerate()
                .map(|(i, p)| (GroupKey { period: batch.period, prompt: p.id }, i))
                .collect();
            let request = RolloutRequest {
                period: batch.period,
                prompts: batch.prompts,
                group_size: self.options.group_size,
            };
            let t = Instant::now();
            let sink = CollectSink::default();
            self.stages
                .engine
                .generate(request, &sink)
                .await
                .map_err(|source| Error::Generation { period, source })?;
            report.intervals.push(self.interval(StageKind::Generation, period, t));

            let t = Instant::now();
            let mut scored = Vec::with_capacity(order.len());
            for group in sink.into_groups() {
                report.generated_tokens +=
                    group.completions.iter().map(|c| c.tokens.len() as u64).sum::<u64>();
                scored.push(self.stages.scorer.score(group).await?);
            }
            report.intervals.push(self.interval(StageKind::Scoring, period, t));
            // Train in release order: a fixed order makes the sync baseline reproducible.
            scored.sort_by_key(|g| order.get(&g.key()).copied().unwrap_or(usize::MAX));

            for group in &scored {
                let micro_batches = match trainable(self.stages.packer.as_ref(), group) {
                    Ok(micro_batches) => micro_batches,
                    Err(reason) => {
                        note_rejected(&mut report, group.key(), &reason);
                        continue;
                    }
                };
                note_group(&mut report, group, 0);
                let t = Instant::now();
                for micro in micro_batches {
                    accumulate(self.stages.trainer.as_mut(), micro)?;
                }
                report.intervals.push(self.interval(StageKind::Training, period, t));
            }
            let t = Instant::now();
            report.step = close_period(self.stages.trainer.as_mut(), period)?;
            report.intervals.push(self.interval(StageKind::Training, period, t));

            // The hook sees the weights the step produced, as with the overlapped
            // schedules (an evaluation of the period's own weights would lag one step
            // behind theirs), and the next period samples with them.
            let t = Instant::now();
            weights = Arc::new(self.stages.trainer.snapshot().await?);
            report.intervals.push(self.interval(StageKind::Publication, period, t));
            finalise_report(&mut report, start);
            self.finish_period(&report, &weights, resume)?;
            reports.push(report);
        }
        Ok((reports, self.stages))
    }

    fn interval(&self, stage: StageKind, period: PeriodId, start: Instant) -> Interval {
        Interval { stage, period, start_s: self.since_start(start), end_s: self.since_start(Instant::now()) }
    }

    async fn run_overlapped(mut self) -> Result<(Vec<PeriodReport>, Stages)> {
        let lag = self.options.schedule.max_lag();
        let transport = self.transport.take().expect("checked in Runner::new");
        let Transport { sender, mut receiver, publisher, subscriber } = transport;

        // A restored source resumes the run at the period its cursor names.
        let first = self.stages.source.cursor().period.0;
        let t = Instant::now();
        let mut weights = Arc::new(self.stages.trainer.snapshot().await?);
        publisher.publish(weights.clone()).await?;
        let mut publication = self.interval(StageKind::Publication, PeriodId(first), t);

        // The producer owns the prompt source and the rollout side for the run.
        let source = std::mem::replace(&mut self.stages.source, Box::new(Exhausted));
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let producer = Producer {
            source,
            engine: self.stages.engine.clone(),
            scorer: self.stages.scorer.clone(),
            sender,
            subscriber,
            lag,
            periods: first..self.options.periods,
            group_size: self.options.group_size,
            events: events_tx,
            t0: self.t0,
        };
        let producer = tokio::spawn(producer.run());

        let mut released: BTreeMap<PeriodId, (usize, Cursor)> = BTreeMap::new();
        let mut generated: BTreeMap<PeriodId, (Interval, u64)> = BTreeMap::new();
        let mut pending: BTreeMap<PeriodId, Vec<Delivery>> = BTreeMap::new();
        let mut trained: HashSet<GroupKey> = HashSet::new();
        let mut producer_done = false;
        let mut reports = Vec::new();

        // A period starts when its weights are published: the consumer's own loop may
        // begin later (after the previous period's hook), while generation already runs.
        let mut start = Instant::now();
        'periods: for k in first..self.options.periods {
            let period = PeriodId(k);
            let mut report = PeriodReport { period, ..PeriodReport::default() };
            report.intervals.push(publication);

            let (expected, resume) = loop {
                if let Some(&released) = released.get(&period) {
                    break released;
                }
                if producer_done {
                    break 'periods;
                }
                match events.recv().await {
                    Some(event) => {
                        producer_done |= handle_event(event, &mut released, &mut generated)?;
                    }
                    None => producer_done = true,
                }
            };

            let mut received = 0usize;
            let mut backlog = pending.remove(&period).unwrap_or_default().into_iter();
            while received < expected {
                let delivery = if let Some(d) = backlog.next() {
                    d
                } else {
                    tokio::select! {
                        biased;
                        event = events.recv(), if !producer_done => {
                            match event {
                                Some(event) => producer_done |= handle_event(event, &mut released, &mut generated)?,
                                None => producer_done = true,
                            }
                            continue;
                        }
                        next = receiver.recv() => match next? {
                            Some(d) => d,
                            None => return Err(Error::StreamClosed { period, received, expected }),
                        },
                    }
                };
                let key = delivery.group.key();
                if trained.contains(&key) {
                    report.duplicates += 1;
                    delivery.acker.ack().await?;
                    continue;
                }
                if key.period != period {
                    if key.period < period {
                        // Not a redelivery (those are in `trained`): nothing of ours.
                        let reason = format!("it belongs to period {}, which is closed", key.period);
                        note_rejected(&mut report, key, &reason);
                        delivery.acker.reject(&reason).await?;
                        continue;
                    }
                    pending.entry(key.period).or_default().push(delivery);
                    continue;
                }
                received += 1;
                let version = self.stages.trainer.version();
                let staleness = delivery.group.group.oldest_version().map_or(0, |v| v.staleness(version));
                if staleness > lag {
                    // The producer's wait makes this unreachable with a well-behaved
                    // engine; a misbehaving one must not sneak old samples in.
                    tracing::warn!(%key, staleness, lag, "dropping a group beyond the staleness bound");
                    report.dropped_stale += 1;
                    delivery.acker.ack().await?;
                    continue;
                }
                metrics::gauge!("metronome_pipeline_queue_depth_groups")
                    .set(pending.values().map(Vec::len).sum::<usize>() as f64);
                let micro_batches = match trainable(self.stages.packer.as_ref(), &delivery.group) {
                    Ok(micro_batches) => micro_batches,
                    Err(reason) => {
                        note_rejected(&mut report, key, &reason);
                        trained.insert(key);
                        if delivery.group.group.is_rejected() {
                            delivery.acker.ack().await?;
                        } else {
                            delivery.acker.reject(&reason).await?;
                        }
                        continue;
                    }
                };
                note_group(&mut report, &delivery.group, staleness);
                let t = Instant::now();
                for micro in micro_batches {
                    accumulate(self.stages.trainer.as_mut(), micro)?;
                }
                report.intervals.push(self.interval(StageKind::Training, period, t));
                // Acknowledge only once the group's gradient is accumulated (DESIGN.md §4).
                trained.insert(key);
                delivery.acker.ack().await?;
            }

            let t = Instant::now();
            report.step = close_period(self.stages.trainer.as_mut(), period)?;
            report.intervals.push(self.interval(StageKind::Training, period, t));

            let t = Instant::now();
            weights = Arc::new(self.stages.trainer.snapshot().await?);
            publisher.publish(weights.clone()).await?;
            publication = self.interval(StageKind::Publication, PeriodId(k + 1), t);
            report.publication_s = publication.seconds();
            let next_start = Instant::now();

            // The generation of this period finished before its last group arrived.
            while !generated.contains_key(&period) && !producer_done {
                match events.recv().await {
                    Some(event) => producer_done |= handle_event(event, &mut released, &mut generated)?,
                    None => producer_done = true,
                }
            }
            if let Some((interval, tokens)) = generated.remove(&period) {
                report.intervals.push(interval);
                report.generated_tokens = tokens;
            }
            finalise_report(&mut report, start);
            self.finish_period(&report, &weights, resume)?;
            reports.push(report);
            start = next_start;
        }

        // Closing the receiver ends a producer that ran ahead (stale schedules).
        drop(receiver);
        drop(events);
        // A producer that ran ahead stops at its next send; its error no longer matters.
        self.stages.source = producer.await.map_err(|_| Error::TaskLost("producer"))?;
        Ok((reports, self.stages))
    }
}

/// The next period's prompts, checked to be distinct: a period's groups are identified
/// by (period, prompt id), so a repeated prompt's second group would be dropped as a
/// redelivery and the period would never complete.
pub(crate) async fn next_batch(source: &mut dyn PromptSource) -> Result<Option<PromptBatch>> {
    let Some(batch) = source.next_batch().await? else { return Ok(None) };
    let mut seen = HashSet::with_capacity(batch.prompts.len());
    if let Some(p) = batch.prompts.iter().find(|p| !seen.insert(p.id)) {
        return Err(Error::RepeatedPrompt { period: batch.period, prompt: p.id });
    }
    Ok(Some(batch))
}

/// Folds one producer event into the consumer's books; true when the producer is done.
fn handle_event(
    event: Event,
    released: &mut BTreeMap<PeriodId, (usize, Cursor)>,
    generated: &mut BTreeMap<PeriodId, (Interval, u64)>,
) -> Result<bool> {
    match event {
        Event::Released { period, prompts, resume } => {
            released.insert(period, (prompts, resume));
            Ok(false)
        }
        Event::Generated { interval, tokens } => {
            generated.insert(interval.period, (interval, tokens));
            Ok(false)
        }
        Event::Finished => Ok(true),
        Event::Failed(e) => Err(e),
    }
}

/// The micro-batches of `group`, or why it can never be trained: its prompt was
/// rejected by the engine ([`metronome_core::Group::rejected`]: nothing to train),
/// or it does not pack into valid micro-batches (a poison message; checked before
/// any is accumulated, so a group is trained whole or not at all).
pub(crate) fn trainable(
    packer: &dyn Packer,
    group: &ScoredGroup,
) -> std::result::Result<Vec<TrainBatch>, String> {
    if group.group.is_rejected() {
        return Err("the rollout engine rejected its prompt".into());
    }
    let batches = packer.pack(std::slice::from_ref(group)).map_err(|e| format!("it does not pack: {e}"))?;
    for batch in &batches {
        batch.validate().map_err(|e| format!("it packs into an invalid micro-batch: {e}"))?;
    }
    Ok(batches)
}

/// Counts and logs a group of the period that is not trained; the period goes on.
pub(crate) fn note_rejected(report: &mut PeriodReport, key: GroupKey, reason: &str) {
    report.rejected += 1;
    tracing::warn!(%key, "not training group {key}: {reason}");
}

fn note_group(report: &mut PeriodReport, group: &ScoredGroup, staleness: u64) {
    report.groups += 1;
    report.staleness.push(staleness);
    let n = group.rewards.len().max(1) as f64;
    let mean = group.rewards.iter().map(|r| f64::from(r.total)).sum::<f64>() / n;
    // Running sums; finalise_report turns them into means over groups.
    report.reward_mean += mean;
    let correct: Vec<f64> =
        group.rewards.iter().filter_map(|r| r.parts.get("correct")).map(|&c| f64::from(c)).collect();
    if !correct.is_empty() {
        *report.accuracy.get_or_insert(0.0) += correct.iter().sum::<f64>() / correct.len() as f64;
    }
}

fn finalise_report(report: &mut PeriodReport, start: Instant) {
    report.period_s = start.elapsed().as_secs_f64();
    let groups = report.groups.max(1) as f64;
    report.reward_mean /= groups;
    if let Some(acc) = report.accuracy.as_mut() {
        *acc /= groups;
    }
    let busy = |kind| report.intervals.iter().filter(|i| i.stage == kind).map(Interval::seconds).sum::<f64>();
    report.generation_s = busy(StageKind::Generation);
    report.training_s = busy(StageKind::Training);
    if report.publication_s == 0.0 {
        report.publication_s = busy(StageKind::Publication);
    }
}

/// Runs trainer work in place: it is compute-bound on the trainer's own pool, so the
/// runtime moves other tasks off this thread meanwhile.
fn accumulate(trainer: &mut dyn Trainer, batch: TrainBatch) -> Result<()> {
    let handle = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| handle.block_on(trainer.accumulate(batch)))?;
    Ok(())
}

/// Steps the trainer, closing `period`, and holds it to the [`Trainer`] contract: the
/// version advances by exactly one, also when a guard refuses the update. Period
/// `k + 1` samples with version `k + 1` and the overlapped schedules wait for it, so a
/// version that stood still would stall them; it is refused here, by name, instead.
/// A refused update is logged: the period's weights go out again, unchanged, under
/// the new version.
pub(crate) fn close_period(trainer: &mut dyn Trainer, period: PeriodId) -> Result<StepReport> {
    let before = trainer.version();
    let handle = tokio::runtime::Handle::current();
    let report = tokio::task::block_in_place(|| handle.block_on(trainer.step()))?;
    let after = trainer.version();
    if after != before.next() || report.version != after {
        return Err(Error::TrainerVersion { period, before, after, reported: report.version });
    }
    if !report.applied {
        tracing::warn!(
            period = period.0,
            version = after.0,
            loss = report.loss,
            grad_norm = report.grad_norm,
            "the trainer refused the step (non-finite loss or gradient); the weights stay and go out as version {after}"
        );
    }
    Ok(report)
}

/// How long the producer waits for weights before it logs that it is waiting.
const WAIT_NOTICE: std::time::Duration = std::time::Duration::from_secs(60);

/// What the producer tells the consumer.
enum Event {
    Released { period: PeriodId, prompts: usize, resume: Cursor },
    Generated { interval: Interval, tokens: u64 },
    Finished,
    Failed(Error),
}

struct Producer {
    source: Box<dyn PromptSource>,
    engine: Arc<dyn RolloutEngine>,
    scorer: Arc<dyn GroupScorer>,
    sender: Arc<dyn GroupSender>,
    subscriber: Box<dyn WeightSubscriber>,
    lag: u64,
    periods: std::ops::Range<u64>,
    group_size: u32,
    events: mpsc::UnboundedSender<Event>,
    t0: Instant,
}

impl Producer {
    /// Generates every period, reporting through the events (a failure included:
    /// the consumer decides whether it matters), and hands the prompt source back.
    async fn run(mut self) -> Box<dyn PromptSource> {
        let outcome = self.periods_loop().await;
        // The consumer may be gone already (it stops after its last period).
        let _ = self.events.send(match outcome {
            Ok(()) => Event::Finished,
            Err(e) => Event::Failed(e),
        });
        self.source
    }

    async fn periods_loop(&mut self) -> Result<()> {
        let mut installed: Option<PolicyVersion> = None;
        for k in self.periods.clone() {
            let Some(batch) = next_batch(self.source.as_mut()).await? else { return Ok(()) };
            let period = batch.period;
            let resume = self.source.cursor();
            let _ = self.events.send(Event::Released { period, prompts: batch.prompts.len(), resume });
            // The controller: never generate more than `lag` versions ahead of training.
            let min = PolicyVersion(k.saturating_sub(self.lag));
            let wait = self.subscriber.wait_for(min);
            tokio::pin!(wait);
            // A long wait is the trainer's (a slow step, or one that hangs): say so
            // instead of waiting in silence.
            let weights = loop {
                tokio::select! {
                    weights = &mut wait => break weights?,
                    () = tokio::time::sleep(WAIT_NOTICE) => tracing::warn!(
                        period = period.0,
                        "generation waits for weights of version {min} after {}s; is the trainer stepping?",
                        WAIT_NOTICE.as_secs()
                    ),
                }
            };
            if installed != Some(weights.version) {
                self.engine.install_weights(weights.clone()).await?;
                installed = Some(weights.version);
            }
            let request = RolloutRequest { period, prompts: batch.prompts, group_size: self.group_size };
            let sink = ScoreAndSend {
                scorer: self.scorer.clone(),
                sender: self.sender.clone(),
                tokens: Mutex::new(0),
            };
            let start = Instant::now();
            self.engine
                .generate(request, &sink)
                .await
                .map_err(|source| Error::Generation { period, source })?;
            let end = Instant::now();
            let interval = Interval {
                stage: StageKind::Generation,
                period,
                start_s: start.duration_since(self.t0).as_secs_f64(),
                end_s: end.duration_since(self.t0).as_secs_f64(),
            };
            let tokens = *sink.tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let _ = self.events.send(Event::Generated { interval, tokens });
        }
        Ok(())
    }
}

/// The overlapped schedules' sink: score each group as it completes and send it on.
struct ScoreAndSend {
    scorer: Arc<dyn GroupScorer>,
    sender: Arc<dyn GroupSender>,
    tokens: Mutex<u64>,
}

#[async_trait]
impl GroupSink for ScoreAndSend {
    async fn emit(&self, group: Group) -> metronome_core::Result<()> {
        let tokens: usize = group.completions.iter().map(|c| c.tokens.len()).sum();
        *self.tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += tokens as u64;
        let scored = self.scorer.score(group).await?;
        self.sender.send(scored).await
    }
}

/// Stands in for the prompt source while the producer task owns it.
struct Exhausted;

#[async_trait]
impl PromptSource for Exhausted {
    async fn next_batch(&mut self) -> metronome_core::Result<Option<metronome_core::PromptBatch>> {
        Ok(None)
    }

    fn cursor(&self) -> metronome_core::Cursor {
        metronome_core::Cursor::default()
    }

    fn restore(&mut self, _cursor: metronome_core::Cursor) -> metronome_core::Result<()> {
        Err(metronome_core::Error::invalid("prompt source", "is owned by the running producer"))
    }
}
