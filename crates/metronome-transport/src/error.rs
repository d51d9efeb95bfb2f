//! The crate's error type.

/// Errors of the transports and of the wire formats.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The bytes do not start with the magic of the expected message kind.
    #[error(
        "{kind} message has magic {found:02x?}, expected {expected:02x?}: not a metronome {kind} message"
    )]
    BadMagic {
        /// The message kind being decoded (`group`, `weights`, `control`).
        kind: &'static str,
        /// The first bytes found.
        found: [u8; 4],
        /// The magic of this kind.
        expected: [u8; 4],
    },
    /// The message was written in a format version this reader cannot read.
    #[error(
        "{kind} message has format version {found}, this reader reads versions {oldest} to {newest}: {hint}"
    )]
    IncompatibleVersion {
        /// The message kind.
        kind: &'static str,
        /// The writer's format version.
        found: u16,
        /// The oldest version this reader reads.
        oldest: u16,
        /// The newest version this reader reads.
        newest: u16,
        /// What to do about it.
        hint: &'static str,
    },
    /// The message ends before a field it declares.
    #[error("{kind} message truncated at {field} (byte {offset}): needs {needed} bytes, {available} left")]
    Truncated {
        /// The message kind.
        kind: &'static str,
        /// The field being read.
        field: &'static str,
        /// Byte offset of the field.
        offset: usize,
        /// Bytes the field needs.
        needed: u64,
        /// Bytes that were left.
        available: u64,
    },
    /// The checksum of the body does not match the header: the bytes were corrupted.
    #[error(
        "{kind} message checksum mismatch (header {expected:#018x}, body {actual:#018x}): the bytes are corrupted"
    )]
    Checksum {
        /// The message kind.
        kind: &'static str,
        /// The checksum in the header.
        expected: u64,
        /// The checksum of the body received.
        actual: u64,
    },
    /// A field holds a value that breaks the format or the data contract.
    #[error("{kind} message field {field} is malformed: {reason}")]
    Malformed {
        /// The message kind.
        kind: &'static str,
        /// The field at fault.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A message is larger than the configured limit.
    #[error("{kind} message of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The message kind.
        kind: &'static str,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A weight snapshot's version is older than one already published.
    #[error("weights version {version} is older than the published version {newest}")]
    StaleVersion {
        /// The version offered.
        version: u64,
        /// The newest version already published.
        newest: u64,
    },
    /// A configuration value is invalid.
    #[error("transport config field {field} is invalid: {reason}")]
    Config {
        /// The field at fault.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A streamed transfer received nothing for longer than its stall timeout (the
    /// sender died or is stuck).
    #[error("{what} stalled: nothing arrived for {waited_ms} ms after {received} of {expected} bytes")]
    Stalled {
        /// What was being received (`streamed weights v<version>` ...).
        what: String,
        /// The stall timeout that ran out, in milliseconds.
        waited_ms: u64,
        /// Bytes received before the stall.
        received: u64,
        /// Bytes announced.
        expected: u64,
    },
    /// A stream or consumer of the same name, left by an earlier run or release, has
    /// settings this one needs changed and the server refused to change them.
    #[error(
        "nats {what} `{name}` exists with other settings ({differences}) and the server refused to update it \
         ({reason}); remove it (`nats {what} rm {name}`) or give this run another name"
    )]
    Leftover {
        /// `stream` or `consumer`.
        what: &'static str,
        /// Its name.
        name: String,
        /// The settings that differ: `field: found -> wanted`.
        differences: String,
        /// The server's answer to the update.
        reason: String,
    },
    /// The other side went away.
    #[error("{0} is closed")]
    Closed(&'static str),
    /// A NATS operation failed. The client's error ends the chain: it is printed
    /// with its own sources (`authorization violation`, `connection refused`), since
    /// retry loops, dead letters and the binary show this error on one line.
    #[error("nats {op} failed: {}", metronome_core::ErrorChain(&**error))]
    Nats {
        /// The operation (`connect`, `publish group`, `fetch weights` ...).
        op: &'static str,
        /// The client's error.
        error: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl Error {
    /// A short, bounded label for the rejection metric (`reason` label).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::BadMagic { .. } => "bad_magic",
            Self::IncompatibleVersion { .. } => "incompatible_version",
            Self::Truncated { .. } => "truncated",
            Self::Checksum { .. } => "checksum",
            Self::Malformed { .. } => "malformed",
            Self::TooLarge { .. } => "oversized",
            Self::StaleVersion { .. } => "stale_version",
            Self::Config { .. } => "config",
            Self::Stalled { .. } => "stalled",
            Self::Leftover { .. } => "leftover",
            Self::Closed(_) => "closed",
            Self::Nats { .. } => "nats",
        }
    }

    /// True for errors about the bytes of one message (the message is rejected and
    /// counted, and the receiver goes on), as opposed to errors of the connection.
    #[must_use]
    pub fn is_bad_message(&self) -> bool {
        matches!(
            self,
            Self::BadMagic { .. }
                | Self::IncompatibleVersion { .. }
                | Self::Truncated { .. }
                | Self::Checksum { .. }
                | Self::Malformed { .. }
                | Self::TooLarge { .. }
        )
    }

    #[cfg(feature = "nats")]
    pub(crate) fn nats(op: &'static str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Nats { op, error: Box::new(source) }
    }
}

impl From<Error> for metronome_core::Error {
    fn from(error: Error) -> Self {
        match error {
            Error::Closed(what) => metronome_core::Error::Closed(what.to_owned()),
            other => metronome_core::Error::transport(other),
        }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
