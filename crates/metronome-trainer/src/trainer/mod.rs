//! The tri-model GRPO trainer: forward, loss and backward per micro-batch in any
//! order, one optimiser step per period, guards and checkpoints.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use candle_core::{Tensor, Var};
use metronome_core::{
    AccumulateReport, AdvantageEstimator, GroupKey, PackedRow, PolicyVersion, RunSeed, Segment, StepReport,
    Targets, TokenId, TokenSpan, TrainBatch, TrainGroup, TrainSequence, WeightSnapshot, mix64, stream_seed,
};
use metronome_model::{Device, Model};
use serde::{Deserialize, Serialize};

use crate::loss::{Aggregation, LossInputs, StepTotals, grpo_loss, sft_loss};
use crate::optim::{AdamW, GradAccumulator, clip_grad_norm};
use crate::{Result, TrainerConfig, TrainerError};

/// Stream id of the trainer's randomness in [`metronome_core::stream_seed`].
const TRAINER_STREAM: u64 = 0x7472_6169_6e65_7221; // "trainer!"
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
/// Version of the checkpoint layout written by [`GrpoTrainer::save_checkpoint`].
const CHECKPOINT_FORMAT: u32 = 1;
/// Prefix of the regulariser's gradient sums in `accumulator.safetensors` (the
/// policy-gradient term's, or the whole loss's, carry the parameter names alone).
const REGULARISER_PREFIX: &str = "regulariser/";
/// The checkpoint's LoRA adapters, in the PEFT format (beside the base in `policy/`).
const ADAPTER_DIR: &str = "adapter";

/// One supervised example: the answer's tokens are the targets, predicted from the
/// prompt and the answer's earlier tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SftExample {
    /// Prompt tokens (context only, never in the loss).
    pub prompt: Vec<TokenId>,
    /// Answer tokens: every one is a target, except those in `context`.
    pub answer: Vec<TokenId>,
    /// Spans of `answer` an environment wrote (tool results between the turns of a
    /// demonstrated episode): context the later tokens are predicted from, never
    /// targets, as in RL on episodes.
    #[serde(default)]
    pub context: Vec<TokenSpan>,
}

impl SftExample {
    /// An example whose every answer token is a target.
    #[must_use]
    pub fn new(prompt: Vec<TokenId>, answer: Vec<TokenId>) -> Self {
        Self { prompt, answer, context: Vec::new() }
    }
}

/// Lays out SFT examples as one causal row each (the answer's last token is only a
/// target, never an input), with one sequence and one group per example.
pub fn sft_batch(examples: &[SftExample]) -> Result<TrainBatch> {
    let mut batch = TrainBatch::default();
    for (i, ex) in examples.iter().enumerate() {
        let mut is_target = vec![true; ex.answer.len()];
        for span in &ex.context {
            let Some(inside) = is_target.get_mut(span.start as usize..span.end() as usize) else {
                return Err(TrainerError::invalid(
                    format!("sft example {i}"),
                    format!(
                        "has a context span {}..{} beyond its {}-token answer",
                        span.start,
                        span.end(),
                        ex.answer.len()
                    ),
                ));
            };
            inside.fill(false);
        }
        if ex.prompt.is_empty() || !is_target.contains(&true) {
            return Err(TrainerError::invalid(
                format!("sft example {i}"),
                format!(
                    "has a {}-token prompt and {} target tokens, both must be non-empty",
                    ex.prompt.len(),
                    is_target.iter().filter(|&&t| t).count()
                ),
            ));
        }
        let p = ex.prompt.len();
        let mut tokens = ex.prompt.clone();
        tokens.extend_from_slice(&ex.answer[..ex.answer.len() - 1]);
        let len = tokens.len() as u32;
        batch.rows.push(PackedRow {
            tokens,
            positions: (0..len).collect(),
            segments: vec![Segment { start: 0, len, parent: None }],
        });
        for (j, &tok) in ex.answer.iter().enumerate().filter(|&(j, _)| is_target[j]) {
            let t = &mut batch.targets;
            t.row.push(i as u32);
            t.position.push((p - 1 + j) as u32);
            t.token.push(tok);
            t.sequence.push(i as u32);
            t.advantage.push(0.0);
            t.behaviour_logprob.push(0.0);
        }
        batch.sequences.push(TrainSequence {
            group: i as u32,
            num_targets: is_target.iter().filter(|&&t| t).count() as u32,
            ..TrainSequence::default()
        });
        batch.groups.push(TrainGroup { num_sequences: 1, group_size: 1, ..TrainGroup::default() });
    }
    Ok(batch)
}

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
    /// Responses in the loss before masking, and the sum and sum of squares of their
    /// advantages: REINFORCE++'s batch standard deviation.
    adv_count: u64,
    adv_sum: f64,
    adv_sq_sum: f64,
}

impl Sums {
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Mode {
    Rl,
    Sft,
}

/// The targets of a batch that enter the loss (before masked IS, which needs the
/// forward), and their counts.
#[derive(Debug)]
struct Prepared {
    targets: Targets,
    counts: Sums,
}

/// The part of a step already accumulated when a checkpoint is written mid-period
/// (`accumulator.json`; the gradient sums are in `accumulator.safetensors`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct PendingState {
    mode: Option<Mode>,
    micro_batches: u64,
    sums: Sums,
    seen_groups: BTreeSet<GroupKey>,
    buffered: Vec<TrainBatch>,
}

/// What a checkpoint's `trainer_state.json` holds besides the tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct CheckpointState {
    format: u32,
    version: u64,
    optimizer_steps: u64,
    schedule_position: u64,
    rng_state: u64,
    skipped_steps: u64,
}

/// The GRPO trainer: policy (trainable), frozen reference, and old policy (the
/// stop-gradient policy, or the behaviour log-probs with mini-steps).
///
/// The synchronous methods ([`GrpoTrainer::accumulate_sync`],
/// [`GrpoTrainer::step_sync`], …) do the work on the trainer's own rayon pool; the
/// [`metronome_core::Trainer`] implementation calls them.
pub struct GrpoTrainer {
    cfg: TrainerConfig,
    policy: Model,
    params: Vec<(String, Var)>,
    reference: Option<Model>,
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
    version: PolicyVersion,
    rng_state: u64,
    skipped_steps: u64,
    sums: Sums,
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
            .field("reference", &self.reference.is_some())
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
    pub fn new(cfg: TrainerConfig, policy: Model) -> Result<Self> {
        cfg.validate()?;
        let policy = match &cfg.lora {
            _ if policy.lora().is_some() => {
                return Err(TrainerError::invalid(
                    "policy model",
                    "already has LoRA adapters; pass its base (`Model::base`) or its merged model \
                     (`Model::merged`), with trainer.lora set to train new ones",
                ));
            }
            Some(lora) => policy.with_lora(lora, cfg.seed).map_err(TrainerError::from_model_config)?,
            None => policy,
        };
        let reference = if cfg.loss.kl_coef > 0.0 { Some(reference_of(&policy)?) } else { None };
        Self::with_reference(cfg, policy, reference)
    }

    /// The trainer around `policy` and `reference` as given; `cfg` is validated.
    fn with_reference(cfg: TrainerConfig, policy: Model, reference: Option<Model>) -> Result<Self> {
        if !policy.is_trainable() {
            return Err(TrainerError::invalid(
                "policy model",
                "is frozen; the trainer needs a trainable model",
            ));
        }
        // What trains: the adapters alone with LoRA, else every weight.
        let params = if policy.lora().is_some() { policy.adapter_parameters() } else { policy.parameters() };
        let optimizer = AdamW::new(cfg.optimizer, &params)?;
        let pool = build_pool(cfg.threads)?;
        Ok(Self {
            rng_state: stream_seed(RunSeed(cfg.seed), TRAINER_STREAM, 0),
            accum: GradAccumulator::new(params.len()),
            accum_regulariser: GradAccumulator::new(params.len()),
            temperature: 1.0,
            advantages_normalised: false,
            cfg,
            policy,
            params,
            reference,
            optimizer,
            pool,
            version: PolicyVersion(0),
            skipped_steps: 0,
            sums: Sums::default(),
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

    fn step_scale(&self) -> f64 {
        let totals = StepTotals { tokens: self.sums.tokens, sequences: self.sums.sequences };
        match self.mode {
            Some(Mode::Sft) => Aggregation::TokenMean.step_scale(totals),
            _ => self.cfg.loss.aggregation.step_scale(totals),
        }
    }

    /// Whether REINFORCE++'s batch normaliser is left to step time for the RL
    /// gradient being accumulated (mini-steps divide the advantages before training).
    fn batch_normalised(&self) -> bool {
        self.cfg.advantage == AdvantageEstimator::ReinforcePlusPlusBaseline && !self.advantages_normalised
    }

    /// The extra scale of the policy-gradient term: REINFORCE++'s `1 / (std + eps)`
    /// of the step's advantages, else 1. The clipped surrogate (and every importance
    /// weight) is positively homogeneous in the advantage, so dividing the gradient
    /// of that term by the batch's standard deviation equals training on advantages
    /// divided by it up front, while groups still arrive one at a time.
    fn policy_scale(&self) -> f64 {
        if self.mode == Some(Mode::Rl) && self.batch_normalised() { self.sums.batch_std_scale() } else { 1.0 }
    }

    /// The step's gradient (before clipping) and its norm: the accumulated sums times
    /// the step-time normaliser, the policy-gradient part also times
    /// [`GrpoTrainer::policy_scale`].
    fn finish_gradients(&self) -> Result<(Vec<Tensor>, f64)> {
        let scale = self.step_scale();
        GradAccumulator::finish_sum(
            &self.params,
            &[(&self.accum, scale * self.policy_scale()), (&self.accum_regulariser, scale)],
        )
    }

    /// Keeps the targets that enter the loss and counts them.
    fn prepare(&self, batch: &TrainBatch) -> Result<Prepared> {
        batch.validate()?;
        let skip_group = |g: usize| {
            self.cfg.skip_zero_advantage_groups && batch.groups.get(g).is_some_and(|g| g.all_equal)
        };
        // Sampled by another version than the one being trained means off-policy:
        // only allowed when truncated or masked importance sampling corrects it.
        if self.cfg.loss.tis_cap.is_none()
            && self.cfg.loss.masked_is.is_none()
            && self.cfg.mini_steps == 1
            && let Some((i, s)) = batch.sequences.iter().enumerate().find(|(_, s)| s.version != self.version)
        {
            return Err(TrainerError::invalid(
                format!("sequence {i} (group {}, sample {})", s.group, s.sample_index),
                format!(
                    "was sampled by version {}, the trainer is at version {}; set loss.tis_cap or loss.masked_is to train on stale samples",
                    s.version, self.version
                ),
            ));
        }
        let mut counts = Sums::default();
        for g in &batch.groups {
            if !self.seen_groups.contains(&g.key) {
                counts.groups += 1;
                counts.zero_groups += u64::from(g.all_equal);
            }
        }
        for s in batch.sequences.iter().filter(|s| !skip_group(s.group as usize)) {
            counts.sequences += 1;
            counts.adv_count += 1;
            counts.adv_sum += f64::from(s.advantage);
            counts.adv_sq_sum += f64::from(s.advantage) * f64::from(s.advantage);
        }
        let t = &batch.targets;
        let mut kept = Targets::default();
        for i in 0..t.len() {
            let seq = &batch.sequences[t.sequence[i] as usize];
            if skip_group(seq.group as usize) {
                continue;
            }
            kept.row.push(t.row[i]);
            kept.position.push(t.position[i]);
            kept.token.push(t.token[i]);
            kept.sequence.push(t.sequence[i]);
            kept.advantage.push(t.advantage[i]);
            kept.behaviour_logprob.push(t.behaviour_logprob[i]);
        }
        counts.tokens = kept.len() as u64;
        Ok(Prepared { targets: kept, counts })
    }

    /// Forward, loss and backward of one prepared batch; adds the gradient.
    fn forward_backward(&mut self, rows: &[PackedRow], p: &Prepared, old_is_behaviour: bool) -> Result<Sums> {
        let mut sums = p.counts;
        if p.targets.is_empty() {
            return Ok(sums);
        }
        let start = Instant::now();
        let n = p.targets.len();
        // One layout of the micro-batch for both forwards, and one scheduling of them:
        // the two are independent until the loss, so on a pool of two or more threads
        // they run side by side (whole forwards in parallel keep the cores busier than
        // splitting each small op across them, docs/design.md §6); on one thread they run
        // in turn. The reference builds no graph (it is frozen).
        let batch = self.policy.prepare_batch(rows, &p.targets)?;
        let temperature = self.temperature;
        let (out, reference) = match &self.reference {
            Some(r) if self.cfg.loss.kl_coef > 0.0 => {
                let (out, reference) =
                    rayon::join(|| self.policy.score(&batch, temperature), || r.score(&batch, temperature));
                (out?, Some(reference?.logprobs))
            }
            _ => (self.policy.score(&batch, temperature)?, None),
        };
        drop(batch);
        let behaviour = Tensor::from_slice(&p.targets.behaviour_logprob, n, self.policy.device())?;
        let old = if old_is_behaviour { behaviour.clone() } else { out.logprobs.detach() };
        let terms = grpo_loss(
            &self.cfg.loss,
            LossInputs {
                logprobs: &out.logprobs,
                old_logprobs: &old,
                behaviour_logprobs: &behaviour,
                ref_logprobs: reference.as_ref(),
                entropy: Some(&out.entropy),
                advantages: &p.targets.advantage,
                sequences: &p.targets.sequence,
            },
        )?;
        let mid = Instant::now();
        match &terms.regulariser {
            // REINFORCE++'s normaliser scales the policy-gradient term alone, known
            // only at step time: the two parts are accumulated apart.
            Some(regulariser) if self.batch_normalised() => {
                self.accum.add(&self.params, &terms.policy_loss.backward()?)?;
                self.accum_regulariser.add(&self.params, &regulariser.backward()?)?;
            }
            _ => self.accum.add(&self.params, &terms.loss.backward()?)?,
        }
        self.times.forward += mid - start;
        self.times.backward += mid.elapsed();
        // Masked IS drops targets, and responses it dropped whole, from the counts
        // the normalisers divide by.
        sums.tokens = terms.tokens;
        sums.sequences = sums.sequences.saturating_sub(terms.masked_sequences);
        sums.loss = terms.loss_sum;
        sums.policy = terms.policy_sum;
        sums.kl = terms.kl_sum;
        sums.entropy = terms.entropy_sum;
        sums.gap = terms.logprob_gap_sum;
        sums.clipped = terms.clipped;
        Ok(sums)
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
        let sums = self.run(|t| t.forward_backward(&batch.rows, &prepared, false))?;
        self.mode = Some(Mode::Rl);
        self.seen_groups.extend(batch.groups.iter().map(|g| g.key));
        self.sums.add(&sums);
        crate::metrics::accumulated(start.elapsed(), sums.tokens, sums.zero_groups);
        Ok(AccumulateReport { tokens: sums.tokens, loss_sum: sums.loss })
    }

    /// Accumulates the supervised cross-entropy of `examples` (token mean over the
    /// step). SFT and RL micro-batches cannot share a step.
    pub fn accumulate_sft(&mut self, examples: &[SftExample]) -> Result<AccumulateReport> {
        self.check_mode(Mode::Sft)?;
        let batch = sft_batch(examples)?;
        let n = batch.targets.len();
        let sums = self.run(|t| {
            let start = Instant::now();
            let out = t.policy.target_logprobs(&batch.rows, &batch.targets)?;
            let (loss, value) = sft_loss(&out.logprobs, &vec![1.0; n])?;
            let mid = Instant::now();
            let grads = loss.backward()?;
            t.accum.add(&t.params, &grads)?;
            t.times.forward += mid - start;
            t.times.backward += mid.elapsed();
            let entropy: f64 = out.entropy.to_vec1::<f32>()?.iter().map(|&v| f64::from(v)).sum();
            Ok(Sums {
                tokens: n as u64,
                sequences: examples.len() as u64,
                groups: examples.len() as u64,
                loss: value,
                entropy,
                ..Sums::default()
            })
        })?;
        self.mode = Some(Mode::Sft);
        self.sums.add(&sums);
        Ok(AccumulateReport { tokens: sums.tokens, loss_sum: sums.loss })
    }

    /// Mean negative log-likelihood of the answers of `examples` under the current
    /// policy (no gradient is kept).
    pub fn sft_loss(&self, examples: &[SftExample]) -> Result<f64> {
        let batch = sft_batch(examples)?;
        let pool = Arc::clone(&self.pool);
        pool.install(|| {
            let out = self.policy.target_logprobs(&batch.rows, &batch.targets)?;
            let lp = out.logprobs.detach().to_vec1::<f32>()?;
            Ok(-lp.iter().map(|&v| f64::from(v)).sum::<f64>() / lp.len().max(1) as f64)
        })
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
            self.optimizer.step(&self.params, &grads, lr)
        })();
        self.accum.clear();
        self.accum_regulariser.clear();
        self.sums = Sums::default();
        self.times.optimizer += start.elapsed();
        result.map(|()| report)
    }

    /// `mini_steps` updates over the buffered batches, old policy = behaviour.
    fn mini_steps(&mut self) -> Result<StepReport> {
        let mut batches = std::mem::take(&mut self.buffered);
        // Groups are counted again as the mini-batches are trained.
        self.seen_groups.clear();
        // Sort first so arrival order does not matter, then shuffle with the
        // checkpointed generator so mini-batches mix groups from across the period.
        batches.sort_by_key(|b| b.groups.first().map(|g| g.key));
        for i in (1..batches.len()).rev() {
            let j = (self.next_random() % (i as u64 + 1)) as usize;
            batches.swap(i, j);
        }
        // REINFORCE++'s batch is the period: its advantages are divided by their
        // standard deviation before the first mini-step.
        if self.cfg.advantage == AdvantageEstimator::ReinforcePlusPlusBaseline {
            let mut stats = Sums::default();
            for b in &batches {
                stats.add(&self.prepare(b)?.counts);
            }
            let factor = stats.batch_std_scale() as f32;
            for b in &mut batches {
                b.targets.advantage.iter_mut().for_each(|a| *a *= factor);
                b.sequences.iter_mut().for_each(|s| s.advantage *= factor);
            }
            self.advantages_normalised = true;
        }
        let result = self.train_mini_batches(&batches);
        self.advantages_normalised = false;
        result
    }

    /// One optimiser update per chunk of `batches` (the shuffled period).
    fn train_mini_batches(&mut self, batches: &[TrainBatch]) -> Result<StepReport> {
        let k = (self.cfg.mini_steps as usize).min(batches.len()).max(1);
        let mut reports = Vec::with_capacity(k);
        let per_chunk = batches.len().div_ceil(k).max(1);
        for chunk in batches.chunks(per_chunk) {
            for b in chunk {
                let prepared = self.prepare(b)?;
                self.seen_groups.extend(b.groups.iter().map(|g| g.key));
                let sums = self.forward_backward(&b.rows, &prepared, true)?;
                self.sums.add(&sums);
            }
            reports.push(self.apply_step()?);
        }
        if reports.is_empty() {
            reports.push(self.apply_step()?);
        }
        Ok(combine(&reports))
    }

    fn next_random(&mut self) -> u64 {
        self.rng_state = self.rng_state.wrapping_add(GOLDEN);
        mix64(self.rng_state)
    }

    /// An owned copy of the current weights at the current version (with LoRA, the
    /// base with the adapters merged in: rollout workers decode a plain model).
    pub fn snapshot_sync(&self) -> Result<WeightSnapshot> {
        Ok(self.policy.snapshot(self.version)?)
    }

    /// Writes a checkpoint directory: `policy/` (Hugging Face `config.json` +
    /// `model.safetensors`; with LoRA the base, and `adapter/` the adapters in the
    /// PEFT format, which `peft` loads onto `policy/`), `reference/` when a KL term is
    /// used without LoRA,
    /// `optimizer.safetensors` (AdamW moments), `accumulator.safetensors` and
    /// `accumulator.json` (the step under way, possibly empty), `trainer_config.json`
    /// (for reading) and `trainer_state.json` (version, optimiser step, schedule
    /// position, generator state), written last.
    ///
    /// It may be written mid-period: micro-batches already accumulated are part of it,
    /// so a transport may treat their groups as done (acknowledged) and a resumed run
    /// continues the period with the remaining groups and reaches the same weights.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| TrainerError::checkpoint(dir, e))?;
        self.save_pending(dir)?;
        if self.policy.lora().is_some() {
            // The base and the adapters apart, bit for bit: a merged model could not
            // be split again, and resuming must continue the same adapters. The
            // reference is the base.
            self.policy.base().save_hf(&dir.join("policy"))?;
            self.policy.save_lora_adapter(&dir.join(ADAPTER_DIR))?;
        } else {
            self.policy.save_hf(&dir.join("policy"))?;
            if let Some(r) = &self.reference {
                r.save_hf(&dir.join("reference"))?;
            }
            // Adapters left by an earlier LoRA checkpoint in this directory would be
            // read as this one's.
            let stale = dir.join(ADAPTER_DIR);
            if stale.exists() {
                std::fs::remove_dir_all(&stale).map_err(|e| TrainerError::checkpoint(&stale, e))?;
            }
        }
        let state: HashMap<String, Tensor> = self.optimizer.state(&self.params)?.into_iter().collect();
        let opt_path = dir.join("optimizer.safetensors");
        candle_core::safetensors::save(&state, &opt_path)
            .map_err(|e| TrainerError::checkpoint(&opt_path, e))?;
        let st = CheckpointState {
            format: CHECKPOINT_FORMAT,
            version: self.version.0,
            optimizer_steps: self.optimizer.steps(),
            schedule_position: self.optimizer.steps(),
            rng_state: self.rng_state,
            skipped_steps: self.skipped_steps,
        };
        // The configuration is written for people reading the run directory; resuming
        // takes the configuration from the caller.
        let cfg_path = dir.join("trainer_config.json");
        let text =
            serde_json::to_string_pretty(&self.cfg).map_err(|e| TrainerError::checkpoint(&cfg_path, e))?;
        std::fs::write(&cfg_path, text).map_err(|e| TrainerError::checkpoint(&cfg_path, e))?;
        // The state file goes last: its presence marks a complete checkpoint.
        let st_path = dir.join("trainer_state.json");
        let text = serde_json::to_string_pretty(&st).map_err(|e| TrainerError::checkpoint(&st_path, e))?;
        std::fs::write(&st_path, text).map_err(|e| TrainerError::checkpoint(&st_path, e))
    }

    /// Mid-period state: the accumulated gradient sums (f64, exactly as held) and the
    /// counts, groups and buffered batches of the step under way. Always written, so
    /// a stale pair never survives from an earlier checkpoint in the same directory.
    fn save_pending(&self, dir: &Path) -> Result<()> {
        let mut grads = HashMap::new();
        for (prefix, accum) in [("", &self.accum), (REGULARISER_PREFIX, &self.accum_regulariser)] {
            for ((name, _), sum) in self.params.iter().zip(accum.sums()) {
                if let Some(sum) = sum {
                    grads.insert(format!("{prefix}{name}"), sum.clone());
                }
            }
        }
        let path = dir.join("accumulator.safetensors");
        candle_core::safetensors::save(&grads, &path).map_err(|e| TrainerError::checkpoint(&path, e))?;
        let pending = PendingState {
            mode: self.mode,
            micro_batches: self.accum.micro_batches(),
            sums: self.sums,
            seen_groups: self.seen_groups.clone(),
            buffered: self.buffered.clone(),
        };
        let path = dir.join("accumulator.json");
        let text = serde_json::to_string(&pending).map_err(|e| TrainerError::checkpoint(&path, e))?;
        std::fs::write(&path, text).map_err(|e| TrainerError::checkpoint(&path, e))
    }

    fn restore_pending(&mut self, dir: &Path, device: &Device) -> Result<()> {
        let path = dir.join("accumulator.json");
        let text = std::fs::read_to_string(&path).map_err(|e| TrainerError::checkpoint(&path, e))?;
        let pending: PendingState =
            serde_json::from_str(&text).map_err(|e| TrainerError::checkpoint(&path, e))?;
        let path = dir.join("accumulator.safetensors");
        let mut grads =
            candle_core::safetensors::load(&path, device).map_err(|e| TrainerError::checkpoint(&path, e))?;
        let mut parts = Vec::with_capacity(2);
        for prefix in ["", REGULARISER_PREFIX] {
            let mut sums = Vec::with_capacity(self.params.len());
            for (name, var) in &self.params {
                let key = format!("{prefix}{name}");
                let g = grads.remove(&key);
                if let Some(g) = &g
                    && g.dims() != var.dims()
                {
                    return Err(TrainerError::checkpoint(
                        &path,
                        format!(
                            "tensor `{key}` has shape {:?}, the parameter has {:?}",
                            g.dims(),
                            var.dims()
                        ),
                    ));
                }
                sums.push(g);
            }
            parts.push(sums);
        }
        if let Some(name) = grads.keys().next() {
            return Err(TrainerError::checkpoint(&path, format!("holds `{name}`, which is not a parameter")));
        }
        let regulariser = parts.pop().unwrap_or_default();
        let policy = parts.pop().unwrap_or_default();
        // A step that split its terms added to both in every micro-batch.
        let split = regulariser.iter().any(Option::is_some);
        self.accum_regulariser.restore(regulariser, if split { pending.micro_batches } else { 0 })?;
        self.accum.restore(policy, pending.micro_batches)?;
        self.mode = pending.mode;
        self.sums = pending.sums;
        self.seen_groups = pending.seen_groups;
        self.buffered = pending.buffered;
        Ok(())
    }

    /// Becomes the trainer the checkpoint in `dir` holds, keeping this trainer's
    /// configuration, device and sampling temperature (which are the run's, not the
    /// checkpoint's).
    pub fn restore(&mut self, dir: &Path) -> Result<()> {
        let device = self.policy.device().clone();
        let temperature = self.temperature;
        *self = Self::resume(self.cfg.clone(), dir, &device)?;
        self.temperature = temperature;
        Ok(())
    }

    /// A trainer restored from [`GrpoTrainer::save_checkpoint`]'s directory: the
    /// steps that follow are bit-identical to those of the trainer that wrote it.
    pub fn resume(cfg: TrainerConfig, dir: &Path, device: &Device) -> Result<Self> {
        let st_path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&st_path).map_err(|e| TrainerError::checkpoint(&st_path, e))?;
        let st: CheckpointState =
            serde_json::from_str(&text).map_err(|e| TrainerError::checkpoint(&st_path, e))?;
        if st.format != CHECKPOINT_FORMAT {
            return Err(TrainerError::checkpoint(
                &st_path,
                format!("has format {}, this build reads {CHECKPOINT_FORMAT}", st.format),
            ));
        }
        cfg.validate()?;
        let policy = Model::load_hf(&dir.join("policy"), device)?;
        let adapter = dir.join(ADAPTER_DIR);
        let (policy, reference) = match &cfg.lora {
            Some(lora) => {
                if !adapter.exists() {
                    return Err(TrainerError::checkpoint(
                        adapter,
                        "is missing, and trainer.lora needs the adapters",
                    ));
                }
                let policy = policy.with_lora_adapter(&adapter)?;
                if let Some((key, want, have)) = policy.lora().and_then(|have| lora.difference(have)) {
                    return Err(TrainerError::config(
                        key,
                        format!("is {want}, the checkpoint's adapters have {have}"),
                    ));
                }
                let reference = if cfg.loss.kl_coef > 0.0 { Some(reference_of(&policy)?) } else { None };
                (policy, reference)
            }
            None if adapter.exists() => {
                return Err(TrainerError::checkpoint(
                    adapter,
                    "holds LoRA adapters, and trainer.lora is not set (set it as the run that wrote it did)",
                ));
            }
            None if cfg.loss.kl_coef > 0.0 => {
                let rdir = dir.join("reference");
                if !rdir.exists() {
                    return Err(TrainerError::checkpoint(
                        rdir,
                        "is missing, and loss.kl_coef needs the reference model",
                    ));
                }
                (policy, Some(Model::load_hf(&rdir, device)?.with_trainable(false)))
            }
            None => (policy, None),
        };
        let mut t = Self::with_reference(cfg, policy, reference)?;
        let opt_path = dir.join("optimizer.safetensors");
        let mut state = candle_core::safetensors::load(&opt_path, device)
            .map_err(|e| TrainerError::checkpoint(&opt_path, e))?;
        t.optimizer
            .restore(&t.params, st.optimizer_steps, |k| state.remove(k))
            .map_err(|e| TrainerError::checkpoint(&opt_path, e))?;
        t.version = PolicyVersion(st.version);
        t.rng_state = st.rng_state;
        t.skipped_steps = st.skipped_steps;
        t.restore_pending(dir, device)?;
        Ok(t)
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

/// The frozen reference model of `policy`: with adapters its base handle, which no
/// step writes (only the adapters train), so no copy is made; otherwise a frozen copy
/// made now.
fn reference_of(policy: &Model) -> Result<Model> {
    Ok(if policy.lora().is_some() { policy.base().with_trainable(false) } else { policy.frozen_copy()? })
}

/// One report for several mini-steps: counts summed, means averaged.
fn combine(reports: &[StepReport]) -> StepReport {
    let n = reports.len() as f64;
    let mean = |f: fn(&StepReport) -> f64| reports.iter().map(f).sum::<f64>() / n;
    let last = reports.last().copied().unwrap_or_default();
    StepReport {
        version: last.version,
        applied: reports.iter().any(|r| r.applied),
        loss: mean(|r| r.loss),
        policy_loss: mean(|r| r.policy_loss),
        kl: mean(|r| r.kl),
        clip_fraction: mean(|r| r.clip_fraction),
        entropy: mean(|r| r.entropy),
        grad_norm: mean(|r| r.grad_norm),
        learning_rate: last.learning_rate,
        tokens: reports.iter().map(|r| r.tokens).sum(),
        sequences: reports.iter().map(|r| r.sequences).sum(),
        groups: reports.iter().map(|r| r.groups).sum(),
        zero_advantage_groups: reports.iter().map(|r| r.zero_advantage_groups).sum(),
        logprob_gap: mean(|r| r.logprob_gap),
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
