//! Incremental decoding: a paged key/value cache with independent slots, prompt
//! prefill (one slot or many in one forward), and batched single-token decode steps,
//! all batch-invariant.
//!
//! The cache is a pool of blocks of [`KV_BLOCK`] positions; each slot's block table
//! lists the blocks its positions fill, in order, as vLLM's PagedAttention (Kwon et al.
//! 2023, arXiv 2309.06180) lays out its cache. A slot takes blocks as it grows and
//! gives them back when freed, so a pool may be smaller than every slot at its longest
//! ([`KvCache::paged`]). The attention kernels read a row's positions in order across
//! its blocks (on the CPU one run per block, on the GPU the block looked up per
//! position), summing in the order they did over one contiguous run: a slot's logits
//! are bitwise the same whatever the block size and whichever blocks it holds.
//!
//! Prefill and decode share one forward ([`Model::prefill_many`], [`Model::decode_step`]):
//! every new token is a row; the linear layers run on all rows at once, padded to
//! [`DECODE_MIN_ROWS`]; per layer, two fused CPU ops write the rows' keys and values
//! into the cache and one fused op computes each row's grouped-query attention over
//! its own slot prefix, read in place (crate `ops`: `DecodeWrite`, `DecodeAttention`).
//! That replaced about ten candle ops per row per layer (cache write, narrow, repeat,
//! matmul, softmax, matmul), whose dispatch dominated steps of many slots.
//!
//! The linear layers take one of two paths. A model that may train runs candle's
//! matmul on its training weights `[out, in]`; candle repacks each transposed weight
//! on every call and picks its kernel by the number of rows, so inputs are padded to
//! [`DECODE_MIN_ROWS`] rows for batch invariance. A frozen model
//! ([`Model::frozen_copy`], what rollout workers decode with) keeps its linear layers a
//! second time in decode layout `[in, out]`, the query/key/value projections stacked
//! into one product and the gate/up projections into another, and runs them through
//! its own SIMD kernel (crate `ops`, `dense_rows`): each output element is one fused
//! multiply-add chain in input order whatever the batch, so no padding is needed and a
//! lone sequence costs one row, not sixteen. Measured on the tiny model, one thread:
//! 2.2x the tokens/s of the padded candle path at 64 slots and 8-9x at one slot. Both
//! paths match the full forward within 1e-5 and are bitwise batch-invariant. The
//! frozen path computes in host buffers its cache keeps ([`Scratch`]), calling the
//! functions the fused ops' own forwards call, without a tensor (an `Arc`, a storage,
//! a shape, strides) allocated per op per layer per step; moving it there changed no
//! bit of a 20-period run.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::draw::{Draw, Next, check_draws};
use crate::model::{DecodeWeights, Model, StackedWeights};
use crate::ops::{
    DecodeRows, StepIndex, attention_rows, dense_rows, linear, output, read_host, rms_norm_rows,
    swiglu_stacked_rows, write_host,
};
use crate::{Error, Result};

/// On models that may train, linear layers in a decode step see at least this many
/// rows (zero rows pad the rest). candle's CPU matmul picks different kernels for
/// small `M` (a gemv path at one row, a "horizontal" kernel when `m·n ≤ 256`), and
/// those round differently; with a fixed minimum every batch size takes the same
/// kernel, so a slot's logits do not depend on who else decodes with it (docs/design.md
/// §6). Frozen models need no padding (see the module docs).
pub const DECODE_MIN_ROWS: usize = 16;

/// Rows (token positions) per block of a [`KvCache::new`] cache, as vLLM's default:
/// small enough that a slot wastes at most 15 positions' memory past its length, large
/// enough that a slot's prefix is a few contiguous runs.
pub const KV_BLOCK: usize = 16;

/// `METRONOME_CUDA_GRAPHS=1` turns [`KvCache::set_cuda_graphs`] on for every cache
/// (`0` or unset: off; any other value is refused naming it).
pub const CUDA_GRAPHS_ENV: &str = "METRONOME_CUDA_GRAPHS";

/// What a cache's CUDA graphs of decode steps did ([`KvCache::set_cuda_graphs`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodeGraphStats {
    /// Steps run as a captured graph (a capturing step's launch included).
    pub replayed: u64,
    /// Graphs captured.
    pub captured: u64,
    /// Captures that failed (each such step ran op by op).
    pub failed: u64,
    /// The last failed capture's error.
    pub last_error: Option<String>,
    /// Whether the cache stopped trying, after four failed captures in a row.
    pub given_up: bool,
}

/// Cached keys and values for a fixed number of sequence slots, paged. Each slot is
/// filled ([`Model::prefill`], [`Model::decode_step`]) and freed ([`KvCache::free`])
/// independently. Memory is a pool of blocks of [`KvCache::block_size`] positions,
/// allocated up front (`2 · layers · blocks · block_size · kv_heads · head_dim` values
/// in the model's type: f32, or bf16 for a bf16 [`Model::compute_copy`]); a slot takes
/// blocks from the pool as it grows and gives them back when freed, and its block table
/// says where each run of its positions lies. [`KvCache::new`] holds enough blocks for
/// every slot at its longest; [`KvCache::paged`] may hold fewer (sequences then share
/// the memory their actual lengths need, and a step that finds the pool short is
/// refused before anything is written).
#[derive(Debug)]
pub struct KvCache {
    /// Per layer, `[blocks * block, kv_heads, head_dim]`: block `b` is rows `b * block ..
    /// (b + 1) * block`.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    lens: Vec<usize>,
    max_seq_len: usize,
    /// Positions per block.
    block: usize,
    /// Entries of each slot's block table: slot `s`'s table is `tables[s * max_blocks ..]`,
    /// of which the first `held[s]` entries are its blocks.
    max_blocks: usize,
    tables: Vec<u32>,
    held: Vec<usize>,
    /// The pool's unused blocks.
    free_blocks: Vec<u32>,
    /// Minimum rows of a decode step's linear layers ([`DECODE_MIN_ROWS`], or 1 when
    /// batch invariance was switched off).
    min_rows: usize,
    /// The host buffers a frozen model's decode steps compute in, kept from step to step.
    scratch: Scratch,
    /// The last step's plan, whose buffers the next step refills.
    plan: StepPlan,
    /// Whether decode steps run as CUDA graphs where they can ([`KvCache::set_cuda_graphs`]).
    cuda_graphs: bool,
    #[cfg(feature = "cuda")]
    graphs: crate::cuda::DecodeGraphs,
}

/// The activations of one cached forward on a frozen model's decode-layout weights
/// (`Model::extend_dense`), on the host, reused by every step of a cache: of buffers a
/// step makes only its logits. As candle tensors each op of each layer allocated its
/// output, an `Arc`, a shape and strides: about 40% of the allocations of a period of
/// the TRL-matched run.
#[derive(Debug, Default)]
struct Scratch {
    /// The residual stream `[rows, hidden]`.
    x: Vec<f32>,
    /// A normed copy of it.
    normed: Vec<f32>,
    /// The stacked query/key/value product, and the rotated queries and keys.
    qkv: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    /// The attention's output, and a linear layer's before it joins the residual.
    att: Vec<f32>,
    out: Vec<f32>,
    /// The stacked gate/up product and its SwiGLU.
    gate_up: Vec<f32>,
    swiglu: Vec<f32>,
}

/// The first `n` elements of `buf`, grown (never shrunk) to hold them: the kernels
/// writing them overwrite every element, so what a longer step left there is never read.
fn sized(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

impl KvCache {
    /// The bytes of a [`KvCache::new`] cache of `num_slots` slots of `max_seq_len`
    /// tokens for `model` (keys and values of every layer, in the model's type); `None`
    /// beyond `u64`.
    #[must_use]
    pub fn bytes(model: &Model, num_slots: usize, max_seq_len: usize) -> Option<u64> {
        let (block, blocks) = Self::whole(num_slots, max_seq_len)?;
        Self::pool_bytes(model, block, blocks)
    }

    /// The bytes of a pool of `blocks` blocks of `block` positions for `model`.
    fn pool_bytes(model: &Model, block: usize, blocks: usize) -> Option<u64> {
        let cfg = model.config();
        let size = model.dtype().size_in_bytes();
        [blocks, block, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim, size]
            .into_iter()
            .try_fold(1u64, |n, d| n.checked_mul(d as u64))
    }

    /// The bytes of a [`KvCache::pooled`] cache of `tokens` positions for `model`;
    /// `None` beyond `u64`.
    #[must_use]
    pub fn pooled_bytes(model: &Model, max_seq_len: usize, tokens: usize) -> Option<u64> {
        let block = Self::block_for(max_seq_len);
        Self::pool_bytes(model, block, tokens.div_ceil(block))
    }

    /// The block size of [`KvCache::new`] and [`KvCache::pooled`] caches of slots of
    /// `max_seq_len` tokens: [`KV_BLOCK`], or `max_seq_len` when that is shorter.
    fn block_for(max_seq_len: usize) -> usize {
        KV_BLOCK.min(max_seq_len).max(1)
    }

    /// The block size and block count of [`KvCache::new`]: every slot at its longest.
    fn whole(num_slots: usize, max_seq_len: usize) -> Option<(usize, usize)> {
        let block = Self::block_for(max_seq_len);
        Some((block, num_slots.checked_mul(max_seq_len.div_ceil(block))?))
    }

    /// A cache for `model` with `num_slots` slots of up to `max_seq_len` tokens each,
    /// and blocks enough for all of them at once (blocks of [`KV_BLOCK`] positions, or
    /// of `max_seq_len` when that is shorter).
    pub fn new(model: &Model, num_slots: usize, max_seq_len: usize) -> Result<Self> {
        let (block, blocks) = Self::whole(num_slots, max_seq_len).ok_or_else(|| {
            Error::invalid("kv cache", format!("{num_slots} slots of {max_seq_len} tokens overflow a count"))
        })?;
        Self::paged(model, num_slots, max_seq_len, block, blocks)
    }

    /// A cache for `model` with `num_slots` slots of up to `max_seq_len` tokens each,
    /// sharing a pool of `tokens` positions (`tokens.div_ceil(block_size)` blocks of
    /// the block size [`KvCache::new`] takes): what a rollout worker with
    /// `rollout.kv_cache_tokens` decodes with.
    pub fn pooled(model: &Model, num_slots: usize, max_seq_len: usize, tokens: usize) -> Result<Self> {
        let block = Self::block_for(max_seq_len);
        Self::paged(model, num_slots, max_seq_len, block, tokens.div_ceil(block))
    }

    /// A cache for `model` with `num_slots` slots of up to `max_seq_len` tokens each,
    /// sharing a pool of `num_blocks` blocks of `block_size` positions: what the slots
    /// hold at once is bounded by the pool, not by `num_slots · max_seq_len`.
    pub fn paged(
        model: &Model,
        num_slots: usize,
        max_seq_len: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self> {
        let cfg = model.config();
        if num_slots == 0 || max_seq_len == 0 {
            return Err(Error::invalid("kv cache", "needs at least one slot of at least one token"));
        }
        if block_size == 0 || num_blocks == 0 {
            return Err(Error::invalid(
                "kv cache",
                format!(
                    "needs at least one block of at least one position (has {num_blocks} of {block_size})"
                ),
            ));
        }
        let max_blocks = max_seq_len.div_ceil(block_size);
        let rows = num_blocks.checked_mul(block_size).filter(|_| u32::try_from(num_blocks).is_ok());
        let tables = num_slots.checked_mul(max_blocks);
        let (Some(rows), Some(tables)) = (rows, tables) else {
            return Err(Error::invalid(
                "kv cache",
                format!(
                    "{num_blocks} blocks of {block_size} positions for {num_slots} slots of {max_seq_len} tokens overflow a count"
                ),
            ));
        };
        let shape = (rows, cfg.num_key_value_heads, cfg.head_dim);
        let mut keys = Vec::with_capacity(cfg.num_hidden_layers);
        let mut values = Vec::with_capacity(cfg.num_hidden_layers);
        // In the weights' type: a bf16 model (generation in bf16) caches bf16 keys and
        // values, half the memory and half the bytes each decode step reads.
        for _ in 0..cfg.num_hidden_layers {
            keys.push(Tensor::zeros(shape, model.dtype(), model.device())?);
            values.push(Tensor::zeros(shape, model.dtype(), model.device())?);
        }
        Ok(Self {
            keys,
            values,
            lens: vec![0; num_slots],
            max_seq_len,
            block: block_size,
            max_blocks,
            tables: vec![0; tables],
            held: vec![0; num_slots],
            // Handed out from the end: block 0 first.
            free_blocks: (0..num_blocks as u32).rev().collect(),
            min_rows: DECODE_MIN_ROWS,
            scratch: Scratch::default(),
            plan: StepPlan::default(),
            cuda_graphs: crate::device::switch(
                CUDA_GRAPHS_ENV,
                std::env::var_os(CUDA_GRAPHS_ENV).as_deref(),
            )?,
            #[cfg(feature = "cuda")]
            graphs: crate::cuda::DecodeGraphs::default(),
        })
    }

    /// Runs decode steps of a frozen model under [`crate::Kernels::Cuda`] as CUDA graphs
    /// (off by default, or as [`CUDA_GRAPHS_ENV`] says): a step whose row count was also
    /// the last step's is captured once, and later steps of that count replay it with
    /// one launch instead of about 280 (its inputs written into the graph's buffers in
    /// place; an installed snapshot writes the weights in place too, so graphs outlive
    /// it). The logits such a step returns are
    /// overwritten by the next replay. A capture that fails (another thread
    /// synchronising the GPU meanwhile invalidates it) runs the step op by op and is
    /// tried again later; [`KvCache::decode_graphs`] says what happened. Elsewhere it
    /// changes nothing.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.cuda_graphs = on;
        #[cfg(feature = "cuda")]
        if !on {
            self.graphs.clear();
        }
    }

    /// What this cache's CUDA graphs did (all zeros without them).
    #[must_use]
    pub fn decode_graphs(&self) -> DecodeGraphStats {
        #[cfg(feature = "cuda")]
        return self.graphs.stats();
        #[cfg(not(feature = "cuda"))]
        DecodeGraphStats::default()
    }

    /// Switches batch-invariant decoding off (or back on) for models that may train
    /// (a frozen model's decode kernel is batch-invariant at no cost and ignores this).
    /// Off, a lone sequence's
    /// linear layers take candle's single-row path: several times faster at batch 1
    /// on large matrices (for a 135M model about 6x measured here), but its logits then
    /// differ in the last bits from the same sequence decoded in a batch. Batches of two
    /// or more cost about the same either way (the weight packing dominates). Keep it on
    /// for rollouts, whose sampled tokens must not depend on the batch.
    pub fn set_batch_invariant(&mut self, on: bool) {
        self.min_rows = if on { DECODE_MIN_ROWS } else { 1 };
    }

    /// Empties `slot`: its blocks go back to the pool for the next sequence.
    pub fn free(&mut self, slot: usize) {
        if let Some(l) = self.lens.get_mut(slot) {
            *l = 0;
            let table = slot * self.max_blocks;
            self.free_blocks.extend(self.tables[table..table + self.held[slot]].iter().rev());
            self.held[slot] = 0;
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

    /// Positions per block.
    #[must_use]
    pub fn block_size(&self) -> usize {
        self.block
    }

    /// Blocks in the pool that no slot holds.
    #[must_use]
    pub fn free_blocks(&self) -> usize {
        self.free_blocks.len()
    }

    fn check(&self, model: &Model, slot: usize, extra: usize) -> Result<()> {
        let cfg = model.config();
        if self.keys.len() != cfg.num_hidden_layers
            || self.keys.first().map(|k| &k.dims()[1..]) != Some(&[cfg.num_key_value_heads, cfg.head_dim][..])
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

    /// Gives every `(slot, tokens)` the blocks its new length needs, all or none: a step
    /// the pool cannot hold is refused before anything is taken or written.
    fn take_blocks(&mut self, seqs: &[(usize, &[u32])]) -> Result<()> {
        let need = |c: &Self, slot: usize, extra: usize| {
            (c.lens[slot] + extra).div_ceil(c.block).saturating_sub(c.held[slot])
        };
        let wanted: usize = seqs.iter().map(|&(slot, t)| need(self, slot, t.len())).sum();
        if wanted > self.free_blocks.len() {
            return Err(Error::invalid(
                "kv cache",
                format!(
                    "is out of blocks: the step needs {wanted} more of {} positions and {} of the pool's {} are free",
                    self.block,
                    self.free_blocks.len(),
                    self.free_blocks.len() + self.held.iter().sum::<usize>(),
                ),
            ));
        }
        for &(slot, tokens) in seqs {
            for _ in 0..need(self, slot, tokens.len()) {
                // Counted above: the pool holds them all.
                if let Some(b) = self.free_blocks.pop() {
                    self.tables[slot * self.max_blocks + self.held[slot]] = b;
                    self.held[slot] += 1;
                }
            }
        }
        Ok(())
    }
}

/// The rows of one cached forward ([`Model::extend`]): the tokens it computes, where
/// each attends, and which pairs take another pair's keys, values and logits instead of
/// computing them.
///
/// A GRPO group starts as G pairs prefilling empty slots with the same prompt. Only
/// the first of them is computed: the others' cache rows are written from its keys
/// and values by the same per-layer writes, and they take its logits row (each draws
/// its own token from it). Every row is computed alone (batch invariance), so what a
/// pair takes is bitwise what it would have computed itself; the prompt's forward
/// costs once per group instead of G times.
#[derive(Debug, Default)]
struct StepPlan {
    /// The computed rows' tokens and positions.
    ids: Vec<u32>,
    positions: Vec<u32>,
    /// Their rotary tables.
    rope: crate::ops::RopeTables,
    /// Each computed row's block table (its slot's) and its cached length once written
    /// ([`DecodeRows`]).
    table: Vec<usize>,
    lens: Vec<usize>,
    /// Each computed pair's last row.
    last: Vec<u32>,
    /// `None` when every pair computes its own rows.
    copies: Option<Copies>,
    /// Per pair: the pair whose rows it takes, its first computed row, and its row of
    /// the logits.
    source: Vec<usize>,
    first_row: Vec<usize>,
    logits_of_pair: Vec<u32>,
    /// Per slot of the cache: whether the step names it (a slot named twice is refused).
    seen: Vec<bool>,
}

/// The cache writes and logits of a [`StepPlan`] whose pairs share rows.
#[derive(Debug)]
struct Copies {
    /// Every cache row written, as [`DecodeRows`]: the computed rows', then the copies'.
    table: Vec<usize>,
    lens: Vec<usize>,
    /// For each written row, the computed row whose key and value it takes.
    from: Vec<u32>,
    /// For each pair, its row of the computed pairs' logits.
    logits_of_pair: Vec<u32>,
}

impl StepPlan {
    /// The plan of a step of `seqs` on `cache`, in this plan's buffers: a decode step
    /// allocates none once they have grown to its width.
    fn fill(&mut self, cache: &KvCache, seqs: &[(usize, &[u32])], head_dim: usize, rope_theta: f64) {
        // The pair whose rows each pair takes: itself, or the first pair that prefills
        // an empty slot with the same tokens (a pair extending a filled slot, such as a
        // multi-turn observation, has a prefix of its own and computes).
        let mut first_with: HashMap<&[u32], usize> = HashMap::new();
        self.source.clear();
        self.source.extend(seqs.iter().enumerate().map(|(p, &(slot, tokens))| {
            if cache.lens[slot] == 0 { *first_with.entry(tokens).or_insert(p) } else { p }
        }));
        for v in [&mut self.ids, &mut self.positions, &mut self.last] {
            v.clear();
        }
        for v in [&mut self.table, &mut self.lens, &mut self.first_row] {
            v.clear();
        }
        self.first_row.resize(seqs.len(), 0);
        self.logits_of_pair.clear();
        self.logits_of_pair.resize(seqs.len(), 0);
        self.copies = None;
        for (p, &(slot, tokens)) in seqs.iter().enumerate() {
            let from = self.source[p];
            if from != p {
                self.logits_of_pair[p] = self.logits_of_pair[from];
                continue;
            }
            let start = cache.lens[slot];
            self.first_row[p] = self.ids.len();
            self.ids.extend_from_slice(tokens);
            for j in 0..tokens.len() {
                self.positions.push((start + j) as u32);
                self.table.push(slot * cache.max_blocks);
                self.lens.push(start + j + 1);
            }
            self.logits_of_pair[p] = self.last.len() as u32;
            self.last.push((self.ids.len() - 1) as u32);
        }
        self.rope.refill(&self.positions, head_dim, rope_theta);
        let total: usize = seqs.iter().map(|(_, t)| t.len()).sum();
        if self.ids.len() < total {
            let mut c = Copies {
                table: self.table.clone(),
                lens: self.lens.clone(),
                from: (0..self.ids.len() as u32).collect(),
                logits_of_pair: self.logits_of_pair.clone(),
            };
            for (p, &(slot, tokens)) in seqs.iter().enumerate().filter(|&(p, _)| self.source[p] != p) {
                for j in 0..tokens.len() {
                    c.table.push(slot * cache.max_blocks);
                    c.lens.push(j + 1);
                    c.from.push((self.first_row[self.source[p]] + j) as u32);
                }
            }
            self.copies = Some(c);
        }
    }
}

/// What every layer of a cached forward reads: where its computed rows attend
/// (`attend`), where their keys and values go (`write`, each written row taking the
/// computed row that `from` names, or the computed rows in order when `from` is
/// `None`), their rotary tables, and the rows whose logits it returns (`last`).
struct StepRows<'a> {
    attend: DecodeRows<'a>,
    write: DecodeRows<'a>,
    from: Option<&'a [u32]>,
    /// `from` on the model's device, uploaded by the first layer that writes.
    from_index: std::sync::OnceLock<Tensor>,
    rope: &'a crate::ops::RopeTables,
    last: &'a [u32],
}

impl StepRows<'_> {
    /// A layer's computed keys or values `[rows, kv_heads, head_dim]` as the rows written.
    fn written(&self, computed: &Tensor) -> Result<Tensor> {
        let Some(from) = self.from else { return Ok(computed.clone()) };
        let index = StepIndex::get(Some(&self.from_index), || {
            Ok(Tensor::from_slice(from, from.len(), computed.device())?)
        })?;
        Ok(computed.index_select(&index, 0)?)
    }

    /// `from` on `device` (uploaded once per step), when written rows take others'.
    fn sources_on(&self, device: &candle_core::Device) -> Result<Option<Tensor>> {
        let Some(from) = self.from else { return Ok(None) };
        let index =
            StepIndex::get(Some(&self.from_index), || Ok(Tensor::from_slice(from, from.len(), device)?))?;
        Ok(Some(index))
    }

    /// The computed row whose key and value written row `i` takes.
    fn source(&self, i: usize) -> usize {
        self.from.map_or(i, |f| f[i] as usize)
    }
}

/// `x` with zero rows appended up to `min_rows` rows (itself when it has that many).
/// Padding each linear layer's input once, and running the gate, up and down
/// projections and the SwiGLU between them on the padded rows (zero rows stay zero),
/// costs three pads per layer instead of seven.
pub(crate) fn pad_rows(x: &Tensor, min_rows: usize) -> Result<Tensor> {
    let n = x.dim(0)?;
    if n >= min_rows {
        return Ok(x.clone());
    }
    let pad = Tensor::zeros((min_rows - n, x.dim(1)?), x.dtype(), x.device())?;
    Ok(Tensor::cat(&[x, &pad], 0)?)
}

/// The token ids of a stacked forward's residual stream ([`Model::extend_stacked`]):
/// `ids`, then token 0 up to `min_rows` rows.
fn padded_ids(ids: &[u32], min_rows: usize) -> Vec<u32> {
    let mut padded = Vec::with_capacity(ids.len().max(min_rows));
    padded.extend_from_slice(ids);
    padded.resize(ids.len().max(min_rows), 0);
    padded
}

/// `linear` with the input padded to `min_rows` rows.
fn padded_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, min_rows: usize) -> Result<Tensor> {
    let n = x.dim(0)?;
    Ok(linear(&pad_rows(x, min_rows)?, w, b)?.narrow(0, 0, n)?)
}

impl Model {
    /// Appends `tokens` (a prompt, or any continuation) to `slot`'s cache and returns
    /// the logits `[vocab]` of the last position. Builds no autograd graph.
    /// [`Model::prefill_many`] prefills several slots in one forward.
    pub fn prefill(&self, cache: &mut KvCache, slot: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut logits = self.prefill_many(cache, &[(slot, tokens)])?;
        Ok(logits.pop().unwrap_or_default())
    }

    /// Appends each `(slot, tokens)` to its slot in one forward pass and returns, per
    /// pair and in order, the logits `[vocab]` of its last position. Builds no autograd
    /// graph.
    ///
    /// One forward for many prompts costs about what one prompt costs on a small model
    /// (the linear layers' per-call work dominates), so an engine admitting many
    /// sequences at once should prefill them together. Batch-invariant like
    /// [`Model::decode_step`]: a slot's logits and cached keys and values are bitwise
    /// the same whichever other slots are prefilled with it. Pairs that fill empty
    /// slots with the same tokens (a prompt's G samples) share one computation: the
    /// first is computed and the others' caches and logits are copied from it, bitwise
    /// what each would have computed.
    pub fn prefill_many(&self, cache: &mut KvCache, seqs: &[(usize, &[u32])]) -> Result<Vec<Vec<f32>>> {
        self.check_prefill(seqs)?;
        Ok(self.extend(cache, seqs)?.to_dtype(DType::F32)?.to_vec2::<f32>()?)
    }

    /// [`Model::prefill_many`] that draws each pair's next token where its logits are,
    /// when `draws` (one per pair) gives it a [`Draw`]: on a GPU under
    /// [`crate::Kernels::Cuda`] only the token and its log-prob cross to the host
    /// (module `draw`). Pairs without a draw, and rows whose logits have no finite
    /// maximum, come back as [`Next::Logits`].
    pub fn prefill_many_drawing(
        &self,
        cache: &mut KvCache,
        seqs: &[(usize, &[u32])],
        draws: &[Option<Draw<'_>>],
    ) -> Result<Vec<Next>> {
        self.check_prefill(seqs)?;
        check_draws(draws, seqs.len())?;
        let logits = self.extend(cache, seqs)?;
        self.kernels.next_rows(&logits, draws)
    }

    fn check_prefill(&self, seqs: &[(usize, &[u32])]) -> Result<()> {
        for &(slot, tokens) in seqs {
            if tokens.is_empty() {
                return Err(Error::invalid(format!("prefill of slot {slot}"), "has no tokens"));
            }
            self.check_tokens(tokens, &|| format!("prefill of slot {slot}"))?;
        }
        Ok(())
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
        Ok(self.decode_logits(cache, batch)?.to_dtype(DType::F32)?.to_vec2::<f32>()?)
    }

    /// [`Model::decode_step`] that draws the next tokens as
    /// [`Model::prefill_many_drawing`] does.
    pub fn decode_step_drawing(
        &self,
        cache: &mut KvCache,
        batch: &[(usize, u32)],
        draws: &[Option<Draw<'_>>],
    ) -> Result<Vec<Next>> {
        check_draws(draws, batch.len())?;
        let logits = self.decode_logits(cache, batch)?;
        self.kernels.next_rows(&logits, draws)
    }

    fn decode_logits(&self, cache: &mut KvCache, batch: &[(usize, u32)]) -> Result<Tensor> {
        self.check_tokens(batch.iter().map(|(_, t)| t), &|| "decode step".to_owned())?;
        let seqs: Vec<(usize, &[u32])> =
            batch.iter().map(|(slot, token)| (*slot, std::slice::from_ref(token))).collect();
        self.extend(cache, &seqs)
    }

    /// Appends every `(slot, tokens)` to its slot in one forward pass; the logits of
    /// each pair's last position, `[pairs, vocab]` on the model's device. Tokens are
    /// already checked against the vocabulary.
    ///
    /// Every computed token is one row: linear layers run on all rows at once (padded
    /// to the cache's minimum rows), and attention is the fused per-row op over the
    /// row's own slot prefix (causal within a prompt, since token `j` sees `start + j +
    /// 1` cached positions). No row's arithmetic depends on another's, hence batch
    /// invariance, and pairs repeating another's prompt are copied ([`StepPlan`]).
    fn extend(&self, cache: &mut KvCache, seqs: &[(usize, &[u32])]) -> Result<Tensor> {
        if seqs.is_empty() {
            let vocab = self.config().vocab_size;
            return Ok(Tensor::zeros((0, vocab), DType::F32, self.device())?);
        }
        if self.lora.is_some() {
            // The rollout engine decodes merged weights; a decode path with adapters
            // would need batch invariance of its own low-rank products.
            return Err(Error::invalid(
                "decoding",
                "needs a plain model: this one has LoRA adapters (decode `Model::merged` or a `frozen_copy`)",
            ));
        }
        // The last step's plan lends its buffers (an error drops them: the next step
        // starts afresh).
        let mut plan = std::mem::take(&mut cache.plan);
        plan.seen.clear();
        plan.seen.resize(cache.num_slots(), false);
        for &(slot, tokens) in seqs {
            cache.check(self, slot, tokens.len())?;
            if std::mem::replace(&mut plan.seen[slot], true) {
                return Err(Error::invalid(format!("slot {slot}"), "appears twice in one step"));
            }
        }
        cache.take_blocks(seqs)?;
        let m = &self.inner;
        let cfg = &m.cfg;
        let dev = &m.device;
        let mr = cache.min_rows;
        plan.fill(cache, seqs, cfg.head_dim, cfg.rope_theta);
        let total = plan.ids.len();
        let index = StepIndex::default();
        let attend = DecodeRows {
            table: &plan.table,
            blocks: &cache.tables,
            block: cache.block,
            len: &plan.lens,
            index: Some(&index),
        };
        let write_index = StepIndex::default();
        let step = StepRows {
            attend,
            write: plan.copies.as_ref().map_or(attend, |c| DecodeRows {
                table: &c.table,
                len: &c.lens,
                index: Some(&write_index),
                ..attend
            }),
            from: plan.copies.as_ref().map(|c| &c.from[..]),
            from_index: Default::default(),
            rope: &plan.rope,
            last: &plan.last,
        };
        let w = |v: &candle_core::Var| Self::w(v, false);
        let (h, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let logits = match (self.decode_weights()?, self.stacked_weights()?) {
            (Some(dw), _) => {
                self.extend_dense((&cache.keys, &cache.values), &mut cache.scratch, &dw, &plan.ids, &step)?
            }
            (None, Some(sw)) => {
                // A decode step (one computed row per pair, none shared) whose every op
                // is a kernel reading the step's index from device buffers: the portable
                // attention, for heads the CUDA kernel does not take, uploads its own.
                #[cfg(feature = "cuda")]
                let graphed = if cache.cuda_graphs
                    && self.kernels == crate::Kernels::Cuda
                    && crate::cuda::decode_kernels_fit(cfg.head_dim)
                    && plan.copies.is_none()
                    && total == seqs.len()
                {
                    self.extend_graphed(
                        &mut cache.graphs,
                        (&cache.keys, &cache.values),
                        &sw,
                        &plan,
                        &step,
                        &index,
                        mr,
                    )?
                } else {
                    None
                };
                #[cfg(not(feature = "cuda"))]
                let graphed = None;
                match graphed {
                    Some(logits) => logits,
                    None => {
                        let ids = Tensor::from_vec(padded_ids(&plan.ids, mr), total.max(mr), dev)?;
                        self.extend_stacked((&cache.keys, &cache.values), &sw, &ids, &step, mr)?
                    }
                }
            }
            (None, None) => {
                let ks = self.kernels;
                let mut x = w(&m.embed).index_select(&Tensor::from_slice(&plan.ids, total, dev)?, 0)?;
                for (li, l) in m.layers.iter().enumerate() {
                    let wo = |v: &Option<candle_core::Var>| v.as_ref().map(w);
                    let a = ks.rms_norm(&x, &w(&l.input_norm), cfg.rms_norm_eps)?;
                    let a = pad_rows(&a, mr)?;
                    let proj = |wt: &candle_core::Var,
                                bias: &Option<candle_core::Var>,
                                heads: usize|
                     -> Result<Tensor> {
                        Ok(linear(&a, &w(wt), wo(bias).as_ref())?
                            .narrow(0, 0, total)?
                            .reshape((total, heads, hd))?)
                    };
                    let q = proj(&l.q, &l.q_bias, h)?;
                    let k = proj(&l.k, &l.k_bias, kvh)?;
                    let v = proj(&l.v, &l.v_bias, kvh)?;
                    let q = ks.rope(&q, step.rope)?;
                    let k = ks.rope(&k, step.rope)?;
                    ks.write_decode_rows(&cache.keys[li], &step.written(&k)?, step.write)?;
                    ks.write_decode_rows(&cache.values[li], &step.written(&v)?, step.write)?;
                    let att = ks.decode_attention(&q, &cache.keys[li], &cache.values[li], step.attend, mr)?;
                    x = (x + linear(&att, &w(&l.o), None)?.narrow(0, 0, total)?)?;
                    let b = ks.rms_norm(&x, &w(&l.post_norm), cfg.rms_norm_eps)?;
                    let b = pad_rows(&b, mr)?;
                    let gu =
                        ks.swiglu(&linear(&b, &w(&l.gate), None)?, &linear(&b, &w(&l.up), None)?, total)?;
                    x = (x + linear(&gu, &w(&l.down), None)?.narrow(0, 0, total)?)?;
                }
                if total > step.last.len() {
                    x = x.index_select(&Tensor::from_slice(step.last, step.last.len(), dev)?, 0)?;
                }
                let x = ks.rms_norm(&x, &w(&m.norm), cfg.rms_norm_eps)?;
                padded_linear(&x, &self.lm_head(false), None, mr)?
            }
        };
        // A pair that shared another's forward takes that pair's logits row.
        let logits = match &plan.copies {
            Some(c) => logits.index_select(&Tensor::from_slice(&c.logits_of_pair, seqs.len(), dev)?, 0)?,
            None => logits,
        };
        for &(slot, tokens) in seqs {
            cache.lens[slot] += tokens.len();
        }
        cache.plan = plan;
        Ok(logits)
    }

    /// The layers and LM head of [`Model::extend`] on the stacked products of the
    /// portable and CUDA kernels ([`StackedWeights`]): nine ops per layer (on a GPU,
    /// nine launches; the op by op form ran 17, and 26 on fewer rows than
    /// `min_rows`, whose padding it made three times per layer). The residual stream
    /// holds `max(rows, min_rows)` rows throughout (the padding rows embed token 0: every
    /// op but attention is row by row, and attention reads and writes the computed rows
    /// only, writing zeros to the others), so no layer pads. Returns the logits of
    /// `step.last`.
    ///
    /// `ids` are the tokens of every row of the residual stream on the model's device:
    /// the computed rows' (`step.attend`'s), then token 0 up to `min_rows` rows.
    fn extend_stacked(
        &self,
        (keys, values): (&[Tensor], &[Tensor]),
        sw: &StackedWeights,
        ids: &Tensor,
        step: &StepRows<'_>,
        min_rows: usize,
    ) -> Result<Tensor> {
        let m = &self.inner;
        let cfg = &m.cfg;
        let ks = self.kernels;
        let (total, eps) = (step.attend.len.len(), cfg.rms_norm_eps);
        let rows = total.max(min_rows);
        if ids.dims() != [rows] {
            return Err(Error::invalid("decoding", format!("{:?} token ids for {rows} rows", ids.dims())));
        }
        let dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let w = |v: &candle_core::Var| Self::w(v, false);
        let mut x = w(&m.embed).index_select(ids, 0)?;
        let from = step.sources_on(&m.device)?;
        let Some(first) = m.layers.first() else {
            return Err(Error::invalid("decoding", "a model without layers"));
        };
        let mut normed = ks.rms_norm(&x, &w(&first.input_norm), eps)?;
        for (li, (l, sl)) in m.layers.iter().zip(&sw.layers).enumerate() {
            let qkv = linear(&normed, &sl.qkv, None)?;
            let caches = (&keys[li], &values[li]);
            let rows_of = (step.attend, step.write);
            let q = ks.decode_project(
                &qkv,
                sl.qkv_bias.as_ref(),
                dims,
                step.rope,
                caches,
                rows_of,
                from.as_ref(),
            )?;
            let att = ks.decode_attention(&q, caches.0, caches.1, step.attend, rows)?;
            (x, normed) = ks.add_rms_norm(&x, &linear(&att, &w(&l.o), None)?, &w(&l.post_norm), eps)?;
            let gate_up = linear(&normed, &sl.gate_up, None)?;
            let down = linear(&ks.swiglu_stacked(&gate_up, total)?, &w(&l.down), None)?;
            // The sum with the next layer's norm, or after the last with the final one.
            let next_norm = m.layers.get(li + 1).map_or(&m.norm, |next| &next.input_norm);
            (x, normed) = ks.add_rms_norm(&x, &down, &w(next_norm), eps)?;
        }
        if total > step.last.len() {
            let last = Tensor::from_slice(step.last, step.last.len(), &m.device)?;
            return padded_linear(&normed.index_select(&last, 0)?, &self.lm_head(false), None, min_rows);
        }
        Ok(linear(&normed, &self.lm_head(false), None)?.narrow(0, 0, total)?)
    }

    /// [`Model::extend_stacked`] of a decode step as a CUDA graph of `graphs`
    /// (`crate::cuda::DecodeGraphs::run`): `None` when the step is to run op by op. A
    /// capture runs the forward on the graph's buffers: the step's index and rotary
    /// tables are set to them before anything builds its own.
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments, reason = "the parts of `extend`'s step a graph reads")]
    fn extend_graphed(
        &self,
        graphs: &mut crate::cuda::DecodeGraphs,
        caches: (&[Tensor], &[Tensor]),
        sw: &StackedWeights,
        plan: &StepPlan,
        step: &StepRows<'_>,
        index: &StepIndex,
        min_rows: usize,
    ) -> Result<Option<Tensor>> {
        let ids = padded_ids(&plan.ids, min_rows);
        let rows = step.attend.pairs()?;
        let (cos, sin) = plan.rope.host();
        let inputs = crate::cuda::StepInputs {
            ids: &ids,
            cos,
            sin,
            rows: &rows,
            blocks: step.attend.blocks,
            weights: sw.id,
        };
        graphs.run(&self.inner.device, plan.ids.len(), &inputs, |g| {
            let _ = index.rows.set(g.rows.clone());
            let _ = index.blocks.set(g.blocks.clone());
            plan.rope.set_on_device(g.cos.clone(), g.sin.clone());
            self.extend_stacked(caches, sw, &g.ids, step, min_rows)
        })
    }

    /// The layers and LM head of [`Model::extend`] on decode-layout weights: the
    /// stacked query/key/value and gate/up products, no padding rows (their kernel is
    /// batch-invariant at any number of rows), computed on the host in the cache's
    /// [`Scratch`] by the functions the fused ops' own forwards call.
    /// `ids` are the tokens of `step`'s computed rows; returns the logits of its rows
    /// `step.last`.
    fn extend_dense(
        &self,
        (keys, values): (&[Tensor], &[Tensor]),
        s: &mut Scratch,
        dw: &DecodeWeights,
        ids: &[u32],
        step: &StepRows<'_>,
    ) -> Result<Tensor> {
        let m = &self.inner;
        let cfg = &m.cfg;
        let (d, total, eps) = (cfg.hidden_size, ids.len(), cfg.rms_norm_eps as f32);
        let (h, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let (qw, kvw) = (h * hd, kvh * hd);
        let cache_rows = keys.first().map_or(0, |k| k.dims()[0]);
        step.write.check("decode-write", step.write.len.len(), cache_rows)?;
        step.attend.check("decode-attention", total, cache_rows)?;
        let x = sized(&mut s.x, total * d);
        read_host(&m.embed, |e| {
            for (row, &id) in x.chunks_exact_mut(d).zip(ids) {
                row.copy_from_slice(&e[id as usize * d..(id as usize + 1) * d]);
            }
        })?;
        let add = |x: &mut [f32], y: &[f32]| x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
        for (li, (l, dl)) in m.layers.iter().zip(&dw.layers).enumerate() {
            let normed = sized(&mut s.normed, total * d);
            read_host(&l.input_norm, |w| rms_norm_rows(x, w, eps, normed))?;
            let width = dl.qkv.outputs();
            let qkv = sized(&mut s.qkv, total * width);
            dense_rows(normed, &dl.qkv, qkv);
            let q = sized(&mut s.q, total * qw);
            step.rope.rotate_rows(qkv, width, hd, q);
            let k = sized(&mut s.k, total * kvw);
            step.rope.rotate_rows(&qkv[qw..], width, hd, k);
            let v = &qkv[qw + kvw..];
            write_host(&keys[li], |c| step.write.write(c, kvw, |i| &k[step.source(i) * kvw..][..kvw]))?;
            write_host(&values[li], |c| step.write.write(c, kvw, |i| &v[step.source(i) * width..][..kvw]))?;
            let att = sized(&mut s.att, total * qw);
            read_host(&keys[li], |k| {
                read_host(&values[li], |v| attention_rows(step.attend, (q, k, v), h, kvh, hd, att))
            })??;
            let out = sized(&mut s.out, total * d);
            dense_rows(att, &dl.o, out);
            add(x, out);
            read_host(&l.post_norm, |w| rms_norm_rows(x, w, eps, normed))?;
            let gate_up = sized(&mut s.gate_up, total * dl.gate_up.outputs());
            dense_rows(normed, &dl.gate_up, gate_up);
            let inter = dl.down.inputs();
            let swiglu = sized(&mut s.swiglu, total * inter);
            swiglu_stacked_rows(gate_up, inter, swiglu);
            dense_rows(swiglu, &dl.down, out);
            add(x, out);
        }
        // The rows whose logits are wanted, normed (the other rows' outputs are unused).
        let n = step.last.len();
        let last = sized(&mut s.att, n * d);
        for (row, &r) in last.chunks_exact_mut(d).zip(step.last) {
            row.copy_from_slice(&x[r as usize * d..(r as usize + 1) * d]);
        }
        let normed = sized(&mut s.normed, n * d);
        read_host(&m.norm, |w| rms_norm_rows(last, w, eps, normed))?;
        let vocab = dw.lm_head.outputs();
        let logits = output(n * vocab, |logits| dense_rows(normed, &dw.lm_head, logits));
        Ok(Tensor::from_vec(logits, (n, vocab), &m.device)?)
    }
}
