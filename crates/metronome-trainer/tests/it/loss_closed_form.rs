//! Loss values and gradients against closed forms computed here in f64, for every
//! advantage estimator, aggregation and KL estimator.

use candle_core::{Device, Tensor, Var};
use metronome_core::AdvantageEstimator;
use metronome_trainer::loss::{Aggregation, KlEstimator, LossConfig, LossInputs, StepTotals, grpo_loss};

/// Independent advantages.
fn advantages(est: AdvantageEstimator, r: &[f64]) -> Vec<f64> {
    let n = r.len() as f64;
    let mean = r.iter().sum::<f64>() / n;
    let std = (r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    r.iter()
        .map(|&x| match est {
            AdvantageEstimator::GroupNorm => (x - mean) / (std + 1e-6),
            AdvantageEstimator::GroupMean => x - mean,
            AdvantageEstimator::LeaveOneOut => x - (r.iter().sum::<f64>() - x) / (n - 1.0),
        })
        .collect()
}

#[test]
fn every_variant_matches_its_closed_form() {
    // Two groups; sequence lengths and rewards per response.
    let groups: [(&[f64], &[usize]); 2] = [(&[1.0, 0.0, 0.5], &[2, 3, 1]), (&[0.0, 2.0], &[2, 2])];
    let estimators =
        [AdvantageEstimator::GroupNorm, AdvantageEstimator::GroupMean, AdvantageEstimator::LeaveOneOut];
    let aggregations = [
        Aggregation::SeqMeanTokenMean,
        Aggregation::TokenMean,
        Aggregation::ConstantNormaliser { max_tokens: 4 },
    ];
    let kls = [None, Some(KlEstimator::K1), Some(KlEstimator::K2), Some(KlEstimator::K3)];
    let (clip_low, clip_high, beta) = (0.2f64, 0.28f64, 0.05f64);
    let mut cases = 0;
    for est in estimators {
        // Per-sequence advantages from the core estimator, checked against ours.
        let mut seq_adv = Vec::new();
        let mut seq_len = Vec::new();
        for (rewards, lens) in groups {
            let ours = advantages(est, rewards);
            let rf: Vec<f32> = rewards.iter().map(|&x| x as f32).collect();
            let core = est.advantages(&rf);
            for (a, b) in ours.iter().zip(&core) {
                assert!((a - f64::from(*b)).abs() < 1e-5, "{est:?}: {a} vs {b}");
            }
            seq_adv.extend(core);
            seq_len.extend_from_slice(lens);
        }
        // Targets: per token, its sequence.
        let seq_of: Vec<usize> =
            seq_len.iter().enumerate().flat_map(|(s, &l)| std::iter::repeat_n(s, l)).collect();
        let n = seq_of.len();
        let lp: Vec<f32> = (0..n).map(|t| -0.3 - 0.17 * t as f32).collect();
        // Old log-probs chosen so that ratios land inside and outside both bounds.
        let shifts = [0.0f32, 0.4, -0.4, 0.1, -0.1, 0.3, -0.5, 0.05, 0.2, -0.25];
        let old: Vec<f32> = (0..n).map(|t| lp[t] - shifts[t % shifts.len()]).collect();
        let reference: Vec<f32> = (0..n).map(|t| lp[t] + 0.1 * ((t as f32) - 4.0) / 3.0).collect();
        let adv: Vec<f32> = seq_of.iter().map(|&s| seq_adv[s]).collect();
        for agg in aggregations {
            for kl in kls {
                cases += 1;
                let cfg = LossConfig {
                    clip_low: clip_low as f32,
                    clip_high: clip_high as f32,
                    kl_coef: if kl.is_some() { beta as f32 } else { 0.0 },
                    kl_estimator: kl.unwrap_or_default(),
                    aggregation: agg,
                    ..LossConfig::default()
                };
                let var = Var::from_slice(&lp, n, &Device::Cpu).unwrap();
                let old_t = Tensor::from_slice(&old, n, &Device::Cpu).unwrap();
                let ref_t = Tensor::from_slice(&reference, n, &Device::Cpu).unwrap();
                let weights: Vec<f32> =
                    seq_of.iter().map(|&s| agg.target_weight(seq_len[s] as u32)).collect();
                let terms = grpo_loss(
                    &cfg,
                    LossInputs {
                        logprobs: var.as_tensor(),
                        old_logprobs: &old_t,
                        behaviour_logprobs: &old_t,
                        ref_logprobs: kl.map(|_| &ref_t),
                        entropy: None,
                        advantages: &adv,
                        weights: &weights,
                    },
                )
                .unwrap();
                let scale = agg.step_scale(StepTotals { tokens: n as u64, sequences: seq_len.len() as u64 });
                let loss = (terms.loss * scale).unwrap();
                let got_value = f64::from(loss.to_scalar::<f32>().unwrap());
                let got_grad: Vec<f32> =
                    loss.backward().unwrap().get(var.as_tensor()).unwrap().to_vec1().unwrap();

                // Closed form: per-token loss and derivative, then the aggregation.
                let mut tok_loss = vec![0f64; n];
                let mut tok_grad = vec![0f64; n];
                for t in 0..n {
                    let a = f64::from(adv[t]);
                    let r = (f64::from(lp[t]) - f64::from(old[t])).exp();
                    let c = r.clamp(1.0 - clip_low, 1.0 + clip_high);
                    let (l, g) = if r * a <= c * a { (-r * a, -r * a) } else { (-c * a, 0.0) };
                    let d = f64::from(reference[t]) - f64::from(lp[t]);
                    let (k, dk) = match kl {
                        None => (0.0, 0.0),
                        Some(KlEstimator::K1) => (-d, 1.0),
                        Some(KlEstimator::K2) => (d * d / 2.0, -d),
                        Some(KlEstimator::K3) => (d.exp() - d - 1.0, 1.0 - d.exp()),
                    };
                    tok_loss[t] = l + beta * k;
                    tok_grad[t] = g + beta * dk;
                }
                let nseq = seq_len.len() as f64;
                let factor = |t: usize| match agg {
                    Aggregation::SeqMeanTokenMean => 1.0 / (nseq * seq_len[seq_of[t]] as f64),
                    Aggregation::TokenMean => 1.0 / n as f64,
                    Aggregation::ConstantNormaliser { max_tokens } => 1.0 / (nseq * f64::from(max_tokens)),
                };
                let want_value: f64 = (0..n).map(|t| factor(t) * tok_loss[t]).sum();
                let what = format!("{est:?} {agg:?} {kl:?}");
                assert!((got_value - want_value).abs() < 1e-5, "{what}: loss {got_value} vs {want_value}");
                assert!((terms.loss_sum * scale - want_value).abs() < 1e-5, "{what}: reported loss");
                for t in 0..n {
                    let want = factor(t) * tok_grad[t];
                    assert!(
                        (f64::from(got_grad[t]) - want).abs() < 1e-5,
                        "{what}: grad[{t}] {} vs {want}",
                        got_grad[t]
                    );
                }
            }
        }
    }
    assert_eq!(cases, 36);
}
