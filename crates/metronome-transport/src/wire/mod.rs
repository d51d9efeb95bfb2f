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

use std::collections::BTreeMap;

use bytemuck::Pod;
use metronome_core::{
    Completion, ControlMessage, EpisodeTrace, FinishReason, Group, GroupStats, GroupTiming, HostTensor,
    PeriodId, PolicyVersion, Prompt, PromptId, Reward, ScoredGroup, TensorData, TokenSpan, WeightSnapshot,
};
use xxhash_rust::xxh3::xxh3_64;

use crate::{Error, Result};

/// Magic of a group message.
pub const GROUP_MAGIC: [u8; 4] = *b"MTRG";
/// Magic of a weight snapshot.
pub const WEIGHTS_MAGIC: [u8; 4] = *b"MTRW";
/// Magic of a control message.
pub const CONTROL_MAGIC: [u8; 4] = *b"MTRC";

/// The group format version this crate writes (and the newest it reads). Version 2
/// appends each completion's episode (observation spans, turns, reward, failure)
/// after the group statistics; a version 1 group decodes with no episodes.
pub const GROUP_FORMAT_VERSION: u16 = 2;
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

/// Encodes a scored group. The group is validated first, so that a broken group is
/// refused at the sender rather than at the trainer.
pub fn encode_group(scored: &ScoredGroup) -> Result<Vec<u8>> {
    validate_scored(scored)?;
    let group = &scored.group;
    let approx = 256
        + group.prompt.text.len()
        + group.prompt.tokens.len() * 4
        + group.completions.iter().map(|c| 64 + c.text.len() + c.tokens.len() * 8).sum::<usize>()
        + scored.rewards.len() * 32;
    let mut w = Writer::new(GROUP_MAGIC, GROUP_FORMAT_VERSION, approx, "group");
    w.u64(group.period.0);
    w.u64(group.prompt.id.0);
    w.str(&group.prompt.text, "prompt.text")?;
    w.packed(&group.prompt.tokens, "prompt.tokens")?;
    match &group.prompt.reference {
        None => w.u8(0),
        Some(r) => {
            w.u8(1);
            w.str(r, "prompt.reference")?;
        }
    }
    w.len32(group.prompt.metadata.len(), "prompt.metadata")?;
    for (k, v) in &group.prompt.metadata {
        w.str(k, "prompt.metadata key")?;
        w.str(v, "prompt.metadata value")?;
    }
    w.f64(group.timing.started_s);
    w.f64(group.timing.finished_s);
    w.len32(group.completions.len(), "completions")?;
    for c in &group.completions {
        w.u32(c.sample_index);
        w.u8(finish_reason_code(c.finish_reason));
        w.u64(c.version.0);
        w.str(&c.text, "completion.text")?;
        w.packed(&c.tokens, "completion.tokens")?;
        w.packed(&c.logprobs, "completion.logprobs")?;
    }
    w.len32(scored.rewards.len(), "rewards")?;
    for r in &scored.rewards {
        w.f32(r.total);
        w.len32(r.parts.len(), "reward.parts")?;
        for (k, v) in &r.parts {
            w.str(k, "reward.parts key")?;
            w.f32(*v);
        }
        match &r.failure {
            None => w.u8(0),
            Some(f) => {
                w.u8(1);
                w.str(f, "reward.failure")?;
            }
        }
    }
    w.packed(&scored.advantages, "advantages")?;
    w.f32(scored.stats.mean);
    w.f32(scored.stats.std);
    w.u8(u8::from(scored.stats.all_equal));
    for c in &group.completions {
        write_episode(&mut w, c.episode.as_ref())?;
    }
    Ok(w.finish())
}

/// Decodes a scored group written by [`encode_group`] and checks its invariants.
pub fn decode_group(bytes: &[u8]) -> Result<ScoredGroup> {
    let mut r = Reader::open(bytes, "group", GROUP_MAGIC, GROUP_FORMAT_VERSION)?;
    let period = PeriodId(r.u64("period")?);
    let id = PromptId(r.u64("prompt.id")?);
    let text = r.str("prompt.text")?;
    let tokens = r.packed("prompt.tokens")?;
    let reference = match r.u8("prompt.reference tag")? {
        0 => None,
        1 => Some(r.str("prompt.reference")?),
        t => return Err(r.malformed("prompt.reference tag", format!("unknown tag {t}"))),
    };
    let n = r.count("prompt.metadata", 8)?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n {
        let k = r.str("prompt.metadata key")?;
        let v = r.str("prompt.metadata value")?;
        metadata.insert(k, v);
    }
    let timing =
        GroupTiming { started_s: r.f64("timing.started_s")?, finished_s: r.f64("timing.finished_s")? };
    let n = r.count("completions", 25)?;
    let mut completions = Vec::with_capacity(n);
    for _ in 0..n {
        let sample_index = r.u32("completion.sample_index")?;
        let finish_reason = match r.u8("completion.finish_reason")? {
            0 => FinishReason::Stop,
            1 => FinishReason::StopString,
            2 => FinishReason::Length,
            3 => FinishReason::Aborted,
            4 => FinishReason::PromptRejected,
            t => return Err(r.malformed("completion.finish_reason", format!("unknown code {t}"))),
        };
        let version = PolicyVersion(r.u64("completion.version")?);
        let text = r.str("completion.text")?;
        let tokens = r.packed("completion.tokens")?;
        let logprobs = r.packed("completion.logprobs")?;
        completions.push(Completion {
            sample_index,
            tokens,
            logprobs,
            text,
            finish_reason,
            version,
            episode: None,
        });
    }
    let n = r.count("rewards", 9)?;
    let mut rewards = Vec::with_capacity(n);
    for _ in 0..n {
        let total = r.f32("reward.total")?;
        let parts_n = r.count("reward.parts", 8)?;
        let mut parts = BTreeMap::new();
        for _ in 0..parts_n {
            let k = r.str("reward.parts key")?;
            let v = r.f32("reward.parts value")?;
            parts.insert(k, v);
        }
        let failure = match r.u8("reward.failure tag")? {
            0 => None,
            1 => Some(r.str("reward.failure")?),
            t => return Err(r.malformed("reward.failure tag", format!("unknown tag {t}"))),
        };
        rewards.push(Reward { total, parts, failure });
    }
    let advantages = r.packed("advantages")?;
    let stats = GroupStats {
        mean: r.f32("stats.mean")?,
        std: r.f32("stats.std")?,
        all_equal: match r.u8("stats.all_equal")? {
            0 => false,
            1 => true,
            t => return Err(r.malformed("stats.all_equal", format!("not a boolean: {t}"))),
        },
    };
    if r.version >= 2 {
        for c in &mut completions {
            c.episode = read_episode(&mut r)?;
        }
    }
    r.finish()?;
    let scored = ScoredGroup {
        group: Group {
            period,
            prompt: Prompt { id, text, tokens, reference, metadata },
            completions,
            timing,
        },
        rewards,
        advantages,
        stats,
    };
    validate_scored(&scored)?;
    Ok(scored)
}

/// A completion's episode: a tag (0 none, 1 some), then the observation spans as a
/// packed `u32` array of `start, len` pairs, the turns, the reward (tag and `f32`)
/// and the failure (tag and string).
fn write_episode(w: &mut Writer, episode: Option<&EpisodeTrace>) -> Result<()> {
    let Some(e) = episode else {
        w.u8(0);
        return Ok(());
    };
    w.u8(1);
    let spans: Vec<u32> = e.observations.iter().flat_map(|s| [s.start, s.len]).collect();
    w.packed(&spans, "episode.observations")?;
    w.u32(e.turns);
    match e.reward {
        None => w.u8(0),
        Some(r) => {
            w.u8(1);
            w.f32(r);
        }
    }
    match &e.failure {
        None => w.u8(0),
        Some(f) => {
            w.u8(1);
            w.str(f, "episode.failure")?;
        }
    }
    Ok(())
}

fn read_episode(r: &mut Reader<'_>) -> Result<Option<EpisodeTrace>> {
    match r.u8("episode tag")? {
        0 => return Ok(None),
        1 => {}
        t => return Err(r.malformed("episode tag", format!("unknown tag {t}"))),
    }
    let spans: Vec<u32> = r.packed("episode.observations")?;
    if !spans.len().is_multiple_of(2) {
        return Err(
            r.malformed("episode.observations", format!("{} numbers, not start/len pairs", spans.len()))
        );
    }
    let observations = spans.chunks_exact(2).map(|p| TokenSpan { start: p[0], len: p[1] }).collect();
    let turns = r.u32("episode.turns")?;
    let reward = match r.u8("episode.reward tag")? {
        0 => None,
        1 => Some(r.f32("episode.reward")?),
        t => return Err(r.malformed("episode.reward tag", format!("unknown tag {t}"))),
    };
    let failure = match r.u8("episode.failure tag")? {
        0 => None,
        1 => Some(r.str("episode.failure")?),
        t => return Err(r.malformed("episode.failure tag", format!("unknown tag {t}"))),
    };
    Ok(Some(EpisodeTrace { observations, turns, reward, failure }))
}

fn validate_scored(scored: &ScoredGroup) -> Result<()> {
    let key = scored.key();
    scored.group.validate().map_err(|e| Error::Malformed {
        kind: "group",
        field: "completions".into(),
        reason: e.to_string(),
    })?;
    let n = scored.group.completions.len();
    if scored.rewards.len() != n || scored.advantages.len() != n {
        return Err(Error::Malformed {
            kind: "group",
            field: "rewards".into(),
            reason: format!(
                "group {key} has {} rewards and {} advantages for {n} completions",
                scored.rewards.len(),
                scored.advantages.len()
            ),
        });
    }
    Ok(())
}

fn finish_reason_code(reason: FinishReason) -> u8 {
    match reason {
        FinishReason::Stop => 0,
        FinishReason::StopString => 1,
        FinishReason::Length => 2,
        FinishReason::Aborted => 3,
        FinishReason::PromptRejected => 4,
    }
}

const DTYPE_F32: u8 = 0;
const DTYPE_BF16: u8 = 1;
const DTYPE_F16: u8 = 2;

/// Encodes a weight snapshot: a tensor table, then every tensor's raw bytes.
pub fn encode_weights(snapshot: &WeightSnapshot) -> Result<Vec<u8>> {
    let table: usize =
        snapshot.tensors.iter().map(|t| 4 + t.name.len() + 1 + 4 + 8 * t.shape.len() + 8).sum();
    let mut w =
        Writer::new(WEIGHTS_MAGIC, WEIGHTS_FORMAT_VERSION, 12 + table + snapshot.num_bytes(), "weights");
    write_weights_table(&mut w, snapshot)?;
    for t in &snapshot.tensors {
        match &t.data {
            TensorData::F32(v) => w.raw(v),
            TensorData::Bf16(v) | TensorData::F16(v) => w.raw(v),
        }
    }
    Ok(w.finish())
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
/// borrow it from the shared snapshot, so publishing costs one checksum pass.
pub fn encode_weights_chunks(
    snapshot: &std::sync::Arc<WeightSnapshot>,
    max_chunk: usize,
) -> Result<Vec<bytes::Bytes>> {
    let max_chunk = max_chunk.max(1);
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

fn tensor_bytes(data: &TensorData) -> &[u8] {
    match data {
        TensorData::F32(v) => bytemuck::cast_slice(v),
        TensorData::Bf16(v) | TensorData::F16(v) => bytemuck::cast_slice(v),
    }
}

fn dtype_code(data: &TensorData) -> u8 {
    match data {
        TensorData::F32(_) => DTYPE_F32,
        TensorData::Bf16(_) => DTYPE_BF16,
        TensorData::F16(_) => DTYPE_F16,
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
    /// table), so nothing of the old snapshot survives in the new one.
    #[must_use]
    pub fn recycling(expected_len: u64, old: Vec<HostTensor>) -> Self {
        Self {
            expected_len,
            received: 0,
            prefix: Vec::new(),
            state: None,
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            recycle: old,
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
                }
            }
        }
        Ok(WeightSnapshot { version: state.version, tensors: state.tensors })
    }
}

/// Encodes a control message.
pub fn encode_control(message: &ControlMessage) -> Result<Vec<u8>> {
    let body = postcard::to_allocvec(message).map_err(|e| Error::Malformed {
        kind: "control",
        field: "body".into(),
        reason: e.to_string(),
    })?;
    let mut w = Writer::new(CONTROL_MAGIC, CONTROL_FORMAT_VERSION, body.len(), "control");
    w.buf.extend_from_slice(&body);
    Ok(w.finish())
}

/// Decodes a control message.
pub fn decode_control(bytes: &[u8]) -> Result<ControlMessage> {
    let mut r = Reader::open(bytes, "control", CONTROL_MAGIC, CONTROL_FORMAT_VERSION)?;
    let body = r.take(r.remaining() as u64, "body")?;
    postcard::from_bytes(body).map_err(|e| Error::Malformed {
        kind: "control",
        field: "body".into(),
        reason: e.to_string(),
    })
}

/// Element types stored as packed little-endian arrays.
trait Packed: Pod {
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
fn unpack<T: Packed>(raw: &[u8]) -> Vec<T> {
    let mut v: Vec<T> = bytemuck::zeroed_vec(raw.len() / size_of::<T>());
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(raw);
    if cfg!(target_endian = "big") {
        for x in &mut v {
            *x = x.swap_bytes();
        }
    }
    v
}

struct Writer {
    kind: &'static str,
    buf: Vec<u8>,
}

impl Writer {
    fn new(magic: [u8; 4], version: u16, body_capacity: usize, kind: &'static str) -> Self {
        let mut buf = Vec::with_capacity(HEADER_LEN + body_capacity);
        buf.extend_from_slice(&magic);
        buf.extend_from_slice(&version.to_le_bytes());
        buf.extend_from_slice(&0u16.to_le_bytes());
        buf.extend_from_slice(&[0; 16]);
        Self { kind, buf }
    }

    fn finish(mut self) -> Vec<u8> {
        let body_len = (self.buf.len() - HEADER_LEN) as u64;
        let checksum = xxh3_64(&self.buf[HEADER_LEN..]);
        self.buf[8..16].copy_from_slice(&body_len.to_le_bytes());
        self.buf[16..24].copy_from_slice(&checksum.to_le_bytes());
        self.buf
    }

    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn f32(&mut self, v: f32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn f64(&mut self, v: f64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn len32(&mut self, n: usize, field: &'static str) -> Result<()> {
        let n = u32::try_from(n).map_err(|_| Error::Malformed {
            kind: self.kind,
            field: field.into(),
            reason: format!("length {n} does not fit the format's 32-bit count"),
        })?;
        self.u32(n);
        Ok(())
    }

    fn str(&mut self, s: &str, field: &'static str) -> Result<()> {
        self.len32(s.len(), field)?;
        self.buf.extend_from_slice(s.as_bytes());
        Ok(())
    }

    fn packed<T: Packed>(&mut self, v: &[T], field: &'static str) -> Result<()> {
        self.len32(v.len(), field)?;
        self.raw(v);
        Ok(())
    }

    fn raw<T: Packed>(&mut self, v: &[T]) {
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
fn parse_header(bytes: &[u8], kind: &'static str, magic: [u8; 4], newest: u16) -> Result<(u64, u64)> {
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

struct Reader<'a> {
    kind: &'static str,
    /// The format version the message was written in.
    version: u16,
    body: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Checks the header and the checksum, and returns a reader over the body.
    fn open(bytes: &'a [u8], kind: &'static str, magic: [u8; 4], newest: u16) -> Result<Self> {
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

    fn remaining(&self) -> usize {
        self.body.len() - self.pos
    }

    fn malformed(&self, field: &str, reason: String) -> Error {
        Error::Malformed {
            kind: self.kind,
            field: format!("{field} (byte {})", HEADER_LEN + self.pos),
            reason,
        }
    }

    fn take(&mut self, n: u64, field: &'static str) -> Result<&'a [u8]> {
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

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N]> {
        let bytes = self.take(N as u64, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8> {
        Ok(self.array::<1>(field)?[0])
    }

    fn u32(&mut self, field: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    fn f32(&mut self, field: &'static str) -> Result<f32> {
        Ok(f32::from_le_bytes(self.array(field)?))
    }

    fn f64(&mut self, field: &'static str) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array(field)?))
    }

    /// Reads a count of items that take at least `min_item_bytes` each, refusing
    /// counts the remaining bytes cannot hold (so a corrupted count cannot make us
    /// allocate gigabytes).
    fn count(&mut self, field: &'static str, min_item_bytes: u64) -> Result<usize> {
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

    fn str(&mut self, field: &'static str) -> Result<String> {
        let n = u64::from(self.u32(field)?);
        let bytes = self.take(n, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.malformed(field, format!("not UTF-8: {e}"))),
        }
    }

    fn packed<T: Packed>(&mut self, field: &'static str) -> Result<Vec<T>> {
        let n = u64::from(self.u32(field)?);
        let raw = self.take(n * size_of::<T>() as u64, field)?;
        Ok(unpack(raw))
    }

    fn finish(self) -> Result<()> {
        if self.remaining() != 0 {
            return Err(
                self.malformed("end", format!("{} unread bytes after the last field", self.remaining()))
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_testkit::data::{scored_group, snapshot};

    #[test]
    fn group_round_trips_bit_exactly() {
        let g = scored_group(3, 7, 4, 33);
        let bytes = encode_group(&g).unwrap();
        assert_eq!(&bytes[..4], b"MTRG");
        assert_eq!(decode_group(&bytes).unwrap(), g);
    }

    #[test]
    fn group_encoding_is_compact() {
        // 4 responses of 256 tokens: ids and log-probs take 8 bytes per token packed;
        // JSON would take several times that.
        let g = scored_group(0, 1, 4, 256);
        let bytes = encode_group(&g).unwrap();
        let payload = 4 * 256 * 8;
        assert!(bytes.len() < payload + 2048, "{} bytes for {payload} bytes of arrays", bytes.len());
    }

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
    fn recycling_skips_tensors_whose_layout_changed() {
        let mut old = snapshot(1, 40);
        // Another dtype, another size, another name: none of them can be reused.
        old.tensors[0].data = TensorData::Bf16(vec![0; old.tensors[0].data.len()]);
        old.tensors[1].data = TensorData::F32(vec![0.0; 3]);
        old.tensors[1].shape = vec![3];
        old.tensors[2].name = "renamed".into();
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
    fn control_round_trips() {
        for m in [
            ControlMessage::PeriodStart {
                period: PeriodId(4),
                version: PolicyVersion(4),
                prompts: vec![PromptId(1), PromptId(9)],
            },
            ControlMessage::PeriodEnd { period: PeriodId(4) },
            ControlMessage::Shutdown,
        ] {
            assert_eq!(decode_control(&encode_control(&m).unwrap()).unwrap(), m);
        }
    }

    #[test]
    fn a_broken_group_is_refused_by_the_writer() {
        let mut g = scored_group(0, 1, 2, 3);
        g.group.completions[1].logprobs.pop();
        assert!(matches!(encode_group(&g), Err(Error::Malformed { .. })));
        let mut g = scored_group(0, 1, 2, 3);
        g.advantages.pop();
        assert!(matches!(encode_group(&g), Err(Error::Malformed { .. })));
    }

    #[test]
    fn a_shape_that_does_not_match_the_data_is_refused() {
        let mut s = snapshot(1, 10);
        s.tensors[0].shape.push(3);
        assert!(matches!(encode_weights(&s), Err(Error::Malformed { .. })));
    }
}
