//! The trainer learns: GRPO moves log-probs in the advantage's direction, SFT lowers
//! its loss.

use metronome_core::Trainer;
use metronome_model::Model;
use metronome_trainer::SftExample;

use crate::common::{config, group_batch, stamped, tiny_model};

fn response_logprob(model: &Model, batch: &metronome_core::TrainBatch, seq: u32) -> f64 {
    let out = model.target_logprobs(&batch.rows, &batch.targets).unwrap();
    let lp: Vec<f32> = out.logprobs.detach().to_vec1().unwrap();
    lp.iter().zip(&batch.targets.sequence).filter(|(_, s)| **s == seq).map(|(l, _)| f64::from(*l)).sum()
}

#[test]
fn positive_advantage_responses_rise_and_negative_ones_fall() {
    let prompt = [20, 21, 22, 23];
    let responses = vec![vec![30, 31, 32], vec![40, 41, 42], vec![50, 51], vec![60, 61, 62, 63]];
    let batch = group_batch(0, &prompt, &responses, &[1.0, -1.0, 1.0, -1.0]);
    let mut t = config().build(tiny_model()).unwrap();
    let before: Vec<f64> = (0..4).map(|s| response_logprob(t.policy(), &batch, s)).collect();
    let rt = tokio_free_block_on(async {
        for _ in 0..5 {
            // Through the async trait, as the pipeline drives it.
            let v = t.version();
            t.accumulate(stamped(&batch, v)).await.unwrap();
            let r = t.step().await.unwrap();
            assert!(r.applied);
        }
        t.snapshot().await.unwrap()
    });
    assert_eq!(rt.version.0, 5);
    let after: Vec<f64> = (0..4).map(|s| response_logprob(t.policy(), &batch, s)).collect();
    for s in 0..4 {
        if s % 2 == 0 {
            assert!(after[s] > before[s] + 0.1, "response {s}: {} -> {}", before[s], after[s]);
        } else {
            assert!(after[s] < before[s] - 0.1, "response {s}: {} -> {}", before[s], after[s]);
        }
    }
}

#[test]
fn sft_steps_lower_the_sft_loss() {
    let examples = vec![
        SftExample { prompt: vec![10, 11, 12], answer: vec![40, 41, 42, 2] },
        SftExample { prompt: vec![13, 14], answer: vec![50, 51, 2] },
    ];
    let mut t = config().build(tiny_model()).unwrap();
    let before = t.sft_loss(&examples).unwrap();
    for _ in 0..5 {
        t.accumulate_sft(&examples).unwrap();
        let r = t.step_sync().unwrap();
        assert!(r.applied && r.tokens == 7);
    }
    let after = t.sft_loss(&examples).unwrap();
    assert!(after < before - 0.5, "sft loss {before} -> {after}");
    let err = t.accumulate_sft(&[SftExample { prompt: vec![], answer: vec![1] }]).unwrap_err().to_string();
    assert!(err.contains("sft example 0"), "{err}");
    // A failed SFT call leaves the trainer free to take RL micro-batches, and the
    // two never share a step.
    let rl =
        crate::common::group_batch_at(0, &[20, 21], &[vec![30, 31], vec![40]], &[1.0, -1.0], t.version());
    t.accumulate_sync(&rl).unwrap();
    let err = t.accumulate_sft(&examples).unwrap_err().to_string();
    assert!(err.contains("call step first"), "{err}");
}

/// A minimal executor: the trainer's futures never wait on I/O, so polling once with a
/// no-op waker completes them.
fn tokio_free_block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}
