//! The variants at the trainer: REINFORCE++'s batch normaliser applied at step time
//! equals dividing the advantages up front, GSPO on-policy, masked IS for stale
//! samples, and log-probs scored at the sampling temperature.

use metronome_core::{AdvantageEstimator, PolicyVersion, TrainBatch};
use metronome_model::Device;
use metronome_trainer::loss::{Aggregation, MaskLevel, MaskedIs, RatioLevel};
use metronome_trainer::{GrpoTrainer, TrainerConfig};

use crate::common::{
    config, flat_weights, group_batch_at, max_abs_diff, pending_gradients, period_groups, stamped, tiny_model,
};

/// The batches with every advantage divided by `factor`.
fn divided(groups: &[TrainBatch], factor: f64) -> Vec<TrainBatch> {
    groups
        .iter()
        .map(|b| {
            let mut b = b.clone();
            b.targets.advantage.iter_mut().for_each(|a| *a = (f64::from(*a) / factor) as f32);
            b.sequences.iter_mut().for_each(|s| s.advantage = (f64::from(s.advantage) / factor) as f32);
            b
        })
        .collect()
}

/// REINFORCE++-baseline (arXiv 2501.03262): group-mean advantages divided by the
/// batch's standard deviation. Streamed group by group, the trainer scales the
/// policy-gradient part of the gradient by `1/(std + eps)` at step time and leaves
/// the KL and entropy parts alone; that must equal training on advantages divided
/// up front (computed here in f64), with and without those terms and with mini-steps.
#[test]
fn reinforce_plus_plus_at_step_time_equals_the_batch_std_up_front() {
    let groups = period_groups();
    let advantages: Vec<f64> =
        groups.iter().flat_map(|b| b.sequences.iter().map(|s| f64::from(s.advantage))).collect();
    let n = advantages.len() as f64;
    let mean = advantages.iter().sum::<f64>() / n;
    let std = (advantages.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!((std - 1.0).abs() > 0.1, "the batch std must not be 1 ({std}), or the test is vacuous");
    let up_front = divided(&groups, std + 1e-6);
    for (kl, entropy, mini_steps) in [(0.05, 0.01, 1), (0.0, 0.0, 1), (0.05, 0.0, 2)] {
        let what = format!("kl {kl}, entropy {entropy}, mini-steps {mini_steps}");
        let mut cfg = config();
        cfg.loss.kl_coef = kl;
        cfg.loss.entropy_coef = entropy;
        cfg.mini_steps = mini_steps;
        // AdamW's first update is `lr · g / (|g| + eps)`; with the default eps (1e-8)
        // elements whose gradient is near eps (this model has some at 2e-8) turn
        // rounding-level differences of the gradient (1e-9 here, compared below) into
        // weight differences of 1% of a step. A larger eps keeps the comparison about
        // the gradient.
        cfg.optimizer.eps = 1e-4;
        cfg.advantage = AdvantageEstimator::ReinforcePlusPlusBaseline;
        let mut streamed = cfg.build(tiny_model()).unwrap();
        cfg.advantage = AdvantageEstimator::GroupMean;
        let mut reference = cfg.build(tiny_model()).unwrap();
        let mut unscaled = cfg.build(tiny_model()).unwrap();
        for ((g, d), order) in groups.iter().zip(&up_front).zip([2usize, 0, 3, 1]) {
            // Completion order for the streamed trainer.
            streamed.accumulate_sync(&groups[order]).unwrap();
            reference.accumulate_sync(d).unwrap();
            unscaled.accumulate_sync(g).unwrap();
        }
        if mini_steps == 1 {
            let (a, b, c) =
                (pending_gradients(&streamed), pending_gradients(&reference), pending_gradients(&unscaled));
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let diff = max_abs_diff(&a, &b);
            assert!(diff <= 1e-5 * scale, "{what}: gradients differ by {diff} (largest {scale})");
            assert!(max_abs_diff(&c, &b) > 1e-3 * scale, "{what}: the normaliser must change the gradient");
        }
        let (ra, rb) = (streamed.step_sync().unwrap(), reference.step_sync().unwrap());
        assert!(ra.applied && rb.applied, "{what}");
        assert!(
            (ra.loss - rb.loss).abs() <= 1e-5 * rb.loss.abs().max(1.0),
            "{what}: loss {} vs {}",
            ra.loss,
            rb.loss
        );
        assert!((ra.policy_loss - rb.policy_loss).abs() <= 1e-5 * rb.policy_loss.abs().max(1.0), "{what}");
        let diff = max_abs_diff(&flat_weights(streamed.policy()), &flat_weights(reference.policy()));
        assert!(diff <= 1e-6, "{what}: weights differ by {diff}");
    }
}

#[test]
fn reinforce_plus_plus_resumes_mid_period_to_the_same_weights() {
    let groups = period_groups();
    let mut cfg = config();
    cfg.loss.kl_coef = 0.05;
    cfg.loss.entropy_coef = 0.01;
    cfg.advantage = AdvantageEstimator::ReinforcePlusPlusBaseline;
    let dir = tempfile::tempdir().unwrap();
    let mut a = cfg.build(tiny_model()).unwrap();
    for g in &groups[..2] {
        a.accumulate_sync(g).unwrap();
    }
    a.save_checkpoint(dir.path()).unwrap();
    let mut b = cfg.resume(dir.path(), &Device::Cpu).unwrap();
    for t in [&mut a, &mut b] {
        for g in &groups[2..] {
            t.accumulate_sync(g).unwrap();
        }
    }
    let (ra, rb) = (a.step_sync().unwrap(), b.step_sync().unwrap());
    assert_eq!(ra.loss.to_bits(), rb.loss.to_bits());
    let (wa, wb) = (flat_weights(a.policy()), flat_weights(b.policy()));
    assert!(wa.iter().zip(&wb).all(|(x, y)| x.to_bits() == y.to_bits()), "weights differ after resume");
}

/// On-policy (old = current), every GSPO ratio is 1 and its gradient is
/// `A_i (1/|y_i|) Σ_t ∇log π`: GRPO's with per-response token means.
#[test]
fn gspo_on_policy_is_grpo_with_sequence_means() {
    let mut cfg = config();
    cfg.loss.aggregation = Aggregation::SeqMeanTokenMean;
    let mut grpo = cfg.build(tiny_model()).unwrap();
    cfg.loss.ratio_level = RatioLevel::Sequence;
    let mut gspo = cfg.build(tiny_model()).unwrap();
    for g in &period_groups() {
        grpo.accumulate_sync(g).unwrap();
        gspo.accumulate_sync(g).unwrap();
    }
    let (a, b) = (pending_gradients(&gspo), pending_gradients(&grpo));
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.0 && max_abs_diff(&a, &b) <= 1e-6 * scale.max(1.0));
}

#[test]
fn masked_importance_sampling_trains_stale_samples() {
    let stale = group_batch_at(1, &[4, 5], &[vec![6, 7], vec![8]], &[1.0, -1.0], PolicyVersion(3));
    let mut cfg = config();
    cfg.loss.masked_is = Some(MaskedIs { level: MaskLevel::Geometric, lower: None, upper: 1e6 });
    let mut t = cfg.build(tiny_model()).unwrap();
    let r = t.accumulate_sync(&stale).unwrap();
    assert_eq!(r.tokens, 3);
    // Bounds that no behaviour ratio meets drop every target: nothing to learn from.
    cfg.loss.masked_is = Some(MaskedIs { level: MaskLevel::Token, lower: Some(1.0), upper: 1.0 });
    let mut t = cfg.build(tiny_model()).unwrap();
    let before = flat_weights(t.policy());
    t.accumulate_sync(&stale).unwrap();
    let report = t.step_sync().unwrap();
    assert_eq!((report.tokens, report.sequences), (0, 0));
    assert_eq!(flat_weights(t.policy()), before);
}

/// The behaviour log-probs of the targets of `batch` under `trainer`'s policy scored
/// at `temperature` (what a sampler at that temperature records).
fn with_behaviour_at(trainer: &GrpoTrainer, batch: &TrainBatch, temperature: f32) -> TrainBatch {
    let policy = trainer.policy();
    let prepared = policy.prepare_batch(&batch.rows, &batch.targets).unwrap();
    let lp = policy.score(&prepared, temperature).unwrap().logprobs.to_vec1::<f32>().unwrap();
    let mut b = batch.clone();
    b.targets.behaviour_logprob = lp;
    b
}

/// The trainer scores at the sampling temperature it was given: its log-probs then
/// equal behaviour log-probs recorded at that temperature (the step's mean gap), and
/// a masked-IS band of ±0.1% keeps every token; scored at 1 they do not.
#[test]
fn the_trainer_scores_at_the_sampling_temperature() {
    let mut cfg: TrainerConfig = config();
    cfg.loss.masked_is = Some(MaskedIs { level: MaskLevel::Token, lower: Some(0.999), upper: 1.001 });
    let groups = period_groups();
    for (trainer_t, gap_below, all_kept) in [(0.7f32, Some(1e-6), true), (1.0, None, false)] {
        let mut t = cfg.build(tiny_model()).unwrap().with_sampling_temperature(trainer_t).unwrap();
        assert_eq!(t.sampling_temperature(), trainer_t);
        let mut total = 0;
        for g in &groups {
            total += g.targets.len() as u64;
            let b = with_behaviour_at(&t, &stamped(g, t.version()), 0.7);
            t.accumulate_sync(&b).unwrap();
        }
        let r = t.step_sync().unwrap();
        match gap_below {
            Some(bound) => assert!(r.logprob_gap < bound, "T={trainer_t}: gap {}", r.logprob_gap),
            None => assert!(r.tokens == 0 || r.logprob_gap > 1e-3, "T={trainer_t}: gap {}", r.logprob_gap),
        }
        assert_eq!(r.tokens == total, all_kept, "T={trainer_t}: {} of {total} kept", r.tokens);
    }
    for bad in [-0.5, f32::NAN] {
        let err = cfg.build(tiny_model()).unwrap().with_sampling_temperature(bad).unwrap_err().to_string();
        assert!(err.contains("sampling temperature"), "{err}");
    }
}
