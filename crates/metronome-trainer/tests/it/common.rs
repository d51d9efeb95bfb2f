//! Hand-built shared-prompt batches and a tiny model.

use metronome_core::{
    GroupKey, PackedRow, PeriodId, PolicyVersion, PromptId, Segment, TrainBatch, TrainGroup, TrainSequence,
};
use metronome_model::{Device, Model, ModelConfig};
use metronome_trainer::TrainerConfig;
use metronome_trainer::loss::{Aggregation, KlEstimator};

/// One group in the shared-prompt layout: the prompt once (positions `0..P`), then one
/// child segment per response with positions restarting at `P`. The last prompt
/// position predicts every first response token; response position `j` predicts
/// token `j + 1` of its response.
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
    let p = prompt.len() as u32;
    let mut row = PackedRow {
        tokens: prompt.to_vec(),
        positions: (0..p).collect(),
        segments: vec![Segment { start: 0, len: p, parent: None }],
    };
    let mut batch = TrainBatch::default();
    for (i, (resp, &adv)) in responses.iter().zip(advantages).enumerate() {
        let start = row.tokens.len() as u32;
        row.tokens.extend_from_slice(resp);
        row.positions.extend((0..resp.len() as u32).map(|j| p + j));
        row.segments.push(Segment { start, len: resp.len() as u32, parent: Some(0) });
        for (j, &tok) in resp.iter().enumerate() {
            let t = &mut batch.targets;
            t.row.push(0);
            t.position.push(if j == 0 { p - 1 } else { start + j as u32 - 1 });
            t.token.push(tok);
            t.sequence.push(i as u32);
            t.advantage.push(adv);
            // A plausible behaviour log-prob (uniform over the tiny vocabulary).
            t.behaviour_logprob.push(-(99f32.ln()));
        }
        batch.sequences.push(TrainSequence {
            group: 0,
            sample_index: i as u32,
            version,
            advantage: adv,
            num_targets: resp.len() as u32,
        });
    }
    batch.rows.push(row);
    batch.groups.push(TrainGroup {
        key: GroupKey { period: PeriodId(0), prompt: PromptId(prompt_id) },
        num_sequences: responses.len() as u32,
        group_size: responses.len() as u32,
        all_equal: advantages.iter().all(|&a| a == 0.0),
        reward_mean: 0.5,
    });
    batch.validate().unwrap();
    batch
}

/// Concatenates micro-batches into one (rows, sequences and groups re-indexed).
pub(crate) fn merge(batches: &[TrainBatch]) -> TrainBatch {
    let mut out = TrainBatch::default();
    for b in batches {
        let (r0, s0, g0) = (out.rows.len() as u32, out.sequences.len() as u32, out.groups.len() as u32);
        out.rows.extend(b.rows.iter().cloned());
        out.groups.extend(b.groups.iter().copied());
        out.sequences.extend(b.sequences.iter().map(|s| TrainSequence { group: s.group + g0, ..*s }));
        let t = &b.targets;
        let o = &mut out.targets;
        o.row.extend(t.row.iter().map(|r| r + r0));
        o.position.extend_from_slice(&t.position);
        o.token.extend_from_slice(&t.token);
        o.sequence.extend(t.sequence.iter().map(|s| s + s0));
        o.advantage.extend_from_slice(&t.advantage);
        o.behaviour_logprob.extend_from_slice(&t.behaviour_logprob);
    }
    out.validate().unwrap();
    out
}

/// Four groups of four responses with distinct prompts, lengths and advantages.
pub(crate) fn period_groups() -> Vec<TrainBatch> {
    (0..4u32)
        .map(|g| {
            let prompt: Vec<u32> = (0..5 + g).map(|i| 3 + (i * 7 + g * 11) % 90).collect();
            let responses: Vec<Vec<u32>> = (0..4u32)
                .map(|r| (0..3 + (r + g) % 4).map(|j| 3 + (j * 13 + r * 5 + g * 17) % 90).collect())
                .collect();
            let advantages = [1.0, -1.0, 0.5, -0.5].map(|a| a * (1.0 + g as f32 / 4.0));
            group_batch(u64::from(g), &prompt, &responses, &advantages)
        })
        .collect()
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
    let groups = period_groups();
    let mut cfg = config();
    cfg.threads = threads;
    cfg.loss.kl_coef = 0.02;
    cfg.loss.kl_estimator = KlEstimator::K3;
    cfg.loss.aggregation = Aggregation::SeqMeanTokenMean;
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
