//! GRPO with the calculator environment on the tiny model: held-out success and tool
//! use before and after a short `periodic` run, with `[env]` (episodes of up to three
//! turns, the `<calculator>…</calculator>` tag format) and, for comparison, without.
//!
//! ```text
//! cargo run -p metronome-pipeline --example calculator_tools -- \
//!     [--periods N] [--seed S] [--sft-steps N] [--tool-demonstrations SHARE] [--agent]
//! ```
//! Both settings warm-start on the same prompts; with `[env]` a share of them (default
//! 0.2, `sft.tool_demonstrations`) is shown solved with the calculator, so the policy
//! starts out calling it sometimes and GRPO has tool use to reinforce. It prints, per
//! setting, held-out accuracy (sampled at the rollout temperature, scored by the
//! environment when there is one) and the share of held-out trajectories that called
//! the calculator, after the warm start and after the RL periods. Under `cargo test
//! --examples` it runs one short period.
//!
//! With `--agent` it runs a third setting: the same `[env]` warm start and held-out
//! evaluation, with rollouts by the example agent `examples/agents/calculator_agent.py`
//! (the official `openai` client, its own calculator) through `rollout.backend =
//! "agent"`. Its chat template writes tool messages as `<result>…</result>` and the
//! others as their text, so its trajectories are the tag format's: the comparison is of
//! the rollout path alone. It needs python3 with the `openai` package. The agent runs
//! through `examples/agents/forkserver.py`, which imports `openai` once for the run
//! instead of once per episode.

use anyhow::Context;
use metronome_pipeline::{EvalPoint, PipelineConfig, RunOptions};

/// Held-out evaluations after the warm start and after the last period.
async fn measure(
    env: bool,
    agent: bool,
    periods: u64,
    seed: u64,
    sft_steps: u64,
    shown: f64,
) -> anyhow::Result<(EvalPoint, EvalPoint)> {
    let dir =
        std::env::temp_dir().join(format!("metronome-calculator-tools-{}-{env}-{agent}", std::process::id()));
    let mut overrides = vec![
        format!("run.periods={periods}"),
        format!("run.seed={seed}"),
        format!("sft.steps={sft_steps}"),
        format!("run.out_dir=\"{}\"", dir.display()),
        format!("eval.every={}", periods.max(1)),
    ];
    if env {
        overrides.extend([
            "env.kind=\"calculator\"".into(),
            "env.format=\"tag\"".into(),
            "env.max_turns=3".into(),
            format!("sft.tool_demonstrations={shown}"),
            // Room for `<calculator>12+34</calculator><result>46</result>46`: the limit
            // bounds the whole episode, observations included.
            "rollout.sampling.max_new_tokens=64".into(),
            "rollout.max_seq_len=96".into(),
        ]);
    }
    let mut config = PipelineConfig::embedded(&overrides)?;
    if agent {
        let agents = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/agents");
        let path = |file: &str| agents.join(file).display().to_string();
        config.rollout.backend = metronome_rollout::Backend::Agent;
        config.rollout.agent = metronome_rollout::AgentConfig {
            // Through the fork server: the agent unchanged, `openai` imported once
            // instead of once per episode.
            command: vec!["python3".into(), "-S".into(), path("forkserver.py"), path("calculator_agent.py")],
            env: [
                ("AGENT_MAX_TURNS".to_owned(), "3".to_owned()),
                ("AGENT_MAX_TOKENS".to_owned(), "32".to_owned()),
            ]
            .into(),
            reward: metronome_rollout::AgentReward::Stage,
            tool_format: metronome_rollout::AgentToolFormat::Tag,
            chat_template: Some(
                "{% for m in messages %}{% if m.role == 'tool' %}<result>{{ m.content }}</result>\
                 {% else %}{{ m.content }}{% endif %}{% endfor %}"
                    .into(),
            ),
            ..metronome_rollout::AgentConfig::default()
        };
    }
    let outcome = metronome_pipeline::run(config, RunOptions::default()).await;
    std::fs::remove_dir_all(&dir).ok();
    let evals = outcome?.evals;
    let first = *evals.first().context("no evaluation before RL")?;
    let last = *evals.last().context("no evaluation after RL")?;
    Ok((first, last))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    // `cargo test --examples` builds examples with cfg(test) and runs them: one short period.
    let quick = cfg!(test);
    let periods: u64 = arg("--periods").map_or(Ok(if quick { 1 } else { 30 }), |p| p.parse())?;
    let seed: u64 = arg("--seed").map_or(Ok(0), |s| s.parse())?;
    let sft_steps: u64 = arg("--sft-steps").map_or(Ok(if quick { 5 } else { 800 }), |s| s.parse())?;
    let shown: f64 = arg("--tool-demonstrations").map_or(Ok(0.2), |s| s.parse())?;
    let percent = |x: f64| format!("{:.1}%", 100.0 * x);
    let agent = args.iter().any(|a| a == "--agent");
    let settings: &[(bool, bool)] =
        if agent { &[(false, false), (true, false), (true, true)] } else { &[(false, false), (true, false)] };
    for &(env, agent) in settings {
        let (before, after) = measure(env, agent, periods, seed, sft_steps, shown).await?;
        let setting = match (env, agent) {
            (_, true) => "agent (example agent)",
            (true, false) => "with [env] calculator",
            (false, false) => "single-turn          ",
        };
        let tools = |p: &EvalPoint| p.tool_use.map_or_else(|| "-".into(), percent);
        println!(
            "{setting}: held-out success {} -> {} after {periods} GRPO periods; \
             trajectories calling the tool {} -> {}",
            percent(before.accuracy),
            percent(after.accuracy),
            tools(&before),
            tools(&after),
        );
    }
    Ok(())
}
