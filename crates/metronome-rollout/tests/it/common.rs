//! Shared fixtures: the tiny model, prompts, and engines in several layouts.

use std::sync::Arc;

use metronome_core::{
    Group, PolicyVersion, Prompt, PromptId, RolloutEngine, RolloutRequest, RunSeed, TokenId, Tokenizer,
};
use metronome_model::{CharTokenizer, Device, Draw, KvCache, Model, ModelConfig, Next};
use metronome_rollout::{
    CollectSink, EngineConfig, InferenceModel, ModelEngine, Result, SamplingConfig, model_engine,
};

/// The tiny model with random weights from `seed`, for inference.
pub(crate) fn tiny_model(seed: u64) -> Model {
    Model::new(ModelConfig::tiny(), &Device::Cpu, seed).expect("tiny model").with_trainable(false)
}

pub(crate) fn tokenizer() -> Arc<dyn Tokenizer> {
    Arc::new(CharTokenizer)
}

/// `n` short arithmetic prompts with ids `100 + i`.
pub(crate) fn prompts(n: usize) -> Vec<Prompt> {
    (0..n)
        .map(|i| {
            let text = format!("{} + {} = ", 3 * i + 1, 7 * i + 2);
            Prompt {
                id: PromptId(100 + i as u64),
                tokens: CharTokenizer.encode(&text).unwrap(),
                text,
                ..Prompt::default()
            }
        })
        .collect()
}

pub(crate) fn sampling(max_new_tokens: usize) -> SamplingConfig {
    SamplingConfig { max_new_tokens, ..SamplingConfig::default() }
}

pub(crate) fn engine(workers: usize, slots: usize, sampling: SamplingConfig) -> ModelEngine {
    let config = EngineConfig {
        workers,
        threads_per_worker: Some(1),
        max_num_seqs: slots,
        max_seq_len: 128,
        sampling,
        ..EngineConfig::default()
    };
    model_engine(tiny_model(7), PolicyVersion(0), tokenizer(), config, RunSeed(42)).expect("engine")
}

/// The groups `engine` generates for `request`, in arrival order.
pub(crate) async fn generate(engine: &dyn RolloutEngine, request: RolloutRequest) -> Vec<Group> {
    let sink = CollectSink::default();
    engine.generate(request, &sink).await.unwrap();
    sink.into_groups()
}

/// Groups sorted by prompt id, for comparisons that ignore completion order.
pub(crate) fn by_prompt(mut groups: Vec<Group>) -> Vec<Group> {
    groups.sort_by_key(|g| g.prompt.id);
    groups
}

/// One completion's identity and content: (prompt id, sample index, tokens, log-prob
/// bits, finish reason + version + text).
pub(crate) type Signature = (u64, u32, Vec<u32>, Vec<u32>, String);

/// Every group's (prompt, sample) tokens, log-probs (as bits), finish reasons and text.
pub(crate) fn signature(groups: &[Group]) -> Vec<Signature> {
    by_prompt(groups.to_vec())
        .iter()
        .flat_map(|g| {
            g.completions.iter().map(|c| {
                (
                    g.prompt.id.0,
                    c.sample_index,
                    c.tokens.clone(),
                    c.logprobs.iter().map(|x| x.to_bits()).collect(),
                    format!("{:?} {:?} {}", c.finish_reason, c.version, c.text),
                )
            })
        })
        .collect()
}

/// Reads every response as a call of the first offered tool whose `input` is the
/// whole text, and writes a call back as its input: so a random model "calls" a
/// tool on every turn, and a re-sent call renders as sampled. (For the chat and agent
/// tests, which need the `http` feature.)
#[cfg(feature = "http")]
pub(crate) struct EverythingCalls;

#[cfg(feature = "http")]
impl metronome_core::ToolCallSyntax for EverythingCalls {
    fn turn_stops(&self, _tools: &[&str]) -> Vec<String> {
        vec!["!".into()]
    }
    fn parse(&self, text: &str, tools: &[&str]) -> Option<(usize, metronome_core::ToolCallText)> {
        let name = tools.first()?;
        Some((
            0,
            metronome_core::ToolCallText {
                name: (*name).into(),
                arguments: serde_json::json!({ "input": text }).to_string(),
            },
        ))
    }
    fn render(&self, call: &metronome_core::ToolCallText) -> metronome_core::Result<String> {
        let args: serde_json::Value = serde_json::from_str(&call.arguments)
            .map_err(|e| metronome_core::Error::invalid("arguments", e.to_string()))?;
        Ok(args["input"].as_str().unwrap_or_default().to_owned())
    }
}

/// What a test watches of a [`Watched`] model's work (each on the engine's worker).
pub(crate) trait Watch: Send + Sync + 'static {
    /// Before a decode step of `rows` rows.
    fn before_decode(&self, rows: usize) {
        let _ = rows;
    }
    /// After a decode step.
    fn after_decode(&self) {}
    /// When a slot is freed.
    fn freed(&self) {}
}

/// A model with every call forwarded to it and a [`Watch`] on its decode steps and
/// freed slots: a test's instrumented engine model.
#[derive(Clone)]
pub(crate) struct Watched<W> {
    pub(crate) model: Model,
    pub(crate) watch: W,
}

impl<W: Watch> InferenceModel for Watched<W> {
    type Cache = KvCache;

    fn new_cache(&self, num_slots: usize, max_seq_len: usize) -> Result<KvCache> {
        InferenceModel::new_cache(&self.model, num_slots, max_seq_len)
    }

    fn new_pooled_cache(
        &self,
        num_slots: usize,
        max_seq_len: usize,
        tokens: usize,
    ) -> Result<(KvCache, usize)> {
        InferenceModel::new_pooled_cache(&self.model, num_slots, max_seq_len, tokens)
    }

    fn check_caches(
        &self,
        caches: usize,
        num_slots: usize,
        max_seq_len: usize,
        pool: Option<usize>,
    ) -> Result<()> {
        InferenceModel::check_caches(&self.model, caches, num_slots, max_seq_len, pool)
    }

    fn prefill(&self, cache: &mut KvCache, slot: usize, tokens: &[TokenId]) -> Result<Vec<f32>> {
        InferenceModel::prefill(&self.model, cache, slot, tokens)
    }

    fn prefill_many(
        &self,
        cache: &mut KvCache,
        seqs: &[(usize, &[TokenId])],
        draws: &[Option<Draw<'_>>],
    ) -> Result<Vec<Next>> {
        InferenceModel::prefill_many(&self.model, cache, seqs, draws)
    }

    fn decode_step(
        &self,
        cache: &mut KvCache,
        batch: &[(usize, TokenId)],
        draws: &[Option<Draw<'_>>],
    ) -> Result<Vec<Next>> {
        self.watch.before_decode(batch.len());
        let rows = InferenceModel::decode_step(&self.model, cache, batch, draws)?;
        self.watch.after_decode();
        Ok(rows)
    }

    fn free(&self, cache: &mut KvCache, slot: usize) {
        self.watch.freed();
        InferenceModel::free(&self.model, cache, slot);
    }

    fn max_context(&self) -> usize {
        InferenceModel::max_context(&self.model)
    }
}
