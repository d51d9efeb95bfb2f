//! Versioned weights: installed between sequences, every completion tagged.

use std::sync::Arc;

use async_trait::async_trait;
use metronome_core::{
    ErrorChain, Group, GroupSink, PeriodId, PolicyVersion, RolloutEngine, RolloutRequest, TensorData,
    WeightSnapshot,
};
use metronome_rollout::Rollback;

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

/// Weights left on the trainer's device (`Model::snapshot_resident`, as a GPU trainer
/// publishes to an engine of its process) install as host ones do: the same
/// generations, token for token, at the same version; and an engine passes the
/// rollout engine suite on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resident_weights_generate_what_host_weights_do() {
    let trained = tiny_model(99);
    let (host, resident) = (engine(1, 4, sampling(12)), engine(1, 4, sampling(12)));
    host.install_weights(Arc::new(trained.snapshot(PolicyVersion(1)).unwrap())).await.unwrap();
    resident.install_weights(Arc::new(trained.snapshot_resident(PolicyVersion(1)).unwrap())).await.unwrap();
    assert_eq!(resident.version(), PolicyVersion(1));
    let (a, b) = (generate(&host, request()).await, generate(&resident, request()).await);
    assert_eq!(signature(&a), signature(&b));
    assert_ne!(signature(&a), signature(&generate(&engine(1, 4, sampling(12)), request()).await));
    let e = engine(2, 3, sampling(8));
    let weights = trained.snapshot_resident(PolicyVersion(1)).unwrap();
    metronome_testkit::conformance::engine::run_all(&e, weights, &prompts(5), 3).await;
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

/// Every way a snapshot can be wrong is refused with the tensor (or the version)
/// named, and the served weights stay exactly as they were: the same version and
/// the same rollouts after each refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_snapshot_leaves_the_served_weights_untouched() {
    let e = engine(1, 2, sampling(8));
    let served = tiny_model(5).snapshot(PolicyVersion(3)).unwrap();
    e.install_weights(Arc::new(served)).await.unwrap();
    let before = signature(&generate(&e, request()).await);
    let good = || tiny_model(1).snapshot(PolicyVersion(4)).unwrap();
    let name = |s: &WeightSnapshot, i: usize| s.tensors[i].name.clone();
    let mut cases: Vec<(&str, WeightSnapshot, String)> = Vec::new();
    let mut s = good();
    let missing = s.tensors.pop().unwrap().name;
    cases.push(("a missing tensor", s, format!("lacks tensor `{missing}`")));
    let mut s = good();
    let n = s.tensors.len();
    if let TensorData::F32(v) = &mut s.tensors[n - 1].data {
        v[7] = f32::NAN;
    }
    let last = name(&s, n - 1);
    cases.push(("a NaN", s, format!("tensor `{last}`: element 7 is not finite")));
    let mut s = good();
    s.tensors[0].data = TensorData::Bf16(vec![0x7f80; s.tensors[0].data.len()]);
    let first = name(&s, 0);
    cases.push(("an infinite bf16", s, format!("tensor `{first}`: element 0 is not finite")));
    let mut s = good();
    let mut extra = s.tensors[0].clone();
    extra.name = "model.layers.99.mlp.up_proj.weight".into();
    s.tensors.push(extra);
    cases.push(("an unknown tensor", s, "does not have: `model.layers.99.mlp.up_proj.weight`".into()));
    let mut s = good();
    s.tensors.push(s.tensors[1].clone());
    let second = name(&s, 1);
    cases.push(("a duplicate", s, format!("holds tensor `{second}` twice")));
    let mut s = good();
    s.tensors[1].shape.reverse();
    s.tensors[1].shape.push(1);
    cases.push(("a wrong shape", s, format!("tensor `{second}`")));
    let mut s = good();
    s.version = PolicyVersion(2);
    cases.push(("an older version", s, "version 2 are older than the installed version 3".into()));
    for (what, snapshot, expected) in cases {
        let err = ErrorChain(&e.install_weights(Arc::new(snapshot)).await.unwrap_err()).to_string();
        assert!(err.contains(&expected), "{what}: {err}");
        assert_eq!(e.version(), PolicyVersion(3), "{what}");
        assert_eq!(signature(&generate(&e, request()).await), before, "{what}");
    }
    // Said explicitly, the policy may go back.
    let older = tiny_model(1).snapshot(PolicyVersion(2)).unwrap();
    e.install_snapshot(&older, Rollback::Allow).unwrap();
    assert_eq!(e.version(), PolicyVersion(2));
    assert_ne!(signature(&generate(&e, request()).await), before);
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

/// `precision = "bf16"` decodes in bf16, the first weights and every installed
/// snapshot: its responses do not depend on the slot layout (the same groups from 1 x 4
/// and 2 x 2 slots), and its behaviour log-probs are within bf16 rounding of the f32
/// engine's on the tokens both sampled, without being the same numbers (so the bf16
/// copy really decodes, before and after an install).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bf16_engine_decodes_in_bf16_before_and_after_an_install() {
    use metronome_model::Precision;
    let build = |workers, slots, precision| {
        let config = metronome_rollout::EngineConfig {
            workers,
            threads_per_worker: Some(1),
            max_num_seqs: slots,
            max_seq_len: 128,
            sampling: sampling(12),
            precision,
            ..metronome_rollout::EngineConfig::default()
        };
        metronome_rollout::model_engine(
            tiny_model(7),
            PolicyVersion(0),
            crate::common::tokenizer(),
            config,
            metronome_core::RunSeed(42),
        )
        .unwrap()
    };
    let snapshot = Arc::new(tiny_model(99).snapshot(PolicyVersion(1)).unwrap());
    let (bf16, bf16_2x2, f32) =
        (build(1, 4, Some(Precision::Bf16)), build(2, 2, Some(Precision::Bf16)), build(1, 4, None));
    for installed in [false, true] {
        if installed {
            for e in [&bf16, &bf16_2x2, &f32] {
                e.install_weights(Arc::clone(&snapshot)).await.unwrap();
            }
        }
        let a = crate::common::by_prompt(generate(&bf16, request()).await);
        let b = crate::common::by_prompt(generate(&bf16_2x2, request()).await);
        assert_eq!(signature(&a), signature(&b), "bf16 (installed: {installed}): 1x4 vs 2x2 slots");
        let reference = crate::common::by_prompt(generate(&f32, request()).await);
        let (mut diffs, mut bitwise) = (Vec::new(), 0);
        for (ga, gr) in a.iter().zip(&reference) {
            for (ca, cr) in ga.completions.iter().zip(&gr.completions) {
                for ((ta, tr), (la, lr)) in
                    ca.tokens.iter().zip(&cr.tokens).zip(ca.logprobs.iter().zip(&cr.logprobs))
                {
                    if ta != tr {
                        break;
                    }
                    diffs.push((la - lr).abs());
                    bitwise += usize::from(la.to_bits() == lr.to_bits());
                }
            }
        }
        let mean = diffs.iter().sum::<f32>() / diffs.len().max(1) as f32;
        let max = diffs.iter().copied().fold(0.0f32, f32::max);
        eprintln!(
            "bf16 vs f32 engine (installed: {installed}): {} shared tokens, |logprob diff| mean {mean:.2e}, max \
             {max:.2e}, {bitwise} bitwise equal",
            diffs.len()
        );
        assert!(diffs.len() >= 10, "too few shared tokens to compare: {}", diffs.len());
        assert!(mean < 0.01 && max < 0.05, "mean {mean}, max {max}");
        assert!(bitwise < diffs.len(), "every log-prob equals the f32 engine's: not decoding in bf16");
    }
}

/// The engine's loader, counting the models it builds and the ones it writes over.
struct Counting {
    inner: metronome_rollout::SnapshotLoader,
    loads: Arc<std::sync::atomic::AtomicUsize>,
    reloads: Arc<std::sync::atomic::AtomicUsize>,
}

impl metronome_rollout::WeightLoader<metronome_model::Model> for Counting {
    fn load(&self, weights: &WeightSnapshot) -> metronome_rollout::Result<metronome_model::Model> {
        self.loads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.load(weights)
    }

    fn reload(
        &self,
        model: &mut metronome_model::Model,
        weights: &WeightSnapshot,
    ) -> metronome_rollout::Result<bool> {
        let written = self.inner.reload(model, weights)?;
        self.reloads.fetch_add(usize::from(written), std::sync::atomic::Ordering::Relaxed);
        Ok(written)
    }
}

/// A weight loader whose models the engine's KV caches cannot serve (bf16 weights for
/// an f32 engine's caches) is refused at the install, naming the loader and both types,
/// and the engine goes on serving what it served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_of_weights_the_caches_cannot_serve_is_refused_at_the_install() {
    let e = engine(2, 3, sampling(8)).with_weight_loader(metronome_rollout::SnapshotLoader {
        config: metronome_model::ModelConfig::tiny(),
        device: metronome_model::Device::Cpu,
        dtype: candle_core::DType::BF16,
    });
    let before = signature(&generate(&e, request()).await);
    let v1 = Arc::new(tiny_model(1).snapshot(PolicyVersion(1)).unwrap());
    let err = ErrorChain(&e.install_weights(v1).await.unwrap_err()).to_string();
    for part in ["weight_loader", "BF16", "F32", "version 1"] {
        assert!(err.contains(part), "{part} in {err}");
    }
    assert_eq!(e.version(), PolicyVersion(0));
    assert_eq!(before, signature(&generate(&e, request()).await));
}

/// Between requests the served model is the loader's own and no sequence holds it:
/// the next weights are written over it rather than loaded into a new model, and it
/// generates what a model loaded anew with them does, in f32 and in a bf16 engine
/// (each snapshot cast as it is written). The model handed to the engine at its start
/// is never written over (others may share its weights).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_engine_writes_new_weights_over_its_loaded_model() {
    use metronome_model::Precision;
    use std::sync::atomic::{AtomicUsize, Ordering};
    // `common::engine`'s engine, decoding in `precision`.
    let engine_in = |precision: Precision| {
        let config = metronome_rollout::EngineConfig {
            workers: 2,
            threads_per_worker: Some(1),
            max_num_seqs: 3,
            max_seq_len: 128,
            sampling: sampling(8),
            precision: Some(precision),
            ..metronome_rollout::EngineConfig::default()
        };
        let tokenizer = crate::common::tokenizer();
        metronome_rollout::model_engine(
            tiny_model(7),
            PolicyVersion(0),
            tokenizer,
            config,
            metronome_core::RunSeed(42),
        )
        .unwrap()
    };
    for precision in [Precision::F32, Precision::Bf16] {
        let dtype = precision.dtype();
        let (loads, reloads) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let loader = metronome_rollout::SnapshotLoader {
            config: metronome_model::ModelConfig::tiny(),
            device: metronome_model::Device::Cpu,
            dtype,
        };
        let e = engine_in(precision).with_weight_loader(Counting {
            inner: loader,
            loads: Arc::clone(&loads),
            reloads: Arc::clone(&reloads),
        });
        let counts = || (loads.load(Ordering::Relaxed), reloads.load(Ordering::Relaxed));
        generate(&e, request()).await;
        e.install_weights(Arc::new(tiny_model(1).snapshot(PolicyVersion(1)).unwrap())).await.unwrap();
        assert_eq!(counts(), (1, 0), "{dtype:?}: the model handed in is not written over");
        generate(&e, request()).await;
        let v2 = Arc::new(tiny_model(2).snapshot(PolicyVersion(2)).unwrap());
        e.install_weights(Arc::clone(&v2)).await.unwrap();
        assert_eq!(counts(), (1, 1), "{dtype:?}: the loaded model is written over");
        let written = signature(&generate(&e, request()).await);
        let fresh = engine_in(precision);
        fresh.install_weights(v2).await.unwrap();
        assert_eq!(written, signature(&generate(&fresh, request()).await), "{dtype:?}");
        // A refused snapshot leaves it as it was.
        let mut bad = tiny_model(3).snapshot(PolicyVersion(3)).unwrap();
        bad.tensors.push(bad.tensors[1].clone());
        let err = ErrorChain(&e.install_weights(Arc::new(bad)).await.unwrap_err()).to_string();
        assert!(err.contains("twice"), "{dtype:?}: {err}");
        assert_eq!(e.version(), PolicyVersion(2));
        assert_eq!(written, signature(&generate(&e, request()).await), "{dtype:?}");
    }
}
