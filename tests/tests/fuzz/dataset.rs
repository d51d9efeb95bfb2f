//! Dataset rows: JSONL files through a field mapping, HumanEval and MBPP files, and
//! Parquet files (their bytes, and columns of every type the reader meets), read by
//! `FileDataset` under both bad-record policies.
//!
//! Asserts: no panic; an error names the file (and a bad record its line or row,
//! and field); a dataset that opens holds at least one record, each readable and
//! placed in the file.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use arrow_array::builder::{ListBuilder, StringBuilder};
use arrow_array::types::Int32Type;
use arrow_array::{
    ArrayRef, BinaryArray, BooleanArray, DictionaryArray, Float64Array, Int64Array, LargeStringArray,
    NullArray, RecordBatch, StringArray, StructArray,
};
use arrow_schema::{DataType, Field};
use metronome_dataloader::{BadRecordPolicy, CodeFileConfig, CodeFormat, Dataset, FieldMapping, FileDataset};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;
use serde_json::{Value, json};

use crate::mutate::{
    ByteOp, LineOp, Mutations, apply_bytes, apply_lines, byte_op, line_op, mutate_json, mutations,
};

/// A column of a generated Parquet file, one value per row.
#[derive(Clone, Debug)]
pub(crate) enum Column {
    Text(Vec<Option<String>>),
    LargeText(Vec<Option<String>>),
    Int(Vec<Option<i64>>),
    Float(Vec<Option<f64>>),
    Bool(Vec<Option<bool>>),
    Strings(Vec<Option<Vec<Option<String>>>>),
    /// A struct with one text field, `level`.
    Level(Vec<Option<String>>),
    Dictionary(Vec<Option<String>>),
    Binary(Vec<Option<Vec<u8>>>),
    Null(usize),
}

#[derive(Clone, Debug)]
pub(crate) enum Input {
    Jsonl { rows: Vec<(usize, Mutations)>, lines: Vec<LineOp>, bytes: Vec<ByteOp>, skip: bool },
    Code { mbpp: bool, rows: Vec<Mutations>, template: Option<&'static str>, skip: bool },
    ParquetBytes { ops: Vec<ByteOp>, skip: bool },
    ParquetColumns { columns: Vec<(&'static str, Column)>, skip: bool },
}

/// JSONL rows: a question with a reference and metadata, and a chat.
fn jsonl_seeds() -> [Value; 2] {
    [
        json!({"question": "12+7=", "answer": 19, "meta": {"level": "L1", "tags": ["a", "b"]}, "numbers": [12, 7]}),
        json!({"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
               "answer": "4", "meta": {"level": 2}, "numbers": []}),
    ]
}

fn mapping() -> FieldMapping {
    FieldMapping {
        prompt: "question".into(),
        reference: Some("answer".into()),
        metadata: BTreeMap::from([
            ("level".into(), "meta.level".into()),
            ("numbers".into(), "numbers".into()),
        ]),
    }
}

fn code_seed(mbpp: bool) -> &'static Value {
    static SEEDS: OnceLock<[Value; 2]> = OnceLock::new();
    let seeds = SEEDS.get_or_init(|| {
        let first = |text: &str| serde_json::from_str(text.lines().next().unwrap()).unwrap();
        [
            first(include_str!("../../../crates/metronome-dataloader/tests/data/humaneval_sample.jsonl")),
            first(include_str!("../../../crates/metronome-dataloader/tests/data/mbpp_sample.jsonl")),
        ]
    });
    &seeds[usize::from(mbpp)]
}

fn text() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        4 => select(&["12+7=", "", " ", "L1", "é", "\0", "{prompt}", "a.b"][..]).prop_map(|s| Some(s.to_owned())),
        2 => "\\PC{0,8}".prop_map(Some),
        1 => Just(None),
        1 => select(&[1_000usize, 70_000][..]).prop_map(|n| Some("x".repeat(n))),
    ]
}

fn column(rows: usize) -> impl Strategy<Value = Column> {
    use proptest::collection::vec;
    let ints = prop_oneof![select(&[0i64, -1, i64::MAX, i64::MIN][..]), any::<i64>()];
    let floats = select(&[0.0, -0.0, 1e30, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 5e-324, 19.0][..]);
    prop_oneof![
        3 => vec(text(), rows).prop_map(Column::Text),
        1 => vec(text(), rows).prop_map(Column::LargeText),
        2 => vec(proptest::option::of(ints), rows).prop_map(Column::Int),
        2 => vec(proptest::option::of(floats), rows).prop_map(Column::Float),
        1 => vec(proptest::option::of(any::<bool>()), rows).prop_map(Column::Bool),
        2 => vec(proptest::option::of(vec(text(), 0..4)), rows).prop_map(Column::Strings),
        2 => vec(text(), rows).prop_map(Column::Level),
        1 => vec(text(), rows).prop_map(Column::Dictionary),
        1 => vec(proptest::option::of(vec(any::<u8>(), 0..4)), rows).prop_map(Column::Binary),
        1 => Just(Column::Null(rows)),
    ]
}

fn columns() -> impl Strategy<Value = Vec<(&'static str, Column)>> {
    (1..6usize).prop_flat_map(|rows| {
        let name = select(&["question", "answer", "meta", "numbers", "other", "meta.level"][..]);
        proptest::collection::vec((name, column(rows)), 1..5)
    })
}

fn input() -> impl Strategy<Value = Input> {
    let skip = any::<bool>();
    let few = |n| proptest::collection::vec(byte_op(), 0..n);
    prop_oneof![
        4 => (
            proptest::collection::vec((0..2usize, mutations()), 1..4),
            prop_oneof![4 => Just(Vec::new()), 1 => proptest::collection::vec(line_op(), 1..3)],
            prop_oneof![4 => Just(Vec::new()), 1 => few(3)],
            skip,
        )
            .prop_map(|(rows, lines, bytes, skip)| Input::Jsonl { rows, lines, bytes, skip }),
        2 => (
            any::<bool>(),
            proptest::collection::vec(mutations(), 1..3),
            prop_oneof![
                4 => Just(None),
                1 => select(&["", "{prompt}{prompt}", "{text}\n{tests}", "{tests}", "{nope}", "{{prompt}}"][..]).prop_map(Some),
            ],
            skip,
        )
            .prop_map(|(mbpp, rows, template, skip)| Input::Code { mbpp, rows, template, skip }),
        2 => (proptest::collection::vec(byte_op(), 1..4), skip)
            .prop_map(|(ops, skip)| Input::ParquetBytes { ops, skip }),
        2 => (columns(), skip).prop_map(|(columns, skip)| Input::ParquetColumns { columns, skip }),
    ]
}

fn array(column: &Column) -> ArrayRef {
    match column {
        Column::Text(v) => Arc::new(StringArray::from(v.clone())),
        Column::LargeText(v) => Arc::new(LargeStringArray::from(v.clone())),
        Column::Int(v) => Arc::new(Int64Array::from(v.clone())),
        Column::Float(v) => Arc::new(Float64Array::from(v.clone())),
        Column::Bool(v) => Arc::new(BooleanArray::from(v.clone())),
        Column::Strings(v) => {
            let mut b = ListBuilder::new(StringBuilder::new());
            for row in v {
                match row {
                    Some(items) => {
                        for item in items {
                            b.values().append_option(item.as_deref());
                        }
                        b.append(true);
                    }
                    None => b.append(false),
                }
            }
            Arc::new(b.finish())
        }
        Column::Level(v) => {
            let level: ArrayRef = Arc::new(StringArray::from(v.clone()));
            Arc::new(StructArray::from(vec![(Arc::new(Field::new("level", DataType::Utf8, true)), level)]))
        }
        Column::Dictionary(v) => {
            Arc::new(v.iter().map(Option::as_deref).collect::<DictionaryArray<Int32Type>>())
        }
        Column::Binary(v) => Arc::new(BinaryArray::from(v.iter().map(Option::as_deref).collect::<Vec<_>>())),
        Column::Null(n) => Arc::new(NullArray::new(*n)),
    }
}

/// A Parquet file of `columns` (the last of two columns of one name wins), two row
/// groups when it has two rows or more.
fn parquet(columns: &[(&'static str, Column)]) -> Vec<u8> {
    let mut unique: Vec<(&str, ArrayRef, bool)> = Vec::new();
    for (name, c) in columns {
        unique.retain(|(n, _, _)| n != name);
        unique.push((name, array(c), true));
    }
    let batch = RecordBatch::try_from_iter_with_nullable(unique).expect("columns of one length");
    let mut out = Vec::new();
    let mut writer = parquet::arrow::ArrowWriter::try_new(&mut out, batch.schema(), None).unwrap();
    let half = batch.num_rows() / 2;
    writer.write(&batch.slice(0, half)).unwrap();
    writer.flush().unwrap();
    writer.write(&batch.slice(half, batch.num_rows() - half)).unwrap();
    writer.close().unwrap();
    out
}

fn good_parquet() -> &'static [u8] {
    static GOOD: OnceLock<Vec<u8>> = OnceLock::new();
    GOOD.get_or_init(|| {
        parquet(&[
            ("question", Column::Text(vec![Some("1+1=".into()), Some("2+3=".into()), Some("é".into())])),
            ("answer", Column::Int(vec![Some(2), Some(5), None])),
            ("meta", Column::Level(vec![Some("L1".into()), Some("L2".into()), None])),
            ("numbers", Column::Strings(vec![Some(vec![Some("1".into())]), None, Some(Vec::new())])),
            ("other", Column::Float(vec![Some(0.5), None, Some(f64::NAN)])),
        ])
    })
}

/// How a dataset file is opened: with the field mapping (skipping bad records or
/// not), as Parquet, or as a code-task file.
pub(crate) enum Open {
    Fields(bool),
    Parquet(bool),
    Code(CodeFormat, CodeFileConfig),
}

fn policy(skip: bool) -> BadRecordPolicy {
    if skip { BadRecordPolicy::Skip } else { BadRecordPolicy::Fail }
}

pub(crate) fn check(input: &Input) -> Result<(), TestCaseError> {
    let (bytes, open) = match input {
        Input::Jsonl { rows, lines, bytes, skip } => {
            let seeds = jsonl_seeds();
            let text: Vec<String> = rows
                .iter()
                .map(|(seed, m)| String::from_utf8_lossy(&mutate_json(&seeds[*seed], m, false)).into_owned())
                .collect();
            let mut out = apply_lines(&text.join("\n"), lines).into_bytes();
            apply_bytes(&mut out, bytes);
            (out, Open::Fields(*skip))
        }
        Input::Code { mbpp, rows, template, skip } => {
            let text: Vec<String> = rows
                .iter()
                .map(|m| String::from_utf8_lossy(&mutate_json(code_seed(*mbpp), m, false)).into_owned())
                .collect();
            let format = if *mbpp { CodeFormat::Mbpp } else { CodeFormat::Humaneval };
            let config = CodeFileConfig {
                path: "unused".into(),
                template: template.map(str::to_owned),
                on_bad_record: policy(*skip),
            };
            (text.join("\n").into_bytes(), Open::Code(format, config))
        }
        Input::ParquetBytes { ops, skip } => {
            let mut bytes = good_parquet().to_vec();
            apply_bytes(&mut bytes, ops);
            (bytes, Open::Parquet(*skip))
        }
        Input::ParquetColumns { columns, skip } => (parquet(columns), Open::Parquet(*skip)),
    };
    check_file(&bytes, open)
}

thread_local! {
    /// Each test thread's folder for the file under test, written anew per input.
    static DIR: tempfile::TempDir = tempfile::tempdir().expect("a temporary folder");
}

pub(crate) fn check_file(bytes: &[u8], open: Open) -> Result<(), TestCaseError> {
    let name = match open {
        Open::Parquet(_) => "rows.parquet",
        _ => "rows.jsonl",
    };
    let path = DIR.with(|dir| dir.path().join(name));
    std::fs::write(&path, bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let opened = match open {
        Open::Fields(skip) => FileDataset::open_jsonl(&path, &mapping(), policy(skip)),
        Open::Parquet(skip) => FileDataset::open_parquet(&path, &mapping(), policy(skip)),
        Open::Code(format, config) => FileDataset::open_code(&path, format, &config),
    };
    check_opened(&path, opened)
}

fn check_opened(path: &Path, opened: metronome_dataloader::Result<FileDataset>) -> Result<(), TestCaseError> {
    let file = path.display().to_string();
    match opened {
        Ok(dataset) => {
            prop_assert!(dataset.len() > 0, "an empty dataset opened");
            for i in 0..dataset.len() {
                prop_assert!(dataset.record(i).is_ok(), "record {i} cannot be read");
                prop_assert!(
                    dataset.place(i).contains(&file),
                    "record {i} is placed at {}",
                    dataset.place(i)
                );
            }
            Ok(())
        }
        Err(e) => {
            let chain = crate::chain(&e);
            if let metronome_dataloader::Error::BadRecord { .. } = e {
                prop_assert!(
                    chain.contains("line ") || chain.contains("row "),
                    "a bad record without its line: {chain}"
                );
            }
            // A template is a setting, named by its key; everything else names the file.
            crate::names_place(&chain, &[file.as_str(), "config `"])
        }
    }
}

#[test]
fn dataset_rows() {
    crate::fuzz("dataset", 20_000, file!(), input(), |input| check(&input));
}
