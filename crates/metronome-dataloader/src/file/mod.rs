//! Prompt datasets read from files: JSONL and Parquet, single files or directories of
//! shards, through a [`FieldMapping`].
//!
//! A file is read once, completely, when the dataset is opened: every record is
//! validated up front, so a bad record is reported (or skipped and counted) before the
//! run starts rather than hours into it, and shuffling needs random access anyway.
//! RL prompt sets are small (thousands to a few hundred thousand prompts), so holding
//! them in memory is cheap.

mod code;
mod columnar;
mod jsonl;
mod mapping;

use std::path::{Path, PathBuf};

use metronome_core::PromptId;
use serde::{Deserialize, Serialize};

pub use code::{CodeFileConfig, CodeFormat};
pub use mapping::FieldMapping;

use crate::dataset::{Dataset, Record};
use crate::error::{Error, Location, Result};

/// What to do with a malformed record, a missing mapped field or a field of the wrong
/// type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BadRecordPolicy {
    /// Stop with an error naming the file, line or row, and field.
    #[default]
    Fail,
    /// Leave the record out, count it in the [`LoadReport`] and the
    /// `metronome_dataloader_records_skipped_total` counter, and log it.
    Skip,
}

/// The file formats a [`FileDataset`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileFormat {
    /// One JSON object per line; blank lines are ignored.
    Jsonl,
    /// An Apache Parquet file (plain or Snappy-compressed pages).
    Parquet,
}

impl FileFormat {
    fn label(self) -> &'static str {
        match self {
            Self::Jsonl => "jsonl",
            Self::Parquet => "parquet",
        }
    }
}

/// How many records of a file were kept and skipped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Records kept.
    pub kept: u64,
    /// Bad records skipped under [`BadRecordPolicy::Skip`].
    pub skipped: u64,
    /// The messages of the first skipped records (at most [`LoadReport::EXAMPLES`]).
    pub skipped_examples: Vec<String>,
}

impl LoadReport {
    /// How many skip messages are kept as examples (and logged one by one).
    pub const EXAMPLES: usize = 16;
}

/// The records of one file, or of every file of a directory (shards), validated and
/// held in memory.
#[derive(Debug)]
pub struct FileDataset {
    path: PathBuf,
    files: Vec<PathBuf>,
    records: Vec<Record>,
    /// Per record: index into `files`, and line or row there.
    locations: Vec<(u32, Location)>,
    report: LoadReport,
}

/// Collects records while files are read, applying the bad-record policy.
pub(crate) struct Collector {
    policy: BadRecordPolicy,
    file: u32,
    /// Record ids used by earlier files: ids run on across shards.
    base: u64,
    records: Vec<Record>,
    locations: Vec<(u32, Location)>,
    report: LoadReport,
}

impl Collector {
    fn new(policy: BadRecordPolicy) -> Self {
        Self {
            policy,
            file: 0,
            base: 0,
            records: Vec::new(),
            locations: Vec::new(),
            report: LoadReport::default(),
        }
    }

    /// The id of the current file's record `local` (counted from 0).
    pub(crate) fn id(&self, local: u64) -> PromptId {
        PromptId(self.base + local)
    }

    pub(crate) fn keep(&mut self, record: Record, location: Location) {
        self.records.push(record);
        self.locations.push((self.file, location));
        self.report.kept += 1;
    }

    /// Records a bad record: an error under [`BadRecordPolicy::Fail`], a count under
    /// [`BadRecordPolicy::Skip`].
    pub(crate) fn bad(&mut self, error: Error) -> Result<()> {
        match self.policy {
            BadRecordPolicy::Fail => Err(error),
            BadRecordPolicy::Skip => {
                self.report.skipped += 1;
                if self.report.skipped_examples.len() < LoadReport::EXAMPLES {
                    tracing::warn!(target: "metronome_dataloader", "skipping bad record: {error}");
                    self.report.skipped_examples.push(error.to_string());
                }
                Ok(())
            }
        }
    }

    fn finish(self, path: PathBuf, files: Vec<PathBuf>, format: FileFormat) -> Result<FileDataset> {
        if self.report.skipped > 0 {
            crate::metrics::records_skipped(format.label(), self.report.skipped);
            tracing::warn!(
                target: "metronome_dataloader",
                "{}: skipped {} bad records, kept {}",
                path.display(),
                self.report.skipped,
                self.report.kept
            );
        }
        if self.records.is_empty() {
            return Err(Error::NoUsableRecords { path, skipped: self.report.skipped });
        }
        crate::metrics::records_loaded(format.label(), self.report.kept);
        Ok(FileDataset { path, files, records: self.records, locations: self.locations, report: self.report })
    }
}

impl FileDataset {
    /// Reads a file of the given format, or every file of a directory whose name ends
    /// in `.jsonl` (respectively `.parquet`), in name order, as one dataset whose ids
    /// run on from file to file. An empty file is an error.
    pub fn open(
        path: impl AsRef<Path>,
        format: FileFormat,
        fields: &FieldMapping,
        policy: BadRecordPolicy,
    ) -> Result<Self> {
        let path = path.as_ref();
        let files = shards(path, format)?;
        let mut collector = Collector::new(policy);
        for (index, file) in files.iter().enumerate() {
            collector.file = u32::try_from(index).unwrap_or(u32::MAX);
            let used = match format {
                FileFormat::Jsonl => jsonl::read(file, fields, &mut collector)?,
                FileFormat::Parquet => columnar::read_guarded(file, fields, &mut collector)?,
            };
            if used == 0 {
                return Err(Error::EmptyFile { path: file.clone() });
            }
            collector.base += used;
        }
        collector.finish(path.to_owned(), files, format)
    }

    /// Reads a JSONL file (or directory of them): one JSON object per line. A record's
    /// id is its index among the non-blank lines, so skipping a bad line does not
    /// renumber the rest.
    pub fn open_jsonl(
        path: impl AsRef<Path>,
        fields: &FieldMapping,
        policy: BadRecordPolicy,
    ) -> Result<Self> {
        Self::open(path, FileFormat::Jsonl, fields, policy)
    }

    /// Reads a Parquet file (or directory of them); a record's id is its row index.
    /// Only the mapped columns are read.
    pub fn open_parquet(
        path: impl AsRef<Path>,
        fields: &FieldMapping,
        policy: BadRecordPolicy,
    ) -> Result<Self> {
        Self::open(path, FileFormat::Parquet, fields, policy)
    }

    /// The file or directory that was opened.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The files read, in id order.
    #[must_use]
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// How many records were kept and skipped.
    #[must_use]
    pub fn report(&self) -> &LoadReport {
        &self.report
    }
}

/// The files behind `path`: itself, or a directory's files with the format's
/// extension in name order (so shard `-00001-` precedes `-00002-`).
fn shards(path: &Path, format: FileFormat) -> Result<Vec<PathBuf>> {
    let io = |source| Error::Io { path: path.to_owned(), source };
    if !std::fs::metadata(path).map_err(io)?.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(io)? {
        let file = entry.map_err(io)?.path();
        if file.is_file() && file.extension().is_some_and(|e| e == format.label()) {
            files.push(file);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(Error::EmptyDirectory { path: path.to_owned(), extension: format.label() });
    }
    Ok(files)
}

impl Dataset for FileDataset {
    fn len(&self) -> usize {
        self.records.len()
    }

    fn record(&self, index: usize) -> Result<Record> {
        self.records.get(index).cloned().ok_or_else(|| Error::Cursor {
            cursor: format!("record {index}"),
            reason: format!("is past the end of {} ({} records)", self.path.display(), self.records.len()),
        })
    }

    fn place(&self, index: usize) -> String {
        match self.locations.get(index) {
            Some((file, location)) => {
                let file = self.files.get(*file as usize).unwrap_or(&self.path);
                format!("{} {location}", file.display())
            }
            None => format!("{} record {index}", self.path.display()),
        }
    }
}
