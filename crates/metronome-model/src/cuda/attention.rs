//! Flash-style attention of a training batch's packed rows, per segment
//! (`kernels/attention.cu`): [`crate::Kernels::segment_attention`] under
//! [`crate::Kernels::Cuda`]. No `[T, T]` scores, probabilities or masks, and no copies
//! into a head-major layout: the kernels read `q`, `k` and `v` as the projections write
//! them. The forward keeps each query's log-sum-exp for the backward, which recomputes
//! the probabilities block by block. The tiles are laid out on the host
//! ([`crate::ops::FlashTiles`]) once per batch and device (a layer's 30-odd calls and
//! its backward share them).

use std::sync::{Arc, Mutex, Weak};

use candle_core::backend::BackendStorage;
use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CudaStorage, DType, Device, Layout, Shape, Storage, Tensor};

use super::{CudaFwd, FwdCpu, view};
use crate::ops::{FlashTiles, RowPlans, TILE};
use crate::{Error, Result};

/// `kernels/attention.cu`.
const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
/// Threads per block (`THREADS` there): four lanes for each of a tile's queries or keys.
const THREADS: u32 = 4 * TILE;

/// The largest head dimension the kernels take (`MAX_HD` there).
const MAX_HEAD_DIM: usize = 128;

/// Whether the kernels take heads of `head_dim`; others run the portable form.
pub(crate) fn flash_attention_fits(head_dim: usize) -> bool {
    (1..=MAX_HEAD_DIM).contains(&head_dim)
}

/// The tiles of a batch on one device: [`FlashTiles`]' arrays in one `u32` tensor.
#[derive(Debug)]
struct DeviceTiles {
    tiles: u32,
    n: usize,
    meta: Tensor,
    /// Where each array starts in `meta`: seg, keys, qtiles, ktiles, vrange, viewers, end.
    at: [usize; 7],
}

/// The batches' tiles lately used, by their plans (alive while the batch is) and device.
type TileCache = Vec<(Weak<RowPlans>, Device, Arc<DeviceTiles>)>;
static TILE_CACHE: Mutex<TileCache> = Mutex::new(Vec::new());

impl DeviceTiles {
    /// `plans`' tiles on `device`, laid out and uploaded on first use.
    fn of(plans: &Arc<RowPlans>, device: &Device) -> Result<Arc<Self>> {
        let mut cache = TILE_CACHE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        cache.retain(|(p, _, _)| p.strong_count() > 0);
        if let Some((_, _, t)) = cache
            .iter()
            .find(|(p, d, _)| std::ptr::eq(p.as_ptr(), Arc::as_ptr(plans)) && d.same_device(device))
        {
            return Ok(Arc::clone(t));
        }
        let t = FlashTiles::new(plans)?;
        let parts = [&t.seg, &t.keys, &t.qtiles, &t.ktiles, &t.vrange, &t.viewers];
        let mut at = [0; 7];
        let mut all = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        for (i, p) in parts.iter().enumerate() {
            at[i] = all.len();
            all.extend_from_slice(p);
        }
        at[6] = all.len();
        let len = all.len();
        let tiles = Arc::new(Self {
            tiles: t.tiles(),
            n: t.n as usize,
            meta: Tensor::from_vec(all, len, device)?,
            at,
        });
        // A few batches at a time (a trainer's and its reference's): beyond, the oldest goes.
        if cache.len() >= 8 {
            cache.remove(0);
        }
        cache.push((Arc::downgrade(plans), device.clone(), Arc::clone(&tiles)));
        Ok(tiles)
    }
}

/// Attention of packed rows' segments, `q: [n, heads, hd]`, `k`, `v: [n, kv_heads, hd]`
/// (f32 or bf16, `hd` that [`flash_attention_fits`]), each segment's query `i` seeing
/// its plan's first `visible + i + 1` keys, scaled by `1/sqrt(hd)`: `[n, heads * hd]`,
/// with its backward.
pub(crate) fn segment_attention(q: &Tensor, k: &Tensor, v: &Tensor, plans: &Arc<RowPlans>) -> Result<Tensor> {
    let tiles = DeviceTiles::of(plans, q.device())?;
    let (n, heads, hd) = q.dims3()?;
    let kv_heads = k.dim(1)?;
    if n != tiles.n
        || k.dims() != v.dims()
        || k.dims() != [n, kv_heads, hd]
        || kv_heads == 0
        || heads % kv_heads != 0
    {
        return Err(Error::invalid(
            "flash attention",
            format!("q {:?}, k {:?}, v {:?} for rows of {} positions", q.dims(), k.dims(), v.dims(), tiles.n),
        ));
    }
    if !flash_attention_fits(hd) {
        return Err(Error::invalid("flash attention", format!("heads of {hd}: the kernels take up to 128")));
    }
    let dtype = q.dtype();
    let (k, v) = (k.to_dtype(dtype)?, v.to_dtype(dtype)?);
    let op = FlashAttention { tiles, lse: Mutex::new(None) };
    let out = q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?;
    Ok(out.reshape((n, heads * hd))?)
}

/// The forward: `(q, k, v)` to the output `[n, heads, hd]`, keeping the log-sum-exps.
#[derive(Debug)]
struct FlashAttention {
    tiles: Arc<DeviceTiles>,
    /// Each query's log-sum-exp, `[n, heads]` f32, from the forward for the backward.
    lse: Mutex<Option<Tensor>>,
}

/// The operands' sizes, checked: `(n, heads, kv_heads, hd)`.
fn dims(
    q: &Layout,
    k: &Layout,
    v: &Layout,
    tiles: &DeviceTiles,
) -> candle_core::Result<(u32, u32, u32, u32)> {
    match (q.dims(), k.dims()) {
        (&[n, heads, hd], &[nk, kv_heads, khd])
            if n == tiles.n
                && nk == n
                && khd == hd
                && k.dims() == v.dims()
                && kv_heads > 0
                && heads % kv_heads == 0 =>
        {
            Ok((n as u32, heads as u32, kv_heads as u32, hd as u32))
        }
        _ => candle_core::bail!("cuda-flash-attention: q {:?}, k {:?}, v {:?}", q.dims(), k.dims(), v.dims()),
    }
}

/// A kernel of `kernels/attention.cu`, `$name_{f32,bf16}_{PL}` for `hd` up to `4 PL`,
/// loaded (a macro: candle does not name the type it returns).
macro_rules! flash_func {
    ($dev:expr, $name:literal, $dtype:expr, $hd:expr) => {{
        let ty = match $dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            other => candle_core::bail!("{}: the CUDA kernels take f32 and bf16, not {other:?}", $name),
        };
        let pl = match $hd {
            0..=32 => 8,
            33..=64 => 16,
            _ => 32,
        };
        $dev.get_or_load_custom_func(&format!("{}_{ty}_{pl}", $name), "metronome_attention", ATTENTION_PTX)?
    }};
}

/// One block per tile and head.
fn per_tile(tiles: u32, heads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (tiles, heads, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// The u32 views of the tiles' arrays, in [`DeviceTiles::at`]'s order.
macro_rules! meta_views {
    ($tiles:expr, $storage:expr, $layout:expr) => {{
        let all = view::<u32>($storage, $layout, "cuda-flash-attention")?;
        let a = $tiles.at;
        [
            all.slice(a[0]..a[1]),
            all.slice(a[1]..a[2]),
            all.slice(a[2]..a[3]),
            all.slice(a[3]..a[4]),
            all.slice(a[4]..a[5]),
            all.slice(a[5]..a[6]),
        ]
    }};
}

impl candle_core::CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "cuda-flash-attention"
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
        let (n, heads, kv_heads, hd) = dims(l1, l2, l3, &self.tiles)?;
        let dev = s1.device();
        let func = flash_func!(dev, "flash_fwd", s1.dtype(), hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let (ms, ml) = self.tiles.meta.storage_and_layout();
        let Storage::Cuda(ms) = &*ms else { candle_core::bail!("cuda-flash-attention: tiles off the GPU") };
        let [seg, keys, qtiles, ..] = meta_views!(self.tiles, ms, ml);
        let rows = n as usize * heads as usize;
        // SAFETY: uninitialised; every query of every head is in one tile, whose block
        // writes its log-sum-exp.
        let lse = unsafe { dev.alloc::<f32>(rows) }?;
        macro_rules! launch {
            ($t:ty) => {{
                let (q, k, v) = (
                    view::<$t>(s1, l1, self.name())?,
                    view::<$t>(s2, l2, self.name())?,
                    view::<$t>(s3, l3, self.name())?,
                );
                // SAFETY: uninitialised, and every element is written (as `lse`).
                let o = unsafe { dev.alloc::<$t>(rows * hd as usize) }?;
                let mut b = func.builder();
                b.arg(&q).arg(&k).arg(&v).arg(&o).arg(&lse).arg(&seg).arg(&keys).arg(&qtiles);
                b.arg(&heads).arg(&kv_heads).arg(&hd).arg(&scale);
                // SAFETY: `flash_fwd_*(q, k, v, o, lse, seg, keys, qtiles, heads, kv_heads,
                // hd, scale)` over (tiles, heads) blocks: `q` and `o` hold `n heads hd`
                // elements, `k` and `v` `n kv_heads hd`, `lse` `n heads`; the tiles'
                // arrays come from `FlashTiles` of this batch, whose positions are below
                // `n` (checked by `dims`).
                if self.tiles.tiles > 0 {
                    unsafe { b.launch(per_tile(self.tiles.tiles, heads)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(o, dev.clone())
            }};
        }
        let o = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        let lse = Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, dev.clone()));
        *self.lse.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Tensor::from_storage(lse, rows, BackpropOp::none(), false));
        Ok((o, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = self.lse.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone() else {
            candle_core::bail!("cuda-flash-attention: a backward without its forward")
        };
        let grad = FlashAttentionGrad {
            tiles: Arc::clone(&self.tiles),
            o: o.clone(),
            g: g.to_dtype(o.dtype())?.contiguous()?,
            lse,
        };
        // `[dq | dk | dv]` flat, in the inputs' type.
        let all = q.apply_op3_no_bwd(k, v, &grad)?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let dq = all.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = all.narrow(0, nq, nk)?.reshape(k.shape())?;
        let dv = all.narrow(0, nq + nk, nk)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The backward: `(q, k, v)` with the forward's output, its gradient and log-sum-exps
/// to `[dq | dk | dv]` flat: `flash_bwd_q` (which also writes each query's
/// `sum(dO o)`), then `flash_bwd_kv`.
#[derive(Debug)]
struct FlashAttentionGrad {
    tiles: Arc<DeviceTiles>,
    o: Tensor,
    g: Tensor,
    lse: Tensor,
}

impl candle_core::CustomOp3 for FlashAttentionGrad {
    fn name(&self) -> &'static str {
        "cuda-flash-attention-grad"
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
        let (n, heads, kv_heads, hd) = dims(l1, l2, l3, &self.tiles)?;
        if self.o.dims() != l1.dims() || self.g.dims() != l1.dims() || self.o.dtype() != s1.dtype() {
            candle_core::bail!(
                "cuda-flash-attention-grad: output {:?}, gradient {:?}",
                self.o.dims(),
                self.g.dims()
            )
        }
        let dev = s1.device();
        let fq = flash_func!(dev, "flash_bwd_q", s1.dtype(), hd);
        let fkv = flash_func!(dev, "flash_bwd_kv", s1.dtype(), hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let (ms, ml) = self.tiles.meta.storage_and_layout();
        let (os, ol) = self.o.storage_and_layout();
        let (gs, gl) = self.g.storage_and_layout();
        let (ls, ll) = self.lse.storage_and_layout();
        let (Storage::Cuda(ms), Storage::Cuda(os), Storage::Cuda(gs), Storage::Cuda(ls)) =
            (&*ms, &*os, &*gs, &*ls)
        else {
            candle_core::bail!("cuda-flash-attention-grad: operands off the GPU")
        };
        let [seg, keys, qtiles, ktiles, vrange, viewers] = meta_views!(self.tiles, ms, ml);
        let lse = view::<f32>(ls, ll, self.name())?;
        let (nq, nk) =
            (n as usize * heads as usize * hd as usize, n as usize * kv_heads as usize * hd as usize);
        // SAFETY: uninitialised; `flash_bwd_q` writes every query's (each is in one tile).
        let dsum = unsafe { dev.alloc::<f32>(n as usize * heads as usize) }?;
        let tiles = self.tiles.tiles;
        macro_rules! launch {
            ($t:ty) => {{
                let (q, k, v) = (
                    view::<$t>(s1, l1, self.name())?,
                    view::<$t>(s2, l2, self.name())?,
                    view::<$t>(s3, l3, self.name())?,
                );
                let (o, g) = (view::<$t>(os, ol, self.name())?, view::<$t>(gs, gl, self.name())?);
                // SAFETY: uninitialised; every position is a query of one tile (dq) and
                // a key of one tile of its own segment (dk, dv), whose blocks write it.
                let all = unsafe { dev.alloc::<$t>(nq + 2 * nk) }?;
                let (dq, dk, dv) = (all.slice(..nq), all.slice(nq..nq + nk), all.slice(nq + nk..));
                let mut b = fq.builder();
                b.arg(&q).arg(&k).arg(&v).arg(&o).arg(&g).arg(&lse).arg(&dsum).arg(&dq);
                b.arg(&seg).arg(&keys).arg(&qtiles).arg(&heads).arg(&kv_heads).arg(&hd).arg(&scale);
                // SAFETY: `flash_bwd_q_*(q, k, v, o, g, lse, dsum, dq, seg, keys, qtiles,
                // heads, kv_heads, hd, scale)` over (tiles, heads) blocks: `q`, `o`, `g`
                // and `dq` hold `n heads hd` elements, `k`, `v` `n kv_heads hd`, `lse`
                // and `dsum` `n heads`; the tiles as in the forward.
                if tiles > 0 {
                    unsafe { b.launch(per_tile(tiles, heads)) }.w()?;
                }
                let mut b = fkv.builder();
                b.arg(&q).arg(&k).arg(&v).arg(&g).arg(&lse).arg(&dsum).arg(&dk).arg(&dv);
                b.arg(&seg)
                    .arg(&ktiles)
                    .arg(&vrange)
                    .arg(&viewers)
                    .arg(&heads)
                    .arg(&kv_heads)
                    .arg(&hd)
                    .arg(&scale);
                // SAFETY: `flash_bwd_kv_*(q, k, v, g, lse, dsum, dk, dv, seg, ktiles,
                // vrange, viewers, heads, kv_heads, hd, scale)` over (tiles, kv_heads)
                // blocks, after `flash_bwd_q` on the same stream (which wrote `dsum`):
                // `dk`, `dv` hold `n kv_heads hd` elements; the viewers are segments of
                // this batch.
                if tiles > 0 {
                    unsafe { b.launch(per_tile(tiles, kv_heads)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(all, dev.clone())
            }};
        }
        let all = match s1.dtype() {
            DType::F32 => launch!(f32),
            _ => launch!(half::bf16),
        };
        Ok((all, Shape::from(nq + 2 * nk)))
    }
}
