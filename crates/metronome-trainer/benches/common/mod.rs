//! Packed micro-batches shared by the trainer benches: groups of `G` responses of
//! 16..32 tokens to a `PROMPT`-token prompt, in the shared-prompt layout or as
//! separate `prompt + response` rows, with token ids in `3..93` (valid for every model
//! shape the benches use).

use metronome_core::{
    GroupKey, PackedRow, PeriodId, PromptId, Segment, TrainBatch, TrainGroup, TrainSequence,
};

const G: u32 = 4;
const PROMPT: u32 = 48;

fn response(g: u32, r: u32) -> Vec<u32> {
    (0..16 + (r * 5 + g) % 17).map(|j| 3 + (j * 13 + r * 7 + g * 17) % 90).collect()
}

fn prompt(g: u32) -> Vec<u32> {
    (0..PROMPT).map(|i| 3 + (i * 7 + g * 11) % 90).collect()
}

/// Appends one group to `batch`: shared-prompt tree in one row, or one row per response.
fn push_group(batch: &mut TrainBatch, g: u32, shared: bool) {
    let gi = batch.groups.len() as u32;
    let p = prompt(g);
    let mut shared_row = PackedRow {
        tokens: p.clone(),
        positions: (0..PROMPT).collect(),
        segments: vec![Segment { start: 0, len: PROMPT, parent: None }],
    };
    let shared_index = batch.rows.len() as u32;
    for r in 0..G {
        let resp = response(g, r);
        let seq = batch.sequences.len() as u32;
        let (row, start) = if shared {
            let start = shared_row.tokens.len() as u32;
            shared_row.tokens.extend_from_slice(&resp);
            shared_row.positions.extend((0..resp.len() as u32).map(|j| PROMPT + j));
            shared_row.segments.push(Segment { start, len: resp.len() as u32, parent: Some(0) });
            (shared_index, start)
        } else {
            let mut tokens = p.clone();
            tokens.extend_from_slice(&resp);
            let len = tokens.len() as u32;
            batch.rows.push(PackedRow {
                tokens,
                positions: (0..len).collect(),
                segments: vec![Segment { start: 0, len, parent: None }],
            });
            (batch.rows.len() as u32 - 1, PROMPT)
        };
        let adv = if r % 2 == 0 { 1.0 } else { -1.0 };
        for (j, &tok) in resp.iter().enumerate() {
            let t = &mut batch.targets;
            t.row.push(row);
            t.position.push(if j == 0 { PROMPT - 1 } else { start + j as u32 - 1 });
            t.token.push(tok);
            t.sequence.push(seq);
            t.advantage.push(adv);
            t.behaviour_logprob.push(-4.6);
        }
        batch.sequences.push(TrainSequence {
            group: gi,
            sample_index: r,
            advantage: adv,
            num_targets: resp.len() as u32,
            ..TrainSequence::default()
        });
    }
    if shared {
        batch.rows.push(shared_row);
    }
    batch.groups.push(TrainGroup {
        key: GroupKey { period: PeriodId(0), prompt: PromptId(u64::from(g)) },
        num_sequences: G,
        group_size: G,
        all_equal: false,
        reward_mean: 0.5,
    });
}

pub(crate) fn micro_batch(first: u32, groups: u32, shared: bool) -> TrainBatch {
    let mut b = TrainBatch::default();
    for g in first..first + groups {
        push_group(&mut b, g, shared);
    }
    b.validate().expect("bench batch is valid");
    b
}
