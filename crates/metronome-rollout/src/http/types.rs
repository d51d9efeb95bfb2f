//! The JSON of the OpenAI completions API, with the vLLM and Metronome extensions the
//! module docs list.

use serde::{Deserialize, Serialize};

/// A `prompt`: text, several texts, token ids, or several token-id lists.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// A `stop`: one string or several.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopInput {
    /// The strings.
    #[must_use]
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// `POST /v1/completions` body. Unknown fields are ignored. Serialized, an unset field
/// is `null`; [`CompletionRequest::to_json`] leaves it out, as a client sends it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// The model name; must be the one the server serves.
    pub model: String,
    /// The prompt(s).
    pub prompt: Option<PromptInput>,
    /// Choices per prompt (default 1).
    pub n: Option<u32>,
    /// Maximum tokens per choice (default 16, as OpenAI).
    pub max_tokens: Option<usize>,
    /// Temperature (default 1; 0 is greedy).
    pub temperature: Option<f32>,
    /// Nucleus sampling mass (default 1).
    pub top_p: Option<f32>,
    /// vLLM extension: top-k (`-1` or `0` disables).
    pub top_k: Option<i64>,
    /// vLLM extension: min-p.
    pub min_p: Option<f32>,
    /// vLLM extension: repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// The run seed of the seed mapping (module docs).
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<StopInput>,
    /// vLLM extension: stop token ids (added to the tokenizer's end-of-sequence tokens).
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM extension: ignore end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// vLLM extension: keep the stop string in the text.
    pub include_stop_str_in_output: Option<bool>,
    /// Return log-probs (any value returns the sampled tokens' log-probs).
    pub logprobs: Option<u32>,
    /// vLLM extension: write log-prob tokens as `token_id:<id>`.
    pub return_tokens_as_token_ids: Option<bool>,
    /// vLLM and SGLang extension: each choice carries its sampled ids in `token_ids`.
    pub return_token_ids: Option<bool>,
    /// Metronome extension: the prompt ids of the seed mapping, one per prompt.
    pub prompt_ids: Option<Vec<u64>>,
    /// Server-sent-event streaming; our server rejects `true`.
    pub stream: Option<bool>,
    /// Echo the prompt in the text; our server rejects `true`.
    pub echo: Option<bool>,
}

impl CompletionRequest {
    /// The request as a client sends it: the JSON object without its unset fields, which
    /// a server takes for its defaults (some refuse a `null`, as vLLM's integer `top_k`).
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        let mut json = serde_json::to_value(self).expect("a completion request is plain JSON");
        if let serde_json::Value::Object(fields) = &mut json {
            fields.retain(|_, value| !value.is_null());
        }
        json
    }
}

/// Per-token log-probs of a choice, in OpenAI's legacy completions layout.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogProbs {
    /// The tokens, as text pieces or `token_id:<id>`.
    pub tokens: Vec<String>,
    /// Each token's behaviour log-prob.
    pub token_logprobs: Vec<f32>,
    /// Alternatives per position; always `null` from our server.
    pub top_logprobs: Option<Vec<serde_json::Value>>,
    /// Byte offset of each token piece in the text.
    pub text_offset: Vec<usize>,
}

/// One generated choice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// `prompt_index * n + sample_index`.
    pub index: u32,
    /// The generated text (without the stop string unless asked).
    pub text: String,
    /// Log-probs when requested.
    pub logprobs: Option<LogProbs>,
    /// `stop` or `length`.
    pub finish_reason: Option<String>,
    /// vLLM extension: the stop token id or stop string that ended the choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<serde_json::Value>,
    /// vLLM and SGLang extension (`return_token_ids`): the sampled token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// SGLang's name for `stop_reason` (read, never written).
    #[serde(default, skip_serializing)]
    pub matched_stop: Option<serde_json::Value>,
}

/// Token counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens (each prompt counted once).
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

/// `POST /v1/completions` response.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// Response id.
    pub id: String,
    /// `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// `metronome-v<version>` from our server.
    #[serde(default)]
    pub system_fingerprint: Option<String>,
    /// The choices, ordered by index.
    pub choices: Vec<Choice>,
    /// Token counts.
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// One entry of `GET /v1/models`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// The model name.
    pub id: String,
    /// `model`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// `metronome`.
    pub owned_by: String,
    /// The context length (vLLM's field).
    #[serde(default)]
    pub max_model_len: Option<usize>,
}

/// `GET /v1/models` response.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    /// The models.
    pub data: Vec<ModelCard>,
}

/// An error response: `{"error": {...}}`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The error's fields.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// What went wrong, naming the field at fault.
    pub message: String,
    /// `invalid_request_error`, `not_found_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The field at fault, when one is.
    pub param: Option<String>,
    /// The HTTP status code.
    pub code: Option<u16>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_parse_in_every_openai_form() {
        let parse = |v: &str| serde_json::from_str::<PromptInput>(v).unwrap();
        assert_eq!(parse(r#""hi""#), PromptInput::Text("hi".into()));
        assert_eq!(parse(r#"["a", "b"]"#), PromptInput::Texts(vec!["a".into(), "b".into()]));
        assert_eq!(parse("[1, 2]"), PromptInput::Tokens(vec![1, 2]));
        assert_eq!(parse("[[1], [2, 3]]"), PromptInput::TokenLists(vec![vec![1], vec![2, 3]]));
        let r: CompletionRequest =
            serde_json::from_str(r#"{"model": "m", "prompt": "x", "stop": "\n", "unknown_field": 1}"#)
                .unwrap();
        assert_eq!(r.stop.map(StopInput::into_vec), Some(vec!["\n".to_owned()]));
    }

    #[test]
    fn a_request_is_sent_without_its_unset_fields() {
        let r =
            CompletionRequest { model: "m".into(), n: Some(2), top_k: None, ..CompletionRequest::default() };
        assert_eq!(r.to_json(), serde_json::json!({"model": "m", "n": 2}));
    }
}
