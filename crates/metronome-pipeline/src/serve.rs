//! `metronome serve`: the rollout engine of a config behind the OpenAI-compatible
//! completions and chat completions API (`metronome_rollout::http`), for clients that
//! are not Metronome's pipeline (an agent, through the official `openai` client), or
//! for Metronome's `OpenAiEngine` in another process.

use std::net::SocketAddr;
use std::sync::Arc;

use metronome_rollout::http::{Chat, ServerConfig, router_with_chat, serve_until};

use crate::builders::load_model;
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::events::{Event, Observer};

/// Serves the model of `config` (`[model]`, on `rollout.device`) through its native
/// rollout engine (`[rollout]`; `rollout.backend` is ignored) on `addr`, as `server`
/// says, until `shutdown` resolves.
/// Refuses, naming the setting, a server other machines can reach without an API key.
/// Tells `observer` where it listens ([`Event::Serving`]).
pub async fn serve(
    mut config: PipelineConfig,
    server: ServerConfig,
    addr: SocketAddr,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    observer: Observer,
) -> Result<()> {
    // The server is what an `openai` backend talks to: it serves the native engine of
    // `[rollout]` whatever the backend, so one config serves both sides.
    config.rollout.backend = metronome_rollout::Backend::Native;
    config.prepare()?;
    server.validate(addr).map_err(|e| Error::Config { key: "serve".into(), reason: e.to_string() })?;
    let (model, tokenizer) = load_model(&config, config.rollout_device())?;
    let inference = model.frozen_copy()?;
    drop(model);
    let seed = metronome_core::RunSeed(config.run.seed);
    let engine = config.rollout.build(inference, metronome_core::PolicyVersion(0), tokenizer, seed)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Config { key: "addr".into(), reason: format!("cannot listen on {addr}: {e}") })?;
    let local = listener.local_addr().map_err(|e| Error::Io { path: "socket".into(), source: e })?;
    tracing::info!(%local, model = %server.model_name, "serving");
    observer.emit(&Event::Serving { model: server.model_name.clone(), addr: local.to_string() });
    // Chat requests' tool calls are read and written as `[env]`'s environments write
    // them (the JSON format without `[env]`).
    let format = config.env.as_ref().map_or(metronome_reward::ToolCallFormat::Json, |e| e.format);
    let chat = Chat { template: None, tools: Some(Arc::new(format)) };
    serve_until(listener, router_with_chat(Arc::new(engine), server.clone(), chat), &server, shutdown)
        .await
        .map_err(|e| Error::Io { path: "socket".into(), source: e })
}
