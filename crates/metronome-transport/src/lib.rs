//! Moving groups and weights between Metronome's stages: in one process over tokio
//! channels, or across processes and machines over NATS JetStream.
//!
//! A period needs three flows: scored groups from rollout to the trainer
//! ([`metronome_core::GroupSender`]/[`metronome_core::GroupReceiver`]), weight
//! snapshots from the trainer to rollout workers
//! ([`metronome_core::WeightPublisher`]/[`metronome_core::WeightSubscriber`]), and small
//! control messages that frame a period ([`ControlSender`]/[`ControlReceiver`] of
//! [`metronome_core::ControlMessage`]). This crate implements all three twice:
//!
//! - [`local`] (feature `local`, default): a bounded `mpsc` channel for groups (the
//!   sender waits when the trainer is `capacity` groups behind), a `watch` cell holding
//!   the newest `Arc<WeightSnapshot>`, and a broadcast for control;
//! - [`nats`] (feature `nats`, default): groups on a durable JetStream work queue,
//!   acknowledged only after accumulation and de-duplicated by (period, prompt); weights
//!   in the JetStream object store by version, announced on a subject, old versions
//!   pruned; connection options (URLs, token, user/password, creds file, TLS,
//!   reconnect backoff) and every stream name in a serde [`nats::NatsConfig`].
//!
//! With `nats`, [`claims`] adds the prompt claim queue of multi-process runs: the
//! trainer offers one claim per prompt, rollout workers take them under a lease, and
//! a dead worker's claims go to another worker when the lease expires.
//!
//! Both count a group once per (period, prompt) key, keep [`Stats`] and emit the
//! metrics of [`METRICS`]. The [`wire`] module defines the versioned binary formats:
//! one framing (header, format version, checksum) and a module per kind of message.
//! Both transports pass the transport suite of `metronome-testkit`
//! (`tests/it/conformance.rs`), as any future transport should.
//!
//! Both features are on by default, so `cargo test -p metronome-transport` runs the
//! NATS tests; they start a real `nats-server` (JetStream, loopback, free port) and
//! fail, rather than skip, when it is not installed (`apt-get install nats-server`,
//! or set `NATS_SERVER_BIN`).
//!
//! Weight snapshots go to the object store in its standard layout (any NATS client
//! can read them) but not through `ObjectStore::put`/`get`: the upload sends chunks
//! that borrow the tensor memory, pipelined, and the download decodes chunks straight
//! into the tensors ([`wire::WeightsDecoder`]), which removes two copies and a
//! SHA-256 pass from the path. A subscriber whose previous snapshot nobody holds
//! any more decodes the next one into its buffers, so a steady stream of versions
//! allocates nothing (the page faults of fresh memory cost as much as the copy).
//! Old versions are deleted while the new one uploads.
//!
//! What the weight path costs against a plain TCP transfer of the same bytes is in
//! the README's benchmark section (`cargo bench -p metronome-transport --
//! side_by_side`) and `docs/measurements.md`.
//!
//! This crate does not decide *when* to send: schedules, staleness limits and the
//! period loop belong to `metronome-pipeline`. It does not know tensors either:
//! snapshots are `metronome-core` host data produced by `metronome-trainer` and
//! installed by `metronome-rollout`. Its only Metronome dependency is `metronome-core`.

#[cfg(any(feature = "local", feature = "nats"))]
mod dedup;
mod error;
#[cfg(feature = "local")]
pub mod local;
mod metrics;
#[cfg(feature = "nats")]
pub mod nats;
/// The prompt claim queue, a part of the NATS transport kept at its own path.
#[cfg(feature = "nats")]
pub use nats::claims;
pub mod stats;
pub mod wire;

pub use error::{Error, Result};
pub use metrics::METRICS;
/// The control traits, at their old path: they are part of the contract in
/// `metronome-core` now, so that a third-party transport depends on it alone.
pub use metronome_core::{ControlReceiver, ControlSender};
pub use stats::Stats;
