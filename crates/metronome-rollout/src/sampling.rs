//! Seeded token sampling: temperature, top-k, top-p, min-p, repetition penalty, greedy
//! decoding at temperature 0, and the behaviour log-prob of every sampled token.
//!
//! # Randomness
//! Every response has its own seed, `metronome_core::sample_seed(run, version, prompt,
//! sample_index)`. Its `k`-th generated token consumes exactly one uniform number, the
//! `k`-th output of a SplitMix64 counter stream started at that seed ([`TokenRng`]). The
//! draw therefore depends on the seed and on `k` only: not on the worker, the slot, the
//! batch, or how many tokens other responses have drawn.
//!
//! # Where tokens are drawn
//! Every setting here but the stop rules is a [`metronome_model::Draw`]
//! ([`SamplingConfig::draw`]), which a decode step draws where its logits are (on a GPU
//! by CUDA kernels, so `[slots, vocab]` logits never cross to the host; the context a
//! repetition penalty reads goes the other way, as its distinct ids). [`Sampler`] is
//! the same arithmetic on the host (`metronome_model::draw::draw_row`), for a row a
//! step hands back as logits, so both give the same token and log-prob from the same
//! logits.
//!
//! # Behaviour log-probs
//! The log-prob recorded for a sampled token is taken from the log-softmax of the
//! logits *after* the repetition penalty and the temperature, and *before* top-k,
//! top-p and min-p truncation: `log_softmax(penalised_logits / T)[token]`. At
//! temperature 0 (greedy) the temperature is taken as 1, i.e. the log-prob is that of
//! the model's own distribution (with the repetition penalty). Without a penalty or
//! truncation this is exactly the policy's log-prob at temperature `T`, which is what
//! the trainer scores (it is given the same temperature) and what importance-sampling
//! corrections compare against; the pipeline refuses truncation, a penalty or greedy
//! decoding wherever the trainer reads these log-probs.
//!
//! A server may be asked for the log-probs of the raw distribution instead
//! ([`LogprobsMode::Raw`]: `log_softmax(logits)[token]` at temperature 1, before the
//! penalty, the temperature and truncation), as vLLM returns them unless started with
//! `--logprobs-mode processed_logprobs`. At a temperature other than 1 they are not
//! the sampled distribution's: the trainer's train–rollout mismatch metrics show it.
//!
//! # Truncation order
//! Top-k first; then top-p over the top-k candidates renormalised (the smallest set,
//! in order of decreasing probability, whose mass reaches `top_p`); then min-p (keep
//! tokens with probability at least `min_p` times the most likely token's). At least
//! one token always survives. Ties are broken by the lower token id, so the order is
//! total and the result deterministic. The definition is
//! `metronome_model::draw::invert_truncated`, which a decode step drawing on its device
//! follows too.

use metronome_core::{TokenId, mix64};
use metronome_model::draw::{DrawScratch, draw_row};
use metronome_model::{Draw, Penalty, Truncation};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The golden-ratio increment of SplitMix64.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The uniform numbers of one response: a SplitMix64 counter stream from its seed.
///
/// `uniform(k)` is a pure function of the seed and `k`, so a response regenerated
/// on another worker, slot or batch draws the same numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRng {
    seed: u64,
}

impl TokenRng {
    /// The stream of a response with the given seed (from `metronome_core::sample_seed`).
    #[must_use]
    pub const fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// The seed.
    #[must_use]
    pub const fn seed(self) -> u64 {
        self.seed
    }

    /// The uniform number in `[0, 1)` used by the `k`-th generated token (53 random bits).
    #[must_use]
    pub fn uniform(self, k: u64) -> f64 {
        let z = mix64(self.seed.wrapping_add(k.wrapping_add(1).wrapping_mul(GOLDEN)));
        (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Which log-prob a sampled token records (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogprobsMode {
    /// Of the distribution the token was drawn from (after the repetition penalty
    /// and the temperature, before truncation): what the trainer scores.
    #[default]
    Sampled,
    /// Of the model's raw distribution, `log_softmax(logits)` at temperature 1 before
    /// any processing (vLLM's default `raw_logprobs`).
    Raw,
}

/// The smallest positive temperature. Logits are divided by it in f32, here and in
/// the trainer (whose gradients it multiplies): far below it a logit of ordinary size
/// leaves f32's range (`1 / 1e-39` is already infinite) and the softmax turns to NaN,
/// while greedy decoding, which such a temperature approaches, is `0`.
pub const MIN_TEMPERATURE: f32 = 1e-3;
/// The largest temperature: beyond it every token is equally likely to within f32's
/// rounding of the scaled logits, so a larger value changes nothing but the risk.
pub const MAX_TEMPERATURE: f32 = 1e3;
/// The repetition penalty's range: it divides or multiplies logits as the temperature
/// does, with the same limits to f32's range.
pub const MIN_PENALTY: f32 = 1e-3;
/// See [`MIN_PENALTY`].
pub const MAX_PENALTY: f32 = 1e3;

/// How tokens are chosen and when a response ends. Serde form of the pipeline's
/// `[rollout.sampling]` table; every field has a default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingConfig {
    /// Softmax temperature; `0` means greedy (argmax) decoding.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`;
    /// `1` disables.
    pub top_p: f32,
    /// Keep tokens whose probability is at least `min_p` times the top token's; `0` disables.
    pub min_p: f32,
    /// Hugging Face-style repetition penalty on every token of the prompt and the
    /// response so far (positive logits divided by it, negative multiplied); `1` disables.
    pub repetition_penalty: f32,
    /// Maximum tokens generated per response (the context length also bounds it).
    pub max_new_tokens: usize,
    /// Token ids that end a response (and are kept as its last token). `None` uses the
    /// tokenizer's stop tokens.
    pub stop_token_ids: Option<Vec<TokenId>>,
    /// Strings that end a response when they appear in its decoded text.
    pub stop_strings: Vec<String>,
    /// Keep the stop string in the completion's text (the tokens always keep it).
    pub include_stop_str_in_output: bool,
    /// Ignore stop tokens (generate until `max_new_tokens` or a stop string).
    pub ignore_eos: bool,
    /// Which log-prob each sampled token records. Not a run setting (never read
    /// from or written to a config file): a server sets it for its requests
    /// (`ServerConfig::logprobs`, `metronome serve --logprobs`).
    #[serde(skip)]
    pub logprobs: LogprobsMode,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            max_new_tokens: 256,
            stop_token_ids: None,
            stop_strings: Vec::new(),
            include_stop_str_in_output: false,
            ignore_eos: false,
            logprobs: LogprobsMode::Sampled,
        }
    }
}

impl SamplingConfig {
    /// Greedy decoding (temperature 0) with otherwise default settings.
    #[must_use]
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t == 0.0 || (MIN_TEMPERATURE..=MAX_TEMPERATURE).contains(&t)) {
            return Err(Error::config(
                "sampling.temperature",
                format!("is {t} (expected 0 for greedy decoding, or {MIN_TEMPERATURE} to {MAX_TEMPERATURE})"),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::config("sampling.top_p", format!("is {} (expected in (0, 1])", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::config("sampling.min_p", format!("is {} (expected in [0, 1])", self.min_p)));
        }
        if !(MIN_PENALTY..=MAX_PENALTY).contains(&self.repetition_penalty) {
            return Err(Error::config(
                "sampling.repetition_penalty",
                format!("is {} (expected {MIN_PENALTY} to {MAX_PENALTY})", self.repetition_penalty),
            ));
        }
        if self.max_new_tokens == 0 {
            return Err(Error::config("sampling.max_new_tokens", "is 0 (expected >= 1)"));
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return Err(Error::config("sampling.stop_strings", "contains an empty string"));
        }
        Ok(())
    }

    /// The draw of a response under these settings whose next token's uniform number
    /// is `u` and whose context (prompt and response so far, which a repetition penalty
    /// reads) is `context`: what a decode step draws where the logits are, and what
    /// [`Sampler::sample`] draws on the host.
    #[must_use]
    pub fn draw<'a>(&self, u: f64, context: &'a [TokenId]) -> Draw<'a> {
        Draw {
            temperature: self.temperature,
            u,
            truncation: self.truncation(),
            penalty: (self.repetition_penalty != 1.0)
                .then_some(Penalty { factor: self.repetition_penalty, context }),
            raw_logprob: self.logprobs == LogprobsMode::Raw,
        }
    }

    /// Top-k, top-p and min-p as a draw applies them.
    fn truncation(&self) -> Truncation {
        Truncation {
            top_k: u32::try_from(self.top_k).unwrap_or(u32::MAX),
            top_p: self.top_p,
            min_p: self.min_p,
        }
    }
}

/// A sampled token and its behaviour log-prob (see the module docs for which distribution).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: TokenId,
    /// Its log-prob under the penalised, temperature-scaled, untruncated distribution
    /// (or the raw one, with [`LogprobsMode::Raw`]).
    pub logprob: f32,
}

/// Chooses tokens from logits on the host, as a decode step draws them; owns scratch
/// buffers so a worker allocates once.
#[derive(Debug, Default)]
pub struct Sampler {
    scratch: DrawScratch,
}

impl Sampler {
    /// A sampler with empty scratch buffers.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Samples one token from `logits` with the uniform number `u` in `[0, 1)`.
    /// `context` holds the prompt and the response so far, for the repetition penalty.
    ///
    /// Errors when the logits are empty or contain no finite value.
    pub fn sample(
        &mut self,
        cfg: &SamplingConfig,
        logits: &[f32],
        context: &[TokenId],
        u: f64,
    ) -> Result<Sampled> {
        if logits.is_empty() {
            return Err(Error::model("empty logits row"));
        }
        match draw_row(logits, cfg.draw(u, context), &mut self.scratch) {
            Ok(d) => Ok(Sampled { token: d.token, logprob: d.logprob }),
            Err(e) => Err(Error::model(format!("cannot sample: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probs(logits: &[f32]) -> Vec<f64> {
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits.iter().map(|&x| (f64::from(x) - f64::from(m)).exp()).collect();
        let s: f64 = w.iter().sum();
        w.iter().map(|x| x / s).collect()
    }

    const LOGITS: [f32; 8] = [1.0, 2.5, 0.3, -1.0, 2.0, 0.0, 1.7, -0.5];

    fn draw(cfg: &SamplingConfig, n: u64) -> Vec<u64> {
        let mut s = Sampler::new();
        let rng = TokenRng::new(0x1234);
        let mut counts = vec![0u64; LOGITS.len()];
        for k in 0..n {
            let t = s.sample(cfg, &LOGITS, &[], rng.uniform(k)).unwrap();
            counts[t.token as usize] += 1;
        }
        counts
    }

    /// Pearson's chi-square statistic of `counts` against `expected` probabilities
    /// (categories with zero expectation must have zero counts).
    fn chi_square(counts: &[u64], expected: &[f64]) -> (f64, usize) {
        let n: u64 = counts.iter().sum();
        let mut stat = 0.0;
        let mut df = 0;
        for (&c, &p) in counts.iter().zip(expected) {
            if p == 0.0 {
                assert_eq!(c, 0, "a token of zero probability was drawn");
                continue;
            }
            let e = p * n as f64;
            stat += (c as f64 - e).powi(2) / e;
            df += 1;
        }
        (stat, df - 1)
    }

    /// Upper 0.1% quantiles of chi-square for 1..=7 degrees of freedom.
    const CHI2_999: [f64; 8] = [0.0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32];

    #[test]
    fn uniforms_are_in_range_and_look_uniform() {
        let rng = TokenRng::new(7);
        let mut bins = [0u64; 10];
        for k in 0..100_000 {
            let u = rng.uniform(k);
            assert!((0.0..1.0).contains(&u));
            bins[(u * 10.0) as usize] += 1;
        }
        let (stat, df) = chi_square(&bins, &[0.1; 10]);
        assert_eq!(df, 9);
        assert!(stat < 27.88, "chi-square {stat} over 9 df");
        assert_ne!(TokenRng::new(7).uniform(0), TokenRng::new(8).uniform(0));
    }

    #[test]
    fn temperature_zero_is_argmax_with_logprob_of_the_model() {
        let mut s = Sampler::new();
        let cfg = SamplingConfig::greedy();
        for u in [0.0, 0.3, 0.999] {
            let t = s.sample(&cfg, &LOGITS, &[], u).unwrap();
            assert_eq!(t.token, 1);
            assert!((f64::from(t.logprob) - probs(&LOGITS)[1].ln()).abs() < 1e-6);
        }
        // Ties go to the lower id.
        let t = s.sample(&cfg, &[0.0, 3.0, 3.0], &[], 0.5).unwrap();
        assert_eq!(t.token, 1);
    }

    #[test]
    fn frequencies_match_the_distribution() {
        let n = 40_000;
        for temperature in [1.0f32, 0.7, 1.5] {
            let cfg = SamplingConfig { temperature, ..SamplingConfig::default() };
            let scaled: Vec<f32> = LOGITS.iter().map(|x| x / temperature).collect();
            let (stat, df) = chi_square(&draw(&cfg, n), &probs(&scaled));
            assert!(stat < CHI2_999[df], "T={temperature}: chi-square {stat} over {df} df");
        }
        // Top-k 3 renormalised: tokens 1 (2.5), 4 (2.0), 6 (1.7).
        let cfg = SamplingConfig { top_k: 3, ..SamplingConfig::default() };
        let mut expected = vec![0.0; 8];
        let p = probs(&[2.5, 2.0, 1.7]);
        for (i, t) in [1, 4, 6].into_iter().enumerate() {
            expected[t] = p[i];
        }
        let (stat, df) = chi_square(&draw(&cfg, n), &expected);
        assert!(stat < CHI2_999[df], "top-k: chi-square {stat} over {df} df");
    }

    #[test]
    fn raw_logprobs_are_of_the_unscaled_distribution() {
        let p1 = probs(&LOGITS);
        for temperature in [0.5f32, 1.0, 2.0] {
            let cfg =
                SamplingConfig { temperature, logprobs: LogprobsMode::Raw, ..SamplingConfig::default() };
            let sampled = SamplingConfig { logprobs: LogprobsMode::Sampled, ..cfg.clone() };
            for u in [0.05, 0.5, 0.95] {
                let raw = Sampler::new().sample(&cfg, &LOGITS, &[], u).unwrap();
                let at_t = Sampler::new().sample(&sampled, &LOGITS, &[], u).unwrap();
                assert_eq!(raw.token, at_t.token, "the mode changes only what is recorded");
                assert!((f64::from(raw.logprob) - p1[raw.token as usize].ln()).abs() < 1e-6);
                if temperature != 1.0 {
                    assert!((raw.logprob - at_t.logprob).abs() > 1e-3, "T = {temperature}");
                }
            }
        }
    }

    #[test]
    fn logprob_is_before_truncation() {
        let mut s = Sampler::new();
        let cfg = SamplingConfig { temperature: 0.5, top_k: 2, ..SamplingConfig::default() };
        let scaled: Vec<f32> = LOGITS.iter().map(|x| x / 0.5).collect();
        let p = probs(&scaled);
        for k in 0..50 {
            let t = s.sample(&cfg, &LOGITS, &[], TokenRng::new(3).uniform(k)).unwrap();
            assert!((f64::from(t.logprob) - p[t.token as usize].ln()).abs() < 1e-5);
        }
    }

    #[test]
    fn truncation_never_emits_excluded_tokens() {
        let p = probs(&LOGITS);
        let mut sorted: Vec<usize> = (0..8).collect();
        sorted.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let cases = [
            (SamplingConfig { top_k: 2, ..SamplingConfig::default() }, vec![1, 4]),
            // top-p 0.5: p(1) = 0.34, p(4) = 0.21 -> {1, 4} reaches 0.5.
            (SamplingConfig { top_p: 0.5, ..SamplingConfig::default() }, vec![1, 4]),
            // min-p 0.5: p_i >= 0.5 p_max <=> logit >= 2.5 - ln 2 = 1.807 -> {1, 4}.
            (SamplingConfig { min_p: 0.5, ..SamplingConfig::default() }, vec![1, 4]),
            (SamplingConfig { min_p: 0.4, ..SamplingConfig::default() }, vec![1, 4, 6]),
            (SamplingConfig { top_k: 4, top_p: 0.9, min_p: 0.3, ..SamplingConfig::default() }, vec![1, 4, 6]),
        ];
        assert!(p[1] + p[4] >= 0.5 && p[1] < 0.5, "fixture assumption");
        for (cfg, allowed) in cases {
            let counts = draw(&cfg, 5_000);
            for (t, &c) in counts.iter().enumerate() {
                if allowed.contains(&t) {
                    assert!(c > 0, "{cfg:?}: allowed token {t} never drawn");
                } else {
                    assert_eq!(c, 0, "{cfg:?}: excluded token {t} drawn {c} times");
                }
            }
        }
        assert_eq!(sorted[0], 1);
    }

    #[test]
    fn every_setting_but_the_stop_rules_reaches_the_draw() {
        // A decode step draws what `draw` gives it; a setting lost here would be sampled
        // by the step as if it were not set.
        let context = [3, 1, 3];
        let cfg = SamplingConfig {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.8,
            min_p: 0.05,
            repetition_penalty: 1.3,
            logprobs: LogprobsMode::Raw,
            ..SamplingConfig::default()
        };
        let d = cfg.draw(0.25, &context);
        assert_eq!((d.temperature, d.u), (0.7, 0.25));
        assert_eq!(d.truncation, Truncation { top_k: 5, top_p: 0.8, min_p: 0.05 });
        assert_eq!(d.penalty, Some(Penalty { factor: 1.3, context: &context }));
        assert!(d.raw_logprob);
        // No penalty at 1, no truncation by default, sampled log-probs by default.
        let plain = SamplingConfig::default().draw(0.25, &context);
        assert_eq!(plain, Draw::new(1.0, 0.25));
        assert!(!plain.truncates());
        // A top-k beyond u32 keeps every token, as `0` does not: it saturates.
        let wide = SamplingConfig { top_k: usize::MAX, ..SamplingConfig::default() };
        assert_eq!(wide.draw(0.5, &[]).truncation.top_k, u32::MAX);
    }

    #[test]
    fn repetition_penalty_follows_hugging_face() {
        let mut s = Sampler::new();
        let cfg = SamplingConfig { temperature: 0.0, repetition_penalty: 2.0, ..SamplingConfig::default() };
        // Token 1 (2.5 -> 1.25) now loses to token 4 (2.0); a negative logit gets more negative.
        let t = s.sample(&cfg, &LOGITS, &[1, 1, 3], 0.0).unwrap();
        assert_eq!(t.token, 4);
        let mut expected = LOGITS.to_vec();
        expected[1] = 1.25;
        expected[3] = -2.0;
        assert!((f64::from(t.logprob) - probs(&expected)[4].ln()).abs() < 1e-6);
    }

    #[test]
    fn bad_logits_and_configs_are_errors() {
        let mut s = Sampler::new();
        let cfg = SamplingConfig::default();
        assert!(s.sample(&cfg, &[], &[], 0.5).is_err());
        assert!(s.sample(&cfg, &[f32::NAN, f32::NEG_INFINITY], &[], 0.5).is_err());
        // Infinite-negative entries are simply never drawn.
        let t = s.sample(&cfg, &[f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY], &[], 0.99).unwrap();
        assert_eq!(t.token, 1);
        for bad in [
            SamplingConfig { temperature: -1.0, ..cfg.clone() },
            SamplingConfig { top_p: 0.0, ..cfg.clone() },
            SamplingConfig { min_p: 1.5, ..cfg.clone() },
            SamplingConfig { max_new_tokens: 0, ..cfg.clone() },
            SamplingConfig { stop_strings: vec![String::new()], ..cfg.clone() },
        ] {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.starts_with("config field `sampling."), "{err}");
        }
    }
}
