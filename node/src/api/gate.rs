//! What may reach a handler: the bearer token off loopback, and body sizes within
//! the node's limits (refused before the body is read when its length is announced).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::{too_large, ApiError, ApiResult};
use crate::error::NodeError;
use crate::limits::Limits;

/// The most bytes a request body may have, and how to name it when it has more.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BodyCap {
    what: &'static str,
    limit: u64,
    setting: &'static str,
}

impl BodyCap {
    /// For axum's `DefaultBodyLimit`, which stops reading one byte past it.
    pub(crate) fn max(&self) -> usize {
        usize::try_from(self.limit).unwrap_or(usize::MAX)
    }

    fn refuse(&self, size: Option<u64>) -> ApiError {
        too_large(match size {
            Some(size) => NodeError::Limit {
                what: self.what,
                value: size,
                limit: self.limit,
                setting: self.setting,
            }
            .to_string(),
            None => format!(
                "{} is over the limit of {} (the node's {})",
                self.what, self.limit, self.setting
            ),
        })
    }

    /// The body, or a refusal naming the limit it went over while it was read.
    pub(crate) fn within(
        &self,
        body: std::result::Result<Bytes, BytesRejection>,
    ) -> ApiResult<Bytes> {
        body.map_err(|rejection| match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => self.refuse(None),
            status => ApiError(status, rejection.body_text()),
        })
    }
}

/// Blob uploads answer to the blob limit; every other body to the request limit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BodyCaps {
    pub blob: BodyCap,
    pub request: BodyCap,
}

impl BodyCaps {
    pub(crate) fn of(limits: &Limits) -> Self {
        BodyCaps {
            blob: BodyCap {
                what: "the blob's size in bytes",
                limit: limits.max_blob_bytes,
                setting: "--max-blob-bytes",
            },
            request: BodyCap {
                what: "the request body's size in bytes",
                limit: limits.max_request_bytes,
                setting: "--max-request-bytes",
            },
        }
    }

    fn for_path(&self, path: &str) -> BodyCap {
        if path == "/v1/blobs" {
            self.blob
        } else {
            self.request
        }
    }
}

/// Who may call the API: anyone (loopback), or holders of the token.
#[derive(Clone)]
pub(crate) struct Gate {
    pub token: Option<Arc<String>>,
}

/// Compares in time independent of where the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Refuses, with 401 and a JSON error, a request off loopback without the token. The
/// dashboard's page itself is served (it holds no data; it sends the token it is
/// given in its address, `/#token=TOKEN`, with each request it makes).
pub(crate) async fn bearer(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    let Some(token) = &gate.token else {
        return next.run(request).await;
    };
    if request.uri().path() == "/" {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(t) if same_secret(t.as_bytes(), token.as_bytes()) => next.run(request).await,
        Some(_) => ApiError(
            StatusCode::UNAUTHORIZED,
            "wrong API token: the node's token is in its data dir (api.token); give it \
             with --token, GPUMESH_TOKEN or --data-dir"
                .into(),
        )
        .into_response(),
        None => ApiError(
            StatusCode::UNAUTHORIZED,
            "this node's API is served off loopback and requires `Authorization: Bearer \
             TOKEN`; the token is in the node's data dir (api.token): give it with --token, \
             GPUMESH_TOKEN or --data-dir"
                .into(),
        )
        .into_response(),
    }
}

/// Refuses a body whose announced length is over its cap before reading any of it,
/// so a client waiting for `100 Continue` is answered at once and sends nothing.
/// Bodies without a length are cut off by `DefaultBodyLimit` as they are read.
pub(crate) async fn announced_within(
    State(caps): State<BodyCaps>,
    request: Request,
    next: Next,
) -> Response {
    let cap = caps.for_path(request.uri().path());
    let announced = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match announced {
        Some(size) if size > cap.limit => cap.refuse(Some(size)).into_response(),
        _ => next.run(request).await,
    }
}
