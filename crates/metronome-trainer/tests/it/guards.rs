//! Guards, zero-advantage groups, stale samples and mini-steps.

use metronome_core::PolicyVersion;

use crate::common::{
    config, flat_weights, group_batch, group_batch_at, period_batch, period_groups, stamped, tiny_model,
};

#[test]
fn non_finite_loss_skips_the_step_and_the_run_goes_on() {
    let mut t = config().build(tiny_model()).unwrap();
    let before = flat_weights(t.policy());
    let bad = group_batch(9, &[5, 6, 7], &[vec![8, 9], vec![10, 11]], &[f32::NAN, 1.0]);
    t.accumulate_sync(&bad).unwrap();
    let r = t.step_sync().unwrap();
    assert!(!r.applied);
    // The refused step still closes the period: version 1 names the same weights, so
    // a schedule waiting for the next period's version does not stall.
    assert_eq!(r.version, PolicyVersion(1));
    assert_eq!(t.version(), PolicyVersion(1));
    assert_eq!(t.skipped_steps(), 1);
    assert_eq!(t.optimizer_steps(), 0, "a refused step is no optimiser update");
    assert_eq!(flat_weights(t.policy()), before, "a skipped step must keep the weights");
    // The next period, sampled with version 1, trains normally.
    for g in period_groups() {
        t.accumulate_sync(&stamped(&g, PolicyVersion(1))).unwrap();
    }
    let r = t.step_sync().unwrap();
    assert!(r.applied && r.grad_norm.is_finite());
    assert_eq!(r.version, PolicyVersion(2));
    assert_ne!(flat_weights(t.policy()), before);
}

/// The `Trainer` contract: one version per step, applied or refused (a non-finite
/// advantage), and snapshots that are copies of the current weights.
#[tokio::test]
async fn the_trainer_passes_the_trainer_suite() {
    let mut t = config().build(tiny_model()).unwrap();
    let refused = |v| group_batch_at(9, &[5, 6, 7], &[vec![8, 9], vec![10, 11]], &[f32::NAN, 1.0], v);
    metronome_testkit::conformance::trainer::run_all(&mut t, &period_batch, Some(&refused)).await;
    let mut fresh = config().build(tiny_model()).unwrap();
    metronome_testkit::conformance::trainer::a_checkpoint_continues_exactly(
        &mut t,
        &mut fresh,
        &period_batch,
    )
    .await;
}

/// The same suite on a trainer that publishes snapshots left on its device (a GPU
/// trainer for an engine of its process; the CPU here): still copies of the current
/// weights, resident, and equal to the host snapshots of the same weights.
#[tokio::test]
async fn a_trainer_publishing_resident_snapshots_passes_the_trainer_suite() {
    let mut t = config().build(tiny_model()).unwrap().with_resident_snapshots(true);
    let refused = |v| group_batch_at(9, &[5, 6, 7], &[vec![8, 9], vec![10, 11]], &[f32::NAN, 1.0], v);
    metronome_testkit::conformance::trainer::run_all(&mut t, &period_batch, Some(&refused)).await;
    let resident = t.snapshot_sync().unwrap();
    assert!(resident.is_resident());
    assert!(resident.on_host().unwrap().into_owned() == t.policy().snapshot(t.version()).unwrap());
    assert!(!t.with_resident_snapshots(false).snapshot_sync().unwrap().is_resident());
}

#[test]
fn zero_advantage_groups_contribute_nothing_and_are_counted() {
    let groups = period_groups();
    let zero = group_batch(7, &[4, 5, 6], &[vec![7, 8, 9], vec![10, 11]], &[0.0, 0.0]);
    let mut with = config().build(tiny_model()).unwrap();
    let mut without = config().build(tiny_model()).unwrap();
    with.accumulate_sync(&groups[0]).unwrap();
    let r = with.accumulate_sync(&zero).unwrap();
    assert_eq!(r.tokens, 0);
    without.accumulate_sync(&groups[0]).unwrap();
    let (ra, rb) = (with.step_sync().unwrap(), without.step_sync().unwrap());
    assert_eq!(ra.zero_advantage_groups, 1);
    assert_eq!(ra.groups, 2);
    assert_eq!(ra.tokens, rb.tokens);
    assert_eq!(flat_weights(with.policy()), flat_weights(without.policy()));
    // A period of only equal-reward groups leaves the weights and counts the period.
    let before = flat_weights(with.policy());
    with.accumulate_sync(&stamped(&zero, with.version())).unwrap();
    let r = with.step_sync().unwrap();
    assert!(r.applied && r.tokens == 0 && r.zero_advantage_groups == 1);
    assert_eq!(flat_weights(with.policy()), before);
}

#[test]
fn stale_samples_need_importance_sampling() {
    let stale = group_batch_at(1, &[4, 5], &[vec![6, 7], vec![8]], &[1.0, -1.0], PolicyVersion(3));
    let mut t = config().build(tiny_model()).unwrap();
    let err = t.accumulate_sync(&stale).unwrap_err().to_string();
    assert!(err.contains("version 3") && err.contains("tis_cap"), "{err}");
    let mut cfg = config();
    cfg.loss.tis_cap = Some(2.0);
    let mut t = cfg.build(tiny_model()).unwrap();
    t.accumulate_sync(&stale).unwrap();
    let r = t.step_sync().unwrap();
    assert!(r.applied && r.logprob_gap > 0.0);
}

#[test]
fn mini_steps_take_several_updates_and_one_version() {
    let mut cfg = config();
    cfg.mini_steps = 2;
    let mut t = cfg.build(tiny_model()).unwrap();
    for g in period_groups() {
        t.accumulate_sync(&g).unwrap();
    }
    let r = t.step_sync().unwrap();
    assert!(r.applied);
    assert_eq!(t.optimizer_steps(), 2);
    assert_eq!(r.version, PolicyVersion(1));
    assert_eq!(r.groups, 4);
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let mut t = config().build(tiny_model()).unwrap();
    let mut b = period_groups().remove(0);
    b.targets.position[0] = 10_000;
    let err = t.accumulate_sync(&b).unwrap_err().to_string();
    assert!(err.contains("target 0"), "{err}");
    let mut b = period_groups().remove(0);
    b.targets.token[0] = 5_000;
    assert!(t.accumulate_sync(&b).is_err());
}

#[test]
fn the_reference_model_exists_only_with_a_kl_term() {
    let t = config().build(tiny_model()).unwrap();
    assert!(format!("{t:?}").contains("reference: false"));
    let mut cfg = config();
    cfg.loss.kl_coef = 0.1;
    let mut t = cfg.build(tiny_model()).unwrap();
    assert!(format!("{t:?}").contains("reference: true"));
    // At version 0 the policy equals its reference: the KL estimate is zero.
    for g in period_groups() {
        t.accumulate_sync(&g).unwrap();
    }
    let r = t.step_sync().unwrap();
    assert!(r.kl.abs() < 1e-6, "{}", r.kl);
    // After a step the policy has moved away from the reference.
    for g in period_groups() {
        t.accumulate_sync(&stamped(&g, t.version())).unwrap();
    }
    assert!(t.step_sync().unwrap().kl > 0.0);
}
