//! The tiles of the CUDA flash attention (`kernels/attention.cu`, launched by
//! `src/cuda.rs`), laid out on the host from a batch's segment plans: which segment each
//! block of queries or keys belongs to, every segment's key list as global positions,
//! and which segments see a segment's keys. Plain data, built and tested without a GPU;
//! the kernels' own arithmetic is checked on the CPU by `kernels/emulate/`
//! (`tests/it/kernels_on_cpu.rs`), which builds the same layout in C++.

use super::train::RowPlans;
use crate::{Error, Result};

/// Queries per tile of the forward and `dq` kernels, and keys per tile of `dkv`
/// (`QB`, `KB` in `kernels/attention.cu`).
pub(crate) const TILE: u32 = 32;

/// Everything the kernels read besides the tensors, as the `u32` arrays they take
/// (`kernels/attention.cu` describes each).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct FlashTiles {
    /// Per segment: the row's first global position, the segment's start in its row,
    /// its length, its ancestors' key count (`visible`), the offset of its key list.
    pub(crate) seg: Vec<u32>,
    /// The key lists: ancestors' positions root first, then the segment's own, global.
    pub(crate) keys: Vec<u32>,
    /// `(segment, first query)` of every tile of [`TILE`] queries.
    pub(crate) qtiles: Vec<u32>,
    /// `(segment, first key)` of every tile of [`TILE`] of a segment's own positions.
    pub(crate) ktiles: Vec<u32>,
    /// Segment `s`'s viewers are `viewers[vrange[s]..vrange[s + 1]]`.
    pub(crate) vrange: Vec<u32>,
    /// Per segment: itself, then every segment whose ancestors include it.
    pub(crate) viewers: Vec<u32>,
    /// The batch's positions.
    pub(crate) n: u32,
}

impl FlashTiles {
    /// The layout of `plans`' rows, concatenated in order. Errors when a count passes
    /// `u32` or an ancestor span is not a whole earlier segment of its row (the plans
    /// the model builds never do either).
    pub(crate) fn new(plans: &RowPlans) -> Result<Self> {
        let big = |what: &str| Error::invalid("flash attention", format!("{what} passes u32"));
        let u = |x: usize, what: &str| u32::try_from(x).map_err(|_| big(what));
        let mut t = Self::default();
        let mut viewers: Vec<Vec<u32>> = Vec::new();
        let mut row_start = 0usize;
        for (row_len, row_plans) in plans {
            let first = viewers.len();
            for (i, plan) in row_plans.iter().enumerate() {
                let s = u(first + i, "segments")?;
                viewers.push(vec![s]);
                let (ancestors, own) = plan.keys.split_at(plan.keys.len().saturating_sub(1));
                for &(start, len) in ancestors {
                    let owner = row_plans[..i]
                        .iter()
                        .position(|p| (p.start, p.len) == (start, len))
                        .ok_or_else(|| {
                            Error::invalid(
                                "flash attention",
                                format!(
                                    "the keys ({start}, {len}) of segment {i} are not an earlier segment"
                                ),
                            )
                        })?;
                    viewers[first + owner].push(s);
                }
                if own != [(plan.start, plan.len)] {
                    return Err(Error::invalid(
                        "flash attention",
                        format!("segment {i}'s key list does not end in its own positions"),
                    ));
                }
                t.seg.extend([
                    u(row_start, "positions")?,
                    u(plan.start, "positions")?,
                    u(plan.len, "positions")?,
                    u(plan.visible, "keys")?,
                    u(t.keys.len(), "keys")?,
                ]);
                for &(start, len) in &plan.keys {
                    for p in row_start + start..row_start + start + len {
                        t.keys.push(u(p, "positions")?);
                    }
                }
                let len = u(plan.len, "positions")?;
                for first in (0..len).step_by(TILE as usize) {
                    t.qtiles.extend([s, first]);
                    t.ktiles.extend([s, first]);
                }
            }
            row_start += row_len;
        }
        t.vrange.push(0);
        for v in viewers {
            t.viewers.extend(v);
            t.vrange.push(u(t.viewers.len(), "viewers")?);
        }
        t.n = u(row_start, "positions")?;
        Ok(t)
    }

    /// The tiles of queries (of keys: the same count, one per [`TILE`] positions of
    /// each segment).
    pub(crate) fn tiles(&self) -> u32 {
        (self.qtiles.len() / 2) as u32
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use candle_core::Device;
    use metronome_core::{PackedRow, Segment};

    use super::*;
    use crate::ops::segment_plans;

    /// Rows of a shared prompt (40 positions) with responses of 70, 33 and 5, a plain
    /// row of 37, and a nested tree, the rows the CPU emulation also runs.
    fn plans() -> RowPlans {
        let row = |segs: &[(u32, Option<u32>)]| {
            let mut start = 0;
            let segments = segs
                .iter()
                .map(|&(len, parent)| {
                    let s = Segment { start, len, parent };
                    start += len;
                    s
                })
                .collect();
            PackedRow { tokens: vec![1; start as usize], positions: (0..start).collect(), segments }
        };
        [
            row(&[(40, None), (70, Some(0)), (33, Some(0)), (5, Some(0))]),
            row(&[(37, None)]),
            row(&[(10, None), (12, Some(0)), (9, Some(1)), (3, Some(0))]),
        ]
        .iter()
        .map(|r| (r.len(), segment_plans(r, &Device::Cpu).unwrap()))
        .collect()
    }

    /// The `(query, key)` pairs, as global positions, that `plans` lets attend.
    fn visible(plans: &RowPlans) -> BTreeSet<(u32, u32)> {
        let mut pairs = BTreeSet::new();
        let mut row = 0;
        for (len, row_plans) in plans {
            for p in row_plans {
                let keys: Vec<usize> = p.keys.iter().flat_map(|&(s, l)| s..s + l).collect();
                for i in 0..p.len {
                    for &k in &keys[..p.visible + i + 1] {
                        pairs.insert(((row + p.start + i) as u32, (row + k) as u32));
                    }
                }
            }
            row += len;
        }
        pairs
    }

    /// The forward and `dq` kernels' loops over the layout: each query tile's queries
    /// against its segment's key list up to each query's bound. Every pair once.
    fn query_side(t: &FlashTiles) -> Vec<(u32, u32)> {
        let mut pairs = Vec::new();
        for tile in t.qtiles.chunks(2) {
            let sg = &t.seg[5 * tile[0] as usize..][..5];
            let (base, len, visible, off) = (sg[0] + sg[1], sg[2], sg[3], sg[4] as usize);
            for i in tile[1]..(tile[1] + TILE).min(len) {
                for j in 0..visible + i + 1 {
                    pairs.push((base + i, t.keys[off + j as usize]));
                }
            }
        }
        pairs
    }

    /// The `dkv` kernel's loops: each key tile's keys against its viewers' queries (its
    /// own segment's from the key on).
    fn key_side(t: &FlashTiles) -> Vec<(u32, u32)> {
        let mut pairs = Vec::new();
        for tile in t.ktiles.chunks(2) {
            let s = tile[0] as usize;
            let sg = &t.seg[5 * s..][..5];
            for jl in tile[1]..(tile[1] + TILE).min(sg[2]) {
                for &w in &t.viewers[t.vrange[s] as usize..t.vrange[s + 1] as usize] {
                    let sw = &t.seg[5 * w as usize..][..5];
                    let from = if w as usize == s { jl } else { 0 };
                    for i in from..sw[2] {
                        pairs.push((sw[0] + sw[1] + i, sg[0] + sg[1] + jl));
                    }
                }
            }
        }
        pairs
    }

    #[test]
    fn both_sides_of_the_layout_cover_every_visible_pair_once() {
        let plans = plans();
        let t = FlashTiles::new(&plans).unwrap();
        let want = visible(&plans);
        for (side, mut pairs) in [("query", query_side(&t)), ("key", key_side(&t))] {
            let n = pairs.len();
            pairs.sort_unstable();
            pairs.dedup();
            assert_eq!(pairs.len(), n, "the {side} side visits a pair twice");
            assert_eq!(pairs.into_iter().collect::<BTreeSet<_>>(), want, "the {side} side's pairs");
        }
        assert_eq!(t.n, 40 + 70 + 33 + 5 + 37 + 10 + 12 + 9 + 3);
        // Tiles: 2 + 3 + 2 + 1, 2, 1 + 1 + 1 + 1.
        assert_eq!(t.tiles(), 14);
        // The prompt of the first row is seen by its three responses; the nested tree's
        // root by all three of its others, its second segment by the third.
        assert_eq!(&t.viewers[t.vrange[0] as usize..t.vrange[1] as usize], &[0, 1, 2, 3]);
        assert_eq!(&t.viewers[t.vrange[5] as usize..t.vrange[6] as usize], &[5, 6, 7, 8]);
        assert_eq!(&t.viewers[t.vrange[6] as usize..t.vrange[7] as usize], &[6, 7]);
    }

    #[test]
    fn a_key_span_that_is_no_earlier_segment_is_refused() {
        let mut plans = plans();
        plans[0].1[1].keys[0] = (1, 39);
        let e = FlashTiles::new(&plans).unwrap_err().to_string();
        assert!(e.contains("(1, 39) of segment 1 are not an earlier segment"), "{e}");
    }
}
