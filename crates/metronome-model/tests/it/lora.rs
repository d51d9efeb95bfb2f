//! Low-rank adapters: an adapted model starts as its base, only adapters get
//! gradients, merging keeps the logits, and the PEFT files round-trip.

use metronome_core::PolicyVersion;
use metronome_model::{Device, KvCache, LoraConfig, Model, ModelConfig, Projection, Tensor};

use metronome_testkit::check_adapter_gradient;
use metronome_testkit::damage::{Damage, check_damaged, positions};

use crate::common::{fixture, full_logits, max_abs_diff, shared_prompt_row, tokens};

/// Tolerance of merged against adapted logits, relative to the larger of 1 and the
/// largest logit: `x·(W + s·B·A)ᵀ` and `x·Wᵀ + s·(x·Aᵀ)·Bᵀ` sum in different orders
/// in float32 (measured: about 1e-6 on these models).
const MERGE_TOL: f32 = 1e-5;

fn lora(rank: usize, targets: &[&str]) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        target_modules: targets.iter().map(|s| (*s).to_owned()).collect(),
        ..LoraConfig::default()
    }
}

/// `B` set to deterministic values of the size training gives it, so the adapters
/// change the logits.
fn move_b(model: &Model) {
    for (name, var) in model.adapter_parameters() {
        if name.contains("lora_B") {
            let n = var.elem_count() as f32;
            let t = (Tensor::arange(0f32, n, var.device()).unwrap() * 0.37).unwrap().sin().unwrap();
            var.set(&(t.reshape(var.dims()).unwrap() * 0.05).unwrap()).unwrap();
        }
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn relative_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let scale = a.iter().flatten().fold(1.0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).map(|(x, y)| max_abs_diff(x, y)).fold(0.0, f32::max) / scale
}

#[test]
fn an_adapted_model_starts_equal_to_its_base() {
    let base = Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap();
    let adapted = base.with_lora(&LoraConfig::default(), 1).unwrap();
    let seq = tokens(4, 11, 99);
    // B = 0, so every adapter adds exactly zero.
    assert_eq!(full_logits(&adapted, &seq), full_logits(&base, &seq));
    let (row, targets) = shared_prompt_row(&tokens(5, 6, 99), &[tokens(6, 4, 99), tokens(7, 3, 99)]);
    let a = adapted.target_logprobs(std::slice::from_ref(&row), &targets).unwrap();
    let b = base.target_logprobs(&[row], &targets).unwrap();
    assert_eq!(a.logprobs.to_vec1::<f32>().unwrap(), b.logprobs.to_vec1::<f32>().unwrap());
    // Seven projections in each of two layers, A and B each.
    let params = adapted.adapter_parameters();
    assert_eq!(params.len(), 2 * 7 * 2);
    assert_eq!(params[0].0, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
    assert_eq!(params[27].0, "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight");
    // A: [r, in], B: [out, r]; k_proj maps 128 to 2 heads x 32.
    let dims = |name: &str| params.iter().find(|(n, _)| n == name).unwrap().1.dims().to_vec();
    assert_eq!(dims("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"), [8, 128]);
    assert_eq!(dims("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"), [64, 8]);
    assert_eq!(dims("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"), [8, 384]);
    // The same seed gives the same adapters, another seed others.
    let again = base.with_lora(&LoraConfig::default(), 1).unwrap().adapter_parameters();
    let other = base.with_lora(&LoraConfig::default(), 2).unwrap().adapter_parameters();
    assert_eq!(bits(&params[0].1), bits(&again[0].1));
    assert_ne!(bits(&params[0].1), bits(&other[0].1));
}

/// Only the adapters record a graph: no base weight gets a gradient. With `B = 0`
/// the gradient of every `A` is exactly zero (`∂L/∂A = s·Bᵀ·∂L/∂y·x`) and that of every
/// `B` finite and non-zero; once `B` has moved, every `A` and `B` gets a finite,
/// non-zero gradient.
#[test]
fn only_adapters_get_gradients() {
    let model = Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap();
    let adapted = model.with_lora(&LoraConfig::default(), 1).unwrap();
    let vocab = model.config().vocab_size;
    let (row, targets) = shared_prompt_row(&tokens(1, 6, vocab), &[tokens(2, 4, vocab), tokens(3, 3, vocab)]);
    let gradients = |m: &Model| {
        let out = m.target_logprobs(std::slice::from_ref(&row), &targets).unwrap();
        out.logprobs.sum_all().unwrap().neg().unwrap().backward().unwrap()
    };
    let grads = gradients(&adapted);
    for (name, var) in adapted.parameters() {
        assert!(grads.get(var.as_tensor()).is_none(), "base weight {name} got a gradient");
    }
    // Nor was one computed for the frozen base under another id (candle's plain
    // matmul computes one for a detached weight too): no gradient has the shape of a
    // base matrix.
    let matrices: Vec<Vec<usize>> =
        adapted.parameters().iter().map(|(_, v)| v.dims().to_vec()).filter(|d| d.len() == 2).collect();
    for id in grads.get_ids() {
        let dims = grads.get_id(*id).unwrap().dims().to_vec();
        assert!(!matrices.contains(&dims), "a gradient of a base weight's shape {dims:?}");
    }
    let check = |grads: &candle_core::backprop::GradStore, a_zero: bool| {
        for (name, var) in adapted.adapter_parameters() {
            let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{name} has no gradient"));
            check_adapter_gradient(&name, &g.flatten_all().unwrap().to_vec1::<f32>().unwrap(), a_zero);
        }
    };
    check(&grads, true);
    move_b(&adapted);
    check(&gradients(&adapted), false);
}

#[test]
fn merged_logits_equal_the_adapted_model() {
    // Llama with an untied head; Qwen2 with q/k/v biases and a tied head.
    let llama = Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap();
    let qwen2 = Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap();
    for (base, cfg) in [(llama, LoraConfig::default()), (qwen2, lora(4, &["v_proj", "q_proj", "down_proj"]))]
    {
        let adapted = base.with_lora(&cfg, 9).unwrap();
        move_b(&adapted);
        let seq = tokens(8, 13, base.config().vocab_size);
        let want = full_logits(&adapted, &seq);
        assert!(relative_diff(&want, &full_logits(&base, &seq)) > 1e-3, "the adapters change nothing");
        let merged = adapted.merged().unwrap();
        assert!(merged.lora().is_none() && merged.is_trainable());
        let diff = relative_diff(&want, &full_logits(&merged, &seq));
        eprintln!("{:?}: merged vs adapted logits, max relative diff {diff:e}", base.config().architecture);
        assert!(diff <= MERGE_TOL, "merged logits differ by {diff}");
        // What the rollout engine decodes: a frozen copy (merged) through the KV cache.
        let frozen = adapted.frozen_copy().unwrap();
        let mut cache = KvCache::new(&frozen, 1, 32).unwrap();
        let last = frozen.prefill(&mut cache, 0, &seq).unwrap();
        let tail = [want.last().unwrap().clone()];
        assert!(relative_diff(&tail, &[last]) <= MERGE_TOL);
        // Snapshots and HF checkpoints of an adapted handle are of the merged model,
        // under the base's names; the base itself is untouched.
        let snap = adapted.snapshot(PolicyVersion(1)).unwrap();
        let names: Vec<String> = base.parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(snap.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>(), names);
        let dir = tempfile::tempdir().unwrap();
        adapted.save_hf(dir.path()).unwrap();
        let loaded = Model::load_hf(dir.path(), &Device::Cpu).unwrap();
        assert_eq!(full_logits(&loaded, &seq), full_logits(&merged, &seq));
        assert_eq!(full_logits(&adapted.base(), &seq), full_logits(&base, &seq));
    }
}

#[test]
fn adapters_round_trip_through_the_peft_files() {
    let base = Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap();
    let adapted = base.with_lora(&lora(4, &["up_proj", "q_proj", "o_proj"]), 5).unwrap();
    move_b(&adapted);
    let dir = tempfile::tempdir().unwrap();
    adapted.save_lora_adapter(dir.path()).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["task_type"], "CAUSAL_LM");
    assert_eq!((config["r"].as_u64(), config["lora_alpha"].as_f64()), (Some(4), Some(8.0)));
    // Targets in layer order, whatever order the config gave.
    assert_eq!(config["target_modules"], serde_json::json!(["q_proj", "o_proj", "up_proj"]));
    let back = base.with_lora_adapter(dir.path()).unwrap();
    assert_eq!(back.lora(), adapted.lora());
    let (a, b) = (adapted.adapter_parameters(), back.adapter_parameters());
    assert_eq!(a.len(), 2 * 3 * 2);
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert_eq!(bits(va.as_tensor()), bits(vb.as_tensor()), "{na}");
    }
    let seq = tokens(2, 9, 99);
    assert_eq!(full_logits(&back, &seq), full_logits(&adapted, &seq));
}

#[test]
fn bad_adapter_files_are_errors_naming_the_file_never_panics() {
    let base = Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap();
    let adapted = base.with_lora(&lora(2, &["q_proj", "v_proj"]), 5).unwrap();
    let good = tempfile::tempdir().unwrap();
    adapted.save_lora_adapter(good.path()).unwrap();
    let mut tried = 0;
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        let bytes = std::fs::read(good.path().join(file)).unwrap();
        let damages = [Damage::Cut, Damage::Flip(0x5a), Damage::Set(b'9')];
        let at = positions(bytes.len(), 160, 64, 0x10ba);
        tried += check_damaged(&good.path().join(file), &bytes, &at, &damages, &[file], || {
            base.with_lora_adapter(good.path()).map(drop)
        });
    }
    eprintln!("{tried} truncated or corrupted adapter files, every one an error or a load");
    // Weights of other adapters under this config: a tensor missing, of the wrong
    // shape, or one the config does not name.
    let cases = [
        (lora(2, &["q_proj"]), "self_attn.v_proj.lora_A.weight`: is missing"),
        (lora(3, &["q_proj", "v_proj"]), "has shape [3, 128], expected [2, 128]"),
        (lora(2, &["q_proj", "v_proj", "k_proj"]), "is not an adapter"),
    ];
    for (cfg, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        base.with_lora(&cfg, 5).unwrap().save_lora_adapter(dir.path()).unwrap();
        std::fs::copy(good.path().join("adapter_config.json"), dir.path().join("adapter_config.json"))
            .unwrap();
        let err = base.with_lora_adapter(dir.path()).unwrap_err().to_string();
        assert!(err.contains("adapter_model.safetensors") && err.contains(want), "{err}");
    }
    let err = base.with_lora_adapter(&good.path().join("nowhere")).unwrap_err().to_string();
    assert!(err.contains("adapter_config.json"), "{err}");
}

#[test]
fn bad_configs_and_misuse_are_errors_naming_the_key() {
    let base = Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap();
    let err = |cfg: LoraConfig| base.with_lora(&cfg, 0).unwrap_err().to_string();
    assert!(err(lora(0, &["q_proj"])).starts_with("lora.rank: is 0"));
    assert!(err(lora(2, &["q_proj", "w_proj"])).starts_with("lora.target_modules[1]: is `w_proj`"));
    // k_proj is 128 -> 64 in the tiny model: rank 64 fits it, 65 does not.
    base.with_lora(&lora(64, &["k_proj"]), 0).unwrap();
    let e = err(lora(65, &["q_proj", "k_proj"]));
    assert!(e.starts_with("lora.rank: is 65, larger than k_proj (64 x 128)"), "{e}");
    let adapted = base.with_lora(&LoraConfig::default(), 0).unwrap();
    let e = adapted.with_lora(&LoraConfig::default(), 0).unwrap_err().to_string();
    assert!(e.contains("already has adapters"), "{e}");
    // A plain model has no adapters to save; an adapted one decodes and loads
    // snapshots only through its merged copy or its base.
    let dir = tempfile::tempdir().unwrap();
    assert!(base.save_lora_adapter(dir.path()).unwrap_err().to_string().contains("LoRA adapters"));
    let mut cache = KvCache::new(&base, 1, 8).unwrap();
    let e = adapted.prefill(&mut cache, 0, &[3, 4]).unwrap_err().to_string();
    assert!(e.contains("Model::merged"), "{e}");
    let snap = base.snapshot(PolicyVersion(0)).unwrap();
    assert!(adapted.load_snapshot(&snap).unwrap_err().to_string().contains("Model::base"));
    adapted.base().load_snapshot(&snap).unwrap();
    assert_eq!(Projection::from_peft_name("gate_proj"), Some(Projection::Gate));
}
