use metronome_core::{AdvantageEstimator, GroupStats};

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

#[test]
fn closed_forms() {
    let r = [1.0, 0.0, 0.0, 1.0];
    // mean 0.5, population std 0.5.
    close(&AdvantageEstimator::GroupNorm.advantages(&r), &[1.0, -1.0, -1.0, 1.0]);
    close(&AdvantageEstimator::GroupMean.advantages(&r), &[0.5, -0.5, -0.5, 0.5]);
    // Leave-one-out: 1 - (0+0+1)/3 = 2/3; 0 - (1+0+1)/3 = -2/3.
    close(&AdvantageEstimator::LeaveOneOut.advantages(&r), &[2.0 / 3.0, -2.0 / 3.0, -2.0 / 3.0, 2.0 / 3.0]);
    // REINFORCE++-baseline: the group part is the mean baseline (the trainer divides
    // by the batch's standard deviation).
    close(&AdvantageEstimator::ReinforcePlusPlusBaseline.advantages(&r), &[0.5, -0.5, -0.5, 0.5]);
}

#[test]
fn all_equal_groups_are_exact_zero() {
    for estimator in [
        AdvantageEstimator::GroupNorm,
        AdvantageEstimator::GroupMean,
        AdvantageEstimator::LeaveOneOut,
        AdvantageEstimator::ReinforcePlusPlusBaseline,
    ] {
        assert_eq!(estimator.advantages(&[0.7; 5]), vec![0.0; 5]);
        assert_eq!(estimator.advantages(&[3.0]), vec![0.0]);
    }
    let stats = GroupStats::of(&[2.0, 2.0]);
    assert!(stats.all_equal);
    assert_eq!(stats.std, 0.0);
    assert!(!GroupStats::of(&[2.0, 2.5]).all_equal);
}

#[test]
fn group_norm_advantages_have_zero_mean_unit_std() {
    let r = [0.3, 1.7, -2.0, 0.0, 5.5, 1.0];
    let a = AdvantageEstimator::GroupNorm.advantages(&r);
    let stats = GroupStats::of(&a);
    assert!(stats.mean.abs() < 1e-5);
    assert!((stats.std - 1.0).abs() < 1e-4);
}

#[test]
fn a_received_group_gets_the_trainers_advantages_and_bad_rewards_are_refused() {
    use metronome_core::{Completion, Group, PeriodId, Prompt, PromptId, Reward, ScoredGroup};
    let group = Group {
        period: PeriodId(1),
        prompt: Prompt { id: PromptId(4), ..Prompt::default() },
        completions: (0..4).map(|i| Completion { sample_index: i, ..Completion::default() }).collect(),
        ..Group::default()
    };
    let rewards: Vec<Reward> = [1.0, 0.0, 0.0, 1.0].map(Reward::scalar).to_vec();
    let honest = ScoredGroup::new(group.clone(), rewards.clone(), AdvantageEstimator::GroupNorm).unwrap();
    // A worker claims huge advantages for the same rewards.
    let mut forged = honest.clone();
    forged.advantages = vec![100.0, -100.0, 100.0, 100.0];
    forged.stats.all_equal = true;
    forged.recompute(AdvantageEstimator::GroupNorm).unwrap();
    assert_eq!(forged, honest);

    let mut nan = honest.clone();
    nan.rewards[2].total = f32::NAN;
    let err = nan.recompute(AdvantageEstimator::GroupNorm).unwrap_err().to_string();
    assert!(err.contains("group (period 1, prompt 4), reward 2") && err.contains("NaN"), "{err}");
    let mut short = honest;
    short.rewards.pop();
    assert!(
        short.recompute(AdvantageEstimator::GroupNorm).unwrap_err().to_string().contains("3 rewards for 4")
    );
}
