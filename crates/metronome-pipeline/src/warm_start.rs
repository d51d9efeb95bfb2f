//! The supervised warm start before RL: `sft.steps` steps of cross-entropy on the
//! training task's reference answers, or, with `[env]`, on prompts shown solved with
//! the environment's tools (`sft.tool_demonstrations`), so that RL has tool use to
//! reinforce.

use std::path::PathBuf;
use std::sync::Arc;

use metronome_core::{Environment, Prompt, PromptSource, RunSeed, TokenSpan, Tokenizer};
use metronome_model::Model;
use metronome_trainer::{GrpoTrainer, SftExample};

use crate::checkpoint::{Checkpointer, Checkpointing};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::events::{Event, Observer};

/// Supervised warm start: `sft.steps` steps of cross-entropy on reference answers,
/// each reported to `observer` (of adapters only with `trainer.lora`, merged into the
/// model it returns).
///
/// It checkpoints into `checkpoints` as the periods do (`checkpoint.rs`: every
/// `sft.checkpoint_every` steps, every `run.checkpoint_interval_s` seconds, and after
/// the last step; a damaged latest checkpoint set aside for the one before) and
/// resumes from there: a killed warm start continues at the step after its last
/// checkpoint with the same weights, optimiser and data, and one that had finished is
/// not repeated. The loss it reports is of the steps this call ran.
pub(crate) async fn warm_start(
    config: &PipelineConfig,
    model: Model,
    tokenizer: &Arc<dyn Tokenizer>,
    observer: &Observer,
    checkpoints: PathBuf,
) -> Result<(Model, Option<(f64, f64)>)> {
    let sft = &config.sft;
    if sft.steps == 0 {
        return Ok((model, None));
    }
    let mut data = config.data.clone();
    data.release.batch_size = sft.batch_size;
    data.release.epochs = None;
    // A stream of the run seed of its own: SFT batches are not the RL batches.
    let mut loader = data
        .build(RunSeed(metronome_core::stream_seed(RunSeed(config.run.seed), 0x5f7, 0)), tokenizer.clone())?;
    let mut cfg = config.trainer.clone();
    // A short warm-up and a cosine decay to a tenth: the supervised phase is long
    // enough for the decay to matter, unlike the RL periods.
    cfg.schedule = metronome_trainer::schedule::LrSchedule {
        lr: sft.learning_rate,
        warmup_steps: (sft.steps / 20).min(50),
        decay: metronome_trainer::schedule::Decay::Cosine { total_steps: sft.steps, min_ratio: 0.1 },
    };
    cfg.loss.kl_coef = 0.0;
    // The warm start learns the references, not the teacher.
    cfg.distill = None;
    let eos = tokenizer.stop_token_ids().first().copied();
    // With `[env]`, prompts the environment can solve with its tools are shown
    // solved that way, so that RL has tool use to reinforce.
    let environment =
        config.env.as_ref().map(|env| env.build().map_err(|e| Error::stage("env", e))).transpose()?;
    let mut trainer = GrpoTrainer::new(cfg, model)?;
    let mut checkpointer = Checkpointer::new(Checkpointing {
        dir: checkpoints,
        every: sft.checkpoint_every,
        interval: std::time::Duration::from_secs(config.run.checkpoint_interval_s),
    });
    // `next_period` of a warm-start checkpoint counts the steps done.
    let mut done = 0;
    if checkpointer.store.root().is_dir() {
        for s in checkpointer.store.recover()? {
            observer.emit(&Event::CheckpointSetAside { moved_to: s.moved_to, reason: s.reason });
        }
    }
    if let Some((dir, state)) = checkpointer.store.latest()? {
        trainer.restore(&dir)?;
        loader.restore(state.cursor)?;
        done = state.next_period;
        observer.emit(&Event::WarmStartResuming { step: done, checkpoint: dir });
    }
    let mut losses = Vec::new();
    for step in done + 1..=sft.steps {
        let Some(batch) = loader.next().await? else { break };
        let mut examples = Vec::with_capacity(batch.prompts.len());
        for p in &batch.prompts {
            let demonstrated = match &environment {
                Some(env) if shown_with_tools(config, p.id) => {
                    demonstrate(env.as_ref(), p, tokenizer.as_ref(), config.data.prompt.chat_template).await?
                }
                _ => None,
            };
            let mut example = match (demonstrated, &p.reference) {
                (Some(example), _) => example,
                (None, Some(reference)) => SftExample::new(p.tokens.clone(), tokenizer.encode(reference)?),
                (None, None) => continue,
            };
            example.answer.extend(eos);
            examples.push(example);
        }
        if examples.is_empty() {
            return Err(Error::Config {
                key: "sft.steps".into(),
                reason: "the training prompts have no reference answers to warm-start on".into(),
            });
        }
        let report = trainer.accumulate_sft(&examples)?;
        trainer.step_sync()?;
        let loss = report.loss_sum / report.tokens.max(1) as f64;
        observer.emit(&Event::WarmStartStep { step, steps: sft.steps, loss });
        losses.push(loss);
        checkpointer.save_if_due(&mut trainer, step, step == sft.steps, loader.cursor()).await?;
    }
    let first_last = losses.first().copied().zip(losses.last().copied());
    // With `trainer.lora` the warm start trained adapters: RL starts from the merged
    // model, which gets fresh adapters and is the KL reference.
    let policy = trainer.policy();
    let policy = if policy.lora().is_some() { policy.merged()? } else { policy.clone() };
    Ok((policy, first_last))
}

/// Whether the warm start shows `prompt` solved with the environment's tools
/// (`sft.tool_demonstrations`): the same prompts whatever the batch they come in.
fn shown_with_tools(config: &PipelineConfig, prompt: metronome_core::PromptId) -> bool {
    let draw = metronome_core::stream_seed(RunSeed(config.run.seed), TOOL_DEMONSTRATION_STREAM, prompt.0);
    // The top 53 bits as a uniform number in [0, 1).
    ((draw >> 11) as f64) / ((1u64 << 53) as f64) < config.sft.tool_demonstrations
}

/// The [`metronome_core::stream_seed`] stream of the choice of demonstrated prompts.
const TOOL_DEMONSTRATION_STREAM: u64 = 0x746f_6f6c_5f64_656d; // "tool_dem"

/// `prompt` solved as `environment` demonstrates it (`None` when it cannot), played
/// through a real episode: the policy's turns are targets, the observations between
/// them context, rendered as the engine renders them (`chat_template`). The stop
/// token is the caller's to add.
async fn demonstrate(
    environment: &dyn Environment,
    prompt: &Prompt,
    tokenizer: &dyn Tokenizer,
    chat_template: bool,
) -> Result<Option<SftExample>> {
    let Some(turns) = environment.demonstration(prompt) else { return Ok(None) };
    let failed = |reason: String| {
        Error::Stage(metronome_core::Error::invalid(
            format!("the demonstration of prompt {}", prompt.id),
            reason,
        ))
    };
    let mut episode = environment.start(prompt, 0).map_err(|e| failed(format!("no episode: {e}")))?;
    let mut example = SftExample::new(prompt.tokens.clone(), Vec::new());
    let (last, calls) = turns.split_last().ok_or_else(|| failed("has no turns".into()))?;
    for (i, turn) in calls.iter().enumerate() {
        example.answer.extend(tokenizer.encode(turn)?);
        let observation = episode.step(turn).await.map_err(|e| failed(format!("turn {i} failed: {e}")))?;
        if observation.done {
            return Err(failed(format!("the environment ended the episode at turn {i} of {}", turns.len())));
        }
        let tokens = tokenizer.encode(&observation.render(tokenizer, chat_template)?)?;
        // As the engine records them: an empty observation leaves no span.
        if !tokens.is_empty() {
            example.context.push(TokenSpan { start: example.answer.len() as u32, len: tokens.len() as u32 });
            example.answer.extend(tokens);
        }
    }
    example.answer.extend(tokenizer.encode(last)?);
    Ok(Some(example))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use async_trait::async_trait;
    use metronome_core::{Episode, Observation, PromptId};
    use metronome_model::CharTokenizer;
    use metronome_reward::{EnvConfig, ToolCallFormat};

    use super::*;

    fn prompt() -> Prompt {
        Prompt {
            id: PromptId(7),
            text: "2+3=".into(),
            tokens: CharTokenizer.encode("2+3=").unwrap(),
            reference: Some("5".into()),
            metadata: BTreeMap::from([("expression".to_owned(), "2+3".to_owned())]),
        }
    }

    /// Shows two turns, but ends the episode at the first.
    struct EndsEarly;

    struct Done;

    #[async_trait]
    impl Episode for Done {
        async fn step(&mut self, _turn: &str) -> metronome_core::Result<Observation> {
            Ok(Observation::done(Some(1.0)))
        }
    }

    impl Environment for EndsEarly {
        fn start(&self, _: &Prompt, _: u32) -> metronome_core::Result<Box<dyn Episode>> {
            Ok(Box::new(Done))
        }

        fn demonstration(&self, _: &Prompt) -> Option<Vec<String>> {
            Some(vec!["call".into(), "answer".into()])
        }
    }

    #[tokio::test]
    async fn a_demonstration_trains_on_the_turns_and_reads_the_tool_results_as_context() {
        let env = EnvConfig { format: ToolCallFormat::Tag, ..EnvConfig::default() }.build().unwrap();
        let example = demonstrate(env.as_ref(), &prompt(), &CharTokenizer, false).await.unwrap().unwrap();
        let text = |tokens: &[u32]| CharTokenizer.decode(tokens).unwrap();
        assert_eq!(example.prompt, prompt().tokens);
        assert_eq!(text(&example.answer), "<calculator>2+3</calculator><result>5</result>5");
        // The environment's own answer, and only it, is context.
        let [span] = example.context[..] else { panic!("{:?}", example.context) };
        assert_eq!(text(&example.answer[span.start as usize..span.end() as usize]), "<result>5</result>");
        // A prompt the environment cannot show is left to its reference answer.
        let bare = Prompt { metadata: BTreeMap::new(), ..prompt() };
        assert!(demonstrate(env.as_ref(), &bare, &CharTokenizer, false).await.unwrap().is_none());
        // A demonstration the environment does not follow is an error naming the prompt.
        let err = demonstrate(&EndsEarly, &prompt(), &CharTokenizer, false).await.unwrap_err().to_string();
        assert!(err.contains("prompt 7") && err.contains("ended the episode at turn 0 of 2"), "{err}");
    }
}
