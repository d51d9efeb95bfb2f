//! The pipeline's error type.

use metronome_core::{PeriodId, PolicyVersion, PromptId};

/// What can stop a run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A stage returned an error.
    #[error(transparent)]
    Stage(#[from] metronome_core::Error),
    /// The group stream ended before the period's groups were all in.
    #[error("the group stream closed during period {period} after {received} of {expected} groups")]
    StreamClosed {
        /// The period being trained.
        period: PeriodId,
        /// Groups received for it.
        received: usize,
        /// Groups released for it.
        expected: usize,
    },
    /// The generation side failed; its error is the source.
    #[error("generation failed in period {period}")]
    Generation {
        /// The period being generated.
        period: PeriodId,
        /// The stage error.
        #[source]
        source: metronome_core::Error,
    },
    /// The prompt source released a period holding one prompt twice: its two groups
    /// would share one identity, and the second would be taken for a redelivery.
    #[error(
        "period {period} holds prompt {prompt} twice; a prompt source must release distinct prompts per period"
    )]
    RepeatedPrompt {
        /// The period.
        period: PeriodId,
        /// The repeated prompt.
        prompt: PromptId,
    },
    /// Invalid configuration; `key` names the setting.
    #[error("invalid configuration `{key}`: {reason}")]
    Config {
        /// The configuration key at fault.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The trainer broke the version contract of `metronome_core::Trainer`: a step
    /// must advance the version by exactly one, applied or refused.
    #[error(
        "the trainer's step closing period {period} moved its version from {before} to {after} \
         (reported {reported}); a step must advance it by exactly one, also when it refuses the \
         update, or the schedules wait for a version that never comes"
    )]
    TrainerVersion {
        /// The period the step closed.
        period: PeriodId,
        /// The version before the step.
        before: PolicyVersion,
        /// The version after it.
        after: PolicyVersion,
        /// The version the step report named.
        reported: PolicyVersion,
    },
    /// A background task panicked or was cancelled.
    #[error("the {0} task stopped unexpectedly")]
    TaskLost(&'static str),
    /// Reading or writing a file of the run directory failed; `path` names the file.
    #[error("cannot write or read `{}`", path.display())]
    Io {
        /// The file or directory at fault.
        path: std::path::PathBuf,
        /// The I/O error (or, for plots and `metrics.jsonl` lines, what went wrong).
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// A stage's failure, named `stage`.
    pub(crate) fn stage(
        stage: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self::Stage(metronome_core::Error::stage(stage, source))
    }

    /// Whether this is the transport's failure (directly, or under the generation that
    /// was publishing a group), which a reconnection may heal.
    #[must_use]
    pub fn is_transport(&self) -> bool {
        match self {
            Self::Stage(e) | Self::Generation { source: e, .. } => e.is_transport(),
            _ => false,
        }
    }
}

/// Each stage crate's error is that stage's failure, named after it; the rollout
/// engine's config errors are config errors, naming their `rollout.` key.
macro_rules! stage_errors {
    ($($error:ty => $stage:literal),* $(,)?) => {$(
        impl From<$error> for Error {
            fn from(e: $error) -> Self {
                Self::stage($stage, e)
            }
        }
    )*};
}

stage_errors! {
    metronome_model::Error => "model",
    metronome_dataloader::Error => "dataloader",
    metronome_reward::Error => "reward",
    metronome_trainer::TrainerError => "trainer",
}

impl From<metronome_rollout::Error> for Error {
    fn from(e: metronome_rollout::Error) -> Self {
        match e {
            metronome_rollout::Error::Config { field, reason } => {
                Self::Config { key: format!("rollout.{field}"), reason }
            }
            other => Self::stage("rollout", other),
        }
    }
}

impl From<metronome_transport::Error> for Error {
    fn from(e: metronome_transport::Error) -> Self {
        Self::Stage(e.into())
    }
}

/// `Result` with the pipeline's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
