//! The actor host: runs the calls of the GPU actors the leader placed on this node,
//! one at a time per actor, in the order the log gave them; different actors' calls
//! run side by side (storing, copying and reporting overlap; the GPU thread takes
//! their kernels one after another).
//!
//! Owns nothing durable. An actor's state is in the record (a blob per buffer, by
//! version) and in the blob store; its bytes stay on this node's GPU between calls
//! (the executor keeps a call's final state buffers under the address of their
//! bytes, which is the next call's starting blob). A call runs as a one-shard task
//! with the state in-out at its bindings. The calls waiting when a turn begins (up
//! to [`MAX_BATCH`]) run back to back, each on the state the one before left; the
//! state after the last is stored, copied to one other member (as what changed
//! since the state it holds), and the whole batch is reported in one
//! `ActorCallsDone` — each call is acknowledged once that is applied, so the states
//! between were never promised to anyone. A call that cannot run (its kernel does
//! not fit, a deadline) is reported failed and leaves the state as it was; one
//! that cannot run *yet* (a blob not reachable) waits, with the calls after it,
//! for the next turn.
//!
//! Talks to: consensus (reads the actors hosted here, proposes results), blobs
//! (state, inputs, outputs and their copies), peers (who holds what), the GPU
//! thread, the kernel cache.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use gpumesh_consensus::{ActorState, CallRan, Command, ConsensusHandle, MergedOutput};
use gpumesh_protocol::changes::Base;
use gpumesh_protocol::{ActorCall, BlobId, BufferChanges, ShardChanges, StateBuffer};
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

/// The calls waiting for one actor hosted here (the oldest, at most [`MAX_BATCH`]),
/// with what running them needs.
struct Turn {
    name: String,
    /// The sequence number of the first; the others follow it one by one.
    first: u64,
    epoch: u32,
    /// Each call and the peer id of the node it came through.
    calls: Vec<(ActorCall, String)>,
    state: Vec<ActorState>,
    backup: Option<u64>,
    creator: String,
}

/// Calls of one actor run back to back and reported in one entry, at most: the
/// state is stored and copied once for all of them.
const MAX_BATCH: usize = 16;

/// Why a call of a batch did not run.
enum CallError {
    /// It cannot: its failure is its result, and the state stays as it was.
    Failed(String),
    /// Not now (this node could not finish it): it and the calls after it wait for
    /// the next turn.
    NotYet,
}

/// What one call that ran left: the state's bytes after it, by binding (in the
/// actor's order), and its own outputs.
struct Ran {
    state: Vec<Vec<u8>>,
    outputs: Vec<(u32, Vec<u8>)>,
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
        let (name, seq) = (turn.name.clone(), turn.first);
        let Some(report) = self.take(turn).await else {
            tokio::time::sleep(RETRY).await;
            return None;
        };
        let state = match &report {
            Command::ActorCallsDone { state, ran, .. }
                if ran.iter().any(|r| matches!(r, CallRan::Done { .. })) =>
            {
                Some(state.iter().map(|(_, b)| *b).collect())
            }
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

    /// The waiting calls of every actor hosted here under its current epoch.
    fn turns(&self) -> Vec<Turn> {
        let me = self.me;
        self.consensus.read_local(move |s| {
            s.actors()
                .values()
                .filter(|a| a.host == Some(me))
                .filter_map(|a| {
                    let (first, _) = a.next_call()?;
                    let calls = (first..)
                        .map_while(|seq| a.pending.get(&seq))
                        .take(MAX_BATCH)
                        .map(|p| (p.call.clone(), p.caller.clone()))
                        .collect();
                    Some(Turn {
                        name: a.name.clone(),
                        first,
                        epoch: a.epoch,
                        calls,
                        state: a.state.clone(),
                        backup: a.backup,
                        creator: a.creator.clone(),
                    })
                })
                .collect()
        })
    }

    /// Runs a turn's calls one after another, each on the state the one before left;
    /// keeps the final state here and on a second node and the outputs on two nodes;
    /// returns the report of the calls that ran (`None` when the first cannot run
    /// yet).
    async fn take(&self, t: Turn) -> Option<Command> {
        // The state's bytes, from the node that keeps its copy or its creator; the
        // calls' inputs, from the nodes they came through.
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
        let mut calls = Vec::new();
        for (seq, (call, caller)) in (t.first..).zip(t.calls) {
            let from: Option<PeerId> = caller.parse().ok();
            let mut reachable = true;
            for blob in call.bindings.iter().filter_map(|b| b.role.blob()) {
                if let Err(e) = self.blobs.fetch(blob, from).await {
                    tracing::warn!(actor = %t.name, seq, error = %e, "a call input is not reachable yet");
                    reachable = false;
                    break;
                }
            }
            if !reachable {
                break; // it and the calls after it wait
            }
            calls.push((call, from));
        }
        if calls.is_empty() {
            return None;
        }
        let store = self.blobs.store().clone();
        let base: Vec<Option<Arc<[u8]>>> = t
            .state
            .iter()
            .map(|s| {
                s.blob
                    .and_then(|b| store.get(&b).ok().flatten().map(Arc::from))
            })
            .collect();
        if t.state
            .iter()
            .zip(&base)
            .any(|(s, b)| s.blob.is_some() && b.is_none())
        {
            return None; // fetched above, gone since: the next turn fetches it again
        }
        // Each call starts from what the one before left.
        let mut now: Vec<(StateBuffer, Option<BlobId>)> =
            t.state.iter().map(|s| (s.buffer, s.blob)).collect();
        let mut latest: HashMap<BlobId, Arc<[u8]>> = HashMap::new();
        let mut ran = Vec::new();
        let mut outputs: Vec<Vec<(u32, Vec<u8>)>> = Vec::new();
        for (call, _) in &calls {
            match self.run_call(call, &now, &latest).await {
                Ok(r) => {
                    latest.clear();
                    for ((_, blob), bytes) in now.iter_mut().zip(r.state) {
                        let id = BlobId::of(&bytes);
                        *blob = Some(id);
                        latest.insert(id, Arc::from(bytes));
                    }
                    ran.push(CallRan::Done {
                        outputs: Vec::new(),
                    });
                    outputs.push(r.outputs);
                }
                Err(CallError::Failed(reason)) => {
                    ran.push(CallRan::Failed { reason });
                    outputs.push(Vec::new());
                }
                Err(CallError::NotYet) => break,
            }
        }
        if ran.is_empty() {
            return None;
        }
        let changed = ran.iter().any(|r| matches!(r, CallRan::Done { .. }));
        let mut backup = t.backup.unwrap_or(self.me);
        if changed {
            backup = self
                .keep_state(&t.name, t.backup, &t.state, &base, &now, &latest)
                .await?;
        }
        // Each call's outputs, on two nodes (one the node it came through).
        for ((r, outs), (_, caller)) in ran.iter_mut().zip(outputs).zip(&calls) {
            let CallRan::Done { outputs } = r else {
                continue;
            };
            for (binding, bytes) in outs {
                let size = bytes.len() as u64;
                match self.blobs.put_and_copy(bytes, *caller).await {
                    Ok(blob) => outputs.push(MergedOutput {
                        binding,
                        blob,
                        size,
                        node: self.me,
                    }),
                    Err(e) => {
                        tracing::warn!(actor = %t.name, error = %e, "could not keep a call's output");
                        return None;
                    }
                }
            }
        }
        Some(Command::ActorCallsDone {
            name: t.name,
            epoch: t.epoch,
            node: self.me,
            first: t.first,
            ran,
            state: now
                .iter()
                .filter_map(|(s, blob)| Some((s.binding, (*blob)?)))
                .collect(),
            backup,
        })
    }

    /// Runs one call on the state `now` (bytes of a state not yet stored are in
    /// `latest`).
    async fn run_call(
        &self,
        call: &ActorCall,
        now: &[(StateBuffer, Option<BlobId>)],
        latest: &HashMap<BlobId, Arc<[u8]>>,
    ) -> Result<Ran, CallError> {
        let spec = call.as_task(now);
        let kernel = self
            .kernels
            .get(&spec.shader, &spec.entry_point)
            .map_err(|e| CallError::Failed(e.to_string()))?;
        let store = self.blobs.store().clone();
        let state_bindings: Vec<u32> = now.iter().map(|(s, _)| s.binding).collect();
        let job = Job::new(spec, kernel, |id| {
            latest
                .get(id)
                .cloned()
                .or_else(|| store.get(id).ok().flatten().map(Arc::from))
        })
        .and_then(|j| j.keep_resident(state_bindings.iter().copied()))
        .map_err(|e| CallError::Failed(e.to_string()))?;
        let deadline = call
            .deadline_ms
            .map_or(self.default_deadline, Duration::from_millis);
        let out = self
            .gpu
            .run(job.clone(), 0, Some(deadline))
            .await
            .map_err(|e| CallError::Failed(e.to_string()))?;
        tokio::task::spawn_blocking(move || {
            let mut merged = job
                .merge(&[&out.changes])
                .map_err(|e| CallError::Failed(e.to_string()))?;
            // The state buffers move out of `merged`; what is left are the outputs.
            let mut state = Vec::with_capacity(state_bindings.len());
            for binding in &state_bindings {
                state.push(merged.remove(binding).ok_or(CallError::NotYet)?);
            }
            Ok(Ran {
                state,
                outputs: merged.into_iter().collect(),
            })
        })
        .await
        .map_err(|_| CallError::NotYet)?
    }

    /// Stores the state a batch left (`now`, bytes in `latest`) here, while the node
    /// that keeps the second copy (`backup` if it can) makes the same from the state
    /// it holds (`old`, bytes `base`) and what changed between the two (only that
    /// travels); returns that node. `None` when either could not be made.
    async fn keep_state(
        &self,
        name: &str,
        backup: Option<u64>,
        old: &[ActorState],
        base: &[Option<Arc<[u8]>>],
        now: &[(StateBuffer, Option<BlobId>)],
        latest: &HashMap<BlobId, Arc<[u8]>>,
    ) -> Option<u64> {
        let mut bytes = Vec::with_capacity(now.len());
        for (_, blob) in now {
            bytes.push(latest.get(&(*blob)?)?.clone());
        }
        let next: Vec<NextState> = old
            .iter()
            .zip(now)
            .filter_map(|(s, (buffer, blob))| {
                Some(NextState {
                    binding: buffer.binding,
                    size: buffer.size,
                    base: s.blob,
                    next: (*blob)?,
                })
            })
            .collect();
        let (base, after) = (base.to_vec(), bytes.clone());
        let bindings: Vec<u32> = now.iter().map(|(s, _)| s.binding).collect();
        let encoded = tokio::task::spawn_blocking(move || {
            let mut changes = std::collections::BTreeMap::new();
            for ((binding, before), after) in bindings.iter().zip(&base).zip(&after) {
                let before = match before {
                    Some(b) => Base::Bytes(b),
                    None => Base::Fill([0; 4]),
                };
                changes.insert(*binding, BufferChanges::diff(before, after));
            }
            ShardChanges(changes).encode()
        })
        .await
        .ok()?;
        // Small changes travel in the request; larger ones as a blob pulled from here.
        let store = self.blobs.store().clone();
        let changes = if encoded.len() <= INLINE_CHANGES {
            Changes::Inline(encoded)
        } else {
            match tokio::task::spawn_blocking(move || store.put(&encoded)).await {
                Ok(Ok(id)) => Changes::Blob(id),
                Ok(Err(e)) => {
                    tracing::warn!(actor = %name, error = %e, "could not store the calls' changes");
                    return None;
                }
                Err(_) => return None,
            }
        };
        let prefer = backup.and_then(|b| self.peers.peer(b));
        let store = self.blobs.store().clone();
        // This node's copy is written while the backup makes its own.
        let own = tokio::task::spawn_blocking(move || {
            bytes.iter().try_for_each(|b| store.put(b).map(|_| ()))
        });
        let (own, copy) = tokio::join!(own, self.blobs.advance(changes, next, prefer));
        match own {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(actor = %name, error = %e, "could not store the actor's new state");
                return None;
            }
            Err(_) => return None,
        }
        match copy {
            Ok(by) => Some(by.map_or(self.me, |p| identity::raft_id(&p))),
            Err(e) => {
                tracing::warn!(actor = %name, error = %e, "no second copy of the actor's state yet");
                None
            }
        }
    }
}
