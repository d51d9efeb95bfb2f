//! The training stage of Metronome: a tri-model GRPO trainer that learns from groups
//! in any order.
//!
//! [`GrpoTrainer`] holds the trainable policy (a `metronome_model::Model`), a frozen
//! reference copy made at construction (only when the KL coefficient is non-zero;
//! its forward is skipped entirely otherwise) and the *old policy*: with one
//! optimiser step per period the old policy is the stop-gradient current policy, so
//! the ratio is exactly 1 and only its gradient acts; with several mini-steps per
//! period it is the behaviour log-probs recorded by the rollout engine. It implements
//! `metronome_core::Trainer`: [`GrpoTrainer::accumulate_sync`] runs forward, loss and
//! backward on one packed micro-batch (`metronome_core::TrainBatch`) and adds the
//! gradient; [`GrpoTrainer::step_sync`] applies the whole-batch normaliser as a scale
//! on the accumulated gradient (docs/design.md §4), the non-finite guard, gradient-norm
//! clipping and one AdamW update. Gradients are summed in f64 per parameter, so the
//! period's groups may arrive in completion order and still give the weights of a
//! synchronous run.
//!
//! - [`loss`]: PPO clipped surrogate with separate low/high bounds (clip-higher), KL
//!   to the reference with the k1/k2/k3 estimators, an optional entropy bonus,
//!   truncated importance sampling for stale samples, and three aggregations
//!   (sequence-mean-token-mean, global token mean, Dr. GRPO's constant normaliser).
//!   Groups whose rewards were all equal are dropped from the loss and counted.
//!   Advantages are computed upstream by `metronome_core::AdvantageEstimator`;
//!   [`TrainerConfig::advantage`] is where a run chooses it.
//! - [`optim`]: gradient accumulation, clipping and an AdamW whose moments are visible,
//!   so checkpoints restore them; [`schedule`]: warm-up then constant or cosine.
//! - SFT warm starts on prompt/answer pairs ([`GrpoTrainer::accumulate_sft`]).
//! - Checkpoints ([`GrpoTrainer::save_checkpoint`], [`GrpoTrainer::resume`]): Hugging
//!   Face safetensors for the weights, AdamW state, version, schedule position and
//!   generator state; a resumed run takes bit-identical steps. A checkpoint may be
//!   written mid-period: the accumulated gradient (f64 sums) and the step's counts go
//!   with it, so groups already accumulated may be acknowledged and are never lost.
//! - Compute runs on the trainer's own rayon pool (`TrainerConfig::threads`), so the
//!   pipeline can give training and generation separate cores (docs/design.md §6).
//!
//! It does not pack groups into rows (`metronome-masking` does), score or normalise
//! rewards (`metronome-reward`, `metronome-core`), or move weights
//! (`metronome-transport`); `metronome-pipeline` wires it to them.
//!
//! Metrics: every one it emits is in [`METRICS`]. Per-step values (loss, KL, clip
//! fraction, …) are returned in `metronome_core::StepReport`; whoever drives the
//! trainer (the pipeline) records them as gauges, so each gauge has one writer.

mod config;
mod error;
pub mod loss;
mod metrics;
pub mod optim;
pub mod schedule;
mod trainer;

pub use config::TrainerConfig;
pub use error::{Result, TrainerError};
pub use metrics::METRICS;
pub use trainer::{GrpoTrainer, PhaseTimes, SftExample, sft_batch};
