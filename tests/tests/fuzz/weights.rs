//! Weight files for `load_weights`: `snapshot_from_safetensors`, then an install
//! into an engine of the fuzz model (what the endpoint does after its path checks).
//!
//! Asserts: no panic; a refusal names its place (the tensor, the header, the
//! version) and leaves the served version as it was; an install that succeeds
//! serves the version it was given.

use std::sync::OnceLock;

use metronome_core::{PolicyVersion, TensorData, WeightSnapshot};
use metronome_rollout::http::{snapshot_from_safetensors, snapshot_to_safetensors};
use metronome_rollout::{ModelEngine, Rollback};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use crate::mutate::{ByteOp, Mutations, apply_bytes, byte_op, mutate_json, mutations};

/// One change to a snapshot before it is written.
#[derive(Clone, Debug)]
pub(crate) enum Edit {
    /// An element set to a value (`at` modulo the tensor's length).
    Element {
        tensor: usize,
        at: usize,
        value: f32,
    },
    Rename {
        tensor: usize,
        name: String,
    },
    Drop {
        tensor: usize,
    },
    Duplicate {
        tensor: usize,
    },
    Reshape {
        tensor: usize,
        shape: Vec<usize>,
    },
    /// The tensor in bf16 (`true`) or f16.
    Narrow {
        tensor: usize,
        bf16: bool,
    },
    /// The tensor's data cut to `len` elements, its shape kept.
    Cut {
        tensor: usize,
        len: usize,
    },
}

#[derive(Clone, Debug)]
pub(crate) enum Change {
    /// The file's bytes.
    Bytes(Vec<ByteOp>),
    /// The JSON header's tree, the data after it kept and the length prefix rewritten.
    Header(Mutations),
    /// The snapshot, before it is written.
    Snapshot(Vec<Edit>),
}

#[derive(Clone, Debug)]
pub(crate) struct Input {
    change: Change,
    version: u64,
    allow_older: bool,
}

fn edit() -> impl Strategy<Value = Edit> {
    let tensor = any::<usize>();
    let value = prop_oneof![
        select(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -f32::MAX, 1e-45, -0.0, 1e30][..]),
        any::<f32>(),
    ];
    let name = prop_oneof![
        select(
            &[
                "",
                "lm_head.weight",
                "model.embed_tokens.weight",
                "model.norm.weight",
                "x",
                "model.layers.9.mlp.up_proj.weight"
            ][..]
        )
        .prop_map(str::to_owned),
        "\\PC{0,16}",
    ];
    let shape = proptest::collection::vec(
        prop_oneof![select(&[0usize, 1, 2, 16, 32, 99, 1 << 20, usize::MAX][..]), 0..200usize],
        0..4,
    );
    prop_oneof![
        4 => (tensor, any::<usize>(), value).prop_map(|(tensor, at, value)| Edit::Element { tensor, at, value }),
        1 => (tensor, name).prop_map(|(tensor, name)| Edit::Rename { tensor, name }),
        1 => tensor.prop_map(|tensor| Edit::Drop { tensor }),
        1 => tensor.prop_map(|tensor| Edit::Duplicate { tensor }),
        2 => (tensor, shape).prop_map(|(tensor, shape)| Edit::Reshape { tensor, shape }),
        1 => (tensor, any::<bool>()).prop_map(|(tensor, bf16)| Edit::Narrow { tensor, bf16 }),
        1 => (tensor, 0..64usize).prop_map(|(tensor, len)| Edit::Cut { tensor, len }),
    ]
}

fn input() -> impl Strategy<Value = Input> {
    let change = prop_oneof![
        2 => proptest::collection::vec(byte_op(), 1..4).prop_map(Change::Bytes),
        3 => mutations().prop_map(Change::Header),
        3 => proptest::collection::vec(edit(), 0..3).prop_map(Change::Snapshot),
    ];
    let version = prop_oneof![select(&[0u64, 1, 2, u64::MAX][..]), any::<u64>()];
    // Mostly allowed to go back: a refused older version teaches little after the first.
    let allow_older = prop_oneof![3 => Just(true), 1 => Just(false)];
    (change, version, allow_older).prop_map(|(change, version, allow_older)| Input {
        change,
        version,
        allow_older,
    })
}

fn good() -> &'static WeightSnapshot {
    static GOOD: OnceLock<WeightSnapshot> = OnceLock::new();
    GOOD.get_or_init(|| crate::model(3).snapshot(PolicyVersion(1)).unwrap())
}

fn engine() -> &'static ModelEngine {
    static ENGINE: OnceLock<ModelEngine> = OnceLock::new();
    ENGINE.get_or_init(crate::engine)
}

fn apply(snapshot: &mut WeightSnapshot, edit: &Edit) {
    let n = snapshot.tensors.len();
    if n == 0 {
        return;
    }
    let pick = |t: usize| t % n;
    match edit {
        Edit::Element { tensor, at, value } => match &mut snapshot.tensors[pick(*tensor)].data {
            TensorData::F32(v) if !v.is_empty() => {
                let i = at % v.len();
                v[i] = *value;
            }
            TensorData::Bf16(v) | TensorData::F16(v) if !v.is_empty() => {
                let i = at % v.len();
                v[i] = (value.to_bits() >> 16) as u16;
            }
            _ => {}
        },
        Edit::Rename { tensor, name } => snapshot.tensors[pick(*tensor)].name = name.clone(),
        Edit::Drop { tensor } => {
            snapshot.tensors.remove(pick(*tensor));
        }
        Edit::Duplicate { tensor } => {
            let t = snapshot.tensors[pick(*tensor)].clone();
            snapshot.tensors.push(t);
        }
        Edit::Reshape { tensor, shape } => snapshot.tensors[pick(*tensor)].shape = shape.clone(),
        Edit::Narrow { tensor, bf16 } => {
            let t = &mut snapshot.tensors[pick(*tensor)];
            if let TensorData::F32(v) = &t.data {
                let halves = v.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
                t.data = if *bf16 { TensorData::Bf16(halves) } else { TensorData::F16(halves) };
            }
        }
        Edit::Cut { tensor, len } => match &mut snapshot.tensors[pick(*tensor)].data {
            TensorData::F32(v) => v.truncate(*len),
            TensorData::Bf16(v) | TensorData::F16(v) => v.truncate(*len),
            TensorData::Resident(_) => unreachable!("the good snapshot is in host memory"),
        },
    }
}

/// The file `input` stands for, or `None` when the edited snapshot has no
/// safetensors form (a shape that does not match its data is refused by the writer).
pub(crate) fn file(change: &Change) -> Option<Vec<u8>> {
    let good_bytes = || snapshot_to_safetensors(good()).expect("the good snapshot writes");
    match change {
        Change::Bytes(ops) => {
            let mut bytes = good_bytes();
            apply_bytes(&mut bytes, ops);
            Some(bytes)
        }
        Change::Header(m) => {
            let bytes = good_bytes();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let new = mutate_json(&header, m, false);
            let mut out = (new.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&new);
            out.extend_from_slice(&bytes[8 + n..]);
            Some(out)
        }
        Change::Snapshot(edits) => {
            let mut s = good().clone();
            for e in edits {
                apply(&mut s, e);
            }
            snapshot_to_safetensors(&s).ok()
        }
    }
}

pub(crate) fn check_file(bytes: &[u8], version: u64, allow_older: bool) -> Result<(), TestCaseError> {
    let engine = engine();
    let before = engine.current_version();
    let result = snapshot_from_safetensors(bytes, PolicyVersion(version)).and_then(|s| {
        let rollback = if allow_older { Rollback::Allow } else { Rollback::Refuse };
        engine.install_snapshot(&s, rollback)
    });
    match result {
        Ok(()) => prop_assert_eq!(engine.current_version(), PolicyVersion(version)),
        Err(e) => {
            prop_assert_eq!(engine.current_version(), before, "a refused install changed the version");
            crate::names_place(&crate::chain(&e), &["tensor `", "header", "version", "metadata"])?;
        }
    }
    Ok(())
}

pub(crate) fn check(input: &Input) -> Result<(), TestCaseError> {
    match file(&input.change) {
        Some(bytes) => check_file(&bytes, input.version, input.allow_older),
        None => Ok(()),
    }
}

#[test]
fn weight_files_for_load_weights() {
    crate::fuzz("weights", 40_000, file!(), input(), |input| check(&input));
}
