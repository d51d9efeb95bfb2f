//! LoRA against full fine-tuning in the same trainer, on SmolLM2-135M's shape with
//! random weights (the shape decides the cost, not the values): trainable
//! parameters, the trainer's state for them (f64 gradient sums and AdamW's two
//! moments), peak resident memory, and the time of a training step (one micro-batch
//! of one group, G = 4 responses of 16..32 tokens to a 48-token prompt in the
//! shared-prompt layout, then the optimiser step), as ratios LoRA / full.
//!
//! ```sh
//! RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 cargo bench -p metronome-trainer --bench lora
//! RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 cargo bench -p metronome-trainer --bench lora -- --kl 0.04 --rounds 3
//! ```
//!
//! Each measurement runs in a process of its own (this program again, told what to
//! run by the environment), so that each peak resident set size (`VmHWM`) is that
//! variant's alone; the variants alternate (full, LoRA, full, LoRA, …) so that a
//! change of load on a shared machine touches both, and the medians over the rounds
//! are compared. Options: `--rank R` (8), `--steps N` timed steps per process after
//! one warm-up (3), `--rounds N` (2), `--kl C` the KL coefficient (0; above 0 full
//! fine-tuning keeps a frozen reference copy and LoRA reads the base). Under
//! `cargo test` (no `--bench`) it runs the tiny model, one round of one step, so the
//! code path is checked without the cost.

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use metronome_core::TrainBatch;
use metronome_model::{Device, LoraConfig, Model, ModelConfig};
use metronome_testkit::BatchBuilder;
use metronome_trainer::TrainerConfig;
use serde::{Deserialize, Serialize};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// One group, as the trainer bench's first: a 48-token prompt and G = 4 responses of
/// 16..31 tokens in the shared-prompt layout, advantages ±1.
fn one_group() -> TrainBatch {
    let prompt: Vec<u32> = (0..48).map(|i| 3 + (i * 7) % 90).collect();
    let responses: Vec<Vec<u32>> =
        (0..4u32).map(|r| (0..16 + 5 * r).map(|j| 3 + (j * 13 + r * 7) % 90).collect()).collect();
    BatchBuilder::new().shared_prompt(0, &prompt, &responses, &[1.0, -1.0, 1.0, -1.0]).build()
}

/// Set in a child process: the JSON of the [`Job`] to run.
const JOB_ENV: &str = "METRONOME_LORA_BENCH_JOB";

/// What one child process measures.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    lora: Option<usize>,
    smollm2: bool,
    steps: usize,
    kl: f32,
}

/// What one child process reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Measured {
    parameters: usize,
    trainable: usize,
    /// Bytes of the trainer's state per trainable parameter: the f64 gradient sum
    /// and AdamW's two f32 moments (with LoRA, plus the adapters themselves).
    state_bytes: usize,
    /// Resident memory once the model is built, and the peak, in bytes.
    rss_model: u64,
    peak_rss: u64,
    /// Seconds of each timed step (accumulate + optimiser step), and of its phases.
    step: Vec<f64>,
    forward: Vec<f64>,
    backward: Vec<f64>,
    optimizer: Vec<f64>,
    positions: usize,
    targets: usize,
}

/// A `/proc/self/status` field in bytes (Linux; 0 elsewhere).
fn status_bytes(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn run_job(job: &Job) -> Result<Measured> {
    let shape = if job.smollm2 { ModelConfig::smollm2_135m() } else { ModelConfig::tiny() };
    let model = Model::new(shape, &Device::Cpu, 1)?;
    let parameters = model.num_parameters();
    let rss_model = status_bytes("VmRSS:");
    let mut cfg = TrainerConfig::default();
    cfg.schedule.lr = 1e-4;
    cfg.loss.kl_coef = job.kl;
    cfg.lora = job.lora.map(|rank| LoraConfig { rank, alpha: 2.0 * rank as f64, ..LoraConfig::default() });
    let mut t = cfg.build(model)?;
    let trainable: usize = match job.lora {
        Some(_) => t.policy().adapter_parameters().iter().map(|(_, v)| v.elem_count()).sum(),
        None => parameters,
    };
    // Adapters are new memory; full fine-tuning trains weights that exist anyway.
    let state_bytes = trainable * (8 + 4 + 4 + if job.lora.is_some() { 4 } else { 0 });
    let batch = one_group();
    let (mut step, mut forward, mut backward, mut optimizer) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..=job.steps {
        let mut b = batch.clone();
        b.sequences.iter_mut().for_each(|s| s.version = t.version());
        let before = t.phase_times();
        let start = Instant::now();
        t.accumulate_sync(&b)?;
        let report = t.step_sync()?;
        let elapsed = start.elapsed().as_secs_f64();
        if !report.applied {
            bail!("step {i} was not applied");
        }
        if i == 0 {
            // The warm-up: allocator pools, first-touch page faults.
            continue;
        }
        // The trainer keeps running totals per phase.
        let after = t.phase_times();
        step.push(elapsed);
        forward.push((after.forward - before.forward).as_secs_f64());
        backward.push((after.backward - before.backward).as_secs_f64());
        optimizer.push((after.optimizer - before.optimizer).as_secs_f64());
    }
    Ok(Measured {
        parameters,
        trainable,
        state_bytes,
        rss_model,
        peak_rss: status_bytes("VmHWM:"),
        step,
        forward,
        backward,
        optimizer,
        positions: batch.num_positions(),
        targets: batch.targets.len(),
    })
}

/// Runs `job` in a child process (this program) and reads its report.
fn spawn(job: &Job) -> Result<Measured> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe).env(JOB_ENV, serde_json::to_string(job)?).output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("the {job:?} process failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let line = stdout.lines().find_map(|l| l.strip_prefix("MEASURED ")).context("no MEASURED line")?;
    Ok(serde_json::from_str(line)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

fn mb(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

/// The medians of several processes of one variant.
struct Summary {
    trainable: usize,
    state_bytes: usize,
    peak_rss: f64,
    over_model: f64,
    step: f64,
    phases: (f64, f64, f64),
}

fn summarise(runs: &[Measured]) -> Summary {
    let m = |f: &dyn Fn(&Measured) -> f64| median(runs.iter().map(f).collect());
    let steps = |f: &dyn Fn(&Measured) -> &Vec<f64>| median(runs.iter().flat_map(|r| f(r).clone()).collect());
    Summary {
        trainable: runs[0].trainable,
        state_bytes: runs[0].state_bytes,
        peak_rss: m(&|r| r.peak_rss as f64),
        over_model: m(&|r| r.peak_rss.saturating_sub(r.rss_model) as f64),
        step: steps(&|r| &r.step),
        phases: (steps(&|r| &r.forward), steps(&|r| &r.backward), steps(&|r| &r.optimizer)),
    }
}

fn main() -> Result<()> {
    if let Ok(job) = std::env::var(JOB_ENV) {
        let measured = run_job(&serde_json::from_str(&job)?)?;
        println!("MEASURED {}", serde_json::to_string(&measured)?);
        return Ok(());
    }
    let args: Vec<String> = std::env::args().collect();
    let bench = args.iter().any(|a| a == "--bench");
    let option = |name: &str, default: f64| -> Result<f64> {
        match args.iter().position(|a| a == name) {
            Some(i) => args.get(i + 1).context("a value after the option")?.parse().context(name.to_owned()),
            None => Ok(default),
        }
    };
    let rank = option("--rank", 8.0)? as usize;
    let (steps, rounds) =
        if bench { (option("--steps", 3.0)? as usize, option("--rounds", 2.0)? as usize) } else { (1, 1) };
    let kl = option("--kl", 0.0)? as f32;
    let job = |lora| Job { lora, smollm2: bench, steps, kl };
    let (mut full, mut lora) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        full.push(spawn(&job(None))?);
        lora.push(spawn(&job(Some(rank)))?);
        eprintln!("round {} of {rounds} done", round + 1);
    }
    let first = &full[0];
    println!(
        "{} shape ({:.1} M parameters), kl_coef {kl}; a step: one group of {} positions, {} targets, \
         then the optimiser; {rounds} rounds of {steps} steps, medians",
        if bench { "SmolLM2-135M" } else { "tiny" },
        first.parameters as f64 / 1e6,
        first.positions,
        first.targets
    );
    let (f, l) = (summarise(&full), summarise(&lora));
    for (name, s) in [("full fine-tuning".to_owned(), &f), (format!("LoRA r={rank}, all 7 projections"), &l)]
    {
        println!(
            "{name}: {:.2} M trainable, state {:.1} MB, peak RSS {:.0} MB ({:.0} MB over the model), \
             step {:.3} s (forward {:.3}, backward {:.3}, optimiser {:.3})",
            s.trainable as f64 / 1e6,
            mb(s.state_bytes as f64),
            mb(s.peak_rss),
            mb(s.over_model),
            s.step,
            s.phases.0,
            s.phases.1,
            s.phases.2
        );
    }
    println!(
        "LoRA / full: trainable {:.4}, state {:.4}, peak RSS {:.2}, RSS over the model {:.2}, step time {:.2} \
         (forward {:.2}, backward {:.2}, optimiser {:.3})",
        l.trainable as f64 / f.trainable as f64,
        l.state_bytes as f64 / f.state_bytes as f64,
        l.peak_rss / f.peak_rss,
        l.over_model / f.over_model,
        l.step / f.step,
        l.phases.0 / f.phases.0,
        l.phases.1 / f.phases.1,
        l.phases.2 / f.phases.2
    );
    Ok(())
}
