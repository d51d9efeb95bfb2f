//! A whole run reports what happens as events, in order, for a front end to render.

use std::sync::{Arc, Mutex};

use metronome_pipeline::tensorboard::{EVENTS_PREFIX, read_scalars};
use metronome_pipeline::{Event, Observer, PipelineConfig, RunDir, RunOptions};

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

    tensorboard_charts_the_run(&out.path().join("events"), &events);
    the_report_page_stands_alone(&out.path().join("events"));

    // Given one more period, the same run resumes from its checkpoint after period 1.
    let (names, events) = events_of(config(out.path(), 3)).await;
    assert_eq!(names, ["resuming", "periods_started", "period_done", "run_finished"]);
    assert!(matches!(events[0], Event::Resuming { period: 2, .. }), "{:?}", events[0]);
    assert!(events.iter().any(|e| matches!(e, Event::PeriodsStarted { first: 2, periods: 3 })));
}

/// The run directory's event file holds, per period, the scalars of its report (and
/// the held-out accuracy from step 0 on), and TensorBoard's own reader agrees.
fn tensorboard_charts_the_run(run: &std::path::Path, events: &[Event]) {
    let files: Vec<_> = std::fs::read_dir(run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(EVENTS_PREFIX))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let scalars = read_scalars(&files[0]).unwrap();
    let value = |tag: &str, step: u64| {
        scalars
            .iter()
            .find(|s| s.1 == tag && s.0 == step)
            .map(|s| s.2)
            .unwrap_or_else(|| panic!("no {tag} at {step}"))
    };
    for event in events {
        if let Event::PeriodDone { report, accuracy } = event {
            let step = report.period.0 + 1;
            assert_eq!(value("reward/mean", step), report.reward_mean as f32);
            assert_eq!(value("loss/total", step), report.step.loss as f32);
            assert_eq!(value("groups/trained", step), report.groups as f32);
            assert_eq!(value("eval/heldout_accuracy", step), accuracy.unwrap() as f32);
        }
    }
    let Some(Event::Evaluated { accuracy, .. }) =
        events.iter().find(|e| matches!(e, Event::Evaluated { .. }))
    else {
        panic!("no evaluation after the warm start")
    };
    assert_eq!(value("eval/heldout_accuracy", 0), *accuracy as f32);

    // TensorBoard's reader, when it is installed (`.ci/run` installs it, so CI must have it).
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/read_tfevents.py");
    let out = std::process::Command::new("python3").arg(script).arg(run).output();
    let out = match out {
        Ok(out) if out.status.success() => out,
        Ok(out) if std::env::var_os("CI").is_none() => {
            eprintln!(
                "skipped TensorBoard's reader: {}",
                String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
            );
            return;
        }
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped TensorBoard's reader: no python3 ({e})");
            return;
        }
        other => panic!("TensorBoard's reader failed in CI: {other:?}"),
    };
    let read: Vec<(u64, String, f32)> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["tag"].as_str().unwrap().to_owned(),
                v["value"].as_f64().unwrap() as f32,
            )
        })
        .collect();
    let mut ours = scalars.clone();
    let mut theirs = read;
    let key = |s: &(u64, String, f32)| (s.1.clone(), s.0);
    ours.sort_by_key(key);
    theirs.sort_by_key(key);
    // NaN never equals itself: compare bit patterns.
    let bits =
        |v: &[(u64, String, f32)]| v.iter().map(|s| (s.0, s.1.clone(), s.2.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&theirs), bits(&ours), "TensorBoard read other scalars than Metronome wrote");
}

/// `report.html` holds the summary, four plots (held-out accuracy among them) and the
/// config, and fetches nothing: no script, and no link or source outside the page.
fn the_report_page_stands_alone(run: &std::path::Path) {
    let page = metronome_pipeline::write_html_report(&RunDir::open(run).unwrap()).unwrap();
    let html = std::fs::read_to_string(page).unwrap();
    assert_eq!(html.matches("<svg").count(), 4, "reward, held-out accuracy, throughput, timeline");
    assert!(html.contains("<h2>Held-out accuracy</h2>") && html.contains("<h2>Configuration</h2>"));
    assert!(html.contains("group_size = 2"), "the config is on the page");
    assert!(
        !html.contains("<script") && !html.contains("src=") && !html.contains("href="),
        "it fetches nothing"
    );
    let e = RunDir::open(&run.join("checkpoints")).unwrap_err();
    let e = metronome_core::ErrorChain(&e).to_string();
    assert!(e.contains("is not a run directory"), "{e}");
}
