//! The engine: a pool of workers doing continuous batching over KV-cache slots, a
//! shared queue of pending sequences, and the group assembler that streams groups out.
//!
//! # Threads
//! Each worker is an OS thread with its own KV cache and its own rayon pool; its
//! whole loop runs inside `pool.install`, so candle's matmuls and the model's decode
//! kernel use that pool's threads only (candle's element-wise "barrier pool" is process-wide and is sized
//! by `CANDLE_NUM_THREADS`; set it to 1 when a trainer shares the machine). Workers
//! share one queue of pending sequences: a worker with a free slot takes the next one.
//!
//! # Prefill
//! The sequences a worker admits in one pass (all free slots, refilled from the
//! queue) are prefilled together in one forward ([`InferenceModel::prefill_many`], in
//! chunks of at most `PREFILL_TOKENS` tokens): on a small model one prompt's forward
//! costs about what many cost, and at 64 slots per-sequence prefill was the largest
//! part of a run of 32-token responses. The model's prefill is batch-invariant, so a
//! sequence's tokens do not depend on which others were admitted with it.
//!
//! # Batching
//! [`Batching::Continuous`] admits a pending sequence into any free slot before each
//! step. [`Batching::Static`] admits only when every slot is free; a finished
//! sequence still frees its slot and leaves the forward. [`Batching::StaticPadded`]
//! is the standard static baseline: a finished sequence becomes a *padding row* that
//! keeps its KV-cache slot and is decoded (its last token fed again, the logits
//! discarded) in every step until the batch's last live sequence ends, as Hugging
//! Face `generate` computes finished rows of a batch.
//!
//! # Episodes
//! With an [`Episodes`] setting ([`Engine::with_episodes`], or
//! [`Engine::submit_episodes`]) a response is a multi-turn episode. When a turn ends
//! (a stop token, a stop string, or one of the environment's turn-ending strings) the
//! slot leaves the decode forward and the environment's [`Episode::step`] runs on a
//! thread of its own, under a time limit and `catch_unwind`; the worker keeps decoding
//! its other slots. The observation's tokens are then appended to the slot's KV cache
//! by prefilling only them (with the turn's last sampled token, which the cache does not
//! hold yet), batched with the other slots ready at that step, and sampling continues.
//! Only policy tokens draw from the response's random stream (the `k`-th policy token
//! uses its `k`-th number) and the prefill is batch-invariant, so a trajectory does not
//! depend on the worker or slot that ran it. A hung, panicking or failing tool, too many
//! turns or too many tokens end the episode with a failure reason on its
//! [`EpisodeTrace`] and a metric; never the run.
//!
//! # Versions
//! The installed weights are an `Arc` swapped by [`Engine::install_weights`]. A
//! sequence takes the `Arc` current when it is prefilled and keeps it until it ends,
//! so new weights may be installed while generation continues: running sequences
//! finish with the version they started with (the old model stays alive until its
//! last sequence ends) and new sequences use the new one. Each decode step batches the
//! active slots per version. Every completion records its version, and that version
//! is also an input of its sampling seed.

mod episodes;
mod shared;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;

use async_trait::async_trait;
use metronome_core::{
    Completion, Group, GroupSink, GroupTiming, PeriodId, PolicyVersion, Prompt, RolloutEngine,
    RolloutRequest, RunSeed, Tokenizer, WeightSnapshot,
};
use tokio::sync::mpsc;

pub use episodes::Episodes;
pub use shared::WorkerStats;
use shared::{CachePool, Event, Job, Queue, Request, Shared, Versioned, WorkerCounters};
use worker::Worker;

use crate::backend::{InferenceModel, WeightLoader};
use crate::stop::StopConditions;
use crate::{EngineConfig, Error, Result, SamplingConfig};

/// One generation request with its own sampling and seed: what
/// [`RolloutEngine::generate`] submits with the engine's defaults, and what the HTTP
/// server submits per request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Submission {
    /// The period the prompts belong to (copied onto every group).
    pub period: PeriodId,
    /// The prompts; each needs at least one token.
    pub prompts: Vec<Prompt>,
    /// Responses per prompt.
    pub group_size: u32,
    /// How to sample.
    pub sampling: SamplingConfig,
    /// The run seed of the seed rule.
    pub seed: RunSeed,
}

/// The in-process generation engine. See the crate docs for the design.
pub struct Engine<M: InferenceModel> {
    shared: Arc<Shared<M>>,
    workers: Vec<JoinHandle<()>>,
    loader: Option<Box<dyn WeightLoader<M>>>,
    config: EngineConfig,
    max_seq_len: usize,
    /// The run seed of [`RolloutEngine::generate`]'s sampling.
    seed: RunSeed,
    /// Multi-turn episodes for [`RolloutEngine::generate`].
    episodes: Option<Episodes>,
}

impl<M: InferenceModel> std::fmt::Debug for Engine<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("max_seq_len", &self.max_seq_len)
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}

impl<M: InferenceModel> Engine<M> {
    /// Starts `config.workers` workers generating with `model` as `version`.
    /// [`Engine::install_weights`] needs a loader: see [`Engine::with_weight_loader`].
    pub fn new(
        model: M,
        version: PolicyVersion,
        tokenizer: Arc<dyn Tokenizer>,
        config: EngineConfig,
    ) -> Result<Self> {
        config.validate()?;
        let max_seq_len = config.max_seq_len.min(model.max_context());
        model.check_caches(config.workers, config.max_num_seqs, max_seq_len, config.kv_cache_tokens)?;
        // With `kv_cache_tokens`, each worker's slots share a pool: the block the
        // cache rounds lengths to and the pool's blocks, for admission.
        let mut pool = None;
        let caches = (0..config.workers)
            .map(|_| match config.kv_cache_tokens {
                None => model.new_cache(config.max_num_seqs, max_seq_len),
                Some(tokens) => {
                    let (cache, block) = model.new_pooled_cache(config.max_num_seqs, max_seq_len, tokens)?;
                    pool = Some(CachePool { block: block.max(1), blocks: tokens.div_ceil(block.max(1)) });
                    Ok(cache)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            current: RwLock::new(Arc::new(Versioned { version, model, loaded: false })),
            counters: (0..config.workers).map(|_| WorkerCounters::default()).collect(),
            tokenizer,
            tool_calls: Arc::new(AtomicU64::new(0)),
            max_num_seqs: config.max_num_seqs,
            max_seq_len,
            pool,
            batching: config.batching,
            partial_rollouts: config.partial_rollouts.then_some(config.partial_cache),
        });
        let mut engine = Self {
            shared,
            workers: Vec::new(),
            loader: None,
            config,
            max_seq_len,
            seed: RunSeed(0),
            episodes: None,
        };
        for (index, cache) in caches.into_iter().enumerate() {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(engine.config.threads_per_worker())
                .thread_name(move |j| format!("rollout-{index}-{j}"))
                .build()
                .map_err(|e| Error::Worker { worker: index, reason: e.to_string() })?;
            let shared = Arc::clone(&engine.shared);
            let handle = std::thread::Builder::new()
                .name(format!("rollout-{index}"))
                // The whole worker loop runs inside its pool, so the matmuls of every
                // step use this pool's threads without a hand-off per call.
                .spawn(move || pool.install(|| Worker::new(index, shared, cache).run()))
                .map_err(|e| Error::Worker { worker: index, reason: e.to_string() })?;
            engine.workers.push(handle);
        }
        Ok(engine)
    }

    /// Sets how [`Engine::install_weights`] turns a snapshot into a model.
    #[must_use]
    pub fn with_weight_loader(mut self, loader: impl WeightLoader<M>) -> Self {
        self.loader = Some(Box::new(loader));
        self
    }

    /// Sets the run seed [`RolloutEngine::generate`] samples from (0 by default;
    /// [`Engine::submit`] takes its seed with each submission).
    #[must_use]
    pub fn with_seed(mut self, seed: RunSeed) -> Self {
        self.seed = seed;
        self
    }

    /// Makes every response of [`RolloutEngine::generate`] a multi-turn episode with
    /// `episodes`' environment ([`Engine::submit`] stays single-turn).
    pub fn with_episodes(mut self, episodes: Episodes) -> Result<Self> {
        episodes.validate()?;
        self.episodes = Some(episodes);
        Ok(self)
    }

    /// The multi-turn setting of [`RolloutEngine::generate`], if any.
    #[must_use]
    pub fn episodes(&self) -> Option<&Episodes> {
        self.episodes.as_ref()
    }

    /// The run seed [`RolloutEngine::generate`] samples from.
    #[must_use]
    pub fn seed(&self) -> RunSeed {
        self.seed
    }

    /// The configuration the engine was built with.
    #[must_use]
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The longest sequence (prompt + response) a slot holds.
    #[must_use]
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// The tokenizer responses are decoded with.
    #[must_use]
    pub fn tokenizer(&self) -> &Arc<dyn Tokenizer> {
        &self.shared.tokenizer
    }

    /// The installed version.
    #[must_use]
    pub fn current_version(&self) -> PolicyVersion {
        self.shared.current().version
    }

    /// Installs an already built model as `version`; sequences started afterwards use it.
    pub fn install_model(&self, model: M, version: PolicyVersion) {
        let next = Arc::new(Versioned { version, model, loaded: false });
        *self.shared.current.write().unwrap_or_else(PoisonError::into_inner) = next;
    }

    /// Builds a model from `weights` with the engine's loader and installs it, unless
    /// they are older than the installed weights and `rollback` refuses that. When the
    /// served model is one the loader built and nothing holds it (no sequence runs on
    /// it), the loader writes the weights over it instead ([`WeightLoader::reload`]).
    /// The loader checks names, shapes and values first (e.g. `Model::from_snapshot`),
    /// so a refused snapshot leaves the served weights as they were.
    pub fn install_snapshot(&self, weights: &WeightSnapshot, rollback: Rollback) -> Result<()> {
        let loader = self
            .loader
            .as_ref()
            .ok_or_else(|| Error::config("weight_loader", "is not set, so weights cannot be installed"))?;
        let older = |installed| Error::Rollback { offered: weights.version, installed };
        let refuse = |current| rollback == Rollback::Refuse && weights.version < current;
        {
            // The served model written over, when the loader built it and no sequence
            // or worker holds it (between the periods of an on-policy schedule).
            let mut current = self.shared.current.write().unwrap_or_else(PoisonError::into_inner);
            if refuse(current.version) {
                return Err(older(current.version));
            }
            if current.loaded
                && let Some(served) = Arc::get_mut(&mut current)
                && loader.reload(&mut served.model, weights)?
            {
                served.version = weights.version;
                return Ok(());
            }
        }
        let model = loader.load(weights)?;
        // Checked again under the lock: another install may have landed meanwhile.
        let mut current = self.shared.current.write().unwrap_or_else(PoisonError::into_inner);
        if refuse(current.version) {
            return Err(older(current.version));
        }
        if let Some(why) = current.model.cache_mismatch(&model) {
            return Err(Error::config(
                "weight_loader",
                format!(
                    "loaded version {} into a model the engine's KV caches cannot serve: {why}",
                    weights.version
                ),
            ));
        }
        *current = Arc::new(Versioned { version: weights.version, model, loaded: true });
        Ok(())
    }

    /// Counters per worker.
    #[must_use]
    pub fn worker_stats(&self) -> Vec<WorkerStats> {
        self.shared.counters.iter().map(WorkerCounters::snapshot).collect()
    }

    /// Sequences waiting for a slot.
    #[must_use]
    pub fn queue_depth(&self) -> usize {
        self.shared.lock_queue().pending.len()
    }

    /// Why `prompt` cannot be generated from, if it cannot: no tokens, or no room
    /// left within the context.
    fn check_prompt(&self, prompt: &Prompt) -> Result<()> {
        if prompt.tokens.is_empty() {
            return Err(Error::Prompt { prompt: prompt.id, reason: "has no tokens".into() });
        }
        if prompt.tokens.len() >= self.max_seq_len {
            return Err(Error::Prompt {
                prompt: prompt.id,
                reason: format!(
                    "has {} tokens, leaving no room to generate within max_seq_len {}",
                    prompt.tokens.len(),
                    self.max_seq_len
                ),
            });
        }
        Ok(())
    }

    /// Checks a submission and resolves its stop conditions (with the environment's
    /// turn-ending strings for episodes).
    fn prepare(&self, sub: &Submission, episodes: Option<&Episodes>) -> Result<StopConditions> {
        sub.sampling.validate()?;
        if sub.group_size == 0 {
            return Err(Error::config("group_size", "is 0 (expected >= 1)"));
        }
        for p in &sub.prompts {
            self.check_prompt(p)?;
        }
        let token_ids = if sub.sampling.ignore_eos {
            Vec::new()
        } else {
            sub.sampling.stop_token_ids.clone().unwrap_or_else(|| self.shared.tokenizer.stop_token_ids())
        };
        let mut strings = sub.sampling.stop_strings.clone();
        if let Some(e) = episodes {
            e.validate()?;
            strings.extend(e.environment.turn_stops().into_iter().filter(|s| !s.is_empty()));
        }
        Ok(StopConditions { token_ids, strings })
    }

    /// Generates `sub`, emitting every group to `sink` the moment its last response
    /// finishes (completion order). Returns when all groups are emitted. If the sink
    /// fails, or this future is dropped, the request's remaining sequences are cancelled.
    pub async fn submit(&self, sub: Submission, sink: &dyn GroupSink) -> metronome_core::Result<()> {
        self.run(sub, None, sink).await
    }

    /// [`Engine::submit`] with every response a multi-turn episode of `episodes`.
    pub async fn submit_episodes(
        &self,
        sub: Submission,
        episodes: Episodes,
        sink: &dyn GroupSink,
    ) -> metronome_core::Result<()> {
        self.run(sub, Some(episodes), sink).await
    }

    async fn run(
        &self,
        sub: Submission,
        episodes: Option<Episodes>,
        sink: &dyn GroupSink,
    ) -> metronome_core::Result<()> {
        let stop = self.prepare(&sub, episodes.as_ref())?;
        if sub.prompts.is_empty() {
            return Ok(());
        }
        let (events, mut rx) = mpsc::unbounded_channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let _cancel_on_drop = CancelOnDrop(Arc::clone(&cancelled));
        let group_size = sub.group_size as usize;
        let mut groups: Vec<Assembly> = sub
            .prompts
            .iter()
            .map(|_| Assembly { completions: vec![None; group_size], done: 0, started_s: None })
            .collect();
        let request = Arc::new(Request {
            prompts: sub.prompts,
            sampling: sub.sampling,
            stop,
            seed: sub.seed,
            episodes,
            events,
            cancelled,
            start: Instant::now(),
        });
        let start = request.start;
        {
            let mut q = self.shared.lock_queue();
            if q.shutdown {
                return Err(Error::Shutdown.into());
            }
            for prompt in 0..request.prompts.len() {
                for sample_index in 0..sub.group_size {
                    q.pending.push_back(Job { request: Arc::clone(&request), prompt, sample_index });
                }
            }
            crate::metrics::queue_depth(q.pending.len());
        }
        self.shared.wake.notify_all();
        // Keep the prompts for the groups; the workers hold the request itself. When
        // every job is gone (done or dropped at shutdown) the channel closes.
        let request_prompts: Vec<Prompt> = request.prompts.clone();
        drop(request);

        let mut remaining = groups.len();
        while remaining > 0 {
            let Some(event) = rx.recv().await else {
                return Err(Error::Shutdown.into());
            };
            match event {
                Event::Started { prompt, at_s } => {
                    let s = &mut groups[prompt].started_s;
                    *s = Some(s.map_or(at_s, |s: f64| s.min(at_s)));
                }
                Event::Finished { prompt, completion } => {
                    let g = &mut groups[prompt];
                    let i = completion.sample_index as usize;
                    g.completions[i] = Some(completion);
                    g.done += 1;
                    if g.done == group_size {
                        remaining -= 1;
                        let finished_s = start.elapsed().as_secs_f64();
                        let started_s = g.started_s.unwrap_or(finished_s);
                        crate::metrics::group_done(finished_s - started_s);
                        let group = Group {
                            period: sub.period,
                            prompt: request_prompts[prompt].clone(),
                            completions: g.completions.iter_mut().filter_map(Option::take).collect(),
                            timing: GroupTiming { started_s, finished_s },
                        };
                        sink.emit(group).await?;
                    }
                }
                Event::Failed(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// [`Engine::submit`] collecting the groups in completion order.
    pub async fn generate_groups(&self, sub: Submission) -> metronome_core::Result<Vec<Group>> {
        let sink = CollectSink::default();
        self.submit(sub, &sink).await?;
        Ok(sink.into_groups())
    }
}

impl<M: InferenceModel> Drop for Engine<M> {
    fn drop(&mut self) {
        self.shared.lock_queue().shutdown = true;
        self.shared.wake.notify_all();
        for h in self.workers.drain(..) {
            // A worker that panicked has already failed its requests by dropping them.
            let _ = h.join();
        }
    }
}

#[async_trait]
impl<M: InferenceModel> RolloutEngine for Engine<M> {
    /// Unlike [`Engine::submit`], a prompt that cannot be generated from (empty, or
    /// too long for `max_seq_len`) does not fail the request: its group is emitted
    /// first as [`Group::rejected`], logged and counted
    /// (`metronome_rollout_prompts_rejected_total`), so the period completes and a
    /// rollout worker does not die on a bad prompt, nor the next one that takes it.
    async fn generate(&self, request: RolloutRequest, sink: &dyn GroupSink) -> metronome_core::Result<()> {
        let version = self.current_version();
        let mut prompts = Vec::with_capacity(request.prompts.len());
        for prompt in request.prompts {
            match self.check_prompt(&prompt) {
                Ok(()) => prompts.push(prompt),
                Err(e) => {
                    tracing::warn!(period = request.period.0, error = %e, "rejected a prompt");
                    crate::metrics::prompt_rejected();
                    sink.emit(Group::rejected(request.period, prompt, request.group_size, version)).await?;
                }
            }
        }
        let sub = Submission {
            period: request.period,
            prompts,
            group_size: request.group_size,
            sampling: self.config.sampling.clone(),
            seed: self.seed,
        };
        self.run(sub, self.episodes.clone(), sink).await
    }

    /// Refuses weights older than the installed ones ([`Engine::install_snapshot`]).
    async fn install_weights(&self, weights: Arc<WeightSnapshot>) -> metronome_core::Result<()> {
        Ok(self.install_snapshot(&weights, Rollback::Refuse)?)
    }

    fn version(&self) -> PolicyVersion {
        self.current_version()
    }
}

/// Whether [`Engine::install_snapshot`] installs weights older than the installed ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rollback {
    /// Refuse them: versions only move forward (a delayed or replayed update must not
    /// undo a newer one). What [`RolloutEngine::install_weights`] does.
    Refuse,
    /// Install them: the caller says explicitly that the policy goes back (a resumed
    /// trainer, an operator restoring a checkpoint).
    Allow,
}

/// A group being assembled.
struct Assembly {
    completions: Vec<Option<Completion>>,
    done: usize,
    started_s: Option<f64>,
}

struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A [`GroupSink`] that keeps the groups in arrival order.
#[derive(Debug, Default)]
pub struct CollectSink {
    groups: Mutex<Vec<Group>>,
}

impl CollectSink {
    /// The groups received so far, in arrival order.
    #[must_use]
    pub fn into_groups(self) -> Vec<Group> {
        self.groups.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl GroupSink for CollectSink {
    async fn emit(&self, group: Group) -> metronome_core::Result<()> {
        self.groups.lock().unwrap_or_else(PoisonError::into_inner).push(group);
        Ok(())
    }
}
