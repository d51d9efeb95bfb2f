//! Damaged copies of a good file, for the tests that a reader refuses every one with
//! an error naming the file (or loads it, where the damage leaves it valid), and
//! never panics or aborts.

use std::path::Path;

use metronome_core::ErrorChain;

/// One way to damage a file at a byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// Cut the file before the byte: never a valid file.
    Cut,
    /// XOR the byte with a mask.
    Flip(u8),
    /// Set the byte to a value (`0x7f` turns a length or count field huge).
    Set(u8),
}

/// Byte positions to damage a file of `len` bytes at: every one of the first `head`
/// (headers and metadata), then `spread` drawn from a fixed sequence seeded by `seed`.
#[must_use]
pub fn positions(len: usize, head: usize, spread: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut next = move || {
        // SplitMix64: any fixed sequence covering the file will do.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let z = (state ^ (state >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        (z ^ (z >> 29)) as usize
    };
    let mut out: Vec<usize> = (0..len.min(head)).collect();
    out.extend((0..spread).map(|_| next() % len.max(1)));
    out
}

/// Writes `good` to `path` damaged in each of `damages` at each of `positions`, and
/// loads it with `load` each time: a cut file must not load, a refusal must name one
/// of `names` in its chain (the file's name, or what in it is at fault), and nothing
/// may panic. Writes `good` back at the end. Returns how many damaged files it tried.
///
/// # Panics
/// On the first damaged file the reader mishandles, naming it.
pub fn check_damaged<E: std::error::Error + 'static>(
    path: &Path,
    good: &[u8],
    positions: &[usize],
    damages: &[Damage],
    names: &[&str],
    load: impl Fn() -> Result<(), E>,
) -> usize {
    let file = path.display();
    let mut tried = 0;
    for &at in positions {
        for &damage in damages {
            let mut bytes = good.to_vec();
            match damage {
                Damage::Cut => bytes.truncate(at),
                Damage::Flip(mask) => bytes[at] ^= mask,
                Damage::Set(value) => bytes[at] = value,
            }
            std::fs::write(path, &bytes).unwrap_or_else(|e| panic!("cannot write {file}: {e}"));
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&load)) {
                Ok(Ok(())) => assert!(damage != Damage::Cut, "{file} cut at byte {at} loaded"),
                Ok(Err(e)) => {
                    let chain = ErrorChain(&e).to_string();
                    assert!(names.iter().any(|n| chain.contains(n)), "{file}, {damage:?} at {at}: {chain}");
                }
                Err(_) => panic!("the reader panicked on {file}, {damage:?} at byte {at}"),
            }
            tried += 1;
        }
    }
    std::fs::write(path, good).unwrap_or_else(|e| panic!("cannot write {file}: {e}"));
    tried
}
