//! The trainer on layouts built by `metronome-masking`: the shared-prompt tree gives
//! the gradient of separate padded rows, and packed, split micro-batches are counted
//! once per group.

use metronome_core::{
    AdvantageEstimator, Completion, Group, PeriodId, PolicyVersion, Prompt, PromptId, Reward, ScoredGroup,
};
use metronome_masking::{LayoutKind, PackingConfig, pack_period, padded, shared_prompt};
use metronome_trainer::loss::Aggregation;

use crate::common::{config, max_abs_diff, pending_gradients, tiny_model};

fn scored_groups() -> Vec<ScoredGroup> {
    (0..3u32)
        .map(|g| {
            let prompt = Prompt {
                id: PromptId(u64::from(g)),
                tokens: (0..6 + g).map(|i| 3 + (i * 7 + g * 11) % 90).collect(),
                ..Prompt::default()
            };
            let completions = (0..4u32)
                .map(|r| {
                    let tokens: Vec<u32> =
                        (0..2 + (r + g) % 4).map(|j| 3 + (j * 13 + r * 5 + g * 17) % 90).collect();
                    Completion {
                        sample_index: r,
                        logprobs: vec![-4.0; tokens.len()],
                        tokens,
                        version: PolicyVersion(0),
                        ..Completion::default()
                    }
                })
                .collect();
            let group = Group { period: PeriodId(0), prompt, completions, ..Group::default() };
            let rewards = [1.0, 0.0, 0.5, 0.0].iter().map(|&r| Reward::scalar(r + g as f32 * 0.1)).collect();
            ScoredGroup::new(group, rewards, AdvantageEstimator::GroupNorm).unwrap()
        })
        .collect()
}

#[test]
fn shared_prompt_gradient_equals_padded_rows_gradient() {
    let groups = scored_groups();
    let mut cfg = config();
    cfg.loss.aggregation = Aggregation::SeqMeanTokenMean;
    cfg.loss.kl_coef = 0.1;
    let mut shared = cfg.build(tiny_model()).unwrap();
    for g in &groups {
        shared.accumulate_sync(&shared_prompt(g).unwrap().batch).unwrap();
    }
    let mut pad = cfg.build(tiny_model()).unwrap();
    let layout = padded(&groups, 0).unwrap();
    pad.accumulate_sync(&layout.batch).unwrap();
    let (a, b) = (pending_gradients(&shared), pending_gradients(&pad));
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = max_abs_diff(&a, &b);
    assert!(scale > 0.0 && diff <= 1e-4 * scale, "gradients differ by {diff} (largest {scale})");
    let (ra, rb) = (shared.step_sync().unwrap(), pad.step_sync().unwrap());
    assert_eq!((ra.tokens, ra.sequences, ra.groups), (rb.tokens, rb.sequences, rb.groups));
    assert!((ra.loss - rb.loss).abs() < 1e-5, "{} vs {}", ra.loss, rb.loss);
}

#[test]
fn packed_and_split_micro_batches_count_each_group_once() {
    let groups = scored_groups();
    let packing = PackingConfig {
        layout: LayoutKind::SharedPrompt,
        row_tokens: 16,
        micro_batch_tokens: 16,
        split_oversized_groups: true,
        pad_token: 0,
        groups_per_pack: 1,
    };
    let layouts = pack_period(&groups, &packing).unwrap();
    assert!(layouts.len() > groups.len(), "the budget must split some group");
    let mut t = config().build(tiny_model()).unwrap();
    for l in layouts.iter().rev() {
        t.accumulate_sync(&l.batch).unwrap();
    }
    let r = t.step_sync().unwrap();
    assert!(r.applied);
    assert_eq!(r.groups, 3);
    assert_eq!(r.sequences, 12);
    let tokens: usize = groups.iter().flat_map(|g| &g.group.completions).map(|c| c.tokens.len()).sum();
    assert_eq!(r.tokens, tokens as u64);
}

/// Multi-turn trajectories: observation tokens are context but carry no loss term.
/// The shared-prompt and padded layouts give the same gradient, the step counts only
/// policy tokens, and the observations' recorded log-probs change nothing; treating
/// the observations as policy tokens would change the gradient.
#[test]
fn observation_tokens_carry_no_gradient() {
    use metronome_core::{EpisodeTrace, TokenSpan};
    let plain = scored_groups();
    let mut episodes = plain.clone();
    for g in &mut episodes {
        for c in &mut g.group.completions {
            if c.tokens.len() >= 3 {
                c.episode = Some(EpisodeTrace {
                    observations: vec![TokenSpan { start: 1, len: 1 }],
                    turns: 2,
                    ..EpisodeTrace::default()
                });
                c.logprobs[1] = 0.0;
            }
        }
    }
    let policy_tokens: usize =
        episodes.iter().flat_map(|g| &g.group.completions).map(Completion::num_policy_tokens).sum();
    let all_tokens: usize = episodes.iter().flat_map(|g| &g.group.completions).map(|c| c.tokens.len()).sum();
    assert!(policy_tokens < all_tokens);
    let gradient = |groups: &[ScoredGroup], layout: LayoutKind| {
        let mut t = config().build(tiny_model()).unwrap();
        match layout {
            LayoutKind::SharedPrompt => {
                for g in groups {
                    t.accumulate_sync(&shared_prompt(g).unwrap().batch).unwrap();
                }
            }
            LayoutKind::Padded => {
                t.accumulate_sync(&padded(groups, 0).unwrap().batch).unwrap();
            }
        }
        let grads = pending_gradients(&t);
        (grads, t.step_sync().unwrap())
    };
    let (shared, report) = gradient(&episodes, LayoutKind::SharedPrompt);
    assert_eq!(report.tokens as usize, policy_tokens);
    let (pad, _) = gradient(&episodes, LayoutKind::Padded);
    let scale = shared.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.0 && max_abs_diff(&shared, &pad) <= 1e-4 * scale);
    // The observations' log-probs are never read.
    let mut perturbed = episodes.clone();
    for c in perturbed.iter_mut().flat_map(|g| &mut g.group.completions) {
        if c.episode.is_some() {
            c.logprobs[1] = -50.0;
        }
    }
    let (again, _) = gradient(&perturbed, LayoutKind::SharedPrompt);
    assert_eq!(shared, again);
    // Without the mask the same tokens give another gradient.
    let (unmasked, r) = gradient(&plain, LayoutKind::SharedPrompt);
    assert_eq!(r.tokens as usize, all_tokens);
    assert!(max_abs_diff(&shared, &unmasked) > 1e-3 * scale);
}
