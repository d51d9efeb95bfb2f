//! Loss values and gradients against closed forms computed here in f64, for every
//! advantage estimator, aggregation and KL estimator, and for the variants named
//! after their papers: Dr. GRPO, GSPO and masked importance sampling.

use candle_core::{Device, Tensor, Var};
use metronome_core::AdvantageEstimator;
use metronome_trainer::loss::{
    Aggregation, KlEstimator, LossConfig, LossInputs, LossTerms, MaskLevel, MaskedIs, RatioLevel, StepTotals,
    grpo_loss,
};

/// Independent advantages.
fn advantages(est: AdvantageEstimator, r: &[f64]) -> Vec<f64> {
    let n = r.len() as f64;
    let mean = r.iter().sum::<f64>() / n;
    let std = (r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    r.iter()
        .map(|&x| match est {
            AdvantageEstimator::GroupNorm => (x - mean) / (std + 1e-6),
            AdvantageEstimator::GroupMean | AdvantageEstimator::ReinforcePlusPlusBaseline => x - mean,
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
                let sequences: Vec<u32> = seq_of.iter().map(|&s| s as u32).collect();
                let terms = grpo_loss(
                    &cfg,
                    LossInputs {
                        logprobs: var.as_tensor(),
                        old_logprobs: &old_t,
                        behaviour_logprobs: &old_t,
                        ref_logprobs: kl.map(|_| &ref_t),
                        entropy: None,
                        teacher_kl: None,
                        advantages: &adv,
                        sequences: &sequences,
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

/// Five responses of two groups: per token its response, log-prob, old and
/// behaviour log-probs, and per response its advantage.
struct Fixture {
    seq_of: Vec<usize>,
    seq_len: Vec<usize>,
    adv: Vec<f64>,
    lp: Vec<f32>,
    old: Vec<f32>,
    beh: Vec<f32>,
    reference: Vec<f32>,
}

fn fixture() -> Fixture {
    let seq_len = vec![3usize, 2, 4, 1, 3];
    let seq_of: Vec<usize> =
        seq_len.iter().enumerate().flat_map(|(s, &l)| std::iter::repeat_n(s, l)).collect();
    let n = seq_of.len();
    // Group mean advantages of rewards [1, 0, 0.5] and [0, 2].
    let adv = vec![0.5, -0.5, 0.0, -1.0, 1.0];
    let lp: Vec<f32> = (0..n).map(|t| -0.4 - 0.13 * t as f32).collect();
    // Per-token shifts put some responses' mean log-ratios outside the clip range.
    let shifts = [0.3f32, 0.25, 0.35, -0.4, -0.3, 0.05, -0.02, 0.01, 0.04, 0.5, -0.1, -0.2, -0.15];
    let old: Vec<f32> = (0..n).map(|t| lp[t] - shifts[t]).collect();
    let beh_shift = [0.1f32, -0.9, 0.05, 0.0, 0.2, -0.3, 0.4, 1.2, -0.05, 0.6, 0.02, -0.01, 0.03];
    let beh: Vec<f32> = (0..n).map(|t| old[t] - beh_shift[t]).collect();
    let reference: Vec<f32> = (0..n).map(|t| lp[t] + 0.07 * (t as f32 - 6.0) / 6.0).collect();
    Fixture { seq_of, seq_len, adv, lp, old, beh, reference }
}

/// The loss of `cfg` on the fixture: the terms, the value after the step-time scale
/// (from the counts the loss reports), and its gradient in the log-probs.
fn run(cfg: &LossConfig, f: &Fixture, with_kl: bool) -> (LossTerms, f64, Vec<f64>) {
    let n = f.lp.len();
    let var = Var::from_slice(&f.lp, n, &Device::Cpu).unwrap();
    let t = |v: &[f32]| Tensor::from_slice(v, n, &Device::Cpu).unwrap();
    let (old, beh, reference) = (t(&f.old), t(&f.beh), t(&f.reference));
    let adv: Vec<f32> = f.seq_of.iter().map(|&s| f.adv[s] as f32).collect();
    let sequences: Vec<u32> = f.seq_of.iter().map(|&s| s as u32).collect();
    let terms = grpo_loss(
        cfg,
        LossInputs {
            logprobs: var.as_tensor(),
            old_logprobs: &old,
            behaviour_logprobs: &beh,
            ref_logprobs: with_kl.then_some(&reference),
            entropy: None,
            teacher_kl: None,
            advantages: &adv,
            sequences: &sequences,
        },
    )
    .unwrap();
    let totals =
        StepTotals { tokens: terms.tokens, sequences: f.seq_len.len() as u64 - terms.masked_sequences };
    let scale = cfg.aggregation.step_scale(totals);
    let loss = (&terms.loss * scale).unwrap();
    let value = f64::from(loss.to_scalar::<f32>().unwrap());
    let grad = loss.backward().unwrap().get(var.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    (terms, value, grad.into_iter().map(f64::from).collect())
}

fn assert_close(what: &str, got: f64, want: f64) {
    assert!((got - want).abs() < 1e-5, "{what}: {got} vs {want}");
}

/// Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): advantages
/// `R − mean(R)` without the standard deviation, and each response's token *sum*
/// divided by one constant (the generation budget) before the mean over responses,
/// without `1/|o_i|`. Written in the paper's shape; reached by `advantage =
/// "group_mean"` with `aggregation = { kind = "constant_normaliser", max_tokens }`.
#[test]
fn dr_grpo_is_the_papers_objective() {
    let cfg = metronome_trainer::TrainerConfig::from_json(
        r#"{"advantage": "group_mean",
            "loss": {"aggregation": {"kind": "constant_normaliser", "max_tokens": 16}}}"#,
    )
    .unwrap();
    let rewards: [&[f32]; 2] = [&[1.0, 0.0, 0.5], &[0.0, 2.0]];
    let mut f = fixture();
    f.adv = rewards.iter().flat_map(|r| cfg.advantage.advantages(r)).map(f64::from).collect();
    let (terms, value, grad) = run(&cfg.loss, &f, false);
    let (lo, hi, budget) = (1.0 - 0.2, 1.0 + 0.28, 16.0);
    let mut want = 0.0;
    let g = f.seq_len.len() as f64;
    for (i, r) in rewards.iter().flat_map(|g| g.iter()).enumerate() {
        let group = if i < 3 { rewards[0] } else { rewards[1] };
        let mean = group.iter().map(|&x| f64::from(x)).sum::<f64>() / group.len() as f64;
        let a = f64::from(*r) - mean;
        assert_close("advantage", f.adv[i], a);
        let mut token_sum = 0.0;
        for t in (0..f.lp.len()).filter(|&t| f.seq_of[t] == i) {
            let ratio = (f64::from(f.lp[t]) - f64::from(f.old[t])).exp();
            let (l, d) = if ratio * a <= ratio.clamp(lo, hi) * a {
                (-ratio * a, -ratio * a)
            } else {
                (-ratio.clamp(lo, hi) * a, 0.0)
            };
            token_sum += l;
            assert_close(&format!("gradient of token {t}"), grad[t], d / budget / g);
        }
        want += token_sum / budget / g;
    }
    assert_close("loss", value, want);
    assert_eq!(terms.tokens, 13);
}

/// GSPO (Zheng et al. 2025, arXiv 2507.18071): per response
/// `s_i = exp(mean_t log(π/π_old))`, loss `−(1/G) Σ_i min(s_i A_i, clip(s_i) A_i)`
/// and `∇ = −(1/G) A_i s_i (1/|y_i|) Σ_t ∇log π(y_t)` where unclipped, 0 where
/// clipped; with a KL term on top (token-level, weighted `1/(G |y_i|)`).
#[test]
fn gspo_matches_its_closed_form() {
    let f = fixture();
    let (clip_low, clip_high, beta) = (0.1f64, 0.12f64, 0.05f64);
    for with_kl in [false, true] {
        let cfg = LossConfig {
            clip_low: clip_low as f32,
            clip_high: clip_high as f32,
            ratio_level: RatioLevel::Sequence,
            aggregation: Aggregation::SeqMeanTokenMean,
            kl_coef: if with_kl { beta as f32 } else { 0.0 },
            kl_estimator: KlEstimator::K3,
            ..LossConfig::default()
        };
        let (terms, value, grad) = run(&cfg, &f, with_kl);
        let g = f.seq_len.len() as f64;
        let mut want = 0.0;
        let mut want_grad = vec![0.0; f.lp.len()];
        let mut clipped_tokens = 0;
        let mut clipped_responses = 0;
        for i in 0..f.seq_len.len() {
            let tokens: Vec<usize> = (0..f.lp.len()).filter(|&t| f.seq_of[t] == i).collect();
            let len = tokens.len() as f64;
            let m = tokens.iter().map(|&t| f64::from(f.lp[t]) - f64::from(f.old[t])).sum::<f64>() / len;
            let (s, a) = (m.exp(), f.adv[i]);
            let c = s.clamp(1.0 - clip_low, 1.0 + clip_high);
            let unclipped = s * a <= c * a;
            want += if unclipped { -s * a } else { -c * a } / g;
            if !unclipped {
                clipped_tokens += tokens.len();
                clipped_responses += 1;
            }
            for &t in &tokens {
                if unclipped {
                    want_grad[t] += -a * s / len / g;
                }
                if with_kl {
                    let d = f64::from(f.reference[t]) - f64::from(f.lp[t]);
                    want += beta * (d.exp() - d - 1.0) / len / g;
                    want_grad[t] += beta * (1.0 - d.exp()) / len / g;
                }
            }
        }
        assert!(clipped_responses > 0 && clipped_responses < 5, "the fixture clips some responses");
        assert_eq!(terms.clipped, clipped_tokens as u64);
        assert_close(&format!("loss (kl {with_kl})"), value, want);
        for t in 0..f.lp.len() {
            assert_close(&format!("gradient of token {t} (kl {with_kl})"), grad[t], want_grad[t]);
        }
    }
}

/// Masked IS (verl's rollout-correction rejection sampling, AReaL's decoupled-PPO
/// mask): with `ρ_t = π_old/π_behaviour`, the targets (token level) or responses
/// (product or geometric mean of `ρ_t`) outside `[lower, upper]` leave the loss and
/// the normalisers; the kept ones carry `min(ρ_t, cap)` with a TIS cap.
#[test]
fn masked_importance_sampling_matches_its_closed_form() {
    let f = fixture();
    let n = f.lp.len();
    let log_rho: Vec<f64> = (0..n).map(|t| f64::from(f.old[t]) - f64::from(f.beh[t])).collect();
    let (clip_low, clip_high) = (0.2f64, 0.28f64);
    let mut cases = 0;
    for level in [MaskLevel::Token, MaskLevel::Sequence, MaskLevel::Geometric] {
        for (lower, upper) in [(0.7f64, 1.5f64), (0.35, 2.5)] {
            for cap in [None, Some(1.2f32)] {
                for agg in [
                    Aggregation::TokenMean,
                    Aggregation::SeqMeanTokenMean,
                    Aggregation::ConstantNormaliser { max_tokens: 8 },
                ] {
                    cases += 1;
                    let cfg = LossConfig {
                        masked_is: Some(MaskedIs { level, lower: Some(lower as f32), upper: upper as f32 }),
                        tis_cap: cap,
                        aggregation: agg,
                        ..LossConfig::default()
                    };
                    let (terms, value, grad) = run(&cfg, &f, false);
                    // Which targets stay.
                    let inside = |l: f64| (lower..=upper).contains(&l.exp());
                    let keep: Vec<bool> = (0..n)
                        .map(|t| {
                            let s = f.seq_of[t];
                            let seq: Vec<f64> =
                                (0..n).filter(|&u| f.seq_of[u] == s).map(|u| log_rho[u]).collect();
                            match level {
                                MaskLevel::Token => inside(log_rho[t]),
                                MaskLevel::Sequence => inside(seq.iter().sum()),
                                MaskLevel::Geometric => inside(seq.iter().sum::<f64>() / seq.len() as f64),
                            }
                        })
                        .collect();
                    let kept_len: Vec<usize> = (0..f.seq_len.len())
                        .map(|s| (0..n).filter(|&t| f.seq_of[t] == s && keep[t]).count())
                        .collect();
                    let kept_tokens = keep.iter().filter(|&&k| k).count();
                    let kept_seqs = kept_len.iter().filter(|&&l| l > 0).count() as f64;
                    let what = format!("{level:?} [{lower}, {upper}] cap {cap:?} {agg:?}");
                    assert_eq!(terms.tokens, kept_tokens as u64, "{what}");
                    assert_eq!(terms.masked_tokens, (n - kept_tokens) as u64, "{what}");
                    let factor = |t: usize| match agg {
                        Aggregation::TokenMean => 1.0 / kept_tokens as f64,
                        Aggregation::SeqMeanTokenMean => 1.0 / (kept_seqs * kept_len[f.seq_of[t]] as f64),
                        Aggregation::ConstantNormaliser { max_tokens } => {
                            1.0 / (kept_seqs * f64::from(max_tokens))
                        }
                    };
                    let mut want = 0.0;
                    for t in 0..n {
                        let d = if keep[t] {
                            let is = cap.map_or(1.0, |c| log_rho[t].exp().min(f64::from(c)));
                            let a = f.adv[f.seq_of[t]];
                            let r = (f64::from(f.lp[t]) - f64::from(f.old[t])).exp();
                            let c = r.clamp(1.0 - clip_low, 1.0 + clip_high);
                            let (l, d) = if r * a <= c * a { (-r * a, -r * a) } else { (-c * a, 0.0) };
                            want += factor(t) * is * l;
                            factor(t) * is * d
                        } else {
                            0.0
                        };
                        assert_close(&format!("{what}: gradient of token {t}"), grad[t], d);
                    }
                    assert_close(&format!("{what}: loss"), value, want);
                }
            }
        }
    }
    assert_eq!(cases, 36);
    // The bounds are wide enough in one case and narrow enough in another to drop
    // something at every level (checked, so the comparisons above are not vacuous).
    for level in [MaskLevel::Token, MaskLevel::Sequence, MaskLevel::Geometric] {
        let cfg = LossConfig {
            masked_is: Some(MaskedIs { level, lower: Some(0.7), upper: 1.5 }),
            ..LossConfig::default()
        };
        let (terms, _, _) = run(&cfg, &f, false);
        assert!(terms.masked_tokens > 0 && terms.tokens > 0, "{level:?}: {} masked", terms.masked_tokens);
    }
}
