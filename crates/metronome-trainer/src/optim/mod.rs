//! Gradient accumulation, gradient-norm clipping and AdamW with visible state.
//!
//! candle-nn's `AdamW` keeps its moments private, so a checkpoint could not restore
//! them and a resumed run would diverge. This one exposes its state as named tensors.
//!
//! On the CPU each element-wise step runs as one pass in place (`host`); elsewhere
//! (a GPU) as composed candle ops. The two compute the same operations in the same
//! order and agree bit for bit in the gradients, parameters and moments (tested); the
//! gradient norm's sum of squares runs in lanes on the host (within 1e-12, tested).

mod host;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// Sums per-micro-batch gradients, keyed by parameter index.
///
/// Sums are kept in f64: each micro-batch's f32 gradient is exact in f64 and a sum of
/// a few of them is (nearly always) exact too, so the total does not depend on the
/// order in which micro-batches arrive. That is what makes completion-order training
/// equal to synchronous training to the last bit in practice, not only to rounding.
///
/// A sum read through [`GradAccumulator::sums`] is the accumulator's own, valid until
/// the next [`GradAccumulator::add`]: later micro-batches are added into it in place,
/// and after [`GradAccumulator::clear`] its memory takes the next period's first
/// gradient (a parameter-sized f64 tensor per parameter each period, allocated anew
/// before, was a share of the CPU trainer's allocator time).
#[derive(Debug, Default)]
pub struct GradAccumulator {
    sums: Vec<Option<Tensor>>,
    /// The sums [`GradAccumulator::clear`] let go, to be written over.
    spare: Vec<Option<Tensor>>,
    micro_batches: u64,
}

impl GradAccumulator {
    /// An empty accumulator for `num_params` parameters.
    #[must_use]
    pub fn new(num_params: usize) -> Self {
        Self { sums: vec![None; num_params], spare: vec![None; num_params], micro_batches: 0 }
    }

    /// Adds the gradients of `params` found in `grads`.
    pub fn add(&mut self, params: &[(String, Var)], grads: &GradStore) -> Result<()> {
        for (i, (_, var)) in params.iter().enumerate() {
            if let Some(g) = grads.get(var.as_tensor()) {
                // candle detaches the gradients of inner nodes but not those of the
                // variables themselves: a weight's gradient (e.g. `xᵀ·g` of a matmul) still
                // references the forward activations. Summed undetached, every step's
                // graph would stay reachable from the sums (measured: 7.6 MB per step on
                // the tiny model, until the process ran out of memory).
                let g = g.detach();
                self.sums[i] = Some(match self.sums[i].take() {
                    // The sum is this accumulator's own (converted here from an f32
                    // gradient, or copied by `restore`), so adding in place changes no
                    // one else's tensor; `sums` is read at once (a checkpoint's save).
                    Some(s)
                        if s.dtype() == DType::F64
                            && g.dtype() == DType::F32
                            && g.device().is_cpu()
                            && host::on_host(&s) =>
                    {
                        host::add_into(&s, &g.contiguous()?)?;
                        s
                    }
                    Some(s) => (s + g.to_dtype(DType::F64)?)?,
                    None => match self.spare.get_mut(i).and_then(Option::take) {
                        Some(s)
                            if s.dtype() == DType::F64
                                && s.dims() == g.dims()
                                && g.dtype() == DType::F32
                                && g.device().is_cpu()
                                && host::on_host(&s) =>
                        {
                            host::assign_into(&s, &g.contiguous()?)?;
                            s
                        }
                        _ => g.to_dtype(DType::F64)?.contiguous()?,
                    },
                });
            }
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Micro-batches added since the last clear.
    #[must_use]
    pub fn micro_batches(&self) -> u64 {
        self.micro_batches
    }

    /// The summed f64 gradient of each parameter (`None` where none arrived).
    #[must_use]
    pub fn sums(&self) -> &[Option<Tensor>] {
        &self.sums
    }

    /// Puts back sums saved from [`GradAccumulator::sums`] (for resuming mid-period).
    pub fn restore(&mut self, sums: Vec<Option<Tensor>>, micro_batches: u64) -> Result<()> {
        if sums.len() != self.sums.len() {
            return Err(TrainerError::invalid(
                "gradient accumulator",
                format!("got {} sums for {} parameters", sums.len(), self.sums.len()),
            ));
        }
        // Copies: later micro-batches are added into the sums in place.
        self.sums =
            sums.into_iter().map(|s| s.map(|s| s.copy()).transpose()).collect::<candle_core::Result<_>>()?;
        self.micro_batches = micro_batches;
        Ok(())
    }

    /// Forgets everything accumulated (keeping the sums' memory for the next ones).
    pub fn clear(&mut self) {
        for (sum, spare) in self.sums.iter_mut().zip(&mut self.spare) {
            if let Some(s) = sum.take() {
                *spare = Some(s);
            }
        }
        self.micro_batches = 0;
    }

    /// The accumulated gradients times `scale`, as f32 tensors shaped like the
    /// parameters (zeros where none arrived), and their global L2 norm (computed in
    /// f64; non-finite when any element is).
    pub fn finish(&self, params: &[(String, Var)], scale: f64) -> Result<(Vec<Tensor>, f64)> {
        Self::finish_sum(params, &[(self, scale)])
    }

    /// [`GradAccumulator::finish`] of `Σ_k scale_k · sums_k` over several
    /// accumulators of the same parameters (terms of a loss scaled apart at step
    /// time), summed in f64.
    pub fn finish_sum(params: &[(String, Var)], parts: &[(&Self, f64)]) -> Result<(Vec<Tensor>, f64)> {
        if let Some((a, _)) = parts.iter().find(|(a, _)| a.sums.len() != params.len()) {
            return Err(TrainerError::invalid(
                "gradient accumulator",
                format!("holds {} sums for {} parameters", a.sums.len(), params.len()),
            ));
        }
        let mut out = Vec::with_capacity(params.len());
        let mut sq = 0f64;
        for (i, (_, var)) in params.iter().enumerate() {
            let present: Vec<(&Tensor, f64)> =
                parts.iter().filter_map(|(a, scale)| a.sums[i].as_ref().map(|s| (s, *scale))).collect();
            if present.is_empty() {
                out.push(var.zeros_like()?);
            } else if var.dtype() == DType::F32
                && present.iter().all(|(s, _)| s.dtype() == DType::F64 && host::on_host(s))
            {
                let (g, squares) = host::scaled_sum(&present)?;
                sq += squares;
                out.push(g);
            } else {
                let mut total: Option<Tensor> = None;
                for (s, scale) in present {
                    let s = (s * scale)?;
                    total = Some(match total {
                        Some(t) => (t + s)?,
                        None => s,
                    });
                }
                let total = total.unwrap_or_else(|| unreachable!("at least one part is present"));
                sq += total.sqr()?.sum_all()?.to_scalar::<f64>()?;
                out.push(total.to_dtype(var.dtype())?);
            }
        }
        Ok((out, sq.sqrt()))
    }
}

/// Scales `grads` in place so that their global norm is at most `max_norm`; returns
/// the factor applied (1 when the norm was already within bounds).
pub fn clip_grad_norm(grads: &mut [Tensor], norm: f64, max_norm: f64) -> Result<f64> {
    if norm <= max_norm || norm == 0.0 {
        return Ok(1.0);
    }
    // The small epsilon matches PyTorch's clip_grad_norm_.
    let factor = max_norm / (norm + 1e-6);
    for g in grads.iter_mut() {
        *g = (&*g * factor)?;
    }
    Ok(factor)
}

/// AdamW's hyper-parameters (the learning rate comes from the schedule).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// Exponential decay of the first moment.
    pub beta1: f64,
    /// Exponential decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices (rank ≥ 2) only: norms and biases
    /// are not decayed, as in most LLM recipes.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

impl AdamWConfig {
    /// Checks the ranges; errors name the key under `prefix`.
    pub fn validate(&self, prefix: &str) -> Result<()> {
        for (name, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(TrainerError::config(
                    format!("{prefix}.{name}"),
                    format!("is {v}, expected 0 <= {name} < 1"),
                ));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(TrainerError::config(
                format!("{prefix}.eps"),
                format!("is {}, expected a positive number", self.eps),
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(TrainerError::config(
                format!("{prefix}.weight_decay"),
                format!("is {}, expected a number >= 0", self.weight_decay),
            ));
        }
        Ok(())
    }
}

/// AdamW (Loshchilov & Hutter) with PyTorch's update order and bias correction.
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    moments: Vec<Moments>,
    steps: u64,
}

/// One parameter's first and second moments: on the host for a parameter on the CPU
/// (updated in the same pass as the parameter), as tensors beside it elsewhere.
#[derive(Debug)]
enum Moments {
    Host { m: Vec<f32>, v: Vec<f32> },
    Tensors { m: Tensor, v: Tensor },
}

impl AdamW {
    /// Zero moments for `params`.
    pub fn new(cfg: AdamWConfig, params: &[(String, Var)]) -> Result<Self> {
        Self::with_moments(cfg, params, true)
    }

    /// Zero moments, kept on the host for the f32 parameters on the CPU when `host`.
    fn with_moments(cfg: AdamWConfig, params: &[(String, Var)], host: bool) -> Result<Self> {
        let moments = params
            .iter()
            .map(|(_, var)| {
                Ok(if host && var.dtype() == DType::F32 && host::on_host(var.as_tensor()) {
                    Moments::Host { m: vec![0.0; var.elem_count()], v: vec![0.0; var.elem_count()] }
                } else {
                    Moments::Tensors { m: var.zeros_like()?, v: var.zeros_like()? }
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { cfg, moments, steps: 0 })
    }

    /// Optimiser steps applied so far (bias correction uses it).
    #[must_use]
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One update of every parameter with its gradient.
    pub fn step(&mut self, params: &[(String, Var)], grads: &[Tensor], lr: f64) -> Result<()> {
        if grads.len() != params.len() {
            return Err(TrainerError::invalid(
                "optimizer step",
                format!("got {} gradients for {} parameters", grads.len(), params.len()),
            ));
        }
        self.steps += 1;
        let AdamWConfig { beta1, beta2, eps, weight_decay } = self.cfg;
        // Past i32::MAX steps the betas' powers are 0 in f64 anyway; a cast would wrap.
        let t = i32::try_from(self.steps).unwrap_or(i32::MAX);
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        for ((_, var), (g, moments)) in params.iter().zip(grads.iter().zip(&mut self.moments)) {
            let theta = var.as_tensor();
            let decay = if theta.rank() >= 2 { lr * weight_decay } else { 0.0 };
            match moments {
                Moments::Host { m, v } => {
                    // The f32 scalars candle's composed form (below) multiplies by.
                    let c = host::Coefficients {
                        beta1: beta1 as f32,
                        one_minus_beta1: (1.0 - beta1) as f32,
                        beta2: beta2 as f32,
                        one_minus_beta2: (1.0 - beta2) as f32,
                        keep: (decay > 0.0).then_some((1.0 - decay) as f32),
                        step: (lr / bc1) as f32,
                        inv_bias2: (1.0 / bc2) as f32,
                        eps: eps as f32,
                    };
                    host::adamw_update(theta, &g.to_dtype(DType::F32)?.contiguous()?, m, v, c)?;
                }
                Moments::Tensors { m: exp_avg, v: exp_avg_sq } => {
                    let m = ((&*exp_avg * beta1)? + (g * (1.0 - beta1))?)?;
                    let v = ((&*exp_avg_sq * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                    let theta = if decay > 0.0 { (theta * (1.0 - decay))? } else { theta.clone() };
                    let update = ((&m * (lr / bc1))? / ((&v * (1.0 / bc2))?.sqrt()? + eps)?)?;
                    var.set(&(theta - update)?)?;
                    *exp_avg = m;
                    *exp_avg_sq = v;
                }
            }
        }
        Ok(())
    }

    /// The moments as named tensors (`<param>.exp_avg`, `<param>.exp_avg_sq`), owned
    /// copies for a checkpoint.
    pub fn state(&self, params: &[(String, Var)]) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(2 * params.len());
        for ((name, var), moments) in params.iter().zip(&self.moments) {
            let (m, v) = match moments {
                Moments::Host { m, v } => (
                    Tensor::from_slice(m, var.shape(), var.device())?,
                    Tensor::from_slice(v, var.shape(), var.device())?,
                ),
                Moments::Tensors { m, v } => (m.copy()?, v.copy()?),
            };
            out.push((format!("{name}.exp_avg"), m));
            out.push((format!("{name}.exp_avg_sq"), v));
        }
        Ok(out)
    }

    /// Restores moments and the step count saved by [`AdamW::state`]; `lookup`
    /// returns the tensor of a name.
    pub fn restore(
        &mut self,
        params: &[(String, Var)],
        steps: u64,
        mut lookup: impl FnMut(&str) -> Option<Tensor>,
    ) -> Result<()> {
        for ((name, var), moments) in params.iter().zip(&mut self.moments) {
            let mut read = |suffix: &str| -> Result<Tensor> {
                let key = format!("{name}.{suffix}");
                let t = lookup(&key)
                    .ok_or_else(|| TrainerError::invalid("optimizer state", format!("lacks `{key}`")))?;
                if t.dims() != var.dims() {
                    return Err(TrainerError::invalid(
                        format!("optimizer state `{key}`"),
                        format!("has shape {:?}, the parameter has {:?}", t.dims(), var.dims()),
                    ));
                }
                Ok(t.to_dtype(var.dtype())?)
            };
            let (m, v) = (read("exp_avg")?, read("exp_avg_sq")?);
            match moments {
                Moments::Host { m: hm, v: hv } => {
                    *hm = m.flatten_all()?.to_vec1::<f32>()?;
                    *hv = v.flatten_all()?.to_vec1::<f32>()?;
                }
                Moments::Tensors { m: tm, v: tv } => {
                    *tm = m.to_device(var.device())?;
                    *tv = v.to_device(var.device())?;
                }
            }
        }
        self.steps = steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn accumulated_gradients_keep_no_graph() {
        let w = Var::from_slice(&[1.0f32, -2.0, 0.5, 3.0], (2, 2), &Device::Cpu).unwrap();
        let a = Var::from_slice(&[0.5f32, 1.5, -1.0, 2.0], (2, 2), &Device::Cpu).unwrap();
        let params = vec![("w".to_string(), w.clone())];
        let mut acc = GradAccumulator::new(1);
        for _ in 0..2 {
            // `x` is an activation: derived from a variable, so it is part of the graph,
            // and the weight's gradient `xᵀ·1` is built from it.
            let x = (a.as_tensor() * 2.0).unwrap();
            let grads = x.matmul(w.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(grads.get(w.as_tensor()).unwrap().track_op(), "the premise: candle keeps the graph");
            acc.add(&params, &grads).unwrap();
        }
        let sum = acc.sums()[0].as_ref().unwrap();
        assert!(!sum.track_op(), "the accumulated gradient holds the forward graph");
        assert_eq!(sum.to_vec2::<f64>().unwrap(), [[-2.0, -2.0], [14.0, 14.0]]);
    }

    #[test]
    fn adamw_matches_hand_computed_first_two_steps() {
        let w = Var::from_slice(&[1.0f32, -2.0, 0.5, 3.0], (2, 2), &Device::Cpu).unwrap();
        let b = Var::from_slice(&[0.5f32], 1, &Device::Cpu).unwrap();
        let params = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
        let cfg = AdamWConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = AdamW::new(cfg, &params).unwrap();
        let lr = 0.01;
        let gw = [0.1f64, -0.2, 0.0, 1.0];
        let gb = [2.0f64];
        let mk = |g: &[f64], shape: &[usize]| {
            Tensor::from_slice(&g.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape, &Device::Cpu).unwrap()
        };
        let grads = vec![mk(&gw, &[2, 2]), mk(&gb, &[1])];
        opt.step(&params, &grads, lr).unwrap();
        opt.step(&params, &grads, lr).unwrap();
        // Independent f64 reference.
        let reference = |theta0: f64, g: f64, decay: bool| {
            let (mut th, mut m, mut v) = (theta0, 0.0, 0.0);
            for t in 1..=2 {
                if decay {
                    th *= 1.0 - lr * 0.1;
                }
                m = 0.9 * m + 0.1 * g;
                v = 0.99 * v + 0.01 * g * g;
                let mh = m / (1.0 - 0.9f64.powi(t));
                let vh = v / (1.0 - 0.99f64.powi(t));
                th -= lr * mh / (vh.sqrt() + 1e-8);
            }
            th
        };
        let got_w: Vec<f32> = w.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for (i, &th0) in [1.0, -2.0, 0.5, 3.0].iter().enumerate() {
            let want = reference(th0, gw[i], true);
            assert!((f64::from(got_w[i]) - want).abs() < 1e-6, "w[{i}] {} vs {want}", got_w[i]);
        }
        let got_b: Vec<f32> = b.as_tensor().to_vec1().unwrap();
        assert!((f64::from(got_b[0]) - reference(0.5, 2.0, false)).abs() < 1e-6);
        assert_eq!(opt.steps(), 2);
    }

    #[test]
    fn adamw_on_the_host_is_the_composed_arithmetic_bit_for_bit() {
        let dev = Device::Cpu;
        let values = |seed: u32, n: usize| -> Vec<f32> {
            (0..n as u32)
                .map(|i| {
                    ((i.wrapping_mul(2_654_435_761) ^ seed).wrapping_mul(40_503) % 2001) as f32 / 1000.0 - 1.0
                })
                .collect()
        };
        let params = || {
            vec![
                ("w".to_string(), Var::from_vec(values(1, 15), (3, 5), &dev).unwrap()),
                ("b".to_string(), Var::from_vec(values(2, 5), 5, &dev).unwrap()),
            ]
        };
        let cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let (on_host, composed) = (params(), params());
        let mut a = AdamW::with_moments(cfg, &on_host, true).unwrap();
        let mut b = AdamW::with_moments(cfg, &composed, false).unwrap();
        assert!(
            matches!(a.moments[0], Moments::Host { .. }) && matches!(b.moments[0], Moments::Tensors { .. })
        );
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        for step in 0..3u32 {
            let grads = vec![
                Tensor::from_vec(values(10 + step, 15), (3, 5), &dev).unwrap(),
                Tensor::from_vec(values(20 + step, 5), 5, &dev).unwrap(),
            ];
            a.step(&on_host, &grads, 0.01).unwrap();
            b.step(&composed, &grads, 0.01).unwrap();
            for ((_, x), (_, y)) in on_host.iter().zip(&composed) {
                assert_eq!(bits(x.as_tensor()), bits(y.as_tensor()), "parameters after step {step}");
            }
            for ((k, x), (_, y)) in a.state(&on_host).unwrap().iter().zip(&b.state(&composed).unwrap()) {
                assert_eq!(bits(x), bits(y), "{k} after step {step}");
            }
        }
        // A restored state continues the same way.
        let saved: std::collections::HashMap<_, _> = a.state(&on_host).unwrap().into_iter().collect();
        let mut c = AdamW::new(cfg, &on_host).unwrap();
        c.restore(&on_host, a.steps(), |k| saved.get(k).cloned()).unwrap();
        assert_eq!(
            c.state(&on_host).unwrap().iter().map(|(_, t)| bits(t)).collect::<Vec<_>>(),
            a.state(&on_host).unwrap().iter().map(|(_, t)| bits(t)).collect::<Vec<_>>()
        );
        let err = c.restore(&on_host, 1, |_| None).unwrap_err().to_string();
        assert!(err.contains("lacks `w.exp_avg`"), "{err}");
    }

    #[test]
    fn clipping_bounds_the_norm() {
        let mut g = vec![Tensor::from_slice(&[3.0f32, 4.0], 2, &Device::Cpu).unwrap()];
        let f = clip_grad_norm(&mut g, 5.0, 1.0).unwrap();
        assert!((f - 1.0 / (5.0 + 1e-6)).abs() < 1e-12);
        let v: Vec<f32> = g[0].to_vec1().unwrap();
        assert!((v[0] - 0.6).abs() < 1e-5 && (v[1] - 0.8).abs() < 1e-5);
        assert_eq!(clip_grad_norm(&mut g, 0.5, 1.0).unwrap(), 1.0);
    }

    #[test]
    fn accumulator_sums_scales_and_reports_norm() {
        let x = Var::from_slice(&[1.0f32, 2.0], 2, &Device::Cpu).unwrap();
        let params = vec![("x".to_string(), x.clone())];
        let mut acc = GradAccumulator::new(1);
        for k in [1.0, 3.0] {
            let loss = (x.as_tensor() * k).unwrap().sum_all().unwrap();
            acc.add(&params, &loss.backward().unwrap()).unwrap();
        }
        let (g, norm) = acc.finish(&params, 0.5).unwrap();
        assert_eq!(g[0].to_vec1::<f32>().unwrap(), vec![2.0, 2.0]);
        assert!((norm - 8f64.sqrt()).abs() < 1e-12);
        assert_eq!(acc.micro_batches(), 2);
        let kept = acc.sums()[0].as_ref().unwrap().id();
        acc.clear();
        let (g, norm) = acc.finish(&params, 1.0).unwrap();
        assert_eq!(g[0].to_vec1::<f32>().unwrap(), vec![0.0, 0.0]);
        assert_eq!(norm, 0.0);
        // The next period's first gradient is written over the last period's sum: the
        // same tensor, holding the new gradient alone.
        let loss = (x.as_tensor() * 5.0).unwrap().sum_all().unwrap();
        acc.add(&params, &loss.backward().unwrap()).unwrap();
        let sum = acc.sums()[0].as_ref().unwrap();
        assert_eq!(sum.id(), kept);
        assert_eq!(sum.to_vec1::<f64>().unwrap(), vec![5.0, 5.0]);
    }

    #[test]
    fn accumulators_scaled_apart_sum_into_one_gradient() {
        let x = Var::from_slice(&[1.0f32, 2.0], 2, &Device::Cpu).unwrap();
        let params = vec![("x".to_string(), x.clone())];
        let (mut a, mut b) = (GradAccumulator::new(1), GradAccumulator::new(1));
        a.add(&params, &(x.as_tensor() * 2.0).unwrap().sum_all().unwrap().backward().unwrap()).unwrap();
        b.add(&params, &x.as_tensor().sqr().unwrap().sum_all().unwrap().backward().unwrap()).unwrap();
        // 0.5·[2, 2] + 3·[2, 4].
        let (g, norm) = GradAccumulator::finish_sum(&params, &[(&a, 0.5), (&b, 3.0)]).unwrap();
        assert_eq!(g[0].to_vec1::<f32>().unwrap(), vec![7.0, 13.0]);
        assert!((norm - (49f64 + 169.0).sqrt()).abs() < 1e-12);
        // An empty part adds nothing; one for other parameters is refused.
        b.clear();
        let (g, _) = GradAccumulator::finish_sum(&params, &[(&a, 1.0), (&b, 3.0)]).unwrap();
        assert_eq!(g[0].to_vec1::<f32>().unwrap(), vec![2.0, 2.0]);
        let other = GradAccumulator::new(2);
        let err = GradAccumulator::finish_sum(&params, &[(&a, 1.0), (&other, 1.0)]).unwrap_err().to_string();
        assert!(err.contains("2 sums for 1 parameters"), "{err}");
    }
}
