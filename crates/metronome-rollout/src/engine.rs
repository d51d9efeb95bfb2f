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

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use metronome_core::{
    Completion, Environment, Episode, EpisodeTrace, ErrorChain, FinishReason, Group, GroupSink, GroupTiming,
    Observation, PeriodId, PolicyVersion, Prompt, RolloutEngine, RolloutRequest, RunSeed, TokenId, TokenSpan,
    Tokenizer, WeightSnapshot, sample_seed,
};
use tokio::sync::mpsc;

use crate::backend::{InferenceModel, WeightLoader};
use crate::stop::{Finish, StopConditions};
use crate::{Batching, EngineConfig, Error, Result, Sampler, SamplingConfig, TokenRng};

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

/// Multi-turn generation: the environment every response talks to, and the limits
/// that keep a run alive. The episode's token budget (policy and observation tokens
/// together) is the sampling's `max_new_tokens`, capped by the slot's context.
#[derive(Clone)]
pub struct Episodes {
    /// Starts one episode per response.
    pub environment: Arc<dyn Environment>,
    /// Most policy turns per episode; the environment is not called after the last.
    pub max_turns: u32,
    /// Time limit of one [`Episode::step`]; past it the episode ends (`tool_timeout`).
    pub tool_time_limit: Duration,
    /// Most environment calls running at once in the engine, timed-out ones that have
    /// not returned included (a thread cannot be killed): past it a turn's call is
    /// refused and its episode ends (`tool_unavailable`), so a tool that always hangs
    /// costs a bounded number of threads.
    pub max_running_calls: usize,
    /// Whether the run renders its prompts through the model's chat template: then
    /// an observation that carries a chat message is appended as the template
    /// writes it ([`Observation::render`]).
    pub chat_template: bool,
}

impl std::fmt::Debug for Episodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Episodes")
            .field("max_turns", &self.max_turns)
            .field("tool_time_limit", &self.tool_time_limit)
            .field("max_running_calls", &self.max_running_calls)
            .field("chat_template", &self.chat_template)
            .finish_non_exhaustive()
    }
}

impl Episodes {
    /// Checks the limits.
    pub fn validate(&self) -> Result<()> {
        if self.max_turns == 0 {
            return Err(Error::config("max_turns", "is 0 (expected >= 1)"));
        }
        if self.tool_time_limit.is_zero() {
            return Err(Error::config("tool_time_limit", "is 0 (expected a positive duration)"));
        }
        if self.max_running_calls == 0 {
            return Err(Error::config("max_running_calls", "is 0 (expected >= 1)"));
        }
        Ok(())
    }
}

/// Counters of one worker since the engine started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Sequences in the worker's slots now.
    pub active_slots: u64,
    /// Tokens sampled (prefill and decode).
    pub generated_tokens: u64,
    /// Decode steps run (one per version batch).
    pub decode_steps: u64,
    /// Sum of the decode steps' batch sizes (`decode_rows / decode_steps` is the mean occupancy).
    pub decode_rows: u64,
    /// Of `decode_rows`, the padding rows of finished sequences computed and discarded
    /// ([`Batching::StaticPadded`] only).
    pub padding_rows: u64,
    /// Sequences finished.
    pub sequences: u64,
}

#[derive(Debug, Default)]
struct WorkerCounters {
    active_slots: AtomicU64,
    generated_tokens: AtomicU64,
    decode_steps: AtomicU64,
    decode_rows: AtomicU64,
    padding_rows: AtomicU64,
    sequences: AtomicU64,
}

impl WorkerCounters {
    fn snapshot(&self) -> WorkerStats {
        WorkerStats {
            active_slots: self.active_slots.load(Ordering::Relaxed),
            generated_tokens: self.generated_tokens.load(Ordering::Relaxed),
            decode_steps: self.decode_steps.load(Ordering::Relaxed),
            decode_rows: self.decode_rows.load(Ordering::Relaxed),
            padding_rows: self.padding_rows.load(Ordering::Relaxed),
            sequences: self.sequences.load(Ordering::Relaxed),
        }
    }
}

/// Installed weights and their version.
struct Versioned<M> {
    version: PolicyVersion,
    model: M,
}

/// What workers report to a request's assembler.
enum Event {
    Started { prompt: usize, at_s: f64 },
    Finished { prompt: usize, completion: Completion },
    Failed(Error),
}

/// A submitted request as the workers see it.
struct Request {
    prompts: Vec<Prompt>,
    sampling: SamplingConfig,
    stop: StopConditions,
    seed: RunSeed,
    episodes: Option<Episodes>,
    events: mpsc::UnboundedSender<Event>,
    cancelled: Arc<AtomicBool>,
    start: Instant,
}

impl Request {
    fn send(&self, event: Event) {
        // A closed channel means the assembler is gone (cancelled); nothing to report to.
        let _ = self.events.send(event);
    }

    fn fail(&self, e: Error) {
        self.cancelled.store(true, Ordering::Relaxed);
        self.send(Event::Failed(e));
    }

    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }
}

/// One pending response.
struct Job {
    request: Arc<Request>,
    prompt: usize,
    sample_index: u32,
}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Job>,
    shutdown: bool,
}

struct Shared<M> {
    queue: Mutex<Queue>,
    wake: Condvar,
    current: RwLock<Arc<Versioned<M>>>,
    counters: Vec<WorkerCounters>,
    tokenizer: Arc<dyn Tokenizer>,
    /// Environment calls running now (hung ones included), engine-wide.
    tool_calls: Arc<AtomicU64>,
    max_num_seqs: usize,
    max_seq_len: usize,
    batching: Batching,
}

impl<M> Shared<M> {
    fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn current(&self) -> Arc<Versioned<M>> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }
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
        let caches = (0..config.workers)
            .map(|_| model.new_cache(config.max_num_seqs, max_seq_len))
            .collect::<Result<Vec<_>>>()?;
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            current: RwLock::new(Arc::new(Versioned { version, model })),
            counters: (0..config.workers).map(|_| WorkerCounters::default()).collect(),
            tokenizer,
            tool_calls: Arc::new(AtomicU64::new(0)),
            max_num_seqs: config.max_num_seqs,
            max_seq_len,
            batching: config.batching,
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
                .num_threads(engine.config.threads_per_worker)
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
        let next = Arc::new(Versioned { version, model });
        *self.shared.current.write().unwrap_or_else(PoisonError::into_inner) = next;
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

    async fn install_weights(&self, weights: Arc<WeightSnapshot>) -> metronome_core::Result<()> {
        let loader = self
            .loader
            .as_ref()
            .ok_or_else(|| Error::config("weight_loader", "is not set, so weights cannot be installed"))?;
        let model = loader.load(&weights)?;
        self.install_model(model, weights.version);
        Ok(())
    }

    fn version(&self) -> PolicyVersion {
        self.current_version()
    }
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

/// Most prompt tokens one prefill forward takes: sequences admitted together are
/// prefilled in one forward (on a small model one prompt costs about what many cost),
/// in chunks of at most this many tokens to bound the activations' memory.
const PREFILL_TOKENS: usize = 2048;

/// The active slots (with their last tokens) that decode with one weight version.
type VersionBatch<M> = (Arc<Versioned<M>>, Vec<(usize, TokenId)>);

/// A sequence in a slot.
struct Seq<M> {
    request: Arc<Request>,
    prompt: usize,
    sample_index: u32,
    model: Arc<Versioned<M>>,
    rng: TokenRng,
    /// The prompt followed by the response so far (the repetition penalty's context).
    context: Vec<TokenId>,
    prompt_len: usize,
    logprobs: Vec<f32>,
    /// Most tokens this response may have.
    budget: usize,
    /// Bytes of the current turn's decoded text already searched for stop strings.
    text_checked: usize,
    /// Tokens sampled so far: the index of the next number of the random stream
    /// (observation tokens draw none).
    sampled: u64,
    /// The episode, for multi-turn generation.
    episode: Option<EpisodeState>,
}

/// A running episode's side of a slot.
struct EpisodeState {
    /// The environment's episode; `None` while a call holds it.
    episode: Option<Box<dyn Episode>>,
    /// The environment call under way: the slot waits and leaves the decode forward.
    call: Option<ToolCall>,
    /// Index (in the response's tokens) where the current policy turn begins.
    turn_start: usize,
    observations: Vec<TokenSpan>,
    turns: u32,
    reward: Option<f32>,
}

/// What a tool thread sends back: the episode (to continue it) and the observation,
/// or why the call failed.
type CallResult = (Option<Box<dyn Episode>>, std::result::Result<Observation, String>);

struct ToolCall {
    result: std_mpsc::Receiver<CallResult>,
    deadline: Instant,
    /// How the turn ended, for the completion if this was the last.
    finish: Finish,
}

/// Counts one running environment call until dropped.
struct Running(Arc<AtomicU64>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs `step` of `episode` on a thread of its own, catching panics; the receiver
/// gets the episode back with the observation, or the failure reason. Refused when
/// `max` calls are running already.
fn spawn_tool_call(
    mut episode: Box<dyn Episode>,
    turn: String,
    running: &Arc<AtomicU64>,
    max: usize,
) -> std_mpsc::Receiver<CallResult> {
    let (tx, rx) = std_mpsc::sync_channel(1);
    if running.fetch_add(1, Ordering::AcqRel) >= max as u64 {
        running.fetch_sub(1, Ordering::AcqRel);
        let _ = tx.send((None, Err(format!("tool_unavailable: {max} environment calls are still running"))));
        return rx;
    }
    let guard = Running(Arc::clone(running));
    let spawned = std::thread::Builder::new().name("rollout-tool".into()).spawn({
        let tx = tx.clone();
        move || {
            let _running = guard;
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build();
            let result = match runtime {
                Ok(rt) => catch_unwind(AssertUnwindSafe(|| rt.block_on(episode.step(&turn)))),
                Err(e) => Ok(Err(metronome_core::Error::invalid("tool runtime", e.to_string()))),
            };
            // A receiver gone (timed out, cancelled) wants nothing any more.
            let _ = match result {
                Ok(Ok(obs)) => tx.send((Some(episode), Ok(obs))),
                Ok(Err(e)) => tx.send((None, Err(format!("tool_error: {}", ErrorChain(&e))))),
                Err(panic) => tx.send((None, Err(format!("tool_panic: {}", panic_message(&*panic))))),
            };
        }
    });
    if let Err(e) = spawned {
        let _ = tx.send((None, Err(format!("tool_error: no thread for the call: {e}"))));
    }
    rx
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// A finished sequence kept in the decode forward under [`Batching::StaticPadded`]
/// until its batch ends: its slot's KV cache grows by one row per step, like a padded
/// row of a static batch.
struct Padding<M> {
    model: Arc<Versioned<M>>,
    /// The token fed at each step (the sequence's last one); its logits are discarded.
    token: TokenId,
    /// Tokens the slot's KV cache holds.
    held: usize,
}

impl<M> Seq<M> {
    fn generated(&self) -> &[TokenId] {
        &self.context[self.prompt_len..]
    }

    fn last(&self) -> TokenId {
        self.context[self.context.len() - 1]
    }

    /// Where the current policy turn begins in the response.
    fn turn_start(&self) -> usize {
        self.episode.as_ref().map_or(0, |e| e.turn_start)
    }

    /// True while an environment call holds the slot.
    fn waiting(&self) -> bool {
        self.episode.as_ref().is_some_and(|e| e.call.is_some())
    }
}

struct Worker<M: InferenceModel> {
    index: usize,
    label: String,
    shared: Arc<Shared<M>>,
    cache: M::Cache,
    slots: Vec<Option<Seq<M>>>,
    /// Finished sequences still decoded ([`Batching::StaticPadded`]); a slot holds
    /// either a live sequence or padding, never both.
    padding: Vec<Option<Padding<M>>>,
    sampler: Sampler,
    max_seq_len: usize,
    /// Tokens sampled since the metrics counter was last advanced: it is advanced
    /// once per step, and before a completion is reported so that a caller who has
    /// its group also sees its tokens counted.
    unflushed_tokens: u64,
    tokens_total: metrics::Counter,
}

impl<M: InferenceModel> Worker<M> {
    fn new(index: usize, shared: Arc<Shared<M>>, cache: M::Cache) -> Self {
        let max_num_seqs = shared.max_num_seqs;
        let max_seq_len = shared.max_seq_len;
        Self {
            index,
            label: index.to_string(),
            shared,
            cache,
            slots: (0..max_num_seqs).map(|_| None).collect(),
            padding: (0..max_num_seqs).map(|_| None).collect(),
            sampler: Sampler::new(),
            max_seq_len,
            unflushed_tokens: 0,
            tokens_total: crate::metrics::generated_tokens(index),
        }
    }

    fn counters(&self) -> &WorkerCounters {
        &self.shared.counters[self.index]
    }

    fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn run(mut self) {
        let active_gauge = crate::metrics::active_slots(&self.label);
        while let Some(jobs) = self.admit() {
            self.start(jobs);
            let decoded = self.step();
            let observed = self.poll_tools();
            if !decoded && !observed && self.active() > 0 {
                // Every live slot waits on its environment: do not spin.
                std::thread::sleep(Duration::from_micros(200));
            }
            let active = self.active() as u64;
            self.counters().active_slots.store(active, Ordering::Relaxed);
            active_gauge.set(active as f64);
            self.flush_tokens();
        }
        // Shutdown: sequences still running are dropped; their requests see the
        // channel close once the queue's jobs are dropped too.
        self.shared.lock_queue().pending.clear();
    }

    /// Frees the slots of cancelled requests, waits while there is nothing to do, and
    /// takes pending jobs for the free slots. `None` at shutdown.
    fn admit(&mut self) -> Option<Vec<(usize, Job)>> {
        for slot in 0..self.slots.len() {
            if self.slots[slot].as_ref().is_some_and(|s| s.request.is_cancelled()) {
                self.release(slot);
            }
        }
        // A padded batch ends with its last live sequence: its padding rows go too.
        if self.active() == 0 {
            for slot in 0..self.padding.len() {
                self.release(slot);
            }
        }
        let mut q = self.shared.lock_queue();
        loop {
            if q.shutdown {
                return None;
            }
            q.pending.retain(|j| !j.request.is_cancelled());
            if self.active() > 0 || !q.pending.is_empty() {
                break;
            }
            q = self.shared.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
        let may_admit = match self.shared.batching {
            Batching::Continuous => true,
            Batching::Static | Batching::StaticPadded => self.active() == 0,
        };
        let mut jobs = Vec::new();
        if may_admit {
            for slot in 0..self.slots.len() {
                if self.slots[slot].is_none() {
                    let Some(job) = q.pending.pop_front() else { break };
                    jobs.push((slot, job));
                }
            }
            if !jobs.is_empty() {
                crate::metrics::queue_depth(q.pending.len());
            }
        }
        Some(jobs)
    }

    /// Puts `jobs` into their slots with the current weights, prefills them in as few
    /// forwards as [`PREFILL_TOKENS`] allows, and samples each one's first token.
    fn start(&mut self, jobs: Vec<(usize, Job)>) {
        if jobs.is_empty() {
            return;
        }
        let model = self.shared.current();
        let mut chunk: Vec<usize> = Vec::with_capacity(jobs.len());
        let mut chunk_tokens = 0;
        for (slot, job) in jobs {
            let request = job.request;
            let prompt = &request.prompts[job.prompt];
            request.send(Event::Started { prompt: job.prompt, at_s: request.start.elapsed().as_secs_f64() });
            let seed = sample_seed(request.seed, model.version, prompt.id, job.sample_index);
            let episode = match &request.episodes {
                None => None,
                Some(e) => match e.environment.start(prompt, job.sample_index) {
                    Ok(episode) => Some(EpisodeState {
                        episode: Some(episode),
                        call: None,
                        turn_start: 0,
                        observations: Vec::new(),
                        turns: 0,
                        reward: None,
                    }),
                    Err(e) => {
                        request.fail(Error::Prompt {
                            prompt: prompt.id,
                            reason: format!("cannot start an episode: {}", ErrorChain(&e)),
                        });
                        continue;
                    }
                },
            };
            let budget = request
                .sampling
                .max_new_tokens
                .min(self.max_seq_len.saturating_sub(prompt.tokens.len()).max(1));
            let mut context = Vec::with_capacity(prompt.tokens.len() + budget);
            context.extend_from_slice(&prompt.tokens);
            if !chunk.is_empty() && chunk_tokens + context.len() > PREFILL_TOKENS {
                self.prefill(&model, &std::mem::take(&mut chunk));
                chunk_tokens = 0;
            }
            chunk_tokens += context.len();
            chunk.push(slot);
            self.slots[slot] = Some(Seq {
                prompt: job.prompt,
                sample_index: job.sample_index,
                rng: TokenRng::new(seed),
                prompt_len: prompt.tokens.len(),
                context,
                logprobs: Vec::with_capacity(budget),
                budget,
                text_checked: 0,
                sampled: 0,
                episode,
                model: Arc::clone(&model),
                request: Arc::clone(&request),
            });
        }
        self.prefill(&model, &chunk);
    }

    /// Prefills the freshly started sequences in `slots` together and samples their
    /// first tokens. If the joint forward fails, each is retried alone, so one bad
    /// prompt fails only its own request.
    fn prefill(&mut self, model: &Versioned<M>, slots: &[usize]) {
        let seqs: Vec<(usize, &[TokenId])> = slots
            .iter()
            .filter_map(|&s| self.slots[s].as_ref().map(|seq| (s, seq.context.as_slice())))
            .collect();
        let joint = match model.model.prefill_many(&mut self.cache, &seqs) {
            Ok(rows) if rows.len() == seqs.len() => Some(rows),
            _ => None,
        };
        drop(seqs);
        if let Some(rows) = joint {
            for (&slot, logits) in slots.iter().zip(&rows) {
                self.advance(slot, logits);
            }
            return;
        }
        for &slot in slots {
            let Some(seq) = self.slots[slot].as_ref() else { continue };
            match model.model.prefill(&mut self.cache, slot, &seq.context) {
                Ok(logits) => self.advance(slot, &logits),
                Err(e) => {
                    seq.request.fail(e);
                    self.release(slot);
                }
            }
        }
    }

    /// One decode step for every active slot not waiting on its environment (and every
    /// padding row), batched per weight version, in slot order. False when nothing
    /// decoded.
    fn step(&mut self) -> bool {
        let mut batches: Vec<VersionBatch<M>> = Vec::new();
        let mut padding_rows = 0;
        for slot in 0..self.slots.len() {
            let (model, token) = match (&self.slots[slot], &self.padding[slot]) {
                (Some(seq), _) if seq.waiting() => continue,
                (Some(seq), _) => (&seq.model, seq.last()),
                // A full slot cannot take another row; its padding leaves the forward.
                (None, Some(pad)) if pad.held < self.max_seq_len => {
                    padding_rows += 1;
                    (&pad.model, pad.token)
                }
                _ => continue,
            };
            match batches.iter_mut().find(|(m, _)| Arc::ptr_eq(m, model)) {
                Some((_, batch)) => batch.push((slot, token)),
                None => batches.push((Arc::clone(model), vec![(slot, token)])),
            }
        }
        if batches.is_empty() {
            return false;
        }
        self.counters().padding_rows.fetch_add(padding_rows, Ordering::Relaxed);
        for (model, batch) in batches {
            let result = model.model.decode_step(&mut self.cache, &batch);
            self.counters().decode_steps.fetch_add(1, Ordering::Relaxed);
            self.counters().decode_rows.fetch_add(batch.len() as u64, Ordering::Relaxed);
            match result {
                Ok(rows) if rows.len() == batch.len() => {
                    for (&(slot, _), row) in batch.iter().zip(&rows) {
                        // A slot without a live sequence was padding: its row is discarded.
                        if self.slots[slot].is_some() {
                            self.advance(slot, row);
                        } else if let Some(pad) = self.padding[slot].as_mut() {
                            pad.held += 1;
                        }
                    }
                }
                Ok(rows) => self.fail_batch(
                    &batch,
                    &format!("decode step returned {} rows for {} slots", rows.len(), batch.len()),
                ),
                Err(e) => self.fail_batch(&batch, &ErrorChain(&e).to_string()),
            }
        }
        true
    }

    /// Takes the answers of finished environment calls (and ends the episodes whose call
    /// timed out), appends the observations of those that go on by prefilling only the
    /// new tokens, batched per weight version, and samples each one's next token. False
    /// when no call finished.
    fn poll_tools(&mut self) -> bool {
        let now = Instant::now();
        let mut answered = Vec::new();
        for slot in 0..self.slots.len() {
            let Some(call) = self.slots[slot].as_ref().and_then(|s| s.episode.as_ref()?.call.as_ref()) else {
                continue;
            };
            match call.result.try_recv() {
                Ok(result) => answered.push((slot, result)),
                Err(std_mpsc::TryRecvError::Empty) if now < call.deadline => {}
                Err(std_mpsc::TryRecvError::Empty) => {
                    answered.push((slot, (None, Err("tool_timeout".into()))))
                }
                Err(std_mpsc::TryRecvError::Disconnected) => {
                    answered.push((
                        slot,
                        (None, Err("tool_panic: the call's thread ended without an answer".into())),
                    ));
                }
            }
        }
        if answered.is_empty() {
            return false;
        }
        let mut feeds: Vec<(usize, Vec<TokenId>)> = Vec::new();
        for (slot, (episode, result)) in answered {
            if let Some(feed) = self.observe(slot, episode, result) {
                feeds.push((slot, feed));
            }
        }
        // Prefill per weight version, in slot order.
        while !feeds.is_empty() {
            let Some(model) = self.slots[feeds[0].0].as_ref().map(|s| Arc::clone(&s.model)) else {
                feeds.remove(0);
                continue;
            };
            let (batch, rest): (Vec<_>, Vec<_>) = feeds.into_iter().partition(|(slot, _)| {
                self.slots[*slot].as_ref().is_some_and(|s| Arc::ptr_eq(&s.model, &model))
            });
            feeds = rest;
            let seqs: Vec<(usize, &[TokenId])> = batch.iter().map(|(s, t)| (*s, t.as_slice())).collect();
            match model.model.prefill_many(&mut self.cache, &seqs) {
                Ok(rows) if rows.len() == batch.len() => {
                    for ((slot, _), logits) in batch.iter().zip(&rows) {
                        self.advance(*slot, logits);
                    }
                }
                Ok(rows) => {
                    let reason =
                        format!("observation prefill returned {} rows for {} slots", rows.len(), batch.len());
                    let slots: Vec<(usize, TokenId)> = batch.iter().map(|(s, _)| (*s, 0)).collect();
                    self.fail_batch(&slots, &reason);
                }
                Err(e) => {
                    let slots: Vec<(usize, TokenId)> = batch.iter().map(|(s, _)| (*s, 0)).collect();
                    self.fail_batch(&slots, &ErrorChain(&e).to_string());
                }
            }
        }
        true
    }

    /// Applies an environment's answer to `slot`: ends the episode (done, a failure, a
    /// limit) or appends the observation's tokens and returns what to prefill: the
    /// turn's last sampled token (not in the cache yet) and the observation.
    fn observe(
        &mut self,
        slot: usize,
        episode: Option<Box<dyn Episode>>,
        result: std::result::Result<Observation, String>,
    ) -> Option<Vec<TokenId>> {
        let seq = self.slots[slot].as_mut()?;
        let (max_turns, chat_template) =
            seq.request.episodes.as_ref().map_or((1, false), |e| (e.max_turns, e.chat_template));
        let state = seq.episode.as_mut()?;
        let finish = state.call.take()?.finish;
        state.episode = episode;
        let obs = match result {
            Ok(obs) => obs,
            Err(failure) => {
                self.finish_episode(slot, finish, Some(failure));
                return None;
            }
        };
        if obs.done {
            state.reward = obs.reward.filter(|r| r.is_finite());
            self.finish_episode(slot, finish, None);
            return None;
        }
        if state.turns >= max_turns {
            self.finish_episode(slot, finish, Some("max_turns".into()));
            return None;
        }
        let tokenizer = self.shared.tokenizer.as_ref();
        let tokens = match obs.render(tokenizer, chat_template).and_then(|text| tokenizer.encode(&text)) {
            Ok(t) => t,
            Err(e) => {
                self.finish_episode(slot, finish, Some(format!("observation: {}", ErrorChain(&e))));
                return None;
            }
        };
        // Room is needed for the observation and at least one more policy token.
        if seq.generated().len() + tokens.len() >= seq.budget {
            self.finish_episode(slot, Finish::new(FinishReason::Length), Some("max_tokens".into()));
            return None;
        }
        let mut feed = Vec::with_capacity(tokens.len() + 1);
        feed.push(seq.last());
        feed.extend_from_slice(&tokens);
        let start = seq.generated().len();
        seq.context.extend_from_slice(&tokens);
        seq.logprobs.extend(std::iter::repeat_n(0.0, tokens.len()));
        seq.text_checked = 0;
        let state = seq.episode.as_mut()?;
        if !tokens.is_empty() {
            state.observations.push(TokenSpan { start: start as u32, len: tokens.len() as u32 });
        }
        state.turn_start = start + tokens.len();
        Some(feed)
    }

    /// Ends `slot`'s episode, counting a failure.
    fn finish_episode(&mut self, slot: usize, finish: Finish, failure: Option<String>) {
        if let Some(f) = &failure {
            crate::metrics::episode_failed(f);
        }
        self.finish_with(slot, finish, failure);
    }

    /// Ends `slot`'s turn: calls its environment (the slot waits) or, at a turn limit
    /// or the token budget, ends the episode.
    fn end_turn(&mut self, slot: usize, finish: Finish) {
        let Some(seq) = self.slots[slot].as_mut() else { return };
        let Some((limit, max_calls)) =
            seq.request.episodes.as_ref().map(|e| (e.tool_time_limit, e.max_running_calls))
        else {
            return;
        };
        let turn = match self.shared.tokenizer.decode(&seq.generated()[seq.turn_start()..]) {
            Ok(t) => t,
            Err(e) => {
                seq.request.fail(e.into());
                self.release(slot);
                return;
            }
        };
        let Some(state) = seq.episode.as_mut() else { return };
        state.turns += 1;
        let Some(episode) = state.episode.take() else {
            self.finish_episode(slot, finish, Some("tool_error: the episode was lost".into()));
            return;
        };
        let result = spawn_tool_call(episode, turn, &self.shared.tool_calls, max_calls);
        state.call = Some(ToolCall { result, deadline: Instant::now() + limit, finish });
    }

    fn fail_batch(&mut self, batch: &[(usize, TokenId)], reason: &str) {
        for &(slot, _) in batch {
            if let Some(seq) = &self.slots[slot] {
                seq.request.fail(Error::Model(format!("worker {}: {reason}", self.index)));
            }
            self.release(slot);
        }
    }

    /// Samples the next token of `slot` from `logits` and finishes the sequence if it ended.
    fn advance(&mut self, slot: usize, logits: &[f32]) {
        let Some(seq) = self.slots[slot].as_mut() else { return };
        let k = seq.sampled;
        let sampling = &seq.request.sampling;
        let sampled = match self.sampler.sample(sampling, logits, &seq.context, seq.rng.uniform(k)) {
            Ok(s) => s,
            Err(e) => {
                seq.request.fail(e);
                self.release(slot);
                return;
            }
        };
        seq.context.push(sampled.token);
        seq.logprobs.push(sampled.logprob);
        seq.sampled += 1;
        self.shared.counters[self.index].generated_tokens.fetch_add(1, Ordering::Relaxed);
        self.unflushed_tokens += 1;

        let stop = &seq.request.stop;
        let mut finish = None;
        if stop.is_stop_token(sampled.token) {
            finish = Some(Finish::new(FinishReason::Stop));
        } else if !stop.strings.is_empty() {
            match self.shared.tokenizer.decode(&seq.generated()[seq.turn_start()..]) {
                Ok(text) => match stop.find_stop_string(&text, seq.text_checked) {
                    Some((at, len)) => {
                        let keep = if sampling.include_stop_str_in_output { at + len } else { at };
                        finish = Some(Finish { reason: FinishReason::StopString, text_len: Some(keep) });
                    }
                    None => seq.text_checked = text.len(),
                },
                Err(e) => {
                    seq.request.fail(e.into());
                    self.release(slot);
                    return;
                }
            }
        }
        let episode = seq.episode.is_some();
        if episode && let Some(f) = finish {
            // A turn ended: the environment answers it, even at the token budget (a
            // final answer may end there); an observation that does not fit then ends
            // the episode. The text of an episode is never cut at a stop string.
            self.end_turn(slot, Finish { text_len: None, ..f });
            return;
        }
        if finish.is_none() && seq.generated().len() >= seq.budget {
            if episode {
                self.finish_episode(slot, Finish::new(FinishReason::Length), Some("max_tokens".into()));
                return;
            }
            finish = Some(Finish::new(FinishReason::Length));
        }
        if let Some(finish) = finish {
            self.finish(slot, finish);
        }
    }

    fn finish(&mut self, slot: usize, finish: Finish) {
        self.finish_with(slot, finish, None);
    }

    /// Reports `slot`'s response; `failure` (for an episode) says why it ended early.
    fn finish_with(&mut self, slot: usize, finish: Finish, failure: Option<String>) {
        let Some(seq) = self.slots[slot].take() else { return };
        if self.shared.batching == Batching::StaticPadded {
            // The slot's cache holds every token but the last sampled one.
            let held = seq.context.len() - 1;
            self.padding[slot] = Some(Padding { model: Arc::clone(&seq.model), token: seq.last(), held });
        } else {
            self.seq_done(slot);
        }
        let text = match self.shared.tokenizer.decode(seq.generated()) {
            Ok(mut text) => {
                if let Some(n) = finish.text_len {
                    text.truncate(n);
                }
                text
            }
            Err(e) => {
                seq.request.fail(e.into());
                return;
            }
        };
        let completion = Completion {
            sample_index: seq.sample_index,
            tokens: seq.generated().to_vec(),
            logprobs: seq.logprobs,
            text,
            finish_reason: finish.reason,
            version: seq.model.version,
            episode: seq.episode.map(|e| EpisodeTrace {
                observations: e.observations,
                turns: e.turns,
                reward: e.reward,
                failure,
            }),
        };
        self.counters().sequences.fetch_add(1, Ordering::Relaxed);
        self.flush_tokens();
        seq.request.send(Event::Finished { prompt: seq.prompt, completion });
    }

    fn flush_tokens(&mut self) {
        if self.unflushed_tokens > 0 {
            self.tokens_total.increment(std::mem::take(&mut self.unflushed_tokens));
        }
    }

    fn seq_done(&mut self, slot: usize) {
        let model = self.shared.current();
        model.model.free(&mut self.cache, slot);
    }

    /// Drops the sequence (or padding) in `slot` without a completion.
    fn release(&mut self, slot: usize) {
        let seq = self.slots[slot].take().is_some();
        let pad = self.padding[slot].take().is_some();
        if seq || pad {
            self.seq_done(slot);
        }
    }
}
