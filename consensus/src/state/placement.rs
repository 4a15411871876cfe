//! Where a shard's attempt goes: one rule, used when a submit is applied (every
//! replica of the record places a new task's shards the same way, so no separate
//! assignment entry is needed) and by the leader's scheduler for what comes later
//! (a node that went down, a straggler's copy, a replica after a mismatch).
//!
//! An attempt goes to the member that minimises (attempts queued + 1) / measured
//! GFLOP/s among those with an adapter whose limits fit the task's largest buffer
//! and its kernel's workgroup (size and memory, where the submit recorded them) and
//! that the record does not hold down; replicas of one shard go to distinct nodes,
//! other hardware first.

use super::*;

/// A member that can take attempts.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub node: u64,
    pub gflops: f64,
    /// Largest buffer its adapter can bind.
    pub fits: u64,
    /// Its adapter's limits.
    pub limits: AdapterLimits,
    /// Bytes of GPU memory it keeps buffers in between runs.
    pub memory: u64,
    pub backend: gpumesh_protocol::BackendKind,
    /// Adapter and backend, so replicas can go to different hardware.
    pub kind: (String, String),
}

/// Members with an adapter, except those in `down`.
pub fn candidates(s: &StateMachine, down: &BTreeSet<u64>) -> Vec<Candidate> {
    s.members()
        .values()
        .filter(|m| !down.contains(&m.raft_id))
        .filter_map(|m| {
            let cap = m.capability.as_ref()?;
            Some(Candidate {
                node: m.raft_id,
                gflops: cap.gflops.max(0.1),
                fits: u64::from(cap.limits.max_storage_buffer_binding_size)
                    .min(cap.limits.max_buffer_size),
                limits: cap.limits,
                memory: cap.memory,
                backend: cap.backend,
                kind: (cap.adapter_name.clone(), cap.backend.name().to_string()),
            })
        })
        .collect()
}

/// What an attempt at one of a task's shards needs of a node's adapter.
#[derive(Clone, Copy, Debug)]
pub struct Need {
    /// Its largest buffer.
    pub binding: u64,
    /// Its kernel's workgroup, where the submit recorded it.
    pub kernel: Option<KernelNeeds>,
}

impl Need {
    pub fn of(t: &Task) -> Self {
        Need {
            binding: largest_binding(&t.spec),
            kernel: t.needs,
        }
    }

    /// Whether candidate `c`'s adapter can run it.
    pub fn met_by(&self, c: &Candidate) -> bool {
        c.fits >= self.binding && self.kernel.is_none_or(|k| k.exceeds(&c.limits).is_none())
    }
}

/// Largest buffer a task binds.
pub fn largest_binding(spec: &TaskSpec) -> u64 {
    spec.bindings
        .iter()
        .map(|b| b.role.size())
        .max()
        .unwrap_or(0)
}

/// How much less busy than the node holding a new task's inputs another must look
/// (its load over its speed) to be given the task instead. Enough to settle a tie
/// between like adapters (their measured speeds differ by a few percent) for the
/// node where the inputs are, which then pulls nothing (a 16 KiB input pulled cost
/// 0.9 ms of a 2.6 ms task here; 64 MiB, 30 ms); never enough to pass over an idler
/// node or a clearly faster one, whose kernel time the record cannot weigh.
const NEAR_INPUTS: f64 = 0.95;

/// The best candidate for one more attempt at a shard that `holders` already hold
/// (on hardware `kinds`), counting it in `load`; `near`, a node that holds the
/// task's inputs, is preferred by a twentieth (`NEAR_INPUTS`).
pub fn pick(
    candidates: &[Candidate],
    load: &mut BTreeMap<u64, u32>,
    need: &Need,
    holders: &BTreeSet<u64>,
    kinds: &[(String, String)],
    near: Option<u64>,
) -> Option<(u64, (String, String))> {
    let best = candidates
        .iter()
        .filter(|c| need.met_by(c) && !holders.contains(&c.node))
        .min_by(|a, b| {
            let score = |c: &Candidate| {
                // Same hardware as an existing replica counts as busier.
                let same = u32::from(kinds.contains(&c.kind)) * 1000;
                let score =
                    f64::from(load.get(&c.node).copied().unwrap_or(0) + 1 + same) / c.gflops;
                if near == Some(c.node) {
                    score * NEAR_INPUTS
                } else {
                    score
                }
            };
            score(a).total_cmp(&score(b))
        })?;
    *load.entry(best.node).or_default() += 1;
    Some((best.node, best.kind.clone()))
}

impl StateMachine {
    /// Members the leader has judged down (`MembersDown`): no new attempts go there.
    pub fn down(&self) -> &BTreeSet<u64> {
        &self.down
    }

    /// Places every attempt the new task `id` wants, as `AssignShard` would; a task
    /// with blob inputs leans to `origin`, the node it was submitted through, where
    /// a client uploads what it submits.
    pub(super) fn place_new_task(&mut self, index: u64, id: TaskId, origin: u64) {
        let candidates = candidates(self, &self.down);
        if candidates.is_empty() {
            return; // the scheduler places it once a member with an adapter joins
        }
        let mut load = self.queue_by_node();
        let Some(t) = self.task_mut(id) else {
            return;
        };
        let need = Need::of(t);
        let near = t
            .spec
            .bindings
            .iter()
            .any(|b| b.role.blob().is_some())
            .then_some(origin);
        for i in 0..t.shards.len() {
            let mut holders = BTreeSet::new();
            let mut kinds = Vec::new();
            for _ in 0..t.shards[i].wanted() {
                let Some((node, kind)) =
                    pick(&candidates, &mut load, &need, &holders, &kinds, near)
                else {
                    break;
                };
                holders.insert(node);
                kinds.push(kind);
                let s = &mut t.shards[i];
                let epoch = s.start_attempt(node, false);
                s.settle();
                t.record(
                    index,
                    Some(i as u32),
                    format!("attempt {epoch} on node {node:x}"),
                );
                t.status = TaskStatus::Running;
            }
        }
    }
}
