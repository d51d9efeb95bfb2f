//! Token accounting: what a layout costs against the baselines, and the saving bound.

use std::ops::{Add, AddAssign};

/// The theoretical fraction of dense-layer tokens the shared-prompt layout saves for a
/// group of `group_size` responses of mean length `response_len` on a prompt of
/// `prompt_len` tokens: `(G−1)P / (G(P+L))`.
///
/// With `L` the *mean* response length it is exact for ragged groups too, since
/// `G(P+L̄) = GP + ΣLᵢ`. Zero for an empty group.
#[must_use]
pub fn saving_bound(prompt_len: usize, response_len: f64, group_size: usize) -> f64 {
    if group_size == 0 {
        return 0.0;
    }
    let (p, g) = (prompt_len as f64, group_size as f64);
    let separate = g * (p + response_len);
    if separate == 0.0 { 0.0 } else { (g - 1.0) * p / separate }
}

/// Token counts of a layout, additive over micro-batches (`+`, `+=`, `Sum`), so the
/// accounts of a period's micro-batches add up to the period's account exactly.
///
/// Three token counts are compared:
/// - `separate`: every response in its own unpadded row with a private copy of its
///   prompt, `Σᵢ (P + Lᵢ)`: the `G(P+L)` of the bound;
/// - `ideal`: every group's prompt exactly once and no padding, `Σ_g P_g + Σᵢ Lᵢ`. A
///   group split across micro-batches counts its prompt in the part holding its first
///   response, so the sum over the period is exact while a later part's own account
///   shows the price of its repeated prompt;
/// - `positions`: what the layout actually feeds the network, pads and repeated
///   prompts included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenAccount {
    /// Responses laid out.
    pub sequences: usize,
    /// Prompt copies laid out (one per group part in the shared-prompt layout, one per
    /// response in the padded layout).
    pub prompt_copies: usize,
    /// Prompt tokens laid out, over all copies.
    pub prompt_tokens: usize,
    /// Response tokens laid out (= target tokens in the loss).
    pub response_tokens: usize,
    /// Padding positions laid out.
    pub pad_tokens: usize,
    /// Tokens of the separate-rows baseline, `Σᵢ (P + Lᵢ)`.
    pub separate: usize,
    /// Tokens with each group's prompt once and no padding.
    pub ideal: usize,
}

impl TokenAccount {
    /// Positions the layout feeds the network: prompts, responses and pads.
    #[must_use]
    pub fn positions(&self) -> usize {
        self.prompt_tokens + self.response_tokens + self.pad_tokens
    }

    /// The saving bound `1 − ideal / separate`: for whole groups, `Σ(G−1)P / ΣG(P+L̄)`.
    #[must_use]
    pub fn bound(&self) -> f64 {
        ratio_saving(self.ideal, self.separate)
    }

    /// The realised saving `1 − positions / separate`: equal to the bound for the
    /// shared-prompt layout of unsplit groups, lower by the repeated prompts of split
    /// groups, and negative for a padded layout that pads.
    #[must_use]
    pub fn realised(&self) -> f64 {
        ratio_saving(self.positions(), self.separate)
    }

    /// Prompt tokens the layout repeats beyond one copy per group (the price of
    /// splitting a group across micro-batches; in the padded layout, every copy but one).
    #[must_use]
    pub fn repeated_prompt_tokens(&self) -> usize {
        self.prompt_tokens + self.response_tokens - self.ideal
    }
}

fn ratio_saving(cost: usize, baseline: usize) -> f64 {
    if baseline == 0 { 0.0 } else { 1.0 - cost as f64 / baseline as f64 }
}

impl AddAssign for TokenAccount {
    fn add_assign(&mut self, o: Self) {
        self.sequences += o.sequences;
        self.prompt_copies += o.prompt_copies;
        self.prompt_tokens += o.prompt_tokens;
        self.response_tokens += o.response_tokens;
        self.pad_tokens += o.pad_tokens;
        self.separate += o.separate;
        self.ideal += o.ideal;
    }
}

impl Add for TokenAccount {
    type Output = Self;

    fn add(mut self, o: Self) -> Self {
        self += o;
        self
    }
}

impl std::iter::Sum for TokenAccount {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), Add::add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_matches_the_paper_formula() {
        // (G−1)P / (G(P+L)) with P=256, L=32, G=8: 7·256 / (8·288).
        let b = saving_bound(256, 32.0, 8);
        assert!((b - 1792.0 / 2304.0).abs() < 1e-12);
        assert_eq!(saving_bound(100, 10.0, 1), 0.0);
        assert_eq!(saving_bound(100, 10.0, 0), 0.0);
    }

    #[test]
    fn account_bound_equals_formula_for_one_group() {
        // G=4, P=10, lengths 1,2,3,6 (mean 3).
        let a = TokenAccount {
            sequences: 4,
            prompt_copies: 1,
            prompt_tokens: 10,
            response_tokens: 12,
            pad_tokens: 0,
            separate: 4 * 10 + 12,
            ideal: 10 + 12,
        };
        assert!((a.bound() - saving_bound(10, 3.0, 4)).abs() < 1e-12);
        assert_eq!(a.realised(), a.bound());
        assert_eq!(a.repeated_prompt_tokens(), 0);
        let twice: TokenAccount = [a, a].into_iter().sum();
        assert_eq!(twice.separate, 2 * a.separate);
        assert_eq!(twice.positions(), 2 * a.positions());
    }
}
