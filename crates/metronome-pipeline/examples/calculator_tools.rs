//! GRPO with the calculator environment on the tiny model: held-out success before
//! and after a short `periodic` run, with `[env]` (episodes of up to three turns, the
//! `<calculator>…</calculator>` tag format) and, for comparison, without it.
//!
//! ```text
//! cargo run -p metronome-pipeline --example calculator_tools -- [--periods N] [--seed S]
//! ```
//! It prints, per setting, held-out accuracy after the warm start and after the RL
//! periods (sampled at the rollout temperature, scored by the environment when there
//! is one), and the share of held-out trajectories that called the calculator. Under
//! `cargo test --examples` it runs one short period.

use anyhow::Context;
use metronome_core::{PeriodId, RolloutEngine, RolloutRequest};

use metronome_pipeline::{PipelineConfig, RunOptions, load_model};

async fn measure(env: bool, periods: u64, seed: u64, sft_steps: u64) -> anyhow::Result<(f64, f64, f64)> {
    let dir = tempfile_dir(env, seed)?;
    let mut overrides = vec![
        format!("run.periods={periods}"),
        format!("run.seed={seed}"),
        format!("sft.steps={sft_steps}"),
        format!("run.out_dir=\"{}\"", dir.display()),
        format!("eval.every={}", periods.max(1)),
    ];
    if env {
        overrides.extend(
            [
                "env.kind=\"calculator\"",
                "env.format=\"tag\"",
                "env.max_turns=3",
                "rollout.sampling.max_new_tokens=24",
            ]
            .map(String::from),
        );
    }
    let config = PipelineConfig::embedded(&overrides)?;
    let outcome = metronome_pipeline::run(config.clone(), RunOptions::default()).await?;
    let first = outcome.evals.first().context("no evaluation before RL")?.accuracy;
    let last = outcome.evals.last().context("no evaluation after RL")?.accuracy;
    // How often the trained policy calls the tool on held-out prompts.
    let tool_rate = if env {
        let (model, tokenizer) = load_model(&config, config.rollout_device())?;
        let version = outcome.weights.version;
        let engine = config.rollout.build(
            model.frozen_copy()?,
            version,
            tokenizer.clone(),
            metronome_core::RunSeed(config.run.seed),
        )?;
        let engine = metronome_pipeline::with_env(engine, &config)?;
        engine.install_weights(outcome.weights.clone()).await?;
        let mut data = config.data.clone();
        data.source = config.heldout_source().context("a held-out split")?;
        data.release.batch_size = config.eval.prompts;
        let mut loader = data.build(metronome_core::RunSeed(config.run.seed), tokenizer)?;
        let prompts = loader.next().await?.map(|b| b.prompts).unwrap_or_default();
        let sink = metronome_rollout::CollectSink::default();
        engine.generate(RolloutRequest { period: PeriodId(u64::MAX), prompts, group_size: 4 }, &sink).await?;
        let groups = sink.into_groups();
        let all: Vec<_> = groups.iter().flat_map(|g| &g.completions).collect();
        let called = all.iter().filter(|c| c.episode.as_ref().is_some_and(|e| e.turns > 1)).count();
        called as f64 / all.len().max(1) as f64
    } else {
        0.0
    };
    std::fs::remove_dir_all(&dir).ok();
    Ok((first, last, tool_rate))
}

fn tempfile_dir(env: bool, seed: u64) -> anyhow::Result<std::path::PathBuf> {
    let dir =
        std::env::temp_dir().join(format!("metronome-calculator-tools-{}-{env}-{seed}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    // `cargo test --examples` builds examples with cfg(test) and runs them: one short period.
    let quick = cfg!(test);
    let periods: u64 = arg("--periods").map_or(Ok(if quick { 1 } else { 30 }), |p| p.parse())?;
    let seed: u64 = arg("--seed").map_or(Ok(0), |s| s.parse())?;
    let sft_steps = if quick { 5 } else { 800 };
    for env in [false, true] {
        let (before, after, tools) = measure(env, periods, seed, sft_steps).await?;
        let setting = if env { "with [env] calculator" } else { "single-turn        " };
        println!(
            "{setting}: held-out success {:.1}% after the warm start, {:.1}% after {periods} GRPO periods; \
             trajectories calling the tool {:.1}%",
            100.0 * before,
            100.0 * after,
            100.0 * tools
        );
    }
    Ok(())
}
