//! `/v1/chat/completions` over loopback: the rendering is the chat template's, the
//! generation is the completions route's for the rendered ids, tool calls go out and
//! come back, bad requests are refused naming the field, and the official `openai`
//! Python client is served (chat, tools, `n` > 1, log-probs).

use std::sync::Arc;

use metronome_core::{ChatMessage, Tokenizer, ToolCallSyntax};
use metronome_model::{CharTokenizer, ChatTemplate};
use metronome_rollout::http::{
    Chat, ChatCompletionResponse, CompletionResponse, ErrorBody, ServerConfig, router_with_chat, serve,
};
use serde_json::json;

use crate::common::{EverythingCalls, engine, sampling};

/// A template for the character tokenizer: each message on a line after its role.
const TEMPLATE: &str = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
                        {% if add_generation_prompt %}assistant: {% endif %}";

fn chat(tools: bool) -> Chat {
    Chat {
        template: Some(ChatTemplate::new(TEMPLATE, "", "")),
        tools: tools.then(|| Arc::new(EverythingCalls) as Arc<dyn ToolCallSyntax>),
    }
}

async fn start(config: ServerConfig, chat: Chat) -> String {
    let engine = Arc::new(engine(1, 8, sampling(16)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    config.validate(addr).unwrap();
    tokio::spawn(serve(listener, router_with_chat(engine, config.clone(), chat), &config));
    format!("http://{addr}")
}

async fn post(url: &str, body: serde_json::Value) -> reqwest::Response {
    reqwest::Client::new().post(url).json(&body).send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_renders_with_the_template_and_samples_as_completions_do() {
    let base = start(ServerConfig::named("tiny"), chat(false)).await;
    let messages = [ChatMessage::new("system", "Add."), ChatMessage::new("user", "1 + 2 = ")];
    let body = json!({
        "model": "tiny", "seed": 9, "n": 3, "max_completion_tokens": 12, "logprobs": true,
        "return_token_ids": true, "temperature": 0.9, "top_p": 0.95,
        "messages": [{"role": "developer", "content": "Add."},
                     {"role": "user", "content": [{"type": "text", "text": "1 + "}, {"type": "text", "text": "2 = "}]}],
    });
    let r = post(&format!("{base}/v1/chat/completions"), body).await;
    assert_eq!(r.status(), 200);
    let chat: ChatCompletionResponse = r.json().await.unwrap();
    let rendered = ChatTemplate::new(TEMPLATE, "", "").render(&messages, true).unwrap();
    let ids = CharTokenizer.encode(&rendered).unwrap();
    let usage = chat.usage.unwrap();
    assert_eq!(usage.prompt_tokens, ids.len(), "the prompt is the template's rendering");
    assert_eq!(chat.object, "chat.completion");
    assert_eq!(chat.choices.len(), 3);

    // The same ids through /v1/completions sample the same tokens and log-probs.
    let body = json!({
        "model": "tiny", "seed": 9, "n": 3, "max_tokens": 12, "logprobs": 0, "prompt": ids,
        "return_token_ids": true, "temperature": 0.9, "top_p": 0.95,
    });
    let plain: CompletionResponse = post(&format!("{base}/v1/completions"), body).await.json().await.unwrap();
    let mut completion_tokens = 0;
    for (c, p) in chat.choices.iter().zip(&plain.choices) {
        assert_eq!(c.token_ids, p.token_ids);
        let logprobs: Vec<f32> = c.logprobs.as_ref().unwrap().content.iter().map(|t| t.logprob).collect();
        assert_eq!(logprobs, p.logprobs.as_ref().unwrap().token_logprobs);
        assert_eq!(c.message.role, "assistant");
        assert_eq!(c.message.content.as_deref(), Some(p.text.as_str()));
        assert!(c.message.tool_calls.is_none());
        completion_tokens += c.token_ids.as_ref().unwrap().len();
    }
    assert_eq!(usage.completion_tokens, completion_tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_are_read_from_the_text_and_written_back_as_sampled() {
    let base = start(ServerConfig::named("tiny"), chat(true)).await;
    let tools =
        json!([{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]);
    let first = json!([{"role": "user", "content": "2 * 3 = "}]);
    let body = json!({"model": "tiny", "seed": 1, "max_tokens": 10, "tools": tools, "messages": first,
                      "return_token_ids": true});
    let r: ChatCompletionResponse =
        post(&format!("{base}/v1/chat/completions"), body).await.json().await.unwrap();
    let choice = &r.choices[0];
    assert_eq!(choice.finish_reason, "tool_calls");
    let calls = choice.message.tool_calls.as_ref().unwrap();
    assert_eq!(calls[0].function.name, "calculator");
    let sampled = CharTokenizer.decode(choice.token_ids.as_ref().unwrap()).unwrap();
    let args: serde_json::Value = serde_json::from_str(&calls[0].function.arguments).unwrap();
    assert_eq!(args["input"], sampled);

    // The assistant message sent back with its call, and the tool's answer: the
    // rendering holds the sampled text where the assistant's content goes.
    let history = json!([
        {"role": "user", "content": "2 * 3 = "},
        {"role": "assistant", "content": null, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "6"},
    ]);
    let body = json!({"model": "tiny", "seed": 1, "max_tokens": 4, "tools": tools, "messages": history});
    let r: ChatCompletionResponse =
        post(&format!("{base}/v1/chat/completions"), body).await.json().await.unwrap();
    let expected = format!("user: 2 * 3 = \nassistant: {sampled}\ntool: 6\nassistant: ");
    assert_eq!(r.usage.unwrap().prompt_tokens, expected.len());

    // `tool_choice: none` reads no calls.
    let body = json!({"model": "tiny", "seed": 1, "max_tokens": 10, "tools": tools, "messages": first,
                      "tool_choice": "none"});
    let r: ChatCompletionResponse =
        post(&format!("{base}/v1/chat/completions"), body).await.json().await.unwrap();
    assert!(r.choices[0].message.tool_calls.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chat_requests_are_refused_naming_the_field() {
    let keyed = ServerConfig {
        api_key: Some(metronome_core::Secret::new("k".to_owned())),
        max_tokens: 32,
        ..ServerConfig::named("tiny")
    };
    let base = start(keyed, chat(false)).await;
    let url = format!("{base}/v1/chat/completions");
    let user = json!([{"role": "user", "content": "hi"}]);
    let unauthorized = post(&url, json!({"model": "tiny", "messages": user})).await;
    assert_eq!(unauthorized.status(), 401);
    let cases = [
        (json!({"model": "tiny", "messages": []}), 400, "messages"),
        (json!({"model": "tiny", "messages": user, "stream": true}), 400, "stream"),
        (json!({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}), 400, "messages[0]"),
        (
            json!({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            400,
            "messages[0]",
        ),
        (json!({"model": "tiny", "messages": [{"role": "user", "content": "é"}]}), 400, "messages"),
        (
            json!({"model": "tiny", "messages": user, "max_completion_tokens": 99}),
            400,
            "max_completion_tokens",
        ),
        (json!({"model": "tiny", "messages": user, "max_tokens": 0}), 400, "max_tokens"),
        (json!({"model": "tiny", "messages": user, "n": 0}), 400, "n"),
        (json!({"model": "tiny", "messages": user, "top_p": 2.0}), 400, "top_p"),
        (json!({"model": "tiny", "messages": user, "top_logprobs": 3}), 400, "top_logprobs"),
        (json!({"model": "other", "messages": user}), 404, "model"),
        (
            json!({"model": "tiny", "messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            400,
            "tools",
        ),
        (
            json!({"model": "tiny", "messages": user, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            400,
            "tools[0].type",
        ),
        (
            json!({"model": "tiny", "messages": [{"role": "assistant", "content": null, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
            400,
            "messages[0]",
        ),
        (json!({"model": "tiny", "messages": "hi"}), 400, "messages"),
    ];
    let client = reqwest::Client::new();
    for (body, status, param) in cases {
        let r = client.post(&url).bearer_auth("k").json(&body).send().await.unwrap();
        assert_eq!(r.status(), status, "{body}");
        let e: ErrorBody = r.json().await.unwrap();
        assert_eq!(e.error.param.as_deref(), Some(param), "{body}: {}", e.error.message);
    }
}

/// The official `openai` Python client against the server: chat, `n` > 1,
/// log-probs, and a tool loop whose call goes back as the client sends it. Skipped
/// without python3 and `openai`, except under CI (`.ci/run` installs it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_python_client_is_served() {
    let base = start(ServerConfig::named("tiny"), chat(true)).await;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/chat_client.py");
    let out = tokio::process::Command::new("python3").arg(&script).arg(format!("{base}/v1")).output().await;
    match out {
        Ok(out) if out.status.code() == Some(3) && std::env::var_os("CI").is_none() => {
            eprintln!("skipped the openai client: {}", String::from_utf8_lossy(&out.stderr));
        }
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped the openai client: no python3 ({e})")
        }
        Ok(out) if out.status.success() => {
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(stdout.contains("ok"), "{stdout}");
        }
        other => panic!("the openai client failed: {other:?}"),
    }
}
