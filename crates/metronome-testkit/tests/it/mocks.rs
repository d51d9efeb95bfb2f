//! Every mock stage against its trait's suite.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use metronome_core::{PolicyVersion, Prompt, PromptId, PromptSource, Trainer};
use metronome_testkit::conformance;
use metronome_testkit::data::{scored_group, snapshot};
use metronome_testkit::mock::{MockEngine, MockScorer, MockSource, MockTrainer, channel_transport, pack};

fn source() -> Box<dyn PromptSource> {
    Box::new(MockSource { next: 0, n: 1000, batch: 4, period: 0 })
}

#[tokio::test]
async fn the_mock_source_passes_its_suite() {
    conformance::source::run_all(&mut source, 5).await;
}

#[tokio::test]
async fn the_mock_engine_passes_its_suite() {
    let engine = MockEngine::new(Duration::ZERO);
    let weights = MockTrainer::new(engine.generating.clone()).snapshot().await.unwrap();
    let prompts: Vec<Prompt> =
        (0..5).map(|i| Prompt { id: PromptId(i), tokens: vec![i as u32], ..Prompt::default() }).collect();
    let weights = metronome_core::WeightSnapshot { version: PolicyVersion(1), ..weights };
    conformance::engine::run_all(&engine, weights, &prompts, 3).await;
}

#[tokio::test]
#[should_panic(
    expected = "rollout engine conformance: response 0 of group (period 1, prompt 0) claims version 9"
)]
async fn the_engine_suite_catches_a_wrong_version() {
    let mut engine = MockEngine::new(Duration::ZERO);
    engine.force_version = Some(PolicyVersion(9));
    let weights = MockTrainer::new(engine.generating.clone()).snapshot().await.unwrap();
    let weights = metronome_core::WeightSnapshot { version: PolicyVersion(1), ..weights };
    let prompts = [Prompt { id: PromptId(0), tokens: vec![1], ..Prompt::default() }];
    conformance::engine::run_all(&engine, weights, &prompts, 2).await;
}

#[tokio::test]
async fn the_mock_scorer_passes_its_suite() {
    conformance::scorer::run_all(&MockScorer, scored_group(0, 3, 4, 5).group).await;
}

/// A period's batch for the mock trainer at `version`: two groups with distinct
/// tokens and advantages, sampled by that version.
fn batch(version: PolicyVersion) -> metronome_core::TrainBatch {
    let groups: Vec<_> = (0..2)
        .map(|p| {
            let mut g = scored_group(version.0, p, 3, 4);
            g.group.completions.iter_mut().for_each(|c| c.version = version);
            g
        })
        .collect();
    pack(&groups)
}

#[tokio::test]
async fn the_mock_trainer_passes_its_suite() {
    let mut trainer = MockTrainer::new(Arc::default());
    conformance::trainer::run_all(&mut trainer, &batch, None).await;
    let mut fresh = MockTrainer::new(Arc::default());
    conformance::trainer::a_checkpoint_continues_exactly(&mut trainer, &mut fresh, &batch).await;
    // Its guard refuses the steps from the versions in `refuse`.
    let mut refusing = MockTrainer::new(Arc::default());
    refusing.refuse = BTreeSet::from([0]);
    conformance::trainer::a_refused_step_advances_the_version_and_keeps_the_weights(&mut refusing, &batch)
        .await;
}

#[tokio::test]
#[should_panic(expected = "trainer conformance: a refused step from 0 reported 0")]
async fn the_trainer_suite_catches_a_version_that_stands_still() {
    let mut trainer = MockTrainer::new(Arc::default());
    trainer.refuse = BTreeSet::from([0]);
    trainer.keep_version_when_refusing = true;
    conformance::trainer::a_refused_step_advances_the_version_and_keeps_the_weights(&mut trainer, &batch)
        .await;
}

#[tokio::test]
async fn the_mock_transport_refuses_older_weights() {
    let t = channel_transport(1);
    let mut subscriber = t.subscriber;
    let newer = Arc::new(snapshot(2, 4));
    t.publisher.publish(Arc::clone(&newer)).await.unwrap();
    assert!(t.publisher.publish(Arc::new(snapshot(1, 4))).await.is_err());
    assert_eq!(subscriber.wait_for(PolicyVersion(1)).await.unwrap(), newer);
}
