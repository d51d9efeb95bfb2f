//! From a record to a [`Prompt`]: chat template, tokenisation and the length limit.

use std::fmt;
use std::sync::Arc;

use metronome_core::{ChatMessage, ErrorChain, Prompt, PromptId, Tokenizer};
use serde::{Deserialize, Serialize};

use crate::dataset::{PromptContent, Record};
use crate::error::{Error, Result};

/// What happens to a prompt with more tokens than [`PromptConfig::max_tokens`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlongPolicy {
    /// Leave it out of every batch, count it (`metronome_dataloader_prompts_skipped_total`
    /// and [`LoaderStats::skipped_too_long`](crate::LoaderStats)) and log its id.
    #[default]
    Skip,
    /// Fail the batch with an error naming the prompt.
    Reject,
}

/// How a record's content becomes the prompt text and tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PromptConfig {
    /// Render through the tokenizer's chat template: plain text becomes one user
    /// message, conversations are rendered as they are, and the text ends where the
    /// assistant's answer begins. Off, plain text is used verbatim.
    pub chat_template: bool,
    /// A system message put before the conversation (chat template only; a
    /// conversation that starts with its own system message keeps it).
    pub system: Option<String>,
    /// The most tokens a prompt may have; `None` for no limit.
    pub max_tokens: Option<usize>,
    /// What to do with longer prompts.
    pub on_overlong: OverlongPolicy,
}

impl PromptConfig {
    /// Checks the values; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if self.max_tokens == Some(0) {
            return Err(Error::config("prompt.max_tokens", "must be at least 1"));
        }
        if self.system.is_some() && !self.chat_template {
            return Err(Error::config("prompt.system", "needs `prompt.chat_template = true`"));
        }
        Ok(())
    }
}

/// The outcome of rendering one record.
#[derive(Debug)]
pub(crate) enum Rendered {
    /// A prompt within the limit.
    Fits(Prompt),
    /// A prompt over the limit, skipped by policy.
    TooLong { id: PromptId, tokens: usize },
}

/// Renders and tokenises records.
pub(crate) struct Renderer {
    tokenizer: Arc<dyn Tokenizer>,
    config: PromptConfig,
}

impl fmt::Debug for Renderer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Renderer")
            .field("vocab_size", &self.tokenizer.vocab_size())
            .field("config", &self.config)
            .finish()
    }
}

impl Renderer {
    pub(crate) fn new(tokenizer: Arc<dyn Tokenizer>, config: PromptConfig) -> Self {
        Self { tokenizer, config }
    }

    pub(crate) fn max_tokens(&self) -> Option<usize> {
        self.config.max_tokens
    }

    pub(crate) fn render(&self, record: Record, place: impl Fn() -> String) -> Result<Rendered> {
        let id = record.id;
        let failed = |reason: String| Error::Prompt { prompt: id, place: place(), reason };
        let text = match (record.content, self.config.chat_template) {
            (PromptContent::Text(text), false) => text,
            (PromptContent::Messages(_), false) => {
                return Err(failed(
                    "is a chat conversation, which needs `prompt.chat_template = true`".to_owned(),
                ));
            }
            (content, true) => {
                let mut messages = Vec::new();
                let conversation = match content {
                    PromptContent::Text(text) => vec![ChatMessage::new("user", text)],
                    PromptContent::Messages(messages) => messages,
                };
                let has_system = conversation.first().is_some_and(|m| m.role == "system");
                if let (Some(system), false) = (&self.config.system, has_system) {
                    messages.push(ChatMessage::new("system", system.clone()));
                }
                messages.extend(conversation);
                self.tokenizer
                    .apply_chat_template(&messages, true)
                    .map_err(|e| failed(format!("chat template failed: {}", ErrorChain(&e))))?
            }
        };
        let tokens = self
            .tokenizer
            .encode(&text)
            .map_err(|e| failed(format!("tokenizer failed: {}", ErrorChain(&e))))?;
        if let Some(max) = self.config.max_tokens
            && tokens.len() > max
        {
            return match self.config.on_overlong {
                OverlongPolicy::Skip => Ok(Rendered::TooLong { id, tokens: tokens.len() }),
                OverlongPolicy::Reject => {
                    Err(Error::PromptTooLong { prompt: id, place: place(), tokens: tokens.len(), max })
                }
            };
        }
        Ok(Rendered::Fits(Prompt {
            id,
            text,
            tokens,
            reference: record.reference,
            metadata: record.metadata,
        }))
    }
}
