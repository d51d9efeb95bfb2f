//! Table-driven countdown checks with exact rational arithmetic.

use metronome_core::RewardFn;
use metronome_reward::{CountdownChecker, CountdownConfig, CountdownVerdict, Invalid, Meter, Rational};

use crate::common::{completion, prompt};

use CountdownVerdict::{Correct, Invalid as Bad, WrongValue};

fn int(n: i128) -> Rational {
    Rational::integer(n)
}

/// (completion, numbers, target, expected verdict) under the default rules: every given
/// number exactly once, unary minus allowed.
fn cases() -> Vec<(&'static str, Vec<i128>, i128, CountdownVerdict)> {
    vec![
        // Valid and correct, in several answer styles.
        ("<answer>(25 - 5) * 3</answer>", vec![25, 5, 3], 60, Correct),
        ("<think>try</think>\n<answer> 3 * (25 - 5) </answer>", vec![3, 5, 25], 60, Correct),
        ("Let me see.\n(100 + 4) / 8 = 13", vec![100, 4, 8], 13, Correct),
        ("The answer is 6 × 4.", vec![6, 4], 24, Correct),
        ("<answer>12 ÷ 3 + 1</answer>", vec![12, 3, 1], 5, Correct),
        ("<answer>[2 + 3] * 4</answer>", vec![2, 3, 4], 20, Correct),
        (r"<answer>$(25 - 5) \times 3$</answer>", vec![25, 5, 3], 60, Correct),
        (r"<answer>(9 \div 3) \cdot 2</answer>", vec![9, 3, 2], 6, Correct),
        ("<answer>5 + 5 * 1</answer>", vec![5, 5, 1], 10, Correct),
        // The expression may sit in `\boxed{…}`, alone or inside the answer tags.
        (r"So the equation is \boxed{(25 - 5) \times 3}", vec![25, 5, 3], 60, Correct),
        (r"<answer>\boxed{(25-5)*3}</answer>", vec![25, 5, 3], 60, Correct),
        (r"\boxed{(25 - 5) * 3 = 60}", vec![25, 5, 3], 60, Correct),
        ("\\boxed{25 - 5 * 3}\nDone.", vec![25, 5, 3], 60, WrongValue(int(10))),
        // Unary minus on a given number.
        ("<answer>-5 + 8</answer>", vec![5, 8], 3, Correct),
        ("<answer>\u{2212}5 + 8 * 1</answer>", vec![5, 8, 1], 3, Correct),
        ("<answer>8 * (-5 + 6)</answer>", vec![5, 8, 6], 8, Correct),
        ("<answer>-4 + 8</answer>", vec![5, 8], 4, Bad(Invalid::UnknownNumber(4))),
        ("<answer>-5 + 5 + 8</answer>", vec![5, 8], 8, Bad(Invalid::ReusedNumber(5))),
        // A subset of the numbers is not an answer, even when it hits the target.
        ("<answer>7</answer>", vec![7, 2], 7, Bad(Invalid::UnusedNumbers)),
        ("<answer>25 + 35</answer>", vec![25, 35, 3], 60, Bad(Invalid::UnusedNumbers)),
        ("Let me see.\n(100 + 4) / 8 = 13", vec![100, 4, 8, 7], 13, Bad(Invalid::UnusedNumbers)),
        ("<answer>5 + 5</answer>", vec![5, 5, 1], 10, Bad(Invalid::UnusedNumbers)),
        // Right expression, another target.
        ("<answer>(25 - 5) * 3</answer>", vec![25, 5, 3], 61, WrongValue(int(60))),
        // Exact rationals: a non-integer intermediate is fine by default.
        ("<answer>6 / (1 - 3 / 4)</answer>", vec![6, 1, 3, 4], 24, Correct),
        ("<answer>8 / (3 - 8 / 3)</answer>", vec![8, 3, 8, 3], 24, Correct),
        ("<answer>1 / 3 * 3</answer>", vec![1, 3, 3], 1, Correct),
        // Valid but another value.
        ("<answer>25 - 5 * 3</answer>", vec![25, 5, 3], 60, WrongValue(int(10))),
        ("<answer>7 / 2</answer>", vec![7, 2], 3, WrongValue(Rational::new(7, 2).unwrap())),
        // Reused and unknown numbers.
        ("<answer>5 * 5</answer>", vec![5, 1], 25, Bad(Invalid::ReusedNumber(5))),
        ("<answer>(3 + 3) * 3</answer>", vec![3, 3], 18, Bad(Invalid::ReusedNumber(3))),
        ("<answer>10 * 6</answer>", vec![25, 5, 3], 60, Bad(Invalid::UnknownNumber(10))),
        ("<answer>60</answer>", vec![25, 5, 3], 60, Bad(Invalid::UnknownNumber(60))),
        // Division by zero, directly and through an intermediate.
        ("<answer>5 / 0</answer>", vec![5, 0], 1, Bad(Invalid::DivisionByZero)),
        ("<answer>4 / (3 - 3)</answer>", vec![4, 3, 3], 1, Bad(Invalid::DivisionByZero)),
        // Syntax problems.
        ("<answer>3 + * 4</answer>", vec![3, 4], 7, Bad(Invalid::Syntax(4))),
        ("<answer>(3 + 4</answer>", vec![3, 4], 7, Bad(Invalid::Syntax(6))),
        ("<answer>3 + 4)</answer>", vec![3, 4], 7, Bad(Invalid::Syntax(5))),
        ("<answer>3 ^ 2</answer>", vec![3, 2], 9, Bad(Invalid::Syntax(2))),
        ("I give up.", vec![3, 5], 8, Bad(Invalid::NoExpression)),
        ("<answer></answer>", vec![3, 5], 8, Bad(Invalid::NoExpression)),
        // Deep nesting is bounded.
        (
            "<answer>((((((((((((((((((((((((((((((((((1))))))))))))))))))))))))))))))))))</answer>",
            vec![1],
            1,
            Bad(Invalid::TooDeep(32)),
        ),
        ("<answer>((((((((((2 + 3))))))))))</answer>", vec![2, 3], 5, Correct),
        // Number size and expression length are bounded.
        ("<answer>1234567890123 + 1</answer>", vec![1234567890123, 1], 0, Bad(Invalid::NumberTooLong(12))),
    ]
}

#[test]
fn countdown_table() {
    let checker = CountdownChecker::new();
    let mut failures = Vec::new();
    for (i, (text, numbers, target, expected)) in cases().into_iter().enumerate() {
        let got = checker.check(text, &numbers, int(target), &mut Meter::new());
        if got != expected {
            failures.push(format!(
                "case {i}: {text:?} {numbers:?} -> {target}: got {got:?}, expected {expected:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn integer_intermediates_subsets_and_unary_minus_are_options() {
    let strict =
        CountdownConfig { integer_intermediates: true, ..CountdownConfig::default() }.build().unwrap();
    let mut m = Meter::new();
    assert_eq!(
        strict.check("<answer>6 / (1 - 3 / 4)</answer>", &[6, 1, 3, 4], int(24), &mut m),
        Bad(Invalid::NonInteger(Rational::new(3, 4).unwrap()))
    );
    assert_eq!(strict.check("<answer>(25 - 5) * 3</answer>", &[25, 5, 3], int(60), &mut m), Correct);
    let no_unary =
        CountdownConfig { allow_unary_minus: false, ..CountdownConfig::default() }.build().unwrap();
    assert_eq!(
        no_unary.check("<answer>-3 + 5</answer>", &[3, 5], int(2), &mut m),
        Bad(Invalid::UnaryMinus(0))
    );
    let subset =
        CountdownConfig { require_all_numbers: false, ..CountdownConfig::default() }.build().unwrap();
    assert_eq!(subset.check("<answer>7</answer>", &[7, 2], int(7), &mut m), Correct);
    assert_eq!(subset.check("<answer>25 + 35</answer>", &[25, 35, 3], int(60), &mut m), Correct);
    // Subsets never allow reuse or numbers that are not given.
    assert_eq!(
        subset.check("<answer>7 + 7</answer>", &[7, 2], int(14), &mut m),
        Bad(Invalid::ReusedNumber(7))
    );
    assert_eq!(
        subset.check("<answer>7 * 3</answer>", &[7, 2], int(21), &mut m),
        Bad(Invalid::UnknownNumber(3))
    );
    let defaults = CountdownConfig::default();
    assert!(defaults.require_all_numbers && defaults.allow_unary_minus && !defaults.integer_intermediates);
}

#[test]
fn overflow_is_invalid_not_wrong() {
    let checker = CountdownChecker::new();
    let numbers = vec![999_999_999_999; 8];
    let expr = "999999999999*999999999999*999999999999*999999999999";
    assert_eq!(
        checker.check(&format!("<answer>{expr}</answer>"), &numbers, int(1), &mut Meter::new()),
        Bad(Invalid::Overflow)
    );
    let long = format!("<answer>{}</answer>", "1+".repeat(200) + "1");
    assert_eq!(checker.check(&long, &[1], int(1), &mut Meter::new()), Bad(Invalid::TooLong(256)));
}

#[test]
fn scores_from_metadata() {
    let checker = CountdownChecker::new();
    let p = prompt(None, &[("numbers", "[25, 5, 3]"), ("target", "60")]);
    let right = checker.score(&p, &completion(0, "<answer>(25-5)*3</answer>"));
    assert_eq!((right.total, right.parts["correct"], right.parts["valid"]), (1.0, 1.0, 1.0));
    let off = checker.score(&p, &completion(0, "<answer>25-5*3</answer>"));
    assert_eq!((off.total, off.parts["correct"], off.parts["valid"]), (0.1, 0.0, 1.0));
    let bad = checker.score(&p, &completion(0, "<answer>5*5</answer>"));
    assert_eq!((bad.total, bad.parts["valid"]), (0.0, 0.0));
    let subset = checker.score(&p, &completion(0, "<answer>25+35</answer>"));
    assert_eq!((subset.total, subset.parts["correct"], subset.parts["valid"]), (0.0, 0.0, 0.0));
    let missing = checker.score(&prompt(None, &[("numbers", "1 2")]), &completion(0, "1+2"));
    assert!(missing.failure.unwrap().contains("metadata `target`"));
}
