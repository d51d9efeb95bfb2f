//! Builders shared by the test modules.

use std::collections::BTreeMap;

use metronome_core::{Completion, Group, Prompt, PromptId};

pub(crate) fn prompt(reference: Option<&str>, metadata: &[(&str, &str)]) -> Prompt {
    Prompt {
        id: PromptId(7),
        text: "question".into(),
        tokens: vec![1, 2, 3],
        reference: reference.map(str::to_owned),
        metadata: metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>(),
    }
}

pub(crate) fn completion(i: u32, text: &str) -> Completion {
    Completion {
        sample_index: i,
        tokens: vec![5; 4],
        logprobs: vec![-0.5; 4],
        text: text.into(),
        ..Completion::default()
    }
}

pub(crate) fn group(prompt: Prompt, texts: &[&str]) -> Group {
    Group {
        prompt,
        completions: texts.iter().enumerate().map(|(i, t)| completion(i as u32, t)).collect(),
        ..Group::default()
    }
}
