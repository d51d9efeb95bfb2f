//! `rollout.backend = "openai"` against two `metronome serve` processes: `periodic`
//! and `sync` runs whose rollouts come over HTTP, spread over both servers, train what
//! the native engine's `periodic` run of the same seed trains.
//!
//! Why they can agree exactly: the client sends the run seed with Metronome's
//! `prompt_ids` extension, so the server derives each response's seed from (run seed,
//! version, prompt id, sample index) as the native engine does; at every period start
//! the trainer's weights are written to the server's weights directory as f32
//! safetensors (bit-exact) and loaded with their version, which the server names in
//! every answer (the client refuses an answer from other weights); decoding is
//! batch-invariant, so the server's batching does not change a token. vLLM and SGLang
//! cannot run here; their protocol is checked against a stub in
//! `crates/metronome-rollout/tests/it/openai.rs`.

use serde_json::Value;

use crate::cluster::{Proc, max_difference, read_weights, serial};

/// A short `periodic` run with a warm start (so the server's own starting weights are
/// wrong until the first sync) and rewards that vary, so the weights move.
fn settings(name: &str) -> Vec<String> {
    [
        "run.periods=3",
        "run.group_size=4",
        "run.schedule=\"periodic\"",
        "data.release.batch_size=4",
        "sft.steps=3",
        "sft.batch_size=8",
        "eval.prompts=0",
        "rollout.max_num_seqs=8",
        "rollout.sampling.max_new_tokens=16",
        "run.cores=2",
        "trainer.schedule.lr=0.01",
        r#"reward.scorer={kind="length", max_len=12, cache_len=10, penalty=1.0}"#,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([format!("run.name={name}")])
    .collect()
}

/// The `period_done` reports of `metrics.jsonl`, in order.
fn periods(run: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn periodic_over_metronome_serve_trains_what_the_native_engine_trains() {
    let _serial = serial();
    let out = tempfile::tempdir().unwrap();
    let weights = out.path().join("weights");
    std::fs::create_dir_all(&weights).unwrap();

    let native_sets = settings("native");
    let mut native = Proc::spawn("native run", &["run", "--quiet"], &native_sets, out.path());

    // Two servers read the same settings (their starting model is the tiny one of
    // the run seed, before the warm start) and load only from `weights`; requests
    // are spread over both and weights go to both.
    let servers: Vec<(Proc, String)> = (0..2)
        .map(|i| {
            let addr = format!("127.0.0.1:{}", metronome_testkit::server::free_port().unwrap());
            let mut args: Vec<String> = ["serve", "--addr", &addr, "--model-name", "tiny", "--events", "-"]
                .iter()
                .map(|s| (*s).to_owned())
                .chain(["--weights-dir".to_owned(), weights.display().to_string()])
                .collect();
            for s in settings("server") {
                args.extend(["--set".to_owned(), s]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let server = Proc::spawn_plain(&format!("serve {i}"), &args);
            server.wait_event("serving", |_| true);
            (server, format!("\"http://{addr}\""))
        })
        .collect();
    let endpoints: Vec<&str> = servers.iter().map(|(_, url)| url.as_str()).collect();

    let mut openai_sets = settings("openai");
    openai_sets.extend([
        "rollout.backend=\"openai\"".to_owned(),
        format!("rollout.openai.endpoints=[{}]", endpoints.join(", ")),
        "rollout.openai.model=\"tiny\"".to_owned(),
        format!("rollout.openai.export_dir={:?}", weights.display().to_string()),
    ]);
    let mut openai = Proc::spawn("openai run", &["run", "--quiet"], &openai_sets, out.path());
    openai.finish_ok();
    // `sync` through the same servers (which hold version 2 by now, and are brought
    // back to the warm start's version 0): `sync` trains what `periodic` trains.
    let sync_sets: Vec<String> = openai_sets
        .iter()
        .map(|s| match s.as_str() {
            "run.schedule=\"periodic\"" => "run.schedule=\"sync\"".to_owned(),
            "run.name=openai" => "run.name=openai-sync".to_owned(),
            other => other.to_owned(),
        })
        .collect();
    let mut sync = Proc::spawn("openai sync run", &["run", "--quiet"], &sync_sets, out.path());
    sync.finish_ok();
    native.finish_ok();
    for (server, _) in &servers {
        server.sigterm();
    }

    let native_dir = out.path().join("native");
    let a = periods(&native_dir);
    assert_eq!(a.len(), 3);
    for name in ["openai", "openai-sync"] {
        let dir = out.path().join(name);
        let b = periods(&dir);
        assert_eq!(b.len(), 3, "{name}");
        same_training(&a, &b, name);
        let difference = max_difference(&read_weights(&native_dir), &read_weights(&dir));
        assert!(difference <= 1e-6, "{name}: final weights differ by {difference}");
    }
    // The servers were brought to every version; only the newest export is kept.
    let files: Vec<String> = std::fs::read_dir(&weights)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    assert_eq!(files, ["weights-v2.safetensors"]);
}

/// The same responses period by period: as many tokens, the same rewards, trained to
/// the same loss, at the same version.
fn same_training(a: &[Value], b: &[Value], name: &str) {
    for (x, y) in a.iter().zip(b) {
        let period = &x["period"];
        for key in ["generated_tokens", "groups", "rejected", "staleness"] {
            assert_eq!(x[key], y[key], "{name} period {period}: {key}");
        }
        for (key, tolerance) in [("reward_mean", 1e-9), ("step.loss", 1e-6), ("step.entropy", 1e-6)] {
            let get = |v: &Value| key.split('.').fold(v, |v, k| &v[k]).as_f64().unwrap();
            let (p, q) = (get(x), get(y));
            assert!((p - q).abs() <= tolerance, "{name} period {period}: {key} {p} vs {q}");
        }
        assert_eq!(x["step"]["version"], y["step"]["version"], "{name} period {period}");
    }
}

/// One `metronome serve` with `--logprobs MODE`, loading weights from `weights`;
/// the server and its endpoint for `rollout.openai.endpoints`.
fn server(name: &str, logprobs: &str, weights: &std::path::Path) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", metronome_testkit::server::free_port().unwrap());
    let mut args: Vec<String> = ["serve", "--addr", &addr, "--model-name", "tiny", "--events", "-"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain(["--weights-dir".to_owned(), weights.display().to_string()])
        .chain(["--logprobs".to_owned(), logprobs.to_owned()])
        .collect();
    for s in settings("server") {
        args.extend(["--set".to_owned(), s]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Proc::spawn_plain(name, &args);
    server.wait_event("serving", |_| true);
    (server, format!("\"http://{addr}\""))
}

/// A server that answers with the log-probs of the raw distribution (temperature 1),
/// as vLLM does unless told otherwise, while the run samples at 0.7: the trainer's
/// train–rollout mismatch shows it in every period, where the same server answering
/// with the sampled distribution's log-probs shows none.
#[test]
fn raw_logprobs_from_the_server_show_as_train_rollout_mismatch() {
    let _serial = serial();
    let out = tempfile::tempdir().unwrap();
    let mut figures = Vec::new();
    for mode in ["sampled", "raw"] {
        let weights = out.path().join(format!("weights-{mode}"));
        std::fs::create_dir_all(&weights).unwrap();
        let (server, endpoint) = server(&format!("serve {mode}"), mode, &weights);
        let mut sets = settings(&format!("openai-{mode}"));
        sets.retain(|s| s != "run.periods=3");
        sets.extend([
            "run.periods=2".to_owned(),
            "rollout.sampling.temperature=0.7".to_owned(),
            "rollout.backend=\"openai\"".to_owned(),
            format!("rollout.openai.endpoints=[{endpoint}]"),
            "rollout.openai.model=\"tiny\"".to_owned(),
            format!("rollout.openai.export_dir={:?}", weights.display().to_string()),
        ]);
        let mut run =
            Proc::spawn(&format!("openai run, {mode} log-probs"), &["run", "--quiet"], &sets, out.path());
        run.finish_ok();
        server.sigterm();
        let reports = periods(&out.path().join(format!("openai-{mode}")));
        assert_eq!(reports.len(), 2, "{mode}");
        for r in &reports {
            let m = &r["step"]["mismatch"];
            let get = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("{mode}: no mismatch.{k} in {r}"));
            eprintln!(
                "{mode} log-probs, period {}: {} tokens, mean {:.3e}, p99 {:.3e}, max {:.3e}, k3 {:.3e}",
                r["period"],
                m["tokens"],
                get("mean_abs"),
                get("p99_abs"),
                get("max_abs"),
                get("kl_k3")
            );
            assert!(m["tokens"].as_u64().unwrap() > 0, "{mode}: {r}");
            figures.push((mode, get("mean_abs"), get("max_abs"), get("kl_k3")));
        }
    }
    for &(mode, mean, max, kl) in &figures {
        if mode == "sampled" {
            // The server samples with the native engine and records what it sampled
            // from: the trainer's log-probs match (tests/tests/behaviour_logprobs.rs).
            assert!(max <= 1e-5 && kl < 1e-10, "sampled: mean {mean}, max {max}, k3 {kl}");
        } else {
            // log softmax(z / 0.7) against log softmax(z): clearly not the same
            // (measured: mean 0.24 to 0.27, max 0.78 to 0.83, k3 0.067 to 0.088).
            assert!(mean > 0.05 && max > 0.2 && kl > 0.01, "raw: mean {mean}, max {max}, k3 {kl}");
        }
    }
}
