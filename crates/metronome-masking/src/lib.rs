//! Training layouts for Metronome: how scored groups become the packed rows the
//! trainer runs the network over.
//!
//! The centre is the *shared-prompt* layout. A group's `G` responses share one prompt,
//! so instead of `G` rows of `prompt + responseᵢ` it lays out one tree: the prompt once
//! (positions `0..P`, causal), then every response as a sibling segment that sees the
//! whole prompt and its own earlier tokens, never another response, with positions
//! restarting at `P` so rotary embeddings equal those of separate decoding. The last
//! prompt position predicts every response's first token; only response tokens are
//! targets. Tokens through the dense layers fall from `G(P+L)` to `P+GL`, a saving of
//! `(G−1)P / (G(P+L))` ([`saving_bound`]).
//!
//! What the crate provides:
//! - [`shared_prompt`] for one group, and [`padded`], the baseline of one right-padded
//!   row per response, producing the same target-aligned arrays so the two compare;
//! - [`Packer`] / [`pack_period`]: next-fit packing of groups, in completion order,
//!   side by side in rows (block-diagonal) and into micro-batches by token budget
//!   ([`PackingConfig`]); a group never straddles micro-batches unless it is over
//!   budget and splitting is enabled, and then each part repeats the prompt;
//! - [`Layout`]: the core [`metronome_core::TrainBatch`] plus the span of each response,
//!   input-aligned loss masks and prediction weights as `ndarray` arrays, and a
//!   [`TokenAccount`] (tokens per layout, bound and realised saving, additive over
//!   micro-batches);
//! - [`dense_additive_mask`] and [`attention_mask`], which materialise the segment tree
//!   for attention backends that need a dense mask, and [`attention_pairs`], the
//!   attention work of a row with a dense mask and with segment-following attention.
//!
//! The token saving is a saving of the dense layers. Attention is another matter: one
//! row of `P + GL` positions under a dense mask costs `(P+GL)²` pairs against
//! `G(P+L)²` for the padded rows, which for long responses and large groups outweighs
//! the dense-layer saving. Keeping the saving at every size needs an attention kernel
//! that follows the segments (each response's queries against the prompt's keys and its
//! own prefix), which is `metronome-model`'s side of the contract.
//!
//! ```
//! use metronome_core::{AdvantageEstimator, Completion, Group, Prompt, Reward, ScoredGroup};
//! use metronome_masking::{PackingConfig, pack_period, shared_prompt};
//!
//! let prompt = Prompt { tokens: vec![5, 6, 7], ..Prompt::default() };
//! let completions = (0..2u32)
//!     .map(|i| Completion { sample_index: i, tokens: vec![8, 9], logprobs: vec![-0.5; 2], ..Completion::default() })
//!     .collect();
//! let group = Group { prompt, completions, ..Group::default() };
//! let rewards = vec![Reward::scalar(0.0), Reward::scalar(1.0)];
//! let scored = ScoredGroup::new(group, rewards, AdvantageEstimator::GroupNorm)?;
//!
//! let layout = shared_prompt(&scored)?;
//! let row = &layout.batch.rows[0];
//! assert_eq!(row.tokens, [5, 6, 7, 8, 9, 8, 9]);
//! assert_eq!(row.positions, [0, 1, 2, 3, 4, 3, 4]);
//! // The last prompt position (2) predicts both first response tokens.
//! assert_eq!(layout.batch.targets.position, [2, 3, 2, 5]);
//! // 2·(3+2) = 10 tokens as separate rows, 7 shared: the bound (G−1)P / (G(P+L)) = 3/10.
//! assert!((layout.account.bound() - 0.3).abs() < 1e-12);
//!
//! // A period's groups, in completion order, packed into micro-batches by budget.
//! let micro_batches = pack_period(&[scored], &PackingConfig::default())?;
//! assert_eq!(micro_batches.len(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! What it deliberately is not: it holds no tensors and runs no network (that is
//! `metronome-model`, which consumes [`metronome_core::PackedRow`]'s segments), computes
//! no loss (`metronome-trainer`), and does no I/O or async work. It is pure and
//! synchronous. Bad input — an empty response, a zero-length prompt, misaligned
//! log-probs or rewards, a group over budget with splitting disabled — is a
//! [`MaskingError`] naming the group, never a panic.
//!
//! Siblings: `metronome-core` defines the layout vocabulary produced here;
//! `metronome-model` runs attention over it; `metronome-pipeline` packs each period's
//! groups with this crate as they arrive and hands the micro-batches to
//! `metronome-trainer`, which computes the GRPO loss from the targets (the trainer
//! does not depend on this crate).

mod account;
mod build;
mod dense;
mod error;
mod input;
mod pack;

pub use account::{TokenAccount, saving_bound};
pub use build::{Layout, LayoutKind, ResponseSpan, padded, shared_prompt};
pub use dense::{
    AttentionPairs, attention_mask, attention_pairs, dense_additive_mask, position_ids, token_ids,
};
pub use error::{MaskingError, Result};
pub use pack::{Packer, PackingConfig, pack_period};
