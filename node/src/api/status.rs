//! `GET /v1/status` (leader, term, members as this node sees them) and `GET /metrics`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::error::{unavailable, ApiResult};
use super::state::ApiState;
use super::views::{members, StatusView};

pub(crate) async fn status(State(api): State<Arc<ApiState>>) -> ApiResult<Json<StatusView>> {
    let c = &api.consensus;
    let st = c.status().await.map_err(unavailable)?;
    let liveness = api.liveness.view();
    let members = c.read_local(move |s| members(s, &liveness));
    Ok(Json(StatusView {
        node: api.raft_id,
        peer_id: api.peer_id.to_string(),
        leader: st.leader_id,
        term: st.term,
        commit_index: st.commit_index,
        applied_index: st.applied_index,
        members,
        actors: super::actors::all(&api),
        data_format: gpumesh_protocol::FORMAT,
    }))
}

/// This node's metrics in the OpenMetrics text format; what is read rather than
/// counted (tasks by status, the blob store) is refreshed first.
pub(crate) async fn metrics(State(api): State<Arc<ApiState>>) -> ApiResult<Response> {
    api.metrics
        .refresh(&api.consensus, api.blobs.store(), &api.kernels)
        .await;
    let text = api
        .metrics
        .encode()
        .map_err(|e| unavailable(format!("could not encode the metrics: {e}")))?;
    Ok(([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response())
}
