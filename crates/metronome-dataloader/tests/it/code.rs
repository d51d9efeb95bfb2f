//! Code tasks: HumanEval and MBPP files and the procedural generator, each prompt's
//! tests in its reference; bad files give errors naming the file, line and field.
//! (That the tests pass with each task's own solution, run in the sandbox, is checked
//! where the reward crate is at hand: `metronome-pipeline`'s `tests/it/code.rs`.)

use std::path::PathBuf;

use metronome_core::{CodeTests, RunSeed};
use metronome_dataloader::{
    BadRecordPolicy, CodeFileConfig, CodeFormat, CodeTask, CodeTaskConfig, Dataset, FileDataset, Holdout,
    LoaderConfig, PromptContent, SourceConfig,
};

use crate::common::{release, runtime, tokenizer, write_file};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn file(path: PathBuf) -> CodeFileConfig {
    CodeFileConfig { path, template: None, on_bad_record: BadRecordPolicy::Fail }
}

fn tests_of(reference: Option<&str>) -> CodeTests {
    serde_json::from_str(reference.expect("a reference")).expect("the reference is a code test spec")
}

#[test]
fn humaneval_records_carry_prompt_tests_and_entry_point() {
    let dataset = FileDataset::open_code(
        data("humaneval_sample.jsonl"),
        CodeFormat::Humaneval,
        &file(data("humaneval_sample.jsonl")),
    )
    .unwrap();
    assert_eq!(dataset.len(), 6);
    let raw: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(data("humaneval_sample.jsonl")).unwrap().lines().next().unwrap(),
    )
    .unwrap();
    let record = dataset.record(0).unwrap();
    assert_eq!(record.content, PromptContent::Text(raw["prompt"].as_str().unwrap().to_owned()));
    assert_eq!(record.metadata["entry_point"], "has_close_elements");
    assert_eq!(record.metadata["task_id"], "HumanEval/0");
    assert_eq!(record.metadata["task"], "code");
    match tests_of(record.reference.as_deref()) {
        CodeTests::Assert { prefix, setup, tests } => {
            assert_eq!(prefix, raw["prompt"].as_str().unwrap());
            assert_eq!(setup, raw["test"].as_str().unwrap());
            assert_eq!(tests, ["check(has_close_elements)"]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn mbpp_records_carry_each_assert_as_a_test() {
    let dataset =
        FileDataset::open_code(data("mbpp_sample.jsonl"), CodeFormat::Mbpp, &file(data("mbpp_sample.jsonl")))
            .unwrap();
    assert_eq!(dataset.len(), 4);
    let gcd = dataset.record(2).unwrap();
    let PromptContent::Text(text) = &gcd.content else { panic!("text") };
    assert!(text.starts_with("Write a function to return the greatest common divisor"), "{text}");
    assert!(text.contains("Your code should pass these tests:\nassert gcd(12, 18) == 6\n"), "{text}");
    match tests_of(gcd.reference.as_deref()) {
        CodeTests::Assert { setup, tests, .. } => {
            assert_eq!(setup, "import math");
            assert_eq!(tests.len(), 3);
        }
        other => panic!("{other:?}"),
    }
    let setup = dataset.record(3).unwrap();
    assert!(
        matches!(tests_of(setup.reference.as_deref()), CodeTests::Assert { setup, .. } if setup.contains("LIMIT_OFFSET = 0"))
    );
}

#[test]
fn bad_code_files_name_the_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let good_mbpp = r#"{"task_id": 1, "text": "t", "test_list": ["assert f() == 1"]}"#;
    let cases = [
        (
            CodeFormat::Mbpp,
            r#"{"task_id": 2, "text": "t", "test_list": []}"#,
            vec!["line 2", "field `test_list`", "without tests"],
        ),
        (
            CodeFormat::Mbpp,
            r#"{"task_id": 2, "text": "t"}"#,
            vec!["line 2", "field `test_list`", "without tests"],
        ),
        (
            CodeFormat::Mbpp,
            r#"{"task_id": 2, "text": "t", "test_list": [1]}"#,
            vec!["line 2", "field `test_list`", "item 0"],
        ),
        (
            CodeFormat::Mbpp,
            r#"{"task_id": 2, "test_list": ["assert 1"]}"#,
            vec!["line 2", "field `prompt`", "missing"],
        ),
        (CodeFormat::Mbpp, r#"{"task_id": 2, "text": "t""#, vec!["line 2", "malformed JSON"]),
        (
            CodeFormat::Humaneval,
            r#"{"prompt": "def f():\n", "entry_point": "f", "test": "assert f() == 1"}"#,
            vec!["line 2", "field `test`", "without tests"],
        ),
        (
            CodeFormat::Humaneval,
            r#"{"prompt": "def f():\n", "test": "def check(c): pass"}"#,
            vec!["line 2", "field `entry_point`", "missing"],
        ),
    ];
    for (i, (format, line, expected)) in cases.into_iter().enumerate() {
        let first = match format {
            CodeFormat::Mbpp => good_mbpp,
            CodeFormat::Humaneval => {
                r#"{"prompt": "def f():\n", "entry_point": "f", "test": "def check(c):\n    assert c() == 1\n"}"#
            }
        };
        let path = write_file(&dir, &format!("bad{i}.jsonl"), &format!("{first}\n{line}\n"));
        let e = FileDataset::open_code(&path, format, &file(path.clone())).unwrap_err().to_string();
        assert!(e.contains(&format!("bad{i}.jsonl")), "{e}");
        for fragment in expected {
            assert!(e.contains(fragment), "case {i}: `{fragment}` not in: {e}");
        }
        // Skipped and counted instead, the good record stays.
        let skipping = CodeFileConfig { on_bad_record: BadRecordPolicy::Skip, ..file(path.clone()) };
        let dataset = FileDataset::open_code(&path, format, &skipping).unwrap();
        assert_eq!((dataset.len(), dataset.report().skipped), (1, 1), "case {i}");
    }
    // HumanEval as it ships: compressed.
    let gz = dir.path().join("HumanEval.jsonl.gz");
    std::fs::write(&gz, [0x1f, 0x8b, 8, 0, 0, 0]).unwrap();
    let e = FileDataset::open_code(&gz, CodeFormat::Humaneval, &file(gz.clone())).unwrap_err().to_string();
    assert!(e.contains("HumanEval.jsonl.gz is gzip-compressed") && e.contains("gunzip"), "{e}");
    let no_slot = CodeFileConfig { template: Some("Solve it.".into()), ..file(data("mbpp_sample.jsonl")) };
    let e = FileDataset::open_code(data("mbpp_sample.jsonl"), CodeFormat::Mbpp, &no_slot)
        .unwrap_err()
        .to_string();
    assert!(e.contains("mbpp.template") && e.contains("{text}"), "{e}");
}

#[test]
fn files_and_the_generator_load_through_the_source_config() {
    let toml_source: SourceConfig = toml::from_str(&format!(
        "kind = \"humaneval\"\npath = {:?}\ntemplate = \"# Complete:\\n{{prompt}}\"\n",
        data("humaneval_sample.jsonl").display().to_string()
    ))
    .unwrap();
    let config =
        LoaderConfig { source: toml_source, release: release(3, Some(1)), ..LoaderConfig::default() };
    let mut loader = config.build(RunSeed(1), tokenizer()).unwrap();
    let batch = runtime()
        .block_on(async { metronome_core::PromptSource::next_batch(&mut loader).await })
        .unwrap()
        .unwrap();
    assert_eq!(batch.prompts.len(), 3);
    assert!(batch.prompts.iter().all(|p| p.text.starts_with("# Complete:\n")), "{:?}", batch.prompts[0].text);

    let code: SourceConfig =
        toml::from_str("kind = \"code\"\nsize = 40\nfamilies = [\"add\", \"sum_input\"]\n").unwrap();
    let config = LoaderConfig { source: code, release: release(8, None), ..LoaderConfig::default() };
    let mut loader = config.build(RunSeed(2), tokenizer()).unwrap();
    let batch = runtime()
        .block_on(async { metronome_core::PromptSource::next_batch(&mut loader).await })
        .unwrap()
        .unwrap();
    for p in &batch.prompts {
        let tests = tests_of(p.reference.as_deref());
        match p.metadata["family"].as_str() {
            "add" => assert!(matches!(tests, CodeTests::Assert { .. }) && p.text.contains("returns x plus")),
            "sum_input" => {
                assert!(matches!(tests, CodeTests::Io { .. }) && p.text.contains("standard input"))
            }
            other => panic!("family {other}"),
        }
        assert!(p.metadata.contains_key("solution"));
    }
}

#[test]
fn code_tasks_split_train_and_heldout_by_content() {
    let keys = |holdout| {
        let task =
            CodeTask::new(CodeTaskConfig { holdout, size: 300, ..CodeTaskConfig::default() }, RunSeed(9))
                .unwrap();
        (0..300).map(|i| task.item(i).unwrap().key).collect::<std::collections::BTreeSet<_>>()
    };
    let train = keys(Holdout::train(20));
    let heldout = keys(Holdout::heldout(20));
    assert!(!heldout.is_empty() && !train.is_empty());
    assert!(train.is_disjoint(&heldout));
}
