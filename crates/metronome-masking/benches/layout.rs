//! Cost of building layouts on the host, beside the network time they are meant to
//! save: packing a period of 64 groups (G = 8, P = 256, L = 128) in the shared-prompt
//! and padded layouts, and materialising a dense mask for one packed row.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use metronome_core::{
    AdvantageEstimator, Completion, Group, PeriodId, Prompt, PromptId, Reward, ScoredGroup,
};
use metronome_masking::{LayoutKind, PackingConfig, dense_additive_mask, pack_period};

fn group(id: u64, p: usize, l: usize, g: usize) -> ScoredGroup {
    let prompt = Prompt { id: PromptId(id), tokens: (0..p as u32).collect(), ..Prompt::default() };
    let completions = (0..g)
        .map(|i| Completion {
            sample_index: i as u32,
            tokens: (0..l as u32).collect(),
            logprobs: vec![-1.0; l],
            ..Completion::default()
        })
        .collect();
    let group = Group { period: PeriodId(0), prompt, completions, ..Group::default() };
    let rewards = (0..g).map(|i| Reward::scalar(i as f32)).collect();
    ScoredGroup::new(group, rewards, AdvantageEstimator::GroupNorm).expect("aligned rewards")
}

fn bench(c: &mut Criterion) {
    let groups: Vec<ScoredGroup> = (0..64).map(|i| group(i, 256, 128, 8)).collect();
    let shared = PackingConfig { row_tokens: 4096, micro_batch_tokens: 16384, ..PackingConfig::default() };
    let padded = PackingConfig { layout: LayoutKind::Padded, ..shared };
    c.bench_function("pack_period/shared_prompt/64x8", |b| {
        b.iter(|| pack_period(black_box(&groups), &shared).expect("fits"));
    });
    c.bench_function("pack_period/padded/64x8", |b| {
        b.iter(|| pack_period(black_box(&groups), &padded).expect("fits"));
    });
    let layouts = pack_period(&groups, &shared).expect("fits");
    let row = &layouts[0].batch.rows[0];
    c.bench_function(&format!("dense_additive_mask/{}", row.len()), |b| {
        b.iter(|| dense_additive_mask(black_box(row)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
