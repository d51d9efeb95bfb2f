//! Procedural tasks: seeded generators of prompts with verifiable reference answers,
//! for runs that need no dataset on disk.
//!
//! Item `i` of a task is computed from `stream_seed(seed, TASK_STREAM, i)` alone, so
//! the dataset is random-access, identical in every process, and independent of the
//! shuffle (which permutes item indices per epoch). The seed is the run seed unless the
//! task config fixes its own (useful for an evaluation set that must not change with
//! the run).

mod arithmetic;
mod code;
mod copy;
mod countdown;
mod word_problems;

use metronome_core::mix64;
use serde::{Deserialize, Serialize};

pub use arithmetic::{ARITHMETIC_STREAM, ArithmeticConfig, ArithmeticTask};
pub use code::{CODE_STREAM, CodeFamily, CodeItem, CodeTask, CodeTaskConfig};
pub use copy::{COPY_STREAM, CopyConfig, CopyTask};
pub use countdown::{COUNTDOWN_STREAM, CountdownConfig, CountdownItem, CountdownTask};
pub use word_problems::{
    DEFAULT_WORD_PROBLEM_FORMAT, WORD_PROBLEM_STREAM, WordProblem, WordProblemConfig, WordProblemTask,
    WorkStep,
};

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

/// Which side of a task's train / held-out partition items are drawn from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Every item, no partition.
    #[default]
    All,
    /// Only items outside the held-out share.
    Train,
    /// Only items inside the held-out share: never seen by a `Train` split of the same
    /// task, whatever the seeds.
    Heldout,
}

/// A deterministic partition of a task's item space into train and held-out parts.
///
/// An item belongs to the held-out part when the hash of its content key (the
/// arithmetic expression; countdown's sorted numbers and target; a word problem's
/// template and given numbers) falls in the first
/// `percent` of 100 buckets. The partition depends on the content alone, not on a
/// seed, so a training run and its evaluation (different seeds, different sizes)
/// never share a problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Holdout {
    /// Which part to draw from.
    pub split: Split,
    /// The held-out share of the item space, in percent (1 to 99 when split).
    pub percent: u64,
}

impl Default for Holdout {
    fn default() -> Self {
        Self { split: Split::All, percent: 10 }
    }
}

impl Holdout {
    /// Only training items, with `percent` held out.
    #[must_use]
    pub const fn train(percent: u64) -> Self {
        Self { split: Split::Train, percent }
    }

    /// Only held-out items, `percent` of the space.
    #[must_use]
    pub const fn heldout(percent: u64) -> Self {
        Self { split: Split::Heldout, percent }
    }

    pub(crate) fn check(self, key: &str) -> Result<()> {
        if self.split != Split::All && !(1..=99).contains(&self.percent) {
            return Err(Error::config(key, format!("percent {} is outside 1..=99", self.percent)));
        }
        Ok(())
    }

    /// Whether an item with content key `key` belongs to the configured split.
    #[must_use]
    pub fn admits(self, key: &str) -> bool {
        match self.split {
            Split::All => true,
            Split::Train => holdout_bucket(key) >= self.percent,
            Split::Heldout => holdout_bucket(key) < self.percent,
        }
    }
}

/// The bucket `0..100` of an item's content key: a SplitMix64 chain over its bytes.
#[must_use]
pub fn holdout_bucket(key: &str) -> u64 {
    const DOMAIN: u64 = 0x686f_6c64_6f75_7421; // "holdout!"
    key.bytes().fold(mix64(DOMAIN ^ key.len() as u64), |h, b| mix64(h ^ u64::from(b))) % 100
}

/// Replaces each `{name}` of `template` by its value; unknown names stay as written.
pub(crate) fn render(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = template.to_owned();
    for (name, value) in values {
        out = out.replace(&format!("{{{name}}}"), value);
    }
    out
}
