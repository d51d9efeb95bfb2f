//! The Prometheus endpoint, scraped while a run is in progress, serves every metric
//! the pipeline documents.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) fn scrape(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut body = String::new();
    stream.read_to_string(&mut body).ok()?;
    Some(body)
}

#[test]
fn every_documented_metric_is_served_during_a_run() {
    let port = metronome_testkit::server::free_port().expect("a free port");
    let out = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_metronome"))
        .args(["run", "--quiet", "--periods", "4", "--metrics-addr", &format!("127.0.0.1:{port}")])
        .args(["--set", "sft.steps=2", "--set", "eval.prompts=16", "--set", "eval.every=1"])
        .args(["--set", "data.release.batch_size=32"])
        .arg("--out-dir")
        .arg(out.path())
        .env("CANDLE_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    // Scrape until the run ends; keep the last page that has a finished period.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut page = None;
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        if let Some(body) = scrape(port)
            && body.contains("metronome_pipeline_periods_total")
        {
            page = Some(body);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(status.success(), "metronome run failed: {stderr}");
    let page = page.unwrap_or_else(|| panic!("no scrape saw a finished period; stderr: {stderr}"));

    let missing: Vec<&str> = metronome_pipeline::METRICS
        .iter()
        .map(|m| m.name)
        .filter(|name| !page.lines().any(|l| l.starts_with(name)))
        .collect();
    assert!(missing.is_empty(), "not served: {missing:?}\n{page}");
    // The stages' own metrics come through the same endpoint.
    for name in ["metronome_reward_completions_total", "metronome_trainer_steps_total"] {
        assert!(page.contains(name), "{name} not served");
    }
    // And the run directory was written.
    let run = std::fs::read_dir(out.path()).unwrap().next().unwrap().unwrap().path();
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().count();
    assert_eq!(lines, 4);
}
