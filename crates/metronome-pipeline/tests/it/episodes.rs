//! A configured run with `[env]`: the countdown environment is built from the config,
//! runs in the run's engine (feedback turns until the target or a limit), and the
//! run completes with every group trained.

use metronome_pipeline::{PipelineConfig, RunOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_countdown_run_with_feedback_episodes_completes() {
    let out = tempfile::tempdir().unwrap();
    let overrides: Vec<String> = [
        "run.periods=2".to_owned(),
        format!("run.out_dir={:?}", out.path().display().to_string()),
        "run.group_size=2".into(),
        // Short prompts for the tiny model's character tokenizer.
        "data.source={ kind = \"countdown\", format = \"[{numbers}] -> {target}: \" }".into(),
        "data.release.batch_size=3".into(),
        "sft.steps=0".into(),
        "eval.prompts=0".into(),
        "data.prompt.max_tokens=48".into(),
        "rollout.max_seq_len=112".into(),
        "rollout.sampling.max_new_tokens=48".into(),
        "reward.scorer={ kind = \"countdown\" }".into(),
        "env.kind=\"countdown\"".into(),
        "env.max_turns=3".into(),
        "run.cores=1".into(),
    ]
    .to_vec();
    let config = PipelineConfig::embedded(&overrides).unwrap();
    assert!(config.env.is_some());
    let outcome = metronome_pipeline::run(config, RunOptions::default()).await.unwrap();
    assert_eq!(outcome.periods.len(), 2);
    assert!(outcome.periods.iter().all(|p| p.groups == 3 && p.generated_tokens > 0), "{:?}", outcome.periods);
}
