//! The word-problem generator: every answer recomputed here from the solution the
//! item records, with checked integer arithmetic written independently of the
//! generator; the solution tied to the question's own numbers; the split, the
//! determinism, the spread of steps and templates, the answer format the math
//! verifier reads, and rendering through a chat template.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use metronome_core::RunSeed;
use metronome_dataloader::{
    DEFAULT_WORD_PROBLEM_FORMAT, Dataset, Holdout, LoaderConfig, PromptConfig, PromptContent, ReleaseConfig,
    SourceConfig, Span, WordProblemConfig, WordProblemTask,
};
use metronome_reward::{MathVerdict, MathVerifier, Meter};

use crate::common::{ByteTokenizer, runtime};

/// The largest answer a grade-school problem should have.
const MAX_ANSWER: u64 = 10_000;

/// One record's parts: the prompt text, the reference and the metadata.
fn record(task: &WordProblemTask, i: usize) -> (String, String, BTreeMap<String, String>) {
    let r = task.record(i).unwrap();
    let PromptContent::Text(text) = r.content else { panic!("word problems are text") };
    (text, r.reference.expect("every problem has a reference"), r.metadata)
}

/// The whole numbers written in `text`, in order.
fn numbers_in(text: &str) -> Vec<u64> {
    text.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("a run of digits is a number"))
        .collect()
}

/// Recomputes a solution written as `a*b=c; c-d=e`: each operation with checked
/// integer arithmetic (no negative intermediate, divisions exact), each operand a
/// number of the question or an earlier result. Returns the operations' count and
/// the last result.
fn recompute(solution: &str, question: &str) -> (usize, u64) {
    let stated = numbers_in(question);
    let mut results: Vec<u64> = Vec::new();
    let mut used = BTreeSet::new();
    for step in solution.split("; ") {
        let (expression, written) = step.split_once('=').unwrap_or_else(|| panic!("`{step}` has no `=`"));
        let op_at =
            expression.find(['+', '-', '*', '/']).unwrap_or_else(|| panic!("`{step}` has no operator"));
        let (a, b) = (&expression[..op_at], &expression[op_at + 1..]);
        let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
        let value = match &expression[op_at..=op_at] {
            "+" => a.checked_add(b),
            "-" => a.checked_sub(b),
            "*" => a.checked_mul(b),
            "/" => (b != 0 && a.is_multiple_of(b)).then(|| a / b),
            _ => unreachable!(),
        }
        .unwrap_or_else(|| panic!("`{step}` leaves the non-negative integers"));
        assert_eq!(written.parse::<u64>().unwrap(), value, "`{step}` in {question}");
        for operand in [a, b] {
            assert!(
                stated.contains(&operand) || results.contains(&operand),
                "operand {operand} of `{step}` is neither in the question nor an earlier result: {question}"
            );
            used.insert(operand);
        }
        results.push(value);
    }
    for n in &stated {
        assert!(used.contains(n), "{n} is stated but the solution `{solution}` never uses it: {question}");
    }
    (results.len(), *results.last().unwrap())
}

#[test]
fn every_answer_is_recomputed_from_its_solution() {
    let task = WordProblemTask::new(WordProblemConfig::default(), RunSeed(9)).unwrap();
    let mut answers = Vec::new();
    for i in 0..task.len() {
        let (text, reference, metadata) = record(&task, i);
        let question = &metadata["question"];
        assert_eq!(text, DEFAULT_WORD_PROBLEM_FORMAT.replace("{question}", question));
        let (steps, answer) = recompute(&metadata["solution"], question);
        assert_eq!(metadata["steps"], steps.to_string());
        assert!((2..=4).contains(&steps), "{steps} steps: {question}");
        // A whole, positive, grade-school-sized number, written as digits only.
        assert!(reference.bytes().all(|b| b.is_ascii_digit()), "reference `{reference}`");
        assert_eq!(reference.parse::<u64>().unwrap(), answer, "{question}");
        assert!((1..=MAX_ANSWER).contains(&answer), "answer {answer}: {question}");
        assert!(!question.contains('{') && !question.contains('}'), "{question}");
        answers.push(answer);
    }
    answers.sort_unstable();
    let quantile = |q: f64| answers[((answers.len() - 1) as f64 * q) as usize];
    eprintln!(
        "{} answers: min {}, quartiles {} / {} / {}, max {}",
        answers.len(),
        answers[0],
        quantile(0.25),
        quantile(0.5),
        quantile(0.75),
        answers[answers.len() - 1]
    );
    // Not all tiny: the problems need more than copying a number.
    assert!(quantile(0.5) >= 10, "median answer {}", quantile(0.5));
}

/// `max_number` keeps the numbers a question states small (those a template computes,
/// such as the bill that covers a cost, may exceed it) and every answer right.
#[test]
fn max_number_caps_the_stated_numbers_and_every_answer_stays_right() {
    let config = WordProblemConfig { size: 2000, max_number: Some(10), ..Default::default() };
    let task = WordProblemTask::new(config, RunSeed(9)).unwrap();
    let (mut small, mut stated) = (0, 0);
    for i in 0..task.len() {
        let (_, reference, metadata) = record(&task, i);
        let question = &metadata["question"];
        let (_, answer) = recompute(&metadata["solution"], question);
        assert_eq!(reference.parse::<u64>().unwrap(), answer, "{question}");
        for n in numbers_in(question) {
            stated += 1;
            small += usize::from(n <= 10);
        }
    }
    eprintln!("{small} of {stated} stated numbers are at most 10");
    assert!(small * 10 >= stated * 8, "{small} of {stated} stated numbers are at most 10");
    let bad = WordProblemConfig { max_number: Some(0), ..Default::default() };
    assert!(bad.validate().unwrap_err().to_string().contains("word_problems.max_number"));
}

#[test]
fn steps_and_templates_are_spread() {
    let task =
        WordProblemTask::new(WordProblemConfig { size: 3000, ..Default::default() }, RunSeed(4)).unwrap();
    let (mut steps, mut templates, mut names) = (BTreeMap::new(), BTreeMap::new(), BTreeSet::new());
    for i in 0..task.len() {
        let (_, _, metadata) = record(&task, i);
        *steps.entry(metadata["steps"].clone()).or_insert(0usize) += 1;
        *templates.entry(metadata["template"].clone()).or_insert(0usize) += 1;
        names.insert(metadata["question"].split_whitespace().next().unwrap().to_owned());
    }
    eprintln!("steps {steps:?}\ntemplates {templates:?}");
    assert_eq!(steps.keys().map(String::as_str).collect::<Vec<_>>(), ["2", "3", "4"]);
    for (count, n) in &steps {
        assert!((800..=1200).contains(n), "{n} of 3000 problems take {count} steps");
    }
    assert!(templates.len() >= 15, "{templates:?}");
    assert!(templates.values().all(|&n| n >= 60), "{templates:?}");
    assert!(names.len() >= 20, "questions open with only {names:?}");

    let three = WordProblemConfig { size: 300, steps: Span::exactly(3), ..Default::default() };
    let task = WordProblemTask::new(three, RunSeed(4)).unwrap();
    assert!((0..task.len()).all(|i| record(&task, i).2["steps"] == "3"));
}

/// One-operation stories (`steps = 1`, for a model too small for two-step problems):
/// every one of the four templates drawn, every answer recomputed and positive, and
/// none of them among the default's draws.
#[test]
fn one_step_problems_are_drawn_only_when_asked_for() {
    let one =
        WordProblemConfig { size: 800, steps: Span::exactly(1), max_number: Some(10), ..Default::default() };
    let task = WordProblemTask::new(one, RunSeed(5)).unwrap();
    let mut templates = BTreeMap::new();
    for i in 0..task.len() {
        let (_, reference, metadata) = record(&task, i);
        let question = &metadata["question"];
        let (steps, answer) = recompute(&metadata["solution"], question);
        assert_eq!((steps, metadata["steps"].as_str()), (1, "1"), "{question}");
        assert_eq!(reference.parse::<u64>().unwrap(), answer, "{question}");
        assert!(answer >= 1, "answer {answer}: {question}");
        *templates.entry(metadata["template"].clone()).or_insert(0usize) += 1;
    }
    eprintln!("one-step templates {templates:?}");
    assert_eq!(templates.len(), 4, "{templates:?}");
    assert!(templates.values().all(|&n| n >= 120), "{templates:?}");

    let default =
        WordProblemTask::new(WordProblemConfig { size: 500, ..Default::default() }, RunSeed(5)).unwrap();
    assert!((0..default.len()).all(|i| record(&default, i).2["steps"] != "1"));
    let mixed = WordProblemConfig { size: 400, steps: Span::new(1, 2), ..Default::default() };
    let task = WordProblemTask::new(mixed, RunSeed(5)).unwrap();
    let ones = (0..task.len()).filter(|&i| record(&task, i).2["steps"] == "1").count();
    assert!((140..=260).contains(&ones), "{ones} of 400 problems take one step");
}

#[test]
fn items_are_deterministic_per_seed() {
    let items = |config: WordProblemConfig, run: u64| {
        let task = WordProblemTask::new(config, RunSeed(run)).unwrap();
        (0..200).map(|i| task.item(i).unwrap()).collect::<Vec<_>>()
    };
    let a = items(WordProblemConfig::default(), 1);
    assert_eq!(a, items(WordProblemConfig::default(), 1));
    assert_ne!(a, items(WordProblemConfig::default(), 2));
    assert_eq!(a, items(WordProblemConfig { seed: Some(1), ..Default::default() }, 2), "a fixed seed wins");
    // Record `i` is item `i`, computed alone: random access gives the same record.
    let task = WordProblemTask::new(WordProblemConfig::default(), RunSeed(1)).unwrap();
    assert_eq!(task.record(150).unwrap(), task.record(150).unwrap());
    assert_eq!(task.item(150).unwrap(), a[150]);
}

#[test]
fn train_and_heldout_never_share_a_problem() {
    // The content key, computed here: the template and the question's numbers in order
    // (names, objects and wording are not part of a problem's identity).
    let problems = |holdout: Holdout, size: u64, seed: u64| {
        let config = WordProblemConfig { size, holdout, ..Default::default() };
        let task = WordProblemTask::new(config, RunSeed(seed)).unwrap();
        (0..task.len())
            .map(|i| {
                let metadata = record(&task, i).2;
                (
                    metadata["template"].clone(),
                    numbers_in(&metadata["question"]),
                    metadata["question"].clone(),
                )
            })
            .collect::<Vec<_>>()
    };
    let train = problems(Holdout::train(10), 5000, 1);
    let heldout = problems(Holdout::heldout(10), 1000, 2);
    let keys = |p: &[(String, Vec<u64>, String)]| p.iter().map(|(t, n, _)| (t.clone(), n.clone())).collect();
    let (train_keys, heldout_keys): (BTreeSet<_>, BTreeSet<_>) = (keys(&train), keys(&heldout));
    eprintln!("{} distinct held-out problems of 1000", heldout_keys.len());
    assert!(heldout_keys.len() > 850, "{} distinct held-out problems of 1000", heldout_keys.len());
    assert!(train_keys.is_disjoint(&heldout_keys));
    let questions = |p: &[(String, Vec<u64>, String)]| p.iter().map(|x| x.2.clone()).collect::<BTreeSet<_>>();
    assert!(questions(&train).is_disjoint(&questions(&heldout)));

    // The unsplit task puts about the held-out share in the held-out part.
    let all =
        WordProblemTask::new(WordProblemConfig { size: 4000, ..Default::default() }, RunSeed(3)).unwrap();
    let inside =
        (0..all.len()).filter(|&i| Holdout::heldout(10).admits(&all.item(i as u64).unwrap().key())).count();
    assert!((300..=500).contains(&inside), "{inside} of 4000 in a 10% held-out part");
    assert!(WordProblemConfig { holdout: Holdout::heldout(100), ..Default::default() }.validate().is_err());
}

#[test]
fn the_math_verifier_reads_the_asked_format() {
    assert!(DEFAULT_WORD_PROBLEM_FORMAT.contains("\"#### N\""), "the prompt names the format");
    let verifier = MathVerifier::new();
    let verdict = |text: &str, reference: &str| verifier.verify(text, reference, &mut Meter::new());
    let task =
        WordProblemTask::new(WordProblemConfig { size: 300, ..Default::default() }, RunSeed(5)).unwrap();
    for i in 0..task.len() {
        let (_, reference, metadata) = record(&task, i);
        let answer: u64 = reference.parse().unwrap();
        // A worked answer in the asked form: the steps' numbers come before the last line.
        let work = metadata["solution"].replace("; ", ".\n");
        let gold = format!("{work}.\n#### {answer}");
        assert_eq!(verdict(&gold, &reference), MathVerdict::Correct, "{gold}");
        let wrong = format!("{work}.\n#### {}", answer + 1);
        assert_eq!(verdict(&wrong, &reference), MathVerdict::Wrong, "{wrong}");
        // The marked line wins over a later stray number.
        let trailing = format!("#### {answer}\nI checked it twice, 7 times.");
        assert_eq!(verdict(&trailing, &reference), MathVerdict::Correct, "{trailing}");
    }
    // Written with a unit or a dollar sign, as a model may.
    assert_eq!(verdict("#### 42 dollars", "42"), MathVerdict::Correct);
    assert_eq!(verdict("#### 1,234", "1234"), MathVerdict::Correct);
    assert_eq!(verdict("#### N", "42"), MathVerdict::Wrong);
}

#[test]
fn problems_render_through_the_chat_template() {
    let config = LoaderConfig {
        source: SourceConfig::WordProblems(WordProblemConfig { size: 50, ..Default::default() }),
        release: ReleaseConfig { batch_size: 4, epochs: Some(1), ..ReleaseConfig::default() },
        prompt: PromptConfig {
            chat_template: true,
            system: Some("You are a careful tutor.".into()),
            ..PromptConfig::default()
        },
    };
    let mut loader = config.build(RunSeed(0), Arc::new(ByteTokenizer { template: true })).unwrap();
    let batch = runtime().block_on(loader.next()).unwrap().unwrap();
    assert_eq!(batch.prompts.len(), 4);
    for prompt in &batch.prompts {
        let question = &prompt.metadata["question"];
        let expected = format!(
            "<system>You are a careful tutor.\n<user>{}\n<assistant>",
            DEFAULT_WORD_PROBLEM_FORMAT.replace("{question}", question)
        );
        assert_eq!(prompt.text, expected);
        assert_eq!(
            prompt.reference.as_deref(),
            Some(recompute(&prompt.metadata["solution"], question).1.to_string().as_str())
        );
    }
    // The source is chosen by its `kind` in a config document.
    let parsed: SourceConfig =
        toml::from_str("kind = \"word_problems\"\nsize = 7\nsteps = { min = 2, max = 3 }").unwrap();
    assert!(matches!(parsed, SourceConfig::WordProblems(c) if c.size == 7 && c.steps == Span::new(2, 3)));
    let unknown = toml::from_str::<SourceConfig>("kind = \"word_problems\"\nstep = 3").unwrap_err();
    assert!(unknown.to_string().contains("step"), "{unknown}");
}
