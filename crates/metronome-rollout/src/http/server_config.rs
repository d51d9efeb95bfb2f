//! What a server accepts: [`ServerConfig`], its limits and their checks.

use std::path::PathBuf;

use metronome_core::Secret;
use serde::{Deserialize, Serialize};

use crate::{Error, LogprobsMode, Result};

/// What the server accepts. Every limit has a default that serves a rollout client
/// (`serde` form of `metronome serve`'s settings).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// The served model name (`model` in requests).
    pub model_name: String,
    /// Every request must carry `Authorization: Bearer <api_key>`; required to listen
    /// on a non-loopback address.
    pub api_key: Option<Secret>,
    /// The largest request body, in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Prompts per request at most.
    pub max_prompts: usize,
    /// Choices per prompt (`n`) at most.
    pub max_n: u32,
    /// `max_tokens` at most (the context length bounds it too).
    pub max_tokens: usize,
    /// Stop strings and stop token ids per request at most, each.
    pub max_stop: usize,
    /// Requests generating at once at most; more are answered 429 at once.
    pub max_concurrent_requests: usize,
    /// The only folder `load_weights` reads from; `None` refuses the route (403).
    pub weights_dir: Option<PathBuf>,
    /// The largest weights file `load_weights` reads, in bytes.
    pub max_weights_bytes: u64,
    /// Which log-prob every answer's `logprobs` carries: of the distribution each
    /// token was sampled from (`sampled`, the default: what a trainer scores), or of
    /// the raw model at temperature 1 (`raw`, as vLLM answers unless started with
    /// `--logprobs-mode processed_logprobs`).
    pub logprobs: LogprobsMode,
    /// Connections open at once at most; more wait in the listen backlog.
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (a new connection's first,
    /// or the next on a kept-alive one) before the connection is closed.
    pub header_timeout_s: f64,
    /// Seconds a client has to send a request's body once its headers are in (408).
    pub body_timeout_s: f64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_name: "metronome".into(),
            api_key: None,
            max_body_bytes: 4 << 20,
            max_prompts: 256,
            max_n: 64,
            max_tokens: 4096,
            max_stop: 16,
            max_concurrent_requests: 16,
            weights_dir: None,
            max_weights_bytes: 64 << 30,
            logprobs: LogprobsMode::Sampled,
            max_connections: 256,
            header_timeout_s: 10.0,
            body_timeout_s: 30.0,
        }
    }
}

/// The most connections a server may be configured to hold open.
const MAX_CONNECTIONS: usize = 65_536;

/// The longest header or body timeout a server may be configured with (one day).
const MAX_TIMEOUT_S: f64 = 86_400.0;

impl ServerConfig {
    /// The default limits, serving `model_name`.
    #[must_use]
    pub fn named(model_name: impl Into<String>) -> Self {
        Self { model_name: model_name.into(), ..Self::default() }
    }

    /// Checks the limits, and that a server reachable from other machines (bound to
    /// `addr`, not a loopback address) asks for a key; errors name the field.
    pub fn validate(&self, addr: std::net::SocketAddr) -> Result<()> {
        for (field, value) in [
            ("max_body_bytes", self.max_body_bytes),
            ("max_prompts", self.max_prompts),
            ("max_n", self.max_n as usize),
            ("max_tokens", self.max_tokens),
            ("max_concurrent_requests", self.max_concurrent_requests),
            ("max_connections", self.max_connections),
        ] {
            if value == 0 {
                return Err(Error::config(field, "is 0 (expected at least 1)"));
            }
        }
        // A connection holds a task and its buffers: beyond this the bound is no bound.
        if self.max_connections > MAX_CONNECTIONS {
            return Err(Error::config(
                "max_connections",
                format!("is {} (expected at most {MAX_CONNECTIONS})", self.max_connections),
            ));
        }
        for (field, value) in
            [("header_timeout_s", self.header_timeout_s), ("body_timeout_s", self.body_timeout_s)]
        {
            if !(value.is_finite() && value > 0.0 && value <= MAX_TIMEOUT_S) {
                return Err(Error::config(
                    field,
                    format!("is {value} (expected in (0, {MAX_TIMEOUT_S}] seconds)"),
                ));
            }
        }
        if self.api_key.as_ref().is_some_and(|k| k.expose().is_empty()) {
            return Err(Error::config("api_key", "is empty"));
        }
        if !addr.ip().is_loopback() && self.api_key.is_none() {
            return Err(Error::config(
                "api_key",
                format!("must be set to listen on {addr}, which other machines can reach"),
            ));
        }
        Ok(())
    }
}
