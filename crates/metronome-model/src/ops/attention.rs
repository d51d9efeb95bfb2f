//! The attention of one packed segment as one CPU op with its own backward, over the
//! causal blocks that can be non-zero only.
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
//! Heads run in parallel (rayon), each over its blocks in order into buffers of its
//! own; the query heads of a key/value head add their key and value gradients in head
//! order, so the result does not depend on the number of threads.

use candle_core::{CpuStorage, Layout, Tensor};
use rayon::prelude::*;

use super::decode::exp_vectorisable;
use super::gemm::{Block, matmul};
use super::{FwdResult, contiguous_f32, fused_op_ran};
use crate::Result;

/// Query rows per block: the blocks' key ranges follow the diagonal in steps of this
/// many, and each product is at least this tall (gemm's kernels run at their peak from
/// about 64 rows here: a [64, 128] × [128, 64] product as fast per FLOP as a square one).
const BLOCK: usize = 64;

/// Attention of `q: [lq, heads, hd]` to `k`, `v: [visible + lq, kv_heads, hd]`, query `i`
/// seeing keys `0..=visible + i`, scaled by `1/sqrt(hd)`; `[lq, heads * hd]`, with its
/// backward. f32 on the CPU ([`crate::Kernels::Fused`]).
pub(crate) fn prefix_attention(q: &Tensor, k: &Tensor, v: &Tensor, visible: usize) -> Result<Tensor> {
    Ok(q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, PrefixAttention { visible })?)
}

#[derive(Debug, Clone, Copy)]
struct PrefixAttention {
    visible: usize,
}

/// The sizes of one call, checked against each other.
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
    fn new(q: &[usize], k: &[usize], v: &[usize], visible: usize) -> candle_core::Result<Self> {
        let (&[lq, heads, hd], &[lk, kv_heads, khd]) = (q, k) else {
            candle_core::bail!("prefix-attention: q {q:?} and k {k:?} are not 3-d")
        };
        if k != v || khd != hd || kv_heads == 0 || heads % kv_heads != 0 || lk != visible + lq {
            candle_core::bail!(
                "prefix-attention: q {q:?}, k {k:?} and v {v:?} do not fit {visible} visible keys before the queries"
            )
        }
        Ok(Self { lq, lk, heads, kv_heads, hd, visible })
    }

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

    /// Per-head `[lq, hd]` buffers, in head order, as one `[lq, heads · hd]` buffer.
    fn interleave<'a>(self, heads: impl Iterator<Item = &'a [f32]> + Clone) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.lq * self.heads * self.hd);
        for i in 0..self.lq {
            for head in heads.clone() {
                out.extend_from_slice(&head[i * self.hd..(i + 1) * self.hd]);
            }
        }
        out
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

impl candle_core::CustomOp3 for PrefixAttention {
    fn name(&self) -> &'static str {
        "prefix-attention"
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
        let d = Dims::new(l1.dims(), l2.dims(), l3.dims(), self.visible)?;
        let [q, k, v] = [(s1, l1), (s2, l2), (s3, l3)].map(|(s, l)| contiguous_f32(self.name(), s, l));
        let (q, k, v) = (q?, k?, v?);
        let hd = d.hd;
        let per_head: Vec<Vec<f32>> = (0..d.heads)
            .into_par_iter()
            .map(|h| {
                let g = h / (d.heads / d.kv_heads);
                let mut out = vec![0f32; d.lq * hd];
                let mut p = vec![0f32; BLOCK.min(d.lq) * d.lk];
                for block @ (i0, rows, keys) in d.blocks() {
                    d.probabilities(q, k, h, block, &mut p);
                    let pb = Block::rows(0, rows, keys, keys);
                    matmul(
                        &mut out,
                        Block::rows(i0 * hd, rows, hd, hd),
                        false,
                        &p,
                        pb,
                        v,
                        d.key_rows(g, keys),
                        1.0,
                    );
                }
                out
            })
            .collect();
        let out = d.interleave(per_head.iter().map(Vec::as_slice));
        Ok((CpuStorage::F32(out), (d.lq, d.heads * hd).into()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = Dims::new(q.dims(), k.dims(), v.dims(), self.visible)?;
        let host = |t: &Tensor| t.contiguous()?.flatten_all()?.to_vec1::<f32>();
        let (qs, ks, vs, os, dos) = (host(q)?, host(k)?, host(v)?, host(out)?, host(grad)?);
        let (dq, dk, dv) = backward(d, &qs, &ks, &vs, &os, &dos);
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, q.shape(), dev)?),
            Some(Tensor::from_vec(dk, k.shape(), dev)?),
            Some(Tensor::from_vec(dv, v.shape(), dev)?),
        ))
    }
}

/// The gradients of `q`, `k` and `v` from the output `o` and its gradient `dout`.
fn backward(
    d: Dims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    dout: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (hd, rep) = (d.hd, d.heads / d.kv_heads);
    let scale = d.scale();
    // Per head: dq `[lq, hd]`, dk and dv `[lk, hd]`.
    let per_head: Vec<[Vec<f32>; 3]> = (0..d.heads)
        .into_par_iter()
        .map(|h| {
            let g = h / rep;
            let (mut dq, mut dk, mut dv) =
                (vec![0f32; d.lq * hd], vec![0f32; d.lk * hd], vec![0f32; d.lk * hd]);
            let mut p = vec![0f32; BLOCK.min(d.lq) * d.lk];
            let mut ds = vec![0f32; BLOCK.min(d.lq) * d.lk];
            for block @ (i0, rows, keys) in d.blocks() {
                d.probabilities(q, k, h, block, &mut p);
                let (pb, kb, qb) =
                    (Block::rows(0, rows, keys, keys), d.key_rows(g, keys), d.query_rows(h, i0, rows));
                let key_grad = Block::rows(0, keys, hd, hd);
                // dV += Pᵀ·dO; dP = dO·Vᵀ; dS = P ⊙ (dP − rowsum(dO ⊙ O)).
                matmul(&mut dv, key_grad, true, &p, pb.t(), dout, qb, 1.0);
                matmul(&mut ds, pb, false, dout, qb, v, kb.t(), 1.0);
                let n = rows * keys;
                crate::simd::dispatch(ScoreGrad { ds: &mut ds[..n], p: &p[..n], keys, dout, o, rows: qb });
                // dQ = scale · dS·K; dK += scale · dSᵀ·Q.
                matmul(&mut dq, Block::rows(i0 * hd, rows, hd, hd), false, &ds, pb, k, kb, scale);
                matmul(&mut dk, key_grad, true, &ds, pb.t(), q, qb, scale);
            }
            [dq, dk, dv]
        })
        .collect();
    let dq = d.interleave(per_head.iter().map(|[dq, _, _]| dq.as_slice()));
    // Each key/value head sums its query heads' gradients in head order.
    let (mut dk, mut dv) = (vec![0f32; d.lk * d.kv_heads * hd], vec![0f32; d.lk * d.kv_heads * hd]);
    for (h, [_, hk, hv]) in per_head.iter().enumerate() {
        let g = h / rep;
        for j in 0..d.lk {
            let at = j * d.kv_heads * hd + g * hd;
            for (t, s) in dk[at..at + hd].iter_mut().zip(&hk[j * hd..(j + 1) * hd]) {
                *t += s;
            }
            for (t, s) in dv[at..at + hd].iter_mut().zip(&hv[j * hd..(j + 1) * hd]) {
                *t += s;
            }
        }
    }
    (dq, dk, dv)
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
