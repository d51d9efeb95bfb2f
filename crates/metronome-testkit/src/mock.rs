//! Mock stages whose outputs depend on exactly the inputs the contracts name: the
//! engine's tokens depend on the installed weights (so training on the wrong version
//! shows), the trainer's gradient on the trained tokens and advantages. They are fast
//! and deterministic, for tests of what drives stages (the pipeline's schedules).
//! Source, engine, scorer and trainer pass their [`crate::conformance`] suites (the
//! kit's own tests run them), and their public fields break a contract on purpose
//! where a test needs that.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use metronome_core::*;
use tokio::sync::{mpsc, watch};

/// The number of weights of [`MockTrainer`]'s linear "policy".
pub const DIM: usize = 4;

/// Prompts `0..n` released `batch` at a time.
#[derive(Debug)]
pub struct MockSource {
    /// The next prompt id to release.
    pub next: u64,
    /// Prompts in all: the source is exhausted after prompt `n - 1`.
    pub n: u64,
    /// Prompts per batch.
    pub batch: u64,
    /// The period of the next batch.
    pub period: u64,
}

#[async_trait]
impl PromptSource for MockSource {
    async fn next_batch(&mut self) -> Result<Option<PromptBatch>> {
        if self.next >= self.n {
            return Ok(None);
        }
        let end = (self.next + self.batch).min(self.n);
        let prompts = (self.next..end)
            .map(|id| Prompt {
                id: PromptId(id),
                text: format!("p{id}"),
                tokens: vec![id as u32],
                ..Prompt::default()
            })
            .collect();
        self.next = end;
        let period = PeriodId(self.period);
        self.period += 1;
        Ok(Some(PromptBatch { period, prompts }))
    }

    fn cursor(&self) -> Cursor {
        Cursor { period: PeriodId(self.period), epoch: 0, offset: self.next }
    }

    fn restore(&mut self, cursor: Cursor) -> Result<()> {
        self.next = cursor.offset;
        self.period = cursor.period.0;
        Ok(())
    }
}

/// Generates responses whose tokens hash the installed weights; response lengths vary
/// by prompt so groups complete out of release order. `tick` is the time per token.
#[derive(Debug)]
pub struct MockEngine {
    /// The installed weights.
    pub weights: Mutex<Option<Arc<WeightSnapshot>>>,
    /// Time per generated token.
    pub tick: Duration,
    /// True while a `generate` call runs (shared with [`MockTrainer::generating`]).
    pub generating: Arc<AtomicBool>,
    /// When set, completions claim this version whatever is installed (a broken engine).
    pub force_version: Option<PolicyVersion>,
    /// With `force_version`: the second half of each completion's tokens claims the
    /// installed version when it is newer, as a partial rollout whose first tokens
    /// came from old weights.
    pub switch_to_installed: bool,
    /// Groups in the order the engine emitted them: the completion order.
    pub emitted: Arc<Mutex<Vec<GroupKey>>>,
    /// Prompts it cannot generate from: their groups come out rejected.
    pub reject: BTreeSet<u64>,
    /// Prompts whose group it emits twice (a transport's redelivery, say).
    pub twice: BTreeSet<u64>,
    /// Emits, before the group of prompt `of`, a copy of it under the prompt id `as`,
    /// which is no prompt of the period (another run's group, say): `(of, as)`.
    pub stranger: Option<(u64, u64)>,
}

impl MockEngine {
    /// An engine with no weights installed, taking `tick` per token.
    #[must_use]
    pub fn new(tick: Duration) -> Self {
        Self {
            weights: Mutex::new(None),
            tick,
            generating: Arc::new(AtomicBool::new(false)),
            force_version: None,
            switch_to_installed: false,
            emitted: Arc::default(),
            reject: BTreeSet::new(),
            twice: BTreeSet::new(),
            stranger: None,
        }
    }
}

fn weights_hash(s: &WeightSnapshot) -> u64 {
    let s = s.on_host().expect("the weights read back to the host");
    let TensorData::F32(w) = &s.tensors[0].data else { unreachable!() };
    w.iter().fold(0u64, |h, x| mix64(h ^ u64::from(x.to_bits())))
}

#[async_trait]
impl RolloutEngine for MockEngine {
    async fn generate(&self, request: RolloutRequest, sink: &dyn GroupSink) -> Result<()> {
        let weights = self.weights.lock().unwrap().clone().expect("weights installed before generation");
        let h = weights_hash(&weights);
        self.generating.store(true, Ordering::SeqCst);
        let futures = request.prompts.into_iter().map(|prompt| {
            let weights = weights.clone();
            async move {
                // Lengths vary with the prompt, so groups complete out of release order.
                let len = 2 + ((prompt.id.0 * 7) % 5) as usize;
                tokio::time::sleep(self.tick * len as u32).await;
                let version = self.force_version.unwrap_or(weights.version);
                if self.reject.contains(&prompt.id.0) {
                    let group = Group::rejected(request.period, prompt, request.group_size, version);
                    self.emitted.lock().unwrap().push(group.key());
                    return sink.emit(group).await;
                }
                let completions = (0..request.group_size)
                    .map(|i| {
                        let seed = sample_seed(RunSeed(1), version, prompt.id, i) ^ h;
                        let tokens: Vec<u32> =
                            (0..len as u64).map(|t| (mix64(seed ^ t) % 50) as u32).collect();
                        Completion {
                            sample_index: i,
                            logprobs: vec![-1.0; tokens.len()],
                            text: format!("{tokens:?}"),
                            tokens,
                            finish_reason: FinishReason::Stop,
                            version,
                            switches: if self.switch_to_installed && weights.version > version {
                                vec![VersionSwitch { at: len as u32 / 2, version: weights.version }]
                            } else {
                                Vec::new()
                            },
                            episode: None,
                        }
                    })
                    .collect();
                let group =
                    Group { period: request.period, prompt, completions, timing: GroupTiming::default() };
                self.emitted.lock().unwrap().push(group.key());
                if let Some((of, id)) = self.stranger
                    && group.prompt.id.0 == of
                {
                    let mut stranger = group.clone();
                    stranger.prompt.id = PromptId(id);
                    sink.emit(stranger).await?;
                }
                if self.twice.contains(&group.prompt.id.0) {
                    sink.emit(group.clone()).await?;
                }
                sink.emit(group).await
            }
        });
        let results = futures::future::join_all(futures).await;
        self.generating.store(false, Ordering::SeqCst);
        results.into_iter().collect()
    }

    async fn install_weights(&self, weights: Arc<WeightSnapshot>) -> Result<()> {
        *self.weights.lock().unwrap() = Some(weights);
        Ok(())
    }

    fn version(&self) -> PolicyVersion {
        self.weights.lock().unwrap().as_ref().map_or(PolicyVersion(0), |w| w.version)
    }
}

/// Reward: the fraction of even tokens; `correct` when the first token is even.
#[derive(Debug, Clone, Copy)]
pub struct MockScorer;

#[async_trait]
impl GroupScorer for MockScorer {
    async fn score(&self, group: Group) -> Result<ScoredGroup> {
        let rewards = group
            .completions
            .iter()
            .map(|c| {
                // An empty (rejected) response scores 0, as a real scorer's would.
                let even =
                    c.tokens.iter().filter(|&&t| t % 2 == 0).count() as f32 / c.tokens.len().max(1) as f32;
                let correct = if c.tokens.first().is_some_and(|t| t % 2 == 0) { 1.0 } else { 0.0 };
                Reward::scalar(even).with_correct(correct)
            })
            .collect();
        ScoredGroup::new(group, rewards, AdvantageEstimator::GroupNorm)
    }
}

/// One micro-batch of `groups` for [`MockTrainer`]: every completion token is a
/// target, at one placeholder position (the mock trainer reads only the targets).
#[must_use]
pub fn pack(groups: &[ScoredGroup]) -> TrainBatch {
    let mut batch = TrainBatch {
        rows: vec![PackedRow {
            tokens: vec![0],
            positions: vec![0],
            segments: vec![Segment { start: 0, len: 1, parent: None }],
        }],
        ..TrainBatch::default()
    };
    for g in groups {
        let gi = batch.groups.len() as u32;
        batch.groups.push(TrainGroup {
            key: g.key(),
            num_sequences: g.group.completions.len() as u32,
            group_size: g.group.completions.len() as u32,
            all_equal: g.stats.all_equal,
            reward_mean: g.stats.mean,
        });
        for (c, &adv) in g.group.completions.iter().zip(&g.advantages) {
            let si = batch.sequences.len() as u32;
            batch.sequences.push(TrainSequence {
                group: gi,
                sample_index: c.sample_index,
                version: c.version,
                advantage: adv,
                num_targets: c.tokens.len() as u32,
            });
            for &t in &c.tokens {
                batch.targets.token.push(t);
                batch.targets.sequence.push(si);
                batch.targets.advantage.push(adv);
                batch.targets.behaviour_logprob.push(-1.0);
                batch.targets.row.push(0);
                batch.targets.position.push(0);
            }
        }
    }
    batch
}

/// What the mock trainer saw, shared with the test.
#[derive(Default, Debug)]
pub struct TrainLog {
    /// Per step, the groups accumulated, in accumulation order, with their tokens.
    pub steps: Vec<Vec<(GroupKey, Vec<Vec<u32>>)>>,
    /// Accumulations that happened while the engine was still generating.
    pub during_generation: u64,
}

/// A linear "policy" of `DIM` weights trained by a fixed gradient rule in f64.
#[derive(Debug)]
pub struct MockTrainer {
    /// The policy's weights.
    pub weights: Vec<f64>,
    /// The gradient accumulated since the last step.
    pub grad: Vec<f64>,
    /// Target tokens accumulated since the last step.
    pub tokens: u64,
    /// The version of the weights.
    pub version: PolicyVersion,
    /// What it trained, shared with the test.
    pub log: Arc<Mutex<TrainLog>>,
    /// The groups accumulated since the last step, with their tokens.
    pub current: Vec<(GroupKey, Vec<Vec<u32>>)>,
    /// The engine's flag (see [`MockEngine::generating`]): accumulations while it is
    /// set are counted in [`TrainLog::during_generation`].
    pub generating: Arc<AtomicBool>,
    /// How long each step blocks its thread.
    pub step_delay: Duration,
    /// Micro-batches accumulated, shared with the test.
    pub accumulations: Arc<AtomicU64>,
    /// Steps (by the version they start from) whose update is refused, as the real
    /// trainer's non-finite guard does: the weights stay, the version advances.
    pub refuse: BTreeSet<u64>,
    /// Breaks the contract on a refused step: the version stands still.
    pub keep_version_when_refusing: bool,
    /// Its checkpoints, in order with the acknowledgements of a
    /// [`recording_transport`] given the same log.
    pub events: Events,
}

impl MockTrainer {
    /// A trainer at version 0 that reads the engine's `generating` flag.
    #[must_use]
    pub fn new(generating: Arc<AtomicBool>) -> Self {
        Self {
            weights: vec![0.1, -0.2, 0.3, 0.05],
            grad: vec![0.0; DIM],
            tokens: 0,
            version: PolicyVersion(0),
            log: Arc::default(),
            current: Vec::new(),
            generating,
            step_delay: Duration::ZERO,
            accumulations: Arc::default(),
            refuse: BTreeSet::new(),
            keep_version_when_refusing: false,
            events: Events::default(),
        }
    }
}

#[async_trait]
impl Trainer for MockTrainer {
    fn version(&self) -> PolicyVersion {
        self.version
    }

    async fn accumulate(&mut self, batch: TrainBatch) -> Result<AccumulateReport> {
        batch.validate()?;
        if self.generating.load(Ordering::SeqCst) {
            self.log.lock().unwrap().during_generation += 1;
        }
        self.accumulations.fetch_add(1, Ordering::SeqCst);
        for i in 0..batch.targets.len() {
            let t = f64::from(batch.targets.token[i]);
            let a = f64::from(batch.targets.advantage[i]);
            for (d, g) in self.grad.iter_mut().enumerate() {
                *g += a * (t * (d as f64 + 1.0) * 0.1).sin();
            }
        }
        self.tokens += batch.targets.len() as u64;
        let mut tokens: BTreeMap<u32, Vec<Vec<u32>>> = BTreeMap::new();
        for i in 0..batch.targets.len() {
            let s = batch.targets.sequence[i] as usize;
            let seq = &batch.sequences[s];
            let entry = tokens.entry(seq.group).or_default();
            entry.resize((seq.sample_index + 1).max(entry.len() as u32) as usize, Vec::new());
            entry[seq.sample_index as usize].push(batch.targets.token[i]);
        }
        for (g, seqs) in tokens {
            self.current.push((batch.groups[g as usize].key, seqs));
        }
        Ok(AccumulateReport { tokens: batch.targets.len() as u64, loss_sum: 0.0 })
    }

    async fn step(&mut self) -> Result<StepReport> {
        std::thread::sleep(self.step_delay);
        let applied = !self.refuse.contains(&self.version.0);
        let scale = if applied { 0.01 / self.tokens.max(1) as f64 } else { 0.0 };
        for (w, g) in self.weights.iter_mut().zip(&mut self.grad) {
            *w -= scale * *g;
            *g = 0.0;
        }
        let tokens = std::mem::take(&mut self.tokens);
        if applied || !self.keep_version_when_refusing {
            self.version = self.version.next();
        }
        self.log.lock().unwrap().steps.push(std::mem::take(&mut self.current));
        let loss = if applied { 0.0 } else { f64::NAN };
        Ok(StepReport { version: self.version, applied, tokens, loss, ..StepReport::default() })
    }

    async fn snapshot(&self) -> Result<WeightSnapshot> {
        Ok(WeightSnapshot {
            version: self.version,
            tensors: vec![HostTensor {
                name: "w".into(),
                shape: vec![DIM],
                data: TensorData::F32(self.weights.iter().map(|&w| w as f32).collect()),
            }],
        })
    }

    /// Weights, gradient, tokens and version, as JSON (f64 round-trips exactly).
    async fn save_checkpoint(&mut self, dir: &std::path::Path) -> Result<()> {
        let state = (self.version.0, &self.weights, &self.grad, self.tokens);
        let text = serde_json::to_string(&state).map_err(|e| Error::stage("mock trainer", e))?;
        std::fs::create_dir_all(dir).map_err(|e| Error::stage("mock trainer", e))?;
        std::fs::write(dir.join("mock.json"), text).map_err(|e| Error::stage("mock trainer", e))?;
        self.events.lock().unwrap().push(Recorded::Checkpoint(self.version.0));
        Ok(())
    }

    async fn restore_checkpoint(&mut self, dir: &std::path::Path) -> Result<()> {
        let text =
            std::fs::read_to_string(dir.join("mock.json")).map_err(|e| Error::stage("mock trainer", e))?;
        let (version, weights, grad, tokens): (u64, Vec<f64>, Vec<f64>, u64) =
            serde_json::from_str(&text).map_err(|e| Error::stage("mock trainer", e))?;
        (self.version, self.weights, self.grad, self.tokens) =
            (PolicyVersion(version), weights, grad, tokens);
        Ok(())
    }
}

/// What a [`MockTrainer`] and a [`recording_transport`] did, in order: checkpoints
/// (by the version they hold) and the acknowledgements of groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// A checkpoint of the weights of this version.
    Checkpoint(u64),
    /// A group acknowledged.
    Ack(GroupKey),
    /// A group rejected, with the reason.
    Reject(GroupKey, String),
}

/// A shared log of [`Recorded`] events.
pub type Events = Arc<Mutex<Vec<Recorded>>>;

/// An acknowledgement that records itself.
#[derive(Debug)]
pub struct RecordingAck {
    /// The group it acknowledges.
    pub key: GroupKey,
    /// Where it records.
    pub events: Events,
}

#[async_trait]
impl Acker for RecordingAck {
    async fn ack(self: Box<Self>) -> Result<()> {
        self.events.lock().unwrap().push(Recorded::Ack(self.key));
        Ok(())
    }

    async fn reject(self: Box<Self>, reason: &str) -> Result<()> {
        self.events.lock().unwrap().push(Recorded::Reject(self.key, reason.to_owned()));
        Ok(())
    }
}

/// The four endpoints of [`channel_transport`], named as the pipeline's `Transport`.
#[allow(missing_debug_implementations, reason = "trait objects without Debug")]
pub struct ChannelTransport {
    /// The rollout side of the group stream.
    pub sender: Arc<dyn GroupSender>,
    /// The trainer side of the group stream.
    pub receiver: Box<dyn GroupReceiver>,
    /// The trainer side of the weights.
    pub publisher: Arc<dyn WeightPublisher>,
    /// The rollout side of the weights.
    pub subscriber: Box<dyn WeightSubscriber>,
}

/// A minimal in-process transport over tokio channels, `capacity` groups deep (the
/// real one is `metronome-transport`'s; what drives stages must not depend on which
/// it gets). Publishing a version older than the newest is refused, as the contract
/// asks.
#[must_use]
pub fn channel_transport(capacity: usize) -> ChannelTransport {
    recording_transport(capacity, None)
}

/// [`channel_transport`] whose acknowledgements are recorded in `events` (when given).
#[must_use]
pub fn recording_transport(capacity: usize, events: Option<Events>) -> ChannelTransport {
    struct Tx(mpsc::Sender<ScoredGroup>);
    struct Rx(mpsc::Receiver<ScoredGroup>, Option<Events>);
    struct Pub(watch::Sender<Option<Arc<WeightSnapshot>>>);
    struct Sub(watch::Receiver<Option<Arc<WeightSnapshot>>>);
    #[async_trait]
    impl GroupSender for Tx {
        async fn send(&self, group: ScoredGroup) -> Result<()> {
            self.0.send(group).await.map_err(|_| Error::Closed("group stream".into()))
        }
    }
    #[async_trait]
    impl GroupReceiver for Rx {
        async fn recv(&mut self) -> Result<Option<Delivery>> {
            Ok(self.0.recv().await.map(|group| {
                let acker: Box<dyn Acker> = match &self.1 {
                    Some(events) => Box::new(RecordingAck { key: group.key(), events: events.clone() }),
                    None => Box::new(NoAck),
                };
                Delivery { group, acker }
            }))
        }
    }
    #[async_trait]
    impl WeightPublisher for Pub {
        async fn publish(&self, snapshot: Arc<WeightSnapshot>) -> Result<()> {
            let newest = self.0.borrow().as_ref().map(|w| w.version);
            if let Some(newest) = newest.filter(|&n| n > snapshot.version) {
                let what = format!("weights version {}", snapshot.version);
                return Err(Error::invalid(what, format!("is older than the published version {newest}")));
            }
            self.0.send_replace(Some(snapshot));
            Ok(())
        }
    }
    #[async_trait]
    impl WeightSubscriber for Sub {
        async fn latest(&mut self) -> Result<Option<Arc<WeightSnapshot>>> {
            Ok(self.0.borrow().clone())
        }
        async fn wait_for(&mut self, min: PolicyVersion) -> Result<Arc<WeightSnapshot>> {
            let w = self
                .0
                .wait_for(|w| w.as_ref().is_some_and(|w| w.version >= min))
                .await
                .map_err(|_| Error::Closed("weights".into()))?;
            Ok(w.clone().expect("checked above"))
        }
    }
    let (tx, rx) = mpsc::channel(capacity);
    let (wtx, wrx) = watch::channel(None);
    ChannelTransport {
        sender: Arc::new(Tx(tx)),
        receiver: Box::new(Rx(rx, events)),
        publisher: Arc::new(Pub(wtx)),
        subscriber: Box::new(Sub(wrx)),
    }
}
