//! Metronome's data loader: which prompts form each period, released at the period's
//! start, resumable exactly after a restart.
//!
//! [`PromptLoader`] implements [`metronome_core::PromptSource`]. Each call of
//! `next_batch` releases the batch of `B` prompts of the next period, already rendered
//! (optionally through the model's chat template) and tokenised through a
//! [`metronome_core::Tokenizer`] trait object. The crate offers:
//!
//! - **Sources** ([`SourceConfig`]): JSONL and Parquet files, or directories of
//!   shards, read whole and validated when opened, through a [`FieldMapping`]
//!   (prompt, reference answer, metadata; dotted paths into nested fields; a prompt
//!   may be a string or a list of chat messages), and procedural
//!   tasks: [`ArithmeticTask`] (operators, digits, number of terms),
//!   [`CountdownTask`] (instances built from a solution, so always solvable) and
//!   [`WordProblemTask`] (grade-school stories of 2 to 4 operations in the style of
//!   GSM8K, the answer asked for on a last line `#### N`), each with
//!   its reference answer in `Prompt::reference` and task fields in
//!   `Prompt::metadata` (countdown: `numbers` as `3,7,25`, `target` as `88`; word
//!   problems: `template`, `steps`, `solution` as `4*3=12; 20-12=8`; all: `task`).
//!   Code tasks: [`CodeTask`] (small functions and programs), and
//!   HumanEval or MBPP files ([`CodeFileConfig`], `kind = "humaneval"` / `"mbpp"`),
//!   each prompt's tests in its reference as a [`metronome_core::CodeTests`] (JSON)
//!   for the code-execution reward, the canonical solution in the `solution`
//!   metadata field. A [`Holdout`] partitions a task's item space by content, so a
//!   training split and a held-out evaluation split never share a problem. The
//!   built-in default task for the embedded run is short sums, `12+7=` → `19`. Any
//!   other [`Dataset`] implementation plugs in too.
//! - **Order**: a Fisher–Yates shuffle per epoch seeded by
//!   `stream_seed(run, SHUFFLE_STREAM, epoch)` (a fixed algorithm pinned by golden
//!   values), every prompt exactly once per epoch, batches that run across epoch
//!   boundaries, a finite or unbounded number of epochs. A batch never holds a prompt
//!   twice (a period's groups are identified by period and prompt id): one that would
//!   meet its own prompt in the next epoch's order ends one short of `batch_size`
//!   (`_batches_cut_short_total`).
//! - **Resumption**: the [`metronome_core::Cursor`] (period, epoch, offset into the
//!   epoch's order, prompts skipped as too long included) fully determines every
//!   future batch; restoring it reproduces the uninterrupted sequence exactly. It
//!   assumes the same dataset, seed and configuration: a cursor cannot tell whether
//!   the file changed underneath it.
//! - **Prefetching**: batches are planned on the loader's own thread, never on the
//!   async runtime; the next period's batch is read, rendered and tokenised there
//!   while the current period runs.
//! - **Bad input**: errors name the file, line or row, and field; a
//!   [`BadRecordPolicy`] skips and counts bad records instead; over-long prompts are
//!   skipped (counted, ids logged) or rejected per [`OverlongPolicy`].
//!
//! Metrics (through the `metrics` facade): every one it emits is in [`METRICS`].
//!
//! It is not a tokenizer (those live in `metronome-model`, behind the core trait), nor
//! a reward: verifiers in `metronome-reward` read `Prompt::reference` and
//! `Prompt::metadata`. It knows nothing of rollout, training or transport; the
//! `metronome-pipeline` crate calls it once per period and saves its cursor with each
//! checkpoint. It depends on `metronome-core` only, among Metronome's crates.

mod config;
mod dataset;
mod error;
mod file;
mod loader;
mod metrics;
mod plan;
mod render;
mod rng;
mod tasks;

pub use config::{FileSourceConfig, LoaderConfig, OpenedSource, SourceConfig};
pub use dataset::{Dataset, PromptContent, Record};
pub use error::{Error, Location, Result};
pub use file::{
    BadRecordPolicy, CodeFileConfig, CodeFormat, FieldMapping, FileDataset, FileFormat, LoadReport,
};
pub use loader::{LoaderStats, PromptLoader};
pub use metrics::METRICS;
pub use plan::ReleaseConfig;
pub use render::{OverlongPolicy, PromptConfig};
pub use rng::{SHUFFLE_STREAM, epoch_order};
pub use tasks::{
    ARITHMETIC_STREAM, ArithmeticConfig, ArithmeticTask, CODE_STREAM, COPY_STREAM, COUNTDOWN_STREAM,
    CodeFamily, CodeItem, CodeTask, CodeTaskConfig, CopyConfig, CopyTask, CountdownConfig, CountdownItem,
    CountdownTask, DEFAULT_WORD_PROBLEM_FORMAT, Holdout, Operator, Span, Split, WORD_PROBLEM_STREAM,
    WordProblem, WordProblemConfig, WordProblemTask, WorkStep, holdout_bucket,
};
