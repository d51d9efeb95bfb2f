//! When a cache's decode steps replay a captured CUDA graph, capture one, or run op by
//! op, and what a failed capture costs: the policy of `src/cuda/graph.rs`, apart from
//! CUDA so that CI tests it (the capture and the replay are closures here).

use std::collections::HashMap;

use crate::Result;
use crate::kv_cache::DecodeGraphStats;

/// Graphs one cache keeps at most (one per row count); more drops them all.
const MAX_GRAPHS: usize = 8;
/// Failed captures in a row after which a cache stops trying.
const MAX_FAILURES: u32 = 4;

/// A cache's captured steps `G`, one per row count, with the stats of what they did.
pub(crate) struct Replays<G> {
    steps: HashMap<usize, G>,
    /// The weights the steps read (an identity of the stacked decode weights).
    weights: u64,
    /// The row count of the last step run op by op: a count seen twice in a row is
    /// captured (a step count that changes every step is not worth a capture).
    last_rows: Option<usize>,
    /// Failed captures since the last success.
    failures_in_a_row: u32,
    stats: DecodeGraphStats,
}

impl<G> Default for Replays<G> {
    fn default() -> Self {
        Self {
            steps: HashMap::new(),
            weights: 0,
            last_rows: None,
            failures_in_a_row: 0,
            stats: DecodeGraphStats::default(),
        }
    }
}

impl<G> std::fmt::Debug for Replays<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replays")
            .field("row_counts", &self.steps.keys().collect::<Vec<_>>())
            .field("stats", &self.stats)
            .finish()
    }
}

impl<G> Replays<G> {
    pub(crate) fn stats(&self) -> DecodeGraphStats {
        self.stats.clone()
    }

    /// Drops every captured step.
    pub(crate) fn clear(&mut self) {
        self.steps.clear();
        self.last_rows = None;
    }

    /// A step of `n` rows on `weights`: `replay`ed when one was captured for `n` and
    /// these weights; captured (and run) by `capture` when `n` was also the last step's
    /// row count; otherwise `None`, and the caller runs it op by op. A replay's error is
    /// the step's; a capture's is counted (`None` then too), the count is tried again
    /// two steps of it later, and after four failures in a row no more are tried.
    pub(crate) fn run<T>(
        &mut self,
        n: usize,
        weights: u64,
        replay: impl FnOnce(&G) -> Result<T>,
        capture: impl FnOnce() -> Result<(G, T)>,
    ) -> Result<Option<T>> {
        if self.stats.given_up {
            return Ok(None);
        }
        if self.weights != weights {
            self.clear();
            self.weights = weights;
        }
        if let Some(step) = self.steps.get(&n) {
            let out = replay(step)?;
            self.stats.replayed += 1;
            return Ok(Some(out));
        }
        if self.last_rows.replace(n) != Some(n) {
            return Ok(None);
        }
        if self.steps.len() >= MAX_GRAPHS {
            self.steps.clear();
        }
        match capture() {
            Ok((step, out)) => {
                self.failures_in_a_row = 0;
                self.stats.captured += 1;
                self.stats.replayed += 1;
                self.steps.insert(n, step);
                Ok(Some(out))
            }
            Err(e) => {
                self.failures_in_a_row += 1;
                self.stats.failed += 1;
                self.stats.last_error = Some(e.to_string());
                self.stats.given_up = self.failures_in_a_row >= MAX_FAILURES;
                if self.stats.failed == 1 || self.stats.given_up {
                    tracing::warn!(
                        rows = n,
                        given_up = self.stats.given_up,
                        "a decode step's CUDA graph capture failed, the step ran op by op: {e}"
                    );
                }
                self.last_rows = None;
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// One step of `n` rows: `Some(true)` replayed, `Some(false)` captured, `None` op by
    /// op; `fail` makes its capture fail.
    fn step(r: &mut Replays<u32>, n: usize, weights: u64, fail: bool) -> Option<bool> {
        r.run(
            n,
            weights,
            |_| Ok(true),
            || if fail { Err(Error::invalid("capture", "refused")) } else { Ok((7, false)) },
        )
        .unwrap()
    }

    /// A count is captured the second time in a row and replayed after; new weights
    /// drop the captures; another count is captured on its own.
    #[test]
    fn a_row_count_seen_twice_is_captured_then_replayed_until_the_weights_change() {
        let mut r = Replays::default();
        let seq: Vec<_> = [(3, 1), (3, 1), (3, 1), (2, 1), (2, 1), (3, 1), (3, 2), (3, 2), (3, 2)]
            .into_iter()
            .map(|(n, w)| step(&mut r, n, w, false))
            .collect();
        let want =
            [None, Some(false), Some(true), None, Some(false), Some(true), None, Some(false), Some(true)];
        assert_eq!(seq, want);
        let s = r.stats();
        assert_eq!((s.captured, s.replayed, s.failed, s.given_up), (3, 6, 0, false));
    }

    /// A failed capture runs the step op by op, is counted with its error and retried
    /// two steps of its count later; a success resets the run of failures; four in a
    /// row and the cache stops trying, also for counts it never captured.
    #[test]
    fn failed_captures_run_op_by_op_are_retried_and_four_in_a_row_give_up() {
        let mut r = Replays::default();
        assert_eq!(step(&mut r, 5, 1, true), None);
        assert_eq!(step(&mut r, 5, 1, true), None, "the failed capture");
        assert_eq!(r.stats().failed, 1);
        assert!(r.stats().last_error.is_some_and(|e| e.contains("refused")), "{:?}", r.stats());
        assert_eq!(step(&mut r, 5, 1, true), None, "op by op: the count starts over");
        assert_eq!(step(&mut r, 5, 1, false), Some(false), "retried, captured");
        assert_eq!(step(&mut r, 5, 1, false), Some(true));
        for _ in 0..4 {
            assert_eq!(step(&mut r, 6, 1, true), None);
            assert_eq!(step(&mut r, 6, 1, true), None);
        }
        let s = r.stats();
        assert_eq!((s.failed, s.given_up), (5, true), "{s:?}");
        assert_eq!(step(&mut r, 5, 1, false), None, "given up: not even a replay");
        assert_eq!(step(&mut r, 7, 1, false), None);
        assert_eq!(r.stats().captured, 1);
    }

    /// A replay's error is the step's, not a failed capture.
    #[test]
    fn a_replay_error_is_returned() {
        let mut r = Replays::default();
        step(&mut r, 2, 1, false);
        step(&mut r, 2, 1, false);
        let e = r.run(2, 1, |_| Err::<bool, _>(Error::invalid("launch", "lost")), || Ok((1, false)));
        assert!(e.unwrap_err().to_string().contains("lost"));
        assert_eq!(r.stats().failed, 0);
    }
}
