//! The deterministic heart of the loader: from a cursor to the next batch.
//!
//! Planning is a pure function of (dataset, tokenizer, run seed, configuration,
//! cursor). That is what makes resuming exact: a restored cursor plans the same batch
//! the uninterrupted run planned, and prefetching is safe because a batch planned
//! ahead is the batch that would have been planned on demand.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use metronome_core::{Cursor, PeriodId, Prompt, PromptBatch, PromptId, RunSeed};
use serde::{Deserialize, Serialize};

use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::render::{Rendered, Renderer};
use crate::rng::epoch_order;

/// How prompts are released: batch size, epochs, shuffling, prefetching.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReleaseConfig {
    /// Prompts per period (`B`).
    pub batch_size: usize,
    /// Epochs to serve; `None` serves forever.
    pub epochs: Option<u64>,
    /// Shuffle each epoch with a permutation derived from the run seed and the epoch.
    pub shuffle: bool,
    /// With a finite number of epochs, drop the last batch when it is not full.
    pub drop_last: bool,
    /// Prepare (read, render, tokenise) the next period's batch on a background thread
    /// while the current period runs.
    pub prefetch: bool,
}

impl Default for ReleaseConfig {
    fn default() -> Self {
        Self { batch_size: 8, epochs: None, shuffle: true, drop_last: false, prefetch: true }
    }
}

impl ReleaseConfig {
    /// Checks the values; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(Error::config("release.batch_size", "must be at least 1"));
        }
        if self.epochs == Some(0) {
            return Err(Error::config("release.epochs", "must be at least 1 (or unset to serve forever)"));
        }
        Ok(())
    }
}

/// A planned batch and where the cursor goes after it.
#[derive(Debug)]
pub(crate) struct Planned {
    /// The batch; `None` when the configured epochs are served.
    pub(crate) batch: Option<PromptBatch>,
    /// The cursor after releasing `batch`.
    pub(crate) next: Cursor,
    /// Prompts skipped as too long while forming the batch: id, place, tokens.
    pub(crate) too_long: Vec<(PromptId, String, usize)>,
    /// The batch ended before `batch_size` prompts because the next one was already
    /// in it (see [`Planner::plan`]).
    pub(crate) cut_short: bool,
}

/// Plans batches; shared with the prefetch thread.
#[derive(Debug)]
pub(crate) struct Planner {
    dataset: Arc<dyn Dataset>,
    renderer: Renderer,
    seed: RunSeed,
    release: ReleaseConfig,
    /// The release order of the most recent epoch, so a batch costs O(B), not O(N).
    order: Mutex<Option<(u64, Arc<Vec<usize>>)>>,
}

impl Planner {
    pub(crate) fn new(
        dataset: Arc<dyn Dataset>,
        renderer: Renderer,
        seed: RunSeed,
        release: ReleaseConfig,
    ) -> Self {
        Self { dataset, renderer, seed, release, order: Mutex::new(None) }
    }

    pub(crate) fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    pub(crate) fn release(&self) -> &ReleaseConfig {
        &self.release
    }

    fn order(&self, epoch: u64) -> Arc<Vec<usize>> {
        let mut cached = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        match &*cached {
            Some((e, order)) if *e == epoch => Arc::clone(order),
            _ => {
                let order = Arc::new(epoch_order(self.seed, epoch, self.dataset.len(), self.release.shuffle));
                *cached = Some((epoch, Arc::clone(&order)));
                order
            }
        }
    }

    fn exhausted(&self, epoch: u64) -> bool {
        self.release.epochs.is_some_and(|epochs| epoch >= epochs)
    }

    /// Checks that `cursor` fits this dataset and configuration and returns it in
    /// canonical form (an offset at the end of an epoch becomes the next epoch's start).
    pub(crate) fn check(&self, cursor: Cursor) -> Result<Cursor> {
        let len = self.dataset.len() as u64;
        let bad = |reason: String| Error::Cursor {
            cursor: format!("{}/{}/{}", cursor.period, cursor.epoch, cursor.offset),
            reason,
        };
        if cursor.offset > len {
            return Err(bad(format!("offset is past the end of an epoch of {len} prompts")));
        }
        let canonical = if cursor.offset == len {
            Cursor { epoch: cursor.epoch + 1, offset: 0, ..cursor }
        } else {
            cursor
        };
        if let Some(epochs) = self.release.epochs
            && (canonical.epoch > epochs || (canonical.epoch == epochs && canonical.offset > 0))
        {
            return Err(bad(format!("is beyond the {epochs} configured epochs")));
        }
        Ok(canonical)
    }

    /// The batch released at `from`, and the cursor after it.
    ///
    /// A batch never holds the same prompt id twice: a period's groups are identified
    /// by (period, prompt id), so a repeat would be taken for a redelivery and dropped,
    /// and the trainer would wait for it forever. A batch that crosses an epoch
    /// boundary and meets, in the next epoch's order, a prompt it already holds ends
    /// there, one period short of `batch_size` prompts; that prompt opens the next
    /// batch. Every prompt is still served exactly once per epoch.
    pub(crate) fn plan(&self, from: Cursor) -> Result<Planned> {
        let len = self.dataset.len();
        let mut cursor = self.check(from)?;
        let batch_size = self.release.batch_size;
        let mut prompts: Vec<Prompt> = Vec::with_capacity(batch_size);
        let mut ids: HashSet<PromptId> = HashSet::with_capacity(batch_size);
        let mut too_long = Vec::new();
        let mut cut_short = false;
        let mut skipped_in_a_row = 0usize;
        while prompts.len() < batch_size && !self.exhausted(cursor.epoch) {
            let before = cursor;
            let index = self.order(cursor.epoch)[cursor.offset as usize];
            cursor.offset += 1;
            if cursor.offset as usize == len {
                cursor = Cursor { epoch: cursor.epoch + 1, offset: 0, ..cursor };
            }
            // The place is only formatted when a message needs it.
            let place = || self.dataset.place(index);
            match self.renderer.render(self.dataset.record(index)?, place)? {
                Rendered::Fits(prompt) if !ids.insert(prompt.id) => {
                    cursor = before;
                    cut_short = true;
                    break;
                }
                Rendered::Fits(prompt) => {
                    prompts.push(prompt);
                    skipped_in_a_row = 0;
                }
                Rendered::TooLong { id, tokens } => {
                    too_long.push((id, place(), tokens));
                    skipped_in_a_row += 1;
                    // A whole epoch without a prompt that fits would loop forever.
                    if skipped_in_a_row >= len {
                        return Err(Error::NothingFits { len, max: self.renderer.max_tokens().unwrap_or(0) });
                    }
                }
            }
        }
        let full = prompts.len() == batch_size || cut_short;
        if prompts.is_empty() || (!full && self.release.drop_last) {
            let next = Cursor { period: from.period, ..cursor };
            return Ok(Planned { batch: None, next, too_long, cut_short });
        }
        let batch = PromptBatch { period: from.period, prompts };
        let next = Cursor { period: PeriodId(from.period.0 + 1), ..cursor };
        Ok(Planned { batch: Some(batch), next, too_long, cut_short })
    }
}
