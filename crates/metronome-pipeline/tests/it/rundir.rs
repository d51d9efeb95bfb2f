//! The run directory, its plots, the summary table and the Grafana dashboard.

use std::collections::BTreeSet;
use std::fs;

use metronome_core::{PeriodId, PolicyVersion, StepReport};
use metronome_pipeline::tensorboard::EventWriter;
use metronome_pipeline::{Error, Interval, METRICS, PeriodReport, RunDir, StageKind, summary_table};

const DASHBOARD: &str = include_str!("../../../../dashboards/grafana.json");

/// Appends each of `reports` to `dir`'s record.
fn append(dir: &RunDir, reports: &[PeriodReport]) {
    for r in reports {
        dir.append_period(r).unwrap();
    }
}

/// The run directory `name` under `root`, created or reopened, with `reports` appended.
fn recorded(root: &std::path::Path, name: &str, reports: &[PeriodReport]) -> RunDir {
    let dir = RunDir::create(root, name).unwrap();
    append(&dir, reports);
    dir
}

/// A period of the `periodic` schedule starting at `t`: publication, generation
/// overlapped by training in completion order, then the step.
fn period(k: u64, t: f64) -> PeriodReport {
    let at = |stage, a: f64, b: f64| Interval { stage, period: PeriodId(k), start_s: t + a, end_s: t + b };
    PeriodReport {
        period: PeriodId(k),
        period_s: 2.1,
        generation_s: 1.6,
        training_s: 1.5,
        publication_s: 0.05,
        groups: 6,
        dropped_stale: 0,
        duplicates: usize::from(k == 1),
        rejected: usize::from(k == 2),
        filtered: 0,
        generated_tokens: 1200 + 10 * k,
        reward_mean: 0.2 + 0.1 * k as f64,
        accuracy: Some(0.15 + 0.1 * k as f64),
        staleness: vec![0; 6],
        step: StepReport {
            version: PolicyVersion(k + 1),
            applied: true,
            loss: 0.5 - 0.01 * k as f64,
            kl: 1e-3 * k as f64,
            clip_fraction: 0.02,
            tokens: 900,
            groups: 6,
            ..StepReport::default()
        },
        intervals: vec![
            at(StageKind::Publication, 0.0, 0.05),
            at(StageKind::Generation, 0.05, 1.65),
            at(StageKind::Training, 0.4, 0.9),
            at(StageKind::Training, 1.0, 1.7),
            at(StageKind::Training, 1.8, 2.1),
        ],
    }
}

fn periods(n: u64) -> Vec<PeriodReport> {
    (0..n).map(|k| period(k, 2.1 * k as f64)).collect()
}

#[test]
fn a_run_directory_holds_config_checkpoints_and_one_json_line_per_period() {
    let root = tempfile::tempdir().unwrap();
    let dir = RunDir::create(&root.path().join("runs"), "demo").unwrap();
    assert_eq!(dir.path(), root.path().join("runs/demo"));
    assert!(dir.checkpoints().is_dir());

    let config = "[run]\nschedule = \"periodic\"\nperiods = 3\n";
    dir.write_config(config).unwrap();
    assert_eq!(fs::read_to_string(dir.path().join("config.toml")).unwrap(), config);

    let reports = periods(3);
    for (k, report) in reports.iter().enumerate() {
        dir.append_period(report).unwrap();
        // Each line is on disk as soon as its period is appended.
        let text = fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(text.lines().count(), k + 1);
        assert!(text.ends_with('\n'));
    }
    let text = fs::read_to_string(dir.metrics_path()).unwrap();
    for (line, report) in text.lines().zip(&reports) {
        let back: PeriodReport = serde_json::from_str(line).unwrap();
        assert_eq!(&back, report);
    }
    assert_eq!(dir.read_periods().unwrap(), reports);
}

#[test]
fn reopening_a_run_directory_appends_to_its_record() {
    let root = tempfile::tempdir().unwrap();
    let reports = periods(4);
    recorded(root.path(), "resumed", &reports[..2]);
    let again = recorded(root.path(), "resumed", &reports[2..]);
    assert_eq!(again.read_periods().unwrap(), reports);
}

#[test]
fn a_line_torn_by_a_crash_is_cut_before_the_next_append_and_a_resume_keeps_its_periods() {
    let root = tempfile::tempdir().unwrap();
    let reports = periods(4);
    let dir = recorded(root.path(), "torn", &reports[..2]);
    // Killed while writing period 2: half its line, no newline.
    let line = serde_json::to_string(&reports[2]).unwrap();
    let mut file = fs::OpenOptions::new().append(true).open(dir.metrics_path()).unwrap();
    std::io::Write::write_all(&mut file, &line.as_bytes()[..line.len() / 2]).unwrap();
    drop(file);
    assert_eq!(dir.read_periods().unwrap(), reports[..2], "the torn line is not a period");
    // The resumed run repeats period 2: its line replaces the torn one.
    append(&dir, &reports[2..]);
    assert_eq!(dir.read_periods().unwrap(), reports);
    assert!(fs::read_to_string(dir.metrics_path()).unwrap().lines().all(|l| l.ends_with('}')));
    // A resume from the checkpoint before period 3 (written before its line was
    // lost, say) keeps periods 0 to 2 only, so period 3 is not recorded twice.
    dir.resume_record(3).unwrap();
    assert_eq!(dir.read_periods().unwrap(), reports[..3]);
    dir.resume_record(0).unwrap();
    assert_eq!(dir.read_periods().unwrap(), []);
}

#[test]
fn a_skipped_step_with_a_non_finite_loss_reads_back_as_nan() {
    let root = tempfile::tempdir().unwrap();
    let dir = RunDir::create(root.path(), "diverged").unwrap();
    let mut report = period(0, 0.0);
    report.step.applied = false;
    report.step.loss = f64::NAN;
    report.step.grad_norm = f64::INFINITY;
    report.accuracy = None;
    dir.append_period(&report).unwrap();
    dir.append_period(&period(1, 2.1)).unwrap();

    let back = dir.read_periods().unwrap();
    assert_eq!(back.len(), 2);
    assert!(back[0].step.loss.is_nan() && back[0].step.grad_norm.is_nan());
    assert_eq!(back[0].accuracy, None);
    assert_eq!(back[0].intervals, report.intervals);
    assert_eq!(back[1], period(1, 2.1));
}

#[test]
fn plots_are_svg_documents_with_their_series() {
    let root = tempfile::tempdir().unwrap();
    let dir = RunDir::create(root.path(), "plots").unwrap();
    let reports = periods(4);
    dir.write_plots(&reports).unwrap();
    for (name, words) in [
        ("reward.svg", &["reward mean", "accuracy", "period"][..]),
        ("throughput.svg", &["generation tokens/s", "training tokens/s"][..]),
        ("timeline.svg", &["generation", "training", "publication", "p0", "p3"][..]),
    ] {
        let svg = fs::read_to_string(dir.path().join(name)).unwrap();
        assert!(svg.starts_with("<svg"), "{name}: {}", &svg[..svg.len().min(60)]);
        assert!(svg.trim_end().ends_with("</svg>"), "{name} is not closed");
        assert_eq!(svg.matches("<svg").count(), svg.matches("</svg>").count(), "{name}");
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count(), "{name}");
        for word in words {
            assert!(svg.contains(word), "{name} lacks {word:?}");
        }
    }
    // A bar per busy interval: 5 per period, beside the background and frame rectangles.
    let timeline = fs::read_to_string(dir.path().join("timeline.svg")).unwrap();
    assert!(timeline.matches("<rect").count() >= 4 * 5, "too few bars");
    // Redrawing replaces the files and leaves no temporary file behind.
    dir.write_plots(&reports[..1]).unwrap();
    let names: BTreeSet<String> =
        fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(
        names,
        ["checkpoints", "reward.svg", "throughput.svg", "timeline.svg"].map(String::from).into()
    );
}

#[test]
fn a_run_that_evaluated_plots_its_heldout_accuracy_from_the_event_files() {
    let root = tempfile::tempdir().unwrap();
    let dir = RunDir::create(root.path(), "evaluated").unwrap();
    // Two writers, as a run resumed once leaves them: the second file's point wins.
    let mut events = EventWriter::create(dir.path()).unwrap();
    events.scalars(0, &[("eval/heldout_accuracy", 0.199)]).unwrap();
    events.scalars(10, &[("eval/heldout_accuracy", 0.559), ("train/loss", 0.1)]).unwrap();
    events.scalars(20, &[("eval/heldout_accuracy", 0.5)]).unwrap();
    let mut resumed = EventWriter::create(dir.path()).unwrap();
    resumed.scalars(20, &[("eval/heldout_accuracy", 0.863)]).unwrap();
    dir.write_plots(&periods(3)).unwrap();

    let svg = fs::read_to_string(dir.path().join("heldout.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for word in ["Held-out accuracy", "held-out accuracy", "accuracy after the period"] {
        assert!(svg.contains(word), "heldout.svg lacks {word:?}");
    }
    assert_eq!(
        metronome_pipeline::heldout_accuracy(dir.path()).unwrap(),
        [(0, f64::from(0.199f32)), (10, f64::from(0.559f32)), (20, f64::from(0.863f32))]
    );
}

#[test]
fn a_damaged_event_file_leaves_out_the_heldout_plot_and_nothing_else() {
    let root = tempfile::tempdir().unwrap();
    let dir = RunDir::create(root.path(), "damaged").unwrap();
    let mut events = EventWriter::create(dir.path()).unwrap();
    events.scalars(0, &[("eval/heldout_accuracy", 0.2)]).unwrap();
    // A record whose length fails its checksum, as a disk error leaves one.
    let file = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).find(|p| {
        p.file_name().unwrap().to_str().unwrap().starts_with(metronome_pipeline::tensorboard::EVENTS_PREFIX)
    });
    let mut bytes = fs::read(file.as_ref().unwrap()).unwrap();
    bytes.extend_from_slice(&[7; 16]);
    fs::write(file.unwrap(), bytes).unwrap();
    let e = metronome_pipeline::heldout_accuracy(dir.path()).unwrap_err().to_string();
    assert!(e.contains("events.out.tfevents"), "{e}");
    dir.write_plots(&periods(2)).unwrap();
    assert!(dir.path().join("reward.svg").exists());
    assert!(!dir.path().join("heldout.svg").exists());
}

#[test]
fn errors_name_the_file_at_fault() {
    let root = tempfile::tempdir().unwrap();
    let dir = RunDir::create(root.path(), "broken").unwrap();
    // A folder where the file should be: opening it for appending fails.
    fs::create_dir(dir.metrics_path()).unwrap();
    let err = dir.append_period(&period(0, 0.0)).unwrap_err();
    assert!(matches!(err, Error::Io { .. }));
    assert!(err.to_string().contains("metrics.jsonl"), "{err}");

    fs::create_dir(dir.path().join("config.toml")).unwrap();
    let err = dir.write_config("").unwrap_err();
    assert!(err.to_string().contains("config.toml"), "{err}");

    let err = RunDir::create(root.path(), "../escape").unwrap_err();
    assert!(err.to_string().contains("escape"), "{err}");
}

#[test]
fn the_summary_has_a_row_per_period_and_a_totals_line() {
    let reports = periods(5);
    let table = summary_table(&reports);
    println!("{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2 + reports.len() + 2);
    for header in [
        "period",
        "seconds",
        "gen busy",
        "train busy",
        "overlap",
        "reward",
        "accuracy",
        "loss",
        "KL",
        "groups",
    ] {
        assert!(lines[0].contains(header), "no {header} column");
    }
    for (line, report) in lines[2..].iter().zip(&reports) {
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells[0], report.period.to_string());
        assert_eq!(cells[1], "2.10");
        assert_eq!(cells[4], format!("{:.2}", report.overlap_efficiency()));
        assert_eq!(cells.last().copied(), Some("6"));
    }
    let totals: Vec<&str> = lines.last().unwrap().split_whitespace().collect();
    assert_eq!(&totals[..3], ["all", "5", "10.50"]);
    assert_eq!(totals.last().copied(), Some("30"));
}

/// Every `metronome_…` name in a Prometheus expression of the dashboard, with the
/// suffixes Prometheus adds to histograms removed.
fn dashboard_metrics(dashboard: &serde_json::Value) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut stack = vec![dashboard];
    while let Some(value) = stack.pop() {
        match value {
            serde_json::Value::Object(map) => {
                if let Some(serde_json::Value::String(expr)) = map.get("expr") {
                    for (at, _) in expr.match_indices("metronome_") {
                        let name: String = expr[at..]
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        let base = ["_bucket", "_sum", "_count"]
                            .iter()
                            .find_map(|s| name.strip_suffix(s))
                            .unwrap_or(&name);
                        names.insert(base.to_owned());
                    }
                }
                stack.extend(map.values());
            }
            serde_json::Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    names
}

#[test]
fn the_grafana_dashboard_parses_and_charts_every_pipeline_metric() {
    let dashboard: serde_json::Value =
        serde_json::from_str(DASHBOARD).expect("dashboards/grafana.json parses");
    let charted = dashboard_metrics(&dashboard);
    for m in METRICS {
        assert!(
            charted.contains(m.name),
            "{} ({:?}) has no panel in dashboards/grafana.json",
            m.name,
            m.kind
        );
    }
    // A Prometheus data-source variable that every panel uses, so the dashboard imports anywhere.
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(variables.iter().any(|v| v["type"] == "datasource" && v["query"] == "prometheus"));
    let mut ids = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        assert!(ids.insert(panel["id"].as_u64().unwrap()), "duplicate panel id {}", panel["id"]);
        if panel["type"] != "row" {
            assert_eq!(panel["datasource"]["uid"], "${datasource}", "panel {}", panel["title"]);
        }
    }
    // Counters are charted as rates, never as raw totals that only grow.
    let exprs = DASHBOARD.matches("\"expr\"").count();
    assert!(exprs >= METRICS.len());
    for m in METRICS.iter().filter(|m| m.kind == metronome_core::MetricKind::Counter) {
        assert!(DASHBOARD.contains(&format!("rate({}", m.name)), "{} is charted without rate()", m.name);
    }
}

/// Every string literal shaped like a metric name (`"metronome_<stage>_<name>…"`) in
/// the sources of `crates/*/src`.
fn metric_names_in_sources() -> BTreeSet<String> {
    fn walk(dir: &std::path::Path, names: &mut BTreeSet<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, names);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let source = fs::read_to_string(&path).unwrap();
                for (at, _) in source.match_indices("\"metronome_") {
                    let Some(len) = source[at + 1..].find('"') else { continue };
                    let name = &source[at + 1..at + 1 + len];
                    let shaped =
                        name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
                    // Two parts are a tracing target or a crate name, not a metric.
                    if shaped && name.split('_').count() >= 3 {
                        names.insert(name.to_owned());
                    }
                }
            }
        }
    }
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut names = BTreeSet::new();
    for krate in fs::read_dir(crates).unwrap() {
        let src = krate.unwrap().path().join("src");
        if src.is_dir() {
            walk(&src, &mut names);
        }
    }
    names
}

#[test]
fn the_grafana_dashboard_charts_the_metrics_of_every_crate() {
    let dashboard: serde_json::Value = serde_json::from_str(DASHBOARD).unwrap();
    let charted = dashboard_metrics(&dashboard);
    let emitted = metric_names_in_sources();
    for stage in ["pipeline", "trainer", "rollout", "reward", "transport"] {
        assert!(
            emitted.iter().any(|n| n.starts_with(&format!("metronome_{stage}_"))),
            "no {stage} metric found"
        );
    }
    let missing: Vec<_> = emitted.difference(&charted).collect();
    assert!(missing.is_empty(), "metrics without a panel in dashboards/grafana.json: {missing:?}");
}

#[test]
fn every_metric_in_the_sources_is_in_a_typed_catalogue_that_follows_the_convention() {
    let mut catalogued = BTreeSet::new();
    // The pipeline's catalogue holds the trainer's per-step gauges (it records them):
    // each entry is held to the convention of the stage its name gives.
    for m in metronome_pipeline::CATALOGUES.iter().copied().flatten() {
        let stage = m.name.split('_').nth(1).unwrap();
        assert_eq!(m.convention_error(stage), None);
        assert!(catalogued.insert(m.name), "{} is catalogued twice", m.name);
    }
    let emitted = metric_names_in_sources();
    let missing: Vec<_> = emitted.iter().filter(|n| !catalogued.contains(n.as_str())).collect();
    assert!(missing.is_empty(), "metrics emitted but in no catalogue: {missing:?}");
}

/// The run directory fed by a real `Runner` (over the mock stages) through its
/// period hook, as the binary does it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_hook_records_every_period_and_the_plots_show_its_intervals() {
    use std::time::Duration;

    use metronome_pipeline::{Runner, RunnerOptions, Schedule};

    use crate::mocks::*;

    for schedule in [Schedule::Periodic, Schedule::Stale(1)] {
        let root = tempfile::tempdir().unwrap();
        let dir = RunDir::create(root.path(), "mock").unwrap();
        let engine = MockEngine::new(Duration::from_millis(2));
        let trainer = MockTrainer::new(engine.generating.clone());
        let stages = mock_stages(MockSource { next: 0, n: 1000, batch: 4, period: 0 }, engine, trainer);
        let options = RunnerOptions { schedule, periods: 3, group_size: 2, ..RunnerOptions::default() };
        let hook_dir = dir.clone();
        let runner = Runner::new(stages, Some(channel_transport(2)), options)
            .unwrap()
            .on_period(move |end| hook_dir.append_period(end.report));
        let reports = runner.run().await.unwrap().reports;

        assert_eq!(reports.len(), 3);
        assert_eq!(dir.read_periods().unwrap(), reports, "{schedule}");
        dir.write_plots(&reports).unwrap();
        let timeline = fs::read_to_string(dir.path().join("timeline.svg")).unwrap();
        let intervals: usize = reports.iter().map(|r| r.intervals.len()).sum();
        // The background and one bar per interval.
        assert_eq!(timeline.matches("<rect").count(), 1 + intervals, "{schedule}");
        assert_eq!(summary_table(&reports).lines().count(), 2 + 3 + 2);
    }
}

/// A run whose latest checkpoint was damaged on disk resumes from the one before,
/// says which it set aside and why, keeps it, and ends with the weights and the
/// record of the run that was never stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_latest_checkpoint_resumes_from_the_one_before_to_the_same_weights() {
    use std::sync::{Arc, Mutex};

    use metronome_pipeline::{Event, Observer, PipelineConfig, RunOptions};
    let out = tempfile::tempdir().unwrap();
    let config = |name: &str, periods: u64| {
        let overrides: Vec<String> = vec![
            format!("run.periods={periods}"),
            format!("run.name={name:?}"),
            format!("run.out_dir={:?}", out.path().display().to_string()),
            "run.checkpoint_every=1".into(),
            "run.group_size=4".into(),
            "data.release.batch_size=4".into(),
            "sft.steps=0".into(),
            "eval.prompts=0".into(),
            "rollout.sampling.max_new_tokens=6".into(),
            "run.cores=1".into(),
            "trainer.schedule.lr=0.01".into(),
            "reward.scorer={ kind = \"format\", pattern = \"[0-9]\" }".into(),
        ];
        PipelineConfig::embedded(&overrides).unwrap()
    };
    let whole = metronome_pipeline::run(config("whole", 3), RunOptions::default()).await.unwrap();
    metronome_pipeline::run(config("parts", 2), RunOptions::default()).await.unwrap();
    let periods = out.path().join("parts/checkpoints/periods");
    let weights = periods.join("period-2/policy/model.safetensors");
    let mut bytes = fs::read(&weights).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 1;
    fs::write(&weights, &bytes).unwrap();

    let events = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&events);
    let options = RunOptions {
        observer: Observer::new(move |e| seen.lock().unwrap().push(e.clone())),
        ..RunOptions::default()
    };
    let parts = metronome_pipeline::run(config("parts", 3), options).await.unwrap();
    let events = events.lock().unwrap();
    let set_aside = events.iter().find_map(|e| match e {
        Event::CheckpointSetAside { moved_to, reason } => Some((moved_to.clone(), reason.clone())),
        _ => None,
    });
    let (moved_to, reason) = set_aside.expect("the damaged checkpoint is reported");
    assert!(reason.starts_with("period-2: policy/model.safetensors is not what was written"), "{reason}");
    assert!(moved_to.join("policy/model.safetensors").is_file(), "kept whole for inspection");
    assert!(events.iter().any(|e| matches!(e, Event::Resuming { period: 1, .. })), "{events:?}");
    // Periods 1 and 2 again: the same weights, and one record line per period.
    assert_eq!(parts.periods.iter().map(|p| p.period.0).collect::<Vec<_>>(), [0, 1, 2]);
    let bits = |w: &metronome_core::WeightSnapshot| -> Vec<u32> {
        w.tensors
            .iter()
            .flat_map(|t| match &t.data {
                metronome_core::TensorData::F32(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                _ => panic!("f32 weights"),
            })
            .collect()
    };
    assert!(bits(&whole.weights) == bits(&parts.weights), "the resumed run ends on other weights");
    let record = RunDir::open(&out.path().join("parts")).unwrap().read_periods().unwrap();
    assert_eq!(record.iter().map(|r| r.period.0).collect::<Vec<_>>(), [0, 1, 2]);
}
