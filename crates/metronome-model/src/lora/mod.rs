//! Low-rank adapters (LoRA; Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
//! Language Models", arXiv 2106.09685) on the decoder's projections, and the PEFT
//! adapter format they are saved in.
//!
//! An adapted projection computes `y = x·Wᵀ + (alpha / r)·x·Aᵀ·Bᵀ` with the base
//! weight `W` (`[out, in]`) frozen and only `A` (`[r, in]`) and `B` (`[out, r]`)
//! trained (Hu et al., eq. 3). `B` starts at zero, so an adapted model starts equal to
//! its base, bit for bit; `A` starts as PEFT initialises it (Kaiming-uniform with
//! `a = √5`, i.e. `U(-1/√in, 1/√in)`, what `torch.nn.Linear` uses; the paper draws
//! it from a Gaussian, and either works since `B = 0` keeps the product zero).
//!
//! Adapters belong to a model *handle*: [`Model::with_lora`] returns a handle on the
//! same base weights with adapters added, [`Model::base`] the same weights without
//! them. The base is never written through an adapted handle (its forward reads the
//! base weights detached, so no gradient reaches them), which is what lets the
//! trainer use the base handle as the frozen reference model without a copy.
//!
//! Publication merges: [`Model::snapshot`], [`Model::save_hf`] and
//! [`Model::frozen_copy`] of an adapted handle hold `W + (alpha / r)·B·A` under the
//! base names (Hu et al. §4.1: merged, the adapted model costs no extra inference
//! latency), so the rollout engine decodes a plain model. Decoding through an adapted
//! handle is refused rather than computed on a path no test covers.

pub(crate) mod adapters;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor, Var};
use safetensors::SafeTensors;
use serde_json::{Value, json};

pub use self::adapters::LoraConfig;
use self::adapters::{Adapter, Adapters};
use crate::model::Model;
use crate::ops::Projection;
use crate::{Error, Result};

/// The PEFT adapter config file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The PEFT adapter weights file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// Stream id of adapter initialisation in [`metronome_core::stream_seed`].
const LORA_STREAM: u64 = 0x6c6f_7261_5f69_6e69; // "lora_ini"

/// The PEFT key of a tensor of layer `layer`'s adapter on `p` (`A` or `B`).
fn peft_key(layer: usize, p: Projection, which: char) -> String {
    format!("base_model.model.model.layers.{layer}.{}.lora_{which}.weight", p.module_path())
}

/// `n` samples of `U(-bound, bound)` from a SplitMix64 stream.
fn uniform_vec(seed: u64, n: usize, bound: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            // 24 random bits into [0, 1), then to [-bound, bound).
            let u = (metronome_core::mix64(state) >> 40) as f32 / (1u32 << 24) as f32;
            (2.0 * u - 1.0) * bound
        })
        .collect()
}

impl Model {
    /// A handle on the same base weights with freshly initialised adapters on the
    /// projections `cfg` names: `B = 0` (the adapted model equals the base), `A` from
    /// `U(-1/√in, 1/√in)` drawn from a generator seeded by `seed` alone. The adapters
    /// are trainable when this handle is; the base weights never receive a gradient
    /// through the result.
    ///
    /// Errors (naming the `lora.` key) for an invalid config, a rank above a target
    /// projection's smaller side (it would add parameters and no expressiveness), and
    /// a handle that already has adapters.
    pub fn with_lora(&self, cfg: &LoraConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let r = cfg.rank;
        self.adapt(cfg, |layer, p, out_dim, in_dim| {
            let index = (layer * Projection::ALL.len() + p.index()) as u64;
            let s = metronome_core::stream_seed(metronome_core::RunSeed(seed), LORA_STREAM, index);
            let bound = 1.0 / (in_dim as f32).sqrt();
            let a = Tensor::from_vec(uniform_vec(s, r * in_dim, bound), (r, in_dim), self.device())?;
            let b = Tensor::zeros((out_dim, r), DType::F32, self.device())?;
            Ok((a, b))
        })
    }

    /// Builds the adapters of `cfg` (validated) with `make(layer, projection, out, in)`
    /// giving `A` and `B`.
    fn adapt(
        &self,
        cfg: &LoraConfig,
        mut make: impl FnMut(usize, Projection, usize, usize) -> Result<(Tensor, Tensor)>,
    ) -> Result<Self> {
        if let Some(have) = &self.lora {
            return Err(Error::config(
                "lora",
                format!(
                    "the model already has adapters of rank {}; add adapters to its base (`Model::base`) \
                     or to its merged copy (`Model::merged`)",
                    have.cfg.rank
                ),
            ));
        }
        let targets = cfg.targets()?;
        let r = cfg.rank;
        let mut layers = Vec::with_capacity(self.inner.layers.len());
        for (i, l) in self.inner.layers.iter().enumerate() {
            let mut slots: [Option<Adapter>; 7] = Default::default();
            for &p in &targets {
                let (out_dim, in_dim) = l.weight(p).dims2()?;
                if r > out_dim.min(in_dim) {
                    return Err(Error::config(
                        "lora.rank",
                        format!(
                            "is {r}, larger than {} ({out_dim} x {in_dim}): a rank above the smaller side \
                             adds parameters and no expressiveness",
                            p.peft_name()
                        ),
                    ));
                }
                let (a, b) = make(i, p, out_dim, in_dim)?;
                slots[p.index()] = Some(Adapter { a: Var::from_tensor(&a)?, b: Var::from_tensor(&b)? });
            }
            layers.push(slots);
        }
        let cfg = LoraConfig {
            dropout: 0.0,
            target_modules: targets.iter().map(|p| p.peft_name().to_owned()).collect(),
            ..cfg.clone()
        };
        let adapters = Adapters { scale: cfg.scale(), cfg, layers };
        Ok(Self { lora: Some(std::sync::Arc::new(adapters)), ..self.clone() })
    }

    /// The adapters' configuration (targets in layer order), `None` for a plain model.
    #[must_use]
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|a| &a.cfg)
    }

    /// The same base weights (shared, not copied) without adapters.
    #[must_use]
    pub fn base(&self) -> Self {
        Self { lora: None, ..self.clone() }
    }

    /// Every adapter tensor with its PEFT name
    /// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), by layer,
    /// then projection, `A` before `B`; empty for a plain model.
    #[must_use]
    pub fn adapter_parameters(&self) -> Vec<(String, Var)> {
        let Some(ad) = &self.lora else { return Vec::new() };
        let mut out = Vec::new();
        for (i, slots) in ad.layers.iter().enumerate() {
            for p in Projection::ALL {
                if let Some(adapter) = &slots[p.index()] {
                    out.push((peft_key(i, p, 'A'), adapter.a.clone()));
                    out.push((peft_key(i, p, 'B'), adapter.b.clone()));
                }
            }
        }
        out
    }

    /// The adapter variables of layer `layer` (`A` and `B` of each adapted
    /// projection); empty for a plain model.
    pub(crate) fn layer_adapter_vars(&self, layer: usize) -> Vec<Var> {
        let Some(ad) = &self.lora else { return Vec::new() };
        ad.layers[layer].iter().flatten().flat_map(|a| [a.a.clone(), a.b.clone()]).collect()
    }

    /// A plain model (its own storage, trainable as this handle is) whose weights are
    /// this handle's with every adapter merged in: `W + (alpha / r)·B·A`. Its logits
    /// equal the adapted model's up to float32 rounding. For a plain model, a deep copy.
    pub fn merged(&self) -> Result<Self> {
        let s = self.snapshot(metronome_core::PolicyVersion(0))?;
        let m = Self::from_snapshot(self.inner.cfg.clone(), &s, self.device(), self.trainable)?;
        m.with_kernels(self.kernels)
    }

    /// `y + (alpha / r)·(x·Aᵀ)·Bᵀ` when layer `layer`'s projection `p` has an adapter,
    /// else `y` (the forward's adapted projection; `x` is the projection's input and
    /// `y = x·Wᵀ`). The adapters record a graph when this handle is trainable.
    pub(crate) fn add_adapter(&self, layer: usize, p: Projection, x: &Tensor, y: Tensor) -> Result<Tensor> {
        let Some(ad) = &self.lora else { return Ok(y) };
        let Some(adapter) = &ad.layers[layer][p.index()] else { return Ok(y) };
        let a = Self::w(&adapter.a, self.trainable);
        let b = Self::w(&adapter.b, self.trainable);
        let low = crate::ops::linear(x, &a, None)?;
        Ok((y + (crate::ops::linear(&low, &b, None)? * ad.scale)?)?)
    }

    /// `w` (layer `layer`'s base weight of `p`, detached) with its adapter merged in:
    /// `W + (alpha / r)·B·A` in f32, the order PEFT's `merge` uses.
    pub(crate) fn merge_adapter(&self, layer: usize, p: Projection, w: Tensor) -> Result<Tensor> {
        let Some(ad) = &self.lora else { return Ok(w) };
        let Some(adapter) = &ad.layers[layer][p.index()] else { return Ok(w) };
        let delta = adapter.b.as_tensor().detach().matmul(&adapter.a.as_tensor().detach())?;
        Ok((w + (delta * ad.scale)?)?)
    }

    /// Writes the adapters in the PEFT format to `dir` (created): `adapter_config.json`
    /// (LoRA, causal LM, `r`, `lora_alpha`, `target_modules`, no dropout, no bias) and
    /// `adapter_model.safetensors` (f32, PEFT's key names), which
    /// `peft.PeftModel.from_pretrained(base, dir)` loads onto the base model (saved
    /// with [`Model::save_hf`] of [`Model::base`]). An error for a plain model.
    pub fn save_lora_adapter(&self, dir: &Path) -> Result<()> {
        let Some(ad) = &self.lora else {
            return Err(Error::invalid("save_lora_adapter", "needs a model with LoRA adapters"));
        };
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let cfg = &ad.cfg;
        let config = json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": cfg.rank,
            "lora_alpha": cfg.alpha,
            "lora_dropout": 0.0,
            "target_modules": cfg.target_modules,
            "bias": "none",
            "fan_in_fan_out": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "use_rslora": false,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "base_model_name_or_path": null,
        });
        let path = dir.join(ADAPTER_CONFIG_FILE);
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| Error::checkpoint(path.display().to_string(), e.to_string()))?;
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
        let tensors =
            self.adapter_parameters().into_iter().map(|(n, v)| (n, v.as_tensor().detach())).collect();
        crate::io::write_safetensors(&dir.join(ADAPTER_WEIGHTS_FILE), tensors)
    }

    /// A handle on this model's weights with the adapters of a PEFT LoRA directory
    /// ([`Model::save_lora_adapter`] writes one; so does PEFT for a Llama/Qwen2 model
    /// with plain LoRA). Refused, naming the file and key: another PEFT method, DoRA,
    /// rsLoRA, trained biases or extra modules, per-layer ranks or layers, a tensor
    /// missing, extra or of the wrong shape.
    pub fn with_lora_adapter(&self, dir: &Path) -> Result<Self> {
        let path = dir.join(ADAPTER_CONFIG_FILE);
        let file = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| Error::checkpoint(&file, format!("is not JSON: {e}")))?;
        let bad = |key: &str, reason: &str| Error::checkpoint(format!("{file}: `{key}`"), reason.to_owned());
        let cfg = peft_config(&v).map_err(|(key, reason)| bad(key, &reason))?;
        let path = dir.join(ADAPTER_WEIGHTS_FILE);
        let file = path.display().to_string();
        let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| Error::checkpoint(&file, e.to_string()))?;
        let mut expected = 0usize;
        let adapted = self.adapt(&cfg, |layer, p, out_dim, in_dim| {
            let mut load = |which: char, shape: [usize; 2]| -> Result<Tensor> {
                let key = peft_key(layer, p, which);
                let what = format!("{file}: tensor `{key}`");
                let view = st.tensor(&key).map_err(|_| Error::checkpoint(&what, "is missing"))?;
                let t = crate::io::view_to_tensor(&view, &what, self.device())?;
                if t.dims() != shape {
                    return Err(Error::checkpoint(
                        &what,
                        format!("has shape {:?}, expected {shape:?}", t.dims()),
                    ));
                }
                expected += 1;
                Ok(t)
            };
            Ok((load('A', [cfg.rank, in_dim])?, load('B', [out_dim, cfg.rank])?))
        })?;
        if st.len() != expected {
            let known: HashMap<String, ()> =
                adapted.adapter_parameters().into_iter().map(|(n, _)| (n, ())).collect();
            let extra =
                st.names().into_iter().find(|n| !known.contains_key(*n)).unwrap_or_default().to_owned();
            return Err(Error::checkpoint(
                format!("{file}: tensor `{extra}`"),
                "is not an adapter of the config's layers and target modules",
            ));
        }
        Ok(adapted)
    }
}

/// The [`LoraConfig`] of a PEFT `adapter_config.json`, or the key at fault and why.
fn peft_config(v: &Value) -> std::result::Result<LoraConfig, (&'static str, String)> {
    let get = |key| v.get(key).filter(|x| !x.is_null());
    if let Some(t) = get("peft_type").and_then(Value::as_str)
        && t != "LORA"
    {
        return Err(("peft_type", format!("is `{t}`, only LORA adapters load")));
    }
    let rank = get("r")
        .and_then(Value::as_u64)
        .ok_or(("r", "is missing or not a non-negative integer".to_owned()))?;
    let alpha = get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or(("lora_alpha", "is missing or not a number".to_owned()))?;
    let target_modules = match get("target_modules") {
        Some(Value::Array(names)) => names
            .iter()
            .map(|n| n.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or(("target_modules", "holds a non-string".to_owned()))?,
        _ => {
            return Err((
                "target_modules",
                "is missing or not a list of module names (a regular expression is not supported)".to_owned(),
            ));
        }
    };
    for key in ["use_dora", "use_rslora", "fan_in_fan_out"] {
        if get(key).and_then(Value::as_bool) == Some(true) {
            return Err((key, "is true, which Metronome's adapters do not implement".to_owned()));
        }
    }
    if let Some(b) = get("bias").and_then(Value::as_str)
        && b != "none"
    {
        return Err(("bias", format!("is `{b}`, only `none` (no trained biases) loads")));
    }
    for key in ["modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"] {
        let empty = match get(key) {
            None => true,
            Some(Value::Object(m)) => m.is_empty(),
            Some(Value::Array(a)) => a.is_empty(),
            Some(_) => false,
        };
        if !empty {
            return Err((key, "is set, which Metronome's adapters do not implement".to_owned()));
        }
    }
    let cfg = LoraConfig { rank: rank as usize, alpha, dropout: 0.0, target_modules };
    // The file's keys are PEFT's (`r`, `lora_alpha`), not the `lora.` section's.
    cfg.validate().map_err(|e| match e {
        Error::Config { what, reason } => {
            let key = match what.as_str() {
                "lora.rank" => "r",
                "lora.alpha" => "lora_alpha",
                _ => "target_modules",
            };
            (key, reason)
        }
        other => ("r", other.to_string()),
    })?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_init_is_deterministic_and_bounded() {
        let a = uniform_vec(3, 10_000, 0.5);
        assert_eq!(a, uniform_vec(3, 10_000, 0.5));
        assert!(a.iter().all(|x| (-0.5..0.5).contains(x)));
        let mean = a.iter().map(|&x| f64::from(x)).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / a.len() as f64;
        // U(-b, b) has variance b²/3.
        assert!(mean.abs() < 0.01 && (var - 0.25 / 3.0).abs() < 0.003, "{mean} {var}");
    }

    /// The frozen product equals the plain one bitwise, forward and in the input's
    /// gradient, and gives the weight none (a `Var` here, which a plain product would
    /// give one).
    #[test]
    fn frozen_linear_is_linear_without_the_weight_gradient() {
        let dev = candle_core::Device::Cpu;
        let t = |seed: u64, shape: (usize, usize)| {
            let v = uniform_vec(seed, shape.0 * shape.1, 1.0);
            Tensor::from_vec(v, shape, &dev).unwrap()
        };
        let x = Var::from_tensor(&t(1, (37, 96))).unwrap();
        let w = Var::from_tensor(&t(2, (80, 96))).unwrap();
        let b = t(3, (1, 80)).squeeze(0).unwrap();
        let up = t(4, (37, 80));
        let plain = crate::ops::linear(x.as_tensor(), w.as_tensor(), Some(&b)).unwrap();
        let frozen = crate::ops::frozen_linear(x.as_tensor(), w.as_tensor(), Some(&b)).unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&plain), bits(&frozen));
        let gp = (plain * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let gf = (frozen * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(bits(gp.get(x.as_tensor()).unwrap()), bits(gf.get(x.as_tensor()).unwrap()));
        assert!(gp.get(w.as_tensor()).is_some() && gf.get(w.as_tensor()).is_none());
    }

    #[test]
    fn peft_config_refuses_what_it_does_not_implement() {
        let base = json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]});
        let cfg = peft_config(&base).unwrap();
        assert_eq!((cfg.rank, cfg.alpha, cfg.target_modules), (4, 8.0, vec!["q_proj".to_owned()]));
        let with = |key: &str, value: Value| {
            let mut v = base.clone();
            v[key] = value;
            peft_config(&v).map(drop).unwrap_err().0
        };
        assert_eq!(with("peft_type", json!("IA3")), "peft_type");
        assert_eq!(with("r", json!(0)), "r");
        assert_eq!(with("r", json!("8")), "r");
        assert_eq!(with("lora_alpha", json!(null)), "lora_alpha");
        assert_eq!(with("target_modules", json!(".*proj")), "target_modules");
        assert_eq!(with("target_modules", json!(["q_proj", 3])), "target_modules");
        assert_eq!(with("target_modules", json!(["lm_head"])), "target_modules");
        assert_eq!(with("use_dora", json!(true)), "use_dora");
        assert_eq!(with("use_rslora", json!(true)), "use_rslora");
        assert_eq!(with("bias", json!("all")), "bias");
        assert_eq!(with("modules_to_save", json!(["lm_head"])), "modules_to_save");
        assert_eq!(with("rank_pattern", json!({"q_proj": 2})), "rank_pattern");
        // PEFT writes nulls and empty maps for what is unset.
        let mut v = base.clone();
        v["modules_to_save"] = Value::Null;
        v["rank_pattern"] = json!({});
        v["lora_dropout"] = json!(0.1);
        peft_config(&v).unwrap();
    }
}
