//! The network's kernels on candle: the training kernels (differentiable, fused with
//! their own backward) in `train`, the attention of packed rows' segments over their
//! causal blocks in `attention` (on `gemm`'s products of strided blocks, `gemm`), the
//! decode kernels (forward only, batch-invariant) in `decode`, the linear layers a
//! decoder layer is made of in `linear` (its projections by name, the plain and the
//! frozen-weight product), and what both use here (rotary embeddings and their tables'
//! copy on a device, the SwiGLU forward, the fixed-lane dot product, access to
//! custom-op operands, and `read_host`/`write_host`, through which a frozen model's
//! decode step runs the kernels' loops on a tensor's elements in place).
//!
//! candle-nn's fused `softmax_last_dim`, `rms_norm` and `RmsNorm::forward` have no
//! backward and silently cut gradients (docs/design.md §6), so the training
//! forward is written from fused ops with their own backward or from candle-core
//! primitives that all have one. Decoding builds no graph: its kernels are forward
//! only and fix their reduction order, so a row's result does not depend on the rows
//! that share its step.

mod attention;
mod decode;
// The CUDA flash attention's tiles: built on the host for `src/cuda.rs`, tested here.
#[cfg(any(feature = "cuda", test))]
mod flash;
mod gemm;
mod layer;
mod linear;
mod train;

use candle_core::{CpuStorage, Device, Layout, Shape, Tensor};

pub(crate) use attention::packed_attention;
pub(crate) use decode::{
    DecodeRows, DenseWeight, StepIndex, attention_rows, decode_attention, dense_rows, swiglu,
    swiglu_stacked_rows, write_decode_rows,
};
#[cfg(feature = "cuda")]
pub(crate) use flash::{FlashTiles, TILE};
pub(crate) use layer::{Buffers, LayerShape, LayerWeights, layer_backward, layer_forward};
pub use linear::Projection;
pub(crate) use linear::{frozen_linear, fused_linear, linear};
pub(crate) use train::{
    RowIndex, RowMasks, RowPlans, masked_softmax, rms_norm, rms_norm_rows, segment_plans, softmax_last_dim,
    swiglu_train, target_columns_grad, target_logprobs_entropy, target_stats,
};
#[cfg(test)]
pub(crate) use train::{SegmentPlan, log_softmax_last_dim};

use crate::{Error, Result};

/// Counts a fused CPU op that ran on this thread: every `cpu_fwd` of `ops/` calls it
/// first, so that the kernel-seam test (`kernel_seam.rs`) can check that
/// [`crate::Kernels::Portable`] runs none of them (CI's portable run on the CPU is then
/// the arithmetic a GPU runs). Outside tests it does nothing.
#[inline(always)]
fn fused_op_ran() {
    #[cfg(test)]
    FUSED_OPS_RUN.with(|n| n.set(n.get() + 1));
}

#[cfg(test)]
thread_local! {
    /// The fused CPU ops [`fused_op_ran`] counted on this thread.
    static FUSED_OPS_RUN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many fused CPU ops have run on this thread so far.
#[cfg(test)]
pub(crate) fn fused_ops_run() -> u64 {
    FUSED_OPS_RUN.with(std::cell::Cell::get)
}

/// What the CPU forward of a custom op returns: its output and the output's shape.
type FwdResult = candle_core::Result<(CpuStorage, Shape)>;

/// The f32 elements of a two-input custom op's operands, which must be contiguous.
fn contiguous_f32_pair<'a>(
    op: &str,
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
) -> candle_core::Result<(&'a [f32], &'a [f32])> {
    let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
        candle_core::bail!("{op} needs contiguous inputs")
    };
    Ok((&s1.as_slice::<f32>()?[a0..a1], &s2.as_slice::<f32>()?[b0..b1]))
}

/// One operand of a custom op's CPU forward: its storage and layout.
type Operand<'a> = (&'a CpuStorage, &'a Layout);

/// A three-input op that runs on the CPU, made a [`candle_core::CustomOp3`] by [`Op3`]
/// (which spells out candle's six-argument forward once for every such op).
trait CpuOp3: Send + Sync {
    /// The op's name, as its errors give it.
    const NAME: &'static str;

    /// The output and its shape from the three operands.
    fn forward(&self, operands: [Operand<'_>; 3]) -> FwdResult;
}

/// A [`CpuOp3`] as a candle op.
#[derive(Debug)]
struct Op3<T>(T);

impl<T: CpuOp3> candle_core::CustomOp3 for Op3<T> {
    fn name(&self) -> &'static str {
        T::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> FwdResult {
        fused_op_ran();
        self.0.forward([(s1, l1), (s2, l2), (s3, l3)])
    }
}

/// A custom op's fresh output of `n` elements, every one of which `fill` writes.
///
/// `vec![0.0; n]` zero-fills the buffer before the kernel overwrites it: with the
/// allocator handing back freed memory (no fresh zero pages) that was a `memset` of
/// every output, about 3% of the TRL-matched run. Release builds skip it, as candle's
/// own `alloc_uninit` does for its ops. Builds with debug assertions (the tests) fill
/// the buffer with a signalling NaN, which no arithmetic produces, and check that
/// `fill` left none of it: a kernel that misses an element fails there, not silently
/// in release.
pub(crate) fn output(n: usize, fill: impl FnOnce(&mut [f32])) -> Vec<f32> {
    output_in(Vec::new(), n, fill)
}

/// [`output`] in the allocation of `out` (whose contents are dropped), grown if it
/// holds fewer than `n` elements.
#[allow(
    unsafe_code,
    reason = "an output buffer without the zero fill; `fill` writes it whole (checked in tests)"
)]
pub(crate) fn output_in(mut out: Vec<f32>, n: usize, fill: impl FnOnce(&mut [f32])) -> Vec<f32> {
    out.clear();
    if cfg!(debug_assertions) {
        const UNWRITTEN: u32 = 0x7fa5_a5a5;
        out.resize(n, f32::from_bits(UNWRITTEN));
        fill(&mut out);
        let left = out.iter().position(|x| x.to_bits() == UNWRITTEN);
        assert!(left.is_none(), "a fused op left element {left:?} of its {n}-element output unwritten");
        return out;
    }
    out.reserve(n);
    // SAFETY: the slice covers the `n` elements the allocation holds, aligned for f32;
    // `fill` only writes them (every kernel passed here assigns each element before it
    // reads it, which the tests check above), and `set_len` follows, so no
    // uninitialised element is ever read. If `fill` panics, `out` is dropped with
    // length 0.
    unsafe {
        fill(std::slice::from_raw_parts_mut(out.as_mut_ptr(), n));
        out.set_len(n);
    }
    out
}

/// `a · b` summed in eight fixed lanes, then a fixed tree: loops over it vectorise,
/// and the order of the sum is the code's, not the instruction set's, so AVX2 and
/// AVX-512 give the same bits (no multiply-add is fused: Rust never contracts them).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
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

/// The contiguous f32 elements of one custom-op operand.
fn contiguous_f32<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let Some((a0, a1)) = l.contiguous_offsets() else { candle_core::bail!("{op} needs contiguous inputs") };
    Ok(&s.as_slice::<f32>()?[a0..a1])
}

/// Runs `read` on the elements of `t`, a contiguous f32 tensor on the CPU, in place
/// (no copy, no tensor made).
pub(crate) fn read_host<R>(t: &Tensor, read: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(read(&v[a..b])),
        _ => Err(Error::invalid("host kernels", format!("need a contiguous f32 CPU tensor, not {t:?}"))),
    }
}

/// [`read_host`] of several tensors at once.
pub(crate) fn read_hosts<const N: usize, R>(
    ts: [&Tensor; N],
    read: impl FnOnce([&[f32]; N]) -> R,
) -> Result<R> {
    let guards = ts.map(Tensor::storage_and_layout);
    let mut slices: [&[f32]; N] = [&[]; N];
    for ((slice, (storage, layout)), t) in slices.iter_mut().zip(&guards).zip(ts) {
        match (&**storage, layout.contiguous_offsets()) {
            (candle_core::Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => *slice = &v[a..b],
            _ => {
                return Err(Error::invalid(
                    "host kernels",
                    format!("need a contiguous f32 CPU tensor, not {t:?}"),
                ));
            }
        }
    }
    Ok(read(slices))
}

/// Runs `write` on the elements of `t`, a contiguous f32 tensor on the CPU, in place.
pub(crate) fn write_host(t: &Tensor, write: impl Fn(&mut [f32])) -> Result<()> {
    struct Write<F>(F);
    impl<F: Fn(&mut [f32])> candle_core::InplaceOp1 for Write<F> {
        fn name(&self) -> &'static str {
            "host-write"
        }

        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
            fused_op_ran();
            let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
                candle_core::bail!("host-write needs a contiguous f32 tensor")
            };
            (self.0)(&mut v[a..b]);
            Ok(())
        }
    }
    Ok(t.inplace_op1(&Write(write))?)
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

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> FwdResult {
        fused_op_ran();
        let Some((a0, a1)) = l.contiguous_offsets() else {
            candle_core::bail!("rope needs a contiguous input")
        };
        let x = &s.as_slice::<f32>()?[a0..a1];
        let (n, heads, hd) = l.shape().dims3()?;
        let half = hd / 2;
        if hd % 2 != 0 {
            candle_core::bail!("rope: head dimension {hd} is odd; rotary needs pairs")
        }
        if self.cos.len() != n * half {
            candle_core::bail!("rope: tables for {} positions, input has {n}", self.cos.len() / half.max(1))
        }
        let sign = if self.inverse { -1.0f32 } else { 1.0 };
        let out = output(x.len(), |out| rope_rows(x, heads * hd, hd, (&self.cos, &self.sin), sign, out));
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let inv = Rope { inverse: !self.inverse, ..self.clone() };
        Ok(Some(g.contiguous()?.apply_op1(inv)?))
    }
}

/// [`Rope`]'s rotation of rows of heads of `head_dim` values: row `p`'s heads are the
/// first `out.len() / n` values of `x[p * stride..]` (a row of a wider product, such as
/// the query part of a stacked query/key/value row), its rotated heads row `p` of
/// `out`; `sign` -1 rotates back. Tables `[n, head_dim / 2]` give the rows' angles.
fn rope_rows(x: &[f32], stride: usize, hd: usize, tables: (&[f32], &[f32]), sign: f32, out: &mut [f32]) {
    crate::simd::dispatch(RopeRows { x, stride, hd, tables, sign, out });
}

/// The loop of [`rope_rows`], compiled for the instruction set `simd::dispatch` picks
/// (element by element, so every level gives the same bits; as plain code it ran on
/// SSE's four lanes).
struct RopeRows<'a> {
    x: &'a [f32],
    stride: usize,
    hd: usize,
    tables: (&'a [f32], &'a [f32]),
    sign: f32,
    out: &'a mut [f32],
}

impl pulp::WithSimd for RopeRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let RopeRows { x, stride, hd, tables: (cos, sin), sign, out } = self;
        let half = hd / 2;
        let n = cos.len() / half.max(1);
        let width = out.len() / n.max(1);
        for p in 0..n {
            let c = &cos[p * half..(p + 1) * half];
            let sn = &sin[p * half..(p + 1) * half];
            let (xr, or) = (&x[p * stride..p * stride + width], &mut out[p * width..(p + 1) * width]);
            for (xh, oh) in xr.chunks_exact(hd).zip(or.chunks_exact_mut(hd)) {
                let (x1, x2) = xh.split_at(half);
                let (o1, o2) = oh.split_at_mut(half);
                for i in 0..half {
                    let s = sign * sn[i];
                    o1[i] = x1[i] * c[i] - x2[i] * s;
                    o2[i] = x2[i] * c[i] + x1[i] * s;
                }
            }
        }
    }
}

/// Rotary tables for explicit positions: `cos` and `sin`, each `[n, head_dim / 2]`,
/// computed in f32 the way `transformers` does (`inv_freq = 1 / theta^(2i/d)`, then
/// `position * inv_freq`), so positions that restart mid-row rotate exactly as
/// separately decoded sequences would.
pub(crate) fn rope_tables(positions: &[u32], head_dim: usize, theta: f64) -> RopeTables {
    let mut tables = RopeTables::default();
    tables.refill(positions, head_dim, theta);
    tables
}

/// Host cos/sin tables of [`rope_tables`], `[n, head_dim / 2]` each, and their copy on
/// a device once the portable kernels ask for it ([`RopeTables::on`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct RopeTables {
    cos: std::sync::Arc<Vec<f32>>,
    sin: std::sync::Arc<Vec<f32>>,
    /// `1 / theta^(2i/d)`, kept for the next [`RopeTables::refill`].
    inv_freq: Vec<f32>,
    device: DeviceTables,
}

/// Rotary tables on a device, built once per forward from the host tables.
#[derive(Debug, Default, Clone)]
struct DeviceTables(std::sync::Arc<std::sync::OnceLock<(Tensor, Tensor)>>);

impl RopeTables {
    /// The tables of [`rope_tables`] for `positions`, in these tables' buffers where no
    /// clone holds them (a decode step refills its cache's tables without allocating).
    pub(crate) fn refill(&mut self, positions: &[u32], head_dim: usize, theta: f64) {
        let half = head_dim / 2;
        let theta = theta as f32;
        self.inv_freq.clear();
        self.inv_freq.extend((0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)));
        let fresh = |v: &mut std::sync::Arc<Vec<f32>>| match std::sync::Arc::get_mut(v) {
            Some(v) => v.clear(),
            None => *v = std::sync::Arc::default(),
        };
        fresh(&mut self.cos);
        fresh(&mut self.sin);
        let (cos, sin) = (std::sync::Arc::make_mut(&mut self.cos), std::sync::Arc::make_mut(&mut self.sin));
        cos.reserve(positions.len() * half);
        sin.reserve(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        match std::sync::Arc::get_mut(&mut self.device.0) {
            Some(uploaded) => drop(uploaded.take()),
            None => self.device = DeviceTables::default(),
        }
    }

    /// The host tables `[n, half]`, cosines and sines.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read by the CUDA graphs only"))]
    pub(crate) fn host(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Makes `cos` and `sin` (`[n, 1, half]`, holding these tables) the tables
    /// [`RopeTables::on`] returns until the next refill, unless it made its own already.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "set by the CUDA graphs only"))]
    pub(crate) fn set_on_device(&self, cos: Tensor, sin: Tensor) {
        let _ = self.device.0.set((cos, sin));
    }

    /// `cos` and `sin` as `[n, 1, half]` tensors on `device` (uploaded on first use).
    pub(crate) fn on(&self, device: &Device, n: usize, half: usize) -> Result<(Tensor, Tensor)> {
        if self.cos.len() != n * half {
            return Err(Error::invalid(
                "rope",
                format!("tables for {} values, input needs {}", self.cos.len(), n * half),
            ));
        }
        if let Some(t) = self.device.0.get()
            && t.0.device().same_device(device)
        {
            return Ok(t.clone());
        }
        let up = |v: &[f32]| Tensor::from_slice(v, (n, 1, half), device);
        let t = (up(&self.cos)?, up(&self.sin)?);
        let _ = self.device.0.set(t.clone());
        Ok(t)
    }
}

impl RopeTables {
    /// Rotates the heads of host rows as [`apply_rope`] does (the same bits): row `p`'s
    /// `out.len() / n` values from `x[p * stride..]` (e.g. the key part of a stacked
    /// query/key/value row) to row `p` of `out`, for the tables' `n` positions.
    pub(crate) fn rotate_rows(&self, x: &[f32], stride: usize, head_dim: usize, out: &mut [f32]) {
        rope_rows(x, stride, head_dim, (&self.cos, &self.sin), 1.0, out);
    }

    /// The inverse of [`RopeTables::rotate_rows`] (the rotation by the negated angles,
    /// which is also its backward), as [`apply_rope`]'s backward computes it.
    pub(crate) fn rotate_rows_back(&self, x: &[f32], stride: usize, head_dim: usize, out: &mut [f32]) {
        rope_rows(x, stride, head_dim, (&self.cos, &self.sin), -1.0, out);
    }
}

/// Applies rotary embeddings to `x: [n, heads, head_dim]` (Hugging Face's
/// rotate-half convention) with tables from [`rope_tables`].
pub(crate) fn apply_rope(x: &Tensor, t: &RopeTables) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(Rope { cos: t.cos.clone(), sin: t.sin.clone(), inverse: false })?)
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

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> FwdResult {
        fused_op_ran();
        let (g, u) = contiguous_f32_pair(self.name(), (s1, l1), (s2, l2))?;
        if l1.dims() != l2.dims() {
            candle_core::bail!("swiglu: gate {:?} and up {:?} differ in shape", l1.dims(), l2.dims())
        }
        let cols = l1.dims().last().copied().unwrap_or(1);
        let live = self.rows.saturating_mul(cols).min(g.len());
        let out = output(g.len(), |out| {
            let (live, padding) = out.split_at_mut(live);
            crate::simd::dispatch(SwiGluLoop { g, u, out: live });
            padding.fill(0.0);
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// `out = silu(g) * u` element by element, compiled for the instruction set
/// `simd::dispatch` picks: with the branch-free `exp` the loop vectorises (libm's
/// `expf` is a call per element, and without FMA in the target `mul_add` is too).
pub(super) struct SwiGluLoop<'a> {
    pub(super) g: &'a [f32],
    pub(super) u: &'a [f32],
    pub(super) out: &'a mut [f32],
}

impl pulp::WithSimd for SwiGluLoop<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for ((o, &g), &u) in self.out.iter_mut().zip(self.g).zip(self.u) {
            *o = g / (1.0 + decode::exp_vectorisable(-g)) * u;
        }
    }
}

/// `n` pseudo-random values in `[-2, 2)`, for the kernels' tests.
#[cfg(test)]
pub(crate) fn noise(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|i| (metronome_core::mix64(seed << 32 | i) % 4096) as f32 / 1024.0 - 2.0).collect()
}

/// The largest absolute difference between two tensors of one shape, for the kernels' tests.
#[cfg(test)]
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host kernels read and write a tensor's elements in place, and refuse, with an
    /// error that says what they need, a tensor they cannot: a strided view, another
    /// type. (A bf16 compute copy never reaches them: it takes the portable kernels.)
    #[test]
    fn the_host_kernels_refuse_a_tensor_that_is_not_contiguous_f32() {
        let t = Tensor::arange(0f32, 6.0, &Device::Cpu).unwrap().reshape((2, 3)).unwrap();
        assert_eq!(read_host(&t, <[f32]>::to_vec).unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        write_host(&t, |v| v[4] = -1.0).unwrap();
        assert_eq!(t.flatten_all().unwrap().to_vec1::<f32>().unwrap()[4], -1.0);
        // A narrow of rows is contiguous: read in place, at its offset.
        assert_eq!(read_host(&t.narrow(0, 1, 1).unwrap(), <[f32]>::to_vec).unwrap(), [3.0, -1.0, 5.0]);
        let strided = t.t().unwrap();
        let bf16 = t.to_dtype(candle_core::DType::BF16).unwrap();
        for (what, bad) in [("a transposed view", &strided), ("a bf16 tensor", &bf16)] {
            let e = read_host(bad, |_| ()).unwrap_err().to_string();
            assert!(e.contains("need a contiguous f32 CPU tensor"), "{what}: {e}");
            let e = write_host(bad, |_| ()).unwrap_err().to_string();
            assert!(e.contains("host-write needs a contiguous f32 tensor"), "{what}: {e}");
            // Among several (a layer's input and weights), any one refuses them all.
            let e = read_hosts([&t, bad], |_| ()).unwrap_err().to_string();
            assert!(e.contains("need a contiguous f32 CPU tensor"), "{what} among several: {e}");
        }
        // Nothing was written through the refusals.
        assert_eq!(read_host(&t, <[f32]>::to_vec).unwrap(), [0.0, 1.0, 2.0, 3.0, -1.0, 5.0]);
    }

    #[test]
    fn an_output_a_kernel_leaves_partly_unwritten_fails_the_tests() {
        assert_eq!(
            output(3, |o| o.copy_from_slice(&[1.0, f32::NAN, -0.0]))[2].to_bits(),
            (-0.0f32).to_bits()
        );
        let missed = std::panic::catch_unwind(|| output(5, |o| o[..3].fill(1.0)));
        let message = *missed.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("left element Some(3) of its 5-element output unwritten"), "{message}");
    }

    #[test]
    fn rope_refuses_an_odd_head_dimension() {
        let x = Tensor::zeros((2, 1, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let t = rope_tables(&[0, 1], 3, 10_000.0);
        let err = apply_rope(&x, &t).unwrap_err();
        assert!(err.to_string().contains("head dimension 3 is odd"), "{err}");
    }
}
