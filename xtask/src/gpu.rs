//! `cargo xtask gpu`: the CUDA build without a GPU, and a bundle to run on one.
//!
//! The CPU build is the default and the one CI tests; the `cuda` feature must still
//! compile, and its tests run on a lent GPU machine that has the NVIDIA driver and
//! CUDA's libraries (in its Python packages) but no Rust toolchain and no network.
//!
//! - `check`: assembles the CUDA toolkit from PyPI wheels (`scripts/cuda-toolkit.sh`,
//!   into `target/cuda-toolkit`) and runs clippy with warnings denied on the `cuda`
//!   build of every crate that has the feature. CI runs this. Our kernels are compiled
//!   by nvcc; candle-kernels' are not (`scripts/nvcc-check.sh` says why).
//! - `bundle [PACKAGE ...]`: builds those packages' test executables (default: every
//!   crate with the feature, and the workspace tests) and the `metronome` binary with
//!   `cuda`, strips them, and packs them into `target/gpu/bundle.tar.xz` beside
//!   `target/gpu/run.sh`. Carry `target/gpu` to the GPU machine and run
//!   `bash target/gpu/run.sh [TEST FILTER]` from the repository root there: it finds
//!   the CUDA libraries, runs every executable from its package directory, and exits
//!   non-zero if any failed; `bash target/gpu/run.sh --bench` runs every GPU test and
//!   then the training throughput comparison with PyTorch (`metronome-model`'s
//!   `examples/throughput.rs`, `benches/torch_gpu.py` and `benches/gpu_report.py`,
//!   which writes `$OUT/gpu.json` with the commit recorded here in `commit.txt`).
//!
//! `check` shares the workspace's target directory (the dependencies the feature does
//! not touch are reused from the CPU clippy); `bundle` links in its own (`target/cuda`),
//! so that the CPU build's binaries stay what they are.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The crates with a `cuda` feature, leaves first.
const CUDA_CRATES: [&str; 5] =
    ["metronome-model", "metronome-rollout", "metronome-trainer", "metronome-pipeline", "metronome-cli"];

pub(crate) const USAGE: &str =
    "  gpu    the CUDA build: `cargo xtask gpu check` (clippy -D warnings of the cuda feature;
         CI runs it), `cargo xtask gpu bundle [PACKAGE ...]` (test executables and the CLI
         for a GPU machine in target/gpu; run there with `bash target/gpu/run.sh`)";

pub(crate) fn gpu(root: &Path, args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("check") => check(root),
        Some("bundle") => bundle(root, &args[1..]),
        _ => bail!("usage: cargo xtask gpu check | bundle [PACKAGE ...]"),
    }
}

/// The packages with a `cuda` feature: the crates, and the workspace tests' GPU variants.
const WITH_CUDA: [&str; 6] =
    [CUDA_CRATES[0], CUDA_CRATES[1], CUDA_CRATES[2], CUDA_CRATES[3], CUDA_CRATES[4], "metronome-tests"];

/// `--features a/cuda,b/cuda,...` for those of `packages` that have the feature (cargo
/// refuses a feature of a package it was not asked to build).
fn cuda_features<S: AsRef<str>>(packages: &[S]) -> String {
    packages
        .iter()
        .map(AsRef::as_ref)
        .filter(|p| WITH_CUDA.contains(p))
        .map(|p| format!("{p}/cuda"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The toolkit directory, assembled on first use, and the environment that points
/// cargo's build scripts (candle-kernels' nvcc, cudarc's version probe) at it.
fn toolkit(root: &Path) -> Result<Vec<(String, String)>> {
    let dir = root.join("target/cuda-toolkit");
    if !dir.join("env.sh").exists() {
        // The script builds the libcuda link stub from cudarc's sources: fetch them first.
        crate::step(root, "fetch", &["fetch"])?;
        eprintln!("==> gpu: assembling the CUDA toolkit in {}", dir.display());
        let status = Command::new("bash")
            .arg(root.join("xtask/scripts/cuda-toolkit.sh"))
            .arg(&dir)
            .status()
            .context("running xtask/scripts/cuda-toolkit.sh")?;
        if !status.success() {
            bail!("assembling the CUDA toolkit failed ({status})");
        }
    }
    let d = dir.display().to_string();
    let path = format!("{d}/bin:{}", std::env::var("PATH").unwrap_or_default());
    Ok(vec![
        ("PATH".into(), path),
        ("CUDA_HOME".into(), d.clone()),
        ("CUDA_PATH".into(), d.clone()),
        ("CUDA_ROOT".into(), d),
        ("CUDA_COMPUTE_CAP".into(), std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into())),
    ])
}

fn cargo_with(
    root: &Path,
    env: &[(String, String)],
    name: &str,
    args: &[&str],
) -> Result<std::process::Output> {
    eprintln!("==> gpu {name}: cargo {}", args.join(" "));
    let out = crate::cargo()
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("starting cargo for gpu {name}"))?;
    if !out.status.success() {
        bail!("gpu {name} failed ({})", out.status);
    }
    Ok(out)
}

pub(crate) fn check(root: &Path) -> Result<()> {
    // The workspace's own target directory: every dependency that the feature does not
    // change (most of them) is reused from the CPU build's clippy.
    let mut env = toolkit(root)?;
    // candle-kernels' sources answered with empty outputs, ours compiled for real
    // (the script says why).
    let toolkit_nvcc = root.join("target/cuda-toolkit/bin/nvcc");
    env.extend([
        ("NVCC".into(), root.join("xtask/scripts/nvcc-check.sh").display().to_string()),
        ("METRONOME_NVCC".into(), toolkit_nvcc.display().to_string()),
        ("METRONOME_ROOT".into(), root.display().to_string()),
    ]);
    let features = cuda_features(&WITH_CUDA);
    let mut args = vec!["clippy", "--all-targets", "--features", &features];
    for c in WITH_CUDA {
        args.extend(["--package", c]);
    }
    args.extend(["--", "-D", "warnings"]);
    cargo_with(root, &env, "check", &args)?;
    Ok(())
}

/// The test executables that hold GPU tests (`cuda_*`), as [`executables`] names them:
/// the bundle carries only these (each links candle and its CUDA kernels, some 50 MB).
const GPU_TESTS: [&str; 4] =
    ["metronome-model-it", "metronome-rollout-it", "metronome-trainer-it", "tests-pipeline"];

/// An executable of the bundle and the package directory it runs in.
struct Executable {
    path: PathBuf,
    package_dir: PathBuf,
    name: String,
    /// A test harness (run by `run.sh`), not the CLI or the throughput example.
    test: bool,
}

fn bundle(root: &Path, packages: &[String]) -> Result<()> {
    let mut env = toolkit(root)?;
    // Linked executables of their own, so that `target/release/metronome` stays the CPU build.
    env.push(("CARGO_TARGET_DIR".into(), root.join("target/cuda").display().to_string()));
    let mut packages: Vec<String> = packages
        .iter()
        .map(|p| if p.starts_with("metronome-") { p.clone() } else { format!("metronome-{p}") })
        .collect();
    if packages.is_empty() {
        packages = CUDA_CRATES[..4].iter().map(|c| (*c).to_owned()).collect();
        packages.push("metronome-tests".into());
    }
    let features = cuda_features(&packages);
    // The dev profile throughout: its dependencies and the model and rollout crates are
    // optimised (the workspace's `[profile.dev.package]`); a release build would compile
    // candle and its CUDA kernels as long again on 2 cores.
    let mut args =
        vec!["test", "--no-run", "--message-format=json-render-diagnostics", "--features", &features];
    for p in &packages {
        args.extend(["--package", p]);
    }
    let out = cargo_with(root, &env, "tests", &args)?;
    let mut exes: Vec<Executable> =
        executables(&out.stdout)?.into_iter().filter(|e| GPU_TESTS.contains(&e.name.as_str())).collect();
    cargo_with(
        root,
        &env,
        "cli",
        &["build", "--package", "metronome-cli", "--features", "metronome-cli/cuda"],
    )?;
    cargo_with(
        root,
        &env,
        "throughput",
        &[
            "build",
            "--package",
            "metronome-model",
            "--example",
            "throughput",
            "--features",
            "metronome-model/cuda",
        ],
    )?;
    for (path, name) in [("debug/metronome", "metronome"), ("debug/examples/throughput", "throughput")] {
        exes.push(Executable {
            path: root.join("target/cuda").join(path),
            package_dir: root.to_path_buf(),
            name: name.into(),
            test: false,
        });
    }

    let gpu = root.join("target/gpu");
    let stage = gpu.join("stage");
    if stage.exists() {
        std::fs::remove_dir_all(&stage)?;
    }
    std::fs::create_dir_all(stage.join("bin"))?;
    let mut manifest = String::new();
    for e in &exes {
        let dest = stage.join("bin").join(&e.name);
        let status = Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(&dest)
            .arg(&e.path)
            .status()
            .context("running strip (binutils)")?;
        if !status.success() {
            bail!("strip {} failed ({status})", e.path.display());
        }
        let dir = e.package_dir.strip_prefix(root).unwrap_or(Path::new("."));
        let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        if e.test {
            manifest.push_str(&format!("{}\t{}\n", e.name, dir.display()));
        }
    }
    std::fs::write(stage.join("tests.tsv"), manifest)?;
    let archive = gpu.join("bundle.tar.xz");
    // One xz stream with a dictionary larger than any executable: they share most of
    // their bytes (candle, its CUDA kernels), which then compress to almost nothing —
    // 330 MB to 18 MB, under the GPU machine's 64 MiB transfer limit (about 3 minutes).
    let status = Command::new("tar")
        .args(["-cJf"])
        .arg(&archive)
        .arg("-C")
        .arg(&stage)
        .args(["bin", "tests.tsv"])
        .env("XZ_OPT", "-T1 --lzma2=preset=6,dict=384MiB")
        .status()
        .context("running tar")?;
    if !status.success() {
        bail!("packing {} failed ({status})", archive.display());
    }
    std::fs::remove_dir_all(&stage)?;
    let script = include_str!("../scripts/gpu-run.sh").replace("@BUILD_ROOT@", &root.display().to_string());
    std::fs::write(gpu.join("run.sh"), script)?;
    // The GPU machine gets a copy of the tree without its history: the benchmark's
    // report names the commit the executables were built from by this file.
    std::fs::write(gpu.join("commit.txt"), commit(root))?;
    let size = std::fs::metadata(&archive)?.len();
    eprintln!(
        "==> gpu: {} executables in {} ({:.1} MiB); on the GPU machine, from the repository root: bash target/gpu/run.sh [FILTER]",
        exes.len(),
        archive.display(),
        size as f64 / (1 << 20) as f64
    );
    if size > 60 << 20 {
        eprintln!("warning: the bundle is over 60 MiB; the device tool carries at most 64 MiB with the tree");
    }
    Ok(())
}

/// `git rev-parse HEAD`, with `-dirty` when the tree has uncommitted changes;
/// `unknown` outside a repository.
fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "HEAD"]) {
        Some(head) if git(&["status", "--porcelain"]).is_some_and(|s| !s.is_empty()) => {
            format!("{head}-dirty")
        }
        Some(head) => head,
        None => "unknown".to_owned(),
    }
}

/// The test executables cargo reported building, named `<package>-<target>`.
fn executables(json_lines: &[u8]) -> Result<Vec<Executable>> {
    let mut out = Vec::new();
    for line in String::from_utf8_lossy(json_lines).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if v["reason"] != "compiler-artifact" || v["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = v["executable"].as_str() else { continue };
        let manifest = v["manifest_path"].as_str().context("cargo artifact without manifest_path")?;
        let package = v["package_id"].as_str().unwrap_or_default();
        let target = v["target"]["name"].as_str().unwrap_or("unknown");
        let kind = v["target"]["kind"][0].as_str().unwrap_or("test");
        let package_dir = Path::new(manifest).parent().context("manifest without a directory")?.to_path_buf();
        let package_name = package_dir.file_name().and_then(|n| n.to_str()).unwrap_or(package);
        let name =
            if kind == "lib" { format!("{package_name}-lib") } else { format!("{package_name}-{target}") };
        out.push(Executable { path: PathBuf::from(exe), package_dir, name, test: true });
    }
    if out.is_empty() {
        bail!("cargo built no test executables");
    }
    Ok(out)
}
