//! Integration tests of metronome-masking: one binary, one module per concern.

mod common;
mod episodes;
mod errors;
mod examples;
mod props;
