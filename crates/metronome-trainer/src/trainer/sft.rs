//! Supervised fine-tuning on prompt/answer pairs, the warm start before RL: the
//! examples, their layout as a batch (one causal row each), and the trainer's
//! supervised step (the token mean over the step, scored at temperature 1).

use std::sync::Arc;
use std::time::Instant;

use metronome_core::{
    AccumulateReport, PackedRow, Segment, TokenId, TokenSpan, TrainBatch, TrainGroup, TrainSequence,
};
use serde::{Deserialize, Serialize};

use super::{GrpoTrainer, Mode, Sums};
use crate::loss::sft_loss;
use crate::{Result, TrainerError};

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

impl GrpoTrainer {
    /// Accumulates the supervised cross-entropy of `examples` (token mean over the
    /// step). SFT and RL micro-batches cannot share a step.
    pub fn accumulate_sft(&mut self, examples: &[SftExample]) -> Result<AccumulateReport> {
        self.check_mode(Mode::Sft)?;
        let batch = sft_batch(examples)?;
        let n = batch.targets.len();
        let sums = self.run(|t| {
            let start = Instant::now();
            let out = t.scorer.target_logprobs(&batch.rows, &batch.targets)?;
            let (loss, value) = sft_loss(&out.logprobs, &vec![1.0; n])?;
            let mid = Instant::now();
            let grads = loss.backward()?;
            t.accum.add(&t.scorer_params, &grads)?;
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
            let out = self.scorer.target_logprobs(&batch.rows, &batch.targets)?;
            let lp = out.logprobs.detach().to_vec1::<f32>()?;
            Ok(-lp.iter().map(|&v| f64::from(v)).sum::<f64>() / lp.len().max(1) as f64)
        })
    }
}
