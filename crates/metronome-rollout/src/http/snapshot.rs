//! Weight snapshots as safetensors files, the format `load_weights` reads and the
//! weight hooks write.

use std::collections::{HashMap, HashSet};

use metronome_core::{HostTensor, PolicyVersion, TensorData, WeightSnapshot};

use crate::{Error, Result};

/// The snapshot as a safetensors file (f32, bf16 and f16 kept as they are); the version
/// goes into the metadata as `metronome_version`. A snapshot holding a tensor name
/// twice is refused, naming it (the `safetensors` writer panics on one, and a
/// snapshot from the transport is not checked for it before it is exported). A
/// resident snapshot is read back from its device first.
pub fn snapshot_to_safetensors(s: &WeightSnapshot) -> Result<Vec<u8>> {
    let s = &*s.on_host().map_err(|e| Error::model(e.to_string()))?;
    let mut names = HashSet::with_capacity(s.tensors.len());
    if let Some(twice) = s.tensors.iter().find(|t| !names.insert(t.name.as_str())) {
        return Err(Error::model(format!("tensor `{}` appears twice in the snapshot", twice.name)));
    }
    let bytes: Vec<(safetensors::Dtype, Vec<u8>)> = s
        .tensors
        .iter()
        .map(|t| match &t.data {
            TensorData::F32(v) => (safetensors::Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            TensorData::Bf16(v) => {
                (safetensors::Dtype::BF16, v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            TensorData::F16(v) => (safetensors::Dtype::F16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            TensorData::Resident(_) => unreachable!("read back by `on_host`"),
        })
        .collect();
    let views = s
        .tensors
        .iter()
        .zip(&bytes)
        .map(|(t, (dtype, b))| {
            safetensors::tensor::TensorView::new(*dtype, t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| Error::model(format!("tensor `{}`: {e}", t.name)))
        })
        .collect::<Result<Vec<_>>>()?;
    // `format: pt` is what `transformers` asks of a Hugging Face folder's weights.
    let meta = HashMap::from([
        ("metronome_version".to_owned(), s.version.to_string()),
        ("format".to_owned(), "pt".to_owned()),
    ]);
    safetensors::serialize(views, Some(meta)).map_err(Error::model)
}

/// A snapshot from a safetensors file's bytes (f32, bf16 or f16 tensors).
pub fn snapshot_from_safetensors(bytes: &[u8], version: PolicyVersion) -> Result<WeightSnapshot> {
    // The reader's own messages do not always say where (`invalid shape, data type,
    // or offset for tensor`): what it checks is the header and the offsets it gives.
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| Error::model(format!("the safetensors header does not describe the file: {e}")))?;
    let mut tensors = Vec::new();
    for (name, view) in st.iter() {
        let raw = view.data();
        let u16s = || raw.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        let data = match view.dtype() {
            safetensors::Dtype::F32 => TensorData::F32(
                raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            safetensors::Dtype::BF16 => TensorData::Bf16(u16s()),
            safetensors::Dtype::F16 => TensorData::F16(u16s()),
            other => return Err(Error::model(format!("tensor `{name}` has unsupported dtype {other:?}"))),
        };
        tensors.push(HostTensor { name: name.to_owned(), shape: view.shape().to_vec(), data });
    }
    Ok(WeightSnapshot { version, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_round_trip_through_safetensors() {
        let s = WeightSnapshot {
            version: PolicyVersion(7),
            tensors: vec![
                HostTensor {
                    name: "a.weight".into(),
                    shape: vec![2, 3],
                    data: TensorData::F32(vec![1.5, -2.0, 0.0, 3.25, f32::MIN_POSITIVE, 9.0]),
                },
                HostTensor {
                    name: "b.bias".into(),
                    shape: vec![2],
                    data: TensorData::Bf16(vec![0x3f80, 0xc000]),
                },
                HostTensor { name: "c".into(), shape: vec![1], data: TensorData::F16(vec![0x3c00]) },
            ],
        };
        let bytes = snapshot_to_safetensors(&s).unwrap();
        let mut back = snapshot_from_safetensors(&bytes, PolicyVersion(7)).unwrap();
        back.tensors.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(back, s);
        assert!(snapshot_from_safetensors(b"not a file", PolicyVersion(0)).is_err());
    }

    /// Found by the fuzz suite: `safetensors::serialize` panicked (index out of
    /// bounds) on a snapshot holding a name twice, which a weights message from the
    /// transport may, on its way to an OpenAI-compatible server.
    #[test]
    fn a_snapshot_holding_a_name_twice_is_refused_naming_it() {
        let t = HostTensor { name: "a.weight".into(), shape: vec![1], data: TensorData::F32(vec![1.0]) };
        let s = WeightSnapshot { version: PolicyVersion(1), tensors: vec![t.clone(), t] };
        let e = snapshot_to_safetensors(&s).unwrap_err().to_string();
        assert!(e.contains("tensor `a.weight` appears twice"), "{e}");
    }
}
