//! The `metronome` binary, run for real.

mod prometheus;
