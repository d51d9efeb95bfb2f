//! The `metronome` binary, run for real.

mod cluster;
mod prometheus;
