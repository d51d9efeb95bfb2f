//! One suite per stage trait of `metronome-core`: the promises every implementation
//! keeps, as checks to call from its tests (each runs its crate's real implementation
//! through them; a third-party stage proves itself the same way).
//!
//! A check panics with a message naming the broken promise, `"<trait> conformance:
//! …"`, and never waits forever: whatever does not complete within [`PATIENCE`] fails.
//!
//! - [`source`]: a [`PromptSource`](metronome_core::PromptSource) restored to a cursor
//!   releases the batches an uninterrupted one would; periods count up by one and
//!   hold each prompt once.
//! - [`engine`]: a [`RolloutEngine`](metronome_core::RolloutEngine) emits every group
//!   of a request once, with `G` responses, each carrying the installed version.
//! - [`scorer`]: a [`GroupScorer`](metronome_core::GroupScorer) gives one reward and
//!   one advantage per completion, and an all-equal group zero advantages.
//! - [`trainer`]: a [`Trainer`](metronome_core::Trainer) advances its version by
//!   exactly one per step, also when it refuses the update (then keeping its
//!   weights), and its snapshots are copies.
//! - [`transport`]: groups, weights and control messages move intact, once, and in
//!   order.

pub mod engine;
pub mod scorer;
pub mod source;
pub mod trainer;
pub mod transport;

use std::future::Future;
use std::time::Duration;

/// How long a check waits for any one call: a safety net so a broken implementation
/// fails the suite instead of hanging it. No check depends on how fast anything is.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// `f`'s output, or a panic naming `what` after [`PATIENCE`].
async fn patiently<T>(suite: &str, what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(PATIENCE, f).await {
        Ok(v) => v,
        Err(_) => panic!("{suite} conformance: {what} did not complete within {PATIENCE:?}"),
    }
}

/// The value of `result`, or a panic naming the suite and what failed, with the
/// error's whole chain.
fn expect<T>(suite: &str, what: &str, result: metronome_core::Result<T>) -> T {
    match result {
        Ok(v) => v,
        Err(e) => panic!("{suite} conformance: {what} failed: {}", metronome_core::ErrorChain(&e)),
    }
}
