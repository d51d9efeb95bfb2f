//! String rewards: exact or normalised match against the reference, and format
//! rewards by regular expression.

use regex::{Regex, RegexBuilder};
use serde::{Deserialize, Serialize};

use metronome_core::{Completion, Prompt, Reward, RewardFn};

use crate::error::finite_scores;
use crate::extract::{self, Extractor, tail};
use crate::math::reference_of;
use crate::meter::Meter;
use crate::{Error, Result};

/// Configuration of [`ExactMatch`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExactMatchConfig {
    /// Extract the answer first with these (in order); empty compares the whole completion.
    pub extractors: Vec<Extractor>,
    /// Normalise both sides: trim, collapse whitespace, drop surrounding quotes and
    /// trailing punctuation, and (unless `case_sensitive`) lower-case.
    pub normalise: bool,
    /// Keep case when normalising.
    pub case_sensitive: bool,
    /// Score of a match.
    pub match_score: f32,
    /// Score otherwise.
    pub miss_score: f32,
    /// Only the last this many bytes of a completion are considered.
    pub max_input_bytes: usize,
}

impl Default for ExactMatchConfig {
    fn default() -> Self {
        Self {
            extractors: Extractor::MARKED.to_vec(),
            normalise: true,
            case_sensitive: false,
            match_score: 1.0,
            miss_score: 0.0,
            max_input_bytes: 64 * 1024,
        }
    }
}

impl ExactMatchConfig {
    /// Checks the values and builds the scorer.
    pub fn build(&self) -> Result<ExactMatch> {
        finite_scores(&[
            ("exact_match.match_score", self.match_score),
            ("exact_match.miss_score", self.miss_score),
        ])?;
        if self.max_input_bytes == 0 {
            return Err(Error::config("exact_match.max_input_bytes", "must be positive"));
        }
        Ok(ExactMatch { config: self.clone() })
    }
}

/// Compares the (extracted) answer with the prompt's reference as strings.
#[derive(Clone, Debug)]
pub struct ExactMatch {
    config: ExactMatchConfig,
}

impl ExactMatch {
    /// `text` normalised as configured.
    #[must_use]
    pub fn normalised(&self, text: &str) -> String {
        if !self.config.normalise {
            return text.to_owned();
        }
        let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let trimmed = collapsed
            .trim_end_matches(['.', '!', '?', ';', ','])
            .trim_matches(['"', '\'', '`', '“', '”'])
            .trim();
        if self.config.case_sensitive { trimmed.to_owned() } else { trimmed.to_lowercase() }
    }

    /// Whether `text` answers `reference`.
    #[must_use]
    pub fn matches(&self, text: &str, reference: &str) -> bool {
        let text = tail(text, self.config.max_input_bytes);
        let mut meter = Meter::new();
        let answer = if self.config.extractors.is_empty() {
            Some(text)
        } else {
            extract::extract(text, &self.config.extractors, &mut meter)
        };
        answer.is_some_and(|a| self.normalised(a) == self.normalised(reference))
    }
}

impl RewardFn for ExactMatch {
    fn score(&self, prompt: &Prompt, completion: &Completion) -> Reward {
        let c = &self.config;
        let Some(reference) = reference_of(prompt) else {
            return Reward::failed(c.miss_score, format!("prompt {} has no reference answer", prompt.id));
        };
        let hit = self.matches(&completion.text, reference);
        let hit = if hit { 1.0 } else { 0.0 };
        let mut reward =
            Reward::scalar(if hit > 0.0 { c.match_score } else { c.miss_score }).with_correct(hit);
        reward.parts.insert("match".into(), hit);
        reward
    }
}

/// The `<think>…</think><answer>…</answer>` structure (whitespace allowed between and around).
pub const THINK_ANSWER_PATTERN: &str = r"(?s)\A\s*<think>.*?</think>\s*<answer>.*?</answer>\s*\z";

/// Configuration of [`FormatReward`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FormatConfig {
    /// The regular expression (Rust `regex` syntax, linear time) the completion must
    /// match somewhere; anchor it with `\A…\z` for the whole text. Defaults to
    /// [`THINK_ANSWER_PATTERN`].
    pub pattern: String,
    /// Score when the pattern matches.
    pub match_score: f32,
    /// Score otherwise.
    pub miss_score: f32,
    /// Longer completions score as a miss without matching.
    pub max_input_bytes: usize,
}

impl Default for FormatConfig {
    fn default() -> Self {
        Self {
            pattern: THINK_ANSWER_PATTERN.into(),
            match_score: 1.0,
            miss_score: 0.0,
            max_input_bytes: 256 * 1024,
        }
    }
}

impl FormatConfig {
    /// Compiles the pattern (with a bounded program size) and builds the scorer.
    pub fn build(&self) -> Result<FormatReward> {
        finite_scores(&[("format.match_score", self.match_score), ("format.miss_score", self.miss_score)])?;
        let regex = RegexBuilder::new(&self.pattern)
            .size_limit(1 << 20)
            .dfa_size_limit(4 << 20)
            .build()
            .map_err(|e| Error::config("format.pattern", e.to_string()))?;
        Ok(FormatReward { regex, config: self.clone() })
    }
}

/// Rewards completions whose text matches a pattern.
#[derive(Clone, Debug)]
pub struct FormatReward {
    regex: Regex,
    config: FormatConfig,
}

impl FormatReward {
    /// The `<think>…</think><answer>…</answer>` format reward with scores 1 and 0.
    #[must_use]
    pub fn think_answer() -> Self {
        match FormatConfig::default().build() {
            Ok(f) => f,
            // The built-in pattern is a constant that compiles; a failure is a bug here.
            Err(e) => unreachable!("built-in format pattern: {e}"),
        }
    }

    /// Whether `text` has the format.
    #[must_use]
    pub fn matches(&self, text: &str) -> bool {
        text.len() <= self.config.max_input_bytes && self.regex.is_match(text)
    }
}

impl RewardFn for FormatReward {
    fn score(&self, _prompt: &Prompt, completion: &Completion) -> Reward {
        let hit = self.matches(&completion.text);
        let mut reward = Reward::scalar(if hit { self.config.match_score } else { self.config.miss_score });
        reward.parts.insert("format".into(), if hit { 1.0 } else { 0.0 });
        reward
    }
}
