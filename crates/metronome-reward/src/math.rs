//! Math answer verification: extract the final answer, normalise it, and compare it
//! with the reference.
//!
//! Normalisation handles signs (including the Unicode minus), thousands separators
//! (`1,234`, `1{,}234`, `1\,234`), decimals, exponents, fractions (`3/4`, `\frac{3}{4}`,
//! `\dfrac34`), percentages, simple LaTeX wrappers (`$…$`, `\(…\)`, `\text{…}`,
//! `\mathrm{…}`, `\left`/`\right`, degrees) and trailing units (`12 cm`, `5 dollars`).
//! Answers that are not numbers (`\pi/2`, `x+1`, `(1,2)`) are compared as normalised text.
//!
//! Numbers are compared as exact rationals, so an answer is right only when it has the
//! reference's value: `1,234`, `1234.0` and `\frac{2468}{2}` are all `1234`, while
//! `1235` and `1234.5` are not, however large the numbers. The one tolerance is for a
//! reference written with decimals whose value is not an integer (`3.14159`, `0.333`):
//! it is taken as rounded to the digits given, so an answer within half a unit of its
//! last digit is right (`3.141592` and `3.14159265` for `3.14159`, `1/3` for `0.333`),
//! and one further from it is wrong (`3.1416`, `3.1415`, `0.334`): a less precise
//! answer does not match a more precise reference. See [`MathConfig`] for
//! percentages and the opt-in tolerances.

use serde::{Deserialize, Serialize};

use metronome_core::{Completion, Prompt, Reward, RewardFn};

use crate::error::finite_scores;
use crate::extract::{self, Extractor, tail};
use crate::meter::Meter;
use crate::rational::Rational;
use crate::{Error, Result};

/// Configuration of [`MathVerifier`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MathConfig {
    /// Where to look for the final answer, in order.
    pub extractors: Vec<Extractor>,
    /// Compare every number exactly, decimal references included: `2.5` then accepts
    /// only 2.5 (`2.50`, `5/2`), not `2.54`, and `rel_tol` / `abs_tol` are ignored. By
    /// default a reference written with decimals whose value is not an integer is taken
    /// as rounded, and an answer within half a unit of its last digit is accepted
    /// (`3.141592` for `3.14159`); integer and fraction references are always exact.
    /// Set it for data whose decimal references are exact (sums of decimals, prices):
    /// there the default would accept `2510.2414` for `2510.241`.
    pub exact: bool,
    /// Opt-in relative tolerance on every numeric comparison, integer references
    /// included (default 0: off). A tolerance of `1e-6` accepts `-4174817` for
    /// `-4174816`, so set it only for references that are measurements.
    pub rel_tol: f64,
    /// Opt-in absolute tolerance on every numeric comparison (default 0: off).
    pub abs_tol: f64,
    /// Accept a percentage for its fraction: `50%` for `0.5` and `0.5` for `50%`. The
    /// percent sign alone never makes a difference: `50%` and `50` match each other
    /// whether or not this is set. Two percentages are compared as written (`0.5%`
    /// is not `50%`).
    pub percent_equivalence: bool,
    /// Score of a correct answer.
    pub correct_score: f32,
    /// Score of a wrong answer.
    pub wrong_score: f32,
    /// Score when no answer could be found or parsed.
    pub no_answer_score: f32,
    /// Only the last this many bytes of a completion are searched.
    pub max_input_bytes: usize,
    /// Longer extracted answers are not parsed (and score as no answer).
    pub max_answer_bytes: usize,
    /// Numbers with more digits than this are not numbers.
    pub max_digits: usize,
}

impl Default for MathConfig {
    fn default() -> Self {
        Self {
            extractors: Extractor::ALL.to_vec(),
            exact: false,
            rel_tol: 0.0,
            abs_tol: 0.0,
            percent_equivalence: true,
            correct_score: 1.0,
            wrong_score: 0.0,
            no_answer_score: 0.0,
            max_input_bytes: 64 * 1024,
            max_answer_bytes: 512,
            max_digits: 64,
        }
    }
}

impl MathConfig {
    /// Checks the values and builds the verifier.
    pub fn build(&self) -> Result<MathVerifier> {
        if self.extractors.is_empty() {
            return Err(Error::config("math.extractors", "is empty"));
        }
        for (field, v) in [("math.rel_tol", self.rel_tol), ("math.abs_tol", self.abs_tol)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::config(field, format!("must be a finite number >= 0, got {v}")));
            }
        }
        finite_scores(&[
            ("math.correct_score", self.correct_score),
            ("math.wrong_score", self.wrong_score),
            ("math.no_answer_score", self.no_answer_score),
        ])?;
        if self.max_input_bytes == 0 || self.max_answer_bytes == 0 || self.max_digits == 0 {
            return Err(Error::config("math.max_*", "limits must be positive"));
        }
        Ok(MathVerifier { config: self.clone() })
    }
}

/// A parsed number: exact when it fits a rational, always with a float value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Number {
    /// The exact value, when every part fitted `i128`.
    pub exact: Option<Rational>,
    /// The value as a float.
    pub value: f64,
    /// Written with a percent sign.
    pub percent: bool,
    /// For a number written with decimals whose value is not an integer (`3.14159`,
    /// `12.5%`), half a unit in its last written digit (`1/200000`, `1/20`): as a
    /// reference, it is taken as rounded to that digit. `None` for integers
    /// (`1234`, `1234.0`, `1.5e3`) and fractions (`1/3`), which are exact.
    pub half_unit: Option<Rational>,
}

/// A normalised final answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// A number (units and wrappers stripped).
    Number(Number),
    /// Anything else, as normalised text (wrappers stripped, whitespace removed).
    Text(String),
}

/// The outcome of verifying one completion.
#[derive(Clone, Debug, PartialEq)]
pub enum MathVerdict {
    /// The answer equals the reference.
    Correct,
    /// An answer was found and differs from the reference.
    Wrong,
    /// No answer could be found or parsed.
    NoAnswer,
    /// The prompt's reference answer is missing or unparsable.
    BadReference,
}

/// Verifies final answers of math problems against `Prompt::reference` (or the
/// `answer` metadata field).
#[derive(Clone, Debug)]
pub struct MathVerifier {
    config: MathConfig,
}

impl MathVerifier {
    /// The verifier with the default configuration.
    #[must_use]
    pub fn new() -> Self {
        Self { config: MathConfig::default() }
    }

    /// Its configuration.
    #[must_use]
    pub fn config(&self) -> &MathConfig {
        &self.config
    }

    /// The normalised final answer of `text`, if one is found.
    pub fn answer(&self, text: &str, meter: &mut Meter) -> Option<Answer> {
        let text = tail(text, self.config.max_input_bytes);
        let candidate = extract::extract(text, &self.config.extractors, meter)?;
        parse_answer(candidate, &self.config, meter)
    }

    /// The normalised reference: the marked answer if the reference carries one
    /// (`#### 72` solutions, `\boxed{…}`), else the whole reference.
    pub fn reference(&self, reference: &str, meter: &mut Meter) -> Option<Answer> {
        let reference = tail(reference, self.config.max_input_bytes);
        let candidate =
            extract::extract(reference, &[Extractor::Boxed, Extractor::Hashes, Extractor::AnswerTag], meter)
                .unwrap_or(reference);
        parse_answer(candidate, &self.config, meter)
    }

    /// Verifies `text` against `reference`.
    pub fn verify(&self, text: &str, reference: &str, meter: &mut Meter) -> MathVerdict {
        let Some(expected) = self.reference(reference, meter) else {
            return MathVerdict::BadReference;
        };
        let Some(got) = self.answer(text, meter) else {
            return MathVerdict::NoAnswer;
        };
        if answers_match(&got, &expected, &self.config) { MathVerdict::Correct } else { MathVerdict::Wrong }
    }
}

impl Default for MathVerifier {
    fn default() -> Self {
        Self::new()
    }
}

/// The reference of a prompt: `Prompt::reference`, else the `answer` metadata field.
pub(crate) fn reference_of(prompt: &Prompt) -> Option<&str> {
    prompt.reference.as_deref().or_else(|| prompt.metadata.get("answer").map(String::as_str))
}

impl RewardFn for MathVerifier {
    fn score(&self, prompt: &Prompt, completion: &Completion) -> Reward {
        let c = &self.config;
        let Some(reference) = reference_of(prompt) else {
            return Reward::failed(
                c.no_answer_score,
                format!("prompt {} has no reference answer", prompt.id),
            );
        };
        let verdict = self.verify(&completion.text, reference, &mut Meter::new());
        let (total, correct, answered) = match verdict {
            MathVerdict::Correct => (c.correct_score, 1.0, 1.0),
            MathVerdict::Wrong => (c.wrong_score, 0.0, 1.0),
            MathVerdict::NoAnswer => (c.no_answer_score, 0.0, 0.0),
            MathVerdict::BadReference => {
                return Reward::failed(
                    c.no_answer_score,
                    format!("prompt {} reference answer is not parsable", prompt.id),
                );
            }
        };
        let mut reward = Reward::scalar(total).with_correct(correct);
        reward.parts.insert("answered".into(), answered);
        reward
    }
}

/// Whether `got` equals the reference `expected` under `config`'s comparison (the
/// order matters: only the reference's written digits give a tolerance).
#[must_use]
pub fn answers_match(got: &Answer, expected: &Answer, config: &MathConfig) -> bool {
    match (got, expected) {
        (Answer::Number(a), Answer::Number(b)) => {
            if numbers_equal(a, b, config) {
                return true;
            }
            // Only one side may carry the percent sign: between two percentages a factor
            // of 100 is a wrong answer (`0.5%` for `50%`), not another notation.
            if !config.percent_equivalence || a.percent == b.percent {
                return false;
            }
            if a.percent {
                hundredth(a).is_some_and(|a| numbers_equal(&a, b, config))
            } else {
                hundredth(b).is_some_and(|b| numbers_equal(a, &b, config))
            }
        }
        (Answer::Text(a), Answer::Text(b)) => a == b,
        _ => false,
    }
}

/// `n / 100`, its half unit scaled with it.
fn hundredth(n: &Number) -> Option<Number> {
    let hundred = Rational::integer(100);
    Some(Number {
        exact: Some(n.exact?.checked_div(hundred)?),
        value: n.value / 100.0,
        percent: false,
        half_unit: match n.half_unit {
            Some(h) => Some(h.checked_div(hundred)?),
            None => None,
        },
    })
}

/// Exact equality; within the reference's half unit for a rounded decimal reference;
/// within the opt-in float tolerances when they are set.
fn numbers_equal(got: &Number, expected: &Number, config: &MathConfig) -> bool {
    if let (Some(a), Some(b)) = (got.exact, expected.exact) {
        if a == b {
            return true;
        }
        // The difference is exact too, so the half-unit bound holds at any magnitude;
        // an overflow (values far beyond any written answer) is a mismatch.
        if !config.exact
            && let Some(half) = expected.half_unit
            && a.checked_sub(b).and_then(Rational::checked_abs).is_some_and(|d| d <= half)
        {
            return true;
        }
    }
    if config.exact {
        return false;
    }
    // Floats tell apart only what they can represent, so they decide nothing unless a
    // tolerance was asked for.
    let tolerance = config.abs_tol + config.rel_tol * got.value.abs().max(expected.value.abs());
    tolerance > 0.0 && (got.value - expected.value).abs() <= tolerance
}

/// LaTeX commands whose braces are dropped and whose content is kept.
const WRAPPERS: [&str; 10] =
    ["text", "textbf", "textrm", "mathrm", "mathbf", "mbox", "boxed", "operatorname", "textit", "hbox"];

/// Literal rewrites applied in order; each is one linear pass.
const REWRITES: [(&str, &str); 22] = [
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\displaystyle", ""),
    ("\\left", ""),
    ("\\right", ""),
    ("{,}", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\:", ""),
    ("\\ ", " "),
    ("\\%", "%"),
    ("\\$", ""),
    ("$", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\circ", ""),
    ("°", ""),
    ("\\(", ""),
    ("\\)", ""),
    ("\\[", ""),
    ("\\]", ""),
];

/// Normalises and parses one extracted answer. `None` when it is empty or longer
/// than `config.max_answer_bytes`.
pub fn parse_answer(candidate: &str, config: &MathConfig, meter: &mut Meter) -> Option<Answer> {
    // Markdown emphasis around an answer (`**42**`) is decoration, not content.
    let candidate = candidate.trim().trim_matches(['*', '_']).trim();
    if candidate.is_empty() || candidate.len() > config.max_answer_bytes {
        return None;
    }
    let mut s = unwrap_commands(candidate, meter);
    for (from, to) in REWRITES {
        meter.charge(s.len());
        if s.contains(from) {
            s = s.replace(from, to);
        }
    }
    s = s.replace('\u{2212}', "-").replace('~', " ");
    meter.charge(2 * s.len());
    // `x = 5`, `a+b = 12`: the answer is what follows the last `=`.
    let s = s.rsplit('=').next().unwrap_or(&s).trim();
    let s = s.trim_end_matches(['.', ' ']).trim().trim_matches(['*', '_']).trim();
    if s.is_empty() {
        return None;
    }
    meter.charge(s.len());
    if let Some(n) = parse_number(s, config.max_digits, meter) {
        return Some(Answer::Number(n));
    }
    let text: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    meter.charge(s.len());
    Some(Answer::Text(text))
}

/// Drops `\text{`…`}`-style wrappers (keeping their content) in one pass, with a
/// stack of which braces to drop instead of recursion.
fn unwrap_commands(s: &str, meter: &mut Meter) -> String {
    let mut out = String::with_capacity(s.len());
    let mut drop_close: Vec<bool> = Vec::new();
    let mut rest = s;
    while let Some(c) = rest.chars().next() {
        meter.charge(1);
        if c == '\\' {
            let name_len = rest[1..].bytes().take_while(u8::is_ascii_alphabetic).count();
            let name = &rest[1..1 + name_len];
            let after = &rest[1 + name_len..];
            if WRAPPERS.contains(&name) && after.starts_with('{') {
                drop_close.push(true);
                meter.charge(name_len);
                rest = &after[1..];
                continue;
            }
        }
        // A `}` closes the innermost group: dropped if a wrapper opened it.
        if c == '}' && drop_close.pop() == Some(true) {
            rest = &rest[1..];
            continue;
        }
        if c == '{' {
            drop_close.push(false);
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Parses a whole string as one number with optional sign, currency, percent and
/// trailing units; `None` if anything else remains.
fn parse_number(s: &str, max_digits: usize, meter: &mut Meter) -> Option<Number> {
    let s = s.trim();
    let s = strip_currency(s);
    let (negative, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let s = strip_currency(s.trim_start());
    let (mut number, rest) = if let Some(after) = s.strip_prefix("\\frac") {
        parse_latex_fraction(after, max_digits, meter)?
    } else {
        let (a, rest) = parse_decimal(s, max_digits, meter)?;
        match rest.strip_prefix('/') {
            Some(after) => {
                let (b, rest) = parse_signed_decimal(after.trim_start(), max_digits, meter)?;
                (divide(a, b)?, rest)
            }
            None => (a, rest),
        }
    };
    let mut rest = rest.trim_start();
    if let Some(r) = rest.strip_prefix('%') {
        number.percent = true;
        rest = r.trim_start();
    }
    let spaced = rest.len() < s.len() && s[..s.len() - rest.len()].ends_with(char::is_whitespace);
    if !rest.is_empty() && !is_unit(rest, spaced) {
        return None;
    }
    if negative {
        number.exact = number.exact.and_then(Rational::checked_neg);
        number.value = -number.value;
    }
    Some(number)
}

fn strip_currency(s: &str) -> &str {
    s.trim_start_matches(['$', '£', '€', '¥'])
}

/// Trailing units: words (and `/`, `^2`, `.`) after the number. A single letter glued
/// to the number (`2x`) is a variable, not a unit, so it is not a number.
fn is_unit(rest: &str, spaced: bool) -> bool {
    let first_alpha = rest.chars().next().is_some_and(|c| c.is_alphabetic());
    let glued_letters = rest.chars().take_while(|c| c.is_alphabetic()).count();
    first_alpha
        && (spaced || glued_letters >= 2)
        && rest
            .chars()
            .all(|c| c.is_alphabetic() || matches!(c, ' ' | '/' | '^' | '.' | '2' | '3' | '{' | '}'))
}

fn parse_latex_fraction<'a>(
    after: &'a str,
    max_digits: usize,
    meter: &mut Meter,
) -> Option<(Number, &'a str)> {
    let after = after.trim_start();
    // `\frac{a}{b}` or the short form `\frac12` (one digit each).
    let (num_text, rest) = latex_argument(after, meter)?;
    let rest = rest.trim_start();
    let (den_text, rest) = latex_argument(rest, meter)?;
    let (a, ra) = parse_signed_decimal(num_text.trim(), max_digits, meter)?;
    let (b, rb) = parse_signed_decimal(den_text.trim(), max_digits, meter)?;
    if !ra.trim().is_empty() || !rb.trim().is_empty() {
        return None;
    }
    Some((divide(a, b)?, rest))
}

fn latex_argument<'a>(s: &'a str, meter: &mut Meter) -> Option<(&'a str, &'a str)> {
    if s.starts_with('{') {
        let (inner, end) = extract::braced(s, 0, meter)?;
        Some((inner, &s[end..]))
    } else {
        let c = s.chars().next().filter(char::is_ascii_digit)?;
        Some((&s[..c.len_utf8()], &s[c.len_utf8()..]))
    }
}

fn divide(a: Number, b: Number) -> Option<Number> {
    if b.value == 0.0 {
        return None;
    }
    Some(Number {
        exact: a.exact.zip(b.exact).and_then(|(a, b)| a.checked_div(b)),
        value: a.value / b.value,
        percent: false,
        half_unit: None,
    })
}

fn parse_signed_decimal<'a>(s: &'a str, max_digits: usize, meter: &mut Meter) -> Option<(Number, &'a str)> {
    let (negative, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let (mut n, rest) = parse_decimal(s, max_digits, meter)?;
    if negative {
        n.exact = n.exact.and_then(Rational::checked_neg);
        n.value = -n.value;
    }
    Some((n, rest))
}

/// `1234`, `1,234,567`, `3.25`, `.5`, `1.5e3`: digits with thousands separators in
/// groups of three, an optional fraction and an optional exponent.
fn parse_decimal<'a>(s: &'a str, max_digits: usize, meter: &mut Meter) -> Option<(Number, &'a str)> {
    let b = s.as_bytes();
    let mut i = 0;
    let mut int_digits = String::new();
    while i < b.len() {
        meter.charge(1);
        if b[i].is_ascii_digit() {
            int_digits.push(b[i] as char);
            i += 1;
        } else if b[i] == b',' && !int_digits.is_empty() && group_of_three(&b[i + 1..]) {
            i += 1;
        } else {
            break;
        }
    }
    let mut frac_digits = String::new();
    if b.get(i) == Some(&b'.') && b.get(i + 1).is_some_and(u8::is_ascii_digit) {
        i += 1;
        while i < b.len() && b[i].is_ascii_digit() {
            meter.charge(1);
            frac_digits.push(b[i] as char);
            i += 1;
        }
    }
    if int_digits.is_empty() && frac_digits.is_empty() {
        return None;
    }
    if int_digits.len() + frac_digits.len() > max_digits {
        return None;
    }
    let mut exponent: i32 = 0;
    if matches!(b.get(i), Some(b'e' | b'E')) {
        let mut j = i + 1;
        let negative = match b.get(j) {
            Some(b'-') => {
                j += 1;
                true
            }
            Some(b'+') => {
                j += 1;
                false
            }
            _ => false,
        };
        let digits_start = j;
        while j < b.len() && b[j].is_ascii_digit() && j - digits_start < 4 {
            meter.charge(1);
            j += 1;
        }
        if j > digits_start && !b.get(j).is_some_and(u8::is_ascii_digit) {
            let e: i32 = s[digits_start..j].parse().ok()?;
            exponent = if negative { -e } else { e };
            i = j;
        }
    }
    let digits = format!("{int_digits}{frac_digits}");
    let mantissa: Option<i128> = digits.parse().ok();
    let scale = exponent - frac_digits.len() as i32;
    let exact = mantissa.and_then(|m| {
        let pow = 10i128.checked_pow(scale.unsigned_abs())?;
        if scale >= 0 { Rational::new(m.checked_mul(pow)?, 1) } else { Rational::new(m, pow) }
    });
    let value: f64 = format!(
        "{}.{}e{}",
        if int_digits.is_empty() { "0" } else { &int_digits },
        if frac_digits.is_empty() { "0" } else { &frac_digits },
        exponent
    )
    .parse()
    .ok()?;
    if !value.is_finite() {
        return None;
    }
    // `3.14159` stands for a value rounded to its last digit; `2.0` and `1.5e3` are
    // integers, exact whatever their notation.
    let half_unit = match exact {
        Some(x) if scale < 0 && !x.is_integer() => {
            10i128.checked_pow(scale.unsigned_abs()).and_then(|p| Rational::new(1, p.checked_mul(2)?))
        }
        _ => None,
    };
    Some((Number { exact, value, percent: false, half_unit }, &s[i..]))
}

/// A thousands group: exactly three digits, then no fourth.
fn group_of_three(b: &[u8]) -> bool {
    b.len() >= 3 && b[..3].iter().all(u8::is_ascii_digit) && !b.get(3).is_some_and(u8::is_ascii_digit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn num(s: &str) -> Option<f64> {
        match parse_answer(s, &MathConfig::default(), &mut Meter::new()) {
            Some(Answer::Number(n)) => Some(n.value),
            _ => None,
        }
    }

    #[test]
    fn parses_number_forms() {
        assert_eq!(num("1,234,567"), Some(1_234_567.0));
        assert_eq!(num("-3.25"), Some(-3.25));
        assert_eq!(num(".5"), Some(0.5));
        assert_eq!(num("1.5e3"), Some(1500.0));
        assert_eq!(num(r"\frac{3}{4}"), Some(0.75));
        assert_eq!(num(r"-\dfrac{1}{2}"), Some(-0.5));
        assert_eq!(num(r"\frac12"), Some(0.5));
        assert_eq!(num("3/4"), Some(0.75));
        assert_eq!(num(r"\$1{,}000"), Some(1000.0));
        assert_eq!(num(r"12\text{ cm}"), Some(12.0));
        assert_eq!(num("5 dollars"), Some(5.0));
        assert_eq!(num(r"90^\circ"), Some(90.0));
        assert_eq!(num("x = 7"), Some(7.0));
        assert_eq!(num("2x"), None);
        assert_eq!(num("1,23"), None);
        assert_eq!(num("1/0"), None);
    }

    fn number(s: &str) -> Number {
        match parse_answer(s, &MathConfig::default(), &mut Meter::new()) {
            Some(Answer::Number(n)) => n,
            other => panic!("{s}: not a number: {other:?}"),
        }
    }

    #[test]
    fn decimals_are_exact() {
        assert_eq!(number("0.1").exact, Rational::new(1, 10));
    }

    #[test]
    fn only_non_integer_decimals_carry_a_half_unit() {
        for (text, half_unit) in [
            ("3.14159", Rational::new(1, 200_000)),
            ("-0.5", Rational::new(1, 20)),
            (r"12.5\%", Rational::new(1, 20)),
            ("1.25e1", Rational::new(1, 20)),
            ("1,234.50", Rational::new(1, 200)),
            ("1234", None),
            ("1234.0", None),
            ("1.5e3", None),
            ("1/3", None),
            (r"\frac{5}{2}", None),
        ] {
            assert_eq!(number(text).half_unit, half_unit, "{text}");
        }
    }

    #[test]
    fn unwraps_nested_wrappers() {
        assert_eq!(unwrap_commands(r"\text{\textbf{5}} m", &mut Meter::new()), "5 m");
        assert_eq!(unwrap_commands(r"\frac{1}{2}", &mut Meter::new()), r"\frac{1}{2}");
    }
}
