//! A whole decoder layer on host buffers, forward and backward, for the fused CPU
//! kernels: the same kernels the layer's fused ops run one by one (RMSNorm, the
//! products, rotary embeddings, the packed rows' attention, SwiGLU), called on slices,
//! with the layer's backward written out by hand.
//!
//! Composed from ops, a layer makes about twenty tensors forward and as many again
//! backward, each an `Arc`, a lock, a storage and, under a graph, a node, and a
//! buffer of up to `[positions, intermediate]` that the allocator hands back cold or
//! maps afresh. Here a layer's activations and intermediate gradients are plain
//! buffers borrowed from the model's [`Buffers`] and given back when the backward (or,
//! without one, the forward) is done with them, and the model attaches the output to
//! its input and weights by one node ([`crate::recompute::attach`]).
//!
//! Only the plain f32 layer runs here (no adapters, no biases, attention per segment);
//! [`crate::Model`] composes the ops for every other case.

use std::sync::{Arc, Mutex, PoisonError};

use super::attention::{Heads, attend, attend_grad};
use super::gemm::{Block, matmul_parallel};
use super::train::{RowPlans, SwiGluGradLoop, rms_norm_grad, rms_norm_rows};
use super::{RopeTables, SwiGluLoop, fused_op_ran, output, output_in};

/// The sizes of a layer's computation: `n` positions of `hidden` values, attention
/// heads of `hd` dimensions, an MLP `inter` wide.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerShape {
    pub(crate) n: usize,
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) hd: usize,
    pub(crate) inter: usize,
    pub(crate) eps: f32,
}

/// A layer's weights in Hugging Face's layouts (`[out, in]` for the projections), in
/// [`crate::model::Layer`]'s order of the gradients [`layer_backward`] returns.
#[derive(Clone, Copy)]
pub(crate) struct LayerWeights<'a> {
    pub(crate) input_norm: &'a [f32],
    pub(crate) post_norm: &'a [f32],
    pub(crate) q: &'a [f32],
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
    pub(crate) o: &'a [f32],
    pub(crate) gate: &'a [f32],
    pub(crate) up: &'a [f32],
    pub(crate) down: &'a [f32],
}

/// Host buffers a model's layers borrow for their activations and intermediate
/// gradients and give back, so that the next micro-batch finds them warm rather than
/// asking the allocator again for a few dozen buffers of up to megabytes each. It
/// keeps at most what one forward and backward of every layer hold at once (about a
/// dozen buffers per layer, what the graph of the composed ops kept until the
/// backward anyway), so a model's memory settles at its peak of a step, as a caching
/// allocator's does.
#[derive(Debug)]
pub(crate) struct Buffers {
    kept: Mutex<Vec<Vec<f32>>>,
    most: usize,
}

impl Buffers {
    /// A pool for a model of `layers` decoder layers.
    pub(crate) fn new(layers: usize) -> Self {
        Self { kept: Mutex::new(Vec::new()), most: 12 * layers + 16 }
    }

    /// A pool that keeps nothing: for an op called on its own (the composed ops'
    /// attention), whose buffers then come from the allocator and go back to it.
    pub(crate) fn unpooled() -> Self {
        Self { kept: Mutex::new(Vec::new()), most: 0 }
    }

    /// The smallest kept buffer that holds `n` elements, as it was given back, else a
    /// fresh one.
    fn take(&self, n: usize) -> Vec<f32> {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let best =
            kept.iter().enumerate().filter(|(_, b)| b.capacity() >= n).min_by_key(|(_, b)| b.capacity());
        best.map(|(i, _)| i).map(|i| kept.swap_remove(i)).unwrap_or_default()
    }

    /// A buffer of `n` elements, every one written by `fill` ([`output`]), in the
    /// smallest kept buffer that holds them, else a fresh one.
    pub(crate) fn output(&self, n: usize, fill: impl FnOnce(&mut [f32])) -> Vec<f32> {
        output_in(self.take(n), n, fill)
    }

    /// A buffer of `n` zeros, for sums.
    pub(crate) fn zeros(&self, n: usize) -> Vec<f32> {
        let mut b = self.take(n);
        b.clear();
        b.resize(n, 0.0);
        b
    }

    /// A buffer of `n` elements whose values are whatever it held: working space a
    /// kernel writes before it reads (only elements it never held before are zeroed).
    pub(crate) fn scratch(&self, n: usize) -> Vec<f32> {
        let mut b = self.take(n);
        b.resize(n, 0.0);
        b
    }

    /// An empty buffer with room for `n` elements, to be filled by pushing.
    pub(crate) fn room(&self, n: usize) -> Vec<f32> {
        let mut b = self.take(n);
        b.clear();
        b.reserve(n);
        b
    }

    /// Gives buffers back. A full pool keeps the larger of a buffer given and its
    /// smallest, so that it comes to hold the sizes of the largest micro-batch.
    pub(crate) fn give(&self, buffers: impl IntoIterator<Item = Vec<f32>>) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        for b in buffers {
            if b.capacity() == 0 {
                continue;
            }
            if kept.len() < self.most {
                kept.push(b);
            } else if let Some(smallest) = kept.iter_mut().min_by_key(|k| k.capacity())
                && smallest.capacity() < b.capacity()
            {
                *smallest = b;
            }
        }
    }
}

/// What [`layer_backward`] reads from the forward: the normed input, the rotated
/// queries and keys, the values, the attention's output, the residual stream after
/// it and its norm, and the MLP's gate and up projections. Dropped, it gives its
/// buffers back to the pool they came from.
pub(crate) struct Saved {
    pool: Arc<Buffers>,
    a: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    h: Vec<f32>,
    b: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
}

impl Drop for Saved {
    fn drop(&mut self) {
        let Saved { pool, a, q, k, v, att, h, b, g, u } = self;
        pool.give([a, q, k, v, att, h, b, g, u].map(std::mem::take));
    }
}

impl LayerShape {
    fn attention(self) -> Heads {
        Heads { n: self.n, heads: self.heads, kv_heads: self.kv_heads, hd: self.hd }
    }
}

/// `y = x · wᵀ` for `x: [n, input]` and `w: [output, input]`, written whole.
fn linear(y: &mut [f32], x: &[f32], w: &[f32], n: usize, input: usize, out: usize) {
    matmul_parallel(
        y,
        Block::rows(0, n, out, out),
        false,
        x,
        Block::rows(0, n, input, input),
        w,
        Block::rows(0, out, input, input).t(),
        1.0,
    );
}

/// `dx (+)= dy · w` for `dy: [n, output]` and `w: [output, input]`.
fn linear_input_grad(
    dx: &mut [f32],
    accumulate: bool,
    dy: &[f32],
    w: &[f32],
    n: usize,
    input: usize,
    out: usize,
) {
    matmul_parallel(
        dx,
        Block::rows(0, n, input, input),
        accumulate,
        dy,
        Block::rows(0, n, out, out),
        w,
        Block::rows(0, out, input, input),
        1.0,
    );
}

/// `dw = dyᵀ · x`, `[output, input]`, for `dy: [n, output]` and `x: [n, input]`: a
/// weight's gradient, which leaves as a tensor (not from the pool).
fn linear_weight_grad(dy: &[f32], x: &[f32], n: usize, input: usize, out: usize) -> Vec<f32> {
    output(out * input, |dw| {
        matmul_parallel(
            dw,
            Block::rows(0, out, input, input),
            false,
            dy,
            Block::rows(0, n, out, out).t(),
            x,
            Block::rows(0, n, input, input),
            1.0,
        );
    })
}

/// `a + b`, element by element, into `a`.
fn add_into(a: &mut [f32], b: &[f32]) {
    for (a, b) in a.iter_mut().zip(b) {
        *a += b;
    }
}

/// The layer on `x: [n, hidden]`: its output, and with `keep` what its backward
/// needs, in buffers of `pool`. The values are those of the composed fused ops (the
/// same kernels in the same order; the tests compare them).
pub(crate) fn layer_forward(
    s: LayerShape,
    w: &LayerWeights<'_>,
    x: &[f32],
    rope: &RopeTables,
    plans: &RowPlans,
    pool: &Arc<Buffers>,
    keep: bool,
) -> candle_core::Result<(Vec<f32>, Option<Saved>)> {
    fused_op_ran();
    let (n, d, m) = (s.n, s.hidden, s.inter);
    let (qw, kw) = (s.heads * s.hd, s.kv_heads * s.hd);
    // A projection of the `n` rows, in a buffer of the pool.
    let project = |x: &[f32], w: &[f32], input: usize, out: usize| {
        pool.output(n * out, |y| linear(y, x, w, n, input, out))
    };
    let a = pool.output(n * d, |a| rms_norm_rows(x, w.input_norm, s.eps, a));
    let rotate = |t: Vec<f32>, width: usize| {
        let r = pool.output(n * width, |r| rope.rotate_rows(&t, width, s.hd, r));
        pool.give([t]);
        r
    };
    let q = rotate(project(&a, w.q, d, qw), qw);
    let k = rotate(project(&a, w.k, d, kw), kw);
    let v = project(&a, w.v, d, kw);
    let att = attend(&q, &k, &v, s.attention(), plans, pool)?;
    let mut h = project(&att, w.o, qw, d);
    // x + o, as the composed ops add them (IEEE addition commutes: the same bits).
    add_into(&mut h, x);
    let b = pool.output(n * d, |b| rms_norm_rows(&h, w.post_norm, s.eps, b));
    let g = project(&b, w.gate, d, m);
    let u = project(&b, w.up, d, m);
    let act = pool.output(n * m, |out| crate::simd::dispatch(SwiGluLoop { g: &g, u: &u, out }));
    // The output leaves as a tensor: not from the pool.
    let mut y = output(n * d, |y| linear(y, &act, w.down, n, m, d));
    pool.give([act]);
    add_into(&mut y, &h);
    let saved = Saved { pool: Arc::clone(pool), a, q, k, v, att, h, b, g, u };
    Ok((y, keep.then_some(saved)))
}

/// The gradients of [`layer_forward`] from the output's gradient `dy`: of the input,
/// and of the weights in [`LayerWeights`]' order (input norm, post-attention norm, q,
/// k, v, o, gate, up, down).
pub(crate) fn layer_backward(
    s: LayerShape,
    w: &LayerWeights<'_>,
    x: &[f32],
    rope: &RopeTables,
    plans: &RowPlans,
    saved: &Saved,
    dy: &[f32],
) -> candle_core::Result<(Vec<f32>, [Vec<f32>; 9])> {
    let (n, d, m) = (s.n, s.hidden, s.inter);
    let (qw, kw) = (s.heads * s.hd, s.kv_heads * s.hd);
    let Saved { pool, a, q, k, v, att, h, b, g, u } = saved;
    // MLP: y = h + down(silu(g) ⊙ u), g = gate(b), u = up(b), b = norm(h).
    let act = pool.output(n * m, |out| crate::simd::dispatch(SwiGluLoop { g, u, out }));
    let d_down = linear_weight_grad(dy, &act, n, m, d);
    let d_act = pool.output(n * m, |da| linear_input_grad(da, false, dy, w.down, n, m, d));
    let dgu = pool.output(2 * n * m, |both| {
        let (dg, du) = both.split_at_mut(n * m);
        crate::simd::dispatch(SwiGluGradLoop { g, u, dy: &d_act, dg, du });
    });
    let (dg, du) = dgu.split_at(n * m);
    let d_gate = linear_weight_grad(dg, b, n, d, m);
    let d_up = linear_weight_grad(du, b, n, d, m);
    let mut db = pool.output(n * d, |db| linear_input_grad(db, false, dg, w.gate, n, d, m));
    linear_input_grad(&mut db, true, du, w.up, n, d, m);
    // dh = dy + norm'(h)·db.
    let mut d_post = vec![0f32; d];
    let mut dh = pool.output(n * d, |dh| rms_norm_grad(h, w.post_norm, &db, s.eps, dh, &mut d_post));
    add_into(&mut dh, dy);
    // Attention: h = x + o(att), att = attend(rope(q(a)), rope(k(a)), v(a)).
    let d_o = linear_weight_grad(&dh, att, n, qw, d);
    let d_att = pool.output(n * qw, |da| linear_input_grad(da, false, &dh, w.o, n, qw, d));
    let [dq_r, dk_r, dv] = attend_grad([q, k, v, att, &d_att], s.attention(), plans, pool)?;
    let dq = pool.output(n * qw, |r| rope.rotate_rows_back(&dq_r, qw, s.hd, r));
    let dk = pool.output(n * kw, |r| rope.rotate_rows_back(&dk_r, kw, s.hd, r));
    let d_q = linear_weight_grad(&dq, a, n, d, qw);
    let d_k = linear_weight_grad(&dk, a, n, d, kw);
    let d_v = linear_weight_grad(&dv, a, n, d, kw);
    let mut da = pool.output(n * d, |da| linear_input_grad(da, false, &dq, w.q, n, d, qw));
    linear_input_grad(&mut da, true, &dk, w.k, n, d, kw);
    linear_input_grad(&mut da, true, &dv, w.v, n, d, kw);
    // dx = dh + norm'(x)·da; it leaves as a tensor: not from the pool.
    let mut d_input = vec![0f32; d];
    let mut dx = output(n * d, |dx| rms_norm_grad(x, w.input_norm, &da, s.eps, dx, &mut d_input));
    add_into(&mut dx, &dh);
    pool.give([act, d_act, dgu, db, dh, d_att, dq_r, dk_r, dv, dq, dk, da]);
    Ok((dx, [d_input, d_post, d_q, d_k, d_v, d_o, d_gate, d_up, d_down]))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::{Device, Tensor, Var};
    use metronome_core::{PackedRow, Segment};

    use super::*;
    use crate::ops::{
        apply_rope, fused_linear, noise, packed_attention, rms_norm, rope_tables, segment_plans, swiglu_train,
    };

    /// A pool hands out the smallest kept buffer that holds a request, and a full pool
    /// keeps the larger buffers: it comes to hold the largest micro-batch's sizes.
    #[test]
    fn a_full_pool_keeps_its_largest_buffers() {
        let pool = Buffers::new(0);
        assert_eq!(pool.most, 16);
        pool.give((1..=20).map(|c| Vec::with_capacity(c * 8)));
        let mut kept: Vec<usize> = pool.kept.lock().unwrap().iter().map(Vec::capacity).collect();
        kept.sort_unstable();
        assert_eq!(kept, (5..=20).map(|c| c * 8).collect::<Vec<_>>());
        let b = pool.output(100, |b| b.fill(1.0));
        assert_eq!((b.len(), b.capacity()), (100, 104), "the smallest buffer holding 100");
        let fresh = pool.output(1000, |b| b.fill(2.0));
        assert_eq!(fresh.len(), 1000);
        assert_eq!(pool.kept.lock().unwrap().len(), 15, "a request no kept buffer holds takes none");
    }

    /// Sums start from zeros in a buffer that held other values; working space keeps
    /// them (its kernels write before they read) and has the length asked; a buffer
    /// for pushing comes empty; a pool that keeps nothing drops what it is given.
    #[test]
    fn pool_buffers_are_zeroed_only_for_sums() {
        let pool = Buffers::new(0);
        pool.give([vec![7.0; 8]]);
        assert_eq!(pool.zeros(6), vec![0.0; 6]);
        let mut held = Vec::with_capacity(16);
        held.resize(8, 7.0);
        pool.give([held]);
        assert_eq!(pool.scratch(10), [[7.0; 8].as_slice(), &[0.0; 2]].concat(), "longer than it was");
        pool.give([vec![7.0; 8]]);
        let room = pool.room(8);
        assert!(room.is_empty() && room.capacity() >= 8);
        let unpooled = Buffers::unpooled();
        unpooled.give([vec![1.0; 4]]);
        assert!(unpooled.kept.lock().unwrap().is_empty());
    }

    /// Two packed rows: a prompt and two responses that see it, and a lone sequence
    /// restarting its positions, as the trainer packs groups.
    fn rows() -> Vec<PackedRow> {
        let shared = PackedRow {
            tokens: vec![0; 12],
            positions: (0..5).chain(5..9).chain(5..8).collect(),
            segments: vec![
                Segment { start: 0, len: 5, parent: None },
                Segment { start: 5, len: 4, parent: Some(0) },
                Segment { start: 9, len: 3, parent: Some(0) },
            ],
        };
        let lone = PackedRow {
            tokens: vec![0; 7],
            positions: (0..7).collect(),
            segments: vec![Segment { start: 0, len: 7, parent: None }],
        };
        vec![shared, lone]
    }

    /// The layer on host buffers against the fused ops composed as the model composes
    /// them (differentiated by candle): the output bit for bit (the same kernels in the
    /// same order), and every gradient within 1e-5 of the largest (the host backward
    /// sums a tensor's contributions in its own order).
    #[test]
    fn a_layer_on_host_buffers_is_the_fused_ops_composed() {
        let dev = Device::Cpu;
        let s = LayerShape { n: 19, hidden: 16, heads: 4, kv_heads: 2, hd: 4, inter: 24, eps: 1e-5 };
        let (d, m, qw, kw) = (s.hidden, s.inter, s.heads * s.hd, s.kv_heads * s.hd);
        let rows = rows();
        let positions: Vec<u32> = rows.iter().flat_map(|r| r.positions.clone()).collect();
        let rope = rope_tables(&positions, s.hd, 10_000.0);
        let plans: Arc<RowPlans> =
            Arc::new(rows.iter().map(|r| (r.len(), segment_plans(r, &dev).unwrap())).collect());
        let var = |seed: u64, n: usize, shape: &[usize], scale: f32| {
            let v: Vec<f32> = noise(seed, n).into_iter().map(|x| x * scale).collect();
            Var::from_vec(v, shape, &dev).unwrap()
        };
        let x = var(1, s.n * d, &[s.n, d], 1.0);
        let norm = |seed| {
            Var::from_vec(noise(seed, d).into_iter().map(|x| 1.0 + x / 8.0).collect(), d, &dev).unwrap()
        };
        let ws = [
            norm(2),
            norm(3),
            var(4, qw * d, &[qw, d], 0.25),
            var(5, kw * d, &[kw, d], 0.25),
            var(6, kw * d, &[kw, d], 0.25),
            var(7, d * qw, &[d, qw], 0.25),
            var(8, m * d, &[m, d], 0.25),
            var(9, m * d, &[m, d], 0.25),
            var(10, d * m, &[d, m], 0.25),
        ];
        let r = Tensor::from_vec(noise(11, s.n * d), (s.n, d), &dev).unwrap();

        // Composed, as `Model::layer` composes the fused ops.
        let [wi, wp, wq, wk, wv, wo, wg, wu, wd] = ws.each_ref().map(Var::as_tensor);
        let x_t = x.as_tensor();
        let a = rms_norm(x_t, wi, f64::from(s.eps)).unwrap();
        let q =
            apply_rope(&fused_linear(&a, wq, None).unwrap().reshape((s.n, s.heads, s.hd)).unwrap(), &rope)
                .unwrap();
        let k =
            apply_rope(&fused_linear(&a, wk, None).unwrap().reshape((s.n, s.kv_heads, s.hd)).unwrap(), &rope)
                .unwrap();
        let v = fused_linear(&a, wv, None).unwrap().reshape((s.n, s.kv_heads, s.hd)).unwrap();
        let att = packed_attention(&q, &k, &v, &plans).unwrap();
        let h = (x_t + fused_linear(&att, wo, None).unwrap()).unwrap();
        let b = rms_norm(&h, wp, f64::from(s.eps)).unwrap();
        let act =
            swiglu_train(&fused_linear(&b, wg, None).unwrap(), &fused_linear(&b, wu, None).unwrap()).unwrap();
        let y = (&h + fused_linear(&act, wd, None).unwrap()).unwrap();
        let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();

        // On host buffers.
        let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let wv: Vec<Vec<f32>> = ws.iter().map(|w| host(w.as_tensor())).collect();
        let w = LayerWeights {
            input_norm: &wv[0],
            post_norm: &wv[1],
            q: &wv[2],
            k: &wv[3],
            v: &wv[4],
            o: &wv[5],
            gate: &wv[6],
            up: &wv[7],
            down: &wv[8],
        };
        let xs = host(x_t);
        let pool = Arc::new(Buffers::new(1));
        let (got, saved) = layer_forward(s, &w, &xs, &rope, &plans, &pool, true).unwrap();
        assert_eq!(got, host(&y), "the output");
        let (plain, none) = layer_forward(s, &w, &xs, &rope, &plans, &pool, false).unwrap();
        assert!(none.is_none());
        assert_eq!(plain, got, "the output without what the backward keeps");
        let saved = saved.unwrap();
        let (dx, dws) = layer_backward(s, &w, &xs, &rope, &plans, &saved, &host(&r)).unwrap();
        // Again, in buffers the pool got back from the first backward and the forward
        // without a backward: the same bits.
        let kept = pool.kept.lock().unwrap().len();
        assert!(kept >= 12, "the pool kept {kept} buffers");
        let (dx2, dws2) = layer_backward(s, &w, &xs, &rope, &plans, &saved, &host(&r)).unwrap();
        assert!(dx2 == dx && dws2 == dws, "a backward in reused buffers differs");
        drop(saved);

        let close = |what: &str, got: &[f32], want: &Tensor| {
            let want = host(want);
            assert_eq!(got.len(), want.len(), "{what}: length");
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
            assert!(scale > 0.0 && worst <= 1e-5 * scale, "{what}: off by {worst} at a scale of {scale}");
        };
        close("dx", &dx, grads.get(x_t).unwrap());
        let names = ["input norm", "post norm", "q", "k", "v", "o", "gate", "up", "down"];
        for ((name, got), w) in names.iter().zip(&dws).zip(&ws) {
            close(name, got, grads.get(w.as_tensor()).unwrap());
        }
    }
}
