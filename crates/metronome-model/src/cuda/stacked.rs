//! The decode layout's kernels: a cached forward of a frozen model on CUDA runs its
//! layers as nine launches each (`Model::extend_stacked` in `kv_cache.rs`): the
//! residual sum with the next RMSNorm (`add_rms_norm`), the stacked query/key/value
//! product, its bias, rotation and cache writes (`decode_project`), attention, the
//! output product, the residual sum and norm again, the stacked gate/up product, its
//! SwiGLU (`swiglu_stacked`) and the down product. On the GPU a decode step's time was
//! its launches (7.1 to 7.6 ms per step of SmolLM2-135M at 1 to 256 sequences alike on the H100, bf16),
//! so each launch saved is time saved. Their references are the composed forms in
//! `src/portable.rs`; `kernels/emulate/decode.cpp` runs them on the CPU in CI.

use candle_core::backend::BackendStorage;
use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::driver::{DevicePtr, PushKernelArg};
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape, Storage, Tensor};

use super::{CudaFwd, DECODE_PTX, FwdCpu, LAYER_PTX, block_u32, elementwise, per_row, rows_tensors, view};
use crate::{Error, Result};

/// `(x + y, rms_norm(x + y))` of two `[rows, d]` tensors, one kernel (forward only).
pub(crate) fn add_rms_norm(x: &Tensor, y: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let w = weight.to_dtype(x.dtype())?.contiguous()?;
    let y = y.to_dtype(x.dtype())?.contiguous()?;
    let both = x.contiguous()?.apply_op3_no_bwd(&y, &w, &AddRmsNorm { eps: eps as f32 })?;
    Ok((both.get(0)?.reshape(x.shape())?, both.get(1)?.reshape(x.shape())?))
}

#[derive(Debug, Clone, Copy)]
struct AddRmsNorm {
    eps: f32,
}

impl candle_core::CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "cuda-add-rms-norm"
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
        let (rows, d) = super::norm_dims(l1, l3)?;
        if l1.shape() != l2.shape() {
            candle_core::bail!("{}: summands {:?} and {:?}", self.name(), l1.dims(), l2.dims())
        }
        let dev = s1.device();
        let func = layer_func!(dev, "add_rms_norm", s1.dtype());
        let d32 = d as u32;
        macro_rules! launch {
            ($t:ty) => {{
                let (x, y) = (view::<$t>(s1, l1, self.name())?, view::<$t>(s2, l2, self.name())?);
                let w = view::<$t>(s3, l3, self.name())?;
                // SAFETY: uninitialised, and every element of both halves is written below.
                let out = unsafe { dev.alloc::<$t>(2 * rows * d) }?;
                let mut args = func.builder();
                args.arg(&x).arg(&y).arg(&w).arg(&out).arg(&d32).arg(&self.eps);
                // SAFETY: `add_rms_norm_*(x, y, w, out, d, eps)` over `rows` blocks: `x` and
                // `y` hold `rows * d` elements, `w` holds `d`, `out` `2 * rows * d`.
                if rows > 0 {
                    unsafe { args.launch(per_row(rows)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((out, Shape::from((2, rows, d))))
    }
}

/// `silu(gate) * up` of a stacked product `[rows, 2 inter]` (gate columns first),
/// `[rows, inter]`, one kernel (forward only).
pub(crate) fn swiglu_stacked(gate_up: &Tensor) -> Result<Tensor> {
    Ok(gate_up.contiguous()?.apply_op1_no_bwd(&SwiGluStacked)?)
}

#[derive(Debug, Clone, Copy)]
struct SwiGluStacked;

impl candle_core::CustomOp1 for SwiGluStacked {
    fn name(&self) -> &'static str {
        "cuda-swiglu-stacked"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> FwdCpu {
        candle_core::bail!("{} runs on CUDA devices only", self.name())
    }

    #[allow(unsafe_code, reason = "kernel launches: cudarc cannot check the arguments against the PTX")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout) -> CudaFwd {
        let (rows, width) = l1.shape().dims2()?;
        if width % 2 != 0 {
            candle_core::bail!("{}: {width} stacked columns are not two halves", self.name())
        }
        let inter = width / 2;
        let n = rows * inter;
        let dev = s1.device();
        let func = layer_func!(dev, "swiglu_stacked", s1.dtype());
        let inter32 = inter as u32;
        macro_rules! launch {
            ($t:ty) => {{
                let gu = view::<$t>(s1, l1, self.name())?;
                // SAFETY: uninitialised, and every element is written by the kernel below.
                let o = unsafe { dev.alloc::<$t>(n) }?;
                let mut args = func.builder();
                args.arg(&gu).arg(&o).arg(&inter32).arg(&n);
                // SAFETY: `swiglu_stacked_*(gu, o, inter, n)`: `gu` holds `2 n` elements,
                // `o` `n`; the kernel returns past `n`.
                if n > 0 {
                    unsafe { args.launch(elementwise(n)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(o, dev.clone())
            }};
        }
        let o = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((o, Shape::from((rows, inter))))
    }
}

/// The stacked product `qkv: [rows, (heads + 2 kv_heads) head_dim]` (rows from
/// `rows.len.len()` on are padding) made ready in one kernel: `bias` added, the
/// queries and keys rotated by `rope`, the keys and values written to `caches` at the
/// rows `rows` names; returns the rotated queries `[n, heads, head_dim]`.
/// [`crate::Kernels::decode_project`] under [`crate::Kernels::Cuda`] when each computed
/// row writes its own cache row.
pub(crate) fn decode_project(
    qkv: &Tensor,
    bias: Option<&Tensor>,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    rope: &crate::ops::RopeTables,
    (keys, values): (&Tensor, &Tensor),
    rows: crate::ops::DecodeRows<'_>,
) -> Result<Tensor> {
    let n = rows.len.len();
    rows.check("cuda-decode-project", n, keys.dim(0)?)?;
    let width = (heads + 2 * kv_heads) * head_dim;
    if qkv.dim(1)? != width
        || qkv.dim(0)? < n
        || keys.dims() != [keys.dim(0)?, kv_heads, head_dim]
        || keys.dims() != values.dims()
        || head_dim % 2 != 0
    {
        return Err(Error::invalid(
            "cuda-decode-project",
            format!(
                "product {:?} of {heads} query and {kv_heads} key heads of {head_dim} into caches {:?} and {:?}",
                qkv.dims(),
                keys.dims(),
                values.dims()
            ),
        ));
    }
    let (cos, sin) = rope.on(qkv.device(), n, head_dim / 2)?;
    let (pairs, blocks) = rows_tensors(rows, qkv.device())?;
    let bias = match bias {
        Some(b) => Some(b.to_dtype(keys.dtype())?.contiguous()?),
        None => None,
    };
    let op = DecodeProject {
        bias,
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
        rows: pairs,
        blocks,
        block: block_u32(rows)?,
        n,
        dims: (heads as u32, kv_heads as u32, head_dim as u32),
    };
    let qkv = qkv.to_dtype(keys.dtype())?.contiguous()?;
    Ok(qkv.apply_op3_no_bwd(keys, values, &op)?)
}

#[derive(Debug)]
struct DecodeProject {
    bias: Option<Tensor>,
    cos: Tensor,
    sin: Tensor,
    rows: Tensor,
    blocks: Tensor,
    block: u32,
    n: usize,
    dims: (u32, u32, u32),
}

/// The CUDA storage of a tensor an op holds (`storage` from its `storage_and_layout`).
fn on_gpu<'a>(storage: &'a Storage, op: &str) -> candle_core::Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        _ => candle_core::bail!("{op}: an operand off the GPU"),
    }
}

impl candle_core::CustomOp3 for DecodeProject {
    fn name(&self) -> &'static str {
        "cuda-decode-project"
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
        let (heads, kv_heads, hd) = self.dims;
        let dev = s1.device();
        let stream = dev.cuda_stream();
        let func = decode_func!(dev, "decode_project", s1.dtype());
        let per_row =
            (heads as usize + kv_heads as usize) * (hd as usize / 2) + kv_heads as usize * hd as usize;
        let total = self.n * per_row;
        let (Some((k0, k1)), Some((v0, v1))) = (l2.contiguous_offsets(), l3.contiguous_offsets()) else {
            candle_core::bail!("{}: caches not contiguous", self.name())
        };
        let has_bias = u32::from(self.bias.is_some());
        macro_rules! launch {
            ($t:ty) => {{
                let qkv = view::<$t>(s1, l1, self.name())?;
                let name = self.name();
                let ((cs, cl), (ss, sl)) = (self.cos.storage_and_layout(), self.sin.storage_and_layout());
                let ((rs, rl), (bs, bl)) = (self.rows.storage_and_layout(), self.blocks.storage_and_layout());
                let (cos, sin) = (
                    view::<f32>(on_gpu(&cs, name)?, &cl, name)?,
                    view::<f32>(on_gpu(&ss, name)?, &sl, name)?,
                );
                let (rows, blocks) = (
                    view::<u32>(on_gpu(&rs, name)?, &rl, name)?,
                    view::<u32>(on_gpu(&bs, name)?, &bl, name)?,
                );
                // Without a bias the kernel never reads the pointer it is given (the cosines').
                let bias_ptr = match &self.bias {
                    Some(b) => {
                        let (s, l) = b.storage_and_layout();
                        view::<$t>(on_gpu(&s, name)?, &l, name)?.device_ptr(&stream).0
                    }
                    None => cos.device_ptr(&stream).0,
                };
                // The caches are written through their pointers: candle lends an op's
                // operands read-only, and nothing else reads or writes a step's caches
                // while it runs (the engine holds them by `&mut`), on this stream.
                let keys = s2.as_cuda_slice::<$t>()?.slice(k0..k1).device_ptr(&stream).0;
                let values = s3.as_cuda_slice::<$t>()?.slice(v0..v1).device_ptr(&stream).0;
                // SAFETY: uninitialised, and every element (both halves of every query
                // head's pairs) is written by the kernel below.
                let q = unsafe { dev.alloc::<$t>(self.n * heads as usize * hd as usize) }?;
                let mut args = func.builder();
                args.arg(&qkv)
                    .arg(&bias_ptr)
                    .arg(&has_bias)
                    .arg(&cos)
                    .arg(&sin)
                    .arg(&rows)
                    .arg(&blocks)
                    .arg(&self.block)
                    .arg(&q)
                    .arg(&keys)
                    .arg(&values)
                    .arg(&heads)
                    .arg(&kv_heads)
                    .arg(&hd)
                    .arg(&total);
                // SAFETY: `decode_project_*(qkv, bias, has_bias, cos, sin, rows, blocks,
                // block, q, keys, values, heads, kv_heads, hd, total)`: `qkv` holds at
                // least n rows of (heads + 2 kv_heads) hd elements, `bias` one such row
                // when read, the tables n hd / 2 each, `rows` n pairs whose block tables
                // in `blocks` were checked against the caches' rows, `q` n heads hd; the
                // kernel returns past `total = n per_row`.
                if total > 0 {
                    unsafe { args.launch(elementwise(total)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(q, dev.clone())
            }};
        }
        let q = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((q, Shape::from((self.n, heads as usize, hd as usize))))
    }
}
