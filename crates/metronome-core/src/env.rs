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

use crate::{ChatMessage, Completion, Prompt, Result, Tokenizer};

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

/// What an environment answers to one policy turn.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Text appended to the trajectory after the turn (a tool result, feedback, in
    /// the environment's own words), tokenized by the engine. Ignored when `done`.
    pub text: String,
    /// The same answer as a chat message (a `tool` result, `user` feedback): in a run
    /// that renders its prompts through the model's chat template, the engine
    /// appends this message as the template writes it ([`render_reply`]) instead of
    /// `text`.
    #[serde(default)]
    pub message: Option<ChatMessage>,
    /// The episode is over: the turn just taken was the last.
    pub done: bool,
    /// The episode's reward, given with `done`; `None` defers to the reward stage.
    pub reward: Option<f32>,
}

impl Observation {
    /// Text for the policy to read before its next turn.
    pub fn reply(text: impl Into<String>) -> Self {
        Self { text: text.into(), message: None, done: false, reward: None }
    }

    /// The same reply as a chat `message` too, for runs with a chat template.
    #[must_use]
    pub fn with_message(self, message: ChatMessage) -> Self {
        Self { message: Some(message), ..self }
    }

    /// The end of the episode, with the environment's reward (or `None`, for the
    /// reward stage to score the trajectory).
    #[must_use]
    pub fn done(reward: Option<f32>) -> Self {
        Self { text: String::new(), message: None, done: true, reward }
    }

    /// The text to append after the policy's turn: the chat message as `tokenizer`'s
    /// template renders it when `chat_template` (the run renders its prompts so) and
    /// the observation has one, else `text`.
    pub fn render(&self, tokenizer: &dyn Tokenizer, chat_template: bool) -> Result<String> {
        match &self.message {
            Some(message) if chat_template => render_reply(tokenizer, message),
            _ => Ok(self.text.clone()),
        }
    }
}

/// What follows an assistant turn when `message` answers it, as `tokenizer`'s chat
/// template writes it: the end of the assistant message, `message`, and the start of
/// the next assistant message (e.g. ChatML's `<|im_end|>\n<|im_start|>tool\n…<|im_end|>\n<|im_start|>assistant\n`).
/// Read off a rendering of a conversation whose assistant turn is a marker, so that
/// it holds for any template that writes messages in order.
pub fn render_reply(tokenizer: &dyn Tokenizer, message: &ChatMessage) -> Result<String> {
    // A private-use character no template writes on its own.
    const TURN: &str = "\u{f8ff}";
    let conversation = [ChatMessage::new("user", "?"), ChatMessage::new("assistant", TURN), message.clone()];
    let rendered = tokenizer.apply_chat_template(&conversation, true)?;
    let Some(at) = rendered.find(TURN) else {
        return Err(crate::Error::invalid(
            "chat template",
            "does not write an assistant message's content, so a tool message cannot be placed after it",
        ));
    };
    Ok(rendered[at + TURN.len()..].to_owned())
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

    /// ChatML over bytes, as the Qwen and SmolLM2 templates write it.
    struct ChatMl;

    impl Tokenizer for ChatMl {
        fn encode(&self, text: &str) -> Result<Vec<crate::TokenId>> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn decode(&self, tokens: &[crate::TokenId]) -> Result<String> {
            Ok(tokens.iter().filter_map(|&t| char::from_u32(t)).collect())
        }
        fn vocab_size(&self) -> usize {
            256
        }
        fn stop_token_ids(&self) -> Vec<crate::TokenId> {
            Vec::new()
        }
        fn apply_chat_template(
            &self,
            messages: &[ChatMessage],
            add_generation_prompt: bool,
        ) -> Result<String> {
            let mut out: String = messages
                .iter()
                .map(|m| format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content))
                .collect();
            if add_generation_prompt {
                out.push_str("<|im_start|>assistant\n");
            }
            Ok(out)
        }
    }

    #[test]
    fn a_reply_message_is_rendered_between_assistant_turns_as_the_template_writes_it() {
        let obs = Observation::reply("<result>46</result>").with_message(ChatMessage::new("tool", "46"));
        assert_eq!(
            obs.render(&ChatMl, true).unwrap(),
            "<|im_end|>\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"
        );
        // Without a chat template in the run, or a message, the text as written.
        assert_eq!(obs.render(&ChatMl, false).unwrap(), "<result>46</result>");
        let plain = Observation::reply("feedback");
        assert_eq!(plain.render(&ChatMl, true).unwrap(), "feedback");
        // A tokenizer without a template says so.
        struct NoTemplate;
        impl Tokenizer for NoTemplate {
            fn encode(&self, _: &str) -> Result<Vec<crate::TokenId>> {
                Ok(Vec::new())
            }
            fn decode(&self, _: &[crate::TokenId]) -> Result<String> {
                Ok(String::new())
            }
            fn vocab_size(&self) -> usize {
                1
            }
            fn stop_token_ids(&self) -> Vec<crate::TokenId> {
                Vec::new()
            }
        }
        let err = obs.render(&NoTemplate, true).unwrap_err().to_string();
        assert!(err.contains("no chat template"), "{err}");
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
}
