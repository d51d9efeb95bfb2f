//! The generators: every answer checked by an evaluator written here, independent of
//! the generator's own arithmetic; countdown solvability checked by a brute-force solver.

use std::collections::{BTreeMap, BTreeSet};

use metronome_core::RunSeed;
use metronome_dataloader::{
    ArithmeticConfig, ArithmeticTask, CountdownConfig, CountdownTask, Dataset, Holdout, Operator,
    PromptContent, Span, holdout_bucket,
};

// ---------------------------------------------------------------------------------
// An independent evaluator: a recursive-descent parser over exact rationals.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ratio {
    num: i128,
    den: i128,
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 { a.abs() } else { gcd(b, a % b) }
}

impl Ratio {
    fn new(num: i128, den: i128) -> Option<Self> {
        if den == 0 {
            return None;
        }
        let g = gcd(num, den).max(1);
        let sign = if den < 0 { -1 } else { 1 };
        Some(Self { num: sign * num / g, den: sign * den / g })
    }
    fn int(n: i128) -> Self {
        Self { num: n, den: 1 }
    }
    fn apply(self, op: char, o: Self) -> Option<Self> {
        match op {
            '+' => Self::new(self.num * o.den + o.num * self.den, self.den * o.den),
            '-' => Self::new(self.num * o.den - o.num * self.den, self.den * o.den),
            '*' => Self::new(self.num * o.num, self.den * o.den),
            '/' => Self::new(self.num * o.den, self.den * o.num),
            _ => None,
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    numbers: Vec<i128>,
}

impl Parser<'_> {
    fn expr(&mut self) -> Ratio {
        let mut v = self.term();
        while self.i < self.s.len() && matches!(self.s[self.i], b'+' | b'-') {
            let op = self.s[self.i] as char;
            self.i += 1;
            v = v.apply(op, self.term()).unwrap();
        }
        v
    }
    fn term(&mut self) -> Ratio {
        let mut v = self.atom();
        while self.i < self.s.len() && matches!(self.s[self.i], b'*' | b'/') {
            let op = self.s[self.i] as char;
            self.i += 1;
            v = v.apply(op, self.atom()).expect("division by zero");
        }
        v
    }
    fn atom(&mut self) -> Ratio {
        if self.s[self.i] == b'(' {
            self.i += 1;
            let v = self.expr();
            assert_eq!(self.s[self.i], b')');
            self.i += 1;
            return v;
        }
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
            self.i += 1;
        }
        let n: i128 = std::str::from_utf8(&self.s[start..self.i]).unwrap().parse().unwrap();
        self.numbers.push(n);
        Ratio::int(n)
    }
}

/// The value of `text` and the numbers it uses.
fn evaluate(text: &str) -> (Ratio, Vec<i128>) {
    let mut p = Parser { s: text.as_bytes(), i: 0, numbers: Vec::new() };
    let v = p.expr();
    assert_eq!(p.i, text.len(), "trailing input in {text}");
    (v, p.numbers)
}

/// Whether `target` can be made from `numbers`, each used at most once, with + - * /
/// over the rationals: the classic exhaustive pair-combining search.
fn solvable(numbers: &[Ratio], target: Ratio) -> bool {
    if numbers.contains(&target) {
        return true;
    }
    for i in 0..numbers.len() {
        for j in 0..numbers.len() {
            if i == j {
                continue;
            }
            let rest: Vec<Ratio> =
                numbers.iter().enumerate().filter(|&(k, _)| k != i && k != j).map(|(_, &r)| r).collect();
            for op in ['+', '-', '*', '/'] {
                if let Some(v) = numbers[i].apply(op, numbers[j]) {
                    let mut next = rest.clone();
                    next.push(v);
                    if solvable(&next, target) {
                        return true;
                    }
                }
            }
        }
    }
    false
}

// ---------------------------------------------------------------------------------

fn text(task: &dyn Dataset, i: usize) -> (String, Option<String>, BTreeMap<String, String>) {
    let r = task.record(i).unwrap();
    let PromptContent::Text(text) = r.content else { panic!("generators emit text") };
    (text, r.reference, r.metadata)
}

#[test]
fn arithmetic_answers_are_correct_for_every_item() {
    let configs = [
        ArithmeticConfig::default(),
        ArithmeticConfig {
            operators: vec![Operator::Add, Operator::Sub, Operator::Mul],
            digits: Span::new(1, 3),
            terms: Span::new(2, 5),
            ..ArithmeticConfig::default()
        },
        ArithmeticConfig {
            operators: vec![Operator::Mul],
            digits: Span::new(6, 9),
            terms: Span::new(2, 4),
            format: "Compute {expression}. Answer:".into(),
            ..ArithmeticConfig::default()
        },
    ];
    for config in configs {
        let format = config.format.clone();
        let (prefix, suffix) = format.split_once("{expression}").unwrap();
        let task = ArithmeticTask::new(config, RunSeed(9)).unwrap();
        for i in 0..task.len() {
            let (text, reference, metadata) = text(&task, i);
            let expression = text.strip_prefix(prefix).unwrap().strip_suffix(suffix).unwrap();
            assert_eq!(metadata["expression"], expression);
            let (value, _) = evaluate(expression);
            assert_eq!(value.den, 1);
            assert_eq!(reference.unwrap(), value.num.to_string(), "{text}");
        }
    }
}

#[test]
fn arithmetic_without_negatives_never_answers_negative() {
    let config = ArithmeticConfig {
        operators: vec![Operator::Sub],
        terms: Span::new(2, 6),
        allow_negative: false,
        ..ArithmeticConfig::default()
    };
    let task = ArithmeticTask::new(config, RunSeed(1)).unwrap();
    for i in 0..task.len() {
        let (text, reference, _) = text(&task, i);
        let (value, _) = evaluate(text.strip_suffix('=').unwrap());
        assert!(value.num >= 0, "{text}");
        assert_eq!(reference.unwrap(), value.num.to_string());
    }
}

#[test]
fn arithmetic_knobs_change_the_distribution() {
    let stats = |config: ArithmeticConfig| {
        let task = ArithmeticTask::new(config, RunSeed(5)).unwrap();
        let (mut operators, mut operand_digits, mut multiplications, mut magnitude) =
            (0usize, 0usize, 0usize, 0f64);
        for i in 0..task.len() {
            let (text, reference, _) = text(&task, i);
            let expression = text.strip_suffix('=').unwrap();
            let (_, numbers) = evaluate(expression);
            operators += numbers.len() - 1;
            operand_digits += numbers.iter().map(|n| n.to_string().len()).sum::<usize>();
            multiplications += expression.matches('*').count();
            magnitude += reference.unwrap().trim_start_matches('-').len() as f64;
        }
        let n = task.len() as f64;
        (operators as f64 / n, operand_digits as f64 / n, multiplications, magnitude / n)
    };
    let base = stats(ArithmeticConfig::default());
    let more_terms = stats(ArithmeticConfig { terms: Span::exactly(4), ..ArithmeticConfig::default() });
    let more_digits = stats(ArithmeticConfig { digits: Span::exactly(4), ..ArithmeticConfig::default() });
    let with_mul = stats(ArithmeticConfig {
        operators: vec![Operator::Add, Operator::Mul],
        ..ArithmeticConfig::default()
    });
    assert_eq!(base.0, 1.0);
    assert_eq!(more_terms.0, 3.0);
    assert_eq!(more_digits.1, 8.0);
    assert!(more_digits.3 > base.3 + 2.0, "{more_digits:?} vs {base:?}");
    assert_eq!(base.2, 0);
    assert!(with_mul.2 > 300 && with_mul.2 < 700, "{with_mul:?}");
    assert!(with_mul.3 > base.3, "products are larger than sums");
}

#[test]
fn generators_are_deterministic_per_seed() {
    let a = ArithmeticTask::new(ArithmeticConfig::default(), RunSeed(1)).unwrap();
    let b = ArithmeticTask::new(ArithmeticConfig::default(), RunSeed(1)).unwrap();
    let c = ArithmeticTask::new(ArithmeticConfig::default(), RunSeed(2)).unwrap();
    let fixed =
        ArithmeticTask::new(ArithmeticConfig { seed: Some(1), ..ArithmeticConfig::default() }, RunSeed(2))
            .unwrap();
    let items = |t: &ArithmeticTask| (0..50).map(|i| t.item(i).unwrap()).collect::<Vec<_>>();
    assert_eq!(items(&a), items(&b));
    assert_ne!(items(&a), items(&c));
    assert_eq!(items(&a), items(&fixed), "a fixed seed ignores the run seed");
    let d = CountdownTask::new(CountdownConfig::default(), RunSeed(1)).unwrap();
    let e = CountdownTask::new(CountdownConfig::default(), RunSeed(1)).unwrap();
    assert_eq!(d.item(17).unwrap(), e.item(17).unwrap());
}

#[test]
fn countdown_references_use_each_number_once_and_hit_the_target() {
    let configs = [
        CountdownConfig::default(),
        CountdownConfig {
            numbers: Span::new(2, 6),
            max_number: 100,
            target: Span::new(10, 999),
            ..Default::default()
        },
        CountdownConfig {
            operators: vec![Operator::Add, Operator::Sub],
            numbers: Span::exactly(3),
            target: Span::new(1, 60),
            size: 300,
            ..Default::default()
        },
    ];
    for config in configs {
        let operators: String = config.operators.iter().map(|o| o.symbol()).collect();
        let (span, target_span) = (config.numbers, config.target);
        let task = CountdownTask::new(config, RunSeed(21)).unwrap();
        for i in 0..task.len() {
            let (text, reference, metadata) = text(&task, i);
            let reference = reference.unwrap();
            let numbers: Vec<i128> = metadata["numbers"].split(',').map(|n| n.parse().unwrap()).collect();
            let target: i128 = metadata["target"].parse().unwrap();
            assert!(text.contains(&format!("equals {target}.")), "{text}");
            assert!((span.min..=span.max).contains(&(numbers.len() as u64)));
            assert!((target_span.min..=target_span.max).contains(&(target as u64)));
            let (value, mut used) = evaluate(&reference);
            assert_eq!(value, Ratio::int(target), "{reference} for {metadata:?}");
            let mut given = numbers.clone();
            given.sort_unstable();
            used.sort_unstable();
            assert_eq!(used, given, "{reference} must use every number exactly once");
            assert!(
                reference.chars().all(|c| c.is_ascii_digit() || "()".contains(c) || operators.contains(c))
            );
        }
    }
}

#[test]
fn countdown_instances_are_solvable_by_an_independent_search() {
    let task = CountdownTask::new(CountdownConfig { size: 150, ..Default::default() }, RunSeed(3)).unwrap();
    for i in 0..task.len() {
        let (_, _, metadata) = text(&task, i);
        let numbers: Vec<Ratio> =
            metadata["numbers"].split(',').map(|n| Ratio::int(n.parse().unwrap())).collect();
        let target = Ratio::int(metadata["target"].parse().unwrap());
        assert!(solvable(&numbers, target), "{metadata:?}");
    }
}

#[test]
fn countdown_knobs_change_the_distribution() {
    let mean = |config: CountdownConfig| {
        let task = CountdownTask::new(config, RunSeed(8)).unwrap();
        let (mut count, mut largest) = (0.0, 0.0);
        for i in 0..task.len() {
            let (_, _, metadata) = text(&task, i);
            let numbers: Vec<f64> = metadata["numbers"].split(',').map(|n| n.parse().unwrap()).collect();
            count += numbers.len() as f64;
            largest += numbers.iter().copied().fold(0.0, f64::max);
        }
        (count / task.len() as f64, largest / task.len() as f64)
    };
    let small = mean(CountdownConfig { numbers: Span::exactly(3), max_number: 10, ..Default::default() });
    let large = mean(CountdownConfig { numbers: Span::exactly(5), max_number: 100, ..Default::default() });
    assert_eq!(small.0, 3.0);
    assert_eq!(large.0, 5.0);
    assert!(small.1 <= 10.0 && large.1 > 40.0, "{small:?} {large:?}");
}

#[test]
fn train_and_heldout_splits_never_share_a_problem() {
    // The partition takes about `percent` of the space: all 10 000 default sums.
    let heldout_sums = (0..100)
        .flat_map(|a| (0..100).map(move |b| format!("{a}+{b}")))
        .filter(|key| holdout_bucket(key) < 10)
        .count();
    assert!((850..=1150).contains(&heldout_sums), "{heldout_sums}");

    let expressions = |holdout, seed| {
        let config = ArithmeticConfig { holdout, size: 1500, ..ArithmeticConfig::default() };
        let task = ArithmeticTask::new(config, RunSeed(seed)).unwrap();
        (0..task.len()).map(|i| text(&task, i).2["expression"].clone()).collect::<BTreeSet<_>>()
    };
    let train = expressions(Holdout::train(10), 1);
    let heldout = expressions(Holdout::heldout(10), 2);
    assert!(train.len() > 800 && heldout.len() > 300, "{} {}", train.len(), heldout.len());
    assert!(train.is_disjoint(&heldout));

    let instances = |holdout, seed| {
        let config = CountdownConfig { holdout, size: 400, ..CountdownConfig::default() };
        let task = CountdownTask::new(config, RunSeed(seed)).unwrap();
        (0..task.len())
            .map(|i| {
                let metadata = text(&task, i).2;
                let mut numbers: Vec<u64> =
                    metadata["numbers"].split(',').map(|n| n.parse().unwrap()).collect();
                numbers.sort_unstable();
                (numbers, metadata["target"].clone())
            })
            .collect::<BTreeSet<_>>()
    };
    let train = instances(Holdout::train(20), 1);
    let heldout = instances(Holdout::heldout(20), 2);
    assert!(train.is_disjoint(&heldout));
    assert!(
        ArithmeticConfig { holdout: Holdout::heldout(0), ..ArithmeticConfig::default() }.validate().is_err()
    );
}
