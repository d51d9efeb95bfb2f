//! JSONL: one JSON object per line.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use super::Collector;
use super::mapping::{FieldError, FieldMapping};
use crate::dataset::Record;
use crate::error::{Error, Location, Result};

/// Reads one file; returns how many record ids it used (bad records included).
pub(super) fn read(path: &Path, fields: &FieldMapping, out: &mut Collector) -> Result<u64> {
    let io = |source| Error::Io { path: path.to_owned(), source };
    let mut reader = BufReader::new(File::open(path).map_err(io)?);
    let mut buf = Vec::new();
    let mut line_no = 0u64;
    let mut record_index = 0u64;
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf).map_err(io)? == 0 {
            return Ok(record_index);
        }
        line_no += 1;
        let location = Location::Line(line_no);
        let bad = |e: FieldError| Error::BadRecord {
            path: path.to_owned(),
            location,
            field: e.field,
            reason: e.reason,
        };
        let Ok(line) = std::str::from_utf8(&buf) else {
            out.bad(bad(FieldError::record("is not valid UTF-8")))?;
            record_index += 1;
            continue;
        };
        if line.trim().is_empty() {
            continue;
        }
        let id = out.id(record_index);
        record_index += 1;
        let value: serde_json::Value = match serde_json::from_str(line) {
            Ok(value) => value,
            Err(e) => {
                out.bad(bad(FieldError::record(format!("malformed JSON: {e}"))))?;
                continue;
            }
        };
        match fields.apply(&value) {
            Ok(m) => out.keep(
                Record { id, content: m.content, reference: m.reference, metadata: m.metadata },
                location,
            ),
            Err(e) => out.bad(bad(e))?,
        }
    }
}
