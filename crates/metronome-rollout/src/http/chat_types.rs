//! The JSON of the OpenAI chat completions API, as the official clients send and read
//! it.

use serde::{Deserialize, Serialize};

use super::types::{StopInput, Usage};

/// `POST /v1/chat/completions` body. Unknown fields are ignored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    /// The model name; must be the one the server serves.
    pub model: String,
    /// The conversation so far.
    pub messages: Vec<ChatRequestMessage>,
    /// Choices (default 1).
    pub n: Option<u32>,
    /// Maximum tokens per choice (the older name of `max_completion_tokens`).
    pub max_tokens: Option<usize>,
    /// Maximum tokens per choice; wins over `max_tokens` when both are given.
    pub max_completion_tokens: Option<usize>,
    /// Temperature (default 1; 0 is greedy).
    pub temperature: Option<f32>,
    /// Nucleus sampling mass (default 1).
    pub top_p: Option<f32>,
    /// The run seed of the seed mapping (module docs).
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<StopInput>,
    /// Return the sampled tokens' log-probs.
    pub logprobs: Option<bool>,
    /// Alternatives per token: only 0 is served.
    pub top_logprobs: Option<u32>,
    /// Functions the model may call.
    pub tools: Option<Vec<ChatTool>>,
    /// `none` turns calls off; `auto` and `required` (and a named function) parse
    /// calls as usual.
    pub tool_choice: Option<serde_json::Value>,
    /// Server-sent-event streaming; refused.
    pub stream: Option<bool>,
    /// vLLM and SGLang extension: each choice carries its sampled ids in `token_ids`.
    pub return_token_ids: Option<bool>,
}

/// One message of a request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequestMessage {
    /// `system`, `developer` (taken as `system`), `user`, `assistant` or `tool`.
    pub role: String,
    /// Text, text parts, or `null` (an assistant message that only calls tools).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// An assistant message's calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<ChatToolCall>>,
    /// A tool message's call id.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// The author's name (ignored).
    #[serde(default)]
    pub name: Option<String>,
}

/// A message's content: a string or a list of parts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Parts; only `text` parts are served.
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    /// `text` (images and audio are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// A function the model may call.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatTool {
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: ChatFunction,
}

/// A function's declaration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatFunction {
    /// Its name.
    pub name: String,
    /// What it does (not rendered: the chat templates this server renders take no tools).
    #[serde(default)]
    pub description: Option<String>,
    /// Its JSON schema (not checked).
    #[serde(default)]
    pub parameters: Option<serde_json::Value>,
}

/// A call in an assistant message, as requests send it and responses carry it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatToolCall {
    /// The call's id.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The called function.
    pub function: ChatFunctionCall,
}

/// The function a call names and its arguments.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatFunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments, a JSON object's text.
    pub arguments: String,
}

/// `POST /v1/chat/completions` response.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    /// Response id.
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// `metronome-v<version>`.
    pub system_fingerprint: Option<String>,
    /// The choices, ordered by index.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Option<Usage>,
}

/// One generated choice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// The choice's index.
    pub index: u32,
    /// The assistant's message.
    pub message: ChatResponseMessage,
    /// The sampled tokens' log-probs, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: String,
    /// The sampled token ids, when asked for (`return_token_ids`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The assistant's message of a choice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatResponseMessage {
    /// `assistant`.
    pub role: String,
    /// The text before any call; `null` when there is none.
    pub content: Option<String>,
    /// The calls read from the text, when the request offered tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ChatToolCall>>,
}

/// A choice's log-probs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    /// One entry per sampled token.
    pub content: Vec<ChatTokenLogprob>,
}

/// One sampled token's log-prob.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its behaviour log-prob.
    pub logprob: f32,
    /// The token text's UTF-8 bytes.
    pub bytes: Option<Vec<u8>>,
    /// Alternatives: always empty.
    pub top_logprobs: Vec<serde_json::Value>,
}
