//! Training and generation tokens/s of a model shape on a device: the Rust side of the
//! GPU comparison with PyTorch (`benches/torch_gpu.py` measures the same shapes).
//!
//! ```sh
//! cargo run --release -p metronome-model --example throughput                 # tiny, CPU (a smoke run)
//! metronome-model/examples/throughput --device cuda:0 --shape smollm2-135m \
//!     --train 8x512,32x512 --generate 1,16,64,256                            # on a GPU (`cargo xtask gpu bundle`)
//! ```
//!
//! Weights are random (the shape decides the cost, not the values). Training: forward
//! and backward of the summed next-token log-probs over `ROWS` plain causal rows of
//! `LEN` tokens, as `Model::target_logprobs` computes them for the trainer, median of
//! five steps after two warm-ups. Generation: `N` sequences prefilled with a 32-token
//! prompt, then greedy decode steps up to 128 new tokens each (`Model::decode_step`,
//! logits to the host each step as the rollout engine reads them), timed from the
//! prefill to the last token, as Hugging Face `generate` is timed.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use metronome_core::{PackedRow, Segment, Targets};
use metronome_model::{DeviceSpec, KvCache, Model, ModelConfig};

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

/// Median seconds of one training step on `rows` rows of `len` tokens.
fn train(model: &Model, rows: usize, len: usize) -> Result<f64> {
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
    for i in 0..7 {
        synchronize(model)?;
        let start = Instant::now();
        let out = model.target_logprobs(&packed, &targets)?;
        let grads = out.logprobs.sum_all()?.neg()?.backward()?;
        drop(grads);
        synchronize(model)?;
        if i >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// Tokens/s of `n` sequences decoding greedily.
fn generate(model: &Model, n: usize) -> Result<f64> {
    let vocab = model.config().vocab_size;
    let mut cache = KvCache::new(model, n, PROMPT + NEW_TOKENS + 1)?;
    let prompts: Vec<Vec<u32>> = (0..n).map(|s| tokens(1000 + s as u64, PROMPT, vocab)).collect();
    let seqs: Vec<(usize, &[u32])> = prompts.iter().enumerate().map(|(s, p)| (s, p.as_slice())).collect();
    synchronize(model)?;
    let start = Instant::now();
    let logits = model.prefill_many(&mut cache, &seqs)?;
    let argmax =
        |l: &[f32]| l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32);
    let mut next: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
    for _ in 1..NEW_TOKENS {
        let batch: Vec<(usize, u32)> = next.iter().enumerate().map(|(s, &t)| (s, t)).collect();
        next = model.decode_step(&mut cache, &batch)?.iter().map(|l| argmax(l)).collect();
    }
    synchronize(model)?;
    Ok((n * NEW_TOKENS) as f64 / start.elapsed().as_secs_f64())
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>> {
    s.split(',').map(|x| x.trim().parse().map_err(|_| anyhow::anyhow!("`{x}` in `{s}`"))).collect()
}

fn main() -> Result<()> {
    let mut device = DeviceSpec::Cpu;
    let mut shape = "tiny".to_owned();
    let mut train_shapes = vec![(1usize, 64usize)];
    let mut gen_sizes = vec![1usize, 4];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--device" => device = value()?.parse().map_err(anyhow::Error::msg)?,
            "--shape" => shape = value()?,
            "--train" => {
                train_shapes = value()?
                    .split(',')
                    .map(|s| {
                        let (r, l) =
                            s.split_once('x').with_context(|| format!("--train `{s}`: expected ROWSxLEN"))?;
                        Ok((r.parse()?, l.parse()?))
                    })
                    .collect::<Result<_>>()?
            }
            "--generate" => gen_sizes = list(&value()?)?,
            other => {
                bail!("unknown argument `{other}` (--device, --shape tiny|smollm2-135m, --train, --generate)")
            }
        }
    }
    let cfg = match shape.as_str() {
        "tiny" => ModelConfig::tiny(),
        "smollm2-135m" => ModelConfig::smollm2_135m(),
        other => bail!("unknown shape `{other}` (tiny, smollm2-135m)"),
    };
    let dev = device.open()?;
    let model = Model::new(cfg, &dev, 0)?;
    let params = model.num_parameters() as f64;
    println!("{shape} ({:.1} M parameters) on {device}, f32, kernels {:?}", params / 1e6, model.kernels());
    for (rows, len) in train_shapes {
        let secs = train(&model, rows, len)?;
        let tps = (rows * len) as f64 / secs;
        // 6 FLOPs per parameter and token for a forward and backward (attention not counted).
        println!(
            "train {rows}x{len}: {tps:.0} tokens/s (step {:.1} ms, {:.1} TFLOP/s by 6N)",
            secs * 1e3,
            6.0 * params * tps / 1e12
        );
    }
    let frozen = model.frozen_copy()?;
    for n in gen_sizes {
        println!(
            "generate {n} seqs: {:.0} tokens/s (prompt {PROMPT}, {NEW_TOKENS} new)",
            generate(&frozen, n)?
        );
    }
    Ok(())
}
