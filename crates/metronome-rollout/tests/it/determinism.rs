//! The same seed gives token-identical outputs whatever the worker and slot layout.

use metronome_core::{PeriodId, RolloutRequest};
use metronome_rollout::{Batching, EngineConfig, SamplingConfig, model_engine};

use crate::common::{by_prompt, engine, prompts, sampling, signature, tiny_model, tokenizer};

fn request() -> RolloutRequest {
    RolloutRequest { period: PeriodId(3), prompts: prompts(6), group_size: 4 }
}

async fn run(workers: usize, slots: usize, sampling: SamplingConfig) -> Vec<metronome_core::Group> {
    let e = engine(workers, slots, sampling);
    let sub = metronome_rollout::Submission {
        period: PeriodId(3),
        prompts: request().prompts,
        group_size: 4,
        sampling: e.config().sampling.clone(),
        seed: metronome_core::RunSeed(e.config().seed),
    };
    e.generate_groups(sub).await.expect("generate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_seed_same_tokens_across_layouts() {
    // Stop on a few common characters too, so lengths differ and slots refill mid-batch.
    let mut s = sampling(24);
    s.stop_token_ids = Some(vec![2, 4, 40, 70]);
    let one_by_one = run(1, 1, s.clone()).await;
    let one_by_eight = run(1, 8, s.clone()).await;
    let two_by_four = run(2, 4, s.clone()).await;
    let base = signature(&one_by_one);
    assert_eq!(base.len(), 24);
    assert_eq!(base, signature(&one_by_eight), "1x1 vs 1x8");
    assert_eq!(base, signature(&two_by_four), "1x1 vs 2x4");
    // Lengths differ, so slots were refilled mid-batch in the multi-slot layouts.
    let lengths: Vec<usize> =
        by_prompt(one_by_one).iter().flat_map(|g| g.completions.iter().map(|c| c.tokens.len())).collect();
    assert!(lengths.iter().min() < lengths.iter().max(), "lengths {lengths:?}");
    for g in &two_by_four {
        g.validate().unwrap();
        assert_eq!(g.period, PeriodId(3));
        assert!(g.timing.started_s <= g.timing.finished_s);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_and_truncated_sampling_are_layout_independent_too() {
    let s = SamplingConfig {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.02,
        repetition_penalty: 1.2,
        ..sampling(16)
    };
    assert_eq!(signature(&run(1, 1, s.clone()).await), signature(&run(2, 4, s).await));
    let g = SamplingConfig::greedy();
    let g = SamplingConfig { max_new_tokens: 16, ..g };
    assert_eq!(signature(&run(1, 1, g.clone()).await), signature(&run(1, 8, g).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_batching_gives_the_same_tokens() {
    let s = sampling(16);
    let cfg = EngineConfig {
        workers: 1,
        max_num_seqs: 4,
        max_seq_len: 128,
        seed: 42,
        batching: Batching::Static,
        sampling: s.clone(),
        ..EngineConfig::default()
    };
    let e = model_engine(tiny_model(7), metronome_core::PolicyVersion(0), tokenizer(), cfg).unwrap();
    let sink = metronome_rollout::CollectSink::default();
    metronome_core::RolloutEngine::generate(&e, request(), &sink).await.unwrap();
    assert_eq!(signature(&sink.into_groups()), signature(&run(1, 1, s).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_of_a_group_differ() {
    let groups = run(1, 8, sampling(16)).await;
    // Within a group, the G responses use different streams.
    let g = &by_prompt(groups)[0];
    assert_ne!(g.completions[0].tokens, g.completions[1].tokens);
}

/// A frozen copy (what pipeline workers decode with) keeps its weights in decode
/// layout; its tokens are layout-independent too, with two threads per worker as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_copies_are_layout_independent_too() {
    let mut s = sampling(24);
    s.stop_token_ids = Some(vec![2, 4, 40, 70]);
    let run = |workers: usize, slots: usize, threads: usize| {
        let cfg = EngineConfig {
            workers,
            threads_per_worker: threads,
            max_num_seqs: slots,
            max_seq_len: 128,
            seed: 42,
            sampling: s.clone(),
            ..EngineConfig::default()
        };
        let model = tiny_model(7).frozen_copy().expect("frozen copy");
        let e = model_engine(model, metronome_core::PolicyVersion(0), tokenizer(), cfg).expect("engine");
        let sub = metronome_rollout::Submission {
            period: PeriodId(3),
            prompts: prompts(16),
            group_size: 4,
            sampling: s.clone(),
            seed: metronome_core::RunSeed(42),
        };
        async move { e.generate_groups(sub).await.expect("generate") }
    };
    let base = signature(&run(1, 1, 1).await);
    assert_eq!(base.len(), 64);
    assert_eq!(base, signature(&run(1, 64, 2).await), "1x1 vs 1x64 on two threads");
    assert_eq!(base, signature(&run(2, 4, 1).await), "1x1 vs 2x4");
}
