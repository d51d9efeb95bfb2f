//! The OpenAI-compatible server: request bodies of every endpoint
//! (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//! `/metronome/v1/load_weights`), with methods,
//! routes, content types and keys around them, through its `Router` in process.
//!
//! Asserts: no panic and never a 5xx; every error is OpenAI's JSON shape with a
//! message and the status as `code`, and an error about the body (400, 403, 409,
//! 422) names its place: `param` (the field), or the line and column of a JSON
//! syntax error; a 200 completion has a choice per prompt and `n` (a chat
//! completion one per `n`), a 200
//! `load_weights` installed the version it names; and the server still answers a
//! valid request after all of it.

use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use metronome_core::PolicyVersion;
use metronome_rollout::ModelEngine;
use metronome_rollout::http::{
    Chat, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ErrorBody,
    PromptInput, ServerConfig, router_with_chat, snapshot_to_safetensors,
};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::mutate::{Mutations, mutate_json, mutations};

const KEY: &str = "fuzz-key";

/// The server under test, its engine and the runtime that drives it.
pub(crate) struct Server {
    router: Router,
    engine: Arc<ModelEngine>,
    runtime: tokio::runtime::Runtime,
}

pub(crate) fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let root = crate::scratch("http");
        let weights = root.join("weights");
        std::fs::create_dir(&weights).unwrap();
        let good = snapshot_to_safetensors(&crate::model(2).snapshot(PolicyVersion(0)).unwrap()).unwrap();
        std::fs::write(weights.join("good.safetensors"), &good).unwrap();
        std::fs::write(weights.join("cut.safetensors"), &good[..good.len() / 2]).unwrap();
        std::fs::write(weights.join("empty"), b"").unwrap();
        std::fs::create_dir(weights.join("sub")).unwrap();
        std::fs::write(root.join("outside.safetensors"), &good).unwrap();
        let engine = Arc::new(crate::engine());
        let config = ServerConfig {
            api_key: Some(metronome_core::Secret::new(KEY.to_owned())),
            max_body_bytes: 256 << 10,
            max_prompts: 3,
            max_n: 2,
            max_tokens: 4,
            max_stop: 4,
            max_concurrent_requests: 64,
            weights_dir: Some(weights),
            max_weights_bytes: 1 << 20,
            ..ServerConfig::named("tiny")
        };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        // The character tokenizer has no template: a plain one, and the tag format's calls.
        let chat = Chat {
            template: Some(metronome_model::ChatTemplate::new(
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ",
                "",
                "",
            )),
            tools: Some(Arc::new(metronome_reward::ToolCallFormat::Tag)),
        };
        Server { router: router_with_chat(Arc::clone(&engine), config, chat), engine, runtime }
    })
}

/// Valid bodies of each endpoint, the seeds of the mutations.
fn seeds() -> Vec<(&'static str, Value)> {
    vec![
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "1 + 1 = ", "max_tokens": 3, "temperature": 0.0}),
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": ["1+1=", "2+2="], "n": 2, "max_tokens": 2, "logprobs": 1,
                   "seed": 3, "stop": "\n", "top_p": 0.9, "top_k": 5}),
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": [5, 9, 12], "max_tokens": 4, "stop_token_ids": [2],
                   "return_token_ids": true, "prompt_ids": [7], "temperature": 0.7}),
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": [[5, 9], [12, 13]], "min_p": 0.1, "repetition_penalty": 1.2,
                   "ignore_eos": true, "include_stop_str_in_output": true, "return_tokens_as_token_ids": true,
                   "logprobs": 0, "stop": ["a", "b"], "stream": false, "echo": false, "max_tokens": 1}),
        ),
        (
            "/metronome/v1/load_weights",
            json!({"path": "good.safetensors", "version": 1, "allow_older": true}),
        ),
        ("/metronome/v1/load_weights", json!({"path": "good.safetensors", "version": 5})),
        ("/metronome/v1/load_weights", json!({"path": "cut.safetensors", "version": 9})),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "system", "content": "Add."},
                   {"role": "user", "content": [{"type": "text", "text": "1 + 1 = "}]}],
                   "max_completion_tokens": 3, "n": 2, "logprobs": true, "seed": 1, "stop": ["\n"]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "max_tokens": 4, "tool_choice": "auto", "return_token_ids": true,
                   "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {}}}],
                   "messages": [{"role": "user", "content": "2*3"},
                   {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "calculator", "arguments": "{\"input\": \"2*3\"}"}}]},
                   {"role": "tool", "tool_call_id": "c", "content": "6"}]}),
        ),
        ("/v1/models", json!({})),
    ]
}

#[derive(Clone, Debug)]
pub(crate) struct Input {
    seed: usize,
    m: Mutations,
    method: Method,
    /// The seed's route, or another.
    path: Option<&'static str>,
    content_type: Option<&'static str>,
    key: Option<&'static str>,
}

fn input() -> impl Strategy<Value = Input> {
    let method = prop_oneof![
        12 => Just(None),
        1 => select(&[Method::GET, Method::POST, Method::PUT, Method::DELETE, Method::HEAD, Method::OPTIONS][..])
            .prop_map(Some),
    ];
    let path = prop_oneof![
        12 => Just(None),
        1 => select(&[
            "/", "/v1", "/v1/completions/", "/V1/COMPLETIONS", "/v1/completions?n=9", "//v1/models",
            "/metronome/v1/load_weights/../../v1/models", "/%2e%2e/v1/models", "/v1/chat/completions",
        ][..]).prop_map(Some),
    ];
    let content_type = prop_oneof![
        12 => Just(Some("application/json")),
        1 => select(&[
            None, Some("application/json; charset=utf-8"), Some("APPLICATION/JSON"), Some("text/plain"),
            Some("application/jsonx"), Some("application/x-www-form-urlencoded"), Some(""), Some(";"),
        ][..]),
    ];
    let key = prop_oneof![
        12 => Just(Some(KEY)),
        1 => select(&[None, Some(""), Some("fuzz-ke"), Some("fuzz-key "), Some("FUZZ-KEY")][..]),
    ];
    (0..seeds().len(), mutations(), method, path, content_type, key).prop_map(
        |(seed, m, method, path, content_type, key)| Input {
            seed,
            m,
            method: method.unwrap_or(if seed == 7 { Method::GET } else { Method::POST }),
            path,
            content_type,
            key,
        },
    )
}

/// The request `input` stands for: its route, and the body bytes.
fn request(input: &Input) -> (String, Vec<u8>) {
    let (route, body) = &seeds()[input.seed];
    let body = if *route == "/v1/models" && input.m.bytes.is_empty() && input.m.tree.is_empty() {
        Vec::new()
    } else {
        mutate_json(body, &input.m, false)
    };
    (input.path.unwrap_or(route).to_owned(), body)
}

/// Sends one request; the status and the body.
pub(crate) fn send(
    method: Method,
    path: &str,
    content_type: Option<&str>,
    key: Option<&str>,
    body: Vec<u8>,
) -> (StatusCode, Vec<u8>) {
    let s = server();
    let mut builder = Request::builder().method(method).uri(path);
    if let Some(t) = content_type {
        builder = builder.header(header::CONTENT_TYPE, t);
    }
    if let Some(k) = key {
        builder = builder.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let request = builder.body(Body::from(body)).expect("a request of a valid URI and headers");
    s.runtime.block_on(async {
        let response = s.router.clone().oneshot(request).await.expect("the router is infallible");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("a whole body");
        (status, body.to_vec())
    })
}

pub(crate) fn check(input: &Input) -> Result<(), TestCaseError> {
    let (path, body) = request(input);
    let (status, answer) = send(input.method.clone(), &path, input.content_type, input.key, body.clone());
    if input.method == Method::HEAD {
        // The answer to HEAD has no body, whatever its status.
        prop_assert!(!status.is_server_error() && answer.is_empty(), "{status} to HEAD {path}");
        return Ok(());
    }
    check_answer(&path, &body, status, &answer)
}

/// The checks of one answer to `body` at `path`.
pub(crate) fn check_answer(
    path: &str,
    body: &[u8],
    status: StatusCode,
    answer: &[u8],
) -> Result<(), TestCaseError> {
    let text = String::from_utf8_lossy(answer);
    prop_assert!(!status.is_server_error(), "{status} to {path}: {text}");
    if status.is_client_error() {
        let error: ErrorBody = serde_json::from_slice(answer)
            .map_err(|e| TestCaseError::fail(format!("{status}: not OpenAI's error shape ({e}): {text}")))?;
        let e = &error.error;
        prop_assert!(!e.message.trim().is_empty(), "{status} without a message");
        prop_assert_eq!(e.code, Some(status.as_u16()));
        let about_the_body = [
            StatusCode::BAD_REQUEST,
            StatusCode::FORBIDDEN,
            StatusCode::CONFLICT,
            StatusCode::UNPROCESSABLE_ENTITY,
        ];
        if about_the_body.contains(&status) {
            let param = e.param.as_deref().is_some_and(|p| !p.trim().is_empty());
            let position = e.message.contains("line ") && e.message.contains("column ");
            prop_assert!(param || position, "{status} naming no field: {text}");
        }
        return Ok(());
    }
    if status == StatusCode::OK && path == "/v1/completions" {
        let request: CompletionRequest = serde_json::from_slice(body)
            .map_err(|e| TestCaseError::fail(format!("200 to a body that is no request ({e})")))?;
        let response: CompletionResponse = serde_json::from_slice(answer)
            .map_err(|e| TestCaseError::fail(format!("200 that is no completion ({e}): {text}")))?;
        let prompts = match request.prompt {
            Some(PromptInput::Text(_) | PromptInput::Tokens(_)) => 1,
            Some(PromptInput::Texts(t)) => t.len(),
            Some(PromptInput::TokenLists(t)) => t.len(),
            None => 0,
        };
        prop_assert_eq!(response.choices.len(), prompts * request.n.unwrap_or(1) as usize);
    }
    if status == StatusCode::OK && path == "/v1/chat/completions" {
        let request: ChatCompletionRequest = serde_json::from_slice(body)
            .map_err(|e| TestCaseError::fail(format!("200 to a body that is no chat request ({e})")))?;
        let response: ChatCompletionResponse = serde_json::from_slice(answer)
            .map_err(|e| TestCaseError::fail(format!("200 that is no chat completion ({e}): {text}")))?;
        prop_assert_eq!(response.choices.len(), request.n.unwrap_or(1) as usize);
    }
    if status == StatusCode::OK && path == "/metronome/v1/load_weights" {
        let version = serde_json::from_slice::<Value>(answer).ok().and_then(|v| v["version"].as_u64());
        prop_assert_eq!(version.map(PolicyVersion), Some(server().engine.current_version()));
    }
    Ok(())
}

#[test]
fn http_requests_to_every_endpoint() {
    crate::fuzz("http", 40_000, file!(), input(), |input| check(&input));
    // The server still serves.
    let body = serde_json::to_vec(&seeds()[0].1).unwrap();
    let (status, answer) = send(Method::POST, "/v1/completions", Some("application/json"), Some(KEY), body);
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer));
}
