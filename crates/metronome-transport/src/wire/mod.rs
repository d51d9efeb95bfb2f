//! The wire formats: scored groups, weight snapshots and control messages as bytes.
//!
//! Every message starts with the same 24-byte header, all integers little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic: `MTRG` (group), `MTRW` (weights), `MTRC` (control) |
//! | 4..6 | format version of this kind (`u16`) |
//! | 6..8 | flags, reserved, must be 0 |
//! | 8..16 | body length in bytes (`u64`) |
//! | 16..24 | xxh3-64 checksum of the body |
//!
//! A reader accepts the format versions from its oldest to its newest supported one
//! and rejects any other with [`Error::IncompatibleVersion`], which says whether the
//! writer is newer (upgrade the reader) or older (re-encode). A format change that an
//! old reader would misread must bump the version.
//!
//! Group bodies are hand-laid binary: token ids and log-probs are packed
//! little-endian arrays (copied with `bytemuck`, no per-element work on little-endian
//! machines), text is length-prefixed UTF-8. Weight bodies are a tensor table (name,
//! dtype, shape) followed by the raw tensor bytes back to back, like safetensors, so
//! encoding and decoding are one copy and one checksum pass. Control messages are
//! rare and tiny, so their body is `postcard`.
//!
//! Decoding never trusts a length: every count is checked against the bytes left
//! before anything is allocated, so a corrupted or hostile message is an error,
//! never a panic or an out-of-memory.
//!
//! The header, the version check and the reader and writer every format uses are in
//! `framing.rs`; each kind has its module (`group.rs`, `weights.rs`, `control.rs`),
//! and this one keeps what they share: the magics, the format versions and the size
//! limit check.

mod control;
mod framing;
mod group;
mod weights;

pub use control::{decode_control, encode_control};
pub use group::{decode_group, encode_group};
pub use weights::{WeightsDecoder, decode_weights, encode_weights, encode_weights_chunks};

use crate::{Error, Result};

/// Magic of a group message.
pub const GROUP_MAGIC: [u8; 4] = *b"MTRG";
/// Magic of a weight snapshot.
pub const WEIGHTS_MAGIC: [u8; 4] = *b"MTRW";
/// Magic of a control message.
pub const CONTROL_MAGIC: [u8; 4] = *b"MTRC";

/// The group format version this crate writes (and the newest it reads). Version 2
/// appends each completion's episode (observation spans, turns, reward, failure)
/// after the group statistics; version 3 then appends each completion's version
/// switches (partial rollouts). A version 1 group decodes with no episodes, and
/// versions 1 and 2 with no switches.
pub const GROUP_FORMAT_VERSION: u16 = 3;
/// The weights format version this crate writes (and the newest it reads).
pub const WEIGHTS_FORMAT_VERSION: u16 = 1;
/// The control format version this crate writes (and the newest it reads).
pub const CONTROL_FORMAT_VERSION: u16 = 1;
/// The oldest version of each kind this crate still reads.
const OLDEST_READABLE: u16 = 1;

/// Bytes of the common header.
pub const HEADER_LEN: usize = 24;

/// Returns [`Error::TooLarge`] when `size` exceeds `limit`.
pub fn check_size(kind: &'static str, size: usize, limit: usize) -> Result<()> {
    if size > limit {
        return Err(Error::TooLarge { kind, size: size as u64, limit: limit as u64 });
    }
    Ok(())
}
