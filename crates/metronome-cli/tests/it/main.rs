//! The `metronome` binary, run for real.

mod cluster;
mod config;
mod openai;
mod prometheus;
mod resume;
mod rewards;
mod serve;
