//! The `openai` backend's client over several endpoints: load balancing, failover from
//! a dead endpoint and from a server on other weights, and the weight-sync requests.
//!
//! Our own server is real (the engine behind `router` on loopback). vLLM and SGLang
//! cannot run on these machines (no GPU, no Python serving stack): their weight-sync
//! and completion request shapes are checked against a local axum stub that records
//! what it receives and answers as their docs say, and nothing more is claimed.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::routing::post;
use metronome_core::{
    ErrorChain, PeriodId, PolicyVersion, PromptId, RolloutEngine, RolloutRequest, RunSeed, WeightSnapshot,
};
use metronome_rollout::ModelEngine;
use metronome_rollout::http::{
    NoWeightUpdate, OpenAiClientConfig, OpenAiEngine, SafetensorsReload, ServerConfig, WeightSync, router,
    serve, weight_sync_hook,
};
use serde_json::{Value, json};

use crate::common::{engine, generate, prompts, sampling, signature, tiny_model};

/// Serves `engine` as `tiny` (loading weights from `weights_dir`) on a free port.
async fn start(engine: Arc<ModelEngine>, weights_dir: Option<PathBuf>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ServerConfig { weights_dir, ..ServerConfig::named("tiny") };
    tokio::spawn(serve(listener, router(engine, config.clone()), &config));
    format!("http://{addr}")
}

/// A loopback address nothing listens on (bound, then released).
fn dead_endpoint() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    format!("http://127.0.0.1:{port}")
}

fn generated(engine: &ModelEngine) -> u64 {
    engine.worker_stats().iter().map(|s| s.generated_tokens).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_spread_over_endpoints_and_fail_over_from_a_dead_one() {
    let s = sampling(12);
    let reference = Arc::new(engine(1, 8, s.clone()));
    let (a, b) = (Arc::new(engine(1, 8, s.clone())), Arc::new(engine(1, 8, s.clone())));
    let endpoints =
        vec![dead_endpoint(), start(Arc::clone(&a), None).await, start(Arc::clone(&b), None).await];
    let request = RolloutRequest { period: PeriodId(1), prompts: prompts(6), group_size: 2 };
    let local = generate(reference.as_ref(), request.clone()).await;

    let config = OpenAiClientConfig {
        endpoints,
        model: "tiny".into(),
        max_retries: 2,
        retry_backoff_ms: 1,
        max_concurrency: 6,
        weight_sync: WeightSync::None,
        ..OpenAiClientConfig::default()
    };
    let client = OpenAiEngine::new(config, s, reference.seed(), PolicyVersion(0), NoWeightUpdate).unwrap();
    let remote = generate(&client, request).await;
    // Every group came back, from whichever live server took it, with the tokens the
    // in-process engine samples: the server a request lands on does not matter.
    assert_eq!(signature(&local), signature(&remote));
    assert!(
        generated(&a) > 0 && generated(&b) > 0,
        "both live endpoints served: {} {}",
        generated(&a),
        generated(&b)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_reach_every_endpoint_and_a_server_on_other_weights_is_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let s = sampling(8);
    let (a, b) = (Arc::new(engine(1, 4, s.clone())), Arc::new(engine(1, 4, s.clone())));
    let endpoints = vec![
        start(Arc::clone(&a), Some(dir.path().into())).await,
        start(Arc::clone(&b), Some(dir.path().into())).await,
    ];
    let config = OpenAiClientConfig {
        endpoints: endpoints.clone(),
        model: "tiny".into(),
        max_retries: 3,
        retry_backoff_ms: 1,
        export_dir: Some(dir.path().into()),
        ..OpenAiClientConfig::default()
    };
    let client =
        OpenAiEngine::new(config, s, RunSeed(42), PolicyVersion(0), SafetensorsReload::new(dir.path()))
            .unwrap();
    for v in [3, 4] {
        client.install_weights(weights(30 + v, v)).await.unwrap();
    }
    assert_eq!((a.current_version(), b.current_version()), (PolicyVersion(4), PolicyVersion(4)));
    // Only the newest export stays.
    let files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    assert_eq!(files, ["weights-v4.safetensors"]);

    // Someone else swaps b's weights: b answers with version 9, which the client
    // refuses (it would be trained as version 4) and retries on a.
    b.install_weights(weights(99, 9)).await.unwrap();
    let request = RolloutRequest { period: PeriodId(4), prompts: prompts(4), group_size: 2 };
    for g in generate(&client, request).await {
        assert!(g.completions.iter().all(|c| c.version == PolicyVersion(4)), "{:?}", g.prompt.id);
    }
    let status = client.endpoint_status();
    assert_eq!(status, [(endpoints[0].clone(), true), (endpoints[1].clone(), false)]);
    // The next update brings b back.
    client.install_weights(weights(35, 5)).await.unwrap();
    assert!(client.endpoint_status().iter().all(|(_, synced)| *synced));
    assert_eq!(b.current_version(), PolicyVersion(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_no_endpoint_takes_fails_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let dead = dead_endpoint();
    let config = OpenAiClientConfig {
        endpoints: vec![dead.clone()],
        export_dir: Some(dir.path().into()),
        timeout_s: 5.0,
        ..OpenAiClientConfig::default()
    };
    let client = OpenAiEngine::new(
        config,
        sampling(4),
        RunSeed(0),
        PolicyVersion(0),
        SafetensorsReload::new(dir.path()),
    )
    .unwrap();
    let err = refusal(&client, 1).await;
    assert!(err.contains("no endpoint took the weights of version 1") && err.contains(&dead), "{err}");
    assert_eq!(client.version(), PolicyVersion(0), "a failed update does not move the version");
}

/// What a stub server received: (path, JSON body) in order.
type Calls = Arc<Mutex<Vec<(String, Value)>>>;

/// The bodies the stub received on `path`, in order.
fn bodies_to(calls: &Calls, path: &str) -> Vec<Value> {
    calls.lock().unwrap().iter().filter(|(p, _)| p == path).map(|(_, b)| b.clone()).collect()
}

/// A stub of vLLM's or SGLang's HTTP surface: records every call; weight updates
/// answer `update_answer`; each completion choice has two tokens, the first the
/// request's seed mod 50, written as SGLang answers (`token_ids`, text log-prob tokens,
/// a stop string in `matched_stop`) or as vLLM does with `return_tokens_as_token_ids`
/// (`token_id:<id>` log-prob tokens, no `token_ids`, `length`).
async fn stub(update_answer: Value, sglang: bool) -> (String, Calls) {
    let calls: Calls = Arc::default();
    let record = |path: &'static str, calls: Calls, answer: Value| {
        post(move |Json(body): Json<Value>| {
            let (calls, answer) = (Arc::clone(&calls), answer.clone());
            async move {
                calls.lock().unwrap().push((path.to_owned(), body));
                Json(answer)
            }
        })
    };
    let completions = {
        let calls = Arc::clone(&calls);
        post(move |Json(body): Json<Value>| {
            let calls = Arc::clone(&calls);
            async move {
                calls.lock().unwrap().push(("/v1/completions".into(), body.clone()));
                let first = body["seed"].as_u64().unwrap() % 50;
                let choices: Vec<Value> = (0..body["n"].as_u64().unwrap_or(1))
                    .map(|i| {
                        let logprobs = json!({"token_logprobs": [-0.5, -0.25], "top_logprobs": null,
                                              "text_offset": [0, 1]});
                        let mut choice = json!({"index": i, "text": "ab", "logprobs": logprobs});
                        if sglang {
                            choice["token_ids"] = json!([first, 7]);
                            choice["logprobs"]["tokens"] = json!(["a", "b"]);
                            choice["finish_reason"] = json!("stop");
                            choice["matched_stop"] = json!("Z");
                        } else {
                            choice["logprobs"]["tokens"] = json!([format!("token_id:{first}"), "token_id:7"]);
                            choice["finish_reason"] = json!("length");
                        }
                        choice
                    })
                    .collect();
                Json(
                    json!({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": choices}),
                )
            }
        })
    };
    let app = axum::Router::new()
        .route("/v1/completions", completions)
        .route(
            "/update_weights_from_disk",
            record("/update_weights_from_disk", Arc::clone(&calls), update_answer.clone()),
        )
        .route("/collective_rpc", record("/collective_rpc", Arc::clone(&calls), json!({"results": [null]})))
        .route("/reset_prefix_cache", record("/reset_prefix_cache", Arc::clone(&calls), json!({})));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve(listener, app, &ServerConfig::default()));
    (url, calls)
}

fn foreign_config(url: String, sync: WeightSync, dir: &std::path::Path) -> OpenAiClientConfig {
    OpenAiClientConfig {
        endpoints: vec![url],
        model: "m".into(),
        send_prompt_ids: false,
        weight_sync: sync,
        export_dir: Some(dir.into()),
        ..OpenAiClientConfig::default()
    }
}

fn config_json() -> String {
    metronome_model::ModelConfig::tiny().to_hf_json()
}

/// A client of the stub `config` points at, updating its weights as `config` says.
fn foreign_client(config: &OpenAiClientConfig) -> OpenAiEngine {
    let hook = weight_sync_hook(config, config_json()).unwrap();
    OpenAiEngine::new(config.clone(), sampling(8), RunSeed(42), PolicyVersion(0), hook).unwrap()
}

/// Weights of version `v`, from a tiny model seeded with `seed`.
fn weights(seed: u64, v: u64) -> Arc<WeightSnapshot> {
    Arc::new(tiny_model(seed).snapshot(PolicyVersion(v)).unwrap())
}

/// Why `engine` refused the weights of version `v` (a tiny model seeded with `v`).
async fn refusal(engine: &impl RolloutEngine, v: u64) -> String {
    ErrorChain(&engine.install_weights(weights(v, v)).await.unwrap_err()).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_gets_an_hf_folder_per_version_and_a_request_per_response() {
    let dir = tempfile::tempdir().unwrap();
    let (url, calls) = stub(json!({"success": true, "message": "ok"}), true).await;
    let mut config = foreign_config(url, WeightSync::Sglang, dir.path());
    config.server_export_dir = Some("/srv/weights".into());
    let client = foreign_client(&config);
    let snapshot = tiny_model(3).snapshot(PolicyVersion(3)).unwrap();
    let names: Vec<String> = snapshot.tensors.iter().map(|t| t.name.clone()).collect();
    client.install_weights(Arc::new(snapshot)).await.unwrap();
    client.install_weights(weights(4, 4)).await.unwrap();

    let updates: Vec<Value> = bodies_to(&calls, "/update_weights_from_disk");
    assert_eq!(
        updates,
        [
            json!({"model_path": "/srv/weights/v3", "weight_version": "3"}),
            json!({"model_path": "/srv/weights/v4", "weight_version": "4"})
        ]
    );
    // An HF folder: the model's config.json and its tensors under their HF names; the
    // older version's folder is gone.
    let folder = dir.path().join("v4");
    assert!(!dir.path().join("v3").exists());
    let hf: Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap()).unwrap();
    assert_eq!(hf, serde_json::from_str::<Value>(&config_json()).unwrap());
    let bytes = std::fs::read(folder.join("model.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut written: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    written.sort();
    let mut names = names;
    names.sort();
    assert_eq!(written, names);
    assert!(names.iter().any(|n| n == "model.layers.0.self_attn.q_proj.weight"), "{names:?}");

    let request = RolloutRequest { period: PeriodId(4), prompts: prompts(1), group_size: 2 };
    let groups = generate(&client, request).await;
    // One request per response, each with that response's own seed, and the answers
    // in sample order.
    let seed =
        |j| metronome_core::sample_seed(RunSeed(42), PolicyVersion(4), PromptId(100), j) & ((1 << 62) - 1);
    let group = &groups[0];
    for (j, c) in group.completions.iter().enumerate() {
        assert_eq!(c.sample_index, j as u32);
        assert_eq!(c.tokens, [(seed(j as u32) % 50) as u32, 7]);
        assert_eq!(c.logprobs, [-0.5, -0.25]);
        assert_eq!(c.finish_reason, metronome_core::FinishReason::StopString, "from matched_stop");
        // SGLang does not say which weights sampled: the version the client brought it to.
        assert_eq!(c.version, PolicyVersion(4));
    }
    let bodies: Vec<Value> = bodies_to(&calls, "/v1/completions");
    let mut seeds: Vec<u64> = bodies.iter().map(|b| b["seed"].as_u64().unwrap()).collect();
    seeds.sort_unstable();
    let mut expected = vec![seed(0), seed(1)];
    expected.sort_unstable();
    assert_eq!(seeds, expected);
    for body in &bodies {
        assert_eq!(body["n"], 1);
        assert_eq!(body["max_tokens"], 8);
        assert_eq!(body["temperature"], 1.0);
        assert_eq!(body["logprobs"], 0);
        assert_eq!(body["return_token_ids"], true);
        assert_eq!(body["model"], "m");
        assert!(body.get("prompt_ids").is_none(), "{body}");
        assert_eq!(body["prompt"], json!(prompts(1)[0].tokens));
    }

    // SGLang's refusal is 200 with `"success": false`: the update fails, naming it.
    let (url, _) = stub(json!({"success": false, "message": "shape mismatch"}), true).await;
    let config = foreign_config(url.clone(), WeightSync::Sglang, dir.path());
    let err = refusal(&foreign_client(&config), 5).await;
    assert!(err.contains("shape mismatch") && err.contains(&url), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_reloads_its_own_folder_in_dev_mode() {
    let dir = tempfile::tempdir().unwrap();
    let (url, calls) = stub(json!({}), false).await;
    let config = foreign_config(url, WeightSync::Vllm, dir.path());
    let client = foreign_client(&config);
    client.install_weights(weights(6, 6)).await.unwrap();
    let seen = calls.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            ("/collective_rpc".to_owned(), json!({"method": "reload_weights"})),
            ("/reset_prefix_cache".to_owned(), json!({}))
        ]
    );
    assert!(dir.path().join("config.json").is_file() && dir.path().join("model.safetensors").is_file());
    assert_eq!(client.version(), PolicyVersion(6));
    // vLLM's `token_id:<id>` log-prob tokens carry the ids.
    let request = RolloutRequest { period: PeriodId(6), prompts: prompts(1), group_size: 1 };
    let c = &generate(&client, request).await[0].completions[0];
    let seed = metronome_core::sample_seed(RunSeed(42), PolicyVersion(6), PromptId(100), 0) & ((1 << 62) - 1);
    assert_eq!(c.tokens, [(seed % 50) as u32, 7]);
    assert_eq!((c.finish_reason, c.version), (metronome_core::FinishReason::Length, PolicyVersion(6)));

    // A sharded folder would keep serving its shards: refused, naming the key.
    std::fs::write(dir.path().join("model.safetensors.index.json"), "{}").unwrap();
    let err = refusal(&foreign_client(&config), 7).await;
    assert!(err.contains("openai.export_dir") && err.contains("model.safetensors.index.json"), "{err}");
}

#[test]
fn bad_tables_are_refused_naming_the_field() {
    let s = sampling(8);
    let ok = OpenAiClientConfig {
        endpoints: vec!["http://127.0.0.1:8000".into()],
        export_dir: Some("/tmp/x".into()),
        ..OpenAiClientConfig::default()
    };
    ok.validate(&s).unwrap();
    let cases: Vec<(OpenAiClientConfig, &str)> = vec![
        (OpenAiClientConfig { endpoints: vec![], ..ok.clone() }, "openai.endpoints"),
        (OpenAiClientConfig { endpoints: vec!["127.0.0.1:8000".into()], ..ok.clone() }, "openai.endpoints"),
        (OpenAiClientConfig { endpoints: vec!["http://h:1/v1".into()], ..ok.clone() }, "openai.endpoints"),
        (
            OpenAiClientConfig { endpoints: vec!["http://h:1".into(), "http://h:1/".into()], ..ok.clone() },
            "twice",
        ),
        (OpenAiClientConfig { timeout_s: 0.0, ..ok.clone() }, "openai.timeout_s"),
        (OpenAiClientConfig { max_concurrency: 0, ..ok.clone() }, "openai.max_concurrency"),
        (OpenAiClientConfig { export_dir: None, ..ok.clone() }, "openai.export_dir"),
        (OpenAiClientConfig { weight_sync: WeightSync::Vllm, ..ok.clone() }, "openai.send_prompt_ids"),
        (
            OpenAiClientConfig {
                weight_sync: WeightSync::Vllm,
                send_prompt_ids: false,
                server_export_dir: Some("/elsewhere".into()),
                ..ok.clone()
            },
            "openai.server_export_dir",
        ),
        (OpenAiClientConfig { model: String::new(), ..ok.clone() }, "openai.model"),
    ];
    for (config, field) in cases {
        let err = config.validate(&s).unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    let sglang = OpenAiClientConfig { weight_sync: WeightSync::Sglang, send_prompt_ids: false, ..ok };
    sglang.validate(&s).unwrap();
    let keep = metronome_rollout::SamplingConfig { include_stop_str_in_output: true, ..s };
    let err = sglang.validate(&keep).unwrap_err().to_string();
    assert!(err.contains("sampling.include_stop_str_in_output"), "{err}");
}
