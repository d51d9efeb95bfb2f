//! Generate groups of sampled responses with the rollout engine from a checkpoint.
//!
//! ```text
//! cargo run -p metronome-rollout --example generate_groups [-- HF_DIR]
//! ```
//! `HF_DIR` is a Hugging Face directory (config.json, model.safetensors) whose
//! vocabulary fits `metronome_model::CharTokenizer`. Without it, the example saves a
//! randomly initialised tiny model to a temporary directory first and loads that: its
//! responses are noise, but the engine's mechanics are the same.

use std::path::PathBuf;
use std::sync::Arc;

use metronome_core::{PeriodId, PolicyVersion, Prompt, PromptId, RolloutEngine, RolloutRequest, Tokenizer};
use metronome_model::{CharTokenizer, Device, Model, ModelConfig};
use metronome_rollout::{CollectSink, EngineConfig, SamplingConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = match std::env::args().nth(1) {
        Some(d) => PathBuf::from(d),
        None => {
            let dir = tmp.path().join("tiny");
            Model::new(ModelConfig::tiny(), &Device::Cpu, 1)?.save_hf(&dir)?;
            dir
        }
    };
    // Inference only: no gradients are tracked.
    let model = Model::load_hf(&dir, &Device::Cpu)?.with_trainable(false);
    let tokenizer: Arc<dyn Tokenizer> = Arc::new(CharTokenizer);
    println!("loaded {} ({} parameters)", dir.display(), model.num_parameters());

    // Continuous batching over 8 KV-cache slots on one worker thread; sampling at
    // temperature 1 with up to 12 new tokens. The run seed fixes every token.
    let config = EngineConfig {
        max_num_seqs: 8,
        max_seq_len: 64,
        sampling: SamplingConfig { temperature: 1.0, max_new_tokens: 12, ..SamplingConfig::default() },
        ..EngineConfig::default()
    };
    let engine = config.build(model, PolicyVersion(0), tokenizer.clone(), metronome_core::RunSeed(42))?;

    // Prompts arrive tokenised (the data loader does this in a run).
    let prompts: Vec<Prompt> = ["12+7=", "3*4="]
        .iter()
        .enumerate()
        .map(|(i, text)| -> anyhow::Result<Prompt> {
            Ok(Prompt {
                id: PromptId(i as u64),
                text: (*text).into(),
                tokens: tokenizer.encode(text)?,
                ..Prompt::default()
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let request = RolloutRequest { period: PeriodId(0), prompts, group_size: 3 };

    // Groups stream to the sink as soon as their last response finishes; in a
    // pipeline the sink is the reward stage. `CollectSink` just keeps them.
    let sink = CollectSink::default();
    engine.generate(request.clone(), &sink).await?;
    let groups = sink.into_groups();
    for g in &groups {
        println!("prompt {:?} (id {}):", g.prompt.text, g.prompt.id);
        for c in &g.completions {
            let logprob: f32 = c.logprobs.iter().sum();
            println!(
                "  sample {} v{} {:?} {:?}, {} tokens, log-prob {logprob:.2}",
                c.sample_index,
                c.version,
                c.finish_reason,
                c.text,
                c.tokens.len()
            );
        }
    }

    // Sampling is seeded by (run seed, policy version, prompt, sample index): the same
    // request gives the same tokens, whatever slot or worker served it.
    let again = CollectSink::default();
    engine.generate(request, &again).await?;
    let mut again = again.into_groups();
    let mut first = groups;
    first.sort_by_key(|g| g.prompt.id);
    again.sort_by_key(|g| g.prompt.id);
    let same = first
        .iter()
        .zip(&again)
        .all(|(a, b)| a.completions.iter().zip(&b.completions).all(|(x, y)| x.tokens == y.tokens));
    println!("regenerated {} groups: identical tokens: {same}", again.len());
    anyhow::ensure!(same, "seeded sampling should reproduce the same tokens");
    Ok(())
}
