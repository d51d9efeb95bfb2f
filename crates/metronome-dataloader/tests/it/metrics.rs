//! The counters the loader emits, through a local debugging recorder.

use std::sync::Arc;

use metrics::{SharedString, Unit};
use metrics_util::CompositeKey;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metronome_core::RunSeed;
use metronome_dataloader::{
    BadRecordPolicy, FieldMapping, FileDataset, OverlongPolicy, PromptConfig, PromptLoader,
};

use crate::common::{Numbered, drain, release, runtime, tokenizer, write_file};

type Snapshot = Vec<(CompositeKey, Option<Unit>, Option<SharedString>, DebugValue)>;

/// Reading a debugging snapshot resets its counters, so take one and query it.
fn snapshot(recorder: &DebuggingRecorder) -> Snapshot {
    recorder.snapshotter().snapshot().into_vec()
}

fn counter(snapshot: &Snapshot, name: &str, label: Option<(&str, &str)>) -> u64 {
    snapshot
        .iter()
        .filter(|(key, ..)| {
            key.key().name() == name
                && label.is_none_or(|(k, v)| key.key().labels().any(|l| l.key() == k && l.value() == v))
        })
        .filter_map(|(.., value)| match value {
            DebugValue::Counter(n) => Some(*n),
            _ => None,
        })
        .sum()
}

#[test]
fn release_and_skip_counters_match_what_was_released() {
    let recorder = DebuggingRecorder::new();
    let dataset = Arc::new(Numbered { len: 20, long: vec![3, 11, 17], long_len: 40 });
    let prompt =
        PromptConfig { max_tokens: Some(16), on_overlong: OverlongPolicy::Skip, ..PromptConfig::default() };
    let batches = metrics::with_local_recorder(&recorder, || {
        runtime().block_on(async {
            let mut l =
                PromptLoader::new(dataset, tokenizer(), RunSeed(2), release(6, Some(2)), prompt).unwrap();
            drain(&mut l, usize::MAX).await
        })
    });
    let snapshot = snapshot(&recorder);
    let tokens: u64 = batches.iter().flat_map(|b| &b.prompts).map(|p| p.tokens.len() as u64).sum();
    assert_eq!(counter(&snapshot, "metronome_dataloader_batches_released_total", None), batches.len() as u64);
    assert_eq!(counter(&snapshot, "metronome_dataloader_prompts_released_total", None), 34);
    assert_eq!(counter(&snapshot, "metronome_dataloader_prompt_tokens_total", None), tokens);
    assert_eq!(
        counter(&snapshot, "metronome_dataloader_prompts_skipped_total", Some(("reason", "too_long"))),
        6
    );
}

#[test]
fn bad_records_are_counted_by_format() {
    let recorder = DebuggingRecorder::new();
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "some-bad.jsonl",
        "{\"prompt\": \"a\"}\nnot json\n{\"prompt\": 3}\n{\"prompt\": \"b\"}\n",
    );
    let dataset = metrics::with_local_recorder(&recorder, || {
        FileDataset::open_jsonl(&path, &FieldMapping::default(), BadRecordPolicy::Skip).unwrap()
    });
    assert_eq!(dataset.report().skipped, 2);
    let snapshot = snapshot(&recorder);
    assert_eq!(
        counter(&snapshot, "metronome_dataloader_records_skipped_total", Some(("format", "jsonl"))),
        2
    );
    assert_eq!(counter(&snapshot, "metronome_dataloader_records_loaded_total", Some(("format", "jsonl"))), 2);
}
