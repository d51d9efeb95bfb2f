//! Packed training batches: the layout vocabulary shared by `metronome-masking`
//! (which produces it), `metronome-model` (which runs the network over it) and
//! `metronome-trainer` (which computes the loss from it).
//!
//! A batch is a set of rows of tokens. Within a row, attention follows a tree of
//! contiguous *segments*: a token may attend an earlier-or-equal position of its own
//! segment and every position of its segment's ancestors. The shared-prompt layout
//! of one group is a prompt segment with one child segment per response; packing
//! several groups in a row puts several such trees side by side (block-diagonal);
//! the padded baseline is one root segment per row.
//!
//! Loss targets are listed separately, one entry per response token, each naming the
//! position whose output predicts it. Only targets enter the loss.

use serde::{Deserialize, Serialize};

use crate::{Error, GroupKey, PolicyVersion, Result, TokenId};

/// A contiguous run of positions in a row, with its attention parent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// First position of the segment in its row.
    pub start: u32,
    /// Number of positions.
    pub len: u32,
    /// Index (in the row's `segments`) of the segment this one may see in full, e.g.
    /// the prompt for a response. It must be an earlier segment. `None` for a root.
    pub parent: Option<u32>,
}

impl Segment {
    /// One past the last position, saturating: segments are read back from
    /// checkpoints, and `start + len` of a hostile one overflowed (a panic in the
    /// validator that was to refuse it).
    #[must_use]
    pub fn end(&self) -> u32 {
        self.start.saturating_add(self.len)
    }
}

/// One packed row: tokens, their rotary positions, and the attention structure.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PackedRow {
    /// Input token ids.
    pub tokens: Vec<TokenId>,
    /// Position id of each token (the shared-prompt layout restarts positions at the
    /// prompt length for every response).
    pub positions: Vec<u32>,
    /// Segments covering `0..tokens.len()` in order, without gaps or overlaps.
    pub segments: Vec<Segment>,
}

impl PackedRow {
    /// Number of positions.
    #[must_use]
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the row has no positions.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The segment index of every position.
    #[must_use]
    pub fn segment_ids(&self) -> Vec<u32> {
        let mut ids = Vec::with_capacity(self.len());
        for (s, seg) in self.segments.iter().enumerate() {
            ids.extend(std::iter::repeat_n(s as u32, seg.len as usize));
        }
        ids
    }

    /// Whether position `query` may attend position `key`: the reference semantics of
    /// the attention structure (quadratic when used for every pair; kernels derive the
    /// same answer from the segments directly).
    #[must_use]
    pub fn can_attend(&self, query: usize, key: usize) -> bool {
        if key > query {
            return false;
        }
        let seg_of = |p: usize| self.segments.partition_point(|s| (s.end() as usize) <= p) as u32;
        let key_seg = seg_of(key);
        let mut s = Some(seg_of(query));
        while let Some(cur) = s {
            if cur == key_seg {
                return true;
            }
            s = self.segments[cur as usize].parent;
        }
        false
    }

    /// Checks that the arrays agree and the segments tile the row with earlier parents.
    pub fn validate(&self, row: usize) -> Result<()> {
        let what = || format!("packed row {row}");
        if self.positions.len() != self.tokens.len() {
            return Err(Error::invalid(
                what(),
                format!("has {} positions for {} tokens", self.positions.len(), self.tokens.len()),
            ));
        }
        let mut next = 0u32;
        for (i, seg) in self.segments.iter().enumerate() {
            if seg.start != next || seg.len == 0 {
                return Err(Error::invalid(
                    what(),
                    format!(
                        "segment {i} spans {}..{}, expected a non-empty span from {next}",
                        seg.start,
                        seg.end()
                    ),
                ));
            }
            if let Some(p) = seg.parent
                && p as usize >= i
            {
                return Err(Error::invalid(
                    what(),
                    format!("segment {i} has parent {p}, which is not earlier"),
                ));
            }
            next = seg.end();
        }
        if next as usize != self.tokens.len() {
            return Err(Error::invalid(
                what(),
                format!("segments cover {next} of {} positions", self.tokens.len()),
            ));
        }
        Ok(())
    }
}

/// Loss targets as parallel arrays, one entry per response token in the loss.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Targets {
    /// The row holding the predicting position.
    pub row: Vec<u32>,
    /// The position (within its row) whose output distribution predicts the target.
    pub position: Vec<u32>,
    /// The target token id.
    pub token: Vec<TokenId>,
    /// The index (in [`TrainBatch::sequences`]) of the response the target belongs to.
    pub sequence: Vec<u32>,
    /// The response's advantage, repeated per token.
    pub advantage: Vec<f32>,
    /// The behaviour log-probability the rollout engine recorded for this token.
    pub behaviour_logprob: Vec<f32>,
}

impl Targets {
    /// Room for `n` more targets in every column.
    pub fn reserve(&mut self, n: usize) {
        self.row.reserve(n);
        self.position.reserve(n);
        self.token.reserve(n);
        self.sequence.reserve(n);
        self.advantage.reserve(n);
        self.behaviour_logprob.reserve(n);
    }

    /// Number of targets.
    #[must_use]
    pub fn len(&self) -> usize {
        self.token.len()
    }

    /// True when there are no targets.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.token.is_empty()
    }
}

/// One response in a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainSequence {
    /// Index (in [`TrainBatch::groups`]) of the response's group.
    pub group: u32,
    /// The response's index within its group.
    pub sample_index: u32,
    /// The policy version that sampled it.
    pub version: PolicyVersion,
    /// Its advantage.
    pub advantage: f32,
    /// Number of its tokens in the loss: its length, less the observation tokens of a
    /// multi-turn episode.
    pub num_targets: u32,
}

/// One group in a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainGroup {
    /// The group's identity, for acknowledgement and de-duplication.
    pub key: GroupKey,
    /// Number of responses of the group in this batch (all of them, unless an
    /// over-budget group was split across micro-batches).
    pub num_sequences: u32,
    /// The group's full size `G`.
    pub group_size: u32,
    /// True when the group's rewards were all equal (zero advantage everywhere).
    pub all_equal: bool,
    /// Mean reward of the group.
    pub reward_mean: f32,
}

/// A micro-batch: packed rows and the targets of the responses they contain.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainBatch {
    /// The packed rows.
    pub rows: Vec<PackedRow>,
    /// The loss targets.
    pub targets: Targets,
    /// The responses.
    pub sequences: Vec<TrainSequence>,
    /// The groups.
    pub groups: Vec<TrainGroup>,
}

impl TrainBatch {
    /// Total positions over all rows (the tokens the network processes).
    #[must_use]
    pub fn num_positions(&self) -> usize {
        self.rows.iter().map(PackedRow::len).sum()
    }

    /// Checks that every array agrees with every other.
    pub fn validate(&self) -> Result<()> {
        for (i, row) in self.rows.iter().enumerate() {
            row.validate(i)?;
        }
        let t = &self.targets;
        let n = t.len();
        for (name, len) in [
            ("row", t.row.len()),
            ("position", t.position.len()),
            ("sequence", t.sequence.len()),
            ("advantage", t.advantage.len()),
            ("behaviour_logprob", t.behaviour_logprob.len()),
        ] {
            if len != n {
                return Err(Error::invalid(
                    format!("targets.{name}"),
                    format!("has {len} entries for {n} target tokens"),
                ));
            }
        }
        for i in 0..n {
            let row = t.row[i] as usize;
            let Some(r) = self.rows.get(row) else {
                return Err(Error::invalid(
                    format!("target {i}"),
                    format!("names row {row} of {}", self.rows.len()),
                ));
            };
            if t.position[i] as usize >= r.len() {
                return Err(Error::invalid(
                    format!("target {i}"),
                    format!("names position {} of a {}-token row", t.position[i], r.len()),
                ));
            }
            if t.sequence[i] as usize >= self.sequences.len() {
                return Err(Error::invalid(
                    format!("target {i}"),
                    format!("names sequence {} of {}", t.sequence[i], self.sequences.len()),
                ));
            }
        }
        for (i, s) in self.sequences.iter().enumerate() {
            if s.group as usize >= self.groups.len() {
                return Err(Error::invalid(
                    format!("sequence {i}"),
                    format!("names group {} of {}", s.group, self.groups.len()),
                ));
            }
        }
        Ok(())
    }
}
