//! The subscribing side of the weight store: complete objects, or chunks decoded as
//! they upload.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{consumer, object_store, stream};
use async_trait::async_trait;
use futures::StreamExt;
use metronome_core::{HostTensor, PolicyVersion, WeightSnapshot, WeightSubscriber};

use super::{Announcement, BEGINS_FORMAT, Begins, begins_subject, last_announcement, last_begins};
use crate::nats::TRANSPORT;
use crate::nats::connection::NatsTransport;
use crate::stats::{Counters, Stats};
use crate::wire::WeightsDecoder;
use crate::{Error, Result};

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
    pub(super) fn new(
        transport: &NatsTransport,
        store: object_store::ObjectStore,
        announce: stream::Stream,
    ) -> Self {
        Self {
            transport: transport.clone(),
            store,
            announce,
            cached: None,
            counters: Arc::new(Counters::new(TRANSPORT, "weights")),
            streamed: 0,
            failed_upload: None,
        }
    }

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
        // Complete, yet a chunk may never come: the publisher may be putting the same
        // version again (a restarted trainer), which purges these chunks mid-read. The
        // stall timeout turns that into an error `newest` retries with the new object,
        // instead of a wait that held the worker's claims for ever.
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
        let recycle = self.recyclable();
        let snapshot = self
            .read_chunks(&begins.nuid, begins.chunks, begins.bytes, recycle, Some(begins.checksum))
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
        crate::metrics::weights_streamed(TRANSPORT);
        Ok(snapshot)
    }

    /// Reads `count` chunks of `size` bytes in all from `$O.<bucket>.C.<nuid>` with an
    /// ordered consumer and decodes them as they arrive ([`WeightsDecoder`]): one copy
    /// into the tensors, checked by the format's own checksum (the object store reader
    /// would add a SHA-256 pass and a copy). Waits at most `stall_timeout_ms` for each
    /// chunk (they may still be uploading, or be purged by a newer put of the object);
    /// with `announced`, checks the header's checksum against it.
    async fn read_chunks(
        &self,
        nuid: &str,
        count: u64,
        size: u64,
        recycle: Vec<HostTensor>,
        announced: Option<u64>,
    ) -> Result<WeightSnapshot> {
        let stall = Duration::from_millis(self.transport.config.weights.stall_timeout_ms.max(1));
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
            let next = tokio::time::timeout(stall, chunks.next()).await.map_err(|_| Error::Stalled {
                what: format!("weights object {nuid}"),
                waited_ms: stall.as_millis() as u64,
                received,
                expected: size,
            })?;
            let chunk = match next {
                Some(Ok(m)) => m,
                Some(Err(e)) => return Err(Error::nats("fetch weights", e)),
                None => return Err(Error::Closed("weight chunk stream")),
            };
            if index == 0
                && let Some(announced) = announced
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
