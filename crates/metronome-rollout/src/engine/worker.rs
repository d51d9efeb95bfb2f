//! A worker: an OS thread that runs continuous batching over its KV-cache slots,
//! taking pending responses from the shared queue, prefilling those it admits
//! together, decoding its active slots in one step per weight version, sampling, and
//! reporting finished responses to their request's assembler (see the engine's docs).

use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use metronome_core::{
    Completion, Episode, EpisodeTrace, ErrorChain, FinishReason, Observation, PolicyVersion, TokenId,
    TokenSpan, VersionSwitch, sample_seed,
};

use metronome_model::{Draw, Next};

use super::episodes::{EpisodeState, ToolCall, spawn_tool_call};
use super::shared::{CachePool, Event, Job, Request, Shared, Versioned, WorkerCounters};
use crate::backend::InferenceModel;
use crate::stop::Finish;
use crate::{Batching, Error, PartialCache, Sampled, Sampler, TokenRng};

/// Most prompt tokens one prefill forward takes: sequences admitted together are
/// prefilled in one forward (on a small model one prompt costs about what many cost),
/// in chunks of at most this many tokens to bound the activations' memory.
const PREFILL_TOKENS: usize = 2048;

/// The active slots (with their last tokens) that decode with one weight version.
type VersionBatch<M> = (Arc<Versioned<M>>, Vec<(usize, TokenId)>);

/// A sequence in a slot.
pub(super) struct Seq<M> {
    pub(super) request: Arc<Request>,
    pub(super) prompt: usize,
    pub(super) sample_index: u32,
    pub(super) model: Arc<Versioned<M>>,
    /// The version that sampled the first token (the response's seed is keyed by it).
    pub(super) version: PolicyVersion,
    pub(super) rng: TokenRng,
    /// The prompt followed by the response so far (the repetition penalty's context).
    pub(super) context: Vec<TokenId>,
    pub(super) prompt_len: usize,
    pub(super) logprobs: Vec<f32>,
    /// Most tokens this response may have.
    pub(super) budget: usize,
    /// Bytes of the current turn's decoded text already searched for stop strings.
    pub(super) text_checked: usize,
    /// Tokens sampled so far: the index of the next number of the random stream
    /// (observation tokens draw none).
    pub(super) sampled: u64,
    /// The episode, for multi-turn generation.
    pub(super) episode: Option<EpisodeState>,
    /// Where newer weights took over (partial rollouts), for the completion.
    pub(super) switches: Vec<VersionSwitch>,
}

/// A finished sequence kept in the decode forward under [`Batching::StaticPadded`]
/// until its batch ends: its slot's KV cache grows by one row per step, like a padded
/// row of a static batch.
struct Padding<M> {
    model: Arc<Versioned<M>>,
    /// The token fed at each step (the sequence's last one); its logits are discarded.
    token: TokenId,
    /// Tokens the slot's KV cache holds.
    held: usize,
}

impl<M> Seq<M> {
    pub(super) fn generated(&self) -> &[TokenId] {
        &self.context[self.prompt_len..]
    }

    pub(super) fn last(&self) -> TokenId {
        self.context[self.context.len() - 1]
    }

    /// Where the current policy turn begins in the response.
    pub(super) fn turn_start(&self) -> usize {
        self.episode.as_ref().map_or(0, |e| e.turn_start)
    }

    /// True while an environment call holds the slot.
    fn waiting(&self) -> bool {
        self.episode.as_ref().is_some_and(|e| e.call.is_some())
    }
}

/// One worker's slots, cache and sampler; its loop is [`Worker::run`].
pub(super) struct Worker<M: InferenceModel> {
    index: usize,
    label: String,
    pub(super) shared: Arc<Shared<M>>,
    pub(super) cache: M::Cache,
    pub(super) slots: Vec<Option<Seq<M>>>,
    /// Finished sequences still decoded ([`Batching::StaticPadded`]); a slot holds
    /// either a live sequence or padding, never both.
    padding: Vec<Option<Padding<M>>>,
    /// Per slot, the KV-cache blocks reserved for what it holds at its longest
    /// ([`Worker::reservation`]); counted only while the slot is occupied.
    reserved: Vec<usize>,
    sampler: Sampler,
    max_seq_len: usize,
    /// Tokens sampled since the metrics counter was last advanced: it is advanced
    /// once per step, and before a completion is reported so that a caller who has
    /// its group also sees its tokens counted.
    unflushed_tokens: u64,
    tokens_total: metrics::Counter,
    /// The decode steps and their rows, for Prometheus (`WorkerStats` has them too).
    steps_total: (metrics::Counter, metrics::Counter),
}

impl<M: InferenceModel> Worker<M> {
    pub(super) fn new(index: usize, shared: Arc<Shared<M>>, cache: M::Cache) -> Self {
        let max_num_seqs = shared.max_num_seqs;
        let max_seq_len = shared.max_seq_len;
        Self {
            index,
            label: index.to_string(),
            shared,
            cache,
            slots: (0..max_num_seqs).map(|_| None).collect(),
            padding: (0..max_num_seqs).map(|_| None).collect(),
            reserved: vec![0; max_num_seqs],
            sampler: Sampler::new(),
            max_seq_len,
            unflushed_tokens: 0,
            tokens_total: crate::metrics::generated_tokens(index),
            steps_total: crate::metrics::decode_steps(&index.to_string()),
        }
    }

    fn counters(&self) -> &WorkerCounters {
        &self.shared.counters[self.index]
    }

    fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    pub(super) fn run(mut self) {
        let active_gauge = crate::metrics::active_slots(&self.label);
        while let Some(jobs) = self.admit() {
            self.start(jobs);
            self.catch_up();
            let decoded = self.step();
            let observed = self.poll_tools();
            if !decoded && !observed && self.active() > 0 {
                // Every live slot waits on its environment: do not spin.
                std::thread::sleep(Duration::from_micros(200));
            }
            let active = self.active() as u64;
            self.counters().active_slots.store(active, Ordering::Relaxed);
            active_gauge.set(active as f64);
            self.flush_tokens();
        }
        // Shutdown: sequences still running are dropped; their requests see the
        // channel close once the queue's jobs are dropped too.
        self.shared.lock_queue().pending.clear();
    }

    /// Frees the slots of cancelled requests, waits while there is nothing to do, and
    /// takes pending jobs for the free slots. `None` at shutdown.
    fn admit(&mut self) -> Option<Vec<(usize, Job)>> {
        for slot in 0..self.slots.len() {
            if self.slots[slot].as_ref().is_some_and(|s| s.request.is_cancelled()) {
                self.release(slot);
            }
        }
        // A padded batch ends with its last live sequence: its padding rows go too.
        if self.active() == 0 {
            for slot in 0..self.padding.len() {
                self.release(slot);
            }
        }
        let mut q = self.shared.lock_queue();
        loop {
            if q.shutdown {
                return None;
            }
            q.pending.retain(|j| !j.request.is_cancelled());
            if self.active() > 0 || !q.pending.is_empty() {
                break;
            }
            q = self.shared.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
        let may_admit = match self.shared.batching {
            Batching::Continuous => true,
            Batching::Static | Batching::StaticPadded => self.active() == 0,
        };
        let mut jobs = Vec::new();
        if may_admit {
            // With a KV-cache pool, in queue order while the next one's blocks fit
            // beside those reserved (an empty worker always fits one: the pool holds at
            // least one sequence at `max_seq_len`).
            let mut reserved: usize = (0..self.slots.len())
                .filter(|&s| self.slots[s].is_some() || self.padding[s].is_some())
                .map(|s| self.reserved[s])
                .sum();
            for slot in 0..self.slots.len() {
                if self.slots[slot].is_none() {
                    let Some(job) = q.pending.front() else { break };
                    if let Some(pool) = self.shared.pool {
                        let need = self.reservation(job, pool);
                        if reserved + need > pool.blocks {
                            break;
                        }
                        reserved += need;
                        self.reserved[slot] = need;
                    }
                    jobs.extend(q.pending.pop_front().map(|job| (slot, job)));
                }
            }
            if !jobs.is_empty() {
                crate::metrics::queue_depth(q.pending.len());
            }
        }
        Some(jobs)
    }

    /// The blocks of `pool` that `job` may fill at its longest: its prompt and its whole
    /// budget, or `max_seq_len` for an episode (observations grow it) and under padded
    /// static batching (a finished row keeps growing until its batch ends).
    fn reservation(&self, job: &Job, pool: CachePool) -> usize {
        let request = &job.request;
        let longest = if request.episodes.is_some() || self.shared.batching == Batching::StaticPadded {
            self.max_seq_len
        } else {
            let prompt = request.prompts[job.prompt].tokens.len();
            prompt + budget(request.sampling.max_new_tokens, prompt, self.max_seq_len)
        };
        longest.min(self.max_seq_len).div_ceil(pool.block)
    }

    /// Puts `jobs` into their slots with the current weights, prefills them in as few
    /// forwards as [`PREFILL_TOKENS`] allows, and samples each one's first token.
    fn start(&mut self, jobs: Vec<(usize, Job)>) {
        if jobs.is_empty() {
            return;
        }
        let model = self.shared.current();
        let mut started = Vec::with_capacity(jobs.len());
        for (slot, job) in jobs {
            let request = job.request;
            let prompt = &request.prompts[job.prompt];
            request.send(Event::Started { prompt: job.prompt, at_s: request.start.elapsed().as_secs_f64() });
            let seed = sample_seed(request.seed, model.version, prompt.id, job.sample_index);
            let episode = match &request.episodes {
                None => None,
                Some(e) => match e.environment.start(prompt, job.sample_index) {
                    Ok(episode) => Some(EpisodeState {
                        episode: Some(episode),
                        call: None,
                        turn_start: 0,
                        observations: Vec::new(),
                        turns: 0,
                        reward: None,
                    }),
                    Err(e) => {
                        request.fail(Error::Prompt {
                            prompt: prompt.id,
                            reason: format!("cannot start an episode: {}", ErrorChain(&e)),
                        });
                        continue;
                    }
                },
            };
            let budget = budget(request.sampling.max_new_tokens, prompt.tokens.len(), self.max_seq_len);
            let mut context = Vec::with_capacity(prompt.tokens.len() + budget);
            context.extend_from_slice(&prompt.tokens);
            started.push(slot);
            self.slots[slot] = Some(Seq {
                prompt: job.prompt,
                sample_index: job.sample_index,
                rng: TokenRng::new(seed),
                prompt_len: prompt.tokens.len(),
                context,
                logprobs: Vec::with_capacity(budget),
                budget,
                text_checked: 0,
                sampled: 0,
                episode,
                switches: Vec::new(),
                version: model.version,
                model: Arc::clone(&model),
                request: Arc::clone(&request),
            });
        }
        self.prefill_chunked(&model, &started);
    }

    /// Partial rollouts (`rollout.partial_rollouts`): every live sequence not waiting on
    /// its environment whose weights are older than the installed ones continues
    /// under them. With [`PartialCache::Rebuild`] its KV cache is rebuilt by
    /// prefilling its whole context (prompt and tokens so far) with the new weights,
    /// which also gives its next token; with [`PartialCache::Keep`] the cache stays
    /// and the next decode step is the new weights' first. The switch is recorded on
    /// the completion. The response's random stream goes on where it was (its seed is
    /// fixed at its start), so a response continued under new weights equals one
    /// given those weights at that token.
    fn catch_up(&mut self) {
        let Some(cache) = self.shared.partial_rollouts else { return };
        let current = self.shared.current();
        let behind: Vec<usize> = (0..self.slots.len())
            .filter(|&s| {
                self.slots[s]
                    .as_ref()
                    .is_some_and(|seq| !seq.waiting() && seq.model.version < current.version)
            })
            .collect();
        if behind.is_empty() {
            return;
        }
        for &slot in &behind {
            if cache == PartialCache::Rebuild {
                current.model.free(&mut self.cache, slot);
            }
            let Some(seq) = self.slots[slot].as_mut() else { continue };
            seq.switches.push(VersionSwitch { at: seq.generated().len() as u32, version: current.version });
            seq.model = Arc::clone(&current);
        }
        crate::metrics::weight_switches(&self.label, behind.len());
        if cache == PartialCache::Rebuild {
            self.prefill_chunked(&current, &behind);
        }
    }

    /// [`Worker::prefill`] in as few forwards as [`PREFILL_TOKENS`] allows.
    fn prefill_chunked(&mut self, model: &Versioned<M>, slots: &[usize]) {
        let mut chunk: Vec<usize> = Vec::with_capacity(slots.len());
        let mut chunk_tokens = 0;
        for &slot in slots {
            let Some(tokens) = self.slots[slot].as_ref().map(|seq| seq.context.len()) else { continue };
            if !chunk.is_empty() && chunk_tokens + tokens > PREFILL_TOKENS {
                self.prefill(model, &std::mem::take(&mut chunk));
                chunk_tokens = 0;
            }
            chunk_tokens += tokens;
            chunk.push(slot);
        }
        self.prefill(model, &chunk);
    }

    /// Prefills the whole contexts of the (empty) slots `slots` together and samples
    /// each one's next token. If the joint forward fails, each is retried alone, so one
    /// bad prompt fails only its own request.
    fn prefill(&mut self, model: &Versioned<M>, slots: &[usize]) {
        let seqs: Vec<(usize, &[TokenId])> = slots
            .iter()
            .filter_map(|&s| self.slots[s].as_ref().map(|seq| (s, seq.context.as_slice())))
            .collect();
        let draws: Vec<Option<Draw<'_>>> = seqs.iter().map(|&(slot, _)| draw_of(&self.slots, slot)).collect();
        let joint = match model.model.prefill_many(&mut self.cache, &seqs, &draws) {
            Ok(rows) if rows.len() == seqs.len() => Some(rows),
            _ => None,
        };
        let prefilled: Vec<usize> = seqs.iter().map(|&(slot, _)| slot).collect();
        drop(seqs);
        if let Some(rows) = joint {
            for (slot, next) in prefilled.into_iter().zip(rows) {
                self.advance(slot, next);
            }
            return;
        }
        for &slot in slots {
            let Some(seq) = self.slots[slot].as_ref() else { continue };
            match model.model.prefill(&mut self.cache, slot, &seq.context) {
                Ok(logits) => self.advance(slot, Next::Logits(logits)),
                Err(e) => {
                    seq.request.fail(e);
                    self.release(slot);
                }
            }
        }
    }

    /// One decode step for every active slot not waiting on its environment (and every
    /// padding row), batched per weight version, in slot order. False when nothing
    /// decoded.
    fn step(&mut self) -> bool {
        let mut batches: Vec<VersionBatch<M>> = Vec::new();
        let mut padding_rows = 0;
        for slot in 0..self.slots.len() {
            let (model, token) = match (&self.slots[slot], &self.padding[slot]) {
                (Some(seq), _) if seq.waiting() => continue,
                (Some(seq), _) => (&seq.model, seq.last()),
                // A full slot cannot take another row; its padding leaves the forward.
                (None, Some(pad)) if pad.held < self.max_seq_len => {
                    padding_rows += 1;
                    (&pad.model, pad.token)
                }
                _ => continue,
            };
            match batches.iter_mut().find(|(m, _)| Arc::ptr_eq(m, model)) {
                Some((_, batch)) => batch.push((slot, token)),
                None => {
                    // Room for every slot from here on: the batch grows without moving.
                    let mut batch = Vec::with_capacity(self.slots.len() - slot);
                    batch.push((slot, token));
                    batches.push((Arc::clone(model), batch));
                }
            }
        }
        if batches.is_empty() {
            return false;
        }
        self.counters().padding_rows.fetch_add(padding_rows, Ordering::Relaxed);
        for (model, batch) in batches {
            let draws: Vec<Option<Draw<'_>>> =
                batch.iter().map(|&(slot, _)| draw_of(&self.slots, slot)).collect();
            let result = model.model.decode_step(&mut self.cache, &batch, &draws);
            self.counters().decode_steps.fetch_add(1, Ordering::Relaxed);
            self.counters().decode_rows.fetch_add(batch.len() as u64, Ordering::Relaxed);
            self.steps_total.0.increment(1);
            self.steps_total.1.increment(batch.len() as u64);
            match result {
                Ok(rows) if rows.len() == batch.len() => {
                    for (&(slot, _), row) in batch.iter().zip(rows) {
                        // A slot without a live sequence was padding: its row is discarded.
                        if self.slots[slot].is_some() {
                            self.advance(slot, row);
                        } else if let Some(pad) = self.padding[slot].as_mut() {
                            pad.held += 1;
                        }
                    }
                }
                Ok(rows) => self.fail_batch(
                    &batch,
                    &format!("decode step returned {} rows for {} slots", rows.len(), batch.len()),
                ),
                Err(e) => self.fail_batch(&batch, &ErrorChain(&e).to_string()),
            }
        }
        true
    }

    /// Takes the answers of finished environment calls (and ends the episodes whose call
    /// timed out), appends the observations of those that go on by prefilling only the
    /// new tokens, batched per weight version, and samples each one's next token. False
    /// when no call finished.
    fn poll_tools(&mut self) -> bool {
        let now = Instant::now();
        let mut answered = Vec::new();
        for slot in 0..self.slots.len() {
            let Some(call) = self.slots[slot].as_ref().and_then(|s| s.episode.as_ref()?.call.as_ref()) else {
                continue;
            };
            match call.result.try_recv() {
                Ok(result) => answered.push((slot, result)),
                Err(std_mpsc::TryRecvError::Empty) if now < call.deadline => {}
                Err(std_mpsc::TryRecvError::Empty) => {
                    answered.push((slot, (None, Err("tool_timeout".into()))))
                }
                Err(std_mpsc::TryRecvError::Disconnected) => {
                    answered.push((
                        slot,
                        (None, Err("tool_panic: the call's thread ended without an answer".into())),
                    ));
                }
            }
        }
        if answered.is_empty() {
            return false;
        }
        let mut feeds: Vec<(usize, Vec<TokenId>)> = Vec::new();
        for (slot, (episode, result)) in answered {
            if let Some(feed) = self.observe(slot, episode, result) {
                feeds.push((slot, feed));
            }
        }
        // Prefill per weight version, in slot order.
        while !feeds.is_empty() {
            let Some(model) = self.slots[feeds[0].0].as_ref().map(|s| Arc::clone(&s.model)) else {
                feeds.remove(0);
                continue;
            };
            let (batch, rest): (Vec<_>, Vec<_>) = feeds.into_iter().partition(|(slot, _)| {
                self.slots[*slot].as_ref().is_some_and(|s| Arc::ptr_eq(&s.model, &model))
            });
            feeds = rest;
            let seqs: Vec<(usize, &[TokenId])> = batch.iter().map(|(s, t)| (*s, t.as_slice())).collect();
            let draws: Vec<Option<Draw<'_>>> =
                batch.iter().map(|&(slot, _)| draw_of(&self.slots, slot)).collect();
            match model.model.prefill_many(&mut self.cache, &seqs, &draws) {
                Ok(rows) if rows.len() == batch.len() => {
                    for ((slot, _), next) in batch.iter().zip(rows) {
                        self.advance(*slot, next);
                    }
                }
                Ok(rows) => {
                    let reason =
                        format!("observation prefill returned {} rows for {} slots", rows.len(), batch.len());
                    let slots: Vec<(usize, TokenId)> = batch.iter().map(|(s, _)| (*s, 0)).collect();
                    self.fail_batch(&slots, &reason);
                }
                Err(e) => {
                    let slots: Vec<(usize, TokenId)> = batch.iter().map(|(s, _)| (*s, 0)).collect();
                    self.fail_batch(&slots, &ErrorChain(&e).to_string());
                }
            }
        }
        true
    }

    /// Applies an environment's answer to `slot`: ends the episode (done, a failure, a
    /// limit) or appends the observation's tokens and returns what to prefill: the
    /// turn's last sampled token (not in the cache yet) and the observation.
    fn observe(
        &mut self,
        slot: usize,
        episode: Option<Box<dyn Episode>>,
        result: std::result::Result<Observation, String>,
    ) -> Option<Vec<TokenId>> {
        let seq = self.slots[slot].as_mut()?;
        let (max_turns, chat_template) =
            seq.request.episodes.as_ref().map_or((1, false), |e| (e.max_turns, e.chat_template));
        let state = seq.episode.as_mut()?;
        let finish = state.call.take()?.finish;
        state.episode = episode;
        let obs = match result {
            Ok(obs) => obs,
            Err(failure) => {
                self.finish_episode(slot, finish, Some(failure));
                return None;
            }
        };
        if obs.done {
            state.reward = obs.reward.filter(|r| r.is_finite());
            self.finish_episode(slot, finish, None);
            return None;
        }
        if state.turns >= max_turns {
            self.finish_episode(slot, finish, Some("max_turns".into()));
            return None;
        }
        let tokenizer = self.shared.tokenizer.as_ref();
        let tokens = match obs.render(tokenizer, chat_template).and_then(|text| tokenizer.encode(&text)) {
            Ok(t) => t,
            Err(e) => {
                self.finish_episode(slot, finish, Some(format!("observation: {}", ErrorChain(&e))));
                return None;
            }
        };
        // Room is needed for the observation and at least one more policy token.
        if seq.generated().len() + tokens.len() >= seq.budget {
            self.finish_episode(slot, Finish::new(FinishReason::Length), Some("max_tokens".into()));
            return None;
        }
        let mut feed = Vec::with_capacity(tokens.len() + 1);
        feed.push(seq.last());
        feed.extend_from_slice(&tokens);
        let start = seq.generated().len();
        seq.context.extend_from_slice(&tokens);
        seq.logprobs.extend(std::iter::repeat_n(0.0, tokens.len()));
        seq.text_checked = 0;
        let state = seq.episode.as_mut()?;
        if !tokens.is_empty() {
            state.observations.push(TokenSpan { start: start as u32, len: tokens.len() as u32 });
        }
        state.turn_start = start + tokens.len();
        Some(feed)
    }

    /// Ends `slot`'s episode, counting a failure.
    fn finish_episode(&mut self, slot: usize, finish: Finish, failure: Option<String>) {
        if let Some(f) = &failure {
            crate::metrics::episode_failed(f);
        }
        self.finish_with(slot, finish, failure);
    }

    /// Ends `slot`'s turn: calls its environment (the slot waits) or, at a turn limit
    /// or the token budget, ends the episode.
    fn end_turn(&mut self, slot: usize, finish: Finish) {
        let Some(seq) = self.slots[slot].as_mut() else { return };
        let Some((limit, max_calls)) =
            seq.request.episodes.as_ref().map(|e| (e.tool_time_limit, e.max_running_calls))
        else {
            return;
        };
        let turn = match self.shared.tokenizer.decode(&seq.generated()[seq.turn_start()..]) {
            Ok(t) => t,
            Err(e) => {
                seq.request.fail(e.into());
                self.release(slot);
                return;
            }
        };
        let Some(state) = seq.episode.as_mut() else { return };
        state.turns += 1;
        let Some(episode) = state.episode.take() else {
            self.finish_episode(slot, finish, Some("tool_error: the episode was lost".into()));
            return;
        };
        let result = spawn_tool_call(episode, turn, &self.shared.tool_calls, max_calls);
        state.call = Some(ToolCall { result, deadline: Instant::now() + limit, finish });
    }

    fn fail_batch(&mut self, batch: &[(usize, TokenId)], reason: &str) {
        for &(slot, _) in batch {
            if let Some(seq) = &self.slots[slot] {
                seq.request.fail(Error::Model(format!("worker {}: {reason}", self.index)));
            }
            self.release(slot);
        }
    }

    /// Takes the next token of `slot`, drawn by the model or sampled here from its
    /// logits, and finishes the sequence if it ended.
    fn advance(&mut self, slot: usize, next: Next) {
        let Some(seq) = self.slots[slot].as_mut() else { return };
        let k = seq.sampled;
        let sampling = &seq.request.sampling;
        let sampled = match next {
            Next::Drawn(d) => Ok(Sampled { token: d.token, logprob: d.logprob }),
            Next::Logits(logits) => self.sampler.sample(sampling, &logits, &seq.context, seq.rng.uniform(k)),
        };
        let sampled = match sampled {
            Ok(s) => s,
            Err(e) => {
                seq.request.fail(e);
                self.release(slot);
                return;
            }
        };
        seq.context.push(sampled.token);
        seq.logprobs.push(sampled.logprob);
        seq.sampled += 1;
        self.shared.counters[self.index].generated_tokens.fetch_add(1, Ordering::Relaxed);
        self.unflushed_tokens += 1;

        let stop = &seq.request.stop;
        let mut finish = None;
        if stop.is_stop_token(sampled.token) {
            finish = Some(Finish::new(FinishReason::Stop));
        } else if !stop.strings.is_empty() {
            match self.shared.tokenizer.decode(&seq.generated()[seq.turn_start()..]) {
                Ok(text) => match stop.find_stop_string(&text, seq.text_checked) {
                    Some((at, len)) => {
                        let keep = if sampling.include_stop_str_in_output { at + len } else { at };
                        finish = Some(Finish { reason: FinishReason::StopString, text_len: Some(keep) });
                    }
                    None => seq.text_checked = text.len(),
                },
                Err(e) => {
                    seq.request.fail(e.into());
                    self.release(slot);
                    return;
                }
            }
        }
        let episode = seq.episode.is_some();
        if episode && let Some(f) = finish {
            // A turn ended: the environment answers it, even at the token budget (a
            // final answer may end there); an observation that does not fit then ends
            // the episode. The text of an episode is never cut at a stop string.
            self.end_turn(slot, Finish { text_len: None, ..f });
            return;
        }
        if finish.is_none() && seq.generated().len() >= seq.budget {
            if episode {
                self.finish_episode(slot, Finish::new(FinishReason::Length), Some("max_tokens".into()));
                return;
            }
            finish = Some(Finish::new(FinishReason::Length));
        }
        if let Some(finish) = finish {
            self.finish(slot, finish);
        }
    }

    fn finish(&mut self, slot: usize, finish: Finish) {
        self.finish_with(slot, finish, None);
    }

    /// Reports `slot`'s response; `failure` (for an episode) says why it ended early.
    fn finish_with(&mut self, slot: usize, finish: Finish, failure: Option<String>) {
        let Some(seq) = self.slots[slot].take() else { return };
        if self.shared.batching == Batching::StaticPadded {
            // The slot's cache holds every token but the last sampled one.
            let held = seq.context.len() - 1;
            self.padding[slot] = Some(Padding { model: Arc::clone(&seq.model), token: seq.last(), held });
        } else {
            self.seq_done(slot);
        }
        let text = match self.shared.tokenizer.decode(seq.generated()) {
            Ok(mut text) => {
                if let Some(n) = finish.text_len {
                    text.truncate(n);
                }
                text
            }
            Err(e) => {
                seq.request.fail(e.into());
                return;
            }
        };
        let completion = Completion {
            sample_index: seq.sample_index,
            tokens: seq.generated().to_vec(),
            logprobs: seq.logprobs,
            text,
            finish_reason: finish.reason,
            version: seq.version,
            switches: seq.switches,
            episode: seq.episode.map(|e| EpisodeTrace {
                observations: e.observations,
                turns: e.turns,
                reward: e.reward,
                failure,
            }),
        };
        self.counters().sequences.fetch_add(1, Ordering::Relaxed);
        self.flush_tokens();
        seq.request.send(Event::Finished { prompt: seq.prompt, completion });
    }

    fn flush_tokens(&mut self) {
        if self.unflushed_tokens > 0 {
            self.tokens_total.increment(std::mem::take(&mut self.unflushed_tokens));
        }
    }

    fn seq_done(&mut self, slot: usize) {
        let model = self.shared.current();
        model.model.free(&mut self.cache, slot);
    }

    /// Drops the sequence (or padding) in `slot` without a completion.
    fn release(&mut self, slot: usize) {
        let seq = self.slots[slot].take().is_some();
        let pad = self.padding[slot].take().is_some();
        if seq || pad {
            self.seq_done(slot);
        }
    }
}

/// The most tokens a response of a `prompt`-token prompt may have: `max_new_tokens`,
/// within what `max_seq_len` leaves (at least one).
fn budget(max_new_tokens: usize, prompt: usize, max_seq_len: usize) -> usize {
    max_new_tokens.min(max_seq_len.saturating_sub(prompt).max(1))
}

/// The draw of `slot`'s next token (its `k`-th token's uniform number, its context for
/// a repetition penalty), which the model makes where the logits are; `None` when the
/// slot holds no sequence (a padding row).
fn draw_of<M>(slots: &[Option<Seq<M>>], slot: usize) -> Option<Draw<'_>> {
    let seq = slots[slot].as_ref()?;
    Some(seq.request.sampling.draw(seq.rng.uniform(seq.sampled), &seq.context))
}
