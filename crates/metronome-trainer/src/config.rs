//! The trainer's serde configuration, validated before it builds a trainer
//! (`TrainerConfig::build` and `resume` are beside the trainer they build).

use metronome_core::AdvantageEstimator;
use metronome_model::LoraConfig;
use serde::{Deserialize, Serialize};

use crate::distill::DistillConfig;
use crate::loss::LossConfig;
use crate::optim::AdamWConfig;
use crate::schedule::LrSchedule;
use crate::{Result, TrainerError};

/// Everything that shapes training, read from the run's config file.
///
/// Unknown keys are rejected, and [`TrainerConfig::validate`] names the dotted key
/// of any value out of range.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    /// Seed of the trainer's own randomness (the mini-step partition).
    pub seed: u64,
    /// Threads of the trainer's own rayon pool; candle's kernels run on it. Unset,
    /// the pipeline's placement chooses (`run.auto_placement`), else 1
    /// ([`TrainerConfig::threads`]).
    pub threads: Option<usize>,
    /// Learning-rate schedule over optimiser steps.
    pub schedule: LrSchedule,
    /// AdamW hyper-parameters.
    pub optimizer: AdamWConfig,
    /// Clip the global gradient norm to this value; `None` disables clipping.
    pub max_grad_norm: Option<f64>,
    /// The loss family and its coefficients.
    pub loss: LossConfig,
    /// The advantage estimator the pipeline's scorer should use. The trainer reads
    /// advantages from the batches; this is where the run chooses them. For
    /// `reinforce_plus_plus_baseline` the trainer also divides the policy-gradient
    /// term by the step's standard deviation of the advantages.
    pub advantage: AdvantageEstimator,
    /// Optimiser steps per period. 1 (the default) is the on-policy case: the old
    /// policy is the stop-gradient current policy. Above 1, the period's batches are
    /// split into this many mini-batches at `step` time and the old policy is the
    /// behaviour log-probs.
    pub mini_steps: u32,
    /// Drop the targets of groups whose rewards were all equal (they carry no
    /// policy-gradient signal): no forward for them, and they are left out of the
    /// normalisers. They are always counted in [`metronome_core::StepReport`].
    pub skip_zero_advantage_groups: bool,
    /// The device the policy (and reference) train on; absent, the model's
    /// (`model.device` in a run config). Read by whoever loads the policy (the pipeline).
    pub device: Option<metronome_model::DeviceSpec>,
    /// Low-rank adapters (LoRA; Hu et al. 2021, arXiv 2106.09685): when set, the
    /// trainer adds adapters to the policy's projections and trains only them; the
    /// base weights stay frozen and serve as the KL reference, and published weights
    /// are merged. Absent (the default), every weight trains.
    pub lora: Option<LoraConfig>,
    /// On-policy distillation (`[trainer.distill]`, see [`crate::distill`]): a teacher
    /// scored in the reference slot, whose per-token reverse KL to the policy on the
    /// policy's own samples is the advantage, alone or added to the rewards'. Absent
    /// (the default), no teacher.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distill: Option<DistillConfig>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            threads: None,
            schedule: LrSchedule::default(),
            optimizer: AdamWConfig::default(),
            max_grad_norm: Some(1.0),
            loss: LossConfig::default(),
            advantage: AdvantageEstimator::GroupNorm,
            mini_steps: 1,
            skip_zero_advantage_groups: true,
            device: None,
            lora: None,
            distill: None,
        }
    }
}

impl TrainerConfig {
    /// Parses a JSON object and validates it.
    pub fn from_json(text: &str) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text)
            .map_err(|e| TrainerError::config("trainer", format!("does not parse: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every range; the error names the dotted key at fault.
    pub fn validate(&self) -> Result<()> {
        if self.threads == Some(0) {
            return Err(TrainerError::config("threads", "is 0, expected at least 1"));
        }
        if self.mini_steps == 0 {
            return Err(TrainerError::config("mini_steps", "is 0, expected at least 1"));
        }
        if let Some(n) = self.max_grad_norm
            && !(n.is_finite() && n > 0.0)
        {
            return Err(TrainerError::config("max_grad_norm", format!("is {n}, expected a positive number")));
        }
        self.schedule.validate("schedule")?;
        self.optimizer.validate("optimizer")?;
        self.loss.validate("loss")?;
        if let Some(lora) = &self.lora {
            lora.validate().map_err(TrainerError::from_model_config)?;
        }
        if let Some(distill) = &self.distill {
            distill.validate("distill")?;
            // The reference slot holds the teacher, and the teacher's reverse KL is
            // already the pull towards a reference: a KL term too would need a third
            // model.
            if self.loss.kl_coef > 0.0 {
                return Err(TrainerError::config(
                    "distill",
                    format!(
                        "is set with loss.kl_coef = {}: the teacher takes the reference model's slot, and its \
                         reverse KL is the regulariser; set loss.kl_coef = 0 or remove distill",
                        self.loss.kl_coef
                    ),
                ));
            }
            // The batch normaliser would divide the teacher's signal by the spread of
            // the rewards' advantages.
            if self.advantage == AdvantageEstimator::ReinforcePlusPlusBaseline {
                return Err(TrainerError::config(
                    "distill",
                    "is set with advantage = \"reinforce_plus_plus_baseline\", whose batch normaliser would \
                     scale the teacher's per-token signal by the rewards' spread; choose another advantage",
                ));
            }
        }
        Ok(())
    }

    /// Threads of the trainer's pool: `threads`, or 1 when unset.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_round_trip() {
        let cfg = TrainerConfig::default();
        cfg.validate().unwrap();
        let text = serde_json::to_string(&cfg).unwrap();
        assert_eq!(TrainerConfig::from_json(&text).unwrap(), cfg);
    }

    #[test]
    fn partial_json_fills_defaults() {
        let cfg = TrainerConfig::from_json(
            r#"{"schedule": {"lr": 0.001, "warmup_steps": 2, "decay": {"kind": "cosine", "total_steps": 10}},
                "loss": {"kl_coef": 0.05, "kl_estimator": "k2", "aggregation": {"kind": "constant_normaliser", "max_tokens": 64}},
                "advantage": "leave_one_out"}"#,
        )
        .unwrap();
        assert_eq!(cfg.schedule.warmup_steps, 2);
        assert_eq!(cfg.loss.kl_coef, 0.05);
        assert_eq!(cfg.advantage, AdvantageEstimator::LeaveOneOut);
        assert_eq!(cfg.threads(), 1);
        let cfg = TrainerConfig::from_json(
            r#"{"advantage": "reinforce_plus_plus_baseline",
                "loss": {"ratio_level": "sequence", "aggregation": {"kind": "seq_mean_token_mean"},
                         "masked_is": {"level": "geometric", "upper": 1.01}}}"#,
        )
        .unwrap();
        assert_eq!(cfg.advantage, AdvantageEstimator::ReinforcePlusPlusBaseline);
        assert_eq!(cfg.loss.ratio_level, crate::loss::RatioLevel::Sequence);
        let masked = cfg.loss.masked_is.unwrap();
        assert_eq!(
            (masked.level, masked.lower, masked.upper),
            (crate::loss::MaskLevel::Geometric, None, 1.01)
        );
    }

    #[test]
    fn errors_name_the_key() {
        let err = TrainerConfig::from_json(r#"{"loss": {"clip_low": 1.5}}"#).unwrap_err().to_string();
        assert!(err.contains("loss.clip_low"), "{err}");
        let err = TrainerConfig::from_json(r#"{"optimizer": {"beta2": 1.0}}"#).unwrap_err().to_string();
        assert!(err.contains("optimizer.beta2"), "{err}");
        let err = TrainerConfig::from_json(r#"{"mini_steps": 0}"#).unwrap_err().to_string();
        assert!(err.contains("mini_steps"), "{err}");
        let err = TrainerConfig::from_json(r#"{"lossy": {}}"#).unwrap_err().to_string();
        assert!(err.contains("lossy"), "{err}");
        let err =
            TrainerConfig::from_json(r#"{"loss": {"masked_is": {"upper": 0.5}}}"#).unwrap_err().to_string();
        assert!(err.contains("loss.masked_is.upper"), "{err}");
        let err =
            TrainerConfig::from_json(r#"{"loss": {"masked_is": {"lower": 0.5}}}"#).unwrap_err().to_string();
        assert!(err.contains("upper"), "{err}");
        for (json, key) in [
            (r#"{"lora": {"rank": 0}}"#, "`lora.rank`"),
            (r#"{"lora": {"dropout": 0.1}}"#, "`lora.dropout`"),
            (r#"{"lora": {"target_modules": ["q_proj", "lm_head"]}}"#, "`lora.target_modules[1]`"),
        ] {
            let err = TrainerConfig::from_json(json).unwrap_err().to_string();
            assert!(err.starts_with(&format!("config key {key}")), "{err}");
        }
        let err = TrainerConfig::from_json(r#"{"lora": {"rnak": 4}}"#).unwrap_err().to_string();
        assert!(err.contains("rnak"), "{err}");
        let teacher = r#""distill": {"kind": "hf", "path": "teacher"}"#;
        let cfg = TrainerConfig::from_json(&format!("{{{teacher}}}")).unwrap();
        let distill = cfg.distill.unwrap();
        assert_eq!((distill.mode, distill.weight), (crate::distill::DistillMode::Alone, 1.0));
        let err = TrainerConfig::from_json(&format!(r#"{{{teacher}, "loss": {{"kl_coef": 0.1}}}}"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`distill`") && err.contains("loss.kl_coef"), "{err}");
        let err =
            TrainerConfig::from_json(&format!(r#"{{{teacher}, "advantage": "reinforce_plus_plus_baseline"}}"#))
                .unwrap_err()
                .to_string();
        assert!(err.contains("`distill`") && err.contains("advantage"), "{err}");
        let err = TrainerConfig::from_json(r#"{"distill": {"kind": "hf", "path": "t", "weight": -1}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`distill.weight`"), "{err}");
        let err = TrainerConfig::from_json(r#"{"distill": {"kind": "onnx", "path": "t"}}"#).unwrap_err().to_string();
        assert!(err.contains("onnx"), "{err}");
    }

    #[test]
    fn lora_fills_peft_defaults() {
        let cfg = TrainerConfig::from_json(r#"{"lora": {"rank": 4}}"#).unwrap();
        let lora = cfg.lora.unwrap();
        assert_eq!((lora.rank, lora.alpha, lora.dropout, lora.target_modules.len()), (4, 16.0, 0.0, 7));
    }
}
