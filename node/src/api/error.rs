//! The API's refusals: a status code and a JSON `error` that says what to do.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::views::ErrorBody;
use crate::error::RESERVE_MARK;

pub(crate) struct ApiError(pub StatusCode, pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

pub(crate) fn bad(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, e.to_string())
}

pub(crate) fn too_large(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::PAYLOAD_TOO_LARGE, e.to_string())
}

/// 507: the node's disk has no room for what was sent; retrying does not help
/// until space is freed.
pub(crate) fn disk_full(e: impl std::fmt::Display) -> ApiError {
    let message = e.to_string();
    // The reserve's refusal says already what to free.
    let message = if message.contains(RESERVE_MARK) {
        format!("{message}; or send this to another node")
    } else {
        format!(
            "{message}: this node's disk is full. Free space on it (`gpumesh forget` \
             finished tasks; their results leave every disk), or send this to another node"
        )
    };
    ApiError(StatusCode::INSUFFICIENT_STORAGE, message)
}

/// 503: the node cannot serve this now; a client retries. Where the cause is this
/// node's disk having no room (an I/O error's text says so, or the disk reserve's
/// refusal: an output fetched here to be served, say), 507 instead ([`disk_full`]):
/// retrying would not mend it.
pub(crate) fn unavailable(e: impl std::fmt::Display) -> ApiError {
    let message = e.to_string();
    if message.contains(&std::io::Error::from_raw_os_error(libc::ENOSPC).to_string())
        || message.contains(RESERVE_MARK)
    {
        return disk_full(message);
    }
    ApiError(StatusCode::SERVICE_UNAVAILABLE, message)
}

pub(crate) fn not_found(id: u64) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!(
            "no task t{id}: never made, or finished long enough ago to be forgotten (the \
             record keeps the newest {} finished tasks); `gpumesh tasks` lists the tasks \
             there are",
            gpumesh_consensus::KEPT_FINISHED_TASKS
        ),
    )
}

pub(crate) type ApiResult<T> = std::result::Result<T, ApiError>;
