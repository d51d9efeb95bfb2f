//! The crate's metrics, emitted through the `metrics` facade (per group, never per token).

use std::time::Duration;

/// Scoring failures by reason: `timeout`, `panic`, `non_finite`, `unavailable`,
/// `scorer` (a scorer reported a failure itself, e.g. a missing reference) and `remote`.
pub(crate) const FAILURES: &str = "metronome_reward_failures_total";
/// Completions scored.
pub(crate) const COMPLETIONS: &str = "metronome_reward_completions_total";
/// Groups scored.
pub(crate) const GROUPS: &str = "metronome_reward_groups_total";
/// Wall time to score one group.
pub(crate) const GROUP_SECONDS: &str = "metronome_reward_group_seconds";
/// Threads stuck in a scorer past its limit.
pub(crate) const STUCK: &str = "metronome_reward_stuck_workers";
/// Remote requests retried.
pub(crate) const REMOTE_RETRIES: &str = "metronome_reward_remote_retries_total";

pub(crate) fn failure(reason: &'static str, n: u64) {
    metrics::counter!(FAILURES, "reason" => reason).increment(n);
}

pub(crate) fn group_scored(completions: usize, elapsed: Duration) {
    metrics::counter!(GROUPS).increment(1);
    metrics::counter!(COMPLETIONS).increment(completions as u64);
    metrics::histogram!(GROUP_SECONDS).record(elapsed.as_secs_f64());
}

pub(crate) fn stuck_workers(n: usize) {
    metrics::gauge!(STUCK).set(n as f64);
}

pub(crate) fn remote_retry() {
    metrics::counter!(REMOTE_RETRIES).increment(1);
}
