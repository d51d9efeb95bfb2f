//! Countdown: the completion's arithmetic expression must use every given number
//! exactly once (as the standard task states; a subset is an option) and evaluate
//! exactly to the target. A number not given, or used more often than given, makes
//! the expression invalid.
//!
//! The expression is parsed and evaluated in one recursive-descent pass with exact
//! [`Rational`] arithmetic. The parser bounds its own work: the expression length, the
//! nesting depth (parentheses and unary signs), and the size of every number are
//! limited, and every step is charged to a [`Meter`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use metronome_core::{Completion, Prompt, Reward, RewardFn};

use crate::error::finite_scores;
use crate::extract::{Extractor, tail};
use crate::meter::Meter;
use crate::rational::Rational;
use crate::{Error, Result};

/// Configuration of [`CountdownChecker`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CountdownConfig {
    /// Metadata field with the available numbers (`[3, 7, 25]`, `3,7,25` or `3 7 25`).
    pub numbers_field: String,
    /// Metadata field with the target.
    pub target_field: String,
    /// Score when the expression is valid and hits the target.
    pub correct_score: f32,
    /// Score when the expression is valid but evaluates to another value.
    pub format_score: f32,
    /// Score when no valid expression is found.
    pub invalid_score: f32,
    /// Every given number must be used exactly once (default), as the standard task
    /// says; `false` also accepts expressions that leave some out, as the television
    /// game does. Either way a number may not be used more often than it is given.
    pub require_all_numbers: bool,
    /// Reject expressions whose intermediate results are not integers (`6/(1-3/4)`).
    pub integer_intermediates: bool,
    /// Allow unary minus (`-3+5`, `8*(-5+6)`; default). It reaches no positive target
    /// that subtraction cannot, so it is notation, not a loophole.
    pub allow_unary_minus: bool,
    /// Longer expressions are rejected unparsed.
    pub max_expression_bytes: usize,
    /// Deeper nesting is rejected.
    pub max_depth: usize,
    /// Numbers with more digits are rejected.
    pub max_digits: usize,
    /// Only the last this many bytes of a completion are searched.
    pub max_input_bytes: usize,
}

impl Default for CountdownConfig {
    fn default() -> Self {
        Self {
            numbers_field: "numbers".into(),
            target_field: "target".into(),
            correct_score: 1.0,
            format_score: 0.1,
            invalid_score: 0.0,
            require_all_numbers: true,
            integer_intermediates: false,
            allow_unary_minus: true,
            max_expression_bytes: 256,
            max_depth: 32,
            max_digits: 12,
            max_input_bytes: 64 * 1024,
        }
    }
}

impl CountdownConfig {
    /// Checks the values and builds the checker.
    pub fn build(&self) -> Result<CountdownChecker> {
        finite_scores(&[
            ("countdown.correct_score", self.correct_score),
            ("countdown.format_score", self.format_score),
            ("countdown.invalid_score", self.invalid_score),
        ])?;
        if self.max_expression_bytes == 0 || self.max_depth == 0 || self.max_input_bytes == 0 {
            return Err(Error::config("countdown.max_*", "limits must be positive"));
        }
        if !(1..=30).contains(&self.max_digits) {
            return Err(Error::config("countdown.max_digits", "must be in 1..=30"));
        }
        Ok(CountdownChecker { config: self.clone() })
    }
}

/// Why an expression is not a valid countdown answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    /// No expression was found in the completion.
    #[error("no expression found")]
    NoExpression,
    /// The expression is longer than the limit.
    #[error("expression longer than {0} bytes")]
    TooLong(usize),
    /// Nesting deeper than the limit.
    #[error("nesting deeper than {0}")]
    TooDeep(usize),
    /// A number with more digits than the limit.
    #[error("number longer than {0} digits")]
    NumberTooLong(usize),
    /// Not an arithmetic expression; the byte offset of the problem.
    #[error("syntax error at byte {0}")]
    Syntax(usize),
    /// A unary sign while those are not allowed.
    #[error("unary minus at byte {0}")]
    UnaryMinus(usize),
    /// A number that is not among the given ones.
    #[error("uses {0}, which is not given")]
    UnknownNumber(i128),
    /// A given number used more often than it was given.
    #[error("uses {0} more often than given")]
    ReusedNumber(i128),
    /// Some given numbers are unused while all are required.
    #[error("leaves given numbers unused")]
    UnusedNumbers,
    /// Division by zero.
    #[error("divides by zero")]
    DivisionByZero,
    /// A non-integer intermediate while integers are required.
    #[error("has the non-integer intermediate {0}")]
    NonInteger(Rational),
    /// An intermediate does not fit the exact arithmetic.
    #[error("overflows")]
    Overflow,
}

/// The outcome of checking one completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CountdownVerdict {
    /// A valid expression equal to the target.
    Correct,
    /// A valid expression with another value.
    WrongValue(Rational),
    /// No valid expression.
    Invalid(Invalid),
}

/// Checks countdown answers against the prompt's `numbers` and `target` metadata.
#[derive(Clone, Debug, Default)]
pub struct CountdownChecker {
    config: CountdownConfig,
}

impl CountdownChecker {
    /// The checker with the default configuration.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks the expression in `text` against `numbers` and `target`.
    pub fn check(
        &self,
        text: &str,
        numbers: &[i128],
        target: Rational,
        meter: &mut Meter,
    ) -> CountdownVerdict {
        let text = tail(text, self.config.max_input_bytes);
        let Some(expr) = expression_of(text, meter) else {
            return CountdownVerdict::Invalid(Invalid::NoExpression);
        };
        match self.evaluate(expr, numbers, meter) {
            Ok(v) if v == target => CountdownVerdict::Correct,
            Ok(v) => CountdownVerdict::WrongValue(v),
            Err(e) => CountdownVerdict::Invalid(e),
        }
    }

    /// Evaluates one bare arithmetic expression over any numbers (`+ - * /`,
    /// parentheses, exact rationals, the configured limits): the calculator tool of
    /// the multi-turn environments. Never evaluates anything but arithmetic.
    pub fn evaluate_any(&self, expr: &str, meter: &mut Meter) -> Result<Rational, Invalid> {
        let c = &self.config;
        if expr.len() > c.max_expression_bytes {
            return Err(Invalid::TooLong(c.max_expression_bytes));
        }
        let mut parser = Parser {
            src: expr.as_bytes(),
            pos: 0,
            depth: 0,
            config: c,
            available: BTreeMap::new(),
            any_number: true,
            meter,
        };
        let value = parser.expr()?;
        parser.skip_space();
        if parser.pos != parser.src.len() {
            return Err(Invalid::Syntax(parser.pos));
        }
        Ok(value)
    }

    /// Evaluates one bare expression with the given numbers.
    pub fn evaluate(&self, expr: &str, numbers: &[i128], meter: &mut Meter) -> Result<Rational, Invalid> {
        let c = &self.config;
        if expr.len() > c.max_expression_bytes {
            return Err(Invalid::TooLong(c.max_expression_bytes));
        }
        let mut available: BTreeMap<i128, usize> = BTreeMap::new();
        for &n in numbers {
            *available.entry(n).or_default() += 1;
        }
        let mut parser =
            Parser { src: expr.as_bytes(), pos: 0, depth: 0, config: c, available, any_number: false, meter };
        let value = parser.expr()?;
        parser.skip_space();
        if parser.pos != parser.src.len() {
            return Err(Invalid::Syntax(parser.pos));
        }
        if c.require_all_numbers && parser.available.values().any(|&n| n > 0) {
            return Err(Invalid::UnusedNumbers);
        }
        Ok(value)
    }
}

/// The expression in a completion: the last `<answer>…</answer>`, else the last
/// `\boxed{…}`, else the last non-empty line (a `\boxed{…}` inside the answer tags is
/// unwrapped too). Text before the first digit, bracket or leading minus sign and
/// after an `=` is dropped (`The answer is (3+5)*4 = 32.` gives `(3+5)*4`).
fn expression_of<'a>(text: &'a str, meter: &mut Meter) -> Option<&'a str> {
    meter.charge(2 * text.len());
    let region = match text.rfind("</answer>") {
        Some(close) => {
            let open = text[..close].rfind("<answer>")? + "<answer>".len();
            let inner = &text[open..close];
            Extractor::Boxed.find(inner, meter).unwrap_or(inner)
        }
        None => match Extractor::Boxed.find(text, meter) {
            Some(boxed) => boxed,
            None => text.lines().rev().find(|l| !l.trim().is_empty())?,
        },
    };
    let start = region.find(|c: char| c.is_ascii_digit() || c == '(' || c == '[')?;
    // Keep a sign written right before the first number or bracket (`-5 + 8`).
    let before = region[..start].trim_end();
    let start = match before.chars().next_back() {
        Some(sign @ ('-' | '\u{2212}')) => before.len() - sign.len_utf8(),
        _ => start,
    };
    let expr = &region[start..];
    let expr = expr.split('=').next().unwrap_or(expr);
    let expr = expr.trim().trim_end_matches(['.', '!', '$']).trim();
    (!expr.is_empty()).then_some(expr)
}

struct Parser<'a, 'm> {
    src: &'a [u8],
    pos: usize,
    depth: usize,
    config: &'a CountdownConfig,
    available: BTreeMap<i128, usize>,
    /// Every number is allowed, any number of times (the calculator).
    any_number: bool,
    meter: &'m mut Meter,
}

impl Parser<'_, '_> {
    fn skip_space(&mut self) {
        while self.pos < self.src.len() && self.src[self.pos].is_ascii_whitespace() {
            self.meter.charge(1);
            self.pos += 1;
        }
    }

    /// The next operator, also accepting `×`, `÷`, `·`, `−`, `x`, `\times`, `\cdot` and `\div`
    /// between operands.
    fn peek_op(&mut self) -> Option<(u8, usize)> {
        self.skip_space();
        let rest = &self.src[self.pos..];
        let ops: [(&[u8], u8); 12] = [
            (b"+", b'+'),
            (b"-", b'-'),
            (b"*", b'*'),
            (b"/", b'/'),
            (b"x", b'*'),
            (b"\\times", b'*'),
            (b"\\cdot", b'*'),
            (b"\\div", b'/'),
            ("×".as_bytes(), b'*'),
            ("÷".as_bytes(), b'/'),
            ("·".as_bytes(), b'*'),
            ("−".as_bytes(), b'-'),
        ];
        ops.iter().find(|(p, _)| rest.starts_with(p)).map(|&(p, op)| (op, p.len()))
    }

    fn expr(&mut self) -> Result<Rational, Invalid> {
        self.chain([b'+', b'-'], Self::term, |acc, op, rhs| {
            if op == b'+' { acc.checked_add(rhs) } else { acc.checked_sub(rhs) }.ok_or(Invalid::Overflow)
        })
    }

    fn term(&mut self) -> Result<Rational, Invalid> {
        self.chain([b'*', b'/'], Self::factor, |acc, op, rhs| {
            if op == b'*' {
                acc.checked_mul(rhs).ok_or(Invalid::Overflow)
            } else if rhs.is_zero() {
                Err(Invalid::DivisionByZero)
            } else {
                acc.checked_div(rhs).ok_or(Invalid::Overflow)
            }
        })
    }

    /// `operand (op operand)*` for the operators `ops` of one precedence level, folded
    /// from the left by `apply`, each intermediate result checked.
    fn chain(
        &mut self,
        ops: [u8; 2],
        operand: fn(&mut Self) -> Result<Rational, Invalid>,
        apply: fn(Rational, u8, Rational) -> Result<Rational, Invalid>,
    ) -> Result<Rational, Invalid> {
        let mut acc = operand(self)?;
        while let Some((op, len)) = self.peek_op().filter(|(op, _)| ops.contains(op)) {
            self.meter.charge(1);
            self.pos += len;
            let rhs = operand(self)?;
            acc = apply(acc, op, rhs)?;
            self.check_intermediate(acc)?;
        }
        Ok(acc)
    }

    fn factor(&mut self) -> Result<Rational, Invalid> {
        self.skip_space();
        self.meter.charge(1);
        let at = self.pos;
        match self.src.get(at) {
            Some(b'(' | b'[') => {
                let close = if self.src[at] == b'(' { b')' } else { b']' };
                self.enter()?;
                self.pos += 1;
                let v = self.expr()?;
                self.skip_space();
                if self.src.get(self.pos) != Some(&close) {
                    return Err(Invalid::Syntax(self.pos));
                }
                self.pos += 1;
                self.depth -= 1;
                Ok(v)
            }
            Some(b'0'..=b'9') => self.number(),
            _ => match self.peek_op() {
                Some((b'-', len)) => {
                    if !self.config.allow_unary_minus {
                        return Err(Invalid::UnaryMinus(at));
                    }
                    self.enter()?;
                    self.pos += len;
                    let v = self.factor()?.checked_neg().ok_or(Invalid::Overflow)?;
                    self.depth -= 1;
                    Ok(v)
                }
                _ => Err(Invalid::Syntax(at)),
            },
        }
    }

    fn enter(&mut self) -> Result<(), Invalid> {
        self.depth += 1;
        if self.depth > self.config.max_depth { Err(Invalid::TooDeep(self.config.max_depth)) } else { Ok(()) }
    }

    fn number(&mut self) -> Result<Rational, Invalid> {
        let start = self.pos;
        while self.pos < self.src.len() && self.src[self.pos].is_ascii_digit() {
            self.meter.charge(1);
            self.pos += 1;
            if self.pos - start > self.config.max_digits {
                return Err(Invalid::NumberTooLong(self.config.max_digits));
            }
        }
        // Digits only, at most 30 of them: the parse cannot fail or overflow i128.
        let n: i128 = std::str::from_utf8(&self.src[start..self.pos])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(Invalid::Syntax(start))?;
        match self.available.get_mut(&n) {
            _ if self.any_number => {}
            Some(count) if *count > 0 => *count -= 1,
            Some(_) => return Err(Invalid::ReusedNumber(n)),
            None => return Err(Invalid::UnknownNumber(n)),
        }
        Ok(Rational::integer(n))
    }

    fn check_intermediate(&self, v: Rational) -> Result<(), Invalid> {
        if self.config.integer_intermediates && !v.is_integer() {
            Err(Invalid::NonInteger(v))
        } else {
            Ok(())
        }
    }
}

/// Parses the numbers field: `[3, 7, 25]`, `3,7,25` or `3 7 25`.
pub(crate) fn parse_numbers(s: &str) -> Option<Vec<i128>> {
    let inner = s.trim().trim_start_matches('[').trim_end_matches(']');
    let numbers: Option<Vec<i128>> = inner
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().ok())
        .collect();
    numbers.filter(|n| !n.is_empty() && n.len() <= 64)
}

impl RewardFn for CountdownChecker {
    fn score(&self, prompt: &Prompt, completion: &Completion) -> Reward {
        let c = &self.config;
        let field = |name: &str| prompt.metadata.get(name).map(String::as_str);
        let Some(numbers) = field(&c.numbers_field).and_then(parse_numbers) else {
            return Reward::failed(
                c.invalid_score,
                format!(
                    "prompt {} metadata `{}` is missing or not a list of integers",
                    prompt.id, c.numbers_field
                ),
            );
        };
        let Some(target) = field(&c.target_field).and_then(|t| t.trim().parse::<i128>().ok()) else {
            return Reward::failed(
                c.invalid_score,
                format!("prompt {} metadata `{}` is missing or not an integer", prompt.id, c.target_field),
            );
        };
        let verdict = self.check(&completion.text, &numbers, Rational::integer(target), &mut Meter::new());
        let (total, correct, valid) = match verdict {
            CountdownVerdict::Correct => (c.correct_score, 1.0, 1.0),
            CountdownVerdict::WrongValue(_) => (c.format_score, 0.0, 1.0),
            CountdownVerdict::Invalid(_) => (c.invalid_score, 0.0, 0.0),
        };
        let mut reward = Reward::scalar(total).with_correct(correct);
        reward.parts.insert("valid".into(), valid);
        reward
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_number_lists() {
        assert_eq!(parse_numbers("[3, 7, 25]"), Some(vec![3, 7, 25]));
        assert_eq!(parse_numbers("3,7 25"), Some(vec![3, 7, 25]));
        assert_eq!(parse_numbers("[]"), None);
        assert_eq!(parse_numbers("3, x"), None);
    }

    #[test]
    fn finds_the_expression() {
        let mut m = Meter::new();
        assert_eq!(expression_of("blah\n<answer> (3+5)*4 </answer>", &mut m), Some("(3+5)*4"));
        assert_eq!(expression_of("so:\nThe answer is (3+5)*4 = 32.\n", &mut m), Some("(3+5)*4"));
        assert_eq!(
            expression_of("so \\boxed{(3+5) \\times 4 = 32}.\nDone.", &mut m),
            Some("(3+5) \\times 4")
        );
        assert_eq!(expression_of("<answer>\\boxed{3*4}</answer>", &mut m), Some("3*4"));
        assert_eq!(expression_of("<answer> -5 + 8 </answer>", &mut m), Some("-5 + 8"));
        assert_eq!(expression_of("is \u{2212}5 + 8", &mut m), Some("\u{2212}5 + 8"));
        assert_eq!(expression_of("no numbers", &mut m), None);
    }
}
