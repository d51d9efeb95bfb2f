//! The same seed gives token-identical outputs whatever the worker and slot layout.

use metronome_core::Tokenizer;
use metronome_core::{PeriodId, RolloutRequest};
use metronome_rollout::{Batching, EngineConfig, ModelEngine, SamplingConfig, model_engine};

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
        seed: e.seed(),
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

/// An engine of one worker with `slots` slots in `batching` mode.
fn batching_engine(batching: Batching, slots: usize, max_seq_len: usize, s: &SamplingConfig) -> ModelEngine {
    let cfg = EngineConfig {
        workers: 1,
        max_num_seqs: slots,
        max_seq_len,
        batching,
        sampling: s.clone(),
        ..EngineConfig::default()
    };
    model_engine(
        tiny_model(7),
        metronome_core::PolicyVersion(0),
        tokenizer(),
        cfg,
        metronome_core::RunSeed(42),
    )
    .unwrap()
}

/// Row-skipping and padded static batching give the tokens of continuous batching;
/// padded static computes every slot in every step, row-skipping static only the live ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_batching_gives_the_same_tokens() {
    // Stop tokens make lengths differ, so batches have finished rows to pad.
    let mut s = sampling(16);
    s.stop_token_ids = Some(vec![2, 4, 40, 70]);
    let base = signature(&run(1, 1, s.clone()).await);
    let mut stats = Vec::new();
    for batching in [Batching::Continuous, Batching::Static, Batching::StaticPadded] {
        let e = batching_engine(batching, 4, 128, &s);
        let sink = metronome_rollout::CollectSink::default();
        metronome_core::RolloutEngine::generate(&e, request(), &sink).await.unwrap();
        assert_eq!(signature(&sink.into_groups()), base, "{batching:?}");
        stats.push(e.worker_stats()[0]);
    }
    let [cont, stat, padded] = stats[..] else { unreachable!() };
    assert_eq!(cont.padding_rows, 0);
    assert_eq!(stat.padding_rows, 0);
    // The same schedule: padded static decodes the live rows of static plus its padding,
    // and 24 sequences in batches of 4 keep all 4 slots in every step.
    assert!(padded.padding_rows > 0, "{padded:?}");
    assert_eq!(padded.decode_steps, stat.decode_steps);
    assert_eq!(padded.decode_rows - padded.padding_rows, stat.decode_rows);
    assert_eq!(padded.decode_rows, 4 * padded.decode_steps);
    assert!(stat.decode_rows < 4 * stat.decode_steps, "{stat:?}");
}

/// A padding row whose KV-cache slot is full leaves the forward instead of failing the
/// step: a long prompt ends at `max_seq_len` while a short one goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_padding_row_leaves_the_forward() {
    let long_text = "1234567890 + 1234567890 = ";
    let long = metronome_core::Prompt {
        id: metronome_core::PromptId(7),
        tokens: metronome_model::CharTokenizer.encode(long_text).unwrap(),
        text: long_text.into(),
        ..metronome_core::Prompt::default()
    };
    let short = prompts(1)[0].clone();
    let max_seq_len = long.tokens.len() + 6;
    // The long prompt's budget is 6 tokens (its slot fills), the short one's 24.
    let s = SamplingConfig { max_new_tokens: 24, ignore_eos: true, ..SamplingConfig::default() };
    assert!(short.tokens.len() + 24 <= max_seq_len, "the short prompt must outlive the long one");
    let sub = metronome_rollout::Submission {
        period: PeriodId(3),
        prompts: vec![long, short],
        group_size: 1,
        sampling: s.clone(),
        seed: metronome_core::RunSeed(42),
    };
    let mut outs = Vec::new();
    for batching in [Batching::Continuous, Batching::StaticPadded] {
        let e = batching_engine(batching, 2, max_seq_len, &s);
        outs.push(signature(&e.generate_groups(sub.clone()).await.expect("generate")));
        if batching == Batching::StaticPadded {
            let stats = e.worker_stats()[0];
            // The long response ends after 5 decode steps with its slot one row short
            // of full: one padding row fills it, then it leaves the forward while the
            // short response runs its 23 decode steps.
            assert_eq!(stats.padding_rows, 1, "{stats:?}");
            assert_eq!(stats.decode_steps, 23);
        }
    }
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0][0].2.len(), 6);
    assert_eq!(outs[0][1].2.len(), 24);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_of_a_group_differ() {
    let groups = run(1, 8, sampling(16)).await;
    // Within a group, the G responses use different streams.
    let g = &by_prompt(groups)[0];
    assert_ne!(g.completions[0].tokens, g.completions[1].tokens);
}

/// A frozen copy (what pipeline workers decode with) keeps its weights in decode
/// layout; its tokens are layout-independent too, with two threads per worker as well,
/// and under both static modes (padding rows go through the SIMD decode kernel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_copies_are_layout_independent_too() {
    let mut s = sampling(24);
    s.stop_token_ids = Some(vec![2, 4, 40, 70]);
    let run = |workers: usize, slots: usize, threads: usize, batching: Batching| {
        let cfg = EngineConfig {
            workers,
            threads_per_worker: Some(threads),
            batching,
            max_num_seqs: slots,
            max_seq_len: 128,
            sampling: s.clone(),
            ..EngineConfig::default()
        };
        let model = tiny_model(7).frozen_copy().expect("frozen copy");
        let e = model_engine(
            model,
            metronome_core::PolicyVersion(0),
            tokenizer(),
            cfg,
            metronome_core::RunSeed(42),
        )
        .expect("engine");
        let sub = metronome_rollout::Submission {
            period: PeriodId(3),
            prompts: prompts(16),
            group_size: 4,
            sampling: s.clone(),
            seed: metronome_core::RunSeed(42),
        };
        async move { e.generate_groups(sub).await.expect("generate") }
    };
    let base = signature(&run(1, 1, 1, Batching::Continuous).await);
    assert_eq!(base.len(), 64);
    assert_eq!(base, signature(&run(1, 64, 2, Batching::Continuous).await), "1x1 vs 1x64 on two threads");
    assert_eq!(base, signature(&run(2, 4, 1, Batching::Continuous).await), "1x1 vs 2x4");
    assert_eq!(base, signature(&run(1, 16, 1, Batching::Static).await), "1x1 vs 1x16 static");
    assert_eq!(base, signature(&run(1, 16, 2, Batching::StaticPadded).await), "1x1 vs 1x16 padded static");
}

/// With a repetition penalty and raw log-probs every token is drawn by the model's
/// decode step, which reads the penalty's context (the prompt and the response so far)
/// from the engine: each completion is bitwise what the host's sampler gives from the
/// model's logits of the whole context at every position, with that context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_penalised_draw_in_the_step_reads_the_whole_context() {
    use metronome_core::{PolicyVersion, sample_seed};
    use metronome_rollout::{InferenceModel, LogprobsMode, Sampler, TokenRng};

    for logprobs in [LogprobsMode::Sampled, LogprobsMode::Raw] {
        let s = SamplingConfig {
            temperature: 0.9,
            repetition_penalty: 1.8,
            top_k: 30,
            logprobs,
            ignore_eos: true,
            ..sampling(12)
        };
        let e = engine(1, 4, s.clone());
        let groups = run(1, 4, s.clone()).await;
        let model = crate::common::tiny_model(7);
        let mut sampler = Sampler::new();
        let mut checked = 0;
        for g in &groups {
            for c in &g.completions {
                let seed = sample_seed(e.seed(), PolicyVersion(0), g.prompt.id, c.sample_index);
                let rng = TokenRng::new(seed);
                let mut context = g.prompt.tokens.clone();
                for (k, (&token, &logprob)) in c.tokens.iter().zip(&c.logprobs).enumerate() {
                    let mut cache = InferenceModel::new_cache(&model, 1, 128).unwrap();
                    let logits = InferenceModel::prefill_many(&model, &mut cache, &[(0, &context)], &[None])
                        .unwrap()
                        .remove(0)
                        .into_logits()
                        .unwrap();
                    let host = sampler.sample(&s, &logits, &context, rng.uniform(k as u64)).unwrap();
                    assert_eq!(
                        (token, logprob.to_bits()),
                        (host.token, host.logprob.to_bits()),
                        "{logprobs:?}, prompt {:?} sample {} token {k}",
                        g.prompt.id,
                        c.sample_index
                    );
                    context.push(token);
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 24 * 12, "{logprobs:?}");
    }
}
