//! `GET /v1/status` (leader, term, members as this node sees them), `GET /metrics`,
//! `POST /v1/leave` and `DELETE /v1/members/{id}`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;

use axum::http::StatusCode;

use super::error::{unavailable, ApiError, ApiResult};
use super::state::ApiState;
use super::views::{members, LeftView, StatusView};
use crate::mesh::{NotLeft, REMOVAL_WAIT};

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

/// Removes a member that is gone for good (its machine lost), named by its raft id
/// in hex as `gpumesh status` shows it: the mesh's quorum stops counting on it.
/// Refused for this node itself and for a member that runs (`gpumesh leave` on it
/// hands its data off first).
pub(crate) async fn remove_member(
    State(api): State<Arc<ApiState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let raft_id = u64::from_str_radix(id.trim_start_matches("0x"), 16).map_err(|_| {
        super::error::bad(format!(
            "{id:?} is not a raft id: give it in hex, as `gpumesh status` shows it"
        ))
    })?;
    if raft_id == api.raft_id {
        return Err(ApiError(
            StatusCode::CONFLICT,
            "that is this node: `gpumesh leave` takes it out of the mesh (its results and actor \
             states handed to other members first)"
                .into(),
        ));
    }
    if !api
        .consensus
        .read_local(move |s| s.member(raft_id).is_some())
    {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no member {raft_id:x}; `gpumesh status` lists the members"),
        ));
    }
    if api.liveness.view().is_alive(raft_id) {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!(
                "member {raft_id:x} runs, as this node sees it: `gpumesh leave --api ITS_API` takes \
                 it out with its results and actor states handed to other members first; remove \
                 is for a member that is gone for good"
            ),
        ));
    }
    match tokio::time::timeout(REMOVAL_WAIT, api.consensus.remove(raft_id)).await {
        Ok(Ok(_)) => Ok(Json(
            serde_json::json!({ "removed": format!("{raft_id:x}") }),
        )),
        Ok(Err(e)) => Err(unavailable(format!(
            "member {raft_id:x} was not removed: {e}"
        ))),
        Err(_) => Err(unavailable(format!(
            "member {raft_id:x} was not removed within {REMOVAL_WAIT:?} (is a majority of the \
             voters running?); it may yet be: see `gpumesh status`"
        ))),
    }
}
