//! Multi-turn episodes: environments the policy talks to between its turns.
//!
//! An episode starts from a prompt. The policy produces a *turn* (text ending at a
//! stop token or at one of the environment's turn-ending strings such as
//! `</tool_call>`); the environment answers with an [`Observation`]: text to append
//! (a tool result, feedback), or `done`, and at the end optionally a reward. The
//! rollout engine appends the observation's tokens to the same sequence and lets the
//! policy continue, so one [`Completion`] holds the whole trajectory: the policy's
//! tokens and the observations' tokens interleaved. [`EpisodeTrace::observations`]
//! says which tokens the environment wrote: they are context for later turns and
//! never loss targets.
//!
//! [`Environment`] is synchronous (starting an episode never waits); [`Episode::step`]
//! is async, because a tool may call out (a sandbox, a search service). The engine
//! bounds every step with a time limit and isolates panics: a hung or panicking tool
//! ends its episode with a failure reason, never the run.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::{Completion, Prompt, Result};

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

/// What an environment answers to one policy turn.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Text appended to the trajectory after the turn (a rendered tool message,
    /// feedback), tokenized by the engine. Ignored when `done`.
    pub text: String,
    /// The episode is over: the turn just taken was the last.
    pub done: bool,
    /// The episode's reward, given with `done`; `None` defers to the reward stage.
    pub reward: Option<f32>,
}

impl Observation {
    /// Text for the policy to read before its next turn.
    pub fn reply(text: impl Into<String>) -> Self {
        Self { text: text.into(), done: false, reward: None }
    }

    /// The end of the episode, with the environment's reward (or `None`, for the
    /// reward stage to score the trajectory).
    #[must_use]
    pub fn done(reward: Option<f32>) -> Self {
        Self { text: String::new(), done: true, reward }
    }
}

/// One running episode: the environment's side of one trajectory.
#[async_trait]
pub trait Episode: Send {
    /// Answers the policy's `turn` (its text since the previous observation, the
    /// turn-ending string included). An `Err` ends the episode with the error as
    /// its failure reason; bad tool calls from the model (malformed, unknown tool)
    /// are data, and should be answered with an observation that says what was wrong.
    async fn step(&mut self, turn: &str) -> Result<Observation>;
}

/// Starts episodes: one per response to a prompt.
pub trait Environment: Send + Sync {
    /// A new episode for response `sample_index` to `prompt` (its text, tokens,
    /// reference and metadata). Must depend only on its inputs, so that trajectories
    /// are reproducible.
    fn start(&self, prompt: &Prompt, sample_index: u32) -> Result<Box<dyn Episode>>;

    /// Strings that end a policy turn (as `</tool_call>` does), besides the engine's
    /// stop tokens and stop strings, which end a turn too. The engine calls
    /// [`Episode::step`] at every turn end.
    fn turn_stops(&self) -> Vec<String> {
        Vec::new()
    }

    /// The policy turns of a solution of `prompt` that uses this environment's tools
    /// (each turn as the policy would write it, turn-ending string included; the last
    /// one the final answer), for a supervised warm start; `None` when the
    /// environment cannot show one for this prompt. The warm start plays the turns
    /// through a real episode, so the observations between them are the
    /// environment's own.
    fn demonstration(&self, _prompt: &Prompt) -> Option<Vec<String>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
