//! The actor host: runs the calls of the GPU actors the leader placed on this node,
//! one at a time per actor, in the order the log gave them; different actors' calls
//! run side by side (storing, copying and reporting overlap; the GPU thread takes
//! their kernels one after another).
//!
//! Owns nothing durable. An actor's state is in the record (a blob per buffer, by
//! version) and in the blob store; its bytes stay on this node's GPU between calls
//! (the executor keeps a call's final state buffers under the address of their
//! bytes, which is the next call's starting blob). A call runs as a one-shard task
//! with the state in-out at its bindings; the new state is stored, copied to one
//! other member, and reported with `ActorCallDone` — the call is acknowledged once
//! that is applied. A call that cannot run (its kernel does not fit, a deadline)
//! is reported with `ActorCallFailed` and leaves the state as it was; one that
//! cannot run *yet* (a blob not reachable) is tried again.
//!
//! Talks to: consensus (reads the actors hosted here, proposes results), blobs
//! (state, inputs, outputs and their copies), peers (who holds what), the GPU
//! thread, the kernel cache.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use gpumesh_consensus::{ActorState, Command, ConsensusHandle, MergedOutput};
use gpumesh_protocol::{ActorCall, BlobId, ShardChanges, StateBuffer};
use gpumesh_shaders::{Job, KernelCache};
use libp2p::PeerId;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::blobs::BlobsHandle;
use crate::identity;
use crate::peers::PeersHandle;
use crate::wire::{Changes, NextState};
use crate::worker::GpuHandle;

/// Changes up to this size go to the backup inside the request; larger ones as a blob.
const INLINE_CHANGES: usize = 1 << 20;

/// How long to wait before trying again a call that could not run yet.
const RETRY: Duration = Duration::from_millis(200);

pub(crate) struct ActorHost {
    pub me: u64,
    pub consensus: ConsensusHandle,
    pub blobs: BlobsHandle,
    pub peers: PeersHandle,
    pub kernels: Arc<KernelCache>,
    pub gpu: GpuHandle,
    pub default_deadline: Duration,
    /// Calls run here whose result the record took (`gpumesh_actor_calls_total`).
    pub calls: prometheus_client::metrics::counter::Counter,
}

/// The next call of one actor hosted here, with what running it needs.
struct Turn {
    name: String,
    seq: u64,
    epoch: u32,
    call: ActorCall,
    caller: String,
    state: Vec<ActorState>,
    backup: Option<u64>,
    creator: String,
}

impl ActorHost {
    /// Runs each hosted actor's calls in order, one at a time per actor; different
    /// actors' calls run side by side (they meet only on the GPU thread).
    pub async fn run(self, cancel: CancellationToken) {
        let host = Arc::new(self);
        let mut applied = host.consensus.watch_state();
        // The state each actor's last call here left on the GPU, by actor.
        let mut on_gpu: HashMap<String, Vec<BlobId>> = HashMap::new();
        // Actors with a call under way here, and those calls.
        let mut busy: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut running: JoinSet<Option<Vec<BlobId>>> = JoinSet::new();
        loop {
            applied.borrow_and_update();
            host.release_gone(&mut on_gpu).await;
            for turn in host.turns() {
                if !busy.values().any(|n| *n == turn.name) {
                    let (host, name) = (host.clone(), turn.name.clone());
                    let task = running.spawn(async move { host.turn(turn).await });
                    busy.insert(task.id(), name);
                }
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {
                    running.abort_all();
                    return;
                }
                Some(done) = running.join_next_with_id(), if !running.is_empty() => {
                    let (task, state) = match done {
                        Ok((task, state)) => (task, state),
                        Err(e) => (e.id(), None),
                    };
                    if let (Some(name), Some(state)) = (busy.remove(&task), state) {
                        on_gpu.insert(name, state);
                    }
                }
                changed = applied.changed() => if changed.is_err() { return },
            }
        }
    }

    /// Runs one call and reports it; returns, when the call ran, the state it left
    /// on the GPU. A call that could not run yet, or whose report could not be made,
    /// is tried again after a pause.
    async fn turn(&self, turn: Turn) -> Option<Vec<BlobId>> {
        let (name, seq) = (turn.name.clone(), turn.seq);
        let Some(report) = self.take(turn).await else {
            tokio::time::sleep(RETRY).await;
            return None;
        };
        let state = match &report {
            Command::ActorCallDone { state, .. } => Some(state.iter().map(|(_, b)| *b).collect()),
            _ => None,
        };
        let done = state.is_some();
        match self.consensus.propose(report).await {
            Ok(c) if done && c.outcome == gpumesh_consensus::Outcome::Applied => {
                self.calls.inc();
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(actor = %name, seq, error = %e, "could not report the call");
                tokio::time::sleep(RETRY).await;
            }
        }
        state
    }

    /// Frees the GPU buffers of actors no longer hosted here (deleted, or moved to
    /// another node).
    async fn release_gone(&self, on_gpu: &mut HashMap<String, Vec<BlobId>>) {
        if on_gpu.is_empty() {
            return;
        }
        let me = self.me;
        let hosted: HashSet<String> = self.consensus.read_local(move |s| {
            s.actors()
                .values()
                .filter(|a| a.host == Some(me))
                .map(|a| a.name.clone())
                .collect()
        });
        let gone: Vec<String> = on_gpu
            .keys()
            .filter(|n| !hosted.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            let blobs = on_gpu.remove(&name).unwrap_or_default();
            tracing::debug!(actor = %name, "no longer hosted here; its GPU buffers are freed");
            self.gpu.forget(blobs).await;
        }
    }

    /// The next call of every actor hosted here under its current epoch.
    fn turns(&self) -> Vec<Turn> {
        let me = self.me;
        self.consensus.read_local(move |s| {
            s.actors()
                .values()
                .filter(|a| a.host == Some(me))
                .filter_map(|a| {
                    let (seq, pending) = a.next_call()?;
                    Some(Turn {
                        name: a.name.clone(),
                        seq,
                        epoch: a.epoch,
                        call: pending.call.clone(),
                        caller: pending.caller.clone(),
                        state: a.state.clone(),
                        backup: a.backup,
                        creator: a.creator.clone(),
                    })
                })
                .collect()
        })
    }

    /// Runs one call; `None` when it cannot run yet.
    async fn take(&self, t: Turn) -> Option<Command> {
        let failed = |reason: String| Command::ActorCallFailed {
            name: t.name.clone(),
            seq: t.seq,
            epoch: t.epoch,
            node: self.me,
            reason,
        };
        // The state's bytes, from the node that keeps its copy or its creator; the
        // call's inputs, from the node it came through.
        let holder = t
            .backup
            .and_then(|b| self.peers.peer(b))
            .or_else(|| t.creator.parse().ok());
        for blob in t.state.iter().filter_map(|s| s.blob) {
            if let Err(e) = self.blobs.fetch(blob, holder).await {
                tracing::warn!(actor = %t.name, error = %e, "the actor's state is not reachable yet");
                return None;
            }
        }
        let caller: Option<PeerId> = t.caller.parse().ok();
        for blob in t.call.bindings.iter().filter_map(|b| b.role.blob()) {
            if let Err(e) = self.blobs.fetch(blob, caller).await {
                tracing::warn!(actor = %t.name, seq = t.seq, error = %e, "a call input is not reachable yet");
                return None;
            }
        }
        let pairs: Vec<(StateBuffer, Option<BlobId>)> =
            t.state.iter().map(|s| (s.buffer, s.blob)).collect();
        let spec = t.call.as_task(&pairs);
        let kernel = match self.kernels.get(&spec.shader, &spec.entry_point) {
            Ok(k) => k,
            Err(e) => return Some(failed(e.to_string())),
        };
        let store = self.blobs.store().clone();
        let state_bindings: Vec<u32> = t.state.iter().map(|s| s.buffer.binding).collect();
        let job = match Job::new(spec, kernel, |id| {
            store.get(id).ok().flatten().map(Arc::from)
        })
        .and_then(|j| j.keep_resident(state_bindings.iter().copied()))
        {
            Ok(job) => job,
            Err(e) => return Some(failed(e.to_string())),
        };
        let deadline = t
            .call
            .deadline_ms
            .map_or(self.default_deadline, Duration::from_millis);
        let out = match self.gpu.run(job.clone(), 0, Some(deadline)).await {
            Ok(out) => out,
            Err(e) => return Some(failed(e.to_string())),
        };
        let merged = {
            let (job, changes) = (job.clone(), out.changes.clone());
            match tokio::task::spawn_blocking(move || job.merge(&[&changes])).await {
                Ok(Ok(merged)) => merged,
                Ok(Err(e)) => return Some(failed(e.to_string())),
                Err(_) => return None,
            }
        };
        // The new state and what the call changed in it, here; the node that keeps
        // the actor's second copy makes the same new state from the old one and the
        // changes (only they travel), or another member does from the whole state.
        let changed = ShardChanges(
            out.changes
                .0
                .into_iter()
                .filter(|(b, _)| state_bindings.contains(b))
                .collect(),
        );
        let base = t.state.clone();
        let prepared = tokio::task::spawn_blocking(move || {
            let mut merged = merged;
            let mut next = Vec::with_capacity(base.len());
            let mut state = Vec::with_capacity(base.len());
            // The state buffers move out of `merged`; what is left are the outputs.
            for s in &base {
                let binding = s.buffer.binding;
                let bytes = merged
                    .remove(&binding)
                    .ok_or_else(|| format!("the call left no state at binding {binding}"))?;
                next.push(NextState {
                    binding,
                    size: s.buffer.size,
                    base: s.blob,
                    next: BlobId::of(&bytes),
                });
                state.push(bytes);
            }
            let outputs: Vec<(u32, Vec<u8>)> = merged.into_iter().collect();
            Ok::<_, String>((next, state, changed.encode(), outputs))
        })
        .await;
        let (next, state_bytes, changes, merged) = match prepared {
            Ok(Ok(prepared)) => prepared,
            Ok(Err(e)) => {
                tracing::warn!(actor = %t.name, error = %e, "could not prepare the actor's new state");
                return None;
            }
            Err(_) => return None,
        };
        // Small changes travel in the request; larger ones as a blob pulled from here.
        let store = self.blobs.store().clone();
        let changes = if changes.len() <= INLINE_CHANGES {
            Changes::Inline(changes)
        } else {
            let put = tokio::task::spawn_blocking(move || store.put(&changes)).await;
            match put {
                Ok(Ok(id)) => Changes::Blob(id),
                Ok(Err(e)) => {
                    tracing::warn!(actor = %t.name, error = %e, "could not store the call's changes");
                    return None;
                }
                Err(_) => return None,
            }
        };
        let state = next.iter().map(|n| (n.binding, n.next)).collect();
        let prefer = t.backup.and_then(|b| self.peers.peer(b));
        // This node's copy is written while the backup makes its own.
        let store = self.blobs.store().clone();
        let own = tokio::task::spawn_blocking(move || {
            state_bytes
                .iter()
                .try_for_each(|bytes| store.put(bytes).map(|_| ()))
        });
        let (own, copy) = tokio::join!(own, self.blobs.advance(changes, next, prefer));
        match own {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(actor = %t.name, error = %e, "could not store the actor's new state");
                return None;
            }
            Err(_) => return None,
        }
        let backup = match copy {
            Ok(by) => by,
            Err(e) => {
                tracing::warn!(actor = %t.name, error = %e, "no second copy of the actor's state yet");
                return None;
            }
        };
        let mut outputs = Vec::new();
        for (binding, bytes) in merged {
            let size = bytes.len() as u64;
            let blob = match self.blobs.put_and_copy(bytes, caller).await {
                Ok(blob) => blob,
                Err(e) => {
                    tracing::warn!(actor = %t.name, error = %e, "could not keep a call's output");
                    return None;
                }
            };
            outputs.push(MergedOutput {
                binding,
                blob,
                size,
                node: self.me,
            });
        }
        Some(Command::ActorCallDone {
            name: t.name,
            seq: t.seq,
            epoch: t.epoch,
            node: self.me,
            state,
            backup: backup.map_or(self.me, |p| identity::raft_id(&p)),
            outputs,
        })
    }
}
