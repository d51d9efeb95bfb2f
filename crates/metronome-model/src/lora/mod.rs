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

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, Var};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::model::{Layer, Model};
use crate::{Error, Result};

/// The PEFT adapter config file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The PEFT adapter weights file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// Stream id of adapter initialisation in [`metronome_core::stream_seed`].
const LORA_STREAM: u64 = 0x6c6f_7261_5f69_6e69; // "lora_ini"

/// A linear projection of a decoder layer that may carry an adapter, by its PEFT
/// (Hugging Face module) name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Projection {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl Projection {
    /// Every projection, in layer order.
    pub const ALL: [Projection; 7] = [Self::Q, Self::K, Self::V, Self::O, Self::Gate, Self::Up, Self::Down];

    /// The PEFT `target_modules` name (`q_proj`, …, `down_proj`).
    #[must_use]
    pub fn peft_name(self) -> &'static str {
        match self {
            Self::Q => "q_proj",
            Self::K => "k_proj",
            Self::V => "v_proj",
            Self::O => "o_proj",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    /// The projection a PEFT `target_modules` name denotes.
    #[must_use]
    pub fn from_peft_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.peft_name() == name)
    }

    /// The Hugging Face module path inside a layer (`self_attn.q_proj`).
    pub(crate) fn module_path(self) -> String {
        let block = if matches!(self, Self::Gate | Self::Up | Self::Down) { "mlp" } else { "self_attn" };
        format!("{block}.{}", self.peft_name())
    }

    /// The layer's base weight of this projection.
    pub(crate) fn weight(self, l: &Layer) -> &Var {
        match self {
            Self::Q => &l.q,
            Self::K => &l.k,
            Self::V => &l.v,
            Self::O => &l.o,
            Self::Gate => &l.gate,
            Self::Up => &l.up,
            Self::Down => &l.down,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Which projections get adapters, of what rank and scale: the `[trainer.lora]`
/// section of a run config, with PEFT's names for the fields it shares.
///
/// Errors of [`LoraConfig::validate`] and [`Model::with_lora`] name the key under
/// `lora.` (`lora.rank`, `lora.target_modules[1]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// The rank `r` of every adapter (PEFT's `r`).
    pub rank: usize,
    /// The scale numerator: adapters add `(alpha / rank)·B·A` (PEFT's `lora_alpha`).
    pub alpha: f64,
    /// Must be 0 (or omitted). Dropout on the adapters' input draws a random mask in
    /// every forward, which would make a step depend on how and where its groups were
    /// computed; `sync == periodic` and bit-identical resumes rest on it not doing so.
    pub dropout: f64,
    /// PEFT names of the projections that get adapters: `q_proj`, `k_proj`, `v_proj`,
    /// `o_proj`, `gate_proj`, `up_proj`, `down_proj`. The default is all seven: on
    /// every linear layer of a block LoRA matches full fine-tuning better than on the
    /// attention alone (Dettmers et al. 2023, "QLoRA", arXiv 2305.14314).
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: Projection::ALL.iter().map(|p| p.peft_name().to_owned()).collect(),
        }
    }
}

impl LoraConfig {
    /// Checks every field; the error names the key (`lora.rank`, …). Whether the rank
    /// fits the model's projections is checked by [`Model::with_lora`].
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::config("lora.rank", "is 0, expected at least 1"));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(Error::config(
                "lora.alpha",
                format!("is {}, expected a positive number", self.alpha),
            ));
        }
        if self.dropout != 0.0 {
            return Err(Error::config(
                "lora.dropout",
                format!(
                    "is {}, only 0 is supported: a random dropout mask per forward would make steps depend \
                     on the order and place groups are computed in (sync == periodic, bit-identical resumes)",
                    self.dropout
                ),
            ));
        }
        self.targets().map(drop)
    }

    /// The targeted projections in layer order, each once.
    pub fn targets(&self) -> Result<Vec<Projection>> {
        if self.target_modules.is_empty() {
            return Err(Error::config("lora.target_modules", "is empty, expected at least one projection"));
        }
        let mut out = BTreeSet::new();
        for (i, name) in self.target_modules.iter().enumerate() {
            let p = Projection::from_peft_name(name).ok_or_else(|| {
                let known: Vec<&str> = Projection::ALL.iter().map(|p| p.peft_name()).collect();
                Error::config(
                    format!("lora.target_modules[{i}]"),
                    format!("is `{name}`, expected one of {}", known.join(", ")),
                )
            })?;
            if !out.insert(p) {
                return Err(Error::config(format!("lora.target_modules[{i}]"), format!("repeats `{name}`")));
            }
        }
        Ok(out.into_iter().collect())
    }

    /// `alpha / rank`, the factor of `B·A` (Hu et al. §4.1).
    #[must_use]
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// The first key in which `self` and `other` describe different adapters (rank,
    /// alpha, or the set of targets, in any order), with both values; `None` when
    /// they describe the same.
    pub fn difference(&self, other: &LoraConfig) -> Option<(&'static str, String, String)> {
        if self.rank != other.rank {
            return Some(("lora.rank", self.rank.to_string(), other.rank.to_string()));
        }
        if self.alpha.to_bits() != other.alpha.to_bits() {
            return Some(("lora.alpha", self.alpha.to_string(), other.alpha.to_string()));
        }
        // In layer order, so that the order a config lists them in does not matter.
        let names = |c: &LoraConfig| match c.targets() {
            Ok(t) => format!("[{}]", t.iter().map(|p| p.peft_name()).collect::<Vec<_>>().join(", ")),
            Err(e) => e.to_string(),
        };
        let (a, b) = (names(self), names(other));
        (a != b).then_some(("lora.target_modules", a, b))
    }
}

/// One adapter: `A` `[r, in]` and `B` `[out, r]`.
#[derive(Debug)]
pub(crate) struct Adapter {
    a: Var,
    b: Var,
}

/// The adapters of a model handle.
#[derive(Debug)]
pub(crate) struct Adapters {
    /// Validated, with the targets in layer order.
    cfg: LoraConfig,
    scale: f64,
    /// Per layer, per [`Projection::index`].
    layers: Vec<[Option<Adapter>; 7]>,
}

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

/// `x·Wᵀ` for a frozen weight `W` (`[out, in]`) whose backward gives the gradient of
/// `x` only. candle's matmul backward computes the gradient of both operands even
/// when one is detached: a frozen base would still pay a weight-gradient product per
/// projection and hold an `[out, in]` gradient of every layer until the step (on
/// SmolLM2-135M's shape that was ~1 GB of the LoRA step's peak memory). The forward
/// is the same storage matmul `Tensor::matmul` runs, so the values are bitwise those
/// of [`crate::ops::linear`].
struct FrozenMatmul;

impl CustomOp2 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = lx.shape().dims2()?;
        let (n, k2) = lw.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("frozen matmul: input of width {k} for a weight of width {k2}");
        }
        Ok((x.matmul(w, (1, m, n, k), lx, &lw.transpose(0, 1)?)?, (m, n).into()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.matmul(w)?), None))
    }
}

/// `x·Wᵀ + b` for frozen `W` and `b` (detached): on the CPU through [`FrozenMatmul`],
/// so the backward skips the weight's gradient; elsewhere (no kernel for it yet) the
/// plain product, whose backward also computes the unused weight gradient.
pub(crate) fn frozen_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return crate::ops::linear(x, w, b);
    }
    let y = x.contiguous()?.apply_op2(w, FrozenMatmul)?;
    Ok(match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
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
                let (out_dim, in_dim) = p.weight(l).dims2()?;
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
        let frozen = frozen_linear(x.as_tensor(), w.as_tensor(), Some(&b)).unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&plain), bits(&frozen));
        let gp = (plain * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let gf = (frozen * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(bits(gp.get(x.as_tensor()).unwrap()), bits(gf.get(x.as_tensor()).unwrap()));
        assert!(gp.get(w.as_tensor()).is_some() && gf.get(w.as_tensor()).is_none());
    }

    #[test]
    fn config_errors_name_the_key() {
        let cases: [(LoraConfig, &str); 6] = [
            (LoraConfig { rank: 0, ..LoraConfig::default() }, "lora.rank"),
            (LoraConfig { alpha: 0.0, ..LoraConfig::default() }, "lora.alpha"),
            (LoraConfig { alpha: f64::NAN, ..LoraConfig::default() }, "lora.alpha"),
            (LoraConfig { dropout: 0.05, ..LoraConfig::default() }, "lora.dropout"),
            (LoraConfig { target_modules: vec![], ..LoraConfig::default() }, "lora.target_modules"),
            (
                LoraConfig {
                    target_modules: vec!["q_proj".into(), "qkv_proj".into()],
                    ..LoraConfig::default()
                },
                "lora.target_modules[1]",
            ),
        ];
        for (cfg, key) in cases {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.starts_with(key), "{err}");
        }
        let twice =
            LoraConfig { target_modules: vec!["v_proj".into(), "v_proj".into()], ..LoraConfig::default() };
        assert!(twice.validate().unwrap_err().to_string().contains("lora.target_modules[1]: repeats"));
        LoraConfig::default().validate().unwrap();
    }

    #[test]
    fn difference_ignores_the_order_of_targets() {
        let a =
            LoraConfig { target_modules: vec!["q_proj".into(), "v_proj".into()], ..LoraConfig::default() };
        let b = LoraConfig { target_modules: vec!["v_proj".into(), "q_proj".into()], ..a.clone() };
        assert_eq!(a.difference(&b), None);
        assert_eq!(a.difference(&LoraConfig { rank: 4, ..a.clone() }).map(|d| d.0), Some("lora.rank"));
        assert_eq!(a.difference(&LoraConfig { alpha: 8.0, ..a.clone() }).map(|d| d.0), Some("lora.alpha"));
        let c = LoraConfig { target_modules: vec!["q_proj".into()], ..a.clone() };
        let d = a.difference(&c).unwrap();
        assert_eq!(d, ("lora.target_modules", "[q_proj, v_proj]".into(), "[q_proj]".into()));
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
