//! Exact match, format, length shaping, composites and closures as scorers.

use metronome_core::{Completion, Prompt, RewardFn};
use metronome_reward::{
    Composite, ExactMatch, ExactMatchConfig, Extractor, FormatConfig, FormatReward, LengthConfig, LengthUnit,
    MathVerifier,
};

use crate::common::{completion, prompt};

#[test]
fn exact_match_table() {
    let normalised = ExactMatchConfig::default().build().unwrap();
    let raw = ExactMatchConfig { normalise: false, extractors: vec![], ..ExactMatchConfig::default() }
        .build()
        .unwrap();
    let cased = ExactMatchConfig { case_sensitive: true, ..ExactMatchConfig::default() }.build().unwrap();
    let cases: &[(&ExactMatch, &str, &str, bool)] = &[
        (&normalised, "<answer>Paris</answer>", "paris", true),
        (&normalised, "The answer is Paris.", "Paris", true),
        (&normalised, r"\boxed{  New   York }", "new york", true),
        (&normalised, "<answer>\"Paris\"</answer>", "Paris", true),
        (&normalised, "<answer>Lyon</answer>", "Paris", false),
        (&normalised, "Paris", "Paris", false), // nothing marked as the answer
        (&raw, "Paris", "Paris", true),
        (&raw, "Paris ", "Paris", false),
        (&cased, "<answer>paris</answer>", "Paris", false),
        (&cased, "<answer>Paris!</answer>", "Paris", true),
    ];
    for (i, (scorer, text, reference, expected)) in cases.iter().enumerate() {
        assert_eq!(scorer.matches(text, reference), *expected, "case {i}: {text:?} vs {reference:?}");
    }
    let r = normalised.score(&prompt(Some("Paris"), &[]), &completion(0, "<answer>paris</answer>"));
    assert_eq!((r.total, r.parts["match"]), (1.0, 1.0));
}

#[test]
fn format_reward_by_pattern() {
    let f = FormatReward::think_answer();
    let cases = [
        ("<think>because</think><answer>4</answer>", true),
        ("  <think>\nmulti\nline\n</think>\n\n<answer>\n4\n</answer>\n", true),
        ("<answer>4</answer>", false),
        ("<think>x</think>", false),
        ("<think>x</think><answer>4</answer> trailing", false),
        ("preamble <think>x</think><answer>4</answer>", false),
        ("<answer>4</answer><think>x</think>", false),
        ("", false),
    ];
    for (text, expected) in cases {
        assert_eq!(f.matches(text), expected, "{text:?}");
    }
    let custom = FormatConfig { pattern: r"\\boxed\{".into(), match_score: 0.5, ..FormatConfig::default() }
        .build()
        .unwrap();
    let r = custom.score(&prompt(None, &[]), &completion(0, r"so \boxed{3}"));
    assert_eq!((r.total, r.parts["format"]), (0.5, 1.0));
    let e = FormatConfig { pattern: "(unclosed".into(), ..FormatConfig::default() }.build().unwrap_err();
    assert!(e.to_string().contains("format.pattern"), "{e}");
    let limited = FormatConfig { max_input_bytes: 10, ..FormatConfig::default() }.build().unwrap();
    assert!(!limited.matches("<think>long enough</think><answer>4</answer>"));
}

#[test]
fn length_shaping_counts_tokens_or_chars() {
    let tokens =
        LengthConfig { max_len: 10, cache_len: 4, penalty: 1.0, unit: LengthUnit::Tokens }.build().unwrap();
    let chars =
        LengthConfig { max_len: 10, cache_len: 4, penalty: 1.0, unit: LengthUnit::Chars }.build().unwrap();
    let p = prompt(None, &[]);
    let mut c = completion(0, "ééééééééé"); // 9 chars, 4 tokens
    assert_eq!(tokens.score(&p, &c).total, 0.0);
    assert_eq!(chars.score(&p, &c).total, -0.75);
    c.tokens = vec![1; 12];
    let r = tokens.score(&p, &c);
    assert_eq!((r.total, r.parts["length"]), (-1.0, 12.0));
}

#[test]
fn composite_weights_and_breakdown() {
    let composite = Composite::of("correct", 1.0, MathVerifier::new())
        .unwrap()
        .with("format", 0.5, FormatReward::think_answer())
        .unwrap()
        .with(
            "length",
            0.25,
            LengthConfig { max_len: 8, cache_len: 4, ..LengthConfig::default() }.build().unwrap(),
        )
        .unwrap();
    let p = prompt(Some("4"), &[]);
    let mut c = completion(0, "<think>2+2</think><answer>4</answer>");
    c.tokens = vec![1; 6]; // half-way into the soft interval: -0.5
    let r = composite.score(&p, &c);
    assert_eq!(r.total, 1.0 + 0.5 - 0.125);
    assert_eq!(r.parts["correct"], 1.0);
    assert_eq!(r.parts["correct.correct"], 1.0);
    assert_eq!(r.parts["format"], 1.0);
    assert_eq!(r.parts["length"], -0.5);
    assert_eq!(r.parts["length.length"], 6.0);
    assert!(r.failure.is_none());
    // A component's failure surfaces, named, while the others still count.
    let r = composite.score(&prompt(None, &[]), &c);
    assert_eq!(r.total, 0.5 - 0.125);
    assert!(r.failure.unwrap().starts_with("correct: prompt 7 has no reference"));
    assert!(
        Composite::of("a", 1.0, MathVerifier::new()).unwrap().with("a", 1.0, MathVerifier::new()).is_err()
    );
    assert!(Composite::of("a", f32::NAN, MathVerifier::new()).is_err());
}

#[test]
fn closures_are_scorers() {
    let by_length = |_: &Prompt, c: &Completion| c.text.len() as f32;
    let composite = Composite::of("len", 2.0, by_length).unwrap();
    assert_eq!(composite.score(&prompt(None, &[]), &completion(0, "abc")).total, 6.0);
    let marked = ExactMatchConfig { extractors: vec![Extractor::Hashes], ..ExactMatchConfig::default() };
    assert!(marked.build().unwrap().matches("#### yes", "YES"));
}
