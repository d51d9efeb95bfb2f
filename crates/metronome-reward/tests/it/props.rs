//! Property tests: parsers never panic, and the work they do (counted by their
//! `Meter`) stays linear in the bounded input, whatever the text.

use metronome_core::RewardFn;
use metronome_reward::{
    CountdownChecker, CountdownVerdict, FormatReward, MathConfig, MathVerifier, Meter, Rational, parse_answer,
};
use proptest::prelude::*;

use crate::common::{completion, prompt};

/// Text built from pieces: the whitespace-separated words of `words`, then `others`
/// (the pieces that hold whitespace), so that random strings reach deep code paths.
fn text_of(words: &'static str, others: &[&'static str], max_pieces: usize) -> impl Strategy<Value = String> {
    let pieces: Vec<&'static str> = words.split_whitespace().chain(others.iter().copied()).collect();
    prop::collection::vec(prop::sample::select(pieces), 0..max_pieces).prop_map(|v| v.concat())
}

/// Text built from the pieces the math parsers react to.
fn math_text() -> impl Strategy<Value = String> {
    let words = r"\boxed{ \fbox{ { } \frac \dfrac \text{ \left \right 1 23 0 , . - + % \% $ e / #### <answer>
        </answer> Answer: = x cm ^\circ − é {,} \,";
    text_of(words, &["the answer is ", " ", "\n"], 300)
}

/// Text built from the pieces the countdown checker reacts to.
fn countdown_text() -> impl Strategy<Value = String> {
    text_of(
        r"( ) [ ] + - * / x × ÷ 1 2 3 25 100 0 <answer> </answer> = . 9999999999999 \boxed{ } {",
        &[" ", "\n"],
        400,
    )
}

/// The linear bound on math parsing: a constant per byte of searched text plus a
/// constant per byte of the (capped) extracted answer.
fn math_bound(len: usize, config: &MathConfig) -> u64 {
    (32 * (len.min(config.max_input_bytes) + 1) + 64 * config.max_answer_bytes) as u64
}

/// The linear bound on countdown checking: a constant per byte of searched text (the
/// answer tag, `\boxed{…}` and line scans) plus a constant per byte of the capped
/// expression.
fn countdown_bound(len: usize) -> u64 {
    (5 * len.min(64 * 1024) + 8 * 256 + 8) as u64
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn math_never_panics_and_work_is_linear(text in prop_oneof![math_text(), any::<String>()]) {
        let v = MathVerifier::new();
        let mut meter = Meter::new();
        let _ = v.answer(&text, &mut meter);
        prop_assert!(meter.steps() <= math_bound(text.len(), v.config()), "{} steps for {} bytes", meter.steps(), text.len());
        let mut meter = Meter::new();
        let _ = parse_answer(&text, v.config(), &mut meter);
        prop_assert!(meter.steps() <= math_bound(text.len(), v.config()));
        let r = v.score(&prompt(Some(&text), &[]), &completion(0, &text));
        prop_assert!(r.total.is_finite());
    }

    #[test]
    fn countdown_never_panics_and_work_is_linear(text in prop_oneof![countdown_text(), any::<String>()]) {
        let c = CountdownChecker::new();
        let mut meter = Meter::new();
        let verdict = c.check(&text, &[1, 2, 3, 25, 100], Rational::integer(24), &mut meter);
        prop_assert!(meter.steps() <= countdown_bound(text.len()), "{} steps for {} bytes", meter.steps(), text.len());
        if let CountdownVerdict::WrongValue(v) = verdict {
            prop_assert!(v != Rational::integer(24));
        }
        let p = prompt(None, &[("numbers", "[1, 2, 3]"), ("target", "6")]);
        prop_assert!(c.score(&p, &completion(0, &text)).total.is_finite());
    }

    #[test]
    fn format_never_panics(text in any::<String>()) {
        let _ = FormatReward::think_answer().matches(&text);
    }

    #[test]
    fn exact_arithmetic_agrees_with_floats(a in -1000i128..1000, b in 1i128..1000, c in -1000i128..1000, d in 1i128..1000) {
        let x = Rational::new(a, b).unwrap();
        let y = Rational::new(c, d).unwrap();
        let (xf, yf) = (a as f64 / b as f64, c as f64 / d as f64);
        prop_assert!((x.checked_add(y).unwrap().to_f64() - (xf + yf)).abs() < 1e-9);
        prop_assert!((x.checked_mul(y).unwrap().to_f64() - xf * yf).abs() < 1e-9);
        prop_assert_eq!(x.checked_sub(y).unwrap().checked_add(y), Some(x));
        if c != 0 {
            prop_assert_eq!(x.checked_div(y).unwrap().checked_mul(y), Some(x));
        }
    }

    #[test]
    fn written_fractions_parse_exactly(a in 0i128..100_000, b in 1i128..100_000) {
        let config = MathConfig { exact: true, ..MathConfig::default() };
        let v = config.build().unwrap();
        let reference = Rational::new(a, b).unwrap().to_string();
        let text = format!(r"so \boxed{{\frac{{{a}}}{{{b}}}}}");
        prop_assert_eq!(v.verify(&text, &reference, &mut Meter::new()), metronome_reward::MathVerdict::Correct);
    }
}

#[test]
fn huge_adversarial_inputs_cost_no_more_than_the_cap() {
    let v = MathVerifier::new();
    for text in [
        "\\boxed{".repeat(200_000),
        "{".repeat(1_000_000),
        "1,".repeat(500_000),
        "the answer is ".repeat(50_000),
    ] {
        let mut meter = Meter::new();
        let _ = v.answer(&text, &mut meter);
        assert!(meter.steps() <= math_bound(text.len(), v.config()), "{} steps", meter.steps());
    }
    let c = CountdownChecker::new();
    for text in ["(".repeat(1_000_000), "1+".repeat(500_000), format!("<answer>{}</answer>", "(".repeat(200))]
    {
        let mut meter = Meter::new();
        let verdict = c.check(&text, &[1], Rational::integer(1), &mut meter);
        assert!(matches!(verdict, CountdownVerdict::Invalid(_)), "{verdict:?}");
        assert!(meter.steps() <= countdown_bound(text.len()), "{} steps", meter.steps());
    }
}
