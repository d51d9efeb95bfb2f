//! Stop tokens, stop strings and the token budget end sequences with the right reason.

use metronome_core::ErrorChain;
use metronome_core::{FinishReason, PeriodId, RunSeed, Tokenizer};
use metronome_model::CharTokenizer;
use metronome_rollout::{SamplingConfig, Submission};

use crate::common::{engine, prompts, sampling};

async fn generate(s: SamplingConfig) -> Vec<metronome_core::Completion> {
    let e = engine(1, 8, s.clone());
    let sub =
        Submission { period: PeriodId(0), prompts: prompts(6), group_size: 4, sampling: s, seed: RunSeed(9) };
    e.generate_groups(sub).await.unwrap().into_iter().flat_map(|g| g.completions).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_tokens_end_with_stop_and_are_kept() {
    let stops = vec![2, 10, 20, 30, 40, 50, 60, 70, 80, 90];
    let max = 40;
    let s = SamplingConfig { stop_token_ids: Some(stops.clone()), ..sampling(max) };
    let mut stopped = 0;
    for c in generate(s).await {
        let (last, before) = c.tokens.split_last().unwrap();
        assert!(before.iter().all(|t| !stops.contains(t)), "{:?} continued past a stop token", c.tokens);
        match c.finish_reason {
            FinishReason::Stop => {
                assert!(stops.contains(last));
                stopped += 1;
            }
            FinishReason::Length => assert_eq!(c.tokens.len(), max),
            other => panic!("unexpected finish {other:?}"),
        }
        assert_eq!(c.logprobs.len(), c.tokens.len());
        assert!(c.logprobs.iter().all(|&l| l.is_finite() && l <= 0.0));
    }
    assert!(stopped > 0, "no sequence hit a stop token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_with_stop_string_and_are_cut_from_the_text() {
    let strings: Vec<String> = ["e", "7", " ", "Q", "x"].map(str::to_owned).to_vec();
    for include in [false, true] {
        let s = SamplingConfig {
            stop_strings: strings.clone(),
            include_stop_str_in_output: include,
            ignore_eos: true,
            ..sampling(40)
        };
        let mut hits = 0;
        for c in generate(s).await {
            let full = CharTokenizer.decode(&c.tokens).unwrap();
            match c.finish_reason {
                FinishReason::StopString => {
                    hits += 1;
                    let last = full.chars().last().unwrap().to_string();
                    assert!(strings.contains(&last), "{full:?} does not end in a stop string");
                    let expected =
                        if include { full.clone() } else { full[..full.len() - last.len()].to_owned() };
                    assert_eq!(c.text, expected);
                }
                FinishReason::Length => assert_eq!(c.tokens.len(), 40),
                other => panic!("unexpected finish {other:?}"),
            }
            let body = &full[..full.len().saturating_sub(1)];
            assert!(
                strings.iter().all(|s| !body.contains(s.as_str())),
                "{full:?} continued past a stop string"
            );
        }
        assert!(hits > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_budget_ends_with_length() {
    let s = SamplingConfig { ignore_eos: true, ..sampling(5) };
    for c in generate(s).await {
        assert_eq!(c.finish_reason, FinishReason::Length);
        assert_eq!(c.tokens.len(), 5);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_submissions_are_errors_not_hangs() {
    let e = engine(1, 2, sampling(4));
    let mut long = prompts(1);
    long[0].tokens = vec![5; 200];
    let sub = Submission { prompts: long, group_size: 2, sampling: sampling(4), ..Submission::default() };
    let err = ErrorChain(&e.generate_groups(sub).await.unwrap_err()).to_string();
    assert!(err.contains("prompt 100") && err.contains("max_seq_len 128"), "{err}");
    let mut empty = prompts(1);
    empty[0].tokens.clear();
    let sub = Submission { prompts: empty, group_size: 2, sampling: sampling(4), ..Submission::default() };
    assert!(ErrorChain(&e.generate_groups(sub).await.unwrap_err()).to_string().contains("has no tokens"));
    let sub =
        Submission { prompts: prompts(1), group_size: 0, sampling: sampling(4), ..Submission::default() };
    assert!(ErrorChain(&e.generate_groups(sub).await.unwrap_err()).to_string().contains("group_size"));
    // A token outside the vocabulary fails in the model and is reported, not panicked on.
    let mut bad = prompts(1);
    bad[0].tokens = vec![5, 5000];
    let sub = Submission { prompts: bad, group_size: 2, sampling: sampling(4), ..Submission::default() };
    assert!(e.generate_groups(sub).await.is_err());
    // The engine still works afterwards.
    let sub =
        Submission { prompts: prompts(2), group_size: 2, sampling: sampling(4), ..Submission::default() };
    assert_eq!(e.generate_groups(sub).await.unwrap().len(), 2);
}
