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
