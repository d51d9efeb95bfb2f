//! The element-wise ops of the network in two implementations, and the switch between
//! them.
//!
//! [`Kernels::Fused`] are the CPU custom ops of `ops.rs`: one pass per op with their
//! own backward, and the batch-invariant decode kernels. They have no GPU
//! implementation. [`Kernels::Portable`] compose the same functions from candle-core
//! primitives that every backend implements forward and backward (CUDA included), so a
//! model on any device trains and decodes through them: a few more launches and
//! buffers per op, each a kernel the backend already optimises.
//!
//! The portable forms are tested against the fused ones on the CPU (values and
//! gradients, `ops.rs` tests and the model's integration tests with
//! [`Kernels::Portable`]), so CI without a GPU checks the arithmetic the GPU runs; the
//! GPU tests check the same assertions on the device.
//!
//! Attention is per segment in both (crate `model`): no `[T, T]` mask of a packed row
//! is ever built, only each segment's `[len, ancestors + len]` block. The portable
//! decode attention gathers each row's cached prefix, padded to the longest row of the
//! step with `-inf` scores, in one batched product per layer.

use std::sync::{Arc, OnceLock};

use candle_core::{D, DType, Device, Tensor};

use crate::ops::{self, DecodeRows};
use crate::{Error, Result};

/// Which implementation of the element-wise ops a [`crate::Model`] runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kernels {
    /// Fused CPU custom ops with their own backward, batch-invariant decoding; the
    /// default on the CPU, unavailable elsewhere.
    #[default]
    Fused,
    /// Composed candle-core ops, on every device; the default on GPUs. Matches
    /// [`Kernels::Fused`] within 1e-5 on the CPU (tested), not bitwise.
    Portable,
}

impl Kernels {
    /// The default for `device`: fused on the CPU, portable elsewhere.
    #[must_use]
    pub fn for_device(device: &Device) -> Self {
        if device.is_cpu() { Self::Fused } else { Self::Portable }
    }

    /// An error when these kernels cannot run on `device`.
    pub(crate) fn check(self, device: &Device) -> Result<()> {
        if self == Self::Fused && !device.is_cpu() {
            return Err(Error::invalid(
                "kernels",
                format!("`Fused` runs on the CPU only, the model is on {device:?}: use `Portable`"),
            ));
        }
        Ok(())
    }

    /// RMSNorm over the last dimension: `w * x / sqrt(mean(x²) + eps)`.
    pub(crate) fn rms_norm(self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        match self {
            Self::Fused => ops::rms_norm(x, weight, eps),
            Self::Portable => {
                // In f32 whatever the activations' type, as `transformers` does.
                let xf = x.to_dtype(DType::F32)?;
                let inv = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
                Ok(xf
                    .broadcast_mul(&inv)?
                    .to_dtype(x.dtype())?
                    .broadcast_mul(&weight.to_dtype(x.dtype())?)?)
            }
        }
    }

    /// Rotary embeddings of `x: [n, heads, head_dim]` (rotate-half convention).
    pub(crate) fn rope(self, x: &Tensor, t: &ops::RopeTables) -> Result<Tensor> {
        match self {
            Self::Fused => ops::apply_rope(x, t),
            Self::Portable => {
                let (n, _, hd) = x.dims3()?;
                let half = hd / 2;
                let (cos, sin) = t.on(x.device(), n, half)?;
                let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
                let x1 = x.narrow(2, 0, half)?;
                let x2 = x.narrow(2, half, half)?;
                let o1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
                let o2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
                Ok(Tensor::cat(&[o1, o2], 2)?)
            }
        }
    }

    /// `softmax(scores + mask)` over the last dimension, `mask: [lq, lk]` broadcast
    /// over the leading dimensions of `scores: [.., lq, lk]`.
    pub(crate) fn masked_softmax(self, scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
        match self {
            Self::Fused => ops::masked_softmax(scores, mask),
            Self::Portable => ops::softmax_last_dim(&scores.broadcast_add(&mask.to_dtype(scores.dtype())?)?),
        }
    }

    /// `silu(gate) * up`, differentiable in both.
    pub(crate) fn swiglu_train(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self {
            Self::Fused => ops::swiglu_train(gate, up),
            Self::Portable => Ok((gate.silu()? * up)?),
        }
    }

    /// `silu(gate) * up` of a decode step; rows from `rows` on are padding (zero in,
    /// zero out in both forms).
    pub(crate) fn swiglu(self, gate: &Tensor, up: &Tensor, rows: usize) -> Result<Tensor> {
        match self {
            Self::Fused => ops::swiglu(gate, up, rows),
            Self::Portable => Ok((gate.silu()? * up)?),
        }
    }

    /// Per row of `logits / T: [n, vocab]`, the log-prob of its target and the entropy,
    /// as `[n, 2]` f32, differentiable in the logits; `inv_temperature` is `1 / T`.
    pub(crate) fn target_logprobs_entropy(
        self,
        logits: &Tensor,
        targets: Vec<u32>,
        inv_temperature: f32,
    ) -> Result<Tensor> {
        match self {
            Self::Fused => ops::target_logprobs_entropy(logits, targets, inv_temperature),
            Self::Portable => {
                let (n, vocab) = logits.dims2()?;
                if targets.len() != n {
                    return Err(Error::invalid(
                        "targets",
                        format!("{} for {n} rows of logits", targets.len()),
                    ));
                }
                if let Some((i, t)) = targets.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
                    return Err(Error::invalid(
                        format!("target {i}"),
                        format!("is token {t}, outside the vocabulary of {vocab}"),
                    ));
                }
                let z = logits.to_dtype(DType::F32)?;
                let z = if inv_temperature == 1.0 { z } else { (z * f64::from(inv_temperature))? };
                let max = z.max_keepdim(D::Minus1)?.detach();
                let z = z.broadcast_sub(&max)?;
                let logp = z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)?;
                let index = Tensor::from_vec(targets, (n, 1), logits.device())?;
                let picked = logp.gather(&index, 1)?;
                let entropy = (logp.exp()? * &logp)?.sum_keepdim(D::Minus1)?.neg()?;
                Ok(Tensor::cat(&[picked, entropy], 1)?)
            }
        }
    }

    /// Writes a step's new keys (or values) `[n, kv_heads, head_dim]` into a layer's
    /// cache at the rows `rows` names.
    pub(crate) fn write_decode_rows(self, cache: &Tensor, new: &Tensor, rows: DecodeRows<'_>) -> Result<()> {
        match self {
            Self::Fused => ops::write_decode_rows(cache, new, rows),
            Self::Portable => {
                let (n, kvh, hd) = new.dims3()?;
                rows.check("decode-write", n, cache.dim(0)?)?;
                // One in-place scatter: element (i, h, d) goes to cache row
                // `base[i] + len[i] - 1`.
                let width = kvh * hd;
                let mut index = Vec::with_capacity(n * width);
                for i in 0..n {
                    let at = (rows.base[i] + rows.len[i] - 1) as u32;
                    index.extend(std::iter::repeat_n(at, width));
                }
                let index = Tensor::from_vec(index, (n, kvh, hd), cache.device())?;
                cache.scatter_set(&index, &new.to_dtype(cache.dtype())?.contiguous()?, 0)?;
                Ok(())
            }
        }
    }

    /// Attention of a step's queries `q: [n, heads, head_dim]` over each row's cached
    /// prefix; `[n, heads * head_dim]`.
    pub(crate) fn decode_attention(
        self,
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        rows: DecodeRows<'_>,
    ) -> Result<Tensor> {
        match self {
            Self::Fused => ops::decode_attention(q, keys, values, rows),
            Self::Portable => portable_decode_attention(q, keys, values, rows),
        }
    }
}

/// [`Kernels::decode_attention`] from candle primitives: every row's prefix gathered
/// into `[n, longest, kv_heads, head_dim]` (rows shorter than the longest repeat their
/// last key, masked out), then one batched product per side of the softmax. A row's
/// result depends on the longest row of its step only through the `-inf` padding,
/// which adds exact zeros; the GPU's reduction order over the padded length may still
/// round differently (see the GPU notes in the README).
fn portable_decode_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    rows: DecodeRows<'_>,
) -> Result<Tensor> {
    let (n, heads, hd) = q.dims3()?;
    let (cache_rows, kvh, _) = keys.dims3()?;
    rows.check("decode-attention", n, cache_rows)?;
    let rep = heads / kvh;
    let longest = rows.len.iter().copied().max().unwrap_or(1);
    let mut index = Vec::with_capacity(n * longest);
    let mut mask = Vec::with_capacity(n * longest);
    for i in 0..n {
        for j in 0..longest {
            index.push((rows.base[i] + j.min(rows.len[i] - 1)) as u32);
            mask.push(if j < rows.len[i] { 0f32 } else { f32::NEG_INFINITY });
        }
    }
    let dev = q.device();
    let index = Tensor::from_vec(index, n * longest, dev)?;
    let mask = Tensor::from_vec(mask, (n, 1, 1, longest), dev)?.to_dtype(q.dtype())?;
    let gather = |t: &Tensor| -> Result<Tensor> {
        // [n, kv_heads, longest, head_dim]
        Ok(t.index_select(&index, 0)?.reshape((n, longest, kvh, hd))?.transpose(1, 2)?.contiguous()?)
    };
    let (k, v) = (gather(keys)?, gather(values)?);
    let scale = 1.0 / (hd as f64).sqrt();
    let q = (q.reshape((n, kvh, rep, hd))? * scale)?;
    let scores = q.matmul(&k.transpose(2, 3)?.contiguous()?)?; // [n, kvh, rep, longest]
    let probs = ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    Ok(probs.matmul(&v)?.reshape((n, heads * hd))?)
}

/// Rotary tables on a device, built once per forward from the host tables.
#[derive(Debug, Default, Clone)]
pub(crate) struct DeviceTables(Arc<OnceLock<(Tensor, Tensor)>>);

impl ops::RopeTables {
    /// `cos` and `sin` as `[n, 1, half]` tensors on `device` (uploaded on first use).
    fn on(&self, device: &Device, n: usize, half: usize) -> Result<(Tensor, Tensor)> {
        if self.cos().len() != n * half {
            return Err(Error::invalid(
                "rope",
                format!("tables for {} values, input needs {}", self.cos().len(), n * half),
            ));
        }
        if let Some(t) = self.device_tables().0.get()
            && t.0.device().same_device(device)
        {
            return Ok(t.clone());
        }
        let up = |v: &[f32]| Tensor::from_slice(v, (n, 1, half), device);
        let t = (up(self.cos())?, up(self.sin())?);
        let _ = self.device_tables().0.set(t.clone());
        Ok(t)
    }
}
