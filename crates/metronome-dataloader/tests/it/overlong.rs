//! Prompts over the token limit: skipped and counted, or rejected by name.

use std::collections::BTreeSet;
use std::sync::Arc;

use metronome_core::RunSeed;
use metronome_dataloader::{OverlongPolicy, PromptConfig, PromptLoader};

use crate::common::{Numbered, drain, ids, release, tokenizer};

fn prompt(max: usize, policy: OverlongPolicy) -> PromptConfig {
    PromptConfig { max_tokens: Some(max), on_overlong: policy, ..PromptConfig::default() }
}

/// 20 prompts, of which 3, 11 and 17 have 40 tokens, limited to 16 tokens by `policy`.
fn loader(batch_size: usize, epochs: u64, policy: OverlongPolicy) -> PromptLoader {
    let dataset = Arc::new(Numbered { len: 20, long: vec![3, 11, 17], long_len: 40 });
    let release = release(batch_size, Some(epochs));
    PromptLoader::new(dataset, tokenizer(), RunSeed(2), release, prompt(16, policy)).unwrap()
}

#[tokio::test]
async fn overlong_prompts_are_skipped_every_epoch_and_counted() {
    let mut l = loader(6, 2, OverlongPolicy::Skip);
    let batches = drain(&mut l, usize::MAX).await;
    let flat: Vec<u64> = batches.iter().flat_map(ids).collect();
    assert_eq!(flat.len(), 2 * 17);
    for epoch in flat.chunks(17) {
        let seen: BTreeSet<u64> = epoch.iter().copied().collect();
        let expected: BTreeSet<u64> = (0..20).filter(|i| ![3, 11, 17].contains(i)).collect();
        assert_eq!(seen, expected);
    }
    assert!(batches.iter().flat_map(|b| &b.prompts).all(|p| p.tokens.len() <= 16));
    assert_eq!(l.stats().skipped_too_long, 6);
    // Batches stay full although prompts were skipped: only the last one is short.
    assert!(batches[..batches.len() - 1].iter().all(|b| b.prompts.len() == 6));
}

#[tokio::test]
async fn overlong_prompt_is_rejected_with_its_id_and_place() {
    let mut l = loader(20, 1, OverlongPolicy::Reject);
    let err = l.next().await.unwrap_err().to_string();
    assert!(err.contains("has 40 tokens, more than the maximum of 16"), "{err}");
    assert!(
        ["3 (numbered item 3)", "11 (numbered item 11)", "17 (numbered item 17)"]
            .iter()
            .any(|s| err.contains(s)),
        "{err}"
    );
    // The cursor did not move: the same error again, not a silently shortened epoch.
    let again = l.next().await.unwrap_err().to_string();
    assert_eq!(err, again);
}

#[tokio::test]
async fn a_limit_nothing_fits_is_an_error_not_a_hang() {
    let mut l = PromptLoader::new(
        Numbered::dataset(5),
        tokenizer(),
        RunSeed(0),
        release(2, None),
        prompt(3, OverlongPolicy::Skip),
    )
    .unwrap();
    let err = l.next().await.unwrap_err().to_string();
    assert_eq!(err, "none of the 5 prompts of the dataset fits within 3 tokens");
}
