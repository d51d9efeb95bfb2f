//! The crate's metrics: the typed catalogue [`METRICS`] and the functions that emit
//! them through the `metrics` facade (per file loaded or batch released). Nothing
//! else in the crate emits.

use std::time::Duration;

use metronome_core::{Metric, metric_catalogue};

metric_catalogue! {
    /// Every metric this crate emits.
    pub const METRICS = [
        RECORDS_LOADED = Metric::counter(
            "metronome_dataloader_records_loaded_total",
            "records kept from dataset files, by format",
        )
        .labels(&["format"]),
        RECORDS_SKIPPED = Metric::counter(
            "metronome_dataloader_records_skipped_total",
            "bad records skipped (bad_records = skip), by format",
        )
        .labels(&["format"]),
        BATCH_WAIT = Metric::seconds(
            "metronome_dataloader_batch_wait_seconds",
            "how long next_batch waited for its batch (near zero when prefetching keeps up)",
        ),
        PROMPTS_SKIPPED = Metric::counter(
            "metronome_dataloader_prompts_skipped_total",
            "prompts not released, by reason (too_long)",
        )
        .labels(&["reason"]),
        BATCHES_CUT_SHORT = Metric::counter(
            "metronome_dataloader_batches_cut_short_total",
            "batches released short because the next prompt was already in them (an epoch boundary)",
        ),
        BATCHES_RELEASED = Metric::counter("metronome_dataloader_batches_released_total", "batches released"),
        PROMPTS_RELEASED = Metric::counter("metronome_dataloader_prompts_released_total", "prompts released"),
        PROMPT_TOKENS =
            Metric::counter("metronome_dataloader_prompt_tokens_total", "tokens of the prompts released"),
        EPOCH = Metric::gauge("metronome_dataloader_epoch", "the epoch the next batch comes from"),
    ];
}

pub(crate) fn records_loaded(format: &'static str, n: u64) {
    metrics::counter!(RECORDS_LOADED.name, "format" => format).increment(n);
}

pub(crate) fn records_skipped(format: &'static str, n: u64) {
    metrics::counter!(RECORDS_SKIPPED.name, "format" => format).increment(n);
}

pub(crate) fn batch_waited(elapsed: Duration) {
    metrics::histogram!(BATCH_WAIT.name).record(elapsed.as_secs_f64());
}

pub(crate) fn prompts_skipped(reason: &'static str, n: u64) {
    metrics::counter!(PROMPTS_SKIPPED.name, "reason" => reason).increment(n);
}

pub(crate) fn batch_cut_short() {
    metrics::counter!(BATCHES_CUT_SHORT.name).increment(1);
}

pub(crate) fn batch_released(prompts: u64, tokens: u64) {
    metrics::counter!(BATCHES_RELEASED.name).increment(1);
    metrics::counter!(PROMPTS_RELEASED.name).increment(prompts);
    metrics::counter!(PROMPT_TOKENS.name).increment(tokens);
}

pub(crate) fn epoch(epoch: u64) {
    metrics::gauge!(EPOCH.name).set(epoch as f64);
}
