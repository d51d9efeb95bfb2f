//! [`PromptLoader`]: the [`PromptSource`] that releases one batch per period, with
//! the next batch prepared in the background.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, mpsc};
use std::time::Instant;

use async_trait::async_trait;
use metronome_core::{Cursor, PromptBatch, PromptSource, RunSeed, Tokenizer};
use tokio::sync::oneshot;
use tokio::sync::oneshot::error::TryRecvError;

use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::file::LoadReport;
use crate::plan::{Planned, Planner, ReleaseConfig};
use crate::render::{PromptConfig, Renderer};

/// Counters since the loader was built (they are not part of the cursor).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoaderStats {
    /// Batches released.
    pub batches: u64,
    /// Prompts released.
    pub prompts: u64,
    /// Prompt tokens released.
    pub tokens: u64,
    /// Prompts skipped because they were longer than the maximum.
    pub skipped_too_long: u64,
    /// Batches released with fewer than `batch_size` prompts because the next prompt
    /// was already in them (a batch crossing an epoch boundary; a period never holds
    /// a prompt twice).
    pub cut_short: u64,
    /// Batches that had already been prepared when they were asked for.
    pub prefetched_ready: u64,
}

/// A request to the planning thread: the cursor to plan from, and where to answer.
type Job = (Cursor, oneshot::Sender<Result<Planned>>);

/// Starts the loader's planning thread. Planning reads and tokenises, which must not
/// block the async runtime that awaits the result; a plain thread keeps the loader
/// independent of which runtime that is, and one long-lived thread avoids a thread
/// start per period. It exits when the loader (the job sender) is dropped. A panic in
/// planning (a bug in a dataset or tokenizer) becomes an error for that batch and the
/// thread lives on.
fn start_worker(planner: Arc<Planner>) -> Option<mpsc::Sender<Job>> {
    let (jobs, queue) = mpsc::channel::<Job>();
    let worker = move || {
        for (from, reply) in queue {
            if reply.is_closed() {
                // Superseded by a restore before it started.
                continue;
            }
            let planned =
                std::panic::catch_unwind(AssertUnwindSafe(|| planner.plan(from))).unwrap_or_else(|panic| {
                    let message = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".to_owned());
                    Err(Error::PlanningPanicked { period: from.period.0, message })
                });
            let _ = reply.send(planned);
        }
    };
    match std::thread::Builder::new().name("metronome-dataloader".into()).spawn(worker) {
        Ok(_) => Some(jobs),
        Err(error) => {
            tracing::error!(target: "metronome_dataloader", "cannot start the batch planning thread: {error}");
            None
        }
    }
}

/// A batch being planned on the planning thread, from cursor `from`.
#[derive(Debug)]
struct Pending {
    from: Cursor,
    result: oneshot::Receiver<Result<Planned>>,
}

/// Releases one batch of `B` prompts per period from a [`Dataset`], tokenised through
/// the model's [`Tokenizer`], in a shuffled order derived from the run seed, and can
/// resume exactly from a saved [`Cursor`].
///
/// Batches are planned on the loader's own thread. With prefetching on, the batch of
/// period `k + 1` is read, rendered and tokenised there as soon as batch `k` is released, so `next_batch` at the
/// start of the next period usually returns at once. Prefetching never changes what
/// is released: a batch is a pure function of the cursor.
#[derive(Debug)]
pub struct PromptLoader {
    planner: Arc<Planner>,
    jobs: Option<mpsc::Sender<Job>>,
    cursor: Cursor,
    pending: Option<Pending>,
    stats: LoaderStats,
    load_report: Option<LoadReport>,
}

impl PromptLoader {
    /// A loader over `dataset` at the start of epoch 0 (period 0). With prefetching on,
    /// the first batch starts being prepared at once.
    pub fn new(
        dataset: Arc<dyn Dataset>,
        tokenizer: Arc<dyn Tokenizer>,
        seed: RunSeed,
        release: ReleaseConfig,
        prompt: PromptConfig,
    ) -> Result<Self> {
        release.validate()?;
        prompt.validate()?;
        if dataset.is_empty() {
            return Err(Error::config("source", format!("the dataset {dataset:?} has no records")));
        }
        if release.batch_size > dataset.len() {
            // Legitimate for one pass over a small evaluation set; in training, every
            // period then holds the whole dataset once (a period never holds a prompt
            // twice), which is probably not what was meant.
            tracing::warn!(
                target: "metronome_dataloader",
                "release.batch_size is {}, but the dataset has only {} prompts: every batch holds each prompt once",
                release.batch_size,
                dataset.len()
            );
        }
        let planner = Arc::new(Planner::new(dataset, Renderer::new(tokenizer, prompt), seed, release));
        let mut loader = Self {
            jobs: start_worker(Arc::clone(&planner)),
            planner,
            cursor: Cursor::default(),
            pending: None,
            stats: LoaderStats::default(),
            load_report: None,
        };
        loader.prefetch();
        Ok(loader)
    }

    /// Attaches the report of the file the dataset was read from.
    #[must_use]
    pub fn with_load_report(mut self, report: LoadReport) -> Self {
        self.load_report = Some(report);
        self
    }

    /// The report of the file the dataset was read from, if it came from a file.
    #[must_use]
    pub fn load_report(&self) -> Option<&LoadReport> {
        self.load_report.as_ref()
    }

    /// The dataset.
    #[must_use]
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        self.planner.dataset()
    }

    /// Counters since the loader was built.
    #[must_use]
    pub fn stats(&self) -> LoaderStats {
        self.stats
    }

    /// The next batch, as [`PromptSource::next_batch`] but with this crate's error.
    pub async fn next(&mut self) -> Result<Option<PromptBatch>> {
        let started = Instant::now();
        let (Pending { from, mut result }, prefetched) = match self.pending.take() {
            Some(pending) if pending.from == self.cursor => (pending, true),
            _ => (self.spawn(self.cursor), false),
        };
        let lost = || Error::PrefetchLost { period: from.period.0 };
        let planned = match result.try_recv() {
            Ok(planned) => {
                self.stats.prefetched_ready += u64::from(prefetched);
                planned
            }
            Err(TryRecvError::Empty) => result.await.map_err(|_| lost())?,
            // The thread is gone without an answer (it panicked, or never started);
            // the receiver is spent, so do not await it.
            Err(TryRecvError::Closed) => return Err(lost()),
        };
        crate::metrics::batch_waited(started.elapsed());
        let planned = planned?;
        self.account(&planned);
        self.cursor = planned.next;
        if planned.batch.is_some() {
            self.prefetch();
        }
        Ok(planned.batch)
    }

    /// Restores a saved position, as [`PromptSource::restore`] but with this crate's
    /// error. A batch prepared for the old position is discarded.
    pub fn seek(&mut self, cursor: Cursor) -> Result<()> {
        self.cursor = self.planner.check(cursor)?;
        self.pending = None;
        self.prefetch();
        Ok(())
    }

    fn prefetch(&mut self) {
        if self.planner.release().prefetch && self.pending.is_none() {
            self.pending = Some(self.spawn(self.cursor));
        }
    }

    /// Asks the planning thread for the batch at `from`. A thread that could not be
    /// started is retried here; if it still cannot start, the receiver reports it
    /// closed and `next` returns an error.
    fn spawn(&mut self, from: Cursor) -> Pending {
        let (reply, result) = oneshot::channel();
        let mut job = (from, reply);
        if let Some(jobs) = &self.jobs {
            match jobs.send(job) {
                Ok(()) => return Pending { from, result },
                Err(mpsc::SendError(returned)) => job = returned,
            }
        }
        self.jobs = start_worker(Arc::clone(&self.planner));
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
        Pending { from, result }
    }

    fn account(&mut self, planned: &Planned) {
        if !planned.too_long.is_empty() {
            // One line per batch, every id in it: a run with many long prompts would
            // otherwise log a line per prompt per epoch.
            let skipped: Vec<String> = planned
                .too_long
                .iter()
                .map(|(id, place, tokens)| format!("{id} ({place}, {tokens} tokens)"))
                .collect();
            tracing::warn!(
                target: "metronome_dataloader",
                "skipped {} prompts over the token limit: {}",
                skipped.len(),
                skipped.join(", ")
            );
        }
        let skipped = planned.too_long.len() as u64;
        self.stats.skipped_too_long += skipped;
        if skipped > 0 {
            crate::metrics::prompts_skipped("too_long", skipped);
        }
        if planned.cut_short {
            self.stats.cut_short += 1;
            crate::metrics::batch_cut_short();
        }
        if let Some(batch) = &planned.batch {
            let tokens: u64 = batch.prompts.iter().map(|p| p.tokens.len() as u64).sum();
            self.stats.batches += 1;
            self.stats.prompts += batch.prompts.len() as u64;
            self.stats.tokens += tokens;
            crate::metrics::batch_released(batch.prompts.len() as u64, tokens);
        }
        crate::metrics::epoch(planned.next.epoch);
    }
}

#[async_trait]
impl PromptSource for PromptLoader {
    async fn next_batch(&mut self) -> metronome_core::Result<Option<PromptBatch>> {
        Ok(self.next().await?)
    }

    fn cursor(&self) -> Cursor {
        self.cursor
    }

    fn restore(&mut self, cursor: Cursor) -> metronome_core::Result<()> {
        Ok(self.seek(cursor)?)
    }
}
