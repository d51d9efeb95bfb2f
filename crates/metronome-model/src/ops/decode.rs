//! The decode kernels: forward only, each row computed alone in a fixed order so
//! that a sequence's result is bitwise the same whoever shares its step (cache
//! writes, attention over a slot's prefix, the decode-layout linear layer, SwiGLU).

use std::sync::OnceLock;

use candle_core::{CpuStorage, Layout, Tensor};

use super::{CpuOp3, FwdResult, Op3, Operand, SwiGlu, contiguous_f32, dot, fused_op_ran, output};
use crate::Result;

/// Where each token row of a cached forward (a decode step, or prompts being
/// prefilled) lives in one layer's paged key/value cache. The cache is a pool of
/// blocks of `block` rows; a slot's positions fill the blocks of its block table in
/// order, so position `p` of row `i` is cache row
/// `blocks[table[i] + p / block] * block + p % block` ([`DecodeRows::at`]). Row `i`'s
/// key and value go to its position `len[i] - 1`, and it attends to its `len[i]` cached
/// positions up to and including that one, in position order whatever blocks they lie
/// in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeRows<'a> {
    /// Where each row's block table starts in `blocks`.
    pub(crate) table: &'a [usize],
    /// The block tables, concatenated (block numbers in the cache's pool).
    pub(crate) blocks: &'a [u32],
    /// Rows per block.
    pub(crate) block: usize,
    pub(crate) len: &'a [usize],
    /// The step's index tensors, shared by its layers (the portable kernels build them
    /// on first use); `None` builds them at every call.
    pub(crate) index: Option<&'a StepIndex>,
}

/// The index tensors the portable and CUDA decode kernels derive from a step's
/// [`DecodeRows`]: the cache rows its keys and values are written to, the cache rows
/// each row's attention reads and the mask of their padding (portable), the rows
/// and their block tables (CUDA). The rows are the same in every layer, so each is
/// built on the host and uploaded once per step, not once per layer (twice per layer
/// for the writes), which on a GPU was a host loop and a copy per layer between kernel
/// launches.
#[derive(Debug, Default)]
pub(crate) struct StepIndex {
    pub(crate) write: OnceLock<Tensor>,
    pub(crate) gather: OnceLock<Tensor>,
    pub(crate) mask: OnceLock<Tensor>,
    /// The rows themselves, `[n, 2]` u32 (block-table start, length), and the block
    /// tables (u32), for the CUDA decode kernels.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read by the CUDA kernels only"))]
    pub(crate) rows: OnceLock<Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read by the CUDA kernels only"))]
    pub(crate) blocks: OnceLock<Tensor>,
}

impl StepIndex {
    /// The tensor in `cell`, built by `build` on first use; built every time without a cell.
    pub(crate) fn get(
        cell: Option<&OnceLock<Tensor>>,
        build: impl FnOnce() -> crate::Result<Tensor>,
    ) -> crate::Result<Tensor> {
        let Some(cell) = cell else { return build() };
        if let Some(t) = cell.get() {
            return Ok(t.clone());
        }
        let t = build()?;
        Ok(cell.get_or_init(|| t).clone())
    }
}

impl<'a> DecodeRows<'a> {
    /// Checks that `n` rows are described and that each row's positions lie in a cache
    /// of `cache_rows` rows. The rows of one slot (a prompt's, in a prefill) share its
    /// table, so the tables' entries are checked once over the span the rows read, not
    /// once per row: a 2,048-token prefill would otherwise read its slot's 128 entries
    /// 2,048 times in every op of every layer.
    pub(crate) fn check(&self, op: &str, n: usize, cache_rows: usize) -> candle_core::Result<()> {
        if self.table.len() != n || self.len.len() != n {
            candle_core::bail!("{op}: {} row placements for {n} rows", self.table.len().min(self.len.len()))
        }
        if self.block == 0 {
            candle_core::bail!("{op}: blocks of 0 rows")
        }
        let (mut first, mut end) = (usize::MAX, 0);
        for i in 0..n {
            let (start, l) = (self.table[i], self.len[i]);
            if l == 0 {
                candle_core::bail!("{op}: row {i} has no positions")
            }
            let need = l.div_ceil(self.block);
            match start.checked_add(need).filter(|&e| e <= self.blocks.len()) {
                Some(e) => (first, end) = (first.min(start), end.max(e)),
                None => candle_core::bail!(
                    "{op}: row {i} needs {need} blocks from entry {start} of {} in the block tables",
                    self.blocks.len()
                ),
            }
        }
        let pool = cache_rows / self.block;
        if let Some(&b) = self.blocks.get(first..end).into_iter().flatten().find(|&&b| b as usize >= pool) {
            candle_core::bail!(
                "{op}: a row reads block {b} of {} rows, past the cache's {cache_rows}",
                self.block
            )
        }
        Ok(())
    }

    /// Writes each row's new key (or value), `row(i)` (`width` values), into a layer's
    /// cache `data` at the row's last position. The rows were [checked](Self::check).
    #[inline]
    pub(crate) fn write<'s>(&self, data: &mut [f32], width: usize, row: impl Fn(usize) -> &'s [f32]) {
        for i in 0..self.len.len() {
            let at = self.at(i, self.len[i] - 1) * width;
            data[at..at + width].copy_from_slice(row(i));
        }
    }

    /// Each row's block-table start and length, interleaved, as the CUDA decode kernels
    /// read them (`[n, 2]` u32).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read by the CUDA kernels only"))]
    pub(crate) fn pairs(&self) -> crate::Result<Vec<u32>> {
        let mut v = Vec::with_capacity(2 * self.len.len());
        for (&t, &l) in self.table.iter().zip(self.len) {
            let (Ok(t), Ok(l)) = (u32::try_from(t), u32::try_from(l)) else {
                return Err(crate::Error::invalid("decode rows", "beyond u32"));
            };
            v.extend([t, l]);
        }
        Ok(v)
    }

    /// The cache row of row `i`'s position `p`.
    #[inline]
    pub(crate) fn at(&self, i: usize, p: usize) -> usize {
        self.blocks[self.table[i] + p / self.block] as usize * self.block + p % self.block
    }

    /// Row `i`'s cached positions in `data` (a layer's cache, `width` values a row), in
    /// position order: one slice per block, each a whole number of rows.
    #[inline]
    pub(crate) fn spans<'d>(
        &self,
        i: usize,
        data: &'d [f32],
        width: usize,
    ) -> impl ExactSizeIterator<Item = &'d [f32]> + use<'a, 'd> {
        let (len, block) = (self.len[i], self.block);
        let table = &self.blocks[self.table[i]..self.table[i] + len.div_ceil(block)];
        table.iter().enumerate().map(move |(b, &blk)| {
            let start = blk as usize * block;
            &data[start * width..(start + block.min(len - b * block)) * width]
        })
    }
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
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        fused_op_ran();
        let new = contiguous_f32(self.name(), s2, l2)?;
        let (n, kvh, hd) = l2.shape().dims3()?;
        let (rows, ckvh, chd) = l1.shape().dims3()?;
        if (ckvh, chd) != (kvh, hd) {
            candle_core::bail!("decode-write: rows {:?} do not fit cache {:?}", l2.dims(), l1.dims())
        }
        self.0.check(self.name(), n, rows)?;
        let (Some((c0, c1)), CpuStorage::F32(cache)) = (l1.contiguous_offsets(), s1) else {
            candle_core::bail!("decode-write needs a contiguous f32 cache")
        };
        let width = kvh * hd;
        self.0.write(&mut cache[c0..c1], width, |i| &new[i * width..(i + 1) * width]);
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
/// stays batch-invariant (docs/design.md §6). Forward only: decoding builds no graph.
#[derive(Debug)]
struct DecodeAttention<'a>(DecodeRows<'a>);

impl CpuOp3 for DecodeAttention<'_> {
    const NAME: &'static str = "decode-attention";

    fn forward(&self, [(s1, l1), (s2, l2), (s3, l3)]: [Operand<'_>; 3]) -> FwdResult {
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
        self.0.check(Self::NAME, n, rows)?;
        let q = contiguous_f32(Self::NAME, s1, l1)?;
        let k = contiguous_f32(Self::NAME, s2, l2)?;
        let v = contiguous_f32(Self::NAME, s3, l3)?;
        // Compiled for the instruction set `simd::dispatch` picks: the dot products run
        // as vectors of 8 lanes under AVX2, 16 under AVX-512 (the same for every row).
        let out = output(n * heads * hd, |out| attention_rows(self.0, (q, k, v), heads, kvh, hd, out));
        Ok((CpuStorage::F32(out), (n, heads * hd).into()))
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
        let weigh = |probs: &[f32], values: &[&[f32]], width: usize, off: usize, og: &mut [f32]| {
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
                            let mut ps = ps.iter();
                            for span in values {
                                for (vr, &p) in span.chunks_exact(width).zip(&mut ps) {
                                    acc = simd.mul_add_e_f32s(
                                        simd.splat_f32s(p),
                                        load(&vr[off + c * l..]),
                                        acc,
                                    );
                                }
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
/// probability-weighted sums of the values (accumulated in key order across the
/// row's blocks, `values` holding one slice per block) for the query heads that share
/// one key/value head (`probs` holds a row of keys per head). Per row and key/value
/// head those query heads are handled together, so each cached key is loaded once for
/// all of them. The order of every sum is the order of positions, whatever blocks
/// they lie in: a row's result does not depend on the cache's block size or on which
/// blocks it was given. Inlined into [`AttentionRows`]'s dispatch, so the closures
/// compile with the instruction set `pulp` detected.
#[inline(always)]
fn attention_rows_with(
    a: AttentionRows<'_>,
    dot: impl Fn(&[f32], &[f32]) -> f32,
    weigh: impl Fn(&[f32], &[&[f32]], usize, usize, &mut [f32]),
) {
    let AttentionRows { rows, q, k, v, heads, kvh, hd, out } = a;
    let n = rows.len.len();
    let rep = heads / kvh;
    let width = kvh * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    // A row's probabilities in the thread's buffer, its blocks' slices on the stack
    // (on the heap past `STACK_SPANS` blocks): a decode step allocates none of them.
    thread_local! {
        static PROBS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut probs = PROBS.take();
    let (mut key_stack, mut value_stack) = ([&[][..]; STACK_SPANS], [&[][..]; STACK_SPANS]);
    let (mut key_heap, mut value_heap) = (Vec::new(), Vec::new());
    for i in 0..n {
        let len = rows.len[i];
        let keys = spans_in(rows.spans(i, k, width), &mut key_stack, &mut key_heap);
        let values = spans_in(rows.spans(i, v, width), &mut value_stack, &mut value_heap);
        probs.clear();
        probs.resize(rep * len, 0f32);
        for g in 0..kvh {
            let off = g * hd;
            let heads_at = (i * heads + g * rep) * hd;
            let qg = &q[heads_at..heads_at + rep * hd];
            let mut j = 0;
            for span in keys {
                for kr in span.chunks_exact(width) {
                    let kr = &kr[off..off + hd];
                    for (r, qh) in qg.chunks_exact(hd).enumerate() {
                        probs[r * len + j] = dot(qh, kr) * scale;
                    }
                    j += 1;
                }
            }
            softmax_rows(&mut probs, len);
            weigh(&probs, values, width, off, &mut out[heads_at..heads_at + rep * hd]);
        }
    }
    PROBS.set(probs);
}

/// Blocks of a row up to which [`attention_rows_with`] lists their slices on the stack.
const STACK_SPANS: usize = 64;

/// `spans` as a slice: in `stack` when they fit, else in `heap`.
#[inline(always)]
fn spans_in<'b, 'd>(
    spans: impl ExactSizeIterator<Item = &'d [f32]>,
    stack: &'b mut [&'d [f32]; STACK_SPANS],
    heap: &'b mut Vec<&'d [f32]>,
) -> &'b [&'d [f32]] {
    let n = spans.len();
    if n <= STACK_SPANS {
        for (slot, span) in stack.iter_mut().zip(spans) {
            *slot = span;
        }
        &stack[..n]
    } else {
        heap.clear();
        heap.extend(spans);
        heap
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
/// in registers across the keys and the blocks they lie in (one fused multiply-add
/// chain per lane, in key order).
#[inline(always)]
fn weighted_values<S: pulp::Simd, const NV: usize>(
    simd: S,
    ps: &[f32],
    values: &[&[f32]],
    width: usize,
    off: usize,
    oh: &mut [f32],
) {
    let l = S::F32_LANES;
    let mut acc = [simd.splat_f32s(0.0); NV];
    let mut ps = ps.iter();
    for span in values {
        for (vr, &p) in span.chunks_exact(width).zip(&mut ps) {
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
        for (j, vr) in values.iter().flat_map(|span| span.chunks_exact(width)).enumerate() {
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

/// [`DecodeAttention`] on host buffers: queries `q` `[n, heads, head_dim]`, a layer's
/// cached keys and values `[rows, kv_heads, head_dim]`, into `out` `[n, heads *
/// head_dim]`. The rows were [checked](DecodeRows::check) against the cache.
#[allow(clippy::too_many_arguments, reason = "the shapes of the three operands")]
pub(crate) fn attention_rows(
    rows: DecodeRows<'_>,
    (q, k, v): (&[f32], &[f32], &[f32]),
    heads: usize,
    kvh: usize,
    hd: usize,
    out: &mut [f32],
) {
    crate::simd::dispatch(AttentionRows { rows, q, k, v, heads, kvh, hd, out });
}

/// Attention of a decode step's queries `q: [n, heads, head_dim]` over each row's
/// cached prefix in `keys`, `values: [rows, kv_heads, head_dim]` (see
/// [`DecodeAttention`]). Returns `[n, heads * head_dim]`, as
/// [`crate::Kernels::attention`] does.
pub(crate) fn decode_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    rows: DecodeRows<'_>,
) -> Result<Tensor> {
    Ok(q.contiguous()?.apply_op3_no_bwd(keys, values, &Op3(DecodeAttention(rows)))?)
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
    ///
    /// Transposed in tiles straight from each weight's storage into the stacked
    /// layout: a rollout worker builds this for every layer at every weight update, and
    /// as candle ops (a `cat`, an element-by-element strided copy, a copy to a `Vec`)
    /// it was about 1% of the TRL-matched run.
    pub(crate) fn stacked(ws: &[&Tensor], biases: &[&Tensor]) -> Result<Self> {
        let host = |w: &Tensor| -> Result<Tensor> {
            Ok(w.to_device(&candle_core::Device::Cpu)?.to_dtype(candle_core::DType::F32)?.contiguous()?)
        };
        let ws = ws.iter().map(|w| host(w)).collect::<Result<Vec<_>>>()?;
        let mut inputs = None;
        let mut outputs = 0;
        for w in &ws {
            let (out, inp) = w.dims2()?;
            if *inputs.get_or_insert(inp) != inp {
                return Err(crate::Error::invalid(
                    "decode weights",
                    "stacked weights differ in their inputs",
                ));
            }
            outputs += out;
        }
        let inputs = inputs.unwrap_or(0);
        // Tiles of TILE x TILE: both the rows read and the rows written stay in cache.
        const TILE: usize = 32;
        let data = output(inputs * outputs, |data| {
            let mut first = 0;
            for w in &ws {
                let (storage, layout) = w.storage_and_layout();
                let (candle_core::Storage::Cpu(CpuStorage::F32(src)), Some((a, b))) =
                    (&*storage, layout.contiguous_offsets())
                else {
                    unreachable!("made a contiguous f32 host tensor above")
                };
                let src = &src[a..b];
                let out = src.len().checked_div(inputs).unwrap_or(0);
                for o0 in (0..out).step_by(TILE) {
                    for i0 in (0..inputs).step_by(TILE) {
                        for o in o0..(o0 + TILE).min(out) {
                            for i in i0..(i0 + TILE).min(inputs) {
                                data[i * outputs + first + o] = src[o * inputs + i];
                            }
                        }
                    }
                }
                first += out;
            }
        });
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

    /// The product's rows (each weight's inputs).
    pub(crate) fn inputs(&self) -> usize {
        self.inputs
    }

    /// The product's columns (the stacked weights' outputs).
    pub(crate) fn outputs(&self) -> usize {
        self.outputs
    }
}

/// Rows per parallel task when a linear layer's rows are split across threads.
const DENSE_ROWS_PER_TASK: usize = 32;

/// `out = x @ w (+ b)` for the rows `x` of a decode step or prefill, on weights in
/// decode layout; `x` holds whole rows of `w.inputs()` values, `out` their
/// `w.outputs()` each.
///
/// candle's matmul on `x @ wᵀ` repacked the transposed weights on every call and chose
/// its kernel by the number of rows, so decoding padded every linear input to
/// `DECODE_MIN_ROWS` rows to stay batch-invariant. Here every output element is one
/// fused multiply-add chain over the inputs in index order, then `+ b`, whichever rows
/// and tile it is computed with: a row's result is bitwise independent of the batch at
/// any batch size, without padding. Rows are split across the current rayon pool when
/// it has more than one thread (the split does not change any result).
pub(crate) fn dense_rows(x: &[f32], w: &DenseWeight, out: &mut [f32]) {
    let (k, m) = (w.inputs, w.outputs);
    let n = x.len().checked_div(k).unwrap_or(0);
    if n >= 2 * DENSE_ROWS_PER_TASK && rayon::current_num_threads() > 1 {
        use rayon::prelude::*;
        x.par_chunks(DENSE_ROWS_PER_TASK * k)
            .zip(out.par_chunks_mut(DENSE_ROWS_PER_TASK * m))
            .for_each(|(x, out)| crate::simd::dispatch(DenseKernel { x, w, out }));
    } else {
        crate::simd::dispatch(DenseKernel { x, w, out });
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

/// `silu(gate) * up` from `gu` `[n, 2 * i]`, each row's gate then its up projection
/// (the product of a stacked gate/up [`DenseWeight`]), into `out` `[n, i]`; computed
/// as [`SwiGlu`] computes it.
pub(crate) fn swiglu_stacked_rows(gu: &[f32], i: usize, out: &mut [f32]) {
    crate::simd::dispatch(SwiGluRows { gu, out, i });
}

/// The loop of [`swiglu_stacked_rows`], compiled for the instruction set `simd::dispatch`
/// picks (with [`exp_vectorisable`], 8 lanes at a time under AVX2, 16 under AVX-512).
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
    y * pow2_integer(n)
}

/// `2^n` for an integer `n` in `[-126, 127]` (as an f32), built in the exponent bits:
/// `n + 127 + 2^23` is exact, and its low mantissa bits are `n + 127`, which the shift
/// moves into the exponent field (the high bits fall off). The same bits as
/// `(n as i32 + 127) << 23` without the float-to-int cast, whose saturating semantics
/// x86 has no vector instruction for: with the cast the compiler converted a vector's
/// 16 lanes one by one, a third of the time of every loop over [`exp_vectorisable`].
#[inline(always)]
fn pow2_integer(n: f32) -> f32 {
    f32::from_bits((n + (127.0 + 8_388_608.0)).to_bits() << 23)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::super::linear;
    use super::*;

    /// Deterministic values in `[-1, 1)`.
    fn values(seed: u64, n: usize) -> Vec<f32> {
        (0..n as u64)
            .map(|i| (metronome_core::mix64(seed * 1_000_003 + i) >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }

    /// `x @ d` through [`dense_rows`], as a tensor.
    fn forward(d: &DenseWeight, x: &Tensor) -> Vec<Vec<f32>> {
        let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut out = vec![f32::NAN; x.len() / d.inputs * d.outputs];
        dense_rows(&x, d, &mut out);
        out.chunks(d.outputs).map(<[f32]>::to_vec).collect()
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
            let got = forward(&d, &x);
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!((g - w).abs() < 1e-4, "{inputs}x{outputs} n={n}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn stacked_decode_layout_is_the_transpose_of_the_stacked_weights() {
        // Sizes that are and are not multiples of the transpose's tile.
        let ws = [(64, 40), (33, 40), (1, 40)]
            .iter()
            .enumerate()
            .map(|(k, &(o, i))| Tensor::from_vec(values(10 + k as u64, o * i), (o, i), &Device::Cpu).unwrap())
            .collect::<Vec<_>>();
        let d = DenseWeight::stacked(&ws.iter().collect::<Vec<_>>(), &[]).unwrap();
        let want = Tensor::cat(&ws, 0).unwrap().t().unwrap().contiguous().unwrap();
        assert_eq!((d.inputs, d.outputs), (40, 98));
        assert_eq!(d.data, want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let narrow = Tensor::zeros((3, 39), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = DenseWeight::stacked(&[&ws[0], &narrow], &[]).unwrap_err();
        assert!(err.to_string().contains("differ in their inputs"), "{err}");
    }

    #[test]
    fn decode_linear_rows_do_not_depend_on_the_batch() {
        let (_, _, d) = dense(128, 99, true);
        let xs = values(4, 70 * 128);
        let x = Tensor::from_vec(xs.clone(), (70, 128), &Device::Cpu).unwrap();
        let all = forward(&d, &x);
        // Each row alone, and the batch split across two threads (the parallel path).
        for r in [0, 3, 4, 69] {
            let one = Tensor::from_vec(xs[r * 128..(r + 1) * 128].to_vec(), (1, 128), &Device::Cpu).unwrap();
            assert_eq!(forward(&d, &one)[0], all[r], "row {r}");
        }
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let split = pool.install(|| forward(&d, &x));
        assert_eq!(split, all);
    }

    #[test]
    fn stacked_swiglu_matches_the_two_input_form() {
        let g = Tensor::from_vec(values(5, 3 * 6), (3, 6), &Device::Cpu).unwrap();
        let u = Tensor::from_vec(values(6, 3 * 6), (3, 6), &Device::Cpu).unwrap();
        let want = swiglu(&g, &u, 3).unwrap().to_vec2::<f32>().unwrap();
        let gu = Tensor::cat(&[&g, &u], 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut got = vec![f32::NAN; 3 * 6];
        swiglu_stacked_rows(&gu, 6, &mut got);
        for (g, w) in got.iter().zip(want.iter().flatten()) {
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
        for n in -126..=127 {
            assert_eq!(pow2_integer(n as f32).to_bits(), ((n + 127) << 23) as u32, "2^{n}");
        }
    }
}
