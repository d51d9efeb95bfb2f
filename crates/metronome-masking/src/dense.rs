//! Materialising the compact attention structure as dense arrays, for backends whose
//! attention takes a mask tensor, and for checking kernels that use the segments.
//!
//! Slicing goes through `slice_axis_mut` rather than ndarray's `s!` macro, whose
//! expansion carries an `allow(unsafe_code)`, which the workspace keeps to the CUDA launches.

use metronome_core::PackedRow;
use ndarray::{Array1, Array2, Axis, Slice};

/// Which positions each position of `row` may attend: `mask[[q, k]]` is true when query
/// `q` may attend key `k` (equal to [`PackedRow::can_attend`], computed per segment).
///
/// A query sees the earlier-or-equal positions of its own segment and every position
/// of its segment's ancestors. Rows that break [`PackedRow::validate`] give the mask of
/// the segments that do lie inside the row.
#[must_use]
pub fn attention_mask(row: &PackedRow) -> Array2<bool> {
    let n = row.len();
    let mut mask = Array2::from_elem((n, n), false);
    for seg in &row.segments {
        let (start, end) = (seg.start as usize, (seg.end() as usize).min(n));
        for q in start..end {
            let mut line = mask.row_mut(q);
            line.slice_axis_mut(Axis(0), Slice::from(start..q + 1)).fill(true);
            let mut parent = seg.parent;
            // Parents are earlier segments (validated), so the walk ends; the bound
            // guards against a malformed cycle all the same.
            let mut steps = 0;
            while let Some(p) = parent
                && steps < row.segments.len()
            {
                let Some(ps) = row.segments.get(p as usize) else { break };
                let (ps_start, ps_end) = (ps.start as usize, (ps.end() as usize).min(n));
                if ps_start < ps_end {
                    line.slice_axis_mut(Axis(0), Slice::from(ps_start..ps_end)).fill(true);
                }
                parent = ps.parent;
                steps += 1;
            }
        }
    }
    mask
}

/// The additive attention mask of `row`: 0 where a query may attend a key and −∞ where
/// it may not, shaped `[len, len]`, to add to attention scores before the softmax.
///
/// Every query sees at least itself, so no row of the softmax is all −∞.
#[must_use]
pub fn dense_additive_mask(row: &PackedRow) -> Array2<f32> {
    attention_mask(row).mapv(|ok| if ok { 0.0 } else { f32::NEG_INFINITY })
}

/// How many (query, key) pairs attention evaluates over a row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionPairs {
    /// Pairs of a dense masked attention over the whole row: `len²`.
    pub dense: u64,
    /// Pairs the mask lets through: what an attention that follows the segments (each
    /// segment's queries against its ancestors' keys and its own causal prefix) computes.
    pub visible: u64,
}

impl std::ops::Add for AttentionPairs {
    type Output = Self;

    fn add(self, o: Self) -> Self {
        Self { dense: self.dense + o.dense, visible: self.visible + o.visible }
    }
}

impl std::iter::Sum for AttentionPairs {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), std::ops::Add::add)
    }
}

/// The attention work of `row`, computed from its segments without materialising a mask.
///
/// The shared-prompt layout saves dense-layer tokens, but a row of `P + GL` positions
/// under a dense mask costs `(P+GL)²` pairs against `G(P+L)²` for padded rows; only an
/// attention that follows the segments keeps the saving (`P² + GL(P+L)`-ish pairs).
#[must_use]
pub fn attention_pairs(row: &PackedRow) -> AttentionPairs {
    let len = row.len() as u64;
    let mut visible = 0u64;
    for seg in &row.segments {
        let mut ancestors = 0u64;
        let mut parent = seg.parent;
        let mut steps = 0;
        while let Some(p) = parent
            && steps < row.segments.len()
        {
            let Some(ps) = row.segments.get(p as usize) else { break };
            ancestors += u64::from(ps.len);
            parent = ps.parent;
            steps += 1;
        }
        let n = u64::from(seg.len);
        visible += n * ancestors + n * (n + 1) / 2;
    }
    AttentionPairs { dense: len * len, visible }
}

/// The rotary position ids of `row` as an array.
#[must_use]
pub fn position_ids(row: &PackedRow) -> Array1<u32> {
    Array1::from(row.positions.clone())
}

/// The token ids of `row` as an array.
#[must_use]
pub fn token_ids(row: &PackedRow) -> Array1<u32> {
    Array1::from(row.tokens.clone())
}

#[cfg(test)]
mod tests {
    use metronome_core::Segment;

    use super::*;

    #[test]
    fn shared_prompt_mask_by_hand() {
        // Prompt of 2, responses of 2 and 1: positions P P A A B.
        let row = PackedRow {
            tokens: vec![10, 11, 20, 21, 30],
            positions: vec![0, 1, 2, 3, 2],
            segments: vec![
                Segment { start: 0, len: 2, parent: None },
                Segment { start: 2, len: 2, parent: Some(0) },
                Segment { start: 4, len: 1, parent: Some(0) },
            ],
        };
        let expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]];
        let m = attention_mask(&row);
        let add = dense_additive_mask(&row);
        for q in 0..5 {
            for k in 0..5 {
                assert_eq!(m[[q, k]], expected[q][k] == 1, "({q}, {k})");
                assert_eq!(m[[q, k]], row.can_attend(q, k), "({q}, {k})");
                assert_eq!(add[[q, k]], if expected[q][k] == 1 { 0.0 } else { f32::NEG_INFINITY });
            }
        }
        assert_eq!(position_ids(&row).to_vec(), vec![0, 1, 2, 3, 2]);
        let visible = expected.iter().flatten().filter(|&&x| x == 1).count() as u64;
        assert_eq!(attention_pairs(&row), AttentionPairs { dense: 25, visible });
        assert_eq!(token_ids(&row).len(), 5);
    }
}
