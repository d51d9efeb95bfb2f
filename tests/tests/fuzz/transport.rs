//! Transport messages: groups, weights (whole and streamed in chunks), control
//! messages (`metronome_transport::wire`) and prompt claims (`claims`).
//!
//! Asserts: no panic; a refusal is a bad-message error (the receiver counts it and
//! goes on) naming its place: the field (`Malformed`, `Truncated`), or the header's
//! magic, format version or checksum; what a decoder accepts is what its encoder
//! writes back (a group also keeps finite log-probs, which the trainer would
//! otherwise meet as a non-finite loss and a dropped step); weights it accepts are
//! written for an OpenAI-compatible server or refused naming the tensor, and
//! installed or refused by an engine naming the tensor or version, the served
//! version untouched by a refusal.

use std::sync::OnceLock;

use metronome_core::{
    ControlMessage, EpisodeTrace, PeriodId, PolicyVersion, Prompt, PromptId, ScoredGroup, TokenSpan,
    VersionSwitch,
};
use metronome_rollout::{ModelEngine, Rollback};
use metronome_transport::claims::{CLAIM_FORMAT_VERSION, ClaimBody, decode_claim, encode_claim};
use metronome_transport::wire::{
    HEADER_LEN, WeightsDecoder, decode_control, decode_group, decode_weights, encode_control, encode_group,
    encode_weights,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use crate::mutate::{ByteOp, Mutations, apply_bytes, byte_op, mutate_json, mutations};

#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind {
    Group,
    Weights,
    /// Weights through the streaming decoder, in chunks of this many bytes.
    StreamedWeights(usize),
    Control(usize),
}

#[derive(Clone, Debug)]
pub(crate) enum Input {
    /// The message's bytes changed, header included (a changed body fails the checksum).
    Raw { kind: Kind, ops: Vec<ByteOp> },
    /// The body changed and the header's length and checksum written anew, as a
    /// writer with a bug (or an attacker) would: what reaches the field decoders.
    Body { kind: Kind, ops: Vec<ByteOp> },
    /// A claim's JSON changed.
    Claim(Mutations),
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        4 => Just(Kind::Group),
        2 => Just(Kind::Weights),
        1 => (1..4096usize).prop_map(Kind::StreamedWeights),
        1 => (0..3usize).prop_map(Kind::Control),
    ]
}

fn input() -> impl Strategy<Value = Input> {
    let ops = || proptest::collection::vec(byte_op(), 1..5);
    prop_oneof![
        1 => (kind(), ops()).prop_map(|(kind, ops)| Input::Raw { kind, ops }),
        4 => (kind(), ops()).prop_map(|(kind, ops)| Input::Body { kind, ops }),
        2 => mutations().prop_map(Input::Claim),
    ]
}

/// A group with every optional part: an episode, version switches, a reference.
fn group() -> ScoredGroup {
    let mut g = metronome_testkit::data::scored_group(3, 8, 4, 9);
    g.group.completions[0].episode = Some(EpisodeTrace {
        observations: vec![TokenSpan { start: 2, len: 3 }],
        turns: 2,
        reward: Some(0.5),
        failure: Some("max_turns".into()),
    });
    for i in 2..5 {
        g.group.completions[0].logprobs[i] = 0.0;
    }
    g.group.completions[1].switches = vec![VersionSwitch { at: 4, version: PolicyVersion(4) }];
    g
}

fn messages() -> &'static [Vec<u8>; 5] {
    static MESSAGES: OnceLock<[Vec<u8>; 5]> = OnceLock::new();
    MESSAGES.get_or_init(|| {
        let snapshot = crate::model(4).snapshot(PolicyVersion(2)).unwrap();
        [
            encode_group(&group()).unwrap(),
            encode_weights(&snapshot).unwrap(),
            encode_control(&ControlMessage::PeriodStart {
                period: PeriodId(4),
                version: PolicyVersion(4),
                prompts: vec![PromptId(1), PromptId(9), PromptId(u64::MAX)],
            })
            .unwrap(),
            encode_control(&ControlMessage::PeriodEnd { period: PeriodId(4) }).unwrap(),
            encode_control(&ControlMessage::Shutdown).unwrap(),
        ]
    })
}

fn claim() -> serde_json::Value {
    let prompt = Prompt {
        id: PromptId(7),
        text: "1+2=".into(),
        tokens: vec![5, 9, 12],
        reference: Some("3".into()),
        metadata: [("level".to_owned(), "2".to_owned())].into(),
    };
    let body =
        ClaimBody { format: CLAIM_FORMAT_VERSION, period: PeriodId(3), version: PolicyVersion(3), prompt };
    serde_json::from_slice(&encode_claim(&body).unwrap()).unwrap()
}

fn engine() -> &'static ModelEngine {
    static ENGINE: OnceLock<ModelEngine> = OnceLock::new();
    ENGINE.get_or_init(crate::engine)
}

/// The bytes of `input`'s message.
pub(crate) fn message(kind: Kind, ops: &[ByteOp], body_only: bool) -> Vec<u8> {
    let m = messages();
    let mut bytes = match kind {
        Kind::Group => m[0].clone(),
        Kind::Weights | Kind::StreamedWeights(_) => m[1].clone(),
        Kind::Control(i) => m[2 + i].clone(),
    };
    if body_only {
        let mut body = bytes.split_off(HEADER_LEN);
        apply_bytes(&mut body, ops);
        bytes[8..16].copy_from_slice(&(body.len() as u64).to_le_bytes());
        bytes[16..24].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(&body).to_le_bytes());
        bytes.extend_from_slice(&body);
    } else {
        apply_bytes(&mut bytes, ops);
    }
    bytes
}

/// A transport error's checks: a bad message, naming where.
fn refused(e: &metronome_transport::Error) -> Result<(), TestCaseError> {
    prop_assert!(e.is_bad_message(), "not a bad-message error: {e}");
    let places = ["field", "truncated at", "magic", "format version", "checksum", "exceeds the limit"];
    crate::names_place(&e.to_string(), &places)
}

/// What a trainer takes from a group as it is: the behaviour log-probs (rewards are
/// checked, and advantages recomputed, when the trainer admits the group).
fn finite(g: &ScoredGroup) -> bool {
    g.group.completions.iter().all(|c| c.logprobs.iter().all(|l| l.is_finite()))
}

pub(crate) fn check_message(kind: Kind, bytes: &[u8]) -> Result<(), TestCaseError> {
    match kind {
        Kind::Group => match decode_group(bytes) {
            Ok(g) => {
                prop_assert!(finite(&g), "a group with a non-finite log-prob was accepted");
                // Compared as bytes: a NaN reward (refused later, when the trainer
                // admits the group) is never equal to itself.
                let again = encode_group(&g).map_err(|e| TestCaseError::fail(format!("re-encoding: {e}")))?;
                let back =
                    decode_group(&again).map_err(|e| TestCaseError::fail(format!("decoding again: {e}")))?;
                prop_assert!(
                    encode_group(&back).is_ok_and(|b| b == again),
                    "a decoded group does not round-trip"
                );
            }
            Err(e) => refused(&e)?,
        },
        Kind::Weights | Kind::StreamedWeights(_) => {
            let decoded = match kind {
                Kind::StreamedWeights(chunk) => {
                    let mut d = WeightsDecoder::new(bytes.len() as u64);
                    bytes.chunks(chunk).try_for_each(|c| d.push(c)).and_then(|()| d.finish())
                }
                _ => decode_weights(bytes),
            };
            match decoded {
                Ok(s) => {
                    // What a worker of the `openai` backend does with weights it
                    // receives: write them for its server.
                    if let Err(e) = metronome_rollout::http::snapshot_to_safetensors(&s) {
                        crate::names_place(&crate::chain(&e), &["tensor `"])?;
                    }
                    let engine = engine();
                    let before = engine.current_version();
                    if let Err(e) = engine.install_snapshot(&s, Rollback::Allow) {
                        prop_assert_eq!(engine.current_version(), before);
                        crate::names_place(&crate::chain(&e), &["tensor `", "version"])?;
                    }
                }
                Err(e) => refused(&e)?,
            }
        }
        Kind::Control(_) => match decode_control(bytes) {
            Ok(m) => {
                let again =
                    encode_control(&m).map_err(|e| TestCaseError::fail(format!("re-encoding: {e}")))?;
                prop_assert_eq!(decode_control(&again).ok(), Some(m));
            }
            Err(e) => refused(&e)?,
        },
    }
    Ok(())
}

pub(crate) fn check_claim(bytes: &[u8]) -> Result<(), TestCaseError> {
    match decode_claim(bytes) {
        Ok(c) => {
            let again = encode_claim(&c).map_err(|e| TestCaseError::fail(format!("re-encoding: {e}")))?;
            prop_assert_eq!(decode_claim(&again).ok(), Some(c));
        }
        Err(e) => refused(&e)?,
    }
    Ok(())
}

pub(crate) fn check(input: &Input) -> Result<(), TestCaseError> {
    match input {
        Input::Raw { kind, ops } => check_message(*kind, &message(*kind, ops, false)),
        Input::Body { kind, ops } => check_message(*kind, &message(*kind, ops, true)),
        Input::Claim(m) => check_claim(&mutate_json(&claim(), m, false)),
    }
}

#[test]
fn transport_messages() {
    crate::fuzz("transport", 40_000, file!(), input(), |input| check(&input));
}
