//! The web dashboard every node serves on its API address: `GET /` is one
//! self-contained page (no external scripts, fonts or styles: a mesh may have no
//! internet), which polls `GET /v1/overview` once a second.
//!
//! The overview is shaped for the page: node ids as hex strings (JavaScript numbers
//! lose precision past 2^53, and raft ids are 64-bit), members with what this node
//! knows of their liveness, the newest tasks with their shard progress and history,
//! and each member's count of accepted shards, which the page turns into a
//! throughput plot.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{Html, IntoResponse};
use axum::Json;
use gpumesh_consensus::{ShardState, StateMachine};
use serde::{Deserialize, Serialize};

use super::error::{unavailable, ApiResult};
use super::state::ApiState;
use super::throughput::ThroughputPoint;
use super::views::hex;
use super::views::kernel_name;
use crate::liveness::{LivenessView, Presence};

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
    pub members: Vec<OverviewMember>,
    /// Tasks by status over the whole record.
    pub counts: HashMap<String, usize>,
    pub tasks: Vec<OverviewTask>,
    /// Shard results per second, by node (hex), one point a second, oldest first.
    pub throughput: Vec<ThroughputPoint>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OverviewMember {
    pub id: String,
    pub peer_id: String,
    pub role: String,
    /// Heard from recently (its heartbeat is fresh) and reachable from this node.
    pub alive: bool,
    /// This node's transport has lost it (connections closed, redial refused).
    pub unreachable: bool,
    pub adapter: Option<String>,
    pub backend: Option<String>,
    pub gflops: Option<f64>,
    pub gbps: Option<f64>,
    /// Attempts placed on it and not finished.
    pub queue: u32,
    /// Shard results of this member accepted so far (all tasks the record holds).
    pub shards_done: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OverviewTask {
    pub id: u64,
    pub status: String,
    pub reason: Option<String>,
    pub kernel: String,
    pub shards: usize,
    pub done: usize,
    pub running: usize,
    pub replicas: u32,
    pub mismatches: u32,
    pub shard_list: Vec<OverviewShard>,
    pub history: Vec<OverviewEvent>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OverviewShard {
    pub index: u32,
    pub state: String,
    /// Nodes (hex) of the attempts in flight, or of the accepted result.
    pub nodes: Vec<String>,
    pub epoch: u32,
    pub failures: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OverviewEvent {
    pub index: u64,
    pub shard: Option<u32>,
    pub what: String,
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
        throughput: api.throughput.points(),
    }))
}

type Summary = (
    Vec<OverviewMember>,
    HashMap<String, usize>,
    Vec<OverviewTask>,
);

fn summarize(s: &StateMachine, liveness: &LivenessView) -> Summary {
    let queue = s.queue_by_node();
    let mut done: HashMap<u64, u64> = HashMap::new();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for t in s.tasks().values() {
        *counts.entry(t.status.name().to_string()).or_default() += 1;
        for sh in &t.shards {
            if let Some(out) = &sh.output {
                *done.entry(out.node).or_default() += 1;
            }
        }
    }
    let members = s
        .members()
        .values()
        .map(|m| OverviewMember {
            id: hex(m.raft_id),
            peer_id: m.peer_id.clone(),
            role: format!("{:?}", m.role).to_lowercase(),
            alive: liveness.is_alive(m.raft_id),
            unreachable: liveness.presence(m.raft_id) == Presence::Unreachable,
            adapter: m.capability.as_ref().map(|c| c.adapter_name.clone()),
            backend: m.capability.as_ref().map(|c| c.backend.name().to_string()),
            gflops: m.capability.as_ref().map(|c| c.gflops),
            gbps: m.capability.as_ref().map(|c| c.gbps),
            queue: queue.get(&m.raft_id).copied().unwrap_or(0),
            shards_done: done.get(&m.raft_id).copied().unwrap_or(0),
        })
        .collect();
    let tasks = s
        .tasks()
        .values()
        .rev()
        .take(OVERVIEW_TASKS)
        .map(|t| OverviewTask {
            id: t.id.0,
            status: t.status.name().to_string(),
            reason: t.status.reason().map(str::to_string),
            kernel: kernel_name(&t.spec),
            shards: t.shards.len(),
            done: t
                .shards
                .iter()
                .filter(|sh| sh.state == ShardState::Done)
                .count(),
            running: t
                .shards
                .iter()
                .filter(|sh| sh.state == ShardState::Running)
                .count(),
            replicas: t.spec.options.replicas,
            mismatches: t.mismatches,
            shard_list: t
                .shards
                .iter()
                .enumerate()
                .map(|(i, sh)| OverviewShard {
                    index: i as u32,
                    state: format!("{:?}", sh.state).to_lowercase(),
                    nodes: match &sh.output {
                        Some(out) => vec![hex(out.node)],
                        None => sh.attempts.iter().map(|a| hex(a.node)).collect(),
                    },
                    epoch: sh.epoch,
                    failures: sh.failures,
                })
                .collect(),
            history: t
                .history
                .iter()
                .map(|e| OverviewEvent {
                    index: e.index,
                    shard: e.shard,
                    what: e.what.clone(),
                })
                .collect(),
        })
        .collect();
    (members, counts, tasks)
}
