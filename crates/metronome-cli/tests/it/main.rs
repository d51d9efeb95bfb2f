//! The `metronome` binary, run for real.

mod cluster;
mod config;
mod export;
mod openai;
mod prometheus;
mod resume;
mod rewards;
mod serve;
