//! A cross-check against checkers Metronome's authors did not write: completions of
//! reasoning-gym problems in many styles, labelled by math-verify and reasoning-gym's
//! own scorers (`tests/data/make_corpus.py` builds `tests/data/corpus.jsonl`; this test
//! needs no Python). The verifiers must accept nothing the labellers reject, and reject
//! no right answer the corpus holds. Run with `--nocapture` for the table per style.

use std::collections::BTreeMap;

use metronome_core::RewardFn;
use metronome_reward::{CountdownChecker, MathConfig, MathVerifier};
use serde::Deserialize;

use crate::common::{completion, prompt};

const CORPUS: &str = include_str!("../data/corpus.jsonl");

/// Tasks whose decimal references are exact sums, not rounded values: they are
/// checked with `exact = true`, as the config documents for such data. (The default
/// takes `2510.241` as rounded and would accept `2510.2414`; the test counts those.)
const EXACT_DECIMAL_TASKS: &[&str] = &["decimal_chain_sum"];

#[derive(Deserialize)]
struct Row {
    task: String,
    style: String,
    completion: String,
    reference: String,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    label: bool,
}

#[derive(Default)]
struct Tally {
    right: usize,
    wrong: usize,
    false_accepts: usize,
    false_rejects: usize,
}

#[test]
fn no_false_accepts_on_an_independently_labelled_corpus() {
    let math = MathVerifier::new();
    let exact = MathConfig { exact: true, ..MathConfig::default() }.build().unwrap();
    let countdown = CountdownChecker::new();
    let accepts = |scorer: &dyn RewardFn, row: &Row| {
        let reward = if row.task == "countdown" {
            let metadata: Vec<(&str, &str)> =
                row.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            scorer.score(&prompt(None, &metadata), &completion(0, &row.completion))
        } else {
            scorer.score(&prompt(Some(&row.reference), &[]), &completion(0, &row.completion))
        };
        assert!(reward.failure.is_none(), "{} {}: {:?}", row.task, row.style, reward.failure);
        reward.parts["correct"] == 1.0
    };

    let mut tallies: BTreeMap<String, Tally> = BTreeMap::new();
    let mut mistakes = Vec::new();
    let mut default_on_exact_decimals = 0;
    for (i, line) in CORPUS.lines().enumerate() {
        let row: Row =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("corpus.jsonl line {}: {e}", i + 1));
        let scorer: &dyn RewardFn = if row.task == "countdown" {
            &countdown
        } else if EXACT_DECIMAL_TASKS.contains(&row.task.as_str()) {
            if accepts(&math, &row) && !row.label {
                default_on_exact_decimals += 1;
            }
            &exact
        } else {
            &math
        };
        let accepted = accepts(scorer, &row);
        let tally = tallies.entry(row.style.clone()).or_default();
        *(if row.label { &mut tally.right } else { &mut tally.wrong }) += 1;
        if accepted != row.label {
            *(if accepted { &mut tally.false_accepts } else { &mut tally.false_rejects }) += 1;
            let kind = if accepted { "false accept" } else { "false reject" };
            let case =
                format!("line {} {kind} {}: {:?} vs {:?}", i + 1, row.task, row.completion, row.reference);
            mistakes.push((row.style, case));
        }
    }

    println!("{:<24} {:>6} {:>6} {:>14} {:>14}", "style", "right", "wrong", "false accepts", "false rejects");
    for (style, t) in &tallies {
        println!("{style:<24} {:>6} {:>6} {:>14} {:>14}", t.right, t.wrong, t.false_accepts, t.false_rejects);
    }
    let sum = |f: fn(&Tally) -> usize| tallies.values().map(f).sum::<usize>();
    let (right, wrong) = (sum(|t| t.right), sum(|t| t.wrong));
    let (false_accepts, false_rejects) = (sum(|t| t.false_accepts), sum(|t| t.false_rejects));
    println!(
        "{} completions ({right} right, {wrong} wrong): {false_accepts} false accepts, {false_rejects} false rejects",
        right + wrong
    );
    println!(
        "{EXACT_DECIMAL_TASKS:?} under the default rule (decimal references taken as rounded): \
         {default_on_exact_decimals} false accepts"
    );

    // The corpus must keep its breadth: both labels, every kind of task and near miss.
    assert!(right >= 1000 && wrong >= 1500, "the corpus shrank: {right} right, {wrong} wrong");
    assert!(tallies.len() >= 50, "only {} styles", tallies.len());
    let list = mistakes.iter().map(|(style, case)| format!("{style}: {case}")).collect::<Vec<_>>().join("\n");
    // The goal: nothing the independent checkers call wrong is rewarded.
    assert_eq!(false_accepts, 0, "\n{list}");
    // Every right answer is read, in every style, with one known exception: a few of
    // reasoning-gym's decimal_arithmetic references are rounded wrongly (`7.09626502262`
    // for 7.0962650226146…, which rounds to `…261`), so the exact value misses them by
    // more than half a unit; the labellers, tolerant to 1e-3 and 1e-6, still say right.
    assert!(mistakes.iter().all(|(style, _)| style == "dec_more_digits"), "\n{list}");
    assert!(false_rejects <= MAX_MISROUNDED_REFERENCES, "\n{list}");
}

/// The false rejects the corpus may hold: right answers more precise than one of
/// reasoning-gym's wrongly rounded decimal references (1 in the current corpus).
const MAX_MISROUNDED_REFERENCES: usize = 2;
