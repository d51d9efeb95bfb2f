//! The traits at the stage boundaries.
//!
//! Boundaries that wait on other stages or on the network are async and object-safe
//! (`#[async_trait]`), so the pipeline can hold `Box<dyn …>` chosen from config.
//! Per-sample work that never waits (scoring a completion) is synchronous.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::{
    Completion, Error, Group, PeriodId, PolicyVersion, Prompt, PromptId, Result, Reward, ScoredGroup,
    TrainBatch, WeightSnapshot,
};

/// Where the data loader stands: enough to reproduce every future batch after a
/// restart. It is saved with every checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// The next period to release.
    pub period: PeriodId,
    /// The current epoch (the shuffle of an epoch is derived from the run seed and it).
    pub epoch: u64,
    /// How many prompts of the current epoch's order were already released.
    pub offset: u64,
}

/// The prompts released at the start of one period.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptBatch {
    /// The period.
    pub period: PeriodId,
    /// Its prompts, in release order.
    pub prompts: Vec<Prompt>,
}

/// Releases one batch of prompts per period and can resume exactly.
#[async_trait]
pub trait PromptSource: Send {
    /// The next period's batch. `Ok(None)` when the source is exhausted (a finite
    /// number of epochs was configured and has been served).
    async fn next_batch(&mut self) -> Result<Option<PromptBatch>>;

    /// The position to save with a checkpoint.
    fn cursor(&self) -> Cursor;

    /// Resumes from a saved position: the batches that follow equal those an
    /// uninterrupted run would have released.
    fn restore(&mut self, cursor: Cursor) -> Result<()>;
}

/// What to generate in one period.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutRequest {
    /// The period the prompts belong to.
    pub period: PeriodId,
    /// The prompts.
    pub prompts: Vec<Prompt>,
    /// Responses per prompt (`G`).
    pub group_size: u32,
}

/// Receives groups as the rollout engine completes them.
#[async_trait]
pub trait GroupSink: Send + Sync {
    /// Takes one complete group. An error stops generation.
    async fn emit(&self, group: Group) -> Result<()>;
}

/// Generates `G` responses per prompt with versioned weights.
#[async_trait]
pub trait RolloutEngine: Send + Sync {
    /// Generates every group of `request` with the weights installed now, emitting each
    /// group to `sink` as soon as its last response finishes (completion order), and
    /// returns when all are emitted.
    async fn generate(&self, request: RolloutRequest, sink: &dyn GroupSink) -> Result<()>;

    /// Installs new weights; responses started afterwards use them. Responses already
    /// running finish with the version they started with.
    async fn install_weights(&self, weights: Arc<WeightSnapshot>) -> Result<()>;

    /// The version of the installed weights.
    fn version(&self) -> PolicyVersion;
}

/// Scores one completion synchronously. Implemented by every
/// `Fn(&Prompt, &Completion) -> R` where `R: Into<Reward>` (e.g. `f32`).
pub trait RewardFn: Send + Sync {
    /// The completion's reward.
    fn score(&self, prompt: &Prompt, completion: &Completion) -> Reward;
}

impl<F, R> RewardFn for F
where
    F: Fn(&Prompt, &Completion) -> R + Send + Sync,
    R: Into<Reward>,
{
    fn score(&self, prompt: &Prompt, completion: &Completion) -> Reward {
        self(prompt, completion).into()
    }
}

impl From<f32> for Reward {
    fn from(total: f32) -> Self {
        Reward::scalar(total)
    }
}

/// Scores whole groups; the boundary the pipeline holds (local scorers on a pool,
/// remote reward models over the network).
#[async_trait]
pub trait GroupScorer: Send + Sync {
    /// Rewards and advantages for every completion of `group`, in completion order.
    async fn score(&self, group: Group) -> Result<ScoredGroup>;
}

/// What the trainer reports after accumulating one micro-batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AccumulateReport {
    /// Target tokens accumulated.
    pub tokens: u64,
    /// Sum of the loss contributions, before any step-time normaliser.
    pub loss_sum: f64,
}

/// What the trainer reports after an optimiser step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// The version the step produced: the previous one plus one, whether or not the
    /// update was applied (see [`Trainer::step`]).
    pub version: PolicyVersion,
    /// False when a guard refused the update (non-finite loss or gradient): the
    /// weights of the new version are then those of the previous one.
    pub applied: bool,
    /// Total loss.
    pub loss: f64,
    /// The policy-gradient part of the loss.
    pub policy_loss: f64,
    /// Mean KL to the reference (0 when the KL coefficient is 0).
    pub kl: f64,
    /// Fraction of tokens whose ratio was clipped.
    pub clip_fraction: f64,
    /// Mean per-token entropy of the policy.
    pub entropy: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub learning_rate: f64,
    /// Target tokens in the step.
    pub tokens: u64,
    /// Responses in the step.
    pub sequences: u64,
    /// Groups in the step.
    pub groups: u64,
    /// Groups whose rewards were all equal (zero advantage).
    pub zero_advantage_groups: u64,
    /// Mean absolute difference between trainer and rollout log-probs of the same tokens.
    pub logprob_gap: f64,
    /// The train–rollout mismatch of the step's scored tokens (absent in reports
    /// written before it was measured: read as all zeros).
    #[serde(default)]
    pub mismatch: LogprobMismatch,
    /// On-policy distillation: the mean per-token reverse KL from the policy to the
    /// teacher on the policy's own sampled tokens over the scored targets: its
    /// single-sample estimate `log π(y_t) − log π_teacher(y_t)` under the sampled
    /// signal, the exact sum over the vocabulary under the full one; `None` without a
    /// teacher.
    #[serde(default)]
    pub distill_kl: Option<f64>,
}

/// How far the trainer's log-probs of the sampled tokens are from the behaviour
/// log-probs the rollout engine recorded for them: the train–rollout mismatch of one
/// step, over every target the trainer scored (before masked importance sampling
/// drops any).
///
/// With `d = log π_trainer(y_t) − log π_behaviour(y_t)` per token: the mean, 99th
/// percentile and maximum of `|d|` (nats), and the mean of `k3 = exp(d) − 1 − d`,
/// Schulman's non-negative unbiased estimator of `KL(behaviour ‖ trainer)` from the
/// behaviour's own samples. For a token sampled by the weights the trainer holds,
/// `d` is the engine's numerical mismatch alone (different kernels, precision,
/// temperature handling); for a stale token it also holds the policy's movement since
/// it was sampled (it is then the log of the importance ratio the corrections read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LogprobMismatch {
    /// Target tokens measured.
    pub tokens: u64,
    /// Mean `|d|`, in nats.
    pub mean_abs: f64,
    /// 99th percentile of `|d|`, in nats (a trainer may report it from a histogram:
    /// then an upper bound, never above `max_abs`).
    pub p99_abs: f64,
    /// Largest `|d|`, in nats.
    pub max_abs: f64,
    /// Mean `exp(d) − 1 − d`: the k3 estimate of `KL(behaviour ‖ trainer)`.
    pub kl_k3: f64,
    /// Share of the tokens whose truncated importance weight was capped (`tis_cap`);
    /// 0 without truncated IS.
    pub truncated_share: f64,
    /// Share of the tokens masked importance sampling dropped from the loss; 0
    /// without masked IS.
    pub masked_share: f64,
}

/// The training stage: accumulates micro-batches in any order, then steps.
///
/// Versions count periods: every call of [`Trainer::step`] closes one and advances
/// the version by exactly one, also when a guard refuses the update. The schedules
/// rely on it: period `k` samples with version `k` (the overlapped ones wait for it),
/// so a trainer whose version stood still after a refused step would stall them.
///
/// A trainer that can checkpoint ([`Trainer::save_checkpoint`],
/// [`Trainer::restore_checkpoint`]) lets a run resume after a crash with the weights
/// an uninterrupted run reaches; one that cannot keeps the default methods, which
/// refuse, and runs without checkpoints.
#[async_trait]
pub trait Trainer: Send {
    /// The version of the current weights: the number of periods stepped.
    fn version(&self) -> PolicyVersion;

    /// Runs forward and backward on one micro-batch and adds its gradient.
    async fn accumulate(&mut self, batch: TrainBatch) -> Result<AccumulateReport>;

    /// Applies step-time normalisers to the accumulated gradient, takes one optimiser
    /// step (or refuses it, reporting `applied: false`), clears the accumulator and
    /// advances the version by one.
    async fn step(&mut self) -> Result<StepReport>;

    /// A copy of the current weights that does not alias the trainer's storage.
    async fn snapshot(&self) -> Result<WeightSnapshot>;

    /// Writes into `dir` (a folder the caller made for it, and makes durable)
    /// everything [`Trainer::restore_checkpoint`] needs to continue exactly: weights,
    /// optimiser state, version, and the step under way.
    async fn save_checkpoint(&mut self, dir: &Path) -> Result<()> {
        Err(Error::invalid(
            format!("checkpoint {}", dir.display()),
            "cannot be written: this trainer does not checkpoint",
        ))
    }

    /// Continues from a checkpoint written by [`Trainer::save_checkpoint`]: the steps
    /// that follow equal those of the trainer that wrote it.
    async fn restore_checkpoint(&mut self, dir: &Path) -> Result<()> {
        Err(Error::invalid(
            format!("checkpoint {}", dir.display()),
            "cannot be read: this trainer does not checkpoint",
        ))
    }
}

/// Acknowledges one delivered group once it has been accumulated.
#[async_trait]
pub trait Acker: Send + Sync + std::fmt::Debug {
    /// Confirms the delivery; until then the transport may deliver it again.
    async fn ack(self: Box<Self>) -> Result<()>;

    /// Gives up on a delivery that can never be processed (a poison message: it
    /// does not pack, or names a period or version this trainer is not training):
    /// the transport must not deliver it again, and may keep it where an operator
    /// can read it, with `reason`. The caller logs and counts it. By default the
    /// delivery is acknowledged, which is all a transport without redelivery needs.
    async fn reject(self: Box<Self>, reason: &str) -> Result<()> {
        let _ = reason;
        self.ack().await
    }
}

/// An acknowledgement that does nothing, for transports without redelivery.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoAck;

#[async_trait]
impl Acker for NoAck {
    async fn ack(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

/// A group as delivered by a transport, with its acknowledgement.
#[derive(Debug)]
pub struct Delivery {
    /// The group.
    pub group: ScoredGroup,
    /// Acknowledge after the trainer has accumulated the group, never before.
    pub acker: Box<dyn Acker>,
}

/// The rollout side of the group stream.
#[async_trait]
pub trait GroupSender: Send + Sync {
    /// Sends one scored group; waits when the receiver is behind (backpressure).
    async fn send(&self, group: ScoredGroup) -> Result<()>;
}

/// The trainer side of the group stream.
#[async_trait]
pub trait GroupReceiver: Send {
    /// The next group, or `Ok(None)` once every sender is gone.
    async fn recv(&mut self) -> Result<Option<Delivery>>;
}

/// Publishes weight snapshots to rollout workers.
#[async_trait]
pub trait WeightPublisher: Send + Sync {
    /// Makes `snapshot` the newest version available to subscribers.
    async fn publish(&self, snapshot: Arc<WeightSnapshot>) -> Result<()>;
}

/// Fetches published weights.
#[async_trait]
pub trait WeightSubscriber: Send {
    /// The newest published snapshot, if any was published.
    async fn latest(&mut self) -> Result<Option<Arc<WeightSnapshot>>>;

    /// Waits until a snapshot of at least version `min` is published and returns the
    /// newest one.
    async fn wait_for(&mut self, min: PolicyVersion) -> Result<Arc<WeightSnapshot>>;
}

/// Small messages that frame a period between processes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ControlMessage {
    /// A period begins: its weights are published at `version` and these prompts are released.
    PeriodStart {
        /// The period.
        period: PeriodId,
        /// The weights to sample it with.
        version: PolicyVersion,
        /// The prompts of the period.
        prompts: Vec<PromptId>,
    },
    /// The trainer has consumed every group of the period and stepped.
    PeriodEnd {
        /// The period.
        period: PeriodId,
    },
    /// Every process should finish its work and exit.
    Shutdown,
}

/// Sends the messages that frame a period (to every receiver).
#[async_trait]
pub trait ControlSender: Send + Sync {
    /// Sends `message` to every receiver.
    async fn send(&self, message: ControlMessage) -> Result<()>;
}

/// Receives the messages that frame a period, in send order.
#[async_trait]
pub trait ControlReceiver: Send {
    /// The next message, or `Ok(None)` once the channel is closed.
    async fn recv(&mut self) -> Result<Option<ControlMessage>>;
}
