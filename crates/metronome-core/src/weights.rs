//! Weight snapshots as plain host data, so that transports and rollout workers can
//! move and install them without knowing the tensor library.

use serde::{Deserialize, Serialize};

use crate::PolicyVersion;

/// The element data of one tensor, in row-major order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum TensorData {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// bfloat16, as raw bits.
    Bf16(Vec<u16>),
    /// IEEE half precision, as raw bits.
    F16(Vec<u16>),
}

impl TensorData {
    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) | Self::F16(v) => v.len(),
        }
    }

    /// True when there are no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the elements occupy.
    #[must_use]
    pub fn num_bytes(&self) -> usize {
        match self {
            Self::F32(v) => v.len() * 4,
            Self::Bf16(v) | Self::F16(v) => v.len() * 2,
        }
    }
}

/// One named tensor held in host memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostTensor {
    /// The parameter name, in Hugging Face naming (e.g. `model.layers.0.mlp.up_proj.weight`).
    pub name: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// The elements.
    pub data: TensorData,
}

impl HostTensor {
    /// Why this tensor cannot be installed, if it cannot: its element count is not
    /// its shape's product, or an element is not finite (NaN or ±inf; the first one's
    /// index is named). A weight that is not finite would poison every forward pass
    /// far from the place it came from, so every installer checks first.
    pub fn check(&self) -> std::result::Result<(), String> {
        let expected = self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if expected != Some(self.data.len()) {
            return Err(format!("has {} elements for shape {:?}", self.data.len(), self.shape));
        }
        // Non-finite floats have every exponent bit set, in all three encodings.
        let bad = match &self.data {
            TensorData::F32(v) => v.iter().position(|x| !x.is_finite()),
            TensorData::Bf16(v) => v.iter().position(|&b| b & 0x7f80 == 0x7f80),
            TensorData::F16(v) => v.iter().position(|&b| b & 0x7c00 == 0x7c00),
        };
        match bad {
            Some(i) => Err(format!("element {i} is not finite")),
            None => Ok(()),
        }
    }
}

/// A complete set of policy weights at one version. It owns its data: it never
/// aliases the trainer's parameters, so the optimiser may keep writing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightSnapshot {
    /// The version these weights are.
    pub version: PolicyVersion,
    /// The tensors, in a stable order.
    pub tensors: Vec<HostTensor>,
}

impl WeightSnapshot {
    /// Total bytes of tensor data.
    #[must_use]
    pub fn num_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.num_bytes()).sum()
    }

    /// The tensor with the given name.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}
