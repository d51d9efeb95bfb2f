//! The trainer's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the trainer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainerError {
    /// A tensor operation failed (shape mismatch, device, dtype).
    #[error("tensor operation failed")]
    Tensor(#[from] candle_core::Error),
    /// A configuration value is out of range; `key` is its dotted path.
    #[error("config key `{key}` {reason}")]
    Config {
        /// The dotted key, e.g. `loss.clip_high`.
        key: String,
        /// What is wrong with its value.
        reason: String,
    },
    /// Input that breaks a contract (batch, example, call order); `what` names it.
    #[error("{what} {reason}")]
    Invalid {
        /// The place at fault.
        what: String,
        /// What is wrong there.
        reason: String,
    },
    /// A checkpoint file is missing, unreadable or inconsistent.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The network failed (bad targets, checkpoint files, shapes).
    #[error(transparent)]
    Model(#[from] metronome_model::Error),
    /// A batch broke the shared layout contract.
    #[error(transparent)]
    Core(#[from] metronome_core::Error),
    /// The trainer's own thread pool could not be built.
    #[error("cannot build the trainer thread pool: {0}")]
    ThreadPool(String),
}

impl TrainerError {
    pub(crate) fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config { key: key.into(), reason: reason.into() }
    }

    pub(crate) fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid { what: what.into(), reason: reason.into() }
    }

    /// A model error about a config key (`lora.rank`) as this crate's config error, so
    /// that it reads like the trainer's own; other model errors pass through.
    pub(crate) fn from_model_config(e: metronome_model::Error) -> Self {
        match e {
            metronome_model::Error::Config { what, reason } => Self::config(what, reason),
            other => other.into(),
        }
    }

    pub(crate) fn checkpoint(path: impl Into<PathBuf>, reason: impl ToString) -> Self {
        Self::Checkpoint { path: path.into(), reason: reason.to_string() }
    }
}

impl From<TrainerError> for metronome_core::Error {
    fn from(e: TrainerError) -> Self {
        match e {
            TrainerError::Core(e) => e,
            other => metronome_core::Error::stage("trainer", other),
        }
    }
}

/// `Result` with [`TrainerError`].
pub type Result<T, E = TrainerError> = std::result::Result<T, E>;
