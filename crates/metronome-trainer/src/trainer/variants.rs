//! The loss variants as a step meets them. Per micro-batch: which targets enter the
//! loss (groups whose rewards were all equal are skipped when configured; samples of
//! another version are refused unless truncated or masked importance sampling
//! corrects them), and the GRPO loss against the old policy and the reference, whose
//! gradient is accumulated (the policy-gradient term apart while REINFORCE++'s batch
//! normaliser waits for the step). Per step: the scales of the accumulated sums (the
//! aggregation's normaliser, REINFORCE++'s `1 / (std + eps)`), and mini-steps,
//! several updates per period with the behaviour log-probs as the old policy.

use std::time::Instant;

use candle_core::{DType, Tensor};
use metronome_core::{AdvantageEstimator, PackedRow, StepReport, Targets, TrainBatch, mix64};

use super::{GrpoTrainer, Mode, Sums};
use crate::distill;
use crate::loss::{Aggregation, LossInputs, StepTotals, grpo_loss};
use crate::optim::GradAccumulator;
use crate::{Result, TrainerError};

/// The SplitMix64 increment of the trainer's generator ([`GrpoTrainer::next_random`]).
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The targets of a batch that enter the loss (before masked IS, which needs the
/// forward), and their counts.
#[derive(Debug)]
pub(super) struct Prepared {
    pub(super) targets: Targets,
    pub(super) counts: Sums,
}

impl GrpoTrainer {
    /// The step-time normaliser of the accumulated sums: the aggregation's (the token
    /// mean for SFT).
    pub(super) fn step_scale(&self) -> f64 {
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
    pub(super) fn policy_scale(&self) -> f64 {
        if self.mode == Some(Mode::Rl) && self.batch_normalised() { self.sums.batch_std_scale() } else { 1.0 }
    }

    /// The step's gradient (before clipping) and its norm: the accumulated sums times
    /// the step-time normaliser, the policy-gradient part also times
    /// [`GrpoTrainer::policy_scale`].
    pub(super) fn finish_gradients(&self) -> Result<(Vec<Tensor>, f64)> {
        let scale = self.step_scale();
        GradAccumulator::finish_sum(
            &self.params,
            &[(&self.accum, scale * self.policy_scale()), (&self.accum_regulariser, scale)],
        )
    }

    /// Keeps the targets that enter the loss and counts them.
    pub(super) fn prepare(&self, batch: &TrainBatch) -> Result<Prepared> {
        batch.validate()?;
        // A distillation teacher has a signal for every token, whatever the rewards.
        let skip_group = |g: usize| {
            self.cfg.skip_zero_advantage_groups
                && self.teacher.is_none()
                && batch.groups.get(g).is_some_and(|g| g.all_equal)
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
        kept.reserve(t.len());
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

    /// Forward, loss and backward of one prepared batch; adds the gradient. With
    /// `measure`, the targets also enter the step's train–rollout mismatch (the
    /// weights scoring them are those of the step's version).
    pub(super) fn forward_backward(
        &mut self,
        rows: &[PackedRow],
        p: &Prepared,
        old_is_behaviour: bool,
        measure: bool,
    ) -> Result<Sums> {
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
        // in turn. The reference builds no graph (it is frozen). A distillation teacher
        // takes the reference's slot (the two never coexist), laying the batch out
        // itself only when its rotary tables differ.
        let batch = self.scorer.prepare_batch(rows, &p.targets)?;
        let teacher_batch = match &self.teacher {
            Some(t) if !t.shares_layout => Some(t.model.prepare_batch(rows, &p.targets)?),
            _ => None,
        };
        let temperature = self.temperature;
        let second = match (&self.reference, &self.teacher) {
            (Some(r), _) if self.cfg.loss.kl_coef > 0.0 => Some(r),
            (_, Some(t)) => Some(&t.model),
            _ => None,
        };
        let (out, second) = match second {
            Some(m) => {
                let (out, second) = rayon::join(
                    || self.scorer.score(&batch, temperature),
                    || m.score(teacher_batch.as_ref().unwrap_or(&batch), temperature),
                );
                (out?, Some(second?))
            }
            None => (self.scorer.score(&batch, temperature)?, None),
        };
        drop((batch, teacher_batch));
        let logprobs_host = out.logprobs.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let (reference, distill) = match (&self.teacher, second) {
            (Some(t), Some(teacher)) => {
                (None, Some(t.signal(&p.targets.advantage, &out, &logprobs_host, &teacher)?))
            }
            (_, second) => (second.map(|s| s.logprobs), None),
        };
        let advantages = distill.as_ref().map_or(p.targets.advantage.as_slice(), |d| &d.advantages);
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
                teacher_kl: distill.as_ref().and_then(distill::Signal::loss_term),
                advantages,
                sequences: &p.targets.sequence,
            },
        )?;
        if measure {
            let behaviour = &p.targets.behaviour_logprob;
            self.mismatch.record(&logprobs_host, behaviour, terms.truncated, terms.masked_tokens);
        }
        let mid = Instant::now();
        match &terms.regulariser {
            // REINFORCE++'s normaliser scales the policy-gradient term alone, known
            // only at step time: the two parts are accumulated apart.
            Some(regulariser) if self.batch_normalised() => {
                self.accum.add(&self.scorer_params, &terms.policy_loss.backward()?)?;
                self.accum_regulariser.add(&self.scorer_params, &regulariser.backward()?)?;
            }
            _ => self.accum.add(&self.scorer_params, &terms.loss.backward()?)?,
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
        if let Some(distill) = &distill {
            sums.distill_tokens = n as u64;
            sums.distill_kl = distill.reverse_kl;
        }
        Ok(sums)
    }

    /// `mini_steps` updates over the buffered batches, old policy = behaviour.
    pub(super) fn mini_steps(&mut self) -> Result<StepReport> {
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
        for (i, chunk) in batches.chunks(per_chunk).enumerate() {
            for b in chunk {
                let prepared = self.prepare(b)?;
                self.seen_groups.extend(b.groups.iter().map(|g| g.key));
                // The mismatch is the engine's only until the first update moves the
                // weights away from those that sampled.
                let sums = self.forward_backward(&b.rows, &prepared, true, i == 0)?;
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
        mismatch: last.mismatch,
        distill_kl: last.distill_kl.map(|_| mean(|r| r.distill_kl.unwrap_or(0.0))),
    }
}
