//! Building layouts: the shared-prompt tree of a group, the padded baseline, and the
//! bookkeeping (spans, accounts) that comes with them.

use std::ops::Range;

use metronome_core::{PackedRow, ScoredGroup, Segment, TokenId, TrainBatch, TrainGroup, TrainSequence};
use ndarray::{Array1, Axis, Slice};

use crate::{MaskingError, Result, TokenAccount, input::check_group};

/// Which layout a batch uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutKind {
    /// One prompt copy per group (part), its responses as sibling segments that see the
    /// prompt and not each other; several groups side by side in a row.
    #[default]
    SharedPrompt,
    /// One row per response, `prompt + response`, right-padded to the longest row of
    /// the batch with a pad segment outside the loss: the baseline it is compared with.
    Padded,
}

/// Where one response lies in its layout: the bookkeeping the [`TrainBatch`] does not
/// carry, from which input-aligned loss masks are materialised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResponseSpan {
    /// Index of the response in [`TrainBatch::sequences`].
    pub sequence: u32,
    /// The row holding it.
    pub row: u32,
    /// Position of its first token.
    pub start: u32,
    /// Its number of tokens.
    pub len: u32,
    /// Position of the first token of the prompt copy it sees.
    pub prompt_start: u32,
    /// Length of that prompt.
    pub prompt_len: u32,
}

impl ResponseSpan {
    /// One past the position of its last token.
    #[must_use]
    pub fn end(&self) -> u32 {
        self.start + self.len
    }
}

/// A laid-out batch: the [`TrainBatch`] the model and trainer consume, the span of
/// every response, and the token account.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Layout {
    /// Which layout built it.
    pub kind: LayoutKind,
    /// Rows, targets, sequences and groups.
    pub batch: TrainBatch,
    /// One span per entry of `batch.sequences`, in the same order.
    pub spans: Vec<ResponseSpan>,
    /// What the layout costs.
    pub account: TokenAccount,
    /// Positions holding observation tokens of multi-turn episodes, as `(row, start,
    /// len)`: inside response spans, attended as context, never loss targets.
    pub observations: Vec<(u32, u32, u32)>,
}

impl Layout {
    /// The input-aligned loss mask of every row: 1 at positions holding a response
    /// token that is a loss target, 0 on prompts, pads and observation tokens.
    #[must_use]
    pub fn loss_mask(&self) -> Vec<Array1<f32>> {
        let mut masks: Vec<Array1<f32>> = self.batch.rows.iter().map(|r| Array1::zeros(r.len())).collect();
        for s in &self.spans {
            masks[s.row as usize]
                .slice_axis_mut(Axis(0), Slice::from(s.start as usize..s.end() as usize))
                .fill(1.0);
        }
        for &(row, start, len) in &self.observations {
            masks[row as usize]
                .slice_axis_mut(Axis(0), Slice::from(start as usize..(start + len) as usize))
                .fill(0.0);
        }
        masks
    }

    /// The prediction-aligned loss weights of every row: how many targets each
    /// position's output predicts. In the padded layout this is the usual shifted 0/1
    /// loss mask; in the shared-prompt layout the last prompt position predicts the first
    /// token of every response of its group, so it weighs `G`.
    #[must_use]
    pub fn prediction_weights(&self) -> Vec<Array1<f32>> {
        let mut w: Vec<Array1<f32>> = self.batch.rows.iter().map(|r| Array1::zeros(r.len())).collect();
        let t = &self.batch.targets;
        for (&row, &pos) in t.row.iter().zip(&t.position) {
            w[row as usize][pos as usize] += 1.0;
        }
        w
    }
}

/// Lays out one group in the shared-prompt layout: a single row holding the prompt
/// once (positions `0..P`) and then every response (positions restarting at `P`).
///
/// # Errors
/// A group that breaks the layout's preconditions (see [`MaskingError`]).
pub fn shared_prompt(group: &ScoredGroup) -> Result<Layout> {
    check_group(group)?;
    let tokens = shared_tokens(group, 0..group.group.completions.len());
    row_fits_u32(group, tokens)?;
    let mut b = Builder::new(LayoutKind::SharedPrompt, 0);
    b.new_row();
    b.push(&Part::whole(group));
    Ok(b.finish())
}

/// Lays out groups in the padded baseline layout: one row `prompt + response` per
/// response, in group then sample order, right-padded with `pad_token` to the longest
/// row. The pad is a segment of its own, outside the loss and invisible to real tokens.
///
/// # Errors
/// A group that breaks the layout's preconditions (see [`MaskingError`]).
pub fn padded(groups: &[ScoredGroup], pad_token: TokenId) -> Result<Layout> {
    for g in groups {
        check_group(g)?;
        let longest = padded_row_lengths(g, 0..g.group.completions.len()).max().unwrap_or(0);
        row_fits_u32(g, longest)?;
    }
    let mut b = Builder::new(LayoutKind::Padded, pad_token);
    for g in groups {
        b.push(&Part::whole(g));
    }
    Ok(b.finish())
}

fn row_fits_u32(group: &ScoredGroup, tokens: usize) -> Result<()> {
    if u32::try_from(tokens).is_err() {
        return Err(MaskingError::RowTooLong { group: group.key(), tokens });
    }
    Ok(())
}

/// Positions the shared-prompt tree of `responses` of a group takes: `P + Σ Lᵢ`.
pub(crate) fn shared_tokens(g: &ScoredGroup, responses: Range<usize>) -> usize {
    g.group.prompt.tokens.len() + g.group.completions[responses].iter().map(|c| c.tokens.len()).sum::<usize>()
}

/// Unpadded lengths `P + Lᵢ` of the padded rows of `responses`.
pub(crate) fn padded_row_lengths(
    g: &ScoredGroup,
    responses: Range<usize>,
) -> impl Iterator<Item = usize> + '_ {
    let p = g.group.prompt.tokens.len();
    g.group.completions[responses].iter().map(move |c| p + c.tokens.len())
}

/// Some consecutive responses of one (validated) group: all of them, or one piece of a
/// group split across micro-batches.
#[derive(Clone, Debug)]
pub(crate) struct Part<'a> {
    pub(crate) group: &'a ScoredGroup,
    pub(crate) responses: Range<usize>,
}

impl<'a> Part<'a> {
    pub(crate) fn whole(group: &'a ScoredGroup) -> Self {
        Self { group, responses: 0..group.group.completions.len() }
    }

    fn is_first(&self) -> bool {
        self.responses.start == 0
    }
}

/// Appends parts of validated groups to a batch. Callers check budgets and `u32`
/// ranges first; the builder only lays out.
#[derive(Debug)]
pub(crate) struct Builder {
    layout: Layout,
    pad_token: TokenId,
}

impl Builder {
    pub(crate) fn new(kind: LayoutKind, pad_token: TokenId) -> Self {
        Self { layout: Layout { kind, ..Layout::default() }, pad_token }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.layout.batch.rows.is_empty()
    }

    pub(crate) fn rows(&self) -> &[PackedRow] {
        &self.layout.batch.rows
    }

    /// Starts a new (empty) row; shared-prompt parts go into the last row.
    pub(crate) fn new_row(&mut self) {
        self.layout.batch.rows.push(PackedRow::default());
    }

    pub(crate) fn push(&mut self, part: &Part<'_>) {
        let group = self.group_entry(part);
        let g = part.group;
        let p = g.group.prompt.tokens.len();
        let response_tokens: usize =
            g.group.completions[part.responses.clone()].iter().map(|c| c.tokens.len()).sum();
        let k = part.responses.len();
        let a = &mut self.layout.account;
        a.sequences += k;
        a.response_tokens += response_tokens;
        a.separate += k * p + response_tokens;
        a.ideal += response_tokens + if part.is_first() { p } else { 0 };
        match self.layout.kind {
            LayoutKind::SharedPrompt => {
                a.prompt_copies += 1;
                a.prompt_tokens += p;
                self.push_shared(part, group);
            }
            LayoutKind::Padded => {
                a.prompt_copies += k;
                a.prompt_tokens += k * p;
                for i in part.responses.clone() {
                    self.new_row();
                    self.push_shared(&Part { group: g, responses: i..i + 1 }, group);
                }
            }
        }
    }

    /// The index of the part's [`TrainGroup`]: a later part of a split group that
    /// follows its previous part in the same batch joins that part's entry.
    fn group_entry(&mut self, part: &Part<'_>) -> u32 {
        let groups = &mut self.layout.batch.groups;
        let key = part.group.key();
        let k = part.responses.len() as u32;
        if !part.is_first()
            && let Some(last) = groups.last_mut()
            && last.key == key
        {
            last.num_sequences += k;
            return (groups.len() - 1) as u32;
        }
        groups.push(TrainGroup {
            key,
            num_sequences: k,
            group_size: part.group.group.completions.len() as u32,
            all_equal: part.group.stats.all_equal,
            reward_mean: part.group.stats.mean,
        });
        (groups.len() - 1) as u32
    }

    /// Appends a prompt segment and its responses to the last row. In the padded layout
    /// a part has one response, and prompt and response form one causal root segment.
    fn push_shared(&mut self, part: &Part<'_>, group: u32) {
        let kind = self.layout.kind;
        let batch = &mut self.layout.batch;
        if batch.rows.is_empty() {
            batch.rows.push(PackedRow::default());
        }
        let row_index = (batch.rows.len() - 1) as u32;
        let Some(row) = batch.rows.last_mut() else { return };
        let g = part.group;
        let prompt = &g.group.prompt.tokens;
        let p = prompt.len() as u32;
        let prompt_start = row.len() as u32;
        let prompt_segment = row.segments.len() as u32;
        // Room for the part at once: grown push by push, a period's rows and targets
        // reallocated a few dozen times each.
        let answers: usize = part.responses.clone().map(|i| g.group.completions[i].tokens.len()).sum();
        row.tokens.reserve(prompt.len() + answers);
        row.positions.reserve(prompt.len() + answers);
        row.segments.reserve(1 + part.responses.len());
        batch.targets.reserve(answers);
        row.tokens.extend_from_slice(prompt);
        row.positions.extend(0..p);
        if kind == LayoutKind::SharedPrompt {
            row.segments.push(Segment { start: prompt_start, len: p, parent: None });
        }
        for i in part.responses.clone() {
            let c = &g.group.completions[i];
            let len = c.tokens.len() as u32;
            let start = row.len() as u32;
            match kind {
                LayoutKind::SharedPrompt => {
                    row.segments.push(Segment { start, len, parent: Some(prompt_segment) });
                }
                LayoutKind::Padded => {
                    row.segments.push(Segment { start: prompt_start, len: p + len, parent: None });
                }
            }
            row.tokens.extend_from_slice(&c.tokens);
            row.positions.extend(p..p + len);

            let sequence = batch.sequences.len() as u32;
            let advantage = g.advantages[i];
            let t = &mut batch.targets;
            let num_targets = match &c.episode {
                None => {
                    t.row.extend(std::iter::repeat_n(row_index, len as usize));
                    // The last prompt position predicts the first response token; each
                    // response position predicts the token after it.
                    t.position.push(prompt_start + p - 1);
                    t.position.extend(start..start + len - 1);
                    t.token.extend_from_slice(&c.tokens);
                    t.sequence.extend(std::iter::repeat_n(sequence, len as usize));
                    t.advantage.extend(std::iter::repeat_n(advantage, len as usize));
                    t.behaviour_logprob.extend_from_slice(&c.logprobs);
                    len
                }
                Some(trace) => {
                    // A multi-turn trajectory lies in the row whole (observations are
                    // context for the turns after them) but only the policy's tokens
                    // are targets.
                    let mut n = 0;
                    for (j, policy) in c.policy_mask().into_iter().enumerate() {
                        if !policy {
                            continue;
                        }
                        t.row.push(row_index);
                        t.position.push(if j == 0 { prompt_start + p - 1 } else { start + j as u32 - 1 });
                        t.token.push(c.tokens[j]);
                        t.sequence.push(sequence);
                        t.advantage.push(advantage);
                        t.behaviour_logprob.push(c.logprobs[j]);
                        n += 1;
                    }
                    self.layout
                        .observations
                        .extend(trace.observations.iter().map(|s| (row_index, start + s.start, s.len)));
                    n
                }
            };
            batch.sequences.push(TrainSequence {
                group,
                sample_index: c.sample_index,
                version: c.version,
                advantage,
                num_targets,
            });
            self.layout.spans.push(ResponseSpan {
                sequence,
                row: row_index,
                start,
                len,
                prompt_start,
                prompt_len: p,
            });
        }
    }

    /// Total positions so far.
    pub(crate) fn positions(&self) -> usize {
        self.layout.batch.num_positions()
    }

    pub(crate) fn finish(mut self) -> Layout {
        if self.layout.kind == LayoutKind::Padded {
            let longest = self.layout.batch.rows.iter().map(PackedRow::len).max().unwrap_or(0);
            for row in &mut self.layout.batch.rows {
                let len = row.len() as u32;
                let pad = longest as u32 - len;
                if pad > 0 {
                    // A root segment of its own: pads see only earlier pads (so every
                    // query row of a dense mask has a finite entry) and nothing sees them.
                    row.segments.push(Segment { start: len, len: pad, parent: None });
                    row.tokens.extend(std::iter::repeat_n(self.pad_token, pad as usize));
                    row.positions.extend(len..len + pad);
                    self.layout.account.pad_tokens += pad as usize;
                }
            }
        }
        self.layout
    }
}
