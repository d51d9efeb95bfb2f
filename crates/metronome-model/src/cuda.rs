//! This crate's own CUDA kernels (`kernels/*.cu`, compiled to PTX by `build.rs` with
//! the `cuda` feature and loaded on first use) and their launches: what
//! [`crate::Kernels::Cuda`] runs beyond the portable ops. Each has a CPU reference in
//! the crate, which its GPU test compares it with (`tests/it/devices.rs`).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, LaunchArgs, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape, Storage, Tensor};

/// What a custom op's CPU forward returns (these ops have none: they run on CUDA only).
type FwdCpu = candle_core::Result<(CpuStorage, Shape)>;

/// The `cpu_fwd` of a CUDA-only op of two or three operands (or an in-place op of two):
/// an error naming the op. [`crate::Kernels::check`] keeps `Kernels::Cuda` off the CPU,
/// so it is reached only by a tensor moved there by hand.
macro_rules! cpu_fwd_refused {
    (2) => {
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> FwdCpu {
            candle_core::bail!("{} runs on CUDA devices only", self.name())
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> FwdCpu {
            candle_core::bail!("{} runs on CUDA devices only", self.name())
        }
    };
    (in place) => {
        fn cpu_fwd(
            &self,
            _: &mut CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<()> {
            candle_core::bail!("{} runs on CUDA devices only", self.name())
        }
    };
}

use crate::draw::{Draw, Drawn, Next};
use crate::{Error, Result};

/// `kernels/draw.cu`.
const DRAW_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/draw.ptx"));
/// Threads per row of the draw kernels (`DRAW_THREADS` there, which sizes their shared arrays).
const DRAW_THREADS: u32 = 1024;
/// Threads per row of the penalty kernel (`PENALISE_THREADS` there).
const PENALISE_THREADS: u32 = 256;
/// The kernel's token for a row without a finite maximum.
const NONE: u32 = u32::MAX;

fn cuda_err(e: impl std::fmt::Display) -> Error {
    Error::invalid("cuda", e.to_string())
}

/// [`crate::Kernels::next_rows`] on a CUDA device: the rows with a draw are drawn by
/// `draw_rows_*` (from the whole distribution, or greedy) and `draw_truncated_rows_*`
/// (top-k, top-p, min-p), one block per row, penalised rows first copied to f32 and
/// penalised by `penalise_rows_*`, one launch for each of these kinds of rows the step
/// has, and only their tokens and log-probs are copied to the host; the other rows'
/// logits are gathered and copied.
pub(crate) fn next_rows(logits: &Tensor, draws: &[Option<Draw<'_>>]) -> Result<Vec<Next>> {
    let (rows, vocab) = logits.dims2()?;
    let mut out: Vec<Option<Next>> = vec![None; rows];
    for (truncated, penalised) in [(false, false), (true, false), (false, true), (true, true)] {
        let kind = |d: &Draw<'_>| d.truncates() == truncated && d.penalty.is_some() == penalised;
        let drawn: Vec<usize> = (0..rows).filter(|&r| draws[r].as_ref().is_some_and(kind)).collect();
        if drawn.is_empty() {
            continue;
        }
        let picked = if drawn.len() == rows { logits.contiguous()? } else { pick(logits, &drawn)? };
        let draws_of: Vec<Draw<'_>> = drawn.iter().filter_map(|&r| draws[r]).collect();
        let results = draw_rows(&picked, vocab, &draws_of, truncated)?;
        for (&r, d) in drawn.iter().zip(results) {
            out[r] = d.map(Next::Drawn);
        }
    }
    // Rows without a draw, and drawn rows that had no finite maximum, go to the host.
    let host: Vec<usize> = (0..rows).filter(|&r| out[r].is_none()).collect();
    if !host.is_empty() {
        let logits = pick(logits, &host)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (&r, row) in host.iter().zip(logits) {
            out[r] = Some(Next::Logits(row));
        }
    }
    Ok(out.into_iter().map(|n| n.expect("every row is drawn or copied")).collect())
}

/// The rows `rows` of `logits`, contiguous.
fn pick(logits: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let index = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect(), rows.len(), logits.device())?;
    Ok(logits.index_select(&index, 0)?.contiguous()?)
}

/// Logits `[rows, vocab]` on the device, in either dtype the draw kernels read.
enum Rows<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, half::bf16>),
}

impl Rows<'_> {
    /// The contiguous elements of `logits` (f32 or bf16).
    fn of<'a>(cs: &'a CudaStorage, layout: &Layout, dtype: DType, len: usize) -> Result<Rows<'a>> {
        let start = layout.start_offset();
        Ok(match dtype {
            DType::F32 => Rows::F32(cs.as_cuda_slice::<f32>()?.slice(start..start + len)),
            DType::BF16 => Rows::Bf16(cs.as_cuda_slice::<half::bf16>()?.slice(start..start + len)),
            other => {
                return Err(Error::invalid(
                    "draw",
                    format!("logits of {other:?}: the kernel reads f32 and bf16"),
                ));
            }
        })
    }

    /// The kernel `name` of `kernels/draw.cu` for these rows' dtype.
    fn kernel(&self, name: &str) -> String {
        format!("{name}_{}", if matches!(self, Rows::F32(_)) { "f32" } else { "bf16" })
    }

    /// Pushes the rows as a kernel's argument.
    fn arg<'a, 'b: 'a>(&'b self, builder: &mut LaunchArgs<'a>) {
        match self {
            Rows::F32(v) => builder.arg(v),
            Rows::Bf16(v) => builder.arg(v),
        };
    }
}

/// Launches the draw kernels on `logits: [draws.len(), vocab]` (contiguous, f32 or
/// bf16), whose draws are all of one kind: `draw_truncated_rows_*` when `truncated`
/// (every draw truncates), `draw_rows_*` otherwise (none does), on an f32 copy
/// penalised by `penalise_rows_*` when the draws have a penalty (all or none do), and
/// `raw_logprobs_*` after them when some report raw log-probs. `None` for a row without
/// a finite maximum.
#[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
fn draw_rows(
    logits: &Tensor,
    vocab: usize,
    draws: &[Draw<'_>],
    truncated: bool,
) -> Result<Vec<Option<Drawn>>> {
    let n = draws.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let vocab32 =
        u32::try_from(vocab).map_err(|_| Error::invalid("draw", format!("vocabulary of {vocab}")))?;
    let (storage, layout) = logits.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(Error::invalid("draw", "the CUDA kernels need logits on a CUDA device"));
    };
    let dev = cs.device();
    let stream = dev.cuda_stream();
    let load = |name: &str| dev.get_or_load_custom_func(name, "metronome_draw", DRAW_PTX);
    let rows = Rows::of(cs, layout, logits.dtype(), n * vocab)?;
    let per_row = |threads: u32| LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };

    // Penalised rows: their context's distinct ids (a few hundred a row, where the
    // logits are the vocabulary's), and an f32 copy of the rows penalised.
    let copy = if draws[0].penalty.is_some() {
        let (mut offsets, mut ids, mut factors, mut seen) =
            (vec![0u32], Vec::new(), Vec::with_capacity(n), Vec::new());
        for d in draws {
            let p = d
                .penalty
                .ok_or_else(|| Error::invalid("draw", "a launch mixes penalised rows with others"))?;
            p.distinct(vocab, &mut seen);
            ids.extend_from_slice(&seen);
            offsets.push(ids.len() as u32);
            factors.push(p.factor);
        }
        ids.push(0); // never read; a launch takes no empty buffer
        let offsets = stream.clone_htod(&offsets).map_err(cuda_err)?;
        let ids = stream.clone_htod(&ids).map_err(cuda_err)?;
        let factors = stream.clone_htod(&factors).map_err(cuda_err)?;
        let out: CudaSlice<f32> = stream.alloc_zeros(n * vocab).map_err(cuda_err)?;
        let func = load(&rows.kernel("penalise_rows"))?;
        let mut b = func.builder();
        rows.arg(&mut b);
        b.arg(&out).arg(&offsets).arg(&ids).arg(&factors).arg(&vocab32);
        // SAFETY: the arguments are the kernel's, in its order and types: the rows and
        // `out` hold `n * vocab` elements, `offsets` n + 1 bounds into `ids`, `factors` n.
        unsafe { b.launch(per_row(PENALISE_THREADS)) }.map_err(cuda_err)?;
        Some(out)
    } else {
        None
    };
    let penalised = copy.as_ref().map(|out| Rows::F32(out.slice(0..n * vocab)));
    let source = penalised.as_ref().unwrap_or(&rows);

    // The host's scaling: `1 / T` in f32, none at `T = 0` (greedy) or `T = 1`.
    let inv: Vec<f32> = draws.iter().map(|d| crate::draw::inv_temperature(d.temperature)).collect();
    let u: Vec<f64> = draws.iter().map(|d| d.u).collect();
    let inv = stream.clone_htod(&inv).map_err(cuda_err)?;
    let u = stream.clone_htod(&u).map_err(cuda_err)?;
    let tokens: CudaSlice<u32> = stream.alloc_zeros(n).map_err(cuda_err)?;
    let logprobs: CudaSlice<f32> = stream.alloc_zeros(n).map_err(cuda_err)?;
    let upload_u32 = |v: Vec<u32>| stream.clone_htod(&v).map_err(cuda_err);
    // The plain kernel's greedy flags, or the truncated one's settings (min-p as the
    // host's floor on `x - max`).
    let greedy = if truncated {
        None
    } else {
        Some(upload_u32(draws.iter().map(|d| u32::from(d.temperature == 0.0)).collect())?)
    };
    let settings = if truncated {
        let top_p: Vec<f32> = draws.iter().map(|d| d.truncation.top_p).collect();
        let floor: Vec<f64> = draws.iter().map(|d| d.truncation.min_p_floor()).collect();
        Some((
            upload_u32(draws.iter().map(|d| d.truncation.top_k).collect())?,
            stream.clone_htod(&top_p).map_err(cuda_err)?,
            stream.clone_htod(&floor).map_err(cuda_err)?,
        ))
    } else {
        None
    };
    let func = load(&source.kernel(if truncated { "draw_truncated_rows" } else { "draw_rows" }))?;
    let mut b = func.builder();
    source.arg(&mut b);
    b.arg(&inv);
    if let Some((top_k, top_p, floor)) = &settings {
        b.arg(&u).arg(top_k).arg(top_p).arg(floor);
    } else if let Some(greedy) = &greedy {
        b.arg(greedy).arg(&u);
    }
    b.arg(&tokens).arg(&logprobs).arg(&vocab32);
    // SAFETY: the arguments are the kernel's, in its order and types; the rows hold
    // `n * vocab` elements and the others `n`, one block writing each row's.
    unsafe { b.launch(per_row(DRAW_THREADS)) }.map_err(cuda_err)?;

    // Raw log-probs, from the rows as they came (unpenalised, unscaled).
    let raw = if draws.iter().any(|d| d.raw_logprob) {
        let raw: CudaSlice<f32> = stream.alloc_zeros(n).map_err(cuda_err)?;
        let func = load(&rows.kernel("raw_logprobs"))?;
        let mut b = func.builder();
        rows.arg(&mut b);
        b.arg(&tokens).arg(&raw).arg(&vocab32);
        // SAFETY: the arguments are the kernel's, in its order and types: the rows hold
        // `n * vocab` elements, `tokens` and `raw` n.
        unsafe { b.launch(per_row(DRAW_THREADS)) }.map_err(cuda_err)?;
        Some(stream.clone_dtoh(&raw).map_err(cuda_err)?)
    } else {
        None
    };
    let tokens = stream.clone_dtoh(&tokens).map_err(cuda_err)?;
    let logprobs = stream.clone_dtoh(&logprobs).map_err(cuda_err)?;
    Ok((0..n)
        .map(|r| {
            let logprob = match &raw {
                Some(raw) if draws[r].raw_logprob => raw[r],
                _ => logprobs[r],
            };
            (tokens[r] != NONE).then_some(Drawn { token: tokens[r], logprob })
        })
        .collect())
}

/// `kernels/layer.cu`: RMSNorm, SwiGLU, rotary embeddings and the masked softmax,
/// forward and backward, f32 and bf16.
const LAYER_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/layer.ptx"));
/// Threads per row of the RMSNorm kernels (a multiple of 32: their sums go by warps).
const NORM_THREADS: u32 = 256;
/// Threads per block of the element-wise kernels.
const ELEMENTWISE_THREADS: u32 = 256;

/// What a CUDA forward returns.
type CudaFwd = candle_core::Result<(CudaStorage, Shape)>;

/// The contiguous elements of one operand as a device view.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, op: &str) -> candle_core::Result<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("{op} needs contiguous inputs") };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// The kernel `$name` of a PTX module for `dtype` (`_f32` or `_bf16`), loaded.
macro_rules! typed_func {
    ($dev:expr, $module:literal, $ptx:expr, $name:literal, $dtype:expr) => {{
        let suffix = match $dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            other => candle_core::bail!("{}: the CUDA kernels take f32 and bf16, not {other:?}", $name),
        };
        $dev.get_or_load_custom_func(&format!("{}_{suffix}", $name), $module, $ptx)?
    }};
}

/// A kernel of `kernels/layer.cu` for `dtype`.
macro_rules! layer_func {
    ($dev:expr, $name:literal, $dtype:expr) => {
        typed_func!($dev, "metronome_layer", LAYER_PTX, $name, $dtype)
    };
}

/// A kernel of `kernels/decode.cu` for `dtype`.
macro_rules! decode_func {
    ($dev:expr, $name:literal, $dtype:expr) => {
        typed_func!($dev, "metronome_decode", DECODE_PTX, $name, $dtype)
    };
}

/// One block per `n`-element chunk of `ELEMENTWISE_THREADS`.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ELEMENTWISE_THREADS as usize).max(1) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ELEMENTWISE_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// `rms_norm_*` over `rows` rows (at least one: the callers launch none for none),
/// one block each.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (NORM_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// RMSNorm of `x: [.., d]` with `weight: [d]` (cast to `x`'s type), one kernel forward
/// and one backward: [`crate::Kernels::rms_norm`] under [`crate::Kernels::Cuda`].
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let w = weight.to_dtype(x.dtype())?.contiguous()?;
    Ok(x.contiguous()?.apply_op2(&w, RmsNorm { eps: eps as f32 })?)
}

#[derive(Debug, Clone, Copy)]
struct RmsNorm {
    eps: f32,
}

/// The rows and width of an RMSNorm's operands.
fn norm_dims(x: &Layout, w: &Layout) -> candle_core::Result<(usize, usize)> {
    let d = w.shape().elem_count();
    if x.dims().last() != Some(&d) || d == 0 {
        candle_core::bail!("cuda-rms-norm: weight of {d} does not fit input {:?}", x.dims())
    }
    Ok((x.shape().elem_count() / d, d))
}

impl candle_core::CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "cuda-rms-norm"
    }

    cpu_fwd_refused!(2);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> CudaFwd {
        let (rows, d) = norm_dims(l1, l2)?;
        let dev = s1.device();
        let func = layer_func!(dev, "rms_norm_fwd", s1.dtype());
        let d32 = d as u32;
        macro_rules! launch {
            ($t:ty) => {{
                let (x, w) = (view::<$t>(s1, l1, self.name())?, view::<$t>(s2, l2, self.name())?);
                // SAFETY: uninitialised, and every element is written by the kernel below.
                let y = unsafe { dev.alloc::<$t>(rows * d) }?;
                let mut b = func.builder();
                b.arg(&x).arg(&w).arg(&y).arg(&d32).arg(&self.eps);
                // SAFETY: `rms_norm_fwd_*(x, w, y, d, eps)` over `rows` blocks: `x` and `y`
                // hold `rows * d` elements, `w` holds `d`.
                if rows > 0 {
                    unsafe { b.launch(per_row(rows)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(y, dev.clone())
            }};
        }
        let y = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (d, rows) = (w.elem_count(), x.elem_count() / w.elem_count().max(1));
        // `[2, rows, d]` f32: the input's gradient, then the rows' terms of the weight's.
        let both = x.apply_op3_no_bwd(w, &g.contiguous()?, &RmsNormGrad { eps: self.eps })?;
        let dx = both.get(0)?.reshape(x.shape())?.to_dtype(x.dtype())?;
        let dw = both.get(1)?.reshape((rows, d))?.sum(0)?.reshape(w.shape())?.to_dtype(w.dtype())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// RMSNorm's backward kernel: `[2, rows, d]` f32 from `(x, w, g)`.
#[derive(Debug, Clone, Copy)]
struct RmsNormGrad {
    eps: f32,
}

impl candle_core::CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "cuda-rms-norm-grad"
    }

    cpu_fwd_refused!(3);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> CudaFwd {
        let (rows, d) = norm_dims(l1, l2)?;
        if l3.shape() != l1.shape() {
            candle_core::bail!("cuda-rms-norm-grad: gradient {:?} for input {:?}", l3.dims(), l1.dims())
        }
        let dev = s1.device();
        let func = layer_func!(dev, "rms_norm_bwd", s1.dtype());
        let d32 = d as u32;
        // SAFETY: uninitialised, and every element is written by the kernel below.
        let out = unsafe { dev.alloc::<f32>(2 * rows * d) }?;
        macro_rules! launch {
            ($t:ty) => {{
                let x = view::<$t>(s1, l1, self.name())?;
                let w = view::<$t>(s2, l2, self.name())?;
                let g = view::<$t>(s3, l3, self.name())?;
                let (dx, wrow) = out.split_at(rows * d);
                let mut b = func.builder();
                b.arg(&x).arg(&w).arg(&g).arg(&dx).arg(&wrow).arg(&d32).arg(&self.eps);
                // SAFETY: `rms_norm_bwd_*(x, w, g, dx, wrow, d, eps)` over `rows` blocks:
                // `x`, `g`, `dx` and `wrow` hold `rows * d` elements, `w` holds `d`.
                if rows > 0 {
                    unsafe { b.launch(per_row(rows)) }.w()?;
                }
            }};
        }
        match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from((2, rows, d))))
    }
}

/// `silu(gate) * up`, one kernel forward and one backward: [`crate::Kernels::swiglu_train`]
/// (and the decode steps' SwiGLU) under [`crate::Kernels::Cuda`].
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let up = up.to_dtype(gate.dtype())?.contiguous()?;
    Ok(gate.contiguous()?.apply_op2(&up, SwiGlu)?)
}

#[derive(Debug, Clone, Copy)]
struct SwiGlu;

impl candle_core::CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "cuda-swiglu"
    }

    cpu_fwd_refused!(2);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> CudaFwd {
        if l1.shape() != l2.shape() {
            candle_core::bail!("cuda-swiglu: gate {:?} and up {:?} differ in shape", l1.dims(), l2.dims())
        }
        let n = l1.shape().elem_count();
        let dev = s1.device();
        let func = layer_func!(dev, "swiglu_fwd", s1.dtype());
        macro_rules! launch {
            ($t:ty) => {{
                let (a, b) = (view::<$t>(s1, l1, self.name())?, view::<$t>(s2, l2, self.name())?);
                // SAFETY: uninitialised, and every element is written by the kernel below.
                let o = unsafe { dev.alloc::<$t>(n) }?;
                let mut args = func.builder();
                args.arg(&a).arg(&b).arg(&o).arg(&n);
                // SAFETY: `swiglu_fwd_*(a, b, o, n)`: each of the three holds `n` elements and
                // the kernel returns past `n`.
                unsafe { args.launch(elementwise(n)) }.w()?;
                CudaStorage::wrap_cuda_slice(o, dev.clone())
            }};
        }
        let o = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((o, l1.shape().clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _o: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = a.apply_op3_no_bwd(b, &g.to_dtype(a.dtype())?.contiguous()?, &SwiGluGrad)?;
        Ok((Some(both.get(0)?.reshape(a.shape())?), Some(both.get(1)?.reshape(b.shape())?)))
    }
}

/// SwiGLU's backward kernel: `[2, n]` (the gate's gradient, then the up projection's)
/// in the inputs' type, from `(gate, up, g)`.
#[derive(Debug, Clone, Copy)]
struct SwiGluGrad;

impl candle_core::CustomOp3 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "cuda-swiglu-grad"
    }

    cpu_fwd_refused!(3);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> CudaFwd {
        if l1.shape() != l2.shape() || l1.shape() != l3.shape() {
            candle_core::bail!("cuda-swiglu-grad: shapes {:?}, {:?}, {:?}", l1.dims(), l2.dims(), l3.dims())
        }
        let n = l1.shape().elem_count();
        let dev = s1.device();
        let func = layer_func!(dev, "swiglu_bwd", s1.dtype());
        macro_rules! launch {
            ($t:ty) => {{
                let a = view::<$t>(s1, l1, self.name())?;
                let b = view::<$t>(s2, l2, self.name())?;
                let g = view::<$t>(s3, l3, self.name())?;
                // SAFETY: uninitialised, and every element is written by the kernel below.
                let out = unsafe { dev.alloc::<$t>(2 * n) }?;
                let mut args = func.builder();
                args.arg(&a).arg(&b).arg(&g).arg(&out).arg(&n);
                // SAFETY: `swiglu_bwd_*(a, b, g, out, n)`: the inputs hold `n` elements and
                // `out` holds `2 n`; the kernel returns past `n`.
                unsafe { args.launch(elementwise(n)) }.w()?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((out, Shape::from((2, n))))
    }
}

/// `softmax(scores + mask)` over the last dimension, one kernel forward and one backward:
/// [`crate::Kernels::masked_softmax`] and [`crate::Kernels::row_masked_softmax`] under
/// [`crate::Kernels::Cuda`]. `scores: [.., lq, lk]` in f32 or bf16, `mask: [lq, lk]` or
/// `[b, lq, lk]` additive (cast to f32): its `b` blocks each cover an equal share of the
/// scores' rows, in order (one mask broadcast over every leading dimension, or one per
/// row of a batch, broadcast over the heads); the probabilities come back in the
/// scores' type, computed in f32.
pub(crate) fn masked_softmax(scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mask = mask.to_dtype(DType::F32)?.contiguous()?;
    Ok(scores.contiguous()?.apply_op2(&mask, MaskedSoftmax)?)
}

#[derive(Debug, Clone, Copy)]
struct MaskedSoftmax;

/// The rows (every leading index and query), the scores' rows per mask block, the
/// queries and the keys of masked-softmax operands.
fn softmax_dims(scores: &Layout, mask: &Layout) -> candle_core::Result<(usize, u64, u32, u32)> {
    let dims = scores.dims();
    let (blocks, mask_tail) = match mask.dims() {
        [b, rest @ ..] if rest.len() == 2 => (*b, rest),
        rest => (1, rest),
    };
    match (dims.len().checked_sub(2).map(|i| &dims[i..]), mask_tail) {
        (Some(&[lq, lk]), &[mq, mk]) if (lq, lk) == (mq, mk) && lk > 0 && lq > 0 && blocks > 0 => {
            let rows = scores.shape().elem_count() / lk;
            if rows.is_multiple_of(blocks * lq) {
                return Ok((rows, (rows / blocks) as u64, lq as u32, lk as u32));
            }
        }
        _ => {}
    }
    candle_core::bail!("cuda-masked-softmax: mask {:?} does not fit scores {dims:?}", mask.dims())
}

impl candle_core::CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "cuda-masked-softmax"
    }

    cpu_fwd_refused!(2);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> CudaFwd {
        let (rows, group, lq, lk) = softmax_dims(l1, l2)?;
        let dev = s1.device();
        let func = layer_func!(dev, "masked_softmax_fwd", s1.dtype());
        let mask = view::<f32>(s2, l2, self.name())?;
        macro_rules! launch {
            ($t:ty) => {{
                let x = view::<$t>(s1, l1, self.name())?;
                // SAFETY: uninitialised, and every element is written by the kernel below.
                let p = unsafe { dev.alloc::<$t>(rows * lk as usize) }?;
                let mut b = func.builder();
                b.arg(&x).arg(&mask).arg(&p).arg(&group).arg(&lq).arg(&lk);
                // SAFETY: `masked_softmax_fwd_*(s, mask, p, group, lq, lk)` over `rows` blocks:
                // `s` and `p` hold `rows * lk` elements, `mask` holds `rows / group` blocks
                // of `lq * lk`, and `group` is a multiple of `lq` that divides `rows` (block
                // `r` reads mask row `(r / group) * lq + r % lq`).
                if rows > 0 {
                    unsafe { b.launch(per_row(rows)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(p, dev.clone())
            }};
        }
        let p = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((p, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _mask: &Tensor,
        p: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let ds = p.apply_op2_no_bwd(&g.to_dtype(p.dtype())?.contiguous()?, &MaskedSoftmaxGrad)?;
        Ok((Some(ds), None))
    }
}

/// The masked softmax's backward kernel: the scores' gradient from `(p, g)`, in `p`'s type.
#[derive(Debug, Clone, Copy)]
struct MaskedSoftmaxGrad;

impl candle_core::CustomOp2 for MaskedSoftmaxGrad {
    fn name(&self) -> &'static str {
        "cuda-masked-softmax-grad"
    }

    cpu_fwd_refused!(2);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> CudaFwd {
        let lk = l1.dims().last().copied().unwrap_or(0);
        if l1.shape() != l2.shape() || lk == 0 {
            candle_core::bail!(
                "cuda-masked-softmax-grad: probabilities {:?}, gradient {:?}",
                l1.dims(),
                l2.dims()
            )
        }
        let rows = l1.shape().elem_count() / lk;
        let lk32 = lk as u32;
        let dev = s1.device();
        let func = layer_func!(dev, "masked_softmax_bwd", s1.dtype());
        macro_rules! launch {
            ($t:ty) => {{
                let (p, g) = (view::<$t>(s1, l1, self.name())?, view::<$t>(s2, l2, self.name())?);
                // SAFETY: uninitialised, and every element is written by the kernel below.
                let ds = unsafe { dev.alloc::<$t>(rows * lk) }?;
                let mut b = func.builder();
                b.arg(&p).arg(&g).arg(&ds).arg(&lk32);
                // SAFETY: `masked_softmax_bwd_*(p, g, ds, lk)` over `rows` blocks: each of the
                // three holds `rows * lk` elements.
                if rows > 0 {
                    unsafe { b.launch(per_row(rows)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(ds, dev.clone())
            }};
        }
        let ds = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((ds, l1.shape().clone()))
    }
}

/// Rotary embeddings of `x: [n, heads, head_dim]` with the tables of `t` (rotate-half
/// convention), one kernel forward and one backward (the inverse rotation):
/// [`crate::Kernels::rope`] under [`crate::Kernels::Cuda`].
pub(crate) fn rope(x: &Tensor, t: &crate::ops::RopeTables) -> Result<Tensor> {
    let (n, _, hd) = x.dims3()?;
    let (cos, sin) = t.on(x.device(), n, hd / 2)?;
    Ok(x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope { sign: 1.0 })?)
}

/// The rotation by the tables' angles (`sign` 1) or their negation (`sign` -1, the
/// backward).
#[derive(Debug, Clone, Copy)]
struct Rope {
    sign: f32,
}

impl candle_core::CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "cuda-rope"
    }

    cpu_fwd_refused!(3);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> CudaFwd {
        let (n, heads, hd) = l1.shape().dims3()?;
        let half = hd / 2;
        if hd % 2 != 0 || l2.shape().elem_count() != n * half || l3.shape().elem_count() != n * half {
            candle_core::bail!(
                "cuda-rope: tables {:?} and {:?} for input {:?}",
                l2.dims(),
                l3.dims(),
                l1.dims()
            )
        }
        let pairs = n * heads * half;
        let dev = s1.device();
        let func = layer_func!(dev, "rope", s1.dtype());
        let (cos, sin) = (view::<f32>(s2, l2, self.name())?, view::<f32>(s3, l3, self.name())?);
        let (heads32, half32) = (heads as u32, half as u32);
        macro_rules! launch {
            ($t:ty) => {{
                let x = view::<$t>(s1, l1, self.name())?;
                // SAFETY: uninitialised, and every element (both halves of every pair) is written
                // by the kernel below.
                let o = unsafe { dev.alloc::<$t>(n * heads * hd) }?;
                let mut args = func.builder();
                args.arg(&x)
                    .arg(&cos)
                    .arg(&sin)
                    .arg(&o)
                    .arg(&heads32)
                    .arg(&half32)
                    .arg(&pairs)
                    .arg(&self.sign);
                // SAFETY: `rope_*(x, cos, sin, o, heads, half, pairs, sign)`: `x` and `o` hold
                // `2 pairs` elements, the tables `n half`; the kernel returns past `pairs`.
                unsafe { args.launch(elementwise(pairs)) }.w()?;
                CudaStorage::wrap_cuda_slice(o, dev.clone())
            }};
        }
        let o = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((o, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _o: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let inverse = Rope { sign: -self.sign };
        Ok((Some(g.contiguous()?.apply_op3_no_bwd(cos, sin, &inverse)?), None, None))
    }
}

/// The chunked head's forward for a chunk of rows, one kernel: per row of
/// `logits / T: [n, vocab]` (f32 or bf16, `column: [n, 1]` u32 its targets) the
/// target's log-prob, the entropy and the log-sum-exp as `[n, 3]` f32, computed in f32:
/// [`crate::Kernels::logprob_stats`] under [`crate::Kernels::Cuda`]. No graph (the head
/// attaches its own backward).
pub(crate) fn logprob_stats(logits: &Tensor, column: &Tensor, inv_temperature: f32) -> Result<Tensor> {
    Ok(logits.contiguous()?.apply_op2_no_bwd(&column.contiguous()?, &LogprobStats { inv_temperature })?)
}

#[derive(Debug, Clone, Copy)]
struct LogprobStats {
    inv_temperature: f32,
}

/// The rows and vocabulary of `logits: [n, vocab]` with `column: [n, 1]` u32.
fn head_dims(op: &str, logits: &Layout, column: &Layout) -> candle_core::Result<(usize, usize)> {
    match (logits.dims(), column.dims()) {
        (&[n, vocab], &[m, 1]) if n == m && vocab > 0 && u32::try_from(vocab).is_ok() => Ok((n, vocab)),
        (z, c) => candle_core::bail!("{op}: logits {z:?} with targets {c:?}"),
    }
}

impl candle_core::CustomOp2 for LogprobStats {
    fn name(&self) -> &'static str {
        "cuda-logprob-stats"
    }

    cpu_fwd_refused!(2);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> CudaFwd {
        let (n, vocab) = head_dims(self.name(), l1, l2)?;
        let dev = s1.device();
        let func = layer_func!(dev, "logprob_stats", s1.dtype());
        let target = view::<u32>(s2, l2, self.name())?;
        let vocab32 = vocab as u32;
        // SAFETY: uninitialised, and every element is written by the kernel below.
        let stats = unsafe { dev.alloc::<f32>(n * 3) }?;
        macro_rules! launch {
            ($t:ty) => {{
                let z = view::<$t>(s1, l1, self.name())?;
                let mut b = func.builder();
                b.arg(&z).arg(&target).arg(&stats).arg(&vocab32).arg(&self.inv_temperature);
                // SAFETY: `logprob_stats_*(z, target, stats, vocab, inv_t)` over `n` blocks:
                // `z` holds `n * vocab` elements, `target` `n` (each below `vocab`: the head
                // checks its targets), `stats` `n * 3`.
                if n > 0 {
                    unsafe { b.launch(per_row(n)) }.w()?;
                }
            }};
        }
        match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        }
        Ok((CudaStorage::wrap_cuda_slice(stats, dev.clone()), Shape::from((n, 3))))
    }
}

/// The chunked head's backward for a block of vocabulary columns, one kernel: the
/// `[n, cols]` gradient of the block's logits `z` (columns `first..`, f32 or bf16), in
/// `z`'s type, from the rows' `[n, 3]` statistics and `[n, 2]` gradient:
/// [`crate::Kernels::logprob_columns_grad`] under [`crate::Kernels::Cuda`].
pub(crate) fn logprob_columns_grad(
    z: &Tensor,
    stats: &Tensor,
    column: &Tensor,
    first: usize,
    g: &Tensor,
    inv_temperature: f32,
) -> Result<Tensor> {
    let first =
        u32::try_from(first).map_err(|_| Error::invalid("log-prob head", "a vocabulary beyond u32"))?;
    let aux = Tensor::cat(&[stats.to_dtype(DType::F32)?, g.to_dtype(DType::F32)?], 1)?;
    let op = LogprobColumnsGrad { first, inv_temperature };
    Ok(z.contiguous()?.apply_op3_no_bwd(&aux, &column.contiguous()?, &op)?)
}

#[derive(Debug, Clone, Copy)]
struct LogprobColumnsGrad {
    first: u32,
    inv_temperature: f32,
}

impl candle_core::CustomOp3 for LogprobColumnsGrad {
    fn name(&self) -> &'static str {
        "cuda-logprob-columns-grad"
    }

    cpu_fwd_refused!(3);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> CudaFwd {
        let (n, cols) = head_dims(self.name(), l1, l3)?;
        if l2.dims() != [n, 5] {
            candle_core::bail!("{}: row statistics {:?} for {n} rows", self.name(), l2.dims())
        }
        let dev = s1.device();
        let func = layer_func!(dev, "logprob_columns_grad", s1.dtype());
        let aux = view::<f32>(s2, l2, self.name())?;
        let target = view::<u32>(s3, l3, self.name())?;
        let (count, cols32) = (n * cols, cols as u32);
        macro_rules! launch {
            ($t:ty) => {{
                let z = view::<$t>(s1, l1, self.name())?;
                // SAFETY: uninitialised, and every element is written by the kernel below.
                let dz = unsafe { dev.alloc::<$t>(count) }?;
                let mut b = func.builder();
                b.arg(&z)
                    .arg(&aux)
                    .arg(&target)
                    .arg(&dz)
                    .arg(&cols32)
                    .arg(&self.first)
                    .arg(&self.inv_temperature)
                    .arg(&count);
                // SAFETY: `logprob_columns_grad_*(z, aux, target, dz, cols, first, inv_t, n)`:
                // `z` and `dz` hold `count = rows * cols` elements, `aux` `rows * 5`, `target`
                // `rows`; the kernel's grid-stride loop stops at `count`.
                if count > 0 {
                    unsafe { b.launch(elementwise(count)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(dz, dev.clone())
            }};
        }
        let dz = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((dz, l1.shape().clone()))
    }
}

/// The rows of `table: [rows, d]` that `ids: [n]` u32 names, one kernel each way:
/// [`crate::Kernels::gather_rows`] under [`crate::Kernels::Cuda`]; `inverse` is the
/// packed inverse of `ids` and the number of rows it reads (`ops::RowIndex`).
pub(crate) fn gather_rows(table: &Tensor, ids: &Tensor, inverse: &(Tensor, usize)) -> Result<Tensor> {
    let op = GatherRows { inverse: inverse.0.clone(), rows_read: inverse.1 };
    Ok(table.contiguous()?.apply_op2(&ids.contiguous()?, op)?)
}

struct GatherRows {
    inverse: Tensor,
    rows_read: usize,
}

impl candle_core::CustomOp2 for GatherRows {
    fn name(&self) -> &'static str {
        "cuda-gather-rows"
    }

    cpu_fwd_refused!(2);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> CudaFwd {
        let ((_, d), n) = (l1.shape().dims2()?, l2.shape().dims1()?);
        let dev = s1.device();
        let func = layer_func!(dev, "gather_rows_fwd", s1.dtype());
        let ids = view::<u32>(s2, l2, self.name())?;
        let d32 =
            u32::try_from(d).map_err(|_| candle_core::Error::msg("cuda-gather-rows: rows beyond u32"))?;
        macro_rules! launch {
            ($t:ty) => {{
                let table = view::<$t>(s1, l1, self.name())?;
                // SAFETY: uninitialised, and every element is written by the kernel below.
                let out = unsafe { dev.alloc::<$t>(n * d) }?;
                let mut b = func.builder();
                b.arg(&table).arg(&ids).arg(&out).arg(&d32);
                // SAFETY: `gather_rows_fwd_*(table, ids, out, d)` over `n` blocks: `ids` holds
                // `n` ids, each below `rows` (the model checks tokens against its vocabulary and
                // targets against their rows), `table` `rows * d` elements, `out` `n * d`.
                if n > 0 && d > 0 {
                    unsafe { b.launch(per_row(n)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((out, Shape::from((n, d))))
    }

    fn bwd(
        &self,
        table: &Tensor,
        _ids: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let op = GatherRowsGrad { rows: table.dim(0)?, rows_read: self.rows_read };
        let g = g.to_dtype(table.dtype())?.contiguous()?;
        Ok((Some(g.apply_op2_no_bwd(&self.inverse, &op)?), None))
    }
}

/// The backward of [`GatherRows`]: the table's `[rows, d]` gradient from the outputs'
/// `[n, d]` and the packed inverse of the ids.
#[derive(Debug, Clone, Copy)]
struct GatherRowsGrad {
    rows: usize,
    rows_read: usize,
}

impl candle_core::CustomOp2 for GatherRowsGrad {
    fn name(&self) -> &'static str {
        "cuda-gather-rows-grad"
    }

    cpu_fwd_refused!(2);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> CudaFwd {
        let ((n, d), packed) = (l1.shape().dims2()?, l2.shape().dims1()?);
        let m = self.rows_read;
        if packed != 2 * m + 1 + n || m > self.rows {
            candle_core::bail!("{}: an inverse of {packed} for {n} outputs of {m} rows", self.name())
        }
        let dev = s1.device();
        let func = layer_func!(dev, "gather_rows_bwd", s1.dtype());
        let inverse = view::<u32>(s2, l2, self.name())?;
        let (m32, d32) = (m as u32, d as u32);
        macro_rules! launch {
            ($t:ty) => {{
                let g = view::<$t>(s1, l1, self.name())?;
                // Rows no output read keep a zero gradient.
                let out = dev.alloc_zeros::<$t>(self.rows * d)?;
                let mut b = func.builder();
                b.arg(&g).arg(&inverse).arg(&out).arg(&m32).arg(&d32);
                // SAFETY: `gather_rows_bwd_*(g, inv, out, m, d)` over `m` blocks: `g` holds `n * d`
                // elements, `inv` the `m` rows read (each below `rows`, as the forward's ids),
                // `m + 1` offsets into the `n` sources (each below `n`), `out` `rows * d`.
                if m > 0 && d > 0 {
                    unsafe { b.launch(per_row(m)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((out, Shape::from((self.rows, d))))
    }
}

/// `kernels/decode.cu`: the cached forward's cache writes and attention, read in place.
const DECODE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));
/// Threads per block of the attention kernel: one warp per (row, query head).
const WARP: u32 = 32;
/// The largest head dimension the attention kernel holds (`MAX_CHUNKS` there, times 32).
const MAX_HEAD_DIM: usize = 256;

/// The step's rows as the decode kernels read them: `[n, 2]` u32 (block-table start,
/// cached length) and the block tables (u32), each uploaded once per step (the step's
/// [`crate::ops::StepIndex`]).
fn rows_tensors(rows: crate::ops::DecodeRows<'_>, device: &candle_core::Device) -> Result<(Tensor, Tensor)> {
    let index = rows.index;
    let pairs = crate::ops::StepIndex::get(index.map(|s| &s.rows), || {
        Ok(Tensor::from_vec(rows.pairs()?, (rows.len.len(), 2), device)?)
    })?;
    let blocks = crate::ops::StepIndex::get(index.map(|s| &s.blocks), || {
        Ok(Tensor::from_slice(rows.blocks, rows.blocks.len(), device)?)
    })?;
    Ok((pairs, blocks))
}

/// The block size as the decode kernels take it.
fn block_u32(rows: crate::ops::DecodeRows<'_>) -> Result<u32> {
    u32::try_from(rows.block).map_err(|_| Error::invalid("decode rows", "blocks beyond u32 rows"))
}

/// Whether the attention kernel takes heads of `head_dim` (a multiple of 32 up to
/// [`MAX_HEAD_DIM`]); others run the portable form.
pub(crate) fn decode_kernels_fit(head_dim: usize) -> bool {
    head_dim.is_multiple_of(32) && head_dim <= MAX_HEAD_DIM
}

/// Writes a step's new keys (or values) `[n, kv_heads, head_dim]` into a layer's cache
/// at the rows `rows` names, in place: [`crate::Kernels::write_decode_rows`] under
/// [`crate::Kernels::Cuda`].
pub(crate) fn write_decode_rows(
    cache: &Tensor,
    new: &Tensor,
    rows: crate::ops::DecodeRows<'_>,
) -> Result<()> {
    let (n, kvh, hd) = new.dims3()?;
    rows.check("cuda-decode-write", n, cache.dim(0)?)?;
    if cache.dims()[1..] != [kvh, hd] {
        return Err(Error::invalid(
            "cuda-decode-write",
            format!("rows {:?} into a cache of {:?}", new.dims(), cache.dims()),
        ));
    }
    let (pairs, blocks) = rows_tensors(rows, cache.device())?;
    let op = DecodeWrite { rows: pairs, blocks, block: block_u32(rows)? };
    cache.inplace_op2(&new.to_dtype(cache.dtype())?.contiguous()?, &op)?;
    Ok(())
}

#[derive(Debug)]
struct DecodeWrite {
    rows: Tensor,
    blocks: Tensor,
    block: u32,
}

impl candle_core::InplaceOp2 for DecodeWrite {
    fn name(&self) -> &'static str {
        "cuda-decode-write"
    }

    cpu_fwd_refused!(in place);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let total = l2.shape().elem_count();
        let width = (total / l2.dims()[0].max(1)) as u32;
        let (rows_storage, rows_layout) = self.rows.storage_and_layout();
        let (blocks_storage, blocks_layout) = self.blocks.storage_and_layout();
        let (Storage::Cuda(rs), Storage::Cuda(bs)) = (&*rows_storage, &*blocks_storage) else {
            candle_core::bail!("cuda-decode-write: rows off the GPU")
        };
        let rows = view::<u32>(rs, rows_layout, self.name())?;
        let blocks = view::<u32>(bs, blocks_layout, self.name())?;
        let dev = s1.device().clone();
        let func = decode_func!(dev, "decode_write", s1.dtype());
        let Some((c0, c1)) = l1.contiguous_offsets() else {
            candle_core::bail!("cuda-decode-write: cache not contiguous")
        };
        macro_rules! launch {
            ($t:ty) => {{
                let src = view::<$t>(s2, l2, self.name())?;
                let cache = s1.as_cuda_slice_mut::<$t>()?;
                let mut cache = cache.slice_mut(c0..c1);
                let mut args = func.builder();
                args.arg(&mut cache)
                    .arg(&src)
                    .arg(&rows)
                    .arg(&blocks)
                    .arg(&self.block)
                    .arg(&width)
                    .arg(&total);
                // SAFETY: `decode_write_*(cache, src, rows, blocks, block, width, total)`:
                // `src` holds `total = n width` elements, `rows` n pairs whose block
                // tables in `blocks` were checked against the cache's rows.
                unsafe { args.launch(elementwise(total)) }.w()?;
            }};
        }
        match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        }
        Ok(())
    }
}

/// Attention of a step's queries `q: [n, heads, head_dim]` over each row's cached prefix,
/// read in place (no gather, no padding): `[out_rows, heads * head_dim]`, rows from `n`
/// on zeros (the next product's padding).
/// [`crate::Kernels::decode_attention`] under [`crate::Kernels::Cuda`] for head
/// dimensions [`decode_kernels_fit`] takes.
pub(crate) fn decode_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    rows: crate::ops::DecodeRows<'_>,
    out_rows: usize,
) -> Result<Tensor> {
    let (n, heads, hd) = q.dims3()?;
    rows.check("cuda-decode-attention", n, keys.dim(0)?)?;
    let kvh = keys.dim(1)?;
    if kvh == 0 || heads % kvh != 0 || keys.dims() != values.dims() || keys.dim(2)? != hd {
        return Err(Error::invalid(
            "cuda-decode-attention",
            format!("queries {:?} over keys {:?} and values {:?}", q.dims(), keys.dims(), values.dims()),
        ));
    }
    let (pairs, blocks) = rows_tensors(rows, q.device())?;
    let out_rows = out_rows.max(n);
    let op = DecodeAttention { rows: pairs, blocks, block: block_u32(rows)?, out_rows };
    let q = q.to_dtype(keys.dtype())?.contiguous()?;
    Ok(q.apply_op3_no_bwd(&keys.contiguous()?, &values.contiguous()?, &op)?
        .reshape((out_rows, heads * hd))?)
}

#[derive(Debug)]
struct DecodeAttention {
    rows: Tensor,
    blocks: Tensor,
    block: u32,
    /// Rows of the output, at least the queries' (the rest zeros).
    out_rows: usize,
}

impl candle_core::CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "cuda-decode-attention"
    }

    cpu_fwd_refused!(3);

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> CudaFwd {
        let (n, heads, hd) = l1.shape().dims3()?;
        let kvh = l2.dims()[1];
        if !decode_kernels_fit(hd) {
            candle_core::bail!(
                "cuda-decode-attention: head dimension {hd} (multiples of 32 up to {MAX_HEAD_DIM})"
            )
        }
        let (rows_storage, rows_layout) = self.rows.storage_and_layout();
        let (blocks_storage, blocks_layout) = self.blocks.storage_and_layout();
        let (Storage::Cuda(rs), Storage::Cuda(bs)) = (&*rows_storage, &*blocks_storage) else {
            candle_core::bail!("cuda-decode-attention: rows off the GPU")
        };
        let rows = view::<u32>(rs, rows_layout, self.name())?;
        let blocks = view::<u32>(bs, blocks_layout, self.name())?;
        let dev = s1.device();
        let func = decode_func!(dev, "decode_attention", s1.dtype());
        let (heads32, kvh32, hd32) = (heads as u32, kvh as u32, hd as u32);
        let scale = 1.0 / (hd as f32).sqrt();
        let (n32, out_rows) = (n as u32, self.out_rows);
        let cfg = LaunchConfig {
            grid_dim: (out_rows as u32, heads32, 1),
            block_dim: (WARP, 1, 1),
            shared_mem_bytes: 0,
        };
        macro_rules! launch {
            ($t:ty) => {{
                let q = view::<$t>(s1, l1, self.name())?;
                let (k, v) = (view::<$t>(s2, l2, self.name())?, view::<$t>(s3, l3, self.name())?);
                // SAFETY: uninitialised, and every element is written by the kernel below
                // (each (row, head) warp writes its head_dim outputs, zeros past n).
                let out = unsafe { dev.alloc::<$t>(out_rows * heads * hd) }?;
                let mut args = func.builder();
                args.arg(&q)
                    .arg(&k)
                    .arg(&v)
                    .arg(&rows)
                    .arg(&blocks)
                    .arg(&self.block)
                    .arg(&out)
                    .arg(&heads32)
                    .arg(&kvh32)
                    .arg(&hd32)
                    .arg(&scale)
                    .arg(&n32);
                // SAFETY: `decode_attention_*(q, keys, values, rows, blocks, block, out,
                // heads, kv_heads, head_dim, scale, n)` over (out_rows, heads) warps, those
                // of rows from n on writing zeros only: `rows` holds n pairs whose block
                // tables in `blocks` were checked against the cache's rows (each at least
                // one position), `q` `n heads head_dim` elements and `out` `out_rows heads
                // head_dim`, head_dim a multiple of 32 within the kernel's registers.
                if out_rows > 0 {
                    unsafe { args.launch(cfg) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((out, Shape::from((out_rows, heads, hd))))
    }
}

mod attention;
mod graph;
mod stacked;
pub(crate) use attention::{flash_attention_fits, segment_attention};
pub(crate) use graph::{DecodeGraphs, StepInputs};
pub(crate) use stacked::{add_rms_norm, decode_project, swiglu_stacked};
