//! JSONL: one JSON value per line; the line loop that every JSONL format shares
//! ([`read_lines`]: the field-mapped rows here, the code tasks of `code.rs`).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use super::Collector;
use super::mapping::{FieldError, FieldMapping};
use crate::dataset::Record;
use crate::error::{Error, Location, Result};

/// Reads one file of field-mapped rows; returns how many record ids it used (bad
/// records included).
pub(super) fn read(path: &Path, fields: &FieldMapping, out: &mut Collector) -> Result<u64> {
    read_lines(path, out, |value| {
        let m = fields.apply(value)?;
        Ok(Record {
            id: Default::default(),
            content: m.content,
            reference: m.reference,
            metadata: m.metadata,
        })
    })
}

/// Reads one JSONL file, making each line's value a record with `parse` (its id is set
/// here, from the line's place among the records); returns how many record ids it used.
/// A blank line is skipped and uses no id; a line that is not UTF-8 or not JSON, or
/// whose value `parse` refuses, is a bad record at its line, and uses its id.
pub(super) fn read_lines(
    path: &Path,
    out: &mut Collector,
    mut parse: impl FnMut(&serde_json::Value) -> std::result::Result<Record, FieldError>,
) -> Result<u64> {
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
        let parsed = serde_json::from_str(line)
            .map_err(|e| FieldError::record(format!("malformed JSON: {e}")))
            .and_then(|value| parse(&value));
        match parsed {
            Ok(record) => out.keep(Record { id, ..record }, location),
            Err(e) => out.bad(bad(e))?,
        }
    }
}
