//! A weighted sum of reward functions.

use std::sync::Arc;

use metronome_core::{Completion, Prompt, Reward, RewardFn};

use crate::{Error, Result};

/// One named, weighted part of a [`Composite`].
#[derive(Clone)]
pub struct Component {
    /// The part's name in the breakdown.
    pub name: String,
    /// Its weight in the total.
    pub weight: f32,
    /// The scorer.
    pub scorer: Arc<dyn RewardFn>,
}

impl std::fmt::Debug for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Component")
            .field("name", &self.name)
            .field("weight", &self.weight)
            .finish_non_exhaustive()
    }
}

/// `total = Σ weight_i · total_i`. The breakdown holds each component's total under
/// its name and the component's own parts as `name.part`; failures of components are
/// joined into the composite's failure (their configured scores still count).
#[derive(Clone, Debug)]
pub struct Composite {
    components: Vec<Component>,
}

impl Composite {
    /// A composite of `components`; names must be unique and weights finite.
    pub fn new(components: Vec<Component>) -> Result<Self> {
        if components.is_empty() {
            return Err(Error::config("composite.components", "is empty"));
        }
        for (i, c) in components.iter().enumerate() {
            if !c.weight.is_finite() {
                return Err(Error::config(format!("composite.components[{i}].weight"), "must be finite"));
            }
            if c.name.is_empty() || c.name.contains('.') {
                return Err(Error::config(
                    format!("composite.components[{i}].name"),
                    "must be non-empty without `.`",
                ));
            }
            if components[..i].iter().any(|o| o.name == c.name) {
                return Err(Error::config(
                    format!("composite.components[{i}].name"),
                    format!("`{}` is used twice", c.name),
                ));
            }
        }
        Ok(Self { components })
    }

    /// Adds a component (builder style).
    pub fn with(
        mut self,
        name: impl Into<String>,
        weight: f32,
        scorer: impl RewardFn + 'static,
    ) -> Result<Self> {
        self.components.push(Component { name: name.into(), weight, scorer: Arc::new(scorer) });
        Self::new(self.components)
    }

    /// A composite with one component.
    pub fn of(name: impl Into<String>, weight: f32, scorer: impl RewardFn + 'static) -> Result<Self> {
        Self::new(vec![Component { name: name.into(), weight, scorer: Arc::new(scorer) }])
    }
}

impl RewardFn for Composite {
    fn score(&self, prompt: &Prompt, completion: &Completion) -> Reward {
        let mut total = 0.0f64;
        let mut out = Reward::default();
        let mut failures = Vec::new();
        for c in &self.components {
            let r = c.scorer.score(prompt, completion);
            total += f64::from(c.weight) * f64::from(r.total);
            for (part, v) in &r.parts {
                out.parts.insert(format!("{}.{part}", c.name), *v);
            }
            out.parts.insert(c.name.clone(), r.total);
            if let Some(f) = r.failure {
                failures.push(format!("{}: {f}", c.name));
            }
        }
        out.total = total as f32;
        out.failure = (!failures.is_empty()).then(|| failures.join("; "));
        out
    }
}
