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

use crate::portable::portable_log_softmax;
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

/// What the log-prob head read for a batch's targets ([`crate::Model::score`]): the
/// final hidden state at each target's predicting position and the head's weight (with
/// their graphs when the model trains), at the temperature it scored. Kept beside the
/// log-probs so that a loss over the targets' whole next-token distributions reads the
/// same rows without another forward: the exact reverse KL of on-policy distillation
/// ([`reverse_kl`]).
#[derive(Clone, Debug)]
pub struct HeadInput {
    pub(crate) hidden: Tensor,
    pub(crate) weight: Tensor,
    pub(crate) inv_temperature: f32,
    /// The logits a chunk of the reverse KL may hold (the model's head budget).
    pub(crate) chunk_elements: usize,
}

/// For each target, the reverse KL `KL(p ‖ q) = Σ_v p(v) (log p(v) − log q(v))` of the
/// student's next-token distribution `p` from the teacher's `q`, each at the
/// temperature it was scored at, over the whole vocabulary: `[n]` f32, differentiable
/// in the student's hidden states and head weight (the teacher is a constant).
///
/// Computed a chunk of rows at a time, within the student's head budget as the
/// chunked log-prob head is: the forward keeps only the `[n]` result, and the
/// backward recomputes each chunk's log-probs of both models, whose gradient in the
/// student's logits `z` is `∂KL/∂z_v = p(v) (log p(v) − log q(v) − KL) / T`, then
/// `dh = dz·W` and `dW += dzᵀ·h`. The ops are candle's, so it runs on every device.
///
/// Errors when the two have different numbers of rows or vocabularies.
pub fn reverse_kl(student: &HeadInput, teacher: &HeadInput) -> Result<Tensor> {
    let n = student.hidden.dim(0)?;
    let vocab = student.weight.dim(0)?;
    let (tn, tvocab) = (teacher.hidden.dim(0)?, teacher.weight.dim(0)?);
    if (tn, tvocab) != (n, vocab) {
        return Err(Error::invalid(
            "reverse KL",
            format!(
                "the student has {n} targets over a vocabulary of {vocab}, the teacher {tn} over {tvocab}"
            ),
        ));
    }
    if n == 0 {
        return Ok(Tensor::zeros(0, DType::F32, student.hidden.device())?);
    }
    let pair = Arc::new(KlRows {
        teacher_hidden: teacher.hidden.detach(),
        teacher_weight: teacher.weight.detach(),
        inv_student: student.inv_temperature,
        inv_teacher: teacher.inv_temperature,
        rows: (student.chunk_elements / vocab.max(1)).clamp(1, n.max(1)),
    });
    let (h, w) = (student.hidden.detach(), student.weight.detach());
    let mut parts = Vec::with_capacity(n.div_ceil(pair.rows));
    for start in (0..n).step_by(pair.rows) {
        let len = pair.rows.min(n - start);
        let (logp, logq) = pair.log_probs(&h, &w, start, len)?;
        parts.push(kl_of(&logp, &logq)?);
    }
    let value = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 0)? };
    let backward = Box::new(move |h: &Tensor, w: &Tensor, g: &Tensor| {
        pair.backward(h, w, g).map_err(candle_core::Error::wrap)
    });
    attach("reverse-kl", &student.hidden, &student.weight, value, backward)
}

/// The teacher's side of [`reverse_kl`] and its chunking, kept for the backward.
struct KlRows {
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    inv_student: f32,
    inv_teacher: f32,
    /// Rows per chunk.
    rows: usize,
}

impl KlRows {
    /// The student's and the teacher's log-probs over the vocabulary for rows
    /// `start..start + len`, `[len, vocab]` f32 each.
    fn log_probs(&self, h: &Tensor, w: &Tensor, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let z = h.narrow(0, start, len)?.matmul(&w.t()?)?;
        let zt = self.teacher_hidden.narrow(0, start, len)?.matmul(&self.teacher_weight.t()?)?;
        let (logp, _) = portable_log_softmax(&z, self.inv_student)?;
        let (logq, _) = portable_log_softmax(&zt, self.inv_teacher)?;
        Ok((logp, logq))
    }

    /// The gradients of the student's hidden states and head weight (each `None` when
    /// its input records no graph).
    fn backward(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (want_h, want_w) = (hidden.track_op(), weight.track_op());
        let (h, w) = (hidden.detach(), weight.detach());
        let g = g.to_dtype(DType::F32)?;
        let n = h.dim(0)?;
        let mut dh = Vec::with_capacity(n.div_ceil(self.rows));
        let mut dw: Option<Tensor> = None;
        for start in (0..n).step_by(self.rows) {
            let len = self.rows.min(n - start);
            let (logp, logq) = self.log_probs(&h, &w, start, len)?;
            let p = logp.exp()?;
            let log_ratio = (logp - logq)?;
            let kl = (&p * &log_ratio)?.sum_keepdim(1)?;
            let scale = (g.narrow(0, start, len)?.unsqueeze(1)? * f64::from(self.inv_student))?;
            let dz = (p * log_ratio.broadcast_sub(&kl)?)?.broadcast_mul(&scale)?.to_dtype(h.dtype())?;
            if want_h {
                dh.push(dz.matmul(&w)?);
            }
            if want_w {
                let part = dz.t()?.matmul(&h.narrow(0, start, len)?)?.to_dtype(DType::F32)?;
                dw = Some(match dw {
                    Some(sum) => (sum + part)?,
                    None => part,
                });
            }
        }
        let dh =
            if want_h { Some(if dh.len() == 1 { dh.remove(0) } else { Tensor::cat(&dh, 0)? }) } else { None };
        let dw = dw.map(|t| t.to_dtype(weight.dtype())).transpose()?;
        Ok((dh, dw))
    }
}

/// `Σ_v exp(log p) (log p − log q)` per row.
fn kl_of(logp: &Tensor, logq: &Tensor) -> Result<Tensor> {
    Ok((logp.exp()? * (logp - logq)?)?.sum(1)?)
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

    /// The chunked reverse KL against the same divergence composed on the whole
    /// logits with autograd: values within 1e-5 and the student's gradients within
    /// 1e-4, at several chunk sizes and temperatures; the teacher gets no gradient, a
    /// student that is its own teacher has a divergence and gradient of zero, and a
    /// teacher of another vocabulary is refused.
    #[test]
    fn chunked_reverse_kl_matches_the_composed_divergence() {
        let dev = Device::Cpu;
        let (n, d, dt, vocab) = (11, 16, 20, 37);
        let var = |seed, rows, cols, scale: f64| {
            Var::from_tensor(
                &(Tensor::from_vec(noise(seed, rows * cols), (rows, cols), &dev).unwrap() * scale).unwrap(),
            )
            .unwrap()
        };
        let (h, w) = (var(51, n, d, 1.0), var(52, vocab, d, 0.7));
        let (ht, wt) = (var(53, n, dt, 1.0), var(54, vocab, dt, 0.9));
        let input = |h: &Var, w: &Var, inv, chunk| HeadInput {
            hidden: h.as_tensor().clone(),
            weight: w.as_tensor().clone(),
            inv_temperature: inv,
            chunk_elements: chunk,
        };
        let probe = Tensor::from_vec(noise(55, n), n, &dev).unwrap();
        for (inv_s, inv_t) in [(1.0f32, 1.0f32), (1.0 / 0.7, 1.0 / 0.7), (1.0, 2.0)] {
            let log_probs = |h: &Var, w: &Var, inv: f32| {
                let z = h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
                log_softmax_rows(&(z * f64::from(inv)).unwrap())
            };
            let (logp, logq) = (log_probs(&h, &w, inv_s), log_probs(&ht, &wt, inv_t).detach());
            let reference = (logp.exp().unwrap() * (&logp - &logq).unwrap()).unwrap().sum(1).unwrap();
            let grads = (&reference * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            let (dh0, dw0) = (grads.get(h.as_tensor()).unwrap(), grads.get(w.as_tensor()).unwrap());
            for chunk in [1, 3 * vocab, 1 << 20] {
                let kl = reverse_kl(&input(&h, &w, inv_s, chunk), &input(&ht, &wt, inv_t, chunk)).unwrap();
                let what = format!("1/T {inv_s} and {inv_t}, chunk {chunk}");
                assert!(max_diff(&kl, &reference) < 1e-5, "{what}: values {}", max_diff(&kl, &reference));
                let grads = (&kl * &probe).unwrap().sum_all().unwrap().backward().unwrap();
                let (dh, dw) = (grads.get(h.as_tensor()).unwrap(), grads.get(w.as_tensor()).unwrap());
                assert!(max_diff(dh, dh0) < 1e-4, "{what}: d hidden {}", max_diff(dh, dh0));
                assert!(max_diff(dw, dw0) < 1e-4, "{what}: d weight {}", max_diff(dw, dw0));
                assert!(grads.get(ht.as_tensor()).is_none() && grads.get(wt.as_tensor()).is_none(), "{what}");
            }
        }
        let same = reverse_kl(&input(&h, &w, 1.0, 64), &input(&h, &w, 1.0, 64)).unwrap();
        assert!(same.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() < 1e-6);
        let grads = same.sum_all().unwrap().backward().unwrap();
        let dh = grads.get(h.as_tensor()).unwrap();
        assert!(dh.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() < 1e-6);
        let other = var(56, vocab + 1, dt, 1.0);
        let e = reverse_kl(&input(&h, &w, 1.0, 64), &input(&ht, &other, 1.0, 64)).unwrap_err().to_string();
        assert!(e.contains("vocabulary of 37") && e.contains("38"), "{e}");
    }

    /// `log softmax` over the last dimension, written out (the reference of the
    /// reverse KL test).
    fn log_softmax_rows(z: &Tensor) -> Tensor {
        let max = z.max_keepdim(1).unwrap().detach();
        let z = z.broadcast_sub(&max).unwrap();
        let lse = z.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
        z.broadcast_sub(&lse).unwrap()
    }
}
