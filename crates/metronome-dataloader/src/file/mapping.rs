//! The field mapping: which field of a record is the prompt, the reference answer and
//! the task metadata. Both file formats go through it: a JSONL line is parsed to a JSON
//! value, a Parquet row is converted to one, so the rules (and the messages) are the
//! same for both.

use std::collections::BTreeMap;

use metronome_core::ChatMessage;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::dataset::PromptContent;

/// Which fields of a record feed the prompt. Field names may be dotted paths into
/// nested objects (`reward_model.ground_truth`); a name that exists literally, dots
/// included, wins over the path reading.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FieldMapping {
    /// The prompt: a string, or a list of `{role, content}` chat messages.
    pub prompt: String,
    /// The reference answer (a string, number or boolean), if the task has one.
    pub reference: Option<String>,
    /// Task fields copied into `Prompt::metadata`: metadata key → field. Strings are
    /// copied, numbers and booleans written in JSON form, lists and objects as compact
    /// JSON text.
    pub metadata: BTreeMap<String, String>,
}

impl Default for FieldMapping {
    fn default() -> Self {
        Self { prompt: "prompt".into(), reference: None, metadata: BTreeMap::new() }
    }
}

/// What is wrong with one record, before the caller adds the file and line.
#[derive(Debug)]
pub(crate) struct FieldError {
    pub(crate) field: Option<String>,
    pub(crate) reason: String,
}

impl FieldError {
    pub(crate) fn record(reason: impl Into<String>) -> Self {
        Self { field: None, reason: reason.into() }
    }

    pub(crate) fn field(field: &str, reason: impl Into<String>) -> Self {
        Self { field: Some(field.to_owned()), reason: reason.into() }
    }
}

/// A record's mapped parts.
pub(crate) struct Mapped {
    pub(crate) content: PromptContent,
    pub(crate) reference: Option<String>,
    pub(crate) metadata: BTreeMap<String, String>,
}

impl FieldMapping {
    /// Every field the mapping reads, for projecting columns.
    pub(crate) fn fields(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.prompt.as_str())
            .chain(self.reference.as_deref())
            .chain(self.metadata.values().map(String::as_str))
    }

    /// Applies the mapping to one record.
    pub(crate) fn apply(&self, record: &Value) -> Result<Mapped, FieldError> {
        let Value::Object(_) = record else {
            return Err(FieldError::record(format!("expected a JSON object, found {}", type_name(record))));
        };
        let content = prompt_content(&self.prompt, required(record, &self.prompt)?)?;
        let reference = match &self.reference {
            Some(field) => Some(match required(record, field)? {
                Value::String(s) => s.clone(),
                v @ (Value::Number(_) | Value::Bool(_)) => v.to_string(),
                other => {
                    return Err(FieldError::field(
                        field,
                        format!("expected a string or a number, found {}", type_name(other)),
                    ));
                }
            }),
            None => None,
        };
        let mut metadata = BTreeMap::new();
        for (key, field) in &self.metadata {
            let text = match required(record, field)? {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            metadata.insert(key.clone(), text);
        }
        Ok(Mapped { content, reference, metadata })
    }
}

/// The value of `field` (literal name first, then dotted path); missing and null are
/// both errors, since a mapped field is one the task needs.
fn required<'a>(record: &'a Value, field: &str) -> Result<&'a Value, FieldError> {
    let found =
        record.get(field).or_else(|| field.split('.').try_fold(record, |value, part| value.get(part)));
    match found {
        None => Err(FieldError::field(field, "missing")),
        Some(Value::Null) => Err(FieldError::field(field, "is null")),
        Some(value) => Ok(value),
    }
}

fn prompt_content(field: &str, value: &Value) -> Result<PromptContent, FieldError> {
    match value {
        Value::String(s) if s.trim().is_empty() => Err(FieldError::field(field, "is an empty string")),
        Value::String(s) => Ok(PromptContent::Text(s.clone())),
        Value::Array(items) if items.is_empty() => {
            Err(FieldError::field(field, "is an empty list of messages"))
        }
        Value::Array(items) => {
            let mut messages = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let role = item.get("role").and_then(Value::as_str);
                let content = item.get("content").and_then(Value::as_str);
                match (role, content) {
                    (Some(role), Some(content)) => messages.push(ChatMessage::new(role, content)),
                    _ => {
                        return Err(FieldError::field(
                            field,
                            format!(
                                "message {i} is not a chat message: expected an object with string `role` and `content`"
                            ),
                        ));
                    }
                }
            }
            Ok(PromptContent::Messages(messages))
        }
        other => Err(FieldError::field(
            field,
            format!("expected a string or a list of chat messages, found {}", type_name(other)),
        )),
    }
}

pub(crate) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn mapping() -> FieldMapping {
        FieldMapping {
            prompt: "q".into(),
            reference: Some("meta.answer".into()),
            metadata: BTreeMap::from([("level".into(), "level".into()), ("nums".into(), "nums".into())]),
        }
    }

    #[test]
    fn maps_strings_numbers_lists_and_paths() {
        let record = json!({"q": "2+2=", "meta": {"answer": 4}, "level": "easy", "nums": [1, 2]});
        let mapped = mapping().apply(&record).unwrap();
        assert_eq!(mapped.content, PromptContent::Text("2+2=".into()));
        assert_eq!(mapped.reference.as_deref(), Some("4"));
        assert_eq!(mapped.metadata["level"], "easy");
        assert_eq!(mapped.metadata["nums"], "[1,2]");
    }

    #[test]
    fn literal_dotted_names_win() {
        let record =
            json!({"q": "x", "meta.answer": "lit", "meta": {"answer": "path"}, "level": 1, "nums": 2});
        assert_eq!(mapping().apply(&record).unwrap().reference.as_deref(), Some("lit"));
    }

    #[test]
    fn chat_messages_are_parsed() {
        let record =
            json!({"q": [{"role": "user", "content": "hi"}], "meta": {"answer": "a"}, "level": 1, "nums": 2});
        let mapped = mapping().apply(&record).unwrap();
        assert_eq!(mapped.content, PromptContent::Messages(vec![ChatMessage::new("user", "hi")]));
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (json!({"meta": {"answer": 1}, "level": 1, "nums": 1}), Some("q"), "missing"),
            (json!({"q": 5, "meta": {"answer": 1}, "level": 1, "nums": 1}), Some("q"), "found a number"),
            (json!({"q": " ", "meta": {"answer": 1}, "level": 1, "nums": 1}), Some("q"), "empty string"),
            (
                json!({"q": [{"role": 1}], "meta": {"answer": 1}, "level": 1, "nums": 1}),
                Some("q"),
                "message 0",
            ),
            (
                json!({"q": "x", "meta": {"answer": [1]}, "level": 1, "nums": 1}),
                Some("meta.answer"),
                "found a list",
            ),
            (json!({"q": "x", "meta": {}, "level": 1, "nums": 1}), Some("meta.answer"), "missing"),
            (json!({"q": "x", "meta": {"answer": 1}, "level": null, "nums": 1}), Some("level"), "is null"),
            (json!([1, 2]), None, "expected a JSON object, found a list"),
        ];
        for (record, field, reason) in cases {
            let err = mapping().apply(&record).err().unwrap();
            assert_eq!(err.field.as_deref(), field, "{record}");
            assert!(err.reason.contains(reason), "{record}: {}", err.reason);
        }
    }
}
