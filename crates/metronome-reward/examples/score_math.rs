//! Score completions of a math prompt with the answer verifier and a composite reward,
//! then turn a group's rewards into GRPO advantages.
//!
//! ```text
//! cargo run -p metronome-reward --example score_math
//! ```

use metronome_core::{Completion, Group, Prompt, RewardFn};
use metronome_reward::{Composite, FormatReward, MathVerifier, Meter, PoolConfig, PoolScorer};

fn main() -> anyhow::Result<()> {
    // The data loader fills `reference` from the dataset; the verifier compares the
    // completion's final answer against it.
    let prompt =
        Prompt { reference: Some("3/4".into()), text: "What is 0.5 + 1/4?".into(), ..Prompt::default() };
    let texts = [
        "<think>1/2 + 1/4 = 3/4</think><answer>3/4</answer>", // right, well formatted
        "The sum is \\boxed{0.75}",                           // right (numeric equality), no format
        "<think>guess</think><answer>1</answer>",             // wrong, well formatted
        "I am not sure.",                                     // no answer at all
    ];
    let completions: Vec<Completion> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| Completion { sample_index: i as u32, text: (*t).into(), ..Completion::default() })
        .collect();

    // The verifier alone: final-answer extraction (`\boxed{}`, `<answer>`, last number),
    // normalisation, and exact rational comparison.
    let verifier = MathVerifier::new();
    for c in &completions {
        let verdict = verifier.verify(&c.text, "3/4", &mut Meter::default());
        println!("verdict {:<9} {}", format!("{verdict:?}"), c.text);
    }

    // A composite: 1.0 × correctness + 0.1 × the `<think>…</think><answer>…</answer>`
    // format. Every scorer is a `metronome_core::RewardFn` (closures are too), and each
    // part is reported by name for metrics.
    let reward = Composite::of("correct", 1.0, MathVerifier::new())?
        .with("format", 0.1, FormatReward::think_answer())?
        // A closure is a reward function too: a small penalty for long answers.
        .with("brevity", 0.01, |_: &Prompt, c: &Completion| -(c.text.len() as f32 / 100.0))?;
    for c in &completions {
        let r = reward.score(&prompt, c);
        println!("reward {:+.3} parts {:?}", r.total, r.parts);
    }

    // The pipeline scores whole groups on a worker pool with a time limit and panic
    // isolation; a scorer that fails yields the failure score, never an error.
    let scorer = PoolScorer::new(reward, PoolConfig { workers: 2, ..PoolConfig::default() })?;
    let scored = scorer.score_blocking(Group { prompt, completions, ..Group::default() })?;
    println!(
        "group mean {:.3} std {:.3}; advantages {:?}",
        scored.stats.mean,
        scored.stats.std,
        scored.advantages.iter().map(|a| (a * 1000.0).round() / 1000.0).collect::<Vec<_>>()
    );
    Ok(())
}
