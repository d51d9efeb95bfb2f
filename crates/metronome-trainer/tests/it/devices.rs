//! The trainer on a CUDA GPU: the same steps as on the CPU. Skipped, with the reason
//! printed, without the `cuda` feature or a GPU (`cargo xtask gpu` runs them on one).

use metronome_model::{Device, DeviceSpec, Model, ModelConfig};
use metronome_trainer::loss::{Aggregation, KlEstimator};

use crate::common::{config, flat_weights, max_abs_diff, period_groups, stamped};

/// GPU 0, or `None` with the reason printed.
fn cuda() -> Option<Device> {
    if !cfg!(feature = "cuda") {
        eprintln!("skipped: built without the `cuda` feature (`cargo xtask gpu` runs this on a GPU)");
        return None;
    }
    DeviceSpec::Cuda(0).open().map_err(|e| eprintln!("skipped: no CUDA device: {e}")).ok()
}

/// Two periods of four groups in `order` (KL term on, so the reference model trains
/// beside the policy), then every weight on the host and the two steps' losses.
fn two_periods(device: &Device, order: [usize; 4]) -> (Vec<f32>, Vec<f64>) {
    let groups = period_groups();
    let mut cfg = config();
    cfg.loss.kl_coef = 0.02;
    cfg.loss.kl_estimator = KlEstimator::K3;
    cfg.loss.aggregation = Aggregation::SeqMeanTokenMean;
    let mut trainer = cfg.build(Model::new(ModelConfig::tiny(), device, 7).unwrap()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..2 {
        for &g in &order {
            let v = trainer.version();
            trainer.accumulate_sync(&stamped(&groups[g], v)).unwrap();
        }
        let report = trainer.step_sync().unwrap();
        assert!(report.applied);
        losses.push(report.loss);
    }
    assert!(trainer.policy().device().same_device(device));
    (flat_weights(trainer.policy()), losses)
}

#[test]
fn cuda_training_is_order_invariant() {
    let Some(gpu) = cuda() else { return };
    let (a, _) = two_periods(&gpu, [0, 1, 2, 3]);
    let (b, _) = two_periods(&gpu, [3, 1, 0, 2]);
    let diff = max_abs_diff(&a, &b);
    assert!(diff <= 1e-6, "orders differ by {diff}");
}

#[test]
fn cuda_steps_match_the_cpu_trainer() {
    let Some(gpu) = cuda() else { return };
    let (g, gl) = two_periods(&gpu, [0, 1, 2, 3]);
    let (c, cl) = two_periods(&Device::Cpu, [0, 1, 2, 3]);
    for (x, y) in gl.iter().zip(&cl) {
        assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "losses {gl:?} vs {cl:?}");
    }
    // AdamW moves each weight by about the learning rate (1e-3) per step whatever the
    // gradient's size, so rounding differences in near-zero gradients show up to that
    // scale in a few weights; the bulk must agree far closer.
    let diff = max_abs_diff(&g, &c);
    let mean = g.iter().zip(&c).map(|(x, y)| f64::from((x - y).abs())).sum::<f64>() / g.len() as f64;
    eprintln!("GPU vs CPU trainer after two steps: max |diff| {diff:e}, mean {mean:e}");
    assert!(diff <= 2e-3 && mean <= 1e-6, "max {diff}, mean {mean}");
}
