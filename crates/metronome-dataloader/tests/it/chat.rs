//! Chat-template rendering through the tokenizer trait.

use std::sync::Arc;

use metronome_core::RunSeed;
use metronome_dataloader::{
    BadRecordPolicy, FieldMapping, FileDataset, PromptConfig, PromptLoader, ReleaseConfig,
};

use crate::common::{ByteTokenizer, write_file};

fn loader(path: &std::path::Path, prompt: PromptConfig, template: bool) -> PromptLoader {
    let fields = FieldMapping { prompt: "p".into(), ..FieldMapping::default() };
    let dataset = FileDataset::open_jsonl(path, &fields, BadRecordPolicy::Fail).unwrap();
    let release =
        ReleaseConfig { batch_size: 2, shuffle: false, epochs: Some(1), ..ReleaseConfig::default() };
    PromptLoader::new(Arc::new(dataset), Arc::new(ByteTokenizer { template }), RunSeed(0), release, prompt)
        .unwrap()
}

#[tokio::test]
async fn text_and_conversations_render_through_the_template() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "chat.jsonl",
        concat!(
            r#"{"p": "What is 2+2?"}"#,
            "\n",
            r#"{"p": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]}"#,
            "\n",
        ),
    );
    let prompt =
        PromptConfig { chat_template: true, system: Some("You add.".into()), ..PromptConfig::default() };
    let batch = loader(&path, prompt, true).next().await.unwrap().unwrap();
    assert_eq!(batch.prompts[0].text, "<system>You add.\n<user>What is 2+2?\n<assistant>");
    // A conversation with its own system message keeps it.
    assert_eq!(batch.prompts[1].text, "<system>Be terse.\n<user>Hi\n<assistant>");
    assert_eq!(batch.prompts[0].tokens.len(), batch.prompts[0].text.len());
}

#[tokio::test]
async fn conversation_without_template_and_tokenizer_without_template_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "chat.jsonl", "{\"p\": [{\"role\": \"user\", \"content\": \"Hi\"}]}\n");
    let err = loader(&path, PromptConfig::default(), true).next().await.unwrap_err().to_string();
    assert!(
        err.contains("prompt 0") && err.contains("chat.jsonl line 1") && err.contains("chat_template"),
        "{err}"
    );

    let prompt = PromptConfig { chat_template: true, ..PromptConfig::default() };
    let err = loader(&path, prompt, false).next().await.unwrap_err().to_string();
    assert!(err.contains("chat template failed") && err.contains("has no chat template"), "{err}");
}

#[test]
fn a_system_prompt_needs_the_template() {
    let prompt = PromptConfig { system: Some("x".into()), ..PromptConfig::default() };
    assert!(prompt.validate().unwrap_err().to_string().contains("prompt.system"));
}
