//! `metronome prompts`: the prompts a run draws, as JSON lines, so that another
//! framework can train and evaluate on exactly the same data (the TRL comparisons of
//! `benches/`): each period's batch in the order the run releases them, then
//! the held-out split as the evaluation takes it. A line is a prompt (`id`, `text` after
//! the chat template, `tokens`, `reference`, `metadata`) with its `split` (`train` or
//! `heldout`) and, for training prompts, the `period` it is drawn in.

use metronome_core::RunSeed;

use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::evaluate::heldout_prompts;

/// The first `periods` training batches of `config`'s run and its first `heldout`
/// held-out prompts, one JSON object each, in that order, tokenised by the model
/// source's tokenizer (its weights are not read). Fewer training batches when the
/// dataset ends first (`data.release.epochs`).
pub async fn prompt_lines(
    config: &PipelineConfig,
    periods: u64,
    heldout: usize,
) -> Result<Vec<serde_json::Value>> {
    let tokenizer = crate::builders::load_tokenizer(config)?;
    let line =
        |split: &str, period: Option<u64>, prompt: &metronome_core::Prompt| -> Result<serde_json::Value> {
            let mut value = serde_json::to_value(prompt).map_err(|e| Error::Config {
                key: "data".into(),
                reason: format!("a prompt does not serialise: {e}"),
            })?;
            if let Some(fields) = value.as_object_mut() {
                fields.insert("split".into(), split.into());
                if let Some(p) = period {
                    fields.insert("period".into(), p.into());
                }
            }
            Ok(value)
        };
    let mut lines = Vec::new();
    // The run's loader, built as `builders` builds it: the same seed, order and batches,
    // each stamped with the period it is for (which the run checks on release).
    let mut loader = config.data.build(RunSeed(config.run.seed), tokenizer.clone())?;
    for _ in 0..periods {
        let Some(batch) = loader.next().await? else { break };
        for prompt in &batch.prompts {
            lines.push(line("train", Some(batch.period.0), prompt)?);
        }
    }
    for prompt in &heldout_prompts(config, tokenizer, heldout).await? {
        lines.push(line("heldout", None, prompt)?);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use metronome_core::{PromptSource, Tokenizer};

    use super::*;

    #[tokio::test]
    async fn the_lines_are_the_run_s_batches_in_order_then_its_held_out_split() {
        let set = ["data.release.batch_size=3".to_owned()];
        let config = PipelineConfig::embedded(&set).unwrap();
        let lines = prompt_lines(&config, 2, 4).await.unwrap();
        assert_eq!(lines.len(), 2 * 3 + 4);
        // The training lines are the batches a run's own loader releases, period by period.
        let tokenizer: std::sync::Arc<dyn Tokenizer> = std::sync::Arc::new(metronome_model::CharTokenizer);
        let mut loader = config.data.build(RunSeed(config.run.seed), tokenizer.clone()).unwrap();
        for period in 0..2u64 {
            let batch = loader.next_batch().await.unwrap().unwrap();
            for (i, prompt) in batch.prompts.iter().enumerate() {
                let line = &lines[period as usize * 3 + i];
                assert_eq!((line["split"].as_str(), line["period"].as_u64()), (Some("train"), Some(period)));
                assert_eq!(line["id"], serde_json::json!(prompt.id.0));
                assert_eq!(line["text"].as_str(), Some(prompt.text.as_str()));
                assert_eq!(line["tokens"], serde_json::json!(prompt.tokens));
                assert_eq!(line["reference"].as_str(), prompt.reference.as_deref());
            }
        }
        let heldout = heldout_prompts(&config, tokenizer, 4).await.unwrap();
        for (line, prompt) in lines[6..].iter().zip(&heldout) {
            assert_eq!((line["split"].as_str(), line.get("period")), (Some("heldout"), None));
            assert_eq!(line["text"].as_str(), Some(prompt.text.as_str()));
        }
    }

    #[tokio::test]
    async fn a_file_dataset_without_a_held_out_source_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.jsonl");
        std::fs::write(&file, "{\"prompt\": \"1+1=\"}\n").unwrap();
        // A run without evaluation needs no held-out source.
        let set = [
            format!("data.source={{ kind = \"jsonl\", path = {:?} }}", file.display().to_string()),
            "eval.prompts=0".to_owned(),
        ];
        let config = PipelineConfig::embedded(&set).unwrap();
        let err = prompt_lines(&config, 1, 2).await.unwrap_err();
        assert!(err.to_string().contains("eval.source"), "{err}");
        // Without held-out prompts asked for, the training lines are written.
        assert_eq!(prompt_lines(&config, 1, 0).await.unwrap().len(), 1);
    }
}
