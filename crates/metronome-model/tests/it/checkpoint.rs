//! Checkpoints and snapshots: save/load is bit-exact, snapshots never alias.

use metronome_core::PolicyVersion;
use metronome_model::{Architecture, Device, Model, ModelConfig, Tensor};
use metronome_testkit::damage::{Damage, check_damaged, positions};

use crate::common::{fixture, full_logits, tokens};

fn bits(model: &Model) -> Vec<(String, Vec<u32>)> {
    model
        .parameters()
        .into_iter()
        .map(|(n, v)| {
            (n, v.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

#[test]
fn save_load_round_trip_is_bit_exact() {
    for arch in [Architecture::Llama, Architecture::Qwen2] {
        let mut cfg = ModelConfig::tiny();
        cfg.architecture = arch;
        cfg.tie_word_embeddings = arch == Architecture::Qwen2;
        let model = Model::new(cfg.clone(), &Device::Cpu, 42).unwrap();
        let dir = tempfile::tempdir().unwrap();
        model.save_hf(dir.path()).unwrap();
        let back = Model::load_hf(dir.path(), &Device::Cpu).unwrap();
        assert_eq!(back.config(), &cfg);
        assert_eq!(bits(&back), bits(&model));
        let seq = tokens(1, 9, cfg.vocab_size);
        assert_eq!(full_logits(&back, &seq), full_logits(&model, &seq));
    }
}

#[test]
fn fixture_round_trips_through_save() {
    let model = Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_hf(dir.path()).unwrap();
    assert_eq!(bits(&Model::load_hf(dir.path(), &Device::Cpu).unwrap()), bits(&model));
}

#[test]
fn init_is_deterministic_per_seed() {
    let a = Model::new(ModelConfig::tiny(), &Device::Cpu, 9).unwrap();
    let b = Model::new(ModelConfig::tiny(), &Device::Cpu, 9).unwrap();
    let c = Model::new(ModelConfig::tiny(), &Device::Cpu, 10).unwrap();
    assert_eq!(bits(&a), bits(&b));
    assert_ne!(bits(&a), bits(&c));
}

/// Both kinds of snapshot: in host memory, and left on the model's device (the CPU
/// here, as a GPU trainer leaves them on its GPU for an engine of the same process).
fn snapshot_of(kind: &str, model: &Model, version: PolicyVersion) -> metronome_core::WeightSnapshot {
    match kind {
        "host" => model.snapshot(version).unwrap(),
        _ => model.snapshot_resident(version).unwrap(),
    }
}

#[test]
fn snapshots_do_not_alias_and_restore() {
    for kind in ["host", "resident"] {
        let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).unwrap();
        let snap = snapshot_of(kind, &model, PolicyVersion(3));
        let before = bits(&model);
        assert_eq!(snap.version, PolicyVersion(3));
        assert_eq!(snap.tensors.len(), model.parameters().len());
        assert_eq!(snap.is_resident(), kind == "resident");
        let frozen = model.frozen_copy().unwrap();
        let worker = Model::from_snapshot(model.config().clone(), &snap, &Device::Cpu, false).unwrap();
        assert!(!worker.is_trainable());
        // An optimiser-style in-place write to the trainer's weights...
        for (_, var) in model.parameters() {
            var.set(&(var.as_tensor() + 1.0).unwrap()).unwrap();
        }
        // ...changes neither the snapshot, nor the frozen copy, nor the worker.
        assert_ne!(bits(&model), before, "{kind}");
        assert_eq!(bits(&frozen), before, "{kind}");
        assert_eq!(bits(&worker), before, "{kind}");
        let again = Model::from_snapshot(model.config().clone(), &snap, &Device::Cpu, true).unwrap();
        assert_eq!(bits(&again), before, "{kind}");
        model.load_snapshot(&snap).unwrap();
        assert_eq!(bits(&model), before, "{kind}");
        // A model built from the snapshot owns its weights: installing other weights
        // into it leaves the snapshot (and anything else built from it) as it was.
        again
            .load_snapshot(
                &Model::new(ModelConfig::tiny(), &Device::Cpu, 2)
                    .unwrap()
                    .snapshot(PolicyVersion(4))
                    .unwrap(),
            )
            .unwrap();
        assert_ne!(bits(&again), before, "{kind}");
        assert_eq!(
            bits(&Model::from_snapshot(model.config().clone(), &snap, &Device::Cpu, false).unwrap()),
            before,
            "{kind}"
        );
    }
}

/// A resident snapshot reads back to the host snapshot bit for bit (what a transport
/// sends of it), and one holding a weight that is not finite is refused by both
/// installers, naming the tensor and the element, with the model left as it was.
#[test]
fn resident_snapshots_read_back_exactly_and_refuse_weights_that_are_not_finite() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 5).unwrap();
    let host = model.snapshot(PolicyVersion(2)).unwrap();
    let resident = model.snapshot_resident(PolicyVersion(2)).unwrap();
    assert!(resident.is_resident() && !host.is_resident());
    assert_eq!(resident.num_bytes(), host.num_bytes());
    assert!(*resident.on_host().unwrap() == host);
    assert!(resident.clone().into_host().unwrap() == host);
    assert!(resident == model.snapshot_resident(PolicyVersion(2)).unwrap(), "equal as their host forms");
    let (name, var) = model.parameters().into_iter().nth(3).unwrap();
    let mut values = var.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // Finite weights whose sum overflows (the device check's reduction) still install.
    let kept = values.clone();
    values[0] = f32::MAX;
    values[1] = f32::MAX;
    var.set(&Tensor::from_slice(&values, var.dims(), &Device::Cpu).unwrap()).unwrap();
    let large = model.snapshot_resident(PolicyVersion(3)).unwrap();
    let target = Model::new(ModelConfig::tiny(), &Device::Cpu, 6).unwrap();
    target.load_snapshot(&large).unwrap();
    assert!(Model::from_snapshot(model.config().clone(), &large, &Device::Cpu, false).is_ok());
    assert!(bits(&target) == bits(&model), "installed as they are");
    values = kept;
    for (bad, value) in [(7, f32::NAN), (values.len() - 1, f32::NEG_INFINITY)] {
        let kept = values[bad];
        values[bad] = value;
        var.set(&Tensor::from_slice(&values, var.dims(), &Device::Cpu).unwrap()).unwrap();
        values[bad] = kept;
        let poisoned = model.snapshot_resident(PolicyVersion(3)).unwrap();
        let target = Model::new(ModelConfig::tiny(), &Device::Cpu, 6).unwrap();
        let before = bits(&target);
        let e = target.load_snapshot(&poisoned).unwrap_err().to_string();
        assert!(
            e.contains(&format!("`{name}`")) && e.contains(&format!("element {bad} is not finite")),
            "{e}"
        );
        assert_eq!(bits(&target), before, "a refused snapshot leaves the model as it was");
        let e = Model::from_snapshot(model.config().clone(), &poisoned, &Device::Cpu, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("`{name}`")) && e.contains(&format!("element {bad} is not finite")),
            "{e}"
        );
    }
}

#[test]
fn mismatched_snapshots_and_checkpoints_are_errors() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).unwrap();
    let mut snap = model.snapshot(PolicyVersion(1)).unwrap();
    snap.tensors[1].shape = vec![1, 1];
    let e = model.load_snapshot(&snap).unwrap_err().to_string();
    assert!(e.contains(&snap.tensors[1].name) && e.contains("shape"), "{e}");
    snap.tensors.remove(0);
    let e = Model::from_snapshot(model.config().clone(), &snap, &Device::Cpu, false).unwrap_err().to_string();
    assert!(e.contains("model.embed_tokens.weight"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let e = Model::load_hf(dir.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");
    std::fs::write(dir.path().join("config.json"), ModelConfig::tiny().to_hf_json()).unwrap();
    let e = Model::load_hf(dir.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    std::fs::write(dir.path().join("model.safetensors"), b"garbage").unwrap();
    assert!(Model::load_hf(dir.path(), &Device::Cpu).is_err());
}

#[test]
fn sharded_checkpoints_load() {
    let model = Model::load_hf(&fixture("tiny_llama"), &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("tiny_llama").join("config.json"), dir.path().join("config.json")).unwrap();
    // Two shards: the embedding alone, everything else in the second.
    let mut map = serde_json::Map::new();
    let mut first = Vec::new();
    let mut second = Vec::new();
    for (name, var) in model.parameters() {
        let file = if name.starts_with("model.embed") { "a.safetensors" } else { "b.safetensors" };
        map.insert(name.clone(), serde_json::json!(file));
        let t: Tensor = var.as_tensor().clone();
        if file == "a.safetensors" { first.push((name, t)) } else { second.push((name, t)) }
    }
    for (file, ts) in [("a.safetensors", first), ("b.safetensors", second)] {
        let ts: std::collections::HashMap<String, Tensor> = ts.into_iter().collect();
        candle_core_save(&ts, &dir.path().join(file));
    }
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({ "metadata": {}, "weight_map": map }).to_string(),
    )
    .unwrap();
    let back = Model::load_hf(dir.path(), &Device::Cpu).unwrap();
    assert_eq!(bits(&back), bits(&model));
}

/// Writes tensors with the safetensors crate (what any other tool would write).
fn candle_core_save(ts: &std::collections::HashMap<String, Tensor>, path: &std::path::Path) {
    let owned: Vec<(String, Vec<usize>, Vec<u8>)> = ts
        .iter()
        .map(|(n, t)| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (n.clone(), t.dims().to_vec(), v.iter().flat_map(|x| x.to_le_bytes()).collect())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn truncated_or_corrupted_hf_checkpoints_are_errors_never_panics() {
    let src = crate::common::fixture("tiny_llama");
    let dir = tempfile::tempdir().unwrap();
    let mut tried = 0;
    for file in ["model.safetensors", "config.json"] {
        let bytes = std::fs::read(src.join(file)).unwrap();
        for name in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(name), dir.path().join(name)).unwrap();
        }
        let damages = [Damage::Cut, Damage::Flip(0xff), Damage::Set(b'9')];
        let at = positions(bytes.len(), 400, 64, 0x00c0_ffee);
        // Bad tensor data is named by its tensor.
        tried += check_damaged(&dir.path().join(file), &bytes, &at, &damages, &[file, "tensor `"], || {
            Model::load_hf(dir.path(), &Device::Cpu).map(drop)
        });
    }
    eprintln!("{tried} truncated or corrupted files, every one an error or a load");
    assert!(tried > 1000);
}
