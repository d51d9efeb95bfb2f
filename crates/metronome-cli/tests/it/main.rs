//! The `metronome` binary, run for real.

mod cluster;
mod config;
mod prometheus;
mod resume;
mod serve;
