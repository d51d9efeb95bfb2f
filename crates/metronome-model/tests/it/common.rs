//! Shared helpers.

use std::path::PathBuf;

use metronome_core::{PackedRow, Targets};
use metronome_model::{Model, Tensor};
use metronome_testkit::BatchBuilder;

pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// Input ids `[2, 7]` and transformers' logits `[2, 7, vocab]` of a fixture.
pub(crate) fn expected(name: &str) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = serde_json::from_value(v["input_ids"].clone()).unwrap();
    let logits = serde_json::from_value(v["logits"].clone()).unwrap();
    (ids, logits)
}

pub(crate) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Logits `[seq, vocab]` of one ordinary causal row (as f32, whatever the model's type).
pub(crate) fn full_logits(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let t = Tensor::from_slice(tokens, (1, tokens.len()), model.device()).unwrap();
    let logits = model.forward_logits(&t).unwrap().squeeze(0).unwrap();
    logits.to_dtype(metronome_model::DType::F32).unwrap().to_vec2::<f32>().unwrap()
}

/// A deterministic token sequence in `3..vocab`.
pub(crate) fn tokens(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| 3 + (metronome_core::mix64(seed * 1000 + i) % (vocab as u64 - 3)) as u32)
        .collect()
}

/// One group in the shared-prompt layout: the prompt once, then every response with
/// positions restarting at the prompt length; targets are all response tokens.
pub(crate) fn shared_prompt_row(prompt: &[u32], responses: &[Vec<u32>]) -> (PackedRow, Targets) {
    let batch = BatchBuilder::new().shared_prompt(0, prompt, responses, &vec![0.0; responses.len()]).build();
    let row = batch.rows.into_iter().next().expect("one row per group");
    (row, batch.targets)
}

/// The same responses as separate causal rows `[prompt + response]`.
pub(crate) fn separate_rows(prompt: &[u32], responses: &[Vec<u32>]) -> (Vec<PackedRow>, Targets) {
    let batch = BatchBuilder::new().separate_rows(0, prompt, responses, &vec![0.0; responses.len()]).build();
    (batch.rows, batch.targets)
}

/// The mean target log-prob of `rows` before and after `steps` steps of plain SGD
/// (rate 0.05) on it through `parameters()`: what an optimiser does.
pub(crate) fn logprob_around_sgd(
    model: &Model,
    rows: &[PackedRow],
    targets: &Targets,
    steps: usize,
) -> (f32, f32) {
    let mean = || model.target_logprobs(rows, targets).unwrap().logprobs.mean_all().unwrap();
    let before = mean().to_scalar::<f32>().unwrap();
    for _ in 0..steps {
        let grads = mean().neg().unwrap().backward().unwrap();
        for (_, var) in model.parameters() {
            let g = grads.get(var.as_tensor()).unwrap();
            var.set(&(var.as_tensor() - (g * 0.05).unwrap()).unwrap()).unwrap();
        }
    }
    (before, mean().to_scalar::<f32>().unwrap())
}

/// The log-probs, entropies and every parameter's (name, gradient) of one
/// shared-prompt group, on the host in f32.
pub(crate) type Forward = (Vec<f32>, Vec<f32>, Vec<(String, Vec<f32>)>);

/// [`Forward`] under `model`, for its base parameters.
pub(crate) fn logprobs_and_gradients(model: &Model) -> Forward {
    logprobs_and_gradients_of(model, model.parameters())
}

/// [`Forward`] under `model`, for the variables `params` (its adapters, say): a loss of
/// weighted log-probs (weights of both signs, as advantages are) and an entropy term.
pub(crate) fn logprobs_and_gradients_of(
    model: &Model,
    params: Vec<(String, metronome_model::Var)>,
) -> Forward {
    let vocab = model.config().vocab_size;
    let (row, targets) = shared_prompt_row(
        &tokens(1, 7, vocab),
        &[tokens(2, 5, vocab), tokens(3, 2, vocab), tokens(4, 6, vocab)],
    );
    logprobs_and_gradients_on(model, params, &[row], &targets)
}

/// [`Forward`] under `model` for `params`, on packed rows and their targets.
pub(crate) fn logprobs_and_gradients_on(
    model: &Model,
    params: Vec<(String, metronome_model::Var)>,
    rows: &[PackedRow],
    targets: &Targets,
) -> Forward {
    let out = model.target_logprobs(rows, targets).unwrap();
    let weights: Vec<f32> = (0..targets.token.len()).map(|i| ((i % 5) as f32 - 2.0) * 0.3).collect();
    let w = Tensor::from_slice(&weights, weights.len(), model.device()).unwrap();
    let loss = ((&out.logprobs * &w).unwrap().sum_all().unwrap()
        + (out.entropy.sum_all().unwrap() * 0.1).unwrap())
    .unwrap();
    let grads = loss.backward().unwrap();
    let g = params
        .into_iter()
        .map(|(n, v)| {
            let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{n} has no gradient"));
            (n, host(g))
        })
        .collect();
    (host(&out.logprobs), host(&out.entropy), g)
}

/// A tensor's values on the host, in f32 whatever its type.
pub(crate) fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(metronome_model::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `a` and `b` agree within `tol` relative to the largest magnitude of `b` (and 1);
/// returns that relative difference.
pub(crate) fn close(what: &str, a: &[f32], b: &[f32], tol: f32) -> f32 {
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    let d = max_abs_diff(a, b);
    assert!(d <= tol * scale, "{what}: max diff {d} (scale {scale})");
    d / scale
}
