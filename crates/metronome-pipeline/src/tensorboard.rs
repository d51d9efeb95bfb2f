//! TensorBoard event files in the run directory, so that `tensorboard --logdir runs/`
//! charts every run: one scalar per measure and period, beside `metrics.jsonl`.
//!
//! The format is TensorBoard's own, as its `EventFileWriter` writes it: a file named
//! `events.out.tfevents.<seconds>.<host>` holding TFRecords (a little-endian u64
//! length, the masked CRC-32C of those 8 bytes, the record, the masked CRC-32C of
//! the record), each an `Event` protocol buffer (`tensorflow/core/util/event.proto`):
//! first one naming the file version, then one per period whose `Summary` holds a
//! `simple_value` per tag. Only those fields are written; the messages are declared
//! here with `prost` rather than generated from the whole schema.
//! `tests/data/read_tfevents.py` reads a run's file back with TensorBoard's reader.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use prost::Message;

use crate::error::{Error, Result};
use crate::report::{EvalPoint, PeriodReport};

/// `tensorflow.Event`, the fields Metronome writes.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

/// `tensorflow.Summary.Value` with its `simple_value`.
#[derive(Clone, PartialEq, prost::Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    /// A member of a oneof in the schema: written even when it is 0 (a plain proto3
    /// field would be left out, and TensorBoard would then see no value at all).
    #[prost(oneof = "Kind", tags = "2")]
    value: Option<Kind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Kind {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
}

/// The prefix TensorBoard looks for in a log directory.
pub const EVENTS_PREFIX: &str = "events.out.tfevents.";

/// Appends scalars to one event file.
#[derive(Debug)]
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl EventWriter {
    /// A new event file in `dir` (a resumed run starts another; TensorBoard reads
    /// them all, the later file's values winning for a step written twice).
    pub fn create(dir: &Path) -> Result<Self> {
        let wall = now();
        let mut name = format!("{EVENTS_PREFIX}{}.metronome", wall as u64);
        // Two writers within a second (a quick resume) must not share a file.
        let mut n = 1;
        while dir.join(&name).exists() {
            name = format!("{EVENTS_PREFIX}{}.metronome.{n}", wall as u64);
            n += 1;
        }
        let path = dir.join(name);
        let file = File::create(&path).map_err(io_error(&path))?;
        let mut writer = Self { file, path };
        writer.write(&Event {
            wall_time: wall,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(writer)
    }

    /// The file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `scalars` (tag, value) at `step`; non-finite values are written as they
    /// are (TensorBoard shows them as gaps).
    pub fn scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> Result<()> {
        let value = scalars
            .iter()
            .map(|&(tag, v)| Value { tag: tag.to_owned(), value: Some(Kind::SimpleValue(v as f32)) })
            .collect();
        let step = i64::try_from(step).unwrap_or(i64::MAX);
        self.write(&Event { wall_time: now(), step, what: Some(What::Summary(Summary { value })) })
    }

    fn write(&mut self, event: &Event) -> Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        // One write per record, flushed, so a reader following the file (or a crash)
        // sees whole records.
        self.file.write_all(&record).map_err(io_error(&self.path))?;
        self.file.flush().map_err(io_error(&self.path))
    }
}

/// TFRecord's checksum: CRC-32C, rotated and offset so that a CRC of data holding
/// CRCs is not trivially related to them.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One scalar read back: (step, tag, value).
pub type Scalar = (u64, String, f32);

/// Reads the scalars of an event file, checking every record's checksums; an error
/// names the file and the byte offset at fault. A record cut short by a crash at the
/// end of the file is ignored.
pub fn read_scalars(path: &Path) -> Result<Vec<Scalar>> {
    let mut bytes = Vec::new();
    File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(io_error(path))?;
    let bad = |at: usize, what: &str| Error::Io {
        path: path.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidData, format!("record at byte {at}: {what}")),
    };
    let mut scalars = Vec::new();
    let mut at = 0;
    while at + 12 <= bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes"));
        if masked_crc(len_bytes) != crc {
            return Err(bad(at, "its length fails its checksum"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        let Some(end) = usize::try_from(len).ok().and_then(|l| (at + 12).checked_add(l)) else {
            return Err(bad(at, "its length does not fit this machine"));
        };
        if end + 4 > bytes.len() {
            break; // cut short at the end of the file
        }
        let data = &bytes[at + 12..end];
        let crc = u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes"));
        if masked_crc(data) != crc {
            return Err(bad(at, "its data fails its checksum"));
        }
        let event = Event::decode(data).map_err(|e| bad(at, &format!("not an event: {e}")))?;
        if let Some(What::Summary(summary)) = event.what {
            let step = u64::try_from(event.step).unwrap_or(0);
            scalars.extend(summary.value.into_iter().filter_map(|v| match v.value {
                Some(Kind::SimpleValue(x)) => Some((step, v.tag, x)),
                None => None,
            }));
        }
        at = end + 4;
    }
    Ok(scalars)
}

/// The scalars of one period, tagged by group (`reward/…`, `loss/…`, …).
pub(crate) fn period_scalars(report: &PeriodReport) -> Vec<(&'static str, f64)> {
    let step = &report.step;
    let per_s = |tokens: f64, seconds: f64| if seconds > 0.0 { tokens / seconds } else { 0.0 };
    let mut scalars = vec![
        ("reward/mean", report.reward_mean),
        ("loss/total", step.loss),
        ("loss/policy", step.policy_loss),
        ("loss/kl", step.kl),
        ("loss/entropy", step.entropy),
        ("loss/clip_fraction", step.clip_fraction),
        ("loss/grad_norm", step.grad_norm),
        ("loss/learning_rate", step.learning_rate),
        ("loss/logprob_gap", step.logprob_gap),
        ("throughput/generation_tokens_per_s", per_s(report.generated_tokens as f64, report.generation_s)),
        ("throughput/training_tokens_per_s", per_s(step.tokens as f64, report.training_s)),
        ("time/period_s", report.period_s),
        ("time/generation_busy_s", report.generation_s),
        ("time/training_busy_s", report.training_s),
        ("time/publication_s", report.publication_s),
        ("time/overlap_efficiency", report.overlap_efficiency()),
        ("groups/trained", report.groups as f64),
        ("groups/rejected", report.rejected as f64),
        ("groups/filtered", report.filtered as f64),
        ("groups/dropped_stale", report.dropped_stale as f64),
        ("groups/duplicates", report.duplicates as f64),
        ("groups/zero_advantage", step.zero_advantage_groups as f64),
    ];
    if let Some(a) = report.accuracy {
        scalars.push(("reward/accuracy", a));
    }
    let mismatch = &step.mismatch;
    scalars.extend([
        ("mismatch/abs_mean", mismatch.mean_abs),
        ("mismatch/abs_p99", mismatch.p99_abs),
        ("mismatch/abs_max", mismatch.max_abs),
        ("mismatch/kl_k3", mismatch.kl_k3),
        ("mismatch/is_truncated_share", mismatch.truncated_share),
        ("mismatch/is_masked_share", mismatch.masked_share),
    ]);
    if let Some(kl) = step.distill_kl {
        scalars.push(("distill/reverse_kl", kl));
    }
    scalars
}

/// The scalars of one held-out evaluation.
pub(crate) fn eval_scalars(point: &EvalPoint) -> Vec<(&'static str, f64)> {
    let mut scalars = vec![("eval/heldout_accuracy", point.accuracy)];
    scalars.extend(point.tool_use.map(|t| ("eval/tool_use", t)));
    scalars
}

/// Held-out accuracy by the periods trained before it, from the run's event files
/// (a resumed run's later file wins for a period evaluated twice).
pub fn heldout_accuracy(dir: &Path) -> Result<Vec<(u64, f64)>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| Error::Io { path: dir.to_owned(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(EVENTS_PREFIX)))
        .collect();
    // Named by creation time in seconds, then a counter: name order is write order.
    files.sort();
    let mut evals = BTreeMap::new();
    for file in files {
        for (step, tag, value) in read_scalars(&file)? {
            if tag == "eval/heldout_accuracy" {
                evals.insert(step, f64::from(value));
            }
        }
    }
    Ok(evals.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_read_back_and_a_damaged_record_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(1, &[("reward/mean", 0.25), ("loss/total", -1.5)]).unwrap();
        w.scalars(2, &[("reward/mean", f64::NAN), ("loss/total", 0.0)]).unwrap();
        let got = read_scalars(w.path()).unwrap();
        assert_eq!(got.len(), 4, "a zero is written too");
        assert_eq!(got[0], (1, "reward/mean".to_owned(), 0.25));
        assert_eq!(got[1], (1, "loss/total".to_owned(), -1.5));
        assert!(got[2].2.is_nan());
        assert_eq!(got[3], (2, "loss/total".to_owned(), 0.0));
        // A second writer in the same second gets its own file.
        let second = EventWriter::create(dir.path()).unwrap();
        assert_ne!(second.path(), w.path());

        let mut bytes = std::fs::read(w.path()).unwrap();
        let n = bytes.len();
        // Cut short: the whole records before the cut are read.
        std::fs::write(w.path(), &bytes[..n - 3]).unwrap();
        assert_eq!(read_scalars(w.path()).unwrap().len(), 2);
        bytes.truncate(n);
        // A flipped bit in the last record's data fails its checksum, naming the offset.
        bytes[n - 6] ^= 1;
        std::fs::write(w.path(), &bytes).unwrap();
        let e = read_scalars(w.path()).unwrap_err();
        let e = metronome_core::ErrorChain(&e).to_string();
        assert!(e.contains("fails its checksum") && e.contains("tfevents"), "{e}");
    }
}
