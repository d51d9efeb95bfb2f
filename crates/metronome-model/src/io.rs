//! Hugging Face checkpoints: `config.json` with `model.safetensors` (or a sharded
//! `model.safetensors.index.json`), in and out.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::config::ModelConfig;
use crate::model::{Init, Model};
use crate::{Error, Result};

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// Decodes one safetensors tensor to f32.
pub(crate) fn view_to_tensor(
    view: &safetensors::tensor::TensorView<'_>,
    what: &str,
    device: &Device,
) -> Result<Tensor> {
    let bytes = view.data();
    let data: Vec<f32> = match view.dtype() {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => {
            bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
        Dtype::F16 => {
            bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
        other => {
            return Err(Error::checkpoint(what, format!("has dtype {other:?} (f32, bf16 or f16 expected)")));
        }
    };
    Ok(Tensor::from_vec(data, view.shape(), device)?)
}

impl Model {
    /// Loads a Hugging Face checkpoint directory: `config.json` and either
    /// `model.safetensors` or `model.safetensors.index.json` with its shards. Weights
    /// in bf16 or f16 are widened to f32. The model is trainable.
    pub fn load_hf(dir: &Path, device: &Device) -> Result<Self> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        // Which file holds each tensor.
        let (files, weight_map): (Vec<String>, HashMap<String, usize>) = if single.exists() {
            (vec!["model.safetensors".to_owned()], HashMap::new())
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| Error::checkpoint(index.display().to_string(), format!("not JSON: {e}")))?;
            let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| {
                Error::checkpoint(index.display().to_string(), "has no `weight_map` object")
            })?;
            let mut files: Vec<String> = Vec::new();
            let mut weight_map = HashMap::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    Error::checkpoint(
                        index.display().to_string(),
                        format!("`weight_map.{name}` is not a file name"),
                    )
                })?;
                let i = files.iter().position(|f| f == file).unwrap_or_else(|| {
                    files.push(file.to_owned());
                    files.len() - 1
                });
                weight_map.insert(name.clone(), i);
            }
            (files, weight_map)
        } else {
            return Err(Error::checkpoint(
                dir.display().to_string(),
                "has neither model.safetensors nor model.safetensors.index.json",
            ));
        };
        let buffers: Vec<Vec<u8>> = files.iter().map(|f| read(&dir.join(f))).collect::<Result<_>>()?;
        let parsed: Vec<SafeTensors<'_>> = buffers
            .iter()
            .zip(&files)
            .map(|(b, f)| {
                SafeTensors::deserialize(b)
                    .map_err(|e| Error::checkpoint(dir.join(f).display().to_string(), e.to_string()))
            })
            .collect::<Result<_>>()?;
        let mut source = |name: &str, _shape: &[usize], _init: Init| -> Result<Tensor> {
            let file = weight_map.get(name).copied().unwrap_or(0);
            let what = format!("{}: tensor `{name}`", dir.join(&files[file]).display());
            let view = parsed[file].tensor(name).map_err(|_| Error::checkpoint(&what, "is missing"))?;
            view_to_tensor(&view, &what, device)
        };
        Self::build(cfg, device, true, &mut source)
    }

    /// Writes `config.json` and `model.safetensors` (f32, `format: pt` metadata) to
    /// `dir`, creating it; `transformers` loads the result with
    /// `AutoModelForCausalLM.from_pretrained(dir)`. A handle with adapters writes the
    /// merged model (its base alone is `self.base().save_hf(dir)`).
    pub fn save_hf(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let config = dir.join("config.json");
        std::fs::write(&config, self.config().to_hf_json()).map_err(|e| Error::io(&config, e))?;
        write_safetensors(&dir.join("model.safetensors"), self.weights()?)
    }
}

/// Writes f32 `tensors` to a safetensors file with `format: pt` metadata (what
/// `transformers` and `peft` expect).
pub(crate) fn write_safetensors(path: &Path, tensors: Vec<(String, Tensor)>) -> Result<()> {
    let mut buffers = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let values = t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        buffers.push((name, t.dims().to_vec(), bytes));
    }
    let views = buffers
        .iter()
        .map(|(name, shape, bytes)| {
            safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| Error::checkpoint(format!("tensor `{name}`"), e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| Error::checkpoint(path.display().to_string(), e.to_string()))
}
