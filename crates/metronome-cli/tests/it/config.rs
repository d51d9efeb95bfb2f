//! `metronome config`: the resolved configuration, as `run` would use it.

use std::process::Command;

fn resolved(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metronome")).arg("config").args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn schedule_shorthand_stale_brings_its_importance_sampling_cap() {
    // `cargo xtask e2e --schedule stale:2` must run on the embedded default.
    let (ok, toml, err) = resolved(&["--schedule", "stale:2"]);
    assert!(ok, "{err}");
    assert!(toml.contains("schedule = \"stale:2\""), "{toml}");
    assert!(toml.contains("tis_cap = 2.0"), "{toml}");
    // A cap the user chose is kept.
    let (ok, toml, err) = resolved(&["--schedule", "stale:1", "--set", "trainer.loss.tis_cap=5.0"]);
    assert!(ok, "{err}");
    assert!(toml.contains("tis_cap = 5.0"), "{toml}");
    // On-policy schedules get none, and `--set run.schedule` is taken as written.
    let (ok, toml, err) = resolved(&["--schedule", "sync"]);
    assert!(ok && !toml.contains("tis_cap"), "{err}{toml}");
    let (ok, _, err) = resolved(&["--set", "run.schedule=\"stale:2\""]);
    assert!(!ok && err.contains("trainer.loss.tis_cap"), "{err}");
}
