//! The shared vocabulary and the stage contracts of Metronome.
//!
//! Metronome is a framework for reinforcement-learning post-training of language
//! models (the GRPO family) that runs inference and training as separate stages and
//! overlaps them with *periodic asynchrony* while staying exactly on-policy. This
//! crate is the contract every stage agrees on:
//!
//! - identifiers ([`RunSeed`], [`PolicyVersion`], [`PromptId`], [`PeriodId`]) and the
//!   seeded-randomness rule [`sample_seed`];
//! - the data that flows between stages ([`Prompt`], [`Completion`], [`Group`],
//!   [`ScoredGroup`]) and the packed training layout ([`TrainBatch`]);
//! - the tests of a code task ([`CodeTests`]), which a data loader writes into a
//!   prompt's reference and a code-execution reward runs;
//! - weight snapshots as host data, or resident on a device between stages of one
//!   process ([`WeightSnapshot`], [`Resident`]), and the [`Tokenizer`] contract;
//! - the typed entry of a crate's metrics catalogue ([`Metric`]) and the macro that
//!   declares one ([`metric_catalogue!`]);
//! - multi-turn episodes ([`Environment`], [`Episode`], [`Observation`]) and what a
//!   completion records of one ([`EpisodeTrace`]: which tokens are observations);
//! - the stage traits ([`PromptSource`], [`RolloutEngine`], [`RewardFn`],
//!   [`GroupScorer`], [`Trainer`], [`GroupSender`]/[`GroupReceiver`],
//!   [`WeightPublisher`]/[`WeightSubscriber`], [`ControlSender`]/[`ControlReceiver`]).
//!
//! It deliberately holds no tensors, no async runtime and no I/O: third-party stage
//! implementations should depend on this crate alone, and prove themselves with the
//! conformance suites of `metronome-testkit` (a dev-dependency). The sibling crates
//! implement the stages (`metronome-dataloader`, `-rollout`, `-reward`, `-trainer`,
//! `-transport`), share the network (`metronome-model`) and layouts
//! (`metronome-masking`), and `metronome-pipeline` wires them.

mod code;
mod data;
mod env;
mod error;
mod ids;
mod layout;
mod metric;
mod secret;
mod stage;
mod text;
mod weights;

pub use code::{CodeTests, IoCase};
pub use data::{
    ADVANTAGE_STD_EPS, AdvantageEstimator, Completion, EpisodeTrace, FinishReason, Group, GroupKey,
    GroupStats, GroupTiming, Prompt, Reward, ScoredGroup, TokenId, TokenSpan, VersionSwitch,
};
pub use env::{Environment, Episode, Observation, ToolCallSyntax, ToolCallText, render_reply};
pub use error::{Error, ErrorChain, Result};
pub use ids::{PeriodId, PolicyVersion, PromptId, RunSeed, mix64, sample_seed, stream_seed};
pub use layout::{PackedRow, Segment, Targets, TrainBatch, TrainGroup, TrainSequence};
pub use metric::{Metric, MetricKind, MetricUnit};
pub use secret::Secret;
pub use stage::{
    AccumulateReport, Acker, ControlMessage, ControlReceiver, ControlSender, Cursor, Delivery, GroupReceiver,
    GroupScorer, GroupSender, GroupSink, LogprobMismatch, NoAck, PromptBatch, PromptSource, RewardFn,
    RolloutEngine, RolloutRequest, StepReport, Trainer, WeightPublisher, WeightSubscriber,
};
pub use text::{ChatMessage, Tokenizer};
pub use weights::{HostTensor, Resident, ResidentData, TensorData, WeightSnapshot};
