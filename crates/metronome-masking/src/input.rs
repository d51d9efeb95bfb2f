//! Validation of the scored groups a layout is built from.

use metronome_core::ScoredGroup;

use crate::{MaskingError, Result};

/// Checks everything a layout relies on, before anything is laid out, so that a bad
/// group is rejected whole and never half-packed.
pub(crate) fn check_group(g: &ScoredGroup) -> Result<()> {
    let group = g.key();
    if g.group.prompt.tokens.is_empty() {
        return Err(MaskingError::EmptyPrompt { group });
    }
    let completions = g.group.completions.len();
    if completions == 0 {
        return Err(MaskingError::NoCompletions { group });
    }
    for (field, found) in [("rewards", g.rewards.len()), ("advantages", g.advantages.len())] {
        if found != completions {
            return Err(MaskingError::ScoreMismatch { group, field, found, completions });
        }
    }
    for (sample, c) in g.group.completions.iter().enumerate() {
        if c.sample_index as usize != sample {
            return Err(MaskingError::SampleIndex { group, sample, found: c.sample_index });
        }
        if c.tokens.is_empty() {
            return Err(MaskingError::EmptyResponse { group, sample });
        }
        if let Some(trace) = &c.episode {
            trace.check_spans(c.tokens.len()).map_err(|reason| MaskingError::Episode {
                group,
                sample,
                reason,
            })?;
            if c.num_policy_tokens() == 0 {
                return Err(MaskingError::Episode {
                    group,
                    sample,
                    reason: "has only observation tokens, nothing the policy sampled".into(),
                });
            }
        }
        if c.logprobs.len() != c.tokens.len() {
            return Err(MaskingError::LogprobMismatch {
                group,
                sample,
                tokens: c.tokens.len(),
                logprobs: c.logprobs.len(),
            });
        }
    }
    Ok(())
}
