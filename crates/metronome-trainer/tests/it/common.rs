//! Hand-built shared-prompt batches and a tiny model.

use metronome_core::{PolicyVersion, TrainBatch};
use metronome_model::{Device, Model, ModelConfig};
use metronome_testkit::BatchBuilder;
use metronome_trainer::TrainerConfig;
use metronome_trainer::loss::{Aggregation, KlEstimator};

/// A builder of groups sampled by `version`, with a plausible behaviour log-prob
/// (uniform over the tiny vocabulary).
fn builder(version: PolicyVersion) -> BatchBuilder {
    BatchBuilder::new().version(version).behaviour_logprob(-(99f32.ln()))
}

/// One group in the shared-prompt layout (see [`BatchBuilder::shared_prompt`]).
pub(crate) fn group_batch(
    prompt_id: u64,
    prompt: &[u32],
    responses: &[Vec<u32>],
    advantages: &[f32],
) -> TrainBatch {
    group_batch_at(prompt_id, prompt, responses, advantages, PolicyVersion(0))
}

pub(crate) fn group_batch_at(
    prompt_id: u64,
    prompt: &[u32],
    responses: &[Vec<u32>],
    advantages: &[f32],
    version: PolicyVersion,
) -> TrainBatch {
    builder(version).shared_prompt(prompt_id, prompt, responses, advantages).build()
}

/// A group of a period: its prompt id, prompt, responses and advantages.
type GroupSpec = (u64, Vec<u32>, Vec<Vec<u32>>, [f32; 4]);

/// Four groups of four responses with distinct prompts, lengths and advantages.
fn period_specs() -> Vec<GroupSpec> {
    (0..4u32)
        .map(|g| {
            let prompt: Vec<u32> = (0..5 + g).map(|i| 3 + (i * 7 + g * 11) % 90).collect();
            let responses: Vec<Vec<u32>> = (0..4u32)
                .map(|r| (0..3 + (r + g) % 4).map(|j| 3 + (j * 13 + r * 5 + g * 17) % 90).collect())
                .collect();
            let advantages = [1.0, -1.0, 0.5, -0.5].map(|a| a * (1.0 + g as f32 / 4.0));
            (u64::from(g), prompt, responses, advantages)
        })
        .collect()
}

/// The groups of [`period_specs`], one micro-batch each.
pub(crate) fn period_groups() -> Vec<TrainBatch> {
    period_specs()
        .iter()
        .map(|(id, prompt, responses, adv)| group_batch(*id, prompt, responses, adv))
        .collect()
}

/// The groups of [`period_specs`] in one micro-batch, sampled by `version`.
pub(crate) fn period_batch(version: PolicyVersion) -> TrainBatch {
    let fold = |b: BatchBuilder, (id, prompt, responses, adv): &GroupSpec| {
        b.shared_prompt(*id, prompt, responses, adv)
    };
    period_specs().iter().fold(builder(version), fold).build()
}

pub(crate) fn tiny_model() -> Model {
    Model::new(ModelConfig::tiny(), &Device::Cpu, 7).unwrap()
}

pub(crate) fn config() -> TrainerConfig {
    let mut cfg = TrainerConfig::default();
    cfg.schedule.lr = 1e-3;
    cfg
}

/// Every weight as one flat vector.
pub(crate) fn flat_weights(model: &Model) -> Vec<f32> {
    model
        .parameters()
        .iter()
        .flat_map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

/// Every pending gradient of `t` (the next step's, before clipping) flattened, in
/// parameter order.
pub(crate) fn pending_gradients(t: &metronome_trainer::GrpoTrainer) -> Vec<f32> {
    t.pending_gradients()
        .unwrap()
        .unwrap()
        .iter()
        .flat_map(|(_, g)| g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

pub(crate) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The batch with every response stamped as sampled by `version` (fixed groups reused
/// across periods must look on-policy to the trainer, which rejects silent staleness).
pub(crate) fn stamped(batch: &TrainBatch, version: PolicyVersion) -> TrainBatch {
    let mut b = batch.clone();
    b.sequences.iter_mut().for_each(|s| s.version = version);
    b
}

/// Two periods of four groups in `order` (KL term on, so the reference model trains
/// beside the policy), then every weight on the host and the two steps' losses.
pub(crate) fn two_periods(device: &Device, order: [usize; 4]) -> (Vec<f32>, Vec<f64>) {
    two_periods_on(device, order, 1)
}

/// [`two_periods`] on a trainer pool of `threads` threads.
pub(crate) fn two_periods_on(device: &Device, order: [usize; 4], threads: usize) -> (Vec<f32>, Vec<f64>) {
    let mut cfg = two_periods_config();
    cfg.threads = Some(threads);
    two_periods_with(device, order, &cfg)
}

/// The configuration of [`two_periods`]: a KL term, sequence-mean aggregation, and the
/// f32 whole-logits trainer on every device (what the CPU runs by default), so that
/// a GPU's steps compare with the CPU's.
pub(crate) fn two_periods_config() -> TrainerConfig {
    let mut cfg = config();
    cfg.loss.kl_coef = 0.02;
    cfg.loss.kl_estimator = KlEstimator::K3;
    cfg.loss.aggregation = Aggregation::SeqMeanTokenMean;
    cfg.precision = Some(metronome_model::Precision::F32);
    cfg.chunked_head = Some(false);
    cfg
}

/// [`two_periods`] under `cfg`.
pub(crate) fn two_periods_with(
    device: &Device,
    order: [usize; 4],
    cfg: &TrainerConfig,
) -> (Vec<f32>, Vec<f64>) {
    let groups = period_groups();
    let mut trainer = cfg.build(Model::new(ModelConfig::tiny(), device, 7).unwrap()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..2 {
        for &g in &order {
            let v = trainer.version();
            trainer.accumulate_sync(&stamped(&groups[g], v)).unwrap();
        }
        let report = trainer.step_sync().unwrap();
        assert!(report.applied);
        assert_eq!((report.groups, report.sequences), (4, 16));
        losses.push(report.loss);
    }
    assert!(trainer.policy().device().same_device(device));
    (flat_weights(trainer.policy()), losses)
}
