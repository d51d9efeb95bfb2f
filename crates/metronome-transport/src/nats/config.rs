//! The serde config of the NATS transport: how to reach the server and the names and
//! settings of every stream, consumer and bucket it uses.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream::stream;
use metronome_core::Secret;
use serde::{Deserialize, Serialize};

/// How to reach NATS and where the transport keeps its streams. Every field has a
/// default, so `{}` (or `{"urls": ["nats://host:4222"]}`) is a valid config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URLs; the client picks among them and fails over on reconnect.
    pub urls: Vec<String>,
    /// What every stream, subject, consumer and bucket name not set below is derived
    /// from (`<PREFIX>_GROUPS`, `<prefix>.claims`, `<prefix>-weights`, …), so that
    /// several runs can share one server; `metronome` when absent (the multi-process
    /// roles use `metronome-<run.name>`). A name set below is kept as it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
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
    /// The prompt claim queue of multi-process runs ([`super::claims`]).
    pub claims: ClaimQueueConfig,
    /// Where poison messages go for an operator to read.
    pub dead_letters: DeadLetterConfig,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            urls: vec!["nats://127.0.0.1:4222".to_owned()],
            prefix: None,
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
            claims: ClaimQueueConfig::default(),
            dead_letters: DeadLetterConfig::default(),
        }
    }
}

impl NatsConfig {
    /// The default config with every stream, subject, consumer and bucket name
    /// derived from `prefix` (and filled in), so that several runs can share one server.
    #[must_use]
    pub fn with_prefix(urls: Vec<String>, prefix: &str) -> Self {
        Self { urls, prefix: Some(prefix.to_owned()), ..Self::default() }.resolved()
    }

    /// The config with every name left empty derived from `prefix` (`metronome` when
    /// unset); names set explicitly are kept. The transport connects with this.
    #[must_use]
    pub fn resolved(mut self) -> Self {
        let prefix = self.prefix.clone().unwrap_or_else(|| "metronome".to_owned());
        let upper = prefix.to_uppercase().replace(['.', '-', ' '], "_");
        let lower = prefix.to_lowercase().replace(['.', ' '], "_");
        let fill = |name: &mut String, derived: String| {
            if name.is_empty() {
                *name = derived;
            }
        };
        fill(&mut self.groups.stream, format!("{upper}_GROUPS"));
        fill(&mut self.groups.subject, format!("{lower}.groups"));
        fill(&mut self.groups.consumer, format!("{lower}-trainer"));
        fill(&mut self.weights.bucket, format!("{lower}-weights"));
        fill(&mut self.weights.announce_stream, format!("{upper}_WEIGHTS"));
        fill(&mut self.weights.announce_subject, format!("{lower}.weights"));
        fill(&mut self.control.stream, format!("{upper}_CONTROL"));
        fill(&mut self.control.subject, format!("{lower}.control"));
        fill(&mut self.claims.stream, format!("{upper}_CLAIMS"));
        fill(&mut self.claims.subject, format!("{lower}.claims"));
        fill(&mut self.claims.consumer, format!("{lower}-workers"));
        fill(&mut self.dead_letters.stream, format!("{upper}_DEAD"));
        fill(&mut self.dead_letters.subject, format!("{lower}.dead"));
        self
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
    /// Stream name; derived from [`NatsConfig::prefix`] when empty.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stream: String,
    /// Subject groups are published on.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub subject: String,
    /// Durable consumer name of the trainer.
    #[serde(skip_serializing_if = "String::is_empty")]
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
            stream: String::new(),
            subject: String::new(),
            consumer: String::new(),
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
    #[serde(skip_serializing_if = "String::is_empty")]
    pub bucket: String,
    /// Stream holding the last announcement.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub announce_stream: String,
    /// Subject of announcements.
    #[serde(skip_serializing_if = "String::is_empty")]
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
    /// How long a fetch waits for the next chunk before it gives up, in
    /// milliseconds: a streamed fetch when the publisher died or is stuck (it falls
    /// back to the newest complete version), a fetch of a complete object when a new
    /// put of the same version purged its chunks (it reads the new object).
    pub stall_timeout_ms: u64,
}

impl Default for WeightStoreConfig {
    fn default() -> Self {
        Self {
            bucket: String::new(),
            announce_stream: String::new(),
            announce_subject: String::new(),
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
    /// Stream name; derived from [`NatsConfig::prefix`] when empty.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stream: String,
    /// Subject.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub subject: String,
    /// A new receiver first gets the last message sent before it subscribed (so a
    /// worker joining mid-period learns the period), instead of only newer ones.
    pub replay_last: bool,
    /// Storage.
    pub storage: Storage,
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self { stream: String::new(), subject: String::new(), replay_last: false, storage: Storage::File }
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
    /// Stream name; derived from [`NatsConfig::prefix`] when empty.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stream: String,
    /// Subject prefix.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub subject: String,
    /// The newest this many dead letters are kept.
    pub max_messages: i64,
}

impl Default for DeadLetterConfig {
    fn default() -> Self {
        Self { stream: String::new(), subject: String::new(), max_messages: 10_000 }
    }
}

/// The claim queue's stream and the workers' shared consumer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClaimQueueConfig {
    /// Stream name (a work queue: a completed claim is removed).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stream: String,
    /// Subject claims are offered on.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub subject: String,
    /// Durable consumer shared by every worker.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub consumer: String,
    /// Lease: a claim neither completed nor extended for this many milliseconds goes
    /// to another worker.
    pub lease_ms: u64,
    /// Window in which offering the same (period, prompt) again adds nothing, in milliseconds.
    pub duplicate_window_ms: u64,
    /// A claim delivered more often than this (every worker that took it failed on
    /// it, or died) is poison: the worker that takes it next publishes its group as
    /// rejected instead of generating.
    pub max_deliveries: u64,
    /// How long a worker renews the leases of claims it holds, in milliseconds; past
    /// it the leases lapse and the claims go to another worker, so that a worker stuck
    /// on them (a wait that never ends) cannot stall a period. Longer than any
    /// generation should take; 0 renews without limit.
    pub max_hold_ms: u64,
    /// Storage.
    pub storage: Storage,
}

impl Default for ClaimQueueConfig {
    fn default() -> Self {
        Self {
            stream: String::new(),
            subject: String::new(),
            consumer: String::new(),
            lease_ms: 30_000,
            duplicate_window_ms: 600_000,
            max_deliveries: 5,
            max_hold_ms: 1_800_000,
            storage: Storage::File,
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
        // Unset names derive from the prefix when the transport connects.
        assert_eq!(c.groups.subject, "");
        let c = c.resolved();
        assert_eq!(
            (c.groups.stream.as_str(), c.groups.subject.as_str()),
            ("RUN7_GROUPS", "metronome.groups")
        );
        assert!(serde_json::from_str::<NatsConfig>(r#"{"url": "x"}"#).is_err(), "unknown fields are refused");
    }

    #[test]
    fn reconnect_backoff_doubles_up_to_the_cap() {
        let r = ReconnectConfig { initial_delay_ms: 10, max_delay_ms: 80, max_attempts: None };
        let delays: Vec<u64> = (1..=6).map(|a| r.delay(a).as_millis() as u64).collect();
        assert_eq!(delays, [0, 10, 20, 40, 80, 80]);
    }
}
