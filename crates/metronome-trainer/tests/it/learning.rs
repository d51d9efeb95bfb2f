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
        SftExample::new(vec![10, 11, 12], vec![40, 41, 42, 2]),
        SftExample::new(vec![13, 14], vec![50, 51, 2]),
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
    let err = t.accumulate_sft(&[SftExample::new(vec![], vec![1])]).unwrap_err().to_string();
    assert!(err.contains("sft example 0"), "{err}");
    // A failed SFT call leaves the trainer free to take RL micro-batches, and the
    // two never share a step.
    let rl =
        crate::common::group_batch_at(0, &[20, 21], &[vec![30, 31], vec![40]], &[1.0, -1.0], t.version());
    t.accumulate_sync(&rl).unwrap();
    let err = t.accumulate_sft(&examples).unwrap_err().to_string();
    assert!(err.contains("call step first"), "{err}");
}

#[test]
fn the_tokens_an_environment_wrote_in_a_demonstration_are_context_not_targets() {
    use metronome_core::TokenSpan;
    // A demonstrated episode: a call (40, 41), the tool's answer (50, 51), the final
    // answer (42) and the stop token.
    let example = SftExample {
        context: vec![TokenSpan { start: 2, len: 2 }],
        ..SftExample::new(vec![10, 11], vec![40, 41, 50, 51, 42, 2])
    };
    let batch = metronome_trainer::sft_batch(std::slice::from_ref(&example)).unwrap();
    // Every answer token is in the row (the last only as a target) ...
    assert_eq!(batch.rows[0].tokens, [10, 11, 40, 41, 50, 51, 42]);
    // ... and only the policy's are targets, each predicted from the token before it.
    assert_eq!(batch.targets.token, [40, 41, 42, 2]);
    assert_eq!(batch.targets.position, [1, 2, 5, 6]);
    assert_eq!(batch.sequences[0].num_targets, 4);
    let mut t = config().build(tiny_model()).unwrap();
    assert_eq!(t.accumulate_sft(&[example]).unwrap().tokens, 4);
    for (context, why) in [
        (TokenSpan { start: 5, len: 2 }, "context span 5..7 beyond its 6-token answer"),
        (TokenSpan { start: u32::MAX, len: 2 }, "beyond its 6-token answer"),
        (TokenSpan { start: 0, len: 6 }, "0 target tokens"),
    ] {
        let bad = SftExample { context: vec![context], ..SftExample::new(vec![1], vec![1, 2, 3, 4, 5, 6]) };
        let err = metronome_trainer::sft_batch(&[bad]).unwrap_err().to_string();
        assert!(err.contains("sft example 0") && err.contains(why), "{err}");
    }
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
