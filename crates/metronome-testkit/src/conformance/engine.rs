//! The contract of [`RolloutEngine`]: a request's groups are each emitted once, as
//! the prompt's group of the request's period with `G` responses numbered `0..G`,
//! every response carrying the version of the weights installed when it started.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use metronome_core::{
    Group, GroupSink, PeriodId, PolicyVersion, Prompt, PromptId, Result, RolloutEngine, RolloutRequest,
    WeightSnapshot,
};

use super::{expect, patiently};

const SUITE: &str = "rollout engine";

/// Collects the groups an engine emits, in emission order.
#[derive(Debug, Default)]
struct Collect(Mutex<Vec<Group>>);

#[async_trait]
impl GroupSink for Collect {
    async fn emit(&self, group: Group) -> Result<()> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(group);
        Ok(())
    }
}

/// Runs every check: installs `weights` (whose version must be newer than the
/// engine's), generates `prompts` with `group_size` responses each, then installs the
/// same weights as the next version and generates again.
pub async fn run_all(
    engine: &dyn RolloutEngine,
    weights: WeightSnapshot,
    prompts: &[Prompt],
    group_size: u32,
) {
    let next = WeightSnapshot { version: weights.version.next(), ..weights.clone() };
    for (period, weights) in [(PeriodId(1), weights), (PeriodId(2), next)] {
        let version = weights.version;
        expect(SUITE, "install_weights", engine.install_weights(Arc::new(weights)).await);
        assert_eq!(engine.version(), version, "{SUITE} conformance: version() is not the installed version");
        every_group_once_with_g_responses_of_the_installed_version(engine, period, prompts, group_size).await;
    }
}

/// Generates `prompts` for `period` with the weights installed now: every prompt's
/// group comes out exactly once, for that period and prompt, with `group_size`
/// responses numbered `0..group_size`, each of the engine's current version. A prompt
/// the engine cannot take comes out as [`Group::rejected`], counted the same.
pub async fn every_group_once_with_g_responses_of_the_installed_version(
    engine: &dyn RolloutEngine,
    period: PeriodId,
    prompts: &[Prompt],
    group_size: u32,
) {
    let version: PolicyVersion = engine.version();
    let sink = Collect::default();
    let request = RolloutRequest { period, prompts: prompts.to_vec(), group_size };
    expect(SUITE, "generate", patiently(SUITE, "generate", engine.generate(request, &sink)).await);
    let groups = sink.0.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut by_prompt: BTreeMap<PromptId, &Group> = BTreeMap::new();
    for g in &groups {
        assert_eq!(
            g.period, period,
            "{SUITE} conformance: a group of period {period} came out as {}",
            g.period
        );
        assert!(
            by_prompt.insert(g.prompt.id, g).is_none(),
            "{SUITE} conformance: group {} emitted twice",
            g.key()
        );
    }
    for p in prompts {
        let Some(g) = by_prompt.remove(&p.id) else {
            panic!("{SUITE} conformance: no group for prompt {} of period {period}", p.id)
        };
        assert_eq!(&g.prompt, p, "{SUITE} conformance: group {} does not carry its prompt", g.key());
        let mut indices: Vec<u32> = g.completions.iter().map(|c| c.sample_index).collect();
        indices.sort_unstable();
        assert_eq!(
            indices,
            (0..group_size).collect::<Vec<_>>(),
            "{SUITE} conformance: group {} has responses {indices:?}, not 0..{group_size}",
            g.key()
        );
        for c in &g.completions {
            assert_eq!(
                c.version,
                version,
                "{SUITE} conformance: response {} of group {} claims version {}, the installed one is {version}",
                c.sample_index,
                g.key(),
                c.version
            );
        }
    }
    assert!(
        by_prompt.is_empty(),
        "{SUITE} conformance: groups for prompts never asked for: {:?}",
        by_prompt.keys()
    );
}
