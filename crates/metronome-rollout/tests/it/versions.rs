//! Versioned weights: installed between sequences, every completion tagged.

use std::sync::Arc;

use async_trait::async_trait;
use metronome_core::{Group, GroupSink, PeriodId, PolicyVersion, RolloutEngine, RolloutRequest};

use crate::common::{engine, generate, prompts, sampling, signature, tiny_model};

fn request() -> RolloutRequest {
    RolloutRequest { period: PeriodId(0), prompts: prompts(6), group_size: 3 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn installed_weights_are_used_and_recorded() {
    let e = engine(1, 4, sampling(12));
    let v0 = generate(&e, request()).await;
    assert!(v0.iter().flat_map(|g| &g.completions).all(|c| c.version == PolicyVersion(0)));
    let snapshot = tiny_model(99).snapshot(PolicyVersion(1)).unwrap();
    e.install_weights(Arc::new(snapshot)).await.unwrap();
    assert_eq!(e.version(), PolicyVersion(1));
    let v1 = generate(&e, request()).await;
    assert!(v1.iter().flat_map(|g| &g.completions).all(|c| c.version == PolicyVersion(1)));
    assert_ne!(signature(&v0), signature(&v1));
}

/// The `RolloutEngine` contract on the real engine, two workers sharing the queue:
/// every group once with G responses of the installed version, the group of a prompt
/// too long for `max_seq_len` (rejected) included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_passes_the_rollout_engine_suite() {
    let e = engine(2, 3, sampling(8));
    let mut prompts = prompts(5);
    prompts[2].tokens = vec![5; 200];
    let weights = tiny_model(99).snapshot(PolicyVersion(1)).unwrap();
    metronome_testkit::conformance::engine::run_all(&e, weights, &prompts, 3).await;
}

/// Installs version 1 from inside the sink when the first group arrives, while the
/// rest of the batch is still generating.
struct InstallOnFirst<'a> {
    engine: &'a metronome_rollout::ModelEngine,
    snapshot: Arc<metronome_core::WeightSnapshot>,
    groups: std::sync::Mutex<Vec<Group>>,
}

#[async_trait]
impl GroupSink for InstallOnFirst<'_> {
    async fn emit(&self, group: Group) -> metronome_core::Result<()> {
        let first = {
            let mut g = self.groups.lock().unwrap();
            g.push(group);
            g.len() == 1
        };
        if first {
            self.engine.install_weights(Arc::clone(&self.snapshot)).await?;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_installed_mid_generation_apply_to_new_sequences_only() {
    let snapshot = Arc::new(tiny_model(99).snapshot(PolicyVersion(1)).unwrap());
    // References: the whole request at version 0, and at version 1.
    let only_v0 = generate(&engine(1, 2, sampling(12)), request()).await;
    let e1 = engine(1, 2, sampling(12));
    e1.install_weights(Arc::clone(&snapshot)).await.unwrap();
    let only_v1 = generate(&e1, request()).await;

    let e = engine(1, 2, sampling(12));
    let sink = InstallOnFirst { engine: &e, snapshot, groups: std::sync::Mutex::new(Vec::new()) };
    e.generate(request(), &sink).await.unwrap();
    let mixed = sink.groups.into_inner().unwrap();
    let find = |groups: &[Group], id, idx: u32| {
        groups.iter().find(|g| g.prompt.id == id).unwrap().completions[idx as usize].clone()
    };
    let mut seen = [0; 2];
    for g in &mixed {
        for c in &g.completions {
            let reference = match c.version.0 {
                0 => find(&only_v0, g.prompt.id, c.sample_index),
                1 => find(&only_v1, g.prompt.id, c.sample_index),
                v => panic!("version {v}"),
            };
            seen[c.version.0 as usize] += 1;
            // A sequence's tokens are those of a run entirely at its own version.
            assert_eq!(c.tokens, reference.tokens);
            assert_eq!(c.logprobs, reference.logprobs);
        }
    }
    assert!(seen[0] > 0 && seen[1] > 0, "versions seen {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_another_shape_is_rejected() {
    let e = engine(1, 2, sampling(4));
    let mut snapshot = tiny_model(1).snapshot(PolicyVersion(1)).unwrap();
    snapshot.tensors.pop();
    assert!(e.install_weights(Arc::new(snapshot)).await.is_err());
    assert_eq!(e.version(), PolicyVersion(0));
}

/// KV caches larger than the machine's available memory are refused when the engine
/// is built, naming `max_num_seqs` and how many slots fit, before anything is
/// allocated (before, a cache of 65,536 slots of a million tokens aborted the process).
#[test]
fn caches_beyond_the_machines_memory_are_refused_before_allocation() {
    use metronome_core::RunSeed;
    use metronome_rollout::{EngineConfig, model_engine};
    // 64 TiB of cache: more than any machine this runs on has.
    let config = EngineConfig {
        workers: metronome_rollout::MAX_WORKERS,
        threads_per_worker: Some(1),
        max_num_seqs: metronome_rollout::MAX_NUM_SEQS,
        max_seq_len: metronome_rollout::MAX_SEQ_LEN,
        ..EngineConfig::default()
    };
    let model = tiny_model(7);
    let context = model.config().max_position_embeddings;
    let tokens = config.max_seq_len.min(context);
    let Err(e) = model_engine(model, PolicyVersion(0), crate::common::tokenizer(), config, RunSeed(1)) else {
        panic!("an engine with 1024 x 65536 slots of {tokens} tokens was built");
    };
    let e = e.to_string();
    assert!(
        e.starts_with("config field `max_num_seqs` is 65536: 1024 worker(s) x 65536 slots x 1024 tokens"),
        "{e}"
    );
    assert!(e.contains("available") && e.contains("slots per worker fit"), "{e}");
}
