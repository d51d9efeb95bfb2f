//! Release order: seeds, epochs, exactly-once, resumption, prefetching.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use metronome_core::{Cursor, PeriodId, PromptSource, RunSeed};
use metronome_dataloader::{Dataset, LoaderConfig, ReleaseConfig, SourceConfig};
use proptest::prelude::*;

use crate::common::{Numbered, drain, ids, loader, release, runtime, tokenizer};

#[tokio::test]
async fn same_seed_same_batches_other_seed_other_order() {
    let a = drain(&mut loader(Numbered::dataset(50), 7, release(8, Some(3))), usize::MAX).await;
    let b = drain(&mut loader(Numbered::dataset(50), 7, release(8, Some(3))), usize::MAX).await;
    let c = drain(&mut loader(Numbered::dataset(50), 8, release(8, Some(3))), usize::MAX).await;
    assert_eq!(a, b);
    assert_ne!(a.iter().map(ids).collect::<Vec<_>>(), c.iter().map(ids).collect::<Vec<_>>());
    // 150 prompts in batches of 8, each served once per epoch.
    assert_eq!(a.iter().map(|b| b.prompts.len()).sum::<usize>(), 150);
    assert!(a.len() >= 19);
    for (k, batch) in a.iter().enumerate() {
        assert_eq!(batch.period, PeriodId(k as u64));
    }
}

#[tokio::test]
async fn every_prompt_exactly_once_per_epoch_even_across_batch_boundaries() {
    // 23 prompts in batches of 5: batches straddle every epoch boundary.
    let mut l = loader(Numbered::dataset(23), 1, release(5, Some(8)));
    let batches = drain(&mut l, usize::MAX).await;
    let flat: Vec<u64> = batches.iter().flat_map(ids).collect();
    assert_eq!(flat.len(), 23 * 8);
    let epochs: Vec<&[u64]> = flat.chunks(23).collect();
    for epoch in &epochs {
        assert_eq!(epoch.iter().copied().collect::<BTreeSet<_>>(), (0..23).collect());
    }
    // Shuffled, and differently per epoch.
    assert_ne!(epochs[0], (0..23).collect::<Vec<_>>().as_slice());
    assert_ne!(epochs[0], epochs[1]);
    // A period never holds a prompt twice (its groups would share one identity): a
    // batch that meets one of its own prompts in the next epoch's order ends there.
    let mut short = 0;
    for (k, batch) in batches.iter().enumerate() {
        let held = ids(batch);
        assert_eq!(held.iter().collect::<BTreeSet<_>>().len(), held.len(), "period {k}: {held:?}");
        if held.len() < 5 && k + 1 < batches.len() {
            short += 1;
        }
    }
    assert!(short > 0, "no batch met one of its own prompts: the test lost its point");
    assert_eq!(l.stats().cut_short, short);
}

#[tokio::test]
async fn a_batch_larger_than_the_dataset_holds_each_prompt_once() {
    let batches = drain(&mut loader(Numbered::dataset(4), 1, release(6, Some(3))), usize::MAX).await;
    assert_eq!(batches.len(), 3);
    for batch in &batches {
        assert_eq!(ids(batch).into_iter().collect::<BTreeSet<_>>(), (0..4).collect());
    }
}

#[tokio::test]
async fn unshuffled_order_is_the_file_order() {
    let config = ReleaseConfig { shuffle: false, ..release(4, Some(1)) };
    let batches = drain(&mut loader(Numbered::dataset(10), 1, config), usize::MAX).await;
    assert_eq!(batches.iter().flat_map(ids).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
}

#[tokio::test]
async fn drop_last_drops_the_partial_batch_and_exhaustion_is_sticky() {
    let config = ReleaseConfig { drop_last: true, ..release(4, Some(1)) };
    let mut l = loader(Numbered::dataset(10), 1, config);
    let batches = drain(&mut l, usize::MAX).await;
    assert_eq!(batches.len(), 2);
    assert!(l.next().await.unwrap().is_none());
    assert!(l.next().await.unwrap().is_none());
    assert_eq!(l.cursor(), Cursor { period: PeriodId(2), epoch: 1, offset: 0 });
}

#[tokio::test]
async fn unbounded_epochs_keep_going() {
    let batches = drain(&mut loader(Numbered::dataset(3), 1, release(2, None)), 30).await;
    assert_eq!(batches.len(), 30);
    let flat: Vec<u64> = batches.iter().flat_map(ids).collect();
    for epoch in flat.chunks_exact(3) {
        assert_eq!(epoch.iter().copied().collect::<BTreeSet<_>>(), (0..3).collect());
    }
}

/// The `PromptSource` contract: restored at every period, by a fresh loader (whose
/// first prefetch is for period 0 and must be discarded) or by the same one rewound,
/// the loader releases what the uninterrupted run did, across epoch boundaries.
#[tokio::test]
async fn the_loader_passes_the_prompt_source_suite() {
    // 40 prompts in batches of 7 for 3 epochs: 18 batches, some crossing epochs.
    let mut make =
        || -> Box<dyn PromptSource> { Box::new(loader(Numbered::dataset(40), 11, release(7, Some(3)))) };
    metronome_testkit::conformance::source::run_all(&mut make, 20).await;
}

#[tokio::test]
async fn prefetching_does_not_change_what_is_released() {
    let on = drain(&mut loader(Numbered::dataset(30), 5, release(4, Some(2))), usize::MAX).await;
    let off_config = ReleaseConfig { prefetch: false, ..release(4, Some(2)) };
    let mut off_loader = loader(Numbered::dataset(30), 5, off_config);
    let off = drain(&mut off_loader, usize::MAX).await;
    assert_eq!(on, off);
    assert_eq!(off_loader.stats().prefetched_ready, 0);
}

/// Counts record reads, to observe the background thread.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Dataset>,
    reads: Arc<AtomicUsize>,
}

impl Dataset for Counting {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn record(&self, index: usize) -> metronome_dataloader::Result<metronome_dataloader::Record> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.record(index)
    }

    fn place(&self, index: usize) -> String {
        self.inner.place(index)
    }
}

fn wait_for_reads(reads: &AtomicUsize, n: usize) {
    // A liveness bound, not a timing assertion: the work takes microseconds.
    let deadline = Instant::now() + Duration::from_secs(60);
    while reads.load(Ordering::SeqCst) < n {
        assert!(Instant::now() < deadline, "prefetch never read {n} records");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[tokio::test]
async fn the_next_batch_is_prepared_in_the_background() {
    let reads = Arc::new(AtomicUsize::new(0));
    let dataset = Arc::new(Counting { inner: Numbered::dataset(30), reads: Arc::clone(&reads) });
    let mut l = loader(dataset, 5, release(4, Some(1)));
    // Built, not yet asked: the first batch is already being read.
    wait_for_reads(&reads, 4);
    l.next().await.unwrap().unwrap();
    // Period 0 runs; nobody calls the loader, yet period 1's batch is read.
    wait_for_reads(&reads, 8);
    assert_eq!(reads.load(Ordering::SeqCst), 8, "exactly one batch ahead");
    let mut released = 1;
    while l.next().await.unwrap().is_some() {
        released += 1;
    }
    let stats = l.stats();
    assert_eq!(stats.batches, released);
    assert_eq!(stats.prompts, 30);
    assert_eq!(reads.load(Ordering::SeqCst), 30, "no record read twice");
}

/// A dataset whose records panic past an index: a bug in a third-party dataset.
#[derive(Debug)]
struct Panicking;

impl Dataset for Panicking {
    fn len(&self) -> usize {
        10
    }

    fn record(&self, index: usize) -> metronome_dataloader::Result<metronome_dataloader::Record> {
        assert!(index < 5, "record {index} is broken");
        Numbered::dataset(10).record(index)
    }

    fn place(&self, index: usize) -> String {
        format!("panicking item {index}")
    }
}

#[tokio::test]
async fn a_panicking_dataset_is_an_error_not_a_hang_or_a_crash_and_the_loader_survives() {
    for prefetch in [true, false] {
        let config = ReleaseConfig { shuffle: false, prefetch, ..release(5, None) };
        let mut l = loader(Arc::new(Panicking), 0, config);
        assert_eq!(ids(&l.next().await.unwrap().unwrap()), [0, 1, 2, 3, 4]);
        for _ in 0..2 {
            let err = l.next().await.unwrap_err().to_string();
            assert_eq!(err, "planning the batch of period 1 panicked: record 5 is broken");
            assert_eq!(l.cursor().period, PeriodId(1));
        }
        // The cursor still works: an earlier position plans fine on the same thread.
        l.seek(Cursor::default()).unwrap();
        assert_eq!(ids(&l.next().await.unwrap().unwrap()), [0, 1, 2, 3, 4]);
    }
}

#[tokio::test]
async fn restore_rejects_cursors_that_do_not_fit() {
    let mut l = loader(Numbered::dataset(10), 1, release(4, Some(2)));
    let err = l.seek(Cursor { period: PeriodId(1), epoch: 0, offset: 11 }).unwrap_err().to_string();
    assert!(err.contains("cursor 1/0/11") && err.contains("past the end"), "{err}");
    let err = l.seek(Cursor { period: PeriodId(9), epoch: 2, offset: 3 }).unwrap_err().to_string();
    assert!(err.contains("beyond the 2 configured epochs"), "{err}");
    // An offset at the end of an epoch is the start of the next one.
    l.seek(Cursor { period: PeriodId(3), epoch: 0, offset: 10 }).unwrap();
    assert_eq!(l.cursor(), Cursor { period: PeriodId(3), epoch: 1, offset: 0 });
    // The core trait converts the error and keeps the message as its source.
    let mut source: Box<dyn PromptSource> = Box::new(l);
    let err = source.restore(Cursor { period: PeriodId(0), epoch: 0, offset: 99 }).unwrap_err();
    let chain = metronome_core::ErrorChain(&err).to_string();
    assert!(chain.starts_with("dataloader: cursor"), "{chain}");
}

#[tokio::test]
async fn config_rejects_bad_values_naming_the_key() {
    let config = LoaderConfig { release: release(0, None), ..LoaderConfig::default() };
    let err = config.build(RunSeed(0), tokenizer()).unwrap_err().to_string();
    assert!(err.contains("release.batch_size"), "{err}");
    let config = LoaderConfig { release: release(1, Some(0)), ..LoaderConfig::default() };
    assert!(config.build(RunSeed(0), tokenizer()).unwrap_err().to_string().contains("release.epochs"));
}

#[tokio::test]
async fn default_task_is_short_sums_with_answers() {
    let config: LoaderConfig = serde_json::from_str(r#"{"release": {"batch_size": 16}}"#).unwrap();
    assert_eq!(config.source, SourceConfig::Default);
    let mut l = config.build(RunSeed(0), tokenizer()).unwrap();
    let batch = l.next().await.unwrap().unwrap();
    assert_eq!(batch.prompts.len(), 16);
    for p in &batch.prompts {
        let (a, b) = p.text.strip_suffix('=').unwrap().split_once('+').unwrap();
        let sum = a.parse::<u64>().unwrap() + b.parse::<u64>().unwrap();
        assert_eq!(p.reference.as_deref(), Some(sum.to_string().as_str()), "{}", p.text);
        assert_eq!(p.tokens.len(), p.text.len());
        assert!(p.text.len() <= 6);
    }
}

#[test]
fn config_round_trips_through_serde_and_rejects_unknown_keys() {
    let text = r#"{
        "source": {"kind": "countdown", "numbers": {"min": 3, "max": 3}, "target": {"min": 1, "max": 50}},
        "release": {"batch_size": 4, "epochs": 2, "shuffle": false},
        "prompt": {"max_tokens": 64, "on_overlong": "reject"}
    }"#;
    let config: LoaderConfig = serde_json::from_str(text).unwrap();
    let back: LoaderConfig = serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
    assert_eq!(config, back);
    let bad = r#"{"release": {"batch_sise": 4}}"#;
    let err = serde_json::from_str::<LoaderConfig>(bad).unwrap_err().to_string();
    assert!(err.contains("batch_sise"), "{err}");
    let bad = r#"{"source": {"kind": "arithmetic", "digit": {"min": 1, "max": 2}}}"#;
    assert!(serde_json::from_str::<LoaderConfig>(bad).is_err());
}

/// The TOML example of `LoaderConfig`'s documentation parses as documented.
#[test]
fn documented_toml_example_parses() {
    let source = include_str!("../../src/config.rs");
    let example: String = source
        .lines()
        .skip_while(|l| !l.contains("```toml"))
        .skip(1)
        .take_while(|l| !l.contains("```"))
        .map(|l| l.trim_start_matches("///").strip_prefix(' ').unwrap_or("").to_owned() + "\n")
        .collect();
    let config: LoaderConfig = toml::from_str(&example).unwrap();
    let SourceConfig::Jsonl(file) = &config.source else { panic!("jsonl expected: {config:?}") };
    assert_eq!(file.fields.prompt, "question");
    assert_eq!(file.fields.metadata["level"], "level");
    assert_eq!(config.release.batch_size, 32);
    assert_eq!(config.prompt.max_tokens, Some(512));
    assert!(config.prompt.chat_template);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// For any dataset size, batch size, epoch count, seed and restart period, the
    /// resumed run releases exactly what the uninterrupted one did.
    #[test]
    fn resume_anywhere_property(
        len in 1usize..40,
        batch in 1usize..12,
        epochs in 1u64..4,
        seed in any::<u64>(),
        restart_at in 0usize..30,
        drop_last in any::<bool>(),
    ) {
        let rt = runtime();
        let config = ReleaseConfig { drop_last, ..release(batch, Some(epochs)) };
        rt.block_on(async {
            let full = drain(&mut loader(Numbered::dataset(len), seed, config.clone()), usize::MAX).await;
            let k = restart_at.min(full.len());
            let mut first = loader(Numbered::dataset(len), seed, config.clone());
            let head = drain(&mut first, k).await;
            let mut second = loader(Numbered::dataset(len), seed, config.clone());
            second.seek(first.cursor()).unwrap();
            let tail = drain(&mut second, usize::MAX).await;
            prop_assert_eq!(&head[..], &full[..k]);
            prop_assert_eq!(&tail[..], &full[k..]);
            // Every prompt once per epoch; drop_last drops at most a last partial batch.
            let released: usize = full.iter().map(|b| b.prompts.len()).sum();
            let all = len * epochs as usize;
            if drop_last {
                prop_assert!(released <= all && released + batch > all, "{} of {}", released, all);
            } else {
                prop_assert_eq!(released, all);
            }
            for b in &full {
                prop_assert!(b.prompts.len() <= batch);
                prop_assert_eq!(ids(b).into_iter().collect::<BTreeSet<_>>().len(), b.prompts.len());
            }
            Ok(())
        })?;
    }
}
