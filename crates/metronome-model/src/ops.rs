//! Differentiable building blocks.
//!
//! candle-nn's fused `softmax_last_dim`, `rms_norm` and `RmsNorm::forward` have no
//! backward and silently cut gradients (DESIGN.md §6), so the network is written from
//! candle-core primitives that all have one.

use candle_core::{D, Device, Tensor};

use crate::Result;

/// RMSNorm over the last dimension, as Hugging Face computes it:
/// `w * x / sqrt(mean(x²) + eps)`, in one pass forward, with its backward.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })?)
}

/// Fused RMSNorm: candle-nn's fused kernel has no backward (DESIGN.md §6), and the
/// composed form costs seven allocating ops forward and more backward.
#[derive(Debug, Clone, Copy)]
struct RmsNorm {
    eps: f32,
}

/// The f32 elements of a two-input custom op's operands, which must be contiguous.
fn contiguous_f32_pair<'a>(
    op: &str,
    (s1, l1): (&'a candle_core::CpuStorage, &candle_core::Layout),
    (s2, l2): (&'a candle_core::CpuStorage, &candle_core::Layout),
) -> candle_core::Result<(&'a [f32], &'a [f32])> {
    let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
        candle_core::bail!("{op} needs contiguous inputs")
    };
    Ok((&s1.as_slice::<f32>()?[a0..a1], &s2.as_slice::<f32>()?[b0..b1]))
}

impl candle_core::CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (x, w) = contiguous_f32_pair(self.name(), (s1, l1), (s2, l2))?;
        let d = w.len();
        if l1.dims().last() != Some(&d) {
            candle_core::bail!("rms-norm: weight of {d} does not fit input {:?}", l1.dims())
        }
        let mut out = vec![0f32; x.len()];
        for (xs, os) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let ms = xs.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let r = 1.0 / (ms + self.eps).sqrt();
            for ((o, &v), &g) in os.iter_mut().zip(xs).zip(w) {
                *o = v * r * g;
            }
        }
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // With r = 1/rms(x) and x̂ = x·r: dw = Σ_rows g·x̂, dx = r·(g·w − x̂·mean(g·w·x̂)).
        let r = (x.sqr()?.mean_keepdim(D::Minus1)? + f64::from(self.eps))?.sqrt()?.recip()?;
        let xhat = x.broadcast_mul(&r)?;
        let d = w.elem_count();
        let rows = xhat.elem_count() / d;
        let dw = (g * &xhat)?.reshape((rows, d))?.sum(0)?;
        let gw = g.broadcast_mul(w)?;
        let dot = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = (gw - xhat.broadcast_mul(&dot)?)?.broadcast_mul(&r)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Rotary embedding as one op: rotates `[n, heads, head_dim]` by per-position
/// angles (rotate-half convention); its backward is the inverse rotation.
#[derive(Debug, Clone)]
struct Rope {
    /// `[n, head_dim / 2]` each.
    cos: std::sync::Arc<Vec<f32>>,
    sin: std::sync::Arc<Vec<f32>>,
    /// Rotate by the negated angles (the backward).
    inverse: bool,
}

impl candle_core::CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let Some((a0, a1)) = l.contiguous_offsets() else {
            candle_core::bail!("rope needs a contiguous input")
        };
        let x = &s.as_slice::<f32>()?[a0..a1];
        let (n, heads, hd) = l.shape().dims3()?;
        let half = hd / 2;
        if self.cos.len() != n * half {
            candle_core::bail!("rope: tables for {} positions, input has {n}", self.cos.len() / half.max(1))
        }
        let sign = if self.inverse { -1.0f32 } else { 1.0 };
        let mut out = vec![0f32; x.len()];
        for p in 0..n {
            let c = &self.cos[p * half..(p + 1) * half];
            let sn = &self.sin[p * half..(p + 1) * half];
            for h in 0..heads {
                let base = (p * heads + h) * hd;
                let (x1, x2) = x[base..base + hd].split_at(half);
                let (o1, o2) = out[base..base + hd].split_at_mut(half);
                for i in 0..half {
                    let s = sign * sn[i];
                    o1[i] = x1[i] * c[i] - x2[i] * s;
                    o2[i] = x2[i] * c[i] + x1[i] * s;
                }
            }
        }
        Ok((candle_core::CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let inv = Rope { inverse: !self.inverse, ..self.clone() };
        Ok(Some(g.contiguous()?.apply_op1(inv)?))
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

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
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
        for (r, xs) in x.chunks_exact(lk).enumerate() {
            let ms = &mask[(r % lq) * lk..(r % lq + 1) * lk];
            let at = out.len();
            out.extend(xs.iter().zip(ms).map(|(&a, &m)| a + m));
            let os = &mut out[at..];
            let max = os.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for o in os.iter_mut() {
                // Masked entries are exactly zero: skip their `exp` (half of a causal block).
                *o = if *o == f32::NEG_INFINITY { 0.0 } else { (*o - max).exp() };
                sum += *o;
            }
            let inv = 1.0 / sum;
            for o in os.iter_mut() {
                *o *= inv;
            }
        }
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
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

/// The backward of a softmax over the last dimension in one pass: from the
/// probabilities `p` and the output gradient `g`, `p · (g − Σ g·p)` per row (as candle
/// ops: a product, a sum, a broadcast subtraction and a product, each allocating).
#[derive(Debug, Clone, Copy)]
struct SoftmaxGrad;

impl candle_core::CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
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
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// `softmax(scores + mask)` over the last dimension; see [`MaskedSoftmax`].
pub(crate) fn masked_softmax(scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(scores.contiguous()?.apply_op2(&mask.contiguous()?, MaskedSoftmax)?)
}

/// Log-softmax over the last dimension (max detached, as in [`softmax_last_dim`]).
#[cfg(test)]
fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
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
    fn rows<'a>(
        &self,
        op: &str,
        s: &'a candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(&'a [f32], usize)> {
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

/// Writes `log softmax(z)` into `out` and returns the entropy of the distribution.
fn log_softmax_row(z: &[f32], out: &mut [f32]) -> f32 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for (o, &v) in out.iter_mut().zip(z) {
        *o = v - max;
        sum += o.exp();
    }
    let lse = sum.ln();
    let mut entropy = 0f32;
    for o in out.iter_mut() {
        *o -= lse;
        entropy -= o.exp() * *o;
    }
    entropy
}

impl candle_core::CustomOp1 for TargetLogProbs {
    fn name(&self) -> &'static str {
        "target-logprobs"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (z, vocab) = self.rows(self.name(), s, l)?;
        let n = self.targets.len();
        let mut out = vec![0f32; 2 * n];
        let mut logp = vec![0f32; vocab];
        let mut scaled = vec![0f32; if self.inv_temperature == 1.0 { 0 } else { vocab }];
        for (i, zs) in z.chunks_exact(vocab).enumerate() {
            let entropy = log_softmax_row(self.scale(zs, &mut scaled), &mut logp);
            out[2 * i] = logp[self.targets[i] as usize];
            out[2 * i + 1] = entropy;
        }
        Ok((candle_core::CpuStorage::F32(out), (n, 2).into()))
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

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (z, vocab) = self.0.rows(self.name(), s1, l1)?;
        let g = contiguous_f32(self.name(), s2, l2)?;
        let n = self.0.targets.len();
        if l2.dims() != [n, 2] {
            candle_core::bail!("{}: gradient {:?} for {n} targets", self.name(), l2.dims())
        }
        let mut out = vec![0f32; z.len()];
        let inv = self.0.inv_temperature;
        let mut scaled = vec![0f32; if inv == 1.0 { 0 } else { vocab }];
        for (i, (zs, os)) in z.chunks_exact(vocab).zip(out.chunks_exact_mut(vocab)).enumerate() {
            let entropy = log_softmax_row(self.0.scale(zs, &mut scaled), os);
            let (g_logp, g_entropy) = (g[2 * i], g[2 * i + 1]);
            for o in os.iter_mut() {
                let p = o.exp();
                *o = -p * (g_logp + g_entropy * (*o + entropy));
            }
            os[self.0.targets[i] as usize] += g_logp;
            if inv != 1.0 {
                os.iter_mut().for_each(|o| *o *= inv);
            }
        }
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
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

/// `x @ wᵀ (+ b)` for `x: [n, in]`, `w: [out, in]`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    Ok(match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// Rotary tables for explicit positions: `cos` and `sin`, each `[n, head_dim / 2]`,
/// computed in f32 the way `transformers` does (`inv_freq = 1 / theta^(2i/d)`, then
/// `position * inv_freq`), so positions that restart mid-row rotate exactly as
/// separately decoded sequences would.
pub(crate) fn rope_tables(positions: &[u32], head_dim: usize, theta: f64) -> RopeTables {
    let half = head_dim / 2;
    let theta = theta as f32;
    let inv_freq: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &f in &inv_freq {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    RopeTables { cos: std::sync::Arc::new(cos), sin: std::sync::Arc::new(sin), device: Default::default() }
}

/// Host cos/sin tables of [`rope_tables`], `[n, head_dim / 2]` each, and their copy on
/// a device once the portable kernels ask for it (`portable.rs`).
#[derive(Debug, Clone)]
pub(crate) struct RopeTables {
    cos: std::sync::Arc<Vec<f32>>,
    sin: std::sync::Arc<Vec<f32>>,
    device: crate::portable::DeviceTables,
}

impl RopeTables {
    pub(crate) fn cos(&self) -> &[f32] {
        &self.cos
    }

    pub(crate) fn sin(&self) -> &[f32] {
        &self.sin
    }

    pub(crate) fn device_tables(&self) -> &crate::portable::DeviceTables {
        &self.device
    }
}

/// Applies rotary embeddings to `x: [n, heads, head_dim]` (Hugging Face's
/// rotate-half convention) with tables from [`rope_tables`].
pub(crate) fn apply_rope(x: &Tensor, t: &RopeTables) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(Rope { cos: t.cos.clone(), sin: t.sin.clone(), inverse: false })?)
}

/// Scaled dot-product attention of one sequence with grouped-query heads.
///
/// `q: [lq, heads, hd]`, `k`, `v: [lk, kv_heads, hd]`, `mask`: additive `[lq, lk]`
/// (`None` when every query sees every key). Returns `[lq, heads * hd]`. Query heads
/// are grouped by their key/value head instead of repeating keys and values.
pub(crate) fn attention(
    kernels: crate::Kernels,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (lq, heads, hd) = q.dims3()?;
    let (lk, kv_heads, _) = k.dims3()?;
    let rep = heads / kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    let k = k.transpose(0, 1)?;
    let v = v.transpose(0, 1)?;
    // candle's CPU matmul takes any strides; cuBLAS wants each operand contiguous in
    // its last two dimensions (or their transpose), so the GPU copies these two.
    let (k, v) = if kernels == crate::Kernels::Fused { (k, v) } else { (k.contiguous()?, v.contiguous()?) };
    let probs = match mask {
        Some(m) => {
            // Scaling the queries is cheaper than scaling the `[.., lq, lk]` scores.
            let q = (q * scale)?.transpose(0, 1)?.contiguous()?.reshape((kv_heads, rep * lq, hd))?;
            let scores = q.matmul(&k.t()?)?.reshape((kv_heads, rep, lq, lk))?;
            kernels.masked_softmax(&scores, m)?.reshape((kv_heads, rep * lq, lk))?
        }
        None => {
            let q = q.transpose(0, 1)?.contiguous()?.reshape((kv_heads, rep * lq, hd))?;
            softmax_last_dim(&(q.matmul(&k.t()?)? * scale)?)?
        }
    };
    let out = probs.matmul(&v)?; // [kv, rep * lq, hd]
    Ok(out.reshape((heads, lq, hd))?.transpose(0, 1)?.contiguous()?.reshape((lq, heads * hd))?)
}

/// Where each token row of a cached forward (a decode step, or prompts being
/// prefilled) lives in one layer's key/value cache: row `i`'s slot starts at cache row
/// `base[i]`, its key and value go to cache row `base[i] + len[i] - 1`, and it attends
/// to the `len[i]` cached positions up to and including its own.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeRows<'a> {
    pub(crate) base: &'a [usize],
    pub(crate) len: &'a [usize],
}

impl DecodeRows<'_> {
    /// Checks that `n` rows are described and that each fits a cache of `cache_rows` rows.
    pub(crate) fn check(&self, op: &str, n: usize, cache_rows: usize) -> candle_core::Result<()> {
        if self.base.len() != n || self.len.len() != n {
            candle_core::bail!("{op}: {} row placements for {n} rows", self.base.len().min(self.len.len()))
        }
        for (i, (&b, &l)) in self.base.iter().zip(self.len).enumerate() {
            if l == 0 || b + l > cache_rows {
                candle_core::bail!("{op}: row {i} spans cache rows {b}..{} of {cache_rows}", b + l)
            }
        }
        Ok(())
    }
}

/// The contiguous f32 elements of one custom-op operand.
fn contiguous_f32<'a>(
    op: &str,
    s: &'a candle_core::CpuStorage,
    l: &candle_core::Layout,
) -> candle_core::Result<&'a [f32]> {
    let Some((a0, a1)) = l.contiguous_offsets() else { candle_core::bail!("{op} needs contiguous inputs") };
    Ok(&s.as_slice::<f32>()?[a0..a1])
}

/// Writes a decode step's new keys (or values) `[n, kv_heads, head_dim]` into a
/// layer's cache `[rows, kv_heads, head_dim]` at the rows [`DecodeRows`] names: one
/// scatter instead of a `slice_set` per row.
#[derive(Debug)]
struct DecodeWrite<'a>(DecodeRows<'a>);

impl candle_core::InplaceOp2 for DecodeWrite<'_> {
    fn name(&self) -> &'static str {
        "decode-write"
    }

    fn cpu_fwd(
        &self,
        s1: &mut candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let new = contiguous_f32(self.name(), s2, l2)?;
        let (n, kvh, hd) = l2.shape().dims3()?;
        let (rows, ckvh, chd) = l1.shape().dims3()?;
        if (ckvh, chd) != (kvh, hd) {
            candle_core::bail!("decode-write: rows {:?} do not fit cache {:?}", l2.dims(), l1.dims())
        }
        self.0.check(self.name(), n, rows)?;
        let (Some((c0, c1)), candle_core::CpuStorage::F32(cache)) = (l1.contiguous_offsets(), s1) else {
            candle_core::bail!("decode-write needs a contiguous f32 cache")
        };
        let cache = &mut cache[c0..c1];
        let width = kvh * hd;
        for (i, src) in new.chunks_exact(width).enumerate() {
            let at = (self.0.base[i] + self.0.len[i] - 1) * width;
            cache[at..at + width].copy_from_slice(src);
        }
        Ok(())
    }
}

/// Writes `new: [n, kv_heads, head_dim]` into `cache` at the rows `rows` names (see
/// [`DecodeWrite`]).
pub(crate) fn write_decode_rows(cache: &Tensor, new: &Tensor, rows: DecodeRows<'_>) -> Result<()> {
    Ok(cache.inplace_op2(&new.contiguous()?, &DecodeWrite(rows))?)
}

/// Grouped-query attention of every row of a decode step over its own cached prefix,
/// read directly from a layer's cache: one op per layer instead of about ten candle
/// ops per row (each a few µs of dispatch and allocation), which dominated decode
/// steps of many slots.
///
/// Each row is computed alone by the same code with a fixed reduction order (dot
/// products in eight fixed lanes, softmax and the weighted sum of values in key
/// order), so its result is bitwise the same whichever rows share the step: decode
/// stays batch-invariant (DESIGN.md §6). Forward only: decoding builds no graph.
#[derive(Debug)]
struct DecodeAttention<'a>(DecodeRows<'a>);

/// `a · b` summed in eight fixed lanes (vectorisable, and the same order every call).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    let mut acc = [0f32; 8];
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

impl candle_core::CustomOp3 for DecodeAttention<'_> {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CpuStorage,
        l3: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (n, heads, hd) = l1.shape().dims3()?;
        let (rows, kvh, khd) = l2.shape().dims3()?;
        if l3.dims() != l2.dims() || khd != hd || kvh == 0 || heads % kvh != 0 {
            candle_core::bail!(
                "decode-attention: queries {:?} do not fit keys {:?} and values {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        self.0.check(self.name(), n, rows)?;
        let q = contiguous_f32(self.name(), s1, l1)?;
        let k = contiguous_f32(self.name(), s2, l2)?;
        let v = contiguous_f32(self.name(), s3, l3)?;
        let mut out = vec![0f32; n * heads * hd];
        // The same scalar code, compiled for the instruction set `pulp` detects (the
        // eight-lane dot products become one AVX vector): results are unchanged.
        pulp::Arch::new().dispatch(AttentionRows { rows: self.0, q, k, v, heads, kvh, hd, out: &mut out });
        Ok((candle_core::CpuStorage::F32(out), (n, heads * hd).into()))
    }
}

/// The loops of [`DecodeAttention`], run under [`pulp::Arch::dispatch`].
struct AttentionRows<'a> {
    rows: DecodeRows<'a>,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    heads: usize,
    kvh: usize,
    hd: usize,
    out: &'a mut [f32],
}

impl pulp::WithSimd for AttentionRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        let l = S::F32_LANES;
        if !self.hd.is_multiple_of(l) {
            return attention_rows_scalar(self);
        }
        let nv = self.hd / l;
        let load = |s: &[f32]| -> S::f32s { bytemuck::pod_read_unaligned(bytemuck::cast_slice(&s[..l])) };
        let dot = |qh: &[f32], kr: &[f32]| {
            let mut acc = simd.splat_f32s(0.0);
            for c in 0..nv {
                acc = simd.mul_add_e_f32s(load(&qh[c * l..]), load(&kr[c * l..]), acc);
            }
            simd.reduce_sum_f32s(acc)
        };
        // Head by head, the accumulators of one head held in registers across the keys.
        let weigh = |probs: &[f32], values: &[f32], width: usize, off: usize, og: &mut [f32]| {
            let len = probs.len() / (og.len() / (nv * l));
            for (ps, oh) in probs.chunks_exact(len).zip(og.chunks_exact_mut(nv * l)) {
                match nv {
                    1 => weighted_values::<S, 1>(simd, ps, values, width, off, oh),
                    2 => weighted_values::<S, 2>(simd, ps, values, width, off, oh),
                    4 => weighted_values::<S, 4>(simd, ps, values, width, off, oh),
                    8 => weighted_values::<S, 8>(simd, ps, values, width, off, oh),
                    _ => {
                        for c in 0..nv {
                            let mut acc = simd.splat_f32s(0.0);
                            for (&p, vr) in ps.iter().zip(values.chunks_exact(width)) {
                                acc = simd.mul_add_e_f32s(simd.splat_f32s(p), load(&vr[off + c * l..]), acc);
                            }
                            oh[c * l..(c + 1) * l]
                                .copy_from_slice(bytemuck::cast_slice(std::slice::from_ref(&acc)));
                        }
                    }
                }
            }
        };
        attention_rows_with(self, dot, weigh);
    }
}

/// The loops of [`DecodeAttention`] around its two inner products: `dot(q_head,
/// key)`, and `weigh(probs, values, width, offset, out_heads)`, which writes the
/// probability-weighted sums of the values (accumulated in key order) for the query
/// heads that share one key/value head (`probs` holds a row of keys per head). Per
/// row and key/value head those query heads are handled together, so each cached key
/// is loaded once for all of them. Inlined into [`AttentionRows`]'s dispatch, so the
/// closures compile with the instruction set `pulp` detected.
#[inline(always)]
fn attention_rows_with(
    a: AttentionRows<'_>,
    dot: impl Fn(&[f32], &[f32]) -> f32,
    weigh: impl Fn(&[f32], &[f32], usize, usize, &mut [f32]),
) {
    let AttentionRows { rows, q, k, v, heads, kvh, hd, out } = a;
    let n = rows.base.len();
    let rep = heads / kvh;
    let width = kvh * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut probs = Vec::new();
    for i in 0..n {
        let (base, len) = (rows.base[i], rows.len[i]);
        let keys = &k[base * width..(base + len) * width];
        let values = &v[base * width..(base + len) * width];
        probs.clear();
        probs.resize(rep * len, 0f32);
        for g in 0..kvh {
            let off = g * hd;
            let heads_at = (i * heads + g * rep) * hd;
            let qg = &q[heads_at..heads_at + rep * hd];
            for (j, kr) in keys.chunks_exact(width).enumerate() {
                let kr = &kr[off..off + hd];
                for (r, qh) in qg.chunks_exact(hd).enumerate() {
                    probs[r * len + j] = dot(qh, kr) * scale;
                }
            }
            softmax_rows(&mut probs, len);
            weigh(&probs, values, width, off, &mut out[heads_at..heads_at + rep * hd]);
        }
    }
}

/// Softmax of each `len`-long row of `probs` in place: exponentials that vectorise,
/// their sum in key order.
#[inline(always)]
fn softmax_rows(probs: &mut [f32], len: usize) {
    for ps in probs.chunks_exact_mut(len) {
        let max = ps.iter().fold(f32::NEG_INFINITY, |m, &p| m.max(p));
        for p in ps.iter_mut() {
            *p = exp_vectorisable(*p - max);
        }
        let mut sum = 0f32;
        for &p in ps.iter() {
            sum += p;
        }
        let inv = 1.0 / sum;
        for p in ps.iter_mut() {
            *p *= inv;
        }
    }
}

/// `oh = Σ_j ps[j] · value_j` for one head of `NV` SIMD vectors, the accumulators held
/// in registers across the keys (one fused multiply-add chain per lane, in key order).
#[inline(always)]
fn weighted_values<S: pulp::Simd, const NV: usize>(
    simd: S,
    ps: &[f32],
    values: &[f32],
    width: usize,
    off: usize,
    oh: &mut [f32],
) {
    let l = S::F32_LANES;
    let mut acc = [simd.splat_f32s(0.0); NV];
    for (&p, vr) in ps.iter().zip(values.chunks_exact(width)) {
        let p = simd.splat_f32s(p);
        let vr = &vr[off..off + NV * l];
        for (c, a) in acc.iter_mut().enumerate() {
            *a = simd.mul_add_e_f32s(
                p,
                bytemuck::pod_read_unaligned(bytemuck::cast_slice(&vr[c * l..(c + 1) * l])),
                *a,
            );
        }
    }
    for (c, a) in acc.iter().enumerate() {
        oh[c * l..(c + 1) * l].copy_from_slice(bytemuck::cast_slice(std::slice::from_ref(a)));
    }
}

/// The attention loops in plain scalar code, for head sizes that are not a whole number
/// of SIMD vectors (inlined into the dispatch, so `exp_vectorisable`'s fused
/// multiply-adds are instructions, not library calls).
#[inline(always)]
fn attention_rows_scalar(a: AttentionRows<'_>) {
    let hd = a.hd;
    // Key by key, each cached value loaded once for all the heads that share it.
    attention_rows_with(a, dot, |probs, values, width, off, og| {
        let len = probs.len() / (og.len() / hd);
        og.fill(0.0);
        for (j, vr) in values.chunks_exact(width).enumerate() {
            let vr = &vr[off..off + hd];
            for (r, oh) in og.chunks_exact_mut(hd).enumerate() {
                let p = probs[r * len + j];
                for (o, &x) in oh.iter_mut().zip(vr) {
                    *o += p * x;
                }
            }
        }
    });
}

/// Attention of a decode step's queries `q: [n, heads, head_dim]` over each row's
/// cached prefix in `keys`, `values: [rows, kv_heads, head_dim]` (see
/// [`DecodeAttention`]). Returns `[n, heads * head_dim]`, as [`attention`] does.
pub(crate) fn decode_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    rows: DecodeRows<'_>,
) -> Result<Tensor> {
    Ok(q.contiguous()?.apply_op3_no_bwd(keys, values, &DecodeAttention(rows))?)
}

/// `silu(gate) * up` in one pass, forward only: the SwiGLU of the decode path, where
/// the separate candle ops would allocate and walk two `[n, intermediate]` buffers.
/// SiLU is computed as candle computes it, `x / (1 + exp(-x))`. Only the first `rows`
/// rows are computed; the rest (padding rows of a decode step) are zero.
#[derive(Debug, Clone, Copy)]
struct SwiGlu {
    rows: usize,
}

impl candle_core::CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (g, u) = contiguous_f32_pair(self.name(), (s1, l1), (s2, l2))?;
        if l1.dims() != l2.dims() {
            candle_core::bail!("swiglu: gate {:?} and up {:?} differ in shape", l1.dims(), l2.dims())
        }
        let cols = l1.dims().last().copied().unwrap_or(1);
        let live = self.rows.saturating_mul(cols).min(g.len());
        let mut out = vec![0f32; g.len()];
        for ((o, &g), &u) in out[..live].iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// `silu(gate) * up` for the first `rows` rows of `[n, d]` inputs, zero after, without
/// an autograd graph (see [`SwiGlu`]).
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor, rows: usize) -> Result<Tensor> {
    Ok(gate.contiguous()?.apply_op2_no_bwd(&up.contiguous()?, &SwiGlu { rows })?)
}

/// A linear layer laid out for decoding: `[in, out]` row-major (the transpose of the
/// training layout `[out, in]`), with its bias. Kept only by models that never train
/// (see `Model::frozen_copy`), next to the training weights.
pub(crate) struct DenseWeight {
    /// `[inputs, outputs]` row-major.
    data: Vec<f32>,
    bias: Option<Vec<f32>>,
    inputs: usize,
    outputs: usize,
}

impl std::fmt::Debug for DenseWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenseWeight")
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .field("bias", &self.bias.is_some())
            .finish()
    }
}

impl DenseWeight {
    /// The decode layout of training weights `ws` stacked along their output
    /// dimension (`[out_i, in]` each, e.g. the query, key and value projections, read
    /// by one product), with their biases stacked the same way (all or none).
    pub(crate) fn stacked(ws: &[&Tensor], biases: &[&Tensor]) -> Result<Self> {
        let w = if ws.len() == 1 { ws[0].clone() } else { Tensor::cat(ws, 0)? };
        let (outputs, inputs) = w.dims2()?;
        let data = w.t()?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let bias = match biases {
            [] => None,
            [b] => Some(b.flatten_all()?.to_vec1::<f32>()?),
            bs => Some(Tensor::cat(bs, 0)?.to_vec1::<f32>()?),
        };
        if bias.as_ref().is_some_and(|b| b.len() != outputs) {
            return Err(crate::Error::invalid("decode weights", "biases do not match the stacked outputs"));
        }
        Ok(Self { data, bias, inputs, outputs })
    }

    /// `x @ w (+ b)` for `x: [n, inputs]` (see [`DecodeLinear`]).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.contiguous()?.apply_op1_no_bwd(&DecodeLinear(self))?)
    }
}

/// `x @ w (+ b)` for the rows of a decode step or prefill, on weights in decode layout.
///
/// candle's matmul on `x @ wᵀ` repacked the transposed weights on every call and chose
/// its kernel by the number of rows, so decoding padded every linear input to
/// `DECODE_MIN_ROWS` rows to stay batch-invariant. Here every output element is one
/// fused multiply-add chain over the inputs in index order, then `+ b`, whichever rows
/// and tile it is computed with: a row's result is bitwise independent of the batch at
/// any batch size, without padding. Rows are split across the current rayon pool when
/// it has more than one thread (the split does not change any result).
#[derive(Debug)]
struct DecodeLinear<'a>(&'a DenseWeight);

impl candle_core::CustomOp1 for DecodeLinear<'_> {
    fn name(&self) -> &'static str {
        "decode-linear"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let w = self.0;
        let x = contiguous_f32(self.name(), s, l)?;
        let (n, k) = l.shape().dims2()?;
        if k != w.inputs {
            candle_core::bail!(
                "decode-linear: input {:?} does not fit a {}x{} weight",
                l.dims(),
                w.inputs,
                w.outputs
            )
        }
        let mut out = vec![0f32; n * w.outputs];
        dense_rows(x, w, &mut out);
        Ok((candle_core::CpuStorage::F32(out), (n, w.outputs).into()))
    }
}

/// Rows per parallel task when a linear layer's rows are split across threads.
const DENSE_ROWS_PER_TASK: usize = 32;

/// `out = x @ w (+ b)` row by row (see [`DecodeLinear`]); `x` holds whole rows.
pub(crate) fn dense_rows(x: &[f32], w: &DenseWeight, out: &mut [f32]) {
    let (k, m) = (w.inputs, w.outputs);
    let n = x.len().checked_div(k).unwrap_or(0);
    if n >= 2 * DENSE_ROWS_PER_TASK && rayon::current_num_threads() > 1 {
        use rayon::prelude::*;
        x.par_chunks(DENSE_ROWS_PER_TASK * k)
            .zip(out.par_chunks_mut(DENSE_ROWS_PER_TASK * m))
            .for_each(|(x, out)| pulp::Arch::new().dispatch(DenseKernel { x, w, out }));
    } else {
        pulp::Arch::new().dispatch(DenseKernel { x, w, out });
    }
}

/// One thread's share of [`dense_rows`], generic over the SIMD instruction set that
/// `pulp` picks at run time.
struct DenseKernel<'a> {
    x: &'a [f32],
    w: &'a DenseWeight,
    out: &'a mut [f32],
}

/// Rows of one register tile.
const TILE_ROWS: usize = 4;
/// SIMD vectors of output columns of one register tile: 4 rows x 3 vectors is twelve
/// independent accumulators, enough to hide the latency of fused multiply-adds.
const TILE_VECTORS: usize = 3;

impl pulp::WithSimd for DenseKernel<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        let DenseKernel { x, w, out } = self;
        let m = w.outputs;
        let l = S::F32_LANES;
        // Column panels outside, rows inside: a panel of the weight (`inputs x 3`
        // vectors, 12 KiB at 128 inputs) stays in L1 while every row tile passes over
        // it, instead of the whole weight streaming through once per row tile.
        let mut c = 0;
        while c + TILE_VECTORS * l <= m {
            dense_panel::<S, TILE_VECTORS, true>(simd, x, w, c, out);
            c += TILE_VECTORS * l;
        }
        while c + l <= m {
            dense_panel::<S, 1, true>(simd, x, w, c, out);
            c += l;
        }
        if c < m {
            dense_panel::<S, 1, false>(simd, x, w, c, out);
        }
    }
}

/// Every row of [`DenseKernel`] times one panel of output columns: tiles of
/// [`TILE_ROWS`] rows, then single rows.
#[inline(always)]
fn dense_panel<S: pulp::Simd, const V: usize, const FULL: bool>(
    simd: S,
    x: &[f32],
    w: &DenseWeight,
    c: usize,
    out: &mut [f32],
) {
    let (k, m) = (w.inputs, w.outputs);
    let n = x.len().checked_div(k).unwrap_or(0);
    let tiled = n / TILE_ROWS * TILE_ROWS;
    for r in (0..tiled).step_by(TILE_ROWS) {
        let xs: [&[f32]; TILE_ROWS] = std::array::from_fn(|i| &x[(r + i) * k..(r + i + 1) * k]);
        dense_tile::<S, TILE_ROWS, V, FULL>(simd, &xs, w, c, &mut out[r * m..]);
    }
    for r in tiled..n {
        dense_tile::<S, 1, V, FULL>(simd, &[&x[r * k..(r + 1) * k]], w, c, &mut out[r * m..]);
    }
}

/// One register tile: rows `xs` times output columns `c..c + V` vectors (`FULL`), or
/// the last, partial vector of columns (`!FULL`, `V == 1`, masked loads and stores
/// computing the same chain per element).
#[inline(always)]
fn dense_tile<S: pulp::Simd, const R: usize, const V: usize, const FULL: bool>(
    simd: S,
    xs: &[&[f32]; R],
    w: &DenseWeight,
    c: usize,
    out: &mut [f32],
) {
    let m = w.outputs;
    let l = S::F32_LANES;
    let width = if FULL { V * l } else { m - c };
    let load = |s: &[f32]| -> S::f32s {
        if FULL {
            bytemuck::pod_read_unaligned(bytemuck::cast_slice(&s[..l]))
        } else {
            simd.partial_load_f32s(s)
        }
    };
    let mut acc = [[simd.splat_f32s(0.0); V]; R];
    for (p, wrow) in w.data.chunks_exact(m).enumerate() {
        let wrow = &wrow[c..c + width];
        let wv: [S::f32s; V] = std::array::from_fn(|v| load(&wrow[v * l..]));
        for r in 0..R {
            let xv = simd.splat_f32s(xs[r][p]);
            for v in 0..V {
                acc[r][v] = simd.mul_add_e_f32s(xv, wv[v], acc[r][v]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let o = &mut out[r * m + c..r * m + c + width];
        for (v, &a) in acc.iter().enumerate() {
            let y = match &w.bias {
                Some(b) => simd.add_f32s(a, load(&b[c + v * l..c + width])),
                None => a,
            };
            if FULL {
                o[v * l..(v + 1) * l].copy_from_slice(bytemuck::cast_slice(std::slice::from_ref(&y)));
            } else {
                simd.partial_store_f32s(o, y);
            }
        }
    }
}

/// `silu(gate) * up` from one `[n, 2 * intermediate]` tensor holding each row's gate
/// then its up projection (the product of a stacked gate/up [`DenseWeight`]), to
/// `[n, intermediate]`; forward only, computed as [`SwiGlu`] computes it.
#[derive(Debug, Clone, Copy)]
struct SwiGluStacked;

impl candle_core::CustomOp1 for SwiGluStacked {
    fn name(&self) -> &'static str {
        "swiglu-stacked"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let gu = contiguous_f32(self.name(), s, l)?;
        let (n, two) = l.shape().dims2()?;
        if two % 2 != 0 {
            candle_core::bail!("swiglu-stacked: {two} columns do not split into gate and up")
        }
        let i = two / 2;
        let mut out = vec![0f32; n * i];
        pulp::Arch::new().dispatch(SwiGluRows { gu, out: &mut out, i });
        Ok((candle_core::CpuStorage::F32(out), (n, i).into()))
    }
}

/// The loop of [`SwiGluStacked`], compiled for the instruction set `pulp` detects
/// (with [`exp_vectorisable`], it runs eight lanes at a time under AVX2).
struct SwiGluRows<'a> {
    gu: &'a [f32],
    out: &'a mut [f32],
    i: usize,
}

impl pulp::WithSimd for SwiGluRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let SwiGluRows { gu, out, i } = self;
        for (o, row) in out.chunks_exact_mut(i.max(1)).zip(gu.chunks_exact(2 * i.max(1))) {
            let (g, u) = row.split_at(i);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + exp_vectorisable(-g)) * u;
            }
        }
    }
}

/// `e^x` in f32 within about 2 ulp (Cephes' `expf`: `x = n·ln 2 + r`, a degree-6
/// polynomial for `e^r`, `2^n` built in the exponent bits), written without branches or
/// library calls so that loops over it vectorise; libm's `expf` is a call per element
/// and made up a tenth of a decode step at 64 rows. Inputs are clamped to
/// `[-87.3, 88.3]` (results from about `1e-38` to `2e38`, never zero or infinite).
#[inline(always)]
pub(crate) fn exp_vectorisable(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.3);
    let n = (x * LOG2E + 0.5).floor();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5); // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32
    let y = (p * r).mul_add(r, r) + 1.0;
    y * f32::from_bits(((n as i32).wrapping_add(127) << 23) as u32)
}

/// `silu(gate) * up` of a stacked `[n, 2 * intermediate]` gate/up product (see
/// [`SwiGluStacked`]).
pub(crate) fn swiglu_stacked(gate_up: &Tensor) -> Result<Tensor> {
    Ok(gate_up.contiguous()?.apply_op1_no_bwd(&SwiGluStacked)?)
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

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
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
        let both = gate.apply_op3_no_bwd(up, &grad.contiguous()?, &SwiGluGrad)?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

/// The backward of [`SwiGluTrain`]: from `gate`, `up` and the output gradient `dy`,
/// `[d gate, d up]` stacked on a new leading dimension. With `s = sigmoid(gate)`:
/// `d up = dy · gate · s` and `d gate = dy · up · s · (1 + gate · (1 − s))`.
#[derive(Debug, Clone, Copy)]
struct SwiGluGrad;

impl candle_core::CustomOp3 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "swiglu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CpuStorage,
        l3: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (g, u) = contiguous_f32_pair(self.name(), (s1, l1), (s2, l2))?;
        let dy = contiguous_f32(self.name(), s3, l3)?;
        if l1.dims() != l2.dims() || l1.dims() != l3.dims() {
            candle_core::bail!(
                "swiglu-grad: gate {:?}, up {:?} and gradient {:?} differ in shape",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        let n = g.len();
        let mut out = vec![0f32; 2 * n];
        let (dg, du) = out.split_at_mut(n);
        for i in 0..n {
            let (x, d) = (g[i], dy[i]);
            let s = 1.0 / (1.0 + (-x).exp());
            du[i] = d * x * s;
            dg[i] = d * u[i] * s * (1.0 + x * (1.0 - s));
        }
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((candle_core::CpuStorage::F32(out), dims.into()))
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
    /// `[len, keys]` additive mask: 0 on the ancestors and the causal prefix, `-inf` after.
    pub(crate) mask: Tensor,
}

/// One [`SegmentPlan`] per segment of `row`, in row order.
pub(crate) fn segment_plans(row: &metronome_core::PackedRow, device: &Device) -> Result<Vec<SegmentPlan>> {
    let mut plans = Vec::with_capacity(row.segments.len());
    for seg in &row.segments {
        let mut keys = Vec::new();
        let mut parent = seg.parent;
        while let Some(a) = parent {
            let ancestor = row.segments[a as usize];
            keys.push((ancestor.start as usize, ancestor.len as usize));
            parent = ancestor.parent;
        }
        keys.reverse();
        let visible: usize = keys.iter().map(|k| k.1).sum();
        let (start, len) = (seg.start as usize, seg.len as usize);
        keys.push((start, len));
        let width = visible + len;
        let mut mask = vec![f32::NEG_INFINITY; len * width];
        for i in 0..len {
            mask[i * width..i * width + visible + i + 1].fill(0.0);
        }
        plans.push(SegmentPlan { start, len, keys, mask: Tensor::from_vec(mask, (len, width), device)? });
    }
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use metronome_core::{PackedRow, Segment};

    use super::*;
    use crate::Kernels;

    /// Deterministic values in `[-1, 1)`.
    fn values(seed: u64, n: usize) -> Vec<f32> {
        (0..n as u64)
            .map(|i| (metronome_core::mix64(seed * 1_000_003 + i) >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }

    /// A `[out, in]` training-layout weight, its decode-layout copy, and a bias.
    fn dense(inputs: usize, outputs: usize, bias: bool) -> (Tensor, Option<Tensor>, DenseWeight) {
        let w = Tensor::from_vec(values(1, outputs * inputs), (outputs, inputs), &Device::Cpu).unwrap();
        let b = bias.then(|| Tensor::from_vec(values(2, outputs), outputs, &Device::Cpu).unwrap());
        let d = DenseWeight::stacked(&[&w], &b.iter().collect::<Vec<_>>()).unwrap();
        (w, b, d)
    }

    #[test]
    fn decode_linear_matches_candle_linear() {
        // Widths with and without a partial SIMD vector, tile tails of 1-3 rows.
        for (inputs, outputs, n, bias) in
            [(128, 256, 64, true), (128, 99, 7, false), (384, 128, 5, false), (3, 5, 1, true)]
        {
            let (w, b, d) = dense(inputs, outputs, bias);
            let x = Tensor::from_vec(values(3, n * inputs), (n, inputs), &Device::Cpu).unwrap();
            let want = linear(&x, &w, b.as_ref()).unwrap().to_vec2::<f32>().unwrap();
            let got = d.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!((g - w).abs() < 1e-4, "{inputs}x{outputs} n={n}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn decode_linear_rows_do_not_depend_on_the_batch() {
        let (_, _, d) = dense(128, 99, true);
        let xs = values(4, 70 * 128);
        let x = Tensor::from_vec(xs.clone(), (70, 128), &Device::Cpu).unwrap();
        let all = d.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        // Each row alone, and the batch split across two threads (the parallel path).
        for r in [0, 3, 4, 69] {
            let one = Tensor::from_vec(xs[r * 128..(r + 1) * 128].to_vec(), (1, 128), &Device::Cpu).unwrap();
            assert_eq!(d.forward(&one).unwrap().to_vec2::<f32>().unwrap()[0], all[r], "row {r}");
        }
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let split = pool.install(|| d.forward(&x).unwrap().to_vec2::<f32>().unwrap());
        assert_eq!(split, all);
        assert!(d.forward(&Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap()).is_err());
    }

    #[test]
    fn stacked_swiglu_matches_the_two_input_form() {
        let g = Tensor::from_vec(values(5, 3 * 6), (3, 6), &Device::Cpu).unwrap();
        let u = Tensor::from_vec(values(6, 3 * 6), (3, 6), &Device::Cpu).unwrap();
        let want = swiglu(&g, &u, 3).unwrap().to_vec2::<f32>().unwrap();
        let got = swiglu_stacked(&Tensor::cat(&[&g, &u], 1).unwrap()).unwrap().to_vec2::<f32>().unwrap();
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-3), "{g} vs {w}");
        }
    }

    #[test]
    fn vectorisable_exp_is_within_a_few_ulp() {
        let mut worst = 0f64;
        for i in -8700..8830 {
            let x = i as f32 / 100.0 + 0.003;
            let (got, want) = (f64::from(exp_vectorisable(x)), f64::from(x).exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 3e-7, "max relative error {worst}");
        assert!(exp_vectorisable(-1e4) > 0.0 && exp_vectorisable(1e4).is_finite());
        assert_eq!(exp_vectorisable(0.0), 1.0);
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
            let mask = plan.mask.to_vec2::<f32>().unwrap();
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
    fn masked_softmax_matches_composed_ops_and_gradient() {
        let dev = Device::Cpu;
        let x = candle_core::Var::from_tensor(
            &Tensor::new(
                &[[[0.3f32, -1.0, 2.0], [1.5, 0.2, -0.7]], [[0.0, 0.1, 0.2], [3.0, -2.0, 1.0]]],
                &dev,
            )
            .unwrap(),
        )
        .unwrap();
        let mask = Tensor::new(&[[0f32, f32::NEG_INFINITY, 0.0], [0.0, 0.0, 0.0]], &dev).unwrap();
        let w = Tensor::new(&[1f32, -2.0, 0.5], &dev).unwrap();
        let fused = masked_softmax(x.as_tensor(), &mask).unwrap();
        let composed = Kernels::Portable.masked_softmax(x.as_tensor(), &mask).unwrap();
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
        };
        assert!(diff(&fused, &composed) < 1e-6);
        let gf = fused.broadcast_mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let gc = composed.broadcast_mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(diff(gf.get(x.as_tensor()).unwrap(), gc.get(x.as_tensor()).unwrap()) < 1e-6);
    }

    #[test]
    fn fused_rms_norm_and_rope_match_composed_ops_and_gradients() {
        let dev = Device::Cpu;
        let xs: Vec<f32> = (0..48).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let x = candle_core::Var::from_tensor(&Tensor::from_vec(xs, (3, 2, 8), &dev).unwrap()).unwrap();
        let w = candle_core::Var::from_tensor(
            &Tensor::new(&[0.5f32, 1.0, 1.5, 2.0, -1.0, 0.3, 0.7, 1.1], &dev).unwrap(),
        )
        .unwrap();
        let probe =
            Tensor::from_vec((0..48).map(|i| (i as f32 * 0.7).sin()).collect::<Vec<_>>(), (3, 2, 8), &dev)
                .unwrap();
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
        };
        let t = rope_tables(&[0, 5, 2], 8, 10_000.0);
        let run = |fused: bool| {
            let y = if fused {
                rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap()
            } else {
                Kernels::Portable.rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap()
            };
            let y = if fused { apply_rope(&y, &t).unwrap() } else { Kernels::Portable.rope(&y, &t).unwrap() };
            let g = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            (y, g.get(x.as_tensor()).unwrap().clone(), g.get(w.as_tensor()).unwrap().clone())
        };
        let (yf, gxf, gwf) = run(true);
        let (yc, gxc, gwc) = run(false);
        assert!(diff(&yf, &yc) < 1e-5, "forward {}", diff(&yf, &yc));
        assert!(diff(&gxf, &gxc) < 1e-5, "dx {}", diff(&gxf, &gxc));
        assert!(diff(&gwf, &gwc) < 1e-5, "dw {}", diff(&gwf, &gwc));
    }

    /// `n` pseudo-random values in `[-2, 2)`.
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        (0..n as u64).map(|i| (metronome_core::mix64(seed << 32 | i) % 4096) as f32 / 1024.0 - 2.0).collect()
    }

    #[test]
    fn decode_attention_matches_reference_on_ragged_rows() {
        // Head sizes of 4 and 8 SIMD vectors (registers held across keys), of 5 (the
        // general loop) and of a fraction of one (the scalar loops).
        for kernels in [Kernels::Fused, Kernels::Portable] {
            for hd in [32, 64, 40, 6] {
                decode_attention_matches_reference(kernels, hd);
            }
        }
    }

    fn decode_attention_matches_reference(kernels: Kernels, hd: usize) {
        let dev = Device::Cpu;
        // 4 query heads over 2 key/value heads.
        let (heads, kvh, slots, max_len) = (4, 2, 6, 50);
        let shape = (slots * max_len, kvh, hd);
        let keys = Tensor::from_vec(noise(1, slots * max_len * kvh * hd), shape, &dev).unwrap();
        let values = Tensor::from_vec(noise(2, slots * max_len * kvh * hd), shape, &dev).unwrap();
        // Ragged lengths, slots out of order, one row of length 1 and one filling its slot.
        let slot_of = [4usize, 0, 5, 2, 1];
        let len = [17usize, 1, 50, 33, 8];
        let base: Vec<usize> = slot_of.iter().map(|s| s * max_len).collect();
        let rows = DecodeRows { base: &base, len: &len };
        let n = slot_of.len();
        let q = Tensor::from_vec(noise(3, n * heads * hd), (n, heads, hd), &dev).unwrap();
        let new_k = Tensor::from_vec(noise(4, n * kvh * hd), (n, kvh, hd), &dev).unwrap();
        let new_v = Tensor::from_vec(noise(5, n * kvh * hd), (n, kvh, hd), &dev).unwrap();
        kernels.write_decode_rows(&keys, &new_k, rows).unwrap();
        kernels.write_decode_rows(&values, &new_v, rows).unwrap();
        let fused = kernels.decode_attention(&q, &keys, &values, rows).unwrap();
        assert_eq!(fused.dims(), [n, heads * hd]);
        for i in 0..n {
            let last = base[i] + len[i] - 1;
            let written = keys.narrow(0, last, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(written, new_k.get(i).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let written = values.narrow(0, last, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(written, new_v.get(i).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let reference = attention(
                Kernels::Fused,
                &q.narrow(0, i, 1).unwrap(),
                &keys.narrow(0, base[i], len[i]).unwrap(),
                &values.narrow(0, base[i], len[i]).unwrap(),
                None,
            )
            .unwrap();
            let got = fused.narrow(0, i, 1).unwrap();
            let d = (got - reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-5, "{kernels:?}, head_dim {hd}, row {i} (length {}): max diff {d}", len[i]);
        }
        if kernels == Kernels::Portable {
            return; // batch-invariant only within 1e-5 (padding changes its reduction length)
        }
        // Each row alone gives bitwise the batch's result.
        let all = fused.to_vec2::<f32>().unwrap();
        for i in 0..n {
            let one = DecodeRows { base: &base[i..=i], len: &len[i..=i] };
            let alone = decode_attention(&q.narrow(0, i, 1).unwrap(), &keys, &values, one).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&alone.to_vec2::<f32>().unwrap()[0]), bits(&all[i]), "row {i}");
        }
    }

    #[test]
    fn fused_swiglu_matches_composed_ops() {
        let dev = Device::Cpu;
        let g = Tensor::from_vec(noise(7, 3 * 37), (3, 37), &dev).unwrap();
        let u = Tensor::from_vec(noise(8, 3 * 37), (3, 37), &dev).unwrap();
        let composed = Kernels::Portable.swiglu(&g, &u, 3).unwrap();
        let d = (swiglu(&g, &u, 3).unwrap() - composed).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-6);
        let two = swiglu(&g, &u, 2).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(two[1], swiglu(&g, &u, 3).unwrap().to_vec2::<f32>().unwrap()[1]);
        assert!(two[2].iter().all(|&x| x == 0.0), "rows past `rows` are zero");
        assert!(swiglu(&g, &u.narrow(1, 0, 36).unwrap(), 3).is_err());
    }

    #[test]
    fn fused_training_swiglu_matches_composed_ops_and_gradients() {
        let dev = Device::Cpu;
        let var = |seed, shape: (usize, usize)| {
            let t = Tensor::from_vec(noise(seed, shape.0 * shape.1), shape, &dev).unwrap();
            candle_core::Var::from_tensor(&(t * 3.0).unwrap()).unwrap()
        };
        let (g, u) = (var(11, (5, 37)), var(12, (5, 37)));
        let probe = Tensor::from_vec(noise(13, 5 * 37), (5, 37), &dev).unwrap();
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
        };
        let run = |fused: bool| {
            let y = if fused {
                swiglu_train(g.as_tensor(), u.as_tensor()).unwrap()
            } else {
                Kernels::Portable.swiglu_train(g.as_tensor(), u.as_tensor()).unwrap()
            };
            let grads = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            (y, grads.get(g.as_tensor()).unwrap().clone(), grads.get(u.as_tensor()).unwrap().clone())
        };
        let (yf, dgf, duf) = run(true);
        let (yc, dgc, duc) = run(false);
        assert!(diff(&yf, &yc) < 1e-5, "forward {}", diff(&yf, &yc));
        assert!(diff(&dgf, &dgc) < 1e-5, "d gate {}", diff(&dgf, &dgc));
        assert!(diff(&duf, &duc) < 1e-5, "d up {}", diff(&duf, &duc));
        assert!(swiglu_train(g.as_tensor(), &u.as_tensor().narrow(1, 0, 36).unwrap()).is_err());
    }

    #[test]
    fn fused_target_logprobs_match_composed_ops_and_gradients() {
        let dev = Device::Cpu;
        let (n, vocab) = (6, 41);
        let z = Tensor::from_vec(noise(21, n * vocab), (n, vocab), &dev).unwrap();
        let z = candle_core::Var::from_tensor(&(z * 2.5).unwrap()).unwrap();
        let targets: Vec<u32> = vec![0, 40, 7, 7, 19, 3];
        let (wl, we) = (
            Tensor::from_vec(noise(22, n), n, &dev).unwrap(),
            Tensor::from_vec(noise(23, n), n, &dev).unwrap(),
        );
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
        };
        let split = |both: &Tensor| {
            (
                both.narrow(1, 0, 1).unwrap().squeeze(1).unwrap(),
                both.narrow(1, 1, 1).unwrap().squeeze(1).unwrap(),
            )
        };
        let loss =
            |l: &Tensor, e: &Tensor| ((l * &wl).unwrap() + (e * &we).unwrap()).unwrap().sum_all().unwrap();
        for temperature in [1.0f32, 0.7, 1.6] {
            let inv = 1.0 / temperature;
            let (lf, ef) = split(&target_logprobs_entropy(z.as_tensor(), targets.clone(), inv).unwrap());
            let (lc, ec) = split(
                &Kernels::Portable.target_logprobs_entropy(z.as_tensor(), targets.clone(), inv).unwrap(),
            );
            assert!(diff(&lf, &lc) < 1e-5, "T={temperature}: log-probs {}", diff(&lf, &lc));
            assert!(diff(&ef, &ec) < 1e-5, "T={temperature}: entropy {}", diff(&ef, &ec));
            // Both against the plain log-softmax of the scaled logits.
            let logp = log_softmax_last_dim(&(z.as_tensor() * f64::from(inv)).unwrap()).unwrap();
            let index = Tensor::from_vec(targets.clone(), (n, 1), &dev).unwrap();
            let want = logp.gather(&index, 1).unwrap().squeeze(1).unwrap();
            assert!(diff(&lf, &want) < 1e-5, "T={temperature}: against log_softmax(z / T)");
            let gf = loss(&lf, &ef).backward().unwrap();
            let gc = loss(&lc, &ec).backward().unwrap();
            let (gf, gc) = (gf.get(z.as_tensor()).unwrap(), gc.get(z.as_tensor()).unwrap());
            assert!(diff(gf, gc) < 1e-5, "T={temperature}: d logits {}", diff(gf, gc));
        }
        for k in [Kernels::Fused, Kernels::Portable] {
            assert!(k.target_logprobs_entropy(z.as_tensor(), vec![0; n - 1], 1.0).is_err());
            assert!(k.target_logprobs_entropy(z.as_tensor(), vec![41; n], 1.0).is_err());
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
    fn decode_ops_reject_rows_outside_the_cache() {
        for k in [Kernels::Fused, Kernels::Portable] {
            decode_ops_reject_rows_outside_the_cache_with(k);
        }
    }

    fn decode_ops_reject_rows_outside_the_cache_with(kernels: Kernels) {
        let dev = Device::Cpu;
        let cache = Tensor::zeros((8, 1, 4), candle_core::DType::F32, &dev).unwrap();
        let q = Tensor::zeros((1, 2, 4), candle_core::DType::F32, &dev).unwrap();
        let new = Tensor::zeros((1, 1, 4), candle_core::DType::F32, &dev).unwrap();
        let past_end = DecodeRows { base: &[4], len: &[5] };
        let empty = DecodeRows { base: &[0], len: &[0] };
        let two = DecodeRows { base: &[0, 1], len: &[1, 1] };
        for rows in [past_end, empty, two] {
            assert!(kernels.write_decode_rows(&cache, &new, rows).is_err());
            assert!(kernels.decode_attention(&q, &cache, &cache, rows).is_err());
        }
        if kernels == Kernels::Portable {
            return;
        }
        let wrong_heads = Tensor::zeros((1, 3, 4), candle_core::DType::F32, &dev).unwrap();
        let ok = DecodeRows { base: &[0], len: &[1] };
        let err = decode_attention(
            &wrong_heads,
            &cache.repeat((1, 2, 1)).unwrap(),
            &cache.repeat((1, 2, 1)).unwrap(),
            ok,
        );
        assert!(err.unwrap_err().to_string().contains("decode-attention"));
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
