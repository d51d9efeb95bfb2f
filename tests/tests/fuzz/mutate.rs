//! The mutations every target draws from: changes to a document's tree (a value
//! replaced by an extreme, removed, duplicated, grown or nested), to its lines, and
//! to its bytes. Trees are `serde_json::Value`s; a TOML document goes through the
//! same tree and back. An extreme a tree cannot hold (an integer past 2^64, a raw
//! `nan`, a key twice, nesting 100,000 deep) is a placeholder string in the tree,
//! replaced by its text once the tree is written out.

use proptest::prelude::*;
use proptest::sample::select;
use serde_json::Value;

/// The text format a tree is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Json,
    Toml,
}

/// A value at an edge of what a reader may expect.
#[derive(Clone, Debug)]
pub(crate) enum Extreme {
    Int(i128),
    Float(f64),
    Text(String),
    /// A string of this many bytes.
    Long(usize),
    Bool(bool),
    Null,
    /// A list of this many zeros.
    List(usize),
    EmptyTable,
    /// An empty list nested this deep.
    Nest(usize),
}

const INTS: &[i128] = &[
    0,
    1,
    -1,
    2,
    255,
    256,
    65_535,
    65_536,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 53,
    (1 << 53) + 1,
    i64::MAX as i128,
    i64::MIN as i128,
    1 << 63,
    u64::MAX as i128,
    1 << 64,
    -(1 << 64),
    1_000_000_000_000_000_000_000_000_000_000,
];

const FLOATS: &[f64] = &[
    0.0,
    -0.0,
    1e30,
    -1e30,
    1e-30,
    1e-45,
    5e-324,
    1e308,
    -1e308,
    f64::MAX,
    f64::MIN_POSITIVE,
    f64::NAN,
    f64::INFINITY,
    f64::NEG_INFINITY,
    0.5,
    1.5,
    -0.5,
    2.0,
    100.0,
];

/// Text a field may be given: numbers as strings, paths that are not files, control
/// characters, template syntax, what looks like another type.
const TEXTS: &[&str] = &[
    "",
    " ",
    "NaN",
    "nan",
    "inf",
    "-inf",
    "Infinity",
    "-1",
    "1e30",
    "18446744073709551616",
    "0x10",
    "true",
    "null",
    "{}",
    "[]",
    "/dev/zero",
    "/dev/null",
    "/proc/self/mem",
    "/",
    ".",
    "..",
    "../../../../etc/passwd",
    "\0",
    "\u{7f}\u{1b}[2J",
    "é",
    "\u{202e}",
    "🦀",
    "\n",
    "{{ x }}",
    "{prompt}",
    "{text}",
    "{% for %}",
    "${HOME}",
    "a.b.c",
    "kind",
    "tiny",
    "local",
    "nats",
    "openai",
    "sync",
    "periodic",
    "stale:0",
    "stale:18446744073709551616",
    "application/json",
    "user",
    "assistant",
];

pub(crate) fn extreme() -> impl Strategy<Value = Extreme> {
    prop_oneof![
        4 => select(INTS).prop_map(Extreme::Int),
        1 => any::<i64>().prop_map(|i| Extreme::Int(i.into())),
        3 => select(FLOATS).prop_map(Extreme::Float),
        1 => any::<f64>().prop_map(Extreme::Float),
        3 => select(TEXTS).prop_map(|t| Extreme::Text(t.to_owned())),
        1 => "\\PC{0,12}".prop_map(Extreme::Text),
        1 => select(&[300usize, 5_000, 70_000, 1 << 20][..]).prop_map(Extreme::Long),
        1 => any::<bool>().prop_map(Extreme::Bool),
        1 => Just(Extreme::Null),
        1 => select(&[0usize, 2, 1_000, 100_000][..]).prop_map(Extreme::List),
        1 => Just(Extreme::EmptyTable),
        1 => select(&[2usize, 64, 127, 128, 129, 1_000, 100_000][..]).prop_map(Extreme::Nest),
    ]
}

impl Extreme {
    /// The value as text of `format` (not always valid there: a JSON `NaN`, a TOML
    /// `null` and integers past 64 bits are written anyway, for the reader to refuse).
    pub(crate) fn render(&self, format: Format) -> String {
        match self {
            Self::Int(i) => i.to_string(),
            Self::Float(f) => float_text(*f, format),
            Self::Text(t) => quote(t, format),
            Self::Long(n) => quote(&"a".repeat(*n), format),
            Self::Bool(b) => b.to_string(),
            Self::Null => "null".to_owned(),
            Self::List(n) => format!("[{}]", vec!["0"; *n].join(",")),
            Self::EmptyTable => "{}".to_owned(),
            Self::Nest(d) => format!("{}{}", "[".repeat(*d), "]".repeat(*d)),
        }
    }
}

fn float_text(f: f64, format: Format) -> String {
    match (f, format) {
        (f, Format::Json) if f.is_nan() => "NaN".to_owned(),
        (f, Format::Toml) if f.is_nan() => "nan".to_owned(),
        (f, Format::Json) if f.is_infinite() => if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned(),
        (f, Format::Toml) if f.is_infinite() => if f > 0.0 { "inf" } else { "-inf" }.to_owned(),
        // Exponent form is a float in both formats (`1e30`, `-0e0`).
        (f, _) => format!("{f:e}"),
    }
}

/// A string literal of `format`.
pub(crate) fn quote(s: &str, format: Format) -> String {
    match format {
        Format::Json => serde_json::to_string(s).expect("a string serialises"),
        Format::Toml => toml::Value::String(s.to_owned()).to_string(),
    }
}

/// The largest input a tree change makes: what a reader does with a few megabytes
/// shows what it would do with more, and the binary's memory check is per input.
pub(crate) const MAX_INPUT: usize = 8 << 20;

/// One change to a tree, at the node numbered `node` in pre-order (modulo the
/// number of nodes).
#[derive(Clone, Debug)]
pub(crate) enum TreeOp {
    Replace {
        node: usize,
        with: Extreme,
    },
    Remove {
        node: usize,
    },
    /// A key added to the nearest table at or above the node.
    AddKey {
        node: usize,
        key: String,
        with: Extreme,
    },
    /// The node's key written a second time in its table, with this value.
    DuplicateKey {
        node: usize,
        with: Option<Extreme>,
    },
    /// A list's last element repeated.
    Grow {
        node: usize,
        times: usize,
    },
    /// The node put inside `depth` lists.
    Wrap {
        node: usize,
        depth: usize,
    },
}

pub(crate) fn tree_op() -> impl Strategy<Value = TreeOp> {
    let node = any::<usize>();
    let key = prop_oneof![
        select(&["unknown", "kind", "", " ", "a.b", "é", "prompt", "model", "n", "version"][..])
            .prop_map(str::to_owned),
        "[a-z_]{1,12}",
    ];
    prop_oneof![
        8 => (node, extreme()).prop_map(|(node, with)| TreeOp::Replace { node, with }),
        2 => node.prop_map(|node| TreeOp::Remove { node }),
        1 => (node, key, extreme()).prop_map(|(node, key, with)| TreeOp::AddKey { node, key, with }),
        1 => (node, proptest::option::of(extreme()))
            .prop_map(|(node, with)| TreeOp::DuplicateKey { node, with }),
        1 => (node, select(&[1usize, 10, 1_000][..])).prop_map(|(node, times)| TreeOp::Grow { node, times }),
        1 => (node, select(&[1usize, 3, 200][..])).prop_map(|(node, depth)| TreeOp::Wrap { node, depth }),
    ]
}

/// One change to the lines of a text.
#[derive(Clone, Debug)]
pub(crate) enum LineOp {
    Duplicate { at: usize },
    Remove { at: usize },
    Swap { a: usize, b: usize },
    Insert { at: usize, text: String },
}

pub(crate) fn line_op() -> impl Strategy<Value = LineOp> {
    let at = any::<usize>();
    prop_oneof![
        2 => at.prop_map(|at| LineOp::Duplicate { at }),
        1 => at.prop_map(|at| LineOp::Remove { at }),
        1 => (at, any::<usize>()).prop_map(|(a, b)| LineOp::Swap { a, b }),
        1 => (at, select(&["[run]", "[[x]]", "x = 1", "\"", "{", "}", ",", "\r", "\u{feff}"][..]))
            .prop_map(|(at, t)| LineOp::Insert { at, text: t.to_owned() }),
    ]
}

/// One change to bytes; positions are taken modulo the length.
#[derive(Clone, Debug)]
pub(crate) enum ByteOp {
    Flip {
        at: usize,
        mask: u8,
    },
    Set {
        at: usize,
        value: u8,
    },
    Cut {
        at: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Remove {
        at: usize,
        len: usize,
    },
    /// `len` bytes from `from` written over `to`.
    Splice {
        from: usize,
        to: usize,
        len: usize,
    },
    /// `len` bytes at `at` repeated `times` times in place.
    Repeat {
        at: usize,
        len: usize,
        times: usize,
    },
}

/// Byte positions: mostly anywhere, often within the first 64 bytes (headers,
/// lengths and magics live there).
fn position() -> impl Strategy<Value = usize> + Clone {
    prop_oneof![2 => any::<usize>(), 1 => 0..64usize]
}

fn interesting_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        select(&[0u8, 0xff, 0x7f, 0x80, 0x01, b'9', b'-', b'"', b'{', b'[', b',', b'\n', b'\\', b'e'][..]),
        any::<u8>(),
    ]
}

pub(crate) fn byte_op() -> impl Strategy<Value = ByteOp> {
    prop_oneof![
        3 => (position(), 1..=255u8).prop_map(|(at, mask)| ByteOp::Flip { at, mask }),
        3 => (position(), interesting_byte()).prop_map(|(at, value)| ByteOp::Set { at, value }),
        2 => position().prop_map(|at| ByteOp::Cut { at }),
        1 => (position(), proptest::collection::vec(interesting_byte(), 1..8))
            .prop_map(|(at, bytes)| ByteOp::Insert { at, bytes }),
        1 => (position(), 1..64usize).prop_map(|(at, len)| ByteOp::Remove { at, len }),
        1 => (position(), position(), 1..64usize).prop_map(|(from, to, len)| ByteOp::Splice { from, to, len }),
        1 => (position(), 1..16usize, 2..64usize).prop_map(|(at, len, times)| ByteOp::Repeat { at, len, times }),
    ]
}

/// Applies byte changes in order.
pub(crate) fn apply_bytes(bytes: &mut Vec<u8>, ops: &[ByteOp]) {
    for op in ops {
        let n = bytes.len();
        let pos = |at: usize| if n == 0 { 0 } else { at % n };
        match op {
            ByteOp::Flip { at, mask } if n > 0 => bytes[pos(*at)] ^= mask,
            ByteOp::Set { at, value } if n > 0 => bytes[pos(*at)] = *value,
            ByteOp::Cut { at } => bytes.truncate(at % (n + 1)),
            ByteOp::Insert { at, bytes: new } => {
                let at = at % (n + 1);
                bytes.splice(at..at, new.iter().copied());
            }
            ByteOp::Remove { at, len } => {
                let at = at % (n + 1);
                bytes.drain(at..(at + len).min(n));
            }
            ByteOp::Splice { from, to, len } if n > 0 => {
                let from = pos(*from);
                let chunk: Vec<u8> = bytes[from..(from + len).min(n)].to_vec();
                let to = pos(*to);
                let end = (to + chunk.len()).min(n);
                bytes[to..end].copy_from_slice(&chunk[..end - to]);
            }
            ByteOp::Repeat { at, len, times } if n > 0 => {
                let at = pos(*at);
                let chunk: Vec<u8> = bytes[at..(at + len).min(n)].to_vec();
                let repeated: Vec<u8> =
                    chunk.iter().copied().cycle().take(chunk.len() * (times - 1)).collect();
                bytes.splice(at..at, repeated);
            }
            _ => {}
        }
    }
}

/// Applies line changes in order (lines end at `\n`).
pub(crate) fn apply_lines(text: &str, ops: &[LineOp]) -> String {
    let mut lines: Vec<String> = text.split('\n').map(str::to_owned).collect();
    for op in ops {
        let n = lines.len();
        match op {
            LineOp::Duplicate { at } => {
                let line = lines[at % n].clone();
                lines.insert(at % n, line);
            }
            LineOp::Remove { at } if n > 1 => {
                lines.remove(at % n);
            }
            LineOp::Swap { a, b } => lines.swap(a % n, b % n),
            LineOp::Insert { at, text } => lines.insert(at % (n + 1), text.clone()),
            LineOp::Remove { .. } => {}
        }
    }
    lines.join("\n")
}

/// Every change one input gets: to its tree, then its lines, then its bytes.
#[derive(Clone, Debug)]
pub(crate) struct Mutations {
    pub(crate) tree: Vec<TreeOp>,
    pub(crate) lines: Vec<LineOp>,
    pub(crate) bytes: Vec<ByteOp>,
}

/// Mostly one to three tree changes (which keep the syntax, so the input reaches the
/// reader's checks of values); sometimes line and byte changes (which test its
/// parser and the messages of its syntax errors).
pub(crate) fn mutations() -> impl Strategy<Value = Mutations> {
    let some = |n| proptest::collection::vec(tree_op(), 1..n);
    (
        prop_oneof![1 => Just(Vec::new()), 6 => some(4)],
        prop_oneof![6 => Just(Vec::new()), 1 => proptest::collection::vec(line_op(), 1..3)],
        prop_oneof![5 => Just(Vec::new()), 1 => proptest::collection::vec(byte_op(), 1..4)],
    )
        .prop_map(|(tree, lines, bytes)| Mutations { tree, lines, bytes })
}

/// A path to a node: keys of tables, indexes of lists.
#[derive(Clone, Debug)]
enum Seg {
    Key(String),
    Index(usize),
}

fn paths(v: &Value, here: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    out.push(here.clone());
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                here.push(Seg::Key(k.clone()));
                paths(child, here, out);
                here.pop();
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                here.push(Seg::Index(i));
                paths(child, here, out);
                here.pop();
            }
        }
        _ => {}
    }
}

fn node_mut<'a>(mut v: &'a mut Value, path: &[Seg]) -> Option<&'a mut Value> {
    for seg in path {
        v = match (seg, v) {
            (Seg::Key(k), Value::Object(m)) => m.get_mut(k)?,
            (Seg::Index(i), Value::Array(a)) => a.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(v)
}

/// A tree being mutated, with the texts its placeholders stand for.
struct Placeholders {
    format: Format,
    raw: Vec<String>,
}

impl Placeholders {
    fn add(&mut self, text: String) -> String {
        self.raw.push(text);
        format!("@@{}@@", self.raw.len() - 1)
    }

    /// A value's text in this format (a list or table inline).
    fn text_of(&self, v: &Value) -> String {
        match self.format {
            Format::Json => serde_json::to_string(v).unwrap_or_default(),
            Format::Toml => toml::Value::try_from(v).map(|t| t.to_string()).unwrap_or_else(|_| "0".into()),
        }
    }

    /// Replaces every quoted placeholder in `text` by what it stands for. A long text
    /// copied many times (a list of a megabyte string grown a thousand times) would
    /// make an input of a gigabyte, which measures the generator, not the reader:
    /// beyond [`MAX_INPUT`] the placeholders stay as they are.
    fn fill(&self, mut text: String) -> String {
        let placeholder = |i: usize| format!("\"@@{i}@@\"");
        let size: usize = text.len()
            + self
                .raw
                .iter()
                .enumerate()
                .map(|(i, raw)| text.matches(&placeholder(i)).count() * raw.len())
                .sum::<usize>();
        if size > MAX_INPUT {
            return text;
        }
        // Last first: a wrapping placeholder's text holds the earlier ones it wraps.
        for (i, raw) in self.raw.iter().enumerate().rev() {
            text = text.replace(&placeholder(i), raw);
        }
        text
    }
}

fn apply_tree(root: &mut Value, ops: &[TreeOp], ph: &mut Placeholders) {
    for op in ops {
        let mut all = Vec::new();
        paths(root, &mut Vec::new(), &mut all);
        let pick = |node: usize| all[node % all.len()].clone();
        match op {
            TreeOp::Replace { node, with } => {
                let path = pick(*node);
                let text = ph.add(with.render(ph.format));
                if let Some(v) = node_mut(root, &path) {
                    *v = Value::String(text);
                }
            }
            TreeOp::Remove { node } => {
                let path = pick(*node);
                if let Some((last, parent)) = path.split_last()
                    && let Some(p) = node_mut(root, parent)
                {
                    match (last, p) {
                        (Seg::Key(k), Value::Object(m)) => {
                            m.remove(k);
                        }
                        (Seg::Index(i), Value::Array(a)) if *i < a.len() => {
                            a.remove(*i);
                        }
                        _ => {}
                    }
                }
            }
            TreeOp::AddKey { node, key, with } => {
                let mut path = pick(*node);
                let text = ph.add(with.render(ph.format));
                loop {
                    if let Some(Value::Object(m)) = node_mut(root, &path) {
                        m.insert(key.clone(), Value::String(text));
                        break;
                    }
                    if path.pop().is_none() {
                        break;
                    }
                }
            }
            TreeOp::DuplicateKey { node, with } => {
                let path = pick(*node);
                if let Some((Seg::Key(k), parent)) = path.split_last() {
                    let value = match with {
                        Some(e) => Value::String(ph.add(e.render(ph.format))),
                        None => node_mut(root, &path).cloned().unwrap_or(Value::Bool(true)),
                    };
                    let key = ph.add(quote(k, ph.format));
                    if let Some(Value::Object(m)) = node_mut(root, parent) {
                        m.insert(key, value);
                    }
                }
            }
            TreeOp::Grow { node, times } => {
                let path = pick(*node);
                if let Some(Value::Array(a)) = node_mut(root, &path)
                    && let Some(last) = a.last().cloned()
                {
                    a.extend(std::iter::repeat_n(last, *times));
                }
            }
            TreeOp::Wrap { node, depth } => {
                let path = pick(*node);
                if let Some(v) = node_mut(root, &path) {
                    let inner = ph.text_of(v);
                    let text = format!("{}{inner}{}", "[".repeat(*depth), "]".repeat(*depth));
                    *v = Value::String(ph.add(text));
                }
            }
        }
    }
}

/// `seed` mutated, as JSON bytes (`pretty` writes one field per line, so that line
/// changes act on fields).
pub(crate) fn mutate_json(seed: &Value, m: &Mutations, pretty: bool) -> Vec<u8> {
    let mut tree = seed.clone();
    let mut ph = Placeholders { format: Format::Json, raw: Vec::new() };
    apply_tree(&mut tree, &m.tree, &mut ph);
    let text = if pretty { serde_json::to_string_pretty(&tree) } else { serde_json::to_string(&tree) }
        .expect("a JSON tree serialises");
    let text = apply_lines(&ph.fill(text), &m.lines);
    let mut bytes = text.into_bytes();
    apply_bytes(&mut bytes, &m.bytes);
    bytes
}

/// The TOML document `seed` mutated (the seed itself when the mutated tree has no
/// TOML form), as text: byte changes that break UTF-8 are read lossily, as a
/// reader of `&str` would never see them.
pub(crate) fn mutate_toml(seed: &str, m: &Mutations) -> String {
    let table: toml::Table = seed.parse().expect("the seed is valid TOML");
    let mut tree = serde_json::to_value(&table).expect("TOML converts to a JSON tree");
    let mut ph = Placeholders { format: Format::Toml, raw: Vec::new() };
    apply_tree(&mut tree, &m.tree, &mut ph);
    let text = toml::to_string(&tree).map_or_else(|_| seed.to_owned(), |t| ph.fill(t));
    let text = apply_lines(&text, &m.lines);
    let mut bytes = text.into_bytes();
    apply_bytes(&mut bytes, &m.bytes);
    String::from_utf8_lossy(&bytes).into_owned()
}
