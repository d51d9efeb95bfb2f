//! The dead-letter stream: where a poison message is kept for an operator after it is
//! terminated on its own stream.

use async_nats::HeaderMap;
use async_nats::jetstream::stream;
use bytes::Bytes;

use super::TRANSPORT;
use super::connection::{NatsTransport, ensure_stream};

impl NatsTransport {
    /// Keeps a copy of a poison message of `kind` that came on `subject` on the
    /// dead-letter stream, with `reason`, and counts it
    /// (`metronome_transport_dead_letters_total`). Best effort: a failure is logged,
    /// since the message is terminated either way.
    pub(super) async fn dead_letter(&self, kind: &'static str, subject: &str, reason: &str, payload: Bytes) {
        crate::metrics::dead_letter(TRANSPORT, kind);
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
}
