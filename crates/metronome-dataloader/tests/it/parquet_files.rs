//! Parquet files, written by the tests themselves with the `parquet`/`arrow` crates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{
    ArrayRef, DictionaryArray, Float64Array, Int64Array, ListArray, RecordBatch, StringArray, StructArray,
};
use arrow_schema::{DataType, Field, Fields};
use metronome_core::{ChatMessage, PromptId};
use metronome_dataloader::{
    BadRecordPolicy, Dataset, FieldMapping, FileDataset, PromptContent, SourceConfig,
};
use metronome_testkit::damage::{Damage, check_damaged};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

use crate::common::file_loader;

fn write(path: &Path, columns: Vec<(&str, ArrayRef)>, compression: Compression) {
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let props = WriterProperties::builder().set_compression(compression).build();
    let file = std::fs::File::create(path).unwrap();
    let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
    // Two row groups, so reading crosses a boundary.
    let half = batch.num_rows() / 2;
    writer.write(&batch.slice(0, half)).unwrap();
    writer.flush().unwrap();
    writer.write(&batch.slice(half, batch.num_rows() - half)).unwrap();
    writer.close().unwrap();
}

fn mapping() -> FieldMapping {
    FieldMapping {
        prompt: "question".into(),
        reference: Some("answer".into()),
        metadata: BTreeMap::from([
            ("numbers".into(), "numbers".into()),
            ("level".into(), "meta.level".into()),
        ]),
    }
}

/// `rows` rows: question `a+b=`, answer, a list of numbers, a struct with a level, and an
/// unmapped float column; `answer` is null in the rows listed in `null_answers`.
fn good_columns(rows: usize, null_answers: &[usize]) -> Vec<(&'static str, ArrayRef)> {
    let questions: Vec<String> = (0..rows).map(|i| format!("{i}+1=")).collect();
    let answers: Vec<Option<i64>> =
        (0..rows).map(|i| (!null_answers.contains(&i)).then_some(i as i64 + 1)).collect();
    let numbers = ListArray::from_iter_primitive::<Int64Type, _, _>(
        (0..rows).map(|i| Some(vec![Some(i as i64), Some(1)])),
    );
    let level: ArrayRef = Arc::new(StringArray::from_iter_values((0..rows).map(|i| format!("L{}", i % 3))));
    let meta = StructArray::from(vec![(Arc::new(Field::new("level", DataType::Utf8, false)), level)]);
    vec![
        ("question", Arc::new(StringArray::from(questions)) as ArrayRef),
        ("answer", Arc::new(Int64Array::from(answers)) as ArrayRef),
        ("numbers", Arc::new(numbers) as ArrayRef),
        ("meta", Arc::new(meta) as ArrayRef),
        ("unused", Arc::new(Float64Array::from_iter_values((0..rows).map(|i| i as f64))) as ArrayRef),
    ]
}

fn file(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

#[test]
fn parquet_rows_map_like_jsonl_across_batches_and_row_groups() {
    let dir = tempfile::tempdir().unwrap();
    let path = file(&dir, "good.parquet");
    write(&path, good_columns(5000, &[]), Compression::SNAPPY);
    let dataset = FileDataset::open_parquet(&path, &mapping(), BadRecordPolicy::Fail).unwrap();
    assert_eq!(dataset.len(), 5000);
    for i in [0usize, 2499, 2500, 4095, 4096, 4999] {
        let r = dataset.record(i).unwrap();
        assert_eq!(r.id, PromptId(i as u64));
        assert_eq!(r.content, PromptContent::Text(format!("{i}+1=")));
        assert_eq!(r.reference, Some((i + 1).to_string()));
        assert_eq!(r.metadata["numbers"], format!("[{i},1]"));
        assert_eq!(r.metadata["level"], format!("L{}", i % 3));
    }
    assert!(dataset.place(4999).ends_with("good.parquet row 5000"));
}

#[test]
fn bad_rows_name_file_row_and_field_and_can_be_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = file(&dir, "nulls.parquet");
    write(&path, good_columns(10, &[2, 7]), Compression::UNCOMPRESSED);
    let err = FileDataset::open_parquet(&path, &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
    assert!(err.contains("nulls.parquet, row 3, field `answer`: is null"), "{err}");

    let dataset = FileDataset::open_parquet(&path, &mapping(), BadRecordPolicy::Skip).unwrap();
    assert_eq!((dataset.report().kept, dataset.report().skipped), (8, 2));
    assert!(dataset.report().skipped_examples[1].contains("row 8"));
    let ids: Vec<u64> = (0..dataset.len()).map(|i| dataset.record(i).unwrap().id.0).collect();
    assert_eq!(ids, [0, 1, 3, 4, 5, 6, 8, 9]);
}

#[test]
fn wrong_type_missing_column_and_unsupported_type_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = file(&dir, "types.parquet");
    let mut columns = good_columns(4, &[]);
    columns[0].1 = Arc::new(Int64Array::from(vec![1, 2, 3, 4]));
    write(&path, columns, Compression::UNCOMPRESSED);
    let err = FileDataset::open_parquet(&path, &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
    assert!(
        err.contains("types.parquet, row 1, field `question`: expected a string or a list of chat messages, found a number"),
        "{err}"
    );

    let mut missing = mapping();
    missing.reference = Some("solution".into());
    let path = file(&dir, "good.parquet");
    write(&path, good_columns(4, &[]), Compression::UNCOMPRESSED);
    let err = FileDataset::open_parquet(&path, &missing, BadRecordPolicy::Skip).unwrap_err().to_string();
    assert!(
        err.contains("good.parquet: field `solution` is not a column of the file (columns: question, answer, numbers, meta, unused)"),
        "{err}"
    );

    let path = file(&dir, "binary.parquet");
    let binary: ArrayRef = Arc::new(arrow_array::BinaryArray::from_vec(vec![b"x".as_slice()]));
    write(&path, vec![("question", binary)], Compression::UNCOMPRESSED);
    let err = FileDataset::open_parquet(
        &path,
        &FieldMapping { prompt: "question".into(), ..FieldMapping::default() },
        BadRecordPolicy::Fail,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("binary.parquet: field `question` has unsupported column type Binary"), "{err}");
}

#[test]
fn empty_and_non_parquet_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = file(&dir, "zero-rows.parquet");
    write(&path, good_columns(0, &[]), Compression::UNCOMPRESSED);
    let err = FileDataset::open_parquet(&path, &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
    assert!(err.contains("zero-rows.parquet is empty"), "{err}");

    let path = file(&dir, "zero-bytes.parquet");
    std::fs::write(&path, b"").unwrap();
    let err = FileDataset::open_parquet(&path, &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
    assert!(err.contains("zero-bytes.parquet is empty"), "{err}");

    let path = file(&dir, "text.parquet");
    std::fs::write(&path, b"question,answer\n1+1=,2\n").unwrap();
    let err = FileDataset::open_parquet(&path, &mapping(), BadRecordPolicy::Fail).unwrap_err();
    assert_eq!(err.to_string(), format!("the Parquet reader failed on {}", path.display()));
    assert!(std::error::Error::source(&err).is_some(), "the reader's error is the source");
}

#[test]
fn chat_message_lists_and_dictionary_strings_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = file(&dir, "chat.parquet");
    let fields = Fields::from(vec![
        Field::new("role", DataType::Utf8, false),
        Field::new("content", DataType::Utf8, false),
    ]);
    let mut messages = ListBuilder::new(StructBuilder::from_fields(fields, 2));
    for (role, content) in [("system", "Be brief."), ("user", "2+2?")] {
        let entry = messages.values();
        entry.field_builder::<StringBuilder>(0).unwrap().append_value(role);
        entry.field_builder::<StringBuilder>(1).unwrap().append_value(content);
        entry.append(true);
    }
    messages.append(true);
    let answer: DictionaryArray<Int32Type> = vec!["4"].into_iter().collect();
    write(
        &path,
        vec![("messages", Arc::new(messages.finish()) as ArrayRef), ("answer", Arc::new(answer) as ArrayRef)],
        Compression::UNCOMPRESSED,
    );
    let fields = FieldMapping {
        prompt: "messages".into(),
        reference: Some("answer".into()),
        ..FieldMapping::default()
    };
    let dataset = FileDataset::open_parquet(&path, &fields, BadRecordPolicy::Fail).unwrap();
    let r = dataset.record(0).unwrap();
    assert_eq!(
        r.content,
        PromptContent::Messages(vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "2+2?")
        ])
    );
    assert_eq!(r.reference.as_deref(), Some("4"));
}

#[tokio::test]
async fn a_parquet_source_from_config_serves_every_row_once_per_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let path = file(&dir, "train.parquet");
    write(&path, good_columns(30, &[]), Compression::SNAPPY);
    let mut loader = file_loader(SourceConfig::Parquet, path, mapping(), 8, 2, 4);
    let mut seen = Vec::new();
    while let Some(batch) = loader.next().await.unwrap() {
        seen.extend(batch.prompts.iter().map(|p| p.id.0));
    }
    for epoch in seen.chunks(30) {
        let mut epoch = epoch.to_vec();
        epoch.sort_unstable();
        assert_eq!(epoch, (0..30).collect::<Vec<_>>());
    }
    assert_eq!(seen.len(), 60);
}

#[test]
fn a_directory_of_parquet_shards_reads_in_name_order() {
    let dir = tempfile::tempdir().unwrap();
    write(&file(&dir, "part-1.parquet"), good_columns(6, &[]), Compression::SNAPPY);
    write(&file(&dir, "part-0.parquet"), good_columns(4, &[1]), Compression::UNCOMPRESSED);
    let dataset = FileDataset::open_parquet(dir.path(), &mapping(), BadRecordPolicy::Skip).unwrap();
    assert_eq!((dataset.report().kept, dataset.report().skipped), (9, 1));
    assert!(dataset.report().skipped_examples[0].contains("part-0.parquet, row 2, field `answer`"));
    let ids: Vec<u64> = (0..dataset.len()).map(|i| dataset.record(i).unwrap().id.0).collect();
    assert_eq!(ids, [0, 2, 3, 4, 5, 6, 7, 8, 9]);
    // Row 0 of the second shard is record 4 overall.
    assert_eq!(dataset.record(3).unwrap().content, PromptContent::Text("0+1=".into()));
    assert!(dataset.place(3).ends_with("part-1.parquet row 1"), "{}", dataset.place(3));
}

#[test]
fn truncated_or_corrupted_parquet_files_are_errors_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let good = file(&dir, "good.parquet");
    write(&good, good_columns(40, &[]), Compression::SNAPPY);
    let bytes = std::fs::read(&good).unwrap();
    let bad = file(&dir, "bad.parquet");
    // Every byte: the file is small, and its footer (schema, offsets) is at the end.
    let every: Vec<usize> = (0..bytes.len()).collect();
    let damages = [Damage::Cut, Damage::Flip(0xff), Damage::Set(0x7f)];
    let tried = check_damaged(&bad, &bytes, &every, &damages, &["bad.parquet"], || {
        FileDataset::open_parquet(&bad, &mapping(), BadRecordPolicy::Fail).map(drop)
    });
    eprintln!("{tried} truncated or corrupted files, every one an error or a load");
    assert!(tried > 1000, "{tried}");
}
