//! Throughput of the tiny configuration: training forward+backward tokens/s and
//! decode tokens/s at several batch sizes, a measured matmul peak (GFLOP/s), and the
//! model FLOP utilisation (MFU) against it; a GRPO group's prefill with its prompt shared
//! against distinct prompts (`group_prefill`); decode steps over a paged cache (blocks of
//! `KV_BLOCK` positions) against one block per slot (the summary's `paged decode`); and
//! what checking a snapshot's weights costs against installing them (`install`, at
//! SmolLM2-135M's shape).
//!
//! `cargo bench -p metronome-model --bench model`; compare with PyTorch on the same
//! machine with `python3 crates/metronome-model/benches/torch_compare.py`. Pin both to
//! the same thread count (`RAYON_NUM_THREADS=1` here, `--threads 1` there) for a fair
//! ratio. After criterion's report a summary prints tokens/s and MFU
//! (`METRONOME_BENCH_SUMMARY=1` prints only the summary; `METRONOME_BENCH_PROFILE=4`
//! only runs 4x256 training steps for 20 s, to profile).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use metronome_core::{PackedRow, Segment, Targets};
use metronome_model::{Device, KvCache, Model, ModelConfig, Tensor};

// Allocation churn was measured as a large share of candle's CPU training time
// (docs/design.md §6); a global allocator belongs to binaries and benches, never libraries.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SEQ: usize = 256;
const TRAIN_ROWS: [usize; 2] = [1, 4];
const DECODE_BATCHES: [usize; 4] = [1, 8, 32, 64];
const PROMPT: usize = 16;
const DECODE_STEPS: usize = 32;
/// A GRPO group's prefill: `GROUP` samples of one `GROUP_PROMPT`-token prompt (copied
/// from one computation), against `GROUP` different prompts of that length (each
/// computed, as every group's prefill was before samples shared their prompt's).
const GROUP: usize = 8;
const GROUP_PROMPT: usize = 96;

fn model() -> Model {
    Model::new(ModelConfig::tiny(), &Device::Cpu, 0).expect("tiny model")
}

/// `rows` causal rows of `SEQ` tokens; every position but the last predicts the next token.
fn train_batch(rows: usize) -> (Vec<PackedRow>, Targets) {
    let vocab = ModelConfig::tiny().vocab_size as u64;
    let mut out = Vec::new();
    let mut targets = Targets::default();
    for r in 0..rows {
        let tokens: Vec<u32> = (0..SEQ as u64)
            .map(|i| 3 + (metronome_core::mix64((r as u64) << 32 | i) % (vocab - 3)) as u32)
            .collect();
        for p in 0..SEQ - 1 {
            targets.row.push(r as u32);
            targets.position.push(p as u32);
            targets.token.push(tokens[p + 1]);
        }
        out.push(PackedRow {
            tokens,
            positions: (0..SEQ as u32).collect(),
            segments: vec![Segment { start: 0, len: SEQ as u32, parent: None }],
        });
    }
    (out, targets)
}

/// One forward+backward, run on a thread of a rayon pool of `RAYON_NUM_THREADS` threads,
/// as the trainer runs its steps (inside its pool): called from a thread outside the
/// pool, every parallel op of the step would hand its work to the pool and wait for it
/// (two thread switches per op, about 5% of a one-thread step of the tiny model).
fn train_step(model: &Model, rows: &[PackedRow], targets: &Targets) {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    let pool = POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().build().expect("a thread pool"));
    pool.install(|| {
        let out = model.target_logprobs(rows, targets).expect("forward");
        let grads =
            out.logprobs.sum_all().and_then(|l| l.neg()).and_then(|l| l.backward()).expect("backward");
        black_box(grads);
    });
}

/// Prefills `GROUP` empty slots in one forward: the same prompt in each with `shared`,
/// different prompts without.
fn group_prefill(model: &Model, shared: bool) {
    let mut cache = KvCache::new(model, GROUP, GROUP_PROMPT).expect("cache");
    let prompts: Vec<Vec<u32>> = (0..GROUP)
        .map(|s| {
            let s = if shared { 0 } else { s as u32 };
            (0..GROUP_PROMPT as u32).map(|i| 3 + (i * 7 + s * 11) % 90).collect()
        })
        .collect();
    let seqs: Vec<(usize, &[u32])> = prompts.iter().enumerate().map(|(s, p)| (s, p.as_slice())).collect();
    black_box(model.prefill_many(&mut cache, &seqs).expect("prefill"));
}

/// Runs `steps` decode steps over `batch` slots prefilled with `PROMPT` tokens; returns the time of the steps only.
fn decode_run(model: &Model, batch: usize, steps: usize) -> Duration {
    decode_from(model, KvCache::new(model, batch, PROMPT + steps).expect("cache"), PROMPT, steps)
}

/// Runs `steps` decode steps over every slot of `cache`, each prefilled with `prompt`
/// tokens; returns the time of the steps only.
fn decode_from(model: &Model, mut cache: KvCache, prompt: usize, steps: usize) -> Duration {
    let batch = cache.num_slots();
    for s in 0..batch {
        let prompt: Vec<u32> = (0..prompt as u32).map(|i| 3 + (i * 7 + s as u32) % 90).collect();
        model.prefill(&mut cache, s, &prompt).expect("prefill");
    }
    let start = Instant::now();
    for step in 0..steps {
        let b: Vec<(usize, u32)> = (0..batch).map(|s| (s, 3 + ((s + step) % 90) as u32)).collect();
        black_box(model.decode_step(&mut cache, &b).expect("decode"));
    }
    start.elapsed()
}

fn matmul_gflops(n: usize, reps: usize) -> f64 {
    let a = Tensor::ones((n, n), candle_core::DType::F32, &Device::Cpu).expect("a");
    let b = Tensor::ones((n, n), candle_core::DType::F32, &Device::Cpu).expect("b");
    black_box(a.matmul(&b).expect("warm-up"));
    let start = Instant::now();
    for _ in 0..reps {
        black_box(a.matmul(&b).expect("matmul"));
    }
    2.0 * (n * n * n * reps) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn benches(c: &mut Criterion) {
    let m = model();
    let mut g = c.benchmark_group("train_fwd_bwd");
    for rows in TRAIN_ROWS {
        let (batch, targets) = train_batch(rows);
        g.throughput(Throughput::Elements((rows * SEQ) as u64));
        g.bench_with_input(BenchmarkId::from_parameter(format!("{rows}x{SEQ}")), &rows, |b, _| {
            b.iter(|| train_step(&m, &batch, &targets));
        });
    }
    g.finish();
    // A frozen copy, as rollout workers decode with: its linear layers in decode layout.
    let frozen = m.frozen_copy().expect("frozen copy");
    let mut g = c.benchmark_group("decode");
    for batch in DECODE_BATCHES {
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_with_input(BenchmarkId::from_parameter(batch), &batch, |b, &batch| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut left = iters as usize;
                while left > 0 {
                    let steps = left.min(DECODE_STEPS);
                    total += decode_run(&frozen, batch, steps);
                    left -= steps;
                }
                total
            });
        });
    }
    g.finish();
    let mut g = c.benchmark_group("group_prefill");
    g.throughput(Throughput::Elements((GROUP * GROUP_PROMPT) as u64));
    for (name, shared) in [("distinct", false), ("shared", true)] {
        g.bench_function(name, |b| b.iter(|| group_prefill(&frozen, shared)));
    }
    g.finish();
    // What the hostile-input checks add to installing weights (issue #37): every
    // tensor's finiteness and element count (`HostTensor::check`, which every install
    // runs before writing a weight) against the whole in-place install
    // (`Model::load_snapshot`, the check included), at SmolLM2-135M's shape (540 MB).
    let big = Model::new(ModelConfig::smollm2_135m(), &Device::Cpu, 1).expect("smollm2 shape");
    let snapshot = big.snapshot(metronome_core::PolicyVersion(1)).expect("snapshot");
    let mut g = c.benchmark_group("install");
    g.sample_size(10);
    g.bench_function("check", |b| b.iter(|| black_box(snapshot.tensors.iter().all(|t| t.check().is_ok()))));
    g.bench_function("load_snapshot", |b| b.iter(|| big.load_snapshot(&snapshot).expect("install")));
    g.finish();
    drop((big, snapshot));
    let mut g = c.benchmark_group("matmul");
    for n in [256usize, 512] {
        let a = Tensor::ones((n, n), candle_core::DType::F32, &Device::Cpu).expect("a");
        g.throughput(Throughput::Elements((2 * n * n * n) as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(a.matmul(&a).expect("mm")))
        });
    }
    g.finish();
}

/// CPU time of this process so far (every thread), from Linux's `/proc/self/task/*/schedstat`
/// (nanoseconds on a core); `None` elsewhere. On a shared machine it leaves out the time
/// the process waited for a core, which wall-clock throughput does not.
fn cpu_seconds() -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e9)
}

/// Plain timings after criterion: tokens/s, the matmul peak and MFU in one place.
fn summary() {
    let m = model();
    let cfg = m.config().clone();
    // Best of several short runs: on a shared machine the maximum is the least disturbed.
    let peak = [256usize, 512, 768, 256, 512, 768].iter().map(|&n| matmul_gflops(n, 10)).fold(0.0, f64::max);
    println!(
        "\nsummary (threads: RAYON_NUM_THREADS={})",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into())
    );
    println!("matmul peak: {peak:.1} GFLOP/s");
    for rows in TRAIN_ROWS {
        let (batch, targets) = train_batch(rows);
        // Warm up until the allocator holds the step's peak footprint: first-touch page
        // faults (2 MiB transparent huge pages, when the kernel has them) otherwise land
        // in the timed steps and made 1x256 bimodal between runs (11K or 15K tokens/s).
        for _ in 0..3 {
            train_step(&m, &batch, &targets);
        }
        let reps = 10;
        let (start, cpu) = (Instant::now(), cpu_seconds());
        for _ in 0..reps {
            train_step(&m, &batch, &targets);
        }
        let tps = (reps * rows * SEQ) as f64 / start.elapsed().as_secs_f64();
        let cpu_tps = cpu.zip(cpu_seconds()).map(|(a, b)| (reps * rows * SEQ) as f64 / (b - a));
        // Training is ~3x the forward FLOPs; attention scores add 2·2·seq·d per token per layer forward.
        let attn = 4.0 * SEQ as f64 / 2.0
            * (cfg.num_attention_heads * cfg.head_dim) as f64
            * cfg.num_hidden_layers as f64;
        let flops = 3.0 * (cfg.dense_flops_per_token() + attn) * tps;
        let cpu_tps = cpu_tps.map_or_else(String::new, |t| format!(", {t:.0} tokens per CPU-second"));
        println!(
            "train fwd+bwd {rows}x{SEQ}: {tps:.0} tokens/s, {:.2} GFLOP/s, MFU {:.1}%{cpu_tps}",
            flops / 1e9,
            100.0 * flops / 1e9 / peak
        );
    }
    let frozen = m.frozen_copy().expect("frozen copy");
    for batch in DECODE_BATCHES {
        decode_run(&frozen, batch, 4);
        let t = decode_run(&frozen, batch, DECODE_STEPS);
        let tps = (batch * DECODE_STEPS) as f64 / t.as_secs_f64();
        let flops = cfg.dense_flops_per_token() * tps;
        println!("decode batch {batch}: {tps:.0} tokens/s, MFU {:.1}%", 100.0 * flops / 1e9 / peak);
    }
    // Alternating rounds, the best of each side (the least disturbed on a shared machine).
    let mut best = [f64::INFINITY; 2];
    for _ in 0..5 {
        for (i, shared) in [false, true].into_iter().enumerate() {
            let start = Instant::now();
            group_prefill(&frozen, shared);
            best[i] = best[i].min(start.elapsed().as_secs_f64());
        }
    }
    println!(
        "prefill of a group of {GROUP} x {GROUP_PROMPT} tokens: {:.2} ms with one prompt shared, {:.2} ms with {GROUP} \
         prompts ({:.2}x)",
        1e3 * best[1],
        1e3 * best[0],
        best[0] / best[1]
    );
    // What paging costs the decode attention, at a context where it is a large part of
    // the step: 32 slots of 480-token prompts, 32 steps, alternating rounds.
    let (slots, prompt, steps) = (32, 480, 32);
    let mut best = [f64::INFINITY; 2];
    for _ in 0..5 {
        for (i, paged) in [false, true].into_iter().enumerate() {
            let len = prompt + steps;
            let cache = if paged {
                KvCache::new(&frozen, slots, len)
            } else {
                KvCache::paged(&frozen, slots, len, len, slots)
            };
            best[i] = best[i].min(decode_from(&frozen, cache.expect("cache"), prompt, steps).as_secs_f64());
        }
    }
    println!(
        "paged decode, {slots} slots at {prompt}+{steps} tokens: {:.0} tokens/s in blocks of {}, {:.0} with one block \
         per slot ({:.3}x)",
        (slots * steps) as f64 / best[1],
        metronome_model::KV_BLOCK,
        (slots * steps) as f64 / best[0],
        best[0] / best[1]
    );
}

/// mimalloc returns freed memory to the OS 10 ms after it is freed by default, but a
/// training step frees and re-allocates the same megabyte-sized activations every few
/// milliseconds, and each re-fault zeroes a fresh page: measured as 17% of the run in
/// the kernel's `clear_page`; with `MIMALLOC_PURGE_DELAY=-1`, which keeps the memory,
/// this bench's page faults fell from ~100K to ~500 and its system time from 0.4 s to
/// 0.08 s (about a fifth of its CPU time). mimalloc reads
/// options from the environment and setting one in-process needs `unsafe`, so the
/// bench re-runs itself with the variable set (the same belongs in a trainer's
/// environment). An explicit value in the environment is left alone.
fn reexec_with_allocator_env() {
    metronome_testkit::bench::rerun_with_env("MIMALLOC_PURGE_DELAY", "-1");
}

fn main() {
    reexec_with_allocator_env();
    // `METRONOME_BENCH_PROFILE=ROWS` runs only training steps of ROWS x 256 tokens for
    // 20 s, for `perf record` without the other groups' set-up (the SmolLM2-shaped
    // model of `install` alone faults in 540 MB).
    if let Some(rows) = std::env::var("METRONOME_BENCH_PROFILE").ok().and_then(|r| r.parse().ok()) {
        let (m, (batch, targets)) = (model(), train_batch(rows));
        let (start, mut steps) = (Instant::now(), 0);
        while start.elapsed() < Duration::from_secs(20) {
            train_step(&m, &batch, &targets);
            steps += 1;
        }
        println!(
            "train fwd+bwd {rows}x{SEQ}: {:.0} tokens/s",
            (steps * rows * SEQ) as f64 / start.elapsed().as_secs_f64()
        );
        return;
    }
    // `METRONOME_BENCH_SUMMARY=1` skips criterion, for quick back-to-back comparisons.
    if std::env::var_os("METRONOME_BENCH_SUMMARY").is_some() {
        summary();
        return;
    }
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    benches(&mut c);
    c.final_summary();
    summary();
}
