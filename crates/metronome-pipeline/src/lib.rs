//! The pipeline: wires Metronome's stages and runs a training schedule.
//!
//! A run is a sequence of periods. This crate decides *when* each stage works:
//!
//! - [`Schedule::Sync`] generates a period's whole batch, then scores, then trains,
//!   then steps — the colocated baseline;
//! - [`Schedule::Periodic`] (the default) publishes weights at the period start and
//!   trains groups in completion order while generation continues, one optimiser step
//!   per period — on-policy and equal to `Sync`;
//! - [`Schedule::Stale`] lets generation run up to `s` periods ahead with the newest
//!   weights it has; the lag bound is the production/consumption controller.
//!
//! The runner holds every stage as a trait object from `metronome-core`, so an
//! in-process transport and a NATS one, or a local engine and a remote one, are
//! swapped without touching schedule code. It does not implement any stage itself.
//!
//! [`cluster`] runs the same periods as separate processes — one trainer, any number
//! of rollout workers — over NATS JetStream (`transport.kind = "nats"`), with prompt
//! claims under leases so that workers may join and leave at any time.

mod app;
mod builders;
mod checkpoint;
#[cfg(feature = "nats")]
pub mod cluster;
mod config;
mod error;
mod evaluate;
mod events;
mod export;
mod generator;
mod html;
mod metrics;
mod plots;
mod prompts;
mod release;
mod report;
mod rundir;
mod runner;
mod schedule;
#[cfg(feature = "http")]
mod serve;
mod session;
mod summary;
pub mod tensorboard;
mod warm_start;

pub use app::run;
pub use builders::{TrainerHandle, build_stages, load_model, local_transport, with_env};
pub use checkpoint::Checkpointing;
pub use config::{
    DEFAULT_CONFIG, DynamicSampling, EvalConfig, MAX_SECRET_FILE_BYTES, ModelSource, PipelineConfig,
    RunConfig, SftConfig, TransportConfig, read_secret_file,
};
pub use error::{Error, Result};
pub use events::{Event, Observer, WorkerOutcome};
pub use export::{BASE_CHECKPOINT, ExportOptions, ExportOutcome, GREEDY_ANSWERS_FILE, export};
pub use html::{REPORT_FILE, write_html_report};
pub use metrics::{CLUSTER_METRICS, METRICS};
pub use metronome_core::Secret;
#[cfg(feature = "http")]
pub use metronome_rollout::{LogprobsMode, http::ServerConfig};
pub use prompts::prompt_lines;
pub use release::{Release, Released};
pub use report::{Clock, EvalPoint, Interval, PeriodReport, StageKind};
pub use rundir::RunDir;
pub use runner::{Packer, Parts, PeriodEnd, PeriodHook, RunEnd, Runner, RunnerOptions, Stages, Transport};
pub use schedule::{ParseScheduleError, Schedule};
#[cfg(feature = "http")]
pub use serve::serve;
pub use session::{RunOptions, RunOutcome};
pub use summary::summary_table;
pub use tensorboard::heldout_accuracy;

/// Every metrics catalogue a run's processes may emit from, this crate's own first,
/// for the binary to describe to its exporter and for the dashboard tests.
pub const CATALOGUES: &[&[metronome_core::Metric]] = &[
    METRICS,
    metrics::CLUSTER_METRICS,
    metronome_dataloader::METRICS,
    metronome_rollout::METRICS,
    metronome_reward::METRICS,
    metronome_trainer::METRICS,
    metronome_transport::METRICS,
];
