//! Code tasks end to end: every task the data loader makes (the generator, HumanEval,
//! MBPP) passes in the sandbox with its own solution and fails with a wrong one; the
//! `configs/code.toml` preset trains with rewards from real sandboxed programs; and a
//! judge that cannot be reached costs its groups under the `drop` policy, never the
//! period.

use std::path::PathBuf;
use std::sync::Arc;

use metronome_core::{Completion, Group, GroupScorer, PromptSource, RunSeed};
use metronome_dataloader::{LoaderConfig, ReleaseConfig, SourceConfig};
use metronome_model::CharTokenizer;
use metronome_pipeline::{PipelineConfig, RunOptions};
use metronome_reward::{CodeConfig, Extract, PoolConfig, PoolScorer, SandboxConfig};

fn dataloader_data(name: &str) -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../metronome-dataloader/tests/data").join(name);
    path.display().to_string()
}

/// A wrong answer in the shape each source expects.
fn wrong(metadata_task_id: Option<&String>) -> &'static str {
    match metadata_task_id {
        Some(id) if id.starts_with("HumanEval") => "    return None\n",
        _ => "def f(*args):\n    return None\n",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_loaded_code_task_passes_with_its_solution_and_fails_without() {
    let code = CodeConfig {
        extract: Extract::Whole,
        time_budget_ms: 3_000,
        sandbox: SandboxConfig { wall_ms: 3_000, ..SandboxConfig::default() },
        ..CodeConfig::default()
    }
    .build()
    .expect("the sandbox starts on this machine");
    let scorer = Arc::new(PoolScorer::new(code, PoolConfig { workers: 4, ..PoolConfig::default() }).unwrap());
    let sources = [
        ("kind = \"code\"\nsize = 48\n".to_owned(), 48),
        (format!("kind = \"humaneval\"\npath = {:?}\n", dataloader_data("humaneval_sample.jsonl")), 6),
        (format!("kind = \"mbpp\"\npath = {:?}\n", dataloader_data("mbpp_sample.jsonl")), 4),
    ];
    for (source, len) in sources {
        let source: SourceConfig = toml::from_str(&source).unwrap();
        let release =
            ReleaseConfig { batch_size: len, epochs: Some(1), shuffle: false, ..ReleaseConfig::default() };
        let config = LoaderConfig { source, release, ..LoaderConfig::default() };
        let mut loader = config.build(RunSeed(4), Arc::new(CharTokenizer)).unwrap();
        let batch = loader.next_batch().await.unwrap().unwrap();
        assert_eq!(batch.prompts.len(), len);
        for prompt in batch.prompts {
            let solution = prompt.metadata["solution"].clone();
            let wrong = wrong(prompt.metadata.get("task_id")).to_owned();
            let completions = [solution, wrong]
                .into_iter()
                .enumerate()
                .map(|(i, text)| Completion { sample_index: i as u32, text, ..Completion::default() })
                .collect();
            let place = format!("{:?} ({})", prompt.metadata.get("task_id"), prompt.text);
            let scored = scorer.score(Group { prompt, completions, ..Group::default() }).await.unwrap();
            let correct: Vec<f32> = scored.rewards.iter().map(|r| r.parts["correct"]).collect();
            assert_eq!(correct, [1.0, 0.0], "{place}: {:?}", scored.rewards);
        }
    }
}

fn preset(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs").join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_code_preset_trains_on_rewards_from_sandboxed_programs() {
    let out = tempfile::tempdir().unwrap();
    let overrides = [
        "run.periods=2".to_owned(),
        format!("run.out_dir={:?}", out.path().display().to_string()),
        "run.group_size=4".into(),
        "data.release.batch_size=4".into(),
        "eval.prompts=0".into(),
        "run.cores=1".into(),
        "rollout.sampling.max_new_tokens=32".into(),
    ];
    let config = PipelineConfig::load(&preset("code.toml"), &overrides).unwrap();
    assert!(matches!(config.data.source, SourceConfig::Code(_)));
    let outcome = metronome_pipeline::run(config, RunOptions::default()).await.unwrap();
    assert_eq!(outcome.periods.len(), 2);
    for p in &outcome.periods {
        assert_eq!((p.groups, p.rejected), (4, 0), "{p:?}");
        // The `correct` part comes only from the code reward's verdicts.
        assert!(p.accuracy.is_some(), "{p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_judge_drops_its_groups_and_the_periods_complete() {
    let out = tempfile::tempdir().unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let overrides = [
        "run.periods=2".to_owned(),
        format!("run.out_dir={:?}", out.path().display().to_string()),
        "run.group_size=2".into(),
        "data.release.batch_size=3".into(),
        "sft.steps=0".into(),
        "eval.prompts=0".into(),
        "run.cores=1".into(),
        format!(
            "reward={{kind = \"judge\", url = \"http://{closed}\", model = \"judge\", probe = false, \
             on_failure = \"drop\", max_retries = 1, backoff_initial_ms = 1, backoff_max_ms = 2}}"
        ),
    ];
    let config = PipelineConfig::embedded(&overrides).unwrap();
    let outcome = metronome_pipeline::run(config, RunOptions::default()).await.unwrap();
    assert_eq!(outcome.periods.len(), 2);
    for p in &outcome.periods {
        assert_eq!((p.groups, p.rejected), (0, 3), "{p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reward_that_cannot_start_fails_the_run_before_the_warm_start() {
    let out = tempfile::tempdir().unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let overrides = [
        format!("run.out_dir={:?}", out.path().display().to_string()),
        "sft.steps=5".into(),
        format!("reward={{kind = \"judge\", url = \"http://{closed}\", model = \"judge\"}}"),
    ];
    let config = PipelineConfig::embedded(&overrides).unwrap();
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = Arc::clone(&events);
    let observer = metronome_pipeline::Observer::new(move |e| sink.lock().unwrap().push(format!("{e:?}")));
    let e =
        metronome_pipeline::run(config, RunOptions { observer, ..RunOptions::default() }).await.unwrap_err();
    let e = metronome_core::ErrorChain(&e).to_string();
    assert!(e.contains(&format!("judge at http://{closed} did not answer GET /v1/models")), "{e}");
    let events = events.lock().unwrap();
    assert!(!events.iter().any(|e| e.contains("WarmStart")), "the warm start ran first: {events:?}");
}
