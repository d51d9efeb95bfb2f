//! GRPO with the calculator environment on the tiny model: held-out success and tool
//! use before and after a short `periodic` run, with `[env]` (episodes of up to three
//! turns, the `<calculator>…</calculator>` tag format) and, for comparison, without.
//!
//! ```text
//! cargo run -p metronome-pipeline --example calculator_tools -- \
//!     [--periods N] [--seed S] [--sft-steps N] [--tool-demonstrations SHARE] [--agent]
//!     [--min-gain POINTS]
//! ```
//! Both settings warm-start on the same prompts; with `[env]` a share of them (default
//! 0.2, `sft.tool_demonstrations`) is shown solved with the calculator, so the policy
//! starts out calling it sometimes and GRPO has tool use to reinforce. It prints, per
//! setting, held-out accuracy (sampled at the rollout temperature, scored by the
//! environment when there is one) and the share of held-out trajectories that called
//! the calculator, after the warm start, every third of the run and after the last
//! period. Under `cargo test --examples` it runs one short period.
//!
//! With `--agent` it runs a third setting: the same `[env]` warm start and held-out
//! evaluation, with rollouts by the example agent `examples/agents/calculator_agent.py`
//! (the official `openai` client, its own calculator) through `rollout.backend =
//! "agent"`. Its chat template writes tool messages as `<result>…</result>` and the
//! others as their text, so its trajectories are the tag format's: the comparison is of
//! the rollout path alone. It needs python3 with the `openai` package. The agent runs
//! through `examples/agents/forkserver.py`, which imports `openai` once for the run
//! instead of once per episode, 16 at a time (`AGENT_CONCURRENCY`). With `--min-gain
//! POINTS` it fails unless the agent's held-out success rose by at least that much:
//! `cargo xtask agents` runs it so, as the learning test of the agent backend.

use anyhow::Context;
use metronome_pipeline::{EvalPoint, PipelineConfig, RunOptions};

/// The interpreter `python3` runs, by its path: a version manager's `python3` (pyenv's
/// shim) is a shell script that costs more CPU per start than the whole launch
/// through the fork server, once per episode.
fn python() -> anyhow::Result<String> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .context("starting python3")?;
    anyhow::ensure!(out.status.success(), "python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// Held-out evaluations: after the warm start, every third of the run, and after the
/// last period.
async fn measure(
    env: bool,
    agent: bool,
    periods: u64,
    seed: u64,
    sft_steps: u64,
    shown: f64,
) -> anyhow::Result<Vec<EvalPoint>> {
    let dir =
        std::env::temp_dir().join(format!("metronome-calculator-tools-{}-{env}-{agent}", std::process::id()));
    let mut overrides = vec![
        format!("run.periods={periods}"),
        format!("run.seed={seed}"),
        format!("sft.steps={sft_steps}"),
        format!("run.out_dir=\"{}\"", dir.display()),
        format!("eval.every={}", periods.div_ceil(3).max(1)),
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
            command: vec![python()?, "-S".into(), path("forkserver.py"), path("calculator_agent.py")],
            env: [
                ("AGENT_MAX_TURNS".to_owned(), "3".to_owned()),
                ("AGENT_MAX_TOKENS".to_owned(), "32".to_owned()),
            ]
            .into(),
            concurrency: match std::env::var("AGENT_CONCURRENCY") {
                Ok(c) => c.parse().with_context(|| format!("AGENT_CONCURRENCY={c:?} is not a count"))?,
                Err(_) => 16,
            },
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
    anyhow::ensure!(evals.len() >= 2, "expected evaluations before and after RL, got {}", evals.len());
    Ok(evals)
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
    let min_gain: Option<f64> = arg("--min-gain").map(|g| g.parse()).transpose()?;
    let percent = |x: f64| format!("{:.1}%", 100.0 * x);
    let agent = args.iter().any(|a| a == "--agent");
    anyhow::ensure!(min_gain.is_none() || agent, "--min-gain holds the agent setting to a gain: add --agent");
    let settings: &[(bool, bool)] =
        if agent { &[(false, false), (true, false), (true, true)] } else { &[(false, false), (true, false)] };
    let mut agent_gain = None;
    for &(env, agent) in settings {
        let started = std::time::Instant::now();
        let evals = measure(env, agent, periods, seed, sft_steps, shown).await?;
        let seconds = started.elapsed().as_secs_f64();
        let setting = match (env, agent) {
            (_, true) => "agent (example agent)",
            (true, false) => "with [env] calculator",
            (false, false) => "single-turn          ",
        };
        let curve = |value: &dyn Fn(&EvalPoint) -> String| {
            evals
                .iter()
                .map(|p| format!("{} @{}", value(p), p.after_periods))
                .collect::<Vec<_>>()
                .join(" -> ")
        };
        let tools = |p: &EvalPoint| p.tool_use.map_or_else(|| "-".into(), percent);
        println!(
            "{setting}: held-out success {}; trajectories calling the tool {} ({seconds:.0} s)",
            curve(&|p| percent(p.accuracy)),
            curve(&tools),
        );
        if agent {
            agent_gain = Some(evals[evals.len() - 1].accuracy - evals[0].accuracy);
        }
    }
    // `cargo xtask agents`: the example agent must learn, not only run.
    if let (Some(min), Some(gain)) = (min_gain, agent_gain) {
        anyhow::ensure!(
            100.0 * gain >= min,
            "the example agent's held-out success rose {:.1} points in {periods} periods; --min-gain asks for {min}",
            100.0 * gain
        );
        println!("the example agent gained {:.1} points (at least {min} asked)", 100.0 * gain);
    }
    Ok(())
}
