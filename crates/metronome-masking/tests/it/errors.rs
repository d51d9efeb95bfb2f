//! Bad input gets a clear error naming the group and the reason, and packs nothing.

use metronome_masking::{
    LayoutKind, MaskingError, Packer, PackingConfig, pack_period, padded, shared_prompt,
};

use crate::common::{self, PAD};

fn message(e: MaskingError) -> String {
    e.to_string()
}

#[test]
fn zero_length_prompt() {
    let g = common::group(4, 0, &[2, 3]);
    let e = shared_prompt(&g).unwrap_err();
    assert_eq!(e, MaskingError::EmptyPrompt { group: common::key(4) });
    assert_eq!(message(e), "group (period 7, prompt 4) has a zero-length prompt");
    assert!(matches!(padded(&[g], PAD), Err(MaskingError::EmptyPrompt { .. })));
}

#[test]
fn empty_response() {
    let g = common::group(5, 3, &[2, 0, 1]);
    let e = shared_prompt(&g).unwrap_err();
    assert_eq!(e, MaskingError::EmptyResponse { group: common::key(5), sample: 1 });
    assert_eq!(message(e), "group (period 7, prompt 5), completion 1 is an empty response");
}

#[test]
fn no_completions() {
    let g = common::group(6, 3, &[]);
    assert_eq!(message(shared_prompt(&g).unwrap_err()), "group (period 7, prompt 6) has no completions");
}

#[test]
fn logprobs_not_aligned_with_tokens() {
    let mut g = common::group(8, 3, &[2, 4]);
    g.group.completions[1].logprobs.pop();
    let e = shared_prompt(&g).unwrap_err();
    assert_eq!(message(e), "group (period 7, prompt 8), completion 1 has 3 log-probs for 4 tokens");
}

#[test]
fn rewards_or_advantages_not_aligned_with_completions() {
    let mut g = common::group(9, 3, &[2, 4]);
    g.rewards.pop();
    assert_eq!(
        message(shared_prompt(&g).unwrap_err()),
        "group (period 7, prompt 9) has 1 rewards for 2 completions"
    );
    let mut g = common::group(9, 3, &[2, 4]);
    g.advantages.push(0.5);
    assert_eq!(
        message(shared_prompt(&g).unwrap_err()),
        "group (period 7, prompt 9) has 3 advantages for 2 completions"
    );
}

#[test]
fn sample_index_out_of_place() {
    let mut g = common::group(10, 3, &[2, 4]);
    g.group.completions[1].sample_index = 5;
    assert_eq!(
        message(shared_prompt(&g).unwrap_err()),
        "group (period 7, prompt 10), completion 1 has sample_index 5 (expected 1)"
    );
}

#[test]
fn group_over_budget_without_splitting() {
    let config = PackingConfig {
        row_tokens: 16,
        micro_batch_tokens: 16,
        split_oversized_groups: false,
        ..Default::default()
    };
    // 4 + 5 + 5 + 5 = 19 positions in the shared-prompt layout.
    let g = common::group(11, 4, &[5, 5, 5]);
    let e = pack_period(&[g], &config).unwrap_err();
    assert_eq!(
        message(e),
        "group (period 7, prompt 11) needs 19 tokens, over the budget of 16, and splitting over-budget groups is disabled"
    );
}

#[test]
fn response_over_budget_even_when_splitting() {
    let config = PackingConfig { row_tokens: 8, micro_batch_tokens: 8, ..Default::default() };
    let g = common::group(12, 4, &[2, 5]);
    let e = pack_period(&[g], &config).unwrap_err();
    assert_eq!(
        message(e),
        "group (period 7, prompt 12), completion 1 needs 9 tokens with its prompt, over the budget of 8"
    );
}

#[test]
fn padded_group_over_micro_batch_budget() {
    let config = PackingConfig {
        layout: LayoutKind::Padded,
        row_tokens: 8,
        micro_batch_tokens: 16,
        split_oversized_groups: false,
        pad_token: PAD,
        groups_per_pack: 1,
    };
    // Three rows padded to 4 + 3 = 7: 21 positions.
    let g = common::group(13, 4, &[1, 3, 2]);
    assert_eq!(
        pack_period(&[g], &config).unwrap_err(),
        MaskingError::GroupOverBudget { group: common::key(13), tokens: 21, budget: 16 }
    );
}

#[test]
fn bad_config() {
    let e = Packer::new(PackingConfig { row_tokens: 64, micro_batch_tokens: 32, ..Default::default() })
        .unwrap_err();
    assert_eq!(message(e), "packing config field micro_batch_tokens is 32, below row_tokens 64");
    assert!(
        Packer::new(PackingConfig { row_tokens: 1, micro_batch_tokens: 1, ..Default::default() }).is_err()
    );
}

#[test]
fn a_rejected_group_leaves_the_packer_unchanged() {
    let config = PackingConfig { row_tokens: 32, micro_batch_tokens: 32, ..Default::default() };
    let good = [common::group(1, 3, &[2, 2]), common::group(3, 2, &[4])];
    let mut bad = common::group(2, 3, &[1, 2, 3]);
    bad.group.completions[2].logprobs.clear();

    let mut packer = Packer::new(config).unwrap();
    let mut with_bad = packer.push(&good[0]).unwrap();
    assert!(packer.push(&bad).is_err());
    with_bad.extend(packer.push(&good[1]).unwrap());
    with_bad.extend(packer.finish());

    assert_eq!(with_bad, pack_period(&good, &config).unwrap());
}

#[test]
fn converts_to_the_core_error_at_the_stage_boundary() {
    let e: metronome_core::Error = MaskingError::EmptyPrompt { group: common::key(1) }.into();
    assert_eq!(e.to_string(), "masking");
    let chain = metronome_core::ErrorChain(&e).to_string();
    assert_eq!(chain, "masking: group (period 7, prompt 1) has a zero-length prompt");
}
