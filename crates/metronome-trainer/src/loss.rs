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

/// Which ratio the clipped surrogate uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    /// PPO/GRPO: one ratio `π(y_t) / π_old(y_t)` per token, clipped per token.
    #[default]
    Token,
    /// GSPO (Zheng et al. 2025, arXiv 2507.18071): one ratio per response,
    /// `s_i = (π(y_i) / π_old(y_i))^(1/|y_i|) = exp(mean_t(log π − log π_old))`, the
    /// length-normalised geometric mean of its token ratios, clipped per response:
    /// `−min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i)`, one term per response (it
    /// needs `aggregation = seq_mean_token_mean`). Computed in the paper's GSPO-token
    /// form, `s_i,t = sg[s_i] · π(y_t) / sg[π(y_t)]`, whose value and gradient
    /// equal GSPO's when a response's tokens share its advantage, as here.
    Sequence,
}

/// What the behaviour importance ratio of masked IS is taken over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaskLevel {
    /// Each token by its own ratio `ρ_t = exp(old_t − behaviour_t)`.
    #[default]
    Token,
    /// Each response by the product of its tokens' ratios, `exp(Σ_t log ρ_t)`.
    Sequence,
    /// Each response by the geometric mean of its tokens' ratios, `exp(mean_t log ρ_t)`.
    Geometric,
}

/// Masked importance sampling: targets (or whole responses) whose behaviour
/// importance ratio `ρ = π_old / π_behaviour` lies outside `[lower, upper]` are dropped
/// from the loss — from every term and from the normalisers' token and response
/// counts, as if they had not been sampled.
///
/// This is verl's rollout-correction rejection sampling (`rollout_rs` = `token`,
/// `sequence` or `geometric`, with `rollout_rs_threshold` and `_lower`; Liu, Li et al.
/// 2025, "When Speed Kills Stability"), and the mask of AReaL's decoupled PPO (Fu et
/// al. 2025, arXiv 2505.24298): its implementation drops from the policy term the
/// tokens whose behaviour weight exceeds a cap and weights the kept ones by it, which
/// is `level = token`, `lower = 0`, `upper = tis_cap = cap` here, except that AReaL
/// keeps the dropped tokens in the token count. Combine it with
/// [`LossConfig::tis_cap`] to weight what is kept.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MaskedIs {
    /// Per token, or per response by the product or the geometric mean of its ratios.
    #[serde(default)]
    pub level: MaskLevel,
    /// The smallest ratio kept; absent, `1 / upper`.
    #[serde(default)]
    pub lower: Option<f32>,
    /// The largest ratio kept.
    pub upper: f32,
}

impl MaskedIs {
    /// The bounds `[lower, upper]` in f64.
    #[must_use]
    pub fn bounds(&self) -> (f64, f64) {
        let upper = f64::from(self.upper);
        (self.lower.map_or(1.0 / upper, f64::from), upper)
    }

    fn validate(&self, prefix: &str) -> Result<()> {
        if !(self.upper.is_finite() && self.upper >= 1.0) {
            return Err(TrainerError::config(
                format!("{prefix}.upper"),
                format!("is {}, expected a number >= 1 (an on-policy ratio is 1)", self.upper),
            ));
        }
        if let Some(lower) = self.lower
            && !(lower.is_finite() && (0.0..=1.0).contains(&lower))
        {
            return Err(TrainerError::config(
                format!("{prefix}.lower"),
                format!("is {lower}, expected 0 <= lower <= 1 (an on-policy ratio is 1)"),
            ));
        }
        Ok(())
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
    /// Per-token ratios (PPO/GRPO) or GSPO's per-response ratio.
    pub ratio_level: RatioLevel,
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
    /// Masked importance sampling: drop targets or responses whose behaviour ratio
    /// is out of bounds (see [`MaskedIs`]).
    pub masked_is: Option<MaskedIs>,
    /// How token losses are averaged.
    pub aggregation: Aggregation,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            clip_low: 0.2,
            clip_high: 0.28,
            ratio_level: RatioLevel::Token,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            entropy_coef: 0.0,
            tis_cap: None,
            masked_is: None,
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
        if let Some(m) = &self.masked_is {
            m.validate(&key("masked_is"))?;
        }
        if let Aggregation::ConstantNormaliser { max_tokens: 0 } = self.aggregation {
            return Err(TrainerError::config(key("aggregation.max_tokens"), "is 0, expected at least 1"));
        }
        if self.ratio_level == RatioLevel::Sequence && self.aggregation != Aggregation::SeqMeanTokenMean {
            return Err(TrainerError::config(
                key("ratio_level"),
                format!(
                    "is `sequence` (GSPO) with {} = {:?}: GSPO's objective has one term per response, \
                     set {} = {{ kind = \"seq_mean_token_mean\" }}",
                    key("aggregation"),
                    self.aggregation,
                    key("aggregation")
                ),
            ));
        }
        Ok(())
    }

    /// Whether the loss has terms besides the policy gradient (KL, entropy bonus).
    #[must_use]
    pub fn has_regulariser(&self) -> bool {
        self.kl_coef != 0.0 || self.entropy_coef != 0.0
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
    /// A per-target divergence from a teacher, differentiable, and its weight `w`:
    /// `w · kl_t` joins each target's loss as the KL to the reference does
    /// (on-policy distillation's exact reverse KL, `trainer.distill.signal = "full"`).
    pub teacher_kl: Option<(&'a Tensor, f32)>,
    /// Advantage of each target's response.
    pub advantages: &'a [f32],
    /// The response each target belongs to (an index into the micro-batch's
    /// responses); the aggregation weights, GSPO's ratios and masked IS read it.
    pub sequences: &'a [u32],
}

/// One micro-batch's loss and the sums behind the step statistics.
#[derive(Clone, Debug)]
pub struct LossTerms {
    /// The scalar to back-propagate: `Σ_t w_t ℓ_t`, before the step-time scale.
    pub loss: Tensor,
    /// The policy-gradient part of `loss` alone (importance weights included): the
    /// trainer scales it apart from the rest for REINFORCE++'s batch normalisation.
    pub policy_loss: Tensor,
    /// The KL (to the reference and to a teacher) and entropy parts of `loss`; `None`
    /// when there are none.
    pub regulariser: Option<Tensor>,
    /// `Σ_t w_t ℓ_t` as a number.
    pub loss_sum: f64,
    /// The policy-gradient part of `loss_sum` (importance weights included).
    pub policy_sum: f64,
    /// The KL parts of `loss_sum`, to the reference and to a teacher (coefficients
    /// included).
    pub kl_term_sum: f64,
    /// Unweighted `Σ_t kl_t` over the kept targets (for the mean KL statistic); 0
    /// without a reference.
    pub kl_sum: f64,
    /// Unweighted `Σ_t H_t` over the kept targets; 0 without entropies.
    pub entropy_sum: f64,
    /// Unweighted `Σ_t |log π_t − behaviour_t|` over the kept targets.
    pub logprob_gap_sum: f64,
    /// Kept targets whose clipped branch was selected.
    pub clipped: u64,
    /// Kept targets whose truncated importance weight was capped (`exp(old −
    /// behaviour) > tis_cap`); 0 without `tis_cap`.
    pub truncated: u64,
    /// Targets kept in the loss (all of them without masked IS).
    pub tokens: u64,
    /// Targets masked IS dropped.
    pub masked_tokens: u64,
    /// Responses with targets of which masked IS dropped every one: they leave the
    /// normalisers' response count.
    pub masked_sequences: u64,
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

/// The responses of one micro-batch's targets, numbered densely, with their target
/// counts.
struct PerSequence {
    /// Each target's response, `0..len.len()`.
    of: Vec<usize>,
    /// Targets of each response.
    len: Vec<u32>,
    /// Targets of each response still in the loss.
    kept: Vec<u32>,
}

impl PerSequence {
    /// Responses numbered in the order of their ids (any `u32`s, not necessarily
    /// dense: a micro-batch's kept targets may skip responses).
    fn new(sequences: &[u32]) -> Self {
        let mut ids = sequences.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let of: Vec<usize> = sequences.iter().map(|s| ids.binary_search(s).unwrap_or_default()).collect();
        let mut len = vec![0u32; ids.len()];
        for &s in &of {
            len[s] += 1;
        }
        Self { of, kept: len.clone(), len }
    }

    /// `Σ_t x_t` per response over the targets `keep` allows, in f64.
    fn sums(&self, x: &[f64], keep: &[bool]) -> Vec<f64> {
        let mut out = vec![0f64; self.len.len()];
        for ((&s, &v), &k) in self.of.iter().zip(x).zip(keep) {
            if k {
                out[s] += v;
            }
        }
        out
    }
}

/// Which targets masked IS keeps: `ρ` (per token, or per response from
/// `log ρ_t = old_t − behaviour_t`) within the bounds.
fn masked_is_keep(m: &MaskedIs, log_rho: &[f64], per_seq: &PerSequence) -> Vec<bool> {
    let (lower, upper) = m.bounds();
    let inside = |log_ratio: f64| {
        let r = log_ratio.exp();
        r >= lower && r <= upper
    };
    match m.level {
        MaskLevel::Token => log_rho.iter().map(|&l| inside(l)).collect(),
        MaskLevel::Sequence | MaskLevel::Geometric => {
            let sums = per_seq.sums(log_rho, &vec![true; log_rho.len()]);
            let keep_seq: Vec<bool> = sums
                .iter()
                .zip(&per_seq.len)
                .map(|(&sum, &len)| {
                    let l = if m.level == MaskLevel::Geometric { sum / f64::from(len.max(1)) } else { sum };
                    inside(l)
                })
                .collect();
            per_seq.of.iter().map(|&s| keep_seq[s]).collect()
        }
    }
}

/// The clipped-surrogate GRPO loss with optional KL, entropy, truncated-IS and
/// masked-IS terms.
///
/// Per target, with `r = exp(log π − log π_old)` (or GSPO's per-response ratio, see
/// [`RatioLevel::Sequence`]):
/// `ℓ = −is · min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) + β·kl − c_H·H`,
/// where `is = min(exp(old − behaviour), cap)` without gradient (1 when no cap is
/// configured). The clipped branch is held constant, so its gradient is zero exactly
/// where PPO's is. Targets masked IS drops have weight 0; every kept target has its
/// aggregation weight ([`Aggregation::target_weight`] of its response's kept
/// targets).
pub fn grpo_loss(cfg: &LossConfig, x: LossInputs<'_>) -> Result<LossTerms> {
    let n = x.logprobs.dims1()?;
    check_len("old_logprobs", x.old_logprobs.dims1()?, n)?;
    check_len("behaviour_logprobs", x.behaviour_logprobs.dims1()?, n)?;
    check_len("advantages", x.advantages.len(), n)?;
    check_len("sequences", x.sequences.len(), n)?;
    let device = x.logprobs.device();

    let old_host = host(x.old_logprobs)?;
    let beh_host = host(x.behaviour_logprobs)?;
    let logp_host = host(x.logprobs)?;
    let log_rho: Vec<f64> =
        old_host.iter().zip(&beh_host).map(|(&o, &b)| f64::from(o) - f64::from(b)).collect();

    let mut per_seq = PerSequence::new(x.sequences);
    let keep = match &cfg.masked_is {
        Some(m) => masked_is_keep(m, &log_rho, &per_seq),
        None => vec![true; n],
    };
    let masked_tokens = keep.iter().filter(|&&k| !k).count() as u64;
    for (&s, &k) in per_seq.of.iter().zip(&keep) {
        per_seq.kept[s] -= u32::from(!k);
    }
    let masked_sequences =
        per_seq.len.iter().zip(&per_seq.kept).filter(|&(&l, &k)| l > 0 && k == 0).count() as u64;
    let weights: Vec<f32> = per_seq
        .of
        .iter()
        .zip(&keep)
        .map(|(&s, &k)| if k { cfg.aggregation.target_weight(per_seq.kept[s]) } else { 0.0 })
        .collect();

    // The ratio as a differentiable tensor and its value per target. GSPO's is the
    // response's `s_i` in value with the gradient `s_i ∇log π(y_t)` (GSPO-token form).
    let (ratio, ratio_host) = match cfg.ratio_level {
        RatioLevel::Token => {
            let ratio = (x.logprobs - x.old_logprobs)?.exp()?;
            let values = host(&ratio)?;
            (ratio, values)
        }
        RatioLevel::Sequence => {
            let log_ratio: Vec<f64> =
                logp_host.iter().zip(&old_host).map(|(&l, &o)| f64::from(l) - f64::from(o)).collect();
            let sums = per_seq.sums(&log_ratio, &keep);
            let s: Vec<f32> = per_seq
                .of
                .iter()
                .map(|&q| (sums[q] / f64::from(per_seq.kept[q].max(1))).exp() as f32)
                .collect();
            let s_t = Tensor::from_slice(&s, n, device)?;
            let ratio = (x.logprobs - x.logprobs.detach())?.exp()?.mul(&s_t)?;
            (ratio, s)
        }
    };

    // The surrogate is linear in `r` on the selected branch: ℓ_pg = coef·r + constant,
    // with coef = −is·w·A on the unclipped branch and 0 on the clipped one.
    let (lo, hi) = (1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
    let mut coef = Vec::with_capacity(n);
    let mut constant = Vec::with_capacity(n);
    let mut clipped = 0u64;
    let mut truncated = 0u64;
    let mut policy_sum = 0f64;
    let mut logprob_gap_sum = 0f64;
    for t in 0..n {
        let (r, a, w) = (ratio_host[t], x.advantages[t], weights[t]);
        if !keep[t] {
            coef.push(0.0);
            constant.push(0.0);
            continue;
        }
        let is = match cfg.tis_cap {
            Some(cap) => {
                let weight = log_rho[t].exp() as f32;
                truncated += u64::from(weight > cap);
                weight.min(cap)
            }
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
    let policy_loss = ((&ratio * &coef)? + &constant)?.sum_all()?;

    let weights_t = Tensor::from_slice(&weights, n, device)?;
    let kept_sum =
        |v: &[f32]| v.iter().zip(&keep).filter(|&(_, &k)| k).map(|(&v, _)| f64::from(v)).sum::<f64>();
    let mut regulariser: Option<Tensor> = None;
    let (mut kl_sum, mut kl_term_sum) = (0f64, 0f64);
    if let Some(ref_lp) = x.ref_logprobs
        && cfg.kl_coef != 0.0
    {
        check_len("ref_logprobs", ref_lp.dims1()?, n)?;
        let kl = cfg.kl_estimator.per_token(x.logprobs, ref_lp)?;
        let kl_host = host(&kl)?;
        kl_sum = kept_sum(&kl_host);
        kl_term_sum =
            kl_host.iter().zip(&weights).map(|(&k, &w)| f64::from(cfg.kl_coef * w) * f64::from(k)).sum();
        regulariser = Some((kl * f64::from(cfg.kl_coef))?.mul(&weights_t)?.sum_all()?);
    }
    if let Some((kl, weight)) = x.teacher_kl {
        check_len("teacher_kl", kl.dims1()?, n)?;
        let kl_host = host(kl)?;
        kl_term_sum +=
            kl_host.iter().zip(&weights).map(|(&k, &w)| f64::from(weight * w) * f64::from(k)).sum::<f64>();
        let term = (kl * f64::from(weight))?.mul(&weights_t)?.sum_all()?;
        regulariser = Some(match regulariser {
            Some(r) => (r + term)?,
            None => term,
        });
    }
    let mut entropy_sum = 0f64;
    let mut entropy_term_sum = 0f64;
    if let Some(h) = x.entropy {
        check_len("entropy", h.dims1()?, n)?;
        let h_host = host(h)?;
        entropy_sum = kept_sum(&h_host);
        if cfg.entropy_coef != 0.0 {
            entropy_term_sum = h_host
                .iter()
                .zip(&weights)
                .map(|(&e, &w)| f64::from(cfg.entropy_coef * w) * f64::from(e))
                .sum();
            let bonus = (h * f64::from(cfg.entropy_coef))?.mul(&weights_t)?.sum_all()?.neg()?;
            regulariser = Some(match regulariser {
                Some(r) => (r + bonus)?,
                None => bonus,
            });
        }
    }
    let loss = match &regulariser {
        Some(r) => (&policy_loss + r)?,
        None => policy_loss.clone(),
    };
    Ok(LossTerms {
        loss,
        policy_loss,
        regulariser,
        loss_sum: policy_sum + kl_term_sum - entropy_term_sum,
        policy_sum,
        kl_term_sum,
        kl_sum,
        entropy_sum,
        logprob_gap_sum,
        clipped,
        truncated,
        tokens: n as u64 - masked_tokens,
        masked_tokens,
        masked_sequences,
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

    /// `grpo_loss` of samples drawn by `behaviour`, without an entropy bonus.
    fn off_policy_loss(
        cfg: &LossConfig,
        lp: &Var,
        old: &Tensor,
        behaviour: &Tensor,
        reference: Option<&Tensor>,
        advantages: &[f32],
        sequences: &[u32],
    ) -> LossTerms {
        let inputs = LossInputs {
            logprobs: lp.as_tensor(),
            old_logprobs: old,
            behaviour_logprobs: behaviour,
            ref_logprobs: reference,
            entropy: None,
            teacher_kl: None,
            advantages,
            sequences,
        };
        grpo_loss(cfg, inputs).unwrap()
    }

    /// `grpo_loss` of samples drawn from the old weights (behaviour = old), without an
    /// entropy bonus.
    fn on_policy_loss(
        cfg: &LossConfig,
        lp: &Var,
        old: &Tensor,
        reference: Option<&Tensor>,
        advantages: &[f32],
        sequences: &[u32],
    ) -> LossTerms {
        off_policy_loss(cfg, lp, old, old, reference, advantages, sequences)
    }

    fn grad(loss: &Tensor, v: &Var) -> Vec<f32> {
        loss.backward().unwrap().get(v.as_tensor()).unwrap().to_vec1().unwrap()
    }

    #[test]
    fn on_policy_ratio_is_one_and_gradient_is_minus_weighted_advantage() {
        let lp = var(&[-1.0, -2.0, -0.5]);
        let old = lp.as_tensor().detach();
        // Per-response token means: responses of one and two targets.
        let cfg = LossConfig { aggregation: Aggregation::SeqMeanTokenMean, ..LossConfig::default() };
        let adv = [1.5, -0.5, 2.0];
        let seqs = [0, 1, 1];
        let w = [1.0, 0.5, 0.5];
        let out = on_policy_loss(&cfg, &lp, &old, None, &adv, &seqs);
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
        let seqs = [0, 1, 2, 3];
        let old_t = t(&old);
        let out = on_policy_loss(&cfg, &lp, &old_t, None, &adv, &seqs);
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
            let cfg = LossConfig {
                kl_coef: beta,
                kl_estimator: est,
                aggregation: Aggregation::SeqMeanTokenMean,
                ..LossConfig::default()
            };
            let adv = [0.0f32; 3];
            let seqs = [0, 1, 1];
            let w = [1.0f32, 0.5, 0.5];
            let out = on_policy_loss(&cfg, &lp, &old, Some(&rf), &adv, &seqs);
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
        let out = off_policy_loss(&cfg, &lp, &old, &beh, None, &[1.0, 1.0], &[0, 1]);
        let is0 = 0.5f64.exp();
        assert!((out.loss_sum - (-is0 - 2.0)).abs() < 1e-5);
        let g = grad(&out.loss, &lp);
        assert!((f64::from(g[0]) + is0).abs() < 1e-5 && (g[1] + 2.0).abs() < 1e-5, "{g:?}");
        assert!((out.logprob_gap_sum - 2.5).abs() < 1e-6);
        assert_eq!(out.truncated, 1, "only the second weight, e^2, is capped");
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
                teacher_kl: None,
                advantages: &[0.0, 0.0],
                sequences: &[0, 1],
            },
        )
        .unwrap();
        // ℓ = −0.1·(0.5 + 1.5) = −0.2; ∂ℓ/∂H = −0.1 (token weights 1).
        assert!((out.loss_sum + 0.2).abs() < 1e-6);
        assert!((out.entropy_sum - 2.0).abs() < 1e-6);
        assert!(out.regulariser.is_some());
        let g: Vec<f32> = out.loss.backward().unwrap().get(h.as_tensor()).unwrap().to_vec1().unwrap();
        assert!((g[0] + 0.1).abs() < 1e-6 && (g[1] + 0.1).abs() < 1e-6, "{g:?}");
    }

    /// A teacher's per-target divergence joins the loss as `w · weight_t · kl_t`, with
    /// its gradient, under the aggregation's weights; the policy term stays as it is.
    #[test]
    fn a_teacher_divergence_is_added_with_its_weight_and_gradient() {
        let lp = var(&[-1.0, -2.0, -0.5]);
        let kl = var(&[0.3, 0.1, 0.8]);
        let old = lp.as_tensor().detach();
        let cfg = LossConfig { aggregation: Aggregation::SeqMeanTokenMean, ..LossConfig::default() };
        let out = grpo_loss(
            &cfg,
            LossInputs {
                logprobs: lp.as_tensor(),
                old_logprobs: &old,
                behaviour_logprobs: &old,
                ref_logprobs: None,
                entropy: None,
                teacher_kl: Some((kl.as_tensor(), 2.0)),
                advantages: &[1.0, 0.0, 0.0],
                sequences: &[0, 1, 1],
            },
        )
        .unwrap();
        // Weights 1, 1/2, 1/2: ℓ = −1·1 (policy) + 2·(0.3 + 0.05 + 0.4) = 0.5.
        assert!((out.policy_sum + 1.0).abs() < 1e-6);
        assert!((out.kl_term_sum - 1.5).abs() < 1e-6 && (out.loss_sum - 0.5).abs() < 1e-6);
        assert!(out.regulariser.is_some());
        let g = grad(&out.loss, &kl);
        assert!((g[0] - 2.0).abs() < 1e-6 && (g[1] - 1.0).abs() < 1e-6 && (g[2] - 1.0).abs() < 1e-6, "{g:?}");
        let err = grpo_loss(
            &cfg,
            LossInputs {
                logprobs: lp.as_tensor(),
                old_logprobs: &old,
                behaviour_logprobs: &old,
                ref_logprobs: None,
                entropy: None,
                teacher_kl: Some((&kl.as_tensor().narrow(0, 0, 2).unwrap(), 1.0)),
                advantages: &[1.0, 0.0, 0.0],
                sequences: &[0, 1, 1],
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("teacher_kl") && err.contains("2 entries for 3 targets"), "{err}");
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
        let masked = |level, lower, upper| LossConfig {
            masked_is: Some(MaskedIs { level, lower, upper }),
            ..LossConfig::default()
        };
        for (cfg, key) in [
            (masked(MaskLevel::Token, None, 0.9), "loss.masked_is.upper"),
            (masked(MaskLevel::Sequence, None, f32::NAN), "loss.masked_is.upper"),
            (masked(MaskLevel::Geometric, Some(1.5), 2.0), "loss.masked_is.lower"),
            (masked(MaskLevel::Token, Some(-0.1), 2.0), "loss.masked_is.lower"),
        ] {
            let err = cfg.validate("loss").unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
        masked(MaskLevel::Token, None, 1.0).validate("loss").unwrap();
        assert_eq!(MaskedIs { level: MaskLevel::Token, lower: None, upper: 4.0 }.bounds(), (0.25, 4.0));
        // GSPO has one term per response.
        let gspo = LossConfig { ratio_level: RatioLevel::Sequence, ..LossConfig::default() };
        let err = gspo.validate("loss").unwrap_err().to_string();
        assert!(err.contains("loss.ratio_level") && err.contains("loss.aggregation"), "{err}");
        LossConfig { aggregation: Aggregation::SeqMeanTokenMean, ..gspo }.validate("loss").unwrap();
    }

    #[test]
    fn response_ids_need_not_be_dense() {
        // Kept targets of a micro-batch may name any responses; per-response means
        // count each response's own targets.
        let lp = var(&[-1.0, -1.0, -1.0]);
        let old = lp.as_tensor().detach();
        let cfg = LossConfig { aggregation: Aggregation::SeqMeanTokenMean, ..LossConfig::default() };
        let out = on_policy_loss(&cfg, &lp, &old, None, &[1.0, 1.0, 1.0], &[7, u32::MAX, 7]);
        assert_eq!(grad(&out.loss, &lp), vec![-0.5, -1.0, -0.5]);
    }

    #[test]
    fn masked_tokens_leave_the_loss_and_the_counts() {
        // Behaviour ratios e^0, e^1, e^-1, e^0.2: with bounds [0.5, 2] tokens 1 and 2
        // are dropped; their response 1 loses every target.
        let lp = var(&[-1.0, -1.0, -1.0, -1.0]);
        let old = lp.as_tensor().detach();
        let beh = t(&[-1.0, -2.0, 0.0, -1.2]);
        let cfg = LossConfig {
            masked_is: Some(MaskedIs { level: MaskLevel::Token, lower: Some(0.5), upper: 2.0 }),
            aggregation: Aggregation::SeqMeanTokenMean,
            kl_coef: 0.5,
            ..LossConfig::default()
        };
        let reference = t(&[-1.5, -1.5, -1.5, -1.5]);
        let out =
            off_policy_loss(&cfg, &lp, &old, &beh, Some(&reference), &[1.0, 2.0, 2.0, -1.0], &[0, 1, 1, 2]);
        assert_eq!((out.tokens, out.masked_tokens, out.masked_sequences), (2, 2, 1));
        // Kept: token 0 (response 0, weight 1) and token 3 (response 2, weight 1).
        // δ = ref − log π = −0.5 on both: k3 = e^δ − δ − 1, ∂k3/∂log π = 1 − e^δ.
        let k3 = (-0.5f64).exp() + 0.5 - 1.0;
        assert!((out.policy_sum - (-1.0 + 1.0)).abs() < 1e-6, "{}", out.policy_sum);
        assert!((out.kl_sum - 2.0 * k3).abs() < 1e-6, "{}", out.kl_sum);
        let g = grad(&out.loss, &lp);
        let dk = 0.5 * (1.0 - (-0.5f64).exp());
        let want = [-1.0 + dk, 0.0, 0.0, 1.0 + dk];
        for i in 0..4 {
            assert!((f64::from(g[i]) - want[i]).abs() < 1e-5, "{g:?} vs {want:?}");
        }
    }
}
