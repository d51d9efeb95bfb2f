//! KV-cache decoding: equal to the full forward, and batch-invariant bitwise.

use metronome_model::draw::{DrawScratch, draw_row};
use metronome_model::{Device, Draw, Kernels, KvCache, Model, ModelConfig, Next, Penalty, Truncation};

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

/// A step that draws its rows gives what drawing them on the host from the step's
/// logits gives: prefills and decode steps of four slots with a greedy row, rows at
/// temperatures 0.7 (top-k and top-p) and 1.0 and a row without a draw (its logits
/// come back), against
/// a twin cache fed the same tokens through `prefill_many`/`decode_step` and
/// `draw::draw_row`. Returns how many drawn tokens had bitwise-equal log-probs, of all.
pub(crate) fn drawing_matches_the_host_reference(model: &Model, logprob_tol: f32) -> (usize, usize) {
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(300 + i, 3 + 2 * i as usize, vocab)).collect();
    let temperature = [Some(0.0), Some(0.7), None, Some(1.0)];
    let draws = |k: u64| -> Vec<Option<Draw<'static>>> {
        temperature
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.map(|temperature| Draw {
                    // Slot 1's draw is truncated: top-k and top-p; slot 3's penalised,
                    // reporting raw log-probs.
                    truncation: if i == 1 {
                        Truncation { top_k: 5, top_p: 0.9, min_p: 0.0 }
                    } else {
                        Truncation::NONE
                    },
                    penalty: (i == 3).then_some(Penalty { factor: 1.5, context: CONTEXTS[0] }),
                    raw_logprob: i == 3,
                    ..Draw::new(temperature, ((k * 7 + i as u64 * 3) % 10) as f64 / 10.0)
                })
            })
            .collect()
    };
    let (mut drawing, mut twin) = (KvCache::new(model, 4, 32).unwrap(), KvCache::new(model, 4, 32).unwrap());
    let seqs: Vec<(usize, &[u32])> = prompts.iter().enumerate().map(|(s, p)| (s, p.as_slice())).collect();
    let mut got = model.prefill_many_drawing(&mut drawing, &seqs, &draws(0)).unwrap();
    let mut want = model.prefill_many(&mut twin, &seqs).unwrap();
    let mut scratch = DrawScratch::default();
    let (mut bitwise, mut total) = (0, 0);
    for k in 0..6u64 {
        let mut fed = Vec::new();
        for (slot, ((next, logits), draw)) in got.iter().zip(&want).zip(draws(k)).enumerate() {
            let token = match (next, draw) {
                (Next::Drawn(d), Some(draw)) => {
                    let host = draw_row(logits, draw, &mut scratch).unwrap();
                    assert_eq!(d.token, host.token, "step {k}, slot {slot}: drawn vs host token");
                    let diff = (d.logprob - host.logprob).abs();
                    assert!(
                        diff <= logprob_tol,
                        "step {k}, slot {slot}: log-prob {} vs {}",
                        d.logprob,
                        host.logprob
                    );
                    bitwise += usize::from(d.logprob.to_bits() == host.logprob.to_bits());
                    total += 1;
                    d.token
                }
                (Next::Logits(l), None) => {
                    assert_eq!(l, logits, "step {k}, slot {slot}: a row without a draw returns its logits");
                    (k as u32 + 5) % vocab as u32
                }
                (other, draw) => panic!("step {k}, slot {slot}: {other:?} for {draw:?}"),
            };
            fed.push((slot, token));
        }
        got = model.decode_step_drawing(&mut drawing, &fed, &draws(k + 1)).unwrap();
        want = model.decode_step(&mut twin, &fed).unwrap();
    }
    (bitwise, total)
}

#[test]
fn drawing_steps_draw_what_the_host_draws_from_their_logits() {
    let base = Model::new(ModelConfig::tiny(), &Device::Cpu, 7).unwrap();
    for model in
        [base.clone(), base.frozen_copy().unwrap(), base.clone().with_kernels(Kernels::Portable).unwrap()]
    {
        let (bitwise, total) = drawing_matches_the_host_reference(&model, 0.0);
        assert_eq!(bitwise, total);
    }
    // Bad draws are refused before the cache moves.
    let mut cache = KvCache::new(&base, 2, 8).unwrap();
    let e = base.decode_step_drawing(&mut cache, &[(0, 3)], &[]).unwrap_err().to_string();
    assert!(e.contains("0 for 1 rows"), "{e}");
    let hot = [Some(Draw::new(f32::NAN, 0.5))];
    let e = base.prefill_many_drawing(&mut cache, &[(0, &[3, 4])], &hot).unwrap_err().to_string();
    assert!(e.contains("draw 0"), "{e}");
    assert_eq!(cache.len(0), 0);
    let e = base.with_kernels(Kernels::Cuda).unwrap_err().to_string();
    assert!(e.contains("CUDA devices only"), "{e}");
}

/// Rows of logits with edge cases and rows of noise, `[rows, vocab]` on `device`:
/// a row without a finite maximum (NaN and `-inf`), one whose only finite logit is the
/// last, one of equal logits (greedy takes the first), then noise at several scales.
pub(crate) fn draw_logits(rows: usize, vocab: usize, device: &Device) -> metronome_model::Tensor {
    let mut v = Vec::with_capacity(rows * vocab);
    for r in 0..rows {
        for i in 0..vocab {
            let noise = (metronome_core::mix64((r as u64) << 32 | i as u64) % 100_000) as f32 / 10_000.0;
            v.push(match r {
                0 => {
                    if i % 2 == 0 {
                        f32::NAN
                    } else {
                        f32::NEG_INFINITY
                    }
                }
                1 => {
                    if i + 1 == vocab {
                        2.5
                    } else {
                        f32::NEG_INFINITY
                    }
                }
                2 => 0.25,
                _ => noise * (r % 4) as f32 - if i % 7 == 0 { f32::INFINITY } else { 0.0 },
            });
        }
    }
    metronome_model::Tensor::from_vec(v, (rows, vocab), device).unwrap()
}

/// The contexts of [`draws_for`]'s penalised rows: repeats, ids past the smaller
/// vocabularies, none at all.
const CONTEXTS: [&[u32]; 3] = [&[0, 1, 1, 2, 7, 7, 7, 98], &[5, 200, 1024, 49_151, 151_935, 200_000, 5], &[]];

/// Draws for [`draw_logits`]' rows: every row drawn, temperatures and uniform numbers
/// varied; from row 3 on every third row truncated (top-k, top-p, min-p, all three);
/// every fourth from row 1 penalised (factors above and below 1, [`CONTEXTS`]); every
/// fifth from row 4 reporting raw log-probs.
pub(crate) fn draws_for(rows: usize) -> Vec<Option<Draw<'static>>> {
    let truncations = [
        Truncation { top_k: 1, ..Truncation::NONE },
        Truncation { top_k: 20, ..Truncation::NONE },
        Truncation { top_p: 0.9, ..Truncation::NONE },
        Truncation { min_p: 0.1, ..Truncation::NONE },
        Truncation { top_k: 50, top_p: 0.95, min_p: 0.01 },
    ];
    (0..rows)
        .map(|r| {
            let temperature = [0.6, 1.0, 0.0, 1.7][r % 4];
            let u = (metronome_core::mix64(r as u64 + 99) >> 11) as f64 / (1u64 << 53) as f64;
            let truncation = if r >= 3 && r % 3 == 0 {
                truncations[(r / 3) % truncations.len()]
            } else {
                Truncation::NONE
            };
            let penalty = (r % 4 == 1)
                .then(|| Penalty { factor: [1.3, 0.7, 2.0][(r / 4) % 3], context: CONTEXTS[(r / 4) % 3] });
            Some(Draw { truncation, penalty, raw_logprob: r % 5 == 4, ..Draw::new(temperature, u) })
        })
        .collect()
}

#[test]
fn kernels_draw_rows_as_the_reference_and_return_rows_without_a_maximum() {
    let logits = draw_logits(12, 300, &Device::Cpu);
    let draws = draws_for(12);
    let fused = Kernels::Fused.next_rows(&logits, &draws).unwrap();
    // Compared as printed: the first row's NaN logits are equal there, not under `==`.
    let portable = Kernels::Portable.next_rows(&logits, &draws).unwrap();
    assert_eq!(format!("{fused:?}"), format!("{portable:?}"));
    assert!(matches!(&fused[0], Next::Logits(l) if l.len() == 300), "a row of NaN and -inf goes to the host");
    assert!(matches!(fused[1], Next::Drawn(d) if d.token == 299 && d.logprob == 0.0));
    assert!(matches!(fused[2], Next::Drawn(d) if d.token == 0), "greedy takes the first of equal logits");
    let bf16 = logits.to_dtype(metronome_model::DType::BF16).unwrap();
    assert_eq!(Kernels::Portable.next_rows(&bf16, &draws).unwrap().len(), 12);
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

/// A prompt's samples prefilled together (pairs of empty slots with the same tokens,
/// computed once and copied) give each slot what prefilling it alone gives: the same
/// logits, and caches from which later decode steps agree bitwise. A pair extending a
/// filled slot with the same tokens is not a copy of one filling an empty slot.
fn shared_prompt_prefill(cfg: ModelConfig, frozen: bool) {
    let model = Model::new(cfg, &Device::Cpu, 9).unwrap().with_trainable(false);
    let model = if frozen { model.frozen_copy().unwrap() } else { model };
    let vocab = model.config().vocab_size;
    let a = tokens(70, 9, vocab);
    let b = tokens(71, 4, vocab);
    let mut alone = KvCache::new(&model, 8, 32).unwrap();
    let mut together = KvCache::new(&model, 8, 32).unwrap();
    // Slot 5 already holds a prefix; it then takes `a` as a continuation.
    for cache in [&mut alone, &mut together] {
        model.prefill(cache, 5, &b).unwrap();
    }
    let c = tokens(72, 1, vocab);
    let (a, b, c) = (a.as_slice(), b.as_slice(), c.as_slice());
    let batch = [(3, a), (0, b), (7, a), (5, a), (1, a), (2, b), (6, c)];
    let firsts: Vec<Vec<f32>> =
        batch.iter().map(|&(s, t)| model.prefill(&mut alone, s, t).unwrap()).collect();
    let joint = model.prefill_many(&mut together, &batch).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, &(s, _)) in batch.iter().enumerate() {
        assert_eq!(bits(&firsts[i]), bits(&joint[i]), "pair {i}: first logits");
        assert_eq!(together.len(s), alone.len(s), "pair {i}: cached length");
    }
    assert_ne!(bits(&joint[3]), bits(&joint[0]), "slot 5 extends its own prefix");
    // Different tokens per slot from here on: each copied cache is read on its own.
    for step in 0..3u64 {
        let d: Vec<(usize, u32)> =
            batch.iter().map(|&(s, _)| (s, tokens(500 + step * 8 + s as u64, 1, vocab)[0])).collect();
        let x = model.decode_step(&mut alone, &d).unwrap();
        let y = model.decode_step(&mut together, &d).unwrap();
        for i in 0..d.len() {
            assert_eq!(bits(&x[i]), bits(&y[i]), "step {step}, pair {i}");
        }
    }
}

#[test]
fn shared_prompts_prefill_as_alone() {
    shared_prompt_prefill(ModelConfig::tiny(), false);
}

#[test]
fn shared_prompts_prefill_as_alone_frozen() {
    shared_prompt_prefill(smollm2_widths(), true);
}

/// The same sequences through caches laid out three ways: one block per slot (the
/// layout before paging), the default blocks of `KV_BLOCK`, and blocks of 3 positions
/// taken as slots grow (so a slot's blocks interleave with its neighbours'), with a slot
/// freed and refilled midway so that freed blocks are reused out of order. Every
/// prefill's and decode step's logits are bitwise the same in all three.
pub(crate) fn paged_equals_contiguous(model: &Model) {
    let vocab = model.config().vocab_size;
    let (slots, max_len) = (5, 64);
    let prompts: Vec<Vec<u32>> =
        [12usize, 1, 30, 5, 17].iter().enumerate().map(|(i, &n)| tokens(80 + i as u64, n, vocab)).collect();
    let refill = tokens(90, 7, vocab);
    let mut caches = [
        KvCache::paged(model, slots, max_len, max_len, slots).unwrap(),
        KvCache::new(model, slots, max_len).unwrap(),
        KvCache::paged(model, slots, max_len, 3, slots * max_len.div_ceil(3)).unwrap(),
    ];
    assert_eq!(caches.each_ref().map(KvCache::block_size), [max_len, metronome_model::KV_BLOCK, 3]);
    let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    let order = [3usize, 0, 2, 4, 1];
    let batch: Vec<(usize, &[u32])> = order.iter().zip(&prompts).map(|(&s, p)| (s, p.as_slice())).collect();
    let firsts: Vec<_> = caches.iter_mut().map(|c| bits(&model.prefill_many(c, &batch).unwrap())).collect();
    assert!(firsts.windows(2).all(|w| w[0] == w[1]), "prefill logits differ between layouts");
    for step in 0..8u64 {
        if step == 4 {
            for c in &mut caches {
                c.free(0);
                model.prefill(c, 0, &refill).unwrap();
            }
        }
        let d: Vec<(usize, u32)> =
            (0..slots).map(|s| (s, tokens(700 + step * 8 + s as u64, 1, vocab)[0])).collect();
        let out: Vec<_> = caches.iter_mut().map(|c| bits(&model.decode_step(c, &d).unwrap())).collect();
        assert!(out.windows(2).all(|w| w[0] == w[1]), "step {step}: logits differ between layouts");
    }
    for s in 0..slots {
        assert!(caches.iter().all(|c| c.len(s) == caches[0].len(s)), "slot {s}: lengths differ");
    }
}

#[test]
fn paged_cache_decodes_as_contiguous() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 11).unwrap().with_trainable(false);
    paged_equals_contiguous(&model);
    // The portable kernels (a GPU's arithmetic): the prefix gathered through the tables.
    paged_equals_contiguous(&model.with_kernels(Kernels::Portable).unwrap());
    let wide = Model::new(smollm2_widths(), &Device::Cpu, 11).unwrap().with_trainable(false);
    paged_equals_contiguous(&wide.frozen_copy().unwrap());
}

/// A row spread over more blocks than the decode attention lists on the stack (64):
/// one-position blocks and a 90-token prompt decode bitwise as the contiguous cache
/// does, on the fused op and on a frozen model's host path.
#[test]
fn a_row_over_more_blocks_than_the_stack_list_holds_decodes_as_contiguous() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 12).unwrap().with_trainable(false);
    let frozen = model.frozen_copy().unwrap();
    let vocab = model.config().vocab_size;
    let (prompt, other) = (tokens(60, 90, vocab), tokens(61, 3, vocab));
    for m in [&model, &frozen] {
        let bits = |v: Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut caches = [KvCache::paged(m, 2, 100, 1, 200).unwrap(), KvCache::new(m, 2, 100).unwrap()];
        let logits: Vec<_> = caches
            .iter_mut()
            .map(|c| {
                m.prefill_many(c, &[(0, &prompt[..]), (1, &other[..])]).unwrap();
                (0..4u32)
                    .map(|t| bits(m.decode_step(c, &[(0, 5 + t), (1, 9 + t)]).unwrap()))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(logits[0], logits[1], "one-position blocks decode differently");
    }
}

/// A pool smaller than every slot at its longest serves what fits, refuses a step that
/// does not fit before anything is written (naming the shortfall), and serves it once
/// a freed slot has given its blocks back, with the logits of a cache that never ran
/// short.
#[test]
fn a_short_pool_refuses_a_step_whole_and_serves_it_after_a_free() {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 12).unwrap().with_trainable(false);
    let vocab = model.config().vocab_size;
    // Four slots of up to 32 tokens, 20 positions in all (five blocks of four).
    let mut short = KvCache::paged(&model, 4, 32, 4, 5).unwrap();
    let mut whole = KvCache::new(&model, 4, 32).unwrap();
    let (a, b) = (tokens(31, 12, vocab), tokens(32, 8, vocab));
    for c in [&mut short, &mut whole] {
        model.prefill_many(c, &[(0, &a[..]), (1, &b[..])]).unwrap();
    }
    assert_eq!(short.free_blocks(), 0);
    // Slot 0's 13th token needs a fourth block: refused, nothing taken or cached.
    let err = model.decode_step(&mut short, &[(0, 5), (1, 6)]).unwrap_err().to_string();
    assert!(err.contains("out of blocks") && err.contains("needs 2 more"), "{err}");
    assert_eq!((short.len(0), short.len(1), short.free_blocks()), (12, 8, 0));
    assert!(model.prefill(&mut short, 2, &[3]).unwrap_err().to_string().contains("out of blocks"));
    short.free(1);
    whole.free(1);
    assert_eq!(short.free_blocks(), 2);
    for t in [5u32, 9, 4, 1] {
        let x = model.decode_step(&mut short, &[(0, t)]).unwrap();
        let y = model.decode_step(&mut whole, &[(0, t)]).unwrap();
        assert_eq!(x, y);
    }
    assert_eq!((short.len(0), short.free_blocks()), (16, 1));
    // Impossible pools are errors, not panics.
    for (block, blocks) in [(0, 4), (4, 0), (usize::MAX, 2)] {
        let err = KvCache::paged(&model, 4, 32, block, blocks).unwrap_err().to_string();
        assert!(err.contains("kv cache"), "{block} x {blocks}: {err}");
    }
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

/// A frozen model's decode step computes in buffers its cache keeps, its plan and
/// rotary tables included: after the first step it allocates a few small things per
/// step (the list of pairs, the logits, here one `Vec` per row of `decode_step`'s
/// answer) and none per layer (the attention lists a row's blocks on the stack and
/// keeps its probabilities with the thread), not a tensor per op. Measured: 17
/// allocations per step of 8 slots at 2 layers and at 6; with per-call attention lists
/// 27, and 5 per layer; with a fresh plan and tables per step 46 and 7; with a candle
/// tensor per op 266 and 105.
#[test]
fn a_frozen_decode_step_allocates_a_few_buffers_whatever_its_width() {
    let per_step = |layers: usize| {
        let cfg = ModelConfig { num_hidden_layers: layers, ..ModelConfig::tiny() };
        let model = Model::new(cfg, &Device::Cpu, 5).unwrap().frozen_copy().unwrap();
        let vocab = model.config().vocab_size;
        let mut cache = KvCache::new(&model, 8, 64).unwrap();
        let prompts: Vec<Vec<u32>> = (0..8).map(|s| tokens(s, 4 + s as usize, vocab)).collect();
        let pairs: Vec<(usize, &[u32])> = prompts.iter().enumerate().map(|(s, p)| (s, &p[..])).collect();
        model.prefill_many(&mut cache, &pairs).unwrap();
        let step = |cache: &mut KvCache, t: u32| {
            let batch: Vec<(usize, u32)> = (0..8).map(|s| (s, 3 + (t + s as u32) % 50)).collect();
            let mut logits = Vec::new();
            let n = allocation_counter::measure(|| logits = model.decode_step(cache, &batch).unwrap());
            assert_eq!(logits.len(), 8);
            n.count_total
        };
        step(&mut cache, 0);
        (1..5).map(|t| step(&mut cache, t)).max().unwrap()
    };
    let (two, six) = (per_step(2), per_step(6));
    eprintln!("allocations per decode step of 8 slots: {two} at 2 layers, {six} at 6");
    assert!(two <= 20, "{two} allocations in a decode step of a 2-layer model");
    assert!(six <= two, "{} allocations per layer", six.saturating_sub(two) / 4);
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

/// Under the fused kernels (whose frozen copies decode from host weights in decode
/// layout) and the portable ones (from stacked products on the device).
#[test]
fn frozen_decode_follows_new_weights() {
    for kernels in [Kernels::Fused, Kernels::Portable] {
        frozen_decode_follows_new_weights_under(kernels);
    }
}

fn frozen_decode_follows_new_weights_under(kernels: Kernels) {
    let a = Model::new(ModelConfig::tiny(), &Device::Cpu, 1).unwrap().with_kernels(kernels).unwrap();
    let b = Model::new(ModelConfig::tiny(), &Device::Cpu, 2).unwrap().with_kernels(kernels).unwrap();
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

/// A bf16 copy decodes (generation in bf16): its cache is bf16 (half the bytes), its
/// portable kernels keep the norms' statistics and the attention's softmax in f32,
/// and its decode steps' logits are as close to the f32 model's as its own full
/// forward is (bf16 rounding, not a decode error); its greedy tokens are printed.
#[test]
fn a_bf16_copy_decodes_as_close_to_f32_as_its_full_forward() {
    let f32_model = Model::load_hf(&fixture("tiny_llama"), &Device::Cpu).unwrap();
    let bf16 = f32_model.frozen_copy().unwrap().compute_copy(metronome_model::DType::BF16).unwrap();
    assert_eq!(bf16.kernels(), Kernels::Portable);
    let vocab = f32_model.config().vocab_size;
    let prompt = tokens(5, 7, vocab);
    let mut cache = KvCache::new(&bf16, 2, 32).unwrap();
    assert_eq!(
        KvCache::bytes(&bf16, 2, 32).unwrap() * 2,
        KvCache::bytes(&f32_model, 2, 32).unwrap(),
        "a bf16 cache holds half the bytes"
    );
    let mut logits = bf16.prefill(&mut cache, 0, &prompt).unwrap();
    let mut seq = prompt.clone();
    let (mut decode, mut full, mut scale, mut same) = (0.0f32, 0.0f32, 0.0f32, 0);
    let steps = 12;
    let argmax = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
    for _ in 0..steps {
        let reference = full_logits(&f32_model, &seq).pop().unwrap();
        let own = full_logits(&bf16, &seq).pop().unwrap();
        decode = decode.max(max_abs_diff(&logits, &reference));
        full = full.max(max_abs_diff(&own, &reference));
        scale = scale.max(reference.iter().fold(0.0f32, |m, x| m.max(x.abs())));
        let next = argmax(&reference);
        same += usize::from(argmax(&logits) == next);
        seq.push(next);
        logits = bf16.decode_step(&mut cache, &[(0, next)]).unwrap().remove(0);
    }
    eprintln!(
        "against the f32 full forward (max |logit| {scale}): bf16 decode max |diff| {decode}, bf16 full forward \
         {full}; greedy tokens equal {same}/{steps}"
    );
    assert!(decode <= 1.5 * full + 1e-3, "bf16 decode {decode} vs bf16 full forward {full}");
    assert!(full < 0.1 * scale, "bf16 full forward {full} at max |logit| {scale}");
}
