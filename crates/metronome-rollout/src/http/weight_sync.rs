//! Bringing new weights to the servers behind an [`OpenAiEngine`](super::OpenAiEngine):
//! write them once where the servers can read them, then tell each server to load them.
//!
//! What each server offers (`[rollout.openai] weight_sync`):
//! - `metronome` ([`SafetensorsReload`]): `metronome serve --weights-dir D` loads a
//!   safetensors file from inside `D` on `POST /metronome/v1/load_weights {"path",
//!   "version"}` and names the version in every response's `system_fingerprint`, so
//!   the client checks it.
//! - `sglang` ([`SglangReload`]): SGLang's `POST /update_weights_from_disk` with
//!   `{"model_path": "<HF folder>", "weight_version": "<version>"}` (its RL docs) reads
//!   the safetensors of a Hugging Face folder into the running model; the client
//!   writes `v<version>/config.json` and `v<version>/model.safetensors` and keeps only
//!   the newest folder.
//! - `vllm` ([`VllmReload`]): plain `vllm serve` has no endpoint that loads new weights.
//!   With `VLLM_SERVER_DEV_MODE=1` it exposes `POST /collective_rpc`, which calls a
//!   worker method; its `reload_weights` re-reads the weights from the model's own
//!   folder (vLLM's RL example does this through `LLM.collective_rpc("reload_weights")`).
//!   So vLLM must serve `export_dir` itself (a copy of the starting model's folder with
//!   one `model.safetensors`, no shard index), the client replaces `model.safetensors`
//!   and `config.json` there, calls `reload_weights`, then `POST /reset_prefix_cache`
//!   so that no prompt is served from keys and values of the old weights.
//!   The dev-mode endpoints are, in vLLM's words, not for production; they are
//!   unauthenticated and must not be reachable from untrusted networks.
//! - `none` ([`NoWeightUpdate`]): nothing is sent.
//!
//! vLLM and SGLang cannot run on the machines these tests run on: their request shapes
//! are tested against a local stub that records them, nothing more.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use metronome_core::{PolicyVersion, WeightSnapshot};
use serde::Serialize;

use super::{LoadWeightsRequest, snapshot_to_safetensors};
use crate::{Error, OpenAiClientConfig, Result, WeightSync};

/// What a weight-update hook may use to reach one server: the client's HTTP
/// connection pool (with its key and timeout) and the server's base URL.
#[derive(Debug)]
pub struct HookContext<'a> {
    /// The client's HTTP client.
    pub http: &'a reqwest::Client,
    /// The server's base URL, without a trailing slash.
    pub base_url: &'a str,
    /// The client does not know the server to hold its previous weights (its first
    /// update, or the server answered with someone else's): the update may take the
    /// server back to an older version, and says so to servers that refuse that by
    /// default (ours, `allow_older`).
    pub allow_older: bool,
}

/// Brings new weights to the servers behind an [`OpenAiEngine`](super::OpenAiEngine).
/// Servers differ (see the module docs), hence a trait: [`export`](Self::export) runs
/// once per version, [`load`](Self::load) once per server.
#[async_trait]
pub trait WeightUpdateHook: Send + Sync + std::fmt::Debug {
    /// Writes `weights` where the servers will read them.
    async fn export(&self, weights: Arc<WeightSnapshot>) -> Result<()>;

    /// Makes the server at `ctx.base_url` sample with the exported `version` from now on.
    async fn load(&self, ctx: &HookContext<'_>, version: PolicyVersion) -> Result<()>;
}

/// A hook that does nothing: the servers' weights are managed elsewhere. The client
/// still records the new version for its completions.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoWeightUpdate;

#[async_trait]
impl WeightUpdateHook for NoWeightUpdate {
    async fn export(&self, _weights: Arc<WeightSnapshot>) -> Result<()> {
        Ok(())
    }

    async fn load(&self, _ctx: &HookContext<'_>, _version: PolicyVersion) -> Result<()> {
        Ok(())
    }
}

/// Where files are written and how the servers name the same folder.
#[derive(Clone, Debug)]
struct ExportDir {
    dir: PathBuf,
    server_dir: PathBuf,
}

impl ExportDir {
    fn new(dir: PathBuf, server_dir: Option<PathBuf>) -> Self {
        Self { server_dir: server_dir.unwrap_or_else(|| dir.clone()), dir }
    }

    async fn create(&self) -> Result<()> {
        tokio::fs::create_dir_all(&self.dir).await.map_err(|source| io(&self.dir, source))
    }
}

fn io(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), source }
}

/// Writes `bytes` to `path` through a temporary file renamed over it, so that a
/// server never reads a half-written file. The temporary name is this process's and
/// call's own: several rollout workers may export the same version to one folder.
async fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}-{n}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    tokio::fs::write(&tmp, bytes).await.map_err(|source| io(&tmp, source))?;
    tokio::fs::rename(&tmp, path).await.map_err(|source| io(path, source))
}

/// Removes the entries of `dir` that `stale` picks (older versions); failures are
/// only logged, as a leftover file costs disk, not correctness.
async fn remove_stale(dir: &Path, stale: impl Fn(&str) -> bool) {
    let Ok(mut entries) = tokio::fs::read_dir(dir).await else { return };
    while let Ok(Some(entry)) = entries.next_entry().await {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !stale(&name) {
            continue;
        }
        let path = entry.path();
        let removed = if path.is_dir() {
            tokio::fs::remove_dir_all(&path).await
        } else {
            tokio::fs::remove_file(&path).await
        };
        if let Err(e) = removed {
            tracing::warn!(path = %path.display(), "cannot remove an older weights export: {e}");
        }
    }
}

/// Posts `body` as JSON to `path` on the server; a non-2xx answer, or a 2xx whose
/// JSON says `"success": false` (SGLang's way), is an error with the server's text.
async fn post_json(ctx: &HookContext<'_>, path: &str, body: &impl Serialize) -> Result<()> {
    let url = format!("{}{path}", ctx.base_url);
    let resp =
        ctx.http.post(&url).json(body).send().await.map_err(|e| Error::Http {
            url: url.clone(),
            reason: metronome_core::ErrorChain(&e).to_string(),
        })?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    let refused = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .is_some_and(|v| v.get("success") == Some(&serde_json::Value::Bool(false)));
    if !status.is_success() || refused {
        return Err(Error::Http { url, reason: format!("status {status}: {text}") });
    }
    Ok(())
}

/// Our server's hook: saves the snapshot as `export_dir/weights-v<version>.safetensors`
/// (removing older ones) and posts `{"path": ..., "version": ...}` to `endpoint`
/// (`/metronome/v1/load_weights`). The folder must be inside the server's
/// `--weights-dir`.
#[derive(Clone, Debug)]
pub struct SafetensorsReload {
    export: ExportDir,
    /// The reload endpoint's path on the server.
    pub endpoint: String,
}

impl SafetensorsReload {
    /// A hook for our own server's endpoint, writing to `dir`, which the server reads
    /// under the same path.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self::with_server_dir(dir, None)
    }

    /// As [`SafetensorsReload::new`], for a server that sees `dir` as `server_dir`.
    pub fn with_server_dir(dir: impl Into<PathBuf>, server_dir: Option<PathBuf>) -> Self {
        Self { export: ExportDir::new(dir.into(), server_dir), endpoint: "/metronome/v1/load_weights".into() }
    }

    fn file_name(version: PolicyVersion) -> String {
        format!("weights-v{version}.safetensors")
    }
}

#[async_trait]
impl WeightUpdateHook for SafetensorsReload {
    async fn export(&self, weights: Arc<WeightSnapshot>) -> Result<()> {
        self.export.create().await?;
        let name = Self::file_name(weights.version);
        let older = |n: &str| {
            n != name
                && n.strip_prefix("weights-v")
                    .and_then(|v| v.strip_suffix(".safetensors"))
                    .is_some_and(|v| v.parse::<u64>().is_ok())
        };
        remove_stale(&self.export.dir, older).await;
        let bytes = snapshot_to_safetensors(&weights)?;
        write_atomic(&self.export.dir.join(&name), &bytes).await
    }

    async fn load(&self, ctx: &HookContext<'_>, version: PolicyVersion) -> Result<()> {
        let path = self.export.server_dir.join(Self::file_name(version));
        let body = LoadWeightsRequest {
            path: path.display().to_string(),
            version: version.0,
            allow_older: ctx.allow_older,
        };
        post_json(ctx, &self.endpoint, &body).await
    }
}

/// SGLang's hook: a Hugging Face folder `export_dir/v<version>/` (`config.json`,
/// `model.safetensors`; older folders removed), then `POST /update_weights_from_disk`
/// with `{"model_path": <the folder as the server sees it>, "weight_version":
/// "<version>"}`.
#[derive(Clone, Debug)]
pub struct SglangReload {
    export: ExportDir,
    config_json: String,
}

impl SglangReload {
    /// Writes to `dir` (seen by the servers as `server_dir`, or `dir`), with the
    /// model's Hugging Face `config.json` text.
    pub fn new(dir: impl Into<PathBuf>, server_dir: Option<PathBuf>, config_json: String) -> Self {
        Self { export: ExportDir::new(dir.into(), server_dir), config_json }
    }

    fn folder(version: PolicyVersion) -> String {
        format!("v{version}")
    }
}

/// SGLang's `/update_weights_from_disk` body (the fields its docs name that we set).
#[derive(Debug, Serialize)]
struct SglangUpdate {
    model_path: String,
    weight_version: String,
}

#[async_trait]
impl WeightUpdateHook for SglangReload {
    async fn export(&self, weights: Arc<WeightSnapshot>) -> Result<()> {
        self.export.create().await?;
        let name = Self::folder(weights.version);
        remove_stale(&self.export.dir, |n| {
            n != name && n.strip_prefix('v').is_some_and(|v| v.parse::<u64>().is_ok())
        })
        .await;
        write_hf_folder(&self.export.dir.join(&name), &self.config_json, &weights).await
    }

    async fn load(&self, ctx: &HookContext<'_>, version: PolicyVersion) -> Result<()> {
        let body = SglangUpdate {
            model_path: self.export.server_dir.join(Self::folder(version)).display().to_string(),
            weight_version: version.to_string(),
        };
        post_json(ctx, "/update_weights_from_disk", &body).await
    }
}

/// vLLM's hook (dev mode): replaces `model.safetensors` and `config.json` in the
/// folder vLLM serves, then `POST /collective_rpc {"method": "reload_weights"}` and
/// `POST /reset_prefix_cache`.
#[derive(Clone, Debug)]
pub struct VllmReload {
    export: ExportDir,
    config_json: String,
}

impl VllmReload {
    /// Writes into `dir`, the folder vLLM was started on, with the model's Hugging
    /// Face `config.json` text.
    pub fn new(dir: impl Into<PathBuf>, config_json: String) -> Self {
        Self { export: ExportDir::new(dir.into(), None), config_json }
    }
}

/// vLLM's `/collective_rpc` body.
#[derive(Debug, Serialize)]
struct CollectiveRpc {
    method: &'static str,
}

#[async_trait]
impl WeightUpdateHook for VllmReload {
    async fn export(&self, weights: Arc<WeightSnapshot>) -> Result<()> {
        self.export.create().await?;
        // With a shard index vLLM would keep reading the shards it names, not ours.
        let index = self.export.dir.join("model.safetensors.index.json");
        if tokio::fs::try_exists(&index).await.unwrap_or(false) {
            return Err(Error::config(
                "openai.export_dir",
                format!(
                    "holds {}: vLLM would reload the shards it names, not the weights written here; serve a \
                     folder with one model.safetensors",
                    index.display()
                ),
            ));
        }
        write_hf_folder(&self.export.dir, &self.config_json, &weights).await
    }

    async fn load(&self, ctx: &HookContext<'_>, _version: PolicyVersion) -> Result<()> {
        post_json(ctx, "/collective_rpc", &CollectiveRpc { method: "reload_weights" }).await?;
        post_json(ctx, "/reset_prefix_cache", &serde_json::json!({})).await
    }
}

/// Writes `config.json` and `model.safetensors` (the snapshot's tensors under their
/// Hugging Face names, as `Model::save_hf` writes them) to `dir`, each atomically.
pub async fn write_hf_folder(dir: &Path, config_json: &str, weights: &WeightSnapshot) -> Result<()> {
    tokio::fs::create_dir_all(dir).await.map_err(|source| io(dir, source))?;
    write_atomic(&dir.join("config.json"), config_json.as_bytes()).await?;
    write_atomic(&dir.join("model.safetensors"), &snapshot_to_safetensors(weights)?).await
}

/// The hook `[rollout.openai] weight_sync` names, writing to its `export_dir` (checked
/// by [`OpenAiClientConfig::validate`]); `config_json` is the model's Hugging Face
/// `config.json` (`ModelConfig::to_hf_json`), which SGLang and vLLM read.
pub fn weight_sync_hook(
    config: &OpenAiClientConfig,
    config_json: String,
) -> Result<Box<dyn WeightUpdateHook>> {
    let dir = || {
        config.export_dir.clone().ok_or_else(|| {
            Error::config(
                "openai.export_dir",
                format!("must be set for weight_sync = \"{}\"", config.weight_sync.name()),
            )
        })
    };
    Ok(match config.weight_sync {
        WeightSync::None => Box::new(NoWeightUpdate),
        WeightSync::Metronome => {
            Box::new(SafetensorsReload::with_server_dir(dir()?, config.server_export_dir.clone()))
        }
        WeightSync::Sglang => {
            Box::new(SglangReload::new(dir()?, config.server_export_dir.clone(), config_json))
        }
        WeightSync::Vllm => Box::new(VllmReload::new(dir()?, config_json)),
    })
}

#[async_trait]
impl WeightUpdateHook for Box<dyn WeightUpdateHook> {
    async fn export(&self, weights: Arc<WeightSnapshot>) -> Result<()> {
        (**self).export(weights).await
    }

    async fn load(&self, ctx: &HookContext<'_>, version: PolicyVersion) -> Result<()> {
        (**self).load(ctx, version).await
    }
}
