//! The engine on a CUDA GPU: seeded sampling reproduces its tokens, and matches the
//! CPU's tokens wherever the two devices' logits round alike. Skipped, with the reason
//! printed, without the `cuda` feature or a GPU (`cargo xtask gpu` runs it on one).

use metronome_core::{PeriodId, PolicyVersion, RunSeed};
use metronome_model::{DeviceSpec, Model, ModelConfig};
use metronome_rollout::{EngineConfig, SamplingConfig, model_engine};

use crate::common::{prompts, sampling, signature, tokenizer};

async fn generate(
    device: &metronome_model::Device,
    slots: usize,
    s: &SamplingConfig,
) -> Vec<crate::common::Signature> {
    let model = Model::new(ModelConfig::tiny(), device, 7).unwrap().frozen_copy().unwrap();
    let config = EngineConfig {
        max_num_seqs: slots,
        max_seq_len: 128,
        sampling: s.clone(),
        ..EngineConfig::default()
    };
    let e = model_engine(model, PolicyVersion(0), tokenizer(), config, RunSeed(42)).unwrap();
    let sub = metronome_rollout::Submission {
        period: PeriodId(3),
        prompts: prompts(6),
        group_size: 4,
        sampling: s.clone(),
        seed: metronome_core::RunSeed(42),
    };
    signature(&e.generate_groups(sub).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_seeded_sampling_is_reproducible() {
    if !cfg!(feature = "cuda") {
        eprintln!("skipped: built without the `cuda` feature (`cargo xtask gpu` runs this on a GPU)");
        return;
    }
    let gpu = match DeviceSpec::Cuda(0).open() {
        Ok(d) => d,
        Err(e) => return eprintln!("skipped: no CUDA device: {e}"),
    };
    // Top-p samples on the host from copied logits; plain temperature is drawn on the
    // device by the draw kernel (`metronome_model::draw`): both must be reproducible.
    for (what, mut s) in [
        ("top-p 0.9, sampled on the host", SamplingConfig { temperature: 1.0, top_p: 0.9, ..sampling(24) }),
        ("temperature 0.8, drawn on the device", SamplingConfig { temperature: 0.8, ..sampling(24) }),
    ] {
        s.stop_token_ids = Some(vec![2, 4, 40, 70]);
        let a = generate(&gpu, 8, &s).await;
        assert_eq!(a, generate(&gpu, 8, &s).await, "{what}: the same seed and layout on the GPU");
        // Another slot count changes which rows share a decode step.
        let layouts = generate(&gpu, 3, &s).await;
        let same = a.iter().zip(&layouts).filter(|(x, y)| x.2 == y.2).count();
        let cpu = generate(&metronome_model::Device::Cpu, 8, &s).await;
        let same_cpu = a.iter().zip(&cpu).filter(|(x, y)| x.2 == y.2).count();
        let tokens = |v: &[crate::common::Signature]| v.iter().map(|x| x.2.len()).sum::<usize>();
        let same_tokens: usize =
            a.iter().zip(&cpu).map(|(x, y)| x.2.iter().zip(&y.2).take_while(|(p, q)| p == q).count()).sum();
        eprintln!(
            "{what}: GPU, 8 vs 3 slots: {same} of {} responses with identical tokens; GPU vs CPU: {same_cpu} \
             responses identical, {same_tokens} of {} GPU tokens before the first difference",
            a.len(),
            tokens(&a)
        );
        assert_eq!(same, a.len(), "{what}: tokens depend on the slot layout on the GPU");
    }
}
