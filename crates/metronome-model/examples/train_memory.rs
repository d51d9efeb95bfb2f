//! Peak memory of a training step with and without the memory levers: the chunked
//! log-prob head (`Model::with_chunked_head`) and gradient checkpointing of the decoder
//! layers (`Model::with_gradient_checkpointing`), alone and together, at a model shape
//! of `benches/llama_shapes.json` with random weights (the shape decides the memory,
//! not the values).
//!
//! ```sh
//! cargo run --release -p metronome-model --example train_memory                      # tiny (a smoke run)
//! cargo run --release -p metronome-model --example train_memory -- \
//!     --shape smollm2-135m --rows 4 --len 512 [--precision bf16]
//! ```
//!
//! A step is what `examples/throughput.rs` times: the forward and backward of the
//! summed next-token log-probs of `ROWS` causal rows of `LEN` tokens through
//! `Model::score` (every position but the last is a target), the gradients then
//! dropped; with `--precision bf16` on a bf16 compute copy beside the f32 weights, as
//! the trainer holds them. Each variant runs in a process of its own (this program
//! again, told what to run by the environment) so that each peak resident set size
//! (`VmHWM` of `/proc/self/status`, Linux; glibc's allocator told to return every
//! large block when it is freed, so that the peak follows the tensors alive at once)
//! is that variant's alone; it also reports the peak over the resident memory once
//! the model and the batch are built (what the step adds), and the step's time.

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use metronome_core::{PackedRow, Segment, Targets};
use metronome_model::{Device, Model, Precision};
use serde::{Deserialize, Serialize};

#[path = "support/shapes.rs"]
mod shapes;

/// Set in a child process: the JSON of the [`Job`] to run.
const JOB_ENV: &str = "METRONOME_TRAIN_MEMORY_JOB";

/// What one child process measures.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    shape: String,
    rows: usize,
    len: usize,
    precision: Precision,
    chunked_head: bool,
    checkpointing: bool,
}

/// What one child process reports, in bytes and seconds.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Measured {
    rss_built: u64,
    peak_rss: u64,
    step: f64,
}

/// A `/proc/self/status` field in bytes (0 where there is none).
fn status_bytes(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64).map(|i| 3 + (metronome_core::mix64(seed << 20 | i) % (vocab as u64 - 3)) as u32).collect()
}

fn run_job(job: &Job) -> Result<Measured> {
    let cfg = shapes::shape(&job.shape)?;
    let vocab = cfg.vocab_size;
    let master = Model::new(cfg, &Device::Cpu, 0)?;
    let model = match job.precision {
        Precision::F32 => master.clone(),
        Precision::Bf16 => master.compute_copy(job.precision.dtype())?,
    };
    let chunk = job.chunked_head.then(|| model.default_head_chunk());
    let model = model.with_chunked_head(chunk).with_gradient_checkpointing(job.checkpointing);
    let mut rows = Vec::new();
    let mut targets = Targets::default();
    for r in 0..job.rows {
        let t = tokens(r as u64, job.len, vocab);
        for p in 0..job.len - 1 {
            targets.row.push(r as u32);
            targets.position.push(p as u32);
            targets.token.push(t[p + 1]);
        }
        rows.push(PackedRow {
            tokens: t,
            positions: (0..job.len as u32).collect(),
            segments: vec![Segment { start: 0, len: job.len as u32, parent: None }],
        });
    }
    let batch = model.prepare_batch(&rows, &targets)?;
    let rss_built = status_bytes("VmRSS:");
    let start = Instant::now();
    let out = model.score(&batch, 1.0)?;
    let grads = out.logprobs.sum_all()?.neg()?.backward()?;
    drop((grads, out));
    let step = start.elapsed().as_secs_f64();
    drop(master);
    Ok(Measured { rss_built, peak_rss: status_bytes("VmHWM:"), step })
}

/// Runs `job` in a child process (this program) and reads its report.
fn spawn(job: &Job) -> Result<Measured> {
    // glibc raises its mmap threshold to the size of each large block freed, after
    // which freed tensors stay in the heap and in the resident set; a fixed threshold
    // returns every block of 128 KiB and more to the system when it is freed, so that
    // the peak follows the tensors alive at once.
    let out = Command::new(std::env::current_exe()?)
        .env(JOB_ENV, serde_json::to_string(job)?)
        .env("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("the {job:?} process failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let line = stdout.lines().find_map(|l| l.strip_prefix("MEASURED ")).context("no MEASURED line")?;
    Ok(serde_json::from_str(line)?)
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> Result<()> {
    if let Ok(job) = std::env::var(JOB_ENV) {
        println!("MEASURED {}", serde_json::to_string(&run_job(&serde_json::from_str(&job)?)?)?);
        return Ok(());
    }
    let (mut shape, mut rows, mut len, mut precision) = ("tiny".to_owned(), 2usize, 64usize, Precision::F32);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--shape" => shape = value()?,
            "--rows" => rows = value()?.parse()?,
            "--len" => len = value()?.parse()?,
            "--precision" => precision = value()?.parse().map_err(anyhow::Error::msg)?,
            other => {
                bail!("unknown argument `{other}` (--shape NAME, --rows N, --len N, --precision f32|bf16)")
            }
        }
    }
    if len < 2 || rows == 0 {
        bail!("--rows must be at least 1 and --len at least 2");
    }
    println!(
        "{shape}, {rows} x {len} tokens, {precision}: peak RSS of a forward and backward, one process each"
    );
    let mut plain = None;
    for (name, chunked_head, checkpointing) in [
        ("whole-logits head", false, false),
        ("chunked head", true, false),
        ("checkpointed layers", false, true),
        ("chunked head + checkpointed layers", true, true),
    ] {
        let job = Job { shape: shape.clone(), rows, len, precision, chunked_head, checkpointing };
        let m = spawn(&job)?;
        let over = m.peak_rss.saturating_sub(m.rss_built);
        let base = *plain.get_or_insert((m.peak_rss, over));
        println!(
            "  {name:<35} peak {:>7.0} MB ({:.2}x), step adds {:>7.0} MB ({:.2}x); step {:.2} s",
            mb(m.peak_rss),
            m.peak_rss as f64 / base.0 as f64,
            mb(over),
            over as f64 / base.1.max(1) as f64,
            m.step
        );
    }
    Ok(())
}
