//! Differentiable building blocks.
//!
//! candle-nn's fused `softmax_last_dim`, `rms_norm` and `RmsNorm::forward` have no
//! backward and silently cut gradients (DESIGN.md §6), so the network is written from
//! candle-core primitives that all have one.

use candle_core::{D, Device, Tensor};

use crate::Result;

/// RMSNorm over the last dimension, as Hugging Face computes it:
/// `w * x / sqrt(mean(x²) + eps)`.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?.broadcast_mul(weight)?)
}

/// Softmax over the last dimension. The max is subtracted for stability and
/// detached: softmax is shift-invariant, so its gradient through the max is zero.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Log-softmax over the last dimension (max detached, as in [`softmax_last_dim`]).
pub(crate) fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let z = x.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(z.broadcast_sub(&lse)?)
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
pub(crate) fn rope_tables(
    positions: &[u32],
    head_dim: usize,
    theta: f64,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
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
    let n = positions.len();
    Ok((Tensor::from_vec(cos, (n, half), device)?, Tensor::from_vec(sin, (n, half), device)?))
}

/// Applies rotary embeddings to `x: [n, heads, head_dim]` (Hugging Face's
/// rotate-half convention) with tables from [`rope_tables`].
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (n, _heads, hd) = x.dims3()?;
    let half = hd / 2;
    let cos = cos.reshape((n, 1, half))?;
    let sin = sin.reshape((n, 1, half))?;
    let x1 = x.narrow(2, 0, half)?;
    let x2 = x.narrow(2, half, half)?;
    let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let b = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Ok(Tensor::cat(&[a, b], 2)?)
}

/// Scaled dot-product attention of one sequence with grouped-query heads.
///
/// `q: [lq, heads, hd]`, `k`, `v: [lk, kv_heads, hd]`, `mask`: additive `[lq, lk]`
/// (`None` when every query sees every key). Returns `[lq, heads * hd]`. Query heads
/// are grouped by their key/value head instead of repeating keys and values.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let (lq, heads, hd) = q.dims3()?;
    let (lk, kv_heads, _) = k.dims3()?;
    let rep = heads / kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    let q = q.transpose(0, 1)?.contiguous()?.reshape((kv_heads, rep * lq, hd))?;
    let k = k.transpose(0, 1)?;
    let v = v.transpose(0, 1)?;
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let scores = match mask {
        Some(m) => {
            scores.reshape((kv_heads, rep, lq, lk))?.broadcast_add(m)?.reshape((kv_heads, rep * lq, lk))?
        }
        None => scores,
    };
    let probs = softmax_last_dim(&scores)?;
    let out = probs.matmul(&v)?; // [kv, rep * lq, hd]
    Ok(out.reshape((heads, lq, hd))?.transpose(0, 1)?.contiguous()?.reshape((lq, heads * hd))?)
}

/// The additive attention mask of a packed row: 0 where a query may attend a key
/// (same segment and not later, or any position of an ancestor segment), `-inf`
/// elsewhere. `[len, len]` f32.
pub(crate) fn segment_mask(row: &metronome_core::PackedRow, device: &Device) -> Result<Tensor> {
    let len = row.len();
    let mut mask = vec![f32::NEG_INFINITY; len * len];
    for seg in &row.segments {
        // Ancestors are earlier segments, wholly before this one.
        let mut ancestors = Vec::new();
        let mut p = seg.parent;
        while let Some(a) = p {
            ancestors.push(row.segments[a as usize]);
            p = row.segments[a as usize].parent;
        }
        for q in seg.start as usize..seg.end() as usize {
            let line = &mut mask[q * len..(q + 1) * len];
            line[seg.start as usize..=q].fill(0.0);
            for a in &ancestors {
                line[a.start as usize..a.end() as usize].fill(0.0);
            }
        }
    }
    Ok(Tensor::from_vec(mask, (len, len), device)?)
}

#[cfg(test)]
mod tests {
    use metronome_core::{PackedRow, Segment};

    use super::*;

    #[test]
    fn segment_mask_matches_can_attend() {
        let row = PackedRow {
            tokens: vec![0; 9],
            positions: vec![0; 9],
            segments: vec![
                Segment { start: 0, len: 3, parent: None },
                Segment { start: 3, len: 2, parent: Some(0) },
                Segment { start: 5, len: 2, parent: Some(0) },
                Segment { start: 7, len: 2, parent: None },
            ],
        };
        let m = segment_mask(&row, &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
        for (q, line) in m.iter().enumerate() {
            for (k, &x) in line.iter().enumerate() {
                assert_eq!(x == 0.0, row.can_attend(q, k), "query {q} key {k}");
            }
        }
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
