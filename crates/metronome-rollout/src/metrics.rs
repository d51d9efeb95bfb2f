//! The crate's metrics: the typed catalogue [`METRICS`] and the functions that emit
//! them through the `metrics` facade (per group, step or request, never per token;
//! token counts are added once per decode step). Nothing else in the crate emits.

use metronome_core::{Metric, metric_catalogue};

metric_catalogue! {
    /// Every metric this crate emits.
    pub const METRICS = [
        ACTIVE_SLOTS =
            Metric::gauge("metronome_rollout_active_slots", "KV-cache slots generating, per worker")
                .labels(&["worker"]),
        QUEUE_DEPTH =
            Metric::gauge("metronome_rollout_queue_depth", "responses waiting for a slot, engine-wide"),
        GENERATED_TOKENS =
            Metric::counter("metronome_rollout_generated_tokens_total", "tokens sampled, per worker")
                .labels(&["worker"]),
        DECODE_STEPS = Metric::counter(
            "metronome_rollout_decode_steps_total",
            "decode steps run (one per weight version a step's rows are on), per worker",
        )
        .labels(&["worker"]),
        DECODE_ROWS = Metric::counter(
            "metronome_rollout_decode_rows_total",
            "rows computed by decode steps, padding included (over decode steps: the mean batch), per worker",
        )
        .labels(&["worker"]),
        GROUP_DURATION = Metric::seconds(
            "metronome_rollout_group_duration_seconds",
            "from the start of a group's first response to the end of its last",
        ),
        PROMPTS_REJECTED = Metric::counter(
            "metronome_rollout_prompts_rejected_total",
            "prompts the engine cannot take (empty, or too long for max_seq_len), emitted as rejected groups",
        ),
        EPISODE_FAILURES = Metric::counter(
            "metronome_rollout_episode_failures_total",
            "multi-turn episodes ended before the environment said done, by reason (max_turns, max_tokens, \
             tool_timeout, tool_panic, tool_error, tool_unavailable, observation; agents: crash, timeout, no_call, \
             no_reward, wrong_key, late_call, not_started)",
        )
        .labels(&["reason"]),
        WEIGHT_SWITCHES = Metric::counter(
            "metronome_rollout_weight_switches_total",
            "running responses that continued under newer weights (partial rollouts), per worker",
        )
        .labels(&["worker"]),
        AGENT_SPLITS = Metric::counter(
            "metronome_rollout_agent_splits_total",
            "agent episodes' extra trajectories: calls whose prompt did not extend the trajectory before them",
        ),
        HTTP_RETRIES = Metric::counter(
            "metronome_rollout_http_retries_total",
            "completion requests to a server retried",
        ),
    ];
}

/// The handle a worker adds its sampled tokens to.
pub(crate) fn generated_tokens(worker: usize) -> metrics::Counter {
    metrics::counter!(GENERATED_TOKENS.name, "worker" => worker.to_string())
}

/// The handles a worker counts its decode steps and their rows on.
pub(crate) fn decode_steps(worker: &str) -> (metrics::Counter, metrics::Counter) {
    (
        metrics::counter!(DECODE_STEPS.name, "worker" => worker.to_owned()),
        metrics::counter!(DECODE_ROWS.name, "worker" => worker.to_owned()),
    )
}

/// The handle a worker sets its active slots on.
pub(crate) fn active_slots(worker: &str) -> metrics::Gauge {
    metrics::gauge!(ACTIVE_SLOTS.name, "worker" => worker.to_owned())
}

/// Counts `n` running responses of `worker` that continued under newer weights.
pub(crate) fn weight_switches(worker: &str, n: usize) {
    metrics::counter!(WEIGHT_SWITCHES.name, "worker" => worker.to_owned()).increment(n as u64);
}

pub(crate) fn queue_depth(pending: usize) {
    metrics::gauge!(QUEUE_DEPTH.name).set(pending as f64);
}

pub(crate) fn group_done(seconds: f64) {
    metrics::histogram!(GROUP_DURATION.name).record(seconds);
}

pub(crate) fn prompt_rejected() {
    metrics::counter!(PROMPTS_REJECTED.name).increment(1);
}

/// Counts an episode that ended early; `reason` is the failure's kind (the text before
/// any `:`), a bounded set.
pub(crate) fn episode_failed(failure: &str) {
    let reason = failure.split(':').next().unwrap_or(failure).to_owned();
    metrics::counter!(EPISODE_FAILURES.name, "reason" => reason).increment(1);
}

#[cfg(feature = "http")]
pub(crate) fn http_retry() {
    metrics::counter!(HTTP_RETRIES.name).increment(1);
}

/// Counts `n` trajectories that agent episodes split off.
#[cfg(feature = "http")]
pub(crate) fn agent_splits(n: usize) {
    metrics::counter!(AGENT_SPLITS.name).increment(n as u64);
}
