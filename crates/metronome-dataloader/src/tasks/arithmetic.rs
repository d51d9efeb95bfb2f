//! Arithmetic: `12+7=` → `19`, with operators, operand digits and term count as the
//! difficulty knobs.

use std::collections::BTreeMap;

use metronome_core::{PromptId, RunSeed, stream_seed};
use serde::{Deserialize, Serialize};

use super::{Holdout, Operator, Span, render};
use crate::dataset::{Dataset, PromptContent, Record};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// The [`stream_seed`] stream of arithmetic items; the index is the item.
pub const ARITHMETIC_STREAM: u64 = 0x6172_6974_686d_6574; // "arithmet"

/// Draws per item before giving up on landing in the configured split.
const SPLIT_ATTEMPTS: usize = 10_000;

/// How many times an item is redrawn to avoid a negative answer before the
/// subtractions of the last draw are turned into additions.
const NON_NEGATIVE_TRIES: usize = 32;

/// Knobs of the arithmetic task. The default is the built-in task of the embedded
/// run: two one- or two-digit numbers added, written `12+7=`, so that a
/// character-level tokenizer and a tiny model can learn it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArithmeticConfig {
    /// Items per epoch.
    pub size: u64,
    /// Operators to draw from, uniformly, between consecutive terms (`+`, `-`, `*`;
    /// the usual precedence applies: `*` before `+` and `-`).
    pub operators: Vec<Operator>,
    /// Digits of each operand (1 to 18); each operand draws its digit count uniformly,
    /// then a value with exactly that many digits (0 to 9 for one digit).
    pub digits: Span,
    /// Number of operands (2 to 16).
    pub terms: Span,
    /// Whether answers may be negative; when not, a negative item is redrawn.
    pub allow_negative: bool,
    /// The prompt text; `{expression}` becomes the expression, e.g. `12+7`.
    pub format: String,
    /// Generate items from this seed instead of the run seed.
    pub seed: Option<u64>,
    /// Draw only training or only held-out expressions (default: all).
    pub holdout: Holdout,
}

impl Default for ArithmeticConfig {
    fn default() -> Self {
        Self {
            size: 1000,
            operators: vec![Operator::Add],
            digits: Span::new(1, 2),
            terms: Span::exactly(2),
            allow_negative: true,
            format: "{expression}=".into(),
            seed: None,
            holdout: Holdout::default(),
        }
    }
}

impl ArithmeticConfig {
    /// Checks every knob; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if self.size == 0 {
            return Err(Error::config("arithmetic.size", "must be at least 1"));
        }
        if self.operators.is_empty() {
            return Err(Error::config("arithmetic.operators", "is empty"));
        }
        if self.operators.contains(&Operator::Div) {
            return Err(Error::config(
                "arithmetic.operators",
                "`/` is not supported by arithmetic (answers are integers); countdown supports exact division",
            ));
        }
        self.digits.check("arithmetic.digits", 1, 18)?;
        self.terms.check("arithmetic.terms", 2, 16)?;
        // Every answer must fit i128 (about 1.7e38): a product of `terms` operands
        // below 10^digits each stays below 10^(digits * terms).
        if self.operators.contains(&Operator::Mul) && self.digits.max * self.terms.max > 36 {
            return Err(Error::config(
                "arithmetic.digits",
                format!(
                    "{} digits times {} terms with `*` may overflow; keep digits.max * terms.max <= 36",
                    self.digits.max, self.terms.max
                ),
            ));
        }
        if !self.format.contains("{expression}") {
            return Err(Error::config("arithmetic.format", "must contain `{expression}`"));
        }
        self.holdout.check("arithmetic.holdout")
    }
}

/// The arithmetic task as a [`Dataset`] of `size` items.
#[derive(Clone, Debug)]
pub struct ArithmeticTask {
    config: ArithmeticConfig,
    seed: RunSeed,
}

impl ArithmeticTask {
    /// The task with `config`, seeded by `config.seed` or else `run`.
    pub fn new(config: ArithmeticConfig, run: RunSeed) -> Result<Self> {
        config.validate()?;
        let seed = config.seed.map_or(run, RunSeed);
        Ok(Self { config, seed })
    }

    /// Item `index`: its expression (e.g. `12+7`) and answer. An error only when the
    /// configured split holds almost none of the item space.
    pub fn item(&self, index: u64) -> Result<(String, i128)> {
        let mut rng = SplitMix64::new(stream_seed(self.seed, ARITHMETIC_STREAM, index));
        for _ in 0..SPLIT_ATTEMPTS {
            let (expression, answer) = self.draw(&mut rng);
            if self.config.holdout.admits(&expression) {
                return Ok((expression, answer));
            }
        }
        Err(Error::Generator {
            task: "arithmetic",
            item: index,
            reason: format!(
                "no expression in the {:?} split after {SPLIT_ATTEMPTS} draws; widen `digits` or `terms`",
                self.config.holdout.split
            ),
        })
    }

    fn draw(&self, rng: &mut SplitMix64) -> (String, i128) {
        let c = &self.config;
        let mut draw = || {
            let terms = rng.between(c.terms.min, c.terms.max) as usize;
            let operands: Vec<i128> = (0..terms).map(|_| operand(rng, c.digits)).collect();
            let ops: Vec<Operator> =
                (1..terms).map(|_| c.operators[rng.below(c.operators.len() as u64) as usize]).collect();
            (operands, ops)
        };
        let (mut operands, mut ops) = draw();
        let mut answer = evaluate(&operands, &ops);
        if !c.allow_negative && answer < 0 {
            let mut tries = 1;
            while answer < 0 && tries < NON_NEGATIVE_TRIES {
                (operands, ops) = draw();
                answer = evaluate(&operands, &ops);
                tries += 1;
            }
            if answer < 0 {
                // With only `+` and `*` left every operand is non-negative, so is the answer.
                for op in &mut ops {
                    if *op == Operator::Sub {
                        *op = Operator::Add;
                    }
                }
                answer = evaluate(&operands, &ops);
            }
        }
        let mut expression = operands[0].to_string();
        for (op, value) in ops.iter().zip(&operands[1..]) {
            expression.push(op.symbol());
            expression.push_str(&value.to_string());
        }
        (expression, answer)
    }
}

fn operand(rng: &mut SplitMix64, digits: Span) -> i128 {
    let d = rng.between(digits.min, digits.max) as u32;
    let lo = if d == 1 { 0 } else { 10u64.pow(d - 1) };
    i128::from(rng.between(lo, 10u64.pow(d) - 1))
}

/// Evaluates `a0 op1 a1 op2 a2 …` with `*` binding tighter than `+` and `-`.
/// [`ArithmeticConfig::validate`] bounds the knobs so this cannot overflow.
fn evaluate(operands: &[i128], ops: &[Operator]) -> i128 {
    let mut total = 0i128;
    let mut sign = 1i128;
    let mut product = operands[0];
    for (op, &value) in ops.iter().zip(&operands[1..]) {
        match op {
            Operator::Mul => product *= value,
            Operator::Add | Operator::Sub | Operator::Div => {
                total += sign * product;
                sign = if *op == Operator::Sub { -1 } else { 1 };
                product = value;
            }
        }
    }
    total + sign * product
}

impl Dataset for ArithmeticTask {
    fn len(&self) -> usize {
        usize::try_from(self.config.size).unwrap_or(usize::MAX)
    }

    fn record(&self, index: usize) -> Result<Record> {
        let (expression, answer) = self.item(index as u64)?;
        let text = render(&self.config.format, &[("expression", &expression)]);
        let metadata = BTreeMap::from([
            ("task".to_owned(), "arithmetic".to_owned()),
            ("expression".to_owned(), expression),
        ]);
        Ok(Record {
            id: PromptId(index as u64),
            content: PromptContent::Text(text),
            reference: Some(answer.to_string()),
            metadata,
        })
    }

    fn place(&self, index: usize) -> String {
        format!("arithmetic item {index}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence() {
        use Operator::{Add, Mul, Sub};
        assert_eq!(evaluate(&[2, 3, 4], &[Add, Mul]), 14);
        assert_eq!(evaluate(&[2, 3, 4], &[Mul, Sub]), 2);
        assert_eq!(evaluate(&[2, 3, 4, 5], &[Sub, Mul, Add]), -5);
    }

    #[test]
    fn default_items_are_short_sums() {
        let task = ArithmeticTask::new(ArithmeticConfig::default(), RunSeed(3)).unwrap();
        for i in 0..200 {
            let record = task.record(i).unwrap();
            let PromptContent::Text(text) = &record.content else { panic!("text expected") };
            assert!(text.len() <= 6 && text.ends_with('='), "{text}");
        }
    }

    #[test]
    fn validation_names_the_key() {
        let bad = ArithmeticConfig { digits: Span::new(3, 2), ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("arithmetic.digits"));
        let bad = ArithmeticConfig {
            operators: vec![Operator::Mul],
            digits: Span::exactly(9),
            terms: Span::exactly(5),
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("overflow"));
        let bad = ArithmeticConfig { format: "no placeholder".into(), ..Default::default() };
        assert!(bad.validate().is_err());
    }
}
