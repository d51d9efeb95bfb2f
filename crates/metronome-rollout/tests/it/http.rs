//! The OpenAI-compatible server and the client backend, over loopback.

use std::sync::Arc;

use metronome_core::{PeriodId, PolicyVersion, RolloutEngine, RolloutRequest};
use metronome_rollout::http::{
    CompletionResponse, ErrorBody, ModelList, NoWeightUpdate, OpenAiClientConfig, OpenAiEngine,
    SafetensorsReload, router, serve,
};
use metronome_rollout::{CollectSink, ModelEngine, SamplingConfig};

use crate::common::{engine, prompts, sampling, signature, tiny_model};

/// Serves `engine` as `tiny` on a free loopback port; returns the base URL.
async fn start(engine: Arc<ModelEngine>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, router(engine, "tiny")));
    format!("http://{addr}")
}

fn sampling_under_test() -> SamplingConfig {
    SamplingConfig { stop_token_ids: Some(vec![2, 10, 20]), stop_strings: vec!["Z".into()], ..sampling(16) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_against_our_server_equals_the_engine() {
    let s = sampling_under_test();
    let engine = Arc::new(engine(1, 8, s.clone()));
    let base_url = start(Arc::clone(&engine)).await;
    let request = RolloutRequest { period: PeriodId(2), prompts: prompts(5), group_size: 3 };

    let local = CollectSink::default();
    engine.generate(request.clone(), &local).await.unwrap();

    let config = OpenAiClientConfig {
        base_url,
        model: "tiny".into(),
        seed: engine.config().seed,
        sampling: s,
        max_concurrency: 2,
        ..OpenAiClientConfig::default()
    };
    let client = OpenAiEngine::new(config, PolicyVersion(0), NoWeightUpdate).unwrap();
    let remote = CollectSink::default();
    client.generate(request, &remote).await.unwrap();
    let (local, remote) = (local.into_groups(), remote.into_groups());
    assert_eq!(remote.len(), 5);
    for g in &remote {
        g.validate().unwrap();
        assert_eq!(g.period, PeriodId(2));
    }
    // Tokens, log-probs (bitwise through JSON), finish reasons, versions and text agree.
    assert_eq!(signature(&local), signature(&remote));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_hook_reloads_our_server() {
    let engine = Arc::new(engine(1, 4, sampling(8)));
    let base_url = start(Arc::clone(&engine)).await;
    let dir = std::env::temp_dir().join(format!("metronome-rollout-hook-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = OpenAiClientConfig {
        base_url,
        model: "tiny".into(),
        sampling: sampling(8),
        ..OpenAiClientConfig::default()
    };
    let client = OpenAiEngine::new(config, PolicyVersion(0), SafetensorsReload::new(&dir)).unwrap();
    let snapshot = tiny_model(31).snapshot(PolicyVersion(4)).unwrap();
    client.install_weights(Arc::new(snapshot)).await.unwrap();
    assert_eq!(engine.current_version(), PolicyVersion(4));
    assert_eq!(client.version(), PolicyVersion(4));
    let sink = CollectSink::default();
    let request = RolloutRequest { period: PeriodId(0), prompts: prompts(1), group_size: 2 };
    client.generate(request, &sink).await.unwrap();
    // The server's fingerprint carries the version that sampled.
    assert!(sink.into_groups()[0].completions.iter().all(|c| c.version == PolicyVersion(4)));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_4xx_and_the_server_keeps_serving() {
    let engine = Arc::new(engine(1, 4, sampling(8)));
    let base = start(engine).await;
    let http = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let cases: [(&str, u16, &str); 8] = [
        (r#"{"model": "tiny", "prompt": "1 + 1 = ", "stream": true}"#, 400, "`stream` is true"),
        (r#"{"model": "gpt-9", "prompt": "1 + 1 = "}"#, 404, "model `gpt-9` does not exist"),
        (r#"{"model": "tiny", "prompt": "1 + 1 = ", "n": 0}"#, 400, "`n` is 0"),
        (
            r#"{"model": "tiny", "prompt": "1 + 1 = ", "max_tokens": 500}"#,
            400,
            "exceeds the context length 128",
        ),
        (r#"{"model": "tiny", "prompt": "1 + 1 = ", "#, 400, "not a valid completion request"),
        (r#"{"model": "tiny", "prompt": [], "max_tokens": 4}"#, 400, "`prompt` is an empty list"),
        (r#"{"model": "tiny", "prompt": [5, 9999]}"#, 400, "outside the vocabulary"),
        (r#"{"model": "tiny", "prompt": "x", "top_p": 1.5}"#, 400, "sampling.top_p"),
    ];
    for (body, status, message) in cases {
        let resp =
            http.post(&url).header("content-type", "application/json").body(body).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{body}");
        let err: ErrorBody = resp.json().await.unwrap();
        assert!(err.error.message.contains(message), "{body}: {}", err.error.message);
    }

    let ok: CompletionResponse = http
        .post(&url)
        .json(&serde_json::json!({
            "model": "tiny", "prompt": ["1 + 1 = ", "2 + 2 = "], "n": 2, "max_tokens": 5,
            "temperature": 0.0, "logprobs": 1, "seed": 3, "stop": "\n"
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ok.choices.len(), 4);
    assert_eq!(ok.choices.iter().map(|c| c.index).collect::<Vec<_>>(), [0, 1, 2, 3]);
    // Greedy: both choices of a prompt are the same.
    assert_eq!(ok.choices[0].text, ok.choices[1].text);
    assert_eq!(ok.system_fingerprint.as_deref(), Some("metronome-v0"));
    let usage = ok.usage.unwrap();
    assert_eq!(usage.prompt_tokens, 16);

    let models: ModelList = http.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(models.data[0].id, "tiny");
    assert_eq!(models.data[0].max_model_len, Some(128));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reports_server_errors_and_unreachable_servers() {
    let engine = Arc::new(engine(1, 4, sampling(8)));
    let base_url = start(engine).await;
    let config = OpenAiClientConfig {
        base_url,
        model: "nope".into(),
        sampling: sampling(4),
        ..OpenAiClientConfig::default()
    };
    let client = OpenAiEngine::new(config, PolicyVersion(0), NoWeightUpdate).unwrap();
    let request = RolloutRequest { period: PeriodId(0), prompts: prompts(1), group_size: 1 };
    let err = client.generate(request.clone(), &CollectSink::default()).await.unwrap_err().to_string();
    assert!(err.contains("404") && err.contains("does not exist"), "{err}");

    // Nothing listens on this port (bound, then dropped): retried, then reported.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = OpenAiClientConfig {
        base_url: format!("http://127.0.0.1:{port}"),
        max_retries: 2,
        retry_backoff_ms: 1,
        timeout_s: 5.0,
        sampling: sampling(4),
        ..OpenAiClientConfig::default()
    };
    let client = OpenAiEngine::new(config, PolicyVersion(0), NoWeightUpdate).unwrap();
    let err = client.generate(request, &CollectSink::default()).await.unwrap_err().to_string();
    assert!(err.contains("http"), "{err}");
}
