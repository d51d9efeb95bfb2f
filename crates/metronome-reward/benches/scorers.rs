//! Completions scored per second on one core (the bench thread) by the math verifier
//! and the countdown checker, over a fixed corpus of realistic completions.
//!
//! `cargo bench -p metronome-reward`; criterion reports throughput in elements
//! (completions) per second.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use metronome_core::{Completion, Group, Prompt, RewardFn};
use metronome_reward::{CountdownChecker, MathVerifier, PoolConfig, PoolScorer};

const REASONING: &str = "Let me think step by step. First we compute the partial sums, then we check the \
    remaining cases carefully and simplify the expression. Each step follows from the previous one. ";

fn math_corpus() -> Vec<(Prompt, Completion)> {
    let answers = [
        (r"\boxed{42}", "42"),
        ("#### 1,234", "1234"),
        (r"The answer is $\frac{3}{4}$.", "0.75"),
        (r"<answer>-7.5</answer>", "-15/2"),
        (r"\boxed{12\text{ cm}}", "12"),
        ("so 18 apples remain", "18"),
        (r"\boxed{50\%}", "0.5"),
        (r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{2}"),
        ("I am not sure.", "3"),
        (r"\boxed{41}", "42"),
    ];
    answers
        .iter()
        .map(|(answer, reference)| {
            let prompt = Prompt { reference: Some((*reference).to_owned()), ..Prompt::default() };
            let text = format!("{}{answer}", REASONING.repeat(4));
            (prompt, Completion { text, ..Completion::default() })
        })
        .collect()
}

fn countdown_corpus() -> Vec<(Prompt, Completion)> {
    // Each answer with its own numbers, so the corpus mixes right, wrong-valued and
    // invalid expressions under the default every-number-once rule; the target is 60.
    let answers = [
        ("25,5,3", "<answer>(25 - 5) * 3</answer>"),
        ("6,1,3,4", "<answer>6 / (1 - 3 / 4)</answer>"),
        ("25,3,5,10", "<answer>25 * 3 - 5 - 10</answer>"),
        ("5,1", "<answer>5 * 5</answer>"),
        ("100,4,8", "<answer>(100 + 4) / 8</answer>"),
        ("3,25,5,100", "The answer is (3 + 25) * 5 - 100 = 40."),
        ("25,5,3,1", r"\boxed{(25 + 5) \times (3 - 1)}"),
        ("3,4", "<answer>3 + * 4</answer>"),
    ];
    answers
        .iter()
        .map(|(numbers, answer)| {
            let metadata = [("numbers", *numbers), ("target", "60")].map(|(k, v)| (k.into(), v.into()));
            let prompt = Prompt { metadata: metadata.into_iter().collect(), ..Prompt::default() };
            let text = format!("<think>{}</think>\n{answer}", REASONING.repeat(4));
            (prompt, Completion { text, ..Completion::default() })
        })
        .collect()
}

fn bench(c: &mut Criterion, name: &str, scorer: &dyn RewardFn, corpus: &[(Prompt, Completion)]) {
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(corpus.len() as u64));
    group.bench_function("completions", |b| {
        b.iter(|| {
            let mut sum = 0.0f32;
            for (p, comp) in corpus {
                sum += scorer.score(black_box(p), black_box(comp)).total;
            }
            sum
        });
    });
    group.finish();
}

/// The floor to compare against: one lower-cased copy of each completion (a single
/// pass and allocation over the same bytes).
fn baseline(c: &mut Criterion, corpus: &[(Prompt, Completion)]) {
    let mut group = c.benchmark_group("baseline_lowercase_copy");
    group.throughput(Throughput::Elements(corpus.len() as u64));
    group.bench_function("completions", |b| {
        b.iter(|| {
            corpus.iter().map(|(_, comp)| black_box(&comp.text).to_ascii_lowercase().len()).sum::<usize>()
        });
    });
    group.finish();
}

/// The same math corpus as one group through a one-worker [`PoolScorer`]: the cost of
/// the thread hand-off, time limit bookkeeping and advantage computation per completion.
fn pooled(c: &mut Criterion, corpus: &[(Prompt, Completion)]) {
    let scorer = PoolScorer::new(MathVerifier::new(), PoolConfig { workers: 1, ..PoolConfig::default() })
        .expect("pool starts");
    let group = Group {
        prompt: corpus[0].0.clone(),
        completions: corpus
            .iter()
            .enumerate()
            .map(|(i, (_, comp))| Completion { sample_index: i as u32, ..comp.clone() })
            .collect(),
        ..Group::default()
    };
    let mut g = c.benchmark_group("math_verifier_pool_1_worker");
    g.throughput(Throughput::Elements(corpus.len() as u64));
    g.bench_function("completions", |b| {
        b.iter(|| scorer.score_blocking(group.clone()).expect("scores").stats.mean);
    });
    g.finish();
}

fn scorers(c: &mut Criterion) {
    let math = math_corpus();
    baseline(c, &math);
    bench(c, "math_verifier", &MathVerifier::new(), &math);
    pooled(c, &math);
    bench(c, "countdown_checker", &CountdownChecker::new(), &countdown_corpus());
}

criterion_group!(benches, scorers);
criterion_main!(benches);
