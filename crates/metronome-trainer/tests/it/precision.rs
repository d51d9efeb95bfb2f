//! Mixed precision (`trainer.precision = "bf16"`) and the memory levers
//! (`trainer.chunked_head`, `trainer.gradient_checkpointing`) in whole steps, on the
//! CPU, whose bf16 arithmetic is the GPU's (the model's `precision` tests).

use metronome_core::PolicyVersion;
use metronome_model::{DType, Device, LoraConfig, Model, ModelConfig, Precision};
use metronome_trainer::{GrpoTrainer, TrainerConfig};

use crate::common::{
    flat_weights, max_abs_diff, pending_gradients, period_groups, stamped, tiny_model, two_periods_config,
    two_periods_with,
};

fn bf16(mut cfg: TrainerConfig) -> TrainerConfig {
    cfg.precision = Some(Precision::Bf16);
    cfg
}

/// One period of the four groups, accumulated in `order`.
fn accumulate_period(t: &mut GrpoTrainer, order: [usize; 4]) {
    let groups = period_groups();
    for g in order {
        let v = t.version();
        t.accumulate_sync(&stamped(&groups[g], v)).unwrap();
    }
}

/// Every element of the bf16 compute copy is its f32 master rounded to bf16.
fn assert_scorer_is_rounded_masters(t: &GrpoTrainer, what: &str) {
    let masters =
        if t.policy().lora().is_some() { t.policy().adapter_parameters() } else { t.policy().parameters() };
    let compute =
        if t.scorer().lora().is_some() { t.scorer().adapter_parameters() } else { t.scorer().parameters() };
    assert_eq!(masters.len(), compute.len());
    for ((name, m), (_, c)) in masters.iter().zip(&compute) {
        assert_eq!((m.dtype(), c.dtype()), (DType::F32, DType::BF16), "{what}: {name}");
        let rounded = m.as_tensor().to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let c = c.as_tensor().to_dtype(DType::F32).unwrap();
        let bits = |t: &metronome_model::Tensor| {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&rounded), bits(&c), "{what}: {name} is not its master rounded to bf16");
    }
}

#[test]
fn a_bf16_step_tracks_the_f32_step() {
    let cfg = two_periods_config();
    let mut a = cfg.build(tiny_model()).unwrap();
    let mut b = bf16(cfg.clone()).build(tiny_model()).unwrap();
    assert_eq!((a.precision(), b.precision()), (Precision::F32, Precision::Bf16));
    for t in [&mut a, &mut b] {
        accumulate_period(t, [0, 1, 2, 3]);
    }
    // The step's gradient (normalised, before clipping), relative to its largest magnitude.
    let (ga, gb) = (pending_gradients(&a), pending_gradients(&b));
    let scale = ga.iter().fold(0f32, |m, x| m.max(x.abs()));
    let grad_gap = max_abs_diff(&gb, &ga) / scale;
    let (ra, rb) = (a.step_sync().unwrap(), b.step_sync().unwrap());
    assert!(ra.applied && rb.applied);
    let loss_gap = (ra.loss - rb.loss).abs();
    // AdamW's first step moves every weight by about the learning rate (1e-3) in the
    // direction of its gradient's sign, so a weight whose gradient is near zero may move
    // the other way in bf16; the mean shows the bulk.
    let (wa, wb) = (flat_weights(a.policy()), flat_weights(b.policy()));
    let max = max_abs_diff(&wa, &wb);
    let mean = wa.iter().zip(&wb).map(|(x, y)| f64::from((x - y).abs())).sum::<f64>() / wa.len() as f64;
    let flipped = wa.iter().zip(&wb).filter(|(x, y)| (*x - *y).abs() > 1e-3).count() as f64 / wa.len() as f64;
    eprintln!(
        "bf16 vs f32, one period: gradient {grad_gap:e} of its largest magnitude, loss {loss_gap:e} ({} vs {}), \
         one AdamW step's weights max {max:e}, mean {mean:e}, moved apart by more than the learning rate: {:.2}%",
        ra.loss,
        rb.loss,
        100.0 * flipped
    );
    assert!(grad_gap <= 2e-2, "gradients {grad_gap}");
    assert!(loss_gap <= 1e-3 * ra.loss.abs().max(1.0), "losses {} vs {}", ra.loss, rb.loss);
    assert!(max <= 2.1e-3 && mean <= 2e-5 && flipped <= 5e-3, "weights: max {max}, mean {mean}, {flipped}");
}

#[test]
fn bf16_compute_weights_are_the_rounded_masters_made_once_per_step() {
    let cfg = bf16(two_periods_config());
    let mut t = cfg.build(tiny_model()).unwrap();
    assert_eq!((t.policy().dtype(), t.scorer().dtype()), (DType::F32, DType::BF16));
    assert_scorer_is_rounded_masters(&t, "at construction");
    accumulate_period(&mut t, [0, 1, 2, 3]);
    // Micro-batches do not touch the weights; the step writes the masters, then the copy.
    assert_scorer_is_rounded_masters(&t, "after accumulating");
    let before = flat_weights(t.policy());
    t.step_sync().unwrap();
    assert!(max_abs_diff(&before, &flat_weights(t.policy())) > 1e-4, "the step moved no master weight");
    assert_scorer_is_rounded_masters(&t, "after a step");
    // The reference computes in bf16 too; snapshots and the optimiser state stay f32.
    let snap = t.snapshot_sync().unwrap();
    assert!(snap.tensors.iter().all(|h| matches!(h.data, metronome_core::TensorData::F32(_))));
}

#[test]
fn bf16_training_is_order_invariant_and_resumes_bit_exact() {
    // Gradients are summed in f64 from the bf16 ones, so the order of micro-batches
    // does not change a bit, as in f32.
    let cfg = bf16(two_periods_config());
    let (a, la) = two_periods_with(&Device::Cpu, [0, 1, 2, 3], &cfg);
    let (b, lb) = two_periods_with(&Device::Cpu, [3, 1, 0, 2], &cfg);
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "orders differ");
    assert_eq!(la, lb);
    // A checkpoint mid-period (the reference saved as its bf16 values widened to f32)
    // resumes to the same weights and the same compute copy.
    let groups = period_groups();
    let dir = tempfile::tempdir().unwrap();
    let mut first = cfg.build(tiny_model()).unwrap();
    accumulate_period(&mut first, [0, 1, 2, 3]);
    first.step_sync().unwrap();
    for g in &groups[..2] {
        first.accumulate_sync(&stamped(g, first.version())).unwrap();
    }
    first.save_checkpoint(dir.path()).unwrap();
    let mut resumed = cfg.resume(dir.path(), &Device::Cpu).unwrap();
    assert_scorer_is_rounded_masters(&resumed, "resumed");
    for t in [&mut first, &mut resumed] {
        for g in &groups[2..] {
            t.accumulate_sync(&stamped(g, t.version())).unwrap();
        }
        t.step_sync().unwrap();
    }
    let (wa, wb) = (flat_weights(first.policy()), flat_weights(resumed.policy()));
    assert!(wa.iter().zip(&wb).all(|(x, y)| x.to_bits() == y.to_bits()), "weights differ after resume");
    // The checkpoint's models are f32 files.
    let reloaded = Model::load_hf(&dir.path().join("reference"), &Device::Cpu).unwrap();
    assert_eq!(reloaded.dtype(), DType::F32);
}

#[test]
fn bf16_trains_lora_adapters_on_f32_masters() {
    let mut cfg = bf16(two_periods_config());
    cfg.lora = Some(LoraConfig { rank: 4, alpha: 8.0, ..LoraConfig::default() });
    let mut t = cfg.build(tiny_model()).unwrap();
    assert_eq!(t.scorer().dtype(), DType::BF16);
    assert_scorer_is_rounded_masters(&t, "LoRA at construction");
    let base = flat_weights(&t.policy().base());
    for _ in 0..2 {
        accumulate_period(&mut t, [0, 1, 2, 3]);
        assert!(t.step_sync().unwrap().applied);
    }
    assert_scorer_is_rounded_masters(&t, "LoRA after two steps");
    assert_eq!(base, flat_weights(&t.policy().base()), "the base moved");
    let moved = t.policy().adapter_parameters().iter().any(|(n, v)| {
        n.contains("lora_B")
            && v.as_tensor().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() > 0.0
    });
    assert!(moved, "no adapter trained");
}

/// The train/rollout log-prob gap: behaviour log-probs as an f32 engine records them
/// (the f32 training forward equals the engine's within 1e-5, `tests/tests/behaviour_logprobs.rs`)
/// against a trainer scoring in f32 and in bf16.
#[test]
fn the_train_rollout_gap_of_a_bf16_trainer_is_reported() {
    let gap = |precision: Precision, model: Model| {
        let mut cfg = two_periods_config();
        cfg.precision = Some(precision);
        cfg.loss.kl_coef = 0.0;
        let engine = model.frozen_copy().unwrap();
        let mut t = cfg.build(model).unwrap();
        for g in period_groups() {
            let mut g = stamped(&g, PolicyVersion(0));
            let out = engine.target_logprobs(&g.rows, &g.targets).unwrap();
            g.targets.behaviour_logprob = out.logprobs.to_vec1::<f32>().unwrap();
            t.accumulate_sync(&g).unwrap();
        }
        t.step_sync().unwrap().logprob_gap
    };
    // The tiny model's N(0, 0.02) weights give nearly flat distributions (entropy 4.57
    // nats of ln 99 = 4.60); weights of N(0, 0.1) less flat ones (3.98). Measured mean
    // gaps: 9.6e-4 and 1.6e-2 (SmolLM2-135M's real weights: `examples/precision_gap.rs`
    // of the model crate).
    let peaked = || {
        let m = Model::new(ModelConfig::tiny(), &Device::Cpu, 7).unwrap();
        for (_, v) in m.parameters() {
            if v.rank() == 2 {
                v.set(&(v.as_tensor() * 5.0).unwrap()).unwrap();
            }
        }
        m
    };
    for (what, model) in [("N(0, 0.02)", tiny_model as fn() -> Model), ("N(0, 0.1)", peaked)] {
        let (f32, bf16) = (gap(Precision::F32, model()), gap(Precision::Bf16, model()));
        eprintln!(
            "train/rollout mean |log-prob gap|, {what} weights: f32 trainer {f32:e}, bf16 trainer {bf16:e}"
        );
        assert!(f32 <= 1e-6, "f32 {f32}");
        assert!(bf16 > f32 && bf16 <= 3e-2, "bf16 {bf16}");
    }
}

#[test]
fn the_memory_levers_train_to_the_same_weights() {
    let plain = two_periods_config();
    let (w0, l0) = two_periods_with(&Device::Cpu, [0, 1, 2, 3], &plain);
    // Checkpointing: bitwise the same steps.
    let mut cfg = plain.clone();
    cfg.gradient_checkpointing = true;
    let (w1, l1) = two_periods_with(&Device::Cpu, [0, 1, 2, 3], &cfg);
    assert!(w0.iter().zip(&w1).all(|(x, y)| x.to_bits() == y.to_bits()), "checkpointing changed the weights");
    assert_eq!(l0, l1);
    // The chunked head: the same steps up to the rounding of its sums (AdamW turns a
    // near-zero gradient's rounding into up to a learning rate's step, hence the mean).
    cfg.chunked_head = Some(true);
    let (w2, l2) = two_periods_with(&Device::Cpu, [0, 1, 2, 3], &cfg);
    let mean = w0.iter().zip(&w2).map(|(x, y)| f64::from((x - y).abs())).sum::<f64>() / w0.len() as f64;
    eprintln!(
        "chunked head and checkpointing vs plain, two steps: max {:e}, mean {mean:e}",
        max_abs_diff(&w0, &w2)
    );
    assert!(mean <= 1e-7, "mean {mean}");
    for (a, b) in l0.iter().zip(&l2) {
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "losses {l0:?} vs {l2:?}");
    }
}
