//! A prompt the engine cannot generate from becomes a rejected group through the
//! `RolloutEngine` contract (the pipeline's path), and an error through `submit`
//! (the server's path, which answers its client).

use metronome_core::ErrorChain;
use metronome_core::{FinishReason, PeriodId, Prompt, PromptId, RolloutEngine, RolloutRequest, RunSeed};
use metronome_rollout::{CollectSink, Submission};

use crate::common::{by_prompt, engine, prompts, sampling, signature};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_prompts_become_rejected_groups_and_the_rest_generate_as_without_them() {
    let good = prompts(3);
    let too_long =
        Prompt { id: PromptId(7), tokens: vec![5; 128], text: "x".repeat(128), ..Prompt::default() };
    let empty = Prompt { id: PromptId(8), text: String::new(), ..Prompt::default() };
    let mut mixed = good.clone();
    mixed.insert(1, too_long);
    mixed.push(empty);

    let e = engine(1, 4, sampling(6));
    let request = |prompts| RolloutRequest { period: PeriodId(2), prompts, group_size: 3 };
    let sink = CollectSink::default();
    e.generate(request(mixed.clone()), &sink).await.expect("a bad prompt does not fail the request");
    let groups = by_prompt(sink.into_groups());
    assert_eq!(groups.len(), 5);
    let rejected: Vec<u64> = groups.iter().filter(|g| g.is_rejected()).map(|g| g.prompt.id.0).collect();
    assert_eq!(rejected, [7, 8]);
    for g in groups.iter().filter(|g| g.is_rejected()) {
        g.validate().unwrap();
        assert_eq!(g.key().period, PeriodId(2));
        assert_eq!(g.completions.len(), 3);
        assert!(
            g.completions
                .iter()
                .all(|c| c.tokens.is_empty() && c.finish_reason == FinishReason::PromptRejected)
        );
    }
    // The good prompts' groups are those of a request without the bad ones.
    let alone = CollectSink::default();
    engine(1, 4, sampling(6)).generate(request(good.clone()), &alone).await.unwrap();
    let kept: Vec<_> = groups.into_iter().filter(|g| !g.is_rejected()).collect();
    assert_eq!(signature(&kept), signature(&by_prompt(alone.into_groups())));

    // The server's path refuses the whole submission, naming the prompt.
    let sub = Submission {
        period: PeriodId(0),
        prompts: mixed,
        group_size: 1,
        sampling: sampling(6),
        seed: RunSeed(42),
    };
    let err = ErrorChain(&e.generate_groups(sub).await.unwrap_err()).to_string();
    assert!(err.contains("prompt 7") && err.contains("max_seq_len 128"), "{err}");
}
