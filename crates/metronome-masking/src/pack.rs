//! Packing a period's groups into micro-batches by token budget.

use std::ops::Range;

use metronome_core::{ScoredGroup, TokenId};

use crate::{
    Layout, LayoutKind, MaskingError, Result,
    build::{Builder, Part, padded_row_lengths, shared_tokens},
    input::check_group,
};

/// How groups are packed into rows and micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PackingConfig {
    /// The layout of every batch.
    pub layout: LayoutKind,
    /// Most positions in one row (the model's context, or the attention kernel's tile).
    /// With an attention that evaluates a dense `[len, len]` mask per row, a row's
    /// attention cost grows with the square of its length; a smaller row budget splits
    /// large groups and trades repeated prompts for attention work.
    pub row_tokens: usize,
    /// Most positions in one micro-batch, summed over its rows (memory per forward);
    /// at least `row_tokens`. For the padded layout pads count.
    pub micro_batch_tokens: usize,
    /// What to do with a group that does not fit one row or micro-batch: split its
    /// responses into parts that do, each with its own copy of the prompt (`true`), or
    /// reject it with [`MaskingError::GroupOverBudget`] (`false`).
    pub split_oversized_groups: bool,
    /// The token id of padding positions (padded layout only).
    pub pad_token: TokenId,
    /// How many of a period's groups the trainer packs together (read by the pipeline's
    /// runner; [`Packer`] packs whatever groups it is given). 1 trains each group as it
    /// arrives. With more, a period's groups form fixed sets of this many in release
    /// order, and each set is packed and trained once all of it is in: fewer, fuller
    /// micro-batches (on a GPU a forward and backward of one small group is bound by
    /// kernel launches), at the cost of training a set only after its slowest group.
    /// The sets do not depend on arrival order, so `sync` and `periodic` still train
    /// the same micro-batches.
    pub groups_per_pack: usize,
}

impl Default for PackingConfig {
    fn default() -> Self {
        Self {
            layout: LayoutKind::SharedPrompt,
            row_tokens: 4096,
            micro_batch_tokens: 4096,
            split_oversized_groups: true,
            pad_token: 0,
            groups_per_pack: 1,
        }
    }
}

impl PackingConfig {
    /// Checks that the budgets can be met at all.
    ///
    /// # Errors
    /// [`MaskingError::Config`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: String| Err(MaskingError::Config { field, reason });
        if self.row_tokens < 2 {
            return bad(
                "row_tokens",
                format!("is {}, but a row needs at least 2 positions", self.row_tokens),
            );
        }
        if self.micro_batch_tokens < self.row_tokens {
            return bad(
                "micro_batch_tokens",
                format!("is {}, below row_tokens {}", self.micro_batch_tokens, self.row_tokens),
            );
        }
        if self.groups_per_pack == 0 {
            return bad("groups_per_pack", "is 0, but a pack holds at least one group".to_owned());
        }
        if u32::try_from(self.row_tokens).is_err() {
            return bad("row_tokens", format!("is {}, more than a row can address", self.row_tokens));
        }
        Ok(())
    }
}

/// Packs groups, in the order they arrive, into micro-batches that respect the budgets.
///
/// Packing is next-fit and streaming: a group joins the current row if it fits, else a
/// new row of the current micro-batch, else a new micro-batch, so no response is ever
/// reordered and a micro-batch is handed out as soon as the next group does not fit it.
/// All micro-batches of a period belong to the same optimiser step; a group is never
/// split between micro-batches unless it does not fit one and splitting is enabled.
#[derive(Debug)]
pub struct Packer {
    config: PackingConfig,
    current: Option<Builder>,
}

impl Packer {
    /// A packer with a checked configuration.
    ///
    /// # Errors
    /// [`MaskingError::Config`] when the budgets cannot be met.
    pub fn new(config: PackingConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config, current: None })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &PackingConfig {
        &self.config
    }

    /// Adds one group and returns the micro-batches it completed (usually none or one;
    /// more when an over-budget group was split).
    ///
    /// # Errors
    /// A malformed group or one over budget (see [`MaskingError`]). The packer is then
    /// unchanged: nothing of the group was packed.
    pub fn push(&mut self, group: &ScoredGroup) -> Result<Vec<Layout>> {
        check_group(group)?;
        let parts = self.plan(group)?;
        let mut done = Vec::new();
        for responses in parts {
            let part = Part { group, responses };
            if let Some(layout) = self.place(&part) {
                done.push(layout);
            }
        }
        Ok(done)
    }

    /// Hands out the last, partly filled micro-batch (at the end of a period).
    pub fn finish(&mut self) -> Option<Layout> {
        self.current.take().map(Builder::finish)
    }

    /// Splits a group into the parts it is packed as: one, unless it is over budget.
    fn plan(&self, g: &ScoredGroup) -> Result<Vec<Range<usize>>> {
        let n = g.group.completions.len();
        let Some((tokens, budget)) = self.excess(g, 0..n) else {
            let whole = 0..n;
            return Ok(Vec::from([whole]));
        };
        if !self.config.split_oversized_groups {
            return Err(MaskingError::GroupOverBudget { group: g.key(), tokens, budget });
        }
        let mut parts = Vec::new();
        let mut start = 0;
        for i in 0..n {
            if let Some((tokens, budget)) = self.excess(g, i..i + 1) {
                return Err(MaskingError::ResponseOverBudget { group: g.key(), sample: i, tokens, budget });
            }
            if self.excess(g, start..i + 1).is_some() {
                parts.push(start..i);
                start = i;
            }
        }
        parts.push(start..n);
        Ok(parts)
    }

    /// `None` when `responses` of `g` fit a micro-batch of their own, else the tokens
    /// they need and the budget they exceed.
    fn excess(&self, g: &ScoredGroup, responses: Range<usize>) -> Option<(usize, usize)> {
        let c = &self.config;
        match c.layout {
            LayoutKind::SharedPrompt => {
                let tokens = shared_tokens(g, responses);
                (tokens > c.row_tokens).then_some((tokens, c.row_tokens))
            }
            LayoutKind::Padded => {
                let longest = padded_row_lengths(g, responses.clone()).max().unwrap_or(0);
                let tokens = responses.len() * longest;
                if longest > c.row_tokens {
                    Some((longest, c.row_tokens))
                } else {
                    (tokens > c.micro_batch_tokens).then_some((tokens, c.micro_batch_tokens))
                }
            }
        }
    }

    /// Places a part that fits alone; returns the micro-batch it closed, if any.
    fn place(&mut self, part: &Part<'_>) -> Option<Layout> {
        let c = self.config;
        let mut closed = None;
        let placement = self.current.as_ref().map_or(Placement::NewBatch, |b| placement(&c, b, part));
        if placement == Placement::NewBatch {
            closed = self.current.take().map(Builder::finish);
        }
        let b = self.current.get_or_insert_with(|| Builder::new(c.layout, c.pad_token));
        if c.layout == LayoutKind::SharedPrompt && placement != Placement::SameRow {
            b.new_row();
        }
        b.push(part);
        closed
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    SameRow,
    NewRow,
    NewBatch,
}

/// Where a part goes in the current micro-batch `b` (next-fit).
fn placement(c: &PackingConfig, b: &Builder, part: &Part<'_>) -> Placement {
    if b.is_empty() {
        return Placement::NewBatch;
    }
    let g = part.group;
    match c.layout {
        LayoutKind::SharedPrompt => {
            let s = shared_tokens(g, part.responses.clone());
            let row_len = b.rows().last().map_or(0, |r| r.len());
            if b.positions() + s > c.micro_batch_tokens {
                Placement::NewBatch
            } else if row_len + s <= c.row_tokens {
                Placement::SameRow
            } else {
                Placement::NewRow
            }
        }
        LayoutKind::Padded => {
            // Rows are padded to the longest at the end, so the cost is rows × longest.
            let longest = b.rows().iter().map(|r| r.len()).max().unwrap_or(0);
            let part_longest = padded_row_lengths(g, part.responses.clone()).max().unwrap_or(0);
            let rows = b.rows().len() + part.responses.len();
            if rows * longest.max(part_longest) <= c.micro_batch_tokens {
                Placement::NewRow
            } else {
                Placement::NewBatch
            }
        }
    }
}

/// Packs a whole period's groups (in completion order) into micro-batches.
///
/// # Errors
/// A bad configuration, or the first malformed or over-budget group.
pub fn pack_period(groups: &[ScoredGroup], config: &PackingConfig) -> Result<Vec<Layout>> {
    let mut packer = Packer::new(*config)?;
    let mut out = Vec::new();
    for g in groups {
        out.extend(packer.push(g)?);
    }
    out.extend(packer.finish());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_reads_from_serde_with_defaults_and_rejects_unknown_fields() {
        let c: PackingConfig = serde_json::from_str(r#"{"layout": "padded", "row_tokens": 512}"#).unwrap();
        assert_eq!(
            c,
            PackingConfig { layout: LayoutKind::Padded, row_tokens: 512, ..PackingConfig::default() }
        );
        assert!(serde_json::from_str::<PackingConfig>(r#"{"row_token": 512}"#).is_err());
        let back: PackingConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }
}
