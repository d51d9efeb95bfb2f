//! A whole run reports what happens as events, in order, for a front end to render.

use std::sync::{Arc, Mutex};

use metronome_pipeline::{Event, Observer, PipelineConfig, RunOptions};

fn config(out: &std::path::Path, periods: u64) -> PipelineConfig {
    let overrides: Vec<String> = [
        format!("run.periods={periods}"),
        "run.name=\"events\"".into(),
        format!("run.out_dir={:?}", out.display().to_string()),
        "run.group_size=2".into(),
        "run.checkpoint_every=1".into(),
        "data.release.batch_size=4".into(),
        "sft.steps=3".into(),
        "sft.batch_size=4".into(),
        "eval.prompts=4".into(),
        "eval.every=1".into(),
        "rollout.sampling.max_new_tokens=4".into(),
        "run.cores=1".into(),
    ]
    .to_vec();
    PipelineConfig::embedded(&overrides).unwrap()
}

/// Runs `config`, returning the name of every event and the events themselves.
async fn events_of(config: PipelineConfig) -> (Vec<String>, Vec<Event>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let observer = Observer::new(move |e: &Event| sink.lock().unwrap().push(e.clone()));
    metronome_pipeline::run(config, RunOptions { observer, allow_config_change: false }).await.unwrap();
    let events = std::mem::take(&mut *seen.lock().unwrap());
    let names = events
        .iter()
        .map(|e| serde_json::to_value(e).unwrap()["event"].as_str().unwrap().to_owned())
        // Groups arrive in completion order; count them apart.
        .filter(|n| n != "group_trained")
        .collect();
    (names, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_and_its_resumption_report_their_events_in_order() {
    let out = tempfile::tempdir().unwrap();
    let (names, events) = events_of(config(out.path(), 2)).await;
    assert_eq!(
        names,
        [
            "warm_start_step",
            "warm_start_step",
            "warm_start_step",
            "evaluated",
            "periods_started",
            "period_done",
            "period_done",
            "run_finished"
        ]
    );
    let trained = events.iter().filter(|e| matches!(e, Event::GroupTrained { .. })).count();
    let done: Vec<(u64, usize, bool)> = events
        .iter()
        .filter_map(|e| match e {
            Event::PeriodDone { report, accuracy } => {
                Some((report.period.0, report.groups, accuracy.is_some()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(trained, done.iter().map(|d| d.1).sum::<usize>(), "one group_trained per trained group");
    assert_eq!(done.iter().map(|d| (d.0, d.2)).collect::<Vec<_>>(), [(0, true), (1, true)]);

    // Given one more period, the same run resumes from its checkpoint after period 1.
    let (names, events) = events_of(config(out.path(), 3)).await;
    assert_eq!(names, ["resuming", "periods_started", "period_done", "run_finished"]);
    assert!(matches!(events[0], Event::Resuming { period: 2, .. }), "{:?}", events[0]);
    assert!(events.iter().any(|e| matches!(e, Event::PeriodsStarted { first: 2, periods: 3 })));
}
