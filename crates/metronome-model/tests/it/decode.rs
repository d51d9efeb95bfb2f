//! KV-cache decoding: equal to the full forward, and batch-invariant bitwise.

use metronome_model::{Device, KvCache, Model, ModelConfig};

use crate::common::{fixture, full_logits, max_abs_diff, tokens};

/// Slots with prompts of different lengths decode together; every step's logits
/// equal the full forward's at the same position.
pub(crate) fn decode_matches_full_forward(model: &Model, tol: f32) {
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<u32>> =
        [5usize, 1, 9, 3].iter().enumerate().map(|(i, &n)| tokens(i as u64, n, vocab)).collect();
    let continuations: Vec<Vec<u32>> = (0..4).map(|i| tokens(100 + i, 6, vocab)).collect();
    let mut cache = KvCache::new(model, 6, 32).unwrap();
    // Slots 1, 2, 4, 5: not contiguous, so slot bookkeeping is exercised.
    let slots = [1usize, 2, 4, 5];
    let mut worst = 0.0f32;
    for (i, &s) in slots.iter().enumerate() {
        let last = model.prefill(&mut cache, s, &prompts[i]).unwrap();
        let full = full_logits(model, &prompts[i]);
        worst = worst.max(max_abs_diff(&last, full.last().unwrap()));
        assert_eq!(cache.len(s), prompts[i].len());
    }
    for step in 0..6 {
        // Slot 2 sits out odd steps, so lengths diverge further and batches vary.
        let active: Vec<usize> = (0..4).filter(|&i| !(i == 1 && step % 2 == 1)).collect();
        let batch: Vec<(usize, u32)> = active
            .iter()
            .map(|&i| (slots[i], continuations[i][cache.len(slots[i]) - prompts[i].len()]))
            .collect();
        let out = model.decode_step(&mut cache, &batch).unwrap();
        for (k, &i) in active.iter().enumerate() {
            let mut seq = prompts[i].clone();
            let fed = cache.len(slots[i]) - prompts[i].len();
            seq.extend(&continuations[i][..fed]);
            let full = full_logits(model, &seq);
            worst = worst.max(max_abs_diff(&out[k], full.last().unwrap()));
        }
    }
    assert!(worst < tol, "max |decode - full forward| = {worst}");
}

#[test]
fn kv_cache_decode_equals_full_forward_tiny() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 7).unwrap();
    decode_matches_full_forward(&model, 1e-5);
}

#[test]
fn kv_cache_decode_equals_full_forward_fixture() {
    // The fixture's weights are large (logits up to ~6); still within 1e-5.
    let model = Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap();
    decode_matches_full_forward(&model, 1e-5);
}

/// Prefills `n` slots identically and returns the cache.
fn filled_cache(model: &Model, n: usize) -> KvCache {
    let mut cache = KvCache::new(model, n, 64).unwrap();
    for s in 0..n {
        model.prefill(&mut cache, s, &tokens(s as u64, 1 + s % 11, model.config().vocab_size)).unwrap();
    }
    cache
}

#[test]
fn decode_is_batch_invariant_bitwise() {
    batch_invariance(&Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap().with_trainable(false));
}

/// Slot 3 decoded alone, in a batch of 7 and in one of 64: bitwise the same logits.
fn batch_invariance(model: &Model) {
    let vocab = model.config().vocab_size;
    let mut alone = filled_cache(model, 64);
    let mut seven = filled_cache(model, 64);
    let mut all = filled_cache(model, 64);
    for step in 0..4u64 {
        let tok = |s: usize| tokens(1000 + s as u64 * 10 + step, 1, vocab)[0];
        let a = model.decode_step(&mut alone, &[(3, tok(3))]).unwrap();
        // Slot 3 in the middle of a batch of 7 and of 64, in different orders.
        let b7: Vec<(usize, u32)> = [0usize, 9, 3, 17, 4, 40, 63].iter().map(|&s| (s, tok(s))).collect();
        let b = model.decode_step(&mut seven, &b7).unwrap();
        let b64: Vec<(usize, u32)> = (0..64).rev().map(|s| (s, tok(s))).collect();
        let c = model.decode_step(&mut all, &b64).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a[0]), bits(&b[2]), "step {step}: alone vs batch of 7");
        assert_eq!(bits(&a[0]), bits(&c[63 - 3]), "step {step}: alone vs batch of 64");
        assert_eq!(bits(&b[3]), bits(&c[63 - 17]), "step {step}: slot 17 in 7 vs 64");
    }
}

#[test]
fn prefilling_together_is_bitwise_prefilling_alone() {
    prefill_invariance(ModelConfig::tiny(), false);
}

#[test]
fn prefilling_together_is_bitwise_prefilling_alone_at_smollm2_widths() {
    prefill_invariance(smollm2_widths(), false);
}

/// SmolLM2-135M's layer widths (hidden 576, MLP 1536, 9 query / 3 key-value heads of
/// 64), two layers: inner dimensions above 512, where candle's matmul blocking differs
/// from the tiny model's.
fn smollm2_widths() -> ModelConfig {
    ModelConfig {
        hidden_size: 576,
        intermediate_size: 1536,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        ..ModelConfig::tiny()
    }
}

/// Prefills ragged prompts alone and all together, then decodes a few steps: the
/// logits agree bitwise throughout.
/// With `frozen`, on a frozen copy, which decodes from its decode-layout weights.
fn prefill_invariance(cfg: ModelConfig, frozen: bool) {
    let model = Model::new(cfg, &Device::Cpu, 4).unwrap().with_trainable(false);
    let model = if frozen { model.frozen_copy().unwrap() } else { model };
    let vocab = model.config().vocab_size;
    // Ragged prompts, among them one token and one of 150 (alone, 150 rows; together, 198).
    let prompts: Vec<Vec<u32>> =
        [12usize, 1, 30, 5, 150].iter().enumerate().map(|(i, &n)| tokens(50 + i as u64, n, vocab)).collect();
    let mut alone = KvCache::new(&model, 8, 160).unwrap();
    let mut together = KvCache::new(&model, 8, 160).unwrap();
    let slots = [6usize, 0, 3, 7, 1];
    let firsts: Vec<Vec<f32>> =
        slots.iter().zip(&prompts).map(|(&s, p)| model.prefill(&mut alone, s, p).unwrap()).collect();
    let batch: Vec<(usize, &[u32])> = slots.iter().zip(&prompts).map(|(&s, p)| (s, p.as_slice())).collect();
    let joint = model.prefill_many(&mut together, &batch).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, &s) in slots.iter().enumerate() {
        assert_eq!(bits(&firsts[i]), bits(&joint[i]), "prompt {i}: first logits");
        assert_eq!(together.len(s), prompts[i].len());
    }
    // The caches hold the same keys and values: later decode steps agree bitwise too.
    for step in 0..3u64 {
        let b: Vec<(usize, u32)> =
            slots.iter().map(|&s| (s, tokens(900 + step * 8 + s as u64, 1, vocab)[0])).collect();
        let a = model.decode_step(&mut alone, &b).unwrap();
        let t = model.decode_step(&mut together, &b).unwrap();
        for i in 0..slots.len() {
            assert_eq!(bits(&a[i]), bits(&t[i]), "step {step}, prompt {i}");
        }
    }
    // And both match the full forward.
    let full = full_logits(&model, &prompts[2]);
    assert!(max_abs_diff(&joint[2], full.last().unwrap()) < 1e-5);
    assert!(
        model
            .prefill_many(&mut together, &[(2, &[5][..]), (2, &[6][..])])
            .unwrap_err()
            .to_string()
            .contains("twice")
    );
}

#[test]
fn slots_are_freed_and_reused() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 5).unwrap();
    let vocab = model.config().vocab_size;
    let mut cache = KvCache::new(&model, 2, 16).unwrap();
    let first = model.prefill(&mut cache, 0, &tokens(1, 4, vocab)).unwrap();
    model.decode_step(&mut cache, &[(0, 5)]).unwrap();
    cache.free(0);
    assert_eq!(cache.len(0), 0);
    let again = model.prefill(&mut cache, 0, &tokens(1, 4, vocab)).unwrap();
    assert_eq!(first, again);
}

#[test]
fn bad_decode_requests_are_errors() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 5).unwrap();
    let mut cache = KvCache::new(&model, 2, 4).unwrap();
    assert!(model.prefill(&mut cache, 2, &[5]).unwrap_err().to_string().contains("slot 2"));
    assert!(model.prefill(&mut cache, 0, &[5; 5]).unwrap_err().to_string().contains("max_seq_len"));
    assert!(model.prefill(&mut cache, 0, &[]).is_err());
    assert!(model.prefill(&mut cache, 0, &[10_000]).unwrap_err().to_string().contains("vocabulary"));
    model.prefill(&mut cache, 0, &[5]).unwrap();
    assert!(model.decode_step(&mut cache, &[(0, 5), (0, 6)]).unwrap_err().to_string().contains("twice"));
    assert_eq!(cache.len(0), 1, "a rejected step leaves the cache as it was");
}

#[test]
fn decode_without_batch_invariance_is_close() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 8).unwrap();
    let prompt = tokens(3, 5, model.config().vocab_size);
    let mut on = KvCache::new(&model, 1, 16).unwrap();
    let mut off = KvCache::new(&model, 1, 16).unwrap();
    off.set_batch_invariant(false);
    model.prefill(&mut on, 0, &prompt).unwrap();
    model.prefill(&mut off, 0, &prompt).unwrap();
    for t in [4u32, 9, 17] {
        let a = model.decode_step(&mut on, &[(0, t)]).unwrap();
        let b = model.decode_step(&mut off, &[(0, t)]).unwrap();
        assert!(max_abs_diff(&a[0], &b[0]) < 1e-5);
    }
}

// A frozen copy decodes from its own decode-layout weights (stacked products, no
// padding rows): the same guarantees hold on that path.

#[test]
fn frozen_decode_equals_full_forward() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 7).unwrap();
    decode_matches_full_forward(&model.frozen_copy().unwrap(), 1e-5);
    let fixture = Model::load_hf(&fixture("tiny_qwen2"), &Device::Cpu).unwrap();
    decode_matches_full_forward(&fixture.frozen_copy().unwrap(), 1e-5);
}

#[test]
fn frozen_decode_is_batch_invariant_bitwise() {
    batch_invariance(&Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap().frozen_copy().unwrap());
}

#[test]
fn frozen_prefill_is_batch_invariant_bitwise() {
    prefill_invariance(ModelConfig::tiny(), true);
    prefill_invariance(smollm2_widths(), true);
}

/// Logits of one prompt prefilled alone and then one decode step.
fn two_steps(model: &Model) -> Vec<Vec<f32>> {
    let mut cache = KvCache::new(model, 1, 16).unwrap();
    let prompt = tokens(21, 6, model.config().vocab_size);
    vec![
        model.prefill(&mut cache, 0, &prompt).unwrap(),
        model.decode_step(&mut cache, &[(0, 7)]).unwrap().remove(0),
    ]
}

#[test]
fn frozen_decode_follows_new_weights() {
    let a = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).unwrap();
    let b = Model::new(ModelConfig::tiny(), &Device::Cpu, 2).unwrap();
    let frozen = a.frozen_copy().unwrap();
    let before = two_steps(&frozen);
    assert_eq!(before, two_steps(&a.frozen_copy().unwrap()));
    // Installing a snapshot refreshes the decode layout: the copy decodes as b's would.
    frozen.load_snapshot(&b.snapshot(metronome_core::PolicyVersion(1)).unwrap()).unwrap();
    let after = two_steps(&frozen);
    assert_ne!(after, before);
    assert_eq!(after, two_steps(&b.frozen_copy().unwrap()));
    // Made trainable, it drops that layout: weights written in place (as an optimiser
    // writes them) are what it decodes with.
    let trainable = frozen.with_trainable(true);
    for (_, var) in trainable.parameters() {
        var.set(&(var.as_tensor() * 0.5).unwrap()).unwrap();
    }
    let seq = tokens(21, 6, trainable.config().vocab_size);
    let full = full_logits(&trainable, &seq);
    assert!(max_abs_diff(&two_steps(&trainable)[0], full.last().unwrap()) < 1e-5);
}
