//! The network's hyper-parameters, read from and written to Hugging Face `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::tokenizer::CharTokenizer;
use crate::{Error, Result};

/// Which member of the decoder family a checkpoint is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Architecture {
    /// Llama: no projection biases.
    #[default]
    Llama,
    /// Qwen2: biases on the query, key and value projections.
    Qwen2,
}

impl Architecture {
    /// Whether q/k/v projections carry a bias.
    #[must_use]
    pub fn qkv_bias(self) -> bool {
        matches!(self, Self::Qwen2)
    }

    fn hf_names(self) -> (&'static str, &'static str) {
        match self {
            Self::Llama => ("LlamaForCausalLM", "llama"),
            Self::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        }
    }
}

/// Hyper-parameters of a Llama/Qwen2-family decoder, named as in Hugging Face's
/// `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Llama or Qwen2.
    pub architecture: Architecture,
    /// Vocabulary size (rows of the embedding and of the LM head).
    pub vocab_size: usize,
    /// Model width `d`.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Width of one head (`hidden_size / num_attention_heads` unless the config says otherwise).
    pub head_dim: usize,
    /// Longest sequence the rotary table covers.
    pub max_position_embeddings: usize,
    /// Rotary base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token id, when the config names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id, when the config names one.
    pub eos_token_id: Option<u32>,
}

impl ModelConfig {
    /// The built-in CPU configuration for tests and tiny tasks: the character
    /// vocabulary, 2 layers, width 128, 4 query and 2 key/value heads, MLP width 384.
    #[must_use]
    pub fn tiny() -> Self {
        Self {
            architecture: Architecture::Llama,
            vocab_size: CharTokenizer::VOCAB_SIZE,
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            max_position_embeddings: 1024,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            bos_token_id: Some(CharTokenizer::BOS),
            eos_token_id: Some(CharTokenizer::EOS),
        }
    }

    /// The shape of SmolLM2-135M (Llama architecture, 30 layers, width 576, 9 query
    /// and 3 key/value heads, MLP width 1536, a 49152-token vocabulary, tied head;
    /// 134.5 M parameters), for benchmarks with random weights of the real shape.
    #[must_use]
    pub fn smollm2_135m() -> Self {
        Self {
            vocab_size: 49152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_hidden_layers: 30,
            num_attention_heads: 9,
            num_key_value_heads: 3,
            head_dim: 64,
            max_position_embeddings: 8192,
            rope_theta: 100_000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            ..Self::tiny()
        }
    }

    /// Query heads per key/value head.
    #[must_use]
    pub fn num_queries_per_kv(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Parses a Hugging Face `config.json` (Llama or Qwen2 family).
    pub fn from_hf_json(text: &str) -> Result<Self> {
        Self::parse(text, "config.json")
    }

    /// Reads and parses a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&text, &path.display().to_string())
    }

    fn parse(text: &str, file: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::config(file, format!("not JSON: {e}")))?;
        let field = |name: &str| format!("{file}: field `{name}`");
        let usize_of = |name: &str| -> Result<usize> {
            v.get(name)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| Error::config(field(name), "missing or not a non-negative integer"))
        };
        let f64_or = |name: &str, default: f64| -> Result<f64> {
            match v.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_f64().ok_or_else(|| Error::config(field(name), "not a number")),
            }
        };
        let token_id = |name: &str| -> Option<u32> {
            match v.get(name) {
                Some(Value::Number(n)) => n.as_u64().map(|x| x as u32),
                // Some configs list several end tokens; the first is the canonical one.
                Some(Value::Array(a)) => a.first().and_then(Value::as_u64).map(|x| x as u32),
                _ => None,
            }
        };
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("llama");
        let architecture = match model_type {
            "llama" | "mistral" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            other => {
                return Err(Error::config(
                    field("model_type"),
                    format!("`{other}` is not supported (llama, mistral or qwen2)"),
                ));
            }
        };
        // transformers 5 moved `rope_theta` and `rope_scaling` into `rope_parameters`.
        let rope_params = v.get("rope_parameters").filter(|s| !s.is_null());
        if let Some(rp) = rope_params {
            let kind = rp.get("rope_type").and_then(Value::as_str).unwrap_or("default");
            if kind != "default" {
                return Err(Error::config(
                    field("rope_parameters"),
                    format!("rope_type `{kind}` is not supported"),
                ));
            }
        }
        if matches!(v.get("use_sliding_window"), Some(Value::Bool(true))) {
            return Err(Error::config(
                field("use_sliding_window"),
                "sliding-window attention is not supported",
            ));
        }
        if let Some(scaling) = v.get("rope_scaling").filter(|s| !s.is_null()) {
            let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str);
            if kind != Some("default") {
                return Err(Error::config(field("rope_scaling"), format!("{scaling} is not supported")));
            }
        }
        if matches!(v.get("attention_bias"), Some(Value::Bool(true))) && architecture == Architecture::Llama {
            return Err(Error::config(
                field("attention_bias"),
                "llama with attention biases is not supported",
            ));
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(Error::config(field("hidden_act"), format!("`{act}` is not supported (silu)")));
        }
        let hidden_size = usize_of("hidden_size")?;
        let num_attention_heads = usize_of("num_attention_heads")?;
        let num_key_value_heads = match v.get("num_key_value_heads") {
            None | Some(Value::Null) => num_attention_heads,
            Some(_) => usize_of("num_key_value_heads")?,
        };
        let head_dim = match v.get("head_dim") {
            None | Some(Value::Null) => {
                if num_attention_heads == 0 || !hidden_size.is_multiple_of(num_attention_heads) {
                    return Err(Error::config(
                        field("num_attention_heads"),
                        format!("{num_attention_heads} does not divide hidden_size {hidden_size}"),
                    ));
                }
                hidden_size / num_attention_heads
            }
            Some(_) => usize_of("head_dim")?,
        };
        let cfg = Self {
            architecture,
            vocab_size: usize_of("vocab_size")?,
            hidden_size,
            intermediate_size: usize_of("intermediate_size")?,
            num_hidden_layers: usize_of("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: usize_of("max_position_embeddings")?,
            rope_theta: match rope_params.and_then(|rp| rp.get("rope_theta")) {
                Some(t) => t
                    .as_f64()
                    .ok_or_else(|| Error::config(field("rope_parameters.rope_theta"), "not a number"))?,
                None => f64_or("rope_theta", 10_000.0)?,
            },
            rms_norm_eps: f64_or("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            bos_token_id: token_id("bos_token_id"),
            eos_token_id: token_id("eos_token_id"),
        };
        cfg.validate().map_err(|e| match e {
            Error::Config { what, reason } => Error::config(format!("{file}: {what}"), reason),
            other => other,
        })?;
        Ok(cfg)
    }

    /// Checks that the sizes fit together.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(Error::config(format!("field `{name}`"), "must be positive"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(Error::config(
                "field `num_key_value_heads`",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(Error::config(
                "field `head_dim`",
                format!("{} is odd; rotary needs pairs", self.head_dim),
            ));
        }
        if !(self.rope_theta > 0.0 && self.rms_norm_eps >= 0.0) {
            return Err(Error::config("field `rope_theta`/`rms_norm_eps`", "must be positive"));
        }
        if !(self.rope_theta.is_finite() && self.rms_norm_eps.is_finite()) {
            return Err(Error::config("field `rope_theta`/`rms_norm_eps`", "must be finite"));
        }
        // Every weight's size in bytes must be a number: the sizes come from a file, and
        // their products overflowed (a panic in a debug build) before any tensor was
        // read.
        let heads = self.num_attention_heads.checked_mul(self.head_dim);
        let kv_heads = self.num_key_value_heads.checked_mul(self.head_dim);
        let bytes = |rows: Option<usize>, what: &str| {
            rows.and_then(|r| r.checked_mul(self.hidden_size))
                .and_then(|n| n.checked_mul(4))
                .filter(|&b| isize::try_from(b).is_ok())
                .map(drop)
                .ok_or_else(|| {
                    Error::config(format!("field `{what}`"), "makes a weight too large to address")
                })
        };
        bytes(Some(self.vocab_size), "vocab_size")?;
        bytes(Some(self.intermediate_size), "intermediate_size")?;
        bytes(heads, "num_attention_heads")?;
        bytes(kv_heads, "num_key_value_heads")?;
        Ok(())
    }

    /// The Hugging Face `config.json` text that `transformers` loads.
    #[must_use]
    pub fn to_hf_json(&self) -> String {
        let (class, model_type) = self.architecture.hf_names();
        let mut v = json!({
            "architectures": [class],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        });
        if self.architecture == Architecture::Llama {
            v["attention_bias"] = json!(false);
            v["mlp_bias"] = json!(false);
        }
        if let Some(b) = self.bos_token_id {
            v["bos_token_id"] = json!(b);
        }
        if let Some(e) = self.eos_token_id {
            v["eos_token_id"] = json!(e);
        }
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// Multiply-accumulate FLOPs of one token's forward pass through the dense layers
    /// (2 per weight), excluding attention scores; the usual `6 N` training estimate is
    /// three times this.
    #[must_use]
    pub fn dense_flops_per_token(&self) -> f64 {
        let d = self.hidden_size as f64;
        let q = (self.num_attention_heads * self.head_dim) as f64;
        let kv = (self.num_key_value_heads * self.head_dim) as f64;
        let per_layer = d * q * 2.0 + d * kv * 2.0 + 3.0 * d * self.intermediate_size as f64;
        2.0 * (per_layer * self.num_hidden_layers as f64 + d * self.vocab_size as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_json_round_trips() {
        let mut cfg = ModelConfig::tiny();
        cfg.architecture = Architecture::Qwen2;
        cfg.tie_word_embeddings = true;
        let back = ModelConfig::from_hf_json(&cfg.to_hf_json()).unwrap();
        assert_eq!(back, cfg);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let err =
            ModelConfig::from_hf_json(r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":4}"#)
                .unwrap_err();
        assert!(err.to_string().contains("vocab_size"), "{err}");
        let err = ModelConfig::from_hf_json(r#"{"model_type":"gpt2"}"#).unwrap_err();
        assert!(err.to_string().contains("model_type"), "{err}");
        let mut text: Value = serde_json::from_str(&ModelConfig::tiny().to_hf_json()).unwrap();
        text["num_key_value_heads"] = json!(3);
        let err = ModelConfig::from_hf_json(&text.to_string()).unwrap_err();
        assert!(err.to_string().contains("num_key_value_heads"), "{err}");
        assert!(ModelConfig::from_hf_json("{").unwrap_err().to_string().contains("not JSON"));
    }

    /// Found by the fuzz suite: a `config.json` of a checkpoint with
    /// `num_attention_heads = 2^63` overflowed `heads * head_dim` (a panic in a
    /// debug build) before any tensor was read.
    #[test]
    fn sizes_whose_weights_cannot_be_addressed_are_refused_naming_the_field() {
        for (field, value) in [
            ("num_attention_heads", json!(1u64 << 63)),
            ("vocab_size", json!(u64::MAX)),
            ("intermediate_size", json!(1u64 << 62)),
        ] {
            let mut text: Value = serde_json::from_str(&ModelConfig::tiny().to_hf_json()).unwrap();
            text[field] = value;
            if field == "num_attention_heads" {
                text["num_key_value_heads"] = json!(1);
            }
            let err = ModelConfig::from_hf_json(&text.to_string()).unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
        let infinite = ModelConfig { rope_theta: f64::INFINITY, ..ModelConfig::tiny() };
        assert!(infinite.validate().unwrap_err().to_string().contains("rope_theta"));
    }
}
