//! The OpenAI-compatible server: `/v1/completions` and `/v1/models` in front of an
//! [`Engine`], plus `POST /metronome/v1/load_weights` for the client's weight hook.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metronome_core::{
    FinishReason, HostTensor, PeriodId, PolicyVersion, Prompt, PromptId, RolloutEngine, RunSeed, TensorData,
    WeightSnapshot,
};
use serde::{Deserialize, Serialize};

use super::types::{
    Choice, CompletionRequest, CompletionResponse, ErrorBody, ErrorDetail, LogProbs, ModelCard, ModelList,
    PromptInput, Usage,
};
use crate::{Engine, Error, InferenceModel, Result, SamplingConfig, Submission};

struct AppState<M: InferenceModel> {
    engine: Arc<Engine<M>>,
    model_name: String,
    created: u64,
}

/// The routes, serving `engine` under the name `model_name`.
pub fn router<M: InferenceModel>(engine: Arc<Engine<M>>, model_name: impl Into<String>) -> Router {
    let state = Arc::new(AppState { engine, model_name: model_name.into(), created: unix_now() });
    Router::new()
        .route("/v1/completions", post(completions::<M>))
        .route("/v1/models", get(models::<M>))
        .route("/metronome/v1/load_weights", post(load_weights::<M>))
        .with_state(state)
}

/// Serves `router` on `listener` until the future is dropped or the listener fails.
pub async fn serve(listener: tokio::net::TcpListener, router: Router) -> std::io::Result<()> {
    axum::serve(listener, router).await
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A 4xx/5xx answer in OpenAI's error shape.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), param }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        };
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message,
                kind: kind.into(),
                param: self.param.map(str::to_owned),
                code: Some(self.status.as_u16()),
            },
        };
        (self.status, Json(body)).into_response()
    }
}

async fn models<M: InferenceModel>(State(s): State<Arc<AppState<M>>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: s.model_name.clone(),
            object: "model".into(),
            created: s.created,
            owned_by: "metronome".into(),
            max_model_len: Some(s.engine.max_seq_len()),
        }],
    })
}

async fn completions<M: InferenceModel>(State(s): State<Arc<AppState<M>>>, body: Bytes) -> Response {
    match complete(&s, &body).await {
        Ok(r) => Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Validates a request, runs it on the engine, and shapes the answer.
async fn complete<M: InferenceModel>(
    s: &AppState<M>,
    body: &[u8],
) -> std::result::Result<CompletionResponse, ApiError> {
    let req: CompletionRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("request body is not a valid completion request: {e}"), None))?;
    if req.model != s.model_name {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("model `{}` does not exist (this server serves `{}`)", req.model, s.model_name),
            param: Some("model"),
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
    if n == 0 {
        return Err(ApiError::bad("`n` is 0 (expected at least 1)", Some("n")));
    }
    let tokenizer = Arc::clone(s.engine.tokenizer());
    let encode =
        |t: &str| tokenizer.encode(t).map_err(|e| ApiError::bad(format!("prompt: {e}"), Some("prompt")));
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
    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens == 0 {
        return Err(ApiError::bad("`max_tokens` is 0 (expected at least 1)", Some("max_tokens")));
    }
    let context = s.engine.max_seq_len();
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
        if tokens.len() + max_tokens > context {
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
    let sampling = sampling_of(&req, max_tokens, &tokenizer.stop_token_ids());
    sampling.validate().map_err(|e| ApiError::bad(e.to_string(), None))?;
    let seed = req
        .seed
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    let prompts: Vec<Prompt> = inputs
        .iter()
        .zip(&ids)
        .map(|((text, tokens), &id)| Prompt {
            id: PromptId(id),
            text: text.clone(),
            tokens: tokens.clone(),
            ..Prompt::default()
        })
        .collect();
    let prompt_tokens = prompts.iter().map(|p| p.tokens.len()).sum();
    let sub = Submission {
        period: PeriodId(0),
        prompts,
        group_size: n,
        sampling: sampling.clone(),
        seed: RunSeed(seed),
    };
    let groups = s.engine.generate_groups(sub).await.map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("generation failed: {e}"),
        param: None,
    })?;

    let index_of: HashMap<u64, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut choices = Vec::with_capacity(inputs.len() * n as usize);
    let mut version = PolicyVersion(0);
    let mut completion_tokens = 0;
    for group in &groups {
        let i = index_of[&group.prompt.id.0];
        for c in &group.completions {
            version = version.max(c.version);
            completion_tokens += c.tokens.len();
            let logprobs = req.logprobs.map(|_| {
                let as_ids = req.return_tokens_as_token_ids.unwrap_or(false);
                let tokens: Vec<String> = c
                    .tokens
                    .iter()
                    .map(|&t| {
                        if as_ids {
                            format!("token_id:{t}")
                        } else {
                            tokenizer.decode(&[t]).unwrap_or_default()
                        }
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
                    let hit = sampling
                        .stop_strings
                        .iter()
                        .filter_map(|s| full.find(s.as_str()).map(|at| (at, s)))
                        .min();
                    ("stop", hit.map(|(_, s)| serde_json::json!(s)))
                }
                // The server checks the context before it submits, so a prompt is
                // never rejected here; no room left is "length" in the API's terms.
                FinishReason::Length | FinishReason::PromptRejected => ("length", None),
                FinishReason::Aborted => ("abort", None),
            };
            choices.push(Choice {
                index: i as u32 * n + c.sample_index,
                text: c.text.clone(),
                logprobs,
                finish_reason: Some(finish_reason.into()),
                stop_reason,
            });
        }
    }
    choices.sort_by_key(|c| c.index);
    Ok(CompletionResponse {
        id: format!("cmpl-{seed:016x}-{}", unix_now()),
        object: "text_completion".into(),
        created: unix_now(),
        model: s.model_name.clone(),
        system_fingerprint: Some(format!("metronome-v{version}")),
        choices,
        usage: Some(Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }),
    })
}

/// The request's sampling; unset fields take OpenAI's defaults (temperature 1, top-p 1).
fn sampling_of(req: &CompletionRequest, max_tokens: usize, eos: &[u32]) -> SamplingConfig {
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
    }
}

/// `POST /metronome/v1/load_weights` body: a safetensors file written by
/// [`snapshot_to_safetensors`] (e.g. by [`super::SafetensorsReload`]) and its version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadWeightsRequest {
    /// The file, readable by the server.
    pub path: String,
    /// The policy version the weights are.
    pub version: u64,
}

async fn load_weights<M: InferenceModel>(State(s): State<Arc<AppState<M>>>, body: Bytes) -> Response {
    let result = async {
        let req: LoadWeightsRequest = serde_json::from_slice(&body).map_err(|e| {
            ApiError::bad(format!("request body is not a valid load_weights request: {e}"), None)
        })?;
        let bytes = tokio::fs::read(&req.path)
            .await
            .map_err(|e| ApiError::bad(format!("{}: {e}", req.path), Some("path")))?;
        let snapshot = snapshot_from_safetensors(&bytes, PolicyVersion(req.version))
            .map_err(|e| ApiError::bad(format!("{}: {e}", req.path), Some("path")))?;
        s.engine.install_weights(Arc::new(snapshot)).await.map_err(|e| ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            message: format!("installing {}: {e}", req.path),
            param: Some("path"),
        })?;
        Ok::<_, ApiError>(serde_json::json!({ "version": req.version }))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The snapshot as a safetensors file (f32, bf16 and f16 kept as they are); the version
/// goes into the metadata as `metronome_version`.
pub fn snapshot_to_safetensors(s: &WeightSnapshot) -> Result<Vec<u8>> {
    let bytes: Vec<(safetensors::Dtype, Vec<u8>)> = s
        .tensors
        .iter()
        .map(|t| match &t.data {
            TensorData::F32(v) => (safetensors::Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            TensorData::Bf16(v) => {
                (safetensors::Dtype::BF16, v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            TensorData::F16(v) => (safetensors::Dtype::F16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        })
        .collect();
    let views = s
        .tensors
        .iter()
        .zip(&bytes)
        .map(|(t, (dtype, b))| {
            safetensors::tensor::TensorView::new(*dtype, t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| Error::model(format!("tensor `{}`: {e}", t.name)))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("metronome_version".to_owned(), s.version.to_string())]);
    safetensors::serialize(views, Some(meta)).map_err(Error::model)
}

/// A snapshot from a safetensors file's bytes (f32, bf16 or f16 tensors).
pub fn snapshot_from_safetensors(bytes: &[u8], version: PolicyVersion) -> Result<WeightSnapshot> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(Error::model)?;
    let mut tensors = Vec::new();
    for (name, view) in st.iter() {
        let raw = view.data();
        let u16s = || raw.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        let data = match view.dtype() {
            safetensors::Dtype::F32 => TensorData::F32(
                raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            safetensors::Dtype::BF16 => TensorData::Bf16(u16s()),
            safetensors::Dtype::F16 => TensorData::F16(u16s()),
            other => return Err(Error::model(format!("tensor `{name}` has unsupported dtype {other:?}"))),
        };
        tensors.push(HostTensor { name: name.to_owned(), shape: view.shape().to_vec(), data });
    }
    Ok(WeightSnapshot { version, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_round_trip_through_safetensors() {
        let s = WeightSnapshot {
            version: PolicyVersion(7),
            tensors: vec![
                HostTensor {
                    name: "a.weight".into(),
                    shape: vec![2, 3],
                    data: TensorData::F32(vec![1.5, -2.0, 0.0, 3.25, f32::MIN_POSITIVE, 9.0]),
                },
                HostTensor {
                    name: "b.bias".into(),
                    shape: vec![2],
                    data: TensorData::Bf16(vec![0x3f80, 0xc000]),
                },
                HostTensor { name: "c".into(), shape: vec![1], data: TensorData::F16(vec![0x3c00]) },
            ],
        };
        let bytes = snapshot_to_safetensors(&s).unwrap();
        let mut back = snapshot_from_safetensors(&bytes, PolicyVersion(7)).unwrap();
        back.tensors.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(back, s);
        assert!(snapshot_from_safetensors(b"not a file", PolicyVersion(0)).is_err());
    }

    #[test]
    fn versions_parse_from_our_fingerprint_only() {
        assert_eq!(super::super::version_from_fingerprint("metronome-v12"), Some(PolicyVersion(12)));
        assert_eq!(super::super::version_from_fingerprint("fp_44709d6fcb"), None);
    }
}
