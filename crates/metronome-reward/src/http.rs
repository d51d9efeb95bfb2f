//! What the HTTP scorers share ([`crate::RemoteScorer`], [`crate::JudgeScorer`]): one
//! attempt's classification (done, retry, give up), bodies read up to a cap, and the
//! retry loop with deterministic exponential backoff.

use std::time::Duration;

use metronome_core::{ErrorChain, mix64};

/// How one attempt ended.
pub(crate) enum Attempt<T> {
    /// It succeeded.
    Done(T),
    /// It failed in a way another attempt may not (a refused connection, a timeout,
    /// `429`, `5xx`).
    Retry(String),
    /// It failed in a way retrying cannot fix (another error status, a malformed or
    /// oversized body).
    Fatal(String),
}

/// Exponential backoff with deterministic "equal jitter" (half fixed, half spread by
/// a hash of the request's key and the retry), so requests that failed together do
/// not retry together.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backoff {
    pub(crate) initial_ms: u64,
    pub(crate) max_ms: u64,
}

impl Backoff {
    /// The delay before retry number `retry` (0-based) of the request `key`.
    pub(crate) fn delay(self, retry: u32, key: u64) -> Duration {
        let base = self.initial_ms.saturating_mul(1u64 << retry.min(32)).min(self.max_ms);
        let spread = mix64(key ^ u64::from(retry)) % (base / 2 + 1);
        Duration::from_millis(base - base / 2 + spread)
    }
}

/// The response of a request, or how the attempt failed: connection errors and
/// timeouts, `429` and `5xx` are worth retrying; other error statuses are not.
pub(crate) fn response<T>(sent: reqwest::Result<reqwest::Response>) -> Result<reqwest::Response, Attempt<T>> {
    let response = sent.map_err(|e| Attempt::Retry(describe(&e)))?;
    let status = response.status();
    if status.as_u16() == 429 || status.is_server_error() {
        return Err(Attempt::Retry(format!("status {status}")));
    }
    if !status.is_success() {
        return Err(Attempt::Fatal(format!("status {status}")));
    }
    Ok(response)
}

/// A client error in words: a timeout says so first.
pub(crate) fn describe(e: &reqwest::Error) -> String {
    if e.is_timeout() { format!("timed out: {}", ErrorChain(e)) } else { ErrorChain(e).to_string() }
}

/// The body, read chunk by chunk so an oversized answer is refused before it is held
/// whole.
pub(crate) async fn body<T>(mut response: reqwest::Response, max: usize) -> Result<Vec<u8>, Attempt<T>> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) if body.len() + chunk.len() > max => {
                return Err(Attempt::Fatal(format!("response larger than max_response_bytes ({max})")));
            }
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            Ok(None) => return Ok(body),
            Err(e) => return Err(Attempt::Retry(describe(&e))),
        }
    }
}

/// Runs `attempt` until it is done, fails fatally, or `max_retries` retries failed,
/// sleeping `backoff` between tries and calling `on_retry` before each retry; `Err`
/// carries the reason of the last attempt.
pub(crate) async fn with_retries<T, F, Fut>(
    max_retries: u32,
    backoff: Backoff,
    key: u64,
    mut on_retry: impl FnMut(&str),
    mut attempt: F,
) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Attempt<T>>,
{
    let mut retry = 0;
    loop {
        match attempt().await {
            Attempt::Done(value) => return Ok(value),
            Attempt::Fatal(reason) => return Err(reason),
            Attempt::Retry(reason) if retry >= max_retries => {
                return Err(format!("{reason} (after {} attempts)", retry + 1));
            }
            Attempt::Retry(reason) => {
                on_retry(&reason);
                tokio::time::sleep(backoff.delay(retry, key)).await;
                retry += 1;
            }
        }
    }
}
