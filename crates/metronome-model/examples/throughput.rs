//! Training and generation tokens/s of a model shape on a device: the Rust side of the
//! GPU comparison with PyTorch (`benches/torch_gpu.py` measures the same shapes, from
//! the same `benches/llama_shapes.json`, and the same work).
//!
//! ```sh
//! cargo run --release -p metronome-model --example throughput                 # tiny, CPU (a smoke run)
//! metronome-model/examples/throughput --device cuda:0 --shape qwen2.5-0.5b --precision bf16 \
//!     --train 8x1024 --memory chunked,chunked+checkpoint --generate '' --json out.json   # on a GPU
//! ```
//!
//! Weights are random (the shape decides the cost, not the values). Training: forward
//! and backward of the summed next-token log-probs over `ROWS` plain causal rows of
//! `LEN` tokens, as `Model::target_logprobs` computes them for the trainer, median of
//! `--reps` steps (5) after `--warmup` (2). `--precision bf16` trains a bf16 compute
//! copy with the f32 weights kept beside it, as the trainer holds them; `--memory`
//! lists the memory settings to time, each one of `whole` (the whole-logits head),
//! `chunked` (the chunked head) and either with `+checkpoint` (checkpointed decoder
//! layers) and `+flash` (rows attended per segment, on a GPU by the flash attention
//! kernels, instead of whole under `[rows, T, T]` masks, the GPU's default). On a GPU each step's peak device memory in use (total minus free, polled
//! every millisecond; this process's and any other's) is reported too; a setting
//! that runs out of memory is reported as such and the next one runs. Generation: `N`
//! sequences prefilled with a 32-token prompt, then greedy decode steps up to 128 new
//! tokens each, timed from the prefill to the last token, as Hugging Face `generate` is
//! timed, twice: with every row's logits to the host each step (`Model::decode_step`,
//! argmax there) and with the next tokens drawn where the logits are
//! (`Model::decode_step_drawing`, greedy draws: on a GPU the draw kernel, so only token
//! ids cross), as the rollout engine now decodes, and a third time so with the decode
//! steps replayed as CUDA graphs (`KvCache::set_cuda_graphs`), and a fourth drawn at
//! temperature 1 from the top-p 0.9 nucleus (the truncated draw), in `--precision` (the engine's
//! `rollout.precision`); beside them the memory roofline (the weights and every
//! sequence's KV cache read once per step at the device's measured copy bandwidth);
//! `--generate ''` skips it. `--publish` times publication to a rollout engine of the
//! same process: the f32 weights copied into an engine's weights in `--precision` on a
//! handle of its own (on a GPU its own CUDA stream), through the host (`Model::snapshot`
//! then `Model::load_snapshot`, the path before issue #31) and device to device
//! (`Model::snapshot_resident`, then the same install), against one raw device copy of
//! every weight (the floor; publication copies twice: out of the trainer's weights, then
//! into the engine's). `--json PATH` writes every figure.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use metronome_core::{PackedRow, Segment, Targets};
use metronome_model::{DeviceSpec, Draw, KvCache, Model, Next, Precision, Truncation};
use serde::Serialize;

#[path = "support/shapes.rs"]
mod shapes;

const PROMPT: usize = 32;
const NEW_TOKENS: usize = 128;

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64).map(|i| 3 + (metronome_core::mix64(seed << 20 | i) % (vocab as u64 - 3)) as u32).collect()
}

fn synchronize(model: &Model) -> Result<()> {
    Ok(model.device().synchronize()?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A memory setting of `--memory`: the chunked head or not, checkpointed layers or
/// not, rows attended per segment (`+flash`) or as the model's default.
#[derive(Clone, Copy, Debug)]
struct Memory {
    chunked: bool,
    checkpoint: bool,
    flash: bool,
}

impl Memory {
    fn parse(s: &str) -> Result<Self> {
        let (rest, flash) = s.strip_suffix("+flash").map_or((s, false), |r| (r, true));
        let (head, checkpoint) = rest.strip_suffix("+checkpoint").map_or((rest, false), |h| (h, true));
        let chunked = match head {
            "whole" => false,
            "chunked" => true,
            _ => bail!("--memory `{s}`: expected whole or chunked, each optionally +checkpoint, then +flash"),
        };
        Ok(Self { chunked, checkpoint, flash })
    }

    fn name(self) -> String {
        format!(
            "{}{}{}",
            if self.chunked { "chunked" } else { "whole" },
            if self.checkpoint { "+checkpoint" } else { "" },
            if self.flash { "+flash" } else { "" }
        )
    }

    fn apply(self, model: &Model) -> Model {
        let chunk = self.chunked.then(|| model.default_head_chunk());
        let m = model.clone().with_chunked_head(chunk).with_gradient_checkpointing(self.checkpoint);
        if self.flash { m.with_batched_attention(false) } else { m }
    }
}

/// One training figure of the JSON report.
#[derive(Debug, Serialize)]
struct TrainFigure {
    rows: usize,
    len: usize,
    memory: String,
    tokens_per_s: Option<f64>,
    step_ms: Option<f64>,
    tflops_6n: Option<f64>,
    peak_device_bytes: Option<u64>,
    error: Option<String>,
}

/// The JSON report of `--json`.
#[derive(Debug, Serialize)]
struct Report {
    shape: String,
    parameters: usize,
    device: String,
    precision: String,
    warmup: usize,
    reps: usize,
    train: Vec<TrainFigure>,
    /// `(sequences, tokens/s)` with the logits to the host.
    generate: Vec<(usize, f64)>,
    /// `(sequences, tokens/s)` with the tokens drawn where the logits are.
    generate_drawn: Vec<(usize, f64)>,
    /// `(sequences, tokens/s)` drawn where the logits are, decode steps replayed as CUDA
    /// graphs (`KvCache::set_cuda_graphs`; on the CPU the same as `generate_drawn`).
    generate_graphed: Vec<(usize, f64)>,
    /// `(sequences, tokens/s)` drawn where the logits are from the top-p 0.9 nucleus at
    /// temperature 1 (`Decode::TopP`).
    generate_top_p: Vec<(usize, f64)>,
    /// `(sequences, what the graphs did)` for those runs.
    generate_graph_stats: Vec<(usize, String)>,
    /// The device's copy bandwidth (bytes read and written per second), in GB/s.
    copy_bandwidth_gbps: Option<f64>,
    /// `(sequences, tokens/s)` if every decode step only read the weights and the KV
    /// cache once at that bandwidth: the memory roofline of greedy generation.
    generate_roofline: Vec<(usize, f64)>,
    /// `--publish`'s milliseconds (medians of `--reps`).
    publish: Option<PublishFigure>,
}

/// Milliseconds to publish the weights to an engine of the same process.
#[derive(Debug, Serialize)]
struct PublishFigure {
    /// Bytes of the f32 weights.
    bytes: usize,
    /// Snapshot to the host, then install from it.
    through_host_ms: f64,
    /// Snapshot left on the device, then install from it (device to device).
    resident_ms: f64,
    /// One device copy of every weight.
    raw_copy_ms: f64,
}

/// `--publish`: each way of publishing `masters` into `engine` (the engine's weights, on
/// a handle of its own), `reps` times after one untimed run, synchronised on both.
fn publish(masters: &Model, engine: &Model, reps: usize) -> Result<PublishFigure> {
    let sync = || -> Result<()> {
        synchronize(masters)?;
        synchronize(engine)
    };
    let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
        f()?;
        let mut times = Vec::new();
        for _ in 0..reps {
            sync()?;
            let start = Instant::now();
            f()?;
            sync()?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        Ok(median(times))
    };
    let version = metronome_core::PolicyVersion(1);
    let through_host_ms = time(&|| Ok(engine.load_snapshot(&masters.snapshot(version)?)?))?;
    let resident_ms = time(&|| Ok(engine.load_snapshot(&masters.snapshot_resident(version)?)?))?;
    let weights: Vec<_> = masters.parameters().into_iter().map(|(_, v)| v.as_tensor().clone()).collect();
    let raw_copy_ms = time(&|| {
        let copies = weights.iter().map(|w| w.copy()).collect::<candle_core::Result<Vec<_>>>()?;
        sync()?;
        drop(copies);
        Ok(())
    })?;
    let bytes = masters.num_parameters() * 4;
    Ok(PublishFigure { bytes, through_host_ms, resident_ms, raw_copy_ms })
}

/// Device memory in use (total minus free) polled every millisecond from a thread
/// while a closure runs, on a GPU; nothing on the CPU.
#[cfg(feature = "cuda")]
fn peak_device_memory<T>(model: &Model, f: impl FnOnce() -> Result<T>) -> Result<(T, Option<u64>)> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let metronome_model::Device::Cuda(dev) = model.device() else { return Ok((f()?, None)) };
    let ctx = Arc::clone(dev.cuda_stream().context());
    let (done, peak) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let poller = {
        let (done, peak) = (Arc::clone(&done), Arc::clone(&peak));
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if let Ok((free, total)) = ctx.mem_get_info() {
                    peak.fetch_max((total - free) as u64, Ordering::Relaxed);
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    let out = f();
    done.store(true, Ordering::Relaxed);
    let _ = poller.join();
    Ok((out?, Some(peak.load(Ordering::Relaxed))))
}

#[cfg(not(feature = "cuda"))]
fn peak_device_memory<T>(_model: &Model, f: impl FnOnce() -> Result<T>) -> Result<(T, Option<u64>)> {
    Ok((f()?, None))
}

/// Median seconds of one training step on `rows` rows of `len` tokens.
fn train(model: &Model, rows: usize, len: usize, warmup: usize, reps: usize) -> Result<f64> {
    let vocab = model.config().vocab_size;
    let mut packed = Vec::new();
    let mut targets = Targets::default();
    for r in 0..rows {
        let t = tokens(r as u64, len, vocab);
        for p in 0..len - 1 {
            targets.row.push(r as u32);
            targets.position.push(p as u32);
            targets.token.push(t[p + 1]);
        }
        packed.push(PackedRow {
            tokens: t,
            positions: (0..len as u32).collect(),
            segments: vec![Segment { start: 0, len: len as u32, parent: None }],
        });
    }
    let mut times = Vec::new();
    for i in 0..warmup + reps {
        synchronize(model)?;
        let start = Instant::now();
        let out = model.target_logprobs(&packed, &targets)?;
        let grads = out.logprobs.sum_all()?.neg()?.backward()?;
        drop((grads, out));
        synchronize(model)?;
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// How `generate` decodes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Decode {
    /// Argmax of the host's logits.
    LogitsToHost,
    /// Greedy draws where the logits are.
    Drawn,
    /// Drawn, the decode steps replayed as CUDA graphs.
    Graphed,
    /// Drawn at temperature 1 from the top-p 0.9 nucleus (the truncated draw: on a GPU
    /// `draw_truncated_rows_*`), each row's uniform number its own per step.
    TopP,
}

/// Tokens/s of `n` sequences decoding greedily as `how` says, and what the cache's CUDA
/// graphs did.
fn generate(model: &Model, n: usize, how: Decode) -> Result<(f64, metronome_model::DecodeGraphStats)> {
    let drawn = how != Decode::LogitsToHost;
    let vocab = model.config().vocab_size;
    let mut cache = KvCache::new(model, n, PROMPT + NEW_TOKENS + 1)?;
    cache.set_cuda_graphs(how == Decode::Graphed);
    let prompts: Vec<Vec<u32>> = (0..n).map(|s| tokens(1000 + s as u64, PROMPT, vocab)).collect();
    let seqs: Vec<(usize, &[u32])> = prompts.iter().enumerate().map(|(s, p)| (s, p.as_slice())).collect();
    synchronize(model)?;
    let start = Instant::now();
    let argmax =
        |l: &[f32]| l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32);
    let draws = |step: usize| -> Vec<Option<Draw<'static>>> {
        (0..n)
            .map(|s| {
                Some(if how == Decode::TopP {
                    let u = (metronome_core::mix64((step * n + s) as u64) >> 11) as f64 / (1u64 << 53) as f64;
                    Draw { truncation: Truncation { top_p: 0.9, ..Truncation::NONE }, ..Draw::new(1.0, u) }
                } else {
                    Draw::new(0.0, 0.0)
                })
            })
            .collect()
    };
    let token = |next: Next| match next {
        Next::Drawn(d) => d.token,
        Next::Logits(l) => argmax(&l),
    };
    let mut next: Vec<u32> = if drawn {
        model.prefill_many_drawing(&mut cache, &seqs, &draws(0))?.into_iter().map(token).collect()
    } else {
        model.prefill_many(&mut cache, &seqs)?.iter().map(|l| argmax(l)).collect()
    };
    for step in 1..NEW_TOKENS {
        let batch: Vec<(usize, u32)> = next.iter().enumerate().map(|(s, &t)| (s, t)).collect();
        next = if drawn {
            model.decode_step_drawing(&mut cache, &batch, &draws(step))?.into_iter().map(token).collect()
        } else {
            model.decode_step(&mut cache, &batch)?.iter().map(|l| argmax(l)).collect()
        };
    }
    synchronize(model)?;
    Ok(((n * NEW_TOKENS) as f64 / start.elapsed().as_secs_f64(), cache.decode_graphs()))
}

/// Bytes per second a device-to-device copy moves, counting the bytes read and written
/// (the median of five copies of 256 MiB on a GPU, 64 MiB on the CPU).
fn copy_bandwidth(dev: &metronome_model::Device) -> Result<f64> {
    let elements = if dev.is_cpu() { 16 << 20 } else { 64 << 20 };
    let t = metronome_model::Tensor::zeros(elements, metronome_model::DType::F32, dev)?;
    let mut times = Vec::new();
    for _ in 0..6 {
        dev.synchronize()?;
        let start = Instant::now();
        let copy = t.copy()?;
        dev.synchronize()?;
        times.push(start.elapsed().as_secs_f64());
        drop(copy);
    }
    times.remove(0); // the first allocates
    Ok(2.0 * 4.0 * elements as f64 / median(times))
}

/// Greedy generation's memory roofline for `n` sequences of `PROMPT` + `NEW_TOKENS`:
/// per decode step the weights are read once and each sequence's cached keys and values
/// once (its mean length over the steps), in the model's type; tokens/s at `bandwidth`.
fn decode_roofline(model: &Model, n: usize, bandwidth: f64) -> f64 {
    let cfg = model.config();
    let size = model.dtype().size_in_bytes() as f64;
    let weights = model.num_parameters() as f64 * size;
    let mean_len = PROMPT as f64 + NEW_TOKENS as f64 / 2.0;
    let kv = n as f64
        * mean_len
        * (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim) as f64
        * size;
    n as f64 * bandwidth / (weights + kv)
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| x.trim().parse().map_err(|_| anyhow::anyhow!("`{x}` in `{s}`")))
        .collect()
}

fn main() -> Result<()> {
    let mut device = DeviceSpec::Cpu;
    let mut shape = "tiny".to_owned();
    let mut train_shapes = vec![(1usize, 64usize)];
    let mut gen_sizes = vec![1usize, 4];
    let mut precision = None;
    let mut memory = vec![Memory { chunked: false, checkpoint: false, flash: false }];
    let (mut warmup, mut reps) = (2usize, 5usize);
    let mut json = None;
    let mut publishing = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--device" => device = value()?.parse().map_err(anyhow::Error::msg)?,
            "--shape" => shape = value()?,
            "--train" => {
                train_shapes = value()?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| {
                        let (r, l) =
                            s.split_once('x').with_context(|| format!("--train `{s}`: expected ROWSxLEN"))?;
                        Ok((r.parse()?, l.parse()?))
                    })
                    .collect::<Result<_>>()?
            }
            "--generate" => gen_sizes = list(&value()?)?,
            "--precision" => precision = Some(value()?.parse::<Precision>().map_err(anyhow::Error::msg)?),
            "--memory" => memory = value()?.split(',').map(Memory::parse).collect::<Result<_>>()?,
            "--warmup" => warmup = value()?.parse()?,
            "--reps" => reps = value()?.parse()?,
            "--json" => json = Some(value()?),
            "--publish" => publishing = true,
            other => bail!(
                "unknown argument `{other}` (--device, --shape, --train, --generate, --precision, --memory, \
                 --warmup, --reps, --publish, --json)"
            ),
        }
    }
    if reps == 0 || train_shapes.iter().any(|&(r, l)| r == 0 || l < 2) {
        bail!("--reps must be at least 1, and every --train shape at least 1 row of 2 tokens");
    }
    let cfg = shapes::shape(&shape)?;
    let dev = device.open()?;
    let masters = Model::new(cfg, &dev, 0)?;
    let precision = precision.unwrap_or_else(|| Precision::for_device(&dev));
    // In bf16 the f32 weights stay beside the compute copy, as the trainer keeps them.
    let model = match precision {
        Precision::F32 => masters.clone(),
        Precision::Bf16 => masters.compute_copy(precision.dtype())?,
    };
    let params = model.num_parameters();
    println!(
        "{shape} ({:.1} M parameters) on {device}, {precision}, kernels {:?}",
        params as f64 / 1e6,
        model.kernels()
    );
    let mut report = Report {
        shape: shape.clone(),
        parameters: params,
        device: device.to_string(),
        precision: precision.to_string(),
        warmup,
        reps,
        train: Vec::new(),
        generate: Vec::new(),
        generate_drawn: Vec::new(),
        generate_graphed: Vec::new(),
        generate_top_p: Vec::new(),
        generate_graph_stats: Vec::new(),
        copy_bandwidth_gbps: None,
        generate_roofline: Vec::new(),
        publish: None,
    };
    if publishing {
        // The engine's weights on a handle of their own, in the engine's precision.
        let engine = Model::new(masters.config().clone(), &device.open_stream()?, 1)?.frozen_copy()?;
        let engine =
            if precision == Precision::F32 { engine } else { engine.compute_copy(precision.dtype())? };
        let f = publish(&masters, &engine, reps)?;
        println!(
            "publish {:.0} MB of f32 weights to a {precision} engine: through the host {:.1} ms, device to device \
             {:.1} ms ({:.1}x), one raw device copy {:.1} ms",
            f.bytes as f64 / 1e6,
            f.through_host_ms,
            f.resident_ms,
            f.through_host_ms / f.resident_ms,
            f.raw_copy_ms
        );
        report.publish = Some(f);
    }
    for &(rows, len) in &train_shapes {
        for &m in &memory {
            let levered = m.apply(&model);
            let figure = match peak_device_memory(&levered, || train(&levered, rows, len, warmup, reps)) {
                Ok((secs, peak)) => {
                    let tps = (rows * len) as f64 / secs;
                    // 6 FLOPs per parameter and token for a forward and backward (attention not counted).
                    let tflops = 6.0 * params as f64 * tps / 1e12;
                    let peak_text = peak.map_or(String::new(), |b| {
                        format!(", peak device memory {:.1} GiB", b as f64 / (1u64 << 30) as f64)
                    });
                    println!(
                        "train {rows}x{len} {}: {tps:.0} tokens/s (step {:.1} ms, {tflops:.1} TFLOP/s by 6N{peak_text})",
                        m.name(),
                        secs * 1e3
                    );
                    TrainFigure {
                        rows,
                        len,
                        memory: m.name(),
                        tokens_per_s: Some(tps),
                        step_ms: Some(secs * 1e3),
                        tflops_6n: Some(tflops),
                        peak_device_bytes: peak,
                        error: None,
                    }
                }
                Err(e) => {
                    println!("train {rows}x{len} {}: failed: {e}", m.name());
                    TrainFigure {
                        rows,
                        len,
                        memory: m.name(),
                        tokens_per_s: None,
                        step_ms: None,
                        tflops_6n: None,
                        peak_device_bytes: None,
                        error: Some(e.to_string()),
                    }
                }
            };
            report.train.push(figure);
            // Written after every figure: a run cut short by a time limit keeps what it measured.
            if let Some(path) = &json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)
                    .with_context(|| format!("writing {path}"))?;
            }
        }
    }
    if !gen_sizes.is_empty() {
        // Generation in `--precision`, as the rollout engine decodes (`rollout.precision`).
        let frozen = masters.frozen_copy()?;
        let frozen =
            if precision == Precision::F32 { frozen } else { frozen.compute_copy(precision.dtype())? };
        let bandwidth = copy_bandwidth(&dev)?;
        println!("device copy bandwidth: {:.0} GB/s (read + write)", bandwidth / 1e9);
        report.copy_bandwidth_gbps = Some(bandwidth / 1e9);
        for &n in &gen_sizes {
            let roofline = decode_roofline(&frozen, n, bandwidth);
            println!(
                "generate {n} seqs: roofline {roofline:.0} tokens/s (weights and KV cache read once per step at that bandwidth)"
            );
            report.generate_roofline.push((n, roofline));
        }
        // One untimed run of each path first: the first launch of a kernel loads its
        // module, and cuBLAS sets up its handle and workspace.
        for how in [Decode::LogitsToHost, Decode::Drawn, Decode::Graphed, Decode::TopP] {
            generate(&frozen, gen_sizes[0].min(16), how)?;
        }
        for n in gen_sizes {
            let (tps, _) = generate(&frozen, n, Decode::LogitsToHost)?;
            println!(
                "generate {n} seqs: {tps:.0} tokens/s (prompt {PROMPT}, {NEW_TOKENS} new, {precision}, logits to the host)"
            );
            report.generate.push((n, tps));
            let (tps, _) = generate(&frozen, n, Decode::Drawn)?;
            println!(
                "generate {n} seqs: {tps:.0} tokens/s (prompt {PROMPT}, {NEW_TOKENS} new, {precision}, drawn where the logits are)"
            );
            report.generate_drawn.push((n, tps));
            let (tps, graphs) = generate(&frozen, n, Decode::Graphed)?;
            println!(
                "generate {n} seqs: {tps:.0} tokens/s (prompt {PROMPT}, {NEW_TOKENS} new, {precision}, drawn, CUDA graphs: {graphs:?})"
            );
            report.generate_graphed.push((n, tps));
            report.generate_graph_stats.push((n, format!("{graphs:?}")));
            let (tps, _) = generate(&frozen, n, Decode::TopP)?;
            println!(
                "generate {n} seqs: {tps:.0} tokens/s (prompt {PROMPT}, {NEW_TOKENS} new, {precision}, drawn from the top-p 0.9 nucleus)"
            );
            report.generate_top_p.push((n, tps));
            if let Some(path) = &json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)
                    .with_context(|| format!("writing {path}"))?;
            }
        }
    }
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}
