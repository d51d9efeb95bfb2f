//! A tiny seeded generator and the epoch shuffle.
//!
//! The data loader's randomness is part of its resumability contract: a cursor saved
//! by one build must reproduce the same order in the next. So it uses a fixed,
//! documented algorithm (SplitMix64 via [`metronome_core::mix64`], Lemire's unbiased
//! bounded integers, Fisher–Yates) rather than a library generator whose stream may
//! change between releases. A golden-value test pins it.

use metronome_core::{RunSeed, mix64, stream_seed};

/// The stream of [`stream_seed`] that shuffles epochs; the index is the epoch.
pub const SHUFFLE_STREAM: u64 = 0x7368_7566_666c_6521; // "shuffle!"

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64: one 64-bit state, advanced by the golden ratio and mixed.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// Uniform in `0..n` without modulo bias (Lemire, "Fast random integer generation
    /// in an interval", 2019). `n` must be positive.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0, "below(0) has no value");
        let threshold = n.wrapping_neg() % n;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(n);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }

    /// Uniform in `lo..=hi`; `lo <= hi`.
    pub(crate) fn between(&mut self, lo: u64, hi: u64) -> u64 {
        debug_assert!(lo <= hi, "empty range {lo}..={hi}");
        match (hi - lo).checked_add(1) {
            Some(span) => lo + self.below(span),
            None => self.next_u64(),
        }
    }
}

/// The release order of epoch `epoch` over `len` records: a Fisher–Yates shuffle
/// seeded by `stream_seed(run, SHUFFLE_STREAM, epoch)`, or the identity without
/// shuffling. Every index `0..len` appears exactly once.
#[must_use]
pub fn epoch_order(run: RunSeed, epoch: u64, len: usize, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    if shuffle {
        let mut rng = SplitMix64::new(stream_seed(run, SHUFFLE_STREAM, epoch));
        for i in (1..len).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_stream() {
        // Vigna's splitmix64.c seeded with 0 yields these first two outputs.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(7);
        let mut seen = [0u32; 7];
        for _ in 0..7000 {
            seen[rng.below(7) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 800), "{seen:?}");
        assert_eq!(rng.between(5, 5), 5);
        let _ = rng.between(0, u64::MAX);
    }

    /// Golden values: a cursor saved by one release must replay the same order in the
    /// next, so the shuffle is part of the contract. Computed by an independent Python
    /// implementation of the same algorithm (big integers masked to 64 bits).
    #[test]
    fn epoch_order_golden_values() {
        assert_eq!(epoch_order(RunSeed(0), 0, 10, true), vec![5, 8, 9, 2, 1, 6, 3, 0, 7, 4]);
        assert_eq!(epoch_order(RunSeed(42), 3, 12, true), vec![6, 11, 7, 0, 4, 3, 8, 10, 1, 9, 5, 2]);
    }

    #[test]
    fn epoch_order_is_a_permutation_that_changes_per_epoch() {
        let a = epoch_order(RunSeed(1), 0, 100, true);
        let b = epoch_order(RunSeed(1), 1, 100, true);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(a, b);
        assert_eq!(a, epoch_order(RunSeed(1), 0, 100, true));
        assert_eq!(epoch_order(RunSeed(1), 0, 5, false), vec![0, 1, 2, 3, 4]);
        assert!(epoch_order(RunSeed(1), 0, 0, true).is_empty());
    }
}
