//! Table-driven math verification: many real answer styles.

use metronome_core::RewardFn;
use metronome_reward::{MathConfig, MathVerdict, MathVerifier, Meter};

use crate::common::{completion, prompt};

use MathVerdict::{BadReference, Correct, NoAnswer, Wrong};

/// (completion, reference, expected verdict) under the default comparison.
const CASES: &[(&str, &str, MathVerdict)] = &[
    // Integers and extraction styles.
    (r"So the total is \boxed{42}.", "42", Correct),
    (r"\boxed{41}", "42", Wrong),
    ("She has 18 apples.\n#### 18", "18", Correct),
    ("#### 17", "18", Wrong),
    ("<think>3+4=7</think><answer>7</answer>", "7", Correct),
    ("<answer> 8 </answer>", "7", Wrong),
    ("Therefore, the answer is 256.", "256", Correct),
    ("The final answer is: 99. I am sure.", "99", Correct),
    ("Answer: 12", "12", Correct),
    ("**Final Answer:** 42", "42", Correct),
    ("So the answer is **17**.", "17", Correct),
    ("The answer is $\\frac{1}{3}$.", "1/3", Correct),
    ("First 3 apples, then 5 more, so 8 in total", "8", Correct),
    ("First 3 apples, then 5 more, so 9 in total", "8", Wrong),
    (r"We try \boxed{3} first, but the result is \boxed{5}", "5", Correct),
    (r"\boxed{5} but the answer is 6", "5", Correct),
    ("no number here at all", "5", NoAnswer),
    ("", "5", NoAnswer),
    (r"\boxed{}", "5", NoAnswer),
    // Negatives.
    (r"\boxed{-7}", "-7", Correct),
    (r"\boxed{7}", "-7", Wrong),
    ("The answer is \u{2212}3", "-3", Correct),
    (r"\boxed{-\frac{1}{2}}", "-0.5", Correct),
    (r"\boxed{\frac{-1}{2}}", "-1/2", Correct),
    ("the temperature dropped to -15 degrees", "-15", Correct),
    (r"\boxed{+4}", "4", Correct),
    // Thousands separators.
    ("#### 1,234", "1234", Correct),
    (r"\boxed{1{,}000{,}000}", "1000000", Correct),
    (r"\boxed{10\,000}", "10000", Correct),
    ("The answer is 1,234,567.", "1234567", Correct),
    ("#### 1,235", "1234", Wrong),
    // Decimals.
    (r"\boxed{3.50}", "3.5", Correct),
    (r"\boxed{0.333333333}", "1/3", Wrong),
    (r"\boxed{0.33}", "1/3", Wrong),
    (r"\boxed{.5}", "0.5", Correct),
    ("The answer is 2.0", "2", Correct),
    (r"\boxed{1.5e3}", "1500", Correct),
    (r"\boxed{2.718}", "2.7183", Wrong),
    // Integer references are compared exactly, however large: an off-by-one or a wrong
    // last step is wrong, and only notation differs among the right answers.
    (r"\boxed{-4174816}", "-4174816", Correct),
    (r"\boxed{-4174817}", "-4174816", Wrong),
    (r"\boxed{47341138414}", "47341138414", Correct),
    (r"\boxed{47341138414.5}", "47341138414", Wrong),
    (r"\boxed{47341138415}", "47341138414", Wrong),
    (r"\boxed{123456789012345678901}", "123456789012345678902", Wrong),
    (r"\boxed{100.00001}", "100", Wrong),
    (r"\boxed{1234.0}", "1234", Correct),
    (r"\boxed{1,234}", "1234", Correct),
    (r"\boxed{\frac{2468}{2}}", "1234", Correct),
    ("The answer is 1234.", "1,234", Correct),
    (r"\boxed{1234.04}", "1234.0", Wrong),
    // A non-integer decimal reference is rounded to its digits: within half a unit of
    // its last digit is right, further is wrong.
    (r"\boxed{3.141592}", "3.14159", Correct),
    (r"\boxed{3.1416}", "3.14159", Wrong),
    (r"\boxed{3.14159265}", "3.14159", Correct),
    (r"\boxed{3.1415}", "3.14159", Wrong),
    (r"\boxed{3.14}", "3.14159", Wrong),
    (r"\boxed{\frac{1}{3}}", "0.333", Correct),
    (r"\boxed{0.3334}", "0.333", Correct),
    (r"\boxed{0.334}", "0.333", Wrong),
    (r"\boxed{0.33}", "0.333", Wrong),
    (r"\boxed{-2.54}", "-2.5", Correct),
    (r"\boxed{-2.56}", "-2.5", Wrong),
    // Fractions are exact.
    (r"\boxed{\frac{1}{3}}", "1/3", Correct),
    (r"\boxed{0.333}", "1/3", Wrong),
    (r"\boxed{\frac{3}{4}}", "0.75", Correct),
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", Correct),
    (r"\boxed{\tfrac12}", "0.5", Correct),
    (r"\boxed{6/8}", "3/4", Correct),
    (r"\boxed{\frac{2}{3}}", "3/4", Wrong),
    (r"\boxed{\frac{10}{4}}", "2.5", Correct),
    (r"\boxed{\frac{1}{0}}", "1", Wrong),
    // Percentages.
    (r"\boxed{50\%}", "50", Correct),
    ("The answer is 25%", "0.25", Correct),
    ("#### 12.5%", "12.5", Correct),
    (r"\boxed{40\%}", "50", Wrong),
    (r"\boxed{50\%}", "0.5", Correct),
    (r"\boxed{0.5}", r"50\%", Correct),
    (r"\boxed{50}", r"50\%", Correct),
    (r"\boxed{0.5}", "50", Wrong),
    (r"\boxed{0.125}", r"12.5\%", Correct),
    // Between two percentages a factor of 100 is a wrong answer.
    (r"\boxed{0.5\%}", r"50\%", Wrong),
    (r"\boxed{5000\%}", r"50\%", Wrong),
    // LaTeX wrappers.
    (r"$\boxed{14}$", "14", Correct),
    (r"\( \boxed{ 9 } \)", "9", Correct),
    (r"\boxed{\text{15}}", "15", Correct),
    (r"\boxed{\mathbf{21}}", "21", Correct),
    (r"\boxed{x = 3}", "3", Correct),
    (r"\boxed{\left( 5 \right)}", "5", Wrong),
    (r"\boxed{90^\circ}", "90", Correct),
    (r"\boxed{90^{\circ}}", "90", Correct),
    (r"\boxed{\$18.00}", "18", Correct),
    // Units.
    (r"\boxed{12\text{ cm}}", "12", Correct),
    ("#### 5 dollars", "5", Correct),
    ("The answer is 60 km/h.", "60", Correct),
    (r"\boxed{3 \text{ square feet}}", "3", Correct),
    ("The answer is 45 minutes", "40", Wrong),
    ("It costs $4.50 in total.", "4.5", Correct),
    // Non-numeric answers compared as normalised text.
    (r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{2}", Correct),
    (r"\boxed{\frac{\pi}{3}}", r"\frac{\pi}{2}", Wrong),
    (r"\boxed{x + 1}", "x+1", Correct),
    (r"\boxed{(1, 2)}", "(1,2)", Correct),
    (r"\boxed{2x}", "2", Wrong),
    // References in solution form.
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", Correct),
    (r"\boxed{10}", r"The value is $\boxed{10}$.", Correct),
    (r"\boxed{10}", "", BadReference),
];

#[test]
fn math_table() {
    assert!(CASES.len() >= 60, "only {} cases", CASES.len());
    let verifier = MathVerifier::new();
    let mut failures = Vec::new();
    for (i, (text, reference, expected)) in CASES.iter().enumerate() {
        let got = verifier.verify(text, reference, &mut Meter::new());
        if got != *expected {
            failures.push(format!("case {i}: {text:?} vs {reference:?}: got {got:?}, expected {expected:?}"));
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn exact_mode_rejects_rounded_answers_and_keeps_exact_ones() {
    let exact = MathConfig { exact: true, ..MathConfig::default() }.build().unwrap();
    let mut m = Meter::new();
    assert_eq!(exact.verify(r"\boxed{0.333333333}", "1/3", &mut m), Wrong);
    assert_eq!(exact.verify(r"\boxed{0.5}", r"\frac{1}{2}", &mut m), Correct);
    assert_eq!(exact.verify(r"\boxed{2.50}", "5/2", &mut m), Correct);
    // Exact mode takes decimal references as exact too.
    assert_eq!(MathVerifier::new().verify(r"\boxed{3.141592}", "3.14159", &mut m), Correct);
    assert_eq!(exact.verify(r"\boxed{3.141592}", "3.14159", &mut m), Wrong);
    assert_eq!(exact.verify(r"\boxed{2.54}", "2.5", &mut m), Wrong);
    assert_eq!(exact.verify(r"\boxed{100.00001}", "100", &mut m), Wrong);
}

#[test]
fn tolerance_and_percent_are_configurable() {
    let loose = MathConfig { rel_tol: 0.01, ..MathConfig::default() }.build().unwrap();
    let strict_pct = MathConfig { percent_equivalence: false, ..MathConfig::default() }.build().unwrap();
    let mut m = Meter::new();
    assert_eq!(loose.verify(r"\boxed{3.14}", "3.14159", &mut m), Correct);
    assert_eq!(MathVerifier::new().verify(r"\boxed{3.14}", "3.14159", &mut m), Wrong);
    // The opt-in tolerances apply to integers too, as the config documents.
    let rel = MathConfig { rel_tol: 1e-6, ..MathConfig::default() }.build().unwrap();
    assert_eq!(rel.verify(r"\boxed{-4174817}", "-4174816", &mut m), Correct);
    assert_eq!(MathVerifier::new().verify(r"\boxed{-4174817}", "-4174816", &mut m), Wrong);
    let abs = MathConfig { abs_tol: 0.5, ..MathConfig::default() }.build().unwrap();
    assert_eq!(abs.verify(r"\boxed{12.5}", "12", &mut m), Correct);
    assert_eq!(abs.verify(r"\boxed{12.6}", "12", &mut m), Wrong);
    assert_eq!(strict_pct.verify("The answer is 25%", "0.25", &mut m), Wrong);
    assert_eq!(strict_pct.verify("The answer is 25%", "25", &mut m), Correct);
}

#[test]
fn only_marked_extractors_skip_last_number_guessing() {
    use metronome_reward::Extractor;
    let marked =
        MathConfig { extractors: Extractor::MARKED.to_vec(), ..MathConfig::default() }.build().unwrap();
    assert_eq!(marked.verify("so 8 in total", "8", &mut Meter::new()), NoAnswer);
    assert_eq!(marked.verify(r"\boxed{8}", "8", &mut Meter::new()), Correct);
}

#[test]
fn scores_and_parts() {
    let v =
        MathConfig { correct_score: 2.0, wrong_score: -1.0, no_answer_score: -2.0, ..MathConfig::default() }
            .build()
            .unwrap();
    let p = prompt(Some("12"), &[]);
    let right = v.score(&p, &completion(0, r"\boxed{12}"));
    assert_eq!((right.total, right.parts["correct"], right.parts["answered"]), (2.0, 1.0, 1.0));
    let wrong = v.score(&p, &completion(0, r"\boxed{13}"));
    assert_eq!((wrong.total, wrong.parts["correct"], wrong.parts["answered"]), (-1.0, 0.0, 1.0));
    let none = v.score(&p, &completion(0, "I do not know"));
    assert_eq!((none.total, none.parts["answered"]), (-2.0, 0.0));
    assert!(right.failure.is_none() && none.failure.is_none());
    // The reference may come from the `answer` metadata field instead.
    let meta = prompt(None, &[("answer", "12")]);
    assert_eq!(v.score(&meta, &completion(0, r"\boxed{12}")).total, 2.0);
    // A prompt without a reference is a data failure, named, not a panic.
    let missing = v.score(&prompt(None, &[]), &completion(0, "12"));
    assert_eq!(missing.total, -2.0);
    assert!(missing.failure.unwrap().contains("prompt 7 has no reference"));
}

#[test]
fn bad_configs_name_the_field() {
    let e = MathConfig { rel_tol: f64::NAN, ..MathConfig::default() }.build().unwrap_err();
    assert!(e.to_string().contains("math.rel_tol"), "{e}");
    let e = MathConfig { extractors: vec![], ..MathConfig::default() }.build().unwrap_err();
    assert!(e.to_string().contains("math.extractors"), "{e}");
}
