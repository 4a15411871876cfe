//! The web dashboard every node serves on its API address: `GET /` is one
//! self-contained page (no external scripts, fonts or styles: a mesh may have no
//! internet), which polls `GET /v1/overview` once a second.
//!
//! The overview holds the same views as the rest of the API — members as
//! `GET /v1/status` shows them, tasks as `GET /v1/tasks/{id}` — with the node ids the
//! page uses as hex strings (JavaScript numbers lose precision past 2^53, and raft
//! ids are 64-bit), task counts by state, and the throughput series the page plots.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{Html, IntoResponse};
use axum::Json;
use gpumesh_consensus::StateMachine;
use gpumesh_protocol::TaskState;
use serde::{Deserialize, Serialize};

use super::error::{unavailable, ApiResult};
use super::state::ApiState;
use super::throughput::ThroughputPoint;
use super::views::{hex, members, view, ActorView, MemberView, TaskView};
use crate::liveness::LivenessView;

/// Tasks the overview lists in full, newest first; older ones are only counted.
pub const OVERVIEW_TASKS: usize = 100;

const PAGE: &str = include_str!("dashboard.html");

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Overview {
    /// This node's raft id, hex.
    pub node: String,
    pub peer_id: String,
    /// The leader's raft id, hex; empty when none is known.
    pub leader: String,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub members: Vec<MemberView>,
    /// Tasks by status over the whole record.
    pub counts: HashMap<TaskState, usize>,
    /// The newest tasks, at most [`OVERVIEW_TASKS`].
    pub tasks: Vec<TaskView>,
    /// Every GPU actor (the page works out calls per second from versions).
    pub actors: Vec<ActorView>,
    /// Shard results per second, by node (hex), one point a second, oldest first.
    pub throughput: Vec<ThroughputPoint>,
}

pub(crate) async fn page() -> impl IntoResponse {
    ([(header::CACHE_CONTROL, "no-cache")], Html(PAGE))
}

pub(crate) async fn overview(State(api): State<Arc<ApiState>>) -> ApiResult<Json<Overview>> {
    let c = &api.consensus;
    let st = c.status().await.map_err(unavailable)?;
    let liveness = api.liveness.view();
    let (members, counts, tasks) = c.read_local(move |s| summarize(s, &liveness));
    Ok(Json(Overview {
        node: hex(api.raft_id),
        peer_id: api.peer_id.to_string(),
        leader: if st.leader_id == 0 {
            String::new()
        } else {
            hex(st.leader_id)
        },
        term: st.term,
        commit_index: st.commit_index,
        applied_index: st.applied_index,
        members,
        counts,
        tasks,
        actors: super::actors::all(&api),
        throughput: api.throughput.points(),
    }))
}

type Summary = (Vec<MemberView>, HashMap<TaskState, usize>, Vec<TaskView>);

fn summarize(s: &StateMachine, liveness: &LivenessView) -> Summary {
    let mut counts: HashMap<TaskState, usize> = HashMap::new();
    for t in s.tasks() {
        *counts.entry(t.status.state()).or_default() += 1;
    }
    let tasks = s.tasks().rev().take(OVERVIEW_TASKS).map(view).collect();
    (members(s, liveness), counts, tasks)
}
