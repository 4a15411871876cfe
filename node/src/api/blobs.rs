//! `POST /v1/blobs` and `GET /v1/blobs/{id}`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use gpumesh_protocol::BlobId;

use super::error::{bad, disk_full, too_large, unavailable, ApiError, ApiResult};
use super::gate::BodyCaps;
use super::state::ApiState;
use super::views::BlobReply;
use crate::error::NodeError;

pub(crate) async fn put_blob(
    State(api): State<Arc<ApiState>>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<BlobReply>> {
    let body = BodyCaps::of(&api.limits).blob.within(body)?;
    let size = body.len() as u64;
    let store = api.blobs.store().clone();
    let id = tokio::task::spawn_blocking(move || store.put(&body))
        .await
        .map_err(unavailable)?
        .map_err(|e| match e {
            NodeError::Limit { .. } => too_large(e),
            e if e.is_disk_full() => disk_full(format!("could not store the blob: {e}")),
            e => unavailable(format!("could not store the blob: {e}")),
        })?;
    Ok(Json(BlobReply {
        id: id.to_hex(),
        size,
    }))
}

pub(crate) async fn get_blob(
    State(api): State<Arc<ApiState>>,
    Path(id): Path<String>,
) -> ApiResult<Vec<u8>> {
    let id: BlobId = id.parse().map_err(bad)?;
    api.blobs
        .fetch(id, None)
        .await
        .map_err(|e| ApiError(StatusCode::NOT_FOUND, e.to_string()))?;
    api.blobs
        .store()
        .get(&id)
        .map_err(unavailable)?
        .ok_or_else(|| {
            ApiError(
                StatusCode::NOT_FOUND,
                format!("blob {id} is not on this node"),
            )
        })
}
