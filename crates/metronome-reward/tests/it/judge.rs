//! The judge scorer against a stub OpenAI-compatible server that grades, answers
//! slowly, malformed, with errors, or not at all; its config errors name the place.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metronome_core::{GroupScorer, ScoredGroup};
use metronome_reward::{JudgeConfig, JudgeFailure, RewardConfig, parse_score};
use serde_json::{Value, json};

use crate::common::{group, prompt};

/// How the stub answers `POST /v1/completions`.
#[derive(Clone, Copy)]
enum Mode {
    /// `SCORE: 9` for a completion that says "good", `SCORE: 2` otherwise, after
    /// answering the first `n` requests with 503.
    Grade { fail_first: usize },
    /// Grades after sleeping this long.
    Slow(u64),
    /// A reply without a score line.
    Malformed,
    /// Always this status.
    Status(u16),
    /// Never answers.
    Silent,
}

struct Stub {
    mode: Mode,
    requests: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    prompts: std::sync::Mutex<Vec<String>>,
}

async fn completions(State(s): State<Arc<Stub>>, Json(req): Json<Value>) -> (StatusCode, String) {
    let n = s.requests.fetch_add(1, Ordering::SeqCst);
    let prompt = req["prompt"].as_str().unwrap_or_default().to_owned();
    s.prompts.lock().unwrap().push(prompt.clone());
    let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    s.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let graded = |text: &str| {
        let score = if prompt.contains("Response:\ngood") { 9 } else { 2 };
        let body = json!({"object": "text_completion", "model": "judge", "choices": [
            {"index": 0, "text": format!("{text}\nSCORE: {score}\n"), "finish_reason": "stop"}
        ]});
        (StatusCode::OK, body.to_string())
    };
    let answer = match s.mode {
        Mode::Grade { fail_first } if n < fail_first => (StatusCode::SERVICE_UNAVAILABLE, "busy".into()),
        Mode::Grade { .. } => graded("The response is judged."),
        Mode::Slow(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            graded("Slowly judged.")
        }
        Mode::Malformed => {
            let body = json!({"choices": [{"index": 0, "text": "I would give it a seven out of ten."}]});
            (StatusCode::OK, body.to_string())
        }
        Mode::Status(code) => (StatusCode::from_u16(code).unwrap(), "no".into()),
        Mode::Silent => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            graded("")
        }
    };
    s.in_flight.fetch_sub(1, Ordering::SeqCst);
    answer
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "judge", "object": "model"}]}))
}

/// Starts the stub on a runtime of its own thread, so that a scorer blocking its
/// caller (the start-up probe) cannot stall it.
fn stub(mode: Mode) -> (Arc<Stub>, String) {
    let stub = Arc::new(Stub {
        mode,
        requests: AtomicUsize::new(0),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
        prompts: std::sync::Mutex::new(Vec::new()),
    });
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let state = Arc::clone(&stub);
    std::thread::spawn(move || {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(async move {
            let app = axum::Router::new()
                .route("/v1/completions", post(completions))
                .route("/v1/models", get(models))
                .with_state(state);
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    (stub, url)
}

fn config(url: String) -> JudgeConfig {
    JudgeConfig {
        url,
        model: "judge".into(),
        timeout_ms: 2_000,
        max_retries: 2,
        backoff_initial_ms: 1,
        backoff_max_ms: 4,
        failure_score: -1.0,
        ..JudgeConfig::default()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// The counters of a run: (name, labels, value). Taken once, since a snapshot resets them.
type Counters = Vec<(String, Vec<(String, String)>, u64)>;

fn counters(recorder: &DebuggingRecorder) -> Counters {
    recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let DebugValue::Counter(n) = value else { return None };
            let labels = key.key().labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
            Some((key.key().name().to_owned(), labels, n))
        })
        .collect()
}

fn counter(counters: &Counters, name: &str, label: Option<(&str, &str)>) -> u64 {
    counters
        .iter()
        .filter(|(n, labels, _)| {
            n == name && label.is_none_or(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(.., v)| v)
        .sum()
}

/// Scores `texts` with `config` under a local recorder.
fn judge(config: &JudgeConfig, texts: &[&str], times: usize) -> (Vec<ScoredGroup>, Counters) {
    let recorder = DebuggingRecorder::new();
    let scorer = config.build().unwrap();
    let scored = metrics::with_local_recorder(&recorder, || {
        runtime().block_on(async {
            let mut out = Vec::new();
            for _ in 0..times {
                let p = prompt(Some("4"), &[]);
                out.push(scorer.score(group(p, texts)).await.unwrap());
            }
            out
        })
    });
    (scored, counters(&recorder))
}

#[test]
fn grades_with_the_rubric_and_caches_repeated_judgements() {
    let (stub, url) = stub(Mode::Grade { fail_first: 0 });
    let (scored, recorder) = judge(&config(url), &["good answer", "bad answer"], 2);
    for s in &scored {
        let totals: Vec<f32> = s.rewards.iter().map(|r| r.total).collect();
        assert_eq!(totals, [0.9, 0.2]);
        assert_eq!(s.rewards[0].parts["judge"], 0.9);
    }
    // The second group is the same (prompt, completion, rubric): from the cache.
    assert_eq!(stub.requests.load(Ordering::SeqCst), 2);
    assert_eq!(counter(&recorder, "metronome_reward_judge_cache_hits_total", None), 2);
    assert_eq!(counter(&recorder, "metronome_reward_judge_requests_total", Some(("outcome", "ok"))), 2);
    let sent = stub.prompts.lock().unwrap()[0].clone();
    assert!(
        sent.contains("Task:\nquestion") && sent.contains("Reference answer (may be empty):\n4"),
        "{sent}"
    );
    assert!(sent.contains("`SCORE: <n>`, where <n> is a whole number from 0 to 10"), "{sent}");
}

#[test]
fn retries_a_busy_judge_then_grades() {
    let (stub, url) = stub(Mode::Grade { fail_first: 2 });
    let (scored, recorder) = judge(&JudgeConfig { max_concurrency: 1, ..config(url) }, &["good"], 1);
    assert_eq!(scored[0].rewards[0].total, 0.9);
    assert_eq!(stub.requests.load(Ordering::SeqCst), 3);
    assert_eq!(counter(&recorder, "metronome_reward_judge_requests_total", Some(("outcome", "error"))), 2);
}

/// The reason of the first reward, the stub's request count and the failures counted
/// under the `score` policy.
fn failing(mode: Mode, tweak: impl FnOnce(&mut JudgeConfig)) -> (String, usize, u64, Counters) {
    let (stub, url) = stub(mode);
    let mut c = config(url);
    tweak(&mut c);
    let (scored, recorder) = judge(&c, &["good", "bad"], 1);
    let reward = &scored[0].rewards[0];
    assert_eq!(reward.total, -1.0, "{reward:?}");
    let failures = counter(&recorder, "metronome_reward_judge_failures_total", Some(("policy", "score")));
    (reward.failure.clone().unwrap(), stub.requests.load(Ordering::SeqCst), failures, recorder)
}

#[test]
fn a_slow_judge_times_out_each_attempt_and_gets_the_failure_score() {
    let (reason, requests, failures, recorder) =
        failing(Mode::Slow(3_000), |c| (c.timeout_ms, c.max_retries) = (200, 1));
    assert!(reason.contains("timed out") && reason.contains("after 2 attempts"), "{reason}");
    assert_eq!((requests, failures), (4, 2));
    assert_eq!(counter(&recorder, "metronome_reward_judge_requests_total", Some(("outcome", "timeout"))), 4);
    assert_eq!(counter(&recorder, "metronome_reward_failures_total", Some(("reason", "judge"))), 2);
}

#[test]
fn a_malformed_judgement_is_not_retried() {
    let (reason, requests, failures, recorder) = failing(Mode::Malformed, |_| {});
    assert!(reason.contains("malformed judgement") && reason.contains("is not `SCORE: <n>`"), "{reason}");
    assert_eq!((requests, failures), (2, 2));
    assert_eq!(
        counter(&recorder, "metronome_reward_judge_requests_total", Some(("outcome", "malformed"))),
        2
    );
}

#[test]
fn error_statuses_are_retried_only_when_retrying_can_help() {
    let (reason, requests, ..) = failing(Mode::Status(500), |_| {});
    assert!(reason.contains("status 500") && reason.contains("after 3 attempts"), "{reason}");
    assert_eq!(requests, 6);
    let (reason, requests, ..) = failing(Mode::Status(400), |_| {});
    assert!(reason.contains("status 400"), "{reason}");
    assert_eq!(requests, 2);
}

#[test]
fn a_silent_judge_cannot_hold_a_group_past_its_deadline() {
    let (reason, _, failures, _) =
        failing(Mode::Silent, |c| (c.timeout_ms, c.group_timeout_ms) = (60_000, 300));
    assert!(reason.contains("not graded within group_timeout_ms (300 ms)"), "{reason}");
    assert_eq!(failures, 2);
}

#[test]
fn the_drop_policy_drops_the_whole_group_and_counts_it() {
    let (_, url) = stub(Mode::Malformed);
    let c = JudgeConfig { on_failure: JudgeFailure::Drop, ..config(url) };
    let (scored, recorder) = judge(&c, &["good", "bad", "good too"], 1);
    let mut group = scored[0].clone();
    assert!(group.rewards.iter().all(|r| r.total.is_nan()), "{:?}", group.rewards);
    assert!(group.rewards[0].failure.as_deref().unwrap().contains("3 of 3 not graded, the group is dropped"));
    assert_eq!(counter(&recorder, "metronome_reward_judge_failures_total", Some(("policy", "drop"))), 3);
    // The trainer's admission refuses it, with the reason.
    let refused = group.recompute(Default::default()).unwrap_err().to_string();
    assert!(refused.contains("NaN"), "{refused}");
}

#[test]
fn requests_in_flight_stay_under_the_limit() {
    let (stub, url) = stub(Mode::Slow(30));
    let texts: Vec<String> = (0..8).map(|i| format!("answer {i}")).collect();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let (scored, _) = judge(&JudgeConfig { max_concurrency: 2, ..config(url) }, &texts, 1);
    assert!(scored[0].rewards.iter().all(|r| r.failure.is_none()));
    let max = stub.max_in_flight.load(Ordering::SeqCst);
    assert!((1..=2).contains(&max), "{max} requests in flight");
}

#[test]
fn bad_configs_and_unreachable_judges_are_errors_naming_the_place() {
    let (_, url) = stub(Mode::Grade { fail_first: 0 });
    let err = |c: JudgeConfig| c.build().expect_err("an error").to_string();
    let no_slot =
        JudgeConfig { template: Some("Grade {completion} from 0 to 10.".into()), ..config(url.clone()) };
    let e = err(no_slot);
    assert!(e.contains("judge.template") && e.contains("no `{score_format}` slot"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rubric.txt");
    std::fs::write(&file, "Rate {completion}.").unwrap();
    let e = err(JudgeConfig { template_file: Some(file.clone()), ..config(url.clone()) });
    assert!(
        e.contains("judge.template_file") && e.contains("rubric.txt") && e.contains("{score_format}"),
        "{e}"
    );
    let missing = dir.path().join("missing.txt");
    let e = err(JudgeConfig { template_file: Some(missing), ..config(url.clone()) });
    assert!(e.contains("judge.template_file") && e.contains("missing.txt"), "{e}");
    let e = err(JudgeConfig { model: "other".into(), ..config(url.clone()) });
    assert!(e.contains("does not serve the model `other` (judge.model)") && e.contains("judge"), "{e}");
    // Nothing listens on this port.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let e = err(config(format!("http://{closed}")));
    assert!(e.starts_with(&format!("judge at http://{closed} did not answer GET /v1/models")), "{e}");
    let e = err(JudgeConfig { url: "https://judge".into(), ..config(url.clone()) });
    assert!(e.contains("judge.url"), "{e}");
    // The same from a run config's `[reward]` table.
    let toml_config: RewardConfig = toml::from_str(&format!(
        "kind = \"judge\"\nurl = \"{url}\"\nmodel = \"judge\"\ntemplate = \"{{completion}} {{score_format}}\"\n"
    ))
    .unwrap();
    assert!(toml_config.build(Default::default()).is_ok());
}

#[test]
fn scores_are_read_strictly() {
    let cases: &[(&str, Result<i64, &str>)] = &[
        ("Good.\nSCORE: 7", Ok(7)),
        ("SCORE: 10\n\n", Ok(10)),
        ("SCORE:0", Ok(0)),
        ("SCORE: 7\nThanks!", Err("is not `SCORE: <n>`")),
        ("Score: 7", Err("is not `SCORE: <n>`")),
        ("SCORE: 7.5", Err("whole number")),
        ("SCORE: 11", Err("outside 0..=10")),
        ("SCORE: -1", Err("outside 0..=10")),
        ("", Err("empty")),
    ];
    for (reply, expected) in cases {
        match (parse_score(reply, 0, 10), expected) {
            (Ok(got), Ok(want)) => assert_eq!(got, *want, "{reply:?}"),
            (Err(got), Err(want)) => assert!(got.contains(want), "{reply:?}: {got}"),
            (got, want) => panic!("{reply:?}: {got:?}, expected {want:?}"),
        }
    }
}
