//! Model shapes by name from `benches/llama_shapes.json`, the file the PyTorch
//! benchmarks (`benches/torch_gpu.py`) build their models from, so both sides measure
//! the same shape. Each entry is a Hugging Face `config.json` subset (`model_type`
//! `qwen2` for the Qwen2.5 shapes, Llama otherwise).

use anyhow::{Context, Result};
use metronome_model::ModelConfig;

const SHAPES: &str = include_str!("../../benches/llama_shapes.json");

/// The shape named `name` as a command line writes it: `smollm2-135m`,
/// `qwen2.5-0.5b`, `qwen2.5-1.5b` or `tiny` (the file's keys, with `-` and `.` for `_`).
pub(crate) fn shape(name: &str) -> Result<ModelConfig> {
    let key = name.to_lowercase().replace(['-', '.'], "_");
    let all: serde_json::Map<String, serde_json::Value> = serde_json::from_str(SHAPES)?;
    let entry = all.get(&key).with_context(|| {
        let known: Vec<&str> = all.keys().map(String::as_str).collect();
        format!("unknown shape `{name}` (benches/llama_shapes.json has {})", known.join(", "))
    })?;
    Ok(ModelConfig::from_hf_json(&entry.to_string())?)
}
