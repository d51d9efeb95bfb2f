//! Weight snapshots in the JetStream object store by version, announced on a subject
//! whose stream keeps the last announcement (and the last "begins" of a streamed
//! upload). The publisher and the subscriber are in the two child modules; this one
//! holds what both read and write.

mod publisher;
mod subscriber;

use async_nats::jetstream::{self, object_store, stream};
use bytes::Bytes;
use metronome_core::PolicyVersion;
use serde::{Deserialize, Serialize};

pub use publisher::NatsWeightPublisher;
pub use subscriber::NatsWeightSubscriber;

use super::connection::{NatsTransport, ensure_stream};
use crate::{Error, Result};

impl NatsTransport {
    pub(super) async fn weight_store(&self) -> Result<(object_store::ObjectStore, stream::Stream)> {
        let c = &self.config.weights;
        let store = match self.js.get_object_store(&c.bucket).await {
            Ok(store) => store,
            Err(_) => {
                let config = object_store::Config {
                    bucket: c.bucket.clone(),
                    storage: c.storage.into(),
                    ..object_store::Config::default()
                };
                match self.js.create_object_store(config).await {
                    Ok(store) => store,
                    // Another process created it between the two calls (as for streams,
                    // `ensure_stream`): the server refuses this create; use theirs.
                    Err(create) => self
                        .js
                        .get_object_store(&c.bucket)
                        .await
                        .map_err(|_| Error::nats("create weight bucket", create))?,
                }
            }
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
        Ok(NatsWeightSubscriber::new(self, store, announce))
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
