//! From an agent's recorded calls to the completions a group trains on.
//!
//! Agents re-send the whole conversation on every call. A call whose rendered
//! prompt extends the trajectory so far (the previous calls' prompts and sampled
//! tokens) token for token continues it: the new prompt tokens are context, the
//! sampled ones policy targets. A call that does not (the agent summarised,
//! truncated or edited its history, or the template wrote a sampled turn back
//! differently) starts a new trajectory; an episode's trajectories share its reward.
//!
//! A group's completions share one prompt: the longest prefix every trajectory's
//! first prompt has in common. What each first prompt holds beyond it is context of
//! that completion.

use metronome_core::{
    Completion, EpisodeTrace, FinishReason, Group, GroupTiming, PeriodId, PolicyVersion, Prompt, TokenId,
    TokenSpan, VersionSwitch,
};

/// One chat call of an episode as the proxy recorded it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecordedCall {
    /// The rendered prompt's token ids.
    pub prompt: Vec<TokenId>,
    /// The sampled token ids.
    pub tokens: Vec<TokenId>,
    /// Their behaviour log-probs.
    pub logprobs: Vec<f32>,
    /// The weights that sampled them.
    pub version: PolicyVersion,
    /// Why sampling ended.
    pub finish_reason: FinishReason,
}

/// A trajectory: context and policy tokens interleaved, from the first prompt on.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trajectory {
    /// Every token, the first prompt's included.
    pub tokens: Vec<TokenId>,
    /// Log-probs aligned with `tokens` (0 for context).
    pub logprobs: Vec<f32>,
    /// The context spans (the first prompt is the first), in order.
    pub context: Vec<TokenSpan>,
    /// The calls it joins.
    pub calls: u32,
    /// Each call's version, and where in `tokens` its sampled tokens begin.
    pub versions: Vec<(usize, PolicyVersion)>,
    /// The last call's finish reason.
    pub finish_reason: FinishReason,
}

impl Trajectory {
    /// Where its first sampled token is: the length of its first prompt.
    #[must_use]
    pub fn first_prompt_len(&self) -> usize {
        self.context.first().map_or(0, |s| s.len as usize)
    }

    fn start(call: &RecordedCall) -> Self {
        let mut t = Self::default();
        t.push_context(&call.prompt);
        t.push_policy(call);
        t
    }

    fn push_context(&mut self, tokens: &[TokenId]) {
        if tokens.is_empty() {
            return;
        }
        self.context.push(TokenSpan { start: self.tokens.len() as u32, len: tokens.len() as u32 });
        self.tokens.extend_from_slice(tokens);
        self.logprobs.resize(self.tokens.len(), 0.0);
    }

    fn push_policy(&mut self, call: &RecordedCall) {
        self.versions.push((self.tokens.len(), call.version));
        self.tokens.extend_from_slice(&call.tokens);
        self.logprobs.extend_from_slice(&call.logprobs);
        self.calls += 1;
        self.finish_reason = call.finish_reason;
    }
}

/// An episode's calls as trajectories: joined while each prompt extends the
/// trajectory so far, split where one does not.
#[must_use]
pub fn trajectories(calls: &[RecordedCall]) -> Vec<Trajectory> {
    let mut out: Vec<Trajectory> = Vec::new();
    for call in calls {
        match out.last_mut() {
            Some(t) if call.prompt.starts_with(&t.tokens) => {
                let new = call.prompt[t.tokens.len()..].to_vec();
                t.push_context(&new);
                t.push_policy(call);
            }
            _ => out.push(Trajectory::start(call)),
        }
    }
    out
}

/// How one episode ended, for its trajectories' traces.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpisodeEnd {
    /// The reward its trajectories share; `None` defers to the reward stage.
    pub reward: Option<f32>,
    /// Why it failed, when it did.
    pub failure: Option<String>,
    /// The text the reward stage scores: the last call's sampled text.
    pub answer: String,
}

/// The group of `prompt` from its episodes' trajectories (each with how its episode
/// ended): the shared prompt is their first prompts' longest common prefix, kept
/// within every first prompt so that no sampled token is in it. `None` when there
/// is no trajectory or the first prompts share no token.
#[must_use]
pub fn group(
    period: PeriodId,
    prompt: &Prompt,
    trajectories: &[(Trajectory, &EpisodeEnd)],
    tokenizer: &dyn metronome_core::Tokenizer,
) -> Option<Group> {
    let (first, _) = trajectories.first()?;
    let mut shared = first.first_prompt_len();
    for (t, _) in trajectories {
        let common = first.tokens.iter().zip(&t.tokens).take_while(|(a, b)| a == b).count();
        shared = shared.min(common).min(t.first_prompt_len());
    }
    if shared == 0 {
        return None;
    }
    let completions =
        trajectories.iter().enumerate().map(|(i, (t, end))| completion(i as u32, t, shared, end)).collect();
    let tokens = first.tokens[..shared].to_vec();
    let text = tokenizer.decode(&tokens).unwrap_or_default();
    Some(Group {
        period,
        prompt: Prompt { tokens, text, ..prompt.clone() },
        completions,
        timing: GroupTiming::default(),
    })
}

/// Trajectory `t` as completion `sample_index` after the group's `shared` prompt
/// tokens.
fn completion(sample_index: u32, t: &Trajectory, shared: usize, end: &EpisodeEnd) -> Completion {
    let observations = t
        .context
        .iter()
        .filter_map(|s| {
            let start = (s.start as usize).max(shared);
            let stop = s.end() as usize;
            (stop > start).then(|| TokenSpan { start: (start - shared) as u32, len: (stop - start) as u32 })
        })
        .collect();
    let version = t.versions.first().map_or(PolicyVersion(0), |v| v.1);
    let mut switches = Vec::new();
    let mut newest = version;
    for &(at, v) in &t.versions {
        if v > newest {
            switches.push(VersionSwitch { at: (at - shared) as u32, version: v });
            newest = v;
        }
    }
    Completion {
        sample_index,
        tokens: t.tokens[shared..].to_vec(),
        logprobs: t.logprobs[shared..].to_vec(),
        text: end.answer.clone(),
        finish_reason: t.finish_reason,
        version,
        switches,
        episode: Some(EpisodeTrace {
            observations,
            turns: t.calls,
            reward: end.reward,
            failure: end.failure.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(prompt: &[u32], tokens: &[u32], version: u64) -> RecordedCall {
        RecordedCall {
            prompt: prompt.to_vec(),
            tokens: tokens.to_vec(),
            logprobs: tokens.iter().map(|&t| -(t as f32) / 10.0).collect(),
            version: PolicyVersion(version),
            finish_reason: FinishReason::Stop,
        }
    }

    #[test]
    fn a_resent_history_joins_one_trajectory() {
        // Prompt [1 2], sampled [3 4]; the agent re-sends [1 2 3 4] with a tool
        // result [5], and the policy answers [6].
        let calls = [call(&[1, 2], &[3, 4], 0), call(&[1, 2, 3, 4, 5], &[6], 0)];
        let t = trajectories(&calls);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].tokens, [1, 2, 3, 4, 5, 6]);
        assert_eq!(t[0].context, [TokenSpan { start: 0, len: 2 }, TokenSpan { start: 4, len: 1 }]);
        assert_eq!(t[0].logprobs, [0.0, 0.0, -0.3, -0.4, 0.0, -0.6]);
        assert_eq!(t[0].calls, 2);
    }

    #[test]
    fn a_rewritten_history_splits_the_episode() {
        // The second call drops the sampled turn (a summary): a new trajectory.
        let calls = [call(&[1, 2], &[3, 4], 0), call(&[1, 2, 9], &[6], 1), call(&[1, 2, 9, 6, 7], &[8], 1)];
        let t = trajectories(&calls);
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].tokens, [1, 2, 3, 4]);
        assert_eq!(t[1].tokens, [1, 2, 9, 6, 7, 8]);
        assert_eq!(t[1].calls, 2);
    }

    #[test]
    fn a_group_shares_its_trajectories_common_prompt() {
        let end = EpisodeEnd { reward: Some(1.0), failure: None, answer: "8".into() };
        let a = trajectories(&[call(&[1, 2, 3], &[4], 0), call(&[1, 2, 3, 4, 5], &[6], 1)]);
        let b = trajectories(&[call(&[1, 2, 7], &[8], 0)]);
        let all: Vec<_> = a.into_iter().chain(b).map(|t| (t, &end)).collect();
        let prompt = Prompt { id: metronome_core::PromptId(5), ..Prompt::default() };
        let g = group(PeriodId(1), &prompt, &all, &metronome_model::CharTokenizer).unwrap();
        g.validate().unwrap();
        assert_eq!(g.prompt.tokens, [1, 2]);
        assert_eq!(g.prompt.id, prompt.id);
        let c = &g.completions;
        assert_eq!(c[0].tokens, [3, 4, 5, 6]);
        let trace = c[0].episode.as_ref().unwrap();
        assert_eq!(trace.observations, [TokenSpan { start: 0, len: 1 }, TokenSpan { start: 2, len: 1 }]);
        assert_eq!(c[0].switches, [VersionSwitch { at: 3, version: PolicyVersion(1) }]);
        c[0].check_switches().unwrap();
        assert_eq!(c[1].tokens, [7, 8]);
        assert_eq!(c[1].sample_index, 1);
        assert_eq!(c[1].num_policy_tokens(), 1);
        assert_eq!(c[1].episode.as_ref().unwrap().reward, Some(1.0));
        // First prompts that share nothing make no group.
        let x = trajectories(&[call(&[9], &[1], 0)]);
        let none: Vec<_> = all.iter().take(1).cloned().chain(x.into_iter().map(|t| (t, &end))).collect();
        assert!(group(PeriodId(1), &prompt, &none, &metronome_model::CharTokenizer).is_none());
    }
}
