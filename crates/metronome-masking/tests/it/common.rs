//! Test groups whose token ids encode where they came from, so a test can say what any
//! position of any layout *should* see without trusting the layout code.

use metronome_core::{
    AdvantageEstimator, Completion, Group, GroupKey, PeriodId, PolicyVersion, Prompt, PromptId, Reward,
    ScoredGroup, TokenId,
};
use metronome_masking::Layout;

/// The pad token of the padded layouts in these tests (never a content token).
pub(crate) const PAD: TokenId = u32::MAX;

/// What a content token is: part of group `group`'s prompt (`response == None`) or of
/// its response `response`, at index `index` within that part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Origin {
    pub(crate) group: u32,
    pub(crate) response: Option<u32>,
    pub(crate) index: u32,
}

/// Token ids: `group·10⁶ + (response+1)·10³ + index` (`response` slot 0 for the prompt).
pub(crate) fn token(o: Origin) -> TokenId {
    o.group * 1_000_000 + o.response.map_or(0, |r| r + 1) * 1000 + o.index
}

pub(crate) fn origin(t: TokenId) -> Option<Origin> {
    if t == PAD {
        return None;
    }
    let slot = (t / 1000) % 1000;
    Some(Origin { group: t / 1_000_000, response: slot.checked_sub(1), index: t % 1000 })
}

/// A scored group `g` (≥ 1) with a prompt of `p` tokens and responses of `lens`.
pub(crate) fn group(g: u32, p: usize, lens: &[usize]) -> ScoredGroup {
    let prompt = Prompt {
        id: PromptId(u64::from(g)),
        tokens: (0..p as u32).map(|index| token(Origin { group: g, response: None, index })).collect(),
        ..Prompt::default()
    };
    let completions = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let tokens: Vec<TokenId> = (0..l as u32)
                .map(|index| token(Origin { group: g, response: Some(i as u32), index }))
                .collect();
            Completion {
                sample_index: i as u32,
                logprobs: tokens.iter().map(|&t| behaviour_logprob(t)).collect(),
                tokens,
                version: PolicyVersion(3),
                ..Completion::default()
            }
        })
        .collect();
    let group = Group { period: PeriodId(7), prompt, completions, ..Group::default() };
    let rewards = (0..lens.len()).map(|i| Reward::scalar((i % 3) as f32)).collect();
    ScoredGroup::new(group, rewards, AdvantageEstimator::GroupMean).expect("rewards match completions")
}

/// The behaviour log-prob the test groups record for a token: unique per token.
pub(crate) fn behaviour_logprob(t: TokenId) -> f32 {
    -((t % 9973) as f32) / 1000.0
}

pub(crate) fn key(g: u32) -> GroupKey {
    GroupKey { period: PeriodId(7), prompt: PromptId(u64::from(g)) }
}

/// The (rotary position, token) sequence that a token at `o` and everything it may
/// attend form in separate decoding: its prompt prefix, or the whole prompt and its
/// response's prefix. Independent of any layout.
pub(crate) fn expected_context(o: Origin, prompt_len: u32) -> Vec<(u32, TokenId)> {
    let prompt =
        |n: u32| (0..n).map(move |j| (j, token(Origin { group: o.group, response: None, index: j })));
    match o.response {
        None => prompt(o.index + 1).collect(),
        Some(r) => prompt(prompt_len)
            .chain(
                (0..=o.index)
                    .map(|t| (prompt_len + t, token(Origin { group: o.group, response: Some(r), index: t }))),
            )
            .collect(),
    }
}

/// Every (rotary position, token) that position `q` of `row` may attend according to a
/// boolean `sees(q, k)`, in position order.
pub(crate) fn visible(
    row: &metronome_core::PackedRow,
    q: usize,
    sees: impl Fn(usize, usize) -> bool,
) -> Vec<(u32, TokenId)> {
    (0..row.len()).filter(|&k| sees(q, k)).map(|k| (row.positions[k], row.tokens[k])).collect()
}

/// The responses of a list of layouts, in order, as (group key, sample index, target tokens).
pub(crate) fn responses_in_order(layouts: &[Layout]) -> Vec<(GroupKey, u32, Vec<TokenId>)> {
    let mut out = Vec::new();
    for l in layouts {
        let b = &l.batch;
        for (s, seq) in b.sequences.iter().enumerate() {
            let tokens = (0..b.targets.len())
                .filter(|&i| b.targets.sequence[i] as usize == s)
                .map(|i| b.targets.token[i])
                .collect();
            out.push((b.groups[seq.group as usize].key, seq.sample_index, tokens));
        }
    }
    out
}
