//! The in-process transport: tokio channels between tasks of one process.
//!
//! Groups go through a bounded `mpsc` channel, so a sender waits when the trainer
//! falls `capacity` groups behind (backpressure). Weights live in a `watch` cell that
//! only ever holds the newest snapshot, shared by `Arc` (publishing costs no copy).
//! Control messages are broadcast to every receiver. Nothing is encoded; groups are
//! de-duplicated by key like on the network, so both transports count alike.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use metronome_core::{
    Acker, ControlMessage, Delivery, GroupReceiver, GroupSender, PolicyVersion, ScoredGroup, WeightPublisher,
    WeightSnapshot, WeightSubscriber,
};
use tokio::sync::{broadcast, mpsc, watch};

use crate::dedup::{Admit, DEFAULT_WINDOW_PERIODS, Dedup, KeyGuard};
use crate::stats::{Counters, Stats};
use crate::{ControlReceiver, ControlSender, Error};

const TRANSPORT: &str = "local";

/// Creates a bounded group channel holding at most `capacity` groups in flight
/// (at least 1).
#[must_use]
pub fn group_channel(capacity: usize) -> (LocalGroupSender, LocalGroupReceiver) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let counters = Arc::new(Counters::new(TRANSPORT, "group"));
    (
        LocalGroupSender { tx, counters: Arc::clone(&counters) },
        LocalGroupReceiver { rx, dedup: Dedup::new(DEFAULT_WINDOW_PERIODS), counters },
    )
}

/// Sends groups into a [`group_channel`]; clone it for more rollout tasks.
#[derive(Debug, Clone)]
pub struct LocalGroupSender {
    tx: mpsc::Sender<ScoredGroup>,
    counters: Arc<Counters>,
}

#[async_trait]
impl GroupSender for LocalGroupSender {
    async fn send(&self, group: ScoredGroup) -> metronome_core::Result<()> {
        let start = Instant::now();
        self.tx.send(group).await.map_err(|_| Error::Closed("local group receiver"))?;
        self.counters.sent(0, start.elapsed());
        Ok(())
    }
}

/// Receives groups from a [`group_channel`].
#[derive(Debug)]
pub struct LocalGroupReceiver {
    rx: mpsc::Receiver<ScoredGroup>,
    dedup: Arc<Dedup>,
    counters: Arc<Counters>,
}

impl LocalGroupReceiver {
    /// The channel's counters (shared by its senders and this receiver).
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }
}

#[derive(Debug)]
struct LocalAck(KeyGuard);

#[async_trait]
impl Acker for LocalAck {
    async fn ack(self: Box<Self>) -> metronome_core::Result<()> {
        self.0.acked();
        Ok(())
    }
}

#[async_trait]
impl GroupReceiver for LocalGroupReceiver {
    async fn recv(&mut self) -> metronome_core::Result<Option<Delivery>> {
        while let Some(group) = self.rx.recv().await {
            match self.dedup.admit(group.key()) {
                (Admit::New, Some(guard)) => {
                    self.counters.received(0);
                    return Ok(Some(Delivery { group, acker: Box::new(LocalAck(guard)) }));
                }
                _ => self.counters.duplicate(),
            }
        }
        Ok(None)
    }
}

/// Creates a weight cell: one publisher, and a subscriber to clone for every worker.
#[must_use]
pub fn weight_channel() -> (LocalWeightPublisher, LocalWeightSubscriber) {
    let (tx, rx) = watch::channel(None);
    let counters = Arc::new(Counters::new(TRANSPORT, "weights"));
    (
        LocalWeightPublisher { tx: Arc::new(tx), counters: Arc::clone(&counters) },
        LocalWeightSubscriber { rx, counters },
    )
}

/// Publishes snapshots into a [`weight_channel`].
#[derive(Debug, Clone)]
pub struct LocalWeightPublisher {
    tx: Arc<watch::Sender<Option<Arc<WeightSnapshot>>>>,
    counters: Arc<Counters>,
}

impl LocalWeightPublisher {
    /// A new subscriber that sees the newest snapshot.
    #[must_use]
    pub fn subscribe(&self) -> LocalWeightSubscriber {
        LocalWeightSubscriber { rx: self.tx.subscribe(), counters: Arc::clone(&self.counters) }
    }
}

#[async_trait]
impl WeightPublisher for LocalWeightPublisher {
    async fn publish(&self, snapshot: Arc<WeightSnapshot>) -> metronome_core::Result<()> {
        let start = Instant::now();
        let mut stale = None;
        self.tx.send_if_modified(|current| {
            if let Some(newest) = current.as_ref().filter(|c| c.version > snapshot.version) {
                stale = Some(Error::StaleVersion { version: snapshot.version.0, newest: newest.version.0 });
                return false;
            }
            *current = Some(Arc::clone(&snapshot));
            true
        });
        if let Some(e) = stale {
            return Err(e.into());
        }
        self.counters.sent(0, start.elapsed());
        Ok(())
    }
}

/// Reads the newest snapshot of a [`weight_channel`].
#[derive(Debug, Clone)]
pub struct LocalWeightSubscriber {
    rx: watch::Receiver<Option<Arc<WeightSnapshot>>>,
    counters: Arc<Counters>,
}

#[async_trait]
impl WeightSubscriber for LocalWeightSubscriber {
    async fn latest(&mut self) -> metronome_core::Result<Option<Arc<WeightSnapshot>>> {
        let newest = self.rx.borrow_and_update().clone();
        if newest.is_some() {
            self.counters.received(0);
        }
        Ok(newest)
    }

    async fn wait_for(&mut self, min: PolicyVersion) -> metronome_core::Result<Arc<WeightSnapshot>> {
        let newest = self
            .rx
            .wait_for(|s| s.as_ref().is_some_and(|s| s.version >= min))
            .await
            .map_err(|_| Error::Closed("local weight publisher"))?
            .clone();
        self.counters.received(0);
        newest.ok_or_else(|| Error::Closed("local weight publisher").into())
    }
}

/// Creates a control broadcast keeping up to `capacity` messages for slow receivers.
#[must_use]
pub fn control_channel(capacity: usize) -> (LocalControlSender, LocalControlReceiver) {
    let (tx, rx) = broadcast::channel(capacity.max(1));
    (LocalControlSender { tx }, LocalControlReceiver { rx })
}

/// Broadcasts control messages.
#[derive(Debug, Clone)]
pub struct LocalControlSender {
    tx: broadcast::Sender<ControlMessage>,
}

impl LocalControlSender {
    /// A new receiver that sees the messages sent from now on.
    #[must_use]
    pub fn subscribe(&self) -> LocalControlReceiver {
        LocalControlReceiver { rx: self.tx.subscribe() }
    }
}

#[async_trait]
impl ControlSender for LocalControlSender {
    async fn send(&self, message: ControlMessage) -> metronome_core::Result<()> {
        // With no receiver subscribed the message has nobody to reach; that is not
        // an error for a broadcast.
        let _ = self.tx.send(message);
        Ok(())
    }
}

/// Receives control messages.
#[derive(Debug)]
pub struct LocalControlReceiver {
    rx: broadcast::Receiver<ControlMessage>,
}

#[async_trait]
impl ControlReceiver for LocalControlReceiver {
    async fn recv(&mut self) -> metronome_core::Result<Option<ControlMessage>> {
        match self.rx.recv().await {
            Ok(m) => Ok(Some(m)),
            Err(broadcast::error::RecvError::Closed) => Ok(None),
            Err(broadcast::error::RecvError::Lagged(n)) => Err(metronome_core::Error::invalid(
                "local control receiver",
                format!("fell {n} messages behind; raise the control channel capacity"),
            )),
        }
    }
}
