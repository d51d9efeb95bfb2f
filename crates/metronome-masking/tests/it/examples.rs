//! Worked examples with every number written out by hand.

use metronome_core::{ScoredGroup, Segment};
use metronome_masking::{
    Layout, LayoutKind, PackingConfig, dense_additive_mask, pack_period, padded, shared_prompt,
};

use crate::common::{self, Origin, PAD, token};

fn p(g: u32, index: u32) -> u32 {
    token(Origin { group: g, response: None, index })
}

fn r(g: u32, response: u32, index: u32) -> u32 {
    token(Origin { group: g, response: Some(response), index })
}

/// `groups` in the default layout, packed into rows of `row_tokens` and micro-batches
/// of `micro_batch_tokens` positions.
fn pack(groups: &[ScoredGroup], row_tokens: usize, micro_batch_tokens: usize) -> Vec<Layout> {
    let config = PackingConfig { row_tokens, micro_batch_tokens, ..Default::default() };
    pack_period(groups, &config).unwrap()
}

#[test]
fn shared_prompt_of_three_prompt_tokens_and_two_responses() {
    let g = common::group(1, 3, &[2, 1]);
    let l = shared_prompt(&g).unwrap();
    let row = &l.batch.rows[0];
    assert_eq!(row.tokens, vec![p(1, 0), p(1, 1), p(1, 2), r(1, 0, 0), r(1, 0, 1), r(1, 1, 0)]);
    assert_eq!(row.positions, vec![0, 1, 2, 3, 4, 3]);
    assert_eq!(
        row.segments,
        vec![
            Segment { start: 0, len: 3, parent: None },
            Segment { start: 3, len: 2, parent: Some(0) },
            Segment { start: 5, len: 1, parent: Some(0) },
        ]
    );
    let t = &l.batch.targets;
    // Position 2 (the last prompt token) predicts both first tokens.
    assert_eq!(t.position, vec![2, 3, 2]);
    assert_eq!(t.token, vec![r(1, 0, 0), r(1, 0, 1), r(1, 1, 0)]);
    assert_eq!(t.sequence, vec![0, 0, 1]);
    assert_eq!(t.row, vec![0, 0, 0]);
    // Rewards 0, 1 with the group-mean estimator: advantages −0.5, 0.5.
    assert_eq!(t.advantage, vec![-0.5, -0.5, 0.5]);
    assert_eq!(l.loss_mask()[0].to_vec(), vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    assert_eq!(l.prediction_weights()[0].to_vec(), vec![0.0, 0.0, 2.0, 1.0, 0.0, 0.0]);
    let m = dense_additive_mask(row);
    let ninf = f32::NEG_INFINITY;
    assert_eq!(m.row(5).to_vec(), vec![0.0, 0.0, 0.0, ninf, ninf, 0.0]);
    assert_eq!(m.row(4).to_vec(), vec![0.0, 0.0, 0.0, 0.0, 0.0, ninf]);
    // Separate rows: 2·3 + 3 = 9 tokens; shared: 6. Bound (G−1)P/(G(P+L̄)) = 3/9.
    assert_eq!((l.account.separate, l.account.positions()), (9, 6));
    assert!((l.account.bound() - 1.0 / 3.0).abs() < 1e-12);
    let g0 = l.batch.groups[0];
    assert_eq!((g0.key, g0.num_sequences, g0.group_size, g0.all_equal), (common::key(1), 2, 2, false));
}

#[test]
fn padded_rows_of_the_same_group() {
    let g = common::group(1, 3, &[2, 1]);
    let l = padded(&[g], PAD).unwrap();
    let rows = &l.batch.rows;
    assert_eq!(rows[0].tokens, vec![p(1, 0), p(1, 1), p(1, 2), r(1, 0, 0), r(1, 0, 1)]);
    assert_eq!(rows[1].tokens, vec![p(1, 0), p(1, 1), p(1, 2), r(1, 1, 0), PAD]);
    assert_eq!(rows[1].positions, vec![0, 1, 2, 3, 4]);
    assert_eq!(
        rows[1].segments,
        vec![Segment { start: 0, len: 4, parent: None }, Segment { start: 4, len: 1, parent: None }]
    );
    assert_eq!(l.batch.targets.row, vec![0, 0, 1]);
    assert_eq!(l.batch.targets.position, vec![2, 3, 2]);
    assert_eq!(l.loss_mask()[1].to_vec(), vec![0.0, 0.0, 0.0, 1.0, 0.0]);
    assert_eq!((l.account.separate, l.account.positions(), l.account.pad_tokens), (9, 10, 1));
    assert!(l.account.realised() < 0.0);
}

#[test]
fn packing_groups_side_by_side_and_into_micro_batches() {
    // Trees of 3+2+1 = 6, 2+2 = 4 and 4+3+3 = 10 positions; rows of 10, micro-batches of 10.
    let groups = [common::group(1, 3, &[2, 1]), common::group(2, 2, &[2]), common::group(3, 4, &[3, 3])];
    let layouts = pack(&groups, 10, 10);
    assert_eq!(layouts.len(), 2);
    let row = &layouts[0].batch.rows[0];
    assert_eq!(row.len(), 10);
    assert_eq!(row.positions, vec![0, 1, 2, 3, 4, 3, 0, 1, 2, 3]);
    // The second group is a root of its own: block-diagonal.
    assert_eq!(row.segments[3], Segment { start: 6, len: 2, parent: None });
    assert_eq!(row.segments[4], Segment { start: 8, len: 2, parent: Some(3) });
    assert!(!row.can_attend(8, 5));
    assert_eq!(layouts[0].batch.targets.position, vec![2, 3, 2, 7, 8]);
    assert_eq!(layouts[1].batch.groups[0].key, common::key(3));
}

#[test]
fn an_over_budget_group_is_split_with_its_prompt_repeated() {
    // P = 4, responses 3, 3, 3, 3: the tree needs 16 positions, rows hold 11.
    let g = common::group(1, 4, &[3, 3, 3, 3]);
    let layouts = pack(std::slice::from_ref(&g), 11, 11);
    assert_eq!(layouts.len(), 2);
    for l in &layouts {
        assert_eq!(l.batch.num_positions(), 10);
        assert_eq!(l.batch.groups[0].num_sequences, 2);
        assert_eq!(l.batch.groups[0].group_size, 4);
    }
    assert_eq!(layouts[1].batch.sequences[0].sample_index, 2);
    let total: metronome_masking::TokenAccount = layouts.iter().map(|l| l.account).sum();
    // Separate 4·7 = 28; ideal 16; laid out 20: the bound is 12/28, realised 8/28.
    assert_eq!((total.separate, total.ideal, total.positions()), (28, 16, 20));
    assert_eq!(total.repeated_prompt_tokens(), 4);
    assert!((total.bound() - 12.0 / 28.0).abs() < 1e-12);
    assert!((total.realised() - 8.0 / 28.0).abs() < 1e-12);
}

#[test]
fn split_parts_that_share_a_micro_batch_share_one_group_entry() {
    // Rows of 11 and micro-batches of 22: both parts land in one micro-batch, two rows.
    let g = common::group(1, 4, &[3, 3, 3, 3]);
    let layouts = pack(std::slice::from_ref(&g), 11, 22);
    assert_eq!(layouts.len(), 1);
    let b = &layouts[0].batch;
    assert_eq!(b.rows.len(), 2);
    assert_eq!(b.groups.len(), 1);
    assert_eq!(b.groups[0].num_sequences, 4);
    assert!(b.sequences.iter().all(|s| s.group == 0));
}

#[test]
fn padded_micro_batches_count_their_pads() {
    let groups = [common::group(1, 2, &[1, 3]), common::group(2, 2, &[1])];
    let config = PackingConfig {
        layout: LayoutKind::Padded,
        row_tokens: 8,
        micro_batch_tokens: 12,
        split_oversized_groups: false,
        pad_token: PAD,
        groups_per_pack: 1,
    };
    // Group 1: 2 rows × 5 = 10; adding group 2 would make 3 × 5 = 15 > 12.
    let layouts = pack_period(&groups, &config).unwrap();
    assert_eq!(layouts.len(), 2);
    assert_eq!(layouts[0].account.pad_tokens, 2);
    assert_eq!(layouts[1].batch.rows[0].len(), 3);
    assert_eq!(layouts[1].account.pad_tokens, 0);
}

#[test]
fn a_group_one_token_over_the_row_goes_to_a_new_row_of_the_same_micro_batch() {
    // Trees of 6 and 5 positions; rows of 10, micro-batches of 20: two rows, one batch.
    let groups = [common::group(1, 3, &[2, 1]), common::group(2, 2, &[3])];
    let layouts = pack(&groups, 10, 20);
    assert_eq!(layouts.len(), 1);
    let rows: Vec<usize> = layouts[0].batch.rows.iter().map(|r| r.len()).collect();
    assert_eq!(rows, vec![6, 5]);
    assert_eq!(layouts[0].batch.targets.row, vec![0, 0, 0, 1, 1, 1]);
}
