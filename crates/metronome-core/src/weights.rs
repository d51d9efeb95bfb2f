//! Weight snapshots as plain host data, so that transports and rollout workers can
//! move and install them without knowing the tensor library; or, between two stages
//! of one process, as data left on the device that made it ([`Resident`]), which
//! the other stage installs by a device-to-device copy and everything that leaves the
//! process reads through [`WeightSnapshot::on_host`].

use std::any::Any;
use std::borrow::Cow;
use std::sync::Arc;

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
    /// Left on the device that made it (a trainer's GPU). Never serialised: whatever
    /// writes a snapshot out reads it through [`WeightSnapshot::on_host`] first.
    #[serde(skip)]
    Resident(Resident),
}

impl TensorData {
    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) | Self::F16(v) => v.len(),
            Self::Resident(r) => r.0.len(),
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
            Self::Resident(r) => r.0.num_bytes(),
        }
    }

    /// The elements in host memory: these, or a resident tensor's read back.
    pub fn on_host(&self) -> std::result::Result<Cow<'_, Self>, String> {
        match self {
            Self::Resident(r) => {
                let host = r.0.to_host()?;
                if matches!(host, Self::Resident(_)) {
                    return Err(format!("{r:?} read back as resident data"));
                }
                Ok(Cow::Owned(host))
            }
            host => Ok(Cow::Borrowed(host)),
        }
    }
}

/// Tensor data that stays on the device that made it, so that a stage of the same
/// process installs it by a copy on that device (on a GPU: device to device, ordered
/// after the source's last write) instead of a round trip through host memory. The
/// tensor library implements it (`metronome-model` for candle tensors); this crate
/// only moves it.
pub trait ResidentData: Any + Send + Sync + std::fmt::Debug {
    /// Number of elements.
    fn len(&self) -> usize;
    /// True when there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes the elements occupy where they are.
    fn num_bytes(&self) -> usize;
    /// The elements read back into host memory, as one of the host variants.
    fn to_host(&self) -> std::result::Result<TensorData, String>;
    /// Why the elements cannot be installed: one that is not finite (the first one's
    /// index named, as [`HostTensor::check`] does). By default read back and scanned
    /// on the host; an implementation may reduce on its device first.
    fn check_finite(&self) -> std::result::Result<(), String> {
        first_non_finite(&self.to_host()?)
    }
    /// For the installer of the same tensor library, to reach the tensor itself.
    fn as_any(&self) -> &dyn Any;
}

/// Resident tensor data ([`ResidentData`]), shared: cloning a snapshot clones no
/// device memory.
#[derive(Clone)]
pub struct Resident(pub Arc<dyn ResidentData>);

impl std::fmt::Debug for Resident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Equal when they are the same data, or their host forms are equal (tests compare
/// snapshots; nothing on a hot path does).
impl PartialEq for Resident {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || matches!((self.0.to_host(), other.0.to_host()), (Ok(a), Ok(b)) if a == b)
    }
}

/// One named tensor, held in host memory (or resident on a device: [`TensorData`]).
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
        match &self.data {
            TensorData::Resident(r) => r.0.check_finite(),
            host => first_non_finite(host),
        }
    }
}

/// Names the first element of host data that is not finite.
fn first_non_finite(data: &TensorData) -> std::result::Result<(), String> {
    // Non-finite floats have every exponent bit set, in all three encodings.
    let bad = match data {
        TensorData::F32(v) => first_where(v, |x| x.to_bits() & 0x7f80_0000 == 0x7f80_0000),
        TensorData::Bf16(v) => first_where(v, |b| b & 0x7f80 == 0x7f80),
        TensorData::F16(v) => first_where(v, |b| b & 0x7c00 == 0x7c00),
        TensorData::Resident(r) => return Err(format!("{r:?} is not host data")),
    };
    match bad {
        Some(i) => Err(format!("element {i} is not finite")),
        None => Ok(()),
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
/// aliases the trainer's parameters, so the optimiser may keep writing. Its tensors
/// are in host memory, or, as a trainer on a GPU publishes them, resident on that GPU
/// ([`TensorData::Resident`]): an engine of the same process copies them device to
/// device, and a transport or a file reads them through [`WeightSnapshot::on_host`].
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

    /// True when a tensor is resident on a device ([`TensorData::Resident`]).
    #[must_use]
    pub fn is_resident(&self) -> bool {
        self.tensors.iter().any(|t| matches!(t.data, TensorData::Resident(_)))
    }

    /// These weights with every tensor in host memory: borrowed when they are there
    /// already, read back from their device when resident (what a transport, a file
    /// or another process needs). A tensor that cannot be read back is named.
    pub fn on_host(&self) -> crate::Result<Cow<'_, Self>> {
        if !self.is_resident() {
            return Ok(Cow::Borrowed(self));
        }
        let tensors = self
            .tensors
            .iter()
            .map(|t| {
                let data = t.data.on_host().map_err(|e| {
                    crate::Error::invalid(format!("weights version {}, tensor `{}`", self.version, t.name), e)
                })?;
                Ok(HostTensor { name: t.name.clone(), shape: t.shape.clone(), data: data.into_owned() })
            })
            .collect::<crate::Result<_>>()?;
        Ok(Cow::Owned(Self { version: self.version, tensors }))
    }

    /// [`WeightSnapshot::on_host`], keeping these weights when they are there already.
    pub fn into_host(self) -> crate::Result<Self> {
        if self.is_resident() { self.on_host().map(Cow::into_owned) } else { Ok(self) }
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

    /// Host data behind the resident interface, with the trait's default check.
    #[derive(Debug)]
    struct Held(TensorData);

    impl ResidentData for Held {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn num_bytes(&self) -> usize {
            self.0.num_bytes()
        }
        fn to_host(&self) -> std::result::Result<TensorData, String> {
            Ok(self.0.clone())
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    /// Resident data is checked like host data (its element count against the shape,
    /// the first element that is not finite named), and reads back to it.
    #[test]
    fn resident_data_is_checked_and_read_back_as_host_data() {
        let resident = |v: Vec<f32>| TensorData::Resident(Resident(Arc::new(Held(TensorData::F32(v)))));
        let tensor = |data: TensorData, n: usize| HostTensor { name: "w".into(), shape: vec![n], data };
        assert_eq!(tensor(resident(vec![1.0; 5]), 5).check(), Ok(()));
        assert_eq!(tensor(resident(vec![1.0; 5]), 6).check(), Err("has 5 elements for shape [6]".into()));
        let mut v = vec![1.0; 5000];
        v[4321] = f32::INFINITY;
        assert_eq!(tensor(resident(v.clone()), 5000).check(), Err("element 4321 is not finite".into()));
        let snapshot =
            WeightSnapshot { version: PolicyVersion(3), tensors: vec![tensor(resident(v.clone()), 5000)] };
        assert!(snapshot.is_resident());
        let host = snapshot.on_host().unwrap().into_owned();
        assert!(!host.is_resident());
        assert_eq!(host.tensors[0].data, TensorData::F32(v));
        assert_eq!(snapshot.clone().into_host().unwrap(), host);
        assert!(matches!(host.on_host().unwrap(), Cow::Borrowed(_)), "host weights are not copied");
    }
}
