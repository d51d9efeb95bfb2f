//! One completions request on the engine: its options checked against the server's
//! limits, its prompts tokenised and checked, its sampling, and the answer shaped,
//! keeping each choice's completion for callers that record them (the chat route,
//! the agent proxy).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use metronome_core::{ErrorChain, FinishReason, PeriodId, PolicyVersion, Prompt, PromptId, RunSeed};

use super::api::{ApiError, unix_now};
use super::server_config::ServerConfig;
use super::types::{Choice, CompletionRequest, CompletionResponse, LogProbs, PromptInput, Usage};
use crate::{Engine, Error, InferenceModel, LogprobsMode, SamplingConfig, Submission};

/// The longest stop string accepted, in bytes.
const MAX_STOP_BYTES: usize = 256;

/// What a request generated: the answer, and each choice's completion in choice
/// order (its sampled ids, behaviour log-probs and version, whatever the answer shows).
pub(crate) struct Generated {
    pub(crate) response: CompletionResponse,
    pub(crate) completions: Vec<metronome_core::Completion>,
}

/// Validates a request, runs it on the engine, and shapes the answer.
pub(crate) async fn complete<M: InferenceModel>(
    engine: &Engine<M>,
    config: &ServerConfig,
    req: &CompletionRequest,
) -> std::result::Result<Generated, ApiError> {
    let (n, max_tokens) = check_options(req, config)?;
    let tokenizer = Arc::clone(engine.tokenizer());
    let prompts = prompts_of(req, tokenizer.as_ref(), config, max_tokens, engine.max_seq_len())?;
    let sampling = sampling_of(req, max_tokens, &tokenizer.stop_token_ids(), config.logprobs);
    sampling.validate().map_err(|e| match &e {
        // The request's field: `sampling.top_p` is `top_p` here.
        Error::Config { field, .. } => {
            let param = field.strip_prefix("sampling.").unwrap_or(field);
            ApiError::bad(e.to_string(), Some(param))
        }
        _ => ApiError::bad(e.to_string(), None),
    })?;
    let seed = req
        .seed
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    let index_of: HashMap<u64, usize> = prompts.iter().enumerate().map(|(i, p)| (p.id.0, i)).collect();
    let prompt_tokens = prompts.iter().map(|p| p.tokens.len()).sum();
    let sub = Submission {
        period: PeriodId(0),
        prompts,
        group_size: n,
        sampling: sampling.clone(),
        seed: RunSeed(seed),
    };
    let groups = engine.generate_groups(sub).await.map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("generation failed: {}", ErrorChain(&e)),
        param: None,
    })?;

    let mut choices = Vec::with_capacity(index_of.len() * n as usize);
    let mut completions = Vec::with_capacity(choices.capacity());
    let mut version = PolicyVersion(0);
    let mut completion_tokens = 0;
    for group in groups {
        let i = index_of[&group.prompt.id.0] as u32;
        for c in group.completions {
            version = version.max(c.version);
            completion_tokens += c.tokens.len();
            let index = i * n + c.sample_index;
            choices.push(choice(req, &c, index, tokenizer.as_ref(), &sampling));
            completions.push((index, c));
        }
    }
    choices.sort_by_key(|c| c.index);
    completions.sort_by_key(|(index, _)| *index);
    let completions = completions.into_iter().map(|(_, c)| c).collect();
    let response = CompletionResponse {
        id: format!("cmpl-{seed:016x}-{}", unix_now()),
        object: "text_completion".into(),
        created: unix_now(),
        model: config.model_name.clone(),
        system_fingerprint: Some(format!("metronome-v{version}")),
        choices,
        usage: Some(Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }),
    };
    Ok(Generated { response, completions })
}

/// Checks the request's options against the server's limits; `n` and `max_tokens`.
fn check_options(
    req: &CompletionRequest,
    limits: &ServerConfig,
) -> std::result::Result<(u32, usize), ApiError> {
    if req.model != limits.model_name {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "model `{}` does not exist (this server serves `{}`)",
                req.model, limits.model_name
            ),
            param: Some(Cow::Borrowed("model")),
        });
    }
    if req.stream == Some(true) {
        return Err(ApiError::bad(
            "`stream` is true, but this server only answers whole responses",
            Some("stream"),
        ));
    }
    if req.echo == Some(true) {
        return Err(ApiError::bad("`echo` is true, but this server does not echo prompts", Some("echo")));
    }
    let n = req.n.unwrap_or(1);
    if n == 0 || n > limits.max_n {
        return Err(ApiError::bad(format!("`n` is {n} (expected 1 to {})", limits.max_n), Some("n")));
    }
    let stops = req.stop.clone().map(super::StopInput::into_vec).unwrap_or_default();
    if stops.len() > limits.max_stop || stops.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            format!("`stop` takes at most {} strings of up to {MAX_STOP_BYTES} bytes", limits.max_stop),
            Some("stop"),
        ));
    }
    if req.stop_token_ids.as_ref().is_some_and(|ids| ids.len() > limits.max_stop) {
        return Err(ApiError::bad(
            format!("`stop_token_ids` takes at most {} ids", limits.max_stop),
            Some("stop_token_ids"),
        ));
    }
    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens == 0 || max_tokens > limits.max_tokens {
        return Err(ApiError::bad(
            format!("`max_tokens` is {max_tokens} (expected 1 to {})", limits.max_tokens),
            Some("max_tokens"),
        ));
    }
    Ok((n, max_tokens))
}

/// The request's prompts, tokenised and checked: within the server's count, the
/// vocabulary and, with `max_tokens` new ones, the engine's `context`.
fn prompts_of(
    req: &CompletionRequest,
    tokenizer: &dyn metronome_core::Tokenizer,
    limits: &ServerConfig,
    max_tokens: usize,
    context: usize,
) -> std::result::Result<Vec<Prompt>, ApiError> {
    let encode = |t: &str| {
        tokenizer.encode(t).map_err(|e| ApiError::bad(format!("prompt: {}", ErrorChain(&e)), Some("prompt")))
    };
    let inputs: Vec<(String, Vec<u32>)> = match req.prompt.clone() {
        None => return Err(ApiError::bad("`prompt` is missing", Some("prompt"))),
        Some(PromptInput::Text(t)) => vec![(t.clone(), encode(&t)?)],
        Some(PromptInput::Texts(ts)) => {
            ts.into_iter().map(|t| Ok((t.clone(), encode(&t)?))).collect::<std::result::Result<_, _>>()?
        }
        Some(PromptInput::Tokens(ids)) => vec![(String::new(), ids)],
        Some(PromptInput::TokenLists(lists)) => lists.into_iter().map(|ids| (String::new(), ids)).collect(),
    };
    if inputs.is_empty() {
        return Err(ApiError::bad("`prompt` is an empty list", Some("prompt")));
    }
    if inputs.len() > limits.max_prompts {
        return Err(ApiError::bad(
            format!("`prompt` holds {} prompts (at most {})", inputs.len(), limits.max_prompts),
            Some("prompt"),
        ));
    }
    let vocab = tokenizer.vocab_size();
    for (i, (_, tokens)) in inputs.iter().enumerate() {
        if tokens.is_empty() {
            return Err(ApiError::bad(format!("prompt {i} has no tokens"), Some("prompt")));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad(
                format!("prompt {i} has token id {bad}, outside the vocabulary of {vocab}"),
                Some("prompt"),
            ));
        }
        // Saturating: neither number is trusted to leave room for the sum.
        if tokens.len().saturating_add(max_tokens) > context {
            return Err(ApiError::bad(
                format!(
                    "`max_tokens` {max_tokens} plus the {} tokens of prompt {i} exceeds the context length {context}",
                    tokens.len()
                ),
                Some("max_tokens"),
            ));
        }
    }
    let ids: Vec<u64> = match &req.prompt_ids {
        Some(ids) if ids.len() != inputs.len() => {
            return Err(ApiError::bad(
                format!("`prompt_ids` has {} ids for {} prompts", ids.len(), inputs.len()),
                Some("prompt_ids"),
            ));
        }
        Some(ids) => ids.clone(),
        None => (0..inputs.len() as u64).collect(),
    };
    if ids.iter().collect::<HashSet<_>>().len() != ids.len() {
        return Err(ApiError::bad("`prompt_ids` has duplicates", Some("prompt_ids")));
    }
    Ok(inputs
        .into_iter()
        .zip(ids)
        .map(|((text, tokens), id)| Prompt { id: PromptId(id), text, tokens, ..Prompt::default() })
        .collect())
}

/// One completion as an API choice at `index`: its text, log-probs when asked for,
/// and why it finished.
fn choice(
    req: &CompletionRequest,
    c: &metronome_core::Completion,
    index: u32,
    tokenizer: &dyn metronome_core::Tokenizer,
    sampling: &SamplingConfig,
) -> Choice {
    let logprobs = req.logprobs.map(|_| {
        let as_ids = req.return_tokens_as_token_ids.unwrap_or(false);
        let tokens: Vec<String> =
            c.tokens
                .iter()
                .map(|&t| {
                    if as_ids { format!("token_id:{t}") } else { tokenizer.decode(&[t]).unwrap_or_default() }
                })
                .collect();
        let mut offset = 0;
        let text_offset = tokens
            .iter()
            .map(|t| {
                let o = offset;
                offset += if as_ids { 0 } else { t.len() };
                o
            })
            .collect();
        LogProbs { tokens, token_logprobs: c.logprobs.clone(), top_logprobs: None, text_offset }
    });
    let (finish_reason, stop_reason) = match c.finish_reason {
        FinishReason::Stop => ("stop", c.tokens.last().map(|&t| serde_json::json!(t))),
        FinishReason::StopString => {
            let full = tokenizer.decode(&c.tokens).unwrap_or_default();
            let hit =
                sampling.stop_strings.iter().filter_map(|s| full.find(s.as_str()).map(|at| (at, s))).min();
            ("stop", hit.map(|(_, s)| serde_json::json!(s)))
        }
        // The server checks the context before it submits, so a prompt is never
        // rejected here; no room left is "length" in the API's terms.
        FinishReason::Length | FinishReason::PromptRejected => ("length", None),
        FinishReason::Aborted => ("abort", None),
    };
    let token_ids = req.return_token_ids.unwrap_or(false).then(|| c.tokens.clone());
    Choice {
        index,
        text: c.text.clone(),
        logprobs,
        finish_reason: Some(finish_reason.into()),
        stop_reason,
        token_ids,
        matched_stop: None,
    }
}

/// The request's sampling, recording log-probs as the server is configured to;
/// unset fields take OpenAI's defaults (temperature 1, top-p 1).
fn sampling_of(
    req: &CompletionRequest,
    max_tokens: usize,
    eos: &[u32],
    logprobs: LogprobsMode,
) -> SamplingConfig {
    let stop_token_ids = req.stop_token_ids.as_ref().map(|extra| {
        let mut ids = eos.to_vec();
        ids.extend(extra.iter().filter(|t| !eos.contains(t)));
        ids
    });
    SamplingConfig {
        temperature: req.temperature.unwrap_or(1.0),
        top_k: req.top_k.filter(|&k| k > 0).map_or(0, |k| k as usize),
        top_p: req.top_p.unwrap_or(1.0),
        min_p: req.min_p.unwrap_or(0.0),
        repetition_penalty: req.repetition_penalty.unwrap_or(1.0),
        max_new_tokens: max_tokens,
        stop_token_ids,
        stop_strings: req.stop.clone().map(super::StopInput::into_vec).unwrap_or_default(),
        include_stop_str_in_output: req.include_stop_str_in_output.unwrap_or(false),
        ignore_eos: req.ignore_eos.unwrap_or(false),
        logprobs,
    }
}
