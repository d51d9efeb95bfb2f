//! The crate's metrics: the typed catalogue [`METRICS`] and the functions that emit
//! them through the `metrics` facade (per group, never per token). Nothing else in the
//! crate emits.

use std::time::Duration;

use metronome_core::{Metric, metric_catalogue};

metric_catalogue! {
    /// Every metric this crate emits.
    pub const METRICS = [
        /// Scoring failures by reason: `timeout`, `panic`, `non_finite`, `unavailable`,
        /// `scorer` (a scorer reported a failure itself, e.g. a missing reference) and `remote`.
        FAILURES = Metric::counter(
            "metronome_reward_failures_total",
            "completions scored as failed, by reason (timeout, panic, non_finite, unavailable, scorer, \
             remote)",
        )
        .labels(&["reason"]),
        COMPLETIONS = Metric::counter("metronome_reward_completions_total", "completions scored"),
        GROUPS = Metric::counter("metronome_reward_groups_total", "groups scored"),
        GROUP_SECONDS = Metric::seconds("metronome_reward_group_seconds", "wall time to score one group"),
        STUCK = Metric::gauge(
            "metronome_reward_stuck_workers",
            "pool threads stuck in a scorer past its time limit",
        ),
        REMOTE_RETRIES =
            Metric::counter("metronome_reward_remote_retries_total", "requests to a remote scorer retried"),
    ];
}

pub(crate) fn failure(reason: &'static str, n: u64) {
    metrics::counter!(FAILURES.name, "reason" => reason).increment(n);
}

pub(crate) fn group_scored(completions: usize, elapsed: Duration) {
    metrics::counter!(GROUPS.name).increment(1);
    metrics::counter!(COMPLETIONS.name).increment(completions as u64);
    metrics::histogram!(GROUP_SECONDS.name).record(elapsed.as_secs_f64());
}

pub(crate) fn stuck_workers(n: usize) {
    metrics::gauge!(STUCK.name).set(n as f64);
}

pub(crate) fn remote_retry() {
    metrics::counter!(REMOTE_RETRIES.name).increment(1);
}
