//! The hostile-program suite through the reward pool: every case contained and
//! scored with its reason, no process of it left in the process table, nothing
//! outside the sandbox changed, no connection made, and the pool still scoring at
//! full strength afterwards.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;

use metronome_core::{GroupScorer, Reward};
use metronome_reward::code::hostile::{self, HostileEnv};
use metronome_reward::{CodeConfig, PoolConfig, PoolScorer, SandboxConfig, VerdictKind};

use crate::code::{reward, task};
use crate::common::group;

/// The suite's limits: what the README's table was produced with
/// (`cargo run -p metronome-reward --example hostile` uses the same).
fn hostile_config() -> CodeConfig {
    CodeConfig {
        time_budget_ms: 2_000,
        sandbox: SandboxConfig { wall_ms: 2_000, cpu_s: 1, memory_mb: 256, ..SandboxConfig::default() },
        ..CodeConfig::default()
    }
}

fn kind_of(reward: &Reward) -> VerdictKind {
    if reward.parts.get("correct") == Some(&1.0) {
        return VerdictKind::Passed;
    }
    *VerdictKind::ALL
        .iter()
        .find(|k| reward.parts.get(k.label()) == Some(&1.0))
        .unwrap_or_else(|| panic!("no verdict in {reward:?}"))
}

/// The command lines (arguments joined by NULs) of the processes whose command line
/// holds `marker`.
fn survivors(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains(marker) {
            found.push(cmdline.into_owned());
        }
    }
    found
}

fn listing(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect()
}

#[test]
fn hostile_programs_are_contained_scored_and_leave_nothing_behind() {
    let run_dir = tempfile::tempdir().unwrap();
    let secret = "the-answers-are-42".to_owned();
    std::fs::write(run_dir.path().join("secret.txt"), &secret).unwrap();
    let before = listing(run_dir.path());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let marker = format!("hostile{nanos:x}");
    let env = HostileEnv {
        marker: marker.clone(),
        run_dir: run_dir.path().display().to_string(),
        secret,
        port: listener.local_addr().unwrap().port(),
        env: host_variable(),
    };
    let cases = hostile::suite(&env);
    assert!(cases.len() >= 14);

    let scorer = Arc::new(
        PoolScorer::new(
            reward(hostile_config()),
            PoolConfig { workers: 4, time_limit_ms: 4_000, ..PoolConfig::default() },
        )
        .unwrap(),
    );
    // While the suite runs, the fork bomb's processes (its program text is in their
    // command lines) are counted: the process limit must hold them down.
    let bomb = cases.iter().find(|c| c.name == "fork bomb").unwrap();
    let bomb_text = "os.fork()\n    except".to_owned();
    assert!(bomb.completion.contains(&bomb_text));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (stop, marker) = (Arc::clone(&stop), marker.clone());
        std::thread::spawn(move || {
            let mut most = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let bombs = survivors(&marker).iter().filter(|cmdline| cmdline.contains(&bomb_text)).count();
                most = most.max(bombs);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            most
        })
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let scored = runtime.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for (i, case) in cases.iter().enumerate() {
            let scorer = Arc::clone(&scorer);
            let g = group(task(&case.tests), &[case.completion.as_str()]);
            tasks.spawn(async move { (i, scorer.score(g).await.unwrap()) });
        }
        let mut scored = tasks.join_all().await;
        scored.sort_by_key(|(i, _)| *i);
        scored
    });

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let most_bombs = sampler.join().unwrap();
    // The limit counts the namespace's processes, bwrap's init among them; bwrap
    // itself, outside, carries the program text too.
    let limit = hostile_config().sandbox.processes as usize;
    assert!(
        (3..=limit + 1).contains(&most_bombs),
        "the fork bomb ran {most_bombs} processes at once (limit {limit})"
    );

    for ((_, s), case) in scored.iter().zip(&cases) {
        let reward = &s.rewards[0];
        assert!(reward.failure.is_none(), "{}: scoring failed: {reward:?}", case.name);
        let kind = kind_of(reward);
        assert!(
            case.expected.contains(&kind),
            "{}: {kind:?} not in {:?}: {reward:?}",
            case.name,
            case.expected
        );
        let expected_score = if kind == VerdictKind::Passed { 1.0 } else { 0.0 };
        assert_eq!(reward.total, expected_score, "{}", case.name);
    }

    // Nothing left running: every hostile process carries the marker in its command line.
    assert_eq!(survivors(&marker), Vec::<String>::new(), "processes of the suite survived it");
    // Nothing outside changed, nothing connected.
    assert_eq!(listing(run_dir.path()), before, "the run directory changed");
    for path in [format!("/usr/{marker}"), format!("/{marker}"), "/tmp/daemon".to_owned()] {
        assert!(!Path::new(&path).exists(), "{path} was written");
    }
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("a sandboxed program connected to the supervisor: {other:?}"),
    }

    // The pool is whole and scores at full strength.
    let stats = scorer.stats();
    assert_eq!((stats.live, stats.stuck, stats.timeouts), (4, 0, 0), "{stats:?}");
    let right = "```python\ndef add(a, b):\n    return a + b\n```";
    let g = group(task(&cases[1].tests), &[right; 8]);
    let scored = runtime.block_on(scorer.score(g)).unwrap();
    assert!(scored.rewards.iter().all(|r| r.total == 1.0), "{:?}", scored.rewards);
}

/// A variable of this process's environment: `HOME` where it is set, else `PATH`.
fn host_variable() -> (String, String) {
    ["HOME", "PATH"]
        .iter()
        .find_map(|name| Some((name.to_string(), std::env::var(name).ok().filter(|v| !v.is_empty())?)))
        .expect("HOME or PATH is set")
}
