//! A config document built from layers (the embedded default, files, `--set`
//! overrides), remembering which layer set each key so that every error names the
//! file, its line, or the `--set` the value at fault came from; credentials read from
//! the environment or files; TOML errors located.

use super::PipelineConfig;
use crate::error::{Error, Result};

/// A config document built from layers, remembering which layer set each key, so
/// that an error names the file (or `--set`) the value at fault came from.
#[derive(Default)]
pub(super) struct Layers {
    doc: toml::Table,
    /// Dotted key (of a value, or of a table a layer replaced whole) -> its layer.
    origins: std::collections::BTreeMap<String, String>,
}

impl Layers {
    /// Parses `text` and lays it over what is there.
    pub(super) fn add(&mut self, origin: &str, text: &str) -> Result<()> {
        let layer: toml::Table = text.parse().map_err(|e: toml::de::Error| Error::Config {
            key: origin.to_owned(),
            reason: format!("is not valid TOML: {}", toml_error_at(text, &e)),
        })?;
        merge("", &mut self.doc, layer, origin, &mut self.origins);
        Ok(())
    }

    /// Applies the overrides, reads the credentials, and deserialises and validates.
    pub(super) fn build(mut self, overrides: &[String]) -> Result<PipelineConfig> {
        for o in overrides {
            let key = apply_override(&mut self.doc, o)?;
            set_origin(&mut self.origins, key, format!("--set {o}"));
        }
        resolve_secrets("", &mut self.doc)?;
        let config: PipelineConfig =
            serde_path_to_error::deserialize(toml::Value::Table(self.doc)).map_err(|e| {
                let path = e.path().to_string();
                let key = if path.is_empty() || path == "." { None } else { Some(path) };
                let origin = key.as_deref().and_then(|k| origin_of(&self.origins, k));
                let origin = origin.or_else(|| self.origins.values().next().cloned()).unwrap_or_default();
                Error::Config {
                    key: key.unwrap_or_else(|| origin.clone()),
                    reason: format!("{} (in {origin})", e.inner().message()),
                }
            })?;
        // A value out of range names its key; say which layer set it too.
        config.validate().map_err(|e| match e {
            Error::Config { key, reason } => {
                let reason = match origin_of(&self.origins, &key) {
                    Some(origin) if !reason.contains("(in ") => format!("{reason} (in {origin})"),
                    _ => reason,
                };
                Error::Config { key, reason }
            }
            e => e,
        })?;
        Ok(config)
    }
}

/// Where a TOML parse error is: its line and column, the dotted key when the error
/// is at one (a duplicate key is named with its table, `run.periods`), and the
/// message. `toml`'s own message names neither for some errors (`duplicate key`,
/// an integer out of range).
fn toml_error_at(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else { return e.message().to_owned() };
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

/// The layer that set `key`, or the closest table above it that a layer set.
fn origin_of(origins: &std::collections::BTreeMap<String, String>, key: &str) -> Option<String> {
    let mut key = key;
    loop {
        if let Some(origin) = origins.get(key) {
            return Some(origin.clone());
        }
        key = &key[..key.rfind(['.', '['])?];
    }
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
            (1, None, Some(toml::Value::String(path))) => std::fs::read_to_string(path)
                .map_err(|e| bad(format!("names the file {path}, which cannot be read: {e}")))?
                .trim_end_matches(['\r', '\n'])
                .to_owned(),
            _ => return Err(bad("expected a string, { env = \"VAR\" } or { file = \"PATH\" }".into())),
        };
        *v = toml::Value::String(value);
    }
    Ok(())
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
    let bad = |reason: String| Error::Config { key: assignment.to_owned(), reason };
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
