//! Configured runs with `[env]`: the countdown preset's environment is built from the
//! config, runs in the run's engine (feedback turns until the target or a limit), and
//! the run completes with every group trained; a warm start on the calculator's
//! demonstrations teaches the policy to call it.

use metronome_pipeline::{PipelineConfig, RunOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_countdown_feedback_preset_runs_episodes_and_trains_every_group() {
    let out = tempfile::tempdir().unwrap();
    let overrides: Vec<String> = [
        "run.periods=2".to_owned(),
        format!("run.out_dir={:?}", out.path().display().to_string()),
        "run.group_size=2".into(),
        "data.release.batch_size=3".into(),
        "eval.prompts=0".into(),
        "run.cores=1".into(),
    ]
    .to_vec();
    let preset = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/countdown_feedback.toml");
    let config = PipelineConfig::load(&preset, &overrides).unwrap();
    assert_eq!(config.env.as_ref().map(|e| e.kind), Some(metronome_reward::EnvKind::Countdown));
    let outcome = metronome_pipeline::run(config, RunOptions::default()).await.unwrap();
    assert_eq!(outcome.periods.len(), 2);
    assert!(outcome.periods.iter().all(|p| p.groups == 3 && p.generated_tokens > 0), "{:?}", outcome.periods);
}

/// Held-out tool use (greedy) after a short warm start in which `shown` of the
/// prompts were solved with the calculator.
async fn tool_use_after_warm_start(shown: f64) -> f64 {
    let out = tempfile::tempdir().unwrap();
    let overrides: Vec<String> = [
        "run.periods=1".to_owned(),
        format!("run.out_dir={:?}", out.path().display().to_string()),
        "run.group_size=2".into(),
        "data.release.batch_size=4".into(),
        "sft.steps=150".into(),
        format!("sft.tool_demonstrations={shown}"),
        "eval.prompts=32".into(),
        "eval.temperature=0.0".into(),
        "eval.samples=1".into(),
        "env.kind=\"calculator\"".into(),
        "env.format=\"tag\"".into(),
        "env.max_turns=3".into(),
        "rollout.max_seq_len=96".into(),
        "rollout.sampling.max_new_tokens=64".into(),
        "run.cores=1".into(),
    ]
    .to_vec();
    let config = PipelineConfig::embedded(&overrides).unwrap();
    let outcome = metronome_pipeline::run(config, RunOptions::default()).await.unwrap();
    let before_rl = outcome.evals.first().unwrap();
    assert_eq!(before_rl.after_periods, 0);
    before_rl.tool_use.expect("episodes report their tool use")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_start_on_tool_demonstrations_teaches_the_policy_to_call_the_tool() {
    // Shown the calculator on every prompt, the policy calls it on held-out prompts;
    // never shown it, never.
    let always = tool_use_after_warm_start(1.0).await;
    assert!(always >= 0.9, "tool use {always} after demonstrations on every prompt");
    assert_eq!(tool_use_after_warm_start(0.0).await, 0.0);
}
