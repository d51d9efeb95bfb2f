//! The network's linear layers: which projection of a decoder layer a weight is
//! ([`Projection`], by its Hugging Face name), and the product `x·Wᵀ (+ b)`, plain
//! ([`linear`]), as one op whose backward makes the weight's gradient in its own
//! layout ([`fused_linear`]), and with a frozen weight whose backward skips the
//! weight's gradient ([`frozen_linear`], what a LoRA handle's base weights go through).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::fused_op_ran;
use crate::Result;

/// A linear projection of a decoder layer that may carry an adapter, by its PEFT
/// (Hugging Face module) name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Projection {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl Projection {
    /// Every projection, in layer order.
    pub const ALL: [Projection; 7] = [Self::Q, Self::K, Self::V, Self::O, Self::Gate, Self::Up, Self::Down];

    /// The PEFT `target_modules` name (`q_proj`, …, `down_proj`).
    #[must_use]
    pub fn peft_name(self) -> &'static str {
        match self {
            Self::Q => "q_proj",
            Self::K => "k_proj",
            Self::V => "v_proj",
            Self::O => "o_proj",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    /// The projection a PEFT `target_modules` name denotes.
    #[must_use]
    pub fn from_peft_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.peft_name() == name)
    }

    /// The Hugging Face module path inside a layer (`self_attn.q_proj`).
    pub(crate) fn module_path(self) -> String {
        let block = if matches!(self, Self::Gate | Self::Up | Self::Down) { "mlp" } else { "self_attn" };
        format!("{block}.{}", self.peft_name())
    }

    /// Its position in [`Projection::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// `x @ wᵀ (+ b)` for `x: [n, in]`, `w: [out, in]`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    with_bias(x.matmul(&w.t()?)?, b)
}

/// `x·Wᵀ` as one op, whose backward computes `dx = dy·W` and, unless the weight is
/// frozen, `dW = dyᵀ·x` directly in `W`'s `[out, in]` layout.
///
/// candle differentiates `x.matmul(&w.t())` through the transposed view: its matmul
/// rule makes `d(Wᵀ) = xᵀ·dy`, `[in, out]`, and the transpose's rule hands `W` that
/// transposed, which the gradient store then copies element by element into `[out, in]`
/// (5% of a training step of the tiny model on the CPU). A frozen weight (a LoRA
/// handle's base) skips `dW` altogether: candle's matmul backward computes the gradient
/// of both operands even when one is detached, which would pay a weight-gradient
/// product per projection and hold an `[out, in]` gradient of every layer until the
/// step (on SmolLM2-135M's shape that was ~1 GB of the LoRA step's peak memory). The
/// forward is the same storage matmul `Tensor::matmul` runs, so the values are bitwise
/// those of [`linear`].
struct Matmul {
    weight_grad: bool,
}

impl CustomOp2 for Matmul {
    fn name(&self) -> &'static str {
        if self.weight_grad { "linear-matmul" } else { "frozen-matmul" }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        fused_op_ran();
        let (m, k) = lx.shape().dims2()?;
        let (n, k2) = lw.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("{}: input of width {k} for a weight of width {k2}", self.name());
        }
        Ok((x.matmul(w, (1, m, n, k), lx, &lw.transpose(0, 1)?)?, (m, n).into()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dw = if self.weight_grad { Some(grad.t()?.matmul(x)?) } else { None };
        Ok((Some(grad.matmul(w)?), dw))
    }
}

/// `x·Wᵀ + b` through [`Matmul`]: the weight's gradient made in its own layout. A
/// fused CPU op: the model reaches it through `Kernels::linear`, which runs the plain
/// product under the portable kernels.
pub(crate) fn fused_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    with_bias(x.contiguous()?.apply_op2(w, Matmul { weight_grad: true })?, b)
}

/// `x·Wᵀ + b` for frozen `W` and `b` (detached) through [`Matmul`], so the backward
/// skips the weight's gradient. A fused CPU op: the model reaches it through
/// `Kernels::frozen_linear`, which runs the plain product under the portable kernels.
pub(crate) fn frozen_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    with_bias(x.contiguous()?.apply_op2(w, Matmul { weight_grad: false })?, b)
}

fn with_bias(y: Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    Ok(match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}
