//! LoRA through the same trainer: only adapters train, the base is the frozen
//! reference, published weights are merged, and checkpoints resume bit-identically.

use metronome_core::PolicyVersion;
use metronome_model::{Device, LoraConfig, Model};
use metronome_testkit::check_adapter_gradient;
use metronome_trainer::loss::KlEstimator;
use metronome_trainer::{GrpoTrainer, TrainerConfig};

use crate::common::{config, flat_weights, period_groups, stamped, tiny_model};

fn lora_config() -> TrainerConfig {
    let mut cfg = config();
    cfg.lora = Some(LoraConfig { rank: 4, alpha: 8.0, ..LoraConfig::default() });
    cfg.loss.kl_coef = 0.05;
    cfg.loss.kl_estimator = KlEstimator::K3;
    cfg
}

fn adapter_bits(t: &GrpoTrainer) -> Vec<(String, Vec<u32>)> {
    t.policy()
        .adapter_parameters()
        .into_iter()
        .map(|(n, v)| {
            (n, v.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// One period of the four groups, in an order that varies with `k`.
fn period(t: &mut GrpoTrainer, k: usize) -> metronome_core::StepReport {
    let groups = period_groups();
    for i in 0..groups.len() {
        let v = t.version();
        t.accumulate_sync(&stamped(&groups[(i + k) % groups.len()], v)).unwrap();
    }
    t.step_sync().unwrap()
}

/// Asserts what the pending gradients hold: exactly the adapters, each as
/// [`check_adapter_gradient`] says.
fn check_pending(t: &GrpoTrainer, b_is_zero: bool) {
    let pending = t.pending_gradients().unwrap().unwrap();
    let names: Vec<&String> = pending.iter().map(|(n, _)| n).collect();
    let adapters: Vec<String> = t.policy().adapter_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, adapters.iter().collect::<Vec<_>>(), "gradients of other than the adapters");
    for (name, g) in pending {
        check_adapter_gradient(&name, &g.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b_is_zero);
    }
}

#[test]
fn only_adapters_train_and_the_base_stays_bit_identical() {
    let model = tiny_model();
    let base_before = flat_weights(&model);
    let mut t = lora_config().build(model).unwrap();
    // Seven projections in two layers, A and B each.
    assert_eq!(t.policy().adapter_parameters().len(), 28);
    let groups = period_groups();
    for g in &groups {
        t.accumulate_sync(&stamped(g, t.version())).unwrap();
    }
    check_pending(&t, true);
    let first = t.step_sync().unwrap();
    assert!(first.applied);
    // The policy equals its base (the reference) until a step moves B: KL exactly 0.
    assert_eq!(first.kl, 0.0);
    for g in &groups {
        t.accumulate_sync(&stamped(g, t.version())).unwrap();
    }
    check_pending(&t, false);
    t.step_sync().unwrap();
    let third = period(&mut t, 2);
    assert!(third.kl > 0.0, "the adapted policy moved away from the base: {}", third.kl);
    let base_after = flat_weights(t.policy());
    assert!(
        base_before.iter().zip(&base_after).all(|(a, b)| a.to_bits() == b.to_bits()),
        "a base weight moved"
    );
    // AdamW's moments exist for the adapters alone.
    let dir = tempfile::tempdir().unwrap();
    t.save_checkpoint(dir.path()).unwrap();
    let state =
        candle_core::safetensors::load(dir.path().join("optimizer.safetensors"), &Device::Cpu).unwrap();
    let mut keys: Vec<String> = state.into_keys().collect();
    keys.sort();
    let mut want: Vec<String> = t
        .policy()
        .adapter_parameters()
        .into_iter()
        .flat_map(|(n, _)| [format!("{n}.exp_avg"), format!("{n}.exp_avg_sq")])
        .collect();
    want.sort();
    assert_eq!(keys, want);
    // The published weights are merged: they moved, under the base's names.
    let snapshot = t.snapshot_sync().unwrap();
    let base = t.policy().base().snapshot(PolicyVersion(0)).unwrap();
    assert_eq!(snapshot.tensors.len(), base.tensors.len());
    assert_ne!(snapshot.tensors, base.tensors, "the snapshot holds the base, not the merged model");
}

#[test]
fn supervised_steps_train_the_adapters_only() {
    let model = tiny_model();
    let before = flat_weights(&model);
    let mut cfg = lora_config();
    cfg.loss.kl_coef = 0.0;
    let mut t = cfg.build(model).unwrap();
    let examples = [metronome_trainer::SftExample::new(vec![3, 4, 5], vec![6, 7])];
    let start = t.sft_loss(&examples).unwrap();
    for _ in 0..5 {
        t.accumulate_sft(&examples).unwrap();
        t.step_sync().unwrap();
    }
    assert!(t.sft_loss(&examples).unwrap() < start);
    assert_eq!(flat_weights(t.policy()), before);
}

/// Two periods, half of the third, a checkpoint; then the rest of the third period
/// and two more, by the trainer that wrote it and by one resumed from it: equal
/// losses and adapters to the bit.
#[test]
fn a_resumed_lora_run_steps_bit_identically() {
    let cfg = lora_config();
    let groups = period_groups();
    let dir = tempfile::tempdir().unwrap();
    let mut a = cfg.build(tiny_model()).unwrap();
    period(&mut a, 0);
    period(&mut a, 1);
    for g in &groups[..2] {
        a.accumulate_sync(&stamped(g, a.version())).unwrap();
    }
    a.save_checkpoint(dir.path()).unwrap();
    // The base and the adapters apart, in the formats transformers and peft load; no
    // reference copy (the base is the reference).
    for file in
        ["policy/model.safetensors", "adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
    {
        assert!(dir.path().join(file).is_file(), "{file}");
    }
    assert!(!dir.path().join("reference").exists());
    let mut b = cfg.resume(dir.path(), &Device::Cpu).unwrap();
    assert_eq!(adapter_bits(&a), adapter_bits(&b));
    for t in [&mut a, &mut b] {
        for g in &groups[2..] {
            t.accumulate_sync(&stamped(g, t.version())).unwrap();
        }
    }
    let mut reports = vec![(a.step_sync().unwrap(), b.step_sync().unwrap())];
    for k in 3..5 {
        reports.push((period(&mut a, k), period(&mut b, k)));
    }
    for (ra, rb) in reports {
        assert_eq!((ra.loss.to_bits(), ra.kl.to_bits()), (rb.loss.to_bits(), rb.kl.to_bits()));
    }
    assert_eq!(adapter_bits(&a), adapter_bits(&b), "adapters differ after resume");
    assert_eq!(flat_weights(a.policy()), flat_weights(b.policy()));
}

#[test]
fn lora_errors_name_the_key_or_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora_config();
    let mut t = cfg.build(tiny_model()).unwrap();
    period(&mut t, 0);
    t.save_checkpoint(dir.path()).unwrap();
    // Resumed without trainer.lora, or with other adapters.
    let mut plain = cfg.clone();
    plain.lora = None;
    let err = plain.resume(dir.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("adapter") && err.contains("trainer.lora is not set"), "{err}");
    let mut other = cfg.clone();
    other.lora = Some(LoraConfig { rank: 2, alpha: 8.0, ..LoraConfig::default() });
    let err = other.resume(dir.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(err.starts_with("config key `lora.rank` is 2, the checkpoint's adapters have 4"), "{err}");
    // A full fine-tuning checkpoint resumed with LoRA; written over a LoRA one, it
    // leaves no adapters behind to be read as its own.
    let full = tempfile::tempdir().unwrap();
    t.save_checkpoint(full.path()).unwrap();
    plain.build(tiny_model()).unwrap().save_checkpoint(full.path()).unwrap();
    let err = cfg.resume(full.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("adapter") && err.contains("is missing"), "{err}");
    plain.resume(full.path(), &Device::Cpu).unwrap();
    // A rank above a projection of the tiny model (k_proj: 128 -> 64).
    let mut big = cfg.clone();
    big.lora = Some(LoraConfig { rank: 65, ..LoraConfig::default() });
    let err = big.build(tiny_model()).unwrap_err().to_string();
    assert!(err.starts_with("config key `lora.rank` is 65, larger than k_proj (64 x 128)"), "{err}");
    // A policy that already has adapters.
    let adapted = tiny_model().with_lora(&LoraConfig::default(), 0).unwrap();
    let err = cfg.build(adapted.clone()).unwrap_err().to_string();
    assert!(err.contains("already has LoRA adapters"), "{err}");
    assert!(plain.build(adapted).is_err());
    // The merged model of a trained policy is a plain model to start again from.
    let merged: Model = t.policy().merged().unwrap();
    cfg.build(merged).unwrap();
}
