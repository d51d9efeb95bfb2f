//! The code and judge rewards in runs of the binary: the code preset's reward runs
//! real programs in the sandbox (their verdicts reach Prometheus), and the judge
//! scorer grades a run through `metronome serve`.

use std::path::PathBuf;

use crate::cluster::{Proc, period_of, serial};
use crate::prometheus::scrape;

/// The sum of the samples of `name` on a Prometheus page whose labels contain `label`.
fn sum(page: &str, name: &str, label: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The page scraped while `run` is between its first and last period.
fn page_after_first_period(run: &Proc, port: u16) -> String {
    run.wait_event("period_done", |e| period_of(e) == Some(0));
    scrape(port).unwrap_or_else(|| panic!("no metrics page; log:\n{}", run.log()))
}

#[test]
fn the_code_preset_scores_with_programs_run_in_the_sandbox() {
    let _serial = serial();
    let out = tempfile::tempdir().unwrap();
    let preset = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../metronome-pipeline/configs/code.toml");
    let port = metronome_testkit::server::free_port().unwrap();
    let sets =
        ["run.periods=3", "run.group_size=4", "data.release.batch_size=4", "eval.prompts=0", "run.cores=1"]
            .map(String::from);
    let mut run = Proc::spawn_with(
        "code",
        &["run", "--config", preset.to_str().unwrap()],
        &sets,
        out.path(),
        Some(port),
    );
    let page = page_after_first_period(&run, port);
    run.finish_ok();
    // Every response of the first period was run (or found to hold no program) and
    // got a verdict; none failed for want of a sandbox.
    let executions = sum(&page, "metronome_reward_code_executions_total", "verdict=");
    assert!(executions >= 16.0, "{executions} executions:\n{page}");
    assert_eq!(sum(&page, "metronome_reward_failures_total", "reason=\"scorer\""), 0.0, "{page}");
    assert!(page.contains("metronome_reward_code_execution_seconds"), "{page}");
}

#[test]
fn the_judge_grades_a_run_through_metronome_serve() {
    let _serial = serial();
    let out = tempfile::tempdir().unwrap();
    let judge_port = metronome_testkit::server::free_port().unwrap();
    let addr = format!("127.0.0.1:{judge_port}");
    // The rubric and its slots take a few hundred of the tiny model's character tokens.
    let serve = [
        "serve",
        "--addr",
        &addr,
        "--model-name",
        "judge",
        "--set",
        "rollout.max_seq_len=1024",
        "--events",
        "-",
    ];
    let mut judge = Proc::spawn_plain("serve", &serve);
    judge.wait_event("serving", |_| true);

    let port = metronome_testkit::server::free_port().unwrap();
    let reward = format!(
        "reward={{kind = \"judge\", url = \"http://{addr}\", model = \"judge\", max_tokens = 12, \
         timeout_ms = 30000, max_retries = 1, on_failure = \"score\"}}"
    );
    let sets = [
        "run.periods=2".to_owned(),
        "run.group_size=2".into(),
        "data.release.batch_size=3".into(),
        "sft.steps=0".into(),
        "eval.prompts=0".into(),
        "run.cores=1".into(),
        reward,
    ];
    let mut run = Proc::spawn_with("judged", &["run"], &sets, out.path(), Some(port));
    let page = page_after_first_period(&run, port);
    run.finish_ok_showing(&[&judge]);
    judge.sigterm();
    assert!(judge.finish().success(), "{}", judge.log());

    // Every completion of the first period went to the judge and got an answer; the
    // untrained tiny model answers without the `SCORE: <n>` line, so its judgements
    // are malformed and the failure policy scored them, counted.
    let requests = sum(&page, "metronome_reward_judge_requests_total", "outcome=");
    let answered = sum(&page, "metronome_reward_judge_requests_total", "outcome=\"ok\"")
        + sum(&page, "metronome_reward_judge_requests_total", "outcome=\"malformed\"");
    assert!(requests >= 6.0 && answered == requests, "{page}");
    let failed = sum(&page, "metronome_reward_judge_failures_total", "policy=\"score\"");
    assert_eq!(
        failed,
        sum(&page, "metronome_reward_judge_requests_total", "outcome=\"malformed\""),
        "{page}"
    );
}
