//! Text in and out: the tokenizer contract shared by the data loader (which encodes
//! prompts) and the rollout engine (which decodes responses), implemented by
//! `metronome-model`'s tokenizers.

use serde::{Deserialize, Serialize};

use crate::{Error, Result, TokenId};

/// One message of a chat conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// Turns text into token ids and back, and renders chat conversations.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text`, without special tokens added.
    fn encode(&self, text: &str) -> Result<Vec<TokenId>>;

    /// The text of `tokens`; special tokens are skipped.
    fn decode(&self, tokens: &[TokenId]) -> Result<String>;

    /// Size of the vocabulary (an upper bound of every token id plus one).
    fn vocab_size(&self) -> usize;

    /// Tokens that end a response (end-of-sequence, end-of-turn).
    fn stop_token_ids(&self) -> Vec<TokenId>;

    /// Renders `messages` with the model's chat template; with `add_generation_prompt`
    /// the text ends where the assistant's answer begins. Tokenizers without a template
    /// return an error naming that.
    fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let _ = (messages, add_generation_prompt);
        Err(Error::invalid("tokenizer", "has no chat template"))
    }
}
