//! The GRPO loss family over per-target tensors.
//!
//! Everything here works on one value per loss target (a response token): the
//! policy log-probs (with gradient), the old-policy, reference and behaviour
//! log-probs, the advantages and a per-target aggregation weight. The functions know
//! nothing about the network, so tests check them in closed form on a `Var` of
//! log-probs.
//!
//! A loss is returned as a *weighted sum* `Σ_t w_t ℓ_t`. The whole-batch part of every
//! normaliser (`1 / total tokens`, `1 / total sequences`) is not applied here: the
//! trainer applies it as a scale on the accumulated gradient at step time
//! ([`Aggregation::step_scale`]), so micro-batches can arrive in any order.

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// Estimator of the per-token KL divergence from the policy to the reference.
///
/// With `δ = ref − policy` (log-probs of the sampled token):
/// k1 = `−δ`, k2 = `δ² / 2`, k3 = `exp(δ) − δ − 1` (Schulman's unbiased, non-negative
/// estimator, the GRPO default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `log π − log π_ref`.
    K1,
    /// `(log π − log π_ref)² / 2`.
    K2,
    /// `π_ref/π − log(π_ref/π) − 1`.
    #[default]
    K3,
}

impl KlEstimator {
    /// The per-token estimate; differentiable w.r.t. `logprobs`.
    pub fn per_token(self, logprobs: &Tensor, ref_logprobs: &Tensor) -> Result<Tensor> {
        let delta = (ref_logprobs - logprobs)?;
        let kl = match self {
            Self::K1 => delta.neg()?,
            Self::K2 => (delta.sqr()? * 0.5)?,
            Self::K3 => ((delta.exp()? - &delta)? - 1.0)?,
        };
        Ok(kl)
    }
}

/// How per-token losses are averaged into the step's loss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Aggregation {
    /// Mean over each response's tokens, then mean over the step's responses (the
    /// original GRPO form).
    SeqMeanTokenMean,
    /// Mean over every token of the step (DAPO's token-level loss).
    #[default]
    TokenMean,
    /// Dr. GRPO: each response's token *sum* divided by a constant (the generation
    /// budget), then mean over the step's responses; no length bias.
    ConstantNormaliser {
        /// The constant, usually the maximum number of generated tokens.
        max_tokens: u32,
    },
}

/// Counts of the whole step, known only when every micro-batch is in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTotals {
    /// Target tokens in the loss.
    pub tokens: u64,
    /// Responses in the loss.
    pub sequences: u64,
}

impl Aggregation {
    /// The weight of one target of a response with `sequence_len` targets: the part of
    /// the normaliser that is known per response.
    #[must_use]
    pub fn target_weight(self, sequence_len: u32) -> f32 {
        match self {
            Self::SeqMeanTokenMean => 1.0 / sequence_len.max(1) as f32,
            Self::TokenMean => 1.0,
            Self::ConstantNormaliser { max_tokens } => 1.0 / max_tokens.max(1) as f32,
        }
    }

    /// The whole-batch part of the normaliser, applied to the accumulated gradient
    /// (and loss sums) at step time. Zero when the step has nothing in the loss.
    #[must_use]
    pub fn step_scale(self, totals: StepTotals) -> f64 {
        let denom = match self {
            Self::TokenMean => totals.tokens,
            Self::SeqMeanTokenMean | Self::ConstantNormaliser { .. } => totals.sequences,
        };
        if denom == 0 { 0.0 } else { 1.0 / denom as f64 }
    }
}

/// The coefficients of the policy loss.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossConfig {
    /// Lower clip bound: the ratio is clipped at `1 − clip_low`.
    pub clip_low: f32,
    /// Upper clip bound: the ratio is clipped at `1 + clip_high` (DAPO's clip-higher
    /// sets it above `clip_low`).
    pub clip_high: f32,
    /// Weight of the KL term; 0 skips the reference forward entirely.
    pub kl_coef: f32,
    /// Which KL estimator the term uses.
    pub kl_estimator: KlEstimator,
    /// Weight of an entropy bonus (subtracted from the loss); usually 0.
    pub entropy_coef: f32,
    /// Truncated importance sampling: when set, the policy term of each token is
    /// weighted by `min(exp(old − behaviour), cap)` (no gradient), correcting samples
    /// drawn by an older policy than the old policy.
    pub tis_cap: Option<f32>,
    /// How token losses are averaged.
    pub aggregation: Aggregation,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            clip_low: 0.2,
            clip_high: 0.28,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            entropy_coef: 0.0,
            tis_cap: None,
            aggregation: Aggregation::TokenMean,
        }
    }
}

impl LossConfig {
    /// Checks the ranges; errors name the key under `prefix` (e.g. `loss`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        let key = |k: &str| format!("{prefix}.{k}");
        if !(self.clip_low.is_finite() && self.clip_low > 0.0 && self.clip_low < 1.0) {
            return Err(TrainerError::config(
                key("clip_low"),
                format!("is {}, expected 0 < clip_low < 1", self.clip_low),
            ));
        }
        if !(self.clip_high.is_finite() && self.clip_high > 0.0) {
            return Err(TrainerError::config(
                key("clip_high"),
                format!("is {}, expected a positive number", self.clip_high),
            ));
        }
        if !(self.kl_coef.is_finite() && self.kl_coef >= 0.0) {
            return Err(TrainerError::config(
                key("kl_coef"),
                format!("is {}, expected a number >= 0", self.kl_coef),
            ));
        }
        if !self.entropy_coef.is_finite() {
            return Err(TrainerError::config(key("entropy_coef"), "is not finite"));
        }
        if let Some(cap) = self.tis_cap
            && !(cap.is_finite() && cap > 0.0)
        {
            return Err(TrainerError::config(
                key("tis_cap"),
                format!("is {cap}, expected a positive number"),
            ));
        }
        if let Aggregation::ConstantNormaliser { max_tokens: 0 } = self.aggregation {
            return Err(TrainerError::config(key("aggregation.max_tokens"), "is 0, expected at least 1"));
        }
        Ok(())
    }
}

/// The per-target inputs of one micro-batch's loss, all `[n]` f32 tensors.
#[derive(Clone, Copy, Debug)]
pub struct LossInputs<'a> {
    /// Policy log-probs of the targets, with gradient.
    pub logprobs: &'a Tensor,
    /// Old-policy log-probs: `logprobs.detach()` when one step is taken per period
    /// (the ratio is then exactly 1 and only its gradient matters), otherwise the
    /// behaviour log-probs.
    pub old_logprobs: &'a Tensor,
    /// The log-probs the rollout engine recorded when it sampled the targets.
    pub behaviour_logprobs: &'a Tensor,
    /// Reference log-probs; `None` when the KL coefficient is 0.
    pub ref_logprobs: Option<&'a Tensor>,
    /// Per-token entropy of the policy (for the bonus and the statistics).
    pub entropy: Option<&'a Tensor>,
    /// Advantage of each target's response.
    pub advantages: &'a [f32],
    /// Aggregation weight of each target ([`Aggregation::target_weight`]).
    pub weights: &'a [f32],
}

/// One micro-batch's loss and the sums behind the step statistics.
#[derive(Clone, Debug)]
pub struct LossTerms {
    /// The scalar to back-propagate: `Σ_t w_t ℓ_t`, before the step-time scale.
    pub loss: Tensor,
    /// `Σ_t w_t ℓ_t` as a number.
    pub loss_sum: f64,
    /// The policy-gradient part of `loss_sum` (importance weights included).
    pub policy_sum: f64,
    /// The KL part of `loss_sum` (coefficient included).
    pub kl_term_sum: f64,
    /// Unweighted `Σ_t kl_t` (for the mean KL statistic); 0 without a reference.
    pub kl_sum: f64,
    /// Unweighted `Σ_t H_t`; 0 without entropies.
    pub entropy_sum: f64,
    /// Unweighted `Σ_t |log π_t − behaviour_t|`.
    pub logprob_gap_sum: f64,
    /// Targets whose clipped branch was selected.
    pub clipped: u64,
    /// Number of targets.
    pub tokens: u64,
}

fn check_len(name: &str, len: usize, n: usize) -> Result<()> {
    if len == n {
        Ok(())
    } else {
        Err(TrainerError::invalid(
            format!("loss input `{name}`"),
            format!("has {len} entries for {n} targets"),
        ))
    }
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// The clipped-surrogate GRPO loss with optional KL, entropy and truncated-IS terms.
///
/// Per target, with `r = exp(log π − log π_old)`:
/// `ℓ = −is · min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) + β·kl − c_H·H`,
/// where `is = min(exp(old − behaviour), cap)` without gradient (1 when no cap is
/// configured). The clipped branch is held constant, so its gradient is zero exactly
/// where PPO's is.
pub fn grpo_loss(cfg: &LossConfig, x: LossInputs<'_>) -> Result<LossTerms> {
    let n = x.logprobs.dims1()?;
    check_len("old_logprobs", x.old_logprobs.dims1()?, n)?;
    check_len("behaviour_logprobs", x.behaviour_logprobs.dims1()?, n)?;
    check_len("advantages", x.advantages.len(), n)?;
    check_len("weights", x.weights.len(), n)?;
    let device = x.logprobs.device();

    let ratio = (x.logprobs - x.old_logprobs)?.exp()?;
    let ratio_host = host(&ratio)?;
    let old_host = host(x.old_logprobs)?;
    let beh_host = host(x.behaviour_logprobs)?;
    let logp_host = host(x.logprobs)?;

    // The surrogate is linear in `r` on the selected branch: ℓ_pg = coef·r + constant,
    // with coef = −is·w·A on the unclipped branch and 0 on the clipped one.
    let (lo, hi) = (1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
    let mut coef = Vec::with_capacity(n);
    let mut constant = Vec::with_capacity(n);
    let mut clipped = 0u64;
    let mut policy_sum = 0f64;
    let mut logprob_gap_sum = 0f64;
    for t in 0..n {
        let (r, a, w) = (ratio_host[t], x.advantages[t], x.weights[t]);
        let is = match cfg.tis_cap {
            Some(cap) => (old_host[t] - beh_host[t]).exp().min(cap),
            None => 1.0,
        };
        let unclipped = r * a;
        let clipped_value = r.clamp(lo, hi) * a;
        if unclipped <= clipped_value {
            coef.push(-is * w * a);
            constant.push(0.0);
            policy_sum += -f64::from(is * w) * f64::from(unclipped);
        } else {
            clipped += 1;
            coef.push(0.0);
            constant.push(-is * w * clipped_value);
            policy_sum += -f64::from(is * w) * f64::from(clipped_value);
        }
        logprob_gap_sum += f64::from((logp_host[t] - beh_host[t]).abs());
    }
    let coef = Tensor::from_vec(coef, n, device)?;
    let constant = Tensor::from_vec(constant, n, device)?;
    let mut per_target = ((&ratio * &coef)? + &constant)?;

    let weights = Tensor::from_slice(x.weights, n, device)?;
    let (mut kl_sum, mut kl_term_sum) = (0f64, 0f64);
    if let Some(ref_lp) = x.ref_logprobs
        && cfg.kl_coef != 0.0
    {
        check_len("ref_logprobs", ref_lp.dims1()?, n)?;
        let kl = cfg.kl_estimator.per_token(x.logprobs, ref_lp)?;
        let kl_host = host(&kl)?;
        kl_sum = kl_host.iter().map(|&v| f64::from(v)).sum();
        kl_term_sum =
            kl_host.iter().zip(x.weights).map(|(&k, &w)| f64::from(cfg.kl_coef * w) * f64::from(k)).sum();
        per_target = (per_target + (kl * (f64::from(cfg.kl_coef)))?.mul(&weights)?)?;
    }
    let mut entropy_sum = 0f64;
    let mut entropy_term_sum = 0f64;
    if let Some(h) = x.entropy {
        check_len("entropy", h.dims1()?, n)?;
        let h_host = host(h)?;
        entropy_sum = h_host.iter().map(|&v| f64::from(v)).sum();
        if cfg.entropy_coef != 0.0 {
            entropy_term_sum = h_host
                .iter()
                .zip(x.weights)
                .map(|(&e, &w)| f64::from(cfg.entropy_coef * w) * f64::from(e))
                .sum();
            per_target = (per_target - (h * f64::from(cfg.entropy_coef))?.mul(&weights)?)?;
        }
    }
    let loss = per_target.sum_all()?;
    Ok(LossTerms {
        loss,
        loss_sum: policy_sum + kl_term_sum - entropy_term_sum,
        policy_sum,
        kl_term_sum,
        kl_sum,
        entropy_sum,
        logprob_gap_sum,
        clipped,
        tokens: n as u64,
    })
}

/// Supervised cross-entropy: `Σ_t w_t · (−log π_t)` over answer tokens.
pub fn sft_loss(logprobs: &Tensor, weights: &[f32]) -> Result<(Tensor, f64)> {
    let n = logprobs.dims1()?;
    check_len("weights", weights.len(), n)?;
    let w = Tensor::from_slice(weights, n, logprobs.device())?;
    let loss = logprobs.mul(&w)?.sum_all()?.neg()?;
    let value = f64::from(loss.to_scalar::<f32>()?);
    Ok((loss, value))
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn var(v: &[f32]) -> Var {
        Var::from_slice(v, v.len(), &Device::Cpu).unwrap()
    }

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
    }

    fn grad(loss: &Tensor, v: &Var) -> Vec<f32> {
        loss.backward().unwrap().get(v.as_tensor()).unwrap().to_vec1().unwrap()
    }

    #[test]
    fn on_policy_ratio_is_one_and_gradient_is_minus_weighted_advantage() {
        let lp = var(&[-1.0, -2.0, -0.5]);
        let old = lp.as_tensor().detach();
        let cfg = LossConfig::default();
        let adv = [1.5, -0.5, 2.0];
        let w = [0.5, 0.25, 1.0];
        let out = grpo_loss(
            &cfg,
            LossInputs {
                logprobs: lp.as_tensor(),
                old_logprobs: &old,
                behaviour_logprobs: &old,
                ref_logprobs: None,
                entropy: None,
                advantages: &adv,
                weights: &w,
            },
        )
        .unwrap();
        let expected: f64 = adv.iter().zip(w).map(|(&a, w)| -f64::from(a * w)).sum();
        assert!((out.loss_sum - expected).abs() < 1e-6);
        assert!((f64::from(out.loss.to_scalar::<f32>().unwrap()) - expected).abs() < 1e-6);
        assert_eq!(out.clipped, 0);
        let g = grad(&out.loss, &lp);
        for i in 0..3 {
            assert!((g[i] + adv[i] * w[i]).abs() < 1e-6, "{g:?}");
        }
    }

    #[test]
    fn clipping_zeroes_the_gradient_only_on_the_clipped_side() {
        // Four tokens: r above 1+eh with A>0 (clipped), r above with A<0 (not clipped),
        // r below 1-el with A<0 (clipped), r below with A>0 (not clipped).
        let cfg = LossConfig { clip_low: 0.2, clip_high: 0.3, ..LossConfig::default() };
        let old = [0.0f32, 0.0, 0.0, 0.0];
        let r = [1.5f32, 1.5, 0.5, 0.5];
        let lp_v: Vec<f32> = r.iter().map(|x| x.ln()).collect();
        let lp = var(&lp_v);
        let adv = [1.0f32, -1.0, -1.0, 1.0];
        let w = [1.0f32; 4];
        let old_t = t(&old);
        let out = grpo_loss(
            &cfg,
            LossInputs {
                logprobs: lp.as_tensor(),
                old_logprobs: &old_t,
                behaviour_logprobs: &old_t,
                ref_logprobs: None,
                entropy: None,
                advantages: &adv,
                weights: &w,
            },
        )
        .unwrap();
        // Closed form: -min(rA, clip(r)A).
        let expected = -(1.3 * 1.0) - (-1.5) - (-0.8) - 0.5;
        assert!((out.loss_sum - expected).abs() < 1e-5, "{} vs {expected}", out.loss_sum);
        assert_eq!(out.clipped, 2);
        // d/dlogp of -rA = -A r on unclipped tokens.
        let g = grad(&out.loss, &lp);
        let want = [0.0, 1.5, 0.0, -0.5];
        for i in 0..4 {
            assert!((g[i] - want[i]).abs() < 1e-5, "{g:?}");
        }
    }

    #[test]
    fn kl_estimators_match_closed_form_values_and_gradients() {
        let lp_v = [-1.0f32, -0.3, -2.5];
        let ref_v = [-1.2f32, -0.1, -2.5];
        for est in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
            let lp = var(&lp_v);
            let old = lp.as_tensor().detach();
            let rf = t(&ref_v);
            let beta = 0.1f32;
            let cfg = LossConfig { kl_coef: beta, kl_estimator: est, ..LossConfig::default() };
            let adv = [0.0f32; 3];
            let w = [1.0f32, 0.5, 2.0];
            let out = grpo_loss(
                &cfg,
                LossInputs {
                    logprobs: lp.as_tensor(),
                    old_logprobs: &old,
                    behaviour_logprobs: &old,
                    ref_logprobs: Some(&rf),
                    entropy: None,
                    advantages: &adv,
                    weights: &w,
                },
            )
            .unwrap();
            let g = grad(&out.loss, &lp);
            let mut value = 0f64;
            for i in 0..3 {
                let d = f64::from(ref_v[i] - lp_v[i]);
                let (k, dk_dlp) = match est {
                    KlEstimator::K1 => (-d, 1.0),
                    KlEstimator::K2 => (d * d / 2.0, -d),
                    KlEstimator::K3 => (d.exp() - d - 1.0, -d.exp() + 1.0),
                };
                value += f64::from(beta * w[i]) * k;
                let want = f64::from(beta * w[i]) * dk_dlp;
                assert!((f64::from(g[i]) - want).abs() < 1e-6, "{est:?} token {i}: {} vs {want}", g[i]);
            }
            assert!((out.loss_sum - value).abs() < 1e-6, "{est:?}");
            assert!((f64::from(out.loss.to_scalar::<f32>().unwrap()) - value).abs() < 1e-6, "{est:?}");
        }
    }

    #[test]
    fn truncated_importance_weight_scales_policy_term_without_gradient_through_it() {
        let lp = var(&[-1.0, -1.0]);
        let old = lp.as_tensor().detach();
        // Behaviour was 0.5 and 2.0 nats less likely: weights e^0.5 and min(e^2, 2) = 2.
        let beh = t(&[-1.5, -3.0]);
        let cfg = LossConfig { tis_cap: Some(2.0), ..LossConfig::default() };
        let adv = [1.0f32, 1.0];
        let w = [1.0f32, 1.0];
        let out = grpo_loss(
            &cfg,
            LossInputs {
                logprobs: lp.as_tensor(),
                old_logprobs: &old,
                behaviour_logprobs: &beh,
                ref_logprobs: None,
                entropy: None,
                advantages: &adv,
                weights: &w,
            },
        )
        .unwrap();
        let is0 = 0.5f64.exp();
        assert!((out.loss_sum - (-is0 - 2.0)).abs() < 1e-5);
        let g = grad(&out.loss, &lp);
        assert!((f64::from(g[0]) + is0).abs() < 1e-5 && (g[1] + 2.0).abs() < 1e-5, "{g:?}");
        assert!((out.logprob_gap_sum - 2.5).abs() < 1e-6);
    }

    #[test]
    fn entropy_bonus_is_subtracted_with_its_gradient() {
        let lp = var(&[-1.0, -2.0]);
        let h = var(&[0.5, 1.5]);
        let old = lp.as_tensor().detach();
        let cfg = LossConfig { entropy_coef: 0.1, ..LossConfig::default() };
        let out = grpo_loss(
            &cfg,
            LossInputs {
                logprobs: lp.as_tensor(),
                old_logprobs: &old,
                behaviour_logprobs: &old,
                ref_logprobs: None,
                entropy: Some(h.as_tensor()),
                advantages: &[0.0, 0.0],
                weights: &[1.0, 0.5],
            },
        )
        .unwrap();
        // ℓ = −0.1·(1·0.5 + 0.5·1.5) = −0.125; ∂ℓ/∂H = −0.1·w.
        assert!((out.loss_sum + 0.125).abs() < 1e-6);
        assert!((out.entropy_sum - 2.0).abs() < 1e-6);
        let g: Vec<f32> = out.loss.backward().unwrap().get(h.as_tensor()).unwrap().to_vec1().unwrap();
        assert!((g[0] + 0.1).abs() < 1e-6 && (g[1] + 0.05).abs() < 1e-6, "{g:?}");
    }

    #[test]
    fn aggregation_weights_and_step_scales() {
        let totals = StepTotals { tokens: 10, sequences: 4 };
        assert_eq!(Aggregation::TokenMean.target_weight(5), 1.0);
        assert!((Aggregation::TokenMean.step_scale(totals) - 0.1).abs() < 1e-12);
        assert_eq!(Aggregation::SeqMeanTokenMean.target_weight(4), 0.25);
        assert!((Aggregation::SeqMeanTokenMean.step_scale(totals) - 0.25).abs() < 1e-12);
        let dr = Aggregation::ConstantNormaliser { max_tokens: 8 };
        assert_eq!(dr.target_weight(3), 0.125);
        assert!((dr.step_scale(totals) - 0.25).abs() < 1e-12);
        assert_eq!(Aggregation::TokenMean.step_scale(StepTotals::default()), 0.0);
    }

    #[test]
    fn sft_loss_is_weighted_negative_log_likelihood() {
        let lp = var(&[-0.5, -1.5]);
        let (loss, value) = sft_loss(lp.as_tensor(), &[0.5, 0.5]).unwrap();
        assert!((value - 1.0).abs() < 1e-6);
        assert_eq!(grad(&loss, &lp), vec![-0.5, -0.5]);
    }

    #[test]
    fn validation_names_the_key() {
        let cfg = LossConfig { clip_high: -1.0, ..LossConfig::default() };
        let err = cfg.validate("loss").unwrap_err().to_string();
        assert!(err.contains("loss.clip_high"), "{err}");
        let cfg = LossConfig {
            aggregation: Aggregation::ConstantNormaliser { max_tokens: 0 },
            ..LossConfig::default()
        };
        assert!(cfg.validate("loss").unwrap_err().to_string().contains("max_tokens"));
    }
}
