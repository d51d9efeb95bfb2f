//! What every route shares: OpenAI's error shape and the parsing of a request body.

use std::borrow::Cow;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::types::{ErrorBody, ErrorDetail};

/// A request body as `T`, keeping the path of the field where it went wrong. The
/// body must be one JSON value: anything after it but whitespace is refused (it was
/// ignored, so `{...} {"n": 64}` was served as the first object alone).
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> std::result::Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| ApiError::json(what, &e))?;
    de.end().map_err(|e| ApiError::bad(format!("request body is not a valid {what} request: {e}"), None))?;
    Ok(value)
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A 4xx/5xx answer in OpenAI's error shape.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) param: Option<Cow<'static, str>>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self { status, message: message.into(), param: param.map(Cow::Borrowed) }
    }

    pub(crate) fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message, param)
    }

    /// A body that is not the JSON `what` expects: 400 naming where it went wrong
    /// (`param`: the field's path, e.g. `stop[2]`), as serde found it.
    pub(crate) fn json(what: &str, e: &serde_path_to_error::Error<serde_json::Error>) -> Self {
        let path = e.path().to_string();
        let param = (path != ".").then_some(Cow::Owned(path));
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!("request body is not a valid {what} request: {e}"),
            param,
        }
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
                param: self.param.map(Cow::into_owned),
                code: Some(self.status.as_u16()),
            },
        };
        (self.status, Json(body)).into_response()
    }
}
