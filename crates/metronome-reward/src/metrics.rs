//! The crate's metrics: the typed catalogue [`METRICS`] and the functions that emit
//! them through the `metrics` facade (per group, never per token). Nothing else in the
//! crate emits.

use std::time::Duration;

use metronome_core::{Metric, metric_catalogue};

metric_catalogue! {
    /// Every metric this crate emits.
    pub const METRICS = [
        /// Scoring failures by reason: `timeout`, `panic`, `non_finite`, `unavailable`,
        /// `scorer` (a scorer reported a failure itself, e.g. a missing reference),
        /// `remote` and `judge`.
        FAILURES = Metric::counter(
            "metronome_reward_failures_total",
            "completions scored as failed, by reason (timeout, panic, non_finite, unavailable, scorer, \
             remote, judge)",
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
        /// One per completion the code reward scored; `verdict` is a
        /// [`crate::VerdictKind`] label, so the pass rate is the `passed` share.
        CODE_EXECUTIONS = Metric::counter(
            "metronome_reward_code_executions_total",
            "completions whose program the code reward ran (or could not), by verdict (passed, failed, \
             error, timeout, cpu_limit, memory_limit, output_limit, killed, no_program, too_long)",
        )
        .labels(&["verdict"]),
        CODE_EXECUTION_SECONDS = Metric::seconds(
            "metronome_reward_code_execution_seconds",
            "wall time of the sandboxed runs of one completion's program",
        ),
        /// `outcome`: `ok`, `malformed` (no score in the strict format), `error` (a
        /// refused request or an error status) or `timeout`.
        JUDGE_REQUESTS = Metric::counter(
            "metronome_reward_judge_requests_total",
            "requests to the judge model, by outcome (ok, malformed, error, timeout)",
        )
        .labels(&["outcome"]),
        JUDGE_REQUEST_SECONDS =
            Metric::seconds("metronome_reward_judge_request_seconds", "wall time of one request to the judge"),
        JUDGE_CACHE_HITS = Metric::counter(
            "metronome_reward_judge_cache_hits_total",
            "completions whose judgement came from the cache (same prompt, completion and rubric)",
        ),
        /// `policy`: `score` (the failure score) or `drop` (the whole group).
        JUDGE_FAILURES = Metric::counter(
            "metronome_reward_judge_failures_total",
            "completions the judge could not grade, by the failure policy applied (score, drop)",
        )
        .labels(&["policy"]),
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

pub(crate) fn code_execution(verdict: &'static str, elapsed: Duration) {
    metrics::counter!(CODE_EXECUTIONS.name, "verdict" => verdict).increment(1);
    metrics::histogram!(CODE_EXECUTION_SECONDS.name).record(elapsed.as_secs_f64());
}

pub(crate) fn judge_request(outcome: &'static str, elapsed: Duration) {
    metrics::counter!(JUDGE_REQUESTS.name, "outcome" => outcome).increment(1);
    metrics::histogram!(JUDGE_REQUEST_SECONDS.name).record(elapsed.as_secs_f64());
}

pub(crate) fn judge_cache_hit() {
    metrics::counter!(JUDGE_CACHE_HITS.name).increment(1);
}

pub(crate) fn judge_failures(policy: &'static str, n: u64) {
    metrics::counter!(JUDGE_FAILURES.name, "policy" => policy).increment(n);
}
