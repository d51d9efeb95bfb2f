//! The trainer on a CUDA GPU: the same steps as on the CPU. Skipped, with the reason
//! printed, without the `cuda` feature or a GPU (`cargo xtask gpu` runs them on one).

use metronome_model::{Device, DeviceSpec};

use crate::common::{max_abs_diff, two_periods, two_periods_config, two_periods_with};

/// GPU 0, or `None` with the reason printed.
fn cuda() -> Option<Device> {
    if !cfg!(feature = "cuda") {
        eprintln!("skipped: built without the `cuda` feature (`cargo xtask gpu` runs this on a GPU)");
        return None;
    }
    DeviceSpec::Cuda(0).open().map_err(|e| eprintln!("skipped: no CUDA device: {e}")).ok()
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

/// The trainer as a GPU runs it by default: bf16 compute on f32 masters, the chunked
/// head; order-invariant as in f32, and within bf16's distance of the CPU's f32 steps.
#[test]
fn cuda_default_bf16_steps_track_the_cpu_f32_trainer() {
    let Some(gpu) = cuda() else { return };
    let mut cfg = two_periods_config();
    (cfg.precision, cfg.chunked_head) = (None, None);
    let (g, gl) = two_periods_with(&gpu, [0, 1, 2, 3], &cfg);
    let (h, _) = two_periods_with(&gpu, [3, 1, 0, 2], &cfg);
    assert!(max_abs_diff(&g, &h) <= 1e-6, "bf16 orders differ by {}", max_abs_diff(&g, &h));
    let (c, cl) = two_periods(&Device::Cpu, [0, 1, 2, 3]);
    let diff = max_abs_diff(&g, &c);
    let mean = g.iter().zip(&c).map(|(x, y)| f64::from((x - y).abs())).sum::<f64>() / g.len() as f64;
    eprintln!(
        "GPU bf16 vs CPU f32 trainer after two steps: max |diff| {diff:e}, mean {mean:e}, losses {gl:?} vs {cl:?}"
    );
    // Two AdamW steps move a weight by at most about twice the learning rate.
    assert!(diff <= 4.1e-3 && mean <= 4e-5, "max {diff}, mean {mean}");
}

#[test]
fn cuda_checkpointed_steps_equal_the_plain_ones() {
    let Some(gpu) = cuda() else { return };
    let mut cfg = two_periods_config();
    let (a, _) = two_periods_with(&gpu, [0, 1, 2, 3], &cfg);
    cfg.gradient_checkpointing = true;
    let (b, _) = two_periods_with(&gpu, [0, 1, 2, 3], &cfg);
    assert!(
        max_abs_diff(&a, &b) <= 1e-6,
        "checkpointing changed the GPU's steps by {}",
        max_abs_diff(&a, &b)
    );
}
