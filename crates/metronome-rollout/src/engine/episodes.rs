//! Multi-turn episodes in the engine: the setting ([`Episodes`]), a slot's side of a
//! running episode, and environment calls on threads of their own under a time limit
//! and `catch_unwind` (the worker ends turns, collects answers and appends
//! observations to a slot's KV cache: see the engine's docs).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use metronome_core::{Environment, Episode, ErrorChain, Observation, TokenSpan};

use crate::stop::Finish;
use crate::{Error, Result};

/// Multi-turn generation: the environment every response talks to, and the limits
/// that keep a run alive. The episode's token budget (policy and observation tokens
/// together) is the sampling's `max_new_tokens`, capped by the slot's context.
#[derive(Clone)]
pub struct Episodes {
    /// Starts one episode per response.
    pub environment: Arc<dyn Environment>,
    /// Most policy turns per episode; the environment is not called after the last.
    pub max_turns: u32,
    /// Time limit of one [`Episode::step`]; past it the episode ends (`tool_timeout`).
    pub tool_time_limit: Duration,
    /// Most environment calls running at once in the engine, timed-out ones that have
    /// not returned included (a thread cannot be killed): past it a turn's call is
    /// refused and its episode ends (`tool_unavailable`), so a tool that always hangs
    /// costs a bounded number of threads.
    pub max_running_calls: usize,
    /// Whether the run renders its prompts through the model's chat template: then
    /// an observation that carries a chat message is appended as the template
    /// writes it ([`Observation::render`]).
    pub chat_template: bool,
}

impl std::fmt::Debug for Episodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Episodes")
            .field("max_turns", &self.max_turns)
            .field("tool_time_limit", &self.tool_time_limit)
            .field("max_running_calls", &self.max_running_calls)
            .field("chat_template", &self.chat_template)
            .finish_non_exhaustive()
    }
}

impl Episodes {
    /// Checks the limits.
    pub fn validate(&self) -> Result<()> {
        if self.max_turns == 0 {
            return Err(Error::config("max_turns", "is 0 (expected >= 1)"));
        }
        if self.tool_time_limit.is_zero() {
            return Err(Error::config("tool_time_limit", "is 0 (expected a positive duration)"));
        }
        if self.max_running_calls == 0 {
            return Err(Error::config("max_running_calls", "is 0 (expected >= 1)"));
        }
        Ok(())
    }
}

/// A running episode's side of a slot.
pub(super) struct EpisodeState {
    /// The environment's episode; `None` while a call holds it.
    pub(super) episode: Option<Box<dyn Episode>>,
    /// The environment call under way: the slot waits and leaves the decode forward.
    pub(super) call: Option<ToolCall>,
    /// Index (in the response's tokens) where the current policy turn begins.
    pub(super) turn_start: usize,
    pub(super) observations: Vec<TokenSpan>,
    pub(super) turns: u32,
    pub(super) reward: Option<f32>,
}

/// What a tool thread sends back: the episode (to continue it) and the observation,
/// or why the call failed.
pub(super) type CallResult = (Option<Box<dyn Episode>>, std::result::Result<Observation, String>);

pub(super) struct ToolCall {
    pub(super) result: std_mpsc::Receiver<CallResult>,
    pub(super) deadline: Instant,
    /// How the turn ended, for the completion if this was the last.
    pub(super) finish: Finish,
}

/// Counts one running environment call until dropped.
struct Running(Arc<AtomicU64>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs `step` of `episode` on a thread of its own, catching panics; the receiver
/// gets the episode back with the observation, or the failure reason. Refused when
/// `max` calls are running already.
pub(super) fn spawn_tool_call(
    mut episode: Box<dyn Episode>,
    turn: String,
    running: &Arc<AtomicU64>,
    max: usize,
) -> std_mpsc::Receiver<CallResult> {
    let (tx, rx) = std_mpsc::sync_channel(1);
    if running.fetch_add(1, Ordering::AcqRel) >= max as u64 {
        running.fetch_sub(1, Ordering::AcqRel);
        let _ = tx.send((None, Err(format!("tool_unavailable: {max} environment calls are still running"))));
        return rx;
    }
    let guard = Running(Arc::clone(running));
    let spawned = std::thread::Builder::new().name("rollout-tool".into()).spawn({
        let tx = tx.clone();
        move || {
            let _running = guard;
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build();
            let result = match runtime {
                Ok(rt) => catch_unwind(AssertUnwindSafe(|| rt.block_on(episode.step(&turn)))),
                Err(e) => Ok(Err(metronome_core::Error::invalid("tool runtime", e.to_string()))),
            };
            // A receiver gone (timed out, cancelled) wants nothing any more.
            let _ = match result {
                Ok(Ok(obs)) => tx.send((Some(episode), Ok(obs))),
                Ok(Err(e)) => tx.send((None, Err(format!("tool_error: {}", ErrorChain(&e))))),
                Err(panic) => tx.send((None, Err(format!("tool_panic: {}", panic_message(&*panic))))),
            };
        }
    });
    if let Err(e) = spawned {
        let _ = tx.send((None, Err(format!("tool_error: no thread for the call: {e}"))));
    }
    rx
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
