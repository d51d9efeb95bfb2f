//! The model's assertions on the portable kernels and on a CUDA GPU.
//!
//! On the CPU, [`Kernels::Portable`] runs the arithmetic a GPU runs (composed candle
//! ops instead of the fused CPU ones), so these tests check the GPU path's numbers in
//! CI. The `cuda_*` tests run the same assertions on GPU 0 when the crate is built
//! with the `cuda` feature and a GPU is present; otherwise they print why they were
//! skipped and pass (`cargo xtask gpu` runs them on a GPU machine).

use metronome_core::Targets;
use metronome_model::{Device, DeviceSpec, Kernels, Model, ModelConfig};

use crate::common::{
    fixture, full_logits, logprob_around_sgd, max_abs_diff, separate_rows, shared_prompt_row, tokens,
};
use crate::decode::decode_matches_full_forward;
use crate::reference::logits_equal_transformers;
use crate::training::{every_parameter_gets_a_gradient, shared_prompt_equals_separate_rows};

fn portable(model: Model) -> Model {
    model.with_kernels(Kernels::Portable).unwrap()
}

fn cpu_fixture(name: &str) -> Model {
    Model::load_hf(&fixture(name), &Device::Cpu).unwrap()
}

/// GPU 0, or `None` with the reason printed (not silently).
fn cuda() -> Option<Device> {
    if !cfg!(feature = "cuda") {
        eprintln!("skipped: built without the `cuda` feature (`cargo xtask gpu` runs this on a GPU)");
        return None;
    }
    match DeviceSpec::Cuda(0).open() {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no CUDA device: {e}");
            None
        }
    }
}

#[test]
fn cuda_fused_kernels_are_refused_off_the_cpu() {
    let Some(gpu) = cuda() else { return };
    let model = Model::new(ModelConfig::tiny(), &gpu, 1).unwrap();
    assert_eq!(model.kernels(), Kernels::Portable);
    let e = model.with_kernels(Kernels::Fused).unwrap_err().to_string();
    assert!(e.contains("CPU only"), "{e}");
}

#[test]
fn portable_kernels_match_transformers_fixtures() {
    for name in ["tiny_llama", "tiny_qwen2"] {
        logits_equal_transformers(&portable(cpu_fixture(name)), name);
    }
}

#[test]
fn portable_kernels_give_every_parameter_a_gradient() {
    every_parameter_gets_a_gradient(&portable(Model::new(ModelConfig::tiny(), &Device::Cpu, 11).unwrap()));
    every_parameter_gets_a_gradient(&portable(cpu_fixture("tiny_qwen2")));
}

#[test]
fn portable_kernels_pack_shared_prompts_like_separate_rows() {
    shared_prompt_equals_separate_rows(&portable(cpu_fixture("tiny_llama")));
}

#[test]
fn portable_decode_equals_full_forward() {
    decode_matches_full_forward(&portable(Model::new(ModelConfig::tiny(), &Device::Cpu, 7).unwrap()), 1e-5);
    decode_matches_full_forward(&portable(cpu_fixture("tiny_qwen2")), 1e-5);
    // A frozen copy keeps the portable kernels (no CPU decode layout).
    let frozen = portable(cpu_fixture("tiny_llama")).frozen_copy().unwrap();
    assert_eq!(frozen.kernels(), Kernels::Portable);
    decode_matches_full_forward(&frozen, 1e-5);
}

/// The log-probs, entropies and every parameter's (name, gradient) of one
/// shared-prompt group, on the host.
type Forward = (Vec<f32>, Vec<f32>, Vec<(String, Vec<f32>)>);

/// [`Forward`] under `model`.
fn logprobs_and_gradients(model: &Model) -> Forward {
    let vocab = model.config().vocab_size;
    let (row, targets) = shared_prompt_row(
        &tokens(1, 7, vocab),
        &[tokens(2, 5, vocab), tokens(3, 2, vocab), tokens(4, 6, vocab)],
    );
    let out = model.target_logprobs(&[row], &targets).unwrap();
    let weights: Vec<f32> = (0..targets.token.len()).map(|i| ((i % 5) as f32 - 2.0) * 0.3).collect();
    let w = metronome_model::Tensor::from_slice(&weights, weights.len(), model.device()).unwrap();
    let loss = ((&out.logprobs * &w).unwrap().sum_all().unwrap()
        + (out.entropy.sum_all().unwrap() * 0.1).unwrap())
    .unwrap();
    let grads = loss.backward().unwrap();
    let host = |t: &metronome_model::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let g =
        model.parameters().into_iter().map(|(n, v)| (n, host(grads.get(v.as_tensor()).unwrap()))).collect();
    (host(&out.logprobs), host(&out.entropy), g)
}

/// `a` and `b` agree within `tol` relative to the largest magnitude of `b` (and 1).
fn close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    let d = max_abs_diff(a, b);
    assert!(d <= tol * scale, "{what}: max diff {d} (scale {scale})");
}

/// The training forward and backward of `other` equal the fused CPU kernels' on the
/// same weights: log-probs and entropies within 1e-5, gradients within 1e-4 of their
/// largest magnitude.
fn training_matches_fused_cpu(other: &Model, reference: &Model) {
    let (lp, h, g) = logprobs_and_gradients(other);
    let (lp0, h0, g0) = logprobs_and_gradients(reference);
    close("log-probs", &lp, &lp0, 1e-5);
    close("entropies", &h, &h0, 1e-5);
    for ((name, a), (_, b)) in g.iter().zip(&g0) {
        close(name, a, b, 1e-4);
    }
}

#[test]
fn portable_training_matches_fused_values_and_gradients() {
    for name in ["tiny_llama", "tiny_qwen2"] {
        training_matches_fused_cpu(&portable(cpu_fixture(name)), &cpu_fixture(name));
    }
}

#[test]
fn cuda_logits_equal_transformers() {
    let Some(gpu) = cuda() else { return };
    for name in ["tiny_llama", "tiny_qwen2"] {
        logits_equal_transformers(&Model::load_hf(&fixture(name), &gpu).unwrap(), name);
    }
}

#[test]
fn cuda_training_matches_cpu_values_and_gradients() {
    let Some(gpu) = cuda() else { return };
    for name in ["tiny_llama", "tiny_qwen2"] {
        training_matches_fused_cpu(&Model::load_hf(&fixture(name), &gpu).unwrap(), &cpu_fixture(name));
    }
}

#[test]
fn cuda_every_parameter_gets_a_finite_nonzero_gradient() {
    let Some(gpu) = cuda() else { return };
    every_parameter_gets_a_gradient(&Model::new(ModelConfig::tiny(), &gpu, 11).unwrap());
    every_parameter_gets_a_gradient(&Model::load_hf(&fixture("tiny_qwen2"), &gpu).unwrap());
}

#[test]
fn cuda_shared_prompt_equals_separate_rows() {
    let Some(gpu) = cuda() else { return };
    shared_prompt_equals_separate_rows(&Model::load_hf(&fixture("tiny_llama"), &gpu).unwrap());
}

#[test]
fn cuda_decode_equals_full_forward() {
    let Some(gpu) = cuda() else { return };
    decode_matches_full_forward(&Model::new(ModelConfig::tiny(), &gpu, 7).unwrap(), 1e-5);
    decode_matches_full_forward(
        &Model::load_hf(&fixture("tiny_qwen2"), &gpu).unwrap().frozen_copy().unwrap(),
        1e-5,
    );
}

#[test]
fn cuda_decode_is_reproducible_and_near_batch_invariant() {
    let Some(gpu) = cuda() else { return };
    let model = Model::load_hf(&fixture("tiny_llama"), &gpu).unwrap().frozen_copy().unwrap();
    let vocab = model.config().vocab_size;
    let run = |batch: &[usize]| {
        let mut cache = metronome_model::KvCache::new(&model, 16, 32).unwrap();
        for &s in batch {
            model.prefill(&mut cache, s, &tokens(s as u64, 2 + s % 5, vocab)).unwrap();
        }
        let step: Vec<(usize, u32)> =
            batch.iter().map(|&s| (s, tokens(50 + s as u64, 1, vocab)[0])).collect();
        let out = model.decode_step(&mut cache, &step).unwrap();
        out[batch.iter().position(|&s| s == 3).unwrap()].clone()
    };
    let alone = run(&[3]);
    // The same batch twice: bitwise the same (no atomics, no nondeterministic algorithm).
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&run(&[0, 3, 9, 12])), bits(&run(&[0, 3, 9, 12])));
    // Other batches: within 1e-5 (cuBLAS may pick another algorithm for another M).
    let d = max_abs_diff(&alone, &run(&[0, 3, 9, 12, 1, 2, 4, 5, 6, 7, 8, 10, 11, 13, 14, 15]));
    eprintln!("slot 3 alone vs in a batch of 16: max |diff| = {d:e}");
    assert!(d < 1e-5, "{d}");
}

#[test]
fn cuda_checkpoints_round_trip_bit_exact() {
    let Some(gpu) = cuda() else { return };
    let model = Model::load_hf(&fixture("tiny_qwen2"), &gpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_hf(dir.path()).unwrap();
    let again = Model::load_hf(dir.path(), &Device::Cpu).unwrap();
    let cpu = cpu_fixture("tiny_qwen2");
    for ((name, a), (_, b)) in again.parameters().iter().zip(cpu.parameters()) {
        let h = |v: &metronome_model::Var| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(h(a), h(&b), "{name}");
    }
    // A snapshot (device to host) and back onto the GPU keeps the logits.
    let snap = model.snapshot(metronome_core::PolicyVersion(3)).unwrap();
    let back = Model::from_snapshot(model.config().clone(), &snap, &gpu, false).unwrap();
    let seq = tokens(5, 9, model.config().vocab_size);
    let (a, b) = (full_logits(&model, &seq), full_logits(&back, &seq));
    assert_eq!(a, b);
}

#[test]
fn cuda_training_step_moves_only_the_device_weights() {
    // A gradient step on the GPU raises the targets' log-probs, as on the CPU.
    let Some(gpu) = cuda() else { return };
    let model = Model::load_hf(&fixture("tiny_llama"), &gpu).unwrap();
    let seq = tokens(4, 8, 96);
    let (rows, targets): (_, Targets) = separate_rows(&seq[..3], &[seq[3..].to_vec()]);
    let (before, after) = logprob_around_sgd(&model, &rows, &targets, 3);
    assert!(after > before + 0.01, "{before} -> {after}");
}
