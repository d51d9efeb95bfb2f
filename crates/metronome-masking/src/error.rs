//! The crate's error type.

use metronome_core::GroupKey;

/// Why a group could not be laid out, or a packing configuration is unusable.
///
/// Every group-level variant names the group by its [`GroupKey`] so a log line points
/// at the prompt and period at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MaskingError {
    /// The prompt has no tokens: there is no position to predict the first response token.
    #[error("group {group} has a zero-length prompt")]
    EmptyPrompt {
        /// The group at fault.
        group: GroupKey,
    },
    /// The group has no completions.
    #[error("group {group} has no completions")]
    NoCompletions {
        /// The group at fault.
        group: GroupKey,
    },
    /// A completion has no tokens, so it has nothing to train on.
    #[error("group {group}, completion {sample} is an empty response")]
    EmptyResponse {
        /// The group at fault.
        group: GroupKey,
        /// The completion's index within the group.
        sample: usize,
    },
    /// A completion's episode names observation spans that do not fit its tokens, or
    /// leaves no token of the policy's to train on.
    #[error("group {group}, completion {sample} {reason}")]
    Episode {
        /// The group at fault.
        group: GroupKey,
        /// The completion's index within the group.
        sample: usize,
        /// What is wrong.
        reason: String,
    },
    /// A completion's `sample_index` is not its place in the group.
    #[error("group {group}, completion {sample} has sample_index {found} (expected {sample})")]
    SampleIndex {
        /// The group at fault.
        group: GroupKey,
        /// The completion's place within the group.
        sample: usize,
        /// The `sample_index` it carries.
        found: u32,
    },
    /// A completion's behaviour log-probs are not aligned with its tokens.
    #[error("group {group}, completion {sample} has {logprobs} log-probs for {tokens} tokens")]
    LogprobMismatch {
        /// The group at fault.
        group: GroupKey,
        /// The completion's index within the group.
        sample: usize,
        /// Number of tokens.
        tokens: usize,
        /// Number of log-probs.
        logprobs: usize,
    },
    /// The group has a different number of rewards (or advantages) than completions.
    #[error("group {group} has {found} {field} for {completions} completions")]
    ScoreMismatch {
        /// The group at fault.
        group: GroupKey,
        /// `rewards` or `advantages`.
        field: &'static str,
        /// How many the group carries.
        found: usize,
        /// Number of completions.
        completions: usize,
    },
    /// The group does not fit one row or micro-batch and splitting is disabled.
    #[error(
        "group {group} needs {tokens} tokens, over the budget of {budget}, and splitting over-budget groups is disabled"
    )]
    GroupOverBudget {
        /// The group at fault.
        group: GroupKey,
        /// Tokens the group needs in the configured layout.
        tokens: usize,
        /// The budget it exceeds.
        budget: usize,
    },
    /// One response with its prompt does not fit the budget, so not even splitting helps.
    #[error(
        "group {group}, completion {sample} needs {tokens} tokens with its prompt, over the budget of {budget}"
    )]
    ResponseOverBudget {
        /// The group at fault.
        group: GroupKey,
        /// The completion's index within the group.
        sample: usize,
        /// Tokens the response needs with its prompt.
        tokens: usize,
        /// The budget it exceeds.
        budget: usize,
    },
    /// A row would exceed the `u32` positions the layout types can address.
    #[error("group {group} makes a row of {tokens} positions, more than a row can address")]
    RowTooLong {
        /// The group at fault.
        group: GroupKey,
        /// Positions the row would hold.
        tokens: usize,
    },
    /// The packing configuration cannot work.
    #[error("packing config field {field} {reason}")]
    Config {
        /// The field at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// `Result` with [`MaskingError`].
pub type Result<T, E = MaskingError> = std::result::Result<T, E>;

impl From<MaskingError> for metronome_core::Error {
    fn from(e: MaskingError) -> Self {
        metronome_core::Error::stage("masking", e)
    }
}
