//! Checkpoint files: a trainer checkpoint written mid-period (`GrpoTrainer::resume`
//! reads its state, optimiser, accumulator, and the policy and reference models as
//! Hugging Face folders through `Model::load_hf`), with one of its files changed.
//! Two checkpoints: with a KL term (a reference model), and with mini-steps (the
//! accumulator holds the period's batches).
//!
//! Asserts: no panic, neither resuming nor in the step after; a refusal names the
//! file (or the tensor) at fault; a trainer that resumes steps.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use metronome_core::{PolicyVersion, TrainBatch};
use metronome_model::Device;
use metronome_testkit::BatchBuilder;
use metronome_trainer::{GrpoTrainer, TrainerConfig};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use crate::mutate::{ByteOp, Mutations, apply_bytes, byte_op, mutate_json, mutations};

/// The files a resume reads.
const FILES: &[&str] = &[
    "trainer_state.json",
    "accumulator.json",
    "policy/config.json",
    "optimizer.safetensors",
    "accumulator.safetensors",
    "policy/model.safetensors",
    "reference/model.safetensors",
];

#[derive(Clone, Debug)]
pub(crate) enum Change {
    /// A JSON file's tree, or a safetensors file's header.
    Tree(Mutations),
    Bytes(Vec<ByteOp>),
}

#[derive(Clone, Debug)]
pub(crate) struct Input {
    /// The mini-step checkpoint rather than the KL one.
    mini_steps: bool,
    file: &'static str,
    change: Change,
}

fn input() -> impl Strategy<Value = Input> {
    let change = prop_oneof![
        3 => mutations().prop_map(Change::Tree),
        1 => proptest::collection::vec(byte_op(), 1..4).prop_map(Change::Bytes),
    ];
    (any::<bool>(), select(FILES), change).prop_map(|(mini_steps, file, change)| Input {
        mini_steps,
        file,
        change,
    })
}

fn config(mini_steps: bool) -> TrainerConfig {
    let mut cfg = TrainerConfig::default();
    cfg.schedule.lr = 1e-3;
    if mini_steps {
        cfg.mini_steps = 2;
    } else {
        cfg.loss.kl_coef = 0.05;
    }
    cfg
}

/// Group `g` of a period, sampled by `version`.
fn batch(g: u32, version: PolicyVersion) -> TrainBatch {
    let prompt: Vec<u32> = (0..4 + g).map(|i| 3 + (i * 7 + g * 11) % 90).collect();
    let responses: Vec<Vec<u32>> = (0..3u32)
        .map(|r| (0..2 + (r + g) % 3).map(|j| 3 + (j * 13 + r * 5 + g * 17) % 90).collect())
        .collect();
    BatchBuilder::new()
        .version(version)
        .behaviour_logprob(-(99f32.ln()))
        .shared_prompt(u64::from(g), &prompt, &responses, &[1.0, -1.0, 0.5])
        .build()
}

/// The two good checkpoints, written once: a step, then two groups of the next period.
pub(crate) fn good(mini_steps: bool) -> &'static Path {
    static DIRS: OnceLock<[PathBuf; 2]> = OnceLock::new();
    let dirs = DIRS.get_or_init(|| {
        let root = crate::scratch("checkpoint");
        [false, true].map(|mini| {
            let mut t = config(mini).build(crate::model(5)).unwrap();
            for g in 0..3 {
                t.accumulate_sync(&batch(g, PolicyVersion(0))).unwrap();
            }
            t.step_sync().unwrap();
            for g in 3..5 {
                t.accumulate_sync(&batch(g, t.version())).unwrap();
            }
            let dir = root.join(if mini { "mini" } else { "kl" });
            t.save_checkpoint(&dir).unwrap();
            dir
        })
    });
    &dirs[usize::from(mini_steps)]
}

/// A copy of `from` at `to`.
fn copy(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

thread_local! {
    /// Each test thread's copies of the two checkpoints, changed one file at a time
    /// and put back after each input (a fresh copy per input costs more than the
    /// resume it is for).
    static WORK: [tempfile::TempDir; 2] = [false, true].map(|mini| {
        let dir = tempfile::tempdir().expect("a temporary folder");
        copy(good(mini), dir.path()).expect("a copy of the checkpoint");
        dir
    });
}

/// The changed file's bytes.
pub(crate) fn changed(good: &[u8], file: &str, change: &Change) -> Vec<u8> {
    match change {
        Change::Bytes(ops) => {
            let mut bytes = good.to_vec();
            apply_bytes(&mut bytes, ops);
            bytes
        }
        Change::Tree(m) if file.ends_with(".json") => {
            let tree: serde_json::Value = serde_json::from_slice(good).expect("a checkpoint's JSON");
            mutate_json(&tree, m, true)
        }
        Change::Tree(m) => {
            // A safetensors file: its JSON header, the data after it kept.
            let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
            let header: serde_json::Value = serde_json::from_slice(&good[8..8 + n]).unwrap();
            let new = mutate_json(&header, m, false);
            let mut out = (new.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&new);
            out.extend_from_slice(&good[8 + n..]);
            out
        }
    }
}

pub(crate) fn check_file(mini_steps: bool, file: &str, bytes: &[u8]) -> Result<(), TestCaseError> {
    WORK.with(|dirs| {
        let dir = dirs[usize::from(mini_steps)].path();
        let io = |e: std::io::Error| TestCaseError::fail(format!("{file}: {e}"));
        std::fs::write(dir.join(file), bytes).map_err(io)?;
        let outcome = check_resume(mini_steps, dir, file);
        std::fs::copy(good(mini_steps).join(file), dir.join(file)).map_err(io)?;
        outcome
    })
}

fn check_resume(mini_steps: bool, dir: &Path, file: &str) -> Result<(), TestCaseError> {
    let resumed = config(mini_steps).resume(dir, &Device::Cpu);
    match resumed {
        Ok(trainer) => steps(trainer),
        Err(e) => {
            let chain = crate::chain(&e);
            let name = Path::new(file).file_name().and_then(|n| n.to_str()).unwrap_or(file);
            crate::names_place(&chain, &[name, "tensor `"])
        }
    }
}

/// A resumed trainer finishes its period: the last group, then the step.
fn steps(mut t: GrpoTrainer) -> Result<(), TestCaseError> {
    let version = t.version();
    let last = t.accumulate_sync(&batch(5, version)).and_then(|_| t.step_sync());
    if let Err(e) = last {
        return Err(TestCaseError::fail(format!("resumed, then failed its step: {}", crate::chain(&e))));
    }
    prop_assert_eq!(t.version().0, version.0.wrapping_add(1), "a step that does not advance the version");
    Ok(())
}

pub(crate) fn check(input: &Input) -> Result<(), TestCaseError> {
    // Only the KL checkpoint has a reference model.
    let mini_steps = input.mini_steps && !input.file.starts_with("reference/");
    let good = std::fs::read(good(mini_steps).join(input.file)).expect("the good checkpoint");
    check_file(mini_steps, input.file, &changed(&good, input.file, &input.change))
}

#[test]
fn trainer_checkpoints_and_model_folders() {
    crate::fuzz("checkpoint", 6_000, file!(), input(), |input| check(&input));
}
