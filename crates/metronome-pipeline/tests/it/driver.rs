//! The period driver's own contracts, the same for every schedule: resuming from a
//! checkpoint, acknowledging only what a checkpoint contains, and dealing with groups
//! that are not what the period expects without stalling it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use metronome_core::{
    AccumulateReport, Group, GroupKey, GroupScorer, PeriodId, PolicyVersion, PromptId, ScoredGroup,
    StepReport, TensorData, TrainBatch, Trainer, WeightSnapshot,
};
use metronome_pipeline::{Checkpointing, RunEnd, Runner, RunnerOptions, Schedule, Stages};

use crate::mocks::*;

const SCHEDULES: [Schedule; 3] = [Schedule::Sync, Schedule::Periodic, Schedule::Stale(1)];

fn options(schedule: Schedule, periods: u64) -> RunnerOptions {
    RunnerOptions { schedule, periods, group_size: 4, ..RunnerOptions::default() }
}

/// Every schedule, and `stale:1` with partial rollouts (periods generating at once).
fn layouts(periods: u64) -> Vec<RunnerOptions> {
    let partial = RunnerOptions { partial_rollouts: true, ..options(Schedule::Stale(1), periods) };
    SCHEDULES.iter().map(|&s| options(s, periods)).chain([partial]).collect()
}

fn stages(engine: MockEngine, trainer: MockTrainer, scorer: Arc<dyn GroupScorer>) -> Stages {
    Stages {
        source: Box::new(MockSource { next: 0, n: 1000, batch: 6, period: 0 }),
        engine: Arc::new(engine),
        scorer,
        packer: mock_packer(),
        trainer: Box::new(trainer),
    }
}

/// Runs `runner`, failing the test after a minute (a hang).
async fn finish(runner: Runner, what: &str) -> RunEnd {
    tokio::time::timeout(Duration::from_secs(60), runner.run())
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

async fn weights(trainer: &dyn Trainer) -> Vec<f32> {
    let TensorData::F32(w) = trainer.snapshot().await.unwrap().tensors[0].data.clone() else {
        unreachable!()
    };
    w
}

fn checkpointing(dir: &std::path::Path, every: u64) -> Checkpointing {
    Checkpointing { dir: dir.to_owned(), every, interval: Duration::ZERO }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_continued_from_its_checkpoint_ends_with_the_weights_of_an_uninterrupted_one() {
    for layout in layouts(0) {
        let schedule = layout.schedule;
        let run = |periods: u64, dir: std::path::PathBuf| async move {
            let engine = MockEngine::new(Duration::from_millis(1));
            let trainer = MockTrainer::new(engine.generating.clone());
            let stages = stages(engine, trainer, Arc::new(MockScorer));
            let runner = Runner::new(stages, Some(channel_transport(4)), RunnerOptions { periods, ..layout })
                .unwrap()
                .checkpoint(checkpointing(&dir, 2));
            finish(runner, &format!("{layout:?}")).await
        };
        let whole = tempfile::tempdir().unwrap();
        let uninterrupted = run(5, whole.path().to_owned()).await;
        assert_eq!(uninterrupted.resumed_at, None);

        let parts = tempfile::tempdir().unwrap();
        // Three periods: checkpoints after period 2 (every 2) and 3 (the last).
        let first = run(3, parts.path().to_owned()).await;
        assert_eq!(first.reports.len(), 3);
        let rest = run(5, parts.path().to_owned()).await;
        assert_eq!(rest.resumed_at, Some(3), "{schedule}");
        let periods: Vec<u64> = rest.reports.iter().map(|r| r.period.0).collect();
        assert_eq!(periods, [3, 4], "{schedule}: the resumed run starts where the first stopped");
        assert_eq!(rest.trainer.version(), PolicyVersion(5));
        let (a, b) = (weights(uninterrupted.trainer.as_ref()).await, weights(rest.trainer.as_ref()).await);
        if schedule.is_on_policy() {
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-6, "{schedule}: {a:?} vs {b:?}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_limit_makes_the_period_that_passes_it_the_last_with_its_checkpoint_and_the_run_resumes_after_it()
 {
    for layout in layouts(5) {
        let what = format!("{} (partial rollouts: {})", layout.schedule, layout.partial_rollouts);
        let dir = tempfile::tempdir().unwrap();
        let run = |time_limit: Option<Duration>| {
            let engine = MockEngine::new(Duration::from_millis(1));
            let trainer = MockTrainer::new(engine.generating.clone());
            let events = trainer.events.clone();
            let lasts = Arc::new(std::sync::Mutex::new(Vec::new()));
            let seen = lasts.clone();
            let runner = Runner::new(
                stages(engine, trainer, Arc::new(MockScorer)),
                Some(channel_transport(4)),
                RunnerOptions { time_limit, ..layout },
            )
            .unwrap()
            // No checkpoint by count or time: only the last period's.
            .checkpoint(checkpointing(dir.path(), 0))
            .on_period(move |end| {
                seen.lock().unwrap().push((end.report.period.0, end.last));
                Ok(())
            });
            (runner, events, lasts)
        };
        // A limit of zero has passed when the first period ends.
        let (runner, events, lasts) = run(Some(Duration::ZERO));
        let end = finish(runner, &what).await;
        assert_eq!(end.reports.len(), 1, "{what}");
        assert_eq!(end.trainer.version(), PolicyVersion(1), "{what}");
        assert_eq!(*lasts.lock().unwrap(), [(0, true)], "{what}: the hook is told the period is the last");
        let saved: Vec<u64> = events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| if let Recorded::Checkpoint(v) = e { Some(*v) } else { None })
            .collect();
        assert_eq!(saved, [1], "{what}: the last period's checkpoint");

        let (runner, _, lasts) = run(None);
        let rest = finish(runner, &what).await;
        assert_eq!(rest.resumed_at, Some(1), "{what}");
        let expected = [(1, false), (2, false), (3, false), (4, true)];
        assert_eq!(*lasts.lock().unwrap(), expected, "{what}: without the limit, the rest of the run");
        assert_eq!(rest.trainer.version(), PolicyVersion(5), "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_are_acknowledged_only_once_a_checkpoint_contains_them() {
    for layout in layouts(5).into_iter().filter(|l| l.schedule != Schedule::Sync) {
        let schedule = format!("{} (partial rollouts: {})", layout.schedule, layout.partial_rollouts);
        let engine = MockEngine::new(Duration::from_millis(1));
        let trainer = MockTrainer::new(engine.generating.clone());
        let events = trainer.events.clone();
        let dir = tempfile::tempdir().unwrap();
        let transport = recording_transport(4, Some(events.clone()));
        let runner = Runner::new(stages(engine, trainer, Arc::new(MockScorer)), Some(transport), layout)
            .unwrap()
            .checkpoint(checkpointing(dir.path(), 2));
        finish(runner, &schedule).await;
        let events = events.lock().unwrap().clone();
        let checkpoints: Vec<u64> = events
            .iter()
            .filter_map(|e| if let Recorded::Checkpoint(v) = e { Some(*v) } else { None })
            .collect();
        assert_eq!(checkpoints, [2, 4, 5], "{schedule}: every 2 periods and after the last");
        let mut acked = 0;
        for (i, event) in events.iter().enumerate() {
            let Recorded::Ack(key) = event else { continue };
            acked += 1;
            let covered =
                events[..i].iter().any(|e| matches!(e, Recorded::Checkpoint(v) if *v > key.period.0));
            assert!(covered, "{schedule}: {key} acknowledged before a checkpoint contained it: {events:?}");
        }
        assert_eq!(acked, 5 * 6, "{schedule}: every group acknowledged once");
    }
}

/// A scorer whose reward for one prompt is not a number.
struct NanReward(u64);

#[async_trait]
impl GroupScorer for NanReward {
    async fn score(&self, group: Group) -> metronome_core::Result<ScoredGroup> {
        let poisoned = group.prompt.id.0 == self.0;
        let mut scored = MockScorer.score(group).await?;
        if poisoned {
            scored.rewards[0].total = f32::NAN;
        }
        Ok(scored)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_duplicates_and_unusable_rewards_are_dealt_with_and_every_period_completes() {
    // In period 0 (prompts 0..6): a copy of prompt 1's group arrives under prompt
    // 999 (no prompt of the period: rejected, and the period still waits for its own
    // groups), prompt 2's group arrives twice (trained once), and prompt 3's rewards
    // are not numbers (rejected: the advantages cannot be computed). Before, the
    // multi-process trainer waited forever for a group it had rejected.
    let mut outcomes = Vec::new();
    for schedule in SCHEDULES {
        let mut engine = MockEngine::new(Duration::from_millis(1));
        engine.stranger = Some((1, 999));
        engine.twice = [2].into();
        let trainer = MockTrainer::new(engine.generating.clone());
        let log = trainer.log.clone();
        let events = trainer.events.clone();
        let transport = recording_transport(4, Some(events.clone()));
        let runner = Runner::new(
            stages(engine, trainer, Arc::new(NanReward(3))),
            Some(transport),
            options(schedule, 2),
        )
        .unwrap();
        let end = finish(runner, &format!("{schedule}")).await;
        let counts: Vec<(usize, usize)> = end.reports.iter().map(|r| (r.groups, r.rejected)).collect();
        assert_eq!(counts, [(5, 2), (6, 0)], "{schedule}: (trained, rejected)");
        // The second copy is counted when it arrives, which may be after its period.
        let duplicates: usize = end.reports.iter().map(|r| r.duplicates).sum();
        assert_eq!(duplicates, 1, "{schedule}");
        let trained: Vec<u64> = log.lock().unwrap().steps[0].iter().map(|(k, _)| k.prompt.0).collect();
        let mut trained = trained;
        trained.sort_unstable();
        assert_eq!(trained, [0, 1, 2, 4, 5], "{schedule}");
        if schedule != Schedule::Sync {
            // Through a transport the rejections say why (sync's groups never left
            // the process).
            let rejected: Vec<(GroupKey, String)> = events
                .lock()
                .unwrap()
                .iter()
                .filter_map(|e| if let Recorded::Reject(k, r) = e { Some((*k, r.clone())) } else { None })
                .collect();
            let key = |p| GroupKey { period: PeriodId(0), prompt: PromptId(p) };
            assert_eq!(rejected.len(), 2, "{schedule}: {rejected:?}");
            assert!(
                rejected.iter().any(|(k, r)| *k == key(999) && r.contains("not one of period 0's prompts"))
            );
            assert!(rejected.iter().any(|(k, r)| *k == key(3) && r.contains("rewards are unusable")));
        }
        outcomes.push(weights(end.trainer.as_ref()).await);
    }
    for (x, y) in outcomes[0].iter().zip(&outcomes[1]) {
        assert!((x - y).abs() <= 1e-6, "sync and periodic differ: {outcomes:?}");
    }
}

/// A trainer that cannot checkpoint (the contract's default methods).
struct NoCheckpoints(MockTrainer);

#[async_trait]
impl Trainer for NoCheckpoints {
    fn version(&self) -> PolicyVersion {
        self.0.version()
    }
    async fn accumulate(&mut self, batch: TrainBatch) -> metronome_core::Result<AccumulateReport> {
        self.0.accumulate(batch).await
    }
    async fn step(&mut self) -> metronome_core::Result<StepReport> {
        self.0.step().await
    }
    async fn snapshot(&self) -> metronome_core::Result<WeightSnapshot> {
        self.0.snapshot().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_asked_of_a_trainer_that_cannot_write_them_are_an_error_naming_it() {
    let engine = MockEngine::new(Duration::from_millis(1));
    let trainer = NoCheckpoints(MockTrainer::new(engine.generating.clone()));
    let mut stages = stages(engine, MockTrainer::new(Default::default()), Arc::new(MockScorer));
    stages.trainer = Box::new(trainer);
    let dir = tempfile::tempdir().unwrap();
    let runner = Runner::new(stages, Some(channel_transport(4)), options(Schedule::Periodic, 2))
        .unwrap()
        .checkpoint(checkpointing(dir.path(), 1));
    let err = tokio::time::timeout(Duration::from_secs(60), runner.run()).await.expect("hung").unwrap_err();
    assert!(err.to_string().contains("this trainer does not checkpoint"), "{err}");
}

/// [`MockScorer`] with its advantages computed by `estimator`.
struct ScoredWith(metronome_core::AdvantageEstimator);

#[async_trait]
impl GroupScorer for ScoredWith {
    async fn score(&self, group: Group) -> metronome_core::Result<ScoredGroup> {
        let mut scored = MockScorer.score(group).await?;
        scored.recompute(self.0)?;
        Ok(scored)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trainer_side_computes_advantages_with_the_runs_estimator_whatever_the_scorer_sent() {
    use metronome_core::AdvantageEstimator::{GroupNorm, LeaveOneOut};
    let run = |scorer, run| async move {
        let engine = MockEngine::new(Duration::from_millis(1));
        let trainer = MockTrainer::new(engine.generating.clone());
        let stages = stages(engine, trainer, Arc::new(ScoredWith(scorer)));
        let options = RunnerOptions { advantage: run, ..options(Schedule::Periodic, 2) };
        let end = finish(Runner::new(stages, Some(channel_transport(4)), options).unwrap(), "run").await;
        weights(end.trainer.as_ref()).await
    };
    // A remote scorer (or a worker) that sent GRPO's advantages for a leave-one-out run.
    let mismatched = run(GroupNorm, LeaveOneOut).await;
    assert_eq!(mismatched, run(LeaveOneOut, LeaveOneOut).await);
    assert_ne!(mismatched, run(GroupNorm, GroupNorm).await, "the estimators must differ for this test");
}

/// [`MockScorer`], except that every response to a prompt whose id is a multiple of
/// three scores the same: such groups carry no group-relative signal.
struct SomeAllEqual;

#[async_trait]
impl GroupScorer for SomeAllEqual {
    async fn score(&self, group: Group) -> metronome_core::Result<ScoredGroup> {
        let flat = group.prompt.id.0.is_multiple_of(3);
        let mut scored = MockScorer.score(group).await?;
        if flat {
            scored.rewards.iter_mut().for_each(|r| r.total = 0.5);
            scored.recompute(metronome_core::AdvantageEstimator::GroupNorm)?;
        }
        Ok(scored)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_sampling_trains_the_first_groups_whose_rewards_vary_in_release_order() {
    // Six prompts a period; those with ids 0, 3, 6, 9 have equal rewards. Three groups
    // wanted: period 0 trains prompts 1, 2, 4 (0 and 3 filtered, 5 not needed),
    // period 1 prompts 7, 8, 10 (6 and 9 filtered, 11 not needed) — in any schedule,
    // whatever order the groups complete in.
    let mut weights_of = Vec::new();
    for schedule in SCHEDULES {
        let engine = MockEngine::new(Duration::from_millis(1));
        let trainer = MockTrainer::new(engine.generating.clone());
        let log = trainer.log.clone();
        let options = RunnerOptions { dynamic_sampling: Some(3), ..options(schedule, 2) };
        let stages = stages(engine, trainer, Arc::new(SomeAllEqual));
        let end = finish(Runner::new(stages, Some(channel_transport(4)), options).unwrap(), "dynamic").await;
        let trained: Vec<Vec<u64>> =
            log.lock().unwrap().steps.iter().map(|s| s.iter().map(|(k, _)| k.prompt.0).collect()).collect();
        assert_eq!(trained, [vec![1, 2, 4], vec![7, 8, 10]], "{schedule}: trained in release order");
        let counts: Vec<(usize, usize)> = end.reports.iter().map(|r| (r.groups, r.filtered)).collect();
        assert_eq!(counts, [(3, 3), (3, 3)], "{schedule}: (trained, filtered)");
        weights_of.push(weights(end.trainer.as_ref()).await);
    }
    assert_eq!(weights_of[0], weights_of[1], "sync and periodic train the same groups in the same order");
}

/// A runner whose hook keeps the record does not also hold every report: the hook
/// sees each period with its busy intervals, and the run's end holds none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_told_not_to_keep_reports_hands_each_to_its_hook_and_keeps_none() {
    for layout in layouts(4) {
        let what = format!("{} (partial rollouts: {})", layout.schedule, layout.partial_rollouts);
        let engine = MockEngine::new(Duration::from_millis(1));
        let trainer = MockTrainer::new(engine.generating.clone());
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let hook_seen = seen.clone();
        let runner =
            Runner::new(stages(engine, trainer, Arc::new(MockScorer)), Some(channel_transport(4)), layout)
                .unwrap()
                .keep_reports(false)
                .on_period(move |end| {
                    hook_seen.lock().unwrap().push((end.report.period.0, end.report.intervals.len()));
                    Ok(())
                });
        let end = finish(runner, &what).await;
        assert!(end.reports.is_empty(), "{what}: {} reports kept", end.reports.len());
        assert_eq!(end.trainer.version(), PolicyVersion(4), "{what}");
        let seen = seen.lock().unwrap();
        assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), [0, 1, 2, 3], "{what}");
        assert!(seen.iter().all(|s| s.1 > 0), "{what}: the hook's reports carry their intervals: {seen:?}");
    }
}
