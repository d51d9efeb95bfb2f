//! The OpenAI-compatible server and the client backend, over loopback.

use std::sync::Arc;

use metronome_core::ErrorChain;
use metronome_core::{PeriodId, PolicyVersion, RolloutEngine, RolloutRequest};
use metronome_rollout::http::{
    CompletionResponse, ErrorBody, ModelList, NoWeightUpdate, OpenAiClientConfig, OpenAiEngine,
    SafetensorsReload, ServerConfig, WeightSync, router, serve,
};
use metronome_rollout::{CollectSink, ModelEngine, SamplingConfig};

use crate::common::{engine, generate, prompts, sampling, signature, tiny_model};

/// Serves `engine` as `tiny` on a free loopback port; returns the base URL.
async fn start(engine: Arc<ModelEngine>) -> String {
    start_with(engine, ServerConfig::named("tiny")).await
}

async fn start_with(engine: Arc<ModelEngine>, config: ServerConfig) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    config.validate(addr).unwrap();
    tokio::spawn(serve(listener, router(engine, config.clone()), &config));
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

    let local = generate(engine.as_ref(), request.clone()).await;

    let config = OpenAiClientConfig {
        endpoints: vec![base_url],
        model: "tiny".into(),
        max_concurrency: 2,
        weight_sync: WeightSync::None,
        ..OpenAiClientConfig::default()
    };
    let client = OpenAiEngine::new(config, s, engine.seed(), PolicyVersion(0), NoWeightUpdate).unwrap();
    let remote = generate(&client, request).await;
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
    let dir = std::env::temp_dir().join(format!("metronome-rollout-hook-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let server = ServerConfig { weights_dir: Some(dir.clone()), ..ServerConfig::named("tiny") };
    let base_url = start_with(Arc::clone(&engine), server).await;
    let config = OpenAiClientConfig {
        endpoints: vec![base_url],
        model: "tiny".into(),
        export_dir: Some(dir.clone()),
        ..OpenAiClientConfig::default()
    };
    let client =
        OpenAiEngine::new(config, sampling(8), engine.seed(), PolicyVersion(0), SafetensorsReload::new(&dir))
            .unwrap();
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
        endpoints: vec![base_url],
        model: "nope".into(),
        weight_sync: WeightSync::None,
        ..OpenAiClientConfig::default()
    };
    let seed = metronome_core::RunSeed(0);
    let client = OpenAiEngine::new(config, sampling(4), seed, PolicyVersion(0), NoWeightUpdate).unwrap();
    let request = RolloutRequest { period: PeriodId(0), prompts: prompts(1), group_size: 1 };
    let err =
        ErrorChain(&client.generate(request.clone(), &CollectSink::default()).await.unwrap_err()).to_string();
    assert!(err.contains("404") && err.contains("does not exist"), "{err}");

    // Nothing listens on this port (bound, then dropped): retried, then reported.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = OpenAiClientConfig {
        endpoints: vec![format!("http://127.0.0.1:{port}")],
        max_retries: 2,
        retry_backoff_ms: 1,
        timeout_s: 5.0,
        weight_sync: WeightSync::None,
        ..OpenAiClientConfig::default()
    };
    let client = OpenAiEngine::new(config, sampling(4), seed, PolicyVersion(0), NoWeightUpdate).unwrap();
    let err = ErrorChain(&client.generate(request, &CollectSink::default()).await.unwrap_err()).to_string();
    assert!(err.contains("http"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_are_refused_by_name_and_the_server_keeps_serving() {
    let engine = Arc::new(engine(1, 4, sampling(8)));
    let weights = tempfile::tempdir().unwrap();
    let secret_dir = tempfile::tempdir().unwrap();
    std::fs::write(secret_dir.path().join("other.safetensors"), b"not yours").unwrap();
    let config = ServerConfig {
        api_key: Some(metronome_core::Secret::new("k3y")),
        max_body_bytes: 4096,
        max_prompts: 4,
        max_n: 8,
        max_tokens: 64,
        max_stop: 2,
        max_concurrent_requests: 1,
        weights_dir: Some(weights.path().to_owned()),
        ..ServerConfig::named("tiny")
    };
    // Reachable from other machines only with a key.
    let open = ServerConfig { api_key: None, ..config.clone() };
    let err = open.validate("0.0.0.0:8000".parse().unwrap()).unwrap_err().to_string();
    assert!(err.contains("api_key") && err.contains("0.0.0.0:8000"), "{err}");
    config.validate("0.0.0.0:8000".parse().unwrap()).unwrap();

    let base = start_with(Arc::clone(&engine), config).await;
    let http = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let post = |body: String, key: Option<&str>| {
        let mut r = http.post(&url).header("content-type", "application/json").body(body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let ok = r#"{"model": "tiny", "prompt": "1 + 1 = ", "max_tokens": 4}"#.to_owned();
    assert_eq!(post(ok.clone(), None).await.unwrap().status().as_u16(), 401);
    assert_eq!(post(ok.clone(), Some("wrong")).await.unwrap().status().as_u16(), 401);
    let models = http.get(format!("{base}/v1/models")).send().await.unwrap();
    assert_eq!(models.status().as_u16(), 401, "every route needs the key");
    assert_eq!(post(ok.clone(), Some("k3y")).await.unwrap().status().as_u16(), 200);

    let huge_prompt = format!(r#"{{"model": "tiny", "prompt": "{}"}}"#, "x".repeat(8000));
    let many = serde_json::json!({"model": "tiny", "prompt": ["a", "b", "c", "d", "e"]}).to_string();
    let stops = serde_json::json!({"model": "tiny", "prompt": "a", "stop": ["1", "2", "3"]}).to_string();
    let cases: [(String, u16, &str); 6] = [
        (huge_prompt, 413, ""),
        (r#"{"model": "tiny", "prompt": "a", "n": 1000000}"#.into(), 400, "`n` is 1000000"),
        (
            format!(r#"{{"model": "tiny", "prompt": "a", "max_tokens": {}}}"#, usize::MAX),
            400,
            "`max_tokens` is 18446744073709551615",
        ),
        (many, 400, "holds 5 prompts"),
        (stops, 400, "`stop` takes at most 2"),
        (r#"{"model": "tiny", "prompt": "a", "n": -1}"#.into(), 400, "not a valid completion request"),
    ];
    for (body, status, message) in cases {
        let resp = post(body.clone(), Some("k3y")).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{}", &body[..body.len().min(80)]);
        if !message.is_empty() {
            let err: ErrorBody = resp.json().await.unwrap();
            assert!(err.error.message.contains(message), "{}", err.error.message);
        }
    }

    // Weights only from the weights directory, and errors that reveal no other path.
    let load = |path: String| {
        http.post(format!("{base}/metronome/v1/load_weights"))
            .bearer_auth("k3y")
            .json(&serde_json::json!({"path": path, "version": 1}))
            .send()
    };
    let outside = secret_dir.path().join("other.safetensors").display().to_string();
    for path in [outside.clone(), "../etc/passwd".to_owned(), "missing.safetensors".to_owned()] {
        let resp = load(path.clone()).await.unwrap();
        assert_eq!(resp.status().as_u16(), 403, "{path}");
        let err: ErrorBody = resp.json().await.unwrap();
        assert!(!err.error.message.contains(&weights.path().display().to_string()), "{}", err.error.message);
        assert!(err.error.message.starts_with(&path), "{}", err.error.message);
    }

    // Beyond the requests it takes at once: 429 at once, not a queue.
    let slow =
        serde_json::json!({"model": "tiny", "prompt": ["1 + 1 = ", "2 + 2 = ", "3 + 3 = ", "4 + 4 = "],
        "n": 8, "max_tokens": 64, "ignore_eos": true})
        .to_string();
    let first = tokio::spawn(post(slow, Some("k3y")));
    while engine.queue_depth() == 0 && !first.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let second = post(ok.clone(), Some("k3y")).await.unwrap();
    assert_eq!(second.status().as_u16(), 429);
    assert_eq!(second.headers().get("retry-after").unwrap(), "1");
    assert_eq!(first.await.unwrap().unwrap().status().as_u16(), 200);
    assert_eq!(post(ok, Some("k3y")).await.unwrap().status().as_u16(), 200, "serving again");
}

/// `load_weights` installs only what the model can take, never rolls the policy back
/// unless the request says so, and a refused load leaves the served weights as they
/// were; each refusal names the field at fault (`param`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_weights_refuses_bad_tensors_and_older_versions_by_name() {
    use metronome_core::TensorData;
    use metronome_rollout::http::snapshot_to_safetensors;
    let engine = Arc::new(engine(1, 4, sampling(8)));
    let dir = tempfile::tempdir().unwrap();
    let server = ServerConfig { weights_dir: Some(dir.path().to_owned()), ..ServerConfig::named("tiny") };
    let base = start_with(Arc::clone(&engine), server).await;
    let http = reqwest::Client::new();
    let write = |name: &str, snapshot: &metronome_core::WeightSnapshot| {
        std::fs::write(dir.path().join(name), snapshot_to_safetensors(snapshot).unwrap()).unwrap();
    };
    let load =
        |body: serde_json::Value| http.post(format!("{base}/metronome/v1/load_weights")).json(&body).send();
    let snapshot = |seed| tiny_model(seed).snapshot(PolicyVersion(0)).unwrap();
    write("v5.safetensors", &snapshot(5));
    let resp = load(serde_json::json!({"path": "v5.safetensors", "version": 5})).await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(engine.current_version(), PolicyVersion(5));
    let served = signature(
        &generate(&*engine, RolloutRequest { period: PeriodId(0), prompts: prompts(3), group_size: 2 }).await,
    );

    let mut nan = snapshot(6);
    if let TensorData::F32(v) = &mut nan.tensors[2].data {
        v[3] = f32::INFINITY;
    }
    let nan_name = nan.tensors[2].name.clone();
    write("nan.safetensors", &nan);
    let mut foreign = snapshot(6);
    let mut extra = foreign.tensors[0].clone();
    extra.name = "transformer.wte.weight".into();
    foreign.tensors.push(extra);
    write("foreign.safetensors", &foreign);
    write("v6.safetensors", &snapshot(6));
    let cases = [
        (
            serde_json::json!({"path": "nan.safetensors", "version": 6}),
            422,
            "path",
            format!("`{nan_name}`: element 3 is not finite"),
        ),
        (
            serde_json::json!({"path": "foreign.safetensors", "version": 6}),
            422,
            "path",
            "`transformer.wte.weight`".to_owned(),
        ),
        (
            serde_json::json!({"path": "v6.safetensors", "version": 4}),
            409,
            "version",
            "version 4 are older than the installed version 5".to_owned(),
        ),
    ];
    for (body, status, param, message) in cases {
        let resp = load(body.clone()).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{body}");
        let err: ErrorBody = resp.json().await.unwrap();
        assert_eq!(err.error.param.as_deref(), Some(param), "{body}");
        assert!(err.error.message.contains(&message), "{body}: {}", err.error.message);
        assert_eq!(engine.current_version(), PolicyVersion(5), "{body}");
        let now =
            generate(&*engine, RolloutRequest { period: PeriodId(0), prompts: prompts(3), group_size: 2 })
                .await;
        assert_eq!(signature(&now), served, "{body}");
    }
    // Said explicitly, the policy goes back.
    let resp =
        load(serde_json::json!({"path": "v6.safetensors", "version": 4, "allow_older": true})).await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(engine.current_version(), PolicyVersion(4));
}

/// Slow and odd clients: headers that never finish and idle connections are closed
/// after `header_timeout_s`, a body that stalls gets 408, connections beyond
/// `max_connections` wait until one closes, a body that is not JSON gets 415,
/// unknown routes 404 and wrong methods 405 — every error in OpenAI's shape, `param`
/// naming the field where there is one — and the server keeps serving throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_odd_clients_are_bounded_and_answered_in_openais_shape() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = Arc::new(engine(1, 4, sampling(8)));
    let config = ServerConfig {
        header_timeout_s: 0.5,
        body_timeout_s: 0.5,
        max_connections: 2,
        ..ServerConfig::named("tiny")
    };
    let base = start_with(Arc::clone(&engine), config).await;
    let addr = base.trim_start_matches("http://").to_owned();
    let http = reqwest::Client::new();
    let ok = serde_json::json!({"model": "tiny", "prompt": "1 + 1 = ", "max_tokens": 4});
    let served = || async {
        let resp = http.post(format!("{base}/v1/completions")).json(&ok).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 200);
    };
    // Reads until the server closes the connection; what it sent.
    let until_closed = |mut s: tokio::net::TcpStream| async move {
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "the server kept a stalled connection open for 30 s");
        String::from_utf8_lossy(&out).into_owned()
    };

    // Headers that never finish, and a connection that sends nothing: closed.
    let mut partial = tokio::net::TcpStream::connect(&addr).await.unwrap();
    partial.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let idle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    until_closed(partial).await;
    until_closed(idle).await;
    served().await;

    // A body that stalls half-way: 408 in OpenAI's shape.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"",
    )
    .await
    .unwrap();
    let answer = until_closed(slow).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":408") && answer.contains("did not arrive within 0.5 s"), "{answer}");

    // Two connections held (their headers unfinished): a third waits for a free one.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /v1/models HTTP/1.1\r\n").await.unwrap();
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let third = tokio::spawn({
        let (http, url) = (http.clone(), format!("{base}/v1/models"));
        async move { http.get(url).send().await.unwrap().status().as_u16() }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!third.is_finished(), "a third connection was served while two were held");
    drop(held);
    assert_eq!(tokio::time::timeout(Duration::from_secs(30), third).await.unwrap().unwrap(), 200);

    // Odd requests: each answered in OpenAI's shape, naming the field where there is one.
    let completions = format!("{base}/v1/completions");
    let cases: Vec<(reqwest::RequestBuilder, u16, Option<&str>, &str)> = vec![
        (
            http.post(&completions).header("content-type", "text/plain").body(ok.to_string()),
            415,
            None,
            "`text/plain`",
        ),
        (http.post(&completions).body(ok.to_string()), 415, None, "no content type"),
        (http.get(&completions), 405, None, "method"),
        (http.post(format!("{base}/v1/chat/nothing")).json(&ok), 404, None, "no such route"),
        (
            http.post(&completions).json(&serde_json::json!({"model": "tiny", "prompt": "a", "n": "two"})),
            400,
            Some("n"),
            "invalid type",
        ),
        (
            http.post(&completions)
                .json(&serde_json::json!({"model": "tiny", "prompt": "a", "temperature": -1.0})),
            400,
            Some("temperature"),
            "sampling.temperature",
        ),
        (
            http.post(&completions)
                .json(&serde_json::json!({"model": "tiny", "prompt": "a", "temperature": 1e-30})),
            400,
            Some("temperature"),
            "expected 0 for greedy decoding, or 0.001 to 1000",
        ),
        (
            http.post(&completions)
                .json(&serde_json::json!({"model": "tiny", "prompt": "a", "repetition_penalty": 1e30})),
            400,
            Some("repetition_penalty"),
            "expected 0.001 to 1000",
        ),
        (
            http.post(&completions).json(&serde_json::json!({"model": "tiny", "prompt": "a", "top_p": 0.0})),
            400,
            Some("top_p"),
            "top_p",
        ),
    ];
    for (request, status, param, message) in cases {
        let resp = request.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{message}");
        let err: ErrorBody =
            resp.json().await.unwrap_or_else(|e| panic!("{message}: not OpenAI's shape: {e}"));
        assert_eq!(err.error.param.as_deref(), param, "{message}: {}", err.error.message);
        assert_eq!(err.error.code, Some(status), "{message}");
        assert!(err.error.message.contains(message), "{message}: {}", err.error.message);
    }
    // A JSON content type with parameters is JSON.
    let resp = http
        .post(&completions)
        .header("content-type", "Application/JSON; charset=utf-8")
        .body(ok.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    served().await;
}
