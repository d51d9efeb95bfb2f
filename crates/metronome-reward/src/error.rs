//! The crate's error type.
//!
//! Errors here are configuration and transport problems. A completion that cannot be
//! parsed or verified is not an error: it is a score (and a part in the breakdown),
//! and a scorer that panics or hangs is a counted failure inside a [`metronome_core::Reward`].

/// Errors of the reward stage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is unusable; `field` names it.
    #[error("reward config field `{field}` {reason}")]
    Config {
        /// The field at fault, e.g. `format.pattern`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The worker pool could not start its threads.
    #[error("reward worker pool could not start a thread")]
    Spawn(#[source] std::io::Error),
    /// The code sandbox cannot be created on this machine (a missing binary, user
    /// namespaces disabled, a probe program that fails). Never worked around by
    /// running programs unsandboxed.
    #[error("code sandbox cannot start on this machine: {reason}")]
    Sandbox {
        /// What is missing or failed.
        reason: String,
    },
    /// The judge's server cannot be used: unreachable at start-up, or without the
    /// configured model.
    #[error("judge at {url} {reason}")]
    Judge {
        /// The judge's base URL (`judge.url`).
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The remote scorer could not be built. The HTTP client's error ends the chain:
    /// it is printed with its own sources, which hold the actual cause.
    #[error("remote scorer at {url}: {}", metronome_core::ErrorChain(error))]
    Remote {
        /// The scorer's URL.
        url: String,
        /// The HTTP client's error.
        error: reqwest::Error,
    },
}

impl Error {
    /// An [`Error::Config`].
    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config { field: field.into(), reason: reason.into() }
    }
}

/// Checks that every score of a config is finite; the error names the first that is not.
pub(crate) fn finite_scores(scores: &[(&str, f32)]) -> Result<()> {
    match scores.iter().find(|(_, v)| !v.is_finite()) {
        Some(&(field, v)) => Err(Error::config(field, format!("must be finite, got {v}"))),
        None => Ok(()),
    }
}

impl From<Error> for metronome_core::Error {
    fn from(e: Error) -> Self {
        metronome_core::Error::stage("reward", e)
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
