//! `rollout.kv_cache_tokens`: a worker's slots share a paged KV-cache pool, and the
//! worker admits a response only while the pool holds its prompt and budget beside
//! those it runs. The tokens are those of an unbounded cache; what runs at once is not.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use metronome_core::{Group, PeriodId, PolicyVersion, RunSeed};
use metronome_rollout::{Batching, Engine, EngineConfig, SamplingConfig, Submission};

use crate::common::{Watch, Watched, prompts, sampling, signature, tiny_model, tokenizer};

/// The most rows any decode step had.
#[derive(Clone, Default)]
struct Widest(Arc<AtomicUsize>);

impl Watch for Widest {
    fn before_decode(&self, rows: usize) {
        self.0.fetch_max(rows, Ordering::SeqCst);
    }
}

const MAX_SEQ_LEN: usize = 64;

fn sampled() -> SamplingConfig {
    // Stops on common characters, so lengths differ and slots refill mid-batch.
    let mut s = sampling(24);
    s.stop_token_ids = Some(vec![2, 4, 40, 70]);
    s
}

/// Eight prompts' groups of four from one worker of eight slots with a pool of
/// `tokens` positions (`None`: every slot's room); the groups and the widest decode step.
async fn run(tokens: Option<usize>, batching: Batching) -> (Vec<Group>, usize) {
    let widest = Widest::default();
    let model = Watched { model: tiny_model(7), watch: widest.clone() };
    let config = EngineConfig {
        workers: 1,
        threads_per_worker: Some(1),
        max_num_seqs: 8,
        max_seq_len: MAX_SEQ_LEN,
        kv_cache_tokens: tokens,
        batching,
        sampling: sampled(),
        ..EngineConfig::default()
    };
    let engine = Engine::new(model, PolicyVersion(0), tokenizer(), config).unwrap().with_seed(RunSeed(42));
    let sub = Submission {
        period: PeriodId(1),
        prompts: prompts(8),
        group_size: 4,
        sampling: sampled(),
        seed: RunSeed(42),
    };
    let groups = engine.generate_groups(sub).await.unwrap();
    (groups, widest.0.load(Ordering::SeqCst))
}

/// The most responses a pool of `blocks` blocks of 16 runs at once: as many of the
/// smallest reservations (prompt and 24 new tokens, in blocks; four responses a prompt)
/// as fit.
fn most_at_once(blocks: usize) -> usize {
    let mut need: Vec<usize> =
        prompts(8).iter().flat_map(|p| [(p.tokens.len() + 24).div_ceil(16); 4]).collect();
    need.sort_unstable();
    need.iter()
        .scan(0, |sum, n| {
            *sum += n;
            Some(*sum)
        })
        .take_while(|&sum| sum <= blocks)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_pool_runs_fewer_responses_at_once_and_samples_the_same_tokens() {
    let (base, all) = run(None, Batching::Continuous).await;
    assert_eq!(base.len(), 8);
    assert_eq!(all, 8, "an unbounded cache decodes every slot at once");
    for tokens in [MAX_SEQ_LEN, 160] {
        let at_most = most_at_once(tokens / 16);
        assert!(at_most < 8);
        let (groups, widest) = run(Some(tokens), Batching::Continuous).await;
        assert_eq!(signature(&groups), signature(&base), "pool of {tokens}: other tokens");
        assert!(
            (1..=at_most).contains(&widest),
            "pool of {tokens}: {widest} responses at once (at most {at_most})"
        );
    }
    // Padded static batching reserves every slot's longest: one response per batch.
    let (groups, widest) = run(Some(MAX_SEQ_LEN), Batching::StaticPadded).await;
    assert_eq!(signature(&groups), signature(&base), "padded static: other tokens");
    assert_eq!(widest, 1);
}

#[test]
fn pools_that_cannot_hold_a_sequence_or_exceed_every_slot_are_refused() {
    let config = |tokens| EngineConfig {
        max_num_seqs: 4,
        max_seq_len: 64,
        kv_cache_tokens: Some(tokens),
        ..EngineConfig::default()
    };
    for tokens in [63, 257] {
        let e = config(tokens).validate().unwrap_err().to_string();
        assert!(e.starts_with(&format!("config field `kv_cache_tokens` is {tokens}")), "{e}");
        assert!(e.contains("max_seq_len 64") && e.contains("256"), "{e}");
    }
    for tokens in [64, 256] {
        config(tokens).validate().unwrap();
    }
}

/// A pool beyond the machine's memory is refused when the engine is built, naming
/// `kv_cache_tokens`, before anything is allocated.
#[test]
fn a_pool_beyond_the_machines_memory_is_refused_before_allocation() {
    let config = EngineConfig {
        workers: metronome_rollout::MAX_WORKERS,
        threads_per_worker: Some(1),
        max_num_seqs: metronome_rollout::MAX_NUM_SEQS,
        max_seq_len: 1024,
        kv_cache_tokens: Some(metronome_rollout::MAX_NUM_SEQS * 1024),
        ..EngineConfig::default()
    };
    let Err(e) = Engine::new(tiny_model(7), PolicyVersion(0), tokenizer(), config) else {
        panic!("an engine with 1024 pools of 64M positions was built");
    };
    let e = e.to_string();
    assert!(
        e.starts_with("config field `kv_cache_tokens` is 67108864: 1024 worker(s) x 67108864 positions"),
        "{e}"
    );
    assert!(e.contains("available"), "{e}");
}
