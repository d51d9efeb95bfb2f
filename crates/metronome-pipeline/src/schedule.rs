//! The schedules a run can use (docs/design.md §2).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How generation and training are arranged in time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Schedule {
    /// Generate the whole batch, then score, then train, then step: the colocated
    /// baseline every comparison is measured against.
    Sync,
    /// Periodic asynchrony: weights published at the period start, groups trained in
    /// completion order while generation continues, one step per period. On-policy,
    /// equal to `Sync`.
    #[default]
    Periodic,
    /// Bounded staleness: generation runs up to `s` periods ahead of training with the
    /// newest weights available; samples at most `s` versions old are trained with
    /// importance-sampling correction.
    Stale(u64),
}

impl Schedule {
    /// How many versions generation may run ahead of training: 0 for the on-policy
    /// schedules.
    #[must_use]
    pub fn max_lag(self) -> u64 {
        match self {
            Self::Sync | Self::Periodic => 0,
            Self::Stale(s) => s,
        }
    }

    /// True for the schedules whose samples all come from the current weights.
    #[must_use]
    pub fn is_on_policy(self) -> bool {
        self.max_lag() == 0
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sync => f.write_str("sync"),
            Self::Periodic => f.write_str("periodic"),
            Self::Stale(s) => write!(f, "stale:{s}"),
        }
    }
}

/// A schedule name that is not `sync`, `periodic` or `stale:<s>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown schedule `{0}`: expected `sync`, `periodic` or `stale:<s>` with s >= 1")]
pub struct ParseScheduleError(String);

impl FromStr for Schedule {
    type Err = ParseScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "sync" => Ok(Self::Sync),
            "periodic" => Ok(Self::Periodic),
            other => other
                .strip_prefix("stale:")
                .and_then(|n| n.parse::<u64>().ok())
                .filter(|&n| n >= 1)
                .map(Self::Stale)
                .ok_or_else(|| ParseScheduleError(s.to_owned())),
        }
    }
}

impl TryFrom<String> for Schedule {
    type Error = ParseScheduleError;

    fn try_from(value: String) -> Result<Self, Self::Error> {
        value.parse()
    }
}

impl From<Schedule> for String {
    fn from(value: Schedule) -> Self {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (text, schedule) in
            [("sync", Schedule::Sync), ("periodic", Schedule::Periodic), ("stale:2", Schedule::Stale(2))]
        {
            assert_eq!(text.parse::<Schedule>().unwrap(), schedule);
            assert_eq!(schedule.to_string(), text);
        }
        for bad in ["", "async", "stale", "stale:", "stale:0", "stale:-1", "stale:x"] {
            let err = bad.parse::<Schedule>().unwrap_err().to_string();
            assert!(err.contains(&format!("`{bad}`")), "{err}");
        }
        assert_eq!(Schedule::Stale(3).max_lag(), 3);
        assert!(Schedule::Periodic.is_on_policy());
    }
}
