//! Integration tests of the rollout engine on the tiny model (random weights with a
//! fixed seed): determinism across worker/slot layouts, streaming order, stop
//! handling, versioned weights, and the OpenAI-compatible server and client.

#[cfg(feature = "http")]
mod agent;
#[cfg(feature = "http")]
mod chat;
mod common;
mod determinism;
mod devices;
mod episodes;
#[cfg(feature = "http")]
mod http;
mod metrics;
#[cfg(feature = "http")]
mod openai;
mod partial;
mod pool;
mod rejected;
mod stops;
mod streaming;
mod versions;
