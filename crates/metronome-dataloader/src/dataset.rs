//! What a prompt source is before tokenisation: an indexed collection of records.

use std::collections::BTreeMap;
use std::fmt;

use metronome_core::{ChatMessage, PromptId};

use crate::Result;

/// The prompt of a record before rendering: plain text, or a chat conversation that
/// the model's chat template turns into text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptContent {
    /// Plain text, used as is (or wrapped as one user message when the chat template
    /// is on).
    Text(String),
    /// Chat messages; rendered by the tokenizer's chat template, which must be on.
    Messages(Vec<ChatMessage>),
}

/// One dataset record: a prompt, its reference answer and task fields, before the
/// chat template and the tokenizer see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Stable identity: the record index in a file, the item index of a generator.
    pub id: PromptId,
    /// The prompt.
    pub content: PromptContent,
    /// The reference answer a verifier compares against.
    pub reference: Option<String>,
    /// Task fields as strings (e.g. `numbers` and `target` for countdown).
    pub metadata: BTreeMap<String, String>,
}

/// An indexed, immutable collection of records that the loader shuffles and releases.
///
/// Implementations must be deterministic: `record(i)` returns the same record every
/// time it is called, in every process, so that shuffles and cursors mean the same
/// thing after a restart. Files hold their records in memory; generators compute item
/// `i` from the run seed and `i`.
pub trait Dataset: Send + Sync + fmt::Debug {
    /// How many records one epoch holds.
    fn len(&self) -> usize;

    /// True when the dataset has no record.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record `index`, `0 <= index < len()`.
    fn record(&self, index: usize) -> Result<Record>;

    /// A human description of where record `index` comes from, for errors and logs
    /// (e.g. `train.jsonl line 12`, `countdown item 7`).
    fn place(&self, index: usize) -> String;
}
