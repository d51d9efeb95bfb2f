//! The trainer scores the distribution the rollout engine sampled from: on the same
//! weights, at a sampling temperature other than 1, the trainer's log-prob of every
//! sampled token equals the behaviour log-prob the engine recorded, within
//! [`TOLERANCE`]; a trainer that scores at T = 1 (what it did before) misses by far
//! more.

use std::sync::Mutex;

use async_trait::async_trait;
use metronome_core::{
    AdvantageEstimator, Group, GroupSink, PeriodId, Reward, RolloutRequest, ScoredGroup, TrainBatch,
};
use metronome_pipeline::{PipelineConfig, build_stages, load_model};
use metronome_trainer::GrpoTrainer;

/// Largest `|trainer log-prob − engine log-prob|` accepted, in nats. The engine
/// decodes with a KV cache and its own batch-invariant kernels (f64 log-softmax), the
/// trainer runs the packed training forward (f32): the same function in a different
/// order of operations.
const TOLERANCE: f32 = 1e-5;

const TEMPERATURE: f32 = 0.7;

struct Collect(Mutex<Vec<Group>>);

#[async_trait]
impl GroupSink for Collect {
    async fn emit(&self, group: Group) -> metronome_core::Result<()> {
        self.0.lock().unwrap().push(group);
        Ok(())
    }
}

/// `max |a − b|`.
fn max_gap(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The trainer's log-prob of every target of `batch`: its policy scoring at the
/// temperature it was built with, as its forward does.
fn trainer_logprobs(trainer: &GrpoTrainer, batch: &TrainBatch) -> Vec<f32> {
    let policy = trainer.policy();
    let prepared = policy.prepare_batch(&batch.rows, &batch.targets).unwrap();
    policy.score(&prepared, trainer.sampling_temperature()).unwrap().logprobs.to_vec1::<f32>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trainer_scores_each_sampled_token_as_the_engine_recorded_it() {
    // Masked IS with a band of ±TOLERANCE around a behaviour ratio of 1: the trainer
    // keeps a token only if its log-prob (old = current on-policy) is within
    // TOLERANCE of the engine's, so the step's token count checks every token.
    let band = format!(
        "trainer.loss.masked_is={{ level = \"token\", lower = {}, upper = {} }}",
        (-TOLERANCE).exp(),
        TOLERANCE.exp()
    );
    let overrides: Vec<String> = [
        "sft.steps=0",
        "eval.prompts=0",
        "data.release.batch_size=6",
        "run.group_size=4",
        "rollout.workers=1",
        "rollout.max_num_seqs=8",
        "rollout.sampling.max_new_tokens=12",
        &format!("rollout.sampling.temperature={TEMPERATURE}"),
        &band,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let config = PipelineConfig::embedded(&overrides).unwrap();
    let (model, tokenizer) = load_model(&config, config.trainer_device()).unwrap();
    let at_one = GrpoTrainer::new(config.trainer.clone(), model.clone())
        .unwrap()
        .with_sampling_temperature(1.0)
        .unwrap();
    let (mut stages, handle) = build_stages(&config, model, tokenizer).unwrap();
    assert_eq!(handle.lock().sampling_temperature(), TEMPERATURE, "built from rollout.sampling.temperature");

    // One period of groups sampled by the engine at TEMPERATURE.
    let prompts = stages.source.next_batch().await.unwrap().unwrap().prompts;
    let sink = Collect(Mutex::new(Vec::new()));
    let request = RolloutRequest { period: PeriodId(0), prompts, group_size: 4 };
    stages.engine.generate(request, &sink).await.unwrap();
    let groups = sink.0.into_inner().unwrap();
    assert_eq!(groups.len(), 6);
    // Rewards that differ within each group, so no group is left out of the loss.
    let scored: Vec<ScoredGroup> = groups
        .into_iter()
        .map(|g| {
            let rewards = (0..g.completions.len()).map(|i| Reward::scalar(i as f32)).collect();
            ScoredGroup::new(g, rewards, AdvantageEstimator::GroupMean).unwrap()
        })
        .collect();
    let batches: Vec<TrainBatch> = metronome_masking::pack_period(&scored, &config.packing)
        .unwrap()
        .into_iter()
        .map(|l| l.batch)
        .collect();
    let targets: usize = batches.iter().map(|b| b.targets.len()).sum();
    assert!(targets >= 6 * 4, "every response has a token");

    let (mut gap, mut gap_at_one) = (0f32, 0f32);
    for b in &batches {
        gap = gap.max(max_gap(&trainer_logprobs(&handle.lock(), b), &b.targets.behaviour_logprob));
        gap_at_one = gap_at_one.max(max_gap(&trainer_logprobs(&at_one, b), &b.targets.behaviour_logprob));
    }
    eprintln!(
        "{targets} sampled tokens at T = {TEMPERATURE}: max |trainer − engine| = {gap:e} scored at T, \
         {gap_at_one:e} scored at 1"
    );
    assert!(gap <= TOLERANCE, "trainer and engine log-probs differ by {gap}");
    assert!(gap_at_one > 100.0 * TOLERANCE, "scored at T = 1 the gap is only {gap_at_one}");

    // Through the trainers' own forwards: every token kept at T, most dropped at 1.
    let mut at_t = handle.lock();
    let mut at_one = at_one;
    for b in &batches {
        at_t.accumulate_sync(b).unwrap();
        at_one.accumulate_sync(b).unwrap();
    }
    let (kept, kept_at_one) = (at_t.step_sync().unwrap().tokens, at_one.step_sync().unwrap().tokens);
    assert_eq!(kept, targets as u64, "tokens outside ±{TOLERANCE} nats at T = {TEMPERATURE}");
    assert!(kept_at_one < targets as u64 / 2, "{kept_at_one} of {targets} within ±{TOLERANCE} nats at T = 1");
}
