//! Integration tests of `metronome-core`: serde round trips of every wire type in a
//! text format (JSON) and a compact binary one (postcard), advantages, and layouts.

mod advantages;
mod layout;
mod serde_roundtrip;
