//! `metronome rollout-worker`: one rollout worker of a multi-process run.
//!
//! A worker serves claims, it does not drive periods: take claims, fetch the weights
//! they name, generate, and score and publish each group through the same sink as
//! the single-process producer ([`ScoreAndSend`]), wrapped in [`CompleteClaims`],
//! which completes a group's claim once the group is out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use metronome_core::{
    ControlMessage, ControlReceiver, ErrorChain, Group, GroupScorer, GroupSender, GroupSink, PeriodId,
    PolicyVersion, PromptId, WeightSnapshot,
};
use metronome_transport::claims::{Claim, NatsClaimTaker};

use super::StopFlag;
use crate::builders::{group_scorer, load_model, rollout_engine};
use crate::config::PipelineConfig;
use crate::error::Result;
use crate::events::{Event, Observer, WorkerOutcome};
use crate::generator::Generator;
use crate::release::ScoreAndSend;

/// How long one wait for a claim lasts before the worker checks whether to stop.
const CLAIM_WAIT: Duration = Duration::from_millis(500);

/// Runs a rollout worker until the trainer sends `Shutdown` or `stop` is set: take
/// claims, fetch the weights they name, generate, score, publish each group and then
/// complete its claim. Leases are renewed while the worker generates, so only a dead
/// worker's claims expire. Leaving (`stop`) finishes the claims in hand. What it
/// does goes to `observer`.
pub async fn run_worker(
    mut config: PipelineConfig,
    worker_id: &str,
    stop: StopFlag,
    observer: Observer,
) -> Result<WorkerOutcome> {
    config.prepare()?;
    let transport =
        super::connect(&config, "rollout-worker", format!("metronome-worker-{worker_id}")).await?;

    let (model, tokenizer) = load_model(&config, config.rollout_device())?;
    let engine = rollout_engine(&config, &model, PolicyVersion(0), tokenizer)?;
    drop(model);

    let mut control = transport.control_receiver().await?;
    let listener_stop = stop.clone();
    let listener = tokio::spawn(async move {
        while let Ok(Some(message)) = control.recv().await {
            if message == ControlMessage::Shutdown {
                listener_stop.stop();
                break;
            }
        }
    });
    let group_size = config.run.group_size.max(1);
    let claims = transport.config().claims.clone();
    let subscriber = Box::new(transport.weight_subscriber().await?);
    let mut worker = Worker {
        id: worker_id.to_owned(),
        generator: Generator::new(engine, group_size).subscribed(subscriber),
        scorer: Arc::from(group_scorer(&config)?),
        taker: transport.claim_taker().await?,
        sender: Arc::new(transport.group_sender().await?),
        lease: Duration::from_millis(claims.lease_ms.max(1)),
        max_hold: (claims.max_hold_ms > 0).then(|| Duration::from_millis(claims.max_hold_ms)),
        // Claims per take: enough prompts to fill the engine's slots.
        per_take: (config.rollout.max_num_seqs * config.rollout.workers.max(1) / group_size as usize).max(1),
        max_deliveries: claims.max_deliveries.max(1),
        group_size,
        outcome: WorkerOutcome::default(),
        observer,
    };
    worker.observer.emit(&Event::WorkerReady { worker: worker_id.to_owned() });
    let result = worker.serve(&stop).await;
    listener.abort();
    let outcome = worker.outcome;
    worker.observer.emit(&Event::WorkerDone { worker: worker_id.to_owned(), outcome: outcome.clone() });
    result.map(|()| outcome)
}

/// One worker's stages and books.
struct Worker {
    id: String,
    generator: Generator,
    scorer: Arc<dyn GroupScorer>,
    taker: NatsClaimTaker,
    sender: Arc<dyn GroupSender>,
    lease: Duration,
    /// How long leases are renewed (`transport.claims.max_hold_ms`; `None`: no limit).
    max_hold: Option<Duration>,
    per_take: usize,
    max_deliveries: u64,
    group_size: u32,
    outcome: WorkerOutcome,
    observer: Observer,
}

/// Claims generated together: one period's, sampled with one version.
struct Batch {
    period: PeriodId,
    version: PolicyVersion,
    claims: Vec<Claim>,
}

impl Worker {
    /// Takes and generates claims until asked to stop.
    async fn serve(&mut self, stop: &StopFlag) -> Result<()> {
        // Batches failed in a row (not counting the transport's failures).
        let mut failures = 0u64;
        while !stop.is_stopped() {
            let claims = match self.taker.take(self.per_take, CLAIM_WAIT).await {
                Ok(claims) => claims,
                // The server may be restarting: the client reconnects, so wait and retry
                // (leaving stays possible meanwhile).
                Err(e) => {
                    tracing::warn!(error = %ErrorChain(&e), "cannot take claims; retrying");
                    tokio::time::sleep(CLAIM_WAIT).await;
                    continue;
                }
            };
            for batch in self.batches(claims).await {
                let period = batch.period;
                match self.generate(batch, stop).await {
                    Ok(()) => failures = 0,
                    // The server may be restarting (a fetch, a group or an acknowledgement
                    // failed): the claims not completed come back when their lease
                    // expires, to this worker or another, so keep working.
                    Err(e) if e.is_transport() => {
                        tracing::warn!(error = %ErrorChain(&e), "transport failed during period {period}; taking claims again");
                        tokio::time::sleep(CLAIM_WAIT).await;
                    }
                    // Anything else failed the batch (the model, a prompt it chokes on):
                    // its claims went back for another try, alone (a claim that fails
                    // every time ends as rejected, in `batches`). A worker that fails
                    // again and again is broken: it leaves, and its supervisor may
                    // restart it.
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(error = %ErrorChain(&e), period = period.0, failures, "generation failed; the claims went back");
                        if failures >= 2 * self.max_deliveries {
                            return Err(e);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Groups taken claims into batches to generate: each period's fresh claims
    /// together, and each claim delivered before (its worker died, or its batch
    /// failed) alone, so that one bad prompt fails only itself. A claim every worker
    /// failed on is poison: its group goes out as rejected (empty responses), so the
    /// period completes and no worker dies on it again.
    async fn batches(&mut self, claims: Vec<Claim>) -> Vec<Batch> {
        if claims.is_empty() {
            return Vec::new();
        }
        let redelivered = claims.iter().filter(|c| c.deliveries > 1).count() as u64;
        crate::metrics::claims_taken(claims.len(), redelivered);
        self.outcome.redelivered_claims += redelivered;
        let mut batches: Vec<Batch> = Vec::new();
        for claim in claims {
            if claim.deliveries > self.max_deliveries {
                if let Err(e) = self.reject_claim(&claim).await {
                    // The server may be restarting: the claim comes back after its lease.
                    tracing::warn!(error = %ErrorChain(&e), "cannot publish a rejected claim's group; it comes back");
                }
                continue;
            }
            let fresh = claim.deliveries <= 1;
            match batches.iter_mut().find(|b| {
                fresh && b.period == claim.period && b.version == claim.version && b.claims[0].deliveries <= 1
            }) {
                Some(batch) => batch.claims.push(claim),
                None => {
                    batches.push(Batch { period: claim.period, version: claim.version, claims: vec![claim] })
                }
            }
        }
        batches
    }

    /// Generates one batch with its leases kept alive; on a failure other than the
    /// transport's, gives its claims back.
    async fn generate(&mut self, batch: Batch, stop: &StopFlag) -> Result<()> {
        let Batch { period, version, claims } = batch;
        let claims = Arc::new(claims);
        let keeper = tokio::spawn(keep_leases(claims.clone(), self.lease, self.max_hold));
        let result = self.generate_claims(period, version, &claims, stop).await;
        keeper.abort();
        if let Err(e) = &result
            && !e.is_transport()
        {
            for claim in claims.iter() {
                // A claim whose group went out is complete; nothing to give back.
                let _ = claim.release().await;
            }
        }
        result
    }

    async fn generate_claims(
        &mut self,
        period: PeriodId,
        version: PolicyVersion,
        claims: &Arc<Vec<Claim>>,
        stop: &StopFlag,
    ) -> Result<()> {
        let start = Instant::now();
        tracing::debug!(
            period = period.0,
            version = version.0,
            prompts = ?claims.iter().map(|c| (c.prompt.id.0, c.deliveries)).collect::<Vec<_>>(),
            "took claims (prompt, deliveries)"
        );
        let Some(weights) = self.weights_for(version, claims, stop).await? else { return Ok(()) };
        if weights.version > version {
            // The period was stepped already (a claim offered again after a trainer
            // restart, say): its groups are trained.
            for claim in claims.iter() {
                claim.complete().await?;
            }
            crate::metrics::claims_obsolete(claims.len());
            return Ok(());
        }
        if self.generator.install(weights).await? {
            crate::metrics::weights_fetched(start.elapsed().as_secs_f64());
            self.observer.emit(&Event::WeightsInstalled {
                worker: self.id.clone(),
                version: version.0,
                period: period.0,
            });
            self.outcome.versions.push(version.0);
        }
        let sink = CompleteClaims {
            inner: ScoreAndSend { scorer: self.scorer.clone(), sender: self.sender.clone() },
            claims: claims.iter().enumerate().map(|(i, c)| (c.prompt.id, i)).collect(),
            all: claims.clone(),
            done: Mutex::new((0, 0)),
        };
        let prompts = claims.iter().map(|c| c.prompt.clone()).collect();
        self.generator.generate(period, prompts, &sink).await?;
        let (groups, tokens) = *sink.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.outcome.groups += groups;
        self.outcome.tokens += tokens;
        if self.outcome.periods.last() != Some(&period.0) {
            self.outcome.periods.push(period.0);
        }
        Ok(())
    }

    /// The weights of at least `version`. Claims are offered while their weights
    /// upload, so the wait lasts one upload (streamed, `weights.streaming`) unless the
    /// trainer died; a worker asked to leave meanwhile gives its claims back (`None`).
    async fn weights_for(
        &mut self,
        version: PolicyVersion,
        claims: &[Claim],
        stop: &StopFlag,
    ) -> Result<Option<Arc<WeightSnapshot>>> {
        let stopped = async {
            while !stop.is_stopped() {
                tokio::time::sleep(CLAIM_WAIT).await;
            }
        };
        // Claims held while weights never come would stall the period: the generator
        // says so as it waits.
        let what = format!("worker {} holding {} claims", self.id, claims.len());
        let weights = self.generator.wait(version, &what, stopped).await?;
        if weights.is_none() {
            for claim in claims {
                claim.release().await?;
            }
            crate::metrics::claims_released(claims.len());
        }
        Ok(weights)
    }

    /// Publishes the group of a poison claim as [`metronome_core::Group::rejected`],
    /// then completes the claim: the trainer counts the group and trains nothing from it.
    async fn reject_claim(&self, claim: &Claim) -> Result<()> {
        tracing::warn!(
            period = claim.period.0,
            prompt = claim.prompt.id.0,
            deliveries = claim.deliveries,
            "every worker that took this claim failed on it; publishing its group as rejected"
        );
        crate::metrics::claim_rejected();
        let group = Group::rejected(claim.period, claim.prompt.clone(), self.group_size, claim.version);
        let scored = self.scorer.score(group).await?;
        self.sender.send(scored).await?;
        claim.complete().await?;
        Ok(())
    }
}

/// Renews the leases of the claims in hand every third of the lease, for at most
/// `max_hold`: a worker stuck on its claims then lets them go to another worker
/// (whichever group is published first counts; the trainer counts each once).
async fn keep_leases(claims: Arc<Vec<Claim>>, lease: Duration, max_hold: Option<Duration>) {
    let start = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(lease / 3).await;
        if let Some(max) = max_hold
            && start.elapsed() >= max
        {
            tracing::warn!(
                claims = claims.len(),
                "held claims for {}s (transport.claims.max_hold_ms); no longer renewing their leases, \
                 so they go to another worker",
                max.as_secs()
            );
            crate::metrics::claims_abandoned(claims.len());
            return;
        }
        for claim in claims.iter() {
            if let Err(e) = claim.extend().await {
                tracing::warn!(error = %ErrorChain(&e), "cannot renew a claim's lease");
            }
        }
    }
}

/// Completes a group's claim once `inner` has published the group, and counts what
/// went out: a decorator around the generating side's sink.
struct CompleteClaims<S> {
    inner: S,
    claims: HashMap<PromptId, usize>,
    all: Arc<Vec<Claim>>,
    done: Mutex<(u64, u64)>,
}

#[async_trait]
impl<S: GroupSink> GroupSink for CompleteClaims<S> {
    async fn emit(&self, group: Group) -> metronome_core::Result<()> {
        let tokens: u64 = group.completions.iter().map(|c| c.tokens.len() as u64).sum();
        let prompt = group.prompt.id;
        self.inner.emit(group).await?;
        let claim = self.claims.get(&prompt).map(|&i| &self.all[i]);
        if let Some(claim) = claim {
            claim.complete().await?;
        }
        crate::metrics::group_published(tokens, claim.is_some());
        let mut done = self.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        done.0 += 1;
        done.1 += tokens;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use metronome_core::Prompt;
    use metronome_testkit::server::NatsServer;
    use metronome_transport::nats::{NatsConfig, NatsTransport};

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_held_past_max_hold_go_to_another_worker() {
        let server = NatsServer::start(&[]).expect("start nats-server");
        let mut cfg = NatsConfig::with_prefix(vec![server.url()], "hold");
        cfg.claims.lease_ms = 1_500;
        let lease = Duration::from_millis(cfg.claims.lease_ms);
        let t = NatsTransport::connect(cfg).await.unwrap();
        let prompt = Prompt { id: PromptId(1), text: "1+1=".into(), tokens: vec![1], ..Prompt::default() };
        t.claim_offerer().await.unwrap().offer(PeriodId(0), PolicyVersion(0), &[prompt]).await.unwrap();
        let stuck = t.claim_taker().await.unwrap();
        let held = Arc::new(stuck.take(1, Duration::from_secs(10)).await.unwrap());
        assert_eq!(held.len(), 1);
        let keeper = tokio::spawn(keep_leases(held.clone(), lease, Some(Duration::from_secs(3))));
        // Renewed: nobody else gets it within the hold, past the lease.
        let other = t.claim_taker().await.unwrap();
        assert!(other.take(1, Duration::from_secs(2)).await.unwrap().is_empty(), "a renewed claim was taken");
        // Past the hold the keeper stops, the lease lapses and another worker takes it.
        let again = other.take(1, Duration::from_secs(20)).await.unwrap();
        assert_eq!(again.iter().map(|c| (c.prompt.id, c.deliveries)).collect::<Vec<_>>(), [(PromptId(1), 2)]);
        keeper.await.unwrap();
    }
}
