//! `metronome run` killed (SIGKILL) and run again: it resumes from its last
//! checkpoint and ends with the weights and the record of an uninterrupted run.

use std::path::Path;
use std::time::Duration;

use crate::cluster::{Proc, max_difference, period_of, read_weights, serial};

/// A short run whose rewards vary for an untrained model (so the weights move), with
/// a checkpoint after every period.
fn settings(schedule: &str) -> Vec<String> {
    [
        "run.group_size=4",
        "data.release.batch_size=6",
        "sft.steps=0",
        "eval.prompts=8",
        "eval.every=3",
        "rollout.max_num_seqs=8",
        "rollout.sampling.max_new_tokens=24",
        "run.cores=2",
        "trainer.schedule.lr=0.01",
        r#"reward.scorer={kind="length", max_len=12, cache_len=10, penalty=1.0}"#,
        "run.name=resumed",
        "run.checkpoint_every=1",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([format!("run.schedule=\"{schedule}\"")])
    .collect()
}

fn run(sets: &[String], out: &Path) -> Proc {
    Proc::spawn("run", &["run", "--quiet"], sets, out)
}

/// The periods of `metrics.jsonl`, in order.
fn recorded_periods(run: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["period"].as_u64().unwrap())
        .collect()
}

/// SplitMix64: the kill points of the test, from a fixed seed.
pub(crate) fn mix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Kills this many runs per schedule (`METRONOME_SOAK_KILLS`, 3 by default; `cargo
/// xtask soak` asks for more, over a longer run).
pub(crate) fn kills_wanted() -> u64 {
    std::env::var("METRONOME_SOAK_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(3)
}

#[test]
fn a_run_killed_anywhere_resumes_to_the_weights_and_record_of_an_uninterrupted_one() {
    let _serial = serial();
    let wanted = kills_wanted();
    // Enough periods for the kills: each lands in one of the next two periods.
    let periods = (2 * wanted).max(6);
    for (schedule, seed) in [("periodic", 1u64), ("sync", 2)] {
        let mut sets = settings(schedule);
        sets.push(format!("run.periods={periods}"));
        let reference = tempfile::tempdir().unwrap();
        run(&sets, reference.path()).finish_ok();
        let expected = read_weights(&reference.path().join("resumed"));

        // SIGKILL at a seeded point of each attempt, right after a period ended
        // (while its checkpoint and the next period's work are under way) or a
        // little later, and the same command again, until the run finishes.
        let out = tempfile::tempdir().unwrap();
        let mut state = seed;
        let (mut kills, mut next) = (0, 0);
        loop {
            let mut p = run(&sets, out.path());
            if kills == wanted || next + 1 >= periods {
                p.finish_ok();
                assert!(kills == 0 || p.log().contains("resuming at period"), "{}", p.log());
                break;
            }
            // A period of this attempt (it may resume past `next`: the kill can land
            // after a later checkpoint).
            let mut target = next + mix(&mut state) % 2;
            let ended = loop {
                let Some(event) = p.next_event() else { break None };
                if let Some(n) = event["period"].as_u64().filter(|_| event["event"] == "resuming") {
                    target = target.max(n);
                }
                if let Some(n) = period_of(&event)
                    && n >= target
                {
                    break Some(n);
                }
            };
            let Some(period) = ended else {
                p.finish_ok();
                break;
            };
            std::thread::sleep(Duration::from_millis(mix(&mut state) % 60));
            p.sigkill();
            kills += 1;
            next = period + 1;
        }
        let run_dir = out.path().join("resumed");
        let diff = max_difference(&expected, &read_weights(&run_dir));
        assert!(diff <= 1e-6, "{schedule}: after {kills} kills the weights differ by {diff}");
        assert_eq!(recorded_periods(&run_dir), (0..periods).collect::<Vec<_>>(), "{schedule}: the record");
        assert!(kills >= wanted.min(3), "{schedule}: only {kills} kills");
        eprintln!("{schedule}: survived {kills} kills");
    }
}

#[test]
fn a_resume_that_would_train_differently_is_refused_by_key_unless_allowed() {
    let _serial = serial();
    let out = tempfile::tempdir().unwrap();
    let mut sets = settings("periodic");
    sets.push("run.periods=2".into());
    run(&sets, out.path()).finish_ok();
    // More periods and another evaluation are the same run; another rate is not.
    let mut longer = sets.clone();
    longer.push("run.periods=3".into());
    longer.push("eval.every=1".into());
    longer.push("trainer.schedule.lr=0.02".into());
    let mut refused = run(&longer, out.path());
    assert!(!refused.finish().success());
    let log = refused.log();
    assert!(log.contains("`trainer.schedule.lr`") && log.contains("--allow-config-change"), "{log}");
    assert_eq!(recorded_periods(&out.path().join("resumed")), [0, 1], "a refused resume changes nothing");

    // `--resume DIR` takes the stored config: no flags needed but the new length.
    let dir = out.path().join("resumed");
    let mut resumed = Proc::spawn(
        "resume",
        &["run", "--quiet", "--resume", dir.to_str().unwrap(), "--periods", "3"],
        &[],
        out.path(),
    );
    resumed.finish_ok();
    assert!(resumed.log().contains("resuming at period 2"), "{}", resumed.log());
    assert_eq!(recorded_periods(&dir), [0, 1, 2]);

    // Allowed, the changed rate trains on.
    longer.push("run.periods=4".into());
    let mut allowed =
        Proc::spawn("allowed", &["run", "--quiet", "--allow-config-change"], &longer, out.path());
    allowed.finish_ok();
    assert_eq!(recorded_periods(&dir), [0, 1, 2, 3]);
}

/// A run killed during its warm start resumes the warm start after its last
/// checkpoint (not from step 0) and ends with the weights of the uninterrupted run.
#[test]
fn a_run_killed_during_its_warm_start_resumes_it_to_the_same_weights() {
    let _serial = serial();
    let mut sets = settings("periodic");
    sets.retain(|s| s != "sft.steps=0");
    sets.extend(
        ["run.periods=1", "sft.steps=12", "sft.batch_size=8", "sft.checkpoint_every=3"].map(String::from),
    );
    let reference = tempfile::tempdir().unwrap();
    run(&sets, reference.path()).finish_ok();
    let expected = read_weights(&reference.path().join("resumed"));

    let out = tempfile::tempdir().unwrap();
    let mut p = run(&sets, out.path());
    // Killed after step 7 is reported: the checkpoint of step 6 is the last whole one.
    p.wait_event("warm_start_step", |e| e["step"].as_u64() == Some(7));
    p.sigkill();
    let mut again = run(&sets, out.path());
    let resumed = again.wait_event("warm_start_resuming", |_| true);
    let step = resumed["step"].as_u64().unwrap();
    assert!((6..12).contains(&step) && step.is_multiple_of(3), "resumed after step {step}");
    let first = again.wait_event("warm_start_step", |_| true);
    assert_eq!(first["step"].as_u64(), Some(step + 1), "the next step, not step 1");
    again.finish_ok();
    let diff = max_difference(&expected, &read_weights(&out.path().join("resumed")));
    assert!(diff <= 1e-6, "after a kill in the warm start the weights differ by {diff}");
}
