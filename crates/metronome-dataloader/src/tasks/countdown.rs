//! Countdown: reach a target by combining given numbers with `+ - * /`, each number
//! used once. Every instance is built from a solution, so it is solvable by
//! construction, and the solution is the reference answer.

use std::collections::BTreeMap;

use metronome_core::{PromptId, RunSeed, stream_seed};
use serde::{Deserialize, Serialize};

use super::{Holdout, Operator, Span, render};
use crate::dataset::{Dataset, PromptContent, Record};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// The [`stream_seed`] stream of countdown items; the index is the item.
pub const COUNTDOWN_STREAM: u64 = 0x636f_756e_7464_6f77; // "countdow"

/// Intermediate values above this are avoided, so no product can overflow and the
/// solutions stay human-sized.
const MAX_INTERMEDIATE: u64 = 1 << 40;

/// Knobs of the countdown task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CountdownConfig {
    /// Items per epoch.
    pub size: u64,
    /// How many numbers an instance gives (2 to 8).
    pub numbers: Span,
    /// Numbers are drawn uniformly from `1..=max_number`.
    pub max_number: u64,
    /// Targets must fall in this range (at least 1).
    pub target: Span,
    /// Operators the solution may use. Subtraction only yields positive results and
    /// division only exact ones, as in the game.
    pub operators: Vec<Operator>,
    /// Draws per item before giving up on reaching a target in range.
    pub max_attempts: u32,
    /// The prompt text; `{numbers}` becomes `3, 7, 25`, `{target}` the target. The
    /// default states the rules the reward crate's countdown checker enforces by
    /// default: every number exactly once, the expression in `<answer>` tags.
    pub format: String,
    /// Generate items from this seed instead of the run seed.
    pub seed: Option<u64>,
    /// Draw only training or only held-out instances (default: all). The content key
    /// is the sorted numbers and the target, so a held-out instance is never trained
    /// on in any order.
    pub holdout: Holdout,
}

impl Default for CountdownConfig {
    fn default() -> Self {
        Self {
            size: 1000,
            numbers: Span::new(3, 4),
            max_number: 50,
            target: Span::new(1, 100),
            operators: vec![Operator::Add, Operator::Sub, Operator::Mul, Operator::Div],
            max_attempts: 1000,
            format: "Using the numbers [{numbers}], create an equation that equals {target}. Use every \
                     number exactly once, with + - * / and parentheses, and give only the expression \
                     in <answer></answer> tags, for example <answer>(1 + 2) * 3</answer>."
                .into(),
            seed: None,
            holdout: Holdout::default(),
        }
    }
}

impl CountdownConfig {
    /// Checks every knob; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if self.size == 0 {
            return Err(Error::config("countdown.size", "must be at least 1"));
        }
        self.numbers.check("countdown.numbers", 2, 8)?;
        if !(1..=1_000_000).contains(&self.max_number) {
            return Err(Error::config("countdown.max_number", "must be in 1..=1000000"));
        }
        self.target.check("countdown.target", 1, MAX_INTERMEDIATE)?;
        if self.operators.is_empty() {
            return Err(Error::config("countdown.operators", "is empty"));
        }
        if self.max_attempts == 0 {
            return Err(Error::config("countdown.max_attempts", "must be at least 1"));
        }
        if !self.format.contains("{numbers}") || !self.format.contains("{target}") {
            return Err(Error::config("countdown.format", "must contain `{numbers}` and `{target}`"));
        }
        self.holdout.check("countdown.holdout")
    }
}

/// One countdown instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CountdownItem {
    /// The given numbers, in the order the prompt lists them.
    pub numbers: Vec<u64>,
    /// The target.
    pub target: u64,
    /// A solution using every number exactly once, e.g. `(25-3)*4`.
    pub solution: String,
}

impl CountdownItem {
    /// The content key of the train / held-out partition: sorted numbers and target,
    /// e.g. `3,7,25=88`.
    #[must_use]
    pub fn key(&self) -> String {
        let mut sorted = self.numbers.clone();
        sorted.sort_unstable();
        let listed: Vec<String> = sorted.iter().map(u64::to_string).collect();
        format!("{}={}", listed.join(","), self.target)
    }
}

/// The countdown task as a [`Dataset`] of `size` items.
#[derive(Clone, Debug)]
pub struct CountdownTask {
    config: CountdownConfig,
    seed: RunSeed,
}

impl CountdownTask {
    /// The task with `config`, seeded by `config.seed` or else `run`.
    pub fn new(config: CountdownConfig, run: RunSeed) -> Result<Self> {
        config.validate()?;
        let seed = config.seed.map_or(run, RunSeed);
        Ok(Self { config, seed })
    }

    /// Item `index`, or an error when no draw within `max_attempts` reached a target
    /// in range (the knobs make that range unreachable or very unlikely).
    pub fn item(&self, index: u64) -> Result<CountdownItem> {
        let c = &self.config;
        let mut rng = SplitMix64::new(stream_seed(self.seed, COUNTDOWN_STREAM, index));
        for _ in 0..c.max_attempts {
            if let Some(item) = self.draw(&mut rng)
                && c.holdout.admits(&item.key())
            {
                return Ok(item);
            }
        }
        Err(Error::Generator {
            task: "countdown",
            item: index,
            reason: format!(
                "no instance with a target in {}..={} in the {:?} split after {} attempts; widen `countdown.target` or change `numbers`/`max_number`",
                c.target.min, c.target.max, c.holdout.split, c.max_attempts
            ),
        })
    }

    /// Draws numbers, then combines random pairs with random valid operators until one
    /// expression is left: its value is the target, its text the solution.
    fn draw(&self, rng: &mut SplitMix64) -> Option<CountdownItem> {
        let c = &self.config;
        let count = rng.between(c.numbers.min, c.numbers.max) as usize;
        let numbers: Vec<u64> = (0..count).map(|_| rng.between(1, c.max_number)).collect();
        // (text, value, is a single number)
        let mut pool: Vec<(String, u64, bool)> = numbers.iter().map(|n| (n.to_string(), *n, true)).collect();
        while pool.len() > 1 {
            let i = rng.below(pool.len() as u64) as usize;
            let a = pool.swap_remove(i);
            let j = rng.below(pool.len() as u64) as usize;
            let b = pool.swap_remove(j);
            let (big, small) = if a.1 >= b.1 { (&a, &b) } else { (&b, &a) };
            let valid: Vec<(Operator, u64)> = c
                .operators
                .iter()
                .filter_map(|&op| {
                    let value = match op {
                        Operator::Add => a.1.checked_add(b.1),
                        Operator::Mul => a.1.checked_mul(b.1),
                        Operator::Sub => (big.1 > small.1).then(|| big.1 - small.1),
                        Operator::Div => (big.1 % small.1 == 0).then(|| big.1 / small.1),
                    }?;
                    (value <= MAX_INTERMEDIATE).then_some((op, value))
                })
                .collect();
            if valid.is_empty() {
                return None;
            }
            let (op, value) = valid[rng.below(valid.len() as u64) as usize];
            let (left, right) = match op {
                Operator::Add | Operator::Mul => (&a, &b),
                Operator::Sub | Operator::Div => (big, small),
            };
            let text = format!("{}{}{}", operand(left), op.symbol(), operand(right));
            pool.push((text, value, false));
        }
        let (solution, target, _) = pool.pop()?;
        (c.target.min..=c.target.max).contains(&target).then_some(CountdownItem { numbers, target, solution })
    }
}

/// An operand's text, parenthesised unless it is a single number, so the solution
/// reads unambiguously whatever the precedence.
fn operand(part: &(String, u64, bool)) -> String {
    if part.2 { part.0.clone() } else { format!("({})", part.0) }
}

impl Dataset for CountdownTask {
    fn len(&self) -> usize {
        usize::try_from(self.config.size).unwrap_or(usize::MAX)
    }

    fn record(&self, index: usize) -> Result<Record> {
        let item = self.item(index as u64)?;
        let listed = item.numbers.iter().map(u64::to_string).collect::<Vec<_>>();
        let target = item.target.to_string();
        let text = render(&self.config.format, &[("numbers", &listed.join(", ")), ("target", &target)]);
        let metadata = BTreeMap::from([
            ("task".to_owned(), "countdown".to_owned()),
            ("numbers".to_owned(), listed.join(",")),
            ("target".to_owned(), target),
        ]);
        Ok(Record {
            id: PromptId(index as u64),
            content: PromptContent::Text(text),
            reference: Some(item.solution),
            metadata,
        })
    }

    fn place(&self, index: usize) -> String {
        format!("countdown item {index}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreachable_targets_are_an_error_naming_the_item() {
        let config = CountdownConfig {
            numbers: Span::exactly(2),
            max_number: 2,
            target: Span::new(100, 200),
            max_attempts: 5,
            ..Default::default()
        };
        let err = CountdownTask::new(config, RunSeed(0)).unwrap().item(3).unwrap_err();
        assert!(err.to_string().starts_with("countdown item 3:"), "{err}");
    }

    #[test]
    fn metadata_and_prompt() {
        let task = CountdownTask::new(CountdownConfig::default(), RunSeed(1)).unwrap();
        let record = task.record(0).unwrap();
        assert_eq!(record.metadata["task"], "countdown");
        let PromptContent::Text(text) = &record.content else { panic!("text expected") };
        assert!(text.contains(&record.metadata["target"]));
        assert!(text.contains("every number exactly once"), "{text}");
        assert!(text.contains("<answer>"), "{text}");
    }
}
