//! Procedural tasks: seeded generators of prompts with verifiable reference answers,
//! for runs that need no dataset on disk.
//!
//! Item `i` of a task is computed from `stream_seed(seed, TASK_STREAM, i)` alone, so
//! the dataset is random-access, identical in every process, and independent of the
//! shuffle (which permutes item indices per epoch). The seed is the run seed unless the
//! task config fixes its own (useful for an evaluation set that must not change with
//! the run).

mod arithmetic;
mod countdown;

use serde::{Deserialize, Serialize};

pub use arithmetic::{ARITHMETIC_STREAM, ArithmeticConfig, ArithmeticTask};
pub use countdown::{COUNTDOWN_STREAM, CountdownConfig, CountdownItem, CountdownTask};

use crate::error::{Error, Result};

/// A binary arithmetic operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Operator {
    /// `+`
    #[serde(rename = "+")]
    Add,
    /// `-`
    #[serde(rename = "-")]
    Sub,
    /// `*`
    #[serde(rename = "*")]
    Mul,
    /// `/` (exact integer division only)
    #[serde(rename = "/")]
    Div,
}

impl Operator {
    /// The operator's symbol.
    #[must_use]
    pub fn symbol(self) -> char {
        match self {
            Self::Add => '+',
            Self::Sub => '-',
            Self::Mul => '*',
            Self::Div => '/',
        }
    }
}

/// An inclusive range `min..=max` of a difficulty knob.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Span {
    /// Smallest value.
    pub min: u64,
    /// Largest value.
    pub max: u64,
}

impl Span {
    /// `min..=max`.
    #[must_use]
    pub const fn new(min: u64, max: u64) -> Self {
        Self { min, max }
    }

    /// The single value `value..=value`.
    #[must_use]
    pub const fn exactly(value: u64) -> Self {
        Self { min: value, max: value }
    }

    /// Checks `lower <= min <= max <= upper`, naming `key` otherwise.
    pub(crate) fn check(self, key: &str, lower: u64, upper: u64) -> Result<()> {
        if self.min > self.max {
            return Err(Error::config(key, format!("min {} is larger than max {}", self.min, self.max)));
        }
        if self.min < lower || self.max > upper {
            return Err(Error::config(
                key,
                format!("{}..={} is outside the supported {lower}..={upper}", self.min, self.max),
            ));
        }
        Ok(())
    }
}

/// Replaces each `{name}` of `template` by its value; unknown names stay as written.
pub(crate) fn render(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = template.to_owned();
    for (name, value) in values {
        out = out.replace(&format!("{{{name}}}"), value);
    }
    out
}
