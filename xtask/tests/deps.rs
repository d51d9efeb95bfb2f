//! `cargo xtask deps` run for real: `cargo metadata` on the workspace itself passes,
//! and on a scratch workspace with a deliberately wrong dependency it fails, naming
//! the package, the dependency and the rule.

use std::fs;
use std::path::{Path, PathBuf};
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

/// `cargo xtask deps` on `manifest`, which must fail; what it wrote to stderr.
fn deps_failure(manifest: &Path) -> String {
    let out = deps(manifest);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "xtask deps passed: {stderr}");
    stderr
}

/// A scratch workspace of `crates` (name, `[dependencies]` lines), and its manifest.
fn scratch_workspace(crates: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let manifest = tmp.path().join("Cargo.toml");
    fs::write(&manifest, "[workspace]\nresolver = \"3\"\nmembers = [\"crates/*\"]\n").unwrap();
    for (name, deps) in crates {
        write_crate(tmp.path(), name, deps);
    }
    (tmp, manifest)
}

/// The dependency on `metronome-core` of a crate beside it.
const ON_CORE: &str = "metronome-core = { path = \"../metronome-core\" }";

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
    let on_rollout = format!("{ON_CORE}\nmetronome-rollout = {{ path = \"../metronome-rollout\" }}");
    let (tmp, manifest) = scratch_workspace(&[
        ("metronome-core", ""),
        ("metronome-rollout", ON_CORE),
        ("metronome-trainer", &on_rollout),
    ]);

    let stderr = deps_failure(&manifest);
    assert!(stderr.contains("metronome-trainer depends on metronome-rollout"), "{stderr}");
    assert!(stderr.contains("stage crates never depend on each other"), "{stderr}");

    write_crate(tmp.path(), "metronome-trainer", ON_CORE);
    let out = deps(&manifest);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn core_gaining_a_runtime_fails() {
    // A path dependency named like a runtime: `--offline --no-deps` needs nothing fetched.
    let (_tmp, manifest) =
        scratch_workspace(&[("tokio", ""), ("metronome-core", "tokio = { path = \"../tokio\" }")]);
    let stderr = deps_failure(&manifest);
    assert!(stderr.contains("metronome-core depends on tokio"), "{stderr}");
}

#[test]
fn files_that_import_each_other_fail_and_the_fix_passes() {
    let (tmp, manifest) = scratch_workspace(&[("metronome-core", "")]);
    let src = tmp.path().join("crates/metronome-core/src");
    fs::write(src.join("lib.rs"), "mod data;\nmod env;\npub use env::Trace;\n").unwrap();
    fs::write(src.join("data.rs"), "pub struct Completion(pub Option<crate::Trace>);\n").unwrap();
    fs::write(src.join("env.rs"), "use crate::data::Completion;\npub struct Trace;\n").unwrap();

    let stderr = deps_failure(&manifest);
    assert!(stderr.contains("data.rs → env.rs → data.rs"), "{stderr}");
    assert!(stderr.contains("1 loop(s) between files"), "{stderr}");

    // The record moved beside the type that holds it: env.rs imports data.rs only.
    fs::write(src.join("lib.rs"), "mod data;\nmod env;\npub use data::Trace;\n").unwrap();
    fs::write(src.join("data.rs"), "pub struct Completion(pub Option<Trace>);\npub struct Trace;\n").unwrap();
    fs::write(src.join("env.rs"), "use crate::data::Completion;\n").unwrap();
    let out = deps(&manifest);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
