//! The weight-snapshot format (`MTRW`): a tensor table (name, dtype, shape), then
//! every tensor's raw bytes back to back, like safetensors; written whole or in
//! chunks that borrow the tensors, read whole or streamed into the tensors
//! ([`WeightsDecoder`]).

use metronome_core::{HostTensor, PolicyVersion, TensorData, WeightSnapshot};

use super::framing::{Packed, Reader, Writer, parse_header, unpack};
use super::{HEADER_LEN, WEIGHTS_FORMAT_VERSION, WEIGHTS_MAGIC};
use crate::{Error, Result};

const DTYPE_F32: u8 = 0;
const DTYPE_BF16: u8 = 1;
const DTYPE_F16: u8 = 2;

/// Encodes a weight snapshot: a tensor table, then every tensor's raw bytes (of
/// resident tensors, read back from their device first).
pub fn encode_weights(snapshot: &WeightSnapshot) -> Result<Vec<u8>> {
    let snapshot = &*on_host(snapshot)?;
    let table: usize =
        snapshot.tensors.iter().map(|t| 4 + t.name.len() + 1 + 4 + 8 * t.shape.len() + 8).sum();
    let mut w =
        Writer::new(WEIGHTS_MAGIC, WEIGHTS_FORMAT_VERSION, 12 + table + snapshot.num_bytes(), "weights");
    write_weights_table(&mut w, snapshot)?;
    for t in &snapshot.tensors {
        match &t.data {
            TensorData::F32(v) => w.raw(v),
            TensorData::Bf16(v) | TensorData::F16(v) => w.raw(v),
            TensorData::Resident(_) => unreachable!("read back by `on_host`"),
        }
    }
    Ok(w.finish())
}

/// The snapshot with every tensor in host memory, for an encoder to borrow.
fn on_host(snapshot: &WeightSnapshot) -> Result<std::borrow::Cow<'_, WeightSnapshot>> {
    snapshot.on_host().map_err(|e| Error::Malformed {
        kind: "weights",
        field: "tensors".into(),
        reason: format!("cannot be read back from their device: {e}"),
    })
}

/// Decodes a weight snapshot written by [`encode_weights`].
pub fn decode_weights(bytes: &[u8]) -> Result<WeightSnapshot> {
    let mut r = Reader::open(bytes, "weights", WEIGHTS_MAGIC, WEIGHTS_FORMAT_VERSION)?;
    let (version, table) = read_weights_table(&mut r)?;
    let mut tensors = Vec::with_capacity(table.len());
    for entry in table {
        let raw = r.take(entry.nbytes, "tensor data")?;
        let data = match entry.dtype {
            DTYPE_F32 => TensorData::F32(unpack(raw)),
            DTYPE_BF16 => TensorData::Bf16(unpack(raw)),
            _ => TensorData::F16(unpack(raw)),
        };
        tensors.push(HostTensor { name: entry.name, shape: entry.shape, data });
    }
    r.finish()?;
    Ok(WeightSnapshot { version, tensors })
}

/// One row of a weights table.
struct TableEntry {
    name: String,
    dtype: u8,
    shape: Vec<usize>,
    nbytes: u64,
}

fn read_weights_table(r: &mut Reader<'_>) -> Result<(PolicyVersion, Vec<TableEntry>)> {
    let version = PolicyVersion(r.u64("version")?);
    let n = r.count("tensors", 17)?;
    let mut table = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str("tensor.name")?;
        let dtype = r.u8("tensor.dtype")?;
        let elem = match dtype {
            DTYPE_F32 => 4u64,
            DTYPE_BF16 | DTYPE_F16 => 2,
            t => return Err(r.malformed("tensor.dtype", format!("unknown dtype {t} for tensor {name}"))),
        };
        let ndim = r.count("tensor.shape", 8)?;
        let mut shape = Vec::with_capacity(ndim);
        for _ in 0..ndim {
            let d = r.u64("tensor.shape")?;
            shape.push(
                usize::try_from(d)
                    .map_err(|_| r.malformed("tensor.shape", format!("dimension {d} too large")))?,
            );
        }
        let numel = r.u64("tensor.numel")?;
        let product = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        if product != Some(numel) {
            return Err(r.malformed(
                "tensor.shape",
                format!("tensor {name}: shape {shape:?} does not hold {numel} elements"),
            ));
        }
        let nbytes = numel.checked_mul(elem).ok_or_else(|| {
            r.malformed("tensor.numel", format!("tensor {name}: {numel} elements overflow"))
        })?;
        table.push(TableEntry { name, dtype, shape, nbytes });
    }
    Ok((version, table))
}

/// Encodes a weight snapshot as a list of chunks of at most `max_chunk` bytes whose
/// concatenation equals [`encode_weights`]. Tensor data is not copied: the chunks
/// borrow it from the shared snapshot, so publishing costs one checksum pass (and a
/// read back to the host of a resident snapshot).
pub fn encode_weights_chunks(
    snapshot: &std::sync::Arc<WeightSnapshot>,
    max_chunk: usize,
) -> Result<Vec<bytes::Bytes>> {
    let max_chunk = max_chunk.max(1);
    let snapshot = &match on_host(snapshot)? {
        std::borrow::Cow::Borrowed(_) => std::sync::Arc::clone(snapshot),
        std::borrow::Cow::Owned(host) => std::sync::Arc::new(host),
    };
    if cfg!(target_endian = "big") {
        let all = bytes::Bytes::from(encode_weights(snapshot)?);
        return Ok((0..all.len())
            .step_by(max_chunk)
            .map(|a| all.slice(a..(a + max_chunk).min(all.len())))
            .collect());
    }
    // The table, then the header over the checksum of table and data.
    let mut table = encode_weights_table(snapshot)?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&table[HEADER_LEN..]);
    for t in &snapshot.tensors {
        hasher.update(tensor_bytes(&t.data));
    }
    let body_len = (table.len() - HEADER_LEN + snapshot.num_bytes()) as u64;
    table[8..16].copy_from_slice(&body_len.to_le_bytes());
    table[16..24].copy_from_slice(&hasher.digest().to_le_bytes());
    let head = bytes::Bytes::from(table);
    let mut chunks: Vec<bytes::Bytes> =
        (0..head.len()).step_by(max_chunk).map(|a| head.slice(a..(a + max_chunk).min(head.len()))).collect();
    for index in 0..snapshot.tensors.len() {
        let all = bytes::Bytes::from_owner(TensorBytes { snapshot: std::sync::Arc::clone(snapshot), index });
        chunks
            .extend((0..all.len()).step_by(max_chunk).map(|a| all.slice(a..(a + max_chunk).min(all.len()))));
    }
    Ok(chunks)
}

/// The version and tensor table of `snapshot` (names, dtypes, shapes, lengths): the
/// part of the weights format both the contiguous and the chunked encoders write.
fn write_weights_table(w: &mut Writer, snapshot: &WeightSnapshot) -> Result<()> {
    w.u64(snapshot.version.0);
    w.len32(snapshot.tensors.len(), "tensors")?;
    for t in &snapshot.tensors {
        check_shape(t)?;
        w.str(&t.name, "tensor.name")?;
        w.u8(dtype_code(&t.data));
        w.len32(t.shape.len(), "tensor.shape")?;
        for &d in &t.shape {
            w.u64(d as u64);
        }
        w.u64(t.data.len() as u64);
    }
    Ok(())
}

/// The header (checksum and length left zero) and the tensor table of `snapshot`.
fn encode_weights_table(snapshot: &WeightSnapshot) -> Result<Vec<u8>> {
    let mut w = Writer::new(WEIGHTS_MAGIC, WEIGHTS_FORMAT_VERSION, 256, "weights");
    write_weights_table(&mut w, snapshot)?;
    Ok(w.buf)
}

/// One tensor's bytes, owned through the shared snapshot.
struct TensorBytes {
    snapshot: std::sync::Arc<WeightSnapshot>,
    index: usize,
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        tensor_bytes(&self.snapshot.tensors[self.index].data)
    }
}

/// The bytes of host data (the encoders read resident data back first, the decoder
/// makes none).
fn tensor_bytes(data: &TensorData) -> &[u8] {
    match data {
        TensorData::F32(v) => bytemuck::cast_slice(v),
        TensorData::Bf16(v) | TensorData::F16(v) => bytemuck::cast_slice(v),
        TensorData::Resident(_) => unreachable!("read back by `on_host`"),
    }
}

fn dtype_code(data: &TensorData) -> u8 {
    match data {
        TensorData::F32(_) => DTYPE_F32,
        TensorData::Bf16(_) => DTYPE_BF16,
        TensorData::F16(_) => DTYPE_F16,
        TensorData::Resident(_) => unreachable!("read back by `on_host`"),
    }
}

fn check_shape(t: &HostTensor) -> Result<()> {
    let numel = t.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    if numel != Some(t.data.len()) {
        return Err(Error::Malformed {
            kind: "weights",
            field: format!("tensor {} shape", t.name),
            reason: format!("shape {:?} does not hold {} elements", t.shape, t.data.len()),
        });
    }
    Ok(())
}

/// Decodes a weight snapshot from chunks as they arrive, writing tensor bytes straight
/// into their final vectors (one copy) and checksumming on the way.
pub struct WeightsDecoder {
    expected_len: u64,
    received: u64,
    /// Bytes of header and table until the table is parsed.
    prefix: Vec<u8>,
    state: Option<Filling>,
    hasher: xxhash_rust::xxh3::Xxh3,
    /// Tensors of an older snapshot whose buffers may be filled instead of new ones.
    recycle: Vec<HostTensor>,
}

impl std::fmt::Debug for WeightsDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightsDecoder")
            .field("expected_len", &self.expected_len)
            .field("received", &self.received)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Filling {
    checksum: u64,
    version: PolicyVersion,
    tensors: Vec<HostTensor>,
    /// The tensor being filled and the bytes of it already written.
    at: (usize, usize),
}

impl WeightsDecoder {
    /// A decoder for a message of exactly `expected_len` bytes (as the store reports
    /// it); a header claiming another length is refused before anything is allocated.
    #[must_use]
    pub fn new(expected_len: u64) -> Self {
        Self::recycling(expected_len, Vec::new())
    }

    /// Like [`WeightsDecoder::new`], but a tensor of the message whose name, dtype and
    /// element count match one of `old` is written into that tensor's buffer instead
    /// of a fresh one. Successive versions of a model share their layout, so a
    /// subscriber that hands back the snapshot it no longer uses decodes the next one
    /// without allocating: the page faults of 100 MB of fresh memory cost about as
    /// much as copying it. Every byte of a reused buffer is overwritten before
    /// [`WeightsDecoder::finish`] succeeds (the body length is checked against the
    /// table), so nothing of the old snapshot survives in the new one. Resident tensors
    /// (`TensorData::Resident`) have no host buffer to lend and are dropped.
    #[must_use]
    pub fn recycling(expected_len: u64, old: Vec<HostTensor>) -> Self {
        let recycle = old.into_iter().filter(|t| !matches!(t.data, TensorData::Resident(_))).collect();
        Self {
            expected_len,
            received: 0,
            prefix: Vec::new(),
            state: None,
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            recycle,
        }
    }

    /// Feeds the next bytes.
    pub fn push(&mut self, mut chunk: &[u8]) -> Result<()> {
        self.received += chunk.len() as u64;
        if self.received > self.expected_len {
            return Err(Error::Malformed {
                kind: "weights",
                field: "body".into(),
                reason: format!("more than the announced {} bytes arrived", self.expected_len),
            });
        }
        if self.state.is_none() {
            self.prefix.extend_from_slice(chunk);
            chunk = &[];
            let Some(consumed) = self.try_parse_table()? else { return Ok(()) };
            let rest = self.prefix.split_off(consumed);
            self.hasher.update(&self.prefix[HEADER_LEN..]);
            self.prefix = Vec::new();
            self.fill(&rest)?;
        }
        self.fill(chunk)
    }

    /// Parses header and table once enough bytes are there; returns how many bytes
    /// of the prefix they took.
    fn try_parse_table(&mut self) -> Result<Option<usize>> {
        if self.prefix.len() < HEADER_LEN {
            return Ok(None);
        }
        let (body_len, checksum) =
            parse_header(&self.prefix, "weights", WEIGHTS_MAGIC, WEIGHTS_FORMAT_VERSION)?;
        if body_len.checked_add(HEADER_LEN as u64) != Some(self.expected_len) {
            return Err(Error::Malformed {
                kind: "weights",
                field: "header".into(),
                reason: format!(
                    "declares a body of {body_len} bytes in a message of {} bytes",
                    self.expected_len
                ),
            });
        }
        let body = &self.prefix[HEADER_LEN..];
        let mut r = Reader { kind: "weights", version: WEIGHTS_FORMAT_VERSION, body, pos: 0 };
        let (version, table) = match read_weights_table(&mut r) {
            Ok(t) => t,
            // The table continues in the next chunk.
            Err(Error::Truncated { .. }) if (self.prefix.len() as u64) < self.expected_len => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let table_len = r.pos as u64;
        let data: u64 = table.iter().map(|e| e.nbytes).sum();
        if table_len + data != body_len {
            return Err(Error::Malformed {
                kind: "weights",
                field: "tensors".into(),
                reason: format!(
                    "a table of {table_len} bytes and {data} bytes of data do not make a body of {body_len}"
                ),
            });
        }
        let mut old: std::collections::HashMap<String, TensorData> =
            std::mem::take(&mut self.recycle).into_iter().map(|t| (t.name, t.data)).collect();
        let tensors = table
            .into_iter()
            .map(|e| {
                let n = e.nbytes as usize;
                let reused =
                    old.remove(&e.name).filter(|d| dtype_code(d) == e.dtype && tensor_bytes(d).len() == n);
                let data = reused.unwrap_or_else(|| match e.dtype {
                    DTYPE_F32 => TensorData::F32(bytemuck::zeroed_vec(n / 4)),
                    DTYPE_BF16 => TensorData::Bf16(bytemuck::zeroed_vec(n / 2)),
                    _ => TensorData::F16(bytemuck::zeroed_vec(n / 2)),
                });
                HostTensor { name: e.name, shape: e.shape, data }
            })
            .collect();
        self.state = Some(Filling { checksum, version, tensors, at: (0, 0) });
        Ok(Some(HEADER_LEN + r.pos))
    }

    fn fill(&mut self, mut bytes: &[u8]) -> Result<()> {
        let Some(state) = self.state.as_mut() else { return Ok(()) };
        self.hasher.update(bytes);
        while !bytes.is_empty() {
            let (index, offset) = state.at;
            let Some(tensor) = state.tensors.get_mut(index) else {
                return Err(Error::Malformed {
                    kind: "weights",
                    field: "body".into(),
                    reason: "bytes after the last tensor".into(),
                });
            };
            let dst: &mut [u8] = match &mut tensor.data {
                TensorData::F32(v) => bytemuck::cast_slice_mut(v),
                TensorData::Bf16(v) | TensorData::F16(v) => bytemuck::cast_slice_mut(v),
                TensorData::Resident(_) => unreachable!("the decoder fills host tensors"),
            };
            let n = (dst.len() - offset).min(bytes.len());
            dst[offset..offset + n].copy_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            state.at = if offset + n == dst.len() { (index + 1, 0) } else { (index, offset + n) };
        }
        Ok(())
    }

    /// Checks that every byte arrived and the checksum matches, and returns the snapshot.
    pub fn finish(mut self) -> Result<WeightSnapshot> {
        let complete = self.received >= self.expected_len;
        let Some(mut state) = self.state.take().filter(|_| complete) else {
            return Err(Error::Truncated {
                kind: "weights",
                field: "body",
                offset: self.received as usize,
                needed: self.expected_len,
                available: self.received,
            });
        };
        // Skip empty tensors at the end, which take no bytes.
        while state.tensors.get(state.at.0).is_some_and(|t| t.data.is_empty()) {
            state.at.0 += 1;
        }
        if state.at.0 != state.tensors.len() {
            return Err(Error::Truncated {
                kind: "weights",
                field: "tensor data",
                offset: self.received as usize,
                needed: self.expected_len,
                available: self.received,
            });
        }
        let actual = self.hasher.digest();
        if actual != state.checksum {
            return Err(Error::Checksum { kind: "weights", expected: state.checksum, actual });
        }
        if cfg!(target_endian = "big") {
            for t in &mut state.tensors {
                match &mut t.data {
                    TensorData::F32(v) => v.iter_mut().for_each(|x| *x = Packed::swap_bytes(*x)),
                    TensorData::Bf16(v) | TensorData::F16(v) => {
                        v.iter_mut().for_each(|x| *x = Packed::swap_bytes(*x))
                    }
                    TensorData::Resident(_) => unreachable!("the decoder fills host tensors"),
                }
            }
        }
        Ok(WeightSnapshot { version: state.version, tensors: state.tensors })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_testkit::data::snapshot;

    #[test]
    fn weights_round_trip_bit_exactly() {
        let s = snapshot(5, 1000);
        let bytes = encode_weights(&s).unwrap();
        let back = decode_weights(&bytes).unwrap();
        assert_eq!(back.version, s.version);
        assert_eq!(encode_weights(&back).unwrap(), bytes);
    }

    #[test]
    fn chunks_concatenate_to_the_encoding_and_stream_back() {
        let s = std::sync::Arc::new(snapshot(5, 333));
        let whole = encode_weights(&s).unwrap();
        for max_chunk in [1, 7, 100, 4096, 1 << 20] {
            let chunks = encode_weights_chunks(&s, max_chunk).unwrap();
            assert!(chunks.iter().all(|c| c.len() <= max_chunk));
            let joined: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
            assert_eq!(joined, whole, "chunks of {max_chunk}");
        }
        for step in [1, 5, 64, 1000, whole.len()] {
            let mut d = WeightsDecoder::new(whole.len() as u64);
            for c in whole.chunks(step) {
                d.push(c).unwrap();
            }
            assert_eq!(encode_weights(&d.finish().unwrap()).unwrap(), whole, "pieces of {step}");
        }
    }

    #[test]
    fn the_streaming_decoder_refuses_what_the_plain_one_refuses() {
        let whole = encode_weights(&snapshot(5, 50)).unwrap();
        // Truncated.
        let mut d = WeightsDecoder::new(whole.len() as u64);
        d.push(&whole[..whole.len() - 1]).unwrap();
        assert!(matches!(d.finish(), Err(Error::Truncated { .. })));
        // Corrupted data.
        let mut bad = whole.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let mut d = WeightsDecoder::new(bad.len() as u64);
        d.push(&bad).unwrap();
        assert!(matches!(d.finish(), Err(Error::Checksum { .. })));
        // A length that disagrees with the store's.
        let mut d = WeightsDecoder::new(whole.len() as u64 + 10);
        assert!(matches!(d.push(&whole), Err(Error::Malformed { .. })));
        // Too many bytes.
        let mut d = WeightsDecoder::new(whole.len() as u64);
        d.push(&whole).unwrap();
        assert!(d.push(&[0]).is_err());
        // A newer writer.
        let mut newer = whole.clone();
        newer[4] = 7;
        let mut d = WeightsDecoder::new(newer.len() as u64);
        assert!(matches!(d.push(&newer), Err(Error::IncompatibleVersion { .. })));
    }

    fn data_ptr(t: &HostTensor) -> usize {
        tensor_bytes(&t.data).as_ptr() as usize
    }

    fn decode_recycling(bytes: &[u8], old: Vec<HostTensor>) -> Result<WeightSnapshot> {
        let mut d = WeightsDecoder::recycling(bytes.len() as u64, old);
        for c in bytes.chunks(100) {
            d.push(c)?;
        }
        d.finish()
    }

    #[test]
    fn a_recycled_snapshot_lends_its_buffers_and_leaves_nothing_behind() {
        let old = snapshot(1, 40);
        let ptrs: Vec<usize> = old.tensors.iter().map(data_ptr).collect();
        let new = snapshot(2, 40);
        let bytes = encode_weights(&new).unwrap();
        let got = decode_recycling(&bytes, old.tensors).unwrap();
        assert_eq!(encode_weights(&got).unwrap(), bytes, "every byte is the new version's");
        // Every non-empty tensor was written into the old buffer of the same name.
        let reused: Vec<usize> = got.tensors.iter().map(data_ptr).collect();
        assert_eq!(reused, ptrs);
    }

    #[test]
    fn recycling_skips_tensors_whose_layout_changed_or_that_are_resident() {
        let mut old = snapshot(1, 40);
        // Another dtype, another size, another name: none of them can be reused.
        old.tensors[0].data = TensorData::Bf16(vec![0; old.tensors[0].data.len()]);
        old.tensors[1].data = TensorData::F32(vec![0.0; 3]);
        old.tensors[1].shape = vec![3];
        old.tensors[2].name = "renamed".into();
        // Data resident on a device: no host buffer to lend.
        #[derive(Debug)]
        struct OnDevice(usize);
        impl metronome_core::ResidentData for OnDevice {
            fn len(&self) -> usize {
                self.0
            }
            fn num_bytes(&self) -> usize {
                4 * self.0
            }
            fn to_host(&self) -> std::result::Result<TensorData, String> {
                Ok(TensorData::F32(vec![0.0; self.0]))
            }
            fn as_any(&self) -> &dyn std::any::Any {
                self
            }
        }
        let resident = OnDevice(old.tensors[4].data.len());
        old.tensors[4].data = TensorData::Resident(metronome_core::Resident(std::sync::Arc::new(resident)));
        let kept = data_ptr(&old.tensors[3]);
        let bytes = encode_weights(&snapshot(2, 40)).unwrap();
        let got = decode_recycling(&bytes, old.tensors).unwrap();
        assert_eq!(encode_weights(&got).unwrap(), bytes);
        assert_eq!(data_ptr(&got.tensors[3]), kept, "an unchanged tensor is still reused");
    }

    #[test]
    fn recycling_still_refuses_truncated_and_corrupted_messages() {
        let bytes = encode_weights(&snapshot(2, 40)).unwrap();
        let mut d = WeightsDecoder::recycling(bytes.len() as u64, snapshot(1, 40).tensors);
        d.push(&bytes[..bytes.len() - 3]).unwrap();
        assert!(matches!(d.finish(), Err(Error::Truncated { .. })));
        let mut bad = bytes.clone();
        let middle = bad.len() / 2;
        bad[middle] ^= 0x10;
        let err = decode_recycling(&bad, snapshot(1, 40).tensors).unwrap_err();
        assert_eq!(err.reason(), "checksum", "{err}");
        // The same version over itself (nothing changes in the buffers) still checks out.
        let same = snapshot(2, 40);
        assert_eq!(encode_weights(&decode_recycling(&bytes, same.tensors).unwrap()).unwrap(), bytes);
    }

    #[test]
    fn a_shape_that_does_not_match_the_data_is_refused() {
        let mut s = snapshot(1, 10);
        s.tensors[0].shape.push(3);
        assert!(matches!(encode_weights(&s), Err(Error::Malformed { .. })));
    }
}
