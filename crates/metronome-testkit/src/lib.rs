//! Metronome's test kit: what a stage implementation, ours or a third party's, tests
//! itself with, and what tests of code that drives stages build on.
//!
//! - [`conformance`]: one suite per stage trait of `metronome-core`. Every stage
//!   crate runs its real implementation through its trait's suite; a third-party
//!   stage proves itself by passing the same checks.
//! - [`mock`]: fast, deterministic mock stages (source, engine, scorer, trainer,
//!   in-process transport) whose outputs depend on exactly the inputs the contracts
//!   name, for tests of the schedules. The source, engine, scorer and trainer pass
//!   their suites; the transport keeps order and loses nothing, but leaves
//!   de-duplication to its caller.
//! - [`BatchBuilder`]: hand-made [`metronome_core::TrainBatch`]es in the shared-prompt
//!   or the separate-rows layout, for tests of the model and the trainer.
//! - [`data`]: deterministic sample groups and weight snapshots with every field
//!   filled, awkward values included; [`damage`]: a good file damaged at many bytes,
//!   for the tests that readers refuse bad input with an error, never a panic.
//! - [`check_adapter_gradient`]: what a LoRA adapter's gradient must hold.
//! - [`server`]: a local `nats-server` child process for tests that need a real one.
//! - [`bench`](mod@bench): what the benchmarks share.
//!
//! It is a dev-dependency only, never a normal one (`cargo xtask deps` checks both
//! directions), and it depends on `metronome-core` alone among Metronome's crates, so
//! a third-party stage needs nothing else to run the suites. It is not published.

mod batch;
pub mod bench;
pub mod conformance;
pub mod damage;
pub mod data;
mod lora;
pub mod mock;
pub mod server;

pub use batch::BatchBuilder;
pub use lora::check_adapter_gradient;
