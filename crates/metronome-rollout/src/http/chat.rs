//! `POST /v1/chat/completions`: a conversation rendered with the model's chat
//! template, generated as a `/v1/completions` request of its token ids (the same
//! limits, checks, seeding and log-probs), and each choice read back into an
//! assistant message, with the tool calls of its text in OpenAI's `tool_calls`.
//!
//! Calls are read and written by a [`ToolCallSyntax`] (the environments' formats,
//! e.g. `<tool_call>{…}</tool_call>`): a response's last well-formed call becomes
//! `tool_calls` (`finish_reason: tool_calls`), the text before it `content`; an
//! assistant message's `tool_calls` in a request are written back after its content
//! as the model writes them, and `tool` messages are rendered by the template as
//! any other role. A request that offers tools stops generation at the syntax's
//! turn-ending strings, as the environments end a turn there. The tools' declarations
//! are not rendered: the templates served take messages only.

use std::sync::Arc;

use axum::http::StatusCode;
use metronome_core::{ChatMessage, Completion, ErrorChain, FinishReason, ToolCallSyntax, ToolCallText};
use metronome_model::ChatTemplate;

use super::api::{ApiError, unix_now};
use super::chat_types::{
    ChatChoice, ChatCompletionRequest, ChatFunctionCall, ChatLogprobs, ChatRequestMessage,
    ChatResponseMessage, ChatTokenLogprob, ChatToolCall, MessageContent,
};
use super::completions::complete;
use super::server_config::ServerConfig;
use super::types::{CompletionRequest, PromptInput, StopInput};
use crate::{Engine, InferenceModel};

/// How chat requests are rendered and read.
#[derive(Clone, Default)]
pub struct Chat {
    /// A template that replaces the tokenizer's (for a tokenizer without one, as the
    /// character tokenizer of the tiny tasks); `None` renders with the tokenizer's.
    pub template: Option<ChatTemplate>,
    /// How tool calls are written in the model's text; `None` refuses requests that
    /// offer tools or carry calls.
    pub tools: Option<Arc<dyn ToolCallSyntax>>,
}

impl std::fmt::Debug for Chat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chat")
            .field("template", &self.template.as_ref().map(ChatTemplate::source))
            .field("tools", &self.tools.is_some())
            .finish()
    }
}

impl Chat {
    /// `messages` as the template writes them, ending where the assistant's answer
    /// begins.
    pub fn render(
        &self,
        tokenizer: &dyn metronome_core::Tokenizer,
        messages: &[ChatMessage],
    ) -> metronome_core::Result<String> {
        match &self.template {
            Some(t) => t
                .render(messages, true)
                .map_err(|e| metronome_core::Error::invalid("chat template", e.to_string())),
            None => tokenizer.apply_chat_template(messages, true),
        }
    }

    /// A request's messages as the chat template takes them: text parts joined, an
    /// assistant message's calls written after its content.
    fn messages(&self, request: &[ChatRequestMessage]) -> Result<Vec<ChatMessage>, ApiError> {
        if request.is_empty() {
            return Err(ApiError::bad("`messages` is empty", Some("messages")));
        }
        request
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let bad = |what: String| ApiError {
                    status: StatusCode::BAD_REQUEST,
                    message: format!("messages[{i}]: {what}"),
                    param: Some(format!("messages[{i}]").into()),
                };
                let role = match m.role.as_str() {
                    "developer" => "system",
                    r @ ("system" | "user" | "assistant" | "tool") => r,
                    other => {
                        return Err(bad(format!(
                            "role `{other}` is not one of system, developer, user, assistant, tool"
                        )));
                    }
                };
                let mut content = match &m.content {
                    None => String::new(),
                    Some(MessageContent::Text(t)) => t.clone(),
                    Some(MessageContent::Parts(parts)) => {
                        let mut text = String::new();
                        for (j, p) in parts.iter().enumerate() {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => text.push_str(t),
                                (kind, _) => {
                                    return Err(bad(format!(
                                        "content part {j} is `{kind}`; only text parts are served"
                                    )));
                                }
                            }
                        }
                        text
                    }
                };
                for (j, call) in m.tool_calls.iter().flatten().enumerate() {
                    if role != "assistant" {
                        return Err(bad("only assistant messages carry `tool_calls`".into()));
                    }
                    let Some(syntax) = &self.tools else {
                        return Err(bad("carries `tool_calls`, but this server reads no tool calls".into()));
                    };
                    let text = ToolCallText {
                        name: call.function.name.clone(),
                        arguments: call.function.arguments.clone(),
                    };
                    let written = syntax.render(&text).map_err(|e| bad(format!("tool call {j}: {e}")))?;
                    content.push_str(&written);
                }
                Ok(ChatMessage::new(role, content))
            })
            .collect()
    }
}

/// How a chat request is seeded: by its own `seed` (the public route), or by the
/// caller (an agent's episode: the seed and prompt id of the seed mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seeding {
    /// The request's `seed`, or the clock.
    Request,
    /// This run seed and prompt id, whatever the request says.
    Fixed { seed: u64, prompt: u64 },
}

/// One chat request served: the answer, the rendered prompt's ids, and each
/// choice's completion in choice order.
pub(crate) struct ChatTurn {
    pub(crate) response: super::chat_types::ChatCompletionResponse,
    pub(crate) prompt: Vec<u32>,
    pub(crate) completions: Vec<Completion>,
}

/// Renders, generates and reads back one chat request.
pub(crate) async fn chat_turn<M: InferenceModel>(
    engine: &Engine<M>,
    config: &ServerConfig,
    chat: &Chat,
    req: &ChatCompletionRequest,
    seeding: Seeding,
) -> Result<ChatTurn, ApiError> {
    if req.stream == Some(true) {
        return Err(ApiError::bad(
            "`stream` is true, but this server only answers whole responses",
            Some("stream"),
        ));
    }
    if req.top_logprobs.is_some_and(|k| k > 0) {
        return Err(ApiError::bad(
            "`top_logprobs` above 0 is not served: answers carry the sampled tokens' log-probs",
            Some("top_logprobs"),
        ));
    }
    let tools = tool_names(req, chat)?;
    let tokenizer = Arc::clone(engine.tokenizer());
    let messages = chat.messages(&req.messages)?;
    let rendered = chat
        .render(tokenizer.as_ref(), &messages)
        .map_err(|e| ApiError::bad(format!("messages: {}", ErrorChain(&e)), Some("messages")))?;
    let prompt = tokenizer
        .encode(&rendered)
        .map_err(|e| ApiError::bad(format!("messages: {}", ErrorChain(&e)), Some("messages")))?;
    let user_stops = req.stop.clone().map(StopInput::into_vec).unwrap_or_default();
    let mut stops = user_stops.clone();
    if let (Some(syntax), false) = (&chat.tools, tools.is_empty()) {
        let names: Vec<&str> = tools.iter().map(String::as_str).collect();
        stops.extend(syntax.turn_stops(&names).into_iter().filter(|s| !user_stops.contains(s)));
    }
    let (seed, prompt_ids) = match seeding {
        Seeding::Request => (req.seed, None),
        Seeding::Fixed { seed, prompt } => (Some(seed), Some(vec![prompt])),
    };
    let completion = CompletionRequest {
        model: req.model.clone(),
        prompt: Some(PromptInput::Tokens(prompt.clone())),
        n: req.n,
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        temperature: req.temperature,
        top_p: req.top_p,
        seed,
        stop: (!stops.is_empty()).then_some(StopInput::Many(stops)),
        logprobs: Some(0),
        prompt_ids,
        ..CompletionRequest::default()
    };
    let generated = complete(engine, config, &completion).await.map_err(|e| renamed(e, req))?;
    let names: Vec<&str> = tools.iter().map(String::as_str).collect();
    let syntax = chat.tools.as_deref().filter(|_| !names.is_empty());
    let choices = generated
        .completions
        .iter()
        .enumerate()
        .map(|(i, c)| chat_choice(req, c, i as u32, tokenizer.as_ref(), &user_stops, syntax, &names))
        .collect();
    let response = generated.response;
    Ok(ChatTurn {
        response: super::chat_types::ChatCompletionResponse {
            id: format!("chatcmpl-{}", response.id.trim_start_matches("cmpl-")),
            object: "chat.completion".into(),
            created: unix_now(),
            model: response.model,
            system_fingerprint: response.system_fingerprint,
            choices,
            usage: response.usage,
        },
        prompt,
        completions: generated.completions,
    })
}

/// The names of the request's tools; none when `tool_choice` is `none`.
fn tool_names(req: &ChatCompletionRequest, chat: &Chat) -> Result<Vec<String>, ApiError> {
    let tools = req.tools.as_deref().unwrap_or_default();
    for (i, t) in tools.iter().enumerate() {
        if t.kind != "function" {
            return Err(ApiError {
                status: StatusCode::BAD_REQUEST,
                message: format!("tools[{i}] is of type `{}`; only `function` tools are served", t.kind),
                param: Some(format!("tools[{i}].type").into()),
            });
        }
    }
    if tools.is_empty() || req.tool_choice.as_ref().is_some_and(|c| c == "none") {
        return Ok(Vec::new());
    }
    if chat.tools.is_none() {
        return Err(ApiError::bad(
            "`tools` is given, but this server reads no tool calls (it was started without a tool-call format)",
            Some("tools"),
        ));
    }
    Ok(tools.iter().map(|t| t.function.name.clone()).collect())
}

/// An error of the completion the chat request became, naming the chat request's
/// field: its prompt is `messages`, its `max_tokens` the one the request set.
fn renamed(mut e: ApiError, req: &ChatCompletionRequest) -> ApiError {
    // The completion's one prompt is the rendered conversation.
    e.message = e.message.replace("prompt 0", "the rendered messages");
    match e.param.as_deref() {
        Some("prompt") => e.param = Some("messages".into()),
        Some("max_tokens") if req.max_completion_tokens.is_some() => {
            e.param = Some("max_completion_tokens".into());
            e.message = e.message.replace("`max_tokens`", "`max_completion_tokens`");
        }
        _ => {}
    }
    e
}

/// One completion as a chat choice: its text up to the first stop string the
/// request gave, its call read out when tools are offered.
fn chat_choice(
    req: &ChatCompletionRequest,
    c: &Completion,
    index: u32,
    tokenizer: &dyn metronome_core::Tokenizer,
    user_stops: &[String],
    syntax: Option<&dyn ToolCallSyntax>,
    tools: &[&str],
) -> ChatChoice {
    let mut text = tokenizer.decode(&c.tokens).unwrap_or_default();
    if let Some(cut) = user_stops.iter().filter_map(|s| text.find(s.as_str())).min() {
        text.truncate(cut);
    }
    let call = syntax.and_then(|s| s.parse(&text, tools));
    let (content, tool_calls, finish_reason) = match call {
        Some((at, call)) => {
            let call = ChatToolCall {
                id: format!("call_{index}_{}", c.tokens.len()),
                kind: "function".into(),
                function: ChatFunctionCall { name: call.name, arguments: call.arguments },
            };
            (text[..at].to_owned(), Some(vec![call]), "tool_calls")
        }
        None => {
            let finish = match c.finish_reason {
                FinishReason::Length | FinishReason::PromptRejected => "length",
                FinishReason::Aborted => "abort",
                FinishReason::Stop | FinishReason::StopString => "stop",
            };
            (text, None, finish)
        }
    };
    let logprobs = (req.logprobs == Some(true)).then(|| ChatLogprobs {
        content: c
            .tokens
            .iter()
            .zip(&c.logprobs)
            .map(|(&t, &logprob)| {
                let token = tokenizer.decode(&[t]).unwrap_or_default();
                ChatTokenLogprob {
                    bytes: Some(token.as_bytes().to_vec()),
                    token,
                    logprob,
                    top_logprobs: vec![],
                }
            })
            .collect(),
    });
    ChatChoice {
        index,
        message: ChatResponseMessage {
            role: "assistant".into(),
            content: (tool_calls.is_none() || !content.is_empty()).then_some(content),
            tool_calls,
        },
        logprobs,
        finish_reason: finish_reason.into(),
        token_ids: req.return_token_ids.unwrap_or(false).then(|| c.tokens.clone()),
    }
}
