//! The network of Metronome: a trainable decoder-only transformer of the Llama/Qwen2
//! family on candle, its checkpoint formats, incremental decoding and tokenizers.
//!
//! - [`ModelConfig`] is read from (and written to) Hugging Face `config.json`;
//!   [`ModelConfig::tiny`] is the built-in CPU configuration for tests and tiny tasks.
//! - [`Model`] holds the weights as `candle_core::Var`s named as in Hugging Face.
//!   [`Model::target_logprobs`] is the trainer's forward: packed rows with explicit
//!   positions and the segment-tree attention of `metronome_core::PackedRow` (the
//!   shared-prompt layout), returning log-probs and entropies of the loss targets only;
//!   [`Model::prepare_batch`] and [`Model::score`] split it so that several models
//!   (a policy and its reference) share one layout of a micro-batch, and score at a
//!   sampling temperature (`logits / T`, the distribution the rollout engine samples).
//!   Its element-wise ops have a backward everywhere (candle-nn's fused softmax and
//!   RMSNorm have none: docs/design.md §6), and attention follows the segments of a
//!   row instead of building a `[T, T]` mask.
//! - [`KvCache`], [`Model::prefill`] and [`Model::decode_step`] are the rollout engine's
//!   incremental decoding over independent slots; a decode step is batch-invariant
//!   (a slot's logits are bitwise the same in any batch).
//! - Checkpoints: Hugging Face safetensors in and out ([`Model::load_hf`],
//!   [`Model::save_hf`]), GGUF in ([`Model::load_gguf`], dequantised to f32), and
//!   host snapshots for publishing weights ([`Model::snapshot`],
//!   [`Model::from_snapshot`], [`Model::load_snapshot`]).
//! - Low-rank adapters (LoRA; Hu et al. 2021, arXiv 2106.09685) on the attention and
//!   MLP projections of a model handle ([`Model::with_lora`], [`LoraConfig`]): only
//!   they record gradients, [`Model::base`] is the same weights without them, and
//!   snapshots, `save_hf` and frozen copies hold the merged `W + (alpha / r)·B·A`.
//!   [`Model::save_lora_adapter`] and [`Model::with_lora_adapter`] write and read
//!   PEFT's adapter format (`fixtures/check_lora.py` loads it with `peft`).
//! - Mixed precision and memory: [`Model::compute_copy`] makes the bf16 copy of the
//!   weights that a [`Precision::Bf16`] trainer computes with (the portable kernels
//!   keep norm statistics, softmaxes and the log-prob head's log-softmax in f32);
//!   [`Model::with_chunked_head`] computes the head ("linear cross-entropy", after
//!   Liger-Kernel) by chunks of rows forward and blocks of vocabulary columns
//!   backward, so no `[targets, vocab]` tensor exists; [`Model::with_gradient_checkpointing`]
//!   keeps each decoder layer's input only and recomputes the layer in the backward.
//!   Both attach graph-free values to autograd by one custom op whose forward is a
//!   storage copy (`recompute.rs`), so they run on every device, and tell no caller:
//!   one `loss.backward()` still gives every gradient. Tested on the CPU: the chunked
//!   head within 1e-5 (values) and 1e-4 (gradients) of the whole-logits head,
//!   checkpointed gradients bitwise equal, bf16 within measured tolerances of f32.
//!   [`reverse_kl`] (on-policy distillation's full signal) reads the rows a head
//!   scored ([`TargetOutput::head`]) and computes the exact reverse KL from a
//!   teacher's distributions by chunks of rows both ways, on the same terms.
//! - Tokenizers implementing `metronome_core::Tokenizer`: [`CharTokenizer`],
//!   [`HfTokenizer`] (`tokenizer.json`) and [`GgufTokenizer`], with chat templates
//!   rendered by `minijinja`.
//!
//! Numerics: logits match Hugging Face `transformers` within 1e-4 on the committed
//! tiny Llama and Qwen2 fixtures (`fixtures/make_fixtures.py` wrote them once; the tests
//! need no Python), and a checkpoint written by [`Model::save_hf`] loads in
//! `transformers` with equal logits (`fixtures/check_checkpoint.py`).
//!
//! Devices: everything above runs on any candle device. [`DeviceSpec`] names one in
//! configs (`"cpu"`, `"cuda:N"`; GPUs need the `cuda` feature) and opens it for a
//! [`Stage`]: one GPU handle shared by the trainer and the rollout engine, or one each
//! with a CUDA stream of its own under [`STAGE_STREAMS_ENV`]. On the CPU the
//! element-wise ops are fused custom ops with their own backward
//! ([`Kernels::Fused`]); elsewhere they are composed from candle-core primitives that
//! every backend implements forward and backward ([`Kernels::Portable`]), tested
//! against the fused ones on the CPU (log-probs and entropies within 1e-5, gradients
//! within 1e-4, relative to the larger of 1 and their largest magnitude), so CI
//! checks the GPU's arithmetic without a GPU. The model's kernels, never its device,
//! choose every fused op (a LoRA handle's frozen base product, a frozen copy's
//! decode layout and the chunked head's per-chunk math included), and a test counts
//! that [`Kernels::Portable`] runs none. The fused ops compute in f32: a bf16 model
//! runs the portable ones, on the CPU as on a GPU.
//!
//! Batch invariance: a decode step's logits for a slot are bitwise the same whoever
//! shares the step. Attention runs per slot over its own cache in a fixed order. A
//! model that never trains ([`Model::frozen_copy`]) runs its linear layers through a
//! decode-layout copy: under the fused kernels one whose kernel computes every output
//! in input order; under the portable and CUDA kernels stacked products (query, key and
//! value as one, gate and up as one) with fused ops between them, nine per layer, its
//! inputs padded to [`DECODE_MIN_ROWS`] rows. A trainable one pads linear-layer inputs
//! to those rows too, so that candle's matmul takes the same kernel for every batch size (a cache that serves one conversation
//! may opt out with [`KvCache::set_batch_invariant`]). `src/kv_cache.rs` says
//! how, and the README's benchmark section what it costs.
//!
//! - [`Model::decode_step_drawing`] and [`Model::prefill_many_drawing`] also draw the
//!   next tokens of the rows the engine asks for where the logits are ([`draw`]:
//!   temperature or greedy, no truncation; on a GPU by this crate's CUDA kernel under
//!   [`Kernels::Cuda`], so `[rows, vocab]` logits stay on the device).
//!
//! It is not a sampler (the rollout engine in `metronome-rollout` owns sampling
//! configs, truncation, penalties, continuous batching and seeds; [`draw`] is the
//! untruncated draw it shares with the model), not a loss or optimiser (`metronome-trainer`), and
//! it does not build packed layouts (`metronome-masking` does). It depends on
//! `metronome-core` only among the workspace crates.
//!
//! Threads: candle's CPU kernels use the current rayon pool and a process-wide
//! barrier pool; run generation and training on their own pools (docs/design.md §6).

mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod device;
pub mod draw;
mod error;
mod gguf;
mod head;
mod io;
#[cfg(test)]
mod kernel_seam;
mod kv_cache;
mod lora;
mod model;
mod ops;
mod portable;
mod precision;
mod recompute;
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "the CUDA graphs' policy, tested on the CPU"))]
mod replays;
mod simd;
mod tokenizer;

pub use candle_core::{DType, Device, Tensor, Var};
pub use config::{Architecture, ModelConfig};
pub use device::{DeviceSpec, STAGE_STREAMS_ENV, Stage};
pub use draw::{Draw, Drawn, Next, Penalty, Truncation};
pub use error::{Error, Result};
pub use gguf::{hf_to_gguf_name, permute_for_gguf};
pub use head::{HeadInput, reverse_kl};
pub use kv_cache::{CUDA_GRAPHS_ENV, DECODE_MIN_ROWS, DecodeGraphStats, KV_BLOCK, KvCache};
pub use lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, LoraConfig};
pub use model::{BATCHED_MASK_BYTES, Model, ScoringBatch, TargetOutput};
pub use ops::Projection;
pub use portable::{CUDA_KERNELS_ENV, Kernels};
pub use precision::Precision;
pub use simd::{SIMD_ENV, SimdLevel};
pub use tokenizer::{CharTokenizer, ChatTemplate, GgufTokenizer, HfTokenizer};
