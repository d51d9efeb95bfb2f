//! The `metronome` binary, run for real.

mod cluster;
mod nats_server;
mod prometheus;
