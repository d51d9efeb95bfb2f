//! The network of Metronome: a trainable decoder-only transformer of the Llama/Qwen2
//! family on candle, its checkpoint formats, incremental decoding and tokenizers.
//!
//! - [`ModelConfig`] is read from (and written to) Hugging Face `config.json`;
//!   [`ModelConfig::tiny`] is the built-in CPU configuration for tests and tiny tasks.
//! - [`Model`] holds the weights as `candle_core::Var`s named as in Hugging Face.
//!   [`Model::target_logprobs`] is the trainer's forward: packed rows with explicit
//!   positions and the segment-tree attention of `metronome_core::PackedRow` (the
//!   shared-prompt layout), returning log-probs and entropies of the loss targets only.
//!   It is written from differentiable candle-core primitives, because candle-nn's
//!   fused softmax and RMSNorm have no backward.
//! - [`KvCache`], [`Model::prefill`] and [`Model::decode_step`] are the rollout engine's
//!   incremental decoding over independent slots; a decode step is batch-invariant
//!   (a slot's logits are bitwise the same in any batch).
//! - Checkpoints: Hugging Face safetensors in and out ([`Model::load_hf`],
//!   [`Model::save_hf`]), GGUF in ([`Model::load_gguf`], dequantised to f32), and
//!   host snapshots for publishing weights ([`Model::snapshot`],
//!   [`Model::from_snapshot`], [`Model::load_snapshot`]).
//! - Tokenizers implementing `metronome_core::Tokenizer`: [`CharTokenizer`],
//!   [`HfTokenizer`] (`tokenizer.json`) and [`GgufTokenizer`], with chat templates
//!   rendered by `minijinja`.
//!
//! It is not a sampler (the rollout engine in `metronome-rollout` owns sampling,
//! continuous batching and seeds), not a loss or optimiser (`metronome-trainer`), and
//! it does not build packed layouts (`metronome-masking` does). It depends on
//! `metronome-core` only among the workspace crates.
//!
//! Threads: candle's CPU kernels use the current rayon pool and a process-wide
//! barrier pool; run generation and training on their own pools (DESIGN.md §6).

mod config;
mod error;
mod gguf;
mod io;
mod kv_cache;
mod model;
mod ops;
mod tokenizer;

pub use candle_core::{Device, Tensor, Var};
pub use config::{Architecture, ModelConfig};
pub use error::{Error, Result};
pub use gguf::{hf_to_gguf_name, permute_for_gguf};
pub use kv_cache::{DECODE_MIN_ROWS, KvCache};
pub use model::{Model, TargetOutput};
pub use tokenizer::{CharTokenizer, ChatTemplate, GgufTokenizer, HfTokenizer};
