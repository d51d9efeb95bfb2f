//! The remote scorer against a local axum server on 127.0.0.1:0.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metronome_core::GroupScorer;
use metronome_reward::{RemoteConfig, RemoteScorer};
use serde_json::{Value, json};

use crate::common::{group, prompt};

/// How the test server answers.
#[derive(Clone, Copy)]
enum Mode {
    /// `{"rewards": [len(text), …]}` after failing the first `n` requests with 503.
    FailFirst(usize),
    /// Always this status.
    Status(u16),
    /// Sleep longer than any client timeout.
    Hang,
    /// One reward too few.
    WrongCount,
    /// Not JSON.
    Garbage,
    /// Sleep a little while counting requests in flight.
    Slow,
}

struct Server {
    mode: Mode,
    requests: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    last: std::sync::Mutex<Value>,
}

async fn handle(State(s): State<Arc<Server>>, Json(req): Json<Value>) -> (StatusCode, String) {
    let n = s.requests.fetch_add(1, Ordering::SeqCst);
    *s.last.lock().unwrap() = req.clone();
    let lengths: Vec<Value> = req["completions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| json!({"total": c.as_str().unwrap().len() as f32, "parts": {"len": 1.0}}))
        .collect();
    let ok = (StatusCode::OK, json!({ "rewards": lengths }).to_string());
    match s.mode {
        Mode::FailFirst(k) if n < k => (StatusCode::SERVICE_UNAVAILABLE, "busy".into()),
        Mode::FailFirst(_) => ok,
        Mode::Status(code) => (StatusCode::from_u16(code).unwrap(), "no".into()),
        Mode::Hang => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            ok
        }
        Mode::WrongCount => (StatusCode::OK, json!({ "rewards": [1.0] }).to_string()),
        Mode::Garbage => (StatusCode::OK, "<html>".into()),
        Mode::Slow => {
            let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            s.max_in_flight.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(30)).await;
            s.in_flight.fetch_sub(1, Ordering::SeqCst);
            ok
        }
    }
}

async fn serve(mode: Mode) -> (Arc<Server>, String) {
    let server = Arc::new(Server {
        mode,
        requests: AtomicUsize::new(0),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
        last: std::sync::Mutex::new(Value::Null),
    });
    let app = axum::Router::new().route("/score", post(handle)).with_state(Arc::clone(&server));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/score", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (server, url)
}

fn config(url: String) -> RemoteConfig {
    RemoteConfig {
        url,
        timeout_ms: 2_000,
        max_retries: 3,
        backoff_initial_ms: 1,
        backoff_max_ms: 4,
        failure_score: -1.0,
        ..RemoteConfig::default()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn counter(recorder: &DebuggingRecorder, name: &str) -> u64 {
    recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == name)
        .map(|(.., v)| if let DebugValue::Counter(n) = v { n } else { 0 })
        .sum()
}

#[test]
fn scores_a_group_after_retrying_unavailable_servers() {
    let recorder = DebuggingRecorder::new();
    let (server, scored) = metrics::with_local_recorder(&recorder, || {
        runtime().block_on(async {
            let (server, url) = serve(Mode::FailFirst(2)).await;
            let scorer = config(url).build().unwrap();
            let p = prompt(Some("42"), &[("numbers", "[1, 2]")]);
            let scored = scorer.score(group(p, &["a", "abc", "abcdef"])).await.unwrap();
            (server, scored)
        })
    });
    assert_eq!(server.requests.load(Ordering::SeqCst), 3);
    assert_eq!(counter(&recorder, "metronome_reward_remote_retries_total"), 2);
    assert_eq!(counter(&recorder, "metronome_reward_failures_total"), 0);
    let totals: Vec<f32> = scored.rewards.iter().map(|r| r.total).collect();
    assert_eq!(totals, [1.0, 3.0, 6.0]);
    assert_eq!(scored.rewards[0].parts["len"], 1.0);
    assert!(scored.rewards.iter().all(|r| r.failure.is_none()));
    assert!((scored.stats.mean - 10.0 / 3.0).abs() < 1e-6);
    let sent = server.last.lock().unwrap().clone();
    assert_eq!(sent["prompt_id"], 7);
    assert_eq!(sent["reference"], "42");
    assert_eq!(sent["metadata"]["numbers"], "[1, 2]");
    assert_eq!(sent["completions"], json!(["a", "abc", "abcdef"]));
}

/// Scores a 2-completion group against a server in `mode`; returns requests seen and the failure reason.
fn failing(mode: Mode, tweak: impl FnOnce(&mut RemoteConfig)) -> (usize, String, u64) {
    let recorder = DebuggingRecorder::new();
    let (requests, scored) = metrics::with_local_recorder(&recorder, || {
        runtime().block_on(async {
            let (server, url) = serve(mode).await;
            let mut c = config(url);
            tweak(&mut c);
            let scored = c.build().unwrap().score(group(prompt(None, &[]), &["a", "b"])).await.unwrap();
            (server.requests.load(Ordering::SeqCst), scored)
        })
    });
    assert!(scored.rewards.iter().all(|r| r.total == -1.0));
    assert!(scored.stats.all_equal);
    let reason = scored.rewards[0].failure.clone().unwrap();
    (requests, reason, counter(&recorder, "metronome_reward_failures_total"))
}

#[test]
fn gives_up_after_the_retries_with_the_failure_score() {
    let (requests, reason, failures) = failing(Mode::Status(500), |c| c.max_retries = 2);
    assert_eq!(requests, 3);
    assert!(reason.contains("status 500") && reason.contains("after 3 attempts"), "{reason}");
    assert_eq!(failures, 2);
}

#[test]
fn does_not_retry_what_retrying_cannot_fix() {
    let (requests, reason, _) = failing(Mode::Status(400), |_| {});
    assert_eq!(requests, 1);
    assert!(reason.contains("status 400"), "{reason}");
    let (requests, reason, _) = failing(Mode::WrongCount, |_| {});
    assert_eq!(requests, 1);
    assert!(reason.contains("returned 1 rewards for 2 completions"), "{reason}");
    let (requests, reason, _) = failing(Mode::Garbage, |_| {});
    assert_eq!(requests, 1);
    assert!(reason.contains("malformed response"), "{reason}");
    let (requests, reason, _) = failing(Mode::FailFirst(0), |c| c.max_response_bytes = 16);
    assert_eq!(requests, 1);
    assert!(reason.contains("larger than max_response_bytes (16)"), "{reason}");
}

#[test]
fn times_out_each_attempt() {
    let (requests, reason, failures) = failing(Mode::Hang, |c| {
        c.timeout_ms = 100;
        c.max_retries = 1;
    });
    assert_eq!(requests, 2);
    assert!(reason.contains("after 2 attempts"), "{reason}");
    assert_eq!(failures, 2);
}

#[test]
fn unreachable_server_fails_without_hanging() {
    // Bind and drop a listener: the port is then (almost surely) closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut c = config(format!("http://127.0.0.1:{port}/score"));
    c.max_retries = 1;
    let scored = runtime().block_on(c.build().unwrap().score(group(prompt(None, &[]), &["a"]))).unwrap();
    assert!(scored.rewards[0].failure.as_deref().unwrap().contains("after 2 attempts"));
}

#[test]
fn limits_requests_in_flight() {
    let max = runtime().block_on(async {
        let (server, url) = serve(Mode::Slow).await;
        let scorer = Arc::new(RemoteConfig { max_concurrency: 2, ..config(url) }.build().unwrap());
        let tasks: Vec<_> = (0..6)
            .map(|_| {
                let s = Arc::clone(&scorer);
                tokio::spawn(async move { s.score(group(prompt(None, &[]), &["ab"])).await.unwrap() })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap().rewards[0].total, 2.0);
        }
        assert_eq!(server.requests.load(Ordering::SeqCst), 6);
        server.max_in_flight.load(Ordering::SeqCst)
    });
    assert!((1..=2).contains(&max), "{max} requests in flight");
}

#[test]
fn backoff_grows_to_the_cap_with_bounded_jitter() {
    let scorer: RemoteScorer = RemoteConfig {
        url: "http://127.0.0.1:1/".into(),
        backoff_initial_ms: 100,
        backoff_max_ms: 1_000,
        ..RemoteConfig::default()
    }
    .build()
    .unwrap();
    for key in [0u64, 1, 99, u64::MAX] {
        let ms: Vec<u128> = (0..6).map(|r| scorer.backoff(r, key).as_millis()).collect();
        for (r, &d) in ms.iter().enumerate() {
            let base = (100u128 << r).min(1_000);
            assert!(
                d >= base - base / 2 && d <= base,
                "retry {r}: {d} ms outside [{}, {base}]",
                base - base / 2
            );
        }
        assert_eq!(ms, (0..6).map(|r| scorer.backoff(r, key).as_millis()).collect::<Vec<_>>());
    }
    assert!(RemoteConfig { url: "ftp://x".into(), ..RemoteConfig::default() }.build().is_err());
    assert!(RemoteConfig { url: "https://x".into(), ..RemoteConfig::default() }.build().is_err());
    assert!(
        RemoteConfig { url: "http://x".into(), max_concurrency: 0, ..RemoteConfig::default() }
            .build()
            .is_err()
    );
}
