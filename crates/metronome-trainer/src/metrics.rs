//! The crate's metrics: the typed catalogue [`METRICS`] and the functions that emit
//! them through the `metrics` facade (per micro-batch or step). Nothing else in the
//! crate emits. Per-step values (loss, KL, clip fraction, …) are returned in
//! `metronome_core::StepReport` instead; whoever drives the trainer records them as
//! gauges, so each gauge has one writer.

use std::time::Duration;

use metronome_core::{Metric, metric_catalogue};

metric_catalogue! {
    /// Every metric this crate emits.
    pub const METRICS = [
        ACCUMULATE_SECONDS = Metric::seconds(
            "metronome_trainer_accumulate_seconds",
            "forward and backward of one micro-batch",
        ),
        TOKENS = Metric::counter("metronome_trainer_tokens_total", "target tokens accumulated"),
        ZERO_ADVANTAGE_GROUPS = Metric::counter(
            "metronome_trainer_zero_advantage_groups_total",
            "groups accumulated whose rewards were all equal (no gradient)",
        ),
        STEPS = Metric::counter("metronome_trainer_steps_total", "optimiser steps, applied or refused"),
        STEP_SECONDS = Metric::seconds("metronome_trainer_step_seconds", "wall time of one step"),
        SKIPPED_STEPS = Metric::counter(
            "metronome_trainer_skipped_steps_total",
            "steps whose update was refused (non-finite loss or gradient)",
        ),
    ];
}

pub(crate) fn accumulated(elapsed: Duration, tokens: u64, zero_advantage_groups: u64) {
    metrics::histogram!(ACCUMULATE_SECONDS.name).record(elapsed.as_secs_f64());
    metrics::counter!(TOKENS.name).increment(tokens);
    metrics::counter!(ZERO_ADVANTAGE_GROUPS.name).increment(zero_advantage_groups);
}

pub(crate) fn stepped(elapsed: Duration) {
    metrics::counter!(STEPS.name).increment(1);
    metrics::histogram!(STEP_SECONDS.name).record(elapsed.as_secs_f64());
}

pub(crate) fn step_refused() {
    metrics::counter!(SKIPPED_STEPS.name).increment(1);
}
