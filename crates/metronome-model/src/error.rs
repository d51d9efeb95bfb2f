//! The crate's error type.

use std::path::PathBuf;

/// Errors of the model crate: bad configs and checkpoints (naming the file and the
/// field or tensor at fault), tokenizer failures, and tensor errors from candle.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read or written.
    #[error("cannot read or write {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A configuration is malformed or unsupported; `what` names the file or field.
    #[error("{what}: {reason}")]
    Config {
        /// The file or field at fault.
        what: String,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint lacks a tensor or holds one of the wrong shape or type.
    #[error("{what}: {reason}")]
    Checkpoint {
        /// The file and tensor at fault.
        what: String,
        /// What is wrong.
        reason: String,
    },
    /// Arguments that break an API contract (slot out of range, target outside its row).
    #[error("{what} {reason}")]
    Invalid {
        /// The argument at fault.
        what: String,
        /// What is wrong.
        reason: String,
    },
    /// A tokenizer failed to load, encode, decode or render a chat template.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A tensor operation failed. Boxed: candle's error holds up to two shapes, and
    /// inline it would make every `Result` of this crate (and the errors that wrap
    /// this one) 120 bytes or more.
    #[error(transparent)]
    Candle(Box<candle_core::Error>),
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Self::Candle(Box::new(e))
    }
}

impl Error {
    pub(crate) fn config(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config { what: what.into(), reason: reason.into() }
    }

    pub(crate) fn checkpoint(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Checkpoint { what: what.into(), reason: reason.into() }
    }

    pub(crate) fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid { what: what.into(), reason: reason.into() }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}

impl From<Error> for metronome_core::Error {
    fn from(e: Error) -> Self {
        metronome_core::Error::stage("model", e)
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
