//! The contract of [`PromptSource`]: periods count up by one from the cursor's and
//! hold each prompt once, and a source restored to a cursor (a fresh one, or the same
//! one rewound) releases exactly the batches that followed that cursor.

use std::collections::BTreeSet;

use metronome_core::{Cursor, PromptBatch, PromptSource};

use super::{expect, patiently};

const SUITE: &str = "prompt source";

/// Up to `n` batches (fewer when the source is exhausted), each with the cursor
/// before it.
async fn take(source: &mut dyn PromptSource, n: usize) -> Vec<(Cursor, PromptBatch)> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let cursor = source.cursor();
        match expect(SUITE, "next_batch", patiently(SUITE, "next_batch", source.next_batch()).await) {
            Some(batch) => out.push((cursor, batch)),
            None => break,
        }
    }
    out
}

/// Runs every check on sources made by `make`, reading up to `periods` batches
/// (at least 2).
pub async fn run_all(make: &mut dyn FnMut() -> Box<dyn PromptSource>, periods: usize) {
    periods_count_up_and_hold_each_prompt_once(&mut *make(), periods).await;
    restore_reproduces_the_batches(make, periods).await;
}

/// Each batch's period is the cursor's period before it, one more than the last
/// batch's, and no batch holds a prompt id twice (a period's groups are identified by
/// period and prompt).
pub async fn periods_count_up_and_hold_each_prompt_once(source: &mut dyn PromptSource, periods: usize) {
    let batches = take(source, periods).await;
    assert!(!batches.is_empty(), "{SUITE} conformance: a fresh source released nothing");
    for (i, (cursor, batch)) in batches.iter().enumerate() {
        assert_eq!(
            batch.period, cursor.period,
            "{SUITE} conformance: batch {i} has period {}, its cursor said {}",
            batch.period, cursor.period
        );
        if let Some((_, previous)) = i.checked_sub(1).map(|p| &batches[p]) {
            assert_eq!(
                batch.period.0,
                previous.period.0 + 1,
                "{SUITE} conformance: period {} follows period {}",
                batch.period,
                previous.period
            );
        }
        let mut seen = BTreeSet::new();
        for p in &batch.prompts {
            assert!(
                seen.insert(p.id),
                "{SUITE} conformance: period {} holds prompt {} twice",
                batch.period,
                p.id
            );
        }
    }
}

/// For each cursor seen, a fresh source restored to it, and the first source rewound
/// to it, release the same batches as the uninterrupted source did from there.
pub async fn restore_reproduces_the_batches(make: &mut dyn FnMut() -> Box<dyn PromptSource>, periods: usize) {
    let periods = periods.max(2);
    let mut first = make();
    let reference = take(&mut *first, periods).await;
    for (k, (cursor, _)) in reference.iter().enumerate() {
        let expected: Vec<&PromptBatch> = reference[k..].iter().map(|(_, b)| b).collect();
        let mut fresh = make();
        expect(SUITE, "restore on a fresh source", fresh.restore(*cursor));
        let resumed = take(&mut *fresh, expected.len()).await;
        let resumed: Vec<&PromptBatch> = resumed.iter().map(|(_, b)| b).collect();
        assert_eq!(resumed, expected, "{SUITE} conformance: a fresh source restored to {cursor:?} differs");
        assert_eq!(
            fresh.cursor(),
            first.cursor(),
            "{SUITE} conformance: a restored source ends at another cursor than the uninterrupted one"
        );
    }
    // The same source rewound to its first cursor, after it has run on.
    let (start, _) = reference[0];
    expect(SUITE, "restore on a used source", first.restore(start));
    let again = take(&mut *first, reference.len()).await;
    assert!(
        again.iter().map(|(_, b)| b).eq(reference.iter().map(|(_, b)| b)),
        "{SUITE} conformance: a source rewound to {start:?} releases other batches"
    );
}
