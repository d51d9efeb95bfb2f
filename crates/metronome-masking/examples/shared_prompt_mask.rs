//! Pack one group with the shared-prompt layout and print its attention mask,
//! position ids and loss targets, next to the padded baseline's cost.
//!
//! ```text
//! cargo run -p metronome-masking --example shared_prompt_mask
//! ```

use metronome_core::{AdvantageEstimator, Completion, Group, Prompt, Reward, ScoredGroup};
use metronome_masking::{PackingConfig, attention_mask, pack_period, padded, position_ids, shared_prompt};

fn main() -> anyhow::Result<()> {
    // A prompt of 3 tokens and G = 3 responses of 2, 3 and 1 tokens. Token ids are
    // arbitrary; log-probs must align with tokens (the rollout engine records them).
    let prompt = Prompt { tokens: vec![10, 11, 12], ..Prompt::default() };
    let responses: [&[u32]; 3] = [&[20, 21], &[30, 31, 32], &[40]];
    let completions = responses
        .iter()
        .enumerate()
        .map(|(i, t)| Completion {
            sample_index: i as u32,
            tokens: t.to_vec(),
            logprobs: vec![-1.0; t.len()],
            ..Completion::default()
        })
        .collect();
    let group = Group { prompt, completions, ..Group::default() };
    let rewards = [1.0, 0.0, 0.5].map(Reward::scalar).to_vec();
    let scored = ScoredGroup::new(group, rewards, AdvantageEstimator::GroupNorm)?;

    // One row: the prompt once, then every response as a sibling segment.
    let layout = shared_prompt(&scored)?;
    let row = &layout.batch.rows[0];
    println!("tokens    {:?}", row.tokens);
    // Every response restarts at P = 3, so rotary embeddings equal separate decoding.
    println!("positions {:?}", position_ids(row).to_vec());

    // The dense mask (query down, key across): prompt causal, each response sees the
    // whole prompt and its own past, never another response.
    let mask = attention_mask(row);
    println!("attention mask (1 = may attend):");
    for (q, line) in mask.rows().into_iter().enumerate() {
        let cells: String = line.iter().map(|&ok| if ok { " 1" } else { " ." }).collect();
        println!("  {:>2} {q:>2} |{cells}", row.tokens[q]);
    }
    // Target i is predicted at input position `targets.position[i]`: the last prompt
    // position (2) predicts the first token of every response.
    println!("target positions {:?}", layout.batch.targets.position);
    println!("target tokens    {:?}", layout.batch.targets.token);

    // The baseline lays out G rows of prompt + response, padded to the longest.
    let base = padded(std::slice::from_ref(&scored), 0)?;
    println!(
        "positions: shared-prompt {} vs padded {} (separate rows {}); saving bound {:.1}%",
        layout.account.positions(),
        base.account.positions(),
        layout.account.separate,
        layout.account.bound() * 100.0
    );

    // A period's groups are packed side by side into micro-batches by token budget.
    let micro_batches = pack_period(&[scored.clone(), scored], &PackingConfig::default())?;
    println!("two groups packed into {} micro-batch(es)", micro_batches.len());
    Ok(())
}
