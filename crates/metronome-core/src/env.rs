//! Multi-turn episodes: environments the policy talks to between its turns.
//!
//! An episode starts from a prompt. The policy produces a *turn* (text ending at a
//! stop token or at one of the environment's turn-ending strings such as
//! `</tool_call>`); the environment answers with an [`Observation`]: text to append
//! (a tool result, feedback), or `done`, and at the end optionally a reward. The
//! rollout engine appends the observation's tokens to the same sequence and lets the
//! policy continue, so one [`crate::Completion`] holds the whole trajectory: the policy's
//! tokens and the observations' tokens interleaved. [`crate::EpisodeTrace::observations`]
//! says which tokens the environment wrote: they are context for later turns and
//! never loss targets.
//!
//! [`Environment`] is synchronous (starting an episode never waits); [`Episode::step`]
//! is async, because a tool may call out (a sandbox, a search service). The engine
//! bounds every step with a time limit and isolates panics: a hung or panicking tool
//! ends its episode with a failure reason, never the run.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::{ChatMessage, Prompt, Result, Tokenizer};

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

/// A tool call as the OpenAI chat API carries it: the function's name and its
/// arguments as the text of a JSON object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallText {
    /// The tool's name.
    pub name: String,
    /// The arguments, a JSON object's text.
    pub arguments: String,
}

/// How a model writes tool calls in its text (e.g. `<tool_call>{…}</tool_call>`),
/// both ways: an OpenAI-compatible chat server reads a response's calls with it
/// and writes an assistant message's calls back into the conversation it renders.
/// The environments' formats implement it (`metronome-reward`), so a server speaks
/// the calls a run's environments train.
pub trait ToolCallSyntax: Send + Sync {
    /// Strings that end a turn holding a call (as `</tool_call>` does), for a
    /// server to stop at when a request offers `tools` (their names).
    fn turn_stops(&self, tools: &[&str]) -> Vec<String>;

    /// The call in `text` among `tools`: the byte offset where it begins (the text
    /// before it is the message's content) and the call; `None` when `text` holds
    /// no well-formed call.
    fn parse(&self, text: &str, tools: &[&str]) -> Option<(usize, ToolCallText)>;

    /// `call` as the model writes it; an error names what cannot be written (e.g.
    /// arguments that are not a JSON object).
    fn render(&self, call: &ToolCallText) -> Result<String>;
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
}
