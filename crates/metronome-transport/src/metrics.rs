//! The crate's metrics: the typed catalogue [`METRICS`] and the functions that emit
//! them through the `metrics` facade (per message or snapshot). Nothing else in the
//! crate emits; [`crate::Stats`] keeps the same counts in memory.
//!
//! Labels: `transport` = `local`|`nats`, `kind` = `group`|`weights`|`control`|`claim`,
//! `reason` = [`crate::Error::reason`]; all bounded.

use std::time::Duration;

use metronome_core::{Metric, MetricUnit, metric_catalogue};

metric_catalogue! {
    /// Every metric this crate emits (the dead letters and the streamed and restored
    /// weights only with the `nats` feature).
    pub const METRICS = [
        MESSAGES_SENT =
            Metric::counter("metronome_transport_messages_sent_total", "messages sent")
                .labels(&["transport", "kind"]),
        BYTES_SENT = Metric::counter(
            "metronome_transport_bytes_sent_total",
            "encoded bytes sent (0 in process, nothing is encoded)",
        )
        .unit(MetricUnit::Bytes)
        .labels(&["transport", "kind"]),
        PUBLISH_LATENCY = Metric::seconds(
            "metronome_transport_publish_latency_seconds",
            "from send until the transport confirmed it",
        )
        .labels(&["transport", "kind"]),
        MESSAGES_RECEIVED =
            Metric::counter("metronome_transport_messages_received_total", "messages received and delivered")
                .labels(&["transport", "kind"]),
        BYTES_RECEIVED =
            Metric::counter("metronome_transport_bytes_received_total", "bytes received")
                .unit(MetricUnit::Bytes)
                .labels(&["transport", "kind"]),
        REDELIVERIES = Metric::counter(
            "metronome_transport_redeliveries_total",
            "deliveries the server marked as repeated",
        )
        .labels(&["transport", "kind"]),
        DUPLICATES = Metric::counter(
            "metronome_transport_duplicates_total",
            "groups dropped because their (period, prompt) key was already delivered",
        )
        .labels(&["transport", "kind"]),
        REJECTED = Metric::counter(
            "metronome_transport_rejected_total",
            "malformed or oversized messages refused, by reason",
        )
        .labels(&["transport", "kind", "reason"]),
        WEIGHT_FETCH = Metric::seconds(
            "metronome_transport_weight_fetch_seconds",
            "fetching and decoding one weight snapshot",
        )
        .labels(&["transport"]),
        DEAD_LETTERS = Metric::counter(
            "metronome_transport_dead_letters_total",
            "poison messages kept on the NATS dead-letter stream, by kind (group, claim)",
        )
        .labels(&["transport", "kind"]),
        WEIGHTS_STREAMED = Metric::counter(
            "metronome_transport_weights_streamed_fetches_total",
            "weight versions decoded while they uploaded",
        )
        .labels(&["transport"]),
        WEIGHTS_RESTORED = Metric::counter(
            "metronome_transport_weights_restored_total",
            "weight versions uploaded again after a restarted server had lost them",
        )
        .labels(&["transport"]),
    ];
}

pub(crate) fn sent(transport: &'static str, kind: &'static str, bytes: usize, latency: Duration) {
    let labels = [("transport", transport), ("kind", kind)];
    metrics::counter!(MESSAGES_SENT.name, &labels).increment(1);
    metrics::counter!(BYTES_SENT.name, &labels).increment(bytes as u64);
    metrics::histogram!(PUBLISH_LATENCY.name, &labels).record(latency.as_secs_f64());
}

pub(crate) fn received(transport: &'static str, kind: &'static str, bytes: usize) {
    let labels = [("transport", transport), ("kind", kind)];
    metrics::counter!(MESSAGES_RECEIVED.name, &labels).increment(1);
    metrics::counter!(BYTES_RECEIVED.name, &labels).increment(bytes as u64);
}

pub(crate) fn redelivered(transport: &'static str, kind: &'static str) {
    metrics::counter!(REDELIVERIES.name, "transport" => transport, "kind" => kind).increment(1);
}

pub(crate) fn duplicate(transport: &'static str, kind: &'static str) {
    metrics::counter!(DUPLICATES.name, "transport" => transport, "kind" => kind).increment(1);
}

pub(crate) fn rejected(transport: &'static str, kind: &'static str, reason: &'static str) {
    metrics::counter!(REJECTED.name, "transport" => transport, "kind" => kind, "reason" => reason)
        .increment(1);
}

pub(crate) fn weights_fetched(transport: &'static str, elapsed: Duration) {
    metrics::histogram!(WEIGHT_FETCH.name, "transport" => transport).record(elapsed.as_secs_f64());
}

#[cfg(feature = "nats")]
pub(crate) fn dead_letter(transport: &'static str, kind: &'static str) {
    metrics::counter!(DEAD_LETTERS.name, "transport" => transport, "kind" => kind).increment(1);
}

#[cfg(feature = "nats")]
pub(crate) fn weights_streamed(transport: &'static str) {
    metrics::counter!(WEIGHTS_STREAMED.name, "transport" => transport).increment(1);
}

#[cfg(feature = "nats")]
pub(crate) fn weights_restored(transport: &'static str) {
    metrics::counter!(WEIGHTS_RESTORED.name, "transport" => transport).increment(1);
}
