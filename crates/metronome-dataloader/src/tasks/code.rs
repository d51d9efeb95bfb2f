//! Code tasks: small programming problems with their tests, for the code-execution
//! reward on runs that need no dataset on disk (the CPU end-to-end path).
//!
//! Each item is one of a few families of one-line functions or programs, with a
//! drawn constant: `f(x)` returns `x + 7`, counts a letter, repeats a string, the
//! largest element plus a constant, or a program that sums the integers of its input.
//! The tests are a [`CodeTests`] in the prompt's reference (JSON): three asserts, or
//! three stdin/stdout cases for the program family; the canonical solution is in the
//! `solution` metadata field.

use std::collections::BTreeMap;

use metronome_core::{CodeTests, IoCase, PromptId, RunSeed, stream_seed};
use serde::{Deserialize, Serialize};

use super::{Holdout, render};
use crate::dataset::{Dataset, PromptContent, Record};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// The [`stream_seed`] stream of code items; the index is the item.
pub const CODE_STREAM: u64 = 0x636f_6465_7461_736b; // "codetask"

/// Draws per item before giving up on landing in the configured split.
const SPLIT_ATTEMPTS: usize = 10_000;

/// A family of generated code tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CodeFamily {
    /// `f(x)` returns `x + k`.
    Add,
    /// `f(x)` returns `x * k`.
    Multiply,
    /// `f(s)` returns how often a letter occurs in `s`.
    Count,
    /// `f(s)` returns `s` repeated `k` times.
    Repeat,
    /// `f(xs)` returns the largest element of `xs` plus `k`.
    MaxPlus,
    /// A program that prints the sum of the integers on its input, plus `k` (tested
    /// with stdin/stdout cases).
    SumInput,
}

impl CodeFamily {
    const ALL: [Self; 6] =
        [Self::Add, Self::Multiply, Self::Count, Self::Repeat, Self::MaxPlus, Self::SumInput];

    fn name(self) -> &'static str {
        match self {
            Self::Add => "add",
            Self::Multiply => "multiply",
            Self::Count => "count",
            Self::Repeat => "repeat",
            Self::MaxPlus => "max_plus",
            Self::SumInput => "sum_input",
        }
    }
}

/// Knobs of the code task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CodeTaskConfig {
    /// Items per epoch.
    pub size: u64,
    /// Families to draw from, uniformly (default: all).
    pub families: Vec<CodeFamily>,
    /// The prompt text; `{task}` becomes the task's statement.
    pub format: String,
    /// Generate items from this seed instead of the run seed.
    pub seed: Option<u64>,
    /// Draw only training or only held-out tasks (default: all).
    pub holdout: Holdout,
}

impl Default for CodeTaskConfig {
    fn default() -> Self {
        Self {
            size: 1000,
            families: CodeFamily::ALL.to_vec(),
            format: "{task}\n".into(),
            seed: None,
            holdout: Holdout::default(),
        }
    }
}

impl CodeTaskConfig {
    /// Checks every knob; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if self.size == 0 {
            return Err(Error::config("code.size", "must be at least 1"));
        }
        if self.families.is_empty() {
            return Err(Error::config("code.families", "is empty"));
        }
        if !self.format.contains("{task}") {
            return Err(Error::config("code.format", "must contain `{task}`"));
        }
        self.holdout.check("code.holdout")
    }
}

/// One generated code task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeItem {
    /// The family.
    pub family: CodeFamily,
    /// The statement, e.g. ``Write a Python function `f(x)` that returns x plus 7.``
    pub statement: String,
    /// The tests.
    pub tests: CodeTests,
    /// A program that passes them.
    pub solution: String,
    /// The content key the held-out split hashes (family and constants).
    pub key: String,
}

/// The code task as a [`Dataset`] of `size` items.
#[derive(Clone, Debug)]
pub struct CodeTask {
    config: CodeTaskConfig,
    seed: RunSeed,
}

fn asserts(tests: Vec<String>) -> CodeTests {
    CodeTests::Assert { prefix: String::new(), setup: String::new(), tests }
}

const LETTERS: &[u8] = b"abcdefghij";

fn word(rng: &mut SplitMix64) -> String {
    let len = rng.between(0, 9) as usize;
    (0..len).map(|_| LETTERS[rng.below(LETTERS.len() as u64) as usize] as char).collect()
}

impl CodeTask {
    /// The task with `config`, seeded by `config.seed` or else `run`.
    pub fn new(config: CodeTaskConfig, run: RunSeed) -> Result<Self> {
        config.validate()?;
        let seed = config.seed.map_or(run, RunSeed);
        Ok(Self { config, seed })
    }

    /// Item `index`. An error only when the configured split holds almost none of the
    /// item space.
    pub fn item(&self, index: u64) -> Result<CodeItem> {
        let mut rng = SplitMix64::new(stream_seed(self.seed, CODE_STREAM, index));
        for _ in 0..SPLIT_ATTEMPTS {
            let family = self.config.families[rng.below(self.config.families.len() as u64) as usize];
            let item = draw(family, &mut rng);
            if self.config.holdout.admits(&item.key) {
                return Ok(item);
            }
        }
        Err(Error::Generator {
            task: "code",
            item: index,
            reason: format!(
                "no task in the {:?} split after {SPLIT_ATTEMPTS} draws; add families",
                self.config.holdout.split
            ),
        })
    }
}

fn draw(family: CodeFamily, rng: &mut SplitMix64) -> CodeItem {
    let k = rng.between(2, 99) as i64;
    let name = family.name();
    let (statement, tests, solution, key) = match family {
        CodeFamily::Add | CodeFamily::Multiply => {
            let (op, words) = if family == CodeFamily::Add { ("+", "plus") } else { ("*", "times") };
            let xs = [0, rng.between(1, 50) as i64, -(rng.between(1, 50) as i64)];
            let tests = xs.iter().map(|x| {
                let want = if family == CodeFamily::Add { x + k } else { x * k };
                format!("assert f({x}) == {want}")
            });
            (
                format!("Write a Python function `f(x)` that returns x {words} {k}."),
                asserts(tests.collect()),
                format!("def f(x):\n    return x {op} {k}\n"),
                format!("{name}:{k}"),
            )
        }
        CodeFamily::Count => {
            let letter = LETTERS[rng.below(LETTERS.len() as u64) as usize] as char;
            let words: Vec<String> = (0..3).map(|_| word(rng)).collect();
            let tests = words.iter().map(|w| format!("assert f({w:?}) == {}", w.matches(letter).count()));
            (
                format!(
                    "Write a Python function `f(s)` that returns how many times the letter '{letter}' occurs in the string s."
                ),
                asserts(tests.collect()),
                format!("def f(s):\n    return s.count({:?})\n", letter.to_string()),
                format!("{name}:{letter}"),
            )
        }
        CodeFamily::Repeat => {
            let k = k % 5 + 1;
            let words: Vec<String> = (0..3).map(|_| word(rng)).collect();
            let tests = words.iter().map(|w| format!("assert f({w:?}) == {:?}", w.repeat(k as usize)));
            (
                format!("Write a Python function `f(s)` that returns the string s repeated {k} times."),
                asserts(tests.collect()),
                format!("def f(s):\n    return s * {k}\n"),
                format!("{name}:{k}"),
            )
        }
        CodeFamily::MaxPlus => {
            let lists: Vec<Vec<i64>> = (0..3)
                .map(|_| (0..rng.between(1, 5)).map(|_| rng.between(0, 200) as i64 - 100).collect())
                .collect();
            let tests = lists
                .iter()
                .map(|xs| format!("assert f({xs:?}) == {}", xs.iter().max().copied().unwrap_or(0) + k));
            (
                format!(
                    "Write a Python function `f(xs)` that returns the largest number of the non-empty list xs plus {k}."
                ),
                asserts(tests.collect()),
                format!("def f(xs):\n    return max(xs) + {k}\n"),
                format!("{name}:{k}"),
            )
        }
        CodeFamily::SumInput => {
            let cases = (0..3)
                .map(|_| {
                    let xs: Vec<i64> =
                        (0..rng.between(1, 5)).map(|_| rng.between(0, 100) as i64 - 50).collect();
                    let line = xs.iter().map(i64::to_string).collect::<Vec<_>>().join(" ");
                    IoCase { input: format!("{line}\n"), output: format!("{}\n", xs.iter().sum::<i64>() + k) }
                })
                .collect();
            (
                format!(
                    "Write a Python program that reads integers separated by spaces from one line of standard input and prints their sum plus {k}."
                ),
                CodeTests::Io { cases },
                format!("print(sum(map(int, input().split())) + {k})\n"),
                format!("{name}:{k}"),
            )
        }
    };
    CodeItem { family, statement, tests, solution, key }
}

impl Dataset for CodeTask {
    fn len(&self) -> usize {
        usize::try_from(self.config.size).unwrap_or(usize::MAX)
    }

    fn record(&self, index: usize) -> Result<Record> {
        let item = self.item(index as u64)?;
        let text = render(&self.config.format, &[("task", &item.statement)]);
        let reference = serde_json::to_string(&item.tests).map_err(|e| Error::Generator {
            task: "code",
            item: index as u64,
            reason: format!("its tests do not serialise: {e}"),
        })?;
        let metadata = BTreeMap::from([
            ("task".to_owned(), "code".to_owned()),
            ("family".to_owned(), item.family.name().to_owned()),
            ("entry_point".to_owned(), "f".to_owned()),
            ("solution".to_owned(), item.solution),
        ]);
        Ok(Record {
            id: PromptId(index as u64),
            content: PromptContent::Text(text),
            reference: Some(reference),
            metadata,
        })
    }

    fn place(&self, index: usize) -> String {
        format!("code item {index}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_deterministic_and_carry_three_tests() {
        let task = CodeTask::new(CodeTaskConfig::default(), RunSeed(5)).unwrap();
        let mut families = std::collections::BTreeSet::new();
        for i in 0..120 {
            let item = task.item(i).unwrap();
            assert_eq!(item, task.item(i).unwrap());
            assert_eq!(item.tests.len(), 3, "{item:?}");
            families.insert(item.family.name());
        }
        assert_eq!(families.len(), CodeFamily::ALL.len());
    }

    #[test]
    fn validation_names_the_key() {
        let bad = CodeTaskConfig { families: vec![], ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("code.families"));
        let bad = CodeTaskConfig { format: "no slot".into(), ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("code.format"));
    }
}
