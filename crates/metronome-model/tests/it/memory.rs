//! The memory levers of a training step against the plain forward: the chunked
//! log-prob head (values within 1e-5, gradients within 1e-4 of the whole-logits head)
//! and gradient checkpointing of the decoder layers (values and gradients bitwise
//! equal), under both kernels, with an untied and a tied head (whose weight is the
//! embedding: both gradients meet in it), biases, and adapters.

use metronome_model::{Device, Kernels, LoraConfig, Model, Tensor};

use crate::common::{Forward, close, fixture, logprobs_and_gradients, logprobs_and_gradients_of};

/// The fixtures (Llama untied; Qwen2 with biases and a tied head) under `kernels`.
fn fixtures(kernels: Kernels) -> Vec<(&'static str, Model)> {
    ["tiny_llama", "tiny_qwen2"]
        .into_iter()
        .map(|name| {
            (name, Model::load_hf(&fixture(name), &Device::Cpu).unwrap().with_kernels(kernels).unwrap())
        })
        .collect()
}

/// Adapters on every projection with `B` moved off zero (so that `A` gets a gradient
/// and the adapters change the logits).
fn adapted(model: &Model) -> Model {
    let cfg = LoraConfig { rank: 4, alpha: 8.0, ..LoraConfig::default() };
    let m = model.with_lora(&cfg, 5).unwrap();
    for (name, var) in m.adapter_parameters() {
        if name.contains("lora_B") {
            let n = var.elem_count() as f32;
            let t = (Tensor::arange(0f32, n, var.device()).unwrap() * 0.37).unwrap().sin().unwrap();
            var.set(&(t.reshape(var.dims()).unwrap() * 0.05).unwrap()).unwrap();
        }
    }
    m
}

/// `a` within `value_tol` (log-probs, entropies) and `grad_tol` (gradients) of `b`,
/// each relative to the larger of 1 and the largest magnitude; prints the largest
/// differences found.
fn assert_close(what: &str, a: &Forward, b: &Forward, value_tol: f32, grad_tol: f32) {
    let values = close(&format!("{what}: log-probs"), &a.0, &b.0, value_tol).max(close(
        &format!("{what}: entropies"),
        &a.1,
        &b.1,
        value_tol,
    ));
    assert_eq!(a.2.len(), b.2.len());
    let grads =
        a.2.iter().zip(&b.2).map(|((name, x), (_, y))| close(&format!("{what}: {name}"), x, y, grad_tol));
    eprintln!("{what}: values within {values:e}, gradients within {:e}", grads.fold(0f32, f32::max));
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `a` and `b` bitwise equal: log-probs, entropies and every gradient.
fn assert_bitwise(what: &str, a: &Forward, b: &Forward) {
    assert_eq!(bits(&a.0), bits(&b.0), "{what}: log-probs");
    assert_eq!(bits(&a.1), bits(&b.1), "{what}: entropies");
    for ((name, x), (_, y)) in a.2.iter().zip(&b.2) {
        assert_eq!(bits(x), bits(y), "{what}: {name}");
    }
}

#[test]
fn the_chunked_head_matches_the_whole_logits_head() {
    for kernels in [Kernels::Fused, Kernels::Portable] {
        for (name, model) in fixtures(kernels) {
            let vocab = model.config().vocab_size;
            let whole = logprobs_and_gradients(&model);
            // Chunks of 3 rows forward and a few columns backward; then one chunk.
            for elements in [3 * vocab, 1 << 22] {
                let chunked = model.clone().with_chunked_head(Some(elements));
                assert_eq!(chunked.chunked_head(), Some(elements));
                let what = format!("{name}, {kernels:?}, chunk {elements}");
                assert_close(&what, &logprobs_and_gradients(&chunked), &whole, 1e-5, 1e-4);
            }
            // With adapters: the head's weight is frozen, the adapters train.
            let lora = adapted(&model);
            let whole = logprobs_and_gradients_of(&lora, lora.adapter_parameters());
            let chunked = lora.clone().with_chunked_head(Some(3 * vocab));
            let got = logprobs_and_gradients_of(&chunked, chunked.adapter_parameters());
            assert_close(&format!("{name}, {kernels:?}, LoRA"), &got, &whole, 1e-5, 1e-4);
        }
    }
}

#[test]
fn checkpointed_layers_give_bitwise_the_same_values_and_gradients() {
    for kernels in [Kernels::Fused, Kernels::Portable] {
        for (name, model) in fixtures(kernels) {
            let plain = logprobs_and_gradients(&model);
            let checkpointed = model.clone().with_gradient_checkpointing(true);
            assert!(checkpointed.gradient_checkpointing());
            assert_bitwise(&format!("{name}, {kernels:?}"), &logprobs_and_gradients(&checkpointed), &plain);
            // Both levers together: the chunked head's own numbers, unchanged by
            // checkpointing.
            let vocab = model.config().vocab_size;
            let chunked = model.clone().with_chunked_head(Some(3 * vocab));
            let both = chunked.clone().with_gradient_checkpointing(true);
            assert_bitwise(
                &format!("{name}, {kernels:?}, chunked head"),
                &logprobs_and_gradients(&both),
                &logprobs_and_gradients(&chunked),
            );
            // Adapters: only they record gradients, through the checkpointed layers.
            let lora = adapted(&model);
            let plain = logprobs_and_gradients_of(&lora, lora.adapter_parameters());
            let checkpointed = lora.clone().with_gradient_checkpointing(true);
            let got = logprobs_and_gradients_of(&checkpointed, checkpointed.adapter_parameters());
            assert_bitwise(&format!("{name}, {kernels:?}, LoRA"), &got, &plain);
        }
    }
}

#[test]
fn the_levers_change_nothing_without_a_graph() {
    // A frozen model (the reference, a rollout worker's) scores through them with no
    // graph and the values of the plain forward.
    let model = Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap().frozen_copy().unwrap();
    let levers = model.clone().with_chunked_head(Some(300)).with_gradient_checkpointing(true);
    let vocab = model.config().vocab_size;
    let (row, targets) = crate::common::shared_prompt_row(
        &crate::common::tokens(1, 6, vocab),
        &[crate::common::tokens(2, 4, vocab), crate::common::tokens(3, 3, vocab)],
    );
    let a = model.target_logprobs(std::slice::from_ref(&row), &targets).unwrap();
    let b = levers.target_logprobs(&[row], &targets).unwrap();
    assert!(!b.logprobs.track_op() && !b.entropy.track_op());
    let host = crate::common::host;
    close("log-probs", &host(&b.logprobs), &host(&a.logprobs), 1e-5);
    close("entropies", &host(&b.entropy), &host(&a.entropy), 1e-5);
}

#[test]
fn checkpointed_gradients_keep_no_recomputed_graph_alive() {
    // candle leaves a variable's gradient attached to the graph it was computed in; a
    // layer weight's gradient from a recomputed layer must not be, or every layer's
    // recomputed activations would live until the optimiser step (the peak memory
    // checkpointing exists to cut).
    let model =
        Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap().with_gradient_checkpointing(true);
    let vocab = model.config().vocab_size;
    let (row, targets) = crate::common::shared_prompt_row(
        &crate::common::tokens(1, 6, vocab),
        &[crate::common::tokens(2, 4, vocab), crate::common::tokens(3, 3, vocab)],
    );
    let out = model.target_logprobs(&[row], &targets).unwrap();
    let grads = out.logprobs.sum_all().unwrap().backward().unwrap();
    let mut layer_weights = 0;
    for (name, var) in model.parameters() {
        if name.contains(".layers.") {
            layer_weights += 1;
            let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{name} has no gradient"));
            assert!(!g.track_op(), "{name}'s gradient keeps the recomputed layer's graph");
        }
    }
    assert!(layer_weights > 0);
}
