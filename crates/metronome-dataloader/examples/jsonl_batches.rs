//! Load prompts from a JSONL file and release them in batches, one per period.
//!
//! ```text
//! cargo run -p metronome-dataloader --example jsonl_batches [-- path/to/file.jsonl]
//! ```
//! Without an argument it reads `examples/data/arithmetic.jsonl` beside this file:
//! seven arithmetic questions with fields `question`, `answer` and `level`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use metronome_core::{PromptSource, RunSeed, TokenId, Tokenizer};
use metronome_dataloader::{FieldMapping, FileSourceConfig, LoaderConfig, ReleaseConfig, SourceConfig};

/// The loader tokenises every prompt through the core `Tokenizer` trait. Real runs
/// pass a model's tokenizer (`metronome-model`); one byte per token is enough here.
struct Bytes;

impl Tokenizer for Bytes {
    fn encode(&self, text: &str) -> metronome_core::Result<Vec<TokenId>> {
        Ok(text.bytes().map(TokenId::from).collect())
    }
    fn decode(&self, tokens: &[TokenId]) -> metronome_core::Result<String> {
        Ok(tokens.iter().map(|&t| char::from(t as u8)).collect())
    }
    fn vocab_size(&self) -> usize {
        256
    }
    fn stop_token_ids(&self) -> Vec<TokenId> {
        Vec::new()
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let path = std::env::args().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/data/arithmetic.jsonl"),
        PathBuf::from,
    );

    // The same structure a run's `[data]` TOML section deserialises into.
    let config = LoaderConfig {
        source: SourceConfig::Jsonl(FileSourceConfig {
            path,
            // Which JSON fields are the prompt, the reference answer and metadata.
            fields: FieldMapping {
                prompt: "question".into(),
                reference: Some("answer".into()),
                metadata: BTreeMap::from([("level".into(), "level".into())]),
            },
            on_bad_record: Default::default(),
        }),
        // Three prompts per period, two passes over the file, shuffled per epoch from
        // the run seed; a batch may run across an epoch boundary, and ends early rather
        // than hold a prompt twice.
        release: ReleaseConfig { batch_size: 3, epochs: Some(2), ..ReleaseConfig::default() },
        // Plain text, no chat template (a model tokenizer would provide one).
        prompt: Default::default(),
    };
    let mut loader = config.build(RunSeed(7), Arc::new(Bytes))?;
    if let Some(report) = loader.load_report() {
        println!("loaded {} records ({} skipped)", report.kept, report.skipped);
    }

    // `PromptSource` is the trait the pipeline drives: one batch per period, `None`
    // once the configured epochs are served.
    while let Some(batch) = loader.next_batch().await? {
        println!("period {}: {} prompts", batch.period, batch.prompts.len());
        for p in &batch.prompts {
            println!(
                "  #{:<2} {:<20} reference {:<4} level {} ({} tokens)",
                p.id.0,
                p.text,
                p.reference.as_deref().unwrap_or("-"),
                p.metadata.get("level").map_or("-", String::as_str),
                p.tokens.len()
            );
        }
    }
    // The cursor is what a checkpoint saves; restoring it replays the same batches.
    let cursor = loader.cursor();
    println!("done: cursor at period {}, epoch {}, offset {}", cursor.period, cursor.epoch, cursor.offset);
    Ok(())
}
