//! Length shaping: DAPO's soft overlong punishment.
//!
//! With maximum length `L_max` and a soft interval `L_cache`, a response of length
//! `L` gets `0` when `L <= L_max - L_cache`, `(L_max - L_cache - L) / L_cache` inside
//! the interval (falling linearly to `-1`), and `-1` past `L_max`; the result is
//! multiplied by `penalty`. It is usually one weighted part of a composite.

use serde::{Deserialize, Serialize};

use metronome_core::{Completion, Prompt, Reward, RewardFn};

use crate::{Error, Result};

/// What a response's length is measured in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthUnit {
    /// Generated tokens (what the policy pays for).
    #[default]
    Tokens,
    /// Characters of the decoded text.
    Chars,
}

/// Configuration of [`LengthShaping`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LengthConfig {
    /// `L_max`: lengths above it get the full penalty.
    pub max_len: u32,
    /// `L_cache`: the soft interval below `max_len` where the penalty grows linearly.
    pub cache_len: u32,
    /// Scale of the penalty (the score reaches `-penalty`).
    pub penalty: f32,
    /// The length unit.
    pub unit: LengthUnit,
}

impl Default for LengthConfig {
    fn default() -> Self {
        Self { max_len: 4096, cache_len: 512, penalty: 1.0, unit: LengthUnit::Tokens }
    }
}

impl LengthConfig {
    /// Checks the values and builds the scorer.
    pub fn build(&self) -> Result<LengthShaping> {
        if self.cache_len == 0 || self.cache_len > self.max_len {
            return Err(Error::config(
                "length.cache_len",
                format!("must be in 1..=max_len ({}), got {}", self.max_len, self.cache_len),
            ));
        }
        if !(self.penalty.is_finite() && self.penalty >= 0.0) {
            return Err(Error::config(
                "length.penalty",
                format!("must be finite and >= 0, got {}", self.penalty),
            ));
        }
        Ok(LengthShaping { config: self.clone() })
    }
}

/// DAPO's overlong reward shaping.
#[derive(Clone, Debug)]
pub struct LengthShaping {
    config: LengthConfig,
}

impl LengthShaping {
    /// The shaped reward of a response of `len` units.
    #[must_use]
    pub fn shape(&self, len: usize) -> f32 {
        let c = &self.config;
        let (max, cache) = (f64::from(c.max_len), f64::from(c.cache_len));
        let len = len as f64;
        let raw = if len <= max - cache {
            0.0
        } else if len <= max {
            (max - cache - len) / cache
        } else {
            -1.0
        };
        (raw * f64::from(c.penalty)) as f32
    }
}

impl RewardFn for LengthShaping {
    fn score(&self, _prompt: &Prompt, completion: &Completion) -> Reward {
        let len = match self.config.unit {
            LengthUnit::Tokens => completion.tokens.len(),
            LengthUnit::Chars => completion.text.chars().count(),
        };
        let mut reward = Reward::scalar(self.shape(len));
        reward.parts.insert("length".into(), len as f32);
        reward
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_dapo_soft_punishment() {
        let s = LengthConfig { max_len: 100, cache_len: 20, penalty: 1.0, unit: LengthUnit::Tokens }
            .build()
            .unwrap();
        assert_eq!(s.shape(0), 0.0);
        assert_eq!(s.shape(80), 0.0);
        assert_eq!(s.shape(90), -0.5);
        assert_eq!(s.shape(100), -1.0);
        assert_eq!(s.shape(101), -1.0);
        let half = LengthConfig {
            penalty: 0.5,
            ..LengthConfig { max_len: 100, cache_len: 20, ..Default::default() }
        };
        assert_eq!(half.build().unwrap().shape(85), -0.125);
    }

    #[test]
    fn rejects_bad_intervals() {
        assert!(LengthConfig { max_len: 10, cache_len: 11, ..Default::default() }.build().is_err());
        assert!(LengthConfig { cache_len: 0, ..Default::default() }.build().is_err());
    }
}
