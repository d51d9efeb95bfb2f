//! The wire formats against truncated, corrupted, wrong-version and oversized input:
//! every case is a clear error, never a panic.

use metronome_testkit::data::{scored_group, snapshot};
use metronome_transport::Error;
use metronome_transport::wire::{
    GROUP_FORMAT_VERSION, HEADER_LEN, check_size, decode_control, decode_group, decode_weights,
    encode_control, encode_group, encode_weights,
};
use xxhash_rust::xxh3::xxh3_64;

/// Rewrites the header checksum so that a body edit reaches the field decoder
/// instead of being caught by the checksum.
fn reseal(bytes: &mut [u8]) {
    let sum = xxh3_64(&bytes[HEADER_LEN..]);
    bytes[16..24].copy_from_slice(&sum.to_le_bytes());
}

/// Decodes `bytes` with each byte in `range` flipped (by several masks) behind a valid
/// checksum: whatever the decoder makes of it, it must not panic.
fn decode_each_flip<T>(bytes: &[u8], range: std::ops::Range<usize>, decode: impl Fn(&[u8]) -> T) {
    for i in range {
        for x in [0xffu8, 0x80, 0x01] {
            let mut bad = bytes.to_vec();
            bad[i] ^= x;
            reseal(&mut bad);
            let _ = decode(&bad);
        }
    }
}

/// `bytes` with the `u32` at `at` claiming `u32::MAX`, behind a valid checksum.
fn claiming_max(bytes: &[u8], at: usize) -> Vec<u8> {
    let mut bad = bytes.to_vec();
    bad[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    reseal(&mut bad);
    bad
}

#[test]
fn every_truncation_of_a_group_is_an_error() {
    let bytes = encode_group(&scored_group(1, 2, 3, 5)).unwrap();
    for len in 0..bytes.len() {
        let err = decode_group(&bytes[..len]).expect_err("a truncated group decoded");
        assert!(matches!(err, Error::Truncated { .. }), "length {len}: {err}");
    }
}

#[test]
fn every_truncation_of_weights_is_an_error() {
    let bytes = encode_weights(&snapshot(1, 3)).unwrap();
    for len in 0..bytes.len() {
        assert!(decode_weights(&bytes[..len]).is_err(), "length {len} decoded");
    }
}

#[test]
fn every_flipped_byte_is_detected() {
    let bytes = encode_group(&scored_group(1, 2, 2, 4)).unwrap();
    for i in 0..bytes.len() {
        let mut bad = bytes.clone();
        bad[i] ^= 0x5a;
        let err = decode_group(&bad).expect_err("a corrupted group decoded");
        let expected = match i {
            0..4 => "bad_magic",
            4..6 => "incompatible_version",
            6..8 => "malformed",
            8..16 => "",
            _ => "checksum",
        };
        if !expected.is_empty() {
            assert_eq!(err.reason(), expected, "byte {i}: {err}");
        }
    }
}

#[test]
fn corrupted_fields_behind_a_valid_checksum_are_clear_errors() {
    // A hostile writer can compute the checksum: the decoder must still refuse
    // impossible counts without allocating them, and must never panic.
    let bytes = encode_group(&scored_group(1, 2, 3, 6)).unwrap();
    decode_each_flip(&bytes, HEADER_LEN..bytes.len(), decode_group);
    // The prompt text length (first field after period and prompt id) claims 4 GiB.
    let err = decode_group(&claiming_max(&bytes, HEADER_LEN + 16)).unwrap_err();
    assert!(matches!(err, Error::Truncated { field: "prompt.text", .. }), "{err}");
    assert!(err.to_string().contains("prompt.text"), "{err}");
}

#[test]
fn corrupted_weight_tables_are_clear_errors() {
    let bytes = encode_weights(&snapshot(2, 4)).unwrap();
    decode_each_flip(&bytes, HEADER_LEN..bytes.len().min(HEADER_LEN + 400), decode_weights);
    // The tensor count claims 4 billion tensors.
    let bad = claiming_max(&bytes, HEADER_LEN + 8);
    assert!(matches!(decode_weights(&bad), Err(Error::Truncated { field: "tensors", .. })));
}

#[test]
fn a_newer_writer_is_refused_with_a_clear_message() {
    let mut bytes = encode_group(&scored_group(0, 0, 1, 1)).unwrap();
    let newer = GROUP_FORMAT_VERSION + 1;
    bytes[4..6].copy_from_slice(&newer.to_le_bytes());
    let err = decode_group(&bytes).unwrap_err();
    assert!(
        matches!(err, Error::IncompatibleVersion { found, newest, .. } if found == newer && newest == GROUP_FORMAT_VERSION),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&format!("format version {newer}")) && msg.contains("upgrade"), "{msg}");

    bytes[4..6].copy_from_slice(&0u16.to_le_bytes());
    let err = decode_group(&bytes).unwrap_err();
    assert!(matches!(err, Error::IncompatibleVersion { found: 0, .. }), "{err}");

    let mut weights = encode_weights(&snapshot(0, 1)).unwrap();
    weights[4..6].copy_from_slice(&9u16.to_le_bytes());
    assert!(matches!(decode_weights(&weights), Err(Error::IncompatibleVersion { found: 9, .. })));
}

#[test]
fn a_message_of_another_kind_is_refused_by_magic() {
    let weights = encode_weights(&snapshot(0, 1)).unwrap();
    assert!(matches!(decode_group(&weights), Err(Error::BadMagic { kind: "group", .. })));
    let control = encode_control(&metronome_core::ControlMessage::Shutdown).unwrap();
    assert!(matches!(decode_weights(&control), Err(Error::BadMagic { .. })));
    assert!(matches!(decode_control(b"{\"json\": true}"), Err(Error::BadMagic { .. })));
}

#[test]
fn trailing_bytes_are_refused() {
    let mut bytes = encode_control(&metronome_core::ControlMessage::Shutdown).unwrap();
    bytes.push(0);
    assert!(matches!(decode_control(&bytes), Err(Error::Malformed { .. })));
}

#[test]
fn oversized_messages_are_refused_by_size() {
    let bytes = encode_group(&scored_group(0, 0, 8, 4096)).unwrap();
    let err = check_size("group", bytes.len(), 64 * 1024).unwrap_err();
    assert_eq!(err.reason(), "oversized");
    assert!(err.to_string().contains("exceeds the limit of 65536 bytes"), "{err}");
    assert!(check_size("group", bytes.len(), bytes.len()).is_ok());
}

#[test]
fn weights_keep_every_bit() {
    // NaN payloads and negative zero survive: the format copies bytes, not values.
    let mut s = snapshot(3, 16);
    if let metronome_core::TensorData::F32(v) = &mut s.tensors[0].data {
        v[0] = f32::from_bits(0x7fc0_1234);
        v[1] = -0.0;
    }
    let bytes = encode_weights(&s).unwrap();
    let back = decode_weights(&bytes).unwrap();
    assert_eq!(encode_weights(&back).unwrap(), bytes);
    if let metronome_core::TensorData::F32(v) = &back.tensors[0].data {
        assert_eq!(v[0].to_bits(), 0x7fc0_1234);
        assert_eq!(v[1].to_bits(), (-0.0f32).to_bits());
    }
}

#[test]
fn episodes_round_trip_and_version_1_groups_still_decode() {
    use metronome_core::{EpisodeTrace, TokenSpan};
    let mut scored = scored_group(1, 2, 3, 6);
    scored.group.completions[1].episode = Some(EpisodeTrace {
        observations: vec![TokenSpan { start: 1, len: 2 }, TokenSpan { start: 4, len: 1 }],
        turns: 3,
        reward: Some(0.5),
        failure: Some("tool_timeout".into()),
    });
    scored.group.completions[2].episode = Some(EpisodeTrace { turns: 1, ..EpisodeTrace::default() });
    let bytes = encode_group(&scored).unwrap();
    assert_eq!(decode_group(&bytes).unwrap(), scored);
    for len in 0..bytes.len() {
        assert!(decode_group(&bytes[..len]).is_err(), "length {len} decoded");
    }

    // A version 1 message is a version 3 one without the episode section (a tag per
    // completion) and the switch section (a count per completion).
    let plain = scored_group(1, 2, 3, 6);
    let v1 = older_group(&plain, 1, plain.group.completions.len() * 5);
    assert_eq!(decode_group(&v1).unwrap(), plain);

    // A span past the tokens is refused, naming it.
    for span in [TokenSpan { start: 5, len: 9 }, TokenSpan { start: u32::MAX, len: 2 }] {
        let mut bad = scored.clone();
        bad.group.completions[1].episode.as_mut().unwrap().observations[1] = span;
        let err = encode_group(&bad).unwrap_err().to_string();
        assert!(err.contains("observation span 1"), "{span:?}: {err}");
    }
}

/// `scored` encoded, then rewritten as a message of format `version`: its last `cut`
/// bytes (the sections that version lacks) dropped, the header fixed and resealed.
fn older_group(scored: &metronome_core::ScoredGroup, version: u16, cut: usize) -> Vec<u8> {
    let mut bytes = encode_group(scored).unwrap();
    bytes.truncate(bytes.len() - cut);
    bytes[4..6].copy_from_slice(&version.to_le_bytes());
    let body = (bytes.len() - HEADER_LEN) as u64;
    bytes[8..16].copy_from_slice(&body.to_le_bytes());
    reseal(&mut bytes);
    bytes
}

#[test]
fn version_switches_round_trip_bad_ones_are_refused_and_version_2_groups_still_decode() {
    use metronome_core::{PolicyVersion, VersionSwitch};
    let mut scored = scored_group(1, 2, 3, 6);
    let c = &mut scored.group.completions[2];
    c.switches = vec![
        VersionSwitch { at: 2, version: c.version.next() },
        VersionSwitch { at: 5, version: PolicyVersion(c.version.0 + 3) },
    ];
    let bytes = encode_group(&scored).unwrap();
    assert_eq!(decode_group(&bytes).unwrap(), scored);
    for len in 0..bytes.len() {
        assert!(decode_group(&bytes[..len]).is_err(), "length {len} decoded");
    }

    // A version 2 message is a version 3 one without the switch section.
    let plain = scored_group(1, 2, 3, 6);
    let v2 = older_group(&plain, 2, plain.group.completions.len() * 4);
    assert_eq!(decode_group(&v2).unwrap(), plain);

    // A switch to an older version, or past the tokens, is refused, naming the
    // completion and the switch (the writer and the reader run the same check).
    let mut bad = scored.clone();
    bad.group.completions[2].switches[1].version = PolicyVersion(0);
    let err = encode_group(&bad).unwrap_err().to_string();
    assert!(err.contains("completion 2") && err.contains("version switch 1"), "{err}");
    let mut past = scored.clone();
    past.group.completions[2].switches[1].at = 6;
    assert!(encode_group(&past).unwrap_err().to_string().contains("version switch 1"));
}

/// Tensor data "resident on a device" for the codec: held host data that counts how
/// often it is read back, or that cannot be read back at all.
#[derive(Debug)]
struct Held {
    data: Option<metronome_core::TensorData>,
    reads: std::sync::atomic::AtomicUsize,
}

impl metronome_core::ResidentData for Held {
    fn len(&self) -> usize {
        self.data.as_ref().map_or(0, metronome_core::TensorData::len)
    }

    fn num_bytes(&self) -> usize {
        self.data.as_ref().map_or(0, metronome_core::TensorData::num_bytes)
    }

    fn to_host(&self) -> Result<metronome_core::TensorData, String> {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.data.clone().ok_or_else(|| "the device is gone".to_owned())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn resident(data: Option<metronome_core::TensorData>) -> (metronome_core::TensorData, std::sync::Arc<Held>) {
    let held = std::sync::Arc::new(Held { data, reads: 0.into() });
    let shared: std::sync::Arc<dyn metronome_core::ResidentData> = held.clone();
    (metronome_core::TensorData::Resident(metronome_core::Resident(shared)), held)
}

/// A snapshot resident on its device (as a GPU trainer publishes to an engine of its
/// own process) crosses the in-process channel as it is, never read back; the
/// encoders read it back once and write exactly the bytes of its host form, and one
/// that cannot be read back is an error naming the tensor, never a panic.
#[tokio::test]
async fn resident_weights_cross_the_local_channel_as_they_are_and_encode_as_their_host_form() {
    use metronome_core::{WeightPublisher, WeightSubscriber};
    use std::sync::atomic::Ordering::Relaxed;

    let host = snapshot(4, 16);
    let mut on_device = host.clone();
    let held: Vec<_> = on_device
        .tensors
        .iter_mut()
        .map(|t| {
            let (data, held) = resident(Some(t.data.clone()));
            t.data = data;
            held
        })
        .collect();
    assert!(on_device.is_resident() && on_device.num_bytes() == host.num_bytes());
    let reads = || held.iter().map(|h| h.reads.load(Relaxed)).sum::<usize>();

    let (publisher, mut subscriber) = metronome_transport::local::weight_channel();
    let on_device = std::sync::Arc::new(on_device);
    publisher.publish(std::sync::Arc::clone(&on_device)).await.unwrap();
    let got = subscriber.latest().await.unwrap().unwrap();
    assert!(std::sync::Arc::ptr_eq(&got, &on_device), "the same snapshot, not a copy");
    assert_eq!(reads(), 0, "nothing was read back to the host");

    let bytes = encode_weights(&host).unwrap();
    assert_eq!(encode_weights(&on_device).unwrap(), bytes);
    assert_eq!(reads(), held.len(), "each tensor read back once");
    let chunks = metronome_transport::wire::encode_weights_chunks(&on_device, 1000).unwrap();
    assert_eq!(chunks.concat(), bytes);
    assert_eq!(decode_weights(&bytes).unwrap(), host);

    let mut broken = host.clone();
    broken.tensors[2].data = resident(None).0;
    let e = encode_weights(&broken).unwrap_err().to_string();
    let name = &host.tensors[2].name;
    assert!(
        e.contains("cannot be read back")
            && e.contains(&format!("`{name}`"))
            && e.contains("the device is gone"),
        "{e}"
    );
    let e = metronome_transport::wire::encode_weights_chunks(&std::sync::Arc::new(broken), 1000).unwrap_err();
    assert!(e.to_string().contains(&format!("`{name}`")), "{e}");
}
