//! Hand-made training batches: groups of token sequences laid out as the masking crate
//! would, without depending on it, for tests of whatever consumes a [`TrainBatch`]
//! (the model's packed forward, the trainer).

use metronome_core::{
    GroupKey, PackedRow, PeriodId, PolicyVersion, PromptId, Segment, TrainBatch, TrainGroup, TrainSequence,
};

/// Builds a [`TrainBatch`] group by group.
///
/// Every response token is a target predicted at the position before it: the last
/// prompt position predicts a response's first token. Each group gets the period,
/// version and behaviour log-prob set on the builder when it is added.
///
/// ```
/// use metronome_testkit::BatchBuilder;
///
/// let batch = BatchBuilder::new()
///     .shared_prompt(0, &[5, 6, 7], &[vec![8, 9], vec![10]], &[1.0, -1.0])
///     .separate_rows(1, &[5, 6], &[vec![11]], &[0.0])
///     .build();
/// assert_eq!(batch.rows.len(), 2);
/// assert_eq!(batch.rows[0].tokens, [5, 6, 7, 8, 9, 10]);
/// assert_eq!(batch.rows[0].positions, [0, 1, 2, 3, 4, 3]);
/// assert_eq!(batch.targets.position, [2, 3, 2, 1]);
/// ```
#[derive(Clone, Debug)]
pub struct BatchBuilder {
    batch: TrainBatch,
    period: PeriodId,
    version: PolicyVersion,
    behaviour_logprob: f32,
}

impl Default for BatchBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl BatchBuilder {
    /// An empty batch; groups of period 0 sampled by version 0, with a behaviour
    /// log-prob of −4.6 per token (about uniform over 100 tokens).
    #[must_use]
    pub fn new() -> Self {
        Self {
            batch: TrainBatch::default(),
            period: PeriodId(0),
            version: PolicyVersion(0),
            behaviour_logprob: -4.6,
        }
    }

    /// The period of the groups added next.
    #[must_use]
    pub fn period(mut self, period: PeriodId) -> Self {
        self.period = period;
        self
    }

    /// The version that sampled the groups added next.
    #[must_use]
    pub fn version(mut self, version: PolicyVersion) -> Self {
        self.version = version;
        self
    }

    /// The rollout log-prob recorded for every token of the groups added next.
    #[must_use]
    pub fn behaviour_logprob(mut self, logprob: f32) -> Self {
        self.behaviour_logprob = logprob;
        self
    }

    /// One group in the shared-prompt layout, in a row of its own: the prompt once
    /// (positions `0..P`), then each response as a child segment whose positions
    /// restart at `P`.
    #[must_use]
    pub fn shared_prompt<R: AsRef<[u32]>>(
        self,
        prompt_id: u64,
        prompt: &[u32],
        responses: &[R],
        advantages: &[f32],
    ) -> Self {
        self.group(prompt_id, prompt, responses, advantages, true)
    }

    /// One group as separate causal rows `[prompt + response]`, one per response (the
    /// padded baseline the shared-prompt layout is compared with).
    #[must_use]
    pub fn separate_rows<R: AsRef<[u32]>>(
        self,
        prompt_id: u64,
        prompt: &[u32],
        responses: &[R],
        advantages: &[f32],
    ) -> Self {
        self.group(prompt_id, prompt, responses, advantages, false)
    }

    /// The batch.
    ///
    /// # Panics
    /// When it breaks the layout contract ([`TrainBatch::validate`]), e.g. a group
    /// with an empty prompt or fewer advantages than responses.
    #[must_use]
    pub fn build(self) -> TrainBatch {
        if let Err(e) = self.batch.validate() {
            panic!("BatchBuilder made an invalid batch: {e}");
        }
        self.batch
    }

    /// Adds one group, in one shared row or one row per response.
    fn group<R: AsRef<[u32]>>(
        mut self,
        prompt_id: u64,
        prompt: &[u32],
        responses: &[R],
        advantages: &[f32],
        shared: bool,
    ) -> Self {
        assert_eq!(responses.len(), advantages.len(), "BatchBuilder: one advantage per response");
        let group = self.batch.groups.len() as u32;
        self.batch.groups.push(TrainGroup {
            key: GroupKey { period: self.period, prompt: PromptId(prompt_id) },
            num_sequences: responses.len() as u32,
            group_size: responses.len() as u32,
            all_equal: advantages.iter().all(|&a| a == 0.0),
            reward_mean: 0.5,
        });
        let p = prompt.len() as u32;
        let row = |tokens: Vec<u32>, positions| PackedRow {
            segments: vec![Segment { start: 0, len: tokens.len() as u32, parent: None }],
            tokens,
            positions,
        };
        let shared_index = self.batch.rows.len() as u32;
        let mut shared_row = shared.then(|| row(prompt.to_vec(), (0..p).collect()));
        for (i, (response, &advantage)) in responses.iter().zip(advantages).enumerate() {
            let response = response.as_ref();
            let len = response.len() as u32;
            // The row of the response and where it starts in it.
            let (row_index, start) = match &mut shared_row {
                Some(r) => {
                    let start = r.tokens.len() as u32;
                    r.tokens.extend_from_slice(response);
                    r.positions.extend((0..len).map(|j| p + j));
                    r.segments.push(Segment { start, len, parent: Some(0) });
                    (shared_index, start)
                }
                None => {
                    self.batch.rows.push(row([prompt, response].concat(), (0..p + len).collect()));
                    (self.batch.rows.len() as u32 - 1, p)
                }
            };
            // The last prompt position predicts the first token, then each token the next.
            let predicted_at = (0..len).map(|j| if j == 0 { p - 1 } else { start + j - 1 });
            self.push_sequence(group, i as u32, row_index, predicted_at, response, advantage);
        }
        self.batch.rows.extend(shared_row);
        self
    }

    /// Adds one response's sequence record and its targets.
    fn push_sequence(
        &mut self,
        group: u32,
        sample_index: u32,
        row: u32,
        predicted_at: impl Iterator<Item = u32>,
        response: &[u32],
        advantage: f32,
    ) {
        let sequence = self.batch.sequences.len() as u32;
        self.batch.sequences.push(TrainSequence {
            group,
            sample_index,
            version: self.version,
            advantage,
            num_targets: response.len() as u32,
        });
        let t = &mut self.batch.targets;
        for (position, &token) in predicted_at.zip(response) {
            t.row.push(row);
            t.position.push(position);
            t.token.push(token);
            t.sequence.push(sequence);
            t.advantage.push(advantage);
            t.behaviour_logprob.push(self.behaviour_logprob);
        }
    }
}
