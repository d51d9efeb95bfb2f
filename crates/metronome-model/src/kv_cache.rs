//! Incremental decoding: a key/value cache with independent slots, prompt prefill,
//! and batched single-token decode steps that are batch-invariant.

use candle_core::{DType, Tensor};

use crate::model::Model;
use crate::ops::{
    DecodeRows, apply_rope, attention, decode_attention, linear, rms_norm, rope_tables, write_decode_rows,
};
use crate::{Error, Result};

/// Linear layers in a decode step see at least this many rows (zero rows pad the
/// rest). candle's CPU matmul picks different kernels for small `M` (a gemv path at
/// one row, a "horizontal" kernel when `m·n ≤ 256`), and those round differently;
/// with a fixed minimum every batch size takes the same kernel, so a slot's logits do
/// not depend on who else decodes with it (DESIGN.md §6).
pub const DECODE_MIN_ROWS: usize = 16;

/// Cached keys and values for a fixed number of sequence slots. Each slot is filled
/// ([`Model::prefill`], [`Model::decode_step`]) and freed ([`KvCache::free`])
/// independently. Memory is allocated up front: `2 · layers · slots · max_seq_len ·
/// kv_heads · head_dim` floats.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer, `[num_slots * max_seq_len, kv_heads, head_dim]`: slot `s` owns rows
    /// `s * max_seq_len ..`, so its prefix is one contiguous block.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    lens: Vec<usize>,
    max_seq_len: usize,
    /// Minimum rows of a decode step's linear layers ([`DECODE_MIN_ROWS`], or 1 when
    /// batch invariance was switched off).
    min_rows: usize,
}

impl KvCache {
    /// A cache for `model` with `num_slots` slots of up to `max_seq_len` tokens each.
    pub fn new(model: &Model, num_slots: usize, max_seq_len: usize) -> Result<Self> {
        let cfg = model.config();
        if num_slots == 0 || max_seq_len == 0 {
            return Err(Error::invalid("kv cache", "needs at least one slot of at least one token"));
        }
        let shape = (num_slots * max_seq_len, cfg.num_key_value_heads, cfg.head_dim);
        let mut keys = Vec::with_capacity(cfg.num_hidden_layers);
        let mut values = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            keys.push(Tensor::zeros(shape, DType::F32, model.device())?);
            values.push(Tensor::zeros(shape, DType::F32, model.device())?);
        }
        Ok(Self { keys, values, lens: vec![0; num_slots], max_seq_len, min_rows: DECODE_MIN_ROWS })
    }

    /// Switches batch-invariant decoding off (or back on). Off, a lone sequence's
    /// linear layers take candle's single-row path: several times faster at batch 1
    /// on large matrices (for a 135M model about 6x measured here), but its logits then
    /// differ in the last bits from the same sequence decoded in a batch. Batches of two
    /// or more cost about the same either way (the weight packing dominates). Keep it on
    /// for rollouts, whose sampled tokens must not depend on the batch.
    pub fn set_batch_invariant(&mut self, on: bool) {
        self.min_rows = if on { DECODE_MIN_ROWS } else { 1 };
    }

    /// Empties `slot` (its memory is reused by the next sequence).
    pub fn free(&mut self, slot: usize) {
        if let Some(l) = self.lens.get_mut(slot) {
            *l = 0;
        }
    }

    /// Tokens cached in `slot` (0 for a slot out of range).
    #[must_use]
    pub fn len(&self, slot: usize) -> usize {
        self.lens.get(slot).copied().unwrap_or(0)
    }

    /// True when `slot` holds no tokens.
    #[must_use]
    pub fn is_empty(&self, slot: usize) -> bool {
        self.len(slot) == 0
    }

    /// Number of slots.
    #[must_use]
    pub fn num_slots(&self) -> usize {
        self.lens.len()
    }

    /// Longest sequence a slot holds.
    #[must_use]
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    fn check(&self, model: &Model, slot: usize, extra: usize) -> Result<()> {
        if self.keys.len() != model.config().num_hidden_layers
            || self.keys.first().map(|k| k.dims()[1..].to_vec())
                != Some(vec![model.config().num_key_value_heads, model.config().head_dim])
        {
            return Err(Error::invalid("kv cache", "was built for a model of another shape"));
        }
        let Some(&len) = self.lens.get(slot) else {
            return Err(Error::invalid(
                format!("slot {slot}"),
                format!("is out of range (cache has {})", self.lens.len()),
            ));
        };
        if len + extra > self.max_seq_len {
            return Err(Error::invalid(
                format!("slot {slot}"),
                format!("holds {len} tokens and cannot take {extra} more (max_seq_len {})", self.max_seq_len),
            ));
        }
        Ok(())
    }

    /// Writes `k`, `v` (`[n, kv_heads, head_dim]`) at `slot`'s positions `start..`.
    fn write(&self, layer: usize, slot: usize, start: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let row = slot * self.max_seq_len + start;
        self.keys[layer].slice_set(&k.contiguous()?, 0, row)?;
        self.values[layer].slice_set(&v.contiguous()?, 0, row)?;
        Ok(())
    }

    /// The first `len` cached keys and values of `slot`, `[len, kv_heads, head_dim]`.
    fn read(&self, layer: usize, slot: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let row = slot * self.max_seq_len;
        Ok((self.keys[layer].narrow(0, row, len)?, self.values[layer].narrow(0, row, len)?))
    }
}

/// `linear` with the input padded to `min_rows` rows.
fn padded_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, min_rows: usize) -> Result<Tensor> {
    let n = x.dim(0)?;
    if n >= min_rows {
        return linear(x, w, b);
    }
    let pad = Tensor::zeros((min_rows - n, x.dim(1)?), x.dtype(), x.device())?;
    linear(&Tensor::cat(&[x, &pad], 0)?, w, b)?.narrow(0, 0, n).map_err(Into::into)
}

impl Model {
    /// Appends `tokens` (a prompt, or any continuation) to `slot`'s cache and returns
    /// the logits `[vocab]` of the last position. Builds no autograd graph.
    pub fn prefill(&self, cache: &mut KvCache, slot: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::invalid(format!("prefill of slot {slot}"), "has no tokens"));
        }
        cache.check(self, slot, tokens.len())?;
        self.check_tokens(tokens, &|| format!("prefill of slot {slot}"))?;
        let m = &self.inner;
        let cfg = &m.cfg;
        let dev = &m.device;
        let n = tokens.len();
        let start = cache.lens[slot];
        let positions: Vec<u32> = (start..start + n).map(|p| p as u32).collect();
        let rope = rope_tables(&positions, cfg.head_dim, cfg.rope_theta);
        let total = start + n;
        // Query i (position start + i) sees keys 0..=start + i.
        let mask = if n > 1 {
            let mut mask = vec![0.0f32; n * total];
            for i in 0..n {
                mask[i * total + start + i + 1..(i + 1) * total].fill(f32::NEG_INFINITY);
            }
            Some(Tensor::from_vec(mask, (n, total), dev)?)
        } else {
            None
        };
        let ids = Tensor::from_slice(tokens, n, dev)?;
        let w = |v: &candle_core::Var| Self::w(v, false);
        let mut x = w(&m.embed).index_select(&ids, 0)?;
        let (h, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        for (li, l) in m.layers.iter().enumerate() {
            let wo = |v: &Option<candle_core::Var>| v.as_ref().map(w);
            let a = rms_norm(&x, &w(&l.input_norm), cfg.rms_norm_eps)?;
            let q = linear(&a, &w(&l.q), wo(&l.q_bias).as_ref())?.reshape((n, h, hd))?;
            let k = linear(&a, &w(&l.k), wo(&l.k_bias).as_ref())?.reshape((n, kvh, hd))?;
            let v = linear(&a, &w(&l.v), wo(&l.v_bias).as_ref())?.reshape((n, kvh, hd))?;
            let q = apply_rope(&q, &rope)?;
            let k = apply_rope(&k, &rope)?;
            cache.write(li, slot, start, &k, &v)?;
            let (ks, vs) = cache.read(li, slot, total)?;
            let att = attention(&q, &ks, &vs, mask.as_ref())?;
            x = (x + linear(&att, &w(&l.o), None)?)?;
            let b = rms_norm(&x, &w(&l.post_norm), cfg.rms_norm_eps)?;
            let g = linear(&b, &w(&l.gate), None)?.silu()?;
            let u = linear(&b, &w(&l.up), None)?;
            x = (x + linear(&(g * u)?, &w(&l.down), None)?)?;
        }
        let last = rms_norm(&x.narrow(0, n - 1, 1)?, &w(&m.norm), cfg.rms_norm_eps)?;
        let logits = linear(&last, &self.lm_head(false), None)?;
        cache.lens[slot] = total;
        Ok(logits.squeeze(0)?.to_vec1::<f32>()?)
    }

    /// One decode step for several slots of possibly different lengths: each
    /// `(slot, token)` appends `token` to `slot` and yields that position's logits.
    /// Returns one `Vec<f32>` of `vocab` logits per pair, in order.
    ///
    /// Batch-invariant: a slot's logits are bitwise the same whichever other slots
    /// decode with it. Attention runs per slot over its own cache without padding (one
    /// fused CPU op per layer reads every slot's prefix in place), and linear layers see
    /// at least [`DECODE_MIN_ROWS`] rows. Builds no autograd graph.
    pub fn decode_step(&self, cache: &mut KvCache, batch: &[(usize, u32)]) -> Result<Vec<Vec<f32>>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut seen = vec![false; cache.num_slots()];
        for &(slot, _) in batch {
            cache.check(self, slot, 1)?;
            if std::mem::replace(&mut seen[slot], true) {
                return Err(Error::invalid(format!("slot {slot}"), "appears twice in one decode step"));
            }
        }
        let tokens: Vec<u32> = batch.iter().map(|&(_, t)| t).collect();
        let mr = cache.min_rows;
        self.check_tokens(&tokens, &|| "decode step".to_owned())?;
        let m = &self.inner;
        let cfg = &m.cfg;
        let dev = &m.device;
        let n = batch.len();
        let positions: Vec<u32> = batch.iter().map(|&(s, _)| cache.lens[s] as u32).collect();
        let rope = rope_tables(&positions, cfg.head_dim, cfg.rope_theta);
        // Each row's slot block in the cache, and its length with this step's token.
        let base: Vec<usize> = batch.iter().map(|&(s, _)| s * cache.max_seq_len).collect();
        let lens: Vec<usize> = positions.iter().map(|&p| p as usize + 1).collect();
        let rows = DecodeRows { base: &base, len: &lens };
        let w = |v: &candle_core::Var| Self::w(v, false);
        let mut x = w(&m.embed).index_select(&Tensor::from_vec(tokens, n, dev)?, 0)?;
        let (h, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        for (li, l) in m.layers.iter().enumerate() {
            let wo = |v: &Option<candle_core::Var>| v.as_ref().map(w);
            let a = rms_norm(&x, &w(&l.input_norm), cfg.rms_norm_eps)?;
            let q = padded_linear(&a, &w(&l.q), wo(&l.q_bias).as_ref(), mr)?.reshape((n, h, hd))?;
            let k = padded_linear(&a, &w(&l.k), wo(&l.k_bias).as_ref(), mr)?.reshape((n, kvh, hd))?;
            let v = padded_linear(&a, &w(&l.v), wo(&l.v_bias).as_ref(), mr)?.reshape((n, kvh, hd))?;
            let q = apply_rope(&q, &rope)?;
            let k = apply_rope(&k, &rope)?;
            write_decode_rows(&cache.keys[li], &k, rows)?;
            write_decode_rows(&cache.values[li], &v, rows)?;
            let att = decode_attention(&q, &cache.keys[li], &cache.values[li], rows)?;
            x = (x + padded_linear(&att, &w(&l.o), None, mr)?)?;
            let b = rms_norm(&x, &w(&l.post_norm), cfg.rms_norm_eps)?;
            let g = padded_linear(&b, &w(&l.gate), None, mr)?.silu()?;
            let u = padded_linear(&b, &w(&l.up), None, mr)?;
            x = (x + padded_linear(&(g * u)?, &w(&l.down), None, mr)?)?;
        }
        let x = rms_norm(&x, &w(&m.norm), cfg.rms_norm_eps)?;
        let logits = padded_linear(&x, &self.lm_head(false), None, mr)?;
        for &(slot, _) in batch {
            cache.lens[slot] += 1;
        }
        Ok(logits.to_vec2::<f32>()?)
    }
}
