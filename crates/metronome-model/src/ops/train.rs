//! The training kernels: fused ops with their own backward (RMSNorm, the masked
//! softmax, SwiGLU, the log-prob and entropy head) and the plans of a packed row's
//! per-segment attention (`Kernels::attention` computes it).

use candle_core::{CpuStorage, D, Device, Layout, Tensor};
use rayon::prelude::*;

use super::decode::exp_vectorisable;
use super::{
    CpuOp3, FwdResult, Op3, Operand, SwiGlu, contiguous_f32, contiguous_f32_pair, dot, fused_op_ran, output,
};
use crate::Result;

/// RMSNorm over the last dimension, as Hugging Face computes it:
/// `w * x / sqrt(mean(x²) + eps)`, in one pass forward, with its backward.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })?)
}

/// Fused RMSNorm: candle-nn's fused kernel has no backward (docs/design.md §6), and the
/// composed form costs seven allocating ops forward and more backward.
#[derive(Debug, Clone, Copy)]
struct RmsNorm {
    eps: f32,
}

impl candle_core::CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> FwdResult {
        fused_op_ran();
        let (x, w) = contiguous_f32_pair(self.name(), (s1, l1), (s2, l2))?;
        let d = w.len();
        if l1.dims().last() != Some(&d) {
            candle_core::bail!("rms-norm: weight of {d} does not fit input {:?}", l1.dims())
        }
        let out = output(x.len(), |out| rms_norm_rows(x, w, self.eps, out));
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // Both gradients in one op, `[rows · d + d]`: dx's rows, then dw.
        let d = w.elem_count();
        let both = x.apply_op3_no_bwd(w, &g.contiguous()?, &Op3(RmsNormGrad { eps: self.eps }))?;
        let dx = both.narrow(0, 0, x.elem_count())?.reshape(x.shape())?;
        Ok((Some(dx), Some(both.narrow(0, x.elem_count(), d)?)))
    }
}

/// `out = x / rms(x) · w` row by row for rows of `w.len()` values: [`RmsNorm`]'s
/// forward, which the decode step on host buffers runs too (the same bits).
pub(crate) fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    crate::simd::dispatch(RmsNormRows { x, w, eps, out });
}

/// The loop of [`rms_norm_rows`], compiled for the instruction set `simd::dispatch`
/// picks. Each row's sum of squares is [`dot`]'s eight fixed lanes: the sum as one
/// chain of scalar additions was 2.8% of the TRL-matched run (a period's rows are
/// normed five times forward, in the reference model again, and in the backward).
struct RmsNormRows<'a> {
    x: &'a [f32],
    w: &'a [f32],
    eps: f32,
    out: &'a mut [f32],
}

impl pulp::WithSimd for RmsNormRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let RmsNormRows { x, w, eps, out } = self;
        let d = w.len();
        for (xs, os) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let r = 1.0 / (dot(xs, xs) / d as f32 + eps).sqrt();
            for ((o, &v), &g) in os.iter_mut().zip(xs).zip(w) {
                *o = v * r * g;
            }
        }
    }
}

/// The backward of [`RmsNorm`] in one pass over the rows. With `r = 1/rms(x)` and
/// `x̂ = x·r`: `dx = r·(g·w − x̂·mean(g·w·x̂))` per row and `dw = Σ_rows g·x̂`. As
/// candle ops this was seven allocating ops, the row sum of `dw` a strided reduction
/// among them: 8% of a training step of the tiny model. `dw` is summed in blocks of
/// [`RMS_GRAD_ROWS`] rows in parallel, the blocks' sums added in order, so the
/// result does not depend on the number of threads.
#[derive(Debug, Clone, Copy)]
struct RmsNormGrad {
    eps: f32,
}

/// Rows per parallel block of [`RmsNormGrad`].
const RMS_GRAD_ROWS: usize = 64;

impl CpuOp3 for RmsNormGrad {
    const NAME: &'static str = "rms-norm-grad";

    fn forward(&self, [(s1, l1), (s2, l2), (s3, l3)]: [Operand<'_>; 3]) -> FwdResult {
        let (x, w) = contiguous_f32_pair(Self::NAME, (s1, l1), (s2, l2))?;
        let g = contiguous_f32(Self::NAME, s3, l3)?;
        let d = w.len();
        if l1.dims().last() != Some(&d) || l1.dims() != l3.dims() {
            candle_core::bail!(
                "rms-norm-grad: input {:?}, weight {:?} and gradient {:?} do not fit",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        let out = output(x.len() + d, |out| {
            let (dx, dw) = out.split_at_mut(x.len());
            rms_norm_grad(x, w, g, self.eps, dx, dw);
        });
        Ok((CpuStorage::F32(out), vec![x.len() + d].into()))
    }
}

/// [`RmsNormGrad`] on host slices: `dx` (the size of `x`) and `dw` (of `w`) written
/// whole from the input `x`, the weight `w` and the output's gradient `g`.
pub(crate) fn rms_norm_grad(x: &[f32], w: &[f32], g: &[f32], eps: f32, dx: &mut [f32], dw: &mut [f32]) {
    let d = w.len();
    dw.fill(0.0);
    if d == 0 {
        return;
    }
    let block = RMS_GRAD_ROWS * d;
    // Per block of rows: its share of `dw`, and room for one row's `g ⊙ w` (one buffer
    // for the call: one per block was a few dozen allocations per norm).
    let mut partial = vec![0f32; x.len().div_ceil(block) * 2 * d];
    dx.par_chunks_mut(block)
        .zip(x.par_chunks(block).zip(g.par_chunks(block)))
        .zip(partial.par_chunks_mut(2 * d))
        .for_each(|((dx, (x, g)), scratch)| {
            let (dw, gw) = scratch.split_at_mut(d);
            crate::simd::dispatch(RmsGradRows { dx, x, g, w, eps, dw, gw });
        });
    for block in partial.chunks_exact(2 * d) {
        for (t, s) in dw.iter_mut().zip(&block[..d]) {
            *t += s;
        }
    }
}

/// One block of rows of [`RmsNormGrad`]: `dx` of each row, and the block's `dw`
/// summed into `dw` in row order; compiled for the instruction set `simd::dispatch`
/// picks, each row's sums in [`dot`]'s fixed lanes.
struct RmsGradRows<'a> {
    dx: &'a mut [f32],
    x: &'a [f32],
    g: &'a [f32],
    w: &'a [f32],
    eps: f32,
    dw: &'a mut [f32],
    /// Room for a row's `g ⊙ w`, `d` elements.
    gw: &'a mut [f32],
}

impl pulp::WithSimd for RmsGradRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let RmsGradRows { dx, x, g, w, eps, dw, gw } = self;
        let d = w.len();
        for ((dx, x), g) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(g.chunks_exact(d)) {
            let r = 1.0 / (dot(x, x) / d as f32 + eps).sqrt();
            for ((t, &g), &w) in gw.iter_mut().zip(g).zip(w) {
                *t = g * w;
            }
            // mean(g·w·x̂) = r · mean(g·w·x).
            let mean = dot(gw, x) * r / d as f32;
            for (((o, &x), &t), (&g, acc)) in dx.iter_mut().zip(x).zip(&*gw).zip(g.iter().zip(dw.iter_mut()))
            {
                let xhat = x * r;
                *o = r * (t - xhat * mean);
                *acc += g * xhat;
            }
        }
    }
}

/// Softmax over the last dimension. The max is subtracted for stability and
/// detached: softmax is shift-invariant, so its gradient through the max is zero.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// `softmax(scores + mask)` over the last dimension in one pass, with its backward.
///
/// The attention probabilities are the largest activations of the training forward;
/// as separate candle ops (add, max, sub, exp, sum, div) each would allocate and walk
/// a fresh `[heads, q, k]` buffer forward and again backward. `scores` is
/// `[.., lq, lk]`, `mask` is `[lq, lk]` and broadcast over the leading dimensions;
/// only `scores` receives a gradient.
#[derive(Debug, Clone, Copy)]
struct MaskedSoftmax;

impl candle_core::CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> FwdResult {
        fused_op_ran();
        let (x, mask) = contiguous_f32_pair(self.name(), (s1, l1), (s2, l2))?;
        let dims = l1.dims();
        let lk = dims[dims.len() - 1];
        let lq = dims[dims.len() - 2];
        if l2.dims() != [lq, lk] {
            candle_core::bail!("masked-softmax: mask {:?} does not fit scores {:?}", l2.dims(), dims)
        }
        // Filled row by row rather than zeroed first: this is the largest buffer of the
        // forward, and zeroing it was a visible share of the step's `memset`.
        let mut out = Vec::with_capacity(x.len());
        crate::simd::dispatch(MaskedSoftmaxRows { x, mask, lq, lk, out: &mut out });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _mask: &Tensor,
        p: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(p.apply_op2_no_bwd(&g.contiguous()?, &SoftmaxGrad)?), None))
    }
}

/// The rows of [`MaskedSoftmax`]'s forward, compiled for the instruction set
/// `simd::dispatch` picks. The branch-free `exp` vectorises, so it runs on every
/// entry and masked ones are selected to exactly zero after; the row's sum stays in
/// order.
struct MaskedSoftmaxRows<'a> {
    x: &'a [f32],
    mask: &'a [f32],
    lq: usize,
    lk: usize,
    out: &'a mut Vec<f32>,
}

impl pulp::WithSimd for MaskedSoftmaxRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let MaskedSoftmaxRows { x, mask, lq, lk, out } = self;
        for (r, xs) in x.chunks_exact(lk).enumerate() {
            let ms = &mask[(r % lq) * lk..(r % lq + 1) * lk];
            let at = out.len();
            out.extend(xs.iter().zip(ms).map(|(&a, &m)| a + m));
            let os = &mut out[at..];
            let max = os.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for o in os.iter_mut() {
                let e = exp_vectorisable(*o - max);
                *o = if *o == f32::NEG_INFINITY { 0.0 } else { e };
            }
            let sum: f32 = os.iter().sum();
            let inv = 1.0 / sum;
            for o in os.iter_mut() {
                *o *= inv;
            }
        }
    }
}

/// The backward of a softmax over the last dimension in one pass: from the
/// probabilities `p` and the output gradient `g`, `p · (g − Σ g·p)` per row (as candle
/// ops: a product, a sum, a broadcast subtraction and a product, each allocating).
#[derive(Debug, Clone, Copy)]
struct SoftmaxGrad;

impl candle_core::CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> FwdResult {
        fused_op_ran();
        let (p, g) = contiguous_f32_pair(self.name(), (s1, l1), (s2, l2))?;
        if l1.dims() != l2.dims() {
            candle_core::bail!(
                "softmax-grad: probabilities {:?} and gradient {:?} differ",
                l1.dims(),
                l2.dims()
            )
        }
        let lk = l1.dims().last().copied().unwrap_or(1).max(1);
        let mut out = Vec::with_capacity(p.len());
        for (ps, gs) in p.chunks_exact(lk).zip(g.chunks_exact(lk)) {
            let dot: f32 = ps.iter().zip(gs).map(|(a, b)| a * b).sum();
            out.extend(ps.iter().zip(gs).map(|(&a, &b)| a * (b - dot)));
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// `softmax(scores + mask)` over the last dimension; see [`MaskedSoftmax`].
pub(crate) fn masked_softmax(scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(scores.contiguous()?.apply_op2(&mask.contiguous()?, MaskedSoftmax)?)
}

/// Log-softmax over the last dimension (max detached, as in [`softmax_last_dim`]).
/// The loop of [`SwiGluGrad`], vectorised as [`SwiGlu`]'s forward is (the same `exp`).
pub(super) struct SwiGluGradLoop<'a> {
    pub(super) g: &'a [f32],
    pub(super) u: &'a [f32],
    pub(super) dy: &'a [f32],
    pub(super) dg: &'a mut [f32],
    pub(super) du: &'a mut [f32],
}

impl pulp::WithSimd for SwiGluGradLoop<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let SwiGluGradLoop { g, u, dy, dg, du } = self;
        for i in 0..g.len() {
            let (x, d) = (g[i], dy[i]);
            let s = 1.0 / (1.0 + exp_vectorisable(-x));
            du[i] = d * x * s;
            dg[i] = d * u[i] * s * (1.0 + x * (1.0 - s));
        }
    }
}

#[cfg(test)]
pub(crate) fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let z = x.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(z.broadcast_sub(&lse)?)
}

/// For each row of `logits: [n, vocab]`, the log-prob of its target token and the
/// entropy of its distribution at a sampling temperature, as `[n, 2]`, with its
/// backward.
///
/// As candle ops this is a scale, a log-softmax (six ops), a gather, and exp, product,
/// sum and negation for the entropy, each with a backward that allocates
/// `[n, vocab]` again. With `z = logits / T`, `p = softmax(z)`, `H = −Σ p log p` and
/// `t` the target: `d log p_t / d z_j = [j = t] − p_j` and
/// `d H / d z_j = −p_j (log p_j + H)`, and `d z / d logits = 1 / T`.
#[derive(Debug, Clone)]
struct TargetLogProbs {
    targets: std::sync::Arc<Vec<u32>>,
    /// `1 / T`, multiplied into the logits as the rollout engine's sampler does (so
    /// both round alike); exactly 1 skips the product.
    inv_temperature: f32,
}

impl TargetLogProbs {
    /// The contiguous logits and their row width, checked against the targets.
    fn rows<'a>(&self, op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<(&'a [f32], usize)> {
        let z = contiguous_f32(op, s, l)?;
        let (n, vocab) = l.shape().dims2()?;
        if n != self.targets.len() {
            candle_core::bail!("{op}: {n} rows of logits for {} targets", self.targets.len())
        }
        if let Some((i, t)) = self.targets.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
            candle_core::bail!("{op}: target {i} is token {t}, outside the vocabulary of {vocab}")
        }
        Ok((z, vocab.max(1)))
    }

    /// The row `z / T` (in `scratch`), or `z` itself at `T = 1`.
    fn scale<'a>(&self, z: &'a [f32], scratch: &'a mut [f32]) -> &'a [f32] {
        if self.inv_temperature == 1.0 {
            return z;
        }
        for (o, &v) in scratch.iter_mut().zip(z) {
            *o = v * self.inv_temperature;
        }
        scratch
    }
}

/// Writes `log softmax(z)` into `out` and returns the entropy of the distribution and
/// the log-sum-exp of `z`.
///
/// Compiled for the instruction set `simd::dispatch` picks: the exponentials are
/// [`exp_vectorisable`]'s (within about 2 ulp of libm's, which was a call per
/// element: 1.6% of the TRL-matched run in this head and its backward) and the max
/// and the sums run in eight fixed lanes, so the result is the same at every level.
fn log_softmax_row(z: &[f32], out: &mut [f32]) -> (f32, f32) {
    crate::simd::dispatch(LogSoftmaxRow { z, out })
}

/// The loop of [`log_softmax_row`].
struct LogSoftmaxRow<'a> {
    z: &'a [f32],
    out: &'a mut [f32],
}

impl pulp::WithSimd for LogSoftmaxRow<'_> {
    type Output = (f32, f32);

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> (f32, f32) {
        let LogSoftmaxRow { z, out } = self;
        let max = lanes(z, f32::NEG_INFINITY, |m, v| m.max(v), f32::max);
        for (o, &v) in out.iter_mut().zip(z) {
            *o = v - max;
        }
        let lse = lanes(out, 0.0, |s, o| s + exp_vectorisable(o), |a, b| a + b).ln();
        for o in out.iter_mut() {
            *o -= lse;
        }
        let entropy = -lanes(out, 0.0, |s, o| s + exp_vectorisable(o) * o, |a, b| a + b);
        (entropy, max + lse)
    }
}

/// `xs` folded by `step` in eight lanes (each whole chunk of eight spread over lanes
/// 0-7, in order; the last partial chunk into a ninth accumulator), the lanes then
/// joined by `join` in a fixed tree and the ninth joined last: vectorisable, and the
/// same result at every SIMD level.
#[inline(always)]
fn lanes(xs: &[f32], init: f32, step: impl Fn(f32, f32) -> f32, join: impl Fn(f32, f32) -> f32) -> f32 {
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(init, |a, &x| step(a, x));
    let mut acc = [init; 8];
    for c in chunks {
        for l in 0..8 {
            acc[l] = step(acc[l], c[l]);
        }
    }
    let tree = join(
        join(join(acc[0], acc[4]), join(acc[1], acc[5])),
        join(join(acc[2], acc[6]), join(acc[3], acc[7])),
    );
    join(tree, tail)
}

impl candle_core::CustomOp1 for TargetLogProbs {
    fn name(&self) -> &'static str {
        "target-logprobs"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> FwdResult {
        fused_op_ran();
        let (z, vocab) = self.rows(self.name(), s, l)?;
        let n = self.targets.len();
        let mut logp = vec![0f32; vocab];
        let mut scaled = vec![0f32; if self.inv_temperature == 1.0 { 0 } else { vocab }];
        let out = output(2 * n, |out| {
            for (i, zs) in z.chunks_exact(vocab).enumerate() {
                let (entropy, _) = log_softmax_row(self.scale(zs, &mut scaled), &mut logp);
                out[2 * i] = logp[self.targets[i] as usize];
                out[2 * i + 1] = entropy;
            }
        });
        Ok((CpuStorage::F32(out), (n, 2).into()))
    }

    fn bwd(&self, z: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(z.apply_op2_no_bwd(&g.contiguous()?, &TargetLogProbsGrad(self.clone()))?))
    }
}

/// The backward of [`TargetLogProbs`]: from the logits and the `[n, 2]` gradient of
/// (log-prob, entropy), the `[n, vocab]` gradient of the logits.
#[derive(Debug, Clone)]
struct TargetLogProbsGrad(TargetLogProbs);

impl candle_core::CustomOp2 for TargetLogProbsGrad {
    fn name(&self) -> &'static str {
        "target-logprobs-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> FwdResult {
        fused_op_ran();
        let (z, vocab) = self.0.rows(self.name(), s1, l1)?;
        let g = contiguous_f32(self.name(), s2, l2)?;
        let n = self.0.targets.len();
        if l2.dims() != [n, 2] {
            candle_core::bail!("{}: gradient {:?} for {n} targets", self.name(), l2.dims())
        }
        let inv = self.0.inv_temperature;
        let mut scaled = vec![0f32; if inv == 1.0 { 0 } else { vocab }];
        let out = output(z.len(), |out| {
            for (i, (zs, os)) in z.chunks_exact(vocab).zip(out.chunks_exact_mut(vocab)).enumerate() {
                let (entropy, _) = log_softmax_row(self.0.scale(zs, &mut scaled), os);
                let (g_logp, g_entropy) = (g[2 * i], g[2 * i + 1]);
                crate::simd::dispatch(LogitGrads { logp: os, g_logp, g_entropy, entropy });
                os[self.0.targets[i] as usize] += g_logp;
                if inv != 1.0 {
                    os.iter_mut().for_each(|o| *o *= inv);
                }
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// One row of [`TargetLogProbsGrad`] before its target's term: each log-prob in `logp`
/// becomes `-p · (g_logp + g_entropy · (log p + entropy))`, under `simd::dispatch`
/// (with [`exp_vectorisable`]; libm's `expf` was a call per element).
struct LogitGrads<'a> {
    logp: &'a mut [f32],
    g_logp: f32,
    g_entropy: f32,
    entropy: f32,
}

impl pulp::WithSimd for LogitGrads<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let LogitGrads { logp, g_logp, g_entropy, entropy } = self;
        for o in logp.iter_mut() {
            *o = -exp_vectorisable(*o) * (g_logp + g_entropy * (*o + entropy));
        }
    }
}

/// Log-probs of `targets` under `logits / T: [n, vocab]` and the entropies of the rows,
/// as `[n, 2]` (see [`TargetLogProbs`]); `inv_temperature` is `1 / T`.
pub(crate) fn target_logprobs_entropy(
    logits: &Tensor,
    targets: Vec<u32>,
    inv_temperature: f32,
) -> Result<Tensor> {
    let op = TargetLogProbs { targets: std::sync::Arc::new(targets), inv_temperature };
    Ok(logits.contiguous()?.apply_op1(op)?)
}

/// The forward of one row chunk of the chunked head (`head.rs`), without a graph: per
/// row of `logits / T`, the target's log-prob, the entropy and the log-sum-exp, as
/// `[n, 3]`. The backward recomputes the logits by vocabulary columns and needs the
/// log-sum-exp and the entropy of each whole row to do so.
#[derive(Debug, Clone)]
struct TargetStats(TargetLogProbs);

impl candle_core::CustomOp1 for TargetStats {
    fn name(&self) -> &'static str {
        "target-stats"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> FwdResult {
        fused_op_ran();
        let (z, vocab) = self.0.rows(self.name(), s, l)?;
        let n = self.0.targets.len();
        let mut logp = vec![0f32; vocab];
        let mut scaled = vec![0f32; if self.0.inv_temperature == 1.0 { 0 } else { vocab }];
        let out = output(3 * n, |out| {
            for (i, zs) in z.chunks_exact(vocab).enumerate() {
                let (entropy, lse) = log_softmax_row(self.0.scale(zs, &mut scaled), &mut logp);
                out[3 * i] = logp[self.0.targets[i] as usize];
                out[3 * i + 1] = entropy;
                out[3 * i + 2] = lse;
            }
        });
        Ok((CpuStorage::F32(out), (n, 3).into()))
    }
}

/// `[n, 3]` (target log-prob, entropy, log-sum-exp) of `logits / T: [n, vocab]` (see
/// [`TargetStats`]); forward only.
pub(crate) fn target_stats(logits: &Tensor, targets: &[u32], inv_temperature: f32) -> Result<Tensor> {
    let op = TargetStats(TargetLogProbs { targets: std::sync::Arc::new(targets.to_vec()), inv_temperature });
    Ok(logits.contiguous()?.apply_op1_no_bwd(&op)?)
}

/// The backward of the chunked head for one block of vocabulary columns, in one pass:
/// from the block's logits `z: [n, cols]` (columns `first..first + cols` of the
/// vocabulary), the rows' `[n, 3]` statistics of [`TargetStats`] and the `[n, 2]`
/// gradient of (log-prob, entropy), the block's `[n, cols]` logit gradient (the
/// formulas of [`TargetLogProbs`], with `log p_j = z_j / T − lse` from the whole row).
#[derive(Debug, Clone)]
struct TargetColumnsGrad {
    targets: std::sync::Arc<Vec<u32>>,
    first: usize,
    inv_temperature: f32,
}

impl CpuOp3 for TargetColumnsGrad {
    const NAME: &'static str = "target-columns-grad";

    fn forward(&self, [(s1, l1), (s2, l2), (s3, l3)]: [Operand<'_>; 3]) -> FwdResult {
        let z = contiguous_f32(Self::NAME, s1, l1)?;
        let (stats, g) = contiguous_f32_pair(Self::NAME, (s2, l2), (s3, l3))?;
        let (n, cols) = l1.shape().dims2()?;
        if l2.dims() != [n, 3] || l3.dims() != [n, 2] || self.targets.len() != n {
            candle_core::bail!(
                "{}: logits {:?}, statistics {:?} and gradient {:?} for {} targets",
                Self::NAME,
                l1.dims(),
                l2.dims(),
                l3.dims(),
                self.targets.len()
            )
        }
        let inv = self.inv_temperature;
        let out = output(z.len(), |out| {
            for (i, (zs, os)) in
                z.chunks_exact(cols.max(1)).zip(out.chunks_exact_mut(cols.max(1))).enumerate()
            {
                let (entropy, lse) = (stats[3 * i + 1], stats[3 * i + 2]);
                let (g_logp, g_entropy) = (g[2 * i], g[2 * i + 1]);
                for (o, &v) in os.iter_mut().zip(zs) {
                    *o = if inv == 1.0 { v } else { v * inv } - lse;
                }
                crate::simd::dispatch(LogitGrads { logp: os, g_logp, g_entropy, entropy });
                let t = self.targets[i] as usize;
                if (self.first..self.first + cols).contains(&t) {
                    os[t - self.first] += g_logp;
                }
                if inv != 1.0 {
                    os.iter_mut().for_each(|o| *o *= inv);
                }
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// The `[n, cols]` logit gradient of the vocabulary columns `first..first + cols` (see
/// [`TargetColumnsGrad`]).
pub(crate) fn target_columns_grad(
    z: &Tensor,
    stats: &Tensor,
    targets: &[u32],
    first: usize,
    g: &Tensor,
    inv_temperature: f32,
) -> Result<Tensor> {
    let op = TargetColumnsGrad { targets: std::sync::Arc::new(targets.to_vec()), first, inv_temperature };
    Ok(z.contiguous()?.apply_op3_no_bwd(&stats.contiguous()?, &g.contiguous()?, &Op3(op))?)
}

/// `silu(gate) * up` with its backward, for training: as candle ops the SiLU and the
/// product each allocate and walk an `[n, intermediate]` buffer forward, and their
/// backwards take several more (SiLU's alone is five ops); here the forward is one
/// pass and the backward one pass writing both gradients.
#[derive(Debug, Clone, Copy)]
struct SwiGluTrain;

impl candle_core::CustomOp2 for SwiGluTrain {
    fn name(&self) -> &'static str {
        "swiglu-train"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> FwdResult {
        fused_op_ran();
        SwiGlu { rows: usize::MAX }.cpu_fwd(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // Both gradients in one pass, stacked as `[2, ..]`; each half is a contiguous view.
        let both = gate.apply_op3_no_bwd(up, &grad.contiguous()?, &Op3(SwiGluGrad))?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

/// The backward of [`SwiGluTrain`]: from `gate`, `up` and the output gradient `dy`,
/// `[d gate, d up]` stacked on a new leading dimension. With `s = sigmoid(gate)`:
/// `d up = dy · gate · s` and `d gate = dy · up · s · (1 + gate · (1 − s))`.
#[derive(Debug, Clone, Copy)]
struct SwiGluGrad;

impl CpuOp3 for SwiGluGrad {
    const NAME: &'static str = "swiglu-grad";

    fn forward(&self, [(s1, l1), (s2, l2), (s3, l3)]: [Operand<'_>; 3]) -> FwdResult {
        let (g, u) = contiguous_f32_pair(Self::NAME, (s1, l1), (s2, l2))?;
        let dy = contiguous_f32(Self::NAME, s3, l3)?;
        if l1.dims() != l2.dims() || l1.dims() != l3.dims() {
            candle_core::bail!(
                "swiglu-grad: gate {:?}, up {:?} and gradient {:?} differ in shape",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        let n = g.len();
        let out = output(2 * n, |out| {
            let (dg, du) = out.split_at_mut(n);
            crate::simd::dispatch(SwiGluGradLoop { g, u, dy, dg, du });
        });
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((CpuStorage::F32(out), dims.into()))
    }
}

/// `silu(gate) * up` for training, differentiable in both inputs (see [`SwiGluTrain`]).
pub(crate) fn swiglu_train(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGluTrain)?)
}

/// How one segment of a packed row attends: its queries against every key of its
/// ancestors and its own causal prefix. Attending per segment costs the pairs the
/// segment tree allows, where one `[len, len]` mask per row would cost the row's
/// square: for a shared-prompt row of G responses that is up to G times less.
#[derive(Debug)]
pub(crate) struct SegmentPlan {
    /// First query position in the row.
    pub(crate) start: usize,
    /// Number of queries.
    pub(crate) len: usize,
    /// Key ranges `(start, len)` in the row: the ancestors, root first, then the segment.
    pub(crate) keys: Vec<(usize, usize)>,
    /// The ancestors' keys, which every query sees: query `i` sees `visible + i + 1` keys.
    pub(crate) visible: usize,
    device: Device,
    /// [`SegmentPlan::mask`], made on first use: the fused attention reads `visible`
    /// only, and building `[len, keys]` per segment was a visible share of its step.
    mask: std::sync::OnceLock<Tensor>,
}

impl SegmentPlan {
    /// The plan of `len` queries from `start` that see `visible` ancestor keys first.
    pub(crate) fn new(
        start: usize,
        len: usize,
        keys: Vec<(usize, usize)>,
        visible: usize,
        device: &Device,
    ) -> Self {
        Self { start, len, keys, visible, device: device.clone(), mask: std::sync::OnceLock::new() }
    }

    /// The `[len, visible + len]` additive mask: 0 on the ancestors and the causal
    /// prefix, `-inf` after.
    pub(crate) fn mask(&self) -> Result<&Tensor> {
        if let Some(m) = self.mask.get() {
            return Ok(m);
        }
        let width = self.visible + self.len;
        let mut mask = vec![f32::NEG_INFINITY; self.len * width];
        for i in 0..self.len {
            mask[i * width..i * width + self.visible + i + 1].fill(0.0);
        }
        let mask = Tensor::from_vec(mask, (self.len, width), &self.device)?;
        Ok(self.mask.get_or_init(|| mask))
    }
}

/// The `(start, len)` spans of `seg`'s ancestors in `row`, root first: the keys every
/// query of the segment sees besides its own causal prefix.
fn ancestor_spans(row: &metronome_core::PackedRow, seg: &metronome_core::Segment) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut parent = seg.parent;
    while let Some(a) = parent {
        let ancestor = row.segments[a as usize];
        spans.push((ancestor.start as usize, ancestor.len as usize));
        parent = ancestor.parent;
    }
    spans.reverse();
    spans
}

/// The attention plans of a batch's packed rows: per row, its length and the plan of
/// each of its segments, in row order.
pub(crate) type RowPlans = Vec<(usize, Vec<SegmentPlan>)>;

/// One [`SegmentPlan`] per segment of `row`, in row order.
pub(crate) fn segment_plans(row: &metronome_core::PackedRow, device: &Device) -> Result<Vec<SegmentPlan>> {
    let mut plans = Vec::with_capacity(row.segments.len());
    for seg in &row.segments {
        let mut keys = ancestor_spans(row, seg);
        let visible: usize = keys.iter().map(|k| k.1).sum();
        let (start, len) = (seg.start as usize, seg.len as usize);
        keys.push((start, len));
        plans.push(SegmentPlan::new(start, len, keys, visible, device));
    }
    Ok(plans)
}

/// The attention masks of rows attended whole ([`crate::Model::with_batched_attention`]):
/// `mask: [rows, len, len]` additive f32, each row padded to `len`; a query sees what
/// its segment's plan lets it see (its ancestors and its own causal prefix), a padding
/// query itself alone.
#[derive(Clone, Debug)]
pub(crate) struct RowMasks {
    pub(crate) rows: usize,
    pub(crate) len: usize,
    pub(crate) mask: Tensor,
}

impl RowMasks {
    pub(crate) fn new(rows: &[metronome_core::PackedRow], len: usize, device: &Device) -> Result<Self> {
        let mut mask = vec![f32::NEG_INFINITY; rows.len() * len * len];
        for (r, row) in rows.iter().enumerate() {
            let block = &mut mask[r * len * len..(r + 1) * len * len];
            for seg in &row.segments {
                let spans = ancestor_spans(row, seg);
                for i in 0..seg.len as usize {
                    let q = seg.start as usize + i;
                    let line = &mut block[q * len..(q + 1) * len];
                    for &(start, l) in &spans {
                        line[start..start + l].fill(0.0);
                    }
                    line[seg.start as usize..=q].fill(0.0);
                }
            }
            for q in row.len()..len {
                block[q * len + q] = 0.0;
            }
        }
        Ok(Self { rows: rows.len(), len, mask: Tensor::from_vec(mask, (rows.len(), len, len), device)? })
    }
}

/// Rows to gather from a table (`index_select` along the first dimension): the token
/// ids of a batch from the embedding, the predicting positions of its targets from the
/// hidden states. On a CUDA device it also holds its inverse for the backward
/// ([`RowIndex::inverse`]), where candle's index-add runs one thread per column, each
/// walking every index in turn (2 ms per step at 4,096 positions on an H100, a tenth
/// of a SmolLM2 step's GPU time) and summing in the table's type.
#[derive(Clone, Debug)]
pub(crate) struct RowIndex {
    /// `[n]` u32, the row each output takes.
    pub(crate) ids: Tensor,
    /// On CUDA devices: `[m + (m + 1) + n]` u32, the [`RowIndex::inverse`] of `ids`
    /// packed in that order (`m` rows read).
    pub(crate) inverse: Option<(Tensor, usize)>,
}

impl RowIndex {
    pub(crate) fn new(ids: Vec<u32>, device: &Device) -> Result<Self> {
        let inverse = if device.is_cuda() {
            let (rows, offsets, sources) = Self::inverse(&ids);
            let m = rows.len();
            let packed: Vec<u32> = rows.into_iter().chain(offsets).chain(sources).collect();
            let len = packed.len();
            Some((Tensor::from_vec(packed, len, device)?, m))
        } else {
            None
        };
        let n = ids.len();
        Ok(Self { ids: Tensor::from_vec(ids, n, device)?, inverse })
    }

    /// The rows `ids` reads, each once and in increasing order, `offsets` into
    /// `sources` (one more than the rows), and the outputs that read each row, in
    /// increasing order: the backward sums, per row read, the gradients of its
    /// outputs in that fixed order (no atomics: the same bits on every run).
    pub(crate) fn inverse(ids: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let mut sources: Vec<u32> = (0..ids.len() as u32).collect();
        sources.sort_by_key(|&i| ids[i as usize]); // stable: outputs in order within a row
        let (mut rows, mut offsets) = (Vec::new(), Vec::new());
        for (k, &i) in sources.iter().enumerate() {
            let id = ids[i as usize];
            if rows.last() != Some(&id) {
                rows.push(id);
                offsets.push(k as u32);
            }
        }
        offsets.push(ids.len() as u32);
        (rows, offsets, sources)
    }
}

#[cfg(test)]
mod tests {
    use metronome_core::{PackedRow, Segment};

    use super::super::noise;
    use super::*;

    /// RMSNorm forward and backward, the head's log-softmax row and rotary, each under every
    /// instruction set this machine has (pulp's scalar fallback, AVX2, AVX-512): the
    /// same bits at every level, as their fixed-lane sums promise (the README says so).
    #[test]
    fn fixed_lane_kernels_give_the_same_bits_at_every_simd_level() {
        /// The three kernels on fixed inputs, compiled at the level `S` runs them with
        /// (each `with_simd` is inlined into the caller's instruction set); their bits.
        struct All<'a>(&'a [f32], &'a [f32], &'a [f32], usize);
        type Bits = (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>, Vec<(u32, u32)>, Vec<u32>);
        impl pulp::WithSimd for All<'_> {
            type Output = Bits;
            #[inline(always)]
            fn with_simd<S: pulp::Simd>(self, simd: S) -> Bits {
                let All(x, w, g, d) = self;
                let (mut y, mut dx, mut dw, mut logp, mut rot) = (
                    vec![0f32; x.len()],
                    vec![0f32; x.len()],
                    vec![0f32; d],
                    vec![0f32; x.len()],
                    vec![0f32; 5 * 32],
                );
                // Five rows of two heads of 16, from rows of `d` (angles from `g`).
                let (cos, sin) = (&g[..5 * 8], &g[5 * 8..10 * 8]);
                super::super::RopeRows { x, stride: d, hd: 16, tables: (cos, sin), sign: 1.0, out: &mut rot }
                    .with_simd(simd);
                RmsNormRows { x, w, eps: 1e-5, out: &mut y }.with_simd(simd);
                RmsGradRows { dx: &mut dx, x, g, w, eps: 1e-5, dw: &mut dw, gw: &mut vec![0f32; d] }
                    .with_simd(simd);
                let stats = x
                    .chunks_exact(d)
                    .zip(logp.chunks_exact_mut(d))
                    .map(|(z, out)| {
                        let (e, lse) = LogSoftmaxRow { z, out }.with_simd(simd);
                        (e.to_bits(), lse.to_bits())
                    })
                    .collect();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
                (bits(&y), bits(&dx), bits(&dw), bits(&logp), stats, bits(&rot))
            }
        }
        let d = 67; // whole chunks of eight and a tail
        let (x, w, g) = (noise(1, 5 * d), noise(2, d), noise(3, 5 * d));
        let all = || All(&x, &w, &g, d);
        let scalar = pulp::Simd::vectorize(pulp::Scalar::new(), all());
        let mut levels = 0;
        #[cfg(target_arch = "x86_64")]
        if let Some(v3) = pulp::x86::V3::try_new() {
            assert_eq!(pulp::Simd::vectorize(v3, all()), scalar, "AVX2 against scalar");
            levels += 1;
        }
        #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
        if let Some(v4) = pulp::x86::V4::try_new() {
            assert_eq!(pulp::Simd::vectorize(v4, all()), scalar, "AVX-512 against scalar");
            levels += 1;
        }
        eprintln!("compared {levels} SIMD levels with the scalar code");
    }

    #[test]
    fn a_row_index_inverts_to_each_row_and_the_outputs_that_read_it() {
        let (rows, offsets, sources) = RowIndex::inverse(&[3, 1, 3, 0, 3, 1]);
        assert_eq!(rows, [0, 1, 3]);
        assert_eq!(offsets, [0, 1, 3, 6]);
        assert_eq!(sources, [3, 1, 5, 0, 2, 4]);
        assert_eq!(RowIndex::inverse(&[]), (vec![], vec![0], vec![]));
        // On the CPU the index has no inverse (candle's index-add is the backward there).
        assert!(RowIndex::new(vec![2, 0], &Device::Cpu).unwrap().inverse.is_none());
    }

    #[test]
    fn segment_plans_cover_exactly_what_can_attend_allows() {
        let row = PackedRow {
            tokens: vec![0; 11],
            positions: vec![0; 11],
            segments: vec![
                Segment { start: 0, len: 3, parent: None },
                Segment { start: 3, len: 2, parent: Some(0) },
                Segment { start: 5, len: 2, parent: Some(1) },
                Segment { start: 7, len: 2, parent: Some(0) },
                Segment { start: 9, len: 2, parent: None },
            ],
        };
        let mut allowed = vec![vec![false; row.len()]; row.len()];
        for plan in segment_plans(&row, &Device::Cpu).unwrap() {
            let key_positions: Vec<usize> = plan.keys.iter().flat_map(|&(s, l)| s..s + l).collect();
            let mask = plan.mask().unwrap().to_vec2::<f32>().unwrap();
            for i in 0..plan.len {
                for (j, &k) in key_positions.iter().enumerate() {
                    allowed[plan.start + i][k] |= mask[i][j] == 0.0;
                }
            }
        }
        for (q, line) in allowed.iter().enumerate() {
            for (k, &a) in line.iter().enumerate() {
                assert_eq!(a, row.can_attend(q, k), "query {q} key {k}");
            }
        }
    }

    #[test]
    fn fused_softmax_backward_matches_composed_ops() {
        let dev = Device::Cpu;
        let p =
            softmax_last_dim(&Tensor::from_vec(noise(31, 3 * 2 * 19), (3, 2, 19), &dev).unwrap()).unwrap();
        let g = Tensor::from_vec(noise(32, 3 * 2 * 19), (3, 2, 19), &dev).unwrap();
        let fused = p.apply_op2_no_bwd(&g, &SoftmaxGrad).unwrap();
        let dot = (&g * &p).unwrap().sum_keepdim(D::Minus1).unwrap();
        let composed = (g.broadcast_sub(&dot).unwrap() * &p).unwrap();
        let d = (fused - composed).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-6, "{d}");
    }

    #[test]
    fn softmax_forms_agree() {
        let x = Tensor::new(&[[1.0f32, 2.0, 3.0], [-1.0, 0.0, 5.0]], &Device::Cpu).unwrap();
        let p = softmax_last_dim(&x).unwrap();
        let lp = log_softmax_last_dim(&x).unwrap().exp().unwrap();
        let d = (p - lp).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-6);
    }
}
