//! `cargo xtask`: Metronome's project automation, one small binary.
//!
//! - `cargo xtask ci`: everything CI checks, cheapest first: formatting, dependency
//!   invariants, unused dependencies (`cargo machete`), clippy with warnings denied
//!   (also of the `cuda` build, with a CUDA toolkit assembled from PyPI), `cargo
//!   deny`, then the test suite.
//! - `cargo xtask deps`: the dependency invariants of ARCHITECTURE.md.
//! - `cargo xtask soak`: the fault-injection tests at length.
//! - `cargo xtask fuzz`: the fuzz suite at length (`cargo test` runs a slice).
//! - `cargo xtask agents`: the agent backend's learning test (too long for CI).
//! - `cargo xtask gpu check | bundle`: the CUDA build without a GPU (see `gpu.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

mod deps;
mod gpu;
mod modules;

const USAGE: &str = "usage: cargo xtask <task>

tasks:
  ci     formatting, dependency invariants, unused dependencies (cargo machete), clippy
         (-D warnings; also of the cuda build, unless METRONOME_SKIP_CUDA_CHECK is set),
         cargo deny, tests
  e2e    build in release and run the embedded default end to end; extra arguments go to
         `metronome run` (e.g. --schedule sync|periodic|stale:2 --workers N --periods N)
  bench  criterion benchmarks: `cargo xtask bench [CRATE ...]` (all when none given),
         e.g. `cargo xtask bench pipeline model`
  deps   check the dependency invariants of ARCHITECTURE.md
         (--manifest-path PATH checks another workspace)
  soak   the fault-injection tests at length: SIGKILLs of `metronome run`, the cluster
         trainer and a worker at --kills N seeded points each (default 10; `ci` runs
         3), then the nats-server restart test --restarts N times in a row (default 10)
  fuzz   the fuzz suite (tests/tests/fuzz) at length: --cases N inputs per target
         (default 100000; `cargo test` runs a few thousand), then the crash corpus
  agents the agent backend's learning test: the example agent (official `openai`
         client, examples/agents/) trained beside the native calculator environment
         for --periods N (default 30); fails unless its held-out success rises by
         --min-gain POINTS (default 10). About 30 minutes on 2 cores; needs python3
         with `openai` (`cargo test` runs one short period of it)
";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    match args.first().map(String::as_str) {
        Some("ci") => ci(&root),
        Some("deps") => match args.get(1..).unwrap_or_default() {
            [] => check_deps(&root.join("Cargo.toml")),
            [flag, path] if flag == "--manifest-path" => check_deps(Path::new(path)),
            _ => bail!("usage: cargo xtask deps [--manifest-path PATH]"),
        },
        Some("e2e") => e2e(&root, &args[1..]),
        Some("soak") => soak(&root, &args[1..]),
        Some("fuzz") => fuzz(&root, &args[1..]),
        Some("agents") => agents(&root, &args[1..]),
        Some("bench") => bench(&root, &args[1..]),
        Some("gpu") => gpu::gpu(&root, &args[1..]),
        Some("-h" | "--help" | "help") | None => {
            println!("{USAGE}{}", gpu::USAGE);
            Ok(())
        }
        Some(other) => bail!("unknown task `{other}`\n\n{USAGE}{}", gpu::USAGE),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the root")
        .to_path_buf()
}

/// The dependency invariants between crates, and no loops between a crate's files.
fn check_deps(manifest: &Path) -> Result<()> {
    let violations = deps::check_workspace(manifest)?;
    let root = manifest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let loops = modules::check_workspace(root)?;
    if violations.is_empty() && loops.is_empty() {
        println!("deps: every dependency invariant holds, and no crate's files import each other in a loop");
        return Ok(());
    }
    for v in &violations {
        eprintln!("deps: {v}");
    }
    for l in &loops {
        eprintln!("deps: files that import each other in a loop: {l}");
    }
    bail!(
        "{} dependency invariant(s) broken and {} loop(s) between files (see ARCHITECTURE.md)",
        violations.len(),
        loops.len()
    )
}

fn ci(root: &Path) -> Result<()> {
    step(root, "fmt", &["fmt", "--all", "--", "--check"])?;
    check_deps(&root.join("Cargo.toml"))?;
    // Declared-but-unused dependencies. `--with-metadata` because every member
    // inherits its dependencies from the workspace, which the plain scan skips.
    require_tool("machete", "cargo-machete")?;
    step(root, "machete", &["machete", "--with-metadata", "--skip-target-dir"])?;
    step(root, "clippy", &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    // The binary without its optional backends (`nats`, `http`), as a user who needs
    // only the in-process pipeline builds it: the gates must keep compiling. Cheap:
    // it reuses the checked dependencies above.
    step(
        root,
        "clippy (no nats, no http)",
        &["clippy", "-p", "metronome-cli", "--no-default-features", "--", "-D", "warnings"],
    )?;
    // The `cuda` feature compiles on a machine without a GPU; its tests run on one
    // (`cargo xtask gpu bundle`).
    if std::env::var_os("METRONOME_SKIP_CUDA_CHECK").is_some() {
        eprintln!("==> gpu check: skipped (METRONOME_SKIP_CUDA_CHECK is set)");
    } else {
        gpu::check(root)?;
    }
    require_tool("deny", "cargo-deny")?;
    step(root, "deny", &["deny", "check", "bans", "licenses", "sources"])?;
    step(root, "test", &["test", "--workspace", "--all-targets"])?;
    // The fused CPU kernels again at AVX2 (on an AVX-512 machine the run above took
    // AVX-512): their equivalence with the portable ops and their batch invariance hold
    // on both paths. The kernel tests by name, a few seconds. `--workspace`, not `-p
    // metronome-model`: one package alone resolves its dependencies' features anew,
    // and rebuilding them took 6m21s of a fresh 49.6-minute CI run here; the workspace's
    // `--lib --test it` executables are the ones the step above built.
    step_with(
        root,
        "test (fused kernels at AVX2)",
        &["test", "--workspace", "--lib", "--test", "it", "--", "decode", "portable", "fused", "simd"],
        &[("METRONOME_SIMD", "avx2")],
    )?;
    // Doc tests are a separate harness; examples in docs must keep compiling.
    step(root, "doctest", &["test", "--workspace", "--doc"])
}

/// Fails, saying how to install it and what the check printed, unless
/// `cargo <subcommand> --version` (from `package`) succeeds.
fn require_tool(subcommand: &str, package: &str) -> Result<()> {
    let output = cargo().args([subcommand, "--version"]).output();
    let why = match output {
        Ok(o) if o.status.success() => return Ok(()),
        Ok(o) => format!("{}; it printed {:?}", o.status, String::from_utf8_lossy(&o.stderr).trim()),
        Err(e) => e.to_string(),
    };
    bail!(
        "`cargo {subcommand} --version` failed ({why}): is {package} installed? \
         Run `cargo install {package} --locked` (.ci/run does this)"
    )
}

/// Test binaries already run their tests on parallel threads; one rayon and candle
/// thread per test keeps them from oversubscribing a 2-core machine (docs/design.md §6).
/// A caller's explicit setting wins.
fn test_thread_env() -> Vec<(&'static str, String)> {
    ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"]
        .into_iter()
        .map(|var| (var, std::env::var(var).unwrap_or_else(|_| "1".into())))
        .collect()
}

fn e2e(root: &Path, args: &[String]) -> Result<()> {
    step(root, "build", &["build", "--release", "--package", "metronome-cli"])?;
    let exe = root.join("target/release/metronome");
    eprintln!("==> e2e: metronome run {}", args.join(" "));
    // The binary sets its own thread environment (candle's pools, docs/design.md §6) when
    // the caller has not, so nothing is set here.
    let status = Command::new(&exe)
        .arg("run")
        .args(args)
        .current_dir(root)
        .status()
        .with_context(|| format!("starting {}", exe.display()))?;
    if !status.success() {
        bail!("e2e failed ({status})");
    }
    Ok(())
}

/// The fault-injection tests of `crates/metronome-cli/tests/it` at length.
fn soak(root: &Path, args: &[String]) -> Result<()> {
    let (mut kills, mut restarts) = (10u64, 10u64);
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().and_then(|v| v.parse().ok());
        match (flag.as_str(), value) {
            ("--kills", Some(n)) => kills = n,
            ("--restarts", Some(n)) => restarts = n,
            _ => bail!("usage: cargo xtask soak [--kills N] [--restarts N]"),
        }
    }
    let kill_tests = ["resume::a_run_killed_anywhere", "cluster::a_trainer_and_a_worker_killed"];
    let mut test = cargo();
    test.args(["test", "--package", "metronome-cli", "--test", "it", "--"])
        .args(kill_tests)
        .args(["--test-threads", "1", "--nocapture"])
        .env("METRONOME_SOAK_KILLS", kills.to_string())
        .envs(test_thread_env())
        .current_dir(root);
    eprintln!("==> soak: {kills} kills per process kind");
    if !test.status().context("starting cargo test")?.success() {
        bail!("soak: a kill test failed");
    }
    let restart = "cluster::a_server_restart_mid_run_loses_nothing_and_the_weights_match_one_process";
    for round in 1..=restarts {
        eprintln!("==> soak: nats-server restart, round {round} of {restarts}");
        step(
            root,
            "restart",
            &["test", "--package", "metronome-cli", "--test", "it", "--", "--exact", restart],
        )?;
    }
    eprintln!("soak: survived {kills} kills of each process kind and {restarts} server restarts");
    Ok(())
}

/// The fuzz suite with `--cases N` inputs per target, through the variable its
/// targets read; each target prints how many inputs it ran and how long they took.
fn fuzz(root: &Path, args: &[String]) -> Result<()> {
    let cases: u64 = match args {
        [] => 100_000,
        [flag, n] if flag == "--cases" => n.parse().context("--cases takes a number")?,
        _ => bail!("usage: cargo xtask fuzz [--cases N]"),
    };
    eprintln!("==> fuzz: {cases} inputs per target");
    let status = cargo()
        .args(["test", "--package", "metronome-tests", "--test", "fuzz", "--", "--nocapture"])
        .env("METRONOME_FUZZ_CASES", cases.to_string())
        .envs(test_thread_env())
        .current_dir(root)
        .status()
        .context("starting cargo test")?;
    if !status.success() {
        bail!(
            "fuzz: a target failed; its input is printed above and kept in tests/tests/proptest-regressions/"
        );
    }
    Ok(())
}

/// The agent backend's learning test: `calculator_tools --agent` in release, which
/// trains the example agent beside the native calculator environment from one warm
/// start and fails unless the agent's held-out success rose by `--min-gain` points.
fn agents(root: &Path, args: &[String]) -> Result<()> {
    let (mut periods, mut min_gain) = ("30".to_owned(), "10".to_owned());
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        match (flag.as_str(), rest.next()) {
            ("--periods", Some(n)) if n.parse::<u64>().is_ok_and(|n| n > 0) => periods = n.clone(),
            ("--min-gain", Some(p)) if p.parse::<f64>().is_ok_and(f64::is_finite) => min_gain = p.clone(),
            _ => bail!("usage: cargo xtask agents [--periods N] [--min-gain POINTS]"),
        }
    }
    let openai = Command::new("python3").args(["-c", "import openai"]).output();
    if !openai.is_ok_and(|o| o.status.success()) {
        bail!("agents: needs python3 with the `openai` package (`pip install openai`)");
    }
    eprintln!("==> agents: {periods} periods, at least {min_gain} points of held-out success");
    let status = cargo()
        .args(["run", "--release", "--package", "metronome-pipeline", "--example", "calculator_tools", "--"])
        .args(["--agent", "--periods", &periods, "--min-gain", &min_gain])
        .current_dir(root)
        .status()
        .context("starting cargo run")?;
    if !status.success() {
        bail!("agents: the example agent did not learn enough, or its run failed ({status})");
    }
    Ok(())
}

fn bench(root: &Path, crates: &[String]) -> Result<()> {
    let mut args = vec!["bench".to_owned()];
    if crates.is_empty() {
        args.push("--workspace".into());
    }
    for c in crates {
        args.push("--package".into());
        args.push(if c.starts_with("metronome-") { c.clone() } else { format!("metronome-{c}") });
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    step(root, "bench", &args)
}

/// The cargo that runs xtask, without the package variables `cargo run` set for xtask
/// itself. Children must not inherit them: cargo subcommands read them to tell
/// `cargo <tool>` from `cargo run` (cargo-machete takes its own name for a path when
/// `CARGO_PKG_NAME` is set), and builds would see xtask's manifest.
pub(crate) fn cargo() -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    for (key, _) in std::env::vars_os() {
        let key_str = key.to_string_lossy();
        let from_cargo_run = key_str.starts_with("CARGO_PKG_")
            || matches!(
                &*key_str,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
            );
        if from_cargo_run {
            command.env_remove(&key);
        }
    }
    command
}

pub(crate) fn step(root: &Path, name: &str, args: &[&str]) -> Result<()> {
    step_with(root, name, args, &[])
}

/// [`step`] with extra environment variables.
fn step_with(root: &Path, name: &str, args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    eprintln!("==> {name}: {}cargo {}", shown.concat(), args.join(" "));
    let status = cargo()
        .args(args)
        .envs(test_thread_env())
        .envs(env.iter().copied())
        .current_dir(root)
        .status()
        .with_context(|| format!("starting cargo for {name}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}
