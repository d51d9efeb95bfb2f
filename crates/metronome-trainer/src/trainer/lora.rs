//! LoRA in the trainer (`trainer.lora`; Hu et al. 2021, arXiv 2106.09685): every
//! choice that differs with adapters, each beside its plain form. With adapters only
//! they train, the reference is the policy's base handle (no copy), and a checkpoint
//! holds the base in `policy/` and the adapters in PEFT's format in `adapter/`
//! instead of the policy and `reference/`.

use std::path::Path;

use candle_core::Var;
use metronome_model::{Device, Model, Precision};

use super::GrpoTrainer;
use crate::{Result, TrainerConfig, TrainerError};

/// The checkpoint's LoRA adapters, in the PEFT format (beside the base in `policy/`).
const ADAPTER_DIR: &str = "adapter";

/// The policy the trainer trains: with `cfg.lora`, `policy` with fresh adapters
/// (`B = 0`, so it starts as the given model; `A` seeded by `cfg.seed`), else
/// `policy` itself. A policy that already has adapters is refused.
pub(super) fn policy_to_train(cfg: &TrainerConfig, policy: Model) -> Result<Model> {
    if policy.lora().is_some() {
        return Err(TrainerError::invalid(
            "policy model",
            "already has LoRA adapters; pass its base (`Model::base`) or its merged model \
             (`Model::merged`), with trainer.lora set to train new ones",
        ));
    }
    Ok(match &cfg.lora {
        Some(lora) => policy.with_lora(lora, cfg.seed).map_err(TrainerError::from_model_config)?,
        None => policy,
    })
}

/// What trains: the adapters alone with LoRA, else every weight.
pub(super) fn trained_parameters(policy: &Model) -> Vec<(String, Var)> {
    if policy.lora().is_some() { policy.adapter_parameters() } else { policy.parameters() }
}

/// The frozen reference model of `policy`: with adapters its base handle, which no
/// step writes (only the adapters train), so no copy is made; otherwise a frozen copy
/// made now.
pub(super) fn reference_of(policy: &Model) -> Result<Model> {
    Ok(if policy.lora().is_some() { policy.base().with_trainable(false) } else { policy.frozen_copy()? })
}

/// The reference model a trainer computes with, from `reference` (f32, as
/// [`reference_of`] or a checkpoint gives it) and the handle that runs the policy's
/// forward (`scorer`): with adapters the scorer's base, which no step writes (in bf16,
/// the compute copy's base, so no second copy); in bf16 otherwise a bf16 copy (the f32
/// one is dropped: it is never read again, and a checkpoint saves the bf16 values
/// widened exactly to f32, so a resumed trainer makes the same copy).
pub(super) fn reference_in(
    scorer: &Model,
    reference: Option<Model>,
    precision: Precision,
) -> Result<Option<Model>> {
    let Some(reference) = reference else { return Ok(None) };
    if scorer.lora().is_some() {
        return Ok(Some(scorer.base().with_trainable(false)));
    }
    Ok(Some(match precision {
        Precision::F32 => reference,
        Precision::Bf16 => reference.compute_copy(precision.dtype())?,
    }))
}

impl GrpoTrainer {
    /// Writes the checkpoint's models: with LoRA the base (`policy/`) and the adapters
    /// (`adapter/`), else the policy and, with a KL term, the reference.
    pub(super) fn save_models(&self, dir: &Path) -> Result<()> {
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
        Ok(())
    }
}

/// The policy and reference of the checkpoint in `dir` as `cfg` asks for them (what
/// [`GrpoTrainer::save_models`] wrote); an error names the directory that is missing
/// or that `cfg` does not expect.
pub(super) fn load_models(
    cfg: &TrainerConfig,
    dir: &Path,
    device: &Device,
) -> Result<(Model, Option<Model>)> {
    let policy = Model::load_hf(&dir.join("policy"), device)?;
    let adapter = dir.join(ADAPTER_DIR);
    match &cfg.lora {
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
            Ok((policy, reference))
        }
        None if adapter.exists() => Err(TrainerError::checkpoint(
            adapter,
            "holds LoRA adapters, and trainer.lora is not set (set it as the run that wrote it did)",
        )),
        None if cfg.loss.kl_coef > 0.0 => {
            let rdir = dir.join("reference");
            if !rdir.exists() {
                return Err(TrainerError::checkpoint(
                    rdir,
                    "is missing, and loss.kl_coef needs the reference model",
                ));
            }
            let reference = Model::load_hf(&rdir, device)?.with_trainable(false);
            // The reference scores the policy's prepared batches: another shape or
            // rotary base fails the first step after the resume, far from the file.
            let differ = config_differences(policy.config(), reference.config());
            if !differ.is_empty() {
                return Err(TrainerError::checkpoint(
                    rdir.join("config.json"),
                    format!("describes another model than policy/config.json ({})", differ.join(", ")),
                ));
            }
            Ok((policy, Some(reference)))
        }
        None => Ok((policy, None)),
    }
}

/// The fields in which two model configs differ, as `field: a != b`.
fn config_differences(a: &metronome_model::ModelConfig, b: &metronome_model::ModelConfig) -> Vec<String> {
    let as_map = |c| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let (a, b) = (as_map(a), as_map(b));
    a.iter()
        .filter(|(k, v)| b.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: {v} != {}", b.get(k).unwrap_or(&serde_json::Value::Null)))
        .collect()
}
