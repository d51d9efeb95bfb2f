//! Table-driven math verification: many real answer styles.

use metronome_core::RewardFn;
use metronome_reward::{MathConfig, MathVerdict, MathVerifier, Meter};

use crate::common::{completion, prompt};

use MathVerdict::{BadReference, Correct, NoAnswer, Wrong};

/// Per reference, the completions that answer it and those that do not, under the
/// default comparison.
const CASES: &[(&str, &[&str], &[&str])] = &[
    // Integers and extraction styles.
    ("42", &[r"So the total is \boxed{42}.", "**Final Answer:** 42"], &[r"\boxed{41}"]),
    ("18", &["She has 18 apples.\n#### 18"], &["#### 17"]),
    ("7", &["<think>3+4=7</think><answer>7</answer>"], &["<answer> 8 </answer>"]),
    ("256", &["Therefore, the answer is 256."], &[]),
    ("99", &["The final answer is: 99. I am sure."], &[]),
    ("12", &["Answer: 12"], &[]),
    ("17", &["So the answer is **17**."], &[]),
    ("1/3", &["The answer is $\\frac{1}{3}$."], &[]),
    ("8", &["First 3 apples, then 5 more, so 8 in total"], &["First 3 apples, then 5 more, so 9 in total"]),
    ("5", &[r"We try \boxed{3} first, but the result is \boxed{5}", r"\boxed{5} but the answer is 6"], &[]),
    // Negatives.
    ("-7", &[r"\boxed{-7}"], &[r"\boxed{7}"]),
    ("-3", &["The answer is \u{2212}3"], &[]),
    ("-0.5", &[r"\boxed{-\frac{1}{2}}"], &[]),
    ("-1/2", &[r"\boxed{\frac{-1}{2}}"], &[]),
    ("-15", &["the temperature dropped to -15 degrees"], &[]),
    ("4", &[r"\boxed{+4}"], &[]),
    // Thousands separators.
    ("1234", &["#### 1,234"], &["#### 1,235"]),
    ("1000000", &[r"\boxed{1{,}000{,}000}"], &[]),
    ("10000", &[r"\boxed{10\,000}"], &[]),
    ("1234567", &["The answer is 1,234,567."], &[]),
    // Decimals.
    ("3.5", &[r"\boxed{3.50}"], &[]),
    ("1/3", &[], &[r"\boxed{0.333333333}", r"\boxed{0.33}"]),
    ("0.5", &[r"\boxed{.5}"], &[]),
    ("2", &["The answer is 2.0"], &[]),
    ("1500", &[r"\boxed{1.5e3}"], &[]),
    ("2.7183", &[], &[r"\boxed{2.718}"]),
    // Integer references are compared exactly, however large: an off-by-one or a wrong
    // last step is wrong, and only notation differs among the right answers.
    ("-4174816", &[r"\boxed{-4174816}"], &[r"\boxed{-4174817}"]),
    ("47341138414", &[r"\boxed{47341138414}"], &[r"\boxed{47341138414.5}", r"\boxed{47341138415}"]),
    ("123456789012345678902", &[], &[r"\boxed{123456789012345678901}"]),
    ("100", &[], &[r"\boxed{100.00001}"]),
    ("1234", &[r"\boxed{1234.0}", r"\boxed{1,234}", r"\boxed{\frac{2468}{2}}"], &[]),
    ("1,234", &["The answer is 1234."], &[]),
    ("1234.0", &[], &[r"\boxed{1234.04}"]),
    // A non-integer decimal reference is rounded to its digits: within half a unit of
    // its last digit is right, further is wrong.
    (
        "3.14159",
        &[r"\boxed{3.141592}", r"\boxed{3.14159265}"],
        &[r"\boxed{3.1416}", r"\boxed{3.1415}", r"\boxed{3.14}"],
    ),
    ("0.333", &[r"\boxed{\frac{1}{3}}", r"\boxed{0.3334}"], &[r"\boxed{0.334}", r"\boxed{0.33}"]),
    ("-2.5", &[r"\boxed{-2.54}"], &[r"\boxed{-2.56}"]),
    // Fractions are exact.
    ("1/3", &[r"\boxed{\frac{1}{3}}"], &[r"\boxed{0.333}"]),
    ("0.75", &[r"\boxed{\frac{3}{4}}"], &[]),
    (r"\frac{3}{4}", &[r"\boxed{\dfrac{3}{4}}"], &[]),
    ("0.5", &[r"\boxed{\tfrac12}"], &[]),
    ("3/4", &[r"\boxed{6/8}"], &[r"\boxed{\frac{2}{3}}"]),
    ("2.5", &[r"\boxed{\frac{10}{4}}"], &[]),
    ("1", &[], &[r"\boxed{\frac{1}{0}}"]),
    // Percentages.
    ("50", &[r"\boxed{50\%}"], &[r"\boxed{40\%}", r"\boxed{0.5}"]),
    ("0.25", &["The answer is 25%"], &[]),
    ("12.5", &["#### 12.5%"], &[]),
    ("0.5", &[r"\boxed{50\%}"], &[]),
    (r"50\%", &[r"\boxed{0.5}", r"\boxed{50}"], &[]),
    (r"12.5\%", &[r"\boxed{0.125}"], &[]),
    // Between two percentages a factor of 100 is a wrong answer.
    (r"50\%", &[], &[r"\boxed{0.5\%}", r"\boxed{5000\%}"]),
    // LaTeX wrappers.
    ("14", &[r"$\boxed{14}$"], &[]),
    ("9", &[r"\( \boxed{ 9 } \)"], &[]),
    ("15", &[r"\boxed{\text{15}}"], &[]),
    ("21", &[r"\boxed{\mathbf{21}}"], &[]),
    ("3", &[r"\boxed{x = 3}"], &[]),
    ("5", &[], &[r"\boxed{\left( 5 \right)}"]),
    ("90", &[r"\boxed{90^\circ}", r"\boxed{90^{\circ}}"], &[]),
    ("18", &[r"\boxed{\$18.00}"], &[]),
    // Units.
    ("12", &[r"\boxed{12\text{ cm}}"], &[]),
    ("5", &["#### 5 dollars"], &[]),
    ("60", &["The answer is 60 km/h."], &[]),
    ("3", &[r"\boxed{3 \text{ square feet}}"], &[]),
    ("40", &[], &["The answer is 45 minutes"]),
    ("4.5", &["It costs $4.50 in total."], &[]),
    // Non-numeric answers compared as normalised text.
    (r"\frac{\pi}{2}", &[r"\boxed{\frac{\pi}{2}}"], &[r"\boxed{\frac{\pi}{3}}"]),
    ("x+1", &[r"\boxed{x + 1}"], &[]),
    ("(1,2)", &[r"\boxed{(1, 2)}"], &[]),
    ("2", &[], &[r"\boxed{2x}"]),
    // References in solution form.
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", &["#### 72"], &[]),
    (r"The value is $\boxed{10}$.", &[r"\boxed{10}"], &[]),
];

/// Completions with no answer to find, whatever the reference.
const NO_ANSWER: &[&str] = &["no number here at all", "", r"\boxed{}"];

#[test]
fn math_table() {
    let verifier = MathVerifier::new();
    let verdicts = CASES.iter().flat_map(|&(reference, right, wrong)| {
        let right = right.iter().map(move |&text| (text, reference, Correct));
        right.chain(wrong.iter().map(move |&text| (text, reference, Wrong)))
    });
    let no_answers = NO_ANSWER.iter().map(|&text| (text, "5", NoAnswer));
    let cases: Vec<_> = verdicts.chain(no_answers).chain([(r"\boxed{10}", "", BadReference)]).collect();
    assert!(cases.len() >= 60, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for (text, reference, expected) in cases {
        let got = verifier.verify(text, reference, &mut Meter::new());
        if got != expected {
            failures.push(format!("{text:?} vs {reference:?}: got {got:?}, expected {expected:?}"));
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
