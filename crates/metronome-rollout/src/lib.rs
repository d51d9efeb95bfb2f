//! The rollout stage of Metronome: a generation engine that turns a period's prompts
//! into groups of sampled responses and streams each group out the moment its last
//! response finishes.
//!
//! # What it does
//! - **Continuous batching.** [`Engine`] runs `workers` OS threads, each with a KV
//!   cache of `max_num_seqs` slots and its own rayon pool. A finished sequence frees
//!   its slot and the next pending sequence (from one queue shared by all workers) is
//!   prefilled at once. Two static modes are baselines; both admit a new batch only
//!   when the current one's longest member ends, and give the same tokens as
//!   continuous batching:
//!   - [`Batching::StaticPadded`] is static batching as practised (Hugging Face
//!     `transformers` `generate`, the continuous-batching literature's baseline):
//!     finished rows keep their slots and stay in every decode forward, computed and
//!     discarded, until the batch ends;
//!   - [`Batching::Static`] is a stronger, row-skipping baseline: finished rows leave
//!     the forward, so a batch's tail costs only its live rows.
//! - **Give it a frozen model** (`Model::frozen_copy`, or `Model::from_snapshot` with
//!   `trainable == false`, as [`SnapshotLoader`] builds them): a frozen model decodes
//!   from its own decode-layout copy of the linear layers with a batch-invariant SIMD
//!   kernel that needs no padding rows, several times faster at few slots. What each
//!   mode costs is in the README's benchmark section (`benches/rollout.rs`).
//! - **Reproducible sampling** ([`sampling`]): temperature, top-k, top-p, min-p,
//!   repetition penalty, greedy at temperature 0, stop tokens and stop strings, all
//!   but the stop rules drawn by the decode step where the logits are
//!   (`metronome_model::draw`; on a GPU by CUDA kernels). A response's seed is `metronome_core::sample_seed(run, version, prompt,
//!   sample_index)` and its `k`-th token uses the `k`-th number of that seed's stream,
//!   so with a batch-invariant model (`metronome_model`'s decode is) the tokens do not
//!   depend on the worker, slot or batch that produced them.
//! - **Behaviour log-probs**: every completion records, per token,
//!   `log_softmax(penalised_logits / T)[token]`: after repetition penalty and
//!   temperature, *before* top-k/top-p/min-p truncation (at `T = 0`, the `T = 1`
//!   distribution). With default sampling this is exactly the policy's log-prob.
//! - **Multi-turn episodes** ([`Episodes`], [`Engine::with_episodes`],
//!   [`Engine::submit_episodes`]): every response talks to a
//!   [`metronome_core::Environment`]. At a turn's end (a stop token, a stop string or
//!   one of the environment's turn-ending strings) the slot waits while the
//!   environment's step runs on its own thread with a time limit and panic isolation;
//!   its observation is appended to the slot's KV cache by prefilling only the new
//!   tokens, and sampling continues. Only policy tokens draw random numbers, so
//!   trajectories are layout-independent too. Max turns, the token budget
//!   (`max_new_tokens` for the whole episode) and failing tools end an episode with a
//!   reason on its [`metronome_core::EpisodeTrace`] and
//!   `metronome_rollout_episode_failures_total{reason}`. A timed-out tool's thread
//!   cannot be killed: it is left to finish on its own, and past
//!   [`Episodes::max_running_calls`] running calls new ones are refused.
//! - **Versioned weights**: [`Engine::install_weights`](metronome_core::RolloutEngine::install_weights)
//!   swaps the model between sequences; sequences already running finish with the
//!   version they started with, and every completion carries its version.
//! - **OpenAI-compatible HTTP** (feature `http`, on by default): [`http::serve`]
//!   exposes `/v1/completions` and `/v1/models`; [`http::OpenAiEngine`] is a
//!   [`RolloutEngine`](metronome_core::RolloutEngine) that drives one or more such
//!   servers (vLLM, SGLang, or ours): the pipeline's `rollout.backend = "openai"`,
//!   configured by [`OpenAiClientConfig`] (`[rollout.openai]`). It balances requests
//!   over the endpoints by load with failover, timeouts, retries and a concurrency
//!   limit, and brings every endpoint to new weights through a
//!   [`http::WeightUpdateHook`] (ours, SGLang's, vLLM's; the `http` module docs say
//!   what each server offers).
//! - **Metrics** through the `metrics` facade, every one in [`METRICS`] (slots and
//!   tokens labelled by worker; rejected prompts are those
//!   [`RolloutEngine::generate`](metronome_core::RolloutEngine::generate) turned into
//!   rejected groups); [`Engine::worker_stats`] gives the same counters in process.
//!
//! # What it is not
//! It does not score, pack or train: groups go to a [`GroupSink`](metronome_core::GroupSink)
//! (in the pipeline, the reward stage). It has no paged attention or prefix sharing:
//! the `G` responses of a prompt each prefill the prompt. It runs the network through
//! the [`InferenceModel`] trait, implemented for `metronome_model::Model`.
//!
//! Siblings: `metronome-core` (the contract it implements), `metronome-model` (the
//! network, KV cache and tokenizers), `metronome-pipeline` (which builds it from an
//! [`EngineConfig`] and feeds it prompts from `metronome-dataloader`).

#[cfg(feature = "http")]
pub mod agent;
mod backend;
mod config;
mod engine;
mod error;
#[cfg(feature = "http")]
pub mod http;
mod metrics;
pub mod sampling;
mod stop;

pub use backend::{InferenceModel, SnapshotLoader, WeightLoader};
pub use config::{
    AgentConfig, AgentReward, AgentToolFormat, Backend, Batching, EngineConfig, MAX_AGENT_CONCURRENCY,
    MAX_NUM_SEQS, MAX_SEQ_LEN, MAX_THREADS, MAX_WORKERS, OpenAiClientConfig, PartialCache, TaskInput,
    WeightSync,
};
pub use engine::{CollectSink, Engine, Episodes, Rollback, Submission, WorkerStats};
pub use error::{Error, Result};
pub use metrics::METRICS;
pub use sampling::{
    LogprobsMode, MAX_PENALTY, MAX_TEMPERATURE, MIN_PENALTY, MIN_TEMPERATURE, Sampled, Sampler,
    SamplingConfig, TokenRng,
};
pub use stop::StopConditions;

/// The engine on Metronome's own candle model.
pub type ModelEngine = Engine<metronome_model::Model>;

/// Builds an engine on `model` (weights at `version`) sampling from the run seed
/// `seed`, whose [`install_weights`](metronome_core::RolloutEngine::install_weights)
/// rebuilds the model from snapshots with the same architecture and device. The
/// engine decodes in [`EngineConfig::precision_on`] the model's device: a bf16 engine
/// gets a bf16 copy of `model` and of every snapshot it installs.
pub fn model_engine(
    model: metronome_model::Model,
    version: metronome_core::PolicyVersion,
    tokenizer: std::sync::Arc<dyn metronome_core::Tokenizer>,
    config: EngineConfig,
    seed: metronome_core::RunSeed,
) -> Result<ModelEngine> {
    let dtype = config.precision_on(model.device()).dtype();
    let model =
        if model.dtype() == dtype { model } else { model.compute_copy(dtype).map_err(Error::model)? };
    let loader = SnapshotLoader { config: model.config().clone(), device: model.device().clone(), dtype };
    Ok(Engine::new(model, version, tokenizer, config)?.with_weight_loader(loader).with_seed(seed))
}

impl EngineConfig {
    /// Builds an engine on `model` from this configuration (see [`model_engine`]). The
    /// run seed is an argument, not a key of this table: a run has one seed, and it
    /// is the run's (`run.seed` in a pipeline config).
    pub fn build(
        &self,
        model: metronome_model::Model,
        version: metronome_core::PolicyVersion,
        tokenizer: std::sync::Arc<dyn metronome_core::Tokenizer>,
        seed: metronome_core::RunSeed,
    ) -> Result<ModelEngine> {
        model_engine(model, version, tokenizer, self.clone(), seed)
    }
}
