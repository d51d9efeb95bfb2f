//! `cargo xtask bench cli`: the multi-process pipeline on one machine — a real
//! `nats-server`, one `metronome trainer` and 1, 2 or 4 `metronome rollout-worker`
//! processes — beside the single-process `periodic` run of the same workload.
//!
//! It prints, per worker count, the mean period time, groups trained per second and
//! the weight publication time per period (object store upload plus announcement),
//! from the trainer's `metrics.jsonl`. Every process shares the machine's cores (CI and
//! the reference machine have two), so more workers than cores measure contention,
//! not scaling.
//!
//! Without `--bench` (e.g. under `cargo test --benches`) it runs one short period with
//! one worker as a smoke test.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

struct Measured {
    period_s: f64,
    groups_per_s: f64,
    publication_s: f64,
}

fn measure(run: &Path, warmup: usize) -> Measured {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics.jsonl");
    let rows: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let kept = &rows[warmup.min(rows.len() - 1)..];
    let n = kept.len() as f64;
    let mean = |key: &str| kept.iter().map(|r| r[key].as_f64().unwrap()).sum::<f64>() / n;
    let groups: f64 = kept.iter().map(|r| r["groups"].as_f64().unwrap()).sum();
    let seconds: f64 = kept.iter().map(|r| r["period_s"].as_f64().unwrap()).sum();
    Measured {
        period_s: mean("period_s"),
        groups_per_s: groups / seconds,
        publication_s: mean("publication_s"),
    }
}

fn metronome(args: &[&str], sets: &[String], out: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_metronome"));
    command.args(args).args(["--metrics-addr", "off"]);
    for s in sets {
        command.arg("--set").arg(s);
    }
    command
        .arg("--out-dir")
        .arg(out)
        .env("CANDLE_NUM_THREADS", "1")
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null());
    command
}

/// Starts a worker and waits until it is ready to take claims.
fn worker(id: usize, sets: &[String], out: &Path) -> Child {
    let mut child = metronome(&["rollout-worker", "--worker-id", &id.to_string()], sets, out)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a worker");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.expect("worker stderr").contains("ready") {
            break;
        }
    }
    // Keep draining so the worker never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    child
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (periods, warmup, counts): (u64, usize, &[usize]) =
        if bench { (5, 1, &[1, 2, 4]) } else { (1, 0, &[1]) };
    // The pipeline bench's balanced workload: 16 prompts of 8 forced 40-token responses.
    let workload: Vec<String> = [
        "sft.steps=0",
        "eval.prompts=0",
        "data.release.batch_size=16",
        "run.group_size=8",
        "trainer.skip_zero_advantage_groups=false",
        "rollout.sampling.max_new_tokens=40",
        "rollout.sampling.ignore_eos=true",
        "run.schedule=\"periodic\"",
        "run.name=bench",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([format!("run.periods={periods}")])
    .collect();

    let out = tempfile::tempdir().unwrap();
    let single = out.path().join("single");
    let status = metronome(&["run", "--quiet"], &workload, &single).stderr(Stdio::null()).status().unwrap();
    assert!(status.success(), "single-process run failed");
    let base = measure(&single.join("bench"), warmup);
    println!("\nworkload: {} periods of 16 prompts x 8 responses of 40 tokens", periods - warmup as u64);
    println!("{:>16}  {:>9}  {:>9}  {:>14}", "processes", "period s", "groups/s", "publication ms");
    println!(
        "{:>16}  {:>9.3}  {:>9.1}  {:>14.2}",
        "single process",
        base.period_s,
        base.groups_per_s,
        base.publication_s * 1e3
    );
    for &n in counts {
        let server = metronome_testkit::server::NatsServer::start(&[]).expect("start nats-server");
        let mut sets = workload.clone();
        sets.extend(["transport.kind=nats".to_owned(), format!(r#"transport.urls=["{}"]"#, server.url())]);
        let dir = out.path().join(format!("workers-{n}"));
        let mut workers: Vec<Child> = (0..n).map(|i| worker(i, &sets, &dir)).collect();
        let status =
            metronome(&["trainer", "--quiet"], &sets, &dir).stderr(Stdio::null()).status().expect("trainer");
        assert!(status.success(), "trainer failed with {n} workers");
        for w in &mut workers {
            assert!(w.wait().unwrap().success(), "a worker failed");
        }
        let m = measure(&dir.join("bench"), warmup);
        println!(
            "{:>16}  {:>9.3}  {:>9.1}  {:>14.2}   ({:.2}x the single-process period)",
            format!("trainer + {n} wkr"),
            m.period_s,
            m.groups_per_s,
            m.publication_s * 1e3,
            m.period_s / base.period_s
        );
    }
}
