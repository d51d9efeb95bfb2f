//! GGUF checkpoints (llama.cpp's format): weights dequantised to f32 and the
//! embedded tokenizer.

use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};

use crate::config::{Architecture, ModelConfig};
use crate::model::{Init, Model};
use crate::tokenizer::GgufTokenizer;
use crate::{Error, Result};

/// The GGUF tensor name of a Hugging Face parameter name.
fn gguf_name(hf: &str) -> String {
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        let (i, tail) = rest.split_once('.').unwrap_or((rest, ""));
        let t = match tail {
            "input_layernorm.weight" => "attn_norm.weight",
            "post_attention_layernorm.weight" => "ffn_norm.weight",
            "self_attn.q_proj.weight" => "attn_q.weight",
            "self_attn.q_proj.bias" => "attn_q.bias",
            "self_attn.k_proj.weight" => "attn_k.weight",
            "self_attn.k_proj.bias" => "attn_k.bias",
            "self_attn.v_proj.weight" => "attn_v.weight",
            "self_attn.v_proj.bias" => "attn_v.bias",
            "self_attn.o_proj.weight" => "attn_output.weight",
            "mlp.gate_proj.weight" => "ffn_gate.weight",
            "mlp.up_proj.weight" => "ffn_up.weight",
            "mlp.down_proj.weight" => "ffn_down.weight",
            other => other,
        };
        return format!("blk.{i}.{t}");
    }
    match hf {
        "model.embed_tokens.weight" => "token_embd.weight".to_owned(),
        "model.norm.weight" => "output_norm.weight".to_owned(),
        "lm_head.weight" => "output.weight".to_owned(),
        other => other.to_owned(),
    }
}

/// llama.cpp stores Llama's query and key rows interleaved per rotary pair; this
/// undoes its `permute` so Hugging Face's rotate-half rotary applies.
fn unpermute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let hd = rows / heads;
    Ok(w.reshape((heads, hd / 2, 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))?)
}

/// The GGUF file at `path`, open, with its header, metadata and tensor index read (no
/// tensor data); errors name the file.
fn read_content(path: &Path) -> Result<(std::fs::File, Content)> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let content =
        Content::read(&mut file).map_err(|e| Error::checkpoint(path.display().to_string(), e.to_string()))?;
    Ok((file, content))
}

impl GgufTokenizer {
    /// The tokenizer and chat template the GGUF file at `path` embeds, from its metadata
    /// alone: no tensor is read (what [`Model::load_gguf`] returns beside the weights).
    pub fn from_gguf(path: &Path) -> Result<Self> {
        Self::from_metadata(&read_content(path)?.1.metadata, &path.display().to_string())
    }
}

impl Model {
    /// Loads a GGUF file of the llama or qwen2 architecture, dequantising every
    /// tensor to f32, with the tokenizer and chat template it embeds. The model is
    /// trainable; use [`Model::with_trainable`] for inference only.
    pub fn load_gguf(path: &Path, device: &Device) -> Result<(Self, GgufTokenizer)> {
        let file_name = path.display().to_string();
        let (mut file, content) = read_content(path)?;
        let md = &content.metadata;
        let key = |k: &str| format!("{file_name}: metadata `{k}`");
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .ok_or_else(|| Error::checkpoint(key("general.architecture"), "is missing"))?;
        let architecture = match arch.as_str() {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            other => {
                return Err(Error::checkpoint(
                    key("general.architecture"),
                    format!("`{other}` is not supported (llama or qwen2)"),
                ));
            }
        };
        let num = |k: &str| -> Result<u64> {
            let full = format!("{arch}.{k}");
            match md.get(&full) {
                Some(Value::U32(v)) => Ok(u64::from(*v)),
                Some(Value::U64(v)) => Ok(*v),
                Some(Value::I32(v)) if *v >= 0 => Ok(*v as u64),
                Some(Value::I64(v)) if *v >= 0 => Ok(*v as u64),
                Some(_) => Err(Error::checkpoint(key(&full), "is not a non-negative integer")),
                None => Err(Error::checkpoint(key(&full), "is missing")),
            }
        };
        let float = |k: &str, default: f64| -> f64 {
            md.get(&format!("{arch}.{k}")).and_then(|v| v.to_f32().ok()).map_or(default, f64::from)
        };
        let tokenizer = GgufTokenizer::from_metadata(md, &file_name)?;
        let embed_info = content.tensor_infos.get("token_embd.weight").ok_or_else(|| {
            Error::checkpoint(format!("{file_name}: tensor `token_embd.weight`"), "is missing")
        })?;
        let hidden_size = num("embedding_length")? as usize;
        let heads = num("attention.head_count")? as usize;
        let kv_heads = num("attention.head_count_kv").unwrap_or(heads as u64) as usize;
        let head_dim = num("attention.key_length").map_or(hidden_size / heads.max(1), |v| v as usize);
        let cfg = ModelConfig {
            architecture,
            vocab_size: embed_info.shape.dims()[0],
            hidden_size,
            intermediate_size: num("feed_forward_length")? as usize,
            num_hidden_layers: num("block_count")? as usize,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: num("context_length")? as usize,
            rope_theta: float("rope.freq_base", 10_000.0),
            rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-6),
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
            bos_token_id: tokenizer.bos_token_id(),
            eos_token_id: md.get("tokenizer.ggml.eos_token_id").and_then(|v| v.to_u32().ok()),
        };
        cfg.validate().map_err(|e| Error::checkpoint(format!("{file_name}: metadata"), e.to_string()))?;
        let mut source = |name: &str, shape: &[usize], _init: Init| -> Result<Tensor> {
            let g = gguf_name(name);
            let what = format!("{file_name}: tensor `{g}`");
            // Checked before reading: the metadata's sizes are not trusted to match.
            let info = content.tensor_infos.get(&g).ok_or_else(|| Error::checkpoint(&what, "is missing"))?;
            if info.shape.elem_count() != shape.iter().product::<usize>() {
                let dims = info.shape.dims();
                return Err(Error::checkpoint(&what, format!("has shape {dims:?}, expected {shape:?}")));
            }
            let q = content
                .tensor(&mut file, &g, &Device::Cpu)
                .map_err(|e| Error::checkpoint(&what, e.to_string()))?;
            let t = q.dequantize(&Device::Cpu).map_err(|e| Error::checkpoint(&what, e.to_string()))?;
            let t = if architecture == Architecture::Llama && name.ends_with("q_proj.weight") {
                unpermute(&t, heads)?
            } else if architecture == Architecture::Llama && name.ends_with("k_proj.weight") {
                unpermute(&t, kv_heads)?
            } else {
                t
            };
            Ok(t.to_device(device)?)
        };
        let model = Self::build(cfg, device, true, &mut source)?;
        Ok((model, tokenizer))
    }
}

/// Inverse of [`unpermute`], as llama.cpp's converter applies it; for tests that
/// write GGUF files.
#[doc(hidden)]
pub fn permute_for_gguf(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let hd = rows / heads;
    Ok(w.reshape((heads, 2, hd / 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))?)
}

/// The GGUF tensor name of a Hugging Face parameter name (for tests that write GGUF).
#[doc(hidden)]
#[must_use]
pub fn hf_to_gguf_name(hf: &str) -> String {
    gguf_name(hf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_round_trips() {
        let w = Tensor::arange(0f32, 48.0, &Device::Cpu).unwrap().reshape((8, 6)).unwrap();
        let back = unpermute(&permute_for_gguf(&w, 2).unwrap(), 2).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        assert_eq!(gguf_name("model.layers.3.mlp.up_proj.weight"), "blk.3.ffn_up.weight");
    }
}
