//! The serde configuration that builds a [`PromptLoader`].

use std::path::PathBuf;
use std::sync::Arc;

use metronome_core::{RunSeed, Tokenizer};
use serde::{Deserialize, Serialize};

use crate::dataset::Dataset;
use crate::error::Result;
use crate::file::{
    BadRecordPolicy, CodeFileConfig, CodeFormat, FieldMapping, FileDataset, FileFormat, LoadReport,
};
use crate::loader::PromptLoader;
use crate::plan::ReleaseConfig;
use crate::render::PromptConfig;
use crate::tasks::{
    ArithmeticConfig, ArithmeticTask, CodeTask, CodeTaskConfig, CopyConfig, CopyTask, CountdownConfig,
    CountdownTask, WordProblemConfig, WordProblemTask,
};

/// A file source: where it is, how its fields map, what to do with bad records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSourceConfig {
    /// The file, or a directory whose `.jsonl` / `.parquet` files (shards) are read in
    /// name order as one dataset.
    pub path: PathBuf,
    /// Which fields are the prompt, the reference and the metadata.
    #[serde(default)]
    pub fields: FieldMapping,
    /// Fail on the first bad record, or skip and count bad records.
    #[serde(default)]
    pub on_bad_record: BadRecordPolicy,
}

/// Where prompts come from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceConfig {
    /// A JSONL file.
    Jsonl(FileSourceConfig),
    /// A Parquet file.
    Parquet(FileSourceConfig),
    /// The procedural arithmetic task.
    Arithmetic(ArithmeticConfig),
    /// The procedural countdown task.
    Countdown(CountdownConfig),
    /// The procedural grade-school word problems (GSM8K-style stories of 2 to 4
    /// operations, answers checked by the math verifier).
    WordProblems(WordProblemConfig),
    /// The procedural copy task with long-tail lengths.
    Copy(CopyConfig),
    /// The procedural code task: small functions and programs with their tests.
    Code(CodeTaskConfig),
    /// HumanEval's JSONL: code tasks whose tests are the reference.
    Humaneval(CodeFileConfig),
    /// MBPP's JSONL: code tasks whose tests are the reference.
    Mbpp(CodeFileConfig),
    /// The built-in task of the embedded run: [`ArithmeticConfig::default`], short
    /// prompts like `12+7=` with answer `19`.
    #[default]
    Default,
}

/// An opened source: the dataset and, for files, what loading kept and skipped.
#[derive(Debug)]
pub struct OpenedSource {
    /// The records.
    pub dataset: Arc<dyn Dataset>,
    /// The load report of a file source.
    pub report: Option<LoadReport>,
}

impl SourceConfig {
    /// Reads the file or sets up the generator. Generators are seeded by the run seed
    /// unless their config fixes a seed.
    pub fn open(&self, run: RunSeed) -> Result<OpenedSource> {
        let file = |c: &FileSourceConfig, format| -> Result<OpenedSource> {
            let dataset = FileDataset::open(&c.path, format, &c.fields, c.on_bad_record)?;
            let report = Some(dataset.report().clone());
            Ok(OpenedSource { dataset: Arc::new(dataset), report })
        };
        let task = |dataset: Arc<dyn Dataset>| OpenedSource { dataset, report: None };
        let code = |c: &CodeFileConfig, format| -> Result<OpenedSource> {
            let dataset = FileDataset::open_code(&c.path, format, c)?;
            let report = Some(dataset.report().clone());
            Ok(OpenedSource { dataset: Arc::new(dataset), report })
        };
        Ok(match self {
            Self::Jsonl(c) => file(c, FileFormat::Jsonl)?,
            Self::Parquet(c) => file(c, FileFormat::Parquet)?,
            Self::Arithmetic(c) => task(Arc::new(ArithmeticTask::new(c.clone(), run)?)),
            Self::Countdown(c) => task(Arc::new(CountdownTask::new(c.clone(), run)?)),
            Self::WordProblems(c) => task(Arc::new(WordProblemTask::new(c.clone(), run)?)),
            Self::Copy(c) => task(Arc::new(CopyTask::new(c.clone(), run)?)),
            Self::Code(c) => task(Arc::new(CodeTask::new(c.clone(), run)?)),
            Self::Humaneval(c) => code(c, CodeFormat::Humaneval)?,
            Self::Mbpp(c) => code(c, CodeFormat::Mbpp)?,
            Self::Default => task(Arc::new(ArithmeticTask::new(ArithmeticConfig::default(), run)?)),
        })
    }
}

/// Everything the data loader needs besides the run seed and the tokenizer.
///
/// In TOML:
///
/// ```toml
/// [source]
/// kind = "jsonl"
/// path = "train.jsonl"
/// fields = { prompt = "question", reference = "answer", metadata = { level = "level" } }
/// on_bad_record = "skip"
///
/// [release]
/// batch_size = 32
/// epochs = 3
///
/// [prompt]
/// chat_template = true
/// max_tokens = 512
/// on_overlong = "skip"
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoaderConfig {
    /// Where prompts come from.
    pub source: SourceConfig,
    /// Batch size, epochs, shuffling, prefetching.
    pub release: ReleaseConfig,
    /// Chat template and length limit.
    pub prompt: PromptConfig,
}

impl LoaderConfig {
    /// Checks the release and prompt values before anything is read.
    pub fn validate(&self) -> Result<()> {
        self.release.validate()?;
        self.prompt.validate()
    }

    /// Opens the source and builds the loader at the start of the run.
    pub fn build(&self, run: RunSeed, tokenizer: Arc<dyn Tokenizer>) -> Result<PromptLoader> {
        self.validate()?;
        let OpenedSource { dataset, report } = self.source.open(run)?;
        let loader = PromptLoader::new(dataset, tokenizer, run, self.release.clone(), self.prompt.clone())?;
        Ok(match report {
            Some(report) => loader.with_load_report(report),
            None => loader,
        })
    }
}
