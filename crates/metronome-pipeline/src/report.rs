//! What a run records per period: the numbers behind `metrics.jsonl`, the summary
//! table, the plots and the benchmark; and held-out accuracy at points of the run.

use metronome_core::{PeriodId, StepReport};
use serde::{Deserialize, Serialize};

/// The kind of work an [`Interval`] was busy with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageKind {
    /// The rollout engine generating a period's groups.
    Generation,
    /// Scoring groups (reported separately only by `sync`; otherwise it overlaps).
    Scoring,
    /// The trainer accumulating a micro-batch or stepping.
    Training,
    /// Publishing and installing weights.
    Publication,
}

/// A busy interval of one stage, in seconds since the run started: the stage
/// timeline of the paper's Figure 1.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    /// The stage.
    pub stage: StageKind,
    /// The period the work belongs to.
    pub period: PeriodId,
    /// Start, seconds since the run started.
    pub start_s: f64,
    /// End, seconds since the run started.
    pub end_s: f64,
}

impl Interval {
    /// Its length in seconds.
    #[must_use]
    pub fn seconds(&self) -> f64 {
        self.end_s - self.start_s
    }
}

/// Held-out accuracy at one point of the run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    /// Optimiser steps of RL taken before the evaluation (0: after the warm start).
    pub after_periods: u64,
    /// Fraction of held-out answers that are correct (greedy, or sampled as `eval` says).
    pub accuracy: f64,
    /// With `[env]`: the fraction of held-out trajectories in which the policy
    /// called a tool (took more than one turn).
    pub tool_use: Option<f64>,
}

/// Everything measured in one period.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PeriodReport {
    /// The period.
    pub period: PeriodId,
    /// Wall time from the period's start (its weights published) to its step.
    pub period_s: f64,
    /// Time the rollout engine was busy generating this period's groups.
    pub generation_s: f64,
    /// Time the trainer was busy with this period (accumulation and step).
    pub training_s: f64,
    /// Time spent publishing the period's weights.
    pub publication_s: f64,
    /// Groups trained.
    pub groups: usize,
    /// Groups not trained because they were older than the staleness bound.
    pub dropped_stale: usize,
    /// Duplicate deliveries ignored (same period and prompt).
    pub duplicates: usize,
    /// Groups received but not trained: their prompt was rejected by the rollout
    /// engine, or they were poison (did not pack; belonged to a period or version
    /// not in training). Logged one by one.
    #[serde(default)]
    pub rejected: usize,
    /// Groups generated but not trained by dynamic sampling (`run.dynamic_sampling`):
    /// their rewards were all equal, or the period had its groups already.
    #[serde(default)]
    pub filtered: usize,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Mean reward over the period's completions.
    pub reward_mean: f64,
    /// Mean of the reward part named `correct` where the scorer reports one.
    pub accuracy: Option<f64>,
    /// Staleness (versions) of each trained group: 0 for on-policy schedules.
    pub staleness: Vec<u64>,
    /// The trainer's step report.
    pub step: StepReport,
    /// Busy intervals of the stages during this period.
    pub intervals: Vec<Interval>,
}

impl PeriodReport {
    /// max(generation, training) / period time: 1.0 when the period lasts no longer
    /// than its slower stage, i.e. the overlap is perfect.
    #[must_use]
    pub fn overlap_efficiency(&self) -> f64 {
        if self.period_s <= 0.0 { 0.0 } else { self.generation_s.max(self.training_s) / self.period_s }
    }
}

/// The run's clock: turns instants into [`Interval`]s in seconds since the run
/// started, for every part of the run alike.
#[derive(Clone, Copy, Debug)]
pub struct Clock(std::time::Instant);

impl Clock {
    /// A clock whose zero is now.
    #[must_use]
    pub fn start() -> Self {
        Self(std::time::Instant::now())
    }

    /// `stage`'s busy interval of `period` from `start` until now.
    #[must_use]
    pub fn interval(&self, stage: StageKind, period: PeriodId, start: std::time::Instant) -> Interval {
        Interval {
            stage,
            period,
            start_s: self.seconds(start),
            end_s: self.seconds(std::time::Instant::now()),
        }
    }

    fn seconds(&self, t: std::time::Instant) -> f64 {
        t.saturating_duration_since(self.0).as_secs_f64()
    }
}
