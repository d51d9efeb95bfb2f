//! The generating side: one rollout engine, the weights it holds, and the wait for
//! newer ones.
//!
//! Everything in the pipeline that generates does the same steps: wait for weights of
//! at least some version (saying so when the wait is long), install them when they are
//! not the ones the engine holds, ask for a period's prompts with `G` responses each,
//! and pass each group to a sink as it completes. `sync`'s release, the producer of
//! the overlapped schedules, a rollout worker of many processes and held-out
//! evaluation all do it through a [`Generator`], so that a new way of generating
//! (partial rollouts, an agent backend) enters here once.

use std::sync::Arc;
use std::time::Duration;

use metronome_core::{
    Group, GroupSink, PeriodId, PolicyVersion, Prompt, RolloutEngine, RolloutRequest, WeightSnapshot,
    WeightSubscriber,
};
use metronome_rollout::CollectSink;

use crate::error::{Error, Result};

/// How long a wait for weights lasts before the generator says so, and again after
/// each as long: a long wait is the trainer's (a slow step, one that hangs, or a
/// trainer that died), and saying so beats waiting in silence.
pub(crate) const WAIT_NOTICE: Duration = Duration::from_secs(30);

/// A rollout engine with the version of the weights it holds, and where newer
/// weights come from (see the module docs).
pub(crate) struct Generator {
    engine: Arc<dyn RolloutEngine>,
    subscriber: Option<Box<dyn WeightSubscriber>>,
    group_size: u32,
    /// The version installed through this generator; `None` before the first install,
    /// which always installs (the engine's own weights are not trusted to match).
    installed: Option<PolicyVersion>,
}

impl Generator {
    /// Generates `group_size` responses per prompt with `engine`, installing the
    /// weights it is given.
    pub(crate) fn new(engine: Arc<dyn RolloutEngine>, group_size: u32) -> Self {
        Self { engine, subscriber: None, group_size, installed: None }
    }

    /// Also waits for weights published through `subscriber` ([`Generator::wait`]).
    #[must_use]
    pub(crate) fn subscribed(mut self, subscriber: Box<dyn WeightSubscriber>) -> Self {
        self.subscriber = Some(subscriber);
        self
    }

    /// The newest published weights once they are of at least version `min`, saying
    /// every [`WAIT_NOTICE`] that `what` waits for them; `None` when `stop` resolves
    /// first.
    pub(crate) async fn wait(
        &mut self,
        min: PolicyVersion,
        what: &str,
        stop: impl Future<Output = ()>,
    ) -> Result<Option<Arc<WeightSnapshot>>> {
        let subscriber = self.subscriber.as_mut().ok_or_else(|| {
            Error::Stage(metronome_core::Error::invalid(
                "generator",
                "waits for weights without a subscriber",
            ))
        })?;
        if let Some(weights) = subscriber.latest().await?.filter(|w| w.version >= min) {
            return Ok(Some(weights));
        }
        let wait = subscriber.wait_for(min);
        tokio::pin!(wait, stop);
        let start = tokio::time::Instant::now();
        loop {
            tokio::select! {
                weights = &mut wait => return Ok(Some(weights?)),
                () = &mut stop => return Ok(None),
                () = tokio::time::sleep(WAIT_NOTICE) => tracing::warn!(
                    version = min.0,
                    "{what} waited {}s for weights of version {min}; is the trainer publishing?",
                    start.elapsed().as_secs()
                ),
            }
        }
    }

    /// Installs `weights` unless they are the version installed already; true when it
    /// installed them.
    pub(crate) async fn install(&mut self, weights: Arc<WeightSnapshot>) -> Result<bool> {
        if self.installed == Some(weights.version) {
            return Ok(false);
        }
        let version = weights.version;
        self.engine.install_weights(weights).await?;
        self.installed = Some(version);
        Ok(true)
    }

    /// Generates `prompts` as `period`'s, emitting each group to `sink` as it completes.
    pub(crate) async fn generate(
        &mut self,
        period: PeriodId,
        prompts: Vec<Prompt>,
        sink: &dyn GroupSink,
    ) -> Result<()> {
        let request = RolloutRequest { period, prompts, group_size: self.group_size };
        self.engine.generate(request, sink).await.map_err(|source| Error::Generation { period, source })
    }

    /// [`Generator::generate`] as a future that holds nothing of the generator, so that
    /// several periods generate at once on its engine (partial rollouts).
    pub(crate) fn detached(
        &self,
        period: PeriodId,
        prompts: Vec<Prompt>,
        sink: Arc<dyn GroupSink>,
    ) -> impl Future<Output = Result<()>> + Send + 'static {
        let engine = Arc::clone(&self.engine);
        let request = RolloutRequest { period, prompts, group_size: self.group_size };
        async move {
            engine
                .generate(request, sink.as_ref())
                .await
                .map_err(|source| Error::Generation { period, source })
        }
    }

    /// [`Generator::generate`] into a list, in completion order.
    pub(crate) async fn collect(&mut self, period: PeriodId, prompts: Vec<Prompt>) -> Result<Vec<Group>> {
        let sink = CollectSink::default();
        self.generate(period, prompts, &sink).await?;
        Ok(sink.into_groups())
    }
}
