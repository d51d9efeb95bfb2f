//! The test kit's mock stages (`metronome_testkit::mock`), and what only the pipeline
//! has: packers (its `Packer` trait) and the kit's channels as a pipeline `Transport`.

use std::collections::BTreeSet;
use std::sync::Arc;

use metronome_core::{Error, Result, ScoredGroup, TrainBatch};
use metronome_pipeline::{Packer, Stages};
use metronome_testkit::mock::{ChannelTransport, recording_transport as kit_transport};
pub(crate) use metronome_testkit::mock::{
    Events, MockEngine, MockScorer, MockSource, MockTrainer, Recorded, TrainLog, pack,
};

/// The mock stages around `engine` and `trainer`: prompts from `source`, the mock
/// scorer, one micro-batch per group.
pub(crate) fn mock_stages(source: MockSource, engine: MockEngine, trainer: MockTrainer) -> Stages {
    Stages {
        source: Box::new(source),
        engine: Arc::new(engine),
        scorer: Arc::new(MockScorer),
        packer: mock_packer(),
        trainer: Box::new(trainer),
    }
}

/// One micro-batch per group: every completion token is a target.
pub(crate) fn mock_packer() -> Arc<dyn Packer> {
    failing_packer(BTreeSet::new())
}

/// [`mock_packer`] that fails on the groups of the prompts in `fail` (as the masking
/// crate does on a group too long for a row, say).
pub(crate) fn failing_packer(fail: BTreeSet<u64>) -> Arc<dyn Packer> {
    Arc::new(move |groups: &[ScoredGroup]| -> Result<Vec<TrainBatch>> {
        if let Some(g) = groups.iter().find(|g| fail.contains(&g.key().prompt.0)) {
            return Err(Error::invalid(format!("group {}", g.key()), "does not fit a row"));
        }
        Ok(vec![pack(groups)])
    })
}

/// The kit's in-process channels, `capacity` groups deep.
pub(crate) fn channel_transport(capacity: usize) -> metronome_pipeline::Transport {
    recording_transport(capacity, None)
}

/// [`channel_transport`] whose acknowledgements are recorded in `events`.
pub(crate) fn recording_transport(capacity: usize, events: Option<Events>) -> metronome_pipeline::Transport {
    let ChannelTransport { sender, receiver, publisher, subscriber } = kit_transport(capacity, events);
    metronome_pipeline::Transport { sender, receiver, publisher, subscriber }
}
