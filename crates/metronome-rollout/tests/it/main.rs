//! Integration tests of the rollout engine on the tiny model (random weights with a
//! fixed seed): determinism across worker/slot layouts, streaming order, stop
//! handling, versioned weights, and the OpenAI-compatible server and client.

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
mod rejected;
mod stops;
mod streaming;
mod versions;
