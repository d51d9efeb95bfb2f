//! The NATS JetStream transport, for rollout and training in different processes
//! or on different machines.
//!
//! - **Groups** are published to a durable work-queue stream, one message per group,
//!   with `Nats-Msg-Id` = `<period>-<prompt>` so that the server drops a re-sent group
//!   within its duplicate window. The stream holds at most `max_pending` unacknowledged
//!   groups and refuses more, which the sender answers by retrying with backoff: that
//!   is the backpressure when the trainer falls behind. The trainer reads through a
//!   durable pull consumer with explicit acknowledgement, acknowledges a group only
//!   after it accumulated it (the [`Delivery`] contract), and a group whose
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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, object_store, stream};
use async_nats::{ConnectOptions, HeaderMap, ServerAddr};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use metronome_core::{
    Acker, ControlMessage, Delivery, GroupReceiver, GroupSender, HostTensor, PolicyVersion, ScoredGroup,
    Secret, WeightPublisher, WeightSnapshot, WeightSubscriber,
};
use serde::{Deserialize, Serialize};

use crate::dedup::{Admit, Dedup, KeyGuard};
use crate::stats::{Counters, Stats};
use crate::wire::{
    WeightsDecoder, check_size, decode_control, decode_group, encode_control, encode_group,
    encode_weights_chunks,
};
use crate::{ControlReceiver, ControlSender, Error, Result};

const TRANSPORT: &str = "nats";

/// How to reach NATS and where the transport keeps its streams. Every field has a
/// default, so `{}` (or `{"urls": ["nats://host:4222"]}`) is a valid config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URLs; the client picks among them and fails over on reconnect.
    pub urls: Vec<String>,
    /// Credentials.
    pub auth: NatsAuth,
    /// TLS settings.
    pub tls: TlsConfig,
    /// Reconnection behaviour.
    pub reconnect: ReconnectConfig,
    /// Time allowed to establish a connection, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Client name shown by the server's monitoring.
    pub client_name: Option<String>,
    /// The largest message (group or control) accepted by senders and receivers, in
    /// bytes; the server's own `max_payload` lowers it further.
    pub max_message_bytes: usize,
    /// How long a sender keeps retrying one publication (server down, stream full)
    /// before giving up, in milliseconds.
    pub publish_timeout_ms: u64,
    /// The group stream.
    pub groups: GroupStreamConfig,
    /// The weight store.
    pub weights: WeightStoreConfig,
    /// The control channel.
    pub control: ControlConfig,
    /// The prompt claim queue of multi-process runs ([`crate::claims`]).
    pub claims: crate::claims::ClaimQueueConfig,
    /// Where poison messages go for an operator to read.
    pub dead_letters: DeadLetterConfig,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            urls: vec!["nats://127.0.0.1:4222".to_owned()],
            auth: NatsAuth::None,
            tls: TlsConfig::default(),
            reconnect: ReconnectConfig::default(),
            connect_timeout_ms: 5_000,
            client_name: None,
            max_message_bytes: 1 << 20,
            publish_timeout_ms: 120_000,
            groups: GroupStreamConfig::default(),
            weights: WeightStoreConfig::default(),
            control: ControlConfig::default(),
            claims: crate::claims::ClaimQueueConfig::default(),
            dead_letters: DeadLetterConfig::default(),
        }
    }
}

impl NatsConfig {
    /// The default config with every stream, subject, consumer and bucket name
    /// prefixed by `prefix`, so that several runs can share one server.
    #[must_use]
    pub fn with_prefix(urls: Vec<String>, prefix: &str) -> Self {
        let upper = prefix.to_uppercase().replace(['.', '-', ' '], "_");
        let lower = prefix.to_lowercase().replace(['.', ' '], "_");
        Self {
            urls,
            groups: GroupStreamConfig {
                stream: format!("{upper}_GROUPS"),
                subject: format!("{lower}.groups"),
                consumer: format!("{lower}-trainer"),
                ..GroupStreamConfig::default()
            },
            weights: WeightStoreConfig {
                bucket: format!("{lower}-weights"),
                announce_stream: format!("{upper}_WEIGHTS"),
                announce_subject: format!("{lower}.weights"),
                ..WeightStoreConfig::default()
            },
            control: ControlConfig {
                stream: format!("{upper}_CONTROL"),
                subject: format!("{lower}.control"),
                ..ControlConfig::default()
            },
            claims: crate::claims::ClaimQueueConfig {
                stream: format!("{upper}_CLAIMS"),
                subject: format!("{lower}.claims"),
                consumer: format!("{lower}-workers"),
                ..crate::claims::ClaimQueueConfig::default()
            },
            dead_letters: DeadLetterConfig {
                stream: format!("{upper}_DEAD"),
                subject: format!("{lower}.dead"),
                ..DeadLetterConfig::default()
            },
            ..Self::default()
        }
    }
}

/// Credentials for the server.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A token.
    Token {
        /// The token (redacted wherever it would print).
        token: Secret,
    },
    /// A user name and password.
    UserPassword {
        /// The user.
        user: String,
        /// The password (redacted wherever it would print).
        password: Secret,
    },
    /// A `.creds` file (JWT and NKey seed), as issued by `nsc`.
    CredsFile {
        /// The file.
        path: PathBuf,
    },
}

/// TLS settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// Refuse to talk to a server without TLS.
    pub required: bool,
    /// PEM file of the certificate authorities to trust (besides the system roots).
    pub root_certificates: Option<PathBuf>,
    /// PEM client certificate, for servers that verify clients (with `client_key`).
    pub client_certificate: Option<PathBuf>,
    /// PEM client key.
    pub client_key: Option<PathBuf>,
}

/// Reconnection with exponential backoff.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReconnectConfig {
    /// Delay before the second attempt, in milliseconds; it doubles per attempt.
    pub initial_delay_ms: u64,
    /// The longest delay between attempts, in milliseconds.
    pub max_delay_ms: u64,
    /// Give up after this many attempts; `None` retries forever.
    pub max_attempts: Option<usize>,
}

impl Default for ReconnectConfig {
    fn default() -> Self {
        Self { initial_delay_ms: 50, max_delay_ms: 5_000, max_attempts: None }
    }
}

impl ReconnectConfig {
    /// The delay before attempt number `attempt` (1-based): none for the first, then
    /// doubling from `initial_delay_ms` up to `max_delay_ms`.
    #[must_use]
    pub fn delay(&self, attempt: usize) -> Duration {
        if attempt <= 1 {
            return Duration::ZERO;
        }
        let shift = (attempt - 2).min(20) as u32;
        Duration::from_millis(self.initial_delay_ms.saturating_mul(1 << shift).min(self.max_delay_ms))
    }
}

/// Where JetStream keeps a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    /// On disk: survives a server restart.
    #[default]
    File,
    /// In memory: faster, lost on restart.
    Memory,
}

impl From<Storage> for stream::StorageType {
    fn from(s: Storage) -> Self {
        match s {
            Storage::File => stream::StorageType::File,
            Storage::Memory => stream::StorageType::Memory,
        }
    }
}

/// The group stream and the trainer's consumer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GroupStreamConfig {
    /// Stream name.
    pub stream: String,
    /// Subject groups are published on.
    pub subject: String,
    /// Durable consumer name of the trainer.
    pub consumer: String,
    /// Unacknowledged groups are redelivered after this many milliseconds; longer
    /// than the trainer may take to accumulate one group.
    pub ack_wait_ms: u64,
    /// Groups the stream holds before senders must wait (backpressure). A trainer
    /// holds a whole period's groups until its checkpoint, so this must be at least
    /// the groups of one period (the pipeline checks it against the prompts per period).
    pub max_pending: i64,
    /// Groups the trainer's consumer may hold delivered and unacknowledged; the
    /// server delivers no more until some are acknowledged. At least one period's
    /// groups, like `max_pending` (the server's own default, 1000, stalled a trainer
    /// of larger periods).
    pub max_ack_pending: i64,
    /// Window in which the server drops a group re-sent with the same key, in milliseconds.
    pub duplicate_window_ms: u64,
    /// How many periods behind the newest the receiver remembers delivered keys.
    pub dedup_window_periods: u64,
    /// Storage.
    pub storage: Storage,
}

impl Default for GroupStreamConfig {
    fn default() -> Self {
        Self {
            stream: "METRONOME_GROUPS".to_owned(),
            subject: "metronome.groups".to_owned(),
            consumer: "metronome-trainer".to_owned(),
            ack_wait_ms: 300_000,
            max_pending: 4_096,
            max_ack_pending: 4_096,
            duplicate_window_ms: 600_000,
            dedup_window_periods: crate::dedup::DEFAULT_WINDOW_PERIODS,
            storage: Storage::File,
        }
    }
}

/// The weight object store and its announcements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WeightStoreConfig {
    /// Object store bucket.
    pub bucket: String,
    /// Stream holding the last announcement.
    pub announce_stream: String,
    /// Subject of announcements.
    pub announce_subject: String,
    /// How many of the newest versions stay in the store.
    pub keep_versions: u64,
    /// Object store chunk size in bytes (lowered to the server's `max_payload`).
    pub chunk_bytes: usize,
    /// Storage of the bucket and its announcements. `memory` (the default) costs the
    /// server about 100 ms less CPU per 100 MB than `file` and brings publish plus
    /// fetch within 2× of one TCP transfer (`cargo bench -p metronome-transport --
    /// side_by_side`);
    /// it needs `keep_versions` snapshots of the server's memory (JetStream
    /// `max_memory_store`), and a restarted server holds no weights until the
    /// publisher uploads its newest again, which it does on reconnecting. `file`
    /// keeps them on disk, for snapshots larger than the server's memory.
    pub storage: Storage,
    /// Also compute the SHA-256 digest that the object store format records, so that
    /// stock NATS object store readers (`nats object get`, `ObjectStore::get`), which
    /// refuse an object without one, can read the snapshots. Metronome's own reader
    /// does not need it: the weights format carries an xxh3-64 checksum of its body,
    /// checked on every fetch. Off (the default) saves one SHA-256 pass over the
    /// snapshot on the publisher (60 ms of CPU per 100 MB on the bench machine, a
    /// fifth of what publish and fetch take).
    pub object_store_digest: bool,
    /// Announce each version on `<announce_subject>.begins` before its chunks are
    /// uploaded, so that subscribers waiting for it (`wait_for`) decode the chunks as
    /// they arrive and publication and fetch overlap. The object and its ordinary
    /// announcement are written as without it; a subscriber that joins later, or an
    /// older one, reads the complete object.
    pub streaming: bool,
    /// How long a streamed fetch waits for the next chunk before it gives up (the
    /// publisher died or is stuck) and falls back to the newest complete version, in
    /// milliseconds.
    pub stall_timeout_ms: u64,
}

impl Default for WeightStoreConfig {
    fn default() -> Self {
        Self {
            bucket: "metronome-weights".to_owned(),
            announce_stream: "METRONOME_WEIGHTS".to_owned(),
            announce_subject: "metronome.weights".to_owned(),
            keep_versions: 2,
            chunk_bytes: 1 << 20,
            storage: Storage::Memory,
            object_store_digest: false,
            streaming: true,
            stall_timeout_ms: 10_000,
        }
    }
}

/// The control channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlConfig {
    /// Stream name.
    pub stream: String,
    /// Subject.
    pub subject: String,
    /// A new receiver first gets the last message sent before it subscribed (so a
    /// worker joining mid-period learns the period), instead of only newer ones.
    pub replay_last: bool,
    /// Storage.
    pub storage: Storage,
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self {
            stream: "METRONOME_CONTROL".to_owned(),
            subject: "metronome.control".to_owned(),
            replay_last: false,
            storage: Storage::File,
        }
    }
}

/// The dead-letter stream: messages that can never be processed (undecodable, or
/// refused by the trainer: a group for a period or weights version it is not
/// training, or one that does not pack) are terminated on their own stream and a
/// copy is kept here, on `<subject>.<kind>` (`group`, `claim`), with the headers
/// `Metronome-Reason` (what was wrong) and `Metronome-Subject` (where it came from).
/// `nats stream view <stream>` shows them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeadLetterConfig {
    /// Stream name.
    pub stream: String,
    /// Subject prefix.
    pub subject: String,
    /// The newest this many dead letters are kept.
    pub max_messages: i64,
}

impl Default for DeadLetterConfig {
    fn default() -> Self {
        Self {
            stream: "METRONOME_DEAD".to_owned(),
            subject: "metronome.dead".to_owned(),
            max_messages: 10_000,
        }
    }
}

/// A connection to NATS from which every endpoint is made.
#[derive(Clone, Debug)]
pub struct NatsTransport {
    client: async_nats::Client,
    js: jetstream::Context,
    config: Arc<NatsConfig>,
    max_message: usize,
    /// Counts the connections made (the first and every reconnection), so that a
    /// weight publisher can check what a restarted server still holds.
    connections: tokio::sync::watch::Receiver<u64>,
}

impl NatsTransport {
    /// Connects with `config`.
    pub async fn connect(config: NatsConfig) -> Result<Self> {
        let config = Arc::new(config);
        if config.urls.is_empty() {
            return Err(Error::Config { field: "urls", reason: "no server URL given".into() });
        }
        let addrs = config
            .urls
            .iter()
            .map(|u| {
                u.parse::<ServerAddr>()
                    .map_err(|e| Error::Config { field: "urls", reason: format!("cannot parse {u:?}: {e}") })
            })
            .collect::<Result<Vec<_>>>()?;
        let reconnect = config.reconnect.clone();
        let mut options = ConnectOptions::new()
            .connection_timeout(Duration::from_millis(config.connect_timeout_ms))
            .max_reconnects(config.reconnect.max_attempts)
            .reconnect_delay_callback(move |attempt| reconnect.delay(attempt));
        options = match &config.auth {
            NatsAuth::None => options,
            NatsAuth::Token { token } => options.token(token.expose().to_owned()),
            NatsAuth::UserPassword { user, password } => {
                options.user_and_password(user.clone(), password.expose().to_owned())
            }
            NatsAuth::CredsFile { path } => {
                options.credentials_file(path).await.map_err(|e| Error::Config {
                    field: "auth.path",
                    reason: format!("cannot read credentials file {}: {e}", path.display()),
                })?
            }
        };
        if config.tls.required {
            options = options.require_tls(true);
        }
        if let Some(roots) = &config.tls.root_certificates {
            options = options.add_root_certificates(roots.clone());
        }
        match (&config.tls.client_certificate, &config.tls.client_key) {
            (Some(cert), Some(key)) => options = options.add_client_certificate(cert.clone(), key.clone()),
            (None, None) => {}
            _ => {
                return Err(Error::Config {
                    field: "tls.client_certificate",
                    reason: "client_certificate and client_key must be given together".into(),
                });
            }
        }
        if let Some(name) = &config.client_name {
            options = options.name(name);
        }
        let (connected, connections) = tokio::sync::watch::channel(0u64);
        let connected = Arc::new(connected);
        options = options.event_callback(move |event| {
            let connected = Arc::clone(&connected);
            async move {
                if matches!(event, async_nats::Event::Connected) {
                    connected.send_modify(|n| *n += 1);
                }
            }
        });
        let client = options.connect(addrs).await.map_err(|e| Error::nats("connect", e))?;
        let max_message = config.max_message_bytes.min(client.server_info().max_payload.max(1));
        let js = jetstream::new(client.clone());
        Ok(Self { client, js, config, max_message, connections })
    }

    /// The underlying client.
    #[must_use]
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The effective message size limit in bytes.
    #[must_use]
    pub fn max_message_bytes(&self) -> usize {
        self.max_message
    }

    /// The config this transport was made with.
    #[must_use]
    pub fn config(&self) -> &NatsConfig {
        &self.config
    }

    /// The JetStream context.
    pub(crate) fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    async fn group_stream(&self) -> Result<stream::Stream> {
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

    /// Keeps a copy of a poison message of `kind` that came on `subject` on the
    /// dead-letter stream, with `reason`, and counts it
    /// (`metronome_transport_dead_letters_total`). Best effort: a failure is logged,
    /// since the message is terminated either way.
    pub(crate) async fn dead_letter(&self, kind: &'static str, subject: &str, reason: &str, payload: Bytes) {
        metrics::counter!("metronome_transport_dead_letters_total", "transport" => TRANSPORT, "kind" => kind)
            .increment(1);
        let c = &self.config.dead_letters;
        let config = stream::Config {
            name: c.stream.clone(),
            subjects: vec![format!("{}.>", c.subject)],
            max_messages: c.max_messages,
            storage: stream::StorageType::File,
            ..stream::Config::default()
        };
        let mut headers = HeaderMap::new();
        // Header values are one line.
        headers.insert("Metronome-Reason", reason.replace(['\r', '\n'], " ").as_str());
        headers.insert("Metronome-Subject", subject);
        let kept = async {
            ensure_stream(&self.js, config, "create dead-letter stream").await?;
            let subject = format!("{}.{kind}", c.subject);
            self.publish_durably("keep a dead letter", &subject, Some(headers), payload).await
        };
        if let Err(e) = kept.await {
            tracing::warn!(error = %e, kind, reason, "could not keep a dead letter");
        }
    }

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
            messages,
            max_message: self.max_message,
            dedup: Dedup::new(c.dedup_window_periods),
            counters: Arc::new(Counters::new(TRANSPORT, "group")),
        })
    }

    async fn weight_store(&self) -> Result<(object_store::ObjectStore, stream::Stream)> {
        let c = &self.config.weights;
        let store = match self.js.get_object_store(&c.bucket).await {
            Ok(store) => store,
            Err(_) => self
                .js
                .create_object_store(object_store::Config {
                    bucket: c.bucket.clone(),
                    storage: c.storage.into(),
                    ..object_store::Config::default()
                })
                .await
                .map_err(|e| Error::nats("create weight bucket", e))?,
        };
        let config = stream::Config {
            name: c.announce_stream.clone(),
            // The begins announcements are kept too, for subscribers that start
            // waiting after an upload began.
            subjects: vec![c.announce_subject.clone(), begins_subject(&c.announce_subject)],
            max_messages_per_subject: 1,
            storage: c.storage.into(),
            ..stream::Config::default()
        };
        let announce = ensure_stream(&self.js, config, "create weight announcement stream").await?;
        Ok((store, announce))
    }

    /// A weight publisher (creates the bucket and the announcement stream when missing).
    pub async fn weight_publisher(&self) -> Result<NatsWeightPublisher> {
        let (store, announce) = self.weight_store().await?;
        Ok(NatsWeightPublisher::new(self, store, announce))
    }

    /// A weight subscriber.
    pub async fn weight_subscriber(&self) -> Result<NatsWeightSubscriber> {
        let (store, announce) = self.weight_store().await?;
        Ok(NatsWeightSubscriber {
            transport: self.clone(),
            store,
            announce,
            cached: None,
            counters: Arc::new(Counters::new(TRANSPORT, "weights")),
            streamed: 0,
            failed_upload: None,
        })
    }

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

    /// Publishes `payload` on `subject` and waits for the stream's acknowledgement,
    /// retrying with backoff while the server is unreachable or the stream is full,
    /// up to `publish_timeout_ms`.
    pub(crate) async fn publish_durably(
        &self,
        op: &'static str,
        subject: &str,
        headers: Option<HeaderMap>,
        payload: Bytes,
    ) -> Result<()> {
        let deadline = Instant::now() + Duration::from_millis(self.config.publish_timeout_ms);
        let mut attempt = 0usize;
        loop {
            attempt += 1;
            let published = match &headers {
                Some(h) => self.js.publish_with_headers(subject.to_owned(), h.clone(), payload.clone()).await,
                None => self.js.publish(subject.to_owned(), payload.clone()).await,
            };
            let error = match published {
                Ok(ack) => match ack.await {
                    Ok(_) => return Ok(()),
                    Err(e) => e,
                },
                Err(e) => e,
            };
            use jetstream::context::PublishErrorKind as K;
            let retriable =
                !matches!(error.kind(), K::MaxPayloadExceeded | K::WrongLastMessageId | K::WrongLastSequence);
            if !retriable || Instant::now() >= deadline {
                return Err(Error::nats(op, error));
            }
            tracing::debug!(%error, attempt, "{op}: retrying");
            let backoff = Duration::from_millis(10u64.saturating_mul(1 << attempt.min(6)));
            tokio::time::sleep(backoff).await;
        }
    }
}

/// The stream `config.name`: created when missing; when a stream of that name exists
/// with other settings (left by an earlier run of the same name, or an older
/// release), updated to these, and when the server refuses the update (retention
/// and storage cannot change), an error naming the stream and what differs, instead
/// of a run that fails later in a confusing way.
pub(crate) async fn ensure_stream(
    js: &jetstream::Context,
    config: stream::Config,
    what: &'static str,
) -> Result<stream::Stream> {
    let mut existing = match js.get_stream(&config.name).await {
        Ok(stream) => stream,
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            return js.get_or_create_stream(config).await.map_err(|e| Error::nats(what, e));
        }
        Err(e) => return Err(Error::nats(what, e)),
    };
    let found = &existing.cached_info().config;
    let differences = stream_differences(found, &config);
    if differences.is_empty() {
        return Ok(existing);
    }
    tracing::warn!(stream = %config.name, %differences, "updating a stream left with other settings");
    match js.update_stream(&config).await {
        Ok(_) => {
            existing.info().await.map_err(|e| Error::nats(what, e))?;
            Ok(existing)
        }
        Err(e) => {
            Err(Error::Leftover { what: "stream", name: config.name, differences, reason: e.to_string() })
        }
    }
}

/// The settings Metronome chooses that differ between `found` and `wanted`, as
/// `field: found -> wanted`; empty when none do. The message size limit is left
/// out: every process enforces its own (`max_message_bytes`) on what it sends and
/// receives, and two processes with different limits must not take turns
/// rewriting the stream's.
fn stream_differences(found: &stream::Config, wanted: &stream::Config) -> String {
    let mut out = Vec::new();
    let mut check = |field: &str, a: String, b: String| {
        if a != b {
            out.push(format!("{field}: {a} -> {b}"));
        }
    };
    check("subjects", format!("{:?}", found.subjects), format!("{:?}", wanted.subjects));
    check("retention", format!("{:?}", found.retention), format!("{:?}", wanted.retention));
    check("storage", format!("{:?}", found.storage), format!("{:?}", wanted.storage));
    check("discard", format!("{:?}", found.discard), format!("{:?}", wanted.discard));
    // The server reports "no limit" as -1 where a config leaves 0.
    let limit = |v: i64| if v <= 0 { "none".to_owned() } else { v.to_string() };
    check("max_messages", limit(found.max_messages), limit(wanted.max_messages));
    check(
        "max_messages_per_subject",
        limit(found.max_messages_per_subject),
        limit(wanted.max_messages_per_subject),
    );
    // A zero window is the server's default (two minutes).
    if !wanted.duplicate_window.is_zero() {
        check(
            "duplicate_window",
            format!("{:?}", found.duplicate_window),
            format!("{:?}", wanted.duplicate_window),
        );
    }
    out.join(", ")
}

/// The durable pull consumer `name` of `stream` with explicit acknowledgement, an
/// acknowledgement timeout of `ack_wait_ms` (the redelivery delay of an
/// unacknowledged message) and at most `max_ack_pending` messages delivered and not
/// yet acknowledged (the server delivers no more until some are). Created when
/// missing, updated to these settings when an earlier run left it with others (the
/// server's default of 1000 pending would stall a trainer that holds a larger
/// period unacknowledged), shared by every client that names it.
pub(crate) async fn durable_consumer(
    stream: &stream::Stream,
    name: &str,
    ack_wait_ms: u64,
    max_ack_pending: i64,
    what: &'static str,
) -> Result<consumer::PullConsumer> {
    let config = consumer::pull::Config {
        durable_name: Some(name.to_owned()),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_millis(ack_wait_ms),
        max_ack_pending,
        ..consumer::pull::Config::default()
    };
    stream.create_consumer(config).await.map_err(|e| match e.kind() {
        stream::ConsumerErrorKind::JetStream(_) => Error::Leftover {
            what: "consumer",
            name: name.to_owned(),
            differences: format!("wanted ack_wait {ack_wait_ms} ms, max_ack_pending {max_ack_pending}"),
            reason: e.to_string(),
        },
        _ => Error::nats(what, e),
    })
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
/// [`ControlMessage::Shutdown`].
pub struct NatsGroupReceiver {
    transport: NatsTransport,
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
        self.acker.double_ack().await.map_err(|e| Error::Nats { op: "acknowledge group", source: e })?;
        self.guard.acked();
        Ok(())
    }

    async fn reject(self: Box<Self>, reason: &str) -> metronome_core::Result<()> {
        let subject = self.transport.config.groups.subject.clone();
        self.transport.dead_letter("group", &subject, reason, self.payload.clone()).await;
        self.acker
            .ack_with(jetstream::AckKind::Term)
            .await
            .map_err(|e| Error::Nats { op: "terminate a rejected group", source: e })?;
        // Counted once: a copy re-sent with the same key is not delivered again.
        self.guard.acked();
        Ok(())
    }
}

#[async_trait]
impl GroupReceiver for NatsGroupReceiver {
    async fn recv(&mut self) -> metronome_core::Result<Option<Delivery>> {
        loop {
            let message = match self.messages.next().await {
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

/// What an announcement says: the newest version and where to find it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Announcement {
    version: u64,
    object: String,
    bytes: u64,
}

/// The format of [`Begins`]; a reader skips (and counts) any other.
const BEGINS_FORMAT: u32 = 1;

/// What a "begins" announcement says: a version's chunks are being uploaded now, on
/// `$O.<bucket>.C.<nuid>`, and what they add up to. Published on
/// `<announce_subject>.begins` before the first chunk, without waiting for the
/// server (the announcement stream keeps the last one); the ordinary
/// [`Announcement`] follows once the object is complete.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Begins {
    /// [`BEGINS_FORMAT`] of the writer.
    format: u32,
    version: u64,
    object: String,
    bucket: String,
    nuid: String,
    /// Total bytes of the encoded snapshot.
    bytes: u64,
    chunks: u64,
    /// The weights format's xxh3-64 checksum of the body (header bytes 16..24).
    checksum: u64,
}

fn begins_subject(announce_subject: &str) -> String {
    format!("{announce_subject}.begins")
}

fn object_name(version: PolicyVersion) -> String {
    format!("v{:020}", version.0)
}

/// A fresh token naming one upload's chunk subject (the object store calls it the
/// nuid): unique per process, time and object.
fn object_nuid(name: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let seed = format!("{name}/{}/{nanos}/{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("{:016x}{:016x}", xxhash_rust::xxh3::xxh3_64(seed.as_bytes()), metronome_core::mix64(nanos))
}

/// Base64 with the URL-safe alphabet and padding, as the object store encodes names
/// and digests.
fn base64_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let b = [group[0], group.get(1).copied().unwrap_or(0), group.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= group.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

async fn last_announcement(announce: &stream::Stream, subject: &str) -> Result<Option<Announcement>> {
    match announce.get_last_raw_message_by_subject(subject).await {
        Ok(m) => serde_json::from_slice(&m.payload).map(Some).map_err(|e| Error::Malformed {
            kind: "weights announcement",
            field: "body".into(),
            reason: e.to_string(),
        }),
        Err(e) => match e.kind() {
            // Nothing announced yet, or a restarted server that held the announcements
            // in memory: nothing to fetch until the publisher uploads again.
            stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
            stream::LastRawMessageErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(None)
            }
            _ => Err(Error::nats("read weight announcement", e)),
        },
    }
}

/// The last begins announcement kept by the announcement stream, if any (a stream
/// made by an older version does not keep them; then only live ones are seen).
async fn last_begins(announce: &stream::Stream, subject: &str) -> Option<Bytes> {
    match announce.get_last_raw_message_by_subject(subject).await {
        Ok(m) => Some(m.payload),
        Err(e) => {
            tracing::debug!(error = %e, "no kept weight begins announcement");
            None
        }
    }
}

/// Publishes weight snapshots to the object store.
///
/// With the bucket in memory (`weights.storage = memory`, the default) a restarted
/// server holds no weights. The publisher keeps its newest snapshot (a reference to
/// the caller's, not a copy) and, whenever its connection comes back, uploads it
/// again if the server no longer announces it: workers waiting for that version get
/// it, instead of waiting for a next publication that their own work blocks
/// (`metronome_transport_weights_restored_total`).
pub struct NatsWeightPublisher {
    state: Arc<PublisherState>,
    /// Watches reconnections and restores the newest snapshot; ends with the
    /// publisher.
    restorer: tokio::task::JoinHandle<()>,
}

struct PublisherState {
    transport: NatsTransport,
    store: object_store::ObjectStore,
    announce: stream::Stream,
    counters: Arc<Counters>,
    /// Chunk subjects of uploads whose future was dropped (task aborted, timeout):
    /// purged by the next publication.
    abandoned: Arc<std::sync::Mutex<Vec<String>>>,
    /// Held for the whole of a publication, so that a restoring upload and the
    /// caller's never interleave; holds the newest snapshot published when the bucket
    /// lives in memory.
    newest: tokio::sync::Mutex<Option<Arc<WeightSnapshot>>>,
}

/// Records an upload's chunk subject in `abandoned` unless it was finished (or
/// cleaned up), so that a dropped publication does not leave its chunks forever.
struct UploadGuard {
    subject: Option<String>,
    abandoned: Arc<std::sync::Mutex<Vec<String>>>,
}

impl UploadGuard {
    fn done(mut self) {
        self.subject = None;
    }
}

impl Drop for UploadGuard {
    fn drop(&mut self) {
        if let Some(subject) = self.subject.take()
            && let Ok(mut abandoned) = self.abandoned.lock()
        {
            abandoned.push(subject);
        }
    }
}

impl std::fmt::Debug for NatsWeightPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsWeightPublisher")
            .field("bucket", &self.state.transport.config.weights.bucket)
            .finish_non_exhaustive()
    }
}

impl Drop for NatsWeightPublisher {
    fn drop(&mut self) {
        self.restorer.abort();
    }
}

impl NatsWeightPublisher {
    fn new(transport: &NatsTransport, store: object_store::ObjectStore, announce: stream::Stream) -> Self {
        let state = Arc::new(PublisherState {
            transport: transport.clone(),
            store,
            announce,
            counters: Arc::new(Counters::new(TRANSPORT, "weights")),
            abandoned: Arc::default(),
            newest: tokio::sync::Mutex::new(None),
        });
        let mut connections = transport.connections.clone();
        connections.borrow_and_update();
        let weak = Arc::downgrade(&state);
        let restorer = tokio::spawn(async move {
            while connections.changed().await.is_ok() {
                let Some(state) = weak.upgrade() else { break };
                state.restore().await;
            }
        });
        Self { state, restorer }
    }

    /// This publisher's counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.state.counters.snapshot()
    }
}

impl PublisherState {
    /// Publishes `snapshot`, holding the publication lock.
    async fn publish(&self, snapshot: Arc<WeightSnapshot>) -> Result<()> {
        let mut newest = self.newest.lock().await;
        self.publish_retrying(Arc::clone(&snapshot)).await?;
        if self.transport.config.weights.storage == Storage::Memory {
            *newest = Some(snapshot);
        }
        Ok(())
    }

    /// Uploads and announces `snapshot`, starting again after a failure of the
    /// connection or the server (a restart mid-upload; the partial chunks are purged)
    /// until `publish_timeout_ms`, as group sends do.
    async fn publish_retrying(&self, snapshot: Arc<WeightSnapshot>) -> Result<()> {
        let deadline = Instant::now() + Duration::from_millis(self.transport.config.publish_timeout_ms);
        loop {
            match self.publish_snapshot(Arc::clone(&snapshot)).await {
                Err(e @ Error::Nats { .. }) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, version = %snapshot.version, "weight publication failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    // A restarted server has lost a bucket that lived in memory.
                    if let Err(e) = self.transport.weight_store().await {
                        tracing::debug!(error = %e, "weight bucket not available yet");
                    }
                }
                done => return done,
            }
        }
    }

    /// After a reconnection: uploads the newest snapshot again if the server does not
    /// announce it any more (a restarted server that kept its weights in memory).
    async fn restore(&self) {
        let newest = self.newest.lock().await;
        let Some(snapshot) = newest.clone() else { return };
        let subject = &self.transport.config.weights.announce_subject;
        if let Ok(Some(a)) = last_announcement(&self.announce, subject).await
            && a.version >= snapshot.version.0
        {
            return;
        }
        match self.publish_retrying(Arc::clone(&snapshot)).await {
            Ok(()) => {
                tracing::info!(version = %snapshot.version, "uploaded the newest weights again: the server had lost them");
                metrics::counter!("metronome_transport_weights_restored_total", "transport" => TRANSPORT)
                    .increment(1);
            }
            Err(error) => {
                tracing::warn!(%error, version = %snapshot.version, "could not upload the newest weights again after a reconnection");
            }
        }
    }

    async fn publish_snapshot(&self, snapshot: Arc<WeightSnapshot>) -> Result<()> {
        let start = Instant::now();
        let c = &self.transport.config.weights;
        let announced = last_announcement(&self.announce, &c.announce_subject).await?.map(|a| a.version);
        if let Some(newest) = announced
            && newest > snapshot.version.0
        {
            return Err(Error::StaleVersion { version: snapshot.version.0, newest });
        }
        let version = snapshot.version;
        let name = object_name(version);
        let chunk = c.chunk_bytes.clamp(1024, self.transport.client.server_info().max_payload.max(1024));
        // Versions older than the newest `keep_versions` go while the new one uploads
        // (deleting a 100 MB version took the server 10 to 90 ms on loopback, beside an
        // upload of 110 to 230 ms), all but the version announced now, which readers
        // may still be fetching: it goes after the new announcement, if it falls out of
        // the window (`keep_versions` = 1).
        let oldest_kept = version.0.saturating_sub(c.keep_versions.max(1) - 1);
        let early = oldest_kept.min(announced.unwrap_or(0));
        let size = self.put_object(&name, snapshot, chunk, early).await?;
        let announcement = Announcement { version: version.0, object: name, bytes: size as u64 };
        let payload = serde_json::to_vec(&announcement).map_err(|e| Error::nats("encode announcement", e))?;
        self.transport.publish_durably("announce weights", &c.announce_subject, None, payload.into()).await?;
        self.counters.sent(size, start.elapsed());
        if announced.is_some_and(|a| a < oldest_kept) {
            self.prune(oldest_kept).await;
        }
        Ok(())
    }

    /// Stores the snapshot as object `name` in the bucket, in the object store's layout
    /// (chunks on `$O.<bucket>.C.<nuid>`, then the info on `$O.<bucket>.M.<name>`) so
    /// that any NATS object store client can read it. Unlike `ObjectStore::put`, the
    /// chunks borrow the tensor data instead of copying it, and are pipelined: the
    /// next chunk is sent while earlier acknowledgements are in flight. The SHA-256
    /// digest stock readers check (`weights.object_store_digest`) is computed on a
    /// blocking thread meanwhile, and the versions older than `prune_below` are
    /// deleted. Returns the object's size.
    async fn put_object(
        &self,
        name: &str,
        snapshot: Arc<WeightSnapshot>,
        chunk: usize,
        prune_below: u64,
    ) -> Result<usize> {
        const IN_FLIGHT: usize = 32;
        let bucket = &self.transport.config.weights.bucket;
        let abandoned = std::mem::take(&mut *self.abandoned.lock().unwrap_or_else(|e| e.into_inner()));
        for subject in abandoned {
            self.purge_chunks(&subject).await;
        }
        let previous = self.store.info(name).await.ok();
        let chunks = {
            let snapshot = Arc::clone(&snapshot);
            tokio::task::spawn_blocking(move || encode_weights_chunks(&snapshot, chunk))
                .await
                .map_err(|e| Error::nats("encode weights", e))??
        };
        let size: usize = chunks.iter().map(Bytes::len).sum();
        // The digest is computed on a blocking thread while the chunks are sent.
        let digest = self.transport.config.weights.object_store_digest.then(|| {
            let chunks = chunks.clone();
            tokio::task::spawn_blocking(move || {
                use sha2::Digest;
                let mut sha = sha2::Sha256::new();
                chunks.iter().for_each(|c| sha.update(c));
                format!("SHA-256={}", base64_url(&sha.finalize()))
            })
        });
        let nuid = object_nuid(name);
        let chunk_subject = format!("$O.{bucket}.C.{nuid}");
        let guard =
            UploadGuard { subject: Some(chunk_subject.clone()), abandoned: Arc::clone(&self.abandoned) };
        let count = chunks.len();
        if self.transport.config.weights.streaming {
            let checksum = chunks
                .first()
                .and_then(|c| c.get(16..24))
                .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
            let begins = Begins {
                format: BEGINS_FORMAT,
                version: snapshot.version.0,
                object: name.to_owned(),
                bucket: bucket.clone(),
                nuid: nuid.clone(),
                bytes: size as u64,
                chunks: count as u64,
                checksum,
            };
            let payload = serde_json::to_vec(&begins).map_err(|e| Error::nats("encode begins", e))?;
            let subject = begins_subject(&self.transport.config.weights.announce_subject);
            // Best effort: a subscriber that misses it waits for the complete object.
            if let Err(e) = self.transport.client.publish(subject, payload.into()).await {
                tracing::debug!(error = %e, "could not announce the upload of weights");
            }
        }
        let mut acks = std::collections::VecDeque::with_capacity(IN_FLIGHT);
        let sent = async {
            for c in chunks {
                if acks.len() >= IN_FLIGHT
                    && let Some(ack) = acks.pop_front()
                {
                    let ack: jetstream::context::PublishAckFuture = ack;
                    ack.await.map_err(|e| Error::nats("store weight chunk", e))?;
                }
                let ack = self
                    .transport
                    .js
                    .publish(chunk_subject.clone(), c)
                    .await
                    .map_err(|e| Error::nats("store weight chunk", e))?;
                acks.push_back(ack);
            }
            for ack in acks.drain(..) {
                ack.await.map_err(|e| Error::nats("store weight chunk", e))?;
            }
            Result::Ok(())
        };
        // The old versions are deleted while the chunks go, and before the new info is
        // written: listing the bucket while an info is written beside it was seen to
        // never end (the list waits for a pending count of 0).
        let (sent, ()) = tokio::join!(sent, self.prune(prune_below));
        if let Err(e) = sent {
            self.purge_chunks(&chunk_subject).await;
            return Err(e);
        }
        let digest = match digest {
            Some(d) => Some(d.await.map_err(|e| Error::nats("hash weights", e))?),
            None => None,
        };
        let info = object_store::ObjectInfo {
            name: name.to_owned(),
            description: Some(format!("metronome weight snapshot version {}", snapshot.version)),
            metadata: std::collections::HashMap::new(),
            headers: None,
            options: Some(object_store::ObjectOptions { link: None, max_chunk_size: Some(chunk) }),
            bucket: bucket.clone(),
            nuid,
            size,
            chunks: count,
            modified: None,
            digest,
            deleted: false,
        };
        let payload = serde_json::to_vec(&info).map_err(|e| Error::nats("encode object info", e))?;
        let mut headers = HeaderMap::new();
        headers.insert(async_nats::header::NATS_ROLLUP, "sub");
        let meta_subject = format!("$O.{bucket}.M.{}", base64_url(name.as_bytes()));
        if let Err(e) = self
            .transport
            .publish_durably("store weight info", &meta_subject, Some(headers), payload.into())
            .await
        {
            self.purge_chunks(&chunk_subject).await;
            return Err(e);
        }
        guard.done();
        if let Some(previous) = previous {
            self.purge_chunks(&format!("$O.{bucket}.C.{}", previous.nuid)).await;
        }
        Ok(size)
    }

    async fn object_stream(&self) -> Result<stream::Stream> {
        let name = format!("OBJ_{}", self.transport.config.weights.bucket);
        self.transport
            .js
            .get_stream(name)
            .await
            .map_err(|e| Error::nats("open the weight bucket's stream", e))
    }

    /// Removes the chunks of an object that was replaced or never completed; a
    /// failure only costs space.
    async fn purge_chunks(&self, subject: &str) {
        let purged = match self.object_stream().await {
            Ok(stream) => {
                stream.purge().filter(subject).await.map(drop).map_err(|e| Error::nats("purge chunks", e))
            }
            Err(e) => Err(e),
        };
        if let Err(e) = purged {
            tracing::warn!(error = %e, subject, "could not purge weight chunks");
        }
    }

    /// Deletes the versions older than `below`; a failure only costs space, so it is
    /// logged, not returned.
    async fn prune(&self, below: u64) {
        if below == 0 {
            return;
        }
        let mut names = Vec::new();
        match self.store.list().await {
            Ok(mut list) => {
                while let Some(Ok(info)) = list.next().await {
                    if let Some(v) = info.name.strip_prefix('v').and_then(|v| v.parse::<u64>().ok())
                        && v < below
                    {
                        names.push(info.name);
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not list weight versions to prune"),
        }
        for name in names {
            if let Err(e) = self.store.delete(&name).await {
                tracing::warn!(error = %e, object = %name, "could not prune a weight version");
            }
        }
    }
}

#[async_trait]
impl WeightPublisher for NatsWeightPublisher {
    async fn publish(&self, snapshot: Arc<WeightSnapshot>) -> metronome_core::Result<()> {
        Ok(self.state.publish(snapshot).await?)
    }
}

/// Fetches the newest published weights, caching the last one fetched.
pub struct NatsWeightSubscriber {
    transport: NatsTransport,
    store: object_store::ObjectStore,
    announce: stream::Stream,
    cached: Option<Arc<WeightSnapshot>>,
    counters: Arc<Counters>,
    streamed: u64,
    /// The chunk subject (nuid) of the last upload whose streamed fetch failed, so
    /// that its kept begins announcement is not followed again.
    failed_upload: Option<String>,
}

impl std::fmt::Debug for NatsWeightSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsWeightSubscriber")
            .field("bucket", &self.transport.config.weights.bucket)
            .field("cached", &self.cached.as_ref().map(|s| s.version))
            .finish_non_exhaustive()
    }
}

impl NatsWeightSubscriber {
    /// This subscriber's counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }

    /// How many versions this subscriber fetched while they were being uploaded
    /// (`weights.streaming`).
    #[must_use]
    pub fn streamed_fetches(&self) -> u64 {
        self.streamed
    }

    async fn newest(&mut self) -> Result<Option<Arc<WeightSnapshot>>> {
        let subject = self.transport.config.weights.announce_subject.clone();
        // A version may be pruned between reading its announcement and fetching it
        // when the publisher is fast; the announcement is then newer on the next try.
        let mut attempts = 0;
        loop {
            let Some(announcement) = last_announcement(&self.announce, &subject).await? else {
                return Ok(None);
            };
            // A streamed fetch may have cached a version whose announcement is not
            // written yet: it is complete and verified, and newer.
            if let Some(cached) = self.cached.as_ref().filter(|c| c.version.0 >= announcement.version) {
                return Ok(Some(Arc::clone(cached)));
            }
            let recycle = self.recyclable();
            match self.fetch(&announcement, recycle).await {
                Ok(snapshot) => {
                    let snapshot = Arc::new(snapshot);
                    self.cached = Some(Arc::clone(&snapshot));
                    return Ok(Some(snapshot));
                }
                Err(e) if attempts < 5 && !e.is_bad_message() => {
                    attempts += 1;
                    tracing::debug!(error = %e, "weight fetch failed; re-reading the announcement");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => {
                    if e.is_bad_message() {
                        self.counters.rejected(e.reason());
                    }
                    return Err(e);
                }
            }
        }
    }

    /// The buffers of the cached snapshot if nobody else holds it any more: they
    /// are lent to the next one (see `WeightsDecoder::recycling`).
    fn recyclable(&mut self) -> Vec<HostTensor> {
        self.cached.take().and_then(|c| Arc::try_unwrap(c).ok()).map(|s| s.tensors).unwrap_or_default()
    }

    /// Fetches a complete object named by `announcement`.
    async fn fetch(&self, announcement: &Announcement, recycle: Vec<HostTensor>) -> Result<WeightSnapshot> {
        let start = Instant::now();
        let info =
            self.store.info(&announcement.object).await.map_err(|e| Error::nats("look up weights", e))?;
        if info.deleted {
            return Err(Error::nats(
                "look up weights",
                std::io::Error::other(format!("object {} was deleted", info.name)),
            ));
        }
        let chunks = info.chunks as u64;
        let snapshot = self.read_chunks(&info.nuid, chunks, info.size as u64, recycle, None).await?;
        if snapshot.version.0 != announcement.version {
            return Err(Error::Malformed {
                kind: "weights",
                field: "version".into(),
                reason: format!("object {} holds version {}", announcement.object, snapshot.version),
            });
        }
        self.counters.received(info.size);
        self.counters.fetched(start.elapsed());
        Ok(snapshot)
    }

    /// Fetches the version that `begins` announces while its chunks are still being
    /// uploaded, waiting at most `stall_timeout_ms` for each chunk; caches it.
    async fn stream_fetch(&mut self, begins: &Begins) -> Result<Arc<WeightSnapshot>> {
        let start = Instant::now();
        if begins.bucket != self.transport.config.weights.bucket {
            return Err(Error::Malformed {
                kind: "weights begins announcement",
                field: "bucket".into(),
                reason: format!(
                    "names bucket {:?}, this subscriber reads {:?}",
                    begins.bucket, self.transport.config.weights.bucket
                ),
            });
        }
        let stall = Duration::from_millis(self.transport.config.weights.stall_timeout_ms.max(1));
        let recycle = self.recyclable();
        let snapshot = self
            .read_chunks(&begins.nuid, begins.chunks, begins.bytes, recycle, Some((stall, begins.checksum)))
            .await?;
        if snapshot.version.0 != begins.version {
            return Err(Error::Malformed {
                kind: "weights",
                field: "version".into(),
                reason: format!("streamed object {} holds version {}", begins.object, snapshot.version),
            });
        }
        let snapshot = Arc::new(snapshot);
        self.cached = Some(Arc::clone(&snapshot));
        self.counters.received(begins.bytes as usize);
        self.counters.fetched(start.elapsed());
        self.streamed += 1;
        metrics::counter!("metronome_transport_weights_streamed_fetches_total", "transport" => TRANSPORT)
            .increment(1);
        Ok(snapshot)
    }

    /// Reads `count` chunks of `size` bytes in all from `$O.<bucket>.C.<nuid>` with an
    /// ordered consumer and decodes them as they arrive ([`WeightsDecoder`]): one copy
    /// into the tensors, checked by the format's own checksum (the object store reader
    /// would add a SHA-256 pass and a copy). With `streamed` = (stall timeout, announced
    /// checksum), waits at most the timeout for each chunk (the chunks may still be
    /// uploading) and checks the header's checksum against the announced one.
    async fn read_chunks(
        &self,
        nuid: &str,
        count: u64,
        size: u64,
        recycle: Vec<HostTensor>,
        streamed: Option<(Duration, u64)>,
    ) -> Result<WeightSnapshot> {
        let bucket = &self.transport.config.weights.bucket;
        let stream = self
            .transport
            .js
            .get_stream(format!("OBJ_{bucket}"))
            .await
            .map_err(|e| Error::nats("open the weight bucket's stream", e))?;
        let mut chunks = stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: format!("$O.{bucket}.C.{nuid}"),
                // The default batch of 500 chunks would make the server push up to
                // 500 MiB at once and cut the connection as a slow consumer; a few
                // chunks per pull keep the pipe full without that.
                max_batch: 8,
                ..Default::default()
            })
            .await
            .map_err(|e| Error::nats("fetch weights", e))?
            .messages()
            .await
            .map_err(|e| Error::nats("fetch weights", e))?;
        let mut decoder = WeightsDecoder::recycling(size, recycle);
        let mut received = 0u64;
        for index in 0..count {
            let next = match streamed {
                None => chunks.next().await,
                Some((stall, _)) => {
                    tokio::time::timeout(stall, chunks.next()).await.map_err(|_| Error::Stalled {
                        what: format!("streamed weights object {nuid}"),
                        waited_ms: stall.as_millis() as u64,
                        received,
                        expected: size,
                    })?
                }
            };
            let chunk = match next {
                Some(Ok(m)) => m,
                Some(Err(e)) => return Err(Error::nats("fetch weights", e)),
                None => return Err(Error::Closed("weight chunk stream")),
            };
            if index == 0
                && let Some((_, announced)) = streamed
                && let Some(header) = chunk.payload.get(16..24)
                && u64::from_le_bytes(header.try_into().unwrap_or_default()) != announced
            {
                return Err(Error::Malformed {
                    kind: "weights",
                    field: "checksum".into(),
                    reason: format!(
                        "streamed object {nuid} does not carry the announced checksum {announced:#018x}"
                    ),
                });
            }
            received += chunk.payload.len() as u64;
            decoder.push(&chunk.payload)?;
        }
        decoder.finish()
    }
}

#[async_trait]
impl WeightSubscriber for NatsWeightSubscriber {
    async fn latest(&mut self) -> metronome_core::Result<Option<Arc<WeightSnapshot>>> {
        Ok(self.newest().await?)
    }

    async fn wait_for(&mut self, min: PolicyVersion) -> metronome_core::Result<Arc<WeightSnapshot>> {
        // Subscribe before looking, so an announcement between the look and the
        // subscription cannot be missed.
        let subject = self.transport.config.weights.announce_subject.clone();
        let client = &self.transport.client;
        let complete = client
            .subscribe(subject.clone())
            .await
            .map_err(|e| Error::nats("subscribe to weight announcements", e))?;
        let begins = if self.transport.config.weights.streaming {
            let s = client
                .subscribe(begins_subject(&subject))
                .await
                .map_err(|e| Error::nats("subscribe to weight announcements", e))?;
            futures::stream::select(complete, s).boxed()
        } else {
            complete.boxed()
        };
        let mut announcements = begins;
        // Announcements sent while the connection was down are lost to the
        // subscriptions: after a reconnection the stored ones are read again.
        let mut connections = self.transport.connections.clone();
        connections.borrow_and_update();
        loop {
            if let Some(s) = self.newest().await?.filter(|s| s.version >= min) {
                return Ok(s);
            }
            // An upload that began before this call (a worker that took a claim
            // offered while its weights upload): the stream keeps its begins.
            if self.transport.config.weights.streaming
                && let Some(payload) = last_begins(&self.announce, &begins_subject(&subject)).await
                && let Some(outcome) = self.on_begins(&payload, min).await
            {
                return outcome;
            }
            loop {
                let message = tokio::select! {
                    m = announcements.next() => m,
                    Ok(()) = connections.changed() => break,
                };
                let Some(message) = message else {
                    return Err(Error::Closed("nats weight announcements").into());
                };
                if message.subject.as_str() != subject {
                    match self.on_begins(&message.payload, min).await {
                        Some(outcome) => return outcome,
                        None => continue,
                    }
                }
                match serde_json::from_slice::<Announcement>(&message.payload) {
                    Ok(a) if a.version >= min.0 => break,
                    Ok(_) => {}
                    Err(e) => {
                        self.counters.rejected("malformed");
                        tracing::warn!(error = %e, "ignored a malformed weight announcement");
                    }
                }
            }
        }
    }
}

impl NatsWeightSubscriber {
    /// Handles a "begins" announcement seen while waiting for version `min`: streams
    /// the version if it is new enough. `None`: not for us, keep waiting. On a failed
    /// streamed fetch (stall, mismatch), falls back to the newest complete version,
    /// and returns the failure when that is older than `min` (never a partial
    /// snapshot, never an endless wait for a publisher that died) unless the
    /// connection dropped meanwhile: then the upload starts again, and `None`.
    async fn on_begins(
        &mut self,
        payload: &[u8],
        min: PolicyVersion,
    ) -> Option<metronome_core::Result<Arc<WeightSnapshot>>> {
        let begins = match serde_json::from_slice::<Begins>(payload) {
            Ok(b) if b.format == BEGINS_FORMAT => b,
            Ok(b) => {
                self.counters.rejected("incompatible_version");
                tracing::warn!(format = b.format, "ignored a weight begins announcement of another format");
                return None;
            }
            Err(e) => {
                self.counters.rejected("malformed");
                tracing::warn!(error = %e, "ignored a malformed weight begins announcement");
                return None;
            }
        };
        if begins.version < min.0
            || self.cached.as_ref().is_some_and(|c| c.version.0 >= begins.version)
            || self.failed_upload.as_ref() == Some(&begins.nuid)
        {
            return None;
        }
        let connections = *self.transport.connections.borrow();
        let error = match self.stream_fetch(&begins).await {
            Ok(s) => return Some(Ok(s)),
            Err(e) => e,
        };
        self.failed_upload = Some(begins.nuid);
        self.counters.rejected(error.reason());
        tracing::warn!(%error, version = begins.version, "streamed weight fetch failed; reading the newest complete version");
        // The connection dropped meanwhile (a server restart, say): the publisher
        // uploads the version again, so this is no dead upload; keep waiting.
        let interrupted = *self.transport.connections.borrow() != connections
            || self.transport.client.connection_state() != async_nats::connection::State::Connected;
        match self.newest().await {
            Ok(Some(s)) if s.version >= min => Some(Ok(s)),
            _ if interrupted => None,
            Ok(_) => Some(Err(error.into())),
            Err(e) => Some(Err(e.into())),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_parse_from_an_empty_object() {
        let c: NatsConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, NatsConfig::default());
    }

    #[test]
    fn config_reads_credentials_and_names() {
        let c: NatsConfig = serde_json::from_str(
            r#"{"urls": ["nats://a:4222", "tls://b:4222"],
                "auth": {"kind": "user_password", "user": "u", "password": "p"},
                "tls": {"required": true},
                "reconnect": {"initial_delay_ms": 10, "max_delay_ms": 80},
                "groups": {"stream": "RUN7_GROUPS", "max_pending": 16}}"#,
        )
        .unwrap();
        assert_eq!(c.urls.len(), 2);
        assert_eq!(c.auth, NatsAuth::UserPassword { user: "u".into(), password: Secret::new("p") });
        assert!(!format!("{c:?}").contains("\"p\""), "the password shows in Debug");
        assert!(c.tls.required);
        assert_eq!(c.groups.stream, "RUN7_GROUPS");
        assert_eq!(c.groups.max_pending, 16);
        assert_eq!(c.groups.subject, "metronome.groups");
        assert!(serde_json::from_str::<NatsConfig>(r#"{"url": "x"}"#).is_err(), "unknown fields are refused");
    }

    #[test]
    fn base64_url_matches_the_rfc_4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
        ];
        for (input, expected) in cases {
            assert_eq!(base64_url(input.as_bytes()), expected);
        }
        assert_eq!(base64_url(&[0xfb, 0xff]), "-_8=");
    }

    #[test]
    fn reconnect_backoff_doubles_up_to_the_cap() {
        let r = ReconnectConfig { initial_delay_ms: 10, max_delay_ms: 80, max_attempts: None };
        let delays: Vec<u64> = (1..=6).map(|a| r.delay(a).as_millis() as u64).collect();
        assert_eq!(delays, [0, 10, 20, 40, 80, 80]);
    }
}
