//! What the engine needs from a network: a KV cache with slots, prefill and a
//! batch-invariant decode step. `metronome_model::Model` implements it; the trait
//! keeps the scheduler testable and lets other backends plug in.

use metronome_core::{TokenId, WeightSnapshot};
use metronome_model::{Draw, Next};

use crate::Result;

/// A decoder the engine can generate with. Implementations must make
/// [`InferenceModel::decode_step`] batch-invariant (a slot's logits do not depend on
/// which other slots decode with it), otherwise sampling is reproducible only for a
/// fixed worker and slot layout.
pub trait InferenceModel: Send + Sync + 'static {
    /// The KV cache of one worker: a fixed number of independently filled slots. A cache
    /// made by one model is used with every version of the same architecture.
    type Cache: Send + 'static;

    /// A cache with `num_slots` slots of up to `max_seq_len` tokens.
    fn new_cache(&self, num_slots: usize, max_seq_len: usize) -> Result<Self::Cache>;

    /// A cache whose `num_slots` slots of up to `max_seq_len` tokens share room for
    /// `tokens` positions in all (`rollout.kv_cache_tokens`), and the positions a
    /// sequence's length is rounded up to there (its block; the pool then holds
    /// `tokens.div_ceil(block)` blocks): the engine admits a sequence only while the
    /// blocks of those it runs and its own fit. The default
    /// ignores the bound (a [`InferenceModel::new_cache`] cache, blocks of one
    /// position), so the engine still limits what runs at once to `tokens`.
    fn new_pooled_cache(
        &self,
        num_slots: usize,
        max_seq_len: usize,
        tokens: usize,
    ) -> Result<(Self::Cache, usize)> {
        let _ = tokens;
        Ok((self.new_cache(num_slots, max_seq_len)?, 1))
    }

    /// Appends `tokens` to `slot` and returns the last position's logits. The slot is
    /// empty for a prompt; for a multi-turn episode it holds the trajectory so far and
    /// `tokens` are an observation (with the turn's last sampled token first).
    fn prefill(&self, cache: &mut Self::Cache, slot: usize, tokens: &[TokenId]) -> Result<Vec<f32>>;

    /// Prefills several slots, each `(slot, tokens)`, and returns each one's last
    /// position's next token or logits, in order. `draws` has one entry per pair: a
    /// pair with a [`Draw`] may come back drawn ([`Next::Drawn`], exactly as
    /// `metronome_model::draw::draw_row` draws it from the logits), any pair may come
    /// back as its logits ([`Next::Logits`]), which the engine samples itself. Must
    /// give each slot what [`InferenceModel::prefill`] gives it alone; the default does
    /// exactly that, one slot at a time, and draws nothing. Models that can prefill in
    /// one forward (as `metronome_model::Model` does) override it: the engine calls it
    /// with every sequence it admits at once.
    fn prefill_many(
        &self,
        cache: &mut Self::Cache,
        seqs: &[(usize, &[TokenId])],
        draws: &[Option<Draw<'_>>],
    ) -> Result<Vec<Next>> {
        let _ = draws;
        seqs.iter().map(|&(slot, tokens)| Ok(Next::Logits(self.prefill(cache, slot, tokens)?))).collect()
    }

    /// Appends one token to each `(slot, token)` pair and returns one row per pair, its
    /// next token or its logits as in [`InferenceModel::prefill_many`].
    fn decode_step(
        &self,
        cache: &mut Self::Cache,
        batch: &[(usize, TokenId)],
        draws: &[Option<Draw<'_>>],
    ) -> Result<Vec<Next>>;

    /// Empties `slot` for the next sequence.
    fn free(&self, cache: &mut Self::Cache, slot: usize);

    /// Why the caches this model made cannot serve `next` (weights of another
    /// architecture, type or device), if they cannot: the engine refuses to install such
    /// a model, naming its weight loader, rather than fail in its next decode step.
    /// The default accepts every model.
    fn cache_mismatch(&self, next: &Self) -> Option<String> {
        let _ = next;
        None
    }

    /// Refuses, before anything is allocated, `caches` caches of `num_slots` slots of
    /// `max_seq_len` tokens (or of `pool` positions shared by the slots, when given)
    /// that this machine cannot hold (an error naming `max_num_seqs` or
    /// `kv_cache_tokens`, never an allocation abort). The default knows no sizes and
    /// accepts.
    fn check_caches(
        &self,
        caches: usize,
        num_slots: usize,
        max_seq_len: usize,
        pool: Option<usize>,
    ) -> Result<()> {
        let _ = (caches, num_slots, max_seq_len, pool);
        Ok(())
    }

    /// The longest sequence (prompt and response) the model supports.
    fn max_context(&self) -> usize;
}

/// Builds a model from a weight snapshot (on
/// [`RolloutEngine::install_weights`](metronome_core::RolloutEngine::install_weights)).
pub trait WeightLoader<M>: Send + Sync + 'static {
    /// A model holding `weights`.
    fn load(&self, weights: &WeightSnapshot) -> Result<M>;

    /// Writes `weights` into `model`, a model this loader built that nothing else
    /// holds now (the engine's, between periods), instead of building another: a
    /// publication then reuses the served weights' memory. Checks everything before
    /// writing, as [`WeightLoader::load`] does, so an error leaves `model` as it was.
    /// `Ok(false)` where the loader cannot (the default): the engine then loads anew.
    fn reload(&self, model: &mut M, weights: &WeightSnapshot) -> Result<bool> {
        let _ = (model, weights);
        Ok(false)
    }
}

impl<M, F> WeightLoader<M> for F
where
    F: Fn(&WeightSnapshot) -> Result<M> + Send + Sync + 'static,
{
    fn load(&self, weights: &WeightSnapshot) -> Result<M> {
        self(weights)
    }
}

mod candle_model {
    use metronome_model::{Draw, KvCache, Model, Next};

    use super::{InferenceModel, TokenId};
    use crate::{Error, Result};

    impl InferenceModel for Model {
        type Cache = KvCache;

        fn new_cache(&self, num_slots: usize, max_seq_len: usize) -> Result<KvCache> {
            KvCache::new(self, num_slots, max_seq_len).map_err(Error::model)
        }

        fn new_pooled_cache(
            &self,
            num_slots: usize,
            max_seq_len: usize,
            tokens: usize,
        ) -> Result<(KvCache, usize)> {
            let cache = KvCache::pooled(self, num_slots, max_seq_len, tokens).map_err(Error::model)?;
            let block = cache.block_size();
            Ok((cache, block))
        }

        /// On the CPU, against the memory the machine has available now (Linux's
        /// `MemAvailable`); on a GPU the allocator's own error names the cache.
        fn check_caches(
            &self,
            caches: usize,
            num_slots: usize,
            max_seq_len: usize,
            pool: Option<usize>,
        ) -> Result<()> {
            if !self.device().is_cpu() {
                return Ok(());
            }
            let Some(available) = super::host_memory_available() else { return Ok(()) };
            let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
            let show = |need: Option<u64>| {
                need.map_or_else(
                    || "more bytes than a u64 counts".to_owned(),
                    |n| format!("{:.1} GiB", gib(n)),
                )
            };
            if let Some(tokens) = pool {
                let need = KvCache::pooled_bytes(self, max_seq_len, tokens)
                    .and_then(|b| b.checked_mul(caches as u64));
                if need.is_some_and(|n| n <= available) {
                    return Ok(());
                }
                return Err(Error::config(
                    "kv_cache_tokens",
                    format!(
                        "is {tokens}: {caches} worker(s) x {tokens} positions of KV cache need {}, and this machine \
                         has {:.1} GiB available (lower kv_cache_tokens)",
                        show(need),
                        gib(available)
                    ),
                ));
            }
            let per_slot = KvCache::bytes(self, 1, max_seq_len);
            let need = per_slot.and_then(|b| b.checked_mul(num_slots as u64)?.checked_mul(caches as u64));
            if need.is_some_and(|n| n <= available) {
                return Ok(());
            }
            let fit = per_slot.map_or(0, |b| available / b.max(1) / caches.max(1) as u64);
            let need = show(need);
            Err(Error::config(
                "max_num_seqs",
                format!(
                    "is {num_slots}: {caches} worker(s) x {num_slots} slots x {max_seq_len} tokens of KV cache need \
                     {need}, and this machine has {:.1} GiB available (at most {fit} slots per worker fit; \
                     lower max_num_seqs or max_seq_len)",
                    gib(available)
                ),
            ))
        }

        fn prefill(&self, cache: &mut KvCache, slot: usize, tokens: &[TokenId]) -> Result<Vec<f32>> {
            Model::prefill(self, cache, slot, tokens).map_err(Error::model)
        }

        fn prefill_many(
            &self,
            cache: &mut KvCache,
            seqs: &[(usize, &[TokenId])],
            draws: &[Option<Draw<'_>>],
        ) -> Result<Vec<Next>> {
            Model::prefill_many_drawing(self, cache, seqs, draws).map_err(Error::model)
        }

        fn decode_step(
            &self,
            cache: &mut KvCache,
            batch: &[(usize, TokenId)],
            draws: &[Option<Draw<'_>>],
        ) -> Result<Vec<Next>> {
            Model::decode_step_drawing(self, cache, batch, draws).map_err(Error::model)
        }

        fn free(&self, cache: &mut KvCache, slot: usize) {
            cache.free(slot);
        }

        fn max_context(&self) -> usize {
            self.config().max_position_embeddings
        }

        fn cache_mismatch(&self, next: &Model) -> Option<String> {
            if self.config() != next.config() {
                return Some("its architecture differs from the served model's".into());
            }
            if self.dtype() != next.dtype() || !self.device().same_device(next.device()) {
                return Some(format!(
                    "its weights are {:?} on {:?}, the caches hold {:?} on {:?}",
                    next.dtype(),
                    next.device(),
                    self.dtype(),
                    self.device()
                ));
            }
            None
        }
    }
}

/// Loads `metronome_model::Model`s from snapshots: the architecture and the device are
/// fixed, the weights come from the snapshot, and the model is built non-trainable
/// (plain tensors, no autograd graphs).
#[derive(Clone, Debug)]
pub struct SnapshotLoader {
    /// The architecture every snapshot must match.
    pub config: metronome_model::ModelConfig,
    /// Where the weights live.
    pub device: candle_core::Device,
    /// The type they decode in (snapshots are f32; a bf16 engine casts each one).
    pub dtype: candle_core::DType,
}

impl WeightLoader<metronome_model::Model> for SnapshotLoader {
    fn load(&self, weights: &WeightSnapshot) -> Result<metronome_model::Model> {
        let model = metronome_model::Model::from_snapshot(self.config.clone(), weights, &self.device, false)
            .map_err(crate::Error::model)?;
        if model.dtype() == self.dtype {
            return Ok(model);
        }
        model.compute_copy(self.dtype).map_err(crate::Error::model)
    }

    /// In place for a model of this loader's type: each weight cast as it is written
    /// (a bf16 engine's as [`SnapshotLoader::load`] casts it), so an install needs no
    /// second copy of the weights beside the served one; a model of another type is
    /// loaded anew.
    fn reload(&self, model: &mut metronome_model::Model, weights: &WeightSnapshot) -> Result<bool> {
        if model.dtype() != self.dtype {
            return Ok(false);
        }
        model.load_snapshot(weights).map_err(crate::Error::model)?;
        Ok(true)
    }
}

/// The memory this machine has available for new allocations, in bytes: Linux's
/// `MemAvailable`; `None` where it cannot be read.
fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
