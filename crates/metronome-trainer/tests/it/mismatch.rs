//! The train–rollout mismatch a step reports (`StepReport::mismatch`): from behaviour
//! log-probs that differ from the trainer's by known offsets, the exact figures; and
//! with mini-steps, only the tokens scored by the weights that sampled them.

use metronome_core::{LogprobMismatch, TrainBatch};
use metronome_trainer::GrpoTrainer;
use metronome_trainer::loss::{MaskLevel, MaskedIs};

use crate::common::{config, period_groups, stamped, tiny_model};

/// `batch` with behaviour log-probs equal to `trainer`'s own (at temperature 1) plus
/// `offset(i)` on target `i`.
fn with_offsets(trainer: &GrpoTrainer, batch: &TrainBatch, offset: impl Fn(usize) -> f32) -> TrainBatch {
    let policy = trainer.policy();
    let lp = policy.target_logprobs(&batch.rows, &batch.targets).unwrap().logprobs.to_vec1::<f32>().unwrap();
    let mut b = batch.clone();
    b.targets.behaviour_logprob = lp.iter().enumerate().map(|(i, l)| l + offset(i)).collect();
    b
}

/// `k3 = exp(d) − 1 − d`.
fn k3(d: f64) -> f64 {
    d.exp_m1() - d
}

#[test]
fn known_offsets_give_the_mean_p99_max_k3_and_the_truncated_and_masked_shares() {
    // Behaviour below the trainer by 0.25 nats on every third target (importance
    // weight e^0.25 = 1.28: kept by the mask, capped by tis_cap = 1.1), by 0.6 on the
    // next (weight 1.82: masked, outside [1/1.5, 1.5]), equal on the rest.
    let mut cfg = config();
    cfg.loss.tis_cap = Some(1.1);
    cfg.loss.masked_is = Some(MaskedIs { level: MaskLevel::Token, lower: None, upper: 1.5 });
    let offset = |i: usize| match i % 3 {
        0 => -0.25,
        1 => -0.6,
        _ => 0.0,
    };
    let mut t = cfg.build(tiny_model()).unwrap();
    let (mut n, mut small, mut large) = (0u64, 0u64, 0u64);
    for g in &period_groups() {
        let b = with_offsets(&t, &stamped(g, t.version()), offset);
        for i in 0..b.targets.len() {
            n += 1;
            small += u64::from(i % 3 == 0);
            large += u64::from(i % 3 == 1);
        }
        t.accumulate_sync(&b).unwrap();
    }
    let m = t.step_sync().unwrap().mismatch;
    let share = |k: u64| k as f64 / n as f64;
    let mean = (0.25 * small as f64 + 0.6 * large as f64) / n as f64;
    let kl = (k3(0.25) * small as f64 + k3(0.6) * large as f64) / n as f64;
    eprintln!("{n} targets: {m:?}");
    assert_eq!(m.tokens, n);
    assert!((m.mean_abs - mean).abs() < 1e-5, "mean {} vs {mean}", m.mean_abs);
    assert!((m.max_abs - 0.6).abs() < 1e-5 && (m.p99_abs - 0.6).abs() < 1e-5, "{m:?}");
    assert!((m.kl_k3 - kl).abs() < 1e-5, "k3 {} vs {kl}", m.kl_k3);
    assert_eq!((m.truncated_share, m.masked_share), (share(small), share(large)));

    // The next step starts from nothing: equal log-probs measure (about) zero.
    for g in &period_groups() {
        let b = with_offsets(&t, &stamped(g, t.version()), |_| 0.0);
        t.accumulate_sync(&b).unwrap();
    }
    let m = t.step_sync().unwrap().mismatch;
    assert_eq!(m.tokens, n);
    assert!(m.max_abs < 1e-6 && m.kl_k3 < 1e-12, "{m:?}");
    assert_eq!((m.truncated_share, m.masked_share), (0.0, 0.0));
}

#[test]
fn mini_steps_measure_only_what_the_sampling_weights_score() {
    // Four groups in two mini-steps at a rate that moves the weights: the second
    // mini-batch is scored after an update, so its log-probs no longer match what
    // sampled it; the mismatch is measured on the first alone.
    let mut cfg = config();
    cfg.mini_steps = 2;
    cfg.schedule.lr = 5e-2;
    cfg.schedule.warmup_steps = 0;
    let mut t = cfg.build(tiny_model()).unwrap();
    let mut total = 0;
    for g in &period_groups() {
        let b = with_offsets(&t, &stamped(g, t.version()), |_| 0.0);
        total += b.targets.len() as u64;
        t.accumulate_sync(&b).unwrap();
    }
    let r = t.step_sync().unwrap();
    assert!(r.tokens == total && r.mismatch.tokens > 0 && r.mismatch.tokens < total, "{r:?}");
    assert!(r.mismatch.max_abs < 1e-6, "{:?}", r.mismatch);
    // The update did move the log-probs the second mini-batch was trained on.
    assert!(r.logprob_gap > 1e-4, "gap {}", r.logprob_gap);
    assert_ne!(r.mismatch, LogprobMismatch::default());
}
