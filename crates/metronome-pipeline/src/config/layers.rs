//! A config document built from layers (the embedded default, files, `--set`
//! overrides), remembering which layer set each key so that every error names the
//! file, its line, or the `--set` the value at fault came from; credentials read from
//! the environment or files; TOML errors located.

use std::path::Path;

use super::PipelineConfig;
use crate::error::{Error, Result};

/// A config document built from layers, remembering which layer set each key, so
/// that an error names the file (or `--set`) the value at fault came from.
#[derive(Default)]
pub(super) struct Layers {
    doc: toml::Table,
    /// Dotted key (of a value, or of a table a layer replaced whole) -> its layer.
    origins: std::collections::BTreeMap<String, String>,
    /// The layers in the order they were laid, `--set`s last.
    order: Vec<String>,
}

impl Layers {
    /// Parses `text` and lays it over what is there.
    pub(super) fn add(&mut self, origin: &str, text: &str) -> Result<()> {
        let layer: toml::Table = text.parse().map_err(|e: toml::de::Error| Error::Config {
            key: origin.to_owned(),
            reason: format!("is not valid TOML: {}", toml_error_at(text, &e)),
        })?;
        merge("", &mut self.doc, layer, origin, &mut self.origins);
        self.order.push(origin.to_owned());
        Ok(())
    }

    /// Applies the overrides, reads the credentials, and deserialises and validates.
    pub(super) fn build(mut self, overrides: &[String]) -> Result<PipelineConfig> {
        for o in overrides {
            let key = apply_override(&mut self.doc, o)?;
            let origin = format!("--set {o}");
            set_origin(&mut self.origins, key, origin.clone());
            self.order.push(origin);
        }
        let Self { mut doc, origins, order } = self;
        // A value out of range names its key; say which layer set it too.
        let annotate = |e: Error| match e {
            Error::Config { key, reason } => {
                let reason = match origins_of(&origins, &order, &key, &reason) {
                    Some(origin) if !reason.contains("(in ") => format!("{reason} (in {origin})"),
                    _ => reason,
                };
                Error::Config { key, reason }
            }
            e => e,
        };
        resolve_secrets("", &mut doc).map_err(annotate)?;
        let config: PipelineConfig =
            serde_path_to_error::deserialize(toml::Value::Table(doc)).map_err(|e| {
                let path = e.path().to_string();
                let key = if path.is_empty() || path == "." { None } else { Some(path) };
                let message = e.inner().message();
                let origin = key.as_deref().and_then(|k| origins_of(&origins, &order, k, message));
                let origin = origin.or_else(|| order.first().cloned()).unwrap_or_default();
                Error::Config {
                    key: key.unwrap_or_else(|| origin.clone()),
                    reason: format!("{message} (in {origin})"),
                }
            })?;
        config.validate().map_err(annotate)?;
        Ok(config)
    }
}

/// Where a TOML parse error is: its line and column, the dotted key when the error
/// is at one (a duplicate key is named with its table, `run.periods`), and the
/// message. `toml`'s own message names neither for some errors (`duplicate key`,
/// an integer out of range).
fn toml_error_at(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        // The parser gives no position for some errors (nesting too deep, in lists or
        // in dotted keys): the place is the first line that brings the error about.
        let message = e.message().trim_end();
        return match line_of_spanless(text, e.message()) {
            Some(line) => {
                let source_line = text.lines().nth(line - 1).unwrap_or("").trim();
                let shown: String = source_line.chars().take(80).collect();
                let more = if shown.len() < source_line.len() { "..." } else { "" };
                format!("line {line}: {message} (`{shown}{more}`)")
            }
            None => message.to_owned(),
        };
    };
    let start = span.start.min(text.len());
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    // The table the error's line is in: the last `[header]` above it.
    let table = before
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|h| h.trim_matches(|c| c == '[' || c == ']').trim().to_owned());
    let source_line = text.lines().nth(line - 1).unwrap_or("").trim();
    let at = text.get(span.clone()).unwrap_or("").trim();
    // A key (not a value) at the span: name it with its table.
    let key = (!at.is_empty()
        && source_line.starts_with(at)
        && source_line[at.len()..].trim_start().starts_with('='))
    .then(|| table.as_ref().map_or_else(|| at.to_owned(), |t| format!("{t}.{at}")));
    let message = e.message().trim_end();
    match key {
        Some(key) => format!("line {line}, column {column}, key `{key}`: {message} (`{source_line}`)"),
        None => format!("line {line}, column {column}: {message} (`{source_line}`)"),
    }
}

/// The first line (from 1) such that the text up to and including it fails with
/// `message` and no position, found by bisection (a few parses of prefixes).
fn line_of_spanless(text: &str, message: &str) -> Option<usize> {
    let ends: Vec<usize> = text.match_indices('\n').map(|(i, _)| i).chain([text.len()]).collect();
    let fails = |k: usize| {
        text[..ends[k]]
            .parse::<toml::Table>()
            .err()
            .is_some_and(|e| e.span().is_none() && e.message() == message)
    };
    let (mut lo, mut hi) = (0, ends.len() - 1);
    if !fails(hi) {
        return None;
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fails(mid) { hi = mid } else { lo = mid + 1 }
    }
    Some(lo + 1)
}

/// The layers that gave the values an error at `key` (saying `reason`) is about,
/// the latest first: the layer that set `key` or the table above it, every layer
/// that set a value under it (an error in a table, such as one chosen by its
/// `kind`, may be in any of them), and those of the other keys the reason names (a
/// limit on a combination of values). Without this, a `--set` inside a table the
/// default set whole was blamed on the default.
fn origins_of(
    origins: &std::collections::BTreeMap<String, String>,
    order: &[String],
    key: &str,
    reason: &str,
) -> Option<String> {
    let (dot, bracket) = (format!("{key}."), format!("{key}["));
    let mut found: Vec<&str> = origins
        .iter()
        .filter(|(k, _)| k.starts_with(&dot) || k.starts_with(&bracket))
        .map(|(_, origin)| origin.as_str())
        .collect();
    let named = reason
        .split(|c: char| !(c.is_ascii_alphanumeric() || "_.[]".contains(c)))
        .map(|word| word.trim_end_matches('.'))
        .filter(|word| word.contains('.') && *word != key);
    let mut keys = vec![key];
    keys.extend(named);
    for k in keys {
        if let Some(origin) = origins.get(k).map(String::as_str).or_else(|| {
            // The closest table above `k` that a layer set.
            let mut at = k;
            loop {
                at = &at[..at.rfind(['.', '['])?];
                if let Some(origin) = origins.get(at) {
                    return Some(origin.as_str());
                }
            }
        }) {
            found.push(origin);
        }
    }
    let position = |origin: &str| order.iter().rposition(|o| o == origin).unwrap_or(0);
    found.sort_by_key(|origin| std::cmp::Reverse(position(origin)));
    found.dedup();
    (!found.is_empty()).then(|| found.join(" and "))
}

/// Lays `layer` over `base`: tables merge key by key, anything else replaces. A table
/// whose `kind` differs from the base's (another scorer, model source, transport)
/// replaces the base's whole, so no key of the other kind is left behind.
fn merge(
    prefix: &str,
    base: &mut toml::Table,
    layer: toml::Table,
    origin: &str,
    origins: &mut std::collections::BTreeMap<String, String>,
) {
    for (k, v) in layer {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(old)), toml::Value::Table(new))
                if new.get("kind").is_none_or(|kind| old.get("kind") == Some(kind)) =>
            {
                merge(&key, old, new, origin, origins);
            }
            (_, v) => {
                set_origin(origins, key, origin.to_owned());
                base.insert(k, v);
            }
        }
    }
}

/// Records that `origin` set `key`, and so everything below it.
fn set_origin(origins: &mut std::collections::BTreeMap<String, String>, key: String, origin: String) {
    let (dot, bracket) = (format!("{key}."), format!("{key}["));
    origins.retain(|k, _| !(k == &key || k.starts_with(&dot) || k.starts_with(&bracket)));
    origins.insert(key, origin);
}

/// Keys whose values are credentials ([`metronome_core::Secret`]).
const SECRET_KEYS: &[&str] = &["password", "token", "api_key"];

/// Reads every credential given as `{ env = "VAR" }` or `{ file = "PATH" }` (at a key
/// named in [`SECRET_KEYS`]) into its value, so that configs and command lines need
/// not hold it; a file's trailing newline is dropped. Errors name the key and the
/// variable or file, never a value.
fn resolve_secrets(prefix: &str, table: &mut toml::Table) -> Result<()> {
    for (k, v) in table.iter_mut() {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        let toml::Value::Table(inner) = v else { continue };
        if !SECRET_KEYS.contains(&k.as_str()) {
            resolve_secrets(&key, inner)?;
            continue;
        }
        let bad = |reason: String| Error::Config { key: key.clone(), reason };
        let value = match (inner.len(), inner.get("env"), inner.get("file")) {
            (1, Some(toml::Value::String(var)), None) => std::env::var(var)
                .map_err(|_| bad(format!("names the environment variable {var}, which is not set")))?,
            (1, None, Some(toml::Value::String(path))) => read_secret_file(Path::new(path))
                .map_err(|e| bad(format!("names the file {path}, which cannot be read: {e}")))?,
            _ => return Err(bad("expected a string, { env = \"VAR\" } or { file = \"PATH\" }".into())),
        };
        *v = toml::Value::String(value);
    }
    Ok(())
}

/// The most bytes a config file may hold.
pub(super) const MAX_CONFIG_FILE_BYTES: u64 = 16 << 20;

/// The most bytes a credential file may hold: a key, a token or a password.
pub const MAX_SECRET_FILE_BYTES: u64 = 64 << 10;

/// Reads a credential file (`{ file = "PATH" }` in a config, `--api-key-file`): its
/// text without the trailing newline, refused beyond [`MAX_SECRET_FILE_BYTES`].
pub fn read_secret_file(path: &Path) -> std::io::Result<String> {
    Ok(read_text_file(path, MAX_SECRET_FILE_BYTES)?.trim_end_matches(['\r', '\n']).to_owned())
}

/// A UTF-8 file of at most `limit` bytes, read without trusting its size: a path
/// such as `/dev/zero` or a FIFO has none, and was read until memory ran out.
pub(super) fn read_text_file(path: &Path, limit: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("it holds more than {limit} bytes"),
        ));
    }
    String::from_utf8(bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Every leaf of `value` under its dotted key path.
pub(super) fn flatten(
    prefix: &str,
    value: &toml::Value,
    out: &mut std::collections::BTreeMap<String, String>,
) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        leaf => {
            out.insert(prefix.to_owned(), leaf.to_string());
        }
    }
}

/// Whether an override's value is meant as TOML rather than bare text: it starts
/// like a number (a digit, or a sign and a digit), an array, an inline table or
/// quoted text.
fn looks_like_toml(raw: &str) -> bool {
    let mut chars = raw.chars();
    match chars.next() {
        Some(c) if c.is_ascii_digit() || "[{\"'".contains(c) => true,
        Some('+' | '-') => chars.next().is_some_and(|c| c.is_ascii_digit() || c == '.'),
        _ => false,
    }
}

/// Applies `key.path=value` to the document, creating tables on the way; the key
/// path, trimmed.
fn apply_override(doc: &mut toml::Table, assignment: &str) -> Result<String> {
    // The assignment is the place; an empty one would name nothing (`invalid
    // configuration ``: ...`).
    let key =
        if assignment.trim().is_empty() { format!("--set {assignment:?}") } else { assignment.to_owned() };
    let bad = |reason: String| Error::Config { key: key.clone(), reason };
    let (path, raw) = assignment.split_once('=').ok_or_else(|| bad("expected `key.path=value`".into()))?;
    let keys: Vec<&str> = path.trim().split('.').collect();
    if keys.iter().any(|k| k.is_empty()) {
        return Err(bad("has an empty key".into()));
    }
    // Read the value as TOML (numbers, booleans, arrays, inline tables, quoted text),
    // else as bare text; but what starts like a number, an array, a table or quoted
    // text and does not parse is refused with TOML's reason (an integer out of range
    // must not become the string "99999999999999999999").
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(raw.to_owned())),
        Err(e) if looks_like_toml(raw) => {
            return Err(bad(format!("`{raw}` is not a valid value: {}", e.message().trim_end())));
        }
        Err(_) => toml::Value::String(raw.to_owned()),
    };
    let (last, parents) = keys.split_last().expect("split yields at least one key");
    let mut table = doc;
    for (i, key) in parents.iter().enumerate() {
        let entry = table.entry((*key).to_owned()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table =
            entry.as_table_mut().ok_or_else(|| bad(format!("`{}` is not a table", keys[..=i].join("."))))?;
    }
    table.insert((*last).to_owned(), value);
    Ok(keys.join("."))
}
