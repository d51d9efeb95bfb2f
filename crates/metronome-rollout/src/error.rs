//! The crate's error type.

use metronome_core::PromptId;

/// Errors of the rollout engine, its server and its client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is out of range; `field` names it.
    #[error("config field `{field}` {reason}")]
    Config {
        /// The field at fault, e.g. `sampling.top_p`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A prompt cannot be generated from (empty, or longer than the context).
    #[error("prompt {prompt}: {reason}")]
    Prompt {
        /// The prompt at fault.
        prompt: PromptId,
        /// What is wrong with it.
        reason: String,
    },
    /// The model failed during prefill, decode or weight installation.
    #[error("model: {0}")]
    Model(String),
    /// Weights older than the installed ones were offered without saying that the
    /// policy should go back ([`crate::Rollback`]).
    #[error(
        "weights of version {offered} are older than the installed version {installed} (installing them \
         would roll the policy back; say so explicitly to allow it)"
    )]
    Rollback {
        /// The version offered.
        offered: metronome_core::PolicyVersion,
        /// The version installed.
        installed: metronome_core::PolicyVersion,
    },
    /// A tokenizer failed to decode generated tokens.
    #[error("tokenizer")]
    Tokenizer(#[from] metronome_core::Error),
    /// The engine was shut down, or the request was cancelled, while work was pending.
    #[error("engine is shut down")]
    Shutdown,
    /// An engine worker thread could not be started.
    #[error("worker {worker}: {reason}")]
    Worker {
        /// The worker index.
        worker: usize,
        /// What failed.
        reason: String,
    },
    /// An HTTP request to an OpenAI-compatible server failed.
    #[error("http {url}: {reason}")]
    Http {
        /// The URL requested.
        url: String,
        /// What failed (status and server message, or the transport error).
        reason: String,
    },
    /// A server response did not have the expected shape.
    #[error("response from {url}: {reason}")]
    Response {
        /// The URL requested.
        url: String,
        /// What is wrong with the response.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("cannot read or write {path}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// An [`Error::Config`].
    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Config { field, reason: reason.into() }
    }

    /// An [`Error::Model`] from a model error (with its sources) or a message.
    pub(crate) fn model(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Model(metronome_core::ErrorChain(&*e.into()).to_string())
    }
}

impl From<Error> for metronome_core::Error {
    fn from(e: Error) -> Self {
        metronome_core::Error::stage("rollout", e)
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
