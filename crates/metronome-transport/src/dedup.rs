//! Exactly-once counting of groups by their (period, prompt) key.
//!
//! A group may arrive twice: the server redelivers it when an acknowledgement was
//! lost or late, or a restarted rollout worker sends it again. A receiver remembers
//! the keys it has delivered; a key that is in flight or acknowledged is not
//! delivered again. A delivery dropped without acknowledgement (the trainer failed
//! before accumulating it) forgets its key, so the redelivery is accepted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use metronome_core::GroupKey;

/// How many periods behind the newest one keys are remembered. Groups older than
/// that are stale beyond any schedule we offer, and forgetting them bounds memory.
pub(crate) const DEFAULT_WINDOW_PERIODS: u64 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    InFlight,
    Acked,
}

/// What a receiver should do with an arriving group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// First sight: deliver it.
    New,
    /// A delivery of this key is being processed: drop this copy, do not acknowledge.
    InFlight,
    /// Already acknowledged: acknowledge this copy too (so the server forgets it) and drop it.
    Acked,
}

#[derive(Debug, Default)]
struct State {
    seen: HashMap<GroupKey, Seen>,
    newest_period: u64,
}

/// The set of keys a receiver has delivered.
#[derive(Debug)]
pub(crate) struct Dedup {
    window: u64,
    state: Mutex<State>,
}

impl Dedup {
    pub(crate) fn new(window: u64) -> Arc<Self> {
        Arc::new(Self { window, state: Mutex::new(State::default()) })
    }

    /// Admits `key`, marking it in flight when it is new.
    pub(crate) fn admit(self: &Arc<Self>, key: GroupKey) -> (Admit, Option<KeyGuard>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if key.period.0 > state.newest_period {
            state.newest_period = key.period.0;
            let oldest = state.newest_period.saturating_sub(self.window);
            state.seen.retain(|k, _| k.period.0 >= oldest);
        }
        match state.seen.get(&key) {
            Some(Seen::InFlight) => (Admit::InFlight, None),
            Some(Seen::Acked) => (Admit::Acked, None),
            None => {
                state.seen.insert(key, Seen::InFlight);
                (Admit::New, Some(KeyGuard { dedup: Arc::clone(self), key, done: false }))
            }
        }
    }

    fn set(&self, key: GroupKey, acked: bool) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if acked {
            state.seen.insert(key, Seen::Acked);
        } else if state.seen.get(&key) == Some(&Seen::InFlight) {
            state.seen.remove(&key);
        }
    }
}

/// Held by a delivery's acknowledgement: marks the key acknowledged, or forgets it
/// when dropped unacknowledged.
#[derive(Debug)]
pub(crate) struct KeyGuard {
    dedup: Arc<Dedup>,
    key: GroupKey,
    done: bool,
}

impl KeyGuard {
    pub(crate) fn acked(mut self) {
        self.dedup.set(self.key, true);
        self.done = true;
    }
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        if !self.done {
            self.dedup.set(self.key, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use metronome_core::{PeriodId, PromptId};

    use super::*;

    fn key(period: u64, prompt: u64) -> GroupKey {
        GroupKey { period: PeriodId(period), prompt: PromptId(prompt) }
    }

    #[test]
    fn a_key_is_admitted_once_until_released() {
        let d = Dedup::new(4);
        let (a, guard) = d.admit(key(0, 1));
        assert_eq!(a, Admit::New);
        assert_eq!(d.admit(key(0, 1)).0, Admit::InFlight);
        drop(guard);
        let (a, guard) = d.admit(key(0, 1));
        assert_eq!(a, Admit::New);
        guard.unwrap().acked();
        assert_eq!(d.admit(key(0, 1)).0, Admit::Acked);
        assert_eq!(d.admit(key(0, 2)).0, Admit::New);
    }

    #[test]
    fn old_periods_are_forgotten() {
        let d = Dedup::new(2);
        d.admit(key(0, 1)).1.unwrap().acked();
        d.admit(key(3, 1)).1.unwrap().acked();
        assert_eq!(d.admit(key(0, 1)).0, Admit::New);
        assert_eq!(d.admit(key(3, 1)).0, Admit::Acked);
    }
}
