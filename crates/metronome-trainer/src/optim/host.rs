//! The optimiser's element-wise work on the CPU, each as one pass in place: adding a
//! micro-batch's gradient into its f64 sum, the scaled sum of the accumulators as the
//! step's f32 gradient, and the AdamW update of a parameter and its moments.
//!
//! Composed from candle ops (which other devices run, `super`), each operation
//! allocates and walks a new parameter-sized tensor: about a dozen per parameter in an
//! AdamW step, three per micro-batch in the accumulation, 2.4% of the TRL-matched run
//! and a share of its allocator time. These passes do the same f32 and f64 operations
//! in the same order, `x * c + 0.0` where candle's scalar product is an affine map
//! with a zero offset, so the two forms agree bitwise (tested: the sums below, AdamW
//! in `super`), except the gradient norm's sum of squares, which runs in eight lanes.

use std::cell::RefCell;

use candle_core::{CpuStorage, Layout, Storage, Tensor};

use crate::{Result, TrainerError};

/// Whether `t` takes the host passes: on the CPU and contiguous.
pub(super) fn on_host(t: &Tensor) -> bool {
    t.device().is_cpu() && t.is_contiguous()
}

/// `x * mul + add`, candle's affine map of a tensor by scalars (`t * c` is `affine(c, 0)`,
/// `t + c` is `affine(1, c)`), rounded as candle rounds it.
#[inline(always)]
fn affine<T: std::ops::Mul<Output = T> + std::ops::Add<Output = T>>(x: T, mul: T, add: T) -> T {
    x * mul + add
}

/// `sum += g` element by element: `sum` f64, `g` f32 (exact in f64).
pub(super) fn add_into(sum: &Tensor, g: &Tensor) -> Result<()> {
    Ok(sum.inplace_op2(g, &AddInto { assign: false })?)
}

/// `sum = g` element by element, `g` widened to f64 (as `to_dtype` widens it): a new
/// sum in an old one's memory.
pub(super) fn assign_into(sum: &Tensor, g: &Tensor) -> Result<()> {
    Ok(sum.inplace_op2(g, &AddInto { assign: true })?)
}

/// [`add_into`], or with `assign` [`assign_into`].
struct AddInto {
    assign: bool,
}

impl candle_core::InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("add-into needs contiguous tensors")
        };
        let (CpuStorage::F64(sum), CpuStorage::F32(g)) = (s1, s2) else {
            candle_core::bail!("add-into adds an f32 gradient into an f64 sum")
        };
        let (sum, g) = (&mut sum[a0..a1], &g[b0..b1]);
        if sum.len() != g.len() {
            candle_core::bail!("add-into: a gradient of {} elements for a sum of {}", g.len(), sum.len())
        }
        if self.assign {
            for (s, &g) in sum.iter_mut().zip(g) {
                *s = f64::from(g);
            }
        } else {
            for (s, &g) in sum.iter_mut().zip(g) {
                *s += f64::from(g);
            }
        }
        Ok(())
    }
}

/// `Σ_k scale_k · sums_k` (f64 sums, the parts in order) as an f32 tensor shaped like
/// the first, and the f64 sum of the squares of the f64 total.
pub(super) fn scaled_sum(parts: &[(&Tensor, f64)]) -> Result<(Tensor, f64)> {
    let guards: Vec<_> = parts.iter().map(|(t, _)| t.storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(parts.len());
    for ((storage, layout), (_, scale)) in guards.iter().zip(parts) {
        let (Storage::Cpu(CpuStorage::F64(s)), Some((a, b))) = (&**storage, layout.contiguous_offsets())
        else {
            return Err(TrainerError::invalid("gradient sum", "needs contiguous f64 sums on the CPU"));
        };
        slices.push((&s[a..b], *scale));
    }
    let Some(&(first, _)) = slices.first() else {
        return Err(TrainerError::invalid("gradient sum", "of no sums"));
    };
    if let Some((s, _)) = slices.iter().find(|(s, _)| s.len() != first.len()) {
        return Err(TrainerError::invalid(
            "gradient sum",
            format!("of sums of {} and {} elements", first.len(), s.len()),
        ));
    }
    // In blocks of a few thousand elements, part by part (each a vectorisable pass),
    // the squares summed in LANES independent lanes: one running sum was a chain of
    // dependent f64 additions and most of the step's time here.
    const BLOCK: usize = 4096;
    const LANES: usize = 8;
    let mut total = [0f64; BLOCK];
    let mut lanes = [0f64; LANES];
    let mut out = Vec::with_capacity(first.len());
    for start in (0..first.len()).step_by(BLOCK) {
        let len = BLOCK.min(first.len() - start);
        let total = &mut total[..len];
        let (s0, scale0) = slices[0];
        for (t, &x) in total.iter_mut().zip(&s0[start..start + len]) {
            *t = affine(x, scale0, 0.0);
        }
        for &(s, scale) in &slices[1..] {
            for (t, &x) in total.iter_mut().zip(&s[start..start + len]) {
                *t += affine(x, scale, 0.0);
            }
        }
        let mut chunks = total.chunks_exact(LANES);
        for c in &mut chunks {
            for (l, &t) in lanes.iter_mut().zip(c) {
                *l += t * t;
            }
        }
        for (l, &t) in lanes.iter_mut().zip(chunks.remainder()) {
            *l += t * t;
        }
        out.extend(total.iter().map(|&t| t as f32));
    }
    let (t, _) = parts[0];
    Ok((Tensor::from_vec(out, t.shape(), t.device())?, lanes.iter().sum()))
}

/// One AdamW step's scalars, each the f32 that candle's composed form multiplies by.
#[derive(Clone, Copy, Debug)]
pub(super) struct Coefficients {
    pub(super) beta1: f32,
    pub(super) one_minus_beta1: f32,
    pub(super) beta2: f32,
    pub(super) one_minus_beta2: f32,
    /// `1 − lr · weight_decay`, for the parameters that decay.
    pub(super) keep: Option<f32>,
    /// `lr / (1 − beta1^t)`.
    pub(super) step: f32,
    /// `1 / (1 − beta2^t)`.
    pub(super) inv_bias2: f32,
    pub(super) eps: f32,
}

/// AdamW's update of the f32 parameter `theta` by its gradient `g`, with its moments
/// `m` and `v` updated on the way, in one pass:
///
/// ```text
/// m ← β1·m + (1 − β1)·g        v ← β2·v + (1 − β2)·g²
/// θ ← keep·θ − (lr / bc1)·m / (sqrt(v / bc2) + ε)
/// ```
pub(super) fn adamw_update(
    theta: &Tensor,
    g: &Tensor,
    m: &mut [f32],
    v: &mut [f32],
    c: Coefficients,
) -> Result<()> {
    Ok(theta.inplace_op2(g, &AdamWUpdate { moments: RefCell::new((m, v)), c })?)
}

struct AdamWUpdate<'a> {
    moments: RefCell<(&'a mut [f32], &'a mut [f32])>,
    c: Coefficients,
}

impl candle_core::InplaceOp2 for AdamWUpdate<'_> {
    fn name(&self) -> &'static str {
        "adamw-update"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("adamw-update needs contiguous tensors")
        };
        let (CpuStorage::F32(theta), CpuStorage::F32(g)) = (s1, s2) else {
            candle_core::bail!("adamw-update updates f32 parameters by f32 gradients")
        };
        let (theta, g) = (&mut theta[a0..a1], &g[b0..b1]);
        let mut moments = self.moments.borrow_mut();
        let (m, v) = &mut *moments;
        if [g.len(), m.len(), v.len()] != [theta.len(); 3] {
            candle_core::bail!(
                "adamw-update: {} parameters, {} gradients, moments of {} and {}",
                theta.len(),
                g.len(),
                m.len(),
                v.len()
            )
        }
        let c = self.c;
        for (((th, &g), m), v) in theta.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *m = affine(*m, c.beta1, 0.0) + affine(g, c.one_minus_beta1, 0.0);
            *v = affine(*v, c.beta2, 0.0) + affine(g * g, c.one_minus_beta2, 0.0);
            let kept = c.keep.map_or(*th, |k| affine(*th, k, 0.0));
            let update = affine(*m, c.step, 0.0) / affine(affine(*v, c.inv_bias2, 0.0).sqrt(), 1.0, c.eps);
            *th = kept - update;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Some exact zeros and negative zeros among them.
                match i % 11 {
                    0 => 0.0,
                    5 => -0.0,
                    _ => (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0,
                }
            })
            .collect()
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        let t = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
        t.to_vec1::<f64>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn host_accumulation_is_the_composed_arithmetic_bit_for_bit() {
        let dev = Device::Cpu;
        let g = |seed| Tensor::from_vec(values(seed, 48), (6, 8), &dev).unwrap();
        let sum = g(1).to_dtype(DType::F64).unwrap();
        let composed = (&sum + g(2).to_dtype(DType::F64).unwrap()).unwrap();
        add_into(&sum, &g(2)).unwrap();
        assert_eq!(bits(&sum), bits(&composed));

        // Less than one block of the scaled sum, and two blocks and a bit.
        for n in [48, 2 * 4096 + 13] {
            let part =
                |seed| Tensor::from_vec(values(seed, n), n, &dev).unwrap().to_dtype(DType::F64).unwrap();
            let (a, b) = (part(3), part(4));
            let (out, sq) = scaled_sum(&[(&a, 0.37), (&b, -2.5)]).unwrap();
            let total = ((&a * 0.37).unwrap() + (&b * -2.5).unwrap()).unwrap();
            assert_eq!(bits(&out), bits(&total.to_dtype(DType::F32).unwrap()));
            let want = total.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
            assert!((sq - want).abs() <= 1e-12 * want, "{sq} vs {want}");
        }
        let other = g(3).to_dtype(DType::F64).unwrap();
        let short = other.narrow(0, 0, 2).unwrap().contiguous().unwrap();
        let err = scaled_sum(&[(&other, 1.0), (&short, 1.0)]).unwrap_err().to_string();
        assert!(err.contains("of sums of 48 and 16 elements"), "{err}");
        // The candle error is the trainer error's source.
        let err = format!("{:?}", add_into(&sum, &g(4).narrow(0, 0, 3).unwrap()).unwrap_err());
        assert!(err.contains("a gradient of 24 elements for a sum of 48"), "{err}");
        let err = format!("{:?}", add_into(&sum, &other).unwrap_err());
        assert!(err.contains("f32 gradient into an f64 sum"), "{err}");
    }
}
