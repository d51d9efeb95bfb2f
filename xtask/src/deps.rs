//! `cargo xtask deps`: the dependency invariants of ARCHITECTURE.md, checked from
//! `cargo metadata`.
//!
//! Only normal and build dependencies are checked. Dev-dependencies may cross stage
//! lines (a trainer test may use the masking crate to build its inputs), because they
//! never reach a user's build.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Stage crates: each may depend on `metronome-core` (and `metronome-model` where it
/// runs the network) but never on another stage.
pub(crate) const STAGES: &[&str] = &[
    "metronome-dataloader",
    "metronome-rollout",
    "metronome-reward",
    "metronome-trainer",
    "metronome-transport",
    "metronome-masking",
];

/// Stages that run the network and so may use `metronome-model`.
pub(crate) const MODEL_USERS: &[&str] = &["metronome-rollout", "metronome-trainer"];

/// The only crates `metronome-core` may depend on: no tensors, no runtime, no I/O.
/// Widening this list is a design decision; say why in ARCHITECTURE.md.
pub(crate) const CORE_ALLOWED: &[&str] = &["async-trait", "serde", "thiserror"];

/// The test kit: a dev-dependency only, and built on `metronome-core` alone so that
/// third-party stages can run its suites.
pub(crate) const TESTKIT: &str = "metronome-testkit";

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    /// The package whose manifest is at fault.
    pub(crate) package: String,
    /// The dependency it must not have.
    pub(crate) dependency: String,
    /// The invariant it breaks.
    pub(crate) rule: &'static str,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} depends on {}: {}", self.package, self.dependency, self.rule)
    }
}

/// Runs `cargo metadata` for the workspace whose manifest is `manifest` and returns
/// every violation.
pub(crate) fn check_workspace(manifest: &Path) -> Result<Vec<Violation>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline", "--manifest-path"])
        .arg(manifest)
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed for {}: {}", manifest.display(), String::from_utf8_lossy(&out.stderr));
    }
    let meta: Value = serde_json::from_slice(&out.stdout).context("parsing cargo metadata output")?;
    Ok(check_metadata(&meta))
}

/// The violations in parsed `cargo metadata --no-deps` output.
#[must_use]
pub(crate) fn check_metadata(meta: &Value) -> Vec<Violation> {
    let mut found = Vec::new();
    let packages = meta["packages"].as_array().map(Vec::as_slice).unwrap_or_default();
    for package in packages {
        let name = package["name"].as_str().unwrap_or_default();
        let deps = package["dependencies"].as_array().map(Vec::as_slice).unwrap_or_default();
        for dep in deps {
            // `kind` is null for normal dependencies, "build" or "dev" otherwise.
            if dep["kind"].as_str() == Some("dev") {
                continue;
            }
            let dep_name = dep["name"].as_str().unwrap_or_default();
            if let Some(rule) = broken_rule(name, dep_name) {
                found.push(Violation { package: name.into(), dependency: dep_name.into(), rule });
            }
        }
    }
    found
}

fn broken_rule(package: &str, dep: &str) -> Option<&'static str> {
    if dep == TESTKIT {
        return Some("metronome-testkit is for tests: depend on it as a dev-dependency only");
    }
    if package == TESTKIT && dep.starts_with("metronome-") && dep != "metronome-core" {
        return Some(
            "metronome-testkit depends on metronome-core alone, so a third-party stage can \
             run its suites without Metronome's other crates",
        );
    }
    if package == "metronome-core" && !CORE_ALLOWED.contains(&dep) {
        return Some(
            "metronome-core is the contract and holds no tensors, runtime or I/O; \
             it may depend only on async-trait, serde and thiserror",
        );
    }
    if STAGES.contains(&package) {
        if STAGES.contains(&dep) {
            return Some("stage crates never depend on each other; only metronome-pipeline wires stages");
        }
        if dep == "metronome-model" && !MODEL_USERS.contains(&package) {
            return Some("only stages that run the network (rollout, trainer) may use metronome-model");
        }
        if dep == "metronome-pipeline" || dep == "metronome-cli" {
            return Some("stage crates never depend on the pipeline or the binary");
        }
    }
    if package == "metronome-model" && dep.starts_with("metronome-") && dep != "metronome-core" {
        return Some("metronome-model depends on no stage; it is shared by rollout and trainer");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dependency: its name and its `kind` (`None` for normal).
    type Dep<'a> = (&'a str, Option<&'a str>);

    fn meta(packages: &[(&str, &[Dep<'_>])]) -> Value {
        let packages: Vec<Value> = packages
            .iter()
            .map(|(name, deps)| {
                let deps: Vec<Value> =
                    deps.iter().map(|(d, kind)| serde_json::json!({ "name": d, "kind": kind })).collect();
                serde_json::json!({ "name": name, "dependencies": deps })
            })
            .collect();
        serde_json::json!({ "packages": packages })
    }

    #[test]
    fn rules_table() {
        let m = meta(&[
            ("metronome-core", &[("serde", None), ("tokio", None), ("proptest", Some("dev"))]),
            (
                "metronome-trainer",
                &[("metronome-core", None), ("metronome-model", None), ("metronome-masking", None)],
            ),
            ("metronome-reward", &[("metronome-model", None), ("metronome-masking", Some("dev"))]),
            ("metronome-model", &[("metronome-core", None), ("candle-core", None)]),
            ("metronome-pipeline", &[("metronome-trainer", None), ("metronome-rollout", None)]),
            ("metronome-transport", &[("metronome-testkit", Some("dev"))]),
            ("metronome-rollout", &[("metronome-testkit", None)]),
            ("metronome-testkit", &[("metronome-core", None), ("metronome-transport", None)]),
        ]);
        let got: Vec<(String, String)> =
            check_metadata(&m).into_iter().map(|v| (v.package, v.dependency)).collect();
        assert_eq!(
            got,
            vec![
                ("metronome-core".into(), "tokio".into()),
                ("metronome-trainer".into(), "metronome-masking".into()),
                ("metronome-reward".into(), "metronome-model".into()),
                ("metronome-rollout".into(), "metronome-testkit".into()),
                ("metronome-testkit".into(), "metronome-transport".into()),
            ]
        );
    }
}
