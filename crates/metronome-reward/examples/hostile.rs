//! Runs the hostile-program suite in the code sandbox and prints the README's table:
//! each case, what contained it, its score and the reason recorded.
//!
//! `cargo run -p metronome-reward --example hostile` (it also runs, as a check, under
//! `cargo test --examples`: a case that is not contained makes it fail).

use std::net::TcpListener;

use anyhow::{Context, bail};
use metronome_reward::code::hostile::{self, HostileEnv};
use metronome_reward::{CodeConfig, SandboxConfig, VerdictKind};

fn main() -> anyhow::Result<()> {
    // The limits the crate's hostile test uses.
    let config = CodeConfig {
        time_budget_ms: 2_000,
        sandbox: SandboxConfig { wall_ms: 2_000, cpu_s: 1, memory_mb: 256, ..SandboxConfig::default() },
        ..CodeConfig::default()
    };
    let code = config.build().context("starting the code sandbox")?;
    let run_dir = tempfile::tempdir()?;
    std::fs::write(run_dir.path().join("secret.txt"), "the-answers-are-42")?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let env = HostileEnv {
        marker: "hostile-example".into(),
        run_dir: run_dir.path().display().to_string(),
        secret: "the-answers-are-42".into(),
        port: listener.local_addr()?.port(),
        env: host_variable(),
    };
    let cases = hostile::suite(&env);
    // Four at a time, as the reward pool runs them by default.
    let verdicts: Vec<_> = std::thread::scope(|s| {
        let chunks: Vec<_> = cases
            .chunks(cases.len().div_ceil(4))
            .map(|chunk| {
                s.spawn(|| {
                    chunk.iter().map(|c| code.verdict_for(&c.completion, &c.tests)).collect::<Vec<_>>()
                })
            })
            .collect();
        chunks.into_iter().flat_map(|h| h.join().expect("a suite thread panicked")).collect()
    });

    let sandbox = code.sandbox().config();
    println!(
        "Limits: {} ms wall, {} s CPU, {} MiB address space, {} processes, {} open files, {} bytes of output, {} \
         bytes of disk.\n",
        sandbox.wall_ms,
        sandbox.cpu_s,
        sandbox.memory_mb,
        sandbox.processes,
        sandbox.open_files,
        sandbox.output_bytes,
        sandbox.disk_bytes
    );
    println!("| case | what it tries | what the sandbox did | score | verdict: reason |");
    println!("|---|---|---|---|---|");
    let mut escaped = Vec::new();
    for (case, verdict) in cases.iter().zip(verdicts) {
        let verdict = verdict.with_context(|| format!("running `{}`", case.name))?;
        let score = code.reward_of(&verdict).total;
        let reason = verdict.detail.replace('|', "\\|").replace(&env.run_dir, "<run dir>");
        println!(
            "| {} | {} | {} | {score} | `{}`: {reason} |",
            case.name,
            case.tries,
            case.contained_by,
            verdict.kind.label()
        );
        let expected_score = if verdict.kind == VerdictKind::Passed { 1.0 } else { 0.0 };
        if !case.expected.contains(&verdict.kind) || score != expected_score {
            escaped.push(case.name);
        }
    }
    if !escaped.is_empty() {
        bail!("not contained as expected: {escaped:?}");
    }
    Ok(())
}

/// A variable of this process's environment: `HOME` where it is set, else `PATH`.
fn host_variable() -> (String, String) {
    ["HOME", "PATH"]
        .iter()
        .find_map(|name| Some((name.to_string(), std::env::var(name).ok().filter(|v| !v.is_empty())?)))
        .expect("HOME or PATH is set")
}
