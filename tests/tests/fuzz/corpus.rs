//! Every input that ever broke a target, kept as a file under `corpus/<target>/` and
//! replayed through the same checks as the target's generated inputs. A file's name
//! says what it is (see `corpus/README.md`); a new crash goes here as the input the
//! target printed, written out, beside the fix.

use std::path::{Path, PathBuf};

use axum::http::{Method, StatusCode};
use metronome_dataloader::{CodeFileConfig, CodeFormat};
use metronome_pipeline::PipelineConfig;
use proptest::test_runner::TestCaseError;

use crate::dataset::Open;
use crate::transport::Kind;

fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus").join(target);
    // A target that never broke has no folder.
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.map(|entry| entry.unwrap().path()).collect();
    files.sort();
    files
}

fn name(path: &Path) -> &str {
    path.file_name().and_then(|n| n.to_str()).unwrap_or_default()
}

/// Replays one input; a failure says which file.
fn replay(path: &Path) -> Result<(), TestCaseError> {
    let target = path.parent().and_then(|p| p.file_name()).and_then(|n| n.to_str()).unwrap_or_default();
    let file = name(path);
    let read = || std::fs::read(path).map_err(|e| TestCaseError::fail(e.to_string()));
    match target {
        "config" if file.ends_with(".set") => {
            let text = String::from_utf8(read()?).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let sets: Vec<String> = text.lines().map(str::to_owned).collect();
            crate::config::check_outcome(PipelineConfig::embedded(&sets), &sets)
        }
        "config" => {
            let text = String::from_utf8_lossy(&read()?).into_owned();
            crate::config::check_outcome(PipelineConfig::parse(&text, "fuzz.toml", &[]), &[])
        }
        "http" => {
            let route = match file.split('-').next() {
                Some("completions") => "/v1/completions",
                Some("load_weights") => "/metronome/v1/load_weights",
                _ => "/v1/models",
            };
            let body = read()?;
            let (status, answer) = crate::http::send(
                Method::POST,
                route,
                Some("application/json"),
                Some("fuzz-key"),
                body.clone(),
            );
            crate::http::check_answer(route, &body, status, &answer)?;
            // Whatever it was, the server still serves.
            let (status, _) =
                crate::http::send(Method::GET, "/v1/models", None, Some("fuzz-key"), Vec::new());
            if status == StatusCode::OK { Ok(()) } else { Err(TestCaseError::fail(format!("then {status}"))) }
        }
        "weights" => crate::weights::check_file(&read()?, 1, true),
        "transport" => {
            let bytes = read()?;
            match file.split('-').next() {
                Some("group") => crate::transport::check_message(Kind::Group, &bytes),
                Some("weights") => {
                    crate::transport::check_message(Kind::Weights, &bytes)?;
                    crate::transport::check_message(Kind::StreamedWeights(7), &bytes)
                }
                Some("control") => crate::transport::check_message(Kind::Control(0), &bytes),
                _ => crate::transport::check_claim(&bytes),
            }
        }
        "dataset" => {
            let bytes = read()?;
            let code = |format| {
                let config = CodeFileConfig {
                    path: "unused".into(),
                    template: None,
                    on_bad_record: Default::default(),
                };
                Open::Code(format, config)
            };
            match (file.split('-').next(), file.rsplit('.').next()) {
                (Some("humaneval"), _) => crate::dataset::check_file(&bytes, code(CodeFormat::Humaneval)),
                (Some("mbpp"), _) => crate::dataset::check_file(&bytes, code(CodeFormat::Mbpp)),
                (_, Some("parquet")) => {
                    crate::dataset::check_file(&bytes, Open::Parquet(false))?;
                    crate::dataset::check_file(&bytes, Open::Parquet(true))
                }
                _ => {
                    crate::dataset::check_file(&bytes, Open::Fields(false))?;
                    crate::dataset::check_file(&bytes, Open::Fields(true))
                }
            }
        }
        "checkpoint" => {
            // A folder `<kl|mini>-<what>` holding the one file that replaces the good
            // checkpoint's, at its path.
            let mini_steps = file.starts_with("mini-");
            let mut replaced = Vec::new();
            collect(path, path, &mut replaced);
            for (relative, bytes) in replaced {
                crate::checkpoint::check_file(mini_steps, &relative, &bytes)?;
            }
            Ok(())
        }
        other => Err(TestCaseError::fail(format!("no target `{other}`"))),
    }
}

/// Every file under `dir`, by its path relative to `root`.
fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(root, &path, out);
        } else {
            let relative = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            out.push((relative, std::fs::read(&path).unwrap()));
        }
    }
}

#[test]
fn every_crash_ever_found_stays_fixed() {
    let targets = ["config", "http", "weights", "transport", "dataset", "checkpoint"];
    let mut failures = Vec::new();
    let mut replayed = 0;
    for target in targets {
        for path in corpus(target) {
            if name(&path) == "README.md" {
                continue;
            }
            replayed += 1;
            if let Err(e) = replay(&path) {
                failures.push(format!("{}: {e}", path.display()));
            }
        }
    }
    eprintln!("fuzz corpus: {replayed} inputs replayed");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
