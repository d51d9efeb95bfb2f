//! The error type of the stage contracts.

/// Errors crossing a stage boundary.
///
/// Stage crates keep their own error enums and convert at the boundary, usually
/// through [`Error::stage`], so that the source chain is preserved.
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
    /// A stage failed; `stage` names it.
    #[error("{stage}: {source}")]
    Stage {
        /// The failing stage, e.g. `rollout` or `transport`.
        stage: &'static str,
        /// The stage's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
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
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
