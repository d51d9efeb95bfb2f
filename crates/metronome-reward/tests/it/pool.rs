//! The worker pool: time limits, panic isolation, stuck workers, order and statistics.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metronome_core::{AdvantageEstimator, Completion, GroupScorer, Prompt, Reward};
use metronome_reward::{PoolConfig, PoolScorer};

use crate::common::{group, prompt};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
}

/// Counter values by `reason` label for `metronome_reward_failures_total`.
fn failure_counts(recorder: &DebuggingRecorder) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "metronome_reward_failures_total")
        .filter_map(|(key, _, _, value)| {
            let reason = key.key().labels().find(|l| l.key() == "reason")?.value().to_owned();
            match value {
                DebugValue::Counter(n) => Some((reason, n)),
                _ => None,
            }
        })
        .collect();
    out.sort();
    out
}

fn misbehaving(_: &Prompt, c: &Completion) -> Reward {
    match c.text.as_str() {
        "sleep" => {
            std::thread::sleep(Duration::from_secs(10));
            Reward::scalar(100.0)
        }
        "panic" => panic!("scorer bug on purpose"),
        "nan" => Reward::scalar(f32::NAN),
        text => Reward::scalar(text.len() as f32),
    }
}

#[test]
fn timeout_and_panic_fail_alone_while_the_group_is_scored() {
    // A panic's hook (a backtrace, with RUST_BACKTRACE set) runs inside the time limit:
    // on a loaded machine it took longer than 300 ms, and once (CI's test step, every
    // core busy) longer than 2 s, and read as a timeout. Most of that is the first
    // symbolisation of this binary's debug info, cached for the process: done here,
    // outside the limit. The sleeper sleeps well past the limit, which bounds the
    // test's time.
    let _ = std::backtrace::Backtrace::force_capture().to_string();
    let config =
        PoolConfig { workers: 2, time_limit_ms: 5_000, failure_score: -1.0, ..PoolConfig::default() };
    let scorer = PoolScorer::new(misbehaving, config).unwrap();
    let recorder = DebuggingRecorder::new();
    let g = group(prompt(None, &[]), &["a", "sleep", "panic", "abcd", "nan", "ab"]);
    let scored = metrics::with_local_recorder(&recorder, || runtime().block_on(scorer.score(g))).unwrap();

    let totals: Vec<f32> = scored.rewards.iter().map(|r| r.total).collect();
    assert_eq!(totals, [1.0, -1.0, -1.0, 4.0, -1.0, 2.0]);
    let failures: Vec<Option<&str>> = scored.rewards.iter().map(|r| r.failure.as_deref()).collect();
    assert_eq!(failures[0], None);
    assert_eq!(failures[1], Some("scorer exceeded its time limit of 5000 ms"));
    assert_eq!(failures[2], Some("scorer panicked: scorer bug on purpose"));
    assert!(failures[4].unwrap().contains("non-finite"));
    assert_eq!(
        failure_counts(&recorder),
        [("non_finite".into(), 1), ("panic".into(), 1), ("timeout".into(), 1)]
    );
    // The stuck thread was written off and replaced; the pool keeps its size.
    let stats = scorer.stats();
    assert_eq!((stats.timeouts, stats.panics, stats.replaced, stats.stuck, stats.live), (1, 1, 1, 1, 2));
    // And it goes on scoring.
    let next = runtime().block_on(scorer.score(group(prompt(None, &[]), &["xyz", "panic"]))).unwrap();
    assert_eq!(next.rewards[0].total, 3.0);
    assert_eq!(next.rewards[1].total, -1.0);
    assert_eq!(next.group.completions.len(), 2);
}

/// A scorer that blocks on "block" until the test releases it.
fn gated() -> (impl Fn(&Prompt, &Completion) -> Reward + Send + Sync + 'static, mpsc::Sender<()>) {
    let (tx, rx) = mpsc::channel::<()>();
    let rx = Arc::new(Mutex::new(rx));
    let scorer = move |_: &Prompt, c: &Completion| {
        if c.text == "block" {
            let _ = rx.lock().unwrap().recv();
        }
        Reward::scalar(c.text.len() as f32)
    };
    (scorer, tx)
}

fn wait_for(scorer: &PoolScorer, what: &str, cond: impl Fn(&metronome_reward::PoolStats) -> bool) {
    for _ in 0..500 {
        if cond(&scorer.stats()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("pool never reached: {what}; stats {:?}", scorer.stats());
}

#[test]
fn stuck_workers_are_replaced_up_to_the_bound_then_calls_fail_fast_and_threads_rejoin() {
    let (scorer, release) = gated();
    let config = PoolConfig { workers: 1, time_limit_ms: 250, max_stuck_workers: 1, ..PoolConfig::default() };
    let pool = PoolScorer::new(scorer, config).unwrap();
    let p = prompt(None, &[]);

    // First stuck call: replaced, and the same group's other completion is scored by the replacement.
    let g = pool.score_blocking(group(p.clone(), &["block", "ok"])).unwrap();
    assert!(g.rewards[0].failure.as_deref().unwrap().contains("time limit"));
    assert_eq!(g.rewards[1].total, 2.0);
    assert_eq!((pool.stats().stuck, pool.stats().live, pool.stats().replaced), (1, 1, 1));

    // Second stuck call: past max_stuck_workers, so no replacement; the pool is empty
    // and the rest of the group fails fast instead of hanging.
    let recorder = DebuggingRecorder::new();
    let g =
        metrics::with_local_recorder(&recorder, || pool.score_blocking(group(p.clone(), &["block", "ok"])))
            .unwrap();
    assert!(g.rewards[0].failure.as_deref().unwrap().contains("time limit"));
    assert!(g.rewards[1].failure.as_deref().unwrap().contains("no reward worker"));
    assert_eq!(failure_counts(&recorder), [("timeout".into(), 1), ("unavailable".into(), 1)]);
    assert_eq!((pool.stats().stuck, pool.stats().live), (2, 0));

    // The stuck scorers return: one thread rejoins (the pool is short), the other exits.
    release.send(()).unwrap();
    release.send(()).unwrap();
    wait_for(&pool, "both stuck threads returned", |s| s.stuck == 0);
    assert_eq!((pool.stats().live, pool.stats().rejoined), (1, 1));
    let g = pool.score_blocking(group(p, &["abc"])).unwrap();
    assert_eq!(g.rewards[0].total, 3.0);
}

#[test]
fn scores_come_back_in_completion_order_with_group_statistics() {
    // Later completions finish first: order must still follow sample_index.
    let slow_first = |_: &Prompt, c: &Completion| {
        std::thread::sleep(Duration::from_millis(u64::from(8 - c.sample_index) * 3));
        c.sample_index as f32
    };
    let config = PoolConfig { workers: 4, ..PoolConfig::default() };
    let pool = PoolScorer::new(slow_first, config).unwrap().with_estimator(AdvantageEstimator::GroupMean);
    let texts = ["", "", "", "", "", "", "", ""];
    let g = runtime().block_on(pool.score(group(prompt(None, &[]), &texts))).unwrap();
    let totals: Vec<f32> = g.rewards.iter().map(|r| r.total).collect();
    assert_eq!(totals, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert_eq!(g.stats.mean, 3.5);
    assert!((g.stats.std - 5.25f32.sqrt()).abs() < 1e-6);
    assert!(!g.stats.all_equal);
    assert_eq!(g.advantages, [-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5]);

    let constant = PoolScorer::new(|_: &Prompt, _: &Completion| 1.0f32, PoolConfig::default()).unwrap();
    let g = runtime().block_on(constant.score(group(prompt(None, &[]), &["a", "b", "c"]))).unwrap();
    assert!(g.stats.all_equal);
    assert_eq!(g.advantages, [0.0, 0.0, 0.0]);
}

/// The `GroupScorer` contract, on the composite the default run uses: a right, a
/// wrong and an unparsable answer, then the same answer G times.
#[test]
fn the_pool_passes_the_group_scorer_suite() {
    let reward = metronome_reward::Composite::of("correct", 1.0, metronome_reward::MathVerifier::new())
        .unwrap()
        .with("format", 0.1, metronome_reward::FormatReward::think_answer())
        .unwrap();
    let pool = PoolScorer::new(reward, PoolConfig { workers: 2, ..PoolConfig::default() }).unwrap();
    let texts = ["<think>2+2</think><answer>4</answer>", r"\boxed{5}", "no idea"];
    let sample = group(prompt(Some("4"), &[]), &texts);
    runtime().block_on(metronome_testkit::conformance::scorer::run_all(&pool, sample));
}

#[test]
fn scorer_reported_failures_are_counted_and_kept() {
    let pool = PoolScorer::new(metronome_reward::MathVerifier::new(), PoolConfig::default()).unwrap();
    let recorder = DebuggingRecorder::new();
    let g = metrics::with_local_recorder(&recorder, || {
        pool.score_blocking(group(prompt(None, &[]), &["1", "2"]))
    })
    .unwrap();
    assert!(g.rewards.iter().all(|r| r.failure.is_some()));
    assert_eq!(failure_counts(&recorder), [("scorer".into(), 2)]);
}

#[test]
fn bad_pool_configs_are_rejected() {
    let f = |_: &Prompt, _: &Completion| 0.0f32;
    for (config, field) in [
        (PoolConfig { workers: 0, ..PoolConfig::default() }, "pool.workers"),
        (PoolConfig { time_limit_ms: 0, ..PoolConfig::default() }, "pool.time_limit_ms"),
        (PoolConfig { failure_score: f32::INFINITY, ..PoolConfig::default() }, "pool.failure_score"),
    ] {
        let e = PoolScorer::new(f, config).unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    }
}

#[test]
fn a_cancelled_caller_does_not_leak_the_time_limit() {
    // The watchdog, not the caller, enforces the limit: dropping the scoring future
    // (e.g. the pipeline shutting a period down) still gets the stuck worker replaced.
    let (scorer, release) = gated();
    let config = PoolConfig { workers: 1, time_limit_ms: 150, ..PoolConfig::default() };
    let pool = PoolScorer::new(scorer, config).unwrap();
    let cancelled = runtime().block_on(async {
        tokio::time::timeout(Duration::from_millis(10), pool.score(group(prompt(None, &[]), &["block"])))
            .await
    });
    assert!(cancelled.is_err(), "the call should have been cancelled");
    wait_for(&pool, "the abandoned job timed out and was replaced", |s| s.timeouts == 1 && s.replaced == 1);
    let g = pool.score_blocking(group(prompt(None, &[]), &["four"])).unwrap();
    assert_eq!(g.rewards[0].total, 4.0);
    release.send(()).unwrap();
    wait_for(&pool, "the stuck thread returned", |s| s.stuck == 0);
    assert_eq!(pool.stats().live, 1);
}
