//! Which adapters a model handle carries ([`LoraConfig`], the `[trainer.lora]`
//! section of a run config) and their tensors ([`Adapters`]). The model holds them;
//! the parent module builds, merges, saves and loads them.

use std::collections::BTreeSet;

use candle_core::Var;
use serde::{Deserialize, Serialize};

use crate::ops::Projection;
use crate::{Error, Result};

/// Which projections get adapters, of what rank and scale: the `[trainer.lora]`
/// section of a run config, with PEFT's names for the fields it shares.
///
/// Errors of [`LoraConfig::validate`] and [`Model::with_lora`](crate::Model::with_lora) name the key under
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
    /// fits the model's projections is checked by [`Model::with_lora`](crate::Model::with_lora).
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
    pub(crate) a: Var,
    pub(crate) b: Var,
}

/// The adapters of a model handle.
#[derive(Debug)]
pub(crate) struct Adapters {
    /// Validated, with the targets in layer order.
    pub(crate) cfg: LoraConfig,
    pub(crate) scale: f64,
    /// Per layer, per [`Projection::index`].
    pub(crate) layers: Vec<[Option<Adapter>; 7]>,
}

impl Adapters {
    /// The same adapters in `dtype`, in storage of their own (a model's
    /// `compute_copy`).
    pub(crate) fn cast(&self, dtype: candle_core::DType) -> Result<Self> {
        let cast =
            |v: &Var| -> Result<Var> { Ok(Var::from_tensor(&v.as_tensor().detach().to_dtype(dtype)?)?) };
        let layers = self
            .layers
            .iter()
            .map(|slots| {
                let mut out: [Option<Adapter>; 7] = Default::default();
                for (o, slot) in out.iter_mut().zip(slots) {
                    if let Some(ad) = slot {
                        *o = Some(Adapter { a: cast(&ad.a)?, b: cast(&ad.b)? });
                    }
                }
                Ok(out)
            })
            .collect::<Result<_>>()?;
        Ok(Self { cfg: self.cfg.clone(), scale: self.scale, layers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
