//! Multi-turn trajectories: observation tokens lie in the rows as context and are
//! never loss targets; the shared-prompt layout still shares the prompt.

use metronome_core::{EpisodeTrace, TokenSpan};
use metronome_masking::{LayoutKind, MaskingError, PackingConfig, pack_period, padded, shared_prompt};
use proptest::prelude::*;

use crate::common::{PAD, behaviour_logprob, group};

/// Group 1: a prompt of 3 tokens and responses of `lens`, response `i` with the
/// observation spans `spans[i]`.
fn episode_group(lens: &[usize], spans: &[Vec<(u32, u32)>]) -> metronome_core::ScoredGroup {
    let mut g = group(1, 3, lens);
    for (c, s) in g.group.completions.iter_mut().zip(spans) {
        if s.is_empty() {
            continue;
        }
        c.episode = Some(EpisodeTrace {
            observations: s.iter().map(|&(start, len)| TokenSpan { start, len }).collect(),
            turns: s.len() as u32 + 1,
            ..EpisodeTrace::default()
        });
        for &(start, len) in s {
            for j in start..start + len {
                c.logprobs[j as usize] = 0.0;
            }
        }
    }
    g
}

#[test]
fn observation_tokens_are_context_but_never_targets() {
    // Response 0: 6 tokens, tokens 2..4 an observation; response 1: 4 tokens, plain.
    let g = episode_group(&[6, 4], &[vec![(2, 2)], vec![]]);
    let layout = shared_prompt(&g).unwrap();
    let row = &layout.batch.rows[0];
    // The prompt once, then both trajectories whole (observations included).
    assert_eq!(row.len(), 3 + 6 + 4);
    assert_eq!(&row.tokens[3..9], g.group.completions[0].tokens.as_slice());
    let t = &layout.batch.targets;
    let c0 = &g.group.completions[0].tokens;
    // Response 0's targets skip its tokens 2 and 3; each target is predicted by the
    // position before its token (the last prompt position for the first).
    assert_eq!(&t.token[..4], &[c0[0], c0[1], c0[4], c0[5]]);
    assert_eq!(&t.position[..4], &[2, 3, 6, 7]);
    assert_eq!(layout.batch.sequences[0].num_targets, 4);
    assert_eq!(layout.batch.sequences[1].num_targets, 4);
    assert_eq!(t.len(), 8);
    layout.batch.validate().unwrap();
    // The input-aligned loss mask is 0 on the prompt and on the observation.
    let mask = &layout.loss_mask()[0];
    assert_eq!(mask.to_vec(), [0., 0., 0., 1., 1., 0., 0., 1., 1., 1., 1., 1., 1.]);
    // Positions 4 and 5 would predict the observation: they predict nothing. Position
    // 6, the observation's last token, predicts the policy token after it.
    let w = &layout.prediction_weights()[0];
    assert_eq!(w.to_vec(), [0., 0., 2., 1., 0., 0., 1., 1., 0., 1., 1., 1., 0.]);
    // Still shared: one prompt copy for the group.
    assert_eq!(layout.account.prompt_copies, 1);
}

#[test]
fn observation_log_probs_never_reach_the_batch() {
    let g = episode_group(&[7, 5], &[vec![(1, 2), (5, 1)], vec![(2, 2)]]);
    let mut perturbed = g.clone();
    for c in &mut perturbed.group.completions {
        let mask = c.policy_mask();
        for (lp, policy) in c.logprobs.iter_mut().zip(mask) {
            if !policy {
                *lp = -123.0;
            }
        }
    }
    for kind in [LayoutKind::SharedPrompt, LayoutKind::Padded] {
        let build = |g: &metronome_core::ScoredGroup| match kind {
            LayoutKind::SharedPrompt => shared_prompt(g).unwrap(),
            LayoutKind::Padded => padded(std::slice::from_ref(g), PAD).unwrap(),
        };
        let (a, b) = (build(&g), build(&perturbed));
        assert_eq!(a.batch, b.batch, "{kind:?}");
        assert!(!a.batch.targets.behaviour_logprob.contains(&-123.0));
    }
}

#[test]
fn a_trajectory_of_observations_only_or_a_bad_span_is_refused() {
    let g = episode_group(&[3], &[vec![(0, 3)]]);
    let err = shared_prompt(&g).unwrap_err();
    assert!(matches!(err, MaskingError::Episode { sample: 0, .. }), "{err}");
    assert!(err.to_string().contains("only observation tokens"), "{err}");
    let g = episode_group(&[4, 4], &[vec![], vec![(3, 1)]]);
    let mut bad = g.clone();
    bad.group.completions[1].episode.as_mut().unwrap().observations[0].len = 5;
    let err = shared_prompt(&bad).unwrap_err().to_string();
    assert!(err.contains("completion 1 has observation span 0 over tokens 3..8"), "{err}");
    // A span whose end overflows is past the tokens, not wrapped into them.
    bad.group.completions[1].episode.as_mut().unwrap().observations[0] =
        TokenSpan { start: u32::MAX, len: 2 };
    let err = shared_prompt(&bad).unwrap_err().to_string();
    assert!(err.contains("observation span 0"), "{err}");
}

proptest! {
    /// Whatever the spans and the packing, the targets are exactly the policy tokens
    /// of every response, in order, each with its own behaviour log-prob.
    #[test]
    fn targets_are_exactly_the_policy_tokens(
        lens in prop::collection::vec(2usize..12, 1..5),
        cuts in prop::collection::vec((1u32..12, 0u32..4), 0..8),
        padded_layout in any::<bool>(),
    ) {
        let spans: Vec<Vec<(u32, u32)>> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                // Spans from the cuts of response i, disjoint, never covering token 0.
                let mut next = 1;
                let mut s = Vec::new();
                for &(start, len) in cuts.iter().skip(i).step_by(lens.len()) {
                    let start = start.max(next);
                    let len = len.min((l as u32).saturating_sub(start));
                    if len > 0 {
                        s.push((start, len));
                        next = start + len;
                    }
                }
                s
            })
            .collect();
        let g = episode_group(&lens, &spans);
        let expected: Vec<u32> = g
            .group
            .completions
            .iter()
            .flat_map(|c| c.tokens.iter().zip(c.policy_mask()).filter(|(_, p)| *p).map(|(&t, _)| t).collect::<Vec<_>>())
            .collect();
        let layout = if padded_layout { LayoutKind::Padded } else { LayoutKind::SharedPrompt };
        let config = PackingConfig { layout, ..PackingConfig::default() };
        let layouts = pack_period(std::slice::from_ref(&g), &config).unwrap();
        let got: Vec<u32> = layouts.iter().flat_map(|l| l.batch.targets.token.clone()).collect();
        prop_assert_eq!(got, expected);
        for l in &layouts {
            l.batch.validate().unwrap();
            let t = &l.batch.targets;
            for i in 0..t.len() {
                prop_assert_eq!(t.behaviour_logprob[i], behaviour_logprob(t.token[i]));
            }
        }
    }
}
