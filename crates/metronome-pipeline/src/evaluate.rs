//! Held-out evaluation: answers to prompts never trained on, sampled from the weights
//! of a point of the run and scored as training scores them.

use std::sync::Arc;

use metronome_core::{PeriodId, PolicyVersion, Prompt, RewardFn, RunSeed, Tokenizer, WeightSnapshot};
use metronome_model::Model;
use metronome_reward::{RewardConfig, ScorerConfig};

use crate::builders::native_engine;
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::generator::Generator;
use crate::report::EvalPoint;

/// The per-completion scorer evaluation uses: the run's local scorer, or the math
/// verifier when rewards come from a remote service.
pub(crate) fn eval_scorer(config: &PipelineConfig) -> Result<Arc<dyn RewardFn>> {
    let scorer = match &config.reward {
        RewardConfig::Local { scorer, .. } => scorer.clone(),
        RewardConfig::Remote(_) | RewardConfig::Judge(_) => ScorerConfig::Math(Default::default()),
    };
    Ok(scorer.build()?)
}

/// The first `count` prompts of the run's held-out source, in order, rendered as its
/// training prompts are: what every evaluation of the run answers (and an export).
/// None asked for, none read: a run without a held-out source may ask for 0.
pub(crate) async fn heldout_prompts(
    config: &PipelineConfig,
    tokenizer: Arc<dyn Tokenizer>,
    count: usize,
) -> Result<Vec<Prompt>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    let Some(source) = config.heldout_source() else {
        return Err(Error::Config {
            key: "eval.source".into(),
            reason: "must be given for a file dataset (only procedural tasks have a built-in held-out split)"
                .into(),
        });
    };
    let mut data = config.data.clone();
    data.source = source;
    data.release.batch_size = count;
    data.release.shuffle = false;
    data.release.prefetch = false;
    data.release.epochs = None;
    let mut loader = data.build(RunSeed(config.run.seed), tokenizer)?;
    Ok(loader.next().await?.map(|b| b.prompts).unwrap_or_default())
}

/// Answers to held-out prompts (greedy, or sampled as `[eval]` says), scored by
/// [`metronome_core::Reward::correctness`]; an episode the environment rewarded
/// counts as correct when that reward is positive.
pub(crate) struct Evaluator {
    generator: Generator,
    prompts: Vec<Prompt>,
    scorer: Arc<dyn RewardFn>,
}

impl Evaluator {
    /// The evaluator of `config` (`None` when `eval.prompts` is 0), decoding a copy of
    /// `model` on the rollout device.
    pub(crate) async fn new(
        config: &PipelineConfig,
        model: &Model,
        tokenizer: Arc<dyn Tokenizer>,
    ) -> Result<Option<Self>> {
        if config.eval.prompts == 0 {
            return Ok(None);
        }
        let prompts = heldout_prompts(config, tokenizer.clone(), config.eval.prompts).await?;
        let mut engine = config.rollout.clone();
        engine.sampling.temperature = config.eval.temperature;
        engine.workers = 1;
        let engine = native_engine(config, &engine, model, PolicyVersion(0), tokenizer)?;
        Ok(Some(Self {
            generator: Generator::new(Arc::new(engine), config.eval.samples),
            prompts,
            scorer: eval_scorer(config)?,
        }))
    }

    /// Held-out accuracy (and tool use) of `weights`, after `after_periods` periods.
    pub(crate) async fn evaluate(
        &mut self,
        weights: Arc<WeightSnapshot>,
        after_periods: u64,
    ) -> Result<EvalPoint> {
        self.generator.install(weights).await?;
        // Not a training period (an answer's seed depends on the weights' version, the run
        // seed, the prompt and the answer's index only): a failure names no period.
        let groups = match self.generator.collect(PeriodId(u64::MAX), self.prompts.clone()).await {
            Err(Error::Generation { source, .. }) => return Err(Error::Stage(source)),
            groups => groups?,
        };
        let answers: usize = groups.iter().map(|g| g.completions.len()).sum();
        let correct: f64 = groups
            .iter()
            .flat_map(|g| g.completions.iter().map(move |c| (&g.prompt, c)))
            .map(|(p, c)| {
                // An environment's own verdict on its episode comes first, as in training.
                if let Some(r) = c.episode.as_ref().and_then(|e| e.reward) {
                    return f64::from(u8::from(r > 0.0));
                }
                f64::from(self.scorer.score(p, c).correctness())
            })
            .sum();
        let episodes: Vec<_> =
            groups.iter().flat_map(|g| &g.completions).filter_map(|c| c.episode.as_ref()).collect();
        let tool_use = (!episodes.is_empty())
            .then(|| episodes.iter().filter(|e| e.turns > 1).count() as f64 / episodes.len() as f64);
        Ok(EvalPoint { after_periods, accuracy: correct / answers.max(1) as f64, tool_use })
    }
}
