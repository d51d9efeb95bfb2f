//! Drawing a row's next token where its logits are, so that only token ids and
//! log-probs cross to the host, not `[rows, vocab]` logits: every sampling setting the
//! rollout engine has (temperature, or greedy at temperature 0; the repetition penalty;
//! top-k/top-p/min-p; the log-probs of the raw distribution instead of the drawn one).
//!
//! The rollout engine owns sampling (configs, seeds, the contexts a penalty reads) and
//! gives a decode step one [`Draw`] per row; a row comes back as its logits
//! ([`Next::Logits`]) only when it had no draw or its logits no finite maximum. The
//! engine's own sampler is [`draw_row`], so a row drawn by a step and one sampled by
//! the engine from the same logits get the same token:
//!
//! 1. the repetition penalty, when there is one ([`Penalty`]): each distinct context
//!    token's logit divided by the factor when positive, multiplied otherwise, in f32;
//! 2. scale the logits by `1 / T` in f32 ([`scale`]; not at `T = 0` or `T = 1`);
//! 3. the first index of the largest scaled value, and `w_i = exp(x_i − max)` in f64,
//!    summed in token order ([`row_weights`]);
//! 4. greedy: that index; otherwise the first token whose running sum of weights
//!    exceeds `u · total` ([`invert_cdf`]), `u` being the row's counter-based uniform
//!    number (`metronome-rollout`'s `TokenRng`: run seed, version, prompt, sample index
//!    and position, never the slot, batch or device);
//! 5. the log-prob of the token under the scaled distribution, `x_t − max − ln total`
//!    (at `T = 1` when greedy), or with [`Draw::raw_logprob`] under the raw logits'
//!    (step 3 at `T = 1` without the penalty; [`raw_logprob`]).
//!
//! A draw may also truncate the distribution ([`Truncation`]: top-k, then top-p over
//! the top-k set, then min-p), in which case step 4 walks the surviving tokens in order
//! of decreasing probability instead ([`invert_truncated`]); the log-prob stays the
//! untruncated one of step 5. The engine's sampler and a decode step on the CPU use
//! this one definition; the CUDA kernel finds the same survivors and token by binary
//! searches over a key that orders tokens as the host's sort does (`kernels/draw.cu`).
//!
//! On the CPU (and under [`crate::Kernels::Portable`]) a step draws its rows with
//! exactly these functions ([`draw_row`]). The CUDA kernels (`kernels/draw.cu`, under
//! [`crate::Kernels::Cuda`]) follow the same steps with one thread block per row: each
//! thread sums a contiguous run of the vocabulary in order and the runs' sums are
//! added in order, so the total differs from the sequential sum only in f64 rounding
//! (about 1e-16 relative); a token differs only when `u · total` falls that close to
//! a boundary between two tokens. A penalised row is first copied to f32 and penalised
//! there by `penalise_rows_*` (the host's arithmetic exactly), its context's distinct
//! ids uploaded with it: a few hundred ids a row instead of its vocabulary's logits.

use crate::{Error, Result};

/// How one row's next token is drawn by a decode step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw<'a> {
    /// Softmax temperature; `0` is greedy (the argmax, whose log-prob is then taken at
    /// temperature 1).
    pub temperature: f32,
    /// The row's uniform number in `[0, 1)`.
    pub u: f64,
    /// The tokens it may draw from (none left out by default; ignored when greedy).
    pub truncation: Truncation,
    /// The repetition penalty, applied to the logits before everything else (none by
    /// default).
    pub penalty: Option<Penalty<'a>>,
    /// Report the token's log-prob under the raw logits (temperature 1, no penalty; vLLM's
    /// default `raw_logprobs`) instead of under the distribution it was drawn from.
    pub raw_logprob: bool,
}

impl Draw<'static> {
    /// A draw at `temperature` with the uniform number `u`, from the whole distribution.
    #[must_use]
    pub const fn new(temperature: f32, u: f64) -> Self {
        Self { temperature, u, truncation: Truncation::NONE, penalty: None, raw_logprob: false }
    }
}

impl Draw<'_> {
    /// Whether it draws from a truncated distribution (greedy draws never do).
    #[must_use]
    pub fn truncates(&self) -> bool {
        self.temperature != 0.0 && !self.truncation.is_none()
    }
}

/// Which tokens a draw may pick, applied in this order: the `top_k` most likely
/// (`0`: all); of those, the smallest set in order of decreasing probability whose mass
/// reaches `top_p` of theirs (`1`: all); of those, the ones at least `min_p` times as
/// likely as the most likely token (`0`: all). At least one token always survives, and
/// ties go to the lower token id, so the order is total and the draw deterministic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Truncation {
    /// Keep the `top_k` most likely tokens; `0` keeps all.
    pub top_k: u32,
    /// Keep the smallest most likely set whose probability reaches `top_p`, in `(0, 1]`.
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the top one, in `[0, 1]`.
    pub min_p: f32,
}

impl Truncation {
    /// Every token kept.
    pub const NONE: Self = Self { top_k: 0, top_p: 1.0, min_p: 0.0 };

    /// Whether it keeps every token.
    #[must_use]
    pub fn is_none(&self) -> bool {
        self.top_k == 0 && self.top_p >= 1.0 && self.min_p <= 0.0
    }

    /// min-p as a floor on a scaled value's distance to the maximum: `p_i >= min_p ·
    /// p_max` is `x_i − max >= ln min_p` (in f64); `-inf` when min-p is off.
    #[must_use]
    pub fn min_p_floor(&self) -> f64 {
        if self.min_p > 0.0 { f64::from(self.min_p).ln() } else { f64::NEG_INFINITY }
    }
}

impl Default for Truncation {
    fn default() -> Self {
        Self::NONE
    }
}

/// Hugging Face's repetition penalty: each distinct token of `context` that is in the
/// vocabulary has its logit divided by `factor` when positive and multiplied by it
/// otherwise, so that a factor above 1 always makes it less likely.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalty<'a> {
    /// The factor, finite and positive (1 changes nothing).
    pub factor: f32,
    /// The tokens it applies to (the prompt and the response so far); each counts once.
    pub context: &'a [u32],
}

impl Penalty<'_> {
    /// Applies the penalty to `row`; `seen` is scratch (the distinct context ids).
    pub fn apply(&self, row: &mut [f32], seen: &mut Vec<u32>) {
        self.distinct(row.len(), seen);
        for &t in seen.iter() {
            let x = &mut row[t as usize];
            *x = if *x > 0.0 { *x / self.factor } else { *x * self.factor };
        }
    }

    /// The context's distinct ids below `vocab`, ascending, into `out`: what a device
    /// is given to penalise a row.
    pub fn distinct(&self, vocab: usize, out: &mut Vec<u32>) {
        out.clear();
        out.extend(self.context.iter().copied().filter(|&t| (t as usize) < vocab));
        out.sort_unstable();
        out.dedup();
    }
}

/// A token drawn by a decode step and its log-prob under the penalised, temperature-scaled
/// (untruncated) distribution, or under the raw one ([`Draw::raw_logprob`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Drawn {
    /// The token.
    pub token: u32,
    /// `log_softmax(penalised_logits / T)[token]` (`T = 1` when greedy), or
    /// `log_softmax(logits)[token]` with [`Draw::raw_logprob`].
    pub logprob: f32,
}

/// What a decode step gives back for one row: its drawn token, or its logits `[vocab]`
/// for the caller (rows that were given no [`Draw`], or whose logits have no finite
/// maximum).
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Drawn by the step.
    Drawn(Drawn),
    /// The row's logits, on the host.
    Logits(Vec<f32>),
}

impl Next {
    /// The logits of a row that was not drawn; `None` for a drawn one.
    #[must_use]
    pub fn into_logits(self) -> Option<Vec<f32>> {
        match self {
            Self::Logits(l) => Some(l),
            Self::Drawn(_) => None,
        }
    }
}

/// Writes `logits / T` into `out` (the logits as they are at `T = 0` and `T = 1`), in
/// f32 with the reciprocal taken once, as the sampler always has.
pub fn scale(logits: &[f32], temperature: f32, out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(logits);
    let inv = inv_temperature(temperature);
    if inv != 1.0 {
        for x in out {
            *x *= inv;
        }
    }
}

/// The factor [`scale`] multiplies the logits by: `1 / T` in f32, or 1 at `T = 0`
/// (greedy) and `T = 1`. A device's draw is given this, so that it scales as the host.
#[must_use]
pub fn inv_temperature(temperature: f32) -> f32 {
    if temperature == 0.0 || temperature == 1.0 { 1.0 } else { 1.0 / temperature }
}

/// The first index of the largest of `scaled` (NaN never wins), that value, and the
/// sum of the weights `exp(x_i − max)` in f64 (zero for `-inf` and NaN), which are
/// written into `weights`, summed sequentially so that the result depends on the row
/// alone. Errors when the row is empty or has no finite maximum.
pub fn row_weights(scaled: &[f32], weights: &mut Vec<f64>) -> Result<(usize, f32, f64)> {
    if scaled.is_empty() {
        return Err(Error::invalid("logits", "the row is empty"));
    }
    let (argmax, max) = argmax(scaled);
    if !max.is_finite() {
        return Err(Error::invalid("logits", format!("the row has no finite maximum ({max})")));
    }
    weights.clear();
    weights.extend(scaled.iter().map(|&x| weight(x, max)));
    Ok((argmax, max, weights.iter().sum()))
}

/// `exp(x − max)` in f64; zero for `-inf` and NaN.
#[must_use]
pub fn weight(x: f32, max: f32) -> f64 {
    if x.is_nan() { 0.0 } else { (f64::from(x) - f64::from(max)).exp() }
}

/// The first index of the largest value (NaN never wins), and that value; for a row of
/// `-inf` and NaN only, index 0 and a value that is not finite.
#[must_use]
pub fn argmax(xs: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &x) in xs.iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    if best.1 == f32::NEG_INFINITY && !xs.is_empty() {
        return (0, if xs[0].is_nan() { f32::NAN } else { f32::NEG_INFINITY });
    }
    best
}

/// Inverse-CDF sampling over `weights` in token order: the first token whose running
/// sum exceeds `u · total`; if rounding leaves the sum short of it, the last token of
/// positive weight.
#[must_use]
pub fn invert_cdf(weights: &[f64], total: f64, u: f64) -> u32 {
    let target = u * total;
    let mut acc = 0.0f64;
    let mut last = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            acc += w;
            last = i;
            if acc > target {
                return i as u32;
            }
        }
    }
    last as u32
}

/// The log-prob of a scaled value `x` in a row of maximum `max` and weight sum `total`.
#[must_use]
pub fn logprob(x: f32, max: f32, total: f64) -> f32 {
    (f64::from(x) - (f64::from(max) + total.ln())) as f32
}

/// Inverse-CDF sampling over the tokens `truncation` keeps of a row of scaled values
/// `scaled` (maximum `max`) and weights `weights` ([`row_weights`]): its survivors in
/// order of decreasing probability (ties to the lower id, NaN last), each set's mass
/// summed in f64 in that order, and the first survivor whose running sum exceeds
/// `u · mass`; if rounding leaves the sum short of it, the last survivor. `order` is
/// scratch.
pub fn invert_truncated(
    scaled: &[f32],
    weights: &[f64],
    max: f32,
    truncation: Truncation,
    u: f64,
    order: &mut Vec<u32>,
) -> u32 {
    // Total order: larger value first, lower token id on ties; NaN ranks with -inf.
    let key = |&i: &u32| {
        let x = scaled[i as usize];
        (if x.is_nan() { f32::NEG_INFINITY } else { x }, std::cmp::Reverse(i))
    };
    let cmp = |a: &u32, b: &u32| key(b).partial_cmp(&key(a)).unwrap_or(std::cmp::Ordering::Equal);
    order.clear();
    order.extend(0..scaled.len() as u32);
    let k = match truncation.top_k as usize {
        0 => scaled.len(),
        k => k.min(scaled.len()),
    };
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, cmp);
        order.truncate(k);
    }
    order.sort_unstable_by(cmp);

    let mut keep = order.len();
    if truncation.top_p < 1.0 {
        let mass: f64 = order.iter().map(|&i| weights[i as usize]).sum();
        let need = f64::from(truncation.top_p) * mass;
        let mut acc = 0.0;
        for (n, &i) in order.iter().enumerate() {
            acc += weights[i as usize];
            if acc >= need {
                keep = n + 1;
                break;
            }
        }
    }
    if truncation.min_p > 0.0 {
        // The top token always passes (its distance is 0).
        let floor = truncation.min_p_floor();
        let passing = order[..keep]
            .iter()
            .take_while(|&&i| f64::from(scaled[i as usize]) - f64::from(max) >= floor)
            .count();
        keep = passing.max(1);
    }
    let kept = &order[..keep.max(1)];
    let total: f64 = kept.iter().map(|&i| weights[i as usize]).sum();
    let target = u * total;
    let mut acc = 0.0;
    for &i in kept {
        acc += weights[i as usize];
        if acc > target {
            return i;
        }
    }
    kept[kept.len() - 1]
}

/// Reusable buffers of [`draw_row`].
#[derive(Debug, Default)]
pub struct DrawScratch {
    penalised: Vec<f32>,
    seen: Vec<u32>,
    scaled: Vec<f32>,
    weights: Vec<f64>,
    order: Vec<u32>,
}

/// Draws one row's token on the host: the reference of every device's draw (module
/// docs). Errors when the row is empty or has no finite maximum once penalised and
/// scaled.
pub fn draw_row(logits: &[f32], draw: Draw<'_>, scratch: &mut DrawScratch) -> Result<Drawn> {
    let row = match draw.penalty {
        Some(penalty) => {
            scratch.penalised.clear();
            scratch.penalised.extend_from_slice(logits);
            penalty.apply(&mut scratch.penalised, &mut scratch.seen);
            &scratch.penalised
        }
        None => logits,
    };
    scale(row, draw.temperature, &mut scratch.scaled);
    let (top, max, total) = row_weights(&scratch.scaled, &mut scratch.weights)?;
    let token = if draw.temperature == 0.0 {
        top as u32
    } else if draw.truncates() {
        invert_truncated(&scratch.scaled, &scratch.weights, max, draw.truncation, draw.u, &mut scratch.order)
    } else {
        invert_cdf(&scratch.weights, total, draw.u)
    };
    let logprob = if draw.raw_logprob {
        raw_logprob(logits, token as usize, &mut scratch.weights)?
    } else {
        logprob(scratch.scaled[token as usize], max, total)
    };
    Ok(Drawn { token, logprob })
}

/// `log_softmax(logits)[token]` at temperature 1: steps 3 and 5 of the module docs on
/// the raw row (`weights` is scratch).
pub fn raw_logprob(logits: &[f32], token: usize, weights: &mut Vec<f64>) -> Result<f32> {
    let (_, max, total) = row_weights(logits, weights)?;
    Ok(logprob(logits[token], max, total))
}

/// Checks a step's draws against its rows: one per row, temperatures of the sampler's
/// domain (`0`, or finite and positive), uniform numbers in `[0, 1)`, truncations and
/// penalty factors in their ranges.
pub(crate) fn check_draws(draws: &[Option<Draw<'_>>], rows: usize) -> Result<()> {
    if draws.len() != rows {
        return Err(Error::invalid("draws", format!("{} for {rows} rows", draws.len())));
    }
    for (i, d) in draws.iter().enumerate() {
        let Some(d) = d else { continue };
        if !(d.temperature == 0.0 || d.temperature.is_finite() && d.temperature > 0.0) {
            return Err(Error::invalid(
                format!("draw {i}"),
                format!("temperature {} is not 0 or positive", d.temperature),
            ));
        }
        if !(0.0..1.0).contains(&d.u) {
            return Err(Error::invalid(
                format!("draw {i}"),
                format!("uniform number {} is not in [0, 1)", d.u),
            ));
        }
        let t = d.truncation;
        if !(t.top_p > 0.0 && t.top_p <= 1.0 && (0.0..=1.0).contains(&t.min_p)) {
            return Err(Error::invalid(
                format!("draw {i}"),
                format!("top_p {} is not in (0, 1] or min_p {} not in [0, 1]", t.top_p, t.min_p),
            ));
        }
        if let Some(p) = d.penalty
            && !(p.factor.is_finite() && p.factor > 0.0)
        {
            return Err(Error::invalid(
                format!("draw {i}"),
                format!("repetition penalty {} is not finite and positive", p.factor),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_and_its_temperature_one_logprob() {
        let mut s = DrawScratch::default();
        let d = draw_row(&[1.0, 3.0, 3.0, -1.0], Draw::new(0.0, 0.99), &mut s).unwrap();
        assert_eq!(d.token, 1);
        let z = (1f64.exp() + 2.0 * 3f64.exp() + (-1f64).exp()).ln();
        assert!((f64::from(d.logprob) - (3.0 - z)).abs() < 1e-6);
    }

    #[test]
    fn the_uniform_number_walks_the_cdf_in_token_order() {
        let mut s = DrawScratch::default();
        // Equal logits: token i owns [i/4, (i+1)/4).
        for (u, want) in [(0.0, 0), (0.24, 0), (0.26, 1), (0.74, 2), (0.9999, 3)] {
            let d = draw_row(&[0.5; 4], Draw::new(0.7, u), &mut s).unwrap();
            assert_eq!(d.token, want, "u = {u}");
            assert!((d.logprob - 0.25f32.ln()).abs() < 1e-6);
        }
        // A token of zero weight is never drawn, even where its interval would be.
        let d = draw_row(&[0.0, f32::NEG_INFINITY, f32::NAN, 0.0], Draw::new(1.0, 0.6), &mut s);
        assert_eq!(d.unwrap().token, 3);
    }

    #[test]
    fn a_truncated_draw_walks_the_survivors_most_likely_first_and_keeps_the_untruncated_logprob() {
        let mut s = DrawScratch::default();
        // Token 2 most likely, then 0 and 3 tied (the lower id first), then 1.
        let logits = [1.0, 0.0, 2.0, 1.0];
        let z = (2.0 * 1f64.exp() + 1.0 + 2f64.exp()).ln();
        let top2 = Truncation { top_k: 2, ..Truncation::NONE };
        // The survivors {2, 0}, in that order: token 2 owns the lower part of [0, 1).
        let p2 = 2f64.exp() / (2f64.exp() + 1f64.exp());
        for (u, want) in [(0.0, 2), (p2 - 1e-9, 2), (p2 + 1e-9, 0), (0.999, 0)] {
            let d = draw_row(&logits, Draw { truncation: top2, ..Draw::new(1.0, u) }, &mut s).unwrap();
            assert_eq!(d.token, want, "u = {u}");
            assert!(
                (f64::from(d.logprob) - (f64::from(logits[want as usize]) - z)).abs() < 1e-6,
                "untruncated log-prob"
            );
        }
        // top-p: the smallest most likely set reaching the mass; min-p: a floor on the ratio
        // to the top token; at least the top token always survives.
        for (t, survivors) in [
            (Truncation { top_p: 0.5, ..Truncation::NONE }, vec![2]),
            (Truncation { top_p: 0.8, ..Truncation::NONE }, vec![2, 0, 3]),
            (Truncation { min_p: 0.3, ..Truncation::NONE }, vec![2, 0, 3]),
            (Truncation { min_p: 0.99, ..Truncation::NONE }, vec![2]),
            (Truncation { top_k: 3, top_p: 0.99, min_p: 0.5 }, vec![2]),
        ] {
            let mut seen = Vec::new();
            for i in 0..200 {
                let d =
                    draw_row(&logits, Draw { truncation: t, ..Draw::new(1.0, f64::from(i) / 200.0) }, &mut s);
                seen.push(d.unwrap().token);
            }
            seen.sort_unstable();
            seen.dedup();
            let mut want = survivors.clone();
            want.sort_unstable();
            assert_eq!(seen, want, "{t:?}");
        }
        // Greedy ignores the truncation.
        let greedy = Draw { truncation: top2, ..Draw::new(0.0, 0.9) };
        assert_eq!(draw_row(&logits, greedy, &mut s).unwrap().token, 2);
    }

    #[test]
    fn rows_without_a_finite_maximum_and_bad_draws_are_errors_naming_them() {
        let mut s = DrawScratch::default();
        let e = draw_row(&[f32::NAN, f32::NEG_INFINITY], Draw::new(1.0, 0.5), &mut s);
        assert!(e.unwrap_err().to_string().contains("no finite maximum"));
        assert!(draw_row(&[], Draw::new(1.0, 0.5), &mut s).unwrap_err().to_string().contains("empty"));
        let ok = Some(Draw::new(1.0, 0.5));
        assert!(check_draws(&[ok, None], 2).is_ok());
        assert!(check_draws(&[ok], 2).unwrap_err().to_string().contains("1 for 2 rows"));
        let hot = Some(Draw::new(-1.0, 0.5));
        assert!(check_draws(&[None, hot], 2).unwrap_err().to_string().contains("draw 1"));
        let wide =
            Some(Draw { truncation: Truncation { top_p: 0.0, ..Truncation::NONE }, ..Draw::new(1.0, 0.5) });
        assert!(check_draws(&[wide], 1).unwrap_err().to_string().contains("top_p 0"));
        let low =
            Some(Draw { truncation: Truncation { min_p: 1.5, ..Truncation::NONE }, ..Draw::new(1.0, 0.5) });
        assert!(check_draws(&[low], 1).unwrap_err().to_string().contains("min_p 1.5"));
        let far = Some(Draw::new(1.0, 1.0));
        assert!(check_draws(&[far], 1).unwrap_err().to_string().contains("[0, 1)"));
        for factor in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let bad = Some(Draw { penalty: Some(Penalty { factor, context: &[1] }), ..Draw::new(1.0, 0.5) });
            let e = check_draws(&[ok, bad], 2).unwrap_err().to_string();
            assert!(e.contains("draw 1") && e.contains("repetition penalty"), "{e}");
        }
    }

    #[test]
    fn the_penalty_comes_first_once_per_distinct_token_and_raw_logprobs_read_the_raw_row() {
        let mut s = DrawScratch::default();
        let logits = [2.0f32, -1.0, 1.5, 0.5];
        // Token 0 repeated and an id past the vocabulary: 2 / 4 = 0.5 and -1 * 4 = -4,
        // each once, so token 2 (1.5) is now the greedy pick.
        let penalty = Penalty { factor: 4.0, context: &[0, 1, 0, 0, 9] };
        let greedy = Draw { penalty: Some(penalty), ..Draw::new(0.0, 0.5) };
        let d = draw_row(&logits, greedy, &mut s).unwrap();
        assert_eq!(d.token, 2);
        let penalised = [0.5f64, -4.0, 1.5, 0.5];
        let z = penalised.iter().map(|x| x.exp()).sum::<f64>().ln();
        assert!((f64::from(d.logprob) - (1.5 - z)).abs() < 1e-6, "the penalised log-prob");
        // Raw: the same token's log-prob under the unpenalised logits at T = 1, whatever
        // the temperature it was drawn at.
        let z_raw = logits.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        for temperature in [0.0, 0.5, 1.0] {
            let raw = Draw { temperature, raw_logprob: true, ..greedy };
            let d = draw_row(&logits, raw, &mut s).unwrap();
            if temperature == 0.0 {
                assert_eq!(d.token, 2);
            }
            let want = f64::from(logits[d.token as usize]) - z_raw;
            assert!((f64::from(d.logprob) - want).abs() < 1e-6, "T = {temperature}");
        }
        // A factor of 1, or no context, changes nothing.
        for penalty in [Penalty { factor: 1.0, context: &[0, 1] }, Penalty { factor: 3.0, context: &[] }] {
            let with = Draw { penalty: Some(penalty), ..Draw::new(0.8, 0.37) };
            assert_eq!(
                draw_row(&logits, with, &mut s).unwrap(),
                draw_row(&logits, Draw::new(0.8, 0.37), &mut s).unwrap()
            );
        }
    }
}
