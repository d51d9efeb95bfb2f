//! Prompts, completions, groups and their scores: what flows from the data loader
//! through rollout and reward to the trainer.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Error, PeriodId, PolicyVersion, PromptId, Result};

/// A token id in the model's vocabulary.
pub type TokenId = u32;

/// One prompt, as released by the data loader for a period.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prompt {
    /// Stable identity (record or item index); the de-duplication key with the period.
    pub id: PromptId,
    /// The prompt as text, after any chat template was applied.
    pub text: String,
    /// The prompt's token ids, as the policy sees them.
    pub tokens: Vec<TokenId>,
    /// The reference answer a verifier compares against, when the task has one.
    pub reference: Option<String>,
    /// Task-specific fields (e.g. `numbers` and `target` for countdown), as strings so
    /// that every serialisation format carries them. Ordered, so encodings are stable.
    pub metadata: BTreeMap<String, String>,
}

/// Why generation of a response stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token (end of sequence) was sampled.
    #[default]
    Stop,
    /// A configured stop string appeared in the text.
    StopString,
    /// The maximum number of new tokens, or the context length, was reached.
    Length,
    /// Generation was cancelled (shutdown, or the period was abandoned).
    Aborted,
    /// The prompt could not be generated from at all (empty, longer than the
    /// engine's context, or failing every worker that took it): the response is
    /// empty. A group of such responses ([`Group::rejected`]) keeps its period
    /// complete; the pipeline counts it and trains nothing from it.
    PromptRejected,
}

/// One sampled response to a prompt.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// Index of this response within its group, `0..G`; an input of the seed rule.
    pub sample_index: u32,
    /// The generated token ids (stop token included when one ended the response).
    pub tokens: Vec<TokenId>,
    /// The behaviour log-probability of each generated token, aligned with `tokens`,
    /// under the distribution the engine actually sampled from (the engine documents
    /// whether that is before or after temperature and truncation).
    pub logprobs: Vec<f32>,
    /// The response decoded to text, for rewards.
    pub text: String,
    /// Why the response ended.
    pub finish_reason: FinishReason,
    /// The policy version whose weights sampled the response's first token: every
    /// token, unless [`Completion::switches`] says newer weights took over.
    pub version: PolicyVersion,
    /// Partial rollouts: where newer weights took over mid-response, in order (the
    /// tokens from `at` on were sampled under `version`, until the next switch). Empty
    /// when one version sampled every token; absent from older JSON (a positional
    /// format such as postcard always carries it, so it is never skipped).
    #[serde(default)]
    pub switches: Vec<VersionSwitch>,
    /// For a multi-turn episode, which tokens the environment wrote and how it ended;
    /// `None` for a single-turn response (every token the policy's). Absent from
    /// older messages, which decode as `None`.
    #[serde(default)]
    pub episode: Option<EpisodeTrace>,
}

/// Newer weights taking over a response mid-way (a partial rollout): its tokens from
/// index `at` on were sampled under `version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VersionSwitch {
    /// Index (in [`Completion::tokens`]) of the first token the new weights sampled.
    pub at: u32,
    /// The version that sampled it.
    pub version: PolicyVersion,
}

impl Completion {
    /// The version whose weights sampled token `index`.
    #[must_use]
    pub fn version_of(&self, index: usize) -> PolicyVersion {
        self.switches.iter().take_while(|s| s.at as usize <= index).last().map_or(self.version, |s| s.version)
    }

    /// The newest version that sampled any of its tokens.
    #[must_use]
    pub fn newest_version(&self) -> PolicyVersion {
        self.switches.last().map_or(self.version, |s| s.version)
    }

    /// Checks the switches: each within the tokens, after the one before, to a newer
    /// version. The reason otherwise, to follow the place that holds the completion.
    pub fn check_switches(&self) -> std::result::Result<(), String> {
        let (mut at, mut version) = (0u32, self.version);
        for (j, s) in self.switches.iter().enumerate() {
            if s.at <= at || s.at as usize >= self.tokens.len() || s.version <= version {
                return Err(format!(
                    "has version switch {j} to version {} at token {}: expected a token after {at} within its \
                     {} tokens and a version newer than {version}",
                    s.version,
                    s.at,
                    self.tokens.len()
                ));
            }
            (at, version) = (s.at, s.version);
        }
        Ok(())
    }
}

/// A contiguous run of a completion's tokens, `start..start + len`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TokenSpan {
    /// Index (in [`Completion::tokens`]) of the first token.
    pub start: u32,
    /// Number of tokens.
    pub len: u32,
}

impl TokenSpan {
    /// One past the last token, saturating: spans come off the wire, and one that
    /// overflows must read as past the tokens (and be refused), not wrap into range.
    #[must_use]
    pub fn end(&self) -> u32 {
        self.start.saturating_add(self.len)
    }
}

/// How a multi-turn episode went, recorded on the completion that holds it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeTrace {
    /// The spans of [`Completion::tokens`] the environment wrote, in order, disjoint:
    /// context for the turns after them, masked out of the loss. Their log-probs are
    /// recorded as 0.
    pub observations: Vec<TokenSpan>,
    /// Policy turns taken (the environment was called after each but possibly the last).
    pub turns: u32,
    /// The environment's reward, when it gave one at the end; `None` leaves scoring
    /// to the reward stage.
    pub reward: Option<f32>,
    /// Why the episode ended before the environment said `done`: a limit
    /// (`max_turns`, `max_tokens`) or a failing tool (`tool_timeout`, `tool_panic`,
    /// `tool_error: …`). `None` when it ended normally.
    pub failure: Option<String>,
}

impl EpisodeTrace {
    /// Checks the observation spans against a completion of `tokens` tokens: each
    /// non-empty, in order, disjoint and within the tokens. The reason otherwise, to
    /// follow the place that holds the trace ("… has observation span 1 over …").
    pub fn check_spans(&self, tokens: usize) -> std::result::Result<(), String> {
        let mut next = 0;
        for (j, s) in self.observations.iter().enumerate() {
            if s.start < next || s.len == 0 || s.end() as usize > tokens {
                return Err(format!(
                    "has observation span {j} over tokens {}..{}: expected a non-empty span from {next} \
                     within its {tokens} tokens",
                    s.start,
                    s.end()
                ));
            }
            next = s.end();
        }
        Ok(())
    }

    /// Tokens the environment wrote.
    #[must_use]
    pub fn observation_tokens(&self) -> usize {
        self.observations.iter().map(|s| s.len as usize).sum()
    }
}

impl Completion {
    /// Per token, whether the policy sampled it (`true`) or an environment wrote it
    /// (`false`, an observation). Only policy tokens are loss targets.
    #[must_use]
    pub fn policy_mask(&self) -> Vec<bool> {
        let mut mask = vec![true; self.tokens.len()];
        if let Some(trace) = &self.episode {
            for s in &trace.observations {
                let end = (s.end() as usize).min(mask.len());
                let start = (s.start as usize).min(end);
                mask[start..end].fill(false);
            }
        }
        mask
    }

    /// Number of tokens the policy sampled (all of them without an episode).
    #[must_use]
    pub fn num_policy_tokens(&self) -> usize {
        self.tokens.len() - self.episode.as_ref().map_or(0, EpisodeTrace::observation_tokens)
    }
}

/// Wall-clock facts about one group's generation, for metrics and timelines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupTiming {
    /// Seconds from the period's start until the group's first response began.
    pub started_s: f64,
    /// Seconds from the period's start until the group's last response finished.
    pub finished_s: f64,
}

/// One prompt and its `G` responses: the unit that GRPO normalises over and that the
/// pipeline moves, scores and trains.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Group {
    /// The period whose batch released this prompt.
    pub period: PeriodId,
    /// The prompt.
    pub prompt: Prompt,
    /// The responses, ordered by `sample_index`.
    pub completions: Vec<Completion>,
    /// When the group was generated.
    pub timing: GroupTiming,
}

impl Group {
    /// The key under which a group is counted exactly once: (period, prompt id).
    #[must_use]
    pub fn key(&self) -> GroupKey {
        GroupKey { period: self.period, prompt: self.prompt.id }
    }

    /// The oldest policy version that sampled any token of the responses (the
    /// group's staleness is measured from it), or `None` for an empty group.
    #[must_use]
    pub fn oldest_version(&self) -> Option<PolicyVersion> {
        self.completions.iter().map(|c| c.version).min()
    }

    /// The newest policy version that sampled any token of the responses, or `None`
    /// for an empty group.
    #[must_use]
    pub fn newest_version(&self) -> Option<PolicyVersion> {
        self.completions.iter().map(Completion::newest_version).max()
    }

    /// The group standing for a prompt that cannot be generated from: `group_size`
    /// empty responses marked [`FinishReason::PromptRejected`], at `version`. It
    /// flows like any group, so that the period it belongs to still completes.
    #[must_use]
    pub fn rejected(period: PeriodId, prompt: Prompt, group_size: u32, version: PolicyVersion) -> Self {
        let completions = (0..group_size)
            .map(|sample_index| Completion {
                sample_index,
                version,
                finish_reason: FinishReason::PromptRejected,
                ..Completion::default()
            })
            .collect();
        Self { period, prompt, completions, timing: GroupTiming::default() }
    }

    /// True for a group made by [`Group::rejected`] (every response's prompt was
    /// rejected): it holds nothing to train.
    #[must_use]
    pub fn is_rejected(&self) -> bool {
        !self.completions.is_empty()
            && self.completions.iter().all(|c| c.finish_reason == FinishReason::PromptRejected)
    }

    /// Checks the structural invariants every stage may rely on: at least one
    /// response, sample indices `0..G` in order, log-probs aligned with tokens and
    /// finite (a NaN or infinite behaviour log-prob makes the trainer's loss
    /// non-finite, and its guard then drops the whole step).
    pub fn validate(&self) -> Result<()> {
        let key = self.key();
        if self.completions.is_empty() {
            return Err(Error::invalid(format!("group {key}"), "has no completions"));
        }
        for (i, c) in self.completions.iter().enumerate() {
            if c.sample_index as usize != i {
                return Err(Error::invalid(
                    format!("group {key}, completion {i}"),
                    format!("has sample_index {} (expected {i})", c.sample_index),
                ));
            }
            if c.logprobs.len() != c.tokens.len() {
                return Err(Error::invalid(
                    format!("group {key}, completion {i}"),
                    format!("has {} log-probs for {} tokens", c.logprobs.len(), c.tokens.len()),
                ));
            }
            if let Some(j) = c.logprobs.iter().position(|l| !l.is_finite()) {
                return Err(Error::invalid(
                    format!("group {key}, completion {i}"),
                    format!("has log-prob {} at token {j} (log-probs are finite)", c.logprobs[j]),
                ));
            }
            if let Some(trace) = &c.episode {
                trace
                    .check_spans(c.tokens.len())
                    .map_err(|reason| Error::invalid(format!("group {key}, completion {i}"), reason))?;
            }
            c.check_switches()
                .map_err(|reason| Error::invalid(format!("group {key}, completion {i}"), reason))?;
        }
        Ok(())
    }
}

/// The identity of a group: the period that released its prompt and the prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GroupKey {
    /// The releasing period.
    pub period: PeriodId,
    /// The prompt.
    pub prompt: PromptId,
}

impl std::fmt::Display for GroupKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "(period {}, prompt {})", self.period, self.prompt)
    }
}

/// The score of one completion.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Reward {
    /// The scalar the advantage is computed from.
    pub total: f32,
    /// Named parts (e.g. [`Reward::CORRECT`], `format`, `length`), for metrics; may be
    /// empty.
    pub parts: BTreeMap<String, f32>,
    /// Set when scoring failed (timeout, panic, remote error); `total` then holds the
    /// configured failure score. A failure is data, not an error: the run goes on.
    pub failure: Option<String>,
}

impl Reward {
    /// The part that says whether an answer is right (1) or wrong (0). Verifiers
    /// write it; the period's training accuracy and held-out evaluation read it.
    pub const CORRECT: &'static str = "correct";

    /// The [`Reward::CORRECT`] part, when the scorer reports one.
    #[must_use]
    pub fn correct(&self) -> Option<f32> {
        self.parts.get(Self::CORRECT).copied()
    }

    /// How right the answer is, for accuracies: its [`Reward::CORRECT`] part, or, from
    /// a scorer that reports none, 1 for a positive total and 0 otherwise.
    #[must_use]
    pub fn correctness(&self) -> f32 {
        self.correct().unwrap_or(if self.total > 0.0 { 1.0 } else { 0.0 })
    }

    /// Sets the [`Reward::CORRECT`] part.
    #[must_use]
    pub fn with_correct(mut self, correct: f32) -> Self {
        self.parts.insert(Self::CORRECT.to_owned(), correct);
        self
    }

    /// A reward with only a total.
    #[must_use]
    pub fn scalar(total: f32) -> Self {
        Self { total, ..Self::default() }
    }

    /// A failed scoring with the given score and reason.
    #[must_use]
    pub fn failed(score: f32, reason: impl Into<String>) -> Self {
        Self { total: score, parts: BTreeMap::new(), failure: Some(reason.into()) }
    }
}

/// How rewards within a group become advantages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// GRPO (Shao et al. 2024, arXiv 2402.03300): `(r - mean) / (std + eps)`,
    /// population standard deviation.
    #[default]
    GroupNorm,
    /// Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): `r - mean`, no division by
    /// the standard deviation.
    GroupMean,
    /// RLOO (Ahmadian et al. 2024, arXiv 2402.14740): `r_i - mean_{j != i} r_j`,
    /// the leave-one-out baseline.
    LeaveOneOut,
    /// REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): the group mean
    /// as the baseline, `r - mean`, then every advantage of the *batch* divided by
    /// the batch's standard deviation of these (plus [`ADVANTAGE_STD_EPS`]). Per group
    /// this computes `r - mean`; the batch part needs the whole batch, so the trainer
    /// applies it (as a step-time scale on the policy-gradient term, where groups
    /// arrive one at a time).
    ReinforcePlusPlusBaseline,
}

/// The epsilon added to the standard deviation by [`AdvantageEstimator::GroupNorm`]
/// and [`AdvantageEstimator::ReinforcePlusPlusBaseline`].
pub const ADVANTAGE_STD_EPS: f32 = 1e-6;

/// Summary statistics of a group's rewards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupStats {
    /// Mean reward.
    pub mean: f32,
    /// Population standard deviation of the rewards.
    pub std: f32,
    /// True when every reward is equal: the group carries no learning signal under
    /// any group-relative estimator and contributes zero (it is counted, not trained).
    pub all_equal: bool,
}

impl GroupStats {
    /// Statistics of `rewards` (all zeros for an empty slice).
    #[must_use]
    pub fn of(rewards: &[f32]) -> Self {
        if rewards.is_empty() {
            return Self { mean: 0.0, std: 0.0, all_equal: true };
        }
        // Accumulate in f64 so the statistics do not depend on group size rounding.
        let n = rewards.len() as f64;
        let mean = rewards.iter().map(|&r| f64::from(r)).sum::<f64>() / n;
        let var = rewards.iter().map(|&r| (f64::from(r) - mean).powi(2)).sum::<f64>() / n;
        let all_equal = rewards.iter().all(|&r| r == rewards[0]);
        Self { mean: mean as f32, std: var.sqrt() as f32, all_equal }
    }
}

impl AdvantageEstimator {
    /// Advantages for one group's rewards, in the same order. An all-equal group gets
    /// exact zeros under every estimator.
    #[must_use]
    pub fn advantages(self, rewards: &[f32]) -> Vec<f32> {
        let stats = GroupStats::of(rewards);
        if stats.all_equal {
            return vec![0.0; rewards.len()];
        }
        let mean = f64::from(stats.mean);
        match self {
            Self::GroupNorm => {
                let denom = f64::from(stats.std) + f64::from(ADVANTAGE_STD_EPS);
                rewards.iter().map(|&r| ((f64::from(r) - mean) / denom) as f32).collect()
            }
            Self::GroupMean | Self::ReinforcePlusPlusBaseline => {
                rewards.iter().map(|&r| (f64::from(r) - mean) as f32).collect()
            }
            Self::LeaveOneOut => {
                let n = rewards.len() as f64;
                let sum: f64 = rewards.iter().map(|&r| f64::from(r)).sum();
                rewards
                    .iter()
                    .map(|&r| {
                        let r = f64::from(r);
                        (r - (sum - r) / (n - 1.0)) as f32
                    })
                    .collect()
            }
        }
    }
}

/// A group with its rewards and advantages: what the trainer side receives.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScoredGroup {
    /// The generated group.
    pub group: Group,
    /// One reward per completion, in completion order.
    pub rewards: Vec<Reward>,
    /// One advantage per completion, in completion order.
    pub advantages: Vec<f32>,
    /// Statistics of the rewards.
    pub stats: GroupStats,
}

impl ScoredGroup {
    /// Attaches rewards to a group and computes advantages with `estimator`.
    pub fn new(group: Group, rewards: Vec<Reward>, estimator: AdvantageEstimator) -> Result<Self> {
        if rewards.len() != group.completions.len() {
            return Err(Error::invalid(
                format!("group {}", group.key()),
                format!("has {} rewards for {} completions", rewards.len(), group.completions.len()),
            ));
        }
        let totals: Vec<f32> = rewards.iter().map(|r| r.total).collect();
        let stats = GroupStats::of(&totals);
        let advantages = estimator.advantages(&totals);
        Ok(Self { group, rewards, advantages, stats })
    }

    /// The group's identity.
    #[must_use]
    pub fn key(&self) -> GroupKey {
        self.group.key()
    }

    /// Computes the statistics and advantages again from the rewards with
    /// `estimator`, replacing those the group came with: a trainer takes the rewards
    /// of another process, never its arithmetic. Refuses a group whose rewards do not
    /// match its completions or are not finite.
    pub fn recompute(&mut self, estimator: AdvantageEstimator) -> Result<()> {
        let key = self.key();
        if self.rewards.len() != self.group.completions.len() {
            return Err(Error::invalid(
                format!("group {key}"),
                format!(
                    "has {} rewards for {} completions",
                    self.rewards.len(),
                    self.group.completions.len()
                ),
            ));
        }
        let totals: Vec<f32> = self.rewards.iter().map(|r| r.total).collect();
        if let Some(i) = totals.iter().position(|t| !t.is_finite()) {
            return Err(Error::invalid(format!("group {key}, reward {i}"), format!("is {}", totals[i])));
        }
        self.stats = GroupStats::of(&totals);
        self.advantages = estimator.advantages(&totals);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the fuzz suite: a group message whose log-prob bytes were NaN was
    /// accepted, and reached the trainer as a non-finite loss (the step dropped).
    #[test]
    fn non_finite_log_probs_are_refused_naming_the_completion_and_token() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let c = Completion {
                tokens: vec![1, 2, 3],
                logprobs: vec![-0.5, bad, -1.0],
                ..Completion::default()
            };
            let group = Group { completions: vec![c], ..Group::default() };
            let e = group.validate().unwrap_err().to_string();
            assert!(e.contains("completion 0") && e.contains("at token 1"), "{e}");
        }
    }

    #[test]
    fn the_policy_mask_clears_exactly_the_observation_spans() {
        let c = Completion {
            tokens: vec![1, 2, 3, 4, 5, 6, 7],
            episode: Some(EpisodeTrace {
                observations: vec![TokenSpan { start: 2, len: 2 }, TokenSpan { start: 6, len: 1 }],
                ..EpisodeTrace::default()
            }),
            ..Completion::default()
        };
        assert_eq!(c.policy_mask(), [true, true, false, false, true, true, false]);
        assert_eq!(c.num_policy_tokens(), 4);
        let plain = Completion { tokens: vec![1, 2], ..Completion::default() };
        assert_eq!(plain.policy_mask(), [true, true]);
        assert_eq!(plain.num_policy_tokens(), 2);
    }

    #[test]
    fn switches_give_each_token_its_version_and_bad_ones_are_named() {
        let switch = |at, version| VersionSwitch { at, version: PolicyVersion(version) };
        let mut c = Completion {
            tokens: vec![1; 6],
            version: PolicyVersion(3),
            switches: vec![switch(2, 4), switch(5, 6)],
            ..Completion::default()
        };
        let versions: Vec<u64> = (0..6).map(|i| c.version_of(i).0).collect();
        assert_eq!(versions, [3, 3, 4, 4, 4, 6]);
        assert_eq!(c.newest_version(), PolicyVersion(6));
        c.check_switches().unwrap();
        for bad in [
            vec![switch(0, 4)],               // the first token is the start version's
            vec![switch(2, 3)],               // not newer
            vec![switch(3, 4), switch(3, 5)], // not after the one before
            vec![switch(6, 4)],               // past the tokens
        ] {
            c.switches = bad;
            let err = c.check_switches().unwrap_err();
            assert!(err.starts_with("has version switch"), "{err}");
        }
    }
}
