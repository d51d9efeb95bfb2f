//! Groups on a durable work-queue stream, read through the trainer's durable consumer
//! and acknowledged only after accumulation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use metronome_core::{Acker, Delivery, GroupReceiver, GroupSender, ScoredGroup};

use super::TRANSPORT;
use super::connection::{NatsTransport, durable_consumer, ensure_stream};
use crate::dedup::{Admit, Dedup, KeyGuard};
use crate::stats::{Counters, Stats};
use crate::wire::{check_size, decode_group, encode_group};
use crate::{Error, Result};

/// How long [`NatsGroupReceiver::recv`] waits for a group before it looks at the
/// server's side of its consumer.
const IDLE_CHECK: Duration = Duration::from_secs(10);

impl NatsTransport {
    pub(super) async fn group_stream(&self) -> Result<stream::Stream> {
        let c = &self.config.groups;
        let config = stream::Config {
            name: c.stream.clone(),
            subjects: vec![c.subject.clone()],
            retention: stream::RetentionPolicy::WorkQueue,
            discard: stream::DiscardPolicy::New,
            max_messages: c.max_pending,
            max_message_size: i32::try_from(self.max_message).unwrap_or(i32::MAX),
            duplicate_window: Duration::from_millis(c.duplicate_window_ms),
            storage: c.storage.into(),
            ..stream::Config::default()
        };
        ensure_stream(&self.js, config, "create group stream").await
    }

    /// A group sender (creates the stream when missing).
    pub async fn group_sender(&self) -> Result<NatsGroupSender> {
        self.group_stream().await?;
        Ok(NatsGroupSender { transport: self.clone(), counters: Arc::new(Counters::new(TRANSPORT, "group")) })
    }

    /// The trainer's group receiver (creates the stream and the durable consumer when
    /// missing). Several receivers with the same consumer name share the work.
    pub async fn group_receiver(&self) -> Result<NatsGroupReceiver> {
        let c = &self.config.groups;
        let stream = self.group_stream().await?;
        let consumer =
            durable_consumer(&stream, &c.consumer, c.ack_wait_ms, c.max_ack_pending, "create group consumer")
                .await?;
        let messages = consumer.messages().await.map_err(|e| Error::nats("subscribe to groups", e))?;
        Ok(NatsGroupReceiver {
            transport: self.clone(),
            consumer,
            messages,
            max_message: self.max_message,
            dedup: Dedup::new(c.dedup_window_periods),
            counters: Arc::new(Counters::new(TRANSPORT, "group")),
        })
    }
}

/// Sends groups to the group stream.
#[derive(Debug, Clone)]
pub struct NatsGroupSender {
    transport: NatsTransport,
    counters: Arc<Counters>,
}

impl NatsGroupSender {
    /// This sender's counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }

    async fn send_bytes(&self, key: metronome_core::GroupKey, bytes: Vec<u8>) -> Result<()> {
        let start = Instant::now();
        if let Err(e) = check_size("group", bytes.len(), self.transport.max_message) {
            self.counters.rejected(e.reason());
            return Err(e);
        }
        let mut headers = HeaderMap::new();
        headers
            .insert(async_nats::header::NATS_MESSAGE_ID, format!("{}-{}", key.period, key.prompt).as_str());
        let len = bytes.len();
        let subject = &self.transport.config.groups.subject;
        self.transport.publish_durably("publish group", subject, Some(headers), Bytes::from(bytes)).await?;
        self.counters.sent(len, start.elapsed());
        Ok(())
    }
}

#[async_trait]
impl GroupSender for NatsGroupSender {
    async fn send(&self, group: ScoredGroup) -> metronome_core::Result<()> {
        let bytes = encode_group(&group).inspect_err(|e| self.counters.rejected(e.reason()))?;
        Ok(self.send_bytes(group.key(), bytes).await?)
    }
}

/// Receives groups from the group stream through the trainer's durable consumer.
///
/// Unlike the in-process receiver it cannot know when every sender is gone (senders
/// are other processes): `recv` waits through server restarts and returns `Ok(None)`
/// only when the connection is closed for good; a pipeline ends the stream with
/// [`metronome_core::ControlMessage::Shutdown`].
pub struct NatsGroupReceiver {
    transport: NatsTransport,
    consumer: consumer::PullConsumer,
    messages: consumer::pull::Stream,
    max_message: usize,
    dedup: Arc<Dedup>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for NatsGroupReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsGroupReceiver").field("max_message", &self.max_message).finish_non_exhaustive()
    }
}

impl NatsGroupReceiver {
    /// This receiver's counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }

    /// Nothing arrived for [`IDLE_CHECK`]: says what the server holds for this
    /// consumer, so that an operator (or a test's log) can tell groups never
    /// published from groups never delivered.
    async fn idle(&self) {
        match self.consumer.get_info().await {
            Ok(info) => tracing::info!(
                waiting = info.num_pending,
                unacknowledged = info.num_ack_pending,
                redelivered = info.num_redelivered,
                pulls = info.num_waiting,
                "no group for {}s; the server's count for this consumer",
                IDLE_CHECK.as_secs()
            ),
            Err(e) => tracing::debug!(error = %e, "cannot read the group consumer's state"),
        }
    }

    /// Terminates a message that can never be processed, so it is not redelivered,
    /// and keeps it as a dead letter.
    async fn reject(&self, message: &jetstream::Message, error: &Error) {
        self.counters.rejected(error.reason());
        tracing::warn!(%error, "rejected a group message");
        let subject = message.subject.as_str();
        self.transport.dead_letter("group", subject, &error.to_string(), message.payload.clone()).await;
        if let Err(e) = message.ack_with(jetstream::AckKind::Term).await {
            tracing::warn!(error = %e, "could not terminate a rejected group message");
        }
    }
}

struct NatsAck {
    acker: jetstream::message::Acker,
    guard: KeyGuard,
    /// For a rejection: the message as received, to keep as a dead letter.
    transport: NatsTransport,
    payload: Bytes,
}

impl std::fmt::Debug for NatsAck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAck").field("guard", &self.guard).finish_non_exhaustive()
    }
}

#[async_trait]
impl Acker for NatsAck {
    async fn ack(self: Box<Self>) -> metronome_core::Result<()> {
        // Wait for the server to confirm: only then is the group safe from redelivery.
        self.acker.double_ack().await.map_err(|e| Error::Nats { op: "acknowledge group", error: e })?;
        self.guard.acked();
        Ok(())
    }

    async fn reject(self: Box<Self>, reason: &str) -> metronome_core::Result<()> {
        let subject = self.transport.config.groups.subject.clone();
        self.transport.dead_letter("group", &subject, reason, self.payload.clone()).await;
        self.acker
            .ack_with(jetstream::AckKind::Term)
            .await
            .map_err(|e| Error::Nats { op: "terminate a rejected group", error: e })?;
        // Counted once: a copy re-sent with the same key is not delivered again.
        self.guard.acked();
        Ok(())
    }
}

#[async_trait]
impl GroupReceiver for NatsGroupReceiver {
    async fn recv(&mut self) -> metronome_core::Result<Option<Delivery>> {
        loop {
            let Ok(next) = tokio::time::timeout(IDLE_CHECK, self.messages.next()).await else {
                self.idle().await;
                continue;
            };
            let message = match next {
                None => return Ok(None),
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    use consumer::pull::MessagesErrorKind as K;
                    match e.kind() {
                        // Heartbeats go missing while the server restarts; the stream
                        // keeps pulling once the client has reconnected.
                        K::MissingHeartbeat | K::Pull | K::NoResponders | K::Other => {
                            tracing::debug!(error = %e, "group stream interrupted; waiting");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                        _ => return Err(Error::nats("receive groups", e).into()),
                    }
                }
            };
            if let Ok(info) = message.info()
                && info.delivered > 1
            {
                self.counters.redelivered();
            }
            let len = message.payload.len();
            if let Err(e) = check_size("group", len, self.max_message) {
                self.reject(&message, &e).await;
                continue;
            }
            let group = match decode_group(&message.payload) {
                Ok(g) => g,
                Err(e) => {
                    self.reject(&message, &e).await;
                    continue;
                }
            };
            match self.dedup.admit(group.key()) {
                (Admit::New, Some(guard)) => {
                    self.counters.received(len);
                    let payload = message.payload.clone();
                    let (_, acker) = message.split();
                    let transport = self.transport.clone();
                    let acker = Box::new(NatsAck { acker, guard, transport, payload });
                    return Ok(Some(Delivery { group, acker }));
                }
                (Admit::Acked, _) => {
                    self.counters.duplicate();
                    if let Err(e) = message.ack().await {
                        tracing::warn!(error = %e, "could not acknowledge a duplicate group");
                    }
                }
                _ => self.counters.duplicate(),
            }
        }
    }
}
