//! Completion-order training equals synchronous training.

use metronome_trainer::loss::Aggregation;

use metronome_model::Device;

use crate::common::{
    config, flat_weights, max_abs_diff, period_batch, period_groups, tiny_model, two_periods, two_periods_on,
};

#[test]
fn two_orders_give_the_same_weights() {
    // Two periods, so the second step also sees moments built from the first.
    let weights: Vec<Vec<f32>> =
        [[0usize, 1, 2, 3], [3, 1, 0, 2]].iter().map(|&order| two_periods(&Device::Cpu, order).0).collect();
    let before = flat_weights(&tiny_model());
    assert!(max_abs_diff(&before, &weights[0]) > 1e-4, "the steps must move the weights");
    let diff = max_abs_diff(&weights[0], &weights[1]);
    assert!(diff <= 1e-6, "orders differ by {diff}");
}

/// With a KL term the policy and reference forwards are scheduled together: side by
/// side on a pool of two threads, in turn on one. Where they run must not change
/// what they compute.
#[test]
fn a_trainer_pool_of_two_threads_gives_the_same_weights() {
    let (one, losses_one) = two_periods_on(&Device::Cpu, [0, 1, 2, 3], 1);
    let (two, losses_two) = two_periods_on(&Device::Cpu, [0, 1, 2, 3], 2);
    let diff = max_abs_diff(&one, &two);
    assert!(diff <= 1e-6, "one and two threads differ by {diff}");
    for (a, b) in losses_one.iter().zip(&losses_two) {
        assert!((a - b).abs() <= 1e-9 * a.abs().max(1.0), "losses {a} vs {b}");
    }
}

#[test]
fn streamed_token_mean_equals_the_whole_batch_computation() {
    let groups = period_groups();
    let mut cfg = config();
    cfg.loss.aggregation = Aggregation::TokenMean;
    // Whole batch: every group in one micro-batch, one forward, one normaliser.
    let mut whole = cfg.build(tiny_model()).unwrap();
    let total = whole.accumulate_sync(&period_batch(whole.version())).unwrap();
    // Streaming: one group per micro-batch; the token total is known only at the end.
    let mut streamed = cfg.build(tiny_model()).unwrap();
    let mut tokens = 0;
    let mut loss_sum = 0.0;
    for g in &groups {
        let r = streamed.accumulate_sync(g).unwrap();
        tokens += r.tokens;
        loss_sum += r.loss_sum;
    }
    assert_eq!(tokens, total.tokens);
    assert!((loss_sum - total.loss_sum).abs() < 1e-5 * total.loss_sum.abs().max(1.0));
    let a = whole.pending_gradients().unwrap().unwrap();
    let b = streamed.pending_gradients().unwrap().unwrap();
    let mut scale = 0f32;
    let mut diff = 0f32;
    for ((name, ga), (_, gb)) in a.iter().zip(&b) {
        let ga: Vec<f32> = ga.flatten_all().unwrap().to_vec1().unwrap();
        let gb: Vec<f32> = gb.flatten_all().unwrap().to_vec1().unwrap();
        scale = ga.iter().fold(scale, |m, x| m.max(x.abs()));
        let d = max_abs_diff(&ga, &gb);
        assert!(d.is_finite(), "{name}");
        diff = diff.max(d);
    }
    assert!(scale > 0.0);
    assert!(diff <= 1e-5 * scale, "gradients differ by {diff} (largest element {scale})");
    let (ra, rb) = (whole.step_sync().unwrap(), streamed.step_sync().unwrap());
    assert_eq!(ra.tokens, rb.tokens);
    assert!((ra.loss - rb.loss).abs() < 1e-6, "{} vs {}", ra.loss, rb.loss);
    assert!((ra.grad_norm - rb.grad_norm).abs() < 1e-5 * ra.grad_norm);
}
