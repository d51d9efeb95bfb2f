//! Counters every transport keeps: emitted through the `metrics` facade and kept in
//! memory so that callers (and tests) can read them without a recorder.
//!
//! Metric names (labels: `transport` = `local`|`nats`, `kind` = `group`|`weights`|`control`,
//! `reason` = [`crate::Error::reason`]; all bounded):
//! - `metronome_transport_messages_sent_total`, `metronome_transport_bytes_sent_total`
//! - `metronome_transport_messages_received_total`, `metronome_transport_bytes_received_total`
//! - `metronome_transport_redeliveries_total`: deliveries the server marked as repeated
//! - `metronome_transport_duplicates_total`: groups dropped because their key was already seen
//! - `metronome_transport_rejected_total`: malformed or oversized messages, by reason
//! - `metronome_transport_dead_letters_total`: poison messages kept on the NATS
//!   dead-letter stream, by kind (`group`, `claim`)
//! - `metronome_transport_publish_latency_seconds`: send until the transport confirmed it
//! - `metronome_transport_weight_fetch_seconds`: fetching and decoding one snapshot
//!
//! The NATS weight path adds `metronome_transport_weights_streamed_fetches_total`
//! (versions decoded while they uploaded) and
//! `metronome_transport_weights_restored_total` (versions uploaded again after a
//! restarted server had lost them).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A point-in-time copy of a transport endpoint's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages sent.
    pub messages_sent: u64,
    /// Bytes sent (encoded size; 0 for the in-process transport, which does not encode).
    pub bytes_sent: u64,
    /// Messages received and delivered.
    pub messages_received: u64,
    /// Bytes received.
    pub bytes_received: u64,
    /// Deliveries the server marked as redelivered.
    pub redeliveries: u64,
    /// Groups dropped because their (period, prompt) key was already delivered.
    pub duplicates: u64,
    /// Rejected messages by reason.
    pub rejected: BTreeMap<&'static str, u64>,
}

impl Stats {
    /// Total rejected messages.
    #[must_use]
    pub fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }
}

/// Shared counters of one endpoint.
#[derive(Debug)]
#[cfg_attr(
    not(any(feature = "local", feature = "nats")),
    allow(dead_code, reason = "no transport is enabled to count")
)]
pub(crate) struct Counters {
    transport: &'static str,
    kind: &'static str,
    messages_sent: AtomicU64,
    bytes_sent: AtomicU64,
    messages_received: AtomicU64,
    bytes_received: AtomicU64,
    redeliveries: AtomicU64,
    duplicates: AtomicU64,
    rejected: Mutex<BTreeMap<&'static str, u64>>,
}

#[cfg_attr(
    not(any(feature = "local", feature = "nats")),
    allow(dead_code, reason = "no transport is enabled to count")
)]
impl Counters {
    pub(crate) fn new(transport: &'static str, kind: &'static str) -> Self {
        Self {
            transport,
            kind,
            messages_sent: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            messages_received: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            redeliveries: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            rejected: Mutex::new(BTreeMap::new()),
        }
    }

    pub(crate) fn sent(&self, bytes: usize, latency: Duration) {
        self.messages_sent.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
        let labels = [("transport", self.transport), ("kind", self.kind)];
        metrics::counter!("metronome_transport_messages_sent_total", &labels).increment(1);
        metrics::counter!("metronome_transport_bytes_sent_total", &labels).increment(bytes as u64);
        metrics::histogram!("metronome_transport_publish_latency_seconds", &labels)
            .record(latency.as_secs_f64());
    }

    pub(crate) fn received(&self, bytes: usize) {
        self.messages_received.fetch_add(1, Ordering::Relaxed);
        self.bytes_received.fetch_add(bytes as u64, Ordering::Relaxed);
        let labels = [("transport", self.transport), ("kind", self.kind)];
        metrics::counter!("metronome_transport_messages_received_total", &labels).increment(1);
        metrics::counter!("metronome_transport_bytes_received_total", &labels).increment(bytes as u64);
    }

    #[cfg_attr(not(feature = "nats"), allow(dead_code, reason = "only the NATS transport redelivers"))]
    pub(crate) fn redelivered(&self) {
        self.redeliveries.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("metronome_transport_redeliveries_total", "transport" => self.transport, "kind" => self.kind)
            .increment(1);
    }

    pub(crate) fn duplicate(&self) {
        self.duplicates.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("metronome_transport_duplicates_total", "transport" => self.transport, "kind" => self.kind)
            .increment(1);
    }

    #[cfg_attr(not(feature = "nats"), allow(dead_code, reason = "the in-process transport never decodes"))]
    pub(crate) fn rejected(&self, reason: &'static str) {
        *self
            .rejected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(reason)
            .or_default() += 1;
        metrics::counter!(
            "metronome_transport_rejected_total",
            "transport" => self.transport, "kind" => self.kind, "reason" => reason
        )
        .increment(1);
    }

    #[cfg_attr(not(feature = "nats"), allow(dead_code, reason = "only the NATS transport fetches"))]
    pub(crate) fn fetched(&self, elapsed: Duration) {
        metrics::histogram!("metronome_transport_weight_fetch_seconds", "transport" => self.transport)
            .record(elapsed.as_secs_f64());
    }

    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            messages_sent: self.messages_sent.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            messages_received: self.messages_received.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            redeliveries: self.redeliveries.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            rejected: self.rejected.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone(),
        }
    }
}
