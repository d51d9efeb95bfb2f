//! Checkpoints: a directory from which a resumed trainer takes bit-identical steps,
//! possibly written mid-period (the step under way goes with it). Which models it
//! holds depends on LoRA (`lora.rs`); the rest is the same for every trainer.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::Tensor;
use metronome_core::{GroupKey, PolicyVersion, TrainBatch};
use metronome_model::Device;
use serde::{Deserialize, Serialize};

use super::{GrpoTrainer, Mode, Sums};
use crate::distill::Teacher;
use crate::mismatch::MismatchSums;
use crate::{Result, TrainerConfig, TrainerError};

/// Version of the checkpoint layout written by [`GrpoTrainer::save_checkpoint`].
const CHECKPOINT_FORMAT: u32 = 1;
/// The largest count a checkpoint may hold (steps, versions, micro-batches, tokens):
/// about two billion, more than any run takes, and room left to count on (a version
/// of `u64::MAX` overflowed at the next step, and AdamW's bias correction raises its
/// betas to the step count as an `i32`).
const MAX_COUNT: u64 = i32::MAX as u64;
/// Prefix of the regulariser's gradient sums in `accumulator.safetensors` (the
/// policy-gradient term's, or the whole loss's, carry the parameter names alone).
const REGULARISER_PREFIX: &str = "regulariser/";

/// The part of a step already accumulated when a checkpoint is written mid-period
/// (`accumulator.json`; the gradient sums are in `accumulator.safetensors`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct PendingState {
    mode: Option<Mode>,
    micro_batches: u64,
    sums: Sums,
    seen_groups: BTreeSet<GroupKey>,
    buffered: Vec<TrainBatch>,
    /// The step's train–rollout mismatch so far (absent in older checkpoints).
    #[serde(default)]
    mismatch: MismatchSums,
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

impl GrpoTrainer {
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
        self.save_models(dir)?;
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
            mismatch: self.mismatch.clone(),
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
        // What the step under way goes on from: a count that overflows, a sum that is
        // not finite or a buffered batch (trained at the step by a mini-step
        // trainer) that breaks the layout contract fails here, naming the file, not
        // at the step.
        if pending.micro_batches > MAX_COUNT {
            return Err(TrainerError::checkpoint(
                &path,
                format!("has micro_batches = {}, more than {MAX_COUNT}", pending.micro_batches),
            ));
        }
        pending.sums.check(MAX_COUNT).map_err(|reason| TrainerError::checkpoint(&path, reason))?;
        pending.mismatch.check(MAX_COUNT).map_err(|reason| TrainerError::checkpoint(&path, reason))?;
        let vocab = self.policy.config().vocab_size;
        for (i, batch) in pending.buffered.iter().enumerate() {
            let bad = |reason: String| TrainerError::checkpoint(&path, format!("buffered[{i}]: {reason}"));
            batch.validate().map_err(|e| bad(e.to_string()))?;
            let tokens = batch.rows.iter().flat_map(|r| &r.tokens).chain(&batch.targets.token);
            if let Some(t) = tokens.copied().find(|&t| t as usize >= vocab) {
                return Err(bad(format!("holds token id {t}, outside the vocabulary of {vocab}")));
            }
            // One non-finite number makes the step's loss non-finite, and the step is
            // dropped.
            let t = &batch.targets;
            for (name, values) in [("advantage", &t.advantage), ("behaviour_logprob", &t.behaviour_logprob)] {
                if let Some((j, x)) = values.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                    return Err(bad(format!("target {j} has {name} {x}")));
                }
            }
        }
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
        self.mismatch = pending.mismatch;
        Ok(())
    }

    /// Becomes the trainer the checkpoint in `dir` holds, keeping this trainer's
    /// configuration, device, sampling temperature (which are the run's, not the
    /// checkpoint's) and distillation teacher (loaded from its path, never from a
    /// checkpoint).
    pub fn restore(&mut self, dir: &Path) -> Result<()> {
        let device = self.policy.device().clone();
        let temperature = self.temperature;
        *self = Self::resume_with(self.cfg.clone(), dir, &device, self.teacher.clone())?;
        self.temperature = temperature;
        Ok(())
    }

    /// A trainer restored from [`GrpoTrainer::save_checkpoint`]'s directory: the
    /// steps that follow are bit-identical to those of the trainer that wrote it.
    /// A distillation teacher (`cfg.distill`) is loaded from its path again.
    pub fn resume(cfg: TrainerConfig, dir: &Path, device: &Device) -> Result<Self> {
        Self::resume_with(cfg, dir, device, None)
    }

    /// [`GrpoTrainer::resume`] with the teacher already loaded, if given.
    fn resume_with(
        cfg: TrainerConfig,
        dir: &Path,
        device: &Device,
        teacher: Option<Teacher>,
    ) -> Result<Self> {
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
        for (field, value) in [
            ("version", st.version),
            ("optimizer_steps", st.optimizer_steps),
            ("schedule_position", st.schedule_position),
            ("skipped_steps", st.skipped_steps),
        ] {
            if value > MAX_COUNT {
                return Err(TrainerError::checkpoint(
                    &st_path,
                    format!("has {field} = {value}, more than the {MAX_COUNT} steps a run may count"),
                ));
            }
        }
        cfg.validate()?;
        let (policy, reference) = super::lora::load_models(&cfg, dir, device)?;
        let mut t = Self::with_reference(cfg, policy, reference, teacher)?;
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
