//! The contract of [`Trainer`]: versions count periods, so every step advances the
//! version by exactly one, also when a guard refuses the update (the weights then
//! stay); a snapshot carries the current version and is a copy that later steps do
//! not change.

use metronome_core::{PolicyVersion, StepReport, TrainBatch, Trainer, WeightSnapshot};

use super::{expect, patiently};

const SUITE: &str = "trainer";

/// Makes the micro-batch of one period for a trainer at the given version (its
/// responses sampled by that version, so the trainer takes them as on-policy).
pub type Batches<'a> = &'a dyn Fn(PolicyVersion) -> TrainBatch;

async fn period(trainer: &mut dyn Trainer, batch: Batches<'_>) -> StepReport {
    let v = trainer.version();
    expect(SUITE, "accumulate", patiently(SUITE, "accumulate", trainer.accumulate(batch(v))).await);
    expect(SUITE, "step", patiently(SUITE, "step", trainer.step()).await)
}

async fn snapshot(trainer: &dyn Trainer) -> WeightSnapshot {
    expect(SUITE, "snapshot", patiently(SUITE, "snapshot", trainer.snapshot()).await)
}

/// Runs every check on `trainer` with micro-batches from `batch`, and the refused
/// step with a batch from `refused` (one that makes the trainer refuse the update:
/// for `metronome-trainer` a non-finite advantage), if the trainer has such a guard.
pub async fn run_all(trainer: &mut dyn Trainer, batch: Batches<'_>, refused: Option<Batches<'_>>) {
    the_version_advances_by_one_per_step(trainer, batch).await;
    a_snapshot_is_a_copy_of_the_current_weights(trainer, batch).await;
    if let Some(refused) = refused {
        a_refused_step_advances_the_version_and_keeps_the_weights(trainer, refused).await;
    }
}

/// Two periods: each step reports, and leaves the trainer at, the previous version
/// plus one, and applies its update.
pub async fn the_version_advances_by_one_per_step(trainer: &mut dyn Trainer, batch: Batches<'_>) {
    for _ in 0..2 {
        let before = trainer.version();
        let report = period(trainer, batch).await;
        assert_eq!(
            report.version,
            before.next(),
            "{SUITE} conformance: a step from {before} reported {}",
            report.version
        );
        assert_eq!(
            trainer.version(),
            before.next(),
            "{SUITE} conformance: a step from {before} left {}",
            trainer.version()
        );
        assert!(report.applied, "{SUITE} conformance: a step on a good batch was refused");
    }
}

/// A snapshot is of the current version; one taken before a step keeps its values
/// after the step changed the weights, and the next snapshot holds the new weights.
pub async fn a_snapshot_is_a_copy_of_the_current_weights(trainer: &mut dyn Trainer, batch: Batches<'_>) {
    let before = snapshot(trainer).await;
    assert_eq!(before.version, trainer.version(), "{SUITE} conformance: a snapshot of another version");
    let kept = before.clone();
    let report = period(trainer, batch).await;
    assert!(report.applied, "{SUITE} conformance: a step on a good batch was refused");
    assert_eq!(
        before, kept,
        "{SUITE} conformance: a step changed an earlier snapshot (it aliases the weights)"
    );
    let after = snapshot(trainer).await;
    assert_eq!(after.version, trainer.version(), "{SUITE} conformance: a snapshot of another version");
    assert_ne!(
        after.tensors, before.tensors,
        "{SUITE} conformance: an applied step left the snapshot's weights as they were"
    );
}

/// A step on a batch the trainer refuses still closes the period: the version
/// advances by one, the report says the update was not applied, and the new version
/// names the previous weights.
pub async fn a_refused_step_advances_the_version_and_keeps_the_weights(
    trainer: &mut dyn Trainer,
    refused: Batches<'_>,
) {
    let weights = snapshot(trainer).await;
    let before = trainer.version();
    let report = period(trainer, refused).await;
    assert!(!report.applied, "{SUITE} conformance: the refusing batch's update was applied");
    assert_eq!(
        report.version,
        before.next(),
        "{SUITE} conformance: a refused step from {before} reported {}",
        report.version
    );
    assert_eq!(
        trainer.version(),
        before.next(),
        "{SUITE} conformance: a refused step from {before} left {} (a schedule waiting for the next version would stall)",
        trainer.version()
    );
    let after = snapshot(trainer).await;
    assert_eq!(after.tensors, weights.tensors, "{SUITE} conformance: a refused step changed the weights");
}

/// For a trainer that checkpoints: a checkpoint written mid-period (one micro-batch
/// in) and restored into `fresh` (another trainer of the same configuration) continues
/// exactly: the period's step and the next one give the same versions and weights as
/// the trainer that wrote it. Resumed runs rely on this.
pub async fn a_checkpoint_continues_exactly(
    trainer: &mut dyn Trainer,
    fresh: &mut dyn Trainer,
    batch: Batches<'_>,
) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let v = trainer.version();
    expect(SUITE, "accumulate", patiently(SUITE, "accumulate", trainer.accumulate(batch(v))).await);
    let saved = patiently(SUITE, "save_checkpoint", trainer.save_checkpoint(dir.path())).await;
    expect(SUITE, "save_checkpoint", saved);
    let restored = patiently(SUITE, "restore_checkpoint", fresh.restore_checkpoint(dir.path())).await;
    expect(SUITE, "restore_checkpoint", restored);
    assert_eq!(fresh.version(), v, "{SUITE} conformance: a restored trainer is at another version");
    finish_two_periods("writer", trainer, v, batch).await;
    finish_two_periods("restored trainer", fresh, v, batch).await;
    let (a, b) = (snapshot(trainer).await, snapshot(fresh).await);
    assert_eq!(a, b, "{SUITE} conformance: the restored trainer's weights differ from the writer's");
}

/// Steps the period begun at `v`, then runs one more.
async fn finish_two_periods(name: &str, t: &mut dyn Trainer, v: PolicyVersion, batch: Batches<'_>) {
    let report = expect(SUITE, "step", patiently(SUITE, "step", t.step()).await);
    assert_eq!(
        report.version,
        v.next(),
        "{SUITE} conformance: the {name}'s step reported {}",
        report.version
    );
    period(t, batch).await;
}
