//! A byte-level tokenizer with an optional trivial chat template, and helpers.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use metronome_core::{ChatMessage, PromptBatch, RunSeed, TokenId, Tokenizer};
use metronome_dataloader::{
    BadRecordPolicy, Dataset, FieldMapping, FileSourceConfig, LoaderConfig, PromptConfig, PromptLoader,
    ReleaseConfig, SourceConfig,
};

/// One token per byte; `256` ends a response. With `template`, chat messages render
/// as `<role>content\n` and the generation prompt as `<assistant>`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ByteTokenizer {
    pub(crate) template: bool,
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> metronome_core::Result<Vec<TokenId>> {
        Ok(text.bytes().map(TokenId::from).collect())
    }

    fn decode(&self, tokens: &[TokenId]) -> metronome_core::Result<String> {
        let bytes: Vec<u8> = tokens.iter().filter_map(|&t| u8::try_from(t).ok()).collect();
        String::from_utf8(bytes).map_err(|e| metronome_core::Error::invalid("tokens", e.to_string()))
    }

    fn vocab_size(&self) -> usize {
        257
    }

    fn stop_token_ids(&self) -> Vec<TokenId> {
        vec![256]
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> metronome_core::Result<String> {
        if !self.template {
            return Err(metronome_core::Error::invalid("tokenizer", "has no chat template"));
        }
        let mut text: String = messages.iter().map(|m| format!("<{}>{}\n", m.role, m.content)).collect();
        if add_generation_prompt {
            text.push_str("<assistant>");
        }
        Ok(text)
    }
}

pub(crate) fn tokenizer() -> Arc<dyn Tokenizer> {
    Arc::new(ByteTokenizer { template: false })
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

pub(crate) fn release(batch_size: usize, epochs: Option<u64>) -> ReleaseConfig {
    ReleaseConfig { batch_size, epochs, ..ReleaseConfig::default() }
}

pub(crate) fn loader(dataset: Arc<dyn Dataset>, seed: u64, release: ReleaseConfig) -> PromptLoader {
    PromptLoader::new(dataset, tokenizer(), RunSeed(seed), release, PromptConfig::default()).unwrap()
}

/// A loader built from config: the file at `path` read as `format` with `fields`,
/// failing on a bad record, in batches of `batch_size` for `epochs` epochs.
pub(crate) fn file_loader(
    format: fn(FileSourceConfig) -> SourceConfig,
    path: PathBuf,
    fields: FieldMapping,
    batch_size: usize,
    epochs: u64,
    seed: u64,
) -> PromptLoader {
    let source = FileSourceConfig { path, fields, on_bad_record: BadRecordPolicy::Fail };
    let config = LoaderConfig {
        source: format(source),
        release: release(batch_size, Some(epochs)),
        ..LoaderConfig::default()
    };
    config.build(RunSeed(seed), tokenizer()).unwrap()
}

/// Every batch until the loader is exhausted (or `limit` batches).
pub(crate) async fn drain(loader: &mut PromptLoader, limit: usize) -> Vec<PromptBatch> {
    let mut batches = Vec::new();
    while batches.len() < limit {
        match loader.next().await.unwrap() {
            Some(batch) => batches.push(batch),
            None => break,
        }
    }
    batches
}

pub(crate) fn ids(batch: &PromptBatch) -> Vec<u64> {
    batch.prompts.iter().map(|p| p.id.0).collect()
}

/// Writes `text` to a fresh file named `name` in `dir`.
pub(crate) fn write_file(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::File::create(&path).unwrap().write_all(text.as_bytes()).unwrap();
    path
}

/// `len` records `prompt {i}`, with `long` of them padded to `long_len` bytes.
#[derive(Debug)]
pub(crate) struct Numbered {
    pub(crate) len: usize,
    pub(crate) long: Vec<usize>,
    pub(crate) long_len: usize,
}

impl Numbered {
    pub(crate) fn dataset(len: usize) -> Arc<dyn Dataset> {
        Arc::new(Self { len, long: Vec::new(), long_len: 0 })
    }
}

impl Dataset for Numbered {
    fn len(&self) -> usize {
        self.len
    }

    fn record(&self, index: usize) -> metronome_dataloader::Result<metronome_dataloader::Record> {
        let mut text = format!("prompt {index}");
        if self.long.contains(&index) {
            text = format!("{text:x<width$}", width = self.long_len);
        }
        Ok(metronome_dataloader::Record {
            id: metronome_core::PromptId(index as u64),
            content: metronome_dataloader::PromptContent::Text(text),
            reference: Some(index.to_string()),
            metadata: Default::default(),
        })
    }

    fn place(&self, index: usize) -> String {
        format!("numbered item {index}")
    }
}
