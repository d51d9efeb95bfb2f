//! The element-wise ops of the network in two implementations, the switch between
//! them, and the attention composed from them.
//!
//! [`Kernels::Fused`] are the CPU custom ops of `ops/`: one pass per op with their
//! own backward, and the batch-invariant decode kernels. They have no GPU
//! implementation. [`Kernels::Portable`] compose the same functions from candle-core
//! primitives that every backend implements forward and backward (CUDA included), so a
//! model on any device trains and decodes through them: a few more launches and
//! buffers per op, each a kernel the backend already optimises.
//!
//! The portable forms are tested against the fused ones on the CPU (values and
//! gradients, this file's tests and the model's integration tests with
//! [`Kernels::Portable`]), so CI without a GPU checks the arithmetic the GPU runs; the
//! GPU tests check the same assertions on the device.
//!
//! Attention is per segment in both (crate `model`): no `[T, T]` mask of a packed row
//! is ever built, only each segment's `[len, ancestors + len]` block. The portable
//! decode attention gathers each row's cached prefix, padded to the longest row of the
//! step with `-inf` scores, in one batched product per layer.

use std::sync::Arc;

use candle_core::{D, DType, Device, Tensor};

use crate::draw::{Draw, DrawScratch, Next, draw_row};
use crate::ops::{self, DecodeRows, StepIndex};
use crate::{Error, Result};

/// `METRONOME_CUDA_KERNELS=0` makes models on CUDA devices run [`Kernels::Portable`]
/// instead of [`Kernels::Cuda`]: the way back to candle's own kernels without a rebuild,
/// should one of this crate's misbehave on a GPU.
pub const CUDA_KERNELS_ENV: &str = "METRONOME_CUDA_KERNELS";

/// Which implementation of the element-wise ops a [`crate::Model`] runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kernels {
    /// Fused CPU custom ops with their own backward, batch-invariant decoding; the
    /// default on the CPU, unavailable elsewhere.
    #[default]
    Fused,
    /// Composed candle-core ops, on every device. Matches [`Kernels::Fused`] within
    /// 1e-5 on the CPU (tested), not bitwise.
    Portable,
    /// The portable ops with CUDA kernels of this crate where they are written
    /// (`kernels/*.cu`, built by nvcc with the `cuda` feature): RMSNorm, SwiGLU and
    /// rotary embeddings as one kernel each way (`kernels/layer.cu`), the cached
    /// forward's cache writes and attention read in place, one launch per layer each
    /// (`kernels/decode.cu`), a frozen model's decode layout as nine launches per layer
    /// (stacked products, and between them its projections made ready, the residual sum
    /// with the next norm, and SwiGLU, each one kernel), training attention per segment, flash style
    /// (`kernels/attention.cu`), and a decode step's draw of its next
    /// tokens ([`crate::Next`], `kernels/draw.cu`), so that `[rows, vocab]` logits stay
    /// on the device. The default on CUDA devices (unless [`CUDA_KERNELS_ENV`] says
    /// `0`); each kernel is tested against the portable form or its CPU reference on a
    /// GPU (`tests/it/devices.rs`).
    Cuda,
}

impl Kernels {
    /// Whether a plain f32 decoder layer runs as one computation on host buffers
    /// with a backward of its own (`ops/layer.rs`) rather than op by op: the fused
    /// CPU kernels' choice.
    pub(crate) fn runs_whole_layers(self) -> bool {
        self == Self::Fused
    }

    /// The default for `device`: fused on the CPU, CUDA on CUDA devices (portable
    /// there when [`CUDA_KERNELS_ENV`] is `0`), portable elsewhere.
    #[must_use]
    pub fn for_device(device: &Device) -> Self {
        if device.is_cpu() {
            Self::Fused
        } else if device.is_cuda() && std::env::var(CUDA_KERNELS_ENV).map_or(true, |v| v != "0") {
            Self::Cuda
        } else {
            Self::Portable
        }
    }

    /// An error when these kernels cannot run on `device` with weights of `dtype`.
    pub(crate) fn check(self, device: &Device, dtype: DType) -> Result<()> {
        if self == Self::Fused && !device.is_cpu() {
            return Err(Error::invalid(
                "kernels",
                format!("`Fused` runs on the CPU only, the model is on {device:?}: use `Portable`"),
            ));
        }
        if self == Self::Cuda && !device.is_cuda() {
            return Err(Error::invalid(
                "kernels",
                format!("`Cuda` runs on CUDA devices only, the model is on {device:?}: use `Portable`"),
            ));
        }
        // The fused ops read and write f32 slices; bf16 runs through candle's own ops.
        if self == Self::Fused && dtype != DType::F32 {
            return Err(Error::invalid(
                "kernels",
                format!("`Fused` computes in f32, the model's weights are {dtype:?}: use `Portable`"),
            ));
        }
        Ok(())
    }

    /// The rows of `table: [rows, d]` that `index` names, `[n, d]`, differentiable in
    /// the table: candle's `index_select`, whose backward is its index-add, or on CUDA
    /// one kernel each way, the backward summing each row's gradients in f32 in a fixed
    /// order from the index's inverse.
    pub(crate) fn gather_rows(self, table: &Tensor, index: &ops::RowIndex) -> Result<Tensor> {
        match (self, &index.inverse) {
            #[cfg(feature = "cuda")]
            (Self::Cuda, Some(inverse)) => crate::cuda::gather_rows(table, &index.ids, inverse),
            _ => Ok(table.index_select(&index.ids, 0)?),
        }
    }

    /// RMSNorm over the last dimension: `w * x / sqrt(mean(x²) + eps)`.
    pub(crate) fn rms_norm(self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        match self {
            Self::Fused => ops::rms_norm(x, weight, eps),
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::rms_norm(x, weight, eps),
            // Portable (and `Cuda` in a build without CUDA, where no model can hold it).
            _ => {
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
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::rope(x, t),
            _ => {
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

    /// `x·Wᵀ + b`, differentiable in all three: fused, one op whose backward makes
    /// `dW = dyᵀ·x` in `W`'s layout; portable, candle's product with the transposed
    /// view of `W`, whose gradient is transposed back by a copy.
    pub(crate) fn linear(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        match self {
            Self::Fused => ops::fused_linear(x, w, b),
            Self::Portable | Self::Cuda => ops::linear(x, w, b),
        }
    }

    /// `x·Wᵀ + b` for a frozen `W` and `b` (a LoRA handle's base weights): fused, the
    /// CPU product whose backward skips the weight's gradient; portable, the plain
    /// product, whose backward also computes the unused weight gradient (no portable
    /// op skips it yet).
    pub(crate) fn frozen_linear(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        match self {
            Self::Fused => ops::frozen_linear(x, w, b),
            Self::Portable | Self::Cuda => ops::linear(x, w, b),
        }
    }

    /// `softmax(scores + mask)` over the last dimension, `mask: [lq, lk]` broadcast
    /// over the leading dimensions of `scores: [.., lq, lk]`.
    pub(crate) fn masked_softmax(self, scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
        match self {
            Self::Fused => ops::masked_softmax(scores, mask),
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::masked_softmax(scores, mask),
            _ => composed_masked_softmax(scores, mask),
        }
    }

    /// `softmax(scores + mask)` over the last dimension with one mask per row of a
    /// batch: `scores: [rows, heads, lq, lk]`, `mask: [rows, lq, lk]` broadcast over the
    /// heads; in f32 whatever the scores' type, as [`Kernels::masked_softmax`].
    pub(crate) fn row_masked_softmax(self, scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
        match self {
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::masked_softmax(scores, mask),
            // The fused CPU op takes one `[lq, lk]` mask; rows attended whole are a GPU
            // layout, so the CPU runs the composed form for them.
            _ => composed_masked_softmax(scores, &mask.unsqueeze(1)?),
        }
    }

    /// Scaled dot-product attention of packed rows attended whole, every row in one
    /// batched product ([`crate::Model::with_batched_attention`]): `q: [rows * len,
    /// heads, hd]`, `k`, `v: [rows * len, kv_heads, hd]`, each row padded to `len`, under
    /// `masks`; returns `[rows * len, heads * hd]`. The same grouped-query layout as
    /// [`Kernels::attention`].
    pub(crate) fn row_attention(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        masks: &ops::RowMasks,
    ) -> Result<Tensor> {
        let (n, heads, hd) = q.dims3()?;
        let kv_heads = k.dim(1)?;
        let rep = heads / kv_heads;
        let (rows, len) = (masks.rows, masks.len);
        let scale = 1.0 / (hd as f64).sqrt();
        let q = (q * scale)?
            .reshape((rows, len, kv_heads, rep, hd))?
            .permute((0, 2, 3, 1, 4))?
            .contiguous()?
            .reshape((rows * kv_heads, rep * len, hd))?;
        let by_head = |t: &Tensor| -> Result<Tensor> {
            Ok(t.reshape((rows, len, kv_heads, hd))?.transpose(1, 2)?.contiguous()?.reshape((
                rows * kv_heads,
                len,
                hd,
            ))?)
        };
        let (k, v) = (by_head(k)?, by_head(v)?);
        let scores = q.matmul(&k.t()?)?.reshape((rows, kv_heads * rep, len, len))?;
        let probs =
            self.row_masked_softmax(&scores, &masks.mask)?.reshape((rows * kv_heads, rep * len, len))?;
        let out = probs.matmul(&v)?; // [rows * kv_heads, rep * len, hd]
        Ok(out
            .reshape((rows, kv_heads, rep, len, hd))?
            .permute((0, 3, 1, 2, 4))?
            .contiguous()?
            .reshape((n, heads * hd))?)
    }

    /// Scaled dot-product attention of one sequence with grouped-query heads.
    ///
    /// `q: [lq, heads, hd]`, `k`, `v: [lk, kv_heads, hd]`, `mask`: additive `[lq, lk]`
    /// (`None` when every query sees every key). Returns `[lq, heads * hd]`. Query heads
    /// are grouped by their key/value head instead of repeating keys and values.
    pub(crate) fn attention(
        self,
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
        let (k, v) = if self == Self::Fused { (k, v) } else { (k.contiguous()?, v.contiguous()?) };
        let probs = match mask {
            Some(m) => {
                // Scaling the queries is cheaper than scaling the `[.., lq, lk]` scores.
                let q = (q * scale)?.transpose(0, 1)?.contiguous()?.reshape((kv_heads, rep * lq, hd))?;
                let scores = q.matmul(&k.t()?)?.reshape((kv_heads, rep, lq, lk))?;
                self.masked_softmax(&scores, m)?.reshape((kv_heads, rep * lq, lk))?
            }
            None => {
                let q = q.transpose(0, 1)?.contiguous()?.reshape((kv_heads, rep * lq, hd))?;
                let scores = (q.matmul(&k.t()?)? * scale)?;
                ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(scores.dtype())?
            }
        };
        let out = probs.matmul(&v)?; // [kv, rep * lq, hd]
        Ok(out.reshape((heads, lq, hd))?.transpose(0, 1)?.contiguous()?.reshape((lq, heads * hd))?)
    }

    /// Attention of packed rows per segment, without padding: each segment's queries
    /// against its ancestors' keys and its own causal prefix, the only pairs it may see
    /// (query `i` the first `plan.visible + i + 1` of its plan's keys). `q: [n, heads,
    /// hd]`, `k`, `v: [n, kv_heads, hd]` of the concatenated rows; returns `[n, heads *
    /// hd]`. Fused: one op for the whole batch over the causal blocks only
    /// (`ops/attention.rs`); CUDA: flash-style kernels over every segment of the batch,
    /// one launch forward and two backward (`kernels/attention.cu`, heads up to 128
    /// wide);
    /// otherwise each segment's [`Kernels::attention`] under its mask, from `narrow`s of
    /// the batch's tensors.
    pub(crate) fn segment_attention(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        plans: &Arc<ops::RowPlans>,
    ) -> Result<Tensor> {
        if self == Self::Fused {
            return ops::packed_attention(q, k, v, plans);
        }
        #[cfg(feature = "cuda")]
        if self == Self::Cuda && crate::cuda::flash_attention_fits(q.dim(2)?) {
            return crate::cuda::segment_attention(q, k, v, plans);
        }
        let mut outs = Vec::new();
        let mut row_start = 0;
        for (row_len, row_plans) in plans.iter() {
            for plan in row_plans {
                let gather = |t: &Tensor| -> Result<Tensor> {
                    let parts = plan
                        .keys
                        .iter()
                        .map(|&(s, l)| t.narrow(0, row_start + s, l))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    Ok(if parts.len() == 1 { parts[0].clone() } else { Tensor::cat(&parts, 0)? })
                };
                let q = q.narrow(0, row_start + plan.start, plan.len)?;
                outs.push(self.attention(&q, &gather(k)?, &gather(v)?, Some(plan.mask()?))?);
            }
            row_start += row_len;
        }
        Ok(if outs.len() == 1 {
            outs.pop().unwrap_or_else(|| unreachable!())
        } else {
            Tensor::cat(&outs, 0)?
        })
    }

    /// `silu(gate) * up`, differentiable in both.
    pub(crate) fn swiglu_train(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self {
            Self::Fused => ops::swiglu_train(gate, up),
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::swiglu(gate, up),
            _ => Ok((gate.silu()? * up)?),
        }
    }

    /// `silu(gate) * up` of a decode step; rows from `rows` on are padding (zero in,
    /// zero out in both forms).
    pub(crate) fn swiglu(self, gate: &Tensor, up: &Tensor, rows: usize) -> Result<Tensor> {
        match self {
            Self::Fused => ops::swiglu(gate, up, rows),
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::swiglu(gate, up),
            _ => Ok((gate.silu()? * up)?),
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
            Self::Portable | Self::Cuda => {
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
                let (logp, _) = portable_log_softmax(logits, inv_temperature)?;
                let index = Tensor::from_vec(targets, (n, 1), logits.device())?;
                let picked = logp.gather(&index, 1)?;
                let entropy = (logp.exp()? * &logp)?.sum_keepdim(D::Minus1)?.neg()?;
                Ok(Tensor::cat(&[picked, entropy], 1)?)
            }
        }
    }

    /// The chunked head's forward for a chunk of rows (`head.rs`), without a graph:
    /// per row of `logits / T: [n, vocab]` (any float type), the target's log-prob, the
    /// entropy and the log-sum-exp, as `[n, 3]` f32. `targets` are the rows' targets on
    /// the host and `column` the same as a `[n, 1]` u32 tensor on the logits' device
    /// (each form reads its own); `inv_temperature` is `1 / T`.
    pub(crate) fn logprob_stats(
        self,
        logits: &Tensor,
        targets: &[u32],
        column: &Tensor,
        inv_temperature: f32,
    ) -> Result<Tensor> {
        match self {
            Self::Fused => ops::target_stats(logits, targets, inv_temperature),
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::logprob_stats(logits, column, inv_temperature),
            _ => {
                let (logp, lse) = portable_log_softmax(logits, inv_temperature)?;
                let picked = logp.gather(&column.contiguous()?, 1)?;
                let entropy = (logp.exp()? * &logp)?.sum_keepdim(D::Minus1)?.neg()?;
                Ok(Tensor::cat(&[picked, entropy, lse], 1)?)
            }
        }
    }

    /// The chunked head's backward for a block of vocabulary columns: from the block's
    /// logits `z: [n, cols]` (columns `first..first + cols`, any float type), the rows'
    /// statistics `[n, 3]` of [`Kernels::logprob_stats`] and the `[n, 2]` gradient of
    /// (log-prob, entropy), the `[n, cols]` gradient of the block's logits: in f32, or
    /// in `z`'s type from the CUDA kernel (the caller casts it to the hidden states' type,
    /// which `z` has).
    /// `targets` and `column` as in [`Kernels::logprob_stats`], for every row.
    #[allow(clippy::too_many_arguments, reason = "the row statistics, targets and gradient of one block")]
    pub(crate) fn logprob_columns_grad(
        self,
        z: &Tensor,
        stats: &Tensor,
        targets: &[u32],
        column: &Tensor,
        first: usize,
        g: &Tensor,
        inv_temperature: f32,
    ) -> Result<Tensor> {
        match self {
            Self::Fused => ops::target_columns_grad(z, stats, targets, first, g, inv_temperature),
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::logprob_columns_grad(z, stats, column, first, g, inv_temperature),
            _ => {
                // d/dz_j of g_l·log p_t + g_e·H, with log p_j = z_j / T − lse:
                // ([j = t]·g_l − p_j·(g_l + g_e·(log p_j + H))) / T.
                let (n, cols) = z.dims2()?;
                let z = z.to_dtype(DType::F32)?;
                let z = if inv_temperature == 1.0 { z } else { (z * f64::from(inv_temperature))? };
                let (entropy, lse) = (stats.narrow(1, 1, 1)?, stats.narrow(1, 2, 1)?);
                let (g_logp, g_entropy) = (g.narrow(1, 0, 1)?, g.narrow(1, 1, 1)?);
                let logp = z.broadcast_sub(&lse)?;
                let coef = logp.broadcast_add(&entropy)?.broadcast_mul(&g_entropy)?.broadcast_add(&g_logp)?;
                let ids =
                    Tensor::arange(first as u32, (first + cols) as u32, z.device())?.reshape((1, cols))?;
                let hot = column.broadcast_eq(&ids)?.to_dtype(DType::F32)?.broadcast_mul(&g_logp)?;
                debug_assert_eq!(hot.dims(), [n, cols]);
                let dz = (hot - (logp.exp()? * coef)?)?;
                Ok(if inv_temperature == 1.0 { dz } else { (dz * f64::from(inv_temperature))? })
            }
        }
    }

    /// Writes a step's new keys (or values) `[n, kv_heads, head_dim]` into a layer's
    /// cache at the rows `rows` names.
    pub(crate) fn write_decode_rows(self, cache: &Tensor, new: &Tensor, rows: DecodeRows<'_>) -> Result<()> {
        match self {
            Self::Fused => ops::write_decode_rows(cache, new, rows),
            #[cfg(feature = "cuda")]
            Self::Cuda => crate::cuda::write_decode_rows(cache, new, rows),
            _ => {
                let (n, kvh, hd) = new.dims3()?;
                rows.check("decode-write", n, cache.dim(0)?)?;
                // One in-place scatter: element (i, h, d) goes to the cache row of row
                // i's last position. The index is the same for the keys and values of
                // every layer: built and uploaded once per step.
                let index = StepIndex::get(rows.index.map(|s| &s.write), || {
                    let width = kvh * hd;
                    let mut index = Vec::with_capacity(n * width);
                    for i in 0..n {
                        let at = rows.at(i, rows.len[i] - 1) as u32;
                        index.extend(std::iter::repeat_n(at, width));
                    }
                    Ok(Tensor::from_vec(index, (n, kvh, hd), cache.device())?)
                })?;
                cache.scatter_set(&index, &new.to_dtype(cache.dtype())?.contiguous()?, 0)?;
                Ok(())
            }
        }
    }

    /// Attention of a step's queries `q: [n, heads, head_dim]` over each row's cached
    /// prefix; `[out_rows, heads * head_dim]` (at least `n` rows), the rows from `n` on
    /// zeros: the padding of the next linear layer's input, made where the output is.
    pub(crate) fn decode_attention(
        self,
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        rows: DecodeRows<'_>,
        out_rows: usize,
    ) -> Result<Tensor> {
        let att = match self {
            Self::Fused => ops::decode_attention(q, keys, values, rows)?,
            #[cfg(feature = "cuda")]
            Self::Cuda if crate::cuda::decode_kernels_fit(q.dim(2)?) => {
                return crate::cuda::decode_attention(q, keys, values, rows, out_rows);
            }
            _ => portable_decode_attention(q, keys, values, rows)?,
        };
        crate::kv_cache::pad_rows(&att, out_rows)
    }

    /// `(x + y, rms_norm(x + y))`: a decode step's residual sum and the next RMSNorm
    /// (on CUDA one kernel, forward only).
    pub(crate) fn add_rms_norm(
        self,
        x: &Tensor,
        y: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if self == Self::Cuda {
            return crate::cuda::add_rms_norm(x, y, weight, eps);
        }
        let sum = (x + y)?;
        let normed = self.rms_norm(&sum, weight, eps)?;
        Ok((sum, normed))
    }

    /// SwiGLU of the decode layout's stacked gate and up product `[rows, 2 inter]`
    /// (gate columns first): `[rows, inter]`; rows from `rows` on are padding.
    pub(crate) fn swiglu_stacked(self, gate_up: &Tensor, rows: usize) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self == Self::Cuda {
            return crate::cuda::swiglu_stacked(gate_up);
        }
        let inter = gate_up.dim(1)? / 2;
        let gate = gate_up.narrow(1, 0, inter)?.contiguous()?;
        let up = gate_up.narrow(1, inter, inter)?.contiguous()?;
        self.swiglu(&gate, &up, rows)
    }

    /// A cached forward's stacked product `qkv: [rows, (heads + 2 kv_heads) head_dim]`
    /// (the decode layout's; rows past `n = rows.len.len()` are padding) made ready:
    /// `bias` added, queries and keys rotated by `rope`, keys and values written to
    /// `caches` at the rows `write` names, written row `i` taking computed row `from[i]`
    /// (or row `i` when `from` is `None`). Returns the rotated queries `[n, heads,
    /// head_dim]`. On CUDA, when each computed row writes its own row, one kernel;
    /// otherwise the composed ops.
    #[allow(clippy::too_many_arguments, reason = "one fused step of the decode layout")]
    pub(crate) fn decode_project(
        self,
        qkv: &Tensor,
        bias: Option<&Tensor>,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        rope: &ops::RopeTables,
        (keys, values): (&Tensor, &Tensor),
        (attend, write): (DecodeRows<'_>, DecodeRows<'_>),
        from: Option<&Tensor>,
    ) -> Result<Tensor> {
        let n = attend.len.len();
        #[cfg(feature = "cuda")]
        if self == Self::Cuda && from.is_none() {
            return crate::cuda::decode_project(
                qkv,
                bias,
                (heads, kv_heads, head_dim),
                rope,
                (keys, values),
                write,
            );
        }
        let qkv = qkv.narrow(0, 0, n)?;
        let qkv = match bias {
            Some(b) => qkv.broadcast_add(b)?,
            None => qkv,
        };
        let (qw, kvw) = (heads * head_dim, kv_heads * head_dim);
        let part = |start: usize, width: usize, heads: usize| -> Result<Tensor> {
            Ok(qkv.narrow(1, start, width)?.contiguous()?.reshape((n, heads, head_dim))?)
        };
        let q = self.rope(&part(0, qw, heads)?, rope)?;
        let k = self.rope(&part(qw, kvw, kv_heads)?, rope)?;
        let v = part(qw + kvw, kvw, kv_heads)?;
        let written = |t: Tensor| -> Result<Tensor> {
            Ok(match from {
                Some(index) => t.index_select(index, 0)?,
                None => t,
            })
        };
        self.write_decode_rows(keys, &written(k)?, write)?;
        self.write_decode_rows(values, &written(v)?, write)?;
        Ok(q)
    }
}

impl Kernels {
    /// A step's next tokens from its logits `[rows, vocab]` (f32 or bf16; module
    /// [`crate::draw`]): each row with a draw is drawn (by the CUDA kernel under
    /// [`Kernels::Cuda`], by the host reference otherwise), each row without one, or
    /// whose logits have no finite maximum, comes back as its logits on the host for
    /// the caller to sample (and to report). `draws` has one entry per row.
    /// [`crate::Model::decode_step_drawing`] calls it; public so that a device's draw
    /// can be tested against the host's on the same logits.
    pub fn next_rows(self, logits: &Tensor, draws: &[Option<Draw<'_>>]) -> Result<Vec<Next>> {
        crate::draw::check_draws(draws, logits.dims2()?.0)?;
        #[cfg(feature = "cuda")]
        if self == Self::Cuda && draws.iter().any(Option::is_some) {
            return crate::cuda::next_rows(logits, draws);
        }
        let (rows, vocab) = logits.dims2()?;
        // The draw's buffers (two of the vocabulary's size) live with the thread, as the
        // engine's sampler keeps its own per worker: not allocated again every step.
        thread_local! {
            static SCRATCH: std::cell::RefCell<DrawScratch> = std::cell::RefCell::default();
        }
        // A row is copied out only when it goes back undrawn (a `Vec` per row was most
        // of a decode step's allocations).
        let draw_all = |all: &[f32]| -> Vec<Next> {
            SCRATCH.with_borrow_mut(|scratch| {
                all.chunks_exact(vocab.max(1))
                    .take(rows)
                    .zip(draws)
                    .map(|(row, draw)| match draw.map(|d| draw_row(row, d, scratch)) {
                        Some(Ok(drawn)) => Next::Drawn(drawn),
                        None | Some(Err(_)) => Next::Logits(row.to_vec()),
                    })
                    .collect()
            })
        };
        // f32 logits on the CPU are read in place; others through one host copy.
        if logits.device().is_cpu() && logits.dtype() == DType::F32 && logits.is_contiguous() {
            return crate::ops::read_host(logits, draw_all);
        }
        Ok(draw_all(&logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?))
    }
}

/// `log softmax(logits / T)` over the last dimension in f32 (`inv_temperature` is
/// `1 / T`) and the log-sum-exp of `logits / T`, `[n, 1]`: differentiable in the
/// logits (the max is detached: the log-softmax does not depend on it).
pub(crate) fn portable_log_softmax(logits: &Tensor, inv_temperature: f32) -> Result<(Tensor, Tensor)> {
    let z = logits.to_dtype(DType::F32)?;
    let z = if inv_temperature == 1.0 { z } else { (z * f64::from(inv_temperature))? };
    let max = z.max_keepdim(D::Minus1)?.detach();
    let z = z.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok((z.broadcast_sub(&lse)?, (lse + max)?))
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
    // Which cache rows each row reads, and the mask of its padding: the same in every
    // layer of the step, so built and uploaded once per step.
    let index = StepIndex::get(rows.index.map(|s| &s.gather), || {
        let mut index = Vec::with_capacity(n * longest);
        for i in 0..n {
            for j in 0..longest {
                index.push(rows.at(i, j.min(rows.len[i] - 1)) as u32);
            }
        }
        Ok(Tensor::from_vec(index, n * longest, q.device())?)
    })?;
    let mask = StepIndex::get(rows.index.map(|s| &s.mask), || {
        let mut mask = Vec::with_capacity(n * longest);
        for i in 0..n {
            mask.extend((0..longest).map(|j| if j < rows.len[i] { 0f32 } else { f32::NEG_INFINITY }));
        }
        Ok(Tensor::from_vec(mask, (n, 1, 1, longest), q.device())?)
    })?;
    let gather = |t: &Tensor| -> Result<Tensor> {
        // [n, kv_heads, longest, head_dim]
        Ok(t.index_select(&index, 0)?.reshape((n, longest, kvh, hd))?.transpose(1, 2)?.contiguous()?)
    };
    let (k, v) = (gather(keys)?, gather(values)?);
    let scale = 1.0 / (hd as f64).sqrt();
    let q = (q.reshape((n, kvh, rep, hd))? * scale)?;
    let scores = q.matmul(&k.transpose(2, 3)?.contiguous()?)?; // [n, kvh, rep, longest]
    // The softmax in f32 whatever the cache's type, as in training (a no-op for f32).
    let probs = ops::softmax_last_dim(&scores.to_dtype(DType::F32)?.broadcast_add(&mask)?)?;
    Ok(probs.to_dtype(v.dtype())?.matmul(&v)?.reshape((n, heads * hd))?)
}

/// `softmax(scores + mask)` over the last dimension from candle's ops, `mask`
/// broadcast to the scores. In f32 whatever the scores' type: a bf16 sum over a
/// thousand keys would keep three significant digits (flash attention accumulates in
/// f32 too).
fn composed_masked_softmax(scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let s = scores.to_dtype(DType::F32)?.broadcast_add(&mask.to_dtype(DType::F32)?)?;
    Ok(ops::softmax_last_dim(&s)?.to_dtype(scores.dtype())?)
}

/// The portable forms against the fused ones on the CPU, values and gradients (both
/// forms meet here, where the switch between them is).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{
        apply_rope, decode_attention, log_softmax_last_dim, masked_softmax, max_diff, noise, rms_norm,
        rope_tables, swiglu, swiglu_train, target_logprobs_entropy,
    };

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
        assert!(max_diff(&fused, &composed) < 1e-6);
        let gf = fused.broadcast_mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let gc = composed.broadcast_mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(max_diff(gf.get(x.as_tensor()).unwrap(), gc.get(x.as_tensor()).unwrap()) < 1e-6);
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
        assert!(max_diff(&yf, &yc) < 1e-5, "forward {}", max_diff(&yf, &yc));
        assert!(max_diff(&gxf, &gxc) < 1e-5, "dx {}", max_diff(&gxf, &gxc));
        assert!(max_diff(&gwf, &gwc) < 1e-5, "dw {}", max_diff(&gwf, &gwc));
    }

    #[test]
    fn fused_rms_norm_gradients_match_over_several_row_blocks_on_any_number_of_threads() {
        let dev = Device::Cpu;
        let (rows, d) = (150, 24);
        let x =
            candle_core::Var::from_tensor(&Tensor::from_vec(noise(41, rows * d), (rows, d), &dev).unwrap())
                .unwrap();
        let w = candle_core::Var::from_tensor(&Tensor::from_vec(noise(42, d), d, &dev).unwrap()).unwrap();
        let probe = Tensor::from_vec(noise(43, rows * d), (rows, d), &dev).unwrap();
        let run = |kernels: Kernels, threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let y = kernels.rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
                let g = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
                [g.get(x.as_tensor()).unwrap().clone(), g.get(w.as_tensor()).unwrap().clone()]
            })
        };
        let (fused, composed) = (run(Kernels::Fused, 1), run(Kernels::Portable, 1));
        assert!(max_diff(&fused[0], &composed[0]) < 1e-5, "dx {}", max_diff(&fused[0], &composed[0]));
        assert!(max_diff(&fused[1], &composed[1]) < 1e-4, "dw {}", max_diff(&fused[1], &composed[1]));
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let on_three = run(Kernels::Fused, 3);
        assert_eq!(bits(&fused[0]), bits(&on_three[0]));
        assert_eq!(bits(&fused[1]), bits(&on_three[1]));
    }

    /// A packed row as its segments' `(len, parent)`.
    type Row<'a> = &'a [(u32, Option<u32>)];

    /// The attention plans of packed rows, and their number of positions.
    fn row_plans(rows: &[Row<'_>]) -> (Arc<ops::RowPlans>, usize) {
        let mut plans = Vec::new();
        for segs in rows {
            let mut start = 0;
            let segments = segs
                .iter()
                .map(|&(len, parent)| {
                    start += len;
                    metronome_core::Segment { start: start - len, len, parent }
                })
                .collect::<Vec<_>>();
            let n = start as usize;
            let row = metronome_core::PackedRow {
                tokens: vec![0; n],
                positions: (0..n as u32).collect(),
                segments,
            };
            plans.push((n, ops::segment_plans(&row, &Device::Cpu).unwrap()));
        }
        let n = plans.iter().map(|p| p.0).sum();
        (Arc::new(plans), n)
    }

    #[test]
    fn fused_segment_attention_matches_the_masked_squares_and_its_gradients() {
        let dev = Device::Cpu;
        // Packed rows as segments (len, parent), with (heads, kv heads, head dim): one
        // query, less than a block, exactly one; a shared prompt whose responses end in
        // a partial block, span several and hold one query; two rows, the second a
        // block and a bit; no grouping.
        let cases: [(&[Row<'_>], _); 5] = [
            (&[&[(1, None)]], (2, 1, 8)),
            (&[&[(5, None)]], (4, 2, 8)),
            (&[&[(64, None)]], (4, 2, 8)),
            (&[&[(9, None), (150, Some(0)), (70, Some(0)), (1, Some(0))]], (6, 2, 16)),
            (&[&[(4, None), (5, Some(0)), (3, Some(1))], &[(66, None)]], (3, 3, 8)),
        ];
        for (rows, (heads, kvh, hd)) in cases {
            let (plans, n) = row_plans(rows);
            let var = |seed, width| {
                let t = Tensor::from_vec(noise(seed, n * width * hd), (n, width, hd), &dev).unwrap();
                candle_core::Var::from_tensor(&(t * 2.0).unwrap()).unwrap()
            };
            let (q, k, v) = (var(21, heads), var(22, kvh), var(23, kvh));
            let probe = Tensor::from_vec(noise(24, n * heads * hd), (n, heads * hd), &dev).unwrap();
            let run = |kernels: Kernels| {
                let (q, k, v) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                let y = kernels.segment_attention(q, k, v, &plans).unwrap();
                let g = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
                [y, g.get(q).unwrap().clone(), g.get(k).unwrap().clone(), g.get(v).unwrap().clone()]
            };
            let fused = run(Kernels::Fused);
            let composed = run(Kernels::Portable);
            for (name, (f, c)) in ["out", "dq", "dk", "dv"].iter().zip(fused.iter().zip(&composed)) {
                assert_eq!(f.dims(), c.dims(), "{name}");
                // Relative to the largest value: the gradients of keys that many queries see
                // are sums of up to `n` terms, taken in another order by each form.
                let scale = c.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
                let d = max_diff(f, c) / scale;
                assert!(d < 1e-5, "rows {rows:?}, {heads}/{kvh} heads: {name} differs by {d} of {scale}");
            }
        }
    }

    #[test]
    fn fused_segment_attention_is_the_same_on_any_number_of_threads_and_refuses_misfit_plans() {
        let dev = Device::Cpu;
        let (heads, kvh, hd) = (4, 2, 8);
        let (plans, n) = row_plans(&[&[(5, None), (140, Some(0)), (7, Some(0))], &[(3, None)]]);
        let t = |seed, width| {
            let t = Tensor::from_vec(noise(seed, n * width * hd), (n, width, hd), &dev).unwrap();
            candle_core::Var::from_tensor(&t).unwrap()
        };
        let (q, k, v) = (t(31, heads), t(32, kvh), t(33, kvh));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let y = ops::packed_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &plans).unwrap();
                let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
                [y, g.get(q.as_tensor()).unwrap().clone(), g.get(k.as_tensor()).unwrap().clone()].map(|t| {
                    t.flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>()
                })
            })
        };
        assert_eq!(run(1), run(3));
        let (short, _) = row_plans(&[&[(5, None), (140, Some(0)), (7, Some(0))]]);
        let err = ops::packed_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &short).unwrap_err();
        assert!(err.to_string().contains("the rows hold 152 positions, q 155"), "{err}");
        // Segments that leave part of their row uncovered.
        let (eight, _) = row_plans(&[&[(5, None), (3, Some(0))]]);
        let segments = Arc::try_unwrap(eight).unwrap().remove(0).1;
        let gappy = Arc::new(vec![(10, segments)]);
        let ten = |t: &candle_core::Var| t.as_tensor().narrow(0, 0, 10).unwrap();
        let err = ops::packed_attention(&ten(&q), &ten(&k), &ten(&v), &gappy).unwrap_err();
        assert!(err.to_string().contains("the segments of a 10-position row cover 8"), "{err}");
        // A plan whose keys are as many as it needs, in its row, but do not end in its
        // own queries (only the keys-end check refuses it), beside one that does.
        let plan = |keys| Arc::new(vec![(3, vec![ops::SegmentPlan::new(0, 3, keys, 0, &dev)])]);
        let three = |t: &candle_core::Var| t.as_tensor().narrow(0, 0, 3).unwrap();
        ops::packed_attention(&three(&q), &three(&k), &three(&v), &plan(vec![(0, 3)])).unwrap();
        let err = ops::packed_attention(&three(&q), &three(&k), &three(&v), &plan(vec![(1, 2), (0, 1)]))
            .unwrap_err();
        assert!(err.to_string().contains("does not fit its 3-position row"), "{err}");
        let short_keys = k.as_tensor().narrow(0, 0, n - 1).unwrap();
        let err = ops::packed_attention(q.as_tensor(), &short_keys, &short_keys, &plans).unwrap_err();
        assert!(err.to_string().contains("do not fit one another"), "{err}");
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
        assert!(max_diff(&yf, &yc) < 1e-5, "forward {}", max_diff(&yf, &yc));
        assert!(max_diff(&dgf, &dgc) < 1e-5, "d gate {}", max_diff(&dgf, &dgc));
        assert!(max_diff(&duf, &duc) < 1e-5, "d up {}", max_diff(&duf, &duc));
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
            assert!(max_diff(&lf, &lc) < 1e-5, "T={temperature}: log-probs {}", max_diff(&lf, &lc));
            assert!(max_diff(&ef, &ec) < 1e-5, "T={temperature}: entropy {}", max_diff(&ef, &ec));
            // Both against the plain log-softmax of the scaled logits.
            let logp = log_softmax_last_dim(&(z.as_tensor() * f64::from(inv)).unwrap()).unwrap();
            let index = Tensor::from_vec(targets.clone(), (n, 1), &dev).unwrap();
            let want = logp.gather(&index, 1).unwrap().squeeze(1).unwrap();
            assert!(max_diff(&lf, &want) < 1e-5, "T={temperature}: against log_softmax(z / T)");
            let gf = loss(&lf, &ef).backward().unwrap();
            let gc = loss(&lc, &ec).backward().unwrap();
            let (gf, gc) = (gf.get(z.as_tensor()).unwrap(), gc.get(z.as_tensor()).unwrap());
            assert!(max_diff(gf, gc) < 1e-5, "T={temperature}: d logits {}", max_diff(gf, gc));
        }
        for k in [Kernels::Fused, Kernels::Portable] {
            assert!(k.target_logprobs_entropy(z.as_tensor(), vec![0; n - 1], 1.0).is_err());
            assert!(k.target_logprobs_entropy(z.as_tensor(), vec![41; n], 1.0).is_err());
        }
    }

    #[test]
    fn decode_attention_matches_reference_on_ragged_rows() {
        // Head sizes of 4 and 8 SIMD vectors (registers held across keys), of 5 (the
        // general loop) and of a fraction of one (the scalar loops); blocks of a whole
        // slot (one span per row), of 8 rows and of one row, scattered over the pool.
        for kernels in [Kernels::Fused, Kernels::Portable] {
            for hd in [32, 64, 40, 6] {
                let by_block: Vec<Vec<u32>> = [50, 8, 1]
                    .into_iter()
                    .map(|block| decode_attention_matches_reference(kernels, hd, block))
                    .collect();
                if kernels == Kernels::Fused {
                    // The fused op sums in position order whatever the blocks: paged ==
                    // contiguous, bit for bit.
                    assert!(by_block.windows(2).all(|w| w[0] == w[1]), "head_dim {hd}: block sizes differ");
                }
            }
        }
    }

    /// Checks one kernel set's decode write and attention on a paged cache of `block`
    /// rows a block against the reference attention over each row's gathered prefix;
    /// returns the attention's bits.
    fn decode_attention_matches_reference(kernels: Kernels, hd: usize, block: usize) -> Vec<u32> {
        let dev = Device::Cpu;
        // 4 query heads over 2 key/value heads.
        let (heads, kvh, slots, max_len) = (4, 2, 6, 50);
        let (cache_rows, width) = (slots * max_len, kvh * hd);
        // Ragged lengths, one row of length 1 and one filling its slot; each row's block
        // table a scattered run of the pool's blocks (7 is prime to every pool size here).
        let len = [17usize, 1, 50, 33, 8];
        let n = len.len();
        let pool = cache_rows / block;
        let mut table = Vec::new();
        let mut blocks = Vec::new();
        for &l in &len {
            table.push(blocks.len());
            for _ in 0..l.div_ceil(block) {
                blocks.push(((blocks.len() * 7 + 3) % pool) as u32);
            }
        }
        let step = StepIndex::default();
        let rows = DecodeRows { table: &table, blocks: &blocks, block, len: &len, index: Some(&step) };
        // Row i's position p holds the same key and value whatever the layout (noise
        // elsewhere), so every block size sees the same prefixes.
        let (logical_k, logical_v) = (noise(1, n * max_len * width), noise(2, n * max_len * width));
        let (mut k, mut v) = (noise(6, cache_rows * width), noise(7, cache_rows * width));
        for (i, &l) in len.iter().enumerate() {
            for p in 0..l {
                let (at, from) = (rows.at(i, p) * width, (i * max_len + p) * width);
                k[at..at + width].copy_from_slice(&logical_k[from..from + width]);
                v[at..at + width].copy_from_slice(&logical_v[from..from + width]);
            }
        }
        let keys = Tensor::from_vec(k, (cache_rows, kvh, hd), &dev).unwrap();
        let values = Tensor::from_vec(v, (cache_rows, kvh, hd), &dev).unwrap();
        let q = Tensor::from_vec(noise(3, n * heads * hd), (n, heads, hd), &dev).unwrap();
        let new_k = Tensor::from_vec(noise(4, n * kvh * hd), (n, kvh, hd), &dev).unwrap();
        let new_v = Tensor::from_vec(noise(5, n * kvh * hd), (n, kvh, hd), &dev).unwrap();
        // The keys' write builds the step's index and the values' reuses it.
        kernels.write_decode_rows(&keys, &new_k, rows).unwrap();
        kernels.write_decode_rows(&values, &new_v, rows).unwrap();
        let fused = kernels.decode_attention(&q, &keys, &values, rows, 0).unwrap();
        assert_eq!(fused.dims(), [n, heads * hd]);
        // Asked for more rows (the next product's padding): the same rows, then zeros.
        let padded = kernels.decode_attention(&q, &keys, &values, rows, n + 3).unwrap();
        assert_eq!(padded.dims(), [n + 3, heads * hd]);
        assert_eq!(
            padded.narrow(0, 0, n).unwrap().to_vec2::<f32>().unwrap(),
            fused.to_vec2::<f32>().unwrap()
        );
        assert!(
            padded
                .narrow(0, n, 3)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .all(|&x| x == 0.0)
        );
        for (i, &l) in len.iter().enumerate() {
            let last = rows.at(i, l - 1);
            let written = keys.narrow(0, last, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(written, new_k.get(i).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let written = values.narrow(0, last, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(written, new_v.get(i).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let prefix: Vec<u32> = (0..l).map(|p| rows.at(i, p) as u32).collect();
            let prefix = Tensor::new(prefix.as_slice(), &dev).unwrap();
            let reference = Kernels::Fused
                .attention(
                    &q.narrow(0, i, 1).unwrap(),
                    &keys.index_select(&prefix, 0).unwrap(),
                    &values.index_select(&prefix, 0).unwrap(),
                    None,
                )
                .unwrap();
            let got = fused.narrow(0, i, 1).unwrap();
            let d = (got - reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(
                d < 1e-5,
                "{kernels:?}, head_dim {hd}, block {block}, row {i} (length {l}): max diff {d}"
            );
        }
        let all = fused.to_vec2::<f32>().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if kernels == Kernels::Fused {
            // Each row alone gives bitwise the batch's result (the portable form is
            // batch-invariant only within 1e-5: padding changes its reduction length).
            for i in 0..n {
                let one = DecodeRows { table: &table[i..=i], len: &len[i..=i], index: None, ..rows };
                let alone = decode_attention(&q.narrow(0, i, 1).unwrap(), &keys, &values, one).unwrap();
                assert_eq!(bits(&alone.to_vec2::<f32>().unwrap()[0]), bits(&all[i]), "row {i}");
            }
        }
        all.iter().flat_map(|r| bits(r)).collect()
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
        // A cache of two blocks of 4 rows.
        let rows = |table: &'static [usize], blocks: &'static [u32], len: &'static [usize]| DecodeRows {
            table,
            blocks,
            block: 4,
            len,
            index: None,
        };
        let past_end = rows(&[0], &[1, 2], &[5]);
        let short_table = rows(&[0], &[1], &[5]);
        let table_past_end = rows(&[2], &[0, 1], &[1]);
        let empty = rows(&[0], &[0], &[0]);
        let two = rows(&[0, 1], &[0, 1], &[1, 1]);
        let no_block = DecodeRows { block: 0, ..rows(&[0], &[0], &[1]) };
        for rows in [past_end, short_table, table_past_end, empty, two, no_block] {
            assert!(kernels.write_decode_rows(&cache, &new, rows).is_err());
            assert!(kernels.decode_attention(&q, &cache, &cache, rows, 0).is_err());
        }
        if kernels == Kernels::Portable {
            return;
        }
        let wrong_heads = Tensor::zeros((1, 3, 4), candle_core::DType::F32, &dev).unwrap();
        let ok = rows(&[0], &[0], &[1]);
        let err = decode_attention(
            &wrong_heads,
            &cache.repeat((1, 2, 1)).unwrap(),
            &cache.repeat((1, 2, 1)).unwrap(),
            ok,
        );
        assert!(err.unwrap_err().to_string().contains("decode-attention"));
    }
}
