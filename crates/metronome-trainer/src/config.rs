//! The trainer's serde configuration, validated before it builds a trainer
//! (`TrainerConfig::build` and `resume` are beside the trainer they build).

use metronome_core::AdvantageEstimator;
use metronome_model::{Device, LoraConfig, Precision};
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
    /// The number format of the forward and backward: `"f32"`, or `"bf16"` (mixed
    /// precision: f32 master weights and AdamW state, a bf16 copy of the weights made
    /// once per optimiser step that runs the forward and backward, gradients summed
    /// in f64 and clipped in f32, the log-softmax and every loss reduction in f32; the
    /// reference model in bf16 too). Absent, bf16 on a GPU and f32 on the CPU
    /// ([`TrainerConfig::precision_on`]); a per-stage choice like `device`.
    pub precision: Option<Precision>,
    /// Compute the log-prob head in chunks that never hold `[targets, vocab]` logits
    /// (`metronome_model::Model::with_chunked_head`: values within 1e-5 of the
    /// whole-logits head, gradients within 1e-4). Absent, on a GPU and off on the CPU
    /// ([`TrainerConfig::chunked_head_on`]).
    pub chunked_head: Option<bool>,
    /// Recompute each decoder layer's activations in the backward instead of keeping
    /// them (`metronome_model::Model::with_gradient_checkpointing`: the same
    /// gradients for about one more forward of the layers per step). Off by default.
    pub gradient_checkpointing: bool,
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
            precision: None,
            chunked_head: None,
            gradient_checkpointing: false,
        }
    }
}

impl TrainerConfig {
    /// Parses a JSON object and validates it; an error names the dotted key whose
    /// value does not parse.
    pub fn from_json(text: &str) -> Result<Self> {
        let cfg: Self = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
            .map_err(|e| {
                let key = e.path().to_string();
                let key = if key.is_empty() || key == "." { "trainer".to_owned() } else { key };
                TrainerError::config(key, format!("does not parse: {}", e.inner()))
            })?;
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

    /// The precision a trainer on `device` computes in: `precision`, else bf16 on a
    /// GPU and f32 on the CPU.
    #[must_use]
    pub fn precision_on(&self, device: &Device) -> Precision {
        self.precision.unwrap_or_else(|| Precision::for_device(device))
    }

    /// Whether a trainer on `device` computes the log-prob head in chunks:
    /// `chunked_head`, else on a GPU and not on the CPU.
    #[must_use]
    pub fn chunked_head_on(&self, device: &Device) -> bool {
        self.chunked_head.unwrap_or(!device.is_cpu())
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
        let err = TrainerConfig::from_json(&format!(
            r#"{{{teacher}, "advantage": "reinforce_plus_plus_baseline"}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("`distill`") && err.contains("advantage"), "{err}");
        let err = TrainerConfig::from_json(r#"{"distill": {"kind": "hf", "path": "t", "weight": -1}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`distill.weight`"), "{err}");
        let err = TrainerConfig::from_json(r#"{"distill": {"kind": "onnx", "path": "t"}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("onnx"), "{err}");
    }

    #[test]
    fn precision_and_memory_levers_read_and_default_by_device() {
        let cfg = TrainerConfig::default();
        assert_eq!(cfg.precision_on(&Device::Cpu), Precision::F32);
        assert!(!cfg.chunked_head_on(&Device::Cpu) && !cfg.gradient_checkpointing);
        let cfg = TrainerConfig::from_json(
            r#"{"precision": "bf16", "chunked_head": true, "gradient_checkpointing": true}"#,
        )
        .unwrap();
        assert_eq!(cfg.precision_on(&Device::Cpu), Precision::Bf16);
        assert!(cfg.chunked_head_on(&Device::Cpu) && cfg.gradient_checkpointing);
        let text = serde_json::to_string(&cfg).unwrap();
        assert_eq!(TrainerConfig::from_json(&text).unwrap(), cfg);
        let err = TrainerConfig::from_json(r#"{"precision": "fp16"}"#).unwrap_err().to_string();
        assert!(
            err.starts_with("config key `precision`")
                && err.contains("`fp16` is not a precision (expected `bf16` or `f32`)"),
            "{err}"
        );
    }

    #[test]
    fn lora_fills_peft_defaults() {
        let cfg = TrainerConfig::from_json(r#"{"lora": {"rank": 4}}"#).unwrap();
        let lora = cfg.lora.unwrap();
        assert_eq!((lora.rank, lora.alpha, lora.dropout, lora.target_modules.len()), (4, 16.0, 0.0, 7));
    }
}
