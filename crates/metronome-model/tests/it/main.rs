//! Integration tests of metronome-model: numbers against Hugging Face `transformers`
//! (fixtures written once by `fixtures/make_fixtures.py`), gradients, KV-cache decoding
//! and batch invariance, packed shared-prompt rows, checkpoints and tokenizers.

mod backprop;
mod checkpoint;
mod common;
mod decode;
mod devices;
mod gguf;
mod kernels_on_cpu;
mod lora;
mod matmul;
mod memory;
mod precision;
mod reference;
mod shapes;
mod training;
