//! `cargo xtask deps` run for real: `cargo metadata` on the workspace itself passes,
//! and on a scratch workspace with a deliberately wrong dependency it fails, naming
//! the package, the dependency and the rule.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

fn deps(manifest: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["deps", "--manifest-path"])
        .arg(manifest)
        .output()
        .expect("xtask runs")
}

#[test]
fn workspace_passes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = deps(&root.join("Cargo.toml"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn write_crate(root: &Path, name: &str, deps: &str) {
    let dir = root.join("crates").join(name);
    fs::create_dir_all(dir.join("src")).unwrap();
    fs::write(
        dir.join("Cargo.toml"),
        format!("[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n[dependencies]\n{deps}\n"),
    )
    .unwrap();
    fs::write(dir.join("src/lib.rs"), "").unwrap();
}

#[test]
fn a_stage_depending_on_a_stage_fails_and_the_fix_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let manifest = root.join("Cargo.toml");
    fs::write(&manifest, "[workspace]\nresolver = \"3\"\nmembers = [\"crates/*\"]\n").unwrap();
    write_crate(root, "metronome-core", "");
    write_crate(root, "metronome-rollout", "metronome-core = { path = \"../metronome-core\" }");
    write_crate(
        root,
        "metronome-trainer",
        "metronome-core = { path = \"../metronome-core\" }\nmetronome-rollout = { path = \"../metronome-rollout\" }",
    );

    let out = deps(&manifest);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a stage depending on a stage must fail");
    assert!(stderr.contains("metronome-trainer depends on metronome-rollout"), "{stderr}");
    assert!(stderr.contains("stage crates never depend on each other"), "{stderr}");

    write_crate(root, "metronome-trainer", "metronome-core = { path = \"../metronome-core\" }");
    let out = deps(&manifest);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn core_gaining_a_runtime_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let manifest = root.join("Cargo.toml");
    fs::write(&manifest, "[workspace]\nresolver = \"3\"\nmembers = [\"crates/*\"]\n").unwrap();
    // A path dependency named like a runtime: `--offline --no-deps` needs nothing fetched.
    write_crate(root, "tokio", "");
    write_crate(root, "metronome-core", "tokio = { path = \"../tokio\" }");
    let out = deps(&manifest);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("metronome-core depends on tokio"), "{stderr}");
}
