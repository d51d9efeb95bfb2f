use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metronome_core::{Cursor, GroupKey, PeriodId, Prompt, PromptBatch, PromptId, PromptSource, TensorData};
use metronome_pipeline::{Error, PeriodReport, Runner, RunnerOptions, Schedule, StageKind, Stages};

use crate::mocks::*;

struct Outcome {
    reports: Vec<PeriodReport>,
    weights: Vec<f32>,
    log: Arc<Mutex<TrainLog>>,
    emitted: Vec<GroupKey>,
}

async fn run(schedule: Schedule, periods: u64, tick_ms: u64, step_delay_ms: u64) -> Outcome {
    run_with(schedule, periods, tick_ms, |t| t.step_delay = Duration::from_millis(step_delay_ms))
        .await
        .unwrap()
}

/// A run of six prompts a period whose mock trainer `setup` adjusts; `None` when the
/// runner did not finish within a minute (a hang).
async fn run_with(
    schedule: Schedule,
    periods: u64,
    tick_ms: u64,
    setup: impl FnOnce(&mut MockTrainer),
) -> Option<Outcome> {
    let engine = MockEngine::new(Duration::from_millis(tick_ms));
    let mut trainer = MockTrainer::new(engine.generating.clone());
    setup(&mut trainer);
    let log = trainer.log.clone();
    let emitted = engine.emitted.clone();
    let stages = mock_stages(MockSource { next: 0, n: 1000, batch: 6, period: 0 }, engine, trainer);
    let options = RunnerOptions { schedule, periods, group_size: 4, ..RunnerOptions::default() };
    let runner = Runner::new(stages, Some(channel_transport(2)), options).unwrap();
    let end = tokio::time::timeout(Duration::from_secs(60), runner.run()).await.ok()?.unwrap();
    let reports = end.reports;
    let snapshot = end.trainer.snapshot().await.unwrap();
    let TensorData::F32(weights) = snapshot.tensors[0].data.clone() else { unreachable!() };
    let emitted = std::mem::take(&mut *emitted.lock().unwrap());
    Some(Outcome { reports, weights, log, emitted })
}

/// The trained rollouts of each step, sorted by group so orders compare equal.
fn sorted_steps(log: &Mutex<TrainLog>) -> Vec<Vec<(GroupKey, Vec<Vec<u32>>)>> {
    let mut steps = log.lock().unwrap().steps.clone();
    for s in &mut steps {
        s.sort_by_key(|(k, _)| *k);
    }
    steps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_and_periodic_train_identical_rollouts_to_equal_weights() {
    let sync = run(Schedule::Sync, 4, 2, 0).await;
    let periodic = run(Schedule::Periodic, 4, 2, 0).await;
    assert_eq!(sync.reports.len(), 4);
    assert_eq!(periodic.reports.len(), 4);
    // Token-identical rollouts: every group of every step, with its tokens.
    let (a, b) = (sorted_steps(&sync.log), sorted_steps(&periodic.log));
    assert_eq!(a.len(), 4);
    assert!(a.iter().all(|s| s.len() == 6));
    assert_eq!(a, b);
    // Identical rewards.
    for (x, y) in sync.reports.iter().zip(&periodic.reports) {
        assert_eq!(x.reward_mean, y.reward_mean, "period {}", x.period);
        assert_eq!(x.accuracy, y.accuracy);
        assert_eq!(x.staleness, vec![0; 6]);
        assert_eq!(y.staleness, vec![0; 6]);
    }
    for (x, y) in sync.weights.iter().zip(&periodic.weights) {
        assert!((x - y).abs() <= 1e-6, "{:?} vs {:?}", sync.weights, periodic.weights);
    }
    // The weights moved, so equality is not vacuous.
    assert_ne!(sync.weights, vec![0.1, -0.2, 0.3, 0.05]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_trains_groups_while_generation_continues() {
    let periodic = run(Schedule::Periodic, 3, 15, 0).await;
    let log = std::mem::take(&mut *periodic.log.lock().unwrap());
    // Groups complete tens of milliseconds apart and accumulation is instant, so the
    // trainer consumes early groups while later ones are still being generated.
    assert!(log.during_generation >= 3, "only {} accumulations overlapped generation", log.during_generation);
    // And groups are consumed in completion order (the engine's emission order), which
    // is not the release order.
    let trained: Vec<GroupKey> = log.steps.iter().flatten().map(|(k, _)| *k).collect();
    assert_eq!(trained, periodic.emitted, "trained out of completion order");
    assert!(!trained.is_sorted(), "completion order happened to equal release order");
    let sync = run(Schedule::Sync, 3, 15, 0).await;
    assert_eq!(sync.log.lock().unwrap().during_generation, 0, "sync never overlaps");
    // Every period of a sync run is generation, then scoring, then training, in order.
    for report in &sync.reports {
        let gen_end = report.intervals.iter().find(|i| i.stage == StageKind::Generation).unwrap().end_s;
        let train_start = report.intervals.iter().find(|i| i.stage == StageKind::Training).unwrap().start_s;
        assert!(gen_end <= train_start);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_step_stalls_no_schedule_and_is_reported() {
    // The trainer's guard refuses the steps closing periods 1 and 2: the weights stay,
    // the versions still advance, and every schedule runs all its periods.
    let refusing = |t: &mut MockTrainer| t.refuse = [1, 2].into();
    let mut outcomes = Vec::new();
    for schedule in [Schedule::Sync, Schedule::Periodic, Schedule::Stale(1)] {
        let outcome = run_with(schedule, 5, 2, refusing).await.unwrap_or_else(|| panic!("{schedule} hung"));
        let applied: Vec<bool> = outcome.reports.iter().map(|r| r.step.applied).collect();
        assert_eq!(applied, [true, false, false, true, true], "{schedule}");
        let versions: Vec<u64> = outcome.reports.iter().map(|r| r.step.version.0).collect();
        assert_eq!(versions, [1, 2, 3, 4, 5], "{schedule}");
        assert!(outcome.reports.iter().all(|r| r.groups == 6), "{schedule}");
        outcomes.push(outcome);
    }
    // The refusals are part of the run, so `sync` and `periodic` still agree, and
    // the weights differ from a run without refusals.
    let (sync, periodic) = (&outcomes[0], &outcomes[1]);
    assert_eq!(sorted_steps(&sync.log), sorted_steps(&periodic.log));
    assert_eq!(sync.weights, periodic.weights);
    let unrefused = run(Schedule::Sync, 5, 2, 0).await;
    assert_ne!(sync.weights, unrefused.weights, "the refusals changed nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_prompts_and_groups_that_do_not_pack_are_counted_and_the_periods_complete() {
    // Prompt 1 (period 0) is rejected by the engine; prompt 8 (period 1) does not pack.
    let mut trained = Vec::new();
    for schedule in [Schedule::Sync, Schedule::Periodic, Schedule::Stale(1)] {
        let mut engine = MockEngine::new(Duration::from_millis(2));
        engine.reject = [1].into();
        let trainer = MockTrainer::new(engine.generating.clone());
        let log = trainer.log.clone();
        let stages = Stages {
            source: Box::new(MockSource { next: 0, n: 1000, batch: 6, period: 0 }),
            engine: Arc::new(engine),
            scorer: Arc::new(MockScorer),
            packer: failing_packer([8].into()),
            trainer: Box::new(trainer),
        };
        let options = RunnerOptions { schedule, periods: 3, group_size: 4, ..RunnerOptions::default() };
        let run = Runner::new(stages, Some(channel_transport(2)), options).unwrap().run();
        let reports = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .unwrap_or_else(|_| panic!("{schedule} hung"))
            .unwrap()
            .reports;
        let counts: Vec<(usize, usize)> = reports.iter().map(|r| (r.groups, r.rejected)).collect();
        assert_eq!(counts, [(5, 1), (5, 1), (6, 0)], "{schedule}: (trained, rejected) per period");
        let keys: Vec<Vec<u64>> = log
            .lock()
            .unwrap()
            .steps
            .iter()
            .map(|s| s.iter().map(|(k, _)| k.prompt.0).collect::<BTreeSet<_>>().into_iter().collect())
            .collect();
        assert_eq!(keys, [vec![0, 2, 3, 4, 5], vec![6, 7, 9, 10, 11], (12..18).collect()], "{schedule}");
        trained.push(sorted_steps(&log));
    }
    assert_eq!(trained[0], trained[1], "sync and periodic trained different rollouts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_whose_version_stands_still_is_an_error_not_a_hang() {
    for schedule in [Schedule::Sync, Schedule::Periodic, Schedule::Stale(1)] {
        let engine = MockEngine::new(Duration::from_millis(1));
        let mut trainer = MockTrainer::new(engine.generating.clone());
        trainer.refuse = [1].into();
        trainer.keep_version_when_refusing = true;
        let stages = mock_stages(MockSource { next: 0, n: 1000, batch: 3, period: 0 }, engine, trainer);
        let options = RunnerOptions { schedule, periods: 4, group_size: 2, ..RunnerOptions::default() };
        let run = Runner::new(stages, Some(channel_transport(4)), options).unwrap().run();
        let err = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .unwrap_or_else(|_| panic!("{schedule} hung"))
            .unwrap_err();
        assert!(matches!(err, Error::TrainerVersion { .. }), "{schedule}: {err}");
        assert_eq!(
            err.to_string(),
            "the trainer's step closing period 1 moved its version from 1 to 1 (reported 1); a step \
             must advance it by exactly one, also when it refuses the update, or the schedules wait for \
             a version that never comes",
            "{schedule}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_schedule_shows_its_hook_the_weights_the_step_produced() {
    // What a hook evaluates or checkpoints must not depend on the schedule: `sync`
    // once showed the period's starting weights, the overlapped schedules the new ones,
    // so held-out accuracy of equal runs differed by a step.
    let mut seen = Vec::new();
    for schedule in [Schedule::Sync, Schedule::Periodic, Schedule::Stale(1)] {
        let engine = MockEngine::new(Duration::from_millis(1));
        let trainer = MockTrainer::new(engine.generating.clone());
        let stages = mock_stages(MockSource { next: 0, n: 1000, batch: 3, period: 0 }, engine, trainer);
        let options = RunnerOptions { schedule, periods: 3, group_size: 2, ..RunnerOptions::default() };
        let hooked = Arc::new(Mutex::new(Vec::new()));
        let record = hooked.clone();
        let runner =
            Runner::new(stages, Some(channel_transport(4)), options).unwrap().on_period(move |end| {
                assert_eq!(end.weights.version, end.report.step.version, "{schedule}");
                record.lock().unwrap().push(end.weights.clone());
                Ok(())
            });
        let end = runner.run().await.unwrap();
        let last = end.trainer.snapshot().await.unwrap();
        let hooked = std::mem::take(&mut *hooked.lock().unwrap());
        assert_eq!(*hooked.last().unwrap().as_ref(), last, "{schedule}: the last hook saw other weights");
        seen.push(hooked);
    }
    // `sync` and `periodic` are the same run.
    assert_eq!(seen[0], seen[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_schedule_bounds_staleness_and_runs_ahead() {
    // A slow trainer step lets generation run ahead by up to one version.
    let stale = run(Schedule::Stale(1), 5, 2, 40).await;
    assert_eq!(stale.reports.len(), 5);
    let staleness: Vec<u64> = stale.reports.iter().flat_map(|r| r.staleness.iter().copied()).collect();
    assert_eq!(staleness.len(), 30);
    assert!(staleness.iter().all(|&s| s <= 1), "{staleness:?}");
    assert!(staleness.contains(&1), "generation never ran ahead: {staleness:?}");
    assert!(stale.reports.iter().all(|r| r.dropped_stale == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_older_than_the_bound_are_never_trained() {
    // An engine that claims every completion came from version 0.
    let mut engine = MockEngine::new(Duration::from_millis(1));
    engine.force_version = Some(metronome_core::PolicyVersion(0));
    let trainer = MockTrainer::new(engine.generating.clone());
    let log = trainer.log.clone();
    let stages = mock_stages(MockSource { next: 0, n: 1000, batch: 3, period: 0 }, engine, trainer);
    let options =
        RunnerOptions { schedule: Schedule::Stale(1), periods: 4, group_size: 2, ..RunnerOptions::default() };
    let reports =
        Runner::new(stages, Some(channel_transport(4)), options).unwrap().run().await.unwrap().reports;
    // Periods 0 and 1 are within the bound (staleness 0 and 1); 2 and 3 are not.
    let dropped: Vec<usize> = reports.iter().map(|r| r.dropped_stale).collect();
    assert_eq!(dropped, vec![0, 0, 3, 3]);
    let trained: Vec<usize> = log.lock().unwrap().steps.iter().map(Vec::len).collect();
    assert_eq!(trained, vec![3, 3, 0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_partial_rollouts_the_oldest_token_decides_and_every_period_completes() {
    // A partial rollout's first tokens claim version 0 and the rest the weights
    // installed when its period generated, which are within the bound: the group's
    // staleness is its oldest token's. With the producer releasing each period as
    // soon as its weights allow (periods generating at once), every period completes.
    let mut engine = MockEngine::new(Duration::from_millis(1));
    engine.force_version = Some(metronome_core::PolicyVersion(0));
    engine.switch_to_installed = true;
    let trainer = MockTrainer::new(engine.generating.clone());
    let log = trainer.log.clone();
    let stages = mock_stages(MockSource { next: 0, n: 1000, batch: 3, period: 0 }, engine, trainer);
    let options = RunnerOptions {
        schedule: Schedule::Stale(1),
        periods: 4,
        group_size: 2,
        partial_rollouts: true,
        ..RunnerOptions::default()
    };
    let run = Runner::new(stages, Some(channel_transport(4)), options).unwrap().run();
    let reports = tokio::time::timeout(Duration::from_secs(60), run).await.expect("hung").unwrap().reports;
    let dropped: Vec<usize> = reports.iter().map(|r| r.dropped_stale).collect();
    assert_eq!(dropped, vec![0, 0, 3, 3]);
    let trained: Vec<usize> = log.lock().unwrap().steps.iter().map(Vec::len).collect();
    assert_eq!(trained, vec![3, 3, 0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_options_fail_before_any_work_naming_the_key() {
    let engine = MockEngine::new(Duration::from_millis(1));
    let trainer = MockTrainer::new(engine.generating.clone());
    let accumulations = trainer.accumulations.clone();
    let stages = mock_stages(MockSource { next: 0, n: 10, batch: 2, period: 0 }, engine, trainer);
    let err = Runner::new(
        stages,
        None,
        RunnerOptions { schedule: Schedule::Periodic, periods: 1, group_size: 2, ..RunnerOptions::default() },
    )
    .unwrap_err()
    .to_string();
    assert_eq!(err, "invalid configuration `schedule`: `periodic` overlaps stages and needs a transport");
    assert_eq!(accumulations.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_runs_out_ends_the_run_early() {
    let engine = MockEngine::new(Duration::from_millis(1));
    let trainer = MockTrainer::new(engine.generating.clone());
    for schedule in [Schedule::Sync, Schedule::Periodic] {
        let engine = MockEngine::new(Duration::from_millis(1));
        let trainer = MockTrainer::new(engine.generating.clone());
        let stages = mock_stages(MockSource { next: 0, n: 5, batch: 2, period: 0 }, engine, trainer);
        let options = RunnerOptions { schedule, periods: 10, group_size: 2, ..RunnerOptions::default() };
        let reports =
            Runner::new(stages, Some(channel_transport(2)), options).unwrap().run().await.unwrap().reports;
        let groups: Vec<usize> = reports.iter().map(|r| r.groups).collect();
        assert_eq!(groups, vec![2, 2, 1], "{schedule}");
    }
    drop((engine, trainer));
}

/// Releases one period holding prompt 0 twice.
struct RepeatingSource;

#[async_trait::async_trait]
impl PromptSource for RepeatingSource {
    async fn next_batch(&mut self) -> metronome_core::Result<Option<PromptBatch>> {
        let prompt = Prompt { id: PromptId(0), text: "p0".into(), tokens: vec![0], ..Prompt::default() };
        Ok(Some(PromptBatch { period: PeriodId(0), prompts: vec![prompt.clone(), prompt] }))
    }

    fn cursor(&self) -> Cursor {
        Cursor::default()
    }

    fn restore(&mut self, _: Cursor) -> metronome_core::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_holding_a_prompt_twice_is_an_error_not_a_hang() {
    // Its second group would share the first one's identity and be dropped as a
    // redelivery: the period would wait for it forever.
    for schedule in [Schedule::Sync, Schedule::Periodic] {
        let engine = MockEngine::new(Duration::from_millis(1));
        let trainer = MockTrainer::new(engine.generating.clone());
        let stages = Stages {
            source: Box::new(RepeatingSource),
            engine: Arc::new(engine),
            scorer: Arc::new(MockScorer),
            packer: mock_packer(),
            trainer: Box::new(trainer),
        };
        let options = RunnerOptions { schedule, periods: 2, group_size: 2, ..RunnerOptions::default() };
        let run = Runner::new(stages, Some(channel_transport(2)), options).unwrap().run();
        let err = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("the run hung")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err, "period 0 holds prompt 0 twice; a prompt source must release distinct prompts per period",
            "{schedule}"
        );
    }
}
