//! Checkpoint and resume give bit-identical steps.

use metronome_core::TrainBatch;
use metronome_model::Device;
use metronome_testkit::damage::{Damage, check_damaged};
use metronome_trainer::schedule::Decay;
use metronome_trainer::{GrpoTrainer, TrainerConfig};

use crate::common::{config, flat_weights, period_groups, stamped, tiny_model};

#[test]
fn three_plus_three_steps_equal_resumed_three() {
    let groups = period_groups();
    let mut cfg = kl_config();
    cfg.schedule.warmup_steps = 2;
    cfg.schedule.decay = Decay::Cosine { total_steps: 10, min_ratio: 0.1 };
    cfg.max_grad_norm = Some(0.5);
    let dir = tempfile::tempdir().unwrap();
    let period = |t: &mut GrpoTrainer, k: usize| {
        // Vary the order per period, as completion order would.
        for i in 0..groups.len() {
            let v = t.version();
            t.accumulate_sync(&stamped(&groups[(i + k) % groups.len()], v)).unwrap();
        }
        t.step_sync().unwrap()
    };
    let mut a = cfg.build(tiny_model()).unwrap();
    for k in 0..3 {
        period(&mut a, k);
    }
    a.save_checkpoint(dir.path()).unwrap();
    let mut reports_a = Vec::new();
    for k in 3..6 {
        reports_a.push(period(&mut a, k));
    }
    let mut b = cfg.resume(dir.path(), &Device::Cpu).unwrap();
    assert_eq!(b.version(), metronome_core::PolicyVersion(3));
    assert_eq!(b.optimizer_steps(), 3);
    for (k, ra) in (3..6).zip(&reports_a) {
        let rb = period(&mut b, k);
        assert_eq!(ra.learning_rate.to_bits(), rb.learning_rate.to_bits());
        assert_eq!(ra.loss.to_bits(), rb.loss.to_bits());
        assert_eq!(ra.version, rb.version);
    }
    let (wa, wb) = (flat_weights(a.policy()), flat_weights(b.policy()));
    assert!(wa.iter().zip(&wb).all(|(x, y)| x.to_bits() == y.to_bits()), "weights differ after resume");
}

/// A trainer (KL term on, so the reference model is saved too) after one full period
/// and half of the next: what a checkpoint mid-period holds.
fn mid_period(cfg: &TrainerConfig, groups: &[TrainBatch]) -> GrpoTrainer {
    let mut t = cfg.build(tiny_model()).unwrap();
    for g in groups {
        t.accumulate_sync(g).unwrap();
    }
    t.step_sync().unwrap();
    for g in &groups[..2] {
        t.accumulate_sync(&stamped(g, t.version())).unwrap();
    }
    t
}

fn kl_config() -> TrainerConfig {
    let mut cfg = config();
    cfg.loss.kl_coef = 0.05;
    cfg
}

#[test]
fn a_checkpoint_mid_period_resumes_to_the_same_weights() {
    let groups = period_groups();
    let cfg = kl_config();
    let dir = tempfile::tempdir().unwrap();
    let mut a = mid_period(&cfg, &groups);
    a.save_checkpoint(dir.path()).unwrap();
    let mut b = cfg.resume(dir.path(), &Device::Cpu).unwrap();
    for t in [&mut a, &mut b] {
        for g in &groups[2..] {
            t.accumulate_sync(&stamped(g, t.version())).unwrap();
        }
    }
    let (ra, rb) = (a.step_sync().unwrap(), b.step_sync().unwrap());
    assert_eq!((ra.groups, ra.sequences, ra.tokens), (4, 16, rb.tokens));
    assert_eq!((rb.groups, rb.sequences), (4, 16));
    assert_eq!(ra.loss.to_bits(), rb.loss.to_bits());
    let (wa, wb) = (flat_weights(a.policy()), flat_weights(b.policy()));
    assert!(wa.iter().zip(&wb).all(|(x, y)| x.to_bits() == y.to_bits()), "weights differ after resume");
}

#[test]
fn missing_checkpoint_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = config().resume(dir.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("trainer_state.json"), "{err}");
    let t = config().build(tiny_model()).unwrap();
    t.save_checkpoint(dir.path()).unwrap();
    std::fs::remove_file(dir.path().join("optimizer.safetensors")).unwrap();
    let err = config().resume(dir.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("optimizer.safetensors"), "{err}");
}

#[test]
fn truncated_or_corrupted_checkpoint_files_are_errors_never_panics() {
    let cfg = kl_config();
    let good = tempfile::tempdir().unwrap();
    // Mid-period, so that the accumulator files hold something.
    mid_period(&cfg, &period_groups()).save_checkpoint(good.path()).unwrap();
    let files =
        ["trainer_state.json", "optimizer.safetensors", "accumulator.safetensors", "accumulator.json"];
    let mut tried = 0;
    for file in files {
        let bytes = std::fs::read(good.path().join(file)).unwrap();
        // Every byte of the first 128 (headers, JSON), then 40 points over the rest.
        let at: Vec<usize> =
            (0..bytes.len().min(128)).chain((128..bytes.len()).step_by(bytes.len() / 40 + 1)).collect();
        let damages = [Damage::Cut, Damage::Flip(0x5a)];
        tried += check_damaged(&good.path().join(file), &bytes, &at, &damages, &[file], || {
            cfg.resume(good.path(), &Device::Cpu).map(drop)
        });
    }
    eprintln!("{tried} truncated or corrupted files, every one an error or a load");
    assert!(tried > 1000, "{tried}");
}

/// A trainer restored in place (the `Trainer` contract's `restore_checkpoint`, what a
/// resumed run does) keeps the run's sampling temperature, and then steps as the
/// trainer that wrote the checkpoint does.
#[test]
fn a_trainer_restored_in_place_keeps_its_sampling_temperature() {
    let groups = period_groups();
    let dir = tempfile::tempdir().unwrap();
    let at = |t: f32| config().build(tiny_model()).unwrap().with_sampling_temperature(t).unwrap();
    let mut a = at(0.7);
    for g in &groups {
        a.accumulate_sync(&stamped(g, a.version())).unwrap();
    }
    a.step_sync().unwrap();
    a.save_checkpoint(dir.path()).unwrap();
    let mut b = at(0.7);
    b.restore(dir.path()).unwrap();
    assert_eq!(b.sampling_temperature(), 0.7);
    assert_eq!(b.version(), a.version());
    for t in [&mut a, &mut b] {
        for g in &groups {
            t.accumulate_sync(&stamped(g, t.version())).unwrap();
        }
    }
    let (ra, rb) = (a.step_sync().unwrap(), b.step_sync().unwrap());
    assert_eq!(ra.loss.to_bits(), rb.loss.to_bits(), "scored at another temperature after the restore");
}

/// Found by the fuzz suite: a checkpoint whose reference model has another rotary
/// base (or shape) than its policy resumed, and its first step failed ("scoring batch
/// was prepared by a model of another vocabulary, head size, rotary base or device").
/// The resume refuses it, naming the file and the field.
#[test]
fn a_reference_model_unlike_the_policy_is_refused_at_resume() {
    let cfg = kl_config();
    let dir = tempfile::tempdir().unwrap();
    cfg.build(tiny_model()).unwrap().save_checkpoint(dir.path()).unwrap();
    let path = dir.path().join("reference/config.json");
    let text =
        std::fs::read_to_string(&path).unwrap().replace("\"rope_theta\": 10000.0", "\"rope_theta\": 2.0");
    std::fs::write(&path, text).unwrap();
    let e = cfg.resume(dir.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("reference/config.json") && e.contains("rope_theta"), "{e}");
}

/// Found by the fuzz suite: a mini-step checkpoint whose buffered batch broke the
/// layout contract (a behaviour log-prob removed from `accumulator.json`) or held a
/// token outside the vocabulary resumed, and its step failed. The resume refuses it,
/// naming the file and the batch.
#[test]
fn a_buffered_batch_the_step_cannot_train_is_refused_at_resume() {
    let mut cfg = config();
    cfg.mini_steps = 2;
    let dir = tempfile::tempdir().unwrap();
    let mut t = cfg.build(tiny_model()).unwrap();
    t.accumulate_sync(&period_groups()[0]).unwrap();
    t.save_checkpoint(dir.path()).unwrap();
    let path = dir.path().join("accumulator.json");
    let good = std::fs::read_to_string(&path).unwrap();
    for (damage, reason) in [(0, "entries"), (1, "outside the vocabulary")] {
        let mut pending: serde_json::Value = serde_json::from_str(&good).unwrap();
        let batch = &mut pending["buffered"][0];
        if damage == 0 {
            batch["targets"]["behaviour_logprob"].as_array_mut().unwrap().pop();
        } else {
            batch["rows"][0]["tokens"][0] = serde_json::json!(255);
        }
        std::fs::write(&path, pending.to_string()).unwrap();
        let e = cfg.resume(dir.path(), &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("accumulator.json") && e.contains("buffered[0]") && e.contains(reason), "{e}");
    }
}

/// Found by the fuzz suite: counts near `u64::MAX` in `trainer_state.json` or
/// `accumulator.json` resumed, and the next step overflowed (a panic in a debug
/// build; in a release build the version wrapped to 0 and AdamW's bias correction
/// went negative). The resume refuses them, naming the file and the field.
#[test]
fn counts_that_would_overflow_are_refused_at_resume() {
    let cfg = kl_config();
    let good = tempfile::tempdir().unwrap();
    mid_period(&cfg, &period_groups()).save_checkpoint(good.path()).unwrap();
    let cases = [
        ("trainer_state.json", "version"),
        ("trainer_state.json", "optimizer_steps"),
        ("accumulator.json", "micro_batches"),
        ("accumulator.json", "sums.tokens"),
        ("accumulator.json", "mismatch.masked"),
    ];
    for (file, field) in cases {
        let path = good.path().join(file);
        let original = std::fs::read_to_string(&path).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&original).unwrap();
        let slot = match field.split_once('.') {
            Some((table, key)) => &mut json[table][key],
            None => &mut json[field],
        };
        *slot = serde_json::json!(u64::MAX);
        std::fs::write(&path, json.to_string()).unwrap();
        let e = cfg.resume(good.path(), &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains(file) && e.contains(field), "{e}");
        std::fs::write(&path, original).unwrap();
    }
}
