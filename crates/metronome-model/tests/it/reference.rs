//! Logits against Hugging Face `transformers` on the committed fixtures.

use metronome_model::{Architecture, Device, Model, Tensor};

use crate::common::{expected, fixture, max_abs_diff};

fn check(name: &str, arch: Architecture) {
    let model = Model::load_hf(&fixture(name), &Device::Cpu).unwrap();
    assert_eq!(model.config().architecture, arch);
    logits_equal_transformers(&model, name);
}

/// `model`, loaded from fixture `name` on any device with any kernels, gives the
/// logits `transformers` gave within 1e-4.
pub(crate) fn logits_equal_transformers(model: &Model, name: &str) {
    let (ids, want) = expected(name);
    let input = Tensor::new(ids, model.device()).unwrap();
    let got = model.forward_logits(&input).unwrap().to_vec3::<f32>().unwrap();
    let got: Vec<f32> = got.into_iter().flatten().flatten().collect();
    let want: Vec<f32> = want.into_iter().flatten().flatten().collect();
    let d = max_abs_diff(&got, &want);
    assert!(d < 1e-4, "{name}: max |logit - transformers| = {d}");
}

#[test]
fn llama_logits_equal_transformers() {
    check("tiny_llama", Architecture::Llama);
}

#[test]
fn qwen2_logits_equal_transformers() {
    let model = Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap();
    assert!(model.config().tie_word_embeddings);
    assert!(model.parameters().iter().any(|(n, _)| n == "model.layers.0.self_attn.q_proj.bias"));
    check("tiny_qwen2", Architecture::Qwen2);
}
