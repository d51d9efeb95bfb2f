//! Weights as host snapshots: what a trainer publishes and a rollout worker installs.
//! An install checks everything first (every tensor the model has, none it lacks or
//! holds twice, shapes, every element finite), so a refused snapshot leaves the model
//! as it was.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use metronome_core::PolicyVersion;

use super::{Init, Model};
use crate::{Error, ModelConfig, Result};

impl Model {
    /// An owned host copy of every weight, tagged with `version`. It never aliases
    /// the model's storage, so the optimiser may keep writing. With adapters, the
    /// projections hold the merged `W + (alpha / r)·B·A` ([`Model::merged`]): a
    /// snapshot is always of a plain model.
    pub fn snapshot(&self, version: PolicyVersion) -> Result<metronome_core::WeightSnapshot> {
        let tensors = self
            .weights()?
            .into_iter()
            .map(|(name, t)| {
                let shape = t.dims().to_vec();
                let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                Ok(metronome_core::HostTensor { name, shape, data: metronome_core::TensorData::F32(data) })
            })
            .collect::<Result<_>>()?;
        Ok(metronome_core::WeightSnapshot { version, tensors })
    }

    /// A model built from a snapshot (e.g. on a rollout worker). With
    /// `trainable == false` forward passes record no graphs.
    pub fn from_snapshot(
        cfg: ModelConfig,
        s: &metronome_core::WeightSnapshot,
        device: &Device,
        trainable: bool,
    ) -> Result<Self> {
        let what = || format!("snapshot version {}", s.version);
        let by_name = by_name(s)?;
        let mut used = std::collections::HashSet::new();
        let model = {
            let mut source = |name: &str, _shape: &[usize], _init: Init| -> Result<Tensor> {
                let t = by_name
                    .get(name)
                    .ok_or_else(|| Error::checkpoint(what(), format!("lacks tensor `{name}`")))?;
                used.insert(t.name.as_str());
                host_to_tensor(t, device)
            };
            Self::build(cfg, device, trainable, &mut source)?
        };
        refuse_unknown(s, |name| used.contains(name))?;
        Ok(model)
    }

    /// Overwrites every weight in place with the snapshot's, cast to the weights' type
    /// (every handle sharing these weights sees the change). Names and shapes must be exactly the model's and
    /// every element finite; all of it is checked before the first weight is written,
    /// so a refused snapshot leaves the model as it was. Refused for a handle with
    /// adapters, whose snapshots hold merged weights that its base must not take.
    pub fn load_snapshot(&self, s: &metronome_core::WeightSnapshot) -> Result<()> {
        if self.lora.is_some() {
            return Err(Error::invalid(
                "load_snapshot",
                "needs a plain model: this one has LoRA adapters (load into `Model::base`)",
            ));
        }
        let params = self.param_map();
        let by_name = by_name(s)?;
        let mut sources = Vec::with_capacity(params.len());
        for (name, var) in &params {
            let t = by_name.get(name.as_str()).ok_or_else(|| {
                Error::checkpoint(format!("snapshot version {}", s.version), format!("lacks tensor `{name}`"))
            })?;
            if t.shape != var.dims() {
                return Err(Error::checkpoint(
                    format!("snapshot version {}, tensor `{name}`", s.version),
                    format!("has shape {:?}, expected {:?}", t.shape, var.dims()),
                ));
            }
            check_host(t, s.version)?;
            sources.push((var, t));
        }
        refuse_unknown(s, |name| params.contains_key(name))?;
        for (var, t) in sources {
            match &t.data {
                // On the host, copied straight into the weight's storage.
                metronome_core::TensorData::F32(data)
                    if var.device().is_cpu() && var.dtype() == DType::F32 && var.is_contiguous() =>
                {
                    crate::ops::write_host(var.as_tensor(), |w| w.copy_from_slice(data))?;
                }
                // Elsewhere (a GPU, or weights of another type: a bf16 engine's), uploaded
                // and cast as `Model::compute_copy` casts, then copied into the storage.
                _ => var.set(&host_to_tensor(t, self.device())?.to_dtype(var.dtype())?)?,
            }
        }
        // The next decode step rebuilds the decode layout from the new weights.
        if let Ok(mut d) = self.inner.decode.write() {
            *d = None;
        }
        Ok(())
    }

    /// A deep, non-trainable copy: the frozen reference model (of a handle with
    /// adapters, the merged plain model).
    pub fn frozen_copy(&self) -> Result<Self> {
        let copy = self.frozen_copy_on(self.device())?;
        Ok(Self { kernels: self.kernels, ..copy })
    }

    /// A deep, non-trainable copy on `device` (e.g. a rollout engine's GPU), with that
    /// device's default kernels.
    pub fn frozen_copy_on(&self, device: &Device) -> Result<Self> {
        let s = self.snapshot(PolicyVersion(0))?;
        Self::from_snapshot(self.inner.cfg.clone(), &s, device, false)
    }
}

/// The snapshot's tensors by name, refusing a name held twice (which of the two
/// would load is not for a loader to guess).
fn by_name(s: &metronome_core::WeightSnapshot) -> Result<HashMap<&str, &metronome_core::HostTensor>> {
    let mut by_name = HashMap::with_capacity(s.tensors.len());
    for t in &s.tensors {
        if by_name.insert(t.name.as_str(), t).is_some() {
            return Err(Error::checkpoint(
                format!("snapshot version {}", s.version),
                format!("holds tensor `{}` twice", t.name),
            ));
        }
    }
    Ok(by_name)
}

/// Refuses a snapshot that holds tensors the model has none of (`known` says which
/// it has): weights saved from another architecture or a corrupted file would
/// otherwise load silently with some of their tensors dropped.
fn refuse_unknown(s: &metronome_core::WeightSnapshot, known: impl Fn(&str) -> bool) -> Result<()> {
    let unknown: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).filter(|n| !known(n)).collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let shown: Vec<String> = unknown.iter().take(4).map(|n| format!("`{n}`")).collect();
    let more = if unknown.len() > shown.len() {
        format!(" and {} more", unknown.len() - shown.len())
    } else {
        String::new()
    };
    Err(Error::checkpoint(
        format!("snapshot version {}", s.version),
        format!("holds tensors the model does not have: {}{more}", shown.join(", ")),
    ))
}

/// [`metronome_core::HostTensor::check`] as this crate's error, naming the tensor.
fn check_host(t: &metronome_core::HostTensor, version: PolicyVersion) -> Result<()> {
    t.check().map_err(|reason| {
        Error::checkpoint(format!("snapshot version {version}, tensor `{}`", t.name), reason)
    })
}

/// A host tensor as an f32 tensor on `device`.
fn host_to_tensor(t: &metronome_core::HostTensor, device: &Device) -> Result<Tensor> {
    use metronome_core::TensorData;
    t.check().map_err(|reason| Error::checkpoint(format!("tensor `{}`", t.name), reason))?;
    let data: Vec<f32> = match &t.data {
        TensorData::F32(v) => v.clone(),
        TensorData::Bf16(v) => v.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect(),
        TensorData::F16(v) => v.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect(),
    };
    Ok(Tensor::from_vec(data, t.shape.as_slice(), device)?)
}
