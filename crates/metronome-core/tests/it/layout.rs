use metronome_core::{PackedRow, Segment};

/// The shared-prompt row of a 3-token prompt and responses of 2 and 1 tokens.
fn shared_prompt_row() -> PackedRow {
    PackedRow {
        tokens: vec![10, 11, 12, 20, 21, 30],
        positions: vec![0, 1, 2, 3, 4, 3],
        segments: vec![
            Segment { start: 0, len: 3, parent: None },
            Segment { start: 3, len: 2, parent: Some(0) },
            Segment { start: 5, len: 1, parent: Some(0) },
        ],
    }
}

#[test]
fn can_attend_follows_the_segment_tree() {
    let row = shared_prompt_row();
    row.validate(0).unwrap();
    let expected = [
        // keys:      0  1  2  3  4  5
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1], // the second response never sees the first
    ];
    for (q, keys) in expected.iter().enumerate() {
        for (k, &allowed) in keys.iter().enumerate() {
            assert_eq!(row.can_attend(q, k), allowed == 1, "query {q} key {k}");
        }
    }
    assert_eq!(row.segment_ids(), vec![0, 0, 0, 1, 1, 2]);
}

#[test]
fn validation_names_the_row_and_the_fault() {
    let mut row = shared_prompt_row();
    row.segments[2].start = 4;
    assert_eq!(
        row.validate(7).unwrap_err().to_string(),
        "packed row 7 segment 2 spans 4..5, expected a non-empty span from 5"
    );
    let mut row = shared_prompt_row();
    row.segments[1].parent = Some(2);
    assert_eq!(
        row.validate(0).unwrap_err().to_string(),
        "packed row 0 segment 1 has parent 2, which is not earlier"
    );
    let mut row = shared_prompt_row();
    row.positions.pop();
    assert_eq!(row.validate(1).unwrap_err().to_string(), "packed row 1 has 5 positions for 6 tokens");
    let mut row = shared_prompt_row();
    row.segments.pop();
    assert_eq!(row.validate(0).unwrap_err().to_string(), "packed row 0 segments cover 5 of 6 positions");
}

/// Found by the fuzz suite: a checkpoint's batch with a segment of `len = u32::MAX`
/// overflowed `Segment::end` inside the validator that was to refuse it.
#[test]
fn a_segment_past_u32_max_is_refused_not_overflowed() {
    let row = PackedRow {
        tokens: vec![1, 2],
        positions: vec![0, 1],
        segments: vec![
            Segment { start: 0, len: 1, parent: None },
            Segment { start: 1, len: u32::MAX, parent: None },
        ],
    };
    let e = row.validate(0).unwrap_err().to_string();
    assert!(e.contains("packed row 0") && e.contains("4294967295"), "{e}");
}
