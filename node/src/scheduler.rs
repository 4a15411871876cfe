//! The scheduler: on the Raft leader only, turns pending shards into assignments.
//!
//! Each pending shard goes to the member that minimises (shards queued + 1) / measured
//! GFLOP/s among those whose adapter limits fit the task's buffers, so placement is
//! proportional to capability and current queue. Members without an adapter stay in
//! the mesh and get nothing. A shard that failed `MAX_FAILURES` times cancels its task
//! with the last error. Talks to: raft (reads state, proposes).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpumesh_consensus::{Command, ConsensusHandle, RaftRole, ShardState, StateMachine, TaskId};
use gpumesh_protocol::{BindingRole, TaskSpec};
use tokio_util::sync::CancellationToken;

/// Failures of one shard before its task is cancelled.
pub const MAX_FAILURES: u32 = 3;
/// A member whose last heartbeat is older than this gets no new shards.
pub const STALE_AFTER: Duration = Duration::from_secs(15);

pub struct Scheduler {
    pub consensus: ConsensusHandle,
    pub interval: Duration,
}

/// What the scheduler decided in one pass.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    pub assign: Vec<(TaskId, u32, u64)>,
    pub cancel: Vec<(TaskId, String)>,
}

impl Scheduler {
    pub async fn run(self, cancel: CancellationToken) {
        let mut events = self.consensus.subscribe();
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Assignments proposed but not yet applied, so a pass does not repeat them.
        let mut in_flight: HashSet<(TaskId, u32)> = HashSet::new();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                Some(key) = done_rx.recv() => { in_flight.remove(&key); continue; }
                _ = events.recv() => {}
                _ = tick.tick() => {}
            }
            if self.consensus.watch_status().borrow().role != RaftRole::Leader {
                in_flight.clear();
                continue;
            }
            let now = now_ms();
            let Ok(plan) = self.consensus.read_local(move |s| plan(s, now)).await else {
                continue;
            };
            for (task, shard, node) in plan.assign {
                if !in_flight.insert((task, shard)) {
                    continue;
                }
                let consensus = self.consensus.clone();
                let done = done_tx.clone();
                tokio::spawn(async move {
                    if let Err(e) = consensus
                        .propose(Command::AssignShard { task, shard, node })
                        .await
                    {
                        tracing::debug!(error = %e, %task, shard, "assignment not committed");
                    }
                    let _ = done.send((task, shard));
                });
            }
            for (task, reason) in plan.cancel {
                let consensus = self.consensus.clone();
                tokio::spawn(async move {
                    let _ = consensus
                        .propose(Command::TaskCancelled { task, reason })
                        .await;
                });
            }
        }
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Largest buffer a task binds.
fn largest_binding(spec: &TaskSpec) -> u64 {
    spec.bindings
        .iter()
        .map(|b| match &b.role {
            BindingRole::Input { size, .. } | BindingRole::Output { size } => *size,
            BindingRole::Param { data } => data.len() as u64,
        })
        .max()
        .unwrap_or(0)
}

/// One scheduling pass over the replicated state (pure, so it is tested directly).
pub fn plan(s: &StateMachine, now_ms: u64) -> Plan {
    let mut load: BTreeMap<u64, u32> = BTreeMap::new();
    for t in s.tasks().values().filter(|t| !t.status.is_terminal()) {
        for sh in &t.shards {
            if let (Some(n), ShardState::Assigned | ShardState::Running) =
                (sh.assigned_to, sh.state)
            {
                *load.entry(n).or_default() += 1;
            }
        }
    }
    let workers: Vec<(u64, f64, u64)> = s
        .members()
        .values()
        .filter_map(|m| {
            let cap = m.capability.as_ref()?;
            let fresh = m
                .last_heartbeat
                .is_none_or(|h| now_ms.saturating_sub(h.at_ms) < STALE_AFTER.as_millis() as u64);
            let fits = u64::from(cap.limits.max_storage_buffer_binding_size)
                .min(cap.limits.max_buffer_size);
            fresh.then_some((m.raft_id, cap.gflops.max(0.1), fits))
        })
        .collect();
    let mut out = Plan::default();
    for t in s.tasks().values().filter(|t| !t.status.is_terminal()) {
        let need = largest_binding(&t.spec);
        for (i, sh) in t.shards.iter().enumerate() {
            if sh.failures >= MAX_FAILURES {
                out.cancel.push((
                    t.id,
                    format!(
                        "shard {i} failed {} times; last error: {}",
                        sh.failures,
                        sh.last_error.as_deref().unwrap_or("unknown")
                    ),
                ));
                break;
            }
            if sh.state != ShardState::Pending {
                continue;
            }
            let best = workers
                .iter()
                .filter(|(_, _, fits)| *fits >= need)
                .min_by(|a, b| {
                    let score = |w: &(u64, f64, u64)| {
                        f64::from(load.get(&w.0).copied().unwrap_or(0) + 1) / w.1
                    };
                    score(a).total_cmp(&score(b))
                });
            if let Some(&(node, _, _)) = best {
                *load.entry(node).or_default() += 1;
                out.assign.push((t.id, i as u32, node));
            }
        }
    }
    out
}
