//! `metronome rollout-worker`: one rollout worker of a multi-process run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use metronome_core::{
    ControlMessage, Group, GroupScorer, GroupSender, GroupSink, PeriodId, PolicyVersion, PromptId,
    RolloutEngine, RolloutRequest, WeightSubscriber,
};
use metronome_transport::ControlReceiver;
use metronome_transport::claims::Claim;
use metronome_transport::nats::NatsGroupSender;

use super::StopFlag;
use crate::app::{err, group_scorer, load_model};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};

/// What a worker did before it left.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerOutcome {
    /// Groups it published.
    pub groups: u64,
    /// Tokens it generated.
    pub tokens: u64,
    /// Claims it took that another worker had held before (lease expired or released).
    pub redelivered_claims: u64,
    /// The weights versions it installed, in order.
    pub versions: Vec<u64>,
    /// The periods it contributed groups to.
    pub periods: Vec<u64>,
}

/// How long one wait for a claim lasts before the worker checks whether to stop.
const CLAIM_WAIT: Duration = Duration::from_millis(500);

/// Runs a rollout worker until the trainer sends `Shutdown` or `stop` is set: take
/// claims, fetch the weights they name, generate, score, publish each group and then
/// complete its claim. Leases are renewed while the worker generates, so only a dead
/// worker's claims expire. Leaving (`stop`) finishes the claims in hand.
pub async fn run_worker(
    mut config: PipelineConfig,
    worker_id: &str,
    stop: StopFlag,
) -> Result<WorkerOutcome> {
    config.place();
    config.validate()?;
    let transport =
        super::connect(&config, "rollout-worker", format!("metronome-worker-{worker_id}")).await?;
    let lease = Duration::from_millis(transport.config().claims.lease_ms.max(1));

    let (model, tokenizer) = load_model(&config, config.rollout_device())?;
    let inference = model.frozen_copy().map_err(err("model"))?;
    drop(model);
    let mut engine_cfg = config.rollout.clone();
    engine_cfg.seed = config.run.seed;
    let engine = engine_cfg.build(inference, PolicyVersion(0), tokenizer).map_err(err("rollout"))?;
    let scorer: Arc<dyn GroupScorer> = Arc::from(group_scorer(&config)?);

    let mut subscriber = transport.weight_subscriber().await.map_err(err("transport"))?;
    let taker = transport.claim_taker().await.map_err(err("transport"))?;
    let sender = transport.group_sender().await.map_err(err("transport"))?;
    let mut control = transport.control_receiver().await.map_err(err("transport"))?;
    let listener_stop = stop.clone();
    let listener = tokio::spawn(async move {
        while let Ok(Some(message)) = control.recv().await {
            if message == ControlMessage::Shutdown {
                listener_stop.stop();
                break;
            }
        }
    });

    // Claims per take: enough prompts to fill the engine's slots.
    let group_size = config.run.group_size.max(1) as usize;
    let per_take = (config.rollout.max_num_seqs * config.rollout.workers.max(1) / group_size).max(1);
    let mut outcome = WorkerOutcome::default();
    let mut installed: Option<PolicyVersion> = None;
    let max_deliveries = transport.config().claims.max_deliveries.max(1);
    // Batches failed in a row (not counting the transport's failures).
    let mut failures = 0u64;
    eprintln!("worker {worker_id}: ready");
    while !stop.is_stopped() {
        let claims = match taker.take(per_take, CLAIM_WAIT).await {
            Ok(claims) => claims,
            // The server may be restarting: the client reconnects, so wait and retry
            // (leaving stays possible meanwhile).
            Err(e) => {
                tracing::warn!(error = %e, "cannot take claims; retrying");
                tokio::time::sleep(CLAIM_WAIT).await;
                continue;
            }
        };
        if claims.is_empty() {
            continue;
        }
        metrics::counter!("metronome_cluster_claims_taken_total").increment(claims.len() as u64);
        let redelivered = claims.iter().filter(|c| c.deliveries > 1).count() as u64;
        metrics::counter!("metronome_cluster_claim_redeliveries_total").increment(redelivered);
        outcome.redelivered_claims += redelivered;
        // A claim every worker failed on is poison: its group goes out as rejected
        // (empty responses), so the period completes and no worker dies on it again.
        let (poison, claims): (Vec<Claim>, Vec<Claim>) =
            claims.into_iter().partition(|c| c.deliveries > max_deliveries);
        for claim in poison {
            if let Err(e) = reject_claim(&claim, &scorer, &sender, config.run.group_size).await {
                // The server may be restarting: the claim comes back after its lease.
                tracing::warn!(error = %e, "cannot publish a rejected claim's group; it comes back");
            }
        }
        // A take normally holds one period's claims; generate each period's fresh
        // claims together, and each claim delivered before (its worker died, or its
        // batch failed) alone, so that one bad prompt fails only itself.
        let mut batches: Vec<(PeriodId, PolicyVersion, Vec<Claim>)> = Vec::new();
        for claim in claims {
            let fresh = claim.deliveries <= 1;
            match batches.iter_mut().find(|(p, v, list)| {
                fresh && *p == claim.period && *v == claim.version && list[0].deliveries <= 1
            }) {
                Some((_, _, list)) => list.push(claim),
                None => batches.push((claim.period, claim.version, vec![claim])),
            }
        }
        for (period, version, claims) in batches {
            let claims = Arc::new(claims);
            let keeper = tokio::spawn(keep_leases(claims.clone(), lease));
            let result = async {
                let start = Instant::now();
                let weights = match subscriber.latest().await? {
                    Some(w) if w.version >= version => w,
                    _ => {
                        // Claims are offered while their weights upload, so this wait
                        // lasts one upload (streamed, `weights.streaming`) unless the
                        // trainer died; a worker asked to leave meanwhile gives its
                        // claims back.
                        let stopped = async {
                            while !stop.is_stopped() {
                                tokio::time::sleep(CLAIM_WAIT).await;
                            }
                        };
                        tokio::select! {
                            w = subscriber.wait_for(version) => w?,
                            () = stopped => {
                                for claim in claims.iter() {
                                    claim.release().await.map_err(err("transport"))?;
                                }
                                metrics::counter!("metronome_cluster_claims_released_total")
                                    .increment(claims.len() as u64);
                                return Ok(None);
                            }
                        }
                    }
                };
                if weights.version > version {
                    // The period was stepped already (a claim offered again after a
                    // trainer restart, say): its groups are trained.
                    for claim in claims.iter() {
                        claim.complete().await.map_err(err("transport"))?;
                    }
                    metrics::counter!("metronome_cluster_claims_obsolete_total")
                        .increment(claims.len() as u64);
                    return Ok::<_, Error>(None);
                }
                if installed != Some(version) {
                    engine.install_weights(weights).await?;
                    installed = Some(version);
                    metrics::histogram!("metronome_cluster_weight_fetch_seconds")
                        .record(start.elapsed().as_secs_f64());
                    eprintln!("worker {worker_id}: installed weights version {version} for period {period}");
                    outcome.versions.push(version.0);
                }
                let sink = PublishAndComplete {
                    scorer: scorer.clone(),
                    sender: sender.clone(),
                    claims: claims.iter().enumerate().map(|(i, c)| (c.prompt.id, i)).collect(),
                    all: claims.clone(),
                    done: Mutex::new((0, 0)),
                };
                let request = RolloutRequest {
                    period,
                    prompts: claims.iter().map(|c| c.prompt.clone()).collect(),
                    group_size: config.run.group_size,
                };
                engine
                    .generate(request, &sink)
                    .await
                    .map_err(|source| Error::Generation { period, source })?;
                let (groups, tokens) = *sink.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                Ok(Some((groups, tokens)))
            }
            .await;
            keeper.abort();
            let result = match result {
                // The server may be restarting (a fetch, a group or an acknowledgement
                // failed): the claims not completed come back when their lease
                // expires, to this worker or another, so keep working.
                Err(e) if is_transport(&e) => {
                    tracing::warn!(error = %e, "transport failed during period {period}; taking claims again");
                    tokio::time::sleep(CLAIM_WAIT).await;
                    continue;
                }
                // Anything else failed this batch (the model, a prompt it chokes on):
                // give the claims back for another try, alone (a claim that fails
                // every time ends as rejected, above). A worker that fails again
                // and again is broken: it leaves, and its supervisor may restart it.
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, period = period.0, failures, "generation failed; giving the claims back");
                    for claim in claims.iter() {
                        // A claim whose group went out is complete; nothing to give back.
                        let _ = claim.release().await;
                    }
                    if failures >= 2 * max_deliveries {
                        return Err(e);
                    }
                    continue;
                }
                Ok(result) => {
                    failures = 0;
                    result
                }
            };
            if let Some((groups, tokens)) = result {
                outcome.groups += groups;
                outcome.tokens += tokens;
                if outcome.periods.last() != Some(&period.0) {
                    outcome.periods.push(period.0);
                }
            }
        }
    }
    listener.abort();
    eprintln!(
        "worker {worker_id}: done: {} groups, {} tokens, {} redelivered claims, versions {:?}, periods {:?}",
        outcome.groups, outcome.tokens, outcome.redelivered_claims, outcome.versions, outcome.periods
    );
    Ok(outcome)
}

/// Whether `e` is the transport's failure (directly, or under the generation that
/// was publishing a group), which a reconnection can heal.
fn is_transport(e: &Error) -> bool {
    let stage = match e {
        Error::Stage(s) | Error::Generation { source: s, .. } => s,
        _ => return false,
    };
    matches!(stage, metronome_core::Error::Stage { stage: "transport", .. })
}

/// Publishes the group of a poison claim as [`metronome_core::Group::rejected`],
/// then completes the claim: the trainer counts the group and trains nothing from it.
async fn reject_claim(
    claim: &Claim,
    scorer: &Arc<dyn GroupScorer>,
    sender: &NatsGroupSender,
    group_size: u32,
) -> Result<()> {
    tracing::warn!(
        period = claim.period.0,
        prompt = claim.prompt.id.0,
        deliveries = claim.deliveries,
        "every worker that took this claim failed on it; publishing its group as rejected"
    );
    metrics::counter!("metronome_cluster_claims_rejected_total").increment(1);
    let group = Group::rejected(claim.period, claim.prompt.clone(), group_size, claim.version);
    let scored = scorer.score(group).await?;
    sender.send(scored).await?;
    claim.complete().await.map_err(err("transport"))?;
    Ok(())
}

/// Renews the leases of the claims in hand every third of the lease.
async fn keep_leases(claims: Arc<Vec<Claim>>, lease: Duration) {
    loop {
        tokio::time::sleep(lease / 3).await;
        for claim in claims.iter() {
            if let Err(e) = claim.extend().await {
                tracing::warn!(error = %e, "cannot renew a claim's lease");
            }
        }
    }
}

/// Scores each group as it completes, publishes it, then completes its claim.
struct PublishAndComplete {
    scorer: Arc<dyn GroupScorer>,
    sender: NatsGroupSender,
    claims: HashMap<PromptId, usize>,
    all: Arc<Vec<Claim>>,
    done: Mutex<(u64, u64)>,
}

#[async_trait]
impl GroupSink for PublishAndComplete {
    async fn emit(&self, group: Group) -> metronome_core::Result<()> {
        let tokens: u64 = group.completions.iter().map(|c| c.tokens.len() as u64).sum();
        let prompt = group.prompt.id;
        let scored = self.scorer.score(group).await?;
        self.sender.send(scored).await?;
        if let Some(&i) = self.claims.get(&prompt) {
            self.all[i].complete().await?;
            metrics::counter!("metronome_cluster_claims_completed_total").increment(1);
        }
        metrics::counter!("metronome_cluster_worker_groups_total").increment(1);
        metrics::counter!("metronome_cluster_worker_tokens_total").increment(tokens);
        let mut done = self.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        done.0 += 1;
        done.1 += tokens;
        Ok(())
    }
}
