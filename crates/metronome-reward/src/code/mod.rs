//! The code-execution reward: the program of a completion run against its task's
//! tests in a sandbox.
//!
//! **The sandbox is [bubblewrap](https://github.com/containers/bubblewrap)** (`bwrap`,
//! what Flatpak runs applications in), with rlimits set by util-linux's `prlimit`
//! inside it. It was chosen over a home-made sandbox (namespaces and seccomp through
//! crates) because the part that must not have bugs, setting up namespaces and mounts
//! without privileges, is then a small, audited, widely deployed program maintained
//! by others, and what it gives is exactly what a policy's program must not escape:
//! its own user, PID, network, IPC and mount namespaces, a read-only view of the
//! interpreter and nothing else of the host, and death with its supervisor. A
//! container runtime would give the same at ten times the start-up cost and a daemon
//! to run; seccomp filters are not needed for containment here (there is nothing
//! reachable to attack but the kernel, which namespaces already narrow) and are left
//! out. See [`sandbox`] for the command line and what each part is for.
//!
//! - [`CodeConfig`] (`kind = "code"` in `[reward.scorer]`) builds a [`CodeReward`],
//!   probing the sandbox first: a machine that cannot create it is an error at
//!   start-up ([`crate::Error::Sandbox`]), never a silent fallback to running
//!   programs unsandboxed.
//! - The task's tests are a [`metronome_core::CodeTests`] in the prompt's reference,
//!   as JSON: assert-style tests run after the program in one interpreter by a small
//!   harness that reports each on a channel the program cannot print on; stdin/stdout
//!   cases run the program once per case and compare its output here, outside the
//!   sandbox, so the expected output never enters it.
//! - A program that fails is data, not an error: a [`Verdict`] (a [`VerdictKind`] and
//!   the reason in words) that becomes the reward, with the parts `correct` (1 when
//!   every test passed), `passed` (the fraction) and the verdict's own label (e.g.
//!   `timeout = 1`), and a count in `metronome_reward_code_executions_total{verdict}`.
//!   Only a task that cannot be scored (no tests, a malformed test spec) or a sandbox
//!   that fails to start is a scoring failure ([`metronome_core::Reward::failure`]).
//! - Executions run on the reward's worker pool ([`crate::PoolScorer`]): at most
//!   `pool.workers` at once, on OS threads, never on the async runtime's.
//!
//! What it does not do: the assert-style tests share an interpreter with the program,
//! as in HumanEval's own harness, so a program written to reach into the harness
//! (inspecting its frames, or returning objects whose `==` always holds) could pass
//! tests it should fail; the harness closes the easy doors (printing a pass, exiting
//! early, raising `SystemExit`). Stdin/stdout tests have no such hole. Memory is
//! limited per process (address space), not for the sandbox as a whole, which would
//! need a cgroup; the process limit bounds the product.

mod check;
mod extract;
pub mod hostile;
pub mod sandbox;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use metronome_core::{CodeTests, Completion, Prompt, Reward, RewardFn};

pub use check::{Verdict, VerdictKind};
pub use extract::{Extract, extract_program};
pub use sandbox::{Run, Sandbox, SandboxConfig, Stopped};

use crate::{Error, Result, metrics};

/// How a verdict becomes a score.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CodeScoring {
    /// `pass_score` when every test passed, else `fail_score`.
    #[default]
    All,
    /// `fail_score + (pass_score - fail_score) * passed / total`.
    Fraction,
}

/// Configuration of [`CodeReward`].
///
/// ```toml
/// [reward.scorer]
/// kind = "code"
/// extract = "fenced_or_whole"
/// scoring = "fraction"
/// sandbox = { wall_ms = 2000, memory_mb = 256 }
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CodeConfig {
    /// Where the program is in a completion.
    pub extract: Extract,
    /// Pass/fail or the passed fraction.
    pub scoring: CodeScoring,
    /// Score when every test passes.
    pub pass_score: f32,
    /// Score when none does (and of a completion without a program).
    pub fail_score: f32,
    /// Programs longer than this (in bytes) are not run.
    pub max_program_bytes: usize,
    /// Wall time of all the runs of one completion (stdin/stdout tests run once per
    /// case), in milliseconds; each run also stops at `sandbox.wall_ms`.
    pub time_budget_ms: u64,
    /// The sandbox's limits and view.
    pub sandbox: SandboxConfig,
}

impl Default for CodeConfig {
    fn default() -> Self {
        Self {
            extract: Extract::default(),
            scoring: CodeScoring::default(),
            pass_score: 1.0,
            fail_score: 0.0,
            max_program_bytes: 64 << 10,
            time_budget_ms: 4_000,
            sandbox: SandboxConfig::default(),
        }
    }
}

/// A program is passed to the interpreter as one argument; Linux refuses a longer one.
const MAX_ARG_BYTES: usize = 128 << 10;

impl CodeConfig {
    fn check(&self) -> Result<()> {
        crate::error::finite_scores(&[
            ("code.pass_score", self.pass_score),
            ("code.fail_score", self.fail_score),
        ])?;
        if self.max_program_bytes == 0 || self.max_program_bytes >= MAX_ARG_BYTES {
            return Err(Error::config(
                "code.max_program_bytes",
                format!("must be between 1 and {} (one argument of a command line)", MAX_ARG_BYTES - 1),
            ));
        }
        if self.time_budget_ms == 0 {
            return Err(Error::config("code.time_budget_ms", "must be positive"));
        }
        Ok(())
    }

    /// The longest one completion's scoring can take: the pool's time limit must be
    /// longer (checked by [`crate::RewardConfig::build`]).
    #[must_use]
    pub fn worst_case(&self) -> Duration {
        check::worst_case(Duration::from_millis(self.time_budget_ms))
    }

    /// Checks the config and starts the sandbox (a probe run): an error names the
    /// field at fault or says why the sandbox cannot be created on this machine.
    pub fn build(&self) -> Result<CodeReward> {
        self.check()?;
        let sandbox = Sandbox::new(self.sandbox.clone())?;
        Ok(CodeReward { config: self.clone(), sandbox: Arc::new(sandbox) })
    }
}

/// Scores a completion by running its program against the prompt's
/// [`CodeTests`] in the sandbox (see the module docs).
#[derive(Clone, Debug)]
pub struct CodeReward {
    config: CodeConfig,
    sandbox: Arc<Sandbox>,
}

/// Why a prompt cannot be scored: a scoring failure, not the program's.
#[derive(Debug)]
struct Unscorable(String);

/// The tests in a prompt's reference, or why there are none usable.
fn tests_of(prompt: &Prompt) -> std::result::Result<CodeTests, Unscorable> {
    let Some(reference) = prompt.reference.as_deref() else {
        return Err(Unscorable(format!("prompt {} has no code tests (its reference is empty)", prompt.id)));
    };
    let tests: CodeTests = serde_json::from_str(reference).map_err(|e| {
        Unscorable(format!(
            "prompt {} reference is not a code test spec (`{{\"kind\": \"assert\" | \"io\", …}}`): {e}",
            prompt.id
        ))
    })?;
    if tests.is_empty() {
        return Err(Unscorable(format!("prompt {} has a code test spec without any test", prompt.id)));
    }
    Ok(tests)
}

impl CodeReward {
    /// The sandbox it runs programs in.
    #[must_use]
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// Runs `completion`'s program against `prompt`'s tests. `Err` when the prompt has
    /// no usable tests or the sandbox failed to run (not the program's doing).
    pub fn verdict(&self, prompt: &Prompt, completion: &Completion) -> std::result::Result<Verdict, String> {
        let tests = tests_of(prompt).map_err(|u| u.0)?;
        self.verdict_for(&completion.text, &tests).map_err(|e| format!("the code sandbox failed to run: {e}"))
    }

    /// Runs the program of `text` against `tests`.
    pub fn verdict_for(&self, text: &str, tests: &CodeTests) -> std::io::Result<Verdict> {
        let c = &self.config;
        let started = Instant::now();
        let verdict = match extract_program(text, c.extract) {
            None => {
                Verdict::without_run(VerdictKind::NoProgram, tests.len(), "the completion holds no program")
            }
            Some(program) if program.len() > c.max_program_bytes => Verdict::without_run(
                VerdictKind::TooLong,
                tests.len(),
                format!("the program is {} bytes, more than {}", program.len(), c.max_program_bytes),
            ),
            Some(program) => check::check(
                &self.sandbox,
                program,
                tests,
                Duration::from_millis(c.time_budget_ms),
                c.scoring == CodeScoring::All,
            )?,
        };
        metrics::code_execution(verdict.kind.label(), started.elapsed());
        Ok(verdict)
    }

    /// The reward a verdict earns under this config.
    #[must_use]
    pub fn reward_of(&self, verdict: &Verdict) -> Reward {
        let c = &self.config;
        let correct = verdict.kind == VerdictKind::Passed;
        let total = match c.scoring {
            CodeScoring::All if correct => c.pass_score,
            CodeScoring::All => c.fail_score,
            CodeScoring::Fraction => c.fail_score + (c.pass_score - c.fail_score) * verdict.fraction(),
        };
        let mut reward = Reward::scalar(total);
        reward.parts.insert("correct".into(), f32::from(u8::from(correct)));
        reward.parts.insert("passed".into(), verdict.fraction());
        if !correct {
            reward.parts.insert(verdict.kind.label().into(), 1.0);
        }
        reward
    }
}

impl RewardFn for CodeReward {
    fn score(&self, prompt: &Prompt, completion: &Completion) -> Reward {
        match self.verdict(prompt, completion) {
            Ok(verdict) => {
                tracing::debug!(prompt = %prompt.id, verdict = verdict.kind.label(), "{}", verdict.detail);
                self.reward_of(&verdict)
            }
            Err(reason) => Reward::failed(self.config.fail_score, reason),
        }
    }
}
