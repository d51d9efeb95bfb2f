//! `metronome export`: a run's checkpoint as a Hugging Face folder that `transformers`
//! loads (`config.json`, `model.safetensors`; LoRA adapters merged in), with the
//! tokenizer of the run's model source where it has one (a GGUF's BPE and chat
//! template written as `tokenizer.json` and `tokenizer_config.json`; a Hugging Face
//! source's tokenizer files copied), and Metronome's greedy answers to fixed held-out
//! questions (`metronome_greedy.json`: prompt ids, answer ids and text, whether the
//! run's scorer calls the answer correct), which
//! `crates/metronome-pipeline/examples/check_export.py` compares with `transformers`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use metronome_core::{PeriodId, PolicyVersion, Tokenizer};
use metronome_model::Model;

use crate::builders::native_engine;
use crate::config::{ModelSource, PipelineConfig};
use crate::error::{Error, Result};
use crate::evaluate::{eval_scorer, heldout_prompts};
use crate::generator::Generator;

/// The file of greedy answers an export writes beside the weights.
pub const GREEDY_ANSWERS_FILE: &str = "metronome_greedy.json";

/// [`ExportOptions::checkpoint`] naming the run's model source itself, untrained.
pub const BASE_CHECKPOINT: &str = "base";

/// What to export and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportOptions {
    /// The checkpoint: `final` (written after the last period), `latest` (the newest
    /// period checkpoint), `period-<n>`, or [`BASE_CHECKPOINT`]: the model the run
    /// starts from, as its config loads it (the base another framework's run of the
    /// same data starts from; a run directory with its `config.toml` is still read).
    pub checkpoint: String,
    /// The folder to write; created, and its files replaced.
    pub out: PathBuf,
    /// Held-out questions answered greedily (the first of the run's held-out source,
    /// in order, as its evaluation takes them); 0 writes none.
    pub questions: usize,
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportOutcome {
    /// The checkpoint folder read (the model source's path for [`BASE_CHECKPOINT`]).
    pub checkpoint: PathBuf,
    /// The folder written.
    pub out: PathBuf,
    /// Whether tokenizer files were written (not for the built-in character-level one).
    pub tokenizer: bool,
    /// Questions answered, and how many of those answers the run's scorer calls correct.
    pub questions: usize,
    /// Correct greedy answers.
    pub correct: usize,
}

/// The engine of the export's answers: the run's, greedy, one worker, and in f32, the
/// precision of the exported weights, whatever the run's rollouts used (bf16 on a GPU):
/// these answers are what another f32 implementation of the same weights must
/// reproduce, and bf16 rounding changes greedy choices at near-ties (on an H100, 24 of
/// 28 answers decoded in bf16 parted from transformers' f32 ones).
fn greedy_engine(config: &PipelineConfig) -> metronome_rollout::EngineConfig {
    let mut engine = config.rollout.clone();
    engine.sampling.temperature = 0.0;
    engine.workers = 1;
    engine.precision = Some(metronome_model::Precision::F32);
    engine
}

/// Exports checkpoint `options.checkpoint` of the run in `run` (whose stored config
/// is `config`) to `options.out`.
pub async fn export(run: &Path, config: &PipelineConfig, options: &ExportOptions) -> Result<ExportOutcome> {
    // The weights decode where the run's rollouts did; the files are written from the host.
    let (model, checkpoint) = if options.checkpoint == BASE_CHECKPOINT {
        let source = match &config.model {
            ModelSource::Tiny { .. } => PathBuf::from("tiny (built-in, run.seed)"),
            ModelSource::Hf { path, .. } | ModelSource::Gguf { path, .. } => path.clone(),
        };
        (crate::load_model(config, config.rollout_device())?.0, source)
    } else {
        let checkpoint = checkpoint_dir(run, &options.checkpoint)?;
        let policy_dir = checkpoint.join("policy");
        if !policy_dir.join("config.json").is_file() {
            return Err(missing(&policy_dir, "holds no policy (config.json and model.safetensors)"));
        }
        let mut model =
            Model::load_hf(&policy_dir, &config.rollout_device().open_for(metronome_model::Stage::Rollout)?)?;
        let adapter = checkpoint.join("adapter");
        if adapter.is_dir() {
            model = model.with_lora_adapter(&adapter)?.merged()?;
        }
        (model, checkpoint)
    };
    let out = &options.out;
    model.save_hf(out)?;
    let (tokenizer, wrote_tokenizer) = write_tokenizer(config, out)?;

    let prompts = heldout_prompts(config, tokenizer.clone(), options.questions).await?;
    let engine = native_engine(config, &greedy_engine(config), &model, PolicyVersion(0), tokenizer.clone())?;
    let mut groups = if prompts.is_empty() {
        Vec::new()
    } else {
        Generator::new(Arc::new(engine), 1).collect(PeriodId(u64::MAX), prompts).await?
    };
    groups.sort_by_key(|g| g.prompt.id.0);
    let scorer = eval_scorer(config)?;
    let mut correct = 0;
    let mut answers = Vec::with_capacity(groups.len());
    for group in &groups {
        let (prompt, completion) = (&group.prompt, &group.completions[0]);
        let right = scorer.score(prompt, completion).correctness() > 0.0;
        correct += usize::from(right);
        answers.push(serde_json::json!({
            "id": prompt.id.0,
            "prompt": prompt.text,
            "prompt_ids": prompt.tokens,
            "reference": prompt.reference,
            "answer": completion.text,
            "answer_ids": completion.tokens,
            "finish_reason": format!("{:?}", completion.finish_reason),
            "correct": right,
        }));
    }
    let record = serde_json::json!({
        "checkpoint": checkpoint.display().to_string(),
        "max_new_tokens": config.rollout.sampling.max_new_tokens,
        "stop_token_ids": tokenizer.stop_token_ids(),
        "questions": answers,
    });
    let path = out.join(GREEDY_ANSWERS_FILE);
    std::fs::write(&path, format!("{record:#}\n")).map_err(|source| Error::Io { path, source })?;
    Ok(ExportOutcome {
        checkpoint,
        out: out.clone(),
        tokenizer: wrote_tokenizer,
        questions: groups.len(),
        correct,
    })
}

/// The folder of checkpoint `name` in run `run`.
fn checkpoint_dir(run: &Path, name: &str) -> Result<PathBuf> {
    let root = run.join("checkpoints");
    let periods = root.join("periods");
    let dir = match name {
        "final" => root.join("final"),
        "latest" => {
            let latest = periods.join("latest");
            let named =
                std::fs::read_to_string(&latest).map_err(|source| Error::Io { path: latest, source })?;
            periods.join(named.trim())
        }
        period if period.strip_prefix("period-").is_some_and(|n| n.parse::<u64>().is_ok()) => {
            periods.join(period)
        }
        other => {
            return Err(Error::Config {
                key: "--checkpoint".into(),
                reason: format!(
                    "is `{other}`, expected `final`, `latest`, `period-<n>` or `{BASE_CHECKPOINT}`"
                ),
            });
        }
    };
    if !dir.is_dir() {
        return Err(missing(&dir, "is not a checkpoint folder of this run"));
    }
    Ok(dir)
}

fn missing(path: &Path, what: &str) -> Error {
    Error::Io {
        path: path.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, format!("{} {what}", path.display())),
    }
}

/// The run's tokenizer, and its files written to `out` where it has a Hugging Face
/// form: a GGUF's byte-level BPE and chat template, or a Hugging Face source's own
/// files.
fn write_tokenizer(config: &PipelineConfig, out: &Path) -> Result<(Arc<dyn Tokenizer>, bool)> {
    let io = |path: PathBuf| move |source: std::io::Error| Error::Io { path, source };
    match &config.model {
        ModelSource::Tiny { .. } => Ok((Arc::new(metronome_model::CharTokenizer), false)),
        ModelSource::Hf { path, .. } => {
            config.check_model_files()?;
            for file in [
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "generation_config.json",
            ] {
                let from = path.join(file);
                if from.is_file() {
                    std::fs::copy(&from, out.join(file)).map_err(io(from))?;
                }
            }
            Ok((Arc::new(metronome_model::HfTokenizer::from_dir(path)?), true))
        }
        ModelSource::Gguf { path, .. } => {
            config.check_model_files()?;
            // The tokenizer lives in the file's metadata.
            let gguf = metronome_model::GgufTokenizer::from_gguf(path)?;
            let hf = gguf.as_hf();
            let file = out.join("tokenizer.json");
            hf.inner().save(&file, false).map_err(|e| Error::Io {
                path: file.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
            let text = |id: Option<u32>| id.and_then(|i| hf.inner().id_to_token(i)).unwrap_or_default();
            let stop = gguf.stop_token_ids();
            let tokenizer_config = serde_json::json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": text(gguf.bos_token_id()),
                "eos_token": text(stop.first().copied()),
                "chat_template": hf.chat_template().map(|t| t.source().to_owned()),
                "add_bos_token": false,
                "clean_up_tokenization_spaces": false,
            });
            let file = out.join("tokenizer_config.json");
            std::fs::write(&file, format!("{tokenizer_config:#}\n")).map_err(io(file))?;
            Ok((Arc::new(gguf), true))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answers_are_decoded_greedily_in_f32_whatever_the_rollouts_used() {
        let set = ["rollout.precision=\"bf16\"".to_owned(), "rollout.workers=3".to_owned()];
        let config = PipelineConfig::embedded(&set).unwrap();
        assert_eq!(config.rollout.precision, Some(metronome_model::Precision::Bf16));
        let engine = greedy_engine(&config);
        assert_eq!(engine.precision, Some(metronome_model::Precision::F32));
        assert_eq!((engine.sampling.temperature, engine.workers), (0.0, 1));
    }
}
