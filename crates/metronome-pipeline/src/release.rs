//! How a period's prompts reach generation: the one part of a schedule that differs
//! between `sync`, the overlapped schedules and a run of many processes.
//!
//! The [`Runner`](crate::Runner) drives every period the same way on the trainer's
//! side. It asks a [`Release`] to release each period's prompts (after it has started
//! publishing the period's weights) and, while it waits for the period's groups, to
//! report a failure of the generating side. Three releases exist (the two that
//! generate in this process do it through a [`Generator`], as a rollout worker does):
//!
//! - [`SyncRelease`] (`sync`): installs the weights, generates and scores the whole
//!   period when it is released, and hands the groups over in release order, so that
//!   nothing overlaps and the baseline is reproducible;
//! - [`ProducerRelease`] (`periodic`, `stale:s`): a producer task releases period `k`'s
//!   prompts, waits until weights of version `k − s` are published, installs the newest,
//!   generates, and scores and sends each group as it completes, so that generation
//!   overlaps training (with `s = 0` that is periodic asynchrony exactly; with `s > 0`
//!   the same wait is the production/consumption controller that bounds staleness);
//! - the multi-process trainer's claims (`crate::cluster`), offered to rollout workers
//!   in other processes.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use metronome_core::{
    Cursor, Group, GroupKey, GroupScorer, GroupSender, GroupSink, PeriodId, PolicyVersion, PromptId,
    PromptSource, ScoredGroup, WeightSnapshot,
};
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::generator::Generator;
use crate::report::{Clock, Interval, StageKind};

/// Releases each period's prompts for generation; see the `release` module docs.
#[async_trait]
pub trait Release: Send {
    /// Takes the prompt source for `periods` (a resumed run starts after 0; the
    /// source is already restored to the first of them).
    async fn start(&mut self, source: Box<dyn PromptSource>, periods: Range<u64>, clock: Clock)
    -> Result<()>;

    /// Releases `period`'s prompts, to be sampled with `weights` (whose publication
    /// the runner has started). `Ok(None)` once the prompt source is exhausted.
    async fn release(&mut self, period: PeriodId, weights: &Arc<WeightSnapshot>) -> Result<Option<Released>>;

    /// Resolves only when generation failed, with its error: the runner waits on it
    /// beside the group stream, so that a failure ends the run instead of a wait for
    /// groups that never come. Cancel-safe. By default it never resolves (generation
    /// runs in other processes, whose failures are theirs).
    async fn failure(&mut self) -> Error {
        std::future::pending().await
    }

    /// The generating side's busy intervals of `period`, once it has finished
    /// generating it (this waits for that). None when other processes generate.
    async fn generated(&mut self, period: PeriodId) -> Result<Vec<Interval>> {
        let _ = period;
        Ok(Vec::new())
    }

    /// `period` is over: stepped, recorded, checkpointed when due, and its groups
    /// acknowledged.
    async fn close(&mut self, period: PeriodId) -> Result<()> {
        let _ = period;
        Ok(())
    }

    /// The run is over (or failed): stop generating and hand the prompt source back.
    async fn finish(&mut self) -> Result<Box<dyn PromptSource>>;
}

/// What a period's release tells the runner.
#[derive(Debug, Default)]
pub struct Released {
    /// The period's prompts: the runner waits until each has its group.
    pub prompts: Vec<PromptId>,
    /// Where the prompt source stands after this release: a checkpoint taken when the
    /// period ends resumes a run with the next period.
    pub resume: Cursor,
    /// Groups handed over with the release itself (`sync`), trained in this order
    /// before anything from the group stream.
    pub groups: Vec<ScoredGroup>,
}

/// The next period's prompts, checked to be the period the run is at and to be
/// distinct: a period's groups are identified by (period, prompt id), so a repeated
/// prompt's second group would be dropped as a redelivery and the period would never
/// complete.
pub(crate) async fn next_batch(
    source: &mut dyn PromptSource,
    period: PeriodId,
) -> Result<Option<metronome_core::PromptBatch>> {
    let Some(batch) = source.next_batch().await? else { return Ok(None) };
    if batch.period != period {
        return Err(Error::Stage(metronome_core::Error::invalid(
            "prompt source",
            format!("released period {} where the run is at period {period}", batch.period),
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(batch.prompts.len());
    if let Some(p) = batch.prompts.iter().find(|p| !seen.insert(p.id)) {
        return Err(Error::RepeatedPrompt { period: batch.period, prompt: p.id });
    }
    Ok(Some(batch))
}

fn not_started() -> Error {
    Error::Stage(metronome_core::Error::invalid("release", "was used before `start` or after `finish`"))
}

/// `sync`: the whole period is generated and scored when it is released.
pub(crate) struct SyncRelease {
    generator: Generator,
    scorer: Arc<dyn GroupScorer>,
    source: Option<Box<dyn PromptSource>>,
    clock: Clock,
    intervals: BTreeMap<PeriodId, Vec<Interval>>,
}

impl SyncRelease {
    pub(crate) fn new(generator: Generator, scorer: Arc<dyn GroupScorer>) -> Self {
        Self { generator, scorer, source: None, clock: Clock::start(), intervals: BTreeMap::new() }
    }
}

#[async_trait]
impl Release for SyncRelease {
    async fn start(&mut self, source: Box<dyn PromptSource>, _: Range<u64>, clock: Clock) -> Result<()> {
        self.source = Some(source);
        self.clock = clock;
        Ok(())
    }

    async fn release(&mut self, period: PeriodId, weights: &Arc<WeightSnapshot>) -> Result<Option<Released>> {
        let source = self.source.as_mut().ok_or_else(not_started)?;
        let Some(batch) = next_batch(source.as_mut(), period).await? else { return Ok(None) };
        let resume = source.cursor();
        let mut intervals = Vec::with_capacity(3);

        let t = Instant::now();
        self.generator.install(weights.clone()).await?;
        intervals.push(self.clock.interval(StageKind::Publication, period, t));

        let order: BTreeMap<GroupKey, usize> =
            batch.prompts.iter().enumerate().map(|(i, p)| (GroupKey { period, prompt: p.id }, i)).collect();
        let prompts = batch.prompts.iter().map(|p| p.id).collect();
        let t = Instant::now();
        let generated = self.generator.collect(period, batch.prompts).await?;
        intervals.push(self.clock.interval(StageKind::Generation, period, t));

        let t = Instant::now();
        let mut groups = Vec::with_capacity(order.len());
        for group in generated {
            groups.push(self.scorer.score(group).await?);
        }
        intervals.push(self.clock.interval(StageKind::Scoring, period, t));
        // Train in release order: a fixed order makes the baseline reproducible.
        groups.sort_by_key(|g| order.get(&g.key()).copied().unwrap_or(usize::MAX));
        self.intervals.insert(period, intervals);
        Ok(Some(Released { prompts, resume, groups }))
    }

    async fn generated(&mut self, period: PeriodId) -> Result<Vec<Interval>> {
        Ok(self.intervals.remove(&period).unwrap_or_default())
    }

    async fn finish(&mut self) -> Result<Box<dyn PromptSource>> {
        self.source.take().ok_or_else(not_started)
    }
}

/// What the producer task tells its [`ProducerRelease`].
enum Event {
    Released(PeriodId, Released),
    Generated(Interval),
    Finished,
    Failed(Error),
}

/// `periodic` and `stale:s`: a producer task generates while the runner trains.
pub(crate) struct ProducerRelease {
    /// Moves into the producer task when the run starts.
    generator: Option<Generator>,
    scorer: Arc<dyn GroupScorer>,
    sender: Arc<dyn GroupSender>,
    lag: u64,
    overlap: bool,
    task: Option<tokio::task::JoinHandle<Box<dyn PromptSource>>>,
    events: Option<mpsc::UnboundedReceiver<Event>>,
    released: BTreeMap<PeriodId, Released>,
    generated: BTreeMap<PeriodId, Interval>,
    /// The producer has stopped (finished its periods, ran out of prompts, or failed).
    done: bool,
}

impl ProducerRelease {
    /// Generates with `generator`, which waits for the published weights, at most
    /// `lag` versions behind the period; with `overlap` (partial rollouts) a period
    /// starts generating while earlier ones still do.
    pub(crate) fn new(
        generator: Generator,
        scorer: Arc<dyn GroupScorer>,
        sender: Arc<dyn GroupSender>,
        lag: u64,
        overlap: bool,
    ) -> Self {
        Self {
            generator: Some(generator),
            scorer,
            sender,
            lag,
            overlap,
            task: None,
            events: None,
            released: BTreeMap::new(),
            generated: BTreeMap::new(),
            done: false,
        }
    }

    /// The next event folded into the books; `Err` when the producer failed.
    async fn next_event(&mut self) -> Result<()> {
        let Some(events) = self.events.as_mut() else {
            self.done = true;
            return Ok(());
        };
        match events.recv().await {
            Some(Event::Released(period, released)) => {
                self.released.insert(period, released);
            }
            Some(Event::Generated(interval)) => {
                self.generated.insert(interval.period, interval);
            }
            Some(Event::Finished) | None => self.done = true,
            Some(Event::Failed(e)) => {
                self.done = true;
                return Err(e);
            }
        }
        Ok(())
    }
}

#[async_trait]
impl Release for ProducerRelease {
    async fn start(
        &mut self,
        source: Box<dyn PromptSource>,
        periods: Range<u64>,
        clock: Clock,
    ) -> Result<()> {
        let generator = self.generator.take().ok_or_else(not_started)?;
        let (events_tx, events) = mpsc::unbounded_channel();
        let producer = Producer {
            source,
            generator,
            scorer: self.scorer.clone(),
            sender: self.sender.clone(),
            lag: self.lag,
            overlap: self.overlap,
            periods,
            events: events_tx,
            clock,
        };
        self.task = Some(tokio::spawn(producer.run()));
        self.events = Some(events);
        Ok(())
    }

    async fn release(&mut self, period: PeriodId, _: &Arc<WeightSnapshot>) -> Result<Option<Released>> {
        loop {
            if let Some(released) = self.released.remove(&period) {
                return Ok(Some(released));
            }
            if self.done {
                return Ok(None);
            }
            self.next_event().await?;
        }
    }

    async fn failure(&mut self) -> Error {
        while !self.done {
            if let Err(e) = self.next_event().await {
                return e;
            }
        }
        std::future::pending().await
    }

    async fn generated(&mut self, period: PeriodId) -> Result<Vec<Interval>> {
        while !self.generated.contains_key(&period) && !self.done {
            self.next_event().await?;
        }
        Ok(self.generated.remove(&period).into_iter().collect())
    }

    async fn finish(&mut self) -> Result<Box<dyn PromptSource>> {
        // A producer that ran ahead (stale schedules) stops at its next send, which
        // fails once the runner has dropped the group stream; its error no longer
        // matters.
        self.events = None;
        let task = self.task.take().ok_or_else(not_started)?;
        task.await.map_err(|_| Error::TaskLost("producer"))
    }
}

struct Producer {
    source: Box<dyn PromptSource>,
    generator: Generator,
    scorer: Arc<dyn GroupScorer>,
    sender: Arc<dyn GroupSender>,
    lag: u64,
    /// Partial rollouts: a period is not held back by the slowest response of the one
    /// before it (see [`ProducerRelease::new`]).
    overlap: bool,
    periods: Range<u64>,
    events: mpsc::UnboundedSender<Event>,
    clock: Clock,
}

impl Producer {
    /// Generates every period, reporting through the events (a failure included:
    /// the runner decides whether it matters), and hands the prompt source back.
    async fn run(mut self) -> Box<dyn PromptSource> {
        let outcome = self.periods_loop().await;
        // The runner may be gone already (it stops after its last period).
        let _ = self.events.send(match outcome {
            Ok(()) => Event::Finished,
            Err(e) => Event::Failed(e),
        });
        self.source
    }

    async fn periods_loop(&mut self) -> Result<()> {
        // With `overlap`, the periods still generating, and whether one failed: the
        // producer then stops waiting for weights that will not come.
        let mut running = tokio::task::JoinSet::new();
        let (failed, failure) = tokio::sync::watch::channel(false);
        for k in self.periods.clone() {
            let period = PeriodId(k);
            let Some(batch) = next_batch(self.source.as_mut(), period).await? else { return Ok(()) };
            let released = Released {
                prompts: batch.prompts.iter().map(|p| p.id).collect(),
                resume: self.source.cursor(),
                groups: Vec::new(),
            };
            let _ = self.events.send(Event::Released(period, released));
            // The controller: never generate more than `lag` versions ahead of training.
            let min = PolicyVersion(k.saturating_sub(self.lag));
            let what = format!("generation of period {k}");
            let mut failure = failure.clone();
            let stop = async move {
                let _ = failure.wait_for(|failed| *failed).await;
            };
            // Stopped, a period's generation failed and said so: nothing more to do.
            let Some(weights) = self.generator.wait(min, &what, stop).await? else { break };
            self.generator.install(weights).await?;
            let sink = ScoreAndSend { scorer: self.scorer.clone(), sender: self.sender.clone() };
            let start = Instant::now();
            if self.overlap {
                // The period joins the engine's queue behind what still runs; a failure
                // is reported at once, or the runner would wait for its groups.
                let generation = self.generator.detached(period, batch.prompts, Arc::new(sink));
                let (events, clock, failed) = (self.events.clone(), self.clock, failed.clone());
                running.spawn(async move {
                    let _ = events.send(match generation.await {
                        Ok(()) => Event::Generated(clock.interval(StageKind::Generation, period, start)),
                        Err(e) => {
                            failed.send_replace(true);
                            Event::Failed(e)
                        }
                    });
                });
                continue;
            }
            self.generator.generate(period, batch.prompts, &sink).await?;
            let _ =
                self.events.send(Event::Generated(self.clock.interval(StageKind::Generation, period, start)));
        }
        while let Some(done) = running.join_next().await {
            done.map_err(|_| Error::TaskLost("generation"))?;
        }
        Ok(())
    }
}

/// The generating side's sink: score each group as it completes and send it on.
pub(crate) struct ScoreAndSend {
    pub(crate) scorer: Arc<dyn GroupScorer>,
    pub(crate) sender: Arc<dyn GroupSender>,
}

#[async_trait]
impl GroupSink for ScoreAndSend {
    async fn emit(&self, group: Group) -> metronome_core::Result<()> {
        let scored = self.scorer.score(group).await?;
        self.sender.send(scored).await
    }
}
