//! The crate's metrics: the typed catalogue [`METRICS`] and the functions that emit
//! them through the `metrics` facade (per micro-batch or step). Nothing else in the
//! crate emits. Per-step values (loss, KL, clip fraction, …) are returned in
//! `metronome_core::StepReport` instead; whoever drives the trainer records them as
//! gauges, so each gauge has one writer.

use std::time::Duration;

use metronome_core::Metric;

const ACCUMULATE_SECONDS: Metric =
    Metric::seconds("metronome_trainer_accumulate_seconds", "forward and backward of one micro-batch");
const TOKENS: Metric = Metric::counter("metronome_trainer_tokens_total", "target tokens accumulated");
const ZERO_ADVANTAGE_GROUPS: Metric = Metric::counter(
    "metronome_trainer_zero_advantage_groups_total",
    "groups accumulated whose rewards were all equal (no gradient)",
);
const STEPS: Metric = Metric::counter("metronome_trainer_steps_total", "optimiser steps, applied or refused");
const STEP_SECONDS: Metric = Metric::seconds("metronome_trainer_step_seconds", "wall time of one step");
const SKIPPED_STEPS: Metric = Metric::counter(
    "metronome_trainer_skipped_steps_total",
    "steps whose update was refused (non-finite loss or gradient)",
);

/// Every metric this crate emits.
pub const METRICS: &[Metric] =
    &[ACCUMULATE_SECONDS, TOKENS, ZERO_ADVANTAGE_GROUPS, STEPS, STEP_SECONDS, SKIPPED_STEPS];

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
