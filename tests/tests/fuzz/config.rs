//! Config documents, layers and `--set` values: `PipelineConfig::parse`,
//! `load_layers` and `embedded`.
//!
//! Asserts: no panic; an error is `Error::Config` with a key (a key path, the file,
//! or the `--set`), and a TOML syntax error says its line; an error caused by a
//! `--set` on the default names the `--set`; a config that loads writes a
//! `config.toml` that a resume finds unchanged and that loads back to the same
//! config.

use std::sync::OnceLock;

use metronome_pipeline::{DEFAULT_CONFIG, Error, PipelineConfig, Secret};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use crate::mutate::{Extreme, Format, Mutations, extreme, mutations};

/// The documents inputs start from: the default and the deployment examples (whole
/// documents), and the presets (layers over the default); whether each is whole.
const SEEDS: &[(&str, bool)] = &[
    (DEFAULT_CONFIG, true),
    (include_str!("../../../deploy/cluster.toml"), true),
    (include_str!("../../../deploy/single-host.toml"), true),
    (include_str!("../../../crates/metronome-pipeline/configs/code.toml"), false),
    (include_str!("../../../crates/metronome-pipeline/configs/longtail_copy.toml"), false),
    (include_str!("../../../crates/metronome-pipeline/configs/countdown_feedback.toml"), false),
];

/// The seeds, their password read from a file instead of an environment variable
/// (which a test cannot set while other tests run).
fn seeds() -> &'static [(String, bool)] {
    static SEEDS_WITH_SECRET: OnceLock<Vec<(String, bool)>> = OnceLock::new();
    SEEDS_WITH_SECRET.get_or_init(|| {
        let dir = crate::scratch("config");
        let secret = dir.join("password");
        std::fs::write(&secret, "fuzz\n").unwrap();
        let file = format!("{{ file = {:?} }}", secret.display().to_string());
        SEEDS
            .iter()
            .map(|(text, whole)| (text.replace("{ env = \"METRONOME_NATS_PASSWORD\" }", &file), *whole))
            .collect()
    })
}

/// Keys named by a `--set`: mostly the default's own (so the value reaches its
/// check), the credential keys (whose `{ file = ... }` form reads a file), and
/// malformed paths.
#[derive(Clone, Debug)]
pub(crate) enum SetKey {
    Leaf(usize),
    Secret(&'static str),
    Raw(&'static str),
}

/// How the assignment is written.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Form {
    Plain,
    Spaced,
    NoEquals,
    DoubleEquals,
}

#[derive(Clone, Debug)]
pub(crate) enum SetValue {
    Extreme(Extreme),
    Text(String),
    Toml(&'static str),
}

#[derive(Clone, Debug)]
pub(crate) struct Set {
    key: SetKey,
    value: SetValue,
    form: Form,
}

#[derive(Clone, Debug)]
pub(crate) enum Input {
    /// A seed document mutated and read whole (`PipelineConfig::parse`).
    Document { seed: usize, m: Mutations },
    /// A seed document mutated and layered over the default from a file (`load_layers`).
    Layer { seed: usize, m: Mutations },
    /// The embedded default with `--set` values.
    Sets(Vec<Set>),
}

/// Every leaf key of the default, dotted.
pub(crate) fn leaves() -> &'static [String] {
    static LEAVES: OnceLock<Vec<String>> = OnceLock::new();
    LEAVES.get_or_init(|| {
        fn walk(prefix: &str, t: &toml::Table, out: &mut Vec<String>) {
            for (k, v) in t {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                match v {
                    toml::Value::Table(inner) => walk(&key, inner, out),
                    _ => out.push(key),
                }
            }
        }
        let mut out = Vec::new();
        // The written form of the default has every key, set or defaulted.
        let full = PipelineConfig::embedded(&[]).unwrap().to_toml().unwrap();
        walk("", &full.parse().unwrap(), &mut out);
        out
    })
}

fn set() -> impl Strategy<Value = Set> {
    let key = prop_oneof![
        8 => any::<usize>().prop_map(SetKey::Leaf),
        1 => select(&[
            "rollout.openai.api_key",
            "reward.judge.api_key",
            "transport.nats.password",
            "transport.nats.token",
            "run.api_key",
        ][..]).prop_map(SetKey::Secret),
        1 => select(&["", ".", "run..periods", "run.periods.x", "run", "[run]", " ", "run.periods ", "a=b", "é"][..])
            .prop_map(SetKey::Raw),
    ];
    let value = prop_oneof![
        6 => extreme().prop_map(SetValue::Extreme),
        2 => "\\PC{0,12}".prop_map(SetValue::Text),
        2 => select(&[
            "{ file = \"/dev/zero\" }",
            "{ file = \"/dev/urandom\" }",
            "{ file = \"/proc/self/status\" }",
            "{ file = \"/\" }",
            "{ file = \"/nonexistent/secret\" }",
            "{ env = \"METRONOME_FUZZ_UNSET\" }",
            "{ env = \"PATH\" }",
            "{ env = 1 }",
            "{ kind = \"nats\" }",
            "{ kind = \"judge\" }",
            "'unterminated",
            "\"unterminated",
            "[1, \"a\"]",
            "1979-05-27T07:32:00Z",
            "1_000",
            "0o777",
            "+inf",
            "-0.0",
        ][..]).prop_map(SetValue::Toml),
    ];
    let form = prop_oneof![
        8 => Just(Form::Plain),
        1 => Just(Form::Spaced),
        1 => Just(Form::NoEquals),
        1 => Just(Form::DoubleEquals),
    ];
    (key, value, form).prop_map(|(key, value, form)| Set { key, value, form })
}

fn input() -> impl Strategy<Value = Input> {
    let whole: Vec<usize> = (0..SEEDS.len()).filter(|&i| SEEDS[i].1).collect();
    prop_oneof![
        4 => (select(whole), mutations()).prop_map(|(seed, m)| Input::Document { seed, m }),
        2 => (0..SEEDS.len(), mutations()).prop_map(|(seed, m)| Input::Layer { seed, m }),
        4 => proptest::collection::vec(set(), 1..4).prop_map(Input::Sets),
    ]
}

impl Set {
    /// The `--set` argument.
    fn text(&self) -> String {
        let key = match &self.key {
            SetKey::Leaf(i) => leaves()[i % leaves().len()].clone(),
            SetKey::Secret(k) | SetKey::Raw(k) => (*k).to_owned(),
        };
        let value = match &self.value {
            SetValue::Extreme(e) => e.render(Format::Toml),
            SetValue::Text(t) => t.clone(),
            SetValue::Toml(t) => (*t).to_owned(),
        };
        match self.form {
            Form::Plain => format!("{key}={value}"),
            Form::Spaced => format!(" {key} = {value} "),
            Form::NoEquals => format!("{key}{value}"),
            Form::DoubleEquals => format!("{key}=={value}"),
        }
    }
}

/// Loads `input` as `metronome run` would and checks the outcome.
pub(crate) fn check(input: &Input) -> Result<(), TestCaseError> {
    let (result, sets) = match input {
        Input::Document { seed, m } => {
            let text = crate::mutate::mutate_toml(&seeds()[*seed].0, m);
            (PipelineConfig::parse(&text, "fuzz.toml", &[]), Vec::new())
        }
        Input::Layer { seed, m } => {
            let text = crate::mutate::mutate_toml(&seeds()[*seed].0, m);
            let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
            let path = dir.path().join("fuzz.toml");
            std::fs::write(&path, text).map_err(|e| TestCaseError::fail(e.to_string()))?;
            (PipelineConfig::load_layers(&[path], &[]), Vec::new())
        }
        Input::Sets(sets) => {
            let args: Vec<String> = sets.iter().map(Set::text).collect();
            let result = PipelineConfig::embedded(&args);
            (result, args)
        }
    };
    check_outcome(result, &sets)
}

/// The checks of one load; `sets` are the `--set` values when they are all that
/// changed of the (valid) default.
pub(crate) fn check_outcome(
    result: Result<PipelineConfig, Error>,
    sets: &[String],
) -> Result<(), TestCaseError> {
    match result {
        Ok(config) => {
            // What a run directory keeps, and a resume compares with the config given.
            let written = config.to_toml().map_err(|e| TestCaseError::fail(format!("to_toml: {e}")))?;
            let changes = config.resume_changes(&written);
            prop_assert!(
                matches!(&changes, Ok(c) if c.is_empty()),
                "a config differs from itself: {changes:?}"
            );
            // Read back whole, it is the same config (a credential is written redacted,
            // and refused when read again: it is given anew).
            if !written.contains(Secret::REDACTED) {
                let back = PipelineConfig::parse(&written, "config.toml", &[]).map_err(|e| {
                    TestCaseError::fail(format!("the written config does not load: {e}\n{written}"))
                })?;
                prop_assert_eq!(back.to_toml().ok(), Some(written));
            }
            Ok(())
        }
        Err(Error::Config { key, reason }) => {
            let message = format!("invalid configuration `{key}`: {reason}");
            // A key may be blank text (`" " = 1` is a TOML key), never missing.
            prop_assert!(!key.is_empty() && !reason.trim().is_empty(), "no place: {message}");
            if reason.contains("not valid TOML") {
                prop_assert!(reason.contains("line "), "a TOML error without its line: {message}");
            }
            if !sets.is_empty() {
                prop_assert!(
                    message.contains("--set") || sets.iter().any(|s| message.contains(s.as_str())),
                    "an error of a --set that names neither `--set` nor the assignment: {message}"
                );
            }
            Ok(())
        }
        Err(e) => Err(TestCaseError::fail(format!("not a config error: {e}"))),
    }
}

#[test]
fn config_documents_layers_and_sets() {
    crate::fuzz("config", 20_000, file!(), input(), |input| check(&input));
}
