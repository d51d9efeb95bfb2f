//! The error type of the stage contracts.

/// Errors crossing a stage boundary.
///
/// Stage crates keep their own error enums and convert at the boundary, usually
/// through [`Error::stage`], so that the source chain is preserved. As in every
/// Metronome error, a message never repeats its source: `{e}` is this error's own
/// message, and the whole chain is `{e:#}` of an `anyhow::Error` or [`ErrorChain`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Input that breaks a contract; `what` names the place (file and line, field,
    /// group), `reason` what is wrong there.
    #[error("{what} {reason}")]
    Invalid {
        /// The place at fault.
        what: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The other side of a channel or connection has gone away.
    #[error("{0} is closed")]
    Closed(String),
    /// A stage failed; `stage` names it, `source` says how.
    #[error("{stage}")]
    Stage {
        /// The failing stage, e.g. `rollout` or `transport`.
        stage: &'static str,
        /// The stage's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The transport between processes failed (a connection, a publish, a fetch):
    /// unlike a stage's failure, a reconnection may heal it, so a caller that can wait
    /// (a rollout worker whose claims come back after their lease) retries instead of
    /// giving up. Transport crates convert their errors to it through
    /// [`Error::transport`].
    #[error("transport")]
    Transport(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl Error {
    /// An [`Error::Invalid`].
    pub fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid { what: what.into(), reason: reason.into() }
    }

    /// An [`Error::Stage`] wrapping a stage's own error.
    pub fn stage(
        stage: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self::Stage { stage, source: source.into() }
    }

    /// An [`Error::Transport`] wrapping the transport's own error.
    pub fn transport(source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        Self::Transport(source.into())
    }

    /// Whether this is the transport's failure, which a reconnection may heal.
    #[must_use]
    pub fn is_transport(&self) -> bool {
        matches!(self, Self::Transport(_))
    }
}

/// Displays an error and its sources on one line, `error: source: source…`, as
/// `anyhow` does with `{:#}`: for libraries that log an error or put it into a
/// message of their own, since an error's `Display` is its own message only.
///
/// ```
/// # use metronome_core::{Error, ErrorChain};
/// let e = Error::stage("rollout", std::io::Error::other("worker 0 is gone"));
/// assert_eq!(e.to_string(), "rollout");
/// assert_eq!(ErrorChain(&e).to_string(), "rollout: worker 0 is gone");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
