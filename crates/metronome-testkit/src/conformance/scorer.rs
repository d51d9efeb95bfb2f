//! The contract of [`GroupScorer`]: the group comes back as it went in, with one
//! reward and one finite advantage per completion in completion order; a group whose
//! responses are all the same is scored all-equal, with zero advantages.

use metronome_core::{Completion, Group, GroupScorer, ScoredGroup};

use super::{expect, patiently};

const SUITE: &str = "group scorer";

/// Runs every check on `group`: a group with at least two completions of the kind
/// the scorer is for (the prompt's reference, the responses' format).
pub async fn run_all(scorer: &dyn GroupScorer, group: Group) {
    one_reward_and_advantage_per_completion(scorer, group.clone()).await;
    an_all_equal_group_has_zero_advantages(scorer, group).await;
}

async fn score(scorer: &dyn GroupScorer, group: Group) -> ScoredGroup {
    expect(SUITE, "score", patiently(SUITE, "score", scorer.score(group)).await)
}

/// The scored group holds `group` unchanged, one reward and one finite advantage per
/// completion, and statistics of those rewards.
pub async fn one_reward_and_advantage_per_completion(scorer: &dyn GroupScorer, group: Group) {
    let n = group.completions.len();
    let scored = score(scorer, group.clone()).await;
    assert_eq!(scored.group, group, "{SUITE} conformance: the group changed while it was scored");
    assert_eq!(
        scored.rewards.len(),
        n,
        "{SUITE} conformance: {} rewards for {n} completions",
        scored.rewards.len()
    );
    assert_eq!(
        scored.advantages.len(),
        n,
        "{SUITE} conformance: {} advantages for {n} completions",
        scored.advantages.len()
    );
    assert!(
        scored.advantages.iter().all(|a| a.is_finite()),
        "{SUITE} conformance: non-finite advantages {:?}",
        scored.advantages
    );
    let mean = scored.rewards.iter().map(|r| r.total).sum::<f32>() / n.max(1) as f32;
    assert!(
        (scored.stats.mean - mean).abs() <= 1e-5 * mean.abs().max(1.0),
        "{SUITE} conformance: the statistics' mean {} is not the rewards' {mean}",
        scored.stats.mean
    );
}

/// Every completion replaced by a copy of the first (renumbered): equal responses
/// score equally, so the group is all-equal and carries no signal.
pub async fn an_all_equal_group_has_zero_advantages(scorer: &dyn GroupScorer, mut group: Group) {
    let first = group.completions.first().cloned().unwrap_or_else(|| {
        panic!("{SUITE} conformance: the sample group has no completions");
    });
    group.completions = (0..group.completions.len().max(2) as u32)
        .map(|sample_index| Completion { sample_index, ..first.clone() })
        .collect();
    let scored = score(scorer, group).await;
    assert!(scored.stats.all_equal, "{SUITE} conformance: equal responses scored {:?}", scored.rewards);
    assert!(
        scored.advantages.iter().all(|&a| a == 0.0),
        "{SUITE} conformance: an all-equal group has advantages {:?}",
        scored.advantages
    );
}
