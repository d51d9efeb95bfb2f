//! Integration tests of metronome-reward: one binary, one module per area.

mod code;
mod common;
mod config;
mod corpus;
mod countdown;
mod hostile;
mod judge;
mod math;
mod pool;
mod props;
mod remote;
mod text;
