//! The serde configuration that builds an engine (the pipeline's `[rollout]` table).

use serde::{Deserialize, Serialize};

use crate::{Error, Result, SamplingConfig};

/// How free slots are refilled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Batching {
    /// A finished sequence's slot takes the next pending sequence at once.
    #[default]
    Continuous,
    /// Row-skipping static batching: a batch of up to `max_num_seqs` sequences runs
    /// until its longest member ends and only then is the next batch admitted, but a
    /// finished sequence leaves the decode forward at once (its slot stays empty). A
    /// stronger baseline than the usual static batching, since the tail of a batch
    /// costs only its live rows.
    Static,
    /// Padded static batching, the standard baseline (Hugging Face `transformers`
    /// `generate`, and the static batching the continuous-batching literature compares
    /// with): as [`Batching::Static`], and moreover a finished sequence keeps its slot
    /// *and its row in every decode forward* until the batch's longest member ends. Its
    /// outputs are discarded, so tokens, log-probs and finish reasons are those of the
    /// other modes (the decode is batch-invariant); only the compute differs. A
    /// finished row whose KV-cache slot is full (`max_seq_len`) drops out of the
    /// forward. Prompts are still prefilled without padding.
    StaticPadded,
}

/// Engine layout and sampling. Every field has a default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Engine workers, each an OS thread with its own KV cache and thread pool.
    pub workers: usize,
    /// Threads of each worker's rayon pool (the matmuls of its decode steps run there).
    pub threads_per_worker: usize,
    /// KV-cache slots per worker: the most sequences one worker decodes at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + response) a slot holds; capped by the model's context.
    pub max_seq_len: usize,
    /// Continuous (default), row-skipping static, or padded static batching.
    pub batching: Batching,
    /// Sampling used by [`metronome_core::RolloutEngine::generate`].
    pub sampling: SamplingConfig,
    /// The device the engine decodes on; absent, the model's (`model.device` in a run
    /// config). Read by whoever builds the engine's model (the pipeline).
    pub device: Option<metronome_model::DeviceSpec>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            workers: 1,
            threads_per_worker: 1,
            max_num_seqs: 16,
            max_seq_len: 1024,
            batching: Batching::Continuous,
            sampling: SamplingConfig::default(),
            device: None,
        }
    }
}

impl EngineConfig {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<()> {
        if self.workers == 0 {
            return Err(Error::config("workers", "is 0 (expected >= 1)"));
        }
        if self.threads_per_worker == 0 {
            return Err(Error::config("threads_per_worker", "is 0 (expected >= 1)"));
        }
        if self.max_num_seqs == 0 {
            return Err(Error::config("max_num_seqs", "is 0 (expected >= 1)"));
        }
        if self.max_seq_len < 2 {
            return Err(Error::config("max_seq_len", format!("is {} (expected >= 2)", self.max_seq_len)));
        }
        self.sampling.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_from_the_pipeline_toml() {
        let text = r#"
            workers = 2
            threads_per_worker = 1
            max_num_seqs = 8
            batching = "static"

            [sampling]
            temperature = 0.7
            top_p = 0.95
            max_new_tokens = 64
            stop_strings = ["</answer>"]
        "#;
        let cfg: EngineConfig = toml::from_str(text).unwrap();
        assert_eq!(cfg.workers, 2);
        assert_eq!(cfg.batching, Batching::Static);
        assert_eq!(cfg.sampling.max_new_tokens, 64);
        assert_eq!(cfg.sampling.top_k, 0, "unset fields take defaults");
        cfg.validate().unwrap();
        let padded: EngineConfig = toml::from_str(r#"batching = "static_padded""#).unwrap();
        assert_eq!(padded.batching, Batching::StaticPadded);
        let err = toml::from_str::<EngineConfig>("max_num_seq = 3").unwrap_err().to_string();
        assert!(err.contains("max_num_seq"), "{err}");
        let zero = EngineConfig { max_num_seqs: 0, ..EngineConfig::default() };
        assert_eq!(
            zero.validate().unwrap_err().to_string(),
            "config field `max_num_seqs` is 0 (expected >= 1)"
        );
    }
}
