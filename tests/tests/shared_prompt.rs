//! The equivalence the shared-prompt layout rests on: the log-prob of every response
//! token, and the parameter gradients of a log-prob loss, are the same whether a group
//! is laid out as one shared-prompt tree (`metronome-masking`) or as padded separate
//! rows, when `metronome-model` runs the network over either.

use anyhow::{Context, Result, ensure};
use metronome_core::{
    AdvantageEstimator, Completion, Group, PeriodId, PolicyVersion, Prompt, PromptId, Reward, ScoredGroup,
    TokenId, mix64,
};
use metronome_masking::{Layout, LayoutKind, PackingConfig, pack_period, padded, shared_prompt};
use metronome_model::{Device, Model, ModelConfig, Tensor};

/// Tolerance of the issue: shared-prompt and padded results agree within 1e-5.
const TOLERANCE: f32 = 1e-5;

/// A tiny deterministic generator (SplitMix64 steps).
struct Rng(u64);

impl Rng {
    fn below(&mut self, bound: usize) -> usize {
        self.0 = mix64(self.0.wrapping_add(0x9e37_79b9_7f4a_7c15));
        (self.0 % bound as u64) as usize
    }

    /// Ordinary text tokens: the special ids 0..3 (pad, bos, eos) are skipped.
    fn tokens(&mut self, len: usize, vocab: usize) -> Vec<TokenId> {
        (0..len).map(|_| (3 + self.below(vocab - 3)) as TokenId).collect()
    }
}

/// Deterministic test groups: prompt lengths 1..=24, 1..=6 responses of 1..=16 tokens.
fn groups(seed: u64, n: usize, vocab: usize) -> Vec<ScoredGroup> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|i| {
            let p = 1 + rng.below(24);
            let prompt = Prompt { id: PromptId(i as u64), tokens: rng.tokens(p, vocab), ..Prompt::default() };
            let g = 1 + rng.below(6);
            let completions = (0..g)
                .map(|s| {
                    let l = 1 + rng.below(16);
                    Completion {
                        sample_index: s as u32,
                        tokens: rng.tokens(l, vocab),
                        logprobs: vec![-1.0; l],
                        version: PolicyVersion(0),
                        ..Completion::default()
                    }
                })
                .collect();
            let group = Group { period: PeriodId(1), prompt, completions, ..Group::default() };
            let rewards = (0..g).map(|s| Reward::scalar((s % 2) as f32)).collect();
            ScoredGroup::new(group, rewards, AdvantageEstimator::GroupNorm)
                .expect("rewards match completions")
        })
        .collect()
}

/// Accumulated gradient of every parameter, by name.
type Gradients = Vec<(String, Vec<f32>)>;

/// Per-target log-probs of `layouts` (concatenated in order) and the gradient of
/// `−Σᵢ wᵢ·logpᵢ` for every parameter, summed over the layouts (gradient accumulation),
/// with weights `wᵢ` fixed by the target's global index.
fn logprobs_and_grads(model: &Model, layouts: &[Layout]) -> Result<(Vec<f32>, Gradients)> {
    let params = model.parameters();
    let mut grads: Vec<Vec<f32>> = params.iter().map(|(_, v)| vec![0.0; v.elem_count()]).collect();
    let mut logprobs = Vec::new();
    for l in layouts {
        let out = model.target_logprobs(&l.batch.rows, &l.batch.targets)?;
        let n = l.batch.targets.len();
        let w: Vec<f32> = (logprobs.len()..logprobs.len() + n).map(|i| 1.0 + (i % 3) as f32 * 0.5).collect();
        let weights = Tensor::from_vec(w, n, model.device())?;
        let loss = (out.logprobs.mul(&weights)?.sum_all()?.neg())?;
        let store = loss.backward()?;
        for ((name, var), acc) in params.iter().zip(&mut grads) {
            let g = store.get(var.as_tensor()).with_context(|| format!("no gradient for {name}"))?;
            for (a, x) in acc.iter_mut().zip(g.flatten_all()?.to_vec1::<f32>()?) {
                *a += x;
            }
        }
        logprobs.extend(out.logprobs.to_vec1::<f32>()?);
    }
    Ok((logprobs, params.into_iter().map(|(n, _)| n).zip(grads).collect()))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Asserts equal log-probs and gradients; returns the largest log-prob difference and
/// the largest gradient difference relative to its parameter's scale.
fn assert_equivalent(model: &Model, shared: &[Layout], baseline: &[Layout]) -> Result<(f32, f32)> {
    let (lp_s, g_s) = logprobs_and_grads(model, shared)?;
    let (lp_p, g_p) = logprobs_and_grads(model, baseline)?;
    ensure!(lp_s.len() == lp_p.len(), "{} shared targets vs {} padded", lp_s.len(), lp_p.len());
    let lp_diff = max_abs_diff(&lp_s, &lp_p);
    ensure!(lp_diff <= TOLERANCE, "log-probs differ by {lp_diff}");
    // Gradients are sums over every target (entries reach ~20 here), so their
    // tolerance scales with the parameter's largest entry: 1e-5 relative, and at least
    // 1e-5 absolute.
    let mut grad_diff = 0.0f32;
    for ((name, a), (_, b)) in g_s.iter().zip(&g_p) {
        ensure!(b.iter().any(|&x| x != 0.0), "parameter {name} got no gradient");
        let scale = b.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        let d = max_abs_diff(a, b);
        ensure!(d <= TOLERANCE * scale, "gradient of {name} differs by {d} (largest entry {scale})");
        grad_diff = grad_diff.max(d / scale);
    }
    Ok((lp_diff, grad_diff))
}

#[test]
fn shared_prompt_logprobs_and_gradients_equal_padded_rows() -> Result<()> {
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 7)?;
    let vocab = model.config().vocab_size;
    for (seed, g) in groups(11, 6, vocab).iter().enumerate() {
        let shared = shared_prompt(g)?;
        let baseline = padded(std::slice::from_ref(g), 0)?;
        let (lp, grad) = assert_equivalent(&model, &[shared], &[baseline])
            .with_context(|| format!("group {seed} ({})", g.key()))?;
        println!("group {seed}: max |Δ log-prob| {lp:.2e}, max relative |Δ grad| {grad:.2e}");
    }
    Ok(())
}

#[test]
fn packed_and_split_micro_batches_equal_padded_rows() -> Result<()> {
    // Several groups per row, several rows per micro-batch, and groups larger than a
    // row split with their prompt repeated: the accumulated gradient is unchanged.
    let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 3)?;
    let gs = groups(5, 8, model.config().vocab_size);
    let config = PackingConfig {
        layout: LayoutKind::SharedPrompt,
        row_tokens: 48,
        micro_batch_tokens: 96,
        split_oversized_groups: true,
        pad_token: 0,
        groups_per_pack: 1,
    };
    let shared = pack_period(&gs, &config)?;
    let account: metronome_masking::TokenAccount = shared.iter().map(|l| l.account).sum();
    ensure!(shared.len() > 1, "expected several micro-batches");
    ensure!(account.repeated_prompt_tokens() > 0, "expected a split group");
    ensure!(shared.iter().any(|l| l.batch.groups.len() > 1), "expected groups sharing a micro-batch");
    let baseline = pack_period(&gs, &PackingConfig { layout: LayoutKind::Padded, ..config })?;
    let (lp, grad) = assert_equivalent(&model, &shared, &baseline)?;
    println!(
        "{} micro-batches: max |Δ log-prob| {lp:.2e}, max relative |Δ grad| {grad:.2e}; tokens {} vs separate {}",
        shared.len(),
        account.positions(),
        account.separate
    );
    Ok(())
}
