//! The training forward: gradients reach every parameter, and packed shared-prompt
//! rows give the log-probs of separate rows.

use metronome_core::Targets;
use metronome_model::{Device, Model, ModelConfig};

use crate::common::{fixture, logprob_around_sgd, max_abs_diff, separate_rows, shared_prompt_row, tokens};

pub(crate) fn every_parameter_gets_a_gradient(model: &Model) {
    let vocab = model.config().vocab_size;
    let prompt = tokens(1, 6, vocab);
    let responses = vec![tokens(2, 4, vocab), tokens(3, 3, vocab)];
    let (row, targets) = shared_prompt_row(&prompt, &responses);
    let out = model.target_logprobs(&[row], &targets).unwrap();
    let loss = (out.logprobs.sum_all().unwrap().neg().unwrap()
        - (out.entropy.sum_all().unwrap() * 0.01).unwrap())
    .unwrap();
    let grads = loss.backward().unwrap();
    for (name, var) in model.parameters() {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{name} has no gradient"));
        let v = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{name} has a non-finite gradient");
        assert!(v.iter().any(|&x| x != 0.0), "{name} has an all-zero gradient");
    }
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient_llama() {
    every_parameter_gets_a_gradient(&Model::new(ModelConfig::tiny(), &Device::Cpu, 11).unwrap());
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient_qwen2_tied() {
    // Biases and the tied embedding/head.
    every_parameter_gets_a_gradient(&Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap());
}

#[test]
fn frozen_model_builds_no_graph() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 11).unwrap().frozen_copy().unwrap();
    let (row, targets) = shared_prompt_row(&tokens(1, 4, 99), &[tokens(2, 3, 99)]);
    let out = model.target_logprobs(&[row], &targets).unwrap();
    let grads = out.logprobs.sum_all().unwrap().backward().unwrap();
    for (name, var) in model.parameters() {
        assert!(grads.get(var.as_tensor()).is_none(), "{name} got a gradient through a frozen model");
    }
}

#[test]
fn packed_shared_prompt_equals_separate_rows() {
    shared_prompt_equals_separate_rows(&Model::load_hf(&fixture("tiny_llama"), &Device::Cpu).unwrap());
}

/// Log-probs and entropies of one group packed with a shared prompt equal those of
/// separate rows within 1e-5, alone or beside another group in the row.
pub(crate) fn shared_prompt_equals_separate_rows(model: &Model) {
    let vocab = model.config().vocab_size;
    let prompt = tokens(7, 5, vocab);
    let responses = vec![tokens(8, 4, vocab), tokens(9, 1, vocab), tokens(10, 6, vocab)];
    let (row, packed_targets) = shared_prompt_row(&prompt, &responses);
    let (rows, sep_targets) = separate_rows(&prompt, &responses);
    let packed = model.target_logprobs(std::slice::from_ref(&row), &packed_targets).unwrap();
    let sep = model.target_logprobs(&rows, &sep_targets).unwrap();
    let v = |t: &metronome_model::Tensor| t.to_vec1::<f32>().unwrap();
    assert_eq!(v(&packed.logprobs).len(), 11);
    let d = max_abs_diff(&v(&packed.logprobs), &v(&sep.logprobs));
    assert!(d < 1e-5, "log-probs differ by {d}");
    let d = max_abs_diff(&v(&packed.entropy), &v(&sep.entropy));
    assert!(d < 1e-5, "entropies differ by {d}");
    assert!(v(&packed.logprobs).iter().all(|&x| x < 0.0));
    assert!(v(&packed.entropy).iter().all(|&x| x > 0.0 && x <= (vocab as f32).ln() + 1e-4));

    // Two groups side by side in one row (block-diagonal trees) give the same numbers.
    let (row2, t2) = shared_prompt_row(&tokens(20, 3, vocab), &[tokens(21, 2, vocab)]);
    let mut both = row.clone();
    let off = both.tokens.len() as u32;
    both.tokens.extend(&row2.tokens);
    both.positions.extend(&row2.positions);
    let base = both.segments.len() as u32;
    both.segments.extend(row2.segments.iter().map(|s| metronome_core::Segment {
        start: s.start + off,
        len: s.len,
        parent: s.parent.map(|p| p + base),
    }));
    let mut tb = packed_targets.clone();
    tb.row.extend(t2.row.iter().map(|_| 0));
    tb.position.extend(t2.position.iter().map(|p| p + off));
    tb.token.extend(&t2.token);
    let joint = v(&model.target_logprobs(&[both], &tb).unwrap().logprobs);
    let alone2 = v(&model.target_logprobs(&[row2], &t2).unwrap().logprobs);
    assert!(max_abs_diff(&joint[..11], &v(&packed.logprobs)) < 1e-5);
    assert!(max_abs_diff(&joint[11..], &alone2) < 1e-5);
}

#[test]
fn target_logprobs_equal_log_softmax_of_full_logits() {
    let model = Model::load_hf(&fixture("tiny_llama"), &Device::Cpu).unwrap();
    let seq = tokens(4, 8, 96);
    let (rows, targets) = separate_rows(&seq[..3], &[seq[3..].to_vec()]);
    let out = model.target_logprobs(&rows, &targets).unwrap().logprobs.to_vec1::<f32>().unwrap();
    let full = crate::common::full_logits(&model, &seq);
    for (j, lp) in out.iter().enumerate() {
        let logits = &full[2 + j];
        let max = logits.iter().copied().fold(f32::MIN, f32::max);
        let lse = max + logits.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
        let want = logits[seq[3 + j] as usize] - lse;
        assert!((lp - want).abs() < 1e-5, "target {j}: {lp} vs {want}");
    }
}

#[test]
fn scoring_at_a_temperature_is_the_log_softmax_of_scaled_logits() {
    let model = Model::load_hf(&fixture("tiny_llama"), &Device::Cpu).unwrap();
    let portable = model.clone().with_kernels(metronome_model::Kernels::Portable).unwrap();
    let seq = tokens(4, 8, 96);
    let (rows, targets) = separate_rows(&seq[..3], &[seq[3..].to_vec()]);
    let full = crate::common::full_logits(&model, &seq);
    let batch = model.prepare_batch(&rows, &targets).unwrap();
    assert_eq!((batch.num_positions(), batch.num_targets()), (8, 5));
    for temperature in [0.6f32, 1.0, 1.7] {
        for m in [&model, &portable] {
            let out = m.score(&batch, temperature).unwrap();
            let (lp, h) = (out.logprobs.to_vec1::<f32>().unwrap(), out.entropy.to_vec1::<f32>().unwrap());
            for j in 0..lp.len() {
                // In f64 from the full forward's logits: log_softmax(z / T) and its entropy.
                let z: Vec<f64> =
                    full[2 + j].iter().map(|&x| f64::from(x) / f64::from(temperature)).collect();
                let max = z.iter().copied().fold(f64::MIN, f64::max);
                let lse = max + z.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                let want = z[seq[3 + j] as usize] - lse;
                let entropy: f64 = z.iter().map(|x| -(x - lse).exp() * (x - lse)).sum();
                assert!(
                    (f64::from(lp[j]) - want).abs() < 1e-5,
                    "T={temperature} target {j}: {} vs {want}",
                    lp[j]
                );
                assert!((f64::from(h[j]) - entropy).abs() < 1e-4, "T={temperature} entropy {j}");
            }
        }
    }
    // Greedy decoding records log-probs at T = 1, so T = 0 scores at 1.
    let at = |t: f32| model.score(&batch, t).unwrap().logprobs.to_vec1::<f32>().unwrap();
    assert_eq!(at(0.0), at(1.0));
    assert_eq!(at(1.0), model.target_logprobs(&rows, &targets).unwrap().logprobs.to_vec1::<f32>().unwrap());
    for bad in [-1.0, f32::NAN, f32::INFINITY] {
        let e = model.score(&batch, bad).unwrap_err().to_string();
        assert!(e.contains("temperature"), "{e}");
    }
}

#[test]
fn a_prepared_batch_is_scored_by_models_of_its_shape_only() {
    let policy = Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap();
    let reference = policy.frozen_copy().unwrap();
    let (row, targets) = shared_prompt_row(&tokens(1, 5, 99), &[tokens(2, 4, 99), tokens(3, 3, 99)]);
    let rows = [row];
    let batch = policy.prepare_batch(&rows, &targets).unwrap();
    let v = |t: &metronome_model::Tensor| t.to_vec1::<f32>().unwrap();
    // The same weights score the shared batch exactly as they score the rows alone.
    let shared = v(&reference.score(&batch, 0.8).unwrap().logprobs);
    let alone =
        v(&reference.score(&reference.prepare_batch(&rows, &targets).unwrap(), 0.8).unwrap().logprobs);
    assert_eq!(shared, alone);
    assert_eq!(v(&policy.score(&batch, 0.8).unwrap().logprobs), shared);
    let other = Model::new(ModelConfig { head_dim: 16, ..ModelConfig::tiny() }, &Device::Cpu, 3).unwrap();
    let e = other.score(&batch, 1.0).unwrap_err().to_string();
    assert!(e.contains("scoring batch") && e.contains("head size"), "{e}");
}

#[test]
fn malformed_targets_are_errors() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).unwrap();
    let (row, mut targets) = shared_prompt_row(&tokens(1, 3, 99), &[tokens(2, 2, 99)]);
    targets.position[0] = 99;
    let e = model.target_logprobs(std::slice::from_ref(&row), &targets).unwrap_err().to_string();
    assert!(e.contains("target 0") && e.contains("position 99"), "{e}");
    let t = Targets { row: vec![1], position: vec![0], token: vec![3], ..Targets::default() };
    assert!(model.target_logprobs(std::slice::from_ref(&row), &t).unwrap_err().to_string().contains("row 1"));
    let mut bad = row;
    bad.positions.pop();
    assert!(
        model.target_logprobs(&[bad], &Targets::default()).unwrap_err().to_string().contains("packed row 0")
    );
}

#[test]
fn gradient_steps_raise_the_target_logprobs() {
    // Plain SGD on the log-prob loss through `parameters()`: what an optimiser does.
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 21).unwrap();
    let (row, targets) = shared_prompt_row(&tokens(1, 5, 99), &[tokens(2, 6, 99), tokens(3, 4, 99)]);
    let (before, after) = logprob_around_sgd(&model, &[row], &targets, 5);
    assert!(after > before + 0.1, "mean log-prob {before} -> {after}");
}
