//! Partial rollouts: a response continues under weights installed mid-way, and what
//! it decodes is what an engine given those weights at those tokens decodes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use metronome_core::{PeriodId, PolicyVersion, RunSeed, TokenId, VersionSwitch, sample_seed};
use metronome_rollout::{
    CollectSink, Engine, EngineConfig, InferenceModel, PartialCache, Sampler, SamplingConfig, Submission,
    TokenRng,
};

use crate::common::{Watch, Watched, prompts, tiny_model, tokenizer};

/// After the watched model's `at`-th decode step, installs the next model in the
/// engine that runs it: weights arriving at a known token, whatever the timing.
#[derive(Clone)]
struct Handover {
    steps: Arc<AtomicUsize>,
    next: Option<(usize, Box<Hooked>, PolicyVersion)>,
    engine: Arc<OnceLock<Weak<Engine<Hooked>>>>,
}

type Hooked = Watched<Handover>;

impl Watch for Handover {
    fn after_decode(&self) {
        let steps = self.steps.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some((at, next, version)) = &self.next
            && steps == *at
            && let Some(engine) = self.engine.get().and_then(Weak::upgrade)
        {
            engine.install_model((**next).clone(), *version);
        }
    }
}

const TOKENS: usize = 24;
const SEED: RunSeed = RunSeed(5);

fn sampling() -> SamplingConfig {
    SamplingConfig { max_new_tokens: TOKENS, ignore_eos: true, ..SamplingConfig::default() }
}

/// One response of the first prompt from an engine that starts with three models'
/// first, each handing over to the next after 5 of its own decode steps; `partial`
/// says what partial rollouts do with the cache (`None`: no partial rollouts).
async fn generate(partial: Option<PartialCache>) -> metronome_core::Completion {
    let engine_slot = Arc::new(OnceLock::new());
    let hooked = |seed: u64, next| Hooked {
        model: tiny_model(seed),
        watch: Handover { steps: Arc::default(), next, engine: Arc::clone(&engine_slot) },
    };
    let third = hooked(13, None);
    let second = hooked(12, Some((5, Box::new(third), PolicyVersion(2))));
    let first = hooked(11, Some((5, Box::new(second), PolicyVersion(1))));
    let config = EngineConfig {
        workers: 1,
        threads_per_worker: Some(1),
        max_num_seqs: 1,
        max_seq_len: 128,
        partial_rollouts: partial.is_some(),
        partial_cache: partial.unwrap_or_default(),
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(first, PolicyVersion(0), tokenizer(), config).unwrap());
    engine_slot.set(Arc::downgrade(&engine)).ok().unwrap();
    let sub = Submission {
        period: PeriodId(0),
        prompts: prompts(1),
        group_size: 1,
        sampling: sampling(),
        seed: SEED,
    };
    let sink = CollectSink::default();
    engine.submit(sub, &sink).await.unwrap();
    sink.into_groups().remove(0).completions.remove(0)
}

/// What an engine given each model from its token on decodes: the first model's
/// prefill of the prompt, then its decode steps; at a switch, the new model's prefill
/// of everything so far (or, keeping the cache, its decode step on the old cache),
/// then its decode steps; one random stream throughout.
fn reference(switches: &[(usize, u64)], keep: bool) -> (Vec<TokenId>, Vec<f32>) {
    let prompt = prompts(1).remove(0);
    let rng = TokenRng::new(sample_seed(SEED, PolicyVersion(0), prompt.id, 0));
    let mut sampler = Sampler::new();
    let mut context = prompt.tokens.clone();
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    let mut model = tiny_model(switches[0].1);
    let mut cache = InferenceModel::new_cache(&model, 1, 128).unwrap();
    for k in 0..TOKENS {
        let switch = switches.iter().find(|(at, _)| *at == k);
        if let Some(&(_, seed)) = switch.filter(|_| keep && k > 0) {
            model = tiny_model(seed);
        }
        let logits = match switch.filter(|_| !keep || k == 0) {
            Some(&(_, seed)) => {
                model = tiny_model(seed);
                cache = InferenceModel::new_cache(&model, 1, 128).unwrap();
                InferenceModel::prefill_many(&model, &mut cache, &[(0, &context)], &[None]).unwrap().remove(0)
            }
            None => InferenceModel::decode_step(&model, &mut cache, &[(0, tokens[k - 1])], &[None])
                .unwrap()
                .remove(0),
        };
        // Sampled here on the host from the logits, while the engine's model draws its
        // tokens itself (`metronome_model::draw`): the two must agree bit for bit.
        let logits = logits.into_logits().expect("a row without a draw comes back as logits");
        let sampled = sampler.sample(&sampling(), &logits, &context, rng.uniform(k as u64)).unwrap();
        context.push(sampled.token);
        tokens.push(sampled.token);
        logprobs.push(sampled.logprob);
    }
    (tokens, logprobs)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_interrupted_twice_decodes_what_an_engine_given_those_weights_at_those_tokens_does() {
    let switch = |at, version| VersionSwitch { at, version: PolicyVersion(version) };
    let mut continued = Vec::new();
    for (cache, keep) in [(PartialCache::Rebuild, false), (PartialCache::Keep, true)] {
        let c = generate(Some(cache)).await;
        // The first model's 5th decode step sampled token 5 and installed version 1:
        // token 6 is the first the new weights sampled; 6 tokens later (a prefill or a
        // decode step, then 5 decode steps), version 2 at token 12.
        assert_eq!(c.version, PolicyVersion(0));
        let expected = if keep { [switch(6, 1), switch(11, 2)] } else { [switch(6, 1), switch(12, 2)] };
        assert_eq!(c.switches, expected, "{cache:?}");
        assert_eq!(c.newest_version(), PolicyVersion(2));
        let at: Vec<usize> = c.switches.iter().map(|s| s.at as usize).collect();
        let (tokens, logprobs) = reference(&[(0, 11), (at[0], 12), (at[1], 13)], keep);
        assert_eq!(c.tokens, tokens, "{cache:?}");
        assert_eq!(bits(&c.logprobs), bits(&logprobs), "{cache:?}");
        continued.push(c.tokens);
    }

    // Without partial rollouts the response finishes with the weights it started with.
    let whole = generate(None).await;
    assert!(whole.switches.is_empty());
    let (tokens, logprobs) = reference(&[(0, 11)], false);
    assert_eq!(whole.tokens, tokens);
    assert_eq!(bits(&whole.logprobs), bits(&logprobs));
    for c in &continued {
        assert_ne!(&whole.tokens, c, "the switches changed nothing: the test would not see them");
    }
    assert_ne!(continued[0], continued[1], "rebuilding and keeping the cache gave the same tokens");
}
