//! On-policy distillation in the trainer (`trainer.distill`): the teacher's sampled
//! signal is the per-token reverse KL as an advantage, alone or added to the rewards';
//! its full signal is the exact reverse KL over the vocabulary as a loss term; a
//! teacher equal to the student teaches nothing; a teacher that does not load or has
//! another vocabulary is refused naming the key; checkpoints leave the teacher out
//! and a resumed trainer, which loads it again, steps bit-identically.

use std::path::Path;

use metronome_core::TrainBatch;
use metronome_model::{Device, Model, ModelConfig, reverse_kl};
use metronome_trainer::{
    DistillConfig, DistillMode, DistillSignal, GrpoTrainer, TeacherFormat, TrainerConfig,
};

use crate::common::{
    config, flat_weights, max_abs_diff, pending_gradients, period_batch, stamped, tiny_model,
};

/// A teacher: a tiny model of another seed, saved as a Hugging Face folder in `dir`.
fn save_teacher(dir: &Path, seed: u64) -> std::path::PathBuf {
    let path = dir.join(format!("teacher-{seed}"));
    Model::new(ModelConfig::tiny(), &Device::Cpu, seed).unwrap().save_hf(&path).unwrap();
    path
}

fn distill_config(path: &Path, mode: DistillMode, weight: f32) -> TrainerConfig {
    with_signal(path, mode, DistillSignal::Sampled, weight)
}

fn with_signal(path: &Path, mode: DistillMode, signal: DistillSignal, weight: f32) -> TrainerConfig {
    let mut cfg = config();
    cfg.distill =
        Some(DistillConfig { kind: TeacherFormat::Hf, path: path.to_owned(), mode, signal, weight });
    cfg
}

/// Log-probs of `batch`'s targets under `model` at temperature 1.
fn logprobs(model: &Model, batch: &TrainBatch) -> Vec<f32> {
    model.target_logprobs(&batch.rows, &batch.targets).unwrap().logprobs.to_vec1::<f32>().unwrap()
}

#[test]
fn the_advantage_is_the_negated_reverse_kl_alone_or_added_to_the_rewards() {
    let dir = tempfile::tempdir().unwrap();
    let path = save_teacher(dir.path(), 11);
    let teacher = Model::load_hf(&path, &Device::Cpu).unwrap();
    let batch = period_batch(metronome_core::PolicyVersion(0));
    let student = logprobs(&tiny_model(), &batch);
    let teacher_lp = logprobs(&teacher, &batch);
    let kl: Vec<f32> = student.iter().zip(&teacher_lp).map(|(s, t)| s - t).collect();
    let mean_kl = kl.iter().map(|&k| f64::from(k)).sum::<f64>() / kl.len() as f64;
    assert!(mean_kl.abs() > 1e-3, "two random models should differ: {mean_kl}");
    for (mode, weight) in [(DistillMode::Alone, 1.0f32), (DistillMode::Add, 0.5)] {
        let mut t = distill_config(&path, mode, weight).build(tiny_model()).unwrap();
        t.accumulate_sync(&batch).unwrap();
        let distilled = pending_gradients(&t);
        let report = t.step_sync().unwrap();
        let got = report.distill_kl.expect("a distilling trainer reports the reverse KL");
        assert!((got - mean_kl).abs() < 1e-5, "{mode:?}: {got} vs {mean_kl}");

        // The same gradient as plain GRPO on those per-token advantages.
        let mut by_hand = batch.clone();
        for (a, k) in by_hand.targets.advantage.iter_mut().zip(&kl) {
            let signal = -weight * k;
            *a = if mode == DistillMode::Alone { signal } else { *a + signal };
        }
        let mut plain = config().build(tiny_model()).unwrap();
        plain.accumulate_sync(&by_hand).unwrap();
        let expected = pending_gradients(&plain);
        let scale = expected.iter().fold(0f32, |m, g| m.max(g.abs()));
        let diff = max_abs_diff(&distilled, &expected);
        assert!(scale > 0.0 && diff <= 1e-5 * scale, "{mode:?}: gradients differ by {diff} (scale {scale})");
        assert_eq!(plain.step_sync().unwrap().distill_kl, None);
    }
}

/// The full signal: the step reports the mean exact reverse KL over the targets, and
/// the gradient is that of `w · mean_t KL_t` (the default token-mean loss), alone or
/// with the GRPO term of the rewards' advantages beside it.
#[test]
fn the_full_signal_is_the_exact_reverse_kl_as_a_loss_term() {
    let dir = tempfile::tempdir().unwrap();
    let path = save_teacher(dir.path(), 11);
    let teacher = Model::load_hf(&path, &Device::Cpu).unwrap();
    let batch = period_batch(metronome_core::PolicyVersion(0));
    for (mode, weight) in [(DistillMode::Alone, 1.0f32), (DistillMode::Add, 0.5)] {
        let mut t = with_signal(&path, mode, DistillSignal::Full, weight).build(tiny_model()).unwrap();
        t.accumulate_sync(&batch).unwrap();
        let distilled = pending_gradients(&t);
        let report = t.step_sync().unwrap();

        // By hand: the student's graph, the teacher's rows, the divergence's gradient.
        let student = tiny_model();
        let out = student.target_logprobs(&batch.rows, &batch.targets).unwrap();
        let of_teacher = teacher.target_logprobs(&batch.rows, &batch.targets).unwrap();
        let kl = reverse_kl(&out.head, &of_teacher.head).unwrap();
        let per_token = kl.to_vec1::<f32>().unwrap();
        let mean = per_token.iter().map(|&k| f64::from(k)).sum::<f64>() / per_token.len() as f64;
        assert!(per_token.iter().all(|&k| k >= 0.0) && mean > 1e-3, "{per_token:?}");
        let got = report.distill_kl.expect("a distilling trainer reports the reverse KL");
        assert!((got - mean).abs() < 1e-5 * mean, "{mode:?}: {got} vs {mean}");

        let scale = f64::from(weight) / per_token.len() as f64;
        let grads = (kl * scale).unwrap().sum_all().unwrap().backward().unwrap();
        let mut expected: Vec<f32> = student
            .parameters()
            .iter()
            .flat_map(|(_, v)| {
                grads.get(v.as_tensor()).map_or_else(
                    || vec![0.0; v.elem_count()],
                    |g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                )
            })
            .collect();
        if mode == DistillMode::Add {
            // Plain GRPO's gradient on the rewards' advantages, beside it.
            let mut plain = config().build(tiny_model()).unwrap();
            plain.accumulate_sync(&batch).unwrap();
            expected.iter_mut().zip(pending_gradients(&plain)).for_each(|(e, g)| *e += g);
        }
        let scale = expected.iter().fold(0f32, |m, g| m.max(g.abs()));
        let diff = max_abs_diff(&distilled, &expected);
        assert!(scale > 0.0 && diff <= 1e-5 * scale, "{mode:?}: gradients differ by {diff} (scale {scale})");
    }
}

/// A student that is its own teacher under the full signal: a divergence and a
/// gradient of zero, and the mean reported as such.
#[test]
fn under_the_full_signal_a_teacher_equal_to_the_student_teaches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("same");
    tiny_model().save_hf(&path).unwrap();
    let mut t = with_signal(&path, DistillMode::Alone, DistillSignal::Full, 1.0).build(tiny_model()).unwrap();
    let batch = period_batch(metronome_core::PolicyVersion(0));
    t.accumulate_sync(&batch).unwrap();
    assert!(pending_gradients(&t).iter().all(|&g| g.abs() < 1e-7), "no pull towards itself");
    let kl = t.step_sync().unwrap().distill_kl.unwrap();
    assert!(kl.abs() < 1e-6, "{kl}");
}

#[test]
fn a_teacher_equal_to_the_student_teaches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("same");
    tiny_model().save_hf(&path).unwrap();
    let mut t = distill_config(&path, DistillMode::Alone, 1.0).build(tiny_model()).unwrap();
    // Groups whose rewards are all equal still train: the teacher has a signal for
    // every token (here none, the teacher being the student).
    let mut batch = period_batch(metronome_core::PolicyVersion(0));
    batch.groups.iter_mut().for_each(|g| g.all_equal = true);
    t.accumulate_sync(&batch).unwrap();
    assert!(pending_gradients(&t).iter().all(|&g| g == 0.0), "a zero advantage everywhere");
    let r = t.step_sync().unwrap();
    assert_eq!(r.tokens, batch.targets.len() as u64, "no group skipped");
    assert_eq!(r.distill_kl, Some(0.0));
}

#[test]
fn a_teacher_that_does_not_load_or_has_another_vocabulary_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let err = distill_config(&missing, DistillMode::Alone, 1.0).build(tiny_model()).unwrap_err().to_string();
    assert!(err.starts_with("config key `distill.path`") && err.contains("missing"), "{err}");
    let other = dir.path().join("other-vocabulary");
    let cfg = ModelConfig { vocab_size: ModelConfig::tiny().vocab_size + 5, ..ModelConfig::tiny() };
    Model::new(cfg, &Device::Cpu, 3).unwrap().save_hf(&other).unwrap();
    let err = distill_config(&other, DistillMode::Add, 1.0).build(tiny_model()).unwrap_err().to_string();
    assert!(err.starts_with("config key `distill.path`") && err.contains("vocabulary"), "{err}");
    let mut gguf = distill_config(&other, DistillMode::Add, 1.0);
    gguf.distill.as_mut().unwrap().kind = TeacherFormat::Gguf;
    let err = gguf.build(tiny_model()).unwrap_err().to_string();
    assert!(err.starts_with("config key `distill.path`") && err.contains("Gguf"), "{err}");
}

#[test]
fn checkpoints_leave_the_teacher_out_and_a_resumed_trainer_steps_identically() {
    let dir = tempfile::tempdir().unwrap();
    let path = save_teacher(dir.path(), 5);
    let cfg = distill_config(&path, DistillMode::Add, 0.5);
    let batch = period_batch(metronome_core::PolicyVersion(0));
    let period = |t: &mut GrpoTrainer| {
        t.accumulate_sync(&stamped(&batch, t.version())).unwrap();
        t.step_sync().unwrap()
    };
    let mut a = cfg.build(tiny_model()).unwrap();
    period(&mut a);
    let ckpt = dir.path().join("ckpt");
    a.save_checkpoint(&ckpt).unwrap();
    assert!(!ckpt.join("reference").exists(), "the teacher is not written into checkpoints");
    let mut b = cfg.resume(&ckpt, &Device::Cpu).unwrap();
    // And through `restore`, which keeps the teacher it has.
    let mut c = cfg.build(tiny_model()).unwrap();
    c.restore(&ckpt).unwrap();
    let (ra, rb, rc) = (period(&mut a), period(&mut b), period(&mut c));
    assert_eq!(ra.loss.to_bits(), rb.loss.to_bits());
    assert_eq!(ra.distill_kl.map(f64::to_bits), rc.distill_kl.map(f64::to_bits));
    let wa = flat_weights(a.policy());
    for other in [&b, &c] {
        let wb = flat_weights(other.policy());
        assert!(wa.iter().zip(&wb).all(|(x, y)| x.to_bits() == y.to_bits()), "weights differ after resume");
    }
}

/// In bf16 (`trainer.precision`) the teacher is scored as the reference is, from a
/// bf16 copy with the policy's chunked head: a teacher equal to the student then
/// teaches exactly nothing (an f32 teacher against the bf16 student would differ by
/// bf16's rounding), and another teacher's reverse KL tracks the f32 trainer's.
#[test]
fn in_bf16_the_teacher_is_scored_in_bf16_and_its_signal_tracks_f32() {
    let dir = tempfile::tempdir().unwrap();
    let same = dir.path().join("same");
    tiny_model().save_hf(&same).unwrap();
    let bf16 = |mut cfg: TrainerConfig| {
        cfg.precision = Some(metronome_model::Precision::Bf16);
        cfg.chunked_head = Some(true);
        cfg
    };
    let batch = period_batch(metronome_core::PolicyVersion(0));
    let mut t = bf16(distill_config(&same, DistillMode::Alone, 1.0)).build(tiny_model()).unwrap();
    t.accumulate_sync(&batch).unwrap();
    assert_eq!(t.step_sync().unwrap().distill_kl, Some(0.0), "the bf16 student against itself in bf16");

    let other = save_teacher(dir.path(), 11);
    let kl = |cfg: TrainerConfig| {
        let mut t = cfg.build(tiny_model()).unwrap();
        t.accumulate_sync(&batch).unwrap();
        t.step_sync().unwrap().distill_kl.unwrap()
    };
    let f32_kl = kl(distill_config(&other, DistillMode::Add, 1.0));
    let bf16_kl = kl(bf16(distill_config(&other, DistillMode::Add, 1.0)));
    eprintln!("mean reverse KL to another teacher: f32 {f32_kl:.6}, bf16 {bf16_kl:.6}");
    assert!(f32_kl.abs() > 1e-3, "{f32_kl}");
    assert!((f32_kl - bf16_kl).abs() <= 2e-2 * f32_kl.abs().max(1e-2), "f32 {f32_kl} vs bf16 {bf16_kl}");
}
