//! Weights as snapshots: what a trainer publishes and a rollout worker installs, in
//! host memory ([`Model::snapshot`]) or left on the model's device
//! ([`Model::snapshot_resident`]: a rollout engine of the same process installs those
//! by a device-to-device copy, with no host round trip). An install checks everything
//! first (every tensor the model has, none it lacks or holds twice, shapes, every
//! element finite), so a refused snapshot leaves the model as it was.

use std::collections::HashMap;
use std::sync::Arc;

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

    /// [`Model::snapshot`] left on the model's device: every weight an f32 copy of its
    /// own there (never the parameter's storage, so the optimiser may keep writing),
    /// made by one device copy each, without reading anything back. An engine of the
    /// same process installs it by another device copy ([`Model::load_snapshot`],
    /// [`Model::from_snapshot`]); a transport reads it back through
    /// [`metronome_core::WeightSnapshot::on_host`]. On a GPU the whole context is
    /// waited for before the copies and after them, as the install waits for its own
    /// (`synchronize_all`): candle's default handle puts each thread's work on that
    /// thread's stream, which nothing orders; between handles with streams of their
    /// own, cudarc's events order the copies as well.
    pub fn snapshot_resident(&self, version: PolicyVersion) -> Result<metronome_core::WeightSnapshot> {
        // The weights' last writes done before they are copied, and the copies done
        // before the snapshot leaves for another thread: a host snapshot's read back
        // waited for both.
        crate::device::synchronize_all(self.device())?;
        let tensors = self
            .weights()?
            .into_iter()
            .map(|(name, t)| {
                let shape = t.dims().to_vec();
                let copy = t.to_dtype(DType::F32)?.contiguous()?.copy()?;
                let data = metronome_core::TensorData::Resident(metronome_core::Resident(Arc::new(
                    DeviceWeight(copy),
                )));
                Ok(metronome_core::HostTensor { name, shape, data })
            })
            .collect::<Result<_>>()?;
        crate::device::synchronize_all(self.device())?;
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
        // Resident weights are checked together once the model is built (one read back).
        let mut resident = Vec::new();
        let model = {
            let mut source = |name: &str, _shape: &[usize], _init: Init| -> Result<Tensor> {
                let t = by_name
                    .get(name)
                    .ok_or_else(|| Error::checkpoint(what(), format!("lacks tensor `{name}`")))?;
                used.insert(t.name.as_str());
                if device_weight(t).is_some() {
                    resident.push(*t);
                } else {
                    check_host(t, s.version)?;
                }
                // The model's own storage: a resident weight is copied, not shared.
                Ok(match source_tensor(t, device)? {
                    Source::Resident(w) => w.copy()?,
                    Source::Made(w) => w,
                })
            };
            Self::build(cfg, device, trainable, &mut source)?
        };
        refuse_unknown(s, |name| used.contains(name))?;
        check_all(s.version, &resident)?;
        // Its weights written before another thread (an engine's worker) reads them.
        crate::device::synchronize_all(device)?;
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
            sources.push((var, t));
        }
        refuse_unknown(s, |name| params.contains_key(name))?;
        check_all(s.version, &sources.iter().map(|&(_, t)| *t).collect::<Vec<_>>())?;
        for (var, t) in sources {
            match &t.data {
                // On the host, copied straight into the weight's storage.
                metronome_core::TensorData::F32(data)
                    if var.device().is_cpu() && var.dtype() == DType::F32 && var.is_contiguous() =>
                {
                    crate::ops::write_host(var.as_tensor(), |w| w.copy_from_slice(data))?;
                }
                // Elsewhere (a GPU, weights of another type: a bf16 engine's, or resident
                // ones), uploaded or moved across devices and cast as
                // `Model::compute_copy` casts, then copied into the storage.
                _ => {
                    let (Source::Resident(w) | Source::Made(w)) = source_tensor(t, self.device())?;
                    var.set(&w.to_dtype(var.dtype())?)?;
                }
            }
        }
        // The decode layouts follow the new weights, and all of it is written before
        // another thread (an engine's worker) reads them.
        self.refresh_decode_layouts()?;
        crate::device::synchronize_all(self.device())?;
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
        let s = self.snapshot_resident(PolicyVersion(0))?;
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

/// A snapshot's tensor as an f32 tensor on a device.
enum Source {
    /// A resident weight already on the device: the snapshot's own storage, to copy
    /// before keeping it.
    Resident(Tensor),
    /// Made from host data, or a resident weight copied from another device (device
    /// to device): a storage of its own.
    Made(Tensor),
}

/// Checks every tensor of `tensors` ([`metronome_core::HostTensor::check`]: its element
/// count against its shape, every element finite), naming the first bad one. A resident
/// weight of this crate is summed where it is ([`DeviceWeight::check_finite`]) and the
/// sums of all of them read back together: one synchronisation of the device per
/// install, not one per tensor.
fn check_all(version: PolicyVersion, tensors: &[&metronome_core::HostTensor]) -> Result<()> {
    let mut reduced = Vec::new();
    for &t in tensors {
        let numel = t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        match device_weight(t) {
            Some(w) if numel == Some(w.0.elem_count()) => reduced.push((t, w.0.sum_all()?)),
            _ => check_host(t, version)?,
        }
    }
    if reduced.is_empty() {
        return Ok(());
    }
    let sums: Vec<Tensor> = reduced.iter().map(|(_, s)| s.clone()).collect();
    // Weights on several devices cannot be stacked: each sum is then read on its own.
    let sums = match Tensor::stack(&sums, 0) {
        Ok(all) => all.to_vec1::<f32>()?,
        Err(_) => sums.iter().map(|s| s.to_scalar::<f32>()).collect::<candle_core::Result<_>>()?,
    };
    for ((t, _), sum) in reduced.iter().zip(sums) {
        // Not finite: a bad element, or finite ones whose sum overflowed; the host says which.
        if !sum.is_finite() {
            check_host(t, version)?;
        }
    }
    Ok(())
}

/// The weight of [`Model::snapshot_resident`] behind `t`, if it is one.
fn device_weight(t: &metronome_core::HostTensor) -> Option<&DeviceWeight> {
    match &t.data {
        metronome_core::TensorData::Resident(r) => r.0.as_any().downcast_ref::<DeviceWeight>(),
        _ => None,
    }
}

/// A snapshot's tensor as an f32 tensor on `device`, once [`check_all`] has passed it.
fn source_tensor(t: &metronome_core::HostTensor, device: &Device) -> Result<Source> {
    use metronome_core::TensorData;
    let data: Vec<f32> = match &t.data {
        TensorData::F32(v) => v.clone(),
        TensorData::Bf16(v) => v.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect(),
        TensorData::F16(v) => v.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect(),
        TensorData::Resident(_) => {
            return match device_weight(t) {
                Some(w) if w.0.device().same_device(device) => {
                    Ok(Source::Resident(w.0.reshape(t.shape.as_slice())?))
                }
                Some(w) => Ok(Source::Made(w.0.to_device(device)?.reshape(t.shape.as_slice())?)),
                // Another library's resident data: through the host.
                None => {
                    let data =
                        t.data.on_host().map_err(|e| Error::checkpoint(format!("tensor `{}`", t.name), e))?;
                    let host = metronome_core::HostTensor {
                        name: t.name.clone(),
                        shape: t.shape.clone(),
                        data: data.into_owned(),
                    };
                    source_tensor(&host, device)
                }
            };
        }
    };
    Ok(Source::Made(Tensor::from_vec(data, t.shape.as_slice(), device)?))
}

/// A weight of [`Model::snapshot_resident`]: an f32 copy on the model's device.
struct DeviceWeight(Tensor);

impl std::fmt::Debug for DeviceWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} f32 elements on {:?}", self.0.elem_count(), self.0.device().location())
    }
}

impl metronome_core::ResidentData for DeviceWeight {
    fn len(&self) -> usize {
        self.0.elem_count()
    }

    fn num_bytes(&self) -> usize {
        self.0.elem_count() * DType::F32.size_in_bytes()
    }

    fn to_host(&self) -> std::result::Result<metronome_core::TensorData, String> {
        let v = self.0.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| e.to_string())?;
        Ok(metronome_core::TensorData::F32(v))
    }

    /// One reduction where the weight is: a sum is finite only when every element is
    /// (a NaN or an infinity survives any addition), so only a sum that is not (a bad
    /// element, or an overflow of finite ones) is read back to name the element.
    fn check_finite(&self) -> std::result::Result<(), String> {
        let sum = self.0.sum_all().and_then(|s| s.to_scalar::<f32>()).map_err(|e| e.to_string())?;
        if sum.is_finite() {
            return Ok(());
        }
        let host = metronome_core::HostTensor {
            name: String::new(),
            shape: vec![self.len()],
            data: self.to_host()?,
        };
        host.check()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
