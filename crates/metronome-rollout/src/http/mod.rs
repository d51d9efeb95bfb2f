//! The OpenAI-compatible completions API, both ways: a server in front of an
//! [`Engine`](crate::Engine) and a [`RolloutEngine`](metronome_core::RolloutEngine)
//! client for any compatible server (vLLM, SGLang, or ours). The server answers chat
//! completions too (`/v1/chat/completions`, [`Chat`]): a conversation rendered with
//! the chat template becomes a completions request of its token ids, under the same
//! limits, seed mapping (as prompt 0) and log-probs.
//!
//! # The seed mapping
//! A request with `seed: s` samples the `j`-th choice of its `i`-th prompt with
//! `sample_seed(RunSeed(s), v, PromptId(id_i), j)`, where `v` is the server's installed
//! policy version and `id_i` is `prompt_ids[i]` when the request carries Metronome's
//! extension field `prompt_ids`, else `i`. So a client that sends the run seed as
//! `seed` and the prompt's id in `prompt_ids` gets exactly the tokens the in-process
//! engine samples for that prompt (given equal weights, version and sampling). Without
//! `seed`, the server draws one from the clock.
//!
//! Servers without the extension (vLLM, SGLang: `send_prompt_ids = false`) get one
//! request per response instead (`n` = 1), seeded with that response's
//! `sample_seed(run, v, prompt, j)` cut to 62 bits: reproducible by their own sampler,
//! but not the native engine's tokens.
//!
//! # The client
//! [`OpenAiEngine`] sends one request per prompt (`n` = group size; per response for
//! servers without `prompt_ids`; `logprobs: 0`,
//! `return_tokens_as_token_ids` and `return_token_ids` so the sampled ids and their
//! log-probs come back) to the endpoint with the fewest requests in flight, retries a
//! failed attempt on another endpoint, and records on each completion the version the
//! server reports (ours) or the one it last brought the servers to. Weight updates go
//! to every endpoint through a [`WeightUpdateHook`]: ours, SGLang's and vLLM's, with
//! what each server offers, in [`weight_sync`].
//!
//! # Extensions beyond OpenAI's fields
//! Accepted, as vLLM does: `top_k` (`-1` or `0` disables), `min_p`,
//! `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
//! `include_stop_str_in_output`, `return_tokens_as_token_ids` (log-prob tokens are
//! then written `token_id:<id>`), `return_token_ids` (each choice's ids in
//! `token_ids`), token-id prompts (`[1, 2, 3]` or `[[1, 2], [3]]`).
//! Metronome's own: `prompt_ids`. Responses carry the policy version in
//! `system_fingerprint` as `metronome-v<version>`. `logprobs` returns the sampled
//! tokens' log-probs only (`top_logprobs` is `null`). Not supported, and answered with
//! 400: `stream: true` and `echo: true`; other unknown fields (`best_of`,
//! `logit_bias`, `suffix`, ...) are ignored.

pub(crate) mod api;
pub(crate) mod chat;
pub(crate) mod chat_types;
mod client;
pub(crate) mod completions;
pub(crate) mod server;
pub(crate) mod server_config;
mod snapshot;
mod types;
pub mod weight_sync;

pub use crate::config::{OpenAiClientConfig, WeightSync};
pub use chat::Chat;
pub use chat_types::{
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatFunction, ChatFunctionCall, ChatLogprobs,
    ChatRequestMessage, ChatResponseMessage, ChatTokenLogprob, ChatTool, ChatToolCall, ContentPart,
    MessageContent,
};
pub use client::OpenAiEngine;
pub use server::{LoadWeightsRequest, ServerConfig, router, router_with_chat, serve, serve_until};
pub use snapshot::{snapshot_from_safetensors, snapshot_to_safetensors};
pub use types::{
    Choice, CompletionRequest, CompletionResponse, ErrorBody, ErrorDetail, LogProbs, ModelCard, ModelList,
    PromptInput, StopInput, Usage,
};
pub use weight_sync::{
    HookContext, NoWeightUpdate, SafetensorsReload, SglangReload, VllmReload, WeightUpdateHook,
    weight_sync_hook, write_hf_folder,
};

/// Parses the policy version out of a `system_fingerprint` written by our server.
#[must_use]
pub fn version_from_fingerprint(fingerprint: &str) -> Option<metronome_core::PolicyVersion> {
    fingerprint.strip_prefix("metronome-v")?.parse().ok().map(metronome_core::PolicyVersion)
}
