//! The training stage of Metronome: a tri-model GRPO trainer that learns from groups
//! in any order.
//!
//! [`GrpoTrainer`] holds the trainable policy (a `metronome_model::Model`), a frozen
//! reference copy made at construction (only when the KL coefficient is non-zero;
//! its forward is skipped entirely otherwise) and the *old policy*: with one
//! optimiser step per period the old policy is the stop-gradient current policy, so
//! the ratio is exactly 1 and only its gradient acts; with several mini-steps per
//! period it is the behaviour log-probs recorded by the rollout engine. Policy and
//! reference score each micro-batch from one layout (`Model::prepare_batch`: token
//! ids, rotary tables, segment masks, target index), the reference without an
//! autograd graph, and both at the rollout engine's sampling temperature
//! ([`GrpoTrainer::with_sampling_temperature`]: `logits / T`, the distribution the
//! behaviour log-probs are of). It implements `metronome_core::Trainer`:
//! [`GrpoTrainer::accumulate_sync`] runs forward, loss and backward on one packed
//! micro-batch (`metronome_core::TrainBatch`) and adds the gradient;
//! [`GrpoTrainer::step_sync`] applies the whole-batch normaliser as a scale on the
//! accumulated gradient (docs/design.md §4), the non-finite guard, gradient-norm clipping
//! and one AdamW update. Gradients are summed in f64 per parameter, so the period's
//! groups may arrive in completion order and still give the weights of a synchronous
//! run.
//!
//! - [`loss`]: PPO clipped surrogate with separate low/high bounds (clip-higher) or
//!   GSPO's sequence-level ratio and clipping ([`loss::RatioLevel`]), KL to the
//!   reference with the k1/k2/k3 estimators, an optional entropy bonus, truncated
//!   and masked importance sampling for stale or mismatched samples
//!   ([`loss::MaskedIs`], verl's rollout correction and AReaL's decoupled-PPO mask),
//!   and three aggregations (sequence-mean-token-mean, global token mean, Dr. GRPO's
//!   constant normaliser). Groups whose rewards were all equal are dropped from the
//!   loss and counted. Advantages are computed upstream by
//!   `metronome_core::AdvantageEstimator`; [`TrainerConfig::advantage`] is where a
//!   run chooses it. REINFORCE++-baseline's division by the batch's advantage
//!   standard deviation is the trainer's: a step-time scale on the policy-gradient
//!   part of the gradient (the KL and entropy parts are accumulated apart and not
//!   scaled), so groups still stream. Each formula cites its paper.
//! - [`optim`]: gradient accumulation, clipping and an AdamW whose moments are visible,
//!   so checkpoints restore them; [`schedule`]: warm-up then constant or cosine.
//! - LoRA ([`TrainerConfig::lora`]; Hu et al. 2021, arXiv 2106.09685): adapters on
//!   the policy's projections are the only trainable parameters (gradients,
//!   accumulator, AdamW moments); the base stays frozen and its handle is the KL
//!   reference, without a copy; snapshots publish the merged weights; checkpoints
//!   keep the base and the adapters (PEFT format) apart.
//! - On-policy distillation ([`TrainerConfig::distill`], [`distill`]; Agarwal et al.
//!   2024, arXiv 2306.13649): a teacher scored in the reference slot, whose per-token
//!   reverse KL to the policy on the policy's own samples is the advantage, alone or
//!   added to the rewards'.
//! - The train–rollout mismatch of every step (`metronome_core::LogprobMismatch` in
//!   the `StepReport`): mean, p99 and maximum `|log π_trainer − log π_behaviour|` over
//!   the scored targets, the k3 KL between the two, and the shares of tokens whose
//!   importance weight was truncated or masked.
//! - Precision ([`TrainerConfig::precision`]): in bf16 (the default on a GPU) the
//!   forward and backward run on a bf16 compute copy of the policy
//!   ([`GrpoTrainer::scorer`]) made at construction and rewritten from the f32 master
//!   weights after every update, never per micro-batch; gradients reach the f64 sums
//!   from the bf16 variables, and clipping, AdamW (f32 state), snapshots and
//!   checkpoints stay f32, so resumes remain bit-exact. The reference is a bf16 copy
//!   (with LoRA, the compute copy's base), and so is a distillation teacher. Memory: [`TrainerConfig::chunked_head`]
//!   (the default on a GPU) and [`TrainerConfig::gradient_checkpointing`] set the
//!   model's levers on the policy and, for the head, the reference and the teacher.
//! - SFT warm starts on prompt/answer pairs ([`GrpoTrainer::accumulate_sft`]), scored
//!   at temperature 1.
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
//! (`metronome-transport`); `metronome-pipeline` wires it to them and checks that the
//! sampling settings give behaviour log-probs the trainer can match.
//!
//! The trainer's code is in `trainer/`: the step (`mod.rs`), the loss variants as a
//! step meets them (`variants.rs`: which targets enter, the loss of a micro-batch,
//! the step-time scales, mini-steps), LoRA (`lora.rs`), the supervised warm start
//! (`sft.rs`) and checkpoints (`checkpoint.rs`).
//!
//! Metrics: every one it emits is in [`METRICS`]. Per-step values (loss, KL, clip
//! fraction, …) are returned in `metronome_core::StepReport`; whoever drives the
//! trainer (the pipeline) records them as gauges, so each gauge has one writer.

mod config;
pub mod distill;
mod error;
pub mod loss;
mod metrics;
mod mismatch;
pub mod optim;
pub mod schedule;
mod trainer;

pub use config::TrainerConfig;
pub use distill::{DistillConfig, DistillMode, DistillSignal, TeacherFormat};
pub use error::{Result, TrainerError};
pub use metrics::METRICS;
pub use trainer::{GrpoTrainer, PhaseTimes, SftExample, sft_batch};
