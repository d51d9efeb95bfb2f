//! JSONL files: mapping, and every bad-input case naming its place.

use std::collections::BTreeMap;

use metronome_core::PromptId;
use metronome_dataloader::{
    BadRecordPolicy, Dataset, FieldMapping, FileDataset, PromptContent, SourceConfig,
};

use crate::common::{file_loader, write_file};

fn mapping() -> FieldMapping {
    FieldMapping {
        prompt: "question".into(),
        reference: Some("answer".into()),
        metadata: BTreeMap::from([("level".into(), "info.level".into())]),
    }
}

const GOOD: &str = concat!(
    r#"{"question": "1+1=", "answer": "2", "info": {"level": 1}}"#,
    "\n",
    "\n",
    r#"{"question": "2+3=", "answer": 5, "info": {"level": "easy"}}"#,
    "\r\n",
    r#"{"question": "9*9=", "answer": "81", "info": {"level": [1, 2]}, "extra": true}"#,
);

#[test]
fn jsonl_maps_fields_and_ignores_blank_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "good.jsonl", GOOD);
    let dataset = FileDataset::open_jsonl(&path, &mapping(), BadRecordPolicy::Fail).unwrap();
    assert_eq!(dataset.len(), 3);
    let r = dataset.record(1).unwrap();
    assert_eq!(r.id, PromptId(1));
    assert_eq!(r.content, PromptContent::Text("2+3=".into()));
    assert_eq!(r.reference.as_deref(), Some("5"));
    assert_eq!(r.metadata["level"], "easy");
    assert_eq!(dataset.record(0).unwrap().metadata["level"], "1");
    assert_eq!(dataset.record(2).unwrap().metadata["level"], "[1,2]");
    // Place counts lines as editors do (the blank line included).
    assert!(dataset.place(1).ends_with("good.jsonl line 3"), "{}", dataset.place(1));
    assert_eq!(dataset.report().kept, 3);
    assert_eq!(dataset.report().skipped, 0);
}

/// One bad line among good ones; the expected message fragments.
fn bad_cases() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
    vec![
        (
            "malformed",
            r#"{"question": "1+1=", "answer": "2", "info": {"level": 1"#,
            vec!["line 2", "malformed JSON"],
        ),
        (
            "missing",
            r#"{"question": "1+1=", "info": {"level": 1}}"#,
            vec!["line 2", "field `answer`", "missing"],
        ),
        (
            "missing-nested",
            r#"{"question": "1+1=", "answer": "2", "info": {}}"#,
            vec!["line 2", "field `info.level`", "missing"],
        ),
        (
            "wrong-type",
            r#"{"question": 12, "answer": "2", "info": {"level": 1}}"#,
            vec![
                "line 2",
                "field `question`",
                "expected a string or a list of chat messages, found a number",
            ],
        ),
        (
            "wrong-type-reference",
            r#"{"question": "x", "answer": {"a": 1}, "info": {"level": 1}}"#,
            vec!["line 2", "field `answer`", "found an object"],
        ),
        (
            "null",
            r#"{"question": null, "answer": "2", "info": {"level": 1}}"#,
            vec!["line 2", "field `question`", "is null"],
        ),
        ("not-an-object", r#"["1+1=", "2"]"#, vec!["line 2", "expected a JSON object, found a list"]),
    ]
}

#[test]
fn each_bad_line_fails_with_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"question": "0+0=", "answer": "0", "info": {"level": 0}}"#;
    for (name, line, fragments) in bad_cases() {
        let file = format!("{name}.jsonl");
        let path = write_file(&dir, &file, &format!("{good}\n{line}\n{good}\n"));
        let err = FileDataset::open_jsonl(&path, &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
        assert!(err.contains(&file), "{name}: {err}");
        for fragment in fragments {
            assert!(err.contains(fragment), "{name}: `{fragment}` not in: {err}");
        }
    }
}

#[test]
fn invalid_utf8_is_a_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bytes.jsonl");
    std::fs::write(&path, b"{\"question\": \"\xff\"}\n").unwrap();
    let err = FileDataset::open_jsonl(&path, &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
    assert!(err.contains("bytes.jsonl, line 1: is not valid UTF-8"), "{err}");
}

#[test]
fn skip_policy_counts_every_bad_line_and_keeps_ids_stable() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"question": "0+0=", "answer": "0", "info": {"level": 0}}"#;
    let mut text = String::new();
    let cases = bad_cases();
    for (_, line, _) in &cases {
        text.push_str(good);
        text.push('\n');
        text.push_str(line);
        text.push('\n');
    }
    let path = write_file(&dir, "mixed.jsonl", &text);
    let dataset = FileDataset::open_jsonl(&path, &mapping(), BadRecordPolicy::Skip).unwrap();
    assert_eq!(dataset.report().kept, cases.len() as u64);
    assert_eq!(dataset.report().skipped, cases.len() as u64);
    assert_eq!(dataset.report().skipped_examples.len(), cases.len());
    assert!(dataset.report().skipped_examples[0].contains("mixed.jsonl, line 2"));
    // Kept records are the even record indices: a skipped line keeps its id.
    let kept: Vec<u64> = (0..dataset.len()).map(|i| dataset.record(i).unwrap().id.0).collect();
    assert_eq!(kept, (0..cases.len() as u64).map(|i| 2 * i).collect::<Vec<_>>());
}

#[test]
fn empty_files_and_all_bad_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n")] {
        let path = write_file(&dir, name, text);
        let err = FileDataset::open_jsonl(&path, &mapping(), BadRecordPolicy::Skip).unwrap_err().to_string();
        assert!(err.contains(name) && err.ends_with("is empty: it holds no records"), "{err}");
    }
    let path = write_file(&dir, "bad.jsonl", "{\n[\n");
    let err = FileDataset::open_jsonl(&path, &mapping(), BadRecordPolicy::Skip).unwrap_err().to_string();
    assert!(err.contains("bad.jsonl has no usable records: all 2 were skipped"), "{err}");
    let missing = dir.path().join("nope.jsonl");
    let err = FileDataset::open_jsonl(&missing, &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
    assert!(err.starts_with("cannot read") && err.contains("nope.jsonl"), "{err}");
}

#[tokio::test]
async fn a_jsonl_source_from_config_releases_mapped_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "good.jsonl", GOOD);
    let mut loader = file_loader(SourceConfig::Jsonl, path, mapping(), 3, 1, 1);
    assert_eq!(loader.load_report().unwrap().kept, 3);
    let batch = loader.next().await.unwrap().unwrap();
    let mut answers: Vec<_> = batch.prompts.iter().map(|p| p.reference.clone().unwrap()).collect();
    answers.sort();
    assert_eq!(answers, ["2", "5", "81"]);
    assert!(loader.next().await.unwrap().is_none());
}

#[test]
fn a_directory_of_shards_is_one_dataset_with_ids_running_on() {
    let dir = tempfile::tempdir().unwrap();
    let line =
        |q: &str| format!("{{\"question\": \"{q}\", \"answer\": \"1\", \"info\": {{\"level\": 1}}}}\n");
    write_file(&dir, "train-00001.jsonl", &(line("c") + &line("d") + &line("e")));
    write_file(&dir, "train-00000.jsonl", &(line("a") + &line("b")));
    write_file(&dir, "README.md", "not a shard");
    let dataset = FileDataset::open_jsonl(dir.path(), &mapping(), BadRecordPolicy::Fail).unwrap();
    assert_eq!(dataset.files().len(), 2);
    let prompts: Vec<(u64, PromptContent)> =
        (0..dataset.len()).map(|i| dataset.record(i).unwrap()).map(|r| (r.id.0, r.content)).collect();
    let expected: Vec<(u64, PromptContent)> = ["a", "b", "c", "d", "e"]
        .iter()
        .enumerate()
        .map(|(i, q)| (i as u64, PromptContent::Text((*q).into())))
        .collect();
    assert_eq!(prompts, expected);
    assert!(dataset.place(3).ends_with("train-00001.jsonl line 2"), "{}", dataset.place(3));

    // A bad line names its shard.
    write_file(&dir, "train-00002.jsonl", &(line("f") + "{oops\n"));
    let err = FileDataset::open_jsonl(dir.path(), &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
    assert!(err.contains("train-00002.jsonl, line 2: malformed JSON"), "{err}");
    // An empty shard is an error naming it; a directory without shards too.
    write_file(&dir, "train-00002.jsonl", "");
    let err = FileDataset::open_jsonl(dir.path(), &mapping(), BadRecordPolicy::Skip).unwrap_err().to_string();
    assert!(err.contains("train-00002.jsonl is empty"), "{err}");
    let err =
        FileDataset::open_parquet(dir.path(), &mapping(), BadRecordPolicy::Fail).unwrap_err().to_string();
    assert!(err.ends_with("holds no `.parquet` files"), "{err}");
}
