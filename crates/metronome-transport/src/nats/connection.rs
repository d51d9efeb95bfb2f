//! The connection every endpoint is made from, and the streams and consumers it
//! brings to the config's settings.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use async_nats::{ConnectOptions, HeaderMap, ServerAddr};
use bytes::Bytes;

use super::config::{NatsAuth, NatsConfig};
use crate::{Error, Result};

/// A connection to NATS from which every endpoint is made.
#[derive(Clone, Debug)]
pub struct NatsTransport {
    pub(super) client: async_nats::Client,
    pub(super) js: jetstream::Context,
    pub(super) config: Arc<NatsConfig>,
    pub(super) max_message: usize,
    /// Counts the connections made (the first and every reconnection), so that a
    /// weight publisher can check what a restarted server still holds.
    pub(super) connections: tokio::sync::watch::Receiver<u64>,
}

impl NatsTransport {
    /// Connects with `config`.
    pub async fn connect(config: NatsConfig) -> Result<Self> {
        let config = Arc::new(config.resolved());
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

/// The stream `config.name`: created when missing (also when processes create it at
/// once); when a stream of that name exists
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
            match js.get_or_create_stream(config.clone()).await {
                Ok(stream) => return Ok(stream),
                // Another process created it between the two calls (the server then
                // refuses this create, saying the subjects overlap the new stream's):
                // the one it made is compared with these settings below.
                Err(create) => js.get_stream(&config.name).await.map_err(|_| Error::nats(what, create))?,
            }
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
