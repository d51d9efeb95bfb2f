//! The scored-group format (`MTRG`): hand-laid binary, token ids and log-probs as
//! packed little-endian arrays, text length-prefixed; version 2 appends each
//! completion's episode, version 3 each completion's version switches.

use std::collections::BTreeMap;

use metronome_core::{
    Completion, EpisodeTrace, FinishReason, Group, GroupStats, GroupTiming, PeriodId, PolicyVersion, Prompt,
    PromptId, Reward, ScoredGroup, TokenSpan, VersionSwitch,
};

use super::framing::{Reader, Writer};
use super::{GROUP_FORMAT_VERSION, GROUP_MAGIC};
use crate::{Error, Result};

/// Encodes a scored group. The group is validated first, so that a broken group is
/// refused at the sender rather than at the trainer.
pub fn encode_group(scored: &ScoredGroup) -> Result<Vec<u8>> {
    validate_scored(scored)?;
    let group = &scored.group;
    let approx = 256
        + group.prompt.text.len()
        + group.prompt.tokens.len() * 4
        + group.completions.iter().map(|c| 64 + c.text.len() + c.tokens.len() * 8).sum::<usize>()
        + scored.rewards.len() * 32;
    let mut w = Writer::new(GROUP_MAGIC, GROUP_FORMAT_VERSION, approx, "group");
    w.u64(group.period.0);
    w.u64(group.prompt.id.0);
    w.str(&group.prompt.text, "prompt.text")?;
    w.packed(&group.prompt.tokens, "prompt.tokens")?;
    match &group.prompt.reference {
        None => w.u8(0),
        Some(r) => {
            w.u8(1);
            w.str(r, "prompt.reference")?;
        }
    }
    w.len32(group.prompt.metadata.len(), "prompt.metadata")?;
    for (k, v) in &group.prompt.metadata {
        w.str(k, "prompt.metadata key")?;
        w.str(v, "prompt.metadata value")?;
    }
    w.f64(group.timing.started_s);
    w.f64(group.timing.finished_s);
    w.len32(group.completions.len(), "completions")?;
    for c in &group.completions {
        w.u32(c.sample_index);
        w.u8(finish_reason_code(c.finish_reason));
        w.u64(c.version.0);
        w.str(&c.text, "completion.text")?;
        w.packed(&c.tokens, "completion.tokens")?;
        w.packed(&c.logprobs, "completion.logprobs")?;
    }
    w.len32(scored.rewards.len(), "rewards")?;
    for r in &scored.rewards {
        w.f32(r.total);
        w.len32(r.parts.len(), "reward.parts")?;
        for (k, v) in &r.parts {
            w.str(k, "reward.parts key")?;
            w.f32(*v);
        }
        match &r.failure {
            None => w.u8(0),
            Some(f) => {
                w.u8(1);
                w.str(f, "reward.failure")?;
            }
        }
    }
    w.packed(&scored.advantages, "advantages")?;
    w.f32(scored.stats.mean);
    w.f32(scored.stats.std);
    w.u8(u8::from(scored.stats.all_equal));
    for c in &group.completions {
        write_episode(&mut w, c.episode.as_ref())?;
    }
    for c in &group.completions {
        write_switches(&mut w, &c.switches)?;
    }
    Ok(w.finish())
}

/// Decodes a scored group written by [`encode_group`] and checks its invariants.
pub fn decode_group(bytes: &[u8]) -> Result<ScoredGroup> {
    let mut r = Reader::open(bytes, "group", GROUP_MAGIC, GROUP_FORMAT_VERSION)?;
    let period = PeriodId(r.u64("period")?);
    let id = PromptId(r.u64("prompt.id")?);
    let text = r.str("prompt.text")?;
    let tokens = r.packed("prompt.tokens")?;
    let reference = match r.u8("prompt.reference tag")? {
        0 => None,
        1 => Some(r.str("prompt.reference")?),
        t => return Err(r.malformed("prompt.reference tag", format!("unknown tag {t}"))),
    };
    let n = r.count("prompt.metadata", 8)?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n {
        let k = r.str("prompt.metadata key")?;
        let v = r.str("prompt.metadata value")?;
        metadata.insert(k, v);
    }
    let timing =
        GroupTiming { started_s: r.f64("timing.started_s")?, finished_s: r.f64("timing.finished_s")? };
    let n = r.count("completions", 25)?;
    let mut completions = Vec::with_capacity(n);
    for _ in 0..n {
        let sample_index = r.u32("completion.sample_index")?;
        let finish_reason = match r.u8("completion.finish_reason")? {
            0 => FinishReason::Stop,
            1 => FinishReason::StopString,
            2 => FinishReason::Length,
            3 => FinishReason::Aborted,
            4 => FinishReason::PromptRejected,
            t => return Err(r.malformed("completion.finish_reason", format!("unknown code {t}"))),
        };
        let version = PolicyVersion(r.u64("completion.version")?);
        let text = r.str("completion.text")?;
        let tokens = r.packed("completion.tokens")?;
        let logprobs = r.packed("completion.logprobs")?;
        completions.push(Completion {
            sample_index,
            tokens,
            logprobs,
            text,
            finish_reason,
            version,
            switches: Vec::new(),
            episode: None,
        });
    }
    let n = r.count("rewards", 9)?;
    let mut rewards = Vec::with_capacity(n);
    for _ in 0..n {
        let total = r.f32("reward.total")?;
        let parts_n = r.count("reward.parts", 8)?;
        let mut parts = BTreeMap::new();
        for _ in 0..parts_n {
            let k = r.str("reward.parts key")?;
            let v = r.f32("reward.parts value")?;
            parts.insert(k, v);
        }
        let failure = match r.u8("reward.failure tag")? {
            0 => None,
            1 => Some(r.str("reward.failure")?),
            t => return Err(r.malformed("reward.failure tag", format!("unknown tag {t}"))),
        };
        rewards.push(Reward { total, parts, failure });
    }
    let advantages = r.packed("advantages")?;
    let stats = GroupStats {
        mean: r.f32("stats.mean")?,
        std: r.f32("stats.std")?,
        all_equal: match r.u8("stats.all_equal")? {
            0 => false,
            1 => true,
            t => return Err(r.malformed("stats.all_equal", format!("not a boolean: {t}"))),
        },
    };
    if r.version >= 2 {
        for c in &mut completions {
            c.episode = read_episode(&mut r)?;
        }
    }
    if r.version >= 3 {
        for c in &mut completions {
            c.switches = read_switches(&mut r)?;
        }
    }
    r.finish()?;
    let scored = ScoredGroup {
        group: Group {
            period,
            prompt: Prompt { id, text, tokens, reference, metadata },
            completions,
            timing,
        },
        rewards,
        advantages,
        stats,
    };
    validate_scored(&scored)?;
    Ok(scored)
}

/// A completion's version switches: a count, then per switch the token index (`u32`)
/// and the version (`u64`).
fn write_switches(w: &mut Writer, switches: &[VersionSwitch]) -> Result<()> {
    w.len32(switches.len(), "completion.switches")?;
    for s in switches {
        w.u32(s.at);
        w.u64(s.version.0);
    }
    Ok(())
}

fn read_switches(r: &mut Reader<'_>) -> Result<Vec<VersionSwitch>> {
    let n = r.count("completion.switches", 12)?;
    let mut switches = Vec::with_capacity(n);
    for _ in 0..n {
        let at = r.u32("completion.switches.at")?;
        let version = PolicyVersion(r.u64("completion.switches.version")?);
        switches.push(VersionSwitch { at, version });
    }
    Ok(switches)
}

/// A completion's episode: a tag (0 none, 1 some), then the observation spans as a
/// packed `u32` array of `start, len` pairs, the turns, the reward (tag and `f32`)
/// and the failure (tag and string).
fn write_episode(w: &mut Writer, episode: Option<&EpisodeTrace>) -> Result<()> {
    let Some(e) = episode else {
        w.u8(0);
        return Ok(());
    };
    w.u8(1);
    let spans: Vec<u32> = e.observations.iter().flat_map(|s| [s.start, s.len]).collect();
    w.packed(&spans, "episode.observations")?;
    w.u32(e.turns);
    match e.reward {
        None => w.u8(0),
        Some(r) => {
            w.u8(1);
            w.f32(r);
        }
    }
    match &e.failure {
        None => w.u8(0),
        Some(f) => {
            w.u8(1);
            w.str(f, "episode.failure")?;
        }
    }
    Ok(())
}

fn read_episode(r: &mut Reader<'_>) -> Result<Option<EpisodeTrace>> {
    match r.u8("episode tag")? {
        0 => return Ok(None),
        1 => {}
        t => return Err(r.malformed("episode tag", format!("unknown tag {t}"))),
    }
    let spans: Vec<u32> = r.packed("episode.observations")?;
    if !spans.len().is_multiple_of(2) {
        return Err(
            r.malformed("episode.observations", format!("{} numbers, not start/len pairs", spans.len()))
        );
    }
    let observations = spans.chunks_exact(2).map(|p| TokenSpan { start: p[0], len: p[1] }).collect();
    let turns = r.u32("episode.turns")?;
    let reward = match r.u8("episode.reward tag")? {
        0 => None,
        1 => Some(r.f32("episode.reward")?),
        t => return Err(r.malformed("episode.reward tag", format!("unknown tag {t}"))),
    };
    let failure = match r.u8("episode.failure tag")? {
        0 => None,
        1 => Some(r.str("episode.failure")?),
        t => return Err(r.malformed("episode.failure tag", format!("unknown tag {t}"))),
    };
    Ok(Some(EpisodeTrace { observations, turns, reward, failure }))
}

fn validate_scored(scored: &ScoredGroup) -> Result<()> {
    let key = scored.key();
    scored.group.validate().map_err(|e| Error::Malformed {
        kind: "group",
        field: "completions".into(),
        reason: e.to_string(),
    })?;
    let n = scored.group.completions.len();
    if scored.rewards.len() != n || scored.advantages.len() != n {
        return Err(Error::Malformed {
            kind: "group",
            field: "rewards".into(),
            reason: format!(
                "group {key} has {} rewards and {} advantages for {n} completions",
                scored.rewards.len(),
                scored.advantages.len()
            ),
        });
    }
    Ok(())
}

fn finish_reason_code(reason: FinishReason) -> u8 {
    match reason {
        FinishReason::Stop => 0,
        FinishReason::StopString => 1,
        FinishReason::Length => 2,
        FinishReason::Aborted => 3,
        FinishReason::PromptRejected => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_testkit::data::scored_group;

    #[test]
    fn group_round_trips_bit_exactly() {
        let g = scored_group(3, 7, 4, 33);
        let bytes = encode_group(&g).unwrap();
        assert_eq!(&bytes[..4], b"MTRG");
        assert_eq!(decode_group(&bytes).unwrap(), g);
    }

    #[test]
    fn group_encoding_is_compact() {
        // 4 responses of 256 tokens: ids and log-probs take 8 bytes per token packed;
        // JSON would take several times that.
        let g = scored_group(0, 1, 4, 256);
        let bytes = encode_group(&g).unwrap();
        let payload = 4 * 256 * 8;
        assert!(bytes.len() < payload + 2048, "{} bytes for {payload} bytes of arrays", bytes.len());
    }

    #[test]
    fn a_broken_group_is_refused_by_the_writer() {
        let mut g = scored_group(0, 1, 2, 3);
        g.group.completions[1].logprobs.pop();
        assert!(matches!(encode_group(&g), Err(Error::Malformed { .. })));
        let mut g = scored_group(0, 1, 2, 3);
        g.advantages.pop();
        assert!(matches!(encode_group(&g), Err(Error::Malformed { .. })));
    }
}
