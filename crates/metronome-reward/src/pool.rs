//! Scoring groups on a worker pool with a per-call time limit and panic isolation.
//!
//! Each completion is one job on a fixed set of OS threads. A watchdog thread holds
//! the deadline of every running job; when one passes, the waiting caller is answered
//! at once with the configured failure score, the worker is written off as *stuck*,
//! and a replacement thread is started so the pool keeps its size.
//!
//! A thread that never returns cannot be killed in Rust, so the bound is explicit:
//! at most `max_stuck_workers` stuck threads get a replacement (the process holds at
//! most `workers + max_stuck_workers` scoring threads). Past that the pool shrinks,
//! and when no live worker is left every call fails fast with the failure score
//! (reason `unavailable`) instead of hanging the run. A stuck scorer that eventually
//! returns gives its thread back: the thread rejoins the pool if it is short of
//! workers and exits otherwise. Panics are caught on the worker with
//! `catch_unwind`; the default panic hook still prints them to stderr.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use metronome_core::{AdvantageEstimator, ErrorChain, Group, GroupScorer, Reward, RewardFn, ScoredGroup};

use crate::{Error, Result, metrics};

/// Configuration of [`WorkerPool`] and [`PoolScorer`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Scoring threads.
    pub workers: usize,
    /// Time limit of one scoring call, in milliseconds, counted from when a worker
    /// starts it (time spent queued does not count).
    pub time_limit_ms: u64,
    /// The score of a completion whose scoring timed out, panicked, returned a
    /// non-finite total, or found no worker.
    pub failure_score: f32,
    /// How many stuck threads get a replacement before the pool starts shrinking.
    pub max_stuck_workers: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self { workers: 4, time_limit_ms: 5_000, failure_score: 0.0, max_stuck_workers: 16 }
    }
}

impl PoolConfig {
    fn check(&self) -> Result<()> {
        if self.workers == 0 {
            return Err(Error::config("pool.workers", "must be at least 1"));
        }
        if self.time_limit_ms == 0 {
            return Err(Error::config("pool.time_limit_ms", "must be positive"));
        }
        if !self.failure_score.is_finite() {
            return Err(Error::config(
                "pool.failure_score",
                format!("must be finite, got {}", self.failure_score),
            ));
        }
        Ok(())
    }
}

/// How one job ended.
#[derive(Debug)]
pub enum Outcome {
    /// The scorer returned.
    Scored(Reward),
    /// The scorer panicked, with the panic message.
    Panicked(String),
    /// The scorer ran past the time limit; its thread is written off.
    TimedOut,
    /// No live worker was left (every one stuck) or the pool shut down.
    Unavailable,
}

/// Counts of what happened in a pool since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Workers taking jobs now.
    pub live: usize,
    /// Threads stuck in a scorer past its time limit now.
    pub stuck: usize,
    /// Jobs that finished (returned or panicked).
    pub completed: u64,
    /// Jobs that panicked.
    pub panics: u64,
    /// Jobs that timed out.
    pub timeouts: u64,
    /// Replacement threads started for stuck ones.
    pub replaced: u64,
    /// Stuck threads that returned and rejoined the pool.
    pub rejoined: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queued,
    Running,
    Done,
    Abandoned,
}

#[derive(Debug)]
struct Ticket {
    state: Mutex<(Phase, Option<oneshot::Sender<Outcome>>)>,
}

impl Ticket {
    fn lock(&self) -> MutexGuard<'_, (Phase, Option<oneshot::Sender<Outcome>>)> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

type Task = Box<dyn FnOnce() -> Reward + Send>;

struct Job {
    task: Task,
    ticket: Arc<Ticket>,
}

struct State {
    queue: VecDeque<Job>,
    running: Vec<(Instant, Arc<Ticket>)>,
    stats: PoolStats,
    shutdown: bool,
    spawned: u64,
}

struct Shared {
    state: Mutex<State>,
    /// Workers wait here for jobs.
    work: Condvar,
    /// The watchdog waits here for new deadlines.
    watch: Condvar,
    target: usize,
    max_stuck: usize,
    limit: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs scoring jobs on OS threads with a time limit per job (see the module docs).
pub struct WorkerPool {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("workers", &self.shared.target)
            .field("limit", &self.shared.limit)
            .field("stats", &self.stats())
            .finish()
    }
}

impl WorkerPool {
    /// Starts `workers` threads and the watchdog.
    pub fn new(workers: usize, time_limit: Duration, max_stuck_workers: usize) -> Result<Self> {
        if workers == 0 {
            return Err(Error::config("pool.workers", "must be at least 1"));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                running: Vec::new(),
                stats: PoolStats::default(),
                shutdown: false,
                spawned: 0,
            }),
            work: Condvar::new(),
            watch: Condvar::new(),
            target: workers,
            max_stuck: max_stuck_workers,
            limit: time_limit,
        });
        // From here on, dropping `pool` (also on an error below) stops the threads started so far.
        let pool = Self { shared };
        {
            let mut state = pool.shared.lock();
            for _ in 0..workers {
                spawn_worker(&pool.shared, &mut state).map_err(Error::Spawn)?;
            }
        }
        let watchdog = Arc::clone(&pool.shared);
        std::thread::Builder::new()
            .name("metronome-reward-watchdog".into())
            .spawn(move || watch(&watchdog))
            .map_err(Error::Spawn)?;
        Ok(pool)
    }

    /// Queues `task`; the receiver yields its outcome (await it, or `blocking_recv`
    /// outside an async context). A dropped sender means the pool shut down.
    pub fn submit(&self, task: impl FnOnce() -> Reward + Send + 'static) -> oneshot::Receiver<Outcome> {
        let (tx, rx) = oneshot::channel();
        let mut state = self.shared.lock();
        if state.shutdown || state.stats.live == 0 {
            let _ = tx.send(Outcome::Unavailable);
            return rx;
        }
        let ticket = Arc::new(Ticket { state: Mutex::new((Phase::Queued, Some(tx))) });
        state.queue.push_back(Job { task: Box::new(task), ticket });
        drop(state);
        self.shared.work.notify_one();
        rx
    }

    /// What happened so far.
    #[must_use]
    pub fn stats(&self) -> PoolStats {
        self.shared.lock().stats
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.shutdown = true;
        // Dropping queued jobs drops their senders: waiting callers see `Unavailable`.
        state.queue.clear();
        drop(state);
        self.shared.work.notify_all();
        self.shared.watch.notify_all();
    }
}

fn spawn_worker(shared: &Arc<Shared>, state: &mut State) -> std::io::Result<()> {
    let id = state.spawned;
    let worker = Arc::clone(shared);
    std::thread::Builder::new().name(format!("metronome-reward-{id}")).spawn(move || work(&worker))?;
    state.spawned += 1;
    state.stats.live += 1;
    Ok(())
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

fn work(shared: &Arc<Shared>) {
    let mut state = shared.lock();
    loop {
        let job = loop {
            if state.shutdown {
                state.stats.live -= 1;
                return;
            }
            if let Some(job) = state.queue.pop_front() {
                break job;
            }
            state = shared.work.wait(state).unwrap_or_else(PoisonError::into_inner);
        };
        // Deadlines share one limit, so a new one is never earlier than those the
        // watchdog already sleeps towards: it needs waking only when it had none.
        let watchdog_idle = state.running.is_empty();
        state.running.push((Instant::now() + shared.limit, Arc::clone(&job.ticket)));
        job.ticket.lock().0 = Phase::Running;
        drop(state);
        if watchdog_idle {
            shared.watch.notify_one();
        }

        let outcome = match catch_unwind(AssertUnwindSafe(job.task)) {
            Ok(reward) => Outcome::Scored(reward),
            Err(payload) => Outcome::Panicked(panic_message(payload.as_ref())),
        };
        let panicked = matches!(outcome, Outcome::Panicked(_));
        let abandoned = {
            let mut ticket = job.ticket.lock();
            if ticket.0 == Phase::Abandoned {
                true
            } else {
                ticket.0 = Phase::Done;
                if let Some(tx) = ticket.1.take() {
                    // The caller may have gone away (cancelled); nothing to tell then.
                    let _ = tx.send(outcome);
                }
                false
            }
        };

        state = shared.lock();
        state.running.retain(|(_, t)| !Arc::ptr_eq(t, &job.ticket));
        state.stats.completed += 1;
        state.stats.panics += u64::from(panicked);
        if abandoned {
            // The watchdog counted this thread as stuck and possibly replaced it.
            state.stats.stuck -= 1;
            metrics::stuck_workers(state.stats.stuck);
            if state.shutdown || state.stats.live >= shared.target {
                return;
            }
            state.stats.live += 1;
            state.stats.rejoined += 1;
        }
    }
}

fn watch(shared: &Arc<Shared>) {
    let mut state = shared.lock();
    loop {
        if state.shutdown {
            return;
        }
        let now = Instant::now();
        let mut expired = Vec::new();
        state.running.retain(|(deadline, ticket)| {
            if *deadline <= now {
                expired.push(Arc::clone(ticket));
                false
            } else {
                true
            }
        });
        for ticket in expired {
            let mut t = ticket.lock();
            if t.0 != Phase::Running {
                continue;
            }
            t.0 = Phase::Abandoned;
            if let Some(tx) = t.1.take() {
                let _ = tx.send(Outcome::TimedOut);
            }
            drop(t);
            state.stats.timeouts += 1;
            state.stats.live -= 1;
            state.stats.stuck += 1;
            if state.stats.stuck <= shared.max_stuck {
                match spawn_worker(shared, &mut state) {
                    Ok(()) => state.stats.replaced += 1,
                    Err(e) => {
                        tracing::error!(error = %ErrorChain(&e), "reward pool could not replace a stuck worker");
                    }
                }
            } else {
                tracing::warn!(stuck = state.stats.stuck, "reward pool past max_stuck_workers; it shrinks");
            }
            metrics::stuck_workers(state.stats.stuck);
        }
        if state.stats.live == 0 {
            // Nobody will ever take these jobs: answer them now instead of hanging.
            for job in state.queue.drain(..) {
                if let Some(tx) = job.ticket.lock().1.take() {
                    let _ = tx.send(Outcome::Unavailable);
                }
            }
        }
        let next = state.running.iter().map(|(d, _)| *d).min();
        state = match next {
            Some(deadline) => {
                let wait = deadline.saturating_duration_since(Instant::now());
                shared.watch.wait_timeout(state, wait).unwrap_or_else(PoisonError::into_inner).0
            }
            None => shared.watch.wait(state).unwrap_or_else(PoisonError::into_inner),
        };
    }
}

/// A [`GroupScorer`] that scores every completion of a group in parallel on a
/// [`WorkerPool`], turns timeouts, panics and non-finite totals into the configured
/// failure score (counted in `metronome_reward_failures_total{reason}`), and computes
/// advantages with its estimator ([`PoolScorer::with_estimator`]; GRPO's by default).
/// Scores come back in completion order.
pub struct PoolScorer {
    scorer: Arc<dyn RewardFn>,
    pool: WorkerPool,
    config: PoolConfig,
    estimator: AdvantageEstimator,
}

impl std::fmt::Debug for PoolScorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolScorer")
            .field("pool", &self.pool)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl PoolScorer {
    /// Starts a pool for `scorer`.
    pub fn new(scorer: impl RewardFn + 'static, config: PoolConfig) -> Result<Self> {
        Self::from_arc(Arc::new(scorer), config)
    }

    /// Starts a pool for a shared scorer.
    pub fn from_arc(scorer: Arc<dyn RewardFn>, config: PoolConfig) -> Result<Self> {
        config.check()?;
        let pool = WorkerPool::new(
            config.workers,
            Duration::from_millis(config.time_limit_ms),
            config.max_stuck_workers,
        )?;
        Ok(Self { scorer, pool, config, estimator: AdvantageEstimator::default() })
    }

    /// Computes advantages with `estimator`. Not a key of [`PoolConfig`]: a run has
    /// one estimator, and it is the trainer's (`trainer.advantage` in a pipeline
    /// config).
    #[must_use]
    pub fn with_estimator(mut self, estimator: AdvantageEstimator) -> Self {
        self.estimator = estimator;
        self
    }

    /// The pool's counters.
    #[must_use]
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    fn submit(&self, group: &Arc<Group>) -> Vec<oneshot::Receiver<Outcome>> {
        (0..group.completions.len())
            .map(|i| {
                let (group, scorer) = (Arc::clone(group), Arc::clone(&self.scorer));
                self.pool.submit(move || {
                    let c = &group.completions[i];
                    // An environment that rewarded its episode has the last word; an
                    // episode without one is scored like any completion.
                    match c.episode.as_ref().and_then(|e| e.reward) {
                        Some(r) => Reward::scalar(r).with_correct(r),
                        None => scorer.score(&group.prompt, c),
                    }
                })
            })
            .collect()
    }

    fn finish(
        &self,
        group: Arc<Group>,
        outcomes: Vec<Outcome>,
        started: Instant,
    ) -> metronome_core::Result<ScoredGroup> {
        let rewards: Vec<Reward> = outcomes.into_iter().map(|o| self.reward_of(o)).collect();
        // A stuck job still holds its clone of the group; copy it out in that case.
        let group = Arc::try_unwrap(group).unwrap_or_else(|shared| (*shared).clone());
        metrics::group_scored(rewards.len(), started.elapsed());
        ScoredGroup::new(group, rewards, self.estimator)
    }

    fn reward_of(&self, outcome: Outcome) -> Reward {
        let fail = self.config.failure_score;
        let (reward, reason) = match outcome {
            Outcome::Scored(r) if !r.total.is_finite() => (
                Reward::failed(fail, format!("scorer returned the non-finite total {}", r.total)),
                Some("non_finite"),
            ),
            Outcome::Scored(r) => {
                let reason = r.failure.is_some().then_some("scorer");
                (r, reason)
            }
            Outcome::Panicked(msg) => {
                (Reward::failed(fail, format!("scorer panicked: {msg}")), Some("panic"))
            }
            Outcome::TimedOut => (
                Reward::failed(
                    fail,
                    format!("scorer exceeded its time limit of {} ms", self.config.time_limit_ms),
                ),
                Some("timeout"),
            ),
            Outcome::Unavailable => (
                Reward::failed(fail, "no reward worker available (all stuck or shut down)"),
                Some("unavailable"),
            ),
        };
        if let Some(reason) = reason {
            metrics::failure(reason, 1);
        }
        reward
    }

    /// Scores a group from synchronous code (not from inside an async runtime).
    pub fn score_blocking(&self, group: Group) -> metronome_core::Result<ScoredGroup> {
        let started = Instant::now();
        let group = Arc::new(group);
        let outcomes = self
            .submit(&group)
            .into_iter()
            .map(|rx| rx.blocking_recv().unwrap_or(Outcome::Unavailable))
            .collect();
        self.finish(group, outcomes, started)
    }
}

#[async_trait]
impl GroupScorer for PoolScorer {
    async fn score(&self, group: Group) -> metronome_core::Result<ScoredGroup> {
        let started = Instant::now();
        let group = Arc::new(group);
        let receivers = self.submit(&group);
        let mut outcomes = Vec::with_capacity(receivers.len());
        for rx in receivers {
            outcomes.push(rx.await.unwrap_or(Outcome::Unavailable));
        }
        self.finish(group, outcomes, started)
    }
}
