//! The data loader's error type.

use std::path::PathBuf;

use metronome_core::PromptId;

/// Everything that can go wrong while loading, generating, tokenising or releasing
/// prompts. Every variant names the place at fault: a file with its line or row and
/// field, a generator item, a prompt id, or a configuration key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be opened or read.
    #[error("cannot read {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file is compressed (gzip), as `HumanEval.jsonl.gz` ships.
    #[error("{} is gzip-compressed: decompress it first (gunzip -k {})", path.display(), path.display())]
    Compressed {
        /// The file.
        path: PathBuf,
    },
    /// A file holds no records at all.
    #[error("{} is empty: it holds no records", path.display())]
    EmptyFile {
        /// The file.
        path: PathBuf,
    },
    /// A directory given as a source holds no file of the source's format.
    #[error("{} holds no `.{extension}` files", path.display())]
    EmptyDirectory {
        /// The directory.
        path: PathBuf,
        /// The extension looked for.
        extension: &'static str,
    },
    /// Every record of a file was bad and skipped under the skip policy.
    #[error("{} has no usable records: all {skipped} were skipped as bad", path.display())]
    NoUsableRecords {
        /// The file.
        path: PathBuf,
        /// How many records were skipped.
        skipped: u64,
    },
    /// One record of a file is malformed, lacks a mapped field or has a field of the
    /// wrong type.
    #[error("{}, {location}{}: {reason}", path.display(), field.as_ref().map(|f| format!(", field `{f}`")).unwrap_or_default())]
    BadRecord {
        /// The file.
        path: PathBuf,
        /// The line (JSONL) or row (Parquet), counted from 1.
        location: Location,
        /// The mapped field at fault, when one is.
        field: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// A mapped column does not exist in a Parquet file's schema.
    #[error("{}: field `{field}` is not a column of the file (columns: {columns})", path.display())]
    MissingColumn {
        /// The file.
        path: PathBuf,
        /// The mapped field.
        field: String,
        /// The columns the file does have, comma-separated.
        columns: String,
    },
    /// A mapped Parquet column has a type the loader cannot read (e.g. binary, dates).
    #[error("{}: field `{field}` has unsupported column type {data_type}", path.display())]
    UnsupportedColumn {
        /// The file.
        path: PathBuf,
        /// The column.
        field: String,
        /// Its Arrow data type.
        data_type: String,
    },
    /// The Parquet reader failed on a file (not a Parquet file, corrupt pages,
    /// unsupported compression).
    #[error("the Parquet reader failed on {}", path.display())]
    Parquet {
        /// The file.
        path: PathBuf,
        /// The reader's error.
        #[source]
        source: parquet::errors::ParquetError,
    },
    /// A prompt has more tokens than allowed and the policy is to reject.
    #[error("prompt {prompt} ({place}) has {tokens} tokens, more than the maximum of {max}")]
    PromptTooLong {
        /// The prompt.
        prompt: PromptId,
        /// Where it comes from (file and line, or generator item).
        place: String,
        /// Its token count.
        tokens: usize,
        /// The configured maximum.
        max: usize,
    },
    /// No prompt of a whole epoch fits the maximum prompt length, so no batch can be
    /// formed.
    #[error("none of the {len} prompts of the dataset fits within {max} tokens")]
    NothingFits {
        /// The dataset's size.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// Rendering or tokenising one prompt failed.
    #[error("prompt {prompt} ({place}): {reason}")]
    Prompt {
        /// The prompt.
        prompt: PromptId,
        /// Where it comes from.
        place: String,
        /// What failed.
        reason: String,
    },
    /// A generator could not produce an item with the configured knobs.
    #[error("{task} item {item}: {reason}")]
    Generator {
        /// The task, e.g. `countdown`.
        task: &'static str,
        /// The item index.
        item: u64,
        /// What failed.
        reason: String,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("config `{key}`: {reason}")]
    Config {
        /// The key at fault, e.g. `release.batch_size`.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A cursor cannot be restored on this dataset and configuration.
    #[error("cursor {cursor}: {reason}")]
    Cursor {
        /// The cursor, as `period/epoch/offset`.
        cursor: String,
        /// Why it does not fit.
        reason: String,
    },
    /// Planning a batch panicked: a bug in a dataset or tokenizer implementation. The
    /// loader stays usable; the same cursor will most likely panic again.
    #[error("planning the batch of period {period} panicked: {message}")]
    PlanningPanicked {
        /// The period being planned.
        period: u64,
        /// The panic's message.
        message: String,
    },
    /// The planning thread could not be started, or stopped without delivering.
    #[error("the planning thread stopped without delivering the batch of period {period}")]
    PrefetchLost {
        /// The period it was preparing.
        period: u64,
    },
}

/// A record's place in a file, counted from 1 as editors and `head -n` count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// A JSONL line.
    Line(u64),
    /// A Parquet row.
    Row(u64),
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Line(n) => write!(f, "line {n}"),
            Self::Row(n) => write!(f, "row {n}"),
        }
    }
}

impl Error {
    /// A [`Error::Config`] for `key`.
    pub(crate) fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config { key: key.into(), reason: reason.into() }
    }
}

impl From<Error> for metronome_core::Error {
    fn from(error: Error) -> Self {
        metronome_core::Error::stage("dataloader", error)
    }
}

/// `Result` with the data loader's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
