//! Serde configuration that builds scorers, so the pipeline can choose rewards from TOML.
//!
//! ```toml
//! [reward]
//! kind = "local"
//! pool = { workers = 4, time_limit_ms = 2000 }
//!
//! [reward.scorer]
//! kind = "composite"
//!
//! [[reward.scorer.components]]
//! name = "correct"
//! scorer = { kind = "math" }
//!
//! [[reward.scorer.components]]
//! name = "format"
//! weight = 0.1
//! scorer = { kind = "format" }
//! ```

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use metronome_core::{AdvantageEstimator, GroupScorer, RewardFn};

use crate::code::CodeConfig;
use crate::composite::{Component, Composite};
use crate::countdown::CountdownConfig;
use crate::judge::JudgeConfig;
use crate::length::LengthConfig;
use crate::math::MathConfig;
use crate::pool::{PoolConfig, PoolScorer};
use crate::remote::RemoteConfig;
use crate::text::{ExactMatchConfig, FormatConfig};
use crate::{Error, Result};

/// One synchronous scorer, chosen by `kind`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ScorerConfig {
    /// [`crate::MathVerifier`].
    Math(MathConfig),
    /// [`crate::ExactMatch`].
    ExactMatch(ExactMatchConfig),
    /// [`crate::FormatReward`].
    Format(FormatConfig),
    /// [`crate::CountdownChecker`].
    Countdown(CountdownConfig),
    /// [`crate::LengthShaping`].
    Length(LengthConfig),
    /// [`crate::Composite`].
    Composite(CompositeConfig),
    /// [`crate::CodeReward`]: the program run against the prompt's tests in a sandbox.
    Code(CodeConfig),
}

/// A weighted sum of scorers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompositeConfig {
    /// The parts.
    pub components: Vec<ComponentConfig>,
}

/// One part of a [`CompositeConfig`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentConfig {
    /// The part's name in the breakdown.
    pub name: String,
    /// Its weight (default 1).
    #[serde(default = "one")]
    pub weight: f32,
    /// The scorer.
    pub scorer: ScorerConfig,
}

fn one() -> f32 {
    1.0
}

/// Composites nest; past this depth a config is rejected rather than recursed into.
const MAX_NESTING: usize = 8;

impl ScorerConfig {
    /// Builds the scorer.
    pub fn build(&self) -> Result<Arc<dyn RewardFn>> {
        self.build_nested(0)
    }

    fn build_nested(&self, depth: usize) -> Result<Arc<dyn RewardFn>> {
        Ok(match self {
            Self::Math(c) => Arc::new(c.build()?),
            Self::ExactMatch(c) => Arc::new(c.build()?),
            Self::Format(c) => Arc::new(c.build()?),
            Self::Countdown(c) => Arc::new(c.build()?),
            Self::Length(c) => Arc::new(c.build()?),
            Self::Code(c) => Arc::new(c.build()?),
            Self::Composite(c) => {
                if depth >= MAX_NESTING {
                    return Err(Error::config("composite", format!("nests deeper than {MAX_NESTING}")));
                }
                let components = c
                    .components
                    .iter()
                    .map(|part| {
                        Ok(Component {
                            name: part.name.clone(),
                            weight: part.weight,
                            scorer: part.scorer.build_nested(depth + 1)?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Arc::new(Composite::new(components)?)
            }
        })
    }
}

impl ScorerConfig {
    /// The longest one call of the scorer is designed to take, when it bounds its own
    /// time (the code reward's sandbox); the pool's time limit must be longer.
    #[must_use]
    pub fn worst_case(&self) -> Option<std::time::Duration> {
        match self {
            Self::Code(c) => Some(c.worst_case()),
            Self::Composite(c) => {
                c.components.iter().filter_map(|p| p.scorer.worst_case()).reduce(|a, b| a + b)
            }
            _ => None,
        }
    }
}

/// The reward stage: local scorers on a worker pool, or a remote scorer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RewardConfig {
    /// A [`ScorerConfig`] run on a [`PoolScorer`].
    Local {
        /// The scorer.
        scorer: ScorerConfig,
        /// The pool.
        #[serde(default)]
        pool: PoolConfig,
    },
    /// A [`crate::RemoteScorer`].
    Remote(RemoteConfig),
    /// A [`crate::JudgeScorer`]: a judge model grades each completion against a rubric.
    Judge(JudgeConfig),
}

impl RewardConfig {
    /// Builds the group scorer (starting the pool's threads for a local one),
    /// computing advantages with `estimator`: an argument, not a key of this table,
    /// because a run has one estimator and it is the trainer's.
    pub fn build(&self, estimator: AdvantageEstimator) -> Result<Box<dyn GroupScorer>> {
        Ok(match self {
            Self::Local { scorer, pool } => {
                if let Some(needed) = scorer.worst_case()
                    && u128::from(pool.time_limit_ms) <= needed.as_millis()
                {
                    return Err(Error::config(
                        "pool.time_limit_ms",
                        format!(
                            "must be longer than the {} ms a code scorer may take (its time_budget_ms and the \
                             time to stop its sandbox), got {}",
                            needed.as_millis(),
                            pool.time_limit_ms
                        ),
                    ));
                }
                Box::new(PoolScorer::from_arc(scorer.build()?, pool.clone())?.with_estimator(estimator))
            }
            Self::Remote(c) => Box::new(c.build()?.with_estimator(estimator)),
            Self::Judge(c) => Box::new(c.build()?.with_estimator(estimator)),
        })
    }
}
