//! Values computed without an autograd graph, attached to their inputs by one graph
//! node whose backward recomputes what it needs. Two parts of the training forward
//! use it: the chunked log-prob head (`head.rs`), which never keeps `[targets, vocab]`
//! logits for its backward, and gradient checkpointing of decoder layers (crate
//! `model`), which keeps a layer's input instead of its activations.
//!
//! candle records a node per op and keeps every node's inputs alive until the backward
//! pass ends; it has no checkpointing and no way to give a composition of ops a
//! backward of its own other than a custom op. [`attach`] is that custom op: its
//! forward copies a value computed beforehand from detached inputs (a storage copy,
//! the same on every backend, so it needs no kernel of its own and runs on CUDA as it
//! does on the CPU), and its backward is a closure given the output's gradient.
//!
//! A custom op has at most three inputs and a decoder layer reads a dozen weights, so
//! [`Links`] chains the weights into one small anchor tensor, the attached node's
//! second input. candle runs a node's backward before those of its inputs (it walks
//! the graph in topological order from the loss), so the layer's backward has run,
//! and left each weight's gradient in the links, when the links' backwards hand them
//! on: every weight receives its gradient through the one `loss.backward()`, and no
//! caller needs to know that a layer was checkpointed.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Layout, Shape, Storage, Tensor, Var};

use crate::Result;

/// The backward of an attached value: from its two inputs and the gradient of the
/// value, the gradients of the inputs.
pub(crate) type Backward = Box<
    dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> + Send + Sync,
>;

/// `value` as a function of `a` and `b` for autograd: the returned tensor equals
/// `value`, and the backward pass calls `backward(a, b, d value)` for the gradients of
/// `a` and `b`. `value` must have been computed from detached tensors (no graph of its
/// own); when neither input records a graph it is returned as it is.
pub(crate) fn attach(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    value: Tensor,
    backward: Backward,
) -> Result<Tensor> {
    if !a.track_op() && !b.track_op() {
        return Ok(value);
    }
    // The copy in the forward takes the value's whole storage, so the value must start
    // at its storage's first element and be laid out row-major.
    let value = if value.is_contiguous() && value.layout().start_offset() == 0 {
        value
    } else {
        value.affine(1.0, 0.0)?
    };
    Ok(a.apply_op2(b, Attached { name, value: Mutex::new(Some(value)), backward })?)
}

/// The custom op of [`attach`]. The value is taken out when the forward runs, so the
/// graph keeps only the op's output (one copy), not the value beside it.
struct Attached {
    name: &'static str,
    value: Mutex<Option<Tensor>>,
    backward: Backward,
}

impl Attached {
    fn take(&self) -> candle_core::Result<Tensor> {
        let mut slot = self.value.lock().unwrap_or_else(PoisonError::into_inner);
        slot.take().ok_or_else(|| candle_core::Error::msg(format!("{}: the forward ran twice", self.name)))
    }
}

impl CustomOp2 for Attached {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let value = self.take()?;
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.clone(), layout.shape().clone())),
            _ => candle_core::bail!("{}: the value is not on the CPU", self.name),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let value = self.take()?;
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{}: the value is not on the GPU", self.name),
        }
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _value: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        (self.backward)(a, b, grad)
    }
}

/// Weights chained into one anchor tensor (see the module docs): the attached node
/// takes the anchor as its second input, its backward [`Links::deliver`]s each
/// weight's gradient, and the links' own backwards, which candle runs afterwards,
/// hand them to the weights.
#[derive(Clone)]
pub(crate) struct Links {
    vars: Arc<Vec<Var>>,
    slots: Arc<Mutex<Vec<Option<Tensor>>>>,
}

impl Links {
    /// The links of `vars` (the weights that record gradients) and their anchor, a
    /// one-element f32 tensor that depends on every one of them.
    pub(crate) fn new(vars: Vec<Var>, device: &candle_core::Device) -> Result<(Self, Tensor)> {
        let links = Self { slots: Arc::new(Mutex::new(vec![None; vars.len()])), vars: Arc::new(vars) };
        let mut anchor = Tensor::zeros(1, DType::F32, device)?;
        for (slot, var) in links.vars.iter().enumerate() {
            anchor = anchor.apply_op2(var.as_tensor(), Link { slot, slots: Arc::clone(&links.slots) })?;
        }
        Ok((links, anchor))
    }

    /// Moves each weight's gradient out of `grads` (a backward pass over a recomputed
    /// graph that reads the same weights) into the links, detached: candle leaves a
    /// variable's gradient attached to the graph it came from (a matmul's `xᵀ·g` keeps
    /// `x`), and a gradient kept until the optimiser step would keep every recomputed
    /// layer's activations alive with it, which is what checkpointing is to avoid.
    pub(crate) fn deliver(&self, grads: &mut GradStore) {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        for (slot, var) in slots.iter_mut().zip(self.vars.iter()) {
            *slot = grads.remove(var.as_tensor()).map(|g| g.detach());
        }
    }

    /// Hands the links each weight's gradient, in the order of the weights given to
    /// [`Links::new`] (a backward that computes them itself, e.g. a decoder layer on
    /// host buffers).
    pub(crate) fn hand(&self, grads: Vec<Tensor>) {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        for (slot, g) in slots.iter_mut().zip(grads) {
            *slot = Some(g);
        }
    }
}

/// The [`Links`] of a fixed set of weights, made on first use and kept: a chain is a
/// few tensors per weight, which a decoder layer run on host buffers would otherwise
/// make again on every forward. The chain's tensors are reused by every graph that
/// attaches to it; each backward pass hands its gradients through the slots and takes
/// them out again before the next can run on this model.
#[derive(Default)]
pub(crate) struct LinkCache(OnceLock<(Links, Tensor)>);

impl LinkCache {
    /// The links and anchor of `vars`, made by the first call.
    pub(crate) fn get(
        &self,
        vars: impl FnOnce() -> Vec<Var>,
        device: &candle_core::Device,
    ) -> Result<(Links, Tensor)> {
        if let Some(made) = self.0.get() {
            return Ok(made.clone());
        }
        let made = Links::new(vars(), device)?;
        Ok(self.0.get_or_init(|| made).clone())
    }
}

impl std::fmt::Debug for LinkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() { "LinkCache(made)" } else { "LinkCache(empty)" })
    }
}

/// One link of the chain: forward, a copy of the chain's one element; backward, the
/// chain's gradient passed on and the weight's gradient taken from its slot.
struct Link {
    slot: usize,
    slots: Arc<Mutex<Vec<Option<Tensor>>>>,
}

impl CustomOp2 for Link {
    fn name(&self) -> &'static str {
        "checkpoint-link"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((s.clone(), l.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok((s.try_clone(l)?, l.shape().clone()))
    }

    fn bwd(
        &self,
        _chain: &Tensor,
        _weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        Ok((Some(grad.clone()), slots.get_mut(self.slot).and_then(Option::take)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// `y = sum(x·w)` attached with a hand-written backward equals the plain
    /// composition's gradients, and the links deliver weights' gradients.
    #[test]
    fn attached_values_take_their_gradients_from_the_closure() {
        let dev = Device::Cpu;
        let x = Var::from_slice(&[1.0f32, -2.0, 3.0], 3, &dev).unwrap();
        let w = Var::from_slice(&[0.5f32, 0.25, -1.0], 3, &dev).unwrap();
        let v = Var::from_slice(&[2.0f32], 1, &dev).unwrap();
        let plain =
            ((x.as_tensor() * w.as_tensor()).unwrap().sum_keepdim(0).unwrap() * v.as_tensor()).unwrap();
        let want = plain.sum_all().unwrap().backward().unwrap();

        // The same through `attach`: x·w recomputed in the backward, `w` and `v`
        // delivered through links.
        let (links, anchor) = Links::new(vec![w.clone(), v.clone()], &dev).unwrap();
        let value = ((x.as_tensor().detach() * w.as_tensor().detach()).unwrap().sum_keepdim(0).unwrap()
            * v.as_tensor().detach())
        .unwrap();
        let (w2, v2, l2) = (w.clone(), v.clone(), links.clone());
        let got = attach(
            "test",
            x.as_tensor(),
            &anchor,
            value,
            Box::new(move |x, anchor, grad| {
                let xv = Var::from_tensor(&x.detach())?;
                let y = ((xv.as_tensor() * w2.as_tensor())?.sum_keepdim(0)? * v2.as_tensor())?;
                let mut grads = (y * grad)?.sum_all()?.backward()?;
                l2.deliver(&mut grads);
                Ok((grads.remove(xv.as_tensor()), Some(anchor.zeros_like()?)))
            }),
        )
        .unwrap();
        assert_eq!(got.to_vec1::<f32>().unwrap(), plain.to_vec1::<f32>().unwrap());
        let grads = got.sum_all().unwrap().backward().unwrap();
        for var in [&x, &w, &v] {
            let (a, b) = (grads.get(var.as_tensor()).unwrap(), want.get(var.as_tensor()).unwrap());
            assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        }
        // Nothing records a graph: the value itself comes back.
        let d = x.as_tensor().detach();
        let same = attach("test", &d, &d, d.clone(), Box::new(|_, _, _| Ok((None, None)))).unwrap();
        assert!(!same.track_op());
    }
}
