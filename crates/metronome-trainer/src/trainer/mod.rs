//! The tri-model GRPO trainer: forward, loss and backward per micro-batch in any
//! order, one optimiser step per period, guards and checkpoints.
//!
//! This file is the step: the trainer, what it holds, accumulating a micro-batch
//! and applying the step. Around it: `variants.rs` (which targets enter the loss, the
//! GRPO loss of a micro-batch and the step-time scales of each variant, mini-steps),
//! `lora.rs` (what differs with adapters), `sft.rs` (the supervised warm start) and
//! `checkpoint.rs`.

mod checkpoint;
mod lora;
mod sft;
mod variants;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use candle_core::{Tensor, Var};
use metronome_core::{
    AccumulateReport, GroupKey, PolicyVersion, RunSeed, StepReport, TrainBatch, WeightSnapshot, stream_seed,
};
use metronome_model::{Device, Model, Precision};
use serde::{Deserialize, Serialize};

pub use self::sft::{SftExample, sft_batch};
use crate::distill::Teacher;
use crate::mismatch::MismatchSums;
use crate::optim::{AdamW, GradAccumulator, clip_grad_norm};
use crate::{Result, TrainerConfig, TrainerError};

/// Stream id of the trainer's randomness in [`metronome_core::stream_seed`].
const TRAINER_STREAM: u64 = 0x7472_6169_6e65_7221; // "trainer!"

/// Wall-clock time spent in each phase since the trainer was built, for benchmarks
/// and logs (never asserted in tests).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    /// Policy and reference forwards and the loss.
    pub forward: Duration,
    /// Back-propagation and gradient accumulation.
    pub backward: Duration,
    /// Step-time scaling, clipping and the AdamW update.
    pub optimizer: Duration,
}

/// Sums over the micro-batches of the current step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
struct Sums {
    tokens: u64,
    sequences: u64,
    groups: u64,
    zero_groups: u64,
    loss: f64,
    policy: f64,
    kl: f64,
    entropy: f64,
    gap: f64,
    clipped: u64,
    /// Targets scored against the distillation teacher and the sum of their
    /// reverse KL `log π − log π_teacher`.
    distill_tokens: u64,
    distill_kl: f64,
    /// Responses in the loss before masking, and the sum and sum of squares of their
    /// advantages: REINFORCE++'s batch standard deviation.
    adv_count: u64,
    adv_sum: f64,
    adv_sq_sum: f64,
}

impl Sums {
    /// Checks sums read back from a checkpoint: every count within `max` (so that
    /// adding to it cannot overflow) and every sum finite (a non-finite one makes the
    /// step's loss non-finite, and the step is dropped); the error names the field.
    fn check(&self, max: u64) -> std::result::Result<(), String> {
        // Every field, so that a new one is checked too.
        let Sums {
            tokens,
            sequences,
            groups,
            zero_groups,
            loss,
            policy,
            kl,
            entropy,
            gap,
            clipped,
            distill_tokens,
            distill_kl,
            adv_count,
            adv_sum,
            adv_sq_sum,
        } = *self;
        let counts = [
            ("tokens", tokens),
            ("sequences", sequences),
            ("groups", groups),
            ("zero_groups", zero_groups),
            ("clipped", clipped),
            ("distill_tokens", distill_tokens),
            ("adv_count", adv_count),
        ];
        if let Some((field, n)) = counts.iter().find(|(_, n)| *n > max) {
            return Err(format!("sums.{field} is {n}, more than {max}"));
        }
        let sums = [
            ("loss", loss),
            ("policy", policy),
            ("kl", kl),
            ("entropy", entropy),
            ("gap", gap),
            ("distill_kl", distill_kl),
            ("adv_sum", adv_sum),
            ("adv_sq_sum", adv_sq_sum),
        ];
        if let Some((field, x)) = sums.iter().find(|(_, x)| !x.is_finite()) {
            return Err(format!("sums.{field} is {x}"));
        }
        Ok(())
    }

    fn add(&mut self, o: &Sums) {
        self.tokens += o.tokens;
        self.sequences += o.sequences;
        self.groups += o.groups;
        self.zero_groups += o.zero_groups;
        self.loss += o.loss;
        self.policy += o.policy;
        self.kl += o.kl;
        self.entropy += o.entropy;
        self.gap += o.gap;
        self.clipped += o.clipped;
        self.distill_tokens += o.distill_tokens;
        self.distill_kl += o.distill_kl;
        self.adv_count += o.adv_count;
        self.adv_sum += o.adv_sum;
        self.adv_sq_sum += o.adv_sq_sum;
    }

    /// `1 / (std + eps)` of the responses' advantages (population standard
    /// deviation, computed in f64), REINFORCE++'s batch normaliser; 1 when the step
    /// holds no response.
    fn batch_std_scale(&self) -> f64 {
        if self.adv_count == 0 {
            return 1.0;
        }
        let n = self.adv_count as f64;
        let mean = self.adv_sum / n;
        let var = (self.adv_sq_sum / n - mean * mean).max(0.0);
        1.0 / (var.sqrt() + f64::from(metronome_core::ADVANTAGE_STD_EPS))
    }
}

/// What the step under way accumulates: RL micro-batches and supervised examples
/// never share a step (their normalisers differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Mode {
    Rl,
    Sft,
}

/// The GRPO trainer: policy (trainable), frozen reference, and old policy (the
/// stop-gradient policy, or the behaviour log-probs with mini-steps).
///
/// The synchronous methods ([`GrpoTrainer::accumulate_sync`],
/// [`GrpoTrainer::step_sync`], …) do the work on the trainer's own rayon pool; the
/// [`metronome_core::Trainer`] implementation calls them.
pub struct GrpoTrainer {
    cfg: TrainerConfig,
    /// The policy as published and checkpointed: f32, whose trained parameters
    /// (`params`) are the ones AdamW updates (the master weights in bf16).
    policy: Model,
    params: Vec<(String, Var)>,
    /// The handle that runs the forward and backward: the policy itself in f32, its
    /// bf16 compute copy in bf16, with the chunked head and checkpointing as
    /// configured. `scorer_params` are its trained parameters, in the order of
    /// `params`: the same variables in f32, their bf16 copies otherwise.
    scorer: Model,
    scorer_params: Vec<(String, Var)>,
    precision: Precision,
    reference: Option<Model>,
    /// The distillation teacher (`trainer.distill`), scored in the reference's slot
    /// (the two never coexist); loaded from its path, never checkpointed.
    teacher: Option<Teacher>,
    optimizer: AdamW,
    /// The accumulated gradient; with REINFORCE++'s batch normaliser and a KL or
    /// entropy term, that of the policy-gradient term only (the normaliser scales it
    /// at step time), the rest going to `accum_regulariser`.
    accum: GradAccumulator,
    accum_regulariser: GradAccumulator,
    /// The sampling temperature the rollout engine draws at: log-probs are scored
    /// at `logits / T`, the behaviour distribution (0 is greedy, scored at 1).
    temperature: f32,
    /// Set while mini-steps train on advantages already divided by the batch
    /// normaliser.
    advantages_normalised: bool,
    pool: Arc<rayon::ThreadPool>,
    /// Snapshots left on the policy's device ([`GrpoTrainer::with_resident_snapshots`]).
    resident_snapshots: bool,
    version: PolicyVersion,
    rng_state: u64,
    skipped_steps: u64,
    sums: Sums,
    /// The train–rollout mismatch of the step under way.
    mismatch: MismatchSums,
    mode: Option<Mode>,
    buffered: Vec<TrainBatch>,
    /// Groups seen this step: a group split across micro-batches counts once.
    seen_groups: BTreeSet<GroupKey>,
    times: PhaseTimes,
}

impl std::fmt::Debug for GrpoTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpoTrainer")
            .field("version", &self.version)
            .field("optimizer_steps", &self.optimizer.steps())
            .field("parameters", &self.params.len())
            .field("precision", &self.precision)
            .field("reference", &self.reference.is_some())
            .field("teacher", &self.teacher.is_some())
            .field("pending_micro_batches", &self.accum.micro_batches())
            .finish_non_exhaustive()
    }
}

fn build_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("metronome-trainer-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| TrainerError::ThreadPool(e.to_string()))
}

impl GrpoTrainer {
    /// A trainer at version 0 around `policy`; the reference is a frozen copy made
    /// now, and only when the KL coefficient is non-zero.
    ///
    /// With `cfg.lora`, adapters are added to the policy (`B = 0`, so it starts as
    /// the given model; `A` seeded by `cfg.seed`) and only they train: they alone get
    /// gradients, accumulator sums and AdamW moments. The reference is then the
    /// policy's base handle on the same storage, not a copy: no step writes the base
    /// (Hu et al. 2021, arXiv 2106.09685, §4.1). A policy that already has adapters is
    /// refused.
    ///
    /// With `cfg.distill`, the teacher is loaded from its path now (see
    /// [`crate::distill`]); one that does not load, or has another vocabulary than
    /// the policy, is refused naming `distill.path`.
    pub fn new(cfg: TrainerConfig, policy: Model) -> Result<Self> {
        cfg.validate()?;
        let policy = lora::policy_to_train(&cfg, policy)?;
        let reference = if cfg.loss.kl_coef > 0.0 { Some(lora::reference_of(&policy)?) } else { None };
        Self::with_reference(cfg, policy, reference, None)
    }

    /// The trainer around `policy` and `reference` as given (f32), in the precision
    /// and with the memory levers `cfg` asks for, and `teacher` (loaded from
    /// `cfg.distill` in that precision when `None` and the config names one); `cfg`
    /// is validated.
    fn with_reference(
        cfg: TrainerConfig,
        policy: Model,
        reference: Option<Model>,
        teacher: Option<Teacher>,
    ) -> Result<Self> {
        if !policy.is_trainable() {
            return Err(TrainerError::invalid(
                "policy model",
                "is frozen; the trainer needs a trainable model",
            ));
        }
        let params = lora::trained_parameters(&policy);
        let precision = cfg.precision_on(policy.device());
        let chunk = cfg.chunked_head_on(policy.device()).then(|| policy.default_head_chunk());
        // The teacher is scored as the reference would be: in the trainer's precision,
        // with its head chunked as the policy's.
        let teacher = match (&cfg.distill, teacher) {
            (Some(_), Some(teacher)) => Some(teacher),
            (Some(distill), None) => Some(Teacher::load(distill, &policy, precision, chunk)?),
            (None, _) => None,
        };
        // In bf16 the forward and backward run on a copy of the weights made now and
        // refreshed after every update (`refresh_scorer`), never per micro-batch.
        let scorer = match precision {
            Precision::F32 => policy.clone(),
            Precision::Bf16 => policy.compute_copy(precision.dtype())?,
        }
        .with_chunked_head(chunk)
        .with_gradient_checkpointing(cfg.gradient_checkpointing);
        let scorer_params = lora::trained_parameters(&scorer);
        let reference =
            lora::reference_in(&scorer, reference, precision)?.map(|r| r.with_chunked_head(chunk));
        let optimizer = AdamW::new(cfg.optimizer, &params)?;
        let pool = build_pool(cfg.threads())?;
        Ok(Self {
            rng_state: stream_seed(RunSeed(cfg.seed), TRAINER_STREAM, 0),
            accum: GradAccumulator::new(params.len()),
            accum_regulariser: GradAccumulator::new(params.len()),
            temperature: 1.0,
            advantages_normalised: false,
            cfg,
            policy,
            params,
            scorer,
            scorer_params,
            precision,
            reference,
            teacher,
            optimizer,
            pool,
            resident_snapshots: false,
            version: PolicyVersion(0),
            skipped_steps: 0,
            sums: Sums::default(),
            mismatch: MismatchSums::default(),
            mode: None,
            buffered: Vec::new(),
            seen_groups: BTreeSet::new(),
            times: PhaseTimes::default(),
        })
    }

    /// Scores log-probs at the rollout engine's sampling temperature (the run
    /// config's `rollout.sampling.temperature`): the policy, old-policy and reference
    /// log-probs are of `softmax(logits / T)`, the distribution the behaviour
    /// log-probs were recorded from, so the PPO ratio and the importance weights
    /// compare like with like. `0` (greedy) scores at 1, as the engine records greedy
    /// tokens; the default is 1. Supervised steps always score at 1.
    pub fn with_sampling_temperature(mut self, temperature: f32) -> Result<Self> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(TrainerError::invalid(
                "sampling temperature",
                format!("is {temperature}, expected a number >= 0"),
            ));
        }
        self.temperature = temperature;
        Ok(self)
    }

    /// Publishes snapshots left on the policy's device ([`Model::snapshot_resident`]):
    /// for a rollout engine of the same process, which installs them by a device copy
    /// (on a GPU: device to device, no host round trip). Off by default: snapshots are
    /// host data, which is what a transport to another process sends (it would read
    /// resident ones back, and each held version would cost a copy of the weights in
    /// device memory meanwhile). `metronome-pipeline` turns it on for an in-process
    /// engine when the trainer is on a GPU.
    #[must_use]
    pub fn with_resident_snapshots(mut self, on: bool) -> Self {
        self.resident_snapshots = on;
        self
    }

    /// The sampling temperature log-probs are scored at
    /// ([`GrpoTrainer::with_sampling_temperature`]).
    #[must_use]
    pub fn sampling_temperature(&self) -> f32 {
        self.temperature
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }

    /// The precision the forward and backward run in (`trainer.precision`, or the
    /// device's default).
    #[must_use]
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The model the forward and backward run on: the policy in f32; in bf16 its
    /// compute copy, refreshed from the f32 policy after every update. Both with the
    /// configured chunked head and checkpointing.
    #[must_use]
    pub fn scorer(&self) -> &Model {
        &self.scorer
    }

    /// The policy (shares its weights with the trainer). With LoRA, the adapted
    /// handle: its snapshots and `save_hf` are of the merged model, its `base()` is
    /// the frozen base.
    #[must_use]
    pub fn policy(&self) -> &Model {
        &self.policy
    }

    /// The version of the current weights: the number of completed periods (calls of
    /// [`GrpoTrainer::step_sync`], including those whose update a guard refused: the
    /// period is closed either way, and the [`metronome_core::Trainer`] contract
    /// keeps versions and periods in step so that no schedule waits for a version
    /// that never comes).
    #[must_use]
    pub fn version(&self) -> PolicyVersion {
        self.version
    }

    /// Optimiser updates applied so far (also the schedule position).
    #[must_use]
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer.steps()
    }

    /// Steps skipped by the non-finite guard.
    #[must_use]
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Time spent per phase since the trainer was built.
    #[must_use]
    pub fn phase_times(&self) -> PhaseTimes {
        self.times
    }

    /// The accumulated gradient of each parameter (by name) with the step-time
    /// normaliser applied, as the next step would see it before clipping. For tests
    /// and diagnostics; `None` before anything was accumulated.
    pub fn pending_gradients(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        if self.accum.micro_batches() == 0 {
            return Ok(None);
        }
        let (grads, _) = self.finish_gradients()?;
        Ok(Some(self.params.iter().map(|(n, _)| n.clone()).zip(grads).collect()))
    }

    fn run<T: Send>(&mut self, f: impl FnOnce(&mut Self) -> Result<T> + Send) -> Result<T> {
        let pool = Arc::clone(&self.pool);
        pool.install(|| f(self))
    }

    /// Refuses to mix RL and SFT micro-batches in one step (their normalisers differ).
    fn check_mode(&self, mode: Mode) -> Result<()> {
        match self.mode {
            Some(m) if m != mode => Err(TrainerError::invalid(
                "accumulate",
                format!("mixes {mode:?} and {m:?} micro-batches in one step; call step first"),
            )),
            _ => Ok(()),
        }
    }

    /// Runs forward and backward on one micro-batch and adds its gradient (with
    /// `mini_steps > 1`, only checks and buffers it: the work happens at step time).
    pub fn accumulate_sync(&mut self, batch: &TrainBatch) -> Result<AccumulateReport> {
        self.check_mode(Mode::Rl)?;
        let prepared = self.prepare(batch)?;
        if self.cfg.mini_steps > 1 {
            self.mode = Some(Mode::Rl);
            self.seen_groups.extend(batch.groups.iter().map(|g| g.key));
            self.buffered.push(batch.clone());
            return Ok(AccumulateReport { tokens: prepared.counts.tokens, loss_sum: 0.0 });
        }
        let start = Instant::now();
        let sums = self.run(|t| t.forward_backward(&batch.rows, &prepared, false, true))?;
        self.mode = Some(Mode::Rl);
        self.seen_groups.extend(batch.groups.iter().map(|g| g.key));
        self.sums.add(&sums);
        crate::metrics::accumulated(start.elapsed(), sums.tokens, sums.zero_groups);
        Ok(AccumulateReport { tokens: sums.tokens, loss_sum: sums.loss })
    }

    /// Applies the step-time normaliser, the guards, clipping and one AdamW update
    /// (or, with `mini_steps > 1`, trains the buffered batches in that many updates),
    /// then clears the accumulator.
    pub fn step_sync(&mut self) -> Result<StepReport> {
        let start = Instant::now();
        let report = if self.cfg.mini_steps > 1 && self.mode == Some(Mode::Rl) {
            self.run(Self::mini_steps)?
        } else {
            self.run(Self::apply_step)?
        };
        self.mode = None;
        self.seen_groups.clear();
        self.mismatch = MismatchSums::default();
        self.version = self.version.next();
        let report = StepReport { version: self.version, ..report };
        crate::metrics::stepped(start.elapsed());
        Ok(report)
    }

    /// One optimiser update from the accumulated gradient.
    fn apply_step(&mut self) -> Result<StepReport> {
        let start = Instant::now();
        let s = self.sums;
        let scale = self.step_scale();
        let policy_scale = self.policy_scale();
        let lr = self.cfg.schedule.lr_at(self.optimizer.steps());
        let per_token = |v: f64| if s.tokens == 0 { 0.0 } else { v / s.tokens as f64 };
        let mut report = StepReport {
            version: self.version,
            applied: true,
            loss: (s.policy * policy_scale + (s.loss - s.policy)) * scale,
            policy_loss: s.policy * policy_scale * scale,
            kl: per_token(s.kl),
            clip_fraction: per_token(s.clipped as f64),
            entropy: per_token(s.entropy),
            grad_norm: 0.0,
            learning_rate: lr,
            tokens: s.tokens,
            sequences: s.sequences,
            groups: s.groups,
            zero_advantage_groups: s.zero_groups,
            logprob_gap: per_token(s.gap),
            mismatch: self.mismatch.summary(),
            distill_kl: self
                .teacher
                .as_ref()
                .map(|_| if s.distill_tokens == 0 { 0.0 } else { s.distill_kl / s.distill_tokens as f64 }),
        };
        let result = (|| {
            if self.accum.micro_batches() == 0 || s.tokens == 0 {
                // Nothing to learn from (e.g. every group had equal rewards): the
                // weights stay, and the version still counts the period.
                return Ok(());
            }
            let (mut grads, norm) = self.finish_gradients()?;
            report.grad_norm = norm;
            if !norm.is_finite() || !report.loss.is_finite() {
                report.applied = false;
                self.skipped_steps += 1;
                crate::metrics::step_refused();
                return Ok(());
            }
            if let Some(max) = self.cfg.max_grad_norm {
                clip_grad_norm(&mut grads, norm, max)?;
            }
            self.optimizer.step(&self.params, &grads, lr)?;
            self.refresh_scorer()
        })();
        self.accum.clear();
        self.accum_regulariser.clear();
        self.sums = Sums::default();
        self.times.optimizer += start.elapsed();
        result.map(|()| report)
    }

    /// Writes the f32 master weights into the bf16 compute copy (nothing to do in f32,
    /// where they are the same variables): once per update, so every micro-batch of a
    /// step computes with the same rounded weights.
    fn refresh_scorer(&self) -> Result<()> {
        if self.precision == Precision::F32 {
            return Ok(());
        }
        for ((_, master), (_, compute)) in self.params.iter().zip(&self.scorer_params) {
            compute.set(&master.as_tensor().detach().to_dtype(compute.dtype())?)?;
        }
        Ok(())
    }

    /// An owned copy of the current weights at the current version (with LoRA, the
    /// base with the adapters merged in: rollout workers decode a plain model), in
    /// host memory or left on the policy's device
    /// ([`GrpoTrainer::with_resident_snapshots`]).
    pub fn snapshot_sync(&self) -> Result<WeightSnapshot> {
        Ok(if self.resident_snapshots {
            self.policy.snapshot_resident(self.version)?
        } else {
            self.policy.snapshot(self.version)?
        })
    }
}

// The config's constructors live here, with the trainer they build, so that the
// config knows nothing of the trainer.
impl TrainerConfig {
    /// Validates and builds a trainer around `policy` (the reference model is a frozen
    /// copy of it, made now; with `lora`, the policy's base weights).
    pub fn build(&self, policy: Model) -> Result<GrpoTrainer> {
        GrpoTrainer::new(self.clone(), policy)
    }

    /// Builds a trainer resumed from a checkpoint directory written by
    /// [`GrpoTrainer::save_checkpoint`].
    pub fn resume(&self, dir: &Path, device: &Device) -> Result<GrpoTrainer> {
        GrpoTrainer::resume(self.clone(), dir, device)
    }
}

#[async_trait]
impl metronome_core::Trainer for GrpoTrainer {
    fn version(&self) -> PolicyVersion {
        self.version
    }

    /// Runs synchronously on the trainer's pool; callers on an async runtime should
    /// hold the trainer on a blocking task.
    async fn accumulate(&mut self, batch: TrainBatch) -> metronome_core::Result<AccumulateReport> {
        Ok(self.accumulate_sync(&batch)?)
    }

    async fn step(&mut self) -> metronome_core::Result<StepReport> {
        Ok(self.step_sync()?)
    }

    async fn snapshot(&self) -> metronome_core::Result<WeightSnapshot> {
        Ok(self.snapshot_sync()?)
    }

    async fn save_checkpoint(&mut self, dir: &Path) -> metronome_core::Result<()> {
        Ok(GrpoTrainer::save_checkpoint(self, dir)?)
    }

    async fn restore_checkpoint(&mut self, dir: &Path) -> metronome_core::Result<()> {
        Ok(self.restore(dir)?)
    }
}
