//! A whole run with LoRA on the real stages: warm start, KL reference, checkpoints.

use metronome_core::TensorData;
use metronome_pipeline::{PipelineConfig, RunOptions};

fn config(out: &std::path::Path, name: &str, periods: u64) -> PipelineConfig {
    let overrides: Vec<String> = [
        format!("run.periods={periods}"),
        format!("run.name={name:?}"),
        format!("run.out_dir={:?}", out.display().to_string()),
        "run.group_size=4".into(),
        "run.checkpoint_every=1".into(),
        "data.release.batch_size=4".into(),
        "sft.steps=2".into(),
        "sft.batch_size=4".into(),
        "eval.prompts=0".into(),
        "rollout.sampling.max_new_tokens=6".into(),
        "run.cores=1".into(),
        "trainer.schedule.lr=0.01".into(),
        "trainer.loss.kl_coef=0.05".into(),
        "trainer.lora={ rank = 4, alpha = 8.0 }".into(),
        // A reward that varies for a barely trained model: any digit in the answer.
        "reward.scorer={ kind = \"format\", pattern = \"[0-9]\" }".into(),
    ]
    .to_vec();
    PipelineConfig::embedded(&overrides).unwrap()
}

fn flat(w: &metronome_core::WeightSnapshot) -> Vec<f32> {
    w.tensors
        .iter()
        .flat_map(|t| match &t.data {
            TensorData::F32(v) => v.clone(),
            _ => panic!("f32 weights"),
        })
        .collect()
}

/// A LoRA run (a warm start of its own adapters, merged; then fresh adapters with a
/// KL term against the warm-started model) that is stopped after one period and
/// resumed ends with the weights of the run that was never stopped, and its
/// checkpoints hold a PEFT adapter beside the base.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_run_resumes_to_the_weights_of_an_uninterrupted_one() {
    let out = tempfile::tempdir().unwrap();
    let run = |name: &str, periods| {
        metronome_pipeline::run(config(out.path(), name, periods), RunOptions::default())
    };
    let whole = run("whole", 2).await.unwrap();
    assert!(whole.periods.iter().any(|p| p.step.tokens > 0), "nothing trained");
    // Period 0 trains the adapters from B = 0 (KL exactly 0 against the base); period
    // 1's policy has moved away from the reference.
    let kl: Vec<f64> = whole.periods.iter().map(|p| p.step.kl).collect();
    assert!(kl[0] == 0.0 && kl[1] > 0.0, "{kl:?}");
    let (first, last) = whole.sft_loss.unwrap();
    assert!(first.is_finite() && last.is_finite());
    run("parts", 1).await.unwrap();
    let parts = run("parts", 2).await.unwrap();
    assert_eq!(parts.periods.len(), 2);
    let (a, b) = (flat(&whole.weights), flat(&parts.weights));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "resumed weights differ");
    let checkpoint = walk_find(out.path(), "adapter_config.json").expect("a checkpoint holds the adapter");
    let peft: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(checkpoint).unwrap()).unwrap();
    assert_eq!((peft["peft_type"].as_str(), peft["r"].as_u64()), (Some("LORA"), Some(4)));
}

fn walk_find(dir: &std::path::Path, file: &str) -> Option<std::path::PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = walk_find(&path, file) {
                return Some(found);
            }
        } else if path.file_name().is_some_and(|n| n == file) {
            return Some(path);
        }
    }
    None
}
