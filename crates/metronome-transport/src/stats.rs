//! Counters every transport keeps: emitted as the metrics of [`crate::METRICS`] and
//! kept in memory so that callers (and tests) can read them without a recorder.

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
        crate::metrics::sent(self.transport, self.kind, bytes, latency);
    }

    pub(crate) fn received(&self, bytes: usize) {
        self.messages_received.fetch_add(1, Ordering::Relaxed);
        self.bytes_received.fetch_add(bytes as u64, Ordering::Relaxed);
        crate::metrics::received(self.transport, self.kind, bytes);
    }

    #[cfg_attr(not(feature = "nats"), allow(dead_code, reason = "only the NATS transport redelivers"))]
    pub(crate) fn redelivered(&self) {
        self.redeliveries.fetch_add(1, Ordering::Relaxed);
        crate::metrics::redelivered(self.transport, self.kind);
    }

    pub(crate) fn duplicate(&self) {
        self.duplicates.fetch_add(1, Ordering::Relaxed);
        crate::metrics::duplicate(self.transport, self.kind);
    }

    #[cfg_attr(not(feature = "nats"), allow(dead_code, reason = "the in-process transport never decodes"))]
    pub(crate) fn rejected(&self, reason: &'static str) {
        *self
            .rejected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(reason)
            .or_default() += 1;
        crate::metrics::rejected(self.transport, self.kind, reason);
    }

    #[cfg_attr(not(feature = "nats"), allow(dead_code, reason = "only the NATS transport fetches"))]
    pub(crate) fn fetched(&self, elapsed: Duration) {
        crate::metrics::weights_fetched(self.transport, elapsed);
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
