//! The fuzz suite: every door through which outside bytes enter Metronome, fed
//! valid inputs that are then mutated (bytes flipped, cut and spliced; values
//! replaced by extremes: 0, -1, 1e30, 2^64, NaN, huge counts, deep nesting,
//! duplicate keys), since random bytes rarely get past a reader's first check.
//!
//! | target | the door |
//! |---|---|
//! | `config` | config documents, layers over the embedded default, `--set` values (`PipelineConfig`) |
//! | `http` | request bodies, methods, routes and content types of every endpoint of the OpenAI-compatible server, in-process through its `Router` |
//! | `weights` | weight files for `load_weights`: `snapshot_from_safetensors`, then an engine install |
//! | `transport` | group, weights, control and claim messages (`metronome_transport::wire`, `claims`) |
//! | `dataset` | dataset rows: JSONL, HumanEval/MBPP and Parquet files through `FileDataset` |
//! | `checkpoint` | trainer checkpoints (`GrpoTrainer::resume`) and Hugging Face model folders (`Model::load_hf`) |
//!
//! Each target asserts that nothing panics, that no allocation takes the process
//! past [`ALLOCATION_CAP`] (the global allocator below refuses it, which aborts the
//! binary), and that every error names its place: the key, the field or `param`,
//! the file or the tensor. `corpus.rs` replays every input that ever broke a
//! target (`corpus/<target>/`), and proptest keeps the seeds of its failures in
//! `tests/tests/proptest-regressions/`.
//!
//! `cargo test` runs a short slice of each target (what CI runs), the same inputs
//! every time; `cargo xtask fuzz [--cases N]` runs N inputs per target (100,000 by
//! default, through `METRONOME_FUZZ_CASES`) from a fresh seed (`METRONOME_FUZZ_SEED`
//! fixes it). `METRONOME_FUZZ_TRACE=1` prints every input before it runs, for one
//! that aborts the binary.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, FileFailurePersistence, RngSeed, TestCaseError, TestRunner};

mod checkpoint;
mod config;
mod corpus;
mod dataset;
mod http;
mod mutate;
mod transport;
mod weights;

/// The most memory the whole test binary may hold at once: a reader that trusts a
/// length or a count from its input and allocates for it fails here, as the process
/// would fail on a machine without the memory, instead of passing on a large one.
/// An allocation past it is refused: an infallible one aborts the binary (`memory
/// allocation of N bytes failed`), a fallible one (`try_reserve`, `read_to_end`)
/// becomes an error, which [`CASE_CAP`] catches.
pub(crate) const ALLOCATION_CAP: usize = 1 << 30;

/// The most memory one input may take the binary to: a case that raises the
/// binary's peak past it fails, whether its allocations succeeded or were refused
/// into an error. Every input here is at most a few megabytes.
pub(crate) const CASE_CAP: usize = 256 << 20;

#[global_allocator]
static ALLOCATOR: cap::Cap<std::alloc::System> = cap::Cap::new(std::alloc::System, ALLOCATION_CAP);

/// Inputs per target: `METRONOME_FUZZ_CASES` (what `cargo xtask fuzz` sets), else
/// `ci`, the slice every `cargo test` runs.
pub(crate) fn cases(ci: u32) -> u32 {
    std::env::var("METRONOME_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(ci)
}

/// Where a target's inputs start: `METRONOME_FUZZ_SEED`, else a fresh random seed in
/// a long run (each explores anew), else one fixed per target, so that `cargo test`
/// tries the same inputs every time and fails only on a change of the code.
fn seed(target: &str) -> RngSeed {
    if let Some(seed) = std::env::var("METRONOME_FUZZ_SEED").ok().and_then(|v| v.parse().ok()) {
        return RngSeed::Fixed(seed);
    }
    if std::env::var_os("METRONOME_FUZZ_CASES").is_some() {
        return RngSeed::Random;
    }
    RngSeed::Fixed(
        target.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)),
    )
}

/// Runs `check` on `cases(ci)` inputs drawn from `strategy` (after the seeds of
/// earlier failures kept in `proptest-regressions/`), and reports how many ran, how
/// long they took and the binary's peak memory. A case fails by returning an error
/// or by panicking; proptest then shrinks it and keeps its seed.
pub(crate) fn fuzz<S>(
    target: &str,
    ci: u32,
    source_file: &'static str,
    strategy: S,
    check: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    let config = Config {
        cases: cases(ci),
        source_file: Some(source_file),
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel("proptest-regressions"))),
        rng_seed: seed(target),
        ..Config::default()
    };
    // One target at a time: the memory check reads the binary's peak, which another
    // target's input would raise as well. The targets use the other core anyway
    // (the engine's workers, the trainer's pool, the parquet reader).
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // Should the binary abort, the last target started is the one.
    eprintln!("fuzz {target}: starting");
    let ran = AtomicU64::new(0);
    let start = Instant::now();
    let result = TestRunner::new(config.clone()).run(&strategy, |input| {
        ran.fetch_add(1, Ordering::Relaxed);
        // An input that aborts the binary (an allocation past the cap) cannot be
        // shrunk or kept by proptest: this prints each input before it runs.
        if std::env::var_os("METRONOME_FUZZ_TRACE").is_some() {
            eprintln!("fuzz {target} input: {input:?}");
        }
        let before = ALLOCATOR.max_allocated();
        let outcome = check(input);
        let after = ALLOCATOR.max_allocated();
        if after > before && after > CASE_CAP {
            return Err(TestCaseError::fail(format!(
                "the input took the binary's memory to {} MiB (at most {} MiB per input)",
                after >> 20,
                CASE_CAP >> 20
            )));
        }
        outcome
    });
    eprintln!(
        "fuzz {target}: {} inputs in {:.1} s ({} planned), peak memory of the binary {} MiB",
        ran.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64(),
        config.cases,
        ALLOCATOR.max_allocated() >> 20
    );
    if let Err(e) = result {
        panic!("fuzz {target}: {e}");
    }
}

/// Fails the case unless `chain` (an error and its sources on one line) is
/// non-empty and contains one of `places`: what names where the input is wrong.
pub(crate) fn names_place(chain: &str, places: &[&str]) -> Result<(), TestCaseError> {
    if chain.trim().is_empty() {
        return Err(TestCaseError::fail("an empty error message"));
    }
    if places.iter().any(|p| chain.contains(p)) {
        Ok(())
    } else {
        Err(TestCaseError::fail(format!("the error names none of {places:?}: {chain}")))
    }
}

/// A model small enough that building, loading and decoding it costs less than the
/// checks around it: the loaders and the server do not care about its size.
pub(crate) fn model_config() -> metronome_model::ModelConfig {
    metronome_model::ModelConfig {
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 16,
        max_position_embeddings: 64,
        ..metronome_model::ModelConfig::tiny()
    }
}

/// The model of [`model_config`] with random weights from `seed`.
pub(crate) fn model(seed: u64) -> metronome_model::Model {
    metronome_model::Model::new(model_config(), &metronome_model::Device::Cpu, seed).expect("the fuzz model")
}

/// An engine serving [`model`]: one worker of one thread, eight slots.
pub(crate) fn engine() -> metronome_rollout::ModelEngine {
    let config = metronome_rollout::EngineConfig {
        workers: 1,
        threads_per_worker: Some(1),
        max_num_seqs: 8,
        max_seq_len: 64,
        ..metronome_rollout::EngineConfig::default()
    };
    let tokenizer = std::sync::Arc::new(metronome_model::CharTokenizer);
    metronome_rollout::model_engine(
        model(1).with_trainable(false),
        metronome_core::PolicyVersion(0),
        tokenizer,
        config,
        metronome_core::RunSeed(7),
    )
    .expect("the fuzz engine")
}

/// A folder for fixtures that live as long as the binary (a static is never
/// dropped, so a temporary folder would stay in /tmp after every run): under cargo's
/// folder for integration tests' files, emptied when the binary first asks.
pub(crate) fn scratch(name: &str) -> std::path::PathBuf {
    static ROOT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let root = ROOT.get_or_init(|| {
        let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz");
        // Left by an earlier run, or absent.
        let _ = std::fs::remove_dir_all(&root);
        root
    });
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("a folder under CARGO_TARGET_TMPDIR");
    dir
}

/// An error and its sources on one line.
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    metronome_core::ErrorChain(e).to_string()
}
