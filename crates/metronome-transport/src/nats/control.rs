//! Control messages on their own stream, read by an ordered consumer per receiver.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{consumer, stream};
use async_trait::async_trait;
use futures::StreamExt;
use metronome_core::ControlMessage;

use super::TRANSPORT;
use super::connection::{NatsTransport, ensure_stream};
use crate::stats::{Counters, Stats};
use crate::wire::{check_size, decode_control, encode_control};
use crate::{ControlReceiver, ControlSender, Error, Result};

impl NatsTransport {
    async fn control_stream(&self) -> Result<stream::Stream> {
        let c = &self.config.control;
        let config = stream::Config {
            name: c.stream.clone(),
            subjects: vec![c.subject.clone()],
            max_messages: 10_000,
            max_message_size: i32::try_from(self.max_message).unwrap_or(i32::MAX),
            storage: c.storage.into(),
            ..stream::Config::default()
        };
        ensure_stream(&self.js, config, "create control stream").await
    }

    /// A control sender.
    pub async fn control_sender(&self) -> Result<NatsControlSender> {
        self.control_stream().await?;
        Ok(NatsControlSender {
            transport: self.clone(),
            counters: Arc::new(Counters::new(TRANSPORT, "control")),
        })
    }

    /// A control receiver: it sees messages sent after it was made (and the last one
    /// before, with `control.replay_last`).
    pub async fn control_receiver(&self) -> Result<NatsControlReceiver> {
        let stream = self.control_stream().await?;
        let deliver_policy = if self.config.control.replay_last {
            consumer::DeliverPolicy::Last
        } else {
            consumer::DeliverPolicy::New
        };
        // Where a consumer made again after a server restart starts: after the last
        // message delivered, or where this one started.
        let last = stream.cached_info().state.last_sequence;
        let last_sequence = if self.config.control.replay_last { last.saturating_sub(1) } else { last };
        let messages = ordered_messages(&stream, deliver_policy).await?;
        Ok(NatsControlReceiver {
            stream,
            messages,
            last_sequence,
            max_message: self.max_message,
            counters: Arc::new(Counters::new(TRANSPORT, "control")),
        })
    }
}

/// Sends control messages.
#[derive(Debug, Clone)]
pub struct NatsControlSender {
    transport: NatsTransport,
    counters: Arc<Counters>,
}

#[async_trait]
impl ControlSender for NatsControlSender {
    async fn send(&self, message: ControlMessage) -> metronome_core::Result<()> {
        let start = Instant::now();
        let bytes = encode_control(&message)?;
        check_size("control", bytes.len(), self.transport.max_message)
            .inspect_err(|e| self.counters.rejected(e.reason()))?;
        let len = bytes.len();
        let subject = &self.transport.config.control.subject;
        self.transport.publish_durably("publish control", subject, None, bytes.into()).await?;
        self.counters.sent(len, start.elapsed());
        Ok(())
    }
}

/// An ordered consumer of `stream` from `deliver_policy`, and its messages.
async fn ordered_messages(
    stream: &stream::Stream,
    deliver_policy: consumer::DeliverPolicy,
) -> Result<consumer::pull::Ordered> {
    stream
        .create_consumer(consumer::pull::OrderedConfig { deliver_policy, ..Default::default() })
        .await
        .map_err(|e| Error::nats("create control consumer", e))?
        .messages()
        .await
        .map_err(|e| Error::nats("subscribe to control", e))
}

/// Receives control messages.
///
/// The ordered consumer it reads through is ephemeral: a restarted server has
/// forgotten it, and the client's ordered consumer then fails its pulls ("consumer
/// not found") without recreating itself. The receiver makes a new one that starts
/// after the last message it delivered, so nothing is lost or repeated.
pub struct NatsControlReceiver {
    stream: stream::Stream,
    messages: consumer::pull::Ordered,
    /// Stream sequence of the last message delivered (or before the first one this
    /// receiver may deliver).
    last_sequence: u64,
    max_message: usize,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for NatsControlReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsControlReceiver").field("max_message", &self.max_message).finish_non_exhaustive()
    }
}

impl NatsControlReceiver {
    /// This receiver's counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }
}

#[async_trait]
impl ControlReceiver for NatsControlReceiver {
    async fn recv(&mut self) -> metronome_core::Result<Option<ControlMessage>> {
        loop {
            let message = match self.messages.next().await {
                None => return Ok(None),
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "control stream interrupted; reading on from a new consumer");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let from =
                        consumer::DeliverPolicy::ByStartSequence { start_sequence: self.last_sequence + 1 };
                    match ordered_messages(&self.stream, from).await {
                        Ok(messages) => self.messages = messages,
                        Err(e) => tracing::debug!(error = %e, "control stream still interrupted"),
                    }
                    continue;
                }
            };
            if let Ok(info) = message.info() {
                self.last_sequence = info.stream_sequence;
            }
            let len = message.payload.len();
            let decoded =
                check_size("control", len, self.max_message).and_then(|()| decode_control(&message.payload));
            match decoded {
                Ok(m) => {
                    self.counters.received(len);
                    return Ok(Some(m));
                }
                Err(e) => {
                    self.counters.rejected(e.reason());
                    tracing::warn!(error = %e, "rejected a control message");
                }
            }
        }
    }
}
