//! The log-prob head in chunks ("linear cross-entropy"): the final projection, the
//! log-softmax at a sampling temperature, the target's log-prob and the entropy as one
//! graph node that never holds `[targets, vocab]` logits.
//!
//! At SmolLM2's vocabulary (49,152) the logits of the loss targets are the largest
//! tensors of a training step: 8 rows × 512 tokens make 0.8 GB of them in f32, and
//! today's head (`Model::score` without chunks) keeps them for its backward, and the
//! portable form several more of that size. Liger-Kernel's fused linear cross-entropy
//! (`liger_kernel/ops/fused_linear_cross_entropy.py`) bounds the transient logits by
//! computing them a chunk of rows at a time; since its loss is the op's own output, it
//! computes the gradients in the forward. Here the loss is the trainer's, made of
//! per-target terms (advantages, ratios, KL), so each row's upstream gradient is known
//! only in the backward: as Liger does for its per-token `reduction="none"` case, the
//! backward recomputes the logits and folds that gradient in before the products that
//! sum over rows.
//!
//! - Forward, by chunks of rows (graph-free, on detached inputs): the chunk's logits
//!   `h·Wᵀ` in the weights' type, then per row the target's log-prob, the entropy and
//!   the log-sum-exp in f32 ([`Kernels::logprob_stats`]).
//! - Backward, by blocks of vocabulary columns: the block's logits again, their
//!   gradient from the saved log-sum-exp and entropy ([`Kernels::logprob_columns_grad`]),
//!   then `dW[block] = dzᵀ·h` (one product over every row: each block of the weight's
//!   gradient is written once, never summed across chunks, which on a GPU would cost a
//!   pass over the whole `[vocab, hidden]` gradient per chunk) and `dh += dz·W[block]`
//!   (accumulated in f32, `[targets, hidden]`: small).
//!
//! Both loops run candle ops only, so they run on every device; what a chunk computes
//! per row goes through the [`Kernels`] seam: fused CPU kernels, one CUDA kernel each
//! way under `Kernels::Cuda` (`kernels/layer.cu`: about a dozen `[rows, vocab]` f32
//! passes of the composed form become one read of the logits), composed ops otherwise.
//! [`crate::recompute`] attaches the result to the hidden states and the weight.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::recompute::attach;
use crate::{Error, Kernels, Result};

/// The elements of transient logits a chunk may hold on the CPU: 4 M f32 (16 MB per
/// buffer) keeps the head's memory far below the model's, where the products are
/// still large enough to run at the matmul's speed.
pub(crate) const CPU_CHUNK_ELEMENTS: usize = 1 << 22;

/// The same on a GPU: 32 M (128 MB of f32 per buffer), so that a step at 8 × 1024
/// tokens and a 152 k vocabulary runs a few dozen chunks, not hundreds of
/// launch-bound ones.
pub(crate) const GPU_CHUNK_ELEMENTS: usize = 1 << 25;

/// For each row `i` of `hidden: [n, d]`, the log-prob of `targets[i]` under
/// `softmax(hidden·weightᵀ / T)` and that distribution's entropy, as `[n, 2]` f32,
/// differentiable in `hidden` and `weight`; `inv_temperature` is `1 / T`. Transient
/// logits hold at most about `chunk_elements` values (never fewer than one row or one
/// column).
pub(crate) fn linear_logprobs(
    kernels: Kernels,
    hidden: &Tensor,
    weight: &Tensor,
    targets: Vec<u32>,
    inv_temperature: f32,
    chunk_elements: usize,
) -> Result<Tensor> {
    let (n, d) = hidden.dims2()?;
    let (vocab, dw) = weight.dims2()?;
    if d != dw {
        return Err(Error::invalid(
            "log-prob head",
            format!("hidden states of width {d} for a weight {vocab} x {dw}"),
        ));
    }
    if targets.len() != n {
        return Err(Error::invalid("targets", format!("{} for {n} rows of hidden states", targets.len())));
    }
    if let Some((i, t)) = targets.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
        return Err(Error::invalid(
            format!("target {i}"),
            format!("is token {t}, outside the vocabulary of {vocab}"),
        ));
    }
    let targets = Arc::new(targets);
    let column = Tensor::from_slice(targets.as_slice(), (n, 1), hidden.device())?;
    let (h, w) = (hidden.detach(), weight.detach());
    let rows = (chunk_elements / vocab.max(1)).clamp(1, n.max(1));
    let mut parts = Vec::with_capacity(n.div_ceil(rows));
    for start in (0..n).step_by(rows) {
        let len = rows.min(n - start);
        let z = h.narrow(0, start, len)?.matmul(&w.t()?)?;
        parts.push(kernels.logprob_stats(
            &z,
            &targets[start..start + len],
            &column.narrow(0, start, len)?,
            inv_temperature,
        )?);
    }
    let stats = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 0)? };
    let value = stats.narrow(1, 0, 2)?.contiguous()?;
    let columns = (chunk_elements / n.max(1)).clamp(1, vocab.max(1));
    let backward = Box::new(move |h: &Tensor, w: &Tensor, g: &Tensor| {
        let grads = ColumnBlocks {
            kernels,
            targets: &targets,
            column: &column,
            stats: &stats,
            inv_temperature,
            columns,
        };
        grads.backward(h, w, g).map_err(candle_core::Error::wrap)
    });
    attach("linear-logprobs", hidden, weight, value, backward)
}

/// What the backward of [`linear_logprobs`] reads, besides the inputs and the gradient.
struct ColumnBlocks<'a> {
    kernels: Kernels,
    targets: &'a [u32],
    column: &'a Tensor,
    /// `[n, 3]`: target log-prob, entropy, log-sum-exp of each row (the forward's).
    stats: &'a Tensor,
    inv_temperature: f32,
    /// Vocabulary columns per block.
    columns: usize,
}

impl ColumnBlocks<'_> {
    /// The gradients of the hidden states and of the weight (each `None` when its
    /// input records no graph: a frozen head skips the weight's product).
    fn backward(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (want_h, want_w) = (hidden.track_op(), weight.track_op());
        let (h, w) = (hidden.detach(), weight.detach());
        let g = g.to_dtype(DType::F32)?.contiguous()?;
        let vocab = w.dim(0)?;
        let mut dh: Option<Tensor> = None;
        let mut dw = Vec::with_capacity(vocab.div_ceil(self.columns));
        for first in (0..vocab).step_by(self.columns) {
            let cols = self.columns.min(vocab - first);
            let block = w.narrow(0, first, cols)?;
            let z = h.matmul(&block.t()?)?;
            let dz = self
                .kernels
                .logprob_columns_grad(
                    &z,
                    self.stats,
                    self.targets,
                    self.column,
                    first,
                    &g,
                    self.inv_temperature,
                )?
                .to_dtype(h.dtype())?;
            if want_w {
                dw.push(dz.t()?.matmul(&h)?);
            }
            if want_h {
                let part = dz.matmul(&block)?.to_dtype(DType::F32)?;
                dh = Some(match dh {
                    Some(sum) => (sum + part)?,
                    None => part,
                });
            }
        }
        let dh = dh.map(|t| t.to_dtype(hidden.dtype())).transpose()?;
        let dw =
            if want_w { Some(if dw.len() == 1 { dw.remove(0) } else { Tensor::cat(&dw, 0)? }) } else { None };
        Ok((dh, dw))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::ops::{max_diff, noise};

    /// The chunked head against today's (the projection, then the fused or composed
    /// log-prob op on whole rows): values within 1e-5, gradients of the hidden states
    /// and the weight within 1e-4, with chunks of a few rows and columns, one chunk,
    /// and a temperature.
    #[test]
    fn chunked_head_matches_the_whole_logits() {
        let dev = Device::Cpu;
        let (n, d, vocab) = (13, 24, 101);
        let h = Var::from_tensor(&Tensor::from_vec(noise(41, n * d), (n, d), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(
            &(Tensor::from_vec(noise(42, vocab * d), (vocab, d), &dev).unwrap() * 0.5).unwrap(),
        )
        .unwrap();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 5) % vocab as u32).collect();
        let probe = Tensor::from_vec(noise(43, 2 * n), (n, 2), &dev).unwrap();
        let run = |out: Tensor| {
            let grads = (&out * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            (out, grads.get(h.as_tensor()).unwrap().clone(), grads.get(w.as_tensor()).unwrap().clone())
        };
        for kernels in [Kernels::Fused, Kernels::Portable] {
            for inv in [1.0f32, 1.0 / 0.7] {
                let logits = h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
                let (y0, dh0, dw0) =
                    run(kernels.target_logprobs_entropy(&logits, targets.clone(), inv).unwrap());
                for chunk in [1, 3 * vocab, 40 * 17, 1 << 20] {
                    let (y, dh, dw) = run(linear_logprobs(
                        kernels,
                        h.as_tensor(),
                        w.as_tensor(),
                        targets.clone(),
                        inv,
                        chunk,
                    )
                    .unwrap());
                    let what = format!("{kernels:?}, 1/T {inv}, chunk {chunk}");
                    assert!(max_diff(&y, &y0) < 1e-5, "{what}: values {}", max_diff(&y, &y0));
                    assert!(max_diff(&dh, &dh0) < 1e-4, "{what}: d hidden {}", max_diff(&dh, &dh0));
                    assert!(max_diff(&dw, &dw0) < 1e-4, "{what}: d weight {}", max_diff(&dw, &dw0));
                }
            }
        }
        // A frozen weight gets no gradient and its product is skipped; bad targets are refused.
        let out =
            linear_logprobs(Kernels::Fused, h.as_tensor(), &w.as_tensor().detach(), targets.clone(), 1.0, 64)
                .unwrap();
        let grads = out.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(h.as_tensor()).is_some() && grads.get(w.as_tensor()).is_none());
        let e = linear_logprobs(Kernels::Portable, h.as_tensor(), w.as_tensor(), vec![101; n], 1.0, 64)
            .unwrap_err();
        assert!(e.to_string().contains("outside the vocabulary"), "{e}");
        assert!(
            linear_logprobs(Kernels::Portable, h.as_tensor(), w.as_tensor(), vec![0; n - 1], 1.0, 64)
                .is_err()
        );
    }
}
