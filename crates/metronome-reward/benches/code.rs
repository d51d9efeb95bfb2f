//! The code reward's throughput and the sandbox's own cost.
//!
//! - `code/pool`: completions per second scored by a [`PoolScorer`] at the default
//!   pool size (`PoolConfig::default().workers`), each a correct program run against
//!   three assert-style tests in its own sandbox; criterion reports elements
//!   (executions) per second.
//! - `code/one`: one execution of the same program and tests (the same interpreter
//!   command line: `python3 -I -c <program and asserts>`) in the sandbox and without it; the ratio of the
//!   two times is the sandbox's overhead (bwrap's namespaces and mounts, setpriv
//!   and prlimit).
//!
//! `cargo xtask bench reward` (or `cargo bench -p metronome-reward --bench code`).

use std::process::Command;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use metronome_core::{CodeTests, Completion, Group, Prompt};
use metronome_reward::{CodeConfig, PoolConfig, PoolScorer, Sandbox, SandboxConfig};

const PROGRAM: &str = "def add(a, b):\n    return a + b\n";
const TESTS: [&str; 3] = ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(20, 22) == 42"];

fn group(n: usize) -> Group {
    let tests = CodeTests::Assert {
        prefix: String::new(),
        setup: String::new(),
        tests: TESTS.map(String::from).to_vec(),
    };
    let prompt = Prompt { reference: Some(serde_json::to_string(&tests).unwrap()), ..Prompt::default() };
    let text = format!("```python\n{PROGRAM}```\n");
    let completions = (0..n)
        .map(|i| Completion { sample_index: i as u32, text: text.clone(), ..Completion::default() })
        .collect();
    Group { prompt, completions, ..Group::default() }
}

fn pool(c: &mut Criterion) {
    let code = CodeConfig::default().build().expect("the sandbox starts on this machine");
    let scorer = PoolScorer::new(code, PoolConfig::default()).unwrap();
    let n = 16;
    let g = group(n);
    let mut bench = c.benchmark_group("code");
    bench.sample_size(10).measurement_time(Duration::from_secs(10));
    bench.throughput(Throughput::Elements(n as u64));
    bench.bench_function(format!("pool/{}_workers", PoolConfig::default().workers), |b| {
        b.iter(|| {
            let scored = scorer.score_blocking(g.clone()).unwrap();
            assert!(scored.rewards.iter().all(|r| r.total == 1.0));
        });
    });
    bench.finish();
}

fn one(c: &mut Criterion) {
    let config = SandboxConfig::default();
    let sandbox = Sandbox::new(config.clone()).expect("the sandbox starts on this machine");
    let source = format!("{PROGRAM}{}\n", TESTS.join("\n"));
    let args = ["-c".to_owned(), source.clone()];
    let mut bench = c.benchmark_group("code/one");
    bench.sample_size(20).measurement_time(Duration::from_secs(8));
    bench.throughput(Throughput::Elements(1));
    bench.bench_function("sandboxed", |b| {
        b.iter(|| {
            let run = sandbox.run(&args, b"", Duration::from_secs(10)).unwrap();
            assert!(run.status.success());
        });
    });
    bench.bench_function("unsandboxed", |b| {
        b.iter(|| {
            let status = Command::new(&config.interpreter)
                .args(&config.interpreter_args)
                .args(&args)
                .status()
                .unwrap();
            assert!(status.success());
        });
    });
    bench.finish();
}

criterion_group!(benches, pool, one);
criterion_main!(benches);
