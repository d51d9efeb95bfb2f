//! `metronome trainer`: the training side of a multi-process run.
//!
//! It is the single-process run's [`Runner`] with one part swapped: prompts reach
//! generation as claims offered to rollout workers ([`ClaimRelease`]) instead of a
//! producer task, groups arrive over NATS, and a checkpoint is written after every
//! period so that the period's groups can be acknowledged.

use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use metronome_core::{ControlMessage, ControlSender, PeriodId, PromptSource, RunSeed, WeightSnapshot};

use crate::builders::{load_model, packer};
use crate::checkpoint::Checkpointing;
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::release::{Release, Released, next_batch};
use crate::report::Clock;
use crate::runner::{Parts, Runner, RunnerOptions};
use crate::schedule::Schedule;
use crate::session::{RunOptions, RunOutcome, Session};

/// Runs the trainer of a multi-process run: connects to NATS (failing fast on bad
/// credentials or a dead server), warm-starts or resumes from the run directory's
/// last period checkpoint, then drives the period protocol of [`crate::cluster`].
/// `run.name` must be set for a restart to find its run directory.
pub async fn run_trainer(mut config: PipelineConfig, options: RunOptions) -> Result<RunOutcome> {
    config.prepare()?;
    // Workers generate the `periodic` protocol; a run directory must not say otherwise.
    if config.run.schedule != Schedule::Periodic {
        return Err(Error::Config {
            key: "run.schedule".into(),
            reason: format!(
                "is `{}`, but `metronome trainer` runs the `periodic` protocol (whose results equal `sync`'s): \
                 set run.schedule = \"periodic\"",
                config.run.schedule
            ),
        });
    }
    let transport = super::connect(&config, "trainer", "metronome-trainer".to_owned()).await?;
    let name = config.run.name.clone().unwrap_or_default();
    // A run directory with a config is this run's: a restart, maybe before its first
    // checkpoint, whose messages on the server are its own.
    let restarted = config.run.out_dir.join(&name).join(crate::rundir::CONFIG_FILE).is_file();
    let session = Session::open(&config, "cluster", &options)?;
    if session.resume_at.is_some() {
        crate::metrics::trainer_resumed();
    } else if !restarted {
        refuse_leftovers(&transport, &name).await?;
    }
    let (model, tokenizer) = load_model(&config, config.trainer_device())?;
    let start = session.start(&config, model, tokenizer.clone()).await?;
    let source = config.data.build(RunSeed(config.run.seed), tokenizer)?;

    let release = ClaimRelease {
        offerer: transport.claim_offerer().await?,
        control: transport.control_sender().await?,
        source: None,
    };
    let parts = Parts {
        source: Box::new(source),
        trainer: Box::new(start.trainer),
        packer: Arc::new(packer(config.packing)),
        release: Box::new(release),
        receiver: Some(Box::new(transport.group_receiver().await?)),
        publisher: Some(Arc::new(transport.weight_publisher().await?)),
    };
    let options = RunnerOptions::from(&config);
    // A checkpoint after every period: its groups are acknowledged only then.
    let checkpointing =
        Checkpointing { dir: session.checkpoints.clone(), every: 1, interval: std::time::Duration::ZERO };
    let runner = Runner::from_parts(parts, options)?.checkpoint(checkpointing);
    session.finish(&config, runner, start.evaluation).await
}

/// Prompts reach rollout workers as claims: one per prompt, naming the weights to
/// sample with, offered while those weights upload; `PeriodStart`, `PeriodEnd` and
/// `Shutdown` frame the periods on the control channel.
struct ClaimRelease {
    offerer: metronome_transport::claims::NatsClaimOfferer,
    control: metronome_transport::nats::NatsControlSender,
    source: Option<Box<dyn PromptSource>>,
}

fn not_started() -> Error {
    Error::Stage(metronome_core::Error::invalid("claim release", "was used before `start` or after `finish`"))
}

#[async_trait]
impl Release for ClaimRelease {
    async fn start(&mut self, source: Box<dyn PromptSource>, _: Range<u64>, _: Clock) -> Result<()> {
        self.source = Some(source);
        Ok(())
    }

    async fn release(&mut self, period: PeriodId, weights: &Arc<WeightSnapshot>) -> Result<Option<Released>> {
        let source = self.source.as_mut().ok_or_else(not_started)?;
        let Some(batch) = next_batch(source.as_mut(), period).await? else { return Ok(None) };
        let version = weights.version;
        // Offered again after a restart, the server drops them as duplicates.
        self.offerer.offer(period, version, &batch.prompts).await?;
        crate::metrics::claims_offered(period.0, batch.prompts.len());
        let prompts: Vec<_> = batch.prompts.iter().map(|p| p.id).collect();
        self.control.send(ControlMessage::PeriodStart { period, version, prompts: prompts.clone() }).await?;
        Ok(Some(Released { prompts, resume: source.cursor(), groups: Vec::new() }))
    }

    async fn close(&mut self, period: PeriodId) -> Result<()> {
        Ok(self.control.send(ControlMessage::PeriodEnd { period }).await?)
    }

    async fn finish(&mut self) -> Result<Box<dyn PromptSource>> {
        let source = self.source.take().ok_or_else(not_started)?;
        self.control.send(ControlMessage::Shutdown).await?;
        Ok(source)
    }
}

/// A run starting from scratch finds the group stream and claim queue of its name
/// empty; messages there were left by an earlier run with the same `run.name` (whose
/// run directory is gone or elsewhere), and would be trained or generated as this
/// run's.
async fn refuse_leftovers(transport: &metronome_transport::nats::NatsTransport, name: &str) -> Result<()> {
    let queued = transport.queued().await?;
    let left: Vec<String> =
        queued.iter().filter(|(_, n)| *n > 0).map(|(stream, n)| format!("{n} in {stream}")).collect();
    if left.is_empty() {
        return Ok(());
    }
    Err(Error::Config {
        key: "run.name".into(),
        reason: format!(
            "`{name}` starts from scratch (no run directory), but the server holds messages of an earlier \
             run with this name ({}); purge those streams (`nats stream purge <stream>`) or pick another run.name",
            left.join(", ")
        ),
    })
}
