//! Generation throughput of the tiny model on CPU:
//! - `slots/<n>`: generated tokens/s with `n` KV-cache slots (1 worker, 1 thread, a
//!   frozen copy of the model, as pipeline workers decode with),
//!   64 responses of 32 tokens each (end-of-sequence ignored, so every layout does
//!   the same work);
//! - `batching/{continuous,static_padded,static}`: 64 responses whose lengths are
//!   long-tailed (sampling stops on two token ids, about 2% per step, capped at 160
//!   tokens), 16 slots. Continuous batching refills a slot as soon as its response
//!   ends. Both static modes admit the next batch of 16 only when the longest response
//!   of the current one ends; they differ in what a finished response costs meanwhile:
//!   - `static_padded` ([`Batching::StaticPadded`]) is static batching as practised
//!     (Hugging Face `transformers` `generate`, the continuous-batching literature's
//!     baseline, and the baseline of the 1.5x target): finished rows stay in
//!     every decode forward, computed and discarded;
//!   - `static` ([`Batching::Static`]) is a stronger, row-skipping baseline: finished
//!     rows leave the forward, so a batch's tail costs only its live rows.
//!
//! `benches/hf_generate.py` measures Hugging Face `transformers` `generate` on the same
//! architecture for comparison (opt-in: needs torch and transformers). With
//! `METRONOME_HF_PYTHON=python3` set, the summary runs it between its own rounds, one
//! thread on both sides, and reports the ratio per slot count side by side.
//!
//! Run with `cargo bench -p metronome-rollout`; `RAYON_NUM_THREADS=1
//! CANDLE_NUM_THREADS=1` pins every path to one thread. `-- summary` (a filter
//! no criterion group matches) runs only the summary.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use metronome_core::{PeriodId, PolicyVersion, Prompt, PromptId, RunSeed, Tokenizer};
use metronome_model::{CharTokenizer, Device, Model, ModelConfig};
use metronome_rollout::{Batching, EngineConfig, ModelEngine, SamplingConfig, Submission, model_engine};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn prompts(n: usize) -> Vec<Prompt> {
    (0..n)
        .map(|i| {
            let text = format!("{:>3} + {:>3} = ", i * 7 % 100, i * 13 % 100);
            Prompt {
                id: PromptId(i as u64),
                tokens: CharTokenizer.encode(&text).unwrap(),
                text,
                ..Prompt::default()
            }
        })
        .collect()
}

fn engine(slots: usize, batching: Batching) -> ModelEngine {
    engine_with(slots, batching, true)
}

/// With `frozen`, the engine decodes from a frozen copy, as a rollout worker does
/// (decode-layout weights); without, from the training model's own weights.
fn engine_with(slots: usize, batching: Batching, frozen: bool) -> ModelEngine {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).unwrap();
    let model = if frozen { model.frozen_copy().unwrap() } else { model.with_trainable(false) };
    let config = EngineConfig {
        workers: 1,
        threads_per_worker: Some(1),
        max_num_seqs: slots,
        max_seq_len: 256,
        batching,
        ..EngineConfig::default()
    };
    model_engine(model, PolicyVersion(0), Arc::new(CharTokenizer), config, RunSeed(42)).unwrap()
}

/// Runs one submission and returns the tokens generated.
fn run(rt: &tokio::runtime::Runtime, e: &ModelEngine, sub: &Submission) -> usize {
    let groups = rt.block_on(e.generate_groups(sub.clone())).unwrap();
    groups.iter().flat_map(|g| &g.completions).map(|c| c.tokens.len()).sum()
}

fn fixed_length_submission() -> Submission {
    Submission {
        period: PeriodId(0),
        prompts: prompts(16),
        group_size: 4,
        sampling: SamplingConfig { max_new_tokens: 32, ignore_eos: true, ..SamplingConfig::default() },
        seed: RunSeed(0),
    }
}

fn long_tail_submission() -> Submission {
    Submission {
        period: PeriodId(0),
        prompts: prompts(16),
        group_size: 4,
        sampling: SamplingConfig {
            max_new_tokens: 160,
            stop_token_ids: Some(vec![2, 50]),
            ..SamplingConfig::default()
        },
        seed: RunSeed(11),
    }
}

fn fixed_length(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let sub = fixed_length_submission();
    let mut group = c.benchmark_group("slots");
    group.sample_size(10).measurement_time(Duration::from_secs(8)).warm_up_time(Duration::from_secs(1));
    for slots in [1, 4, 16, 64] {
        let e = engine(slots, Batching::Continuous);
        let tokens = run(&rt, &e, &sub);
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_function(slots.to_string(), |b| b.iter(|| black_box(run(&rt, &e, &sub))));
    }
    group.finish();
}

fn long_tail(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let sub = long_tail_submission();
    let mut group = c.benchmark_group("batching");
    group.sample_size(10).measurement_time(Duration::from_secs(8)).warm_up_time(Duration::from_secs(1));
    for (name, batching) in BATCHING {
        let e = engine(16, batching);
        let tokens = run(&rt, &e, &sub);
        let stats = e.worker_stats()[0];
        eprintln!(
            "batching/{name}: {tokens} tokens, {} decode steps, mean rows per step {:.1} of 16 ({:.1} of them padding)",
            stats.decode_steps,
            stats.decode_rows as f64 / stats.decode_steps.max(1) as f64,
            stats.padding_rows as f64 / stats.decode_steps.max(1) as f64
        );
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_function(name, |b| b.iter(|| black_box(run(&rt, &e, &sub))));
    }
    group.finish();
}

/// The long-tail workload's modes: continuous, padded static (the standard
/// baseline), row-skipping static (a stronger one).
const BATCHING: [(&str, Batching); 3] = [
    ("continuous", Batching::Continuous),
    ("static_padded", Batching::StaticPadded),
    ("static", Batching::Static),
];

/// Ratios robust to a shared, noisy machine: the engines under comparison run
/// alternately. Throughput per slot count keeps each engine's fastest run; the
/// continuous/static ratio is taken per round (the two runs of a round are adjacent in
/// time, so a load burst from another process hits both) and reported as the median
/// and range over the rounds, a steadier figure than a ratio of two separate minima.
fn summary() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // Per round and engine: (tokens, seconds).
    let rounds = |engines: &[&ModelEngine], sub: &Submission, n: usize| -> Vec<Vec<(usize, f64)>> {
        (0..n)
            .map(|_| {
                engines
                    .iter()
                    .map(|e| {
                        let t = Instant::now();
                        let tokens = run(&rt, e, sub);
                        (tokens, t.elapsed().as_secs_f64())
                    })
                    .collect()
            })
            .collect()
    };
    let fastest = |runs: &[Vec<(usize, f64)>], i: usize| {
        runs.iter().map(|r| r[i]).fold((0, f64::INFINITY), |b, (tokens, s)| (tokens, b.1.min(s)))
    };
    // The slot counts on a frozen copy, then 1 and 64 slots on the training model's own
    // weights (candle's matmul, inputs padded to 16 rows), in the same rounds.
    let mut slots: Vec<ModelEngine> = SLOTS.iter().map(|&n| engine(n, Batching::Continuous)).collect();
    slots.extend([1, 64].map(|n| engine_with(n, Batching::Continuous, false)));
    let refs: Vec<&ModelEngine> = slots.iter().collect();
    let hf = std::env::var("METRONOME_HF_PYTHON").ok();
    let mut runs = Vec::new();
    let mut hf_rounds = Vec::new();
    // Each round: every engine's fastest of three interleaved runs, then (opt-in) the
    // transformers script's fastest of three; a ratio compares the two of one round.
    for _ in 0..3 {
        let best = rounds(&refs, &fixed_length_submission(), 3);
        runs.push((0..refs.len()).map(|i| fastest(&best, i)).collect());
        if let Some(python) = &hf {
            hf_rounds.push(hf_generate(python));
        }
    }
    println!("summary (fastest of interleaved runs)");
    for (i, n) in SLOTS.iter().enumerate() {
        let (tokens, secs) = fastest(&runs, i);
        print!("  slots {n:>2}: {:8.0} tokens/s", tokens as f64 / secs);
        // Per round: ours over transformers in the adjacent run, then median and range.
        let mut ratios: Vec<f64> = runs
            .iter()
            .zip(&hf_rounds)
            .filter_map(|(r, hf)| Some(r[i].0 as f64 / r[i].1 / hf.get(i).copied().flatten()?))
            .collect();
        ratios.sort_by(f64::total_cmp);
        if !ratios.is_empty() {
            let best_hf = hf_rounds.iter().filter_map(|h| h.get(i).copied().flatten()).fold(0.0, f64::max);
            print!(
                ", transformers generate {best_hf:6.0} tokens/s, ratio {:.2}x (median of {} paired rounds, range \
                 {:.2}-{:.2})",
                ratios[ratios.len() / 2],
                ratios.len(),
                ratios[0],
                ratios[ratios.len() - 1]
            );
        }
        println!();
    }
    // (slots, index of the frozen engine, index of the training-layout engine)
    for (n, i, j) in [(1, 0, SLOTS.len()), (64, 3, SLOTS.len() + 1)] {
        let (tokens, secs) = fastest(&runs, j);
        let frozen = fastest(&runs, i);
        println!(
            "  slots {n:>2} on training-layout weights: {:8.0} tokens/s (frozen copy {:.2}x)",
            tokens as f64 / secs,
            (frozen.0 as f64 / frozen.1) / (tokens as f64 / secs)
        );
    }
    // The three modes alternate within each round; a ratio compares continuous with a
    // static mode in the same round.
    let engines: Vec<ModelEngine> = BATCHING.iter().map(|&(_, b)| engine(16, b)).collect();
    let refs: Vec<&ModelEngine> = engines.iter().collect();
    // Each round: every mode's fastest of three interleaved runs (one run is about a
    // tenth of a second, short enough for a load burst to swing a single pair).
    let runs: Vec<Vec<(usize, f64)>> = (0..9)
        .map(|_| {
            let best = rounds(&refs, &long_tail_submission(), 3);
            (0..refs.len()).map(|i| fastest(&best, i)).collect()
        })
        .collect();
    let c = fastest(&runs, 0);
    println!(
        "  long tail, 16 slots, 64 responses: continuous {:.0} tokens/s (fastest of {} rounds)",
        c.0 as f64 / c.1,
        runs.len()
    );
    let labels = [
        "",
        "padded static (the standard baseline, as transformers generate: finished rows computed until the batch's \
         longest ends)",
        "row-skipping static (finished rows leave the forward; a stronger baseline than the standard one)",
    ];
    for (i, label) in labels.iter().enumerate().skip(1) {
        let mut ratios: Vec<f64> = runs.iter().map(|r| r[i].1 / r[0].1).collect();
        ratios.sort_by(f64::total_cmp);
        let s = fastest(&runs, i);
        let stats = engines[i].worker_stats()[0];
        println!(
            "    continuous vs {label}: {:.0} tokens/s, ratio {:.2}x (median of {} paired rounds, range {:.2}-{:.2}); \
             {:.1} rows per decode step, {:.1} of them padding",
            s.0 as f64 / s.1,
            ratios[ratios.len() / 2],
            ratios.len(),
            ratios[0],
            ratios[ratios.len() - 1],
            stats.decode_rows as f64 / stats.decode_steps.max(1) as f64,
            stats.padding_rows as f64 / stats.decode_steps.max(1) as f64,
        );
    }
    let stats = engines[0].worker_stats()[0];
    println!(
        "    continuous: {:.1} rows per decode step",
        stats.decode_rows as f64 / stats.decode_steps.max(1) as f64
    );
}

/// Slot counts of the fixed-length workload.
const SLOTS: [usize; 4] = [1, 4, 16, 64];

/// One run of `benches/hf_generate.py` (fastest of three repeats, one thread): tokens/s per slot count
/// of [`SLOTS`], `None` where it failed or printed no figure.
fn hf_generate(python: &str) -> Vec<Option<f64>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/hf_generate.py");
    let batches: Vec<String> = SLOTS.iter().map(ToString::to_string).collect();
    let out = std::process::Command::new(python)
        .args([script, "--threads", "1", "--repeats", "3", "--batches"])
        .args(&batches)
        .output();
    let text = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(o) => {
            eprintln!("hf_generate.py failed: {}", String::from_utf8_lossy(&o.stderr));
            String::new()
        }
        Err(e) => {
            eprintln!("cannot run {python}: {e}");
            String::new()
        }
    };
    // Lines read "transformers generate batch  64:     12016 tokens/s (...)".
    SLOTS
        .iter()
        .map(|n| {
            text.lines().find_map(|l| {
                let rest = l.strip_prefix("transformers generate batch")?.trim_start();
                let (batch, rest) = rest.split_once(':')?;
                (batch.trim() == n.to_string()).then_some(())?;
                rest.split_whitespace().next()?.parse().ok()
            })
        })
        .collect()
}

criterion_group!(benches, fixed_length, long_tail);

/// Re-runs the bench with `MIMALLOC_PURGE_DELAY=-1` unless the environment sets it, as
/// the `metronome` binary runs its workers: each decode step frees and re-allocates the
/// same activation buffers, and with mimalloc's default purging each re-fault zeroes
/// fresh pages in the kernel (about 4% of a 64-slot run, measured). mimalloc reads its
/// options at start-up, and setting one in-process needs `unsafe`.
fn reexec_with_allocator_env() {
    metronome_testkit::bench::rerun_with_env("MIMALLOC_PURGE_DELAY", "-1");
}

fn main() {
    reexec_with_allocator_env();
    benches();
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and then the
    // summary's timed runs are skipped.
    if std::env::args().any(|a| a == "--bench") {
        summary();
    }
    Criterion::default().configure_from_args().final_summary();
}
