//! What the engine and its workers share: the queue of pending responses, the
//! installed weights with their version, and each worker's counters.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Instant;

use metronome_core::{Completion, PolicyVersion, Prompt, RunSeed, Tokenizer};
use tokio::sync::mpsc;

use super::Episodes;
use crate::stop::StopConditions;
use crate::{Batching, Error, PartialCache, SamplingConfig};

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

/// The atomics behind [`WorkerStats`], written by the worker.
#[derive(Debug, Default)]
pub(super) struct WorkerCounters {
    pub(super) active_slots: AtomicU64,
    pub(super) generated_tokens: AtomicU64,
    pub(super) decode_steps: AtomicU64,
    pub(super) decode_rows: AtomicU64,
    pub(super) padding_rows: AtomicU64,
    pub(super) sequences: AtomicU64,
}

impl WorkerCounters {
    pub(super) fn snapshot(&self) -> WorkerStats {
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
pub(super) struct Versioned<M> {
    pub(super) version: PolicyVersion,
    pub(super) model: M,
    /// Built by the engine's [`crate::WeightLoader`] (not handed in), so the loader may
    /// write the next weights into it ([`crate::WeightLoader::reload`]).
    pub(super) loaded: bool,
}

/// What workers report to a request's assembler.
pub(super) enum Event {
    Started { prompt: usize, at_s: f64 },
    Finished { prompt: usize, completion: Completion },
    Failed(Error),
}

/// A submitted request as the workers see it.
pub(super) struct Request {
    pub(super) prompts: Vec<Prompt>,
    pub(super) sampling: SamplingConfig,
    pub(super) stop: StopConditions,
    pub(super) seed: RunSeed,
    pub(super) episodes: Option<Episodes>,
    pub(super) events: mpsc::UnboundedSender<Event>,
    pub(super) cancelled: Arc<AtomicBool>,
    pub(super) start: Instant,
}

impl Request {
    pub(super) fn send(&self, event: Event) {
        // A closed channel means the assembler is gone (cancelled); nothing to report to.
        let _ = self.events.send(event);
    }

    pub(super) fn fail(&self, e: Error) {
        self.cancelled.store(true, Ordering::Relaxed);
        self.send(Event::Failed(e));
    }

    pub(super) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }
}

/// One pending response.
pub(super) struct Job {
    pub(super) request: Arc<Request>,
    pub(super) prompt: usize,
    pub(super) sample_index: u32,
}

/// The pending responses of every request, in submission order.
#[derive(Default)]
pub(super) struct Queue {
    pub(super) pending: VecDeque<Job>,
    pub(super) shutdown: bool,
}

/// What the engine and its workers share.
/// A worker's KV-cache pool: its blocks, of `block` positions each.
#[derive(Clone, Copy, Debug)]
pub(super) struct CachePool {
    pub(super) block: usize,
    pub(super) blocks: usize,
}

pub(super) struct Shared<M> {
    pub(super) queue: Mutex<Queue>,
    pub(super) wake: Condvar,
    pub(super) current: RwLock<Arc<Versioned<M>>>,
    pub(super) counters: Vec<WorkerCounters>,
    pub(super) tokenizer: Arc<dyn Tokenizer>,
    /// Environment calls running now (hung ones included), engine-wide.
    pub(super) tool_calls: Arc<AtomicU64>,
    pub(super) max_num_seqs: usize,
    pub(super) max_seq_len: usize,
    /// Each worker's KV-cache pool (`rollout.kv_cache_tokens`); `None` when every slot
    /// has room for `max_seq_len`.
    pub(super) pool: Option<CachePool>,
    pub(super) batching: Batching,
    /// Running responses continue under newly installed weights (partial rollouts),
    /// their caches rebuilt or kept: `None` when they finish with their own.
    pub(super) partial_rollouts: Option<PartialCache>,
}

impl<M> Shared<M> {
    pub(super) fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn current(&self) -> Arc<Versioned<M>> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }
}
