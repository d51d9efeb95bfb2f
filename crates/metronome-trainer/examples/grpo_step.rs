//! Take GRPO trainer steps on one hand-made group and watch the log-probs move in the
//! direction of each response's advantage.
//!
//! ```text
//! cargo run -p metronome-trainer --example grpo_step
//! ```
//! In a run, `metronome-masking` packs scored groups into the [`TrainBatch`] made
//! below with the test kit's `BatchBuilder`, and `metronome-pipeline` drives the trainer through the async
//! `metronome_core::Trainer` trait; the synchronous methods used here are the same code.

use metronome_core::{PolicyVersion, TrainBatch};
use metronome_model::{Device, Model, ModelConfig};
use metronome_testkit::BatchBuilder;
use metronome_trainer::{GrpoTrainer, TrainerConfig, schedule::LrSchedule};

/// One group in the shared-prompt layout: the prompt once (positions `0..P`), then
/// each response as a child segment whose positions restart at `P`. Target `j` of a
/// response is predicted at the position before it; the last prompt position predicts
/// every response's first token. The behaviour log-probs are what the rollout engine
/// recorded; with one step per period the trainer uses its own stop-gradient
/// log-probs as the old policy instead.
fn group_batch(
    prompt: &[u32],
    responses: &[&[u32]],
    advantages: &[f32],
    version: PolicyVersion,
) -> TrainBatch {
    BatchBuilder::new().version(version).shared_prompt(0, prompt, responses, advantages).build()
}

/// Summed log-probability of each response under `model`.
fn response_logprobs(model: &Model, batch: &TrainBatch) -> anyhow::Result<Vec<f64>> {
    let lp: Vec<f32> = model.target_logprobs(&batch.rows, &batch.targets)?.logprobs.detach().to_vec1()?;
    let mut sums = vec![0.0; batch.sequences.len()];
    for (l, &s) in lp.iter().zip(&batch.targets.sequence) {
        sums[s as usize] += f64::from(*l);
    }
    Ok(sums)
}

fn main() -> anyhow::Result<()> {
    // The tiny built-in network (2 layers, d = 128, a 99-token vocabulary).
    let policy = Model::new(ModelConfig::tiny(), &Device::Cpu, 3)?;
    let config = TrainerConfig {
        schedule: LrSchedule { lr: 1e-3, ..LrSchedule::default() },
        ..TrainerConfig::default()
    };
    let mut trainer = GrpoTrainer::new(config, policy)?;

    // Four responses; rewards 1, 0, 1, 0 normalised within the group give ±1.
    let (prompt, responses): (&[u32], &[&[u32]]) =
        (&[20, 21, 22, 23], &[&[30, 31, 32], &[40, 41, 42], &[50, 51], &[60, 61]]);
    let advantages = [1.0, -1.0, 1.0, -1.0];
    let batch = group_batch(prompt, responses, &advantages, trainer.version());
    let before = response_logprobs(trainer.policy(), &batch)?;

    for _ in 0..3 {
        // Accumulate gradients from any number of micro-batches (in any order), then
        // take exactly one optimiser step: the period boundary.
        // Every sample carries the policy version that generated it; on-policy
        // training needs it to equal the trainer's (stale samples need `loss.tis_cap`).
        let batch = group_batch(prompt, responses, &advantages, trainer.version());
        let acc = trainer.accumulate_sync(&batch)?;
        // The loss prints as ~0: at ratio 1 the surrogate is minus the mean advantage,
        // zero for a group-normalised group, while its gradient is not.
        let step = trainer.step_sync()?;
        println!(
            "step -> v{}: {} tokens, loss {:+.4}, grad norm {:.3}, entropy {:.3}, lr {:.0e} (accumulated {} tokens)",
            step.version,
            step.tokens,
            step.loss,
            step.grad_norm,
            step.entropy,
            step.learning_rate,
            acc.tokens
        );
    }

    let after = response_logprobs(trainer.policy(), &batch)?;
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        println!("response {i}: advantage {:+.0}, log-prob {b:.3} -> {a:.3}", batch.sequences[i].advantage);
    }
    let moved_right = (0..4).all(|i| (after[i] > before[i]) == (batch.sequences[i].advantage > 0.0));
    println!("every log-prob moved with its advantage: {moved_right}");
    anyhow::ensure!(moved_right, "GRPO should raise positive-advantage responses and lower the others");
    // `trainer.save_checkpoint(dir)` writes HF safetensors plus optimiser state;
    // `trainer.snapshot_sync()` gives the weights to publish to rollout workers.
    Ok(())
}
