//! Learning-rate schedules: linear warm-up, then constant or cosine decay.

use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// The shape after warm-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Decay {
    /// Stay at the base rate.
    #[default]
    Constant,
    /// Half-cosine from the base rate to `min_ratio × base` at `total_steps`, then flat.
    Cosine {
        /// Total optimiser steps of the run (warm-up included).
        total_steps: u64,
        /// Final rate as a fraction of the base rate.
        #[serde(default)]
        min_ratio: f64,
    },
}

/// A learning-rate schedule over optimiser steps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LrSchedule {
    /// The peak (base) learning rate.
    pub lr: f64,
    /// Steps of linear warm-up from `lr / warmup_steps` to `lr`.
    pub warmup_steps: u64,
    /// What follows the warm-up.
    pub decay: Decay,
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self { lr: 1e-5, warmup_steps: 0, decay: Decay::Constant }
    }
}

impl LrSchedule {
    /// The rate of optimiser step `step` (0-based).
    #[must_use]
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.decay {
            Decay::Constant => self.lr,
            Decay::Cosine { total_steps, min_ratio } => {
                let span = total_steps.saturating_sub(self.warmup_steps).max(1);
                let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
                let min = self.lr * min_ratio;
                min + (self.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }

    /// Checks the ranges; errors name the key under `prefix`.
    pub fn validate(&self, prefix: &str) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(TrainerError::config(
                format!("{prefix}.lr"),
                format!("is {}, expected a positive number", self.lr),
            ));
        }
        if let Decay::Cosine { total_steps, min_ratio } = self.decay {
            if total_steps <= self.warmup_steps {
                return Err(TrainerError::config(
                    format!("{prefix}.decay.total_steps"),
                    format!("is {total_steps}, expected more than warmup_steps ({})", self.warmup_steps),
                ));
            }
            if !(0.0..=1.0).contains(&min_ratio) {
                return Err(TrainerError::config(
                    format!("{prefix}.decay.min_ratio"),
                    format!("is {min_ratio}, expected 0 <= min_ratio <= 1"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s =
            LrSchedule { lr: 1.0, warmup_steps: 4, decay: Decay::Cosine { total_steps: 14, min_ratio: 0.1 } };
        assert_eq!(s.lr_at(0), 0.25);
        assert_eq!(s.lr_at(3), 1.0);
        assert!((s.lr_at(4) - 1.0).abs() < 1e-12);
        assert!((s.lr_at(9) - 0.55).abs() < 1e-12);
        assert!((s.lr_at(14) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(100) - 0.1).abs() < 1e-12);
        s.validate("schedule").unwrap();
    }

    #[test]
    fn constant_after_warmup() {
        let s = LrSchedule { lr: 0.5, warmup_steps: 0, decay: Decay::Constant };
        assert_eq!(s.lr_at(0), 0.5);
        assert_eq!(s.lr_at(1000), 0.5);
    }

    #[test]
    fn bad_values_name_their_key() {
        let s =
            LrSchedule { lr: 1.0, warmup_steps: 10, decay: Decay::Cosine { total_steps: 5, min_ratio: 0.0 } };
        assert!(s.validate("schedule").unwrap_err().to_string().contains("schedule.decay.total_steps"));
        let s = LrSchedule { lr: -1.0, ..LrSchedule::default() };
        assert!(s.validate("schedule").unwrap_err().to_string().contains("schedule.lr"));
    }
}
