//! Multi-turn episodes: observations appended to the slot's KV cache, trajectories
//! independent of the worker/slot layout, and failing tools that end their episode,
//! never the run.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use metronome_core::{ChatMessage, Environment, Episode, Group, Observation, PeriodId, Prompt, Tokenizer};
use metronome_model::KvCache;
use metronome_rollout::{Episodes, SamplingConfig, Submission};

use crate::common::{engine, prompts, sampling, signature, tiny_model, tokenizer};

/// Answers turn `k` with `<obs k>` (or a panic, a hang or an error at turn `fail_at`),
/// and ends the episode after `done_after` turns with the reward `turns`.
#[derive(Clone, Copy)]
struct Scripted {
    done_after: u32,
    fail_at: Option<(u32, Failure)>,
}

#[derive(Clone, Copy)]
enum Failure {
    Panic,
    Hang,
    Error,
}

struct ScriptedEpisode {
    env: Scripted,
    turns: u32,
}

#[async_trait]
impl Episode for ScriptedEpisode {
    async fn step(&mut self, _turn: &str) -> metronome_core::Result<Observation> {
        self.turns += 1;
        if let Some((at, failure)) = self.env.fail_at
            && at == self.turns
        {
            match failure {
                Failure::Panic => panic!("the tool fell over"),
                Failure::Hang => std::thread::sleep(Duration::from_secs(5)),
                Failure::Error => return Err(metronome_core::Error::invalid("tool", "refused")),
            }
        }
        if self.turns >= self.env.done_after {
            return Ok(Observation::done(Some(self.turns as f32)));
        }
        let message = ChatMessage::new("tool", self.turns.to_string());
        Ok(Observation::reply(format!("<obs {}>", self.turns)).with_message(message))
    }
}

impl Environment for Scripted {
    fn start(&self, _prompt: &Prompt, _sample_index: u32) -> metronome_core::Result<Box<dyn Episode>> {
        Ok(Box::new(ScriptedEpisode { env: *self, turns: 0 }))
    }
}

fn episodes(env: Scripted, max_turns: u32) -> Episodes {
    Episodes {
        environment: Arc::new(env),
        max_turns,
        tool_time_limit: Duration::from_millis(200),
        max_running_calls: 64,
        chat_template: false,
    }
}

/// Short turns: a few common token ids end a turn.
fn turn_sampling(max_new_tokens: usize) -> SamplingConfig {
    let mut s = sampling(max_new_tokens);
    s.stop_token_ids = Some(TURN_ENDS.to_vec());
    s
}

const TURN_ENDS: [u32; 10] = [2, 4, 33, 40, 50, 60, 70, 80, 90, 100];

async fn run(workers: usize, slots: usize, s: SamplingConfig, ep: Episodes) -> Vec<Group> {
    run_on(&engine(workers, slots, s), ep).await
}

/// Episodes of 5 prompts x 4 responses on `e`.
async fn run_on(e: &metronome_rollout::ModelEngine, ep: Episodes) -> Vec<Group> {
    let sub = Submission {
        period: PeriodId(1),
        prompts: prompts(5),
        group_size: 4,
        sampling: e.config().sampling.clone(),
        seed: e.seed(),
    };
    let sink = metronome_rollout::CollectSink::default();
    e.submit_episodes(sub, ep, &sink).await.expect("generate");
    sink.into_groups()
}

fn traces(groups: &[Group]) -> Vec<(u64, u32, Option<metronome_core::EpisodeTrace>)> {
    let mut t: Vec<_> = groups
        .iter()
        .flat_map(|g| g.completions.iter().map(|c| (g.prompt.id.0, c.sample_index, c.episode.clone())))
        .collect();
    t.sort_by_key(|x| (x.0, x.1));
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trajectories_do_not_depend_on_the_worker_or_slot_layout() {
    let ep = || episodes(Scripted { done_after: 3, fail_at: None }, 4);
    let one = run(1, 1, turn_sampling(48), ep()).await;
    let eight = run(1, 8, turn_sampling(48), ep()).await;
    let two_by_three = run(2, 3, turn_sampling(48), ep()).await;
    assert_eq!(signature(&one), signature(&eight), "1x1 vs 1x8");
    assert_eq!(signature(&one), signature(&two_by_three), "1x1 vs 2x3");
    assert_eq!(traces(&one), traces(&eight));
    assert_eq!(traces(&one), traces(&two_by_three));
    let multi = traces(&one).iter().filter(|t| t.2.as_ref().is_some_and(|e| e.turns > 1)).count();
    assert!(multi >= 8, "only {multi} of 20 episodes took several turns");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observations_are_in_the_trajectory_and_marked() {
    let groups = run(1, 4, turn_sampling(48), episodes(Scripted { done_after: 3, fail_at: None }, 4)).await;
    let tok = tokenizer();
    for g in &groups {
        g.validate().unwrap();
        for c in &g.completions {
            let e = c.episode.as_ref().expect("every response is an episode");
            assert!(e.turns <= 3, "{e:?}");
            for (k, span) in e.observations.iter().enumerate() {
                let obs = &c.tokens[span.start as usize..span.end() as usize];
                assert_eq!(tok.decode(obs).unwrap(), format!("<obs {}>", k + 1));
                assert!(c.logprobs[span.start as usize..span.end() as usize].iter().all(|&l| l == 0.0));
                // The token before an observation ended the policy's turn.
                assert!(TURN_ENDS.contains(&c.tokens[span.start as usize - 1]));
            }
            match &e.failure {
                None => {
                    assert_eq!(e.turns, 3);
                    assert_eq!(e.reward, Some(3.0));
                    assert_eq!(e.observations.len(), 2);
                }
                Some(f) => assert_eq!(f, "max_tokens", "{e:?}"),
            }
            assert!(c.num_policy_tokens() + e.observation_tokens() == c.tokens.len());
            assert!(c.tokens.len() <= 48);
        }
    }
}

/// The character tokenizer with a chat template that writes each message as
/// `[role]\ncontent[end]\n`.
struct Chat;

impl Tokenizer for Chat {
    fn encode(&self, text: &str) -> metronome_core::Result<Vec<u32>> {
        tokenizer().encode(text)
    }
    fn decode(&self, tokens: &[u32]) -> metronome_core::Result<String> {
        tokenizer().decode(tokens)
    }
    fn vocab_size(&self) -> usize {
        tokenizer().vocab_size()
    }
    fn stop_token_ids(&self) -> Vec<u32> {
        tokenizer().stop_token_ids()
    }
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        generation: bool,
    ) -> metronome_core::Result<String> {
        let mut out: String =
            messages.iter().map(|m| format!("[{}]\n{}[end]\n", m.role, m.content)).collect();
        if generation {
            out.push_str("[assistant]\n");
        }
        Ok(out)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_chat_run_observations_are_tool_messages_as_the_template_writes_them() {
    let config = metronome_rollout::EngineConfig {
        max_num_seqs: 4,
        max_seq_len: 128,
        sampling: turn_sampling(64),
        ..metronome_rollout::EngineConfig::default()
    };
    let e = metronome_rollout::model_engine(
        tiny_model(7),
        metronome_core::PolicyVersion(0),
        std::sync::Arc::new(Chat),
        config,
        metronome_core::RunSeed(42),
    )
    .unwrap();
    let ep = Episodes { chat_template: true, ..episodes(Scripted { done_after: 3, fail_at: None }, 4) };
    let mut seen = 0;
    for c in run_on(&e, ep).await.iter().flat_map(|g| g.completions.clone()) {
        let e = c.episode.as_ref().unwrap();
        for (k, span) in e.observations.iter().enumerate() {
            let obs = &c.tokens[span.start as usize..span.end() as usize];
            // The assistant's message closes, the tool's follows, the assistant's opens.
            assert_eq!(
                tokenizer().decode(obs).unwrap(),
                format!("[end]\n[tool]\n{}[end]\n[assistant]\n", k + 1)
            );
            seen += 1;
        }
    }
    assert!(seen >= 3, "only {seen} observations");
}

/// Every policy token's recorded log-prob equals the one a fresh prefill of the whole
/// trajectory so far gives: appending observations to the KV cache is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appending_observations_to_the_cache_equals_a_fresh_prefill() {
    let groups = run(1, 2, turn_sampling(40), episodes(Scripted { done_after: 4, fail_at: None }, 4)).await;
    let model = tiny_model(7);
    let mut checked = 0;
    for g in groups.iter().take(2) {
        for c in
            g.completions.iter().filter(|c| c.episode.as_ref().is_some_and(|e| !e.observations.is_empty()))
        {
            let mask = c.policy_mask();
            let first_obs = mask.iter().position(|p| !p).unwrap();
            // Policy tokens after the first observation.
            for j in (first_obs..c.tokens.len()).filter(|&j| mask[j]) {
                let mut cache = KvCache::new(&model, 1, 128).unwrap();
                let context: Vec<u32> = g.prompt.tokens.iter().chain(&c.tokens[..j]).copied().collect();
                let logits = model.prefill(&mut cache, 0, &context).unwrap();
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
                let fresh = logits[c.tokens[j] as usize] - lse;
                assert!(
                    (fresh - c.logprobs[j]).abs() < 1e-4,
                    "token {j}: fresh {fresh} vs {}",
                    c.logprobs[j]
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_tools_and_limits_end_the_episode_not_the_run() {
    for (failure, expected) in [
        (Failure::Panic, "tool_panic: the tool fell over"),
        (Failure::Hang, "tool_timeout"),
        (Failure::Error, "tool_error"),
    ] {
        let hang = matches!(failure, Failure::Hang);
        let mut setup = episodes(Scripted { done_after: 5, fail_at: Some((2, failure)) }, 5);
        if !hang {
            // Only the hang must outlast the limit: a panic's backtrace alone can take
            // longer than 200 ms on a loaded machine, and would read as a timeout.
            setup.tool_time_limit = Duration::from_secs(60);
        }
        let groups = run(2, 3, turn_sampling(64), setup).await;
        assert_eq!(groups.len(), 5);
        let failed: Vec<_> = groups
            .iter()
            .flat_map(|g| &g.completions)
            .filter_map(|c| c.episode.as_ref()?.failure.clone())
            .filter(|f| f != "max_tokens")
            .collect();
        assert!(!failed.is_empty());
        assert!(failed.iter().all(|f| f.starts_with(expected)), "{failed:?}");
    }
    // One turn allowed: the environment answers but is not let go on.
    let groups = run(1, 4, turn_sampling(64), episodes(Scripted { done_after: 5, fail_at: None }, 1)).await;
    for c in groups.iter().flat_map(|g| &g.completions) {
        let e = c.episode.as_ref().unwrap();
        assert_eq!(e.turns, 1);
        assert!(e.observations.is_empty());
        assert!(matches!(e.failure.as_deref(), Some("max_turns" | "max_tokens")), "{e:?}");
    }
}

/// A tool that never returns: its threads cannot be killed, so past the bound its
/// episodes are refused a call instead of costing a thread each.
struct Stuck;

struct StuckEpisode;

#[async_trait]
impl Episode for StuckEpisode {
    async fn step(&mut self, _turn: &str) -> metronome_core::Result<Observation> {
        // Parks this call's thread for good (the test process ends it).
        let (_keep, never) = std::sync::mpsc::channel::<()>();
        let _ = never.recv();
        unreachable!("the sender is alive")
    }
}

impl Environment for Stuck {
    fn start(&self, _prompt: &Prompt, _sample_index: u32) -> metronome_core::Result<Box<dyn Episode>> {
        Ok(Box::new(StuckEpisode))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_that_never_returns_costs_a_bounded_number_of_threads() {
    let ep = Episodes {
        environment: Arc::new(Stuck),
        max_turns: 4,
        tool_time_limit: Duration::from_millis(20),
        max_running_calls: 2,
        chat_template: false,
    };
    let groups = run(1, 4, turn_sampling(64), ep).await;
    let failures: Vec<String> = groups
        .iter()
        .flat_map(|g| &g.completions)
        .filter_map(|c| c.episode.as_ref()?.failure.clone())
        .collect();
    let timeouts = failures.iter().filter(|f| *f == "tool_timeout").count();
    let refused = failures.iter().filter(|f| f.starts_with("tool_unavailable: 2 environment calls")).count();
    // Two calls hang for good; every later one is refused at once.
    assert_eq!(timeouts, 2, "{failures:?}");
    assert!(refused > 0 && timeouts + refused + failures.iter().filter(|f| *f == "max_tokens").count() == 20);
}

#[test]
fn zero_limits_are_refused() {
    let e = engine(1, 1, sampling(8));
    let bad = Episodes { max_turns: 0, ..episodes(Scripted { done_after: 1, fail_at: None }, 1) };
    let err = e.with_episodes(bad).unwrap_err().to_string();
    assert!(err.contains("max_turns"), "{err}");
}
