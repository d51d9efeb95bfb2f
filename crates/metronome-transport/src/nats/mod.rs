//! The NATS JetStream transport, for rollout and training in different processes
//! or on different machines.
//!
//! - **Groups** are published to a durable work-queue stream, one message per group,
//!   with `Nats-Msg-Id` = `<period>-<prompt>` so that the server drops a re-sent group
//!   within its duplicate window. The stream holds at most `max_pending` unacknowledged
//!   groups and refuses more, which the sender answers by retrying with backoff: that
//!   is the backpressure when the trainer falls behind. The trainer reads through a
//!   durable pull consumer with explicit acknowledgement, acknowledges a group only
//!   after it accumulated it (the [`metronome_core::Delivery`] contract), and a group whose
//!   acknowledgement does not arrive within `ack_wait` is delivered again (to a
//!   restarted trainer, say). The receiver drops a key it has already delivered, so
//!   every group counts once.
//! - **Weights** are encoded ([`crate::wire::encode_weights`], xxh3 checksum inside)
//!   and stored in a JetStream object store under `v<version>` (the store chunks them
//!   below the server's maximum payload), then announced on a subject whose stream
//!   keeps only the last announcement. Subscribers read the last announcement, fetch
//!   that object, verify its checksum and cache it. Versions older than the newest
//!   `keep_versions` are deleted during each publication. The bucket lives in memory
//!   by default (`weights.storage`): the weights' source of truth is the trainer, the
//!   store only distributes them, and memory costs the server less CPU. A restarted
//!   server has lost them, so the publisher keeps its newest snapshot and uploads it
//!   again when its connection comes back (see [`NatsWeightPublisher`]); a
//!   publication interrupted by a restart starts again.
//! - **Streamed weights** (`weights.streaming`, on by default): before the first chunk
//!   the publisher sends a "begins" announcement on `<announce_subject>.begins`
//!   naming the chunk subject, size, chunk count and the format's checksum; the
//!   announcement stream keeps the last one, so that a subscriber that starts
//!   waiting after the upload began (a worker that took a claim offered meanwhile)
//!   finds it too. A subscriber inside `wait_for` that sees it reads the chunks
//!   with an ordered consumer from the first one while the upload runs, decodes them
//!   as they arrive, and checks size and checksum at the end, so publication and
//!   fetch overlap. No chunk for `stall_timeout_ms`, or a mismatch, is an error
//!   (counted by reason): the subscriber then returns the newest complete version if
//!   it is new enough, else the error; it never returns a partial snapshot and never
//!   waits for a publisher that died (nor follows that upload's kept begins again).
//!   If the connection dropped during the fetch, the publisher uploads again (see
//!   [`NatsWeightPublisher`]), so the subscriber keeps waiting instead. The object
//!   info and the ordinary announcement are still written, so a subscriber that
//!   joins later, `latest`, stock object store readers and older Metronome readers
//!   (which do not subscribe to the begins subject) read the complete object as
//!   before. The begins message carries a `format` number; a reader skips, and
//!   counts as `incompatible_version`, a format it does not know.
//! - **Control messages** go on their own stream, read by an ordered consumer per
//!   receiver, made again after a server restart from the last message it read.
//!
//! Streams and durable consumers are created when missing and brought to this
//! config's settings when an earlier run of the same name (or an older release)
//! left them with others (`max_pending`, `max_ack_pending`, ...); where the server
//! cannot change a setting in place (storage, retention), connecting fails with an
//! error naming the stream and the difference.
//!
//! Every message larger than the limit (the smaller of `max_message_bytes` and the
//! server's `max_payload`) is refused by the sender and by the receiver; a malformed
//! message is terminated (never redelivered), counted by reason, and skipped.
//!
//! The code follows these concerns: `config` (the serde settings), `connection`
//! (the client and the streams it brings to the config), `groups`, `weights`,
//! `control`, [`claims`] (the prompt claim queue of multi-process runs) and
//! `dead_letters`. Each endpoint is made by a method of [`NatsTransport`]; the
//! modules depend on `config`, `connection` and `dead_letters` only, never on each
//! other, except
//! [`NatsTransport::queued`] below, which spans the two work queues.

pub mod claims;
mod config;
mod connection;
mod control;
mod dead_letters;
mod groups;
mod weights;

pub use config::{
    ControlConfig, DeadLetterConfig, GroupStreamConfig, NatsAuth, NatsConfig, ReconnectConfig, Storage,
    TlsConfig, WeightStoreConfig,
};
pub use connection::NatsTransport;
pub use control::{NatsControlReceiver, NatsControlSender};
pub use groups::{NatsGroupReceiver, NatsGroupSender};
pub use weights::{NatsWeightPublisher, NatsWeightSubscriber};

use crate::{Error, Result};

/// The `transport` label of this transport's metrics.
const TRANSPORT: &str = "nats";

// The one method that reads both work queues (groups and claims).
impl NatsTransport {
    /// The messages the group stream and the claim queue hold now, by stream name
    /// (creating them when missing). A trainer starting a run from scratch expects
    /// none: any are left by an earlier run of the same name, and would be taken
    /// for this run's.
    pub async fn queued(&self) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        for mut stream in [self.group_stream().await?, self.claim_stream().await?] {
            let info = stream.info().await.map_err(|e| Error::nats("read stream state", e))?;
            out.push((info.config.name.clone(), info.state.messages));
        }
        Ok(out)
    }
}
