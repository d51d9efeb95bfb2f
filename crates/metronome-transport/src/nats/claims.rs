//! Prompt claims with leases, so that many rollout workers share one period's prompts
//! and a dead worker's prompts go to another.
//!
//! The trainer *offers* one claim per prompt of a period on a JetStream work-queue
//! stream (`Nats-Msg-Id` = `claim-<period>-<prompt>`, so offering a period twice, as a
//! restarted trainer does, adds nothing within the duplicate window). Workers pull
//! claims through one shared durable consumer whose `ack_wait` is the *lease*: a claim
//! a worker neither completes nor extends within the lease is delivered to another
//! worker. A worker completes a claim only after the group it generated is published
//! to the group stream, so a crash between the two costs a regeneration, never a
//! group; determinism (per-sample seeds) makes the regenerated group identical and
//! the trainer's (period, prompt) de-duplication counts it once.
//!
//! A claim is plain data for the worker (period, weights version, the prompt itself),
//! so workers need no data loader.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use futures::StreamExt;
use metronome_core::{PeriodId, PolicyVersion, Prompt};
use serde::{Deserialize, Serialize};

pub use super::config::ClaimQueueConfig;
use super::connection::{NatsTransport, durable_consumer, ensure_stream};
use crate::stats::Counters;
use crate::{Error, Result, Stats};

/// How long a pull may go unanswered past its expiry before the taker gives up on it.
pub const PULL_GRACE: Duration = Duration::from_secs(2);

/// The expiry of the pull that takes what else is available after the first claim.
const REST_WAIT: Duration = Duration::from_millis(50);

/// The format version of a claim message; a reader refuses others.
pub const CLAIM_FORMAT_VERSION: u16 = 1;

/// The body of a claim message (JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClaimBody {
    /// [`CLAIM_FORMAT_VERSION`] of the writer.
    pub format: u16,
    /// The period the prompt belongs to.
    pub period: PeriodId,
    /// The weights version the period samples with.
    pub version: PolicyVersion,
    /// The prompt.
    pub prompt: Prompt,
}

/// One prompt to generate, leased to this worker until completed, released or expired.
pub struct Claim {
    /// The period the prompt belongs to.
    pub period: PeriodId,
    /// The weights version the period samples with.
    pub version: PolicyVersion,
    /// The prompt.
    pub prompt: Prompt,
    /// How many times the claim was delivered (1 on first delivery; more after a lease
    /// expired or a worker released it).
    pub deliveries: u64,
    message: jetstream::Message,
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("period", &self.period)
            .field("version", &self.version)
            .field("prompt", &self.prompt.id)
            .field("deliveries", &self.deliveries)
            .finish_non_exhaustive()
    }
}

impl Claim {
    /// Marks the claim done (after its group is published): it is never delivered again.
    pub async fn complete(&self) -> Result<()> {
        self.message.double_ack().await.map_err(|e| Error::Nats { op: "complete claim", error: e })
    }

    /// Gives the claim back at once, for another worker (graceful leave).
    pub async fn release(&self) -> Result<()> {
        self.message
            .ack_with(jetstream::AckKind::Nak(None))
            .await
            .map_err(|e| Error::Nats { op: "release claim", error: e })
    }

    /// Renews the lease (the worker is still on it).
    pub async fn extend(&self) -> Result<()> {
        self.message
            .ack_with(jetstream::AckKind::Progress)
            .await
            .map_err(|e| Error::Nats { op: "extend claim", error: e })
    }
}

/// A claim message's bytes.
pub fn encode_claim(body: &ClaimBody) -> Result<Vec<u8>> {
    serde_json::to_vec(body).map_err(|e| Error::Malformed {
        kind: "claim",
        field: "body".into(),
        reason: e.to_string(),
    })
}

/// A claim message read back: its format version checked first, then the body;
/// an error names the JSON field at fault (`prompt.tokens[3]`), or `body`.
pub fn decode_claim(bytes: &[u8]) -> Result<ClaimBody> {
    #[derive(Deserialize)]
    struct Format {
        format: u16,
    }
    let malformed = |e: serde_path_to_error::Error<serde_json::Error>| {
        let path = e.path().to_string();
        Error::Malformed {
            kind: "claim",
            field: if path == "." { "body".into() } else { path },
            reason: e.into_inner().to_string(),
        }
    };
    let format: Format = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(bytes))
        .map_err(malformed)?;
    if format.format != CLAIM_FORMAT_VERSION {
        return Err(Error::IncompatibleVersion {
            kind: "claim",
            found: format.format,
            oldest: CLAIM_FORMAT_VERSION,
            newest: CLAIM_FORMAT_VERSION,
            hint: "run the trainer and the workers from the same release",
        });
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let body = serde_path_to_error::deserialize(&mut de).map_err(malformed)?;
    de.end().map_err(|e| Error::Malformed { kind: "claim", field: "body".into(), reason: e.to_string() })?;
    Ok(body)
}

impl NatsTransport {
    pub(super) async fn claim_stream(&self) -> Result<stream::Stream> {
        let c = &self.config().claims;
        let config = stream::Config {
            name: c.stream.clone(),
            subjects: vec![c.subject.clone()],
            retention: stream::RetentionPolicy::WorkQueue,
            duplicate_window: Duration::from_millis(c.duplicate_window_ms),
            max_message_size: i32::try_from(self.max_message_bytes()).unwrap_or(i32::MAX),
            storage: c.storage.into(),
            ..stream::Config::default()
        };
        ensure_stream(self.jetstream(), config, "create claim stream").await
    }

    /// The trainer's side of the claim queue (creates the stream when missing).
    pub async fn claim_offerer(&self) -> Result<NatsClaimOfferer> {
        self.claim_stream().await?;
        Ok(NatsClaimOfferer { transport: self.clone(), counters: Counters::new("nats", "claim").into() })
    }

    /// A worker's side of the claim queue (creates the stream and the shared consumer
    /// when missing).
    pub async fn claim_taker(&self) -> Result<NatsClaimTaker> {
        let c = &self.config().claims;
        let stream = self.claim_stream().await?;
        // Claims in hand are bounded by the workers' slots, not by this limit: -1
        // lets any number of workers hold any number of claims.
        let consumer =
            durable_consumer(&stream, &c.consumer, c.lease_ms, -1, "create claim consumer").await?;
        Ok(NatsClaimTaker {
            transport: self.clone(),
            consumer,
            counters: Counters::new("nats", "claim").into(),
        })
    }
}

/// Offers a period's prompts as claims.
#[derive(Debug, Clone)]
pub struct NatsClaimOfferer {
    transport: NatsTransport,
    counters: std::sync::Arc<Counters>,
}

impl NatsClaimOfferer {
    /// Offers one claim per prompt of `period`, to be sampled with `version`. Offering
    /// the same period again within the duplicate window adds nothing.
    pub async fn offer(&self, period: PeriodId, version: PolicyVersion, prompts: &[Prompt]) -> Result<()> {
        let subject = self.transport.config().claims.subject.clone();
        for prompt in prompts {
            let start = std::time::Instant::now();
            let body = ClaimBody { format: CLAIM_FORMAT_VERSION, period, version, prompt: prompt.clone() };
            let bytes = encode_claim(&body)?;
            crate::wire::check_size("claim", bytes.len(), self.transport.max_message_bytes())?;
            let mut headers = HeaderMap::new();
            headers.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("claim-{period}-{}", prompt.id).as_str(),
            );
            let len = bytes.len();
            self.transport
                .publish_durably("offer claim", &subject, Some(headers), Bytes::from(bytes))
                .await?;
            self.counters.sent(len, start.elapsed());
        }
        Ok(())
    }

    /// This offerer's counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }
}

/// Takes claims for one worker.
#[derive(Clone)]
pub struct NatsClaimTaker {
    transport: NatsTransport,
    consumer: consumer::PullConsumer,
    counters: std::sync::Arc<Counters>,
}

impl std::fmt::Debug for NatsClaimTaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsClaimTaker").finish_non_exhaustive()
    }
}

impl NatsClaimTaker {
    /// Up to `max` claims: waits up to `wait` for the first, then takes whatever else
    /// is available at once. Empty when no claim came within `wait`. A malformed claim
    /// is terminated (never redelivered), counted and skipped.
    ///
    /// Each pull gives up on its own after its expiry and [`PULL_GRACE`]: a pull
    /// request in flight when the server restarts is never answered, and a worker
    /// that waited for the answer hung for good. A claim delivered to a pull given up
    /// on goes to another take when its lease expires.
    pub async fn take(&self, max: usize, wait: Duration) -> Result<Vec<Claim>> {
        let mut out = Vec::new();
        self.pull(1, wait, &mut out).await?;
        if !out.is_empty() && max > 1 {
            // What is there now: a short expiry rather than a no-wait fetch, whose
            // request the client never times out.
            self.pull(max - 1, REST_WAIT, &mut out).await?;
        }
        Ok(out)
    }

    /// One pull of up to `max` claims expiring after `wait`, appended to `out`.
    async fn pull(&self, max: usize, wait: Duration, out: &mut Vec<Claim>) -> Result<()> {
        let deadline = tokio::time::Instant::now() + wait + PULL_GRACE;
        let batch = self.consumer.batch().max_messages(max).expires(wait).messages();
        let mut batch = match tokio::time::timeout_at(deadline, batch).await {
            Ok(batch) => batch.map_err(|e| Error::nats("take claims", e))?,
            Err(_) => {
                tracing::debug!("claim pull unanswered; giving up on it");
                return Ok(());
            }
        };
        loop {
            let next = match tokio::time::timeout_at(deadline, batch.next()).await {
                Ok(Some(next)) => next,
                Ok(None) => return Ok(()),
                Err(_) => {
                    tracing::debug!("claim pull unanswered; giving up on it");
                    return Ok(());
                }
            };
            let message = match next {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(error = %e, "claim pull interrupted");
                    return Ok(());
                }
            };
            let deliveries = message.info().map_or(1, |i| i.delivered.max(1) as u64);
            if deliveries > 1 {
                self.counters.redelivered();
            }
            match decode_claim(&message.payload) {
                Ok(body) => {
                    self.counters.received(message.payload.len());
                    out.push(Claim {
                        period: body.period,
                        version: body.version,
                        prompt: body.prompt,
                        deliveries,
                        message,
                    });
                }
                Err(e) => {
                    self.counters.rejected(e.reason());
                    tracing::warn!(error = %e, "rejected a claim message");
                    let subject = message.subject.as_str();
                    self.transport
                        .dead_letter("claim", subject, &e.to_string(), message.payload.clone())
                        .await;
                    if let Err(e) = message.ack_with(jetstream::AckKind::Term).await {
                        tracing::warn!(error = %e, "could not terminate a rejected claim");
                    }
                }
            }
        }
    }

    /// This taker's counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_round_trip_and_refuse_other_formats() {
        let body = ClaimBody {
            format: CLAIM_FORMAT_VERSION,
            period: PeriodId(3),
            version: PolicyVersion(3),
            prompt: Prompt { id: metronome_core::PromptId(7), text: "1+2=".into(), ..Prompt::default() },
        };
        let bytes = encode_claim(&body).unwrap();
        assert_eq!(decode_claim(&bytes).unwrap(), body);
        let newer = String::from_utf8(bytes).unwrap().replace("\"format\":1", "\"format\":9");
        let err = decode_claim(newer.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("format version 9"), "{err}");
        assert!(decode_claim(b"{").unwrap_err().is_bad_message());
    }
}
