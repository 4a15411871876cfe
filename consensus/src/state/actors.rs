//! GPU actors in the record: each actor's layout, where its state is now (blobs by
//! version), which node hosts it under which epoch, the calls waiting in log order,
//! and the results of the calls that ran.
//!
//! The log gives every call to an actor one place in one order, whichever node it came
//! through; the host runs them in that order and reports each (`ActorCallDone` /
//! `ActorCallFailed`). Only the oldest waiting call of the current epoch's host is
//! accepted, so a late report from a host the actor has moved away from, or one out
//! of order, changes nothing.
//!
//! Calls may also reach the host directly (`ActorCallsRan`): it runs them and records
//! them with their results in one entry, taking their sequence numbers only then; the
//! record accepts such a batch only on the state it ran on, behind no queued call,
//! and for request ids it has not seen. A small state ([`INLINE_STATE_BYTES`] at
//! most) is held by the record itself, so its calls write and copy no blob.

use gpumesh_protocol::actor::{check_layout, check_name};
use gpumesh_protocol::{ActorCall, BackendKind, BlobId, StateBuffer};

use super::*;
use crate::command::{ActorState, CallRan, RequestId, INLINE_STATE_BYTES};

/// How many results of an actor's calls the record keeps (the newest), so that a
/// retried call learns its result.
pub const REMEMBERED_CALLS: usize = 10_000;

/// The most calls that wait in the record's queue for one actor: beyond them a call
/// is refused (the caller tries again later), so a flood of calls to an actor whose
/// host is away cannot grow the record without bound.
pub const MAX_WAITING_CALLS: usize = 4096;

/// One actor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Actor {
    pub name: String,
    /// Log index of the entry that created it.
    pub created: u64,
    /// Peer id of the node it was created through.
    pub creator: String,
    pub backend: Option<BackendKind>,
    /// The state as of `version`: each buffer's blob (`None`: zeros, never changed).
    pub state: Vec<ActorState>,
    /// Calls that changed nothing or something: one more with every call that ran.
    pub version: u64,
    /// The node it runs on; `None` until the leader places it.
    pub host: Option<u64>,
    /// Placements so far: the host's reports count only under the current one.
    pub epoch: u32,
    /// Moves away from a host that was down or gone.
    pub moves: u32,
    /// The node that keeps the second copy of the state (it holds each call's
    /// changes and makes the new state from the old); none while the record holds
    /// the state itself (`inline`).
    pub backup: Option<u64>,
    /// The state's bytes, buffer by buffer in `state`'s order, when the record holds
    /// them (a state of at most [`INLINE_STATE_BYTES`], once a call changed it);
    /// empty otherwise. Each is the bytes of its buffer's blob id.
    #[serde(with = "gpumesh_protocol::mesh::bytes_list")]
    pub inline: Vec<Vec<u8>>,
    /// The sequence number the next call takes.
    pub next_seq: u64,
    /// Calls waiting to run, by sequence number.
    pub pending: BTreeMap<u64, PendingCall>,
    /// Results of calls that ran (the newest [`REMEMBERED_CALLS`]), by sequence number.
    pub results: BTreeMap<u64, CallResult>,
}

/// The state a batch of calls left: each buffer's blob, the bytes when the record
/// holds them, and the node with the second copy when it does not.
pub(crate) struct After<'a> {
    pub state: &'a [(u32, BlobId)],
    pub inline: &'a [Vec<u8>],
    pub backup: u64,
}

/// A call waiting for its turn on the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingCall {
    pub call: ActorCall,
    /// Peer id of the node the call came through (it holds its input blobs).
    pub caller: String,
    /// Log index of its `CallActor` entry.
    pub index: u64,
}

/// How a call ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CallResult {
    /// It ran: the state is at `version` after it, and its own outputs are these.
    Done {
        version: u64,
        outputs: Vec<MergedOutput>,
        index: u64,
    },
    /// It did not run, or failed: the state is as it was.
    Failed { reason: String, index: u64 },
}

impl Actor {
    /// The layout of its state.
    pub fn layout(&self) -> Vec<StateBuffer> {
        self.state.iter().map(|s| s.buffer).collect()
    }

    /// The bytes of the state buffer at `binding`, when the record holds them.
    pub fn inline_state(&self, binding: u32) -> Option<&[u8]> {
        let i = self
            .state
            .iter()
            .position(|s| s.buffer.binding == binding)?;
        self.inline.get(i).map(Vec::as_slice)
    }

    /// Whether the record holds this actor's state itself once a call changed it.
    pub fn state_is_inline(&self) -> bool {
        self.state.iter().map(|s| s.buffer.size).sum::<u64>() <= INLINE_STATE_BYTES
    }

    /// Why the state a batch reports cannot be this actor's next, if it cannot:
    /// another layout, or inline bytes that are not the buffers' (or for a state too
    /// large to hold inline).
    fn check_after(&self, after: &After) -> Option<String> {
        let name = &self.name;
        let same_layout = after.state.len() == self.state.len()
            && self
                .state
                .iter()
                .zip(after.state)
                .all(|(s, (binding, _))| s.buffer.binding == *binding);
        if !same_layout {
            return Some(format!(
                "actor {name}: the reported state does not match its buffers"
            ));
        }
        if after.inline.is_empty() {
            return None;
        }
        if !self.state_is_inline() {
            return Some(format!(
                "actor {name}: its state is over {INLINE_STATE_BYTES} bytes; the record \
                 does not hold it"
            ));
        }
        let matches = after.inline.len() == self.state.len()
            && self.state.iter().zip(after.state).zip(after.inline).all(
                |((s, (_, blob)), bytes)| {
                    bytes.len() as u64 == s.buffer.size && BlobId::of(bytes) == *blob
                },
            );
        (!matches).then(|| {
            format!("actor {name}: the state's bytes in the entry are not the state reported")
        })
    }

    /// Takes the state a batch left.
    fn advance(&mut self, after: &After) {
        for (s, (_, blob)) in self.state.iter_mut().zip(after.state) {
            s.blob = Some(*blob);
        }
        if after.inline.is_empty() {
            self.inline.clear();
            self.backup = Some(after.backup);
        } else {
            self.inline = after.inline.to_vec();
            self.backup = None;
        }
    }

    /// The call the host runs next, if any.
    pub fn next_call(&self) -> Option<(u64, &PendingCall)> {
        self.pending.iter().next().map(|(seq, c)| (*seq, c))
    }

    /// The result of a call that ran (the state one version on) or failed.
    fn result_of(&mut self, ran: &CallRan, index: u64) -> CallResult {
        match ran {
            CallRan::Done { outputs } => {
                self.version += 1;
                CallResult::Done {
                    version: self.version,
                    outputs: outputs.clone(),
                    index,
                }
            }
            CallRan::Failed { reason } => CallResult::Failed {
                reason: reason.clone(),
                index,
            },
        }
    }

    fn finish(&mut self, seq: u64, result: CallResult) {
        self.pending.remove(&seq);
        self.results.insert(seq, result);
        while self.results.len() > REMEMBERED_CALLS {
            self.results.pop_first();
        }
    }

    /// Why a report of call `seq` by `node` under `epoch` does not count, if it does
    /// not.
    fn stale(&self, seq: u64, epoch: u32, node: u64) -> Option<String> {
        if epoch != self.epoch || self.host != Some(node) {
            return Some(format!(
                "actor {}: a report from node {node:x} under epoch {epoch}; it is hosted by \
                 {} under epoch {}",
                self.name,
                self.host.map_or("nobody".into(), |h| format!("{h:x}")),
                self.epoch
            ));
        }
        match self.next_call() {
            Some((next, _)) if next == seq => None,
            Some((next, _)) => Some(format!(
                "actor {}: call {seq} reported while call {next} is the next to run",
                self.name
            )),
            None => Some(format!("actor {}: no call is waiting", self.name)),
        }
    }
}

impl StateMachine {
    /// Every actor in the record, by name.
    pub fn actors(&self) -> impl DoubleEndedIterator<Item = &Actor> + ExactSizeIterator {
        self.actors.values().map(|a| &**a)
    }

    pub fn actor(&self, name: &str) -> Option<&Actor> {
        self.actors.get(name).map(|a| &**a)
    }

    /// An actor to change; copied first if a copy of the record shares it.
    fn actor_mut(&mut self, name: &str) -> Option<&mut Actor> {
        self.actors.get_mut(name).map(Arc::make_mut)
    }

    /// The actors `node` hosts (`None`: those not placed yet).
    pub fn actors_hosted_by(&self, node: Option<u64>) -> impl Iterator<Item = &Actor> {
        self.by_host
            .get(&node)
            .into_iter()
            .flatten()
            .filter_map(|name| self.actor(name))
    }

    /// Each host named by an actor (`None` for actors not placed yet) and how many
    /// actors name it.
    pub fn actor_hosts(&self) -> impl Iterator<Item = (Option<u64>, usize)> + '_ {
        self.by_host
            .iter()
            .map(|(host, names)| (*host, names.len()))
    }

    /// The actors with calls waiting in the record's queue.
    pub fn actors_with_queued_calls(&self) -> impl Iterator<Item = &Actor> {
        self.queued.iter().filter_map(|name| self.actor(name))
    }

    /// Brings the derived indexes up to date for actor `name`, which had host
    /// `before` (`None`: it did not exist) before the entry just applied.
    pub(super) fn index_actor(&mut self, name: &str, before: Option<Option<u64>>) {
        let now = self
            .actors
            .get(name)
            .map(|a| (a.host, !a.pending.is_empty()));
        if before != now.map(|(host, _)| host) {
            if let Some(host) = before {
                if let Some(names) = self.by_host.get_mut(&host) {
                    names.remove(name);
                    if names.is_empty() {
                        self.by_host.remove(&host);
                    }
                }
            }
            if let Some((host, _)) = now {
                self.by_host
                    .entry(host)
                    .or_default()
                    .insert(name.to_string());
            }
        }
        match now {
            Some((_, true)) if !self.queued.contains(name) => {
                self.queued.insert(name.to_string());
            }
            Some((_, true)) => {}
            _ => {
                self.queued.remove(name);
            }
        }
    }

    pub(super) fn create_actor(
        &mut self,
        index: u64,
        name: &str,
        state: &[ActorState],
        backend: Option<BackendKind>,
        creator: &str,
    ) -> Outcome {
        if let Err(e) = check_name(name) {
            return Outcome::Rejected(e.to_string());
        }
        let layout: Vec<StateBuffer> = state.iter().map(|s| s.buffer).collect();
        if let Err(e) = check_layout(&layout) {
            return Outcome::Rejected(e.to_string());
        }
        if self.actors.contains_key(name) {
            return Outcome::Rejected(format!(
                "an actor named {name} exists; names are unique in the mesh (delete it \
                 first, or pick another name)"
            ));
        }
        self.actors.insert(
            name.to_string(),
            Arc::new(Actor {
                name: name.to_string(),
                created: index,
                creator: creator.to_string(),
                backend,
                state: state.to_vec(),
                version: 0,
                host: None,
                epoch: 0,
                moves: 0,
                backup: None,
                inline: Vec::new(),
                next_seq: 1,
                pending: BTreeMap::new(),
                results: BTreeMap::new(),
            }),
        );
        Outcome::Applied
    }

    pub(super) fn place_actor(&mut self, name: &str, epoch: u32, node: u64) -> Outcome {
        if !self.members.contains_key(&node) {
            return Outcome::Rejected(format!("node {node:x} is not a member"));
        }
        let Some(a) = self.actor_mut(name) else {
            return Outcome::Rejected(format!("no actor named {name}"));
        };
        if epoch != a.epoch {
            return Outcome::Ignored(format!(
                "actor {name} is at epoch {}, not {epoch}: placed already",
                a.epoch
            ));
        }
        if a.host.is_some() {
            a.moves += 1;
        }
        a.host = Some(node);
        a.epoch += 1;
        Outcome::Applied
    }

    pub(super) fn call_actor(
        &mut self,
        index: u64,
        name: &str,
        call: &ActorCall,
        caller: &str,
    ) -> Outcome {
        let Some(a) = self.actor_mut(name) else {
            return Outcome::Rejected(format!("no actor named {name}"));
        };
        if let Err(e) = call.check_shape(&a.layout()) {
            return Outcome::Rejected(e.to_string());
        }
        if a.pending.len() >= MAX_WAITING_CALLS {
            return Outcome::Rejected(format!(
                "actor {name} has {} calls waiting to run, the limit; try again once some \
                 have run",
                a.pending.len()
            ));
        }
        let seq = a.next_seq;
        a.next_seq += 1;
        a.pending.insert(
            seq,
            PendingCall {
                call: call.clone(),
                caller: caller.to_string(),
                index,
            },
        );
        Outcome::CallQueued { seq }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn actor_call_done(
        &mut self,
        index: u64,
        name: &str,
        seq: u64,
        epoch: u32,
        node: u64,
        state: &[(u32, BlobId)],
        backup: u64,
        outputs: &[MergedOutput],
    ) -> Outcome {
        let Some(a) = self.actor_mut(name) else {
            return Outcome::Ignored(format!("no actor named {name} (deleted?)"));
        };
        if let Some(why) = a.stale(seq, epoch, node) {
            return Outcome::Ignored(why);
        }
        let same_layout = state.len() == a.state.len()
            && state
                .iter()
                .all(|(binding, _)| a.state.iter().any(|s| s.buffer.binding == *binding));
        if !same_layout {
            return Outcome::Rejected(format!(
                "actor {name}: the reported state does not match its buffers"
            ));
        }
        for (binding, blob) in state {
            if let Some(s) = a.state.iter_mut().find(|s| s.buffer.binding == *binding) {
                s.blob = Some(*blob);
            }
        }
        a.version += 1;
        a.backup = Some(backup);
        a.inline.clear();
        let version = a.version;
        a.finish(
            seq,
            CallResult::Done {
                version,
                outputs: outputs.to_vec(),
                index,
            },
        );
        Outcome::Applied
    }

    pub(super) fn actor_call_failed(
        &mut self,
        index: u64,
        name: &str,
        seq: u64,
        epoch: u32,
        node: u64,
        reason: &str,
    ) -> Outcome {
        let Some(a) = self.actor_mut(name) else {
            return Outcome::Ignored(format!("no actor named {name} (deleted?)"));
        };
        if let Some(why) = a.stale(seq, epoch, node) {
            return Outcome::Ignored(why);
        }
        a.finish(
            seq,
            CallResult::Failed {
                reason: reason.to_string(),
                index,
            },
        );
        Outcome::Applied
    }

    /// A batch of queued calls the host ran back to back, recorded together.
    pub(super) fn actor_calls_done(
        &mut self,
        index: u64,
        name: &str,
        (epoch, node): (u32, u64),
        (version, first): (u64, u64),
        ran: &[CallRan],
        after: After,
    ) -> Outcome {
        let Some(a) = self.actor_mut(name) else {
            return Outcome::Ignored(format!("no actor named {name} (deleted?)"));
        };
        if let Some(why) = a.stale(first, epoch, node) {
            return Outcome::Ignored(why);
        }
        if version != a.version {
            return Outcome::Ignored(format!(
                "actor {name}: the calls ran on version {version} of the state; it is at {}",
                a.version
            ));
        }
        if ran.is_empty() {
            return Outcome::Rejected(format!("actor {name}: a batch of no calls"));
        }
        if let Some(missing) =
            (first..first + ran.len() as u64).find(|s| !a.pending.contains_key(s))
        {
            return Outcome::Rejected(format!(
                "actor {name}: call {missing} of the batch is not waiting to run"
            ));
        }
        let changed = ran.iter().any(|r| matches!(r, CallRan::Done { .. }));
        if changed {
            if let Some(why) = a.check_after(&after) {
                return Outcome::Rejected(why);
            }
        }
        for (seq, r) in (first..).zip(ran) {
            let result = a.result_of(r, index);
            a.finish(seq, result);
        }
        if changed {
            a.advance(&after);
        }
        Outcome::Applied
    }

    /// A batch of calls sent to the host, run on the state at `version` and recorded
    /// with their results: each takes the next sequence number now.
    pub(super) fn actor_calls_ran(
        &mut self,
        index: u64,
        name: &str,
        (epoch, node): (u32, u64),
        version: u64,
        calls: &[(RequestId, CallRan)],
        after: After,
    ) -> Outcome {
        if let Some((id, _)) = calls
            .iter()
            .find(|(id, _)| self.requests.contains_key(id) || self.task_by_request.contains_key(id))
        {
            return Outcome::Ignored(format!(
                "actor {name}: request {id} was recorded already; the batch would run it twice"
            ));
        }
        let Some(a) = self.actor_mut(name) else {
            return Outcome::Ignored(format!("no actor named {name} (deleted?)"));
        };
        if epoch != a.epoch || a.host != Some(node) {
            return Outcome::Ignored(format!(
                "actor {name}: calls run by node {node:x} under epoch {epoch}; it is hosted \
                 by {} under epoch {}",
                a.host.map_or("nobody".into(), |h| format!("{h:x}")),
                a.epoch
            ));
        }
        if calls.is_empty() {
            return Outcome::Rejected(format!("actor {name}: a batch of no calls"));
        }
        if let Some((seq, _)) = a.next_call() {
            return Outcome::Ignored(format!(
                "actor {name}: queued call {seq} runs before calls sent to the host"
            ));
        }
        if version != a.version {
            return Outcome::Ignored(format!(
                "actor {name}: the calls ran on version {version} of the state; it is at {}",
                a.version
            ));
        }
        let changed = calls.iter().any(|(_, r)| matches!(r, CallRan::Done { .. }));
        if changed {
            if let Some(why) = a.check_after(&after) {
                return Outcome::Rejected(why);
            }
        }
        let mut seqs = Vec::with_capacity(calls.len());
        for (_, r) in calls {
            let seq = a.next_seq;
            a.next_seq += 1;
            let result = a.result_of(r, index);
            a.finish(seq, result);
            seqs.push(seq);
        }
        if changed {
            a.advance(&after);
        }
        for ((id, _), seq) in calls.iter().zip(seqs) {
            self.remember(
                *id,
                Committed {
                    index,
                    outcome: Outcome::CallQueued { seq },
                },
            );
        }
        Outcome::Applied
    }

    pub(super) fn delete_actor(&mut self, name: &str) -> Outcome {
        match self.actors.remove(name) {
            Some(_) => Outcome::Applied,
            None => Outcome::Ignored(format!("no actor named {name}")),
        }
    }
}
