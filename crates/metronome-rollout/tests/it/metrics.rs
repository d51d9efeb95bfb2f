//! The engine reports per-worker metrics through the `metrics` facade.

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metronome_core::{PeriodId, RolloutEngine, RolloutRequest};

use crate::common::{engine, prompts, sampling};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_report_slots_queue_tokens_and_group_times() {
    // The only test of this binary that installs a global recorder; engines must be
    // built after it so their metric handles are live.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("no other global recorder in this test binary");

    let e = engine(2, 2, sampling(6));
    let sink = metronome_rollout::CollectSink::default();
    let request = RolloutRequest { period: PeriodId(0), prompts: prompts(4), group_size: 2 };
    e.generate(request, &sink).await.unwrap();
    let generated: usize =
        sink.into_groups().iter().flat_map(|g| &g.completions).map(|c| c.tokens.len()).sum();

    let snapshot = snapshotter.snapshot().into_vec();
    let mut tokens = 0;
    let (mut steps, mut rows) = (0, 0);
    let mut names = std::collections::BTreeSet::new();
    for (key, _, _, value) in snapshot {
        let name = key.key().name().to_owned();
        let worker = key.key().labels().find(|l| l.key() == "worker").map(|l| l.value().to_owned());
        if name == "metronome_rollout_generated_tokens_total" {
            assert!(matches!(worker.as_deref(), Some("0" | "1")), "{worker:?}");
            if let DebugValue::Counter(n) = value {
                tokens += n;
            }
        }
        match (name.as_str(), &value) {
            ("metronome_rollout_decode_steps_total", DebugValue::Counter(n)) => steps += n,
            ("metronome_rollout_decode_rows_total", DebugValue::Counter(n)) => rows += n,
            _ => {}
        }
        if let ("metronome_rollout_group_duration_seconds", DebugValue::Histogram(v)) =
            (name.as_str(), &value)
        {
            assert!(v.len() >= 4, "one observation per group");
        }
        names.insert(name);
    }
    for expected in [
        "metronome_rollout_active_slots",
        "metronome_rollout_queue_depth",
        "metronome_rollout_generated_tokens_total",
        "metronome_rollout_group_duration_seconds",
        "metronome_rollout_decode_steps_total",
        "metronome_rollout_decode_rows_total",
    ] {
        assert!(names.contains(expected), "{expected} missing from {names:?}");
    }
    // Other tests' engines may run at the same time but built their handles before
    // the recorder existed only if they started earlier; ours are all counted.
    assert!(tokens >= generated as u64, "{tokens} counted, {generated} generated");
    // Each response's first token comes from its prefill, every later one from a decode
    // step's row; two workers of two slots decode at most two rows a step each. Other
    // engines of this binary may count beside ours: the recorder holds at least ours.
    let stats = e.worker_stats();
    let own_steps: u64 = stats.iter().map(|s| s.decode_steps).sum();
    let own_rows: u64 = stats.iter().map(|s| s.decode_rows).sum();
    assert!(
        own_rows >= generated as u64 - 8 && own_rows <= 2 * own_steps,
        "{own_rows} rows in {own_steps} steps"
    );
    assert!(
        steps >= own_steps && rows >= own_rows,
        "{steps} steps and {rows} rows counted, ours {own_steps} and {own_rows}"
    );
}
