//! The period driver: the one loop that runs a schedule's periods, for one process
//! and many.
//!
//! On the trainer's side every schedule is the same loop. For period `k`:
//!
//! 1. the weights of version `k` go out (in the background: the upload overlaps what
//!    follows) and the period's prompts are released through the run's [`Release`];
//! 2. the period's groups are admitted in arrival order, each trained (accumulated) or
//!    given up on with a reason, until every prompt of the period is settled;
//! 3. one optimiser step closes the period (version `k + 1`, also when the trainer
//!    refuses the update);
//! 4. the period hook records it and a checkpoint is written when due; only then does
//!    version `k + 1` go out and are the groups the checkpoint contains acknowledged.
//!
//! What differs between `sync`, `periodic`, `stale:s` and many processes is only how
//! prompts reach generation (the [`Release`]; see `release.rs`). So resuming from a
//! checkpoint, liveness after a refused step, acknowledgement after a durable
//! checkpoint and the handling of poison groups are written once, here, and tested
//! once (`tests/it/driver.rs`, `tests/it/schedules.rs`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metronome_core::{
    Acker, AdvantageEstimator, Cursor, Delivery, ErrorChain, GroupKey, GroupReceiver, GroupScorer,
    GroupSender, NoAck, PeriodId, PromptSource, Reward, RolloutEngine, ScoredGroup, StepReport, TrainBatch,
    Trainer, WeightPublisher, WeightSnapshot, WeightSubscriber,
};

use crate::checkpoint::{Checkpointer, Checkpointing, Checkpoints};
use crate::error::{Error, Result};
use crate::events::{Event, Observer};
use crate::generator::Generator;
use crate::metrics::record_period;
use crate::release::{ProducerRelease, Release, Released, SyncRelease};
use crate::report::{Clock, Interval, PeriodReport, StageKind};
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

/// The stages of a run in one process, each behind its contract.
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

/// The trainer's side of a run whose prompts reach generation through `release`:
/// what [`Runner::from_parts`] drives (a multi-process trainer, say).
pub struct Parts {
    /// Releases each period's prompts; handed to `release` when the run starts.
    pub source: Box<dyn PromptSource>,
    /// Trains.
    pub trainer: Box<dyn Trainer>,
    /// Packs scored groups into micro-batches.
    pub packer: Arc<dyn Packer>,
    /// How prompts reach generation.
    pub release: Box<dyn Release>,
    /// Where groups arrive from; `None` when every group comes with its release.
    pub receiver: Option<Box<dyn GroupReceiver>>,
    /// Where weights go; `None` when the release installs them itself.
    pub publisher: Option<Arc<dyn WeightPublisher>>,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts").field("version", &self.trainer.version()).finish_non_exhaustive()
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
    /// How the trainer's side computes each received group's advantages from its
    /// rewards: the numbers a scorer (maybe in another process) sent are replaced, so
    /// one estimator holds for the whole run whoever scored.
    pub advantage: AdvantageEstimator,
    /// DAPO's dynamic sampling: of each period's groups, train the first this many
    /// (in release order) whose rewards vary; `None` trains every group.
    pub dynamic_sampling: Option<usize>,
    /// Partial rollouts (`stale:s` only, `rollout.partial_rollouts`): the producer
    /// releases a period as soon as its weights are published instead of after the
    /// previous period's slowest response, and responses still running continue
    /// under the newest weights (the engine's side of the setting).
    pub partial_rollouts: bool,
    /// End after the first period that finishes once this much time has passed since
    /// the periods started (`run.time_limit_s`); `None`: `periods` alone decides.
    pub time_limit: Option<Duration>,
    /// How many groups are packed and trained together (`packing.groups_per_pack`):
    /// fixed sets of a period's groups in release order, each trained once all of it
    /// is in; 1 trains every group as it arrives.
    pub groups_per_pack: usize,
}

impl Default for RunnerOptions {
    /// One `periodic` period of groups of one, GRPO's advantages, every group trained.
    fn default() -> Self {
        Self {
            schedule: Schedule::Periodic,
            periods: 1,
            group_size: 1,
            advantage: AdvantageEstimator::default(),
            dynamic_sampling: None,
            partial_rollouts: false,
            time_limit: None,
            groups_per_pack: 1,
        }
    }
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
    /// Whether the run ends with this period: `periods` reached, or the time limit.
    pub last: bool,
}

/// Called after every period, before its checkpoint; an error stops the run (a
/// record that cannot be written must not be lost silently).
pub type PeriodHook = Box<dyn FnMut(&PeriodEnd<'_>) -> Result<()> + Send>;

/// What a run leaves: its reports and the stages it handed back.
pub struct RunEnd {
    /// One report per period this runner ran (after a resume, only the remaining ones);
    /// empty when the runner was told not to keep them ([`Runner::keep_reports`]).
    pub reports: Vec<PeriodReport>,
    /// The period the run resumed at, when it restarted from a checkpoint.
    pub resumed_at: Option<u64>,
    /// The trainer, after the last step.
    pub trainer: Box<dyn Trainer>,
    /// The prompt source, where the run left it.
    pub source: Box<dyn PromptSource>,
}

impl std::fmt::Debug for RunEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunEnd")
            .field("reports", &self.reports.len())
            .field("resumed_at", &self.resumed_at)
            .finish_non_exhaustive()
    }
}

/// Runs a schedule's periods; see the `runner` module docs.
pub struct Runner {
    parts: Parts,
    options: RunnerOptions,
    hook: Option<PeriodHook>,
    checkpointing: Option<Checkpointing>,
    observer: Observer,
    keep_reports: bool,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("options", &self.options).finish_non_exhaustive()
    }
}

/// How long the runner waits for a group before it logs that it is waiting.
const WAIT_NOTICE: Duration = Duration::from_secs(60);

impl Runner {
    /// A runner of the stages in this process. Overlapped schedules (`periodic`,
    /// `stale:s`) need a transport; `sync` ignores it.
    pub fn new(stages: Stages, transport: Option<Transport>, options: RunnerOptions) -> Result<Self> {
        let Stages { source, engine, scorer, packer, trainer } = stages;
        let parts = match (options.schedule, transport) {
            (Schedule::Sync, _) => Parts {
                source,
                trainer,
                packer,
                release: Box::new(SyncRelease::new(Generator::new(engine, options.group_size), scorer)),
                receiver: None,
                publisher: None,
            },
            (schedule, Some(Transport { sender, receiver, publisher, subscriber })) => Parts {
                source,
                trainer,
                packer,
                release: Box::new(ProducerRelease::new(
                    Generator::new(engine, options.group_size).subscribed(subscriber),
                    scorer,
                    sender,
                    schedule.max_lag(),
                    options.partial_rollouts,
                )),
                receiver: Some(receiver),
                publisher: Some(publisher),
            },
            (schedule, None) => {
                return Err(Error::Config {
                    key: "schedule".into(),
                    reason: format!("`{schedule}` overlaps stages and needs a transport"),
                });
            }
        };
        Self::from_parts(parts, options)
    }

    /// A runner of a trainer whose prompts reach generation through `parts.release`.
    pub fn from_parts(parts: Parts, options: RunnerOptions) -> Result<Self> {
        if options.group_size == 0 {
            return Err(Error::Config { key: "group_size".into(), reason: "must be at least 1".into() });
        }
        Ok(Self {
            parts,
            options,
            hook: None,
            checkpointing: None,
            observer: Observer::default(),
            keep_reports: true,
        })
    }

    /// Reports each group trained to `observer` ([`Event::GroupTrained`]).
    #[must_use]
    pub fn observe(mut self, observer: Observer) -> Self {
        self.observer = observer;
        self
    }

    /// Calls `hook` after every period (e.g. to record, evaluate or print).
    #[must_use]
    pub fn on_period(mut self, hook: impl FnMut(&PeriodEnd<'_>) -> Result<()> + Send + 'static) -> Self {
        self.hook = Some(Box::new(hook));
        self
    }

    /// Whether [`RunEnd::reports`] holds every period's report (the default). A run
    /// whose hook records the periods (the CLI's run directory writes each to
    /// `metrics.jsonl`) turns it off: a report holds the period's busy intervals, a
    /// few kilobytes, and over tens of thousands of periods the kept ones were the
    /// run's one memory that grew without bound.
    #[must_use]
    pub fn keep_reports(mut self, keep: bool) -> Self {
        self.keep_reports = keep;
        self
    }

    /// Writes period checkpoints as `checkpointing` says (and after the last period),
    /// acknowledges groups only once a checkpoint contains them, and resumes from the
    /// newest checkpoint found there.
    #[must_use]
    pub fn checkpoint(mut self, checkpointing: Checkpointing) -> Self {
        self.checkpointing = Some(checkpointing);
        self
    }

    /// Runs every period and returns their reports and the stages the runner still
    /// holds. Needs a multi-threaded tokio runtime: the trainer's compute runs in
    /// place on the runtime thread it is called from.
    pub async fn run(self) -> Result<RunEnd> {
        if tokio::runtime::Handle::current().runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return Err(Error::Config {
                key: "runtime".into(),
                reason: "the pipeline needs a multi-threaded tokio runtime".into(),
            });
        }
        let Self { parts, options, hook, checkpointing, observer, keep_reports } = self;
        let Parts { mut source, mut trainer, packer, mut release, receiver, publisher } = parts;
        let checkpoints = checkpointing.map(Checkpointer::new);
        let resumed_at = match &checkpoints {
            Some(c) => resume(&c.store, trainer.as_mut(), source.as_mut()).await?,
            None => None,
        };
        // A restored source resumes the run at the period its cursor names.
        let first = source.cursor().period.0;
        let clock = Clock::start();
        release.start(source, first..options.periods, clock).await?;

        let mut driver = Driver {
            trainer,
            packer,
            receiver,
            options,
            clock,
            observer,
            first: PeriodId(first),
            settled: HashSet::new(),
            held: Vec::new(),
            held_keys: HashSet::new(),
            pending: BTreeMap::new(),
        };
        let outcome = driver.periods(release.as_mut(), publisher, hook, checkpoints, keep_reports).await;
        // Closing the group stream ends a producer that ran ahead (stale schedules).
        drop(driver.receiver.take());
        let reports = outcome?;
        let source = release.finish().await?;
        Ok(RunEnd { reports, resumed_at, trainer: driver.trainer, source })
    }
}

/// Restores the trainer and the prompt source from the newest checkpoint, if any;
/// the period to resume at.
async fn resume(
    store: &Checkpoints,
    trainer: &mut dyn Trainer,
    source: &mut dyn PromptSource,
) -> Result<Option<u64>> {
    let Some((dir, state)) = store.latest()? else { return Ok(None) };
    tracing::info!(period = state.next_period, "resuming from {}", dir.display());
    in_place(trainer.restore_checkpoint(&dir))?;
    source.restore(state.cursor)?;
    let version = trainer.version();
    if version.0 != state.next_period || state.cursor.period.0 != state.next_period {
        return Err(Error::Stage(metronome_core::Error::invalid(
            format!("checkpoint {}", dir.display()),
            format!(
                "resumes at period {} with weights of version {version} and a prompt source at period {}; \
                 they must agree",
                state.next_period, state.cursor.period
            ),
        )));
    }
    Ok(Some(state.next_period))
}

/// A group admitted for training, with what training it needs.
struct Waiting {
    delivery: Delivery,
    batches: Vec<TrainBatch>,
    staleness: u64,
}

/// A period's groups in fixed sets of `size` by release order (`packing.groups_per_pack`):
/// a set is handed back, its trainable groups together, once each of its groups is
/// settled (admitted for training, or settled without it), whatever the arrival order.
struct Packs {
    size: usize,
    /// Each expected group's set.
    of: HashMap<GroupKey, usize>,
    /// Per set: groups not settled yet, and the trainable ones that are.
    left: Vec<usize>,
    ready: Vec<Vec<Waiting>>,
}

impl Packs {
    fn new(order: impl Iterator<Item = GroupKey>, size: usize) -> Self {
        let size = size.max(1);
        let of: HashMap<GroupKey, usize> = order.enumerate().map(|(i, key)| (key, i / size)).collect();
        let mut left = vec![0; of.values().max().map_or(0, |&last| last + 1)];
        for &set in of.values() {
            left[set] += 1;
        }
        Self { size, of, ready: left.iter().map(|_| Vec::new()).collect(), left }
    }

    /// Records `key` as settled (`waiting`: it trains); the groups of its set to train
    /// when that completes the set, else none. A key outside the period's order (which
    /// admission never lets through) trains alone.
    fn settle(&mut self, key: GroupKey, waiting: Option<Waiting>) -> Vec<Waiting> {
        if self.size == 1 {
            return waiting.into_iter().collect();
        }
        let Some(&set) = self.of.get(&key) else { return waiting.into_iter().collect() };
        self.ready[set].extend(waiting);
        self.left[set] -= 1;
        if self.left[set] == 0 { std::mem::take(&mut self.ready[set]) } else { Vec::new() }
    }
}

/// DAPO's dynamic sampling on the trainer's side (Yu et al. 2025, arXiv 2503.14476,
/// §3.2; see `DynamicSampling` in `config.rs`): of a period's groups, in release
/// order, the first `wanted` whose rewards vary are trained, the rest are not. A
/// group is decided only once every group released before it has arrived, so the
/// choice does not depend on completion order and `sync` equals `periodic`.
struct DynamicSampling {
    /// The period's groups in release order.
    order: Vec<GroupKey>,
    /// The first undecided position of `order`.
    next: usize,
    wanted: usize,
    trained: usize,
    /// Arrived and undecided: `None` for a group settled otherwise (rejected, stale).
    arrived: HashMap<GroupKey, Option<Waiting>>,
}

impl DynamicSampling {
    /// The decisions the release order allows now: each group and whether to train it.
    fn decide(&mut self) -> Vec<(Waiting, bool)> {
        let mut decided = Vec::new();
        while let Some(waiting) = self.order.get(self.next).and_then(|key| self.arrived.remove(key)) {
            self.next += 1;
            let Some(waiting) = waiting else { continue };
            let train = self.trained < self.wanted && !waiting.delivery.group.stats.all_equal;
            self.trained += usize::from(train);
            decided.push((waiting, train));
        }
        decided
    }
}

/// A delivery whose outcome waits for the checkpoint that contains its period.
struct Held {
    acker: Box<dyn Acker>,
    /// `None`: acknowledge; `Some(reason)`: reject (never deliver it again).
    reject: Option<String>,
}

/// What admission decided about one delivery.
enum Admission {
    /// Trained before by this process, or in the checkpoint it resumed from.
    Duplicate,
    /// A later period's: kept until that period.
    Later,
    /// Never trainable and names no prompt of this period (a closed period's, or a
    /// stranger's): rejected now; the period still waits for its own groups.
    Poison(String),
    /// The period's group for its prompt, not trained: counted and settled.
    Settled { reason: String, stale: bool, reject: bool },
    /// Its micro-batches, to train.
    Train { batches: Vec<TrainBatch>, staleness: u64 },
}

/// The trainer's side of a run, as it drives the periods.
struct Driver {
    trainer: Box<dyn Trainer>,
    packer: Arc<dyn Packer>,
    receiver: Option<Box<dyn GroupReceiver>>,
    options: RunnerOptions,
    clock: Clock,
    observer: Observer,
    /// The first period this process runs; earlier ones are in the checkpoint.
    first: PeriodId,
    /// Every group this process settled (trained or gave up on).
    settled: HashSet<GroupKey>,
    /// Deliveries to acknowledge (or reject) once a checkpoint contains them.
    held: Vec<Held>,
    /// The groups of `held`.
    held_keys: HashSet<GroupKey>,
    /// Groups of later periods, received early.
    pending: BTreeMap<PeriodId, Vec<Delivery>>,
}

impl Driver {
    /// Runs the periods from `self.first` on; their reports if `keep_reports`.
    async fn periods(
        &mut self,
        release: &mut dyn Release,
        publisher: Option<Arc<dyn WeightPublisher>>,
        mut hook: Option<PeriodHook>,
        mut checkpoints: Option<Checkpointer>,
        keep_reports: bool,
    ) -> Result<Vec<PeriodReport>> {
        let mut reports = Vec::new();
        let mut weights = Arc::new(self.trainer.snapshot().await?);
        let mut period = self.first;
        let began = Instant::now();
        // A period starts when its weights go out.
        let mut start = began;
        let mut publishing = publish(publisher.as_ref(), &weights, self.clock, period);
        let mut released =
            if period.0 < self.options.periods { release.release(period, &weights).await? } else { None };
        while let Some(this) = released.take() {
            let mut report = PeriodReport { period, ..PeriodReport::default() };
            report.intervals.extend(finish_publication(publishing).await?);
            let resume = this.resume;
            self.train_period(release, this, &mut report).await?;
            weights = self.step(&mut report).await?;
            report.intervals.extend(release.generated(period).await?);
            finalise_report(&mut report, start);
            record_period(&report);
            tracing::info!(
                period = period.0,
                seconds = report.period_s,
                reward = report.reward_mean,
                loss = report.step.loss,
                "period done"
            );
            let next = PeriodId(period.0 + 1);
            let out_of_time = self.options.time_limit.is_some_and(|limit| began.elapsed() >= limit);
            if out_of_time && next.0 < self.options.periods {
                tracing::info!(period = period.0, "time limit reached: this period is the last");
            }
            let last = next.0 >= self.options.periods || out_of_time;
            if let Some(hook) = hook.as_mut() {
                hook(&PeriodEnd { report: &report, weights: &weights, resume, last })?;
            }
            let checkpointed = match checkpoints.as_mut() {
                Some(c) => in_place(c.save_if_due(self.trainer.as_mut(), next.0, last, resume))?,
                None => false,
            };
            // The new weights go out only now: a published version is recorded, and in
            // a checkpoint when one is due, so a trainer restarted from its checkpoint
            // never publishes an older version after a newer one.
            start = Instant::now();
            publishing = publish(publisher.as_ref(), &weights, self.clock, next);
            // Without checkpoints nothing could bring a group back after a crash, so
            // there is nothing to wait for; with them, a group waits for the one that
            // contains it.
            if checkpointed || checkpoints.is_none() {
                self.settle_held().await?;
            }
            release.close(period).await?;
            if keep_reports {
                reports.push(report);
            }
            period = next;
            if !last {
                released = release.release(period, &weights).await?;
            }
        }
        // The last weights go out too, for the rollout side and anyone watching.
        finish_publication(publishing).await?;
        Ok(reports)
    }

    /// Closes the report's period with one step; the weights it produced.
    async fn step(&mut self, report: &mut PeriodReport) -> Result<Arc<WeightSnapshot>> {
        let t = Instant::now();
        report.step = close_period(self.trainer.as_mut(), report.period)?;
        report.intervals.push(self.clock.interval(StageKind::Training, report.period, t));
        let t = Instant::now();
        let weights = Arc::new(self.trainer.snapshot().await?);
        report.intervals.push(self.clock.interval(StageKind::Publication, report.period, t));
        Ok(weights)
    }

    /// Receives and trains `period`'s groups until every prompt of it is settled.
    async fn train_period(
        &mut self,
        release: &mut dyn Release,
        released: Released,
        report: &mut PeriodReport,
    ) -> Result<()> {
        let period = report.period;
        let expected: BTreeSet<GroupKey> =
            released.prompts.iter().map(|&prompt| GroupKey { period, prompt }).collect();
        let mut open = expected.clone();
        let mut packs = Packs::new(
            released.prompts.iter().map(|&prompt| GroupKey { period, prompt }),
            self.options.groups_per_pack,
        );
        let mut dynamic = self.options.dynamic_sampling.map(|wanted| DynamicSampling {
            order: released.prompts.iter().map(|&prompt| GroupKey { period, prompt }).collect(),
            next: 0,
            wanted,
            trained: 0,
            arrived: HashMap::new(),
        });
        let mut backlog: VecDeque<Delivery> = released
            .groups
            .into_iter()
            .map(|group| Delivery { group, acker: Box::new(NoAck) })
            .chain(self.pending.remove(&period).unwrap_or_default())
            .collect();
        // Deliveries left in the backlog once the period is complete are duplicates or
        // strangers; admission deals with them too.
        while !open.is_empty() || !backlog.is_empty() {
            let mut delivery = match backlog.pop_front() {
                Some(d) => d,
                None => self.receive(release, period, expected.len() - open.len(), expected.len()).await?,
            };
            let key = delivery.group.key();
            let waiting = backlog.len() + self.pending.values().map(Vec::len).sum::<usize>();
            crate::metrics::queue_depth(waiting);
            match self.admit(&mut delivery.group, period, &expected) {
                Admission::Duplicate => {
                    report.duplicates += 1;
                    self.hold_or_ack(delivery, key).await?;
                }
                Admission::Later => self.pending.entry(key.period).or_default().push(delivery),
                Admission::Poison(reason) => {
                    note_rejected(report, key, &reason);
                    delivery.acker.reject(&reason).await?;
                }
                Admission::Settled { reason, stale, reject } => {
                    if stale {
                        report.dropped_stale += 1;
                        tracing::warn!(%key, "not training group {key}: {reason}");
                    } else {
                        note_rejected(report, key, &reason);
                    }
                    report.generated_tokens += tokens(&delivery.group);
                    open.remove(&key);
                    self.settled.insert(key);
                    self.hold(delivery.acker, key, reject.then_some(reason));
                    if let Some(dynamic) = dynamic.as_mut() {
                        dynamic.arrived.insert(key, None);
                    }
                    let pack = packs.settle(key, None);
                    self.train_pack(report, pack)?;
                }
                Admission::Train { batches, staleness } => {
                    report.generated_tokens += tokens(&delivery.group);
                    open.remove(&key);
                    self.settled.insert(key);
                    let waiting = Waiting { delivery, batches, staleness };
                    match dynamic.as_mut() {
                        Some(dynamic) => {
                            dynamic.arrived.insert(key, Some(waiting));
                        }
                        None => {
                            let pack = packs.settle(key, Some(waiting));
                            self.train_pack(report, pack)?;
                        }
                    }
                }
            }
            // What arrived may be what the release order waited for.
            for (waiting, train) in dynamic.as_mut().map(DynamicSampling::decide).unwrap_or_default() {
                let key = waiting.delivery.group.key();
                let pack = if train {
                    packs.settle(key, Some(waiting))
                } else {
                    report.filtered += 1;
                    tracing::debug!(%key, "dynamic sampling does not train group {key}");
                    self.hold(waiting.delivery.acker, key, None);
                    packs.settle(key, None)
                };
                self.train_pack(report, pack)?;
            }
        }
        Ok(())
    }

    /// Accumulates the admitted groups of a complete pack (none while it is not).
    /// One group trains the micro-batches admission packed for it; several are packed
    /// together in key order, so the micro-batches do not depend on arrival order.
    fn train_pack(&mut self, report: &mut PeriodReport, mut pack: Vec<Waiting>) -> Result<()> {
        let Some(first) = pack.first() else { return Ok(()) };
        let period = first.delivery.group.key().period;
        pack.sort_by_key(|w| w.delivery.group.key());
        let batches = if pack.len() == 1 { None } else { self.pack_together(&pack) };
        let t = Instant::now();
        let mut own = Vec::new();
        for waiting in &mut pack {
            let key = waiting.delivery.group.key();
            tracing::debug!("accumulating a group of period {} (prompt {})", key.period, key.prompt);
            note_group(report, &waiting.delivery.group, waiting.staleness);
            own.append(&mut waiting.batches);
        }
        for batch in batches.unwrap_or(own) {
            accumulate(self.trainer.as_mut(), batch)?;
        }
        report.intervals.push(self.clock.interval(StageKind::Training, period, t));
        for Waiting { delivery, .. } in pack {
            let key = delivery.group.key();
            self.hold(delivery.acker, key, None);
            self.observer.emit(&Event::GroupTrained { period: key.period.0, prompt: key.prompt.0 });
        }
        Ok(())
    }

    /// The micro-batches of several groups packed together; `None` (each group then
    /// trains its own) if they do not pack, which admission's packing of each group
    /// alone makes a packer's bug rather than the data's.
    fn pack_together(&self, pack: &[Waiting]) -> Option<Vec<TrainBatch>> {
        let groups: Vec<ScoredGroup> = pack.iter().map(|w| w.delivery.group.clone()).collect();
        let packed = self.packer.pack(&groups).map_err(|e| ErrorChain(&e).to_string()).and_then(|batches| {
            batches.iter().try_for_each(TrainBatch::validate).map_err(|e| e.to_string()).map(|()| batches)
        });
        packed
            .inspect_err(|e| {
                tracing::warn!("{} groups did not pack together ({e}): training each alone", pack.len())
            })
            .ok()
    }

    /// The next delivery from the group stream, watching the generating side for a
    /// failure and telling the operator when nothing arrives for a while.
    async fn receive(
        &mut self,
        release: &mut dyn Release,
        period: PeriodId,
        received: usize,
        expected: usize,
    ) -> Result<Delivery> {
        let Some(receiver) = self.receiver.as_mut() else {
            // Every group comes with its release, and one is missing.
            return Err(Error::StreamClosed { period, received, expected });
        };
        loop {
            // Cancelling a receive loses nothing: an unacknowledged group comes back.
            tokio::select! {
                biased;
                e = release.failure() => return Err(e),
                next = tokio::time::timeout(WAIT_NOTICE, receiver.recv()) => match next {
                    Ok(next) => return next?.ok_or(Error::StreamClosed { period, received, expected }),
                    Err(_) => tracing::warn!(
                        "period {period}: {received} of {expected} groups in after waiting {}s; is generation running?",
                        WAIT_NOTICE.as_secs()
                    ),
                },
            }
        }
    }

    /// Decides what to do with a delivery while `period` is being trained.
    fn admit(&self, group: &mut ScoredGroup, period: PeriodId, expected: &BTreeSet<GroupKey>) -> Admission {
        let key = group.key();
        if self.settled.contains(&key) || key.period < self.first {
            return Admission::Duplicate;
        }
        if key.period > period {
            return Admission::Later;
        }
        if key.period < period {
            return Admission::Poison(format!("it belongs to period {}, which is closed", key.period));
        }
        if !expected.contains(&key) {
            return Admission::Poison(format!(
                "it is not one of period {period}'s prompts: another trainer may share these streams"
            ));
        }
        let settle = |reason: String| Admission::Settled { reason, stale: false, reject: true };
        // The advantages are the trainer's own, from the rewards: the numbers another
        // process sent are not trusted, and one estimator holds for the run.
        if let Err(e) = group.recompute(self.options.advantage) {
            return settle(format!("its rewards are unusable: {e}"));
        }
        let version = self.trainer.version();
        let lag = self.options.schedule.max_lag();
        if let Some(sampled) = group.group.newest_version().filter(|&v| v > version) {
            return settle(format!(
                "it was sampled with weights of version {sampled}, newer than the trainer's {version}"
            ));
        }
        // A partial rollout's tokens span several versions: the oldest counts.
        let staleness = group.group.oldest_version().map_or(0, |sampled| sampled.staleness(version));
        if staleness > lag {
            // The release's wait makes this unreachable with a well-behaved engine; a
            // misbehaving one (or another trainer's) must not sneak old samples in.
            return Admission::Settled {
                reason: format!("it is {staleness} versions old, beyond the bound of {lag}"),
                stale: true,
                reject: true,
            };
        }
        if group.group.is_rejected() {
            // Nothing to train, and nothing wrong with the message: acknowledged.
            let reason = "the rollout engine rejected its prompt".to_owned();
            return Admission::Settled { reason, stale: false, reject: false };
        }
        match trainable(self.packer.as_ref(), group) {
            Ok(batches) => Admission::Train { batches, staleness },
            Err(reason) => settle(reason),
        }
    }

    /// A duplicate of a group whose own delivery waits for a checkpoint waits with it
    /// (acknowledging a redelivered message acknowledges the original); any other is
    /// acknowledged now.
    async fn hold_or_ack(&mut self, delivery: Delivery, key: GroupKey) -> Result<()> {
        if self.held_keys.contains(&key) {
            self.hold(delivery.acker, key, None);
            return Ok(());
        }
        delivery.acker.ack().await?;
        Ok(())
    }

    fn hold(&mut self, acker: Box<dyn Acker>, key: GroupKey, reject: Option<String>) {
        self.held.push(Held { acker, reject });
        self.held_keys.insert(key);
    }

    /// Acknowledges (or rejects) every held delivery: a checkpoint contains them.
    async fn settle_held(&mut self) -> Result<()> {
        self.held_keys.clear();
        for held in std::mem::take(&mut self.held) {
            match held.reject {
                None => held.acker.ack().await?,
                Some(reason) => held.acker.reject(&reason).await?,
            }
        }
        Ok(())
    }
}

/// Starts publishing `weights` (for `period`) in the background, so that the
/// upload overlaps what the runner does next; `None` without a publisher.
fn publish(
    publisher: Option<&Arc<dyn WeightPublisher>>,
    weights: &Arc<WeightSnapshot>,
    clock: Clock,
    period: PeriodId,
) -> Option<tokio::task::JoinHandle<Result<Interval>>> {
    let publisher = publisher?.clone();
    let weights = weights.clone();
    Some(tokio::spawn(async move {
        let t = Instant::now();
        publisher.publish(weights).await?;
        Ok(clock.interval(StageKind::Publication, period, t))
    }))
}

/// Waits for a publication started by [`publish`]; its interval.
async fn finish_publication(
    publishing: Option<tokio::task::JoinHandle<Result<Interval>>>,
) -> Result<Option<Interval>> {
    match publishing {
        None => Ok(None),
        Some(task) => Ok(Some(task.await.map_err(|_| Error::TaskLost("weight publication"))??)),
    }
}

fn tokens(group: &ScoredGroup) -> u64 {
    group.group.completions.iter().map(|c| c.tokens.len() as u64).sum()
}

/// The micro-batches of `group`, or why it can never be trained: it does not pack
/// into valid micro-batches (a poison message; checked before any is accumulated, so
/// a group is trained whole or not at all).
fn trainable(packer: &dyn Packer, group: &ScoredGroup) -> std::result::Result<Vec<TrainBatch>, String> {
    let batches = packer
        .pack(std::slice::from_ref(group))
        .map_err(|e| format!("it does not pack: {}", ErrorChain(&e)))?;
    for batch in &batches {
        batch.validate().map_err(|e| format!("it packs into an invalid micro-batch: {e}"))?;
    }
    Ok(batches)
}

/// Counts and logs a group of the period that is not trained; the period goes on.
fn note_rejected(report: &mut PeriodReport, key: GroupKey, reason: &str) {
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
    let correct: Vec<f64> = group.rewards.iter().filter_map(Reward::correct).map(f64::from).collect();
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
    // A fold from +0: an empty `sum` of floats is -0, which prints as "-0.00".
    let busy = |kind| {
        report.intervals.iter().filter(|i| i.stage == kind).map(Interval::seconds).fold(0.0, |a, b| a + b)
    };
    report.generation_s = busy(StageKind::Generation);
    report.training_s = busy(StageKind::Training);
    report.publication_s = busy(StageKind::Publication);
}

/// Runs trainer (or checkpoint) work in place: it is compute- or disk-bound, so the
/// runtime moves other tasks off this thread meanwhile.
fn in_place<T>(work: impl std::future::Future<Output = T>) -> T {
    let handle = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| handle.block_on(work))
}

fn accumulate(trainer: &mut dyn Trainer, batch: TrainBatch) -> Result<()> {
    in_place(trainer.accumulate(batch))?;
    Ok(())
}

/// Steps the trainer, closing `period`, and holds it to the [`Trainer`] contract: the
/// version advances by exactly one, also when a guard refuses the update. Period
/// `k + 1` samples with version `k + 1` and the overlapped schedules wait for it, so a
/// version that stood still would stall them; it is refused here, by name, instead.
/// A refused update is logged: the period's weights go out again, unchanged, under
/// the new version.
fn close_period(trainer: &mut dyn Trainer, period: PeriodId) -> Result<StepReport> {
    let before = trainer.version();
    let report = in_place(trainer.step())?;
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
