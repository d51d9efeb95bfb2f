//! Trainer forward+backward time of the shared-prompt layout against the padded
//! baseline, over a grid of prompt length P, response length L and group size G, with
//! the realised time saving printed beside the token-saving bound (G−1)P / (G(P+L)).
//!
//! The target: where the bound exceeds 20%, the realised saving is at least
//! 80% of it. The table is measured side by side in one run (interleaved repetitions,
//! median), so only the ratios mean anything. `METRONOME_PACKING_REPS` sets the
//! repetitions (default 5). Beside the times the table prints the attention pairs of
//! the shared row relative to the padded rows, with a dense mask (what the model
//! evaluates today) and following the segments (what a segment-aware kernel would).
//! Pass a criterion filter that matches nothing (`cargo bench --bench packing -- none`)
//! to print only the table; `METRONOME_PACKING_GRID=small` runs only P=64, L=32 (as
//! does `cargo test --all-targets`, which runs each case once and prints no table).

use std::{
    hint::black_box,
    time::{Duration, Instant},
};

use criterion::{BenchmarkId, Criterion};
use metronome_core::{
    AdvantageEstimator, Completion, Group, PeriodId, Prompt, PromptId, Reward, ScoredGroup, TokenId, mix64,
};
use metronome_masking::{AttentionPairs, Layout, attention_pairs, padded, saving_bound, shared_prompt};
use metronome_model::{Device, Model, ModelConfig};

fn group(p: usize, l: usize, g: usize, vocab: usize) -> ScoredGroup {
    let mut state = (p * 1_000_003 + l * 1009 + g) as u64;
    let mut tokens = |n: usize| -> Vec<TokenId> {
        (0..n)
            .map(|_| {
                state = mix64(state.wrapping_add(0x9e37_79b9_7f4a_7c15));
                (3 + state % (vocab as u64 - 3)) as TokenId
            })
            .collect()
    };
    let prompt = Prompt { id: PromptId(0), tokens: tokens(p), ..Prompt::default() };
    let completions = (0..g)
        .map(|i| Completion {
            sample_index: i as u32,
            tokens: tokens(l),
            logprobs: vec![-1.0; l],
            ..Completion::default()
        })
        .collect();
    let group = Group { period: PeriodId(0), prompt, completions, ..Group::default() };
    let rewards = (0..g).map(|i| Reward::scalar((i % 2) as f32)).collect();
    ScoredGroup::new(group, rewards, AdvantageEstimator::GroupNorm).expect("rewards match completions")
}

/// One trainer step's network work on a layout: target log-probs, a scalar loss, backward.
fn forward_backward(model: &Model, layout: &Layout) {
    let out = model.target_logprobs(&layout.batch.rows, &layout.batch.targets).expect("forward");
    let loss = out.logprobs.sum_all().and_then(|s| s.neg()).expect("loss");
    black_box(loss.backward().expect("backward"));
}

/// True under `cargo bench` (which passes `--bench`); `cargo test --all-targets` runs
/// this binary without it, and then only checks that each case runs once.
fn benchmarking() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn grid() -> Vec<(usize, usize, usize)> {
    let small = !benchmarking() || std::env::var("METRONOME_PACKING_GRID").is_ok_and(|v| v == "small");
    let (ps, ls): (&[usize], &[usize]) = if small { (&[64], &[32]) } else { (&[64, 256], &[32, 128]) };
    let mut out = Vec::new();
    for &p in ps {
        for &l in ls {
            for g in [4, 8, 16] {
                out.push((p, l, g));
            }
        }
    }
    out
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The side-by-side table: interleaved repetitions so drift hits both layouts alike.
fn table(model: &Model, cases: &[(usize, usize, usize, Layout, Layout)]) {
    let reps: usize = std::env::var("METRONOME_PACKING_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    println!("\nshared-prompt vs padded trainer forward+backward (median of {reps}, interleaved)");
    println!(
        "{:>4} {:>4} {:>3} {:>9} {:>9} {:>7} {:>8} {:>7} {:>7} {:>10} {:>10}",
        "P", "L", "G", "shared", "padded", "bound", "realised", "ratio", "target", "attn dense", "attn seg"
    );
    for (p, l, g, shared, base) in cases {
        forward_backward(model, shared);
        forward_backward(model, base);
        let (mut ts, mut tp) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let t = Instant::now();
            forward_backward(model, shared);
            ts.push(t.elapsed());
            let t = Instant::now();
            forward_backward(model, base);
            tp.push(t.elapsed());
        }
        let (ts, tp) = (median(ts), median(tp));
        let bound = saving_bound(*p, *l as f64, *g);
        let realised = 1.0 - ts.as_secs_f64() / tp.as_secs_f64();
        let ratio = realised / bound;
        let target = if bound <= 0.2 {
            "n/a"
        } else if ratio >= 0.8 {
            "met"
        } else {
            "MISSED"
        };
        // Attention pairs of the shared row relative to the padded rows: with the dense
        // mask the model evaluates, and with an attention that follows the segments.
        let pairs = |l: &Layout| l.batch.rows.iter().map(attention_pairs).sum::<AttentionPairs>();
        let (ps, pp) = (pairs(shared), pairs(base));
        println!(
            "{p:>4} {l:>4} {g:>3} {:>7.1}ms {:>7.1}ms {:>6.1}% {:>7.1}% {:>7.2} {target:>7} {:>9.2}x {:>9.2}x",
            ts.as_secs_f64() * 1e3,
            tp.as_secs_f64() * 1e3,
            bound * 100.0,
            realised * 100.0,
            ratio,
            ps.dense as f64 / pp.dense as f64,
            ps.visible as f64 / pp.visible as f64,
        );
    }
}

fn main() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 0).expect("model");
    let vocab = model.config().vocab_size;
    let cases: Vec<_> = grid()
        .into_iter()
        .map(|(p, l, g)| {
            let grp = group(p, l, g, vocab);
            (
                p,
                l,
                g,
                shared_prompt(&grp).expect("layout"),
                padded(std::slice::from_ref(&grp), 0).expect("layout"),
            )
        })
        .collect();

    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    {
        let mut group = c.benchmark_group("trainer_fwd_bwd");
        for (p, l, g, shared, base) in &cases {
            let id = format!("P{p}_L{l}_G{g}");
            group.bench_with_input(BenchmarkId::new("shared_prompt", &id), shared, |b, lay| {
                b.iter(|| forward_backward(&model, lay));
            });
            group.bench_with_input(BenchmarkId::new("padded", &id), base, |b, lay| {
                b.iter(|| forward_backward(&model, lay));
            });
        }
        group.finish();
    }
    c.final_summary();
    if benchmarking() {
        table(&model, &cases);
    }
}
