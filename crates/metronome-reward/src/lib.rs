//! Metronome's reward stage: verifiable rewards for reasoning and code, and judge
//! models, that never stall or crash a run.
//!
//! - Scorers are synchronous [`metronome_core::RewardFn`]s (closures are scorers too):
//!   [`MathVerifier`] (final-answer extraction, normalisation and exact comparison; only
//!   a non-integer decimal reference such as `3.14159` accepts answers within half a
//!   unit of its last digit), [`ExactMatch`], [`FormatReward`] (regular expressions,
//!   e.g. the `<think>…</think><answer>…</answer>` structure), [`CountdownChecker`]
//!   (every given number exactly once, exact rational arithmetic), [`LengthShaping`]
//!   (DAPO's overlong shaping) and a weighted [`Composite`].
//! - [`PoolScorer`] is the [`metronome_core::GroupScorer`] the pipeline holds: it scores a
//!   group's completions in parallel on a [`WorkerPool`] with a time limit per call and
//!   panic isolation. A timeout, panic or non-finite score becomes the configured
//!   failure score with a reason in [`metronome_core::Reward::failure`] and a count in
//!   `metronome_reward_failures_total{reason}`; the run goes on. A stuck scorer costs
//!   one thread, which is replaced up to a bound (see [`pool`]).
//! - [`RemoteScorer`] is a [`metronome_core::GroupScorer`] for reward models served
//!   over HTTP (JSON), with timeout, retries with backoff and a concurrency limit.
//! - [`CodeReward`] ([`code`]) runs the program of a completion against the task's
//!   tests ([`metronome_core::CodeTests`] in the prompt's reference: asserts or
//!   stdin/stdout cases) in a **bubblewrap** sandbox, with rlimits set by `prlimit`:
//!   no network, a private tmpfs working directory, a read-only view of the
//!   interpreter and nothing else of the host, limits on CPU, wall time, memory,
//!   processes, open files, file size and output, and every process of it killed at
//!   the end (the module docs say why bubblewrap). It runs on the [`PoolScorer`]'s
//!   threads; a failing program is a [`Verdict`] with its reason, counted in
//!   `metronome_reward_code_executions_total{verdict}`; a machine that cannot create
//!   the sandbox fails at start-up ([`Error::Sandbox`]). [`code::hostile`] is the suite
//!   of hostile programs the tests hold it to.
//! - [`JudgeScorer`] is a [`metronome_core::GroupScorer`] that asks a judge model
//!   behind an OpenAI-compatible completions endpoint to grade each completion
//!   against a rubric template, reads a strict `SCORE: <n>`, caches judgements, and
//!   applies a [`JudgeFailure`] policy (the failure score, or dropping the group) to
//!   what it could not grade, within per-request timeouts, bounded retries and a
//!   per-group deadline.
//! - [`RewardConfig`] / [`ScorerConfig`] are serde configs that build all of the above
//!   (`kind = "code"` is a scorer; `kind = "judge"` a reward stage of its own).
//! - Multi-turn environments ([`metronome_core::Environment`]): [`CalculatorEnv`] (a
//!   calculator tool for arithmetic word problems) and [`CountdownEnv`] (feedback on
//!   invalid or wrong expressions), built from [`EnvConfig`], with tool calls parsed
//!   by [`parse_tool_call`] in the JSON-block or tag format. A bad call is answered
//!   with an observation that says what was wrong. [`PoolScorer`] takes an episode's
//!   own reward when its environment gave one, and scores the text otherwise.
//!
//! Parsers bound their own work: they read only the tail of a completion, cap the
//! length of an extracted answer or expression, the nesting depth and the digits of a
//! number, and charge their steps to a [`Meter`], so adversarial text costs linear time.
//!
//! ```
//! use metronome_core::{Completion, Group, Prompt};
//! use metronome_reward::{Composite, FormatReward, MathVerifier, PoolConfig, PoolScorer};
//!
//! let reward = Composite::of("correct", 1.0, MathVerifier::new())?
//!     .with("format", 0.1, FormatReward::think_answer())?;
//! let scorer = PoolScorer::new(reward, PoolConfig { workers: 2, ..PoolConfig::default() })?;
//! let group = Group {
//!     prompt: Prompt { reference: Some("4".into()), ..Prompt::default() },
//!     completions: ["<think>2+2</think><answer>4</answer>", r"\boxed{5}"]
//!         .iter()
//!         .enumerate()
//!         .map(|(i, t)| Completion { sample_index: i as u32, text: (*t).into(), ..Completion::default() })
//!         .collect(),
//!     ..Group::default()
//! };
//! let scored = scorer.score_blocking(group)?;
//! assert_eq!(scored.rewards[0].total, 1.1);
//! assert_eq!(scored.rewards[1].total, 0.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! This crate does not tokenise, generate or train, and it does not depend on other
//! stage crates: it sees only `metronome-core` types. The pipeline
//! (`metronome-pipeline`) puts a scorer between the rollout stage (`metronome-rollout`)
//! and the trainer (`metronome-trainer`); the data loader (`metronome-dataloader`)
//! supplies each prompt's `reference` and metadata (countdown's `numbers` and `target`;
//! a code task's tests).

pub mod code;
mod composite;
mod config;
mod countdown;
mod env;
mod error;
mod extract;
mod http;
mod judge;
mod length;
mod math;
mod meter;
mod metrics;
pub mod pool;
mod rational;
mod remote;
mod text;

pub use code::{
    CodeConfig, CodeReward, CodeScoring, Extract, Sandbox, SandboxConfig, Verdict, VerdictKind,
    extract_program,
};
pub use composite::{Component, Composite};
pub use config::{ComponentConfig, CompositeConfig, RewardConfig, ScorerConfig};
pub use countdown::{CountdownChecker, CountdownConfig, CountdownVerdict, Invalid};
pub use env::{
    CalculatorEnv, CountdownEnv, EnvConfig, EnvKind, ParsedTurn, ToolCall, ToolCallFormat, parse_tool_call,
};
pub use error::{Error, Result};
pub use extract::{Extractor, extract, tail};
pub use judge::{DEFAULT_TEMPLATE, JudgeConfig, JudgeFailure, JudgeScorer, parse_score};
pub use length::{LengthConfig, LengthShaping, LengthUnit};
pub use math::{Answer, MathConfig, MathVerdict, MathVerifier, Number, answers_match, parse_answer};
pub use meter::Meter;
pub use metrics::METRICS;
pub use pool::{Outcome, PoolConfig, PoolScorer, PoolStats, WorkerPool};
pub use rational::Rational;
pub use remote::{RemoteConfig, RemoteRequest, RemoteResponse, RemoteReward, RemoteScorer};
pub use text::{ExactMatch, ExactMatchConfig, FormatConfig, FormatReward, THINK_ANSWER_PATTERN};
