use std::collections::BTreeMap;
use std::fmt::Debug;

use metronome_core::*;
use serde::{Serialize, de::DeserializeOwned};

/// Round-trips `value` through JSON and postcard and asserts equality both times.
fn roundtrip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) {
    let json = serde_json::to_string(value).expect("serialises to json");
    let back: T = serde_json::from_str(&json).expect("deserialises from json");
    assert_eq!(&back, value, "json round trip via {json}");
    let bytes = postcard::to_allocvec(value).expect("serialises to postcard");
    let back: T = postcard::from_bytes(&bytes).expect("deserialises from postcard");
    assert_eq!(&back, value, "postcard round trip");
}

fn prompt() -> Prompt {
    Prompt {
        id: PromptId(17),
        text: "What is 2 + 3?".into(),
        tokens: vec![5, 9, 12, 0, u32::MAX],
        reference: Some("5".into()),
        metadata: BTreeMap::from([("numbers".into(), "2,3".into()), ("target".into(), "5".into())]),
    }
}

fn completion(i: u32) -> Completion {
    Completion {
        sample_index: i,
        tokens: vec![1, 2, 3],
        logprobs: vec![-0.5, -1.25, f32::MIN_POSITIVE],
        text: "5".into(),
        finish_reason: FinishReason::StopString,
        version: PolicyVersion(3),
        switches: Vec::new(),
        episode: None,
    }
}

fn group() -> Group {
    Group {
        period: PeriodId(3),
        prompt: prompt(),
        completions: vec![completion(0), completion(1)],
        timing: GroupTiming { started_s: 0.25, finished_s: 1.5 },
    }
}

#[test]
fn ids() {
    roundtrip(&RunSeed(u64::MAX));
    roundtrip(&PolicyVersion(7));
    roundtrip(&PromptId(0));
    roundtrip(&PeriodId(12));
    // Ids are transparent: a JSON id is a bare number.
    assert_eq!(serde_json::to_string(&PolicyVersion(7)).unwrap(), "7");
}

#[test]
fn prompts_completions_groups() {
    roundtrip(&prompt());
    roundtrip(&Prompt::default());
    for reason in [FinishReason::Stop, FinishReason::StopString, FinishReason::Length, FinishReason::Aborted]
    {
        roundtrip(&Completion { finish_reason: reason, ..completion(0) });
    }
    assert_eq!(serde_json::to_string(&FinishReason::StopString).unwrap(), "\"stop_string\"");
    let episode = EpisodeTrace {
        observations: vec![TokenSpan { start: 1, len: 1 }],
        turns: 2,
        reward: Some(1.0),
        failure: Some("max_turns".into()),
    };
    roundtrip(&Completion { episode: Some(episode), ..completion(0) });
    // A completion written before episodes existed decodes as single-turn.
    let mut old = serde_json::to_value(completion(1)).unwrap();
    old.as_object_mut().unwrap().remove("episode");
    let decoded: Completion = serde_json::from_value(old).unwrap();
    assert_eq!(decoded, completion(1));
    roundtrip(&group());
    roundtrip(&group().key());
}

#[test]
fn rewards_and_scored_groups() {
    roundtrip(&Reward::scalar(1.0));
    roundtrip(&Reward::failed(-1.0, "timed out after 2s"));
    roundtrip(&Reward { total: 0.5, parts: BTreeMap::from([("format".into(), 0.5)]), failure: None });
    let scored = ScoredGroup::new(
        group(),
        vec![Reward::scalar(1.0), Reward::scalar(0.0)],
        AdvantageEstimator::GroupNorm,
    )
    .unwrap();
    roundtrip(&scored);
    for estimator in [
        AdvantageEstimator::GroupNorm,
        AdvantageEstimator::GroupMean,
        AdvantageEstimator::LeaveOneOut,
        AdvantageEstimator::ReinforcePlusPlusBaseline,
    ] {
        roundtrip(&estimator);
    }
}

#[test]
fn layouts() {
    let batch = TrainBatch {
        rows: vec![PackedRow {
            tokens: vec![1, 2, 3, 4],
            positions: vec![0, 1, 2, 2],
            segments: vec![
                Segment { start: 0, len: 2, parent: None },
                Segment { start: 2, len: 1, parent: Some(0) },
                Segment { start: 3, len: 1, parent: Some(0) },
            ],
        }],
        targets: Targets {
            row: vec![0, 0],
            position: vec![1, 1],
            token: vec![3, 4],
            sequence: vec![0, 1],
            advantage: vec![1.0, -1.0],
            behaviour_logprob: vec![-0.1, -0.2],
        },
        sequences: vec![
            TrainSequence {
                group: 0,
                sample_index: 0,
                version: PolicyVersion(1),
                advantage: 1.0,
                num_targets: 1,
            },
            TrainSequence {
                group: 0,
                sample_index: 1,
                version: PolicyVersion(1),
                advantage: -1.0,
                num_targets: 1,
            },
        ],
        groups: vec![TrainGroup {
            key: GroupKey { period: PeriodId(1), prompt: PromptId(9) },
            num_sequences: 2,
            group_size: 2,
            all_equal: false,
            reward_mean: 0.5,
        }],
    };
    batch.validate().unwrap();
    roundtrip(&batch);
}

#[test]
fn weights_control_and_cursors() {
    let snapshot = WeightSnapshot {
        version: PolicyVersion(2),
        tensors: vec![
            HostTensor {
                name: "a".into(),
                shape: vec![2, 2],
                data: TensorData::F32(vec![1.0, -2.0, 0.0, 3.5]),
            },
            HostTensor { name: "b".into(), shape: vec![1], data: TensorData::Bf16(vec![0x3f80]) },
            HostTensor { name: "c".into(), shape: vec![0], data: TensorData::F16(vec![]) },
        ],
    };
    roundtrip(&snapshot);
    assert_eq!(snapshot.num_bytes(), 16 + 2);
    roundtrip(&ControlMessage::PeriodStart {
        period: PeriodId(4),
        version: PolicyVersion(4),
        prompts: vec![PromptId(1), PromptId(2)],
    });
    roundtrip(&ControlMessage::PeriodEnd { period: PeriodId(4) });
    roundtrip(&ControlMessage::Shutdown);
    roundtrip(&Cursor { period: PeriodId(3), epoch: 1, offset: 40 });
    roundtrip(&PromptBatch { period: PeriodId(0), prompts: vec![prompt()] });
    roundtrip(&RolloutRequest { period: PeriodId(0), prompts: vec![prompt()], group_size: 8 });
    roundtrip(&StepReport { version: PolicyVersion(1), applied: true, loss: 0.25, ..StepReport::default() });
    let mismatch =
        LogprobMismatch { tokens: 7, mean_abs: 0.5, p99_abs: 0.9, max_abs: 1.0, ..Default::default() };
    roundtrip(&StepReport { mismatch, distill_kl: Some(0.125), ..StepReport::default() });
    // A report written before the mismatch and distillation fields reads as without them.
    let mut old = serde_json::to_value(StepReport { loss: 0.5, ..StepReport::default() }).unwrap();
    let fields = old.as_object_mut().unwrap();
    fields.remove("mismatch");
    fields.remove("distill_kl");
    let read: StepReport = serde_json::from_value(old).unwrap();
    assert_eq!(read, StepReport { loss: 0.5, ..StepReport::default() });
    roundtrip(&AccumulateReport { tokens: 10, loss_sum: -1.5 });
    roundtrip(&ChatMessage::new("user", "hi"));
}

#[test]
fn group_validation_names_the_group_and_the_fault() {
    group().validate().unwrap();
    let mut g = group();
    g.completions[1].sample_index = 5;
    let err = g.validate().unwrap_err().to_string();
    assert_eq!(err, "group (period 3, prompt 17), completion 1 has sample_index 5 (expected 1)");
    let mut g = group();
    g.completions[0].logprobs.pop();
    let err = g.validate().unwrap_err().to_string();
    assert_eq!(err, "group (period 3, prompt 17), completion 0 has 2 log-probs for 3 tokens");
    let g = Group { completions: vec![], ..group() };
    assert_eq!(g.validate().unwrap_err().to_string(), "group (period 3, prompt 17) has no completions");
    let err =
        ScoredGroup::new(group(), vec![Reward::scalar(1.0)], AdvantageEstimator::GroupNorm).unwrap_err();
    assert_eq!(err.to_string(), "group (period 3, prompt 17) has 1 rewards for 2 completions");
}

#[test]
fn closures_are_reward_fns() {
    let by_len = |_: &Prompt, c: &Completion| c.tokens.len() as f32;
    let with_parts = |_: &Prompt, _: &Completion| Reward::failed(-1.0, "always");
    let fns: Vec<Box<dyn RewardFn>> = vec![Box::new(by_len), Box::new(with_parts)];
    assert_eq!(fns[0].score(&prompt(), &completion(0)), Reward::scalar(3.0));
    assert_eq!(fns[1].score(&prompt(), &completion(0)).failure.as_deref(), Some("always"));
}

#[test]
fn a_secret_serialises_redacted_and_its_redaction_is_not_read_back() {
    use metronome_core::Secret;
    let s = Secret::new("hunter2");
    assert_eq!(serde_json::to_string(&s).unwrap(), "\"<redacted>\"");
    let back: Secret = serde_json::from_str("\"hunter2\"").unwrap();
    assert_eq!(back.expose(), "hunter2");
    let err = serde_json::from_str::<Secret>("\"<redacted>\"").unwrap_err().to_string();
    assert!(err.contains("redacted secret") && err.contains("env"), "{err}");
}
