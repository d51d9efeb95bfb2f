//! Integration tests of metronome-masking: one binary, one module per concern.

mod common;
mod errors;
mod examples;
mod props;
