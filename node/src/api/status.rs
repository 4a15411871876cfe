//! `GET /v1/status` (leader, term, members as this node sees them), `GET /metrics`
//! and `POST /v1/leave`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;

use axum::http::StatusCode;

use super::error::{unavailable, ApiError, ApiResult};
use super::state::ApiState;
use super::views::{members, LeftView, StatusView};
use crate::mesh::NotLeft;

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

/// Takes this node out of the mesh for good (see `crate::mesh::leave`), then it
/// stops. A refusal (the only voter, a leave under way) answers 409, a failure
/// before the removal committed 503; either way the node stays a member.
pub(crate) async fn leave(State(api): State<Arc<ApiState>>) -> ApiResult<Json<LeftView>> {
    let Some(leaving) = &api.leaving else {
        return Err(unavailable(
            "this node cannot leave: it is not running as a mesh node",
        ));
    };
    match leaving.leave().await {
        Ok(left) => Ok(Json(left)),
        Err(NotLeft::Refused(why)) => Err(ApiError(StatusCode::CONFLICT, why)),
        Err(NotLeft::Failed(why)) => Err(unavailable(why)),
    }
}
