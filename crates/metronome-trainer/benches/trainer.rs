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
//!
//! Before each accumulate benchmark the minimum forward and backward times over five
//! runs are printed too (criterion's means suffer on a busy machine).
//!
//! Run with `cargo bench -p metronome-trainer`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use metronome_core::TrainBatch;
use metronome_model::{Device, Model, ModelConfig};
use metronome_testkit::BatchBuilder;
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

criterion_group!(benches, accumulate, period);
criterion_main!(benches);
