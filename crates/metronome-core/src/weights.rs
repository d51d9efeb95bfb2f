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
            TensorData::F32(v) => first_where(v, |x| x.to_bits() & 0x7f80_0000 == 0x7f80_0000),
            TensorData::Bf16(v) => first_where(v, |b| b & 0x7f80 == 0x7f80),
            TensorData::F16(v) => first_where(v, |b| b & 0x7c00 == 0x7c00),
        };
        match bad {
            Some(i) => Err(format!("element {i} is not finite")),
            None => Ok(()),
        }
    }
}

/// The index of the first element of `v` that `hit` holds for. Scanned in blocks with
/// no early exit inside one, which the compiler vectorises: every install checks every
/// weight this way, and an element-by-element `position` took 48 ms over SmolLM2-135M's
/// 540 MB (`cargo bench -p metronome-model --bench model -- install`).
fn first_where<T: Copy>(v: &[T], hit: impl Fn(T) -> bool) -> Option<usize> {
    const BLOCK: usize = 4096;
    v.chunks(BLOCK).enumerate().find_map(|(i, block)| {
        if block.iter().fold(false, |any, &x| any | hit(x)) {
            block.iter().position(|&x| hit(x)).map(|j| i * BLOCK + j)
        } else {
            None
        }
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The block scan names the first non-finite element wherever it lies: first and
    /// last of a block, across blocks, in the last partial block, and in each encoding.
    #[test]
    fn check_names_the_first_non_finite_element() {
        let tensor = |data: TensorData| HostTensor { name: "w".into(), shape: vec![data.len()], data };
        let n = 3 * 4096 + 17;
        for (bad, first) in [
            (vec![0], 0),
            (vec![4095], 4095),
            (vec![4096, 9000], 4096),
            (vec![9000, n - 1], 9000),
            (vec![n - 1], n - 1),
        ] {
            for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut v = vec![1.5f32; n];
                for &i in &bad {
                    v[i] = value;
                }
                let want = Err(format!("element {first} is not finite"));
                assert_eq!(tensor(TensorData::F32(v.clone())).check(), want, "f32 {value} at {bad:?}");
                let bf16 = v.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
                assert_eq!(tensor(TensorData::Bf16(bf16)).check(), want, "bf16 {value} at {bad:?}");
            }
            let mut h = vec![0x3c00u16; n]; // f16 1.0
            for &i in &bad {
                h[i] = 0x7e00; // f16 NaN
            }
            assert_eq!(tensor(TensorData::F16(h)).check(), Err(format!("element {first} is not finite")));
        }
        let big = vec![f32::MAX; n];
        assert_eq!(tensor(TensorData::F32(big)).check(), Ok(()), "the largest finite value passes");
    }
}
