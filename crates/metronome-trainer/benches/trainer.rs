//! Trainer throughput on the tiny model.
//!
//! - `accumulate/shared_prompt/<groups>`: target tokens/s of forward + loss + backward
//!   for micro-batches of 1..8 groups (G = 4, prompt 48, responses 16..32) packed with
//!   the shared-prompt layout, one group tree per row;
//! - `accumulate/separate_rows/<groups>`: the same responses as separate
//!   `prompt + response` rows (the padded baseline without padding waste), for the
//!   shared-prompt saving;
//! - `period/8_groups`: a whole period (8 micro-batches, then the optimiser step);
//!   after it the split of time between forward, backward and optimiser is printed.
//! - `reference/{fused,two_pass}/<threads>/<groups>` and
//!   `reference_period/{fused,two_pass}/<threads>`: with a KL term (so a frozen
//!   reference scores every micro-batch), the trainer's forward, which lays a
//!   micro-batch out once for the policy and the reference (`Model::prepare_batch`,
//!   `Model::score`) and schedules the two forwards together (side by side on a pool
//!   of two threads), against the two `Model::target_logprobs` passes in turn that it
//!   ran before, with the same loss, backward, accumulation and AdamW step, on trainer
//!   pools of one and two threads. Before criterion's report, the two are run
//!   alternately and the ratio of their minimum times is printed.
//! - `reference precision`: one matmul of the model's widest layer in f32, bf16 and
//!   f16, the ratio that decides whether a reference in lower precision could pay.
//!
//! Before each accumulate benchmark the minimum forward and backward times over five
//! runs are printed too (criterion's means suffer on a busy machine).
//!
//! Run with `cargo bench -p metronome-trainer`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use metronome_core::TrainBatch;
use std::time::Instant;

use candle_core::Tensor;
use metronome_model::{Device, Model, ModelConfig};
use metronome_testkit::BatchBuilder;
use metronome_trainer::loss::{LossInputs, grpo_loss};
use metronome_trainer::optim::{AdamW, GradAccumulator, clip_grad_norm};
use metronome_trainer::{GrpoTrainer, TrainerConfig};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const G: u32 = 4;
const PROMPT: u32 = 48;

fn response(g: u32, r: u32) -> Vec<u32> {
    (0..16 + (r * 5 + g) % 17).map(|j| 3 + (j * 13 + r * 7 + g * 17) % 90).collect()
}

fn prompt(g: u32) -> Vec<u32> {
    (0..PROMPT).map(|i| 3 + (i * 7 + g * 11) % 90).collect()
}

/// `groups` groups from `first` on, each a shared-prompt tree in one row or one row
/// per response; advantages ±1.
fn micro_batch(first: u32, groups: u32, shared: bool) -> TrainBatch {
    let advantages: Vec<f32> = (0..G).map(|r| if r % 2 == 0 { 1.0 } else { -1.0 }).collect();
    let add = |b: BatchBuilder, g: u32| {
        let responses: Vec<Vec<u32>> = (0..G).map(|r| response(g, r)).collect();
        if shared {
            b.shared_prompt(u64::from(g), &prompt(g), &responses, &advantages)
        } else {
            b.separate_rows(u64::from(g), &prompt(g), &responses, &advantages)
        }
    };
    (first..first + groups).fold(BatchBuilder::new(), add).build()
}

fn trainer() -> GrpoTrainer {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).expect("tiny model");
    let mut cfg = TrainerConfig::default();
    cfg.schedule.lr = 1e-4;
    cfg.build(model).expect("trainer")
}

/// Minimum over a few runs of the forward and backward time of one micro-batch: on a
/// shared machine the minimum is the figure least disturbed by other processes.
fn print_min_split(t: &mut GrpoTrainer, batch: &TrainBatch, name: &str, groups: u32) {
    let (mut fwd, mut bwd) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        let before = t.phase_times();
        t.accumulate_sync(batch).expect("accumulate");
        let after = t.phase_times();
        fwd = fwd.min((after.forward - before.forward).as_secs_f64());
        bwd = bwd.min((after.backward - before.backward).as_secs_f64());
    }
    println!(
        "{name}/{groups}: {} positions, {} targets, min forward {:.1} ms, min backward {:.1} ms, {:.0} targets/s",
        batch.num_positions(),
        batch.targets.len(),
        fwd * 1e3,
        bwd * 1e3,
        batch.targets.len() as f64 / (fwd + bwd)
    );
}

fn accumulate(c: &mut Criterion) {
    let mut group = c.benchmark_group("accumulate");
    group.sample_size(10);
    for shared in [true, false] {
        let name = if shared { "shared_prompt" } else { "separate_rows" };
        for groups in [1u32, 2, 4, 8] {
            let batch = micro_batch(0, groups, shared);
            group.throughput(Throughput::Elements(batch.targets.len() as u64));
            let mut t = trainer();
            print_min_split(&mut t, &batch, name, groups);
            group.bench_with_input(BenchmarkId::new(name, groups), &batch, |b, batch| {
                b.iter(|| t.accumulate_sync(batch).expect("accumulate"));
            });
        }
    }
    group.finish();
}

fn period(c: &mut Criterion) {
    let batches: Vec<TrainBatch> = (0..8).map(|g| micro_batch(g, 1, true)).collect();
    let tokens: usize = batches.iter().map(|b| b.targets.len()).sum();
    let mut t = trainer();
    let mut group = c.benchmark_group("period");
    group.sample_size(10);
    group.throughput(Throughput::Elements(tokens as u64));
    group.bench_function("8_groups", |b| {
        b.iter(|| {
            let v = t.version();
            for batch in &batches {
                let mut batch = batch.clone();
                batch.sequences.iter_mut().for_each(|s| s.version = v);
                t.accumulate_sync(&batch).expect("accumulate");
            }
            t.step_sync().expect("step")
        });
    });
    group.finish();
    let p = t.phase_times();
    let total = (p.forward + p.backward + p.optimizer).as_secs_f64();
    println!(
        "period split: forward {:.1}%, backward {:.1}%, optimizer {:.1}% ({} periods)",
        100.0 * p.forward.as_secs_f64() / total,
        100.0 * p.backward.as_secs_f64() / total,
        100.0 * p.optimizer.as_secs_f64() / total,
        t.version().0
    );
}

/// The trainer's forward with a KL term as it was before the shared layout and the
/// joint scheduling: the policy and then the reference each lay the micro-batch out
/// and run their own pass; the loss, backward, accumulation and AdamW step are the
/// trainer's public pieces, on a pool of the same size as the trainer's.
struct TwoPass {
    cfg: TrainerConfig,
    policy: Model,
    reference: Model,
    params: Vec<(String, metronome_model::Var)>,
    accum: GradAccumulator,
    optimizer: AdamW,
    tokens: u64,
    pool: rayon::ThreadPool,
}

impl TwoPass {
    fn new(cfg: &TrainerConfig) -> Self {
        let policy = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).expect("tiny model");
        let reference = policy.frozen_copy().expect("reference");
        let params = policy.parameters();
        Self {
            cfg: cfg.clone(),
            accum: GradAccumulator::new(params.len()),
            optimizer: AdamW::new(cfg.optimizer, &params).expect("optimizer"),
            policy,
            reference,
            params,
            tokens: 0,
            pool: rayon::ThreadPoolBuilder::new().num_threads(cfg.threads()).build().expect("pool"),
        }
    }

    fn accumulate(&mut self, batch: &TrainBatch) {
        let Self { cfg, policy, reference, params, accum, tokens, pool, .. } = self;
        pool.install(|| {
            let t = &batch.targets;
            let out = policy.target_logprobs(&batch.rows, t).expect("policy forward");
            let reference = reference.target_logprobs(&batch.rows, t).expect("reference forward").logprobs;
            let behaviour =
                Tensor::from_slice(&t.behaviour_logprob, t.len(), &Device::Cpu).expect("behaviour");
            let old = out.logprobs.detach();
            let terms = grpo_loss(
                &cfg.loss,
                LossInputs {
                    logprobs: &out.logprobs,
                    old_logprobs: &old,
                    behaviour_logprobs: &behaviour,
                    ref_logprobs: Some(&reference),
                    entropy: Some(&out.entropy),
                    teacher_kl: None,
                    advantages: &t.advantage,
                    sequences: &t.sequence,
                },
            )
            .expect("loss");
            accum.add(params, &terms.loss.backward().expect("backward")).expect("accumulate");
            *tokens += terms.tokens;
        });
    }

    fn step(&mut self) {
        let Self { cfg, params, accum, optimizer, tokens, pool, .. } = self;
        pool.install(|| {
            let (mut grads, norm) = accum.finish(params, 1.0 / *tokens as f64).expect("finish");
            clip_grad_norm(&mut grads, norm, cfg.max_grad_norm.unwrap_or(f64::MAX)).expect("clip");
            let lr = cfg.schedule.lr_at(optimizer.steps());
            optimizer.step(params, &grads, lr).expect("step");
        });
        self.accum.clear();
        self.tokens = 0;
    }
}

fn kl_config(threads: usize) -> TrainerConfig {
    let mut cfg = TrainerConfig::default();
    cfg.schedule.lr = 1e-4;
    cfg.loss.kl_coef = 0.05;
    cfg.threads = Some(threads);
    cfg
}

/// Minimum time of `fused` and `two_pass` over `runs` alternating runs of each.
fn min_times(runs: usize, mut fused: impl FnMut(), mut two_pass: impl FnMut()) -> (f64, f64) {
    let (mut a, mut b) = (f64::MAX, f64::MAX);
    for _ in 0..runs {
        let start = Instant::now();
        fused();
        a = a.min(start.elapsed().as_secs_f64());
        let start = Instant::now();
        two_pass();
        b = b.min(start.elapsed().as_secs_f64());
    }
    (a, b)
}

/// Trainer pools of one thread (each stage its own core, the `periodic` placement on
/// two cores) and of two (`sync`, or a larger machine).
const REFERENCE_THREADS: [usize; 2] = [1, 2];

fn reference(c: &mut Criterion) {
    let mut group = c.benchmark_group("reference");
    group.sample_size(10);
    for threads in REFERENCE_THREADS {
        let cfg = kl_config(threads);
        for groups in [1u32, 4] {
            let batch = micro_batch(0, groups, true);
            let mut fused = cfg
                .build(Model::new(ModelConfig::tiny(), &Device::Cpu, 1).expect("tiny model"))
                .expect("trainer");
            let mut two = TwoPass::new(&cfg);
            let (a, b) = min_times(
                30,
                || {
                    fused.accumulate_sync(&batch).expect("accumulate");
                },
                || two.accumulate(&batch),
            );
            println!(
                "reference/{threads} threads/{groups} groups: fused {:.2} ms, two passes {:.2} ms, \
                 two passes / fused = {:.3}",
                a * 1e3,
                b * 1e3,
                b / a
            );
            let id = format!("{threads}_threads/{groups}_groups");
            group.throughput(Throughput::Elements(batch.targets.len() as u64));
            group.bench_with_input(BenchmarkId::new("fused", &id), &batch, |bench, batch| {
                bench.iter(|| fused.accumulate_sync(batch).expect("accumulate"));
            });
            group.bench_with_input(BenchmarkId::new("two_pass", &id), &batch, |bench, batch| {
                bench.iter(|| two.accumulate(batch));
            });
        }
    }
    group.finish();

    // A whole period: 8 one-group micro-batches, then the optimiser step.
    let batches: Vec<TrainBatch> = (0..8).map(|g| micro_batch(g, 1, true)).collect();
    let mut group = c.benchmark_group("reference_period");
    group.sample_size(10);
    for threads in REFERENCE_THREADS {
        let cfg = kl_config(threads);
        let mut fused = cfg
            .build(Model::new(ModelConfig::tiny(), &Device::Cpu, 1).expect("tiny model"))
            .expect("trainer");
        let mut two = TwoPass::new(&cfg);
        let mut fused_period = || {
            let v = fused.version();
            for batch in &batches {
                let mut batch = batch.clone();
                batch.sequences.iter_mut().for_each(|s| s.version = v);
                fused.accumulate_sync(&batch).expect("accumulate");
            }
            fused.step_sync().expect("step");
        };
        let mut two_period = || {
            for batch in &batches {
                two.accumulate(batch);
            }
            two.step();
        };
        let (a, b) = min_times(15, &mut fused_period, &mut two_period);
        println!(
            "reference_period/{threads} threads/8 groups: fused {:.1} ms, two passes {:.1} ms, \
             two passes / fused = {:.3}",
            a * 1e3,
            b * 1e3,
            b / a
        );
        group.bench_function(format!("fused/{threads}_threads"), |bench| bench.iter(&mut fused_period));
        group.bench_function(format!("two_pass/{threads}_threads"), |bench| bench.iter(&mut two_period));
    }
    group.finish();
}

/// Whether a reference held in lower precision could pay on the CPU: the matmul of
/// the tiny model's widest layer (`[rows, 128] x [128, 384]`, rows of a 4-group
/// micro-batch) in f32, bf16 and f16, minimum of alternating runs, as ratios to f32.
fn reference_precision(_: &mut Criterion) {
    let rows = micro_batch(0, 4, true).num_positions();
    let x = Tensor::randn(0f32, 1.0, (rows, 128), &Device::Cpu).expect("x");
    let w = Tensor::randn(0f32, 0.02, (384, 128), &Device::Cpu).expect("w");
    let mut best = [f64::MAX; 3];
    let dtypes = [candle_core::DType::F32, candle_core::DType::BF16, candle_core::DType::F16];
    let pairs: Vec<(Tensor, Tensor)> = dtypes
        .iter()
        .map(|&d| {
            (x.to_dtype(d).expect("x"), w.to_dtype(d).expect("w").t().expect("wt").contiguous().expect("w"))
        })
        .collect();
    for _ in 0..50 {
        for (i, (x, w)) in pairs.iter().enumerate() {
            let start = Instant::now();
            std::hint::black_box(x.matmul(w).expect("matmul"));
            best[i] = best[i].min(start.elapsed().as_secs_f64());
        }
    }
    println!(
        "reference precision, matmul [{rows}, 128] x [128, 384]: f32 {:.3} ms, bf16 {:.3} ms ({:.2}x f32), f16 {:.3} ms ({:.2}x f32)",
        best[0] * 1e3,
        best[1] * 1e3,
        best[1] / best[0],
        best[2] * 1e3,
        best[2] / best[0]
    );
}

criterion_group!(benches, accumulate, period, reference, reference_precision);
criterion_main!(benches);
