//! Copy with a long tail: `dbjj=` → `dbjj`, where the string's length follows a
//! heavy-tailed (Zipf) law, so most answers are a few tokens and a few run to the
//! longest. It is the task that shows what a schedule does with long-tail generation
//! lengths (a period held back by its slowest response), and a tiny model learns it.

use std::collections::BTreeMap;

use metronome_core::{PromptId, RunSeed, stream_seed};
use serde::{Deserialize, Serialize};

use super::{Holdout, Span, render};
use crate::dataset::{Dataset, PromptContent, Record};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// The [`stream_seed`] stream of copy items; the index is the item.
pub const COPY_STREAM: u64 = 0x636f_7079_7461_696c; // "copytail"

/// Draws per item before giving up on landing in the configured split.
const SPLIT_ATTEMPTS: usize = 10_000;

/// Knobs of the copy task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CopyConfig {
    /// Items per epoch.
    pub size: u64,
    /// The string's length in characters (1 to 256).
    pub length: Span,
    /// The Zipf exponent of the length: `P(L) ∝ (L - min + 1)^-tail`. 0 draws lengths
    /// uniformly; about 1 to 1.5 gives a long tail (most strings short, a few at `max`).
    pub tail: f64,
    /// The characters strings are drawn from, uniformly (2 to 64, distinct).
    pub alphabet: String,
    /// The prompt text; `{text}` becomes the string.
    pub format: String,
    /// Generate items from this seed instead of the run seed.
    pub seed: Option<u64>,
    /// Draw only training or only held-out strings (default: all).
    pub holdout: Holdout,
}

impl Default for CopyConfig {
    fn default() -> Self {
        Self {
            size: 1000,
            length: Span::new(1, 40),
            tail: 1.2,
            alphabet: "abcdefghij".into(),
            format: "{text}=".into(),
            seed: None,
            holdout: Holdout::default(),
        }
    }
}

impl CopyConfig {
    /// Checks every knob; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if self.size == 0 {
            return Err(Error::config("copy.size", "must be at least 1"));
        }
        self.length.check("copy.length", 1, 256)?;
        if !(self.tail.is_finite() && (0.0..=8.0).contains(&self.tail)) {
            return Err(Error::config("copy.tail", format!("is {}, expected 0 to 8", self.tail)));
        }
        let chars: Vec<char> = self.alphabet.chars().collect();
        let distinct: std::collections::BTreeSet<char> = chars.iter().copied().collect();
        if !(2..=64).contains(&chars.len()) || distinct.len() != chars.len() {
            return Err(Error::config(
                "copy.alphabet",
                format!(
                    "has {} characters ({} distinct): expected 2 to 64 distinct",
                    chars.len(),
                    distinct.len()
                ),
            ));
        }
        if chars.iter().any(|c| self.format.replace("{text}", "").contains(*c)) {
            return Err(Error::config(
                "copy.format",
                "uses a character of copy.alphabet outside `{text}`: the string's end would be ambiguous",
            ));
        }
        if !self.format.contains("{text}") {
            return Err(Error::config("copy.format", "must contain `{text}`"));
        }
        self.holdout.check("copy.holdout")
    }
}

/// The copy task as a [`Dataset`] of `size` items.
#[derive(Clone, Debug)]
pub struct CopyTask {
    config: CopyConfig,
    seed: RunSeed,
    alphabet: Vec<char>,
    /// The cumulative Zipf weights of the lengths `min..=max`, normalised to end at 1.
    lengths: Vec<f64>,
}

impl CopyTask {
    /// The task with `config`, seeded by `config.seed` or else `run`.
    pub fn new(config: CopyConfig, run: RunSeed) -> Result<Self> {
        config.validate()?;
        let seed = config.seed.map_or(run, RunSeed);
        let weights: Vec<f64> =
            (1..=config.length.max - config.length.min + 1).map(|r| (r as f64).powf(-config.tail)).collect();
        let total: f64 = weights.iter().sum();
        let lengths = weights
            .iter()
            .scan(0.0, |acc, w| {
                *acc += w / total;
                Some(*acc)
            })
            .collect();
        let alphabet = config.alphabet.chars().collect();
        Ok(Self { config, seed, alphabet, lengths })
    }

    /// Item `index`'s string. An error only when the configured split holds almost
    /// none of the item space.
    pub fn item(&self, index: u64) -> Result<String> {
        let mut rng = SplitMix64::new(stream_seed(self.seed, COPY_STREAM, index));
        for _ in 0..SPLIT_ATTEMPTS {
            let text = self.draw(&mut rng);
            if self.config.holdout.admits(&text) {
                return Ok(text);
            }
        }
        Err(Error::Generator {
            task: "copy",
            item: index,
            reason: format!(
                "no string in the {:?} split after {SPLIT_ATTEMPTS} draws; widen `length` or `alphabet`",
                self.config.holdout.split
            ),
        })
    }

    fn draw(&self, rng: &mut SplitMix64) -> String {
        // 53 random bits as a uniform number in [0, 1), then the inverse of the CDF.
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let rank = self.lengths.partition_point(|&c| c <= u).min(self.lengths.len() - 1);
        let len = self.config.length.min as usize + rank;
        (0..len).map(|_| self.alphabet[rng.below(self.alphabet.len() as u64) as usize]).collect()
    }
}

impl Dataset for CopyTask {
    fn len(&self) -> usize {
        usize::try_from(self.config.size).unwrap_or(usize::MAX)
    }

    fn record(&self, index: usize) -> Result<Record> {
        let text = self.item(index as u64)?;
        let prompt = render(&self.config.format, &[("text", &text)]);
        let metadata = BTreeMap::from([("task".to_owned(), "copy".to_owned())]);
        Ok(Record {
            id: PromptId(index as u64),
            content: PromptContent::Text(prompt),
            reference: Some(text),
            metadata,
        })
    }

    fn place(&self, index: usize) -> String {
        format!("copy item {index}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_have_a_long_tail_within_the_span() {
        let task = CopyTask::new(CopyConfig { size: 4000, ..CopyConfig::default() }, RunSeed(1)).unwrap();
        let lengths: Vec<usize> = (0..4000).map(|i| task.item(i).unwrap().len()).collect();
        assert!(lengths.iter().all(|l| (1..=40).contains(l)));
        let short = lengths.iter().filter(|&&l| l <= 4).count();
        let long = lengths.iter().filter(|&&l| l >= 30).count();
        // Zipf(1.2) over 1..=40: about 60% at most 4 characters, about 5% at least 30.
        assert!(short > 2000, "{short} short of 4000");
        assert!((50..600).contains(&long), "{long} long of 4000");
        let record = task.record(3).unwrap();
        let PromptContent::Text(prompt) = &record.content else { panic!("text expected") };
        assert_eq!(prompt, &format!("{}=", record.reference.unwrap()));
    }

    #[test]
    fn validation_names_the_key() {
        for (bad, key) in [
            (CopyConfig { length: Span::new(0, 3), ..CopyConfig::default() }, "copy.length"),
            (CopyConfig { tail: f64::NAN, ..CopyConfig::default() }, "copy.tail"),
            (CopyConfig { alphabet: "aab".into(), ..CopyConfig::default() }, "copy.alphabet"),
            (CopyConfig { format: "a{text}".into(), ..CopyConfig::default() }, "copy.format"),
            (CopyConfig { format: "{txt}".into(), ..CopyConfig::default() }, "copy.format"),
        ] {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }
}
