//! The attention of a batch's packed rows as one CPU op with its own backward: every
//! segment over the causal blocks that can be non-zero only.
//!
//! A segment's query `i` sees the first `visible + i + 1` of its keys: its ancestors'
//! `visible` keys, then its own causal prefix ([`super::SegmentPlan`]). Composed from
//! candle's products and the masked softmax, attention computes the whole `[lq, lk]`
//! square of every head and masks the upper triangle away, forward and in both
//! products of the backward. This op walks the queries in blocks of [`BLOCK`] rows and
//! multiplies each block by the keys its last query sees only: for a segment without
//! ancestors in `n` blocks that is `(n + 1) / 2n` of the square (5/8 at 256 queries).
//! The backward recomputes each block's probabilities from `q` and `k`, as flash
//! attention does, instead of keeping `[heads, lq, lk]` of them from the forward: one
//! product more per block, and no activation quadratic in the segment's length.
//!
//! One op covers every segment of every row, reading each segment's queries and keys
//! in place from the batch's `q`, `k` and `v` and writing its output and gradients in
//! place. Per segment, as candle ops, the queries and key spans were `narrow`s and a
//! `cat`, and each `narrow`'s backward builds a zero-padded gradient of the whole
//! batch that the graph then adds up: per layer, per segment, three full-size
//! tensors zeroed, copied and added (in the TRL-matched run, `memset` and `memmove`
//! of about 1.5% of each period, besides the adds).
//!
//! Segments run in row order; within one, heads run in parallel (rayon), each over its
//! blocks in order into buffers of its own; the query heads of a key/value head add
//! their key and value gradients in head order, and a key that several segments see
//! (a shared prompt) sums their gradients in segment order, so the result does not
//! depend on the number of threads.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{CpuStorage, Layout, Storage, Tensor};
use rayon::prelude::*;

use super::decode::exp_vectorisable;
use super::gemm::{Block, matmul};
use super::train::{RowPlans, SegmentPlan};
use super::{Buffers, FwdResult, contiguous_f32, fused_op_ran};
use crate::Result;

/// Query rows per block: the blocks' key ranges follow the diagonal in steps of this
/// many, and each product is at least this tall (gemm's kernels run at their peak from
/// about 64 rows here: a [64, 128] × [128, 64] product as fast per FLOP as a square one).
const BLOCK: usize = 64;

thread_local! {
    /// This thread's scratch for a head's probability blocks ([`with_scratch`]).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f` with two scratch slices of `n` elements, reused across heads, segments and
/// calls on this thread (fresh zeroed buffers per head and segment were most of the
/// op's remaining `memset`). Their contents are left over from earlier use: every
/// block of `p` and `dS` is written before it is read.
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < 2 * n {
                buf.resize(2 * n, 0.0);
            }
            let (a, b) = buf[..2 * n].split_at_mut(n);
            f(a, b)
        }
        // Re-entered on this thread (not done today): a buffer of its own.
        Err(_) => {
            let mut buf = vec![0f32; 2 * n];
            let (a, b) = buf.split_at_mut(n);
            f(a, b)
        }
    })
}

/// Attention of packed rows' segments: `q: [n, heads, hd]`, `k`, `v: [n, kv_heads, hd]`
/// of the rows concatenated, each segment's query `i` seeing its plan's ancestor keys
/// and its own keys up to `i`, scaled by `1/sqrt(hd)`; `[n, heads * hd]`, with its
/// backward. f32 on the CPU ([`crate::Kernels::Fused`]).
pub(crate) fn packed_attention(q: &Tensor, k: &Tensor, v: &Tensor, plans: &Arc<RowPlans>) -> Result<Tensor> {
    let op = PackedAttention { plans: Arc::clone(plans) };
    Ok(q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?)
}

#[derive(Debug, Clone)]
struct PackedAttention {
    plans: Arc<RowPlans>,
}

/// The batch's sizes: `n` positions, grouped-query heads of `hd` dimensions.
#[derive(Debug, Clone, Copy)]
pub(super) struct Heads {
    pub(super) n: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) hd: usize,
}

impl Heads {
    pub(super) fn new(q: &[usize], k: &[usize], v: &[usize]) -> candle_core::Result<Self> {
        let (&[n, heads, hd], &[nk, kv_heads, khd]) = (q, k) else {
            candle_core::bail!("packed-attention: q {q:?} and k {k:?} are not 3-d")
        };
        if k != v || nk != n || khd != hd || kv_heads == 0 || heads % kv_heads != 0 {
            candle_core::bail!("packed-attention: q {q:?}, k {k:?} and v {v:?} do not fit one another")
        }
        Ok(Self { n, heads, kv_heads, hd })
    }
}

/// One segment of the batch: its plan, and where its row starts among the positions.
#[derive(Clone, Copy)]
struct Span<'a> {
    row: usize,
    plan: &'a SegmentPlan,
}

impl Span<'_> {
    /// Every segment of `plans` in row order, checked to tile its row (so the spans'
    /// queries cover the batch's rows, each once), the rows to cover the batch's `n`
    /// positions and each plan's keys to lie in its row and end in its queries.
    fn all(plans: &RowPlans, n: usize) -> candle_core::Result<Vec<Span<'_>>> {
        let mut spans = Vec::with_capacity(plans.iter().map(|(_, row_plans)| row_plans.len()).sum());
        let mut row = 0;
        for (row_len, row_plans) in plans {
            let mut next = 0;
            for plan in row_plans {
                let keys: usize = plan.keys.iter().map(|k| k.1).sum();
                if plan.keys.iter().any(|&(s, l)| s + l > *row_len)
                    || plan.keys.last() != Some(&(plan.start, plan.len))
                    || plan.start != next
                    || plan.start + plan.len > *row_len
                    || keys != plan.visible + plan.len
                {
                    candle_core::bail!(
                        "packed-attention: segment at {} ({} queries, keys {:?}) does not fit its {row_len}-position row",
                        plan.start,
                        plan.len,
                        plan.keys
                    )
                }
                spans.push(Span { row, plan });
                next += plan.len;
            }
            if next != *row_len {
                candle_core::bail!("packed-attention: the segments of a {row_len}-position row cover {next}")
            }
            row += row_len;
        }
        if row != n {
            candle_core::bail!("packed-attention: the rows hold {row} positions, q {n}")
        }
        Ok(spans)
    }

    fn dims(self, b: Heads) -> Dims {
        let (lq, visible) = (self.plan.len, self.plan.visible);
        Dims { lq, lk: visible + lq, heads: b.heads, kv_heads: b.kv_heads, hd: b.hd, visible }
    }

    /// The segment's queries (and output rows) in a `[n, width]` buffer.
    fn queries(self, width: usize) -> Range<usize> {
        let first = (self.row + self.plan.start) * width;
        first..first + self.plan.len * width
    }

    /// The segment's keys in a `[n, width]` buffer, span by span, root first.
    fn keys(self, width: usize) -> impl Iterator<Item = Range<usize>> {
        self.plan.keys.iter().map(move |&(s, l)| (self.row + s) * width..(self.row + s + l) * width)
    }

    /// The segment's keys (or values) of `t: [n, width]` as one slice: in place when
    /// they are one span, otherwise copied into `buf`.
    fn gather<'b>(self, t: &'b [f32], width: usize, buf: &'b mut Vec<f32>) -> &'b [f32] {
        if let [(s, l)] = self.plan.keys[..] {
            return &t[(self.row + s) * width..(self.row + s + l) * width];
        }
        buf.clear();
        for r in self.keys(width) {
            buf.extend_from_slice(&t[r]);
        }
        buf
    }

    /// Adds a gradient of the segment's gathered keys (or values) into `t: [n, width]`.
    fn scatter_add(self, grad: &[f32], width: usize, t: &mut [f32]) {
        let mut from = 0;
        for r in self.keys(width) {
            let len = r.len();
            for (t, g) in t[r].iter_mut().zip(&grad[from..from + len]) {
                *t += g;
            }
            from += len;
        }
    }
}

/// The sizes of one segment.
#[derive(Debug, Clone, Copy)]
struct Dims {
    lq: usize,
    lk: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    visible: usize,
}

impl Dims {
    fn scale(self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }

    /// Rows `i0..i0 + rows` of head `h` in a `[lq, heads, hd]` buffer (q, the output
    /// and their gradients).
    fn query_rows(self, h: usize, i0: usize, rows: usize) -> Block {
        Block::rows(i0 * self.heads * self.hd + h * self.hd, rows, self.hd, self.heads * self.hd)
    }

    /// The first `n` keys (or values) of key/value head `g` in a `[lk, kv_heads, hd]` buffer.
    fn key_rows(self, g: usize, n: usize) -> Block {
        Block::rows(g * self.hd, n, self.hd, self.kv_heads * self.hd)
    }

    /// Per-head `[lq, hd]` buffers, in head order, into one `[lq, heads · hd]` buffer.
    fn interleave<'a>(self, heads: impl Iterator<Item = &'a [f32]> + Clone, out: &mut [f32]) {
        let mut rows = out.chunks_exact_mut(self.hd);
        for i in 0..self.lq {
            for (head, row) in heads.clone().zip(&mut rows) {
                row.copy_from_slice(&head[i * self.hd..(i + 1) * self.hd]);
            }
        }
    }

    /// The blocks of queries: `(i0, rows, keys)`, `keys` being those the last query sees.
    fn blocks(self) -> impl Iterator<Item = (usize, usize, usize)> {
        (0..self.lq).step_by(BLOCK).map(move |i0| {
            let rows = BLOCK.min(self.lq - i0);
            (i0, rows, self.visible + i0 + rows)
        })
    }

    /// Head `h`'s probabilities for the query block at `i0` into `p` (`[rows, keys]`,
    /// zero where a query may not look).
    fn probabilities(
        self,
        q: &[f32],
        k: &[f32],
        h: usize,
        (i0, rows, keys): (usize, usize, usize),
        p: &mut [f32],
    ) {
        let g = h / (self.heads / self.kv_heads);
        let pb = Block::rows(0, rows, keys, keys);
        matmul(p, pb, false, q, self.query_rows(h, i0, rows), k, self.key_rows(g, keys).t(), self.scale());
        crate::simd::dispatch(PrefixSoftmax { p: &mut p[..rows * keys], keys, first: self.visible + i0 + 1 });
    }
}

impl candle_core::CustomOp3 for PackedAttention {
    fn name(&self) -> &'static str {
        "packed-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> FwdResult {
        fused_op_ran();
        let b = Heads::new(l1.dims(), l2.dims(), l3.dims())?;
        let [q, k, v] = [(s1, l1), (s2, l2), (s3, l3)].map(|(s, l)| contiguous_f32(self.name(), s, l));
        let out = attend(q?, k?, v?, b, &self.plans, &Buffers::unpooled())?;
        Ok((CpuStorage::F32(out), (b.n, b.heads * b.hd).into()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let b = Heads::new(q.dims(), k.dims(), v.dims())?;
        let grad = grad.contiguous()?;
        // Read in place: q, k, v and the output are contiguous (the forward made them so).
        let guards = [q, k, v, out, &grad].map(Tensor::storage_and_layout);
        let host = |i: usize| -> candle_core::Result<&[f32]> {
            let (storage, layout) = &guards[i];
            match &**storage {
                Storage::Cpu(s) => contiguous_f32(self.name(), s, layout),
                _ => candle_core::bail!("packed-attention runs on the CPU"),
            }
        };
        let hosts = [host(0)?, host(1)?, host(2)?, host(3)?, host(4)?];
        let [dq, dk, dv] = attend_grad(hosts, b, &self.plans, &Buffers::unpooled())?;
        drop(guards);
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, q.shape(), dev)?),
            Some(Tensor::from_vec(dk, k.shape(), dev)?),
            Some(Tensor::from_vec(dv, v.shape(), dev)?),
        ))
    }
}

/// The attention of the segments of `plans` on host slices: `q: [n, heads, hd]`,
/// `k`, `v: [n, kv_heads, hd]` to `[n, heads · hd]` ([`PackedAttention`]'s forward,
/// which a decoder layer on host buffers runs too), in a buffer of `pool`.
pub(super) fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    b: Heads,
    plans: &RowPlans,
    pool: &Buffers,
) -> candle_core::Result<Vec<f32>> {
    let (qw, kw) = (b.heads * b.hd, b.kv_heads * b.hd);
    let spans = Span::all(plans, b.n)?;
    let mut scratch = Scratch::new(&spans, b, false, pool);
    let Scratch { work, kb, vb, .. } = &mut scratch;
    // The spans tile the rows: every output row is written by its segment.
    Ok(pool.output(b.n * qw, |out| {
        for span in &spans {
            let rows = span.queries(qw);
            let (ks, vs) = (span.gather(k, kw, kb), span.gather(v, kw, vb));
            forward(span.dims(b), &q[rows.clone()], ks, vs, &mut out[rows], &mut work.queries);
        }
    }))
}

/// The gradients `[dq, dk, dv]` of [`attend`] from its inputs, its output and the
/// output's gradient (`[q, k, v, out, d out]`), in buffers of `pool`.
pub(super) fn attend_grad(
    [qs, ks, vs, os, dos]: [&[f32]; 5],
    b: Heads,
    plans: &RowPlans,
    pool: &Buffers,
) -> candle_core::Result<[Vec<f32>; 3]> {
    let (qw, kw) = (b.heads * b.hd, b.kv_heads * b.hd);
    let spans = Span::all(plans, b.n)?;
    let (mut dk, mut dv) = (pool.zeros(b.n * kw), pool.zeros(b.n * kw));
    let mut scratch = Scratch::new(&spans, b, true, pool);
    let Scratch { work, kb, vb, .. } = &mut scratch;
    // The spans tile the rows: every row of dq is written by its segment.
    let dq = pool.output(b.n * qw, |dq| {
        for span in &spans {
            let rows = span.queries(qw);
            let (kg, vg) = (span.gather(ks, kw, kb), span.gather(vs, kw, vb));
            let (sq, so, sdo) = (&qs[rows.clone()], &os[rows.clone()], &dos[rows.clone()]);
            let (sdk, sdv) = backward(span.dims(b), sq, kg, vg, so, sdo, &mut dq[rows], work);
            span.scatter_add(sdk, kw, &mut dk);
            span.scatter_add(sdv, kw, &mut dv);
        }
    });
    Ok([dq, dk, dv])
}

/// One call's buffers for the work of its segments, sized for the longest one, reused
/// by each in turn and given back to the pool they came from when the call is done
/// (a decoder layer on host buffers finds them there at its next call).
struct Scratch<'p> {
    pool: &'p Buffers,
    work: Work,
    /// A segment's keys and values gathered from their spans, when they are several.
    kb: Vec<f32>,
    vb: Vec<f32>,
}

/// The per-head buffers of a segment's attention. A buffer per head and segment,
/// zeroed, was most of the op's allocations: with this and RMSNorm's gradient doing
/// the same, the TRL-matched run's allocator calls per period fell from 9,130 to 7,670
/// (zeroed ones from 1,160 to 310).
struct Work {
    /// `[heads, lq, hd]`: each head's queries' output, or their gradient.
    queries: Vec<f32>,
    /// `[heads, lk, hd]` twice: each head's key and value gradients.
    head_keys: Vec<f32>,
    /// `[lk, kv_heads · hd]` twice: the segment's key and value gradients.
    keys: Vec<f32>,
}

impl<'p> Scratch<'p> {
    /// The buffers for the longest segment of `spans`: each head's queries, the
    /// gathered keys and values, and with `grads` the key and value gradients the
    /// backward sums (each zeroed there, segment by segment).
    fn new(spans: &[Span<'_>], b: Heads, grads: bool, pool: &'p Buffers) -> Self {
        let (mut lq, mut lk) = (0, 0);
        for s in spans {
            lq = lq.max(s.plan.len);
            lk = lk.max(s.plan.visible + s.plan.len);
        }
        let (grads, kw) = (usize::from(grads), b.kv_heads * b.hd);
        let work = Work {
            queries: pool.scratch(b.heads * lq * b.hd),
            head_keys: pool.scratch(grads * 2 * b.heads * lk * b.hd),
            keys: pool.scratch(grads * 2 * lk * kw),
        };
        Scratch { pool, work, kb: pool.room(lk * kw), vb: pool.room(lk * kw) }
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        let Scratch { pool, work: Work { queries, head_keys, keys }, kb, vb } = self;
        pool.give([queries, head_keys, keys, kb, vb].map(std::mem::take));
    }
}

/// One segment's output `[lq, heads · hd]` into `out` from its queries `q: [lq, heads,
/// hd]` and its keys and values `[lk, kv_heads, hd]`, with each head's output in
/// `queries`.
fn forward(d: Dims, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], queries: &mut [f32]) {
    let hd = d.hd;
    if d.lq == 0 {
        return;
    }
    let per_head = &mut queries[..d.heads * d.lq * hd];
    per_head.par_chunks_mut(d.lq * hd).enumerate().for_each(|(h, hq)| {
        let g = h / (d.heads / d.kv_heads);
        // Each block writes its rows of `hq` whole.
        with_scratch(BLOCK.min(d.lq) * d.lk, |p, _| {
            for block @ (i0, rows, keys) in d.blocks() {
                d.probabilities(q, k, h, block, p);
                let pb = Block::rows(0, rows, keys, keys);
                matmul(hq, Block::rows(i0 * hd, rows, hd, hd), false, p, pb, v, d.key_rows(g, keys), 1.0);
            }
        });
    });
    d.interleave(per_head.chunks_exact(d.lq * hd), out);
}

/// One segment's gradients: of `q` into `dq` (`[lq, heads · hd]`), and those of its
/// keys and values (`[lk, kv_heads · hd]` each, in `scratch`), from the output `o`
/// and its gradient `dout`.
#[allow(clippy::too_many_arguments, reason = "a segment's five inputs, its output and the call's buffers")]
fn backward<'s>(
    d: Dims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    dout: &[f32],
    dq: &mut [f32],
    scratch: &'s mut Work,
) -> (&'s [f32], &'s [f32]) {
    let (hd, rep) = (d.hd, d.heads / d.kv_heads);
    let scale = d.scale();
    let kw = d.kv_heads * hd;
    let (dk, dv) = scratch.keys[..2 * d.lk * kw].split_at_mut(d.lk * kw);
    dk.fill(0.0);
    dv.fill(0.0);
    if d.lq == 0 {
        return (dk, dv);
    }
    // Per head: dq `[lq, hd]`, dk and dv `[lk, hd]`, the latter two summed over blocks.
    let hqs = &mut scratch.queries[..d.heads * d.lq * hd];
    let (hks, hvs) = scratch.head_keys[..2 * d.heads * d.lk * hd].split_at_mut(d.heads * d.lk * hd);
    hks.fill(0.0);
    hvs.fill(0.0);
    hqs.par_chunks_mut(d.lq * hd)
        .zip(hks.par_chunks_mut(d.lk * hd).zip(hvs.par_chunks_mut(d.lk * hd)))
        .enumerate()
        .for_each(|(h, (hq, (dk, dv)))| {
            let g = h / rep;
            with_scratch(BLOCK.min(d.lq) * d.lk, |p, ds| {
                for block @ (i0, rows, keys) in d.blocks() {
                    d.probabilities(q, k, h, block, p);
                    let (pb, kb, qb) =
                        (Block::rows(0, rows, keys, keys), d.key_rows(g, keys), d.query_rows(h, i0, rows));
                    let key_grad = Block::rows(0, keys, hd, hd);
                    // dV += Pᵀ·dO; dP = dO·Vᵀ; dS = P ⊙ (dP − rowsum(dO ⊙ O)).
                    matmul(dv, key_grad, true, p, pb.t(), dout, qb, 1.0);
                    matmul(ds, pb, false, dout, qb, v, kb.t(), 1.0);
                    let n = rows * keys;
                    crate::simd::dispatch(ScoreGrad {
                        ds: &mut ds[..n],
                        p: &p[..n],
                        keys,
                        dout,
                        o,
                        rows: qb,
                    });
                    // dQ = scale · dS·K; dK += scale · dSᵀ·Q.
                    matmul(hq, Block::rows(i0 * hd, rows, hd, hd), false, ds, pb, k, kb, scale);
                    matmul(dk, key_grad, true, ds, pb.t(), q, qb, scale);
                }
            });
        });
    d.interleave(hqs.chunks_exact(d.lq * hd), dq);
    // Each key/value head sums its query heads' gradients in head order.
    for (h, (hk, hv)) in hks.chunks_exact(d.lk * hd).zip(hvs.chunks_exact(d.lk * hd)).enumerate() {
        let g = h / rep;
        for j in 0..d.lk {
            let at = j * kw + g * hd;
            for (t, s) in dk[at..at + hd].iter_mut().zip(&hk[j * hd..(j + 1) * hd]) {
                *t += s;
            }
            for (t, s) in dv[at..at + hd].iter_mut().zip(&hv[j * hd..(j + 1) * hd]) {
                *t += s;
            }
        }
    }
    (dk, dv)
}

/// `dS = P ⊙ (dP − rowsum(dO ⊙ O))` in place of `ds` (holding `dP`), `[rows, keys]`,
/// for the query rows `rows` of `dout` and `o`; compiled for the instruction set
/// `simd::dispatch` picks.
struct ScoreGrad<'a> {
    ds: &'a mut [f32],
    p: &'a [f32],
    keys: usize,
    dout: &'a [f32],
    o: &'a [f32],
    rows: Block,
}

impl pulp::WithSimd for ScoreGrad<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let ScoreGrad { ds, p, keys, dout, o, rows } = self;
        for (r, (ds, p)) in ds.chunks_exact_mut(keys).zip(p.chunks_exact(keys)).enumerate() {
            let at = rows.offset + r * rows.rs;
            let dot: f32 =
                dout[at..at + rows.cols].iter().zip(&o[at..at + rows.cols]).map(|(a, b)| a * b).sum();
            for (s, &pr) in ds.iter_mut().zip(p) {
                *s = pr * (*s - dot);
            }
        }
    }
}

/// Softmax of each row of `p: [rows, keys]` over its first `first + r` entries (row
/// `r`), the rest set to zero; compiled for the instruction set `simd::dispatch` picks,
/// with the branch-free `exp` of the decode kernels. The row's max and sum run in
/// [`LANES`] independent lanes, added in a fixed order after: a single running max or
/// sum is a chain of dependent operations the compiler may not reorder, and ran at a
/// few cycles per key (a tenth of the training step).
struct PrefixSoftmax<'a> {
    p: &'a mut [f32],
    keys: usize,
    first: usize,
}

/// Lanes of [`PrefixSoftmax`]'s reductions: one AVX-512 register of f32.
const LANES: usize = 16;

impl pulp::WithSimd for PrefixSoftmax<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let PrefixSoftmax { p, keys, first } = self;
        for (r, row) in p.chunks_exact_mut(keys).enumerate() {
            let (seen, hidden) = row.split_at_mut((first + r).min(keys));
            let mut lanes = [f32::NEG_INFINITY; LANES];
            let mut chunks = seen.chunks_exact(LANES);
            for c in &mut chunks {
                for (m, &x) in lanes.iter_mut().zip(c) {
                    *m = m.max(x);
                }
            }
            let max = chunks.remainder().iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max);
            let mut lanes = [0f32; LANES];
            let mut chunks = seen.chunks_exact_mut(LANES);
            for c in &mut chunks {
                for (s, x) in lanes.iter_mut().zip(c) {
                    *x = exp_vectorisable(*x - max);
                    *s += *x;
                }
            }
            let mut sum = lanes.iter().sum::<f32>();
            for x in chunks.into_remainder() {
                *x = exp_vectorisable(*x - max);
                sum += *x;
            }
            let inv = 1.0 / sum;
            for x in seen.iter_mut() {
                *x *= inv;
            }
            hidden.fill(0.0);
        }
    }
}
