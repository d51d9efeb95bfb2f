//! The framing every message shares: the header (magic, format version, flags, body
//! length, checksum) checked against the versions a reader accepts, and the
//! little-endian writer and bounds-checked reader the formats are written with.

use bytemuck::Pod;
use xxhash_rust::xxh3::xxh3_64;

use super::{HEADER_LEN, OLDEST_READABLE};
use crate::{Error, Result};

/// Element types stored as packed little-endian arrays.
pub(super) trait Packed: Pod {
    fn swap_bytes(self) -> Self;
}

impl Packed for u32 {
    fn swap_bytes(self) -> Self {
        u32::swap_bytes(self)
    }
}

impl Packed for u16 {
    fn swap_bytes(self) -> Self {
        u16::swap_bytes(self)
    }
}

impl Packed for f32 {
    fn swap_bytes(self) -> Self {
        f32::from_bits(self.to_bits().swap_bytes())
    }
}

/// Copies little-endian bytes into a vector (one memcpy on little-endian machines;
/// the bytes need not be aligned).
pub(super) fn unpack<T: Packed>(raw: &[u8]) -> Vec<T> {
    let mut v: Vec<T> = bytemuck::zeroed_vec(raw.len() / size_of::<T>());
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(raw);
    if cfg!(target_endian = "big") {
        for x in &mut v {
            *x = x.swap_bytes();
        }
    }
    v
}

/// A message being written: the header with its length and checksum left blank, then
/// the body, which [`Writer::finish`] checksums into the header.
pub(super) struct Writer {
    pub(super) kind: &'static str,
    pub(super) buf: Vec<u8>,
}

impl Writer {
    pub(super) fn new(magic: [u8; 4], version: u16, body_capacity: usize, kind: &'static str) -> Self {
        let mut buf = Vec::with_capacity(HEADER_LEN + body_capacity);
        buf.extend_from_slice(&magic);
        buf.extend_from_slice(&version.to_le_bytes());
        buf.extend_from_slice(&0u16.to_le_bytes());
        buf.extend_from_slice(&[0; 16]);
        Self { kind, buf }
    }

    pub(super) fn finish(mut self) -> Vec<u8> {
        let body_len = (self.buf.len() - HEADER_LEN) as u64;
        let checksum = xxh3_64(&self.buf[HEADER_LEN..]);
        self.buf[8..16].copy_from_slice(&body_len.to_le_bytes());
        self.buf[16..24].copy_from_slice(&checksum.to_le_bytes());
        self.buf
    }

    pub(super) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    pub(super) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn f32(&mut self, v: f32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn f64(&mut self, v: f64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn len32(&mut self, n: usize, field: &'static str) -> Result<()> {
        let n = u32::try_from(n).map_err(|_| Error::Malformed {
            kind: self.kind,
            field: field.into(),
            reason: format!("length {n} does not fit the format's 32-bit count"),
        })?;
        self.u32(n);
        Ok(())
    }

    pub(super) fn str(&mut self, s: &str, field: &'static str) -> Result<()> {
        self.len32(s.len(), field)?;
        self.buf.extend_from_slice(s.as_bytes());
        Ok(())
    }

    pub(super) fn packed<T: Packed>(&mut self, v: &[T], field: &'static str) -> Result<()> {
        self.len32(v.len(), field)?;
        self.raw(v);
        Ok(())
    }

    pub(super) fn raw<T: Packed>(&mut self, v: &[T]) {
        if cfg!(target_endian = "little") {
            self.buf.extend_from_slice(bytemuck::cast_slice(v));
        } else {
            for &x in v {
                self.buf.extend_from_slice(bytemuck::bytes_of(&x.swap_bytes()));
            }
        }
    }
}

/// Checks magic, version and flags; returns the declared body length and checksum.
pub(super) fn parse_header(
    bytes: &[u8],
    kind: &'static str,
    magic: [u8; 4],
    newest: u16,
) -> Result<(u64, u64)> {
    let truncated = |field, needed: usize| Error::Truncated {
        kind,
        field,
        offset: 0,
        needed: needed as u64,
        available: bytes.len() as u64,
    };
    let found: [u8; 4] = bytes.get(..4).ok_or_else(|| truncated("magic", 4))?.try_into().unwrap_or_default();
    if found != magic {
        return Err(Error::BadMagic { kind, found, expected: magic });
    }
    let header = bytes.get(..HEADER_LEN).ok_or_else(|| truncated("header", HEADER_LEN))?;
    let le_u64 = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap_or_default());
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version > newest {
        return Err(Error::IncompatibleVersion {
            kind,
            found: version,
            oldest: OLDEST_READABLE,
            newest,
            hint: "the writer is newer than this reader; upgrade metronome on the receiving side",
        });
    }
    if version < OLDEST_READABLE {
        return Err(Error::IncompatibleVersion {
            kind,
            found: version,
            oldest: OLDEST_READABLE,
            newest,
            hint: "the writer is older than any format this reader supports; upgrade the sender",
        });
    }
    let flags = u16::from_le_bytes([header[6], header[7]]);
    if flags != 0 {
        return Err(Error::Malformed {
            kind,
            field: "flags".into(),
            reason: format!("unknown flags {flags:#06x}"),
        });
    }
    Ok((le_u64(8), le_u64(16)))
}

/// A checked message's body, read field by field; every read names its field in the
/// error when the bytes run out or do not parse.
pub(super) struct Reader<'a> {
    pub(super) kind: &'static str,
    /// The format version the message was written in.
    pub(super) version: u16,
    pub(super) body: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    /// Checks the header and the checksum, and returns a reader over the body.
    pub(super) fn open(bytes: &'a [u8], kind: &'static str, magic: [u8; 4], newest: u16) -> Result<Self> {
        let (body_len, expected) = parse_header(bytes, kind, magic, newest)?;
        let body = &bytes[HEADER_LEN..];
        if (body.len() as u64) < body_len {
            return Err(Error::Truncated {
                kind,
                field: "body",
                offset: HEADER_LEN,
                needed: body_len,
                available: body.len() as u64,
            });
        }
        if body.len() as u64 > body_len {
            return Err(Error::Malformed {
                kind,
                field: "body".into(),
                reason: format!("{} bytes follow a body of {body_len} bytes", body.len() as u64 - body_len),
            });
        }
        let actual = xxh3_64(body);
        if actual != expected {
            return Err(Error::Checksum { kind, expected, actual });
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        Ok(Self { kind, version, body, pos: 0 })
    }

    pub(super) fn remaining(&self) -> usize {
        self.body.len() - self.pos
    }

    pub(super) fn malformed(&self, field: &str, reason: String) -> Error {
        Error::Malformed {
            kind: self.kind,
            field: format!("{field} (byte {})", HEADER_LEN + self.pos),
            reason,
        }
    }

    pub(super) fn take(&mut self, n: u64, field: &'static str) -> Result<&'a [u8]> {
        let available = self.remaining() as u64;
        if n > available {
            return Err(Error::Truncated {
                kind: self.kind,
                field,
                offset: HEADER_LEN + self.pos,
                needed: n,
                available,
            });
        }
        let n = n as usize;
        let out = &self.body[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    pub(super) fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N]> {
        let bytes = self.take(N as u64, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    pub(super) fn u8(&mut self, field: &'static str) -> Result<u8> {
        Ok(self.array::<1>(field)?[0])
    }

    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    pub(super) fn f32(&mut self, field: &'static str) -> Result<f32> {
        Ok(f32::from_le_bytes(self.array(field)?))
    }

    pub(super) fn f64(&mut self, field: &'static str) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array(field)?))
    }

    /// Reads a count of items that take at least `min_item_bytes` each, refusing
    /// counts the remaining bytes cannot hold (so a corrupted count cannot make us
    /// allocate gigabytes).
    pub(super) fn count(&mut self, field: &'static str, min_item_bytes: u64) -> Result<usize> {
        let offset = HEADER_LEN + self.pos;
        let n = u64::from(self.u32(field)?);
        let available = self.remaining() as u64;
        if n.saturating_mul(min_item_bytes) > available {
            return Err(Error::Truncated {
                kind: self.kind,
                field,
                offset,
                needed: n.saturating_mul(min_item_bytes),
                available,
            });
        }
        Ok(n as usize)
    }

    pub(super) fn str(&mut self, field: &'static str) -> Result<String> {
        let n = u64::from(self.u32(field)?);
        let bytes = self.take(n, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.malformed(field, format!("not UTF-8: {e}"))),
        }
    }

    pub(super) fn packed<T: Packed>(&mut self, field: &'static str) -> Result<Vec<T>> {
        let n = u64::from(self.u32(field)?);
        let raw = self.take(n * size_of::<T>() as u64, field)?;
        Ok(unpack(raw))
    }

    pub(super) fn finish(self) -> Result<()> {
        if self.remaining() != 0 {
            return Err(
                self.malformed("end", format!("{} unread bytes after the last field", self.remaining()))
            );
        }
        Ok(())
    }
}
