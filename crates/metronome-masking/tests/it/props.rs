//! Property tests over random prompt lengths, response lengths, group sizes and budgets.
//!
//! The expectations come from the token ids alone (see `common`): a token knows which
//! prompt or response it belongs to, so what a position *should* see is the context of
//! separate decoding, computed without the layout code.

use std::collections::BTreeMap;

use metronome_core::ScoredGroup;
use metronome_masking::{
    Layout, LayoutKind, MaskingError, PackingConfig, attention_mask, dense_additive_mask, pack_period,
    padded, saving_bound, shared_prompt,
};
use proptest::prelude::*;

use crate::common::{self, Origin, PAD, origin};

/// Checks every promise a layout makes, against the groups it was built from (by id).
fn check_layout(layout: &Layout, groups: &BTreeMap<u32, ScoredGroup>) {
    let batch = &layout.batch;
    batch.validate().expect("a valid batch");
    let prompt_len = |g: u32| groups[&g].group.prompt.tokens.len() as u32;
    let loss_mask = layout.loss_mask();
    let weights = layout.prediction_weights();
    let mut masked = Vec::new();
    for (r, row) in batch.rows.iter().enumerate() {
        let dense = dense_additive_mask(row);
        let boolean = attention_mask(row);
        let first_pad = row.tokens.iter().position(|&t| t == PAD).unwrap_or(row.len());
        for q in 0..row.len() {
            for k in 0..row.len() {
                let reference = row.can_attend(q, k);
                assert_eq!(boolean[[q, k]], reference, "row {r}: attention_mask({q}, {k})");
                assert_eq!(dense[[q, k]] == 0.0, reference, "row {r}: additive mask ({q}, {k})");
                assert!(dense[[q, k]] == 0.0 || dense[[q, k]] == f32::NEG_INFINITY);
            }
            let seen = common::visible(row, q, |q, k| row.can_attend(q, k));
            match origin(row.tokens[q]) {
                // A pad sees earlier pads of its run and nothing else.
                None => {
                    assert!(q >= first_pad, "row {r}: pad at {q} before real tokens end");
                    assert!(seen.iter().all(|&(_, t)| t == PAD), "row {r}: pad at {q} sees a real token");
                    assert_eq!(seen.len(), q - first_pad + 1, "row {r}: pad at {q}");
                }
                Some(o) => {
                    let expected = common::expected_context(o, prompt_len(o.group));
                    assert_eq!(seen, expected, "row {r}, position {q} ({o:?}) sees the wrong context");
                    assert_eq!(
                        row.positions[q],
                        expected.last().unwrap().0,
                        "row {r}: rotary position of {q}"
                    );
                    // The loss mask covers exactly the response tokens.
                    let is_response = o.response.is_some();
                    assert_eq!(
                        loss_mask[r][q],
                        if is_response { 1.0 } else { 0.0 },
                        "row {r}: loss mask at {q}"
                    );
                    if is_response {
                        masked.push(o);
                    }
                }
            }
            if origin(row.tokens[q]).is_none() {
                assert_eq!(loss_mask[r][q], 0.0);
            }
        }
    }

    // Targets: each is predicted by the position that holds the token before it in
    // separate decoding (the last prompt token for a first response token).
    let t = &batch.targets;
    let mut targeted = Vec::new();
    let mut predicted = vec![Vec::new(); batch.rows.len()];
    for (r, row) in batch.rows.iter().enumerate() {
        predicted[r] = vec![0.0f32; row.len()];
    }
    for i in 0..t.len() {
        let (r, q) = (t.row[i] as usize, t.position[i] as usize);
        let target = origin(t.token[i]).expect("a target is a content token");
        let resp = target.response.expect("a target is a response token");
        let before = if target.index == 0 {
            Origin { group: target.group, response: None, index: prompt_len(target.group) - 1 }
        } else {
            Origin { index: target.index - 1, ..target }
        };
        assert_eq!(
            origin(batch.rows[r].tokens[q]),
            Some(before),
            "target {i} predicted from the wrong position"
        );
        let g = &groups[&target.group];
        assert_eq!(t.behaviour_logprob[i], common::behaviour_logprob(t.token[i]), "target {i} log-prob");
        assert_eq!(t.advantage[i], g.advantages[resp as usize], "target {i} advantage");
        let seq = batch.sequences[t.sequence[i] as usize];
        assert_eq!(seq.sample_index, resp, "target {i} sequence");
        assert_eq!(seq.advantage, g.advantages[resp as usize]);
        assert_eq!(batch.groups[seq.group as usize].key, common::key(target.group));
        predicted[r][q] += 1.0;
        targeted.push(target);
    }
    for (r, w) in weights.iter().enumerate() {
        assert_eq!(w.to_vec(), predicted[r], "row {r}: prediction weights");
    }
    masked.sort();
    targeted.sort();
    assert_eq!(masked, targeted, "loss-masked tokens and targets differ");
    targeted.dedup();
    assert_eq!(targeted.len(), t.len(), "a response token is targeted twice");

    // Spans point at their responses.
    assert_eq!(layout.spans.len(), batch.sequences.len());
    for (s, span) in layout.spans.iter().enumerate() {
        assert_eq!(span.sequence as usize, s);
        assert_eq!(span.len, batch.sequences[s].num_targets);
        let row = &batch.rows[span.row as usize];
        let first = origin(row.tokens[span.start as usize]).unwrap();
        assert_eq!((first.response, first.index), (Some(batch.sequences[s].sample_index), 0));
        let p = origin(row.tokens[span.prompt_start as usize]).unwrap();
        assert_eq!((p.group, p.response, p.index), (first.group, None, 0));
        assert_eq!(span.prompt_len, prompt_len(first.group));
    }

    // The account matches what is in the rows.
    let a = layout.account;
    let all: Vec<_> = batch.rows.iter().flat_map(|r| r.tokens.iter().map(|&t| origin(t))).collect();
    assert_eq!(a.positions(), batch.num_positions());
    assert_eq!(a.pad_tokens, all.iter().filter(|o| o.is_none()).count());
    assert_eq!(a.response_tokens, t.len());
    assert_eq!(a.prompt_tokens, all.iter().flatten().filter(|o| o.response.is_none()).count());
    assert_eq!(
        a.prompt_copies,
        all.iter().flatten().filter(|o| o.response.is_none() && o.index == 0).count()
    );
    assert_eq!(a.sequences, batch.sequences.len());
    let separate: usize = batch.sequences.iter().map(|s| s.num_targets as usize).sum::<usize>()
        + layout.spans.iter().map(|s| s.prompt_len as usize).sum::<usize>();
    assert_eq!(a.separate, separate);
}

fn by_id(groups: &[ScoredGroup]) -> BTreeMap<u32, ScoredGroup> {
    groups.iter().map(|g| (g.group.prompt.id.0 as u32, g.clone())).collect()
}

/// Random groups: prompt lengths, group sizes and response lengths.
fn groups_strategy(max_groups: usize) -> impl Strategy<Value = Vec<ScoredGroup>> {
    prop::collection::vec((1usize..12, prop::collection::vec(1usize..9, 1..7)), 1..=max_groups).prop_map(
        |specs| {
            specs.iter().enumerate().map(|(i, (p, lens))| common::group(i as u32 + 1, *p, lens)).collect()
        },
    )
}

fn config_strategy() -> impl Strategy<Value = PackingConfig> {
    (prop_oneof![Just(LayoutKind::SharedPrompt), Just(LayoutKind::Padded)], 8usize..80, 1usize..4).prop_map(
        |(layout, row_tokens, rows)| PackingConfig {
            layout,
            row_tokens,
            micro_batch_tokens: row_tokens * rows,
            split_oversized_groups: true,
            pad_token: PAD,
            groups_per_pack: 1,
        },
    )
}

/// The row budget the longest response of `g` needs with its prompt, in either layout.
fn response_need(g: &ScoredGroup) -> usize {
    g.group.prompt.tokens.len() + g.group.completions.iter().map(|c| c.tokens.len()).max().unwrap_or(0)
}

fn group_need(g: &ScoredGroup, layout: LayoutKind) -> (usize, usize) {
    let p = g.group.prompt.tokens.len();
    let lens = g.group.completions.iter().map(|c| c.tokens.len());
    match layout {
        // (positions, longest row) of the group alone.
        LayoutKind::SharedPrompt => {
            let n = p + lens.sum::<usize>();
            (n, n)
        }
        LayoutKind::Padded => {
            let longest = p + lens.max().unwrap_or(0);
            (longest * g.group.completions.len(), longest)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    #[test]
    fn shared_prompt_layout_of_one_group(groups in groups_strategy(1)) {
        let g = &groups[0];
        let layout = shared_prompt(g).unwrap();
        check_layout(&layout, &by_id(&groups));
        let p = g.group.prompt.tokens.len();
        let lens: Vec<usize> = g.group.completions.iter().map(|c| c.tokens.len()).collect();
        let total: usize = lens.iter().sum();
        prop_assert_eq!(layout.batch.rows.len(), 1);
        prop_assert_eq!(layout.batch.num_positions(), p + total);
        let mean = total as f64 / lens.len() as f64;
        prop_assert!((layout.account.bound() - saving_bound(p, mean, lens.len())).abs() < 1e-12);
        prop_assert_eq!(layout.account.realised(), layout.account.bound());
        prop_assert_eq!(layout.account.repeated_prompt_tokens(), 0);
    }

    #[test]
    fn padded_layout_of_groups(groups in groups_strategy(3)) {
        let layout = padded(&groups, PAD).unwrap();
        check_layout(&layout, &by_id(&groups));
        let rows: usize = groups.iter().map(|g| g.group.completions.len()).sum();
        let lengths: Vec<usize> = groups.iter().flat_map(|g| {
            g.group.completions.iter().map(move |c| g.group.prompt.tokens.len() + c.tokens.len())
        }).collect();
        let longest = *lengths.iter().max().unwrap();
        prop_assert_eq!(layout.batch.rows.len(), rows);
        prop_assert!(layout.batch.rows.iter().all(|r| r.len() == longest));
        prop_assert_eq!(layout.account.pad_tokens, rows * longest - lengths.iter().sum::<usize>());
        prop_assert_eq!(layout.account.separate, lengths.iter().sum::<usize>());
    }

    #[test]
    fn packing_keeps_every_response_once_in_order(groups in groups_strategy(5), config in config_strategy()) {
        let result = pack_period(&groups, &config);
        let too_long = groups.iter().position(|g| response_need(g) > config.row_tokens);
        let layouts = match (result, too_long) {
            (Err(MaskingError::ResponseOverBudget { group, .. }), Some(i)) => {
                prop_assert_eq!(group, groups[i].key());
                return Ok(());
            }
            (Ok(layouts), None) => layouts,
            (other, expected) => {
                return Err(TestCaseError::fail(format!("got {other:?}, expected failure at {expected:?}")));
            }
        };
        let ids = by_id(&groups);
        for l in &layouts {
            prop_assert_eq!(l.kind, config.layout);
            check_layout(l, &ids);
            prop_assert!(!l.batch.sequences.is_empty(), "an empty micro-batch");
            prop_assert!(l.batch.num_positions() <= config.micro_batch_tokens, "micro-batch over budget");
            prop_assert!(l.batch.rows.iter().all(|r| r.len() <= config.row_tokens), "row over budget");
        }

        // Never loses, duplicates or reorders a response.
        let expected: Vec<_> = groups.iter().flat_map(|g| {
            g.group.completions.iter().map(move |c| (g.key(), c.sample_index, c.tokens.clone()))
        }).collect();
        prop_assert_eq!(common::responses_in_order(&layouts), expected);

        // A group that fits a micro-batch is never split across micro-batches.
        for g in &groups {
            let holders = layouts.iter().filter(|l| l.batch.groups.iter().any(|tg| tg.key == g.key())).count();
            let (positions, longest) = group_need(g, config.layout);
            if positions <= config.micro_batch_tokens && longest <= config.row_tokens
                && (config.layout == LayoutKind::Padded || positions <= config.row_tokens)
            {
                prop_assert_eq!(holders, 1, "group {} was split", g.key());
            }
            let in_batch: u32 = layouts.iter().flat_map(|l| &l.batch.groups).filter(|tg| tg.key == g.key())
                .map(|tg| tg.num_sequences).sum();
            prop_assert_eq!(in_batch as usize, g.group.completions.len());
        }

        // Accounting adds up exactly over the period.
        let total: metronome_masking::TokenAccount = layouts.iter().map(|l| l.account).sum();
        let separate: usize = groups.iter().map(|g| {
            g.group.completions.iter().map(|c| g.group.prompt.tokens.len() + c.tokens.len()).sum::<usize>()
        }).sum();
        let ideal: usize = groups.iter().map(|g| {
            g.group.prompt.tokens.len() + g.group.completions.iter().map(|c| c.tokens.len()).sum::<usize>()
        }).sum();
        prop_assert_eq!(total.separate, separate);
        prop_assert_eq!(total.ideal, ideal);
        prop_assert_eq!(total.positions(), layouts.iter().map(|l| l.batch.num_positions()).sum::<usize>());
        let bound_num: f64 = groups.iter().map(|g| {
            (g.group.completions.len() as f64 - 1.0) * g.group.prompt.tokens.len() as f64
        }).sum();
        prop_assert!((total.bound() - bound_num / separate as f64).abs() < 1e-12);
        if config.layout == LayoutKind::SharedPrompt {
            // Each part of a split group repeats its prompt; nothing else is repeated.
            let repeated: usize = groups.iter().map(|g| {
                let first = g.group.prompt.tokens[0];
                let copies = layouts.iter().flat_map(|l| &l.batch.rows)
                    .map(|r| r.tokens.iter().filter(|&&t| t == first).count()).sum::<usize>();
                (copies - 1) * g.group.prompt.tokens.len()
            }).sum();
            prop_assert_eq!(total.repeated_prompt_tokens(), repeated);
            prop_assert_eq!(total.pad_tokens, 0);
        }
    }

    #[test]
    fn without_splitting_an_over_budget_group_is_an_error(groups in groups_strategy(4), mut config in config_strategy()) {
        config.split_oversized_groups = false;
        let over = groups.iter().position(|g| {
            let (positions, longest) = group_need(g, config.layout);
            match config.layout {
                LayoutKind::SharedPrompt => positions > config.row_tokens,
                LayoutKind::Padded => longest > config.row_tokens || positions > config.micro_batch_tokens,
            }
        });
        match (pack_period(&groups, &config), over) {
            (Ok(layouts), None) => {
                prop_assert_eq!(common::responses_in_order(&layouts).len(),
                    groups.iter().map(|g| g.group.completions.len()).sum::<usize>());
            }
            (Err(MaskingError::GroupOverBudget { group, tokens, budget }), Some(i)) => {
                prop_assert_eq!(group, groups[i].key());
                prop_assert!(tokens > budget);
            }
            (other, expected) => {
                return Err(TestCaseError::fail(format!("got {other:?}, expected failure at {expected:?}")));
            }
        }
    }
}
