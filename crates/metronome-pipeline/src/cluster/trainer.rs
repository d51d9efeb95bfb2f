//! `metronome trainer`: the training side of a multi-process run.

use std::sync::Arc;
use std::time::Instant;

use metronome_core::{
    ControlMessage, Delivery, GroupKey, GroupReceiver, PeriodId, PromptSource, RunSeed, ScoredGroup,
    WeightPublisher, WeightSnapshot,
};
use metronome_trainer::GrpoTrainer;
use metronome_transport::ControlSender;

use crate::app::{err, load_model, progress_bar, warm_start};
use crate::checkpoint::{Checkpoints, RunState};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::metrics::record_period;
use crate::report::{Interval, PeriodReport, StageKind};
use crate::rundir::RunDir;
use crate::runner::{note_rejected, trainable};
use crate::schedule::Schedule;
use crate::summary::summary_table;

/// How long the trainer waits for a group before it logs that it is waiting.
const WAIT_NOTICE: std::time::Duration = std::time::Duration::from_secs(60);

/// What a trainer process produced.
#[derive(Debug)]
pub struct TrainerOutcome {
    /// The run directory.
    pub dir: RunDir,
    /// The periods this process ran (after a resume, only the remaining ones).
    pub periods: Vec<PeriodReport>,
    /// The period it resumed from, when it restarted from a checkpoint.
    pub resumed_at: Option<u64>,
    /// The final weights.
    pub weights: Arc<WeightSnapshot>,
}

/// Runs the trainer of a multi-process run: connects to NATS (failing fast on bad
/// credentials or a dead server), warm-starts or resumes from the run directory's
/// last period checkpoint, then drives the period protocol of [`crate::cluster`].
/// `run.name` must be set for a restart to find its run directory.
pub async fn run_trainer(mut config: PipelineConfig, progress: bool) -> Result<TrainerOutcome> {
    config.place();
    config.validate()?;
    let transport = super::connect(&config, "trainer", "metronome-trainer".to_owned()).await?;
    let name = config.run.name.clone().unwrap_or_else(|| {
        let secs =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        format!("trainer-{secs}")
    });
    // A run directory with a config is this run's: a restart, maybe before its first
    // checkpoint, whose messages on the server are its own.
    let restarted = config.run.out_dir.join(&name).join("config.toml").is_file();
    let dir = RunDir::create(&config.run.out_dir, &name)?;
    dir.write_config(&config.to_toml()?)?;
    let checkpoints = Checkpoints::new(dir.checkpoints().join("cluster"));

    if let Schedule::Stale(_) = config.run.schedule {
        return Err(Error::Config {
            key: "run.schedule".into(),
            reason: format!(
                "is `{}`, but `metronome trainer` runs the on-policy `periodic` protocol",
                config.run.schedule
            ),
        });
    }
    // The model is the warm start's input; a resumed trainer only needs its tokenizer.
    let (model, tokenizer) = load_model(&config, config.trainer_device())?;
    let mut source =
        config.data.build(RunSeed(config.run.seed), tokenizer.clone()).map_err(err("dataloader"))?;
    let (mut trainer, first_period, resumed_at) = match checkpoints.latest()? {
        Some((path, state)) => {
            let device = model.device().clone();
            drop(model);
            tracing::info!(period = state.next_period, "resuming from {}", path.display());
            eprintln!("resuming at period {} from {}", state.next_period, path.display());
            metrics::counter!("metronome_cluster_trainer_resumes_total").increment(1);
            // The trainer scores log-probs at the temperature the workers sample at.
            let trainer = GrpoTrainer::resume(config.trainer.clone(), &path, &device)
                .and_then(|t| t.with_sampling_temperature(config.rollout.sampling.temperature))
                .map_err(err("trainer"))?;
            source.restore(state.cursor).map_err(err("dataloader"))?;
            dir.resume_record(state.next_period)?;
            (trainer, state.next_period, Some(state.next_period))
        }
        None => {
            if !restarted {
                refuse_leftovers(&transport, &name).await?;
            }
            let bar = progress_bar(progress, config.sft.steps, "sft");
            let (model, sft_loss) = warm_start(&config, model, &tokenizer).await?;
            bar.finish_and_clear();
            if let Some((first, last)) = sft_loss {
                tracing::info!(first, last, "warm start done");
            }
            let trainer = GrpoTrainer::new(config.trainer.clone(), model)
                .and_then(|t| t.with_sampling_temperature(config.rollout.sampling.temperature))
                .map_err(err("trainer"))?;
            (trainer, 0, None)
        }
    };

    let publisher = transport.weight_publisher().await.map_err(err("transport"))?;
    let offerer = transport.claim_offerer().await.map_err(err("transport"))?;
    let control = transport.control_sender().await.map_err(err("transport"))?;
    let mut receiver = transport.group_receiver().await.map_err(err("transport"))?;
    let packer = crate::app::packer(config.packing);

    let t0 = Instant::now();
    let interval = |stage, period, start: Instant| Interval {
        stage,
        period,
        start_s: start.duration_since(t0).as_secs_f64(),
        end_s: t0.elapsed().as_secs_f64(),
    };
    let bar = progress_bar(progress, config.run.periods.saturating_sub(first_period), "periods");
    let mut reports = Vec::new();
    let mut weights = Arc::new(trainer.snapshot_sync().map_err(err("trainer"))?);
    for k in first_period..config.run.periods {
        let period = PeriodId(k);
        metrics::gauge!("metronome_cluster_period").set(k as f64);
        let Some(batch) = crate::runner::next_batch(&mut source).await? else { break };
        let start = Instant::now();
        let mut report = PeriodReport { period, ..PeriodReport::default() };

        let version = trainer.version();
        // The claims go out while the weights upload: a worker that takes one waits
        // for the version and decodes its chunks as they arrive (`weights.streaming`),
        // so that fetching overlaps publishing.
        let (published, offered) =
            tokio::join!(publisher.publish(weights.clone()), offerer.offer(period, version, &batch.prompts));
        published?;
        offered.map_err(err("transport"))?;
        report.intervals.push(interval(StageKind::Publication, period, start));
        report.publication_s = start.elapsed().as_secs_f64();
        metrics::counter!("metronome_cluster_claims_offered_total").increment(batch.prompts.len() as u64);
        control
            .send(ControlMessage::PeriodStart {
                period,
                version,
                prompts: batch.prompts.iter().map(|p| p.id).collect(),
            })
            .await?;

        let expected: std::collections::BTreeSet<GroupKey> =
            batch.prompts.iter().map(|p| GroupKey { period, prompt: p.id }).collect();
        let mut trained = std::collections::BTreeSet::new();
        // Acknowledged only after the checkpoint that contains them.
        let mut held: Vec<Delivery> = Vec::with_capacity(expected.len());
        while trained.len() < expected.len() {
            // Tell the operator when nothing arrives for a while (no worker running?).
            // Cancelling a receive loses nothing: an unacknowledged group comes back.
            let next = match tokio::time::timeout(WAIT_NOTICE, receiver.recv()).await {
                Ok(next) => next?,
                Err(_) => {
                    tracing::warn!(
                        "period {period}: {} of {} groups in after waiting {}s; are rollout workers running?",
                        trained.len(),
                        expected.len(),
                        WAIT_NOTICE.as_secs()
                    );
                    continue;
                }
            };
            let Some(delivery) = next else {
                return Err(Error::StreamClosed {
                    period,
                    received: trained.len(),
                    expected: expected.len(),
                });
            };
            let key = delivery.group.key();
            if key.period < period || trained.contains(&key) {
                // A redelivery of a group already in a checkpoint or in this period.
                report.duplicates += 1;
                metrics::counter!("metronome_cluster_trainer_duplicate_groups_total").increment(1);
                delivery.acker.ack().await?;
                continue;
            }
            // A group no trainer of this run would send: terminated, kept as a dead
            // letter, counted; the period goes on. The advantages are the trainer's own,
            // from the rewards (a worker's numbers are not trusted).
            let mut delivery = delivery;
            let recomputed = delivery.group.recompute(config.trainer.advantage);
            let poison = if let Err(e) = recomputed {
                Some(format!("its rewards are unusable: {e}"))
            } else if !expected.contains(&key) {
                Some(format!(
                    "it is not one of period {period}'s prompts: another trainer may share these streams"
                ))
            } else {
                let sampled = delivery.group.group.oldest_version();
                (sampled != Some(version)).then(|| {
                    format!("it was sampled with weights {sampled:?}, the period's are {version}: another trainer may share these streams")
                })
            };
            if let Some(reason) = poison {
                note_rejected(&mut report, key, &reason);
                delivery.acker.reject(&reason).await?;
                continue;
            }
            let micro_batches = match trainable(&packer, &delivery.group) {
                Ok(micro_batches) => micro_batches,
                Err(reason) => {
                    note_rejected(&mut report, key, &reason);
                    trained.insert(key);
                    if delivery.group.group.is_rejected() {
                        held.push(delivery);
                    } else {
                        delivery.acker.reject(&reason).await?;
                    }
                    continue;
                }
            };
            note_group(&mut report, &delivery.group);
            let t = Instant::now();
            tokio::task::block_in_place(|| {
                micro_batches.iter().try_for_each(|b| trainer.accumulate_sync(b).map(drop))
            })
            .map_err(err("trainer"))?;
            report.intervals.push(interval(StageKind::Training, period, t));
            report.generated_tokens +=
                delivery.group.group.completions.iter().map(|c| c.tokens.len() as u64).sum::<u64>();
            tracing::info!("accumulated a group of period {k} (prompt {})", key.prompt);
            trained.insert(key);
            held.push(delivery);
        }
        let t = Instant::now();
        report.step = crate::runner::close_period(&mut trainer, period)?;
        weights = Arc::new(trainer.snapshot_sync().map_err(err("trainer"))?);
        report.intervals.push(interval(StageKind::Training, period, t));
        finalise(&mut report, start);
        // The period's line, then the checkpoint that contains it, then the
        // acknowledgements: a kill anywhere between loses nothing (a resume from the
        // previous checkpoint drops the line and runs the period again).
        dir.append_period(&report)?;
        checkpoints.save(&trainer, RunState { next_period: k + 1, cursor: source.cursor() })?;
        for delivery in held {
            delivery.acker.ack().await?;
        }
        control.send(ControlMessage::PeriodEnd { period }).await?;
        record_period(&report);
        bar.inc(1);
        bar.suspend(|| {
            eprintln!(
                "period {:>3}  {:6.2}s  reward {:.3}  loss {:+.4}  duplicates {}",
                report.period, report.period_s, report.reward_mean, report.step.loss, report.duplicates
            );
        });
        reports.push(report);
    }
    bar.finish_and_clear();
    // Publish the final weights too, so workers (and anyone else) can fetch them.
    publisher.publish(weights.clone()).await?;
    control.send(ControlMessage::Shutdown).await?;
    trainer.save_checkpoint(&dir.checkpoints().join("final")).map_err(err("trainer"))?;
    if !reports.is_empty() {
        dir.write_plots(&reports)?;
        eprintln!("\n{}", summary_table(&reports));
    }
    eprintln!("run directory: {}", dir.path().display());
    Ok(TrainerOutcome { dir, periods: reports, resumed_at, weights })
}

/// A run starting from scratch finds the group stream and claim queue of its name
/// empty; messages there were left by an earlier run with the same `run.name` (whose
/// run directory is gone or elsewhere), and would be trained or generated as this
/// run's.
async fn refuse_leftovers(transport: &metronome_transport::nats::NatsTransport, name: &str) -> Result<()> {
    let queued = transport.queued().await.map_err(err("transport"))?;
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

fn note_group(report: &mut PeriodReport, group: &ScoredGroup) {
    report.groups += 1;
    report.staleness.push(0);
    let n = group.rewards.len().max(1) as f64;
    report.reward_mean += group.rewards.iter().map(|r| f64::from(r.total)).sum::<f64>() / n;
    let correct: Vec<f64> =
        group.rewards.iter().filter_map(|r| r.parts.get("correct")).map(|&c| f64::from(c)).collect();
    if !correct.is_empty() {
        *report.accuracy.get_or_insert(0.0) += correct.iter().sum::<f64>() / correct.len() as f64;
    }
}

fn finalise(report: &mut PeriodReport, start: Instant) {
    report.period_s = start.elapsed().as_secs_f64();
    let groups = report.groups.max(1) as f64;
    report.reward_mean /= groups;
    if let Some(acc) = report.accuracy.as_mut() {
        *acc /= groups;
    }
    report.training_s =
        report.intervals.iter().filter(|i| i.stage == StageKind::Training).map(Interval::seconds).sum();
}
