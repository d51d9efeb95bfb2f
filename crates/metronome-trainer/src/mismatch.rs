//! The train–rollout mismatch of a step: how far the trainer's log-probs of the
//! sampled tokens are from the behaviour log-probs the rollout engine recorded
//! (`metronome_core::LogprobMismatch`).
//!
//! The trainer has both for every target it scores, so measuring costs one pass over
//! the targets' host values. The 99th percentile comes from a fixed histogram of
//! `|d|` with [`BINS_PER_DECADE`] logarithmic bins per decade from [`SMALLEST`] to
//! `1e3` nats (a bin's upper edge is at most 12.2% above its lower): the step's
//! memory does not grow with its tokens, a mid-period checkpoint carries it in a few
//! kilobytes, and the reported p99 is the upper edge of the bin holding it, never
//! above the exact maximum.

use metronome_core::LogprobMismatch;
use serde::{Deserialize, Serialize};

/// Logarithmic histogram bins per decade of `|d|`.
const BINS_PER_DECADE: usize = 20;
/// `|d|` below this (exact agreement included) falls in the first bin.
const SMALLEST: f64 = 1e-9;
/// Decades of logarithmic bins above [`SMALLEST`]: `|d|` from `1e3` nats up falls in
/// the last bin.
const DECADES: usize = 12;
/// One bin below [`SMALLEST`], the logarithmic ones, one from `1e3` up.
const BINS: usize = DECADES * BINS_PER_DECADE + 2;

/// The running sums of one step's mismatch (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct MismatchSums {
    tokens: u64,
    abs_sum: f64,
    max_abs: f64,
    k3_sum: f64,
    truncated: u64,
    masked: u64,
    /// Counts per bin of `|d|`; empty until the first token.
    bins: Vec<u64>,
}

/// The bin of `|d| = a`.
fn bin(a: f64) -> usize {
    if a < SMALLEST {
        return 0;
    }
    let position = ((a / SMALLEST).log10() * BINS_PER_DECADE as f64).min(BINS as f64);
    (position.floor() as usize + 1).min(BINS - 1)
}

/// The upper edge of bin `i` (the last bin's is unbounded: the maximum stands in).
fn upper_edge(i: usize) -> f64 {
    if i + 1 >= BINS {
        return f64::INFINITY;
    }
    SMALLEST * 10f64.powf(i as f64 / BINS_PER_DECADE as f64)
}

impl MismatchSums {
    /// Checks sums read back from a checkpoint: every count within `max` (the bins'
    /// total too, so that adding to any cannot overflow), every sum finite, and the
    /// bins empty or all there; the error names the field.
    pub(crate) fn check(&self, max: u64) -> Result<(), String> {
        let MismatchSums { tokens, abs_sum, max_abs, k3_sum, truncated, masked, bins } = self;
        if !(bins.is_empty() || bins.len() == BINS) {
            return Err(format!("mismatch.bins has {} bins, expected {BINS}", bins.len()));
        }
        let total = bins.iter().try_fold(0u64, |sum, &n| sum.checked_add(n)).unwrap_or(u64::MAX);
        let counts = [("tokens", *tokens), ("truncated", *truncated), ("masked", *masked), ("bins", total)];
        if let Some((field, n)) = counts.iter().find(|(_, n)| *n > max) {
            return Err(format!("mismatch.{field} is {n}, more than {max}"));
        }
        let sums = [("abs_sum", *abs_sum), ("max_abs", *max_abs), ("k3_sum", *k3_sum)];
        if let Some((field, x)) = sums.iter().find(|(_, x)| !x.is_finite()) {
            return Err(format!("mismatch.{field} is {x}"));
        }
        Ok(())
    }

    /// Adds the targets of one micro-batch: the trainer's log-probs, the behaviour
    /// log-probs, and how many of them the truncated IS weight capped and masked IS
    /// dropped. A pair that is not finite is left out (the step's guard reports it).
    pub(crate) fn record(&mut self, trainer: &[f32], behaviour: &[f32], truncated: u64, masked: u64) {
        if self.bins.len() != BINS {
            self.bins = vec![0; BINS];
        }
        for (&t, &b) in trainer.iter().zip(behaviour) {
            let d = f64::from(t) - f64::from(b);
            if !d.is_finite() {
                continue;
            }
            let a = d.abs();
            self.tokens += 1;
            self.abs_sum += a;
            self.max_abs = self.max_abs.max(a);
            self.k3_sum += d.exp_m1() - d;
            self.bins[bin(a)] += 1;
        }
        self.truncated += truncated;
        self.masked += masked;
    }

    /// The step's figures.
    pub(crate) fn summary(&self) -> LogprobMismatch {
        if self.tokens == 0 {
            return LogprobMismatch::default();
        }
        let n = self.tokens as f64;
        // The smallest value with at least 99% of the tokens at or below it.
        let rank = (0.99 * n).ceil().max(1.0) as u64;
        let mut seen = 0;
        let mut p99 = self.max_abs;
        for (i, &count) in self.bins.iter().enumerate() {
            seen += count;
            if seen >= rank {
                p99 = upper_edge(i).min(self.max_abs);
                break;
            }
        }
        LogprobMismatch {
            tokens: self.tokens,
            mean_abs: self.abs_sum / n,
            p99_abs: p99,
            max_abs: self.max_abs,
            kl_k3: self.k3_sum / n,
            truncated_share: self.truncated as f64 / n,
            masked_share: self.masked as f64 / n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_constant_offset_is_reported_exactly_and_k3_in_closed_form() {
        let mut m = MismatchSums::default();
        let trainer = [-1.0f32, -2.0, -0.5, -3.0];
        let behaviour: Vec<f32> = trainer.iter().map(|t| t + 0.25).collect();
        m.record(&trainer, &behaviour, 1, 2);
        let s = m.summary();
        assert_eq!(s.tokens, 4);
        for v in [s.mean_abs, s.p99_abs, s.max_abs] {
            assert!((v - 0.25).abs() < 1e-6, "{s:?}");
        }
        // d = -0.25: k3 = e^-0.25 - 1 + 0.25.
        assert!((s.kl_k3 - ((-0.25f64).exp() - 0.75)).abs() < 1e-6, "{s:?}");
        assert_eq!((s.truncated_share, s.masked_share), (0.25, 0.5));
    }

    #[test]
    fn p99_is_the_bin_above_the_99th_value_and_never_above_the_maximum() {
        let mut m = MismatchSums::default();
        // 990 tokens at 1e-6, 10 at 0.1: the 99th percentile is 1e-6 (its bin's edge).
        let mut trainer = vec![0.0f32; 1000];
        let behaviour = vec![0.0f32; 1000];
        trainer[..990].iter_mut().for_each(|t| *t = 1e-6);
        trainer[990..].iter_mut().for_each(|t| *t = 0.1);
        m.record(&trainer, &behaviour, 0, 0);
        let s = m.summary();
        assert!(s.p99_abs >= 1e-6 * 0.999 && s.p99_abs <= 1e-6 * 1.13, "{s:?}");
        assert!((s.max_abs - 0.1).abs() < 1e-7);
        // One more large token moves the 99th percentile up to the large ones.
        m.record(&[0.1], &[0.0], 0, 0);
        let s = m.summary();
        assert!((s.p99_abs - 0.1).abs() < 1e-7, "{s:?}");
        assert_eq!(MismatchSums::default().summary(), LogprobMismatch::default());
    }

    #[test]
    fn bins_are_monotone_and_cover_every_value() {
        let mut last = 0;
        for k in -120..40 {
            let a = 10f64.powf(f64::from(k) / 10.0);
            let b = bin(a);
            assert!(b >= last && b < BINS, "{a}: {b}");
            assert!(a <= upper_edge(b) * (1.0 + 1e-12), "{a} above its bin's edge {}", upper_edge(b));
            last = b;
        }
        assert_eq!(bin(0.0), 0);
        assert_eq!(bin(f64::MAX), BINS - 1);
        let mut m = MismatchSums::default();
        m.record(&[f32::NAN, -1.0], &[-1.0, -1.0], 0, 0);
        assert_eq!(m.summary().tokens, 1, "a non-finite pair is left out");
    }
}
