//! The publishing side of the weight store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, object_store, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use metronome_core::{WeightPublisher, WeightSnapshot};

use super::{
    Announcement, BEGINS_FORMAT, Begins, base64_url, begins_subject, last_announcement, object_name,
    object_nuid,
};
use crate::nats::TRANSPORT;
use crate::nats::config::Storage;
use crate::nats::connection::NatsTransport;
use crate::stats::{Counters, Stats};
use crate::wire::encode_weights_chunks;
use crate::{Error, Result};

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
    pub(super) fn new(
        transport: &NatsTransport,
        store: object_store::ObjectStore,
        announce: stream::Stream,
    ) -> Self {
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
                crate::metrics::weights_restored(TRANSPORT);
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
