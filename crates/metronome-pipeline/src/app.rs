//! A whole run from a [`PipelineConfig`] in this process: build the stages, warm-start
//! with SFT (or resume), run the schedule, evaluate on held-out prompts, and record
//! everything in the run directory. The `metronome` binary and `cargo xtask e2e` call
//! [`run`]; `session.rs` is what it shares with the trainer of many processes,
//! `builders.rs` how stages come from the config.

use crate::builders::{group_scorer, load_model, local_transport, stages_around};
use crate::checkpoint::Checkpointing;
use crate::config::PipelineConfig;
use crate::error::Result;
use crate::runner::{Runner, RunnerOptions};
use crate::schedule::Schedule;
use crate::session::{RunOptions, RunOutcome, Session};

/// Runs a whole configured run in this process. When `run.out_dir/run.name` holds a
/// checkpoint of an earlier run (killed, or ended and given more `run.periods`), the
/// run resumes from it: trainer, optimiser, generator, data cursor and period, with
/// the record of the periods before it; the weights it ends with equal an
/// uninterrupted run's (`sync` and `periodic`; a `stale:s` run resumes with the newest
/// weights where the uninterrupted one sampled older ones).
pub async fn run(mut config: PipelineConfig, options: RunOptions) -> Result<RunOutcome> {
    config.prepare()?;
    // A reward that cannot start (no sandbox, an unreachable judge) fails the run now,
    // not after the warm start; the scorer is built again with the other stages.
    drop(group_scorer(&config)?);
    let session = Session::open(&config, "periods", &options)?;
    let (model, tokenizer) = load_model(&config, config.trainer_device())?;
    let start = session.start(&config, model, tokenizer.clone()).await?;
    let (stages, _) = stages_around(&config, start.trainer, tokenizer)?;
    let transport = (config.run.schedule != Schedule::Sync).then(|| local_transport(&config));
    let runner = Runner::new(stages, transport, RunnerOptions::from(&config))?;
    let checkpointing = Checkpointing {
        dir: session.checkpoints.clone(),
        every: config.run.checkpoint_every,
        interval: std::time::Duration::from_secs(config.run.checkpoint_interval_s),
    };
    session.finish(&config, runner.checkpoint(checkpointing), start.evaluation).await
}
