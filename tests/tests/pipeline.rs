//! The pipeline on the real stages (tiny model, real engine, reward pool, masking,
//! trainer, in-process transport): `sync` and `periodic` are the same algorithm.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use metronome_core::{
    Completion, Group, GroupKey, GroupScorer, PeriodId, Prompt, ScoredGroup, TensorData, TrainBatch,
    WeightSnapshot,
};
use metronome_pipeline::{
    Packer, PeriodReport, PipelineConfig, Runner, RunnerOptions, Schedule, StageKind, Stages, build_stages,
    load_model, local_transport,
};
use metronome_reward::{PoolConfig, PoolScorer};

/// Per group: the tokens of every response and their rewards.
type Rollouts = BTreeMap<GroupKey, (Vec<Vec<u32>>, Vec<f32>)>;

/// Records every scored group on its way to the trainer.
struct Recording {
    inner: Arc<dyn GroupScorer>,
    seen: Arc<Mutex<Rollouts>>,
}

#[async_trait]
impl GroupScorer for Recording {
    async fn score(&self, group: Group) -> metronome_core::Result<ScoredGroup> {
        let scored = self.inner.score(group).await?;
        let tokens = scored.group.completions.iter().map(|c| c.tokens.clone()).collect();
        let rewards = scored.rewards.iter().map(|r| r.total).collect();
        self.seen.lock().unwrap().insert(scored.key(), (tokens, rewards));
        Ok(scored)
    }
}

/// A reward that varies for an untrained model's responses: the share of digits.
fn digit_share(_: &Prompt, c: &Completion) -> f32 {
    let digits = c.text.chars().filter(char::is_ascii_digit).count();
    digits as f32 / c.text.chars().count().max(1) as f32
}

async fn run(schedule: Schedule, workers: usize) -> (Rollouts, Vec<PeriodReport>, WeightSnapshot) {
    run_with(schedule, workers, &[]).await
}

/// [`run`] with more config overrides (e.g. a device).
async fn run_with(
    schedule: Schedule,
    workers: usize,
    extra: &[&str],
) -> (Rollouts, Vec<PeriodReport>, WeightSnapshot) {
    run_scored(schedule, workers, extra, |_, _| {}).await
}

/// [`run_with`] with the stages (their scorer records what was generated) changed by
/// `wrap`; a run that does not finish within five minutes fails the test (a hang).
async fn run_scored(
    schedule: Schedule,
    workers: usize,
    extra: &[&str],
    wrap: impl FnOnce(&mut Stages, &PipelineConfig),
) -> (Rollouts, Vec<PeriodReport>, WeightSnapshot) {
    run_configured(schedule, workers, extra, |_| {}, wrap).await
}

/// [`run_scored`] with the config changed by `tweak` before it is prepared.
async fn run_configured(
    schedule: Schedule,
    workers: usize,
    extra: &[&str],
    tweak: impl FnOnce(&mut PipelineConfig),
    wrap: impl FnOnce(&mut Stages, &PipelineConfig),
) -> (Rollouts, Vec<PeriodReport>, WeightSnapshot) {
    let mut overrides: Vec<String> = [
        "run.periods=3".to_owned(),
        "run.group_size=4".to_owned(),
        "data.release.batch_size=6".to_owned(),
        "sft.steps=0".to_owned(),
        "eval.prompts=0".to_owned(),
        "rollout.max_num_seqs=8".to_owned(),
        format!("rollout.workers={workers}"),
        format!("run.schedule=\"{schedule}\""),
        // The stage pools must not change results: placement is part of the test.
        "run.cores=2".to_owned(),
        "trainer.schedule.lr=0.01".to_owned(),
    ]
    .to_vec();
    if !schedule.is_on_policy() {
        overrides.push("trainer.loss.tis_cap=2.0".to_owned());
    }
    overrides.extend(extra.iter().map(|s| (*s).to_owned()));
    let mut config = PipelineConfig::embedded(&overrides).unwrap();
    tweak(&mut config);
    config.prepare().unwrap();
    let (model, tokenizer) = load_model(&config, config.trainer_device()).unwrap();
    assert!(tokenizer.vocab_size() > 0);
    let (mut stages, _trainer) = build_stages(&config, model, tokenizer).unwrap();
    let seen = Arc::new(Mutex::new(Rollouts::new()));
    let pool = PoolScorer::new(digit_share, PoolConfig::default()).unwrap();
    stages.scorer = Arc::new(Recording { inner: Arc::new(pool), seen: seen.clone() });
    wrap(&mut stages, &config);
    let transport = (schedule != Schedule::Sync).then(|| local_transport(&config));
    let run = Runner::new(stages, transport, RunnerOptions::from(&config)).unwrap().run();
    let end = tokio::time::timeout(std::time::Duration::from_secs(300), run)
        .await
        .unwrap_or_else(|_| panic!("{schedule} hung"))
        .unwrap();
    let (reports, weights) = (end.reports, end.trainer.snapshot().await.unwrap());
    let rollouts = std::mem::take(&mut *seen.lock().unwrap());
    (rollouts, reports, weights)
}

/// The embedded default model's weights before any training.
fn initial_weights() -> WeightSnapshot {
    let config = PipelineConfig::embedded(&[]).unwrap();
    let (model, _) = load_model(&config, config.trainer_device()).unwrap();
    model.snapshot(metronome_core::PolicyVersion(0)).unwrap()
}

fn max_weight_difference(a: &WeightSnapshot, b: &WeightSnapshot) -> f32 {
    let mut max = 0f32;
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!(x.name, y.name);
        let (TensorData::F32(x), TensorData::F32(y)) = (&x.data, &y.data) else { panic!("f32 weights") };
        for (p, q) in x.iter().zip(y) {
            max = max.max((p - q).abs());
        }
    }
    max
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_and_periodic_agree_with_one_and_two_workers() {
    let (base_rollouts, base_reports, base_weights) = run(Schedule::Sync, 1).await;
    assert_eq!(base_rollouts.len(), 18, "3 periods of 6 groups");
    assert!(base_reports.iter().all(|r| r.groups == 6 && r.generated_tokens > 0));
    // The rewards vary, so the weights move and equality below is not vacuous.
    assert!(base_reports.iter().any(|r| r.step.tokens > 0), "every group had equal rewards");
    let initial = initial_weights();
    assert!(max_weight_difference(&initial, &base_weights) > 1e-4, "training did not move the weights");

    for (schedule, workers) in [(Schedule::Periodic, 1), (Schedule::Sync, 2), (Schedule::Periodic, 2)] {
        let (rollouts, reports, weights) = run(schedule, workers).await;
        assert_eq!(rollouts, base_rollouts, "{schedule} with {workers} workers: rollouts or rewards differ");
        let tokens = |r: &[PeriodReport]| r.iter().map(|p| p.generated_tokens).collect::<Vec<_>>();
        assert_eq!(
            tokens(&reports),
            tokens(&base_reports),
            "{schedule} with {workers} workers: token counts"
        );
        let diff = max_weight_difference(&base_weights, &weights);
        assert!(diff <= 1e-6, "{schedule} with {workers} workers: weights differ by {diff}");
    }
}

/// Every loss variant (and dynamic sampling, and LoRA) keeps `sync` equal to
/// `periodic`: the same rollouts and weights within 1e-6 (REINFORCE++'s batch
/// normaliser is applied at step time, so completion order cannot change it; masked
/// IS, GSPO and the temperature are per group), and the weights moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_and_periodic_agree_for_every_loss_variant() {
    let variants: [&[&str]; 7] = [
        // GSPO, scored at a sampling temperature other than 1, with a KL term.
        &[
            "trainer.loss.ratio_level=\"sequence\"",
            "trainer.loss.aggregation={ kind = \"seq_mean_token_mean\" }",
            "rollout.sampling.temperature=0.7",
            "trainer.loss.kl_coef=0.01",
        ],
        // REINFORCE++-baseline with KL and entropy terms (accumulated apart), masked IS.
        &[
            "trainer.advantage=\"reinforce_plus_plus_baseline\"",
            "trainer.loss.kl_coef=0.01",
            "trainer.loss.entropy_coef=0.001",
            "trainer.loss.masked_is={ level = \"token\", upper = 1.5 }",
        ],
        // Dr. GRPO.
        &[
            "trainer.advantage=\"group_mean\"",
            "trainer.loss.aggregation={ kind = \"constant_normaliser\", max_tokens = 8 }",
        ],
        // DAPO's dynamic sampling: 4 of the 6 groups, those whose rewards vary first;
        // and again with groups packed in sets of 4, where filtered groups settle their
        // set's place without training.
        &["run.dynamic_sampling={ groups = 4 }"],
        &["run.dynamic_sampling={ groups = 4 }", "packing.groups_per_pack=4"],
        // RLOO with truncated IS and geometric masked IS.
        &[
            "trainer.advantage=\"leave_one_out\"",
            "trainer.loss.tis_cap=2.0",
            "trainer.loss.masked_is={ level = \"geometric\", lower = 0.5, upper = 2.0 }",
        ],
        // LoRA on every projection, with the base as the KL reference; the weights
        // compared are the merged ones the engine decodes.
        &["trainer.lora={ rank = 4, alpha = 8.0 }", "trainer.loss.kl_coef=0.01"],
    ];
    let initial = initial_weights();
    for extra in variants {
        let (base_rollouts, base_reports, base_weights) = run_with(Schedule::Sync, 1, extra).await;
        assert!(base_reports.iter().any(|r| r.step.tokens > 0), "{extra:?}: nothing trained");
        let moved = max_weight_difference(&initial, &base_weights);
        assert!(moved > 1e-5, "{extra:?}: the weights moved by {moved} only");
        let (rollouts, _, weights) = run_with(Schedule::Periodic, 1, extra).await;
        assert_eq!(rollouts, base_rollouts, "{extra:?}: rollouts or rewards differ");
        let diff = max_weight_difference(&base_weights, &weights);
        assert!(diff <= 1e-6, "{extra:?}: weights differ by {diff}");
    }
}

/// The training intervals of each period before its step's: one per group, or one
/// per set of groups packed together.
fn training_intervals(reports: &[PeriodReport]) -> Vec<usize> {
    reports
        .iter()
        .map(|r| r.intervals.iter().filter(|i| i.stage == StageKind::Training).count() - 1)
        .collect()
}

/// `packing.groups_per_pack`: a period's 6 groups train in sets of 4 and 2 fixed by
/// release order, each packed together once all of it is in, so `sync` and `periodic`
/// (one and two workers, where arrival orders differ) still train the same
/// micro-batches to the same weights. The first period's rollouts, from the same
/// weights, are those of training each group alone, and so are its loss and token
/// count up to the packing's rounding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_packed_together_keep_sync_equal_to_periodic() {
    let packed = ["packing.groups_per_pack=4"];
    let (base_rollouts, base_reports, base_weights) = run_with(Schedule::Sync, 1, &packed).await;
    assert_eq!(training_intervals(&base_reports), [2, 2, 2], "sync: sets of 4 and 2");
    assert!(
        max_weight_difference(&initial_weights(), &base_weights) > 1e-4,
        "training did not move the weights"
    );
    for (schedule, workers) in [(Schedule::Periodic, 1), (Schedule::Periodic, 2)] {
        let (rollouts, reports, weights) = run_with(schedule, workers, &packed).await;
        assert_eq!(rollouts, base_rollouts, "{schedule} with {workers} workers: rollouts or rewards differ");
        assert_eq!(training_intervals(&reports), [2, 2, 2], "{schedule} with {workers} workers");
        let diff = max_weight_difference(&base_weights, &weights);
        assert!(diff <= 1e-6, "{schedule} with {workers} workers: weights differ by {diff}");
    }
    let (alone_rollouts, alone_reports, _) = run(Schedule::Sync, 1).await;
    assert_eq!(training_intervals(&alone_reports), [6, 6, 6], "one group at a time");
    let first = |r: &Rollouts| {
        r.iter().filter(|(k, _)| k.period == PeriodId(0)).map(|(k, v)| (*k, v.clone())).collect::<Vec<_>>()
    };
    assert_eq!(first(&alone_rollouts), first(&base_rollouts));
    let (a, b) = (&alone_reports[0].step, &base_reports[0].step);
    assert_eq!((a.tokens, a.sequences, a.groups), (b.tokens, b.sequences, b.groups));
    assert!(
        (a.loss - b.loss).abs() <= 1e-5 * a.loss.abs().max(1.0),
        "loss {} alone, {} packed",
        a.loss,
        b.loss
    );
}

/// A set of groups that does not pack together (a packer that refuses more than one
/// group) trains each of its groups alone: the run completes with the weights of
/// training every group as it arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_that_do_not_pack_together_train_alone() {
    let refuse_sets = |stages: &mut Stages, _: &PipelineConfig| {
        let inner = stages.packer.clone();
        stages.packer = Arc::new(move |groups: &[ScoredGroup]| -> metronome_core::Result<Vec<TrainBatch>> {
            if groups.len() > 1 {
                return Err(metronome_core::Error::Invalid {
                    what: format!("{} groups", groups.len()),
                    reason: "this packer packs one group at a time".to_owned(),
                });
            }
            inner.pack(groups)
        });
    };
    let (_, alone_reports, alone) = run(Schedule::Periodic, 1).await;
    let (_, reports, weights) =
        run_scored(Schedule::Periodic, 1, &["packing.groups_per_pack=4"], refuse_sets).await;
    assert_eq!(training_intervals(&reports), [2, 2, 2], "still trained as sets");
    assert_eq!(reports.iter().map(|r| r.groups).collect::<Vec<_>>(), [6, 6, 6]);
    let diff = max_weight_difference(&alone, &weights);
    assert!(diff <= 1e-6, "weights differ by {diff} from training each group alone");
    assert_eq!(training_intervals(&alone_reports), [6, 6, 6]);
}

/// Packs every group of one period with NaN advantages (the trainer's side computes
/// advantages from the rewards, so the scorer cannot poison them), so that the
/// trainer's non-finite guard refuses the step that closes it.
fn nan_advantages_in(period: PeriodId, inner: Arc<dyn Packer>) -> Arc<dyn Packer> {
    Arc::new(move |groups: &[ScoredGroup]| -> metronome_core::Result<Vec<TrainBatch>> {
        let mut batches = inner.pack(groups)?;
        if groups.iter().any(|g| g.key().period == period) {
            for batch in &mut batches {
                batch.targets.advantage.fill(f32::NAN);
            }
        }
        Ok(batches)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_the_real_trainer_refuses_stalls_no_schedule() {
    let poison = |stages: &mut Stages| stages.packer = nan_advantages_in(PeriodId(1), stages.packer.clone());
    let mut weights = Vec::new();
    for schedule in [Schedule::Sync, Schedule::Periodic, Schedule::Stale(1)] {
        let (rollouts, reports, w) = run_scored(schedule, 1, &[], |s, _| poison(s)).await;
        assert_eq!(rollouts.len(), 18, "{schedule}: every period generated");
        let applied: Vec<bool> = reports.iter().map(|r| r.step.applied).collect();
        assert_eq!(applied, [true, false, true], "{schedule}: only period 1's step is refused");
        let versions: Vec<u64> = reports.iter().map(|r| r.step.version.0).collect();
        assert_eq!(versions, [1, 2, 3], "{schedule}: versions count periods");
        weights.push(w);
    }
    let diff = max_weight_difference(&weights[0], &weights[1]);
    assert!(diff <= 1e-6, "sync and periodic differ by {diff} after a refused step");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_schedule_trains_nothing_older_than_its_bound() {
    let (rollouts, reports, _) = run(Schedule::Stale(1), 1).await;
    assert_eq!(rollouts.len(), 18);
    let staleness: Vec<u64> = reports.iter().flat_map(|r| r.staleness.iter().copied()).collect();
    assert_eq!(staleness.len(), 18, "every group trained");
    assert!(staleness.iter().all(|&s| s <= 1), "{staleness:?}");
    assert!(reports.iter().all(|r| r.dropped_stale == 0));
}

/// `sync` and `periodic` on a CUDA GPU (trainer and engine sharing it): the same
/// rollouts and rewards, and weights within 1e-6, with one engine worker. Skipped, with
/// the reason printed, without the `cuda` feature or a GPU (`cargo xtask gpu` runs it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_sync_and_periodic_agree() {
    if !cfg!(feature = "cuda") {
        eprintln!("skipped: built without the `cuda` feature (`cargo xtask gpu` runs this on a GPU)");
        return;
    }
    if let Err(e) = metronome_model::DeviceSpec::Cuda(0).open() {
        eprintln!("skipped: no CUDA device: {e}");
        return;
    }
    let gpu = ["model.device=\"cuda:0\""];
    let (base_rollouts, base_reports, base_weights) = run_with(Schedule::Sync, 1, &gpu).await;
    assert_eq!(base_rollouts.len(), 18, "3 periods of 6 groups");
    assert!(base_reports.iter().any(|r| r.step.tokens > 0), "every group had equal rewards");
    let (rollouts, _, weights) = run_with(Schedule::Periodic, 1, &gpu).await;
    assert_eq!(rollouts, base_rollouts, "periodic on the GPU: rollouts or rewards differ");
    let diff = max_weight_difference(&base_weights, &weights);
    assert!(diff <= 1e-6, "periodic on the GPU: weights differ by {diff}");
    // The same run on the CPU: how far the GPU's arithmetic moves the rollouts.
    let (cpu_rollouts, _, cpu_weights) = run(Schedule::Sync, 1).await;
    let same = cpu_rollouts.iter().filter(|(k, v)| base_rollouts.get(k) == Some(v)).count();
    eprintln!(
        "GPU vs CPU sync: {same} of {} groups with identical rollouts; max weight difference {:e}",
        cpu_rollouts.len(),
        max_weight_difference(&base_weights, &cpu_weights)
    );
}

/// Held-out evaluation is a function of the weights, the run seed, the prompt and the
/// sample index only: `sync` and `periodic` runs, whose weights are equal, report the
/// same accuracy at every point (a run once printed 1.6% for one and 6.2% for the
/// other when the schedules showed the evaluation different weights).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_and_periodic_report_the_same_held_out_accuracy() {
    let mut accuracies = Vec::new();
    for schedule in [Schedule::Sync, Schedule::Periodic] {
        let out = tempfile::tempdir().unwrap();
        let overrides = [
            format!("run.out_dir={:?}", out.path().display().to_string()),
            format!("run.schedule=\"{schedule}\""),
            "run.periods=2".to_owned(),
            "run.group_size=4".to_owned(),
            "data.release.batch_size=6".to_owned(),
            "rollout.max_num_seqs=8".to_owned(),
            "run.cores=2".to_owned(),
            // A warm start that answers a few held-out questions (4-7% after 400
            // steps), sampled at T = 1 so every answer depends on its seed.
            "sft.steps=400".to_owned(),
            "eval.prompts=64".to_owned(),
            "eval.samples=2".to_owned(),
            "eval.temperature=1.0".to_owned(),
            "eval.every=1".to_owned(),
        ];
        let config = PipelineConfig::embedded(&overrides).unwrap();
        let outcome =
            metronome_pipeline::run(config, metronome_pipeline::RunOptions::default()).await.unwrap();
        let points: Vec<(u64, f64)> = outcome.evals.iter().map(|e| (e.after_periods, e.accuracy)).collect();
        assert_eq!(points.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1, 2], "{schedule}");
        accuracies.push(points);
    }
    eprintln!("held-out accuracy (after periods, accuracy), sync then periodic: {accuracies:?}");
    assert!(accuracies[0].iter().any(|&(_, a)| a > 0.0), "no held-out answer right: {accuracies:?}");
    assert_eq!(accuracies[0], accuracies[1], "sync vs periodic held-out accuracy");
}

/// Answers each turn with `[k]` and ends the episode after two turns, leaving the
/// reward to the reward stage (the digit share of the whole trajectory).
struct TwoTurns;

struct TwoTurnsEpisode(u32);

#[async_trait]
impl metronome_core::Episode for TwoTurnsEpisode {
    async fn step(&mut self, _turn: &str) -> metronome_core::Result<metronome_core::Observation> {
        self.0 += 1;
        Ok(if self.0 >= 2 {
            metronome_core::Observation::done(None)
        } else {
            metronome_core::Observation::reply(format!(" [{}] ", self.0))
        })
    }
}

impl metronome_core::Environment for TwoTurns {
    fn start(&self, _: &Prompt, _: u32) -> metronome_core::Result<Box<dyn metronome_core::Episode>> {
        Ok(Box::new(TwoTurnsEpisode(0)))
    }

    fn turn_stops(&self) -> Vec<String> {
        // Frequent in the untrained model's text, so most episodes take two turns.
        ["1", "2", "3", "+", "="].map(String::from).to_vec()
    }
}

async fn run_episodes(schedule: Schedule, workers: usize) -> (Rollouts, Vec<PeriodReport>, WeightSnapshot) {
    let extra = ["rollout.sampling.max_new_tokens=24"];
    let observed = Arc::new(Mutex::new(0usize));
    let count = observed.clone();
    let out = run_scored(schedule, workers, &extra, move |stages, config| {
        let (model, tokenizer) = load_model(config, config.rollout_device()).unwrap();
        let engine = config
            .rollout
            .build(
                model.frozen_copy().unwrap(),
                metronome_core::PolicyVersion(0),
                tokenizer,
                metronome_core::RunSeed(config.run.seed),
            )
            .unwrap()
            .with_episodes(metronome_rollout::Episodes {
                environment: Arc::new(TwoTurns),
                max_turns: 2,
                tool_time_limit: std::time::Duration::from_secs(30),
                max_running_calls: 64,
                chat_template: false,
            })
            .unwrap();
        stages.engine = Arc::new(engine);
        let inner = stages.packer.clone();
        stages.packer = Arc::new(move |groups: &[ScoredGroup]| -> metronome_core::Result<Vec<TrainBatch>> {
            *count.lock().unwrap() += groups
                .iter()
                .flat_map(|g| &g.group.completions)
                .filter(|c| c.episode.as_ref().is_some_and(|e| !e.observations.is_empty()))
                .count();
            inner.pack(groups)
        });
    })
    .await;
    assert!(*observed.lock().unwrap() > 20, "too few trajectories had an observation");
    out
}

/// Multi-turn episodes keep `sync` equal to `periodic`: every token of a period's
/// trajectories comes from the period's weights, observations included as context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_and_periodic_agree_with_multi_turn_episodes() {
    let (base_rollouts, base_reports, base_weights) = run_episodes(Schedule::Sync, 1).await;
    assert_eq!(base_rollouts.len(), 18);
    assert!(base_reports.iter().any(|r| r.step.tokens > 0), "every group had equal rewards");
    assert!(max_weight_difference(&initial_weights(), &base_weights) > 1e-4, "the weights did not move");
    for (schedule, workers) in [(Schedule::Periodic, 1), (Schedule::Periodic, 2)] {
        let (rollouts, _, weights) = run_episodes(schedule, workers).await;
        assert_eq!(rollouts, base_rollouts, "{schedule} with {workers} workers: rollouts or rewards differ");
        let diff = max_weight_difference(&base_weights, &weights);
        assert!(diff <= 1e-6, "{schedule} with {workers} workers: weights differ by {diff}");
    }
}

/// The `agent` backend on the pipeline: a program of two chat calls per episode
/// (`agents/two_calls.py`) through the recording proxy.
async fn run_agents(schedule: Schedule, workers: usize) -> (Rollouts, Vec<PeriodReport>, WeightSnapshot) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/agents/two_calls.py");
    let joined = Arc::new(Mutex::new(0usize));
    let count = joined.clone();
    let tweak = move |config: &mut PipelineConfig| {
        config.rollout.backend = metronome_rollout::Backend::Agent;
        config.rollout.agent = metronome_rollout::AgentConfig {
            command: vec!["python3".into(), script.display().to_string()],
            concurrency: 4,
            reward: metronome_rollout::AgentReward::Stage,
            // The messages' text alone, as the native runs write prompts and observations.
            chat_template: Some("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
            ..metronome_rollout::AgentConfig::default()
        };
    };
    let out = run_configured(
        schedule,
        workers,
        &["rollout.sampling.max_new_tokens=12"],
        tweak,
        move |stages, _| {
            let inner = stages.packer.clone();
            stages.packer =
                Arc::new(move |groups: &[ScoredGroup]| -> metronome_core::Result<Vec<TrainBatch>> {
                    *count.lock().unwrap() += groups
                        .iter()
                        .flat_map(|g| &g.group.completions)
                        .filter(|c| c.episode.as_ref().is_some_and(|e| e.turns == 2))
                        .count();
                    inner.pack(groups)
                });
        },
    )
    .await;
    assert!(*joined.lock().unwrap() > 20, "too few episodes joined their two calls into one trajectory");
    out
}

/// The agent backend keeps `sync` equal to `periodic`: the proxy serves every call of
/// a period from the period's weights, seeded by sample and call, so the agents'
/// trajectories and the trained weights agree. Skipped without python3, except
/// under CI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_and_periodic_agree_with_the_agent_backend() {
    if std::process::Command::new("python3").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "python3 is missing under CI");
        return eprintln!("skipped: no python3");
    }
    let (base_rollouts, base_reports, base_weights) = run_agents(Schedule::Sync, 1).await;
    assert_eq!(base_rollouts.len(), 18);
    assert!(base_reports.iter().any(|r| r.step.tokens > 0), "every group had equal rewards");
    assert!(max_weight_difference(&initial_weights(), &base_weights) > 1e-4, "the weights did not move");
    let (rollouts, _, weights) = run_agents(Schedule::Periodic, 1).await;
    assert_eq!(rollouts, base_rollouts, "periodic: rollouts or rewards differ");
    let diff = max_weight_difference(&base_weights, &weights);
    assert!(diff <= 1e-6, "periodic: weights differ by {diff}");
}
