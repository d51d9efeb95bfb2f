//! On-policy distillation (`trainer.distill`): the student samples, a teacher scores
//! the student's own tokens, and the reverse KL from the teacher is the learning
//! signal.
//!
//! The technique: Agarwal et al. 2024, "On-Policy Distillation of Language Models:
//! Learning from Self-Generated Mistakes" (GKD, ICLR 2024, arXiv 2306.13649), train
//! the student on its own samples against the teacher's distribution instead of on a
//! fixed dataset, so it learns where its own mistakes lead. Two signals
//! (`trainer.distill.signal`, [`DistillSignal`]):
//!
//! - `sampled` (Thinking Machines Lab, "On-Policy Distillation", 2025): the
//!   single-sample reverse KL of each sampled token, negated and without gradient, is
//!   that token's advantage in the ordinary policy-gradient loss; with weight `w`,
//!
//!   `A_t = −w · (log π_student(y_t) − log π_teacher(y_t))` (stop-gradient),
//!
//!   either alone (`mode = "alone"`: the rewards' advantages are not used) or added to
//!   the GRPO advantage of the token's response (`mode = "add"`). On-policy the ratio
//!   is 1 and the term's gradient is `w · Σ_t (log π − log π_teacher) ∇log π`: an
//!   unbiased estimate of the gradient of `KL(student ‖ teacher)` on the tokens the
//!   student produces, from one token of each position's distribution.
//! - `full` (GKD's token-level divergence): the exact `KL(student ‖ teacher)` over the
//!   whole vocabulary at each of the student's positions, `w · KL_t` added to each
//!   target's loss as the KL to a reference is, beside the GRPO term of the rewards'
//!   advantages (`add`) or without it (`alone`). The same expected gradient with none
//!   of the sampling noise: each position carries the teacher's whole next-token
//!   distribution, where the sampled signal carries one token of it. It costs a second
//!   pass of the head over the targets' logits of both models, in chunks
//!   ([`metronome_model::reverse_kl`]).
//!
//! The teacher is scored in the trainer's reference slot: it shares the policy's
//! layout of each micro-batch (token ids, rotary tables, segment masks) when it has
//! the same head size and rotary base, and runs beside the policy's forward, without
//! an autograd graph, at the sampling temperature the policy is scored at, in the
//! trainer's precision (`trainer.precision`: a bf16 copy in bf16, as the reference
//! is) and with its head chunked as the policy's (`trainer.chunked_head`). It must
//! have the student's vocabulary (the same tokenizer): one of another size is refused
//! when it loads. It is never written into a checkpoint: a resumed trainer loads it
//! from its path again.

use std::path::PathBuf;

use metronome_core::ErrorChain;
use metronome_model::{DType, Device, Model, ModelConfig, Precision, TargetOutput, Tensor};
use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// The file format of a teacher checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TeacherFormat {
    /// A Hugging Face folder (`config.json`, `model.safetensors` or its shards), as
    /// `[model] kind = "hf"` reads, e.g. a run's `checkpoints/final/policy`.
    Hf,
    /// A GGUF file, as `[model] kind = "gguf"` reads.
    Gguf,
}

/// How the teacher's signal meets the rewards'.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DistillMode {
    /// Pure on-policy distillation: each token's advantage is the teacher's signal
    /// alone; the rewards are still scored and reported, not trained on.
    #[default]
    Alone,
    /// The teacher's signal added to the GRPO advantage of the token's response.
    Add,
}

/// What the teacher tells the student at each of its tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DistillSignal {
    /// The sampled token's reverse KL `log π_student(y_t) − log π_teacher(y_t)`,
    /// negated, as its advantage in the policy-gradient loss (Thinking Machines Lab's
    /// form): one number per token, an unbiased but noisy estimate of the divergence.
    #[default]
    Sampled,
    /// The exact reverse KL over the whole vocabulary at each of the student's
    /// positions, `Σ_v π_student(v) (log π_student(v) − log π_teacher(v))`, as a loss
    /// term of weight `w` (GKD's token-level divergence on the student's own
    /// sequences): the teacher's whole next-token distribution at every position, not
    /// one sample of it. Computed in chunks of the student's head budget from the rows
    /// both heads read ([`metronome_model::reverse_kl`]).
    Full,
}

/// `[trainer.distill]`: the teacher and how its signal is used.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistillConfig {
    /// The teacher's format.
    pub kind: TeacherFormat,
    /// Where the teacher is: a folder (`hf`) or a file (`gguf`).
    pub path: PathBuf,
    /// Alone, or added to the GRPO advantage.
    #[serde(default)]
    pub mode: DistillMode,
    /// The sampled token's log-ratio as an advantage, or the exact divergence as a
    /// loss term.
    #[serde(default)]
    pub signal: DistillSignal,
    /// `w`: the sampled signal's `A_t = −w · (log π_student − log π_teacher)`, or the
    /// full signal's loss term `w · KL_t`.
    #[serde(default = "default_weight")]
    pub weight: f32,
}

fn default_weight() -> f32 {
    1.0
}

impl DistillConfig {
    /// Checks the values; errors name the key under `prefix` (`distill`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        if !(self.weight.is_finite() && self.weight > 0.0) {
            return Err(TrainerError::config(
                format!("{prefix}.weight"),
                format!("is {}, expected a positive number", self.weight),
            ));
        }
        if self.path.as_os_str().is_empty() {
            return Err(TrainerError::config(format!("{prefix}.path"), "is empty"));
        }
        Ok(())
    }

    /// Loads the teacher on `device`, frozen, and checks that it has the vocabulary
    /// of `student`; an error names `distill.path` and what went wrong.
    pub fn load_teacher(&self, student: &ModelConfig, device: &Device) -> Result<Model> {
        let key = "distill.path";
        let path = &self.path;
        let loaded = match self.kind {
            TeacherFormat::Hf => Model::load_hf(path, device),
            TeacherFormat::Gguf => Model::load_gguf(path, device).map(|(model, _)| model),
        };
        let teacher = loaded.map_err(|e| {
            TrainerError::config(
                key,
                format!(
                    "= {}: the teacher does not load as {:?}: {}",
                    path.display(),
                    self.kind,
                    ErrorChain(&e)
                ),
            )
        })?;
        let (have, want) = (teacher.config().vocab_size, student.vocab_size);
        if have != want {
            return Err(TrainerError::config(
                key,
                format!(
                    "= {}: the teacher has a vocabulary of {have} tokens, the student {want}; a teacher must \
                     share the student's tokenizer",
                    path.display()
                ),
            ));
        }
        Ok(teacher.with_trainable(false))
    }
}

/// A loaded teacher, as the trainer holds it (a clone shares its weights).
#[derive(Clone, Debug)]
pub(crate) struct Teacher {
    pub(crate) model: Model,
    pub(crate) mode: DistillMode,
    pub(crate) signal: DistillSignal,
    pub(crate) weight: f32,
    /// Whether it scores from the policy's layout of a micro-batch (same head size
    /// and rotary base); otherwise it lays the batch out itself.
    pub(crate) shares_layout: bool,
}

impl Teacher {
    /// Loads `cfg`'s teacher for `policy`, on its device, scored in `precision` (a
    /// bf16 copy, as the reference is, whose f32 weights are then dropped) with the
    /// chunked head `chunk` if set.
    pub(crate) fn load(
        cfg: &DistillConfig,
        policy: &Model,
        precision: Precision,
        chunk: Option<usize>,
    ) -> Result<Self> {
        let model = cfg.load_teacher(policy.config(), policy.device())?;
        let model = match precision {
            Precision::F32 => model,
            Precision::Bf16 => model.compute_copy(precision.dtype())?,
        }
        .with_chunked_head(chunk);
        let (t, s) = (model.config(), policy.config());
        let shares_layout = t.head_dim == s.head_dim && t.rope_theta == s.rope_theta;
        Ok(Self { model, mode: cfg.mode, signal: cfg.signal, weight: cfg.weight, shares_layout })
    }

    /// The teacher's signal for one micro-batch, from the rewards' advantages of its
    /// targets, the student's scoring (with `student_logprobs`, its log-probs on the
    /// host) and the teacher's.
    pub(crate) fn signal(
        &self,
        rewards: &[f32],
        student: &TargetOutput,
        student_logprobs: &[f32],
        teacher: &TargetOutput,
    ) -> Result<Signal> {
        match self.signal {
            DistillSignal::Sampled => {
                let teacher = teacher.logprobs.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                let (advantages, reverse_kl) =
                    per_token_advantages(self.mode, self.weight, rewards, student_logprobs, &teacher);
                Ok(Signal { advantages, reverse_kl, divergence: None, weight: self.weight })
            }
            DistillSignal::Full => {
                let divergence = metronome_model::reverse_kl(&student.head, &teacher.head)?;
                let reverse_kl = divergence.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
                let advantages = match self.mode {
                    DistillMode::Alone => vec![0.0; rewards.len()],
                    DistillMode::Add => rewards.to_vec(),
                };
                Ok(Signal { advantages, reverse_kl, divergence: Some(divergence), weight: self.weight })
            }
        }
    }
}

/// What [`Teacher::signal`] gives the loss.
pub(crate) struct Signal {
    /// Each target's advantage: the sampled signal's (alone or added to the
    /// rewards'), or under the full signal the rewards' (`add`) or zero (`alone`).
    pub(crate) advantages: Vec<f32>,
    /// The sum over the targets of the reverse KL, sampled or exact: the statistic.
    pub(crate) reverse_kl: f64,
    /// The full signal's per-target divergence, differentiable in the student.
    divergence: Option<Tensor>,
    /// Its weight in the loss.
    weight: f32,
}

impl Signal {
    /// The full signal's loss term: each target's divergence and its weight `w`.
    pub(crate) fn loss_term(&self) -> Option<(&Tensor, f32)> {
        self.divergence.as_ref().map(|d| (d, self.weight))
    }
}

/// [`Teacher::advantages`] as a function of its settings.
fn per_token_advantages(
    mode: DistillMode,
    weight: f32,
    rewards: &[f32],
    student: &[f32],
    teacher: &[f32],
) -> (Vec<f32>, f64) {
    let mut reverse_kl = 0f64;
    let advantages = rewards
        .iter()
        .zip(student.iter().zip(teacher))
        .map(|(&a, (&s, &t))| {
            let kl = f64::from(s) - f64::from(t);
            reverse_kl += kl;
            let signal = (-f64::from(weight) * kl) as f32;
            match mode {
                DistillMode::Alone => signal,
                DistillMode::Add => a + signal,
            }
        })
        .collect();
    (advantages, reverse_kl)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advantage_is_the_negated_weighted_reverse_kl_alone_or_added() {
        let rewards = [1.0f32, 1.0, -0.5];
        let student = [-0.5f32, -2.0, -1.0];
        let teacher = [-1.5f32, -0.5, -1.0];
        let (alone, kl) = per_token_advantages(DistillMode::Alone, 0.5, &rewards, &student, &teacher);
        assert_eq!(alone, vec![-0.5, 0.75, 0.0]);
        assert!((kl - (1.0 - 1.5 + 0.0)).abs() < 1e-12);
        let (added, _) = per_token_advantages(DistillMode::Add, 0.5, &rewards, &student, &teacher);
        assert_eq!(added, vec![0.5, 1.75, -0.5]);
    }

    #[test]
    fn validation_names_the_key() {
        let cfg = DistillConfig {
            kind: TeacherFormat::Hf,
            path: "teacher".into(),
            mode: DistillMode::Add,
            signal: DistillSignal::Full,
            weight: 1.0,
        };
        cfg.validate("distill").unwrap();
        let err = DistillConfig { weight: 0.0, ..cfg.clone() }.validate("distill").unwrap_err().to_string();
        assert!(err.contains("`distill.weight`"), "{err}");
        let err = DistillConfig { path: "".into(), ..cfg }.validate("distill").unwrap_err().to_string();
        assert!(err.contains("`distill.path`"), "{err}");
    }
}
