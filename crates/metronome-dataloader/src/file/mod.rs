//! Prompt datasets read from files: JSONL and Parquet, through a [`FieldMapping`].
//!
//! A file is read once, completely, when the dataset is opened: every record is
//! validated up front, so a bad record is reported (or skipped and counted) before the
//! run starts rather than hours into it, and shuffling needs random access anyway.
//! RL prompt sets are small (thousands to a few hundred thousand prompts), so holding
//! them in memory is cheap.

mod columnar;
mod jsonl;
mod mapping;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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

/// The records of one file, validated and held in memory.
#[derive(Debug)]
pub struct FileDataset {
    path: PathBuf,
    records: Vec<Record>,
    locations: Vec<Location>,
    report: LoadReport,
}

/// Collects records while a file is read, applying the bad-record policy.
pub(crate) struct Collector {
    path: PathBuf,
    policy: BadRecordPolicy,
    records: Vec<Record>,
    locations: Vec<Location>,
    report: LoadReport,
}

impl Collector {
    fn new(path: &Path, policy: BadRecordPolicy) -> Self {
        Self {
            path: path.to_owned(),
            policy,
            records: Vec::new(),
            locations: Vec::new(),
            report: LoadReport::default(),
        }
    }

    pub(crate) fn keep(&mut self, record: Record, location: Location) {
        self.records.push(record);
        self.locations.push(location);
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

    fn finish(self, format: FileFormat) -> Result<FileDataset> {
        if self.report.skipped > 0 {
            metrics::counter!("metronome_dataloader_records_skipped_total", "format" => format.label())
                .increment(self.report.skipped);
            tracing::warn!(
                target: "metronome_dataloader",
                "{}: skipped {} bad records, kept {}",
                self.path.display(),
                self.report.skipped,
                self.report.kept
            );
        }
        if self.records.is_empty() {
            return Err(if self.report.skipped > 0 {
                Error::NoUsableRecords { path: self.path, skipped: self.report.skipped }
            } else {
                Error::EmptyFile { path: self.path }
            });
        }
        metrics::counter!("metronome_dataloader_records_loaded_total", "format" => format.label())
            .increment(self.report.kept);
        Ok(FileDataset {
            path: self.path,
            records: self.records,
            locations: self.locations,
            report: self.report,
        })
    }
}

impl FileDataset {
    /// Reads a file of the given format.
    pub fn open(
        path: impl AsRef<Path>,
        format: FileFormat,
        fields: &FieldMapping,
        policy: BadRecordPolicy,
    ) -> Result<Self> {
        let path = path.as_ref();
        let mut collector = Collector::new(path, policy);
        match format {
            FileFormat::Jsonl => jsonl::read(path, fields, &mut collector)?,
            FileFormat::Parquet => columnar::read(path, fields, &mut collector)?,
        }
        collector.finish(format)
    }

    /// Reads a JSONL file: one JSON object per line. A record's id is its index among
    /// the file's non-blank lines, so skipping a bad line does not renumber the rest.
    pub fn open_jsonl(
        path: impl AsRef<Path>,
        fields: &FieldMapping,
        policy: BadRecordPolicy,
    ) -> Result<Self> {
        Self::open(path, FileFormat::Jsonl, fields, policy)
    }

    /// Reads a Parquet file; a record's id is its row index. Only the mapped columns
    /// are read.
    pub fn open_parquet(
        path: impl AsRef<Path>,
        fields: &FieldMapping,
        policy: BadRecordPolicy,
    ) -> Result<Self> {
        Self::open(path, FileFormat::Parquet, fields, policy)
    }

    /// The file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many records were kept and skipped.
    #[must_use]
    pub fn report(&self) -> &LoadReport {
        &self.report
    }
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
            Some(location) => format!("{} {location}", self.path.display()),
            None => format!("{} record {index}", self.path.display()),
        }
    }
}
